//! The host side of the proxy FIFO: a ring of [`ProxyTrigger`]s that GPU threads push and one host
//! proxy thread consumes (docs/device-abi.md, "FIFO and proxy triggers").
//!
//! # Protocol
//! A pusher takes a position with `pos = head.fetch_add(1)`, waits (bounded) while
//! `pos >= tail + depth`, then writes the slot so that `fst` is visible no later than `snd` with
//! bit 63 set: a CUDA thread writes both in one 16-byte release store (a single transaction that
//! host memory receives whole, so no fence has to wait for `fst` to cross PCIe first); HIP and the
//! host pusher write `fst`, then `snd` with release ordering. The consumer polls `snd` of slot
//! `tail % depth` with acquire ordering; a set bit 63 means `fst` is visible too. After handling,
//! [`Fifo::pop`] clears the slot and publishes `tail + 1` with release ordering, so a pusher that
//! sees the new tail also sees the cleared slot and cannot have its own later write overwritten by
//! our clearing.
//!
//! # Memory
//! Production FIFOs live in host-pinned memory mapped into the device (ring and tail) plus a device
//! counter (head); the GPU backend allocates them and hands the pointers to [`Fifo::from_raw`]. CPU
//! tests use [`Fifo::new`], which allocates the same layout on the heap, and push through
//! [`HostFifoPusher`], a host thread that follows exactly the device protocol.

use crate::error::{Error, Result};
use std::fmt;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::device::trigger_bits::VALID_BIT;
pub use crate::device::ProxyTrigger;

/// A bounded wait: spins briefly, then yields, and checks the clock only every so often so the
/// per-iteration cost stays a few nanoseconds. Shared by the FIFO, the proxy and host semaphores.
pub(crate) struct Backoff {
    deadline: Instant,
    iterations: u32,
}

impl Backoff {
    /// Spins before this many iterations; yields the CPU afterwards (the machines that run the
    /// CPU tests have two cores, so a pure spin would starve the thread we wait for).
    const SPIN_LIMIT: u32 = 64;
    /// Reads the clock once per this many iterations.
    const CLOCK_EVERY: u32 = 256;

    pub(crate) fn new(timeout: Duration) -> Self {
        Backoff {
            // A timeout too large to add is "wait practically forever"; a year is far enough.
            deadline: Instant::now()
                .checked_add(timeout)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 24 * 3600)),
            iterations: 0,
        }
    }

    /// Waits a little; returns false once the deadline has passed.
    pub(crate) fn snooze(&mut self) -> bool {
        self.iterations = self.iterations.wrapping_add(1);
        if self.iterations < Self::SPIN_LIMIT {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
        !(self.iterations % Self::CLOCK_EVERY == 0 && Instant::now() >= self.deadline)
    }
}

/// One ring slot as atomics (same layout as [`ProxyTrigger`]).
#[repr(C, align(16))]
#[derive(Default)]
struct Slot {
    fst: AtomicU64,
    snd: AtomicU64,
}

/// A counter on its own cache line, so the pusher's head and the consumer's tail do not share one.
#[repr(C, align(64))]
#[derive(Default)]
struct PaddedCounter(AtomicU64);

/// Where the FIFO's words live and what keeps them alive.
struct FifoMemory {
    slots: *const Slot,
    depth: u64,
    head: *const AtomicU64,
    tail: *const AtomicU64,
    /// Heap storage of [`Fifo::new`], or the caller's owner guard of [`Fifo::from_raw`]
    /// (e.g. the backend's pinned allocation, freed on drop).
    _owner: Box<dyn std::any::Any + Send + Sync>,
    /// True when `head` is readable from the host (heap FIFOs); device-memory heads are not.
    head_on_host: bool,
}

// SAFETY: all accesses to the pointed-to words are atomic, and `_owner` keeps them alive for as long
// as any `Arc<FifoMemory>` exists.
unsafe impl Send for FifoMemory {}
unsafe impl Sync for FifoMemory {}

impl FifoMemory {
    fn slot(&self, pos: u64) -> &Slot {
        // SAFETY: `pos % depth < depth`, and `slots` points to `depth` slots kept alive by `_owner`.
        unsafe { &*self.slots.add((pos % self.depth) as usize) }
    }
    fn head(&self) -> &AtomicU64 {
        // SAFETY: valid, aligned and alive for the lifetime of `self` (see `_owner`).
        unsafe { &*self.head }
    }
    fn tail(&self) -> &AtomicU64 {
        // SAFETY: as for `head`.
        unsafe { &*self.tail }
    }
}

struct HeapStorage {
    _slots: Box<[Slot]>,
    _head: Box<PaddedCounter>,
    _tail: Box<PaddedCounter>,
}

/// Raw locations of an externally allocated FIFO, for [`Fifo::from_raw`].
#[derive(Debug, Clone, Copy)]
pub struct FifoRaw {
    /// Host address of `depth` 16-byte slots, zeroed.
    pub triggers: *mut ProxyTrigger,
    /// Host address of the tail counter (host-mapped), zero.
    pub tail: *mut u64,
    /// Host address of the head counter when the host can read it (pushers on the host, or a
    /// host-mapped head); `None` when it lives in device memory.
    pub head: Option<*mut u64>,
    pub depth: u32,
}

/// The consumer end of a FIFO. There is exactly one consumer (the proxy thread); pushers are the
/// device, or [`HostFifoPusher`]s in CPU tests.
pub struct Fifo {
    mem: Arc<FifoMemory>,
    /// Our copy of the tail: only this consumer writes it, so there is no need to read it back.
    tail: u64,
}

impl fmt::Debug for Fifo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fifo")
            .field("depth", &self.mem.depth)
            .field("tail", &self.tail)
            .finish()
    }
}

impl Fifo {
    /// The default depth, as in MSCCL++ (`DEFAULT_FIFO_SIZE`).
    pub const DEFAULT_DEPTH: u32 = 512;

    /// A FIFO in plain heap memory, for host pushers and CPU tests. `depth` must be > 0 (a power of
    /// two is not required).
    pub fn new(depth: u32) -> Result<Self> {
        check_depth(depth)?;
        let slots: Box<[Slot]> = (0..depth).map(|_| Slot::default()).collect();
        let head = Box::new(PaddedCounter::default());
        let tail = Box::new(PaddedCounter::default());
        let mem = FifoMemory {
            slots: slots.as_ptr(),
            depth: depth.into(),
            head: &head.0,
            tail: &tail.0,
            head_on_host: true,
            // Moving the boxes does not move their heap contents, so the pointers above stay valid.
            _owner: Box::new(HeapStorage {
                _slots: slots,
                _head: head,
                _tail: tail,
            }),
        };
        Ok(Fifo {
            mem: Arc::new(mem),
            tail: 0,
        })
    }

    /// A FIFO over memory allocated elsewhere (host-pinned mapped memory in production). `owner`
    /// is kept alive as long as the FIFO or any pusher is, and dropped afterwards (put the
    /// allocation's guard there).
    ///
    /// # Safety
    /// `raw.triggers` must point to `raw.depth` zeroed, 16-byte aligned slots and `raw.tail` (and
    /// `raw.head` if given) to zeroed, 8-byte aligned words; all must stay valid until `owner` is
    /// dropped, and be accessed by others only with the FIFO protocol (atomically).
    pub unsafe fn from_raw(
        raw: FifoRaw,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<Self> {
        check_depth(raw.depth)?;
        let misaligned = |name: &str, addr: usize, align: usize| {
            Error::InvalidArgument(format!(
                "FIFO {name} pointer {addr:#x} is null or not {align}-byte aligned"
            ))
        };
        if raw.triggers.is_null() || raw.triggers as usize % 16 != 0 {
            return Err(misaligned("triggers", raw.triggers as usize, 16));
        }
        if raw.tail.is_null() || raw.tail as usize % 8 != 0 {
            return Err(misaligned("tail", raw.tail as usize, 8));
        }
        // Without a host-readable head, a private word stands in so pushers on the host still work;
        // it is only used by `HostFifoPusher` and drain accounting.
        let (head, head_on_host, owner): (
            *const AtomicU64,
            bool,
            Box<dyn std::any::Any + Send + Sync>,
        ) = match raw.head {
            Some(h) if h.is_null() || h as usize % 8 != 0 => {
                return Err(misaligned("head", h as usize, 8))
            }
            Some(h) => (h.cast::<AtomicU64>(), true, owner),
            None => {
                let word = Box::new(PaddedCounter::default());
                let ptr: *const AtomicU64 = &word.0;
                (ptr, false, Box::new((owner, word)))
            }
        };
        let mem = FifoMemory {
            slots: raw.triggers.cast::<Slot>(),
            depth: raw.depth.into(),
            head,
            tail: raw.tail.cast::<AtomicU64>(),
            head_on_host,
            _owner: owner,
        };
        Ok(Fifo {
            mem: Arc::new(mem),
            tail: 0,
        })
    }

    pub fn depth(&self) -> u32 {
        // Constructed from a u32.
        self.mem.depth as u32
    }

    /// Triggers consumed so far (the value of the tail word).
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// The head counter (positions taken by pushers) when the host can read it, else `None`.
    pub fn head(&self) -> Option<u64> {
        self.mem
            .head_on_host
            .then(|| self.mem.head().load(Ordering::Acquire))
    }

    /// Host addresses of the ring, head and tail (for building the device's `FifoHandle`; the
    /// backend translates them to device addresses).
    pub fn raw_parts(&self) -> FifoRaw {
        FifoRaw {
            triggers: self.mem.slots as *mut ProxyTrigger,
            tail: self.mem.tail as *mut u64,
            head: self.mem.head_on_host.then_some(self.mem.head as *mut u64),
            depth: self.depth(),
        }
    }

    /// A pusher that follows the device protocol from a host thread.
    pub fn pusher(&self) -> HostFifoPusher {
        HostFifoPusher {
            mem: Arc::clone(&self.mem),
        }
    }

    /// The trigger at the tail if one has been fully pushed. Does not consume it.
    #[inline]
    pub fn poll(&self) -> Option<ProxyTrigger> {
        let slot = self.mem.slot(self.tail);
        let snd = slot.snd.load(Ordering::Acquire);
        if snd & VALID_BIT == 0 {
            return None;
        }
        // Acquire on `snd` synchronises with the pusher's fence before it, so `fst` is complete.
        let fst = slot.fst.load(Ordering::Relaxed);
        Some(ProxyTrigger { fst, snd })
    }

    /// Consumes the trigger at the tail: clears the slot, then publishes the new tail with release
    /// so a pusher waiting for space sees the slot cleared before it reuses it. Call only after
    /// [`Fifo::poll`] returned `Some`.
    #[inline]
    pub fn pop(&mut self) {
        let slot = self.mem.slot(self.tail);
        slot.snd.store(0, Ordering::Relaxed);
        slot.fst.store(0, Ordering::Relaxed);
        self.tail += 1;
        self.mem.tail().store(self.tail, Ordering::Release);
    }
}

fn check_depth(depth: u32) -> Result<()> {
    if depth == 0 {
        return Err(Error::InvalidArgument(
            "FIFO depth must be greater than 0".into(),
        ));
    }
    Ok(())
}

/// Pushes triggers from a host thread with exactly the device's protocol (see the module docs).
/// Cloneable: several pushers may share one FIFO, like many GPU threads.
#[derive(Clone)]
pub struct HostFifoPusher {
    mem: Arc<FifoMemory>,
}

impl HostFifoPusher {
    /// Pushes `trigger` (bit 63 of `snd` is set here) and returns its position. Waits at most
    /// `timeout` for space. On timeout the position stays taken and never gets written, as on the
    /// device: the consumer will wait on it, so a timed-out FIFO must be torn down, not reused.
    #[inline]
    pub fn push(&self, trigger: ProxyTrigger, timeout: Duration) -> Result<u64> {
        let mem = &*self.mem;
        let pos = mem.head().fetch_add(1, Ordering::Relaxed);
        // Backpressure: never overwrite a slot the consumer has not popped.
        if pos >= mem.tail().load(Ordering::Acquire) + mem.depth {
            let mut backoff = Backoff::new(timeout);
            while pos >= mem.tail().load(Ordering::Acquire) + mem.depth {
                if !backoff.snooze() {
                    return Err(Error::Timeout {
                        what: format!(
                            "FIFO space for position {pos} (tail {}, depth {}): the proxy is not consuming",
                            mem.tail().load(Ordering::Acquire),
                            mem.depth
                        ),
                        timeout,
                    });
                }
            }
        }
        let slot = mem.slot(pos);
        slot.fst.store(trigger.fst, Ordering::Relaxed);
        // The device's `__threadfence_system()` between the two words.
        fence(Ordering::Release);
        slot.snd.store(trigger.snd | VALID_BIT, Ordering::Relaxed);
        Ok(pos)
    }

    /// Waits until the trigger at `pos` has been consumed (the device's `sync(pos)`).
    pub fn sync(&self, pos: u64, timeout: Duration) -> Result<()> {
        let mut backoff = Backoff::new(timeout);
        while self.mem.tail().load(Ordering::Acquire) <= pos {
            if !backoff.snooze() {
                return Err(Error::Timeout {
                    what: format!(
                        "FIFO position {pos} to be consumed (tail {})",
                        self.mem.tail().load(Ordering::Acquire)
                    ),
                    timeout,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_layout_matches_the_trigger() {
        assert_eq!(
            std::mem::size_of::<Slot>(),
            std::mem::size_of::<ProxyTrigger>()
        );
        assert_eq!(
            std::mem::align_of::<Slot>(),
            std::mem::align_of::<ProxyTrigger>()
        );
    }
}
