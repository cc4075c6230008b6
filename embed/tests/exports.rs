//! The embedded library as a host stack's link sees it, on the CPU: `exports.txt` is the shim's
//! `nccl/exports.txt` under the `mscclpp_` prefix plus the C API, every name is declared in its
//! header; the libraries `package.sh` makes from this build export exactly that list (no
//! `nccl*`/`pnccl*` name, no Rust symbol, no name libnccl exports); and `tests/c/stack.c`, a host
//! stack defining its own `ncclAllReduce`, links the static library and passes its CPU checks
//! (init with bad arguments, over its own bootstrap between two processes).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const CRATE: &str = env!("CARGO_MANIFEST_DIR");

fn names(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

fn exports() -> Vec<String> {
    names(&Path::new(CRATE).join("exports.txt"))
}

/// libnccl's names: the shim's exports and their `p` aliases.
fn nccl_names() -> Vec<String> {
    let plain = names(&Path::new(CRATE).join("../nccl/exports.txt"));
    let aliases: Vec<String> = plain.iter().map(|n| format!("p{n}")).collect();
    plain.into_iter().chain(aliases).collect()
}

#[test]
fn the_list_is_the_shims_exports_under_the_prefix_then_the_c_api() {
    let list = exports();
    let prefixed: Vec<String> = names(&Path::new(CRATE).join("../nccl/exports.txt"))
        .iter()
        .map(|n| format!("mscclpp_{n}"))
        .collect();
    assert_eq!(
        list[..prefixed.len()],
        prefixed[..],
        "exports.txt must start with nccl/exports.txt prefixed, in order"
    );
    assert_eq!(
        mscclpp_embed::nccl_abi::EXPORTS,
        prefixed.iter().map(String::as_str).collect::<Vec<_>>(),
        "src/nccl_abi.rs must wrap every export of nccl/exports.txt, in its order"
    );
    let c_api = &list[prefixed.len()..];
    assert!(c_api
        .iter()
        .all(|n| n.starts_with("mscclpp") && !n.starts_with("mscclpp_")));
    let header = |p: &str| std::fs::read_to_string(Path::new(CRATE).join(p)).expect("header");
    let (nccl_h, mscclpp_h) = (
        header("../nccl/include/mscclpp_nccl.h"),
        header("include/mscclpp.h"),
    );
    let undeclared: Vec<&String> = prefixed
        .iter()
        .filter(|n| !nccl_h.contains(&format!(" {n}(")))
        .chain(
            c_api
                .iter()
                .filter(|n| !mscclpp_h.contains(&format!(" {n}("))),
        )
        .collect();
    assert!(
        undeclared.is_empty(),
        "not declared in their header: {undeclared:?}"
    );
}

/// The staticlib cargo built for this test run (in target/<profile>/deps, named by its hash:
/// the newest is this build's).
fn staticlib() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("target/<profile>/deps/<test>");
    std::fs::read_dir(deps)
        .expect("deps")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("libmscclpp_embed-") && name.ends_with(".a")
        })
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .expect("cargo built no libmscclpp_embed staticlib for this test")
}

/// The packaged libraries (`package.sh`), made once per test run.
fn packaged() -> &'static Path {
    static OUT: OnceLock<PathBuf> = OnceLock::new();
    OUT.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("embed-package");
        let status = Command::new("bash")
            .arg(Path::new(CRATE).join("package.sh"))
            .arg(staticlib())
            .arg(&out)
            .status()
            .expect("run package.sh");
        assert!(status.success(), "package.sh failed");
        out
    })
}

/// `nm` lines (`<address> <type> <name>` or `<type> <name>`) of `lib` under `flags`.
fn symbols(lib: &Path, flags: &[&str]) -> Vec<(String, String)> {
    let out = Command::new("nm")
        .args(flags)
        .arg(lib)
        .output()
        .expect("run nm");
    assert!(
        out.status.success(),
        "nm {flags:?} {}: {}",
        lib.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.as_slice() {
                [_, t, name] | [t, name] if t.len() == 1 => Some((t.to_string(), name.to_string())),
                _ => None,
            }
        })
        .collect()
}

fn has_tools() -> bool {
    ["nm", "ld", "objcopy", "ar", "cc"].iter().all(|t| {
        Command::new(t)
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    })
}

#[test]
fn packaged_libraries_export_exactly_the_list_and_nothing_of_nccl_or_rust() {
    if !has_tools() {
        eprintln!("skipping: nm, ld, objcopy, ar or cc missing");
        return;
    }
    let want: BTreeSet<String> = exports().into_iter().collect();
    let nccl: BTreeSet<String> = nccl_names().into_iter().collect();
    let lib = packaged().join("lib");
    for (file, flags) in [
        ("libmscclpp_embed.a", &["-g", "--defined-only"][..]),
        ("libmscclpp_embed.so", &["-D", "--defined-only"][..]),
    ] {
        let path = lib.join(file);
        let got: BTreeSet<String> = symbols(&path, flags).into_iter().map(|(_, n)| n).collect();
        let rust: Vec<&String> = got
            .iter()
            .filter(|n| n.starts_with("_ZN") || n.starts_with("_R") || n.contains("rust"))
            .collect();
        assert!(
            rust.is_empty(),
            "{file} exports Rust symbols: {:?}",
            &rust[..rust.len().min(10)]
        );
        let unprefixed: Vec<&String> = got
            .iter()
            .filter(|n| n.starts_with("nccl") || n.starts_with("pnccl"))
            .collect();
        assert!(
            unprefixed.is_empty(),
            "{file} exports NCCL's own names: {unprefixed:?}"
        );
        let clash: Vec<&String> = got.intersection(&nccl).collect();
        assert!(
            clash.is_empty(),
            "{file} exports names libnccl has: {clash:?}"
        );
        assert_eq!(
            got.difference(&want).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "{file} exports names exports.txt lacks"
        );
        assert_eq!(
            want.difference(&got).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "{file} lacks names of exports.txt"
        );
        // Every reference among the library's own objects is resolved inside it: what is left
        // undefined is the C and unwinding runtime's, never one of ours.
        let undefined: Vec<String> = symbols(
            &path,
            &[
                if file.ends_with(".so") { "-D" } else { "-g" },
                "--undefined-only",
            ],
        )
        .into_iter()
        .map(|(_, n)| n)
        .filter(|n| n.contains("nccl") || n.starts_with("mscclpp") || n.starts_with("_ZN"))
        .collect();
        assert!(
            undefined.is_empty(),
            "{file} leaves its own symbols undefined: {undefined:?}"
        );
    }
}

/// Builds `tests/c/stack.c` against the packaged headers and static library into `exe`, with
/// `cflags` before the source and `libs` after the static library.
fn build_stack(exe: &Path, cflags: &[String], libs: &[String]) {
    let pkg = packaged();
    let link_flags = std::fs::read_to_string(pkg.join("link-flags")).expect("link-flags");
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(pkg.join("include"))
        .args(cflags)
        .arg(Path::new(CRATE).join("tests/c/stack.c"))
        .arg(pkg.join("lib/libmscclpp_embed.a"))
        .args(libs)
        .args(link_flags.split_whitespace())
        .arg("-o")
        .arg(exe)
        .status()
        .expect("run cc");
    assert!(status.success(), "building {} failed", exe.display());
}

fn run(exe: &Path, args: &[&str]) -> String {
    let out = Command::new(exe)
        .args(args)
        // A rank that never joins is named within 2 s.
        .env("MSCCLPP_BOOTSTRAP_TIMEOUT", "2")
        .env_remove("LD_PRELOAD")
        .output()
        .expect("run the stack");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(
        out.status.success(),
        "{} {args:?} failed:\n{text}",
        exe.display()
    );
    text
}

#[test]
fn c_stack_links_the_static_library_beside_its_own_nccl_names_and_passes_the_cpu_checks() {
    if !has_tools() {
        eprintln!("skipping: nm, ld, objcopy, ar or cc missing");
        return;
    }
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("embed-stack");
    // The stack defines ncclAllReduce itself: a library exporting that name would not link.
    build_stack(&exe, &[], &[]);
    let text = run(&exe, &["cpu"]);
    assert!(text.contains("PASS: 0 failure(s)"), "{text}");
    assert!(run(&exe, &["gpu", "2"]).contains("skip:"));
}

/// The GPU checks compile and link wherever a complete CUDA runtime's headers and library are
/// under `CUDA_HOME`, and skip with their reason without a GPU. (The PyPI runtime that
/// scripts/nvrtc-env.sh installs lacks crt/host_config.h, which nvidia-cuda-crt has.)
#[test]
fn c_stack_gpu_checks_compile_against_the_cuda_runtime() {
    let Some(cuda) = std::env::var_os("CUDA_HOME").map(PathBuf::from) else {
        eprintln!("skipping: CUDA_HOME is unset (scripts/nvrtc-env.sh sets it)");
        return;
    };
    let runtime = ["lib64", "lib"].iter().find_map(|d| {
        std::fs::read_dir(cuda.join(d))
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("libcudart.so"))
            })
    });
    let headers = ["include/cuda_runtime.h", "include/crt/host_config.h"];
    let complete = headers.iter().all(|h| cuda.join(h).exists());
    let (true, Some(runtime)) = (has_tools() && complete, runtime) else {
        eprintln!(
            "skipping: no complete CUDA runtime ({headers:?}, libcudart) under {}",
            cuda.display()
        );
        return;
    };
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("embed-stack-cuda");
    let lib_dir = runtime.parent().expect("lib dir").display().to_string();
    build_stack(
        &exe,
        &[
            "-DSTACK_CUDA".into(),
            format!("-I{}", cuda.join("include").display()),
        ],
        &[
            runtime.display().to_string(),
            format!("-Wl,-rpath,{lib_dir}"),
        ],
    );
    if Path::new("/dev/nvidia0").exists() {
        eprintln!("a GPU is present: the GPU checks run on the device (embed/tests/c/gpu-run.sh)");
        return;
    }
    let text = run(&exe, &["gpu", "2"]);
    assert!(text.contains("skip: stack gpu: no CUDA device"), "{text}");
}
