//! The real NCCL (or RCCL), loaded at run time from `MSCCLPP_NCCL_LIB_PATH` for the operations
//! that do not run natively or that `MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION` sends there.
//!
//! It is opened with `RTLD_LOCAL | RTLD_DEEPBIND` and every symbol is looked up on its handle, so
//! its own calls resolve inside it and never back into this shim, even when the shim is
//! preloaded or installed as `libnccl.so.2`.

use crate::abi::{self, NcclResult, UniqueId, SUCCESS};
use crate::guard::{CallResult, Failure};
use libloading::os::unix::Library;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::Path;

/// The real library's `ncclComm_t`.
pub type RawComm = *mut c_void;
pub type RawStream = *mut c_void;

type Buf = *const c_void;
type BufMut = *mut c_void;

/// `ncclAlltoAll`'s prototype (NCCL 2.28 on).
pub type AlltoallFn =
    unsafe extern "C" fn(Buf, BufMut, usize, c_int, RawComm, RawStream) -> NcclResult;

macro_rules! real_functions {
    ($( $field:ident : $name:literal => fn($($arg:ty),*) -> $ret:ty ; )*) => {
        /// The functions of the real library the shim calls.
        pub struct RealNccl {
            $( pub $field: unsafe extern "C" fn($($arg),*) -> $ret, )*
            /// `ncclAlltoAll` where the library has it (2.28 on): the fallback of an in-place
            /// all-to-all, which a group of sends and receives on one buffer cannot serve.
            pub alltoall: Option<AlltoallFn>,
            pub version: c_int,
            pub location: String,
            _lib: Library,
        }

        impl RealNccl {
            fn resolve(lib: Library, location: String) -> Result<RealNccl, String> {
                $(
                    // SAFETY: the type is the documented prototype of this NCCL function.
                    let $field = *unsafe { lib.get::<unsafe extern "C" fn($($arg),*) -> $ret>($name) }
                        .map_err(|e| format!("{location} has no {}: {e}",
                            String::from_utf8_lossy(&$name[..$name.len() - 1])))?;
                )*
                // SAFETY: the documented prototype of ncclAlltoAll (NCCL 2.28).
                let alltoall = unsafe { lib.get::<AlltoallFn>(b"ncclAlltoAll\0") }.ok().map(|f| *f);
                Ok(RealNccl { $($field,)* alltoall, version: 0, location, _lib: lib })
            }
        }
    };
}

real_functions! {
    get_version_fn: b"ncclGetVersion\0" => fn(*mut c_int) -> NcclResult;
    get_unique_id: b"ncclGetUniqueId\0" => fn(*mut UniqueId) -> NcclResult;
    comm_init_rank: b"ncclCommInitRank\0" => fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult;
    comm_destroy: b"ncclCommDestroy\0" => fn(RawComm) -> NcclResult;
    comm_abort: b"ncclCommAbort\0" => fn(RawComm) -> NcclResult;
    comm_get_async_error: b"ncclCommGetAsyncError\0" => fn(RawComm, *mut NcclResult) -> NcclResult;
    get_last_error: b"ncclGetLastError\0" => fn(RawComm) -> *const c_char;
    group_start: b"ncclGroupStart\0" => fn() -> NcclResult;
    group_end: b"ncclGroupEnd\0" => fn() -> NcclResult;
    group_simulate_end: b"ncclGroupSimulateEnd\0" => fn(*mut crate::abi::SimInfo) -> NcclResult;
    all_reduce: b"ncclAllReduce\0" => fn(Buf, BufMut, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
    all_gather: b"ncclAllGather\0" => fn(Buf, BufMut, usize, c_int, RawComm, RawStream) -> NcclResult;
    reduce_scatter: b"ncclReduceScatter\0" => fn(Buf, BufMut, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
    broadcast: b"ncclBroadcast\0" => fn(Buf, BufMut, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
    reduce: b"ncclReduce\0" => fn(Buf, BufMut, usize, c_int, c_int, c_int, RawComm, RawStream) -> NcclResult;
    send: b"ncclSend\0" => fn(Buf, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
    recv: b"ncclRecv\0" => fn(BufMut, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
    red_op_create_pre_mul_sum: b"ncclRedOpCreatePreMulSum\0" => fn(*mut c_int, *mut c_void, c_int, c_int, RawComm) -> NcclResult;
    red_op_destroy: b"ncclRedOpDestroy\0" => fn(c_int, RawComm) -> NcclResult;
}

impl RealNccl {
    /// Opens the library at `path`. A path that resolves to this shim itself is refused (its
    /// calls would come straight back here).
    pub fn load(path: &Path) -> Result<RealNccl, String> {
        let flags = libc::RTLD_LOCAL | libc::RTLD_LAZY | libc::RTLD_DEEPBIND;
        // SAFETY: loading a shared library runs its initialisers; NCCL's are benign.
        let lib = unsafe { Library::open(Some(path), flags) }
            .map_err(|e| format!("loading the real NCCL from {}: {e}", path.display()))?;
        // SAFETY: the documented prototype.
        let gv = *unsafe {
            lib.get::<unsafe extern "C" fn(*mut c_int) -> NcclResult>(b"ncclGetVersion\0")
        }
        .map_err(|e| format!("{} is not an NCCL library: {e}", path.display()))?;
        if gv as *const () == crate::lifecycle::ncclGetVersion as *const () {
            return Err(format!(
                "MSCCLPP_NCCL_LIB_PATH={} is this shim itself; point it at NVIDIA's libnccl.so.2",
                path.display()
            ));
        }
        let mut real = RealNccl::resolve(lib, path.display().to_string())?;
        // SAFETY: writes one int.
        unsafe { (real.get_version_fn)(&mut real.version) };
        Ok(real)
    }

    /// Turns a real NCCL result into ours, with its code's name and its own last-error text.
    /// `comm` is only handed back to NCCL (an opaque handle, or null), never dereferenced here.
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    pub fn check(&self, call: &str, code: NcclResult, comm: RawComm) -> CallResult {
        if code == SUCCESS || code == crate::abi::IN_PROGRESS {
            return Ok(code);
        }
        // SAFETY: NCCL returns a NUL-terminated string it owns (or null).
        let text = unsafe {
            let p = (self.get_last_error)(comm);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        // NCCL can refuse without a text (its one-rank path returns ncclInvalidArgument for an
        // fp8 avg and logs nothing), so the code's name is always given.
        let text = if text.is_empty() {
            "its ncclGetLastError is empty".to_string()
        } else {
            text
        };
        Err(Failure::new(
            code,
            format!(
                "{call} in the real NCCL ({}) failed with {}: {text}",
                self.location,
                result_name(code)
            ),
        ))
    }
}

/// NCCL's name of a result code. `nccl/scripts/torch_check.py` reads `ncclInvalidArgument` in the
/// message as the real library refusing the combination.
fn result_name(code: NcclResult) -> String {
    match code {
        abi::UNHANDLED_CUDA_ERROR => "ncclUnhandledCudaError".into(),
        abi::SYSTEM_ERROR => "ncclSystemError".into(),
        abi::INTERNAL_ERROR => "ncclInternalError".into(),
        abi::INVALID_ARGUMENT => "ncclInvalidArgument".into(),
        abi::INVALID_USAGE => "ncclInvalidUsage".into(),
        abi::REMOTE_ERROR => "ncclRemoteError".into(),
        other => format!("result code {other}"),
    }
}

// SAFETY: the function pointers and the library handle are plain data; NCCL's functions are
// thread-safe as documented.
unsafe impl Send for RealNccl {}
unsafe impl Sync for RealNccl {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_codes_are_named_as_nccl_names_them() {
        // torch_check.py's fallback mode keys on this name.
        assert_eq!(result_name(abi::INVALID_ARGUMENT), "ncclInvalidArgument");
        assert_eq!(
            result_name(abi::UNHANDLED_CUDA_ERROR),
            "ncclUnhandledCudaError"
        );
        assert_eq!(result_name(42), "result code 42");
    }
}
