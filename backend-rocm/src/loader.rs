//! Finding and opening ROCm's shared libraries at run time.
//!
//! Search order for each library: the bare names (so `LD_LIBRARY_PATH` and the loader cache win, as
//! for any other program), then `$ROCM_PATH/lib`, then `/opt/rocm/lib`. The unversioned name comes
//! first because it is what a ROCm install links to its current version; the versioned names cover
//! runtime-only installs that ship no development symlink.

use mscclpp_core::{Error, Result};
use std::path::PathBuf;

/// Default ROCm install prefix.
pub const DEFAULT_ROCM_PATH: &str = "/opt/rocm";

/// A library that was opened, and where it was found.
pub struct Opened {
    pub lib: libloading::Library,
    /// The path, or the bare name resolved by the dynamic loader.
    pub location: String,
}

/// Every candidate to try for `names`, in search order. `rocm_path` is `$ROCM_PATH` if set.
pub fn candidates(names: &[&str], rocm_path: Option<&str>) -> Vec<String> {
    let mut out: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(root) = rocm_path.filter(|r| !r.is_empty()) {
        dirs.push(PathBuf::from(root).join("lib"));
    }
    let default = PathBuf::from(DEFAULT_ROCM_PATH).join("lib");
    if !dirs.contains(&default) {
        dirs.push(default);
    }
    for dir in dirs {
        for n in names {
            out.push(dir.join(n).display().to_string());
        }
    }
    out
}

/// Opens the first candidate that loads and that `resolve` accepts (it resolves the entry points
/// the caller needs). A library that loads but lacks a symbol (an older ROCm) does not stop the
/// search: a newer one may come later. On failure the error lists every candidate and why each
/// was passed over, so a user sees both where we looked and what was wrong.
pub fn open_first<T>(
    what: &str,
    names: &[&str],
    resolve: impl Fn(&libloading::Library, &str) -> Result<T>,
) -> Result<(Opened, T)> {
    let rocm_path = std::env::var("ROCM_PATH").ok();
    let cands = candidates(names, rocm_path.as_deref());
    open_any(what, &cands, resolve).map_err(|failures| Error::BackendUnavailable {
        backend: "rocm".into(),
        reason: format!(
            "{what} ({}) not found; ROCM_PATH={}; tried: {failures}",
            names.first().copied().unwrap_or_default(),
            rocm_path.as_deref().unwrap_or("(unset)"),
        ),
    })
}

/// Opens exactly `path` (a user's explicit choice), with the same checks as [`open_first`].
pub fn open_path<T>(
    what: &str,
    path: &str,
    resolve: impl Fn(&libloading::Library, &str) -> Result<T>,
) -> Result<(Opened, T)> {
    open_any(what, &[path.to_string()], resolve).map_err(|failure| Error::BackendUnavailable {
        backend: "rocm".into(),
        reason: format!("{what} could not be used: {failure}"),
    })
}

/// The first of `cands` that loads and resolves, or every failure joined with "; ".
fn open_any<T>(
    what: &str,
    cands: &[String],
    resolve: impl Fn(&libloading::Library, &str) -> Result<T>,
) -> std::result::Result<(Opened, T), String> {
    let mut failures = Vec::new();
    for cand in cands {
        // SAFETY: loading a library runs its initialisers; these are ROCm's own libraries, which
        // are designed to be dlopen'ed by language runtimes (PyTorch does the same).
        match unsafe { libloading::Library::new(cand) } {
            Ok(lib) => match resolve(&lib, cand) {
                Ok(api) => {
                    tracing::debug!(target: mscclpp_core::log::target::GPU, "{what}: {cand}");
                    return Ok((
                        Opened {
                            lib,
                            location: cand.clone(),
                        },
                        api,
                    ));
                }
                Err(e) => failures.push(format!("{cand}: {}", reason_of(&e))),
            },
            Err(e) => failures.push(format!("{cand}: {}", with_sources(&e))),
        }
    }
    Err(failures.join("; "))
}

/// The reason inside a `BackendUnavailable` (without its "backend is unavailable" preamble), or
/// the whole message of any other error.
fn reason_of(e: &Error) -> String {
    match e {
        Error::BackendUnavailable { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

/// An error with its chain of causes: libloading's own text is only "dlopen failed"; the
/// loader's message (which file, and why) is in the source.
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        text.push_str(": ");
        text.push_str(&s.to_string());
        cur = s.source();
    }
    text
}

/// Resolves one symbol as a function pointer of type `T`, naming the library and the symbol when
/// it is missing (usually a ROCm version older than we support).
pub fn symbol<T: Copy>(lib: &libloading::Library, location: &str, name: &str) -> Result<T> {
    // SAFETY: every caller names a symbol whose C signature matches `T` (see `sys`).
    match unsafe { lib.get::<T>(name.as_bytes()) } {
        Ok(s) => Ok(*s),
        Err(e) => Err(Error::BackendUnavailable {
            backend: "rocm".into(),
            reason: format!(
                "{location} lacks {name} (ROCm 6 or newer is required): {}",
                with_sources(&e)
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_order_is_names_then_rocm_path_then_opt_rocm() {
        let c = candidates(&["liba.so", "liba.so.6"], Some("/custom/rocm"));
        assert_eq!(
            c,
            vec![
                "liba.so",
                "liba.so.6",
                "/custom/rocm/lib/liba.so",
                "/custom/rocm/lib/liba.so.6",
                "/opt/rocm/lib/liba.so",
                "/opt/rocm/lib/liba.so.6",
            ]
        );
        // ROCM_PATH equal to the default is not searched twice.
        assert_eq!(candidates(&["liba.so"], Some("/opt/rocm")).len(), 2);
        assert_eq!(candidates(&["liba.so"], None).len(), 2);
    }

    #[test]
    fn absent_library_error_lists_every_place() {
        let err = open_first("test library", &["libmscclpp-surely-absent.so"], |_, _| {
            Ok(())
        })
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(err.contains("GPU backend rocm is unavailable"), "{err}");
        assert!(err.contains("libmscclpp-surely-absent.so:"), "{err}");
        assert!(
            err.contains("/opt/rocm/lib/libmscclpp-surely-absent.so"),
            "{err}"
        );
    }
}
