//! An all-gather among the ranks of one host through shared memory, for the host exchanges that
//! every call makes (the user-buffer agreement of each zero-copy call,
//! [`Communicator::agreement_all_gather`](crate::communicator::Communicator::agreement_all_gather)).
//!
//! Why: a bootstrap all-gather crosses TCP and two thread hand-offs per message (20-40 µs between
//! two processes), which an eager framework call pays on top of its own host time. Here each rank
//! writes its message into its own slot of a shared page and reads the peers' slots: once every
//! rank has arrived it costs a few cache-line transfers.
//!
//! Protocol. Each rank owns one file in `/dev/shm` holding two halves, used by the parity of the
//! call number `k` (every rank makes the same calls in the same order, as for any collective):
//! `[seq: u64][len: u64][data: CAPACITY bytes]`. A rank writes its message, then its length, then
//! stores `k` into `seq` with release ordering, and waits for every peer's `seq` of that half to
//! read `k` (acquire) before copying their messages out. A rank rewrites a half only at call
//! `k + 2`, after finishing call `k + 1`, which needs every peer to have posted `k + 1`, which each
//! does only after it has read everything of call `k`: two halves are enough. A message larger
//! than the capacity posts a marker instead; every rank then sees it and the call goes through the
//! bootstrap all-gather (`Ok(None)`), so every rank takes the same path.
//!
//! Waits are bounded by the bootstrap timeout and end at once when `failed` says the communicator
//! failed (a peer died or stalled, or this rank was aborted: the liveness and failure machinery of
//! the bootstrap sets it), so a dead peer is an error here as it is over TCP.

use crate::error::{Error, Result};
use std::fs::OpenOptions;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Bytes of a message that travel through the shared page (larger ones take the bootstrap).
pub const CAPACITY: usize = 16 << 10;
/// `len` of a message too large for the page.
const OVERFLOW: u64 = u64::MAX;
const HALF_BYTES: usize = 16 + CAPACITY;
const FILE_BYTES: usize = 2 * HALF_BYTES;

/// One rank's file, mapped into this process.
struct Mapping {
    base: *mut u8,
}

// SAFETY: the mapping is plain shared memory; every access through it is either an atomic or a
// copy of bytes whose publication the atomics order (module docs).
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    fn map(path: &str, writable: bool) -> std::io::Result<Mapping> {
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .create(writable)
            .truncate(false)
            .open(path)?;
        if writable {
            file.set_len(FILE_BYTES as u64)?;
        }
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of the whole file; the file descriptor may close after.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_BYTES,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping {
            base: base as *mut u8,
        })
    }

    fn half(&self, k: u64) -> *mut u8 {
        // SAFETY: both halves lie inside the mapping.
        unsafe { self.base.add((k % 2) as usize * HALF_BYTES) }
    }

    fn seq(&self, k: u64) -> &AtomicU64 {
        // SAFETY: 8-aligned (page-aligned mapping, halves of a multiple of 8 bytes), inside the
        // mapping, and only ever accessed atomically.
        unsafe { &*(self.half(k) as *const AtomicU64) }
    }

    fn len(&self, k: u64) -> &AtomicU64 {
        // SAFETY: as for `seq`, 8 bytes further.
        unsafe { &*(self.half(k).add(8) as *const AtomicU64) }
    }

    fn data(&self, k: u64) -> *mut u8 {
        // SAFETY: the data follows the two words of its half.
        unsafe { self.half(k).add(16) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.base as *mut libc::c_void, FILE_BYTES) };
    }
}

/// This rank's file, created before the peers map it.
pub struct OwnPage {
    mapping: Mapping,
    path: String,
}

impl OwnPage {
    /// This rank's new file, or `None` where shared memory cannot be had here (logged at debug
    /// level; the communicator then uses the bootstrap).
    pub fn create(rank: usize) -> Option<OwnPage> {
        let path = format!(
            "/dev/shm/mscclpp-host-gather-{}-{rank}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        match Mapping::map(&path, true) {
            Ok(mapping) => Some(OwnPage { mapping, path }),
            Err(e) => {
                tracing::debug!("host gather: no shared page at {path} ({e})");
                None
            }
        }
    }

    /// Where the peers find it.
    pub fn path(&self) -> &str {
        &self.path
    }
}

/// Removes a page's file from /dev/shm once every rank has mapped it (or given up), so that
/// nothing outlives the processes; the mappings stay.
pub fn unlink(path: &str) {
    let _ = std::fs::remove_file(path);
}

/// The shared pages of every rank of one communicator (all on this host).
pub struct HostGather {
    rank: usize,
    /// Index = rank; this rank's own is writable.
    slots: Vec<Mapping>,
    /// Number of this gather's last call.
    calls: u64,
}

impl HostGather {
    /// Maps every peer's page from `paths` (every rank's [`OwnPage::path`], index = rank, empty
    /// for a rank that has none); `None` where some rank has none or a page cannot be mapped here.
    pub fn join(own: OwnPage, rank: usize, paths: &[String]) -> Option<HostGather> {
        let mut own = Some(own.mapping);
        let mut slots = Vec::with_capacity(paths.len());
        for (r, path) in paths.iter().enumerate() {
            let mapping = if r == rank {
                own.take()
            } else if path.is_empty() {
                None
            } else {
                Mapping::map(path, false)
                    .map_err(|e| tracing::debug!("host gather: rank {r}'s page {path}: {e}"))
                    .ok()
            };
            slots.push(mapping?);
        }
        Some(HostGather {
            rank,
            slots,
            calls: 0,
        })
    }
}

impl HostGather {
    /// Every rank's `data` (index = rank), or `Ok(None)` where some rank's message is larger than
    /// [`CAPACITY`] (the caller then gathers through the bootstrap, as every rank does). Fails when
    /// `failed` reports the communicator's error while waiting, or after `timeout` naming the ranks
    /// that did not arrive.
    pub fn all_gather(
        &mut self,
        data: &[u8],
        timeout: Duration,
        failed: &dyn Fn() -> Option<Error>,
    ) -> Result<Option<Vec<Vec<u8>>>> {
        self.calls += 1;
        let k = self.calls;
        let own = &self.slots[self.rank];
        if data.len() <= CAPACITY {
            // SAFETY: `data` fits the half's data; no peer reads this half before `seq` says `k`,
            // and none still reads it from call k - 2 (module docs).
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), own.data(k), data.len()) };
            own.len(k).store(data.len() as u64, Ordering::Relaxed);
        } else {
            own.len(k).store(OVERFLOW, Ordering::Relaxed);
        }
        own.seq(k).store(k, Ordering::Release);
        let start = Instant::now();
        let mut out = Vec::with_capacity(self.slots.len());
        let mut overflow = false;
        for (r, slot) in self.slots.iter().enumerate() {
            let mut spins = 0u32;
            while slot.seq(k).load(Ordering::Acquire) != k {
                spins += 1;
                if spins < 1 << 12 {
                    std::hint::spin_loop();
                    continue;
                }
                if let Some(e) = failed() {
                    return Err(e);
                }
                if start.elapsed() > timeout {
                    return Err(Error::Timeout {
                        what: format!(
                            "rank {r} in a host exchange (call {k}) with rank {}",
                            self.rank
                        ),
                        timeout,
                    });
                }
                if spins < 1 << 14 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
            let len = slot.len(k).load(Ordering::Relaxed);
            if len == OVERFLOW || len as usize > CAPACITY {
                overflow = true;
                out.push(Vec::new());
                continue;
            }
            let mut msg = vec![0u8; len as usize];
            // SAFETY: `len` bytes the owner wrote before its release store of `seq`, which this
            // rank's acquire load saw; the owner rewrites them only at call k + 2 (module docs).
            unsafe { std::ptr::copy_nonoverlapping(slot.data(k), msg.as_mut_ptr(), msg.len()) };
            out.push(msg);
        }
        Ok((!overflow).then_some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// `n` ranks as threads, each with its gather (pages set up as the communicator does).
    fn gathers(n: usize) -> Vec<HostGather> {
        let pages: Vec<OwnPage> = (0..n)
            .map(|r| OwnPage::create(r).expect("/dev/shm"))
            .collect();
        let paths: Vec<String> = pages.iter().map(|p| p.path().to_string()).collect();
        let out = pages
            .into_iter()
            .enumerate()
            .map(|(r, p)| HostGather::join(p, r, &paths).expect("join"))
            .collect();
        paths.iter().for_each(|p| unlink(p));
        out
    }

    fn message(call: u64, rank: usize) -> Vec<u8> {
        // Lengths that change from call to call, up to the capacity and past it once in a while.
        let len = if call % 97 == 13 && rank == 1 {
            CAPACITY + 1
        } else {
            ((call as usize * 31 + rank * 7) % 600) + (call as usize % 5) * 3000
        };
        (0..len).map(|i| (call as usize ^ rank ^ i) as u8).collect()
    }

    #[test]
    fn every_rank_gets_every_message_of_every_call() {
        let n = 3;
        let calls = 2000u64;
        let handles: Vec<_> = gathers(n)
            .into_iter()
            .enumerate()
            .map(|(rank, mut g)| {
                std::thread::spawn(move || {
                    let mut overflows = 0;
                    for call in 1..=calls {
                        let got = g
                            .all_gather(&message(call, rank), Duration::from_secs(20), &|| None)
                            .unwrap();
                        match got {
                            Some(all) => {
                                for (r, m) in all.iter().enumerate() {
                                    assert_eq!(m, &message(call, r), "call {call} rank {r}");
                                }
                            }
                            None => {
                                assert_eq!(call % 97, 13, "call {call}: an overflow nobody posted");
                                overflows += 1;
                            }
                        }
                    }
                    overflows
                })
            })
            .collect();
        let overflows: Vec<u64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(
            overflows.iter().all(|&o| o == overflows[0] && o > 0),
            "{overflows:?}"
        );
    }

    #[test]
    fn a_missing_rank_times_out_by_name_and_a_failure_ends_the_wait() {
        let mut gs = gathers(2);
        let _absent = gs.pop();
        let mut g = gs.pop().unwrap();
        let start = Instant::now();
        let e = g
            .all_gather(b"x", Duration::from_millis(200), &|| None)
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("rank 1"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(5));
        let said = Arc::new(Mutex::new(0));
        let seen = said.clone();
        let e = g
            .all_gather(b"x", Duration::from_secs(30), &move || {
                *seen.lock().unwrap() += 1;
                Some(Error::Aborted("rank 1 died".into()))
            })
            .unwrap_err();
        assert!(e.to_string().contains("rank 1 died"), "{e}");
        assert!(*said.lock().unwrap() > 0);
    }
}
