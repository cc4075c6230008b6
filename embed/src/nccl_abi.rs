//! The NCCL ABI of the shim under the `mscclpp_` prefix: each `mscclpp_ncclX` declares this copy
//! embedded ([`embedding::declare`]: no fallback library of its own) and runs the shim's `ncclX`,
//! which guards the call (error codes, the last-error text, no unwinding into C).
//!
//! The list below is the shim's `nccl/exports.txt` in its order (`tests/exports.rs` keeps them
//! equal); the calls are type-checked against the shim's own definitions, so a signature here
//! cannot drift from the one served.

use mscclpp_nccl::abi::{Config, NcclResult, SimInfo, UniqueId};
use mscclpp_nccl::embedding;
use mscclpp_nccl::handles::Handle;
use mscclpp_nccl::{device_api, lifecycle, memory, ops};
use std::ffi::{c_char, c_int, c_void};

macro_rules! prefixed {
    ($( $module:ident :: $name:ident => $export:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty ; )*) => {
        $(
            #[doc = concat!("`", stringify!($name), "` of the NCCL ABI (`nccl/include/nccl.h`), embedded.")]
            #[no_mangle]
            pub unsafe extern "C" fn $export($($arg: $ty),*) -> $ret {
                embedding::declare();
                unsafe { $module::$name($($arg),*) }
            }
        )*

        /// The exported names, in the order of `nccl/exports.txt`.
        pub const EXPORTS: &[&str] = &[$(stringify!($export)),*];
    };
}

prefixed! {
    lifecycle::ncclGetVersion => mscclpp_ncclGetVersion(version: *mut c_int) -> NcclResult;
    lifecycle::ncclGetErrorString => mscclpp_ncclGetErrorString(result: NcclResult) -> *const c_char;
    lifecycle::ncclGetLastError => mscclpp_ncclGetLastError(comm: Handle) -> *const c_char;
    lifecycle::ncclResetDebugInit => mscclpp_ncclResetDebugInit() -> ();
    memory::ncclMemAlloc => mscclpp_ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> NcclResult;
    memory::ncclMemFree => mscclpp_ncclMemFree(ptr: *mut c_void) -> NcclResult;
    lifecycle::ncclGetUniqueId => mscclpp_ncclGetUniqueId(unique_id: *mut UniqueId) -> NcclResult;
    lifecycle::ncclCommInitRank => mscclpp_ncclCommInitRank(comm: *mut Handle, nranks: c_int, comm_id: UniqueId, rank: c_int) -> NcclResult;
    lifecycle::ncclCommInitRankConfig => mscclpp_ncclCommInitRankConfig(comm: *mut Handle, nranks: c_int, comm_id: UniqueId, rank: c_int, config: *mut Config) -> NcclResult;
    lifecycle::ncclCommInitRankScalable => mscclpp_ncclCommInitRankScalable(newcomm: *mut Handle, nranks: c_int, myrank: c_int, n_id: c_int, comm_ids: *mut UniqueId, config: *mut Config) -> NcclResult;
    lifecycle::ncclCommInitAll => mscclpp_ncclCommInitAll(comms: *mut Handle, ndev: c_int, devlist: *const c_int) -> NcclResult;
    lifecycle::ncclCommSplit => mscclpp_ncclCommSplit(comm: Handle, color: c_int, key: c_int, newcomm: *mut Handle, config: *mut Config) -> NcclResult;
    lifecycle::ncclCommShrink => mscclpp_ncclCommShrink(comm: Handle, exclude_ranks_list: *mut c_int, exclude_ranks_count: c_int, newcomm: *mut Handle, config: *mut Config, shrink_flags: c_int) -> NcclResult;
    lifecycle::ncclCommFinalize => mscclpp_ncclCommFinalize(comm: Handle) -> NcclResult;
    lifecycle::ncclCommDestroy => mscclpp_ncclCommDestroy(comm: Handle) -> NcclResult;
    lifecycle::ncclCommAbort => mscclpp_ncclCommAbort(comm: Handle) -> NcclResult;
    lifecycle::ncclCommRevoke => mscclpp_ncclCommRevoke(comm: Handle, revoke_flags: c_int) -> NcclResult;
    lifecycle::ncclCommGetAsyncError => mscclpp_ncclCommGetAsyncError(comm: Handle, async_error: *mut NcclResult) -> NcclResult;
    lifecycle::ncclCommCount => mscclpp_ncclCommCount(comm: Handle, count: *mut c_int) -> NcclResult;
    lifecycle::ncclCommCuDevice => mscclpp_ncclCommCuDevice(comm: Handle, device: *mut c_int) -> NcclResult;
    lifecycle::ncclCommUserRank => mscclpp_ncclCommUserRank(comm: Handle, rank: *mut c_int) -> NcclResult;
    memory::ncclCommRegister => mscclpp_ncclCommRegister(comm: Handle, buff: *mut c_void, size: usize, handle: *mut *mut c_void) -> NcclResult;
    memory::ncclCommDeregister => mscclpp_ncclCommDeregister(comm: Handle, handle: *mut c_void) -> NcclResult;
    memory::ncclCommWindowRegister => mscclpp_ncclCommWindowRegister(comm: Handle, buff: *mut c_void, size: usize, win: *mut *mut c_void, win_flags: c_int) -> NcclResult;
    memory::ncclCommWindowDeregister => mscclpp_ncclCommWindowDeregister(comm: Handle, win: *mut c_void) -> NcclResult;
    memory::ncclRedOpCreatePreMulSum => mscclpp_ncclRedOpCreatePreMulSum(op: *mut c_int, scalar: *mut c_void, datatype: c_int, residence: c_int, comm: Handle) -> NcclResult;
    memory::ncclRedOpDestroy => mscclpp_ncclRedOpDestroy(op: c_int, comm: Handle) -> NcclResult;
    ops::ncclAllReduce => mscclpp_ncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: Handle, stream: *mut c_void) -> NcclResult;
    ops::ncclAllGather => mscclpp_ncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: c_int, comm: Handle, stream: *mut c_void) -> NcclResult;
    ops::ncclReduceScatter => mscclpp_ncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: c_int, op: c_int, comm: Handle, stream: *mut c_void) -> NcclResult;
    ops::ncclBroadcast => mscclpp_ncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Handle, stream: *mut c_void) -> NcclResult;
    ops::ncclBcast => mscclpp_ncclBcast(buff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Handle, stream: *mut c_void) -> NcclResult;
    ops::ncclReduce => mscclpp_ncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, root: c_int, comm: Handle, stream: *mut c_void) -> NcclResult;
    ops::ncclAlltoAll => mscclpp_ncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, comm: Handle, stream: *mut c_void) -> NcclResult;
    ops::ncclGather => mscclpp_ncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Handle, stream: *mut c_void) -> NcclResult;
    ops::ncclScatter => mscclpp_ncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Handle, stream: *mut c_void) -> NcclResult;
    ops::ncclSend => mscclpp_ncclSend(sendbuff: *const c_void, count: usize, datatype: c_int, peer: c_int, comm: Handle, stream: *mut c_void) -> NcclResult;
    ops::ncclRecv => mscclpp_ncclRecv(recvbuff: *mut c_void, count: usize, datatype: c_int, peer: c_int, comm: Handle, stream: *mut c_void) -> NcclResult;
    ops::ncclGroupStart => mscclpp_ncclGroupStart() -> NcclResult;
    ops::ncclGroupEnd => mscclpp_ncclGroupEnd() -> NcclResult;
    ops::ncclGroupSimulateEnd => mscclpp_ncclGroupSimulateEnd(sim_info: *mut SimInfo) -> NcclResult;
    device_api::ncclDevCommCreate => mscclpp_ncclDevCommCreate(comm: Handle, reqs: *const c_void, out_devcomm: *mut c_void) -> NcclResult;
    device_api::ncclDevCommDestroy => mscclpp_ncclDevCommDestroy(comm: Handle, devcomm: *const c_void) -> NcclResult;
}
