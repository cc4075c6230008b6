//! The `Transport` trait: what one link to one peer can do, host side.
//!
//! A transport moves bytes between registered memory regions and bumps remote semaphores. The
//! semantics follow MSCCL++'s `Connection`: `write` and `update_and_sync` are asynchronous and ordered
//! per connection; `flush` waits until everything issued so far is complete at the destination, with
//! a timeout. Kinds: CUDA/HIP IPC on one host, InfiniBand verbs, Ethernet (TCP staged through host
//! memory), and the IB-less stub that refuses every request with a reason.
//!
//! # Thread safety
//! Implementations are `Send + Sync`; calls from several threads on one connection are serialised by
//! the implementation, and the order of operations is the order in which calls returned.

use crate::error::Result;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;

/// Which mechanism a connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TransportKind {
    /// Peer GPU memory mapped through CUDA/HIP IPC on one host.
    CudaIpc,
    /// InfiniBand verbs on the HCA with this index in MSCCLPP_HCA_DEVICES (or the system list).
    Ib(u8),
    /// TCP between hosts, staged through host memory.
    Ethernet,
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransportKind::CudaIpc => f.write_str("CudaIpc"),
            TransportKind::Ib(i) => write!(f, "IB{i}"),
            TransportKind::Ethernet => f.write_str("Ethernet"),
        }
    }
}

/// A region of registered memory as a transport sees it: its address in the owner's address space
/// (device or host) and a transport-specific key (IB rkey/lkey; 0 where unused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryRegion {
    pub addr: u64,
    pub size: u64,
    pub key: u32,
}

impl MemoryRegion {
    /// Checks that `[offset, offset+bytes)` lies inside the region; the error names both.
    pub fn check_range(&self, offset: u64, bytes: u64, what: &str) -> Result<()> {
        match offset.checked_add(bytes) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(crate::Error::InvalidArgument(format!(
                "{what}: range [{offset}, {offset}+{bytes}) exceeds the registered size {}",
                self.size
            ))),
        }
    }
}

/// One connection to one peer. See the module docs for ordering and thread safety.
pub trait Transport: Send + Sync {
    fn kind(&self) -> TransportKind;

    /// The rank at the other end.
    fn remote_rank(&self) -> usize;

    /// Copies `bytes` from `src + src_offset` (local) to `dst + dst_offset` (remote). Returns once
    /// the copy is issued; `flush` waits for it. Out-of-range offsets are `InvalidArgument`.
    fn write(
        &self,
        dst: &MemoryRegion,
        dst_offset: u64,
        src: &MemoryRegion,
        src_offset: u64,
        bytes: u64,
    ) -> Result<()>;

    /// Atomically sets the remote 64-bit semaphore at `dst + dst_offset` to `new_value`, ordered after
    /// every earlier `write` on this connection (so the peer that sees the value sees the data).
    fn update_and_sync(&self, dst: &MemoryRegion, dst_offset: u64, new_value: u64) -> Result<()>;

    /// Waits until every operation issued so far has completed at the destination, or `timeout`.
    fn flush(&self, timeout: Duration) -> Result<()>;

    /// Where the peer's `update_and_sync` calls on this connection land here: `word`, a local
    /// 64-bit semaphore word. Most transports carry the address with each update and ignore this;
    /// IB in write-with-immediate mode (`MSCCLPP_IBV_MODE=host-no-atomic`) carries only the value,
    /// so its receiver stores every update into this word (and refuses a second, different one).
    fn deliver_signals_to(&self, word: MemoryRegion) -> Result<()> {
        let _ = word;
        Ok(())
    }
}

pub mod connect;
pub mod cuda_ipc;
pub mod device_memory;
pub mod ethernet;
pub mod host_memory;
pub mod select;

pub use cuda_ipc::CudaIpcTransport;
pub use device_memory::DeviceMemoryResolver;
pub use ethernet::{EthernetConfig, EthernetListener, EthernetTransport};
pub use host_memory::{HostMemoryRegistry, MemoryResolver};
