//! Device-side resources of a native algorithm: owned device memory, scratch shared with peers,
//! per-block semaphores and the compiled kernels.

use mscclpp_core::communicator::{Communicator, RegisteredMemory};
use mscclpp_core::device::{D2DSemaphoreHandle, DeviceRepr};
use mscclpp_core::gpu::{
    Allocation, DevicePtr, Function, Gpu, HostMapped, MemoryKind, Module, Stream,
};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::alltoall::{AlltoallState, TABLE_SCRATCH_BYTES};
use mscclpp_kernels_cu::collectives::{
    self as kc, CallState, CollectiveFile, PeerPtrs, ReduceSpec,
};
use mscclpp_kernels_cu::p2p::P2pState;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub(crate) fn lock<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    m.lock().map_err(|_| {
        Error::Internal("a collective's resource table was poisoned by a panic".into())
    })
}

/// Device memory freed on drop.
pub struct DeviceBuffer {
    gpu: Arc<dyn Gpu>,
    alloc: Allocation,
}

impl DeviceBuffer {
    /// `bytes` of zeroed device memory (zeroed synchronously: this runs at setup only).
    pub fn zeroed(gpu: &Arc<dyn Gpu>, bytes: usize) -> Result<DeviceBuffer> {
        DeviceBuffer::zeroed_as(gpu, bytes, MemoryKind::Plain)
    }

    /// As [`DeviceBuffer::zeroed`], of memory `kind`.
    pub fn zeroed_as(gpu: &Arc<dyn Gpu>, bytes: usize, kind: MemoryKind) -> Result<DeviceBuffer> {
        let alloc = gpu.alloc(bytes.max(1), kind)?;
        let buf = DeviceBuffer {
            gpu: gpu.clone(),
            alloc,
        };
        gpu.memset_async(buf.ptr(), 0, bytes.max(1), Stream::DEFAULT)?;
        gpu.synchronize_stream(Stream::DEFAULT)?;
        Ok(buf)
    }

    /// Device memory holding a copy of `items` (plain `#[repr(C)]` handles).
    pub fn upload<T>(gpu: &Arc<dyn Gpu>, items: &[T]) -> Result<DeviceBuffer> {
        let buf = DeviceBuffer::zeroed(gpu, std::mem::size_of_val(items))?;
        buf.write(0, items)?;
        Ok(buf)
    }

    /// Copies `items` (plain `#[repr(C)]` handles) to `offset` bytes into the buffer
    /// (synchronously: setup only).
    pub fn write<T>(&self, offset: usize, items: &[T]) -> Result<()> {
        let bytes = std::mem::size_of_val(items);
        if offset + bytes > self.alloc.size {
            return Err(Error::Internal(format!(
                "writing {bytes} bytes at offset {offset} of a device buffer of {}",
                self.alloc.size
            )));
        }
        // SAFETY: `items` is a live slice of `bytes` bytes; the handle types uploaded here are
        // `#[repr(C)]` structs of integers and pointers with no padding the device relies on.
        let raw = unsafe { std::slice::from_raw_parts(items.as_ptr() as *const u8, bytes) };
        self.gpu.copy_to_device(self.ptr() + offset as u64, raw)
    }

    pub fn ptr(&self) -> DevicePtr {
        self.alloc.ptr
    }
    pub fn allocation(&self) -> &Allocation {
        &self.alloc
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.free(&self.alloc) {
            tracing::warn!(target: "mscclpp::coll", "freeing {} bytes of device memory failed: {e}", self.alloc.size);
        }
    }
}

/// Pinned host memory mapped for kernels, zero-filled, freed on drop: a record a kernel fills and
/// the host reads with one load, no sync (the point-to-point engines' mismatch records).
pub struct HostMappedBuffer {
    gpu: Arc<dyn Gpu>,
    mem: HostMapped,
}

impl HostMappedBuffer {
    pub fn zeroed(gpu: &Arc<dyn Gpu>, bytes: usize) -> Result<HostMappedBuffer> {
        Ok(HostMappedBuffer {
            mem: gpu.alloc_host_mapped(bytes)?,
            gpu: gpu.clone(),
        })
    }

    /// The address kernels use.
    pub fn device_ptr(&self) -> DevicePtr {
        self.mem.device_ptr
    }

    /// The address the host reads; valid while `self` lives.
    pub fn host_ptr(&self) -> *mut u8 {
        self.mem.host_ptr
    }
}

impl Drop for HostMappedBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.free_host_mapped(&self.mem) {
            tracing::warn!(target: "mscclpp::coll", "freeing {} bytes of host-mapped memory failed: {e}", self.mem.size);
        }
    }
}

/// Scratch memory of this rank that every peer maps (packet algorithms write into it).
pub struct SharedScratch {
    comm: Arc<Communicator>,
    /// Every rank's scratch as mapped here; dropped before `local` is freed.
    peers: Vec<RegisteredMemory>,
    local: Option<DeviceBuffer>,
}

impl SharedScratch {
    /// Collective: allocates and zeroes `bytes`, then exchanges it with every rank.
    pub fn new(comm: &Arc<Communicator>, bytes: usize) -> Result<SharedScratch> {
        SharedScratch::with_private_tail(comm, bytes, 0)
    }

    /// As [`SharedScratch::new`], with `tail` more bytes after the shared ones that only this rank
    /// uses (at `local_ptr() + bytes`): small device state then costs no allocation of its own
    /// (each is rounded up to `PLAIN_ALLOCATION_GRANULE`, 2 MiB).
    pub fn with_private_tail(
        comm: &Arc<Communicator>,
        bytes: usize,
        tail: usize,
    ) -> Result<SharedScratch> {
        let kind = comm.gpu().shared_memory_kind(comm.device());
        let local = DeviceBuffer::zeroed_as(comm.gpu(), bytes + tail, kind)?;
        let reg = comm.register(local.allocation(), local.ptr(), bytes)?;
        let peers = comm.exchange(reg)?;
        Ok(SharedScratch {
            comm: comm.clone(),
            peers,
            local: Some(local),
        })
    }

    pub fn local_ptr(&self) -> DevicePtr {
        self.local.as_ref().map_or(0, DeviceBuffer::ptr)
    }

    /// Every rank's scratch address in this process, by rank.
    pub fn rank_ptrs(&self) -> Vec<DevicePtr> {
        self.peers.iter().map(RegisteredMemory::ptr).collect()
    }
}

impl Drop for SharedScratch {
    fn drop(&mut self) {
        // After a failure our own kernels may still run on this scratch (and on the peers' we
        // mapped): drain them first; if that cannot be known, leak it (a leak lasts until the
        // process ends, freeing it under a running kernel faults the context).
        let idle = self.comm.drain_after_failure("the shared scratch");
        if !idle {
            // Leaked on purpose, mappings of the peers' scratch included (see above).
            tracing::warn!(target: "mscclpp::coll", "leaving the shared scratch allocated and mapped until the process ends");
            std::mem::forget(std::mem::take(&mut self.peers));
            std::mem::forget(self.local.take());
            return;
        }
        self.peers.clear();
        // Peers must unmap our scratch before we free it; the bootstrap barrier is bounded, so a
        // dead peer delays teardown but cannot hang it. A failed communicator skips it, as the
        // communicator's own teardown does: the peer may be stopped or blocked in another call,
        // and the barrier would hold this rank for the whole bootstrap timeout.
        if self.comm.async_error().is_none() {
            if let Err(e) = self.comm.bootstrap().barrier() {
                tracing::warn!(target: "mscclpp::coll", "scratch teardown barrier failed: {e}");
            }
        }
        self.local.take();
    }
}

/// The three parts of a collection's scratch. Users of one part share it; parts never overlap, so
/// a reader never mistakes another format's stale bytes for its own data: an LL16 reader would
/// accept any stale word equal to its flag, and LL128 lines only stay safe because every LL128
/// user puts its flags at the same 128-byte positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScratchPart {
    /// LL16 packets (`default_allreduce_allpair_packet`).
    Ll16,
    /// LL128 lines (the two-phase packet all-reduce, the packet all-gather and reduce-scatter).
    Ll128,
    /// Raw staged data (the scratch pipelines). The copy-engine all-reduce's ring is this part and
    /// the LL128 part behind it; it zeroes what it used of the LL128 part before its last barrier
    /// (0 is never a flag).
    Staging,
}

/// One part of the scratch as the kernels see it.
#[derive(Debug, Clone, Copy)]
pub struct ScratchRegion {
    /// Every rank's address of the part, by rank.
    pub peers: PeerPtrs,
    pub local: DevicePtr,
    pub bytes: usize,
}

impl ScratchRegion {
    /// Offset of the second half: whole LL128 lines and 16-byte vectors.
    pub fn half_bytes(&self) -> usize {
        self.bytes / 2 / 128 * 128
    }
}

/// The device resources of a collection, owned once and lent to its algorithms: one scratch every
/// peer maps, in three parts ([`ScratchPart`]), the call counter its users share, one table of
/// per-block semaphores (every kind that barriers uses its first blocks), and the all-to-all
/// exchange's state (`AlltoallState`: its failure count and mismatch report). Built once per
/// collection (collective), at build time rather than on first use (building is collective, and a
/// call being captured in a CUDA graph must not allocate); the counter and the table live in the
/// scratch's allocation, past the shared bytes, so the whole is one allocation of the bytes asked.
///
/// Why sharing a part is safe: a call on a part uses its half `(calls & 1) * half_bytes` (the
/// pipelines per step) and advances the one shared [`CallState`]. Whichever algorithm ran last, a
/// call either follows the part's previous user directly (and takes the other half), or a
/// collective call came in between, which this rank only completed once every peer had started it,
/// so every peer had finished reading the part (stream order). Either way a peer still reading is
/// never overwritten. The copy-engine all-reduce takes whole parts, between barriers with every
/// peer. Sharing the semaphores is safe because every call signals and waits each semaphore it uses
/// equally often on every rank, in stream order (the all-to-all exchange passes both its barriers
/// on every rank even when the counts disagree, see kernels/alltoall.cu).
///
/// The all-to-all exchange's tables ([`Self::alltoall_tables`]) are the first
/// `TABLE_SCRATCH_BYTES` of the staging part, in neither half in particular: an exchange is a full
/// barrier at both ends (every block of every rank pairs with every peer before its first read of
/// a table and after its last), so no call before it still writes there when it writes its table,
/// and no call after it writes there before every peer read it. Stale table bytes are harmless to
/// the staging part's other users, which read only what a peer pushed in the same step, after a
/// barrier (no flags there, unlike the packet parts). The rest of the staging part is also the
/// all-to-all family's copy space ([`Self::alltoall_stage`]), in the same window.
///
/// Rule for callers: the calls of one collection must be ordered on the device (one stream, or
/// streams ordered by events), as NCCL requires of one communicator's collectives; calls on
/// unordered streams would share halves and semaphores. Another collection has its own resources.
///
/// The point-to-point region ([`Self::with_p2p`], the default collection's): the region of one
/// `p2p::P2pEngine` (`p2p::plan::Layout`), every peer mapping it, after the LL128 part, with the
/// engine's `P2pState` at the end of the private tail; the staging part gives up its bytes, so the
/// whole stays one allocation of the same granules (30 MiB with the default scratch at 2 to 8
/// ranks). It is in no part and no algorithm of the collection touches it: point-to-point groups
/// are not collective (a rank's sends and receives need not follow the collection's calls in step
/// with its peers, and may run on another stream than its collectives), so the halves argument
/// above does not hold for them; their own protocol (per-channel chunk numbers, credits and posts,
/// see kernels/p2p.cu) is what keeps them safe, and it holds only while one engine owns the
/// region, so an engine claims it ([`Self::claim_p2p`]) until it is dropped. A later engine on the
/// same resources carries on from the counters and slot headers its predecessor left, as every rank
/// does alike.
pub struct CollectionResources {
    /// Every rank's scratch address, by rank.
    peers: PeerPtrs,
    /// Byte offsets of the parts, in the order LL16, staging, LL128 (the copy engine's ring is the
    /// last two, contiguous), and the end of the scratch.
    bounds: [usize; 4],
    semaphore_blocks: u32,
    /// Bytes of the semaphore table (the tail's second field).
    semaphore_table_bytes: usize,
    /// Bytes of the point-to-point region after the LL128 part (0: none).
    p2p_bytes: usize,
    /// Whether an engine holds the point-to-point region.
    p2p_claimed: AtomicBool,
    scratch: SharedScratch,
}

/// The point-to-point region of a collection as an engine sees it (see [`CollectionResources`]).
#[derive(Debug, Clone, Copy)]
pub struct P2pRegion {
    pub region: ScratchRegion,
    /// This rank's `P2pState`, zeroed at creation.
    pub state: DevicePtr,
}

impl CollectionResources {
    /// Collective: allocates, zeroed, the scratch every rank maps (parts sized by
    /// [`scratch_bounds`] from the builder's `scratch_bytes`), then the call counter and
    /// `semaphore_blocks` blocks of semaphores towards every peer.
    pub fn new(
        comm: &Arc<Communicator>,
        scratch_bytes: usize,
        semaphore_blocks: u32,
    ) -> Result<CollectionResources> {
        CollectionResources::build(comm, scratch_bytes, semaphore_blocks, 0)
    }

    /// As [`Self::new`], with the point-to-point region for `comm`'s world size after the scratch
    /// (see the type's docs): the default collection's resources.
    pub fn with_p2p(
        comm: &Arc<Communicator>,
        scratch_bytes: usize,
        semaphore_blocks: u32,
    ) -> Result<CollectionResources> {
        let p2p_bytes = crate::p2p::plan::layout(comm.size()).region_bytes;
        CollectionResources::build(comm, scratch_bytes, semaphore_blocks, p2p_bytes)
    }

    fn build(
        comm: &Arc<Communicator>,
        scratch_bytes: usize,
        semaphore_blocks: u32,
        p2p_bytes: usize,
    ) -> Result<CollectionResources> {
        let table = semaphore_table(comm, semaphore_blocks)?;
        let semaphore_table_bytes = std::mem::size_of_val(table.as_slice());
        let tail = private_tail_bytes(semaphore_table_bytes, p2p_bytes);
        // The staging part gives up the point-to-point region's bytes as it does the tail's.
        let bounds = scratch_bounds(scratch_bytes, tail + p2p_bytes);
        if bounds.windows(2).any(|w| w[1] <= w[0]) {
            return Err(Error::InvalidArgument(format!(
                "a scratch of {scratch_bytes} bytes is too small for a collection (its call \
                 counter and semaphores take {tail} bytes)"
            )));
        }
        // Zeroed memory is CallState::default() (every per-block slot at call 0),
        // AlltoallState::default() and P2pState::default().
        let scratch = SharedScratch::with_private_tail(comm, bounds[3] + p2p_bytes, tail)?;
        let resources = CollectionResources {
            peers: PeerPtrs::from_slice(&scratch.rank_ptrs())?,
            bounds,
            semaphore_blocks,
            semaphore_table_bytes,
            p2p_bytes,
            p2p_claimed: AtomicBool::new(false),
            scratch,
        };
        comm.gpu().copy_to_device(
            resources.semaphores_ptr(),
            DeviceRepr::slice_as_bytes(&table),
        )?;
        Ok(resources)
    }

    /// Bytes of the whole scratch.
    pub fn bytes(&self) -> usize {
        self.bounds[3]
    }

    /// Byte range of `part` in the scratch.
    fn range(&self, part: ScratchPart) -> (usize, usize) {
        let b = &self.bounds;
        match part {
            ScratchPart::Ll16 => (b[0], b[1]),
            ScratchPart::Staging => (b[1], b[2]),
            ScratchPart::Ll128 => (b[2], b[3]),
        }
    }

    /// `part` of the scratch as the kernels see it.
    pub fn region(&self, part: ScratchPart) -> ScratchRegion {
        let (begin, end) = self.range(part);
        self.region_between(begin, end)
    }

    /// The copy-engine all-reduce's ring (staging then LL128), and the offset in it where the
    /// LL128 part begins (what it must zero after use).
    pub fn copy_engine_ring(&self) -> (ScratchRegion, usize) {
        let (begin, ll128) = (self.bounds[1], self.bounds[2]);
        (self.region_between(begin, self.bounds[3]), ll128 - begin)
    }

    fn region_between(&self, begin: usize, end: usize) -> ScratchRegion {
        let mut peers = self.peers;
        for p in peers.p.iter_mut().filter(|p| **p != 0) {
            *p += begin as u64;
        }
        ScratchRegion {
            peers,
            local: self.scratch.local_ptr() + begin as u64,
            bytes: end - begin,
        }
    }

    /// The shared `coll::CallState`, the private tail's first field (after the shared bytes).
    pub fn state_ptr(&self) -> DevicePtr {
        self.scratch.local_ptr() + (self.bounds[3] + self.p2p_bytes) as u64
    }

    /// The semaphore table, `[block][peer index]` as the kernels index it.
    pub fn semaphores_ptr(&self) -> DevicePtr {
        self.state_ptr() + std::mem::size_of::<CallState>() as u64
    }

    /// Blocks of semaphores the table holds: no kernel may barrier with more blocks.
    pub fn semaphore_blocks(&self) -> u32 {
        self.semaphore_blocks
    }

    /// The all-to-all exchange's `AlltoallState`, after the semaphore table.
    pub fn alltoall_state_ptr(&self) -> DevicePtr {
        self.semaphores_ptr() + self.semaphore_table_bytes as u64
    }

    /// The point-to-point region, for one engine until [`Self::release_p2p`]; `None` where these
    /// resources have none or an engine holds it.
    pub fn claim_p2p(&self) -> Option<P2pRegion> {
        if self.p2p_bytes == 0 || self.p2p_claimed.swap(true, Ordering::AcqRel) {
            return None;
        }
        let state = self.alltoall_state_ptr() + std::mem::size_of::<AlltoallState>() as u64;
        Some(P2pRegion {
            region: self.region_between(self.bounds[3], self.bounds[3] + self.p2p_bytes),
            state,
        })
    }

    /// Gives the point-to-point region back (its engine is gone; its kernels were ordered before
    /// any later engine's by the caller, as for any reuse of device memory).
    pub fn release_p2p(&self) {
        self.p2p_claimed.store(false, Ordering::Release);
    }

    /// The all-to-all exchange's table space (see the type's docs): the start of the staging part,
    /// or an error naming the sizes where the builder's scratch leaves it too small.
    pub fn alltoall_tables(&self) -> Result<ScratchRegion> {
        let (begin, end) = self.range(ScratchPart::Staging);
        if end - begin < TABLE_SCRATCH_BYTES {
            return Err(Error::InvalidArgument(format!(
                "the collection's staging part ({} bytes) cannot hold the all-to-all tables \
                 ({TABLE_SCRATCH_BYTES} bytes): give the builder a larger scratch",
                end - begin
            )));
        }
        Ok(self.region_between(begin, begin + TABLE_SCRATCH_BYTES))
    }

    /// The rest of the staging part after the all-to-all tables (see the type's docs; `bytes` 0
    /// where the tables take it all): where the all-to-all exchange copies a rank's input before
    /// an in-place call and a gather's or scatter's senders copy what they send (their peers read
    /// it there instead of a registered buffer). A copy there is written after this rank's previous
    /// call ended and before its exchange kernel's start barrier, and read before its end barrier,
    /// the same window as the tables': every part of the staging part a peer stores into is read
    /// by this rank within the call that stored it, so none is still in flight when this rank's
    /// next call starts, and no peer stores into it again before that exchange's end barrier.
    pub fn alltoall_stage(&self) -> ScratchRegion {
        let (begin, end) = self.range(ScratchPart::Staging);
        let begin = (begin + TABLE_SCRATCH_BYTES).min(end);
        self.region_between(begin, end)
    }
}

/// Bytes of a collection's private tail: [CallState][semaphores [block][peer index]]
/// [AlltoallState], and the point-to-point engine's P2pState where it has a region.
pub fn private_tail_bytes(semaphore_table_bytes: usize, p2p_bytes: usize) -> usize {
    let p2p_state = if p2p_bytes > 0 {
        std::mem::size_of::<P2pState>()
    } else {
        0
    };
    std::mem::size_of::<CallState>()
        + semaphore_table_bytes
        + std::mem::size_of::<AlltoallState>()
        + p2p_state
}

/// Offsets of the parts (LL16, staging, LL128, end) for the builder's `scratch_bytes` s, with `tail`
/// private bytes behind them: LL16 s/2, staging s less the tail, LL128 9s/4, each whole 64 KiB units
/// (so every slot and line stays aligned). With the default 8 MiB: 4 MiB, the staging part (7 MiB
/// at 3 to 8 ranks, 7.375 MiB at 2, the tail taking the rest of its 8 MiB) and 18 MiB, one
/// allocation of 30 MiB. See `crate::DEFAULT_SCRATCH_BYTES` for what they hold.
pub fn scratch_bounds(scratch_bytes: usize, tail: usize) -> [usize; 4] {
    const UNIT: usize = 64 << 10;
    let units = |bytes: usize| bytes / UNIT * UNIT;
    let ll16 = units(scratch_bytes / 2);
    let staging = units(scratch_bytes.saturating_sub(tail));
    let ll128 = units(scratch_bytes / 4 * 9);
    [0, ll16, ll16 + staging, ll16 + staging + ll128]
}

/// Collective: `max_blocks` semaphores towards every peer, interleaved to `[block][peer index]`.
fn semaphore_table(comm: &Communicator, max_blocks: u32) -> Result<Vec<D2DSemaphoreHandle>> {
    let me = comm.rank();
    let mut per_peer = Vec::new();
    for peer in (0..comm.size()).filter(|&p| p != me) {
        per_peer.push(comm.d2d_semaphores(peer, max_blocks as usize)?);
    }
    // Moving the handles out needs no Copy/Clone.
    let mut columns: Vec<_> = per_peer.into_iter().map(Vec::into_iter).collect();
    let mut table = Vec::with_capacity(max_blocks as usize * columns.len());
    for b in 0..max_blocks {
        for (i, column) in columns.iter_mut().enumerate() {
            table.push(column.next().ok_or_else(|| {
                Error::Internal(format!("semaphore {b} towards peer index {i} missing"))
            })?);
        }
    }
    Ok(table)
}

/// Semaphores for per-block barriers: `max_blocks` per peer, laid out `[block][peer index]` in
/// device memory as the kernels index them.
pub struct BlockSemaphores {
    buf: DeviceBuffer,
    max_blocks: u32,
}

impl BlockSemaphores {
    /// Collective: every rank builds the same algorithms in the same order.
    pub fn new(comm: &Communicator, max_blocks: u32) -> Result<BlockSemaphores> {
        let table = semaphore_table(comm, max_blocks)?;
        Ok(BlockSemaphores {
            buf: DeviceBuffer::upload(comm.gpu(), &table)?,
            max_blocks,
        })
    }

    pub fn ptr(&self) -> DevicePtr {
        self.buf.ptr()
    }
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }
}

/// Compiled kernels by (unit, entry point); each unit is compiled once per process (and cached on
/// disk by the backend).
#[derive(Default)]
pub struct KernelTable {
    modules: Mutex<HashMap<String, Module>>,
    /// Keyed by what identifies the unit, not its name: the hot path of every call looks here, and
    /// formatting the unit name each time would cost an allocation per collective.
    functions: Mutex<HashMap<FunctionKey, Function>>,
}

type FunctionKey = (CollectiveFile, Option<ReduceSpec>, &'static str);

impl KernelTable {
    pub fn function(
        &self,
        gpu: &dyn Gpu,
        file: CollectiveFile,
        spec: Option<ReduceSpec>,
        entry: &'static str,
    ) -> Result<Function> {
        if let Some(f) = lock(&self.functions)?.get(&(file, spec, entry)) {
            return Ok(*f);
        }
        let unit = kc::unit_name(file, spec);
        let module = {
            let mut modules = lock(&self.modules)?;
            match modules.get(&unit) {
                Some(m) => *m,
                None => {
                    let m = gpu.build_module(&unit, &kc::unit_source(file, spec)?)?;
                    modules.insert(unit.clone(), m);
                    m
                }
            }
        };
        let f = gpu.get_function(module, entry)?;
        lock(&self.functions)?.insert((file, spec, entry), f);
        Ok(f)
    }
}

/// A kernel parameter slot for `Gpu::launch`: the address of a local holding the argument value.
pub(crate) fn param_ptr<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}

/// Launches `f`, whose only parameter is the argument struct `args` (one of
/// `mscclpp_core::device`'s `coll::*Args`, layout-checked against collective_common.cuh).
pub(crate) fn launch_with_args<A: mscclpp_core::device::DeviceRepr>(
    gpu: &dyn Gpu,
    f: Function,
    cfg: mscclpp_core::gpu::LaunchConfig,
    stream: Stream,
    mut args: A,
) -> Result<()> {
    let mut params = [param_ptr(&mut args)];
    // SAFETY: every native kernel takes exactly one argument struct by value, of the family the
    // caller picked `f` from; `args` outlives the call, and its device addresses are the caller's
    // checked buffers and our own live resources.
    unsafe { gpu.launch(f, cfg, stream, &mut params) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_parts_tile_the_default_scratch() {
        // The default scratch, with the call counter, an 8-rank, 256-block semaphore table and the
        // all-to-all state: the whole collection, all-to-all family included, is one allocation.
        let tail =
            std::mem::size_of::<CallState>() + 256 * 7 * 40 + std::mem::size_of::<AlltoallState>();
        let b = scratch_bounds(8 << 20, tail);
        assert_eq!(b[0], 0);
        assert_eq!(b[1], 4 << 20, "LL16");
        assert_eq!(b[3] - b[2], 18 << 20, "LL128");
        assert_eq!(b[2] - b[1], (8 << 20) - (128 << 10), "staging");
        // One allocation of 30 MiB (Plain allocations are whole 2 MiB granules).
        assert_eq!(
            mscclpp_core::gpu::plain_allocation_bytes(b[3] + tail),
            30 << 20
        );
        for w in b.windows(2) {
            assert_eq!(w[0] % (64 << 10), 0);
            assert!(w[1] > w[0]);
        }
        assert!(
            b[2] - b[1] >= TABLE_SCRATCH_BYTES,
            "all-to-all tables in staging"
        );
    }

    /// The default collection with the point-to-point region (the NCCL shim's and the bench's) stays
    /// one allocation of 30 MiB at every world size: staging gives up the region's bytes.
    #[test]
    fn the_p2p_region_fits_the_default_allocation() {
        use crate::p2p::plan::layout;
        for n in 2..=mscclpp_kernels_cu::collectives::MAX_RANKS {
            // 132 SMs: the rsag zero-copy kind's 256 blocks of semaphores towards n - 1 peers.
            let table = 256 * (n - 1) * std::mem::size_of::<D2DSemaphoreHandle>();
            let p2p = layout(n).region_bytes;
            let tail = private_tail_bytes(table, p2p);
            let b = scratch_bounds(8 << 20, tail + p2p);
            assert_eq!(b[1], 4 << 20, "LL16, {n} ranks");
            assert_eq!(b[3] - b[2], 18 << 20, "LL128, {n} ranks");
            let staging = b[2] - b[1];
            assert!(staging >= 7 << 20, "staging {staging}, {n} ranks");
            assert_eq!(
                mscclpp_core::gpu::plain_allocation_bytes(b[3] + p2p + tail),
                30 << 20,
                "{n} ranks"
            );
        }
        // What the region costs the staging part at 8 ranks: 7.875 MiB -> 7 MiB.
        let table = 256 * 7 * std::mem::size_of::<D2DSemaphoreHandle>();
        let p2p = layout(8).region_bytes;
        let b = scratch_bounds(8 << 20, private_tail_bytes(table, p2p) + p2p);
        assert_eq!(b[2] - b[1], 7 << 20);
    }

    #[test]
    fn standalone_alltoall_collections_fit_one_or_two_granules() {
        use crate::alltoall::{packet, zero_copy};
        // AlltoallZeroCopy::new: 128 KiB scratch, 128 blocks of semaphores at 8 ranks.
        let tail =
            std::mem::size_of::<CallState>() + 128 * 7 * 40 + std::mem::size_of::<AlltoallState>();
        let b = scratch_bounds(zero_copy::STANDALONE_SCRATCH_BYTES, tail);
        assert!(b[2] - b[1] >= TABLE_SCRATCH_BYTES);
        assert_eq!(
            mscclpp_core::gpu::plain_allocation_bytes(b[3] + tail),
            2 << 20
        );
        // AlltoallPacket::new: 1 MiB scratch, no semaphores; its LL128 part carries the 2-rank
        // chunks the selector gives the packet kernel (a 1 MiB all-to-all).
        let tail = std::mem::size_of::<CallState>() + std::mem::size_of::<AlltoallState>();
        let b = scratch_bounds(packet::STANDALONE_SCRATCH_BYTES, tail);
        let ll128 = b[3] - b[2];
        assert!(
            packet::max_chunk_bytes(ll128, 2)
                >= mscclpp_core::algorithm_collection::alltoall_packet_max_chunk(2)
        );
        assert_eq!(
            mscclpp_core::gpu::plain_allocation_bytes(b[3] + tail),
            4 << 20
        );
    }
}
