//! ncclGroupStart/End: calls between them (nested to any depth) are collected per thread and
//! launched at the outermost End. Grouped inits run together (one thread may init several ranks
//! of one job); grouped native operations run per communicator, each communicator's on its own
//! thread when the group spans several (one thread driving several ranks: the first call on a new
//! buffer exchanges its registration with the peers); sends and receives are collected per
//! (communicator, stream) and run as one point-to-point group each, after that communicator's
//! other operations; fallback operations go into one real NCCL group opened at the first of them.
//!
//! Several communicators of one group share this process's CUDA context, so their operations run
//! in two passes: every communicator first prepares all its operations (`Algorithm::prepare`:
//! checks, kernel compiles and loads), and only once all are prepared does any launch. Loading a
//! kernel may synchronize the context (CUDA lazy loading); done while another rank's kernel waits
//! for this rank, it would wait for that kernel, which then fails on its device timeout with
//! nothing from us. If any communicator fails to prepare, none launches (its peers' kernels
//! would wait for it in vain) and the group reports that failure.

use crate::abi::{NcclResult, SUCCESS};
use crate::comm::Comm;
use crate::fallback::RealNccl;
use crate::guard::{CallResult, Failure};
use mscclpp::core::gpu::Stream;
use mscclpp::core::{Algorithm, ExecuteArgs};
use mscclpp_collectives::p2p::P2pOp;
use std::cell::RefCell;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// A grouped init: runs it and says how it ended.
pub type Job = Box<dyn FnOnce() -> CallResult<()> + Send>;

/// A grouped native operation.
pub enum Op {
    Collective(Arc<dyn Algorithm>, ExecuteArgs),
    /// One point-to-point group of a (communicator, stream).
    PointToPoint(Vec<P2pOp>, Stream),
}

impl Op {
    fn prepare(&self, comm: &Comm) -> mscclpp::Result<()> {
        match self {
            Op::Collective(algorithm, args) => algorithm.prepare(args),
            Op::PointToPoint(..) => comm.prepare_p2p(),
        }
    }

    fn launch(self, comm: &Comm) -> mscclpp::Result<()> {
        match self {
            Op::Collective(algorithm, args) => algorithm.execute(&args),
            Op::PointToPoint(list, stream) => comm.run_p2p(&list, stream),
        }
    }
}

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
    prepare_all_then_launch(
        per_comm,
        |(comm, list)| {
            comm.gpu.set_device(comm.device)?;
            list.iter().try_for_each(|op| op.prepare(comm))
        },
        |(comm, list)| {
            comm.gpu.set_device(comm.device)?;
            let started = Instant::now();
            let launched = list.into_iter().try_for_each(|op| op.launch(&comm));
            note_slow_launch(comm.rank, started.elapsed());
            launched
        },
    )
}

/// A grouped launch that takes longer than this is logged: a launch costs microseconds, so one
/// this slow was held up by host or driver work while its peers' kernels already waited for it.
const SLOW_LAUNCH: Duration = Duration::from_secs(1);

/// Logs a launch of one communicator's grouped operations that took `took` (see
/// [`SLOW_LAUNCH`]): what a device timeout on its peers then points to.
fn note_slow_launch(rank: usize, took: Duration) {
    if took > SLOW_LAUNCH {
        tracing::warn!(
            target: "mscclpp::nccl",
            "rank {rank}: launching its grouped operations took {took:.1?}; its peers' kernels \
             waited for it meanwhile (beyond MSCCLPP_DEVICE_WAIT_TIMEOUT they fail)"
        );
    }
}

/// Runs `prepare` on every part, then `launch` on every part, each part on its own thread when
/// there are several; no part launches before every part is prepared, and none launches if any
/// failed to prepare (that failure is the result). Every thread passes the barrier exactly once,
/// whatever its preparation did (a panic included), so none waits for a thread that left.
fn prepare_all_then_launch<T: Send>(
    parts: Vec<T>,
    prepare: impl Fn(&T) -> mscclpp::Result<()> + Sync,
    launch: impl Fn(T) -> mscclpp::Result<()> + Sync,
) -> mscclpp::Result<()> {
    if parts.len() <= 1 {
        return parts.into_iter().try_for_each(|part| {
            prepare(&part)?;
            launch(part)
        });
    }
    let prepared = Barrier::new(parts.len());
    let failed = AtomicBool::new(false);
    let (prepare, launch) = (&prepare, &launch);
    std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .into_iter()
            .map(|part| {
                let (prepared, failed) = (&prepared, &failed);
                s.spawn(move || {
                    let ready = std::panic::catch_unwind(AssertUnwindSafe(|| prepare(&part)))
                        .unwrap_or_else(|_| {
                            Err(mscclpp::Error::Internal(
                                "preparing a grouped operation panicked".into(),
                            ))
                        });
                    if ready.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    prepared.wait();
                    ready?;
                    if failed.load(Ordering::SeqCst) {
                        // Another part's failure is the one the group reports.
                        return Ok(());
                    }
                    launch(part)
                })
            })
            .collect();
        // Every thread is joined (none left running) before the first error is returned.
        let results: Vec<mscclpp::Result<()>> = handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(mscclpp::Error::Internal(
                        "a grouped operation panicked".into(),
                    ))
                })
            })
            .collect();
        results.into_iter().collect()
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
        ops.push((comm, Op::PointToPoint(list, stream)));
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// What ncclGroupEnd over ncclCommInitAll's communicators relies on: no communicator launches
    /// while another still prepares (loads kernels, which may synchronize the shared context).
    #[test]
    fn every_part_is_prepared_before_any_launches() {
        let events = Mutex::new(Vec::new());
        let result = prepare_all_then_launch(
            (0..4).collect(),
            |r: &usize| {
                // The last rank prepares slowest, as a rank compiling a kernel would.
                std::thread::sleep(std::time::Duration::from_millis(if *r == 3 {
                    50
                } else {
                    0
                }));
                events.lock().unwrap().push(("prepare", *r));
                Ok(())
            },
            |r| {
                events.lock().unwrap().push(("launch", r));
                Ok(())
            },
        );
        assert!(result.is_ok());
        let events = events.into_inner().unwrap();
        assert_eq!(events.len(), 8);
        assert!(
            events[..4].iter().all(|(what, _)| *what == "prepare"),
            "{events:?}"
        );
        assert!(
            events[4..].iter().all(|(what, _)| *what == "launch"),
            "{events:?}"
        );
    }

    /// A rank that cannot prepare (or panics doing so) stops every launch, and its error is the
    /// group's: its peers' kernels would otherwise wait for it until their device timeout.
    #[test]
    fn a_failed_preparation_launches_nothing_and_is_reported() {
        for panics in [false, true] {
            let launched = Mutex::new(Vec::new());
            let result = prepare_all_then_launch(
                (0..4).collect(),
                |r: &usize| match (*r, panics) {
                    (1, false) => Err(mscclpp::Error::InvalidArgument("rank 1 refused".into())),
                    (1, true) => panic!("rank 1 panicked"),
                    _ => Ok(()),
                },
                |r| {
                    launched.lock().unwrap().push(r);
                    Ok(())
                },
            );
            let e = result.unwrap_err().to_string();
            let want = if panics { "panicked" } else { "rank 1 refused" };
            assert!(e.contains(want), "{e}");
            assert!(launched.into_inner().unwrap().is_empty());
        }
    }

    #[test]
    fn one_part_runs_on_the_calling_thread() {
        let caller = std::thread::current().id();
        let result = prepare_all_then_launch(
            vec![0],
            |_| {
                assert_eq!(std::thread::current().id(), caller);
                Ok(())
            },
            |_| Ok(()),
        );
        assert!(result.is_ok());
    }
}
