//! [`PortP2pEngine`]: NCCL-style groups of sends and receives where peers' memory is not mapped
//! (ranks on several hosts), through PortChannels: the kernel (`p2p_port_group` in
//! kernels-cu/src/kernels/p2p.cu, "Across hosts", where the protocol is described) stages each
//! chunk and asks this process's proxy to put it into the peer's inbound slots, and the receiver
//! copies it out and returns a credit. The same calls as [`P2pEngine`](super::P2pEngine): one kernel
//! per group on the caller's stream, no host synchronisation and no allocation per call, legal
//! under CUDA-graph capture; the k-th send from a rank to a peer matches the peer's k-th receive
//! from it, within a group and across groups.
//!
//! # Setup (collective: every rank builds its engine at the same point of its communicator setup)
//! - Inbound slots ([`SharedScratch`], exchanged: on another host a peer's address is the one in
//!   its owner's process, which the transports name) with the device counters behind them, and
//!   staging slots of the same size with the channel handles behind them ([`PortLayout`]:
//!   [`PORT_SLOTS`] slots per peer and direction, within [`PORT_BUDGET`] for both): two
//!   allocations, as every allocation takes whole 2 MiB granules. And a host-mapped mismatch
//!   record.
//! - A [`PortChannelService`]: per peer in rank order two connections (CudaIpc on this host, IB
//!   or Ethernet to another: [`proxy_connections`]), one for the data channel and one for the
//!   credit channel, a semaphore on each, and the channels (dst = the peer's inbound slots, src =
//!   the staging slots). Two connections because an IB connection in write-with-immediate mode
//!   delivers its signals into one semaphore only. Then the proxy starts.
//!
//! Refuses to start under [`shared_queue_hazard`] (its kernel waits for the proxy's copies, which
//! would queue behind it), and on more than [`MAX_PORT_RANKS`] ranks.
//!
//! # Groups in flight
//! Every group needs this process's proxy (and Ethernet receiver), which make CUDA calls of their
//! own: an eager caller that queues groups without bound fills the driver's launch queue and
//! stalls them, as for `port_allreduce` (its module docs, "Segments in flight"). So outside a
//! capture, and where no other rank runs in this process, at most three marks' worth of groups
//! are queued (`port_allreduce::Marks`).

use super::plan::{self, check_op_count, check_ops, self_copy_source, self_sends};
use super::{read_mismatch, GroupOrder, P2pKind, P2pOp};
use crate::geometry::Residency;
use crate::port_allreduce::{proxy_connections, Marks};
use crate::resources::{param_ptr, DeviceBuffer, HostMappedBuffer, KernelTable, SharedScratch};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::device::PortChannelHandle;
use mscclpp_core::env::Env;
use mscclpp_core::gpu::{DevicePtr, Function, LaunchConfig, Stream};
use mscclpp_core::port_channel::{shared_queue_hazard, PortChannelConfig, PortChannelService};
use mscclpp_core::transport::MemoryRegion;
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::collectives::CollectiveFile;
use mscclpp_kernels_cu::p2p::{
    P2pMismatch, P2pPortArgs, P2pPortLane, P2pPortOp, P2pPortState, KIND_COPY, KIND_RECV,
    KIND_SEND, MAX_OPS, MAX_PORT_RANKS, PORT_HEADER_BYTES, PORT_SLOTS, PORT_THREADS,
};
use std::sync::{Arc, Mutex};

/// The kernel's entry point.
pub const ENTRY: &str = "p2p_port_group";
/// Device bytes of the engine's two allocations (inbound slots with the counters, staging slots
/// with the channel handles), at most: one 2 MiB granule each. The engine sits beside a multi-host
/// collection of about 26 MiB per rank (`DEFAULT_SCRATCH_BYTES`' docs), and a communicator keeps
/// to 32 MiB.
pub const PORT_BUDGET: usize = 4 << 20;
/// Chunk (slot data) size bounds. Every chunk costs a put, a signal and a credit through the proxy,
/// so chunks are as large as the budget allows up to 64 KiB (four in flight per lane, 256 KiB a
/// round trip); below 4 KiB they would cost more than they move.
pub const MAX_SLOT_BYTES: usize = 64 << 10;
pub const MIN_SLOT_BYTES: usize = plan::MIN_SLOT_BYTES;
/// The name errors and logs give the engine.
const WHAT: &str = "send/recv across hosts";

/// Where slots are in each rank's inbound and staging memory (the same on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortLayout {
    pub nranks: usize,
    /// Data bytes of a slot: a multiple of 4 KiB.
    pub slot_bytes: usize,
}

impl PortLayout {
    /// The layout on `nranks` ranks: the largest slots within [`PORT_BUDGET`] for the inbound and
    /// staging slots together, whole 4 KiB pages up to [`MAX_SLOT_BYTES`] (64 KiB up to 7 ranks,
    /// 60 KiB at 8, 28 KiB at 16, 4 KiB at 64). Unsupported beyond [`MAX_PORT_RANKS`] ranks.
    pub fn new(nranks: usize) -> Result<PortLayout> {
        if !(1..=MAX_PORT_RANKS).contains(&nranks) {
            return Err(Error::Unsupported(format!(
                "{WHAT} on {nranks} ranks: the PortChannel engine takes 1..={MAX_PORT_RANKS} ranks"
            )));
        }
        // Each allocation's slots leave room in its granule for what follows them (the larger
        // of the counters and the channel handles at the largest world).
        let tail = std::mem::size_of::<P2pPortState>().max(channels_bytes(MAX_PORT_RANKS));
        let stride = (PORT_BUDGET / 2 - tail) / (nranks * PORT_SLOTS);
        let slot_bytes = ((stride - PORT_HEADER_BYTES) / MIN_SLOT_BYTES * MIN_SLOT_BYTES)
            .clamp(MIN_SLOT_BYTES, MAX_SLOT_BYTES);
        Ok(PortLayout { nranks, slot_bytes })
    }

    /// Bytes from one slot to the next: its header, then its data.
    pub fn stride(&self) -> usize {
        PORT_HEADER_BYTES + self.slot_bytes
    }

    /// Bytes of the inbound slots, and of the staging slots: [`PORT_SLOTS`] per rank.
    pub fn region_bytes(&self) -> usize {
        self.nranks * PORT_SLOTS * self.stride()
    }

    /// Offset of slot `slot` of `rank` (inbound: written by `rank`; staging: put towards it).
    pub fn slot_offset(&self, rank: usize, slot: usize) -> u64 {
        ((rank * PORT_SLOTS + slot) * self.stride()) as u64
    }
}

/// Bytes of the channel handles on `nranks` ranks: a data and a credit channel per rank.
fn channels_bytes(nranks: usize) -> usize {
    2 * nranks * std::mem::size_of::<PortChannelHandle>()
}

/// One group as the kernel runs it: the ops lane by lane, and the lanes (one block each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lanes {
    pub ops: Vec<P2pPortOp>,
    pub lanes: Vec<P2pPortLane>,
}

/// The lanes of one group of `rank` of `nranks` (see p2p.cu, "Across hosts"): every op of one
/// (peer, direction) in one lane, in the caller's order, lanes in the order of their first ops;
/// each receive from `rank` itself paired with the next send to itself into a copy, a lane of its
/// own. Errors name the rank and the op (as [`plan::plan`]'s).
pub fn plan_lanes(rank: usize, nranks: usize, ops: &[P2pOp]) -> Result<Lanes> {
    check_ops(rank, nranks, ops)?;
    let mut self_pairs = self_sends(rank, ops)?.into_iter();
    let mut lanes: Vec<Vec<P2pPortOp>> = Vec::new();
    for op in ops {
        let mut item = P2pPortOp {
            ptr: op.ptr,
            aux: 0,
            bytes: op.bytes as u64,
            kind: match op.kind {
                P2pKind::Send => KIND_SEND,
                P2pKind::Recv => KIND_RECV,
            },
            peer: op.peer as u32,
        };
        if op.peer == rank {
            if op.kind == P2pKind::Send {
                continue;
            }
            item.kind = KIND_COPY;
            item.aux = self_copy_source(rank, self_pairs.next(), op)?;
            lanes.push(vec![item]);
            continue;
        }
        match lanes
            .iter_mut()
            .find(|l| l[0].kind == item.kind && l[0].peer == item.peer)
        {
            Some(lane) => lane.push(item),
            None => lanes.push(vec![item]),
        }
    }
    check_op_count(rank, lanes.iter().map(Vec::len).sum())?;
    let mut out = Lanes {
        ops: Vec::with_capacity(MAX_OPS),
        lanes: Vec::with_capacity(lanes.len()),
    };
    for lane in lanes {
        out.lanes.push(P2pPortLane {
            first: out.ops.len() as u32,
            count: lane.len() as u32,
            kind: lane[0].kind,
            peer: lane[0].peer,
        });
        out.ops.extend(lane);
    }
    Ok(out)
}

/// The point-to-point engine of one communicator whose peers' memory is not mapped. See the module
/// docs.
pub struct PortP2pEngine {
    // Field order is drop order, as in `PortAllreduce`: the service first (its proxy drains and
    // stops before anything it copies from or into goes), the inbound slots after the staging
    // slots (their drop waits, at a bootstrap barrier, until every peer dropped its service, so no
    // peer's proxy still writes into them), the mismatch record after the inbound slots (whose
    // drop waits for this process's kernels after a failure).
    // In a mutex because the service is `Send` but not `Sync`; only the host-side checks take it.
    service: Mutex<PortChannelService>,
    /// The staging slots, then the channel handles.
    staging: DeviceBuffer,
    /// The inbound slots, then the counters (`P2pPortState`).
    inbound: SharedScratch,
    mismatch: HostMappedBuffer,
    kernels: KernelTable,
    marks: Mutex<Marks>,
    order: GroupOrder,
    layout: PortLayout,
    max_blocks: u32,
    comm: Arc<Communicator>,
}

impl PortP2pEngine {
    /// Collective: builds the engine of `comm` (see the module docs). `config` sets the proxy
    /// (FIFO depth, flush timeout) and the device waits' spin bound.
    pub fn new(comm: Arc<Communicator>, config: PortChannelConfig) -> Result<Self> {
        // Its kernel waits for the proxy's copies: on one hardware queue they wait behind it.
        if let Some(hazard) = shared_queue_hazard(Env::get()?, comm.mps_clients_per_gpu()) {
            return Err(Error::Unsupported(format!("{WHAT}: {hazard}")));
        }
        let (rank, nranks) = (comm.rank(), comm.size());
        let layout = PortLayout::new(nranks)?;
        let gpu = comm.gpu().clone();
        gpu.set_device(comm.device())?;
        let max_blocks = Residency::of(&comm)?.max_blocks(PORT_THREADS);
        let bytes = layout.region_bytes();
        // Zeroed memory is a state with nothing sent or received yet.
        let inbound =
            SharedScratch::with_private_tail(&comm, bytes, std::mem::size_of::<P2pPortState>())?;
        let staging = DeviceBuffer::zeroed(&gpu, bytes + channels_bytes(nranks))?;
        let mismatch = HostMappedBuffer::zeroed(&gpu, std::mem::size_of::<P2pMismatch>())?;
        let mut service = PortChannelService::new(&comm, config)?;
        let src = service.add_memory_region(MemoryRegion {
            addr: staging.ptr(),
            size: bytes as u64,
            key: 0,
        })?;
        let peers: Vec<usize> = (0..nranks).filter(|&p| p != rank).collect();
        let buffers = [(inbound.local_ptr(), bytes), (staging.ptr(), bytes)];
        let data = proxy_connections(&comm, &peers, &buffers)?;
        let credit = proxy_connections(&comm, &peers, &buffers)?;
        let inbound_ptrs = inbound.rank_ptrs();
        // Indexed by rank, data and credit channel; this rank's entries stay zero.
        let mut handles = vec![PortChannelHandle::default(); 2 * nranks];
        for ((&peer, data), credit) in peers.iter().zip(data).zip(credit) {
            let addr = *inbound_ptrs.get(peer).ok_or_else(|| {
                Error::Internal(format!("{WHAT}: no inbound slots of rank {peer}"))
            })?;
            let dst = service.add_memory_region(MemoryRegion {
                addr,
                size: bytes as u64,
                key: 0,
            })?;
            for (i, conn) in [data, credit].into_iter().enumerate() {
                let sem = service.add_semaphore(&comm, conn).map_err(|e| {
                    Error::Internal(format!("{WHAT}: semaphore towards rank {peer}: {e}"))
                })?;
                handles[2 * peer + i] = service.port_channel(sem, dst, src)?;
            }
        }
        staging.write(bytes, &handles)?;
        let marks = Mutex::new(Marks::new(gpu.clone())?);
        let order = GroupOrder::new(gpu)?;
        service.start()?;
        Ok(PortP2pEngine {
            service: Mutex::new(service),
            staging,
            inbound,
            mismatch,
            kernels: KernelTable::default(),
            marks,
            order,
            layout,
            max_blocks,
            comm,
        })
    }

    pub fn layout(&self) -> PortLayout {
        self.layout
    }

    /// Bytes of device memory the engine uses on this rank: inbound and staging slots, counters,
    /// channel handles (in two allocations, each rounded up to whole 2 MiB granules).
    pub fn device_bytes(&self) -> usize {
        2 * self.layout.region_bytes()
            + std::mem::size_of::<P2pPortState>()
            + channels_bytes(self.layout.nranks)
    }

    /// The device address of the channel handles.
    fn channels(&self) -> DevicePtr {
        self.staging.ptr() + self.layout.region_bytes() as u64
    }

    /// The device address of the counters.
    fn state(&self) -> DevicePtr {
        self.inbound.local_ptr() + self.layout.region_bytes() as u64
    }

    /// The first send/receive size mismatch the device saw on this rank, naming both ranks.
    pub fn mismatch(&self) -> Option<String> {
        read_mismatch(self.comm.rank(), &self.mismatch)
    }

    /// The engine's health, no sync: a size mismatch seen on the device (naming rank and peer),
    /// else a proxy error, else the communicator's error.
    pub fn check(&self) -> Result<()> {
        if let Some(m) = self.mismatch() {
            return Err(Error::InvalidArgument(m));
        }
        self.check_proxy()?;
        self.comm.check("send/recv")
    }

    /// The first proxy error not reported yet (a failed copy, signal or flush).
    fn check_proxy(&self) -> Result<()> {
        let service = self.service.lock().map_err(|_| {
            Error::Internal(format!("{WHAT}: the proxy service was poisoned by a panic"))
        })?;
        service
            .check()
            .map_err(|e| Error::Internal(format!("{WHAT}: the PortChannel proxy reported: {e}")))
    }

    /// The host work of [`run`](Self::run) that must come before any rank of this process
    /// launches (see `Algorithm::prepare`): compiling and loading the kernel.
    pub fn prepare(&self) -> Result<()> {
        self.check()?;
        self.function().map(|_| ())
    }

    fn function(&self) -> Result<Function> {
        self.kernels
            .function(self.comm.gpu().as_ref(), CollectiveFile::P2p, None, ENTRY)
    }

    /// Runs one group: every op of `ops` as one kernel on `stream`, without waiting for it (but
    /// see "Groups in flight" in the module docs). Every rank named as a peer must run its
    /// matching ops (in the same order per direction); errors on the device (a mismatch, a dead
    /// peer) show up in [`check`](Self::check) and the communicator's `async_error`.
    pub fn run(&self, ops: &[P2pOp], stream: &Stream) -> Result<()> {
        self.check()?;
        if ops.is_empty() {
            return Ok(());
        }
        let rank = self.comm.rank();
        let planned = plan_lanes(rank, self.layout.nranks, ops)?;
        let nlanes = planned.lanes.len() as u32;
        // Lanes wait for their peers' lanes, not for each other, but every one must be resident.
        if nlanes > self.max_blocks {
            return Err(Error::Unsupported(format!(
                "rank {rank}: a group of {nlanes} (peer, direction) lanes needs one resident block \
                 each, and this GPU holds {}",
                self.max_blocks
            )));
        }
        let mut kargs = P2pPortArgs {
            channels: self.channels(),
            inbound: self.inbound.local_ptr(),
            staging: self.staging.ptr(),
            state: self.state(),
            mismatch: self.mismatch.device_ptr(),
            error_word: self.comm.error_word_device_ptr(),
            slot_bytes: self.layout.slot_bytes as u64,
            rank: rank as u32,
            nlanes,
            ops: [P2pPortOp::default(); MAX_OPS],
            lanes: [P2pPortLane::default(); MAX_OPS],
        };
        kargs.ops[..planned.ops.len()].copy_from_slice(&planned.ops);
        kargs.lanes[..planned.lanes.len()].copy_from_slice(&planned.lanes);
        let f = self.function()?;
        // Plain launches, as `port_allreduce`'s: building a cached launch graph is driver work
        // that may wait on kernels that wait for this process's proxy.
        let cfg = LaunchConfig::linear(nlanes, PORT_THREADS);
        let mut params = [param_ptr(&mut kargs)];
        let gpu = self.comm.gpu();
        let capturing = gpu.is_capturing(*stream)?;
        // SAFETY: `params` matches the kernel's one `P2pPortArgs` parameter (layout checked by the
        // NVRTC test's static_asserts); the op buffers are the caller's, checked non-null where
        // they carry bytes, and the slots, counters, channels and record are ours and live.
        let launch = || unsafe { gpu.launch(f, cfg, *stream, &mut params) };
        self.order.launch(*stream, capturing, launch)?;
        if capturing || self.comm.shares_process() {
            return Ok(());
        }
        let mut marks = self.marks.lock().map_err(|_| {
            Error::Internal(format!(
                "{WHAT}: the in-flight marks were poisoned by a panic"
            ))
        })?;
        marks.segment_enqueued(*stream, |mark| {
            // Bounded too by the device wait budget of every queued kernel's waits.
            self.comm
                .wait_event(mark, *stream, "send/recv", &|| self.check_proxy())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::gpu::plain_allocation_bytes;
    use rstest::rstest;
    use std::mem::size_of;

    /// Three thread ranks on the host test GPU build their engines (the collective setup: slots
    /// exchanged, two connections, semaphores and channels per peer, the proxy started) and tear
    /// them down; the channel table has a data and a credit channel per peer, each with its own
    /// semaphore and both into the peer's inbound slots, and nothing for the rank itself. On a
    /// GPU of one SM, a group of more lanes than its resident blocks is refused before launch.
    #[test]
    fn engines_build_and_tear_down_on_loopback_ranks() {
        use mscclpp_core::bootstrap::on_loopback_ranks;
        use mscclpp_core::port_channel::test_gpu::HostGpu;
        let n = 3;
        let tables = on_loopback_ranks(n, std::time::Duration::from_secs(30), move |rank, boot| {
            let gpu = Arc::new(HostGpu::new().with_multiprocessors(1));
            let comm = Arc::new(Communicator::new(boot, gpu.clone(), 0).expect("communicator"));
            let engine =
                PortP2pEngine::new(comm, PortChannelConfig::default()).expect("the engine");
            engine.check().expect("a healthy engine");
            assert_eq!(engine.mismatch(), None);
            let layout = PortLayout::new(n).unwrap();
            assert_eq!(engine.layout(), layout);
            assert!(engine.device_bytes() > 2 * layout.region_bytes());
            let stream = Stream::DEFAULT;
            engine
                .run(&[], &stream)
                .expect("an empty group is nothing to do");
            let stray = [op(P2pKind::Send, n, 1)];
            let e = engine.run(&stray, &stream).unwrap_err().to_string();
            assert!(e.contains(&format!("peer {n} is not a rank")), "{e}");
            let all: Vec<P2pOp> = (0..n)
                .flat_map(|p| [op(P2pKind::Send, p, 8), op(P2pKind::Recv, p, 8)])
                .collect();
            let e = engine.run(&all, &stream).unwrap_err();
            assert!(matches!(e, Error::Unsupported(_)), "{e}");
            assert!(
                e.to_string()
                    .contains(&format!("{} (peer, direction) lanes", 2 * n - 1)),
                "{e}"
            );
            let size = std::mem::size_of::<PortChannelHandle>();
            let mut raw = vec![0u8; 2 * n * size];
            use mscclpp_core::gpu::Gpu;
            gpu.copy_from_device(&mut raw, engine.channels())
                .expect("the channel table");
            let handles: Vec<PortChannelHandle> = raw
                .chunks(size)
                // SAFETY: each chunk holds the bytes of one uploaded `#[repr(C)]` handle.
                .map(|c| unsafe {
                    std::ptr::read_unaligned(c.as_ptr() as *const PortChannelHandle)
                })
                .collect();
            (rank, handles)
        });
        for (rank, handles) in tables {
            for peer in 0..n {
                let (data, credit) = (handles[2 * peer], handles[2 * peer + 1]);
                if peer == rank {
                    assert_eq!(
                        (data, credit),
                        Default::default(),
                        "rank {rank}'s own entries"
                    );
                    continue;
                }
                assert_ne!(
                    data.semaphore_id, credit.semaphore_id,
                    "rank {rank}, peer {peer}"
                );
                assert_ne!(data.semaphore.inbound, credit.semaphore.inbound);
                assert_eq!(data.dst_memory_id, credit.dst_memory_id);
                assert_eq!(data.src_memory_id, credit.src_memory_id);
                assert_ne!(data.dst_memory_id, data.src_memory_id);
            }
        }
    }

    fn op(kind: P2pKind, peer: usize, bytes: usize) -> P2pOp {
        P2pOp {
            kind,
            peer,
            ptr: 0x1000 * (peer as u64 + 1)
                + bytes as u64
                + u64::from(kind == P2pKind::Recv) * (1 << 40),
            bytes,
        }
    }

    /// (kind, peer, bytes) of each lane's ops, lane by lane.
    fn shape(l: &Lanes) -> Vec<Vec<(u32, u32, u64)>> {
        l.lanes
            .iter()
            .map(|lane| {
                assert!(l.ops[lane.first as usize..][..lane.count as usize]
                    .iter()
                    .all(|o| o.kind == lane.kind && o.peer == lane.peer));
                l.ops[lane.first as usize..][..lane.count as usize]
                    .iter()
                    .map(|o| (o.kind, o.peer, o.bytes))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn lanes_keep_the_callers_order_per_peer_and_direction() {
        use P2pKind::{Recv, Send};
        let ops = [
            op(Send, 1, 10),
            op(Recv, 2, 20),
            op(Send, 2, 30),
            op(Send, 1, 0),
            op(Recv, 2, 40),
            op(Recv, 1, 50),
            op(Send, 1, 60),
        ];
        let l = plan_lanes(0, 3, &ops).unwrap();
        assert_eq!(
            shape(&l),
            vec![
                vec![(KIND_SEND, 1, 10), (KIND_SEND, 1, 0), (KIND_SEND, 1, 60)],
                vec![(KIND_RECV, 2, 20), (KIND_RECV, 2, 40)],
                vec![(KIND_SEND, 2, 30)],
                vec![(KIND_RECV, 1, 50)],
            ]
        );
        // Lanes tile the ops, in order.
        let mut next = 0;
        for lane in &l.lanes {
            assert_eq!(lane.first, next);
            next += lane.count;
        }
        assert_eq!(next as usize, l.ops.len());
        assert_eq!(l.ops[0].ptr, ops[0].ptr);
    }

    #[test]
    fn self_sends_pair_in_order_into_copy_lanes() {
        use P2pKind::{Recv, Send};
        let ops = [
            op(Send, 1, 7),
            op(Send, 1, 8),
            op(Recv, 1, 7),
            op(Send, 1, 100),
            op(Recv, 0, 3),
            op(Recv, 1, 8),
            op(Recv, 1, 100),
        ];
        let l = plan_lanes(1, 2, &ops).unwrap();
        let copies: Vec<&P2pPortOp> = l.ops.iter().filter(|o| o.kind == KIND_COPY).collect();
        assert_eq!(copies.len(), 3);
        // A receive of `rank` from itself takes the next send to itself.
        assert_eq!((copies[0].ptr, copies[0].aux), (ops[2].ptr, ops[0].ptr));
        assert_eq!((copies[1].ptr, copies[1].aux), (ops[5].ptr, ops[1].ptr));
        assert_eq!((copies[2].ptr, copies[2].aux), (ops[6].ptr, ops[3].ptr));
        assert_eq!(l.ops.len(), 4, "three copies and the receive from rank 0");
        // One lane per copy.
        let copy_lanes = l.lanes.iter().filter(|x| x.kind == KIND_COPY).count();
        assert_eq!(copy_lanes, 3);
        assert!(l.lanes.iter().all(|x| x.kind != KIND_COPY || x.count == 1));
    }

    #[test]
    fn self_size_mismatches_and_unpaired_self_ops_are_refused() {
        use P2pKind::{Recv, Send};
        let bad = [op(Send, 2, 100), op(Recv, 2, 99)];
        let err = plan_lanes(2, 3, &bad).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let m = err.to_string();
        assert!(
            m.contains("rank 2") && m.contains("the send has 100 bytes, the receive 99"),
            "{m}"
        );
        let lonely = [op(Send, 2, 100), op(Send, 0, 1)];
        let err = plan_lanes(2, 3, &lonely).unwrap_err().to_string();
        assert!(
            err.contains("rank 2") && err.contains("1 sends to itself"),
            "{err}"
        );
    }

    #[test]
    fn bad_ops_and_message_sizes_are_refused() {
        use P2pKind::{Recv, Send};
        let err = plan_lanes(0, 2, &[op(Send, 2, 1)]).unwrap_err();
        assert!(err.to_string().contains("peer 2 is not a rank"), "{err}");
        let mut null = op(Recv, 1, 8);
        null.ptr = 0;
        let err = plan_lanes(0, 2, &[null]).unwrap_err();
        assert!(err.to_string().contains("null buffer"), "{err}");
        null.bytes = 0;
        assert!(plan_lanes(0, 2, &[null]).is_ok());
        // Message sizes travel in the 40 low bits of the header's word.
        let largest = op(Send, 1, (1 << 40) - 1);
        assert!(plan_lanes(0, 2, &[largest]).is_ok());
        let huge = op(Send, 1, 1 << 40);
        let err = plan_lanes(0, 2, &[huge]).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("largest message"), "{err}");
    }

    #[test]
    fn a_group_takes_at_most_max_ops_after_self_pairing() {
        use P2pKind::{Recv, Send};
        let full: Vec<P2pOp> = (0..MAX_OPS).map(|i| op(Send, 1 + i % 3, i)).collect();
        let l = plan_lanes(0, 4, &full).unwrap();
        assert_eq!((l.ops.len(), l.lanes.len()), (MAX_OPS, 3));
        let over: Vec<P2pOp> = (0..=MAX_OPS).map(|_| op(Recv, 1, 0)).collect();
        let err = plan_lanes(0, 2, &over).unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err}");
        assert!(err.to_string().contains("at most 64"), "{err}");
        // A self pair counts once.
        let mut paired: Vec<P2pOp> = (0..MAX_OPS - 1).map(|_| op(Recv, 1, 0)).collect();
        paired.extend([op(Send, 0, 5), op(Recv, 0, 5)]);
        assert_eq!(plan_lanes(0, 2, &paired).unwrap().ops.len(), MAX_OPS);
    }

    #[rstest]
    #[case(2, 64 << 10)]
    #[case(4, 64 << 10)]
    #[case(7, 64 << 10)]
    #[case(8, 60 << 10)]
    #[case(16, 28 << 10)]
    #[case(32, 12 << 10)]
    #[case(64, 4 << 10)]
    fn slots_shrink_with_the_world(#[case] n: usize, #[case] slot: usize) {
        assert_eq!(PortLayout::new(n).unwrap().slot_bytes, slot);
    }

    #[test]
    fn every_world_fits_the_budget_and_the_trigger_fields() {
        for n in 1..=MAX_PORT_RANKS {
            let l = PortLayout::new(n).unwrap();
            assert!(2 * l.region_bytes() <= PORT_BUDGET, "{n} ranks: {l:?}");
            assert!(
                (MIN_SLOT_BYTES..=MAX_SLOT_BYTES).contains(&l.slot_bytes),
                "{n}"
            );
            assert_eq!(l.slot_bytes % MIN_SLOT_BYTES, 0);
            assert_eq!(l.stride() % 16, 0, "data and headers 16-byte aligned");
            // A put's last byte must fit a trigger's 32-bit offset field.
            assert!(l.region_bytes() as u64 - 1 <= u32::MAX as u64);
            // The two allocations, in whole granules, within the budget too.
            let granules = plain_allocation_bytes(l.region_bytes() + size_of::<P2pPortState>())
                + plain_allocation_bytes(l.region_bytes() + channels_bytes(n));
            assert!(granules <= PORT_BUDGET, "{n} ranks: {granules} bytes");
        }
        for n in [0, MAX_PORT_RANKS + 1] {
            let e = PortLayout::new(n).unwrap_err();
            assert!(matches!(e, Error::Unsupported(_)), "{e}");
            assert!(
                e.to_string().contains(&format!("{n} ranks")) && e.to_string().contains("1..=64"),
                "{e}"
            );
        }
    }

    #[test]
    fn slots_tile_the_region_without_overlap() {
        let l = PortLayout::new(3).unwrap();
        assert_eq!(l.slot_offset(0, 0), 0);
        assert_eq!(l.slot_offset(0, 1), l.stride() as u64);
        assert_eq!(l.slot_offset(1, 0), (PORT_SLOTS * l.stride()) as u64);
        let mut ranges: Vec<(u64, u64)> = (0..3)
            .flat_map(|r| (0..PORT_SLOTS).map(move |s| (r, s)))
            .map(|(r, s)| {
                let at = l.slot_offset(r, s);
                (at, at + l.stride() as u64)
            })
            .collect();
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert_eq!(w[0].1, w[1].0, "{w:?}");
        }
        assert_eq!(ranges.last().unwrap().1, l.region_bytes() as u64);
    }
}
