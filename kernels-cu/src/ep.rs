//! Host side of the expert-parallel kernels (`kernels/ep_intranode.cu`): the argument struct's
//! mirror (checked against the CUDA declaration by [`layout_asserts`]), the layout of a rank's
//! NVLink buffer ([`BufferLayout`]) and the grids. (Whether a grid may be launched, given the
//! ranks sharing the GPU, is `mscclpp_collectives::ep`'s check.)

use crate::collectives::{PeerPtrs, MAX_RANKS};
use mscclpp_core::device::DeviceRepr;
use mscclpp_core::{Error, Result};
use std::mem::{offset_of, size_of};

/// Threads per block of every EP kernel.
pub const BLOCK_THREADS: u32 = 256;
/// Most rows a sender stores before it publishes its tail (the kernels' shared row list).
pub const MAX_CHUNK: u32 = 64;
/// Most experts per rank: the meta part holds this many counts per source, so its size, and the
/// offsets after it, are the same for every call of a buffer whatever its expert count.
pub const MAX_LOCAL_EXPERTS: usize = 1024;

/// `EpArgs`: the one argument of `ep_notify`, `ep_reset`, `ep_dispatch` and `ep_combine` (every
/// pointer a device address; null where a kernel does not use it).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EpArgs {
    pub bufs: PeerPtrs,
    pub sems: u64,
    pub error_word: u64,
    pub max_spin: u64,
    pub meta_offset: u64,
    pub ctrl_offset: u64,
    pub ring_offset: u64,
    pub slot_bytes: u64,
    pub hidden_bytes: u64,
    pub x: u64,
    pub is_token_in_rank: u64,
    pub num_tokens_per_rank: u64,
    pub num_tokens_per_expert: u64,
    pub channel_prefix: u64,
    pub topk_idx: u64,
    pub topk_weights: u64,
    pub rank_prefix: u64,
    pub recv_expert_counts: u64,
    pub recv_x: u64,
    pub recv_src_idx: u64,
    pub recv_topk_idx: u64,
    pub recv_topk_weights: u64,
    pub recv_channel_prefix: u64,
    pub bias0: u64,
    pub bias1: u64,
    pub combined: u64,
    pub combined_weights: u64,
    pub num_tokens: u32,
    pub num_topk: u32,
    pub experts_per_rank: u32,
    pub expert_alignment: u32,
    pub num_channels: u32,
    pub ring_slots: u32,
    pub chunk: u32,
    pub rank: u32,
    pub nranks: u32,
    pub pad: u32,
}

// SAFETY: repr(C), u64 and u32 fields only, with `pad` making the size a multiple of 8 (no
// implicit padding: `args_layout_is_the_documented_one` checks the size is the fields' sum).
unsafe impl DeviceRepr for EpArgs {}

/// Where the parts of one rank's NVLink buffer start (bytes), and its ring slots, for one
/// (ranks, channels, slots, hidden, top-k) shape: meta, then ctrl, then rings (see the .cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferLayout {
    pub meta_offset: u64,
    pub ctrl_offset: u64,
    pub ring_offset: u64,
    pub slot_bytes: u64,
    /// Bytes the layout needs; a buffer smaller than this cannot run the call.
    pub bytes: u64,
}

fn align16(n: u64) -> u64 {
    n.div_ceil(16) * 16
}

impl BufferLayout {
    /// The layout of `nranks` ranks, `channels` channels of `ring_slots`-slot rings, and tokens
    /// of `hidden_bytes` (a multiple of 16) with `num_topk` experts. A slot holds the dispatch's
    /// row (token, source index, top-k indices and weights), which is also room for the
    /// combine's (token, top-k weights).
    pub fn new(
        nranks: usize,
        channels: usize,
        ring_slots: usize,
        hidden_bytes: usize,
        num_topk: usize,
    ) -> Result<BufferLayout> {
        if nranks == 0 || nranks > MAX_RANKS {
            return Err(Error::InvalidArgument(format!(
                "expert parallelism runs on 1 to {MAX_RANKS} ranks in one NVLink domain, not {nranks}"
            )));
        }
        if hidden_bytes == 0 || hidden_bytes % 16 != 0 {
            return Err(Error::InvalidArgument(format!(
                "a token of {hidden_bytes} bytes: it must be a positive multiple of 16"
            )));
        }
        if channels == 0 || ring_slots == 0 {
            return Err(Error::InvalidArgument(
                "expert parallelism needs at least one channel and one ring slot".into(),
            ));
        }
        let (n, c) = (nranks as u64, channels as u64);
        let meta_bytes = n * (n + MAX_LOCAL_EXPERTS as u64) * 4;
        let ctrl_offset = align16(meta_bytes);
        let ring_offset = ctrl_offset + c * n * 4 * 8;
        let slot_bytes = align16(hidden_bytes as u64 + 8 + num_topk as u64 * (8 + 4));
        let bytes = ring_offset + c * n * ring_slots as u64 * slot_bytes;
        Ok(BufferLayout {
            meta_offset: 0,
            ctrl_offset,
            ring_offset,
            slot_bytes,
            bytes,
        })
    }
}

/// Blocks of `ep_dispatch` (a sender and a receiver per ring) and of `ep_combine` (a sender per
/// ring, a receiver per channel) for `channels` channels of `nranks` ranks.
pub fn dispatch_blocks(channels: u32, nranks: u32) -> u32 {
    2 * channels * nranks
}

pub fn combine_blocks(channels: u32, nranks: u32) -> u32 {
    channels * (nranks + 1)
}

/// C++ static_asserts of [`EpArgs`] (size and every field offset).
pub fn layout_asserts() -> String {
    let mut out = String::from("\n// Generated by mscclpp_kernels_cu::ep::layout_asserts().\n");
    macro_rules! fields {
        ($($f:ident),+) => {
            $(out += &format!(
                "static_assert(offsetof(EpArgs, {}) == {}, \"EpArgs::{}: offset differs from kernels-cu/src/ep.rs\");\n",
                stringify!($f), offset_of!(EpArgs, $f), stringify!($f)
            );)+
        };
    }
    fields!(
        bufs,
        sems,
        error_word,
        max_spin,
        meta_offset,
        ctrl_offset,
        ring_offset,
        slot_bytes,
        hidden_bytes,
        x,
        is_token_in_rank,
        num_tokens_per_rank,
        num_tokens_per_expert,
        channel_prefix,
        topk_idx,
        topk_weights,
        rank_prefix,
        recv_expert_counts,
        recv_x,
        recv_src_idx,
        recv_topk_idx,
        recv_topk_weights,
        recv_channel_prefix,
        bias0,
        bias1,
        combined,
        combined_weights,
        num_tokens,
        num_topk,
        experts_per_rank,
        expert_alignment,
        num_channels,
        ring_slots,
        chunk,
        rank,
        nranks,
        pad
    );
    out += &format!(
        "static_assert(sizeof(EpArgs) == {}, \"EpArgs: size differs from kernels-cu/src/ep.rs\");\n",
        size_of::<EpArgs>()
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_layout_is_the_documented_one() {
        // 64 bytes of peer pointers, 26 eight-byte fields, 10 four-byte ones.
        assert_eq!(size_of::<EpArgs>(), 64 + 26 * 8 + 10 * 4);
        assert!(layout_asserts().contains("offsetof(EpArgs, sems) == 64"));
    }

    #[test]
    fn layout_places_meta_ctrl_then_rings() {
        // 8 ranks, 10 channels of 256 slots, 7168 bf16, top-8.
        let l = BufferLayout::new(8, 10, 256, 7168 * 2, 8).expect("layout");
        assert_eq!(l.meta_offset, 0);
        assert_eq!(l.ctrl_offset, 8 * (8 + 1024) * 4);
        assert_eq!(l.ring_offset, l.ctrl_offset + 10 * 8 * 32);
        assert_eq!(l.slot_bytes, 14448); // 14336 + 8 + 8 * 12, rounded up to 16
        assert_eq!(l.bytes, l.ring_offset + 10 * 8 * 256 * l.slot_bytes);
        // Config.buffer_bytes in python/mscclpp/ext/ep/config.py pins the same number.
        assert_eq!(l.bytes, 295_930_624);
        assert_eq!(l.slot_bytes % 16, 0);
        // A slot rounds up to 16 bytes.
        assert_eq!(BufferLayout::new(2, 1, 4, 16, 1).unwrap().slot_bytes, 48);
    }

    #[test]
    fn layout_refusals_name_the_problem() {
        let e = BufferLayout::new(9, 1, 1, 16, 1).unwrap_err().to_string();
        assert!(e.contains("1 to 8 ranks"), "{e}");
        let e = BufferLayout::new(2, 1, 1, 14, 1).unwrap_err().to_string();
        assert!(e.contains("multiple of 16"), "{e}");
    }

    #[test]
    fn grids_have_a_block_per_ring_end() {
        assert_eq!(dispatch_blocks(10, 8), 160);
        assert_eq!(combine_blocks(10, 8), 90);
    }
}
