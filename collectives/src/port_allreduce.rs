//! `port_allreduce`: an all-reduce whose data moves through PortChannels, i.e. the host proxy copies
//! with the copy engine on the GPU's request, instead of SM loads and stores over NVLink. 2..=8
//! ranks on any number of hosts (a flat algorithm: it serves uneven ranks per host too), every
//! (dtype, accumulator, op) that `resolve_accumulator` offers.
//!
//! # Setup (collective: every rank constructs it at the same point of its communicator setup)
//! - A scratch of `2 * nranks * slot_stride` bytes (two parity halves of one slot per rank,
//!   `slot_stride = round_up(max_bytes, 16)`), exchanged with every rank ([`SharedScratch`]).
//! - A staging buffer of `max_bytes`, the source of every put. Choice: the input is copied into
//!   it with a stream-ordered copy-engine copy (`memcpy_async`) rather than registered directly,
//!   because the proxy's memory table is closed once it runs, while callers pass new buffers on
//!   every call; and rather than copied by a kernel, because a one-block copy is slow and a
//!   many-block copy would need a grid barrier before block 0 may push the puts.
//! - A [`PortChannelService`] with, per peer in rank order, one connection (CudaIpc on this host;
//!   to another host IB where both ends can use it, else Ethernet: [`proxy_connections`]), one
//!   semaphore and one channel (dst = the peer's scratch, src = the staging buffer); then the
//!   proxy starts. IB peers write into our scratch and semaphore words through their HCA (the
//!   memory is registered with ours), Ethernet peers through a `DeviceMemoryResolver`.
//!
//! Refuses to start under `CUDA_DEVICE_MAX_CONNECTIONS=1`, where its exchange kernel would wait for
//! copies queued behind it ([`shared_queue_hazard`]).
//!
//! # One call (`execute` enqueues only; legal during CUDA-graph capture)
//! Messages larger than `max_bytes` run as consecutive all-reduces of segments that fit the slots
//! ([`segment_bytes`]). Per segment: copy input -> staging; `port_allreduce_exchange` (one warp: put with signal into slot `rank` of
//! the current half of every peer, flush, wait for every peer's signal, advance the device call
//! counter); `port_allreduce_reduce` (every block: output = reduction of the ranks' data in rank
//! order, so every rank gets bit-identical results). Why parity double buffering makes a second
//! signal round unnecessary is explained in port_allreduce.cu.
//!
//! # Segments in flight (`InFlight`)
//! A large message is hundreds of segments, three stream operations each (1 GiB at 2 ranks: 960
//! for the cross-host step of the hierarchical all-reduce, 2,700 for the flat one at 3 ranks),
//! and every segment's exchange needs this process's proxy thread and Ethernet receiver, which
//! make CUDA calls of their own (copies to and from the device, event records and queries).
//! Once about a thousand operations are queued the driver blocks the next launch until the GPU
//! retires some, and other threads' CUDA calls in the process wait too (reported on NVIDIA's
//! forums, where launches and copies of other threads on other streams blocked, and in other
//! projects' deadlock analyses as exhaustion of a launch queue the process shares): the proxy
//! and the receiver stop, the exchange kernels wait for them, and every rank's device waits time
//! out. That is what 1 GiB did on one H200 (2 hosts x 2 ranks hierarchical, 2 + 1 ranks flat: a
//! receiver stuck in its copy for the whole 30 s budget, the peer's flush unacknowledged), while
//! 2 x 4 (half the segments per rank) passed; inferred from the logs and the segment counts, not
//! profiled. So an eager call keeps at most `3 x SEGMENTS_PER_MARK` of its segments queued
//! (`InFlight`): every `SEGMENTS_PER_MARK`-th segment records an event, and before recording it
//! again the host waits (polling, with the communicator's and the proxy's health) for its
//! previous record, two marks back; the wait ends with about `2 x SEGMENTS_PER_MARK` segments
//! still queued, so the GPU does not starve. Not under graph capture (nothing runs then; a replay
//! is one operation) and not where another rank runs in this process (one thread may drive both,
//! and the wait would need the other rank's kernels, not enqueued yet).

use crate::geometry::{self, Residency};
use crate::resources::{launch_with_args, DeviceBuffer, SharedScratch};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::device::{PortAllreduceArgs, PortChannelHandle};
use mscclpp_core::env::Env;
use mscclpp_core::gpu::{DevicePtr, Event, Function, Gpu, LaunchConfig, Stream};
use mscclpp_core::port_channel::{shared_queue_hazard, PortChannelConfig, PortChannelService};
use mscclpp_core::proxy::ProxyStats;
use mscclpp_core::transport::connect::{agree_plan, connect_peers, IbConnector, IbSetup};
use mscclpp_core::transport::select::TransportPlan;
use mscclpp_core::transport::{DeviceMemoryResolver, MemoryRegion, Transport};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::collectives::{
    cxx_type, resolve_accumulator, ReduceSpec, COMMON, MAX_RANKS,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The algorithm's name in selectors and reports.
pub const NAME: &str = mscclpp_core::algorithm_collection::native_names::PORT_ALLREDUCE;
/// The kernel file (see its header comment for the protocol).
pub const KERNEL_SOURCE: &str = include_str!("port_allreduce.cu");
/// Entry points of every unit.
pub const EXCHANGE_ENTRY: &str = "port_allreduce_exchange";
pub const REDUCE_ENTRY: &str = "port_allreduce_reduce";

/// Threads of the one exchange block: one warp, a lane per peer.
const EXCHANGE_THREADS: u32 = 32;
/// Default threads per block of the reduce kernel.
const DEFAULT_THREADS: u32 = 512;
/// Largest byte offset a proxy trigger can carry (32-bit offset fields).
const MAX_TRIGGER_OFFSET: u64 = u32::MAX as u64;
/// Slot alignment: the reduce kernel uses 16-byte vector accesses when slots and buffers allow.
const SLOT_ALIGN: usize = 16;
/// Segments between two events of `InFlight` (module docs, "Segments in flight"): at most three
/// times this many are queued, 72 stream operations of this algorithm, far below the driver's
/// launch queue even with the per-segment work of a caller (the reduce-scatter through the
/// all-reduce adds a copy per rank and the hierarchical host steps).
const SEGMENTS_PER_MARK: usize = 8;

/// Which of two marks (events) to wait for and record after a segment: the counting of
/// [`Marks`], pure so it is tested on the CPU.
#[derive(Debug, Default)]
struct InFlight {
    /// Whether each mark has been recorded (and so may be waited for).
    recorded: [bool; 2],
    /// The mark recorded next.
    next: usize,
    /// Segments enqueued since the last mark.
    since_mark: usize,
}

/// What the host does after a segment (see [`InFlight::segment_enqueued`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MarkStep {
    /// Wait for this mark's previous record first.
    wait: Option<usize>,
    /// Then record this mark behind the segment.
    record: usize,
}

impl InFlight {
    /// Counts one segment just enqueued: every [`SEGMENTS_PER_MARK`]-th, the mark to record behind
    /// it, after waiting for that mark's previous record (two marks back).
    fn segment_enqueued(&mut self) -> Option<MarkStep> {
        self.since_mark += 1;
        if self.since_mark < SEGMENTS_PER_MARK {
            return None;
        }
        let m = self.next;
        let step = MarkStep {
            wait: self.recorded[m].then_some(m),
            record: m,
        };
        self.recorded[m] = true;
        self.next = 1 - m;
        self.since_mark = 0;
        Some(step)
    }
}

/// Bounds the segments of this algorithm queued on the GPU (module docs, "Segments in flight"):
/// two events recorded in turn as [`InFlight`] says, across calls. The cross-host point-to-point
/// engine bounds its queued groups with it too (`p2p::port`), for the same reason: each needs
/// this process's proxy.
pub(crate) struct Marks {
    events: [Event; 2],
    count: InFlight,
    gpu: Arc<dyn Gpu>,
}

impl Marks {
    pub(crate) fn new(gpu: Arc<dyn Gpu>) -> Result<Marks> {
        let first = gpu.create_event()?;
        let second = match gpu.create_event() {
            Ok(e) => e,
            Err(e) => {
                let _ = gpu.destroy_event(first);
                return Err(e);
            }
        };
        Ok(Marks {
            events: [first, second],
            count: InFlight::default(),
            gpu,
        })
    }

    /// After a segment enqueued on `stream`: waits (with `wait`) and records as [`InFlight`] says.
    pub(crate) fn segment_enqueued(
        &mut self,
        stream: Stream,
        wait: impl FnOnce(Event) -> Result<()>,
    ) -> Result<()> {
        let Some(step) = self.count.segment_enqueued() else {
            return Ok(());
        };
        if let Some(m) = step.wait {
            wait(self.events[m])?;
        }
        self.gpu.record_event(self.events[step.record], stream)
    }
}

impl Drop for Marks {
    fn drop(&mut self) {
        // An event still pending is released once it completes (cuEventDestroy).
        for e in self.events {
            if let Err(err) = self.gpu.destroy_event(e) {
                tracing::warn!(target: "mscclpp::coll", "destroying an in-flight mark's event: {err}");
            }
        }
    }
}

/// Where each rank's data lands in a rank's scratch. Pure arithmetic, mirrored by the kernels
/// (which receive `slot_stride` and compute the same offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScratchLayout {
    pub nranks: usize,
    /// Largest message (bytes per rank) one call takes.
    pub max_bytes: usize,
    /// Bytes between consecutive slots: `max_bytes` rounded up to 16.
    pub slot_stride: usize,
}

/// Bytes of one segment of a call: messages larger than the scratch slots run as consecutive
/// all-reduces of segments of this size (each a complete call with its own exchange, so the
/// double buffering holds between segments as between calls). A whole number of 16-byte vectors
/// where `max_bytes` allows, so every segment but the last keeps the vectorised reduction, and
/// always a whole number of elements.
pub fn segment_bytes(max_bytes: usize, elem_bytes: usize) -> usize {
    let vectors = max_bytes / SLOT_ALIGN * SLOT_ALIGN;
    if vectors >= elem_bytes {
        vectors
    } else {
        max_bytes / elem_bytes * elem_bytes
    }
}

impl ScratchLayout {
    /// The layout for `nranks` ranks and messages of up to `max_bytes`. Errors name the limit
    /// that is broken: world size outside 2..=8, an empty message size, or a scratch whose offsets
    /// do not fit a trigger's 32-bit offset field.
    pub fn new(nranks: usize, max_bytes: usize) -> Result<ScratchLayout> {
        if !(2..=MAX_RANKS).contains(&nranks) {
            return Err(Error::Unsupported(format!(
                "{NAME} on {nranks} ranks: it supports 2..={MAX_RANKS} ranks"
            )));
        }
        if max_bytes == 0 {
            return Err(Error::InvalidArgument(format!(
                "{NAME}: max_bytes must be greater than 0"
            )));
        }
        let layout = ScratchLayout {
            nranks,
            max_bytes,
            slot_stride: max_bytes.next_multiple_of(SLOT_ALIGN),
        };
        // The last byte any put writes is the end of the last slot of the second half.
        let total = layout.scratch_bytes() as u64;
        if total - 1 > MAX_TRIGGER_OFFSET {
            return Err(Error::InvalidArgument(format!(
                "{NAME}: max_bytes {max_bytes} on {nranks} ranks needs a scratch of {total} bytes, \
                 beyond the {} bytes a PortChannel trigger can address; at most {} bytes per call",
                MAX_TRIGGER_OFFSET + 1,
                Self::largest_max_bytes(nranks)
            )));
        }
        Ok(layout)
    }

    /// The largest `max_bytes` whose scratch a trigger can still address on `nranks` ranks.
    pub fn largest_max_bytes(nranks: usize) -> usize {
        let slots = 2 * nranks.max(1) as u64;
        (((MAX_TRIGGER_OFFSET + 1) / slots) as usize) / SLOT_ALIGN * SLOT_ALIGN
    }

    /// Bytes of scratch each rank allocates: two parity halves of `nranks` slots.
    pub fn scratch_bytes(&self) -> usize {
        2 * self.nranks * self.slot_stride
    }

    /// Offset in every peer's scratch where `rank` puts its data in call number `call`.
    pub fn slot_offset(&self, call: u64, rank: usize) -> u64 {
        ((call & 1) * self.nranks as u64 + rank as u64) * self.slot_stride as u64
    }
}

/// Collective with `peers`: a proxy transport towards each: CudaIpc on this host; to other hosts
/// IB where both ends can use it (`mscclpp_ib::VerbsConnector`: `buffers` and the communicator's
/// semaphore slab registered with the HCA, GPU memory through GPUDirect RDMA), Ethernet otherwise
/// (`buffers` and the slab served to peers by a `DeviceMemoryResolver`). The plan is agreed by
/// both ends of every pair and logged once (`mscclpp_core::transport::connect`).
pub fn proxy_connections(
    comm: &Communicator,
    peers: &[usize],
    buffers: &[(DevicePtr, usize)],
) -> Result<Vec<Arc<dyn Transport>>> {
    let env = Env::get()?;
    let connector = mscclpp_ib::VerbsConnector;
    let ib = connector.availability(env);
    let plan = TransportPlan::new(comm.topology(), comm.rank(), ib, env.ibv_mode);
    let plan = agree_plan(comm.bootstrap().as_ref(), plan)?;
    plan.log_once();
    let mut memory = buffers.to_vec();
    memory.push(comm.semaphore_slab());
    let resolver = Arc::new(DeviceMemoryResolver::new(comm.gpu().clone(), comm.device()));
    for &(ptr, bytes) in &memory {
        resolver.register(ptr, bytes)?;
    }
    let ib = IbSetup {
        connector: &connector,
        memory: &memory,
    };
    connect_peers(comm, &plan, peers, resolver, Some(ib))
}

/// Validates `args` (no device access) and returns the element count
/// (0: nothing to do). Unsupported combinations are `Error::Unsupported` naming them. Any size is
/// accepted: messages beyond `layout.max_bytes` run as several segments ([`segment_bytes`]).
pub fn check_args(args: &ExecuteArgs) -> Result<usize> {
    check_args_of(NAME, args)
}

/// [`check_args`] for all-reduce algorithm `name` (errors name it): the checks of every all-reduce
/// built on this one (`hierarchical`).
pub fn check_args_of(name: &str, args: &ExecuteArgs) -> Result<usize> {
    let count = args.input_count()?;
    resolve_accumulator(args.dtype, args.accum)
        .map_err(|e| Error::Unsupported(format!("{name}: {e}")))?;
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
    Ok(count)
}

/// Name (logs, kernel cache) of the unit for `spec`.
pub fn unit_name(spec: ReduceSpec) -> String {
    format!(
        "{NAME}_{}_acc_{}_{}",
        spec.dtype.name(),
        spec.acc.name(),
        spec.op.name()
    )
}

/// The complete translation unit for `spec`: the type/op defines, the shared collective code
/// (`PeerPtrs`, `reduce_to_all`), then [`KERNEL_SOURCE`].
pub fn unit_source(spec: ReduceSpec) -> String {
    format!(
        "#define MSCCLPP_COLL_T {}\n#define MSCCLPP_COLL_ACC {}\n#define MSCCLPP_COLL_OP {}\n{COMMON}\n{KERNEL_SOURCE}",
        cxx_type(spec.dtype),
        cxx_type(spec.acc),
        spec.op.to_nccl()
    )
}

/// The two kernels of one unit.
#[derive(Debug, Clone, Copy)]
struct Kernels {
    exchange: Function,
    reduce: Function,
}

/// The PortChannel all-reduce bound to one communicator. See the module docs.
pub struct PortAllreduce {
    // Field order is drop order. The service goes first: its proxy drains and stops (and its
    // connections finish their copies) before anything it copies from or into is released. The
    // scratch goes after the staging buffer: its drop waits (bootstrap barrier) until every peer
    // has dropped its own service, so no peer's proxy still writes into it.
    // In a mutex because the service is `Send` but not `Sync` (the proxy's stop channel), while
    // `Algorithm` objects are shared between threads; only the host-side checks take it.
    service: Mutex<PortChannelService>,
    channels: DeviceBuffer,
    staging: DeviceBuffer,
    calls: DeviceBuffer,
    scratch: SharedScratch,
    kernels: Mutex<HashMap<ReduceSpec, Kernels>>,
    marks: Mutex<Marks>,
    layout: ScratchLayout,
    residency: Residency,
    comm: Arc<Communicator>,
}

impl PortAllreduce {
    /// Collective: builds the algorithm for messages of up to `max_bytes` bytes per rank. `config`
    /// sets the proxy (FIFO depth, flush timeout) and the device waits' spin bound.
    pub fn new(
        comm: Arc<Communicator>,
        max_bytes: usize,
        config: PortChannelConfig,
    ) -> Result<PortAllreduce> {
        // Its exchange flushes and waits in one kernel: on one hardware queue that hangs.
        if let Some(hazard) = shared_queue_hazard(Env::get()?, comm.mps_clients_per_gpu()) {
            return Err(Error::Unsupported(format!("{NAME}: {hazard}")));
        }
        let (rank, nranks) = (comm.rank(), comm.size());
        let layout = ScratchLayout::new(nranks, max_bytes)?;
        let gpu = comm.gpu().clone();
        gpu.set_device(comm.device())?;
        let residency = Residency::of(&comm)?;
        let scratch = SharedScratch::new(&comm, layout.scratch_bytes())?;
        let staging = DeviceBuffer::zeroed(&gpu, layout.max_bytes)?;
        let calls = DeviceBuffer::zeroed(&gpu, std::mem::size_of::<u64>())?;
        let mut service = PortChannelService::new(&comm, config)?;
        let src = service.add_memory_region(MemoryRegion {
            addr: staging.ptr(),
            size: layout.max_bytes as u64,
            key: 0,
        })?;
        let peers: Vec<usize> = (0..nranks).filter(|&p| p != rank).collect();
        let connections = proxy_connections(
            &comm,
            &peers,
            &[
                (scratch.local_ptr(), layout.scratch_bytes()),
                (staging.ptr(), layout.max_bytes),
            ],
        )?;
        let scratch_ptrs = scratch.rank_ptrs();
        let mut handles: Vec<PortChannelHandle> = Vec::with_capacity(nranks - 1);
        for (&peer, conn) in peers.iter().zip(connections) {
            // On another host: the scratch's address in its owner's process, which the Ethernet
            // transport names to the owner's resolver and the IB transport keys with the owner's
            // rkey.
            let peer_scratch = *scratch_ptrs.get(peer).ok_or_else(|| {
                Error::Internal(format!("{NAME}: no scratch address of rank {peer}"))
            })?;
            let dst = service.add_memory_region(MemoryRegion {
                addr: peer_scratch,
                size: layout.scratch_bytes() as u64,
                key: 0,
            })?;
            let sem = service.add_semaphore(&comm, conn).map_err(|e| {
                Error::Internal(format!("{NAME}: semaphore towards rank {peer}: {e}"))
            })?;
            handles.push(service.port_channel(sem, dst, src)?);
        }
        let channels = DeviceBuffer::upload(&gpu, &handles)?;
        let marks = Mutex::new(Marks::new(gpu.clone())?);
        service.start()?;
        Ok(PortAllreduce {
            service: Mutex::new(service),
            channels,
            staging,
            calls,
            scratch,
            kernels: Mutex::new(HashMap::new()),
            marks,
            layout,
            residency,
            comm,
        })
    }

    pub fn layout(&self) -> ScratchLayout {
        self.layout
    }

    /// Largest message (input bytes per rank) one call takes.
    pub fn max_bytes(&self) -> usize {
        self.layout.max_bytes
    }

    /// The first proxy error not reported yet (a failed copy, signal or flush). Call it after
    /// synchronising the stream; `execute` also reports it at its next call.
    pub fn check_proxy(&self) -> Result<()> {
        self.service()?
            .check()
            .map_err(|e| Error::Internal(format!("{NAME}: the PortChannel proxy reported: {e}")))
    }

    /// The grid of the call's reduction: the requested launch shape where given, checked
    /// ([`Error::LaunchShape`]), else sized by the message.
    fn reduce_config(&self, args: &ExecuteArgs) -> Result<LaunchConfig> {
        let threads = args.nthreads.unwrap_or(DEFAULT_THREADS);
        let max_blocks = self.residency.max_blocks(threads);
        geometry::launch_config(
            args.nblocks,
            args.nthreads,
            geometry::bandwidth_blocks(args.input_bytes, max_blocks),
            DEFAULT_THREADS,
            max_blocks,
        )
        .map_err(|e| match e {
            Error::LaunchShape(m) => Error::LaunchShape(format!("{NAME}: {m}")),
            e => e,
        })
    }

    /// Triggers the proxy has handled so far.
    pub fn proxy_stats(&self) -> Result<ProxyStats> {
        Ok(self.service()?.stats())
    }

    fn service(&self) -> Result<std::sync::MutexGuard<'_, PortChannelService>> {
        self.service.lock().map_err(|_| {
            Error::Internal(format!("{NAME}: the proxy service was poisoned by a panic"))
        })
    }

    /// The unit a call of `args` runs.
    fn spec(&self, args: &ExecuteArgs) -> Result<ReduceSpec> {
        Ok(ReduceSpec {
            dtype: args.dtype,
            acc: resolve_accumulator(args.dtype, args.accum)?,
            op: args.op,
        })
    }

    fn kernels(&self, spec: ReduceSpec) -> Result<Kernels> {
        let lock = || {
            self.kernels.lock().map_err(|_| {
                Error::Internal(format!("{NAME}: the kernel table was poisoned by a panic"))
            })
        };
        if let Some(k) = lock()?.get(&spec) {
            return Ok(*k);
        }
        // Compiled outside the lock: NVRTC takes a while and other specs need not wait.
        let gpu = self.comm.gpu();
        let module = gpu.build_module(&unit_name(spec), &unit_source(spec))?;
        let k = Kernels {
            exchange: gpu.get_function(module, EXCHANGE_ENTRY)?,
            reduce: gpu.get_function(module, REDUCE_ENTRY)?,
        };
        lock()?.insert(spec, k);
        Ok(k)
    }
}

impl Algorithm for PortAllreduce {
    fn name(&self) -> &str {
        NAME
    }

    fn collective(&self) -> Collective {
        Collective::AllReduce
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        check_args(args)?;
        self.reduce_config(args).map(|_| ())
    }

    /// Loads the call's two kernels (one unit) without enqueuing anything: an algorithm that
    /// enqueues this one after other work of its call (`hierarchical`) prepares it first, since
    /// loading a kernel may wait for the exchange kernel of an earlier step, which waits for this
    /// process's own Ethernet receiver.
    fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        self.comm.check(NAME)?;
        if check_args(args)? > 0 {
            self.reduce_config(args)?;
            self.kernels(self.spec(args)?)?;
        }
        Ok(())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        // A failed communicator (dead or stalled peer, abort) queues nothing more: one host load.
        self.comm.check(NAME)?;
        let count = check_args(args)?;
        // A proxy failure of an earlier call surfaces here at the latest (host-only check).
        self.check_proxy()?;
        if count == 0 {
            return Ok(());
        }
        let kernels = self.kernels(self.spec(args)?)?;
        let reduce_cfg = self.reduce_config(args)?;
        let es = args.dtype.size();
        let segment = segment_bytes(self.layout.max_bytes, es);
        if segment == 0 {
            return Err(Error::InvalidArgument(format!(
                "{NAME}: built for {} bytes per rank, less than one {} element",
                self.layout.max_bytes, args.dtype
            )));
        }
        // Module docs, "Segments in flight".
        let bounded = !self.comm.shares_process() && !self.comm.gpu().is_capturing(args.stream)?;
        let mut marks = self.marks.lock().map_err(|_| {
            Error::Internal(format!(
                "{NAME}: the in-flight marks were poisoned by a panic"
            ))
        })?;
        let mut done = 0usize;
        while done < args.input_bytes {
            let len = segment.min(args.input_bytes - done);
            self.enqueue_segment(&kernels, reduce_cfg, args, done as u64, len)?;
            done += len;
            if bounded {
                marks.segment_enqueued(args.stream, |mark| {
                    // Bounded too by the device wait budget of every queued kernel's waits.
                    self.comm
                        .wait_event(mark, args.stream, NAME, &|| self.check_proxy())
                })?;
            }
        }
        Ok(())
    }
}

impl PortAllreduce {
    /// Enqueues the all-reduce of bytes `[offset, offset + len)` of the caller's buffers (`len` at
    /// most the slot size, a whole number of elements): copy into staging, exchange, reduce.
    fn enqueue_segment(
        &self,
        kernels: &Kernels,
        reduce_cfg: LaunchConfig,
        args: &ExecuteArgs,
        offset: u64,
        len: usize,
    ) -> Result<()> {
        let gpu = self.comm.gpu();
        gpu.memcpy_async(self.staging.ptr(), args.input + offset, len, args.stream)?;

        let nranks = self.comm.size() as u32;
        // One argument struct for both kernels: the exchange's device addresses are this
        // object's live buffers (channels, counter) and, through the channels, the proxy's FIFO,
        // which live until the object is dropped; the reduce's input and output are the
        // caller's buffers (checked non-null, holding at least input_bytes).
        let kargs = PortAllreduceArgs {
            chans: self.channels.ptr(),
            input: args.input + offset,
            output: args.output + offset,
            scratch: self.scratch.local_ptr(),
            calls: self.calls.ptr(),
            bytes: len as u64,
            count: (len / args.dtype.size()) as u64,
            slot_stride: self.layout.slot_stride as u64,
            npeers: nranks - 1,
            rank: self.comm.rank() as u32,
            nranks,
            pad: 0,
        };
        launch_with_args(
            gpu.as_ref(),
            kernels.exchange,
            LaunchConfig::linear(1, EXCHANGE_THREADS),
            args.stream,
            kargs,
        )?;
        launch_with_args(gpu.as_ref(), kernels.reduce, reduce_cfg, args.stream, kargs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::gpu::Stream;
    use mscclpp_core::{AccumType, DataType, ReduceOp};
    use rstest::rstest;

    fn args(dtype: DataType, input_bytes: usize, output_bytes: usize) -> ExecuteArgs {
        ExecuteArgs {
            input: 0x1000,
            output: 0x2000,
            input_bytes,
            output_bytes,
            dtype,
            op: ReduceOp::Sum,
            accum: AccumType::Auto,
            root: 0,
            stream: Stream::DEFAULT,
            nblocks: None,
            nthreads: None,
        }
    }

    /// Whatever the GPU does in between, the host never leaves more than three marks' worth of
    /// segments queued, waits only for marks already recorded, and leaves two marks' worth queued
    /// when a wait ends (here: a GPU that runs nothing until waited for).
    #[test]
    fn at_most_three_marks_of_segments_are_queued() {
        let mut count = InFlight::default();
        let mut recorded_at = [None::<usize>; 2];
        let mut done = 0usize;
        let mut waits = 0;
        for enqueued in 1..=1000usize {
            if let Some(step) = count.segment_enqueued() {
                if let Some(m) = step.wait {
                    let at = recorded_at[m].expect("a recorded mark");
                    assert_eq!(enqueued - at, 2 * SEGMENTS_PER_MARK);
                    done = done.max(at);
                    waits += 1;
                }
                recorded_at[step.record] = Some(enqueued);
            }
            assert!(
                enqueued - done < 3 * SEGMENTS_PER_MARK,
                "{enqueued} queued, {done} done"
            );
        }
        assert_eq!(waits, 1000 / SEGMENTS_PER_MARK - 2);
    }

    #[rstest]
    #[case(2, 4, 16)]
    #[case(2, 16, 16)]
    #[case(3, 4104, 4112)]
    #[case(8, 64 << 20, 64 << 20)]
    #[case(4, (1 << 20) - 2, 1 << 20)]
    fn slot_stride_is_max_bytes_rounded_to_16(
        #[case] n: usize,
        #[case] max: usize,
        #[case] stride: usize,
    ) {
        let l = ScratchLayout::new(n, max).expect("layout");
        assert_eq!(l.slot_stride, stride);
        assert_eq!(l.scratch_bytes(), 2 * n * stride);
    }

    #[test]
    fn slot_offsets_alternate_halves_and_never_overlap() {
        let l = ScratchLayout::new(4, 1000).expect("layout");
        assert_eq!(l.slot_offset(0, 0), 0);
        assert_eq!(l.slot_offset(0, 3), 3 * 1008);
        assert_eq!(l.slot_offset(1, 0), 4 * 1008);
        assert_eq!(l.slot_offset(2, 2), l.slot_offset(0, 2), "parity only");
        assert_eq!(l.slot_offset(7, 1), l.slot_offset(1, 1));
        // Every (half, rank) slot is disjoint from every other and inside the scratch.
        let mut ranges: Vec<(u64, u64)> = (0..2u64)
            .flat_map(|c| (0..4).map(move |r| (c, r)))
            .map(|(c, r)| {
                (
                    l.slot_offset(c, r),
                    l.slot_offset(c, r) + l.max_bytes as u64,
                )
            })
            .collect();
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert!(w[0].1 <= w[1].0, "{w:?} overlap");
        }
        assert!(ranges.iter().all(|r| r.0 % 16 == 0));
        assert!(ranges.last().expect("slots").1 <= l.scratch_bytes() as u64);
    }

    #[rstest]
    #[case(1)]
    #[case(9)]
    #[case(0)]
    fn world_sizes_outside_2_to_8_are_unsupported(#[case] n: usize) {
        let e = ScratchLayout::new(n, 1024).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(e.to_string().contains(&format!("{n} ranks")), "{e}");
    }

    #[test]
    fn scratch_must_fit_trigger_offsets() {
        for n in 2..=MAX_RANKS {
            let largest = ScratchLayout::largest_max_bytes(n);
            let l = ScratchLayout::new(n, largest).expect("largest fits");
            let last = l.slot_offset(1, n - 1) + l.max_bytes as u64 - 1;
            assert!(last <= MAX_TRIGGER_OFFSET, "{n} ranks: {last}");
            let e = ScratchLayout::new(n, largest + SLOT_ALIGN).unwrap_err();
            assert!(
                e.to_string().contains(&format!("at most {largest} bytes")),
                "{e}"
            );
        }
        // 64 MiB messages fit at every world size the suite runs.
        assert!(ScratchLayout::largest_max_bytes(8) >= 64 << 20);
        assert!(ScratchLayout::new(2, 0).is_err());
    }

    #[rstest]
    #[case(64 << 20, 2, 64 << 20)]
    #[case(4100, 4, 4096)]
    #[case(4100, 8, 4096)]
    #[case(6, 4, 4)]
    #[case(7, 2, 6)]
    #[case(15, 8, 8)]
    fn segments_are_whole_vectors_or_elements(
        #[case] max_bytes: usize,
        #[case] es: usize,
        #[case] want: usize,
    ) {
        let seg = segment_bytes(max_bytes, es);
        assert_eq!(seg, want);
        assert!(seg <= max_bytes && seg % es == 0 && seg > 0);
    }

    #[test]
    fn call_arguments_are_checked() {
        assert_eq!(
            check_args(&args(DataType::F32, 4096, 4096)).ok(),
            Some(1024)
        );
        assert_eq!(check_args(&args(DataType::Bf16, 2, 2)).ok(), Some(1));
        // Larger than any scratch: accepted, it runs in segments.
        assert_eq!(
            check_args(&args(DataType::Bf16, 1 << 30, 1 << 30)).ok(),
            Some(1 << 29)
        );
        let e = check_args(&args(DataType::F32, 6, 8)).unwrap_err();
        assert!(e.to_string().contains("element size"), "{e}");
        let e = check_args(&args(DataType::F32, 16, 12)).unwrap_err();
        assert!(e.to_string().contains("output holds 12"), "{e}");
        let mut a = args(DataType::F32, 16, 16);
        a.input = 0;
        assert!(check_args(&a)
            .unwrap_err()
            .to_string()
            .contains("null input"));
        // An empty call is a no-op, with or without buffers.
        a.input_bytes = 0;
        a.output = 0;
        assert_eq!(check_args(&a).ok(), Some(0));
        // Narrowing accumulators are refused by name.
        let mut a = args(DataType::F32, 16, 16);
        a.accum = AccumType::F16;
        let e = check_args(&a).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(e.to_string().contains(NAME), "{e}");
    }

    #[test]
    fn units_are_named_and_specialised_per_spec() {
        let spec = ReduceSpec {
            dtype: DataType::Bf16,
            acc: DataType::F32,
            op: ReduceOp::Max,
        };
        assert_eq!(unit_name(spec), "port_allreduce_bf16_acc_f32_max");
        let src = unit_source(spec);
        assert!(src.starts_with("#define MSCCLPP_COLL_T bf16\n#define MSCCLPP_COLL_ACC float\n"));
        assert!(src.contains("#define MSCCLPP_COLL_OP 2\n"), "ncclMax = 2");
        for entry in [EXCHANGE_ENTRY, REDUCE_ENTRY] {
            assert!(src.contains(&format!(" {entry}(")), "{entry}");
        }
        assert!(src.contains("reduce_to_all"));
    }

    /// The specs the NVRTC test compiles: every dtype with its own accumulator and Sum, every op
    /// for one float and one integer type, and the widening accumulators.
    fn compile_specs() -> Vec<ReduceSpec> {
        let mut specs: Vec<ReduceSpec> = DataType::ALL
            .iter()
            .map(|&dtype| ReduceSpec {
                dtype,
                acc: dtype,
                op: ReduceOp::Sum,
            })
            .collect();
        for dtype in [DataType::Bf16, DataType::I32] {
            for op in ReduceOp::ALL {
                specs.push(ReduceSpec {
                    dtype,
                    acc: dtype,
                    op,
                });
            }
        }
        for (dtype, accum) in [
            (DataType::Bf16, AccumType::F32),
            (DataType::F16, AccumType::F32),
            (DataType::Fp8E4M3, AccumType::F16),
        ] {
            let acc = resolve_accumulator(dtype, accum).expect("offered accumulator");
            specs.push(ReduceSpec {
                dtype,
                acc,
                op: ReduceOp::Avg,
            });
        }
        specs.dedup();
        specs
    }

    /// The kernel unit compiles through NVRTC for sm_90 (H100/H200), with the static_asserts of
    /// the argument structs against their Rust layout (`PortAllreduceArgs` among them). Needs
    /// NVRTC and the CUDA headers (`source scripts/nvrtc-env.sh`); skipped with a printed reason
    /// otherwise, unless MSCCLPP_REQUIRE_NVRTC=1.
    #[test]
    fn kernel_units_compile_for_sm_90() {
        use mscclpp_cuda::compile_test::{compile_cubin, nvrtc_or_skip};
        let Some(nvrtc) = nvrtc_or_skip("kernel_units_compile_for_sm_90") else {
            return;
        };
        for spec in compile_specs() {
            let name = unit_name(spec);
            let source = unit_source(spec) + &mscclpp_kernels_cu::collectives::layout_asserts();
            compile_cubin(&nvrtc, &name, &source, "sm_90", mscclpp_kernels_cu::HEADERS);
        }
    }
}
