//! Native collective algorithms of mscclpp-rs over NVLink (one host, 1..=8 ranks):
//! - all-reduce: all-pair packets, two-phase packets, zero-copy reduce-scatter + all-gather on
//!   registered buffers, scratch-staged rsag / rsag_pipeline / fullmesh for unregistered buffers,
//!   the write-only rsag_push (inputs staged, reduced chunks written into registered outputs; CUDA
//!   only for now),
//!   the copy-engine all-reduce (`copy_engine`: the default selector takes it for large
//!   out-of-place calls at 2-4 ranks), and, behind the NVLS gate, the four NVLS variants (`nvls`);
//! - all-gather: packets, zero-copy fullmesh2, scratch-staged fullmesh;
//! - reduce-scatter: packets and zero-copy; broadcast: zero-copy;
//! - across hosts: the hierarchical all-reduce of H hosts x k ranks (`hierarchical`: the
//!   single-host algorithms in each host, `port_allreduce` across hosts), and the flat all-reduce
//!   over PortChannels (`port_allreduce`, CudaIpc on a host and IB or Ethernet between hosts), the
//!   default for uneven ranks per host and one rank per host; all-gather, broadcast and
//!   reduce-scatter through either (`via_allreduce`);
//! - at world size 1, every collective as one device copy (`single_rank`);
//! - the all-to-all family (`alltoall`): packet and zero-copy all-to-all, all-to-all-v, gather,
//!   scatter (`gather_scatter` serves the last two as collection algorithms);
//! - reduce to one root: zero-copy (`algorithms::reduce_zero_copy`);
//! - expert-parallel MoE dispatch and combine (`ep`: rings in every rank's NVLink buffer).
//!
//! Kernels are in `mscclpp-kernels-cu` (collectives.rs, nvls_units.rs).
//! [`build_default_algorithms`] builds them all for a communicator, with the default selector of
//! `mscclpp_core::algorithm_collection`; `tune` fills a tuning table for `mscclpp_core::tuner`.

pub mod algorithms;
pub mod alltoall;
pub mod copy_engine;
pub mod ep;
pub mod gather_scatter;
pub mod geometry;
pub mod hierarchical;
pub mod native;
pub mod nvls;
pub mod p2p;
pub mod port_allreduce;
pub mod resources;
pub mod session;
pub mod single_rank;
pub mod testing;
pub mod tune;
pub mod user_buffers;
pub mod via_allreduce;

pub use native::{check_shape, max_input_bytes, max_input_bytes_on, NativeBase, NativeKind};

use mscclpp_core::algorithm::Algorithm;
use mscclpp_core::algorithm_collection::{
    default_native_selector, AlgorithmCollection, AlgorithmCollectionBuilder, NativeLimits,
};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::GpuVendor;
use mscclpp_core::Result;
use mscclpp_kernels_cu::collectives::MAX_RANKS;
use std::sync::Arc;

/// The builder's default `scratch_bytes` s. The collection makes one allocation of 30 MiB from it
/// and lends it to every algorithm, the all-to-all family included (its exchange tables take the
/// first 25 KiB of the staging part, its in-place copies the rest of it, its packets up to 2 MiB
/// of the LL128 part), at 2, 4 and 8
/// ranks alike (`resources::CollectionResources`, `resources::scratch_bounds`):
/// s/2 = 4 MiB of LL16 packets, 9s/4 = 18 MiB of LL128 lines, s = 8 MiB (less the call counter,
/// semaphores and the point-to-point engine's region, up to 0.97 MiB at 8 ranks: 7 MiB at 3 to 8
/// ranks, 7.375 MiB at 2; 7.875 MiB before the region came in) for staged data and, with the LL128
/// part, the copy engine's ring.
/// Capacities (input per rank; before, from each algorithm's own 8 MiB, 32 MiB for the two-phase
/// all-reduce): two-phase packet all-reduce 4.22 MiB (7.5), all-pair 512 KiB at 2 ranks, 256 KiB at
/// 4, 128 KiB at 8 (1 MiB, 512 KiB, 256 KiB), packet all-gather 4.22 MiB x 2 / nranks (1.875 MiB x
/// 2 / nranks), packet reduce-scatter 8.4 MiB (3.75), one-step rsag 1.97 MiB (4), copy-engine
/// pieces 8.6 MiB at 2 ranks (32). Every selector threshold stays within these, so the default
/// selection is unchanged (`native` tests).
/// Across hosts s buys: the hierarchical all-reduce's host-group collection from s/4 (7.5 MiB) and
/// its cross-host `port_allreduce` of about s, the flat `port_allreduce` of about s, and the
/// reduce-scatter's s/4: about 26 MiB at 2 hosts x 2 or x 4 ranks (`hierarchical`,
/// `via_allreduce`).
pub const DEFAULT_SCRATCH_BYTES: usize = 8 << 20;

/// Collective: builds every native algorithm for `comm` into `builder`, lending them one scratch of
/// about 3.75 x `scratch_bytes` bytes and one semaphore table
/// (`resources::CollectionResources`: read its rule on streams), allocated here (not on first use: building
/// is collective, so every rank maps every peer's scratch now, and a call under CUDA-graph capture
/// never allocates), and installs the default selector with the limits that scratch gives. Returns
/// the builder so callers can add plan algorithms or their own selector before `build()`.
pub fn build_default_algorithms(
    comm: &Arc<Communicator>,
    scratch_bytes: usize,
    builder: AlgorithmCollectionBuilder,
) -> Result<AlgorithmCollectionBuilder> {
    Ok(build_default_algorithms_with_resources(comm, scratch_bytes, builder)?.0)
}

/// As [`build_default_algorithms`], also returning the resources the collection lends (`None`
/// across hosts, where no algorithm shares a scratch): a point-to-point engine borrows its region
/// from them (`p2p::P2pEngine::with_resources`), as the NCCL shim's and the bench's do, so the
/// whole communicator stays in one scratch allocation.
pub fn build_default_algorithms_with_resources(
    comm: &Arc<Communicator>,
    scratch_bytes: usize,
    mut builder: AlgorithmCollectionBuilder,
) -> Result<(
    AlgorithmCollectionBuilder,
    Option<Arc<resources::CollectionResources>>,
)> {
    // At world size 1 every collective is a copy (or nothing): no kernel, whatever the device.
    if comm.size() == 1 {
        for collective in single_rank::COLLECTIVES {
            let algo = single_rank::SingleRank::new(collective, comm.gpu().clone())?;
            builder.add_algorithm(Arc::new(algo))?;
        }
    }
    if !comm.topology().is_single_host() {
        // The NVLink kernels and their shared scratch need every peer's memory mapped here:
        // across hosts they run inside each host only, within the hierarchical algorithm.
        let limits = NativeLimits {
            allpair_packet_max_bytes: 0,
            allpair_ll128_max_bytes: 0,
            packet_max_bytes: 0,
            allgather_packet_max_bytes: 0,
            reducescatter_packet_max_bytes: 0,
            alltoall_packet_max_chunk: 0,
            max_ranks: MAX_RANKS,
            multi_host_allreduce: add_multi_host_algorithms(comm, scratch_bytes, &mut builder)?,
        };
        builder.set_selector(default_native_selector(limits));
        return Ok((builder, None));
    }
    let properties = comm.gpu().properties(comm.device())?;
    let scratch = collection_resources(comm, scratch_bytes)?;
    let limit = |kind: NativeKind| {
        let part = kind.scratch_part().map_or(0, |p| scratch.region(p).bytes);
        max_input_bytes_on(kind, part, comm.size(), properties.vendor)
    };
    let alltoall_packet = Arc::new(alltoall::AlltoallPacket::with_resources(
        comm.clone(),
        scratch.clone(),
    )?);
    let limits = NativeLimits {
        allpair_packet_max_bytes: limit(NativeKind::AllreduceAllpairPacket),
        allpair_ll128_max_bytes: if properties.vendor == GpuVendor::Amd {
            0
        } else {
            limit(NativeKind::AllreduceAllpairLl128)
        },
        packet_max_bytes: limit(NativeKind::AllreducePacket),
        allgather_packet_max_bytes: limit(NativeKind::AllgatherPacket),
        reducescatter_packet_max_bytes: limit(NativeKind::ReducescatterPacket),
        alltoall_packet_max_chunk: alltoall_packet.max_chunk_bytes(),
        max_ranks: MAX_RANKS,
        multi_host_allreduce: None,
    };
    for kind in NativeKind::ALL {
        if properties.vendor == GpuVendor::Amd && kind.is_cuda_only() {
            tracing::debug!(target: "mscclpp::algo", "{}: CUDA only for now, left out", kind.name());
            continue;
        }
        builder.add_algorithm(algorithms::build(kind, comm, &scratch)?)?;
    }
    // The all-to-all family borrows the same resources (`resources::CollectionResources`).
    let exchange = Arc::new(alltoall::AlltoallZeroCopy::with_resources(
        comm.clone(),
        scratch.clone(),
    )?);
    builder.add_algorithm(exchange.clone())?;
    builder.add_algorithm(Arc::new(alltoall::ShiftSendRecv::new(exchange.clone())))?;
    builder.add_algorithm(Arc::new(gather_scatter::GatherScatter::gather(
        exchange.clone(),
    )))?;
    builder.add_algorithm(Arc::new(gather_scatter::GatherScatter::scatter(exchange)))?;
    builder.add_algorithm(alltoall_packet)?;
    // NVLS (NVLink multicast) only behind its safety gate and on hardware that supports it; the
    // selector takes its NVLS branch only when the caller's SelectionContext allows it.
    let env = mscclpp_core::env::Env::get()?;
    nvls::add_nvls_algorithms(comm, scratch_bytes, &mut builder, env)?;
    builder.set_selector(default_native_selector(limits));
    Ok((builder, Some(scratch)))
}

/// Collective: the resources a default collection lends its algorithms (one scratch of about
/// 3.75 x `scratch_bytes`, the call counter, semaphores for the kind that barriers with the most
/// blocks, the all-to-all state, the point-to-point region), as [`build_default_algorithms`]
/// builds them; for tests and
/// callers that build the algorithms themselves (`with_resources` constructors).
pub fn collection_resources(
    comm: &Arc<Communicator>,
    scratch_bytes: usize,
) -> Result<Arc<resources::CollectionResources>> {
    let sm = comm.multiprocessors()?;
    let semaphore_blocks = NativeKind::ALL
        .iter()
        .map(|k| k.semaphore_blocks(sm))
        .max()
        .unwrap_or(0);
    Ok(Arc::new(resources::CollectionResources::with_p2p(
        comm,
        scratch_bytes,
        semaphore_blocks,
    )?))
}

/// Collective: the algorithms of a job whose ranks span hosts, in this order on every rank:
/// - up to 8 ranks, the flat `port_allreduce`, whose scratch (slots and staging buffer) is about
///   `scratch_bytes` in all (`hierarchical::port_segment_bytes`): the default where the hierarchy
///   does not apply, kept beside it for comparison (`--algo port_allreduce`) and for the
///   hierarchical one's integer averages;
/// - for H hosts x k ranks (2..=8 each; `Topology::hierarchy`), `default_allreduce_hierarchical`
///   (its memory: `hierarchical`'s module docs);
///
/// - with the all-reduce the selector takes (the hierarchical one where built), all-gather,
///   broadcast and reduce-scatter through it (`via_allreduce`; the reduce-scatter's scratch is
///   `scratch_bytes / 4`).
///
/// Returns the name of that all-reduce, logged once per communicator; `None` where neither could
/// be built. Where an algorithm cannot start (e.g. under `CUDA_DEVICE_MAX_CONNECTIONS=1`) the
/// reason is logged and the collection goes without it.
fn add_multi_host_algorithms(
    comm: &Arc<Communicator>,
    scratch_bytes: usize,
    builder: &mut AlgorithmCollectionBuilder,
) -> Result<Option<&'static str>> {
    let topology = comm.topology();
    let n = comm.size();
    // The flat all-reduce first: the hierarchical one runs integer averages through it.
    let flat = port_allreduce::NAME;
    let mut flat_algo: Option<Arc<dyn Algorithm>> = None;
    if n <= MAX_RANKS {
        let config = mscclpp_core::port_channel::PortChannelConfig::default();
        let segment = hierarchical::port_segment_bytes(scratch_bytes, n);
        let built = unless_unsupported(port_allreduce::PortAllreduce::new(
            comm.clone(),
            segment,
            config,
        ))?;
        if let Some(algo) = built {
            let algo: Arc<dyn Algorithm> = Arc::new(algo);
            builder.add_algorithm(algo.clone())?;
            flat_algo = Some(algo);
        }
    } else {
        tracing::warn!(target: "mscclpp::algo", "{flat} takes at most {MAX_RANKS} ranks, not {n}");
    }
    // The all-reduce the selector takes, with its name for the selector's limits.
    let mut chosen: Option<(Arc<dyn Algorithm>, &'static str)> =
        flat_algo.clone().map(|a| (a, flat));
    if topology.hierarchy(comm.rank()).is_some() {
        let built = unless_unsupported(hierarchical::HierarchicalAllreduce::new(
            comm.clone(),
            scratch_bytes,
            flat_algo,
        ))?;
        if let Some(algo) = built {
            let algo: Arc<dyn Algorithm> = Arc::new(algo);
            builder.add_algorithm(algo.clone())?;
            chosen = Some((algo, hierarchical::NAME));
        }
    }
    let Some((allreduce, name)) = chosen else {
        if comm.rank() == 0 {
            tracing::warn!(target: "mscclpp::algo", "ranks on {topology}: no allreduce could be built");
        }
        return Ok(None);
    };
    for collective in via_allreduce::COLLECTIVES {
        let algo = via_allreduce::ViaAllreduce::new(collective, allreduce.clone(), comm.clone())?;
        builder.add_algorithm(Arc::new(algo))?;
    }
    builder.add_algorithm(Arc::new(via_allreduce::ReduceScatterViaAllreduce::new(
        allreduce,
        comm.clone(),
        scratch_bytes,
    )?))?;
    if comm.rank() == 0 {
        tracing::info!(target: "mscclpp::algo", "ranks on {topology}: allreduce runs {name}, allgather, broadcast and reducescatter through it");
    }
    Ok(Some(name))
}

/// `built`, or `None` with the reason logged where it is `Unsupported` (the collection goes without
/// it); other errors stay errors.
fn unless_unsupported<T>(built: Result<T>) -> Result<Option<T>> {
    match built {
        Ok(algo) => Ok(Some(algo)),
        Err(mscclpp_core::Error::Unsupported(why)) => {
            tracing::warn!(target: "mscclpp::algo", "{why}");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// [`build_default_algorithms`] into a fresh collection.
pub fn default_algorithm_collection(
    comm: &Arc<Communicator>,
    scratch_bytes: usize,
) -> Result<AlgorithmCollection> {
    Ok(build_default_algorithms(comm, scratch_bytes, AlgorithmCollection::builder())?.build())
}
