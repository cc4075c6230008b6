//! The scratch-pipeline kernel family (`coll::PipelineArgs`, "Scratch pipelines" in
//! collective_common.cuh): unregistered inputs staged through the collection's scratch in steps,
//! with a block barrier per step.

use crate::geometry::{self, PipelineGeometry};
use crate::native::{NativeBase, DEFAULT_THREADS};
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::{PeerPtrs, PipelineArgs};
use mscclpp_core::{Error, Result};

/// Launches the kind's pipeline kernel for a checked call of `units` (elements; bytes for the
/// all-gather) cut by `geometry`. Every geometry lies in one half of the staging part of the
/// scratch, and the halves alternate by the shared counter (see `resources::CollectionResources`).
/// `peer_outputs`: every rank's registered output for the kernel that writes into them
/// (`allreduce_rsag_push`), default (null) for the others.
pub fn launch(
    base: &NativeBase,
    args: &ExecuteArgs,
    units: u64,
    geometry: Result<PipelineGeometry>,
    peer_outputs: PeerPtrs,
) -> Result<()> {
    let g = geometry.map_err(|e| Error::InvalidArgument(format!("{}: {e}", base.kind().name())))?;
    let f = base.function(args)?;
    let (sems, _) = base.semaphores()?;
    let threads = args.nthreads.unwrap_or(DEFAULT_THREADS);
    // The step counter has MAX_PACKET_BLOCKS slots, and blocks wait for the peers' blocks.
    let max_blocks = base.max_blocks(threads);
    let cfg = geometry::launch_config(
        args.nblocks,
        args.nthreads,
        geometry::bandwidth_blocks(args.input_bytes, max_blocks),
        DEFAULT_THREADS,
        max_blocks,
    )?;
    let (comm, scratch) = (base.comm(), base.scratch()?);
    let kernel_args = PipelineArgs {
        input: args.input,
        output: args.output,
        count: units,
        peer_scratch: scratch.peers,
        peer_outputs,
        local_scratch: scratch.local,
        slot_bytes: g.slot_bytes,
        half_bytes: scratch.half_bytes() as u64,
        step: g.step,
        sems,
        state: base.resources().state_ptr(),
        error_word: comm.error_word_device_ptr(),
        max_spin: 0,
        rank: comm.rank() as u32,
        nranks: comm.size() as u32,
    };
    base.launch(f, cfg, args, kernel_args)
}
