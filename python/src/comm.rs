//! Bootstrap and communicator objects: `TcpBootstrap` (rank discovery over TCP, no GPU needed)
//! and `Communicator` (one rank's GPU, semaphores and shared memory on top of a bootstrap).

use crate::{default_device, env, gpu, to_py};
use mscclpp::core::bootstrap::{Bootstrap, BootstrapConfig, TcpBootstrap, UniqueId};
use mscclpp::core::communicator::Communicator;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Arc;

/// The TCP bootstrap of one rank: how ranks find each other and exchange setup messages.
#[pyclass(frozen, module = "mscclpp", name = "TcpBootstrap")]
pub struct PyBootstrap {
    pub(crate) inner: Arc<TcpBootstrap>,
}

fn config() -> PyResult<BootstrapConfig> {
    Ok(BootstrapConfig::from_env(env()?))
}

#[pymethods]
impl PyBootstrap {
    /// A new job id; rank 0 must create it in its own process and hand its bytes to the others.
    #[staticmethod]
    fn create_unique_id(py: Python<'_>) -> PyResult<Py<PyBytes>> {
        let config = config()?;
        let id = py
            .detach(|| TcpBootstrap::create_unique_id(&config))
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &id.to_bytes()).unbind())
    }

    /// Joins the job `unique_id` (bytes from `create_unique_id`) as `rank` of `size`.
    #[staticmethod]
    fn from_unique_id(
        py: Python<'_>,
        unique_id: &[u8],
        rank: usize,
        size: usize,
    ) -> PyResult<Self> {
        let id = UniqueId::from_bytes(unique_id).map_err(to_py)?;
        let config = config()?;
        let inner = py
            .detach(|| TcpBootstrap::new(rank, size, &id, &config))
            .map_err(to_py)?;
        Ok(PyBootstrap {
            inner: Arc::new(inner),
        })
    }

    /// Joins the job whose root listens at `address` (`ip:port`, `host:port`, `[ipv6]:port`,
    /// optionally `ifname:` first); rank 0 listens there itself.
    #[staticmethod]
    fn from_address(py: Python<'_>, address: &str, rank: usize, size: usize) -> PyResult<Self> {
        let config = config()?;
        let inner = py
            .detach(|| TcpBootstrap::from_address(rank, size, address, &config))
            .map_err(to_py)?;
        Ok(PyBootstrap {
            inner: Arc::new(inner),
        })
    }

    /// Joins the job the environment describes (launcher variables for rank and size,
    /// `MSCCLPP_MASTER_ADDR`/`PORT` or torchrun's `MASTER_ADDR` with `MASTER_PORT + 1`).
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<Self> {
        let env = env()?;
        let inner = py.detach(|| TcpBootstrap::from_env(env)).map_err(to_py)?;
        Ok(PyBootstrap {
            inner: Arc::new(inner),
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.barrier()).map_err(to_py)
    }

    /// Every rank's `data`, indexed by rank.
    fn all_gather(&self, py: Python<'_>, data: Vec<u8>) -> PyResult<Vec<Py<PyBytes>>> {
        let all = py.detach(|| self.inner.all_gather(&data)).map_err(to_py)?;
        Ok(all.iter().map(|d| PyBytes::new(py, d).unbind()).collect())
    }

    /// `root`'s `data` on every rank (ignored elsewhere).
    fn broadcast(&self, py: Python<'_>, root: usize, data: Vec<u8>) -> PyResult<Py<PyBytes>> {
        let out = py
            .detach(|| self.inner.broadcast(root, &data))
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &out).unbind())
    }
}

/// One rank's communicator (MSCCL++'s `Communicator`): what algorithms run on.
#[pyclass(frozen, module = "mscclpp", name = "Communicator")]
pub struct PyCommunicator {
    pub(crate) inner: Arc<Communicator>,
}

#[pymethods]
impl PyCommunicator {
    /// Collective: sets up the communicator over `bootstrap` on `device` (default: the
    /// launcher's local rank modulo the visible GPUs). The GPU backend is chosen first, so a
    /// machine without a usable GPU fails here with the reason, before any peer waits on it.
    #[new]
    #[pyo3(signature = (bootstrap, device = None))]
    fn new(py: Python<'_>, bootstrap: &PyBootstrap, device: Option<usize>) -> PyResult<Self> {
        let gpu = gpu()?;
        let boot: Arc<dyn Bootstrap> = bootstrap.inner.clone();
        let inner = py.detach(|| -> PyResult<Communicator> {
            let device = match device {
                Some(d) => d,
                None => default_device(gpu.as_ref())?,
            };
            Communicator::new(boot, gpu, device).map_err(to_py)
        })?;
        Ok(PyCommunicator {
            inner: Arc::new(inner),
        })
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
        self.inner.device()
    }

    /// Ranks on this rank's host (its NVLink domain), what a selector's request calls
    /// `nranks_per_node`.
    #[getter]
    fn nranks_per_node(&self) -> usize {
        self.inner.topology().local_size(self.inner.rank())
    }

    /// The ranks of each host (simulated hosts, MSCCLPP_HOSTID, count as hosts), hosts in the
    /// order of their first rank.
    #[getter]
    fn host_ranks(&self) -> Vec<Vec<usize>> {
        let topology = self.inner.topology();
        (0..topology.nhosts())
            .map(|h| topology.ranks_on_host(h).to_vec())
            .collect()
    }

    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let boot = self.inner.bootstrap().clone();
        py.detach(|| boot.barrier()).map_err(to_py)
    }

    /// Aborts the communicator (sticky, first reason wins): device waits of its kernels give up
    /// and every later `execute` raises with the reason.
    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }

    /// Collective: MemoryChannels from this rank to every peer over `buffer` (`size` bytes, the
    /// same buffer role on every rank), for a kernel compiled with `compile_native`; the peer's
    /// packets land in `packet_buffer` (0: none).
    #[pyo3(signature = (buffer, size, packet_buffer = 0))]
    fn memory_channels(
        &self,
        py: Python<'_>,
        buffer: u64,
        size: usize,
        packet_buffer: u64,
    ) -> PyResult<crate::native::PyMemoryChannels> {
        crate::native::memory_channels(py, self, buffer, size, packet_buffer)
    }

    /// The error the device or an abort left on this communicator, or None (one host load).
    fn async_error(&self) -> Option<String> {
        self.inner.async_error().map(|e| e.to_string())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBootstrap>()?;
    m.add_class::<PyCommunicator>()?;
    Ok(())
}
