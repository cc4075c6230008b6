//! The `UniqueId`: the 128 bytes rank 0 creates and every rank needs to join a job.
//!
//! Layout (fixed, so the NCCL shim can store it in an `ncclUniqueId`, which is 128 bytes):
//!
//! | bytes    | field                                                      |
//! |----------|------------------------------------------------------------|
//! | 0..8     | magic `MSCLPPRS`                                            |
//! | 8..10    | layout version (u16 LE)                                    |
//! | 10..16   | reserved, zero                                             |
//! | 16..40   | root's socket address (family, port, scope id, 16 IP bytes) |
//! | 40..56   | random 16-byte job secret                                  |
//! | 56..120  | reserved, zero                                             |
//! | 120..128 | FNV-1a 64 checksum of bytes 0..120 (LE)                    |
//!
//! The checksum catches ids mangled in transit (truncated env vars, wrong copies) with a clear
//! error instead of a connection to a random port.

use super::wire::{decode_addr, encode_addr, Secret, ADDR_LEN, MAGIC, SECRET_LEN};
use crate::error::{Error, Result};
use serde::de::{self, Deserializer, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

/// Layout version of the UniqueId bytes (independent of the wire protocol version).
const ID_VERSION: u16 = 1;
const ADDR_AT: usize = 16;
const SECRET_AT: usize = ADDR_AT + ADDR_LEN;
const RESERVED_AT: usize = SECRET_AT + SECRET_LEN;
const CHECKSUM_AT: usize = 120;

/// Identifies one bootstrap job: where its root listens and the secret its ranks share.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct UniqueId {
    root: SocketAddr,
    secret: Secret,
}

impl UniqueId {
    /// Size of the byte form: exactly an `ncclUniqueId`.
    pub const BYTES: usize = 128;

    /// An id for a root at `root` with the given secret (the constructors of `TcpBootstrap` build
    /// these; use `TcpBootstrap::create_unique_id` to start a job).
    pub fn from_parts(root: SocketAddr, secret: Secret) -> Self {
        UniqueId { root, secret }
    }

    /// The address the root (rank 0) listens on.
    pub fn root_addr(&self) -> SocketAddr {
        self.root
    }

    pub(crate) fn secret(&self) -> &Secret {
        &self.secret
    }

    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&ID_VERSION.to_le_bytes());
        b[ADDR_AT..SECRET_AT].copy_from_slice(&encode_addr(&self.root));
        b[SECRET_AT..RESERVED_AT].copy_from_slice(&self.secret);
        let sum = fnv1a64(&b[..CHECKSUM_AT]);
        b[CHECKSUM_AT..].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Parses the byte form. Malformed input gives `Error::Bootstrap` saying what is wrong
    /// (length, magic, version, checksum, reserved bytes, address).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bad = |why: String| Error::Bootstrap(format!("malformed UniqueId: {why}"));
        if bytes.len() != Self::BYTES {
            return Err(bad(format!(
                "{} bytes, expected {}",
                bytes.len(),
                Self::BYTES
            )));
        }
        if bytes[0..8] != MAGIC {
            return Err(bad(
                "bad magic (not an mscclpp-rs UniqueId, or created by another library)".into(),
            ));
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != ID_VERSION {
            return Err(bad(format!(
                "layout version {version}, this build reads version {ID_VERSION}"
            )));
        }
        let stored = u64::from_le_bytes(
            bytes[CHECKSUM_AT..]
                .try_into()
                .map_err(|_| bad("checksum field".into()))?,
        );
        let computed = fnv1a64(&bytes[..CHECKSUM_AT]);
        if stored != computed {
            return Err(bad(format!(
                "checksum mismatch (stored {stored:#018x}, computed {computed:#018x}): the id \
                 was corrupted or truncated in transit"
            )));
        }
        if bytes[10..ADDR_AT]
            .iter()
            .chain(&bytes[RESERVED_AT..CHECKSUM_AT])
            .any(|&x| x != 0)
        {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let mut addr = [0u8; ADDR_LEN];
        addr.copy_from_slice(&bytes[ADDR_AT..SECRET_AT]);
        let root = decode_addr(&addr).map_err(|e| bad(format!("root address: {e}")))?;
        let mut secret = [0u8; SECRET_LEN];
        secret.copy_from_slice(&bytes[SECRET_AT..RESERVED_AT]);
        Ok(UniqueId { root, secret })
    }

    /// Lower-case hex of the 128 bytes (256 characters): the form for env vars and JSON.
    pub fn to_hex(&self) -> String {
        hex::encode(self.to_bytes())
    }

    /// Parses [`to_hex`](Self::to_hex)'s form.
    pub fn from_hex(s: &str) -> Result<Self> {
        let bytes = hex::decode(s.trim())
            .map_err(|e| Error::Bootstrap(format!("malformed UniqueId hex string: {e}")))?;
        Self::from_bytes(&bytes)
    }
}

/// FNV-1a, 64-bit: a checksum against accidental corruption, not an integrity guarantee.
fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Shows the root address only: the secret must not end up in logs.
impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "mscclpp-rs bootstrap root {}", self.root)
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId")
            .field("root", &self.root)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl FromStr for UniqueId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::from_hex(s)
    }
}

/// Human-readable formats (JSON, YAML) get the hex string; binary formats get the 128 bytes.
impl Serialize for UniqueId {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&self.to_hex())
        } else {
            s.serialize_bytes(&self.to_bytes())
        }
    }
}

impl<'de> Deserialize<'de> for UniqueId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct IdVisitor;
        impl<'de> Visitor<'de> for IdVisitor {
            type Value = UniqueId;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a 128-byte UniqueId as bytes or a 256-character hex string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<UniqueId, E> {
                UniqueId::from_hex(v).map_err(E::custom)
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> std::result::Result<UniqueId, E> {
                UniqueId::from_bytes(v).map_err(E::custom)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<UniqueId, A::Error> {
                let mut bytes = Vec::with_capacity(UniqueId::BYTES);
                while let Some(b) = seq.next_element::<u8>()? {
                    if bytes.len() > UniqueId::BYTES {
                        break;
                    }
                    bytes.push(b);
                }
                UniqueId::from_bytes(&bytes).map_err(de::Error::custom)
            }
        }
        if d.is_human_readable() {
            d.deserialize_str(IdVisitor)
        } else {
            d.deserialize_bytes(IdVisitor)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> UniqueId {
        UniqueId::from_parts("[::1]:29501".parse().unwrap(), [0xab; SECRET_LEN])
    }

    #[test]
    fn bytes_round_trip() {
        let id = sample();
        let b = id.to_bytes();
        assert_eq!(b.len(), 128);
        assert_eq!(UniqueId::from_bytes(&b).unwrap(), id);
    }

    #[test]
    fn json_round_trip_and_display_hides_secret() {
        let id = sample();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(serde_json::from_str::<UniqueId>(&json).unwrap(), id);
        let shown = format!("{id} {id:?}");
        assert!(shown.contains("[::1]:29501"));
        assert!(!shown.contains("abab"), "secret leaked: {shown}");
    }

    #[test]
    fn corrupt_bytes_are_named() {
        let id = sample();
        let mut b = id.to_bytes();
        b[SECRET_AT] ^= 1;
        let e = UniqueId::from_bytes(&b).unwrap_err().to_string();
        assert!(e.contains("checksum"), "{e}");
        let e = UniqueId::from_bytes(&b[..100]).unwrap_err().to_string();
        assert!(e.contains("100 bytes, expected 128"), "{e}");
        let e = UniqueId::from_bytes(&[0u8; 128]).unwrap_err().to_string();
        assert!(e.contains("magic"), "{e}");
    }
}
