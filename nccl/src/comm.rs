//! One NCCL communicator over mscclpp-rs: the bootstrap, the core communicator, the default
//! native algorithms, and the real NCCL's communicator when a fallback library is configured.

use crate::abi::UniqueId as AbiId;
use crate::fallback::{RawComm, RealNccl};
use crate::guard::{CallResult, Failure};
use mscclpp::core::algorithm_collection::{AlgorithmCollection, SelectionContext};
use mscclpp::core::bootstrap::{Bootstrap, BootstrapConfig, TcpBootstrap, UniqueId};
use mscclpp::core::communicator::Communicator;
use mscclpp::core::gpu::Stream;
use mscclpp::core::{AccumType, Algorithm, Collective, ExecuteArgs};
use mscclpp::{Env, Gpu, GpuBackend};
use mscclpp_collectives::p2p::{P2pEngine, P2pOp};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

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
    pub algorithms: AlgorithmCollection,
    /// ncclSend/ncclRecv natively, or why not (then they go to the fallback).
    p2p: Result<P2pEngine, String>,
    pub communicator: Arc<Communicator>,
    pub fallback: Fallback,
    /// Lower-case operation names `MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION` sends to the fallback.
    forced: Vec<String>,
    /// What fp8 reductions accumulate in (`MSCCLPP_NCCL_ACCUM_DTYPE`).
    pub accum: AccumType,
    arch: String,
    /// Set once the real communicator was aborted (which frees it): drop must not destroy it.
    real_released: AtomicBool,
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
        let env = env()?;
        let config = BootstrapConfig::from_env(env);
        let bootstrap: Arc<dyn Bootstrap> = Arc::new(TcpBootstrap::new(rank, nranks, id, &config)?);
        let gpu = gpu()?;
        gpu.set_device(device)?;
        let communicator = Arc::new(Communicator::new(bootstrap.clone(), gpu.clone(), device)?);
        let (builder, resources) = mscclpp_collectives::build_default_algorithms_with_resources(
            &communicator,
            mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
            AlgorithmCollection::builder(),
        )?;
        let algorithms = builder.build();
        // ncclSend/ncclRecv borrow the collection's point-to-point region: no allocation of their
        // own, so the communicator stays within its 32 MiB per rank (issue #24).
        let p2p = match resources {
            Some(r) => P2pEngine::with_resources(communicator.clone(), r),
            None => P2pEngine::new(communicator.clone()),
        }
        .map_err(|e| e.to_string());
        let arch = gpu.properties(device)?.arch;
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
            algorithms,
            p2p,
            communicator,
            fallback,
            forced: env.force_nccl_fallback_operation.clone(),
            accum: env.nccl_accum_dtype,
            arch,
            real_released: AtomicBool::new(false),
        })
    }

    /// After the real NCCL's abort freed the fallback communicator.
    pub fn forget_fallback(&self) {
        self.real_released.store(true, Ordering::Release);
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
        self.p2p.as_ref().err().map(String::as_str)
    }

    /// Runs one group of sends and receives of this communicator on `stream` natively.
    pub fn run_p2p(&self, ops: &[P2pOp], stream: Stream) -> mscclpp::Result<()> {
        match &self.p2p {
            Ok(engine) => {
                self.gpu.set_device(self.device)?;
                engine.run(ops, &stream)
            }
            Err(why) => Err(mscclpp::Error::Unsupported(why.clone())),
        }
    }

    /// [`run_p2p`](Self::run_p2p)'s host work before any rank of this process launches.
    pub fn prepare_p2p(&self) -> mscclpp::Result<()> {
        match &self.p2p {
            Ok(engine) => {
                self.gpu.set_device(self.device)?;
                engine.prepare()
            }
            Err(why) => Err(mscclpp::Error::Unsupported(why.clone())),
        }
    }

    /// The communicator's asynchronous error: a send/recv size mismatch (naming rank and peer)
    /// first, else the core communicator's.
    pub fn async_error(&self) -> Option<mscclpp::Error> {
        match &self.p2p {
            Ok(engine) => engine.mismatch().map(mscclpp::Error::InvalidArgument),
            Err(_) => None,
        }
        .or_else(|| self.communicator.async_error())
    }

    /// The native algorithm that runs `args`, checked; the error says why none does.
    pub fn native(
        &self,
        collective: Collective,
        args: &ExecuteArgs,
    ) -> mscclpp::Result<Arc<dyn Algorithm>> {
        self.gpu.set_device(self.device)?;
        let ctx = SelectionContext {
            collective,
            message_bytes: args.input_bytes,
            dtype: args.dtype,
            world_size: self.nranks,
            // Ranks on other hosts (MSCCLPP_HOSTID) take the multi-host branch of the selector.
            local_world_size: self.communicator.topology().local_size(self.rank),
            symmetric_memory: false,
            capturing: self.gpu.is_capturing(args.stream)?,
            arch: self.arch.clone(),
            // NVLink multicast stays off under the shim (DESIGN.md, safety on shared GPUs).
            nvls_allowed: false,
            in_place: SelectionContext::buffers_in_place(collective, args, self.rank),
        };
        let algorithm = self.algorithms.select(&ctx)?;
        algorithm.check(args)?;
        Ok(algorithm)
    }
}

/// Collective: the real NCCL's communicator over the same ranks. Every rank says whether it
/// loaded the library before anyone calls the real init, so a rank without it cannot leave the
/// others waiting inside NCCL.
fn connect_fallback(env: &Env, bootstrap: &dyn Bootstrap) -> Fallback {
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
        if self.real_released.load(Ordering::Acquire) {
            return;
        }
        if let Fallback::Ready { real, comm } = &self.fallback {
            // SAFETY: the real communicator is ours and used by nobody else now.
            let code = unsafe { (real.comm_destroy)(*comm) };
            if let Err(f) = real.check("ncclCommDestroy", code, *comm) {
                tracing::warn!(target: "mscclpp::nccl", "{}", f.message);
            }
        }
    }
}

// SAFETY: the raw real-NCCL communicator is an opaque handle NCCL lets any thread use.
unsafe impl Send for Fallback {}
unsafe impl Sync for Fallback {}
