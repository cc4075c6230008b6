//! PortChannel, host side: the proxy service that carries out what GPU threads request through a
//! FIFO (MSCCL++'s `ProxyService` + `PortChannel`), and the device handles kernels use.
//!
//! # Pieces
//! - [`DeviceFifo`]: the trigger ring and its `tail` in pinned host memory mapped into the device
//!   (the proxy polls the ring and publishes the tail without crossing PCIe), and the `head`
//!   counter in device memory (pushers on the GPU take positions with a device-scope atomic, which
//!   a host-mapped word would make slow). It yields the consumer [`Fifo`] for the proxy and the
//!   [`FifoHandle`] for kernels.
//! - [`PortChannelService`]: a [`DeviceFifo`] and a [`Proxy`] running the default
//!   [`TransportProxyHandler`], with tables of registered memories ([`MemoryId`]) and
//!   host-to-device semaphores ([`SemaphoreId`]). [`PortChannelService::port_channel`] builds the
//!   [`PortChannelHandle`] a kernel receives.
//!
//! # Semaphores
//! A PortChannel semaphore is a pair of 64-bit words in the communicator's semaphore slab, taken
//! with [`Communicator::d2d_semaphores`]: our *inbound* word (device memory, which the peer's
//! proxy sets through its transport after the data it signals has landed) with our *expected*
//! counter, and the peer's inbound word mapped here, which our proxy sets on a FLAG trigger.
//! Because both ranks reserve slab slots in the same order, rank A's outbound word is exactly rank
//! B's inbound word: setup is collective (every rank makes the same `add_semaphore` calls towards
//! each other, in the same order relative to its other communicator setup calls).
//!
//! # Lifecycle
//! Register memories and semaphores, [`start`](PortChannelService::start) the proxy, launch
//! kernels, [`check`](PortChannelService::check) for proxy errors after synchronising, and
//! [`stop`](PortChannelService::stop) (or drop) when done. Tables are fixed once the proxy runs:
//! it owns them, so lookups on its hot path take no lock. Handles stay valid until the service is
//! dropped (the ring and counters are freed then).
//!
//! # One hardware queue
//! For CudaIpc and Ethernet connections the proxy enqueues the copies and signals on CUDA streams
//! after the kernel that asked for them is running. CUDA feeds a process's streams into
//! `CUDA_DEVICE_MAX_CONNECTIONS` hardware queues (8 by default); at 1, as Megatron-LM sets it, that
//! work waits behind the kernel spinning on it (a flush, or a wait for a peer that waits for this
//! copy in turn) until the device wait times out. MPS clients share one pool of the GPU's queues:
//! with more than [`MPS_PORT_RANKS_PER_GPU`] ranks a GPU the same happened (port_allreduce timed
//! out in its first calls at 4 and 8 ranks on one H100, one job at a time, and passed at 2).
//! [`shared_queue_hazard`] says so; the service warns once per process, and `port_allreduce` and
//! port-channel plans refuse to start.

use crate::communicator::{Communicator, FailureFlag, RegisteredMemory};
use crate::device::{D2DSemaphoreHandle, FifoHandle, H2DSemaphoreHandle, PortChannelHandle};
use crate::env::Env;
use crate::error::{Error, Result};
use crate::fifo::{Fifo, FifoRaw, HostFifoPusher, ProxyTrigger};
use crate::gpu::{Allocation, CaptureMode, DevicePtr, Gpu, HostMapped, MemoryKind};
use crate::host_semaphore::{Host2DeviceSemaphore, SemaphoreSignaller};
use crate::proxy::{Proxy, ProxyAction, ProxyHandler, ProxyStats, TransportProxyHandler};
use crate::transport::{MemoryRegion, Transport, TransportKind};
use std::sync::Arc;
use std::time::Duration;

/// Most ranks of one communicator on one GPU under MPS for which PortChannel traffic worked
/// (see "One hardware queue" in the module docs).
pub const MPS_PORT_RANKS_PER_GPU: usize = 2;

/// Why PortChannel kernels over CudaIpc or Ethernet connections can hang in this process, if
/// they can (see "One hardware queue" in the module docs). `mps_clients_per_gpu` is
/// `Communicator::mps_clients_per_gpu`: the most ranks on one GPU as MPS clients.
/// Measured on H100 with 2 ranks: `port_allreduce` hung in its first call (device wait timeout)
/// with `CUDA_DEVICE_MAX_CONNECTIONS=1` and passed all 116 checks without it.
pub fn shared_queue_hazard(env: &Env, mps_clients_per_gpu: Option<usize>) -> Option<String> {
    if env.cuda_device_max_connections == Some(1) {
        return Some(
            "CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream of this process on one hardware \
             queue, so the proxy's copies for CudaIpc and Ethernet connections wait behind the \
             kernels that wait for them; unset it or set it above 1 (CUDA's default is 8)"
                .to_string(),
        );
    }
    match mps_clients_per_gpu {
        Some(n) if n > MPS_PORT_RANKS_PER_GPU => Some(format!(
            "{n} ranks share a GPU as MPS clients, which share one pool of the GPU's hardware \
             queues, so the proxy's copies for CudaIpc and Ethernet connections can wait behind \
             the kernels that wait for them (seen at 4 and 8 ranks a GPU); run at most \
             {MPS_PORT_RANKS_PER_GPU} ranks a GPU under MPS, or these ranks without MPS"
        )),
        _ => None,
    }
}

/// A memory registered with a [`PortChannelService`]: the id triggers carry (9 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryId(pub u32);

/// A semaphore registered with a [`PortChannelService`]: the id triggers carry (10 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SemaphoreId(pub u32);

/// Settings of a [`PortChannelService`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortChannelConfig {
    /// Trigger slots in the FIFO.
    pub fifo_depth: u32,
    /// Bound on each SYNC trigger's transport flush (the proxy records a timeout as its error).
    pub flush_timeout: Duration,
    /// Spin bound of the device handles' waits, in iterations (0 = the device default, 2^32).
    pub max_spin: u64,
    /// How long `stop` (and drop) let the proxy drain before giving up.
    pub stop_timeout: Duration,
}

impl Default for PortChannelConfig {
    fn default() -> Self {
        PortChannelConfig {
            fifo_depth: Fifo::DEFAULT_DEPTH,
            flush_timeout: Duration::from_secs(30),
            max_spin: 0,
            stop_timeout: Duration::from_secs(10),
        }
    }
}

/// Pinned host memory of a FIFO, freed when the last user (the consumer [`Fifo`], which may live
/// on in a detached proxy thread) lets go of it.
struct MappedRing {
    gpu: Arc<dyn Gpu>,
    /// The device it was allocated on: the last user may be the proxy thread, whose current
    /// device is otherwise the backend's default (freeing there would wake up another GPU).
    device: usize,
    mem: HostMapped,
}

impl Drop for MappedRing {
    fn drop(&mut self) {
        if let Err(e) = self
            .gpu
            .set_device(self.device)
            .and_then(|()| self.gpu.free_host_mapped(&self.mem))
        {
            tracing::warn!(target: "mscclpp::proxy", "freeing the FIFO ring failed: {e}");
        }
    }
}

/// Byte offset of the tail word after a ring of `depth` slots: on its own 64-byte line, so the
/// proxy's tail stores do not share a line with slots the GPU is writing.
fn tail_offset(depth: u32) -> usize {
    (depth as usize * std::mem::size_of::<ProxyTrigger>()).next_multiple_of(64)
}

/// The device-facing half of a proxy FIFO. See the module docs for where each word lives.
pub struct DeviceFifo {
    gpu: Arc<dyn Gpu>,
    head: Allocation,
    triggers: DevicePtr,
    tail: DevicePtr,
    depth: u32,
}

impl std::fmt::Debug for DeviceFifo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFifo")
            .field("triggers", &format_args!("{:#x}", self.triggers))
            .field("head", &format_args!("{:#x}", self.head.ptr))
            .field("tail", &format_args!("{:#x}", self.tail))
            .field("depth", &self.depth)
            .finish()
    }
}

impl DeviceFifo {
    /// Allocates a FIFO of `depth` slots on the calling thread's current device; returns it and the
    /// consumer end for a [`Proxy`].
    pub fn new(gpu: &Arc<dyn Gpu>, depth: u32) -> Result<(DeviceFifo, Fifo)> {
        if depth == 0 {
            return Err(Error::InvalidArgument(
                "PortChannel FIFO depth must be greater than 0".into(),
            ));
        }
        let tail_off = tail_offset(depth);
        let ring = MappedRing {
            gpu: gpu.clone(),
            device: gpu.current_device()?,
            mem: gpu.alloc_host_mapped(tail_off + 64)?,
        };
        // Two device words: the head counter and the pushers' tail cache.
        let head = gpu.alloc(2 * std::mem::size_of::<u64>(), MemoryKind::Plain)?;
        // Synchronous, so both words are zero before any kernel can see the handle.
        if let Err(e) = gpu.copy_to_device(head.ptr, &[0u8; 16]) {
            if let Err(f) = gpu.free(&head) {
                tracing::warn!(target: "mscclpp::proxy", "freeing the FIFO head failed: {f}");
            }
            return Err(e);
        }
        let triggers = ring.mem.device_ptr;
        let tail = ring.mem.device_ptr + tail_off as u64;
        let raw = FifoRaw {
            triggers: ring.mem.host_ptr.cast::<ProxyTrigger>(),
            // SAFETY (pointer arithmetic): `tail_off + 8 <= size` of the mapping.
            tail: unsafe { ring.mem.host_ptr.add(tail_off) }.cast::<u64>(),
            // The head is in device memory; the host cannot read it.
            head: None,
            depth,
        };
        let device_fifo = DeviceFifo {
            gpu: gpu.clone(),
            head,
            triggers,
            tail,
            depth,
        };
        // SAFETY: the mapping is zero-filled (alloc_host_mapped's contract), page aligned (so the
        // slots are 16-byte and the tail 64-byte aligned), large enough for `depth` slots and the
        // tail, and stays alive with `ring`, which the Fifo owns. The device touches it only with
        // the FIFO protocol's atomics.
        let fifo = unsafe { Fifo::from_raw(raw, Box::new(ring)) }?;
        Ok((device_fifo, fifo))
    }

    /// The handle kernels push through (device addresses of ring, head and tail).
    pub fn handle(&self, error_word: DevicePtr, max_spin: u64) -> FifoHandle {
        FifoHandle {
            triggers: self.triggers,
            head: self.head.ptr,
            tail: self.tail,
            size: self.depth,
            pad: 0,
            error_word,
            max_spin,
            tail_cache: self.head.ptr + std::mem::size_of::<u64>() as u64,
        }
    }

    pub fn depth(&self) -> u32 {
        self.depth
    }
}

impl Drop for DeviceFifo {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.free(&self.head) {
            tracing::warn!(target: "mscclpp::proxy", "freeing the FIFO head failed: {e}");
        }
    }
}

/// The default handler bound to the service's device (GPU backends select devices per thread, and
/// the proxy thread starts on device 0), its thread in relaxed capture mode.
struct DeviceBoundHandler {
    gpu: Arc<dyn Gpu>,
    device: usize,
    bound: bool,
    inner: TransportProxyHandler,
}

impl ProxyHandler for DeviceBoundHandler {
    fn handle(&mut self, trigger: ProxyTrigger) -> Result<ProxyAction> {
        if !self.bound {
            self.gpu.set_device(self.device)?;
            // The proxy's copies and flushes are on its own streams: in the default mode a
            // flush made while the caller's thread captures a graph would invalidate the
            // capture (`CaptureMode`).
            self.gpu.exchange_capture_mode(CaptureMode::Relaxed)?;
            self.bound = true;
        }
        self.inner.handle(trigger)
    }
}

/// What is needed before the proxy starts; moved into the proxy thread by `start`.
struct Pending {
    fifo: Fifo,
    handler: TransportProxyHandler,
}

/// A proxy serving one FIFO for any number of PortChannels. See the module docs.
pub struct PortChannelService {
    gpu: Arc<dyn Gpu>,
    device: usize,
    error_word: DevicePtr,
    config: PortChannelConfig,
    /// Declared before `fifo` so that drop stops the proxy before the FIFO's head is freed.
    proxy: Option<Proxy>,
    pending: Option<Pending>,
    fifo: DeviceFifo,
    pusher: HostFifoPusher,
    /// Registered memories by id (the same ids as the handler's table).
    memories: Vec<MemoryRegion>,
    /// Device halves of the registered semaphores, by id.
    semaphores: Vec<H2DSemaphoreHandle>,
    /// The communicator's health (services made by [`new`](Self::new)).
    failed: Option<FailureFlag>,
    /// `Communicator::mps_clients_per_gpu` (services made by [`new`](Self::new)), for the
    /// [`shared_queue_hazard`] warning.
    mps_clients_per_gpu: Option<usize>,
}

/// How long stopping the proxy of a failed communicator waits for a handler still running: it is
/// in a transfer to a peer that died or stopped, which would otherwise hold up the rank's exit for
/// the whole stop timeout.
pub const FAILED_STOP_TIMEOUT: Duration = Duration::from_millis(500);

impl std::fmt::Debug for PortChannelService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortChannelService")
            .field("device", &self.device)
            .field("fifo", &self.fifo)
            .field("memories", &self.memories.len())
            .field("semaphores", &self.semaphores.len())
            .field("proxy", &self.proxy)
            .finish()
    }
}

impl PortChannelService {
    /// A service on the communicator's device, reporting device-side timeouts into its error word.
    /// Once the communicator failed, the proxy pops triggers without carrying them out
    /// ([`TransportProxyHandler::skip_after_failure`]) and stopping it waits at most
    /// [`FAILED_STOP_TIMEOUT`] for a transfer still under way.
    pub fn new(comm: &Communicator, config: PortChannelConfig) -> Result<Self> {
        let mut svc = Self::with_gpu(
            comm.gpu().clone(),
            comm.device(),
            comm.error_word_device_ptr(),
            config,
        )?;
        let flag = comm.failure_flag();
        if let Some(p) = svc.pending.as_mut() {
            p.handler.skip_after_failure(flag.clone());
        }
        svc.failed = Some(flag);
        svc.mps_clients_per_gpu = comm.mps_clients_per_gpu();
        Ok(svc)
    }

    /// A service on `device` of `gpu` without a communicator; `error_word` is the device address
    /// of the word device-side timeouts are recorded in (0: not recorded).
    pub fn with_gpu(
        gpu: Arc<dyn Gpu>,
        device: usize,
        error_word: DevicePtr,
        config: PortChannelConfig,
    ) -> Result<Self> {
        gpu.set_device(device)?;
        let (fifo, consumer) = DeviceFifo::new(&gpu, config.fifo_depth)?;
        let pusher = consumer.pusher();
        Ok(PortChannelService {
            pending: Some(Pending {
                fifo: consumer,
                handler: TransportProxyHandler::new(config.flush_timeout),
            }),
            gpu,
            device,
            error_word,
            config,
            proxy: None,
            fifo,
            pusher,
            memories: Vec::new(),
            semaphores: Vec::new(),
            failed: None,
            mps_clients_per_gpu: None,
        })
    }

    fn pending(&mut self, what: &str) -> Result<&mut Pending> {
        self.pending.as_mut().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "PortChannelService: {what} after start(); register everything before starting \
                 the proxy"
            ))
        })
    }

    /// Registers `mem` (local, or a peer's memory mapped here) as a source or destination of puts.
    pub fn add_memory(&mut self, mem: &RegisteredMemory) -> Result<MemoryId> {
        self.add_memory_region(MemoryRegion {
            addr: mem.ptr(),
            size: mem.size() as u64,
            key: 0,
        })
    }

    /// Registers a region given by its address in this process (see `MemoryRegion`).
    pub fn add_memory_region(&mut self, region: MemoryRegion) -> Result<MemoryId> {
        let id = self.pending("add_memory")?.handler.add_memory(region)?;
        self.memories.push(region);
        Ok(MemoryId(id))
    }

    /// Collective with the peer at the other end of `connection`: takes a semaphore slot pair
    /// towards it from the communicator (see the module docs) and registers it.
    pub fn add_semaphore(
        &mut self,
        comm: &Communicator,
        connection: Arc<dyn Transport>,
    ) -> Result<SemaphoreId> {
        // Fail before reserving a slot, so a misuse does not shift this rank's slots.
        self.pending("add_semaphore")?;
        let peer = connection.remote_rank();
        let words = comm
            .d2d_semaphores(peer, 1)?
            .into_iter()
            .next()
            .ok_or_else(|| Error::Internal(format!("no semaphore returned towards rank {peer}")))?;
        self.add_semaphore_words(&words, connection)
    }

    /// Registers a semaphore made of `words.inbound` and `words.expected` (local device words) and
    /// `words.remote_inbound` (the peer's inbound word, mapped here, which our FLAG triggers set
    /// through `connection`). Other fields of `words` are ignored.
    pub fn add_semaphore_words(
        &mut self,
        words: &D2DSemaphoreHandle,
        connection: Arc<dyn Transport>,
    ) -> Result<SemaphoreId> {
        let peer = connection.remote_rank();
        if matches!(
            connection.kind(),
            TransportKind::CudaIpc | TransportKind::Ethernet
        ) {
            if let Some(hazard) = shared_queue_hazard(Env::get()?, self.mps_clients_per_gpu) {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED
                    .call_once(|| tracing::warn!(target: "mscclpp::conn", "PortChannel: {hazard}"));
            }
        }
        for (name, addr) in [
            ("inbound", words.inbound),
            ("expected", words.expected),
            ("remote_inbound", words.remote_inbound),
        ] {
            if addr == 0 || addr % 8 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "PortChannel semaphore towards rank {peer}: {name} word {addr:#x} is null or \
                     not 8-byte aligned"
                )));
            }
        }
        let word = |addr| MemoryRegion {
            addr,
            size: 8,
            key: 0,
        };
        // The peer's signals for this semaphore land in our inbound word (see the trait method).
        connection.deliver_signals_to(word(words.inbound))?;
        let signaller = SemaphoreSignaller::new(connection, word(words.remote_inbound), 0)?;
        let semaphore = Arc::new(Host2DeviceSemaphore::new(signaller, word(words.inbound)));
        let id = self
            .pending("add_semaphore")?
            .handler
            .add_semaphore(semaphore)?;
        self.semaphores.push(H2DSemaphoreHandle {
            inbound: words.inbound,
            expected: words.expected,
            error_word: self.error_word,
            max_spin: self.config.max_spin,
        });
        Ok(SemaphoreId(id))
    }

    /// The device handle of a channel that puts from `src` into `dst` and signals `semaphore`.
    pub fn port_channel(
        &self,
        semaphore: SemaphoreId,
        dst: MemoryId,
        src: MemoryId,
    ) -> Result<PortChannelHandle> {
        let sem = *self.semaphores.get(semaphore.0 as usize).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "port_channel: semaphore id {} is not registered ({} semaphores)",
                semaphore.0,
                self.semaphores.len()
            ))
        })?;
        for (role, id) in [("dst", dst), ("src", src)] {
            if id.0 as usize >= self.memories.len() {
                return Err(Error::InvalidArgument(format!(
                    "port_channel: {role} memory id {} is not registered ({} memories)",
                    id.0,
                    self.memories.len()
                )));
            }
        }
        Ok(PortChannelHandle {
            fifo: self.fifo_handle(),
            semaphore: sem,
            semaphore_id: semaphore.0,
            dst_memory_id: dst.0,
            src_memory_id: src.0,
            pad: 0,
        })
    }

    /// The FIFO handle of this service (every channel of the service shares it).
    pub fn fifo_handle(&self) -> FifoHandle {
        self.fifo.handle(self.error_word, self.config.max_spin)
    }

    /// A pusher that follows the device protocol from host threads (host-initiated transfers,
    /// tests). Its positions come from a host counter, not the device `head`: never use it on a
    /// service whose FIFO kernels also push to, or positions would collide.
    pub fn host_pusher(&self) -> HostFifoPusher {
        self.pusher.clone()
    }

    /// Starts the proxy thread. Registration is closed from here on.
    pub fn start(&mut self) -> Result<()> {
        let Pending { fifo, handler } = self.pending.take().ok_or_else(|| {
            Error::InvalidArgument("PortChannelService: start() called twice".into())
        })?;
        let handler = DeviceBoundHandler {
            gpu: self.gpu.clone(),
            device: self.device,
            bound: false,
            inner: handler,
        };
        // Best effort: a backend that cannot name the GPU's PCI address leaves the proxy unbound.
        let cpus = self
            .gpu
            .properties(self.device)
            .ok()
            .and_then(|p| crate::affinity::local_cpus(&p.pci_bus_id));
        self.proxy = Some(Proxy::start_on(fifo, handler, cpus)?);
        Ok(())
    }

    pub fn is_running(&self) -> bool {
        self.proxy.is_some()
    }

    /// The first proxy error not reported yet (a failed copy, signal or flush), if any.
    pub fn check(&self) -> Result<()> {
        self.proxy.as_ref().map_or(Ok(()), Proxy::check)
    }

    /// Triggers handled so far (zeros before start).
    pub fn stats(&self) -> ProxyStats {
        self.proxy.as_ref().map(Proxy::stats).unwrap_or_default()
    }

    /// Stops the proxy after it has handled every trigger already pushed (bounded by the
    /// configured stop timeout); returns its final counters or its first unreported error.
    /// Stopping a service that never started, or twice, is fine.
    pub fn stop(&mut self) -> Result<ProxyStats> {
        let timeout = if self.failed.as_ref().is_some_and(FailureFlag::is_set) {
            self.config.stop_timeout.min(FAILED_STOP_TIMEOUT)
        } else {
            self.config.stop_timeout
        };
        match self.proxy.as_mut() {
            Some(p) => p.stop(timeout),
            None => Ok(ProxyStats::default()),
        }
    }
}

impl Drop for PortChannelService {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::error!(target: "mscclpp::proxy", "stopping the PortChannel proxy: {e}");
        }
    }
}

/// A [`Gpu`] over host memory for CPU tests: "device" pointers are heap addresses, copies run
/// at once, events complete at once (unless held), IPC export/import pass the address through.
#[cfg(any(test, feature = "testing"))]
pub mod test_gpu {
    use crate::error::{Error, Result};
    use crate::gpu::*;
    use std::alloc::Layout;
    use std::collections::HashMap;
    use std::ffi::c_void;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Mutex;

    thread_local! {
        /// The calling thread's capture mode, as the driver keeps it (global until exchanged).
        static THREAD_CAPTURE_MODE: std::cell::Cell<CaptureMode> =
            const { std::cell::Cell::new(CaptureMode::Global) };
    }

    #[derive(Debug, Default)]
    pub struct HostGpu {
        /// Live allocations by address: their layout and buffer id.
        allocations: Mutex<HashMap<u64, (Layout, u64)>>,
        next_handle: AtomicU64,
        no_stream_writes: bool,
        stream_writes: AtomicU64,
        hold_events: AtomicBool,
        /// The `peer` argument of every enable_peer_access call, in order.
        peer_access: Mutex<Vec<usize>>,
        no_peer_access: bool,
        capturing: AtomicBool,
        /// Another thread captures a graph in global mode (`capture_globally_elsewhere`).
        global_capture_elsewhere: AtomicBool,
        /// SMs `properties` reports; `None`: it answers Unsupported (this GPU runs no kernels).
        multiprocessors: Option<u32>,
    }

    impl HostGpu {
        pub fn new() -> Self {
            Self::default()
        }
        /// Whether `stream_write_u64` is available (else it answers Unsupported).
        pub fn with_stream_writes(mut self, on: bool) -> Self {
            self.no_stream_writes = !on;
            self
        }
        /// Whether enable_peer_access succeeds (else the devices cannot reach each other).
        pub fn with_peer_access(mut self, on: bool) -> Self {
            self.no_peer_access = !on;
            self
        }
        /// `properties` describes a device of `sm` SMs (architecture `test`), for setups that size
        /// grids without launching them.
        pub fn with_multiprocessors(mut self, sm: u32) -> Self {
            self.multiprocessors = Some(sm);
            self
        }
        pub fn stream_writes(&self) -> u64 {
            self.stream_writes.load(Ordering::Relaxed)
        }
        /// Whether every stream reports a capture in progress.
        pub fn set_capturing(&self, on: bool) {
            self.capturing.store(on, Ordering::Relaxed);
        }
        /// While held, events never complete (a copy that hangs).
        pub fn hold_events(&self, hold: bool) {
            self.hold_events.store(hold, Ordering::Relaxed);
        }
        /// While on, another thread of the process is taken to capture a graph in
        /// `CaptureMode::Global`: as the driver does, a wait (for a stream, an event or the
        /// device) from a thread in global mode is refused.
        pub fn capture_globally_elsewhere(&self, on: bool) {
            self.global_capture_elsewhere.store(on, Ordering::Relaxed);
        }
        fn wait_allowed(&self, call: &str) -> Result<()> {
            if self.global_capture_elsewhere.load(Ordering::Relaxed)
                && THREAD_CAPTURE_MODE.get() == CaptureMode::Global
            {
                return Err(Error::Internal(format!(
                    "test GPU: {call} from a thread in global capture mode while a global \
                     capture is in progress (the driver invalidates that capture)"
                )));
            }
            Ok(())
        }
        fn raw_alloc(&self, size: usize) -> Result<u64> {
            let layout = Layout::from_size_align(size.max(1), 4096)
                .map_err(|e| Error::InvalidArgument(format!("test allocation of {size}: {e}")))?;
            // SAFETY: non-zero size.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            if p.is_null() {
                return Err(Error::Internal(format!("test allocation of {size} failed")));
            }
            self.allocations
                .lock()
                .map_err(|_| Error::Internal("poisoned".into()))?
                .insert(p as u64, (layout, self.handle()));
            Ok(p as u64)
        }
        fn raw_free(&self, ptr: u64) -> Result<()> {
            let (layout, _) = self
                .allocations
                .lock()
                .map_err(|_| Error::Internal("poisoned".into()))?
                .remove(&ptr)
                .ok_or_else(|| Error::InvalidArgument(format!("{ptr:#x} freed twice")))?;
            // SAFETY: allocated above with this layout, freed once.
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
            Ok(())
        }
        pub fn peer_access_enabled(&self) -> Vec<usize> {
            self.peer_access
                .lock()
                .map(|v| v.clone())
                .unwrap_or_default()
        }
        pub fn live_allocations(&self) -> usize {
            self.allocations.lock().map(|m| m.len()).unwrap_or(0)
        }
        /// The live allocation holding `ptr`: its address, layout and buffer id.
        fn holding(&self, ptr: u64) -> Result<(u64, Layout, u64)> {
            let allocations = self
                .allocations
                .lock()
                .map_err(|_| Error::Internal("poisoned".into()))?;
            allocations
                .iter()
                .find(|(&base, (layout, _))| ptr >= base && ptr < base + layout.size() as u64)
                .map(|(&base, &(layout, id))| (base, layout, id))
                .ok_or_else(|| Error::InvalidArgument(format!("{ptr:#x} is not allocated")))
        }
        fn handle(&self) -> u64 {
            self.next_handle.fetch_add(1, Ordering::Relaxed) + 1
        }
    }

    fn no_kernels<T>() -> Result<T> {
        Err(Error::Unsupported(
            "the host test GPU runs no kernels".into(),
        ))
    }

    impl Gpu for HostGpu {
        fn backend_name(&self) -> &'static str {
            "host-test"
        }
        fn device_count(&self) -> Result<usize> {
            Ok(1)
        }
        fn set_device(&self, device: usize) -> Result<()> {
            if device < 8 {
                Ok(())
            } else {
                Err(Error::InvalidArgument(format!("test device {device}")))
            }
        }
        fn current_device(&self) -> Result<usize> {
            Ok(0)
        }
        fn properties(&self, _device: usize) -> Result<DeviceProperties> {
            let Some(multiprocessors) = self.multiprocessors else {
                return no_kernels();
            };
            Ok(DeviceProperties {
                vendor: GpuVendor::Nvidia,
                name: "host test GPU".into(),
                arch: "test".into(),
                compute_major: 0,
                compute_minor: 0,
                multiprocessors,
                warp_size: 32,
                total_memory: 0,
                pci_bus_id: String::new(),
                supports_vmm: false,
                supports_multicast: false,
                mps_client: false,
            })
        }
        fn alloc(&self, size: usize, kind: MemoryKind) -> Result<Allocation> {
            Ok(Allocation {
                ptr: self.raw_alloc(size)?,
                size,
                reserved: size,
                kind,
                device: 0,
                handle: 0,
            })
        }
        fn free(&self, alloc: &Allocation) -> Result<()> {
            self.raw_free(alloc.ptr)
        }
        fn alloc_host_mapped(&self, size: usize) -> Result<HostMapped> {
            let p = self.raw_alloc(size)?;
            Ok(HostMapped {
                host_ptr: p as *mut u8,
                device_ptr: p,
                size,
            })
        }
        fn free_host_mapped(&self, mem: &HostMapped) -> Result<()> {
            self.raw_free(mem.device_ptr)
        }
        fn memcpy_async(
            &self,
            dst: DevicePtr,
            src: DevicePtr,
            bytes: usize,
            _: Stream,
        ) -> Result<()> {
            // SAFETY: tests pass live heap ranges.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
            Ok(())
        }
        fn copy_to_device(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
            self.memcpy_async(dst, src.as_ptr() as u64, src.len(), Stream::DEFAULT)
        }
        fn copy_from_device(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
            self.memcpy_async(dst.as_mut_ptr() as u64, src, dst.len(), Stream::DEFAULT)
        }
        fn memset_async(&self, dst: DevicePtr, value: u8, bytes: usize, _: Stream) -> Result<()> {
            // SAFETY: as in memcpy_async.
            unsafe { std::ptr::write_bytes(dst as *mut u8, value, bytes) };
            Ok(())
        }
        fn create_stream(&self) -> Result<Stream> {
            Ok(Stream(self.handle()))
        }
        fn destroy_stream(&self, _: Stream) -> Result<()> {
            Ok(())
        }
        fn synchronize_stream(&self, _: Stream) -> Result<()> {
            self.wait_allowed("synchronize_stream")
        }
        fn synchronize_device(&self) -> Result<()> {
            self.wait_allowed("synchronize_device")
        }
        fn create_event(&self) -> Result<Event> {
            Ok(Event(self.handle()))
        }
        fn destroy_event(&self, _: Event) -> Result<()> {
            Ok(())
        }
        fn record_event(&self, _: Event, _: Stream) -> Result<()> {
            Ok(())
        }
        fn elapsed_ms(&self, _: Event, _: Event) -> Result<f32> {
            Ok(0.0)
        }
        fn query_event(&self, _: Event) -> Result<bool> {
            self.wait_allowed("query_event")?;
            Ok(!self.hold_events.load(Ordering::Relaxed))
        }
        fn stream_write_u64(&self, _: Stream, addr: DevicePtr, value: u64) -> Result<()> {
            if self.no_stream_writes {
                return Err(Error::Unsupported("test GPU without stream writes".into()));
            }
            self.stream_writes.fetch_add(1, Ordering::Relaxed);
            // SAFETY: tests pass live, aligned words that readers access atomically.
            unsafe { AtomicU64::from_ptr(addr as *mut u64) }.store(value, Ordering::Release);
            Ok(())
        }
        fn export_memory(
            &self,
            _: &Allocation,
            ptr: DevicePtr,
            size: usize,
        ) -> Result<IpcMemHandle> {
            Ok(IpcMemHandle::Legacy {
                bytes: ptr.to_le_bytes().to_vec(),
                offset: 0,
                size: size as u64,
            })
        }
        fn import_memory(&self, handle: &IpcMemHandle, _: Option<i32>) -> Result<ImportedMemory> {
            match handle {
                IpcMemHandle::Legacy {
                    bytes,
                    offset,
                    size,
                } => {
                    let base = u64::from_le_bytes(bytes.as_slice().try_into().map_err(|_| {
                        Error::InvalidArgument("test IPC handle is not 8 bytes".into())
                    })?);
                    Ok(ImportedMemory {
                        ptr: base + offset,
                        size: *size as usize,
                        base,
                        handle: 0,
                        reserved: *size as usize,
                        legacy: true,
                    })
                }
                other => Err(Error::Unsupported(format!("test import of {other:?}"))),
            }
        }
        fn close_imported(&self, _: &ImportedMemory) -> Result<()> {
            Ok(())
        }
        fn allocation_of(&self, ptr: DevicePtr) -> Result<Allocation> {
            let (base, layout, _) = self.holding(ptr)?;
            Ok(Allocation {
                ptr: base,
                size: layout.size(),
                reserved: layout.size(),
                kind: MemoryKind::Plain,
                device: 0,
                handle: 0,
            })
        }
        fn buffer_id(&self, ptr: DevicePtr) -> Result<u64> {
            Ok(self.holding(ptr)?.2)
        }
        fn is_capturing(&self, _: Stream) -> Result<bool> {
            Ok(self.capturing.load(Ordering::Relaxed))
        }
        fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
            Ok(THREAD_CAPTURE_MODE.replace(mode))
        }
        fn enable_peer_access(&self, peer: usize) -> Result<()> {
            if self.no_peer_access {
                return Err(Error::Unsupported(format!(
                    "test device {peer} is out of reach"
                )));
            }
            self.peer_access
                .lock()
                .map_err(|_| Error::Internal("poisoned".into()))?
                .push(peer);
            Ok(())
        }
        fn load_module(&self, _: &[u8]) -> Result<Module> {
            no_kernels()
        }
        fn get_function(&self, _: Module, _: &str) -> Result<Function> {
            no_kernels()
        }
        unsafe fn launch(
            &self,
            _: Function,
            _: LaunchConfig,
            _: Stream,
            _: &mut [*mut c_void],
        ) -> Result<()> {
            no_kernels()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_gpu::HostGpu;
    use super::*;
    use crate::bootstrap::on_loopback_ranks;
    use crate::device::{TriggerFields, TriggerType};
    use crate::proxy::wait_handled;
    use crate::transport::cuda_ipc::CudaIpcTransport;
    use rstest::rstest;
    use std::sync::atomic::{AtomicU64, Ordering};

    const T: Duration = Duration::from_secs(10);

    #[rstest]
    #[case(&[], false)]
    #[case(&[("CUDA_DEVICE_MAX_CONNECTIONS", "1")], true)]
    #[case(&[("CUDA_DEVICE_MAX_CONNECTIONS", "2")], false)]
    #[case(&[("CUDA_DEVICE_MAX_CONNECTIONS", "32")], false)]
    fn one_hardware_queue_is_a_hazard(#[case] vars: &[(&str, &str)], #[case] hazard: bool) {
        let env = Env::from_vars(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())))
            .expect("valid environment");
        let reason = shared_queue_hazard(&env, None);
        assert_eq!(reason.is_some(), hazard, "{reason:?}");
        if let Some(r) = reason {
            assert!(r.contains("CUDA_DEVICE_MAX_CONNECTIONS=1"), "{r}");
        }
    }

    /// Under MPS, PortChannel traffic worked at 2 ranks a GPU and hung at 4 and 8.
    #[rstest]
    #[case(None, false)]
    #[case(Some(1), false)]
    #[case(Some(2), false)]
    #[case(Some(4), true)]
    #[case(Some(8), true)]
    fn many_mps_clients_on_a_gpu_are_a_hazard(
        #[case] sharers: Option<usize>,
        #[case] hazard: bool,
    ) {
        let env = Env::from_vars(std::iter::empty()).expect("valid environment");
        let reason = shared_queue_hazard(&env, sharers);
        assert_eq!(reason.is_some(), hazard, "{reason:?}");
        if let Some(r) = reason {
            assert!(
                r.contains("MPS") && r.contains(&format!("{} ranks", sharers.unwrap())),
                "{r}"
            );
        }
    }

    fn trigger(
        chan: &PortChannelHandle,
        kind: TriggerType,
        offset: u64,
        size: u64,
    ) -> ProxyTrigger {
        ProxyTrigger::encode(&TriggerFields {
            kind,
            dst_memory_id: chan.dst_memory_id,
            dst_offset: offset,
            src_memory_id: chan.src_memory_id,
            src_offset: offset,
            size,
            semaphore_id: chan.semaphore_id,
        })
        .expect("a valid trigger")
    }

    /// The device's `semaphore.wait()`: waits until the inbound word reaches `target`.
    fn device_wait(sem: &H2DSemaphoreHandle, target: u64) {
        // SAFETY: on the host test GPU device words are live, aligned heap words.
        let word = unsafe { AtomicU64::from_ptr(sem.inbound as *mut u64) };
        let start = std::time::Instant::now();
        while word.load(Ordering::Acquire) < target {
            assert!(start.elapsed() < T, "signal {target} never arrived");
            std::thread::yield_now();
        }
    }

    fn pattern(rank: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + rank * 131 + 3) as u8).collect()
    }

    /// After the communicator failed, the proxy pops triggers without carrying them out: no data
    /// reaches the peer, no signal either, and the pusher's sync still returns.
    #[test]
    fn a_failed_communicator_s_triggers_are_skipped() {
        let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::new());
        let bytes = 4096;
        let results = on_loopback_ranks(2, T, move |rank, boot| -> Result<()> {
            let comm = Communicator::new(boot.clone(), gpu.clone(), 0)?;
            let peer = 1 - rank;
            let src = gpu.alloc(bytes, MemoryKind::Plain)?;
            let dst = gpu.alloc(bytes, MemoryKind::Plain)?;
            gpu.copy_to_device(src.ptr, &pattern(rank, bytes))?;
            gpu.memset_async(dst.ptr, 0xee, bytes, crate::gpu::Stream::DEFAULT)?;
            let mems = comm.exchange(comm.register(&dst, dst.ptr, bytes)?)?;
            let local_src = comm.register(&src, src.ptr, bytes)?;
            let mut svc = PortChannelService::new(&comm, PortChannelConfig::default())?;
            let dst_id = svc.add_memory(&mems[peer])?;
            let src_id = svc.add_memory(&local_src)?;
            let conn = Arc::new(CudaIpcTransport::new(gpu.clone(), 0, peer)?);
            let sem = svc.add_semaphore(&comm, conn)?;
            let chan = svc.port_channel(sem, dst_id, src_id)?;
            svc.start()?;
            comm.abort("the test gave up");
            let pusher = svc.host_pusher();
            let t = trigger(
                &chan,
                TriggerType::DATA | TriggerType::FLAG,
                0,
                bytes as u64,
            );
            let pos = pusher.push(t, T)?;
            pusher.sync(pos, T)?;
            boot.barrier()?;
            let mut got = vec![0u8; bytes];
            gpu.copy_from_device(&mut got, dst.ptr)?;
            assert!(got.iter().all(|&b| b == 0xee), "rank {rank}: data arrived");
            // SAFETY: on the host test GPU device words are live, aligned heap words.
            let signals = unsafe { AtomicU64::from_ptr(chan.semaphore.inbound as *mut u64) };
            assert_eq!(signals.load(Ordering::Acquire), 0, "rank {rank}: signalled");
            assert_eq!(svc.stop()?.handled, 1);
            drop((svc, mems, local_src));
            gpu.free(&src)?;
            gpu.free(&dst)
        });
        for (rank, result) in results.into_iter().enumerate() {
            result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        }
    }

    /// A trigger the proxy cannot carry out (a put past the end of the peer's memory) fails the
    /// communicator with the proxy's error, so its kernels stop waiting for what will never come;
    /// the service still reports the error itself, once.
    #[test]
    fn a_failed_trigger_fails_the_communicator() {
        let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::new());
        let bytes = 4096;
        let results = on_loopback_ranks(2, T, move |rank, boot| -> Result<()> {
            let comm = Communicator::new(boot.clone(), gpu.clone(), 0)?;
            let peer = 1 - rank;
            let buf = gpu.alloc(bytes, MemoryKind::Plain)?;
            let mems = comm.exchange(comm.register(&buf, buf.ptr, bytes)?)?;
            let mut svc = PortChannelService::new(&comm, PortChannelConfig::default())?;
            let dst_id = svc.add_memory(&mems[peer])?;
            let src_id = svc.add_memory(&mems[rank])?;
            let conn = Arc::new(CudaIpcTransport::new(gpu.clone(), 0, peer)?);
            let sem = svc.add_semaphore(&comm, conn)?;
            let chan = svc.port_channel(sem, dst_id, src_id)?;
            svc.start()?;
            let pusher = svc.host_pusher();
            let t = trigger(&chan, TriggerType::DATA, bytes as u64, 16);
            let pos = pusher.push(t, T)?;
            pusher.sync(pos, T)?;
            let e = comm.check("allreduce").expect_err("failed by the proxy");
            assert!(
                matches!(e, Error::Aborted(_)) && e.to_string().contains("PortChannel proxy"),
                "rank {rank}: {e}"
            );
            assert!(
                svc.check().is_err(),
                "rank {rank}: the service's own report"
            );
            assert!(svc.check().is_ok(), "rank {rank}: reported once");
            boot.barrier()?;
            drop((svc, mems));
            gpu.free(&buf)
        });
        for (rank, result) in results.into_iter().enumerate() {
            result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        }
    }

    /// Two ranks as threads, each with a communicator, a service and a CudaIpc connection to the
    /// other: both put their data in chunks with a signal each, wait for the peer's signals,
    /// check the data byte for byte, flush, and stop cleanly.
    #[rstest]
    #[case::one_chunk(1, 4096)]
    #[case::fifo_wraps(40, 40 * 1000 + 13)]
    fn two_ranks_put_signal_flush(#[case] chunks: usize, #[case] bytes: usize) {
        let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::new());
        let results = on_loopback_ranks(2, T, move |rank, boot| -> Result<ProxyStats> {
            let comm = Communicator::new(boot.clone(), gpu.clone(), 0)?;
            let peer = 1 - rank;
            let src = gpu.alloc(bytes, MemoryKind::Plain)?;
            let dst = gpu.alloc(bytes, MemoryKind::Plain)?;
            gpu.copy_to_device(src.ptr, &pattern(rank, bytes))?;
            gpu.memset_async(dst.ptr, 0xee, bytes, crate::gpu::Stream::DEFAULT)?;
            let mems = comm.exchange(comm.register(&dst, dst.ptr, bytes)?)?;
            let local_src = comm.register(&src, src.ptr, bytes)?;
            // Depth 8: the wrapping case pushes far more triggers than slots.
            let config = PortChannelConfig {
                fifo_depth: 8,
                ..Default::default()
            };
            let mut svc = PortChannelService::new(&comm, config)?;
            let dst_id = svc.add_memory(&mems[peer])?;
            let src_id = svc.add_memory(&local_src)?;
            let conn = Arc::new(CudaIpcTransport::new(gpu.clone(), 0, peer)?);
            let sem = svc.add_semaphore(&comm, conn)?;
            let chan = svc.port_channel(sem, dst_id, src_id)?;
            assert_eq!(chan.fifo.error_word, comm.error_word_device_ptr());
            svc.start()?;
            let pusher = svc.host_pusher();
            let chunk = bytes / chunks;
            for k in 0..chunks {
                let size = if k + 1 == chunks {
                    bytes - k * chunk
                } else {
                    chunk
                };
                let t = trigger(
                    &chan,
                    TriggerType::DATA | TriggerType::FLAG,
                    (k * chunk) as u64,
                    size as u64,
                );
                pusher.push(t, T)?;
            }
            device_wait(&chan.semaphore, chunks as u64);
            let mut got = vec![0u8; bytes];
            gpu.copy_from_device(&mut got, dst.ptr)?;
            assert!(
                got == pattern(peer, bytes),
                "rank {rank}: data from rank {peer} differs"
            );
            let pos = pusher.push(trigger(&chan, TriggerType::SYNC, 0, 0), T)?;
            pusher.sync(pos, T)?;
            svc.check()?;
            // The peer may still be pushing into our memory until it is done too.
            boot.barrier()?;
            let stats = svc.stop()?;
            drop(svc);
            drop(mems);
            drop(local_src);
            gpu.free(&src)?;
            gpu.free(&dst)?;
            Ok(stats)
        });
        for (rank, result) in results.into_iter().enumerate() {
            let stats = result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            assert_eq!(
                stats,
                ProxyStats {
                    handled: chunks as u64 + 1,
                    errors: 0
                },
                "rank {rank}"
            );
        }
    }

    struct Loopback {
        gpu: Arc<HostGpu>,
        svc: PortChannelService,
        a: Allocation,
        b: Allocation,
        words: Allocation,
        error_word: HostMapped,
    }

    /// One service whose channel puts from buffer `a` into buffer `b` of the same "device" and
    /// signals its own inbound word (CudaIpc to rank 0 itself).
    fn loopback(depth: u32) -> Loopback {
        let gpu = Arc::new(HostGpu::new());
        let dyn_gpu: Arc<dyn Gpu> = gpu.clone();
        let error_word = gpu
            .alloc_host_mapped(crate::device::ERROR_WORD_BYTES)
            .unwrap();
        let config = PortChannelConfig {
            fifo_depth: depth,
            ..Default::default()
        };
        let svc = PortChannelService::with_gpu(dyn_gpu.clone(), 0, error_word.device_ptr, config)
            .unwrap();
        let a = gpu.alloc(256, MemoryKind::Plain).unwrap();
        let b = gpu.alloc(256, MemoryKind::Plain).unwrap();
        let words = gpu.alloc(16, MemoryKind::Plain).unwrap();
        Loopback {
            gpu,
            svc,
            a,
            b,
            words,
            error_word,
        }
    }

    fn region(a: &Allocation) -> MemoryRegion {
        MemoryRegion {
            addr: a.ptr,
            size: a.size as u64,
            key: 0,
        }
    }

    /// A CudaIpc connection that records where it was told to deliver the peer's signals, and
    /// refuses a second word as IB in write-with-immediate mode does.
    struct SignalSink {
        inner: Arc<dyn Transport>,
        words: std::sync::Mutex<Vec<MemoryRegion>>,
    }

    impl Transport for SignalSink {
        fn kind(&self) -> TransportKind {
            TransportKind::Ib(0)
        }
        fn remote_rank(&self) -> usize {
            self.inner.remote_rank()
        }
        fn write(
            &self,
            dst: &MemoryRegion,
            dst_offset: u64,
            src: &MemoryRegion,
            src_offset: u64,
            bytes: u64,
        ) -> Result<()> {
            self.inner.write(dst, dst_offset, src, src_offset, bytes)
        }
        fn update_and_sync(&self, dst: &MemoryRegion, dst_offset: u64, value: u64) -> Result<()> {
            self.inner.update_and_sync(dst, dst_offset, value)
        }
        fn flush(&self, timeout: Duration) -> Result<()> {
            self.inner.flush(timeout)
        }
        fn deliver_signals_to(&self, word: MemoryRegion) -> Result<()> {
            let mut words = self.words.lock().unwrap();
            if words.first().is_some_and(|w| *w != word) {
                return Err(Error::Unsupported("one semaphore per connection".into()));
            }
            words.push(word);
            Ok(())
        }
    }

    /// Registering a semaphore tells its connection our inbound word (where the peer's signals
    /// land); a connection's refusal fails the registration.
    #[test]
    fn semaphores_tell_their_connection_the_inbound_word() {
        let Loopback {
            gpu,
            mut svc,
            words,
            ..
        } = loopback(4);
        let dyn_gpu: Arc<dyn Gpu> = gpu.clone();
        let sink = Arc::new(SignalSink {
            inner: Arc::new(CudaIpcTransport::new(dyn_gpu, 0, 0).unwrap()),
            words: std::sync::Mutex::new(Vec::new()),
        });
        let first = D2DSemaphoreHandle {
            inbound: words.ptr,
            expected: words.ptr + 8,
            remote_inbound: words.ptr,
            ..Default::default()
        };
        svc.add_semaphore_words(&first, sink.clone()).unwrap();
        let want = MemoryRegion {
            addr: words.ptr,
            size: 8,
            key: 0,
        };
        assert_eq!(*sink.words.lock().unwrap(), vec![want]);
        let second = D2DSemaphoreHandle {
            inbound: words.ptr + 8,
            ..first
        };
        let err = svc.add_semaphore_words(&second, sink.clone()).unwrap_err();
        assert!(err.to_string().contains("one semaphore"), "{err}");
    }

    #[test]
    fn ids_handles_errors_and_shutdown() {
        let Loopback {
            gpu,
            mut svc,
            a,
            b,
            words,
            error_word,
        } = loopback(4);
        let dyn_gpu: Arc<dyn Gpu> = gpu.clone();
        let conn: Arc<dyn Transport> = Arc::new(CudaIpcTransport::new(dyn_gpu, 0, 0).unwrap());
        assert_eq!(svc.add_memory_region(region(&a)).unwrap(), MemoryId(0));
        assert_eq!(svc.add_memory_region(region(&b)).unwrap(), MemoryId(1));
        let sem_words = D2DSemaphoreHandle {
            inbound: words.ptr,
            expected: words.ptr + 8,
            remote_inbound: words.ptr,
            ..Default::default()
        };
        let misaligned = D2DSemaphoreHandle {
            expected: words.ptr + 4,
            ..sem_words
        };
        let err = svc
            .add_semaphore_words(&misaligned, conn.clone())
            .unwrap_err();
        assert!(err.to_string().contains("expected word"), "{err}");
        let sem = svc.add_semaphore_words(&sem_words, conn.clone()).unwrap();
        assert_eq!(sem, SemaphoreId(0));

        // Unknown ids name themselves.
        let err = svc
            .port_channel(SemaphoreId(1), MemoryId(1), MemoryId(0))
            .unwrap_err();
        assert!(err.to_string().contains("semaphore id 1"), "{err}");
        let err = svc.port_channel(sem, MemoryId(5), MemoryId(0)).unwrap_err();
        assert!(err.to_string().contains("dst memory id 5"), "{err}");

        // The handle carries device addresses of ring, tail (own 64-byte line after 4 slots),
        // head, error word and semaphore words.
        let chan = svc.port_channel(sem, MemoryId(1), MemoryId(0)).unwrap();
        assert_eq!(chan.fifo.size, 4);
        assert_eq!(chan.fifo.tail, chan.fifo.triggers + 64);
        assert_eq!(chan.fifo.triggers % 16, 0);
        assert_ne!(chan.fifo.head, 0);
        assert_eq!(chan.fifo.error_word, error_word.device_ptr);
        assert_eq!(chan.semaphore.inbound, words.ptr);
        assert_eq!(chan.semaphore.expected, words.ptr + 8);
        assert_eq!(chan.semaphore.error_word, error_word.device_ptr);
        assert_eq!(
            (chan.semaphore_id, chan.dst_memory_id, chan.src_memory_id),
            (0, 1, 0)
        );
        assert_eq!(svc.fifo_handle(), chan.fifo);

        svc.start().unwrap();
        assert!(svc.is_running());
        let err = svc.add_memory_region(region(&a)).unwrap_err();
        assert!(err.to_string().contains("after start()"), "{err}");
        assert!(svc.add_semaphore_words(&sem_words, conn).is_err());
        assert!(svc.start().is_err(), "start twice");

        // A trigger naming an unregistered memory fails on the proxy, which keeps serving.
        let pusher = svc.host_pusher();
        let bad = ProxyTrigger::encode(&TriggerFields {
            kind: TriggerType::DATA,
            dst_memory_id: 9,
            size: 8,
            ..Default::default()
        })
        .unwrap();
        pusher.push(bad, T).unwrap();
        let proxy = svc.proxy.as_ref().unwrap();
        wait_handled(proxy, 1, T).unwrap();
        let err = svc.check().unwrap_err();
        assert!(err.to_string().contains("memory id 9"), "{err}");
        assert!(svc.check().is_ok(), "reported once");

        // Ten puts through four slots, each 16 bytes with a signal.
        let data: Vec<u8> = (0..=255).collect();
        gpu.copy_to_device(a.ptr, &data).unwrap();
        for k in 0..10u64 {
            let t = trigger(&chan, TriggerType::DATA | TriggerType::FLAG, 16 * k, 16);
            pusher.push(t, T).unwrap();
        }
        device_wait(&chan.semaphore, 10);
        let pos = pusher
            .push(trigger(&chan, TriggerType::SYNC, 0, 0), T)
            .unwrap();
        pusher.sync(pos, T).unwrap();
        let mut got = vec![0u8; 256];
        gpu.copy_from_device(&mut got, b.ptr).unwrap();
        assert_eq!(&got[..160], &data[..160]);
        assert!(
            got[160..].iter().all(|&x| x == 0),
            "nothing beyond the puts"
        );

        let stats = svc.stop().unwrap();
        assert_eq!(
            stats,
            ProxyStats {
                handled: 12,
                errors: 1
            }
        );
        assert_eq!(svc.stop().unwrap(), stats, "stopping twice");
        drop(svc);
        // A pusher keeps the ring alive (it stays safe to use); the last one frees it.
        assert_eq!(
            gpu.live_allocations(),
            5,
            "a, b, words, error word and the ring"
        );
        drop(pusher);
        for alloc in [&a, &b, &words] {
            gpu.free(alloc).unwrap();
        }
        gpu.free_host_mapped(&error_word).unwrap();
        assert_eq!(
            gpu.live_allocations(),
            0,
            "ring and head freed with the service"
        );
    }

    /// The loopback's channel: puts from `a` into `b`, signals into the first word of `words`
    /// (the second is the expected counter).
    fn a_to_b(
        gpu: &Arc<HostGpu>,
        svc: &mut PortChannelService,
        a: &Allocation,
        b: &Allocation,
        words: &Allocation,
    ) -> PortChannelHandle {
        let dyn_gpu: Arc<dyn Gpu> = gpu.clone();
        let conn: Arc<dyn Transport> = Arc::new(CudaIpcTransport::new(dyn_gpu, 0, 0).unwrap());
        let src = svc.add_memory_region(region(a)).unwrap();
        let dst = svc.add_memory_region(region(b)).unwrap();
        let sem_words = D2DSemaphoreHandle {
            inbound: words.ptr,
            expected: words.ptr + 8,
            remote_inbound: words.ptr,
            ..Default::default()
        };
        let sem = svc.add_semaphore_words(&sem_words, conn).unwrap();
        svc.port_channel(sem, dst, src).unwrap()
    }

    /// Dropping a running service drains what was pushed, and a service that never started
    /// frees its FIFO too.
    #[rstest]
    #[case::running(true)]
    #[case::never_started(false)]
    fn drop_stops_and_frees(#[case] start: bool) {
        let Loopback {
            gpu,
            mut svc,
            a,
            b,
            words,
            error_word,
        } = loopback(Fifo::DEFAULT_DEPTH);
        let chan = a_to_b(&gpu, &mut svc, &a, &b, &words);
        if start {
            svc.start().unwrap();
            let pusher = svc.host_pusher();
            for _ in 0..100 {
                pusher
                    .push(trigger(&chan, TriggerType::FLAG, 0, 0), T)
                    .unwrap();
            }
        }
        drop(svc);
        // SAFETY: a live, aligned word of the host test GPU.
        let signals = unsafe { AtomicU64::from_ptr(words.ptr as *mut u64) }.load(Ordering::Acquire);
        assert_eq!(signals, if start { 100 } else { 0 });
        for alloc in [&a, &b, &words] {
            gpu.free(alloc).unwrap();
        }
        gpu.free_host_mapped(&error_word).unwrap();
        assert_eq!(gpu.live_allocations(), 0);
    }

    /// While the caller's thread captures a graph in global mode (PyTorch's default), the proxy's
    /// puts, signals and flushes still complete: its thread works in relaxed mode, where the
    /// driver would refuse its waits and invalidate the capture.
    #[test]
    fn the_proxy_serves_while_another_thread_captures_globally() {
        let mut lb = loopback(Fifo::DEFAULT_DEPTH);
        let (gpu, a, b) = (lb.gpu.clone(), lb.a.clone(), lb.b.clone());
        let chan = a_to_b(&gpu, &mut lb.svc, &a, &b, &lb.words);
        lb.svc.start().unwrap();
        let data: Vec<u8> = (0..=255).collect();
        gpu.copy_to_device(a.ptr, &data).unwrap();
        gpu.capture_globally_elsewhere(true);
        let this_thread = gpu.synchronize_stream(crate::gpu::Stream::DEFAULT);
        assert!(this_thread.is_err(), "the test's thread is in global mode");
        let pusher = lb.svc.host_pusher();
        let put = trigger(&chan, TriggerType::DATA | TriggerType::FLAG, 0, 64);
        pusher.push(put, T).unwrap();
        let pos = pusher
            .push(trigger(&chan, TriggerType::SYNC, 0, 0), T)
            .unwrap();
        pusher.sync(pos, T).unwrap();
        lb.svc.check().expect("the proxy's flush in relaxed mode");
        let mut got = vec![0u8; 64];
        gpu.copy_from_device(&mut got, b.ptr).unwrap();
        assert_eq!(got, data[..64]);
        assert_eq!(lb.svc.stop().unwrap().errors, 0);
        gpu.capture_globally_elsewhere(false);
        drop(lb.svc);
        drop(pusher);
        for alloc in [&a, &b, &lb.words] {
            gpu.free(alloc).unwrap();
        }
        gpu.free_host_mapped(&lb.error_word).unwrap();
    }

    #[test]
    fn zero_depth_is_rejected() {
        let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::new());
        let err = DeviceFifo::new(&gpu, 0).unwrap_err();
        assert!(err.to_string().contains("depth"), "{err}");
    }
}
