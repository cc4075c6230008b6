//! What two ends of an RC queue pair tell each other to connect: 48 bytes, little endian.
//!
//! `magic[8] rank:u32 remote_rank:u32 qpn:u32 psn:u32 lid:u16 port:u8 link_layer:u8 mtu:u8
//! no_atomic:u8 reserved[2] gid[16]`
//!
//! `rank` is the sender, `remote_rank` whom it is for, so a message delivered to the wrong rank is
//! caught. `no_atomic` says the sender needs write-with-immediate signalling (its mode or HCA); the
//! connection then uses it in both directions, since the receiving end must post receives for it.

use mscclpp_core::{Error, Result};

/// Magic and version of the format.
pub const CONN_INFO_MAGIC: [u8; 8] = *b"MSCLIBV1";
/// Encoded length.
pub const CONN_INFO_LEN: usize = 48;

/// One end's queue pair and port as the other end needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IbConnInfo {
    pub rank: u32,
    pub remote_rank: u32,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    pub lid: u16,
    pub port: u8,
    /// `IBV_LINK_LAYER_*`.
    pub link_layer: u8,
    /// `enum ibv_mtu` (1 = 256 ... 5 = 4096).
    pub mtu: u8,
    pub no_atomic: bool,
    pub gid: [u8; 16],
}

impl IbConnInfo {
    pub fn encode(&self) -> [u8; CONN_INFO_LEN] {
        let mut b = [0u8; CONN_INFO_LEN];
        b[0..8].copy_from_slice(&CONN_INFO_MAGIC);
        b[8..12].copy_from_slice(&self.rank.to_le_bytes());
        b[12..16].copy_from_slice(&self.remote_rank.to_le_bytes());
        b[16..20].copy_from_slice(&self.qpn.to_le_bytes());
        b[20..24].copy_from_slice(&self.psn.to_le_bytes());
        b[24..26].copy_from_slice(&self.lid.to_le_bytes());
        b[26] = self.port;
        b[27] = self.link_layer;
        b[28] = self.mtu;
        b[29] = u8::from(self.no_atomic);
        b[32..48].copy_from_slice(&self.gid);
        b
    }

    /// Decodes and validates a peer's message; `from` names the peer in errors.
    pub fn decode(bytes: &[u8], from: usize) -> Result<IbConnInfo> {
        let bad = |why: String| Error::Peer {
            rank: from,
            message: format!("invalid IB connection info: {why}"),
        };
        if bytes.len() != CONN_INFO_LEN {
            return Err(bad(format!(
                "{} bytes, expected {CONN_INFO_LEN}",
                bytes.len()
            )));
        }
        if bytes[0..8] != CONN_INFO_MAGIC {
            return Err(bad(
                "wrong magic (not mscclpp-rs IB connection info, or another version)".into(),
            ));
        }
        let u32_at =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&bytes[32..48]);
        let info = IbConnInfo {
            rank: u32_at(8),
            remote_rank: u32_at(12),
            qpn: u32_at(16),
            psn: u32_at(20),
            lid: u16::from_le_bytes([bytes[24], bytes[25]]),
            port: bytes[26],
            link_layer: bytes[27],
            mtu: bytes[28],
            no_atomic: match bytes[29] {
                0 => false,
                1 => true,
                other => return Err(bad(format!("no_atomic flag {other}"))),
            },
            gid,
        };
        if info.qpn >= 1 << 24 || info.psn >= 1 << 24 {
            return Err(bad(format!(
                "QPN {:#x} / PSN {:#x} exceed 24 bits",
                info.qpn, info.psn
            )));
        }
        if !(1..=5).contains(&info.mtu) {
            return Err(bad(format!("MTU enum {} outside 1..=5", info.mtu)));
        }
        if info.port == 0 {
            return Err(bad("port 0".into()));
        }
        Ok(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn sample() -> IbConnInfo {
        IbConnInfo {
            rank: 3,
            remote_rank: 7,
            qpn: 0x00ab_cdef,
            psn: 0x12_3456,
            lid: 0x1234,
            port: 1,
            link_layer: 2,
            mtu: 5,
            no_atomic: true,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 168, 1, 2],
        }
    }

    #[test]
    fn round_trip() {
        let b = sample().encode();
        assert_eq!(b.len(), CONN_INFO_LEN);
        assert_eq!(&b[0..8], b"MSCLIBV1");
        assert_eq!(IbConnInfo::decode(&b, 7).unwrap(), sample());
    }

    #[rstest]
    #[case(|b: &mut Vec<u8>| { b.pop(); }, "47 bytes")]
    #[case(|b: &mut Vec<u8>| { b[0] = b'X'; }, "wrong magic")]
    #[case(|b: &mut Vec<u8>| { b[19] = 1; }, "exceed 24 bits")]
    #[case(|b: &mut Vec<u8>| { b[28] = 6; }, "MTU enum 6")]
    #[case(|b: &mut Vec<u8>| { b[29] = 2; }, "no_atomic flag 2")]
    #[case(|b: &mut Vec<u8>| { b[26] = 0; }, "port 0")]
    fn rejects(#[case] corrupt: fn(&mut Vec<u8>), #[case] text: &str) {
        let mut b = sample().encode().to_vec();
        corrupt(&mut b);
        match IbConnInfo::decode(&b, 7) {
            Err(Error::Peer { rank: 7, message }) => assert!(message.contains(text), "{message}"),
            other => panic!("expected a Peer error naming rank 7, got {other:?}"),
        }
    }
}
