//! Which consecutive data ops of a specialised unit run as one pass (executor.cu's `run_fused`):
//! plain data ops of one cut, with nops between them at most, whose references are pairwise
//! equal or disjoint. One thread then does a unit of every op in turn, loading every source
//! first, so the ops' memory round trips overlap where one op after another pays one each; a
//! source equal to an earlier op's destination takes the value that op stored.

use crate::executor::{OpKind, PlanOp, PlanRef, FIRST_REMOTE_SLOT, SLOT_OUTPUT, SLOT_SCRATCH};

/// Most sources and destinations of an op in a group (executor.cu's `kFusedMaxSrcs` and
/// `kFusedMaxDsts`), and most ops in a group (the registers that hold one unit of every source).
pub const FUSED_MAX_SRCS: usize = 4;
pub const FUSED_MAX_DSTS: usize = 4;
pub const FUSED_MAX_OPS: usize = 4;
// run_fused's kFeed: 4 bits per (op, source) in a u64, each an op's place plus one.
const _: () = assert!(FUSED_MAX_OPS * FUSED_MAX_SRCS <= 16 && FUSED_MAX_OPS < 16);
/// Most 16-byte words a thread of a fused group loads before it reduces any (64 of its 128
/// registers)...
pub const FUSED_WORDS_IN_FLIGHT: usize = 16;
/// ... and most words of each source among them (run_fused's kUnroll; the one-op path unrolls its
/// reductions 4 words deep too).
pub const FUSED_MAX_UNROLL: usize = 4;

/// A fused group of a threadblock's ops: `ops` (indices into the program's ops, in order; the
/// nops between them are left out) and, per op, where each source comes from (`Some(k)`: the
/// value op `k` of the group stores; `None`: memory). The group covers the program's ops up to
/// `end` (exclusive).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedGroup {
    pub ops: Vec<usize>,
    pub feed: Vec<[Option<usize>; FUSED_MAX_SRCS]>,
    pub end: usize,
}

impl FusedGroup {
    /// Words of every source a thread loads at once (run_fused's kUnroll), where `ops` are the
    /// program's ops: as many as [`FUSED_WORDS_IN_FLIGHT`] allows for the sources the group
    /// reads from memory (a fed source is in a register already).
    pub fn unroll(&self, ops: &[PlanOp]) -> usize {
        let loads: usize = self
            .ops
            .iter()
            .zip(&self.feed)
            .map(|(&o, feed)| usize::from(ops[o].nsrc) - feed.iter().flatten().count())
            .sum();
        (FUSED_WORDS_IN_FLIGHT / loads.max(1)).clamp(1, FUSED_MAX_UNROLL)
    }
}

/// How two references relate: disjoint memory, the same chunks of the same buffer, or anything
/// else (which keeps their ops apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Overlap {
    Disjoint,
    Equal,
    Partial,
}

/// Buffers of one class may be one memory: the input and the output (an in-place plan's are one
/// buffer), and remote slots of one `remote_memory` value.
fn memory_class(slot: u16, remote_memory: &[u32]) -> u64 {
    match slot {
        s if s <= SLOT_OUTPUT => 0,
        SLOT_SCRATCH => 1,
        s => 2 + u64::from(remote_memory[usize::from(s - FIRST_REMOTE_SLOT)]),
    }
}

fn overlap(x: &PlanRef, y: &PlanRef, remote_memory: &[u32]) -> Overlap {
    let apart = x.index + x.size <= y.index || y.index + y.size <= x.index;
    if memory_class(x.slot, remote_memory) != memory_class(y.slot, remote_memory) || apart {
        Overlap::Disjoint
    } else if (x.slot, x.index, x.size) == (y.slot, y.index, y.size) {
        Overlap::Equal
    } else {
        Overlap::Partial
    }
}

/// The sources and destinations of a plain data op that a group can hold, or `None`.
fn fusable<'a>(op: &PlanOp, refs: &'a [PlanRef]) -> Option<(&'a [PlanRef], &'a [PlanRef])> {
    let (nsrc, ndst) = (usize::from(op.nsrc), usize::from(op.ndst));
    let ok = op.kind == OpKind::Data as u8
        && op.flags == 0
        && (1..=FUSED_MAX_SRCS).contains(&nsrc)
        && (1..=FUSED_MAX_DSTS).contains(&ndst);
    let own = &refs[op.first_ref as usize..op.first_ref as usize + nsrc + ndst];
    (ok && own.iter().all(|r| r.packets == 0)).then(|| own.split_at(nsrc))
}

/// The group that starts at `ops[start]` (a threadblock's ops end at `ops.len()`), if at least
/// two data ops fuse there. `remote_memory` as in `StaticProgram`.
pub fn fused_group(
    ops: &[PlanOp],
    refs: &[PlanRef],
    remote_memory: &[u32],
    start: usize,
) -> Option<FusedGroup> {
    let (first_src, first_dst) = fusable(&ops[start], refs)?;
    let (part, parts, size) = (ops[start].tbg_part, ops[start].tbg_parts, first_src[0].size);
    if first_src.iter().chain(first_dst).any(|r| r.size != size) {
        return None;
    }
    let mut group = FusedGroup {
        ops: vec![start],
        feed: vec![[None; FUSED_MAX_SRCS]],
        end: start + 1,
    };
    let mut o = start + 1;
    while o < ops.len() && group.ops.len() < FUSED_MAX_OPS {
        let op = &ops[o];
        if op.kind == OpKind::Nop as u8 {
            o += 1;
            continue;
        }
        let Some((src, dst)) = fusable(op, refs) else {
            break;
        };
        let one_cut = (op.tbg_part, op.tbg_parts) == (part, parts);
        if !one_cut || src.iter().chain(dst).any(|r| r.size != size) {
            break;
        }
        let Some(feed) = feed_of(ops, refs, remote_memory, &group.ops, src, dst) else {
            break;
        };
        group.ops.push(o);
        group.feed.push(feed);
        o += 1;
        group.end = o;
    }
    (group.ops.len() >= 2).then_some(group)
}

/// Where each source of an op with `src` and `dst` comes from after the group's ops `earlier`,
/// or `None` where some reference of it partly overlaps one of theirs.
fn feed_of(
    ops: &[PlanOp],
    refs: &[PlanRef],
    remote_memory: &[u32],
    earlier: &[usize],
    src: &[PlanRef],
    dst: &[PlanRef],
) -> Option<[Option<usize>; FUSED_MAX_SRCS]> {
    let mut feed = [None; FUSED_MAX_SRCS];
    for (k, &e) in earlier.iter().enumerate() {
        let (e_src, e_dst) = fusable(&ops[e], refs)?;
        for (s, r) in src.iter().enumerate() {
            for d in e_dst {
                match overlap(r, d, remote_memory) {
                    Overlap::Equal => feed[s] = Some(k),
                    Overlap::Partial => return None,
                    Overlap::Disjoint => {}
                }
            }
        }
        // Writes after the earlier op's reads or writes of the same units are in order in the
        // one thread that does those units; only a partial overlap would put them in two.
        let clash = dst.iter().any(|w| {
            e_src
                .iter()
                .chain(e_dst)
                .any(|r| overlap(w, r, remote_memory) == Overlap::Partial)
        });
        if clash {
            return None;
        }
    }
    Some(feed)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Slot 3 the peer's scratch, slot 4 its input.
    const REMOTE: [u32; 2] = [0, 1];

    /// A plain data op of `nsrc` sources and `ndst` destinations from reference `first_ref`.
    pub(crate) fn data(nsrc: u8, ndst: u8, first_ref: u32) -> PlanOp {
        PlanOp {
            kind: OpKind::Data as u8,
            nsrc,
            ndst,
            tbg_parts: 1,
            first_ref,
            ..PlanOp::default()
        }
    }

    pub(crate) fn nop() -> PlanOp {
        PlanOp {
            kind: OpKind::Nop as u8,
            tbg_parts: 1,
            ..PlanOp::default()
        }
    }

    /// One plain chunk of buffer `slot`.
    pub(crate) fn r(slot: u16, index: u32) -> PlanRef {
        PlanRef {
            slot,
            packets: 0,
            index,
            size: 1,
        }
    }

    /// The reduce fixture's second half: rres (input 0 + remote scratch 0 into input 0 and the
    /// peer's input 0), get (remote scratch 1 into scratch 1), nop, res (input 1 + scratch 1 into
    /// input 1 and the peer's input 1), nop, signal.
    fn reduce_tail() -> (Vec<PlanOp>, Vec<PlanRef>) {
        let ops = vec![
            data(2, 2, 0),
            data(1, 1, 4),
            nop(),
            data(2, 2, 6),
            nop(),
            PlanOp {
                kind: OpKind::Signal as u8,
                nids: 1,
                ..PlanOp::default()
            },
        ];
        let refs = vec![
            r(0, 0),
            r(3, 0),
            r(0, 0),
            r(4, 0),
            r(3, 1),
            r(2, 1),
            r(0, 1),
            r(2, 1),
            r(0, 1),
            r(4, 1),
        ];
        (ops, refs)
    }

    #[test]
    fn the_reduce_fixtures_three_data_ops_fuse_and_res_takes_gets_value() {
        let (ops, refs) = reduce_tail();
        let group = fused_group(&ops, &refs, &REMOTE, 0).expect("a group");
        assert_eq!(group.ops, vec![0, 1, 3]);
        assert_eq!(
            group.end, 4,
            "the nop after res and the signal stay outside"
        );
        assert_eq!(group.feed[0], [None; FUSED_MAX_SRCS]);
        assert_eq!(group.feed[1], [None; FUSED_MAX_SRCS]);
        assert_eq!(group.feed[2], [None, Some(1), None, None]);
        // Four sources from memory (res's scratch source is fed): four words of each in flight.
        assert_eq!(group.unroll(&ops), 4);
        let wide = FusedGroup {
            feed: vec![[None; FUSED_MAX_SRCS]; 3],
            ..group.clone()
        };
        assert_eq!(wide.unroll(&ops), 3, "five sources from memory");
        assert_eq!(
            fused_group(&ops, &refs, &REMOTE, 3),
            None,
            "res alone before a nop and a signal"
        );
    }

    #[test]
    fn partial_overlaps_other_cuts_sizes_packets_and_flags_keep_ops_apart() {
        let (ops, mut refs) = reduce_tail();
        // get's destination two chunks wide: res's source (scratch 1) is part of it.
        let wide = PlanRef { size: 2, ..refs[5] };
        refs[5] = wide;
        assert_eq!(fused_group(&ops, &refs, &REMOTE, 0), None, "sizes differ");
        let (ops, mut refs) = reduce_tail();
        // get into the output, res from the input: in place they are one buffer.
        refs[5] = r(SLOT_OUTPUT, 1);
        refs[7] = r(0, 1);
        assert_eq!(
            fused_group(&ops, &refs, &REMOTE, 0).unwrap().ops,
            vec![0, 1]
        );
        let (mut ops, refs) = reduce_tail();
        ops[1].tbg_parts = 2;
        assert_eq!(fused_group(&ops, &refs, &REMOTE, 0), None, "another cut");
        let (mut ops, refs) = reduce_tail();
        ops[1].flags = crate::executor::FLAG_SIGNAL_AFTER;
        assert_eq!(
            fused_group(&ops, &refs, &REMOTE, 0),
            None,
            "a signal after the data"
        );
        let (ops, mut refs) = reduce_tail();
        refs[4].packets = 1;
        assert_eq!(fused_group(&ops, &refs, &REMOTE, 0), None, "packets");
    }

    #[test]
    fn a_write_that_partly_overlaps_an_earlier_read_keeps_ops_apart() {
        // Two chunks each: copy input 0..2 to scratch 0..2, then scratch 4..6 to input 1..3,
        // which the first op reads in part (another thread's units).
        let ops = vec![data(1, 1, 0), data(1, 1, 2)];
        let two = |slot, index| PlanRef {
            size: 2,
            ..r(slot, index)
        };
        let refs = vec![two(0, 0), two(2, 0), two(2, 4), two(0, 1)];
        assert_eq!(fused_group(&ops, &refs, &REMOTE, 0), None);
        let refs = vec![two(0, 0), two(2, 0), two(2, 4), two(0, 2)];
        assert_eq!(
            fused_group(&ops, &refs, &REMOTE, 0).unwrap().ops,
            vec![0, 1],
            "disjoint"
        );
    }
}
