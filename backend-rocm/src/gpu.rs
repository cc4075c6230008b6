//! [`RocmGpu`]: the `Gpu` trait over the HIP runtime, loaded at run time.
//!
//! Device selection follows HIP's own model: the current device is per thread (`hipSetDevice`), so
//! `set_device`/`current_device` are thin wrappers and every other call acts on the calling
//! thread's device. Waits on the device (stream/event/device synchronisation) are bounded by
//! `MSCCLPP_DEVICE_WAIT_TIMEOUT`: streams and events are polled with `hipStreamQuery` /
//! `hipEventQuery`; `hipDeviceSynchronize`, which has no query form, runs on a helper thread that
//! is abandoned (and reported) if it does not return in time.
//!
//! Not implemented here (reported as `Unsupported`): VMM allocations (`hipMemCreate`) and POSIX-fd
//! memory export; legacy IPC handles cover same-host sharing on ROCm.

use crate::aot;
use crate::hiprtc::{CompileRequest, Hiprtc};
use crate::ipc_cache::{self, IpcCache};
use crate::loader;
use crate::sys::*;
use crate::KernelCache;
use mscclpp_core::env::Env;
use mscclpp_core::gpu::{
    plain_allocation_bytes, Allocation, CaptureMode, DeviceProperties, DevicePtr, Event, Function,
    Gpu, GpuVendor, HostMapped, ImportedMemory, IpcMemHandle, LaunchConfig, MemoryKind, Module,
    Stream,
};
use mscclpp_core::log::target;
use mscclpp_core::{Error, Result};
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

/// Names tried for the HIP runtime (see `loader` for the directories).
pub const HIP_LIB_NAMES: &[&str] = &["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];

/// The HIP backend. Cheap to share: wrap it in an `Arc` and call it from any thread.
pub struct RocmGpu {
    api: HipApi,
    location: String,
    ipc: IpcCache<[u8; HIP_IPC_HANDLE_SIZE]>,
    /// Loaded on the first `build_module`; a load failure is remembered as its message.
    /// hiprtc and the disk cache of what it compiles, loaded on first use.
    kernel_cache: OnceLock<std::result::Result<KernelCache, String>>,
    wait_timeout: Duration,
    // Keeps `api`'s function pointers valid; shared with the device-synchronise helper thread.
    lib: Arc<libloading::Library>,
}

impl std::fmt::Debug for RocmGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocmGpu")
            .field("location", &self.location)
            .field("wait_timeout", &self.wait_timeout)
            .finish()
    }
}

fn as_ptr(p: DevicePtr) -> *mut c_void {
    p as usize as *mut c_void
}

fn device_index(device: usize) -> Result<c_int> {
    c_int::try_from(device)
        .map_err(|_| Error::InvalidArgument(format!("device index {device} is out of range")))
}

/// A NUL-terminated string inside a fixed buffer (without trusting the NUL to be there).
fn fixed_str(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `gfx942:sramecc+:xnack-` -> `gfx942`: the compiler target without feature flags.
pub fn arch_from_gcn_name(gcn: &str) -> String {
    gcn.split(':').next().unwrap_or_default().trim().to_string()
}

impl RocmGpu {
    /// Loads the HIP runtime. Without it: `Error::BackendUnavailable` naming the library and every
    /// place looked in. Device waits are bounded by `MSCCLPP_DEVICE_WAIT_TIMEOUT`.
    pub fn new() -> Result<RocmGpu> {
        let (opened, api) = loader::open_first("the HIP runtime", HIP_LIB_NAMES, HipApi::resolve)?;
        Self::with_api(opened, api)
    }

    /// Loads the HIP runtime from exactly `path` (a build of ROCm outside the search path, or a
    /// test double). A missing file or a library that lacks an entry point we need (ROCm older
    /// than 6) is `Error::BackendUnavailable` naming the path and the symbol.
    pub fn load_from(path: &str) -> Result<RocmGpu> {
        let (opened, api) = loader::open_path("the HIP runtime", path, HipApi::resolve)?;
        Self::with_api(opened, api)
    }

    fn with_api(opened: loader::Opened, api: HipApi) -> Result<RocmGpu> {
        let wait_timeout = Env::get()?.device_wait_timeout;
        Ok(RocmGpu {
            api,
            location: opened.location,
            ipc: IpcCache::new(ipc_cache::system_limit()),
            kernel_cache: OnceLock::new(),
            wait_timeout,
            lib: Arc::new(opened.lib),
        })
    }

    /// Overrides the bound on device waits.
    pub fn with_wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// Where the HIP runtime was found.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// hiprtc and its disk cache (in `MSCCLPP_CACHE_DIR`), loaded and created on first use.
    pub fn kernel_cache(&self) -> Result<&KernelCache> {
        let made = self.kernel_cache.get_or_init(|| {
            let dir = Env::get().map_err(|e| e.to_string())?.cache_dir.clone();
            let hiprtc =
                Hiprtc::load().map_err(|e| format!("run-time compilation needs hiprtc: {e}"))?;
            KernelCache::new(dir, hiprtc).map_err(|e| e.to_string())
        });
        made.as_ref().map_err(|msg| Error::BackendUnavailable {
            backend: "rocm".into(),
            reason: msg.clone(),
        })
    }

    fn check(&self, call: &'static str, code: HipError) -> Result<()> {
        self.api.check(call, code)
    }

    /// Unmaps a peer allocation the IPC cache no longer holds.
    fn close_ipc_mapping(&self, base: u64) -> Result<()> {
        // SAFETY: `base` came from hipIpcOpenMemHandle and no importer uses it any more.
        self.check("hipIpcCloseMemHandle", unsafe {
            (self.api.ipc_close_mem_handle)(as_ptr(base))
        })
    }

    /// How many peer allocations are mapped (in use or kept idle by the IPC cache).
    pub fn open_ipc_mappings(&self) -> usize {
        self.ipc.open_count()
    }

    /// Polls `query` until it stops answering "not ready", within the wait timeout. Spins briefly,
    /// then yields, then sleeps, so a short wait costs little latency and a long one little CPU.
    fn poll(
        &self,
        what: impl Fn() -> String,
        call: &'static str,
        query: impl Fn() -> HipError,
    ) -> Result<()> {
        let start = Instant::now();
        let mut round = 0u32;
        loop {
            match query() {
                HIP_SUCCESS => return Ok(()),
                HIP_ERROR_NOT_READY => {}
                code => return self.check(call, code),
            }
            if start.elapsed() > self.wait_timeout {
                return Err(Error::Timeout {
                    what: what(),
                    timeout: self.wait_timeout,
                });
            }
            round += 1;
            if round < 1000 {
                std::hint::spin_loop();
            } else if round < 2000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

impl Drop for RocmGpu {
    fn drop(&mut self) {
        if let Err(e) = self.ipc.close_idle(|base| self.close_ipc_mapping(base)) {
            tracing::warn!(target: target::GPU, "closing idle IPC mappings: {e}");
        }
    }
}

impl Gpu for RocmGpu {
    fn backend_name(&self) -> &'static str {
        "rocm"
    }

    fn device_count(&self) -> Result<usize> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        match unsafe { (self.api.get_device_count)(&mut n) } {
            HIP_ERROR_NO_DEVICE => Ok(0),
            code => {
                self.check("hipGetDeviceCount", code)?;
                Ok(usize::try_from(n).unwrap_or(0))
            }
        }
    }

    fn set_device(&self, device: usize) -> Result<()> {
        // SAFETY: plain value argument.
        self.check("hipSetDevice", unsafe {
            (self.api.set_device)(device_index(device)?)
        })
    }

    fn current_device(&self) -> Result<usize> {
        let mut d: c_int = 0;
        // SAFETY: valid out-pointer.
        self.check("hipGetDevice", unsafe { (self.api.get_device)(&mut d) })?;
        usize::try_from(d).map_err(|_| Error::Internal(format!("hipGetDevice returned {d}")))
    }

    fn properties(&self, device: usize) -> Result<DeviceProperties> {
        let dev = device_index(device)?;
        // SAFETY: the struct holds only integers, arrays and raw pointers, for which all-zero is
        // a valid value; boxed because it is several KiB.
        let mut buf: Box<HipDevicePropBuffer> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: the buffer is larger than hipDeviceProp_tR0600 (see `HipDevicePropBuffer`).
        self.check("hipGetDevicePropertiesR0600", unsafe {
            (self.api.get_device_properties)(&mut buf.prop, dev)
        })?;
        let p = &buf.prop;
        let mut bus: [c_char; 64] = [0; 64];
        // SAFETY: the buffer length is passed.
        self.check("hipDeviceGetPCIBusId", unsafe {
            (self.api.device_get_pci_bus_id)(bus.as_mut_ptr(), bus.len() as c_int, dev)
        })?;
        let non_negative = |v: c_int| u32::try_from(v).unwrap_or(0);
        Ok(DeviceProperties {
            vendor: GpuVendor::Amd,
            name: fixed_str(&p.name),
            arch: arch_from_gcn_name(&fixed_str(&p.gcn_arch_name)),
            compute_major: non_negative(p.major),
            compute_minor: non_negative(p.minor),
            multiprocessors: non_negative(p.multi_processor_count),
            warp_size: non_negative(p.warp_size),
            total_memory: p.total_global_mem as u64,
            pci_bus_id: fixed_str(&bus).to_ascii_lowercase(),
            supports_vmm: false,
            supports_multicast: false,
            mps_client: false,
        })
    }

    fn alloc(&self, size: usize, kind: MemoryKind) -> Result<Allocation> {
        if size == 0 {
            return Err(Error::InvalidArgument(
                "alloc: size must be greater than 0".into(),
            ));
        }
        if kind == MemoryKind::Vmm {
            return Err(Error::Unsupported(
                "VMM allocations (hipMemCreate/hipMemMap) are not implemented by the ROCm backend; \
                 use MemoryKind::Plain"
                    .into(),
            ));
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        let reserved = plain_allocation_bytes(size);
        // SAFETY: valid out-pointer.
        self.check("hipMalloc", unsafe { (self.api.malloc)(&mut p, reserved) })?;
        let alloc = Allocation {
            ptr: p as usize as u64,
            size,
            reserved,
            kind,
            device: self.current_device()?,
            handle: 0,
        };
        mscclpp_core::gpu::note_device_alloc(&alloc);
        Ok(alloc)
    }

    fn free(&self, alloc: &Allocation) -> Result<()> {
        // SAFETY: the caller passes an allocation made by `alloc` (trait contract).
        self.check("hipFree", unsafe { (self.api.free)(as_ptr(alloc.ptr)) })?;
        mscclpp_core::gpu::note_device_free(alloc);
        Ok(())
    }

    fn alloc_host_mapped(&self, size: usize) -> Result<HostMapped> {
        if size == 0 {
            return Err(Error::InvalidArgument(
                "alloc_host_mapped: size must be greater than 0".into(),
            ));
        }
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.check("hipHostMalloc", unsafe {
            (self.api.host_malloc)(
                &mut host,
                size,
                HIP_HOST_MALLOC_MAPPED | HIP_HOST_MALLOC_COHERENT,
            )
        })?;
        // SAFETY: `host` points at `size` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, size) };
        let mut dev: *mut c_void = std::ptr::null_mut();
        // SAFETY: `host` is mapped pinned memory.
        let rc = unsafe { (self.api.host_get_device_pointer)(&mut dev, host, 0) };
        if let Err(e) = self.check("hipHostGetDevicePointer", rc) {
            // SAFETY: freeing what we just allocated; the original error is the one to report.
            unsafe { (self.api.host_free)(host) };
            return Err(e);
        }
        Ok(HostMapped {
            host_ptr: host.cast(),
            device_ptr: dev as usize as u64,
            size,
        })
    }

    fn free_host_mapped(&self, mem: &HostMapped) -> Result<()> {
        // SAFETY: the caller passes memory from `alloc_host_mapped`.
        self.check("hipHostFree", unsafe {
            (self.api.host_free)(mem.host_ptr.cast())
        })
    }

    fn memcpy_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: device addresses from the caller; HIP validates them and reports errors.
        self.check("hipMemcpyAsync", unsafe {
            (self.api.memcpy_async)(
                as_ptr(dst),
                as_ptr(src),
                bytes,
                HIP_MEMCPY_DEFAULT,
                as_ptr(stream.0),
            )
        })
    }

    fn copy_to_device(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` is a valid host slice for its length.
        self.check("hipMemcpy(HostToDevice)", unsafe {
            (self.api.memcpy)(
                as_ptr(dst),
                src.as_ptr().cast(),
                src.len(),
                HIP_MEMCPY_HOST_TO_DEVICE,
            )
        })
    }

    fn copy_from_device(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is a valid, writable host slice for its length.
        self.check("hipMemcpy(DeviceToHost)", unsafe {
            (self.api.memcpy)(
                dst.as_mut_ptr().cast(),
                as_ptr(src),
                dst.len(),
                HIP_MEMCPY_DEVICE_TO_HOST,
            )
        })
    }

    fn memset_async(&self, dst: DevicePtr, value: u8, bytes: usize, stream: Stream) -> Result<()> {
        // SAFETY: device address from the caller; HIP validates it.
        self.check("hipMemsetAsync", unsafe {
            (self.api.memset_async)(as_ptr(dst), c_int::from(value), bytes, as_ptr(stream.0))
        })
    }

    fn create_stream(&self) -> Result<Stream> {
        let mut s: HipStream = std::ptr::null_mut();
        // Non-blocking: our streams must not serialise with the legacy default stream, which
        // frameworks use for their own work.
        // SAFETY: valid out-pointer.
        self.check("hipStreamCreateWithFlags", unsafe {
            (self.api.stream_create_with_flags)(&mut s, HIP_STREAM_NON_BLOCKING)
        })?;
        Ok(Stream(s as usize as u64))
    }

    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        // SAFETY: a stream from `create_stream`.
        self.check("hipStreamDestroy", unsafe {
            (self.api.stream_destroy)(as_ptr(stream.0))
        })
    }

    fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        self.poll(
            || format!("stream {:#x} to finish (hipStreamQuery)", stream.0),
            "hipStreamQuery",
            // SAFETY: a stream handle from the caller; HIP validates it.
            || unsafe { (self.api.stream_query)(as_ptr(stream.0)) },
        )
    }

    fn synchronize_device(&self) -> Result<()> {
        let device = device_index(self.current_device()?)?;
        let (set_device, synchronize) = (self.api.set_device, self.api.device_synchronize);
        let lib = Arc::clone(&self.lib);
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("mscclpp-hip-sync".into())
            .spawn(move || {
                // Holding `lib` keeps the function pointers valid even if the RocmGpu is dropped
                // while this thread is still blocked.
                let _lib = lib;
                // SAFETY: plain calls on the device the caller was using.
                let rc = unsafe {
                    match set_device(device) {
                        HIP_SUCCESS => synchronize(),
                        code => code,
                    }
                };
                let _ = tx.send(rc);
            })
            .map_err(|e| Error::io("spawning the hipDeviceSynchronize helper thread", e))?;
        match rx.recv_timeout(self.wait_timeout) {
            Ok(rc) => self.check("hipDeviceSynchronize", rc),
            Err(_) => Err(Error::Timeout {
                what: format!("device {device} to finish all work (hipDeviceSynchronize)"),
                timeout: self.wait_timeout,
            }),
        }
    }

    fn create_event(&self) -> Result<Event> {
        let mut e: HipEvent = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.check("hipEventCreate", unsafe { (self.api.event_create)(&mut e) })?;
        Ok(Event(e as usize as u64))
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        // SAFETY: an event from `create_event`.
        self.check("hipEventDestroy", unsafe {
            (self.api.event_destroy)(as_ptr(event.0))
        })
    }

    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        // SAFETY: handles from the caller; HIP validates them.
        self.check("hipEventRecord", unsafe {
            (self.api.event_record)(as_ptr(event.0), as_ptr(stream.0))
        })
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        // SAFETY: handles from the caller; HIP validates them; flags must be 0.
        self.check("hipStreamWaitEvent", unsafe {
            (self.api.stream_wait_event)(as_ptr(stream.0), as_ptr(event.0), 0)
        })
    }

    fn elapsed_ms(&self, start: Event, end: Event) -> Result<f32> {
        self.poll(
            || format!("event {:#x} to complete (hipEventQuery)", end.0),
            "hipEventQuery",
            // SAFETY: an event handle from the caller.
            || unsafe { (self.api.event_query)(as_ptr(end.0)) },
        )?;
        let mut ms = 0f32;
        // SAFETY: valid out-pointer and event handles.
        self.check("hipEventElapsedTime", unsafe {
            (self.api.event_elapsed_time)(&mut ms, as_ptr(start.0), as_ptr(end.0))
        })?;
        Ok(ms)
    }

    fn export_memory(
        &self,
        alloc: &Allocation,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<IpcMemHandle> {
        if alloc.kind != MemoryKind::Plain {
            return Err(Error::Unsupported(
                "the ROCm backend exports only plain (hipMalloc) memory".into(),
            ));
        }
        let inside = match ptr.checked_add(size as u64) {
            Some(end) => ptr >= alloc.ptr && end <= alloc.ptr.saturating_add(alloc.size as u64),
            None => false,
        };
        if !inside {
            return Err(Error::InvalidArgument(format!(
                "export_memory: [{ptr:#x}, +{size}) is not inside the allocation [{:#x}, +{})",
                alloc.ptr, alloc.size
            )));
        }
        let mut handle = HipIpcMemHandle {
            reserved: [0; HIP_IPC_HANDLE_SIZE],
        };
        // The handle names the whole allocation, so it is taken for the base and the offset
        // travels beside it.
        // SAFETY: valid out-pointer; `alloc.ptr` is the base of a hipMalloc allocation.
        self.check("hipIpcGetMemHandle", unsafe {
            (self.api.ipc_get_mem_handle)(&mut handle, as_ptr(alloc.ptr))
        })?;
        Ok(IpcMemHandle::Legacy {
            bytes: handle.reserved.to_vec(),
            offset: ptr - alloc.ptr,
            size: size as u64,
        })
    }

    fn import_memory(&self, handle: &IpcMemHandle, _fd: Option<i32>) -> Result<ImportedMemory> {
        let IpcMemHandle::Legacy {
            bytes,
            offset,
            size,
        } = handle
        else {
            return Err(Error::Unsupported(
                "the ROCm backend imports only legacy IPC handles (not POSIX file descriptors)"
                    .into(),
            ));
        };
        let key: [u8; HIP_IPC_HANDLE_SIZE] = bytes.as_slice().try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "an IPC handle for HIP has {HIP_IPC_HANDLE_SIZE} bytes, this one has {}",
                bytes.len()
            ))
        })?;
        let base = self.ipc.acquire(
            &key,
            || {
                let mut p: *mut c_void = std::ptr::null_mut();
                // SAFETY: valid out-pointer; the handle is passed by value as HIP expects.
                let rc = unsafe {
                    (self.api.ipc_open_mem_handle)(
                        &mut p,
                        HipIpcMemHandle { reserved: key },
                        HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
                    )
                };
                self.check("hipIpcOpenMemHandle", rc)?;
                Ok(p as usize as u64)
            },
            |base| self.close_ipc_mapping(base),
        )?;
        let size = usize::try_from(*size).map_err(|_| {
            Error::InvalidArgument(format!("imported size {size} does not fit in usize"))
        })?;
        Ok(ImportedMemory {
            ptr: base + offset,
            size,
            base,
            handle: 0,
            reserved: 0,
            legacy: true,
        })
    }

    fn close_imported(&self, mem: &ImportedMemory) -> Result<()> {
        // The mapping stays open for reuse until the cache's LRU bound needs its place (see
        // `ipc_cache`), or the backend is dropped.
        self.ipc.release(mem.base)
    }

    fn allocation_of(&self, ptr: DevicePtr) -> Result<Allocation> {
        let mut base: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: valid out-pointers.
        self.check("hipMemGetAddressRange", unsafe {
            (self.api.mem_get_address_range)(&mut base, &mut size, as_ptr(ptr))
        })?;
        Ok(Allocation {
            ptr: base as usize as u64,
            size,
            reserved: size,
            kind: MemoryKind::Plain,
            device: self.current_device()?,
            handle: 0,
        })
    }

    fn enable_peer_access(&self, peer: usize) -> Result<()> {
        // SAFETY: plain value arguments.
        match unsafe { (self.api.device_enable_peer_access)(device_index(peer)?, 0) } {
            HIP_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            code => self.check("hipDeviceEnablePeerAccess", code),
        }
    }

    fn load_module(&self, image: &[u8]) -> Result<Module> {
        if image.is_empty() {
            return Err(Error::InvalidArgument(
                "load_module: the code object is empty".into(),
            ));
        }
        let mut m: HipModule = std::ptr::null_mut();
        // SAFETY: `image` is a complete code object (ELF carries its own size).
        self.check("hipModuleLoadData", unsafe {
            (self.api.module_load_data)(&mut m, image.as_ptr().cast())
        })?;
        Ok(Module(m as usize as u64))
    }

    fn get_function(&self, module: Module, name: &str) -> Result<Function> {
        let cname = CString::new(name).map_err(|_| {
            Error::InvalidArgument(format!("kernel name {name:?} contains a NUL byte"))
        })?;
        let mut f: HipFunction = std::ptr::null_mut();
        // SAFETY: valid out-pointer, module handle from `load_module`, NUL-terminated name.
        let rc =
            unsafe { (self.api.module_get_function)(&mut f, as_ptr(module.0), cname.as_ptr()) };
        self.check("hipModuleGetFunction", rc)
            .map_err(|e| match e {
                Error::Driver {
                    call,
                    code,
                    message,
                } => Error::Driver {
                    call,
                    code,
                    message: format!("{message} (kernel {name})"),
                },
                other => other,
            })?;
        Ok(Function(f as usize as u64))
    }

    unsafe fn launch(
        &self,
        function: Function,
        config: LaunchConfig,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let (g, b) = (config.grid, config.block);
        // SAFETY: the caller guarantees `params` matches the kernel (trait contract).
        let rc = unsafe {
            (self.api.module_launch_kernel)(
                as_ptr(function.0),
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                config.shared_mem_bytes,
                as_ptr(stream.0),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.check("hipModuleLaunchKernel", rc)
    }

    fn build_module(&self, name: &str, source: &str) -> Result<Module> {
        let arch = self.properties(self.current_device()?)?.arch;
        let headers = mscclpp_kernels_hip::all_headers();
        let request = CompileRequest {
            name,
            source,
            arch: &arch,
            headers: &headers,
            options: &[],
        };
        let force = Env::get()?.nvrtc_force;
        if let Some(image) = aot::lookup(aot::embedded(), force, &request) {
            match self.load_module(image) {
                Ok(module) => {
                    tracing::debug!(target: target::GPU, "{name} for {arch}: embedded");
                    return Ok(module);
                }
                // A runtime that refuses the embedded code object (an older ROCm than the code
                // object's version needs) costs a compile, not the call.
                Err(e) => {
                    static ONCE: std::sync::Once = std::sync::Once::new();
                    ONCE.call_once(|| {
                        tracing::warn!(
                            target: target::GPU,
                            "the HIP runtime refused the embedded {name} for {arch}: {e}; hiprtc \
                             compiles such kernels instead"
                        )
                    });
                }
            }
        }
        let built = self.kernel_cache()?.get_or_compile(&request)?;
        tracing::debug!(target: target::GPU, "{name} for {arch}: {:?} in {:?}", built.outcome, built.elapsed);
        if !built.kernel.log.is_empty() {
            tracing::debug!(target: target::GPU, "hiprtc log for {name} ({arch}): {}", built.kernel.log);
        }
        self.load_module(&built.kernel.image)
    }

    fn is_capturing(&self, stream: Stream) -> Result<bool> {
        let mut status: c_int = 0;
        // SAFETY: valid out-pointer and stream handle.
        self.check("hipStreamIsCapturing", unsafe {
            (self.api.stream_is_capturing)(as_ptr(stream.0), &mut status)
        })?;
        // 1 = active, 2 = invalidated: both mean the stream is inside a capture sequence, where
        // host synchronisation is not allowed.
        Ok(status != 0)
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        // hipStreamCaptureMode: 0 global, 1 thread-local, 2 relaxed.
        let mut m: c_int = match mode {
            CaptureMode::Global => 0,
            CaptureMode::ThreadLocal => 1,
            CaptureMode::Relaxed => 2,
        };
        // SAFETY: reads and writes one mode of the calling thread's.
        self.check("hipThreadExchangeStreamCaptureMode", unsafe {
            (self.api.thread_exchange_stream_capture_mode)(&mut m)
        })?;
        match m {
            0 => Ok(CaptureMode::Global),
            1 => Ok(CaptureMode::ThreadLocal),
            2 => Ok(CaptureMode::Relaxed),
            other => Err(Error::Internal(format!(
                "hipThreadExchangeStreamCaptureMode gave back mode {other}, which HIP does not define"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_hip_gives_a_clear_error() {
        match RocmGpu::new() {
            Ok(g) => eprintln!("skipping: HIP is present here ({})", g.location()),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    matches!(e, Error::BackendUnavailable { ref backend, .. } if backend == "rocm"),
                    "{msg}"
                );
                assert!(msg.contains("libamdhip64.so"), "{msg}");
                assert!(msg.contains("/opt/rocm/lib/libamdhip64.so.6"), "{msg}");
                assert!(msg.contains("ROCM_PATH="), "{msg}");
            }
        }
    }

    #[test]
    fn gcn_arch_name_is_stripped_of_features() {
        assert_eq!(arch_from_gcn_name("gfx942:sramecc+:xnack-"), "gfx942");
        assert_eq!(arch_from_gcn_name("gfx90a"), "gfx90a");
        assert_eq!(arch_from_gcn_name(""), "");
    }

    #[test]
    fn fixed_str_stops_at_nul_or_end() {
        let mut buf = [0 as c_char; 8];
        for (i, b) in b"gfx942".iter().enumerate() {
            buf[i] = *b as c_char;
        }
        assert_eq!(fixed_str(&buf), "gfx942");
        let full = [b'a' as c_char; 4];
        assert_eq!(fixed_str(&full), "aaaa");
    }
}
