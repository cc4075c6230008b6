//! Hand-written `#[repr(C)]` mirrors of the parts of rdma-core's `infiniband/verbs.h` this crate
//! touches, for x86_64/aarch64 Linux (LP64).
//!
//! Why by hand: bindgen would need the verbs headers at build time, and CI machines (and this crate's
//! users without IB) have none. Only struct *prefixes* are declared where the library owns the object
//! (`ibv_context`, `ibv_qp`, `ibv_cq`): we read a few leading fields and never allocate those. Structs
//! we allocate and the library fills or reads (`ibv_port_attr`, `ibv_device_attr`, `ibv_qp_attr`,
//! `ibv_send_wr`, ...) are declared whole, and the unit tests pin every size and the offsets we use,
//! derived from verbs.h, so a mistake is a failing test rather than memory corruption.

use std::ffi::c_void;
use std::os::raw::c_int;

/// Opaque `struct ibv_device`.
#[repr(C)]
pub struct IbvDevice {
    _private: [u8; 0],
}

/// Opaque `struct ibv_pd`.
#[repr(C)]
pub struct IbvPd {
    _private: [u8; 0],
}

/// `union ibv_gid`: 16 raw bytes; the union's other member holds two `__be64`, hence 8-byte alignment.
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbvGid {
    pub raw: [u8; 16],
}

pub type PollCqFn =
    unsafe extern "C" fn(cq: *mut IbvCq, num_entries: c_int, wc: *mut IbvWc) -> c_int;
pub type PostSendFn =
    unsafe extern "C" fn(qp: *mut IbvQp, wr: *mut IbvSendWr, bad_wr: *mut *mut IbvSendWr) -> c_int;
pub type PostRecvFn =
    unsafe extern "C" fn(qp: *mut IbvQp, wr: *mut IbvRecvWr, bad_wr: *mut *mut IbvRecvWr) -> c_int;

/// `struct ibv_context_ops`: 32 function pointers. verbs.h's `ibv_poll_cq`, `ibv_post_send` and
/// `ibv_post_recv` are inline functions calling entries 11, 25 and 26; the rest are only padding here.
#[repr(C)]
pub struct IbvContextOps {
    _before_poll_cq: [*mut c_void; 11],
    pub poll_cq: Option<PollCqFn>,
    _before_post_send: [*mut c_void; 13],
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    _after_post_recv: [*mut c_void; 5],
}

/// Prefix of `struct ibv_context` (the library allocates it; fields after `ops` are not needed).
#[repr(C)]
pub struct IbvContext {
    pub device: *mut IbvDevice,
    pub ops: IbvContextOps,
}

/// Prefix of `struct ibv_qp` up to `qp_type` (a mutex and condition variable follow).
#[repr(C)]
pub struct IbvQp {
    pub context: *mut IbvContext,
    pub qp_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: u32,
    pub qp_type: u32,
}

/// Prefix of `struct ibv_cq` up to `cqe`.
#[repr(C)]
pub struct IbvCq {
    pub context: *mut IbvContext,
    pub channel: *mut c_void,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct IbvMr {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_device_attr` (232 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvDeviceAttr {
    pub fw_ver: [u8; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: u32,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: u32,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

impl Default for IbvDeviceAttr {
    fn default() -> Self {
        // SAFETY: every field is an integer or an integer array; all-zero is a valid value.
        unsafe { std::mem::zeroed() }
    }
}

/// `struct ibv_port_attr` as in current verbs.h (56 bytes). The exported `ibv_query_port` symbol
/// fills only the older 48-byte prefix (`struct _compat_ibv_port_attr`, ending at `flags`); this
/// struct is larger, so handing it to that symbol is safe, and the two trailing fields stay zero.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvPortAttr {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
    pub active_speed_ex: u32,
}

/// Size of `struct _compat_ibv_port_attr`, what the exported `ibv_query_port` writes.
pub const COMPAT_PORT_ATTR_SIZE: usize = 48;

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvSge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `wr.rdma` of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvRdmaWr {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// `wr.atomic` of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvAtomicWr {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// The `wr` union of `struct ibv_send_wr` (its `ud` member is never used here; the atomic member is
/// the largest, 32 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub union IbvSendWrUnion {
    pub rdma: IbvRdmaWr,
    pub atomic: IbvAtomicWr,
}

/// `struct ibv_send_wr` (128 bytes). The trailing `bind_mw`/`tso` union is unused here (left zero).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvSendWr {
    pub wr_id: u64,
    pub next: *mut IbvSendWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
    pub opcode: u32,
    pub send_flags: u32,
    /// Big-endian (network order) immediate for `*_WITH_IMM` opcodes.
    pub imm_data: u32,
    pub wr: IbvSendWrUnion,
    pub qp_type_xrc_remote_srqn: u32,
    pub bind_mw_or_tso: [u64; 6],
}

impl Default for IbvSendWr {
    fn default() -> Self {
        // SAFETY: integers, null pointers and a union of integers: all-zero is valid.
        unsafe { std::mem::zeroed() }
    }
}

/// `struct ibv_recv_wr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvRecvWr {
    pub wr_id: u64,
    pub next: *mut IbvRecvWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
}

/// `struct ibv_wc` (48 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvWc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Big-endian immediate when `wc_flags & IBV_WC_WITH_IMM`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvQpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct IbvQpInitAttr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut c_void,
    pub cap: IbvQpCap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvGlobalRoute {
    pub dgid: IbvGid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvAhAttr {
    pub grh: IbvGlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr` (144 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvQpAttr {
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: IbvQpCap,
    pub ah_attr: IbvAhAttr,
    pub alt_ah_attr: IbvAhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

// enum ibv_qp_state
pub const IBV_QPS_INIT: u32 = 1;
pub const IBV_QPS_RTR: u32 = 2;
pub const IBV_QPS_RTS: u32 = 3;

// enum ibv_qp_type
pub const IBV_QPT_RC: u32 = 2;

// enum ibv_port_state
pub const IBV_PORT_ACTIVE: u32 = 4;

// IBV_LINK_LAYER_*
pub const IBV_LINK_LAYER_UNSPECIFIED: u8 = 0;
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

// enum ibv_atomic_cap
pub const IBV_ATOMIC_NONE: u32 = 0;

// enum ibv_access_flags
pub const IBV_ACCESS_LOCAL_WRITE: u32 = 1;
pub const IBV_ACCESS_REMOTE_WRITE: u32 = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: u32 = 1 << 2;
pub const IBV_ACCESS_REMOTE_ATOMIC: u32 = 1 << 3;

// enum ibv_qp_attr_mask
pub const IBV_QP_STATE: c_int = 1;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

// enum ibv_wr_opcode
pub const IBV_WR_RDMA_WRITE: u32 = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: u32 = 1;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: u32 = 6;

// enum ibv_send_flags
pub const IBV_SEND_SIGNALED: u32 = 1 << 1;

// enum ibv_wc_opcode
pub const IBV_WC_RECV_RDMA_WITH_IMM: u32 = 129;

// enum ibv_wc_flags
pub const IBV_WC_WITH_IMM: u32 = 1 << 1;

// enum ibv_wc_status (only the ones acted upon; the rest are named by `wc_status_text`)
pub const IBV_WC_SUCCESS: u32 = 0;
pub const IBV_WC_WR_FLUSH_ERR: u32 = 5;

/// `enum ibv_wc_status` in words: the enumerator and what it usually means, so a failed completion
/// in a log says what to look at without the header at hand.
pub fn wc_status_text(status: u32) -> String {
    let (name, meaning) = match status {
        0 => ("IBV_WC_SUCCESS", "success"),
        1 => ("IBV_WC_LOC_LEN_ERR", "local length error"),
        2 => ("IBV_WC_LOC_QP_OP_ERR", "local QP operation error"),
        3 => ("IBV_WC_LOC_EEC_OP_ERR", "local EE context operation error"),
        4 => (
            "IBV_WC_LOC_PROT_ERR",
            "local protection error (lkey does not cover the source buffer)",
        ),
        5 => (
            "IBV_WC_WR_FLUSH_ERR",
            "flushed because the queue pair entered the error state",
        ),
        6 => ("IBV_WC_MW_BIND_ERR", "memory window bind error"),
        7 => ("IBV_WC_BAD_RESP_ERR", "bad response from the peer"),
        8 => ("IBV_WC_LOC_ACCESS_ERR", "local access error"),
        9 => ("IBV_WC_REM_INV_REQ_ERR", "remote invalid request (opcode or length the peer refuses)"),
        10 => (
            "IBV_WC_REM_ACCESS_ERR",
            "remote access error (rkey, address range or access rights of the peer's region)",
        ),
        11 => ("IBV_WC_REM_OP_ERR", "remote operation error"),
        12 => (
            "IBV_WC_RETRY_EXC_ERR",
            "transport retry count exceeded (the peer's QP did not answer: dead, wrong QPN/LID/GID, or not yet ready)",
        ),
        13 => (
            "IBV_WC_RNR_RETRY_EXC_ERR",
            "receiver-not-ready retry count exceeded (the peer posted no receive)",
        ),
        14 => ("IBV_WC_LOC_RDD_VIOL_ERR", "local RDD violation"),
        15 => ("IBV_WC_REM_INV_RD_REQ_ERR", "remote invalid RD request"),
        16 => ("IBV_WC_REM_ABORT_ERR", "remote aborted"),
        17 => ("IBV_WC_INV_EECN_ERR", "invalid EE context number"),
        18 => ("IBV_WC_INV_EEC_STATE_ERR", "invalid EE context state"),
        19 => ("IBV_WC_FATAL_ERR", "fatal error"),
        20 => ("IBV_WC_RESP_TIMEOUT_ERR", "response timeout"),
        21 => ("IBV_WC_GENERAL_ERR", "general error"),
        22 => ("IBV_WC_TM_ERR", "tag matching error"),
        23 => ("IBV_WC_TM_RNDV_INCOMPLETE", "tag matching rendezvous incomplete"),
        _ => return format!("unknown work completion status {status}"),
    };
    format!("{name} ({meaning})")
}

/// `enum ibv_mtu` to bytes (1 = 256 ... 5 = 4096); `None` for values outside the enum.
pub fn mtu_bytes(mtu: u32) -> Option<u32> {
    match mtu {
        1..=5 => Some(128 << mtu),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;
    use std::mem::{align_of, offset_of, size_of};

    // Sizes derived from rdma-core's verbs.h for LP64.
    #[rstest]
    #[case("ibv_gid", size_of::<IbvGid>(), 16)]
    #[case("ibv_context_ops", size_of::<IbvContextOps>(), 32 * 8)]
    #[case("ibv_mr", size_of::<IbvMr>(), 48)]
    #[case("ibv_device_attr", size_of::<IbvDeviceAttr>(), 232)]
    #[case("ibv_port_attr", size_of::<IbvPortAttr>(), 56)]
    #[case("ibv_sge", size_of::<IbvSge>(), 16)]
    #[case("ibv_send_wr", size_of::<IbvSendWr>(), 128)]
    #[case("ibv_recv_wr", size_of::<IbvRecvWr>(), 32)]
    #[case("ibv_wc", size_of::<IbvWc>(), 48)]
    #[case("ibv_qp_cap", size_of::<IbvQpCap>(), 20)]
    #[case("ibv_qp_init_attr", size_of::<IbvQpInitAttr>(), 64)]
    #[case("ibv_global_route", size_of::<IbvGlobalRoute>(), 24)]
    #[case("ibv_ah_attr", size_of::<IbvAhAttr>(), 32)]
    #[case("ibv_qp_attr", size_of::<IbvQpAttr>(), 144)]
    fn struct_sizes(#[case] name: &str, #[case] got: usize, #[case] want: usize) {
        assert_eq!(got, want, "sizeof(struct {name})");
    }

    #[rstest]
    // ops table: poll_cq is entry 11, post_send 25, post_recv 26.
    #[case("ibv_context.ops", offset_of!(IbvContext, ops), 8)]
    #[case("ibv_context_ops.poll_cq", offset_of!(IbvContextOps, poll_cq), 11 * 8)]
    #[case("ibv_context_ops.post_send", offset_of!(IbvContextOps, post_send), 25 * 8)]
    #[case("ibv_context_ops.post_recv", offset_of!(IbvContextOps, post_recv), 26 * 8)]
    #[case("ibv_qp.qp_num", offset_of!(IbvQp, qp_num), 52)]
    #[case("ibv_qp.qp_type", offset_of!(IbvQp, qp_type), 60)]
    #[case("ibv_cq.cqe", offset_of!(IbvCq, cqe), 28)]
    #[case("ibv_mr.lkey", offset_of!(IbvMr, lkey), 36)]
    #[case("ibv_mr.rkey", offset_of!(IbvMr, rkey), 40)]
    #[case("ibv_device_attr.max_qp_wr", offset_of!(IbvDeviceAttr, max_qp_wr), 112)]
    #[case("ibv_device_attr.max_qp_rd_atom", offset_of!(IbvDeviceAttr, max_qp_rd_atom), 144)]
    #[case("ibv_device_attr.atomic_cap", offset_of!(IbvDeviceAttr, atomic_cap), 164)]
    #[case("ibv_device_attr.phys_port_cnt", offset_of!(IbvDeviceAttr, phys_port_cnt), 227)]
    #[case("ibv_port_attr.max_msg_sz", offset_of!(IbvPortAttr, max_msg_sz), 20)]
    #[case("ibv_port_attr.lid", offset_of!(IbvPortAttr, lid), 34)]
    #[case("ibv_port_attr.link_layer", offset_of!(IbvPortAttr, link_layer), 46)]
    #[case("ibv_port_attr.flags", offset_of!(IbvPortAttr, flags), COMPAT_PORT_ATTR_SIZE - 1)]
    #[case("ibv_send_wr.opcode", offset_of!(IbvSendWr, opcode), 28)]
    #[case("ibv_send_wr.send_flags", offset_of!(IbvSendWr, send_flags), 32)]
    #[case("ibv_send_wr.imm_data", offset_of!(IbvSendWr, imm_data), 36)]
    #[case("ibv_send_wr.wr", offset_of!(IbvSendWr, wr), 40)]
    #[case("ibv_send_wr.wr.atomic.rkey", offset_of!(IbvSendWr, wr) + offset_of!(IbvAtomicWr, rkey), 64)]
    #[case("ibv_send_wr.wr.rdma.rkey", offset_of!(IbvSendWr, wr) + offset_of!(IbvRdmaWr, rkey), 48)]
    #[case("ibv_send_wr.qp_type", offset_of!(IbvSendWr, qp_type_xrc_remote_srqn), 72)]
    #[case("ibv_wc.imm_data", offset_of!(IbvWc, imm_data), 24)]
    #[case("ibv_wc.wc_flags", offset_of!(IbvWc, wc_flags), 36)]
    #[case("ibv_qp_init_attr.cap", offset_of!(IbvQpInitAttr, cap), 32)]
    #[case("ibv_qp_init_attr.qp_type", offset_of!(IbvQpInitAttr, qp_type), 52)]
    #[case("ibv_ah_attr.dlid", offset_of!(IbvAhAttr, dlid), 24)]
    #[case("ibv_ah_attr.port_num", offset_of!(IbvAhAttr, port_num), 30)]
    #[case("ibv_qp_attr.cap", offset_of!(IbvQpAttr, cap), 36)]
    #[case("ibv_qp_attr.ah_attr", offset_of!(IbvQpAttr, ah_attr), 56)]
    #[case("ibv_qp_attr.pkey_index", offset_of!(IbvQpAttr, pkey_index), 120)]
    #[case("ibv_qp_attr.max_rd_atomic", offset_of!(IbvQpAttr, max_rd_atomic), 126)]
    #[case("ibv_qp_attr.port_num", offset_of!(IbvQpAttr, port_num), 129)]
    #[case("ibv_qp_attr.rnr_retry", offset_of!(IbvQpAttr, rnr_retry), 132)]
    #[case("ibv_qp_attr.rate_limit", offset_of!(IbvQpAttr, rate_limit), 136)]
    fn field_offsets(#[case] name: &str, #[case] got: usize, #[case] want: usize) {
        assert_eq!(got, want, "offsetof({name})");
    }

    #[test]
    fn gid_is_eight_byte_aligned() {
        assert_eq!(align_of::<IbvGid>(), 8);
        assert_eq!(align_of::<IbvQpAttr>(), 8);
    }

    #[rstest]
    #[case(1, Some(256))]
    #[case(3, Some(1024))]
    #[case(5, Some(4096))]
    #[case(0, None)]
    #[case(6, None)]
    fn mtu_enum(#[case] mtu: u32, #[case] bytes: Option<u32>) {
        assert_eq!(mtu_bytes(mtu), bytes);
    }

    #[test]
    fn every_wc_status_has_words() {
        for s in 0..=23 {
            let t = wc_status_text(s);
            assert!(t.starts_with("IBV_WC_") && t.contains('('), "{s}: {t}");
        }
        assert!(wc_status_text(12).contains("retry"));
        assert_eq!(wc_status_text(99), "unknown work completion status 99");
    }
}
