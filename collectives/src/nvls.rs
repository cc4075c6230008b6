//! The NVLS (NVLink multicast) all-reduces, behind the NVLS safety gate:
//! `default_allreduce_nvls_packet`, `default_allreduce_nvls_zero_copy`,
//! `default_allreduce_nvls_warp_pipeline` and `default_allreduce_nvls_block_pipeline`. The
//! protocols are described in `kernels-cu/src/kernels/allreduce_nvls.cu`.
//!
//! # Safety gate
//! NVLink multicast can take a shared host's GPUs out of service (DESIGN.md, "Safety on shared
//! GPUs"). [`NvlsAlgorithm::with_env`] calls [`nvls_available`] before anything else: unless
//! `Env::nvls_allowed` it returns the gate's `Unsupported` error without touching the driver;
//! unless `Gpu::is_nvls_supported` it returns `Unsupported` naming the device. No algorithm of
//! this module exists otherwise, so none of its kernels can be launched. All ranks must run with
//! the same NVLS variables (see `mscclpp_core::switch_channel`).
//!
//! # Reductions
//! Sum of f32, f16 and bf16 only (what `multimem.ld_reduce ... add` computes, in the element
//! type); other types and ops are `Unsupported`, naming them.
//!
//! # Resources (built collectively: every rank builds the same kinds in the same order)
//! - packet: a multicast-bound scratch (VMM) of 2 x nranks slots of LL16 packets for
//!   [`NVLS_PACKET_THRESHOLD`] bytes (or `scratch_bytes` if larger), a device call counter.
//! - block / warp pipeline: a multicast-bound scratch of `scratch_bytes`, one region per block or
//!   warp, and per-unit semaphores with every peer.
//! - zero copy: per-block semaphores; the user's buffers are bound to multicast objects on first
//!   use (collective, cached by allocation, host-only so legal during graph capture). Only VMM
//!   allocations can be bound: others are refused, naming the buffer.

use crate::geometry::{self, Residency};
use crate::resources::{launch_with_args, BlockSemaphores, DeviceBuffer};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::{native_names as names, NVLS_PACKET_THRESHOLD};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::device::SwitchChannelHandle;
use mscclpp_core::env::Env;
use mscclpp_core::gpu::{Allocation, DevicePtr, Function, Gpu, MemoryKind, Stream};
use mscclpp_core::switch_channel::{nvls_gate, SwitchChannel};
use mscclpp_core::{DataType, Error, ReduceOp, Result};
use mscclpp_kernels_cu::collectives::{CallState, MAX_PACKET_BLOCKS, MAX_RANKS};
use mscclpp_kernels_cu::nvls_units::{nvls_unit_name, nvls_unit_source, NvlsArgs, NvlsKernel};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

/// The NVLS all-reduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NvlsKind {
    Packet,
    ZeroCopy,
    WarpPipeline,
    BlockPipeline,
}

impl NvlsKind {
    pub const ALL: [NvlsKind; 4] = [
        NvlsKind::Packet,
        NvlsKind::ZeroCopy,
        NvlsKind::WarpPipeline,
        NvlsKind::BlockPipeline,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            NvlsKind::Packet => names::ALLREDUCE_NVLS_PACKET,
            NvlsKind::ZeroCopy => names::ALLREDUCE_NVLS_ZERO_COPY,
            NvlsKind::WarpPipeline => names::ALLREDUCE_NVLS_WARP_PIPELINE,
            NvlsKind::BlockPipeline => names::ALLREDUCE_NVLS_BLOCK_PIPELINE,
        }
    }

    pub const fn kernel(self) -> NvlsKernel {
        match self {
            NvlsKind::Packet => NvlsKernel::Packet,
            NvlsKind::ZeroCopy => NvlsKernel::ZeroCopy,
            NvlsKind::WarpPipeline => NvlsKernel::WarpPipeline,
            NvlsKind::BlockPipeline => NvlsKernel::BlockPipeline,
        }
    }

    /// Semaphore units per peer: blocks (zero copy, block pipeline) or warps (warp pipeline).
    /// Every rank's communicator has 1024 semaphores per peer for all algorithms together; these
    /// 192 leave the NVLink algorithms theirs.
    const fn semaphore_units(self) -> u32 {
        match self {
            NvlsKind::Packet => 0,
            NvlsKind::ZeroCopy | NvlsKind::BlockPipeline => MAX_NVLS_BLOCKS,
            NvlsKind::WarpPipeline => MAX_NVLS_WARPS,
        }
    }

    const fn default_threads(self) -> u32 {
        match self {
            // 8 warps a block: 16 blocks fill the warp budget, spread over 16 SMs.
            NvlsKind::WarpPipeline => 256,
            _ => 512,
        }
    }
}

/// Most blocks of the zero-copy and block-pipeline kernels (one semaphore per block and peer).
pub const MAX_NVLS_BLOCKS: u32 = 32;
/// Most warps of the warp-pipeline kernel (one semaphore per warp and peer).
pub const MAX_NVLS_WARPS: u32 = 128;
/// Bytes of one 16-byte multimem vector; zero-copy messages are whole vectors.
const VECTOR_BYTES: usize = 16;
const PACKET_BYTES: usize = geometry::PACKET_BYTES;
const PACKET_PAYLOAD: usize = geometry::PACKET_PAYLOAD;

/// The safety gate and the hardware check, in that order: `env` must allow NVLS (else the gate's
/// `Unsupported`, with no call into `gpu`), then `gpu` must support multicast on `device`.
pub fn nvls_available(gpu: &dyn Gpu, device: usize, env: &Env) -> Result<()> {
    nvls_gate(env)?;
    if !gpu.is_nvls_supported(device)? {
        return Err(Error::Unsupported(format!(
            "NVLS all-reduce: device {device} ({} backend) does not support NVLink multicast",
            gpu.backend_name()
        )));
    }
    Ok(())
}

/// Scratch bytes (per rank) of the packet kind for messages of up to `max_bytes` on `nranks`
/// ranks: 2 parity halves x nranks slots of LL16 packets.
pub fn packet_scratch_bytes(max_bytes: usize, nranks: usize) -> usize {
    2 * nranks.max(1) * max_bytes.div_ceil(PACKET_PAYLOAD) * PACKET_BYTES
}

/// Largest message (bytes per rank) the packet kind takes with `scratch_bytes` of scratch.
pub fn packet_max_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    scratch_bytes / (2 * nranks.max(1) * PACKET_BYTES) * PACKET_PAYLOAD
}

/// Scratch bytes each pipeline unit owns: an equal share, whole 16-byte vectors.
pub fn pipeline_unit_bytes(scratch_bytes: usize, units: u32) -> usize {
    scratch_bytes / units.max(1) as usize / VECTOR_BYTES * VECTOR_BYTES
}

/// Validates `args` for `kind` on `nranks` ranks without touching the device; returns the element
/// count. Pure, so every refusal is unit-tested on the CPU.
pub fn check_nvls_args(
    kind: NvlsKind,
    args: &ExecuteArgs,
    nranks: usize,
    packet_max: usize,
) -> Result<usize> {
    let name = kind.name();
    if nranks == 0 || nranks > MAX_RANKS {
        return Err(Error::Unsupported(format!(
            "{name} on {nranks} ranks: it supports 1..={MAX_RANKS} ranks on one NVSwitch domain"
        )));
    }
    mscclpp_kernels_cu::nvls_units::nvls_vector_type(args.dtype)
        .map_err(|e| Error::Unsupported(format!("{name}: {e}")))?;
    if args.op != ReduceOp::Sum {
        return Err(Error::Unsupported(format!(
            "{name}: reduction {} of {}: NVLink multicast only sums",
            args.op.name(),
            args.dtype
        )));
    }
    if args.accum.resolve(args.dtype)? != args.dtype {
        return Err(Error::Unsupported(format!(
            "{name}: {} accumulating in {:?}: the switch accumulates in the element type",
            args.dtype, args.accum
        )));
    }
    let count = args.input_count()?;
    if args.output_bytes < args.input_bytes {
        return Err(Error::InvalidArgument(format!(
            "{name}: the output holds {} bytes, the call needs {}",
            args.output_bytes, args.input_bytes
        )));
    }
    if count > 0 && (args.input == 0 || args.output == 0) {
        return Err(Error::InvalidArgument(format!(
            "{name}: null {} pointer",
            if args.input == 0 { "input" } else { "output" }
        )));
    }
    match kind {
        NvlsKind::ZeroCopy => {
            if args.input_bytes % VECTOR_BYTES != 0 {
                return Err(Error::Unsupported(format!(
                    "{name}: {} bytes is not a whole number of 16-byte multimem vectors (use \
                     {} for such sizes)",
                    args.input_bytes,
                    names::ALLREDUCE_NVLS_BLOCK_PIPELINE
                )));
            }
            for (what, ptr) in [("input", args.input), ("output", args.output)] {
                if count > 0 && ptr % VECTOR_BYTES as u64 != 0 {
                    return Err(Error::Unsupported(format!(
                        "{name}: {what} {ptr:#x} is not 16-byte aligned"
                    )));
                }
            }
        }
        NvlsKind::Packet if args.input_bytes > packet_max => {
            return Err(Error::InvalidArgument(format!(
                "{name}: an input of {} bytes exceeds its scratch capacity of {packet_max} bytes \
                 per rank",
                args.input_bytes
            )));
        }
        _ => {}
    }
    Ok(count)
}

fn lock<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| Error::Internal("an NVLS algorithm's table was poisoned by a panic".into()))
}

/// A VMM buffer of this rank bound to a multicast object shared by every rank.
struct MulticastScratch {
    gpu: Arc<dyn Gpu>,
    comm: Arc<Communicator>,
    channel: Option<SwitchChannel>,
    alloc: Allocation,
}

impl MulticastScratch {
    /// Collective: allocates and zeroes `bytes` of VMM memory and binds it to a new multicast
    /// object (`SwitchChannel::with_env`, which checks the gate again).
    fn new(comm: &Arc<Communicator>, bytes: usize, env: &Env) -> Result<MulticastScratch> {
        let gpu = comm.gpu().clone();
        let alloc = gpu.alloc(bytes, MemoryKind::Vmm)?;
        let mut scratch = MulticastScratch {
            gpu: gpu.clone(),
            comm: comm.clone(),
            channel: None,
            alloc,
        };
        // Zero matters: packet flags must never match stale bytes, and pipeline padding is
        // written per chunk anyway.
        gpu.memset_async(scratch.alloc.ptr, 0, bytes, Stream::DEFAULT)?;
        gpu.synchronize_stream(Stream::DEFAULT)?;
        scratch.channel = Some(SwitchChannel::with_env(comm, &scratch.alloc, bytes, env)?);
        Ok(scratch)
    }

    fn handle(&self) -> Result<SwitchChannelHandle> {
        self.channel
            .as_ref()
            .map(SwitchChannel::handle)
            .ok_or_else(|| Error::Internal("NVLS scratch without its multicast binding".into()))
    }
}

impl Drop for MulticastScratch {
    fn drop(&mut self) {
        if self.channel.is_some() {
            // Every rank's kernels must be done with the object before anyone unbinds; the
            // bootstrap barrier is bounded, so a dead peer delays teardown but cannot hang it.
            if let Err(e) = self.comm.bootstrap().barrier() {
                tracing::warn!(target: "mscclpp::coll", "NVLS scratch teardown barrier failed: {e}");
            }
            self.channel.take();
        }
        if let Err(e) = self.gpu.free(&self.alloc) {
            tracing::warn!(target: "mscclpp::coll", "freeing the NVLS scratch failed: {e}");
        }
    }
}

/// A user allocation bound to a multicast object, with the buffer offsets every rank agreed on.
struct BoundUserBuffer {
    buffer_id: u64,
    channel: SwitchChannel,
    agreed_offsets: HashSet<u64>,
}

/// One NVLS all-reduce bound to one communicator. See the module docs.
pub struct NvlsAlgorithm {
    kind: NvlsKind,
    // Field order is drop order: device resources go before the communicator they came from.
    functions: Mutex<HashMap<DataType, Function>>,
    user_buffers: Mutex<HashMap<DevicePtr, BoundUserBuffer>>,
    scratch: Option<MulticastScratch>,
    semaphores: Option<BlockSemaphores>,
    state: Option<DeviceBuffer>,
    scratch_bytes: usize,
    residency: Residency,
    env: Env,
    comm: Arc<Communicator>,
}

impl NvlsAlgorithm {
    /// Collective: sets up `kind` for `comm` with the process environment. See [`Self::with_env`].
    pub fn new(kind: NvlsKind, comm: Arc<Communicator>, scratch_bytes: usize) -> Result<Self> {
        Self::with_env(kind, comm, scratch_bytes, Env::get()?)
    }

    /// Collective: sets up `kind` for `comm`. Refuses first, touching nothing, unless `env` opens
    /// the NVLS gate and the device supports multicast ([`nvls_available`]). `scratch_bytes` is
    /// the pipelined kinds' multicast scratch per rank (the packet kind takes at least enough for
    /// [`NVLS_PACKET_THRESHOLD`]; zero copy needs none).
    pub fn with_env(
        kind: NvlsKind,
        comm: Arc<Communicator>,
        scratch_bytes: usize,
        env: &Env,
    ) -> Result<Self> {
        nvls_available(comm.gpu().as_ref(), comm.device(), env)?;
        let gpu = comm.gpu().clone();
        let residency = Residency::of(&comm)?;
        let n = comm.size();
        let scratch_bytes = match kind {
            NvlsKind::Packet => scratch_bytes.max(packet_scratch_bytes(NVLS_PACKET_THRESHOLD, n)),
            NvlsKind::ZeroCopy => 0,
            NvlsKind::WarpPipeline | NvlsKind::BlockPipeline => {
                let units = kind.semaphore_units() as usize;
                if scratch_bytes < units * VECTOR_BYTES * n {
                    return Err(Error::InvalidArgument(format!(
                        "{}: scratch of {scratch_bytes} bytes is too small for {units} pipeline \
                         units on {n} ranks (at least {} bytes)",
                        kind.name(),
                        units * VECTOR_BYTES * n
                    )));
                }
                scratch_bytes
            }
        };
        let scratch = match kind {
            NvlsKind::ZeroCopy => None,
            _ => Some(MulticastScratch::new(&comm, scratch_bytes, env)?),
        };
        let semaphores = match kind.semaphore_units() {
            0 => None,
            units => Some(BlockSemaphores::new(&comm, units)?),
        };
        let state = match kind {
            NvlsKind::Packet => Some(DeviceBuffer::zeroed(
                &gpu,
                std::mem::size_of::<CallState>(),
            )?),
            _ => None,
        };
        Ok(NvlsAlgorithm {
            kind,
            functions: Mutex::default(),
            user_buffers: Mutex::default(),
            scratch,
            semaphores,
            state,
            scratch_bytes,
            residency,
            env: env.clone(),
            comm,
        })
    }

    pub fn kind(&self) -> NvlsKind {
        self.kind
    }

    /// Largest message (bytes per rank): the packet kind's scratch capacity, else unlimited.
    pub fn max_bytes(&self) -> usize {
        match self.kind {
            NvlsKind::Packet => packet_max_bytes(self.scratch_bytes, self.comm.size()),
            _ => usize::MAX,
        }
    }

    fn missing(&self, what: &str) -> Error {
        Error::Internal(format!("{} was built without its {what}", self.kind.name()))
    }

    fn function(&self, dtype: DataType) -> Result<Function> {
        if let Some(f) = lock(&self.functions)?.get(&dtype) {
            return Ok(*f);
        }
        let gpu = self.comm.gpu();
        let module = gpu.build_module(&nvls_unit_name(dtype)?, &nvls_unit_source(dtype)?)?;
        let f = gpu.get_function(module, self.kind.kernel().entry_point())?;
        lock(&self.functions)?.insert(dtype, f);
        Ok(f)
    }

    /// The multicast view of the user buffer `[ptr, ptr + bytes)`: collective on first use of its
    /// allocation (binding) and of each new offset inside it (every rank must use the same one,
    /// since ld_reduce combines the same multicast offset of every rank's allocation).
    fn user_channel(&self, ptr: DevicePtr, bytes: usize) -> Result<SwitchChannelHandle> {
        let name = self.kind.name();
        let gpu = self.comm.gpu();
        let alloc = gpu.allocation_of(ptr).map_err(|e| {
            Error::InvalidArgument(format!(
                "{name}: buffer {ptr:#x} is not a device allocation the backend knows: {e}"
            ))
        })?;
        if alloc.kind != MemoryKind::Vmm {
            return Err(Error::InvalidArgument(format!(
                "{name}: buffer {ptr:#x} is {:?} memory; zero-copy NVLS binds the user's buffers \
                 to a multicast object, which needs VMM allocations (MemoryKind::Vmm, e.g. \
                 symmetric memory). Use {} for other buffers",
                alloc.kind,
                names::ALLREDUCE_NVLS_BLOCK_PIPELINE
            )));
        }
        let offset = ptr - alloc.ptr;
        if offset as usize + bytes > alloc.size {
            return Err(Error::InvalidArgument(format!(
                "{name}: {bytes} bytes at {ptr:#x} run past the end of its allocation \
                 ({} bytes at {:#x})",
                alloc.size, alloc.ptr
            )));
        }
        let id = gpu.buffer_id(ptr)?;
        let mut table = lock(&self.user_buffers)?;
        if table.get(&alloc.ptr).is_some_and(|b| b.buffer_id != id) {
            // The address was recycled: the old binding is stale. Every rank sees the same
            // pattern (SPMD), so all drop and rebind together.
            table.remove(&alloc.ptr);
        }
        let bound = match table.entry(alloc.ptr) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(BoundUserBuffer {
                buffer_id: id,
                channel: SwitchChannel::with_env(&self.comm, &alloc, alloc.size, &self.env)?,
                agreed_offsets: HashSet::new(),
            }),
        };
        if !bound.agreed_offsets.contains(&offset) {
            agree_offset(self.comm.as_ref(), name, offset)?;
            bound.agreed_offsets.insert(offset);
        }
        let mut handle = bound.channel.handle();
        handle.device_ptr = ptr;
        handle.mc_ptr += offset;
        handle.size = bytes as u64;
        Ok(handle)
    }
}

impl Drop for NvlsAlgorithm {
    fn drop(&mut self) {
        // User buffers' multicast bindings are unbound when their channels drop; every rank's
        // kernels must be done with them first (the scratch does the same in its own drop). The
        // bootstrap barrier is bounded, so a dead peer delays teardown but cannot hang it.
        let bound = match self.user_buffers.get_mut() {
            Ok(table) => std::mem::take(table),
            Err(poisoned) => std::mem::take(poisoned.into_inner()),
        };
        if !bound.is_empty() {
            if let Err(e) = self.comm.bootstrap().barrier() {
                tracing::warn!(target: "mscclpp::coll", "NVLS user-buffer teardown barrier failed: {e}");
            }
        }
        drop(bound);
    }
}

/// Collective: every rank states the offset of its buffer inside its bound allocation; they must
/// all be equal.
fn agree_offset(comm: &Communicator, name: &str, offset: u64) -> Result<()> {
    let all = comm.bootstrap().all_gather(&offset.to_le_bytes())?;
    for (rank, bytes) in all.iter().enumerate() {
        let theirs = <[u8; 8]>::try_from(bytes.as_slice())
            .map(u64::from_le_bytes)
            .map_err(|_| Error::Peer {
                rank,
                message: format!("{name}: sent a malformed buffer offset"),
            })?;
        if theirs != offset {
            return Err(Error::InvalidArgument(format!(
                "{name}: rank {} passes a buffer at offset {offset} of its allocation, rank \
                 {rank} at offset {theirs}; zero-copy NVLS needs the same offset on every rank",
                comm.rank()
            )));
        }
    }
    Ok(())
}

impl Algorithm for NvlsAlgorithm {
    fn name(&self) -> &str {
        self.kind.name()
    }

    fn collective(&self) -> Collective {
        Collective::AllReduce
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        check_nvls_args(self.kind, args, self.comm.size(), self.max_bytes()).map(|_| ())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        let count = check_nvls_args(self.kind, args, self.comm.size(), self.max_bytes())?;
        if count == 0 {
            return Ok(());
        }
        let f = self.function(args.dtype)?;
        let threads = args.nthreads.unwrap_or(self.kind.default_threads());
        let resident = self.residency.max_blocks(threads);
        let sm = self.residency.sm;
        // Each kind fills the fields its kernel reads (NvlsArgs); the device addresses are the
        // caller's buffers (checked non-null) and this algorithm's live resources.
        let common = NvlsArgs {
            input: args.input,
            output: args.output,
            bytes: args.input_bytes as u64,
            rank: self.comm.rank() as u32,
            nranks: self.comm.size() as u32,
            ..NvlsArgs::default()
        };
        let (cfg, kargs) = match self.kind {
            NvlsKind::Packet => {
                let scratch = self
                    .scratch
                    .as_ref()
                    .ok_or_else(|| self.missing("scratch"))?;
                let state = self
                    .state
                    .as_ref()
                    .ok_or_else(|| self.missing("call state"))?;
                let cfg = geometry::launch_config(
                    args.nblocks,
                    args.nthreads,
                    geometry::packet_blocks(args.input_bytes, threads, sm),
                    self.kind.default_threads(),
                    sm.min(resident).min(MAX_PACKET_BLOCKS as u32),
                )?;
                let kargs = NvlsArgs {
                    count: count as u64,
                    scratch: scratch.handle()?,
                    state: state.ptr(),
                    error_word: self.comm.error_word_device_ptr(),
                    max_spin: 0,
                    ..common
                };
                (cfg, kargs)
            }
            NvlsKind::ZeroCopy => {
                let sems = self
                    .semaphores
                    .as_ref()
                    .ok_or_else(|| self.missing("semaphores"))?;
                let cfg = geometry::launch_config(
                    args.nblocks,
                    args.nthreads,
                    geometry::bandwidth_blocks(args.input_bytes, sems.max_blocks()),
                    self.kind.default_threads(),
                    sems.max_blocks().min(resident),
                )?;
                let input_channel = self.user_channel(args.input, args.input_bytes)?;
                let output_channel = if args.in_place() {
                    input_channel
                } else {
                    self.user_channel(args.output, args.input_bytes)?
                };
                let kargs = NvlsArgs {
                    input_channel,
                    output_channel,
                    sems: sems.ptr(),
                    ..common
                };
                (cfg, kargs)
            }
            NvlsKind::WarpPipeline | NvlsKind::BlockPipeline => {
                let scratch = self
                    .scratch
                    .as_ref()
                    .ok_or_else(|| self.missing("scratch"))?;
                let sems = self
                    .semaphores
                    .as_ref()
                    .ok_or_else(|| self.missing("semaphores"))?;
                let units_per_block = match self.kind {
                    NvlsKind::WarpPipeline => (threads / 32).max(1),
                    _ => 1,
                };
                let max_blocks = (sems.max_blocks() / units_per_block).max(1).min(resident);
                let cfg = geometry::launch_config(
                    args.nblocks,
                    args.nthreads,
                    geometry::bandwidth_blocks(args.input_bytes, max_blocks),
                    self.kind.default_threads(),
                    max_blocks,
                )?;
                let units = cfg.grid.0 * units_per_block;
                let unit_bytes = pipeline_unit_bytes(self.scratch_bytes, units);
                if unit_bytes == 0 || units > sems.max_blocks() {
                    // Units follow the grid and, for the warp pipeline, the threads of a block.
                    return Err(Error::LaunchShape(format!(
                        "{}: {units} pipeline units do not fit its {} semaphores or {} bytes of \
                         scratch",
                        self.kind.name(),
                        sems.max_blocks(),
                        self.scratch_bytes
                    )));
                }
                let kargs = NvlsArgs {
                    scratch: scratch.handle()?,
                    unit_bytes: unit_bytes as u64,
                    sems: sems.ptr(),
                    ..common
                };
                (cfg, kargs)
            }
        };
        launch_with_args(self.comm.gpu().as_ref(), f, cfg, args.stream, kargs)
    }
}

/// Collective: adds the four NVLS all-reduces to `builder` when `env` opens the NVLS gate and the
/// device supports multicast; returns whether it did. With the gate closed or the hardware unable
/// it adds nothing and touches nothing else (the NVLink algorithms serve every call).
pub fn add_nvls_algorithms(
    comm: &Arc<Communicator>,
    scratch_bytes: usize,
    builder: &mut mscclpp_core::algorithm_collection::AlgorithmCollectionBuilder,
    env: &Env,
) -> Result<bool> {
    if nvls_gate(env).is_err() || !comm.gpu().is_nvls_supported(comm.device())? {
        return Ok(false);
    }
    for kind in NvlsKind::ALL {
        builder.add_algorithm(Arc::new(NvlsAlgorithm::with_env(
            kind,
            comm.clone(),
            scratch_bytes,
            env,
        )?))?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::gpu::{DeviceProperties, Event, LaunchConfig, Module};
    use mscclpp_core::AccumType;
    use rstest::rstest;
    use std::ffi::c_void;

    /// A Gpu that records every call and fails every driver operation: proof that the gate is
    /// decided before the driver is asked anything.
    struct RecordingGpu {
        nvls: bool,
        calls: Mutex<Vec<&'static str>>,
    }

    impl RecordingGpu {
        fn new(nvls: bool) -> Self {
            RecordingGpu {
                nvls,
                calls: Mutex::default(),
            }
        }
        fn record<T>(&self, what: &'static str) -> Result<T> {
            self.calls.lock().expect("calls").push(what);
            Err(Error::Internal(format!("fake driver: {what}")))
        }
        fn calls(&self) -> Vec<&'static str> {
            self.calls.lock().expect("calls").clone()
        }
    }

    impl Gpu for RecordingGpu {
        fn backend_name(&self) -> &'static str {
            "fake"
        }
        fn device_count(&self) -> Result<usize> {
            self.record("device_count")
        }
        fn set_device(&self, _: usize) -> Result<()> {
            self.record("set_device")
        }
        fn current_device(&self) -> Result<usize> {
            self.record("current_device")
        }
        fn properties(&self, _: usize) -> Result<DeviceProperties> {
            self.record("properties")
        }
        fn alloc(&self, _: usize, _: MemoryKind) -> Result<Allocation> {
            self.record("alloc")
        }
        fn free(&self, _: &Allocation) -> Result<()> {
            self.record("free")
        }
        fn memcpy_async(&self, _: DevicePtr, _: DevicePtr, _: usize, _: Stream) -> Result<()> {
            self.record("memcpy_async")
        }
        fn copy_to_device(&self, _: DevicePtr, _: &[u8]) -> Result<()> {
            self.record("copy_to_device")
        }
        fn copy_from_device(&self, _: &mut [u8], _: DevicePtr) -> Result<()> {
            self.record("copy_from_device")
        }
        fn memset_async(&self, _: DevicePtr, _: u8, _: usize, _: Stream) -> Result<()> {
            self.record("memset_async")
        }
        fn create_stream(&self) -> Result<Stream> {
            self.record("create_stream")
        }
        fn destroy_stream(&self, _: Stream) -> Result<()> {
            self.record("destroy_stream")
        }
        fn synchronize_stream(&self, _: Stream) -> Result<()> {
            self.record("synchronize_stream")
        }
        fn synchronize_device(&self) -> Result<()> {
            self.record("synchronize_device")
        }
        fn create_event(&self) -> Result<Event> {
            self.record("create_event")
        }
        fn destroy_event(&self, _: Event) -> Result<()> {
            self.record("destroy_event")
        }
        fn record_event(&self, _: Event, _: Stream) -> Result<()> {
            self.record("record_event")
        }
        fn elapsed_ms(&self, _: Event, _: Event) -> Result<f32> {
            self.record("elapsed_ms")
        }
        fn load_module(&self, _: &[u8]) -> Result<Module> {
            self.record("load_module")
        }
        fn get_function(&self, _: Module, _: &str) -> Result<Function> {
            self.record("get_function")
        }
        unsafe fn launch(
            &self,
            _: Function,
            _: LaunchConfig,
            _: Stream,
            _: &mut [*mut c_void],
        ) -> Result<()> {
            self.record("launch")
        }
        fn is_nvls_supported(&self, _: usize) -> Result<bool> {
            self.calls.lock().expect("calls").push("is_nvls_supported");
            Ok(self.nvls)
        }
    }

    fn env(pairs: &[(&str, &str)]) -> Env {
        Env::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()))).expect("env")
    }

    #[rstest]
    #[case::unset(&[], "MSCCLPP_ENABLE_NVLS is not set")]
    #[case::force_disabled(
        &[("MSCCLPP_ENABLE_NVLS", "1"), ("MSCCLPP_FORCE_DISABLE_NVLS", "1")],
        "MSCCLPP_FORCE_DISABLE_NVLS"
    )]
    #[case::nccl_off(&[("MSCCLPP_ENABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0")], "NCCL_NVLS_ENABLE=0")]
    fn a_closed_gate_refuses_without_touching_the_driver(
        #[case] pairs: &[(&str, &str)],
        #[case] why: &str,
    ) {
        let e = env(pairs);
        for supported in [false, true] {
            let gpu = RecordingGpu::new(supported);
            let err = nvls_available(&gpu, 0, &e).unwrap_err();
            assert!(matches!(err, Error::Unsupported(_)), "{err:?}");
            assert!(err.to_string().contains("NVLS is disabled"), "{err}");
            assert!(err.to_string().contains(why), "{err}");
            assert!(gpu.calls().is_empty(), "driver touched: {:?}", gpu.calls());
        }
    }

    #[test]
    fn an_open_gate_still_needs_the_hardware() {
        let open = env(&[("MSCCLPP_ENABLE_NVLS", "1")]);
        let gpu = RecordingGpu::new(false);
        let err = nvls_available(&gpu, 3, &open).unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err:?}");
        assert!(err.to_string().contains("device 3"), "{err}");
        // Only the capability query, nothing that allocates or creates multicast objects.
        assert_eq!(gpu.calls(), ["is_nvls_supported"]);
        let able = RecordingGpu::new(true);
        nvls_available(&able, 0, &open).expect("gate open and hardware able");
        assert_eq!(able.calls(), ["is_nvls_supported"]);
    }

    /// The test process's own environment must keep the gate closed (suites never set
    /// MSCCLPP_ENABLE_NVLS), so nothing in this crate's tests can build an NVLS algorithm.
    #[test]
    fn the_test_environment_keeps_nvls_closed() {
        let e = Env::get().expect("process environment");
        assert!(!e.nvls_allowed(), "a test process must not enable NVLS");
        let gpu = RecordingGpu::new(true);
        assert!(nvls_available(&gpu, 0, e).is_err());
        assert!(gpu.calls().is_empty());
    }

    fn args(dtype: DataType, bytes: usize) -> ExecuteArgs {
        ExecuteArgs {
            input: 0x1000,
            output: 0x2000,
            input_bytes: bytes,
            output_bytes: bytes,
            dtype,
            op: ReduceOp::Sum,
            accum: AccumType::Auto,
            root: 0,
            stream: Stream::DEFAULT,
            nblocks: None,
            nthreads: None,
        }
    }

    #[rstest]
    #[case(DataType::F32)]
    #[case(DataType::F16)]
    #[case(DataType::Bf16)]
    fn multimem_types_are_accepted(#[case] dtype: DataType) {
        for kind in NvlsKind::ALL {
            let n = check_nvls_args(kind, &args(dtype, 4096), 8, 1 << 20).expect("accepted");
            assert_eq!(n, 4096 / dtype.size());
        }
    }

    #[test]
    fn other_types_ops_and_accumulators_are_refused_by_name() {
        for kind in NvlsKind::ALL {
            for dtype in DataType::ALL {
                if matches!(dtype, DataType::F32 | DataType::F16 | DataType::Bf16) {
                    continue;
                }
                let e = check_nvls_args(kind, &args(dtype, 64), 2, 1 << 20).unwrap_err();
                assert!(matches!(e, Error::Unsupported(_)), "{e}");
                assert!(
                    e.to_string().contains(dtype.name()) && e.to_string().contains(kind.name()),
                    "{e}"
                );
            }
            for op in [ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
                let mut a = args(DataType::Bf16, 64);
                a.op = op;
                let e = check_nvls_args(kind, &a, 2, 1 << 20).unwrap_err();
                assert!(matches!(e, Error::Unsupported(_)), "{e}");
                assert!(e.to_string().contains(op.name()), "{e}");
            }
            let mut a = args(DataType::Bf16, 64);
            a.accum = AccumType::F32;
            let e = check_nvls_args(kind, &a, 2, 1 << 20).unwrap_err();
            assert!(matches!(e, Error::Unsupported(_)), "{e}");
        }
    }

    #[rstest]
    #[case::zero_copy_whole_vectors(NvlsKind::ZeroCopy, 64, 0x1000, true)]
    #[case::zero_copy_partial_vector(NvlsKind::ZeroCopy, 66, 0x1000, false)]
    #[case::zero_copy_misaligned(NvlsKind::ZeroCopy, 64, 0x1008, false)]
    #[case::pipeline_any_size(NvlsKind::BlockPipeline, 66, 0x1002, true)]
    #[case::warp_pipeline_any_size(NvlsKind::WarpPipeline, 2, 0x1002, true)]
    #[case::packet_any_size(NvlsKind::Packet, 6, 0x1002, true)]
    #[case::packet_over_capacity(NvlsKind::Packet, 4098, 0x1000, false)]
    fn shapes(#[case] kind: NvlsKind, #[case] bytes: usize, #[case] input: u64, #[case] ok: bool) {
        let mut a = args(DataType::F16, bytes);
        a.input = input;
        let r = check_nvls_args(kind, &a, 4, 4096);
        assert_eq!(r.is_ok(), ok, "{kind:?} {bytes} {input:#x}: {r:?}");
        if let Err(e) = r {
            assert!(e.to_string().contains(kind.name()), "{e}");
        }
    }

    #[test]
    fn null_pointers_and_short_outputs_are_refused() {
        let mut a = args(DataType::F32, 64);
        a.output_bytes = 60;
        assert!(check_nvls_args(NvlsKind::BlockPipeline, &a, 2, 0).is_err());
        let mut a = args(DataType::F32, 64);
        a.input = 0;
        let e = check_nvls_args(NvlsKind::Packet, &a, 2, 1024).unwrap_err();
        assert!(e.to_string().contains("null input"), "{e}");
        assert!(check_nvls_args(NvlsKind::Packet, &args(DataType::F32, 64), 9, 1024).is_err());
        let empty = ExecuteArgs {
            input: 0,
            output: 0,
            ..args(DataType::F32, 0)
        };
        assert_eq!(
            check_nvls_args(NvlsKind::ZeroCopy, &empty, 2, 0).expect("no-op"),
            0
        );
    }

    #[rstest]
    #[case(2)]
    #[case(8)]
    fn packet_scratch_round_trips(#[case] n: usize) {
        let bytes = packet_scratch_bytes(NVLS_PACKET_THRESHOLD, n);
        assert_eq!(bytes, 2 * n * (NVLS_PACKET_THRESHOLD / 8) * 16);
        assert_eq!(packet_max_bytes(bytes, n), NVLS_PACKET_THRESHOLD);
        // One element short of a packet still takes a whole packet.
        assert_eq!(packet_scratch_bytes(6, n), 2 * n * 16);
    }

    #[test]
    fn pipeline_units_own_whole_vectors() {
        assert_eq!(pipeline_unit_bytes(8 << 20, 32), 256 << 10);
        assert_eq!(pipeline_unit_bytes(1000, 3) % VECTOR_BYTES, 0);
        assert_eq!(pipeline_unit_bytes(1000, 3), 320);
        // The semaphore budget of the three NVLS kinds leaves most of the 1024 per peer.
        let total: u32 = NvlsKind::ALL.iter().map(|k| k.semaphore_units()).sum();
        assert_eq!(total, 2 * MAX_NVLS_BLOCKS + MAX_NVLS_WARPS);
        assert!(total <= 256);
    }

    #[test]
    fn names_are_the_collection_names() {
        for k in NvlsKind::ALL {
            assert!(k.name().starts_with("default_allreduce_nvls_"), "{k:?}");
            assert!(k.name().ends_with(
                k.kernel()
                    .entry_point()
                    .trim_start_matches("allreduce_nvls_")
            ));
        }
    }

    /// Every NVLS unit compiles through NVRTC for sm_90 and sm_100 (multimem) and sm_80 (the trap
    /// path), with the static_asserts of `NvlsArgs` against its Rust layout. Needs NVRTC and the CUDA headers (`source scripts/nvrtc-env.sh`); skipped with a
    /// printed reason otherwise, unless MSCCLPP_REQUIRE_NVRTC=1. Compiling launches nothing.
    #[test]
    fn nvls_units_compile_for_sm_80_90_100() {
        use mscclpp_cuda::compile_test::{compile_cubin, nvrtc_or_skip};
        let Some(nvrtc) = nvrtc_or_skip("nvls_units_compile_for_sm_80_90_100") else {
            return;
        };
        for dtype in mscclpp_kernels_cu::nvls_units::NVLS_DTYPES {
            let name = nvls_unit_name(dtype).expect("name");
            let source = nvls_unit_source(dtype).expect("source")
                + &mscclpp_kernels_cu::nvls_units::layout_asserts();
            for arch in ["sm_80", "sm_90", "sm_100"] {
                compile_cubin(&nvrtc, &name, &source, arch, mscclpp_kernels_cu::HEADERS);
            }
        }
    }
}
