//! Native collective algorithms of mscclpp-rs over NVLink (one host, 1..=8 ranks):
//! - all-reduce: all-pair packets, two-phase packets, zero-copy reduce-scatter + all-gather on
//!   registered buffers, scratch-staged rsag / rsag_pipeline / fullmesh for unregistered buffers,
//!   the copy-engine all-reduce for large messages (`copy_engine`), and, behind the NVLS gate, the four NVLS variants (`nvls`);
//! - all-gather: packets, zero-copy fullmesh2, scratch-staged fullmesh;
//! - reduce-scatter: packets and zero-copy; broadcast: zero-copy;
//! - an all-reduce over PortChannels (`port_allreduce`).
//!
//! Kernels are in `mscclpp-kernels-cu` (collectives.rs, nvls_units.rs).
//! [`build_default_algorithms`] builds them all for a communicator, with the default selector of
//! `mscclpp_core::algorithm_collection`; `tune` fills a tuning table for `mscclpp_core::tuner`.

pub mod copy_engine;
pub mod geometry;
pub mod native;
pub mod nvls;
pub mod port_allreduce;
pub mod resources;
pub mod testing;
pub mod tune;

pub use native::{check_shape, max_input_bytes, NativeAlgorithm, NativeKind};

use mscclpp_core::algorithm_collection::{
    default_native_selector, AlgorithmCollection, AlgorithmCollectionBuilder, NativeLimits,
};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::Result;
use mscclpp_kernels_cu::collectives::MAX_RANKS;
use std::sync::Arc;

/// The builder's default `scratch_bytes`. The collection allocates one scratch of
/// `native::PACKET_SCRATCH_SCALE` times this (32 MiB) and lends it to every algorithm that stages
/// data (see `resources::CollectionResources`). Capacities on it: 7.5 MiB for the two-phase packet
/// all-reduce (as before), 4 MiB for the all-pair one at 2 ranks, 7.5 MiB x 2 / nranks of
/// all-gather input, 15 MiB of reduce-scatter input (each 4x its former own 8 MiB scratch's; the
/// selector's thresholds, not these, decide at those sizes).
pub const DEFAULT_SCRATCH_BYTES: usize = 8 << 20;

/// Collective: builds every native algorithm for `comm` into `builder`, lending them one scratch of
/// `native::PACKET_SCRATCH_SCALE * scratch_bytes` bytes and one semaphore table
/// (`resources::CollectionResources`: read its rule on streams), allocated here (not on first use: building
/// is collective, so every rank maps every peer's scratch now, and a call under CUDA-graph capture
/// never allocates), and installs the default selector with the limits that scratch gives. Returns
/// the builder so callers can add plan algorithms or their own selector before `build()`.
pub fn build_default_algorithms(
    comm: &Arc<Communicator>,
    scratch_bytes: usize,
    mut builder: AlgorithmCollectionBuilder,
) -> Result<AlgorithmCollectionBuilder> {
    let mut limits = NativeLimits {
        allpair_packet_max_bytes: 0,
        packet_max_bytes: 0,
        allgather_packet_max_bytes: 0,
        reducescatter_packet_max_bytes: 0,
        max_ranks: MAX_RANKS,
    };
    let sm = comm.gpu().properties(comm.device())?.multiprocessors.max(1);
    let semaphore_blocks = NativeKind::ALL
        .iter()
        .map(|k| k.semaphore_blocks(sm))
        .max()
        .unwrap_or(0);
    let scratch = Arc::new(resources::CollectionResources::new(
        comm,
        scratch_bytes.saturating_mul(native::PACKET_SCRATCH_SCALE),
        semaphore_blocks,
    )?);
    for kind in NativeKind::ALL {
        let algo = NativeAlgorithm::new(kind, comm.clone(), scratch.clone())?;
        match kind {
            NativeKind::AllreduceAllpairPacket => {
                limits.allpair_packet_max_bytes = algo.max_bytes()
            }
            NativeKind::AllreducePacket => limits.packet_max_bytes = algo.max_bytes(),
            NativeKind::AllgatherPacket => limits.allgather_packet_max_bytes = algo.max_bytes(),
            NativeKind::ReducescatterPacket => {
                limits.reducescatter_packet_max_bytes = algo.max_bytes()
            }
            _ => {}
        }
        builder.add_algorithm(Arc::new(algo))?;
    }
    // NVLS (NVLink multicast) only behind its safety gate and on hardware that supports it; the
    // selector takes its NVLS branch only when the caller's SelectionContext allows it.
    let env = mscclpp_core::env::Env::get()?;
    nvls::add_nvls_algorithms(comm, scratch_bytes, &mut builder, env)?;
    builder.set_selector(default_native_selector(limits));
    Ok(builder)
}

/// [`build_default_algorithms`] into a fresh collection.
pub fn default_algorithm_collection(
    comm: &Arc<Communicator>,
    scratch_bytes: usize,
) -> Result<AlgorithmCollection> {
    Ok(build_default_algorithms(comm, scratch_bytes, AlgorithmCollection::builder())?.build())
}
