//! `EthernetTransport`: a [`Transport`] between processes or hosts over TCP, staged through host
//! memory (MSCCL++'s `EthernetConnection`).
//!
//! # Connections
//! One transport is two TCP connections to one peer, one per direction. On each, the data sender
//! streams frames and the data receiver answers flush requests. Keeping the directions apart means
//! a receiver thread never waits for a lock held by a local writer, so two peers writing large
//! buffers to each other cannot deadlock on full socket buffers.
//!
//! Establishment: one side binds an [`EthernetListener`] and calls [`EthernetListener::accept`], the
//! other calls [`EthernetTransport::connect`]. Each connection starts with a handshake carrying a
//! magic, both ranks, the connection's direction and the job secret; the listener answers with a
//! status byte. The secret keeps ranks of different jobs from connecting by accident (it travels in
//! clear, as in the bootstrap; it is not protection against an eavesdropper).
//!
//! # Frames (little endian)
//! A 48-byte header `{op: u32, key: u32, seq: u64, addr: u64, size: u64, offset: u64, arg: u64}`
//! where `(addr, size, key)` is the destination [`MemoryRegion`] as registered at the receiver:
//! - `WRITE`: `arg` bytes of payload follow, streamed in chunks of `chunk_size`; the receiver copies
//!   each chunk into `region + offset` through its [`MemoryResolver`], which checks the region.
//! - `SIGNAL`: the receiver stores `arg` to the 64-bit word at `region + offset` with release
//!   ordering. It handles frames in order, so every earlier write has landed by then.
//! - `FLUSH`: the receiver answers `{status: u32, len: u32, seq: u64}` + `len` message bytes once
//!   everything before it is applied; status 1 carries the first error met since the last flush.
//! - `CLOSE`: the sender is going away cleanly. End of stream without it means the peer died.
//!
//! # Failure
//! Every socket operation is bounded by `io_timeout`; an idle connection may wait forever between
//! frames, but a frame that stops mid-way is a timeout. A peer that disappears turns into
//! [`Error::Peer`] naming its rank: on the sending side from the next `write`/`flush`, on the
//! receiving side from [`EthernetTransport::check_receiver`].

use crate::error::{Error, Result};
use crate::transport::host_memory::MemoryResolver;
use crate::transport::{MemoryRegion, Transport, TransportKind};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAGIC: [u8; 8] = *b"MSCLETH1";
/// Longest secret accepted in a handshake (a bound so a stray connection cannot make us allocate).
const MAX_SECRET: usize = 4096;
const HEADER_LEN: usize = 48;
const REPLY_LEN: usize = 16;
/// Longest error message a receiver sends back.
const MAX_MESSAGE: usize = 4096;

const OP_WRITE: u32 = 1;
const OP_SIGNAL: u32 = 2;
const OP_FLUSH: u32 = 3;
const OP_CLOSE: u32 = 4;

/// Direction of one TCP connection, from the connector's point of view.
const ROLE_CONNECTOR_SENDS: u8 = 0;
const ROLE_CONNECTOR_RECEIVES: u8 = 1;

const STATUS_OK: u8 = 0;
const STATUS_BAD_SECRET: u8 = 1;
const STATUS_BAD_RANK: u8 = 2;

/// How often a blocked receiver read wakes up to look at the stop flag.
const RECEIVER_TICK: Duration = Duration::from_millis(100);

/// Settings of one Ethernet connection.
#[derive(Debug, Clone)]
pub struct EthernetConfig {
    /// This process's rank.
    pub rank: usize,
    /// The rank at the other end.
    pub remote_rank: usize,
    /// The other end's rank in the whole job, which errors and logs name: inside a
    /// sub-communicator (`Communicator::split`) `remote_rank` is its rank in the group. Defaults
    /// to `remote_rank`.
    pub remote_job_rank: usize,
    /// Job secret both ends must present (the bootstrap's secret, typically).
    pub secret: Vec<u8>,
    /// How long connect/accept (including the handshake) may take.
    pub connect_timeout: Duration,
    /// Longest time one socket operation may make no progress mid-frame.
    pub io_timeout: Duration,
    /// Bytes staged per chunk of a large write (sender and receiver).
    pub chunk_size: usize,
}

impl EthernetConfig {
    pub fn new(rank: usize, remote_rank: usize, secret: impl Into<Vec<u8>>) -> Self {
        EthernetConfig {
            rank,
            remote_rank,
            remote_job_rank: remote_rank,
            secret: secret.into(),
            connect_timeout: Duration::from_secs(30),
            io_timeout: Duration::from_secs(30),
            chunk_size: 4 << 20,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.secret.len() > MAX_SECRET {
            return Err(Error::InvalidArgument(format!(
                "Ethernet secret is {} bytes; at most {MAX_SECRET} are allowed",
                self.secret.len()
            )));
        }
        if self.chunk_size == 0 {
            return Err(Error::InvalidArgument(
                "EthernetConfig.chunk_size must be greater than 0".into(),
            ));
        }
        for (name, value) in [("rank", self.rank), ("remote_rank", self.remote_rank)] {
            if u32::try_from(value).is_err() {
                return Err(Error::InvalidArgument(format!(
                    "EthernetConfig.{name}={value} does not fit the handshake's 32 bits"
                )));
            }
        }
        Ok(())
    }
}

/// Accepts [`EthernetTransport`] connections from peers. Connections from ranks other than the one
/// an `accept` waits for are kept for a later `accept`, so one listener serves many peers.
pub struct EthernetListener {
    listener: TcpListener,
    pending: Mutex<HashMap<(usize, u8), TcpStream>>,
}

impl EthernetListener {
    /// Binds `addr` (port 0 picks a free port; see [`EthernetListener::local_addr`]).
    pub fn bind(addr: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| Error::io(format!("binding Ethernet listener to {addr}"), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("making the Ethernet listener non-blocking", e))?;
        Ok(EthernetListener {
            listener,
            pending: Mutex::new(HashMap::new()),
        })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|e| Error::io("reading the Ethernet listener's address", e))
    }

    /// Waits for `config.remote_rank` to connect (both directions) and returns the transport.
    pub fn accept(
        &self,
        config: &EthernetConfig,
        resolver: Arc<dyn MemoryResolver>,
    ) -> Result<EthernetTransport> {
        config.validate()?;
        let deadline = Instant::now() + config.connect_timeout;
        let mut data_in = None; // the peer sends on it
        let mut data_out = None; // we send on it
        while data_in.is_none() || data_out.is_none() {
            {
                let mut pending = lock(&self.pending, "Ethernet listener")?;
                if data_in.is_none() {
                    data_in = pending.remove(&(config.remote_rank, ROLE_CONNECTOR_SENDS));
                }
                if data_out.is_none() {
                    data_out = pending.remove(&(config.remote_rank, ROLE_CONNECTOR_RECEIVES));
                }
            }
            if data_in.is_some() && data_out.is_some() {
                break;
            }
            match self.listener.accept() {
                Ok((stream, from)) => match accept_handshake(stream, config, deadline) {
                    Ok((rank, role, stream)) => {
                        lock(&self.pending, "Ethernet listener")?.insert((rank, role), stream);
                    }
                    // A stray or misconfigured connection must not stop us from serving the real
                    // peer; the other side gets the status and reports it.
                    Err(e) => tracing::warn!("rejected Ethernet connection from {from}: {e}"),
                },
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(Error::Timeout {
                            what: format!(
                                "rank {} to connect to the Ethernet listener of rank {}",
                                config.remote_rank, config.rank
                            ),
                            timeout: config.connect_timeout,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("accepting an Ethernet connection", e)),
            }
        }
        match (data_in, data_out) {
            (Some(i), Some(o)) => EthernetTransport::start(config, o, i, resolver),
            _ => Err(Error::Internal(
                "Ethernet accept loop ended without both connections".into(),
            )),
        }
    }
}

/// Reads and checks a connector's handshake; answers with a status byte.
fn accept_handshake(
    mut stream: TcpStream,
    config: &EthernetConfig,
    deadline: Instant,
) -> Result<(usize, u8, TcpStream)> {
    let io = |e| Error::io("Ethernet handshake", e);
    stream.set_nonblocking(false).map_err(io)?;
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    stream.set_read_timeout(Some(remaining)).map_err(io)?;
    stream.set_write_timeout(Some(remaining)).map_err(io)?;
    let mut head = [0u8; 8 + 4 + 4 + 1 + 4];
    stream.read_exact(&mut head).map_err(io)?;
    if head[..8] != MAGIC {
        return Err(Error::Bootstrap(
            "Ethernet handshake: wrong magic (not an mscclpp-rs peer or another version)".into(),
        ));
    }
    let from = u32::from_le_bytes(head[8..12].try_into().unwrap_or_default()) as usize;
    let to = u32::from_le_bytes(head[12..16].try_into().unwrap_or_default()) as usize;
    let role = head[16];
    let secret_len = u32::from_le_bytes(head[17..21].try_into().unwrap_or_default()) as usize;
    if secret_len > MAX_SECRET || role > ROLE_CONNECTOR_RECEIVES {
        return Err(Error::Bootstrap(format!(
            "Ethernet handshake from rank {from}: malformed (secret length {secret_len}, role {role})"
        )));
    }
    let mut secret = vec![0u8; secret_len];
    stream.read_exact(&mut secret).map_err(io)?;
    let status = if !constant_time_eq(&secret, &config.secret) {
        STATUS_BAD_SECRET
    } else if to != config.rank {
        STATUS_BAD_RANK
    } else {
        STATUS_OK
    };
    stream.write_all(&[status]).map_err(io)?;
    match status {
        STATUS_OK => Ok((from, role, stream)),
        STATUS_BAD_SECRET => Err(Error::Bootstrap(format!(
            "Ethernet handshake from rank {from}: job secret mismatch"
        ))),
        _ => Err(Error::Bootstrap(format!(
            "Ethernet handshake from rank {from}: addressed to rank {to}, this is rank {}",
            config.rank
        ))),
    }
}

/// Compares secrets without an early exit, so timing does not reveal a matching prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Connects one direction to `addr`, retrying while the listener is not up yet.
fn connect_one(
    addr: SocketAddr,
    config: &EthernetConfig,
    role: u8,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut stream = loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(Error::Timeout {
                what: format!("connecting to rank {} at {addr}", config.remote_job_rank),
                timeout: config.connect_timeout,
            });
        }
        match TcpStream::connect_timeout(&addr, remaining) {
            Ok(s) => break s,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::Interrupted
                ) =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => continue,
            Err(e) => {
                return Err(Error::io(
                    format!("connecting to rank {} at {addr}", config.remote_job_rank),
                    e,
                ))
            }
        }
    };
    let io = |e| {
        Error::io(
            format!(
                "Ethernet handshake with rank {} at {addr}",
                config.remote_job_rank
            ),
            e,
        )
    };
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    stream.set_read_timeout(Some(remaining)).map_err(io)?;
    stream.set_write_timeout(Some(remaining)).map_err(io)?;
    let mut msg = Vec::with_capacity(21 + config.secret.len());
    msg.extend_from_slice(&MAGIC);
    // Ranks and the secret length were validated to fit in 32 bits.
    msg.extend_from_slice(&(config.rank as u32).to_le_bytes());
    msg.extend_from_slice(&(config.remote_rank as u32).to_le_bytes());
    msg.push(role);
    msg.extend_from_slice(&(config.secret.len() as u32).to_le_bytes());
    msg.extend_from_slice(&config.secret);
    stream.write_all(&msg).map_err(io)?;
    let mut status = [0u8; 1];
    stream.read_exact(&mut status).map_err(io)?;
    match status[0] {
        STATUS_OK => Ok(stream),
        STATUS_BAD_SECRET => Err(Error::Bootstrap(format!(
            "rank {} rejected our Ethernet connection: job secret mismatch",
            config.remote_job_rank
        ))),
        STATUS_BAD_RANK => Err(Error::Bootstrap(format!(
            "the listener at {addr} is not rank {}",
            config.remote_job_rank
        ))),
        other => Err(Error::Bootstrap(format!(
            "rank {} answered the Ethernet handshake with unknown status {other}",
            config.remote_job_rank
        ))),
    }
}

fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>> {
    m.lock()
        .map_err(|_| Error::Internal(format!("{what} lock poisoned by a panic")))
}

fn header(op: u32, seq: u64, region: &MemoryRegion, offset: u64, arg: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&op.to_le_bytes());
    h[4..8].copy_from_slice(&region.key.to_le_bytes());
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    h[16..24].copy_from_slice(&region.addr.to_le_bytes());
    h[24..32].copy_from_slice(&region.size.to_le_bytes());
    h[32..40].copy_from_slice(&offset.to_le_bytes());
    h[40..48].copy_from_slice(&arg.to_le_bytes());
    h
}

/// The region field of frames that name no memory.
const NO_REGION: MemoryRegion = MemoryRegion {
    addr: 0,
    size: 0,
    key: 0,
};

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// The sending half, behind the transport's lock.
struct Sender {
    stream: TcpStream,
    seq: u64,
    staging: Vec<u8>,
    /// Set once the stream is out of sync or dead; every later call fails with it.
    broken: Option<String>,
}

/// What the receiver thread reports to the transport's owner.
#[derive(Default)]
struct ReceiverShared {
    stop: AtomicBool,
    /// Why the receiver stopped, if it was not a clean close.
    failure: Mutex<Option<String>>,
}

/// A TCP link to one peer. See the module docs.
pub struct EthernetTransport {
    rank: usize,
    remote_rank: usize,
    config: EthernetConfig,
    resolver: Arc<dyn MemoryResolver>,
    sender: Mutex<Sender>,
    receiver_stream: TcpStream,
    receiver_shared: Arc<ReceiverShared>,
    receiver: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for EthernetTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EthernetTransport")
            .field("rank", &self.rank)
            .field("remote_rank", &self.remote_rank)
            .finish_non_exhaustive()
    }
}

impl EthernetTransport {
    /// Connects to the listener of `config.remote_rank` at `addr`. `resolver` resolves the local
    /// regions: sources of our writes and destinations of the peer's.
    pub fn connect(
        addr: SocketAddr,
        config: &EthernetConfig,
        resolver: Arc<dyn MemoryResolver>,
    ) -> Result<Self> {
        config.validate()?;
        let deadline = Instant::now() + config.connect_timeout;
        let out = connect_one(addr, config, ROLE_CONNECTOR_SENDS, deadline)?;
        let inc = connect_one(addr, config, ROLE_CONNECTOR_RECEIVES, deadline)?;
        Self::start(config, out, inc, resolver)
    }

    fn start(
        config: &EthernetConfig,
        out: TcpStream,
        inc: TcpStream,
        resolver: Arc<dyn MemoryResolver>,
    ) -> Result<Self> {
        let ctx = |what: &'static str| {
            move |e| Error::io(format!("Ethernet connection setup: {what}"), e)
        };
        for s in [&out, &inc] {
            // Signals and flushes are small frames: send them now, not after Nagle's delay.
            s.set_nodelay(true).map_err(ctx("TCP_NODELAY"))?;
            s.set_write_timeout(Some(config.io_timeout))
                .map_err(ctx("write timeout"))?;
        }
        out.set_read_timeout(Some(config.io_timeout))
            .map_err(ctx("read timeout"))?;
        inc.set_read_timeout(Some(RECEIVER_TICK.min(config.io_timeout)))
            .map_err(ctx("read timeout"))?;
        let receiver_stream = inc.try_clone().map_err(ctx("cloning the socket"))?;
        let shared = Arc::new(ReceiverShared::default());
        let receiver = {
            let shared = Arc::clone(&shared);
            let resolver = Arc::clone(&resolver);
            let config = config.clone();
            std::thread::Builder::new()
                .name(format!("mscclpp-eth-rx-{}", config.remote_job_rank))
                .spawn(move || {
                    let failed = Arc::clone(&shared);
                    let ended = crate::process::guarded("mscclpp-eth-rx", move || {
                        let mut rx = Receiver {
                            stream: inc,
                            config,
                            resolver,
                            shared: Arc::clone(&shared),
                            pending_error: None,
                        };
                        if let Err(msg) = rx.run() {
                            tracing::error!(
                                "Ethernet receiver for rank {}: {msg}",
                                rx.config.remote_job_rank
                            );
                            if let Ok(mut f) = shared.failure.lock() {
                                f.get_or_insert(msg);
                            }
                        }
                    });
                    if ended.is_none() {
                        if let Ok(mut f) = failed.failure.lock() {
                            f.get_or_insert("the Ethernet receiver thread panicked (a bug)".into());
                        }
                    }
                })
                .map_err(|e| Error::io("spawning the Ethernet receiver thread", e))?
        };
        Ok(EthernetTransport {
            rank: config.rank,
            remote_rank: config.remote_rank,
            config: config.clone(),
            resolver,
            sender: Mutex::new(Sender {
                stream: out,
                seq: 0,
                staging: Vec::new(),
                broken: None,
            }),
            receiver_stream,
            receiver_shared: shared,
            receiver: Some(receiver),
        })
    }

    /// `Err(Error::Peer)` once the receiving direction failed (the peer died, or sent something we
    /// cannot accept). A clean close by the peer is not a failure.
    pub fn check_receiver(&self) -> Result<()> {
        match lock(&self.receiver_shared.failure, "Ethernet receiver")?.as_ref() {
            Some(msg) => Err(self.peer_error(msg.clone())),
            None => Ok(()),
        }
    }

    fn peer_error(&self, message: String) -> Error {
        Error::Peer {
            rank: self.config.remote_job_rank,
            message,
        }
    }

    /// Locks the sender and fails fast if it is already broken.
    fn sender(&self) -> Result<MutexGuard<'_, Sender>> {
        let s = lock(&self.sender, "Ethernet sender")?;
        if let Some(why) = &s.broken {
            return Err(self.peer_error(format!("Ethernet connection unusable: {why}")));
        }
        Ok(s)
    }

    /// Turns a socket failure into our error and marks the sender broken (the stream is out of
    /// sync after a partial frame).
    fn fail(&self, s: &mut Sender, doing: &str, e: io::Error) -> Error {
        let _ = s.stream.shutdown(Shutdown::Both);
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            s.broken = Some(format!("timed out {doing}"));
            Error::Timeout {
                what: format!(
                    "rank {} while {doing} over Ethernet",
                    self.config.remote_job_rank
                ),
                timeout: self.config.io_timeout,
            }
        } else {
            let msg = format!("connection lost while {doing}: {e}");
            s.broken = Some(msg.clone());
            self.peer_error(msg)
        }
    }
}

impl Transport for EthernetTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Ethernet
    }

    fn remote_rank(&self) -> usize {
        self.remote_rank
    }

    /// Streams the bytes into the socket and returns once the last chunk is handed to the kernel
    /// (it blocks while the socket buffer is full, bounded by `io_timeout`); `flush` waits until the
    /// peer has copied them.
    fn write(
        &self,
        dst: &MemoryRegion,
        dst_offset: u64,
        src: &MemoryRegion,
        src_offset: u64,
        bytes: u64,
    ) -> Result<()> {
        dst.check_range(dst_offset, bytes, "Ethernet write destination")?;
        src.check_range(src_offset, bytes, "Ethernet write source")?;
        let mut guard = self.sender()?;
        let s = &mut *guard;
        let chunk = self
            .config
            .chunk_size
            .min(usize::try_from(bytes).unwrap_or(usize::MAX));
        if s.staging.len() < chunk {
            s.staging.resize(chunk, 0);
        }
        // Stage the first chunk before the header goes out, so a bad source region fails cleanly
        // without leaving a half-sent frame.
        let first = chunk;
        self.resolver
            .read(src, src_offset, &mut s.staging[..first])?;
        s.seq += 1;
        let h = header(OP_WRITE, s.seq, dst, dst_offset, bytes);
        if let Err(e) = s.stream.write_all(&h) {
            return Err(self.fail(s, "sending a write header", e));
        }
        let mut done = 0u64;
        let mut staged = first;
        loop {
            if let Err(e) = s.stream.write_all(&s.staging[..staged]) {
                return Err(self.fail(s, "sending write payload", e));
            }
            done += staged as u64;
            if done == bytes {
                return Ok(());
            }
            staged = chunk.min(usize::try_from(bytes - done).unwrap_or(usize::MAX));
            if let Err(e) = self
                .resolver
                .read(src, src_offset + done, &mut s.staging[..staged])
            {
                // The frame is half sent; the connection cannot be resynchronised.
                let _ = s.stream.shutdown(Shutdown::Both);
                s.broken = Some(format!("source became unreadable mid-write: {e}"));
                return Err(e);
            }
        }
    }

    fn update_and_sync(&self, dst: &MemoryRegion, dst_offset: u64, new_value: u64) -> Result<()> {
        dst.check_range(dst_offset, 8, "Ethernet semaphore update")?;
        let mut guard = self.sender()?;
        let s = &mut *guard;
        s.seq += 1;
        let h = header(OP_SIGNAL, s.seq, dst, dst_offset, new_value);
        if let Err(e) = s.stream.write_all(&h) {
            return Err(self.fail(s, "sending a semaphore update", e));
        }
        Ok(())
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        let mut guard = self.sender()?;
        let s = &mut *guard;
        s.seq += 1;
        let seq = s.seq;
        if let Err(e) = s.stream.write_all(&header(OP_FLUSH, seq, &NO_REGION, 0, 0)) {
            return Err(self.fail(s, "sending a flush", e));
        }
        let deadline = Instant::now() + timeout;
        let mut reply = [0u8; REPLY_LEN];
        let mut filled = 0;
        while filled < REPLY_LEN {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                let _ = s.stream.shutdown(Shutdown::Both);
                s.broken =
                    Some("a flush timed out; its acknowledgement would arrive out of turn".into());
                return Err(Error::Timeout {
                    what: format!(
                        "rank {} to acknowledge an Ethernet flush",
                        self.config.remote_job_rank
                    ),
                    timeout,
                });
            }
            // set_read_timeout rejects zero; `remaining` is non-zero here.
            if let Err(e) = s.stream.set_read_timeout(Some(remaining)) {
                return Err(self.fail(s, "setting the flush timeout", e));
            }
            match s.stream.read(&mut reply[filled..]) {
                Ok(0) => {
                    let e = io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection",
                    );
                    return Err(self.fail(s, "waiting for a flush acknowledgement", e));
                }
                Ok(n) => filled += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(self.fail(s, "waiting for a flush acknowledgement", e)),
            }
        }
        let status = le_u32(&reply[0..4]);
        let len = le_u32(&reply[4..8]) as usize;
        let got = le_u64(&reply[8..16]);
        if got != seq || len > MAX_MESSAGE {
            let _ = s.stream.shutdown(Shutdown::Both);
            let msg = format!("flush acknowledgement out of order (sequence {got}, expected {seq}, message {len} bytes)");
            s.broken = Some(msg.clone());
            return Err(self.peer_error(msg));
        }
        let mut message = vec![0u8; len];
        if let Err(e) = s.stream.read_exact(&mut message) {
            return Err(self.fail(s, "reading a flush error message", e));
        }
        if status != 0 {
            return Err(self.peer_error(format!(
                "failed to apply our writes: {}",
                String::from_utf8_lossy(&message)
            )));
        }
        Ok(())
    }
}

impl Drop for EthernetTransport {
    fn drop(&mut self) {
        if let Ok(mut s) = self.sender.lock() {
            if s.broken.is_none() {
                // Best effort: tells the peer's receiver that the end of stream is a clean close.
                let seq = s.seq + 1;
                let _ = s.stream.write_all(&header(OP_CLOSE, seq, &NO_REGION, 0, 0));
            }
            let _ = s.stream.shutdown(Shutdown::Write);
        }
        self.receiver_shared.stop.store(true, Ordering::Release);
        let _ = self.receiver_stream.shutdown(Shutdown::Both);
        if let Some(t) = self.receiver.take() {
            // The receiver wakes within RECEIVER_TICK (or at once from the shutdown) and exits.
            let _ = t.join();
        }
    }
}

/// How a bounded read ended.
enum ReadEnd {
    Full,
    /// End of stream after this many bytes of the buffer.
    Eof(usize),
    Stopped,
}

/// The receiving half: applies the peer's frames in order on its own thread.
struct Receiver {
    stream: TcpStream,
    config: EthernetConfig,
    resolver: Arc<dyn MemoryResolver>,
    shared: Arc<ReceiverShared>,
    /// First failure applying a frame since the last flush; reported in the flush reply.
    pending_error: Option<String>,
}

impl Receiver {
    fn run(&mut self) -> std::result::Result<(), String> {
        let mut staging = vec![0u8; self.config.chunk_size];
        let mut h = [0u8; HEADER_LEN];
        loop {
            match self.read_full(&mut h, true)? {
                ReadEnd::Full => {}
                ReadEnd::Stopped => return Ok(()),
                ReadEnd::Eof(0) => {
                    return Err("connection closed without a goodbye (the peer died?)".into())
                }
                ReadEnd::Eof(n) => {
                    return Err(format!(
                        "connection closed mid-header after {n} of {HEADER_LEN} bytes"
                    ))
                }
            }
            let (op, key, seq) = (le_u32(&h[0..4]), le_u32(&h[4..8]), le_u64(&h[8..16]));
            let region = MemoryRegion {
                addr: le_u64(&h[16..24]),
                size: le_u64(&h[24..32]),
                key,
            };
            let (offset, arg) = (le_u64(&h[32..40]), le_u64(&h[40..48]));
            match op {
                OP_WRITE => self.receive_payload(&region, offset, arg, &mut staging)?,
                OP_SIGNAL => {
                    // Frames are applied in order on this thread, so every earlier write is
                    // complete; the release store publishes them with the value.
                    if let Err(e) = self.resolver.store_release(&region, offset, arg) {
                        self.note(format!("semaphore update (sequence {seq}): {e}"));
                    }
                }
                OP_FLUSH => self.reply(seq)?,
                OP_CLOSE => return Ok(()),
                other => {
                    return Err(format!(
                        "unknown frame op {other} (sequence {seq}): protocol violation"
                    ))
                }
            }
        }
    }

    fn note(&mut self, msg: String) {
        tracing::warn!(
            "Ethernet receiver for rank {}: {msg}",
            self.config.remote_job_rank
        );
        self.pending_error.get_or_insert(msg);
    }

    fn receive_payload(
        &mut self,
        region: &MemoryRegion,
        offset: u64,
        len: u64,
        staging: &mut [u8],
    ) -> std::result::Result<(), String> {
        let mut done = 0u64;
        let mut failed = false;
        while done < len {
            let n = staging
                .len()
                .min(usize::try_from(len - done).unwrap_or(usize::MAX));
            match self.read_full(&mut staging[..n], false)? {
                ReadEnd::Full => {}
                ReadEnd::Stopped => return Ok(()),
                ReadEnd::Eof(got) => {
                    return Err(format!(
                        "connection closed mid-write after {} of {len} bytes (the peer died?)",
                        done + got as u64
                    ))
                }
            }
            if !failed {
                if let Err(e) = self.resolver.write(region, offset + done, &staging[..n]) {
                    // Keep consuming the payload so the stream stays in sync; report at flush.
                    self.note(format!("write of {len} bytes: {e}"));
                    failed = true;
                }
            }
            done += n as u64;
        }
        Ok(())
    }

    fn reply(&mut self, seq: u64) -> std::result::Result<(), String> {
        let (status, msg) = match self.pending_error.take() {
            Some(m) => (1u32, m),
            None => (0, String::new()),
        };
        let mut bytes = msg.into_bytes();
        bytes.truncate(MAX_MESSAGE);
        let mut out = Vec::with_capacity(REPLY_LEN + bytes.len());
        out.extend_from_slice(&status.to_le_bytes());
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&bytes);
        self.stream
            .write_all(&out)
            .map_err(|e| format!("sending a flush acknowledgement: {e}"))
    }

    /// Fills `buf`. Between frames (`idle_ok`) the connection may stay silent forever; inside a
    /// frame, `io_timeout` without progress is an error.
    fn read_full(&mut self, buf: &mut [u8], idle_ok: bool) -> std::result::Result<ReadEnd, String> {
        let mut filled = 0;
        let mut last_progress = Instant::now();
        while filled < buf.len() {
            match self.stream.read(&mut buf[filled..]) {
                Ok(0) => {
                    if self.shared.stop.load(Ordering::Acquire) {
                        return Ok(ReadEnd::Stopped);
                    }
                    return Ok(ReadEnd::Eof(filled));
                }
                Ok(n) => {
                    filled += n;
                    last_progress = Instant::now();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if self.shared.stop.load(Ordering::Acquire) {
                        return Ok(ReadEnd::Stopped);
                    }
                    if !(idle_ok && filled == 0)
                        && last_progress.elapsed() >= self.config.io_timeout
                    {
                        return Err(format!(
                            "no data for {:?} in the middle of a frame ({filled} of {} bytes)",
                            self.config.io_timeout,
                            buf.len()
                        ));
                    }
                }
                Err(e) => {
                    if self.shared.stop.load(Ordering::Acquire) {
                        return Ok(ReadEnd::Stopped);
                    }
                    return Err(format!("reading from the connection: {e}"));
                }
            }
        }
        Ok(ReadEnd::Full)
    }
}
