//! The shim as C programs see it, on the CPU: every NCCL 2.28 export of `exports.txt` is present
//! with C linkage (and its `p` alias) and declared in `include/nccl.h`; and `tests/c/abi_check.c`,
//! built with `cc` against our header and linked as `libnccl.so.2`, passes its checks (versions,
//! error strings, unique ids, init with bad arguments, a missing rank named by its timeout, the
//! registry of `include/mscclpp_nccl_registry.h`).

use std::path::{Path, PathBuf};
use std::process::Command;

const CRATE: &str = env!("CARGO_MANIFEST_DIR");

/// The cdylib cargo built for this test run: next to the test binary in target/<profile>/deps/
/// (`cargo test` does not copy it up to target/<profile>/, where an older `cargo build` may have
/// left a stale one).
fn shim_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("target/<profile>/deps/<test>");
    let lib = deps.join("libmscclpp_nccl.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    lib
}

fn exports() -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(CRATE).join("exports.txt")).expect("exports.txt");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

#[test]
fn every_nccl_2_28_export_has_c_linkage_and_a_declaration() {
    let names = exports();
    assert!(
        names.len() >= 40,
        "exports.txt lists only {} names",
        names.len()
    );
    let header = std::fs::read_to_string(Path::new(CRATE).join("include/nccl.h")).expect("nccl.h");
    // SAFETY: loading our own library; its one initialiser only sets a CUDA variable (preload.rs).
    let lib = unsafe { libloading::Library::new(shim_path()) }.expect("load the shim");
    let mut missing = Vec::new();
    for name in &names {
        for symbol in [name.clone(), format!("p{name}")] {
            // SAFETY: only the address is looked up, nothing is called.
            if unsafe { lib.get::<*const ()>(symbol.as_bytes()) }.is_err() {
                missing.push(symbol);
            }
        }
        if !header.contains(&format!(" {name}(")) {
            missing.push(format!("{name} (declaration in nccl.h)"));
        }
    }
    assert!(missing.is_empty(), "missing: {missing:?}");
}

#[test]
fn c_program_against_our_header_passes() {
    let Ok(cc) = which_cc() else {
        eprintln!("skipping: no C compiler (cc) found");
        return;
    };
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nccl-c-abi");
    let (link_dir, run_dir) = (work.join("link"), work.join("run"));
    for d in [&link_dir, &run_dir] {
        std::fs::create_dir_all(d).expect("work dirs");
    }
    let shim = shim_path();
    // Link as -lnccl; run where only libnccl.so.2 exists, so the program loads only if the
    // SONAME recorded at link time is libnccl.so.2.
    for link in [link_dir.join("libnccl.so"), run_dir.join("libnccl.so.2")] {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&shim, &link).expect("symlink");
    }
    let exe = work.join("abi_check");
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(Path::new(CRATE).join("include"))
        .arg(Path::new(CRATE).join("tests/c/abi_check.c"))
        .arg("-L")
        .arg(&link_dir)
        .arg(format!("-Wl,-rpath,{}", run_dir.display()))
        .args(["-lnccl", "-lpthread", "-o"])
        .arg(&exe)
        .status()
        .expect("run cc");
    assert!(status.success(), "cc failed");
    let out = Command::new(&exe)
        // Short timeouts: the missing-rank checks wait for them.
        .env("MSCCLPP_BOOTSTRAP_TIMEOUT", "2")
        .env_remove("MSCCLPP_NCCL_LIB_PATH")
        .env(
            "MSCCLPP_TEST_PLAN",
            Path::new(CRATE).join("../python/tests/golden/dsl/allgather_put_2.json"),
        )
        .env_remove("LD_PRELOAD")
        .output()
        .expect("run abi_check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "abi_check failed:\n{text}");
}

fn which_cc() -> Result<String, ()> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match Command::new(&cc).arg("--version").output() {
        Ok(o) if o.status.success() => Ok(cc),
        _ => Err(()),
    }
}

/// Under `LD_PRELOAD` the shim gives the program CUDA's most hardware queues before its `main`
/// unless the user chose a number (src/preload.rs): a shell started that way sees 32, or its own.
#[test]
fn preloading_gives_32_hardware_queues_unless_set() {
    let queues_seen = |given: Option<&str>| {
        let mut sh = Command::new("sh");
        sh.args(["-c", "echo ${CUDA_DEVICE_MAX_CONNECTIONS:-unset}"])
            .env("LD_PRELOAD", shim_path())
            .env_remove("CUDA_DEVICE_MAX_CONNECTIONS");
        if let Some(v) = given {
            sh.env("CUDA_DEVICE_MAX_CONNECTIONS", v);
        }
        let out = sh.output().expect("run sh");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    assert_eq!(queues_seen(None), "32");
    assert_eq!(queues_seen(Some("8")), "8");
    assert_eq!(queues_seen(Some("1")), "1");
}
