//! ncclGroupStart/End: calls between them (nested to any depth) are collected per thread and
//! launched at the outermost End. Grouped inits run together (one thread may init several ranks
//! of one job); grouped native operations run per communicator, each communicator's on its own
//! thread when the group spans several (one thread driving several ranks: the first call on a new
//! buffer exchanges its registration with the peers); sends and receives are collected per
//! (communicator, stream) and run as one point-to-point group each, after that communicator's
//! other operations; fallback operations go into one real NCCL group opened at the first of them.

use crate::abi::{NcclResult, SUCCESS};
use crate::comm::Comm;
use crate::fallback::RealNccl;
use crate::guard::{CallResult, Failure};
use mscclpp::core::gpu::Stream;
use mscclpp_collectives::p2p::P2pOp;
use std::cell::RefCell;
use std::sync::Arc;

/// A grouped init: runs it and says how it ended.
pub type Job = Box<dyn FnOnce() -> CallResult<()> + Send>;
pub type Op = Box<dyn FnOnce() -> mscclpp::Result<()> + Send>;

#[derive(Default)]
struct Group {
    depth: u32,
    inits: Vec<Job>,
    ops: Vec<(Arc<Comm>, Op)>,
    p2p: Vec<(Arc<Comm>, Stream, Vec<P2pOp>)>,
    real: Option<Arc<RealNccl>>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

pub fn active() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

pub fn start() {
    GROUP.with(|g| g.borrow_mut().depth += 1);
}

pub fn defer_init(job: Job) {
    GROUP.with(|g| g.borrow_mut().inits.push(job));
}

pub fn defer_op(comm: Arc<Comm>, op: Op) {
    GROUP.with(|g| g.borrow_mut().ops.push((comm, op)));
}

/// Adds a send or receive to the group of (`comm`, `stream`), in call order.
pub fn defer_p2p(comm: Arc<Comm>, stream: Stream, op: P2pOp) {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        match g
            .p2p
            .iter_mut()
            .find(|(c, s, _)| Arc::ptr_eq(c, &comm) && *s == stream)
        {
            Some((_, _, list)) => list.push(op),
            None => g.p2p.push((comm, stream, vec![op])),
        }
    });
}

/// Opens the real NCCL's group for this group's fallback calls, once.
pub fn join_real(real: &Arc<RealNccl>) -> CallResult<()> {
    if GROUP.with(|g| g.borrow().real.is_some()) {
        return Ok(());
    }
    // SAFETY: no arguments.
    let code = unsafe { (real.group_start)() };
    real.check("ncclGroupStart", code, std::ptr::null_mut())?;
    GROUP.with(|g| g.borrow_mut().real = Some(real.clone()));
    Ok(())
}

/// Closes one level; at the outermost, hands back what the group collected.
fn close(call: &str) -> CallResult<Option<Group>> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Failure::invalid_usage(format!(
                "{call} without a matching ncclGroupStart"
            )));
        }
        g.depth -= 1;
        Ok((g.depth == 0).then(|| std::mem::take(&mut *g)))
    })
}

fn run_ops(ops: Vec<(Arc<Comm>, Op)>) -> mscclpp::Result<()> {
    let mut per_comm: Vec<(Arc<Comm>, Vec<Op>)> = Vec::new();
    for (comm, op) in ops {
        match per_comm.iter_mut().find(|(c, _)| Arc::ptr_eq(c, &comm)) {
            Some((_, list)) => list.push(op),
            None => per_comm.push((comm, vec![op])),
        }
    }
    let run = |comm: &Comm, list: Vec<Op>| -> mscclpp::Result<()> {
        comm.gpu.set_device(comm.device)?;
        list.into_iter().try_for_each(|op| op())
    };
    if per_comm.len() <= 1 {
        return per_comm
            .into_iter()
            .try_for_each(|(comm, list)| run(&comm, list));
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = per_comm
            .into_iter()
            .map(|(comm, list)| s.spawn(move || run(&comm, list)))
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join().unwrap_or_else(|_| {
                Err(mscclpp::Error::Internal(
                    "a grouped operation panicked".into(),
                ))
            })
        })
    })
}

/// Runs the grouped inits together (they meet each other in the bootstrap); the first failure.
fn run_inits(inits: Vec<Job>) -> CallResult<()> {
    std::thread::scope(|s| {
        let joins: Vec<_> = inits.into_iter().map(|job| s.spawn(job)).collect();
        let results: Vec<CallResult<()>> = joins
            .into_iter()
            .map(|j| {
                j.join().unwrap_or_else(|_| {
                    Err(Failure::new(
                        crate::abi::INTERNAL_ERROR,
                        "a grouped init panicked",
                    ))
                })
            })
            .collect();
        results.into_iter().collect()
    })
}

/// ncclGroupEnd.
pub fn end() -> CallResult {
    let Some(group) = close("ncclGroupEnd")? else {
        return Ok(SUCCESS);
    };
    let inits = run_inits(group.inits);
    let mut ops = group.ops;
    for (comm, stream, list) in group.p2p {
        let c = comm.clone();
        ops.push((comm, Box::new(move || c.run_p2p(&list, stream))));
    }
    let native = run_ops(ops);
    let real = match &group.real {
        // SAFETY: no arguments.
        Some(real) => real.check(
            "ncclGroupEnd",
            unsafe { (real.group_end)() },
            std::ptr::null_mut(),
        ),
        None => Ok(SUCCESS),
    };
    inits?;
    native?;
    real
}

/// ncclGroupSimulateEnd: closes the group without launching its operations. Inits still run (a
/// handle handed out must become usable). There is no cost model, so the estimate stays
/// NCCL_UNDEF_FLOAT.
pub fn simulate_end() -> CallResult<NcclResult> {
    let Some(group) = close("ncclGroupSimulateEnd")? else {
        return Ok(SUCCESS);
    };
    run_inits(group.inits)?;
    if let Some(real) = &group.real {
        // The real group holds fallback calls already issued; NCCL's simulate discards them too.
        // SAFETY: a null sim info is refused by NCCL, so pass a valid one.
        let mut info = crate::abi::SimInfo {
            size: std::mem::size_of::<crate::abi::SimInfo>(),
            magic: crate::abi::SIM_INFO_MAGIC,
            version: crate::abi::NCCL_VERSION_CODE as u32,
            estimated_time: -1.0,
        };
        let code = unsafe { (real.group_simulate_end)(&mut info) };
        real.check("ncclGroupSimulateEnd", code, std::ptr::null_mut())?;
    }
    Ok(SUCCESS)
}
