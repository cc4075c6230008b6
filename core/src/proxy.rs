//! The proxy: a host thread that consumes a [`Fifo`] of [`ProxyTrigger`]s pushed by GPU threads and
//! carries them out (MSCCL++'s `Proxy` and `ProxyService`).
//!
//! [`Proxy`] runs any [`ProxyHandler`]; [`TransportProxyHandler`] is the default one, which maps
//! trigger types onto a [`Transport`](crate::Transport): DATA is a `write` between two registered
//! memories, FLAG signals a semaphore, SYNC flushes the semaphore's connection.
//!
//! # Errors and shutdown
//! A failing handler does not stop the proxy: the GPU waits on the FIFO tail, so the proxy keeps
//! consuming (and logging) to let kernels finish. The first error is kept and reported once, by the
//! first [`Proxy::check`] that sees it, else by [`Proxy::stop`]. `stop` lets the thread drain every
//! trigger whose position was taken before the deadline, then joins it, all within its timeout.

use crate::communicator::FailureFlag;
use crate::device::{trigger_bits, ProxyTrigger, TriggerType};
use crate::error::{Error, Result};
use crate::fifo::{Backoff, Fifo};
use crate::host_semaphore::Host2DeviceSemaphore;
use crate::transport::MemoryRegion;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the proxy does after a trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyAction {
    /// Keep serving the FIFO.
    Continue,
    /// Exit the proxy thread after this trigger (it is still popped).
    Stop,
}

/// Carries out one trigger. Runs on the proxy thread; the trigger is popped after `handle` returns,
/// so a device `sync(pos)` returns only once the handler is done with `pos`.
pub trait ProxyHandler: Send + 'static {
    fn handle(&mut self, trigger: ProxyTrigger) -> Result<ProxyAction>;
}

impl<F> ProxyHandler for F
where
    F: FnMut(ProxyTrigger) -> Result<ProxyAction> + Send + 'static,
{
    fn handle(&mut self, trigger: ProxyTrigger) -> Result<ProxyAction> {
        self(trigger)
    }
}

/// Counters of a proxy's work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProxyStats {
    /// Triggers consumed (popped), including failed ones.
    pub handled: u64,
    /// Triggers whose handler returned an error or panicked.
    pub errors: u64,
}

#[derive(Default)]
struct ProxyShared {
    stop: AtomicBool,
    /// Until when a stopping proxy may wait for positions taken but not yet written.
    drain_deadline: Mutex<Option<Instant>>,
    first_error: Mutex<Option<Error>>,
    handled: AtomicU64,
    errors: AtomicU64,
}

impl ProxyShared {
    fn record(&self, e: Error) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        tracing::error!("proxy handler failed: {e}");
        if let Ok(mut first) = self.first_error.lock() {
            first.get_or_insert(e);
        }
    }

    fn take_error(&self) -> Option<Error> {
        self.first_error.lock().ok().and_then(|mut e| e.take())
    }

    fn stats(&self) -> ProxyStats {
        ProxyStats {
            handled: self.handled.load(Ordering::Acquire),
            errors: self.errors.load(Ordering::Acquire),
        }
    }
}

/// A running proxy thread. Dropping it stops it (with a 10 s drain limit, errors logged).
pub struct Proxy {
    shared: Arc<ProxyShared>,
    thread: Option<JoinHandle<()>>,
    done: mpsc::Receiver<()>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("running", &self.thread.is_some())
            .field("stats", &self.shared.stats())
            .finish()
    }
}

impl Proxy {
    /// Starts the proxy thread on `fifo` with `handler`, free to run on any CPU.
    pub fn start(fifo: Fifo, handler: impl ProxyHandler) -> Result<Self> {
        Self::start_on(fifo, handler, None)
    }

    /// Starts the proxy thread restricted to `cpus` when given (see [`crate::affinity`]: the
    /// CPUs next to the GPU make every poll and driver call cheaper). A failed binding is logged
    /// and the proxy runs unbound: it is slower, not wrong.
    pub fn start_on(
        fifo: Fifo,
        handler: impl ProxyHandler,
        cpus: Option<Vec<usize>>,
    ) -> Result<Self> {
        let shared = Arc::new(ProxyShared::default());
        let (tx, done) = mpsc::channel();
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("mscclpp-proxy".into())
                .spawn(move || {
                    // A panic outside the handler (which `run` guards itself) is recorded as the
                    // proxy's error, and `stop` still hears that the thread ended.
                    let run_shared = Arc::clone(&shared);
                    let body = std::panic::catch_unwind(AssertUnwindSafe(move || {
                        if let Some(cpus) = cpus {
                            if let Err(e) = crate::affinity::bind_current_thread(&cpus) {
                                tracing::warn!(target: "mscclpp::proxy", "proxy thread runs unbound: {e}");
                            }
                        }
                        run(fifo, handler, &run_shared);
                    }));
                    if body.is_err() {
                        shared.record(Error::Internal(
                            "the proxy thread panicked outside its handler".into(),
                        ));
                    }
                    // The receiver may be gone (stop timed out earlier); nothing to do then.
                    let _ = tx.send(());
                })
                .map_err(|e| Error::io("spawning the proxy thread", e))?
        };
        Ok(Proxy {
            shared,
            thread: Some(thread),
            done,
        })
    }

    /// The first handler error since the last report, if any (reported once).
    pub fn check(&self) -> Result<()> {
        match self.shared.take_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub fn stats(&self) -> ProxyStats {
        self.shared.stats()
    }

    /// Stops the thread: triggers already pushed are handled first, then it exits. Waits at most
    /// `timeout`; returns the stats, or the first unreported handler error.
    pub fn stop(&mut self, timeout: Duration) -> Result<ProxyStats> {
        let Some(thread) = self.thread.take() else {
            return self.check().map(|()| self.stats());
        };
        if let Ok(mut d) = self.shared.drain_deadline.lock() {
            *d = Some(Instant::now() + timeout);
        }
        self.shared.stop.store(true, Ordering::Release);
        match self.done.recv_timeout(timeout) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                if thread.join().is_err() {
                    return Err(Error::Internal(
                        "the proxy thread panicked outside its handler".into(),
                    ));
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // A handler is blocked (e.g. in a transport call with a longer timeout). The thread
                // is detached; it exits once the handler returns, as the stop flag is set.
                let s = self.stats();
                return Err(Error::Timeout {
                    what: format!(
                        "the proxy thread to stop ({} triggers handled, a handler is still running)",
                        s.handled
                    ),
                    timeout,
                });
            }
        }
        self.check().map(|()| self.stats())
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if self.thread.is_some() {
            if let Err(e) = self.stop(Duration::from_secs(10)) {
                tracing::error!("stopping the proxy on drop: {e}");
            }
        }
    }
}

/// Empty polls before the proxy thread starts yielding its core (about 0.1-0.5 ms of spinning).
/// A yield is a system call that delays the next poll, so a proxy that yields too soon adds
/// microseconds to the first trigger of each burst.
const IDLE_SPINS_BEFORE_YIELD: u32 = 1 << 14;

/// The proxy thread's loop.
fn run(mut fifo: Fifo, mut handler: impl ProxyHandler, shared: &ProxyShared) {
    let mut idle = 0u32;
    loop {
        // The process is exiting: the driver is about to tear down what the handler would use
        // (`process`'s module docs). Kernels that still wait on this FIFO give up on their budget.
        if crate::process::exiting() {
            return;
        }
        if let Some(trigger) = fifo.poll() {
            idle = 0;
            // A panicking handler must not take the thread down: kernels would wait forever.
            let result = std::panic::catch_unwind(AssertUnwindSafe(|| handler.handle(trigger)))
                .unwrap_or_else(|_| {
                    Err(Error::Internal(format!(
                        "proxy handler panicked on {trigger:?}"
                    )))
                });
            fifo.pop();
            let stop = match result {
                Ok(ProxyAction::Continue) => false,
                Ok(ProxyAction::Stop) => true,
                Err(e) => {
                    shared.record(e);
                    false
                }
            };
            // Counted once its error is recorded: whoever sees it handled also sees its error
            // (`check` right after `wait_handled` found nothing when this came first).
            shared.handled.fetch_add(1, Ordering::Release);
            if stop {
                return;
            }
            continue;
        }
        if shared.stop.load(Ordering::Acquire) {
            // Positions taken before the stop may not be written yet; wait for them (host-readable
            // heads only: a device head cannot be read, and kernels have finished by then anyway).
            let deadline = shared.drain_deadline.lock().ok().and_then(|d| *d);
            let behind = fifo.head().is_some_and(|h| fifo.tail() < h);
            if !(behind && deadline.is_some_and(|d| Instant::now() < d)) {
                if behind {
                    tracing::warn!(
                        "proxy stopped with positions {}..{:?} taken but never written",
                        fifo.tail(),
                        fifo.head()
                    );
                }
                return;
            }
        }
        // Spin briefly for low latency, then yield so an idle proxy does not starve other threads.
        idle = idle.saturating_add(1);
        if idle < IDLE_SPINS_BEFORE_YIELD {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// The default handler: tables of registered memories and semaphores, indexed by the ids that
/// triggers carry (MSCCL++'s `ProxyService`). Fill the tables before starting the proxy.
pub struct TransportProxyHandler {
    memories: Vec<MemoryRegion>,
    semaphores: Vec<Arc<Host2DeviceSemaphore>>,
    flush_timeout: Duration,
    /// Set once the owning communicator failed: triggers are then popped without effect.
    failed: Option<FailureFlag>,
}

impl TransportProxyHandler {
    /// `flush_timeout` bounds each SYNC trigger's flush.
    pub fn new(flush_timeout: Duration) -> Self {
        TransportProxyHandler {
            memories: Vec::new(),
            semaphores: Vec::new(),
            flush_timeout,
            failed: None,
        }
    }

    /// Once `flag` is set (the communicator failed), triggers are popped without being carried
    /// out: a transfer to a peer that died would touch its freed memory (docs/fail-fast.md), one
    /// to a stopped peer would block the proxy until the transport's timeout, and the kernels
    /// that pushed them give up on their waits anyway. A trigger that fails sets it: the data or
    /// signal it owed never arrives, so the kernels waiting for it (here and at the peer) could
    /// only time out, and this rank's would hold it up to a device wait budget longer than its
    /// peers (on 2 + 1 ranks, past the bootstrap's timeout in the next collective step).
    pub fn skip_after_failure(&mut self, flag: FailureFlag) {
        self.failed = Some(flag);
    }

    /// Adds a memory region (local source or remote destination) and returns its trigger id.
    pub fn add_memory(&mut self, region: MemoryRegion) -> Result<u32> {
        let max = trigger_bits::mask(trigger_bits::MEMORY_ID_BITS);
        push_limited(&mut self.memories, region, max, "memory")
    }

    /// Adds a semaphore (its connection carries DATA and SYNC too) and returns its trigger id.
    pub fn add_semaphore(&mut self, semaphore: Arc<Host2DeviceSemaphore>) -> Result<u32> {
        let max = trigger_bits::mask(trigger_bits::SEMAPHORE_ID_BITS);
        push_limited(&mut self.semaphores, semaphore, max, "semaphore")
    }

    fn memory(&self, id: u32, role: &str) -> Result<&MemoryRegion> {
        self.memories.get(id as usize).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "trigger names {role} memory id {id}, but only {} memories are registered",
                self.memories.len()
            ))
        })
    }
}

fn push_limited<T>(table: &mut Vec<T>, item: T, max_id: u64, what: &str) -> Result<u32> {
    let id = u32::try_from(table.len()).unwrap_or(u32::MAX);
    if u64::from(id) > max_id {
        return Err(Error::InvalidArgument(format!(
            "too many {what}s for one proxy: trigger ids go up to {max_id}"
        )));
    }
    table.push(item);
    Ok(id)
}

impl ProxyHandler for TransportProxyHandler {
    fn handle(&mut self, trigger: ProxyTrigger) -> Result<ProxyAction> {
        let Some(flag) = self.failed.clone() else {
            return self.carry_out(trigger);
        };
        if flag.is_set() {
            return Ok(ProxyAction::Continue);
        }
        let result = self.carry_out(trigger);
        if let Err(e) = &result {
            // See `skip_after_failure`.
            flag.fail(&format!("the PortChannel proxy failed: {e}"));
        }
        result
    }
}

impl TransportProxyHandler {
    fn carry_out(&mut self, trigger: ProxyTrigger) -> Result<ProxyAction> {
        let f = trigger.decode().ok_or_else(|| {
            Error::Internal(format!(
                "proxy handed an empty FIFO slot to the handler: {trigger:?}"
            ))
        })?;
        let semaphore = self
            .semaphores
            .get(f.semaphore_id as usize)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "trigger names semaphore id {}, but only {} semaphores are registered",
                    f.semaphore_id,
                    self.semaphores.len()
                ))
            })?;
        if f.kind.contains(TriggerType::DATA) {
            let dst = self.memory(f.dst_memory_id, "destination")?;
            let src = self.memory(f.src_memory_id, "source")?;
            semaphore
                .connection()
                .write(dst, f.dst_offset, src, f.src_offset, f.size)?;
        }
        if f.kind.contains(TriggerType::FLAG) {
            semaphore.signal()?;
        }
        if f.kind.contains(TriggerType::SYNC) {
            semaphore.connection().flush(self.flush_timeout)?;
        }
        Ok(ProxyAction::Continue)
    }
}

/// Summary of latency samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatencyStats {
    pub samples: usize,
    pub min: Duration,
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
    pub mean: Duration,
}

impl LatencyStats {
    /// Summarises nanosecond samples (sorted in place); `None` when there are none.
    pub fn from_nanos(samples: &mut [u64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let n = samples.len();
        let at = |q: usize| Duration::from_nanos(samples[((n - 1) * q) / 100]);
        let sum: u128 = samples.iter().map(|&s| u128::from(s)).sum();
        Some(LatencyStats {
            samples: n,
            min: Duration::from_nanos(samples[0]),
            p50: at(50),
            p99: at(99),
            max: Duration::from_nanos(samples[n - 1]),
            mean: Duration::from_nanos(u64::try_from(sum / n as u128).unwrap_or(u64::MAX)),
        })
    }
}

/// A handler that measures trigger-to-handler latency: each trigger's `fst` carries its push time
/// in nanoseconds since `epoch` (see [`LatencyProbe::stamp`]); the handler records how long ago
/// that was when it starts. For device pushers, write a host-synchronised clock into `fst`.
pub struct LatencyProbe {
    epoch: Instant,
    samples: Arc<Mutex<Vec<u64>>>,
}

impl LatencyProbe {
    /// A probe and the shared sample list it fills.
    pub fn new(epoch: Instant) -> (Self, Arc<Mutex<Vec<u64>>>) {
        let samples = Arc::new(Mutex::new(Vec::new()));
        (
            LatencyProbe {
                epoch,
                samples: Arc::clone(&samples),
            },
            samples,
        )
    }

    /// A trigger stamped with the current time (no type bits: the probe only times it).
    pub fn stamp(epoch: Instant) -> ProxyTrigger {
        ProxyTrigger {
            fst: u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX),
            snd: 0,
        }
    }
}

impl ProxyHandler for LatencyProbe {
    fn handle(&mut self, trigger: ProxyTrigger) -> Result<ProxyAction> {
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let sample = now.saturating_sub(trigger.fst);
        self.samples
            .lock()
            .map_err(|_| Error::Internal("latency sample list lock poisoned".into()))?
            .push(sample);
        Ok(ProxyAction::Continue)
    }
}

/// Measures the host-to-proxy trigger latency: `count` triggers pushed one at a time from this
/// thread (each waits until the previous one was consumed, as a kernel's push + sync would), each
/// timed from push to handler start.
pub fn measure_host_trigger_latency(
    depth: u32,
    count: usize,
    timeout: Duration,
) -> Result<LatencyStats> {
    let fifo = Fifo::new(depth)?;
    let pusher = fifo.pusher();
    let epoch = Instant::now();
    let (probe, samples) = LatencyProbe::new(epoch);
    let mut proxy = Proxy::start(fifo, probe)?;
    for _ in 0..count {
        let pos = pusher.push(LatencyProbe::stamp(epoch), timeout)?;
        pusher.sync(pos, timeout)?;
    }
    proxy.stop(timeout)?;
    let mut samples = std::mem::take(
        &mut *samples
            .lock()
            .map_err(|_| Error::Internal("latency sample list lock poisoned".into()))?,
    );
    LatencyStats::from_nanos(&mut samples).ok_or_else(|| {
        Error::InvalidArgument("measure_host_trigger_latency: count must be > 0".into())
    })
}

/// Waits until `proxy` has consumed `count` triggers in total, at most `timeout` (for tests and
/// benchmarks that push from the host).
pub fn wait_handled(proxy: &Proxy, count: u64, timeout: Duration) -> Result<()> {
    let mut backoff = Backoff::new(timeout);
    while proxy.stats().handled < count {
        if !backoff.snooze() {
            return Err(Error::Timeout {
                what: format!(
                    "the proxy to handle {count} triggers ({} so far)",
                    proxy.stats().handled
                ),
                timeout,
            });
        }
    }
    Ok(())
}
