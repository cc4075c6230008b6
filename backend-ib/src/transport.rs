//! `IbTransport`: a [`Transport`] over one reliable-connected (RC) queue pair to one peer.
//!
//! # Operations
//! - `write`: RDMA WRITE from a local region (key = lkey) to the peer's region (key = rkey), split
//!   into messages no larger than the port's maximum message size.
//! - `update_and_sync`, `host` mode: RDMA ATOMIC FETCH_AND_ADD of `new - last` on the remote word,
//!   `last` being the value this connection last set there (MSCCL++ keeps the same shadow copy).
//! - `update_and_sync`, `host-no-atomic` mode (or an HCA without atomics): a zero-length RDMA
//!   WRITE_WITH_IMM whose 32-bit immediate carries the low half of the value. The peer's receiver
//!   thread (see [`IbTransport::set_signal_destination`]) widens it back to 64 bits, the counter
//!   being monotonic and advancing by less than 2^32 per update, and stores it with release order.
//!   The peer learns no address from the immediate, so each connection signals one destination word.
//! - `flush`: polls the send completion queue until every work request issued so far completed
//!   (all are signalled), or the timeout. RC delivers in order, so a completed signal means the
//!   earlier writes were placed at the peer.
//!
//! # Connection
//! Both ends call [`IbTransport::connect`] with a closure that sends this end's bytes to the peer
//! and returns the peer's (a bootstrap send+recv; [`IbTransport::connect_bootstrap`] does that).
//! It is called twice: once with the [`IbConnInfo`], once with a ready marker after the queue pair
//! reached RTS, so neither end sends before the other can receive.
//!
//! # Failure
//! A failed work completion moves the QP to the error state: the error names the operation, the
//! peer, device and port, and the status in words; later calls fail with the same cause.

use crate::conn_info::IbConnInfo;
use crate::device::{last_errno, DeviceInner, IbContext, IbMemory};
use crate::ffi::*;
use mscclpp_core::bootstrap::Bootstrap;
use mscclpp_core::env::IbvMode;
use mscclpp_core::transport::{MemoryRegion, MemoryResolver, Transport, TransportKind};
use mscclpp_core::{Error, Result};
use std::collections::HashMap;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Second message of the connection handshake: "my QP is ready to send and receive".
const READY_MARKER: &[u8; 8] = b"MSCLIBRD";
/// Largest single RDMA message; also bounded by the port's `max_msg_sz`. 1 GiB keeps `sge.length`
/// (u32) far from overflow.
const MAX_MESSAGE: u64 = 1 << 30;
/// Completions taken per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

// Work request kinds, kept in the low byte of wr_id so a failed completion can say what failed.
const KIND_WRITE: u64 = 1;
const KIND_ATOMIC: u64 = 2;
const KIND_WRITE_IMM: u64 = 3;

fn kind_name(wr_id: u64) -> &'static str {
    match wr_id & 0xff {
        KIND_WRITE => "RDMA write",
        KIND_ATOMIC => "RDMA atomic fetch-and-add (semaphore update)",
        KIND_WRITE_IMM => "RDMA write-with-immediate (semaphore update)",
        _ => "work request",
    }
}

/// Settings of one IB connection.
#[derive(Debug, Clone)]
pub struct IbConfig {
    /// This process's rank.
    pub rank: usize,
    /// The rank at the other end.
    pub remote_rank: usize,
    /// The other end's rank in the whole job, which errors and logs name: inside a
    /// sub-communicator `remote_rank` is its rank in the group. Defaults to `remote_rank`.
    pub remote_job_rank: usize,
    /// Send queue depth: work requests in flight before a post waits for completions.
    pub max_send_wr: u32,
    /// Receive queue depth (used in write-with-immediate mode).
    pub max_recv_wr: u32,
    /// Longest a `write`/`update_and_sync` waits for room in a full send queue.
    pub op_timeout: Duration,
    /// Local ACK timeout exponent: 4.096 us * 2^n (18 = about 1 s).
    pub ack_timeout: u8,
    /// Transport retries before a work request fails with RETRY_EXC (at most 7).
    pub retry_cnt: u8,
    /// Overrides the context's `MSCCLPP_IBV_MODE`.
    pub mode: Option<IbvMode>,
}

impl IbConfig {
    pub fn new(rank: usize, remote_rank: usize) -> Self {
        IbConfig {
            rank,
            remote_rank,
            remote_job_rank: remote_rank,
            max_send_wr: 1024,
            max_recv_wr: 1024,
            op_timeout: Duration::from_secs(60),
            ack_timeout: 18,
            retry_cnt: 7,
            mode: None,
        }
    }

    fn validate(&self, device: &DeviceInner) -> Result<()> {
        let limit = u32::try_from(device.attr.max_qp_wr).unwrap_or(0);
        for (name, v) in [
            ("max_send_wr", self.max_send_wr),
            ("max_recv_wr", self.max_recv_wr),
        ] {
            if v == 0 || v > limit {
                return Err(Error::InvalidArgument(format!(
                    "IbConfig.{name}={v}: must be 1..={limit} (max_qp_wr of {})",
                    device.describe()
                )));
            }
        }
        if self.ack_timeout > 31 || self.retry_cnt > 7 {
            return Err(Error::InvalidArgument(format!(
                "IbConfig.ack_timeout={} (max 31) / retry_cnt={} (max 7)",
                self.ack_timeout, self.retry_cnt
            )));
        }
        for (name, v) in [("rank", self.rank), ("remote_rank", self.remote_rank)] {
            if u32::try_from(v).is_err() {
                return Err(Error::InvalidArgument(format!(
                    "IbConfig.{name}={v} does not fit the connection info's 32 bits"
                )));
            }
        }
        Ok(())
    }
}

/// Sender-side state, under one lock so posts and completions stay in order.
#[derive(Default)]
struct SendState {
    outstanding: u32,
    next_seq: u64,
    /// Set by the first failed completion; the QP is in the error state from then on.
    broken: Option<String>,
    /// Value last set per remote semaphore (address, rkey), for the atomic add's delta.
    semaphores: HashMap<(u64, u32), u64>,
}

/// The raw handles the receiver thread uses; the transport joins it before destroying them.
struct RecvHandles {
    qp: *mut IbvQp,
    cq: *mut IbvCq,
}

// SAFETY: verbs handles may be used from any thread; the owner outlives the thread (joined in Drop).
unsafe impl Send for RecvHandles {}

/// Where received signals go, and what arrived so far.
#[derive(Default)]
struct SignalTarget {
    dest: Option<(Arc<dyn MemoryResolver>, MemoryRegion, u64)>,
    last: u64,
    received: u64,
}

#[derive(Default)]
struct SignalShared {
    stop: AtomicBool,
    error: Mutex<Option<String>>,
    target: Mutex<SignalTarget>,
}

/// Widens a 32-bit immediate to the 64-bit counter value following `prev`: the counter only grows
/// and by less than 2^32 per update, so a smaller low half means the high half advanced.
pub fn widen_signal(prev: u64, low: u32) -> u64 {
    let candidate = (prev & !0xffff_ffff) | u64::from(low);
    if candidate < prev {
        candidate.wrapping_add(1 << 32)
    } else {
        candidate
    }
}

fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>> {
    m.lock()
        .map_err(|_| Error::Internal(format!("{what} lock poisoned by a panic")))
}

/// One RC connection to one peer. See the module docs.
pub struct IbTransport {
    device: Arc<DeviceInner>,
    config: IbConfig,
    qp: *mut IbvQp,
    send_cq: *mut IbvCq,
    recv_cq: *mut IbvCq,
    no_atomic: bool,
    max_message: u64,
    send: Mutex<SendState>,
    signals: Arc<SignalShared>,
    receiver: Option<JoinHandle<()>>,
    /// Landing word for fetch-and-add results, which nobody reads. Its MR is dropped before it.
    scratch_mr: Option<IbMemory>,
    scratch: Box<AtomicU64>,
}

// SAFETY: the QP/CQ handles are used under `send`'s lock (send side) or by the receiver thread
// (receive side), which libibverbs allows concurrently; they are destroyed only in Drop.
unsafe impl Send for IbTransport {}
// SAFETY: as above.
unsafe impl Sync for IbTransport {}

impl std::fmt::Debug for IbTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IbTransport(rank {} -> {} over {}, QPN {:#x}, {})",
            self.config.rank,
            self.config.remote_job_rank,
            self.device.describe(),
            self.qp_num(),
            if self.no_atomic {
                "write-with-immediate"
            } else {
                "atomic"
            }
        )
    }
}

impl IbTransport {
    /// Connects to `config.remote_rank`; `exchange` sends this end's bytes and returns the
    /// peer's (see the module docs). Both ends must call this.
    pub fn connect(
        ctx: &IbContext,
        config: IbConfig,
        mut exchange: impl FnMut(&[u8]) -> Result<Vec<u8>>,
    ) -> Result<IbTransport> {
        let device = ctx.inner.clone();
        config.validate(&device)?;
        let mode = config.mode.unwrap_or(device.mode);
        let atomics = device.attr.atomic_cap != IBV_ATOMIC_NONE;
        if mode == IbvMode::Host && !atomics {
            tracing::warn!(target: mscclpp_core::log::target::NET,
                "{} does not support RDMA atomics; signalling rank {} with write-with-immediate instead",
                device.describe(), config.remote_job_rank);
        }
        let want_no_atomic = mode == IbvMode::HostNoAtomic || !atomics;
        let scratch = Box::new(AtomicU64::new(0));
        let mut t = IbTransport {
            max_message: MAX_MESSAGE.min(u64::from(device.port.max_msg_sz).max(1)),
            device,
            config,
            qp: std::ptr::null_mut(),
            send_cq: std::ptr::null_mut(),
            recv_cq: std::ptr::null_mut(),
            no_atomic: want_no_atomic,
            send: Mutex::new(SendState::default()),
            signals: Arc::new(SignalShared::default()),
            receiver: None,
            scratch_mr: None,
            scratch,
        };
        // From here on, an early return drops `t`, which destroys whatever was created.
        // SAFETY: the scratch word lives in `t` (boxed, so it does not move) and outlives its MR.
        t.scratch_mr = Some(unsafe { ctx.register(t.scratch.as_ptr().cast::<u8>(), 8)? });
        t.send_cq = t.create_cq(t.config.max_send_wr)?;
        t.recv_cq = t.create_cq(t.config.max_recv_wr)?;
        t.create_qp()?;
        t.to_init()?;

        let psn = rand::random::<u32>() & 0x00ff_ffff;
        let local = IbConnInfo {
            rank: t.config.rank as u32,
            remote_rank: t.config.remote_rank as u32,
            // SAFETY: `qp` is live.
            qpn: unsafe { (*t.qp).qp_num },
            psn,
            lid: t.device.port.lid,
            port: t.device.port.port,
            link_layer: t.device.port.link_layer,
            mtu: u8::try_from(t.device.port.active_mtu).unwrap_or(1),
            no_atomic: want_no_atomic,
            gid: t.device.gid.raw,
        };
        let reply = exchange(&local.encode())?;
        let peer = IbConnInfo::decode(&reply, t.config.remote_rank)?;
        t.check_peer(&local, &peer)?;
        t.no_atomic = want_no_atomic || peer.no_atomic;
        if t.no_atomic {
            for i in 0..t.config.max_recv_wr {
                t.post_one_recv(u64::from(i))?;
            }
        }
        t.to_rtr(&local, &peer)?;
        t.to_rts(psn)?;
        let ready = exchange(READY_MARKER)?;
        if ready.as_slice() != READY_MARKER {
            return Err(Error::Peer {
                rank: t.config.remote_job_rank,
                message: format!(
                    "expected the IB ready marker after connection info, got {} bytes",
                    ready.len()
                ),
            });
        }
        if t.no_atomic {
            t.start_receiver()?;
        }
        tracing::debug!(target: mscclpp_core::log::target::CONN, "connected {t:?}");
        Ok(t)
    }

    /// [`IbTransport::connect`] with the exchange done over `bootstrap` under `tag`.
    pub fn connect_bootstrap(
        ctx: &IbContext,
        config: IbConfig,
        bootstrap: &dyn Bootstrap,
        tag: u64,
    ) -> Result<IbTransport> {
        let peer = config.remote_rank;
        Self::connect(ctx, config, |bytes| {
            bootstrap.send(peer, tag, bytes)?;
            bootstrap.recv(peer, tag)
        })
    }

    /// Whether signals travel as write-with-immediate (negotiated at connect).
    pub fn is_no_atomic(&self) -> bool {
        self.no_atomic
    }

    /// This end's queue pair number.
    pub fn qp_num(&self) -> u32 {
        if self.qp.is_null() {
            0
        } else {
            // SAFETY: non-null QPs are live until Drop.
            unsafe { (*self.qp).qp_num }
        }
    }

    /// In write-with-immediate mode, where signals from the peer land: the 8-byte word at
    /// `region + offset`, stored through `resolver` (host memory: `HostMemoryRegistry`; device
    /// memory: the GPU backend's resolver). A signal that arrived earlier is applied now.
    /// In atomic mode the peer writes the word itself and this is not needed.
    pub fn set_signal_destination(
        &self,
        resolver: Arc<dyn MemoryResolver>,
        region: MemoryRegion,
        offset: u64,
    ) -> Result<()> {
        region.check_range(offset, 8, "IB signal destination")?;
        if (region.addr.wrapping_add(offset)) % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "IB signal destination {:#x}+{offset} is not 8-byte aligned",
                region.addr
            )));
        }
        let mut target = lock(&self.signals.target, "IB signal target")?;
        if target.received > 0 {
            resolver.store_release(&region, offset, target.last)?;
        }
        target.dest = Some((resolver, region, offset));
        Ok(())
    }

    /// The first failure of the receiver thread, if any (write-with-immediate mode).
    pub fn check_receiver(&self) -> Result<()> {
        match lock(&self.signals.error, "IB receiver error")?.as_ref() {
            Some(msg) => Err(self.peer_error(format!("receiving signals failed: {msg}"))),
            None => Ok(()),
        }
    }

    fn peer_error(&self, message: String) -> Error {
        Error::Peer {
            rank: self.config.remote_job_rank,
            message: format!("{} ({})", message, self.device.describe()),
        }
    }

    fn create_cq(&self, depth: u32) -> Result<*mut IbvCq> {
        let cqe = c_int::try_from(depth).unwrap_or(c_int::MAX);
        // SAFETY: live context; no channel or completion vector is used.
        let cq = unsafe {
            (self.device.verbs.create_cq)(
                self.device.ctx,
                cqe,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(self.device.verbs_error(
                "ibv_create_cq",
                last_errno(),
                &format!(
                    "creating a completion queue of {depth} entries for rank {}",
                    self.config.remote_job_rank
                ),
            ));
        }
        Ok(cq)
    }

    fn create_qp(&mut self) -> Result<()> {
        let mut init = IbvQpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: self.send_cq,
            recv_cq: self.recv_cq,
            srq: std::ptr::null_mut(),
            cap: IbvQpCap {
                max_send_wr: self.config.max_send_wr,
                max_recv_wr: self.config.max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: live PD; `init` names live CQs.
        let qp = unsafe { (self.device.verbs.create_qp)(self.device.pd, &mut init) };
        if qp.is_null() {
            return Err(self.device.verbs_error(
                "ibv_create_qp",
                last_errno(),
                &format!(
                    "creating an RC queue pair for rank {}",
                    self.config.remote_job_rank
                ),
            ));
        }
        self.qp = qp;
        Ok(())
    }

    fn modify(&self, attr: &mut IbvQpAttr, mask: c_int, step: &str) -> Result<()> {
        // SAFETY: live QP, valid attribute struct.
        let rc = unsafe { (self.device.verbs.modify_qp)(self.qp, attr, mask) };
        if rc != 0 {
            return Err(self.device.verbs_error(
                "ibv_modify_qp",
                rc,
                &format!(
                    "moving the queue pair to rank {} to {step}",
                    self.config.remote_job_rank
                ),
            ));
        }
        Ok(())
    }

    fn to_init(&self) -> Result<()> {
        let mut a = IbvQpAttr {
            qp_state: IBV_QPS_INIT,
            pkey_index: 0,
            port_num: self.device.port.port,
            qp_access_flags: IBV_ACCESS_LOCAL_WRITE
                | IBV_ACCESS_REMOTE_WRITE
                | IBV_ACCESS_REMOTE_READ
                | IBV_ACCESS_REMOTE_ATOMIC,
            ..Default::default()
        };
        self.modify(
            &mut a,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
            "INIT",
        )
    }

    fn check_peer(&self, local: &IbConnInfo, peer: &IbConnInfo) -> Result<()> {
        if peer.rank != local.remote_rank || peer.remote_rank != local.rank {
            return Err(self.peer_error(format!(
                "IB connection info from rank {} meant for rank {} arrived at rank {} expecting rank {}",
                peer.rank, peer.remote_rank, local.rank, local.remote_rank
            )));
        }
        let ll = |l: u8| {
            if l == IBV_LINK_LAYER_ETHERNET {
                "RoCE"
            } else {
                "InfiniBand"
            }
        };
        if ll(peer.link_layer) != ll(local.link_layer) {
            return Err(self.peer_error(format!(
                "link layers differ: ours is {}, the peer's is {}",
                ll(local.link_layer),
                ll(peer.link_layer)
            )));
        }
        Ok(())
    }

    fn to_rtr(&self, local: &IbConnInfo, peer: &IbConnInfo) -> Result<()> {
        let rd_atomic = u8::try_from(self.device.attr.max_qp_rd_atom.clamp(1, 16)).unwrap_or(1);
        // Routing by GID is required on RoCE and when the peer has no LID (other subnet).
        let global = local.link_layer == IBV_LINK_LAYER_ETHERNET || peer.lid == 0;
        let mut a = IbvQpAttr {
            qp_state: IBV_QPS_RTR,
            path_mtu: u32::from(local.mtu.min(peer.mtu)),
            dest_qp_num: peer.qpn,
            rq_psn: peer.psn,
            max_dest_rd_atomic: rd_atomic,
            min_rnr_timer: 12,
            ah_attr: IbvAhAttr {
                grh: IbvGlobalRoute {
                    dgid: IbvGid { raw: peer.gid },
                    flow_label: 0,
                    sgid_index: u8::try_from(self.device.gid_index).unwrap_or(0),
                    hop_limit: if global { 255 } else { 0 },
                    traffic_class: 0,
                },
                dlid: peer.lid,
                sl: 0,
                src_path_bits: 0,
                static_rate: 0,
                is_global: u8::from(global),
                port_num: self.device.port.port,
            },
            ..Default::default()
        };
        self.modify(
            &mut a,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            "RTR (check LID/GID reachability and MSCCLPP_IB_GID_INDEX)",
        )
    }

    fn to_rts(&self, psn: u32) -> Result<()> {
        let rd_atomic =
            u8::try_from(self.device.attr.max_qp_init_rd_atom.clamp(1, 16)).unwrap_or(1);
        let mut a = IbvQpAttr {
            qp_state: IBV_QPS_RTS,
            sq_psn: psn,
            timeout: self.config.ack_timeout,
            retry_cnt: self.config.retry_cnt,
            // 7 = retry forever while the peer has no receive posted; its receiver reposts.
            rnr_retry: 7,
            max_rd_atomic: rd_atomic,
            ..Default::default()
        };
        self.modify(
            &mut a,
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    fn post_one_recv(&self, wr_id: u64) -> Result<()> {
        post_recv(&self.device, self.qp, wr_id).map_err(|rc| {
            self.device.verbs_error(
                "ibv_post_recv",
                rc,
                &format!(
                    "posting a receive for signals from rank {}",
                    self.config.remote_job_rank
                ),
            )
        })
    }

    fn start_receiver(&mut self) -> Result<()> {
        let handles = RecvHandles {
            qp: self.qp,
            cq: self.recv_cq,
        };
        let device = self.device.clone();
        let shared = self.signals.clone();
        let remote = self.config.remote_job_rank;
        let thread = std::thread::Builder::new()
            .name(format!("mscclpp-ib-recv-{remote}"))
            .spawn(move || receive_signals(handles, device, shared, remote))
            .map_err(|e| {
                Error::io(
                    format!("spawning the IB signal receiver for rank {remote}"),
                    e,
                )
            })?;
        self.receiver = Some(thread);
        Ok(())
    }

    /// Takes available send completions; returns how many. A failed one breaks the connection.
    fn poll_send(&self, s: &mut SendState) -> Result<usize> {
        let mut wc = [IbvWc::default(); POLL_BATCH];
        // SAFETY: live CQ of this library.
        let n = unsafe { self.device.verbs.poll_cq(self.send_cq, &mut wc) }.map_err(|e| {
            let msg = format!("polling send completions: {e}");
            s.broken.get_or_insert(msg);
            e
        })?;
        for c in &wc[..n] {
            s.outstanding = s.outstanding.saturating_sub(1);
            if c.status != IBV_WC_SUCCESS {
                let what = format!(
                    "{} to rank {} on {} failed: {} (vendor error {:#x})",
                    kind_name(c.wr_id),
                    self.config.remote_job_rank,
                    self.device.describe(),
                    wc_status_text(c.status),
                    c.vendor_err
                );
                s.broken.get_or_insert(what.clone());
                return Err(Error::Driver {
                    call: "ibv_poll_cq",
                    code: i64::from(c.status),
                    message: what,
                });
            }
        }
        Ok(n)
    }

    /// Posts one signalled work request, first waiting (bounded) for room in the send queue.
    fn post(&self, s: &mut SendState, wr: &mut IbvSendWr, kind: u64) -> Result<()> {
        if let Some(cause) = &s.broken {
            return Err(self.peer_error(format!("the IB connection is broken: {cause}")));
        }
        let deadline = Instant::now() + self.config.op_timeout;
        while s.outstanding >= self.config.max_send_wr {
            if self.poll_send(s)? == 0 {
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        what: format!(
                            "room in the IB send queue to rank {} ({} work requests outstanding on {})",
                            self.config.remote_job_rank,
                            s.outstanding,
                            self.device.describe()
                        ),
                        timeout: self.config.op_timeout,
                    });
                }
                std::hint::spin_loop();
            }
        }
        s.next_seq += 1;
        wr.wr_id = (s.next_seq << 8) | kind;
        wr.send_flags |= IBV_SEND_SIGNALED;
        // SAFETY: live QP; `wr` and its SGE (on the caller's stack) outlive the call, which copies
        // them into the send queue.
        let rc = unsafe { self.device.verbs.post_send(self.qp, wr) };
        if rc != 0 {
            return Err(self.device.verbs_error(
                "ibv_post_send",
                rc,
                &format!(
                    "posting an {} to rank {}",
                    kind_name(kind),
                    self.config.remote_job_rank
                ),
            ));
        }
        s.outstanding += 1;
        Ok(())
    }
}

/// verbs' `ibv_post_recv` of one zero-length receive (write-with-immediate carries no payload).
fn post_recv(device: &DeviceInner, qp: *mut IbvQp, wr_id: u64) -> std::result::Result<(), i32> {
    let mut wr = IbvRecvWr {
        wr_id,
        next: std::ptr::null_mut(),
        sg_list: std::ptr::null_mut(),
        num_sge: 0,
    };
    // SAFETY: live QP of this library; `wr` is valid for the call.
    match unsafe { device.verbs.post_recv(qp, &mut wr) } {
        0 => Ok(()),
        rc => Err(rc),
    }
}

/// Body of the receiver thread: applies write-with-immediate signals in arrival order.
fn receive_signals(
    h: RecvHandles,
    device: Arc<DeviceInner>,
    shared: Arc<SignalShared>,
    remote: usize,
) {
    let fail = |msg: String| {
        tracing::error!(target: mscclpp_core::log::target::NET, "IB signal receiver for rank {remote}: {msg}");
        if let Ok(mut e) = shared.error.lock() {
            e.get_or_insert(msg);
        }
    };
    let mut wc = [IbvWc::default(); POLL_BATCH];
    let mut idle = 0u32;
    while !shared.stop.load(Ordering::Acquire) {
        // SAFETY: the CQ lives until the owner joins this thread.
        let n = match unsafe { device.verbs.poll_cq(h.cq, &mut wc) } {
            Ok(n) => n,
            Err(e) => return fail(format!("{e} on {}", device.describe())),
        };
        if n == 0 {
            // Spin briefly for latency, then back off so an idle connection costs no CPU.
            idle = idle.saturating_add(1);
            if idle < 1000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
            continue;
        }
        idle = 0;
        for c in &wc[..n] {
            if c.status != IBV_WC_SUCCESS {
                if c.status == IBV_WC_WR_FLUSH_ERR && shared.stop.load(Ordering::Acquire) {
                    return;
                }
                return fail(format!(
                    "receive completion on {}: {} (vendor error {:#x})",
                    device.describe(),
                    wc_status_text(c.status),
                    c.vendor_err
                ));
            }
            if c.opcode != IBV_WC_RECV_RDMA_WITH_IMM || c.wc_flags & IBV_WC_WITH_IMM == 0 {
                return fail(format!(
                    "unexpected receive completion (opcode {}, flags {:#x}): the peer sent something other than a signal",
                    c.opcode, c.wc_flags
                ));
            }
            let low = u32::from_be(c.imm_data);
            match shared.target.lock() {
                Ok(mut t) => {
                    t.last = widen_signal(t.last, low);
                    t.received += 1;
                    if let Some((resolver, region, offset)) = &t.dest {
                        if let Err(e) = resolver.store_release(region, *offset, t.last) {
                            return fail(format!("storing signal value {}: {e}", t.last));
                        }
                    }
                }
                Err(_) => return fail("signal target lock poisoned by a panic".into()),
            }
            if let Err(rc) = post_recv(&device, h.qp, c.wr_id) {
                return fail(format!(
                    "ibv_post_recv (re-arming a receive) on {}: {}",
                    device.describe(),
                    std::io::Error::from_raw_os_error(rc)
                ));
            }
        }
    }
}

impl Transport for IbTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Ib(self.device.index)
    }

    fn remote_rank(&self) -> usize {
        self.config.remote_rank
    }

    /// Posts RDMA WRITEs (`src.key` = lkey, `dst.key` = rkey) and returns; `flush` waits for them.
    fn write(
        &self,
        dst: &MemoryRegion,
        dst_offset: u64,
        src: &MemoryRegion,
        src_offset: u64,
        bytes: u64,
    ) -> Result<()> {
        dst.check_range(dst_offset, bytes, "IB write destination")?;
        src.check_range(src_offset, bytes, "IB write source")?;
        let mut s = lock(&self.send, "IB send state")?;
        let mut done = 0u64;
        while done < bytes {
            let len = (bytes - done).min(self.max_message);
            let mut sge = IbvSge {
                addr: src.addr + src_offset + done,
                // `len` <= MAX_MESSAGE (1 GiB) fits in u32.
                length: len as u32,
                lkey: src.key,
            };
            let mut wr = IbvSendWr {
                sg_list: &mut sge,
                num_sge: 1,
                opcode: IBV_WR_RDMA_WRITE,
                wr: IbvSendWrUnion {
                    rdma: IbvRdmaWr {
                        remote_addr: dst.addr + dst_offset + done,
                        rkey: dst.key,
                    },
                },
                ..Default::default()
            };
            self.post(&mut s, &mut wr, KIND_WRITE)?;
            done += len;
        }
        Ok(())
    }

    fn update_and_sync(&self, dst: &MemoryRegion, dst_offset: u64, new_value: u64) -> Result<()> {
        dst.check_range(dst_offset, 8, "IB semaphore update")?;
        let remote_addr = dst.addr + dst_offset;
        if remote_addr % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "IB semaphore {remote_addr:#x} on rank {} is not 8-byte aligned",
                self.config.remote_job_rank
            )));
        }
        let mut s = lock(&self.send, "IB send state")?;
        if self.no_atomic {
            let mut wr = IbvSendWr {
                sg_list: std::ptr::null_mut(),
                num_sge: 0,
                opcode: IBV_WR_RDMA_WRITE_WITH_IMM,
                // Only the low half travels; the receiver widens it (see `widen_signal`).
                imm_data: (new_value as u32).to_be(),
                wr: IbvSendWrUnion {
                    rdma: IbvRdmaWr {
                        remote_addr,
                        rkey: dst.key,
                    },
                },
                ..Default::default()
            };
            return self.post(&mut s, &mut wr, KIND_WRITE_IMM);
        }
        let key = (remote_addr, dst.key);
        let old = s.semaphores.get(&key).copied().unwrap_or(0);
        let scratch = self
            .scratch_mr
            .as_ref()
            .ok_or_else(|| Error::Internal("IB scratch word not registered".into()))?
            .local();
        let mut sge = IbvSge {
            addr: scratch.addr,
            length: 8,
            lkey: scratch.key,
        };
        let mut wr = IbvSendWr {
            sg_list: &mut sge,
            num_sge: 1,
            opcode: IBV_WR_ATOMIC_FETCH_AND_ADD,
            wr: IbvSendWrUnion {
                atomic: IbvAtomicWr {
                    remote_addr,
                    compare_add: new_value.wrapping_sub(old),
                    swap: 0,
                    rkey: dst.key,
                },
            },
            ..Default::default()
        };
        self.post(&mut s, &mut wr, KIND_ATOMIC)?;
        s.semaphores.insert(key, new_value);
        Ok(())
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut s = lock(&self.send, "IB send state")?;
        if let Some(cause) = &s.broken {
            return Err(self.peer_error(format!("the IB connection is broken: {cause}")));
        }
        while s.outstanding > 0 {
            if self.poll_send(&mut s)? == 0 {
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        what: format!(
                            "IB completions of {} work request(s) to rank {} on {}",
                            s.outstanding,
                            self.config.remote_job_rank,
                            self.device.describe()
                        ),
                        timeout,
                    });
                }
                std::hint::spin_loop();
            }
        }
        drop(s);
        self.check_receiver()
    }
}

impl Drop for IbTransport {
    fn drop(&mut self) {
        self.signals.stop.store(true, Ordering::Release);
        if let Some(t) = self.receiver.take() {
            // The receiver checks `stop` at least every 50 us.
            let _ = t.join();
        }
        let verbs = &self.device.verbs;
        // SAFETY: each handle was created by this library, is destroyed once, QP before its CQs,
        // and no thread uses them any more.
        unsafe {
            if !self.qp.is_null() {
                let rc = (verbs.destroy_qp)(self.qp);
                if rc != 0 {
                    tracing::warn!(target: mscclpp_core::log::target::NET, "ibv_destroy_qp on {}: errno {rc}", self.device.describe());
                }
            }
            for cq in [self.send_cq, self.recv_cq] {
                if !cq.is_null() {
                    let rc = (verbs.destroy_cq)(cq);
                    if rc != 0 {
                        tracing::warn!(target: mscclpp_core::log::target::NET, "ibv_destroy_cq on {}: errno {rc}", self.device.describe());
                    }
                }
            }
        }
        // `scratch_mr` (a field) is deregistered after this body, before `scratch` is freed.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(0, 5, 5)]
    #[case(5, 5, 5)]
    #[case(0xffff_fff0, 3, 0x1_0000_0003)]
    #[case(0x1_0000_0003, 0x10, 0x1_0000_0010)]
    #[case(0x7_ffff_ffff, 0, 0x8_0000_0000)]
    fn signals_widen_monotonically(#[case] prev: u64, #[case] low: u32, #[case] want: u64) {
        assert_eq!(widen_signal(prev, low), want);
    }

    #[test]
    fn wr_kind_names() {
        assert_eq!(kind_name((7 << 8) | KIND_WRITE), "RDMA write");
        assert!(kind_name(KIND_ATOMIC).contains("fetch-and-add"));
        assert!(kind_name(KIND_WRITE_IMM).contains("immediate"));
    }
}
