//! The HIP compile gate: every kernel unit compiles for gfx90a and gfx942, on a machine with no AMD
//! GPU. A broken HIP path fails here.
//!
//! - gfx90a goes through the backend's own hiprtc code path ([`Hiprtc::load`] and
//!   [`Hiprtc::compile`], exactly what `RocmGpu::build_module` calls) with whatever hiprtc is
//!   installed: Debian 12's ROCm 5.2 (hiprtc inside libamdhip64.so.5) in CI. ROCm 5.2 predates
//!   gfx942.
//! - gfx942 goes through clang (`MSCCLPP_HIP_CLANG`, default `clang-19`) the way hiprtc drives it:
//!   `-D__HIPCC_RTC__`, `-nogpuinc`, hiprtc's own runtime header (read from
//!   libhiprtc-builtins.so.5) as a forced include, and our in-memory headers as files. The device
//!   code is compiled to gfx942 ISA (`-S`: every instruction selected, nothing linked, as ROCm
//!   5.2's device libraries have no gfx942 build).
//!
//! Units: every unit of `mscclpp-kernels-cu` (primitives, switch channel, simple all-reduce per
//! type), the native collectives and the PortChannel all-reduce. For gfx942 (the fp8 target)
//! every variant: each type/accumulator pair with each op. For gfx90a each pair with one op,
//! rotating, so every type, accumulator and op is built at a fifth of the time (2 CI cores).
//! NVLS units are CUDA-only (multicast) and not built for HIP.
//!
//! Without the toolchain the tests print why they skip, unless `MSCCLPP_REQUIRE_HIP=1` (CI, set
//! by scripts/hip-env.sh), which turns absence into a failure. Compiled units are remembered in
//! `MSCCLPP_HIP_GATE_CACHE` (a directory; unset: no cache) by a hash of source, headers, options
//! and compiler, so an unchanged unit is not compiled twice.

use mscclpp_collectives::port_allreduce;
use mscclpp_core::ReduceOp;
use mscclpp_kernels_cu::collectives::{self as kc, CollectiveFile, ReduceSpec};
use mscclpp_kernels_cu::{KERNELS, PRIMITIVE_KERNELS};
use mscclpp_rocm::{CompileRequest, Hiprtc};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// One translation unit and the entry points its code object must define.
struct Unit {
    name: String,
    source: String,
    entries: Vec<String>,
}

fn required() -> bool {
    std::env::var("MSCCLPP_REQUIRE_HIP").is_ok_and(|v| v == "1")
}

/// Skips (prints why) or, when the toolchain is required, fails.
fn unavailable(test: &str, why: &str) {
    assert!(
        !required(),
        "{test}: MSCCLPP_REQUIRE_HIP=1 but {why} (run: source scripts/hip-env.sh)"
    );
    eprintln!("skipping {test}: {why}");
}

/// Which reduction ops each (type, accumulator) pair of a reducing file is built with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ops {
    /// Every op for every pair: every variant there is.
    All,
    /// One op per pair, rotating through the ops, so every type, accumulator, op and file is
    /// built while the unit count stays a fifth (the ops differ by one `#define`).
    Rotating,
}

fn ops_for(ops: Ops, pair_index: usize) -> Vec<ReduceOp> {
    match ops {
        Ops::All => ReduceOp::ALL.to_vec(),
        Ops::Rotating => vec![ReduceOp::ALL[pair_index % ReduceOp::ALL.len()]],
    }
}

fn every_unit(ops: Ops) -> Vec<Unit> {
    let mut units = Vec::new();
    for k in KERNELS {
        let entries = match k.name {
            "primitives" => PRIMITIVE_KERNELS.iter().map(|s| s.to_string()).collect(),
            _ => Vec::new(),
        };
        units.push(Unit {
            name: k.name.to_string(),
            source: k.source.to_string(),
            entries,
        });
    }
    for file in CollectiveFile::ALL {
        let entries: Vec<String> = file.entry_points().iter().map(|s| s.to_string()).collect();
        if !file.reduces() {
            units.push(Unit {
                name: kc::unit_name(file, None),
                source: kc::unit_source(file, None).expect("byte-oriented unit"),
                entries,
            });
            continue;
        }
        for (i, (dtype, acc)) in kc::reduce_type_pairs().into_iter().enumerate() {
            for op in ops_for(ops, i) {
                let spec = Some(ReduceSpec { dtype, acc, op });
                units.push(Unit {
                    name: kc::unit_name(file, spec),
                    source: kc::unit_source(file, spec).expect("reducing unit"),
                    entries: entries.clone(),
                });
            }
        }
    }
    for (i, (dtype, acc)) in kc::reduce_type_pairs().into_iter().enumerate() {
        for op in ops_for(ops, i + 2) {
            let spec = ReduceSpec { dtype, acc, op };
            units.push(Unit {
                name: port_allreduce::unit_name(spec),
                source: port_allreduce::unit_source(spec),
                entries: vec![
                    port_allreduce::EXCHANGE_ENTRY.to_string(),
                    port_allreduce::REDUCE_ENTRY.to_string(),
                ],
            });
        }
    }
    units
}

/// The on-disk cache of units already compiled by an identical compiler.
struct Cache(Option<PathBuf>);

impl Cache {
    fn from_env() -> Cache {
        Cache(std::env::var_os("MSCCLPP_HIP_GATE_CACHE").map(PathBuf::from))
    }
    fn key(compiler: &str, arch: &str, unit: &Unit, headers: &[(&str, &str)]) -> String {
        let mut h = Sha256::new();
        for part in [compiler, arch, &unit.name, &unit.source] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        for (n, t) in headers {
            h.update(n.as_bytes());
            h.update(t.as_bytes());
        }
        for e in &unit.entries {
            h.update(e.as_bytes());
        }
        hex::encode(h.finalize())
    }
    fn hit(&self, key: &str) -> bool {
        self.0.as_ref().is_some_and(|d| d.join(key).exists())
    }
    fn record(&self, key: &str) {
        if let Some(d) = &self.0 {
            let _ = std::fs::create_dir_all(d);
            let _ = std::fs::write(d.join(key), b"ok");
        }
    }
}

/// Compiles every unit with `compile` on `workers` threads; returns the failures.
fn compile_all(
    units: &[Unit],
    workers: usize,
    compile: &(dyn Fn(&Unit) -> Result<(), String> + Sync),
) -> Vec<String> {
    let next = Mutex::new(0usize);
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..workers.max(1) {
            s.spawn(|| loop {
                let i = {
                    let mut n = next.lock().unwrap();
                    *n += 1;
                    *n - 1
                };
                let Some(unit) = units.get(i) else { break };
                if let Err(e) = compile(unit) {
                    failures.lock().unwrap().push(format!("{}: {e}", unit.name));
                }
            });
        }
    });
    failures.into_inner().unwrap()
}

/// Compiles at once: `MSCCLPP_HIP_GATE_JOBS`, else one per core.
fn workers() -> usize {
    std::env::var("MSCCLPP_HIP_GATE_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
}

fn missing_entries(unit: &Unit, has: impl Fn(&str) -> bool) -> Result<(), String> {
    let missing: Vec<&String> = unit.entries.iter().filter(|e| !has(e)).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "entry points missing from the code object: {missing:?}"
        ))
    }
}

#[test]
fn every_kernel_unit_compiles_for_gfx90a_through_hiprtc() {
    let test = "every_kernel_unit_compiles_for_gfx90a_through_hiprtc";
    let hiprtc = match Hiprtc::load() {
        Ok(h) => h,
        Err(e) => return unavailable(test, &e.to_string()),
    };
    let compiler = format!("hiprtc {:?} at {}", hiprtc.version(), hiprtc.location());
    eprintln!("{test}: {compiler}");
    let headers = mscclpp_kernels_hip::all_headers();
    let units = every_unit(Ops::Rotating);
    let cache = Cache::from_env();
    let failures = compile_all(&units, workers(), &|unit| {
        let key = Cache::key(&compiler, "gfx90a", unit, &headers);
        if cache.hit(&key) {
            return Ok(());
        }
        let out = hiprtc
            .compile(&CompileRequest {
                name: &unit.name,
                source: &unit.source,
                arch: "gfx90a",
                headers: &headers,
                options: &[],
            })
            .map_err(|e| e.to_string())?;
        if out.image.is_empty() {
            return Err("empty code object".into());
        }
        missing_entries(unit, |e| {
            let sym = format!("{e}\0");
            out.image.windows(sym.len()).any(|w| w == sym.as_bytes())
        })?;
        cache.record(&key);
        Ok(())
    });
    assert!(
        failures.is_empty(),
        "{} of {} units failed for gfx90a:\n{}",
        failures.len(),
        units.len(),
        failures.join("\n\n")
    );
    eprintln!("{test}: {} units", units.len());
}

/// hiprtc's runtime header (the declarations hiprtc puts in front of every program), as ROCm
/// ships it in libhiprtc-builtins.
fn hiprtc_runtime_header() -> Result<Vec<u8>, String> {
    let names = ["libhiprtc-builtins.so.5", "libhiprtc-builtins.so.6"];
    let mut errors = Vec::new();
    for name in names {
        // SAFETY: a data-only library of ROCm's; nothing of it runs except its (empty) init.
        let lib = match unsafe { libloading::Library::new(name) } {
            Ok(l) => l,
            Err(e) => {
                errors.push(format!("{name}: {e}"));
                continue;
            }
        };
        // SAFETY: both symbols are data (a byte array and its length, an unsigned int); a
        // `*const T` symbol is the object's address, read while `lib` is loaded.
        let text = unsafe {
            let size = lib
                .get::<*const u32>(b"__hipRTC_header_size\0")
                .map_err(|e| format!("{name}: {e}"))?;
            let start = lib
                .get::<*const u8>(b"__hipRTC_header\0")
                .map_err(|e| format!("{name}: {e}"))?;
            std::slice::from_raw_parts(*start, **size as usize).to_vec()
        };
        return Ok(text);
    }
    Err(format!(
        "hiprtc's runtime header not found ({})",
        errors.join("; ")
    ))
}

#[test]
fn every_kernel_unit_compiles_for_gfx942_through_clang() {
    let test = "every_kernel_unit_compiles_for_gfx942_through_clang";
    let clang = std::env::var("MSCCLPP_HIP_CLANG").unwrap_or_else(|_| "clang-19".into());
    let version = match Command::new(&clang).arg("--version").output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
        Ok(o) => return unavailable(test, &format!("{clang} --version failed: {o:?}")),
        Err(e) => return unavailable(test, &format!("{clang} not found: {e}")),
    };
    let header = match hiprtc_runtime_header() {
        Ok(h) => h,
        Err(e) => return unavailable(test, &e),
    };
    eprintln!("{test}: {version}");
    let dir = std::env::temp_dir().join(format!("mscclpp-hip-gate-{}", std::process::id()));
    let headers = mscclpp_kernels_hip::all_headers();
    for (name, text) in &headers {
        let path = dir.join("include").join(name);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("include dir");
        std::fs::write(&path, text).expect("header");
    }
    let runtime = dir.join("hiprtc_runtime.h");
    std::fs::write(&runtime, &header).expect("runtime header");
    let units = every_unit(Ops::All);
    let cache = Cache::from_env();
    let failures = compile_all(&units, workers(), &|unit| {
        let key = Cache::key(&version, "gfx942", unit, &headers);
        if cache.hit(&key) {
            return Ok(());
        }
        let src = dir.join(format!("{}.hip", unit.name));
        let asm = dir.join(format!("{}.s", unit.name));
        std::fs::write(&src, &unit.source).map_err(|e| e.to_string())?;
        let out = clang_command(&clang, &dir, &runtime, &src, &asm)
            .output()
            .map_err(|e| format!("{clang}: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        let text = std::fs::read_to_string(&asm).map_err(|e| e.to_string())?;
        missing_entries(unit, |e| text.contains(&format!(".amdhsa_kernel {e}\n")))?;
        let _ = std::fs::remove_file(&src);
        let _ = std::fs::remove_file(&asm);
        cache.record(&key);
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "{} of {} units failed for gfx942:\n{}",
        failures.len(),
        units.len(),
        failures.join("\n\n")
    );
    eprintln!("{test}: {} units", units.len());
}

/// clang driven as hiprtc drives it (the options `Hiprtc::options_for` gives, plus the defines and
/// includes hiprtc adds itself), device code only, to gfx942 assembly.
fn clang_command(clang: &str, dir: &Path, runtime: &Path, src: &Path, asm: &Path) -> Command {
    let mut cmd = Command::new(clang);
    cmd.args(["-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc"])
        .args(["-D__HIPCC_RTC__", "-Wno-pragma-once-outside-header"])
        .args(Hiprtc::options_for(&CompileRequest {
            name: "",
            source: "",
            arch: "gfx942",
            headers: &[],
            options: &[],
        }))
        .arg("-include")
        .arg(runtime)
        .arg("-I")
        .arg(dir.join("include"))
        .arg("-S")
        .arg(src)
        .arg("-o")
        .arg(asm);
    cmd
}

/// The gate has teeth: a unit that does not compile for HIP is reported with the compiler's log.
#[test]
fn a_broken_unit_fails_the_hiprtc_gate() {
    let Ok(hiprtc) = Hiprtc::load() else {
        return unavailable("a_broken_unit_fails_the_hiprtc_gate", "hiprtc is absent");
    };
    let headers = mscclpp_kernels_hip::all_headers();
    let err = hiprtc
        .compile(&CompileRequest {
            name: "broken",
            source: "#include \"mscclpp/common.cuh\"\nextern \"C\" __global__ void k() { undeclared(); }\n",
            arch: "gfx90a",
            headers: &headers,
            options: &[],
        })
        .expect_err("a call to an undeclared function compiled");
    let msg = err.to_string();
    assert!(
        msg.contains("broken for gfx90a") && msg.contains("undeclared"),
        "{msg}"
    );
}
