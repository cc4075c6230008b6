//! A [`Bootstrap`] over the host stack's own exchange (`mscclppBootstrap` of `mscclpp.h`): its
//! all-gather and barrier, and its send and receive where it has them, so an embedded
//! communicator needs no TCP bootstrap of its own.
//!
//! The host's all-gather is NCCL's shape (fixed bytes per rank, in place, each rank's part at
//! `rank * bytes`); ours takes contributions of any size, so each is two of the host's: the
//! sizes, then the parts padded to the largest. A message sent is two of the host's sends under
//! the same tag: its length (8 bytes), then its bytes, so a receiver that must know the size up
//! front (RCCL's `bootstrapRecv`) can take it.
//!
//! Calls into the host are serialised per communicator (one at a time, from whichever of our
//! threads needs one), which also gives the collectives one order on every rank. Timeouts are the
//! host's: a callback that never returns is a hang we cannot break, so the host's exchange must
//! time out (or fail when a peer dies) and return non-zero. After [`Bootstrap::interrupt`]
//! (`mscclppCommAbort`) every call fails at once without calling the host.

use mscclpp::core::bootstrap::Bootstrap;
use mscclpp::core::{Error, Result};
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, OnceLock};

/// The version of [`HostCallbacks`] this library reads (`MSCCLPP_BOOTSTRAP_VERSION`).
pub const CALLBACKS_VERSION: c_int = 1;

pub type AllGatherFn =
    unsafe extern "C" fn(ctx: *mut c_void, all: *mut c_void, bytes: usize) -> c_int;
pub type BarrierFn = unsafe extern "C" fn(ctx: *mut c_void) -> c_int;
pub type SendFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    peer: c_int,
    tag: c_int,
    data: *const c_void,
    bytes: usize,
) -> c_int;
pub type RecvFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    peer: c_int,
    tag: c_int,
    data: *mut c_void,
    bytes: usize,
) -> c_int;

/// `mscclppBootstrap` of `mscclpp.h`, field for field.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HostCallbacks {
    pub version: c_int,
    pub rank: c_int,
    pub nranks: c_int,
    pub ctx: *mut c_void,
    pub all_gather: Option<AllGatherFn>,
    pub barrier: Option<BarrierFn>,
    pub send: Option<SendFn>,
    pub recv: Option<RecvFn>,
}

/// The host's exchange as our bootstrap.
pub struct HostBootstrap {
    rank: usize,
    size: usize,
    ctx: *mut c_void,
    all_gather: AllGatherFn,
    barrier: BarrierFn,
    point_to_point: Option<(SendFn, RecvFn)>,
    /// Held across each call into the host.
    turn: Mutex<()>,
    /// Set by `interrupt`: why every later call fails.
    interrupted: OnceLock<String>,
}

// SAFETY: `ctx` is only handed back to the host's callbacks, which `mscclpp.h` requires to be
// callable from any thread (one call at a time, which `turn` ensures).
unsafe impl Send for HostBootstrap {}
unsafe impl Sync for HostBootstrap {}

impl HostBootstrap {
    /// Checks the host's description; an error names the field at fault.
    pub fn new(callbacks: &HostCallbacks) -> Result<HostBootstrap> {
        let bad = |what: String| Err(Error::InvalidArgument(format!("mscclppBootstrap: {what}")));
        if callbacks.version != CALLBACKS_VERSION {
            return bad(format!(
                "version is {}, this library reads version {CALLBACKS_VERSION} \
                 (set it to MSCCLPP_BOOTSTRAP_VERSION)",
                callbacks.version
            ));
        }
        if callbacks.nranks < 1 {
            return bad(format!("nranks is {}; at least 1 rank", callbacks.nranks));
        }
        if callbacks.rank < 0 || callbacks.rank >= callbacks.nranks {
            return bad(format!(
                "rank {} is not in 0..{}",
                callbacks.rank, callbacks.nranks
            ));
        }
        let (Some(all_gather), Some(barrier)) = (callbacks.all_gather, callbacks.barrier) else {
            return bad("allGather and barrier are required (one is NULL)".into());
        };
        let point_to_point = match (callbacks.send, callbacks.recv) {
            (Some(s), Some(r)) => Some((s, r)),
            (None, None) => None,
            _ => return bad("send and recv come together (one of them is NULL)".into()),
        };
        Ok(HostBootstrap {
            rank: callbacks.rank as usize,
            size: callbacks.nranks as usize,
            ctx: callbacks.ctx,
            all_gather,
            barrier,
            point_to_point,
            turn: Mutex::new(()),
            interrupted: OnceLock::new(),
        })
    }

    /// Runs one call into the host (`what` names it in errors), after checking for an abort.
    fn host_call(&self, what: &str, call: impl FnOnce() -> c_int) -> Result<()> {
        if let Some(reason) = self.interrupted.get() {
            return Err(Error::Aborted(reason.clone()));
        }
        let _turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        match call() {
            0 => Ok(()),
            rc => Err(Error::Bootstrap(format!(
                "rank {}: the host's {what} callback returned {rc}",
                self.rank
            ))),
        }
    }

    /// The host's all-gather of `bytes` per rank, this rank's part being `mine`.
    fn fixed_all_gather(&self, mine: &[u8], bytes: usize) -> Result<Vec<u8>> {
        let total = bytes.checked_mul(self.size).ok_or_else(|| {
            Error::InvalidArgument(format!("an all-gather of {bytes} bytes per rank overflows"))
        })?;
        let mut all = vec![0u8; total];
        all[self.rank * bytes..][..mine.len()].copy_from_slice(mine);
        // SAFETY: `all` holds `bytes` per rank, as the callback's contract says.
        self.host_call("allGather", || unsafe {
            (self.all_gather)(self.ctx, all.as_mut_ptr().cast(), bytes)
        })?;
        Ok(all)
    }

    fn point_to_point(&self, what: &str) -> Result<(SendFn, RecvFn)> {
        self.point_to_point.ok_or_else(|| {
            Error::Unsupported(format!(
                "{what} between two ranks needs the host's send and recv callbacks, and \
                 mscclppBootstrap has none"
            ))
        })
    }

    fn check_peer(&self, peer: usize) -> Result<c_int> {
        if peer >= self.size || peer == self.rank {
            return Err(Error::InvalidArgument(format!(
                "rank {}: peer {peer} is not another rank of 0..{}",
                self.rank, self.size
            )));
        }
        Ok(peer as c_int)
    }
}

/// Our 64-bit tags folded into the host's non-negative `int` tags (the few tags in use stay
/// distinct).
fn host_tag(tag: u64) -> c_int {
    ((tag ^ (tag >> 31) ^ (tag >> 62)) & 0x7fff_ffff) as c_int
}

impl Bootstrap for HostBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        let (send, _) = self.point_to_point("a message")?;
        let (peer, tag) = (self.check_peer(peer)?, host_tag(tag));
        let len = (data.len() as u64).to_le_bytes();
        // SAFETY: the pointers are valid for the lengths given.
        self.host_call("send", || unsafe {
            send(self.ctx, peer, tag, len.as_ptr().cast(), len.len())
        })?;
        if data.is_empty() {
            return Ok(());
        }
        self.host_call("send", || unsafe {
            send(self.ctx, peer, tag, data.as_ptr().cast(), data.len())
        })
    }

    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>> {
        let (_, recv) = self.point_to_point("a message")?;
        let (peer, tag) = (self.check_peer(peer)?, host_tag(tag));
        let mut len = [0u8; 8];
        // SAFETY: as in `send`.
        self.host_call("recv", || unsafe {
            recv(self.ctx, peer, tag, len.as_mut_ptr().cast(), len.len())
        })?;
        let len = usize::try_from(u64::from_le_bytes(len)).map_err(|_| {
            Error::Bootstrap(format!(
                "rank {}: a message length from rank {peer} overflows",
                self.rank
            ))
        })?;
        let mut data = vec![0u8; len];
        if len > 0 {
            self.host_call("recv", || unsafe {
                recv(self.ctx, peer, tag, data.as_mut_ptr().cast(), len)
            })?;
        }
        Ok(data)
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let sizes = self.fixed_all_gather(&(data.len() as u64).to_le_bytes(), 8)?;
        let sizes: Vec<usize> = sizes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()) as usize)
            .collect();
        let widest = sizes.iter().copied().max().unwrap_or(0);
        if widest == 0 {
            return Ok(vec![Vec::new(); self.size]);
        }
        let all = self.fixed_all_gather(data, widest)?;
        Ok(sizes
            .iter()
            .enumerate()
            .map(|(r, &n)| all[r * widest..][..n].to_vec())
            .collect())
    }

    fn barrier(&self) -> Result<()> {
        // SAFETY: the callback's contract.
        self.host_call("barrier", || unsafe { (self.barrier)(self.ctx) })
    }

    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        if root >= self.size {
            return Err(Error::InvalidArgument(format!(
                "broadcast root {root} is not in 0..{}",
                self.size
            )));
        }
        let mine = if self.rank == root { data } else { &[] };
        Ok(self.all_gather(mine)?.swap_remove(root))
    }

    fn interrupt(&self, reason: &str) {
        let _ = self.interrupted.set(reason.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::{Arc, Barrier, Condvar};

    /// Messages waiting, per (from, to, tag).
    type Mailbox = HashMap<(c_int, c_int, c_int), std::collections::VecDeque<Vec<u8>>>;

    /// A host exchange among threads: an all-gather board and a mailbox per (from, to, tag).
    #[derive(Default)]
    struct Board {
        parts: Mutex<HashMap<c_int, Vec<u8>>>,
        mail: Mutex<Mailbox>,
        posted: Condvar,
    }

    struct Rank {
        board: Arc<Board>,
        rank: c_int,
        nranks: c_int,
        barrier: Arc<Barrier>,
    }

    unsafe extern "C" fn all_gather(ctx: *mut c_void, all: *mut c_void, bytes: usize) -> c_int {
        let me = unsafe { &*(ctx as *const Rank) };
        let n = me.nranks as usize;
        let all = unsafe { std::slice::from_raw_parts_mut(all as *mut u8, bytes * n) };
        let at = me.rank as usize * bytes;
        me.board
            .parts
            .lock()
            .unwrap()
            .insert(me.rank, all[at..at + bytes].to_vec());
        me.barrier.wait();
        for (r, part) in me.board.parts.lock().unwrap().iter() {
            all[*r as usize * bytes..][..bytes].copy_from_slice(part);
        }
        // Nobody posts the next round's part before everyone has read this one.
        me.barrier.wait();
        0
    }

    unsafe extern "C" fn barrier(ctx: *mut c_void) -> c_int {
        let me = unsafe { &*(ctx as *const Rank) };
        me.barrier.wait();
        0
    }

    unsafe extern "C" fn send(
        ctx: *mut c_void,
        peer: c_int,
        tag: c_int,
        data: *const c_void,
        bytes: usize,
    ) -> c_int {
        let me = unsafe { &*(ctx as *const Rank) };
        let data = unsafe { std::slice::from_raw_parts(data as *const u8, bytes) }.to_vec();
        me.board
            .mail
            .lock()
            .unwrap()
            .entry((me.rank, peer, tag))
            .or_default()
            .push_back(data);
        me.board.posted.notify_all();
        0
    }

    unsafe extern "C" fn recv(
        ctx: *mut c_void,
        peer: c_int,
        tag: c_int,
        data: *mut c_void,
        bytes: usize,
    ) -> c_int {
        let me = unsafe { &*(ctx as *const Rank) };
        let mut mail = me.board.mail.lock().unwrap();
        loop {
            if let Some(m) = mail
                .get_mut(&(peer, me.rank, tag))
                .and_then(|q| q.pop_front())
            {
                if m.len() != bytes {
                    return 3;
                }
                unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), data as *mut u8, bytes) };
                return 0;
            }
            mail = me.board.posted.wait(mail).unwrap();
        }
    }

    fn on_threads(n: usize, body: impl Fn(HostBootstrap) + Send + Sync + 'static) {
        let board = Arc::new(Board::default());
        let gate = Arc::new(Barrier::new(n));
        let body = Arc::new(body);
        let threads: Vec<_> = (0..n)
            .map(|r| {
                let (board, gate, body) = (board.clone(), gate.clone(), body.clone());
                std::thread::spawn(move || {
                    let me = Box::new(Rank {
                        board,
                        rank: r as c_int,
                        nranks: n as c_int,
                        barrier: gate,
                    });
                    let callbacks = HostCallbacks {
                        version: CALLBACKS_VERSION,
                        rank: r as c_int,
                        nranks: n as c_int,
                        ctx: &*me as *const Rank as *mut c_void,
                        all_gather: Some(all_gather),
                        barrier: Some(barrier),
                        send: Some(send),
                        recv: Some(recv),
                    };
                    body(HostBootstrap::new(&callbacks).expect("valid callbacks"));
                })
            })
            .collect();
        for t in threads {
            t.join().expect("rank thread");
        }
    }

    #[test]
    fn all_gather_of_uneven_parts_broadcast_and_messages_arrive_whole() {
        on_threads(3, |b| {
            let r = b.rank();
            let mine = vec![r as u8; r * 5];
            let all = b.all_gather(&mine).expect("all_gather");
            for (p, part) in all.iter().enumerate() {
                assert_eq!(part, &vec![p as u8; p * 5], "rank {r} got rank {p}'s part");
            }
            assert_eq!(b.broadcast(1, b"from one").expect("broadcast"), b"from one");
            b.barrier().expect("barrier");
            let next = (r + 1) % 3;
            b.send(next, 1 << 40, &[r as u8; 1000]).expect("send");
            b.send(next, 1 << 40, &[]).expect("empty send");
            let prev = (r + 2) % 3;
            assert_eq!(b.recv(prev, 1 << 40).expect("recv"), vec![prev as u8; 1000]);
            assert!(b.recv(prev, 1 << 40).expect("empty recv").is_empty());
            assert!(b
                .all_gather(&[])
                .expect("empty all_gather")
                .iter()
                .all(Vec::is_empty));
        });
    }

    #[test]
    fn an_interrupted_bootstrap_fails_without_calling_the_host() {
        on_threads(1, |b| {
            b.interrupt("mscclppCommAbort");
            match b.barrier() {
                Err(Error::Aborted(why)) => assert_eq!(why, "mscclppCommAbort"),
                other => panic!("expected Aborted, got {other:?}"),
            }
        });
    }

    #[test]
    fn bad_descriptions_name_the_field() {
        let good = HostCallbacks {
            version: CALLBACKS_VERSION,
            rank: 0,
            nranks: 2,
            ctx: std::ptr::null_mut(),
            all_gather: Some(all_gather),
            barrier: Some(barrier),
            send: None,
            recv: None,
        };
        let cases = [
            (HostCallbacks { version: 0, ..good }, "version is 0"),
            (HostCallbacks { nranks: 0, ..good }, "nranks is 0"),
            (HostCallbacks { rank: 2, ..good }, "rank 2 is not in 0..2"),
            (
                HostCallbacks {
                    barrier: None,
                    ..good
                },
                "allGather and barrier are required",
            ),
            (
                HostCallbacks {
                    send: Some(send),
                    ..good
                },
                "send and recv come together",
            ),
        ];
        for (callbacks, expected) in cases {
            let e = HostBootstrap::new(&callbacks)
                .err()
                .expect("refused")
                .to_string();
            assert!(e.contains(expected), "{e:?} should say {expected:?}");
        }
        let b = HostBootstrap::new(&good).expect("valid");
        let e = b
            .send(1, 0, b"x")
            .expect_err("no point-to-point")
            .to_string();
        assert!(e.contains("send and recv callbacks"), "{e}");
        assert_eq!(host_tag(7), 7);
    }
}
