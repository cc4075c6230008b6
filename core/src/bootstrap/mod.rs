//! Bootstrap: how ranks find each other and exchange small messages before any GPU link exists.
//!
//! The [`Bootstrap`] trait is the interface the communicator uses; `TcpBootstrap` implements it
//! over TCP with MSCCL++'s semantics (UniqueId from rank 0, ring/all-to-all sockets, tags).

use crate::error::Result;
use std::sync::Weak;
use std::time::Duration;

mod collectives;
pub mod config;
pub mod iface;
mod mailbox;
mod root;
mod sock;
pub mod sub;
pub mod tcp;
pub mod unique_id;
mod wire;

pub use config::BootstrapConfig;
pub use iface::{list_interfaces, InterfaceAddr};
pub use sub::SubBootstrap;
pub use tcp::{root_address_from_env, TcpBootstrap};
pub use unique_id::UniqueId;
pub use wire::{Secret, SECRET_LEN};

/// Told once when the job fails: a peer's process died (its bootstrap connection closed without a
/// goodbye) or a collective failed on some rank. Communicators subscribe to abort themselves.
pub trait FailureListener: Send + Sync {
    /// `rank` is the rank blamed, `reason` says why. Called on a bootstrap thread: must not block.
    fn job_failed(&self, rank: usize, reason: &str);
}

/// Out-of-band messaging between the ranks of one job.
///
/// Every blocking call has a timeout (from the environment or the constructor) and, when it
/// expires, returns `Error::Timeout` naming the rank that did not answer. Messages between one
/// (sender, receiver, tag) triple are delivered in order. `Send + Sync`: calls may come from several
/// threads; calls that involve every rank (all_gather, barrier, broadcast) must be made in the same
/// order by every rank: a rank that meets a peer in another one fails with an error naming both
/// (the TCP bootstrap then aborts the job, so every rank fails).
pub trait Bootstrap: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Sends `data` to `peer` under `tag`; returns once the bytes are handed to the OS.
    fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()>;
    /// Receives the next message from `peer` under `tag`.
    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>>;
    /// The next message from `peer` under `tag` if one has arrived, without waiting (a host
    /// protocol that must not block, e.g. the point-to-point engine's buffer offers). The default:
    /// a bootstrap that cannot tell whether a message has arrived reports none, so callers must
    /// treat `None` as "not yet", never as "never".
    fn try_recv(&self, peer: usize, tag: u64) -> Result<Option<Vec<u8>>> {
        let _ = (peer, tag);
        Ok(None)
    }
    /// Every rank contributes `data` (sizes may differ); every rank gets all contributions, indexed
    /// by rank.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;
    /// `root`'s `data` reaches every rank; the argument is ignored on other ranks.
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>>;

    /// Subscribes `listener` to the job's failure: it is called once, within a second of a peer's
    /// process dying, or at once if the job already failed. Held weakly, so dropping the listener
    /// unsubscribes it. Collective in the sense that every rank subscribes at the same point (the
    /// TCP bootstrap opens its liveness link then). The default never calls: a bootstrap without
    /// liveness (tests' in-process mocks).
    fn watch_failures(&self, listener: Weak<dyn FailureListener>) {
        let _ = listener;
    }

    /// Peers that did not answer a liveness ping within `within`: stopped (SIGSTOP), hung in the
    /// kernel, or dead (peers that shut down cleanly, with a goodbye, are not counted). Used to name the rank behind a device wait that timed out. The default
    /// knows of none.
    fn unresponsive_peers(&self, within: Duration) -> Vec<usize> {
        let _ = within;
        Vec::new()
    }

    /// Gives up on this bootstrap on this rank: every wait in progress (a collective, a receive)
    /// and every later call fails at once with `Error::Aborted(reason)`. Local: the peers are not
    /// told and the job is not aborted (the peers learn when this rank's bootstrap goes away), so
    /// it is what an `ncclCommAbort` of this rank's communicator does to a thread blocked in one
    /// of its host waits. Callable from any thread; never blocks. Sticky. The default does
    /// nothing (a bootstrap whose waits cannot be interrupted).
    fn interrupt(&self, reason: &str) {
        let _ = reason;
    }

    /// Fails the whole job, blaming `rank` (a rank of this bootstrap) with `reason`: this rank's
    /// failure listeners hear it at once, the peers' when the flood reaches them, and every later
    /// wait fails naming it; the first failure of a job wins. For a cause found outside the
    /// bootstrap, such as a peer that does not answer after a device wait gave up, so that every
    /// rank reports that peer rather than the rank that noticed first and left. Never blocks.
    /// The default does nothing (a bootstrap without liveness links: tests' in-process mocks).
    fn abort_job(&self, rank: usize, reason: &str) {
        let _ = (rank, reason);
    }

    /// `rank`'s rank in the whole job, which errors name: a sub-bootstrap's ranks are its group's
    /// (`SubBootstrap`), so "rank 1" of a cross-host group would be a different process than the
    /// job's rank 1. The default: the same rank (a bootstrap of the whole job).
    fn job_rank(&self, rank: usize) -> usize {
        rank
    }
}

/// Test support: runs `body(rank, bootstrap)` on `n` ranks of one TCP bootstrap job over loopback
/// whose steps time out after `timeout`, a thread each; their results in rank order (a rank that
/// panics fails the test).
#[cfg(any(test, feature = "testing"))]
pub fn on_loopback_ranks<T: Send + 'static>(
    n: usize,
    timeout: Duration,
    body: impl Fn(usize, std::sync::Arc<dyn Bootstrap>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    use std::sync::Arc;
    let cfg = BootstrapConfig::default().with_timeout(timeout);
    let id = TcpBootstrap::create_unique_id(&cfg).expect("unique id");
    let body = Arc::new(body);
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let (id, cfg, body) = (id.clone(), cfg.clone(), body.clone());
            std::thread::spawn(move || {
                let boot = TcpBootstrap::new(rank, n, &id, &cfg).expect("bootstrap");
                body(rank, Arc::new(boot))
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("rank thread"))
        .collect()
}
