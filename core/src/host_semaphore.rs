//! Semaphores signalled by the host through a [`Transport`] (MSCCL++'s `Host2DeviceSemaphore` and
//! `Host2HostSemaphore`).
//!
//! A semaphore pair is an *outbound* counter on the signalling side and an *inbound* 64-bit word on
//! the waiting side. `signal` increments the outbound counter and sets the peer's inbound word to the
//! new value with [`Transport::update_and_sync`], which orders it after every earlier write on the
//! same connection: a waiter that sees value `n` also sees the data written before the `n`-th signal.
//! The waiter keeps an *expected* count and waits until `inbound >= expected`.
//!
//! - Host-to-device: the host signals (usually from the proxy thread on a FLAG trigger) and a kernel
//!   on the peer waits on its inbound word in device memory (its `D2DSemaphoreHandle`-style wait).
//! - Host-to-host: both ends are host code; the inbound word is host memory registered with the
//!   transport (e.g. [`HostMemoryRegistry`](crate::transport::HostMemoryRegistry)).

use crate::error::{Error, Result};
use crate::fifo::Backoff;
use crate::transport::{MemoryRegion, Transport};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The signalling half: a connection, the peer's inbound word, and our outbound counter.
pub struct SemaphoreSignaller {
    connection: Arc<dyn Transport>,
    remote_inbound: MemoryRegion,
    remote_offset: u64,
    outbound: Mutex<u64>,
}

impl std::fmt::Debug for SemaphoreSignaller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SemaphoreSignaller")
            .field("remote_rank", &self.connection.remote_rank())
            .field("remote_inbound", &self.remote_inbound)
            .field("remote_offset", &self.remote_offset)
            .field("outbound", &self.outbound())
            .finish()
    }
}

impl SemaphoreSignaller {
    /// `remote_inbound + remote_offset` is the peer's inbound word (8 bytes, 8-byte aligned).
    pub fn new(
        connection: Arc<dyn Transport>,
        remote_inbound: MemoryRegion,
        remote_offset: u64,
    ) -> Result<Self> {
        remote_inbound.check_range(remote_offset, 8, "remote semaphore inbound word")?;
        if (remote_inbound.addr + remote_offset) % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "remote semaphore inbound word at {:#x}+{remote_offset} (rank {}) is not 8-byte aligned",
                remote_inbound.addr,
                connection.remote_rank()
            )));
        }
        Ok(SemaphoreSignaller {
            connection,
            remote_inbound,
            remote_offset,
            outbound: Mutex::new(0),
        })
    }

    /// Signals once: sets the peer's inbound word to the next outbound value and returns it.
    /// Safe to call from several threads: the counter is held locked across the send, so values
    /// reach the peer in increasing order (the peer's word never goes back).
    pub fn signal(&self) -> Result<u64> {
        let mut outbound = self
            .outbound
            .lock()
            .map_err(|_| Error::Internal("semaphore outbound counter lock poisoned".into()))?;
        let value = *outbound + 1;
        self.connection
            .update_and_sync(&self.remote_inbound, self.remote_offset, value)?;
        *outbound = value;
        Ok(value)
    }

    /// Signals sent so far.
    pub fn outbound(&self) -> u64 {
        self.outbound
            .lock()
            .map(|v| *v)
            .unwrap_or_else(|p| *p.into_inner())
    }

    /// The connection the signals travel on (the proxy also uses it for the data of a trigger).
    pub fn connection(&self) -> &Arc<dyn Transport> {
        &self.connection
    }

    pub fn remote_inbound(&self) -> (MemoryRegion, u64) {
        (self.remote_inbound, self.remote_offset)
    }
}

/// Host signals, device waits. The device side (inbound word and expected counter in device
/// memory) is built by the GPU backend from [`Host2DeviceSemaphore::local_inbound`].
#[derive(Debug)]
pub struct Host2DeviceSemaphore {
    signaller: SemaphoreSignaller,
    /// Our own inbound word in device memory, which the peer's host signals.
    local_inbound: MemoryRegion,
}

impl Host2DeviceSemaphore {
    pub fn new(signaller: SemaphoreSignaller, local_inbound: MemoryRegion) -> Self {
        Host2DeviceSemaphore {
            signaller,
            local_inbound,
        }
    }

    pub fn signal(&self) -> Result<u64> {
        self.signaller.signal()
    }

    pub fn signaller(&self) -> &SemaphoreSignaller {
        &self.signaller
    }

    pub fn connection(&self) -> &Arc<dyn Transport> {
        self.signaller.connection()
    }

    pub fn local_inbound(&self) -> MemoryRegion {
        self.local_inbound
    }
}

/// The host's inbound word: 8-byte aligned, on its own cache line so polling it does not contend
/// with neighbouring data.
#[repr(C, align(64))]
#[derive(Debug, Default)]
pub struct InboundWord(AtomicU64);

impl InboundWord {
    pub fn new() -> Box<Self> {
        Box::default()
    }

    /// The address to register with the transport's memory registry.
    pub fn as_ptr(&self) -> *mut u8 {
        self.0.as_ptr().cast()
    }

    /// Current value, with acquire ordering (pairs with the transport's release store).
    pub fn load(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// Host signals, host waits.
pub struct Host2HostSemaphore {
    signaller: SemaphoreSignaller,
    inbound: Box<InboundWord>,
    expected: u64,
}

impl std::fmt::Debug for Host2HostSemaphore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host2HostSemaphore")
            .field("signaller", &self.signaller)
            .field("inbound", &self.inbound.load())
            .field("expected", &self.expected)
            .finish()
    }
}

impl Host2HostSemaphore {
    /// `inbound` must be the word the peer's signaller targets (registered with this side's
    /// transport before the peer learns its region).
    pub fn new(signaller: SemaphoreSignaller, inbound: Box<InboundWord>) -> Self {
        Host2HostSemaphore {
            signaller,
            inbound,
            expected: 0,
        }
    }

    pub fn signal(&self) -> Result<u64> {
        self.signaller.signal()
    }

    pub fn inbound(&self) -> &InboundWord {
        &self.inbound
    }

    /// Consumes one signal if it has arrived; never blocks.
    pub fn poll(&mut self) -> bool {
        if self.inbound.load() > self.expected {
            self.expected += 1;
            true
        } else {
            false
        }
    }

    /// Waits for the next signal, at most `timeout`. On timeout the signal is still expected (a
    /// later wait waits for the same one).
    pub fn wait(&mut self, timeout: Duration) -> Result<()> {
        let target = self.expected + 1;
        let mut backoff = Backoff::new(timeout);
        while self.inbound.load() < target {
            if !backoff.snooze() {
                return Err(Error::Timeout {
                    what: format!(
                        "signal {target} from rank {} (inbound word is {})",
                        self.signaller.connection().remote_rank(),
                        self.inbound.load()
                    ),
                    timeout,
                });
            }
        }
        self.expected = target;
        Ok(())
    }
}
