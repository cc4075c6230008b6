//! Communicator handles: what `ncclComm_t` points at. Handles are keys into a process-wide table,
//! never dereferenced, so a destroyed, aborted or made-up handle is an error naming it instead of
//! undefined behaviour, and a handle may be destroyed while another thread still uses its comm.

use crate::abi::{NcclResult, IN_PROGRESS};
use crate::comm::Comm;
use crate::guard::{CallResult, Failure};
use mscclpp::core::bootstrap::UniqueId;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// `ncclComm_t` as Rust sees it.
pub type Handle = *mut std::ffi::c_void;

/// Where a communicator is in its life.
pub enum State {
    /// Nonblocking or grouped init under way (`ncclCommGetAsyncError` says `ncclInProgress`).
    Initializing,
    Ready(Arc<Comm>),
    Failed(Failure),
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

    /// Ends an init: ready, or failed with the failure recorded for `ncclGetLastError`.
    pub fn finish(&self, call: &str, result: CallResult<Comm>) {
        *self.state() = match result {
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
            State::Ready(_) => Ok(crate::abi::SUCCESS),
            State::Failed(f) => Err(f.clone()),
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

pub fn lookup(handle: Handle) -> CallResult<Arc<Entry>> {
    let k = key(handle)?;
    table().get(&k).cloned().ok_or_else(|| unknown(handle))
}

pub fn remove(handle: Handle) -> CallResult<Arc<Entry>> {
    let k = key(handle)?;
    table().remove(&k).ok_or_else(|| unknown(handle))
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
    }
}

/// The communicator behind `handle`, for an operation: a communicator with an asynchronous error
/// (aborted, revoked, a device wait that timed out) fails every operation with that error.
pub fn ready(handle: Handle) -> CallResult<Arc<Comm>> {
    let comm = live(handle)?;
    if let Some(e) = comm.communicator.async_error() {
        return Err(e.into());
    }
    Ok(comm)
}

/// Frees a destroyed communicator. Its teardown meets the job's other ranks (a bootstrap
/// barrier), so while ranks of the same job still live in this process (one thread driving
/// several ranks) it waits in `RETIRED`, and the last rank's destroy tears them all down together.
pub fn retire(comm: Arc<Comm>) {
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
}
