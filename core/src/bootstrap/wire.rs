//! Byte layouts on the bootstrap's sockets: socket addresses, handshakes, message frames and the
//! root's reply, plus the blocking read/write helpers that turn socket timeouts into our errors.
//!
//! Everything is little-endian except ports, which travel in network order as they do in
//! `sockaddr`. Fixed layouts (no serde) keep the handshake small and let a reader reject garbage
//! after a handful of bytes, before it allocates anything.

use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpStream};
use std::time::{Duration, Instant};

/// Leads every handshake and the [`UniqueId`](super::UniqueId): "MSCLPPRS".
pub(crate) const MAGIC: [u8; 8] = *b"MSCLPPRS";
/// Bumped whenever a layout in this file, or the collectives' message layout (collectives.rs),
/// changes; both ends must agree. 3: collective messages lead with the collective they belong to.
pub(crate) const PROTOCOL_VERSION: u16 = 3;
/// Length of the per-job secret carried by the UniqueId and every handshake.
pub const SECRET_LEN: usize = 16;
/// The per-job secret: random for a UniqueId, derived from the address for `ip:port` bootstraps.
pub type Secret = [u8; SECRET_LEN];

/// An encoded socket address: family (4 or 6), reserved, port (big-endian), IPv6 scope id,
/// 16 address bytes (IPv4 uses the first four).
pub(crate) const ADDR_LEN: usize = 24;

pub(crate) fn encode_addr(addr: &SocketAddr) -> [u8; ADDR_LEN] {
    let mut out = [0u8; ADDR_LEN];
    out[2..4].copy_from_slice(&addr.port().to_be_bytes());
    match addr {
        SocketAddr::V4(a) => {
            out[0] = 4;
            out[8..12].copy_from_slice(&a.ip().octets());
        }
        SocketAddr::V6(a) => {
            out[0] = 6;
            out[4..8].copy_from_slice(&a.scope_id().to_le_bytes());
            out[8..24].copy_from_slice(&a.ip().octets());
        }
    }
    out
}

/// Decodes [`encode_addr`]'s layout; the error says which field is wrong.
pub(crate) fn decode_addr(b: &[u8; ADDR_LEN]) -> std::result::Result<SocketAddr, String> {
    let port = u16::from_be_bytes([b[2], b[3]]);
    if port == 0 {
        return Err("socket address has port 0".into());
    }
    if b[1] != 0 {
        return Err(format!(
            "socket address reserved byte is {:#04x}, expected 0",
            b[1]
        ));
    }
    match b[0] {
        4 => {
            if b[4..8].iter().chain(&b[12..24]).any(|&x| x != 0) {
                return Err("IPv4 socket address has non-zero bytes in unused fields".into());
            }
            let ip = Ipv4Addr::new(b[8], b[9], b[10], b[11]);
            Ok(SocketAddr::V4(SocketAddrV4::new(ip, port)))
        }
        6 => {
            let scope = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let mut ip = [0u8; 16];
            ip.copy_from_slice(&b[8..24]);
            Ok(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(ip),
                port,
                0,
                scope,
            )))
        }
        other => Err(format!(
            "socket address family byte is {other}, expected 4 or 6"
        )),
    }
}

/// Compares secrets without an early exit, so response timing does not leak how many leading
/// bytes a guess got right.
pub(crate) fn secrets_equal(a: &Secret, b: &Secret) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What a connection is for; the first byte after magic and version in a [`Hello`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HelloKind {
    /// A rank registering its listening address with the root.
    Root = 1,
    /// A rank opening its sending connection to a peer (or the peer's answer).
    Peer = 2,
}

/// The handshake every connection starts with, in both directions of a peer link: it proves the
/// sender holds the job secret and says which rank it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub kind: HelloKind,
    pub secret: Secret,
    pub rank: u32,
    pub size: u32,
    /// The sender's listening address (Root hellos); the unspecified address otherwise.
    pub listen: SocketAddr,
}

impl Hello {
    pub const LEN: usize = 8 + 2 + 1 + 1 + SECRET_LEN + 4 + 4 + ADDR_LEN;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0..8].copy_from_slice(&MAGIC);
        out[8..10].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out[10] = self.kind as u8;
        out[12..28].copy_from_slice(&self.secret);
        out[28..32].copy_from_slice(&self.rank.to_le_bytes());
        out[32..36].copy_from_slice(&self.size.to_le_bytes());
        out[36..60].copy_from_slice(&encode_addr(&self.listen));
        out
    }

    /// Parses a hello; the error (logged by the acceptor) says what was wrong with it. The secret
    /// is returned as-is: the caller compares it, so that it can log a mismatch distinctly.
    pub fn decode(b: &[u8; Self::LEN]) -> std::result::Result<Hello, String> {
        if b[0..8] != MAGIC {
            return Err("not an mscclpp-rs bootstrap handshake (bad magic)".into());
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != PROTOCOL_VERSION {
            return Err(format!(
                "bootstrap protocol version {version}, this build speaks {PROTOCOL_VERSION}"
            ));
        }
        let kind = match b[10] {
            1 => HelloKind::Root,
            2 => HelloKind::Peer,
            k => return Err(format!("unknown handshake kind {k}")),
        };
        let mut secret = [0u8; SECRET_LEN];
        secret.copy_from_slice(&b[12..28]);
        let rank = u32::from_le_bytes([b[28], b[29], b[30], b[31]]);
        let size = u32::from_le_bytes([b[32], b[33], b[34], b[35]]);
        let mut addr = [0u8; ADDR_LEN];
        addr.copy_from_slice(&b[36..60]);
        let listen = match kind {
            HelloKind::Root => decode_addr(&addr)?,
            HelloKind::Peer => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        };
        Ok(Hello {
            kind,
            secret,
            rank,
            size,
            listen,
        })
    }
}

/// What a frame on a peer link carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum FrameKind {
    /// A user `send` under the user's tag.
    User = 0,
    /// Internal traffic of a collective; the tag is the collective's sequence number, the
    /// payload leads with which collective it is (collectives.rs).
    Collective = 1,
    /// The sender is shutting down its bootstrap cleanly: not a failure.
    Goodbye = 2,
    /// A collective failed somewhere; payload = origin rank (u32) + reason (UTF-8).
    Abort = 3,
    /// Liveness question; the tag is a nonce the receiver echoes in its `Pong`.
    Ping = 4,
    /// Liveness answer, sent by the reader thread (so a rank busy in a device wait still answers).
    Pong = 5,
    /// "Still here": sent to the ring successor every few hundred milliseconds by a thread of
    /// its own, so a stopped or hung process is told from a busy one (tcp.rs, Liveness).
    Heartbeat = 6,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<FrameKind> {
        match v {
            0 => Some(FrameKind::User),
            1 => Some(FrameKind::Collective),
            2 => Some(FrameKind::Goodbye),
            3 => Some(FrameKind::Abort),
            4 => Some(FrameKind::Ping),
            5 => Some(FrameKind::Pong),
            6 => Some(FrameKind::Heartbeat),
            _ => None,
        }
    }
}

/// Frame header: kind (1 byte), tag (8), payload length (8).
pub(crate) const FRAME_HEADER_LEN: usize = 17;

/// Payloads up to this size are copied behind the header and written with one syscall (one TCP
/// segment with TCP_NODELAY); larger ones are written in place to avoid the copy.
const COALESCE_LIMIT: usize = 64 * 1024;

/// Writes one frame. The caller holds the connection's lock so frames never interleave.
pub(crate) fn write_frame(
    stream: &mut TcpStream,
    kind: FrameKind,
    tag: u64,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    header[0] = kind as u8;
    header[1..9].copy_from_slice(&tag.to_le_bytes());
    header[9..17].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    if payload.len() <= COALESCE_LIMIT {
        let mut buf = Vec::with_capacity(FRAME_HEADER_LEN + payload.len());
        buf.extend_from_slice(&header);
        buf.extend_from_slice(payload);
        stream.write_all(&buf)
    } else {
        stream.write_all(&header)?;
        stream.write_all(payload)
    }
}

/// Outcome of reading one frame from a peer link.
pub(crate) enum FrameRead {
    Frame {
        kind: FrameKind,
        tag: u64,
        payload: Vec<u8>,
    },
    /// The peer closed the connection at a frame boundary.
    Closed,
}

/// Reads one frame (blocking). Errors are described for the log and the peer's error message.
pub(crate) fn read_frame(stream: &mut TcpStream) -> std::result::Result<FrameRead, String> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    // A clean close shows up as EOF before the first header byte.
    let mut got = 0;
    while got < FRAME_HEADER_LEN {
        match stream.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Ok(FrameRead::Closed),
            Ok(0) => return Err("connection closed in the middle of a frame header".into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading a frame header failed: {e}")),
        }
    }
    let kind = FrameKind::from_u8(header[0])
        .ok_or_else(|| format!("unknown frame kind {} (stream corrupt)", header[0]))?;
    let tag = u64::from_le_bytes(header[1..9].try_into().map_err(|_| "frame tag")?);
    let len = u64::from_le_bytes(header[9..17].try_into().map_err(|_| "frame length")?);
    let len = usize::try_from(len).map_err(|_| format!("frame length {len} does not fit"))?;
    let mut payload = Vec::new();
    // try_reserve: a corrupt length must become an error, not an allocation abort.
    payload
        .try_reserve_exact(len)
        .map_err(|e| format!("cannot allocate {len} bytes for a frame: {e}"))?;
    payload.resize(len, 0);
    stream
        .read_exact(&mut payload)
        .map_err(|e| format!("reading a {len}-byte frame payload failed: {e}"))?;
    Ok(FrameRead::Frame { kind, tag, payload })
}

/// True for the error kinds a socket timeout produces (`EAGAIN` on Linux, `ETIMEDOUT` elsewhere).
pub(crate) fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Time left until `deadline`, at least 1 ms: `set_read_timeout(Some(0))` is an error.
pub(crate) fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// Reads exactly `buf.len()` bytes before `deadline`. `what` describes the awaited data for the
/// error; `rank` is the peer blamed when the connection closes.
pub(crate) fn read_exact_until(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    timeout: Duration,
    rank: usize,
    what: &str,
) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: what.to_string(),
                timeout,
            });
        }
        stream
            .set_read_timeout(Some(remaining(deadline)))
            .map_err(|e| Error::io(format!("setting a read timeout for {what}"), e))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(Error::Peer {
                    rank,
                    message: format!("connection closed while waiting for {what}"),
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {}
            Err(e) => {
                return Err(Error::Peer {
                    rank,
                    message: format!("reading {what} failed: {e}"),
                })
            }
        }
    }
    Ok(())
}

/// The root's answer to a rank's Root hello: either every rank's listening address, or the reason
/// the job cannot start (a rank did not join, a duplicate rank, a size mismatch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RootReply {
    Table(Vec<SocketAddr>),
    /// `missing`: ranks that never joined (empty when the failure is something else).
    Failed {
        missing: Vec<u32>,
        message: String,
    },
}

impl RootReply {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            RootReply::Table(addrs) => {
                out.push(0);
                out.extend_from_slice(&(addrs.len() as u32).to_le_bytes());
                for a in addrs {
                    out.extend_from_slice(&encode_addr(a));
                }
            }
            RootReply::Failed { missing, message } => {
                out.push(1);
                out.extend_from_slice(&(missing.len() as u32).to_le_bytes());
                for r in missing {
                    out.extend_from_slice(&r.to_le_bytes());
                }
                out.extend_from_slice(&(message.len() as u32).to_le_bytes());
                out.extend_from_slice(message.as_bytes());
            }
        }
        out
    }

    /// Reads a reply from the root (rank 0) before `deadline`; `size` bounds the table length so a
    /// corrupt count cannot make us allocate without limit.
    pub fn read(
        stream: &mut TcpStream,
        size: usize,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<RootReply> {
        let what = "the peer table from the bootstrap root (rank 0)";
        let mut head = [0u8; 5];
        read_exact_until(stream, &mut head, deadline, timeout, 0, what)?;
        let count = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
        let corrupt = |why: String| Error::Bootstrap(format!("root (rank 0) sent {why}"));
        match head[0] {
            0 => {
                if count != size {
                    return Err(corrupt(format!(
                        "a table of {count} ranks, expected {size}"
                    )));
                }
                let mut addrs = Vec::with_capacity(count);
                for r in 0..count {
                    let mut a = [0u8; ADDR_LEN];
                    read_exact_until(stream, &mut a, deadline, timeout, 0, what)?;
                    addrs.push(
                        decode_addr(&a)
                            .map_err(|e| corrupt(format!("a bad address for rank {r}: {e}")))?,
                    );
                }
                Ok(RootReply::Table(addrs))
            }
            1 => {
                if count > size {
                    return Err(corrupt(format!("{count} missing ranks out of {size}")));
                }
                let mut missing = Vec::with_capacity(count);
                for _ in 0..count {
                    let mut r = [0u8; 4];
                    read_exact_until(stream, &mut r, deadline, timeout, 0, what)?;
                    missing.push(u32::from_le_bytes(r));
                }
                let mut len = [0u8; 4];
                read_exact_until(stream, &mut len, deadline, timeout, 0, what)?;
                let len = (u32::from_le_bytes(len) as usize).min(64 * 1024);
                let mut msg = vec![0u8; len];
                read_exact_until(stream, &mut msg, deadline, timeout, 0, what)?;
                Ok(RootReply::Failed {
                    missing,
                    message: String::from_utf8_lossy(&msg).into_owned(),
                })
            }
            s => Err(corrupt(format!("an unknown reply status {s}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addr_round_trip() {
        for a in [
            "127.0.0.1:29500",
            "[::1]:1234",
            "[fe80::1%3]:80",
            "10.1.2.3:65535",
        ] {
            let addr: SocketAddr = a.parse().unwrap();
            assert_eq!(decode_addr(&encode_addr(&addr)).unwrap(), addr, "{a}");
        }
    }

    #[test]
    fn addr_rejects_bad_family_and_port() {
        let mut b = encode_addr(&"127.0.0.1:1".parse().unwrap());
        b[0] = 5;
        assert!(decode_addr(&b).unwrap_err().contains("family"));
        let b = encode_addr(&"127.0.0.1:0".parse().unwrap());
        assert!(decode_addr(&b).unwrap_err().contains("port 0"));
    }

    #[test]
    fn hello_round_trip_and_magic() {
        let h = Hello {
            kind: HelloKind::Root,
            secret: [7; SECRET_LEN],
            rank: 3,
            size: 8,
            listen: "127.0.0.1:4000".parse().unwrap(),
        };
        let mut b = h.encode();
        assert_eq!(Hello::decode(&b).unwrap(), h);
        b[0] = b'X';
        assert!(Hello::decode(&b).unwrap_err().contains("magic"));
    }

    #[test]
    fn secrets_compare() {
        assert!(secrets_equal(&[1; 16], &[1; 16]));
        let mut b = [1; 16];
        b[15] = 2;
        assert!(!secrets_equal(&[1; 16], &b));
    }
}
