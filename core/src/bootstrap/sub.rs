//! A bootstrap over a subset of a parent bootstrap's ranks, as `ncclCommSplit` makes a
//! communicator over some of its parent's ranks, without new sockets.
//!
//! Sub-rank `i` is parent rank `members[i]`. Every message goes through the parent's point-to-point
//! `send`/`recv` under a tag of its own namespace, so several sub-bootstraps of one parent (the
//! per-host group and the cross-host group of a hierarchical algorithm) and the parent's own users
//! never take each other's messages:
//!
//! ```text
//! bit 63      set: a sub-bootstrap's tag (parent users keep their tags below 2^63)
//! bits 32..62 namespace: drawn by parent rank 0 at the split, unique among its splits
//! bit 31      set: a collective of the sub-bootstrap, bits 0..30 its sequence number
//!             clear: a user tag of the sub-bootstrap (below 2^31)
//! ```
//!
//! Collectives (all-gather, barrier, broadcast) are the parent's algorithms run over the members.
//! Liveness is the parent's: a failure of any parent rank reaches the sub-bootstrap's listeners.

use super::collectives::{self, Exchange, Op};
use super::{Bootstrap, FailureListener};
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Set in every tag a sub-bootstrap sends under.
const SUB_TAG: u64 = 1 << 63;
/// Set in a sub-bootstrap tag that carries a collective's sequence number.
const COLLECTIVE_BIT: u64 = 1 << 31;
/// User tags of a sub-bootstrap stay below this.
pub const MAX_SUB_TAG: u64 = COLLECTIVE_BIT;
/// Namespaces are 31 bits wide.
const NAMESPACE_MASK: u32 = 0x7fff_ffff;

/// Namespaces drawn in this process: parent rank 0 draws one per split and broadcasts it, so every
/// split of one parent gets its own (the parent's rank 0 lives in one process).
static NEXT_NAMESPACE: AtomicU32 = AtomicU32::new(1);

/// See the module docs.
pub struct SubBootstrap {
    link: Link,
    /// Sequence number of the next collective (the same on every member: collectives are called in
    /// the same order by all of them).
    seq: AtomicU64,
}

/// The members' messaging over the parent, with the namespace of their tags.
struct Link {
    parent: Arc<dyn Bootstrap>,
    /// Parent rank of each sub-rank.
    members: Vec<usize>,
    /// This rank's sub-rank.
    index: usize,
    namespace: u64,
}

impl Link {
    fn tag(&self, inner: u64) -> u64 {
        SUB_TAG | (self.namespace << 32) | inner
    }

    fn parent_rank(&self, peer: usize) -> Result<usize> {
        self.members.get(peer).copied().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "peer {peer} is not a rank of this sub-bootstrap of {} ranks",
                self.members.len()
            ))
        })
    }
}

impl Exchange for Link {
    fn rank(&self) -> usize {
        self.index
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn send_coll(&self, peer: usize, seq: u64, data: &[u8]) -> Result<()> {
        let to = self.parent_rank(peer)?;
        self.parent.send(
            to,
            self.tag(COLLECTIVE_BIT | (seq & (COLLECTIVE_BIT - 1))),
            data,
        )
    }
    fn recv_coll(&self, peer: usize, seq: u64, _op: Op) -> Result<Vec<u8>> {
        let from = self.parent_rank(peer)?;
        self.parent.recv(
            from,
            self.tag(COLLECTIVE_BIT | (seq & (COLLECTIVE_BIT - 1))),
        )
    }
    /// Adds which sub-bootstrap step failed. The parent's job is not aborted from here (the
    /// `Bootstrap` trait offers no abort): a member whose peer fails may wait out its timeout.
    fn fail(&self, peer: usize, seq: u64, op: Op, e: Error) -> Error {
        let (me, from) = (self.index, self.members.get(peer).copied().unwrap_or(peer));
        Error::Bootstrap(format!(
            "sub-bootstrap {op} #{seq}: sub-rank {me} with sub-rank {peer} (parent rank \
             {from}): {e}"
        ))
    }
}

/// Parent ranks, encoded for the split's consistency check.
fn encode_members(members: &[usize]) -> Vec<u8> {
    members
        .iter()
        .flat_map(|&m| (m as u64).to_le_bytes())
        .collect()
}

impl SubBootstrap {
    /// Collective over `parent`: every parent rank calls it once, in the same order relative to its
    /// other parent collectives, with the parent ranks of its own group in sub-rank order (this
    /// rank among them). Every member of a group must pass the same list; groups may overlap only
    /// in the sense that different ranks' lists differ entirely. Errors name the offending rank or
    /// list.
    pub fn split(parent: Arc<dyn Bootstrap>, members: &[usize]) -> Result<SubBootstrap> {
        let (me, size) = (parent.rank(), parent.size());
        let index = validate_members(members, me, size);
        // One all-gather carries each rank's namespace draw (parent rank 0's is taken) and its
        // group. A rank whose own list is bad still takes part (with an empty group), so its
        // peers fail with a message instead of a timeout.
        let drawn = NEXT_NAMESPACE.fetch_add(1, Ordering::Relaxed) & NAMESPACE_MASK;
        let group = match &index {
            Ok(_) => encode_members(members),
            Err(_) => Vec::new(),
        };
        let all = parent.all_gather(&[drawn.to_le_bytes().to_vec(), group.clone()].concat())?;
        let index = index?;
        for &m in members {
            if all.get(m).and_then(|b| b.get(4..)) != Some(group.as_slice()) {
                return Err(Error::InvalidArgument(format!(
                    "split: rank {me} groups {members:?}, but rank {m} (a member) passed another \
                     group"
                )));
            }
        }
        let namespace = all
            .first()
            .and_then(|b| b.get(..4))
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
            .ok_or_else(|| Error::Peer {
                rank: 0,
                message: "sent a malformed split (no namespace)".into(),
            })?;
        Ok(SubBootstrap {
            link: Link {
                parent,
                members: members.to_vec(),
                index,
                namespace: u64::from(namespace & NAMESPACE_MASK),
            },
            seq: AtomicU64::new(0),
        })
    }

    /// Parent rank of each sub-rank.
    pub fn members(&self) -> &[usize] {
        &self.link.members
    }

    /// The bootstrap this one is a view of.
    pub fn parent(&self) -> &Arc<dyn Bootstrap> {
        &self.link.parent
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// The parent's rank and tag of `peer`'s messages under `tag` in this group.
    fn parent_address(&self, peer: usize, tag: u64) -> Result<(usize, u64)> {
        if tag >= MAX_SUB_TAG {
            return Err(Error::InvalidArgument(format!(
                "tag {tag:#x} of a sub-bootstrap: tags must be below {MAX_SUB_TAG:#x}"
            )));
        }
        Ok((self.link.parent_rank(peer)?, self.link.tag(tag)))
    }
}

/// This rank's sub-rank in `members`, after checking the list: not empty, parent ranks only, no
/// rank twice, this rank (`me` of `size`) among them.
fn validate_members(members: &[usize], me: usize, size: usize) -> Result<usize> {
    if let Some(&bad) = members.iter().find(|&&m| m >= size) {
        return Err(Error::InvalidArgument(format!(
            "split: member {bad} is not a rank of the parent's {size}"
        )));
    }
    for (i, m) in members.iter().enumerate() {
        if members[..i].contains(m) {
            return Err(Error::InvalidArgument(format!(
                "split: rank {m} is listed twice in {members:?}"
            )));
        }
    }
    members.iter().position(|&m| m == me).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "split: rank {me} is not in its own group {members:?}"
        ))
    })
}

impl Bootstrap for SubBootstrap {
    fn rank(&self) -> usize {
        self.link.index
    }
    fn size(&self) -> usize {
        self.link.members.len()
    }
    fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        let (to, tag) = self.parent_address(peer, tag)?;
        self.link.parent.send(to, tag, data)
    }
    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>> {
        let (from, tag) = self.parent_address(peer, tag)?;
        self.link.parent.recv(from, tag)
    }
    fn try_recv(&self, peer: usize, tag: u64) -> Result<Option<Vec<u8>>> {
        let (from, tag) = self.parent_address(peer, tag)?;
        self.link.parent.try_recv(from, tag)
    }
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        collectives::all_gather(&self.link, self.next_seq(), data)
    }
    fn job_rank(&self, rank: usize) -> usize {
        let parent_rank = self.link.members.get(rank).copied().unwrap_or(rank);
        self.link.parent.job_rank(parent_rank)
    }
    fn barrier(&self) -> Result<()> {
        collectives::barrier(&self.link, self.next_seq())
    }
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        collectives::broadcast(&self.link, self.next_seq(), root, data)
    }
    /// The parent's liveness: a failure anywhere in the parent's job is this one's too.
    fn watch_failures(&self, listener: Weak<dyn FailureListener>) {
        self.link.parent.watch_failures(listener)
    }
    /// The parent's silent ranks that are members, as sub-ranks.
    fn unresponsive_peers(&self, within: Duration) -> Vec<usize> {
        self.link
            .parent
            .unresponsive_peers(within)
            .into_iter()
            .filter_map(|r| self.link.members.iter().position(|&m| m == r))
            .collect()
    }
    /// The parent's job fails: the group's `rank` is blamed by its rank there.
    fn abort_job(&self, rank: usize, reason: &str) {
        if let Some(&member) = self.link.members.get(rank) {
            self.link.parent.abort_job(member, reason);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::on_loopback_ranks;

    /// Runs `body(parent)` on `n` thread ranks of one TCP bootstrap job over loopback.
    fn with_parents<T: Send + 'static>(
        n: usize,
        body: impl Fn(Arc<dyn Bootstrap>) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        on_loopback_ranks(n, Duration::from_secs(10), move |_, parent| body(parent))
    }

    /// 2 hosts x 3 ranks: the per-host groups and the cross-host groups of a hierarchical
    /// algorithm, split in that order on every rank, each running every collective and
    /// point-to-point messages under the same tag at the same time as the other.
    #[test]
    fn host_and_cross_groups_run_side_by_side() {
        let got = with_parents(6, |parent| {
            let r = parent.rank();
            let host: Vec<usize> = if r < 3 { vec![0, 1, 2] } else { vec![3, 4, 5] };
            let cross = vec![r % 3, r % 3 + 3];
            let h = SubBootstrap::split(parent.clone(), &host).expect("host split");
            let c = SubBootstrap::split(parent.clone(), &cross).expect("cross split");
            assert_eq!((h.rank(), h.size()), (r % 3, 3));
            assert_eq!((c.rank(), c.size()), (r / 3, 2));
            // Errors name the job's ranks: cross sub-rank 1 is job rank r % 3 + 3.
            assert_eq!((c.job_rank(1), h.job_rank(0)), (r % 3 + 3, r / 3 * 3));
            let hg = h.all_gather(&[r as u8]).expect("host all_gather");
            let cg = c.all_gather(&[r as u8, 7]).expect("cross all_gather");
            // Same user tag in both groups and in the parent: each reaches its own receiver.
            let next = (h.rank() + 1) % 3;
            let prev = (h.rank() + 2) % 3;
            h.send(next, 5, b"host").expect("send");
            c.send(1 - c.rank(), 5, b"cross").expect("send");
            parent.send((r + 1) % 6, 5, b"parent").expect("send");
            let from_host = h.recv(prev, 5).expect("recv");
            let from_cross = c.recv(1 - c.rank(), 5).expect("recv");
            let from_parent = parent.recv((r + 5) % 6, 5).expect("recv");
            let b = c.broadcast(1, &[r as u8]).expect("broadcast");
            h.barrier().expect("barrier");
            c.barrier().expect("barrier");
            (hg, cg, from_host, from_cross, from_parent, b, r)
        });
        for (hg, cg, fh, fc, fp, b, r) in got {
            let base = (r / 3 * 3) as u8;
            assert_eq!(hg, vec![vec![base], vec![base + 1], vec![base + 2]]);
            let low = (r % 3) as u8;
            assert_eq!(cg, vec![vec![low, 7], vec![low + 3, 7]]);
            assert_eq!(
                (fh.as_slice(), fc.as_slice()),
                (&b"host"[..], &b"cross"[..])
            );
            assert_eq!(fp, b"parent");
            assert_eq!(
                b,
                vec![low + 3],
                "rank {r}: broadcast from cross sub-rank 1"
            );
        }
    }

    /// Two splits over the same members get different namespaces, so a message of one is never
    /// taken by the other.
    #[test]
    fn two_splits_of_one_group_stay_apart() {
        let got = with_parents(2, |parent| {
            let a = SubBootstrap::split(parent.clone(), &[0, 1]).expect("a");
            let b = SubBootstrap::split(parent.clone(), &[1, 0]).expect("b");
            let peer_a = 1 - a.rank();
            a.send(peer_a, 1, b"a").expect("send");
            // b's sub-ranks are reversed: parent rank 1 is b's sub-rank 0.
            let peer_b = 1 - b.rank();
            b.send(peer_b, 1, b"b").expect("send");
            (
                b.recv(peer_b, 1).expect("recv b"),
                a.recv(peer_a, 1).expect("recv a"),
                a.link.namespace != b.link.namespace,
                b.rank(),
            )
        });
        for (from_b, from_a, distinct, b_rank) in got {
            assert_eq!(
                (from_b.as_slice(), from_a.as_slice()),
                (&b"b"[..], &b"a"[..])
            );
            assert!(distinct);
            assert!(b_rank < 2);
        }
    }

    /// Sub-ranks out of step (one in a barrier, the other in an all_gather) both fail at once,
    /// naming both collectives and the sub-bootstrap.
    #[test]
    fn members_out_of_step_name_both_collectives() {
        let got = with_parents(2, |parent| {
            let s = SubBootstrap::split(parent, &[1, 0]).expect("split");
            let e = match s.rank() {
                0 => s.barrier().unwrap_err(),
                _ => s.all_gather(b"x").unwrap_err(),
            };
            (s.rank(), e.to_string())
        });
        for (r, e) in got {
            assert!(
                e.starts_with("bootstrap: sub-bootstrap ")
                    && e.contains("out of step")
                    && e.contains("barrier #0")
                    && e.contains("all_gather #0")
                    // The peer's parent rank: with members [1, 0], this sub-rank's number.
                    && e.contains(&format!("parent rank {r}")),
                "sub-rank {r}: {e}"
            );
        }
    }

    #[test]
    fn bad_groups_are_named_on_every_rank() {
        let got = with_parents(3, |parent| {
            let members: Vec<usize> = match parent.rank() {
                // Rank 0 thinks it is alone with rank 1; rank 1 disagrees.
                0 => vec![0, 1],
                1 => vec![1, 2],
                _ => vec![1, 2],
            };
            SubBootstrap::split(parent, &members)
                .err()
                .map(|e| e.to_string())
        });
        assert!(
            got[0].as_deref().is_some_and(|e| e.contains("rank 1")),
            "{got:?}"
        );
        assert!(
            got[1].as_deref().is_none() && got[2].as_deref().is_none(),
            "{got:?}"
        );
    }

    #[test]
    fn member_lists_are_checked() {
        assert_eq!(validate_members(&[2, 0, 1], 0, 3).unwrap(), 1);
        let e = validate_members(&[0, 3], 0, 3).unwrap_err().to_string();
        assert!(e.contains("member 3"), "{e}");
        let e = validate_members(&[0, 1, 0], 0, 3).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
        let e = validate_members(&[1, 2], 0, 3).unwrap_err().to_string();
        assert!(e.contains("not in its own group"), "{e}");
        let e = validate_members(&[], 0, 3).unwrap_err().to_string();
        assert!(e.contains("not in its own group"), "{e}");
    }

    #[test]
    fn tags_at_or_above_the_limit_are_refused() {
        let got = with_parents(2, |parent| {
            let s = SubBootstrap::split(parent, &[0, 1]).expect("split");
            let peer = 1 - s.rank();
            let e = s.send(peer, MAX_SUB_TAG, b"x").unwrap_err().to_string();
            let r = s.recv(peer, u64::MAX).unwrap_err().to_string();
            let p = s.send(2, 1, b"x").unwrap_err().to_string();
            (e, r, p)
        });
        for (e, r, p) in got {
            assert!(e.contains("must be below"), "{e}");
            assert!(r.contains("must be below"), "{r}");
            assert!(p.contains("peer 2"), "{p}");
        }
    }
}
