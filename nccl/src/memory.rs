//! Memory: ncclMemAlloc/Free (VMM allocations, which every algorithm can share with peers,
//! zero-copy ones included), buffer and window registration, and PreMulSum operators.
//!
//! Registration is bookkeeping here: every zero-copy call agrees on every rank's buffers with its
//! peers (`mscclpp_collectives::user_buffers`), so a handle only records what was registered,
//! and deregistering an unknown handle is an error naming it.

use crate::abi::*;
use crate::comm::{gpu, Fallback};
use crate::device::caller_device;
use crate::guard::{ffi, write_out, CallResult, Failure};
use crate::handles::{self, Handle};
use mscclpp::core::gpu::{Allocation, MemoryKind};
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// ncclMemAlloc's allocations by address.
static ALLOCATIONS: Mutex<BTreeMap<u64, Allocation>> = Mutex::new(BTreeMap::new());
/// Registration and window handles: key -> (comm handle, buffer, bytes).
static REGISTRATIONS: Mutex<BTreeMap<usize, (usize, u64, usize)>> = Mutex::new(BTreeMap::new());
static NEXT_REGISTRATION: AtomicUsize = AtomicUsize::new(1);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

nccl_export! {
    fn ncclMemAlloc / pncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> NcclResult {
        ffi("ncclMemAlloc", || {
            if ptr.is_null() {
                return Err(Failure::invalid_argument("ptr is NULL"));
            }
            if size == 0 {
                return Err(Failure::invalid_argument("size is 0"));
            }
            let gpu = gpu()?;
            gpu.set_device(caller_device())?;
            let alloc = gpu.alloc(size, MemoryKind::Vmm)?;
            let address = alloc.ptr;
            lock(&ALLOCATIONS).insert(address, alloc);
            unsafe { write_out(ptr, "ptr", address as *mut c_void) }?;
            Ok(SUCCESS)
        })
    }
}

nccl_export! {
    fn ncclMemFree / pncclMemFree(ptr: *mut c_void) -> NcclResult {
        ffi("ncclMemFree", || {
            if ptr.is_null() {
                return Ok(SUCCESS);
            }
            let alloc = lock(&ALLOCATIONS).remove(&(ptr as u64)).ok_or_else(|| {
                Failure::invalid_argument(format!("{ptr:p} was not allocated by ncclMemAlloc (or was freed already)"))
            })?;
            let gpu = gpu()?;
            gpu.set_device(alloc.device)?;
            gpu.free(&alloc)?;
            Ok(SUCCESS)
        })
    }
}

pub fn register(comm: Handle, buff: *mut c_void, size: usize) -> CallResult<*mut c_void> {
    handles::live(comm)?;
    if buff.is_null() && size > 0 {
        return Err(Failure::invalid_argument("buff is NULL"));
    }
    let key = NEXT_REGISTRATION.fetch_add(1, Ordering::Relaxed) << 4;
    lock(&REGISTRATIONS).insert(key, (comm as usize, buff as u64, size));
    Ok(key as *mut c_void)
}

pub fn deregister(comm: Handle, handle: *mut c_void, what: &str) -> CallResult {
    handles::live(comm)?;
    let mut table = lock(&REGISTRATIONS);
    match table.get(&(handle as usize)) {
        Some(&(owner, _, _)) if owner == comm as usize => {
            table.remove(&(handle as usize));
            Ok(SUCCESS)
        }
        _ => Err(Failure::invalid_argument(format!(
            "{what} {handle:p} is not registered with comm {comm:p}"
        ))),
    }
}

nccl_export! {
    fn ncclCommRegister / pncclCommRegister(comm: Handle, buff: *mut c_void, size: usize, handle: *mut *mut c_void) -> NcclResult {
        ffi("ncclCommRegister", || {
            if handle.is_null() {
                return Err(Failure::invalid_argument("handle is NULL"));
            }
            let h = register(comm, buff, size)?;
            unsafe { write_out(handle, "handle", h) }.map(|_| SUCCESS)
        })
    }
}

nccl_export! {
    fn ncclCommDeregister / pncclCommDeregister(comm: Handle, handle: *mut c_void) -> NcclResult {
        ffi("ncclCommDeregister", || deregister(comm, handle, "handle"))
    }
}

nccl_export! {
    fn ncclCommWindowRegister / pncclCommWindowRegister(comm: Handle, buff: *mut c_void, size: usize, win: *mut *mut c_void, win_flags: c_int) -> NcclResult {
        ffi("ncclCommWindowRegister", || {
            if win.is_null() {
                return Err(Failure::invalid_argument("win is NULL"));
            }
            if !(0..=1).contains(&win_flags) {
                return Err(Failure::invalid_argument(format!("winFlags {win_flags}: expected NCCL_WIN_DEFAULT or NCCL_WIN_COLL_SYMMETRIC")));
            }
            let h = register(comm, buff, size)?;
            unsafe { write_out(win, "win", h) }.map(|_| SUCCESS)
        })
    }
}

nccl_export! {
    fn ncclCommWindowDeregister / pncclCommWindowDeregister(comm: Handle, win: *mut c_void) -> NcclResult {
        ffi("ncclCommWindowDeregister", || deregister(comm, win, "window"))
    }
}

nccl_export! {
    /// PreMulSum runs in the real NCCL: the operator is the real library's, and operations that
    /// use it go there.
    fn ncclRedOpCreatePreMulSum / pncclRedOpCreatePreMulSum(op: *mut c_int, scalar: *mut c_void, datatype: c_int, residence: c_int, comm: Handle) -> NcclResult {
        ffi("ncclRedOpCreatePreMulSum", || handles::operate(comm, |c| {
            if op.is_null() || scalar.is_null() {
                return Err(Failure::invalid_argument("op or scalar is NULL"));
            }
            match &c.fallback {
                Fallback::Ready { real, comm: raw } => {
                    let code = unsafe { (real.red_op_create_pre_mul_sum)(op, scalar, datatype, residence, *raw) };
                    real.check("ncclRedOpCreatePreMulSum", code, *raw)
                }
                Fallback::Missing(why) => Err(Failure::invalid_usage(format!(
                    "PreMulSum has no native implementation and there is no fallback to the real NCCL: {why}"
                ))),
            }
        }))
    }
}

nccl_export! {
    fn ncclRedOpDestroy / pncclRedOpDestroy(op: c_int, comm: Handle) -> NcclResult {
        ffi("ncclRedOpDestroy", || {
            let c = handles::live(comm)?;
            if op < NUM_BUILTIN_OPS {
                return Err(Failure::invalid_argument(format!("ncclRedOp_t {op} is built in, not created")));
            }
            match &c.fallback {
                Fallback::Ready { real, comm: raw } => {
                    let code = unsafe { (real.red_op_destroy)(op, *raw) };
                    real.check("ncclRedOpDestroy", code, *raw)
                }
                Fallback::Missing(why) => Err(Failure::invalid_argument(format!(
                    "ncclRedOp_t {op} was not created here (no fallback: {why})"
                ))),
            }
        })
    }
}
