//! The CUDA driver library: the presence probe and `CUresult` checking.
//!
//! cudarc (with `dynamic-loading`) opens libcuda lazily on the first driver call and panics when the
//! library is missing. We therefore `dlopen` `libcuda.so.1` ourselves before any cudarc call and turn
//! absence into [`Error::BackendUnavailable`]. libcuda.so.1 is among the names cudarc tries, so once
//! the probe succeeds cudarc's own load succeeds too.

use cudarc::driver::sys;
use mscclpp_core::{Error, Result};
use std::ffi::CStr;
use std::sync::OnceLock;

/// The driver library's soname: what the NVIDIA driver installs (the unversioned name is a
/// development symlink and may be absent or a stub).
pub const LIBCUDA: &str = "libcuda.so.1";

/// Checks once per process that libcuda can be loaded. Every `CudaGpu` constructor goes through
/// this before touching cudarc.
pub fn probe_libcuda() -> Result<()> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    let outcome = PROBE.get_or_init(|| {
        // SAFETY: loading the driver runs its initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(LIBCUDA) } {
            // Keep it loaded for the life of the process: cudarc resolves symbols from it later and
            // unloading a GPU driver mid-process is never wanted.
            Ok(lib) => {
                std::mem::forget(lib);
                Ok(())
            }
            Err(e) => Err(crate::toolkit::describe_dl_error(&e)),
        }
    });
    outcome
        .clone()
        .map_err(|dlerror| Error::BackendUnavailable {
            backend: "cuda".into(),
            reason: format!("{LIBCUDA} could not be loaded: {dlerror}"),
        })
}

/// The names in `symbols` that libcuda does not export. cudarc panics on its first call of a
/// missing entry point, so optional driver features check theirs here before any call.
pub fn missing_symbols<'a>(symbols: &[&'a str]) -> std::result::Result<Vec<&'a str>, String> {
    // SAFETY: the driver library was already loaded by `probe_libcuda` (every `CudaGpu`
    // constructor runs it first); this only takes another reference to it.
    let lib =
        unsafe { libloading::Library::new(LIBCUDA) }.map_err(|e| format!("{LIBCUDA}: {e}"))?;
    Ok(symbols
        .iter()
        .copied()
        // SAFETY: only looks the symbol up; the pointer is never called through here.
        .filter(|name| unsafe { lib.get::<*const std::ffi::c_void>(name.as_bytes()) }.is_err())
        .collect())
}

/// The driver's description of `r`: "CUDA_ERROR_OUT_OF_MEMORY: out of memory".
pub fn error_message(r: sys::CUresult) -> String {
    let text = |f: unsafe fn(sys::CUresult, *mut *const std::ffi::c_char) -> sys::CUresult| {
        let mut p: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: the driver writes a pointer to a static string, or fails for unknown codes.
        let ok = unsafe { f(r, &mut p) } == sys::CUresult::CUDA_SUCCESS && !p.is_null();
        // SAFETY: non-null, NUL-terminated, static.
        ok.then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    match (text(sys::cuGetErrorName), text(sys::cuGetErrorString)) {
        (Some(name), Some(desc)) => format!("{name}: {desc}"),
        (Some(s), None) | (None, Some(s)) => s,
        (None, None) => "unrecognised CUresult".into(),
    }
}

/// Turns a failed driver call into [`Error::Driver`] naming the call.
pub fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver {
            call,
            code: r as i64,
            message: error_message(r),
        })
    }
}

/// Calls a driver function and checks its result, naming the call after the function:
/// `cu!(cuMemAlloc_v2(&mut p, n))` reports `cuMemAlloc_v2` on failure.
macro_rules! cu {
    ($f:ident($($arg:expr),* $(,)?)) => {
        $crate::driver::check(stringify!($f), cudarc::driver::sys::$f($($arg),*))
    };
}
pub(crate) use cu;
