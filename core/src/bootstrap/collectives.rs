//! Collectives built on point-to-point messages: all_gather (Bruck), barrier, broadcast
//! (binomial tree).
//!
//! Bruck's all_gather takes ceil(log2 n) rounds for any n (3 for 8 ranks, 6 for 64) and moves the
//! same bytes as a ring, so it is both the low-latency choice for tiny payloads (barriers, 8-byte
//! exchanges) and fine for large ones. Contributions may differ in size per rank, so the choice
//! of algorithm must not depend on local sizes: one algorithm for all sizes keeps every rank in
//! step. Each rank talks to ceil(log2 n) distinct peers, which bounds the sockets a job opens.
//!
//! Messages are matched by the collective's sequence number alone, so every message leads with
//! the [`Op`] it belongs to: a rank that meets a peer in another collective under the same number
//! (the ranks called collectives in different orders) fails at once, naming both, instead of
//! taking the peer's bytes for its own and failing later and elsewhere (a barrier's empty
//! contribution read as a memory descriptor, or a timeout in an unrelated step). The cost is one
//! byte per message (five for a broadcast). This layout is part of the bootstrap protocol: a
//! change bumps `wire::PROTOCOL_VERSION`.

use crate::error::{Error, Result};
use std::fmt;

/// What a collective needs from the transport: ordered messages to and from any peer under a
/// per-collective sequence number.
pub(crate) trait Exchange {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn send_coll(&self, peer: usize, seq: u64, data: &[u8]) -> Result<()>;
    /// `op` names the collective for a timeout's error.
    fn recv_coll(&self, peer: usize, seq: u64, op: Op) -> Result<Vec<u8>>;
    /// Turns `e`, the failure of a step with `peer` in collective `op` number `seq`, into the
    /// error the caller gets, doing whatever the transport does when a collective fails (the TCP
    /// bootstrap aborts the job, so that every rank fails rather than waits).
    fn fail(&self, peer: usize, seq: u64, op: Op, e: Error) -> Error;
}

/// The collective a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    AllGather,
    Barrier,
    Broadcast { root: usize },
}

impl Op {
    /// Leading byte of a message of each kind; a broadcast's is followed by its root (u32).
    const ALL_GATHER: u8 = 1;
    const BARRIER: u8 = 2;
    const BROADCAST: u8 = 3;

    fn header_len(self) -> usize {
        match self {
            Op::Broadcast { .. } => 5,
            Op::AllGather | Op::Barrier => 1,
        }
    }

    /// A message buffer with this op's header written, room reserved for `body` more bytes.
    fn message(self, body: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.header_len() + body);
        match self {
            Op::AllGather => out.push(Self::ALL_GATHER),
            Op::Barrier => out.push(Self::BARRIER),
            Op::Broadcast { root } => {
                out.push(Self::BROADCAST);
                // Roots are ranks, and job sizes fit a u32 (TcpBootstrap::new checks).
                out.extend_from_slice(&(root as u32).to_le_bytes());
            }
        }
        out
    }

    /// The op a received message leads with; the error says what is wrong with its header.
    fn parse(msg: &[u8]) -> std::result::Result<Op, String> {
        match msg.first() {
            Some(&Self::ALL_GATHER) => Ok(Op::AllGather),
            Some(&Self::BARRIER) => Ok(Op::Barrier),
            Some(&Self::BROADCAST) => msg
                .get(1..5)
                .and_then(|b| b.try_into().ok())
                .map(|b| Op::Broadcast {
                    root: u32::from_le_bytes(b) as usize,
                })
                .ok_or_else(|| format!("a {}-byte broadcast header", msg.len())),
            Some(k) => Err(format!("unknown collective kind {k}")),
            None => Err("an empty message".into()),
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::AllGather => f.write_str("all_gather"),
            Op::Barrier => f.write_str("barrier"),
            Op::Broadcast { root } => write!(f, "broadcast (root {root})"),
        }
    }
}

/// Sends `msg` (built by [`Op::message`]) to `peer`.
fn send(x: &impl Exchange, peer: usize, seq: u64, op: Op, msg: &[u8]) -> Result<()> {
    x.send_coll(peer, seq, msg)
        .map_err(|e| x.fail(peer, seq, op, e))
}

/// Receives `peer`'s message of collective `op` number `seq`, header checked (still in place:
/// the body starts at `op.header_len()`).
fn recv(x: &impl Exchange, peer: usize, seq: u64, op: Op) -> Result<Vec<u8>> {
    let msg = x
        .recv_coll(peer, seq, op)
        .map_err(|e| x.fail(peer, seq, op, e))?;
    let wrong = match Op::parse(&msg) {
        Ok(theirs) if theirs == op => return Ok(msg),
        Ok(theirs) => Error::Bootstrap(format!(
            "rank {peer} is in {theirs} #{seq} while this rank ({}) is in {op} #{seq}: the ranks \
             are out of step (they called bootstrap collectives, e.g. communicator setup or \
             buffer registration, in different orders)",
            x.rank()
        )),
        Err(why) => Error::Peer {
            rank: peer,
            message: format!("sent an unreadable message in {op} #{seq}: {why}"),
        },
    };
    Err(x.fail(peer, seq, op, wrong))
}

/// Packs blocks behind `op`'s header as: count (u32), each length (u64), then the bytes back to
/// back.
fn pack(op: Op, blocks: &[Vec<u8>]) -> Vec<u8> {
    let total: usize = blocks.iter().map(Vec::len).sum();
    let mut out = op.message(4 + 8 * blocks.len() + total);
    out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    for b in blocks {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    }
    for b in blocks {
        out.extend_from_slice(b);
    }
    out
}

fn unpack(msg: &[u8], expected: usize, from: usize) -> Result<Vec<Vec<u8>>> {
    let bad = |why: String| Error::Peer {
        rank: from,
        message: format!("malformed all_gather message: {why}"),
    };
    let field = |at: usize, n: usize| {
        msg.get(at..at + n)
            .ok_or_else(|| bad(format!("{} bytes, header truncated", msg.len())))
    };
    let count = u32::from_le_bytes(field(0, 4)?.try_into().map_err(|_| bad("count".into()))?);
    if count as usize != expected {
        return Err(bad(format!("{count} blocks, expected {expected}")));
    }
    let mut lens = Vec::with_capacity(expected);
    for i in 0..expected {
        let l = u64::from_le_bytes(
            field(4 + 8 * i, 8)?
                .try_into()
                .map_err(|_| bad("length".into()))?,
        );
        lens.push(usize::try_from(l).map_err(|_| bad(format!("block length {l}")))?);
    }
    let mut at = 4 + 8 * expected;
    let mut blocks = Vec::with_capacity(expected);
    for l in lens {
        let end = at
            .checked_add(l)
            .filter(|&e| e <= msg.len())
            .ok_or_else(|| {
                bad(format!(
                    "block of {l} bytes overruns the {}-byte message",
                    msg.len()
                ))
            })?;
        blocks.push(msg[at..end].to_vec());
        at = end;
    }
    if at != msg.len() {
        return Err(bad(format!("{} trailing bytes", msg.len() - at)));
    }
    Ok(blocks)
}

/// Bruck all_gather: see [`gather`].
pub(crate) fn all_gather(x: &impl Exchange, seq: u64, data: &[u8]) -> Result<Vec<Vec<u8>>> {
    gather(x, seq, Op::AllGather, data)
}

/// A dissemination barrier is exactly Bruck's pattern with empty payloads; its messages say
/// barrier, so that it never passes for a peer's all_gather of nothing.
pub(crate) fn barrier(x: &impl Exchange, seq: u64) -> Result<()> {
    gather(x, seq, Op::Barrier, &[]).map(|_| ())
}

/// Bruck all_gather. After round k rank r holds the blocks of ranks r..r+2^(k+1) (mod n); in
/// round k it sends what it holds (capped so nobody receives more than n blocks in total) to
/// r - 2^k and receives from r + 2^k.
fn gather(x: &impl Exchange, seq: u64, op: Op, data: &[u8]) -> Result<Vec<Vec<u8>>> {
    let (rank, n) = (x.rank(), x.size());
    // held[i] is the contribution of rank (rank + i) % n.
    let mut held: Vec<Vec<u8>> = vec![data.to_vec()];
    let mut dist = 1;
    while dist < n {
        let count = dist.min(n - dist);
        let to = (rank + n - dist) % n;
        let from = (rank + dist) % n;
        send(x, to, seq, op, &pack(op, &held[..count]))?;
        let msg = recv(x, from, seq, op)?;
        let blocks = unpack(&msg[op.header_len()..], count, from);
        held.extend(blocks.map_err(|e| x.fail(from, seq, op, e))?);
        dist *= 2;
    }
    // Rotate so index = rank.
    held.rotate_right(rank);
    Ok(held)
}

/// Binomial-tree broadcast from `root`: ceil(log2 n) rounds, each rank sends at most that many
/// times, so large payloads do not serialize on the root.
pub(crate) fn broadcast(x: &impl Exchange, seq: u64, root: usize, data: &[u8]) -> Result<Vec<u8>> {
    let (rank, n) = (x.rank(), x.size());
    if root >= n {
        return Err(Error::InvalidArgument(format!(
            "broadcast root {root} is not a rank of this {n}-rank job"
        )));
    }
    let op = Op::Broadcast { root };
    let vrank = (rank + n - root) % n;
    // The message with its header: children get it as received.
    let mut msg = if vrank == 0 {
        let mut m = op.message(data.len());
        m.extend_from_slice(data);
        Some(m)
    } else {
        None
    };
    // Receive from the parent: vrank with its lowest set bit cleared.
    let mut mask = 1;
    while mask < n {
        if vrank & mask != 0 {
            let parent = (vrank - mask + root) % n;
            msg = Some(recv(x, parent, seq, op)?);
            break;
        }
        mask <<= 1;
    }
    let mut msg =
        msg.ok_or_else(|| Error::Internal("broadcast tree left a rank without data".into()))?;
    // Forward to children vrank + m for every m below the bit we received on.
    mask >>= 1;
    while mask > 0 {
        if vrank + mask < n {
            send(x, (vrank + mask + root) % n, seq, op, &msg)?;
        }
        mask >>= 1;
    }
    msg.drain(..op.header_len());
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;
    use std::collections::{HashMap, VecDeque};
    use std::sync::{Arc, Condvar, Mutex};

    /// Messages in flight, one queue per (from, to).
    type Queues = HashMap<(usize, usize), VecDeque<Vec<u8>>>;

    /// In-memory exchange.
    struct Net {
        q: Mutex<Queues>,
        cv: Condvar,
    }
    struct Node {
        rank: usize,
        n: usize,
        net: Arc<Net>,
    }
    impl Exchange for Node {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.n
        }
        fn send_coll(&self, peer: usize, _seq: u64, data: &[u8]) -> Result<()> {
            let mut q = self.net.q.lock().unwrap();
            q.entry((self.rank, peer))
                .or_default()
                .push_back(data.to_vec());
            self.net.cv.notify_all();
            Ok(())
        }
        fn recv_coll(&self, peer: usize, _seq: u64, _op: Op) -> Result<Vec<u8>> {
            let mut q = self.net.q.lock().unwrap();
            loop {
                if let Some(m) = q.get_mut(&(peer, self.rank)).and_then(VecDeque::pop_front) {
                    return Ok(m);
                }
                q = self.net.cv.wait(q).unwrap();
            }
        }
        fn fail(&self, _peer: usize, _seq: u64, _op: Op, e: Error) -> Error {
            e
        }
    }

    fn run<T: Send + 'static>(n: usize, f: fn(&Node) -> T) -> Vec<T> {
        let net = Arc::new(Net {
            q: Mutex::new(HashMap::new()),
            cv: Condvar::new(),
        });
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let net = Arc::clone(&net);
                std::thread::spawn(move || f(&Node { rank, n, net }))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[rstest]
    fn bruck_gathers_variable_sizes(#[values(1, 2, 3, 5, 8, 13)] n: usize) {
        let out = run(n, |node| {
            all_gather(node, 0, &vec![node.rank as u8; node.rank]).unwrap()
        });
        for got in out {
            for (r, block) in got.iter().enumerate() {
                assert_eq!(block, &vec![r as u8; r]);
            }
        }
    }

    #[rstest]
    fn broadcast_from_any_root(#[values(1, 2, 6, 8)] n: usize) {
        for root in [0, n - 1] {
            let out = run(
                n,
                match root {
                    0 => |node: &Node| broadcast(node, 0, 0, &[node.rank as u8; 3]).unwrap(),
                    _ => {
                        |node: &Node| broadcast(node, 0, node.n - 1, &[node.rank as u8; 3]).unwrap()
                    }
                },
            );
            assert!(out.iter().all(|v| *v == vec![root as u8; 3]));
        }
    }

    /// Ranks that call different collectives under one sequence number fail at once, each
    /// naming both collectives. (Two ranks: with more, some wait on a failed rank, which only
    /// the TCP bootstrap's abort ends; core/tests/bootstrap.rs covers that.)
    #[test]
    fn ranks_out_of_step_name_both_collectives() {
        let out = run(2, |node| match node.rank {
            0 => barrier(node, 7).unwrap_err().to_string(),
            _ => all_gather(node, 7, &[1]).unwrap_err().to_string(),
        });
        for (e, want) in out.iter().zip([
            "rank 1 is in all_gather #7 while this rank (0) is in barrier #7",
            "rank 0 is in barrier #7 while this rank (1) is in all_gather #7",
        ]) {
            assert!(e.contains(want) && e.contains("out of step"), "{e}");
        }
    }

    #[test]
    fn headers_round_trip_and_garbage_is_named() {
        for op in [Op::AllGather, Op::Barrier, Op::Broadcast { root: 70000 }] {
            let m = op.message(0);
            assert_eq!((Op::parse(&m), m.len()), (Ok(op), op.header_len()));
        }
        assert!(Op::parse(&[9]).unwrap_err().contains("kind 9"));
        assert!(Op::parse(&[Op::BROADCAST, 1])
            .unwrap_err()
            .contains("2-byte"));
        assert!(Op::parse(&[]).unwrap_err().contains("empty"));
    }

    #[test]
    fn unpack_rejects_overrun() {
        let mut m = pack(Op::AllGather, &[vec![1, 2, 3]]);
        m.pop();
        assert!(unpack(&m[1..], 1, 4)
            .unwrap_err()
            .to_string()
            .contains("overruns"));
    }
}
