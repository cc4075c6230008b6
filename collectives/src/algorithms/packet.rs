//! The LL-packet kernel family (`coll::PacketArgs`): the packet algorithms write LL16 packets or
//! LL128 lines into the peers' halves of the collection's scratch and poll their own, with no
//! semaphores; the shared call counter picks the half and the flag.

use crate::geometry;
use crate::native::{NativeBase, NativeKind, DEFAULT_THREADS};
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::PacketArgs;
use mscclpp_core::Result;

/// Bytes of one rank's slot in a half of a scratch part of `part_bytes`, by `kind`'s layout.
pub fn slot_bytes(kind: NativeKind, part_bytes: usize, nranks: usize) -> usize {
    match kind {
        NativeKind::AllreducePacket => geometry::packet_slot_bytes(part_bytes, nranks),
        NativeKind::AllreduceAllpairLl128
        | NativeKind::AllgatherPacket
        | NativeKind::ReducescatterPacket => geometry::line_slot_bytes(part_bytes, nranks),
        // All-pair layout: 2 parity halves x one slot per sending rank.
        _ => geometry::allpair_slot_bytes(part_bytes, nranks),
    }
}

/// Bytes of each slot that one call of `kind` with `input_bytes` per rank fills (its lines or
/// packets; `line_payload`: an LL128 line's payload on the GPU, `geometry::ll128_payload`), and
/// how far into its half of the part the call reaches: the last slot's start plus that (the
/// two-phase all-reduce has two regions of `nranks` slots). Packet kernels of one collection take
/// turns between the halves by the shared call counter, so a call can only disturb a peer still
/// reading the previous call if it reaches past its half: the launch trace prints this, and the
/// tests check it stays within the half at every size the selector lets through.
pub fn footprint(
    kind: NativeKind,
    slot_bytes: usize,
    nranks: usize,
    input_bytes: usize,
    line_payload: usize,
) -> (usize, usize) {
    let n = nranks.max(1);
    let lines = |bytes: usize| bytes.div_ceil(line_payload.max(1)) * geometry::LL128_LINE_BYTES;
    let (per_slot, regions) = match kind {
        // Rank r's chunk of ceil(lines / nranks) lines, in the RS and the AG region.
        NativeKind::AllreducePacket => {
            let total = input_bytes.div_ceil(line_payload.max(1));
            (total.div_ceil(n) * geometry::LL128_LINE_BYTES, 2)
        }
        NativeKind::AllreduceAllpairLl128 | NativeKind::AllgatherPacket => (lines(input_bytes), 1),
        NativeKind::ReducescatterPacket => (lines(input_bytes / n), 1),
        _ => (
            input_bytes.div_ceil(geometry::PACKET_PAYLOAD) * geometry::PACKET_BYTES,
            1,
        ),
    };
    (per_slot, (regions * n - 1) * slot_bytes + per_slot)
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
    let max_blocks = base.max_blocks(threads);
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
    let slot = slot_bytes(base.kind(), scratch.bytes, n);
    if tracing::enabled!(target: "mscclpp::algo", tracing::Level::DEBUG) {
        let payload = geometry::ll128_payload(base.vendor());
        let (used, reach) = footprint(base.kind(), slot, n, args.input_bytes, payload);
        tracing::debug!(
            target: "mscclpp::algo",
            "rank {}: {} of {} bytes, {} x {} threads on stream {:#x}; scratch part at {:#x}, \
             halves of {} bytes, slots of {slot} bytes, {used} used in each, the call reaches \
             {reach} bytes into its half (the device call counter picks the half)",
            comm.rank(),
            base.kind().name(),
            args.input_bytes,
            cfg.grid.0,
            cfg.block.0,
            args.stream.0,
            scratch.local,
            scratch.half_bytes(),
        );
    }
    let kernel_args = PacketArgs {
        input: args.input,
        output: args.output,
        count,
        peer_scratch: scratch.peers,
        local_scratch: scratch.local,
        slot_bytes: slot as u64,
        half_bytes: scratch.half_bytes() as u64,
        state: base.resources().state_ptr(),
        error_word: comm.error_word_device_ptr(),
        max_spin: 0,
        rank: comm.rank() as u32,
        nranks: n as u32,
    };
    base.launch(f, cfg, args, kernel_args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::max_input_bytes_on;
    use crate::resources::{scratch_bounds, ScratchPart, ScratchRegion};
    use mscclpp_core::gpu::GpuVendor;
    use mscclpp_kernels_cu::collectives::MAX_RANKS;

    const PACKET_KINDS: [NativeKind; 5] = [
        NativeKind::AllreduceAllpairPacket,
        NativeKind::AllreduceAllpairLl128,
        NativeKind::AllreducePacket,
        NativeKind::AllgatherPacket,
        NativeKind::ReducescatterPacket,
    ];

    /// Bytes of `part` in the default collection's scratch (independent of the private tail).
    fn part_bytes(part: ScratchPart) -> usize {
        let b = scratch_bounds(crate::DEFAULT_SCRATCH_BYTES, 0);
        match part {
            ScratchPart::Ll16 => b[1] - b[0],
            ScratchPart::Staging => b[2] - b[1],
            ScratchPart::Ll128 => b[3] - b[2],
        }
    }

    /// The packet kinds share a part and one call counter: consecutive calls (any kinds, e.g. the
    /// two-phase all-reduce then the packet all-gather of the 4-rank initall group) take
    /// alternate halves, so a peer still reading call c is safe from call c + 1 only if no call
    /// reaches past its half and no rank's lines spill into the next rank's slot. Checked at
    /// 2..=8 ranks for sizes up to the most each kind accepts (what the selector can give it).
    /// Slots and halves are whole lines (packets for LL16), so every LL128 user's flag words sit
    /// at the same places and a stale line of another kind carries an older call's flag.
    #[test]
    fn a_packet_call_stays_within_its_half_and_its_slots() {
        for n in 2..=MAX_RANKS {
            for kind in PACKET_KINDS {
                let part = kind
                    .scratch_part()
                    .expect("packet kinds use a scratch part");
                let bytes = part_bytes(part);
                let half = ScratchRegion {
                    peers: Default::default(),
                    local: 0,
                    bytes,
                }
                .half_bytes();
                let slot = slot_bytes(kind, bytes, n);
                let unit = if part == ScratchPart::Ll128 {
                    geometry::LL128_LINE_BYTES
                } else {
                    geometry::PACKET_BYTES
                };
                assert_eq!(slot % unit, 0, "{kind:?} at {n} ranks");
                assert_eq!(half % unit, 0, "{kind:?} at {n} ranks");
                assert!(2 * half <= bytes);
                for vendor in [GpuVendor::Nvidia, GpuVendor::Amd] {
                    let payload = geometry::ll128_payload(vendor);
                    let max = max_input_bytes_on(kind, bytes, n, vendor);
                    for input in [1, 7, 4 * 100_003, max / 2 + 1, max] {
                        // The reduce-scatter's input is whole chunks of whole elements.
                        let input = match kind {
                            NativeKind::ReducescatterPacket => (input / (4 * n)).max(1) * 4 * n,
                            _ => input,
                        };
                        if input > max {
                            continue;
                        }
                        let (used, reach) = footprint(kind, slot, n, input, payload);
                        let what = format!("{kind:?}, {n} ranks, {input} bytes, {vendor:?}");
                        assert!(used <= slot, "{what}: {used} bytes in a slot of {slot}");
                        assert!(
                            reach <= half,
                            "{what}: reaches {reach} into a half of {half}"
                        );
                    }
                }
            }
        }
    }

    /// The 4-rank initall group's two calls, in numbers: the two-phase all-reduce of 400,012
    /// bytes uses 834 lines of each of its 8 slots of 1.125 MiB, the all-gather 3,334 lines of
    /// each of its 4 slots of 2.25 MiB, both within a 9 MiB half of the 18 MiB LL128 part.
    #[test]
    fn the_initall_pair_at_four_ranks() {
        let bytes = part_bytes(ScratchPart::Ll128);
        assert_eq!(bytes, 18 << 20);
        let p = geometry::LL128_PAYLOAD;
        let ar = slot_bytes(NativeKind::AllreducePacket, bytes, 4);
        let ag = slot_bytes(NativeKind::AllgatherPacket, bytes, 4);
        assert_eq!((ar, ag), (1_179_648, 2_359_296));
        let (used, reach) = footprint(NativeKind::AllreducePacket, ar, 4, 400_012, p);
        assert_eq!(used, 834 * 128);
        assert_eq!(reach, 7 * ar + 834 * 128);
        let (used, reach) = footprint(NativeKind::AllgatherPacket, ag, 4, 400_012, p);
        assert_eq!(used, 3334 * 128);
        assert_eq!(reach, 3 * ag + 3334 * 128);
        assert!(reach <= 9 << 20);
    }
}
