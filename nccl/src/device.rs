//! The caller's CUDA device: NCCL binds a communicator to the device current on the calling
//! thread (cudaSetDevice), which our backend's own per-thread device does not track. The driver
//! knows it: the runtime makes the device's primary context current, and cuCtxGetDevice reads it.

use libloading::Library;
use std::ffi::c_int;
use std::sync::OnceLock;

type CtxGetDevice = unsafe extern "C" fn(*mut c_int) -> c_int;

static CU_CTX_GET_DEVICE: OnceLock<Option<(Library, CtxGetDevice)>> = OnceLock::new();

fn load() -> Option<(Library, CtxGetDevice)> {
    // SAFETY: libcuda's initialisers are benign; the prototype is the documented one.
    unsafe {
        let lib = Library::new("libcuda.so.1").ok()?;
        let f = *lib.get::<CtxGetDevice>(b"cuCtxGetDevice\0").ok()?;
        Some((lib, f))
    }
}

/// The device of the calling thread's current CUDA context; 0 when no context is current yet
/// (cudaSetDevice was never called, which means device 0 for the runtime as well) or when CUDA
/// is absent (the backend reports that itself, with the reason).
pub fn caller_device() -> usize {
    let Some((_, get)) = CU_CTX_GET_DEVICE.get_or_init(load) else {
        return 0;
    };
    let mut device: c_int = 0;
    // SAFETY: writes one int.
    match unsafe { get(&mut device) } {
        0 if device >= 0 => device as usize,
        _ => 0,
    }
}
