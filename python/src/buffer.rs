//! `RawGpuBuffer`: VMM device memory (MSCCL++'s GpuBuffer: granularity-aligned, shareable, usable
//! as symmetric memory) handed to frameworks through DLPack without a copy.
//!
//! DLPack hand-off: `to_dlpack` returns a capsule named `dltensor` holding a `DLManagedTensor`
//! whose context keeps the allocation alive (an `Arc`), so the memory lives as long as the last of
//! the Python buffer object and any tensor made from it. A consumer renames the capsule
//! `used_dltensor` and calls the deleter when its tensor dies; an unconsumed capsule calls it when
//! the capsule itself is freed. The deleter takes no GIL: it only drops Rust values.

use crate::{default_device, gpu, to_py, MscclppError};
use mscclpp::core::gpu::{Allocation, Gpu, MemoryKind};
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::ffi::{c_void, CStr};
use std::sync::Arc;

/// A device allocation freed when the last owner lets go.
struct OwnedAllocation {
    alloc: Allocation,
    gpu: Arc<dyn Gpu>,
}

impl Drop for OwnedAllocation {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.free(&self.alloc) {
            // Freeing after the driver shut down (interpreter exit) is harmless; say so, go on.
            tracing::warn!(target: "mscclpp::gpu", "freeing a RawGpuBuffer failed: {e}");
        }
    }
}

#[pyclass(frozen, module = "mscclpp", name = "RawGpuBuffer")]
pub struct PyRawGpuBuffer {
    inner: Arc<OwnedAllocation>,
}

// DLPack 0.8 ABI (dlpack.h), the version every framework's `from_dlpack` accepts in a capsule.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// What a DLManagedTensor owns: the allocation and the shape array its DLTensor points into.
struct ManagerContext {
    _owner: Arc<OwnedAllocation>,
    shape: [i64; 1],
}

const DL_CUDA: i32 = 2;
const DL_ROCM: i32 = 10;
const DLTENSOR: &CStr = c"dltensor";

unsafe extern "C" fn dl_deleter(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` and its context were made by `Box::into_raw` in `to_dlpack`, and DLPack
    // calls the deleter exactly once.
    let managed = unsafe { Box::from_raw(managed) };
    drop(unsafe { Box::from_raw(managed.manager_ctx as *mut ManagerContext) });
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // A consumed capsule was renamed `used_dltensor`: its consumer owns the tensor now.
    // SAFETY: called by Python with the capsule being freed, GIL held.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let managed =
                ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()) as *mut DlManagedTensor;
            dl_deleter(managed);
        }
    }
}

/// DLPack type of a `data_type` string: torch's spelling (`torch.float16`, `str(torch.bfloat16)`)
/// or the bare name (`float16`).
fn dl_dtype(data_type: &str) -> PyResult<(DlDataType, usize)> {
    let name = data_type.strip_prefix("torch.").unwrap_or(data_type);
    let (code, bits) = match name {
        "float16" | "half" => (2, 16),
        "float32" | "float" => (2, 32),
        "float64" | "double" => (2, 64),
        "bfloat16" => (4, 16),
        "int8" => (0, 8),
        "int16" | "short" => (0, 16),
        "int32" | "int" => (0, 32),
        "int64" | "long" => (0, 64),
        "uint8" => (1, 8),
        "uint16" => (1, 16),
        "uint32" => (1, 32),
        "uint64" => (1, 64),
        _ => {
            return Err(PyValueError::new_err(format!(
                "RawGpuBuffer.to_dlpack: data type {data_type:?} is not supported (float16, \
                 float32, float64, bfloat16, int8/16/32/64, uint8/16/32/64, with or without \
                 'torch.')"
            )))
        }
    };
    Ok((
        DlDataType {
            code,
            bits,
            lanes: 1,
        },
        bits as usize / 8,
    ))
}

#[pymethods]
impl PyRawGpuBuffer {
    /// `nbytes` of VMM device memory on `device` (default: the launcher's local rank modulo the
    /// visible GPUs, as `Communicator`); zero bytes is an error.
    #[new]
    #[pyo3(signature = (nbytes, device = None))]
    fn new(py: Python<'_>, nbytes: usize, device: Option<usize>) -> PyResult<Self> {
        if nbytes == 0 {
            return Err(PyValueError::new_err("RawGpuBuffer of 0 bytes"));
        }
        let gpu = gpu()?;
        let alloc = py.detach(|| -> PyResult<Allocation> {
            let device = match device {
                Some(d) => d,
                None => default_device(gpu.as_ref())?,
            };
            gpu.set_device(device).map_err(to_py)?;
            gpu.alloc(nbytes, MemoryKind::Vmm).map_err(to_py)
        })?;
        Ok(PyRawGpuBuffer {
            inner: Arc::new(OwnedAllocation { alloc, gpu }),
        })
    }

    /// Bytes asked for.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.alloc.size
    }

    /// The device address, as an int.
    fn data_ptr(&self) -> u64 {
        self.inner.alloc.ptr
    }

    #[getter]
    fn device(&self) -> usize {
        self.inner.alloc.device
    }

    /// Copies `data` to byte `offset` of the buffer and waits (the path without a framework).
    #[pyo3(signature = (data, offset = 0))]
    fn write(&self, py: Python<'_>, data: &[u8], offset: usize) -> PyResult<()> {
        self.check_range(offset, data.len())?;
        let data = data.to_vec();
        let inner = self.inner.clone();
        py.detach(|| {
            inner
                .gpu
                .copy_to_device(inner.alloc.ptr + offset as u64, &data)
        })
        .map_err(to_py)
    }

    /// `nbytes` from byte `offset` of the buffer, after the device work before it completed.
    #[pyo3(signature = (nbytes, offset = 0))]
    fn read(&self, py: Python<'_>, nbytes: usize, offset: usize) -> PyResult<Py<PyBytes>> {
        self.check_range(offset, nbytes)?;
        let inner = self.inner.clone();
        let mut out = vec![0u8; nbytes];
        py.detach(|| {
            inner
                .gpu
                .copy_from_device(&mut out, inner.alloc.ptr + offset as u64)
        })
        .map_err(to_py)?;
        Ok(PyBytes::new(py, &out).unbind())
    }

    /// A DLPack capsule viewing the whole buffer as a 1-D tensor of `data_type` (the buffer size
    /// must be a whole number of elements): `torch.utils.dlpack.from_dlpack(buf.to_dlpack(...))`.
    #[pyo3(signature = (data_type = "torch.uint8"))]
    fn to_dlpack(&self, py: Python<'_>, data_type: &str) -> PyResult<Py<PyAny>> {
        let (dtype, elem) = dl_dtype(data_type)?;
        let bytes = self.inner.alloc.size;
        if bytes % elem != 0 {
            return Err(PyValueError::new_err(format!(
                "RawGpuBuffer of {bytes} bytes is not a whole number of {data_type} elements"
            )));
        }
        let device_type = match self.inner.gpu.backend_name() {
            "rocm" => DL_ROCM,
            _ => DL_CUDA,
        };
        let device_id = i32::try_from(self.inner.alloc.device)
            .map_err(|_| MscclppError::new_err("device index exceeds i32"))?;
        let ctx = Box::into_raw(Box::new(ManagerContext {
            _owner: self.inner.clone(),
            shape: [(bytes / elem) as i64],
        }));
        let managed = Box::into_raw(Box::new(DlManagedTensor {
            dl_tensor: DlTensor {
                data: self.inner.alloc.ptr as *mut c_void,
                device: DlDevice {
                    device_type,
                    device_id,
                },
                ndim: 1,
                dtype,
                // SAFETY: `ctx` is a live Box; the shape array lives as long as the tensor.
                shape: unsafe { (*ctx).shape.as_mut_ptr() },
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: ctx as *mut c_void,
            deleter: Some(dl_deleter),
        }));
        // SAFETY: a valid pointer and a static name; on failure we still own `managed`.
        let capsule = unsafe {
            ffi::PyCapsule_New(
                managed as *mut c_void,
                DLTENSOR.as_ptr(),
                Some(capsule_destructor),
            )
        };
        if capsule.is_null() {
            // SAFETY: the capsule was not made, so nothing else frees `managed`.
            unsafe { dl_deleter(managed) };
            return Err(PyErr::fetch(py));
        }
        // SAFETY: PyCapsule_New returned a new reference.
        Ok(unsafe { Bound::from_owned_ptr(py, capsule) }.unbind())
    }
}

impl PyRawGpuBuffer {
    fn check_range(&self, offset: usize, len: usize) -> PyResult<()> {
        let size = self.inner.alloc.size;
        if offset.checked_add(len).map_or(true, |end| end > size) {
            return Err(PyValueError::new_err(format!(
                "{len} bytes at offset {offset} do not fit the buffer's {size} bytes"
            )));
        }
        Ok(())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRawGpuBuffer>()?;
    Ok(())
}
