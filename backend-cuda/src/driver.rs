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
        default_hardware_queues();
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

/// CUDA's own variable for the hardware queues a process's streams share (8 when unset).
pub const HARDWARE_QUEUES_VAR: &str = "CUDA_DEVICE_MAX_CONNECTIONS";

/// The value [`default_hardware_queues`] gives: CUDA's most.
pub const DEFAULT_HARDWARE_QUEUES: &str = "32";

/// Sets `CUDA_DEVICE_MAX_CONNECTIONS=32` when it is unset and libcuda is not loaded in this
/// process yet; returns whether it did.
///
/// CUDA spreads a process's streams over that many hardware queues in creation order. A copy of
/// the Ethernet receiver's (or of the proxy's) whose stream shares a queue with a kernel waiting
/// for that copy waits behind the kernel until the device wait timeout: at 2 simulated hosts x 4
/// ranks on one H100 every run stalled with 8 queues and none with 32 (docs/troubleshooting.md).
/// With 32, two streams share a queue only 32 creations apart.
///
/// CUDA reads the variable when it makes a context, so it is set only while libcuda is not loaded
/// (then no context of the process exists). A user's own value stays (1 is refused where it would
/// hang, [`mscclpp_core::port_channel::shared_queue_hazard`]). Writing the environment races with
/// C code of other threads reading it; this runs before the process's first CUDA work, from the
/// NCCL shim's load-time initialiser or from the first backend constructor.
pub fn default_hardware_queues() -> bool {
    let set = std::env::var_os(HARDWARE_QUEUES_VAR).is_none() && !libcuda_loaded();
    if set {
        std::env::set_var(HARDWARE_QUEUES_VAR, DEFAULT_HARDWARE_QUEUES);
    }
    set
}

/// Whether libcuda is loaded in this process already (by us, a CUDA runtime or another library).
fn libcuda_loaded() -> bool {
    let name = std::ffi::CString::new(LIBCUDA).expect("no NUL in the soname");
    // SAFETY: RTLD_NOLOAD never loads anything; it only looks the library up, matching its
    // soname, and the reference it gives back is dropped at once.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
    if handle.is_null() {
        return false;
    }
    // SAFETY: drops the reference the lookup above took.
    unsafe { libc::dlclose(handle) };
    true
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
