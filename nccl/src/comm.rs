//! One NCCL communicator over mscclpp-rs: the bootstrap, the core communicator, the default
//! native algorithms, and the real NCCL's communicator when a fallback library is configured.

use crate::abi::UniqueId as AbiId;
use crate::fallback::{RawComm, RealNccl};
use crate::guard::{CallResult, Failure};
use crate::watchdog::Watchdog;
use mscclpp::core::algorithm_collection::AlgorithmCollectionBuilder;
use mscclpp::core::bootstrap::{Bootstrap, BootstrapConfig, TcpBootstrap, UniqueId};
use mscclpp::core::communicator::Communicator;
use mscclpp::core::gpu::Stream;
use mscclpp::core::process::Section;
use mscclpp::core::{AccumType, Algorithm, Collective, ExecuteArgs};
use mscclpp::{Env, Gpu, GpuBackend};
use mscclpp_collectives::p2p::P2pOp;
use mscclpp_collectives::session::CommSession;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The process's GPU backend, opened on first use.
pub fn gpu() -> CallResult<Arc<dyn Gpu>> {
    static GPU: OnceLock<Result<Arc<GpuBackend>, Failure>> = OnceLock::new();
    let backend = GPU
        .get_or_init(|| {
            mscclpp::select_backend(env()?)
                .map(Arc::new)
                .map_err(Failure::from)
        })
        .clone()?;
    Ok(backend)
}

/// The process's environment, parsed once; logging starts with it.
pub fn env() -> CallResult<&'static Env> {
    let env = Env::get()?;
    let _ = mscclpp::init_logging(env);
    Ok(env)
}

/// The real NCCL of `MSCCLPP_NCCL_LIB_PATH`, loaded once per process.
fn real_nccl(env: &Env) -> Result<Arc<RealNccl>, String> {
    static REAL: OnceLock<Result<Arc<RealNccl>, String>> = OnceLock::new();
    let path = env
        .nccl_lib_path
        .as_ref()
        .ok_or_else(|| "MSCCLPP_NCCL_LIB_PATH is unset".to_string())?;
    REAL.get_or_init(|| RealNccl::load(path).map(Arc::new))
        .clone()
}

/// The fallback of one communicator: the real NCCL's communicator over the same ranks, or why
/// there is none.
pub enum Fallback {
    Ready { real: Arc<RealNccl>, comm: RawComm },
    Missing(String),
}

/// One rank's communicator.
pub struct Comm {
    pub rank: usize,
    pub nranks: usize,
    pub device: usize,
    pub job: UniqueId,
    pub gpu: Arc<dyn Gpu>,
    /// The default algorithms, the point-to-point engine (ncclSend/ncclRecv natively, or why not:
    /// then they go to the fallback) and the order of calls across streams.
    session: CommSession,
    /// Algorithms loaded after init (the C API's execution plans), found by name beside the
    /// collection's; dropped before the communicator they hold.
    loaded: Mutex<Vec<Arc<dyn Algorithm>>>,
    pub communicator: Arc<Communicator>,
    pub fallback: Fallback,
    /// Lower-case operation names `MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION` sends to the fallback.
    forced: Vec<String>,
    /// What fp8 reductions accumulate in (`MSCCLPP_NCCL_ACCUM_DTYPE`).
    pub accum: AccumType,
    /// Set by [`abort`](Comm::abort): the teardown aborts the real NCCL's communicator instead
    /// of destroying it.
    aborted: AtomicBool,
    /// Whether another thread watches this communicator, so a failure waits for its abort
    /// before a call returns it (`crate::watchdog`).
    pub watchdog: Watchdog,
    /// Taken by the drop: the process's exit waits for the teardown (`mscclpp::core::process`).
    /// Last, so it is released after every other field is dropped.
    exit_section: Mutex<Option<Section<'static>>>,
}

/// Checks NCCL's (nranks, rank) pair.
pub fn check_ranks(nranks: i32, rank: i32) -> CallResult<(usize, usize)> {
    if nranks < 1 {
        return Err(Failure::invalid_argument(format!(
            "nranks is {nranks}; a communicator needs at least 1 rank"
        )));
    }
    if rank < 0 || rank >= nranks {
        return Err(Failure::invalid_argument(format!(
            "rank {rank} is not in 0..{nranks} (nranks {nranks})"
        )));
    }
    Ok((nranks as usize, rank as usize))
}

/// Reads an `ncclUniqueId`; one not made by `ncclGetUniqueId` of this library is named as such.
pub fn parse_id(id: &AbiId) -> CallResult<UniqueId> {
    UniqueId::from_bytes(&id.bytes()).map_err(|e| {
        Failure::invalid_argument(format!(
            "the ncclUniqueId was not made by ncclGetUniqueId of libmscclpp_nccl (or was \
             corrupted): {e}"
        ))
    })
}

/// A fresh job id; rank 0 of the job must join it from this process.
pub fn new_job_id() -> CallResult<UniqueId> {
    Ok(TcpBootstrap::create_unique_id(&BootstrapConfig::from_env(
        env()?,
    ))?)
}

impl Comm {
    /// Collective: joins job `id` as `rank` of `nranks` on `device`. The bootstrap comes first,
    /// so a rank that never joins is named by the timeout even on a machine without a GPU.
    pub fn connect(nranks: usize, rank: usize, id: &UniqueId, device: usize) -> CallResult<Comm> {
        Self::connect_with(nranks, rank, id, device, gpu)
    }

    /// [`connect`](Self::connect) on the GPU `gpu` gives (once the bootstrap is up): the
    /// process's backend, or a test's host GPU.
    pub fn connect_with(
        nranks: usize,
        rank: usize,
        id: &UniqueId,
        device: usize,
        gpu: impl FnOnce() -> CallResult<Arc<dyn Gpu>>,
    ) -> CallResult<Comm> {
        Self::build(nranks, rank, id, device, gpu, true)
    }

    /// [`connect_with`](Self::connect_with) without algorithms or point-to-point engine (they
    /// load kernels): the lifecycle on the host test GPU.
    #[cfg(test)]
    pub fn connect_bare(
        nranks: usize,
        rank: usize,
        id: &UniqueId,
        device: usize,
        gpu: Arc<dyn Gpu>,
    ) -> CallResult<Comm> {
        Self::build(nranks, rank, id, device, move || Ok(gpu), false)
    }

    fn build(
        nranks: usize,
        rank: usize,
        id: &UniqueId,
        device: usize,
        gpu: impl FnOnce() -> CallResult<Arc<dyn Gpu>>,
        with_algorithms: bool,
    ) -> CallResult<Comm> {
        let config = BootstrapConfig::from_env(env()?);
        let bootstrap: Arc<dyn Bootstrap> = Arc::new(TcpBootstrap::new(rank, nranks, id, &config)?);
        Self::build_over(bootstrap, id, device, gpu, with_algorithms)
    }

    /// Collective: a communicator over a bootstrap the caller made (a host stack's, through the
    /// C API's callbacks), for job `job`: the identity that ranks of one job living in one
    /// process share (their teardown meets, `handles::retire`).
    pub fn connect_over(
        bootstrap: Arc<dyn Bootstrap>,
        job: &UniqueId,
        device: usize,
    ) -> CallResult<Comm> {
        Self::build_over(bootstrap, job, device, gpu, true)
    }

    fn build_over(
        bootstrap: Arc<dyn Bootstrap>,
        id: &UniqueId,
        device: usize,
        gpu: impl FnOnce() -> CallResult<Arc<dyn Gpu>>,
        with_algorithms: bool,
    ) -> CallResult<Comm> {
        let env = env()?;
        let (rank, nranks) = (bootstrap.rank(), bootstrap.size());
        let gpu = gpu()?;
        gpu.set_device(device)?;
        let communicator = Arc::new(Communicator::new(bootstrap.clone(), gpu.clone(), device)?);
        let session = if with_algorithms {
            CommSession::with_more_algorithms(communicator.clone(), |builder| {
                add_execution_plans(&communicator, env, builder)
            })?
        } else {
            CommSession::without_algorithms(communicator.clone())
        };
        let arch = session.arch().to_string();
        let fallback = connect_fallback(env, bootstrap.as_ref());
        if let Fallback::Missing(why) = &fallback {
            tracing::info!(target: "mscclpp::nccl", "rank {rank}: no NCCL fallback ({why})");
        }
        tracing::info!(
            target: "mscclpp::nccl",
            "mscclpp-rs {} (NCCL ABI 2.28.9): rank {rank} of {nranks} on device {device} ({arch})",
            env!("CARGO_PKG_VERSION")
        );
        Ok(Comm {
            rank,
            nranks,
            device,
            job: id.clone(),
            gpu,
            session,
            loaded: Mutex::new(Vec::new()),
            communicator,
            fallback,
            forced: env.force_nccl_fallback_operation.clone(),
            accum: env.nccl_accum_dtype,
            aborted: AtomicBool::new(false),
            watchdog: Watchdog::new(env.nccl_watchdog_wait),
            exit_section: Mutex::new(None),
        })
    }

    /// ncclCommAbort's part while calls may still run on this communicator (another thread's):
    /// marks it aborted (its kernels return at entry, device waits give up within about a
    /// millisecond) and interrupts its host waits (`Communicator::interrupt`), so a thread
    /// blocked in one returns at once. Frees nothing and never blocks: the teardown runs when
    /// the last reference is dropped, and then aborts the real NCCL's communicator instead of
    /// destroying it (which also releases its kernels still waiting on the device). Not
    /// earlier: the real abort frees that communicator, and a fallback call still running, or a
    /// group's fallback calls waiting for ncclGroupEnd (the group holds this communicator for
    /// them), would then use freed memory inside the real NCCL. A fallback call blocked on the
    /// host inside the real NCCL returns on the real NCCL's terms.
    pub fn abort(&self, reason: &str) {
        self.aborted.store(true, Ordering::Release);
        self.communicator.interrupt(reason);
    }

    /// The real communicator's asynchronous error (success without a fallback).
    pub fn real_async_error(&self) -> crate::abi::NcclResult {
        let mut code = crate::abi::SUCCESS;
        if let Fallback::Ready { real, comm } = &self.fallback {
            // SAFETY: documented prototype; writes one result.
            let rc = unsafe { (real.comm_get_async_error)(*comm, &mut code) };
            if rc != crate::abi::SUCCESS {
                return rc;
            }
        }
        code
    }

    /// Whether `MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION` sends `operation` to the fallback.
    pub fn forced(&self, operation: &str) -> bool {
        let p2p = matches!(operation, "send" | "recv");
        self.forced
            .iter()
            .any(|o| o == "all" || o == operation || (o == "sendrecv" && p2p))
    }

    /// Why ncclSend/ncclRecv do not run natively on this communicator, if they do not.
    pub fn p2p_unavailable(&self) -> Option<&str> {
        self.session.p2p_unavailable()
    }

    /// Runs `algorithm` on `args`, after this communicator's previous operation, whatever stream
    /// that came on (`CommSession::follow_previous`).
    pub fn execute(&self, algorithm: &dyn Algorithm, args: &ExecuteArgs) -> mscclpp::Result<()> {
        self.session.execute(algorithm, args)
    }

    /// Runs one group of sends and receives of this communicator on `stream` natively.
    pub fn run_p2p(&self, ops: &[P2pOp], stream: Stream) -> mscclpp::Result<()> {
        self.session.run_p2p(ops, stream)
    }

    /// [`run_p2p`](Self::run_p2p)'s host work before any rank of this process launches.
    pub fn prepare_p2p(&self) -> mscclpp::Result<()> {
        self.session.prepare_p2p()
    }

    /// The communicator's asynchronous error: a send/recv size mismatch (naming rank and peer)
    /// first, else the core communicator's.
    pub fn async_error(&self) -> Option<mscclpp::Error> {
        self.session.async_error()
    }

    /// Adds an algorithm made for this communicator (an execution plan) under its own name, for
    /// [`algorithm_named`](Self::algorithm_named); a name this communicator has already for the
    /// same collective is refused.
    pub fn add_loaded(&self, algorithm: Arc<dyn Algorithm>) -> mscclpp::Result<()> {
        let (collective, name) = (algorithm.collective(), algorithm.name().to_string());
        if self.algorithm_named(collective, &name).is_some() {
            return Err(mscclpp::Error::InvalidArgument(format!(
                "an algorithm named {name} for {collective:?} is already loaded on rank {}",
                self.rank
            )));
        }
        self.loaded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(algorithm);
        Ok(())
    }

    /// The algorithm named `name` for `collective`: a loaded one, else the collection's.
    pub fn algorithm_named(
        &self,
        collective: Collective,
        name: &str,
    ) -> Option<Arc<dyn Algorithm>> {
        let loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        loaded
            .iter()
            .find(|a| a.collective() == collective && a.name() == name)
            .cloned()
            .or_else(|| self.session.algorithms().get(collective, name))
    }

    /// The names of every algorithm for `collective`: the collection's, then the loaded ones.
    pub fn algorithm_names(&self, collective: Collective) -> Vec<String> {
        let mut names = self.session.algorithms().names(collective);
        let loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        names.extend(
            loaded
                .iter()
                .filter(|a| a.collective() == collective)
                .map(|a| a.name().to_string()),
        );
        names
    }

    /// The native algorithm that runs `args`, checked; the error says why none does.
    pub fn native(
        &self,
        collective: Collective,
        args: &ExecuteArgs,
    ) -> mscclpp::Result<Arc<dyn Algorithm>> {
        let rank = self.rank;
        self.session.native_preferring(collective, args, |ctx| {
            crate::registry::ask(ctx, rank, args.stream)
        })
    }
}

/// Collective: the execution plans a program registered in this process (`registry`, the
/// Python package's `add_algorithm_builder`), then those of `MSCCLPP_EXECUTION_PLAN_DIR` and of
/// the plan cache's `default/` (where `python -m mscclpp --install` puts them) not named alike,
/// that run on this communicator, ahead of the native algorithms for the calls they match, as
/// MSCCL++'s shim serves them. Every rank takes the same plans or none (`agreed_plans`).
fn add_execution_plans(
    communicator: &Arc<Communicator>,
    env: &Env,
    builder: &mut AlgorithmCollectionBuilder,
) -> mscclpp::Result<()> {
    use mscclpp_executor::load::{agreed_plans, default_plans, runnable_plans};
    let mut plans = runnable_plans(communicator, crate::registry::plans());
    for plan in default_plans(communicator, env) {
        if plans.iter().all(|p| p.name != plan.name) {
            plans.push(plan);
        }
    }
    let plans = agreed_plans(
        communicator,
        plans,
        "this process's registrations and the plan directories",
    )?;
    if plans.is_empty() {
        return Ok(());
    }
    let added = mscclpp_executor::load::add_plans(communicator, builder, &plans)?;
    let names: Vec<&str> = added.iter().map(|a| a.name()).collect();
    tracing::info!(
        target: "mscclpp::nccl",
        "rank {}: execution plans ahead of the native algorithms where they match: {}",
        communicator.rank(),
        names.join(", ")
    );
    Ok(())
}

/// Collective: the real NCCL's communicator over the same ranks. Every rank says whether it
/// loaded the library before anyone calls the real init, so a rank without it cannot leave the
/// others waiting inside NCCL.
fn connect_fallback(env: &Env, bootstrap: &dyn Bootstrap) -> Fallback {
    if crate::embedding::active() {
        return Fallback::Missing(crate::embedding::NO_FALLBACK.into());
    }
    if env.nccl_lib_path.is_none() {
        return Fallback::Missing("MSCCLPP_NCCL_LIB_PATH is unset".into());
    }
    let real = real_nccl(env);
    let loaded = bootstrap.all_gather(&[u8::from(real.is_ok())]);
    let real = match (real, loaded) {
        (Err(why), _) => return Fallback::Missing(why),
        (_, Err(e)) => return Fallback::Missing(format!("agreeing on the fallback: {e}")),
        (Ok(_), Ok(all)) if all.iter().any(|b| b.first() != Some(&1)) => {
            return Fallback::Missing("another rank could not load the real NCCL".into())
        }
        (Ok(real), Ok(_)) => real,
    };
    let mut id = AbiId::from_bytes(&[0; 128]);
    if bootstrap.rank() == 0 {
        // SAFETY: writes one ncclUniqueId.
        let code = unsafe { (real.get_unique_id)(&mut id) };
        if code != crate::abi::SUCCESS {
            id = AbiId::from_bytes(&[0; 128]);
        }
    }
    let bytes = match bootstrap.broadcast(0, &id.bytes()) {
        Ok(b) if b.len() == 128 && b.iter().any(|&x| x != 0) => b,
        Ok(_) => return Fallback::Missing("the real ncclGetUniqueId failed on rank 0".into()),
        Err(e) => return Fallback::Missing(format!("sharing the real NCCL's id: {e}")),
    };
    let mut arr = [0u8; 128];
    arr.copy_from_slice(&bytes);
    let mut comm: RawComm = std::ptr::null_mut();
    // SAFETY: the documented prototype; the device is current on this thread (connect set it).
    let code = unsafe {
        (real.comm_init_rank)(
            &mut comm,
            bootstrap.size() as i32,
            AbiId::from_bytes(&arr),
            bootstrap.rank() as i32,
        )
    };
    match real.check("ncclCommInitRank", code, comm) {
        Ok(_) => Fallback::Ready { real, comm },
        Err(f) => Fallback::Missing(f.message),
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // The process's exit waits for this (bounded), and once it is exiting the backend refuses
        // our driver calls (`mscclpp::core::process`); held until every field is dropped.
        *self
            .exit_section
            .get_mut()
            .unwrap_or_else(|e| e.into_inner()) = mscclpp::core::process::enter();
        if let Fallback::Ready { real, comm } = &self.fallback {
            // SAFETY: the real communicator is ours, and no call holds it any more (this is the
            // last reference). Aborting also releases its kernels still waiting on the device.
            let (call, code) = if self.aborted.load(Ordering::Acquire) {
                ("ncclCommAbort", unsafe { (real.comm_abort)(*comm) })
            } else {
                ("ncclCommDestroy", unsafe { (real.comm_destroy)(*comm) })
            };
            if let Err(f) = real.check(call, code, *comm) {
                tracing::warn!(target: "mscclpp::nccl", "{}", f.message);
            }
        }
        // This process's kernels may still run: a destroy right after a call (NCCL's destroy
        // finishes the communicator's operations first, so callers need not synchronise), or
        // after a failure (abort, a device wait that timed out: each returns at entry or gives up
        // within its budget). They are drained once before any of the fields below frees or
        // unmaps what they touch (after a failure each shared buffer checks again, and leaks
        // itself if the drain fails).
        self.communicator.drain("the communicator's buffers");
    }
}

// SAFETY: the raw real-NCCL communicator is an opaque handle NCCL lets any thread use.
unsafe impl Send for Fallback {}
unsafe impl Sync for Fallback {}
