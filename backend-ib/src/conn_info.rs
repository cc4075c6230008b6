//! What two ends of an RC queue pair tell each other to connect, little endian.
//!
//! [`IbConnInfo`], 48 bytes: `magic[8] rank:u32 remote_rank:u32 qpn:u32 psn:u32 lid:u16 port:u8
//! link_layer:u8 mtu:u8 no_atomic:u8 reserved[2] gid[16]`
//!
//! [`MemoryTable`], the memory each end registered with its HCA, so that writes name peer memory
//! by address and the transport adds the key: `magic[8] rank:u32 remote_rank:u32 count:u32
//! reserved:u32`, then `count` entries of `addr:u64 size:u64 rkey:u32 reserved:u32`.
//!
//! `rank` is the sender, `remote_rank` whom it is for, so a message delivered to the wrong rank is
//! caught. `no_atomic` says the sender needs write-with-immediate signalling (its mode or HCA); the
//! connection then uses it in both directions, since the receiving end must post receives for it.

use mscclpp_core::transport::MemoryRegion;
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

/// Magic and version of the memory table.
pub const MEMORY_TABLE_MAGIC: [u8; 8] = *b"MSCLIBMT";
const TABLE_HEADER: usize = 24;
const TABLE_ENTRY: usize = 24;

/// One end's registered memory as the other end addresses it: each region's address in the
/// owner's process, size and rkey.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryTable {
    pub rank: u32,
    pub remote_rank: u32,
    pub regions: Vec<MemoryRegion>,
}

impl MemoryTable {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(TABLE_HEADER + TABLE_ENTRY * self.regions.len());
        b.extend_from_slice(&MEMORY_TABLE_MAGIC);
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&self.remote_rank.to_le_bytes());
        b.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        for r in &self.regions {
            b.extend_from_slice(&r.addr.to_le_bytes());
            b.extend_from_slice(&r.size.to_le_bytes());
            b.extend_from_slice(&r.key.to_le_bytes());
            b.extend_from_slice(&[0; 4]);
        }
        b
    }

    /// Decodes and validates the table rank `from` sent to rank `to`.
    pub fn decode(bytes: &[u8], from: usize, to: usize) -> Result<MemoryTable> {
        let bad = |why: String| Error::Peer {
            rank: from,
            message: format!("invalid IB memory table: {why}"),
        };
        if bytes.len() < TABLE_HEADER || bytes[0..8] != MEMORY_TABLE_MAGIC {
            return Err(bad(format!(
                "{} bytes without the {:?} header (another version, or out of step)",
                bytes.len(),
                String::from_utf8_lossy(&MEMORY_TABLE_MAGIC)
            )));
        }
        let u32_at =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | (u64::from(u32_at(i + 4)) << 32);
        let (rank, remote_rank, count) = (u32_at(8), u32_at(12), u32_at(16) as usize);
        if (rank as usize, remote_rank as usize) != (from, to) {
            return Err(bad(format!(
                "sent by rank {rank} for rank {remote_rank}, expected {from} for {to}"
            )));
        }
        if bytes.len() != TABLE_HEADER + TABLE_ENTRY * count {
            return Err(bad(format!(
                "{} bytes for {count} regions, expected {}",
                bytes.len(),
                TABLE_HEADER + TABLE_ENTRY * count
            )));
        }
        let regions = (0..count)
            .map(|i| {
                let at = TABLE_HEADER + TABLE_ENTRY * i;
                MemoryRegion {
                    addr: u64_at(at),
                    size: u64_at(at + 8),
                    key: u32_at(at + 16),
                }
            })
            .collect();
        Ok(MemoryTable {
            rank,
            remote_rank,
            regions,
        })
    }
}

/// `region` with the key of the entry of `table` that holds `[region.addr + offset, +bytes)`, or
/// `None` if no entry holds all of it.
pub fn with_key(
    table: impl IntoIterator<Item = MemoryRegion>,
    region: &MemoryRegion,
    offset: u64,
    bytes: u64,
) -> Option<MemoryRegion> {
    let start = region.addr.checked_add(offset)?;
    let end = start.checked_add(bytes)?;
    table
        .into_iter()
        .find(|e| e.addr <= start && e.addr.checked_add(e.size).is_some_and(|e_end| end <= e_end))
        .map(|e| MemoryRegion {
            key: e.key,
            ..*region
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn table() -> MemoryTable {
        MemoryTable {
            rank: 4,
            remote_rank: 0,
            regions: vec![
                MemoryRegion {
                    addr: 0x7f00_0000_0000,
                    size: 1 << 21,
                    key: 0xdead_beef,
                },
                MemoryRegion {
                    addr: 0x7f00_1000_0000,
                    size: 8 * 4096,
                    key: 7,
                },
            ],
        }
    }

    #[test]
    fn memory_table_round_trip() {
        let b = table().encode();
        assert_eq!(b.len(), 24 + 2 * 24);
        assert_eq!(MemoryTable::decode(&b, 4, 0).unwrap(), table());
        let empty = MemoryTable {
            regions: vec![],
            ..table()
        };
        assert_eq!(MemoryTable::decode(&empty.encode(), 4, 0).unwrap(), empty);
    }

    #[rstest]
    #[case(|b: &mut Vec<u8>| { b.truncate(10); }, 4, "10 bytes without")]
    #[case(|b: &mut Vec<u8>| { b[0] = b'X'; }, 4, "header")]
    #[case(|b: &mut Vec<u8>| { b.pop(); }, 4, "71 bytes for 2 regions, expected 72")]
    #[case(|_: &mut Vec<u8>| {}, 5, "sent by rank 4 for rank 0, expected 5 for 0")]
    fn memory_table_rejects(
        #[case] corrupt: fn(&mut Vec<u8>),
        #[case] from: usize,
        #[case] text: &str,
    ) {
        let mut b = table().encode();
        corrupt(&mut b);
        match MemoryTable::decode(&b, from, 0) {
            Err(Error::Peer { rank, message }) => {
                assert_eq!(rank, from);
                assert!(message.contains(text), "{message}");
            }
            other => panic!("expected a Peer error, got {other:?}"),
        }
    }

    /// Keys come from the entry holding the whole accessed range; a range that leaves it (or
    /// lies in no entry) gets none.
    #[rstest]
    #[case(0x7f00_0000_0000, 0, 1 << 21, Some(0xdead_beef))]
    #[case(0x7f00_0000_0000, (1 << 21) - 8, 8, Some(0xdead_beef))]
    #[case(0x7f00_0000_0000, (1 << 21) - 8, 16, None)]
    #[case(0x7f00_1000_0000, 8 * 100, 8, Some(7))]
    #[case(0x1000, 0, 8, None)]
    #[case(u64::MAX, 8, 8, None)]
    fn keys_by_address(
        #[case] addr: u64,
        #[case] offset: u64,
        #[case] bytes: u64,
        #[case] key: Option<u32>,
    ) {
        let region = MemoryRegion {
            addr,
            size: 1 << 40,
            key: 0,
        };
        let got = with_key(table().regions, &region, offset, bytes);
        assert_eq!(got.map(|r| r.key), key);
        if let Some(r) = got {
            assert_eq!((r.addr, r.size), (addr, region.size));
        }
    }

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
