//! A set of [`Algorithm`]s per collective plus the selector that picks one for each call.
//!
//! MSCCL++ keeps native and execution-plan algorithms in one collection and asks a selector, per
//! call, which to run; we do the same, so a user's selector (or tuning table) sees every algorithm
//! by its MSCCL++ name. [`default_native_selector`] is the built-in policy for the native
//! algorithms of `mscclpp-collectives`; it is plain data in, a name out, so it is tested on the CPU.
//!
//! Safety rule (DESIGN.md, "Safety on shared GPUs"): an algorithm whose name contains `nvls` is
//! never returned by [`AlgorithmCollection::select`] unless [`SelectionContext::nvls_allowed`],
//! whatever the selector says.

use crate::algorithm::{Algorithm, Collective, ExecuteArgs};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// What a selector knows about one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelectionContext {
    pub collective: Collective,
    /// Bytes of the call's input buffer (per rank).
    pub message_bytes: usize,
    pub dtype: DataType,
    pub world_size: usize,
    /// Ranks sharing this host (and its NVLink domain).
    pub local_world_size: usize,
    /// The caller promises symmetric memory: every rank calls with buffers in the same pattern
    /// (VMM allocations bindable to a multicast object for the NVLS zero-copy all-reduce, which
    /// needs the promise).
    pub symmetric_memory: bool,
    /// The stream is being captured into a CUDA graph (`Gpu::is_capturing`).
    pub capturing: bool,
    /// Compiler architecture of the device: `sm_90`, `gfx942`...
    pub arch: String,
    /// NVLink multicast may be used (`Env::nvls_allowed` and the hardware supports it).
    pub nvls_allowed: bool,
    /// The call is in place ([`SelectionContext::buffers_in_place`]): algorithms written for one
    /// buffer mode (execution plans) are chosen only for calls of that mode.
    pub in_place: bool,
    /// The call's reduction, where the caller knows it (`None`: a selector asked without a
    /// call, as the Python package's `select` and the registry's C request are): algorithms
    /// written for one reduction (execution plans) are chosen only for calls of that one.
    pub op: Option<ReduceOp>,
}

impl SelectionContext {
    /// Whether a call's buffers are in place in MSCCL++'s meaning for `collective`: all-gather's
    /// input is rank `rank`'s slice of its output, reduce-scatter's output is that rank's slice of
    /// its input, any other collective's input is its output.
    pub fn buffers_in_place(collective: Collective, args: &ExecuteArgs, rank: usize) -> bool {
        match collective {
            Collective::AllGather => {
                args.output.checked_add((rank * args.input_bytes) as u64) == Some(args.input)
            }
            Collective::ReduceScatter => {
                args.input.checked_add((rank * args.output_bytes) as u64) == Some(args.output)
            }
            _ => args.input == args.output,
        }
    }
}

/// A selector: the name of the algorithm to run, or `None` when it has no answer.
pub type Selector = Box<dyn Fn(&SelectionContext) -> Option<String> + Send + Sync>;

/// Algorithms by collective and name, and the selector. Built by [`AlgorithmCollectionBuilder`].
/// Dropped in the reverse order of registration (`Registry` says why).
pub struct AlgorithmCollection {
    algorithms: Registry,
    selector: Option<Selector>,
}

/// Algorithms by collective and name, released in the reverse order of registration.
///
/// Why the order is fixed: tearing down some algorithms is collective (their scratch's drop
/// barriers over the communicator's bootstrap, a sub-communicator's drop barriers over its group),
/// so every rank must release them in the same order, as it built them. A `HashMap` drops its
/// entries in an order drawn per process (`RandomState`): on 2 hosts x 4 ranks one rank released
/// the hierarchical all-reduce (barriers over its host and cross-host groups) before the flat
/// `port_allreduce` (a barrier over every rank) while a peer did the opposite, and each waited for
/// the other until the bootstrap timed out, after every check had passed. Reverse registration is
/// the order that also releases an algorithm before the ones it was built on (the multi-host
/// all-gather before the all-reduce it runs through).
#[derive(Default)]
struct Registry {
    by_collective: HashMap<Collective, BTreeMap<String, Arc<dyn Algorithm>>>,
    /// `(collective, name)` in registration order.
    order: Vec<(Collective, String)>,
}

impl Registry {
    fn get(&self, collective: Collective) -> Option<&BTreeMap<String, Arc<dyn Algorithm>>> {
        self.by_collective.get(&collective)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        while let Some((collective, name)) = self.order.pop() {
            if let Some(by_name) = self.by_collective.get_mut(&collective) {
                by_name.remove(&name);
            }
        }
    }
}

impl std::fmt::Debug for AlgorithmCollection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: BTreeMap<&str, Vec<&str>> = self
            .algorithms
            .by_collective
            .iter()
            .map(|(c, m)| (c.name(), m.keys().map(String::as_str).collect()))
            .collect();
        f.debug_struct("AlgorithmCollection")
            .field("algorithms", &names)
            .field("selector", &self.selector.is_some())
            .finish()
    }
}

impl AlgorithmCollection {
    pub fn builder() -> AlgorithmCollectionBuilder {
        AlgorithmCollectionBuilder::default()
    }

    /// The algorithm `name` of `collective`.
    pub fn get(&self, collective: Collective, name: &str) -> Option<Arc<dyn Algorithm>> {
        self.algorithms.get(collective)?.get(name).cloned()
    }

    /// Names registered for `collective`, sorted.
    pub fn names(&self, collective: Collective) -> Vec<String> {
        self.algorithms
            .get(collective)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Runs the selector for `ctx`. Errors name the call when the selector has no answer, names an
    /// algorithm that is not registered, or picks an NVLS algorithm while NVLS is not allowed.
    pub fn select(&self, ctx: &SelectionContext) -> Result<Arc<dyn Algorithm>> {
        let selector = self.selector.as_ref().ok_or_else(|| {
            Error::InvalidArgument("the algorithm collection has no selector".into())
        })?;
        let describe = || describe_call(ctx);
        let name = selector(ctx).ok_or_else(|| {
            Error::Unsupported(format!(
                "no algorithm for {}{}",
                describe(),
                unserved_reason(ctx)
                    .map(|why| format!(": {why}"))
                    .unwrap_or_default()
            ))
        })?;
        self.chosen(ctx, &name)
    }

    /// The algorithm `name` chosen for `ctx` (by the selector, or by a selector outside the
    /// collection such as the one the NCCL shim takes from Python). Errors name the call when
    /// `name` is not registered, or is an NVLS algorithm while NVLS is not allowed.
    pub fn chosen(&self, ctx: &SelectionContext, name: &str) -> Result<Arc<dyn Algorithm>> {
        let describe = || describe_call(ctx);
        if is_nvls_name(name) && !ctx.nvls_allowed {
            return Err(Error::Unsupported(format!(
                "the selector chose {name} for {}, but NVLink multicast is not allowed \
                 (set MSCCLPP_ENABLE_NVLS=1 on a machine that supports it)",
                describe()
            )));
        }
        self.get(ctx.collective, name).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the selector chose {name} for {}, but no such {} algorithm is registered \
                 (registered: {})",
                describe(),
                ctx.collective,
                self.names(ctx.collective).join(", ")
            ))
        })
    }
}

/// The call `ctx` describes, as errors name it.
fn describe_call(ctx: &SelectionContext) -> String {
    format!(
        "{} of {} bytes of {} on {} ranks (arch {}, symmetric memory {}, capturing {})",
        ctx.collective,
        ctx.message_bytes,
        ctx.dtype,
        ctx.world_size,
        ctx.arch,
        ctx.symmetric_memory,
        ctx.capturing
    )
}

/// Why the default policy has no algorithm for `ctx`, where it knows: what a user reads after
/// "no algorithm for ...".
fn unserved_reason(ctx: &SelectionContext) -> Option<String> {
    if ctx.world_size > 1 && ctx.local_world_size != ctx.world_size {
        return Some(format!(
            "the ranks span several hosts ({} of {} on this host); across hosts only allreduce \
             ({} for H hosts x k ranks, up to 8 x 8; {}, flat, up to 8 ranks), and allgather, \
             broadcast and reducescatter through it, have algorithms so far; the multi-host {} \
             is not implemented yet",
            ctx.local_world_size,
            ctx.world_size,
            native_names::ALLREDUCE_HIERARCHICAL,
            native_names::PORT_ALLREDUCE,
            ctx.collective
        ));
    }
    if ctx.world_size > 1 && !cuda_arch_ok(&ctx.arch) {
        return Some(format!(
            "the native kernels need a CUDA device of sm_70 or newer, this is {}",
            ctx.arch
        ));
    }
    None
}

fn is_nvls_name(name: &str) -> bool {
    name.to_ascii_lowercase().contains("nvls")
}

/// Builds an [`AlgorithmCollection`].
#[derive(Default)]
pub struct AlgorithmCollectionBuilder {
    algorithms: Registry,
    selector: Option<Selector>,
}

impl AlgorithmCollectionBuilder {
    /// Adds `algorithm` under its name and collective; a second algorithm of the same name for the
    /// same collective is an error naming it.
    pub fn add_algorithm(&mut self, algorithm: Arc<dyn Algorithm>) -> Result<&mut Self> {
        let collective = algorithm.collective();
        let by_name = self.algorithms.by_collective.entry(collective).or_default();
        let name = algorithm.name().to_string();
        if by_name.contains_key(&name) {
            return Err(Error::InvalidArgument(format!(
                "{collective} algorithm {name} is registered twice"
            )));
        }
        by_name.insert(name.clone(), algorithm);
        self.algorithms.order.push((collective, name));
        Ok(self)
    }

    /// Replaces the selector.
    pub fn set_selector(&mut self, selector: Selector) -> &mut Self {
        self.selector = Some(selector);
        self
    }

    /// Takes the selector out, e.g. to wrap it in one that prefers other algorithms first (the
    /// execution plans of `mscclpp-executor`).
    pub fn take_selector(&mut self) -> Option<Selector> {
        self.selector.take()
    }

    pub fn build(self) -> AlgorithmCollection {
        AlgorithmCollection {
            algorithms: self.algorithms,
            selector: self.selector,
        }
    }
}

/// Names of the native algorithms (MSCCL++ spelling where MSCCL++ has the algorithm).
pub mod native_names {
    use super::Collective;

    pub const ALLREDUCE_ALLPAIR_PACKET: &str = "default_allreduce_allpair_packet";
    /// New in mscclpp-rs: the all-pair schedule through LL128 lines (CUDA only).
    pub const ALLREDUCE_ALLPAIR_LL128: &str = "default_allreduce_allpair_ll128";
    pub const ALLREDUCE_PACKET: &str = "default_allreduce_packet";
    pub const ALLREDUCE_RSAG_ZERO_COPY: &str = "default_allreduce_rsag_zero_copy";
    pub const ALLGATHER_FULLMESH2: &str = "default_allgather_fullmesh2";
    /// Ours: LL128 lines through scratch, no semaphores (MSCCL++'s scratch-based all-gather is
    /// `default_allgather_fullmesh`, a different algorithm, so the name differs).
    pub const ALLGATHER_PACKET: &str = "default_allgather_packet";
    pub const REDUCESCATTER_ZERO_COPY: &str = "default_reducescatter_zero_copy";
    pub const REDUCESCATTER_PACKET: &str = "default_reducescatter_packet";
    pub const BROADCAST_ZERO_COPY: &str = "default_broadcast_zero_copy";
    /// Ours (MSCCL++ has no reduce algorithm): the root reduces every rank's registered input.
    pub const REDUCE_ZERO_COPY: &str = "default_reduce_zero_copy";
    /// Ours: gather and scatter on the all-to-all exchange engine (`collectives::alltoall`).
    pub const GATHER_ZERO_COPY: &str = "default_gather_zero_copy";
    pub const SCATTER_ZERO_COPY: &str = "default_scatter_zero_copy";
    /// Pushes every chunk into the receivers' registered outputs (`collectives::alltoall`).
    pub const ALLTOALL_ZERO_COPY: &str = "default_alltoall_zero_copy";
    /// LL128 lines through the peers' scratch, for small chunks (`collectives::alltoall`).
    pub const ALLTOALL_PACKET: &str = "default_alltoall_packet";
    /// Ours: the shift exchange (`root` = shift; 1 is nccl-tests' `sendrecv` ring) on the
    /// all-to-all engine.
    pub const SENDRECV_ZERO_COPY: &str = "default_sendrecv_zero_copy";
    /// Scratch-staged algorithms for unregistered buffers (MSCCL++'s names); selectable by name,
    /// not chosen by the default selector.
    pub const ALLREDUCE_RSAG: &str = "default_allreduce_rsag";
    pub const ALLREDUCE_RSAG_PIPELINE: &str = "default_allreduce_rsag_pipeline";
    pub const ALLREDUCE_FULLMESH: &str = "default_allreduce_fullmesh";
    pub const ALLGATHER_FULLMESH: &str = "default_allgather_fullmesh";
    /// Ours (MSCCL++ has no push all-reduce of this name): the rsag pipeline with every transfer a
    /// write over NVLink, the reduced chunks written straight into the peers' registered outputs;
    /// selectable by name and by the tuner, not chosen by the default selector until measured.
    pub const ALLREDUCE_RSAG_PUSH: &str = "default_allreduce_rsag_push";
    /// Ours (MSCCL++ has no copy-engine all-reduce): the copy engines move the data of large
    /// messages while the SMs reduce.
    pub const ALLREDUCE_COPY_ENGINE: &str = "default_allreduce_copy_engine";
    /// NVLS (NVLink multicast) all-reduces; built and selected only behind the NVLS gate.
    pub const ALLREDUCE_NVLS_PACKET: &str = "default_allreduce_nvls_packet";
    pub const ALLREDUCE_NVLS_ZERO_COPY: &str = "default_allreduce_nvls_zero_copy";
    pub const ALLREDUCE_NVLS_WARP_PIPELINE: &str = "default_allreduce_nvls_warp_pipeline";
    pub const ALLREDUCE_NVLS_BLOCK_PIPELINE: &str = "default_allreduce_nvls_block_pipeline";
    /// Ours: the collectives of a one-rank job (one device copy out of place, nothing in place).
    pub const ALLREDUCE_SINGLE_RANK: &str = "default_allreduce_single_rank";
    pub const ALLGATHER_SINGLE_RANK: &str = "default_allgather_single_rank";
    pub const REDUCESCATTER_SINGLE_RANK: &str = "default_reducescatter_single_rank";
    pub const BROADCAST_SINGLE_RANK: &str = "default_broadcast_single_rank";
    pub const REDUCE_SINGLE_RANK: &str = "default_reduce_single_rank";
    pub const ALLTOALL_SINGLE_RANK: &str = "default_alltoall_single_rank";
    pub const GATHER_SINGLE_RANK: &str = "default_gather_single_rank";
    pub const SCATTER_SINGLE_RANK: &str = "default_scatter_single_rank";
    /// Ours: the flat all-reduce over PortChannels (CudaIpc on a host, Ethernet between hosts),
    /// the default for ranks on several hosts when [`ALLREDUCE_HIERARCHICAL`] does not apply
    /// (uneven ranks per host, one rank per host).
    pub const PORT_ALLREDUCE: &str = "port_allreduce";
    /// The all-reduce of H hosts x k ranks: reduce-scatter in the host, all-reduce across hosts
    /// among equal local ranks, all-gather in the host (`mscclpp_collectives::hierarchical`).
    pub const ALLREDUCE_HIERARCHICAL: &str = "default_allreduce_hierarchical";
    /// Ours, for ranks on several hosts: all-gather and broadcast as a bit-exact byte-wise sum
    /// all-reduce of the zero-filled output, through the multi-host all-reduce
    /// (`mscclpp_collectives::via_allreduce`).
    pub const ALLGATHER_VIA_ALLREDUCE: &str = "default_allgather_via_allreduce";
    pub const BROADCAST_VIA_ALLREDUCE: &str = "default_broadcast_via_allreduce";
    /// Ours, for ranks on several hosts: reduce-scatter as an all-reduce of the ranks' pieces
    /// packed into a scratch, through the multi-host all-reduce.
    pub const REDUCESCATTER_VIA_ALLREDUCE: &str = "default_reducescatter_via_allreduce";

    /// The single-rank algorithm of `collective`, if it has one.
    pub const fn single_rank_name(collective: Collective) -> Option<&'static str> {
        match collective {
            Collective::AllReduce => Some(ALLREDUCE_SINGLE_RANK),
            Collective::AllGather => Some(ALLGATHER_SINGLE_RANK),
            Collective::ReduceScatter => Some(REDUCESCATTER_SINGLE_RANK),
            Collective::Broadcast => Some(BROADCAST_SINGLE_RANK),
            Collective::Reduce => Some(REDUCE_SINGLE_RANK),
            Collective::AllToAll => Some(ALLTOALL_SINGLE_RANK),
            Collective::Gather => Some(GATHER_SINGLE_RANK),
            Collective::Scatter => Some(SCATTER_SINGLE_RANK),
            Collective::SendRecv => None,
        }
    }
}

/// Message size (bytes per rank) up to which the NVLS packet all-reduce is preferred when NVLS is
/// allowed: below it one multimem store per packet and a local reduction beat the two barrier
/// rounds of the multicast kernels. A starting point; retune with `mscclpp-bench` on NVSwitch
/// hardware. `default_allreduce_nvls_packet` is built with scratch for at least this much.
pub const NVLS_PACKET_THRESHOLD: usize = 256 << 10;

/// Chunk (bytes per peer) up to which the default selector takes `default_alltoall_packet`, by
/// world size (also bounded by its scratch: `NativeLimits::alltoall_packet_max_chunk`, 960 KiB at
/// 2 ranks, 240 KiB at 8). The zero-copy exchange has a fixed cost whatever the size (its count
/// exchange and barriers), which the packet kernel does not pay; at 2 ranks the packet kernel
/// measured faster at every chunk it takes (docs/performance.md). So 2 ranks take the packet
/// kernel up to 512 KiB chunks (a 1 MiB all-to-all); more ranks keep 256 KiB (at 8 ranks the
/// scratch holds 240 KiB) until their packet rows are measured against the zero-copy ones
/// (docs/pending-gpu-checks.md).
pub fn alltoall_packet_max_chunk(world_size: usize) -> usize {
    match world_size {
        2 => 512 << 10,
        _ => 256 << 10,
    }
}

/// Limits the default selector needs from the algorithms as built (their scratch capacity).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NativeLimits {
    /// Largest message (bytes per rank) `default_allreduce_allpair_packet` can take.
    pub allpair_packet_max_bytes: usize,
    /// Largest message (bytes per rank) `default_allreduce_allpair_ll128` can take (0: not built,
    /// as on AMD GPUs).
    pub allpair_ll128_max_bytes: usize,
    /// Largest message (bytes per rank) `default_allreduce_packet` can take.
    pub packet_max_bytes: usize,
    /// Largest input (bytes per rank) `default_allgather_packet` can take.
    pub allgather_packet_max_bytes: usize,
    /// Largest input (bytes per rank, all chunks) `default_reducescatter_packet` can take.
    pub reducescatter_packet_max_bytes: usize,
    /// Largest chunk (bytes per peer) `default_alltoall_packet` can take.
    pub alltoall_packet_max_chunk: usize,
    /// Largest world size of the native kernels.
    pub max_ranks: usize,
    /// The all-reduce the collection built for ranks on several hosts, which the selector takes
    /// for every all-reduce there (`None`: none could be built; a single-host collection leaves
    /// it `None`): `mscclpp_collectives` builds [`native_names::ALLREDUCE_HIERARCHICAL`] for H
    /// hosts x k ranks and [`native_names::PORT_ALLREDUCE`] (flat) for the other topologies, and
    /// logs its choice once. With it come [`native_names::ALLGATHER_VIA_ALLREDUCE`],
    /// [`native_names::BROADCAST_VIA_ALLREDUCE`] and
    /// [`native_names::REDUCESCATTER_VIA_ALLREDUCE`], which the selector takes there too.
    pub multi_host_allreduce: Option<&'static str>,
}

/// Message size (bytes) up to which the all-pair packet all-reduce is preferred, by world size.
/// All-pair sends the whole message to every peer in 16-byte packets carrying 8 bytes, so its
/// traffic grows with the world size; above it the two-phase packet all-reduce (LL128 lines,
/// 1.07x its bytes per phase) takes over. The thresholds are where the two crossed when measured
/// at 2 and 4 ranks (docs/performance.md).
pub fn allpair_threshold(world_size: usize) -> usize {
    match world_size {
        0..=2 => 256 << 10,
        3..=4 => 128 << 10,
        _ => 32 << 10,
    }
}

/// Message size (bytes) above which the all-pair schedule sends LL128 lines instead of LL16
/// packets, up to [`allpair_threshold`], by world size (`None`: LL16 packets throughout). LL128
/// lines put 1.07x the message on the wire where LL16 packets put 2x, but their reads vote across
/// a warp, which costs a fraction of a microsecond at small sizes: the thresholds are where LL128
/// lines measured faster at 2 and 4 ranks. 3 ranks follow 4, as in [`allpair_threshold`]; 8 ranks
/// are not measured yet.
pub fn allpair_ll128_from(world_size: usize) -> Option<usize> {
    match world_size {
        2 => Some(128 << 10),
        3..=4 => Some(32 << 10),
        _ => None,
    }
}

/// Message size (bytes) up to which the two-phase packet all-reduce (LL128 lines) beats the
/// zero-copy kernel, whose two barrier rounds cost a few microseconds, by world size: at 2 ranks
/// the packet kernel measured faster up to 4 MiB. Other world sizes keep the 1 MiB measured with
/// LL16 packets until measured; retune with `mscclpp-bench`.
pub fn packet_threshold(world_size: usize) -> usize {
    match world_size {
        2 => 4 << 20,
        _ => 1 << 20,
    }
}

/// Message size (bytes per rank) from which `default_allreduce_copy_engine` is preferred to the
/// zero-copy kernel, by world size and whether the call is captured (`None`: never), for calls it
/// can stage in their output (out of place, every rank's share a whole number of 16-byte vectors;
/// see `mscclpp_collectives::copy_engine::Staging`). The copy engines push a peer faster than the
/// SMs do, but a call costs tens of microseconds beyond its bytes in copy starts and barriers
/// (more at 4 ranks than at 2), so it wins from the size where it measured faster than the
/// zero-copy kernel at 2 and 4 ranks (docs/performance.md). Eager calls enqueue the same two
/// dozen operations from the host each time, so they start later and win only from a larger size
/// (4 ranks not measured eager). 3 ranks sit between the measured 2 and 4; 5-8 ranks (more
/// copies per call) are not measured.
pub fn copy_engine_threshold(world_size: usize, capturing: bool) -> Option<usize> {
    match (world_size, capturing) {
        (2..=4, true) => Some(128 << 20),
        (2..=4, false) => Some(256 << 20),
        _ => None,
    }
}

/// Whether every rank's share of an all-reduce of `message_bytes` is the same whole number of
/// 16-byte vectors, which the copy-engine all-reduce needs to stage its pieces in the output
/// (`mscclpp_collectives::copy_engine::Staging::for_call` asks the same).
pub fn copy_engine_equal_shares(message_bytes: usize, world_size: usize) -> bool {
    message_bytes % (world_size.max(1) * 16) == 0
}

/// Whether an all-reduce of `ctx` can stage the copy-engine pieces in its output (the conditions
/// of `copy_engine::Staging::Output` the selector can see; overlapping distinct buffers fall back
/// to the scratch ring inside the algorithm).
fn copy_engine_stages_in_output(ctx: &SelectionContext) -> bool {
    !ctx.in_place && copy_engine_equal_shares(ctx.message_bytes, ctx.world_size)
}

/// Total bytes (the all-gather's output, the reduce-scatter's input) up to which the packet
/// all-gather and reduce-scatter are preferred to the zero-copy ones, by world size (the packet
/// kinds' scratch capacity bounds it too). The zero-copy kernels pay two barrier rounds; the
/// packet kernels, on LL128 lines, move 1.07x the bytes and poll. At 2 ranks packets measured
/// faster at every size they take. More peers mean more concurrent line streams to poll per rank,
/// so 5-8 ranks start lower until measured; retune with `mscclpp-bench`.
pub fn packet_gather_scatter_threshold(world_size: usize) -> usize {
    match world_size {
        0..=4 => 2 << 20,
        _ => 512 << 10,
    }
}

/// The built-in policy for the native algorithms (see the module docs for the NVLS rule): at world
/// size 1 the single-rank algorithms (any device); on several hosts the all-reduce built for the
/// topology (`limits.multi_host_allreduce`: hierarchical for H hosts x k ranks, else the flat
/// [`native_names::PORT_ALLREDUCE`]), and all-gather, broadcast and reduce-scatter through it;
/// the other collectives have no multi-host algorithm yet; else the native kernels, on CUDA
/// sm_70 or newer and on AMD CDNA (gfx90a, gfx942, gfx950), on one host of at most
/// `limits.max_ranks` ranks.
pub fn default_native_selector(limits: NativeLimits) -> Selector {
    Box::new(move |ctx: &SelectionContext| native_choice(&limits, ctx).map(str::to_string))
}

/// `90` for `sm_90` / `sm_90a`; None for anything that is not a CUDA architecture.
fn sm_version(arch: &str) -> Option<u32> {
    arch.strip_prefix("sm_").and_then(|v| {
        v.trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .parse::<u32>()
            .ok()
    })
}

fn cuda_arch_ok(arch: &str) -> bool {
    sm_version(arch).is_some_and(|v| v >= 70)
}

/// AMD CDNA targets the native kernels are built for (the HIP compile gate covers gfx90a and
/// gfx942; gfx950 shares their wave64 and 8-byte-atomicity paths).
fn amd_arch_ok(arch: &str) -> bool {
    matches!(arch, "gfx90a" | "gfx942" | "gfx950")
}

/// The NVLS all-reduce for `ctx`, when NVLS is allowed (gate open and hardware able, which the
/// caller states in `ctx.nvls_allowed`), the device has multimem (sm_90+) and multimem adds the
/// type. Large messages go zero-copy when the buffers are symmetric memory (VMM, bindable to a
/// multicast object) and whole 16-byte vectors, else through the pipelined scratch.
/// multimem only sums: callers reducing with another op must not set `nvls_allowed` (the
/// algorithms refuse other ops with `Unsupported`).
fn nvls_allreduce_choice(ctx: &SelectionContext) -> Option<&'static str> {
    use native_names::*;
    if !ctx.nvls_allowed
        || !sm_version(&ctx.arch).is_some_and(|v| v >= 90)
        || !matches!(ctx.dtype, DataType::F32 | DataType::F16 | DataType::Bf16)
    {
        return None;
    }
    let bytes = ctx.message_bytes;
    if bytes <= NVLS_PACKET_THRESHOLD {
        Some(ALLREDUCE_NVLS_PACKET)
    } else if ctx.symmetric_memory && bytes % 16 == 0 {
        Some(ALLREDUCE_NVLS_ZERO_COPY)
    } else {
        Some(ALLREDUCE_NVLS_BLOCK_PIPELINE)
    }
}

fn native_choice(limits: &NativeLimits, ctx: &SelectionContext) -> Option<&'static str> {
    use native_names::*;
    if ctx.world_size == 1 {
        return single_rank_name(ctx.collective);
    }
    if ctx.local_world_size != ctx.world_size {
        let via_allreduce = match ctx.collective {
            Collective::AllReduce => limits.multi_host_allreduce,
            Collective::AllGather => Some(ALLGATHER_VIA_ALLREDUCE),
            Collective::Broadcast => Some(BROADCAST_VIA_ALLREDUCE),
            Collective::ReduceScatter => Some(REDUCESCATTER_VIA_ALLREDUCE),
            _ => None,
        };
        return limits.multi_host_allreduce.and(via_allreduce);
    }
    let amd = amd_arch_ok(&ctx.arch);
    if !(cuda_arch_ok(&ctx.arch) || amd)
        || ctx.world_size == 0
        || ctx.world_size > limits.max_ranks
        || ctx.local_world_size != ctx.world_size
    {
        return None;
    }
    let bytes = ctx.message_bytes;
    match ctx.collective {
        Collective::AllReduce => {
            if let Some(nvls) = nvls_allreduce_choice(ctx) {
                Some(nvls)
            } else if !amd
                && allpair_ll128_from(ctx.world_size).is_some_and(|from| {
                    bytes > from
                        && bytes
                            <= allpair_threshold(ctx.world_size).min(limits.allpair_ll128_max_bytes)
                })
            {
                Some(ALLREDUCE_ALLPAIR_LL128)
            } else if bytes
                <= allpair_threshold(ctx.world_size).min(limits.allpair_packet_max_bytes)
            {
                Some(ALLREDUCE_ALLPAIR_PACKET)
            } else if bytes <= packet_threshold(ctx.world_size).min(limits.packet_max_bytes) {
                Some(ALLREDUCE_PACKET)
            } else if amd {
                // As MSCCL++ on AMD: the full-mesh kernel for large messages (xGMI links
                // every GPU to every other, and the zero-copy kernel's barriers cost more there).
                Some(ALLREDUCE_FULLMESH)
            } else if copy_engine_stages_in_output(ctx)
                && copy_engine_threshold(ctx.world_size, ctx.capturing).is_some_and(|t| bytes >= t)
            {
                Some(ALLREDUCE_COPY_ENGINE)
            } else {
                // Every call agrees on the ranks' buffers on the host (`user_buffers` in
                // mscclpp-collectives), so the zero-copy kernel serves any memory. In place, the
                // copy-engine all-reduce would stage in the scratch ring, in pieces too small to
                // beat this kernel; a call in place on some ranks only reaches both algorithms,
                // and the copy-engine one then runs this kernel too.
                Some(ALLREDUCE_RSAG_ZERO_COPY)
            }
        }
        Collective::AllGather => {
            // `bytes` is this rank's input; the threshold is on the gathered total.
            let total = bytes.saturating_mul(ctx.world_size);
            if total <= packet_gather_scatter_threshold(ctx.world_size)
                && bytes <= limits.allgather_packet_max_bytes
            {
                Some(ALLGATHER_PACKET)
            } else {
                Some(ALLGATHER_FULLMESH2)
            }
        }
        Collective::ReduceScatter => {
            // `bytes` is this rank's input, already the total of all chunks.
            if bytes <= packet_gather_scatter_threshold(ctx.world_size)
                && bytes <= limits.reducescatter_packet_max_bytes
            {
                Some(REDUCESCATTER_PACKET)
            } else {
                Some(REDUCESCATTER_ZERO_COPY)
            }
        }
        Collective::Broadcast => Some(BROADCAST_ZERO_COPY),
        // `bytes` is this rank's whole send buffer, one chunk per rank.
        Collective::AllToAll => {
            let chunk = bytes / ctx.world_size;
            if chunk <= alltoall_packet_max_chunk(ctx.world_size)
                && chunk <= limits.alltoall_packet_max_chunk
            {
                Some(ALLTOALL_PACKET)
            } else {
                Some(ALLTOALL_ZERO_COPY)
            }
        }
        Collective::SendRecv => Some(SENDRECV_ZERO_COPY),
        Collective::Reduce => Some(REDUCE_ZERO_COPY),
        Collective::Gather => Some(GATHER_ZERO_COPY),
        Collective::Scatter => Some(SCATTER_ZERO_COPY),
    }
}

#[cfg(test)]
mod tests {
    use super::native_names::*;
    use super::*;
    use crate::algorithm::ExecuteArgs;
    use rstest::rstest;

    struct Fake(&'static str, Collective);
    impl Algorithm for Fake {
        fn name(&self) -> &str {
            self.0
        }
        fn collective(&self) -> Collective {
            self.1
        }
        fn check(&self, _args: &ExecuteArgs) -> Result<()> {
            Ok(())
        }
        fn execute(&self, _args: &ExecuteArgs) -> Result<()> {
            Ok(())
        }
    }

    const LIMITS: NativeLimits = NativeLimits {
        allpair_packet_max_bytes: 2 << 20,
        allpair_ll128_max_bytes: 1 << 20,
        packet_max_bytes: 4 << 20,
        allgather_packet_max_bytes: 1 << 20,
        reducescatter_packet_max_bytes: 2 << 20,
        alltoall_packet_max_chunk: 960 << 10,
        max_ranks: 8,
        multi_host_allreduce: None,
    };

    fn ctx(collective: Collective, bytes: usize, world: usize) -> SelectionContext {
        SelectionContext {
            collective,
            message_bytes: bytes,
            dtype: DataType::Bf16,
            world_size: world,
            local_world_size: world,
            symmetric_memory: false,
            capturing: true,
            arch: "sm_90".into(),
            nvls_allowed: false,
            in_place: false,
            op: None,
        }
    }

    /// Algorithms are released in the reverse order of registration, whatever their collectives
    /// (a `HashMap`'s order differs between processes; collective teardowns must match), also
    /// when the builder is dropped without building; an algorithm that only another one holds (as
    /// the hierarchical all-reduce holds its groups' algorithms) goes with its holder.
    #[test]
    fn algorithms_are_released_in_reverse_registration_order() {
        use std::sync::Mutex;
        type Log = Arc<Mutex<Vec<&'static str>>>;
        struct Logged {
            fake: Fake,
            log: Log,
            _holds: Option<Arc<dyn Algorithm>>,
        }
        impl Algorithm for Logged {
            fn name(&self) -> &str {
                self.fake.name()
            }
            fn collective(&self) -> Collective {
                self.fake.collective()
            }
            fn check(&self, args: &ExecuteArgs) -> Result<()> {
                self.fake.check(args)
            }
            fn execute(&self, args: &ExecuteArgs) -> Result<()> {
                self.fake.execute(args)
            }
        }
        impl Drop for Logged {
            fn drop(&mut self) {
                self.log.lock().unwrap().push(self.fake.0);
            }
        }
        let logged = |name, c, log: &Log, holds| -> Arc<dyn Algorithm> {
            Arc::new(Logged {
                fake: Fake(name, c),
                log: log.clone(),
                _holds: holds,
            })
        };
        let registered = [
            ("flat", Collective::AllReduce),
            ("b_allgather", Collective::AllGather),
            ("a_allreduce", Collective::AllReduce),
            ("reducescatter", Collective::ReduceScatter),
            ("broadcast", Collective::Broadcast),
            ("alltoall", Collective::AllToAll),
        ];
        for build in [true, false] {
            let log = Log::default();
            let mut b = AlgorithmCollection::builder();
            for (name, c) in registered {
                let holds = (name == "b_allgather")
                    .then(|| logged("inner", Collective::AllReduce, &log, None));
                b.add_algorithm(logged(name, c, &log, holds)).unwrap();
            }
            if build {
                drop(b.build());
            } else {
                drop(b);
            }
            let want = [
                "alltoall",
                "broadcast",
                "reducescatter",
                "a_allreduce",
                "b_allgather",
                "inner",
                "flat",
            ];
            assert_eq!(*log.lock().unwrap(), want, "built: {build}");
        }
    }

    #[test]
    fn buffers_are_in_place_in_msccl_pp_meaning_per_collective() {
        use crate::algorithm::ExecuteArgs;
        use crate::dtype::{AccumType, ReduceOp};
        use crate::gpu::Stream;
        let args = |input, output, input_bytes, output_bytes| ExecuteArgs {
            input,
            output,
            input_bytes,
            output_bytes,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            accum: AccumType::Auto,
            root: 0,
            stream: Stream::DEFAULT,
            nblocks: None,
            nthreads: None,
        };
        let in_place = SelectionContext::buffers_in_place;
        // Rank 2 of 4, 256 bytes per rank.
        let ag = args(0x1000 + 512, 0x1000, 256, 1024);
        assert!(in_place(Collective::AllGather, &ag, 2));
        assert!(!in_place(Collective::AllGather, &ag, 1));
        assert!(!in_place(
            Collective::AllGather,
            &args(0x1000, 0x1000, 256, 1024),
            2
        ));
        let rs = args(0x1000, 0x1000 + 512, 1024, 256);
        assert!(in_place(Collective::ReduceScatter, &rs, 2));
        assert!(!in_place(Collective::ReduceScatter, &rs, 3));
        let ar = args(0x1000, 0x1000, 256, 256);
        assert!(in_place(Collective::AllReduce, &ar, 2));
        assert!(!in_place(
            Collective::AllReduce,
            &args(0x1000, 0x2000, 256, 256),
            0
        ));
    }

    fn native_collection() -> AlgorithmCollection {
        let mut b = AlgorithmCollection::builder();
        for (n, c) in [
            (ALLREDUCE_ALLPAIR_PACKET, Collective::AllReduce),
            (ALLREDUCE_ALLPAIR_LL128, Collective::AllReduce),
            (ALLREDUCE_PACKET, Collective::AllReduce),
            (ALLREDUCE_RSAG_ZERO_COPY, Collective::AllReduce),
            (ALLREDUCE_COPY_ENGINE, Collective::AllReduce),
            (ALLGATHER_FULLMESH2, Collective::AllGather),
            (ALLGATHER_PACKET, Collective::AllGather),
            (REDUCESCATTER_ZERO_COPY, Collective::ReduceScatter),
            (REDUCESCATTER_PACKET, Collective::ReduceScatter),
            (BROADCAST_ZERO_COPY, Collective::Broadcast),
            (ALLTOALL_ZERO_COPY, Collective::AllToAll),
            (ALLTOALL_PACKET, Collective::AllToAll),
            (SENDRECV_ZERO_COPY, Collective::SendRecv),
            (REDUCE_ZERO_COPY, Collective::Reduce),
            (GATHER_ZERO_COPY, Collective::Gather),
            (SCATTER_ZERO_COPY, Collective::Scatter),
        ] {
            b.add_algorithm(Arc::new(Fake(n, c))).expect("add");
        }
        b.set_selector(default_native_selector(LIMITS));
        b.build()
    }

    #[rstest]
    #[case(Collective::AllReduce, 1024, 2, ALLREDUCE_ALLPAIR_PACKET)]
    #[case(Collective::AllReduce, 128 << 10, 2, ALLREDUCE_ALLPAIR_PACKET)]
    #[case(Collective::AllReduce, (128 << 10) + 2, 2, ALLREDUCE_ALLPAIR_LL128)]
    #[case(Collective::AllReduce, 256 << 10, 2, ALLREDUCE_ALLPAIR_LL128)]
    #[case(Collective::AllReduce, (256 << 10) + 2, 2, ALLREDUCE_PACKET)]
    #[case(Collective::AllReduce, 32 << 10, 4, ALLREDUCE_ALLPAIR_PACKET)]
    #[case(Collective::AllReduce, 64 << 10, 4, ALLREDUCE_ALLPAIR_LL128)]
    #[case(Collective::AllReduce, 128 << 10, 4, ALLREDUCE_ALLPAIR_LL128)]
    #[case(Collective::AllReduce, 64 << 10, 3, ALLREDUCE_ALLPAIR_LL128)]
    #[case(Collective::AllReduce, 256 << 10, 4, ALLREDUCE_PACKET)]
    #[case(Collective::AllReduce, 4 << 20, 2, ALLREDUCE_PACKET)]
    #[case(Collective::AllReduce, (4 << 20) + 2, 2, ALLREDUCE_RSAG_ZERO_COPY)]
    #[case(Collective::AllReduce, 1 << 20, 4, ALLREDUCE_PACKET)]
    #[case(Collective::AllReduce, (1 << 20) + 2, 4, ALLREDUCE_RSAG_ZERO_COPY)]
    #[case(Collective::AllReduce, 1 << 30, 2, ALLREDUCE_COPY_ENGINE)]
    #[case(Collective::AllReduce, 1 << 30, 4, ALLREDUCE_COPY_ENGINE)]
    #[case(Collective::AllReduce, 1 << 30, 8, ALLREDUCE_RSAG_ZERO_COPY)]
    #[case(Collective::AllReduce, 3 << 27, 3, ALLREDUCE_COPY_ENGINE)]
    #[case(Collective::AllReduce, 128 << 20, 3, ALLREDUCE_RSAG_ZERO_COPY)]
    #[case(Collective::AllReduce, (128 << 20) - 64, 4, ALLREDUCE_RSAG_ZERO_COPY)]
    #[case(Collective::AllReduce, (128 << 20) + 2, 4, ALLREDUCE_RSAG_ZERO_COPY)]
    #[case(Collective::AllReduce, 64 << 20, 2, ALLREDUCE_RSAG_ZERO_COPY)]
    #[case(Collective::AllReduce, (64 << 20) - 2, 2, ALLREDUCE_RSAG_ZERO_COPY)]
    #[case(Collective::AllReduce, 16 << 10, 8, ALLREDUCE_ALLPAIR_PACKET)]
    #[case(Collective::AllReduce, 256 << 10, 8, ALLREDUCE_PACKET)]
    #[case(Collective::AllReduce, 32 << 10, 8, ALLREDUCE_ALLPAIR_PACKET)]
    #[case(Collective::AllReduce, 512 << 10, 4, ALLREDUCE_PACKET)]
    #[case(Collective::AllGather, 1 << 20, 8, ALLGATHER_FULLMESH2)]
    #[case(Collective::AllGather, 1, 2, ALLGATHER_PACKET)]
    #[case(Collective::AllGather, 1 << 20, 2, ALLGATHER_PACKET)]
    #[case(Collective::AllGather, (1 << 20) + 1, 2, ALLGATHER_FULLMESH2)]
    #[case(Collective::AllGather, 128 << 10, 4, ALLGATHER_PACKET)]
    #[case(Collective::AllGather, 64 << 10, 8, ALLGATHER_PACKET)]
    #[case(Collective::AllGather, (64 << 10) + 1, 8, ALLGATHER_FULLMESH2)]
    #[case(Collective::ReduceScatter, 4 << 20, 3, REDUCESCATTER_ZERO_COPY)]
    #[case(Collective::ReduceScatter, 2, 2, REDUCESCATTER_PACKET)]
    #[case(Collective::ReduceScatter, 2 << 20, 2, REDUCESCATTER_PACKET)]
    #[case(Collective::ReduceScatter, (2 << 20) + 2, 2, REDUCESCATTER_ZERO_COPY)]
    #[case(Collective::ReduceScatter, 256 << 10, 8, REDUCESCATTER_PACKET)]
    #[case(Collective::ReduceScatter, 512 << 10, 8, REDUCESCATTER_PACKET)]
    #[case(Collective::ReduceScatter, (512 << 10) + 8, 8, REDUCESCATTER_ZERO_COPY)]
    #[case(Collective::Broadcast, 1, 2, BROADCAST_ZERO_COPY)]
    #[case(Collective::AllToAll, 4 << 20, 8, ALLTOALL_ZERO_COPY)]
    #[case(Collective::AllToAll, 2 << 20, 8, ALLTOALL_PACKET)]
    #[case(Collective::AllToAll, (2 << 20) + 8, 8, ALLTOALL_ZERO_COPY)]
    #[case(Collective::AllToAll, 128 << 10, 2, ALLTOALL_PACKET)]
    #[case(Collective::AllToAll, 1 << 20, 2, ALLTOALL_PACKET)]
    #[case(Collective::AllToAll, (1 << 20) + 16, 2, ALLTOALL_ZERO_COPY)]
    #[case(Collective::AllToAll, 1 << 20, 4, ALLTOALL_PACKET)]
    #[case(Collective::AllToAll, (1 << 20) + 16, 4, ALLTOALL_ZERO_COPY)]
    #[case(Collective::SendRecv, 1 << 20, 4, SENDRECV_ZERO_COPY)]
    #[case(Collective::Reduce, 1, 8, REDUCE_ZERO_COPY)]
    #[case(Collective::Reduce, 1 << 30, 2, REDUCE_ZERO_COPY)]
    #[case(Collective::Gather, 8, 4, GATHER_ZERO_COPY)]
    #[case(Collective::Scatter, 1 << 20, 2, SCATTER_ZERO_COPY)]
    fn default_policy(
        #[case] c: Collective,
        #[case] bytes: usize,
        #[case] world: usize,
        #[case] want: &str,
    ) {
        let coll = native_collection();
        let algo = coll.select(&ctx(c, bytes, world)).expect("selected");
        assert_eq!(algo.name(), want);
    }

    #[rstest]
    #[case(128 << 20, true, false, ALLREDUCE_COPY_ENGINE)]
    #[case(128 << 20, false, false, ALLREDUCE_RSAG_ZERO_COPY)]
    #[case(256 << 20, false, false, ALLREDUCE_COPY_ENGINE)]
    #[case(1 << 30, true, true, ALLREDUCE_RSAG_ZERO_COPY)]
    #[case(1 << 30, false, true, ALLREDUCE_RSAG_ZERO_COPY)]
    fn large_allreduces_take_the_copy_engine_out_of_place_eager_later(
        #[case] bytes: usize,
        #[case] capturing: bool,
        #[case] in_place: bool,
        #[case] want: &str,
    ) {
        for world in [2, 4] {
            let mut c = ctx(Collective::AllReduce, bytes, world);
            c.capturing = capturing;
            c.in_place = in_place;
            let coll = native_collection();
            assert_eq!(
                coll.select(&c).expect("selected").name(),
                want,
                "{world} ranks"
            );
        }
    }

    #[test]
    fn scratch_limits_are_respected() {
        let small = NativeLimits {
            allpair_packet_max_bytes: 4096,
            allpair_ll128_max_bytes: 0,
            packet_max_bytes: 64 << 10,
            allgather_packet_max_bytes: 1024,
            reducescatter_packet_max_bytes: 2048,
            alltoall_packet_max_chunk: 1024,
            max_ranks: 8,
            multi_host_allreduce: None,
        };
        let sel = default_native_selector(small);
        let c = |b| sel(&ctx(Collective::AllReduce, b, 2));
        assert_eq!(c(4096).as_deref(), Some(ALLREDUCE_ALLPAIR_PACKET));
        assert_eq!(c(4097).as_deref(), Some(ALLREDUCE_PACKET));
        assert_eq!(c((64 << 10) + 1).as_deref(), Some(ALLREDUCE_RSAG_ZERO_COPY));
        let ag = |b| sel(&ctx(Collective::AllGather, b, 2));
        assert_eq!(ag(1024).as_deref(), Some(ALLGATHER_PACKET));
        assert_eq!(ag(1025).as_deref(), Some(ALLGATHER_FULLMESH2));
        let rs = |b| sel(&ctx(Collective::ReduceScatter, b, 2));
        assert_eq!(rs(2048).as_deref(), Some(REDUCESCATTER_PACKET));
        assert_eq!(rs(2050).as_deref(), Some(REDUCESCATTER_ZERO_COPY));
        let a2a = |b| sel(&ctx(Collective::AllToAll, b, 2));
        assert_eq!(a2a(2048).as_deref(), Some(ALLTOALL_PACKET));
        assert_eq!(a2a(2050).as_deref(), Some(ALLTOALL_ZERO_COPY));
    }

    #[rstest]
    #[case("gfx1100", 2, 2)]
    #[case("sm_60", 2, 2)]
    #[case("sm_90", 9, 9)]
    fn outside_the_native_domain_nothing_is_chosen(
        #[case] arch: &str,
        #[case] world: usize,
        #[case] local: usize,
    ) {
        let mut c = ctx(Collective::AllReduce, 1024, world);
        c.arch = arch.into();
        c.local_world_size = local;
        assert_eq!(default_native_selector(LIMITS)(&c), None);
        let err = native_collection().select(&c).err().expect("no algorithm");
        assert!(err.to_string().contains("allreduce of 1024 bytes"), "{err}");
        for a in ["sm_90a", "sm_100", "sm_70"] {
            c.arch = a.into();
            c.world_size = 2;
            c.local_world_size = 2;
            assert!(default_native_selector(LIMITS)(&c).is_some(), "{a}");
        }
    }

    /// World size 1: every collective has its single-rank algorithm, on any device.
    #[rstest]
    #[case(Collective::AllReduce, ALLREDUCE_SINGLE_RANK)]
    #[case(Collective::AllGather, ALLGATHER_SINGLE_RANK)]
    #[case(Collective::ReduceScatter, REDUCESCATTER_SINGLE_RANK)]
    #[case(Collective::Broadcast, BROADCAST_SINGLE_RANK)]
    #[case(Collective::Reduce, REDUCE_SINGLE_RANK)]
    #[case(Collective::AllToAll, ALLTOALL_SINGLE_RANK)]
    #[case(Collective::Gather, GATHER_SINGLE_RANK)]
    #[case(Collective::Scatter, SCATTER_SINGLE_RANK)]
    fn one_rank_takes_the_single_rank_algorithm(#[case] c: Collective, #[case] want: &str) {
        for arch in ["sm_90", "sm_60", "gfx942"] {
            for bytes in [0, 4, 1 << 30] {
                let mut x = ctx(c, bytes, 1);
                x.arch = arch.into();
                x.nvls_allowed = true;
                assert_eq!(default_native_selector(LIMITS)(&x).as_deref(), Some(want));
            }
        }
        let mut x = ctx(Collective::SendRecv, 4, 1);
        x.local_world_size = 1;
        assert_eq!(default_native_selector(LIMITS)(&x), None);
    }

    /// Several hosts, even or uneven: all-reduce takes the algorithm built for the topology
    /// (none where none could be built), all-gather, broadcast and reduce-scatter go through it;
    /// the other collectives have none yet, and the error says why.
    #[rstest]
    #[case(4, 2, Some(ALLREDUCE_HIERARCHICAL))]
    #[case(16, 8, Some(ALLREDUCE_HIERARCHICAL))]
    #[case(3, 2, Some(PORT_ALLREDUCE))]
    #[case(5, 1, Some(PORT_ALLREDUCE))]
    #[case(12, 4, None)]
    fn several_hosts(
        #[case] world: usize,
        #[case] local: usize,
        #[case] built: Option<&'static str>,
    ) {
        let sel = default_native_selector(NativeLimits {
            multi_host_allreduce: built,
            ..LIMITS
        });
        let mut c = ctx(Collective::AllReduce, 1 << 20, world);
        c.local_world_size = local;
        assert_eq!(sel(&c).as_deref(), built);
        c.arch = "gfx942".into();
        assert_eq!(sel(&c).as_deref(), built, "no kernel arch rule");
        for (other, via) in [
            (Collective::AllGather, ALLGATHER_VIA_ALLREDUCE),
            (Collective::Broadcast, BROADCAST_VIA_ALLREDUCE),
            (Collective::ReduceScatter, REDUCESCATTER_VIA_ALLREDUCE),
        ] {
            let mut c = ctx(other, 1024, world);
            c.local_world_size = local;
            assert_eq!(sel(&c).as_deref(), built.map(|_| via));
        }
        for other in [Collective::Reduce, Collective::AllToAll, Collective::Gather] {
            let mut c = ctx(other, 1024, world);
            c.local_world_size = local;
            assert_eq!(sel(&c), None);
            let err = native_collection().select(&c).err().expect("none");
            let msg = err.to_string();
            assert!(
                msg.contains("span several hosts")
                    && msg.contains(PORT_ALLREDUCE)
                    && msg.contains(ALLREDUCE_HIERARCHICAL),
                "{msg}"
            );
        }
    }

    /// AMD (MSCCL++'s policy there): packets for small messages (LL16 all-pair throughout: the
    /// LL128 all-pair kernel is CUDA only), the full-mesh kernel for large all-reduce, never the
    /// copy engine or NVLS.
    #[rstest]
    #[case("gfx942", 1024, Some(ALLREDUCE_ALLPAIR_PACKET))]
    #[case("gfx942", 256 << 10, Some(ALLREDUCE_ALLPAIR_PACKET))]
    #[case("gfx942", 4 << 20, Some(ALLREDUCE_PACKET))]
    #[case("gfx942", (4 << 20) + 2, Some(ALLREDUCE_FULLMESH))]
    #[case("gfx90a", 1 << 30, Some(ALLREDUCE_FULLMESH))]
    #[case("gfx1100", 1 << 30, None)]
    fn amd_takes_the_full_mesh_for_large_all_reduce(
        #[case] arch: &str,
        #[case] bytes: usize,
        #[case] want: Option<&str>,
    ) {
        let mut c = ctx(Collective::AllReduce, bytes, 2);
        c.arch = arch.into();
        c.nvls_allowed = true;
        assert_eq!(default_native_selector(LIMITS)(&c).as_deref(), want);
    }

    #[test]
    fn nvls_is_refused_unless_allowed() {
        let mut b = AlgorithmCollection::builder();
        b.add_algorithm(Arc::new(Fake(
            "default_allreduce_nvls",
            Collective::AllReduce,
        )))
        .expect("add");
        b.set_selector(Box::new(|_| Some("default_allreduce_nvls".into())));
        let coll = b.build();
        let mut c = ctx(Collective::AllReduce, 1 << 20, 2);
        let err = coll.select(&c).err().expect("refused");
        assert!(err.to_string().contains("NVLink multicast"), "{err}");
        c.nvls_allowed = true;
        assert_eq!(
            coll.select(&c).expect("allowed").name(),
            "default_allreduce_nvls"
        );
    }

    /// With NVLS not allowed the default policy never answers an NVLS name, whatever the call.
    #[test]
    fn default_policy_never_picks_nvls_unless_allowed() {
        let sel = default_native_selector(LIMITS);
        for collective in [
            Collective::AllReduce,
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::Broadcast,
        ] {
            for dtype in DataType::ALL {
                for bytes in [0, 1, 16, 4096, 256 << 10, (256 << 10) + 16, 1 << 30] {
                    for world in 1..=8 {
                        for symmetric in [false, true] {
                            for arch in ["sm_90", "sm_100", "sm_80"] {
                                let mut c = ctx(collective, bytes, world);
                                c.dtype = dtype;
                                c.symmetric_memory = symmetric;
                                c.arch = arch.into();
                                if let Some(name) = sel(&c) {
                                    assert!(!is_nvls_name(&name), "{name} for {c:?}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The push all-reduce is unmeasured: the default policy leaves it to `--algo` and the tuner,
    /// at every size, world size, architecture and capture mode.
    #[test]
    fn default_policy_never_picks_the_unmeasured_push_allreduce() {
        let sel = default_native_selector(LIMITS);
        for bytes in [1usize, 1 << 20, 64 << 20, 256 << 20, 1 << 30] {
            for world in 2..=8 {
                for arch in ["sm_80", "sm_90", "sm_100", "gfx942"] {
                    for capturing in [false, true] {
                        let mut c = ctx(Collective::AllReduce, bytes, world);
                        c.arch = arch.into();
                        c.capturing = capturing;
                        assert_ne!(sel(&c).as_deref(), Some(ALLREDUCE_RSAG_PUSH), "{c:?}");
                    }
                }
            }
        }
    }

    #[rstest]
    #[case(DataType::Bf16, 1024, false, "sm_90", Some(ALLREDUCE_NVLS_PACKET))]
    #[case(
        DataType::F32,
        NVLS_PACKET_THRESHOLD,
        true,
        "sm_90",
        Some(ALLREDUCE_NVLS_PACKET)
    )]
    #[case(DataType::F16, 1 << 24, true, "sm_100", Some(ALLREDUCE_NVLS_ZERO_COPY))]
    #[case(DataType::F16, 1 << 24, false, "sm_90", Some(ALLREDUCE_NVLS_BLOCK_PIPELINE))]
    #[case(DataType::F16, (1 << 24) + 2, true, "sm_90", Some(ALLREDUCE_NVLS_BLOCK_PIPELINE))]
    // multimem cannot add these types, and sm_80 has no multimem: the NVLink policy answers.
    #[case(DataType::F64, 1 << 24, true, "sm_90", None)]
    #[case(DataType::I32, 1024, true, "sm_90", None)]
    #[case(DataType::Bf16, 1 << 24, true, "sm_80", None)]
    fn nvls_branch_when_allowed(
        #[case] dtype: DataType,
        #[case] bytes: usize,
        #[case] symmetric: bool,
        #[case] arch: &str,
        #[case] want: Option<&str>,
    ) {
        let mut c = ctx(Collective::AllReduce, bytes, 8);
        c.dtype = dtype;
        c.symmetric_memory = symmetric;
        c.arch = arch.into();
        c.nvls_allowed = true;
        let got = default_native_selector(LIMITS)(&c);
        match want {
            Some(w) => assert_eq!(got.as_deref(), Some(w)),
            None => assert!(got.is_some_and(|n| !is_nvls_name(&n)), "{c:?}"),
        }
        // Closing the gate always falls back to the NVLink algorithms.
        c.nvls_allowed = false;
        assert!(default_native_selector(LIMITS)(&c).is_some_and(|n| !is_nvls_name(&n)));
    }

    #[test]
    fn builder_errors_name_the_problem() {
        let mut b = AlgorithmCollection::builder();
        b.add_algorithm(Arc::new(Fake("x", Collective::AllGather)))
            .expect("first");
        let err = b
            .add_algorithm(Arc::new(Fake("x", Collective::AllGather)))
            .err()
            .expect("duplicate");
        assert!(err.to_string().contains("x is registered twice"), "{err}");
        // The same name for another collective is fine.
        b.add_algorithm(Arc::new(Fake("x", Collective::Broadcast)))
            .expect("other collective");
        b.set_selector(Box::new(|_| Some("missing".into())));
        let coll = b.build();
        assert_eq!(coll.names(Collective::AllGather), vec!["x".to_string()]);
        let err = coll
            .select(&ctx(Collective::AllGather, 8, 2))
            .err()
            .expect("missing");
        assert!(err.to_string().contains("missing"), "{err}");
        assert!(err.to_string().contains("registered: x"), "{err}");
        let no_selector = AlgorithmCollection::builder().build();
        assert!(no_selector
            .select(&ctx(Collective::AllGather, 8, 2))
            .is_err());
    }
}
