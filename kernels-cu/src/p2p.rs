//! Host mirrors of the point-to-point kernels' structs (`kernels/p2p.cu`, entry points `p2p_group`
//! and, across hosts, `p2p_port_group`), checked against the CUDA declarations by the
//! static_asserts [`layout_asserts`] generates (the NVRTC test appends them to the unit).

use crate::collectives::{PeerPtrs, MAX_RANKS};
use std::mem::{offset_of, size_of};

/// Most ops one `p2p_group` launch takes (`kP2pMaxOps`).
pub const MAX_OPS: usize = 64;
/// Copies of every engine counter, one per block index (`kP2pCounterSlots`, see p2p.cu's "Order"):
/// the largest grid of a `p2p_group` launch.
pub const COUNTER_SLOTS: usize = 128;
/// Entries of each peer's post ring (`kP2pPosts`); more than twice [`MAX_OPS`] (see p2p.cu).
pub const POSTS: usize = 256;
const _: () = assert!(
    POSTS > 2 * MAX_OPS,
    "the post ring must not lap (see p2p.cu)"
);

/// Entries of each peer's zero-copy table (`kP2pZcEntries`): the registrations of one engine in
/// use at once. Key `k` takes entry `k % ZC_ENTRIES`; a later key takes the entry of a freed
/// allocation's.
pub const ZC_ENTRIES: usize = 32;

/// Keys an engine may give: below this every key of an entry has its own tag ([`zc_entry`]).
pub const ZC_KEYS: usize = ZC_ENTRIES * ZC_TAGS as usize;
const ZC_TAGS: u64 = 0xFFFF;

/// The zero-copy word of a receive (`p2p_zc_key`, `p2p_zc_offset`): `key + 1` in the high 24
/// bits, the receive's byte offset in the offered allocation in the low 40 (`None` if it does not
/// fit).
pub fn zc_word(key: usize, offset: u64) -> Option<u64> {
    (key < ZC_KEYS && offset < 1 << 40).then(|| ((key as u64 + 1) << 40) | offset)
}

/// A zero-copy table entry (`p2p_zc_tag`): the key's tag in the high 16 bits (never 0, so an
/// empty entry matches no key), the mapped allocation's address in the low 48 (`None` if it does
/// not fit). A send uses an entry only when its tag is that of the receive's key.
pub fn zc_entry(key: usize, base: u64) -> Option<u64> {
    (key < ZC_KEYS && base < 1 << 48).then(|| ((key as u64 % ZC_TAGS + 1) << 48) | base)
}

/// `P2pOpArgs::kind` values.
pub const KIND_SEND: u32 = 0;
pub const KIND_RECV: u32 = 1;
pub const KIND_COPY: u32 = 2;

/// `P2pOpArgs`: one op of a group.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct P2pOpArgs {
    /// Send: the source; receive and copy: the destination.
    pub ptr: u64,
    /// Copy: the source; receive: its zero-copy word ([`zc_word`]) or 0; send: 1 where it may go
    /// zero copy (the receiver's post decides), else 0.
    pub aux: u64,
    pub bytes: u64,
    /// Chunks of the earlier ops of this (peer, direction) in the group.
    pub chunk_offset: u64,
    pub kind: u32,
    pub peer: u32,
    pub first_block: u32,
    pub nblocks: u32,
    /// Earlier ops of this (peer, direction) in the group.
    pub msg_offset: u32,
    /// 1 where no later op of the group has this (peer, direction): the kernel advances the
    /// channel's counters from this op's offsets.
    pub last: u32,
}

/// `P2pState`: the engine's device-resident counters and zero-copy table (zeroed at creation).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pState {
    /// Per peer rank: send messages, send chunks, receive messages, receive chunks, each in
    /// [`COUNTER_SLOTS`] copies.
    pub counters: [[[u64; COUNTER_SLOTS]; 4]; MAX_RANKS],
    /// Per peer rank and entry: the peer's offered allocation as mapped here ([`zc_entry`]; 0:
    /// none).
    pub zc_table: [[u64; ZC_ENTRIES]; MAX_RANKS],
}

impl Default for P2pState {
    fn default() -> Self {
        P2pState {
            counters: [[[0; COUNTER_SLOTS]; 4]; MAX_RANKS],
            zc_table: [[0; ZC_ENTRIES]; MAX_RANKS],
        }
    }
}

/// `P2pMismatch::theirs` of a receive that met a chunk of another message (`kP2pOtherSize`): the
/// peer's message has another chunk count, and its size was not in the chunk.
pub const OTHER_SIZE: u64 = u64::MAX;

/// `P2pMismatch`: the host-mapped record of the first size mismatch a rank saw.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct P2pMismatch {
    pub claimed: u32,
    pub is_send: u32,
    pub peer: u64,
    pub mine: u64,
    pub theirs: u64,
}

/// `P2pArgs`: the one argument of `p2p_group`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pArgs {
    /// Every rank's engine region as mapped in this process.
    pub regions: PeerPtrs,
    pub local: u64,
    pub state: u64,
    pub mismatch: u64,
    pub error_word: u64,
    pub max_spin: u64,
    pub slot_bytes: u64,
    pub headers_offset: u64,
    pub acks_offset: u64,
    pub posts_offset: u64,
    /// Region offset of the `P2pZeroCopy` entries, one per peer index.
    pub zc_offset: u64,
    /// Device address of the host-mapped table the host writes, `[MAX_RANKS][ZC_ENTRIES]` of
    /// [`zc_entry`].
    pub zc_staging: u64,
    pub slots: u32,
    pub rank: u32,
    pub nranks: u32,
    pub nops: u32,
    pub ops: [P2pOpArgs; MAX_OPS],
}

/// Slots of each (peer, direction) of `p2p_port_group` (`kP2pPortSlots`): chunks in flight
/// between a sender and its receiver.
pub const PORT_SLOTS: usize = 4;
/// Threads of every `p2p_port_group` block (`kP2pPortThreads`, its launch bound).
pub const PORT_THREADS: u32 = 512;
/// Largest world of `p2p_port_group` (`kP2pPortMaxRanks`, the rows of [`P2pPortState`]).
pub const MAX_PORT_RANKS: usize = 64;
/// Most credits a receiver gives back for a mismatched message (`kP2pPortDrainMax`, see p2p.cu's
/// "Across hosts").
pub const PORT_DRAIN_MAX: u64 = 1 << 16;
/// Bytes of a slot's header (`P2pPortHeader`: message word, chunk seq), in front of its data.
pub const PORT_HEADER_BYTES: usize = 16;

/// `P2pPortOp`: one op of a `p2p_port_group` lane.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct P2pPortOp {
    /// Send: the source; receive and copy: the destination.
    pub ptr: u64,
    /// Copy: the source; else 0.
    pub aux: u64,
    pub bytes: u64,
    pub kind: u32,
    pub peer: u32,
}

/// `P2pPortLane`: ops `first..first + count` of [`P2pPortArgs::ops`], all of `kind` with `peer`;
/// one block runs one lane.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct P2pPortLane {
    pub first: u32,
    pub count: u32,
    pub kind: u32,
    pub peer: u32,
}

/// `P2pPortState`: per peer rank, send messages, send chunks, receive messages, receive chunks
/// (zeroed at creation; only the kernel advances them).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pPortState {
    pub counters: [[u64; 4]; MAX_PORT_RANKS],
}

/// `P2pPortArgs`: the one argument of `p2p_port_group`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pPortArgs {
    /// Device array of `PortChannelHandle`s, two per rank: data, credit.
    pub channels: u64,
    pub inbound: u64,
    pub staging: u64,
    pub state: u64,
    pub mismatch: u64,
    pub error_word: u64,
    pub slot_bytes: u64,
    pub rank: u32,
    pub nlanes: u32,
    pub ops: [P2pPortOp; MAX_OPS],
    pub lanes: [P2pPortLane; MAX_OPS],
}

/// C++ static_asserts of the structs (size and every field offset) and of the constants.
pub fn layout_asserts() -> String {
    let mut out = String::from("\n// Generated by mscclpp_kernels_cu::p2p::layout_asserts().\n");
    let mut check = |ty: &str, field: &str, offset: usize| {
        out += &format!(
            "static_assert(offsetof({ty}, {field}) == {offset}, \"{ty}::{field}: offset differs from kernels-cu/src/p2p.rs\");\n"
        );
    };
    macro_rules! fields {
        ($ty:ident: $($f:ident),+) => {
            $(check(stringify!($ty), stringify!($f), offset_of!($ty, $f));)+
        };
    }
    fields!(P2pOpArgs: ptr, aux, bytes, chunk_offset, kind, peer, first_block, nblocks, msg_offset, last);
    fields!(P2pState: counters, zc_table);
    fields!(P2pMismatch: claimed, is_send, peer, mine, theirs);
    fields!(P2pArgs: regions, local, state, mismatch, error_word, max_spin, slot_bytes,
        headers_offset, acks_offset, posts_offset, zc_offset, zc_staging, slots, rank, nranks, nops, ops);
    fields!(P2pPortOp: ptr, aux, bytes, kind, peer);
    fields!(P2pPortLane: first, count, kind, peer);
    fields!(P2pPortState: counters);
    fields!(P2pPortArgs: channels, inbound, staging, state, mismatch, error_word, slot_bytes, rank,
        nlanes, ops, lanes);
    for (ty, size) in [
        ("P2pOpArgs", size_of::<P2pOpArgs>()),
        ("P2pState", size_of::<P2pState>()),
        ("P2pMismatch", size_of::<P2pMismatch>()),
        ("P2pArgs", size_of::<P2pArgs>()),
        ("P2pPortOp", size_of::<P2pPortOp>()),
        ("P2pPortLane", size_of::<P2pPortLane>()),
        ("P2pPortState", size_of::<P2pPortState>()),
        ("P2pPortArgs", size_of::<P2pPortArgs>()),
        ("P2pPortHeader", PORT_HEADER_BYTES),
    ] {
        out += &format!(
            "static_assert(sizeof({ty}) == {size}, \"{ty}: size differs from kernels-cu/src/p2p.rs\");\n"
        );
    }
    for (name, value) in [
        ("kP2pMaxOps", MAX_OPS as u32),
        ("kP2pCounterSlots", COUNTER_SLOTS as u32),
        ("kP2pPosts", POSTS as u32),
        ("kP2pZcEntries", ZC_ENTRIES as u32),
        ("kP2pZcTags", ZC_TAGS as u32),
        ("kP2pSend", KIND_SEND),
        ("kP2pRecv", KIND_RECV),
        ("kP2pCopy", KIND_COPY),
        ("kP2pPortSlots", PORT_SLOTS as u32),
        ("kP2pPortThreads", PORT_THREADS),
        ("kP2pPortMaxRanks", MAX_PORT_RANKS as u32),
    ] {
        out += &format!("static_assert({name} == {value}, \"{name}\");\n");
    }
    for (name, value) in [
        ("kP2pOtherSize", OTHER_SIZE),
        ("kP2pPortDrainMax", PORT_DRAIN_MAX),
        ("kP2pPortHeaderBytes", PORT_HEADER_BYTES as u64),
    ] {
        out += &format!("static_assert({name} == {value}ull, \"{name}\");\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_the_documented_one() {
        assert_eq!(size_of::<P2pOpArgs>(), 56);
        assert_eq!(
            size_of::<P2pState>(),
            8 * (4 * COUNTER_SLOTS + ZC_ENTRIES) * MAX_RANKS
        );
        assert_eq!(size_of::<P2pMismatch>(), 32);
        assert_eq!(offset_of!(P2pArgs, ops), 168);
        assert_eq!(size_of::<P2pArgs>(), 168 + MAX_OPS * 56);
        // Kernel parameters are limited to 4 KiB.
        assert!(size_of::<P2pArgs>() <= 4096);
        let asserts = layout_asserts();
        assert!(asserts.contains("offsetof(P2pArgs, nops) == 164"));
        assert!(asserts.contains("static_assert(kP2pPosts == 256"));
    }

    #[test]
    fn port_layout_is_the_documented_one() {
        assert_eq!(size_of::<P2pPortOp>(), 32);
        assert_eq!(size_of::<P2pPortLane>(), 16);
        assert_eq!(size_of::<P2pPortState>(), 32 * MAX_PORT_RANKS);
        assert_eq!(offset_of!(P2pPortArgs, ops), 64);
        assert_eq!(offset_of!(P2pPortArgs, lanes), 64 + 32 * MAX_OPS);
        // Kernel parameters are limited to 4 KiB.
        assert_eq!(size_of::<P2pPortArgs>(), 64 + 48 * MAX_OPS);
        assert!(size_of::<P2pPortArgs>() <= 4096);
        let asserts = layout_asserts();
        assert!(asserts.contains("offsetof(P2pPortArgs, nlanes) == 60"));
        assert!(asserts.contains("static_assert(sizeof(P2pPortHeader) == 16"));
        assert!(asserts.contains("static_assert(kP2pPortDrainMax == 65536ull"));
    }

    #[test]
    fn zero_copy_words_carry_key_and_offset() {
        assert_eq!(zc_word(0, 0), Some(1 << 40));
        assert_eq!(zc_word(5, 0x1234), Some((6 << 40) | 0x1234));
        assert_eq!(
            zc_word(ZC_KEYS - 1, 0),
            Some((ZC_KEYS as u64) << 40),
            "the largest key fits its 24 bits"
        );
        assert_eq!(zc_word(ZC_KEYS, 0), None);
        assert_eq!(zc_word(0, 1 << 40), None);
        assert_eq!(
            zc_entry(0, 0x7f00_0000_0000),
            Some((1 << 48) | 0x7f00_0000_0000)
        );
        assert_eq!(zc_entry(ZC_ENTRIES + 3, 0x1000), Some((36 << 48) | 0x1000));
        // Keys of one entry have distinct tags.
        let tags: std::collections::HashSet<u64> = (3..ZC_KEYS)
            .step_by(ZC_ENTRIES)
            .map(|k| zc_entry(k, 0).unwrap() >> 48)
            .collect();
        assert_eq!(tags.len(), ZC_KEYS / ZC_ENTRIES);
        assert_eq!(zc_entry(ZC_KEYS, 0), None);
        assert_eq!(zc_entry(0, 1 << 48), None);
    }
}
