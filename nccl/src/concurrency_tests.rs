//! Teardown racing calls, on the CPU: communicators of the shim over the host test GPU (ranks as
//! threads of this process), with one thread blocked inside a shim call in a host wait (the
//! parent's all-gather of `ncclCommSplit`, which the peer never joins) while other threads call
//! ncclCommAbort, ncclCommDestroy, ncclCommFinalize and ncclCommGetAsyncError on the same
//! communicator, as PyTorch's watchdog does.

use crate::abi::*;
use crate::comm::{new_job_id, Comm};
use crate::handles::{self, Entry, Handle, State};
use crate::lifecycle::*;
use crate::ops::ncclAllReduce;
use mscclpp::core::port_channel::test_gpu::HostGpu;
use mscclpp::Gpu;
use std::ffi::c_int;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A handle as a plain number, so threads can share it.
#[derive(Clone, Copy)]
pub(crate) struct H(usize);

impl H {
    pub(crate) fn get(self) -> Handle {
        self.0 as Handle
    }
}

/// `n` ranks of one job over one host test GPU, each registered as a ready handle.
pub(crate) fn host_comms(n: usize) -> Vec<H> {
    let id = new_job_id().expect("job id");
    let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::new());
    let joins: Vec<_> = (0..n)
        .map(|rank| {
            let (id, gpu) = (id.clone(), gpu.clone());
            std::thread::spawn(move || {
                Comm::connect_bare(n, rank, &id, 0, gpu).expect("communicator")
            })
        })
        .collect();
    joins
        .into_iter()
        .map(|j| {
            let entry = Entry::initializing(id.clone());
            *entry.state() = State::Ready(Arc::new(j.join().expect("init thread")));
            H(handles::register(entry) as usize)
        })
        .collect()
}

/// The communicator behind a live handle, weakly: whether it was torn down.
fn weak(h: H) -> Weak<Comm> {
    Arc::downgrade(&handles::live(h.get()).expect("live"))
}

fn async_error(h: H) -> (NcclResult, NcclResult) {
    let mut code: NcclResult = -1;
    let rc = unsafe { ncclCommGetAsyncError(h.get(), &mut code) };
    (rc, code)
}

/// Rank `h` calls ncclCommSplit (color 0): its parent's all-gather waits for peers that may
/// never come. Returns the call's result, the new handle, and how long it took.
fn split_in_thread(h: H, color: c_int) -> JoinHandle<(NcclResult, usize, Duration)> {
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let mut new: Handle = std::ptr::null_mut();
        let rc = unsafe { ncclCommSplit(h.get(), color, 0, &mut new, std::ptr::null_mut()) };
        (rc, new as usize, t0.elapsed())
    })
}

/// What PyTorch's watchdog does while the main thread is blocked in a host wait of a call on the
/// same communicator: ncclCommGetAsyncError (polled all along by another thread too), then
/// ncclCommAbort, ncclCommDestroy and ncclCommFinalize. The abort returns at once and releases
/// the blocked call (well within the 30 s bootstrap timeout) with the error, the teardown runs
/// only once that call let go of the communicator, every later call on the handle is answered
/// (the teardown calls as no-ops, operations with an error naming it), and the peer, which never
/// joined, is destroyed promptly afterwards.
#[test]
fn abort_from_another_thread_releases_a_call_blocked_in_a_host_wait() {
    let comms = host_comms(2);
    let (h0, h1) = (comms[0], comms[1]);
    let alive = weak(h0);
    let blocked = split_in_thread(h0, 0);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poller = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                let (rc, code) = async_error(h0);
                assert_eq!(rc, SUCCESS, "ncclCommGetAsyncError itself must not fail");
                if seen.last() != Some(&code) {
                    seen.push(code);
                }
                std::thread::yield_now();
            }
            seen
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(!blocked.is_finished(), "the split should wait for rank 1");
    assert_eq!(async_error(h0), (SUCCESS, SUCCESS));

    let t0 = Instant::now();
    assert_eq!(unsafe { ncclCommAbort(h0.get()) }, SUCCESS);
    let abort_took = t0.elapsed();
    assert!(
        abort_took < Duration::from_secs(1),
        "ncclCommAbort took {abort_took:?}"
    );
    let (rc, new, took) = blocked.join().expect("split thread");
    // Error::Aborted("ncclCommAbort") from the interrupted all-gather.
    assert_eq!(
        rc, SYSTEM_ERROR,
        "the interrupted split must fail as aborted"
    );
    assert_eq!(new, 0, "no communicator was made");
    assert!(
        took < Duration::from_secs(5),
        "the blocked split returned after {took:?}"
    );
    // The poller's own ncclCommGetAsyncError holds the communicator for the moment of its
    // call, so the last call to let go may be that one, just after the split.
    let let_go = Instant::now();
    while alive.upgrade().is_some() && let_go.elapsed() < Duration::from_secs(1) {
        std::thread::yield_now();
    }
    assert!(
        alive.upgrade().is_none(),
        "the teardown ran when the calls holding the communicator let go of it"
    );

    assert_eq!(async_error(h0), (SUCCESS, SYSTEM_ERROR));
    assert_eq!(
        unsafe { ncclCommDestroy(h0.get()) },
        SUCCESS,
        "after abort: a no-op"
    );
    assert_eq!(unsafe { ncclCommFinalize(h0.get()) }, SUCCESS);
    assert_eq!(
        unsafe { ncclCommAbort(h0.get()) },
        SUCCESS,
        "a second abort: a no-op"
    );
    let mut count: c_int = 0;
    assert_eq!(
        unsafe { ncclCommCount(h0.get(), &mut count) },
        INVALID_ARGUMENT
    );
    let rc = all_reduce_of_nothing(h0);
    assert_eq!(rc, INVALID_ARGUMENT);
    stop.store(true, std::sync::atomic::Ordering::Release);
    let seen = poller.join().expect("poller");
    assert_eq!(seen.first(), Some(&SUCCESS), "{seen:?}");
    assert_eq!(seen.last(), Some(&SYSTEM_ERROR), "{seen:?}");

    // Rank 1 never joined; its teardown's barrier meets what rank 0 left (the split's message,
    // or its closed bootstrap) and fails at once, not after the bootstrap timeout.
    let t0 = Instant::now();
    assert_eq!(unsafe { ncclCommDestroy(h1.get()) }, SUCCESS);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

/// ncclCommDestroy from another thread while a call is blocked on the communicator only drops the
/// handle's reference: the call goes on (its peer joins later) on a communicator that is still
/// there, and the teardown runs when it returns. ncclCommGetAsyncError answers throughout.
#[test]
fn destroy_from_another_thread_leaves_a_call_in_flight_its_communicator() {
    let comms = host_comms(2);
    let (h0, h1) = (comms[0], comms[1]);
    let alive = weak(h0);
    let blocked = split_in_thread(h0, 0);
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    assert_eq!(unsafe { ncclCommDestroy(h0.get()) }, SUCCESS);
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(
        alive.upgrade().is_some(),
        "the call in flight still holds it"
    );
    assert!(!blocked.is_finished());
    assert_eq!(async_error(h0), (SUCCESS, SUCCESS));
    assert_eq!(
        unsafe { ncclCommDestroy(h0.get()) },
        SUCCESS,
        "a second destroy: a no-op"
    );
    assert_eq!(
        unsafe { ncclCommAbort(h0.get()) },
        SUCCESS,
        "abort after destroy: a no-op"
    );
    // Rank 1 joins the split (no color), then is destroyed. A healthy communicator's teardown
    // meets its job's other ranks of this process: rank 0's waits (retired) for rank 1's
    // destroy, and both go down together then.
    let peer = std::thread::spawn(move || {
        let mut new: Handle = std::ptr::null_mut();
        let rc =
            unsafe { ncclCommSplit(h1.get(), SPLIT_NOCOLOR, 0, &mut new, std::ptr::null_mut()) };
        assert_eq!(rc, SUCCESS);
        assert!(new.is_null());
        assert_eq!(unsafe { ncclCommDestroy(h1.get()) }, SUCCESS);
    });
    let (rc, new, took) = blocked.join().expect("split thread");
    // The parent's all-gather completed on the destroyed handle's communicator; building the
    // child needs kernels, which the host test GPU lacks (ncclInvalidUsage saying so), so no
    // child is made. Not an abort's error: nothing interrupted the call.
    assert_eq!(rc, INVALID_USAGE, "the split ran to its end");
    assert_eq!(new, 0);
    assert!(took < Duration::from_secs(20), "{took:?}");
    peer.join().expect("rank 1");
    assert!(
        alive.upgrade().is_none(),
        "torn down once the split returned"
    );
}

/// Many threads at once: one aborting, one destroying, several polling the async error and
/// finalizing, while a call is blocked. Exactly one teardown, no call fails for the race.
#[test]
fn teardown_calls_racing_each_other_are_all_answered() {
    let comms = host_comms(2);
    let (h0, h1) = (comms[0], comms[1]);
    let alive = weak(h0);
    let blocked = split_in_thread(h0, 0);
    std::thread::sleep(Duration::from_millis(200));
    let barrier = Arc::new(std::sync::Barrier::new(6));
    let racers: Vec<_> = (0..6)
        .map(|i| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                match i {
                    0 => unsafe { ncclCommAbort(h0.get()) },
                    1 => unsafe { ncclCommDestroy(h0.get()) },
                    2 => unsafe { ncclCommFinalize(h0.get()) },
                    _ => {
                        for _ in 0..1000 {
                            let (rc, _) = async_error(h0);
                            if rc != SUCCESS {
                                return rc;
                            }
                        }
                        SUCCESS
                    }
                }
            })
        })
        .collect();
    for (i, r) in racers.into_iter().enumerate() {
        assert_eq!(r.join().expect("racer"), SUCCESS, "racer {i}");
    }
    // Whichever of abort and destroy came first, the split ends: aborted at once, or (destroy
    // first) when rank 1 joins.
    let peer = std::thread::spawn(move || {
        let mut new: Handle = std::ptr::null_mut();
        unsafe { ncclCommSplit(h1.get(), SPLIT_NOCOLOR, 0, &mut new, std::ptr::null_mut()) };
        unsafe { ncclCommDestroy(h1.get()) }
    });
    // No child is made either way (the host test GPU cannot build one).
    let (_, new, _) = blocked.join().expect("split thread");
    assert_eq!(new, 0);
    assert_eq!(peer.join().expect("rank 1"), SUCCESS);
    assert!(alive.upgrade().is_none());
    let (rc, _) = async_error(h0);
    assert_eq!(rc, SUCCESS);
}

/// Set in the child of [`the_process_exits_with_its_code_while_our_threads_run`].
const EXIT_CHILD: &str = "MSCCLPP_NCCL_TEST_EXIT_CHILD";

/// The child: live communicators, a call blocked in a host wait, bootstrap threads running,
/// then `exit(3)` from the main thread (with a teardown section held when asked).
#[test]
fn exit_child() {
    let Ok(how) = std::env::var(EXIT_CHILD) else {
        return;
    };
    let comms = host_comms(2);
    let _blocked = split_in_thread(comms[0], 0);
    if how == "section" {
        std::thread::spawn(|| {
            let _held = mscclpp::core::process::enter();
            std::thread::sleep(Duration::from_secs(60));
        });
    }
    std::thread::sleep(Duration::from_millis(300));
    std::process::exit(3);
}

/// A process exits with its own code while threads of ours run (bootstrap readers and heartbeat,
/// a call blocked in a host wait): the exit handler the first communicator registered runs, and
/// waits for a teardown in progress only up to its bound (`process::EXIT_WAIT`).
#[test]
fn the_process_exits_with_its_code_while_our_threads_run() {
    let exe = std::env::current_exe().expect("test binary");
    let run = |how: &str| {
        let t0 = Instant::now();
        let status = std::process::Command::new(&exe)
            .args([
                "--exact",
                "concurrency_tests::exit_child",
                "--test-threads=1",
            ])
            .env(EXIT_CHILD, how)
            .stdout(std::process::Stdio::null())
            .status()
            .expect("child");
        (status, t0.elapsed())
    };
    let (status, plain) = run("plain");
    assert_eq!(status.code(), Some(3), "{status:?}");
    let (status, held) = run("section");
    assert_eq!(status.code(), Some(3), "{status:?}");
    let bound = mscclpp::core::process::EXIT_WAIT;
    assert!(
        held >= bound,
        "the exit did not wait for the section: {held:?}"
    );
    assert!(held < bound + Duration::from_secs(10), "{held:?}");
    assert!(plain < held, "plain {plain:?}, with a section {held:?}");
}

/// A thread that ends inside a group (ncclGroupStart without its End) leaks what the group
/// collected: the communicator it holds is not torn down in the thread's thread-local
/// destructor (driver calls and a barrier there, with other thread-locals already gone).
#[test]
fn a_thread_ending_inside_a_group_leaks_its_communicators() {
    use mscclpp_collectives::p2p::{P2pKind, P2pOp};
    let comms = host_comms(2);
    let (h0, h1) = (comms[0], comms[1]);
    let alive = weak(h0);
    std::thread::spawn(move || {
        assert_eq!(unsafe { crate::ops::ncclGroupStart() }, SUCCESS);
        let op = P2pOp {
            kind: P2pKind::Send,
            peer: 1,
            ptr: 0,
            bytes: 8,
        };
        crate::group::defer_p2p(
            handles::live(h0.get()).expect("live"),
            Default::default(),
            op,
        );
    })
    .join()
    .expect("grouping thread");
    assert_eq!(unsafe { ncclCommAbort(h0.get()) }, SUCCESS);
    assert!(
        alive.upgrade().is_some(),
        "leaked, not torn down at the thread's end"
    );
    assert_eq!(unsafe { ncclCommAbort(h1.get()) }, SUCCESS);
}

/// As NCCL: destroy and abort of NULL succeed doing nothing. PyTorch's watchdog aborts a
/// communicator a second time once its handle is NULL (`NCCLComm::abort` after an abort) and
/// terminates the process on an error there.
#[test]
fn destroy_and_abort_of_null_succeed() {
    assert_eq!(unsafe { ncclCommAbort(std::ptr::null_mut()) }, SUCCESS);
    assert_eq!(unsafe { ncclCommDestroy(std::ptr::null_mut()) }, SUCCESS);
}

/// Fails the communicator behind `h` as the liveness check does when a peer stops.
fn fail_as_if_rank_1_stalled(h: H) {
    handles::live(h.get())
        .expect("live")
        .communicator
        .abort("rank 1 stalled (test)");
}

/// An all-reduce on `h` that fails before it touches its buffers (the handle is closed, or its
/// communicator has failed).
fn all_reduce_of_nothing(h: H) -> NcclResult {
    unsafe {
        ncclAllReduce(
            std::ptr::null(),
            std::ptr::null_mut(),
            1,
            7,
            0,
            h.get(),
            std::ptr::null_mut(),
        )
    }
}

/// PyTorch's order after a failure: its watchdog thread polls ncclCommGetAsyncError, sees the
/// error, prints the failed collective's stack, then aborts the communicator; the main thread's
/// next call on it returns the error only after that abort (`crate::watchdog`), never while the
/// watchdog is still at work.
#[test]
fn a_failure_is_returned_after_the_watchdog_aborts() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let comms = host_comms(2);
    let h0 = comms[0];
    let polled = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let polled = polled.clone();
        std::thread::spawn(move || loop {
            let (rc, code) = async_error(h0);
            assert_eq!(rc, SUCCESS);
            polled.store(true, Ordering::Release);
            if code != SUCCESS {
                std::thread::sleep(Duration::from_millis(400)); // the stack trace
                let aborted_at = Instant::now();
                assert_eq!(unsafe { ncclCommAbort(h0.get()) }, SUCCESS);
                return aborted_at;
            }
            std::thread::sleep(Duration::from_millis(5));
        })
    };
    while !polled.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
    fail_as_if_rank_1_stalled(h0);
    let t0 = Instant::now();
    let rc = all_reduce_of_nothing(h0);
    let returned_at = Instant::now();
    let aborted_at = watchdog.join().expect("watchdog");
    assert_ne!(rc, SUCCESS);
    let last = unsafe { std::ffi::CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) };
    assert!(
        last.to_string_lossy().contains("rank 1 stalled"),
        "{last:?}"
    );
    assert!(
        returned_at >= aborted_at,
        "the call returned {:?} before the watchdog's abort",
        aborted_at - returned_at
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    unsafe { ncclCommAbort(comms[1].get()) };
}

/// Without a watchdog (nobody else polls), a failed communicator's call returns at once.
#[test]
fn without_a_watchdog_a_failure_is_returned_at_once() {
    let comms = host_comms(2);
    let h0 = comms[0];
    fail_as_if_rank_1_stalled(h0);
    let t0 = Instant::now();
    let rc = all_reduce_of_nothing(h0);
    assert_ne!(rc, SUCCESS);
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    for h in comms {
        unsafe { ncclCommAbort(h.get()) };
    }
}
