//! Which ranks share a host: hosts, local ranks and ranks per host, from every rank's host identity.
//!
//! Two ranks are on one host when their host identities are equal. The identity is
//! `MSCCLPP_HOSTID` when set (so one machine can pose as several hosts: traffic between its "hosts"
//! then takes the network transports, over loopback), else the host name and boot id. Launchers'
//! `LOCAL_RANK`/`LOCAL_WORLD_SIZE` are not used for this: they describe how the job was started,
//! not which ranks can map each other's memory.
//!
//! Hosts are numbered in the order of their lowest rank; local ranks in rank order within a host.
//! The same list of identities gives the same [`Topology`] on every rank.

use crate::env::Env;
use crate::error::{Error, Result};
use std::fmt;

/// This process's host identity: `MSCCLPP_HOSTID` when set, else `hostname/boot_id` (the boot id
/// tells apart two machines that share a host name, and one machine across reboots).
pub fn host_identity(env: &Env) -> String {
    if let Some(id) = &env.host_id {
        return id.clone();
    }
    format!(
        "{}/{}",
        read_trimmed("/proc/sys/kernel/hostname"),
        boot_id()
    )
}

/// This machine's boot id: one machine, whatever `MSCCLPP_HOSTID` says.
fn boot_id() -> String {
    read_trimmed("/proc/sys/kernel/random/boot_id")
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The physical GPU with PCI bus id `pci_bus_id` on this machine, as [`Placement::gpu`] names it:
/// the boot id and the bus id, so ranks of simulated hosts (`MSCCLPP_HOSTID`) on one GPU still
/// count as sharing it.
pub fn gpu_identity(pci_bus_id: &str) -> String {
    format!("{}/{}", boot_id(), pci_bus_id.replace(' ', "_"))
}

/// What each rank says about where it runs, gathered once when a communicator is created: its
/// host identity (see the module docs), its process, its device ordinal, its physical GPU
/// ([`gpu_identity`]) and whether it is an MPS client of it. Encoded as
/// `"{pid} {device} {mps 0|1} {gpu} {host}"` (the host identity last, so it may hold spaces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub host: String,
    pub pid: u32,
    pub device: usize,
    pub gpu: String,
    pub mps_client: bool,
}

impl Placement {
    pub fn encode(&self) -> String {
        let mps = u8::from(self.mps_client);
        format!(
            "{} {} {mps} {} {}",
            self.pid, self.device, self.gpu, self.host
        )
    }

    /// The placement rank `rank` sent; an error naming the rank when it is not one.
    pub fn decode(rank: usize, text: &str) -> Result<Placement> {
        let mut parts = text.splitn(5, ' ');
        let mut next = || parts.next();
        let (pid, device, mps, gpu, host) = (next(), next(), next(), next(), next());
        let mps = mps.and_then(|m| match m {
            "0" => Some(false),
            "1" => Some(true),
            _ => None,
        });
        match (
            pid.and_then(|p| p.parse().ok()),
            device.and_then(|d| d.parse().ok()),
            mps,
            gpu,
            host,
        ) {
            (Some(pid), Some(device), Some(mps_client), Some(gpu), Some(host)) => Ok(Placement {
                host: host.to_string(),
                pid,
                device,
                gpu: gpu.to_string(),
                mps_client,
            }),
            _ => Err(Error::InvalidArgument(format!(
                "rank {rank} sent a malformed placement {text:?} (expected \"pid device mps gpu \
                 host\")"
            ))),
        }
    }
}

/// The most ranks of `placements` that share one physical GPU as MPS clients, over every GPU of
/// the job; `None` where no rank is an MPS client. The same answer on every rank, so a decision
/// made from it (`port_channel::shared_queue_hazard`) is made alike everywhere.
pub fn most_mps_clients_on_a_gpu(placements: &[Placement]) -> Option<usize> {
    let clients: Vec<&Placement> = placements.iter().filter(|p| p.mps_client).collect();
    clients
        .iter()
        .map(|me| clients.iter().filter(|p| p.gpu == me.gpu).count())
        .max()
}

/// How many ranks of `placements` (index = rank) run in the process of `rank` on its device, itself
/// included. Such ranks share one CUDA context and the device's SMs with no MPS partition between
/// them, so their kernels compete for the same SMs: every native kernel needs its whole grid
/// resident while it waits for peers, so each of them may count on only its share of the SMs
/// (`Communicator::multiprocessors`). Ranks in other processes are not counted: under MPS each
/// process already reads its own share as its SM count (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE).
pub fn ranks_sharing_device(placements: &[Placement], rank: usize) -> usize {
    let Some(me) = placements.get(rank) else {
        return 1;
    };
    placements
        .iter()
        .filter(|p| p.host == me.host && p.pid == me.pid && p.device == me.device)
        .count()
        .max(1)
}

/// How many ranks of `placements` (index = rank) run in the process of `rank`, itself included.
pub fn ranks_in_process(placements: &[Placement], rank: usize) -> usize {
    let Some(me) = placements.get(rank) else {
        return 1;
    };
    placements
        .iter()
        .filter(|p| p.host == me.host && p.pid == me.pid)
        .count()
        .max(1)
}

/// The SMs one of `sharers` ranks sharing a device of `multiprocessors` SMs may size its grids for:
/// an equal share, at least one.
pub fn sm_share(multiprocessors: u32, sharers: usize) -> u32 {
    let sharers = u32::try_from(sharers.max(1)).unwrap_or(u32::MAX);
    (multiprocessors / sharers).max(1)
}

/// The SMs left of a `share` when `reserved` of them are kept for other kernels
/// (`Communicator::reserve_multiprocessors`): at least one, so a share of one SM keeps it.
pub fn usable_sms(share: u32, reserved: u32) -> u32 {
    share.saturating_sub(reserved).max(1)
}

/// One rank's groups in a hierarchical algorithm ([`Topology::hierarchy`]), as parent ranks in
/// the order of the group's ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    /// The ranks of this rank's host (its position here is its local rank).
    pub host: Vec<usize>,
    /// The ranks with this rank's local rank, one per host in host order (its position here is
    /// its host index).
    pub cross: Vec<usize>,
}

/// The hosts of a job and where each rank sits. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Host index of each rank.
    host_of: Vec<usize>,
    /// Ranks of each host, in rank order.
    ranks_of: Vec<Vec<usize>>,
    /// Identity of each host.
    host_ids: Vec<String>,
}

impl Topology {
    /// The topology of ranks whose host identities are `ids` (index = rank). An empty list, or an
    /// empty identity, is an error naming it.
    pub fn from_host_ids<S: AsRef<str>>(ids: &[S]) -> Result<Topology> {
        if ids.is_empty() {
            return Err(Error::InvalidArgument(
                "a topology needs at least one rank".into(),
            ));
        }
        let mut topo = Topology {
            host_of: Vec::with_capacity(ids.len()),
            ranks_of: Vec::new(),
            host_ids: Vec::new(),
        };
        for (rank, id) in ids.iter().map(AsRef::as_ref).enumerate() {
            if id.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "rank {rank} reported an empty host identity"
                )));
            }
            let host = match topo.host_ids.iter().position(|h| h == id) {
                Some(h) => h,
                None => {
                    topo.host_ids.push(id.to_string());
                    topo.ranks_of.push(Vec::new());
                    topo.host_ids.len() - 1
                }
            };
            topo.host_of.push(host);
            topo.ranks_of[host].push(rank);
        }
        Ok(topo)
    }

    pub fn world_size(&self) -> usize {
        self.host_of.len()
    }

    pub fn nhosts(&self) -> usize {
        self.ranks_of.len()
    }

    /// Index of `rank`'s host (hosts numbered by their lowest rank).
    pub fn host_index(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// The identity of host `host`.
    pub fn host_id(&self, host: usize) -> &str {
        &self.host_ids[host]
    }

    /// `rank`'s position among the ranks of its host.
    pub fn local_rank(&self, rank: usize) -> usize {
        let host = &self.ranks_of[self.host_of[rank]];
        host.iter().position(|&r| r == rank).unwrap_or(0)
    }

    /// Ranks on `rank`'s host, itself included.
    pub fn local_size(&self, rank: usize) -> usize {
        self.ranks_of[self.host_of[rank]].len()
    }

    /// Ranks of host `host`, in rank order.
    pub fn ranks_on_host(&self, host: usize) -> &[usize] {
        &self.ranks_of[host]
    }

    pub fn same_host(&self, a: usize, b: usize) -> bool {
        self.host_of[a] == self.host_of[b]
    }

    pub fn is_single_host(&self) -> bool {
        self.nhosts() == 1
    }

    /// Ranks per host when every host has the same number, else `None` (uneven).
    pub fn ranks_per_host(&self) -> Option<usize> {
        let k = self.ranks_of[0].len();
        self.ranks_of.iter().all(|r| r.len() == k).then_some(k)
    }

    /// The groups of `rank` in a hierarchical algorithm: its host's ranks, and the ranks with its
    /// local rank on every host (one per host, in host order). `None` where the hierarchy does
    /// not apply: one host, one rank per host (the cross-host group is the whole job), or uneven
    /// ranks per host (flat algorithms serve those).
    pub fn hierarchy(&self, rank: usize) -> Option<Hierarchy> {
        let k = self.ranks_per_host()?;
        if self.nhosts() < 2 || k < 2 {
            return None;
        }
        let local = self.local_rank(rank);
        Some(Hierarchy {
            host: self.ranks_on_host(self.host_index(rank)).to_vec(),
            cross: self.ranks_of.iter().map(|r| r[local]).collect(),
        })
    }
}

impl fmt::Display for Topology {
    /// `1 host x 8 ranks`, `2 hosts x 4 ranks`, or `3 hosts, uneven: 2+1+2 ranks`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hosts = self.nhosts();
        let plural = if hosts == 1 { "host" } else { "hosts" };
        match self.ranks_per_host() {
            Some(k) => write!(
                f,
                "{hosts} {plural} x {k} rank{}",
                if k == 1 { "" } else { "s" }
            ),
            None => {
                let counts: Vec<String> =
                    self.ranks_of.iter().map(|r| r.len().to_string()).collect();
                write!(f, "{hosts} {plural}, uneven: {} ranks", counts.join("+"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn env(pairs: &[(&str, &str)]) -> Env {
        Env::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()))).unwrap()
    }

    #[rstest]
    #[case(&["a"; 8], 1, Some(8), "1 host x 8 ranks")]
    #[case(&["a"], 1, Some(1), "1 host x 1 rank")]
    #[case(&["a", "a", "b", "b"], 2, Some(2), "2 hosts x 2 ranks")]
    #[case(&["a", "b", "a", "b"], 2, Some(2), "2 hosts x 2 ranks")]
    #[case(&["a", "a", "a", "a", "b", "b", "b", "b"], 2, Some(4), "2 hosts x 4 ranks")]
    #[case(&["a", "b", "c"], 3, Some(1), "3 hosts x 1 rank")]
    #[case(&["a", "a", "b", "c", "c"], 3, None, "3 hosts, uneven: 2+1+2 ranks")]
    #[case(&["x", "y", "y"], 2, None, "2 hosts, uneven: 1+2 ranks")]
    fn hosts_and_ranks_per_host(
        #[case] ids: &[&str],
        #[case] hosts: usize,
        #[case] per_host: Option<usize>,
        #[case] shown: &str,
    ) {
        let t = Topology::from_host_ids(ids).unwrap();
        assert_eq!(t.world_size(), ids.len());
        assert_eq!(t.nhosts(), hosts);
        assert_eq!(t.ranks_per_host(), per_host);
        assert_eq!(t.is_single_host(), hosts == 1);
        assert_eq!(t.to_string(), shown);
    }

    /// Host indices follow the lowest rank of each host; local ranks follow rank order inside it,
    /// also when the launcher interleaves hosts.
    #[test]
    fn local_rank_and_host_index_mapping() {
        let t = Topology::from_host_ids(&["n1", "n0", "n1", "n0", "n2"]).unwrap();
        let got: Vec<(usize, usize, usize)> = (0..5)
            .map(|r| (t.host_index(r), t.local_rank(r), t.local_size(r)))
            .collect();
        assert_eq!(
            got,
            vec![(0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2), (2, 0, 1)]
        );
        assert_eq!(t.ranks_on_host(0), &[0, 2]);
        assert_eq!(t.ranks_on_host(1), &[1, 3]);
        assert_eq!(t.host_id(2), "n2");
        assert!(t.same_host(1, 3) && !t.same_host(0, 1));
    }

    /// Which ranks form which group: per host in rank order, across hosts by local rank, also
    /// when the launcher interleaves hosts; no hierarchy on one host, with one rank per host, or
    /// with uneven hosts.
    #[rstest]
    #[case(&["a", "a", "b", "b"], 0, Some((vec![0, 1], vec![0, 2])))]
    #[case(&["a", "a", "b", "b"], 3, Some((vec![2, 3], vec![1, 3])))]
    #[case(&["a", "b", "a", "b"], 2, Some((vec![0, 2], vec![2, 3])))]
    #[case(&["a", "b", "a", "b"], 1, Some((vec![1, 3], vec![0, 1])))]
    #[case(&["a", "a", "a", "a", "b", "b", "b", "b"], 6, Some((vec![4, 5, 6, 7], vec![2, 6])))]
    #[case(&["a", "a", "b", "b", "c", "c"], 5, Some((vec![4, 5], vec![1, 3, 5])))]
    #[case(&["b", "a", "b", "a"], 1, Some((vec![1, 3], vec![0, 1])))]
    #[case(&["a"; 4], 0, None)]
    #[case(&["a", "b", "c"], 1, None)]
    #[case(&["a", "a", "b"], 0, None)]
    #[case(&["a", "a", "b", "c", "c"], 4, None)]
    fn hierarchy_groups(
        #[case] ids: &[&str],
        #[case] rank: usize,
        #[case] want: Option<(Vec<usize>, Vec<usize>)>,
    ) {
        let t = Topology::from_host_ids(ids).unwrap();
        let got = t.hierarchy(rank).map(|h| (h.host, h.cross));
        assert_eq!(got, want, "{t} rank {rank}");
    }

    #[test]
    fn bad_input_is_named() {
        let empty: [&str; 0] = [];
        let e = Topology::from_host_ids(&empty).unwrap_err();
        assert!(e.to_string().contains("at least one rank"), "{e}");
        let e = Topology::from_host_ids(&["a", ""]).unwrap_err();
        assert!(e.to_string().contains("rank 1"), "{e}");
    }

    #[test]
    fn hostid_overrides_the_machine_identity() {
        assert_eq!(host_identity(&env(&[("MSCCLPP_HOSTID", "sim-1")])), "sim-1");
        let machine = host_identity(&env(&[]));
        assert!(machine.contains('/'), "{machine}");
        assert_eq!(machine, host_identity(&env(&[])), "stable");
    }

    fn placed(host: &str, pid: u32, device: usize) -> Placement {
        Placement {
            host: host.into(),
            pid,
            device,
            gpu: format!("boot-{}/bus-{device}", host.replace(' ', "_")),
            mps_client: pid % 2 == 0,
        }
    }

    /// ncclCommInitAll on devices [0, 0, 0, 0] puts 4 ranks in one process on one device: each
    /// gets a quarter of the SMs. Other processes (MPS), other devices and other hosts do not
    /// count.
    #[test]
    fn ranks_of_one_process_on_one_device_share_its_sms() {
        let one_process = vec![placed("h", 7, 0); 4];
        assert_eq!(ranks_sharing_device(&one_process, 2), 4);
        assert_eq!(sm_share(132, 4), 33);
        let mixed = vec![
            placed("h", 7, 0),
            placed("h", 7, 1),
            placed("h", 8, 0),
            placed("g", 7, 0),
            placed("h", 7, 0),
        ];
        assert_eq!(ranks_sharing_device(&mixed, 0), 2);
        assert_eq!(ranks_sharing_device(&mixed, 1), 1);
        assert_eq!(ranks_sharing_device(&mixed, 2), 1);
        assert_eq!(ranks_sharing_device(&mixed, 3), 1);
        assert_eq!(ranks_sharing_device(&mixed, 4), 2);
        // One process on two devices still shares an allocator (registration caches agree).
        assert_eq!(ranks_in_process(&mixed, 0), 3);
        assert_eq!(ranks_in_process(&mixed, 1), 3);
        assert_eq!(ranks_in_process(&mixed, 2), 1);
        assert_eq!(ranks_in_process(&mixed, 3), 1);
        assert_eq!(sm_share(132, 1), 132);
        assert_eq!(sm_share(3, 8), 1, "never zero");
        assert_eq!(sm_share(132, 0), 132);
        assert_eq!(usable_sms(132, 0), 132);
        assert_eq!(usable_sms(132, 1), 131);
        assert_eq!(usable_sms(1, 1), 1, "a share of one SM keeps it");
        assert_eq!(usable_sms(2, 5), 1);
    }

    /// MPS clients are separate processes, and simulated hosts (MSCCLPP_HOSTID) may share a GPU:
    /// the physical GPU alone decides, and every rank gets the job's largest count.
    #[test]
    fn mps_clients_count_per_physical_gpu_across_processes_and_simulated_hosts() {
        let on = |pid: u32, gpu: &str, mps_client: bool| Placement {
            host: format!("sim-{pid}"),
            pid,
            device: 0,
            gpu: gpu.into(),
            mps_client,
        };
        let job = vec![
            on(1, "b/0", true),
            on(2, "b/1", true),
            on(3, "b/0", true),
            on(4, "b/0", true),
            on(5, "b/1", false),
        ];
        assert_eq!(most_mps_clients_on_a_gpu(&job), Some(3));
        assert_eq!(most_mps_clients_on_a_gpu(&job[1..2]), Some(1));
        assert_eq!(most_mps_clients_on_a_gpu(&job[4..]), None);
        let gpu = gpu_identity("0000:19:00.0");
        assert!(
            gpu.ends_with("/0000:19:00.0") && !gpu.contains(' '),
            "{gpu}"
        );
    }

    #[test]
    fn placements_round_trip_and_bad_ones_are_named() {
        let p = placed("sim host/boot", 4242, 3);
        assert_eq!(Placement::decode(0, &p.encode()).unwrap(), p);
        let e = Placement::decode(5, "hostname-only").unwrap_err();
        assert!(e.to_string().contains("rank 5"), "{e}");
    }
}
