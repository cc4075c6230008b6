//! Execution plans (MSCCL++'s JSON format, as its DSL emits them): `ExecutionPlan(path)` parses
//! and validates one plan file, `Executor(comm)` runs plans on a communicator through the GPU
//! interpreter (`mscclpp_executor::algorithm::PlanAlgorithm`).
//!
//! The executor sets a plan up for its communicator on the plan's first run (collective: every
//! rank runs the same plans in the same order, as in MSCCL++) and keeps that set-up, so later runs
//! are one kernel launch each, legal under CUDA-graph capture. An algorithm collection that has
//! plans registered (`AlgorithmCollectionBuilder.add_algorithm_builder`) adds the set-ups of the
//! collection's executor to the runtime's collection, so its selector can pick them.

use crate::algorithm::dtype;
use crate::comm::PyCommunicator;
use crate::to_py;
use mscclpp::core::communicator::Communicator;
use mscclpp::core::gpu::Stream;
use mscclpp::core::{AccumType, Algorithm, ExecuteArgs, ReduceOp};
use mscclpp::{Error, Result};
use mscclpp_executor::algorithm::PlanAlgorithm;
use mscclpp_executor::{Plan, Protocol};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// One execution plan, parsed and validated (MSCCL++'s `ExecutionPlan`).
#[pyclass(frozen, module = "mscclpp", name = "ExecutionPlan")]
pub struct PyExecutionPlan {
    pub(crate) inner: Arc<Plan>,
    path: PathBuf,
}

#[pymethods]
impl PyExecutionPlan {
    /// Loads the plan file at `path`. `rank` (MSCCL++ passes the caller's rank) is only checked
    /// against the plan's world size. A malformed plan raises ValueError naming the file, the
    /// JSON path of the offending value and what is wrong with it.
    #[new]
    #[pyo3(signature = (path, rank = None))]
    fn new(py: Python<'_>, path: PathBuf, rank: Option<usize>) -> PyResult<Self> {
        let fail = |why: String| {
            PyValueError::new_err(format!("execution plan {}: {why}", path.display()))
        };
        if !path.is_file() {
            return Err(fail(
                if path.is_dir() {
                    "is a directory, not a plan file"
                } else {
                    "no such file"
                }
                .into(),
            ));
        }
        let plan = py
            .detach(|| Plan::load(&path))
            .map_err(|e| fail(e.to_string()))?;
        if let Some(rank) = rank.filter(|&r| r >= plan.world_size()) {
            return Err(fail(format!(
                "rank {rank} is not in 0..{}: the plan is written for {} ranks",
                plan.world_size(),
                plan.world_size()
            )));
        }
        Ok(PyExecutionPlan {
            inner: Arc::new(plan),
            path,
        })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }

    /// MSCCL++'s spelling: `allreduce`, `allgather`, `reducescatter`...
    #[getter]
    fn collective(&self) -> &'static str {
        self.inner.collective.name()
    }

    /// `Simple`, `LL`, `LL8` or `LL16`.
    #[getter]
    fn protocol(&self) -> &'static str {
        match self.inner.protocol {
            Protocol::Simple => "Simple",
            Protocol::Ll => "LL",
            Protocol::Ll8 => "LL8",
            Protocol::Ll16 => "LL16",
        }
    }

    #[getter]
    fn inplace(&self) -> bool {
        self.inner.inplace
    }

    /// Smallest input (bytes per rank) the plan is for.
    #[getter]
    fn min_message_size(&self) -> u64 {
        self.inner.min_message_size
    }

    /// Largest input (bytes per rank) the plan is for, as the plan states it (a run may also be
    /// refused where the message would not fit the plan's scratch; the error says so).
    #[getter]
    fn max_message_size(&self) -> u64 {
        self.inner.max_message_size
    }

    /// `(min, max)` input bytes per rank the plan runs with: its own range, capped by the scratch
    /// and staging areas an executor sets it up with (at most 8 MiB per rank). A call outside it
    /// is refused, naming this range.
    #[getter]
    fn runnable_message_size_range(&self) -> (u64, u64) {
        mscclpp_executor::algorithm::runnable_message_range(&self.inner)
    }

    /// Ranks the plan is written for.
    #[getter]
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    #[getter]
    fn num_threads_per_block(&self) -> u32 {
        self.inner.num_threads_per_block
    }

    /// The file the plan was loaded from.
    #[getter]
    fn path(&self) -> String {
        self.path.display().to_string()
    }

    fn __repr__(&self) -> String {
        format!(
            "ExecutionPlan({:?}, {}, {} ranks, {}, {})",
            self.inner.name,
            self.collective(),
            self.world_size(),
            self.protocol(),
            self.path.display()
        )
    }
}

/// A plan as set up on the executor's communicator, under the packet size it runs with.
struct Context {
    plan: Arc<Plan>,
    ll8: bool,
    algorithm: Arc<PlanAlgorithm>,
}

/// Runs execution plans on one communicator (MSCCL++'s `Executor`).
#[pyclass(frozen, module = "mscclpp", name = "NativeExecutor")]
pub struct PyExecutor {
    pub(crate) comm: Arc<Communicator>,
    contexts: Mutex<Vec<Context>>,
}

impl PyExecutor {
    /// The set-up of `plan` (with LL8 packets where `ll8` and the plan says only `LL`), made on
    /// first use. Setting up allocates and synchronises, so it is refused while `stream` is being
    /// captured into a CUDA graph.
    pub(crate) fn context(
        &self,
        plan: &Arc<Plan>,
        ll8: bool,
        stream: u64,
    ) -> Result<Arc<PlanAlgorithm>> {
        let mut contexts = self
            .contexts
            .lock()
            .map_err(|_| Error::Internal("executor context table poisoned".into()))?;
        let ll8 = ll8 && plan.protocol == Protocol::Ll;
        if let Some(c) = contexts
            .iter()
            .find(|c| Arc::ptr_eq(&c.plan, plan) && c.ll8 == ll8)
        {
            return Ok(c.algorithm.clone());
        }
        if self.comm.gpu().is_capturing(Stream(stream))? {
            return Err(Error::Unsupported(format!(
                "plan {} is set up on its first run, which cannot happen while a CUDA graph is \
                 being captured: run it once before capturing",
                plan.name
            )));
        }
        let runs = if ll8 {
            Arc::new(Plan {
                protocol: Protocol::Ll8,
                ..Plan::clone(plan)
            })
        } else {
            plan.clone()
        };
        let algorithm = Arc::new(PlanAlgorithm::new(self.comm.clone(), runs)?);
        contexts.push(Context {
            plan: plan.clone(),
            ll8,
            algorithm: algorithm.clone(),
        });
        Ok(algorithm)
    }
}

#[pymethods]
impl PyExecutor {
    #[new]
    fn new(comm: &PyCommunicator) -> Self {
        PyExecutor {
            comm: comm.inner.clone(),
            contexts: Mutex::new(Vec::new()),
        }
    }

    /// Enqueues `plan` on `stream` over `send_buff`/`recv_buff` (device addresses, sizes in
    /// bytes); `packet_type` (`LL8` or `LL16`) is the packet size of a plan whose protocol is
    /// `LL`. `op` (default: the plan's own) must be the reduction the plan applies. Never waits
    /// for the device. Raises when the communicator was aborted, the device reported an error,
    /// or the call does not fit the plan (the message says how).
    #[pyo3(signature = (rank, send_buff, recv_buff, send_buff_size, recv_buff_size, data_type,
                        plan, stream = 0, packet_type = "LL16", op = None))]
    #[allow(clippy::too_many_arguments)]
    fn execute(
        &self,
        py: Python<'_>,
        rank: usize,
        send_buff: u64,
        recv_buff: u64,
        send_buff_size: usize,
        recv_buff_size: usize,
        data_type: &str,
        plan: &PyExecutionPlan,
        stream: u64,
        packet_type: &str,
        op: Option<&str>,
    ) -> PyResult<()> {
        if rank != self.comm.rank() {
            return Err(PyValueError::new_err(format!(
                "Executor.execute: rank {rank}, but the executor's communicator is rank {}",
                self.comm.rank()
            )));
        }
        let ll8 = match packet_type {
            "LL8" => true,
            "LL16" => false,
            other => {
                return Err(PyValueError::new_err(format!(
                    "packet type {other:?} is not LL8 or LL16"
                )))
            }
        };
        let dtype = dtype(data_type)?;
        let op = op
            .map(|o| o.parse::<ReduceOp>())
            .transpose()
            .map_err(to_py)?;
        let plan = plan.inner.clone();
        py.detach(|| {
            if let Some(e) = self.comm.async_error() {
                return Err(e);
            }
            let algorithm = self.context(&plan, ll8, stream)?;
            algorithm.execute(&ExecuteArgs {
                input: send_buff,
                output: recv_buff,
                input_bytes: send_buff_size,
                output_bytes: recv_buff_size,
                dtype,
                op: op.unwrap_or(algorithm.reduce_op()),
                accum: AccumType::Auto,
                root: 0,
                stream: Stream(stream),
                nblocks: None,
                nthreads: None,
            })
        })
        .map_err(to_py)
    }

    /// Collective: frees every plan's set-up (the next run of a plan sets it up again). Call it
    /// only when no run of this executor is in flight on the device. A set-up whose scratch the
    /// peers map waits for them to unmap it (a bounded barrier), so the GIL is released.
    fn reset(&self, py: Python<'_>) {
        let freed = match self.contexts.lock() {
            Ok(mut contexts) => std::mem::take(&mut *contexts),
            Err(_) => return,
        };
        py.detach(|| drop(freed));
    }
}

/// Parses, validates and proves the plan in `text` (JSON) on the CPU reference interpreter, on
/// random data of every dtype (what `mscclpp-bench plan-check` does for a file). Returns the
/// checker's line; raises ValueError with it when the plan is malformed or computes a wrong
/// result. `ranks`, when given, is the world size the plan must be written for.
#[pyfunction]
#[pyo3(signature = (text, name = "plan", ranks = None))]
fn check_plan(py: Python<'_>, text: &str, name: &str, ranks: Option<usize>) -> PyResult<String> {
    let line = py.detach(|| match Plan::from_json(text.as_bytes()) {
        Ok(plan) => mscclpp_executor::check::check_plan(name, &plan, ranks),
        Err(e) => mscclpp_executor::check::CheckLine {
            text: format!("{name}: FAILED: {e}"),
            ok: false,
        },
    });
    if line.ok {
        Ok(line.text)
    } else {
        Err(PyValueError::new_err(line.text))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(check_plan, m)?)?;
    m.add_class::<PyExecutionPlan>()?;
    m.add_class::<PyExecutor>()?;
    Ok(())
}
