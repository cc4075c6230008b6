//! Communicator handles: what `ncclComm_t` points at. Handles are keys into a process-wide table,
//! never dereferenced, so a made-up handle is an error naming it instead of undefined behaviour.
//!
//! A handle keeps its entry after `ncclCommDestroy` or `ncclCommAbort` (a few bytes: the
//! communicator itself is gone), so calls racing a teardown from another thread are answered
//! instead of failing: PyTorch's watchdog calls ncclCommGetAsyncError, ncclCommAbort and
//! ncclCommDestroy from its own thread while the main thread may still be inside a call on the
//! same communicator. A second destroy or abort is a no-op, ncclCommGetAsyncError says how the
//! communicator ended, and operations fail naming it as destroyed or aborted.
//!
//! A call holds the communicator (`Arc<Comm>`) for as long as it runs, so a destroy or abort from
//! another thread only drops the table's reference: the teardown runs when the last call on it
//! returns, on that call's thread, never under a call in flight.

use crate::abi::{NcclResult, IN_PROGRESS, SUCCESS};
use crate::comm::Comm;
use crate::guard::{code_of, CallResult, Failure};
use mscclpp::core::bootstrap::UniqueId;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// `ncclComm_t` as Rust sees it.
pub type Handle = *mut std::ffi::c_void;

/// How a communicator's handle was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Destroy,
    Abort,
}

impl Ending {
    fn past(self) -> &'static str {
        match self {
            Ending::Destroy => "destroyed",
            Ending::Abort => "aborted",
        }
    }
}

/// Where a communicator is in its life.
#[derive(Clone)]
pub enum State {
    /// Nonblocking or grouped init under way (`ncclCommGetAsyncError` says `ncclInProgress`).
    Initializing,
    Ready(Arc<Comm>),
    Failed(Failure),
    /// Destroyed or aborted; `code` is what ncclCommGetAsyncError says from then on: the
    /// communicator's error when it ended (`ncclSuccess` for a healthy one destroyed).
    Closed {
        ending: Ending,
        code: NcclResult,
    },
}

pub struct Entry {
    pub state: Mutex<State>,
    /// The bootstrap job the communicator belongs to (several ranks of one job may live in one
    /// process: ncclCommInitAll, grouped inits).
    pub job: UniqueId,
}

impl Entry {
    pub fn initializing(job: UniqueId) -> Arc<Entry> {
        Arc::new(Entry {
            state: Mutex::new(State::Initializing),
            job,
        })
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends an init: ready, or failed with the failure recorded for `ncclGetLastError`. A handle
    /// destroyed or aborted while its init ran stays closed: the new communicator is aborted and
    /// torn down (here: no call can hold it yet).
    pub fn finish(&self, call: &str, result: CallResult<Comm>) {
        let mut state = self.state();
        if let State::Closed { ending, .. } = *state {
            drop(state);
            if let Ok(comm) = result {
                comm.abort(&format!(
                    "the handle was {} while its init ran",
                    ending.past()
                ));
                retire(Arc::new(comm));
            }
            return;
        }
        *state = match result {
            Ok(comm) => State::Ready(Arc::new(comm)),
            Err(f) => {
                crate::guard::record(call, &f);
                State::Failed(f)
            }
        };
    }

    /// The init result as a code: success, still in progress, or the failure.
    pub fn init_result(&self) -> CallResult<NcclResult> {
        match &*self.state() {
            State::Initializing => Ok(IN_PROGRESS),
            State::Ready(_) => Ok(SUCCESS),
            State::Failed(f) => Err(f.clone()),
            State::Closed { ending, .. } => Err(Failure::invalid_argument(format!(
                "the communicator was {} during its init",
                ending.past()
            ))),
        }
    }
}

static TABLE: Mutex<BTreeMap<usize, Arc<Entry>>> = Mutex::new(BTreeMap::new());
static NEXT: AtomicUsize = AtomicUsize::new(1);
/// Destroyed communicators whose job still has live ranks in this process (see [`retire`]).
static RETIRED: Mutex<Vec<Arc<Comm>>> = Mutex::new(Vec::new());

fn table() -> MutexGuard<'static, BTreeMap<usize, Arc<Entry>>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn register(entry: Arc<Entry>) -> Handle {
    // Aligned, non-null, never a real address of ours.
    let key = NEXT.fetch_add(1, Ordering::Relaxed) << 4;
    table().insert(key, entry);
    key as Handle
}

fn key(handle: Handle) -> CallResult<usize> {
    if handle.is_null() {
        return Err(Failure::invalid_argument("comm is NULL"));
    }
    Ok(handle as usize)
}

fn unknown(handle: Handle) -> Failure {
    Failure::invalid_argument(format!(
        "comm {handle:p} is not a live communicator (destroyed, aborted, or never created)"
    ))
}

/// The entry behind `handle`, closed ones included.
pub fn lookup(handle: Handle) -> CallResult<Arc<Entry>> {
    let k = key(handle)?;
    table().get(&k).cloned().ok_or_else(|| unknown(handle))
}

/// Forgets `handle` entirely (a blocking init that failed: the handle was never handed out).
pub fn remove(handle: Handle) -> CallResult<Arc<Entry>> {
    let k = key(handle)?;
    table().remove(&k).ok_or_else(|| unknown(handle))
}

/// Closes `handle` (destroy or abort): the table's reference to its communicator, if it has one
/// and this is the first close; `None` when it was closed already (a no-op), failed its init, is
/// still initialising (the init's end sees the handle closed), or is NULL (as NCCL). An abort
/// flags the communicator first (kernels and host waits give up within about a millisecond:
/// `Comm::abort`), under the entry's lock, so no call can pick it up healthy after this returns.
pub fn close(handle: Handle, ending: Ending) -> CallResult<Option<Arc<Comm>>> {
    // NCCL's destroy and abort of NULL succeed doing nothing; PyTorch's watchdog aborts a
    // communicator it has already aborted (its handle then NULL) and dies on an error.
    if handle.is_null() {
        return Ok(None);
    }
    let entry = lookup(handle)?;
    let mut state = entry.state();
    let (comm, code) = match &*state {
        State::Closed { .. } => return Ok(None),
        State::Initializing => (
            None,
            match ending {
                Ending::Abort => crate::abi::SYSTEM_ERROR,
                Ending::Destroy => SUCCESS,
            },
        ),
        State::Failed(f) => (None, f.code),
        State::Ready(c) => {
            if ending == Ending::Abort {
                c.abort("ncclCommAbort");
            }
            c.watchdog.closed();
            let code = c.async_error().map_or(SUCCESS, |e| code_of(&e));
            (Some(c.clone()), code)
        }
    };
    *state = State::Closed { ending, code };
    Ok(comm)
}

/// The initialised communicator behind `handle`, whatever its health (queries, split, shrink).
pub fn live(handle: Handle) -> CallResult<Arc<Comm>> {
    match &*lookup(handle)?.state() {
        State::Ready(c) => Ok(c.clone()),
        State::Initializing => Err(Failure::invalid_usage(
            "the communicator is still initialising (nonblocking init): poll \
             ncclCommGetAsyncError until it no longer returns ncclInProgress",
        )),
        State::Failed(f) => Err(Failure::new(
            f.code,
            format!("the communicator's init failed: {}", f.message),
        )),
        State::Closed { ending, .. } => Err(Failure::invalid_argument(format!(
            "comm {handle:p} is not a live communicator: it was {}",
            ending.past()
        ))),
    }
}

/// Runs an operation on the communicator behind `handle`. A communicator with an asynchronous
/// error (aborted, revoked, a device wait that timed out) fails it with that error; a failure of
/// a communicator that has failed is returned once its watchdog has acted ([`crate::watchdog`]).
pub fn operate(handle: Handle, body: impl FnOnce(&Arc<Comm>) -> CallResult) -> CallResult {
    let comm = live(handle)?;
    let result = match comm.communicator.async_error() {
        Some(e) => Err(e.into()),
        None => body(&comm),
    };
    if result.is_err() {
        await_watchdog(&comm);
    }
    result
}

/// Before a failure on `comm` is returned: when the communicator has failed, waits (bounded) for
/// its watchdog to abort it ([`crate::watchdog`]).
pub fn await_watchdog(comm: &Comm) {
    if comm.async_error().is_some() {
        comm.watchdog.await_close();
    }
}

/// Drops the table's reference to a destroyed or aborted communicator; the teardown runs when
/// the last reference goes (here, or when a call in flight on another thread returns). A healthy
/// communicator's teardown meets the job's other ranks (a bootstrap barrier), so while ranks of
/// the same job still live in this process (one thread driving several ranks) it waits in
/// `RETIRED`, and the last rank's destroy tears them all down together. A failed one meets
/// nobody (its teardown skips the barriers), so it goes at once.
pub fn retire(comm: Arc<Comm>) {
    if comm.communicator.async_error().is_some() {
        drop(comm);
        return;
    }
    let job = comm.job.clone();
    let mut retired = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
    retired.push(comm);
    let job_alive = table().values().any(|e| match &*e.state() {
        State::Ready(c) => c.job == job,
        _ => false,
    });
    if job_alive {
        return;
    }
    let (batch, rest): (Vec<_>, Vec<_>) = retired.drain(..).partition(|c| c.job == job);
    *retired = rest;
    drop(retired);
    std::thread::scope(|s| {
        for c in batch {
            s.spawn(move || drop(c));
        }
    });
}

/// What ncclCommGetAsyncError reports for `handle`: still initialising, the init's failure, the
/// communicator's asynchronous error (ours, then the real NCCL's), or how it ended. Answered from
/// the entry looked up once, so a destroy or abort racing it from another thread changes the
/// answer, never turns it into an error.
pub fn async_error_code(handle: Handle) -> CallResult<NcclResult> {
    let entry = lookup(handle)?;
    // The state is copied out: the lock is not held while the real NCCL is asked.
    let state = entry.state().clone();
    Ok(match state {
        State::Initializing => IN_PROGRESS,
        State::Failed(f) => f.code,
        State::Closed { code, .. } => code,
        State::Ready(c) => {
            c.watchdog.polled();
            match c.async_error() {
                Some(e) => {
                    let f = Failure::from(e);
                    crate::guard::record("ncclCommGetAsyncError", &f);
                    f.code
                }
                None => c.real_async_error(),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp::core::bootstrap::SECRET_LEN;

    #[test]
    fn handles_are_checked_not_dereferenced() {
        let job = UniqueId::from_parts("127.0.0.1:1".parse().unwrap(), [1; SECRET_LEN]);
        let h = register(Entry::initializing(job));
        assert!(!h.is_null() && (h as usize) % 16 == 0);
        let e = live(h).err().expect("an initialising comm is not live");
        assert!(e.message.contains("still initialising"), "{e:?}");
        assert!(remove(h).is_ok());
        let e = lookup(h).err().expect("removed");
        assert!(e.message.contains("not a live communicator"), "{e:?}");
        let e = lookup(std::ptr::null_mut()).err().expect("null");
        assert_eq!(e.code, crate::abi::INVALID_ARGUMENT);
        let e = lookup(0x1234 as Handle).err().expect("made up");
        assert!(e.message.contains("0x1234"), "{e:?}");
    }

    /// A handle closed while its init runs stays closed: a second close is a no-op, the async
    /// error says it was aborted, and the init's end does not revive it.
    #[test]
    fn a_closed_handle_stays_closed_and_answers() {
        let job = UniqueId::from_parts("127.0.0.1:1".parse().unwrap(), [2; SECRET_LEN]);
        let entry = Entry::initializing(job);
        let h = register(entry.clone());
        assert!(close(h, Ending::Abort).expect("first close").is_none());
        assert!(close(h, Ending::Destroy).expect("second close").is_none());
        assert!(close(h, Ending::Abort).expect("third close").is_none());
        assert_eq!(async_error_code(h), Ok(crate::abi::SYSTEM_ERROR));
        entry.finish("test", Err(Failure::invalid_usage("late")));
        assert!(matches!(
            *entry.state(),
            State::Closed {
                ending: Ending::Abort,
                ..
            }
        ));
        let e = live(h).err().expect("closed");
        assert!(e.message.contains("it was aborted"), "{e:?}");
        assert!(init_result_is_err(&entry));
    }

    fn init_result_is_err(entry: &Entry) -> bool {
        entry.init_result().is_err()
    }
}
