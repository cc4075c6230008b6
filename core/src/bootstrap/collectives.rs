//! Collectives built on point-to-point messages: all_gather (Bruck), barrier, broadcast
//! (binomial tree).
//!
//! Bruck's all_gather takes ceil(log2 n) rounds for any n (3 for 8 ranks, 6 for 64) and moves the
//! same bytes as a ring, so it is both the low-latency choice for tiny payloads (barriers, 8-byte
//! exchanges) and fine for large ones. Contributions may differ in size per rank, so the choice
//! of algorithm must not depend on local sizes: one algorithm for all sizes keeps every rank in
//! step. Each rank talks to ceil(log2 n) distinct peers, which bounds the sockets a job opens.

use crate::error::{Error, Result};

/// What a collective needs from the transport: ordered messages to and from any peer under a
/// per-collective sequence number.
pub(crate) trait Exchange {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn send_coll(&self, peer: usize, seq: u64, data: &[u8]) -> Result<()>;
    /// `op` names the collective for error messages.
    fn recv_coll(&self, peer: usize, seq: u64, op: &str) -> Result<Vec<u8>>;
}

/// Packs blocks as: count (u32), each length (u64), then the bytes back to back.
fn pack(blocks: &[Vec<u8>]) -> Vec<u8> {
    let total: usize = blocks.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(4 + 8 * blocks.len() + total);
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

/// Bruck all_gather. After round k rank r holds the blocks of ranks r..r+2^(k+1) (mod n); in
/// round k it sends what it holds (capped so nobody receives more than n blocks in total) to
/// r - 2^k and receives from r + 2^k.
pub(crate) fn all_gather(x: &impl Exchange, seq: u64, data: &[u8]) -> Result<Vec<Vec<u8>>> {
    let (rank, n) = (x.rank(), x.size());
    // held[i] is the contribution of rank (rank + i) % n.
    let mut held: Vec<Vec<u8>> = vec![data.to_vec()];
    let mut dist = 1;
    while dist < n {
        let count = dist.min(n - dist);
        let to = (rank + n - dist) % n;
        let from = (rank + dist) % n;
        x.send_coll(to, seq, &pack(&held[..count]))?;
        let msg = x.recv_coll(from, seq, "all_gather")?;
        held.extend(unpack(&msg, count, from)?);
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
    let vrank = (rank + n - root) % n;
    let mut value = if vrank == 0 {
        Some(data.to_vec())
    } else {
        None
    };
    // Receive from the parent: vrank with its lowest set bit cleared.
    let mut mask = 1;
    while mask < n {
        if vrank & mask != 0 {
            let parent = (vrank - mask + root) % n;
            value = Some(x.recv_coll(parent, seq, "broadcast")?);
            break;
        }
        mask <<= 1;
    }
    let value =
        value.ok_or_else(|| Error::Internal("broadcast tree left a rank without data".into()))?;
    // Forward to children vrank + m for every m below the bit we received on.
    mask >>= 1;
    while mask > 0 {
        if vrank + mask < n {
            x.send_coll((vrank + mask + root) % n, seq, &value)?;
        }
        mask >>= 1;
    }
    Ok(value)
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
        fn recv_coll(&self, peer: usize, _seq: u64, _op: &str) -> Result<Vec<u8>> {
            let mut q = self.net.q.lock().unwrap();
            loop {
                if let Some(m) = q.get_mut(&(peer, self.rank)).and_then(VecDeque::pop_front) {
                    return Ok(m);
                }
                q = self.net.cv.wait(q).unwrap();
            }
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

    #[test]
    fn unpack_rejects_overrun() {
        let mut m = pack(&[vec![1, 2, 3]]);
        m.pop();
        assert!(unpack(&m, 1, 4)
            .unwrap_err()
            .to_string()
            .contains("overruns"));
    }
}
