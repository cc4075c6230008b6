//! [`CudaIpcTransport`]: a [`Transport`] between GPUs of one host whose memory is mapped into each
//! other's process through CUDA/HIP IPC (MSCCL++'s `CudaIpcConnection`).
//!
//! The data moves on the copy engines, not on SMs: `write` enqueues an asynchronous copy from local
//! device memory into the peer's memory (mapped here) on a stream that belongs to this connection.
//! Because everything of one connection goes onto that one stream, stream order is the
//! connection's order:
//! - `update_and_sync` enqueues a 64-bit store of the new semaphore value into the peer's inbound
//!   word ([`Gpu::stream_write_u64`], a memory barrier before the store), so the peer's kernel that
//!   sees the value sees the data of every earlier `write`.
//! - `flush` records an event behind everything issued so far and polls it until it completes or
//!   the timeout passes; the poll keeps the caller (the proxy thread) in charge of its own deadline
//!   instead of blocking inside the driver.
//!
//! # Addresses
//! [`MemoryRegion::addr`] is the address in *this* process: the local buffer's device pointer for
//! sources, and the peer's buffer as mapped here (`RegisteredMemory::ptr` of the imported memory)
//! for destinations and semaphore words.
//!
//! # Fallback for the semaphore store
//! Where the backend has no 64-bit stream memory operations (`stream_write_u64` answers
//! `Unsupported`), the value is written into a slot of a small ring of pinned, device-mapped host
//! words and copied from there on the same stream. A slot is only rewritten after a flush has
//! proven that its earlier copy ran, so a pending copy never reads a newer value than the one it
//! was enqueued for.
//!
//! # Threads and devices
//! GPU backends bind a device per calling thread, so every call first selects this connection's
//! device: the proxy thread (or any other) can use the transport without further setup.

use crate::error::{Error, Result};
use crate::fifo::Backoff;
use crate::gpu::{DevicePtr, Event, Gpu, HostMapped, Stream};
use crate::transport::{MemoryRegion, Transport, TransportKind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// How long dropping a connection waits for its last copies. Copies do not wait for kernels, so
/// they end within this unless the device is faulted or wedged; then teardown goes on without them.
const DROP_DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Slots of the staging ring used when the backend cannot store a 64-bit value from a stream.
const STAGING_WORDS: usize = 256;

/// How `update_and_sync` reaches the peer's word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SignalPath {
    /// Not tried yet: the first signal probes `stream_write_u64`.
    Unknown,
    /// `Gpu::stream_write_u64`.
    StreamWrite,
    /// Value staged in pinned host memory, then copied (see the module docs).
    Staged,
}

/// Pinned host words the staged signal path copies from.
struct Staging {
    mem: HostMapped,
    /// Next slot to use.
    next: usize,
    /// Slots used since the last flush that completed: when it reaches the ring size, a flush must
    /// complete before any slot is rewritten.
    since_flush: usize,
}

struct State {
    stream: Stream,
    event: Event,
    path: SignalPath,
    staging: Option<Staging>,
    /// Copies enqueued since the connection was made (for diagnostics).
    writes: u64,
}

/// One connection to a peer GPU on this host. See the module docs.
pub struct CudaIpcTransport {
    gpu: Arc<dyn Gpu>,
    device: usize,
    remote_rank: usize,
    state: Mutex<State>,
}

impl std::fmt::Debug for CudaIpcTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaIpcTransport")
            .field("device", &self.device)
            .field("remote_rank", &self.remote_rank)
            .finish()
    }
}

impl CudaIpcTransport {
    /// A connection from `device` (this process's GPU) to `remote_rank`, with its own stream and
    /// completion event. The peer's memory must already be mapped here (the communicator does that
    /// when it exchanges registered memory).
    pub fn new(gpu: Arc<dyn Gpu>, device: usize, remote_rank: usize) -> Result<Self> {
        gpu.set_device(device)?;
        let stream = gpu.create_stream()?;
        let event = match gpu.create_event() {
            Ok(e) => e,
            Err(e) => {
                if let Err(d) = gpu.destroy_stream(stream) {
                    tracing::warn!(target: "mscclpp::conn", "destroying the CudaIpc stream to rank {remote_rank}: {d}");
                }
                return Err(e);
            }
        };
        Ok(CudaIpcTransport {
            gpu,
            device,
            remote_rank,
            state: Mutex::new(State {
                stream,
                event,
                path: SignalPath::Unknown,
                staging: None,
                writes: 0,
            }),
        })
    }

    /// The stream the copies run on (for callers that want to order their own work after them).
    pub fn stream(&self) -> Result<Stream> {
        Ok(self.lock()?.stream)
    }

    /// Copies enqueued so far.
    pub fn writes(&self) -> u64 {
        self.lock().map(|s| s.writes).unwrap_or(0)
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| {
            Error::Internal(format!(
                "CudaIpc connection to rank {} poisoned by a panic",
                self.remote_rank
            ))
        })
    }

    /// Selects this connection's device on the calling thread (see the module docs).
    fn bind(&self) -> Result<()> {
        self.gpu.set_device(self.device)
    }

    /// Address of `[offset, offset+bytes)` inside `region`, after the range check.
    fn address(
        &self,
        region: &MemoryRegion,
        offset: u64,
        bytes: u64,
        what: &str,
    ) -> Result<DevicePtr> {
        region.check_range(
            offset,
            bytes,
            &format!("CudaIpc {what} (peer rank {})", self.remote_rank),
        )?;
        Ok(region.addr + offset)
    }

    /// Records the event behind everything enqueued so far and polls it until done or `timeout`.
    fn flush_locked(&self, state: &mut State, timeout: Duration) -> Result<()> {
        self.gpu.record_event(state.event, state.stream)?;
        let mut backoff = Backoff::new(timeout);
        loop {
            match self.gpu.query_event(state.event) {
                Ok(true) => break,
                Ok(false) => {}
                // A backend without event queries: the blocking wait still ends, because copies
                // always complete (they do not depend on any kernel).
                Err(Error::Unsupported(_)) => {
                    self.gpu.synchronize_stream(state.stream)?;
                    break;
                }
                Err(e) => return Err(e),
            }
            if !backoff.snooze() {
                return Err(Error::Timeout {
                    what: format!(
                        "CudaIpc copies to rank {} to complete ({} issued on this connection)",
                        self.remote_rank, state.writes
                    ),
                    timeout,
                });
            }
        }
        if let Some(staging) = state.staging.as_mut() {
            staging.since_flush = 0;
        }
        Ok(())
    }

    /// The staged signal path: value into a pinned slot, slot copied to `addr` on the stream.
    fn staged_store(&self, state: &mut State, addr: DevicePtr, value: u64) -> Result<()> {
        if state.staging.is_none() {
            let mem = self
                .gpu
                .alloc_host_mapped(STAGING_WORDS * std::mem::size_of::<u64>())?;
            state.staging = Some(Staging {
                mem,
                next: 0,
                since_flush: 0,
            });
        }
        let ring_full = state
            .staging
            .as_ref()
            .is_some_and(|s| s.since_flush >= STAGING_WORDS);
        if ring_full {
            // Every slot may still be read by a pending copy: wait for them before reusing one.
            self.flush_locked(state, Duration::from_secs(30))?;
        }
        let stream = state.stream;
        let staging = state
            .staging
            .as_mut()
            .ok_or_else(|| Error::Internal("CudaIpc staging ring missing".into()))?;
        let slot = staging.next;
        let offset = (slot * std::mem::size_of::<u64>()) as u64;
        // SAFETY: the ring holds STAGING_WORDS aligned words of pinned memory alive until drop;
        // no pending copy reads this slot (see `since_flush`), and the copy engine reads it only
        // after the enqueue below, which the driver orders after this store.
        unsafe {
            AtomicU64::from_ptr(staging.mem.host_ptr.add(offset as usize).cast::<u64>())
                .store(value, Ordering::Release)
        };
        staging.next = (slot + 1) % STAGING_WORDS;
        staging.since_flush += 1;
        let src = staging.mem.device_ptr + offset;
        self.gpu.memcpy_async(addr, src, 8, stream)
    }
}

impl Transport for CudaIpcTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::CudaIpc
    }

    fn remote_rank(&self) -> usize {
        self.remote_rank
    }

    fn write(
        &self,
        dst: &MemoryRegion,
        dst_offset: u64,
        src: &MemoryRegion,
        src_offset: u64,
        bytes: u64,
    ) -> Result<()> {
        let to = self.address(dst, dst_offset, bytes, "write destination")?;
        let from = self.address(src, src_offset, bytes, "write source")?;
        if bytes == 0 {
            // A 0-byte put still orders a signal after it; there is nothing to copy.
            return Ok(());
        }
        let len = usize::try_from(bytes).map_err(|_| {
            Error::InvalidArgument(format!("CudaIpc write of {bytes} bytes exceeds usize"))
        })?;
        self.bind()?;
        let mut state = self.lock()?;
        self.gpu.memcpy_async(to, from, len, state.stream)?;
        state.writes += 1;
        Ok(())
    }

    fn update_and_sync(&self, dst: &MemoryRegion, dst_offset: u64, new_value: u64) -> Result<()> {
        let addr = self.address(dst, dst_offset, 8, "semaphore word")?;
        if addr % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "CudaIpc semaphore word of rank {} at {addr:#x} is not 8-byte aligned",
                self.remote_rank
            )));
        }
        self.bind()?;
        let mut state = self.lock()?;
        if state.path != SignalPath::Staged {
            match self.gpu.stream_write_u64(state.stream, addr, new_value) {
                Ok(()) => {
                    state.path = SignalPath::StreamWrite;
                    return Ok(());
                }
                Err(Error::Unsupported(why)) if state.path == SignalPath::Unknown => {
                    tracing::info!(
                        target: "mscclpp::conn",
                        "CudaIpc to rank {}: {why}; staging semaphore values in pinned memory",
                        self.remote_rank
                    );
                    state.path = SignalPath::Staged;
                }
                Err(e) => return Err(e),
            }
        }
        self.staged_store(&mut state, addr, new_value)
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        self.bind()?;
        let mut state = self.lock()?;
        self.flush_locked(&mut state, timeout)
    }
}

impl Drop for CudaIpcTransport {
    fn drop(&mut self) {
        let remote = self.remote_rank;
        let warn = |what: &str, e: Error| {
            tracing::warn!(target: "mscclpp::conn", "CudaIpc to rank {remote}: {what}: {e}");
        };
        if let Err(e) = self.bind() {
            return warn("selecting the device for teardown", e);
        }
        let mut guard = match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let state = &mut *guard;
        // Pending copies may still read the staging ring: let them finish before freeing it, for
        // a bounded time (every wait of the library has one). Copies that did not finish keep the
        // ring: it is left allocated rather than freed under them.
        let drained = self.flush_locked(state, DROP_DRAIN_TIMEOUT);
        if let Err(e) = &drained {
            tracing::warn!(target: "mscclpp::conn", "CudaIpc to rank {remote}: waiting for the last copies: {e}; the staging ring stays allocated");
        }
        if let Some(staging) = state.staging.take().filter(|_| drained.is_ok()) {
            if let Err(e) = self.gpu.free_host_mapped(&staging.mem) {
                warn("freeing the staging ring", e);
            }
        }
        if let Err(e) = self.gpu.destroy_event(state.event) {
            warn("destroying the flush event", e);
        }
        if let Err(e) = self.gpu.destroy_stream(state.stream) {
            warn("destroying the copy stream", e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{Allocation, MemoryKind};
    use crate::port_channel::test_gpu::HostGpu;
    use rstest::rstest;

    fn region(a: &Allocation) -> MemoryRegion {
        MemoryRegion {
            addr: a.ptr,
            size: a.size as u64,
            key: 0,
        }
    }

    fn read(gpu: &HostGpu, a: &Allocation) -> Vec<u8> {
        let mut out = vec![0u8; a.size];
        gpu.copy_from_device(&mut out, a.ptr).unwrap();
        out
    }

    #[rstest]
    #[case::stream_write(true)]
    #[case::staged(false)]
    fn copies_then_signals_in_order(#[case] stream_writes: bool) {
        let gpu = Arc::new(HostGpu::new().with_stream_writes(stream_writes));
        let t = CudaIpcTransport::new(gpu.clone(), 0, 3).unwrap();
        let src = gpu.alloc(512, MemoryKind::Plain).unwrap();
        let dst = gpu.alloc(512, MemoryKind::Plain).unwrap();
        let sem = gpu.alloc(16, MemoryKind::Plain).unwrap();
        let data: Vec<u8> = (0..512).map(|i| (i * 13 + 1) as u8).collect();
        gpu.copy_to_device(src.ptr, &data).unwrap();
        // More signals than staging slots, so the staged path must flush and reuse its ring.
        let n = STAGING_WORDS as u64 + 10;
        for i in 0..n {
            let off = 8 * (i % 64);
            t.write(&region(&dst), off, &region(&src), off, 8).unwrap();
            t.update_and_sync(&region(&sem), 8, i + 1).unwrap();
        }
        t.flush(Duration::from_secs(1)).unwrap();
        assert_eq!(read(&gpu, &dst), data);
        assert_eq!(read(&gpu, &sem)[8..], n.to_le_bytes());
        assert_eq!(gpu.stream_writes(), if stream_writes { n } else { 0 });
        assert_eq!(t.writes(), n, "data copies only");
        drop(t);
        for a in [&src, &dst, &sem] {
            gpu.free(a).unwrap();
        }
        assert_eq!(gpu.live_allocations(), 0, "staging ring freed on drop");
    }

    #[test]
    fn ranges_and_alignment_are_checked_naming_the_peer() {
        let gpu = Arc::new(HostGpu::new());
        let t = CudaIpcTransport::new(gpu.clone(), 0, 5).unwrap();
        let buf = gpu.alloc(32, MemoryKind::Plain).unwrap();
        let err = t
            .write(&region(&buf), 30, &region(&buf), 0, 4)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 5") && err.contains("destination"),
            "{err}"
        );
        let err = t
            .update_and_sync(&region(&buf), 4, 1)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not 8-byte aligned") && err.contains("rank 5"),
            "{err}"
        );
        assert!(
            t.update_and_sync(&region(&buf), 32, 1).is_err(),
            "past the end"
        );
        t.write(&region(&buf), 32, &region(&buf), 0, 0)
            .expect("a 0-byte write at the end is fine");
        assert_eq!(t.writes(), 0);
        gpu.free(&buf).unwrap();
    }

    #[test]
    fn flush_times_out_naming_the_peer() {
        let gpu = Arc::new(HostGpu::new());
        gpu.hold_events(true);
        let t = CudaIpcTransport::new(gpu.clone(), 0, 7).unwrap();
        let err = t.flush(Duration::from_millis(50)).unwrap_err();
        assert!(
            matches!(&err, Error::Timeout { what, .. } if what.contains("rank 7")),
            "{err}"
        );
        gpu.hold_events(false);
        t.flush(Duration::from_secs(1)).unwrap();
        assert_eq!(t.kind(), TransportKind::CudaIpc);
        assert_eq!(t.remote_rank(), 7);
    }

    /// Copies that never finish (a wedged device) hold a dropped connection for a bounded time.
    #[test]
    fn drop_waits_for_copies_a_bounded_time() {
        let gpu = Arc::new(HostGpu::new());
        gpu.hold_events(true);
        let t = CudaIpcTransport::new(gpu.clone(), 0, 3).unwrap();
        let start = std::time::Instant::now();
        drop(t);
        let took = start.elapsed();
        assert!(
            took >= DROP_DRAIN_TIMEOUT && took < DROP_DRAIN_TIMEOUT + Duration::from_secs(2),
            "{took:?}"
        );
    }
}
