//! The `Gpu` trait: what the runtime needs from a GPU driver, in vendor-neutral terms.
//!
//! Backends (CUDA through cudarc, HIP loaded at run time) implement it; the facade crate picks one at
//! run time. Handles are plain integers (the driver's own pointer or handle value), so the trait is
//! object-safe, cheap to copy, and the same on every backend.
//!
//! # Thread safety
//! Implementations are `Send + Sync`. Every method may be called from any thread: a backend makes
//! the device's primary context current on the calling thread itself (driver APIs bind contexts per
//! thread), so callers never manage contexts. Streams and events may be used from several threads,
//! with the usual stream-ordering semantics; the caller orders conflicting operations.
//!
//! # Errors
//! Driver failures are [`Error::Driver`] naming the call. Anything a backend
//! cannot do (e.g. VMM on an old driver) is [`Error::Unsupported`]; the
//! default method bodies return that, so a backend that lacks a capability says so instead of lying.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::ffi::c_void;

/// A device address (CUdeviceptr / hipDeviceptr_t).
pub type DevicePtr = u64;

/// Device memory this process holds through [`Gpu::alloc`], in bytes actually reserved (with the
/// backend's rounding), over every backend instance. One process is one rank in every launcher we
/// support, so this is the library's memory per rank; unlike a cuMemGetInfo delta it stays exact
/// when ranks share a GPU (MPS). Peers' memory mapped here is not counted (it is theirs).
static LIVE_DEVICE_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Bytes of device memory live through [`Gpu::alloc`] in this process (see `LIVE_DEVICE_BYTES`).
pub fn live_device_bytes() -> u64 {
    LIVE_DEVICE_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Backends call this after every successful [`Gpu::alloc`] with the allocation made.
pub fn note_device_alloc(alloc: &Allocation) {
    LIVE_DEVICE_BYTES.fetch_add(alloc.reserved as u64, std::sync::atomic::Ordering::Relaxed);
}

/// Backends call this after every successful [`Gpu::free`].
pub fn note_device_free(alloc: &Allocation) {
    LIVE_DEVICE_BYTES.fetch_sub(alloc.reserved as u64, std::sync::atomic::Ordering::Relaxed);
}

/// A driver stream handle; `Stream::DEFAULT` (0) is the legacy default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Stream(pub u64);

impl Stream {
    pub const DEFAULT: Stream = Stream(0);
}

/// A driver event handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Event(pub u64);

/// An instantiated, launchable graph (CUgraphExec) and the graph it came from (CUgraph).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Graph {
    pub exec: u64,
    pub graph: u64,
}

/// How the driver treats a thread's calls that may synchronise (stream and event waits, some
/// allocations) while a graph is being captured (cudaStreamCaptureMode / hipStreamCaptureMode,
/// in their order). `Global`, every thread's default, refuses such a call while any thread of the
/// process captures in `Global` mode (PyTorch's default), and the refusal invalidates that
/// capture; `ThreadLocal` refuses it only during the thread's own captures; `Relaxed` never.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    Global,
    ThreadLocal,
    Relaxed,
}

/// Runs `f` with the calling thread in [`CaptureMode::Relaxed`], then gives the thread its mode
/// back. For the runtime's copies and waits on streams of its own, which no capture contains,
/// made from threads that may be a caller's (a transport's staging step).
pub fn relaxed_capture<T>(gpu: &dyn Gpu, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let before = gpu.exchange_capture_mode(CaptureMode::Relaxed)?;
    let out = f();
    let restored = gpu.exchange_capture_mode(before);
    // `f`'s own error first: it is what the caller's call failed of.
    let value = out?;
    restored?;
    Ok(value)
}

/// A loaded module (CUmodule / hipModule_t).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Module(pub u64);

/// A kernel entry point inside a [`Module`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Function(pub u64);

/// Which vendor's GPU this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GpuVendor {
    Nvidia,
    Amd,
}

/// What the runtime needs to know about a device to choose algorithms and compile kernels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceProperties {
    pub vendor: GpuVendor,
    pub name: String,
    /// Architecture name the run-time compiler targets: `sm_90`, `sm_100`, `gfx942`...
    pub arch: String,
    /// Compute capability (NVIDIA) or gfx major/minor (AMD).
    pub compute_major: u32,
    pub compute_minor: u32,
    pub multiprocessors: u32,
    pub warp_size: u32,
    pub total_memory: u64,
    /// PCI bus id, `0000:19:00.0`: identifies the physical GPU across processes.
    pub pci_bus_id: String,
    /// Virtual memory management (cuMemCreate/cuMemMap) with shareable handles is available.
    pub supports_vmm: bool,
    /// The hardware and driver could do NVLink multicast. This does not mean it may be used: that is
    /// also gated by the environment (see `Env::nvls_allowed`).
    pub supports_multicast: bool,
    /// Processes share the device through MPS (NVIDIA's multi-process service): then
    /// `multiprocessors` is this process's limit, and other processes' grids run on the same SMs.
    pub mps_client: bool,
}

/// Plain (cuMemAlloc/hipMalloc) allocations are rounded up to this many bytes. The drivers
/// sub-allocate small requests from shared 2 MiB blocks, and legacy IPC shares and maps the whole
/// block: two exported small allocations from one block collide in an importer
/// (CUDA_ERROR_ALREADY_MAPPED) and expose their neighbours. A whole block each avoids both.
pub const PLAIN_ALLOCATION_GRANULE: usize = 2 << 20;

/// Bytes a backend reserves for a Plain allocation of `size` bytes.
pub fn plain_allocation_bytes(size: usize) -> usize {
    size.div_ceil(PLAIN_ALLOCATION_GRANULE) * PLAIN_ALLOCATION_GRANULE
}

/// How device memory is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// cuMemAlloc / hipMalloc. Shared with peers through legacy IPC handles.
    Plain,
    /// Physical allocation mapped into a reserved VA range (cuMemCreate + cuMemMap), granularity
    /// aligned, exportable as a POSIX file descriptor: MSCCL++'s GpuBuffer. Needed for symmetric
    /// memory and NVLS.
    Vmm,
}

/// Device memory owned by this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub ptr: DevicePtr,
    /// Bytes the caller asked for.
    pub size: usize,
    /// Bytes actually reserved (rounded up to the allocation granularity for VMM).
    pub reserved: usize,
    pub kind: MemoryKind,
    pub device: usize,
    /// Backend-private handle (the CUmemGenericAllocationHandle for VMM, else 0).
    pub handle: u64,
}

/// Host memory that is pinned and mapped into the device's address space (FIFOs, semaphores,
/// host-visible error words).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMapped {
    pub host_ptr: *mut u8,
    pub device_ptr: DevicePtr,
    pub size: usize,
}

// SAFETY: the pointer refers to pinned memory valid until `free_host_mapped`; sharing its address
// between threads is the point (a proxy thread reads what a kernel writes). Accesses are made by
// callers with atomics.
unsafe impl Send for HostMapped {}
unsafe impl Sync for HostMapped {}

/// A description of local device memory that another process on the same host can map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum IpcMemHandle {
    /// Legacy IPC handle bytes (cuIpcGetMemHandle / hipIpcGetMemHandle), plus the offset of the
    /// shared pointer inside the allocation the handle names.
    Legacy {
        bytes: Vec<u8>,
        offset: u64,
        size: u64,
    },
    /// A VMM allocation exported as a POSIX file descriptor. The descriptor itself travels out of
    /// band (SCM_RIGHTS or pidfd_getfd); here we carry who owns it and the mapping parameters.
    PosixFd {
        pid: u32,
        fd: i32,
        size: u64,
        reserved: u64,
        offset: u64,
        /// Which export of the owner this is: a number the owner never gives twice. `fd` alone
        /// does not name an allocation over time: the owner closes it when the allocation is
        /// freed and the next export may get the same number (POSIX hands out the lowest free
        /// one), while an importer can still hold its mapping of the old allocation. Importers
        /// key their mappings by it, so a new allocation is never read through an old mapping.
        #[serde(default)]
        export: u64,
    },
}

/// An NVLink multicast object (NVLS): one address range whose stores reach every bound device and
/// whose `multimem` loads reduce across them. Created by one rank, imported by the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MulticastHandle {
    /// Backend-private handle (the CUmemGenericAllocationHandle of the multicast object).
    pub handle: u64,
    /// Bytes the caller asked for.
    pub size: usize,
    /// Bytes of the object: `size` rounded up to `granularity`. Binds and maps cover this much.
    pub reserved: usize,
    /// The driver's minimum multicast granularity: offsets and sizes of binds are multiples of it.
    pub granularity: usize,
    /// Number of devices the object was created for; each must be added before any bind.
    pub num_devices: usize,
}

/// A multicast object described for another process on this host: a POSIX file descriptor owned
/// by `pid` (copied with `pidfd_getfd`, like [`IpcMemHandle::PosixFd`]) and the object's geometry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MulticastExport {
    pub pid: u32,
    pub fd: i32,
    pub size: u64,
    pub reserved: u64,
    pub granularity: u64,
    pub num_devices: u32,
}

/// A peer's memory mapped into this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedMemory {
    pub ptr: DevicePtr,
    pub size: usize,
    /// Backend-private bookkeeping needed to unmap (base pointer, handle, reserved size).
    pub base: DevicePtr,
    pub handle: u64,
    pub reserved: usize,
    pub legacy: bool,
}

/// Launch geometry, and how the launch may overlap the stream's previous kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
    /// The kernel waits for the stream's previous grid itself before it touches memory (it begins
    /// with `wait_prior_grids()` of kernels-cu), so a backend that can may start launching it
    /// while that grid still runs (CUDA programmatic dependent launch, sm_90+), hiding the launch
    /// latency. Backends without the feature launch it normally. Never set this for a kernel
    /// that does not wait: it could read its inputs before they are written.
    pub programmatic: bool,
    /// Outside stream capture, a backend that can may launch through a one-kernel graph it keeps
    /// per (function, geometry, stream) and updates in place, because replaying such a graph costs
    /// the calling thread less than a kernel launch on CUDA. Semantically it is the same launch
    /// (stream-ordered, same parameters), but launches of one cached graph are also ordered after
    /// each other, so the cache is per stream; `programmatic` does not apply on that path.
    pub cached_graph: bool,
}

impl LaunchConfig {
    pub fn linear(blocks: u32, threads: u32) -> Self {
        LaunchConfig {
            grid: (blocks, 1, 1),
            block: (threads, 1, 1),
            shared_mem_bytes: 0,
            programmatic: false,
            cached_graph: false,
        }
    }

    /// This configuration with [`LaunchConfig::programmatic`] set to `on`.
    pub fn with_programmatic(self, on: bool) -> Self {
        LaunchConfig {
            programmatic: on,
            ..self
        }
    }

    /// This configuration with [`LaunchConfig::cached_graph`] set to `on`.
    pub fn with_cached_graph(self, on: bool) -> Self {
        LaunchConfig {
            cached_graph: on,
            ..self
        }
    }
}

fn unsupported<T>(what: &str) -> Result<T> {
    Err(Error::Unsupported(format!(
        "{what} is not implemented by this GPU backend"
    )))
}

/// A GPU driver. See the module docs for the thread-safety and error contracts.
pub trait Gpu: Send + Sync {
    /// Short backend name: `cuda` or `rocm`.
    fn backend_name(&self) -> &'static str;

    /// Number of visible devices. Never fails for "zero devices": that is `Ok(0)`.
    fn device_count(&self) -> Result<usize>;

    /// Makes `device` the current device of the calling thread (retaining its primary context).
    fn set_device(&self, device: usize) -> Result<()>;

    /// The device the calling thread works on (0 until `set_device`).
    fn current_device(&self) -> Result<usize>;

    fn properties(&self, device: usize) -> Result<DeviceProperties>;

    /// The kind of memory for buffers that peers map (semaphore slabs, scratch). A backend
    /// answers VMM where its peers can import VMM allocations, because an importer's mapping of
    /// one keeps it alive after its exporter died, where a legacy IPC import may fault
    /// (docs/fail-fast.md, "A dead peer's memory"). The default: Plain, valid everywhere.
    fn shared_memory_kind(&self, device: usize) -> MemoryKind {
        let _ = device;
        MemoryKind::Plain
    }

    /// Whether this process's contexts on `device` are clients of an MPS server. MPS clients
    /// share one pool of the GPU's hardware work queues, so a client may get too few for a
    /// PortChannel proxy's copies to run beside the kernel that waits for them
    /// (`port_channel::shared_queue_hazard`). The default: no.
    fn is_mps_client(&self, device: usize) -> bool {
        let _ = device;
        false
    }

    /// Allocates `size` bytes (size > 0) on the current device.
    fn alloc(&self, size: usize, kind: MemoryKind) -> Result<Allocation>;

    /// Frees an allocation made by `alloc` in this process. Freeing twice is undefined.
    fn free(&self, alloc: &Allocation) -> Result<()>;

    /// Pinned host memory mapped into the device address space, zero-filled.
    fn alloc_host_mapped(&self, _size: usize) -> Result<HostMapped> {
        unsupported("host-mapped memory")
    }
    fn free_host_mapped(&self, _mem: &HostMapped) -> Result<()> {
        unsupported("host-mapped memory")
    }

    /// Asynchronous copy on `stream` (any direction; unified addressing).
    fn memcpy_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()>;
    /// Synchronous host-to-device copy.
    fn copy_to_device(&self, dst: DevicePtr, src: &[u8]) -> Result<()>;
    /// Synchronous device-to-host copy.
    fn copy_from_device(&self, dst: &mut [u8], src: DevicePtr) -> Result<()>;
    /// Asynchronous byte fill on `stream`.
    fn memset_async(&self, dst: DevicePtr, value: u8, bytes: usize, stream: Stream) -> Result<()>;

    fn create_stream(&self) -> Result<Stream>;
    fn destroy_stream(&self, stream: Stream) -> Result<()>;
    fn synchronize_stream(&self, stream: Stream) -> Result<()>;
    fn synchronize_device(&self) -> Result<()>;

    fn create_event(&self) -> Result<Event>;
    fn destroy_event(&self, event: Event) -> Result<()>;
    fn record_event(&self, event: Event, stream: Stream) -> Result<()>;
    /// Makes later work on `stream` wait until the work before the event's latest record has run
    /// (cuStreamWaitEvent); the host does not block. Inside a CUDA-graph capture this is how a
    /// second stream forks from and joins the captured one.
    fn stream_wait_event(&self, _stream: Stream, _event: Event) -> Result<()> {
        unsupported("cross-stream event waits")
    }
    /// Milliseconds between two recorded events (blocks until `end` completes).
    fn elapsed_ms(&self, start: Event, end: Event) -> Result<f32>;
    /// Non-blocking: true once the work before the event's latest record has completed (and for
    /// an event never recorded), false while it is pending (cuEventQuery's NOT_READY). Lets a
    /// host thread wait for the GPU with its own timeout instead of a blocking synchronise.
    fn query_event(&self, _event: Event) -> Result<bool> {
        unsupported("event queries")
    }

    /// Enqueues on `stream` a 64-bit store of `value` to `addr` (device memory of this device or a
    /// peer's memory mapped here) that runs after all earlier work on `stream`, behind a memory
    /// barrier: whoever sees `value` also sees what that earlier work wrote (cuStreamWriteValue64
    /// with default flags). The value is captured when the call is made. Backends without 64-bit
    /// stream memory operations answer `Unsupported`; callers then stage the value in pinned host
    /// memory and copy it.
    fn stream_write_u64(&self, _stream: Stream, _addr: DevicePtr, _value: u64) -> Result<()> {
        unsupported("64-bit stream memory writes")
    }

    /// Describes `[ptr, ptr+size)` (inside `alloc`) for a peer process on this host.
    fn export_memory(
        &self,
        _alloc: &Allocation,
        _ptr: DevicePtr,
        _size: usize,
    ) -> Result<IpcMemHandle> {
        unsupported("memory export")
    }
    /// Maps a peer's memory. For `PosixFd` the caller passes the descriptor it received.
    fn import_memory(&self, _handle: &IpcMemHandle, _fd: Option<i32>) -> Result<ImportedMemory> {
        unsupported("memory import")
    }
    fn close_imported(&self, _mem: &ImportedMemory) -> Result<()> {
        unsupported("memory import")
    }
    /// The allocation that contains `ptr` (e.g. a PyTorch tensor's storage), so that user buffers
    /// can be registered and exported without knowing how they were allocated.
    fn allocation_of(&self, _ptr: DevicePtr) -> Result<Allocation> {
        unsupported("looking up the allocation of a user pointer")
    }
    /// An identifier of the allocation that holds `ptr`, unique for the life of the process (CUDA's
    /// buffer id): a new allocation at a recycled address gets a new id, so caches keyed by address
    /// can tell a live registration from a stale one. Fails for memory that is not allocated.
    fn buffer_id(&self, _ptr: DevicePtr) -> Result<u64> {
        unsupported("buffer ids")
    }
    /// Lets this device read/write `peer`'s memory directly (NVLink/PCIe P2P).
    fn enable_peer_access(&self, _peer: usize) -> Result<()> {
        unsupported("peer access")
    }

    /// Loads a compiled image (cubin, PTX, or code object).
    fn load_module(&self, image: &[u8]) -> Result<Module>;
    fn get_function(&self, module: Module, name: &str) -> Result<Function>;
    /// Launches `function` with `params`: one pointer per kernel parameter, pointing at its value.
    ///
    /// # Safety
    /// `params` must match the kernel's signature exactly, and every pointer the kernel dereferences
    /// must be valid for the launch's lifetime.
    unsafe fn launch(
        &self,
        function: Function,
        config: LaunchConfig,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> Result<()>;

    /// Compiles (or loads from the on-disk cache) the translation unit `source` with the backend's
    /// run-time compiler for the current device's exact architecture, with the device library's
    /// headers available, and loads it. `name` identifies it in logs and errors.
    fn build_module(&self, _name: &str, _source: &str) -> Result<Module> {
        unsupported("run-time kernel compilation")
    }

    /// Starts capturing the work enqueued on `stream` into a graph (relaxed mode, so other threads
    /// may keep using the driver meanwhile).
    fn begin_capture(&self, _stream: Stream) -> Result<()> {
        unsupported("stream capture")
    }
    /// Ends the capture begun on `stream` and instantiates the graph.
    fn end_capture(&self, _stream: Stream) -> Result<Graph> {
        unsupported("stream capture")
    }
    /// Replays an instantiated graph on `stream`.
    fn launch_graph(&self, _graph: Graph, _stream: Stream) -> Result<()> {
        unsupported("graph launch")
    }
    fn destroy_graph(&self, _graph: Graph) -> Result<()> {
        unsupported("graph launch")
    }

    /// Stream capture state: true while `stream` is being captured into a graph. Collectives use this
    /// to avoid host synchronisation during capture.
    fn is_capturing(&self, _stream: Stream) -> Result<bool> {
        Ok(false)
    }

    /// Sets the calling thread's [`CaptureMode`] and returns the one it had. The runtime's own
    /// threads (the proxy, the transports' receivers) work in `Relaxed`: their waits are for
    /// streams of their own, and in the default `Global` mode one made while the caller's thread
    /// captures a graph (in PyTorch's default mode) would invalidate that capture. A backend
    /// without capture has nothing to set: every thread is as if relaxed.
    fn exchange_capture_mode(&self, _mode: CaptureMode) -> Result<CaptureMode> {
        Ok(CaptureMode::Relaxed)
    }

    // -----------------------------------------------------------------------------------------
    // NVLink multicast (NVLS). Gated: see DESIGN.md "Safety on shared GPUs" and
    // `Env::nvls_allowed`. A backend answers `is_nvls_supported` with false and every other
    // method below with `Unsupported` while the gate is closed, without touching the driver's
    // multicast entry points.
    // -----------------------------------------------------------------------------------------

    /// True when `device` can do NVLink multicast AND the environment allows it. False (not an
    /// error) when either says no.
    fn is_nvls_supported(&self, _device: usize) -> Result<bool> {
        Ok(false)
    }
    /// Creates a multicast object of at least `size` bytes for `num_devices` devices (this
    /// process's current device among them).
    fn create_multicast(&self, _size: usize, _num_devices: usize) -> Result<MulticastHandle> {
        unsupported("NVLink multicast")
    }
    /// Adds `device` (an ordinal of this process) to the object. Every participating device of
    /// every process must be added before any of them binds memory.
    fn multicast_add_device(&self, _handle: &MulticastHandle, _device: usize) -> Result<()> {
        unsupported("NVLink multicast")
    }
    /// Binds `[offset, offset + size)` of the VMM allocation `alloc` to the object, at multicast
    /// offset 0. `offset` and `size` are multiples of `handle.granularity`.
    fn multicast_bind_memory(
        &self,
        _handle: &MulticastHandle,
        _alloc: &Allocation,
        _offset: usize,
        _size: usize,
    ) -> Result<()> {
        unsupported("NVLink multicast")
    }
    /// Undoes `multicast_bind_memory` of `device` (`size` bytes at multicast offset 0). The
    /// device is explicit because teardown may run on a thread that works on another device.
    fn multicast_unbind(
        &self,
        _handle: &MulticastHandle,
        _device: usize,
        _size: usize,
    ) -> Result<()> {
        unsupported("NVLink multicast")
    }
    /// Maps the whole object (`handle.reserved` bytes) into this process for the current device;
    /// the result is the multicast address that `multimem.*` instructions take.
    fn map_multicast(&self, _handle: &MulticastHandle) -> Result<DevicePtr> {
        unsupported("NVLink multicast")
    }
    /// Undoes `map_multicast`.
    fn unmap_multicast(&self, _handle: &MulticastHandle, _ptr: DevicePtr) -> Result<()> {
        unsupported("NVLink multicast")
    }
    /// Describes the object for other processes on this host. The descriptor stays open (owned
    /// by the backend) until `free_multicast`.
    fn export_multicast(&self, _handle: &MulticastHandle) -> Result<MulticastExport> {
        unsupported("NVLink multicast")
    }
    /// Opens a peer's exported object. `fd` is a descriptor the caller already holds; `None`
    /// copies the exporter's with `pidfd_getfd`.
    fn import_multicast(
        &self,
        _export: &MulticastExport,
        _fd: Option<i32>,
    ) -> Result<MulticastHandle> {
        unsupported("NVLink multicast")
    }
    /// Releases this process's reference to the object (created or imported).
    fn free_multicast(&self, _handle: &MulticastHandle) -> Result<()> {
        unsupported("NVLink multicast")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_device_bytes_counts_reserved_bytes_until_freed() {
        let alloc = Allocation {
            ptr: 0x1000,
            size: 100,
            reserved: 2 << 20,
            kind: MemoryKind::Vmm,
            device: 0,
            handle: 1,
        };
        // Other tests of this crate allocate through mocks that do not report, so deltas are exact.
        let before = live_device_bytes();
        note_device_alloc(&alloc);
        assert_eq!(live_device_bytes() - before, 2 << 20);
        note_device_free(&alloc);
        assert_eq!(live_device_bytes(), before);
    }
}
