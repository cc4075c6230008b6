//! The host half of the point-to-point protocol (kernels-cu/src/kernels/p2p.cu), pure and
//! CPU-tested: the engine region's layout (slots, chunk size, offsets), the chunk count of a
//! message, and a group's plan: validation, self send/recv pairing, per-(peer, direction) message
//! and chunk offsets, and the split of the grid among the ops.

use super::{P2pKind, P2pOp, ZERO_COPY_MIN_BYTES};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::p2p::{P2pOpArgs, KIND_COPY, KIND_RECV, KIND_SEND, MAX_OPS, POSTS};

/// Data bytes of one rank's region over all its incoming channels: 896 KiB keeps the engine under
/// 1 MiB per rank at 8 ranks (7 channels x 8 slots x 16 KiB plus headers, acks and posts).
pub const DATA_BUDGET: usize = 896 << 10;
/// Chunk (slot) size bounds. One block moves one chunk at a time, a small part of a link's
/// bandwidth, so bandwidth comes from many blocks, and so from many slots within the budget: 16 KiB chunks still cost little in flags
/// (a header store and a credit per chunk), and below 4 KiB they would cost more than they move.
pub const MIN_SLOT_BYTES: usize = 4 << 10;
pub const MAX_SLOT_BYTES: usize = 16 << 10;
/// Slots of one channel at least (a small budget per peer shrinks the chunks first) and at most
/// (beyond, the blocks of one op would crowd out the other ops of a group).
pub const MIN_SLOTS: usize = 8;
pub const MAX_SLOTS: usize = 64;
/// A message's byte count travels in the low 40 bits of a post word.
pub const MAX_MESSAGE_BYTES: usize = (1 << 40) - 1;
/// Bytes of a slot header (`ready`, `bytes`).
const HEADER_BYTES: usize = 16;
/// Bytes of a channel's zero-copy words (`P2pZeroCopy`: the receiver's word, the sender's count).
const ZERO_COPY_BYTES: usize = 16;

/// Where things are in each rank's region (the same on every rank of a communicator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Slots of one channel (sender, receiver): chunks in flight between them.
    pub slots: usize,
    pub slot_bytes: usize,
    pub headers_offset: usize,
    pub acks_offset: usize,
    pub posts_offset: usize,
    /// The zero-copy words, one pair per peer index (see kernels/p2p.cu, "Zero copy").
    pub zc_offset: usize,
    /// Bytes of the region every peer maps.
    pub region_bytes: usize,
}

/// The region layout for `nranks` ranks: per peer index, `slots` data slots, then the slot
/// headers, the acks (credits this rank's receivers return), the posts (what they expect) and
/// the zero-copy words. The
/// budget per peer is cut into as many slots of at most `MAX_SLOT_BYTES` as fit (56 at 2 ranks, 8
/// at 8), chunks shrinking only to keep `MIN_SLOTS`.
pub fn layout(nranks: usize) -> Layout {
    let npeers = nranks.saturating_sub(1).max(1);
    let per_peer = DATA_BUDGET / npeers;
    let slot_bytes = (per_peer / MIN_SLOTS / MIN_SLOT_BYTES * MIN_SLOT_BYTES)
        .clamp(MIN_SLOT_BYTES, MAX_SLOT_BYTES);
    let slots = (per_peer / slot_bytes).clamp(1, MAX_SLOTS);
    let headers_offset = npeers * slots * slot_bytes;
    let acks_offset = headers_offset + npeers * slots * HEADER_BYTES;
    let posts_offset = acks_offset + npeers * slots * 8;
    let zc_offset = posts_offset + npeers * POSTS * 8;
    Layout {
        slots,
        slot_bytes,
        headers_offset,
        acks_offset,
        posts_offset,
        zc_offset,
        region_bytes: zc_offset + npeers * ZERO_COPY_BYTES,
    }
}

/// Most threads of a `p2p_group` block (the engine counts its grid's residency at this size).
pub const MAX_BLOCK_THREADS: u32 = 512;
/// Fewest: the kernel's entry reads every op's counters with one thread an op.
pub const MIN_BLOCK_THREADS: u32 = MAX_OPS as u32;
const _: () = assert!(MIN_BLOCK_THREADS % 32 == 0 && MIN_BLOCK_THREADS <= MAX_BLOCK_THREADS);
/// Bytes of a chunk one thread holds (p2p.cu's `P2pWords`: two 16-byte words).
const THREAD_BYTES: usize = 32;

/// Threads of every block of a planned group: enough that a thread holds at most
/// `THREAD_BYTES` of the largest piece one block moves at once (a chunk, or a copy's share), a
/// power of two within [`MIN_BLOCK_THREADS`]..=[`MAX_BLOCK_THREADS`]. Small messages get small
/// blocks, whose barriers cost less (a small sendrecv measured faster with 64-thread blocks than
/// with 512).
pub fn block_threads(ops: &[P2pOpArgs], layout: &Layout) -> u32 {
    let largest = ops
        .iter()
        .map(|o| {
            let bytes = o.bytes as usize;
            if o.kind == KIND_COPY {
                bytes.div_ceil(o.nblocks.max(1) as usize)
            } else {
                bytes.min(layout.slot_bytes)
            }
        })
        .max()
        .unwrap_or(0);
    let wanted = u32::try_from(largest.div_ceil(THREAD_BYTES)).unwrap_or(u32::MAX);
    wanted
        .checked_next_power_of_two()
        .unwrap_or(MAX_BLOCK_THREADS)
        .clamp(MIN_BLOCK_THREADS, MAX_BLOCK_THREADS)
}

/// Chunks of a message of `bytes`: at least one, so a zero-byte message still matches.
pub fn chunks(bytes: usize, slot_bytes: usize) -> u64 {
    bytes.div_ceil(slot_bytes).max(1) as u64
}

impl Layout {
    /// Most blocks one op takes: half the slots, so that each block has two slots of its own (its
    /// chunks j, j + nblocks, ... alternate between them) and writes one while the receiver
    /// drains the other, instead of waiting out a whole round trip for the credit of one.
    pub fn blocks_per_op(&self) -> u32 {
        (self.slots / 2).max(1) as u32
    }
}

/// Most blocks of a send that may go zero copy, one per 128 KiB: it writes straight into the
/// receiver's buffer, so its blocks share no slots, and NVLink takes more writers than the slots'
/// blocks.
pub const ZERO_COPY_SEND_BLOCKS: u32 = 64;

/// Blocks an op would like: one per chunk up to [`Layout::blocks_per_op`] (a block moves one
/// chunk at a time); a self copy, one per 256 KiB up to the same bound; a send that may go zero
/// copy, at least that and up to [`ZERO_COPY_SEND_BLOCKS`].
fn wanted_blocks(op: &P2pOpArgs, layout: &Layout) -> u32 {
    let bytes = op.bytes as usize;
    let units = if op.kind == KIND_COPY {
        bytes.div_ceil(256 << 10).max(1) as u64
    } else {
        chunks(bytes, layout.slot_bytes)
    };
    let slotted = units.min(u64::from(layout.blocks_per_op())) as u32;
    if op.kind == KIND_SEND && bytes >= ZERO_COPY_MIN_BYTES {
        let direct = u32::try_from(bytes.div_ceil(128 << 10)).unwrap_or(u32::MAX);
        slotted.max(direct.min(ZERO_COPY_SEND_BLOCKS))
    } else {
        slotted
    }
}

/// Checks every op of a group of `rank` of `nranks` on its own: its peer is a rank, its size fits a
/// post word, and it has a buffer if it carries bytes. Errors name the rank and the op.
pub(crate) fn check_ops(rank: usize, nranks: usize, ops: &[P2pOp]) -> Result<()> {
    for (i, op) in ops.iter().enumerate() {
        let what = || format!("rank {rank}: op {i} ({} peer {})", op.kind, op.peer);
        if op.peer >= nranks {
            return Err(Error::InvalidArgument(format!(
                "{}: peer {} is not a rank of this communicator (0..{nranks})",
                what(),
                op.peer
            )));
        }
        if op.bytes > MAX_MESSAGE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "{}: {} bytes exceed the largest message ({MAX_MESSAGE_BYTES})",
                what(),
                op.bytes
            )));
        }
        if op.bytes > 0 && op.ptr == 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: null buffer for {} bytes",
                what(),
                op.bytes
            )));
        }
    }
    Ok(())
}

/// The sends of `rank`'s group to itself, in order: the k-th is the source of the group's k-th
/// receive from itself ([`self_copy_source`]). Errors when the counts differ.
pub(crate) fn self_sends(rank: usize, ops: &[P2pOp]) -> Result<Vec<&P2pOp>> {
    let sends: Vec<&P2pOp> = ops
        .iter()
        .filter(|o| o.peer == rank && o.kind == P2pKind::Send)
        .collect();
    let recvs = ops
        .iter()
        .filter(|o| o.peer == rank && o.kind == P2pKind::Recv)
        .count();
    if sends.len() != recvs {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: a group with {} sends to itself and {recvs} receives from itself \
             (each self send needs its self receive in the same group)",
            sends.len()
        )));
    }
    Ok(sends)
}

/// The source of the copy that a receive of `rank` from itself becomes, `send` being its send
/// (the next of [`self_sends`]); errors naming both sizes when they differ.
pub(crate) fn self_copy_source(rank: usize, send: Option<&P2pOp>, recv: &P2pOp) -> Result<u64> {
    let send =
        send.ok_or_else(|| Error::Internal(format!("rank {rank}: self receive without its send")))?;
    if send.bytes != recv.bytes {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: send/recv to itself with mismatched sizes: the send has {} \
             bytes, the receive {}",
            send.bytes, recv.bytes
        )));
    }
    Ok(send.ptr)
}

/// Refuses a group of more than [`MAX_OPS`] ops after pairing those of `rank` to itself.
pub(crate) fn check_op_count(rank: usize, ops: usize) -> Result<()> {
    if ops > MAX_OPS {
        return Err(Error::Unsupported(format!(
            "rank {rank}: a group of {ops} sends and receives (after pairing those to itself); one \
             group takes at most {MAX_OPS}"
        )));
    }
    Ok(())
}

/// The kernel's ops for one group of `rank` of `nranks`, in the caller's order (self sends and
/// receives paired into copies at the receive), with offsets and blocks filled in; the grid is the
/// last op's `first_block + nblocks` (at most `max_blocks`). Errors name the rank and the op.
pub fn plan(
    rank: usize,
    nranks: usize,
    ops: &[P2pOp],
    layout: &Layout,
    max_blocks: u32,
) -> Result<Vec<P2pOpArgs>> {
    check_ops(rank, nranks, ops)?;
    let mut self_pairs = self_sends(rank, ops)?.into_iter();
    let mut out = Vec::with_capacity(ops.len());
    // Per (peer, direction): ops and chunks so far in this group.
    let mut seen = vec![[(0u32, 0u64); 2]; nranks];
    for op in ops {
        let mut args = P2pOpArgs {
            ptr: op.ptr,
            bytes: op.bytes as u64,
            peer: op.peer as u32,
            ..P2pOpArgs::default()
        };
        if op.peer == rank {
            if op.kind == P2pKind::Send {
                continue;
            }
            args.kind = KIND_COPY;
            args.aux = self_copy_source(rank, self_pairs.next(), op)?;
        } else {
            let dir = match op.kind {
                P2pKind::Send => 0,
                P2pKind::Recv => 1,
            };
            args.kind = if dir == 0 { KIND_SEND } else { KIND_RECV };
            let (msgs, chunk_total) = &mut seen[op.peer][dir];
            args.msg_offset = *msgs;
            args.chunk_offset = *chunk_total;
            *msgs += 1;
            *chunk_total += chunks(op.bytes, layout.slot_bytes);
        }
        out.push(args);
    }
    // The kernel advances each channel's counters from its last op (p2p.cu, p2p_finish).
    for i in 0..out.len() {
        let (kind, peer) = (out[i].kind, out[i].peer);
        out[i].last = u32::from(
            kind != KIND_COPY
                && !out[i + 1..]
                    .iter()
                    .any(|o| o.kind == kind && o.peer == peer),
        );
    }
    check_op_count(rank, out.len())?;
    if out.len() > max_blocks as usize {
        return Err(Error::Unsupported(format!(
            "rank {rank}: a group of {} sends and receives needs one resident block each, and this \
             GPU holds {max_blocks}",
            out.len()
        )));
    }
    let mut blocks: Vec<u32> = out.iter().map(|o| wanted_blocks(o, layout)).collect();
    while blocks.iter().sum::<u32>() > max_blocks {
        if let Some(most) = blocks.iter_mut().max() {
            *most -= 1;
        }
    }
    let mut first = 0;
    for (op, n) in out.iter_mut().zip(blocks) {
        op.first_block = first;
        op.nblocks = n;
        first += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    /// A layout of 8 slots of 4 KiB: ops of a few chunks show the planning rules.
    fn small() -> Layout {
        Layout {
            slots: 8,
            slot_bytes: 4096,
            ..layout(3)
        }
    }

    fn op(kind: P2pKind, peer: usize, bytes: usize) -> P2pOp {
        P2pOp {
            kind,
            peer,
            ptr: 0x1000 + peer as u64,
            bytes,
        }
    }

    #[rstest]
    #[case(2, 16 << 10, 56)]
    #[case(3, 16 << 10, 28)]
    #[case(4, 16 << 10, 18)]
    #[case(8, 16 << 10, 8)]
    #[case(1, 16 << 10, 56)]
    fn layout_fits_the_budget(#[case] nranks: usize, #[case] slot: usize, #[case] slots: usize) {
        let l = layout(nranks);
        assert_eq!((l.slot_bytes, l.slots), (slot, slots));
        assert!(
            l.slots * l.slot_bytes * (nranks.max(2) - 1) <= DATA_BUDGET,
            "{l:?}"
        );
        assert_eq!(l.blocks_per_op() as usize, slots / 2);
        assert_eq!(l.slot_bytes % 16, 0);
        assert!(l.region_bytes <= 1 << 20, "{l:?}");
        assert!(l.headers_offset % 16 == 0 && l.acks_offset % 8 == 0 && l.posts_offset % 8 == 0);
        assert!(l.region_bytes > l.posts_offset);
    }

    #[test]
    fn blocks_are_as_wide_as_the_largest_piece_needs() {
        let l = layout(2);
        let threads = |ops: &[P2pOp]| block_threads(&plan(0, 2, ops, &l, 128).unwrap(), &l);
        let pair = |bytes| [op(P2pKind::Send, 1, bytes), op(P2pKind::Recv, 1, bytes)];
        assert_eq!(threads(&pair(0)), MIN_BLOCK_THREADS);
        assert_eq!(threads(&pair(1024)), 64);
        assert_eq!(threads(&pair(4096)), 128);
        assert_eq!(threads(&pair(4097)), 256);
        assert_eq!(threads(&pair(16 << 10)), 512);
        assert_eq!(threads(&pair(1 << 30)), MAX_BLOCK_THREADS);
        // The largest op sets it for the whole group.
        let mixed = [op(P2pKind::Send, 1, 100), op(P2pKind::Recv, 1, 8192)];
        assert_eq!(threads(&mixed), 256);
        // A copy moves its share of the bytes in each of its blocks.
        let copy = [op(P2pKind::Send, 0, 1 << 20), op(P2pKind::Recv, 0, 1 << 20)];
        assert_eq!(threads(&copy), MAX_BLOCK_THREADS);
    }

    #[test]
    fn chunk_counts() {
        assert_eq!(chunks(0, 4096), 1);
        assert_eq!(chunks(1, 4096), 1);
        assert_eq!(chunks(4096, 4096), 1);
        assert_eq!(chunks(4097, 4096), 2);
        assert_eq!(chunks(1 << 30, 16 << 10), 65536);
    }

    #[test]
    fn offsets_follow_order_per_peer_and_direction() {
        let ops = [
            op(P2pKind::Send, 1, 10_000), // 3 chunks
            op(P2pKind::Recv, 1, 0),
            op(P2pKind::Send, 2, 5),
            op(P2pKind::Send, 1, 0),
            op(P2pKind::Recv, 1, 4097),
            op(P2pKind::Send, 1, 1),
        ];
        let p = plan(0, 3, &ops, &small(), 1000).unwrap();
        let got: Vec<(u32, u32, u64)> = p
            .iter()
            .map(|o| (o.kind, o.msg_offset, o.chunk_offset))
            .collect();
        assert_eq!(
            got,
            vec![
                (KIND_SEND, 0, 0),
                (KIND_RECV, 0, 0),
                (KIND_SEND, 0, 0),
                (KIND_SEND, 1, 3),
                (KIND_RECV, 1, 1),
                (KIND_SEND, 2, 4),
            ]
        );
        // The last op of each (peer, direction) carries the channel's totals to the counters.
        let last: Vec<u32> = p.iter().map(|o| o.last).collect();
        assert_eq!(last, vec![0, 0, 1, 0, 1, 1]);
        // Blocks: contiguous, in order, one per chunk up to half the slots.
        assert_eq!(p[0].nblocks, 3);
        assert_eq!(p[4].nblocks, 2);
        for w in p.windows(2) {
            assert_eq!(w[1].first_block, w[0].first_block + w[0].nblocks);
        }
    }

    #[test]
    fn blocks_shrink_to_the_resident_limit_but_every_op_keeps_one() {
        let ops: Vec<P2pOp> = (1..4)
            .flat_map(|p| [op(P2pKind::Send, p, 1 << 30), op(P2pKind::Recv, p, 1 << 30)])
            .collect();
        let p = plan(0, 4, &ops, &small(), 10).unwrap();
        let total: u32 = p.iter().map(|o| o.nblocks).sum();
        assert_eq!(total, 10);
        assert!(p.iter().all(|o| o.nblocks >= 1));
        let err = plan(0, 4, &ops, &small(), 5).unwrap_err().to_string();
        assert!(err.contains("rank 0") && err.contains("resident"), "{err}");
    }

    #[test]
    fn self_pairs_become_copies_and_mismatches_name_the_rank() {
        let ops = [
            op(P2pKind::Send, 2, 100),
            op(P2pKind::Recv, 1, 8),
            op(P2pKind::Recv, 2, 100),
        ];
        let p = plan(2, 3, &ops, &small(), 100).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!((p[1].kind, p[1].last), (KIND_COPY, 0));
        assert_eq!(p[1].aux, 0x1002);
        let bad = [op(P2pKind::Send, 2, 100), op(P2pKind::Recv, 2, 99)];
        let err = plan(2, 3, &bad, &small(), 100).unwrap_err().to_string();
        assert!(
            err.contains("rank 2") && err.contains("mismatched"),
            "{err}"
        );
        let lonely = [op(P2pKind::Send, 2, 100)];
        let err = plan(2, 3, &lonely, &small(), 100).unwrap_err().to_string();
        assert!(err.contains("rank 2"), "{err}");
    }

    #[test]
    fn bad_ops_are_refused() {
        let err = plan(0, 2, &[op(P2pKind::Send, 2, 1)], &small(), 100).unwrap_err();
        assert!(err.to_string().contains("peer 2 is not a rank"), "{err}");
        let mut null = op(P2pKind::Recv, 1, 8);
        null.ptr = 0;
        let err = plan(0, 2, &[null], &small(), 100).unwrap_err();
        assert!(err.to_string().contains("null buffer"), "{err}");
        null.bytes = 0;
        assert!(plan(0, 2, &[null], &small(), 100).is_ok());
        let huge = op(P2pKind::Send, 1, MAX_MESSAGE_BYTES + 1);
        assert!(plan(0, 2, &[huge], &small(), 100).is_err());
        let many: Vec<P2pOp> = (0..=MAX_OPS).map(|_| op(P2pKind::Send, 1, 0)).collect();
        let err = plan(0, 2, &many, &small(), 1000).unwrap_err();
        assert!(err.to_string().contains("at most 64"), "{err}");
    }
}
