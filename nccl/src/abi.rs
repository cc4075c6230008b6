//! The NCCL 2.28 ABI as Rust types: result codes, the 128-byte unique id, `ncclConfig_t` and
//! `ncclSimInfo_t` with their magic numbers, and the version we implement. `include/nccl.h` is
//! the same ABI for C; the layout test below keeps the two in step.

use std::ffi::{c_char, c_int, c_uint};

/// `ncclResult_t`.
pub type NcclResult = c_int;
pub const SUCCESS: NcclResult = 0;
pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
pub const SYSTEM_ERROR: NcclResult = 2;
pub const INTERNAL_ERROR: NcclResult = 3;
pub const INVALID_ARGUMENT: NcclResult = 4;
pub const INVALID_USAGE: NcclResult = 5;
pub const REMOTE_ERROR: NcclResult = 6;
pub const IN_PROGRESS: NcclResult = 7;

/// The NCCL version whose interface we implement (NCCL_VERSION(2, 28, 9)): frameworks enable
/// features by it.
pub const NCCL_VERSION_CODE: c_int = 22809;

/// `NCCL_SPLIT_NOCOLOR`.
pub const SPLIT_NOCOLOR: c_int = -1;
/// `NCCL_CONFIG_UNDEF_INT`.
pub const CONFIG_UNDEF_INT: c_int = c_int::MIN;
pub const CONFIG_MAGIC: c_uint = 0xcafe_beef;
pub const SIM_INFO_MAGIC: c_uint = 0x7468_5283;
/// `ncclNumOps`: op values from here on are created by `ncclRedOpCreatePreMulSum`.
pub const NUM_BUILTIN_OPS: c_int = 5;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

impl UniqueId {
    pub fn from_bytes(bytes: &[u8; 128]) -> Self {
        UniqueId {
            internal: bytes.map(|b| b as c_char),
        }
    }
    pub fn bytes(&self) -> [u8; 128] {
        self.internal.map(|b| b as u8)
    }
}

/// `ncclConfig_t` of NCCL 2.28 (`ncclConfig_v22800`). Callers built against older headers pass
/// a smaller `size`; fields beyond it are not read.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub net_name: *const c_char,
    pub split_share: c_int,
    pub traffic_class: c_int,
    pub comm_name: *const c_char,
    pub collnet_enable: c_int,
    pub cta_policy: c_int,
    pub shrink_share: c_int,
    pub nvls_ctas: c_int,
    pub n_channels_per_net_peer: c_int,
    pub nvlink_centric_sched: c_int,
}

/// `ncclSimInfo_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SimInfo {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub estimated_time: f32,
}

/// What the shim takes from a caller's config: only whether init blocks. The other fields are
/// performance hints for NCCL's own transports, which ours do not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    pub blocking: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { blocking: true }
    }
}

impl Options {
    /// Reads `config` (null: defaults). A config not made from `NCCL_CONFIG_INITIALIZER` (bad
    /// magic, too small) is an error naming the field.
    ///
    /// # Safety
    /// `config` is null or points to at least `config.size` readable bytes.
    pub unsafe fn from_config(config: *const Config) -> Result<Options, String> {
        if config.is_null() {
            return Ok(Options::default());
        }
        // SAFETY: non-null, and the caller promises `size` readable bytes; the header fields come
        // first in every version of the struct.
        let (size, magic) = unsafe { ((*config).size, (*config).magic) };
        if magic != CONFIG_MAGIC {
            return Err(format!(
                "ncclConfig_t has magic {magic:#x}, expected {CONFIG_MAGIC:#x}: initialise it with \
                 NCCL_CONFIG_INITIALIZER"
            ));
        }
        let blocking_end = std::mem::offset_of!(Config, blocking) + std::mem::size_of::<c_int>();
        if size < blocking_end {
            return Err(format!(
                "ncclConfig_t of {size} bytes is too small to hold the blocking field"
            ));
        }
        // SAFETY: `blocking` lies within the `size` bytes checked above.
        let blocking = unsafe { (*config).blocking };
        Ok(Options {
            blocking: blocking == CONFIG_UNDEF_INT || blocking != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// The offsets nccl.h's ncclConfig_v22800 has on LP64.
    #[test]
    fn config_layout_matches_nccl_2_28() {
        assert_eq!(offset_of!(Config, magic), 8);
        assert_eq!(offset_of!(Config, blocking), 16);
        assert_eq!(offset_of!(Config, net_name), 32);
        assert_eq!(offset_of!(Config, split_share), 40);
        assert_eq!(offset_of!(Config, comm_name), 48);
        assert_eq!(offset_of!(Config, nvlink_centric_sched), 76);
        assert_eq!(size_of::<Config>(), 80);
        assert_eq!(size_of::<UniqueId>(), 128);
        assert_eq!(size_of::<SimInfo>(), 24);
    }

    #[test]
    fn config_is_checked() {
        let mut c = Config {
            size: size_of::<Config>(),
            magic: CONFIG_MAGIC,
            version: NCCL_VERSION_CODE as c_uint,
            blocking: CONFIG_UNDEF_INT,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF_INT,
            traffic_class: CONFIG_UNDEF_INT,
            comm_name: std::ptr::null(),
            collnet_enable: CONFIG_UNDEF_INT,
            cta_policy: CONFIG_UNDEF_INT,
            shrink_share: CONFIG_UNDEF_INT,
            nvls_ctas: CONFIG_UNDEF_INT,
            n_channels_per_net_peer: CONFIG_UNDEF_INT,
            nvlink_centric_sched: CONFIG_UNDEF_INT,
        };
        assert!(unsafe { Options::from_config(&c) }.unwrap().blocking);
        c.blocking = 0;
        assert!(!unsafe { Options::from_config(&c) }.unwrap().blocking);
        c.magic = 0;
        let e = unsafe { Options::from_config(&c) }.unwrap_err();
        assert!(e.contains("magic"), "{e}");
    }
}
