//! Which transport each peer pair uses: CudaIpc on one host; between hosts InfiniBand when an HCA
//! is usable, Ethernet (TCP through the proxy) otherwise.
//!
//! Whether IB is usable is decided by the IB crate and handed in as [`IbAvailability`], since the
//! core depends on no backend: `mscclpp-ib`'s `VerbsConnector::availability` counts the HCAs
//! libibverbs lists after `MSCCLPP_HCA_DEVICES` (or every HCA found), unless
//! `MSCCLPP_DISABLE_IB_TESTS=1`, no HCA, or a missing libibverbs rules IB out, and says which. Ranks of one host spread over the usable HCAs by local rank, as NCCL
//! pairs each GPU with its nearest NIC on the usual 1 GPU : 1 NIC machines.
//!
//! Both ends of a pair must pick the same transport: [`TransportPlan::agree`] (fed by the collective
//! `connect::agree_plan`) turns IB into Ethernet towards every peer whose own end cannot use IB
//! (no HCA there, `MSCCLPP_DISABLE_IB_TESTS=1` set there only, no libibverbs there).
//!
//! [`TransportPlan::log_once`] logs each distinct plan once per process, with the IB mode
//! (`MSCCLPP_IBV_MODE`) when IB is chosen, so a job's log says how its ranks talk.

use crate::env::{Env, IbvMode};
use crate::topology::Topology;
use crate::transport::TransportKind;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::Mutex;

/// Whether InfiniBand can carry traffic between hosts in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IbAvailability {
    /// This many HCAs are usable (after `MSCCLPP_HCA_DEVICES`); entry `i` is `TransportKind::Ib(i)`.
    Usable { hcas: usize },
    /// IB cannot be used, and why (shown in the log and in errors).
    Unusable(String),
}

impl IbAvailability {
    /// Usable HCAs given the names found on this host and `MSCCLPP_HCA_DEVICES` (NCCL-style entries
    /// may carry a port, `mlx5_0:1`), unless `MSCCLPP_DISABLE_IB_TESTS` rules IB out. The reason
    /// names which of these applied.
    pub fn from_hcas(env: &Env, found: &[String]) -> IbAvailability {
        if env.disable_ib_tests {
            return IbAvailability::Unusable("disabled by MSCCLPP_DISABLE_IB_TESTS=1".into());
        }
        let hcas = if env.hca_devices.is_empty() {
            found.len()
        } else {
            env.hca_devices
                .iter()
                .filter(|want| {
                    let name = want.split(':').next().unwrap_or(want);
                    found.iter().any(|f| f == name)
                })
                .count()
        };
        if hcas == 0 {
            let found = if found.is_empty() {
                "none found".to_string()
            } else {
                format!("found: {}", found.join(", "))
            };
            return IbAvailability::Unusable(if env.hca_devices.is_empty() {
                format!("no InfiniBand HCA ({found})")
            } else {
                format!(
                    "MSCCLPP_HCA_DEVICES={} names none of the HCAs here ({found})",
                    env.hca_devices.join(",")
                )
            });
        }
        IbAvailability::Usable { hcas }
    }
}

/// The transport between `me` and `peer` (see the module docs).
pub fn transport_between(
    topo: &Topology,
    me: usize,
    peer: usize,
    ib: &IbAvailability,
) -> TransportKind {
    if topo.same_host(me, peer) {
        return TransportKind::CudaIpc;
    }
    match ib {
        IbAvailability::Usable { hcas } => {
            let index = topo.local_rank(me) % (*hcas).max(1);
            TransportKind::Ib(u8::try_from(index).unwrap_or(u8::MAX))
        }
        IbAvailability::Unusable(_) => TransportKind::Ethernet,
    }
}

/// The transport towards every peer of one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportPlan {
    pub rank: usize,
    /// Transport by peer rank (this rank itself excluded).
    pub peers: BTreeMap<usize, TransportKind>,
    pub ib: IbAvailability,
    pub ibv_mode: IbvMode,
    /// The topology in words (`2 hosts x 4 ranks`).
    pub topology: String,
    /// Peers on other hosts that get Ethernet although IB is usable here, because it is not at
    /// their end ([`TransportPlan::agree`]).
    pub ib_unusable_at: Vec<usize>,
}

impl TransportPlan {
    pub fn new(topo: &Topology, me: usize, ib: IbAvailability, ibv_mode: IbvMode) -> Self {
        let peers = (0..topo.world_size())
            .filter(|&p| p != me)
            .map(|p| (p, transport_between(topo, me, p, &ib)))
            .collect();
        TransportPlan {
            rank: me,
            peers,
            ib,
            ibv_mode,
            topology: topo.to_string(),
            ib_unusable_at: Vec::new(),
        }
    }

    /// The plan both ends of every pair agree on: `usable[r]` says whether rank `r` can use IB
    /// (its own [`IbAvailability`]); a peer that cannot gets Ethernet instead of IB, as it plans
    /// Ethernet towards us. `usable` must cover every rank of the job.
    pub fn agree(mut self, usable: &[bool]) -> Self {
        for (&peer, kind) in self.peers.iter_mut() {
            if matches!(kind, TransportKind::Ib(_)) && !usable.get(peer).copied().unwrap_or(false) {
                *kind = TransportKind::Ethernet;
                self.ib_unusable_at.push(peer);
            }
        }
        self
    }

    /// The transport towards `peer` (`None` for this rank itself or a rank outside the job).
    pub fn kind(&self, peer: usize) -> Option<TransportKind> {
        self.peers.get(&peer).copied()
    }

    /// Logs the plan at INFO, once per process for each distinct plan (a rank that builds several
    /// PortChannel algorithms, or the cross-host communicator of `hierarchical`, says it once).
    pub fn log_once(&self) {
        static LOGGED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
        let line = self.to_string();
        let first = match LOGGED.lock() {
            Ok(mut seen) => seen.get_or_insert_with(HashSet::new).insert(line.clone()),
            // A panic elsewhere while logging: saying it twice beats not saying it.
            Err(_) => true,
        };
        if first {
            tracing::info!(target: "mscclpp::net", "{line}");
        }
    }
}

impl fmt::Display for TransportPlan {
    /// `rank 1 (2 hosts x 2 ranks): CudaIpc to 0; Ethernet to 2,3 (IB unusable: ...)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut by_kind: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (peer, kind) in &self.peers {
            by_kind
                .entry(kind.to_string())
                .or_default()
                .push(peer.to_string());
        }
        write!(f, "rank {} ({}):", self.rank, self.topology)?;
        if by_kind.is_empty() {
            f.write_str(" no peers")?;
        }
        let groups: Vec<String> = by_kind
            .iter()
            .map(|(kind, peers)| format!(" {kind} to {}", peers.join(",")))
            .collect();
        f.write_str(&groups.join(";"))?;
        let crosses_hosts = self.peers.values().any(|k| *k != TransportKind::CudaIpc);
        match &self.ib {
            IbAvailability::Usable { hcas } if crosses_hosts => {
                write!(
                    f,
                    " (IB: {hcas} HCAs, MSCCLPP_IBV_MODE={:?})",
                    self.ibv_mode
                )
            }
            IbAvailability::Unusable(why) if crosses_hosts => write!(f, " (IB unusable: {why})"),
            _ => Ok(()),
        }?;
        if !self.ib_unusable_at.is_empty() {
            let ranks: Vec<String> = self.ib_unusable_at.iter().map(|r| r.to_string()).collect();
            write!(f, " (IB unusable at rank {})", ranks.join(","))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn env(pairs: &[(&str, &str)]) -> Env {
        Env::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()))).unwrap()
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[rstest]
    #[case(&[], &["mlx5_0", "mlx5_1"], Some(2), "")]
    #[case(&[("MSCCLPP_HCA_DEVICES", "mlx5_1:1")], &["mlx5_0", "mlx5_1"], Some(1), "")]
    #[case(&[("MSCCLPP_HCA_DEVICES", "mlx5_7")], &["mlx5_0"], None,
           "MSCCLPP_HCA_DEVICES=mlx5_7 names none of the HCAs here (found: mlx5_0)")]
    #[case(&[], &[], None, "no InfiniBand HCA (none found)")]
    #[case(&[("MSCCLPP_DISABLE_IB_TESTS", "1")], &["mlx5_0"], None, "MSCCLPP_DISABLE_IB_TESTS=1")]
    fn ib_availability_respects_the_environment(
        #[case] vars: &[(&str, &str)],
        #[case] found: &[&str],
        #[case] hcas: Option<usize>,
        #[case] why: &str,
    ) {
        match IbAvailability::from_hcas(&env(vars), &names(found)) {
            IbAvailability::Usable { hcas: n } => assert_eq!(Some(n), hcas),
            IbAvailability::Unusable(reason) => {
                assert_eq!(hcas, None, "{reason}");
                assert!(reason.contains(why), "{reason:?} lacks {why:?}");
            }
        }
    }

    #[test]
    fn same_host_is_ipc_other_hosts_ib_or_ethernet() {
        let topo = Topology::from_host_ids(&["a", "a", "a", "a", "b", "b", "b", "b"]).unwrap();
        let ib = IbAvailability::Usable { hcas: 2 };
        let no_ib = IbAvailability::Unusable("none".into());
        assert_eq!(transport_between(&topo, 0, 3, &ib), TransportKind::CudaIpc);
        assert_eq!(
            transport_between(&topo, 0, 4, &no_ib),
            TransportKind::Ethernet
        );
        // Local ranks spread over the HCAs: 0->IB0, 1->IB1, 2->IB0, 3->IB1.
        let hca: Vec<TransportKind> = (4..8)
            .map(|me| transport_between(&topo, me, 0, &ib))
            .collect();
        assert_eq!(
            hca,
            vec![
                TransportKind::Ib(0),
                TransportKind::Ib(1),
                TransportKind::Ib(0),
                TransportKind::Ib(1)
            ]
        );
    }

    #[test]
    fn plan_lists_every_peer_and_says_why() {
        let topo = Topology::from_host_ids(&["a", "a", "b", "b"]).unwrap();
        let plan = TransportPlan::new(
            &topo,
            1,
            IbAvailability::Unusable("no InfiniBand HCA (none found)".into()),
            IbvMode::Host,
        );
        assert_eq!(plan.kind(1), None);
        assert_eq!(plan.kind(0), Some(TransportKind::CudaIpc));
        assert_eq!(plan.kind(3), Some(TransportKind::Ethernet));
        assert_eq!(
            plan.to_string(),
            "rank 1 (2 hosts x 2 ranks): CudaIpc to 0; Ethernet to 2,3 \
             (IB unusable: no InfiniBand HCA (none found))"
        );
        let ib = TransportPlan::new(
            &topo,
            2,
            IbAvailability::Usable { hcas: 1 },
            IbvMode::HostNoAtomic,
        );
        assert_eq!(
            ib.to_string(),
            "rank 2 (2 hosts x 2 ranks): CudaIpc to 3; IB0 to 0,1 (IB: 1 HCAs, MSCCLPP_IBV_MODE=HostNoAtomic)"
        );
        let single = Topology::from_host_ids(&["a"]).unwrap();
        let one = TransportPlan::new(
            &single,
            0,
            IbAvailability::Usable { hcas: 1 },
            IbvMode::Host,
        );
        assert_eq!(one.to_string(), "rank 0 (1 host x 1 rank): no peers");
    }

    /// A peer whose end cannot use IB gets Ethernet from both ends; IB stays towards the others.
    #[test]
    fn plans_agree_with_peers_without_ib() {
        let topo = Topology::from_host_ids(&["a", "a", "b", "c"]).unwrap();
        let usable = [true, true, true, false];
        let ib = || IbAvailability::Usable { hcas: 1 };
        let plan = TransportPlan::new(&topo, 0, ib(), IbvMode::Host).agree(&usable);
        assert_eq!(plan.kind(1), Some(TransportKind::CudaIpc));
        assert_eq!(plan.kind(2), Some(TransportKind::Ib(0)));
        assert_eq!(plan.kind(3), Some(TransportKind::Ethernet));
        assert_eq!(
            plan.to_string(),
            "rank 0 (3 hosts, uneven: 2+1+1 ranks): CudaIpc to 1; Ethernet to 3; IB0 to 2 \
             (IB: 1 HCAs, MSCCLPP_IBV_MODE=Host) (IB unusable at rank 3)"
        );
        // Rank 3 itself has no IB: its own plan is Ethernet to everyone, matching the others'.
        let none = IbAvailability::Unusable("no InfiniBand HCA (none found)".into());
        let three = TransportPlan::new(&topo, 3, none, IbvMode::Host).agree(&usable);
        assert!((0..3).all(|p| three.kind(p) == Some(TransportKind::Ethernet)));
        assert!(three.ib_unusable_at.is_empty());
        for me in 0..3 {
            let p = TransportPlan::new(&topo, me, ib(), IbvMode::Host).agree(&usable);
            assert_eq!(p.kind(3), three.kind(me), "rank {me} and rank 3 disagree");
        }
    }
}
