//! Opens one rank's connections to its peers, one transport per pair as a [`TransportPlan`] says:
//! CudaIpc on the host, Ethernet to other hosts. IB is opened by the `mscclpp-ib` crate, which the
//! core does not depend on; a plan that asks for IB here is refused with that reason.
//!
//! # Ethernet setup (collective: every rank calls [`connect_peers`] at the same point)
//! Every rank binds a listener on the address the bootstrap would use (`MSCCLPP_SOCKET_IFNAME`,
//! `MSCCLPP_SOCKET_FAMILY`) and the ranks exchange listener addresses and a job secret drawn by
//! rank 0 over the bootstrap. Each rank then connects to its lower-ranked Ethernet peers in rank
//! order and accepts its higher-ranked ones: rank 0 only accepts, and by induction every rank
//! reaches its accepting phase, so no two ranks wait for each other. The listener serves any
//! peer's handshake while waiting for a particular one.

use crate::bootstrap::iface::{choose_address, list_interfaces};
use crate::communicator::Communicator;
use crate::env::Env;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::transport::host_memory::MemoryResolver;
use crate::transport::select::TransportPlan;
use crate::transport::{
    CudaIpcTransport, EthernetConfig, EthernetListener, EthernetTransport, Transport, TransportKind,
};
use std::net::SocketAddr;
use std::sync::Arc;

/// Bytes of the job secret the Ethernet handshakes carry.
const SECRET_BYTES: usize = 32;

/// Collective: the connection towards each of `peers` (in that order), of the kind `plan` gives.
/// `resolver` serves the memory Ethernet peers write into and that writes read from (register
/// every buffer and semaphore word they may name before any traffic).
pub fn connect_peers(
    comm: &Communicator,
    plan: &TransportPlan,
    peers: &[usize],
    resolver: Arc<dyn MemoryResolver>,
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
    let ethernet: Vec<usize> = peers
        .iter()
        .copied()
        .filter(|&p| plan.kind(p) == Some(TransportKind::Ethernet))
        .collect();
    let mut eth = connect_ethernet(comm, &ethernet, resolver)?;
    let gpu: &Arc<dyn Gpu> = comm.gpu();
    let mut out: Vec<Arc<dyn Transport>> = Vec::with_capacity(peers.len());
    for &peer in peers {
        out.push(match kind(peer)? {
            TransportKind::CudaIpc => {
                Arc::new(CudaIpcTransport::new(gpu.clone(), comm.device(), peer)?)
            }
            TransportKind::Ethernet => {
                let i = eth
                    .iter()
                    .position(|(p, _)| *p == peer)
                    .ok_or_else(|| Error::Internal(format!("no Ethernet link to rank {peer}")))?;
                Arc::new(eth.swap_remove(i).1)
            }
            TransportKind::Ib(i) => {
                return Err(Error::Unsupported(format!(
                    "rank {} to rank {peer}: the plan chose IB{i}, but IB connections are opened \
                     by mscclpp-ib, not here; set MSCCLPP_DISABLE_IB_TESTS=1 to use Ethernet",
                    plan.rank
                )))
            }
        });
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
    use std::time::Duration;

    const T: Duration = Duration::from_secs(10);

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
            let links = connect_peers(&comm, &plan, &peers, resolver)?;
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
