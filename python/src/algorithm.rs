//! Algorithms: the default collection for a communicator, one algorithm's `execute`, the default
//! selector, and the in-library tuner with its YAML tables. Types cross as strings (`"bf16"`,
//! `"sum"`, `"allreduce"`), parsed by the library's own `FromStr`s, so the Python enums are the
//! only spelling users see and an unknown name raises with the library's list of valid ones.

use crate::comm::PyCommunicator;
use crate::executor::{PyExecutionPlan, PyExecutor};
use crate::{to_py, MscclppError};
use mscclpp::core::algorithm_collection::{AlgorithmCollection, SelectionContext};
use mscclpp::core::gpu::Stream;
use mscclpp::core::tuner::TuningTable;
use mscclpp::core::{
    AccumType, Algorithm, Collective, CommResult, DataType, Error, ExecuteArgs, ReduceOp,
};
use mscclpp_collectives::tune::CandidateGrid;
use mscclpp_executor::load::register_plans;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::Arc;

pub(crate) fn collective(name: &str) -> PyResult<Collective> {
    Collective::from_name(name).ok_or_else(|| {
        let names: Vec<_> = Collective::ALL.iter().map(|c| c.name()).collect();
        PyValueError::new_err(format!(
            "unknown collective {name:?} (expected one of {})",
            names.join(", ")
        ))
    })
}

pub(crate) fn dtype(name: &str) -> PyResult<DataType> {
    name.parse().map_err(to_py)
}

pub(crate) fn accum(name: Option<&str>) -> PyResult<AccumType> {
    Ok(match name {
        None => AccumType::Auto,
        Some(n) => match dtype(n)? {
            DataType::F16 => AccumType::F16,
            DataType::F32 => AccumType::F32,
            other => {
                return Err(PyValueError::new_err(format!(
                    "accumulation type {other} is not supported (float16 or float32)"
                )))
            }
        },
    })
}

/// Zero means "the algorithm's choice", as in MSCCL++.
fn geometry(v: u32) -> Option<u32> {
    (v != 0).then_some(v)
}

/// One algorithm of a collection, bound to the communicator it was built for.
#[pyclass(frozen, module = "mscclpp", name = "NativeAlgorithm")]
pub struct PyAlgorithm {
    inner: Arc<dyn Algorithm>,
}

#[pymethods]
impl PyAlgorithm {
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_string()
    }

    #[getter]
    fn collective(&self) -> &'static str {
        self.inner.collective().name()
    }

    /// Enqueues the collective on `stream` (a raw stream handle, 0 for the default stream) over
    /// device addresses `input`/`output` of `input_size`/`output_size` bytes. Never waits for
    /// the device, so it may run while the stream is being captured into a CUDA graph. Returns
    /// MSCCL++'s CommResult code: 0 when enqueued, 4 (invalid argument) for an `nblocks` /
    /// `nthreads_per_block` this algorithm cannot run with here (nothing enqueued; another shape
    /// may run). Raises for every other failure: bad buffers or sizes, an unsupported type or
    /// op, an aborted communicator, an error the device reported.
    #[pyo3(signature = (comm, input, output, input_size, output_size, dtype, op, stream,
                        nblocks, nthreads_per_block, accum_dtype = None, root = 0))]
    #[allow(clippy::too_many_arguments)]
    fn execute(
        &self,
        py: Python<'_>,
        comm: &PyCommunicator,
        input: u64,
        output: u64,
        input_size: usize,
        output_size: usize,
        dtype: &str,
        op: &str,
        stream: u64,
        nblocks: u32,
        nthreads_per_block: u32,
        accum_dtype: Option<&str>,
        root: usize,
    ) -> PyResult<i32> {
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
            nblocks: geometry(nblocks),
            nthreads: geometry(nthreads_per_block),
        };
        let comm = comm.inner.clone();
        let algo = self.inner.clone();
        let outcome = py.detach(|| {
            if let Some(e) = comm.async_error() {
                return Err(e);
            }
            algo.execute(&args)
        });
        if let Err(e @ Error::LaunchShape(_)) = &outcome {
            tracing::warn!(target: "mscclpp::algo", "{}: {e}", algo.name());
        }
        Ok(CommResult::of_execute(outcome).map_err(to_py)?.code())
    }
}

/// The algorithms built for one communicator and the library's default selector.
#[pyclass(frozen, module = "mscclpp", name = "NativeAlgorithmCollection")]
pub struct PyCollection {
    inner: Arc<AlgorithmCollection>,
    comm: Arc<mscclpp::core::communicator::Communicator>,
}

#[pymethods]
impl PyCollection {
    /// Collective: builds every default (native) algorithm for `comm` (unless `defaults` is
    /// false), each packet algorithm with `scratch_bytes` of its own scratch (NVLS ones only
    /// behind the NVLS gate), and adds `plans` as set up by `executor` (which must be `comm`'s),
    /// with a selector that prefers a plan matching the call's collective, world size and size.
    /// Setting up allocates and synchronises, which would break a CUDA-graph capture in progress
    /// on `stream`: that is refused with an error saying what to do instead.
    #[staticmethod]
    #[pyo3(signature = (comm, scratch_bytes, stream = 0, plans = Vec::new(), executor = None,
                        defaults = true))]
    fn build_default(
        py: Python<'_>,
        comm: &PyCommunicator,
        scratch_bytes: usize,
        stream: u64,
        plans: Vec<PyRef<'_, PyExecutionPlan>>,
        executor: Option<Py<PyExecutor>>,
        defaults: bool,
    ) -> PyResult<Self> {
        let c = comm.inner.clone();
        let plans: Vec<_> = plans.iter().map(|p| p.inner.clone()).collect();
        let executor = match executor {
            Some(e) if Arc::ptr_eq(&e.get().comm, &c) => Some(e),
            Some(_) => {
                return Err(PyValueError::new_err(
                    "the executor belongs to another communicator",
                ))
            }
            None if plans.is_empty() => None,
            None => {
                return Err(PyValueError::new_err(
                    "plans need an executor to set them up",
                ))
            }
        };
        let inner = py.detach(|| -> PyResult<AlgorithmCollection> {
            if c.gpu().is_capturing(Stream(stream)).map_err(to_py)? {
                return Err(MscclppError::new_err(
                    "the default algorithms are set up on their first call, which cannot run \
                     while a CUDA graph is being captured: make one call (or \
                     AlgorithmCollection.native_collection(comm)) before capturing",
                ));
            }
            let builder = AlgorithmCollection::builder();
            let mut builder = if defaults {
                mscclpp_collectives::build_default_algorithms(&c, scratch_bytes, builder)
                    .map_err(to_py)?
            } else {
                builder
            };
            if let Some(executor) = &executor {
                let algos = plans
                    .iter()
                    .map(|p| executor.get().context(p, false, stream))
                    .collect::<mscclpp::Result<Vec<_>>>()
                    .map_err(to_py)?;
                register_plans(&mut builder, &algos).map_err(to_py)?;
            }
            Ok(builder.build())
        })?;
        Ok(PyCollection {
            inner: Arc::new(inner),
            comm: comm.inner.clone(),
        })
    }

    /// Every algorithm, collective by collective, names sorted.
    fn algorithms(&self) -> Vec<PyAlgorithm> {
        let mut out = Vec::new();
        for c in Collective::ALL {
            for name in self.inner.names(c) {
                if let Some(inner) = self.inner.get(c, &name) {
                    out.push(PyAlgorithm { inner });
                }
            }
        }
        out
    }

    /// The default selector's choice for a call, or an error naming the call. `in_place`: the
    /// call's buffers are in place (MSCCL++'s meaning for the collective).
    #[pyo3(signature = (collective, message_size, dtype, stream = 0, symmetric_memory = false, in_place = false))]
    #[allow(clippy::too_many_arguments)] // the Python keyword arguments
    fn select(
        &self,
        py: Python<'_>,
        collective: &str,
        message_size: usize,
        dtype: &str,
        stream: u64,
        symmetric_memory: bool,
        in_place: bool,
    ) -> PyResult<PyAlgorithm> {
        let collective = self::collective(collective)?;
        let dtype = self::dtype(dtype)?;
        let comm = self.comm.clone();
        let collection = self.inner.clone();
        let inner = py
            .detach(|| {
                let gpu = comm.gpu();
                let props = gpu.properties(comm.device())?;
                let env = mscclpp::Env::get()?;
                let ctx = SelectionContext {
                    collective,
                    message_bytes: message_size,
                    dtype,
                    world_size: comm.size(),
                    // Who can map whose memory (MSCCLPP_HOSTID), not how the launcher
                    // grouped the processes: simulated hosts share one launcher node.
                    local_world_size: comm.topology().local_size(comm.rank()),
                    symmetric_memory,
                    capturing: gpu.is_capturing(Stream(stream))?,
                    arch: props.arch.clone(),
                    nvls_allowed: env.nvls_allowed() && props.supports_multicast,
                    in_place,
                    op: None,
                };
                collection.select(&ctx)
            })
            .map_err(to_py)?;
        Ok(PyAlgorithm { inner })
    }

    /// Collective: the in-library tuner (every rank calls it with the same arguments). Grid
    /// search over `algorithms` (default: every one of `collective`) x `nblocks` x
    /// `nthreads_per_block` (0 = the algorithm's default) for each power-of-two size in bytes,
    /// `iters` calls per CUDA graph; returns the table of winners, the same on every rank.
    #[pyo3(signature = (collective, dtype, sizes, algorithms = None, nblocks = vec![0],
                        nthreads_per_block = vec![0], iters = 20))]
    #[allow(clippy::too_many_arguments)]
    fn tune(
        &self,
        py: Python<'_>,
        collective: &str,
        dtype: &str,
        sizes: Vec<usize>,
        algorithms: Option<Vec<String>>,
        nblocks: Vec<u32>,
        nthreads_per_block: Vec<u32>,
        iters: usize,
    ) -> PyResult<PyTuningTable> {
        let collective = self::collective(collective)?;
        let dtype = self::dtype(dtype)?;
        let grid = CandidateGrid {
            algorithms: algorithms.unwrap_or_else(|| self.inner.names(collective)),
            nblocks: nblocks.into_iter().map(geometry).collect(),
            nthreads: nthreads_per_block.into_iter().map(geometry).collect(),
        };
        let (comm, collection) = (self.comm.clone(), self.inner.clone());
        let table = py
            .detach(|| {
                mscclpp_collectives::tune::tune(
                    &comm,
                    &collection,
                    collective,
                    dtype,
                    &sizes,
                    &grid,
                    iters,
                )
            })
            .map_err(to_py)?;
        Ok(PyTuningTable { inner: table })
    }
}

/// Tuning results: the best (algorithm, nblocks, nthreads) per collective, type, world size and
/// power-of-two size; YAML on disk in the library's format.
#[pyclass(module = "mscclpp", name = "TuningTable")]
pub struct PyTuningTable {
    inner: TuningTable,
}

#[pymethods]
impl PyTuningTable {
    #[new]
    fn new() -> Self {
        PyTuningTable {
            inner: TuningTable::new(),
        }
    }

    #[staticmethod]
    fn load_yaml(path: std::path::PathBuf) -> PyResult<Self> {
        Ok(PyTuningTable {
            inner: TuningTable::load_yaml(path).map_err(to_py)?,
        })
    }

    #[staticmethod]
    #[pyo3(signature = (text, source = "<string>"))]
    fn from_yaml(text: &str, source: &str) -> PyResult<Self> {
        Ok(PyTuningTable {
            inner: TuningTable::from_yaml(text, source).map_err(to_py)?,
        })
    }

    fn save_yaml(&self, path: std::path::PathBuf) -> PyResult<()> {
        self.inner.save_yaml(path).map_err(to_py)
    }

    fn to_yaml(&self) -> PyResult<String> {
        self.inner.to_yaml().map_err(to_py)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// `(collective, dtype, world_size, size_bytes, algorithm, nblocks, nthreads, time_us)` per
    /// entry; nblocks/nthreads 0 mean the algorithm's default.
    #[allow(clippy::type_complexity)]
    fn entries(
        &self,
    ) -> Vec<(
        &'static str,
        &'static str,
        usize,
        usize,
        String,
        u32,
        u32,
        f64,
    )> {
        self.inner
            .entries()
            .map(|(c, d, w, bytes, l)| {
                (
                    c.name(),
                    d.name(),
                    w,
                    bytes,
                    l.algorithm.clone(),
                    l.nblocks.unwrap_or(0),
                    l.nthreads.unwrap_or(0),
                    l.time_us,
                )
            })
            .collect()
    }

    /// The tuned launch for a call, or None: `(algorithm, nblocks, nthreads)`.
    fn lookup(
        &self,
        collective: &str,
        dtype: &str,
        world_size: usize,
        message_size: usize,
    ) -> PyResult<Option<(String, u32, u32)>> {
        let (c, d) = (self::collective(collective)?, self::dtype(dtype)?);
        Ok(self.inner.lookup(c, d, world_size, message_size).map(|l| {
            (
                l.algorithm.clone(),
                l.nblocks.unwrap_or(0),
                l.nthreads.unwrap_or(0),
            )
        }))
    }
}

/// `(name, collective)` of every default native algorithm, known before any communicator exists
/// (the NVLS ones are added by the collection only where NVLS is allowed).
#[pyfunction]
fn default_algorithm_names() -> Vec<(&'static str, &'static str)> {
    mscclpp_collectives::NativeKind::ALL
        .iter()
        .map(|k| (k.name(), k.collective().name()))
        .collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(default_algorithm_names, m)?)?;
    m.add(
        "DEFAULT_SCRATCH_BYTES",
        mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
    )?;
    m.add_class::<PyAlgorithm>()?;
    m.add_class::<PyCollection>()?;
    m.add_class::<PyTuningTable>()?;
    Ok(())
}
