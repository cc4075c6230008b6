//! The LL-packet kernel family (`coll::PacketArgs`): the packet algorithms write LL16 packets or
//! LL128 lines into the peers' halves of the collection's scratch and poll their own, with no
//! semaphores; the shared call counter picks the half and the flag.

use crate::geometry;
use crate::native::{NativeBase, NativeKind, DEFAULT_THREADS};
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::PacketArgs;
use mscclpp_core::Result;
use mscclpp_kernels_cu::collectives::MAX_PACKET_BLOCKS;

/// Bytes of one rank's slot in a half of the scratch, by the kind's layout.
fn slot_bytes(base: &NativeBase, s: usize) -> usize {
    let n = base.comm().size();
    match base.kind() {
        NativeKind::AllreducePacket => geometry::packet_slot_bytes(s, n),
        NativeKind::AllgatherPacket | NativeKind::ReducescatterPacket => {
            geometry::line_slot_bytes(s, n)
        }
        // All-pair layout: 2 parity halves x one slot per sending rank.
        _ => geometry::allpair_slot_bytes(s, n),
    }
}

/// Launches the kind's packet kernel for a checked call; `count` in the kernel's units (elements;
/// bytes for the all-gather; elements per chunk for the reduce-scatter).
pub fn launch(base: &NativeBase, args: &ExecuteArgs, count: u64) -> Result<()> {
    let f = base.function(args)?;
    let comm = base.comm();
    let n = comm.size();
    let threads = args.nthreads.unwrap_or(DEFAULT_THREADS);
    // At most one block per SM (the packet kernels poll; latency matters more than bandwidth),
    // within the residency cap, and the per-block call counter has MAX_PACKET_BLOCKS slots
    // (collective_common.cuh).
    let max_blocks = base
        .residency()
        .max_blocks(threads)
        .min(base.sm())
        .min(MAX_PACKET_BLOCKS as u32);
    let cfg = geometry::launch_config(
        args.nblocks,
        args.nthreads,
        geometry::packet_blocks(
            base.kind().packet_work_bytes(args.input_bytes, n),
            threads,
            base.sm(),
        ),
        DEFAULT_THREADS,
        max_blocks,
    )?;
    let scratch = base.scratch()?;
    let kernel_args = PacketArgs {
        input: args.input,
        output: args.output,
        count,
        peer_scratch: scratch.peers,
        local_scratch: scratch.local,
        slot_bytes: slot_bytes(base, scratch.bytes) as u64,
        half_bytes: scratch.half_bytes() as u64,
        state: base.resources().state_ptr(),
        error_word: comm.error_word_device_ptr(),
        max_spin: 0,
        rank: comm.rank() as u32,
        nranks: n as u32,
    };
    base.launch(f, cfg, args, kernel_args)
}
