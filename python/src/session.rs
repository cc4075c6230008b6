//! `CommSession`: a communicator with its default algorithms and point-to-point engine, as the
//! NCCL shim drives it (`mscclpp_collectives::session`), for front ends written in Python (the
//! TorchComms backend, `mscclpp.torchcomms`). A collective is named by its MSCCL++ spelling and
//! runs on the algorithm the default selector picks, exactly as the same call through
//! `libmscclpp_nccl.so` would.

use crate::algorithm::{accum, collective, dtype};
use crate::comm::PyCommunicator;
use crate::to_py;
use mscclpp::core::gpu::Stream;
use mscclpp::core::{Error, ExecuteArgs, ReduceOp};
use mscclpp_collectives::p2p::{P2pKind, P2pOp};
use mscclpp_collectives::session::CommSession;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::Arc;

#[pyclass(frozen, module = "mscclpp", name = "CommSession")]
pub struct PySession {
    inner: Arc<CommSession>,
}

fn session(
    py: Python<'_>,
    communicator: Arc<mscclpp::core::communicator::Communicator>,
) -> PyResult<PySession> {
    let inner = py
        .detach(|| CommSession::new(communicator))
        .map_err(to_py)?;
    Ok(PySession {
        inner: Arc::new(inner),
    })
}

#[pymethods]
impl PySession {
    /// Collective: builds the default algorithms and the point-to-point engine for `comm`.
    #[new]
    fn new(py: Python<'_>, comm: &PyCommunicator) -> PyResult<Self> {
        session(py, comm.inner.clone())
    }

    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    #[getter]
    fn device(&self) -> usize {
        self.inner.communicator().device()
    }

    /// Enqueues `collective` (`allreduce`, `allgather`, `reducescatter`, `broadcast`, `reduce`,
    /// `alltoall`, `gather`, `scatter`) on `stream` over device addresses `input`/`output` of
    /// `input_size`/`output_size` bytes, after this session's previous call whatever stream that
    /// came on. `op` is the runtime's name (`sum`, `prod`, `min`, `max`, `avg`; ignored by
    /// collectives that do not reduce), `root` the root rank of rooted collectives,
    /// `accum_dtype` what fp8 reductions accumulate in (None: the algorithm's choice). Never
    /// waits for the device, so it may run during CUDA-graph capture.
    #[pyo3(signature = (collective, input, output, input_size, output_size, dtype, op = "sum",
                        root = 0, stream = 0, accum_dtype = None))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        collective: &str,
        input: u64,
        output: u64,
        input_size: usize,
        output_size: usize,
        dtype: &str,
        op: &str,
        root: usize,
        stream: u64,
        accum_dtype: Option<&str>,
    ) -> PyResult<()> {
        let collective = self::collective(collective)?;
        if root >= self.inner.size() {
            return Err(PyValueError::new_err(format!(
                "root {root} is not a rank of this communicator (0..{})",
                self.inner.size()
            )));
        }
        let args = ExecuteArgs {
            input,
            output,
            input_bytes: input_size,
            output_bytes: output_size,
            dtype: self::dtype(dtype)?,
            op: op.parse::<ReduceOp>().map_err(to_py)?,
            accum: accum(accum_dtype)?,
            root,
            stream: Stream(stream),
            nblocks: None,
            nthreads: None,
        };
        let session = self.inner.clone();
        py.detach(|| {
            if let Some(e) = session.async_error() {
                return Err(e);
            }
            session.run(collective, &args)
        })
        .map_err(to_py)
    }

    /// Enqueues one group of sends and receives on `stream`, one kernel: `ops` are
    /// `(kind, peer, address, bytes)` with kind `"send"` or `"recv"`. The whole group may be in
    /// flight at once (a rank may send to and receive from the same peers in one group); a send
    /// to this rank is a copy into the group's receive from this rank.
    fn p2p(
        &self,
        py: Python<'_>,
        ops: Vec<(String, usize, u64, usize)>,
        stream: u64,
    ) -> PyResult<()> {
        let (rank, size) = (self.inner.rank(), self.inner.size());
        let ops = ops
            .into_iter()
            .map(|(kind, peer, ptr, bytes)| {
                let kind = match kind.as_str() {
                    "send" => P2pKind::Send,
                    "recv" => P2pKind::Recv,
                    other => {
                        return Err(PyValueError::new_err(format!(
                            "point-to-point kind {other:?} (expected \"send\" or \"recv\")"
                        )))
                    }
                };
                if peer >= size {
                    return Err(PyValueError::new_err(format!(
                        "peer {peer} of rank {rank} is not a rank of this communicator (0..{size})"
                    )));
                }
                Ok(P2pOp {
                    kind,
                    peer,
                    ptr,
                    bytes,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let session = self.inner.clone();
        py.detach(|| {
            if let Some(e) = session.async_error() {
                return Err(e);
            }
            session.run_p2p(&ops, Stream(stream))
        })
        .map_err(to_py)
    }

    /// Collective over this session (every rank calls it): a session over `members` (ranks of
    /// this communicator, in the new one's rank order, this rank among them), built on
    /// `Communicator::split` (no new sockets; it shares this one's health). A rank passing an
    /// empty list takes part and gets None.
    fn split(&self, py: Python<'_>, members: Vec<usize>) -> PyResult<Option<PySession>> {
        let parent = self.inner.communicator().clone();
        let outcome = py.detach(|| parent.split(&members));
        match outcome {
            Ok(sub) => session(py, Arc::new(sub)).map(Some),
            // The one error an empty group expects: the split refuses a list without this rank
            // after taking part in it.
            Err(Error::InvalidArgument(_)) if members.is_empty() => Ok(None),
            Err(e) => Err(to_py(e)),
        }
    }

    /// Aborts the communicator (`Communicator::abort`: sticky, the first reason wins): its
    /// kernels return at entry, device waits give up, and every later call raises `reason`.
    fn abort(&self, reason: &str) {
        self.inner.communicator().abort(reason);
    }

    /// The error left on this session, or None: a send/receive size mismatch (naming rank and
    /// peer), an abort, a dead peer, a device wait that gave up.
    fn async_error(&self) -> Option<String> {
        self.inner.async_error().map(|e| e.to_string())
    }

    /// Why sends and receives cannot run on this communicator, or None.
    fn p2p_unavailable(&self) -> Option<String> {
        self.inner.p2p_unavailable().map(str::to_string)
    }

    /// Raises the error left on this session, if any, as the runtime's exception for it; after
    /// a device wait that gave up it names the peers that no longer answer (a liveness ping of
    /// up to half a second, once).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let session = &self.inner;
        py.detach(|| session.check("this session's work"))
            .map_err(to_py)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySession>()?;
    Ok(())
}
