//! Native collective algorithms of mscclpp-rs over NVLink (one host, 1..=8 ranks):
//! - all-reduce: all-pair packets, two-phase packets, zero-copy reduce-scatter + all-gather on
//!   registered buffers, scratch-staged rsag / rsag_pipeline / fullmesh for unregistered buffers,
//!   the copy-engine all-reduce for large messages (`copy_engine`), and, behind the NVLS gate, the four NVLS variants (`nvls`);
//! - all-gather: packets, zero-copy fullmesh2, scratch-staged fullmesh;
//! - reduce-scatter: packets and zero-copy; broadcast: zero-copy;
//! - an all-reduce over PortChannels (`port_allreduce`);
//! - the all-to-all family (`alltoall`): packet and zero-copy all-to-all, all-to-all-v, gather,
//!   scatter.
//!
//! Kernels are in `mscclpp-kernels-cu` (collectives.rs, nvls_units.rs).
//! [`build_default_algorithms`] builds them all for a communicator, with the default selector of
//! `mscclpp_core::algorithm_collection`; `tune` fills a tuning table for `mscclpp_core::tuner`.

pub mod alltoall;
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

/// Default per-rank scratch of each packet algorithm (the two-phase packet all-reduce takes
/// `native::PACKET_SCRATCH_SCALE` times as much). Capacities, whatever the world size: 1 MiB for
/// the all-pair all-reduce at 2 ranks (less with more), 7.5 MiB for the two-phase all-reduce,
/// 1.875 MiB x 2 / nranks of all-gather input, 3.75 MiB of reduce-scatter input.
pub const DEFAULT_SCRATCH_BYTES: usize = 8 << 20;

/// Collective: builds every native algorithm for `comm` (each packet algorithm gets its own
/// `scratch_bytes` of scratch) into `builder`, and installs the default selector with the limits
/// those scratches give. Returns the builder so callers can add plan algorithms or their own
/// selector before `build()`.
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
    for kind in NativeKind::ALL {
        let algo = NativeAlgorithm::new(kind, comm.clone(), scratch_bytes)?;
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
    let exchange = Arc::new(alltoall::AlltoallZeroCopy::new(comm.clone())?);
    builder.add_algorithm(exchange.clone())?;
    builder.add_algorithm(Arc::new(alltoall::ShiftSendRecv::new(exchange)))?;
    builder.add_algorithm(Arc::new(alltoall::AlltoallPacket::new(comm.clone())?))?;
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
