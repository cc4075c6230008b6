//! `mscclpp.h`: the C API below the NCCL ABI. The header documents each function, its errors
//! and which threads may call it; this module implements it over the shim's communicators, so a
//! handle made here is an `ncclComm_t` of the prefixed ABI too.
//!
//! Every function runs in the shim's guard (`guard::ffi`): a failure returns its code and leaves
//! its text for `mscclppGetLastError` on the calling thread; a panic becomes
//! `mscclppInternalError`, never an unwind into C.

use crate::host_bootstrap::{HostBootstrap, HostCallbacks};
use mscclpp::core::bootstrap::{Bootstrap, UniqueId as JobId, SECRET_LEN};
use mscclpp::core::gpu::Stream;
use mscclpp::core::{Algorithm, Collective, ExecuteArgs};
use mscclpp_nccl::abi::{NcclResult, Options, UniqueId, SUCCESS};
use mscclpp_nccl::comm::{new_job_id, parse_id};
use mscclpp_nccl::guard::{self, write_out, CallResult, Failure};
use mscclpp_nccl::handles::{self, Ending, Handle};
use mscclpp_nccl::{embedding, lifecycle, memory, ops};
use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;

/// Runs one function of `mscclpp.h` named `call` (the name its failures carry).
fn api(call: &str, body: impl FnOnce() -> CallResult) -> NcclResult {
    embedding::declare();
    guard::ffi(call, body)
}

/// `mscclppCollective_t`.
fn collective(c: c_int) -> CallResult<Collective> {
    Ok(match c {
        0 => Collective::AllReduce,
        1 => Collective::AllGather,
        2 => Collective::ReduceScatter,
        3 => Collective::Broadcast,
        4 => Collective::AllToAll,
        5 => Collective::Reduce,
        6 => Collective::Gather,
        7 => Collective::Scatter,
        _ => {
            return Err(Failure::invalid_argument(format!(
                "collective {c} is not an mscclppCollective_t (0..=7)"
            )))
        }
    })
}

/// Copies `name` and its NUL into the caller's `buf` of `len` bytes.
unsafe fn write_name(buf: *mut c_char, len: usize, name: &str) -> CallResult<()> {
    if buf.is_null() {
        return Err(Failure::invalid_argument(
            "name (the output buffer) is NULL",
        ));
    }
    if len <= name.len() {
        return Err(Failure::invalid_argument(format!(
            "nameBytes is {len}; {name} needs {} (MSCCLPP_MAX_NAME_BYTES always suffices)",
            name.len() + 1
        )));
    }
    // SAFETY: `buf` holds `len` > name.len() bytes, as the caller promises.
    unsafe {
        std::ptr::copy_nonoverlapping(name.as_ptr(), buf.cast::<u8>(), name.len());
        buf.add(name.len()).write(0);
    }
    Ok(())
}

fn device_index(device: c_int) -> CallResult<usize> {
    usize::try_from(device)
        .map_err(|_| Failure::invalid_argument(format!("device {device} is negative")))
}

/// The first exchange over a host's bootstrap: every rank says who it thinks it is, so a host
/// that wires ranks up wrongly is named at init rather than by a hang or wrong data later, and
/// rank 0's random secret becomes the job's identity.
fn handshake(bootstrap: &HostBootstrap) -> CallResult<JobId> {
    const MAGIC: &[u8; 8] = b"MSCCLPPB";
    let mut mine = MAGIC.to_vec();
    mine.extend((bootstrap.rank() as u32).to_le_bytes());
    mine.extend((bootstrap.size() as u32).to_le_bytes());
    mine.extend(rand::random::<[u8; SECRET_LEN]>());
    let all = bootstrap.all_gather(&mine)?;
    let word = |part: &[u8], at: usize| {
        u32::from_le_bytes(part[at..at + 4].try_into().unwrap_or_default())
    };
    for (r, part) in all.iter().enumerate() {
        if part.len() != mine.len() || &part[..8] != MAGIC {
            return Err(Failure::invalid_argument(format!(
                "rank {}: the host's allGather gave slot {r} {} bytes that are not this \
                 library's init message: the allGather does not put rank r's part at r * bytes",
                bootstrap.rank(),
                part.len()
            )));
        }
        let (rank, size) = (word(part, 8) as usize, word(part, 12) as usize);
        if (rank, size) != (r, bootstrap.size()) {
            return Err(Failure::invalid_argument(format!(
                "rank {me} of {n}: slot {r} of the host's allGather comes from a rank that \
                 says it is rank {rank} of {size}: the ranks' mscclppBootstrap descriptions \
                 disagree",
                me = bootstrap.rank(),
                n = bootstrap.size()
            )));
        }
    }
    let mut secret = [0u8; SECRET_LEN];
    secret.copy_from_slice(&all[0][16..16 + SECRET_LEN]);
    let unspecified = std::net::SocketAddr::from(([0, 0, 0, 0], 0));
    Ok(JobId::from_parts(unspecified, secret))
}

#[no_mangle]
pub unsafe extern "C" fn mscclppGetErrorString(result: NcclResult) -> *const c_char {
    guard::error_string(result).as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn mscclppGetLastError() -> *const c_char {
    std::panic::catch_unwind(guard::thread_last_error_ptr).unwrap_or(c"".as_ptr())
}

#[no_mangle]
pub unsafe extern "C" fn mscclppGetUniqueId(id: *mut UniqueId) -> NcclResult {
    api("mscclppGetUniqueId", || {
        if id.is_null() {
            return Err(Failure::invalid_argument("uniqueId is NULL"));
        }
        let job = new_job_id()?;
        unsafe { write_out(id, "uniqueId", UniqueId::from_bytes(&job.to_bytes())) }?;
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppCommInitRank(
    comm: *mut Handle,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    device: c_int,
) -> NcclResult {
    api("mscclppCommInitRank", || {
        let device = device_index(device)?;
        let job = parse_id(&id)?;
        lifecycle::start_init(
            "mscclppCommInitRank",
            comm,
            (nranks, rank),
            job,
            device,
            Options::default(),
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppCommInitBootstrap(
    comm: *mut Handle,
    bootstrap: *const HostCallbacks,
    device: c_int,
) -> NcclResult {
    api("mscclppCommInitBootstrap", || {
        if comm.is_null() {
            return Err(Failure::invalid_argument(
                "comm (the output pointer) is NULL",
            ));
        }
        if bootstrap.is_null() {
            return Err(Failure::invalid_argument("bootstrap is NULL"));
        }
        let device = device_index(device)?;
        // SAFETY: non-null, and the caller promises an mscclppBootstrap (copied: it need not
        // outlive this call, only its ctx must outlive the communicator).
        let host = HostBootstrap::new(unsafe { &*bootstrap })?;
        let job = handshake(&host)?;
        lifecycle::start_init_over(
            "mscclppCommInitBootstrap",
            comm,
            Arc::new(host),
            job,
            device,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppCommDestroy(comm: Handle) -> NcclResult {
    api("mscclppCommDestroy", || {
        if let Some(c) = handles::close(comm, Ending::Destroy)? {
            handles::retire(c);
        }
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppCommAbort(comm: Handle) -> NcclResult {
    api("mscclppCommAbort", || {
        if let Some(c) = handles::close(comm, Ending::Abort)? {
            handles::retire(c);
        }
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppCommGetAsyncError(
    comm: Handle,
    error: *mut NcclResult,
) -> NcclResult {
    api("mscclppCommGetAsyncError", || {
        let code = handles::async_error_code(comm)?;
        unsafe { write_out(error, "asyncError", code) }?;
        Ok(SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppCommRank(comm: Handle, rank: *mut c_int) -> NcclResult {
    api("mscclppCommRank", || {
        let c = handles::live(comm)?;
        unsafe { write_out(rank, "rank", c.rank as c_int) }.map(|_| SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppCommSize(comm: Handle, size: *mut c_int) -> NcclResult {
    api("mscclppCommSize", || {
        let c = handles::live(comm)?;
        unsafe { write_out(size, "size", c.nranks as c_int) }.map(|_| SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppCommRegister(
    comm: Handle,
    buff: *mut c_void,
    bytes: usize,
    handle: *mut *mut c_void,
) -> NcclResult {
    api("mscclppCommRegister", || {
        if handle.is_null() {
            return Err(Failure::invalid_argument("handle is NULL"));
        }
        let h = memory::register(comm, buff, bytes)?;
        unsafe { write_out(handle, "handle", h) }.map(|_| SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppCommDeregister(comm: Handle, handle: *mut c_void) -> NcclResult {
    api("mscclppCommDeregister", || {
        memory::deregister(comm, handle, "handle")
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppAlgorithmCount(
    comm: Handle,
    coll: c_int,
    count: *mut c_int,
) -> NcclResult {
    api("mscclppAlgorithmCount", || {
        let c = handles::live(comm)?;
        let n = c.algorithm_names(collective(coll)?).len();
        unsafe { write_out(count, "count", n as c_int) }.map(|_| SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppAlgorithmName(
    comm: Handle,
    coll: c_int,
    index: c_int,
    name: *mut c_char,
    name_bytes: usize,
) -> NcclResult {
    api("mscclppAlgorithmName", || {
        let c = handles::live(comm)?;
        let names = c.algorithm_names(collective(coll)?);
        let chosen = usize::try_from(index)
            .ok()
            .and_then(|i| names.get(i))
            .ok_or_else(|| {
                Failure::invalid_argument(format!(
                    "index {index} is not in 0..{} (mscclppAlgorithmCount)",
                    names.len()
                ))
            })?;
        unsafe { write_name(name, name_bytes, chosen) }.map(|_| SUCCESS)
    })
}

/// The arguments of one call of an algorithm, checked.
#[allow(clippy::too_many_arguments)]
fn execute_args(
    comm: &mscclpp_nccl::comm::Comm,
    (input, output): (*const c_void, *mut c_void),
    (input_bytes, output_bytes): (usize, usize),
    datatype: c_int,
    op: c_int,
    root: c_int,
    stream: *mut c_void,
    (nblocks, nthreads): (c_int, c_int),
) -> CallResult<ExecuteArgs> {
    let geometry = |n: c_int, what: &str| match n {
        0 => Ok(None),
        n if n > 0 => Ok(Some(n as u32)),
        n => Err(Failure::invalid_argument(format!(
            "{what} is {n}; 0 lets the algorithm choose, else a positive count"
        ))),
    };
    let op = ops::red_op(op)?.ok_or_else(|| {
        Failure::invalid_argument(format!("op {op} is not a built-in ncclRedOp_t (0..=4)"))
    })?;
    let root = usize::try_from(root)
        .ok()
        .filter(|&r| r < comm.nranks)
        .ok_or_else(|| {
            Failure::invalid_argument(format!("root {root} is not in 0..{}", comm.nranks))
        })?;
    Ok(ExecuteArgs {
        input: input as u64,
        output: output as u64,
        input_bytes,
        output_bytes,
        dtype: ops::dtype(datatype)?,
        op,
        accum: comm.accum,
        root,
        stream: Stream(stream as u64),
        nblocks: geometry(nblocks, "nblocks")?,
        nthreads: geometry(nthreads, "nthreads")?,
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppAlgorithmSelect(
    comm: Handle,
    coll: c_int,
    input: *const c_void,
    output: *mut c_void,
    input_bytes: usize,
    output_bytes: usize,
    datatype: c_int,
    stream: *mut c_void,
    name: *mut c_char,
    name_bytes: usize,
) -> NcclResult {
    api("mscclppAlgorithmSelect", || {
        let c = handles::live(comm)?;
        let coll = collective(coll)?;
        let args = execute_args(
            &c,
            (input, output),
            (input_bytes, output_bytes),
            datatype,
            0,
            0,
            stream,
            (0, 0),
        )?;
        let chosen = c.native(coll, &args)?;
        unsafe { write_name(name, name_bytes, chosen.name()) }.map(|_| SUCCESS)
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppAlgorithmExecute(
    comm: Handle,
    coll: c_int,
    name: *const c_char,
    input: *const c_void,
    output: *mut c_void,
    input_bytes: usize,
    output_bytes: usize,
    datatype: c_int,
    op: c_int,
    root: c_int,
    stream: *mut c_void,
    nblocks: c_int,
    nthreads: c_int,
) -> NcclResult {
    api("mscclppAlgorithmExecute", || {
        handles::operate(comm, |c| {
            let coll = collective(coll)?;
            let name = unsafe { guard::text_arg(name, "name") }?;
            let algorithm = c.algorithm_named(coll, name).ok_or_else(|| {
            Failure::invalid_argument(format!(
                "rank {} has no algorithm named {name} for {coll:?} (mscclppAlgorithmName lists them)",
                c.rank
            ))
        })?;
            let args = execute_args(
                c,
                (input, output),
                (input_bytes, output_bytes),
                datatype,
                op,
                root,
                stream,
                (nblocks, nthreads),
            )?;
            if input_bytes == 0 && output_bytes == 0 {
                return Ok(SUCCESS);
            }
            c.gpu.set_device(c.device)?;
            algorithm.check(&args)?;
            c.execute(algorithm.as_ref(), &args)?;
            Ok(SUCCESS)
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn mscclppExecutionPlanLoad(
    comm: Handle,
    path: *const c_char,
    name: *mut c_char,
    name_bytes: usize,
) -> NcclResult {
    api("mscclppExecutionPlanLoad", || {
        handles::operate(comm, |c| {
            let path = std::path::Path::new(unsafe { guard::text_arg(path, "path") }?);
            if !path.is_file() {
                return Err(Failure::invalid_argument(format!(
                    "{} is not a file (one execution plan, JSON)",
                    path.display()
                )));
            }
            let plan = mscclpp_executor::load::load_plans(path)?
                .pop()
                .ok_or_else(|| {
                    Failure::invalid_argument(format!("{} holds no plan", path.display()))
                })?;
            c.gpu.set_device(c.device)?;
            let algorithm: Arc<dyn Algorithm> = Arc::new(
                mscclpp_executor::algorithm::PlanAlgorithm::new(c.communicator.clone(), plan)?,
            );
            let loaded = algorithm.name().to_string();
            c.add_loaded(algorithm)?;
            if name.is_null() {
                return Ok(SUCCESS);
            }
            unsafe { write_name(name, name_bytes, &loaded) }.map(|_| SUCCESS)
        })
    })
}
