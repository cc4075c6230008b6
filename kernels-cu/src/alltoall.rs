//! Host mirrors of the all-to-all family's kernel arguments (`kernels/alltoall.cu`): one
//! `#[repr(C)]` struct per kernel, passed by value, checked against the CUDA declarations by the
//! static_asserts [`layout_asserts`] generates, which the NVRTC tests append to the unit (they use
//! `offsetof`, which NVRTC has only from CUDA 13.5, so the run-time compile goes without them).

use crate::collectives::{PeerPtrs, MAX_RANKS};
use std::mem::{offset_of, size_of};

/// Largest grid of the exchange kernels: the slots per rank of their table space
/// (`kMaxAlltoallBlocks`).
pub const MAX_ALLTOALL_BLOCKS: usize = 128;

/// `ExchangeTable`: what one rank publishes to every peer for one exchange (one copy per block
/// slot): the bytes it sends to and expects from every rank, and the displacement of the side its
/// peers address (its receive displacements where peers push, its send displacements where they
/// pull). Every rank reads every table, so every rank sees every disagreement. `slice`: where this
/// rank runs in place in rounds (push), the bytes per peer and round it stages (0: none); every
/// rank then moves every pair's bytes in rounds of the smallest slice published.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExchangeTable {
    pub send: [u64; MAX_RANKS],
    pub recv: [u64; MAX_RANKS],
    pub displs: [u64; MAX_RANKS],
    pub slice: u64,
}

/// Bytes of one rank's table space (one [`ExchangeTable`] per block slot), which every peer maps.
pub const TABLE_SCRATCH_BYTES: usize = MAX_ALLTOALL_BLOCKS * size_of::<ExchangeTable>();

/// `CountMismatch`: the first disagreement an exchange found, as every rank saw it. `sender` or
/// `receiver` is `u32::MAX` where all ranks of that side together are meant (device counts: the
/// senders' total beyond a receiver's capacity, or a sender's counts beyond its input).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CountMismatch {
    pub sender: u32,
    pub receiver: u32,
    /// Bytes the sender sends (or all senders together).
    pub sent: u64,
    /// Bytes the receiver expects (or its capacity, or the sender's input).
    pub expected: u64,
}

/// `AlltoallState`: per-rank device state of the exchange kernels (in the collection's private
/// tail, zeroed at build). `finished` counts the blocks of a failing call that are done, so that
/// the last one records the error only once every block of the grid passed its barriers; `found`
/// is set with `mismatch`, never cleared (the communicator is failed from then on).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AlltoallState {
    pub finished: u32,
    pub found: u32,
    pub mismatch: CountMismatch,
}

impl AlltoallState {
    /// The state from its device bytes (little-endian, as read back); `None` if `b` is short.
    pub fn from_le_bytes(b: &[u8]) -> Option<AlltoallState> {
        let u32_at = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
        let u64_at = |i: usize| Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?));
        Some(AlltoallState {
            finished: u32_at(offset_of!(AlltoallState, finished))?,
            found: u32_at(offset_of!(AlltoallState, found))?,
            mismatch: CountMismatch {
                sender: u32_at(
                    offset_of!(AlltoallState, mismatch) + offset_of!(CountMismatch, sender),
                )?,
                receiver: u32_at(
                    offset_of!(AlltoallState, mismatch) + offset_of!(CountMismatch, receiver),
                )?,
                sent: u64_at(
                    offset_of!(AlltoallState, mismatch) + offset_of!(CountMismatch, sent),
                )?,
                expected: u64_at(
                    offset_of!(AlltoallState, mismatch) + offset_of!(CountMismatch, expected),
                )?,
            },
        })
    }
}

/// `AlltoallArgs`: the one argument of `alltoallv_zero_copy` (push: this rank stores into the
/// peers' registered outputs) and `alltoallv_zero_copy_pull` (this rank loads from the peers'
/// registered inputs). Counts and displacements are in bytes, indexed by rank; entries at and
/// beyond `nranks` are zero.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AlltoallArgs {
    /// This rank's own side: its input (push) or its output (pull).
    pub local: u64,
    /// Every rank's registered side as mapped in this process: outputs (push) or inputs (pull).
    pub remote: PeerPtrs,
    /// Every rank's table space ([`TABLE_SCRATCH_BYTES`]) as mapped in this process.
    pub tables: PeerPtrs,
    pub send_counts: [u64; MAX_RANKS],
    pub send_displs: [u64; MAX_RANKS],
    pub recv_counts: [u64; MAX_RANKS],
    pub recv_displs: [u64; MAX_RANKS],
    /// `D2DSemaphoreHandle[blocks][nranks - 1]`.
    pub sems: u64,
    /// `AlltoallState*` of this rank.
    pub state: u64,
    /// `Communicator::error_word_device_ptr()`.
    pub error_word: u64,
    pub max_spin: u64,
    pub rank: u32,
    pub nranks: u32,
    /// Push, in place in rounds: this rank's staging (`u8*`, at least `nranks * slice` bytes);
    /// else 0.
    pub stage: u64,
    /// Bytes per peer and round this rank can stage at `stage` (0: not in rounds).
    pub slice: u64,
}

/// `AlltoallDeviceArgs`: the one argument of `alltoallv_device_counts` (send counts in device
/// memory, both sides packed in rank order).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AlltoallDeviceArgs {
    pub input: u64,
    pub input_bytes: u64,
    pub outputs: PeerPtrs,
    pub tables: PeerPtrs,
    /// `const u64*`: `nranks` send counts in units of `unit_bytes`.
    pub send_counts: u64,
    /// `u64*`: `nranks` receive counts, written by the kernel.
    pub recv_counts: u64,
    pub unit_bytes: u64,
    pub output_bytes: u64,
    pub sems: u64,
    /// `AlltoallState*` of this rank.
    pub state: u64,
    pub error_word: u64,
    pub max_spin: u64,
    pub rank: u32,
    pub nranks: u32,
}

/// `AlltoallPacketArgs`: the one argument of `alltoall_packet` (uniform chunks of `bytes`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AlltoallPacketArgs {
    pub input: u64,
    pub output: u64,
    pub bytes: u64,
    /// Every rank's packet scratch as mapped in this process.
    pub peer_scratch: PeerPtrs,
    pub local_scratch: u64,
    /// Stride of the slots (nranks per half); at least the chunk's LL128 lines.
    pub slot_bytes: u64,
    /// Offset of the second half (the collection's LL128 part: `ScratchRegion::half_bytes`).
    pub half_bytes: u64,
    /// The collection's shared `CallState*`.
    pub state: u64,
    pub error_word: u64,
    pub max_spin: u64,
    pub rank: u32,
    pub nranks: u32,
}

/// C++ static_asserts of the argument structs (size and every field offset).
pub fn layout_asserts() -> String {
    let mut out =
        String::from("\n// Generated by mscclpp_kernels_cu::alltoall::layout_asserts().\n");
    let mut check = |ty: &str, field: &str, offset: usize| {
        out += &format!(
            "static_assert(offsetof({ty}, {field}) == {offset}, \"{ty}::{field}: offset differs from kernels-cu/src/alltoall.rs\");\n"
        );
    };
    macro_rules! fields {
        ($ty:ident: $($f:ident),+) => {
            $(check(stringify!($ty), stringify!($f), offset_of!($ty, $f));)+
        };
    }
    fields!(ExchangeTable: send, recv, displs, slice);
    fields!(CountMismatch: sender, receiver, sent, expected);
    fields!(AlltoallState: finished, found, mismatch);
    fields!(AlltoallArgs: local, remote, tables, send_counts, send_displs, recv_counts,
        recv_displs, sems, state, error_word, max_spin, rank, nranks, stage, slice);
    fields!(AlltoallDeviceArgs: input, input_bytes, outputs, tables, send_counts, recv_counts,
        unit_bytes, output_bytes, sems, state, error_word, max_spin, rank, nranks);
    fields!(AlltoallPacketArgs: input, output, bytes, peer_scratch, local_scratch, slot_bytes,
        half_bytes, state, error_word, max_spin, rank, nranks);
    for (ty, size) in [
        ("ExchangeTable", size_of::<ExchangeTable>()),
        ("CountMismatch", size_of::<CountMismatch>()),
        ("AlltoallState", size_of::<AlltoallState>()),
        ("AlltoallArgs", size_of::<AlltoallArgs>()),
        ("AlltoallDeviceArgs", size_of::<AlltoallDeviceArgs>()),
        ("AlltoallPacketArgs", size_of::<AlltoallPacketArgs>()),
    ] {
        out += &format!(
            "static_assert(sizeof({ty}) == {size}, \"{ty}: size differs from kernels-cu/src/alltoall.rs\");\n"
        );
    }
    out += &format!(
        "static_assert(kMaxAlltoallBlocks == {MAX_ALLTOALL_BLOCKS}, \"kMaxAlltoallBlocks\");\n"
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_layout_is_the_documented_one() {
        assert_eq!(size_of::<ExchangeTable>(), 200);
        assert_eq!(TABLE_SCRATCH_BYTES, 25 << 10);
        assert_eq!(size_of::<AlltoallState>(), 32);
        assert_eq!(size_of::<AlltoallArgs>(), 448);
        assert_eq!(offset_of!(AlltoallArgs, sems), 392);
        let asserts = layout_asserts();
        assert!(asserts.contains("offsetof(AlltoallArgs, nranks) == 428"));
        assert!(asserts.contains("offsetof(AlltoallArgs, slice) == 440"));
        assert_eq!(size_of::<AlltoallPacketArgs>(), 144);
        assert_eq!(size_of::<AlltoallDeviceArgs>(), 216);
        assert!(asserts.contains("offsetof(AlltoallDeviceArgs, nranks) == 212"));
        assert!(asserts.contains("offsetof(AlltoallPacketArgs, state) == 112"));
    }

    #[test]
    fn state_reads_back_from_its_bytes() {
        let mut b = vec![0u8; size_of::<AlltoallState>()];
        b[4] = 1;
        b[8] = 3;
        b[16] = 8;
        b[24] = 9;
        let s = AlltoallState::from_le_bytes(&b).expect("whole state");
        assert_eq!(s.found, 1);
        assert_eq!(
            s.mismatch,
            CountMismatch {
                sender: 3,
                receiver: 0,
                sent: 8,
                expected: 9
            }
        );
        assert!(AlltoallState::from_le_bytes(&b[..31]).is_none());
    }
}
