//! Collectives, point-to-point and groups. Each call runs natively when a native algorithm takes
//! it (all-reduce, all-gather, reduce-scatter, broadcast, reduce: every NCCL type and built-in op;
//! all-to-all, gather, scatter; send and receive through the point-to-point engine), else through
//! the real NCCL, else fails with the reason for both (docs/nccl-shim.md has the table). Everything
//! is enqueued on the
//! caller's stream without host synchronisation, so it can be captured in a CUDA graph.

use crate::abi::*;
use crate::comm::{Comm, Fallback};
use crate::fallback::{RawComm, RawStream, RealNccl};
use crate::group;
use crate::guard::{ffi, CallResult, Failure};
use crate::handles::{self, Handle};
use mscclpp::core::gpu::Stream;
use mscclpp::core::{Collective, DataType, ExecuteArgs, ReduceOp};
use mscclpp_collectives::p2p::{P2pKind, P2pOp};
use std::ffi::{c_int, c_void};
use std::sync::Arc;

type FallbackCall<'a> = Box<dyn FnOnce(&RealNccl, RawComm) -> NcclResult + 'a>;

pub fn dtype(d: c_int) -> CallResult<DataType> {
    DataType::from_nccl(d).map_err(|e| Failure::invalid_argument(e.to_string()))
}

/// A built-in op, `None` for a PreMulSum op (made by the real NCCL), an error for anything else.
pub fn red_op(op: c_int) -> CallResult<Option<ReduceOp>> {
    if op < 0 {
        return Err(Failure::invalid_argument(format!(
            "ncclRedOp_t {op} is not an operator"
        )));
    }
    if op >= NUM_BUILTIN_OPS {
        return Ok(None);
    }
    ReduceOp::from_nccl(op)
        .map(Some)
        .map_err(|e| Failure::invalid_argument(e.to_string()))
}

fn bytes(count: usize, dtype: DataType, times: usize) -> CallResult<usize> {
    count
        .checked_mul(dtype.size())
        .and_then(|b| b.checked_mul(times))
        .ok_or_else(|| Failure::invalid_argument(format!("count {count} of {dtype} overflows")))
}

fn check_rank(comm: &Comm, what: &str, r: c_int) -> CallResult<usize> {
    if r < 0 || r as usize >= comm.nranks {
        return Err(Failure::invalid_argument(format!(
            "{what} {r} is not a rank of this communicator (0..{})",
            comm.nranks
        )));
    }
    Ok(r as usize)
}

/// What a call asks for natively: the collective and its arguments, or why it has no native path.
enum Native {
    Run(Collective, ExecuteArgs),
    None(String),
}

fn args(
    comm: &Comm,
    (input, output): (*const c_void, *mut c_void),
    sizes: (usize, usize),
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    stream: *mut c_void,
) -> ExecuteArgs {
    ExecuteArgs {
        input: input as u64,
        output: output as u64,
        input_bytes: sizes.0,
        output_bytes: sizes.1,
        dtype,
        op,
        accum: comm.accum,
        root,
        stream: Stream(stream as u64),
        nblocks: None,
        nthreads: None,
    }
}

/// Runs one operation on `comm`: natively, or through the fallback, or fails naming both reasons.
fn submit(
    comm: &Arc<Comm>,
    operation: &str,
    native: Native,
    fallback: FallbackCall<'_>,
) -> CallResult {
    let reason = if comm.forced(operation) {
        format!("MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION sends {operation} to the real NCCL")
    } else {
        match native {
            Native::Run(collective, args) => match comm.native(collective, &args) {
                Ok(algorithm) => {
                    if group::active() {
                        group::defer_op(comm.clone(), group::Op::Collective(algorithm, args));
                    } else {
                        comm.execute(algorithm.as_ref(), &args)?;
                    }
                    return Ok(SUCCESS);
                }
                Err(e) => format!("mscclpp-rs cannot run it ({e})"),
            },
            Native::None(why) => why,
        }
    };
    match &comm.fallback {
        Fallback::Ready { real, comm: raw } => {
            if group::active() {
                group::join_real(real, comm)?;
            }
            let code = fallback(real, *raw);
            real.check(operation, code, *raw)
        }
        Fallback::Missing(why) => Err(Failure::invalid_usage(format!(
            "{operation} on rank {}: {reason}; and no fallback to the real NCCL: {why}",
            comm.rank
        ))),
    }
}

fn stream_of(s: *mut c_void) -> RawStream {
    s
}

nccl_export! {
    fn ncclAllReduce / pncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: Handle, stream: *mut c_void) -> NcclResult {
        ffi("ncclAllReduce", || handles::operate(comm, |c| {
            let t = dtype(datatype)?;
            let native = match red_op(op)? {
                Some(o) => { let b = bytes(count, t, 1)?; Native::Run(Collective::AllReduce, args(c, (sendbuff, recvbuff), (b, b), t, o, 0, stream)) }
                None => Native::None("PreMulSum runs only in the real NCCL".into()),
            };
            if count == 0 { return Ok(SUCCESS); }
            submit(c, "allreduce", native, Box::new(|r, rc| unsafe { (r.all_reduce)(sendbuff, recvbuff, count, datatype, op, rc, stream_of(stream)) }))
        }))
    }
}

nccl_export! {
    fn ncclAllGather / pncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: c_int, comm: Handle, stream: *mut c_void) -> NcclResult {
        ffi("ncclAllGather", || handles::operate(comm, |c| {
            let t = dtype(datatype)?;
            let b = bytes(sendcount, t, 1)?;
            let out = bytes(sendcount, t, c.nranks)?;
            if sendcount == 0 { return Ok(SUCCESS); }
            let native = Native::Run(Collective::AllGather, args(c, (sendbuff, recvbuff), (b, out), t, ReduceOp::Sum, 0, stream));
            submit(c, "allgather", native, Box::new(|r, rc| unsafe { (r.all_gather)(sendbuff, recvbuff, sendcount, datatype, rc, stream_of(stream)) }))
        }))
    }
}

nccl_export! {
    fn ncclReduceScatter / pncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: c_int, op: c_int, comm: Handle, stream: *mut c_void) -> NcclResult {
        ffi("ncclReduceScatter", || handles::operate(comm, |c| {
            let t = dtype(datatype)?;
            let native = match red_op(op)? {
                Some(o) => Native::Run(Collective::ReduceScatter, args(c, (sendbuff, recvbuff), (bytes(recvcount, t, c.nranks)?, bytes(recvcount, t, 1)?), t, o, 0, stream)),
                None => Native::None("PreMulSum runs only in the real NCCL".into()),
            };
            if recvcount == 0 { return Ok(SUCCESS); }
            submit(c, "reducescatter", native, Box::new(|r, rc| unsafe { (r.reduce_scatter)(sendbuff, recvbuff, recvcount, datatype, op, rc, stream_of(stream)) }))
        }))
    }
}

nccl_export! {
    fn ncclBroadcast / pncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Handle, stream: *mut c_void) -> NcclResult {
        ffi("ncclBroadcast", || handles::operate(comm, |c| {
            let t = dtype(datatype)?;
            let rt = check_rank(c, "root", root)?;
            let b = bytes(count, t, 1)?;
            if count == 0 { return Ok(SUCCESS); }
            let native = Native::Run(Collective::Broadcast, args(c, (sendbuff, recvbuff), (b, b), t, ReduceOp::Sum, rt, stream));
            submit(c, "broadcast", native, Box::new(|r, rc| unsafe { (r.broadcast)(sendbuff, recvbuff, count, datatype, root, rc, stream_of(stream)) }))
        }))
    }
}

nccl_export! {
    fn ncclBcast / pncclBcast(buff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Handle, stream: *mut c_void) -> NcclResult {
        unsafe { ncclBroadcast(buff, buff, count, datatype, root, comm, stream) }
    }
}

nccl_export! {
    fn ncclReduce / pncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, root: c_int, comm: Handle, stream: *mut c_void) -> NcclResult {
        ffi("ncclReduce", || handles::operate(comm, |c| {
            let t = dtype(datatype)?;
            let rt = check_rank(c, "root", root)?;
            let native = match red_op(op)? {
                // Only the root writes: recvbuff is ignored elsewhere, as in NCCL.
                Some(o) => { let b = bytes(count, t, 1)?; Native::Run(Collective::Reduce, args(c, (sendbuff, recvbuff), (b, b), t, o, rt, stream)) }
                None => Native::None("PreMulSum runs only in the real NCCL".into()),
            };
            if count == 0 { return Ok(SUCCESS); }
            submit(c, "reduce", native,
                Box::new(|r, rc| unsafe { (r.reduce)(sendbuff, recvbuff, count, datatype, op, root, rc, stream_of(stream)) }))
        }))
    }
}

/// One send or receive: natively through the communicator's point-to-point engine (deferred to
/// the outermost ncclGroupEnd inside a group, else a group of one), or through the fallback when
/// `MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION` names it or the engine is unavailable.
fn p2p(
    c: &Arc<Comm>,
    operation: &str,
    op: P2pOp,
    stream: *mut c_void,
    fallback: FallbackCall<'_>,
) -> CallResult {
    let unavailable = c.p2p_unavailable();
    if unavailable.is_none() && !c.forced(operation) {
        let stream = Stream(stream as u64);
        if group::active() {
            group::defer_p2p(c.clone(), stream, op);
        } else {
            c.run_p2p(&[op], stream)?;
        }
        return Ok(SUCCESS);
    }
    let why = unavailable.map_or_else(String::new, |w| format!("no point-to-point engine ({w})"));
    submit(c, operation, Native::None(why), fallback)
}

nccl_export! {
    fn ncclSend / pncclSend(sendbuff: *const c_void, count: usize, datatype: c_int, peer: c_int, comm: Handle, stream: *mut c_void) -> NcclResult {
        ffi("ncclSend", || handles::operate(comm, |c| {
            let b = bytes(count, dtype(datatype)?, 1)?;
            let p = check_rank(c, "peer", peer)?;
            let op = P2pOp { kind: P2pKind::Send, peer: p, ptr: sendbuff as u64, bytes: b };
            p2p(c, "send", op, stream,
                Box::new(|r, rc| unsafe { (r.send)(sendbuff, count, datatype, peer, rc, stream_of(stream)) }))
        }))
    }
}

nccl_export! {
    fn ncclRecv / pncclRecv(recvbuff: *mut c_void, count: usize, datatype: c_int, peer: c_int, comm: Handle, stream: *mut c_void) -> NcclResult {
        ffi("ncclRecv", || handles::operate(comm, |c| {
            let b = bytes(count, dtype(datatype)?, 1)?;
            let p = check_rank(c, "peer", peer)?;
            let op = P2pOp { kind: P2pKind::Recv, peer: p, ptr: recvbuff as u64, bytes: b };
            p2p(c, "recv", op, stream,
                Box::new(|r, rc| unsafe { (r.recv)(recvbuff, count, datatype, peer, rc, stream_of(stream)) }))
        }))
    }
}

/// The buffers, element count and type, and stream of one exchange through the real NCCL.
#[derive(Clone, Copy)]
struct Exchange {
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    stream: *mut c_void,
}

/// All-to-all, gather and scatter through the real NCCL, as one real group of sends and
/// receives (so any NCCL from 2.7 on serves them, not only 2.28's own versions).
/// `sends`/`recvs`: (peer, byte offset) pairs.
fn exchange(
    real: &RealNccl,
    rc: RawComm,
    x: &Exchange,
    sends: &[(c_int, usize)],
    recvs: &[(c_int, usize)],
) -> NcclResult {
    let Exchange {
        sendbuff,
        recvbuff,
        count,
        datatype,
        stream,
    } = *x;
    // SAFETY: the documented prototypes; offsets stay inside the caller's buffers by NCCL's contract.
    unsafe {
        let code = (real.group_start)();
        if code != SUCCESS {
            return code;
        }
        for &(peer, off) in sends {
            let code = (real.send)(
                (sendbuff as *const u8).add(off).cast(),
                count,
                datatype,
                peer,
                rc,
                stream,
            );
            if code != SUCCESS {
                (real.group_end)();
                return code;
            }
        }
        for &(peer, off) in recvs {
            let code = (real.recv)(
                (recvbuff as *mut u8).add(off).cast(),
                count,
                datatype,
                peer,
                rc,
                stream,
            );
            if code != SUCCESS {
                (real.group_end)();
                return code;
            }
        }
        (real.group_end)()
    }
}

nccl_export! {
    fn ncclAlltoAll / pncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, comm: Handle, stream: *mut c_void) -> NcclResult {
        ffi("ncclAlltoAll", || handles::operate(comm, |c| {
            let t = dtype(datatype)?;
            let chunk = bytes(count, t, 1)?;
            let total = bytes(count, t, c.nranks)?;
            if count == 0 { return Ok(SUCCESS); }
            let pairs: Vec<(c_int, usize)> = (0..c.nranks).map(|p| (p as c_int, p * chunk)).collect();
            let native = Native::Run(Collective::AllToAll, args(c, (sendbuff, recvbuff), (total, total), t, ReduceOp::Sum, 0, stream));
            let in_place = sendbuff == recvbuff.cast_const();
            if let Fallback::Ready { real, .. } = &c.fallback {
                if in_place && real.alltoall.is_none() && c.forced("alltoall") {
                    return Err(Failure::invalid_usage(format!(
                        "alltoall on rank {}: MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION sends it to the real NCCL, whose library ({}) has no ncclAlltoAll to run it in place (a group of sends and receives on one buffer cannot)",
                        c.rank, real.location)));
                }
            }
            submit(c, "alltoall", native,
                Box::new(move |r, rc| match (in_place, r.alltoall) {
                    // A group of sends and receives on one buffer would let a peer's chunk land
                    // before this rank's chunk for it was sent: the real ncclAlltoAll, or nothing.
                    // SAFETY: the documented prototype; the caller's buffers and stream.
                    (true, Some(alltoall)) => unsafe { alltoall(sendbuff, recvbuff, count, datatype, rc, stream_of(stream)) },
                    // Only where no native algorithm took it either (beyond the all-to-all stage).
                    (true, None) => INVALID_USAGE,
                    (false, _) => exchange(r, rc, &Exchange { sendbuff, recvbuff, count, datatype, stream }, &pairs, &pairs),
                }))
        }))
    }
}

nccl_export! {
    fn ncclGather / pncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Handle, stream: *mut c_void) -> NcclResult {
        ffi("ncclGather", || handles::operate(comm, |c| {
            let t = dtype(datatype)?;
            let rt = check_rank(c, "root", root)?;
            let chunk = bytes(count, t, 1)?;
            let total = bytes(count, t, c.nranks)?;
            if count == 0 { return Ok(SUCCESS); }
            let recvs: Vec<(c_int, usize)> = if c.rank == rt { (0..c.nranks).map(|p| (p as c_int, p * chunk)).collect() } else { Vec::new() };
            let native = Native::Run(Collective::Gather, args(c, (sendbuff, recvbuff), (chunk, total), t, ReduceOp::Sum, rt, stream));
            submit(c, "gather", native,
                Box::new(move |r, rc| exchange(r, rc, &Exchange { sendbuff, recvbuff, count, datatype, stream }, &[(root, 0)], &recvs)))
        }))
    }
}

nccl_export! {
    fn ncclScatter / pncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Handle, stream: *mut c_void) -> NcclResult {
        ffi("ncclScatter", || handles::operate(comm, |c| {
            let t = dtype(datatype)?;
            let rt = check_rank(c, "root", root)?;
            let chunk = bytes(count, t, 1)?;
            let total = bytes(count, t, c.nranks)?;
            if count == 0 { return Ok(SUCCESS); }
            let sends: Vec<(c_int, usize)> = if c.rank == rt { (0..c.nranks).map(|p| (p as c_int, p * chunk)).collect() } else { Vec::new() };
            let native = Native::Run(Collective::Scatter, args(c, (sendbuff, recvbuff), (total, chunk), t, ReduceOp::Sum, rt, stream));
            submit(c, "scatter", native,
                Box::new(move |r, rc| exchange(r, rc, &Exchange { sendbuff, recvbuff, count, datatype, stream }, &sends, &[(root, 0)])))
        }))
    }
}

nccl_export! {
    fn ncclGroupStart / pncclGroupStart() -> NcclResult {
        ffi("ncclGroupStart", || { group::start(); Ok(SUCCESS) })
    }
}

nccl_export! {
    fn ncclGroupEnd / pncclGroupEnd() -> NcclResult {
        ffi("ncclGroupEnd", group::end)
    }
}

nccl_export! {
    fn ncclGroupSimulateEnd / pncclGroupSimulateEnd(sim_info: *mut SimInfo) -> NcclResult {
        ffi("ncclGroupSimulateEnd", || {
            if sim_info.is_null() {
                return Err(Failure::invalid_argument("simInfo is NULL"));
            }
            // SAFETY: non-null; the header fields come first in every version.
            let magic = unsafe { (*sim_info).magic };
            if magic != SIM_INFO_MAGIC {
                return Err(Failure::invalid_argument(format!(
                    "ncclSimInfo_t has magic {magic:#x}, expected {SIM_INFO_MAGIC:#x}: initialise it with NCCL_SIM_INFO_INITIALIZER"
                )));
            }
            let code = group::simulate_end()?;
            // SAFETY: as above; estimatedTime is part of every version's layout.
            unsafe { (*sim_info).estimated_time = -1.0 };
            Ok(code)
        })
    }
}
