//! `TcpBootstrap`: the [`Bootstrap`] over TCP sockets.
//!
//! # Protocol
//! 1. Rank 0 runs the root (`RootServer`) at the UniqueId's address.
//! 2. Every rank (rank 0 included) connects to the root; the local address of that connection is
//!    the address this host reaches the root by, so the rank binds its own listener on that IP
//!    (or on `MSCCLPP_SOCKET_IFNAME`'s address) with an ephemeral port and sends it to the root
//!    with the job secret. The root answers every rank with the whole table once all have joined.
//! 3. Ranks then connect to each other lazily, one connection per direction: a rank's sending
//!    connection to a peer is opened on its first send and carries only its messages to that
//!    peer, so no two ranks ever race to open the same link. Each connection starts with a
//!    two-way handshake carrying the secret; connections without it are refused with a warning.
//! 4. A reader thread per incoming connection drains frames into per-(peer, kind, tag) queues
//!    (`Mailbox`). Sockets are therefore always read, and a receiver learns at once when its
//!    peer's connection closes.
//!
//! Collectives (Bruck all_gather, dissemination barrier, binomial broadcast) run on the same
//! links under a per-call sequence number; each message also says which collective it belongs
//! to, so ranks that called collectives in different orders fail at once with both named
//! (collectives.rs). When a collective fails on some rank (peer died, timeout, ranks out of
//! step), that rank floods an abort over its open links, so every rank fails promptly with the
//! rank to blame instead of waiting out its own timeout. After that the bootstrap is poisoned:
//! the job cannot complete collectives any more.
//!
//! Dropping a `TcpBootstrap` says goodbye on every link, so peers can tell a clean shutdown from a
//! crash. Drop it before the process exits.
//!
//! # Liveness
//! A connection that closes without a goodbye means the peer's process died (the kernel closes a
//! dead process's sockets at once, SIGKILL included): the reader aborts the job, blaming that
//! peer, floods the abort and tells the [`FailureListener`]s (communicators abort themselves). For
//! every death to be seen, [`watch_failures`](Bootstrap::watch_failures) opens each rank's link
//! to its ring successor, so every rank has a reader on its predecessor; the flood then goes round
//! the ring, one local TCP hop per rank.
//!
//! A stopped or hung process keeps its sockets open, so the same call also starts a heartbeat
//! thread: every `heartbeat_period` it sends a `Heartbeat` frame to the ring successor and
//! checks when the last frame (of any kind) came from the ring predecessor. A predecessor silent
//! for `BootstrapConfig::liveness_timeout` is stalled: the job is aborted blaming it ("rank P
//! stalled: no heartbeat for 3.0 s"), which floods on round the ring. The thread is the only one
//! that has to run for a rank to count as alive, so a rank busy on the host (a long NVRTC compile,
//! a blocked launch, the Python interpreter) is not blamed; a SIGSTOPped process stops all its
//! threads, the heartbeat included, and is. A rank that was itself stopped (or starved of CPU)
//! sees every peer silent when it resumes: its thread notices its own gap and gives its
//! predecessor a fresh timeout instead of blaming it. `unresponsive_peers`
//! (Bootstrap::unresponsive_peers) (pings answered by reader threads) names the stopped rank when a
//! device wait timed out first.

use super::collectives::{self, Exchange, Op};
use super::config::BootstrapConfig;
use super::iface::{choose_address, list_interfaces, parse_root_spec};
use super::mailbox::Mailbox;
use super::root::RootServer;
use super::sock::{accept_polled, bind_listener, connect_until};
use super::unique_id::UniqueId;
use super::wire::{
    is_timeout, read_exact_until, read_frame, secrets_equal, write_frame, FrameKind, FrameRead,
    Hello, HelloKind, Secret,
};
use super::{Bootstrap, FailureListener};
use crate::env::Env;
use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Root listeners bound by [`TcpBootstrap::create_unique_id`], waiting for rank 0 of the same
/// process. Holding the socket (instead of closing it and binding again later) means no other
/// process can take the port in between.
static PREBOUND: Mutex<Vec<(Secret, TcpListener)>> = Mutex::new(Vec::new());

/// Locks ignoring poisoning: every critical section here leaves its data consistent.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The TCP bootstrap. See the module docs for the protocol.
pub struct TcpBootstrap {
    inner: Arc<Inner>,
    acceptor: Option<JoinHandle<()>>,
    /// Started by the first `watch_failures`; see the module docs (Liveness).
    heartbeat: Mutex<Option<JoinHandle<()>>>,
    root: Option<RootServer>,
}

/// Incoming connections, kept so that drop can shut them down and join their readers.
#[derive(Default)]
struct Incoming {
    closed: bool,
    streams: Vec<TcpStream>,
    readers: Vec<JoinHandle<()>>,
}

struct Inner {
    rank: usize,
    size: usize,
    secret: Secret,
    timeout: Duration,
    listen: SocketAddr,
    peers: Vec<SocketAddr>,
    /// This rank's sending connection to each peer, opened on first use.
    out: Vec<Mutex<Option<TcpStream>>>,
    mailbox: Mailbox,
    stop: AtomicBool,
    incoming: Mutex<Incoming>,
    collective_seq: AtomicU64,
    /// Told when the job fails (see [`Bootstrap::watch_failures`]).
    listeners: Mutex<Vec<Weak<dyn FailureListener>>>,
    /// Nonces of liveness pings, so a late answer to an old ping is never taken for a new one.
    ping_nonce: AtomicU64,
    /// See [`BootstrapConfig::liveness_timeout`].
    liveness_timeout: Duration,
    /// Origin of the `heard` timestamps.
    epoch: Instant,
    /// Per peer: nanoseconds after `epoch` when its last frame was read (0: none yet).
    heard: Vec<AtomicU64>,
}

impl TcpBootstrap {
    /// Creates the id of a new job: picks the root address (interface and family from `config`),
    /// binds the root listener there on an ephemeral port, and draws a random job secret. Rank 0
    /// must call [`new`](Self::new) with this id in the same process (as MSCCL++/NCCL programs
    /// do: rank 0 creates the id and distributes it), so it serves on the socket bound here.
    pub fn create_unique_id(config: &BootstrapConfig) -> Result<UniqueId> {
        let ip = choose_address(
            &list_interfaces()?,
            config.interface.as_deref(),
            config.family,
        )?;
        let listener = bind_listener(ip, "the bootstrap root")?;
        let addr = listener.local_addr().map_err(|e| {
            Error::io(
                format!("reading the root listener address bound at {ip}"),
                e,
            )
        })?;
        let secret: Secret = rand::random();
        lock(&PREBOUND).push((secret, listener));
        Ok(UniqueId::from_parts(addr, secret))
    }

    /// Joins the job `id` as `rank` of `size`. Blocks until every rank joined (or the timeout).
    pub fn new(rank: usize, size: usize, id: &UniqueId, config: &BootstrapConfig) -> Result<Self> {
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!(
                "bootstrap rank {rank} is not in 0..{size} (size must be at least 1)"
            )));
        }
        if u32::try_from(size).is_err() {
            return Err(Error::InvalidArgument(format!(
                "bootstrap size {size} exceeds u32"
            )));
        }
        let timeout = config.timeout;
        let start = Instant::now();
        let deadline = start + timeout;
        let root = if rank == 0 {
            let listener = take_prebound(id).map_or_else(|| bind_root(id.root_addr()), Ok)?;
            // The root gives up slightly before the ranks would, so its report naming the
            // missing ranks reaches them before their own timeouts fire.
            let margin = (timeout / 10).min(Duration::from_millis(500));
            let root_deadline = deadline.checked_sub(margin).unwrap_or(deadline);
            Some(
                RootServer::start(listener, size, *id.secret(), root_deadline, timeout)
                    .map_err(|e| Error::io("starting the bootstrap root threads", e))?,
            )
        } else {
            None
        };

        let root_addr = id.root_addr();
        let mut root_stream = connect_until(
            root_addr,
            deadline,
            timeout,
            &format!("the bootstrap root (rank 0) at {root_addr}"),
        )?;
        let own_ip = match &config.interface {
            Some(spec) => choose_address(&list_interfaces()?, Some(spec), config.family)?,
            None => {
                let mut a = root_stream.local_addr().map_err(|e| {
                    Error::io("reading the local address of the root connection", e)
                })?;
                a.set_port(0);
                a
            }
        };
        let listener = bind_listener(own_ip, &format!("rank {rank}'s bootstrap listener"))?;
        let listen = listener
            .local_addr()
            .map_err(|e| Error::io(format!("reading rank {rank}'s listener address"), e))?;

        let hello = Hello {
            kind: HelloKind::Root,
            secret: *id.secret(),
            rank: rank as u32,
            size: size as u32,
            listen,
        };
        root_stream
            .set_write_timeout(Some(timeout))
            .and_then(|_| root_stream.write_all(&hello.encode()))
            .map_err(|e| Error::Peer {
                rank: 0,
                message: format!(
                    "sending rank {rank}'s join request to the root at {root_addr} failed: {e}"
                ),
            })?;
        let peers = match super::wire::RootReply::read(&mut root_stream, size, deadline, timeout)? {
            super::wire::RootReply::Table(t) => t,
            super::wire::RootReply::Failed { missing, message } if !missing.is_empty() => {
                return Err(Error::Timeout {
                    what: format!("rank(s) {missing:?} to join the bootstrap ({message})"),
                    timeout,
                })
            }
            super::wire::RootReply::Failed { message, .. } => {
                return Err(Error::Bootstrap(format!(
                    "the root refused rank {rank}: {message}"
                )))
            }
        };
        drop(root_stream);

        let inner = Arc::new(Inner {
            rank,
            size,
            secret: *id.secret(),
            timeout,
            listen,
            peers,
            out: (0..size).map(|_| Mutex::new(None)).collect(),
            mailbox: Mailbox::new(),
            stop: AtomicBool::new(false),
            incoming: Mutex::new(Incoming::default()),
            collective_seq: AtomicU64::new(0),
            listeners: Mutex::new(Vec::new()),
            ping_nonce: AtomicU64::new(0),
            liveness_timeout: config.liveness_timeout,
            epoch: Instant::now(),
            heard: (0..size).map(|_| AtomicU64::new(0)).collect(),
        });
        let acceptor = {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new()
                .name(format!("mscclpp-bootstrap-accept-{rank}"))
                .spawn(move || {
                    crate::process::run_guarded("mscclpp-bootstrap-accept", || {
                        accept_loop(&inner, listener)
                    })
                })
                .map_err(|e| Error::io("spawning the bootstrap accept thread", e))?
        };
        tracing::debug!(
            "bootstrap rank {rank}/{size} up in {:?}, listening on {listen}",
            start.elapsed()
        );
        Ok(TcpBootstrap {
            inner,
            acceptor: Some(acceptor),
            heartbeat: Mutex::new(None),
            root,
        })
    }

    /// Joins a job whose root listens at `address`: `ip:port`, `[ipv6]:port`, `host:port`, or
    /// `ifname:` before any of those (this rank then listens on that interface). Rank 0 listens
    /// there itself. The job secret is `config.secret`, or else derived from the address.
    pub fn from_address(
        rank: usize,
        size: usize,
        address: &str,
        config: &BootstrapConfig,
    ) -> Result<Self> {
        let spec = parse_root_spec(address, config.family)?;
        let mut config = config.clone();
        if spec.interface.is_some() {
            config.interface = spec.interface;
        }
        let secret = config.secret.unwrap_or_else(|| derive_secret(&spec.addr));
        Self::new(
            rank,
            size,
            &UniqueId::from_parts(spec.addr, secret),
            &config,
        )
    }

    /// Joins the job the environment describes: rank and size from the launcher (torchrun, Open
    /// MPI, PMI, Slurm), the root from `MSCCLPP_MASTER_ADDR`/`MSCCLPP_MASTER_PORT`, or else from
    /// torchrun's `MASTER_ADDR` with port `MASTER_PORT + 1` (torchrun's own TCP store already
    /// listens on `MASTER_PORT` in rank 0's process, so the next port is taken instead).
    pub fn from_env(env: &Env) -> Result<Self> {
        let launcher = env.launcher.as_ref().ok_or_else(|| {
            Error::Bootstrap(
                "no launcher variables found to tell this process its rank: set RANK and \
                 WORLD_SIZE (torchrun), or run under mpirun (OMPI_COMM_WORLD_*), a PMI launcher \
                 or srun (SLURM_*)"
                    .into(),
            )
        })?;
        let address = root_address_from_env(env)?;
        Self::from_address(
            launcher.rank,
            launcher.world_size,
            &address,
            &BootstrapConfig::from_env(env),
        )
    }

    /// This rank's listening address (where peers connect).
    pub fn listen_addr(&self) -> SocketAddr {
        self.inner.listen
    }

    /// Every rank's listening address, indexed by rank.
    pub fn peer_addrs(&self) -> &[SocketAddr] {
        &self.inner.peers
    }

    fn collective<T>(&self, f: impl FnOnce(&Arc<Inner>, u64) -> Result<T>) -> Result<T> {
        if let Some(reason) = self.inner.mailbox.interrupted() {
            return Err(Error::Aborted(reason));
        }
        if let Some((rank, reason)) = self.inner.mailbox.aborted() {
            return Err(Error::Peer {
                rank,
                message: format!("job aborted earlier: {reason}"),
            });
        }
        let seq = self.inner.collective_seq.fetch_add(1, Ordering::Relaxed);
        f(&self.inner, seq)
    }
}

/// The root address from `MSCCLPP_MASTER_ADDR`/`PORT`, else torchrun's `MASTER_ADDR`:
/// `MASTER_PORT + 1` (see [`TcpBootstrap::from_env`]).
pub fn root_address_from_env(env: &Env) -> Result<String> {
    let join = |host: &str, port: u16| {
        if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        }
    };
    match (&env.master_addr, env.master_port) {
        (Some(host), Some(port)) => Ok(join(host, port)),
        (Some(host), None) => Err(Error::Env {
            var: "MSCCLPP_MASTER_PORT",
            value: String::new(),
            reason: format!("MSCCLPP_MASTER_ADDR={host} is set but MSCCLPP_MASTER_PORT is not"),
        }),
        (None, Some(port)) => Err(Error::Env {
            var: "MSCCLPP_MASTER_ADDR",
            value: String::new(),
            reason: format!("MSCCLPP_MASTER_PORT={port} is set but MSCCLPP_MASTER_ADDR is not"),
        }),
        (None, None) => match &env.torch_master {
            Some((host, port)) => {
                let next = port.checked_add(1).ok_or_else(|| Error::Env {
                    var: "MASTER_PORT",
                    value: port.to_string(),
                    reason: "the bootstrap uses MASTER_PORT+1 (torchrun's store has MASTER_PORT), \
                             which overflows; set MSCCLPP_MASTER_PORT"
                        .into(),
                })?;
                Ok(join(host, next))
            }
            None => Err(Error::Bootstrap(
                "no bootstrap root address: set MSCCLPP_MASTER_ADDR and MSCCLPP_MASTER_PORT, or \
                 run under torchrun (MASTER_ADDR/MASTER_PORT)"
                    .into(),
            )),
        },
    }
}

/// The secret of an address-based job: every rank can compute it from the address alone. It
/// keeps ranks of different jobs (different root addresses) apart; it is not a credential.
fn derive_secret(addr: &SocketAddr) -> Secret {
    let digest = Sha256::new()
        .chain_update(b"mscclpp-rs bootstrap address secret v1\0")
        .chain_update(addr.to_string().as_bytes())
        .finalize();
    let mut s = [0u8; super::wire::SECRET_LEN];
    s.copy_from_slice(&digest[..super::wire::SECRET_LEN]);
    s
}

fn take_prebound(id: &UniqueId) -> Option<TcpListener> {
    let mut pre = lock(&PREBOUND);
    let at = pre.iter().position(|(s, l)| {
        secrets_equal(s, id.secret()) && l.local_addr().ok() == Some(id.root_addr())
    })?;
    Some(pre.swap_remove(at).1)
}

/// Binds the root at `addr`. A host name in MASTER_ADDR may resolve to an address this host does
/// not own directly (NAT, 127.0.1.1 quirks); then listen on every address at that port.
fn bind_root(addr: SocketAddr) -> Result<TcpListener> {
    match bind_listener(addr, "the bootstrap root") {
        Err(Error::Bootstrap(msg)) if msg.contains("does not belong to this host") => {
            let any = match addr.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            };
            tracing::debug!("bootstrap root: {addr} is not local, listening on {any} instead");
            bind_listener(SocketAddr::new(any, addr.port()), "the bootstrap root")
        }
        other => other,
    }
}

fn accept_loop(inner: &Arc<Inner>, listener: TcpListener) {
    loop {
        match accept_polled(&listener, &inner.stop) {
            Ok(Some((stream, from))) => {
                let mut inc = lock(&inner.incoming);
                if inc.closed {
                    return;
                }
                match stream.try_clone() {
                    Ok(c) => inc.streams.push(c),
                    Err(e) => {
                        tracing::warn!(
                            "bootstrap rank {}: dropping connection from {from}: {e}",
                            inner.rank
                        );
                        continue;
                    }
                }
                let reader_inner = Arc::clone(inner);
                let spawned = std::thread::Builder::new()
                    .name(format!("mscclpp-bootstrap-read-{}", inner.rank))
                    .spawn(move || {
                        crate::process::run_guarded("mscclpp-bootstrap-read", || {
                            serve_connection(&reader_inner, stream, from)
                        })
                    });
                match spawned {
                    Ok(h) => inc.readers.push(h),
                    Err(e) => tracing::warn!(
                        "bootstrap rank {}: cannot spawn a reader for {from}: {e}",
                        inner.rank
                    ),
                }
            }
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("bootstrap rank {}: accept failed: {e}", inner.rank);
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Text of an error for a log line about a connection that is not (yet) a known rank.
fn describe(e: &Error) -> String {
    match e {
        Error::Peer { message, .. } => message.clone(),
        other => other.to_string(),
    }
}

/// Handshakes an incoming connection, then routes its frames until it closes.
fn serve_connection(inner: &Arc<Inner>, mut stream: TcpStream, from: SocketAddr) {
    let me = inner.rank;
    let deadline = Instant::now() + inner.timeout;
    let mut buf = [0u8; Hello::LEN];
    if let Err(e) = read_exact_until(
        &mut stream,
        &mut buf,
        deadline,
        inner.timeout,
        0,
        "a handshake",
    ) {
        if !inner.stop.load(Ordering::Acquire) {
            tracing::warn!(
                "bootstrap rank {me}: refused connection from {from}: {}",
                describe(&e)
            );
        }
        return;
    }
    let hello = match Hello::decode(&buf) {
        Ok(h) => h,
        Err(why) => {
            tracing::warn!("bootstrap rank {me}: refused connection from {from}: {why}");
            return;
        }
    };
    if !secrets_equal(&hello.secret, &inner.secret) {
        tracing::warn!(
            "bootstrap rank {me}: refused connection from {from} claiming rank {}: wrong job secret",
            hello.rank
        );
        return;
    }
    let peer = hello.rank as usize;
    if hello.kind != HelloKind::Peer || hello.size as usize != inner.size || peer >= inner.size {
        tracing::warn!(
            "bootstrap rank {me}: refused connection from {from}: handshake for rank {peer} of \
             {} ({:?}) does not fit this {}-rank job",
            hello.size,
            hello.kind,
            inner.size
        );
        return;
    }
    let answer = Hello {
        kind: HelloKind::Peer,
        secret: inner.secret,
        rank: me as u32,
        size: inner.size as u32,
        listen: inner.listen,
    };
    let answered = stream
        .set_write_timeout(Some(inner.timeout))
        .and_then(|_| stream.write_all(&answer.encode()))
        .and_then(|_| stream.set_read_timeout(None))
        .and_then(|_| stream.set_nodelay(true));
    if let Err(e) = answered {
        tracing::warn!(
            "bootstrap rank {me}: handshake answer to rank {peer} at {from} failed: {e}"
        );
        return;
    }
    loop {
        match read_frame(&mut stream) {
            Ok(FrameRead::Frame { kind, tag, payload }) => {
                // Any frame shows the peer's process runs, not only heartbeats.
                inner.heard_from(peer);
                match kind {
                    FrameKind::User | FrameKind::Collective => {
                        inner.mailbox.push((peer, kind, tag), payload)
                    }
                    FrameKind::Goodbye => {
                        inner
                            .mailbox
                            .goodbye(peer, format!("rank {peer} shut down its bootstrap"));
                        return;
                    }
                    FrameKind::Abort => {
                        let (blamed, reason) = parse_abort(&payload, peer);
                        inner.abort_job(blamed, reason);
                    }
                    FrameKind::Ping => inner.answer_ping(peer, tag),
                    FrameKind::Pong => inner.mailbox.push((peer, kind, tag), payload),
                    FrameKind::Heartbeat => {}
                }
            }
            Ok(FrameRead::Closed) => {
                let why = "connection closed unexpectedly (the process exited or crashed)";
                inner.mailbox.close_peer(peer, why.into());
                inner.abort_job(peer, format!("rank {peer} died: its bootstrap {why}"));
                return;
            }
            Err(why) => {
                if !inner.stop.load(Ordering::Acquire) {
                    let why = format!("connection closed: {why}");
                    inner.mailbox.close_peer(peer, why.clone());
                    inner.abort_job(peer, format!("rank {peer} failed: its bootstrap {why}"));
                }
                return;
            }
        }
    }
}

/// How often the heartbeat thread beats and looks: often enough that a stall is seen within a
/// few percent of the liveness timeout, rarely enough to cost nothing (a 17-byte frame).
fn heartbeat_period(liveness_timeout: Duration) -> Duration {
    (liveness_timeout / 10).clamp(Duration::from_millis(10), Duration::from_millis(200))
}

fn encode_abort(blamed: usize, reason: &str) -> Vec<u8> {
    let mut p = (blamed as u32).to_le_bytes().to_vec();
    p.extend_from_slice(reason.as_bytes());
    p
}

fn parse_abort(payload: &[u8], from: usize) -> (usize, String) {
    match payload.get(..4) {
        Some(b) => (
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize,
            String::from_utf8_lossy(&payload[4..]).into_owned(),
        ),
        None => (from, format!("rank {from} aborted the job")),
    }
}

impl Inner {
    /// Opens (and handshakes) this rank's sending connection to `peer`, within `timeout`.
    fn connect_peer(&self, peer: usize, timeout: Duration) -> Result<TcpStream> {
        let addr = self.peers[peer];
        let deadline = Instant::now() + timeout;
        let mut s = connect_until(addr, deadline, timeout, &format!("rank {peer} at {addr}"))?;
        let hello = Hello {
            kind: HelloKind::Peer,
            secret: self.secret,
            rank: self.rank as u32,
            size: self.size as u32,
            listen: self.listen,
        };
        s.set_write_timeout(Some(self.timeout))
            .and_then(|_| s.write_all(&hello.encode()))
            .map_err(|e| Error::Peer {
                rank: peer,
                message: format!("sending the handshake to {addr} failed: {e}"),
            })?;
        let mut buf = [0u8; Hello::LEN];
        read_exact_until(
            &mut s,
            &mut buf,
            deadline,
            timeout,
            peer,
            &format!("rank {peer}'s handshake answer from {addr}"),
        )?;
        let answer = Hello::decode(&buf).map_err(|why| Error::Peer {
            rank: peer,
            message: format!("bad handshake answer from {addr}: {why}"),
        })?;
        if !secrets_equal(&answer.secret, &self.secret) || answer.rank as usize != peer {
            return Err(Error::Bootstrap(format!(
                "the process at {addr} (rank {peer}'s address) is not rank {peer} of this job \
                 (it answered as rank {} with {} secret)",
                answer.rank,
                if secrets_equal(&answer.secret, &self.secret) {
                    "the right"
                } else {
                    "another"
                }
            )));
        }
        Ok(s)
    }

    fn send_frame(&self, peer: usize, kind: FrameKind, tag: u64, data: &[u8]) -> Result<()> {
        self.send_frame_within(peer, kind, tag, data, self.timeout)
    }

    /// As `send_frame`, opening the link (if it is not open yet) within `connect_timeout`.
    fn send_frame_within(
        &self,
        peer: usize,
        kind: FrameKind,
        tag: u64,
        data: &[u8],
        connect_timeout: Duration,
    ) -> Result<()> {
        if peer >= self.size {
            return Err(Error::InvalidArgument(format!(
                "peer rank {peer} is not in this {}-rank job",
                self.size
            )));
        }
        if peer == self.rank {
            self.mailbox.push((peer, kind, tag), data.to_vec());
            return Ok(());
        }
        // An interrupted rank sends nothing more of its own (opening a link to a stopped peer
        // could block for the bootstrap timeout); answers to pings still go, it is alive.
        if kind != FrameKind::Pong {
            if let Some(reason) = self.mailbox.interrupted() {
                return Err(Error::Aborted(reason));
            }
        }
        let mut slot = lock(&self.out[peer]);
        if slot.is_none() {
            *slot = Some(self.connect_peer(peer, connect_timeout)?);
        }
        let Some(stream) = slot.as_mut() else {
            return Err(Error::Internal(
                "peer connection vanished under its lock".into(),
            ));
        };
        let result = write_frame(stream, kind, tag, data);
        result.map_err(|e| {
            // The stream may hold half a frame now: never reuse it.
            if let Some(s) = slot.take() {
                let _ = s.shutdown(Shutdown::Both);
            }
            if is_timeout(&e) {
                Error::Timeout {
                    what: format!("rank {peer} to take {} bytes (tag {tag})", data.len()),
                    timeout: self.timeout,
                }
            } else {
                Error::Peer {
                    rank: peer,
                    message: format!("sending {} bytes (tag {tag}) failed: {e}", data.len()),
                }
            }
        })
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(Error::InvalidArgument(format!(
                "peer rank {peer} is not in this {}-rank job",
                self.size
            )));
        }
        Ok(())
    }

    fn recv_frame(
        &self,
        peer: usize,
        kind: FrameKind,
        tag: u64,
        what: impl Fn() -> String,
    ) -> Result<Vec<u8>> {
        self.check_peer(peer)?;
        self.mailbox.wait(
            (peer, kind, tag),
            Instant::now() + self.timeout,
            self.timeout,
            what,
        )
    }

    /// Records a job-wide failure and, the first time, floods it over this rank's open links.
    /// The flood runs on its own thread: the caller may be a reader thread, which must keep
    /// draining its socket while a link's lock is held by a large send.
    fn abort_job(self: &Arc<Inner>, blamed: usize, reason: String) {
        if !self.mailbox.abort(blamed, reason.clone()) || self.stop.load(Ordering::Acquire) {
            return;
        }
        // This process is exiting (its peers' connections close as theirs do): waits fail, but
        // nothing is told or logged, and no thread started, while the driver tears down.
        if crate::process::exiting() {
            return;
        }
        tracing::error!("bootstrap rank {}: aborting the job: {reason}", self.rank);
        let listeners = std::mem::take(&mut *lock(&self.listeners));
        for l in listeners.iter().filter_map(Weak::upgrade) {
            l.job_failed(blamed, &reason);
        }
        let inner = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(format!("mscclpp-bootstrap-abort-{}", self.rank))
            .spawn(move || {
                crate::process::run_guarded("mscclpp-bootstrap-abort", || {
                    let payload = encode_abort(blamed, &reason);
                    for (peer, slot) in inner.out.iter().enumerate() {
                        // Only links that exist: opening new ones to a failing job could block.
                        let mut slot = lock(slot);
                        if let Some(s) = slot.as_mut() {
                            if write_frame(s, FrameKind::Abort, 0, &payload).is_err() {
                                let _ = s.shutdown(Shutdown::Both);
                                *slot = None;
                            }
                        }
                        drop(slot);
                        tracing::trace!("bootstrap rank {}: abort sent to rank {peer}", inner.rank);
                    }
                })
            });
        if let Err(e) = spawned {
            tracing::warn!(
                "bootstrap rank {}: cannot spawn the abort thread: {e}",
                self.rank
            );
        }
    }

    fn heard_from(&self, peer: usize) {
        let at = self.epoch.elapsed().as_nanos().max(1);
        self.heard[peer].store(u64::try_from(at).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// When `peer`'s last frame was read, if any.
    fn last_heard(&self, peer: usize) -> Option<Instant> {
        match self.heard[peer].load(Ordering::Relaxed) {
            0 => None,
            ns => Some(self.epoch + Duration::from_nanos(ns)),
        }
    }

    /// Sends a heartbeat on the existing link to `peer`. Skipped while another thread holds the
    /// link: its send is traffic the peer hears too (or, if that send is blocked, the peer is
    /// not reading, and its own successor will tell).
    fn send_heartbeat(&self, peer: usize) {
        let Ok(mut slot) = self.out[peer].try_lock() else {
            return;
        };
        if let Some(s) = slot.as_mut() {
            if let Err(e) = write_frame(s, FrameKind::Heartbeat, 0, &[]) {
                tracing::debug!(
                    "bootstrap rank {}: heartbeat to rank {peer}: {e}",
                    self.rank
                );
                let _ = s.shutdown(Shutdown::Both);
                *slot = None;
            }
        }
    }

    /// The heartbeat thread (module docs, Liveness): beats to the ring successor and blames the
    /// ring predecessor once it has been silent for `liveness_timeout`. Ends at drop or once
    /// the job failed (the abort's flood tells the peers from then on).
    fn heartbeat_loop(self: &Arc<Inner>) {
        let (next, prev) = (
            (self.rank + 1) % self.size,
            (self.rank + self.size - 1) % self.size,
        );
        let timeout = self.liveness_timeout;
        let period = heartbeat_period(timeout);
        let started = Instant::now();
        // Silence is counted from here at the earliest: the start, or the end of a gap in which
        // this thread itself did not run (so it could not have heard anything either).
        let mut counting_from = started;
        let mut last_tick = started;
        loop {
            self.send_heartbeat(next);
            std::thread::park_timeout(period);
            if self.stop.load(Ordering::Acquire) || self.mailbox.aborted().is_some() {
                return;
            }
            let now = Instant::now();
            if now - last_tick > period + timeout / 2 {
                tracing::debug!(
                    "bootstrap rank {}: the heartbeat thread did not run for {:?} (this process \
                     was stopped or starved): restarting the liveness count",
                    self.rank,
                    now - last_tick
                );
                counting_from = now;
            }
            last_tick = now;
            if self.mailbox.said_goodbye(prev) {
                continue;
            }
            let heard = self.last_heard(prev).filter(|&t| t > started);
            // Until the predecessor's first beat, allow for it reaching `watch_failures` later
            // than this rank (it is collective, but ranks leave the preceding barrier apart).
            let allowed = if heard.is_some() {
                timeout
            } else {
                timeout + self.timeout
            };
            let since = heard.map_or(counting_from, |t| t.max(counting_from));
            let silent = now.saturating_duration_since(since);
            if silent > allowed {
                self.abort_job(
                    prev,
                    format!(
                        "rank {prev} stalled: no heartbeat for {:.1} s (the process is stopped, \
                         hung or starved; MSCCLPP_LIVENESS_TIMEOUT is {:.1} s)",
                        silent.as_secs_f64(),
                        timeout.as_secs_f64()
                    ),
                );
                return;
            }
        }
    }

    /// Answers `peer`'s liveness ping on a thread of its own: the reader must keep draining its
    /// socket, and the link to `peer` may be busy with a large send or still to be opened.
    fn answer_ping(self: &Arc<Inner>, peer: usize, nonce: u64) {
        let inner = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(format!("mscclpp-bootstrap-pong-{}", self.rank))
            .spawn(move || {
                crate::process::run_guarded("mscclpp-bootstrap-pong", || {
                    if let Err(e) = inner.send_frame(peer, FrameKind::Pong, nonce, &[]) {
                        tracing::debug!("bootstrap rank {}: pong to rank {peer}: {e}", inner.rank);
                    }
                })
            });
        if let Err(e) = spawned {
            tracing::warn!(
                "bootstrap rank {}: cannot spawn a pong thread: {e}",
                self.rank
            );
        }
    }

    /// See [`Bootstrap::unresponsive_peers`].
    fn unresponsive_peers(self: &Arc<Inner>, within: Duration) -> Vec<usize> {
        let inner = self;
        let nonce = inner.ping_nonce.fetch_add(1, Ordering::Relaxed);
        let peers: Vec<usize> = (0..inner.size).filter(|&p| p != inner.rank).collect();
        // Sends on threads: opening a link to a stopped process blocks until the bootstrap
        // timeout (its kernel accepts, nobody answers the handshake).
        for &peer in &peers {
            let inner = Arc::clone(self);
            let _ = std::thread::Builder::new()
                .name(format!("mscclpp-bootstrap-ping-{}", inner.rank))
                .spawn(move || {
                    crate::process::run_guarded("mscclpp-bootstrap-ping", || {
                        // A stopped peer's kernel accepts the connection but nobody answers the
                        // handshake: give up with the ping rather than hold the link's lock.
                        let _ = inner.send_frame_within(peer, FrameKind::Ping, nonce, &[], within);
                    })
                });
        }
        let deadline = Instant::now() + within;
        peers
            .into_iter()
            .filter(|&peer| {
                !inner.mailbox.said_goodbye(peer)
                    && inner
                        .mailbox
                        .wait((peer, FrameKind::Pong, nonce), deadline, within, || {
                            format!("rank {peer}'s liveness answer")
                        })
                        .is_err()
            })
            .collect()
    }
}

impl Exchange for Arc<Inner> {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn send_coll(&self, peer: usize, seq: u64, data: &[u8]) -> Result<()> {
        self.send_frame(peer, FrameKind::Collective, seq, data)
    }
    fn recv_coll(&self, peer: usize, seq: u64, op: Op) -> Result<Vec<u8>> {
        let me = self.rank;
        self.recv_frame(peer, FrameKind::Collective, seq, || {
            format!("rank {peer} in {op} #{seq} (rank {me} waiting)")
        })
    }
    /// Runs after any failed collective step: turns the local failure into a job abort. A
    /// timeout blames the peer waited for only when no other peer is silent: with a stopped
    /// rank, the peer waited for may itself be waiting for it.
    fn fail(&self, peer: usize, seq: u64, op: Op, e: Error) -> Error {
        // This rank gave up on the bootstrap itself (`interrupt`): nothing to blame on a peer, and
        // nothing to flood (the interrupt is local by design).
        if matches!(e, Error::Aborted(_)) {
            return e;
        }
        // A link that fails after the job was aborted fails because of it (a send to a peer that
        // already left, say): the abort's reason is the one the caller needs.
        if let (Error::Peer { message, .. }, Some((rank, reason))) = (&e, self.mailbox.aborted()) {
            if !message.starts_with("job aborted") {
                return Error::Peer {
                    rank,
                    message: format!("job aborted: {reason}"),
                };
            }
        }
        if let Error::Timeout { .. } = &e {
            let silent = self.unresponsive_peers(Duration::from_millis(500));
            if let Some(&stalled) = silent
                .iter()
                .find(|&&p| p != peer)
                .filter(|_| !silent.contains(&peer))
            {
                let why = format!(
                    "rank {} timed out in {op} #{seq} and rank {stalled} does not answer liveness \
                     pings (stopped or hung): {e}",
                    self.rank
                );
                self.abort_job(stalled, why.clone());
                return Error::Peer {
                    rank: stalled,
                    message: why,
                };
            }
        }
        self.abort_job(
            peer,
            format!(
                "rank {} gave up on rank {peer} in {op} #{seq}: {e}",
                self.rank
            ),
        );
        e
    }
}

impl Bootstrap for TcpBootstrap {
    fn rank(&self) -> usize {
        self.inner.rank
    }
    fn size(&self) -> usize {
        self.inner.size
    }
    fn send(&self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        self.inner.send_frame(peer, FrameKind::User, tag, data)
    }
    fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>> {
        let me = self.inner.rank;
        self.inner.recv_frame(peer, FrameKind::User, tag, || {
            format!("a message from rank {peer} with tag {tag} (rank {me} waiting)")
        })
    }
    fn try_recv(&self, peer: usize, tag: u64) -> Result<Option<Vec<u8>>> {
        let me = self.inner.rank;
        self.inner.check_peer(peer)?;
        self.inner
            .mailbox
            .try_take((peer, FrameKind::User, tag), || {
                format!("a message from rank {peer} with tag {tag} (rank {me} polling)")
            })
    }
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.collective(|x, seq| collectives::all_gather(x, seq, data))
    }
    fn barrier(&self) -> Result<()> {
        self.collective(collectives::barrier)
    }
    fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        self.collective(|x, seq| collectives::broadcast(x, seq, root, data))
    }
    fn watch_failures(&self, listener: Weak<dyn FailureListener>) {
        let inner = &self.inner;
        {
            // Checked under the listeners' lock: `abort_job` marks the mailbox before it takes
            // the listeners, so a failure is either seen here or delivered to this listener.
            let mut listeners = lock(&inner.listeners);
            if let Some((rank, reason)) = inner.mailbox.aborted() {
                drop(listeners);
                if let Some(l) = listener.upgrade() {
                    l.job_failed(rank, &reason);
                }
                return;
            }
            listeners.retain(|l| l.strong_count() > 0);
            listeners.push(listener);
        }
        // The ring link: our successor then reads from us, so it sees our death.
        let next = (inner.rank + 1) % inner.size;
        if next != inner.rank {
            let mut slot = lock(&inner.out[next]);
            if slot.is_none() {
                match inner.connect_peer(next, inner.timeout) {
                    Ok(s) => *slot = Some(s),
                    Err(e) => tracing::warn!(
                        "bootstrap rank {}: liveness link to rank {next}: {e}",
                        inner.rank
                    ),
                }
            }
            drop(slot);
            let mut heartbeat = lock(&self.heartbeat);
            if heartbeat.is_none() {
                let beating = Arc::clone(inner);
                let spawned = std::thread::Builder::new()
                    .name(format!("mscclpp-bootstrap-heartbeat-{}", inner.rank))
                    .spawn(move || {
                        crate::process::run_guarded("mscclpp-bootstrap-heartbeat", || {
                            beating.heartbeat_loop()
                        })
                    });
                match spawned {
                    Ok(h) => *heartbeat = Some(h),
                    Err(e) => tracing::warn!(
                        "bootstrap rank {}: cannot spawn the heartbeat thread: {e}",
                        inner.rank
                    ),
                }
            }
        }
    }
    fn unresponsive_peers(&self, within: Duration) -> Vec<usize> {
        self.inner.unresponsive_peers(within)
    }
    fn interrupt(&self, reason: &str) {
        self.inner.mailbox.interrupt(reason);
    }
    fn abort_job(&self, rank: usize, reason: &str) {
        self.inner.abort_job(rank, reason.to_string());
    }
}

impl Drop for TcpBootstrap {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.stop.store(true, Ordering::Release);
        if let Some(h) = lock(&self.heartbeat).take() {
            h.thread().unpark();
            if h.join().is_err() {
                tracing::error!("bootstrap rank {}: heartbeat thread panicked", inner.rank);
            }
        }
        lock(&inner.incoming).closed = true;
        // Goodbye first, so peers read it as a clean shutdown rather than a crash. A short write
        // timeout: a peer that stopped reading must not hold up our exit. A failed job's abort
        // goes before it: the flood thread may not have reached every link yet, and a peer stops
        // reading at the goodbye.
        let abort = inner
            .mailbox
            .aborted()
            .map(|(blamed, reason)| encode_abort(blamed, &reason));
        for slot in &inner.out {
            let mut slot = lock(slot);
            if let Some(s) = slot.as_mut() {
                let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
                if let Some(payload) = &abort {
                    let _ = write_frame(s, FrameKind::Abort, 0, payload);
                }
                let _ = write_frame(s, FrameKind::Goodbye, 0, &[]);
                let _ = s.shutdown(Shutdown::Both);
            }
            *slot = None;
        }
        if let Some(h) = self.acceptor.take() {
            if h.join().is_err() {
                tracing::error!("bootstrap rank {}: accept thread panicked", inner.rank);
            }
        }
        let Incoming {
            streams, readers, ..
        } = std::mem::take(&mut *lock(&inner.incoming));
        for s in &streams {
            let _ = s.shutdown(Shutdown::Both);
        }
        inner.mailbox.shutdown();
        for h in readers {
            if h.join().is_err() {
                tracing::error!("bootstrap rank {}: reader thread panicked", inner.rank);
            }
        }
        self.root.take();
    }
}
