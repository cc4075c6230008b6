//! Native customisation without a C++ toolchain: a user's CUDA source, which may include the
//! device library's headers (`mscclpp/memory_channel.cuh`, packets, semaphores), is compiled at
//! run time by the backend's compiler (NVRTC, cached on disk) and its kernels are launched from
//! Python with a grid, a block and arguments. `Communicator.memory_channels` builds the
//! MemoryChannel handles such a kernel takes, in device memory.
//!
//! A launch is as unsafe as any raw CUDA launch (CuPy's RawKernel, ctypes): the arguments must
//! match the kernel's parameters. Each argument is an int (passed as 8 bytes: pointers, size_t,
//! u64) or a bytes object holding the parameter's exact value (`struct.pack("i", rank)`).

use crate::comm::PyCommunicator;
use crate::{default_device, gpu, to_py};
use mscclpp::core::communicator::RegisteredMemory;
use mscclpp::core::gpu::{Allocation, Gpu, LaunchConfig, MemoryKind, Module, Stream};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::ffi::c_void;
use std::sync::Arc;

/// A compiled translation unit, loaded on one device.
#[pyclass(frozen, module = "mscclpp", name = "NativeModule")]
pub struct PyNativeModule {
    gpu: Arc<dyn Gpu>,
    module: Module,
    name: String,
}

/// Compiles `source` (CUDA C++; the device library's headers are on the include path) for the
/// current device's architecture and loads it. Compile errors raise with the compiler's log.
#[pyfunction]
#[pyo3(signature = (name, source, device = None))]
fn compile_native(
    py: Python<'_>,
    name: String,
    source: &str,
    device: Option<usize>,
) -> PyResult<PyNativeModule> {
    let gpu = gpu()?;
    let module = py.detach(|| -> PyResult<Module> {
        let device = match device {
            Some(d) => d,
            None => default_device(gpu.as_ref())?,
        };
        gpu.set_device(device).map_err(to_py)?;
        gpu.build_module(&name, source).map_err(to_py)
    })?;
    Ok(PyNativeModule { gpu, module, name })
}

/// One kernel argument's bytes, in an 8-byte aligned slot the launch can point at.
fn argument(i: usize, value: &Bound<'_, PyAny>) -> PyResult<Box<[u64]>> {
    let bytes: Vec<u8> = if let Ok(v) = value.extract::<u64>() {
        v.to_ne_bytes().to_vec()
    } else if let Ok(b) = value.extract::<Vec<u8>>() {
        b
    } else {
        return Err(PyValueError::new_err(format!(
            "kernel argument {i} must be an int (8 bytes) or bytes (the exact value), not {}",
            value.get_type().name()?
        )));
    };
    if bytes.is_empty() {
        return Err(PyValueError::new_err(format!(
            "kernel argument {i} is empty"
        )));
    }
    let mut slot = vec![0u64; bytes.len().div_ceil(8)].into_boxed_slice();
    // SAFETY: the slot holds at least `bytes.len()` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), slot.as_mut_ptr() as *mut u8, bytes.len())
    };
    Ok(slot)
}

#[pymethods]
impl PyNativeModule {
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Launches `kernel` on `stream` (a raw handle; 0 is the default stream) with `grid` and
    /// `block` (ints or up to 3-tuples) and `args` (see the module docs). Does not wait, so it can
    /// be captured into a CUDA graph.
    #[pyo3(signature = (kernel, grid, block, args, shared_mem = 0, stream = 0))]
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        py: Python<'_>,
        kernel: &str,
        grid: Vec<u32>,
        block: Vec<u32>,
        args: Vec<Bound<'_, PyAny>>,
        shared_mem: u32,
        stream: u64,
    ) -> PyResult<()> {
        let dims = |what: &str, v: &[u32]| -> PyResult<(u32, u32, u32)> {
            match *v {
                [x] => Ok((x, 1, 1)),
                [x, y] => Ok((x, y, 1)),
                [x, y, z] => Ok((x, y, z)),
                _ => Err(PyValueError::new_err(format!(
                    "{what} must have 1 to 3 dimensions"
                ))),
            }
        };
        let config = LaunchConfig {
            grid: dims("grid", &grid)?,
            block: dims("block", &block)?,
            shared_mem_bytes: shared_mem,
            // A user kernel is not known to wait for the previous grid itself (PDL off).
            programmatic: false,
            cached_graph: false,
        };
        let mut slots = args
            .iter()
            .enumerate()
            .map(|(i, a)| argument(i, a))
            .collect::<PyResult<Vec<_>>>()?;
        let gpu = self.gpu.clone();
        let module = self.module;
        py.detach(|| {
            let function = gpu.get_function(module, kernel)?;
            let mut params: Vec<*mut c_void> = slots
                .iter_mut()
                .map(|s| s.as_mut_ptr() as *mut c_void)
                .collect();
            // SAFETY: each parameter points at an owned slot alive for the call; that the values
            // match the kernel's signature is the caller's contract (module docs).
            unsafe { gpu.launch(function, config, Stream(stream), &mut params) }
        })
        .map_err(to_py)
    }
}

/// MemoryChannels from this rank to every peer over one buffer, their handles in device memory
/// (an array of `mscclpp::MemoryChannelHandle`, peers in rank order without this rank).
#[pyclass(frozen, module = "mscclpp", name = "MemoryChannels")]
pub struct PyMemoryChannels {
    gpu: Arc<dyn Gpu>,
    handles: Allocation,
    count: usize,
    /// The peers' buffers mapped here: the handles point into them.
    _peers: Vec<RegisteredMemory>,
}

impl Drop for PyMemoryChannels {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.free(&self.handles) {
            tracing::warn!(target: "mscclpp::gpu", "freeing channel handles failed: {e}");
        }
    }
}

#[pymethods]
impl PyMemoryChannels {
    /// Device address of the handle array (pass it as a kernel argument).
    #[getter]
    fn device_handles(&self) -> u64 {
        self.handles.ptr
    }

    /// Number of channels (peers).
    #[getter]
    fn count(&self) -> usize {
        self.count
    }
}

/// Collective: see `PyCommunicator::memory_channels`.
pub(crate) fn memory_channels(
    py: Python<'_>,
    comm: &PyCommunicator,
    buffer: u64,
    size: usize,
    packet_buffer: u64,
) -> PyResult<PyMemoryChannels> {
    let comm = comm.inner.clone();
    py.detach(|| -> mscclpp::Result<PyMemoryChannels> {
        let local = comm.register_user_buffer(buffer, size)?;
        let all = comm.exchange(local)?;
        let mut handles = Vec::new();
        for (peer, mem) in all.iter().enumerate() {
            if peer == comm.rank() {
                continue;
            }
            let semaphore = comm.d2d_semaphores(peer, 1)?.remove(0);
            handles.push(comm.memory_channel(semaphore, mem, buffer, packet_buffer));
        }
        let bytes = std::mem::size_of_val(handles.as_slice());
        let gpu = comm.gpu().clone();
        let alloc = gpu.alloc(bytes.max(1), MemoryKind::Plain)?;
        // SAFETY: MemoryChannelHandle is a plain #[repr(C)] struct of integers.
        let raw = unsafe { std::slice::from_raw_parts(handles.as_ptr() as *const u8, bytes) };
        if let Err(e) = gpu.copy_to_device(alloc.ptr, raw) {
            let _ = gpu.free(&alloc);
            return Err(e);
        }
        Ok(PyMemoryChannels {
            gpu,
            handles: alloc,
            count: handles.len(),
            _peers: all,
        })
    })
    .map_err(to_py)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(compile_native, m)?)?;
    m.add_class::<PyNativeModule>()?;
    m.add_class::<PyMemoryChannels>()?;
    Ok(())
}
