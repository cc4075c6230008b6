//! `EpBuffer`: the expert-parallel kernels of `mscclpp_collectives::ep` for `mscclpp.ext.ep`, which
//! passes device addresses and shapes by name (it owns the tensors; this owns the NVLink buffer).

use crate::comm::PyCommunicator;
use crate::to_py;
use mscclpp::core::gpu::Stream;
use mscclpp_collectives::ep::{EpArgs, EpBuffer, EpKernel};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

#[pyclass(frozen, module = "mscclpp", name = "EpBuffer")]
pub struct PyEpBuffer {
    inner: Arc<EpBuffer>,
}

/// Sets the field `name` of `args` to `value`: the tensors' addresses and the call's shape
/// (`EpBuffer::launch` sets the rest); an unknown name or an out-of-range count is a ValueError.
fn set_field(args: &mut EpArgs, name: &str, value: u64) -> PyResult<()> {
    let count = |v: u64| {
        u32::try_from(v)
            .map_err(|_| PyValueError::new_err(format!("EP argument {name}={v} exceeds 32 bits")))
    };
    match name {
        "hidden_bytes" => args.hidden_bytes = value,
        "x" => args.x = value,
        "is_token_in_rank" => args.is_token_in_rank = value,
        "num_tokens_per_rank" => args.num_tokens_per_rank = value,
        "num_tokens_per_expert" => args.num_tokens_per_expert = value,
        "channel_prefix" => args.channel_prefix = value,
        "topk_idx" => args.topk_idx = value,
        "topk_weights" => args.topk_weights = value,
        "rank_prefix" => args.rank_prefix = value,
        "recv_expert_counts" => args.recv_expert_counts = value,
        "recv_x" => args.recv_x = value,
        "recv_src_idx" => args.recv_src_idx = value,
        "recv_topk_idx" => args.recv_topk_idx = value,
        "recv_topk_weights" => args.recv_topk_weights = value,
        "recv_channel_prefix" => args.recv_channel_prefix = value,
        "bias0" => args.bias0 = value,
        "bias1" => args.bias1 = value,
        "combined" => args.combined = value,
        "combined_weights" => args.combined_weights = value,
        "num_tokens" => args.num_tokens = count(value)?,
        "num_topk" => args.num_topk = count(value)?,
        "experts_per_rank" => args.experts_per_rank = count(value)?,
        "expert_alignment" => args.expert_alignment = count(value)?,
        "num_channels" => args.num_channels = count(value)?,
        "ring_slots" => args.ring_slots = count(value)?,
        "chunk" => args.chunk = count(value)?,
        other => {
            return Err(PyValueError::new_err(format!(
                "EP argument {other:?} is not one a caller sets"
            )))
        }
    }
    Ok(())
}

#[pymethods]
impl PyEpBuffer {
    /// Collective: `bytes` of NVLink buffer on every rank of `comm`, mapped by every peer.
    #[new]
    fn new(py: Python<'_>, comm: &PyCommunicator, bytes: usize) -> PyResult<Self> {
        let comm = comm.inner.clone();
        let inner = py.detach(|| EpBuffer::new(&comm, bytes)).map_err(to_py)?;
        Ok(PyEpBuffer {
            inner: Arc::new(inner),
        })
    }

    /// This rank's buffer, a device address.
    #[getter]
    fn local_ptr(&self) -> u64 {
        self.inner.local_ptr()
    }

    /// Enqueues `kernel` (`notify`, `reset`, `dispatch`, `combine`) on `stream` with `fields`
    /// (argument name to device address or count). Never waits for the device.
    fn launch(
        &self,
        py: Python<'_>,
        kernel: &str,
        fields: HashMap<String, u64>,
        stream: u64,
    ) -> PyResult<()> {
        let kernel = EpKernel::parse(kernel).map_err(to_py)?;
        let mut args = EpArgs::default();
        for (name, value) in &fields {
            set_field(&mut args, name, *value)?;
        }
        let inner = self.inner.clone();
        py.detach(|| inner.launch(kernel, args, Stream(stream)))
            .map_err(to_py)
    }

    /// Raises the error a kernel of this communicator left, if any, naming the peers that no
    /// longer answer after a wait that gave up (a liveness ping of up to half a second, once).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| inner.check("the EP kernels")).map_err(to_py)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEpBuffer>()?;
    Ok(())
}
