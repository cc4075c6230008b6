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
//!
//! The launches go in lock step (`MSCCLPP_NCCL_GROUP_LOCKSTEP`, on by default): every
//! communicator launches its first operation, and only once all have does any launch its second,
//! and so on. Without it, one communicator's thread could launch its all-reduce and then its
//! all-gather before a peer's thread launched its all-reduce. The all-gather, which cannot start
//! before its own all-reduce ends, then sits ahead of the peer's all-reduce in whatever the
//! streams share on the way to the GPU (the driver's launch path, its hardware queues: which of
//! them was not established) and can hold it back, while its own all-reduce, which it waits
//! for, waits for that one: a cycle that only the device wait timeout ends.
//! In lock step every kernel a launch depends on (the same call on the peers, the earlier calls on
//! its stream) was launched before it, so nothing queued can stand in front of a kernel it waits
//! for. Seen with ncclCommInitAll over one GPU at 4 ranks: `default_allreduce_packet` then
//! `default_allgather_packet` in one group timed out on every rank, while the same all-reduce
//! followed by `default_allgather_fullmesh2` (whose registration meets every peer's thread before
//! it launches: in lock step by accident) passed.

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
    /// What the launch trace calls it: the algorithm's name, or the point-to-point group.
    fn name(&self) -> &str {
        match self {
            Op::Collective(algorithm, _) => algorithm.name(),
            Op::PointToPoint(..) => "send/recv group",
        }
    }

    fn stream(&self) -> Stream {
        match self {
            Op::Collective(_, args) => args.stream,
            Op::PointToPoint(_, stream) => *stream,
        }
    }

    fn prepare(&self, comm: &Comm) -> mscclpp::Result<()> {
        match self {
            Op::Collective(algorithm, args) => algorithm.prepare(args),
            Op::PointToPoint(..) => comm.prepare_p2p(),
        }
    }

    fn launch(self, comm: &Comm) -> mscclpp::Result<()> {
        match self {
            Op::Collective(algorithm, args) => comm.execute(algorithm.as_ref(), &args),
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
    /// Communicators with calls in the real NCCL's group: held until its ncclGroupEnd, so a
    /// destroy or abort from another thread cannot free their real communicators under it.
    held: Vec<Arc<Comm>>,
}

/// This thread's group. A thread that ends with a group open (no ncclGroupEnd) leaks what the
/// group collected instead of dropping it in its thread-local destructor: the last reference to
/// a communicator would tear it down there (driver calls, a barrier with the peers), while other
/// thread-locals are already gone, maybe at the process's exit.
struct ThreadGroup(RefCell<Group>);

impl Drop for ThreadGroup {
    fn drop(&mut self) {
        let group = std::mem::take(self.0.get_mut());
        if group.depth > 0
            || !group.ops.is_empty()
            || !group.p2p.is_empty()
            || !group.inits.is_empty()
            || !group.held.is_empty()
        {
            std::mem::forget(group);
        }
    }
}

thread_local! {
    static GROUP: ThreadGroup = ThreadGroup(RefCell::new(Group::default()));
}

pub fn active() -> bool {
    GROUP.with(|g| g.0.borrow().depth > 0)
}

pub fn start() {
    GROUP.with(|g| g.0.borrow_mut().depth += 1);
}

pub fn defer_init(job: Job) {
    GROUP.with(|g| g.0.borrow_mut().inits.push(job));
}

pub fn defer_op(comm: Arc<Comm>, op: Op) {
    GROUP.with(|g| g.0.borrow_mut().ops.push((comm, op)));
}

/// Adds a send or receive to the group of (`comm`, `stream`), in call order.
pub fn defer_p2p(comm: Arc<Comm>, stream: Stream, op: P2pOp) {
    GROUP.with(|g| {
        let mut g = g.0.borrow_mut();
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

/// Opens the real NCCL's group for this group's fallback calls, once, and holds `comm` (whose
/// real communicator a call is about to use) until the group ends.
pub fn join_real(real: &Arc<RealNccl>, comm: &Arc<Comm>) -> CallResult<()> {
    GROUP.with(|g| {
        let mut g = g.0.borrow_mut();
        if !g.held.iter().any(|c| Arc::ptr_eq(c, comm)) {
            g.held.push(comm.clone());
        }
    });
    if GROUP.with(|g| g.0.borrow().real.is_some()) {
        return Ok(());
    }
    // SAFETY: no arguments.
    let code = unsafe { (real.group_start)() };
    real.check("ncclGroupStart", code, std::ptr::null_mut())?;
    GROUP.with(|g| g.0.borrow_mut().real = Some(real.clone()));
    Ok(())
}

/// Closes one level; at the outermost, hands back what the group collected.
fn close(call: &str) -> CallResult<Option<Group>> {
    GROUP.with(|g| {
        let mut g = g.0.borrow_mut();
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
    let lockstep = mscclpp::core::env::Env::get()?.nccl_group_lockstep;
    let group_start = Instant::now();
    prepare_all_then_launch(
        per_comm,
        lockstep,
        |comm, list| {
            comm.gpu.set_device(comm.device)?;
            list.iter().try_for_each(|op| op.prepare(comm))
        },
        |comm, round, op| {
            comm.gpu.set_device(comm.device)?;
            // The launch order across communicators is what a device timeout of a multi-rank
            // group turns on (see the module docs): MSCCLPP_LOG_LEVEL=DEBUG shows it.
            let traced = tracing::enabled!(target: "mscclpp::nccl", tracing::Level::DEBUG)
                .then(|| (op.name().to_string(), op.stream()));
            let started = Instant::now();
            let launched = op.launch(comm);
            let took = started.elapsed();
            if let Some((name, stream)) = traced {
                tracing::debug!(
                    target: "mscclpp::nccl",
                    "rank {}: operation {round} ({name}, stream {:#x}) launched at +{:?} in \
                     {took:?}{}",
                    comm.rank,
                    stream.0,
                    started - group_start,
                    if launched.is_ok() { "" } else { " (failed)" }
                );
            }
            note_slow_launch(comm.rank, took);
            launched
        },
    )
}

/// A grouped launch that takes longer than this is logged: a launch costs microseconds, so one
/// this slow was held up by host or driver work while its peers' kernels already waited for it.
const SLOW_LAUNCH: Duration = Duration::from_secs(1);

/// Logs a launch of one grouped operation that took `took` (see [`SLOW_LAUNCH`]): what a device
/// timeout on its peers then points to.
fn note_slow_launch(rank: usize, took: Duration) {
    if took > SLOW_LAUNCH {
        tracing::warn!(
            target: "mscclpp::nccl",
            "rank {rank}: launching a grouped operation took {took:.1?}; its peers' kernels \
             waited for it meanwhile (beyond MSCCLPP_DEVICE_WAIT_TIMEOUT they fail)"
        );
    }
}

/// Runs `f`, turning a panic into an error naming `what`, so a thread that panics still takes
/// part in every barrier of [`prepare_all_then_launch`].
fn caught(what: &str, f: impl FnOnce() -> mscclpp::Result<()>) -> mscclpp::Result<()> {
    std::panic::catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(mscclpp::Error::Internal(format!("{what} panicked"))))
}

/// Runs `prepare` on every part (a communicator and its operations, in call order), then
/// `launch` on every operation (with its index), each part on its own thread when there are
/// several. No part launches before every part is prepared, and none launches if any failed to
/// prepare (that failure is the result). In `lockstep` (see the module docs) operation i of every
/// part is launched before operation i + 1 of any. A part stops launching at its first failure,
/// which is its result. Every thread passes every barrier exactly once, whatever its preparation
/// or launches did (a panic included), so none waits for a thread that left.
fn prepare_all_then_launch<C: Send, O: Send>(
    parts: Vec<(C, Vec<O>)>,
    lockstep: bool,
    prepare: impl Fn(&C, &[O]) -> mscclpp::Result<()> + Sync,
    launch: impl Fn(&C, usize, O) -> mscclpp::Result<()> + Sync,
) -> mscclpp::Result<()> {
    // Launches a part's operations in order; `between` runs after each round (the lock step).
    let launch_all = |part: &C, ops: Vec<O>, rounds: usize, between: &dyn Fn()| {
        let mut result = Ok(());
        let mut ops = ops.into_iter();
        for round in 0..rounds {
            if let Some(op) = ops.next() {
                if result.is_ok() {
                    result = caught("launching a grouped operation", || launch(part, round, op));
                }
            }
            between();
        }
        result
    };
    if parts.len() <= 1 {
        return parts.into_iter().try_for_each(|(part, ops)| {
            prepare(&part, &ops)?;
            let rounds = ops.len();
            launch_all(&part, ops, rounds, &|| {})
        });
    }
    let rounds = parts.iter().map(|(_, ops)| ops.len()).max().unwrap_or(0);
    let prepared = Barrier::new(parts.len());
    let launched = Barrier::new(parts.len());
    let failed = AtomicBool::new(false);
    let (prepare, launch_all) = (&prepare, &launch_all);
    std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .into_iter()
            .map(|(part, ops)| {
                let (prepared, launched, failed) = (&prepared, &launched, &failed);
                s.spawn(move || {
                    let ready = caught("preparing a grouped operation", || prepare(&part, &ops));
                    if ready.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    prepared.wait();
                    ready?;
                    if failed.load(Ordering::SeqCst) {
                        // Another part's failure is the one the group reports. Every thread
                        // reads the same flag after the barrier, so all of them stop here.
                        return Ok(());
                    }
                    let between = || {
                        if lockstep {
                            launched.wait();
                        }
                    };
                    launch_all(&part, ops, rounds, &between)
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
    // A failure of a communicator that has failed is returned once its watchdog has acted.
    let mut watched: Vec<Arc<Comm>> = Vec::new();
    for (c, _) in &ops {
        if !watched.iter().any(|w| Arc::ptr_eq(w, c)) {
            watched.push(c.clone());
        }
    }
    let native = run_ops(ops);
    if native.is_err() {
        watched
            .iter()
            .for_each(|c| crate::handles::await_watchdog(c));
    }
    let real = match &group.real {
        // SAFETY: no arguments.
        Some(real) => real.check(
            "ncclGroupEnd",
            unsafe { (real.group_end)() },
            std::ptr::null_mut(),
        ),
        None => Ok(SUCCESS),
    };
    // Only now may their teardown run (on this thread, if a destroy came meanwhile).
    drop(group.held);
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
    drop(group.held);
    Ok(SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// `n` parts (ranks), rank r with `ops(r)` operations numbered 0.. in call order.
    fn parts(n: usize, ops: impl Fn(usize) -> usize) -> Vec<(usize, Vec<usize>)> {
        (0..n).map(|r| (r, (0..ops(r)).collect())).collect()
    }

    /// What ncclGroupEnd over ncclCommInitAll's communicators relies on: no communicator launches
    /// while another still prepares (loads kernels, which may synchronize the shared context).
    #[test]
    fn every_part_is_prepared_before_any_launches() {
        let events = Mutex::new(Vec::new());
        let result = prepare_all_then_launch(
            parts(4, |_| 1),
            true,
            |r: &usize, _: &[usize]| {
                // The last rank prepares slowest, as a rank compiling a kernel would.
                std::thread::sleep(Duration::from_millis(if *r == 3 { 50 } else { 0 }));
                events.lock().unwrap().push(("prepare", *r));
                Ok(())
            },
            |r: &usize, _, _| {
                events.lock().unwrap().push(("launch", *r));
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

    /// The 4-rank initall group (all-reduce then all-gather on every communicator): every rank's
    /// operation i is launched before any rank's operation i + 1, however the threads are
    /// scheduled. Rank 0 rushes through its launches and the others are slow to start theirs, as a
    /// thread woken last from the barrier is; parts with fewer operations still take their turn
    /// in every round. Without lock step the rushing rank's second launch goes first.
    #[test]
    fn lockstep_launches_round_by_round() {
        for lockstep in [true, false] {
            let events = Mutex::new(Vec::new());
            let result = prepare_all_then_launch(
                parts(4, |r| if r == 2 { 1 } else { 2 + usize::from(r == 3) }),
                lockstep,
                |_: &usize, _: &[usize]| Ok(()),
                |r: &usize, round, op| {
                    assert_eq!(round, op, "operations launch in call order");
                    if *r != 0 {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    events.lock().unwrap().push((round, *r));
                    Ok(())
                },
            );
            assert!(result.is_ok());
            let events = events.into_inner().unwrap();
            assert_eq!(events.len(), 2 + 2 + 1 + 3);
            let in_rounds = events.windows(2).all(|w| w[0].0 <= w[1].0);
            assert_eq!(in_rounds, lockstep, "lock step {lockstep}: {events:?}");
        }
    }

    /// A rank whose launch fails (or panics) launches nothing more but still takes its turn in
    /// every round, so the others are not left waiting at the barrier; its error is the group's.
    #[test]
    fn a_failed_launch_stops_its_part_only() {
        for panics in [false, true] {
            let launched = Mutex::new(Vec::new());
            let result = prepare_all_then_launch(
                parts(3, |_| 3),
                true,
                |_: &usize, _: &[usize]| Ok(()),
                |r: &usize, round, _| {
                    if (*r, round) == (1, 0) {
                        if panics {
                            panic!("rank 1 panicked");
                        }
                        return Err(mscclpp::Error::InvalidArgument("rank 1 refused".into()));
                    }
                    launched.lock().unwrap().push((*r, round));
                    Ok(())
                },
            );
            let e = result.unwrap_err().to_string();
            let want = if panics { "panicked" } else { "rank 1 refused" };
            assert!(e.contains(want), "{e}");
            let mut launched = launched.into_inner().unwrap();
            launched.sort();
            assert_eq!(launched, [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2)]);
        }
    }

    /// A rank that cannot prepare (or panics doing so) stops every launch, and its error is the
    /// group's: its peers' kernels would otherwise wait for it until their device timeout.
    #[test]
    fn a_failed_preparation_launches_nothing_and_is_reported() {
        for panics in [false, true] {
            let launched = Mutex::new(Vec::new());
            let result = prepare_all_then_launch(
                parts(4, |_| 2),
                true,
                |r: &usize, _: &[usize]| match (*r, panics) {
                    (1, false) => Err(mscclpp::Error::InvalidArgument("rank 1 refused".into())),
                    (1, true) => panic!("rank 1 panicked"),
                    _ => Ok(()),
                },
                |r: &usize, _, _| {
                    launched.lock().unwrap().push(*r);
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
            parts(1, |_| 2),
            true,
            |_: &usize, _: &[usize]| {
                assert_eq!(std::thread::current().id(), caller);
                Ok(())
            },
            |_: &usize, _, _| {
                assert_eq!(std::thread::current().id(), caller);
                Ok(())
            },
        );
        assert!(result.is_ok());
    }
}
