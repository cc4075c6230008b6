//! Hand-written declarations of the HIP runtime entry points this backend uses (ROCm 6 ABI), and
//! the table that holds them once resolved. Only what the backend calls is declared: a smaller
//! surface is a smaller chance of an ABI mismatch.

use crate::loader;
use mscclpp_core::{Error, Result};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

pub type HipError = c_int;
pub type HipStream = *mut c_void;
pub type HipEvent = *mut c_void;
pub type HipModule = *mut c_void;
pub type HipFunction = *mut c_void;

pub const HIP_SUCCESS: HipError = 0;
pub const HIP_ERROR_NO_DEVICE: HipError = 100;
pub const HIP_ERROR_NOT_READY: HipError = 600;
pub const HIP_ERROR_PEER_ACCESS_ALREADY_ENABLED: HipError = 704;

pub const HIP_MEMCPY_HOST_TO_DEVICE: c_int = 1;
pub const HIP_MEMCPY_DEVICE_TO_HOST: c_int = 2;
/// Direction inferred from the pointers (unified addressing).
pub const HIP_MEMCPY_DEFAULT: c_int = 4;

pub const HIP_HOST_MALLOC_MAPPED: c_uint = 0x2;
/// Fine-grained (coherent) host memory: device writes become visible to a polling host thread and
/// host writes to a polling kernel without explicit flushes, which FIFOs and semaphores rely on.
pub const HIP_HOST_MALLOC_COHERENT: c_uint = 0x4000_0000;
pub const HIP_STREAM_NON_BLOCKING: c_uint = 0x1;
pub const HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 0x1;

pub const HIP_IPC_HANDLE_SIZE: usize = 64;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct HipIpcMemHandle {
    pub reserved: [u8; HIP_IPC_HANDLE_SIZE],
}

/// `hipDeviceProp_tR0600` from ROCm 6's hip_runtime_api.h, field for field (unneeded runs of
/// `int` are grouped into arrays of the same total size; alignment falls out identically).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HipDeviceProp {
    pub name: [c_char; 256],
    pub uuid: [u8; 16],
    pub luid: [c_char; 8],
    pub luid_device_node_mask: c_uint,
    pub total_global_mem: usize,
    pub shared_mem_per_block: usize,
    pub regs_per_block: c_int,
    pub warp_size: c_int,
    pub mem_pitch: usize,
    pub max_threads_per_block: c_int,
    pub max_threads_dim: [c_int; 3],
    pub max_grid_size: [c_int; 3],
    pub clock_rate: c_int,
    pub total_const_mem: usize,
    pub major: c_int,
    pub minor: c_int,
    pub texture_alignment: usize,
    pub texture_pitch_alignment: usize,
    pub device_overlap: c_int,
    pub multi_processor_count: c_int,
    /// kernelExecTimeoutEnabled .. maxTexture1DLinear (7 ints), then the texture and surface
    /// dimension arrays (2+2+3+2+3+3+1+2+3+2 + 1+2+3+2+3+1+2 = 37 ints).
    pub _ints_a: [c_int; 7 + 37],
    pub surface_alignment: usize,
    /// concurrentKernels, ECCEnabled, pciBusID, pciDeviceID, pciDomainID, ... localL1CacheSupported.
    pub _ints_b: [c_int; 16],
    pub shared_mem_per_multiprocessor: usize,
    /// regsPerMultiprocessor .. cooperativeMultiDeviceLaunch.
    pub _ints_c: [c_int; 12],
    pub shared_mem_per_block_optin: usize,
    /// pageableMemoryAccessUsesHostPageTables .. accessPolicyMaxWindowSize.
    pub _ints_d: [c_int; 4],
    pub reserved_shared_mem_per_block: usize,
    /// hostRegisterSupported .. unifiedFunctionPointers (6 + 3 + 4), `reserved[63]`, `hipReserved[32]`.
    pub _ints_e: [c_int; 13 + 63 + 32],
    pub gcn_arch_name: [c_char; 256],
    pub max_shared_memory_per_multiprocessor: usize,
    pub clock_instruction_rate: c_int,
    pub arch: c_uint,
    pub hdp_mem_flush_cntl: *mut c_uint,
    pub hdp_reg_flush_cntl: *mut c_uint,
    /// cooperativeMultiDeviceUnmatched{Func,GridDim,BlockDim,SharedMem}, isLargeBar, asicRevision.
    pub _ints_f: [c_int; 6],
}

/// What `hipGetDevicePropertiesR0600` writes into. The slack means a newer runtime whose struct
/// grew at the end (the header reserves room, but still) cannot write past our buffer.
#[repr(C)]
pub struct HipDevicePropBuffer {
    pub prop: HipDeviceProp,
    pub _slack: [u8; 4096],
}

/// Declares the function table: one field per entry point, resolved by its C name.
macro_rules! hip_api {
    ($( $field:ident = $sym:literal : fn($($arg:ty),*) -> $ret:ty; )*) => {
        /// The resolved HIP entry points. The `Library` they came from is kept alive beside them.
        #[allow(non_snake_case)]
        pub struct HipApi {
            $( pub $field: unsafe extern "C" fn($($arg),*) -> $ret, )*
        }

        impl HipApi {
            pub fn resolve(lib: &libloading::Library, location: &str) -> Result<HipApi> {
                Ok(HipApi {
                    $( $field: loader::symbol(lib, location, concat!($sym, "\0"))?, )*
                })
            }
        }
    };
}

hip_api! {
    get_error_name = "hipGetErrorName": fn(HipError) -> *const c_char;
    get_error_string = "hipGetErrorString": fn(HipError) -> *const c_char;
    get_device_count = "hipGetDeviceCount": fn(*mut c_int) -> HipError;
    set_device = "hipSetDevice": fn(c_int) -> HipError;
    get_device = "hipGetDevice": fn(*mut c_int) -> HipError;
    get_device_properties = "hipGetDevicePropertiesR0600": fn(*mut HipDeviceProp, c_int) -> HipError;
    device_get_pci_bus_id = "hipDeviceGetPCIBusId": fn(*mut c_char, c_int, c_int) -> HipError;
    malloc = "hipMalloc": fn(*mut *mut c_void, usize) -> HipError;
    free = "hipFree": fn(*mut c_void) -> HipError;
    host_malloc = "hipHostMalloc": fn(*mut *mut c_void, usize, c_uint) -> HipError;
    host_free = "hipHostFree": fn(*mut c_void) -> HipError;
    host_get_device_pointer = "hipHostGetDevicePointer": fn(*mut *mut c_void, *mut c_void, c_uint) -> HipError;
    mem_get_address_range = "hipMemGetAddressRange": fn(*mut *mut c_void, *mut usize, *mut c_void) -> HipError;
    memcpy = "hipMemcpy": fn(*mut c_void, *const c_void, usize, c_int) -> HipError;
    memcpy_async = "hipMemcpyAsync": fn(*mut c_void, *const c_void, usize, c_int, HipStream) -> HipError;
    memset_async = "hipMemsetAsync": fn(*mut c_void, c_int, usize, HipStream) -> HipError;
    stream_create_with_flags = "hipStreamCreateWithFlags": fn(*mut HipStream, c_uint) -> HipError;
    stream_destroy = "hipStreamDestroy": fn(HipStream) -> HipError;
    stream_query = "hipStreamQuery": fn(HipStream) -> HipError;
    stream_is_capturing = "hipStreamIsCapturing": fn(HipStream, *mut c_int) -> HipError;
    thread_exchange_stream_capture_mode = "hipThreadExchangeStreamCaptureMode": fn(*mut c_int) -> HipError;
    device_synchronize = "hipDeviceSynchronize": fn() -> HipError;
    event_create = "hipEventCreate": fn(*mut HipEvent) -> HipError;
    event_destroy = "hipEventDestroy": fn(HipEvent) -> HipError;
    event_record = "hipEventRecord": fn(HipEvent, HipStream) -> HipError;
    stream_wait_event = "hipStreamWaitEvent": fn(HipStream, HipEvent, u32) -> HipError;
    event_query = "hipEventQuery": fn(HipEvent) -> HipError;
    event_elapsed_time = "hipEventElapsedTime": fn(*mut f32, HipEvent, HipEvent) -> HipError;
    ipc_get_mem_handle = "hipIpcGetMemHandle": fn(*mut HipIpcMemHandle, *mut c_void) -> HipError;
    ipc_open_mem_handle = "hipIpcOpenMemHandle": fn(*mut *mut c_void, HipIpcMemHandle, c_uint) -> HipError;
    ipc_close_mem_handle = "hipIpcCloseMemHandle": fn(*mut c_void) -> HipError;
    device_enable_peer_access = "hipDeviceEnablePeerAccess": fn(c_int, c_uint) -> HipError;
    module_load_data = "hipModuleLoadData": fn(*mut HipModule, *const c_void) -> HipError;
    module_get_function = "hipModuleGetFunction": fn(*mut HipFunction, HipModule, *const c_char) -> HipError;
    module_launch_kernel = "hipModuleLaunchKernel": fn(HipFunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, HipStream, *mut *mut c_void, *mut *mut c_void) -> HipError;
}

impl HipApi {
    /// `hipGetErrorName (hipGetErrorString)` for a code, for error messages.
    pub fn describe(&self, code: HipError) -> String {
        // SAFETY: both functions return pointers to static NUL-terminated strings (or null).
        let text = |p: *const c_char| {
            if p.is_null() {
                String::from("unknown error")
            } else {
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        let (name, string) =
            unsafe { ((self.get_error_name)(code), (self.get_error_string)(code)) };
        format!("{}: {}", text(name), text(string))
    }

    /// Turns a HIP return code into our error, naming the call.
    pub fn check(&self, call: &'static str, code: HipError) -> Result<()> {
        if code == HIP_SUCCESS {
            Ok(())
        } else {
            Err(Error::Driver {
                call,
                code: i64::from(code),
                message: self.describe(code),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Offsets from ROCm 6's hipDeviceProp_tR0600 on x86-64, worked out from the header by hand; if
    /// a field above moves, these catch it before a GPU does.
    #[test]
    fn device_prop_layout() {
        assert_eq!(std::mem::offset_of!(HipDeviceProp, total_global_mem), 288);
        assert_eq!(std::mem::offset_of!(HipDeviceProp, warp_size), 308);
        assert_eq!(std::mem::offset_of!(HipDeviceProp, major), 360);
        assert_eq!(
            std::mem::offset_of!(HipDeviceProp, multi_processor_count),
            388
        );
        assert_eq!(std::mem::offset_of!(HipDeviceProp, surface_alignment), 568);
        assert_eq!(std::mem::offset_of!(HipDeviceProp, gcn_arch_name), 1160);
        assert_eq!(std::mem::size_of::<HipIpcMemHandle>(), 64);
    }
}
