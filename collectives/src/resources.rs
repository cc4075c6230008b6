//! Device-side resources of a native algorithm: owned device memory, scratch shared with peers,
//! per-block semaphores, the cache of registered user buffers, and the compiled kernels.

use mscclpp_core::communicator::{Communicator, RegisteredMemory};
use mscclpp_core::gpu::{Allocation, DevicePtr, Function, Gpu, MemoryKind, Module, Stream};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::collectives::{self as kc, CollectiveFile, ReduceSpec};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

fn lock<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
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
        let alloc = gpu.alloc(bytes.max(1), MemoryKind::Plain)?;
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
        let bytes = std::mem::size_of_val(items);
        let buf = DeviceBuffer::zeroed(gpu, bytes)?;
        // SAFETY: `items` is a live slice of `bytes` bytes; the handle types uploaded here are
        // `#[repr(C)]` structs of integers and pointers with no padding the device relies on.
        let raw = unsafe { std::slice::from_raw_parts(items.as_ptr() as *const u8, bytes) };
        gpu.copy_to_device(buf.ptr(), raw)?;
        Ok(buf)
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
        let local = DeviceBuffer::zeroed(comm.gpu(), bytes)?;
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
        // Peers must unmap our scratch before we free it; the bootstrap barrier is bounded, so a
        // dead peer delays teardown but cannot hang it.
        self.peers.clear();
        if let Err(e) = self.comm.bootstrap().barrier() {
            tracing::warn!(target: "mscclpp::coll", "scratch teardown barrier failed: {e}");
        }
        self.local.take();
    }
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
        let me = comm.rank();
        let mut per_peer = Vec::new();
        for peer in (0..comm.size()).filter(|&p| p != me) {
            per_peer.push(comm.d2d_semaphores(peer, max_blocks as usize)?);
        }
        // Interleave to [block][peer index]; moving the handles out needs no Copy/Clone.
        let mut columns: Vec<_> = per_peer.into_iter().map(Vec::into_iter).collect();
        let mut table = Vec::with_capacity(max_blocks as usize * columns.len());
        for b in 0..max_blocks {
            for (i, column) in columns.iter_mut().enumerate() {
                table.push(column.next().ok_or_else(|| {
                    Error::Internal(format!("semaphore {b} towards peer index {i} missing"))
                })?);
            }
        }
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

/// Registrations of one buffer on every rank, by (local address, size), with the local buffer id
/// they were made for.
type RegistrationMap = HashMap<(DevicePtr, usize), (u64, Arc<Vec<RegisteredMemory>>)>;

/// User buffers registered with every peer, by (local address, size).
///
/// Registration is collective, so the cache assumes what MSCCL++ assumes: every rank calls with
/// buffers in the same pattern (a buffer new on one rank is new on all), which holds for SPMD
/// programs such as training loops. Registration is host-only, so it is legal during capture.
///
/// Addresses are recycled by allocators: an entry is only reused while the allocation at its
/// address is the one it was made for (same buffer id). Before registering anything new, entries
/// whose allocation is gone are dropped, which closes this rank's mappings of the peers' old
/// buffers; every rank does the same, so no stale mapping blocks the new ones.
#[derive(Default)]
pub struct RegistrationCache {
    entries: Mutex<RegistrationMap>,
}

impl RegistrationCache {
    /// Every rank's address of its buffer (the one registered with `ptr`, `size` here), by rank.
    pub fn rank_ptrs(
        &self,
        comm: &Communicator,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<Vec<DevicePtr>> {
        let gpu = comm.gpu();
        let id = gpu.buffer_id(ptr)?;
        let mut entries = lock(&self.entries)?;
        if let Some((cached_id, mems)) = entries.get(&(ptr, size)) {
            if *cached_id == id {
                return Ok(mems.iter().map(RegisteredMemory::ptr).collect());
            }
        }
        entries.retain(|&(p, _), (cached_id, _)| gpu.buffer_id(p).ok() == Some(*cached_id));
        let local = comm.register_user_buffer(ptr, size).map_err(|e| {
            Error::InvalidArgument(format!(
                "registering user buffer {ptr:#x} ({size} bytes) for a zero-copy collective: {e}"
            ))
        })?;
        let mems = Arc::new(comm.exchange(local)?);
        let ptrs = mems.iter().map(RegisteredMemory::ptr).collect();
        entries.insert((ptr, size), (id, mems));
        Ok(ptrs)
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
