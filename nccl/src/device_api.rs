//! NCCL 2.28's device-API host entry points (ncclDevCommCreate / ncclDevCommDestroy).
//!
//! Frameworks link against them even when they never use NCCL's device API (PyTorch's
//! libtorch_cuda does, for its NCCL symmetric-memory backend), so a library loaded as
//! `libnccl.so.2` must define them or the framework fails to load. This library has no
//! device-kernel interface of NCCL's kind: both calls refuse with `ncclInvalidUsage`, and
//! `ncclGetLastError` says so, instead of handing out a device communicator that nothing backs.

use crate::abi::*;
use crate::guard::{ffi, Failure};
use crate::handles::{self, Handle};
use std::ffi::c_void;

fn unsupported(call: &str) -> Failure {
    Failure::invalid_usage(format!(
        "{call}: NCCL's device API (nccl_device.h) is not offered by libmscclpp_nccl; use the \
         host collectives, or the real NCCL for device-initiated communication"
    ))
}

nccl_export! {
    fn ncclDevCommCreate / pncclDevCommCreate(comm: Handle, reqs: *const c_void, out_dev_comm: *mut c_void) -> NcclResult {
        ffi("ncclDevCommCreate", || {
            handles::live(comm)?;
            let _ = (reqs, out_dev_comm);
            Err(unsupported("ncclDevCommCreate"))
        })
    }
}

nccl_export! {
    fn ncclDevCommDestroy / pncclDevCommDestroy(comm: Handle, dev_comm: *const c_void) -> NcclResult {
        ffi("ncclDevCommDestroy", || {
            handles::live(comm)?;
            let _ = dev_comm;
            Err(unsupported("ncclDevCommDestroy"))
        })
    }
}
