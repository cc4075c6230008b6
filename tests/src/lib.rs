//! Shared pieces of the integration tests and the GPU suite: per-rank setup under a launcher,
//! kernel launch parameter packing, reproducible random data and host-side float64 references.

pub mod alltoall_checks;
pub mod byte_pattern;
pub mod divergent_buffers;
pub mod host_cost;
pub mod p2p_checks;
pub mod plan_checks;
pub mod port_allreduce_checks;
pub mod port_channel_checks;
pub mod tally;

/// Device-side kernels of the suite itself (measurement kernels; the checked kernels live in
/// kernels-cu).
pub const SUITE_KERNELS: &str = r#"
#include "mscclpp/memory_channel.cuh"
using namespace mscclpp;
// MemoryChannel put by every thread of the grid: the bandwidth a collective gets from put().
extern "C" __global__ void put_bandwidth(MemoryChannelHandle chan, u64 bytes) {
  chan.put(0, bytes, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}
// Semaphore-only ping-pong, one thread: the initiator signals and waits, the peer waits and signals.
// `relaxed` selects relaxed_signal/relaxed_wait (no data ordering) instead of release/acquire.
extern "C" __global__ void semaphore_ping_pong(D2DSemaphoreHandle sem, u32 iters, u32 initiator, u32 relaxed) {
  for (u32 it = 0; it < iters; ++it) {
    if (initiator) {
      if (relaxed) sem.relaxed_signal(); else sem.signal();
      if (!(relaxed ? sem.relaxed_wait() : sem.wait())) return;
    } else {
      if (!(relaxed ? sem.relaxed_wait() : sem.wait())) return;
      if (relaxed) sem.relaxed_signal(); else sem.signal();
    }
  }
}
// The plain SM store copy the put is measured against: 16-byte loads and stores, grid-stride.
extern "C" __global__ void plain_copy(uint4* dst, const uint4* src, u64 n) {
  for (u64 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}
"#;

use mscclpp::core::bootstrap::{Bootstrap, TcpBootstrap};
use mscclpp::core::communicator::Communicator;
use mscclpp::core::env::Env;
use mscclpp::core::gpu::{Allocation, DevicePtr, Gpu, MemoryKind, Stream};
use mscclpp::core::{DataType, Error, Result};
use std::ffi::c_void;
use std::sync::Arc;

pub const MIB: usize = 1 << 20;
/// The largest message of the data-movement checks (the standards' ">= 1 GiB").
pub const GIB: usize = 1 << 30;

/// One rank of a GPU job started by a launcher (torchrun, mpirun, srun).
pub struct RankContext {
    pub env: &'static Env,
    pub gpu: Arc<dyn Gpu>,
    pub bootstrap: Arc<dyn Bootstrap>,
    pub comm: Arc<Communicator>,
    /// The GPU this rank runs on: `LOCAL_RANK` modulo the GPUs visible.
    pub device: usize,
    /// More ranks run on this host than it has GPUs, so some share one (see
    /// [`RankContext::from_launcher`]): results are checked as usual, timing targets are not.
    pub shares_gpu: bool,
    /// Wall time of `Communicator::new` on this rank (bootstrap and context creation excluded).
    pub comm_init: std::time::Duration,
    /// Wall time of making the device current the first time (the driver creates its context).
    pub context_init: std::time::Duration,
    /// `mscclpp_core::gpu::live_device_bytes()` right after the communicator was built.
    pub bytes_after_comm_init: u64,
}

impl RankContext {
    /// Joins the job described by the launcher variables, on GPU `LOCAL_RANK` modulo the GPUs
    /// visible. Returns `Ok(None)` with the reason printed when there is no GPU to run on.
    ///
    /// Ranks beyond the GPU count share GPUs: their kernels time-slice the GPU (or run side by
    /// side under MPS), so a machine with fewer GPUs checks the results of a larger world size
    /// (8 ranks' scratch layouts, peer loops and signal counts on one GPU). Timings of such a run
    /// mean nothing; timed checks report without judging.
    pub fn from_launcher() -> Result<Option<RankContext>> {
        let env = Env::get()?;
        mscclpp::core::log::init_logging(env)?;
        let gpu: Arc<dyn Gpu> = match mscclpp::select_backend(env) {
            Ok(backend) => Arc::new(backend),
            Err(e) if e.is_unavailable() => {
                eprintln!("SKIP: no usable GPU backend: {e}");
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let gpus = gpu.device_count()?;
        if gpus == 0 {
            eprintln!("SKIP: the {} backend sees no GPU", gpu.backend_name());
            return Ok(None);
        }
        let launcher = env.launcher.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "the GPU suite runs one process per GPU under a launcher \
                 (torchrun --no-python --nproc_per_node=N ...)"
                    .into(),
            )
        })?;
        let device = launcher.local_rank % gpus;
        let local_ranks = launcher.local_size.unwrap_or(launcher.local_rank + 1);
        let shares_gpu = local_ranks > gpus;
        if shares_gpu && launcher.local_rank == 0 {
            eprintln!(
                "NOTE: {local_ranks} ranks on this host share {gpus} GPU(s): results are checked, \
                 timings are not judged"
            );
        }
        let bootstrap: Arc<dyn Bootstrap> = Arc::new(TcpBootstrap::from_env(env)?);
        // The device's context is created first, so `comm_init` is the communicator's own set-up
        // (as a framework that already uses the GPU sees it), not the driver's context creation.
        let started = std::time::Instant::now();
        gpu.set_device(device)?;
        let context_init = started.elapsed();
        let started = std::time::Instant::now();
        let comm = Arc::new(Communicator::new(bootstrap.clone(), gpu.clone(), device)?);
        let comm_init = started.elapsed();
        Ok(Some(RankContext {
            env,
            gpu,
            bootstrap,
            comm,
            device,
            shares_gpu,
            comm_init,
            context_init,
            bytes_after_comm_init: mscclpp_core::gpu::live_device_bytes(),
        }))
    }

    pub fn rank(&self) -> usize {
        self.bootstrap.rank()
    }
    pub fn size(&self) -> usize {
        self.bootstrap.size()
    }

    /// Collective: a second communicator of the same ranks, with its own bootstrap (from a
    /// UniqueId rank 0 creates) and so its own error word: a check that fails a communicator on
    /// purpose runs on one, and the job's goes on healthy.
    pub fn fresh_communicator(&self) -> Result<Arc<Communicator>> {
        use mscclpp::core::bootstrap::{BootstrapConfig, UniqueId};
        let config = BootstrapConfig::from_env(self.env);
        let (rank, size) = (self.rank(), self.size());
        let id = if rank == 0 {
            TcpBootstrap::create_unique_id(&config)?.to_bytes().to_vec()
        } else {
            Vec::new()
        };
        let id = UniqueId::from_bytes(&self.bootstrap.broadcast(0, &id)?)?;
        let bootstrap: Arc<dyn Bootstrap> = Arc::new(TcpBootstrap::new(rank, size, &id, &config)?);
        Ok(Arc::new(Communicator::new(
            bootstrap,
            self.gpu.clone(),
            self.device,
        )?))
    }

    /// Collective: a seed rank 0 takes from its clock, the same on every rank, fresh per run: every
    /// rank regenerates its peers' data from it.
    pub fn shared_seed(&self) -> Result<u64> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        let b = self.bootstrap.broadcast(0, &now.to_le_bytes())?;
        b.get(..8)
            .and_then(|s| s.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| Error::Internal("run seed broadcast: short message".into()))
    }

    /// Collective: whether every rank `completed` its last check (with or without wrong results).
    /// After one that did not complete somewhere, the ranks skip the rest together instead of each
    /// timing out in the next.
    pub fn all_completed(&self, completed: bool) -> Result<bool> {
        let all = self.bootstrap.all_gather(&[u8::from(completed)])?;
        Ok(all.iter().all(|v| v.first() == Some(&1)))
    }
}

/// Device memory freed on drop.
pub struct DeviceBuffer {
    pub alloc: Allocation,
    gpu: Arc<dyn Gpu>,
}

impl DeviceBuffer {
    pub fn new(gpu: &Arc<dyn Gpu>, bytes: usize, kind: MemoryKind) -> Result<Self> {
        Ok(DeviceBuffer {
            alloc: gpu.alloc(bytes.max(1), kind)?,
            gpu: gpu.clone(),
        })
    }
    pub fn ptr(&self) -> DevicePtr {
        self.alloc.ptr
    }
    pub fn upload(&self, bytes: &[u8]) -> Result<()> {
        self.gpu.copy_to_device(self.alloc.ptr, bytes)
    }
    pub fn download(&self, bytes: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; bytes];
        self.gpu.copy_from_device(&mut out, self.alloc.ptr)?;
        Ok(out)
    }
    /// Fills the buffer with `byte` and waits: outputs are poisoned before every check.
    pub fn poison(&self, byte: u8) -> Result<()> {
        self.gpu
            .memset_async(self.alloc.ptr, byte, self.alloc.size, Stream::DEFAULT)?;
        self.gpu.synchronize_stream(Stream::DEFAULT)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.free(&self.alloc) {
            eprintln!("freeing a test buffer failed: {e}");
        }
    }
}

/// Kernel parameters: each argument is copied into an owned, 8-byte aligned slot so that the
/// pointers handed to the driver stay valid for the launch call.
#[derive(Default)]
pub struct KernelArgs {
    slots: Vec<Box<[u64]>>,
}

impl KernelArgs {
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds one argument by value (`T` must be the exact type of the kernel parameter).
    pub fn push<T: Copy>(&mut self, value: T) -> &mut Self {
        let words = std::mem::size_of::<T>().div_ceil(8).max(1);
        let mut slot = vec![0u64; words].into_boxed_slice();
        // SAFETY: the slot has at least size_of::<T>() bytes and 8-byte alignment, which covers
        // every kernel parameter type we pass (handles are 8-byte aligned).
        unsafe { std::ptr::write(slot.as_mut_ptr() as *mut T, value) };
        self.slots.push(slot);
        self
    }
    pub fn pointers(&mut self) -> Vec<*mut c_void> {
        self.slots
            .iter_mut()
            .map(|s| s.as_mut_ptr() as *mut c_void)
            .collect()
    }
}

/// SplitMix64: tiny, fast, reproducible on every rank (each rank regenerates peers' inputs).
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

/// Seed of rank `rank`'s data for check number `case`, fresh per run (`run_seed`).
pub fn seed(run_seed: u64, case: u64, rank: usize) -> u64 {
    run_seed ^ case.wrapping_mul(0x1000_0000_01b3) ^ ((rank as u64 + 1) << 48)
}

pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return 0x7fc0;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    ((bits + round) >> 16) as u16
}

pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Random elements of `dtype` (floats in [-1, 1], integers small enough not to overflow sums),
/// as raw bytes, plus their exact values in f64.
pub fn random_elements(dtype: DataType, count: usize, seed: u64) -> Result<(Vec<u8>, Vec<f64>)> {
    let mut rng = SplitMix64(seed);
    let mut bytes = Vec::with_capacity(count * dtype.size());
    let mut values = Vec::with_capacity(count);
    for _ in 0..count {
        match dtype {
            DataType::F32 => {
                let v = rng.next_f64() as f32;
                bytes.extend_from_slice(&v.to_le_bytes());
                values.push(v as f64);
            }
            DataType::Bf16 => {
                let b = f32_to_bf16(rng.next_f64() as f32);
                bytes.extend_from_slice(&b.to_le_bytes());
                values.push(bf16_to_f32(b) as f64);
            }
            DataType::I32 => {
                let v = (rng.next_u64() % 2001) as i32 - 1000;
                bytes.extend_from_slice(&v.to_le_bytes());
                values.push(v as f64);
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "test data generation for {other}"
                )))
            }
        }
    }
    Ok((bytes, values))
}

/// Decodes device bytes of `dtype` to f64.
pub fn decode_elements(dtype: DataType, bytes: &[u8]) -> Result<Vec<f64>> {
    Ok(match dtype {
        DataType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        DataType::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])) as f64)
            .collect(),
        DataType::I32 => bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        other => return Err(Error::Unsupported(format!("decoding {other}"))),
    })
}

/// Relative tolerance of one rounding in `dtype` (exact for integers).
pub fn unit_roundoff(dtype: DataType) -> f64 {
    match dtype {
        DataType::F32 => f32::EPSILON as f64,
        DataType::Bf16 => 1.0 / 128.0,
        DataType::F16 => 1.0 / 1024.0,
        _ => 0.0,
    }
}

/// Compares `got` with the float64 sum of `inputs` (one vector per rank): each element must lie
/// within `ulps * unit_roundoff * sum(|x_r|)` of the reference (0 for integers: exact). Returns
/// the number of wrong elements and a description of the first.
pub fn check_sum(
    dtype: DataType,
    got: &[f64],
    inputs: &[Vec<f64>],
    ulps: f64,
) -> (usize, Option<String>) {
    let tol = ulps * unit_roundoff(dtype);
    let mut wrong = 0;
    let mut first = None;
    for (i, g) in got.iter().enumerate() {
        let exact: f64 = inputs.iter().map(|v| v[i]).sum();
        let scale: f64 = inputs.iter().map(|v| v[i].abs()).sum();
        if g.is_nan() || (g - exact).abs() > tol * scale {
            wrong += 1;
            if first.is_none() {
                first = Some(format!(
                    "element {i}: got {g}, expected {exact} (tol {})",
                    tol * scale
                ));
            }
        }
    }
    (wrong, first)
}
