//! The native algorithms' common ground: [`NativeKind`] (names, collectives, kernels, scratch and
//! semaphore needs), the checks of a call ([`check_shape`], [`max_input_bytes`]) and
//! [`NativeBase`], what every algorithm of `crate::algorithms` holds. Construction is collective
//! (every rank builds the same kinds in the same order); `execute` only enqueues work on
//! `args.stream`, with no host synchronisation, so it is legal during CUDA-graph capture.

use crate::geometry::{self, Residency};
use crate::resources::{
    launch_with_args, CollectionResources, KernelTable, ScratchPart, ScratchRegion,
};
use crate::user_buffers::{Agreed, UserBuffer, UserBufferTable};
use mscclpp_core::algorithm::{Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::native_names as names;
use mscclpp_core::communicator::Communicator;
use mscclpp_core::device::DeviceRepr;
use mscclpp_core::gpu::{DevicePtr, Function, GpuVendor, LaunchConfig};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::collectives::{
    resolve_accumulator, CollectiveFile, ReduceSpec, MAX_PACKET_BLOCKS, MAX_RANKS,
};
use std::sync::Arc;

/// The native algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NativeKind {
    AllreduceAllpairPacket,
    /// The all-pair schedule through LL128 lines (CUDA only).
    AllreduceAllpairLl128,
    AllreducePacket,
    AllreduceRsagZeroCopy,
    AllgatherFullmesh2,
    AllgatherPacket,
    ReducescatterZeroCopy,
    ReducescatterPacket,
    BroadcastZeroCopy,
    /// Reduce-scatter + all-gather staged through the scratch (unregistered buffers), one step:
    /// messages up to the scratch's capacity.
    AllreduceRsag,
    /// The same in double-buffered steps of the scratch: any message size.
    AllreduceRsagPipeline,
    /// Every rank pushes its whole input into every peer's scratch and reduces locally.
    AllreduceFullmesh,
    /// All-gather pushed through the peers' scratch in steps (unregistered buffers).
    AllgatherFullmesh,
    /// The copy engines move the data, the SMs reduce (`copy_engine`).
    AllreduceCopyEngine,
    /// The root reduces every rank's registered input into its output.
    ReduceZeroCopy,
    /// The pipelined reduce-scatter + all-gather with every transfer a write: inputs pushed into
    /// the peers' scratch, reduced chunks pushed into the peers' registered outputs.
    AllreduceRsagPush,
}

impl NativeKind {
    pub const ALL: [NativeKind; 16] = [
        NativeKind::AllreduceAllpairPacket,
        NativeKind::AllreduceAllpairLl128,
        NativeKind::AllreducePacket,
        NativeKind::AllreduceRsagZeroCopy,
        NativeKind::AllgatherFullmesh2,
        NativeKind::AllgatherPacket,
        NativeKind::ReducescatterZeroCopy,
        NativeKind::ReducescatterPacket,
        NativeKind::BroadcastZeroCopy,
        NativeKind::AllreduceRsag,
        NativeKind::AllreduceRsagPipeline,
        NativeKind::AllreduceFullmesh,
        NativeKind::AllgatherFullmesh,
        NativeKind::AllreduceCopyEngine,
        NativeKind::ReduceZeroCopy,
        NativeKind::AllreduceRsagPush,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            NativeKind::AllreduceAllpairPacket => names::ALLREDUCE_ALLPAIR_PACKET,
            NativeKind::AllreduceAllpairLl128 => names::ALLREDUCE_ALLPAIR_LL128,
            NativeKind::AllreducePacket => names::ALLREDUCE_PACKET,
            NativeKind::AllreduceRsagZeroCopy => names::ALLREDUCE_RSAG_ZERO_COPY,
            NativeKind::AllgatherFullmesh2 => names::ALLGATHER_FULLMESH2,
            NativeKind::AllgatherPacket => names::ALLGATHER_PACKET,
            NativeKind::ReducescatterZeroCopy => names::REDUCESCATTER_ZERO_COPY,
            NativeKind::ReducescatterPacket => names::REDUCESCATTER_PACKET,
            NativeKind::BroadcastZeroCopy => names::BROADCAST_ZERO_COPY,
            NativeKind::AllreduceRsag => names::ALLREDUCE_RSAG,
            NativeKind::AllreduceRsagPipeline => names::ALLREDUCE_RSAG_PIPELINE,
            NativeKind::AllreduceFullmesh => names::ALLREDUCE_FULLMESH,
            NativeKind::AllgatherFullmesh => names::ALLGATHER_FULLMESH,
            NativeKind::AllreduceCopyEngine => names::ALLREDUCE_COPY_ENGINE,
            NativeKind::ReduceZeroCopy => names::REDUCE_ZERO_COPY,
            NativeKind::AllreduceRsagPush => names::ALLREDUCE_RSAG_PUSH,
        }
    }

    pub const fn collective(self) -> Collective {
        match self {
            NativeKind::AllreduceAllpairPacket
            | NativeKind::AllreduceAllpairLl128
            | NativeKind::AllreducePacket
            | NativeKind::AllreduceRsagZeroCopy
            | NativeKind::AllreduceRsag
            | NativeKind::AllreduceRsagPipeline
            | NativeKind::AllreduceFullmesh
            | NativeKind::AllreduceCopyEngine
            | NativeKind::AllreduceRsagPush => Collective::AllReduce,
            NativeKind::AllgatherFullmesh2
            | NativeKind::AllgatherPacket
            | NativeKind::AllgatherFullmesh => Collective::AllGather,
            NativeKind::ReducescatterZeroCopy | NativeKind::ReducescatterPacket => {
                Collective::ReduceScatter
            }
            NativeKind::BroadcastZeroCopy => Collective::Broadcast,
            NativeKind::ReduceZeroCopy => Collective::Reduce,
        }
    }

    /// Whether its kernel is built for CUDA only (`collectives::CUDA_ONLY_ENTRY_POINTS`).
    pub fn is_cuda_only(self) -> bool {
        mscclpp_kernels_cu::collectives::CUDA_ONLY_ENTRY_POINTS.contains(&self.file_and_entry().1)
    }

    const fn file_and_entry(self) -> (CollectiveFile, &'static str) {
        match self {
            NativeKind::AllreduceAllpairPacket => {
                (CollectiveFile::AllReduce, "allreduce_allpair_packet")
            }
            NativeKind::AllreduceAllpairLl128 => {
                (CollectiveFile::AllReduce, "allreduce_allpair_ll128")
            }
            NativeKind::AllreducePacket => (CollectiveFile::AllReduce, "allreduce_packet"),
            NativeKind::AllreduceRsagZeroCopy => {
                (CollectiveFile::AllReduce, "allreduce_rsag_zero_copy")
            }
            NativeKind::AllgatherFullmesh2 => (CollectiveFile::AllGather, "allgather_fullmesh2"),
            NativeKind::AllgatherPacket => (CollectiveFile::AllGather, "allgather_packet"),
            NativeKind::ReducescatterZeroCopy => {
                (CollectiveFile::ReduceScatter, "reducescatter_zero_copy")
            }
            NativeKind::ReducescatterPacket => {
                (CollectiveFile::ReduceScatter, "reducescatter_packet")
            }
            NativeKind::BroadcastZeroCopy => (CollectiveFile::Broadcast, "broadcast_zero_copy"),
            // One kernel: the host's geometry makes it single-buffered one-step or pipelined.
            NativeKind::AllreduceRsag | NativeKind::AllreduceRsagPipeline => {
                (CollectiveFile::AllReduce, "allreduce_rsag")
            }
            NativeKind::AllreduceFullmesh => (CollectiveFile::AllReduce, "allreduce_fullmesh"),
            NativeKind::AllgatherFullmesh => (CollectiveFile::AllGather, "allgather_fullmesh"),
            // The reduction of one staged piece; the unit also holds `allreduce_ce_sync`.
            NativeKind::AllreduceCopyEngine => (CollectiveFile::AllReduce, "allreduce_ce_reduce"),
            NativeKind::ReduceZeroCopy => (CollectiveFile::Reduce, "reduce_zero_copy"),
            NativeKind::AllreduceRsagPush => (CollectiveFile::AllReduce, "allreduce_rsag_push"),
        }
    }

    /// The kinds that stage their input through a shared scratch in steps, with semaphores and
    /// a device step counter (one kernel signature, `scratch_pipeline::launch`).
    pub const fn uses_scratch_pipeline(self) -> bool {
        matches!(
            self,
            NativeKind::AllreduceRsag
                | NativeKind::AllreduceRsagPipeline
                | NativeKind::AllreduceFullmesh
                | NativeKind::AllgatherFullmesh
                | NativeKind::AllreduceRsagPush
        )
    }

    /// Whether the kind stages data in the collection's scratch (with the device call counter).
    pub const fn uses_scratch(self) -> bool {
        self.uses_packets() || self.uses_scratch_pipeline()
    }

    /// The part of the collection's scratch the kind uses (the copy-engine all-reduce's ring is
    /// `CollectionResources::copy_engine_ring`).
    pub const fn scratch_part(self) -> Option<ScratchPart> {
        match self {
            NativeKind::AllreduceAllpairPacket => Some(ScratchPart::Ll16),
            NativeKind::AllreduceAllpairLl128
            | NativeKind::AllreducePacket
            | NativeKind::AllgatherPacket
            | NativeKind::ReducescatterPacket => Some(ScratchPart::Ll128),
            NativeKind::AllreduceRsag
            | NativeKind::AllreduceRsagPipeline
            | NativeKind::AllreduceFullmesh
            | NativeKind::AllgatherFullmesh
            | NativeKind::AllreduceRsagPush => Some(ScratchPart::Staging),
            _ => None,
        }
    }

    /// The kinds that run through LL packets in a shared scratch with a device call counter
    /// (one kernel signature, see `execute`).
    pub const fn uses_packets(self) -> bool {
        matches!(
            self,
            NativeKind::AllreduceAllpairPacket
                | NativeKind::AllreduceAllpairLl128
                | NativeKind::AllreducePacket
                | NativeKind::AllgatherPacket
                | NativeKind::ReducescatterPacket
        )
    }

    /// Payload bytes a packet kind's kernel handles per call, for sizing its grid (about one packet
    /// per thread): the all-gather receives its input from every peer; the others move about their
    /// input.
    pub fn packet_work_bytes(self, input_bytes: usize, nranks: usize) -> usize {
        match self {
            NativeKind::AllgatherPacket => {
                input_bytes.saturating_mul(nranks.saturating_sub(1).max(1))
            }
            _ => input_bytes,
        }
    }

    /// Semaphore blocks to reserve per peer (0 for the packet kinds, which need none). The
    /// all-reduce gets the most: it is the one tuned for bandwidth with 2 blocks per SM.
    pub fn semaphore_blocks(self, sm: u32) -> u32 {
        match self {
            NativeKind::AllreduceAllpairPacket
            | NativeKind::AllreduceAllpairLl128
            | NativeKind::AllreducePacket
            | NativeKind::AllgatherPacket
            | NativeKind::ReducescatterPacket => 0,
            NativeKind::AllreduceRsagZeroCopy => (2 * sm).min(256),
            // One barrier per call, from a single block.
            NativeKind::AllreduceCopyEngine => 1,
            _ => sm.min(128),
        }
    }

    /// Most blocks of `threads` threads a grid of the kind may have on a rank of `residency`
    /// (its kernel family's cap): co-resident with every peer's grid, for the packet kinds at
    /// most one block per SM and the packet call counter's slots, for the scratch pipelines
    /// those slots and the semaphores, for the zero-copy kinds the semaphores (the copy-engine
    /// all-reduce's reduction barriers once, from one block).
    pub fn max_blocks(self, residency: Residency, threads: u32) -> u32 {
        let resident = residency.max_blocks(threads);
        let sems = self.semaphore_blocks(residency.sm);
        if self.uses_packets() {
            resident.min(residency.sm).min(MAX_PACKET_BLOCKS as u32)
        } else if self.uses_scratch_pipeline() {
            sems.min(resident).min(MAX_PACKET_BLOCKS as u32)
        } else if self == NativeKind::AllreduceCopyEngine {
            resident
        } else {
            sems.min(resident)
        }
    }
}

/// Default threads per block of the native kernels.
pub const DEFAULT_THREADS: u32 = 512;

/// Validates the shape of `args` for `kind` on `nranks` ranks (no device access): the element
/// count (0 is a no-op), and for reductions the (dtype, accumulator) pair. Pure, so it is
/// unit-tested on the CPU.
pub fn check_shape(
    kind: NativeKind,
    args: &ExecuteArgs,
    rank: usize,
    nranks: usize,
) -> Result<usize> {
    let name = kind.name();
    if nranks == 0 || nranks > MAX_RANKS {
        return Err(Error::Unsupported(format!(
            "{name} on {nranks} ranks: the native collectives support 1..={MAX_RANKS} ranks"
        )));
    }
    let count = args.input_count()?;
    if kind.collective().reduces() {
        resolve_accumulator(args.dtype, args.accum)
            .map_err(|e| Error::Unsupported(format!("{name}: {e}")))?;
    }
    let need = |what: &str, have: usize, want: usize| -> Result<()> {
        if have < want {
            return Err(Error::InvalidArgument(format!(
                "{name}: {what} holds {have} bytes, the call needs {want}"
            )));
        }
        Ok(())
    };
    match kind.collective() {
        Collective::AllReduce => need("the output", args.output_bytes, args.input_bytes)?,
        Collective::AllGather => need("the output", args.output_bytes, nranks * args.input_bytes)?,
        Collective::ReduceScatter => {
            if args.input_bytes % (nranks * args.dtype.size()) != 0 {
                return Err(Error::InvalidArgument(format!(
                    "{name}: input of {} bytes does not split into {nranks} chunks of whole {} elements",
                    args.input_bytes, args.dtype
                )));
            }
            need("the output", args.output_bytes, args.input_bytes / nranks)?
        }
        Collective::Broadcast | Collective::Reduce => {
            if args.root >= nranks {
                return Err(Error::InvalidArgument(format!(
                    "{name}: root {} is not a rank of {nranks}",
                    args.root
                )));
            }
            if output_needed(kind, rank, args.root) {
                need("the output", args.output_bytes, args.input_bytes)?
            }
        }
        other => {
            return Err(Error::Internal(format!(
                "{name} is not a {other} algorithm"
            )));
        }
    }
    if count > 0 && output_needed(kind, rank, args.root) && args.output == 0 {
        return Err(Error::InvalidArgument(format!(
            "{name}: null output pointer"
        )));
    }
    let input_needed = kind.collective() != Collective::Broadcast || rank == args.root;
    if count > 0 && input_needed && args.input == 0 {
        return Err(Error::InvalidArgument(format!(
            "{name}: null input pointer"
        )));
    }
    Ok(count)
}

/// Whether `rank` writes an output: a reduce writes only on its root (NCCL ignores the others'
/// receive buffers, so they may be null).
fn output_needed(kind: NativeKind, rank: usize, root: usize) -> bool {
    kind.collective() != Collective::Reduce || rank == root
}

/// What every native algorithm holds: its kind, its compiled kernels, the table of user buffers its
/// calls agree on, and the collection's resources it borrows. Each algorithm (`crate::algorithms`) is a
/// small type around one of these.
pub struct NativeBase {
    kind: NativeKind,
    // Field order is drop order: device resources go before the communicator they came from.
    kernels: KernelTable,
    user_buffers: UserBufferTable,
    /// The collection's scratch, call counter and semaphores, lent to every algorithm.
    resources: Arc<CollectionResources>,
    residency: Residency,
    /// Whose GPU: an LL128 line's payload differs (see [`max_input_bytes_on`]).
    vendor: GpuVendor,
    comm: Arc<Communicator>,
}

impl NativeBase {
    /// Sets up `kind` for `comm`, borrowing the collection's `resources` (checked large enough).
    pub fn new(
        kind: NativeKind,
        comm: Arc<Communicator>,
        resources: Arc<CollectionResources>,
    ) -> Result<Self> {
        let vendor = comm.gpu().properties(comm.device())?.vendor;
        let residency = Residency::of(&comm)?;
        let sm = residency.sm;
        if let Some(part) = kind.scratch_part() {
            let bytes = resources.region(part).bytes;
            // A slot of one LL128 line (two-phase all-reduce, all-gather, reduce-scatter) or of two
            // LL16 packets (all-pair) per half; the pipelines need one 16-byte vector per slot.
            let n = comm.size();
            let min = match kind {
                NativeKind::AllreducePacket => 4 * n * geometry::LL128_LINE_BYTES,
                NativeKind::AllreduceAllpairLl128
                | NativeKind::AllgatherPacket
                | NativeKind::ReducescatterPacket => 2 * n * geometry::LL128_LINE_BYTES,
                NativeKind::AllreduceAllpairPacket => 2 * 4 * n * geometry::PACKET_BYTES,
                _ => 4 * n * geometry::VECTOR_BYTES,
            };
            if bytes < min {
                return Err(Error::InvalidArgument(format!(
                    "{}: scratch of {bytes} bytes holds no slot for {n} ranks (at least {min} bytes \
                     are needed)",
                    kind.name(),
                )));
            }
        }
        if kind.semaphore_blocks(sm) > resources.semaphore_blocks() {
            return Err(Error::InvalidArgument(format!(
                "{}: the collection holds semaphores for {} blocks, it needs {}",
                kind.name(),
                resources.semaphore_blocks(),
                kind.semaphore_blocks(sm)
            )));
        }
        Ok(NativeBase {
            kind,
            kernels: KernelTable::default(),
            user_buffers: UserBufferTable::new(format!("{:?}", kind.collective())),
            resources,
            residency,
            vendor,
            comm,
        })
    }

    pub fn kind(&self) -> NativeKind {
        self.kind
    }

    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
    }

    pub fn resources(&self) -> &Arc<CollectionResources> {
        &self.resources
    }

    /// Multiprocessors this rank's grids are sized for (`Communicator::multiprocessors`: the
    /// GPU's, shared among the ranks of this process on it).
    pub fn sm(&self) -> u32 {
        self.residency.sm
    }

    /// Whose GPU this rank runs on.
    pub fn vendor(&self) -> GpuVendor {
        self.vendor
    }

    /// The most blocks this rank's grids may have ([`Residency::max_blocks`]).
    pub fn residency(&self) -> Residency {
        self.residency
    }

    /// Most blocks of `threads` threads this algorithm's grids may have
    /// ([`NativeKind::max_blocks`]).
    pub fn max_blocks(&self, threads: u32) -> u32 {
        self.kind.max_blocks(self.residency, threads)
    }

    /// The requested launch shape of `args` checked against this algorithm's limits
    /// ([`Error::LaunchShape`] naming the kind), as its launch checks it.
    pub fn check_launch_shape(&self, args: &ExecuteArgs) -> Result<()> {
        let threads = args.nthreads.unwrap_or(DEFAULT_THREADS);
        geometry::launch_config(
            args.nblocks,
            args.nthreads,
            1,
            DEFAULT_THREADS,
            self.max_blocks(threads),
        )
        .map(|_| ())
        .map_err(|e| match e {
            Error::LaunchShape(m) => Error::LaunchShape(format!("{}: {m}", self.kind.name())),
            e => e,
        })
    }

    /// Largest message (input bytes per rank) this algorithm takes; `usize::MAX` for zero-copy.
    pub fn max_bytes(&self) -> usize {
        max_input_bytes_on(
            self.kind,
            self.scratch_bytes(),
            self.comm.size(),
            self.vendor,
        )
    }

    /// Bytes of the kind's part of the scratch (0 for the kinds that use none).
    pub fn scratch_bytes(&self) -> usize {
        self.kind
            .scratch_part()
            .map_or(0, |part| self.resources.region(part).bytes)
    }

    /// The kind's part of the scratch.
    pub fn scratch(&self) -> Result<ScratchRegion> {
        self.kind
            .scratch_part()
            .map(|part| self.resources.region(part))
            .ok_or_else(|| Error::Internal(format!("{} uses no scratch", self.kind.name())))
    }

    /// `Algorithm::check`: the shape, the scratch capacity and the launch shape (so `prepare`
    /// refuses a launch shape too, and an algorithm made of others' calls can refuse it before
    /// enqueuing any of them).
    pub fn check(&self, args: &ExecuteArgs) -> Result<()> {
        check_shape(self.kind, args, self.comm.rank(), self.comm.size())?;
        check_capacity(self.kind, args.input_bytes, self.max_bytes())?;
        self.check_launch_shape(args)
    }

    /// Checks the communicator's health (one host load: after a failure, nothing more is queued
    /// and the error names the peer) and `args`; the element count of a call that has work to
    /// do, None for an empty one.
    pub fn begin(&self, args: &ExecuteArgs) -> Result<Option<usize>> {
        self.comm.check(self.kind.name())?;
        self.check(args)?;
        let count = args.input_count()?;
        Ok((count > 0).then_some(count))
    }

    /// `Algorithm::prepare`: [`begin`](Self::begin), then loads every kernel the call launches.
    pub fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        if self.begin(args)?.is_some() {
            self.function(args)?;
            if self.kind == NativeKind::AllreduceCopyEngine {
                self.entry_point(args, "allreduce_ce_sync")?;
            }
        }
        Ok(())
    }

    /// The kind's kernel, from the unit specialised for `args`.
    pub fn function(&self, args: &ExecuteArgs) -> Result<Function> {
        self.entry_point(args, self.kind.file_and_entry().1)
    }

    /// Entry point `entry` of the kind's kernel file, from the unit specialised for `args`.
    pub fn entry_point(&self, args: &ExecuteArgs, entry: &'static str) -> Result<Function> {
        let (file, _) = self.kind.file_and_entry();
        let spec = if file.reduces() {
            Some(ReduceSpec {
                dtype: args.dtype,
                acc: resolve_accumulator(args.dtype, args.accum)?,
                op: args.op,
            })
        } else {
            None
        };
        self.kernels
            .function(self.comm.gpu().as_ref(), file, spec, entry)
    }

    /// The collection's semaphore table and how many of its blocks this kind barriers with.
    pub fn semaphores(&self) -> Result<(DevicePtr, u32)> {
        match self.kind.semaphore_blocks(self.sm()) {
            0 => Err(Error::Internal(format!(
                "{} barriers with no semaphores",
                self.kind.name()
            ))),
            blocks => Ok((self.resources.semaphores_ptr(), blocks)),
        }
    }

    /// Collective: every rank's address of each of `buffers`, agreed for this call
    /// ([`crate::user_buffers`]). Every rank passes the same number of buffers, whatever its own
    /// call looks like (in place or not): an unused one is passed all the same.
    pub fn agree(&self, buffers: &[UserBuffer]) -> Result<Arc<Agreed>> {
        self.user_buffers.agree(&self.comm, buffers)
    }

    /// Launches `f` with its argument struct on the caller's stream.
    pub fn launch<A: DeviceRepr>(
        &self,
        f: Function,
        cfg: LaunchConfig,
        args: &ExecuteArgs,
        kernel_args: A,
    ) -> Result<()> {
        // Every native kernel begins with wait_prior_grids(), so its launch may overlap the end
        // of the stream's previous kernel (the backend decides whether it can). Outside capture,
        // a cached one-kernel graph is cheaper for the calling thread (see LaunchConfig). Neither
        // when ranks of this process share the device (`Communicator::owns_device`).
        let cfg = cfg
            .with_programmatic(self.comm.fast_launches())
            .with_cached_graph(self.comm.fast_launches());
        launch_with_args(self.comm.gpu().as_ref(), f, cfg, args.stream, kernel_args)
    }
}

/// [`max_input_bytes`] on `vendor`'s GPUs: an LL128 line carries
/// [`geometry::ll128_payload`] bytes there, so the LL128 kinds take proportionally less on AMD
/// (every LL128 capacity is a whole number of lines).
pub fn max_input_bytes_on(
    kind: NativeKind,
    scratch_bytes: usize,
    nranks: usize,
    vendor: GpuVendor,
) -> usize {
    let max = max_input_bytes(kind, scratch_bytes, nranks);
    if kind.scratch_part() == Some(ScratchPart::Ll128) && max != usize::MAX {
        max / geometry::LL128_PAYLOAD * geometry::ll128_payload(vendor)
    } else {
        max
    }
}

/// Largest input (bytes per rank) `kind` takes with `scratch_bytes` in its part of the scratch on
/// `nranks` ranks (CUDA's LL128 lines; [`max_input_bytes_on`] for any vendor);
/// `usize::MAX` for the zero-copy and pipelined kinds. The packet all-gather sends its whole input to each peer's
/// slot; the packet reduce-scatter sends one chunk (input / nranks) per slot.
pub fn max_input_bytes(kind: NativeKind, scratch_bytes: usize, nranks: usize) -> usize {
    match kind {
        NativeKind::AllreduceAllpairPacket => geometry::allpair_max_bytes(scratch_bytes, nranks),
        // Whole inputs in each peer's slot, as the packet all-gather.
        NativeKind::AllreduceAllpairLl128 | NativeKind::AllgatherPacket => {
            geometry::line_slot_payload(scratch_bytes, nranks)
        }
        NativeKind::AllreducePacket => geometry::packet_max_bytes(scratch_bytes, nranks),
        NativeKind::ReducescatterPacket => {
            geometry::line_slot_payload(scratch_bytes, nranks).saturating_mul(nranks.max(1))
        }
        // One step in one half of the shared scratch (see CollectionResources).
        NativeKind::AllreduceRsag => geometry::rsag_max_bytes(scratch_bytes / 2, nranks),
        NativeKind::AllreduceRsagZeroCopy
        | NativeKind::AllgatherFullmesh2
        | NativeKind::ReducescatterZeroCopy
        | NativeKind::BroadcastZeroCopy
        | NativeKind::ReduceZeroCopy
        | NativeKind::AllreduceRsagPipeline
        | NativeKind::AllreduceFullmesh
        | NativeKind::AllgatherFullmesh
        | NativeKind::AllreduceCopyEngine
        | NativeKind::AllreduceRsagPush => usize::MAX,
    }
}

/// Refuses a packet algorithm's call whose input does not fit its scratch, naming the limit.
fn check_capacity(kind: NativeKind, input_bytes: usize, max_bytes: usize) -> Result<()> {
    if input_bytes > max_bytes {
        return Err(Error::InvalidArgument(format!(
            "{}: an input of {input_bytes} bytes exceeds its scratch capacity of {max_bytes} bytes \
             per rank (build it with more scratch, or use the zero-copy algorithm)",
            kind.name()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// Building every native algorithm (plus the NVLS ones) must leave at least half of each
    /// peer's semaphore slots to user channels, on every GPU size we expect; running out fails
    /// `build_default_algorithms` on the GPU only, so catch it here. The native kinds share one
    /// table, as large as the largest kind's.
    #[test]
    fn default_algorithms_fit_the_semaphore_budget() {
        use mscclpp_core::communicator::SEMAPHORES_PER_PEER;
        for sm in [80u32, 108, 132, 148, 160, 256] {
            let native: u32 = NativeKind::ALL
                .iter()
                .map(|k| k.semaphore_blocks(sm))
                .max()
                .unwrap_or(0);
            let nvls = 192;
            assert!(
                (native + nvls) as usize <= SEMAPHORES_PER_PEER / 2,
                "{sm} SMs: {native} native + {nvls} NVLS slots of {SEMAPHORES_PER_PEER}"
            );
        }
    }

    use super::*;
    use mscclpp_core::gpu::Stream;
    use mscclpp_core::{AccumType, DataType, ReduceOp};
    use mscclpp_kernels_cu::collectives::MAX_PACKET_BLOCKS;
    use rstest::rstest;

    fn args(input_bytes: usize, output_bytes: usize) -> ExecuteArgs {
        ExecuteArgs {
            input: 0x1000,
            output: 0x2000,
            input_bytes,
            output_bytes,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            accum: AccumType::Auto,
            root: 0,
            stream: Stream::DEFAULT,
            nblocks: None,
            nthreads: None,
        }
    }

    #[rstest]
    #[case(NativeKind::AllreduceRsagZeroCopy, 64, 64, 4, true)]
    #[case(NativeKind::AllreduceRsagZeroCopy, 64, 60, 4, false)]
    #[case(NativeKind::AllgatherFullmesh2, 64, 256, 4, true)]
    #[case(NativeKind::AllgatherFullmesh2, 64, 255, 4, false)]
    #[case(NativeKind::ReducescatterZeroCopy, 64, 16, 4, true)]
    #[case(NativeKind::ReducescatterZeroCopy, 60, 16, 4, false)]
    #[case(NativeKind::BroadcastZeroCopy, 64, 64, 2, true)]
    #[case(NativeKind::AllreducePacket, 6, 8, 2, false)]
    #[case(NativeKind::AllreducePacket, 64, 64, 9, false)]
    #[case(NativeKind::AllgatherPacket, 4, 8, 2, true)]
    #[case(NativeKind::AllgatherPacket, 4, 7, 2, false)]
    #[case(NativeKind::ReducescatterPacket, 8, 4, 2, true)]
    #[case(NativeKind::ReducescatterPacket, 12, 4, 2, false)]
    #[case(NativeKind::AllreduceRsag, 4, 4, 8, true)]
    #[case(NativeKind::AllreduceRsagPipeline, 12, 8, 3, false)]
    #[case(NativeKind::AllreduceFullmesh, 4, 4, 2, true)]
    #[case(NativeKind::AllgatherFullmesh, 4, 28, 7, true)]
    #[case(NativeKind::AllgatherFullmesh, 4, 27, 7, false)]
    #[case(NativeKind::AllreduceRsagPush, 4, 4, 8, true)]
    #[case(NativeKind::AllreduceRsagPush, 6, 4, 3, false)]
    fn shapes(
        #[case] kind: NativeKind,
        #[case] inb: usize,
        #[case] outb: usize,
        #[case] n: usize,
        #[case] ok: bool,
    ) {
        let r = check_shape(kind, &args(inb, outb), 0, n);
        assert_eq!(r.is_ok(), ok, "{kind:?} {inb} {outb} {n}: {r:?}");
        if let Err(e) = r {
            assert!(
                e.to_string().contains(kind.name()) || e.to_string().contains("element size"),
                "{e}"
            );
        }
    }

    #[test]
    fn unsupported_accumulation_is_refused_by_name() {
        let mut a = args(64, 64);
        a.accum = AccumType::F16;
        let e = check_shape(NativeKind::AllreduceAllpairPacket, &a, 0, 2).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(e.to_string().contains("f32"), "{e}");
        // Byte-moving collectives ignore the accumulator.
        check_shape(
            NativeKind::AllgatherFullmesh2,
            &{
                let mut b = a;
                b.output_bytes = 128;
                b
            },
            0,
            2,
        )
        .expect("allgather ignores accum");
    }

    #[test]
    fn reduce_needs_an_output_on_its_root_only() {
        let mut a = args(64, 0);
        a.root = 1;
        a.output = 0;
        check_shape(NativeKind::ReduceZeroCopy, &a, 0, 2).expect("non-root output may be null");
        let e = check_shape(NativeKind::ReduceZeroCopy, &a, 1, 2).unwrap_err();
        assert!(e.to_string().contains("default_reduce_zero_copy"), "{e}");
        a.output = 0x2000;
        a.output_bytes = 64;
        check_shape(NativeKind::ReduceZeroCopy, &a, 1, 2).expect("root with its output");
        a.input = 0;
        assert!(check_shape(NativeKind::ReduceZeroCopy, &a, 0, 2).is_err());
        a.root = 2;
        assert!(check_shape(NativeKind::ReduceZeroCopy, &args(64, 64), 0, 2).is_ok());
        assert!(check_shape(NativeKind::ReduceZeroCopy, &a, 0, 2).is_err());
    }

    #[test]
    fn broadcast_roots_and_null_inputs() {
        let mut a = args(64, 64);
        a.root = 2;
        assert!(check_shape(NativeKind::BroadcastZeroCopy, &a, 0, 2).is_err());
        a.root = 1;
        a.input = 0;
        check_shape(NativeKind::BroadcastZeroCopy, &a, 0, 2).expect("non-root input may be null");
        assert!(check_shape(NativeKind::BroadcastZeroCopy, &a, 1, 2).is_err());
        assert!(check_shape(NativeKind::AllreduceRsagZeroCopy, &a, 0, 2).is_err());
        let empty = ExecuteArgs {
            input: 0,
            output: 0,
            ..args(0, 0)
        };
        assert_eq!(
            check_shape(NativeKind::AllreducePacket, &empty, 0, 2).expect("no-op"),
            0
        );
    }

    /// On AMD an LL128 line carries 64 payload bytes, not 120: the LL128 kinds' capacity shrinks
    /// in proportion, so a call the kernels could not fit is refused; LL16 and the rest keep theirs.
    #[test]
    fn amd_ll128_capacity_follows_its_line_payload() {
        for n in [2, 4, 8] {
            for kind in NativeKind::ALL {
                let cuda = max_input_bytes_on(kind, 18 << 20, n, GpuVendor::Nvidia);
                let amd = max_input_bytes_on(kind, 18 << 20, n, GpuVendor::Amd);
                assert_eq!(cuda, max_input_bytes(kind, 18 << 20, n), "{kind:?}");
                if kind.scratch_part() == Some(ScratchPart::Ll128) {
                    assert_eq!(amd, cuda / 120 * 64, "{kind:?} on {n} ranks");
                    assert_eq!(cuda % 120, 0, "{kind:?}: whole lines");
                } else {
                    assert_eq!(amd, cuda, "{kind:?}");
                }
            }
        }
    }

    #[rstest]
    // 8 MiB scratch at 2 ranks: the all-pair kind's 2 MiB slots of LL16 packets carry 1 MiB each.
    #[case(NativeKind::AllreduceAllpairPacket, 8 << 20, 2, 1 << 20)]
    // The two-phase one: [RS][AG] x 2 slots of 1 MiB, 8192 LL128 lines of 120 bytes each.
    #[case(NativeKind::AllreducePacket, 8 << 20, 2, 2 * 8192 * 120)]
    // The gather and scatter: 2 MiB slots of 16384 lines (512 KiB slots, 4096 lines, at 8 ranks).
    #[case(NativeKind::AllgatherPacket, 8 << 20, 2, 16384 * 120)]
    #[case(NativeKind::ReducescatterPacket, 8 << 20, 2, 2 * 16384 * 120)]
    #[case(NativeKind::AllgatherPacket, 8 << 20, 8, 4096 * 120)]
    #[case(NativeKind::ReducescatterPacket, 8 << 20, 8, 8 * 4096 * 120)]
    #[case(NativeKind::AllgatherFullmesh2, 0, 8, usize::MAX)]
    #[case(NativeKind::ReducescatterZeroCopy, 0, 8, usize::MAX)]
    // Scratch-staged: rsag holds [RS][AG] x nranks slots of 2 MiB at 2 ranks; the pipelines take
    // any size.
    #[case(NativeKind::AllreduceRsag, 8 << 20, 2, 2 << 20)]
    #[case(NativeKind::AllreduceRsag, 8 << 20, 8, 2 << 20)]
    #[case(NativeKind::AllreduceRsagPipeline, 8 << 20, 8, usize::MAX)]
    #[case(NativeKind::AllreduceFullmesh, 8 << 20, 8, usize::MAX)]
    #[case(NativeKind::AllgatherFullmesh, 8 << 20, 8, usize::MAX)]
    #[case(NativeKind::AllreduceRsagPush, 8 << 20, 8, usize::MAX)]
    fn packet_capacities(
        #[case] kind: NativeKind,
        #[case] scratch: usize,
        #[case] n: usize,
        #[case] want: usize,
    ) {
        assert_eq!(max_input_bytes(kind, scratch, n), want, "{kind:?}");
        check_capacity(kind, want, want).expect("at the limit");
        if want != usize::MAX {
            let e = check_capacity(kind, want + 1, want).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            let msg = e.to_string();
            assert!(
                msg.contains(kind.name()) && msg.contains(&want.to_string()),
                "{msg}"
            );
        }
    }

    /// Each kind's block cap, which `NativeBase::check` (so `prepare`) and its launch share: the
    /// packet kinds one block per SM, the scratch pipelines and zero-copy kinds their semaphores,
    /// the copy engine's reduction the residency alone; one block more is a launch shape.
    #[rstest]
    #[case(NativeKind::AllreducePacket, 512, 132)]
    #[case(NativeKind::AllgatherPacket, 1024, 132)]
    #[case(NativeKind::AllreduceRsagZeroCopy, 512, 256)]
    #[case(NativeKind::AllreduceRsagZeroCopy, 1024, 132)]
    #[case(NativeKind::BroadcastZeroCopy, 512, 128)]
    #[case(NativeKind::AllreduceFullmesh, 256, 128)]
    #[case(NativeKind::AllreduceCopyEngine, 256, 528)]
    fn every_kind_caps_its_blocks(
        #[case] kind: NativeKind,
        #[case] threads: u32,
        #[case] cap: u32,
    ) {
        let r = Residency {
            sm: 132,
            shares_device: false,
            mps: false,
        };
        assert_eq!(kind.max_blocks(r, threads), cap, "{kind:?}");
        let over = geometry::launch_config(Some(cap + 1), Some(threads), 1, 512, cap).unwrap_err();
        assert!(matches!(over, Error::LaunchShape(_)), "{over:?}");
        for k in NativeKind::ALL {
            assert!(k.max_blocks(r, threads) >= 1, "{k:?}");
        }
    }

    #[test]
    fn packet_kinds_share_one_launch_shape() {
        for k in NativeKind::ALL {
            // Packet kinds need scratch and no semaphores; the zero-copy ones the reverse; the
            // scratch pipelines need both.
            assert_eq!(k.uses_packets(), k.semaphore_blocks(132) == 0, "{k:?}");
            assert!(!(k.uses_packets() && k.uses_scratch_pipeline()), "{k:?}");
            assert_eq!(
                k.uses_scratch(),
                k.uses_packets() || k.uses_scratch_pipeline(),
                "{k:?}"
            );
            // Their step counter has MAX_PACKET_BLOCKS slots: never more semaphore blocks.
            if k.uses_scratch_pipeline() {
                assert!(
                    k.semaphore_blocks(1000) as usize <= MAX_PACKET_BLOCKS,
                    "{k:?}"
                );
            }
        }
        assert_eq!(
            NativeKind::AllgatherPacket.packet_work_bytes(1024, 8),
            7 * 1024
        );
        assert_eq!(NativeKind::AllgatherPacket.packet_work_bytes(1024, 1), 1024);
        assert_eq!(
            NativeKind::ReducescatterPacket.packet_work_bytes(1024, 8),
            1024
        );
    }

    #[test]
    fn pipeline_capacity_matches_its_geometry() {
        // Whatever fits rsag's limit gets a one-step geometry; the pipeline takes 1 GiB.
        for n in 2..=MAX_RANKS {
            let max = max_input_bytes(NativeKind::AllreduceRsag, 8 << 20, n);
            let g = geometry::rsag_geometry(max / 2, 2, 4 << 20, n, false).expect("fits");
            assert_eq!(g.steps(max / 2, n, true), 1, "{n} ranks");
            let g = geometry::rsag_geometry((1 << 30) / 2, 2, 8 << 20, n, true).expect("pipelined");
            assert!(g.steps((1 << 30) / 2, n, true) > 1);
        }
    }

    /// The default collection's parts hold every message the default selector sends to a packet
    /// algorithm, at every world size, so the selection does not change with the shared scratch.
    #[test]
    fn default_parts_cover_the_selector_thresholds() {
        use crate::resources::scratch_bounds;
        use mscclpp_core::algorithm_collection::{
            allpair_ll128_from, allpair_threshold, packet_gather_scatter_threshold,
            packet_threshold,
        };
        for n in 2..=MAX_RANKS {
            // The call counter and a 256-block semaphore table towards n - 1 peers.
            let tail = 8 * 1024 + 256 * (n - 1) * 40;
            let b = scratch_bounds(crate::DEFAULT_SCRATCH_BYTES, tail);
            let (ll16, ll128) = (b[1] - b[0], b[3] - b[2]);
            let max = |k| {
                max_input_bytes(
                    k,
                    if k == NativeKind::AllreduceAllpairPacket {
                        ll16
                    } else {
                        ll128
                    },
                    n,
                )
            };
            assert!(
                max(NativeKind::AllreduceAllpairPacket) >= allpair_threshold(n),
                "{n}"
            );
            if allpair_ll128_from(n).is_some() {
                assert!(
                    max(NativeKind::AllreduceAllpairLl128) >= allpair_threshold(n),
                    "{n}"
                );
            }
            assert!(
                max(NativeKind::AllreducePacket) >= packet_threshold(n),
                "{n}"
            );
            let total = packet_gather_scatter_threshold(n);
            assert!(max(NativeKind::AllgatherPacket) >= total / n, "{n}");
            assert!(max(NativeKind::ReducescatterPacket) >= total, "{n}");
        }
    }

    #[test]
    fn every_kind_has_a_distinct_name() {
        let mut names: Vec<_> = NativeKind::ALL.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), NativeKind::ALL.len());
    }

    #[test]
    fn names_and_kernels_match() {
        for k in NativeKind::ALL {
            let (file, entry) = k.file_and_entry();
            assert!(file.entry_points().contains(&entry), "{k:?}");
            assert!(k
                .name()
                .starts_with(&format!("default_{}", k.collective().name())));
        }
    }
}
