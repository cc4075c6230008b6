//! Point-to-point: NCCL-style groups of sends and receives on any device buffers, one kernel per
//! group on the caller's stream (`p2p_group` in kernels-cu/src/kernels/p2p.cu, where the protocol
//! is described). No host synchronisation and no allocation per call, so a group can be captured
//! in a CUDA graph; the message and chunk counters live on the device and the kernel advances
//! them, so replays stay matched with the peers. The k-th send from a rank to a peer matches the
//! peer's k-th receive from that rank, within a group and across groups, as in NCCL.
//! - [`plan`]: the region layout, chunking and a group's plan (CPU-tested);
//! - [`sendrecv`]: `default_sendrecv_p2p`, nccl-tests' shift exchange as an `Algorithm`;
//! - `zero_copy`: messages from [`ZERO_COPY_MIN_BYTES`] on straight into the receiver's buffer once
//!   its allocation is mapped by the sender (offered and answered on the bootstrap; only a group
//!   being captured waits, a bounded time, for the answers);
//! - [`port`]: [`PortP2pEngine`], the same groups where peers' memory is not mapped (ranks on
//!   several hosts), through PortChannels (`p2p_port_group`).
//!
//! [`PointToPoint`] is whichever of the two engines a communicator has.
//!
//! The counters are the engine's, so its groups must not overlap on the device: a group on another
//! stream than the engine's previous one waits for it (an event recorded after every group and
//! waited for on a stream change, no host block). Under CUDA-graph capture the caller orders the
//! captured work (events of other streams cannot join a capture); for two groups really in flight
//! at once, use two engines.

pub mod plan;
pub mod port;
pub mod sendrecv;
mod zero_copy;

pub use port::PortP2pEngine;
pub use zero_copy::ZERO_COPY_MIN_BYTES;

use crate::geometry;
use crate::resources::{
    param_ptr, CollectionResources, HostMappedBuffer, KernelTable, SharedScratch,
};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::{DevicePtr, Event, Function, Gpu, LaunchConfig, Stream};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::collectives::{CollectiveFile, PeerPtrs, MAX_RANKS};
use mscclpp_kernels_cu::p2p::{
    P2pArgs, P2pMismatch, P2pOpArgs, P2pState, COUNTER_SLOTS, MAX_OPS, OTHER_SIZE,
};
use std::fmt;
use std::sync::{Arc, Mutex};

/// The direction of a point-to-point op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum P2pKind {
    Send,
    Recv,
}

impl fmt::Display for P2pKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            P2pKind::Send => "send to",
            P2pKind::Recv => "recv from",
        })
    }
}

/// One send or receive of a group: `bytes` at `ptr` (any device memory of this rank's GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pOp {
    pub kind: P2pKind,
    pub peer: usize,
    pub ptr: DevicePtr,
    pub bytes: usize,
}

/// Where an engine's region and counters live.
enum Memory {
    /// Its own allocation ([`P2pEngine::new`]), held until the engine goes.
    Own { _region: SharedScratch },
    /// A collection's point-to-point region, claimed until the engine goes
    /// ([`P2pEngine::with_resources`]).
    Borrowed(Arc<CollectionResources>),
}

/// The point-to-point engine of one communicator: the region every peer writes its chunks into
/// (under 1 MiB per rank at 8 ranks), the device counters, and a host-mapped record of the first
/// size mismatch; the region and counters its own ([`P2pEngine::new`]) or a collection's
/// ([`P2pEngine::with_resources`]).
pub struct P2pEngine {
    // Field order is drop order: device resources go before the communicator.
    kernels: KernelTable,
    memory: Memory,
    regions: PeerPtrs,
    local: DevicePtr,
    state: DevicePtr,
    layout: plan::Layout,
    mismatch: HostMappedBuffer,
    zero_copy: zero_copy::ZeroCopy,
    order: GroupOrder,
    max_blocks: u32,
    comm: Arc<Communicator>,
}

impl P2pEngine {
    /// Collective: every rank calls it once; allocates (one 2 MiB granule) and exchanges the region.
    pub fn new(comm: Arc<Communicator>) -> Result<Self> {
        check_world(&comm)?;
        let layout = plan::layout(comm.size());
        // Zeroed memory is P2pState::default(): no message sent or received yet.
        let region = SharedScratch::with_private_tail(
            &comm,
            layout.region_bytes,
            std::mem::size_of::<P2pState>(),
        )?;
        let regions = PeerPtrs::from_slice(&region.rank_ptrs())?;
        let local = region.local_ptr();
        let state = local + layout.region_bytes as u64;
        P2pEngine::build(comm, Memory::Own { _region: region }, regions, local, state)
    }

    /// An engine on the point-to-point region of a collection's resources (the default
    /// collection's: `crate::build_default_algorithms_with_resources`), no allocation of its own;
    /// see `CollectionResources` for why the region is safe beside the collection's algorithms.
    /// Not collective, but every rank must build its engine on the same collection. One engine at
    /// a time holds the region: a second is refused until the first is dropped.
    pub fn with_resources(
        comm: Arc<Communicator>,
        resources: Arc<CollectionResources>,
    ) -> Result<Self> {
        check_world(&comm)?;
        let layout = plan::layout(comm.size());
        let Some(p2p) = resources.claim_p2p() else {
            return Err(Error::InvalidArgument(format!(
                "rank {}: these collection resources have no point-to-point region, or another                  engine holds it",
                comm.rank()
            )));
        };
        if p2p.region.bytes != layout.region_bytes {
            resources.release_p2p();
            return Err(Error::Internal(format!(
                "the collection's point-to-point region has {} bytes, the engine needs {} for {}                  ranks",
                p2p.region.bytes,
                layout.region_bytes,
                comm.size()
            )));
        }
        let (regions, local, state) = (p2p.region.peers, p2p.region.local, p2p.state);
        // On failure the engine is not built, so its Drop does not release: do it here.
        P2pEngine::build(
            comm,
            Memory::Borrowed(resources.clone()),
            regions,
            local,
            state,
        )
        .inspect_err(|_| resources.release_p2p())
    }

    fn build(
        comm: Arc<Communicator>,
        memory: Memory,
        regions: PeerPtrs,
        local: DevicePtr,
        state: DevicePtr,
    ) -> Result<Self> {
        let layout = plan::layout(comm.size());
        // Every counter has a copy per block index (p2p.cu, "Order"), so the grid stays within them.
        let max_blocks = geometry::Residency::of(&comm)?
            .max_blocks(plan::MAX_BLOCK_THREADS)
            .min(COUNTER_SLOTS as u32);
        let mismatch = HostMappedBuffer::zeroed(comm.gpu(), std::mem::size_of::<P2pMismatch>())?;
        let table = state + std::mem::offset_of!(P2pState, zc_table) as u64;
        let zero_copy = zero_copy::ZeroCopy::new(comm.gpu().clone(), table)?;
        let order = GroupOrder::new(comm.gpu().clone())?;
        Ok(P2pEngine {
            kernels: KernelTable::default(),
            memory,
            regions,
            local,
            state,
            layout,
            mismatch,
            zero_copy,
            order,
            max_blocks,
            comm,
        })
    }

    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
    }

    /// Whether the engine's memory is a collection's ([`Self::with_resources`]).
    pub fn borrows(&self) -> bool {
        matches!(self.memory, Memory::Borrowed(_))
    }

    /// Bytes of device memory the engine uses on this rank (its own allocation's, or of the
    /// collection's allocation, see [`Self::borrows`]).
    pub fn device_bytes(&self) -> usize {
        self.layout.region_bytes + std::mem::size_of::<P2pState>()
    }

    /// Receives launched with a zero-copy word so far (from [`ZERO_COPY_MIN_BYTES`], once the
    /// sender mapped the buffer's allocation).
    pub fn zero_copy_receives(&self) -> u64 {
        self.zero_copy.receives()
    }

    /// Bytes that the sender wrote straight into this rank's buffer of the last receive from
    /// `peer` launched with a zero-copy word (0 where that message took the slots). A synchronous
    /// device read, for checks.
    pub fn last_zero_copied_bytes(&self, peer: usize) -> Result<u64> {
        let rank = self.comm.rank();
        if peer == rank || peer >= self.comm.size() {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: no zero-copy channel from rank {peer}"
            )));
        }
        let index = if peer < rank { peer } else { peer - 1 };
        // P2pZeroCopy::done of the channel's entry (p2p.cu): the message's tag and its bytes.
        let done = self.local + (self.layout.zc_offset + 16 * index + 8) as u64;
        let mut word = [0u8; 8];
        self.comm.gpu().copy_from_device(&mut word, done)?;
        Ok(u64::from_le_bytes(word) & ((1 << 40) - 1))
    }

    /// The first send/receive size mismatch the device saw on this rank, naming both ranks.
    pub fn mismatch(&self) -> Option<String> {
        read_mismatch(self.comm.rank(), &self.mismatch)
    }

    /// The engine's health, one host load or two, no sync: a size mismatch seen on the device
    /// (naming rank and peer), else the communicator's error.
    pub fn check(&self) -> Result<()> {
        if let Some(m) = self.mismatch() {
            return Err(Error::InvalidArgument(m));
        }
        self.comm.check("send/recv")
    }

    /// The host work of [`run`](Self::run) that must come before any rank of this process
    /// launches (see `Algorithm::prepare`): compiling and loading the kernel.
    pub fn prepare(&self) -> Result<()> {
        self.check()?;
        self.function().map(|_| ())
    }

    fn function(&self) -> Result<Function> {
        self.kernels.function(
            self.comm.gpu().as_ref(),
            CollectiveFile::P2p,
            None,
            "p2p_group",
        )
    }

    /// Runs one group: every op of `ops` as one kernel on `stream`, without waiting for it.
    /// Every rank named as a peer must run its matching ops (in the same order per direction);
    /// errors on the device (a mismatch, a dead peer) show up in [`check`](Self::check) and the
    /// communicator's `async_error`.
    pub fn run(&self, ops: &[P2pOp], stream: &Stream) -> Result<()> {
        self.check()?;
        if ops.is_empty() {
            return Ok(());
        }
        let (rank, n) = (self.comm.rank(), self.comm.size());
        let mut planned = plan::plan(rank, n, ops, &self.layout, self.max_blocks)?;
        self.zero_copy.mark(&self.comm, &mut planned, *stream)?;
        let Some(last) = planned.last() else {
            return Ok(());
        };
        let blocks = last.first_block + last.nblocks;
        let mut kargs = P2pArgs {
            regions: self.regions,
            local: self.local,
            state: self.state,
            mismatch: self.mismatch.device_ptr(),
            error_word: self.comm.error_word_device_ptr(),
            max_spin: 0,
            slot_bytes: self.layout.slot_bytes as u64,
            headers_offset: self.layout.headers_offset as u64,
            acks_offset: self.layout.acks_offset as u64,
            posts_offset: self.layout.posts_offset as u64,
            zc_offset: self.layout.zc_offset as u64,
            zc_staging: self.zero_copy.staging(),
            slots: self.layout.slots as u32,
            rank: rank as u32,
            nranks: n as u32,
            nops: planned.len() as u32,
            ops: [P2pOpArgs::default(); MAX_OPS],
        };
        kargs.ops[..planned.len()].copy_from_slice(&planned);
        let f = self.function()?;
        let threads = plan::block_threads(&planned, &self.layout);
        // Only when asked for: this is every eager call's path.
        if tracing::enabled!(target: "mscclpp::coll", tracing::Level::DEBUG)
            && planned.iter().any(zero_copy::large)
        {
            tracing::debug!(target: "mscclpp::coll",
                "rank {rank}: p2p group of {blocks} blocks of {threads} threads: {}",
                planned.iter().map(|op| format!("(kind {} peer {} bytes {} blocks {} aux {:#x})",
                    op.kind, op.peer, op.bytes, op.nblocks, op.aux)).collect::<Vec<_>>().join(" "));
        }
        // As the natives' (NativeContext::launch): outside capture a cached one-kernel graph
        // costs the calling thread less than a plain launch.
        let fast = self.comm.fast_launches();
        let cfg = LaunchConfig::linear(blocks, threads)
            .with_programmatic(fast)
            .with_cached_graph(fast);
        let mut params = [param_ptr(&mut kargs)];
        let gpu = self.comm.gpu();
        // SAFETY: `params` matches the kernel's one `P2pArgs` parameter (layout checked by the NVRTC
        // test's static_asserts); the op buffers are the caller's, checked non-null where they
        // carry bytes, and the region, counters and record are ours and live.
        let launch = || unsafe { gpu.launch(f, cfg, *stream, &mut params) };
        self.order
            .launch(*stream, gpu.is_capturing(*stream)?, launch)
    }
}

/// The order of one engine's groups on the device. The counters are the engine's, so its groups
/// must not overlap: a group launched outside a capture on another stream than the engine's
/// previous one waits for it (an event recorded after every such group, waited for on a stream
/// change; no host block). A capture orders its work itself (events of other streams cannot join
/// it).
struct GroupOrder {
    /// The stream of the last group launched outside a capture, and an event recorded after it.
    last: Mutex<(Option<Stream>, Event)>,
    gpu: Arc<dyn Gpu>,
}

impl GroupOrder {
    fn new(gpu: Arc<dyn Gpu>) -> Result<GroupOrder> {
        Ok(GroupOrder {
            last: Mutex::new((None, gpu.create_event()?)),
            gpu,
        })
    }

    /// Runs `launch`, the launch of one group on `stream` (`capturing`: whether the stream is
    /// being captured), after the engine's previous group.
    fn launch(
        &self,
        stream: Stream,
        capturing: bool,
        launch: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if capturing {
            return launch();
        }
        let mut order = self.last.lock().map_err(|_| {
            Error::Internal("a p2p engine's stream order was poisoned by a panic".into())
        })?;
        let (last, event) = &mut *order;
        if last.is_some_and(|s| s != stream) {
            self.gpu.stream_wait_event(stream, *event)?;
        }
        launch()?;
        self.gpu.record_event(*event, stream)?;
        *last = Some(stream);
        Ok(())
    }
}

impl Drop for GroupOrder {
    fn drop(&mut self) {
        if let Ok((_, event)) = self.last.get_mut().map(|o| *o) {
            let _ = self.gpu.destroy_event(event);
        }
    }
}

/// The mismatch record `record` of `rank` as [`describe_mismatch`] words it.
fn read_mismatch(rank: usize, record: &HostMappedBuffer) -> Option<String> {
    // SAFETY: the record is live pinned memory of a P2pMismatch; the device writes it before it
    // raises the error word, and a torn read only garbles the message of an error already raised.
    let m = unsafe { std::ptr::read_volatile(record.host_ptr() as *const P2pMismatch) };
    describe_mismatch(rank, &m)
}

/// A communicator's point-to-point engine: [`P2pEngine`] where every peer's memory is mapped (one
/// host), [`PortP2pEngine`] where it is not (ranks on several hosts).
pub enum PointToPoint {
    Mapped(P2pEngine),
    Port(PortP2pEngine),
}

impl PointToPoint {
    /// Runs one group (the engine's `run`).
    pub fn run(&self, ops: &[P2pOp], stream: &Stream) -> Result<()> {
        match self {
            PointToPoint::Mapped(e) => e.run(ops, stream),
            PointToPoint::Port(e) => e.run(ops, stream),
        }
    }

    /// The host work of `run` that must come before any rank of this process launches.
    pub fn prepare(&self) -> Result<()> {
        match self {
            PointToPoint::Mapped(e) => e.prepare(),
            PointToPoint::Port(e) => e.prepare(),
        }
    }

    /// The engine's health, no sync: a size mismatch, a proxy error, the communicator's error.
    pub fn check(&self) -> Result<()> {
        match self {
            PointToPoint::Mapped(e) => e.check(),
            PointToPoint::Port(e) => e.check(),
        }
    }

    /// The first send/receive size mismatch the device saw on this rank, naming both ranks.
    pub fn mismatch(&self) -> Option<String> {
        match self {
            PointToPoint::Mapped(e) => e.mismatch(),
            PointToPoint::Port(e) => e.mismatch(),
        }
    }
}

/// The message of `rank`'s mismatch record `m`, if one was claimed: names `rank` once, as its
/// first words (callers print it as it is), and the peer.
fn describe_mismatch(rank: usize, m: &P2pMismatch) -> Option<String> {
    (m.claimed != 0).then(|| {
        let (verb, dir, their_verb) = if m.is_send != 0 {
            ("send", "to", "receives")
        } else {
            ("recv", "from", "sends")
        };
        let theirs = if m.theirs == OTHER_SIZE {
            "a message of another size".to_string()
        } else {
            format!("{} bytes", m.theirs)
        };
        format!(
            "rank {rank}: {verb} of {} bytes {dir} rank {}, but rank {} {their_verb} {theirs} \
             (a send/recv pair with mismatched sizes; nothing was copied for it)",
            m.mine, m.peer, m.peer
        )
    })
}

/// The engine's counters and region layout cover at most `MAX_RANKS` ranks.
fn check_world(comm: &Communicator) -> Result<()> {
    if comm.size() > MAX_RANKS {
        return Err(Error::Unsupported(format!(
            "point-to-point engine on {} ranks: at most {MAX_RANKS} ranks on one host",
            comm.size()
        )));
    }
    Ok(())
}

impl Drop for P2pEngine {
    fn drop(&mut self) {
        if let Memory::Borrowed(resources) = &self.memory {
            resources.release_p2p();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatch_names_its_rank_once_and_the_peer() {
        assert_eq!(describe_mismatch(1, &P2pMismatch::default()), None);
        let recv = P2pMismatch {
            claimed: 1,
            is_send: 0,
            peer: 0,
            mine: 1 << 20,
            theirs: (1 << 20) + 100,
        };
        let m = describe_mismatch(1, &recv).expect("claimed");
        assert!(
            m.starts_with(
                "rank 1: recv of 1048576 bytes from rank 0, but rank 0 sends 1048676 bytes"
            ),
            "{m}"
        );
        assert_eq!(m.matches("rank 1").count(), 1, "{m}");
        let send = P2pMismatch {
            is_send: 1,
            peer: 3,
            theirs: OTHER_SIZE,
            ..recv
        };
        let m = describe_mismatch(2, &send).expect("claimed");
        assert!(
            m.starts_with("rank 2: send of 1048576 bytes to rank 3, but rank 3 receives a message of another size"),
            "{m}"
        );
    }
}
