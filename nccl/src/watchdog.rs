//! A failed communicator's error reaches the caller after its watchdog has acted.
//!
//! PyTorch watches each communicator from a thread of its own: it polls ncclCommGetAsyncError
//! and, on an error, prints the failed collective's stack (symbolising its Python frames in a
//! task that needs the interpreter), then aborts the communicator. Under NCCL the thread that
//! issues the collectives learns of the failure only after that: a kernel waiting on a dead or
//! stalled peer spins until the abort, so the program's `synchronize` or next call returns after
//! the watchdog is done. Our waits end on their own (the device wait timeout, the liveness
//! check), so the issuing thread's next call fails at the moment the watchdog starts on the same
//! failure. The program's exception then ends the interpreter while the watchdog's task still
//! needs it: PyTorch's watchdog thread dies of `std::future_error: Broken promise` (SIGABRT), or
//! the process of SIGSEGV, instead of exiting with the exception (one H200, 2 ranks, with and
//! without MPS: `torch_check.py watchdog`).
//!
//! So a call on a communicator that has an asynchronous error, about to return that failure,
//! first waits until the communicator is aborted or destroyed when a thread other than the caller
//! has polled its asynchronous error (a watchdog), at most `MSCCLPP_NCCL_WATCHDOG_WAIT` (10 s by
//! default, longer than PyTorch's 8 s bound on symbolising the stack; 0 turns the wait off). The
//! failure is still returned, unchanged: only its order against the watchdog changes. Without a
//! watchdog, or polled from the calling thread only, nothing waits.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

/// One communicator's watchdog, as its calls see it.
#[derive(Debug)]
pub struct Watchdog {
    /// Kernel id of the thread that last polled ncclCommGetAsyncError (0: none has).
    poller: AtomicI64,
    /// Set by ncclCommAbort and ncclCommDestroy: the watchdog (or the program) has acted.
    closed: AtomicBool,
    /// The longest a failure waits for the close (`MSCCLPP_NCCL_WATCHDOG_WAIT`; zero: never).
    wait: Duration,
}

/// The calling thread's kernel id.
fn thread_id() -> i64 {
    // SAFETY: gettid has no preconditions.
    i64::from(unsafe { libc::gettid() })
}

impl Watchdog {
    pub fn new(wait: Duration) -> Self {
        Watchdog {
            poller: AtomicI64::new(0),
            closed: AtomicBool::new(false),
            wait,
        }
    }

    /// ncclCommGetAsyncError was called on the communicator from this thread.
    pub fn polled(&self) {
        self.poller.store(thread_id(), Ordering::Relaxed);
    }

    /// The communicator's handle was aborted or destroyed.
    pub fn closed(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Whether a failure returned now on this thread would race a watchdog still at work.
    fn watched_elsewhere(&self) -> bool {
        let poller = self.poller.load(Ordering::Relaxed);
        poller != 0 && poller != thread_id() && !self.closed.load(Ordering::Acquire)
    }

    /// Before a call on the failed communicator returns its failure: waits for the abort or
    /// destroy while a watchdog polls from another thread (bounded); whether it came.
    pub fn await_close(&self) -> bool {
        let wait = self.wait;
        if wait.is_zero() || !self.watched_elsewhere() {
            return true;
        }
        let deadline = Instant::now() + wait;
        while !self.closed.load(Ordering::Acquire) {
            if Instant::now() >= deadline {
                tracing::warn!(
                    target: "mscclpp::nccl",
                    "the communicator's watchdog did not abort it within {wait:?} of its failure \
                     (MSCCLPP_NCCL_WATCHDOG_WAIT): the call returns its error now"
                );
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn no_watchdog_or_one_on_the_calling_thread_means_no_wait() {
        let w = Watchdog::new(Duration::from_secs(5));
        let t0 = Instant::now();
        assert!(w.await_close());
        w.polled(); // this thread
        assert!(w.await_close());
        assert!(t0.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn a_watchdog_elsewhere_is_awaited_until_it_closes_the_communicator() {
        let w = Arc::new(Watchdog::new(Duration::from_secs(10)));
        let watchdog = {
            let w = w.clone();
            std::thread::spawn(move || {
                w.polled();
                std::thread::sleep(Duration::from_millis(300));
                w.closed();
            })
        };
        // The poll lands before this thread looks.
        while w.poller.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        let t0 = Instant::now();
        assert!(w.await_close());
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(200), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        watchdog.join().unwrap();
        // Closed: later failures return at once.
        let t0 = Instant::now();
        assert!(w.await_close());
        assert!(t0.elapsed() < Duration::from_millis(100));
    }

    #[test]
    fn the_wait_is_bounded_and_zero_turns_it_off() {
        for (wait, came) in [(Duration::from_millis(200), false), (Duration::ZERO, true)] {
            let w = Arc::new(Watchdog::new(wait));
            {
                let w = w.clone();
                std::thread::spawn(move || w.polled()).join().unwrap();
            }
            let t0 = Instant::now();
            assert_eq!(w.await_close(), came);
            let took = t0.elapsed();
            assert!(
                took >= wait && took < wait + Duration::from_millis(500),
                "{took:?}"
            );
        }
    }
}
