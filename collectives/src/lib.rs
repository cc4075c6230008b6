//! Native collective algorithms of mscclpp-rs over NVLink (one host, 1..=8 ranks):
//! - all-reduce: all-pair packets, two-phase packets, zero-copy reduce-scatter + all-gather on
//!   registered buffers, scratch-staged rsag / rsag_pipeline / fullmesh for unregistered buffers,
//!   the write-only rsag_push (inputs staged, reduced chunks written into registered outputs),
//!   the copy-engine all-reduce for large messages (`copy_engine`), and, behind the NVLS gate, the four NVLS variants (`nvls`);
//! - all-gather: packets, zero-copy fullmesh2, scratch-staged fullmesh;
//! - reduce-scatter: packets and zero-copy; broadcast: zero-copy;
//! - an all-reduce over PortChannels (`port_allreduce`), CudaIpc on a host and Ethernet between
//!   hosts: the default for ranks on several hosts;
//! - at world size 1, every collective as one device copy (`single_rank`);
//! - the all-to-all family (`alltoall`): packet and zero-copy all-to-all, all-to-all-v, gather,
//!   scatter (`gather_scatter` serves the last two as collection algorithms);
//! - reduce to one root: zero-copy (`algorithms::reduce_zero_copy`).
//!
//! Kernels are in `mscclpp-kernels-cu` (collectives.rs, nvls_units.rs).
//! [`build_default_algorithms`] builds them all for a communicator, with the default selector of
//! `mscclpp_core::algorithm_collection`; `tune` fills a tuning table for `mscclpp_core::tuner`.

pub mod algorithms;
pub mod alltoall;
pub mod copy_engine;
pub mod gather_scatter;
pub mod geometry;
pub mod native;
pub mod nvls;
pub mod p2p;
pub mod port_allreduce;
pub mod resources;
pub mod single_rank;
pub mod testing;
pub mod tune;

pub use native::{check_shape, max_input_bytes, max_input_bytes_on, NativeBase, NativeKind};

use mscclpp_core::algorithm_collection::{
    default_native_selector, AlgorithmCollection, AlgorithmCollectionBuilder, NativeLimits,
};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::Result;
use mscclpp_kernels_cu::collectives::MAX_RANKS;
use std::sync::Arc;

/// The builder's default `scratch_bytes` s. The collection makes one allocation of 30 MiB from it
/// and lends it to every algorithm, the all-to-all family included (its exchange tables take the
/// first 24 KiB of the staging part, its packets up to 2 MiB of the LL128 part), at 2, 4 and 8
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
        // The NVLink kernels and their shared scratch need every peer's memory mapped here; across
        // hosts the flat PortChannel all-reduce runs (the hierarchical algorithms are still to
        // come), and no packet algorithm is built.
        let limits = NativeLimits {
            allpair_packet_max_bytes: 0,
            packet_max_bytes: 0,
            allgather_packet_max_bytes: 0,
            reducescatter_packet_max_bytes: 0,
            max_ranks: MAX_RANKS,
        };
        add_multi_host_algorithms(comm, scratch_bytes, &mut builder)?;
        builder.set_selector(default_native_selector(limits));
        return Ok((builder, None));
    }
    let properties = comm.gpu().properties(comm.device())?;
    let scratch = collection_resources(comm, scratch_bytes)?;
    let limit = |kind: NativeKind| {
        let part = kind.scratch_part().map_or(0, |p| scratch.region(p).bytes);
        max_input_bytes_on(kind, part, comm.size(), properties.vendor)
    };
    let limits = NativeLimits {
        allpair_packet_max_bytes: limit(NativeKind::AllreduceAllpairPacket),
        packet_max_bytes: limit(NativeKind::AllreducePacket),
        allgather_packet_max_bytes: limit(NativeKind::AllgatherPacket),
        reducescatter_packet_max_bytes: limit(NativeKind::ReducescatterPacket),
        max_ranks: MAX_RANKS,
    };
    for kind in NativeKind::ALL {
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
    builder.add_algorithm(Arc::new(alltoall::AlltoallPacket::with_resources(
        comm.clone(),
        scratch.clone(),
    )?))?;
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

/// The algorithms of a job whose ranks span hosts: `port_allreduce` with segments of
/// `scratch_bytes`, up to its rank limit. Where it cannot start (e.g. under
/// `CUDA_DEVICE_MAX_CONNECTIONS=1`) the reason is logged and the collection goes without it, so
/// the selector's choice of it fails naming what is registered.
fn add_multi_host_algorithms(
    comm: &Arc<Communicator>,
    scratch_bytes: usize,
    builder: &mut AlgorithmCollectionBuilder,
) -> Result<()> {
    let name = port_allreduce::NAME;
    let topology = comm.topology();
    tracing::info!(target: "mscclpp::algo", "ranks on {topology}: building {name} only");
    if comm.size() > MAX_RANKS {
        let n = comm.size();
        tracing::warn!(target: "mscclpp::algo", "{name} takes at most {MAX_RANKS} ranks, not {n}");
        return Ok(());
    }
    let config = mscclpp_core::port_channel::PortChannelConfig::default();
    match port_allreduce::PortAllreduce::new(comm.clone(), scratch_bytes, config) {
        Ok(algo) => {
            builder.add_algorithm(Arc::new(algo))?;
        }
        Err(e @ mscclpp_core::Error::Unsupported(_)) => {
            tracing::warn!(target: "mscclpp::algo", "{e}");
        }
        Err(e) => return Err(e),
    }
    Ok(())
}

/// [`build_default_algorithms`] into a fresh collection.
pub fn default_algorithm_collection(
    comm: &Arc<Communicator>,
    scratch_bytes: usize,
) -> Result<AlgorithmCollection> {
    Ok(build_default_algorithms(comm, scratch_bytes, AlgorithmCollection::builder())?.build())
}
