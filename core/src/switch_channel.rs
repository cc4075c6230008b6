//! SwitchChannel: a buffer per rank bound to one NVLink multicast object (NVLS, MSCCL++'s
//! `SwitchChannel` / `NvlsConnection`).
//!
//! Through the multicast address a kernel reduces the same bytes of every rank's buffer in the
//! NVSwitch with one `multimem.ld_reduce`, and writes them to every rank with one `multimem.st`
//! (`kernels-cu/include/mscclpp/switch_channel.cuh`, docs/device-abi.md).
//!
//! # Safety gate
//! NVLink multicast can take a shared host's GPUs out of service (DESIGN.md, "Safety on shared
//! GPUs"). [`SwitchChannel::new`] refuses with the error of [`nvls_gate`] unless
//! `MSCCLPP_ENABLE_NVLS=1` is set and neither `MSCCLPP_FORCE_DISABLE_NVLS=1` nor
//! `NCCL_NVLS_ENABLE=0` is. The refusal comes before any bootstrap message or driver call. The
//! gate reads this process's environment, so **every rank must run with the same NVLS variables**:
//! a rank whose gate is closed returns at once while its peers (gate open) wait in the first
//! collective step until the bootstrap timeout, and then fail naming that rank.
//!
//! # Collective setup (every rank calls [`SwitchChannel::new`] with the same size)
//! 1. check: each rank validates its buffer (VMM, large enough) and asks its backend whether the
//!    device supports multicast; the ranks exchange the outcome and the requested size, so a
//!    problem on one rank fails every rank at once, each naming the rank and reason.
//! 2. create: rank 0 creates the object for `size` bytes and `nranks` devices and broadcasts its
//!    export (a POSIX file descriptor plus geometry); the other ranks import it (`pidfd_getfd`).
//! 3. add device: every rank adds its device; the exchange that follows is the barrier the driver
//!    needs (all devices are added before any binds).
//! 4. bind and map: every rank binds its buffer at multicast offset 0 and maps the object.
//!
//! Each step ends with an exchange of outcomes, so all ranks leave setup with the same verdict;
//! a failed setup undoes this rank's completed steps.
//!
//! # Teardown
//! Dropping the channel unmaps, unbinds and releases the object on this rank. Kernels of any rank
//! that use the channel must have finished first (synchronise and barrier before dropping).

use crate::bootstrap::Bootstrap;
use crate::communicator::Communicator;
use crate::device::SwitchChannelHandle;
use crate::env::Env;
use crate::error::{Error, Result};
use crate::gpu::{Allocation, DevicePtr, Gpu, MemoryKind, MulticastExport, MulticastHandle};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The rank that creates the multicast object and exports it to the others.
const CREATOR: usize = 0;

/// The NVLS safety gate: `Ok` only when [`Env::nvls_allowed`]; otherwise `Unsupported` saying which
/// variable closes it. Every NVLS entry point (this module and the backends) calls this first.
pub fn nvls_gate(env: &Env) -> Result<()> {
    if env.nvls_allowed() {
        return Ok(());
    }
    let why = if !env.enable_nvls {
        "MSCCLPP_ENABLE_NVLS is not set to 1"
    } else if env.force_disable_nvls {
        "MSCCLPP_FORCE_DISABLE_NVLS (or MSCCLPP_DISABLE_NVLS) is set"
    } else {
        "NCCL_NVLS_ENABLE=0 is set"
    };
    Err(Error::Unsupported(format!(
        "NVLS is disabled: set MSCCLPP_ENABLE_NVLS=1 (with neither MSCCLPP_FORCE_DISABLE_NVLS=1 \
         nor NCCL_NVLS_ENABLE=0) to use NVLink multicast; here {why}"
    )))
}

/// What rank 0 broadcasts in step 2.
#[derive(Debug, Serialize, Deserialize)]
enum CreateOutcome {
    Created(MulticastExport),
    Failed(String),
}

/// Step outcome on the wire: `[0] ++ payload` for success, `[1] ++ message` for failure.
fn encode_outcome(local: &Result<Vec<u8>>) -> Vec<u8> {
    match local {
        Ok(payload) => [&[0u8][..], payload].concat(),
        Err(e) => [&[1u8][..], e.to_string().as_bytes()].concat(),
    }
}

/// Collective: every rank contributes the outcome of its part of `step`; every rank learns them
/// all. Returns every rank's payload when all succeeded; otherwise this rank's own error, or the
/// first failed peer's (as [`Error::Peer`], listing the others).
fn agree(boot: &dyn Bootstrap, step: &str, local: Result<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
    let gathered = match boot.all_gather(&encode_outcome(&local)) {
        Ok(g) => g,
        // Our own failure says more than the exchange that could not report it.
        Err(e) => return Err(local.err().unwrap_or(e)),
    };
    local?;
    let me = boot.rank();
    let mut failures = Vec::new();
    let mut payloads = Vec::with_capacity(gathered.len());
    for (rank, bytes) in gathered.into_iter().enumerate() {
        match bytes.split_first() {
            Some((0, payload)) => payloads.push(payload.to_vec()),
            Some((1, message)) => {
                failures.push((rank, String::from_utf8_lossy(message).into_owned()));
                payloads.push(Vec::new());
            }
            _ if rank == me => payloads.push(Vec::new()),
            _ => failures.push((rank, "sent a malformed step outcome".to_string())),
        }
    }
    match failures.split_first() {
        None => Ok(payloads),
        Some(((rank, message), rest)) => {
            let others: Vec<String> = rest.iter().map(|(r, _)| r.to_string()).collect();
            let also = if others.is_empty() {
                String::new()
            } else {
                format!(" (ranks {} failed too)", others.join(", "))
            };
            Err(Error::Peer {
                rank: *rank,
                message: format!("SwitchChannel setup step `{step}` failed there: {message}{also}"),
            })
        }
    }
}

/// Takes part in `step`'s exchange with a local failure; returns the error to hand back.
fn report_failure(boot: &dyn Bootstrap, step: &str, error: Error) -> Error {
    match agree(boot, step, Err(error)) {
        Err(e) => e,
        Ok(_) => Error::Internal(format!("the `{step}` exchange accepted a failed step")),
    }
}

/// One rank's SwitchChannel: the multicast object, this rank's binding and mapping. See the
/// module docs.
pub struct SwitchChannel {
    gpu: Arc<dyn Gpu>,
    mc: MulticastHandle,
    /// Bytes bound at multicast offset 0 (None until step 4 binds).
    bound: Option<usize>,
    /// The multicast mapping (None until step 4 maps).
    mc_ptr: Option<DevicePtr>,
    device_ptr: DevicePtr,
    size: usize,
    /// The device this rank bound (unbinding names it explicitly).
    device: usize,
}

impl std::fmt::Debug for SwitchChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwitchChannel")
            .field("mc", &self.mc)
            .field("bound", &self.bound)
            .field("mc_ptr", &self.mc_ptr)
            .field("device_ptr", &self.device_ptr)
            .field("size", &self.size)
            .field("device", &self.device)
            .finish()
    }
}

impl SwitchChannel {
    /// Collective: binds `size` bytes from the start of `buffer` (a VMM allocation of this rank's
    /// device) to a new multicast object shared by every rank of `comm`. Refuses with
    /// [`nvls_gate`]'s error, before any collective step, unless the environment allows NVLS.
    pub fn new(comm: &Communicator, buffer: &Allocation, size: usize) -> Result<Self> {
        Self::with_env(comm, buffer, size, Env::get()?)
    }

    /// [`SwitchChannel::new`] with an explicit environment (tests; embedders that parse their
    /// own). The gate is decided by `env`; the backend's own gate (the process environment) still
    /// applies to every driver call.
    pub fn with_env(
        comm: &Communicator,
        buffer: &Allocation,
        size: usize,
        env: &Env,
    ) -> Result<Self> {
        nvls_gate(env)?;
        setup(
            comm.bootstrap().as_ref(),
            comm.gpu().clone(),
            comm.device(),
            buffer,
            size,
        )
    }

    /// The device handle kernels receive.
    pub fn handle(&self) -> SwitchChannelHandle {
        SwitchChannelHandle {
            device_ptr: self.device_ptr,
            mc_ptr: self.mc_ptr.unwrap_or(0),
            size: self.size as u64,
        }
    }

    /// The multicast object (geometry: requested size, reserved bytes, granularity).
    pub fn multicast(&self) -> &MulticastHandle {
        &self.mc
    }

    /// Usable bytes.
    pub fn size(&self) -> usize {
        self.size
    }
}

impl Drop for SwitchChannel {
    fn drop(&mut self) {
        // Reverse order of setup; every step is attempted even if an earlier one fails, so a
        // driver error leaks as little as possible.
        if let Some(ptr) = self.mc_ptr.take() {
            if let Err(e) = self.gpu.unmap_multicast(&self.mc, ptr) {
                tracing::warn!(target: "mscclpp::conn", "unmapping the multicast object: {e}");
            }
        }
        if let Some(bytes) = self.bound.take() {
            if let Err(e) = self.gpu.multicast_unbind(&self.mc, self.device, bytes) {
                tracing::warn!(target: "mscclpp::conn", "unbinding from the multicast object: {e}");
            }
        }
        if let Err(e) = self.gpu.free_multicast(&self.mc) {
            tracing::warn!(target: "mscclpp::conn", "releasing the multicast object: {e}");
        }
    }
}

/// Step 1's local part: the buffer and size are usable and the device supports NVLS.
fn check_local(gpu: &dyn Gpu, device: usize, buffer: &Allocation, size: usize) -> Result<()> {
    if size == 0 {
        return Err(Error::InvalidArgument(
            "SwitchChannel size is 0 bytes".into(),
        ));
    }
    if buffer.kind != MemoryKind::Vmm {
        return Err(Error::InvalidArgument(format!(
            "SwitchChannel buffer at {:#x} is {:?} memory; NVLink multicast binds only VMM \
             allocations (MemoryKind::Vmm)",
            buffer.ptr, buffer.kind
        )));
    }
    if size > buffer.size {
        return Err(Error::InvalidArgument(format!(
            "SwitchChannel size {size} exceeds its buffer of {} bytes at {:#x}",
            buffer.size, buffer.ptr
        )));
    }
    if buffer.device != device {
        return Err(Error::InvalidArgument(format!(
            "SwitchChannel buffer is on device {}, the communicator on device {device}",
            buffer.device
        )));
    }
    if !gpu.is_nvls_supported(device)? {
        return Err(Error::Unsupported(format!(
            "device {device} ({} backend) does not support NVLink multicast, or its backend's \
             NVLS gate (this process's MSCCLPP_ENABLE_NVLS) is closed",
            gpu.backend_name()
        )));
    }
    Ok(())
}

/// Steps 1-4 of the module docs (the gate has been checked).
fn setup(
    boot: &dyn Bootstrap,
    gpu: Arc<dyn Gpu>,
    device: usize,
    buffer: &Allocation,
    size: usize,
) -> Result<SwitchChannel> {
    let nranks = boot.size();
    let rank = boot.rank();

    // 1. check
    let local =
        check_local(gpu.as_ref(), device, buffer, size).map(|()| size.to_le_bytes().to_vec());
    let sizes = agree(boot, "check", local)?;
    if let Some((r, s)) = sizes
        .iter()
        .enumerate()
        .find(|(_, s)| s.as_slice() != size.to_le_bytes())
    {
        return Err(Error::InvalidArgument(format!(
            "SwitchChannel sizes differ: rank {rank} asked for {size} bytes, rank {r} for {}",
            <[u8; 8]>::try_from(s.as_slice())
                .map_or("a malformed size".to_string(), |b| u64::from_le_bytes(b)
                    .to_string())
        )));
    }

    // 2. create (rank 0) and import (the others). From here on, dropping `channel` undoes
    // whatever this rank has done.
    let channel = |mc| SwitchChannel {
        gpu: gpu.clone(),
        mc,
        bound: None,
        mc_ptr: None,
        device_ptr: buffer.ptr,
        size,
        device,
    };
    let mut channel = if rank == CREATOR {
        // A failed export drops the channel inside the closure, which releases the object.
        let created = gpu
            .create_multicast(size, nranks)
            .map(channel)
            .and_then(|c| {
                let export = gpu.export_multicast(&c.mc)?;
                Ok((c, export))
            });
        let outcome = match &created {
            Ok((_, export)) => CreateOutcome::Created(export.clone()),
            Err(e) => CreateOutcome::Failed(e.to_string()),
        };
        let bytes = serde_json::to_vec(&outcome)
            .map_err(|e| Error::Internal(format!("serialising a multicast export: {e}")))?;
        let sent = boot.broadcast(CREATOR, &bytes);
        let (created, _) = created?;
        sent?;
        created
    } else {
        let bytes = boot.broadcast(CREATOR, &[])?;
        let outcome: CreateOutcome = serde_json::from_slice(&bytes).map_err(|e| Error::Peer {
            rank: CREATOR,
            message: format!("sent a malformed multicast export: {e}"),
        })?;
        let export = match outcome {
            CreateOutcome::Created(export) => export,
            CreateOutcome::Failed(message) => {
                return Err(Error::Peer {
                    rank: CREATOR,
                    message: format!("creating the multicast object failed there: {message}"),
                })
            }
        };
        match gpu.import_multicast(&export, None) {
            Ok(mc) => channel(mc),
            // Reported in the exchange, so rank 0 and the others fail too instead of waiting.
            Err(e) => return Err(report_failure(boot, "import", e)),
        }
    };
    agree(boot, "import", Ok(Vec::new()))?;

    // 3. add device; the exchange is the barrier before any bind.
    let added = gpu
        .multicast_add_device(&channel.mc, device)
        .map(|()| Vec::new());
    agree(boot, "add device", added)?;

    // 4. bind and map
    let bind_map = (|| -> Result<Vec<u8>> {
        let need = channel.mc.reserved;
        if buffer.reserved < need {
            return Err(Error::InvalidArgument(format!(
                "SwitchChannel buffer at {:#x} reserves {} bytes but the multicast object is {need} \
                 bytes (granularity {}); allocate at least {need} bytes",
                buffer.ptr, buffer.reserved, channel.mc.granularity
            )));
        }
        gpu.multicast_bind_memory(&channel.mc, buffer, 0, need)?;
        channel.bound = Some(need);
        channel.mc_ptr = Some(gpu.map_multicast(&channel.mc)?);
        Ok(Vec::new())
    })();
    agree(boot, "bind and map", bind_map)?;
    tracing::debug!(
        target: "mscclpp::conn",
        "rank {rank}: SwitchChannel of {size} bytes over {nranks} ranks (multicast object {} bytes)",
        channel.mc.reserved
    );
    Ok(channel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::{BootstrapConfig, TcpBootstrap};
    use crate::gpu::*;
    use crate::port_channel::test_gpu::HostGpu;
    use rstest::rstest;
    use std::collections::HashMap;
    use std::ffi::c_void;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::time::Duration;

    const T: Duration = Duration::from_secs(10);
    /// Multicast granularity of the fake backend.
    const GRAN: usize = 4096;

    fn env(pairs: &[(&str, &str)]) -> Env {
        Env::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
            .expect("test environment parses")
    }

    /// Multicast objects shared by the ranks (threads) of one test, by id.
    #[derive(Default)]
    struct Fabric {
        next: usize,
        /// id -> (references, devices added, bound buffers)
        objects: HashMap<usize, (usize, usize, Vec<DevicePtr>)>,
    }

    /// A Gpu over host memory (HostGpu) whose multicast calls are simulated on a shared
    /// [`Fabric`] and logged, so tests see exactly which NVLS steps ran. Never a real driver.
    struct FakeNvlsGpu {
        host: HostGpu,
        supported: bool,
        fabric: Arc<Mutex<Fabric>>,
        log: Mutex<Vec<String>>,
        /// Fail `multicast_bind_memory` (to test failure propagation).
        fail_bind: bool,
    }

    impl FakeNvlsGpu {
        fn new(fabric: Arc<Mutex<Fabric>>) -> Self {
            FakeNvlsGpu {
                host: HostGpu::new(),
                supported: true,
                fabric,
                log: Mutex::new(Vec::new()),
                fail_bind: false,
            }
        }
        fn record(&self, what: &str) {
            self.log.lock().expect("log").push(what.to_string());
        }
        fn calls(&self) -> Vec<String> {
            self.log.lock().expect("log").clone()
        }
        fn fabric(&self) -> std::sync::MutexGuard<'_, Fabric> {
            self.fabric.lock().expect("fabric")
        }
    }

    impl Gpu for FakeNvlsGpu {
        fn backend_name(&self) -> &'static str {
            "fake-nvls"
        }
        fn device_count(&self) -> Result<usize> {
            self.host.device_count()
        }
        fn set_device(&self, d: usize) -> Result<()> {
            self.host.set_device(d)
        }
        fn current_device(&self) -> Result<usize> {
            self.host.current_device()
        }
        fn properties(&self, d: usize) -> Result<DeviceProperties> {
            self.host.properties(d)
        }
        fn alloc(&self, size: usize, kind: MemoryKind) -> Result<Allocation> {
            self.host.alloc(size, kind)
        }
        fn free(&self, a: &Allocation) -> Result<()> {
            self.host.free(a)
        }
        fn alloc_host_mapped(&self, size: usize) -> Result<HostMapped> {
            self.host.alloc_host_mapped(size)
        }
        fn free_host_mapped(&self, m: &HostMapped) -> Result<()> {
            self.host.free_host_mapped(m)
        }
        fn memcpy_async(&self, d: DevicePtr, s: DevicePtr, n: usize, st: Stream) -> Result<()> {
            self.host.memcpy_async(d, s, n, st)
        }
        fn copy_to_device(&self, d: DevicePtr, s: &[u8]) -> Result<()> {
            self.host.copy_to_device(d, s)
        }
        fn copy_from_device(&self, d: &mut [u8], s: DevicePtr) -> Result<()> {
            self.host.copy_from_device(d, s)
        }
        fn memset_async(&self, d: DevicePtr, v: u8, n: usize, st: Stream) -> Result<()> {
            self.host.memset_async(d, v, n, st)
        }
        fn create_stream(&self) -> Result<Stream> {
            self.host.create_stream()
        }
        fn destroy_stream(&self, s: Stream) -> Result<()> {
            self.host.destroy_stream(s)
        }
        fn synchronize_stream(&self, s: Stream) -> Result<()> {
            self.host.synchronize_stream(s)
        }
        fn synchronize_device(&self) -> Result<()> {
            self.host.synchronize_device()
        }
        fn create_event(&self) -> Result<Event> {
            self.host.create_event()
        }
        fn destroy_event(&self, e: Event) -> Result<()> {
            self.host.destroy_event(e)
        }
        fn record_event(&self, e: Event, s: Stream) -> Result<()> {
            self.host.record_event(e, s)
        }
        fn elapsed_ms(&self, a: Event, b: Event) -> Result<f32> {
            self.host.elapsed_ms(a, b)
        }
        fn export_memory(&self, a: &Allocation, p: DevicePtr, n: usize) -> Result<IpcMemHandle> {
            self.host.export_memory(a, p, n)
        }
        fn import_memory(&self, h: &IpcMemHandle, fd: Option<i32>) -> Result<ImportedMemory> {
            self.host.import_memory(h, fd)
        }
        fn close_imported(&self, m: &ImportedMemory) -> Result<()> {
            self.host.close_imported(m)
        }
        fn load_module(&self, image: &[u8]) -> Result<Module> {
            self.host.load_module(image)
        }
        fn get_function(&self, m: Module, name: &str) -> Result<Function> {
            self.host.get_function(m, name)
        }
        unsafe fn launch(
            &self,
            f: Function,
            c: LaunchConfig,
            s: Stream,
            p: &mut [*mut c_void],
        ) -> Result<()> {
            // SAFETY: forwarded unchanged; HostGpu refuses every launch.
            unsafe { self.host.launch(f, c, s, p) }
        }

        fn is_nvls_supported(&self, _device: usize) -> Result<bool> {
            self.record("is_nvls_supported");
            Ok(self.supported)
        }
        fn create_multicast(&self, size: usize, num_devices: usize) -> Result<MulticastHandle> {
            self.record("create");
            let mut f = self.fabric();
            f.next += 1;
            let id = f.next;
            f.objects.insert(id, (1, 0, Vec::new()));
            Ok(MulticastHandle {
                handle: id as u64,
                size,
                reserved: size.next_multiple_of(GRAN),
                granularity: GRAN,
                num_devices,
            })
        }
        fn export_multicast(&self, h: &MulticastHandle) -> Result<MulticastExport> {
            self.record("export");
            Ok(MulticastExport {
                pid: std::process::id(),
                fd: h.handle as i32,
                size: h.size as u64,
                reserved: h.reserved as u64,
                granularity: h.granularity as u64,
                num_devices: h.num_devices as u32,
            })
        }
        fn import_multicast(
            &self,
            e: &MulticastExport,
            _fd: Option<i32>,
        ) -> Result<MulticastHandle> {
            self.record("import");
            let mut f = self.fabric();
            let obj = f
                .objects
                .get_mut(&(e.fd as usize))
                .ok_or_else(|| Error::InvalidArgument(format!("no multicast object {}", e.fd)))?;
            obj.0 += 1;
            Ok(MulticastHandle {
                handle: e.fd as u64,
                size: e.size as usize,
                reserved: e.reserved as usize,
                granularity: e.granularity as usize,
                num_devices: e.num_devices as usize,
            })
        }
        fn multicast_add_device(&self, h: &MulticastHandle, _device: usize) -> Result<()> {
            self.record("add_device");
            let mut f = self.fabric();
            let obj = f
                .objects
                .get_mut(&(h.handle as usize))
                .expect("live object");
            obj.1 += 1;
            assert!(
                obj.1 <= h.num_devices,
                "more devices added than created for"
            );
            Ok(())
        }
        fn multicast_bind_memory(
            &self,
            h: &MulticastHandle,
            a: &Allocation,
            offset: usize,
            size: usize,
        ) -> Result<()> {
            self.record("bind");
            if self.fail_bind {
                return Err(Error::Driver {
                    call: "cuMulticastBindMem",
                    code: 1,
                    message: "injected by the test".into(),
                });
            }
            assert_eq!((offset, size % h.granularity), (0, 0));
            let mut f = self.fabric();
            let obj = f
                .objects
                .get_mut(&(h.handle as usize))
                .expect("live object");
            // The driver requires every device to be added before the first bind.
            assert_eq!(obj.1, h.num_devices, "bind before every device was added");
            obj.2.push(a.ptr);
            Ok(())
        }
        fn multicast_unbind(&self, h: &MulticastHandle, _device: usize, size: usize) -> Result<()> {
            self.record("unbind");
            assert_eq!(size, h.reserved);
            Ok(())
        }
        fn map_multicast(&self, h: &MulticastHandle) -> Result<DevicePtr> {
            self.record("map");
            Ok(0xc000_0000_0000 + h.handle * 0x1_0000_0000)
        }
        fn unmap_multicast(&self, _h: &MulticastHandle, _ptr: DevicePtr) -> Result<()> {
            self.record("unmap");
            Ok(())
        }
        fn free_multicast(&self, h: &MulticastHandle) -> Result<()> {
            self.record("free");
            let mut f = self.fabric();
            let id = h.handle as usize;
            let obj = f.objects.get_mut(&id).expect("live object");
            obj.0 -= 1;
            if obj.0 == 0 {
                f.objects.remove(&id);
            }
            Ok(())
        }
    }

    /// A bootstrap that counts calls, to prove the gate refuses before any collective step.
    struct Counting {
        inner: TcpBootstrap,
        calls: AtomicUsize,
    }

    impl Bootstrap for Counting {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn size(&self) -> usize {
            self.inner.size()
        }
        fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.inner.send(peer, tag, data)
        }
        fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.inner.recv(peer, tag)
        }
        fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.inner.all_gather(data)
        }
        fn barrier(&self) -> Result<()> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.inner.barrier()
        }
        fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.inner.broadcast(root, data)
        }
    }

    /// Runs `f(comm, gpu, bootstrap)` on `n` ranks as threads (rank `r` gets `gpus[r]`);
    /// returns each rank's result.
    fn run_ranks<R, F>(gpus: Vec<Arc<FakeNvlsGpu>>, f: F) -> Vec<R>
    where
        R: Send + 'static,
        F: Fn(&Communicator, &FakeNvlsGpu, &Counting) -> R + Send + Sync + 'static,
    {
        let n = gpus.len();
        let cfg = BootstrapConfig::default().with_timeout(T);
        let id = TcpBootstrap::create_unique_id(&cfg).expect("unique id");
        let f = Arc::new(f);
        let threads: Vec<_> = gpus
            .into_iter()
            .enumerate()
            .map(|(rank, gpu)| {
                let (id, cfg, f) = (id.clone(), cfg.clone(), f.clone());
                std::thread::spawn(move || {
                    let boot = Arc::new(Counting {
                        inner: TcpBootstrap::new(rank, n, &id, &cfg).expect("bootstrap"),
                        calls: AtomicUsize::new(0),
                    });
                    let comm = Communicator::new(boot.clone(), gpu.clone(), 0).expect("comm");
                    f(&comm, &gpu, &boot)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("rank thread"))
            .collect()
    }

    fn fakes(n: usize) -> (Arc<Mutex<Fabric>>, Vec<Arc<FakeNvlsGpu>>) {
        let fabric = Arc::new(Mutex::new(Fabric::default()));
        let gpus = (0..n)
            .map(|_| Arc::new(FakeNvlsGpu::new(fabric.clone())))
            .collect();
        (fabric, gpus)
    }

    const OPEN: &[(&str, &str)] = &[("MSCCLPP_ENABLE_NVLS", "1")];

    /// All 27 combinations of unset / 0 / 1 for the three variables: NVLS is allowed exactly when
    /// MSCCLPP_ENABLE_NVLS=1, MSCCLPP_FORCE_DISABLE_NVLS is not 1 and NCCL_NVLS_ENABLE is not 0,
    /// and the gate agrees with `nvls_allowed`.
    #[test]
    fn every_combination_of_the_three_variables_decides_the_gate() {
        let values = [None, Some("0"), Some("1")];
        for enable in values {
            for force in values {
                for nccl in values {
                    let pairs: Vec<(&str, &str)> = [
                        ("MSCCLPP_ENABLE_NVLS", enable),
                        ("MSCCLPP_FORCE_DISABLE_NVLS", force),
                        ("NCCL_NVLS_ENABLE", nccl),
                    ]
                    .into_iter()
                    .filter_map(|(k, v)| v.map(|v| (k, v)))
                    .collect();
                    let e = env(&pairs);
                    let want = enable == Some("1") && force != Some("1") && nccl != Some("0");
                    assert_eq!(e.nvls_allowed(), want, "{pairs:?}");
                    assert_eq!(nvls_gate(&e).is_ok(), want, "{pairs:?}");
                }
            }
        }
    }

    #[rstest]
    #[case::nothing_set(&[], "MSCCLPP_ENABLE_NVLS is not set")]
    #[case::enable_0(&[("MSCCLPP_ENABLE_NVLS", "0")], "MSCCLPP_ENABLE_NVLS is not set")]
    #[case::forced_off(
        &[("MSCCLPP_ENABLE_NVLS", "1"), ("MSCCLPP_FORCE_DISABLE_NVLS", "1")],
        "MSCCLPP_FORCE_DISABLE_NVLS"
    )]
    #[case::old_name_off(
        &[("MSCCLPP_ENABLE_NVLS", "1"), ("MSCCLPP_DISABLE_NVLS", "1")],
        "MSCCLPP_FORCE_DISABLE_NVLS"
    )]
    #[case::nccl_off(&[("MSCCLPP_ENABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0")], "NCCL_NVLS_ENABLE=0")]
    #[case::only_nccl_on(&[("NCCL_NVLS_ENABLE", "1")], "MSCCLPP_ENABLE_NVLS is not set")]
    fn closed_gate_refuses_before_any_collective_step(
        #[case] pairs: &[(&str, &str)],
        #[case] why: &'static str,
    ) {
        let e = env(pairs);
        assert!(!e.nvls_allowed());
        let err = nvls_gate(&e).unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("NVLS is disabled: set MSCCLPP_ENABLE_NVLS=1"),
            "{text}"
        );
        assert!(text.contains(why), "{text}");

        let (fabric, gpus) = fakes(2);
        let outcomes = run_ranks(gpus, move |comm, gpu, boot| {
            let buf = gpu.alloc(GRAN, MemoryKind::Vmm).expect("buffer");
            let before = boot.calls.load(Ordering::SeqCst);
            let r = SwitchChannel::with_env(comm, &buf, GRAN, &e);
            let messages = boot.calls.load(Ordering::SeqCst) - before;
            gpu.free(&buf).expect("free");
            (
                r.map(|_| ()).map_err(|e| e.to_string()),
                messages,
                gpu.calls(),
            )
        });
        for (rank, (r, messages, calls)) in outcomes.into_iter().enumerate() {
            let msg = r.expect_err("a closed gate must refuse");
            assert!(msg.contains("NVLS is disabled"), "rank {rank}: {msg}");
            assert_eq!(
                messages, 0,
                "rank {rank} sent bootstrap messages before refusing"
            );
            assert!(calls.is_empty(), "rank {rank} made NVLS calls: {calls:?}");
        }
        assert!(fabric.lock().expect("fabric").objects.is_empty());
    }

    #[rstest]
    #[case::one_object_two_ranks(2, 1000)]
    #[case::three_ranks_exact_granule(3, GRAN)]
    fn open_gate_runs_the_collective_protocol(#[case] n: usize, #[case] size: usize) {
        let (fabric, gpus) = fakes(n);
        let outcomes = run_ranks(gpus, move |comm, gpu, _| {
            let buf = gpu
                .alloc(size.next_multiple_of(GRAN), MemoryKind::Vmm)
                .expect("buffer");
            let chan = SwitchChannel::with_env(comm, &buf, size, &env(OPEN)).expect("channel");
            let h = chan.handle();
            assert_eq!((h.device_ptr, h.size), (buf.ptr, size as u64));
            assert_ne!(h.mc_ptr, 0);
            assert_eq!(chan.multicast().reserved, size.next_multiple_of(GRAN));
            assert_eq!(chan.multicast().num_devices, comm.size());
            let during = gpu.calls();
            // Every rank must be done with setup before anyone tears down (as after kernels).
            comm.bootstrap().barrier().expect("barrier");
            drop(chan);
            gpu.free(&buf).expect("free");
            (comm.rank(), buf.ptr, during, gpu.calls())
        });
        let mut bound_everywhere = Vec::new();
        for (rank, ptr, during, after) in outcomes {
            bound_everywhere.push(ptr);
            let first = if rank == 0 {
                ["create", "export"]
            } else {
                ["import", "import"]
            };
            let want: Vec<&str> = ["is_nvls_supported"]
                .into_iter()
                .chain(first.into_iter().take(if rank == 0 { 2 } else { 1 }))
                .chain(["add_device", "bind", "map"])
                .collect();
            assert_eq!(during, want, "rank {rank}");
            assert_eq!(
                &after[want.len()..],
                ["unmap", "unbind", "free"],
                "rank {rank}"
            );
        }
        assert_eq!(bound_everywhere.len(), n);
        // Every reference was released: the object is gone.
        assert!(fabric.lock().expect("fabric").objects.is_empty());
    }

    #[rstest]
    #[case::not_vmm(MemoryKind::Plain, GRAN, GRAN, "VMM")]
    #[case::too_large(MemoryKind::Vmm, GRAN, GRAN + 1, "exceeds its buffer")]
    #[case::zero(MemoryKind::Vmm, GRAN, 0, "size is 0")]
    fn a_bad_buffer_on_one_rank_fails_every_rank(
        #[case] kind: MemoryKind,
        #[case] alloc: usize,
        #[case] size: usize,
        #[case] why: &'static str,
    ) {
        let (fabric, gpus) = fakes(2);
        let outcomes = run_ranks(gpus, move |comm, gpu, _| {
            // Rank 1 brings the bad buffer; rank 0 a good one.
            let (kind, alloc, size) = if comm.rank() == 1 {
                (kind, alloc, size)
            } else {
                (MemoryKind::Vmm, GRAN, GRAN)
            };
            let buf = gpu.alloc(alloc, kind).expect("buffer");
            let r = SwitchChannel::with_env(comm, &buf, size, &env(OPEN));
            gpu.free(&buf).expect("free");
            (r.map(|_| ()).map_err(|e| e.to_string()), gpu.calls())
        });
        let (r0, calls0) = &outcomes[0];
        let (r1, _) = &outcomes[1];
        let e1 = r1.as_ref().expect_err("rank 1 refuses its buffer");
        assert!(e1.contains(why), "{e1}");
        let e0 = r0.as_ref().expect_err("rank 0 fails with rank 1");
        assert!(e0.contains("rank 1") && e0.contains(why), "{e0}");
        // Nothing was created: the failure was agreed on in the first step.
        assert!(!calls0.iter().any(|c| c == "create"), "{calls0:?}");
        assert!(fabric.lock().expect("fabric").objects.is_empty());
    }

    #[test]
    fn a_failed_bind_fails_every_rank_and_releases_the_object() {
        let fabric = Arc::new(Mutex::new(Fabric::default()));
        let gpus = (0..2)
            .map(|rank| {
                let mut g = FakeNvlsGpu::new(fabric.clone());
                g.fail_bind = rank == 1;
                Arc::new(g)
            })
            .collect();
        let outcomes = run_ranks(gpus, |comm, gpu, _| {
            let buf = gpu.alloc(GRAN, MemoryKind::Vmm).expect("buffer");
            let r = SwitchChannel::with_env(comm, &buf, GRAN, &env(OPEN));
            gpu.free(&buf).expect("free");
            (r.map(|_| ()).map_err(|e| e.to_string()), gpu.calls())
        });
        let (e0, calls0) = (outcomes[0].0.as_ref().unwrap_err(), &outcomes[0].1);
        let e1 = outcomes[1].0.as_ref().unwrap_err();
        assert!(e1.contains("cuMulticastBindMem"), "{e1}");
        assert!(e0.contains("rank 1") && e0.contains("bind and map"), "{e0}");
        // Rank 0 had bound and mapped: it undoes both before releasing.
        assert_eq!(&calls0[calls0.len() - 3..], ["unmap", "unbind", "free"]);
        assert!(fabric.lock().expect("fabric").objects.is_empty());
    }

    #[test]
    fn unsupported_hardware_on_one_rank_fails_every_rank() {
        let fabric = Arc::new(Mutex::new(Fabric::default()));
        let gpus = (0..2)
            .map(|rank| {
                let mut g = FakeNvlsGpu::new(fabric.clone());
                g.supported = rank == 0;
                Arc::new(g)
            })
            .collect();
        let outcomes = run_ranks(gpus, |comm, gpu, _| {
            let buf = gpu.alloc(GRAN, MemoryKind::Vmm).expect("buffer");
            let r = SwitchChannel::with_env(comm, &buf, GRAN, &env(OPEN));
            gpu.free(&buf).expect("free");
            r.map(|_| ()).map_err(|e| e.to_string())
        });
        assert!(outcomes[1]
            .as_ref()
            .unwrap_err()
            .contains("does not support NVLink multicast"));
        let e0 = outcomes[0].as_ref().unwrap_err();
        assert!(e0.contains("rank 1") && e0.contains("check"), "{e0}");
    }

    #[test]
    fn mismatched_sizes_are_refused_on_every_rank() {
        let (fabric, gpus) = fakes(2);
        let outcomes = run_ranks(gpus, |comm, gpu, _| {
            let buf = gpu.alloc(2 * GRAN, MemoryKind::Vmm).expect("buffer");
            let size = GRAN + comm.rank();
            let r = SwitchChannel::with_env(comm, &buf, size, &env(OPEN));
            gpu.free(&buf).expect("free");
            r.map(|_| ()).map_err(|e| e.to_string())
        });
        for r in outcomes {
            assert!(r.unwrap_err().contains("sizes differ"));
        }
        assert!(fabric.lock().expect("fabric").objects.is_empty());
    }
}
