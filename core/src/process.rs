//! The process around mscclpp-rs's own threads: its exit, and panics on threads we start.
//!
//! # Exit
//! When a process exits (`exit`, a return from `main`, the end of a Python interpreter), its other
//! threads keep running until the kernel ends the process, while the exiting thread runs the
//! atexit handlers and static destructors, the CUDA runtime's and driver's teardown among them:
//! contexts are destroyed and what they own is freed. A thread that makes a driver call then, or
//! touches memory the driver frees (pinned host memory from `cuMemHostAlloc`), can crash inside
//! the driver: SIGSEGV in a native thread, no frame of the program's own. Threads that may be
//! running at that moment are ours (bootstrap readers and heartbeat, the PortChannel proxy, the
//! Ethernet receiver) and the application's that are inside our calls (PyTorch's NCCL watchdog
//! polls `ncclCommGetAsyncError` and may be aborting a communicator while the main thread exits).
//!
//! [`watch_exit`] (the first communicator calls it) registers an atexit handler. Handlers run in
//! the reverse order of their registration, and the CUDA runtime's and driver's teardown is
//! registered earlier (CUDA is initialised before any communicator exists; a library's own
//! destructors run after every atexit handler), so ours runs before them. It marks the process
//! exiting, after which the backends refuse every driver call ([`exiting`], one load, checked where
//! a backend binds its context), so a teardown still running leaks what it has left to the
//! process's end instead of racing the driver's own. It then waits, at most [`EXIT_WAIT`], for the
//! [`Section`]s in progress: teardowns already inside a driver call when the flag was set. Host
//! memory that host threads read and write (error words, FIFO rings) is ours, not the driver's (the
//! CUDA backend registers pages it mapped itself), so it stays valid to the last instruction.
//!
//! # Panics
//! A panic on a thread of ours ends that thread only, but a bootstrap reader that ends silently
//! stops draining its socket, and a panic while unwinding (in a destructor) aborts the process.
//! [`guarded`] runs a thread's body so that a panic is logged with the thread's name and the
//! thread ends normally.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

/// How long the exit handler waits for teardowns in progress (see the module docs). Teardowns
/// refused by the flag end in microseconds; this bounds one already inside a long driver call
/// (draining a context's queued kernels after a failure, which the device wait budget bounds).
pub const EXIT_WAIT: Duration = Duration::from_secs(3);

/// A process-wide "exiting" flag with a count of sections that must not be cut by the exit
/// (see the module docs). The process has one ([`watch_exit`]); tests make their own.
#[derive(Debug, Default)]
pub struct ExitGate {
    exiting: AtomicBool,
    active: AtomicUsize,
}

impl ExitGate {
    pub const fn new() -> Self {
        ExitGate {
            exiting: AtomicBool::new(false),
            active: AtomicUsize::new(0),
        }
    }

    /// Whether [`close`](Self::close) was called.
    pub fn exiting(&self) -> bool {
        self.exiting.load(Ordering::SeqCst)
    }

    /// A section `close` waits for, or `None` once the gate is closed (then do not start).
    pub fn enter(&self) -> Option<Section<'_>> {
        // With `close` (store the flag, then read the count), sequentially consistent order makes
        // either this thread see the flag or `close` see this section.
        self.active.fetch_add(1, Ordering::SeqCst);
        if self.exiting.load(Ordering::SeqCst) {
            self.active.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Section(self))
    }

    /// Closes the gate, then waits up to `wait` for the sections in progress; whether all ended.
    pub fn close(&self, wait: Duration) -> bool {
        self.exiting.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + wait;
        while self.active.load(Ordering::SeqCst) > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Sections in progress.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }
}

/// Work the exit waits for (bounded) while it lasts: see [`ExitGate::enter`].
#[derive(Debug)]
#[must_use = "the section ends when this is dropped"]
pub struct Section<'a>(&'a ExitGate);

impl Drop for Section<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

static GATE: ExitGate = ExitGate::new();

/// Registers the exit handler once per process (see the module docs). Cheap after the first call.
pub fn watch_exit() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a plain function with no arguments; it never unwinds (see below).
        if unsafe { libc::atexit(at_exit) } != 0 {
            tracing::warn!(
                "cannot register the exit handler: background threads are not stopped at exit"
            );
        }
    });
}

extern "C" fn at_exit() {
    // Nothing may unwind out of an atexit handler.
    let _ = catch_unwind(|| {
        if !GATE.close(EXIT_WAIT) {
            tracing::warn!(
                "the process exits while {} communicator teardown(s) of mscclpp-rs still run \
                 (waited {EXIT_WAIT:?}); what they have left is left to the driver",
                GATE.active()
            );
        }
    });
}

/// Whether the process is exiting (its exit handler ran): backends refuse driver calls from then
/// on, and threads of ours stop what they do.
pub fn exiting() -> bool {
    GATE.exiting.load(Ordering::Relaxed)
}

/// A section the process's exit waits for (bounded), or `None` once it is exiting.
pub fn enter() -> Option<Section<'static>> {
    GATE.enter()
}

/// [`guarded`] for a body without a result.
pub fn run_guarded(name: &str, body: impl FnOnce()) {
    let _ = guarded(name, body);
}

/// Runs the body of a thread named `name`: its result, or `None` after a panic, which is logged
/// (and ends the thread normally).
pub fn guarded<T>(name: &str, body: impl FnOnce() -> T) -> Option<T> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(t) => Some(t),
        Err(panic) => {
            let what = panic_message(panic.as_ref());
            tracing::error!("thread {name} of mscclpp-rs panicked (a bug): {what}");
            None
        }
    }
}

/// The message a panic carried (`panic!`'s text), for an error or a log line.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_closed_gate_refuses_new_sections_and_waits_for_the_ones_in_progress() {
        let gate = Arc::new(ExitGate::new());
        let section = gate.enter().expect("open");
        assert_eq!(gate.active(), 1);
        let holder = {
            let gate = gate.clone();
            std::thread::spawn(move || {
                let _s = gate.enter().expect("open");
                std::thread::sleep(Duration::from_millis(200));
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        drop(section);
        let start = Instant::now();
        assert!(gate.close(Duration::from_secs(5)), "the section ended");
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(100), "{waited:?}");
        assert!(gate.exiting());
        assert!(gate.enter().is_none(), "closed");
        holder.join().unwrap();
        assert_eq!(gate.active(), 0);
    }

    #[test]
    fn the_wait_is_bounded() {
        let gate = ExitGate::new();
        let _stuck = gate.enter().expect("open");
        let start = Instant::now();
        assert!(!gate.close(Duration::from_millis(50)));
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn a_panic_in_a_guarded_body_ends_the_thread_normally() {
        let t = std::thread::spawn(|| guarded("test", || -> u8 { panic!("boom") }));
        assert_eq!(t.join().ok(), Some(None));
        assert_eq!(guarded("test", || 7), Some(7));
    }
}
