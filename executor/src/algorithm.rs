//! `PlanAlgorithm`: an execution plan run by the GPU interpreter (`kernels-cu` executor.cu) as an
//! [`Algorithm`] of the collection, under the plan's name.
//!
//! Set-up (collective, when a plan is loaded, so a collection without plans costs nothing): the
//! rank's ops are encoded ([`crate::encode`]) and uploaded with the interpreter's device state
//! (channel semaphores, local semaphores, barrier counters, per-threadblock execution counters) in
//! one allocation; one D2D semaphore pair per memory channel of the plan, paired with the peer's
//! channel of the same ordinal (as the CPU reference pairs them); a scratch every peer maps, sized
//! for the plan's largest message up to [`MAX_PLAN_SCRATCH_BYTES`] per rank.
//! Every execute agrees on every rank's user buffers with its peers (one bootstrap all-gather,
//! host only, `mscclpp_collectives::user_buffers`), so an execute is one launch with its buffer
//! table passed by value: no host sync, no per-call upload, legal under graph capture.
//! The launch may overlap the stream's previous kernel (programmatic launch, as the natives'), and
//! each plan threadblock runs as one or more blocks, more for larger chunks where the plan allows
//! it (`replicas_for`, executor.cu's "Replicas"). A rank's program of at most
//! `MAX_SPECIALISED_DATA_OPS` data ops is compiled into its unit instead of interpreted
//! (executor.cu's "Specialised units"), with no more warps than a chunk has units
//! (`call_threads`).
//!
//! Plans with port channels are staged: the host proxy copies between memories registered before
//! it starts, while callers pass new buffers on every call. Each rank gets one block (scratch,
//! then input and output staging, mapped by every peer and registered with the proxy); an execute
//! copies the input in, launches, and copies the output back (stream-ordered copy-engine copies,
//! legal under graph capture). One PortChannel per port channel of the plan, paired with the
//! peer's channel of the same ordinal, puts from this rank's block into the peer's (one proxy per
//! plan, started at set-up).

use crate::encode::{encode, packet_bytes, unit_bytes, EncodedPlan, Replication};
use crate::plan::{BufferType, ChannelType, Collective as PlanCollective, Plan, PlanReduceOp};
use crate::reference::plan_reduce_op;
use mscclpp_collectives::geometry::{Residency, RESIDENT_THREADS_PER_SM};
use mscclpp_collectives::port_allreduce::proxy_connections;
use mscclpp_collectives::resources::{DeviceBuffer, SharedScratch};
use mscclpp_collectives::user_buffers::{UserBuffer, UserBufferTable};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::SelectionContext;
use mscclpp_core::communicator::Communicator;
use mscclpp_core::device::{D2DSemaphoreHandle, PortChannelHandle};
use mscclpp_core::gpu::{DevicePtr, Function, LaunchConfig};
use mscclpp_core::port_channel::{shared_queue_hazard, PortChannelConfig, PortChannelService};
use mscclpp_core::transport::MemoryRegion;
use mscclpp_core::{DataType, Error, ReduceOp, Result};
use mscclpp_kernels_cu::executor::{
    self as kx, OpKind, PlanArgs, PlanFeatures, PlanRef, FIRST_REMOTE_SLOT,
};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Largest scratch (bytes per rank) a plan gets; a message whose scratch would not fit is refused
/// by `check` naming both sizes. A plan's `max_message_size` is often unbounded, so the plan is
/// sized for the smaller of the two.
pub const MAX_PLAN_SCRATCH_BYTES: usize = 8 << 20;

/// The plan's collective in the core's terms.
pub fn core_collective(c: PlanCollective) -> Result<Collective> {
    Ok(match c {
        PlanCollective::Allreduce => Collective::AllReduce,
        PlanCollective::Allgather => Collective::AllGather,
        PlanCollective::Reducescatter => Collective::ReduceScatter,
        PlanCollective::Alltoall => Collective::AllToAll,
        PlanCollective::Broadcast => Collective::Broadcast,
        PlanCollective::Sendrecv => Collective::SendRecv,
        PlanCollective::Reduce => {
            return Err(Error::Unsupported(
                "plans of collective `reduce`: the runtime has no reduce collective to run them as"
                    .into(),
            ))
        }
    })
}

fn core_op(op: PlanReduceOp) -> ReduceOp {
    match op {
        PlanReduceOp::Sum => ReduceOp::Sum,
        PlanReduceOp::Min => ReduceOp::Min,
        PlanReduceOp::Max => ReduceOp::Max,
        PlanReduceOp::Prod => ReduceOp::Prod,
    }
}

/// Byte offsets of the parts of the interpreter's device state.
#[derive(Debug, Clone, Copy, Default)]
struct StateLayout {
    ops: usize,
    tb_starts: usize,
    refs: usize,
    ids: usize,
    channels: usize,
    port_channels: usize,
    semaphores: usize,
    barriers: usize,
    flags: usize,
    end: usize,
}

/// Where a staged (port-channel) plan's input and output lie in every rank's block, and the
/// largest chunk they hold. In-place plans have one area, viewed as MSCCL++'s in-place rules say.
#[derive(Debug, Clone, Copy)]
struct Staging {
    input: usize,
    output: usize,
    max_chunk: usize,
}

/// One plan, set up for one communicator. See the module docs.
pub struct PlanAlgorithm {
    // Field order is drop order: the proxy stops first (nothing copies into the blocks after),
    // device resources go before the communicator. In a mutex: the service is `Send`, not `Sync`.
    proxy: Option<Mutex<PortChannelService>>,
    functions: Mutex<HashMap<(DataType, DataType, ReduceOp), Function>>,
    user_buffers: UserBufferTable,
    state: DeviceBuffer,
    /// Owned for its lifetime only: the kernel reaches it through `block_ptrs`.
    _block: Option<SharedScratch>,
    /// Every rank's block: its scratch from offset 0, then the staging areas of staged plans.
    block_ptrs: Vec<DevicePtr>,
    staging: Option<Staging>,
    layout: StateLayout,
    plan: Arc<Plan>,
    collective: Collective,
    reduce_op: ReduceOp,
    threadblocks: u32,
    /// Whether (and at what price) a threadblock may run as several blocks.
    replication: Replication,
    /// What this rank's ops use: its interpreter unit leaves out the rest.
    features: PlanFeatures,
    /// Dynamic shared memory of a block: the largest threadblock program, which every block
    /// copies there first (`encode` refuses programs that do not fit).
    program_bytes: u32,
    /// This rank's program where its unit has it compiled in ([`specialises`]), read by no
    /// interpreter then.
    specialised: Option<EncodedPlan>,
    /// Most blocks this rank's grid may have where they wait for each other (a plan's
    /// threadblocks, replicas that meet), so that all must be resident at once
    /// ([`Residency::max_meeting_blocks`]).
    max_threadblocks: u32,
    /// Most blocks where they never wait for each other, only for the peers' blocks (replicas
    /// that never meet, [`Replication::Free`]).
    max_free_blocks: u32,
    /// Bytes of one scratch copy (a half for LL plans).
    scratch_half_bytes: usize,
    comm: Arc<Communicator>,
}

impl PlanAlgorithm {
    /// Collective: every rank loads the same plan in the same order.
    pub fn new(comm: Arc<Communicator>, plan: Arc<Plan>) -> Result<PlanAlgorithm> {
        let what = |e: String| Error::InvalidArgument(format!("plan {}: {e}", plan.name));
        let (rank, size) = (comm.rank(), comm.size());
        if plan.world_size() != size {
            return Err(what(format!(
                "written for {} ranks, the communicator has {size}",
                plan.world_size()
            )));
        }
        let first = &plan.gpus[0];
        if let Some((r, g)) = plan.gpus.iter().enumerate().find(|(_, g)| {
            (g.input_chunks, g.output_chunks) != (first.input_chunks, first.output_chunks)
        }) {
            // Every rank cuts the same message into chunks of one size, and peers' buffers are
            // reached by their chunk indices.
            return Err(what(format!(
                "gpus[{r}] has {} input and {} output chunks, gpus[0] {} and {}",
                g.input_chunks, g.output_chunks, first.input_chunks, first.output_chunks
            )));
        }
        let collective = core_collective(plan.collective)?;
        let nvls = mscclpp_core::env::Env::get()
            .map(|e| e.nvls_allowed())
            .unwrap_or(false);
        let encoded = encode(&plan, rank, nvls).map_err(|e| {
            Error::Unsupported(format!("plan {} cannot run on the GPU: {e}", plan.name))
        })?;
        let reduce_op = plan_reduce_op(&plan).map_err(|e| what(e.to_string()))?;
        // Every rank decides alike (the block and the proxy's connections are collective).
        let staged = is_staged(&plan);
        if staged {
            if let Some(hazard) =
                shared_queue_hazard(mscclpp_core::env::Env::get()?, comm.mps_clients_per_gpu())
            {
                return Err(Error::Unsupported(format!(
                    "plan {} (port channels): {hazard}",
                    plan.name
                )));
            }
        }
        let channels = channel_semaphores(&comm, &plan, &encoded)?;
        let scratch_half_bytes = scratch_bytes(&plan, max_chunk_bytes(&plan));
        let copies = if plan.protocol == crate::plan::Protocol::Simple {
            1
        } else {
            2
        };
        let scratch_end = (scratch_half_bytes * copies).next_multiple_of(16);
        let staging = staged.then(|| staging_layout(&plan, scratch_end));
        let block_bytes = staging.map_or(scratch_end, |s| {
            s.output + (s.max_chunk * staged_chunks(&plan)).next_multiple_of(16)
        });
        let block = if block_bytes > 0 {
            Some(SharedScratch::new(&comm, block_bytes)?)
        } else {
            None
        };
        let block_ptrs = block
            .as_ref()
            .map_or_else(|| vec![0; size], SharedScratch::rank_ptrs);
        let (proxy, ports) = match &block {
            Some(block) if staged => {
                let (service, handles) = port_channels(&comm, &plan, &encoded, block, block_bytes)?;
                (Some(Mutex::new(service)), handles)
            }
            _ => (None, Vec::new()),
        };
        let (layout, bytes) = state_bytes(&encoded, &channels, &ports);
        let state = DeviceBuffer::upload(comm.gpu(), &bytes)?;
        // A block of the interpreter may use a whole SM's registers (kx::MAX_BLOCK_THREADS).
        let residency = Residency::of(&comm)?;
        let max_threadblocks = residency.max_meeting_blocks(RESIDENT_THREADS_PER_SM);
        let max_free_blocks = residency.max_blocks(RESIDENT_THREADS_PER_SM);
        let replication = encoded.replication();
        tracing::debug!(
            target: "mscclpp::plan",
            "plan {} on rank {}: {} threadblocks, replicas {replication:?}; grids of at most \
             {max_threadblocks} blocks that meet ({residency:?})",
            plan.name,
            comm.rank(),
            encoded.threadblocks()
        );
        Ok(PlanAlgorithm {
            proxy,
            functions: Mutex::default(),
            user_buffers: UserBufferTable::new(format!("plan {}", plan.name)),
            state,
            _block: block,
            block_ptrs,
            staging,
            layout,
            threadblocks: encoded.threadblocks() as u32,
            replication,
            features: encoded.features(),
            program_bytes: encoded.largest_program_bytes() as u32,
            specialised: specialises(&encoded).then(|| encoded.clone()),
            max_threadblocks,
            max_free_blocks,
            collective,
            reduce_op: core_op(reduce_op),
            scratch_half_bytes,
            plan,
            comm,
        })
    }

    pub fn plan(&self) -> &Arc<Plan> {
        &self.plan
    }

    /// The reduction the plan's reducing ops apply (a call must ask for this one).
    pub fn reduce_op(&self) -> ReduceOp {
        self.reduce_op
    }

    /// Message sizes (input bytes per rank) the plan takes: its own range, capped by the scratch
    /// (and staging) of its set-up. The same as [`runnable_message_range`] of the plan.
    pub fn message_range(&self) -> (u64, u64) {
        range_within(&self.plan, self.scratch_half_bytes, self.staging)
    }

    /// Chunks this rank's input is cut into: a call's input must be a whole number of elements
    /// a chunk.
    pub fn input_chunks(&self) -> usize {
        self.plan.gpus[self.comm.rank()].input_chunks.max(1) as usize
    }

    /// The widest element the plan's protocol carries (an LL8 packet's payload, or any).
    pub fn widest_element(&self) -> usize {
        unit_bytes(self.plan.protocol) as usize
    }

    /// Bytes per chunk for `args`, after every check of the call against the plan.
    fn chunk_bytes(&self, args: &ExecuteArgs) -> Result<usize> {
        let name = &self.plan.name;
        let rank = self.comm.rank();
        let bad = |why: String| Err(Error::Unsupported(format!("plan {name}: {why}")));
        if args.dtype.size() > self.widest_element() {
            return bad(format!(
                "{} elements are wider than the {}-byte payload of an LL8 packet",
                args.dtype,
                unit_bytes(self.plan.protocol)
            ));
        }
        if self.collective.reduces() && args.op != self.reduce_op {
            return bad(format!(
                "the plan reduces with {}, the call asks for {}",
                self.reduce_op, args.op
            ));
        }
        let (min, max) = self.message_range();
        let bytes = args.input_bytes as u64;
        if bytes < min || bytes > max {
            return bad(format!(
                "{bytes}-byte input outside the plan's range {min}..={max} bytes"
            ));
        }
        let gpu = &self.plan.gpus[rank];
        let chunks = self.input_chunks();
        let unit = chunks * args.dtype.size();
        if args.input_bytes % unit != 0 {
            return Err(Error::InvalidArgument(format!(
                "plan {name}: a {}-byte input does not cut into {chunks} chunks of whole {} elements",
                args.input_bytes, args.dtype
            )));
        }
        let chunk = args.input_bytes / chunks;
        let out_needed = gpu.output_chunks as usize * chunk;
        if args.output_bytes < out_needed {
            return Err(Error::InvalidArgument(format!(
                "plan {name}: output of {} bytes, the plan writes {} chunks of {chunk} bytes",
                args.output_bytes, gpu.output_chunks
            )));
        }
        let in_place = SelectionContext::buffers_in_place(self.collective, args, rank);
        if self.plan.inplace != in_place {
            return bad(format!(
                "the plan is {}, the call's buffers are {}",
                mode(self.plan.inplace),
                mode(in_place)
            ));
        }
        if scratch_bytes(&self.plan, chunk) > self.scratch_half_bytes {
            return bad(format!(
                "chunks of {chunk} bytes need more than the plan's {} bytes of scratch",
                self.scratch_half_bytes
            ));
        }
        Ok(chunk)
    }

    /// Blocks per plan threadblock for chunks of `chunk` bytes ([`replicas_for`]), within what
    /// stays resident beside the plan's other threadblocks.
    fn replicas(&self, chunk: usize) -> u32 {
        let blocks = match self.replication {
            Replication::Free => self.max_free_blocks,
            Replication::Never | Replication::Synced => self.max_threadblocks,
        };
        replicas_for(
            self.replication,
            block_threads(&self.plan),
            unit_bytes(self.plan.protocol),
            chunk,
            blocks / self.threadblocks.max(1),
        )
    }

    /// Every rank's input and output for chunks of `chunk` bytes: the staging areas of a staged
    /// plan, or the caller's buffers, agreed for this call (collective, `user_buffers`).
    fn rank_buffers(&self, args: &ExecuteArgs, chunk: usize) -> Result<[Vec<DevicePtr>; 2]> {
        let n = self.comm.size();
        let gpu = &self.plan.gpus[self.comm.rank()];
        let out_bytes = gpu.output_chunks as usize * chunk;
        let agree = |buffers: &[UserBuffer]| self.user_buffers.agree(&self.comm, buffers);
        let (inputs, outputs) = match self.staging {
            Some(s) => {
                let at = |off: usize| -> Vec<DevicePtr> {
                    self.block_ptrs.iter().map(|&b| b + off as u64).collect()
                };
                (at(s.input), at(s.output))
            }
            None if !self.plan.inplace => {
                let agreed = agree(&[
                    UserBuffer::new(args.input, args.input_bytes),
                    UserBuffer::new(args.output, out_bytes),
                ])?;
                (agreed.ptrs(0), agreed.ptrs(1))
            }
            None => {
                let one = match self.collective {
                    Collective::AllGather => UserBuffer::new(args.output, out_bytes),
                    Collective::ReduceScatter => UserBuffer::new(args.input, args.input_bytes),
                    _ => UserBuffer::new(args.input, args.input_bytes.max(out_bytes)),
                };
                let base = agree(&[one])?.ptrs(0);
                (base.clone(), base)
            }
        };
        if !self.plan.inplace {
            return Ok([inputs, outputs]);
        }
        // In place: one buffer per rank, viewed by MSCCL++'s rules (all-gather input is the
        // rank's slice of the output, reduce-scatter output the rank's slice of the input).
        let slices = |base: &[DevicePtr], chunks: u32| -> Vec<DevicePtr> {
            (0..n)
                .map(|p| base[p] + (p * chunks as usize * chunk) as u64)
                .collect()
        };
        Ok(match self.collective {
            Collective::AllGather => [slices(&outputs, gpu.input_chunks), outputs],
            Collective::ReduceScatter => {
                let outputs = slices(&inputs, gpu.output_chunks);
                [inputs, outputs]
            }
            _ => [inputs, outputs],
        })
    }

    /// Refuses a plan whose threadblocks could not all be resident at once on this rank's SMs
    /// (they would wait for each other until the device timeout).
    fn check_residency(&self) -> Result<()> {
        if self.threadblocks > self.max_threadblocks {
            return Err(Error::Unsupported(format!(
                "plan {}: {} threadblocks on rank {}, more than the {} its share of the GPU keeps \
                 resident at once ({} threads each)",
                self.plan.name,
                self.threadblocks,
                self.comm.rank(),
                self.max_threadblocks,
                block_threads(&self.plan)
            )));
        }
        Ok(())
    }

    /// The first proxy error not reported yet (a failed copy, signal or flush); host only.
    fn check_proxy(&self) -> Result<()> {
        let Some(proxy) = &self.proxy else {
            return Ok(());
        };
        let service = proxy.lock().map_err(|_| {
            Error::Internal(format!(
                "plan {}: the proxy was poisoned by a panic",
                self.plan.name
            ))
        })?;
        service.check().map_err(|e| {
            Error::Internal(format!(
                "plan {}: the PortChannel proxy reported: {e}",
                self.plan.name
            ))
        })
    }

    /// The unit for the call's types: this rank's program compiled in, or the interpreter.
    fn unit_source(&self, args: &ExecuteArgs) -> Result<(String, String)> {
        match &self.specialised {
            Some(enc) => kx::specialised_unit_source(
                args.dtype,
                args.accum,
                self.reduce_op,
                self.features,
                &enc.static_program(),
            ),
            None => kx::unit_source(args.dtype, args.accum, self.reduce_op, self.features),
        }
    }

    /// The call's (type, accumulator, op): its unit; an error names a pair no unit is offered for.
    fn function_key(&self, args: &ExecuteArgs) -> Result<(DataType, DataType, ReduceOp)> {
        let acc = mscclpp_kernels_cu::collectives::resolve_accumulator(args.dtype, args.accum)?;
        Ok((args.dtype, acc, self.reduce_op))
    }

    /// The call's kernel, its unit built (compiled or loaded from the kernel cache) on the first
    /// call of its key: the source (the interpreter's text, a program's code) is written only then,
    /// not on every call.
    fn function(&self, args: &ExecuteArgs) -> Result<Function> {
        let key = self.function_key(args)?;
        let mut functions = self
            .functions
            .lock()
            .map_err(|_| Error::Internal("plan kernel table poisoned".into()))?;
        if let Some(f) = functions.get(&key) {
            return Ok(*f);
        }
        let (name, source) = self.unit_source(args)?;
        let gpu = self.comm.gpu();
        let module = gpu.build_module(&name, &source)?;
        let f = gpu.get_function(module, kx::ENTRY)?;
        functions.insert(key, f);
        Ok(f)
    }
}

/// Threads per block of the plan's grid: its `num_threads_per_block` as a launchable block size,
/// at most the interpreter's [`kx::MAX_BLOCK_THREADS`] (executor.cu, "Block size").
fn block_threads(plan: &Plan) -> u32 {
    plan.num_threads_per_block.clamp(32, kx::MAX_BLOCK_THREADS) / 32 * 32
}

/// Data ops of a rank's program up to which its unit has the program compiled in
/// (`kx::specialised_unit_source`): each costs its own optimised code, 1-2 s of NVRTC's time on
/// one core (and each other op a fraction of that; threadblocks of one shape share theirs), once
/// per machine (the kernel cache). The 2-rank fixture plans have at most 8 and compile in 1-9 s,
/// where the interpreter's unit takes ~3 s; the builder's 8-rank Simple all-reduce (15 data ops
/// in one threadblock) took 34 s on a busy core.
const MAX_SPECIALISED_DATA_OPS: usize = 8;

/// Whether this rank's program is compiled into its unit: it has at most
/// [`MAX_SPECIALISED_DATA_OPS`] data ops.
fn specialises(enc: &EncodedPlan) -> bool {
    data_ops(enc) <= MAX_SPECIALISED_DATA_OPS
}

/// Data ops of a rank's program, over all its threadblocks.
fn data_ops(enc: &EncodedPlan) -> usize {
    enc.ops
        .iter()
        .filter(|op| op.kind == OpKind::Data as u8)
        .count()
}

/// Threads per block for chunks of `chunk` bytes: [`block_threads`], or the fewest whole warps
/// that give every unit of a chunk a thread where a chunk has fewer units (no op part has more
/// units than a chunk, and no thread beyond an op's units does any of its work). Every thread of a
/// block walks the interpreter's bookkeeping of every op and meets the others at every op's
/// barrier: at 1 KiB a 2-rank all-reduce plan's chunks are 64-256 bytes, 8-32 units, which one
/// warp moves while fifteen more only added their bookkeeping to each op's time.
fn call_threads(plan: &Plan, chunk: usize) -> u32 {
    let units = chunk.div_ceil(unit_bytes(plan.protocol) as usize).max(1);
    let warps = units.div_ceil(32).min(kx::MAX_BLOCK_THREADS as usize / 32) as u32;
    block_threads(plan).min(warps * 32)
}

/// Blocks per plan threadblock for chunks of `chunk` bytes, at most `fit` (and
/// [`kx::MAX_REPLICAS`]). Without meetings, one per `threads` units of a chunk (a unit per
/// thread and pass). Up to 64 rather than 16: plans of few threadblocks (the one-phase LL
/// fixtures) took less time with more. Where the replicas meet around signals (and between cuts),
/// none below 16 x `threads` units, then one per 2 x `threads` units, a power of two: that
/// measured faster than one per 8 x `threads` units from 8 x `threads` (replicas that start
/// earlier slowed small Simple plans), and a number of replicas that is not a power of two made
/// the reduce fixtures slower. At most [`MAX_MEETING_REPLICAS`]. A local choice: peers may pick differently
/// (executor.cu, "Replicas").
fn replicas_for(
    replication: Replication,
    threads: u32,
    unit_bytes: u32,
    chunk: usize,
    fit: u32,
) -> u32 {
    let threads = u64::from(threads);
    let units = (chunk as u64).div_ceil(u64::from(unit_bytes));
    let most = fit.clamp(1, kx::MAX_REPLICAS);
    match replication {
        Replication::Never => 1,
        Replication::Free => (units / threads).clamp(1, u64::from(most)) as u32,
        Replication::Synced if units < 16 * threads => 1,
        Replication::Synced => {
            let most = most.min(MAX_MEETING_REPLICAS);
            let n = (units / (2 * threads)).clamp(1, u64::from(most)) as u32;
            1 << n.ilog2()
        }
    }
}

/// Most replicas of a threadblock that meet: the most that have met on a GPU, as a power of two
/// (ranks sharing one H200 under MPS, whose residency cap is 33 there). 64 would run the reduce
/// fixtures from 4 MiB on GPUs the ranks own; not before a run there has checked and timed them
/// (docs/pending-gpu-checks.md).
const MAX_MEETING_REPLICAS: u32 = 32;

fn mode(in_place: bool) -> &'static str {
    if in_place {
        "in place"
    } else {
        "out of place"
    }
}

/// Message sizes (input bytes per rank) `plan` runs with: its own `min_message_size..=
/// max_message_size`, capped by the scratch and staging areas its set-up gets (at most
/// [`MAX_PLAN_SCRATCH_BYTES`] per rank). A call outside it is refused naming this range; callers
/// that pick sizes (a selector, a test) read it here without setting the plan up.
pub fn runnable_message_range(plan: &Plan) -> (u64, u64) {
    let scratch_half_bytes = scratch_bytes(plan, max_chunk_bytes(plan));
    // The staging's largest chunk does not depend on where the scratch ends.
    let staging = is_staged(plan).then(|| staging_layout(plan, 0));
    range_within(plan, scratch_half_bytes, staging)
}

/// Whether `plan` has port channels, so its set-up stages the caller's buffers.
fn is_staged(plan: &Plan) -> bool {
    plan.gpus
        .iter()
        .any(|g| !g.channel_peers(ChannelType::Port).is_empty())
}

/// `plan`'s range within a scratch copy of `scratch_half_bytes` and the staging `staging`.
fn range_within(plan: &Plan, scratch_half_bytes: usize, staging: Option<Staging>) -> (u64, u64) {
    let chunks = plan.gpus[0].input_chunks.max(1) as u64;
    let unit = unit_bytes(plan.protocol) as u64;
    let mut max = plan.max_message_size;
    if scratch_half_bytes > 0 {
        let per_chunk = scratch_half_bytes as u64 / scratch_chunks(plan).max(1) as u64;
        let chunk_cap = if plan.protocol == crate::plan::Protocol::Simple {
            per_chunk
        } else {
            per_chunk / packet_bytes(plan.protocol) as u64 * unit
        };
        max = max.min(chunk_cap * chunks);
    }
    if let Some(s) = staging {
        max = max.min((s.max_chunk as u64) * chunks);
    }
    (plan.min_message_size, max)
}

/// The largest chunk the plan's messages have (its `max_message_size` over its input chunks),
/// capped so that the scratch stays within [`MAX_PLAN_SCRATCH_BYTES`].
fn max_chunk_bytes(plan: &Plan) -> usize {
    let chunks = plan
        .gpus
        .iter()
        .map(|g| g.input_chunks)
        .max()
        .unwrap_or(1)
        .max(1) as u64;
    // A chunk never takes less scratch than its own bytes, so the cap bounds the search.
    let mut chunk = (plan.max_message_size / chunks).min(MAX_PLAN_SCRATCH_BYTES as u64) as usize;
    while chunk > 0 && 2 * scratch_bytes(plan, chunk) > MAX_PLAN_SCRATCH_BYTES {
        chunk /= 2;
    }
    chunk
}

/// The most scratch chunks any rank of `plan` uses.
fn scratch_chunks(plan: &Plan) -> usize {
    plan.gpus
        .iter()
        .map(|g| g.scratch_chunks)
        .max()
        .unwrap_or(0) as usize
}

/// Bytes of one scratch copy for chunks of `chunk` bytes: plain chunks for Simple, whole packets
/// per chunk for LL.
fn scratch_bytes(plan: &Plan, chunk: usize) -> usize {
    let chunks = scratch_chunks(plan);
    let per_chunk = match packet_bytes(plan.protocol) {
        0 => chunk,
        pkt => chunk
            .div_ceil(unit_bytes(plan.protocol) as usize)
            .saturating_mul(pkt as usize),
    };
    chunks
        .saturating_mul(per_chunk)
        .checked_next_multiple_of(16)
        .unwrap_or(usize::MAX)
}

/// Chunks of a staged plan's data area(s): input and output, or one area for in-place plans.
fn staged_chunks(plan: &Plan) -> usize {
    let max = |f: fn(&crate::plan::Gpu) -> u32| plan.gpus.iter().map(f).max().unwrap_or(0) as usize;
    let (i, o) = (max(|g| g.input_chunks), max(|g| g.output_chunks));
    if plan.inplace {
        i.max(o)
    } else {
        i + o
    }
}

/// The staging areas after the scratch (which ends at `scratch_end`): chunks up to the plan's
/// largest, with all of them within [`MAX_PLAN_SCRATCH_BYTES`].
fn staging_layout(plan: &Plan, scratch_end: usize) -> Staging {
    let chunks = staged_chunks(plan).max(1);
    let max_chunk = max_chunk_bytes(plan).min(MAX_PLAN_SCRATCH_BYTES / chunks);
    let output = if plan.inplace {
        scratch_end
    } else {
        let inputs = plan.gpus.iter().map(|g| g.input_chunks).max().unwrap_or(0) as usize;
        scratch_end + (inputs * max_chunk).next_multiple_of(16)
    };
    Staging {
        input: scratch_end,
        output,
        max_chunk,
    }
}

/// Collective: the proxy and a PortChannel per port channel of this rank (by global index),
/// putting from this rank's block into the peer's, started. Semaphores are made per peer in
/// ascending order, as many as the larger of the two ranks' channel counts, so this rank's k-th
/// channel to a peer pairs with the peer's k-th channel to it.
fn port_channels(
    comm: &Arc<Communicator>,
    plan: &Plan,
    enc: &EncodedPlan,
    block: &SharedScratch,
    block_bytes: usize,
) -> Result<(PortChannelService, Vec<PortChannelHandle>)> {
    let me = comm.rank();
    let counts: Vec<(usize, usize)> = (0..comm.size())
        .filter(|&p| p != me)
        .map(|p| {
            let mine = enc.port_channel_peers.iter().filter(|&&q| q == p).count();
            let theirs = plan.gpus[p]
                .channel_peers(ChannelType::Port)
                .into_iter()
                .filter(|&q| q == me)
                .count();
            (p, mine.max(theirs))
        })
        .filter(|&(_, count)| count > 0)
        .collect();
    let peers: Vec<usize> = counts.iter().map(|&(p, _)| p).collect();
    let connections = proxy_connections(comm, &peers, &[(block.local_ptr(), block_bytes)])?;
    let mut service = PortChannelService::new(comm, PortChannelConfig::default())?;
    let region = |addr| MemoryRegion {
        addr,
        size: block_bytes as u64,
        key: 0,
    };
    let local = service.add_memory_region(region(block.local_ptr()))?;
    let blocks = block.rank_ptrs();
    let mut handles = vec![PortChannelHandle::default(); enc.port_channel_peers.len()];
    for (&(peer, count), conn) in counts.iter().zip(connections) {
        let dst = service.add_memory_region(region(blocks[peer]))?;
        let mut semaphores = Vec::with_capacity(count);
        for _ in 0..count {
            semaphores.push(service.add_semaphore(comm, conn.clone())?);
        }
        let mine = (0..handles.len()).filter(|&c| enc.port_channel_peers[c] == peer);
        for (c, sem) in mine.collect::<Vec<_>>().into_iter().zip(semaphores) {
            handles[c] = service.port_channel(sem, dst, local)?;
        }
    }
    service.start()?;
    Ok((service, handles))
}

/// Collective: a D2D semaphore per memory channel, in ascending peer order on every rank (as the
/// collection's semaphore table is made); this rank's k-th channel to a peer pairs with the peer's
/// k-th channel to it. Both sides create as many as the larger of their channel counts.
fn channel_semaphores(
    comm: &Communicator,
    plan: &Plan,
    enc: &EncodedPlan,
) -> Result<Vec<D2DSemaphoreHandle>> {
    let me = comm.rank();
    let mut handles = vec![D2DSemaphoreHandle::default(); enc.channel_peers.len()];
    for peer in (0..comm.size()).filter(|&p| p != me) {
        let mine: Vec<usize> = (0..enc.channel_peers.len())
            .filter(|&c| enc.channel_peers[c] == peer)
            .collect();
        let theirs = plan.gpus[peer]
            .channel_peers(ChannelType::Memory)
            .into_iter()
            .filter(|&p| p == me)
            .count();
        let count = mine.len().max(theirs);
        if count == 0 {
            continue;
        }
        let made = comm.d2d_semaphores(peer, count)?;
        for (c, h) in mine.into_iter().zip(made) {
            handles[c] = h;
        }
    }
    Ok(handles)
}

/// The interpreter's device state as one blob (8-byte aligned parts) and where each part is.
fn state_bytes(
    enc: &EncodedPlan,
    channels: &[D2DSemaphoreHandle],
    ports: &[PortChannelHandle],
) -> (StateLayout, Vec<u8>) {
    fn put<T: Copy>(out: &mut Vec<u8>, items: &[T]) -> usize {
        out.resize(out.len().next_multiple_of(8), 0);
        let at = out.len();
        // SAFETY: `T` is one of the plain `#[repr(C)]` integer structs of the device ABI.
        let raw = unsafe {
            std::slice::from_raw_parts(items.as_ptr() as *const u8, std::mem::size_of_val(items))
        };
        out.extend_from_slice(raw);
        at
    }
    let mut out = Vec::new();
    let (ops, tb_starts) = enc.device_program();
    let refs: &[PlanRef] = &enc.refs;
    let layout = StateLayout {
        ops: put(&mut out, &ops),
        tb_starts: put(&mut out, &tb_starts),
        refs: put(&mut out, refs),
        ids: put(&mut out, &enc.ids),
        channels: put(&mut out, channels),
        port_channels: put(&mut out, ports),
        semaphores: put(&mut out, &enc.semaphores),
        barriers: put(&mut out, &vec![0u64; enc.barriers as usize]),
        flags: put(&mut out, &vec![0u32; kx::TB_WORDS * enc.threadblocks()]),
        end: 0,
    };
    out.resize(out.len().next_multiple_of(8) + 8, 0);
    let end = out.len();
    (StateLayout { end, ..layout }, out)
}

impl Algorithm for PlanAlgorithm {
    fn name(&self) -> &str {
        &self.plan.name
    }

    fn collective(&self) -> Collective {
        self.collective
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        if args.input_bytes == 0 {
            return Ok(());
        }
        self.check_residency()?;
        self.chunk_bytes(args)?;
        self.function_key(args).map(|_| ())
    }

    /// `check`, then the host work of `execute` that must not run while a peer's kernel in this
    /// process waits for this rank: compiling and loading the interpreter for the call's types and
    /// registering the call's buffers with every peer (collective, so every rank of the group
    /// prepares before any launches).
    fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        if args.input_bytes == 0 {
            return Ok(());
        }
        self.check_residency()?;
        let chunk = self.chunk_bytes(args)?;
        self.function(args)?;
        self.rank_buffers(args, chunk).map(|_| ())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        if args.input_bytes == 0 {
            return Ok(());
        }
        self.check_residency()?;
        let chunk = self.chunk_bytes(args)?;
        self.check_proxy()?;
        let f = self.function(args)?;
        let rank = self.comm.rank();
        let [inputs, outputs] = self.rank_buffers(args, chunk)?;
        let gpu = self.comm.gpu();
        let out_bytes = self.plan.gpus[rank].output_chunks as usize * chunk;
        let (input, output) = match self.staging {
            Some(_) => (inputs[rank], outputs[rank]),
            None => (args.input, args.output),
        };
        if self.staging.is_some() {
            gpu.memcpy_async(input, args.input, args.input_bytes, args.stream)?;
        }
        let base = self.state.ptr();
        let at = |off: usize| base + off as u64;
        let mut a = PlanArgs {
            ops: at(self.layout.ops),
            tb_starts: at(self.layout.tb_starts),
            refs: at(self.layout.refs),
            ids: at(self.layout.ids),
            channels: at(self.layout.channels),
            port_channels: at(self.layout.port_channels),
            semaphores: at(self.layout.semaphores),
            barriers: at(self.layout.barriers),
            flags: at(self.layout.flags),
            error_word: self.comm.error_word_device_ptr(),
            chunk_bytes: chunk as u64,
            scratch_half_bytes: if self.plan.protocol == crate::plan::Protocol::Simple {
                0
            } else {
                self.scratch_half_bytes as u64
            },
            max_spin: 0,
            packet_bytes: packet_bytes(self.plan.protocol),
            unit_bytes: unit_bytes(self.plan.protocol),
            replicas: self.replicas(chunk),
            ..PlanArgs::default()
        };
        debug_assert!(self.layout.end <= self.state.allocation().size);
        // Slots with their owners: the block offsets port-channel puts address.
        let mut owners = [rank; kx::MAX_PLAN_BUFFERS];
        a.buffers[0] = input;
        a.buffers[1] = output;
        a.buffers[2] = self.block_ptrs[rank];
        for (k, rb) in self.plan.gpus[rank].remote_buffers.iter().enumerate() {
            let p = rb.rank as usize;
            let slot = FIRST_REMOTE_SLOT as usize + k;
            owners[slot] = p;
            a.buffers[slot] = match rb.buffer_type {
                BufferType::Input => inputs[p],
                BufferType::Output => outputs[p],
                BufferType::Scratch => self.block_ptrs[p],
            };
        }
        if self.staging.is_some() {
            for (slot, &owner) in owners.iter().enumerate() {
                a.block_offsets[slot] = a.buffers[slot].saturating_sub(self.block_ptrs[owner]);
            }
        }
        // The interpreter begins with wait_prior_grids(), so its launch may overlap the end of the
        // stream's previous kernel, and outside capture a cached one-kernel graph costs the
        // calling thread less: the natives' fast launches, under the same condition
        // (`Communicator::fast_launches`: not where ranks of this process share the device).
        let fast = self.comm.fast_launches();
        let cfg = LaunchConfig {
            shared_mem_bytes: if self.specialised.is_some() {
                0
            } else {
                self.program_bytes
            },
            ..LaunchConfig::linear(
                self.threadblocks.max(1) * a.replicas,
                call_threads(&self.plan, chunk),
            )
        }
        .with_programmatic(fast)
        .with_cached_graph(fast);
        let mut params = [&mut a as *mut PlanArgs as *mut c_void];
        // SAFETY: `PlanArgs` is the entry point's one parameter (layout checked by the NVRTC
        // test's static_asserts); its addresses are the caller's checked buffers, the peers'
        // registered buffers and scratch, and our own live device state; every chunk an op names
        // was validated against the plan's chunk counts, which the buffers cover (chunk_bytes).
        unsafe { gpu.launch(f, cfg, args.stream, &mut params) }?;
        if self.staging.is_some() {
            gpu.memcpy_async(args.output, output, out_bytes, args.stream)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder;
    use crate::plan::Protocol;

    fn plan(ranks: usize, protocol: Protocol) -> Plan {
        let json = builder::allreduce(ranks, protocol, PlanReduceOp::Sum).to_string();
        Plan::from_json(json.as_bytes()).expect("valid")
    }

    #[test]
    fn scratch_holds_whole_packets_per_chunk_and_stays_within_the_cap() {
        let simple = plan(8, Protocol::Simple);
        let ll = plan(8, Protocol::Ll);
        let chunks = simple.gpus[0].scratch_chunks as usize;
        assert_eq!(scratch_bytes(&simple, 64), chunks * 64);
        // 3 bytes per chunk still take one whole 16-byte packet per chunk.
        let ll_chunks = ll.gpus[0].scratch_chunks as usize;
        assert_eq!(scratch_bytes(&ll, 3), (ll_chunks * 16).next_multiple_of(16));
        for p in [&simple, &ll] {
            let chunk = max_chunk_bytes(p);
            assert!(chunk > 0);
            assert!(2 * scratch_bytes(p, chunk) <= MAX_PLAN_SCRATCH_BYTES);
            assert!(2 * scratch_bytes(p, 2 * chunk) > MAX_PLAN_SCRATCH_BYTES);
        }
    }

    /// The range a caller reads without a set-up is the one a call is checked against: capped by
    /// the staging of a port-channel plan and by the scratch of an LL plan (#58: the DSL check ran
    /// a port-channel plan at a size its staging cannot hold, from the plan's unbounded range).
    #[test]
    fn the_runnable_range_is_capped_by_staging_and_scratch() {
        for (p, staged) in [
            (plan(2, Protocol::Simple), false),
            (plan(4, Protocol::Ll), false),
            (port_plan(2, Protocol::Simple), true),
            (port_plan(2, Protocol::Ll), true),
        ] {
            let (min, max) = runnable_message_range(&p);
            assert_eq!(min, p.min_message_size);
            assert!(max <= p.max_message_size);
            let chunks = p.gpus[0].input_chunks.max(1) as u64;
            let chunk = (max / chunks) as usize;
            assert!(chunk > 0, "{}: nothing runs", p.name);
            let half = scratch_bytes(&p, max_chunk_bytes(&p));
            assert!(scratch_bytes(&p, chunk) <= half, "{}", p.name);
            assert!(2 * half <= MAX_PLAN_SCRATCH_BYTES, "{}", p.name);
            assert_eq!(is_staged(&p), staged, "{}", p.name);
            if staged {
                let s = staging_layout(&p, 0);
                assert!(chunk <= s.max_chunk, "{}", p.name);
                assert!(s.max_chunk * staged_chunks(&p) <= MAX_PLAN_SCRATCH_BYTES);
                // A plan with an unbounded range still runs at a bounded one.
                assert!(max < p.max_message_size, "{}", p.name);
            }
        }
    }

    fn port_plan(ranks: usize, protocol: Protocol) -> Plan {
        let json = builder::port_allreduce(ranks, protocol, PlanReduceOp::Sum).to_string();
        Plan::from_json(json.as_bytes()).expect("valid")
    }

    #[test]
    fn replicas_grow_with_the_chunk_up_to_what_fits() {
        use Replication::*;
        // 1024 threads, 8-byte units: a replica per 8 KiB of chunk; with meetings none below 128
        // KiB, then one per 16 KiB, a power of two.
        assert_eq!(replicas_for(Free, 1024, 8, 512, 66), 1);
        assert_eq!(replicas_for(Free, 1024, 8, 16 << 10, 66), 2);
        assert_eq!(replicas_for(Free, 1024, 8, 64 << 10, 66), 8);
        assert_eq!(replicas_for(Free, 1024, 8, 512 << 10, 66), kx::MAX_REPLICAS);
        assert_eq!(replicas_for(Free, 1024, 8, 512 << 10, 5), 5);
        assert_eq!(replicas_for(Free, 1024, 8, 512 << 10, 0), 1);
        assert_eq!(replicas_for(Synced, 1024, 8, 64 << 10, 16), 1);
        assert_eq!(replicas_for(Synced, 1024, 8, (128 << 10) - 8, 16), 1);
        assert_eq!(replicas_for(Synced, 1024, 8, 128 << 10, 16), 8);
        assert_eq!(replicas_for(Synced, 1024, 8, 256 << 10, 16), 16);
        assert_eq!(replicas_for(Synced, 1024, 8, 64 << 20, 33), 32);
        assert_eq!(
            replicas_for(Synced, 1024, 8, 64 << 20, 132),
            MAX_MEETING_REPLICAS
        );
        assert_eq!(replicas_for(Synced, 1024, 8, 64 << 20, 16), 16);
        assert_eq!(replicas_for(Never, 1024, 8, 64 << 20, 16), 1);
    }

    #[test]
    fn small_chunks_take_the_fewest_warps_that_give_each_unit_a_thread() {
        let mut p = plan(2, Protocol::Simple);
        p.num_threads_per_block = 1024;
        assert_eq!(block_threads(&p), kx::MAX_BLOCK_THREADS);
        // 8-byte units: one warp up to 256 bytes, then a warp per 256 bytes, up to the plan's.
        assert_eq!(call_threads(&p, 1), 32);
        assert_eq!(call_threads(&p, 64), 32);
        assert_eq!(call_threads(&p, 256), 32);
        assert_eq!(call_threads(&p, 257), 64);
        assert_eq!(call_threads(&p, 4096), kx::MAX_BLOCK_THREADS);
        assert_eq!(call_threads(&p, 1 << 30), kx::MAX_BLOCK_THREADS);
        p.num_threads_per_block = 96;
        assert_eq!(call_threads(&p, 1 << 20), 96);
        assert_eq!(call_threads(&p, 300), 64);
        // LL8: 4-byte units.
        let mut ll8 = plan(2, Protocol::Ll);
        ll8.protocol = Protocol::Ll8;
        ll8.num_threads_per_block = 1024;
        assert_eq!(call_threads(&ll8, 256), 64);
    }

    #[test]
    fn programs_of_few_data_ops_are_specialised() {
        let enc = |ranks, protocol| encode(&plan(ranks, protocol), 0, false).expect("encodes");
        let small = enc(2, Protocol::Simple);
        assert!(data_ops(&small) <= MAX_SPECIALISED_DATA_OPS);
        assert!(specialises(&small));
        let large = enc(8, Protocol::Ll);
        assert!(data_ops(&large) > MAX_SPECIALISED_DATA_OPS);
        assert!(!specialises(&large));
    }

    #[test]
    fn device_state_parts_are_aligned_and_in_order() {
        let p = plan(4, Protocol::Simple);
        let enc = encode(&p, 1, false).expect("encodes");
        let channels = vec![D2DSemaphoreHandle::default(); enc.channel_peers.len()];
        let ports = vec![PortChannelHandle::default(); 2];
        let (layout, bytes) = state_bytes(&enc, &channels, &ports);
        let parts = [
            layout.ops,
            layout.tb_starts,
            layout.refs,
            layout.ids,
            layout.channels,
            layout.port_channels,
            layout.semaphores,
            layout.barriers,
            layout.flags,
            layout.end,
        ];
        assert!(parts.iter().all(|o| o % 8 == 0));
        assert!(parts.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(
            layout.tb_starts - layout.ops,
            (enc.ops.len() * size_of::<kx::PlanOp>()).next_multiple_of(8)
        );
        assert_eq!(bytes.len(), layout.end);
        // TB_WORDS u32 words per threadblock, then the 8 bytes of slack after the last part.
        assert_eq!(
            layout.end - layout.flags,
            (kx::TB_WORDS * 4 * enc.threadblocks()).next_multiple_of(8) + 8
        );
    }
}
