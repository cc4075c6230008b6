//! [`VerbsConnector`]: the core's `IbConnector` over libibverbs, through which
//! `mscclpp_core::transport::connect::connect_peers` opens the IB connections a transport plan
//! chooses (see that module for the design and the agreement between the two ends).
//!
//! # Memory
//! `open` registers every buffer the caller names (scratch, staging buffer, semaphore slab: GPU
//! memory, reached by the HCA through GPUDirect RDMA, i.e. `ibv_reg_mr` on the device pointer
//! with nvidia-peermem loaded) once per HCA. Each connection then exchanges a [`MemoryTable`]
//! (address, size, rkey of every region) with its peer, and [`IbPeerTransport`] fills in the keys:
//! callers name memory by address as over Ethernet, where the peer's `MemoryResolver` finds it, so
//! the PortChannel proxy and its memory tables stay transport-neutral. The communicator's memory
//! descriptors are not the carrier: the semaphore slab's is exchanged when the communicator is
//! made, before any plan or HCA exists, and most registered memory never crosses hosts.
//!
//! # Failure at one end
//! A handshake step that fails at one end sends the peer a failure notice in place of its next
//! message, so the peer fails at once naming it instead of waiting out the bootstrap timeout.

use crate::conn_info::{with_key, MemoryTable};
use crate::device::{IbContext, IbMemory};
use crate::transport::{IbConfig, IbTransport};
use mscclpp_core::bootstrap::Bootstrap;
use mscclpp_core::env::Env;
use mscclpp_core::gpu::DevicePtr;
use mscclpp_core::transport::connect::{IbConnector, IbEndpoint};
use mscclpp_core::transport::select::IbAvailability;
use mscclpp_core::transport::{MemoryRegion, MemoryResolver, Transport, TransportKind};
use mscclpp_core::{Error, Result};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Bootstrap tag of the per-pair handshake (connection info, ready marker, memory table).
const TAG_IB_CONNECT: u64 = 0x6962_6300;
/// First bytes of a failure notice; the rest is the reason in UTF-8.
const FAILURE_NOTICE: &[u8; 8] = b"MSCLIBNO";
/// Messages each end sends in one handshake: after the last, no notice may be sent (the peer no
/// longer reads this tag).
const HANDSHAKE_MESSAGES: usize = 3;

/// The libibverbs `IbConnector` (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct VerbsConnector;

impl IbConnector for VerbsConnector {
    /// Most specific reason first: `MSCCLPP_DISABLE_IB_TESTS=1`, no HCA under sysfs, libibverbs
    /// missing, no device it lists (after `MSCCLPP_HCA_DEVICES`).
    fn availability(&self, env: &Env) -> IbAvailability {
        let sysfs = mscclpp_noib::list_hcas(Path::new(mscclpp_noib::SYSFS_INFINIBAND));
        if env.disable_ib_tests || sysfs.is_empty() {
            return IbAvailability::from_hcas(env, &sysfs);
        }
        match crate::Verbs::load(env).and_then(|v| v.device_names()) {
            Ok(found) => IbAvailability::from_hcas(env, &found),
            Err(e) => IbAvailability::Unusable(e.to_string()),
        }
    }

    fn open(
        &self,
        env: &Env,
        hca: u8,
        memory: &[(DevicePtr, usize)],
    ) -> Result<Box<dyn IbEndpoint>> {
        let ctx = crate::open_ib_index(env, hca)?;
        let regions = memory
            .iter()
            .map(|&(ptr, bytes)| {
                // SAFETY: `IbConnector::open`'s contract: the ranges outlive the endpoint and its
                // transports, which hold the registrations.
                unsafe { ctx.register(ptr as *mut u8, bytes) }
            })
            .collect::<Result<Vec<IbMemory>>>()?;
        Ok(Box::new(VerbsEndpoint {
            ctx,
            memory: Arc::new(regions),
            op_timeout: env.device_wait_timeout,
        }))
    }
}

/// One opened HCA and the memory registered with it.
struct VerbsEndpoint {
    ctx: IbContext,
    memory: Arc<Vec<IbMemory>>,
    /// How long a post waits for room in a full send queue.
    op_timeout: Duration,
}

impl IbEndpoint for VerbsEndpoint {
    fn describe(&self) -> String {
        format!(
            "IB{} = {} port {}",
            self.ctx.index(),
            self.ctx.device_name(),
            self.ctx.port().port
        )
    }

    fn connect(
        &self,
        bootstrap: &dyn Bootstrap,
        peer: usize,
        resolver: Arc<dyn MemoryResolver>,
    ) -> Result<Arc<dyn Transport>> {
        let me = bootstrap.rank();
        let mut handshake = Handshake::new(bootstrap, peer);
        let result = (|| -> Result<IbPeerTransport> {
            let mut config = IbConfig::new(me, peer);
            config.remote_job_rank = bootstrap.job_rank(peer);
            config.op_timeout = self.op_timeout;
            let link = IbTransport::connect(&self.ctx, config, |b| handshake.exchange(b))?;
            let local = MemoryTable {
                rank: me as u32,
                remote_rank: peer as u32,
                regions: self.memory.iter().map(IbMemory::remote).collect(),
            };
            let reply = handshake.exchange(&local.encode())?;
            let remote = MemoryTable::decode(&reply, peer, me)?.regions;
            Ok(IbPeerTransport {
                link,
                memory: self.memory.clone(),
                remote,
                resolver,
                signal_word: Mutex::new(None),
                rank: me,
            })
        })();
        match result {
            Ok(t) => Ok(Arc::new(t)),
            Err(e) => Err(handshake.fail(e)),
        }
    }
}

/// One end of a pair's handshake over the bootstrap (module docs, "Failure at one end").
struct Handshake<'a> {
    bootstrap: &'a dyn Bootstrap,
    peer: usize,
    /// Messages sent so far.
    sent: usize,
    /// Whether the peer's failure notice arrived (it reads this tag no more).
    notified: bool,
}

impl<'a> Handshake<'a> {
    fn new(bootstrap: &'a dyn Bootstrap, peer: usize) -> Self {
        Handshake {
            bootstrap,
            peer,
            sent: 0,
            notified: false,
        }
    }

    /// Sends `bytes` and returns the peer's message, or its failure as an error.
    fn exchange(&mut self, bytes: &[u8]) -> Result<Vec<u8>> {
        self.bootstrap.send(self.peer, TAG_IB_CONNECT, bytes)?;
        self.sent += 1;
        let reply = self.bootstrap.recv(self.peer, TAG_IB_CONNECT)?;
        match reply.strip_prefix(FAILURE_NOTICE) {
            Some(why) => {
                self.notified = true;
                Err(Error::Peer {
                    rank: self.bootstrap.job_rank(self.peer),
                    message: format!(
                        "failed to set up its end of the IB connection: {}",
                        String::from_utf8_lossy(why)
                    ),
                })
            }
            None => Ok(reply),
        }
    }

    /// `e`, after telling the peer in place of our next message while it still waits for one.
    fn fail(&self, e: Error) -> Error {
        if !self.notified && self.sent < HANDSHAKE_MESSAGES {
            let mut notice = FAILURE_NOTICE.to_vec();
            notice.extend_from_slice(e.to_string().as_bytes());
            // Best effort: the peer's bounded receive reports it otherwise.
            let _ = self.bootstrap.send(self.peer, TAG_IB_CONNECT, &notice);
        }
        e
    }
}

/// An [`IbTransport`] that names memory by address: keys come from this end's registrations
/// (lkey of a write's source) and the peer's [`MemoryTable`] (rkey of its destination).
pub struct IbPeerTransport {
    link: IbTransport,
    /// Holds the registrations (deregistered when the endpoint and its last transport are gone).
    memory: Arc<Vec<IbMemory>>,
    remote: Vec<MemoryRegion>,
    /// Stores signals that arrive as write-with-immediate.
    resolver: Arc<dyn MemoryResolver>,
    /// The word those signals go to, once set (see `deliver_signals_to`).
    signal_word: Mutex<Option<MemoryRegion>>,
    rank: usize,
}

impl IbPeerTransport {
    /// `region` with the key covering `[offset, +bytes)`, or an error naming what is missing.
    fn keyed(
        &self,
        region: &MemoryRegion,
        offset: u64,
        bytes: u64,
        remote: bool,
    ) -> Result<MemoryRegion> {
        let found = if remote {
            with_key(self.remote.iter().copied(), region, offset, bytes)
        } else {
            with_key(
                self.memory.iter().map(IbMemory::local),
                region,
                offset,
                bytes,
            )
        };
        found.ok_or_else(|| {
            let (owner, table): (usize, Vec<MemoryRegion>) = if remote {
                (self.link.remote_rank(), self.remote.clone())
            } else {
                (self.rank, self.memory.iter().map(IbMemory::local).collect())
            };
            let listed: Vec<String> = table
                .iter()
                .map(|r| format!("{:#x}+{}", r.addr, r.size))
                .collect();
            Error::InvalidArgument(format!(
                "rank {} -> rank {} over IB: [{:#x}, +{bytes}) is in no memory rank {owner} \
                 registered with its HCA ({}); name it in the memory handed to connect_peers",
                self.rank,
                self.link.remote_rank(),
                region.addr.wrapping_add(offset),
                if listed.is_empty() {
                    "none".to_string()
                } else {
                    listed.join(", ")
                }
            ))
        })
    }
}

impl Transport for IbPeerTransport {
    fn kind(&self) -> TransportKind {
        self.link.kind()
    }

    fn remote_rank(&self) -> usize {
        self.link.remote_rank()
    }

    fn write(
        &self,
        dst: &MemoryRegion,
        dst_offset: u64,
        src: &MemoryRegion,
        src_offset: u64,
        bytes: u64,
    ) -> Result<()> {
        let dst = self.keyed(dst, dst_offset, bytes, true)?;
        let src = self.keyed(src, src_offset, bytes, false)?;
        self.link.write(&dst, dst_offset, &src, src_offset, bytes)
    }

    fn update_and_sync(&self, dst: &MemoryRegion, dst_offset: u64, new_value: u64) -> Result<()> {
        let dst = self.keyed(dst, dst_offset, 8, true)?;
        self.link.update_and_sync(&dst, dst_offset, new_value)
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        self.link.flush(timeout)
    }

    /// In write-with-immediate mode the one word this connection's signals are stored into.
    fn deliver_signals_to(&self, word: MemoryRegion) -> Result<()> {
        if !self.link.is_no_atomic() {
            return Ok(());
        }
        let mut current = self
            .signal_word
            .lock()
            .map_err(|_| Error::Internal("IB signal word lock poisoned by a panic".into()))?;
        match *current {
            Some(w) if w == word => Ok(()),
            Some(w) => Err(Error::Unsupported(format!(
                "rank {} <- rank {} over IB: signals travel as write-with-immediate \
                 (MSCCLPP_IBV_MODE=host-no-atomic, or an HCA without RDMA atomics), which carries \
                 no address, so a connection serves one semaphore; it serves {:#x} and a second \
                 asks for {:#x}. Use MSCCLPP_IBV_MODE=host on HCAs with atomics",
                self.rank,
                self.link.remote_rank(),
                w.addr,
                word.addr
            ))),
            None => {
                self.link
                    .set_signal_destination(self.resolver.clone(), word, 0)?;
                *current = Some(word);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Env {
        Env::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()))).unwrap()
    }

    /// Rank 1 fails after the first message (as a failed `ibv_modify_qp` would): rank 0, waiting
    /// for its second, fails at once naming rank 1 and the cause, instead of timing out.
    #[test]
    fn a_failed_end_tells_the_waiting_peer() {
        use mscclpp_core::bootstrap::{BootstrapConfig, TcpBootstrap};
        let cfg = BootstrapConfig::default().with_timeout(Duration::from_secs(20));
        let id = TcpBootstrap::create_unique_id(&cfg).unwrap();
        let start = std::time::Instant::now();
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (id, cfg) = (id.clone(), cfg.clone());
                std::thread::spawn(move || {
                    let boot = TcpBootstrap::new(rank, 2, &id, &cfg).unwrap();
                    let mut hs = Handshake::new(&boot, 1 - rank);
                    assert_eq!(hs.exchange(&[rank as u8]).unwrap(), [1 - rank as u8]);
                    let e = if rank == 0 {
                        hs.exchange(b"ready").unwrap_err()
                    } else {
                        hs.fail(Error::Driver {
                            call: "ibv_modify_qp",
                            code: 110,
                            message: "moving the QP to RTR on device mlx5_0 port 1".into(),
                        })
                    };
                    boot.barrier().unwrap();
                    e
                })
            })
            .collect();
        let errors: Vec<Error> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
        match &errors[0] {
            Error::Peer { rank: 1, message } => {
                assert!(message.contains("failed to set up its end"), "{message}");
                assert!(message.contains("ibv_modify_qp"), "{message}");
                assert!(message.contains("mlx5_0 port 1"), "{message}");
            }
            other => panic!("rank 0: {other:?}"),
        }
        assert!(matches!(
            errors[1],
            Error::Driver {
                call: "ibv_modify_qp",
                ..
            }
        ));
    }

    /// The child process that plays rank 1 in [`a_killed_or_stopped_peer_fails_the_waiting_end`]:
    /// it joins the bootstrap whose id the parent passes, does the handshake's first exchange,
    /// then waits to be killed or stopped.
    const PEER_ID_VAR: &str = "MSCCLPP_IB_TEST_PEER_ID";

    fn liveness_config() -> mscclpp_core::bootstrap::BootstrapConfig {
        mscclpp_core::bootstrap::BootstrapConfig::default()
            .with_timeout(Duration::from_secs(20))
            .with_liveness_timeout(Duration::from_secs(2))
    }

    /// A communicator's bootstrap watches its peers (`Communicator::new` does this); the test
    /// needs only the watch, not a listener.
    struct NoListener;

    impl mscclpp_core::bootstrap::FailureListener for NoListener {
        fn job_failed(&self, _rank: usize, _reason: &str) {}
    }

    /// Watches the peers as a communicator does, then lets a few heartbeats pass: connections
    /// open well after the communicator (until a peer's first beat is heard the bootstrap allows
    /// it its full timeout, see `TcpBootstrap`'s liveness docs).
    fn watched(boot: &mscclpp_core::bootstrap::TcpBootstrap, listener: &Arc<NoListener>) {
        let weak: std::sync::Weak<NoListener> = Arc::downgrade(listener);
        boot.watch_failures(weak);
        boot.barrier().unwrap();
        std::thread::sleep(Duration::from_millis(600));
    }

    /// A real peer process dies (SIGKILL) or stalls (SIGSTOP) in the middle of the handshake, after
    /// its first message: the waiting end fails naming rank 1 (its bootstrap connection closed,
    /// or no heartbeat within the 2 s liveness timeout), within seconds, instead of hanging.
    #[test]
    fn a_killed_or_stopped_peer_fails_the_waiting_end() {
        use mscclpp_core::bootstrap::{TcpBootstrap, UniqueId};
        use std::process::{Command, Stdio};
        if let Ok(hex) = std::env::var(PEER_ID_VAR) {
            let id = UniqueId::from_hex(&hex).unwrap();
            let boot = TcpBootstrap::new(1, 2, &id, &liveness_config()).unwrap();
            let listener = Arc::new(NoListener);
            watched(&boot, &listener);
            Handshake::new(&boot, 0).exchange(b"one").unwrap();
            std::thread::sleep(Duration::from_secs(120));
            panic!("the parent never signalled this peer");
        }
        for signal in [libc::SIGKILL, libc::SIGSTOP] {
            let cfg = liveness_config();
            let id = TcpBootstrap::create_unique_id(&cfg).unwrap();
            let mut child = Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "connector::tests::a_killed_or_stopped_peer_fails_the_waiting_end",
                ])
                .env(PEER_ID_VAR, id.to_hex())
                .stdout(Stdio::null())
                .spawn()
                .unwrap();
            let boot = TcpBootstrap::new(0, 2, &id, &cfg).unwrap();
            let listener = Arc::new(NoListener);
            watched(&boot, &listener);
            let mut hs = Handshake::new(&boot, 1);
            assert_eq!(hs.exchange(b"one").unwrap(), b"one");
            // SAFETY: signals the child this test spawned and still owns.
            assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
            let signalled = std::time::Instant::now();
            let err = hs.exchange(b"two").unwrap_err().to_string();
            let took = signalled.elapsed();
            let _ = child.kill();
            let _ = child.wait();
            eprintln!("signal {signal}: the waiting end failed after {took:?}: {err}");
            assert!(
                took < Duration::from_secs(10),
                "signal {signal}: {took:?}: {err}"
            );
            assert!(err.contains("rank 1"), "signal {signal}: {err}");
        }
    }

    /// The explicit switch is the reason, whatever the host has.
    #[test]
    fn disabled_by_env_is_unusable() {
        let a = VerbsConnector.availability(&env(&[("MSCCLPP_DISABLE_IB_TESTS", "1")]));
        assert_eq!(
            a,
            IbAvailability::Unusable("disabled by MSCCLPP_DISABLE_IB_TESTS=1".into())
        );
    }

    /// Without a usable HCA (this machine), IB is unusable with a reason (no HCA, or libibverbs
    /// missing where sysfs lists one): connect_peers then plans Ethernet.
    #[test]
    fn this_host_explains_why_not() {
        let e = env(&[("MSCCLPP_IBV_SO", "/nonexistent/libibverbs.so.1")]);
        match VerbsConnector.availability(&e) {
            IbAvailability::Usable { hcas } => panic!("{hcas} HCAs with no libibverbs?"),
            IbAvailability::Unusable(why) => {
                eprintln!("IB unusable here: {why}");
                let sysfs = mscclpp_noib::list_hcas(Path::new(mscclpp_noib::SYSFS_INFINIBAND));
                let want = if sysfs.is_empty() {
                    "no InfiniBand HCA"
                } else {
                    "/nonexistent/libibverbs.so.1"
                };
                assert!(why.contains(want), "{why:?} lacks {want:?}");
            }
        }
    }

    /// Opening (what connect_peers does once the plan chose IB) without libibverbs: an
    /// `IbUnavailable` naming the file tried, which connect_peers wraps with the rank pair and
    /// MSCCLPP_DISABLE_IB_TESTS=1.
    #[test]
    fn open_without_libibverbs_names_the_library() {
        let e = env(&[("MSCCLPP_IBV_SO", "/nonexistent/libibverbs.so.1")]);
        let err = match VerbsConnector.open(&e, 0, &[]) {
            Ok(_) => panic!("opened IB through a missing library"),
            Err(err) => err,
        };
        assert!(matches!(err, Error::IbUnavailable(_)), "{err:?}");
        assert!(
            err.to_string().contains("/nonexistent/libibverbs.so.1"),
            "{err}"
        );
    }
}
