//! The device ABI on the Rust side: `#[repr(C)]` mirrors of the handles that kernels receive
//! (`kernels-cu/include/mscclpp/*.cuh`), the proxy-trigger bit layout, LL packets and the codes of
//! the device error word. `docs/device-abi.md` is the specification.
//!
//! Pointer fields are device addresses ([`DevicePtr`]), not Rust pointers: hosts build these
//! structs and copy them to the device (kernel parameters or device memory) without dereferencing
//! them. Every struct has explicit padding fields, so [`DeviceRepr::as_bytes`] never exposes
//! uninitialised bytes; [`layouts`] and its tests check that, and [`layout_static_asserts`] turns
//! the Rust layout into C++ `static_assert`s that the NVRTC test compiles against the headers.

use crate::error::{Error, Result};
use crate::gpu::DevicePtr;
use std::mem::{align_of, offset_of, size_of};

// ---------------------------------------------------------------------------------------------
// Device error word
// ---------------------------------------------------------------------------------------------

/// No device-side error.
pub const DEVICE_ERROR_NONE: u32 = 0;
/// A semaphore wait gave up (the peer never signalled).
pub const DEVICE_ERROR_SEMAPHORE_WAIT_TIMEOUT: u32 = 1;
/// An LL packet never carried the expected flag.
pub const DEVICE_ERROR_PACKET_READ_TIMEOUT: u32 = 2;
/// The proxy FIFO stayed full (the proxy is not consuming triggers).
pub const DEVICE_ERROR_FIFO_PUSH_TIMEOUT: u32 = 3;
/// A FIFO flush/sync gave up (the proxy never completed the trigger).
pub const DEVICE_ERROR_FIFO_FLUSH_TIMEOUT: u32 = 4;
/// A PortChannel request had an offset that does not fit the 32-bit trigger field.
pub const DEVICE_ERROR_TRIGGER_OVERFLOW: u32 = 5;

/// The communicator was aborted (`Communicator::abort`, a dead peer, or a wait that timed out on
/// another stream): kernels return at entry and every wait gives up at once.
pub const DEVICE_ERROR_ABORTED: u32 = 6;

/// An all-to-all sender and receiver disagreed on the bytes between them: the kernel sent nothing
/// to that receiver (`collectives::alltoall` names the ranks when its host check is on).
pub const DEVICE_ERROR_COUNT_MISMATCH: u32 = 7;

/// Spin bound (iterations) the device uses when a handle's `max_spin` is 0.
pub const DEFAULT_MAX_SPIN: u64 = 1 << 32;

/// Bytes of an error page and of the host-mapped error word, which share one layout: the code
/// (u32) at offset 0, the wait budget in milliseconds (u32) at [`ERROR_WORD_BUDGET_OFFSET`], and at
/// [`ERROR_WORD_HOST_OFFSET`] the device address of the host word (u64; null in the host word
/// itself). Kernels get the page, device memory in the communicator's semaphore slab: they read it
/// at entry and while they wait, and read the host word only after a wait has lasted a millisecond,
/// because GPU reads of host memory can be serialised across the whole GPU (`mscclpp::spin_until`,
/// error.cuh). A device wait gives up when the budget passes (wall clock, `%globaltimer`), when
/// `max_spin` polls passed, or at once when the code is non-zero; a budget of 0 leaves only the
/// spin bound. The host reads and aborts through its word; device errors are written to both.
pub const ERROR_WORD_BYTES: usize = 16;
/// Offset of the wait budget (milliseconds, u32) in an error page or word.
pub const ERROR_WORD_BUDGET_OFFSET: usize = 4;
/// Offset of the host word's device address (u64) in an error page.
pub const ERROR_WORD_HOST_OFFSET: usize = 8;

/// An error page's contents: no error yet, `budget_ms`, and the device address of the host word.
pub fn error_page(budget_ms: u32, host_word: DevicePtr) -> [u8; ERROR_WORD_BYTES] {
    let mut page = [0u8; ERROR_WORD_BYTES];
    page[ERROR_WORD_BUDGET_OFFSET..ERROR_WORD_BUDGET_OFFSET + 4]
        .copy_from_slice(&budget_ms.to_le_bytes());
    page[ERROR_WORD_HOST_OFFSET..].copy_from_slice(&host_word.to_le_bytes());
    page
}

/// The wait budget to store next to an error word for a host timeout: whole milliseconds, at
/// least 1, saturated at u32::MAX (49 days).
pub fn wait_budget_ms(timeout: std::time::Duration) -> u32 {
    u32::try_from(timeout.as_millis())
        .unwrap_or(u32::MAX)
        .max(1)
}

/// Words for a non-zero error word, for [`Error::DeviceTimeout`] messages.
pub fn describe_device_error(code: u32) -> String {
    match code {
        DEVICE_ERROR_NONE => "no error".to_string(),
        DEVICE_ERROR_SEMAPHORE_WAIT_TIMEOUT => "a semaphore wait timed out (code 1)".to_string(),
        DEVICE_ERROR_PACKET_READ_TIMEOUT => "an LL packet read timed out (code 2)".to_string(),
        DEVICE_ERROR_FIFO_PUSH_TIMEOUT => {
            "a proxy FIFO push timed out: FIFO full (code 3)".to_string()
        }
        DEVICE_ERROR_FIFO_FLUSH_TIMEOUT => "a proxy FIFO flush timed out (code 4)".to_string(),
        DEVICE_ERROR_TRIGGER_OVERFLOW => {
            "a port-channel offset did not fit in a proxy trigger (code 5)".to_string()
        }
        DEVICE_ERROR_ABORTED => "the communicator was aborted (code 6)".to_string(),
        DEVICE_ERROR_COUNT_MISMATCH => {
            "a sender and a receiver (all-to-all, send/recv) disagreed on a count (code 7)"
                .to_string()
        }
        other => format!("unknown device error code {other}"),
    }
}

/// Turns the value read from a device error word into a result; `context` names the operation
/// (collective, kernel, rank) for the message.
pub fn check_device_error(code: u32, context: &str) -> Result<()> {
    if code == DEVICE_ERROR_NONE {
        Ok(())
    } else {
        Err(Error::DeviceTimeout(format!(
            "{context}: {}",
            describe_device_error(code)
        )))
    }
}

// ---------------------------------------------------------------------------------------------
// Handles
// ---------------------------------------------------------------------------------------------

/// Device-to-device semaphore (`mscclpp::D2DSemaphoreHandle`, 40 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct D2DSemaphoreHandle {
    /// Local u64 counter the peer increments.
    pub inbound: DevicePtr,
    /// Local u64 (device memory) only this rank touches: signals consumed so far.
    pub expected: DevicePtr,
    /// The peer's `inbound`, mapped into this process.
    pub remote_inbound: DevicePtr,
    /// Host-mapped u32 error word (0 = none).
    pub error_word: DevicePtr,
    /// Spin bound in iterations; 0 = [`DEFAULT_MAX_SPIN`].
    pub max_spin: u64,
}

/// Host-to-device semaphore (`mscclpp::H2DSemaphoreHandle`, 32 bytes): the proxy increments
/// `inbound`, the device waits or polls.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct H2DSemaphoreHandle {
    pub inbound: DevicePtr,
    pub expected: DevicePtr,
    pub error_word: DevicePtr,
    pub max_spin: u64,
}

/// Memory channel (`mscclpp::MemoryChannelHandle`, 64 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct MemoryChannelHandle {
    pub semaphore: D2DSemaphoreHandle,
    /// The peer's buffer, mapped here (destination of put/put_packets, source of get).
    pub dst: DevicePtr,
    /// The local buffer (source of put, destination of get/unpack_packets).
    pub src: DevicePtr,
    /// Local scratch that the peer's put_packets write into.
    pub packet_buffer: DevicePtr,
}

/// One FIFO slot (`mscclpp::ProxyTrigger`, 16 bytes, 16-byte aligned). See [`TriggerFields`] for
/// the decoded form and the bit layout constants below.
#[repr(C, align(16))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ProxyTrigger {
    pub fst: u64,
    pub snd: u64,
}

/// Device-to-proxy FIFO (`mscclpp::FifoHandle`, 56 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct FifoHandle {
    /// Host-mapped ring of `size` [`ProxyTrigger`]s.
    pub triggers: DevicePtr,
    /// Device u64: next position handed to a pusher.
    pub head: DevicePtr,
    /// Host-mapped u64: triggers the proxy has consumed.
    pub tail: DevicePtr,
    pub size: u32,
    pub pad: u32,
    pub error_word: DevicePtr,
    pub max_spin: u64,
    /// Device u64: the largest tail a pusher has read, so pushes skip the PCIe read of `tail`
    /// while the ring is known to have room.
    pub tail_cache: DevicePtr,
}

/// Port channel (`mscclpp::PortChannelHandle`, 104 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PortChannelHandle {
    pub fifo: FifoHandle,
    pub semaphore: H2DSemaphoreHandle,
    /// The proxy's id of the semaphore FLAG triggers increment (10 bits).
    pub semaphore_id: u32,
    /// Registered memory ids (9 bits each) of the peer's and the local buffer.
    pub dst_memory_id: u32,
    pub src_memory_id: u32,
    pub pad: u32,
}

/// NVLink multicast channel (`mscclpp::SwitchChannelHandle`, 24 bytes): one buffer per rank bound
/// to a multicast object. `multimem.ld_reduce` through `mc_ptr` reads the sum over every rank's
/// buffer; `multimem.st` through `mc_ptr` writes every rank's buffer.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SwitchChannelHandle {
    /// This rank's buffer (unicast address).
    pub device_ptr: DevicePtr,
    /// The multicast address of the same bytes on every rank.
    pub mc_ptr: DevicePtr,
    /// Usable bytes from both addresses.
    pub size: u64,
}

/// LL16 packet: 8 payload bytes, each 4-byte half guarded by its own flag.
#[repr(C, align(16))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct LL16Packet {
    pub data1: u32,
    pub flag1: u32,
    pub data2: u32,
    pub flag2: u32,
}

/// LL8 packet: 4 payload bytes and a flag.
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct LL8Packet {
    pub data: u32,
    pub flag: u32,
}

/// Plain-old-data that may be copied to the device byte for byte.
///
/// # Safety
/// Implementors are `#[repr(C)]`, contain no implicit padding (every byte belongs to a field) and
/// no references. The layout tests of this module check both for every implementor.
pub unsafe trait DeviceRepr: Copy + 'static {
    /// The struct's bytes, as the device sees them (little-endian hosts and devices).
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: per the trait contract every byte of Self is an initialised field byte.
        unsafe { std::slice::from_raw_parts((self as *const Self).cast::<u8>(), size_of::<Self>()) }
    }

    /// The bytes of a slice of handles (e.g. an array of channels uploaded for a kernel).
    fn slice_as_bytes(items: &[Self]) -> &[u8] {
        // SAFETY: as above; a slice of Self has no bytes between elements beyond Self's own.
        unsafe {
            std::slice::from_raw_parts(items.as_ptr().cast::<u8>(), std::mem::size_of_val(items))
        }
    }
}

// SAFETY: all are repr(C) with explicit padding; `layouts_have_no_implicit_padding` checks it.
unsafe impl DeviceRepr for D2DSemaphoreHandle {}
unsafe impl DeviceRepr for H2DSemaphoreHandle {}
unsafe impl DeviceRepr for MemoryChannelHandle {}
unsafe impl DeviceRepr for ProxyTrigger {}
unsafe impl DeviceRepr for FifoHandle {}
unsafe impl DeviceRepr for PortChannelHandle {}
unsafe impl DeviceRepr for SwitchChannelHandle {}
unsafe impl DeviceRepr for LL16Packet {}
unsafe impl DeviceRepr for LL8Packet {}
unsafe impl DeviceRepr for PeerPtrs {}
unsafe impl DeviceRepr for PacketArgs {}
unsafe impl DeviceRepr for PipelineArgs {}
unsafe impl DeviceRepr for ZeroCopyArgs {}
unsafe impl DeviceRepr for CopyEngineArgs {}
unsafe impl DeviceRepr for PortAllreduceArgs {}

// ---------------------------------------------------------------------------------------------
// Native collective kernel arguments (`mscclpp::coll`, kernels-cu/src/kernels/collective_common.cuh)
// ---------------------------------------------------------------------------------------------

/// Largest world size of the native collectives (`coll::kMaxRanks`).
pub const COLL_MAX_RANKS: usize = 8;

/// `coll::PeerPtrs`: one address per rank, by value inside the argument structs below.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerPtrs {
    pub p: [DevicePtr; COLL_MAX_RANKS],
}

impl PeerPtrs {
    /// Addresses indexed by rank; an error if there are more than [`COLL_MAX_RANKS`].
    pub fn from_slice(ptrs: &[DevicePtr]) -> Result<PeerPtrs> {
        if ptrs.len() > COLL_MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "{} ranks: the native collectives support at most {COLL_MAX_RANKS} ranks on one host",
                ptrs.len()
            )));
        }
        let mut out = PeerPtrs::default();
        out.p[..ptrs.len()].copy_from_slice(ptrs);
        Ok(out)
    }
}

/// `coll::PacketArgs`: the only parameter of the LL-packet kernels (`allreduce_allpair_packet`,
/// `allreduce_packet`, `allgather_packet`, `reducescatter_packet`). `count` is in the kernel's
/// units (elements; bytes for the all-gather; elements per chunk for the reduce-scatter). The
/// call with counter value c uses the scratch half at `(c & 1) * half_bytes`, its slots of
/// `slot_bytes` inside it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacketArgs {
    pub input: DevicePtr,
    pub output: DevicePtr,
    pub count: u64,
    pub peer_scratch: PeerPtrs,
    pub local_scratch: DevicePtr,
    pub slot_bytes: u64,
    pub half_bytes: u64,
    /// `coll::CallState*`, shared by every scratch user of the collection.
    pub state: DevicePtr,
    /// The communicator's error word (`u32*`).
    pub error_word: DevicePtr,
    /// Spin bound of every wait; 0 = [`DEFAULT_MAX_SPIN`].
    pub max_spin: u64,
    pub rank: u32,
    pub nranks: u32,
}

/// `coll::PipelineArgs`: the only parameter of the scratch pipelines (`allreduce_rsag`,
/// `allreduce_rsag_push`, `allreduce_fullmesh`, `allgather_fullmesh`); see "Scratch pipelines" in
/// collective_common.cuh.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PipelineArgs {
    pub input: DevicePtr,
    pub output: DevicePtr,
    pub count: u64,
    pub peer_scratch: PeerPtrs,
    /// Every rank's (registered) output, read by `allreduce_rsag_push` only; zero for the others.
    pub peer_outputs: PeerPtrs,
    pub local_scratch: DevicePtr,
    pub slot_bytes: u64,
    pub half_bytes: u64,
    pub step: u64,
    /// `const D2DSemaphoreHandle*`, `[block][peer index]`.
    pub sems: DevicePtr,
    pub state: DevicePtr,
    pub error_word: DevicePtr,
    pub max_spin: u64,
    pub rank: u32,
    pub nranks: u32,
}

/// `coll::ZeroCopyArgs`: the only parameter of the kernels on registered user buffers
/// (`allreduce_rsag_zero_copy`, `allgather_fullmesh2`, `reducescatter_zero_copy`,
/// `broadcast_zero_copy`, `reduce_zero_copy`); each reads the fields its collective needs.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroCopyArgs {
    pub inputs: PeerPtrs,
    pub outputs: PeerPtrs,
    pub input: DevicePtr,
    pub output: DevicePtr,
    pub count: u64,
    pub sems: DevicePtr,
    pub error_word: DevicePtr,
    pub max_spin: u64,
    pub rank: u32,
    pub root: u32,
    pub nranks: u32,
    pub pad: u32,
}

/// `coll::CopyEngineArgs`: the only parameter of the copy-engine all-reduce's kernels
/// (`allreduce_ce_reduce` reads `srcs`..`nranks`, `allreduce_ce_sync` `sems`, `npeers`, `mode`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyEngineArgs {
    pub srcs: PeerPtrs,
    pub output: DevicePtr,
    pub count: u64,
    pub sems: DevicePtr,
    pub error_word: DevicePtr,
    pub max_spin: u64,
    pub nsrc: u32,
    pub nranks: u32,
    pub npeers: u32,
    pub mode: u32,
}

/// `coll::PortAllreduceArgs`: the only parameter of the PortChannel all-reduce's kernels
/// (collectives/src/port_allreduce.cu). `port_allreduce_exchange` reads `chans`, `calls`, `bytes`,
/// `slot_stride`, `npeers`, `rank` and `nranks`; `port_allreduce_reduce` `input`, `output`,
/// `scratch`, `calls`, `count`, `slot_stride`, `rank` and `nranks`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PortAllreduceArgs {
    /// `const PortChannelHandle*`, one channel per peer index.
    pub chans: DevicePtr,
    pub input: DevicePtr,
    pub output: DevicePtr,
    /// This rank's scratch: two parity halves of `nranks` slots of `slot_stride` bytes.
    pub scratch: DevicePtr,
    /// The device call counter (`u64*`), advanced by the exchange kernel.
    pub calls: DevicePtr,
    /// Bytes of this segment (the puts), and the same in elements (the reduction).
    pub bytes: u64,
    pub count: u64,
    pub slot_stride: u64,
    pub npeers: u32,
    pub rank: u32,
    pub nranks: u32,
    pub pad: u32,
}

// ---------------------------------------------------------------------------------------------
// Proxy trigger encoding
// ---------------------------------------------------------------------------------------------

/// Bit layout of [`ProxyTrigger`] (docs/device-abi.md, kernels-cu fifo.cuh).
pub mod trigger_bits {
    pub const SIZE_BITS: u32 = 32;
    pub const SRC_OFFSET_SHIFT: u32 = 32;
    pub const OFFSET_BITS: u32 = 32;
    pub const SRC_MEMORY_ID_SHIFT: u32 = 32;
    pub const DST_MEMORY_ID_SHIFT: u32 = 41;
    pub const MEMORY_ID_BITS: u32 = 9;
    pub const TYPE_SHIFT: u32 = 50;
    pub const TYPE_BITS: u32 = 3;
    pub const SEMAPHORE_ID_SHIFT: u32 = 53;
    pub const SEMAPHORE_ID_BITS: u32 = 10;
    pub const VALID_BIT: u64 = 1 << 63;

    pub(crate) const fn mask(bits: u32) -> u64 {
        (1u64 << bits) - 1
    }
}

/// What a trigger asks the proxy to do; a set of DATA, FLAG and SYNC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TriggerType(u8);

impl TriggerType {
    /// Copy `size` bytes from (src_memory_id, src_offset) to (dst_memory_id, dst_offset).
    pub const DATA: TriggerType = TriggerType(1);
    /// Increment the peer's semaphore `semaphore_id` (after the data of this and earlier triggers).
    pub const FLAG: TriggerType = TriggerType(2);
    /// Flush the connection before marking the trigger consumed.
    pub const SYNC: TriggerType = TriggerType(4);

    pub const fn bits(self) -> u8 {
        self.0
    }
    /// Rejects bits outside DATA|FLAG|SYNC.
    pub fn from_bits(bits: u8) -> Result<Self> {
        if bits & !7 != 0 {
            return Err(Error::InvalidArgument(format!(
                "proxy trigger type bits {bits:#x} outside DATA|FLAG|SYNC (0x7)"
            )));
        }
        Ok(TriggerType(bits))
    }
    pub const fn contains(self, other: TriggerType) -> bool {
        self.0 & other.0 == other.0
    }
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl std::ops::BitOr for TriggerType {
    type Output = TriggerType;
    fn bitor(self, rhs: Self) -> Self {
        TriggerType(self.0 | rhs.0)
    }
}

/// A trigger's fields, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TriggerFields {
    pub kind: TriggerType,
    pub dst_memory_id: u32,
    pub dst_offset: u64,
    pub src_memory_id: u32,
    pub src_offset: u64,
    pub size: u64,
    pub semaphore_id: u32,
}

fn check_width(field: &str, value: u64, bits: u32) -> Result<u64> {
    if value > trigger_bits::mask(bits) {
        return Err(Error::InvalidArgument(format!(
            "proxy trigger field {field} = {value} does not fit in {bits} bits (max {})",
            trigger_bits::mask(bits)
        )));
    }
    Ok(value)
}

impl ProxyTrigger {
    /// Packs `f`; a field too wide for its bits, or an empty type, is an error naming it.
    pub fn encode(f: &TriggerFields) -> Result<Self> {
        use trigger_bits::*;
        if f.kind.is_empty() {
            return Err(Error::InvalidArgument(
                "proxy trigger with no type (need DATA, FLAG and/or SYNC)".to_string(),
            ));
        }
        let size = check_width("size", f.size, SIZE_BITS)?;
        let src_offset = check_width("src_offset", f.src_offset, OFFSET_BITS)?;
        let dst_offset = check_width("dst_offset", f.dst_offset, OFFSET_BITS)?;
        let src_id = check_width("src_memory_id", f.src_memory_id.into(), MEMORY_ID_BITS)?;
        let dst_id = check_width("dst_memory_id", f.dst_memory_id.into(), MEMORY_ID_BITS)?;
        let sem = check_width("semaphore_id", f.semaphore_id.into(), SEMAPHORE_ID_BITS)?;
        Ok(ProxyTrigger {
            fst: size | (src_offset << SRC_OFFSET_SHIFT),
            snd: dst_offset
                | (src_id << SRC_MEMORY_ID_SHIFT)
                | (dst_id << DST_MEMORY_ID_SHIFT)
                | (u64::from(f.kind.bits()) << TYPE_SHIFT)
                | (sem << SEMAPHORE_ID_SHIFT)
                | VALID_BIT,
        })
    }

    /// True when the slot holds a trigger (the valid bit the device sets last).
    pub const fn is_valid(&self) -> bool {
        self.snd & trigger_bits::VALID_BIT != 0
    }

    /// Unpacks the fields, or `None` for an empty slot.
    pub fn decode(&self) -> Option<TriggerFields> {
        use trigger_bits::*;
        if !self.is_valid() {
            return None;
        }
        let field = |word: u64, shift: u32, bits: u32| (word >> shift) & mask(bits);
        Some(TriggerFields {
            // Three bits, so always a valid TriggerType.
            kind: TriggerType(field(self.snd, TYPE_SHIFT, TYPE_BITS) as u8),
            dst_memory_id: field(self.snd, DST_MEMORY_ID_SHIFT, MEMORY_ID_BITS) as u32,
            dst_offset: field(self.snd, 0, OFFSET_BITS),
            src_memory_id: field(self.snd, SRC_MEMORY_ID_SHIFT, MEMORY_ID_BITS) as u32,
            src_offset: field(self.fst, SRC_OFFSET_SHIFT, OFFSET_BITS),
            size: field(self.fst, 0, SIZE_BITS),
            semaphore_id: field(self.snd, SEMAPHORE_ID_SHIFT, SEMAPHORE_ID_BITS) as u32,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Layout description and the C++ static_asserts generated from it
// ---------------------------------------------------------------------------------------------

/// One field of a device struct, as Rust lays it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldLayout {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
}

/// A device struct's name (the same in C++, namespace `mscclpp`), size, alignment and fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StructLayout {
    pub name: &'static str,
    pub size: usize,
    pub align: usize,
    pub fields: Vec<FieldLayout>,
}

/// Size of the field `f` projects to, without needing a value of `T`.
fn field_size<T, F>(_project: fn(&T) -> &F) -> usize {
    size_of::<F>()
}

macro_rules! struct_layout {
    ($ty:ident { $($field:ident),+ $(,)? }) => {
        struct_layout!("", $ty { $($field),+ })
    };
    ($prefix:literal, $ty:ident { $($field:ident),+ $(,)? }) => {
        StructLayout {
            name: concat!($prefix, stringify!($ty)),
            size: size_of::<$ty>(),
            align: align_of::<$ty>(),
            fields: vec![$(FieldLayout {
                name: stringify!($field),
                offset: offset_of!($ty, $field),
                size: field_size(|s: &$ty| &s.$field),
            }),+],
        }
    };
}

/// Every device struct with every field.
pub fn layouts() -> Vec<StructLayout> {
    vec![
        struct_layout!(D2DSemaphoreHandle {
            inbound,
            expected,
            remote_inbound,
            error_word,
            max_spin
        }),
        struct_layout!(H2DSemaphoreHandle {
            inbound,
            expected,
            error_word,
            max_spin
        }),
        struct_layout!(MemoryChannelHandle {
            semaphore,
            dst,
            src,
            packet_buffer
        }),
        struct_layout!(ProxyTrigger { fst, snd }),
        struct_layout!(FifoHandle {
            triggers,
            head,
            tail,
            size,
            pad,
            error_word,
            max_spin,
            tail_cache
        }),
        struct_layout!(PortChannelHandle {
            fifo,
            semaphore,
            semaphore_id,
            dst_memory_id,
            src_memory_id,
            pad
        }),
        struct_layout!(SwitchChannelHandle {
            device_ptr,
            mc_ptr,
            size
        }),
        struct_layout!(LL16Packet {
            data1,
            flag1,
            data2,
            flag2
        }),
        struct_layout!(LL8Packet { data, flag }),
        struct_layout!("coll::", PeerPtrs { p }),
        struct_layout!(
            "coll::",
            PacketArgs {
                input,
                output,
                count,
                peer_scratch,
                local_scratch,
                slot_bytes,
                half_bytes,
                state,
                error_word,
                max_spin,
                rank,
                nranks
            }
        ),
        struct_layout!(
            "coll::",
            PipelineArgs {
                input,
                output,
                count,
                peer_scratch,
                peer_outputs,
                local_scratch,
                slot_bytes,
                half_bytes,
                step,
                sems,
                state,
                error_word,
                max_spin,
                rank,
                nranks
            }
        ),
        struct_layout!(
            "coll::",
            ZeroCopyArgs {
                inputs,
                outputs,
                input,
                output,
                count,
                sems,
                error_word,
                max_spin,
                rank,
                root,
                nranks,
                pad
            }
        ),
        struct_layout!(
            "coll::",
            PortAllreduceArgs {
                chans,
                input,
                output,
                scratch,
                calls,
                bytes,
                count,
                slot_stride,
                npeers,
                rank,
                nranks,
                pad
            }
        ),
        struct_layout!(
            "coll::",
            CopyEngineArgs {
                srcs,
                output,
                count,
                sems,
                error_word,
                max_spin,
                nsrc,
                nranks,
                npeers,
                mode
            }
        ),
    ]
}

/// Whether `layout` belongs to the native collectives (`mscclpp::coll`, declared in
/// collective_common.cuh rather than in the device headers).
pub fn is_collective_layout(layout: &StructLayout) -> bool {
    layout.name.starts_with("coll::")
}

/// C++ `static_assert`s on sizeof/alignof/offsetof of every struct and field, computed from the
/// Rust layout. Appended to a translation unit that includes the device headers, they make any
/// drift between the two sides a compile error.
pub fn layout_static_asserts() -> String {
    static_asserts(layouts().iter().filter(|l| !is_collective_layout(l)))
}

/// [`layout_static_asserts`] for the native collectives' argument structs: append it to a unit of
/// `mscclpp_kernels_cu::collectives` (which holds collective_common.cuh).
pub fn collective_layout_static_asserts() -> String {
    static_asserts(layouts().iter().filter(|l| is_collective_layout(l)))
}

fn static_asserts<'a>(structs: impl Iterator<Item = &'a StructLayout>) -> String {
    let mut out = String::from("// Generated by mscclpp_core::device::layout_static_asserts().\n");
    for s in structs {
        out += &format!(
            "static_assert(sizeof(mscclpp::{0}) == {1}, \"mscclpp::{0}: size differs from core/src/device.rs ({1})\");\n",
            s.name, s.size
        );
        out += &format!(
            "static_assert(alignof(mscclpp::{0}) == {1}, \"mscclpp::{0}: alignment differs from core/src/device.rs ({1})\");\n",
            s.name, s.align
        );
        for f in &s.fields {
            out += &format!(
                "static_assert(offsetof(mscclpp::{0}, {1}) == {2}, \"mscclpp::{0}::{1}: offset differs from core/src/device.rs ({2})\");\n",
                s.name, f.name, f.offset
            );
            out += &format!(
                "static_assert(sizeof(mscclpp::{0}::{1}) == {2}, \"mscclpp::{0}::{1}: size differs from core/src/device.rs ({2})\");\n",
                s.name, f.name, f.size
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case("D2DSemaphoreHandle", 40, 8)]
    #[case("H2DSemaphoreHandle", 32, 8)]
    #[case("MemoryChannelHandle", 64, 8)]
    #[case("ProxyTrigger", 16, 16)]
    #[case("FifoHandle", 56, 8)]
    #[case("PortChannelHandle", 104, 8)]
    #[case("SwitchChannelHandle", 24, 8)]
    #[case("LL16Packet", 16, 16)]
    #[case("LL8Packet", 8, 8)]
    #[case("coll::PeerPtrs", 64, 8)]
    #[case("coll::PacketArgs", 144, 8)]
    #[case("coll::PipelineArgs", 224, 8)]
    #[case("coll::ZeroCopyArgs", 192, 8)]
    #[case("coll::CopyEngineArgs", 120, 8)]
    #[case("coll::PortAllreduceArgs", 80, 8)]
    fn sizes_match_the_abi_document(#[case] name: &str, #[case] size: usize, #[case] align: usize) {
        let l = layouts()
            .into_iter()
            .find(|l| l.name == name)
            .unwrap_or_else(|| panic!("{name} missing from layouts()"));
        assert_eq!((l.size, l.align), (size, align), "{name}");
    }

    /// The fields listed tile the struct exactly: no implicit padding (so `as_bytes` is sound) and
    /// no field forgotten in `layouts()` (so the C++ asserts cover every field).
    #[test]
    fn layouts_have_no_implicit_padding() {
        for l in layouts() {
            let mut fields = l.fields.clone();
            fields.sort_by_key(|f| f.offset);
            let mut end = 0;
            for f in &fields {
                assert_eq!(
                    f.offset, end,
                    "{}::{} leaves a gap before it",
                    l.name, f.name
                );
                end = f.offset + f.size;
            }
            assert_eq!(
                end, l.size,
                "{} has trailing padding or unlisted fields",
                l.name
            );
        }
    }

    #[test]
    fn static_asserts_cover_every_field() {
        let text = layout_static_asserts() + &collective_layout_static_asserts();
        for l in layouts() {
            assert!(text.contains(&format!("sizeof(mscclpp::{}) == {}", l.name, l.size)));
            for f in &l.fields {
                assert!(text.contains(&format!(
                    "offsetof(mscclpp::{}, {}) == {}",
                    l.name, f.name, f.offset
                )));
            }
        }
        assert!(text.contains("offsetof(mscclpp::PortChannelHandle, semaphore) == 56"));
        assert!(text.contains("offsetof(mscclpp::MemoryChannelHandle, packet_buffer) == 56"));
    }

    #[test]
    fn as_bytes_is_the_little_endian_struct() {
        let h = MemoryChannelHandle {
            dst: 0x1122_3344_5566_7788,
            ..Default::default()
        };
        let b = h.as_bytes();
        assert_eq!(b.len(), 64);
        assert_eq!(&b[40..48], &0x1122_3344_5566_7788u64.to_le_bytes());
        let pkts = [
            LL8Packet { data: 1, flag: 2 },
            LL8Packet { data: 3, flag: 4 },
        ];
        assert_eq!(
            LL8Packet::slice_as_bytes(&pkts),
            &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0]
        );
    }

    fn data(size: u64) -> TriggerFields {
        TriggerFields {
            kind: TriggerType::DATA,
            size,
            ..Default::default()
        }
    }

    /// One field set to 1 lands on exactly the documented bit.
    #[rstest]
    #[case(data(1), 1, 1 << 63)]
    #[case(TriggerFields { src_offset: 1, ..data(0) }, 1 << 32, 1 << 63)]
    #[case(TriggerFields { dst_offset: 1, ..data(0) }, 0, 1 | (1 << 63))]
    #[case(TriggerFields { src_memory_id: 1, ..data(0) }, 0, (1 << 32) | (1 << 63))]
    #[case(TriggerFields { dst_memory_id: 1, ..data(0) }, 0, (1 << 41) | (1 << 63))]
    #[case(TriggerFields { semaphore_id: 1, ..data(0) }, 0, (1 << 53) | (1 << 63))]
    #[case(TriggerFields { kind: TriggerType::FLAG, ..data(0) }, 0, (1 << 51) | (1 << 63))]
    #[case(TriggerFields { kind: TriggerType::SYNC, ..data(0) }, 0, (1 << 52) | (1 << 63))]
    fn trigger_bit_positions(#[case] f: TriggerFields, #[case] fst: u64, #[case] snd: u64) {
        let mut f = f;
        if f.kind != TriggerType::DATA {
            f.size = 0;
        }
        let t = ProxyTrigger::encode(&f).expect("encodes");
        // DATA is bit 50 of snd; strip it for the cases that did not ask for another type.
        let data_bit = if f.kind == TriggerType::DATA {
            1 << 50
        } else {
            0
        };
        assert_eq!((t.fst, t.snd), (fst, snd | data_bit), "{f:?}");
        assert_eq!(t.decode(), Some(f));
    }

    #[test]
    fn trigger_all_ones_and_round_trip() {
        let f = TriggerFields {
            kind: TriggerType::DATA | TriggerType::FLAG | TriggerType::SYNC,
            dst_memory_id: 511,
            dst_offset: u32::MAX.into(),
            src_memory_id: 511,
            src_offset: u32::MAX.into(),
            size: u32::MAX.into(),
            semaphore_id: 1023,
        };
        let t = ProxyTrigger::encode(&f).expect("encodes");
        assert_eq!((t.fst, t.snd), (u64::MAX, u64::MAX));
        assert_eq!(t.decode(), Some(f));
        let g = TriggerFields {
            kind: TriggerType::DATA | TriggerType::FLAG,
            dst_memory_id: 300,
            dst_offset: 0xdead_beef,
            src_memory_id: 7,
            src_offset: 0x1234_5678,
            size: 4096,
            semaphore_id: 513,
        };
        assert_eq!(
            ProxyTrigger::encode(&g)
                .and_then(|t| t.decode().ok_or_else(|| Error::Internal("empty".into())))
                .unwrap(),
            g
        );
        assert!(g.kind.contains(TriggerType::FLAG) && !g.kind.contains(TriggerType::SYNC));
    }

    #[test]
    fn empty_slot_decodes_to_none() {
        assert_eq!(ProxyTrigger::default().decode(), None);
        assert!(!ProxyTrigger {
            fst: 5,
            snd: 1 << 50
        }
        .is_valid());
    }

    #[rstest]
    #[case(data(1 << 32), "size")]
    #[case(TriggerFields { src_offset: 1 << 32, ..data(0) }, "src_offset")]
    #[case(TriggerFields { dst_offset: 1 << 32, ..data(0) }, "dst_offset")]
    #[case(TriggerFields { src_memory_id: 512, ..data(0) }, "src_memory_id")]
    #[case(TriggerFields { dst_memory_id: 512, ..data(0) }, "dst_memory_id")]
    #[case(TriggerFields { semaphore_id: 1024, ..data(0) }, "semaphore_id")]
    #[case(TriggerFields { kind: TriggerType::default(), ..data(0) }, "no type")]
    fn trigger_overflow_names_the_field(#[case] f: TriggerFields, #[case] field: &str) {
        let err = ProxyTrigger::encode(&f).unwrap_err().to_string();
        assert!(err.contains(field), "{err}");
    }

    #[test]
    fn trigger_type_bits() {
        assert!(TriggerType::from_bits(8).is_err());
        assert_eq!(TriggerType::from_bits(5).map(|t| t.bits()).ok(), Some(5));
    }

    #[test]
    fn device_error_words() {
        assert!(check_device_error(0, "allreduce").is_ok());
        for code in 1..=5 {
            let err = check_device_error(code, "allreduce rank 3")
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("allreduce rank 3") && err.contains(&format!("code {code}")),
                "{err}"
            );
        }
        assert!(describe_device_error(77).contains("77"));
    }
}
