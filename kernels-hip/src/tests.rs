//! CPU checks of the HIP headers: the software FNUZ path is compiled as host C++ (when a C++
//! compiler is present) and compared bit for bit with the Rust reference in `mscclpp_core::fp8`,
//! over all 256 codes and a sweep of floats including every midpoint between neighbouring codes.

use super::*;
use mscclpp_core::fp8::{Fp8Format, E4M3_FNUZ, E5M2_FNUZ};
use std::io::Write;
use std::process::{Command, Stdio};

const HARNESS: &str = r#"
#define MSCCLPP_HIP_DEVICE inline
#include "mscclpp_hip/fp8_fnuz.h"
#include <cstdio>
#include <cstring>
int main() {
  for (int c = 0; c < 256; ++c) {
    float a = mscclpp_hip::fp8_e4m3fnuz_to_float((unsigned char)c);
    float b = mscclpp_hip::fp8_e5m2fnuz_to_float((unsigned char)c);
    unsigned ua, ub; std::memcpy(&ua, &a, 4); std::memcpy(&ub, &b, 4);
    std::printf("d %d %08x %08x\n", c, ua, ub);
  }
  unsigned bits;
  while (std::scanf("%x", &bits) == 1) {
    float x; std::memcpy(&x, &bits, 4);
    std::printf("e %08x %u %u\n", bits, (unsigned)mscclpp_hip::float_to_fp8_e4m3fnuz(x),
                (unsigned)mscclpp_hip::float_to_fp8_e5m2fnuz(x));
  }
  return 0;
}
"#;

fn inputs() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-40,
        -1e-40,
    ];
    let mut x: u32 = 0x2f00_0000;
    while x < 0x4880_0000 {
        v.push(f32::from_bits(x));
        v.push(-f32::from_bits(x));
        x += 0x2_4681;
    }
    for f in [E4M3_FNUZ, E5M2_FNUZ] {
        for c in 0..f.max_code() {
            let mid = (f.decode(c) + f.decode(c + 1)) / 2.0;
            v.push(mid);
            v.push(-mid);
        }
    }
    v
}

fn same(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}

#[test]
fn software_fnuz_matches_the_rust_reference() {
    let dir = std::env::temp_dir().join(format!("mscclpp-kernels-hip-{}", std::process::id()));
    let include = dir.join("mscclpp_hip");
    std::fs::create_dir_all(&include).unwrap();
    for (name, text) in HEADERS {
        std::fs::write(dir.join(name), text).unwrap();
    }
    std::fs::write(dir.join("harness.cpp"), HARNESS).unwrap();
    let exe = dir.join("harness");
    let compiled = Command::new("c++")
        .args(["-std=c++17", "-O1", "-I"])
        .arg(&dir)
        .arg(dir.join("harness.cpp"))
        .arg("-o")
        .arg(&exe)
        .output();
    let compiled = match compiled {
        Ok(out) => out,
        Err(e) => {
            eprintln!("skipping: no host C++ compiler (c++): {e}");
            return;
        }
    };
    assert!(
        compiled.status.success(),
        "{}",
        String::from_utf8_lossy(&compiled.stderr)
    );

    let inputs = inputs();
    let mut child = Command::new(&exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let text: String = inputs
        .iter()
        .map(|x| format!("{:08x}\n", x.to_bits()))
        .collect();
    let writer = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let out = String::from_utf8(out.stdout).unwrap();

    let check = |f: Fp8Format, what: &str, got: u32, x: f32| {
        assert_eq!(
            got,
            u32::from(f.encode(x)),
            "{what} encode {x:e} ({:#010x})",
            x.to_bits()
        );
    };
    let (mut decoded, mut encoded) = (0, 0);
    for line in out.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        match parts.as_slice() {
            ["d", c, a, b] => {
                let c: u8 = c.parse().unwrap();
                let a = f32::from_bits(u32::from_str_radix(a, 16).unwrap());
                let b = f32::from_bits(u32::from_str_radix(b, 16).unwrap());
                assert!(
                    same(a, E4M3_FNUZ.decode(c)),
                    "e4m3fnuz decode {c:#x}: {a} vs {}",
                    E4M3_FNUZ.decode(c)
                );
                assert!(
                    same(b, E5M2_FNUZ.decode(c)),
                    "e5m2fnuz decode {c:#x}: {b} vs {}",
                    E5M2_FNUZ.decode(c)
                );
                decoded += 1;
            }
            ["e", bits, a, b] => {
                let x = f32::from_bits(u32::from_str_radix(bits, 16).unwrap());
                check(E4M3_FNUZ, "e4m3fnuz", a.parse().unwrap(), x);
                check(E5M2_FNUZ, "e5m2fnuz", b.parse().unwrap(), x);
                encoded += 1;
            }
            _ => panic!("unexpected harness output {line:?}"),
        }
    }
    assert_eq!(decoded, 256);
    assert_eq!(encoded, inputs.len());
}

#[test]
fn headers_guard_the_gfx942_builtins() {
    assert!(FP8_FNUZ_H.contains("#if defined(__gfx942__)"));
    assert!(FP8_FNUZ_H.contains("__builtin_amdgcn_cvt_f32_fp8"));
    assert!(FP8_FNUZ_H.contains("__builtin_amdgcn_cvt_pk_fp8_f32"));
    assert!(WAVE64_H.contains("MSCCLPP_WARP_SIZE"));
    assert!(HEADERS
        .iter()
        .all(|(_, text)| text.starts_with("// mscclpp-rs HIP device library")));
}
