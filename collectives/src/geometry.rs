//! Launch geometry and scratch layout: pure functions, unit-tested on the CPU.
//!
//! Every native kernel waits for peers' blocks, so its grid must be co-resident (see
//! collective_common.cuh). The kernels are built with `__launch_bounds__(1024, 1)` (at most 64
//! registers a thread), so an SM always holds 1024 of their threads: `sm * (1024 / threads)` blocks.

use mscclpp_core::gpu::LaunchConfig;
use mscclpp_core::{Error, Result};

/// Threads an SM is guaranteed to hold for our kernels (see the module docs).
pub const RESIDENT_THREADS_PER_SM: u32 = 1024;
/// Bytes of one LL16 packet and of its payload.
pub const PACKET_BYTES: usize = 16;
pub const PACKET_PAYLOAD: usize = 8;

/// Most blocks that are guaranteed co-resident with `threads` threads each on `sm` SMs.
pub fn resident_blocks(sm: u32, threads: u32) -> u32 {
    sm.max(1) * (RESIDENT_THREADS_PER_SM / threads.max(1)).max(1)
}

/// The launch geometry of one call: the caller's request where given (checked), else the defaults;
/// blocks are capped at `max_blocks` (co-residency and semaphores reserved).
pub fn launch_config(
    requested_blocks: Option<u32>,
    requested_threads: Option<u32>,
    default_blocks: u32,
    default_threads: u32,
    max_blocks: u32,
) -> Result<LaunchConfig> {
    let threads = requested_threads.unwrap_or(default_threads);
    if !(32..=1024).contains(&threads) || threads % 32 != 0 {
        return Err(Error::InvalidArgument(format!(
            "nthreads {threads}: must be a multiple of 32 in 32..=1024"
        )));
    }
    let blocks = match requested_blocks {
        Some(b) if b == 0 || b > max_blocks => {
            return Err(Error::InvalidArgument(format!(
                "nblocks {b}: must be in 1..={max_blocks} (blocks of every rank must be resident \
                 at once and each needs its own semaphores)"
            )))
        }
        Some(b) => b,
        None => default_blocks.clamp(1, max_blocks.max(1)),
    };
    Ok(LaunchConfig::linear(blocks, threads))
}

/// Scratch layout of the all-pair packet all-reduce: 2 parity halves x `nranks` slots.
pub fn allpair_slot_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    (scratch_bytes / (2 * nranks.max(1))) / PACKET_BYTES * PACKET_BYTES
}

/// Largest message (bytes per rank) the all-pair packet all-reduce takes with this scratch.
pub fn allpair_max_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    allpair_slot_bytes(scratch_bytes, nranks) / PACKET_BYTES * PACKET_PAYLOAD
}

/// Scratch layout of the two-phase packet all-reduce: 2 parity halves x 2 phases x `nranks` slots.
pub fn packet_slot_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    (scratch_bytes / (4 * nranks.max(1))) / PACKET_BYTES * PACKET_BYTES
}

/// Largest message the two-phase packet all-reduce takes: each rank's chunk of
/// ceil(packets / nranks) packets must fit one slot.
pub fn packet_max_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    nranks * (packet_slot_bytes(scratch_bytes, nranks) / PACKET_BYTES) * PACKET_PAYLOAD
}

/// Default blocks for the packet kernels: about one packet per thread, at most one block per SM
/// (latency matters more than bandwidth at these sizes).
pub fn packet_blocks(bytes: usize, threads: u32, sm: u32) -> u32 {
    let packets = bytes.div_ceil(PACKET_PAYLOAD).max(1);
    (packets.div_ceil(threads.max(1) as usize) as u64).clamp(1, sm.max(1) as u64) as u32
}

/// Default blocks for the bandwidth kernels: enough blocks that each handles at least 64 KiB,
/// up to `max_blocks`.
pub fn bandwidth_blocks(bytes: usize, max_blocks: u32) -> u32 {
    (bytes.div_ceil(64 << 10) as u64).clamp(1, max_blocks.max(1) as u64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(132, 512, 264)]
    #[case(132, 1024, 132)]
    #[case(132, 256, 528)]
    #[case(0, 2048, 1)]
    fn residency(#[case] sm: u32, #[case] threads: u32, #[case] want: u32) {
        assert_eq!(resident_blocks(sm, threads), want);
    }

    #[test]
    fn launch_requests_are_checked() {
        let c = launch_config(None, None, 500, 512, 264).expect("defaults");
        assert_eq!((c.grid.0, c.block.0), (264, 512));
        let c = launch_config(Some(3), Some(64), 500, 512, 264).expect("request");
        assert_eq!((c.grid.0, c.block.0), (3, 64));
        let e = launch_config(Some(265), None, 1, 512, 264).unwrap_err();
        assert!(e.to_string().contains("nblocks 265"), "{e}");
        assert!(launch_config(Some(0), None, 1, 512, 264).is_err());
        let e = launch_config(None, Some(100), 1, 512, 264).unwrap_err();
        assert!(e.to_string().contains("nthreads 100"), "{e}");
        assert!(launch_config(None, Some(2048), 1, 512, 264).is_err());
    }

    #[test]
    fn packet_capacities() {
        // 8 MiB scratch, 2 ranks: 2 MiB slots of packets -> 1 MiB of payload.
        assert_eq!(allpair_slot_bytes(8 << 20, 2), 2 << 20);
        assert_eq!(allpair_max_bytes(8 << 20, 2), 1 << 20);
        assert_eq!(packet_slot_bytes(8 << 20, 2), 1 << 20);
        assert_eq!(packet_max_bytes(8 << 20, 2), 1 << 20);
        // Slots stay whole packets whatever the scratch size.
        assert_eq!(allpair_slot_bytes(1000, 3) % PACKET_BYTES, 0);
        assert_eq!(packet_max_bytes(1000, 3), 3 * (80 / 16) * 8);
    }

    #[rstest]
    #[case(1, 512, 132, 1)]
    #[case(1024, 512, 132, 1)]
    #[case(64 << 10, 256, 132, 32)]
    #[case(1 << 20, 512, 132, 132)]
    fn packet_grid(#[case] bytes: usize, #[case] threads: u32, #[case] sm: u32, #[case] want: u32) {
        assert_eq!(packet_blocks(bytes, threads, sm), want);
    }

    #[test]
    fn bandwidth_grid() {
        assert_eq!(bandwidth_blocks(1, 256), 1);
        assert_eq!(bandwidth_blocks(1 << 20, 256), 16);
        assert_eq!(bandwidth_blocks(1 << 30, 256), 256);
    }
}
