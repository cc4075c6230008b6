//! [`CudaGpu`]: the [`Gpu`] trait over the CUDA driver API (cudarc's raw `sys` bindings).
//!
//! # Contexts
//! Every device is used through its primary context (the one the CUDA runtime and PyTorch use too),
//! retained once per `CudaGpu` and released on drop. The device a thread works on is a thread-local
//! (0 until [`Gpu::set_device`]). Each call compares the driver's current context with the device's
//! primary context (`cuCtxGetCurrent` is a thread-local read in the driver) and calls
//! `cuCtxSetCurrent` only when they differ, so the hot path costs one cheap call and code that
//! switched the thread's context behind our back (another library) is corrected rather than trusted.
//!
//! # Waits
//! Stream/device/event synchronisation uses the driver's blocking calls. They cannot take a
//! timeout, but they cannot hang forever either: every device-side wait in our kernels is bounded
//! (see docs/device-abi.md, the error word), so kernels always finish.
//!
//! # Memory
//! `Plain` is `cuMemAlloc`, shared through legacy IPC handles. `Vmm` is `cuMemCreate` (POSIX file
//! descriptor handle type, recommended granularity) mapped into a reserved range and made accessible
//! to this device and every device that can reach it peer-to-peer; it is shared as a descriptor that
//! the importer copies with `pidfd_getfd` (see [`crate::ipc`]).

use crate::aot;
use crate::driver::{self, cu};
use crate::graph_launch::{self, GraphLaunches};
use crate::ipc::{fetch_peer_fd, ExportOwner, ExportTable, ImportCache, ImportKey, Mapping};
use crate::nvrtc::{CompileRequest, Nvrtc};
use crate::KernelCache;
use cudarc::driver::sys;
use mscclpp_core::env::Env;
use mscclpp_core::gpu::{
    plain_allocation_bytes, Allocation, CaptureMode, DevicePtr, Event, Function, Graph, HostMapped,
    ImportedMemory, IpcMemHandle, LaunchConfig, MemoryKind, Module, MulticastExport,
    MulticastHandle, Stream,
};
use mscclpp_core::switch_channel::nvls_gate;
use mscclpp_core::{DeviceProperties, Error, Gpu, GpuVendor, Result};
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, OnceLock};

thread_local! {
    /// The device this thread works on (see the module docs).
    static CURRENT_DEVICE: Cell<usize> = const { Cell::new(0) };
}

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// The CUDA implementation of [`Gpu`].
#[derive(Debug)]
pub struct CudaGpu {
    devices: Vec<sys::CUdevice>,
    /// Retained primary contexts (`CUcontext` as an address), filled on first use of each device.
    contexts: Vec<OnceLock<usize>>,
    imports: Mutex<ImportCache>,
    /// Descriptors exported for VMM allocations, by allocation handle, each with its export
    /// number: kept open (peers copy them with pidfd_getfd) until the allocation is freed, and
    /// reused by repeated exports (`crate::ipc`'s docs).
    exported_fds: Mutex<ExportTable>,
    /// NVRTC + on-disk cache, created on the first kernel the embedded ones do not serve (NVRTC is
    /// only needed by callers that compile kernels, so a missing NVRTC must not stop
    /// `CudaGpu::new`, nor a run whose kernels are all embedded).
    kernel_cache: OnceLock<KernelCache>,
    /// `cuDriverGetVersion`, read on the first lookup of an embedded kernel.
    driver_version: OnceLock<aot::Version>,
    /// Per device: whether 64-bit stream memory operations (cuStreamWriteValue64) are available,
    /// read from the device attribute on first use.
    stream_mem_ops_64: Vec<OnceLock<bool>>,
    /// Per device: whether programmatic dependent launch is used (sm_90+, and not switched off
    /// by MSCCLPP_PROGRAMMATIC_LAUNCH=0), decided on first use.
    programmatic_launch: Vec<OnceLock<bool>>,
    /// Whether `LaunchConfig::cached_graph` launches go through `graph_launches` (the
    /// environment allows it and the driver has the entry points), decided on first use.
    eager_graph_launch: OnceLock<bool>,
    graph_launches: GraphLaunches,
    /// Host-mapped allocations made of pages this backend mapped itself and registered with the
    /// driver (host address -> mapped length): see `alloc_host_mapped`.
    registered_host: Mutex<HashMap<usize, usize>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The protected maps stay consistent across a panic in another thread (each update is a single
    // insert/remove), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn cu_stream(s: Stream) -> sys::CUstream {
    s.0 as usize as sys::CUstream
}

/// The driver's `kernelParams` for `params`: null for a kernel without parameters.
pub(crate) fn kernel_params(params: &mut [*mut c_void]) -> *mut *mut c_void {
    if params.is_empty() {
        std::ptr::null_mut()
    } else {
        params.as_mut_ptr()
    }
}

fn cu_event(e: Event) -> sys::CUevent {
    e.0 as usize as sys::CUevent
}

impl CudaGpu {
    /// Loads the driver (a clear [`Error::BackendUnavailable`] when libcuda.so.1 is missing, never a
    /// panic), initialises it and enumerates devices. Zero devices is not an error.
    pub fn new() -> Result<CudaGpu> {
        driver::probe_libcuda()?;
        // SAFETY: cuInit has no preconditions.
        let r = unsafe { sys::cuInit(0) };
        let count = match r {
            sys::CUresult::CUDA_SUCCESS => {
                let mut n: c_int = 0;
                // SAFETY: writes one int.
                unsafe { cu!(cuDeviceGetCount(&mut n)) }?;
                usize::try_from(n).unwrap_or(0)
            }
            sys::CUresult::CUDA_ERROR_NO_DEVICE => 0,
            other => driver::check("cuInit", other).map(|_| 0)?,
        };
        let mut devices = Vec::with_capacity(count);
        for ordinal in 0..count {
            let mut dev: sys::CUdevice = 0;
            // SAFETY: writes one CUdevice; ordinal < count.
            unsafe { cu!(cuDeviceGet(&mut dev, ordinal as c_int)) }?;
            devices.push(dev);
        }
        tracing::debug!("CUDA driver initialised with {count} device(s)");
        Ok(CudaGpu {
            contexts: (0..count).map(|_| OnceLock::new()).collect(),
            devices,
            imports: Mutex::new(ImportCache::default()),
            exported_fds: Mutex::new(ExportTable::default()),
            kernel_cache: OnceLock::new(),
            driver_version: OnceLock::new(),
            stream_mem_ops_64: (0..count).map(|_| OnceLock::new()).collect(),
            programmatic_launch: (0..count).map(|_| OnceLock::new()).collect(),
            eager_graph_launch: OnceLock::new(),
            graph_launches: GraphLaunches::new(count),
            registered_host: Mutex::new(HashMap::new()),
        })
    }

    fn device(&self, ordinal: usize) -> Result<sys::CUdevice> {
        self.devices.get(ordinal).copied().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "CUDA device {ordinal} does not exist ({} visible)",
                self.devices.len()
            ))
        })
    }

    /// The retained primary context of `ordinal`.
    fn context(&self, ordinal: usize) -> Result<sys::CUcontext> {
        let dev = self.device(ordinal)?;
        let cell = &self.contexts[ordinal];
        if let Some(&ctx) = cell.get() {
            return Ok(ctx as sys::CUcontext);
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one CUcontext.
        unsafe { cu!(cuDevicePrimaryCtxRetain(&mut ctx, dev)) }?;
        if cell.set(ctx as usize).is_err() {
            // Another thread retained it first; drop our extra reference.
            // SAFETY: balances the retain above.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) };
        }
        Ok(ctx)
    }

    /// Makes the thread's device context current if it is not; returns the device ordinal.
    fn bind(&self) -> Result<usize> {
        // Once the process is exiting the driver is about to tear its contexts down, and a call
        // racing that teardown can crash the calling thread (`mscclpp_core::process`): every call
        // that binds is refused, so what is left is left to the process's end.
        if mscclpp_core::process::exiting() {
            return Err(Error::Driver {
                call: "cuCtxSetCurrent",
                code: sys::cudaError_enum::CUDA_ERROR_DEINITIALIZED as i64,
                message: "not called: the process is exiting and the CUDA driver is shutting down"
                    .into(),
            });
        }
        let ordinal = CURRENT_DEVICE.get();
        let want = self.context(ordinal)?;
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one CUcontext.
        unsafe { cu!(cuCtxGetCurrent(&mut cur)) }?;
        if cur != want {
            // SAFETY: `want` is a retained primary context.
            unsafe { cu!(cuCtxSetCurrent(want)) }?;
        }
        Ok(ordinal)
    }

    /// `size` bytes (rounded up to pages) of zeroed anonymous memory mapped here and registered
    /// with the driver as device-mapped, portable pinned memory (see `alloc_host_mapped`); `None`
    /// (after undoing its steps) where mapping or registering fails, for `cuMemHostAlloc` then.
    fn alloc_registered(&self, size: usize) -> Option<HostMapped> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|&p| p > 0)
            .unwrap_or(4096);
        let len = size.checked_next_multiple_of(page)?;
        // SAFETY: a fresh private anonymous mapping (zero-filled by the kernel).
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if host == libc::MAP_FAILED {
            return None;
        }
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: `host` is a live mapping of `len` bytes.
        let registered = unsafe { cu!(cuMemHostRegister_v2(host, len, flags)) };
        let was_registered = registered.is_ok();
        let mut dptr: sys::CUdeviceptr = 0;
        let mapped = registered.and_then(|()| {
            // SAFETY: registered with DEVICEMAP.
            unsafe { cu!(cuMemHostGetDevicePointer_v2(&mut dptr, host, 0)) }
        });
        if let Err(e) = mapped {
            tracing::debug!("registering host pages failed ({e}); using cuMemHostAlloc");
            // SAFETY: undoes the steps above that succeeded.
            unsafe {
                if was_registered {
                    let _ = sys::cuMemHostUnregister(host);
                }
                libc::munmap(host, len);
            }
            return None;
        }
        lock(&self.registered_host).insert(host as usize, len);
        Some(HostMapped {
            host_ptr: host.cast(),
            device_ptr: dptr,
            size,
        })
    }

    /// Whether launches that allow it overlap the previous kernel on device `ordinal` (see
    /// `LaunchConfig::programmatic`): compute capability 9.0 or newer, unless the environment
    /// switches it off.
    fn programmatic_launch(&self, ordinal: usize) -> Result<bool> {
        let cell = self.programmatic_launch.get(ordinal).ok_or_else(|| {
            Error::InvalidArgument(format!("CUDA device {ordinal} does not exist"))
        })?;
        if let Some(&on) = cell.get() {
            return Ok(on);
        }
        let dev = self.device(ordinal)?;
        let major = self.attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        )?;
        let wanted = mscclpp_core::env::Env::get()?.programmatic_launch;
        Ok(*cell.get_or_init(|| wanted && major >= 9))
    }

    /// Whether launches that allow it go through cached graphs (see `graph_launch`).
    fn eager_graph_launch(&self) -> Result<bool> {
        if let Some(&on) = self.eager_graph_launch.get() {
            return Ok(on);
        }
        let wanted = mscclpp_core::env::Env::get()?.eager_graph_launch;
        Ok(*self
            .eager_graph_launch
            .get_or_init(|| wanted && graph_launch::supported()))
    }

    /// Whether `stream` is being captured. A stream the driver will not even query (the legacy
    /// stream while another captures) counts as capturing: only the plain launch is tried there.
    fn capturing(stream: Stream) -> bool {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: writes one status.
        let r = unsafe { sys::cuStreamIsCapturing(cu_stream(stream), &mut status) };
        r != sys::CUresult::CUDA_SUCCESS
            || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    }

    fn attribute(&self, dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        unsafe { cu!(cuDeviceGetAttribute(&mut v, attr, dev)) }?;
        Ok(v)
    }

    /// VMM allocations that can be exported as POSIX file descriptors (how peers import them).
    fn supports_vmm(&self, dev: sys::CUdevice) -> Result<bool> {
        use sys::CUdevice_attribute as A;
        Ok(self.attribute(
            dev,
            A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        )? != 0
            && self.attribute(
                dev,
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )? != 0)
    }

    fn vmm_prop(&self, dev: sys::CUdevice) -> Result<sys::CUmemAllocationProp> {
        let rdma = self.attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
        )?;
        // SAFETY: a plain C struct for which all-zero is the documented "unset" value.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = POSIX_FD;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = dev;
        // Lets an IB transport register this memory later (GPUDirect RDMA).
        prop.allocFlags.gpuDirectRDMACapable = u8::from(rdma != 0);
        Ok(prop)
    }

    fn granularity(&self, prop: &sys::CUmemAllocationProp) -> Result<usize> {
        let mut g: usize = 0;
        // SAFETY: reads `prop`, writes one size_t.
        unsafe {
            cu!(cuMemGetAllocationGranularity(
                &mut g,
                prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            ))
        }?;
        if g == 0 {
            return Err(Error::Internal(
                "cuMemGetAllocationGranularity returned 0".into(),
            ));
        }
        Ok(g)
    }

    /// Grants read/write on `[ptr, ptr+size)` to `ordinal` and every device that can reach it P2P.
    fn set_access(&self, ptr: u64, size: usize, ordinal: usize) -> Result<()> {
        let owner = self.device(ordinal)?;
        let mut descs = Vec::with_capacity(self.devices.len());
        for &dev in &self.devices {
            let reachable = dev == owner || {
                let mut can: c_int = 0;
                // SAFETY: writes one int.
                unsafe { cu!(cuDeviceCanAccessPeer(&mut can, dev, owner)) }?;
                can != 0
            };
            if reachable {
                // SAFETY: plain C struct; every field is set below.
                let mut d: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
                d.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                d.location.id = dev;
                d.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                descs.push(d);
            }
        }
        // SAFETY: `descs` is a live array of `descs.len()` descriptors.
        unsafe { cu!(cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())) }
    }

    /// Reserves `reserved` bytes of address space, maps `handle` there and sets access. Undoes its
    /// own steps on failure; the caller still owns `handle`.
    fn map_vmm(&self, handle: u64, reserved: usize, align: usize, ordinal: usize) -> Result<u64> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one address.
        unsafe { cu!(cuMemAddressReserve(&mut ptr, reserved, align, 0, 0)) }?;
        // SAFETY: `ptr` is a fresh reservation of `reserved` bytes.
        if let Err(e) = unsafe { cu!(cuMemMap(ptr, reserved, 0, handle, 0)) } {
            // SAFETY: frees the reservation made above (best effort: the map error is what counts).
            unsafe { sys::cuMemAddressFree(ptr, reserved) };
            return Err(e);
        }
        if let Err(e) = self.set_access(ptr, reserved, ordinal) {
            // SAFETY: undoes the map and reservation above.
            unsafe {
                sys::cuMemUnmap(ptr, reserved);
                sys::cuMemAddressFree(ptr, reserved);
            }
            return Err(e);
        }
        Ok(ptr)
    }

    /// Unmaps, frees the range and releases the handle; all three are attempted, the first error is
    /// returned.
    fn unmap_vmm(&self, ptr: u64, reserved: usize, handle: u64) -> Result<()> {
        // SAFETY: the caller passes a mapping made by `map_vmm` with this handle.
        let results = unsafe {
            [
                cu!(cuMemUnmap(ptr, reserved)),
                cu!(cuMemAddressFree(ptr, reserved)),
                cu!(cuMemRelease(handle)),
            ]
        };
        results.into_iter().collect()
    }

    fn alloc_vmm(&self, size: usize, ordinal: usize) -> Result<Allocation> {
        let prop = self.vmm_prop(self.device(ordinal)?)?;
        let gran = self.granularity(&prop)?;
        let reserved = size.div_ceil(gran).checked_mul(gran).ok_or_else(|| {
            Error::InvalidArgument(format!("allocation size {size} overflows when rounded"))
        })?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: writes one handle; `prop` is fully initialised.
        unsafe { cu!(cuMemCreate(&mut handle, reserved, &prop, 0)) }?;
        let ptr = match self.map_vmm(handle, reserved, gran, ordinal) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: releases the handle created above.
                unsafe { sys::cuMemRelease(handle) };
                return Err(e);
            }
        };
        Ok(Allocation {
            ptr,
            size,
            reserved,
            kind: MemoryKind::Vmm,
            device: ordinal,
            handle,
        })
    }

    /// The POSIX descriptor of a VMM or multicast handle and its export number, exported once and
    /// kept open (peers copy it with pidfd_getfd) until the handle is freed; later exports reuse
    /// it. `owner`: the allocation the handle is for, where it is one (see
    /// [`ExportTable::get_or_export`]).
    fn exported_fd(
        &self,
        handle: sys::CUmemGenericAllocationHandle,
        owner: Option<ExportOwner>,
    ) -> Result<(c_int, u64)> {
        lock(&self.exported_fds).get_or_export(handle, owner, || {
            let mut raw: c_int = -1;
            // SAFETY: for POSIX descriptors the driver writes an int.
            unsafe {
                cu!(cuMemExportToShareableHandle(
                    (&mut raw as *mut c_int).cast(),
                    handle,
                    POSIX_FD,
                    0,
                ))
            }?;
            // SAFETY: the driver handed us a new descriptor.
            Ok(unsafe { OwnedFd::from_raw_fd(raw) })
        })
    }

    /// Describes the allocation containing `ptr`, which may come from elsewhere (e.g. a PyTorch
    /// tensor from `cudaMalloc`), so it can be exported. The result covers the whole allocation
    /// (`ptr` field = its base); it is not ours to free.
    pub fn allocation_of(&self, ptr: DevicePtr) -> Result<Allocation> {
        self.bind()?;
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: writes an address and a size.
        unsafe { cu!(cuMemGetAddressRange_v2(&mut base, &mut size, ptr)) }?;
        let mut ordinal: c_int = 0;
        // SAFETY: the attribute is an int.
        unsafe {
            cu!(cuPointerGetAttribute(
                (&mut ordinal as *mut c_int).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr,
            ))
        }?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: asks whether `base` is VMM-mapped; succeeds only then.
        let r =
            unsafe { sys::cuMemRetainAllocationHandle(&mut handle, base as usize as *mut c_void) };
        let kind = if r == sys::CUresult::CUDA_SUCCESS {
            // The mapping keeps its own reference, so the handle stays valid while the memory is
            // mapped; drop the one retain just added.
            // SAFETY: balances the retain above.
            unsafe { cu!(cuMemRelease(handle)) }?;
            MemoryKind::Vmm
        } else {
            handle = 0;
            MemoryKind::Plain
        };
        Ok(Allocation {
            ptr: base,
            size,
            reserved: size,
            kind,
            device: usize::try_from(ordinal).unwrap_or(0),
            handle,
        })
    }

    /// NVRTC and the disk cache, loaded and created on first use.
    fn kernel_cache(&self) -> Result<&KernelCache> {
        if let Some(cache) = self.kernel_cache.get() {
            return Ok(cache);
        }
        let dir = Env::get()?.cache_dir.clone();
        let nvrtc = Nvrtc::load().inspect_err(|e| {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                tracing::warn!(
                    target: "mscclpp::gpu",
                    "NVRTC cannot be loaded, so no kernel that this build does not embed can run: {e}"
                )
            });
        })?;
        // A racing thread may have set it first; either cache is equivalent.
        let _ = self.kernel_cache.set(KernelCache::new(dir, nvrtc)?);
        self.kernel_cache
            .get()
            .ok_or_else(|| Error::Internal("kernel cache vanished".into()))
    }

    /// The image of `request` this build embeds for the device `props` describes
    /// ([`aot::lookup`]: none under `MSCCLPP_NVRTC_FORCE`, none where the driver is too old).
    fn embedded_image(
        &self,
        request: &CompileRequest,
        props: &DeviceProperties,
    ) -> Result<Option<aot::Found<'static>>> {
        let device = (props.compute_major, props.compute_minor);
        let driver = || {
            *self.driver_version.get_or_init(|| {
                let mut v: c_int = 0;
                // SAFETY: writes one int; callable at any time.
                match unsafe { cu!(cuDriverGetVersion(&mut v)) } {
                    Ok(()) => aot::driver_version(v),
                    // Unknown: taken as too old for anything embedded, so NVRTC compiles.
                    Err(_) => (0, 0),
                }
            })
        };
        let force = Env::get()?.nvrtc_force;
        Ok(aot::lookup(aot::embedded(), force, request, device, driver))
    }

    /// Unloads a module from [`Gpu::load_module`].
    pub fn unload_module(&self, module: Module) -> Result<()> {
        let ordinal = self.bind()?;
        // Cached launch graphs may name the module's functions, and a later module may reuse
        // their addresses: drop them all (unloading is rare).
        self.graph_launches.clear(ordinal, self.context(ordinal)?);
        // SAFETY: the caller passes a module we loaded and no longer uses its functions.
        unsafe { cu!(cuModuleUnload(module.0 as usize as sys::CUmodule)) }
    }

    /// Number of peer imports currently mapped (for tests and diagnostics).
    pub fn imported_mappings(&self) -> usize {
        lock(&self.imports).len()
    }

    fn import_mapping(&self, handle: &IpcMemHandle, fd: Option<i32>) -> Result<Mapping> {
        match handle {
            IpcMemHandle::Legacy { bytes, .. } => {
                // SAFETY: plain C struct of 64 bytes.
                let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
                if bytes.len() != h.reserved.len() {
                    return Err(Error::InvalidArgument(format!(
                        "legacy IPC handle has {} bytes, expected {}",
                        bytes.len(),
                        h.reserved.len()
                    )));
                }
                for (d, s) in h.reserved.iter_mut().zip(bytes) {
                    *d = *s as c_char;
                }
                let mut base: sys::CUdeviceptr = 0;
                // SAFETY: writes one address.
                let r = unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut base,
                        h,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                };
                if r == sys::CUresult::CUDA_ERROR_ALREADY_MAPPED {
                    return Err(Error::InvalidArgument(
                        "cuIpcOpenMemHandle: the peer's buffer shares a driver memory block with \
                         another of its buffers already mapped here (the driver sub-allocates \
                         small cudaMalloc requests); allocate buffers to register in whole 2 MiB \
                         blocks, or use VMM memory"
                            .into(),
                    ));
                }
                driver::check("cuIpcOpenMemHandle_v2", r)?;
                Ok(Mapping {
                    base,
                    handle: 0,
                    reserved: 0,
                    legacy: true,
                })
            }
            IpcMemHandle::PosixFd {
                pid,
                fd: peer_fd,
                reserved,
                ..
            } => {
                let ordinal = CURRENT_DEVICE.get();
                let reserved = usize::try_from(*reserved).map_err(|_| {
                    Error::InvalidArgument(format!("peer buffer size {reserved} is too large"))
                })?;
                // A descriptor we fetched ourselves is closed when `owned` drops (after import the
                // driver holds its own reference); one the caller passed stays the caller's.
                let owned;
                let raw = match fd {
                    Some(f) => f,
                    None => {
                        owned = fetch_peer_fd(*pid, *peer_fd)?;
                        owned.as_raw_fd()
                    }
                };
                let mut h: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: for POSIX descriptors the OS handle is the fd value cast to a pointer.
                unsafe {
                    cu!(cuMemImportFromShareableHandle(
                        &mut h,
                        raw as isize as *mut c_void,
                        POSIX_FD,
                    ))
                }?;
                let prop = self.vmm_prop(self.device(ordinal)?)?;
                let align = self.granularity(&prop)?;
                match self.map_vmm(h, reserved, align, ordinal) {
                    Ok(base) => Ok(Mapping {
                        base,
                        handle: h,
                        reserved,
                        legacy: false,
                    }),
                    Err(e) => {
                        // SAFETY: releases the imported handle.
                        unsafe { sys::cuMemRelease(h) };
                        Err(e)
                    }
                }
            }
        }
    }
}

/// A context release longer than this is logged (see the drop).
const SLOW_CONTEXT_RELEASE: std::time::Duration = std::time::Duration::from_millis(250);

impl Drop for CudaGpu {
    fn drop(&mut self) {
        for (ordinal, (cell, &dev)) in self.contexts.iter().zip(&self.devices).enumerate() {
            if let Some(&ctx) = cell.get() {
                self.graph_launches.clear(ordinal, ctx as sys::CUcontext);
                let start = std::time::Instant::now();
                // SAFETY: balances the retain made in `context`.
                let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) };
                if let Err(e) = driver::check("cuDevicePrimaryCtxRelease", r) {
                    tracing::warn!("releasing the primary context of device {dev}: {e}");
                }
                // The last release destroys the context, which waits for its work: said when it
                // is long, so a slow exit after a failure shows where its time went.
                if start.elapsed() > SLOW_CONTEXT_RELEASE {
                    tracing::warn!(
                        "releasing the primary context of device {dev} took {:.2} s",
                        start.elapsed().as_secs_f64()
                    );
                }
            }
        }
    }
}

impl Gpu for CudaGpu {
    fn backend_name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.devices.len())
    }

    fn set_device(&self, device: usize) -> Result<()> {
        self.device(device)?;
        CURRENT_DEVICE.set(device);
        self.bind().map(|_| ())
    }

    fn current_device(&self) -> Result<usize> {
        Ok(CURRENT_DEVICE.get())
    }

    fn properties(&self, device: usize) -> Result<DeviceProperties> {
        use sys::CUdevice_attribute as A;
        let dev = self.device(device)?;
        let mut name = [0 as c_char; 256];
        // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates.
        unsafe { cu!(cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev)) }?;
        let mut bus = [0 as c_char; 32];
        // SAFETY: as above.
        unsafe {
            cu!(cuDeviceGetPCIBusId(
                bus.as_mut_ptr(),
                bus.len() as c_int,
                dev
            ))
        }?;
        let mut total: usize = 0;
        // SAFETY: writes one size_t.
        unsafe { cu!(cuDeviceTotalMem_v2(&mut total, dev)) }?;
        let text = |buf: &[c_char]| {
            // SAFETY: the driver NUL-terminated the buffer, which we zeroed anyway.
            unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        };
        let attr = |a| self.attribute(dev, a);
        let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let vmm = self.supports_vmm(dev)?;
        let to_u32 = |v: i32| u32::try_from(v).unwrap_or(0);
        Ok(DeviceProperties {
            vendor: GpuVendor::Nvidia,
            name: text(&name),
            arch: format!("sm_{major}{minor}"),
            compute_major: to_u32(major),
            compute_minor: to_u32(minor),
            multiprocessors: to_u32(attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?),
            warp_size: to_u32(attr(A::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?),
            total_memory: total as u64,
            // Lower case, as in /sys/bus/pci/devices, so it compares with other sources.
            pci_bus_id: text(&bus).to_ascii_lowercase(),
            supports_vmm: vmm,
            supports_multicast: attr(A::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)? != 0,
            // A driver older than the attribute refuses it: no MPS it knows of.
            mps_client: attr(A::CU_DEVICE_ATTRIBUTE_MPS_ENABLED).is_ok_and(|v| v != 0),
        })
    }

    /// VMM where the device has it and this process may copy its peers' descriptors
    /// ([`crate::ipc::peer_descriptors_copyable`]): otherwise peers could not import it.
    fn shared_memory_kind(&self, device: usize) -> MemoryKind {
        // Two attributes, not the whole `properties` query: this runs for every shared buffer.
        let vmm = self
            .device(device)
            .and_then(|dev| self.supports_vmm(dev))
            .unwrap_or(false);
        if vmm && crate::ipc::peer_descriptors_copyable() {
            MemoryKind::Vmm
        } else {
            MemoryKind::Plain
        }
    }

    /// CUDA's own answer (CU_DEVICE_ATTRIBUTE_MPS_ENABLED: contexts on the device are shared
    /// through MPS). A driver too old to know the attribute answers no.
    fn is_mps_client(&self, device: usize) -> bool {
        self.device(device)
            .and_then(|dev| {
                self.attribute(
                    dev,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MPS_ENABLED,
                )
            })
            .is_ok_and(|v| v != 0)
    }

    fn alloc(&self, size: usize, kind: MemoryKind) -> Result<Allocation> {
        if size == 0 {
            return Err(Error::InvalidArgument(
                "device allocation of 0 bytes".into(),
            ));
        }
        let ordinal = self.bind()?;
        let alloc = match kind {
            MemoryKind::Plain => {
                let mut ptr: sys::CUdeviceptr = 0;
                let reserved = plain_allocation_bytes(size);
                // SAFETY: writes one address.
                unsafe { cu!(cuMemAlloc_v2(&mut ptr, reserved)) }?;
                Allocation {
                    ptr,
                    size,
                    reserved,
                    kind,
                    device: ordinal,
                    handle: 0,
                }
            }
            MemoryKind::Vmm => self.alloc_vmm(size, ordinal)?,
        };
        mscclpp_core::gpu::note_device_alloc(&alloc);
        Ok(alloc)
    }

    fn free(&self, alloc: &Allocation) -> Result<()> {
        self.bind()?;
        match alloc.kind {
            // SAFETY: the caller passes an allocation made by `alloc` and frees it once.
            MemoryKind::Plain => unsafe { cu!(cuMemFree_v2(alloc.ptr)) },
            MemoryKind::Vmm => {
                // Peers that already imported hold their own references; new imports are over.
                lock(&self.exported_fds).remove(alloc.handle);
                self.unmap_vmm(alloc.ptr, alloc.reserved, alloc.handle)
            }
        }?;
        mscclpp_core::gpu::note_device_free(alloc);
        Ok(())
    }

    fn alloc_host_mapped(&self, size: usize) -> Result<HostMapped> {
        if size == 0 {
            return Err(Error::InvalidArgument(
                "host-mapped allocation of 0 bytes".into(),
            ));
        }
        self.bind()?;
        // Pages mapped here and registered with the driver, rather than `cuMemHostAlloc`'s: host
        // threads read and write this memory (error words polled by `ncclCommGetAsyncError`,
        // FIFO rings polled by the proxy, words a bootstrap reader sets when a peer dies), also
        // while the process exits, when the driver's teardown frees what it allocated; pages it
        // only registered stay mapped, so those accesses stay valid to the process's end.
        if let Some(mem) = self.alloc_registered(size) {
            return Ok(mem);
        }
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: writes one pointer.
        unsafe { cu!(cuMemHostAlloc(&mut host, size, flags)) }?;
        // SAFETY: `host` points at `size` writable pinned bytes.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, size) };
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP.
        if let Err(e) = unsafe { cu!(cuMemHostGetDevicePointer_v2(&mut dptr, host, 0)) } {
            // SAFETY: frees what we just allocated.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        Ok(HostMapped {
            host_ptr: host.cast(),
            device_ptr: dptr,
            size,
        })
    }

    fn free_host_mapped(&self, mem: &HostMapped) -> Result<()> {
        self.bind()?;
        let registered = lock(&self.registered_host).remove(&(mem.host_ptr as usize));
        let Some(len) = registered else {
            // SAFETY: the caller passes memory from `alloc_host_mapped` and frees it once.
            return unsafe { cu!(cuMemFreeHost(mem.host_ptr.cast())) };
        };
        // SAFETY: registered by `alloc_registered`; unregistered once.
        unsafe { cu!(cuMemHostUnregister(mem.host_ptr.cast())) }?;
        // SAFETY: our own mapping of `len` bytes, no longer registered and freed once.
        if unsafe { libc::munmap(mem.host_ptr.cast(), len) } != 0 {
            return Err(Error::io(
                "unmapping host-mapped memory",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    fn memcpy_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        self.bind()?;
        // SAFETY: unified addressing; the caller guarantees both ranges are valid.
        unsafe { cu!(cuMemcpyAsync(dst, src, bytes, cu_stream(stream))) }
    }

    fn copy_to_device(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: `src` is a live slice; the caller guarantees `dst` holds `src.len()` bytes.
        unsafe { cu!(cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())) }?;
        // From pageable memory the call returns once the bytes are staged, before the DMA lands;
        // work on non-blocking streams does not wait for it. Promise "synchronous" for real.
        // SAFETY: the legacy default stream always exists.
        unsafe { cu!(cuStreamSynchronize(std::ptr::null_mut())) }
    }

    fn buffer_id(&self, ptr: DevicePtr) -> Result<u64> {
        self.bind()?;
        let mut id: u64 = 0;
        // SAFETY: the attribute is an unsigned 64-bit integer.
        unsafe {
            cu!(cuPointerGetAttribute(
                (&mut id as *mut u64).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                ptr,
            ))
        }?;
        Ok(id)
    }

    fn copy_from_device(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.bind()?;
        // SAFETY: `dst` is a live slice; the caller guarantees `src` holds `dst.len()` bytes.
        unsafe { cu!(cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())) }
    }

    fn memset_async(&self, dst: DevicePtr, value: u8, bytes: usize, stream: Stream) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees `dst` holds `bytes` bytes.
        unsafe { cu!(cuMemsetD8Async(dst, value, bytes, cu_stream(stream))) }
    }

    fn create_stream(&self) -> Result<Stream> {
        self.bind()?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        // Non-blocking: our streams must not serialise with the legacy default stream other
        // libraries use.
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: writes one stream.
        unsafe { cu!(cuStreamCreate(&mut s, flags)) }?;
        Ok(Stream(s as usize as u64))
    }

    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        if stream == Stream::DEFAULT {
            return Err(Error::InvalidArgument(
                "the default stream cannot be destroyed".into(),
            ));
        }
        self.bind()?;
        // SAFETY: the caller passes a stream from `create_stream`.
        unsafe { cu!(cuStreamDestroy_v2(cu_stream(stream))) }
    }

    fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        self.bind()?;
        // SAFETY: any valid stream, or the default stream.
        unsafe { cu!(cuStreamSynchronize(cu_stream(stream))) }
    }

    fn synchronize_device(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: no arguments.
        unsafe { cu!(cuCtxSynchronize()) }
    }

    fn create_event(&self) -> Result<Event> {
        self.bind()?;
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event.
        unsafe {
            cu!(cuEventCreate(
                &mut e,
                sys::CUevent_flags::CU_EVENT_DEFAULT as u32
            ))
        }?;
        Ok(Event(e as usize as u64))
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller passes an event from `create_event`.
        unsafe { cu!(cuEventDestroy_v2(cu_event(event))) }
    }

    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.bind()?;
        // SAFETY: valid event and stream.
        unsafe { cu!(cuEventRecord(cu_event(event), cu_stream(stream))) }
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.bind()?;
        // SAFETY: valid stream and event; flags must be 0.
        unsafe { cu!(cuStreamWaitEvent(cu_stream(stream), cu_event(event), 0)) }
    }

    fn elapsed_ms(&self, start: Event, end: Event) -> Result<f32> {
        self.bind()?;
        let mut ms: f32 = 0.0;
        // SAFETY: valid events; elapsed time needs `end` complete, so wait for it first.
        unsafe {
            cu!(cuEventSynchronize(cu_event(end)))?;
            cu!(cuEventElapsedTime(&mut ms, cu_event(start), cu_event(end)))?;
        }
        Ok(ms)
    }

    fn query_event(&self, event: Event) -> Result<bool> {
        self.bind()?;
        // SAFETY: the caller passes an event from `create_event`.
        match unsafe { sys::cuEventQuery(cu_event(event)) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => driver::check("cuEventQuery", other).map(|()| false),
        }
    }

    fn stream_write_u64(&self, stream: Stream, addr: DevicePtr, value: u64) -> Result<()> {
        let ordinal = self.bind()?;
        let dev = self.device(ordinal)?;
        let cell = &self.stream_mem_ops_64[ordinal];
        let supported = match cell.get() {
            Some(&s) => s,
            None => {
                // CUDA 12+ drivers always report 1; older drivers needed a module option.
                let v = self.attribute(
                    dev,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                )?;
                *cell.get_or_init(|| v != 0)
            }
        };
        if !supported {
            return Err(Error::Unsupported(format!(
                "CUDA device {ordinal} reports CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 0 \
                 (no cuStreamWriteValue64)"
            )));
        }
        // Default flags: the driver puts a memory barrier before the write, so the value is
        // visible only after everything earlier on the stream (copies included) is.
        let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        // SAFETY: a valid stream of this context; the caller guarantees `addr` is an 8-byte
        // aligned device word this context can write (local or peer-mapped memory).
        unsafe {
            cu!(cuStreamWriteValue64_v2(
                cu_stream(stream),
                addr,
                value,
                flags
            ))
        }
    }

    fn export_memory(
        &self,
        alloc: &Allocation,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<IpcMemHandle> {
        let end = alloc.ptr + alloc.reserved.max(alloc.size) as u64;
        if ptr < alloc.ptr || ptr.checked_add(size as u64).map_or(true, |e| e > end) {
            return Err(Error::InvalidArgument(format!(
                "export of [{ptr:#x}, +{size}) is outside the allocation [{:#x}, {end:#x})",
                alloc.ptr
            )));
        }
        self.bind()?;
        match alloc.kind {
            MemoryKind::Plain => {
                // The handle names the whole cudaMalloc block; the offset locates `ptr` in it.
                let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
                // SAFETY: writes an address and a size.
                unsafe { cu!(cuMemGetAddressRange_v2(&mut base, &mut len, ptr)) }?;
                // SAFETY: plain C struct.
                let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
                // SAFETY: `base` is the start of a cuMemAlloc block.
                unsafe { cu!(cuIpcGetMemHandle(&mut h, base)) }?;
                Ok(IpcMemHandle::Legacy {
                    bytes: h.reserved.iter().map(|&b| b as u8).collect(),
                    offset: ptr - base,
                    size: size as u64,
                })
            }
            MemoryKind::Vmm => {
                let owner = ExportOwner {
                    base: alloc.ptr,
                    buffer_id: self.buffer_id(alloc.ptr)?,
                };
                let (fd, export) = self.exported_fd(alloc.handle, Some(owner))?;
                Ok(IpcMemHandle::PosixFd {
                    pid: std::process::id(),
                    fd,
                    export,
                    size: size as u64,
                    reserved: alloc.reserved as u64,
                    offset: ptr - alloc.ptr,
                })
            }
        }
    }

    fn import_memory(&self, handle: &IpcMemHandle, fd: Option<i32>) -> Result<ImportedMemory> {
        let (offset, size, limit) = match handle {
            IpcMemHandle::Legacy { offset, size, .. } => (*offset, *size, None),
            IpcMemHandle::PosixFd {
                offset,
                size,
                reserved,
                ..
            } => (*offset, *size, Some(*reserved)),
        };
        if let Some(limit) = limit {
            if offset.checked_add(size).map_or(true, |e| e > limit) {
                return Err(Error::InvalidArgument(format!(
                    "peer buffer [offset {offset}, +{size}) exceeds its allocation of {limit} bytes"
                )));
            }
        }
        let size = usize::try_from(size)
            .map_err(|_| Error::InvalidArgument(format!("peer buffer size {size} is too large")))?;
        self.bind()?;
        let key = ImportKey::of(handle);
        // Held across the driver calls so two threads cannot open the same handle at once.
        let mut imports = lock(&self.imports);
        let mapping = match imports.acquire(&key) {
            Some(m) => m,
            None => {
                let m = self.import_mapping(handle, fd)?;
                imports.insert(key, m);
                m
            }
        };
        Ok(ImportedMemory {
            ptr: mapping.base + offset,
            size,
            base: mapping.base,
            handle: mapping.handle,
            reserved: mapping.reserved,
            legacy: mapping.legacy,
        })
    }

    fn close_imported(&self, mem: &ImportedMemory) -> Result<()> {
        self.bind()?;
        let mut imports = lock(&self.imports);
        match imports.release(mem.base)? {
            None => Ok(()),
            // SAFETY: the last user is gone; `base` came from cuIpcOpenMemHandle.
            Some(m) if m.legacy => unsafe { cu!(cuIpcCloseMemHandle(m.base)) },
            Some(m) => self.unmap_vmm(m.base, m.reserved, m.handle),
        }
    }

    fn enable_peer_access(&self, peer: usize) -> Result<()> {
        let ordinal = self.bind()?;
        if peer == ordinal {
            return Ok(());
        }
        let peer_ctx = self.context(peer)?;
        // SAFETY: `peer_ctx` is a retained primary context; flags must be 0.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer_ctx, 0) };
        match r {
            sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            other => driver::check("cuCtxEnablePeerAccess", other),
        }
    }

    fn load_module(&self, image: &[u8]) -> Result<Module> {
        if image.is_empty() {
            return Err(Error::InvalidArgument("empty module image".into()));
        }
        self.bind()?;
        // cuModuleLoadData reads PTX as a C string: make sure text images end in NUL. Binary
        // images (ELF cubin, fatbin) carry their own length.
        let is_binary =
            image.starts_with(b"\x7fELF") || image.starts_with(&0xBA55_ED50u32.to_le_bytes());
        let owned;
        let data = if !is_binary && image.last() != Some(&0) {
            owned = [image, &[0]].concat();
            &owned[..]
        } else {
            image
        };
        let mut m: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `data` is a complete image that outlives the call.
        unsafe { cu!(cuModuleLoadData(&mut m, data.as_ptr().cast())) }?;
        Ok(Module(m as usize as u64))
    }

    fn get_function(&self, module: Module, name: &str) -> Result<Function> {
        let cname = CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("kernel name {name:?} contains NUL")))?;
        self.bind()?;
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: valid module and NUL-terminated name.
        let r = unsafe {
            sys::cuModuleGetFunction(&mut f, module.0 as usize as sys::CUmodule, cname.as_ptr())
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(Error::Driver {
                call: "cuModuleGetFunction",
                code: r as i64,
                message: format!("{} (kernel {name:?})", driver::error_message(r)),
            });
        }
        load_now(f, name)?;
        reserve_local_memory(f, name)?;
        Ok(Function(f as usize as u64))
    }

    unsafe fn launch(
        &self,
        function: Function,
        config: LaunchConfig,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let ordinal = self.bind()?;
        if config.cached_graph && self.eager_graph_launch()? && !Self::capturing(stream) {
            // SAFETY: the caller's guarantees, passed on.
            let launched = unsafe {
                self.graph_launches
                    .launch(ordinal, function, &config, stream, params)
            }?;
            if launched {
                return Ok(());
            }
        }
        let (g, b) = (config.grid, config.block);
        let params_ptr = kernel_params(params);
        if config.programmatic && self.programmatic_launch(ordinal)? {
            // SAFETY: a plain C union; all-zero is a valid value of every member.
            let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
            value.programmaticStreamSerializationAllowed = 1;
            let mut attr = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value,
            };
            let cfg = sys::CUlaunchConfig {
                gridDimX: g.0,
                gridDimY: g.1,
                gridDimZ: g.2,
                blockDimX: b.0,
                blockDimY: b.1,
                blockDimZ: b.2,
                sharedMemBytes: config.shared_mem_bytes,
                hStream: cu_stream(stream),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: `cfg` and `attr` live across the call; the caller guarantees `params`
            // matches the kernel and that the kernel waits for the prior grid (trait docs).
            return unsafe {
                cu!(cuLaunchKernelEx(
                    &cfg,
                    function.0 as usize as sys::CUfunction,
                    params_ptr,
                    std::ptr::null_mut(),
                ))
            };
        }
        // SAFETY: the caller guarantees `params` matches the kernel (see the trait docs).
        unsafe {
            cu!(cuLaunchKernel(
                function.0 as usize as sys::CUfunction,
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                config.shared_mem_bytes,
                cu_stream(stream),
                params_ptr,
                std::ptr::null_mut(),
            ))
        }
    }

    fn allocation_of(&self, ptr: DevicePtr) -> Result<Allocation> {
        CudaGpu::allocation_of(self, ptr)
    }

    /// The embedded image of `request` first (`crate::aot`), else NVRTC through the disk cache;
    /// NVRTC is loaded only then, so a machine without it runs everything that is embedded.
    fn build_module(&self, name: &str, source: &str) -> Result<Module> {
        let props = self.properties(CURRENT_DEVICE.get())?;
        let request = CompileRequest {
            name,
            source,
            arch: &props.arch,
            headers: mscclpp_kernels_cu::HEADERS,
            options: &[],
        };
        if let Some(found) = self.embedded_image(&request, &props)? {
            match self.load_module(found.image) {
                Ok(module) => {
                    tracing::debug!(target: "mscclpp::gpu", "{name} for {}: embedded ({})", props.arch, found.arch);
                    return Ok(module);
                }
                // A driver that refuses what `aot::find` judged loadable (a rule of CUDA's
                // compatibility we got wrong) costs a compile, not the call.
                Err(e) => {
                    static ONCE: std::sync::Once = std::sync::Once::new();
                    ONCE.call_once(|| {
                        tracing::warn!(
                            target: "mscclpp::gpu",
                            "the driver refused the embedded {name} ({}): {e}; NVRTC compiles \
                             such kernels instead",
                            found.arch
                        )
                    });
                }
            }
        }
        let built = self.kernel_cache()?.get_or_compile(&request)?;
        tracing::debug!(target: "mscclpp::gpu", "{name} for {}: {:?} in {:?}", props.arch, built.outcome, built.elapsed);
        self.load_module(&built.kernel.image)
    }

    fn begin_capture(&self, stream: Stream) -> Result<()> {
        self.bind()?;
        // SAFETY: a valid stream handle of this context.
        unsafe {
            cu!(cuStreamBeginCapture_v2(
                cu_stream(stream),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED
            ))
        }
    }

    fn end_capture(&self, stream: Stream) -> Result<Graph> {
        self.bind()?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: writes one graph handle.
        unsafe { cu!(cuStreamEndCapture(cu_stream(stream), &mut graph)) }?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` was just captured; writes one executable graph handle.
        if let Err(e) = unsafe { cu!(cuGraphInstantiateWithFlags(&mut exec, graph, 0)) } {
            // SAFETY: the graph is ours and not used again.
            let _ = unsafe { cu!(cuGraphDestroy(graph)) };
            return Err(e);
        }
        Ok(Graph {
            exec: exec as usize as u64,
            graph: graph as usize as u64,
        })
    }

    fn launch_graph(&self, graph: Graph, stream: Stream) -> Result<()> {
        self.bind()?;
        // SAFETY: an instantiated graph of this context.
        unsafe {
            cu!(cuGraphLaunch(
                graph.exec as usize as sys::CUgraphExec,
                cu_stream(stream)
            ))
        }
    }

    fn destroy_graph(&self, graph: Graph) -> Result<()> {
        self.bind()?;
        // SAFETY: both handles come from end_capture and are destroyed once.
        unsafe { cu!(cuGraphExecDestroy(graph.exec as usize as sys::CUgraphExec)) }?;
        unsafe { cu!(cuGraphDestroy(graph.graph as usize as sys::CUgraph)) }
    }

    fn is_capturing(&self, stream: Stream) -> Result<bool> {
        self.bind()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: writes one status.
        unsafe { cu!(cuStreamIsCapturing(cu_stream(stream), &mut status)) }?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        use sys::CUstreamCaptureMode::*;
        let mut m = match mode {
            CaptureMode::Global => CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: reads and writes one mode of the calling thread's (no context needed).
        unsafe { cu!(cuThreadExchangeStreamCaptureMode(&mut m)) }?;
        Ok(match m {
            CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
        })
    }

    // NVLink multicast: the implementations are in the NVLS section below, each gated first.
    fn is_nvls_supported(&self, device: usize) -> Result<bool> {
        self.nvls_supported(device)
    }
    fn create_multicast(&self, size: usize, num_devices: usize) -> Result<MulticastHandle> {
        self.mc_create(size, num_devices)
    }
    fn multicast_add_device(&self, handle: &MulticastHandle, device: usize) -> Result<()> {
        self.mc_add_device(handle, device)
    }
    fn multicast_bind_memory(
        &self,
        handle: &MulticastHandle,
        alloc: &Allocation,
        offset: usize,
        size: usize,
    ) -> Result<()> {
        self.mc_bind_memory(handle, alloc, offset, size)
    }
    fn multicast_unbind(&self, handle: &MulticastHandle, device: usize, size: usize) -> Result<()> {
        self.mc_unbind(handle, device, size)
    }
    fn map_multicast(&self, handle: &MulticastHandle) -> Result<DevicePtr> {
        self.mc_map(handle)
    }
    fn unmap_multicast(&self, handle: &MulticastHandle, ptr: DevicePtr) -> Result<()> {
        self.mc_unmap(handle, ptr)
    }
    fn export_multicast(&self, handle: &MulticastHandle) -> Result<MulticastExport> {
        self.mc_export(handle)
    }
    fn import_multicast(
        &self,
        export: &MulticastExport,
        fd: Option<i32>,
    ) -> Result<MulticastHandle> {
        self.mc_import(export, fd)
    }
    fn free_multicast(&self, handle: &MulticastHandle) -> Result<()> {
        self.mc_free(handle)
    }
}

// ---------------------------------------------------------------------------------------------
// NVLink multicast (NVLS), behind the safety gate
// ---------------------------------------------------------------------------------------------
//
// DESIGN.md, "Safety on shared GPUs": multicast can take a shared host's GPUs out of service, so
// every method here calls `require_nvls_gate` before anything else, and in particular before any
// `cuMulticast*` symbol is resolved (cudarc resolves a symbol on its first call). While the gate
// is closed the driver's multicast API is never touched: `is_nvls_supported` answers false and
// every other method `Error::Unsupported`.

/// The multicast entry points we call. Drivers older than CUDA 12.1 lack them, and cudarc panics
/// on a missing symbol, so their presence is checked (after the gate) before the first call.
const MULTICAST_SYMBOLS: &[&str] = &[
    "cuMulticastCreate",
    "cuMulticastGetGranularity",
    "cuMulticastAddDevice",
    "cuMulticastBindMem",
    "cuMulticastUnbind",
];

/// `Ok` only when the process environment allows NVLS (`Env::nvls_allowed`); otherwise the
/// gate's `Unsupported` error (or the environment's own error when it does not parse).
fn require_nvls_gate() -> Result<()> {
    nvls_gate(Env::get()?)
}

/// Whether libcuda exports every symbol of [`MULTICAST_SYMBOLS`]; checked once per process.
fn multicast_symbols_present() -> Result<()> {
    static PRESENT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PRESENT
        .get_or_init(|| {
            let missing = driver::missing_symbols(MULTICAST_SYMBOLS)?;
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "the CUDA driver lacks {} (NVLink multicast needs a CUDA 12.1+ driver)",
                    missing.join(", ")
                ))
            }
        })
        .clone()
        .map_err(Error::Unsupported)
}

/// Finishes loading `f` now instead of at its first launch. Under CUDA's lazy module loading (the
/// default since CUDA 12.2) the first launch of a kernel loads it, and loading may wait for every
/// kernel running in the context. Where ranks share a context (one process driving several ranks
/// of one GPU, as `ncclCommInitAll` on one device does), one rank's kernel already waits for its
/// peers while a peer's first launch would wait for it: a deadlock until the device wait timeout.
/// Loaded here, outside any launch, a launch never loads. Drivers before 12.4 lack `cuFuncLoad`;
/// there nothing is done (their lazy loading stays the user's choice: CUDA_MODULE_LOADING=EAGER).
fn load_now(f: sys::CUfunction, name: &str) -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    let present = *PRESENT
        .get_or_init(|| driver::missing_symbols(&["cuFuncLoad"]).is_ok_and(|m| m.is_empty()));
    if !present {
        return Ok(());
    }
    // SAFETY: `f` is a function just returned by cuModuleGetFunction; loading a loaded one is a no-op.
    let r = unsafe { sys::cuFuncLoad(f) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Driver {
            call: "cuFuncLoad",
            code: r as i64,
            message: format!("{} (kernel {name:?})", driver::error_message(r)),
        });
    }
    Ok(())
}

/// Raises the context's per-thread stack limit to what `f` uses, as NCCL does. A launch that needs
/// more local memory than the context reserved first grows the reservation, which waits for every
/// kernel running in the context: where ranks share a context, for a peer's kernel that waits for
/// this launch. Done here, when the kernel is loaded and none of ours waits, a launch never grows
/// it. The limit only rises (one lock for the process, so two loads cannot lower it).
fn reserve_local_memory(f: sys::CUfunction, name: &str) -> Result<()> {
    static RAISING: Mutex<()> = Mutex::new(());
    let mut local: std::ffi::c_int = 0;
    let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES;
    // SAFETY: `f` is a loaded function; writes one int.
    driver::check("cuFuncGetAttribute", unsafe {
        sys::cuFuncGetAttribute(&mut local, attr, f)
    })
    .map_err(|e| Error::Internal(format!("kernel {name:?}: {e}")))?;
    let Ok(needed) = usize::try_from(local) else {
        return Ok(());
    };
    if needed == 0 {
        return Ok(());
    }
    let _raising = lock(&RAISING);
    let mut current: usize = 0;
    let limit = sys::CUlimit::CU_LIMIT_STACK_SIZE;
    // SAFETY: writes one size_t for the current context.
    driver::check("cuCtxGetLimit", unsafe {
        sys::cuCtxGetLimit(&mut current, limit)
    })?;
    if needed > current {
        // SAFETY: sets a limit of the current context (bound by the caller).
        driver::check("cuCtxSetLimit", unsafe {
            sys::cuCtxSetLimit(limit, needed)
        })?;
    }
    Ok(())
}

/// The gate, then the symbols: what every multicast driver call needs first.
fn require_multicast_api() -> Result<()> {
    require_nvls_gate()?;
    multicast_symbols_present()
}

fn multiple_of(value: usize, unit: usize) -> bool {
    unit != 0 && value % unit == 0
}

impl CudaGpu {
    fn nvls_supported(&self, device: usize) -> Result<bool> {
        if require_nvls_gate().is_err() {
            // A closed gate (or an unparsable environment, which `Env::get` reports to every
            // other caller) means "no" here, never a driver query.
            return Ok(false);
        }
        if let Err(e) = multicast_symbols_present() {
            tracing::info!(target: "mscclpp::gpu", "NVLS unavailable: {e}");
            return Ok(false);
        }
        let dev = self.device(device)?;
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED;
        Ok(self.attribute(dev, attr)? != 0)
    }

    fn mc_create(&self, size: usize, num_devices: usize) -> Result<MulticastHandle> {
        require_multicast_api()?;
        if size == 0 {
            return Err(Error::InvalidArgument("multicast object of 0 bytes".into()));
        }
        let devices = u32::try_from(num_devices)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "multicast object for {num_devices} devices (must be 1..=u32::MAX)"
                ))
            })?;
        self.bind()?;
        // SAFETY: a plain C struct; every field is set below.
        let mut prop: sys::CUmulticastObjectProp = unsafe { std::mem::zeroed() };
        prop.numDevices = devices;
        prop.size = size;
        prop.handleTypes = u64::from(POSIX_FD.0);
        prop.flags = 0;
        let mut gran: usize = 0;
        // SAFETY: reads `prop`, writes one size_t. The minimum granularity is what binds must be
        // multiples of; VMM buffers are rounded to the (equal or larger) VMM granularity already.
        unsafe {
            cu!(cuMulticastGetGranularity(
                &mut gran,
                &prop,
                sys::CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_MINIMUM,
            ))
        }?;
        if gran == 0 {
            return Err(Error::Internal(
                "cuMulticastGetGranularity returned 0".into(),
            ));
        }
        let reserved = size.div_ceil(gran).checked_mul(gran).ok_or_else(|| {
            Error::InvalidArgument(format!("multicast size {size} overflows when rounded"))
        })?;
        prop.size = reserved;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: writes one handle; `prop` is fully initialised.
        unsafe { cu!(cuMulticastCreate(&mut handle, &prop)) }?;
        Ok(MulticastHandle {
            handle,
            size,
            reserved,
            granularity: gran,
            num_devices,
        })
    }

    fn mc_add_device(&self, handle: &MulticastHandle, device: usize) -> Result<()> {
        require_multicast_api()?;
        let dev = self.device(device)?;
        self.bind()?;
        // SAFETY: a live multicast handle and a valid device.
        unsafe { cu!(cuMulticastAddDevice(handle.handle, dev)) }
    }

    fn mc_bind_memory(
        &self,
        handle: &MulticastHandle,
        alloc: &Allocation,
        offset: usize,
        size: usize,
    ) -> Result<()> {
        require_multicast_api()?;
        if alloc.kind != MemoryKind::Vmm {
            return Err(Error::InvalidArgument(format!(
                "multicast bind of {:?} memory at {:#x}: only VMM allocations can be bound",
                alloc.kind, alloc.ptr
            )));
        }
        let g = handle.granularity;
        if !multiple_of(offset, g) || !multiple_of(size, g) || size == 0 {
            return Err(Error::InvalidArgument(format!(
                "multicast bind of [offset {offset}, +{size}): both must be non-zero multiples \
                 (offset may be 0) of the multicast granularity {g}"
            )));
        }
        if offset
            .checked_add(size)
            .map_or(true, |end| end > alloc.reserved)
            || size > handle.reserved
        {
            return Err(Error::InvalidArgument(format!(
                "multicast bind of [offset {offset}, +{size}) exceeds the allocation ({} bytes) or \
                 the multicast object ({} bytes)",
                alloc.reserved, handle.reserved
            )));
        }
        self.bind()?;
        // SAFETY: live handles; ranges checked above.
        unsafe {
            cu!(cuMulticastBindMem(
                handle.handle,
                0,
                alloc.handle,
                offset,
                size,
                0
            ))
        }
    }

    fn mc_unbind(&self, handle: &MulticastHandle, device: usize, size: usize) -> Result<()> {
        require_multicast_api()?;
        let dev = self.device(device)?;
        self.bind()?;
        // SAFETY: a live multicast handle; unbinding what this device bound at offset 0.
        unsafe { cu!(cuMulticastUnbind(handle.handle, dev, 0, size)) }
    }

    /// Reserves address space, maps the object there and grants the current device access. Unlike
    /// `map_vmm` it grants no peers: a multicast mapping is per device (each rank maps its own).
    fn mc_map(&self, handle: &MulticastHandle) -> Result<DevicePtr> {
        require_multicast_api()?;
        let ordinal = self.bind()?;
        let dev = self.device(ordinal)?;
        let (size, align) = (handle.reserved, handle.granularity);
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one address.
        unsafe { cu!(cuMemAddressReserve(&mut ptr, size, align, 0, 0)) }?;
        // SAFETY: `ptr` is a fresh reservation of `size` bytes.
        if let Err(e) = unsafe { cu!(cuMemMap(ptr, size, 0, handle.handle, 0)) } {
            // SAFETY: frees the reservation above (best effort: the map error is what counts).
            unsafe { sys::cuMemAddressFree(ptr, size) };
            return Err(e);
        }
        // SAFETY: plain C struct; every field is set below.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = dev;
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: one descriptor for the range mapped above.
        if let Err(e) = unsafe { cu!(cuMemSetAccess(ptr, size, &desc, 1)) } {
            // SAFETY: undoes the map and reservation above.
            unsafe {
                sys::cuMemUnmap(ptr, size);
                sys::cuMemAddressFree(ptr, size);
            }
            return Err(e);
        }
        Ok(ptr)
    }

    fn mc_unmap(&self, handle: &MulticastHandle, ptr: DevicePtr) -> Result<()> {
        require_multicast_api()?;
        self.bind()?;
        // SAFETY: a mapping made by `mc_map` for this handle; both steps are attempted.
        let results = unsafe {
            [
                cu!(cuMemUnmap(ptr, handle.reserved)),
                cu!(cuMemAddressFree(ptr, handle.reserved)),
            ]
        };
        results.into_iter().collect()
    }

    fn mc_export(&self, handle: &MulticastHandle) -> Result<MulticastExport> {
        require_multicast_api()?;
        self.bind()?;
        // Multicast and allocation handles share one namespace (CUmemGenericAllocationHandle),
        // so the descriptors of both live in `exported_fds` until the object is freed.
        let (fd, _) = self.exported_fd(handle.handle, None)?;
        Ok(MulticastExport {
            pid: std::process::id(),
            fd,
            size: handle.size as u64,
            reserved: handle.reserved as u64,
            granularity: handle.granularity as u64,
            num_devices: u32::try_from(handle.num_devices)
                .map_err(|_| Error::InvalidArgument(format!("{} devices", handle.num_devices)))?,
        })
    }

    fn mc_import(&self, export: &MulticastExport, fd: Option<i32>) -> Result<MulticastHandle> {
        require_multicast_api()?;
        let field = |name: &str, v: u64| {
            usize::try_from(v).map_err(|_| {
                Error::InvalidArgument(format!("multicast export field {name} = {v} is too large"))
            })
        };
        let size = field("size", export.size)?;
        let reserved = field("reserved", export.reserved)?;
        let granularity = field("granularity", export.granularity)?;
        if size == 0 || size > reserved || !multiple_of(reserved, granularity) {
            return Err(Error::InvalidArgument(format!(
                "multicast export from pid {} is inconsistent: size {size}, reserved {reserved}, \
                 granularity {granularity}",
                export.pid
            )));
        }
        self.bind()?;
        // A descriptor we fetched is closed when `owned` drops (the driver keeps its own
        // reference after the import); one the caller passed stays the caller's.
        let owned;
        let raw = match fd {
            Some(f) => f,
            None => {
                owned = fetch_peer_fd(export.pid, export.fd)?;
                owned.as_raw_fd()
            }
        };
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX descriptors the OS handle is the fd value cast to a pointer.
        unsafe {
            cu!(cuMemImportFromShareableHandle(
                &mut handle,
                raw as isize as *mut c_void,
                POSIX_FD,
            ))
        }?;
        Ok(MulticastHandle {
            handle,
            size,
            reserved,
            granularity,
            num_devices: export.num_devices as usize,
        })
    }

    fn mc_free(&self, handle: &MulticastHandle) -> Result<()> {
        require_multicast_api()?;
        // Importers hold their own references; new imports of this object are over.
        lock(&self.exported_fds).remove(handle.handle);
        self.bind()?;
        // SAFETY: this process's reference to the object, released once.
        unsafe { cu!(cuMemRelease(handle.handle)) }
    }
}

#[cfg(test)]
mod nvls_tests {
    use super::*;
    use rstest::rstest;

    /// A `CudaGpu` with no devices, built without touching the driver: enough to call the NVLS
    /// methods, which must return before any driver call while the gate is closed. (Were one to
    /// reach cudarc on this machine without libcuda, cudarc would panic and fail the test.)
    fn driverless() -> CudaGpu {
        CudaGpu {
            devices: Vec::new(),
            contexts: Vec::new(),
            imports: Mutex::new(ImportCache::default()),
            exported_fds: Mutex::new(ExportTable::default()),
            kernel_cache: OnceLock::new(),
            driver_version: OnceLock::new(),
            stream_mem_ops_64: Vec::new(),
            programmatic_launch: Vec::new(),
            eager_graph_launch: OnceLock::new(),
            graph_launches: GraphLaunches::new(0),
            registered_host: Mutex::new(HashMap::new()),
        }
    }

    /// The tests need the process gate closed; they never open it. Skips (with the reason) if
    /// whoever runs them opened it.
    fn gate_closed_or_skip(test: &str) -> bool {
        match Env::get() {
            Ok(env) if env.nvls_allowed() => {
                eprintln!("{test}: skipped: MSCCLPP_ENABLE_NVLS=1 is set in this environment");
                false
            }
            Ok(_) => true,
            Err(e) => {
                eprintln!("{test}: skipped: the environment does not parse: {e}");
                false
            }
        }
    }

    fn assert_gate_error(what: &str, r: Result<impl std::fmt::Debug>) {
        match r {
            Err(Error::Unsupported(m)) => {
                assert!(
                    m.starts_with("NVLS is disabled: set MSCCLPP_ENABLE_NVLS=1"),
                    "{what}: {m}"
                )
            }
            other => panic!("{what}: expected the NVLS gate's Unsupported error, got {other:?}"),
        }
    }

    #[test]
    fn the_gate_refuses_in_this_process() {
        if !gate_closed_or_skip("the_gate_refuses_in_this_process") {
            return;
        }
        assert_gate_error("require_nvls_gate", require_nvls_gate());
        assert_gate_error("require_multicast_api", require_multicast_api());
    }

    #[rstest]
    #[case::device_0(0)]
    #[case::absent_device(7)]
    fn is_nvls_supported_is_false_without_a_driver_call(#[case] device: usize) {
        if !gate_closed_or_skip("is_nvls_supported_is_false_without_a_driver_call") {
            return;
        }
        // Device 7 does not exist: answering at all (rather than "no such device") shows the
        // gate is checked before the device is even looked up.
        assert!(!driverless().is_nvls_supported(device).expect("an answer"));
    }

    #[test]
    fn every_multicast_method_refuses_while_the_gate_is_closed() {
        if !gate_closed_or_skip("every_multicast_method_refuses_while_the_gate_is_closed") {
            return;
        }
        let gpu = driverless();
        let mc = MulticastHandle {
            handle: 0xdead,
            size: 1 << 21,
            reserved: 1 << 21,
            granularity: 1 << 21,
            num_devices: 2,
        };
        let alloc = Allocation {
            ptr: 0x7000_0000,
            size: 1 << 21,
            reserved: 1 << 21,
            kind: MemoryKind::Vmm,
            device: 0,
            handle: 0xbeef,
        };
        let export = MulticastExport {
            pid: std::process::id(),
            fd: 0,
            size: 1 << 21,
            reserved: 1 << 21,
            granularity: 1 << 21,
            num_devices: 2,
        };
        assert_gate_error("create_multicast", gpu.create_multicast(1 << 21, 2));
        assert_gate_error("multicast_add_device", gpu.multicast_add_device(&mc, 0));
        assert_gate_error(
            "multicast_bind_memory",
            gpu.multicast_bind_memory(&mc, &alloc, 0, 1 << 21),
        );
        assert_gate_error("multicast_unbind", gpu.multicast_unbind(&mc, 0, 1 << 21));
        assert_gate_error("map_multicast", gpu.map_multicast(&mc));
        assert_gate_error("unmap_multicast", gpu.unmap_multicast(&mc, 0x1000));
        assert_gate_error("export_multicast", gpu.export_multicast(&mc));
        assert_gate_error("import_multicast", gpu.import_multicast(&export, Some(0)));
        assert_gate_error("free_multicast", gpu.free_multicast(&mc));
    }
}
