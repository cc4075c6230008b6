//! Bootstrap: how ranks find each other and exchange small messages before any GPU link exists.
//!
//! The [`Bootstrap`] trait is the interface the communicator uses; `TcpBootstrap` implements it
//! over TCP with MSCCL++'s semantics (UniqueId from rank 0, ring/all-to-all sockets, tags).

use crate::error::Result;

mod collectives;
pub mod config;
pub mod iface;
mod mailbox;
mod root;
mod sock;
pub mod tcp;
pub mod unique_id;
mod wire;

pub use config::BootstrapConfig;
pub use iface::{list_interfaces, InterfaceAddr};
pub use tcp::{root_address_from_env, TcpBootstrap};
pub use unique_id::UniqueId;
pub use wire::{Secret, SECRET_LEN};

/// Out-of-band messaging between the ranks of one job.
///
/// Every blocking call has a timeout (from the environment or the constructor) and, when it
/// expires, returns `Error::Timeout` naming the rank that did not answer. Messages between one
/// (sender, receiver, tag) triple are delivered in order. `Send + Sync`: calls may come from several
/// threads; calls that involve every rank (all_gather, barrier, broadcast) must be made in the same
/// order by every rank.
pub trait Bootstrap: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Sends `data` to `peer` under `tag`; returns once the bytes are handed to the OS.
    fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()>;
    /// Receives the next message from `peer` under `tag`.
    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>>;
    /// Every rank contributes `data` (sizes may differ); every rank gets all contributions, indexed
    /// by rank.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;
    /// `root`'s `data` reaches every rank; the argument is ignored on other ranks.
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>>;
}
