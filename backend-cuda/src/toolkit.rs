//! Where the CUDA toolkit pieces we load at run time live: NVRTC libraries and the headers NVRTC needs.
//!
//! NVRTC itself carries no `cuda_fp16.h` / `cuda_bf16.h` / `cuda_fp8.h`, and users get NVRTC in two
//! ways: a toolkit install (`$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`) or PyPI's wheels
//! (`nvidia-cuda-nvrtc` and `nvidia-cuda-runtime`, unpacked under `site-packages/nvidia/`). This module
//! lists both kinds of places, in the order we trust them, so the NVRTC loader and the include-path
//! builder agree on one search order.
//!
//! The PyPI layouts are `nvidia/cu13/{lib,include}` (CUDA 13 wheels) and
//! `nvidia/cuda_nvrtc/lib` + `nvidia/cuda_runtime/include` (CUDA 12 wheels).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Environment variable naming the NVRTC library to load: either the file itself
/// (`/opt/cuda/lib64/libnvrtc.so.13`) or a directory holding one of the usual names.
pub const NVRTC_LIB_ENV: &str = "MSCCLPP_NVRTC_LIB";

/// NVRTC file names, newest first: we load whichever major version is present.
pub const NVRTC_LIB_NAMES: [&str; 3] = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// Sub-folders of a `site-packages/nvidia` folder holding NVRTC libraries (PyPI wheels).
const PIP_LIB_DIRS: [&str; 3] = ["cu13/lib", "cu12/lib", "cuda_nvrtc/lib"];
/// Sub-folders of a `site-packages/nvidia` folder holding the CUDA runtime headers (PyPI wheels).
const PIP_INCLUDE_DIRS: [&str; 3] = ["cu13/include", "cu12/include", "cuda_runtime/include"];

/// How long we let `python3` take to tell us where its `nvidia` package lives. Only asked when the
/// scan of the usual prefixes found nothing.
const PYTHON_QUERY_TIMEOUT: Duration = Duration::from_secs(10);

/// A `dlopen`/`dlsym` failure as one line: libloading's own text ("dlopen failed") plus the
/// loader's reason (`libcuda.so.1: cannot open shared object file: ...`), which it keeps as source.
pub fn describe_dl_error(e: &libloading::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Toolkit roots from the environment and the conventional install location, in that order.
pub fn toolkit_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            roots.push(PathBuf::from(v));
        }
    }
    roots.push(PathBuf::from("/usr/local/cuda"));
    dedup(roots)
}

/// Folders to look for NVRTC in, before the dynamic loader's own path: `<root>/lib64` of each
/// toolkit root.
pub fn toolkit_lib_dirs() -> Vec<PathBuf> {
    toolkit_roots()
        .into_iter()
        .map(|r| r.join("lib64"))
        .collect()
}

/// NVRTC library folders inside pip-installed `nvidia` packages (searched after the loader path).
pub fn pip_lib_dirs() -> Vec<PathBuf> {
    pip_subdirs(&PIP_LIB_DIRS)
}

/// Include folders that hold `cuda_fp16.h` (and so the bf16/fp8 headers next to it), in search
/// order: `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include`, then pip's
/// `nvidia/cu13/include` or `nvidia/cuda_runtime/include`. Folders without the header are left out so
/// the compiler's `-I` list stays short and meaningful.
pub fn cuda_include_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = toolkit_roots()
        .into_iter()
        .map(|r| r.join("include"))
        .collect();
    dirs.extend(pip_subdirs(&PIP_INCLUDE_DIRS));
    dedup(dirs)
        .into_iter()
        .filter(|d| d.join("cuda_fp16.h").is_file())
        .collect()
}

/// The include folder that belongs to the NVRTC library at `lib`, if there is one with the headers:
/// a toolkit's `lib64/../include` or a wheel's `cu13/lib/../include`. Headers of the same release as
/// the compiler avoid version skew between NVRTC's built-ins and the fp16/bf16/fp8 headers.
pub fn sibling_include_dir(lib: &Path) -> Option<PathBuf> {
    let dir = lib.parent()?.parent()?.join("include");
    dir.join("cuda_fp16.h").is_file().then_some(dir)
}

/// `sub` joined onto every `site-packages/nvidia` folder we know of, keeping the ones that exist.
fn pip_subdirs(subs: &[&str]) -> Vec<PathBuf> {
    nvidia_package_dirs()
        .iter()
        .flat_map(|nv| subs.iter().map(move |s| nv.join(s)))
        .filter(|d| d.is_dir())
        .collect()
}

/// Every `site-packages/nvidia` (or `dist-packages/nvidia`) folder found, computed once per process.
fn nvidia_package_dirs() -> &'static [PathBuf] {
    static DIRS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    DIRS.get_or_init(|| {
        let mut found: Vec<PathBuf> = site_packages_candidates()
            .into_iter()
            .map(|sp| sp.join("nvidia"))
            .filter(|d| d.is_dir())
            .collect();
        if found.is_empty() {
            // Interpreters in unusual prefixes: ask python itself, once, with a deadline.
            if let Some(sp) = ask_python_for_site_packages() {
                let nv = sp.join("nvidia");
                if nv.is_dir() {
                    found.push(nv);
                }
            }
        }
        dedup(found)
    })
}

/// The usual places a Python installation keeps packages: active virtualenv/conda, `PYTHONPATH`,
/// the user site, pyenv versions, and the system prefixes.
fn site_packages_candidates() -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            prefixes.push(PathBuf::from(v));
        }
    }
    let home = std::env::var_os("HOME").map(PathBuf::from);
    if let Some(h) = &home {
        prefixes.push(h.join(".local"));
    }
    if let Some(root) = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| home.as_ref().map(|h| h.join(".pyenv")))
    {
        prefixes.extend(read_dir_sorted(&root.join("versions")));
    }
    prefixes.extend(
        ["/usr/local", "/usr", "/opt/conda"]
            .iter()
            .map(PathBuf::from),
    );

    let mut out: Vec<PathBuf> = Vec::new();
    if let Some(pp) = std::env::var_os("PYTHONPATH") {
        out.extend(std::env::split_paths(&pp));
    }
    for prefix in prefixes {
        for lib in ["lib", "lib64"] {
            for py in read_dir_sorted(&prefix.join(lib)) {
                let is_python = py
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"));
                if is_python {
                    out.push(py.join("site-packages"));
                    out.push(py.join("dist-packages"));
                }
            }
        }
    }
    dedup(out)
}

/// Runs `python3` to print the folder holding the `nvidia` namespace package; `None` on any failure
/// or after [`PYTHON_QUERY_TIMEOUT`].
fn ask_python_for_site_packages() -> Option<PathBuf> {
    let mut child = Command::new("python3")
        .args([
            "-c",
            "import nvidia,os;print(os.path.dirname(list(nvidia.__path__)[0]))",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + PYTHON_QUERY_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => break,
            Ok(Some(_)) | Err(_) => return None,
            Ok(None) if Instant::now() >= deadline => {
                tracing::debug!(
                    "python3 did not answer within {PYTHON_QUERY_TIMEOUT:?}; giving up"
                );
                // Best effort: the child is ours and no longer useful.
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let mut text = String::new();
    use std::io::Read;
    child.stdout.take()?.read_to_string(&mut text).ok()?;
    let line = text.lines().next()?.trim();
    (!line.is_empty()).then(|| PathBuf::from(line))
}

fn read_dir_sorted(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(_) => Vec::new(),
    };
    // Newest versions last in lexical order; reverse so e.g. python3.12 is tried before python3.10.
    v.sort();
    v.reverse();
    v
}

/// Removes later duplicates, keeping the first occurrence's position (search order matters).
fn dedup(v: Vec<PathBuf>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::with_capacity(v.len());
    for p in v {
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dedup_keeps_first_position() {
        let v = vec![
            PathBuf::from("/a"),
            PathBuf::from("/b"),
            PathBuf::from("/a"),
        ];
        assert_eq!(dedup(v), vec![PathBuf::from("/a"), PathBuf::from("/b")]);
    }

    #[test]
    fn toolkit_roots_end_with_usr_local_cuda() {
        assert_eq!(
            toolkit_roots().last(),
            Some(&PathBuf::from("/usr/local/cuda"))
        );
    }

    #[test]
    fn include_dirs_all_have_fp16_header() {
        for d in cuda_include_dirs() {
            assert!(d.join("cuda_fp16.h").is_file(), "{}", d.display());
        }
    }
}
