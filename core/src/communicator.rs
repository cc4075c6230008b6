//! The communicator: one rank's view of a job, its GPU, and the memory it shares with peers.
//!
//! Setup is collective: every rank makes the same calls in the same order (as in MSCCL++), which lets
//! semaphore slots be assigned deterministically without extra messages. After setup, everything the
//! device needs lives in plain `#[repr(C)]` handles (see `device`), so kernels run with no host
//! involvement and stay valid across CUDA-graph replays.
//!
//! Memory sharing within one host goes through the GPU backend's IPC (legacy handles or VMM file
//! descriptors); ranks on other hosts need a network transport (PortChannel, a later layer).

use crate::bootstrap::Bootstrap;
use crate::device::{D2DSemaphoreHandle, MemoryChannelHandle};
use crate::error::{Error, Result};
use crate::gpu::{
    Allocation, DevicePtr, Gpu, HostMapped, ImportedMemory, IpcMemHandle, MemoryKind,
};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// Semaphore slots each rank reserves for each peer in its sync slab. Algorithms draw slots from
/// this budget in setup order: the default native collection takes about 1,200 per peer on a
/// 132-SM GPU (one per block and peer), NVLS adds 192, and user channels need room too. 4096
/// costs 64 KiB of device memory per peer.
pub const SEMAPHORES_PER_PEER: usize = 4096;

/// Bootstrap tag space used by the communicator's own setup messages.
const TAG_MEMORY: u64 = 0x6d65_6d00;

/// What a peer needs to map one of our buffers: who owns it, where, and the IPC description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryDescriptor {
    pub rank: usize,
    /// Host identity (hostname + boot id): IPC only works between ranks with the same host id.
    pub host_id: String,
    /// The address in the owner's process.
    pub ptr: DevicePtr,
    pub size: usize,
    pub ipc: IpcMemHandle,
    /// The owner's process and device: a peer in the same process on the same device (several
    /// ranks driven by one process, as ncclCommInitAll does) uses the buffer at its own address,
    /// because the driver refuses to open an IPC handle in the process that exported it.
    #[serde(default)]
    pub pid: u32,
    #[serde(default)]
    pub device: usize,
}

/// Memory registered with the communicator: local (owned here) or a peer's, mapped into this process.
pub struct RegisteredMemory {
    desc: MemoryDescriptor,
    /// Where this process addresses the memory (equal to `desc.ptr` when local).
    local_ptr: DevicePtr,
    imported: Option<ImportedMemory>,
    gpu: Arc<dyn Gpu>,
}

impl RegisteredMemory {
    pub fn descriptor(&self) -> &MemoryDescriptor {
        &self.desc
    }
    /// The address of this memory in this process.
    pub fn ptr(&self) -> DevicePtr {
        self.local_ptr
    }
    pub fn size(&self) -> usize {
        self.desc.size
    }
    pub fn rank(&self) -> usize {
        self.desc.rank
    }
    /// Whether the memory is used at its owner's address (ours, or a peer's in this process on
    /// this device), so nothing is unmapped when it is dropped.
    pub fn is_local(&self) -> bool {
        self.imported.is_none()
    }
}

impl Drop for RegisteredMemory {
    fn drop(&mut self) {
        if let Some(imported) = self.imported.take() {
            if let Err(e) = self.gpu.close_imported(&imported) {
                tracing::warn!(target: "mscclpp::conn", "unmapping rank {}'s memory failed: {e}", self.desc.rank);
            }
        }
    }
}

/// Per-rank slab of 64-bit semaphore words: the first half receives peers' signals (inbound), the
/// second half holds this rank's expected counters. Peers map the slab once at setup.
struct SyncSlab {
    alloc: Allocation,
    /// Every rank's slab, mapped here (our own at our rank).
    peers: Vec<RegisteredMemory>,
}

/// One rank's communicator. See the module docs.
pub struct Communicator {
    bootstrap: Arc<dyn Bootstrap>,
    gpu: Arc<dyn Gpu>,
    device: usize,
    host_id: String,
    error_word: HostMapped,
    /// Why the communicator was aborted, once it was (the first reason wins).
    abort_reason: Mutex<Option<String>>,
    slab: SyncSlab,
    /// Next free semaphore slot per peer (same on every rank because setup is collective).
    next_slot: Mutex<Vec<usize>>,
}

/// Identifies this host for IPC purposes: two ranks can share GPU memory only on the same host.
fn host_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", host.trim(), boot.trim())
}

impl Communicator {
    /// Creates the communicator on `device` (collective: every rank calls it).
    pub fn new(bootstrap: Arc<dyn Bootstrap>, gpu: Arc<dyn Gpu>, device: usize) -> Result<Self> {
        gpu.set_device(device)?;
        let size = bootstrap.size();
        let error_word = gpu.alloc_host_mapped(std::mem::size_of::<u64>())?;
        let slab_bytes = 2 * size * SEMAPHORES_PER_PEER * std::mem::size_of::<u64>();
        let alloc = gpu.alloc(slab_bytes, MemoryKind::Plain)?;
        gpu.memset_async(alloc.ptr, 0, slab_bytes, crate::gpu::Stream::DEFAULT)?;
        gpu.synchronize_stream(crate::gpu::Stream::DEFAULT)?;
        let mut comm = Communicator {
            bootstrap,
            gpu,
            device,
            host_id: host_identity(),
            error_word,
            abort_reason: Mutex::new(None),
            slab: SyncSlab {
                alloc,
                peers: Vec::new(),
            },
            next_slot: Mutex::new(vec![0; size]),
        };
        let slab_alloc = comm.slab.alloc.clone();
        let local = comm.register(&slab_alloc, slab_alloc.ptr, slab_bytes)?;
        comm.slab.peers = comm.exchange(local)?;
        Ok(comm)
    }

    pub fn rank(&self) -> usize {
        self.bootstrap.rank()
    }
    pub fn size(&self) -> usize {
        self.bootstrap.size()
    }
    pub fn device(&self) -> usize {
        self.device
    }
    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }
    pub fn bootstrap(&self) -> &Arc<dyn Bootstrap> {
        &self.bootstrap
    }

    /// Device address of the host-visible error word that device-side bounded waits write.
    pub fn error_word_device_ptr(&self) -> DevicePtr {
        self.error_word.device_ptr
    }

    fn error_word(&self) -> &AtomicU32 {
        // SAFETY: the word is pinned host memory of at least 4 bytes, alive as long as `self`, and
        // only ever accessed atomically (device atomics and host atomics).
        unsafe { &*(self.error_word.host_ptr as *const AtomicU32) }
    }

    /// Aborts the communicator: records `reason` (the first one wins) and sets the error word to
    /// [`DEVICE_ERROR_ABORTED`](crate::device::DEVICE_ERROR_ABORTED) unless an error is already
    /// recorded. Callable from any thread, also while another thread is blocked in a call on this
    /// communicator; never blocks.
    pub fn abort(&self, reason: &str) {
        if let Ok(mut r) = self.abort_reason.lock() {
            r.get_or_insert_with(|| reason.to_string());
        }
        let _ = self.error_word().compare_exchange(
            crate::device::DEVICE_ERROR_NONE,
            crate::device::DEVICE_ERROR_ABORTED,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// The communicator's health, without synchronising anything (one host load): `None` while no
    /// device wait has failed and no abort was requested, else the error that ended it.
    pub fn async_error(&self) -> Option<Error> {
        let code = self.error_word().load(Ordering::Acquire);
        if code == crate::device::DEVICE_ERROR_NONE {
            return None;
        }
        let reason = self.abort_reason.lock().ok().and_then(|r| r.clone());
        Some(match reason {
            Some(reason) => Error::Aborted(format!("rank {}: {reason}", self.rank())),
            None => Error::DeviceTimeout(format!(
                "rank {}: {}",
                self.rank(),
                crate::device::describe_device_error(code)
            )),
        })
    }

    /// Reads and clears the device error word; a non-zero code becomes `Error::DeviceTimeout`.
    /// Call after synchronising the stream the kernels ran on.
    pub fn check_device_errors(&self) -> Result<()> {
        // SAFETY: the word is pinned host memory of at least 4 bytes, alive as long as `self`, and
        // only ever accessed atomically (device atomics and this exchange).
        let word = unsafe { &*(self.error_word.host_ptr as *const AtomicU32) };
        match word.swap(0, Ordering::AcqRel) {
            0 => Ok(()),
            code => Err(Error::DeviceTimeout(format!(
                "rank {}: {}",
                self.rank(),
                crate::device::describe_device_error(code)
            ))),
        }
    }

    /// Describes `[ptr, ptr+size)` of `alloc` (owned by this process) for peers.
    pub fn register(
        &self,
        alloc: &Allocation,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<RegisteredMemory> {
        let ipc = self.gpu.export_memory(alloc, ptr, size)?;
        Ok(RegisteredMemory {
            desc: MemoryDescriptor {
                rank: self.rank(),
                host_id: self.host_id.clone(),
                ptr,
                size,
                ipc,
                pid: std::process::id(),
                device: self.device,
            },
            local_ptr: ptr,
            imported: None,
            gpu: self.gpu.clone(),
        })
    }

    /// Registers a user buffer (e.g. a framework tensor) whose allocation the backend looks up.
    pub fn register_user_buffer(&self, ptr: DevicePtr, size: usize) -> Result<RegisteredMemory> {
        let alloc = self.gpu.allocation_of(ptr)?;
        self.register(&alloc, ptr, size)
    }

    /// Maps a peer's descriptor into this process.
    pub fn import(&self, desc: MemoryDescriptor) -> Result<RegisteredMemory> {
        if desc.rank == self.rank() {
            return Err(Error::InvalidArgument(
                "import of this rank's own memory: use the local registration".into(),
            ));
        }
        if desc.host_id != self.host_id {
            return Err(Error::Unsupported(format!(
                "rank {}'s memory is on another host ({}); only same-host IPC is available",
                desc.rank, desc.host_id
            )));
        }
        if desc.pid == std::process::id() && desc.device == self.device {
            return Ok(RegisteredMemory {
                local_ptr: desc.ptr,
                desc,
                imported: None,
                gpu: self.gpu.clone(),
            });
        }
        let imported = self
            .gpu
            .import_memory(&desc.ipc, None)
            .map_err(|e| Error::Peer {
                rank: desc.rank,
                message: format!("mapping its memory failed: {e}"),
            })?;
        Ok(RegisteredMemory {
            local_ptr: imported.ptr,
            desc,
            imported: Some(imported),
            gpu: self.gpu.clone(),
        })
    }

    /// Collective: every rank contributes `local`; returns every rank's memory indexed by rank,
    /// peers' mapped into this process and our own at our index.
    pub fn exchange(&self, local: RegisteredMemory) -> Result<Vec<RegisteredMemory>> {
        let bytes = serde_json::to_vec(&local.desc)
            .map_err(|e| Error::Internal(format!("serialising a memory descriptor: {e}")))?;
        let all = self.bootstrap.all_gather(&bytes)?;
        let mut local = Some(local);
        let mut out = Vec::with_capacity(all.len());
        for (rank, bytes) in all.iter().enumerate() {
            if rank == self.rank() {
                out.push(
                    local
                        .take()
                        .ok_or_else(|| Error::Internal("own slot twice".into()))?,
                );
                continue;
            }
            let desc: MemoryDescriptor =
                serde_json::from_slice(bytes).map_err(|e| Error::Peer {
                    rank,
                    message: format!("sent a malformed memory descriptor: {e}"),
                })?;
            out.push(self.import(desc)?);
        }
        // Owners keep their exported handles alive; the barrier makes sure no owner moves on (and,
        // e.g., frees) before every importer has mapped.
        self.bootstrap.barrier()?;
        Ok(out)
    }

    /// Sends one registered memory to `peer` (point-to-point variant of `exchange`).
    pub fn send_memory(&self, peer: usize, mem: &RegisteredMemory) -> Result<()> {
        let bytes = serde_json::to_vec(&mem.desc)
            .map_err(|e| Error::Internal(format!("serialising a memory descriptor: {e}")))?;
        self.bootstrap.send(peer, TAG_MEMORY, &bytes)
    }

    /// Receives and maps one registered memory from `peer`.
    pub fn recv_memory(&self, peer: usize) -> Result<RegisteredMemory> {
        let bytes = self.bootstrap.recv(peer, TAG_MEMORY)?;
        let desc: MemoryDescriptor = serde_json::from_slice(&bytes).map_err(|e| Error::Peer {
            rank: peer,
            message: format!("sent a malformed memory descriptor: {e}"),
        })?;
        self.import(desc)
    }

    /// Reserves `count` semaphore slots towards `peer`; returns the first. Collective in the sense
    /// that both ends must reserve in the same order (they do when setup calls are collective).
    fn reserve_slots(&self, peer: usize, count: usize) -> Result<usize> {
        let mut next = self
            .next_slot
            .lock()
            .map_err(|_| Error::Internal("semaphore slot table poisoned".into()))?;
        let base = next[peer];
        if base + count > SEMAPHORES_PER_PEER {
            return Err(Error::InvalidArgument(format!(
                "out of semaphore slots towards rank {peer}: {base} used, {count} more requested, \
                 {SEMAPHORES_PER_PEER} available"
            )));
        }
        next[peer] = base + count;
        Ok(base)
    }

    /// Creates `count` device-to-device semaphores with `peer`. Both ranks must call this with each
    /// other as `peer`, in the same order relative to their other setup calls.
    pub fn d2d_semaphores(&self, peer: usize, count: usize) -> Result<Vec<D2DSemaphoreHandle>> {
        let size = self.size();
        if peer >= size || peer == self.rank() {
            return Err(Error::InvalidArgument(format!(
                "semaphore peer {peer} (this is rank {} of {size})",
                self.rank()
            )));
        }
        let base = self.reserve_slots(peer, count)?;
        let word = std::mem::size_of::<u64>() as u64;
        let half = (size * SEMAPHORES_PER_PEER) as u64 * word;
        let me = self.rank();
        let own = self.slab.alloc.ptr;
        let remote = self.slab.peers[peer].ptr();
        Ok((0..count)
            .map(|i| {
                let slot = (base + i) as u64;
                D2DSemaphoreHandle {
                    // Inbound from `peer` lives in our slab's row for `peer`.
                    inbound: own + ((peer * SEMAPHORES_PER_PEER) as u64 + slot) * word,
                    expected: own + half + ((peer * SEMAPHORES_PER_PEER) as u64 + slot) * word,
                    // Our signals land in the peer's slab, in its row for us.
                    remote_inbound: remote + ((me * SEMAPHORES_PER_PEER) as u64 + slot) * word,
                    error_word: self.error_word.device_ptr,
                    max_spin: 0,
                }
            })
            .collect())
    }

    /// Builds a MemoryChannel towards `dst.rank()`: puts go from `src` (local) into `dst` (the peer's
    /// memory mapped here); the peer writes packets into `packet_buffer` (local).
    pub fn memory_channel(
        &self,
        semaphore: D2DSemaphoreHandle,
        dst: &RegisteredMemory,
        src: DevicePtr,
        packet_buffer: DevicePtr,
    ) -> MemoryChannelHandle {
        MemoryChannelHandle {
            semaphore,
            dst: dst.ptr(),
            src,
            packet_buffer,
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Peers' mappings of our slab must be gone before it is freed; best effort, since a dead
        // peer must not make teardown hang forever (the bootstrap barrier has a timeout).
        self.slab.peers.clear();
        if let Err(e) = self.bootstrap.barrier() {
            tracing::warn!(target: "mscclpp::conn", "teardown barrier failed: {e}");
        }
        if let Err(e) = self.gpu.free(&self.slab.alloc) {
            tracing::warn!(target: "mscclpp::conn", "freeing the semaphore slab failed: {e}");
        }
        if let Err(e) = self.gpu.free_host_mapped(&self.error_word) {
            tracing::warn!(target: "mscclpp::conn", "freeing the error word failed: {e}");
        }
    }
}
