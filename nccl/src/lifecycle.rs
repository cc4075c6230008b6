//! Versions, errors and the communicator lifecycle: init (blocking, nonblocking, grouped, all
//! devices of a process, scalable), split, shrink, finalize, destroy, abort, revoke, health and
//! queries.

use crate::abi::*;
use crate::comm::{check_ranks, new_job_id, parse_id, Comm};
use crate::device::caller_device;
use crate::group;
use crate::guard::{self, ffi, write_out, CallResult, Failure};
use crate::handles::{self, Ending, Entry, Handle, State};
use mscclpp::core::bootstrap::UniqueId as JobId;
use std::ffi::{c_char, c_int};
use std::sync::Arc;

nccl_export! {
    /// The NCCL version whose ABI this library implements.
    fn ncclGetVersion / pncclGetVersion(version: *mut c_int) -> NcclResult {
        ffi("ncclGetVersion", || unsafe { write_out(version, "version", NCCL_VERSION_CODE) }.map(|_| SUCCESS))
    }
}

/// This library's own version, MAJOR*10000 + MINOR*100 + PATCH.
#[no_mangle]
pub unsafe extern "C" fn mscclppGetVersion(version: *mut c_int) -> NcclResult {
    ffi("mscclppGetVersion", || {
        let part = |s: &str| s.parse::<c_int>().unwrap_or(0);
        let code = part(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
            + part(env!("CARGO_PKG_VERSION_MINOR")) * 100
            + part(env!("CARGO_PKG_VERSION_PATCH"));
        unsafe { write_out(version, "version", code) }.map(|_| SUCCESS)
    })
}

nccl_export! {
    fn ncclGetErrorString / pncclGetErrorString(result: NcclResult) -> *const c_char {
        guard::error_string(result).as_ptr()
    }
}

nccl_export! {
    /// The last failure of any call in this process, with the call's name and the reason.
    fn ncclGetLastError / pncclGetLastError(_comm: Handle) -> *const c_char {
        std::panic::catch_unwind(guard::last_error_ptr).unwrap_or(c"".as_ptr())
    }
}

nccl_export! {
    /// Logging is configured once from MSCCLPP_LOG_LEVEL; there is nothing to reload.
    fn ncclResetDebugInit / pncclResetDebugInit() -> () {}
}

nccl_export! {
    fn ncclGetUniqueId / pncclGetUniqueId(unique_id: *mut UniqueId) -> NcclResult {
        ffi("ncclGetUniqueId", || {
            if unique_id.is_null() {
                return Err(Failure::invalid_argument("uniqueId is NULL"));
            }
            let id = new_job_id()?;
            unsafe { write_out(unique_id, "uniqueId", UniqueId::from_bytes(&id.to_bytes())) }?;
            Ok(SUCCESS)
        })
    }
}

/// Starts an init of `rank` of `nranks` in job `id` on `device` (NCCL's calls: the caller's
/// current device): now (blocking), on a thread (nonblocking: `ncclInProgress`), or at the
/// group's end.
pub fn start_init(
    call: &'static str,
    out: *mut Handle,
    (nranks, rank): (c_int, c_int),
    id: JobId,
    device: usize,
    options: Options,
) -> CallResult {
    let (nranks, rank) = check_ranks(nranks, rank)?;
    let job = id.clone();
    launch_init(call, out, job, rank, options, move || {
        Comm::connect(nranks, rank, &id, device)
    })
}

/// Starts the init of a communicator over a bootstrap the caller made (the C API's host
/// callbacks) on `device`, as `start_init` does with the TCP bootstrap.
pub fn start_init_over(
    call: &'static str,
    out: *mut Handle,
    bootstrap: Arc<dyn mscclpp::core::bootstrap::Bootstrap>,
    job: JobId,
    device: usize,
) -> CallResult {
    let rank = bootstrap.rank();
    let id = job.clone();
    launch_init(call, out, job, rank, Options::default(), move || {
        Comm::connect_over(bootstrap, &id, device)
    })
}

/// Registers a handle for the init `connect` does and runs it now, on a thread or at the group's
/// end (see `start_init`).
fn launch_init(
    call: &'static str,
    out: *mut Handle,
    id: JobId,
    rank: usize,
    options: Options,
    connect: impl FnOnce() -> CallResult<Comm> + Send + 'static,
) -> CallResult {
    if out.is_null() {
        return Err(Failure::invalid_argument(
            "comm (the output pointer) is NULL",
        ));
    }
    let entry = Entry::initializing(id);
    let handle = handles::register(entry.clone());
    // SAFETY: checked non-null above.
    unsafe { out.write(handle) };
    let job = move || {
        // On whatever thread runs it (ours for a nonblocking init): a panic must not leave the
        // handle initialising forever.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(connect))
            .unwrap_or_else(|_| {
                Err(Failure::new(
                    INTERNAL_ERROR,
                    "the init panicked (a bug in mscclpp-rs)",
                ))
            });
        entry.finish(call, result);
        entry.init_result().map(|_| ())
    };
    if group::active() {
        group::defer_init(Box::new(job));
        return Ok(SUCCESS);
    }
    if !options.blocking {
        std::thread::Builder::new()
            .name(format!("mscclpp-nccl-init-{rank}"))
            .spawn(move || {
                let _ = job();
            })
            .map_err(|e| Failure::new(SYSTEM_ERROR, format!("spawning the init thread: {e}")))?;
        return Ok(IN_PROGRESS);
    }
    let result = job().map(|_| SUCCESS);
    if result.is_err() {
        let _ = handles::remove(handle);
        // SAFETY: as above.
        unsafe { out.write(std::ptr::null_mut()) };
    }
    result
}

nccl_export! {
    fn ncclCommInitRank / pncclCommInitRank(comm: *mut Handle, nranks: c_int, comm_id: UniqueId, rank: c_int) -> NcclResult {
        ffi("ncclCommInitRank", || {
            check_ranks(nranks, rank)?;
            start_init("ncclCommInitRank", comm, (nranks, rank), parse_id(&comm_id)?, caller_device(), Options::default())
        })
    }
}

nccl_export! {
    fn ncclCommInitRankConfig / pncclCommInitRankConfig(comm: *mut Handle, nranks: c_int, comm_id: UniqueId, rank: c_int, config: *mut Config) -> NcclResult {
        ffi("ncclCommInitRankConfig", || {
            let options = unsafe { Options::from_config(config) }.map_err(Failure::invalid_argument)?;
            check_ranks(nranks, rank)?;
            start_init("ncclCommInitRankConfig", comm, (nranks, rank), parse_id(&comm_id)?, caller_device(), options)
        })
    }
}

nccl_export! {
    /// Our bootstrap has one root, so only the first id is used; every rank must pass the same
    /// list, as NCCL requires.
    fn ncclCommInitRankScalable / pncclCommInitRankScalable(newcomm: *mut Handle, nranks: c_int, myrank: c_int, n_id: c_int, comm_ids: *mut UniqueId, config: *mut Config) -> NcclResult {
        ffi("ncclCommInitRankScalable", || {
            let options = unsafe { Options::from_config(config) }.map_err(Failure::invalid_argument)?;
            if n_id < 1 || comm_ids.is_null() {
                return Err(Failure::invalid_argument(format!("nId is {n_id} and commIds is {comm_ids:p}: at least one id is needed")));
            }
            check_ranks(nranks, myrank)?;
            // SAFETY: non-null and holds nId >= 1 ids.
            let first = unsafe { *comm_ids };
            start_init("ncclCommInitRankScalable", newcomm, (nranks, myrank), parse_id(&first)?, caller_device(), options)
        })
    }
}

nccl_export! {
    /// One process, `ndev` ranks: `devlist[i]` (or device i) for rank i. A device may repeat:
    /// several ranks may share one GPU here, which NCCL refuses.
    fn ncclCommInitAll / pncclCommInitAll(comms: *mut Handle, ndev: c_int, devlist: *const c_int) -> NcclResult {
        ffi("ncclCommInitAll", || {
            if comms.is_null() {
                return Err(Failure::invalid_argument("comms is NULL"));
            }
            let (n, _) = check_ranks(ndev, 0)?;
            let devices: Vec<usize> = (0..n)
                .map(|i| {
                    // SAFETY: a non-null devlist holds ndev ints.
                    let d = if devlist.is_null() { i as c_int } else { unsafe { *devlist.add(i) } };
                    usize::try_from(d).map_err(|_| Failure::invalid_argument(format!("devlist[{i}] is {d}")))
                })
                .collect::<CallResult<_>>()?;
            let id = new_job_id()?;
            let results: Vec<CallResult<Comm>> = std::thread::scope(|s| {
                let joins: Vec<_> = devices.iter().enumerate()
                    .map(|(rank, &device)| { let id = &id; s.spawn(move || Comm::connect(n, rank, id, device)) })
                    .collect();
                joins.into_iter().map(|j| j.join().unwrap_or_else(|_| Err(Failure::new(INTERNAL_ERROR, "an init thread panicked")))).collect()
            });
            if let Some(Err(f)) = results.iter().find(|r| r.is_err()) {
                let f = f.clone();
                std::thread::scope(|s| { for r in results { s.spawn(move || drop(r)); } });
                return Err(f);
            }
            for (i, r) in results.into_iter().enumerate() {
                let comm = r?;
                let entry = Entry::initializing(id.clone());
                *entry.state() = State::Ready(Arc::new(comm));
                // SAFETY: comms holds ndev handles.
                unsafe { comms.add(i).write(handles::register(entry)) };
            }
            Ok(SUCCESS)
        })
    }
}

/// Tag of the new job's id sent from its first rank to the others (split, shrink).
const TAG_DERIVED_ID: u64 = 0x6e63_636c_6964; // "nclid"

/// Collective over `members` (parent ranks, in new rank order): a new communicator of them.
fn derive(parent: &Comm, members: &[usize], out: *mut Handle) -> CallResult {
    let me = parent.rank;
    let position = members
        .iter()
        .position(|&m| m == me)
        .ok_or_else(|| Failure::new(INTERNAL_ERROR, "this rank is not a member"))?;
    let bootstrap = parent.communicator.bootstrap();
    let id = if position == 0 {
        let id = new_job_id()?;
        for &m in &members[1..] {
            bootstrap.send(m, TAG_DERIVED_ID, &id.to_bytes())?;
        }
        id
    } else {
        let bytes = bootstrap.recv(members[0], TAG_DERIVED_ID)?;
        JobId::from_bytes(&bytes)?
    };
    // On the parent's GPU backend (the process's, or a test's).
    let gpu = parent.gpu.clone();
    let comm = Comm::connect_with(members.len(), position, &id, parent.device, move || Ok(gpu))?;
    let entry = Entry::initializing(id);
    *entry.state() = State::Ready(Arc::new(comm));
    unsafe { write_out(out, "newcomm", handles::register(entry)) }?;
    Ok(SUCCESS)
}

nccl_export! {
    fn ncclCommSplit / pncclCommSplit(comm: Handle, color: c_int, key: c_int, newcomm: *mut Handle, _config: *mut Config) -> NcclResult {
        ffi("ncclCommSplit", || {
            let parent = handles::live(comm)?;
            if newcomm.is_null() {
                return Err(Failure::invalid_argument("newcomm is NULL"));
            }
            if color < SPLIT_NOCOLOR {
                return Err(Failure::invalid_argument(format!("color {color}: use a color >= 0 or NCCL_SPLIT_NOCOLOR")));
            }
            let mine = [color.to_le_bytes(), key.to_le_bytes()].concat();
            let all = parent.communicator.bootstrap().all_gather(&mine)?;
            let pair = |b: &[u8]| -> (c_int, c_int) {
                let word = |i: usize| b.get(i..i + 4).and_then(|w| w.try_into().ok()).map(c_int::from_le_bytes).unwrap_or(SPLIT_NOCOLOR);
                (word(0), word(4))
            };
            if color == SPLIT_NOCOLOR {
                unsafe { newcomm.write(std::ptr::null_mut()) };
                return Ok(SUCCESS);
            }
            let mut members: Vec<(c_int, usize)> = all.iter().enumerate()
                .map(|(r, b)| (pair(b), r))
                .filter(|((c, _), _)| *c == color)
                .map(|((_, k), r)| (k, r))
                .collect();
            members.sort();
            let members: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
            derive(&parent, &members, newcomm)
        })
    }
}

nccl_export! {
    /// The remaining ranks, in their old order, form the new communicator; the excluded ranks
    /// take no part (they may be dead).
    fn ncclCommShrink / pncclCommShrink(comm: Handle, exclude_ranks_list: *mut c_int, exclude_ranks_count: c_int, newcomm: *mut Handle, _config: *mut Config, shrink_flags: c_int) -> NcclResult {
        ffi("ncclCommShrink", || {
            let parent = handles::live(comm)?;
            if exclude_ranks_count < 0 || (exclude_ranks_count > 0 && exclude_ranks_list.is_null()) {
                return Err(Failure::invalid_argument(format!("excludeRanksList {exclude_ranks_list:p} with count {exclude_ranks_count}")));
            }
            let mut excluded = vec![false; parent.nranks];
            for i in 0..exclude_ranks_count as usize {
                // SAFETY: the list holds count ints.
                let r = unsafe { *exclude_ranks_list.add(i) };
                let idx = usize::try_from(r).ok().filter(|&r| r < parent.nranks)
                    .ok_or_else(|| Failure::invalid_argument(format!("excluded rank {r} is not a rank of {}", parent.nranks)))?;
                excluded[idx] = true;
            }
            if excluded[parent.rank] {
                return Err(Failure::invalid_usage(format!("rank {} called ncclCommShrink but is in its exclude list", parent.rank)));
            }
            if shrink_flags & 1 != 0 {
                parent.communicator.abort("ncclCommShrink with NCCL_SHRINK_ABORT");
            }
            let members: Vec<usize> = (0..parent.nranks).filter(|&r| !excluded[r]).collect();
            derive(&parent, &members, newcomm)
        })
    }
}

nccl_export! {
    /// Operations are enqueued on the caller's streams; there is nothing of ours left to flush.
    /// A communicator destroyed or aborted meanwhile (another thread) has nothing left either.
    fn ncclCommFinalize / pncclCommFinalize(comm: Handle) -> NcclResult {
        ffi("ncclCommFinalize", || {
            if let State::Closed { .. } = &*handles::lookup(comm)?.state() {
                return Ok(SUCCESS);
            }
            handles::live(comm).map(|_| SUCCESS)
        })
    }
}

nccl_export! {
    /// Drops the handle's reference: the teardown runs now, or when the last call still running
    /// on the communicator (another thread's) returns. A second destroy, or one after an abort,
    /// does nothing.
    fn ncclCommDestroy / pncclCommDestroy(comm: Handle) -> NcclResult {
        ffi("ncclCommDestroy", || {
            if let Some(c) = handles::close(comm, Ending::Destroy)? {
                handles::retire(c);
            }
            Ok(SUCCESS)
        })
    }
}

nccl_export! {
    /// Callable from any thread, also while another thread is inside a call on the communicator
    /// (PyTorch's watchdog does this): marks it aborted, so its kernels and device waits give up
    /// within about a millisecond and a thread blocked in one of its host waits (a buffer
    /// registration's exchange with the peers) returns at once with the error; then drops the
    /// handle's reference. The teardown (the real NCCL's communicator aborted, this process's
    /// kernels drained, buffers freed) runs now if no call holds the communicator, else when
    /// the last such call returns, on its thread: nothing is freed under a call in flight, and
    /// no thread of ours is left tearing down while the process exits. A second abort, or one
    /// after a destroy, does nothing.
    fn ncclCommAbort / pncclCommAbort(comm: Handle) -> NcclResult {
        ffi("ncclCommAbort", || {
            if let Some(c) = handles::close(comm, Ending::Abort)? {
                handles::retire(c);
            }
            Ok(SUCCESS)
        })
    }
}

nccl_export! {
    /// Stops the communicator's operations (it is aborted for operations) but keeps it for
    /// destroy, split and shrink.
    fn ncclCommRevoke / pncclCommRevoke(comm: Handle, revoke_flags: c_int) -> NcclResult {
        ffi("ncclCommRevoke", || {
            if revoke_flags != 0 {
                return Err(Failure::invalid_argument(format!("revokeFlags {revoke_flags}: must be NCCL_REVOKE_DEFAULT (0)")));
            }
            handles::live(comm)?.communicator.abort("ncclCommRevoke");
            Ok(SUCCESS)
        })
    }
}

nccl_export! {
    /// After a destroy or abort (another thread's, racing this one), the error the communicator
    /// ended with, so a watchdog polling it never gets a failure for the call itself.
    fn ncclCommGetAsyncError / pncclCommGetAsyncError(comm: Handle, async_error: *mut NcclResult) -> NcclResult {
        ffi("ncclCommGetAsyncError", || {
            let code = handles::async_error_code(comm)?;
            unsafe { write_out(async_error, "asyncError", code) }?;
            Ok(SUCCESS)
        })
    }
}

nccl_export! {
    fn ncclCommCount / pncclCommCount(comm: Handle, count: *mut c_int) -> NcclResult {
        ffi("ncclCommCount", || {
            let c = handles::live(comm)?;
            unsafe { write_out(count, "count", c.nranks as c_int) }.map(|_| SUCCESS)
        })
    }
}

nccl_export! {
    /// The CUDA device of the communicator (not its rank).
    fn ncclCommCuDevice / pncclCommCuDevice(comm: Handle, device: *mut c_int) -> NcclResult {
        ffi("ncclCommCuDevice", || {
            let c = handles::live(comm)?;
            unsafe { write_out(device, "device", c.device as c_int) }.map(|_| SUCCESS)
        })
    }
}

nccl_export! {
    fn ncclCommUserRank / pncclCommUserRank(comm: Handle, rank: *mut c_int) -> NcclResult {
        ffi("ncclCommUserRank", || {
            let c = handles::live(comm)?;
            unsafe { write_out(rank, "rank", c.rank as c_int) }.map(|_| SUCCESS)
        })
    }
}
