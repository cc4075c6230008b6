//! Per-(peer, kind, tag) receive queues: reader threads push, receivers wait with a deadline.
//!
//! Reader threads never block on a receiver: they append to an in-memory queue and wake waiters.
//! That keeps every socket drained, so a large blocking send can never deadlock against a send
//! in the other direction. Waiters learn promptly when a peer's connection closes or when the job
//! was aborted, instead of sleeping until their timeout.

use super::wire::FrameKind;
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Queue key: sender rank, traffic kind (user or collective), tag.
pub(crate) type Key = (usize, FrameKind, u64);

#[derive(Default)]
struct State {
    queues: HashMap<Key, VecDeque<Vec<u8>>>,
    /// Peers whose incoming connection ended, with the reason given to waiters.
    closed: HashMap<usize, String>,
    /// Peers that ended theirs with a goodbye (a clean shutdown, not a failure).
    said_goodbye: std::collections::HashSet<usize>,
    /// Set once a collective failed anywhere: (rank blamed, reason). Poisons every later wait
    /// that finds its queue empty, since the job cannot make progress any more.
    aborted: Option<(usize, String)>,
    /// Set when this rank gave up on the bootstrap itself (`Bootstrap::interrupt`): every wait
    /// that finds its queue empty fails at once with the reason. Local: nothing is sent.
    interrupted: Option<String>,
    /// The owning bootstrap is being dropped.
    shutdown: bool,
}

pub(crate) struct Mailbox {
    state: Mutex<State>,
    cv: Condvar,
}

impl Mailbox {
    pub fn new() -> Self {
        Mailbox {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        }
    }

    /// A panic elsewhere while holding the lock leaves the maps consistent (every update is a
    /// single insert/remove), so poisoning is ignored rather than turned into a panic here.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn push(&self, key: Key, data: Vec<u8>) {
        self.lock().queues.entry(key).or_default().push_back(data);
        self.cv.notify_all();
    }

    /// Marks `peer`'s incoming connection as ended; waiters on it get `Error::Peer{peer, reason}`
    /// once its queued messages are consumed.
    pub fn close_peer(&self, peer: usize, reason: String) {
        self.lock().closed.entry(peer).or_insert(reason);
        self.cv.notify_all();
    }

    /// As [`close_peer`](Self::close_peer), for a peer that said goodbye.
    pub fn goodbye(&self, peer: usize, reason: String) {
        self.lock().said_goodbye.insert(peer);
        self.close_peer(peer, reason);
    }

    pub fn said_goodbye(&self, peer: usize) -> bool {
        self.lock().said_goodbye.contains(&peer)
    }

    /// Records a job-wide failure. Returns true the first time, so the caller forwards it once.
    pub fn abort(&self, rank: usize, reason: String) -> bool {
        let mut st = self.lock();
        if st.aborted.is_some() {
            return false;
        }
        st.aborted = Some((rank, reason));
        drop(st);
        self.cv.notify_all();
        true
    }

    pub fn aborted(&self) -> Option<(usize, String)> {
        self.lock().aborted.clone()
    }

    /// Fails every wait in progress and every later one whose queue is empty with
    /// `Error::Aborted(reason)` (the first reason wins). Sticky.
    pub fn interrupt(&self, reason: &str) {
        self.lock()
            .interrupted
            .get_or_insert_with(|| reason.to_string());
        self.cv.notify_all();
    }

    pub fn interrupted(&self) -> Option<String> {
        self.lock().interrupted.clone()
    }

    pub fn shutdown(&self) {
        self.lock().shutdown = true;
        self.cv.notify_all();
    }

    /// Takes the next message under `key`, waiting until `deadline`. `what` names the awaited
    /// message for the timeout error (it includes the peer rank).
    pub fn wait(
        &self,
        key: Key,
        deadline: Instant,
        timeout: Duration,
        what: impl Fn() -> String,
    ) -> Result<Vec<u8>> {
        let mut st = self.lock();
        loop {
            if let Some(msg) = st.take(key, &what)? {
                return Ok(msg);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: what(),
                    timeout,
                });
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The next message under `key` if one is queued, without waiting; the errors of
    /// [`wait`](Self::wait) (a closed peer, an aborted job) once the queue is empty.
    pub fn try_take(&self, key: Key, what: impl Fn() -> String) -> Result<Option<Vec<u8>>> {
        self.lock().take(key, &what)
    }
}

impl State {
    /// The next message under `key`; `None` while none is queued and waiting could still bring
    /// one; the reason it never will otherwise.
    fn take(&mut self, key: Key, what: &impl Fn() -> String) -> Result<Option<Vec<u8>>> {
        let peer = key.0;
        if let Some(q) = self.queues.get_mut(&key) {
            if let Some(msg) = q.pop_front() {
                if q.is_empty() {
                    // Collective tags are sequence numbers: drop empty queues so the map
                    // does not grow with every call.
                    self.queues.remove(&key);
                }
                return Ok(Some(msg));
            }
        }
        if let Some(reason) = &self.interrupted {
            return Err(Error::Aborted(reason.clone()));
        }
        // Liveness answers are awaited after a failure too: they name who stalled.
        if let (Some((rank, reason)), false) = (&self.aborted, key.1 == FrameKind::Pong) {
            return Err(Error::Peer {
                rank: *rank,
                message: format!("job aborted: {reason}"),
            });
        }
        if let Some(reason) = self.closed.get(&peer) {
            return Err(Error::Peer {
                rank: peer,
                message: reason.clone(),
            });
        }
        if self.shutdown {
            return Err(Error::Bootstrap(format!(
                "bootstrap shut down while waiting for {}",
                what()
            )));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn delivers_in_order_then_reports_close() {
        let m = Mailbox::new();
        let k = (1, FrameKind::User, 9);
        m.push(k, vec![1]);
        m.push(k, vec![2]);
        m.close_peer(1, "connection closed".into());
        let dl = Instant::now() + T;
        assert_eq!(m.wait(k, dl, T, String::new).unwrap(), vec![1]);
        assert_eq!(m.wait(k, dl, T, String::new).unwrap(), vec![2]);
        match m.wait(k, dl, T, String::new) {
            Err(Error::Peer { rank: 1, message }) => assert_eq!(message, "connection closed"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn try_take_does_not_wait_and_reports_close() {
        let m = Mailbox::new();
        let k = (1, FrameKind::User, 4);
        assert_eq!(m.try_take(k, String::new).unwrap(), None);
        m.push(k, vec![7]);
        m.close_peer(1, "gone".into());
        assert_eq!(m.try_take(k, String::new).unwrap(), Some(vec![7]));
        assert!(matches!(
            m.try_take(k, String::new),
            Err(Error::Peer { rank: 1, .. })
        ));
    }

    /// An interrupt releases a waiter blocked with a long deadline at once, and every later wait on
    /// an empty queue fails the same way; messages already queued are still delivered.
    #[test]
    fn an_interrupt_releases_a_blocked_waiter_at_once() {
        let m = Arc::new(Mailbox::new());
        let k = (1, FrameKind::Collective, 3);
        let waiter = {
            let m = m.clone();
            std::thread::spawn(move || {
                let start = Instant::now();
                let r = m.wait(k, Instant::now() + Duration::from_secs(60), T, String::new);
                (r, start.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        m.interrupt("ncclCommAbort");
        m.interrupt("second");
        let (r, took) = waiter.join().unwrap();
        assert!(
            matches!(&r, Err(Error::Aborted(why)) if why == "ncclCommAbort"),
            "{r:?}"
        );
        assert!(took < Duration::from_secs(5), "{took:?}");
        m.push(k, vec![1]);
        assert_eq!(
            m.wait(k, Instant::now() + T, T, String::new).unwrap(),
            vec![1]
        );
        assert!(matches!(m.try_take(k, String::new), Err(Error::Aborted(_))));
        assert_eq!(m.interrupted().as_deref(), Some("ncclCommAbort"));
        assert!(
            m.aborted().is_none(),
            "an interrupt is local, not a job abort"
        );
    }

    #[test]
    fn times_out_with_name() {
        let m = Mailbox::new();
        let t = Duration::from_millis(30);
        let e = m
            .wait((2, FrameKind::User, 0), Instant::now() + t, t, || {
                "rank 2".into()
            })
            .unwrap_err();
        assert!(
            matches!(e, Error::Timeout { ref what, .. } if what == "rank 2"),
            "{e}"
        );
    }

    #[test]
    fn wakes_blocked_waiter_on_push() {
        let m = Arc::new(Mailbox::new());
        let k = (0, FrameKind::Collective, 3);
        let m2 = Arc::clone(&m);
        let h = std::thread::spawn(move || m2.wait(k, Instant::now() + T, T, String::new));
        std::thread::sleep(Duration::from_millis(20));
        m.push(k, vec![5]);
        assert_eq!(h.join().unwrap().unwrap(), vec![5]);
    }
}
