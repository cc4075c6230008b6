//! `default_allreduce_hierarchical`: the all-reduce of H hosts x k ranks (k equal on every host,
//! H and k in 2..=8), composed of algorithms that run on a GPU already, with no kernel of its own.
//!
//! # Setup (collective over the communicator)
//! Two sub-communicators ([`Communicator::split`], over the parent's bootstrap, sharing its health):
//! - the host group (the k ranks of this rank's host), with the single-host default collection
//!   built over it (`build_default_algorithms`: packet, zero-copy and scratch-staged kernels over
//!   CudaIpc/NVLink, and its selector);
//! - the cross-host group (the H ranks with this rank's local rank, one per host), with
//!   [`PortAllreduce`] over it (the proxy: Ethernet between hosts).
//!
//! # One call (`execute` enqueues only, no host synchronisation beyond `port_allreduce`'s bound
//! on queued segments; legal during CUDA-graph capture)
//! The [`plan`] of a call: for messages of at least [`SPLIT_MIN_BYTES`] and k elements, the whole
//! chunks (k shares of `count / k` elements) run as three steps:
//! 1. reduce-scatter in the host: local rank j gets the host's sum of share j, written into its
//!    own slice of the output;
//! 2. all-reduce of that slice across hosts (every host's rank j reduces share j);
//! 3. all-gather in the host, in place in the output (packets or staged through the scratch,
//!    never the zero-copy kernel: [`HierarchicalAllreduce`]'s `host_algorithm` says why);
//!
//! and the last `count % k` elements (and whole smaller messages): all-reduce in the host, then
//! all-reduce across hosts (every cross group reduces the same elements, so every rank ends with
//! them). Network traffic per rank is about 1/k of the message for the large path, which is where
//! the model in `docs/multi-host-model.md` puts the hierarchical algorithm's bandwidth.
//! Each step is the group's algorithm as its selector picks it (the host group's selector sees a
//! k-rank single-host call). Every step's kernels are loaded before the first is enqueued (CUDA's
//! lazy loading may wait for the running kernels of the context, among them the cross-host
//! exchange, which waits for this process's Ethernet receiver).
//!
//! # Pipeline
//! Where each share holds at least two [`PIPELINE_MIN_SHARE_BYTES`], the whole chunks are cut into
//! segments ([`segment_elems`]: up to [`PIPELINE_MAX_SEGMENTS`]), each a contiguous piece of the
//! message run through the three steps. The host group's calls stay on the caller's stream, in
//! the order reduce-scatter 0, reduce-scatter 1, all-gather 0, reduce-scatter 2, all-gather 1,
//! ...; the cross-host all-reduces run on this algorithm's second stream, in segment order. Events
//! order them ([`READY`], [`CROSSED`]): an all-reduce after its segment's reduce-scatter, an
//! all-gather after its segment's all-reduce. So while segment s crosses the network, the
//! caller's stream gathers s - 1 and scatters s + 1 over NVLink. The caller's stream waits for
//! the last all-reduce before the last all-gather (the join), so it depends on all the work, a
//! capture contains it all (the second stream forks from the capture through the first event),
//! and every call of `port_allreduce` and of the host collection is ordered on the device, as
//! `resources::CollectionResources` requires, across calls too (the tail's all-reduce across
//! hosts runs on the caller's stream after the join). Smaller messages, and jobs where a rank's
//! SM share is one SM (nothing to reserve), keep the sequential steps on the caller's stream. A
//! failed enqueue still joins the second stream before the error is returned (no capture is left
//! with an unjoined stream); a failure on the device is the communicator's sticky error naming
//! the step's algorithm, as before, and every device wait is bounded, so nothing hangs.
//!
//! # Residency
//! Every host-group kernel waits for its peers' blocks, so its whole grid must be resident, and
//! now the cross-host exchange kernel (one block of 32 threads, spinning until the peers' data is
//! in) can run at the same time on the same rank. The host group's communicator reserves
//! [`CROSS_RESERVED_SMS`] SM ([`Communicator::reserve_multiprocessors`]): its grids are sized
//! for one SM less than the rank's share (`geometry::Residency`). Why the two always fit:
//! - one rank per context (`Residency::max_blocks`: `q = 1024 / threads` blocks an SM, each
//!   thread at most 64 registers by `__launch_bounds__(1024, 1)`, the exchange kernel included):
//!   the host grid has at most `(sm - 1) q` blocks. If the exchange block is resident, the other
//!   `sm - 1` SMs hold `q` host blocks each. If the whole host grid is, some SM holds at most
//!   `q - 1` of its blocks (else there would be `sm q`), so of the 1024 threads (and their
//!   registers) the rule counts on there, at least one host block's worth, 32 threads or more,
//!   is free: the exchange block (32 threads) fits. The other kernels of the rank that may share
//!   the SMs (`port_allreduce`'s reduce, copies) wait for no one, so they leave in bounded time.
//!   Other processes' ranks run in their own contexts (time-sliced without MPS, within their SM
//!   share with it), as before.
//! - ranks sharing a context (one block per SM of each rank's share): host grid `share - 1`
//!   blocks plus the exchange block is still at most one block per SM of the device in all.
//!
//! And no wait is circular: a host kernel waits only for its host peers' kernels of the same
//! step and segment, an exchange only for its cross peers' exchanges of the same segment, and
//! every stream and event dependency points from a segment's later phase to an earlier one or
//! to an earlier segment. So by induction over (segment, phase) every kernel's peers start, each
//! rank holding at most its two waiting kernels resident at once.
//!
//! # Integer averages
//! The host step's average is rounded (truncated) before the cross-host step averages again, and
//! `trunc(trunc(a / k) + trunc(b / k)) / 2` is not `trunc((a + b) / 2k)`: an integer `avg` runs
//! the flat all-reduce the collection passes in (one division of the whole sum, as on one host),
//! and is refused where there is none (more than 8 ranks). Float averages stay hierarchical (each
//! step's rounding is within the type's tolerance).
//!
//! # Device memory per rank
//! The host group's collection lends one scratch built from `scratch_bytes / 4`
//! ([`host_scratch_bytes`]: about 3.75 x that, 7.5 MiB for the default 8 MiB), the cross group's
//! `port_allreduce` takes `(2H + 1)` segments of [`port_segment_bytes`] (about `scratch_bytes`
//! in all), and the two sub-communicators' semaphore slabs `2 x (k + H) x 32 KiB`: about 16 MiB at
//! 2 hosts x 4 ranks with the default scratch.

use crate::port_allreduce::{self, PortAllreduce};
use crate::resources::lock;
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::{native_names, AlgorithmCollection, SelectionContext};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::{Event, Gpu, Stream};
use mscclpp_core::port_channel::PortChannelConfig;
use mscclpp_core::{Error, ReduceOp, Result};
use mscclpp_kernels_cu::collectives::MAX_RANKS;
use std::sync::{Arc, Mutex};

/// The algorithm's name in selectors and reports.
pub const NAME: &str = native_names::ALLREDUCE_HIERARCHICAL;

/// Messages (bytes per rank) from which the three-step path runs; below, the two all-reduces (in
/// the host, across hosts) cost one launch less and move at most this much over the network. A
/// starting point; retune with `mscclpp-bench` on hosts with a network.
pub const SPLIT_MIN_BYTES: usize = 64 << 10;

/// The scratch the host group's collection is built from (`build_default_algorithms`' argument).
pub fn host_scratch_bytes(scratch_bytes: usize) -> usize {
    scratch_bytes / 4
}

/// Segment (bytes) of a PortChannel all-reduce over `nranks` ranks whose whole scratch (two
/// parity halves of a slot per rank, and the staging buffer: `2 x nranks + 1` segments) is about
/// `scratch_bytes`; at least one 16-byte vector.
pub fn port_segment_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    (scratch_bytes / (2 * nranks + 1) / 16 * 16).max(16)
}

/// Least bytes of a segment's share, what one rank all-reduces across hosts per segment: each
/// segment costs a reduce-scatter and an all-gather launch in the host and at least one proxy
/// round trip across hosts (tens of microseconds over TCP). The rule: a segment's share is
/// itself a message the three-step path takes ([`SPLIT_MIN_BYTES`]); a starting point, to retune
/// with `mscclpp-bench` on hosts with a network. It also cuts the GPU suite's 1 MiB all-reduces
/// at 2 x 2 and 2 x 4 ranks into 7 and 3 segments, so the pipeline runs under graph capture in
/// the suite. MSCCL++ has no such knob (its multi-node all-reduces fix their pipelines in the
/// kernels), hence a constant.
pub const PIPELINE_MIN_SHARE_BYTES: usize = SPLIT_MIN_BYTES;

/// Most segments of one call: the fill and drain of the pipeline cost about one segment's
/// three phases, 1/16 of the sequential time, and every segment adds six stream operations
/// (two host launches, two event records, two waits) to `port_allreduce`'s own: 96 at most,
/// well within the launch queue (its module docs, "Segments in flight").
pub const PIPELINE_MAX_SEGMENTS: usize = 16;

/// SMs of each rank's share that the host group's kernels leave to the cross-host exchange
/// kernel running beside them (module docs, "Residency"): its one block.
pub const CROSS_RESERVED_SMS: u32 = 1;

/// Segment shares are whole 16-byte vectors (of every element size), so every segment's
/// offsets keep the alignment of the caller's buffers.
const SEGMENT_ALIGN: usize = 16;

/// One step of a call, on byte offsets of the caller's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Reduce-scatter in the host of input `[offset, offset + k * chunk)`: local rank j's share
    /// goes to output `[offset + j * chunk, offset + (j + 1) * chunk)`.
    HostReduceScatter { offset: usize, chunk: usize },
    /// All-reduce across hosts of output `[offset, offset + bytes)`, in place.
    CrossAllreduce { offset: usize, bytes: usize },
    /// All-gather in the host, in place: output `[offset + j * chunk, offset + (j + 1) * chunk)`
    /// of every local rank j into output `[offset, offset + k * chunk)`.
    HostAllgather { offset: usize, chunk: usize },
    /// All-reduce in the host of input `[offset, offset + bytes)` into the same bytes of the
    /// output.
    HostAllreduce { offset: usize, bytes: usize },
}

/// The stream a step is enqueued on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// The caller's stream: every call of the host group's collection, and every step of an
    /// unpipelined call.
    Caller,
    /// This algorithm's second stream: the cross-host all-reduces of a pipelined call.
    Cross,
}

/// Events of a pipelined call (indices into [`EVENTS`] events): `READY[s % 2]` is recorded on the
/// caller's stream behind segment s's reduce-scatter and waited for by the cross stream before
/// its all-reduce; `CROSSED` is recorded on the cross stream behind each all-reduce and waited
/// for by the caller's stream before the segment's all-gather (the last wait is the join).
pub const READY: [usize; 2] = [0, 1];
pub const CROSSED: usize = 2;
pub const EVENTS: usize = 3;

/// One step with its stream and its event operations: on `lane`, wait for `wait`'s latest
/// record, enqueue the step, then record `record`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    pub step: Step,
    pub lane: Lane,
    pub wait: Option<usize>,
    pub record: Option<usize>,
}

impl Op {
    fn on_caller(step: Step) -> Op {
        Op {
            step,
            lane: Lane::Caller,
            wait: None,
            record: None,
        }
    }
}

/// Elements of each local rank's share per segment when each rank's whole share is `whole`
/// elements of `elem_bytes` bytes: as many segments as hold [`PIPELINE_MIN_SHARE_BYTES`] each,
/// at most [`PIPELINE_MAX_SEGMENTS`], cut equally (rounded up to whole 16-byte vectors; the last
/// segment takes what is left). `whole` or more: one segment.
pub fn segment_elems(whole: usize, elem_bytes: usize) -> usize {
    let es = elem_bytes.max(1);
    let align = (SEGMENT_ALIGN / es).max(1);
    let min = (PIPELINE_MIN_SHARE_BYTES / es).max(1);
    let segments = (whole / min).clamp(1, PIPELINE_MAX_SEGMENTS);
    whole.div_ceil(segments).next_multiple_of(align).max(1)
}

/// The steps of an all-reduce of `count` elements of `elem_bytes` bytes over hosts of `k` ranks,
/// for local rank `local`, in enqueue order (see the module docs). `pipelined`: whether this
/// rank may run the cross-host steps on a second stream (the same on every rank of the job).
/// The same sequence on every rank, so every group's collectives match; only the offsets of the
/// cross steps differ by local rank. Pure, so it is tested on the CPU.
pub fn plan(count: usize, elem_bytes: usize, k: usize, local: usize, pipelined: bool) -> Vec<Op> {
    let bytes = count * elem_bytes;
    let whole = if bytes >= SPLIT_MIN_BYTES && k > 0 {
        count / k
    } else {
        0
    };
    let per = if pipelined {
        segment_elems(whole, elem_bytes)
    } else {
        whole.max(1)
    };
    // (offset, chunk) in bytes of each segment: k shares of `chunk`, tiling [0, k * whole).
    let segments: Vec<(usize, usize)> = (0..whole)
        .step_by(per)
        .map(|e| (e * k * elem_bytes, per.min(whole - e) * elem_bytes))
        .collect();
    let rs = |(offset, chunk): (usize, usize)| Step::HostReduceScatter { offset, chunk };
    let cross = |(offset, chunk): (usize, usize)| Step::CrossAllreduce {
        offset: offset + local * chunk,
        bytes: chunk,
    };
    let ag = |(offset, chunk): (usize, usize)| Step::HostAllgather { offset, chunk };
    let mut out = Vec::with_capacity(3 * segments.len() + 2);
    if let [one] = segments[..] {
        out.extend([rs(one), cross(one), ag(one)].map(Op::on_caller));
    } else if !segments.is_empty() {
        // The caller's stream runs segment s + 1's reduce-scatter before segment s's all-gather,
        // which waits for s's all-reduce: so the cross stream's all-reduce of s overlaps the
        // caller's all-gather of s - 1 and reduce-scatter of s + 1. Segment s + 1's
        // reduce-scatter is enqueued before s's all-reduce, whose enqueue may block the host
        // (`port_allreduce`'s bound on queued segments) while the GPU works on both.
        let n = segments.len();
        let reduce_scatter = |s: usize| Op {
            step: rs(segments[s]),
            lane: Lane::Caller,
            wait: None,
            record: Some(READY[s % 2]),
        };
        out.push(reduce_scatter(0));
        out.push(reduce_scatter(1));
        for s in 0..n {
            out.push(Op {
                step: cross(segments[s]),
                lane: Lane::Cross,
                wait: Some(READY[s % 2]),
                record: Some(CROSSED),
            });
            out.push(Op {
                step: ag(segments[s]),
                lane: Lane::Caller,
                wait: Some(CROSSED),
                record: None,
            });
            if s + 2 < n {
                out.push(reduce_scatter(s + 2));
            }
        }
    }
    let done = whole * k * elem_bytes;
    if done < bytes {
        let rest = bytes - done;
        out.push(Op::on_caller(Step::HostAllreduce {
            offset: done,
            bytes: rest,
        }));
        out.push(Op::on_caller(Step::CrossAllreduce {
            offset: done,
            bytes: rest,
        }));
    }
    out
}

/// The second stream of pipelined calls and its [`EVENTS`] events (see [`plan`]).
struct CrossStream {
    stream: Stream,
    events: Vec<Event>,
    gpu: Arc<dyn Gpu>,
}

impl CrossStream {
    fn new(gpu: Arc<dyn Gpu>) -> Result<CrossStream> {
        let stream = gpu.create_stream()?;
        let mut events = Vec::with_capacity(EVENTS);
        for _ in 0..EVENTS {
            match gpu.create_event() {
                Ok(e) => events.push(e),
                Err(e) => {
                    crate::copy_engine::destroy(gpu.as_ref(), NAME, stream, &events);
                    return Err(e);
                }
            }
        }
        Ok(CrossStream {
            stream,
            events,
            gpu,
        })
    }
}

impl Drop for CrossStream {
    fn drop(&mut self) {
        // Its all-reduces use the cross group's buffers, released after this (field order).
        if let Err(e) = self.gpu.synchronize_stream(self.stream) {
            tracing::warn!(target: "mscclpp::algo", "{NAME}: waiting for the cross stream: {e}");
        }
        crate::copy_engine::destroy(self.gpu.as_ref(), NAME, self.stream, &self.events);
    }
}

/// The hierarchical all-reduce bound to one communicator. See the module docs.
pub struct HierarchicalAllreduce {
    // Field order is drop order: the cross stream (drained) first, then the groups' algorithms
    // before the groups' communicators, all before the parent.
    /// `Some` where the cross-host steps may run on a second stream (module docs, "Residency");
    /// locked through a call, whose events it holds.
    pipeline: Option<Mutex<CrossStream>>,
    host: AlgorithmCollection,
    cross: Arc<PortAllreduce>,
    /// The flat all-reduce over the whole communicator, for integer averages.
    flat: Option<Arc<dyn Algorithm>>,
    host_comm: Arc<Communicator>,
    cross_comm: Arc<Communicator>,
    /// The device's architecture, for the host group's selector.
    arch: String,
    comm: Arc<Communicator>,
}

impl HierarchicalAllreduce {
    /// Collective over `comm`: splits it into its host and cross-host groups and builds each
    /// group's algorithms (see the module docs for what `scratch_bytes` buys). `flat`, an
    /// all-reduce over all of `comm`, runs the integer averages (module docs). `Unsupported`
    /// where the hierarchy does not apply (one host, one rank per host, uneven hosts, more than
    /// 8 hosts or 8 ranks per host), before anything collective, so every rank refuses alike.
    pub fn new(
        comm: Arc<Communicator>,
        scratch_bytes: usize,
        flat: Option<Arc<dyn Algorithm>>,
    ) -> Result<HierarchicalAllreduce> {
        let topology = comm.topology();
        let groups = topology.hierarchy(comm.rank()).ok_or_else(|| {
            Error::Unsupported(format!(
                "{NAME} needs at least 2 hosts with the same number (at least 2) of ranks each, \
                 not {topology}"
            ))
        })?;
        let (k, hosts) = (groups.host.len(), groups.cross.len());
        if k > MAX_RANKS || hosts > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "{NAME} takes up to {MAX_RANKS} hosts of up to {MAX_RANKS} ranks, not {topology}"
            )));
        }
        let arch = comm.gpu().properties(comm.device())?.arch;
        // Every rank splits its host group first, then its cross group: two parent collectives
        // in the same order everywhere; the groups' own setup then involves their members only.
        let mut host_comm = comm.split(&groups.host)?;
        host_comm.reserve_multiprocessors(CROSS_RESERVED_SMS);
        // Pipelined only where the reservation left the exchange its SM, on every rank: the
        // segments decide the cross group's calls, which must match across hosts (whose devices
        // and sharers may differ). A parent collective, in the same place on every rank.
        let able = host_comm.multiprocessors()? < comm.multiprocessors()?;
        let pipelined = comm
            .bootstrap()
            .all_gather(&[u8::from(able)])?
            .iter()
            .all(|b| b[..] == [1]);
        let host_comm = Arc::new(host_comm);
        let cross_comm = Arc::new(comm.split(&groups.cross)?);
        let host = crate::build_default_algorithms(
            &host_comm,
            host_scratch_bytes(scratch_bytes),
            AlgorithmCollection::builder(),
        )?
        .build();
        let cross = Arc::new(PortAllreduce::new(
            cross_comm.clone(),
            port_segment_bytes(scratch_bytes, hosts),
            PortChannelConfig::default(),
        )?);
        let pipeline = if pipelined {
            comm.gpu().set_device(comm.device())?;
            Some(Mutex::new(CrossStream::new(comm.gpu().clone())?))
        } else {
            None
        };
        Ok(HierarchicalAllreduce {
            pipeline,
            host,
            cross,
            flat,
            host_comm,
            cross_comm,
            arch,
            comm,
        })
    }

    /// Ranks per host.
    pub fn ranks_per_host(&self) -> usize {
        self.host_comm.size()
    }

    /// Hosts.
    pub fn hosts(&self) -> usize {
        self.cross_comm.size()
    }

    /// The first proxy error of the cross-host step not reported yet (see
    /// [`PortAllreduce::check_proxy`]).
    pub fn check_proxy(&self) -> Result<()> {
        self.cross.check_proxy()
    }

    /// The algorithm of the host group for `collective` on `args`: its selector's choice, except
    /// that the all-gather never takes the zero-copy `default_allgather_fullmesh2` but the
    /// scratch-staged `default_allgather_fullmesh` (the packet one where the selector picks it):
    /// the all-gather is enqueued after the cross-host step, whose exchange kernel spins until
    /// this process's Ethernet receiver has copied the peers' data in, and a zero-copy kernel
    /// registers a new user buffer first (driver calls that could wait on that kernel).
    /// The reduce-scatter stays zero-copy for large segments: a pipelined call enqueues the
    /// reduce-scatters of segments 2 and on while exchanges run, but their input lies in the
    /// allocation the first segment's registration has already imported from every peer
    /// (imports are counted per allocation), so what is left is address and handle queries
    /// (`cuMemGetAddressRange`, `cuIpcGetMemHandle`) and the host group's bootstrap exchange.
    fn host_algorithm(
        &self,
        collective: Collective,
        args: &ExecuteArgs,
    ) -> Result<Arc<dyn Algorithm>> {
        let k = self.host_comm.size();
        let ctx = SelectionContext {
            collective,
            message_bytes: args.input_bytes,
            dtype: args.dtype,
            world_size: k,
            local_world_size: k,
            symmetric_memory: false,
            capturing: self.comm.gpu().is_capturing(args.stream)?,
            arch: self.arch.clone(),
            // NVLink multicast stays behind its gate: not from here.
            nvls_allowed: false,
            in_place: SelectionContext::buffers_in_place(collective, args, self.host_comm.rank()),
            op: Some(args.op),
        };
        let chosen = self.host.select(&ctx)?;
        if chosen.name() != native_names::ALLGATHER_FULLMESH2 {
            return Ok(chosen);
        }
        self.host
            .get(Collective::AllGather, native_names::ALLGATHER_FULLMESH)
            .ok_or_else(|| {
                Error::Internal(format!(
                    "{NAME}: the host group has no {}",
                    native_names::ALLGATHER_FULLMESH
                ))
            })
    }

    /// The call's steps as (algorithm, arguments, op), in enqueue order (see [`plan`]); a step
    /// on the cross lane gets `cross_stream` (the caller's stream where there is none).
    fn calls(&self, args: &ExecuteArgs, cross_stream: Option<Stream>) -> Result<Vec<Call>> {
        let count = port_allreduce::check_args_of(NAME, args)?;
        if args.op == ReduceOp::Avg && !args.dtype.is_float() {
            let flat = self.flat.clone().ok_or_else(|| {
                Error::Unsupported(format!(
                    "{NAME}: the {} average over {} ranks needs one division of the whole sum \
                     (a hierarchical one truncates twice), and no flat all-reduce serves {} ranks",
                    args.dtype,
                    self.comm.size(),
                    self.comm.size()
                ))
            })?;
            // The whole message on the caller's stream (the step only labels it).
            return Ok(vec![(
                flat,
                *args,
                Op::on_caller(Step::HostAllreduce {
                    offset: 0,
                    bytes: args.input_bytes,
                }),
            )]);
        }
        let (k, local) = (self.host_comm.size(), self.host_comm.rank());
        let at = |base: u64, offset: usize| base + offset as u64;
        let cross: Arc<dyn Algorithm> = self.cross.clone();
        plan(count, args.dtype.size(), k, local, cross_stream.is_some())
            .into_iter()
            .map(|op| match op.step {
                Step::HostReduceScatter { offset, chunk } => {
                    let a = ExecuteArgs {
                        input: at(args.input, offset),
                        input_bytes: k * chunk,
                        output: at(args.output, offset + local * chunk),
                        output_bytes: chunk,
                        ..*args
                    };
                    Ok((self.host_algorithm(Collective::ReduceScatter, &a)?, a, op))
                }
                Step::CrossAllreduce { offset, bytes } => Ok((
                    cross.clone(),
                    ExecuteArgs {
                        input: at(args.output, offset),
                        output: at(args.output, offset),
                        input_bytes: bytes,
                        output_bytes: bytes,
                        stream: match op.lane {
                            Lane::Cross => cross_stream.unwrap_or(args.stream),
                            Lane::Caller => args.stream,
                        },
                        ..*args
                    },
                    op,
                )),
                Step::HostAllgather { offset, chunk } => {
                    let a = ExecuteArgs {
                        input: at(args.output, offset + local * chunk),
                        input_bytes: chunk,
                        output: at(args.output, offset),
                        output_bytes: k * chunk,
                        ..*args
                    };
                    Ok((self.host_algorithm(Collective::AllGather, &a)?, a, op))
                }
                Step::HostAllreduce { offset, bytes } => {
                    let a = ExecuteArgs {
                        input: at(args.input, offset),
                        output: at(args.output, offset),
                        input_bytes: bytes,
                        output_bytes: bytes,
                        ..*args
                    };
                    Ok((self.host_algorithm(Collective::AllReduce, &a)?, a, op))
                }
            })
            .collect()
    }
}

/// One step of a call: the algorithm, its arguments and where it goes (its [`Op`]).
type Call = (Arc<dyn Algorithm>, ExecuteArgs, Op);

/// Enqueues `calls` in order, each on its lane with its event wait and record (`cross`: the
/// second stream and its events, needed once a call is on the cross lane). Once the cross
/// stream has waited for the caller's (forked), an error still joins it back to the caller's
/// stream before it is returned, so a CUDA-graph capture is not left with an unjoined stream;
/// the first error is returned.
fn enqueue(
    gpu: &dyn Gpu,
    calls: &[Call],
    caller: Stream,
    cross: Option<&CrossStream>,
) -> Result<()> {
    let mut forked = None;
    let mut run = || -> Result<()> {
        for (algo, a, op) in calls {
            let second = || {
                cross.ok_or_else(|| {
                    Error::Internal(format!("{NAME}: a pipelined step without a second stream"))
                })
            };
            let stream = match op.lane {
                Lane::Caller => caller,
                Lane::Cross => second()?.stream,
            };
            let event = |i: usize| -> Result<Event> {
                second()?
                    .events
                    .get(i)
                    .copied()
                    .ok_or_else(|| Error::Internal(format!("{NAME}: no event {i} of {EVENTS}")))
            };
            if let Some(w) = op.wait {
                gpu.stream_wait_event(stream, event(w)?)?;
                if op.lane == Lane::Cross {
                    forked = cross;
                }
            }
            algo.execute(a)?;
            if let Some(r) = op.record {
                gpu.record_event(event(r)?, stream)?;
            }
        }
        Ok(())
    };
    let result = run();
    if let (Err(_), Some(c)) = (&result, forked) {
        // Best effort: the error being reported is the first one.
        let joined = gpu
            .record_event(c.events[CROSSED], c.stream)
            .and_then(|()| gpu.stream_wait_event(caller, c.events[CROSSED]));
        if let Err(e) = joined {
            tracing::warn!(target: "mscclpp::algo", "{NAME}: joining the second stream: {e}");
        }
    }
    result
}

impl Algorithm for HierarchicalAllreduce {
    fn name(&self) -> &str {
        NAME
    }

    fn collective(&self) -> Collective {
        Collective::AllReduce
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        port_allreduce::check_args_of(NAME, args).map(|_| ())
    }

    /// Chooses and prepares (compiles, loads) every step's algorithm, enqueuing nothing.
    fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        self.comm.check(NAME)?;
        let pipeline = self.pipeline.as_ref().map(lock).transpose()?;
        for (algo, a, _) in self.calls(args, pipeline.as_ref().map(|c| c.stream))? {
            algo.prepare(&a)?;
        }
        Ok(())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        self.comm.check(NAME)?;
        // Held through the call: its events are the call's.
        let pipeline = self.pipeline.as_ref().map(lock).transpose()?;
        let calls = self.calls(args, pipeline.as_ref().map(|c| c.stream))?;
        // Every kernel of the call is loaded before the first step is enqueued: loading a kernel
        // may wait for the kernels running in this context (CUDA's lazy loading), among them the
        // cross-host exchange kernel, which waits for this process's Ethernet receiver, whose
        // copies into the device would then wait for the load: a hang.
        for (algo, a, _) in &calls {
            algo.prepare(a)?;
        }
        enqueue(
            self.comm.gpu().as_ref(),
            &calls,
            args.stream,
            pipeline.as_deref(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    /// Unpipelined (and every message with one segment): today's steps on the caller's stream,
    /// no events. The reduce-scatter's shares tile the whole chunks, the cross steps cover each
    /// rank's share and the tail, and the steps cover every byte once per phase.
    #[rstest]
    #[case(1, 4, 2)]
    #[case(3, 2, 4)]
    #[case(SPLIT_MIN_BYTES / 2, 2, 2)]
    #[case(SPLIT_MIN_BYTES / 2 - 1, 2, 2)]
    #[case(SPLIT_MIN_BYTES / 4 + 3, 4, 3)]
    #[case(SPLIT_MIN_BYTES, 1, 8)]
    #[case((1 << 30) / 2, 2, 8)]
    fn unpipelined_steps_cover_the_message(
        #[case] count: usize,
        #[case] es: usize,
        #[case] k: usize,
    ) {
        let bytes = count * es;
        for local in 0..k {
            let whole = if bytes >= SPLIT_MIN_BYTES {
                count / k
            } else {
                0
            };
            let chunk = whole * es;
            let mut want = Vec::new();
            if whole > 0 {
                want.push(Step::HostReduceScatter { offset: 0, chunk });
                want.push(Step::CrossAllreduce {
                    offset: local * chunk,
                    bytes: chunk,
                });
                want.push(Step::HostAllgather { offset: 0, chunk });
            }
            let done = k * chunk;
            if done < bytes {
                want.push(Step::HostAllreduce {
                    offset: done,
                    bytes: bytes - done,
                });
                want.push(Step::CrossAllreduce {
                    offset: done,
                    bytes: bytes - done,
                });
            }
            let ops = plan(count, es, k, local, false);
            assert!(ops.iter().all(|o| *o == Op::on_caller(o.step)));
            let got: Vec<Step> = ops.iter().map(|o| o.step).collect();
            assert_eq!(got, want, "count {count} es {es} k {k} local {local}");
            // The tail is shorter than one element per local rank (or the whole small message).
            assert!(bytes < SPLIT_MIN_BYTES || bytes - done < k * es);
            // Small messages keep today's path when pipelined too.
            if whole * es < 2 * PIPELINE_MIN_SHARE_BYTES {
                assert_eq!(plan(count, es, k, local, true), ops);
            }
        }
    }

    /// The segment rule: at most [`PIPELINE_MAX_SEGMENTS`] segments, each share (but the last)
    /// at least [`PIPELINE_MIN_SHARE_BYTES`] and whole 16-byte vectors, together the whole share.
    #[rstest]
    #[case(0, 2)]
    #[case(1, 1)]
    #[case(PIPELINE_MIN_SHARE_BYTES / 2 * 2 - 1, 2)]
    #[case(PIPELINE_MIN_SHARE_BYTES / 2 * 2, 2)]
    #[case(PIPELINE_MIN_SHARE_BYTES * 3 + 5, 1)]
    #[case(PIPELINE_MIN_SHARE_BYTES / 8 * 7 + 1, 8)]
    #[case((1 << 30) / 2 / 4, 4)]
    #[case(usize::MAX / 64, 8)]
    fn segments_follow_the_rule(#[case] whole: usize, #[case] es: usize) {
        let per = segment_elems(whole, es);
        assert!(per >= 1);
        let n = whole.div_ceil(per);
        assert!(n <= PIPELINE_MAX_SEGMENTS, "{n} segments");
        if n > 1 {
            assert_eq!(per * es % SEGMENT_ALIGN, 0);
            assert!(per * es >= PIPELINE_MIN_SHARE_BYTES);
        }
        let wanted = (whole * es / PIPELINE_MIN_SHARE_BYTES).clamp(1, PIPELINE_MAX_SEGMENTS);
        // Rounding to vectors may save a segment, never add one.
        assert!(
            n <= wanted && n + 1 >= wanted.min(whole.max(1)),
            "{n} for {wanted}"
        );
    }

    /// The device order a plan gives: each op's predecessors are the previous op of its lane and
    /// the op whose record its wait sees (the latest record of that event enqueued before it,
    /// as cuStreamWaitEvent and stream capture take it). `reach[i][j]`: op j runs before op i.
    fn happens_before(ops: &[Op]) -> Vec<Vec<bool>> {
        let n = ops.len();
        let mut reach = vec![vec![false; n]; n];
        let mut last_on = [None::<usize>; 2];
        let mut recorded = [None::<usize>; EVENTS];
        for (i, op) in ops.iter().enumerate() {
            let lane = op.lane as usize;
            let mut preds: Vec<usize> = last_on[lane].into_iter().collect();
            if let Some(w) = op.wait {
                let producer = recorded[w].expect("a wait for an event recorded before it");
                preds.push(producer);
            }
            for p in preds {
                let before = reach[p].clone();
                reach[i][p] = true;
                for (r, b) in reach[i].iter_mut().zip(before) {
                    *r |= b;
                }
            }
            last_on[lane] = Some(i);
            if let Some(r) = op.record {
                recorded[r] = Some(i);
            }
        }
        reach
    }

    /// A pipelined plan: every segment's three phases in dependency order (the all-reduce after
    /// its own reduce-scatter, the all-gather after its own all-reduce), the caller's last op after
    /// every op (the join: the caller's stream depends on all the work, so the call is captured
    /// whole), the cross stream's all-reduces (the only calls of `port_allreduce`) in segment
    /// order on one stream, and segment s + 1's reduce-scatter free of segment s's all-reduce
    /// (the overlap).
    #[rstest]
    #[case(1 << 20, 2, 2)]
    #[case((1 << 20) + 5, 2, 2)]
    #[case(16 << 20, 4, 4)]
    #[case((64 << 20) - 4, 4, 3)]
    #[case((1 << 30) / 2, 2, 8)]
    #[case(3 << 20, 1, 2)]
    fn pipelined_plans_keep_their_dependencies(
        #[case] count: usize,
        #[case] es: usize,
        #[case] k: usize,
    ) {
        for local in 0..k {
            let ops = plan(count, es, k, local, true);
            let find = |f: &dyn Fn(&Step) -> bool| -> Vec<usize> {
                ops.iter()
                    .enumerate()
                    .filter(|(_, o)| f(&o.step))
                    .map(|(i, _)| i)
                    .collect()
            };
            let rs = find(&|s| matches!(s, Step::HostReduceScatter { .. }));
            let ag = find(&|s| matches!(s, Step::HostAllgather { .. }));
            let cross: Vec<usize> = (0..ops.len())
                .filter(|&i| ops[i].lane == Lane::Cross)
                .collect();
            let n = rs.len();
            assert!(n >= 2, "count {count}: {n} segments");
            assert_eq!((ag.len(), cross.len()), (n, n));
            let reach = happens_before(&ops);
            let last = ops.len() - 1;
            assert_eq!(ops[last].lane, Lane::Caller);
            let unjoined: Vec<usize> = (0..last).filter(|&i| !reach[last][i]).collect();
            assert!(
                unjoined.is_empty(),
                "ops {unjoined:?} of {ops:?} are not joined"
            );
            let mut next = 0;
            for s in 0..n {
                assert!(
                    reach[cross[s]][rs[s]] && reach[ag[s]][cross[s]],
                    "segment {s}"
                );
                if s + 1 < n {
                    assert!(!reach[rs[s + 1]][cross[s]], "segment {s} does not overlap");
                    assert!(
                        rs[s + 1] < cross[s],
                        "enqueued before the all-reduce may block"
                    );
                    assert!(reach[cross[s + 1]][cross[s]]);
                }
                // The segments tile the whole shares, in order, and each cross step is this
                // rank's share of its segment.
                let (
                    Step::HostReduceScatter { offset, chunk },
                    Step::HostAllgather {
                        offset: o2,
                        chunk: c2,
                    },
                ) = (ops[rs[s]].step, ops[ag[s]].step)
                else {
                    unreachable!()
                };
                assert_eq!((offset, chunk), (o2, c2));
                assert_eq!(offset, next);
                next += k * chunk;
                assert_eq!(
                    ops[cross[s]].step,
                    Step::CrossAllreduce {
                        offset: offset + local * chunk,
                        bytes: chunk
                    }
                );
            }
            assert_eq!(next, count / k * k * es);
            // The tail, if any, runs on the caller's stream after the join.
            assert!(ops[ag[n - 1] + 1..]
                .iter()
                .all(|o| *o == Op::on_caller(o.step)));
        }
    }

    /// Every rank of a host runs the same sequence of collectives on the same streams with the
    /// same events (only offsets differ), pipelined or not.
    #[test]
    fn every_local_rank_runs_the_same_collectives() {
        let shape = |o: &Op| (std::mem::discriminant(&o.step), o.lane, o.wait, o.record);
        for pipelined in [false, true] {
            for count in [1usize, 7, 40_000, 1 << 20, (1 << 20) + 5, 1 << 24] {
                let first: Vec<_> = plan(count, 2, 4, 0, pipelined).iter().map(shape).collect();
                for local in 1..4 {
                    let other: Vec<_> = plan(count, 2, 4, local, pipelined)
                        .iter()
                        .map(shape)
                        .collect();
                    assert_eq!(first, other, "count {count}");
                }
            }
            assert!(plan(0, 4, 2, 0, pipelined).is_empty());
        }
    }

    /// The call's checks are the all-reduce's, naming this algorithm.
    #[test]
    fn bad_arguments_are_named() {
        use mscclpp_core::gpu::Stream;
        use mscclpp_core::{AccumType, DataType, ReduceOp};
        let args = ExecuteArgs {
            input: 0x1000,
            output: 0x2000,
            input_bytes: 64,
            output_bytes: 64,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            accum: AccumType::Auto,
            root: 0,
            stream: Stream::DEFAULT,
            nblocks: None,
            nthreads: None,
        };
        let check = |a: ExecuteArgs| port_allreduce::check_args_of(NAME, &a);
        assert_eq!(check(args).ok(), Some(16));
        let short = check(ExecuteArgs {
            output_bytes: 60,
            ..args
        });
        assert!(short.is_err_and(|e| e.to_string().contains(NAME)));
        let null = check(ExecuteArgs { output: 0, ..args });
        assert!(null.is_err_and(|e| e.to_string().contains("null output")));
        let ragged = check(ExecuteArgs {
            input_bytes: 6,
            ..args
        });
        assert!(ragged.is_err());
        let accum = check(ExecuteArgs {
            accum: AccumType::F16,
            ..args
        });
        assert!(accum
            .is_err_and(|e| matches!(e, Error::Unsupported(_)) && e.to_string().contains(NAME)));
        assert_eq!(
            check(ExecuteArgs {
                input_bytes: 0,
                input: 0,
                ..args
            })
            .ok(),
            Some(0)
        );
    }

    /// The host group's collection, built from a quarter of the default scratch, still has every
    /// part (the point-to-point region and the semaphores of a 132-SM or larger GPU taken out of
    /// the staging part), with room for the all-to-all tables, at every host size.
    #[test]
    fn the_host_groups_scratch_holds_a_collection() {
        use crate::native::NativeKind;
        use crate::resources::{private_tail_bytes, scratch_bounds};
        use mscclpp_core::device::D2DSemaphoreHandle;
        let s = host_scratch_bytes(crate::DEFAULT_SCRATCH_BYTES);
        for sm in [132u32, 256] {
            let blocks = NativeKind::ALL
                .iter()
                .map(|k| k.semaphore_blocks(sm))
                .max()
                .unwrap_or(0) as usize;
            for k in 2..=MAX_RANKS {
                let table = blocks * (k - 1) * std::mem::size_of::<D2DSemaphoreHandle>();
                let p2p = crate::p2p::plan::layout(k).region_bytes;
                let b = scratch_bounds(s, private_tail_bytes(table, p2p) + p2p);
                assert!(b.windows(2).all(|w| w[1] > w[0]), "{k} ranks: {b:?}");
                let staging = b[2] - b[1];
                assert!(
                    staging >= mscclpp_kernels_cu::alltoall::TABLE_SCRATCH_BYTES,
                    "{k} ranks: staging {staging}"
                );
            }
        }
    }

    #[test]
    fn scratch_shares_fit_the_budget() {
        let s = crate::DEFAULT_SCRATCH_BYTES;
        assert_eq!(host_scratch_bytes(s), 2 << 20);
        for n in 2..=MAX_RANKS {
            let seg = port_segment_bytes(s, n);
            assert_eq!(seg % 16, 0);
            assert!((2 * n + 1) * seg <= s, "{n} ranks");
            assert!((2 * n + 1) * (seg + 16) > s, "{n} ranks: not the largest");
        }
        assert_eq!(port_segment_bytes(0, 8), 16);
    }
}
