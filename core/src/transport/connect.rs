//! Opens one rank's connections to its peers, one transport per pair as a [`TransportPlan`] says:
//! CudaIpc on the host; to other hosts IB where both ends can use it, Ethernet otherwise.
//!
//! # IB: a connector handed in
//! The IB transport lives in `mscclpp-ib`, which depends on this crate, so the core cannot call it.
//! It implements [`IbConnector`], and whoever assembles connections hands it in ([`IbSetup`]):
//! `mscclpp_collectives::port_allreduce::proxy_connections`, through which every PortChannel
//! algorithm (the flat and hierarchical all-reduces, execution plans) connects, always passes
//! `mscclpp_ib::VerbsConnector`, so the benchmark, the NCCL shim and the Python package get IB
//! without a step of their own. An argument rather than a process-wide registry: no
//! initialisation order to get wrong, and tests pass fakes.
//!
//! # Agreement (collective: every rank calls [`agree_plan`] and [`connect_peers`] at the same
//! point)
//! [`agree_plan`] gathers every rank's IB usability, so both ends of a pair choose IB or both
//! choose Ethernet. In [`connect_peers`] every rank with IB peers opens its HCA and registers the
//! memory peers write into, and the ranks gather the outcome: a rank that failed makes every IB
//! peer fail at once with its reason, instead of leaving them waiting for a handshake. Errors name
//! the rank pair, the HCA and the verb, and say how to choose Ethernet
//! (`MSCCLPP_DISABLE_IB_TESTS=1`). The per-pair handshakes run in ascending peer order; bootstrap
//! sends do not wait for the receiver, so the lowest unfinished pair can always progress, and
//! every receive is bounded by the bootstrap timeout.
//!
//! # Ethernet setup
//! Every rank binds a listener on the address the bootstrap would use (`MSCCLPP_SOCKET_IFNAME`,
//! `MSCCLPP_SOCKET_FAMILY`) and the ranks exchange listener addresses and a job secret drawn by
//! rank 0 over the bootstrap. Each rank then connects to its lower-ranked Ethernet peers in rank
//! order and accepts its higher-ranked ones: rank 0 only accepts, and by induction every rank
//! reaches its accepting phase, so no two ranks wait for each other. The listener serves any
//! peer's handshake while waiting for a particular one.

use crate::bootstrap::iface::{choose_address, list_interfaces};
use crate::bootstrap::Bootstrap;
use crate::communicator::Communicator;
use crate::env::Env;
use crate::error::{Error, Result};
use crate::gpu::{DevicePtr, Gpu};
use crate::transport::host_memory::MemoryResolver;
use crate::transport::select::{IbAvailability, TransportPlan};
use crate::transport::{
    CudaIpcTransport, EthernetConfig, EthernetListener, EthernetTransport, Transport, TransportKind,
};
use std::net::SocketAddr;
use std::sync::Arc;

/// Bytes of the job secret the Ethernet handshakes carry.
const SECRET_BYTES: usize = 32;

/// What every IB error of [`connect_peers`] ends with.
pub const IB_ADVICE: &str = "set MSCCLPP_DISABLE_IB_TESTS=1 on every rank to use Ethernet instead";

/// Opens IB connections for [`connect_peers`] (see the module docs); `mscclpp-ib` implements it.
pub trait IbConnector: Send + Sync {
    /// Whether this process can use IB: HCAs after `MSCCLPP_HCA_DEVICES`, unless
    /// `MSCCLPP_DISABLE_IB_TESTS=1` or libibverbs is missing (the reason says which).
    fn availability(&self, env: &Env) -> IbAvailability;

    /// Opens HCA entry `hca` and registers `memory` with it for remote writes and atomics. The
    /// ranges are GPU memory (GPUDirect RDMA) or host memory, and must stay allocated until the
    /// endpoint and every transport it made are dropped.
    fn open(
        &self,
        env: &Env,
        hca: u8,
        memory: &[(DevicePtr, usize)],
    ) -> Result<Box<dyn IbEndpoint>>;
}

/// One opened HCA with its registered memory (see [`IbConnector::open`]).
pub trait IbEndpoint {
    /// The HCA in words (`IB0 = mlx5_0 port 1`), for errors.
    fn describe(&self) -> String;

    /// Collective with `peer`, which calls this towards us: one connection, and the keys of
    /// each side's registered memory, so `write`/`update_and_sync` name peer memory by address
    /// (as over Ethernet). `resolver` stores signals that arrive without an address.
    fn connect(
        &self,
        bootstrap: &dyn Bootstrap,
        peer: usize,
        resolver: Arc<dyn MemoryResolver>,
    ) -> Result<Arc<dyn Transport>>;
}

/// The IB half of [`connect_peers`]'s arguments.
#[derive(Clone, Copy)]
pub struct IbSetup<'a> {
    pub connector: &'a dyn IbConnector,
    /// Every buffer and semaphore word peers write into or writes read from (what `resolver`
    /// serves to Ethernet peers).
    pub memory: &'a [(DevicePtr, usize)],
}

/// Collective: `plan` with every pair's transport agreed by both ends (see
/// [`TransportPlan::agree`]).
pub fn agree_plan(bootstrap: &dyn Bootstrap, plan: TransportPlan) -> Result<TransportPlan> {
    let usable = matches!(plan.ib, IbAvailability::Usable { .. });
    let all = bootstrap.all_gather(&[u8::from(usable)])?;
    let usable: Vec<bool> = all.iter().map(|b| b.first() == Some(&1)).collect();
    Ok(plan.agree(&usable))
}

/// Collective: the connection towards each of `peers` (in that order), of the kind `plan` gives
/// (agreed with [`agree_plan`]). `resolver` serves the memory Ethernet peers write into and that
/// writes read from (register every buffer and semaphore word they may name before any traffic;
/// it is prepared here, [`MemoryResolver::prepare`]);
/// `ib` opens the IB connections, registering `ib.memory` with the HCA.
pub fn connect_peers(
    comm: &Communicator,
    plan: &TransportPlan,
    peers: &[usize],
    resolver: Arc<dyn MemoryResolver>,
    ib: Option<IbSetup<'_>>,
) -> Result<Vec<Arc<dyn Transport>>> {
    let kind = |peer: usize| {
        plan.kind(peer).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "rank {peer} is not a peer of rank {} in a job of {}",
                plan.rank,
                comm.size()
            ))
        })
    };
    let of_kind = |want: fn(TransportKind) -> bool| -> Vec<usize> {
        peers
            .iter()
            .copied()
            .filter(|&p| plan.kind(p).is_some_and(want))
            .collect()
    };
    let ethernet = of_kind(|k| k == TransportKind::Ethernet);
    let ib_peers = of_kind(|k| matches!(k, TransportKind::Ib(_)));
    if !ethernet.is_empty() || !ib_peers.is_empty() {
        resolver.prepare()?;
    }
    let mut ib_links = connect_ib(comm, plan, &ib_peers, resolver.clone(), ib)?;
    let mut eth: Vec<(usize, Arc<dyn Transport>)> = connect_ethernet(comm, &ethernet, resolver)?
        .into_iter()
        .map(|(p, t)| (p, Arc::new(t) as Arc<dyn Transport>))
        .collect();
    let gpu: &Arc<dyn Gpu> = comm.gpu();
    let mut out: Vec<Arc<dyn Transport>> = Vec::with_capacity(peers.len());
    for &peer in peers {
        out.push(match kind(peer)? {
            TransportKind::CudaIpc => {
                Arc::new(CudaIpcTransport::new(gpu.clone(), comm.device(), peer)?)
            }
            TransportKind::Ethernet => take_link(&mut eth, peer, "Ethernet")?,
            TransportKind::Ib(_) => take_link(&mut ib_links, peer, "IB")?,
        });
    }
    Ok(out)
}

/// The link towards `peer` out of `links`.
fn take_link(
    links: &mut Vec<(usize, Arc<dyn Transport>)>,
    peer: usize,
    what: &str,
) -> Result<Arc<dyn Transport>> {
    let i = links
        .iter()
        .position(|(p, _)| *p == peer)
        .ok_or_else(|| Error::Internal(format!("no {what} link to rank {peer}")))?;
    Ok(links.swap_remove(i).1)
}

/// `e` with the IB context (`rank 0 <-> rank 4 over IB0 = mlx5_0 port 1`) and [`IB_ADVICE`],
/// keeping a driver error's verb and code.
fn ib_error(e: Error, context: &str) -> Error {
    match e {
        Error::Driver {
            call,
            code,
            message,
        } => Error::Driver {
            call,
            code,
            message: format!("{context}: {message}; {IB_ADVICE}"),
        },
        Error::Timeout { what, timeout } => Error::Timeout {
            what: format!("{what} ({context}; {IB_ADVICE})"),
            timeout,
        },
        Error::Peer { rank, message } => Error::Peer {
            rank,
            message: format!("{message} ({context}; {IB_ADVICE})"),
        },
        other => Error::Unsupported(format!("{context}: {other}; {IB_ADVICE}")),
    }
}

/// Collective (see the module docs): IB transports to `peers`, by peer. Every rank takes part in
/// the outcome exchange, also with no IB peer.
fn connect_ib(
    comm: &Communicator,
    plan: &TransportPlan,
    peers: &[usize],
    resolver: Arc<dyn MemoryResolver>,
    ib: Option<IbSetup<'_>>,
) -> Result<Vec<(usize, Arc<dyn Transport>)>> {
    let me = comm.rank();
    let pair = |peer: usize| format!("rank {me} <-> rank {peer}");
    let list = |ps: &[usize]| {
        let v: Vec<String> = ps.iter().map(|p| p.to_string()).collect();
        v.join(",")
    };
    let hca = peers.iter().find_map(|&p| match plan.kind(p) {
        Some(TransportKind::Ib(i)) => Some(i),
        _ => None,
    });
    let opened: Option<Result<Box<dyn IbEndpoint>>> = hca.map(|i| {
        let setup = ib.ok_or_else(|| {
            Error::Internal(format!(
                "rank {me}: the plan chose IB{i} towards rank(s) {}, but no IB connector was \
                 handed to connect_peers",
                list(peers)
            ))
        })?;
        setup
            .connector
            .open(Env::get()?, i, setup.memory)
            .map_err(|e| {
                ib_error(
                    e,
                    &format!("rank {me} opening IB{i} for rank(s) {}", list(peers)),
                )
            })
    });
    // An empty message: nothing to report (opened, or no IB peer); else why this rank failed.
    let outcome = match &opened {
        Some(Err(e)) => e.to_string(),
        _ => String::new(),
    };
    let outcomes = comm.bootstrap().all_gather(outcome.as_bytes())?;
    let endpoint = match opened {
        None => return Ok(Vec::new()),
        Some(r) => r?,
    };
    if let Some(&peer) = peers.iter().find(|&&p| !outcomes[p].is_empty()) {
        return Err(Error::Peer {
            rank: peer,
            message: format!(
                "{}: the peer could not set up IB: {}",
                pair(peer),
                String::from_utf8_lossy(&outcomes[peer])
            ),
        });
    }
    let mut sorted = peers.to_vec();
    sorted.sort_unstable();
    let bootstrap = comm.bootstrap();
    let mut out = Vec::with_capacity(sorted.len());
    for peer in sorted {
        let link = endpoint
            .connect(bootstrap.as_ref(), peer, resolver.clone())
            .map_err(|e| ib_error(e, &format!("{} over {}", pair(peer), endpoint.describe())))?;
        out.push((peer, link));
    }
    Ok(out)
}

/// Collective (see the module docs): Ethernet transports to `peers`, by peer. Every rank takes part
/// in the address exchange, also with no Ethernet peer.
fn connect_ethernet(
    comm: &Communicator,
    peers: &[usize],
    resolver: Arc<dyn MemoryResolver>,
) -> Result<Vec<(usize, EthernetTransport)>> {
    let bootstrap = comm.bootstrap();
    let me = comm.rank();
    let env = Env::get()?;
    let secret = bootstrap.broadcast(0, &rand::random::<[u8; SECRET_BYTES]>())?;
    let listener = if peers.is_empty() {
        None
    } else {
        let ip = choose_address(
            &list_interfaces()?,
            env.socket_ifname.as_deref(),
            env.socket_family,
        )?;
        Some(EthernetListener::bind(ip)?)
    };
    let mine = match &listener {
        Some(l) => l.local_addr()?.to_string(),
        None => String::new(),
    };
    let addrs = bootstrap.all_gather(mine.as_bytes())?;
    let config = |peer: usize| {
        let mut c = EthernetConfig::new(me, peer, secret.clone());
        c.remote_job_rank = bootstrap.job_rank(peer);
        c.connect_timeout = env.bootstrap_timeout;
        c.io_timeout = env.device_wait_timeout;
        c
    };
    let mut sorted = peers.to_vec();
    sorted.sort_unstable();
    let mut out = Vec::with_capacity(sorted.len());
    for &peer in sorted.iter().filter(|&&p| p < me) {
        let text = String::from_utf8_lossy(&addrs[peer]).into_owned();
        let addr: SocketAddr = text.parse().map_err(|e| Error::Peer {
            rank: peer,
            message: format!("sent an unusable Ethernet listener address {text:?}: {e}"),
        })?;
        out.push((
            peer,
            EthernetTransport::connect(addr, &config(peer), resolver.clone())?,
        ));
    }
    if let Some(l) = &listener {
        for &peer in sorted.iter().filter(|&&p| p > me) {
            out.push((peer, l.accept(&config(peer), resolver.clone())?));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::on_loopback_ranks;
    use crate::env::IbvMode;
    use crate::gpu::MemoryKind;
    use crate::port_channel::test_gpu::HostGpu;
    use crate::topology::Topology;
    use crate::transport::select::IbAvailability;
    use crate::transport::{DeviceMemoryResolver, MemoryRegion};
    use std::sync::Mutex;
    use std::time::Duration;

    const T: Duration = Duration::from_secs(10);

    /// A connector standing in for mscclpp-ib: `fail_on` makes `open` fail there as `ibv_reg_mr`
    /// would; every open records the memory it was asked to register.
    struct FakeConnector {
        fail_on: Option<usize>,
        rank: usize,
        registered: Mutex<Vec<(DevicePtr, usize)>>,
    }

    struct FakeEndpoint(usize);

    struct FakeIbLink {
        peer: usize,
    }

    impl IbConnector for FakeConnector {
        fn availability(&self, _env: &Env) -> IbAvailability {
            IbAvailability::Usable { hcas: 1 }
        }
        fn open(
            &self,
            _env: &Env,
            hca: u8,
            memory: &[(DevicePtr, usize)],
        ) -> Result<Box<dyn IbEndpoint>> {
            assert_eq!(hca, 0);
            if self.fail_on == Some(self.rank) {
                return Err(Error::Driver {
                    call: "ibv_reg_mr",
                    code: 14,
                    message: "registering 64 bytes on device mlx5_0 port 1: Bad address".into(),
                });
            }
            self.registered.lock().unwrap().extend_from_slice(memory);
            Ok(Box::new(FakeEndpoint(self.rank)))
        }
    }

    impl IbEndpoint for FakeEndpoint {
        fn describe(&self) -> String {
            "IB0 = mlx5_0 port 1".into()
        }
        /// A handshake over the bootstrap, as the real one: both ends must be in it together.
        fn connect(
            &self,
            bootstrap: &dyn Bootstrap,
            peer: usize,
            _resolver: Arc<dyn MemoryResolver>,
        ) -> Result<Arc<dyn Transport>> {
            bootstrap.send(peer, 99, &[self.0 as u8])?;
            let got = bootstrap.recv(peer, 99)?;
            assert_eq!(got, [peer as u8]);
            Ok(Arc::new(FakeIbLink { peer }))
        }
    }

    impl Transport for FakeIbLink {
        fn kind(&self) -> TransportKind {
            TransportKind::Ib(0)
        }
        fn remote_rank(&self) -> usize {
            self.peer
        }
        fn write(&self, _: &MemoryRegion, _: u64, _: &MemoryRegion, _: u64, _: u64) -> Result<()> {
            Ok(())
        }
        fn update_and_sync(&self, _: &MemoryRegion, _: u64, _: u64) -> Result<()> {
            Ok(())
        }
        fn flush(&self, _: Duration) -> Result<()> {
            Ok(())
        }
    }

    /// Four ranks on four hosts; rank 3 has no IB. After agreement, ranks 0-2 talk IB through
    /// the connector (which registered the memory it was given) and every rank reaches rank 3 over
    /// Ethernet, from both ends.
    #[test]
    fn ib_goes_through_the_connector_and_ethernet_where_one_end_lacks_ib() {
        let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::new());
        let results = on_loopback_ranks(4, T, move |rank, boot| -> Result<Vec<TransportKind>> {
            let comm = Communicator::new(boot.clone(), gpu.clone(), 0)?;
            let topo = Topology::from_host_ids(&["a", "b", "c", "d"])?;
            let connector = FakeConnector {
                fail_on: None,
                rank,
                registered: Mutex::new(Vec::new()),
            };
            let ib = if rank == 3 {
                IbAvailability::Unusable("no InfiniBand HCA (none found)".into())
            } else {
                connector.availability(Env::get()?)
            };
            let plan = agree_plan(
                boot.as_ref(),
                TransportPlan::new(&topo, rank, ib, IbvMode::Host),
            )?;
            let peers: Vec<usize> = (0..4).rev().filter(|&p| p != rank).collect();
            let buf = gpu.alloc(64, MemoryKind::Plain)?;
            let resolver = Arc::new(DeviceMemoryResolver::new(gpu.clone(), 0));
            resolver.register(buf.ptr, 64)?;
            let memory = [(buf.ptr, 64)];
            let setup = IbSetup {
                connector: &connector,
                memory: &memory,
            };
            let links = connect_peers(&comm, &plan, &peers, resolver, Some(setup))?;
            let want: Vec<(DevicePtr, usize)> = if rank == 3 { vec![] } else { memory.to_vec() };
            assert_eq!(*connector.registered.lock().unwrap(), want, "rank {rank}");
            for (link, &peer) in links.iter().zip(&peers) {
                assert_eq!(link.remote_rank(), peer);
            }
            let kinds = links.iter().map(|l| l.kind()).collect();
            drop(links);
            boot.barrier()?;
            gpu.free(&buf)?;
            Ok(kinds)
        });
        use TransportKind::{Ethernet as E, Ib};
        let want = [
            vec![E, Ib(0), Ib(0)],
            vec![E, Ib(0), Ib(0)],
            vec![E, Ib(0), Ib(0)],
            vec![E, E, E],
        ];
        for (rank, got) in results.into_iter().enumerate() {
            assert_eq!(got.expect("rank"), want[rank], "rank {rank}, peers 3..0");
        }
    }

    /// Rank 1 cannot register its memory with its HCA: it fails with the verb, the HCA and how to
    /// choose Ethernet, and rank 0 fails at once naming rank 1 and the same cause (no handshake
    /// left waiting).
    #[test]
    fn a_failed_ib_open_fails_both_ends_naming_the_pair_the_hca_and_the_verb() {
        let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::new());
        let results = on_loopback_ranks(2, T, move |rank, boot| -> Result<()> {
            let comm = Communicator::new(boot.clone(), gpu.clone(), 0)?;
            let topo = Topology::from_host_ids(&["a", "b"])?;
            let connector = FakeConnector {
                fail_on: Some(1),
                rank,
                registered: Mutex::new(Vec::new()),
            };
            let ib = IbAvailability::Usable { hcas: 1 };
            let plan = agree_plan(
                boot.as_ref(),
                TransportPlan::new(&topo, rank, ib, IbvMode::Host),
            )?;
            let resolver = Arc::new(DeviceMemoryResolver::new(gpu.clone(), 0));
            let setup = IbSetup {
                connector: &connector,
                memory: &[],
            };
            connect_peers(&comm, &plan, &[1 - rank], resolver, Some(setup)).map(|_| ())
        });
        let mut results = results.into_iter();
        let e0 = results.next().unwrap().unwrap_err();
        let e1 = results.next().unwrap().unwrap_err();
        match &e1 {
            Error::Driver { call, message, .. } => {
                assert_eq!(*call, "ibv_reg_mr");
                assert!(
                    message.contains("rank 1 opening IB0 for rank(s) 0"),
                    "{message}"
                );
            }
            other => panic!("rank 1: {other:?}"),
        }
        assert!(matches!(e0, Error::Peer { rank: 1, .. }), "{e0:?}");
        for (rank, e) in [(0, e0), (1, e1)] {
            let text = e.to_string();
            for part in ["rank 1", "ibv_reg_mr", "mlx5_0 port 1", IB_ADVICE] {
                assert!(text.contains(part), "rank {rank}: {text:?} lacks {part:?}");
            }
        }
        assert!(
            IB_ADVICE.contains("MSCCLPP_DISABLE_IB_TESTS=1"),
            "{IB_ADVICE}"
        );
    }

    /// `n` ranks posing as `n` hosts get Ethernet links to each other (the connect/accept order
    /// must not deadlock); each writes 8 bytes into its slot of every peer's "device" buffer and
    /// signals a word there through the peer's resolver; every rank sees all of them.
    #[rstest::rstest]
    #[case(2)]
    #[case(4)]
    fn ranks_on_separate_hosts_talk_over_ethernet_into_device_memory(#[case] n: usize) {
        let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::new());
        let bytes = 8 * n + 8;
        let results = on_loopback_ranks(n, T, move |rank, boot| -> Result<Vec<u8>> {
            let comm = Communicator::new(boot.clone(), gpu.clone(), 0)?;
            let ids: Vec<String> = (0..n).map(|r| format!("host-{r}")).collect();
            let topo = Topology::from_host_ids(&ids)?;
            let ib = IbAvailability::Unusable("test".into());
            let plan = TransportPlan::new(&topo, rank, ib, IbvMode::Host);
            let peers: Vec<usize> = (0..n).filter(|&p| p != rank).collect();
            let buf = gpu.alloc(bytes, MemoryKind::Plain)?;
            gpu.copy_to_device(buf.ptr, &vec![0xee; bytes])?;
            gpu.copy_to_device(buf.ptr + 8 * rank as u64, &[rank as u8; 8])?;
            let resolver = Arc::new(DeviceMemoryResolver::new(gpu.clone(), 0));
            resolver.register(buf.ptr, bytes)?;
            let links = connect_peers(&comm, &plan, &peers, resolver, None)?;
            let addrs = boot.all_gather(&buf.ptr.to_le_bytes())?;
            let src = MemoryRegion {
                addr: buf.ptr,
                size: bytes as u64,
                key: 0,
            };
            for (&peer, link) in peers.iter().zip(&links) {
                assert_eq!(link.kind(), TransportKind::Ethernet);
                assert_eq!(link.remote_rank(), peer);
                let addr = u64::from_le_bytes(addrs[peer][..8].try_into().unwrap());
                let dst = MemoryRegion {
                    addr,
                    size: bytes as u64,
                    key: 0,
                };
                let at = 8 * rank as u64;
                link.write(&dst, at, &src, at, 8)?;
                link.update_and_sync(&dst, 8 * n as u64, 7)?;
                link.flush(T)?;
            }
            boot.barrier()?;
            let mut out = vec![0u8; bytes];
            gpu.copy_from_device(&mut out, buf.ptr)?;
            drop(links);
            boot.barrier()?;
            gpu.free(&buf)?;
            Ok(out)
        });
        for (rank, result) in results.into_iter().enumerate() {
            let got = result.expect("rank");
            for r in 0..n {
                assert_eq!(
                    &got[8 * r..8 * r + 8],
                    &[r as u8; 8],
                    "rank {rank}, slot {r}"
                );
            }
            let signal = u64::from_le_bytes(got[8 * n..].try_into().unwrap());
            assert_eq!(signal, 7, "rank {rank}'s signal word");
        }
    }
}
