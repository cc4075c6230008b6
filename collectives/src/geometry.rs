//! Launch geometry and scratch layout: pure functions, unit-tested on the CPU.
//!
//! Every native kernel waits for peers' blocks, so its grid must be co-resident (see
//! collective_common.cuh); [`Residency`] says how many blocks a rank's grid may have for that.

use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::{GpuVendor, LaunchConfig};
use mscclpp_core::{Error, Result};

/// Threads an SM is guaranteed to hold for our kernels (see [`Residency`]).
pub const RESIDENT_THREADS_PER_SM: u32 = 1024;
/// Bytes of one LL16 packet and of its payload.
pub const PACKET_BYTES: usize = 16;
pub const PACKET_PAYLOAD: usize = 8;

/// The SMs one rank's grids may occupy, and how full it may pack them: the one rule every grid
/// size of the native kernels, point-to-point and all-to-all is capped by.
///
/// - A rank that owns its device's context (one rank per process, MPS or not): the kernels are
///   built with `__launch_bounds__(1024, 1)` (at most 64 registers a thread), so each of its `sm`
///   SMs always holds 1024 of their threads: `sm * (1024 / threads)` blocks, whatever the block
///   scheduler does, since only this rank's one grid waits on them.
/// - Ranks of one process sharing the device (`ncclCommInitAll` on one GPU): their grids, of
///   different block sizes, are resident in one context at once, and the block scheduler places
///   blocks where it likes: 512-thread blocks spread one per SM leave no SM with room for a
///   1024-thread block, so packing each share exactly full can leave a peer's block unscheduled
///   while ours wait for it (until the device timeout). So each rank takes at most one block per
///   SM of its share: with every rank's grids together at most one block per SM of the device, a
///   block waiting to be scheduled always finds an empty SM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Residency {
    /// SMs this rank's grids are sized for (`Communicator::multiprocessors`, its share).
    pub sm: u32,
    /// Whether other ranks of this process share the device (`!Communicator::owns_device`).
    pub shares_device: bool,
    /// Whether other processes share the device through MPS (`DeviceProperties::mps_client`).
    pub mps: bool,
}

impl Residency {
    /// This rank's residency on `comm`'s device.
    pub fn of(comm: &Communicator) -> Result<Residency> {
        Ok(Residency {
            sm: comm.multiprocessors()?,
            shares_device: !comm.owns_device(),
            mps: comm.gpu().properties(comm.device())?.mps_client,
        })
    }

    /// Most blocks of `threads` threads one grid of this rank may have and still be resident with
    /// every peer's grid (see the type's docs).
    pub fn max_blocks(self, threads: u32) -> u32 {
        let sm = self.sm.max(1);
        if self.shares_device {
            sm
        } else {
            sm * (RESIDENT_THREADS_PER_SM / threads.max(1)).max(1)
        }
    }

    /// Most blocks of `threads` threads of one grid of this rank that wait for each other, so
    /// that every one of them must be resident at once (the execution-plan interpreter's replicas
    /// meet at barriers). Under MPS the SM count a process reads is its limit, not a promise: on
    /// one H200 shared by two ranks (66 SMs each), grids of up to 62 meeting blocks ran and grids
    /// of 63 and 64 waited for their last blocks until the device timeout (2026-11-29). There
    /// half of [`max_blocks`](Self::max_blocks) is kept to. The native kernels' blocks wait for
    /// the peers' blocks, not for each other, and keep to `max_blocks`: grids of the whole share
    /// passed there (the suites; `default_allreduce_rsag_zero_copy` with 66 blocks of 1024).
    pub fn max_meeting_blocks(self, threads: u32) -> u32 {
        let blocks = self.max_blocks(threads);
        if self.mps {
            (blocks / 2).max(1)
        } else {
            blocks
        }
    }
}

/// The launch geometry of one call: the caller's request where given (checked), else the defaults;
/// blocks are capped at `max_blocks` (co-residency and semaphores reserved). A request outside
/// them is [`Error::LaunchShape`]: the call may run with another shape.
pub fn launch_config(
    requested_blocks: Option<u32>,
    requested_threads: Option<u32>,
    default_blocks: u32,
    default_threads: u32,
    max_blocks: u32,
) -> Result<LaunchConfig> {
    let threads = requested_threads.unwrap_or(default_threads);
    if !(32..=1024).contains(&threads) || threads % 32 != 0 {
        return Err(Error::LaunchShape(format!(
            "nthreads {threads}: must be a multiple of 32 in 32..=1024"
        )));
    }
    let blocks = match requested_blocks {
        Some(b) if b == 0 || b > max_blocks => {
            return Err(Error::LaunchShape(format!(
                "nblocks {b}: must be in 1..={max_blocks} (blocks of every rank must be resident \
                 at once and each needs its own semaphores)"
            )))
        }
        Some(b) => b,
        None => default_blocks.clamp(1, max_blocks.max(1)),
    };
    Ok(LaunchConfig::linear(blocks, threads))
}

/// Bytes of the vectors the bandwidth kernels move (`uint4`); scratch slots are whole vectors.
pub const VECTOR_BYTES: usize = 16;

/// Bytes of one slot when `scratch_bytes` is cut into `regions` x `nranks` slots, rounded down to
/// whole 16-byte vectors (which are also whole LL16 packets).
pub fn slot_bytes(scratch_bytes: usize, nranks: usize, regions: usize) -> usize {
    (scratch_bytes / (regions.max(1) * nranks.max(1))) / VECTOR_BYTES * VECTOR_BYTES
}

/// Scratch layout of the all-pair packet all-reduce: 2 parity halves x `nranks` slots.
pub fn allpair_slot_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    slot_bytes(scratch_bytes, nranks, 2)
}

/// Largest message (bytes per rank) the all-pair packet all-reduce takes with this scratch.
pub fn allpair_max_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    allpair_slot_bytes(scratch_bytes, nranks) / PACKET_BYTES * PACKET_PAYLOAD
}

/// Bytes of an LL128 line (packet.cuh) and the payload it carries.
pub const LL128_LINE_BYTES: usize = 128;
pub const LL128_PAYLOAD: usize = 120;
/// The payload of an LL128 line on AMD GPUs: HIP promises only 8-byte single-copy atomicity, so
/// packet.cuh's HIP branch writes each lane's 16 bytes as two self-flagged 8-byte words.
pub const LL128_PAYLOAD_HIP: usize = 64;

/// Payload bytes of one LL128 line on `vendor`'s GPUs.
pub const fn ll128_payload(vendor: GpuVendor) -> usize {
    match vendor {
        GpuVendor::Nvidia => LL128_PAYLOAD,
        GpuVendor::Amd => LL128_PAYLOAD_HIP,
    }
}

/// Scratch layout of the two-phase packet all-reduce: 2 parity halves x 2 phases x `nranks` slots
/// of whole LL128 lines (every line 128-byte aligned: the scratch and the slots are).
pub fn packet_slot_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    slot_bytes(scratch_bytes, nranks, 4) / LL128_LINE_BYTES * LL128_LINE_BYTES
}

/// Largest message the two-phase packet all-reduce takes: each rank's chunk of
/// ceil(lines / nranks) lines must fit one slot.
pub fn packet_max_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    nranks * (packet_slot_bytes(scratch_bytes, nranks) / LL128_LINE_BYTES) * LL128_PAYLOAD
}

/// Scratch layout of the packet all-gather and reduce-scatter: 2 parity halves x `nranks` slots of
/// whole LL128 lines.
pub fn line_slot_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    slot_bytes(scratch_bytes, nranks, 2) / LL128_LINE_BYTES * LL128_LINE_BYTES
}

/// Payload bytes one slot of [`line_slot_bytes`] carries.
pub fn line_slot_payload(scratch_bytes: usize, nranks: usize) -> usize {
    line_slot_bytes(scratch_bytes, nranks) / LL128_LINE_BYTES * LL128_PAYLOAD
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

/// Launch parameters of a scratch pipeline kernel (allreduce_rsag, allreduce_fullmesh,
/// allgather_fullmesh; "Scratch pipelines" in collective_common.cuh).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineGeometry {
    /// Stride between the slots of one region.
    pub slot_bytes: u64,
    /// Stride between the two double-buffered halves; 0 for the single-buffered rsag.
    pub half_bytes: u64,
    /// The kernel's step: elements of each rank's chunk per step (rsag), elements of the window
    /// per step (full-mesh all-reduce) or bytes per step (all-gather, `elem_bytes` = 1).
    pub step: u64,
}

impl PipelineGeometry {
    /// Steps the kernel runs for `count` elements.
    pub fn steps(&self, count: usize, nranks: usize, rsag: bool) -> u64 {
        let window = if rsag {
            self.step * nranks.max(1) as u64
        } else {
            self.step
        };
        (count as u64).div_ceil(window.max(1))
    }
}

fn vec_elems(elem_bytes: usize) -> Result<u64> {
    if elem_bytes == 0 || VECTOR_BYTES % elem_bytes != 0 {
        return Err(Error::InvalidArgument(format!(
            "element size {elem_bytes}: the scratch pipelines move 16-byte vectors of whole elements"
        )));
    }
    Ok((VECTOR_BYTES / elem_bytes) as u64)
}

/// Scratch regions of an rsag layout: `[RS][AG]`, doubled when pipelined.
pub const fn rsag_regions(pipelined: bool) -> usize {
    if pipelined {
        4
    } else {
        2
    }
}

/// Largest input (bytes per rank) the single-buffered rsag takes: every rank's chunk must fit a
/// slot, and the chunks are the message cut into `nranks` runs of whole vectors.
pub fn rsag_max_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    nranks.max(1) * slot_bytes(scratch_bytes, nranks, rsag_regions(false))
}

/// Geometry of the rsag kernel for `count` elements of `elem_bytes`: chunks of whole vectors, one
/// per rank. Single-buffered (`pipelined` false) it is one step and the message must fit
/// ([`rsag_max_bytes`]); pipelined, chunks are capped at a slot and the halves alternate.
pub fn rsag_geometry(
    count: usize,
    elem_bytes: usize,
    scratch_bytes: usize,
    nranks: usize,
    pipelined: bool,
) -> Result<PipelineGeometry> {
    let n = nranks.max(1);
    let slot = slot_bytes(scratch_bytes, n, rsag_regions(pipelined));
    let step = rsag_chunk(count, elem_bytes, scratch_bytes, slot, n, pipelined)?;
    Ok(PipelineGeometry {
        slot_bytes: slot as u64,
        half_bytes: if pipelined { 2 * (n * slot) as u64 } else { 0 },
        step,
    })
}

/// Geometry of `allreduce_rsag_push` (`default_allreduce_rsag_push`) for `count` elements of
/// `elem_bytes`: the pipelined rsag's chunks, with halves of `nranks - 1` receive slots only (a
/// rank's own chunk never goes through its scratch, and the reduced chunks go straight into the
/// peers' outputs), so each step carries more than twice the pipelined rsag's in the same scratch.
pub fn push_geometry(
    count: usize,
    elem_bytes: usize,
    scratch_bytes: usize,
    nranks: usize,
) -> Result<PipelineGeometry> {
    let n = nranks.max(1);
    let peers = (n - 1).max(1);
    let slot = slot_bytes(scratch_bytes, peers, 2);
    let step = rsag_chunk(count, elem_bytes, scratch_bytes, slot, n, true)?;
    Ok(PipelineGeometry {
        slot_bytes: slot as u64,
        half_bytes: (peers * slot) as u64,
        step,
    })
}

/// Elements of each rank's chunk per step of the rsag kernels: `count` cut into `nranks` runs of
/// whole vectors, capped at a `slot`-byte slot when `pipelined`, else refused beyond it.
fn rsag_chunk(
    count: usize,
    elem_bytes: usize,
    scratch_bytes: usize,
    slot: usize,
    nranks: usize,
    pipelined: bool,
) -> Result<u64> {
    let vec = vec_elems(elem_bytes)?;
    let slot_vecs = (slot / VECTOR_BYTES) as u64;
    if slot_vecs == 0 {
        return Err(Error::InvalidArgument(format!(
            "a scratch of {scratch_bytes} bytes holds no 16-byte slot for {nranks} ranks"
        )));
    }
    let per_vecs = (count as u64).div_ceil(vec).div_ceil(nranks as u64).max(1);
    let per_vecs = if pipelined {
        per_vecs.min(slot_vecs)
    } else if per_vecs > slot_vecs {
        return Err(Error::InvalidArgument(format!(
            "{count} elements of {elem_bytes} bytes need chunks of {} bytes per rank, more than the \
             scratch slot of {slot} bytes (the pipelined rsag takes any size)",
            per_vecs * VECTOR_BYTES as u64
        )));
    } else {
        per_vecs
    };
    Ok(per_vecs * vec)
}

/// Geometry of the full-mesh kernels (all-reduce: elements; all-gather: `elem_bytes` = 1, bytes):
/// 2 halves x `nranks` slots, each step a window of up to one slot.
pub fn fullmesh_geometry(
    count: usize,
    elem_bytes: usize,
    scratch_bytes: usize,
    nranks: usize,
) -> Result<PipelineGeometry> {
    let vec = vec_elems(elem_bytes)?;
    let n = nranks.max(1);
    let slot = slot_bytes(scratch_bytes, n, 2);
    let slot_vecs = (slot / VECTOR_BYTES) as u64;
    if slot_vecs == 0 {
        return Err(Error::InvalidArgument(format!(
            "a scratch of {scratch_bytes} bytes holds no 16-byte slot for {n} ranks"
        )));
    }
    let vecs = (count as u64).div_ceil(vec).clamp(1, slot_vecs);
    Ok(PipelineGeometry {
        slot_bytes: slot as u64,
        half_bytes: (n * slot) as u64,
        step: vecs * vec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    /// A process that owns its device packs each SM full; under MPS, blocks that meet keep to
    /// half of what its SM limit would hold.
    #[rstest]
    #[case(132, 512, false, 264, 264)]
    #[case(132, 1024, false, 132, 132)]
    #[case(132, 256, false, 528, 528)]
    #[case(0, 2048, false, 1, 1)]
    #[case(66, 1024, true, 66, 33)]
    #[case(66, 512, true, 132, 66)]
    #[case(33, 1024, true, 33, 16)]
    #[case(1, 1024, true, 1, 1)]
    fn owned_devices_pack_each_sm_full_and_meet_within_half_under_mps(
        #[case] sm: u32,
        #[case] threads: u32,
        #[case] mps: bool,
        #[case] blocks: u32,
        #[case] meeting: u32,
    ) {
        let r = Residency {
            sm,
            shares_device: false,
            mps,
        };
        assert_eq!(r.max_blocks(threads), blocks);
        assert_eq!(r.max_meeting_blocks(threads), meeting);
    }

    /// Ranks of one process sharing a 132-SM device (`ncclCommInitAll`): whatever the block size,
    /// each rank's grid takes at most one block per SM of its share, so all ranks' grids together
    /// hold at most one block per SM of the device and a block never waits for room.
    #[rstest]
    #[case(2)]
    #[case(3)]
    #[case(4)]
    #[case(8)]
    fn ranks_sharing_a_device_take_one_block_per_sm(#[case] sharers: usize) {
        let sm = mscclpp_core::topology::sm_share(132, sharers);
        let r = Residency {
            sm,
            shares_device: true,
            mps: false,
        };
        for threads in [32, 256, 512, 1024] {
            assert_eq!(r.max_blocks(threads), sm, "{threads} threads");
            assert!(sharers as u32 * r.max_blocks(threads) <= 132);
        }
        // A request above the cap is refused, naming the limit; defaults are clamped to it.
        let e = launch_config(Some(sm + 1), Some(512), 1, 512, r.max_blocks(512)).unwrap_err();
        assert!(e.to_string().contains(&format!("1..={sm}")), "{e}");
        let c = launch_config(None, None, 4 * sm, 512, r.max_blocks(512)).expect("default");
        assert_eq!(c.grid.0, sm);
    }

    #[test]
    fn launch_requests_are_checked() {
        let c = launch_config(None, None, 500, 512, 264).expect("defaults");
        assert_eq!((c.grid.0, c.block.0), (264, 512));
        let c = launch_config(Some(3), Some(64), 500, 512, 264).expect("request");
        assert_eq!((c.grid.0, c.block.0), (3, 64));
        // Every refusal is a launch shape (another may run), naming the value.
        for (blocks, threads, named) in [
            (Some(265), None, "nblocks 265"),
            (Some(0), None, "nblocks 0"),
            (None, Some(100), "nthreads 100"),
            (None, Some(2048), "nthreads 2048"),
            (Some(3), Some(16), "nthreads 16"),
        ] {
            let e = launch_config(blocks, threads, 1, 512, 264).unwrap_err();
            assert!(matches!(e, Error::LaunchShape(_)), "{e:?}");
            assert!(e.to_string().contains(named), "{e}");
        }
    }

    #[test]
    fn packet_capacities() {
        // 8 MiB scratch, 2 ranks: 2 MiB slots of packets -> 1 MiB of payload.
        assert_eq!(allpair_slot_bytes(8 << 20, 2), 2 << 20);
        assert_eq!(allpair_max_bytes(8 << 20, 2), 1 << 20);
        assert_eq!(packet_slot_bytes(8 << 20, 2), 1 << 20);
        assert_eq!(packet_max_bytes(8 << 20, 2), 2 * (1 << 20) / 128 * 120);
        // Slots stay whole packets whatever the scratch size.
        assert_eq!(allpair_slot_bytes(1000, 3) % PACKET_BYTES, 0);
        assert_eq!(packet_max_bytes(1000, 3), 0);
        assert_eq!(packet_slot_bytes(3 * 4 * 1000, 3), 896);
        assert_eq!(packet_max_bytes(3 * 4 * 1000, 3), 3 * 7 * 120);
        assert_eq!(line_slot_bytes(8 << 20, 2), 2 << 20);
        assert_eq!(line_slot_payload(8 << 20, 2), (2 << 20) / 128 * 120);
        assert_eq!(line_slot_bytes(3 * 2 * 1000, 3) % LL128_LINE_BYTES, 0);
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

    #[test]
    fn slots_are_whole_vectors() {
        assert_eq!(slot_bytes(8 << 20, 2, 2), 2 << 20);
        assert_eq!(slot_bytes(8 << 20, 8, 4), 256 << 10);
        assert_eq!(slot_bytes(1000, 3, 2), 160);
        assert_eq!(slot_bytes(1000, 0, 0), 992);
        assert_eq!(slot_bytes(15, 1, 1), 0);
    }

    #[rstest]
    // 8 MiB, 2 ranks, single buffer: [RS][AG] x 2 slots of 2 MiB -> 4 MiB messages.
    #[case(8 << 20, 2, 4 << 20)]
    #[case(8 << 20, 8, 4 << 20)]
    #[case(1000, 3, 480)]
    fn rsag_capacity(#[case] scratch: usize, #[case] n: usize, #[case] want: usize) {
        assert_eq!(rsag_max_bytes(scratch, n), want);
        // At the limit the single-buffered kernel takes it in one step; one element more is refused.
        let g = rsag_geometry(want / 4, 4, scratch, n, false).expect("fits");
        assert_eq!(g.steps(want / 4, n, true), 1);
        assert!(g.step * 4 <= g.slot_bytes);
        let e = rsag_geometry(want / 4 + 1, 4, scratch, n, false).unwrap_err();
        assert!(e.to_string().contains("pipelined"), "{e}");
    }

    #[rstest]
    #[case(1, 4, 2)]
    #[case(1, 1, 8)]
    #[case(3, 2, 3)]
    #[case(1023, 8, 5)]
    #[case(1 << 20, 2, 7)]
    fn rsag_chunks_cover_the_message(#[case] count: usize, #[case] es: usize, #[case] n: usize) {
        let g = rsag_geometry(count, es, 8 << 20, n, false).expect("fits");
        assert_eq!(g.half_bytes, 0);
        // Chunks of whole vectors, n of them cover the message, and one vector less would not.
        let vec = VECTOR_BYTES / es;
        assert_eq!(g.step as usize % vec, 0);
        assert!(g.step as usize * n >= count);
        assert!((g.step as usize / vec - 1) * n < count.div_ceil(vec));
        assert_eq!(g.steps(count, n, true), 1);
    }

    #[rstest]
    #[case(64 << 20, 2, 2, 8 << 20)]
    #[case((64 << 20) + 2, 2, 8, 8 << 20)]
    #[case(1, 1, 8, 8 << 20)]
    #[case(1 << 30, 4, 3, 1 << 20)]
    fn rsag_pipeline_steps(
        #[case] bytes: usize,
        #[case] es: usize,
        #[case] n: usize,
        #[case] scratch: usize,
    ) {
        let count = bytes / es;
        let g = rsag_geometry(count, es, scratch, n, true).expect("any size");
        let slot = slot_bytes(scratch, n, 4) as u64;
        assert_eq!(g.slot_bytes, slot);
        // Both halves of [RS][AG] fit the scratch.
        assert_eq!(g.half_bytes, 2 * n as u64 * slot);
        assert!(2 * g.half_bytes <= scratch as u64);
        assert!(g.step * es as u64 <= slot);
        let steps = g.steps(count, n, true);
        assert!(steps * g.step * n as u64 >= count as u64);
        assert!((steps - 1) * g.step * (n as u64) < count as u64);
    }

    #[rstest]
    #[case(1, 4, 2, 4)]
    #[case(5, 1, 8, 16)]
    #[case(1 << 20, 2, 2, 1 << 20)]
    #[case(1 << 22, 4, 4, 1 << 18)]
    fn fullmesh_windows(
        #[case] count: usize,
        #[case] es: usize,
        #[case] n: usize,
        #[case] want_step: u64,
    ) {
        let scratch = 8 << 20;
        let g = fullmesh_geometry(count, es, scratch, n).expect("geometry");
        assert_eq!(g.step, want_step);
        assert_eq!(g.half_bytes, n as u64 * g.slot_bytes);
        assert!(2 * g.half_bytes <= scratch as u64);
        assert!(g.step * es as u64 <= g.slot_bytes);
        assert_eq!(g.step * es as u64 % VECTOR_BYTES as u64, 0);
        let steps = g.steps(count, n, false);
        assert!(steps * g.step >= count as u64 && (steps - 1) * g.step < count as u64);
    }

    /// `block_range` of collective_common.cuh: block `b` of `blocks` takes items [begin, end) of
    /// `n`, in whole groups of `align`.
    fn block_range(n: u64, align: u64, blocks: u64, b: u64) -> (u64, u64) {
        let per = n.div_ceil(align).div_ceil(blocks);
        let begin = (b * per * align).min(n);
        (begin, (begin + per * align).min(n))
    }

    /// Sorted, the intervals tile [0, end): no gap, no overlap.
    fn assert_tiles(mut v: Vec<(u64, u64)>, end: u64, what: &str) {
        v.retain(|&(lo, hi)| lo < hi);
        v.sort_unstable();
        let mut at = 0;
        for (lo, hi) in v {
            assert_eq!(lo, at, "{what}: gap or overlap at {at}");
            at = hi;
        }
        assert_eq!(at, end, "{what}: ends at {at}, not {end}");
    }

    /// `allreduce_rsag_push`'s indexing, mirrored from allreduce.cu (`chunk`, `push_slot`,
    /// `pipeline_half`) over the geometry the host launches it with (`scratch` = both halves of
    /// the staging part, `half_bytes` as `ScratchRegion::half_bytes`): every element of the message
    /// is reduced by exactly one (step, owner, block); what each sender's block writes into a
    /// receiver's scratch in a step lies inside that step's half, and no two (sender, block) pairs
    /// share a byte there; consecutive steps, and the last step of a call and the first of the
    /// next, use different halves. Odd counts, counts not divisible by the ranks or the vector, one
    /// element, grids of 1, 3 and 128 blocks, and a part small enough for many steps.
    #[rstest]
    fn push_steps_cover_the_message_once_inside_their_half(
        #[values(2, 3, 4, 5, 6, 7, 8)] n: usize,
        #[values(1, 2, 4, 8)] es: usize,
    ) {
        let default_part = 7 << 20;
        // Three vectors per slot and change: nothing divides evenly.
        let tiny_part = 2 * ((n - 1) * 3 * VECTOR_BYTES + 40) + 256;
        let vec = (VECTOR_BYTES / es) as u64;
        for part in [default_part, tiny_part] {
            let half_bytes = (part / 2 / 128 * 128) as u64;
            let window_of = |count: usize| {
                let g = push_geometry(count, es, 2 * half_bytes as usize, n).expect("geometry");
                g.step * n as u64
            };
            let big = window_of(usize::MAX / 64) as usize;
            let counts = [
                1,
                2,
                3,
                vec as usize * n - 1,
                vec as usize * n + 1,
                1023,
                4099,
                2 * big + 5,
                3 * big - 1,
            ];
            for count in counts {
                let g = push_geometry(count, es, 2 * half_bytes as usize, n).expect("geometry");
                let (per, slot) = (g.step, g.slot_bytes);
                assert_eq!(per % vec, 0, "whole vectors");
                assert!(per * es as u64 <= slot, "a chunk fits its slot");
                assert_eq!(slot % VECTOR_BYTES as u64, 0);
                assert!(g.half_bytes <= half_bytes, "{n} ranks, part {part}");
                let window = per * n as u64;
                let steps = g.steps(count, n, true);
                assert_eq!(steps, (count as u64).div_ceil(window));
                for blocks in [1u64, 3, 128] {
                    let mut reduced = Vec::new();
                    for k in 0..steps {
                        // Per receiver: the bytes of its half written in step k.
                        let mut written = vec![Vec::new(); n];
                        for b in 0..blocks {
                            let (b0, b1) = block_range(per, vec, blocks, b);
                            for q in 0..n as u64 {
                                let base = k * window + q * per;
                                let lo = (base + b0).min(count as u64);
                                let hi = (base + b1).min(count as u64);
                                reduced.push((lo, hi));
                                if lo >= hi {
                                    continue;
                                }
                                for s in (0..n as u64).filter(|&s| s != q) {
                                    let slot_index = if s < q { s } else { s - 1 };
                                    assert!(slot_index < n as u64 - 1);
                                    let at = slot_index * slot + b0 * es as u64;
                                    let end = at + (hi - lo) * es as u64;
                                    assert!(end <= half_bytes, "step {k} sender {s}");
                                    written[q as usize].push((at, end));
                                }
                            }
                        }
                        for (q, mut w) in written.into_iter().enumerate() {
                            w.sort_unstable();
                            for pair in w.windows(2) {
                                assert!(pair[0].1 <= pair[1].0, "receiver {q}, step {k}");
                            }
                        }
                    }
                    let what = format!("{n} ranks, {es}-byte elements, {count}, {blocks} blocks");
                    assert_tiles(reduced, count as u64, &what);
                }
                // The kernel's half of step k is ((calls + k) & 1) * half_bytes, and it advances
                // the call counter by `steps`: neighbours in the sequence of steps, within a call
                // or across two, never share a half.
                for calls in [0u64, 1, 7] {
                    let half = |c: u64, k: u64| ((c + k) & 1) * half_bytes;
                    for k in 1..steps {
                        assert_ne!(half(calls, k), half(calls, k - 1));
                    }
                    assert_ne!(half(calls + steps, 0), half(calls, steps - 1));
                    assert!(half(calls, 1) + half_bytes <= part as u64);
                }
            }
        }
    }

    #[test]
    fn push_steps_are_larger_than_the_pipelined_rsag() {
        // Same scratch: rsag's halves hold [RS][AG] x n slots, push's n - 1 slots.
        for n in 2..=8 {
            let scratch = 7 << 20;
            let rsag = rsag_geometry(1 << 30, 2, scratch, n, true).expect("rsag");
            let push = push_geometry(1 << 30, 2, scratch, n).expect("push");
            assert!(push.step > 2 * rsag.step, "{n} ranks");
            assert!(push.steps(1 << 30, n, true) < rsag.steps(1 << 30, n, true) / 2);
        }
        // 2 ranks: one slot of a whole half (3.5 MiB of a 7 MiB part).
        let g = push_geometry(1 << 30, 2, 7 << 20, 2).expect("push");
        assert_eq!(g.slot_bytes, 7 << 19);
        assert!(push_geometry(1, 4, 2 * 3 * 16 - 1, 4).is_err());
        assert!(push_geometry(1, 4, 2 * 3 * 16, 4).is_ok());
        assert!(push_geometry(1, 3, 1 << 20, 4).is_err());
    }

    #[test]
    fn pipeline_geometry_refuses_what_it_cannot_hold() {
        assert!(fullmesh_geometry(1, 4, 16 * 2 * 8 - 1, 8).is_err());
        assert!(fullmesh_geometry(1, 4, 16 * 2 * 8, 8).is_ok());
        assert!(rsag_geometry(1, 4, 16 * 4 * 8 - 1, 8, true).is_err());
        assert!(rsag_geometry(1, 3, 1 << 20, 2, true).is_err());
        assert!(fullmesh_geometry(1, 0, 1 << 20, 2).is_err());
    }
}
