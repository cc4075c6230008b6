//! `mscclpp._mscclpp`: the native half of the `mscclpp` Python package (distribution `mscclpp-rs`).
//!
//! This layer is thin on purpose: each class wraps one runtime object (`Communicator`,
//! `AlgorithmCollection`, an `Algorithm`, a VMM allocation, a `TuningTable`) and each method is one
//! call into the library with the GIL released around anything that can block (bootstrap, device
//! setup, kernel launches, tuning). The MSCCL++-compatible API the guide's programs use
//! (`CommGroup`, `AlgorithmCollectionBuilder`, `DataType`...) is written in Python on top of it
//! (python/mscclpp/), so the library can change underneath without touching user code.
//!
//! Errors: every library error becomes an `mscclpp.MscclppError` (a `RuntimeError`) carrying the
//! library's message; bad arguments become `ValueError`, bootstrap and device timeouts
//! `TimeoutError`. Nothing here panics on user input.

mod algorithm;
mod buffer;
mod comm;
mod ep;
mod executor;
mod native;
mod session;

use mscclpp::core::gpu::Gpu;
use mscclpp::{Env, Error};
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

pyo3::create_exception!(
    _mscclpp,
    MscclppError,
    pyo3::exceptions::PyRuntimeError,
    "An error reported by the mscclpp-rs runtime; the message is the library's."
);

/// Turns a library error into the Python exception that fits it, keeping the library's message.
pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidArgument(_) | Error::LaunchShape(_) | Error::Env { .. } => {
            pyo3::exceptions::PyValueError::new_err(msg)
        }
        Error::Timeout { .. } | Error::DeviceTimeout(_) => {
            pyo3::exceptions::PyTimeoutError::new_err(msg)
        }
        _ => MscclppError::new_err(msg),
    }
}

pub(crate) fn env() -> PyResult<&'static Env> {
    Env::get().map_err(to_py)
}

/// The GPU backend of this process, chosen once (`MSCCLPP_GPU_BACKEND` or detection) and kept for
/// the life of the process: communicators, buffers and algorithms all hold it, so it must outlive
/// every one of them whatever order the interpreter frees them in at exit.
pub(crate) fn gpu() -> PyResult<Arc<dyn Gpu>> {
    static GPU: Mutex<Option<Arc<dyn Gpu>>> = Mutex::new(None);
    let mut slot = GPU.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(gpu) = slot.as_ref() {
        return Ok(gpu.clone());
    }
    let env = env()?;
    mscclpp::init_logging(env).map_err(to_py)?;
    let gpu: Arc<dyn Gpu> = Arc::new(mscclpp::select_backend(env).map_err(to_py)?);
    *slot = Some(gpu.clone());
    Ok(gpu)
}

/// The device a rank uses when the caller names none: the launcher's local rank modulo the
/// devices visible (several ranks may share one GPU), else device 0.
pub(crate) fn default_device(gpu: &dyn Gpu) -> PyResult<usize> {
    let count = gpu.device_count().map_err(to_py)?;
    if count == 0 {
        return Err(MscclppError::new_err(format!(
            "the {} backend sees no GPU",
            gpu.backend_name()
        )));
    }
    Ok(env()?.launcher.as_ref().map_or(0, |l| l.local_rank % count))
}

/// Whether NVLink multicast may be used here: the hardware supports it and the environment allows
/// it (`MSCCLPP_ENABLE_NVLS=1`, not forced off). False on a machine without a GPU.
#[pyfunction]
fn is_nvls_supported(py: Python<'_>) -> PyResult<bool> {
    let env = env()?;
    if !env.nvls_allowed() {
        return Ok(false);
    }
    let Ok(gpu) = gpu() else { return Ok(false) };
    py.detach(|| {
        let device = gpu.current_device().map_err(to_py)?;
        Ok(gpu
            .properties(device)
            .map(|p| p.supports_multicast)
            .unwrap_or(false))
    })
}

/// The `MSCCLPP_*` (and launcher) variables the runtime recognised, name to value.
#[pyfunction(name = "env")]
fn env_vars() -> PyResult<std::collections::BTreeMap<&'static str, String>> {
    Ok(env()?.recognized.iter().cloned().collect())
}

/// Name of the GPU backend in use (`cuda` or `rocm`); raises when none is usable.
#[pyfunction]
fn backend_name() -> PyResult<&'static str> {
    Ok(gpu()?.backend_name())
}

#[pymodule]
fn _mscclpp(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MscclppError", m.py().get_type::<MscclppError>())?;
    // The workspace's version, which is also the wheel's (maturin reads it from Cargo.toml).
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(is_nvls_supported, m)?)?;
    m.add_function(wrap_pyfunction!(env_vars, m)?)?;
    m.add_function(wrap_pyfunction!(backend_name, m)?)?;
    comm::register(m)?;
    buffer::register(m)?;
    algorithm::register(m)?;
    native::register(m)?;
    executor::register(m)?;
    session::register(m)?;
    ep::register(m)?;
    Ok(())
}
