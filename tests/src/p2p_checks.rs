//! GPU checks of the point-to-point engine (`mscclpp_collectives::p2p`): groups of sends and
//! receives run as one kernel each, on any buffers. Every rank of the job takes part; the suite calls
//! [`run`] on every rank (section `p2p`) and prints one PASS/FAIL line per entry. Works with several
//! ranks sharing one GPU.
//!
//! Data: byte `i` of the `tag`-th message from rank `s` to rank `d` is a hash of (case key, s, d,
//! tag, i) ([`byte_pattern`]), so a receiver knows what it must get without any exchange, and a
//! message delivered out of order shows up as wrong bytes. Every receive buffer has a 16-byte poisoned tail after the
//! message, which must stay poisoned; the whole buffer is checked.
//!
//! Checks: a ring and an all-pairs group (every rank to and from every rank, itself included) at
//! each size of {0, 1, 3, 4 KiB + 8, 1 MiB - 1, 64 MiB} (all-pairs: 64 MiB / n), eager and as a
//! CUDA graph replayed twice on fresh data; a 1 GiB ring, eager; an all-pairs group of uneven sizes (each pair its own
//! size from that list); three sends to the same peer in one group (order) interleaved with the
//! receives; 20 repeated groups; two engines with groups in flight on two streams, and one engine
//! used from two streams (which it orders); zero copy (messages of at least
//! `ZERO_COPY_MIN_BYTES`) on buffers used again, and in graphs captured on new buffers (all-pairs,
//! and rings beyond two ranks); and size mismatches (see `MISMATCHES`, `MAPPED_MISMATCHES`),
//! each on a fresh communicator, which must end with an error naming rank and peer on both ranks,
//! the receive buffer untouched, and no hang.
//!
//! Across hosts ([`run_across_hosts`], `PortP2pEngine`): all-pairs groups (every rank to and from
//! every rank, itself included) of sizes drawn per pair from [`ACROSS_HOST_SIZES`] (0 and 1 byte,
//! odd sizes, up to 1 MiB + 3, many chunks beyond the slots), each group eager three times with
//! fresh data and as a CUDA graph replayed twice on fresh data; three messages per peer and
//! direction in one group; an 8 MiB + 5 ring; 20 repeated groups; and size mismatches between two
//! ranks on different hosts (see `ACROSS_HOST_MISMATCHES`), on a fresh communicator: the receiver
//! must name both ranks with its buffer untouched, and the sender's send must complete.

use crate::byte_pattern::{self, message_key};
use crate::host_cost::per_call_cost_settled;
use crate::tally::{ran_to_end, Tally};
use crate::{RankContext, SplitMix64, GIB, MIB};
use mscclpp::core::gpu::{Allocation, Gpu, MemoryKind, Stream};
use mscclpp::core::port_channel::{shared_queue_hazard, PortChannelConfig};
use mscclpp::core::{Error, Result};
use mscclpp_collectives::p2p::plan::{chunks, layout};
use mscclpp_collectives::p2p::port::PortLayout;
use mscclpp_collectives::p2p::{P2pEngine, P2pKind, P2pOp, PortP2pEngine, ZERO_COPY_MIN_BYTES};
use mscclpp_collectives::session::CommSession;
use std::sync::Arc;

/// What the group checks need of an engine: the one of mapped peers and the PortChannel one.
pub trait Engine {
    fn run(&self, ops: &[P2pOp], stream: &Stream) -> Result<()>;
    fn check(&self) -> Result<()>;
}

impl Engine for P2pEngine {
    fn run(&self, ops: &[P2pOp], stream: &Stream) -> Result<()> {
        P2pEngine::run(self, ops, stream)
    }
    fn check(&self) -> Result<()> {
        P2pEngine::check(self)
    }
}

impl Engine for PortP2pEngine {
    fn run(&self, ops: &[P2pOp], stream: &Stream) -> Result<()> {
        PortP2pEngine::run(self, ops, stream)
    }
    fn check(&self) -> Result<()> {
        PortP2pEngine::check(self)
    }
}

/// A session's groups, as the NCCL shim and the Python package issue them (its engine sits beside
/// the session's algorithms, which set up their own channels first).
impl Engine for CommSession {
    fn run(&self, ops: &[P2pOp], stream: &Stream) -> Result<()> {
        self.run_p2p(ops, *stream)
    }
    fn check(&self) -> Result<()> {
        self.async_error().map_or(Ok(()), Err)
    }
}

const POISON: u8 = 0x5A;
/// Poisoned bytes after every received message.
const GUARD: usize = 16;

/// Message sizes of the checks on `n` ranks (the largest shrinks with n in all-pairs groups).
pub fn sizes(largest: usize) -> [usize; 6] {
    [0, 1, 3, 4096 + 8, MIB - 1, largest]
}

/// One op of a rank's group: direction, peer, bytes, and its tag (index among this rank's ops
/// of the same direction and peer in the group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Msg {
    kind: P2pKind,
    peer: usize,
    bytes: usize,
    tag: usize,
}

/// A group as lists of (kind, peer, bytes) per rank; tags are filled in.
fn tagged(list: Vec<(P2pKind, usize, usize)>) -> Vec<Msg> {
    let mut out: Vec<Msg> = Vec::new();
    for (kind, peer, bytes) in list {
        let tag = out
            .iter()
            .filter(|m| m.kind == kind && m.peer == peer)
            .count();
        out.push(Msg {
            kind,
            peer,
            bytes,
            tag,
        });
    }
    out
}

/// Rank `rank`'s group of the ring: send to the next rank, receive from the previous.
fn ring(rank: usize, n: usize, bytes: usize) -> Vec<Msg> {
    tagged(vec![
        (P2pKind::Send, (rank + 1) % n, bytes),
        (P2pKind::Recv, (rank + n - 1) % n, bytes),
    ])
}

/// Every rank sends to and receives from every rank (itself too); `size(src, dst)`.
fn all_pairs(rank: usize, n: usize, size: impl Fn(usize, usize) -> usize) -> Vec<Msg> {
    let mut list = Vec::new();
    for d in 1..=n {
        let to = (rank + d) % n;
        let from = (rank + n - d % n) % n;
        list.push((P2pKind::Send, to, size(rank, to)));
        list.push((P2pKind::Recv, from, size(from, rank)));
    }
    tagged(list)
}

/// Three messages to the next rank and three from the previous, receives interleaved.
fn ordered(rank: usize, n: usize) -> Vec<Msg> {
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let sizes = [70_001, 5, 0];
    let mut list = Vec::new();
    for &b in &sizes {
        list.push((P2pKind::Send, next, b));
        list.push((P2pKind::Recv, prev, b));
    }
    // Receives first in this rank's call order: the matching is per direction, not per call.
    list.sort_by_key(|(k, _, _)| *k == P2pKind::Send);
    tagged(list)
}

/// One rank's buffers for a group, one per op.
struct Group {
    msgs: Vec<Msg>,
    bufs: Vec<Allocation>,
    gpu: Arc<dyn Gpu>,
    rank: usize,
}

impl Group {
    fn new(gpu: &Arc<dyn Gpu>, rank: usize, msgs: Vec<Msg>) -> Result<Group> {
        let mut bufs = Vec::new();
        for m in &msgs {
            bufs.push(gpu.alloc(m.bytes + GUARD, MemoryKind::Plain)?);
        }
        Ok(Group {
            msgs,
            bufs,
            gpu: gpu.clone(),
            rank,
        })
    }

    fn ops(&self) -> Vec<P2pOp> {
        self.msgs
            .iter()
            .zip(&self.bufs)
            .map(|(m, b)| P2pOp {
                kind: m.kind,
                peer: m.peer,
                ptr: b.ptr,
                bytes: m.bytes,
            })
            .collect()
    }

    /// Fresh send data for `key`; receive buffers poisoned.
    fn fill(&self, key: u64) -> Result<()> {
        for (m, b) in self.msgs.iter().zip(&self.bufs) {
            match m.kind {
                P2pKind::Send => {
                    let mut data = vec![0u8; m.bytes];
                    byte_pattern::fill(&mut data, message_key(key, self.rank, m.peer, m.tag));
                    self.gpu.copy_to_device(b.ptr, &data)?;
                }
                P2pKind::Recv => {
                    self.gpu
                        .memset_async(b.ptr, POISON, m.bytes + GUARD, Stream::DEFAULT)?
                }
            }
        }
        self.gpu.synchronize_stream(Stream::DEFAULT)
    }

    /// Every byte of every receive buffer, guard included.
    fn verify(&self, key: u64) -> Result<()> {
        for (m, b) in self.msgs.iter().zip(&self.bufs) {
            if m.kind != P2pKind::Recv {
                continue;
            }
            let mut got = vec![0u8; m.bytes + GUARD];
            self.gpu.copy_from_device(&mut got, b.ptr)?;
            let mut want = vec![POISON; m.bytes + GUARD];
            let message = message_key(key, m.peer, self.rank, m.tag);
            byte_pattern::fill(&mut want[..m.bytes], message);
            if let Some((at, wrong)) = byte_pattern::differences(&got, &want) {
                return Err(Error::Internal(format!(
                    "rank {}: recv #{} of {} bytes from rank {}: {wrong} wrong bytes, first at {at}{}: \
                     got {:#04x}, want {:#04x}",
                    self.rank,
                    m.tag,
                    m.bytes,
                    m.peer,
                    if at >= m.bytes { " (past the message)" } else { "" },
                    got[at],
                    want[at]
                )));
            }
        }
        Ok(())
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        for b in &self.bufs {
            let _ = self.gpu.free(b);
        }
    }
}

/// Runs `msgs` once (eager, `repeats` times with fresh data) or captured once and replayed twice.
fn check_group(
    ctx: &RankContext,
    engine: &impl Engine,
    msgs: Vec<Msg>,
    key: u64,
    graph: bool,
    repeats: u64,
) -> Result<()> {
    let g = Group::new(&ctx.gpu, ctx.rank(), msgs)?;
    run_group(ctx, engine, &g, key, graph, repeats)
}

/// [`check_group`] on buffers the caller holds.
fn run_group(
    ctx: &RankContext,
    engine: &impl Engine,
    g: &Group,
    key: u64,
    graph: bool,
    repeats: u64,
) -> Result<()> {
    let gpu = &ctx.gpu;
    let ops = g.ops();
    let stream = gpu.create_stream()?;
    let result = (|| {
        if !graph {
            for k in 0..repeats {
                let key = key ^ k.wrapping_mul(0xD6E8_FEB8_6659_FD93);
                g.fill(key)?;
                engine.run(&ops, &stream)?;
                gpu.synchronize_stream(stream)?;
                engine.check()?;
                g.verify(key)?;
            }
            return Ok(());
        }
        gpu.begin_capture(stream)?;
        let enqueued = engine.run(&ops, &stream);
        let ended = gpu.end_capture(stream);
        enqueued?;
        let graph = ended?;
        let replays = (0..2u64).try_for_each(|replay| {
            let key = key ^ (replay + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            g.fill(key)?;
            gpu.launch_graph(graph, stream)?;
            gpu.synchronize_stream(stream)?;
            engine.check()?;
            g.verify(key)
        });
        let _ = gpu.destroy_graph(graph);
        replays
    })();
    let _ = gpu.destroy_stream(stream);
    result
}

/// One eager ring group of `bytes` on `engine`, every byte checked (for other sections).
pub fn ring_once(ctx: &RankContext, engine: &P2pEngine, bytes: usize, key: u64) -> Result<()> {
    let (rank, n) = (ctx.rank(), ctx.size());
    check_group(ctx, engine, ring(rank, n, bytes), key, false, 1)?;
    engine.check()
}

/// Zero copy: a ring of `bytes` on the same buffers, eager until the receivers' allocations are
/// mapped by their senders (the first calls go through the slots), then captured and replayed;
/// every byte of every call checked, and this rank's receives must have gone zero copy.
fn zero_copy(ctx: &RankContext, engine: &P2pEngine, bytes: usize, key: u64) -> Result<String> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let g = Group::new(&ctx.gpu, rank, ring(rank, n, bytes))?;
    let before = engine.zero_copy_receives();
    run_group(ctx, engine, &g, key, false, ZERO_COPY_EAGER_CALLS)?;
    let eager = engine.zero_copy_receives() - before;
    run_group(ctx, engine, &g, key ^ 0x5a5a, true, 1)?;
    let captured = engine.zero_copy_receives() - before - eager;
    // The sender's side: what its last replay wrote straight into this rank's buffer.
    let direct = engine.last_zero_copied_bytes((rank + n - 1) % n)?;
    if eager == 0 || captured != 1 || direct != bytes as u64 {
        return Err(Error::Internal(format!(
            "rank {rank}: {eager} of {ZERO_COPY_EAGER_CALLS} eager receives of {bytes} bytes and \
             {captured} of 1 captured were offered zero copy (at least one, and the captured \
             one, expected), and the sender wrote {direct} bytes of the last replay straight \
             into the buffer"
        )));
    }
    Ok(format!(
        "{bytes} B: {eager} of {ZERO_COPY_EAGER_CALLS} eager calls and the graph zero copy, every byte"
    ))
}

/// Zero copy on buffers a graph's capture sees first (as a framework's graph pool gives them): an
/// all-pairs exchange (every rank sends to the peers it receives from, so the captures answer
/// each other's offers) or a ring (at more than two ranks a rank's send peer is not its receive
/// peer: each capture waits for its send peer's note, see p2p::zero_copy), every byte of both
/// replays checked: every receive must be offered zero copy in the capture and written straight
/// into its buffer.
fn zero_copy_captured_fresh(
    ctx: &RankContext,
    engine: &P2pEngine,
    (shape, msgs): (&str, Vec<Msg>),
    key: u64,
) -> Result<String> {
    let rank = ctx.rank();
    let peers: Vec<usize> = msgs
        .iter()
        .filter(|m| m.kind == P2pKind::Recv && m.peer != rank)
        .map(|m| m.peer)
        .collect();
    let bytes = msgs.first().map_or(0, |m| m.bytes);
    let g = Group::new(&ctx.gpu, rank, msgs)?;
    let before = engine.zero_copy_receives();
    let started = std::time::Instant::now();
    run_group(ctx, engine, &g, key, true, 1)?;
    let captured = engine.zero_copy_receives() - before;
    let mut direct = Vec::new();
    for &p in &peers {
        direct.push(engine.last_zero_copied_bytes(p)?);
    }
    if captured != peers.len() as u64 || direct.iter().any(|&d| d != bytes as u64) {
        return Err(Error::Internal(format!(
            "rank {rank}: a {shape} group of {bytes} bytes captured on new buffers: {captured} \
             of {} receives offered zero copy, and the senders wrote {direct:?} bytes of the last \
             replay straight into the buffers",
            peers.len()
        )));
    }
    Ok(format!(
        "{bytes} B {shape}: captured on new buffers, both replays zero copy, every byte ({:.0} \
         ms with the handshake)",
        started.elapsed().as_secs_f64() * 1e3
    ))
}

/// What one eager ring group of `bytes` costs the calling thread (a measurement, not a check):
/// thread CPU and wall µs per `P2pEngine::run`, batches of back-to-back calls on the same
/// buffers, after calls enough for a large one to go zero copy; the kernels are waited for
/// between batches. Tells the host path's part in an eager call's time (its planning, and for a
/// large group the zero-copy polls) from the launch's.
fn host_path(ctx: &RankContext, engine: &P2pEngine, bytes: usize) -> Result<String> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let g = Group::new(&ctx.gpu, rank, ring(rank, n, bytes))?;
    let ops = g.ops();
    let stream = ctx.gpu.create_stream()?;
    let zero_copy_before = engine.zero_copy_receives();
    let measured = (|| {
        for _ in 0..ZERO_COPY_EAGER_CALLS {
            engine.run(&ops, &stream)?;
            ctx.gpu.synchronize_stream(stream)?;
        }
        let settle = || {
            ctx.gpu.synchronize_stream(stream)?;
            engine.check()
        };
        per_call_cost_settled(50, || engine.run(&ops, &stream), settle)
    })();
    let _ = ctx.gpu.destroy_stream(stream);
    let (wall, cpu) = measured?;
    let zero_copy = engine.zero_copy_receives() > zero_copy_before;
    Ok(format!(
        "{bytes} B ring{}: {cpu:.2} µs of thread CPU time per group ({wall:.2} wall)",
        if zero_copy { " (zero copy)" } else { "" }
    ))
}

/// Eager calls of [`zero_copy`]: the offer goes out on the first, the sender maps it at its next
/// call and the receiver sees the confirmation at the one after.
const ZERO_COPY_EAGER_CALLS: u64 = 5;

/// Two ring groups (opposite directions) on two streams without a host sync between them: on two
/// engines they run at once; on one engine the second waits for the first.
fn two_streams(ctx: &RankContext, engines: [&P2pEngine; 2], key: u64) -> Result<()> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let gpu = &ctx.gpu;
    let reverse = |r: usize| (n - r) % n;
    let groups = [
        Group::new(gpu, rank, ring(rank, n, MIB + 5))?,
        // The reverse ring, relabelled back to real ranks.
        Group::new(
            gpu,
            rank,
            ring(reverse(rank), n, MIB + 6)
                .into_iter()
                .map(|m| Msg {
                    peer: reverse(m.peer),
                    ..m
                })
                .collect(),
        )?,
    ];
    let streams = [gpu.create_stream()?, gpu.create_stream()?];
    let mut result = Ok(());
    for (j, g) in groups.iter().enumerate() {
        result = result.and_then(|()| g.fill(key + j as u64));
    }
    for j in 0..2 {
        result = result.and_then(|()| engines[j].run(&groups[j].ops(), &streams[j]));
    }
    for s in streams {
        result = result.and(gpu.synchronize_stream(s));
    }
    for (j, g) in groups.iter().enumerate() {
        result = result
            .and_then(|()| engines[j].check())
            .and_then(|()| g.verify(key + j as u64));
    }
    for s in streams {
        let _ = gpu.destroy_stream(s);
    }
    result
}

/// (sent, received) of the mismatch checks. Both are larger than the channel's slots at any world
/// size, so the sender meets the receiver's post while it waits for credit. 1 MiB + 100 against
/// 1 MiB has one more chunk on the sender at 2 and 8 ranks, the same count at 4; 1 MiB - 100
/// against 1 MiB - 200 has the same chunk count at every world size (slots are multiples of 4 KiB),
/// so the message differs only in the count carried by every chunk, which every receiving block
/// must check before it copies (at 4 ranks a block once copied most of its chunk anyway).
const MISMATCHES: [(usize, usize); 2] = [(MIB + 100, MIB), (MIB - 100, MIB - 200)];

/// (sent, received) of the mismatch on a buffer its sender already mapped: both at least
/// [`ZERO_COPY_MIN_BYTES`], one larger and one smaller than the receive.
const MAPPED_MISMATCHES: [(usize, usize); 2] =
    [(2 * MIB + 100, 2 * MIB), (2 * MIB - 4096, 2 * MIB)];

/// Rank 0 sends `sent` bytes to rank 1, which receives `received`, on a fresh communicator (the
/// error is sticky): both ranks must report an error naming both ranks, rank 1's buffer must stay
/// poisoned, and nothing may hang. Other ranks only take part in building the communicator.
/// `mapped`: first `received` bytes go from rank 0 into the same buffer until its sender has
/// mapped it and writes straight into it, so the mismatched send finds a table entry for it and
/// must still take the slots (where the mismatch is seen) rather than write.
fn size_mismatch(
    ctx: &RankContext,
    (sent, received): (usize, usize),
    mapped: bool,
) -> Result<String> {
    let (rank, size) = (ctx.rank(), ctx.size());
    let engine = P2pEngine::new(ctx.fresh_communicator()?)?;
    let slot = layout(size).slot_bytes;
    let msgs = match rank {
        0 => tagged(vec![(P2pKind::Send, 1, sent)]),
        1 => tagged(vec![(P2pKind::Recv, 0, received)]),
        _ => Vec::new(),
    };
    let g = Group::new(&ctx.gpu, rank, msgs)?;
    if mapped {
        zero_copy_before_mismatch(ctx, &engine, &g, received)?;
    }
    g.fill(0xBAD)?;
    let stream = ctx.gpu.create_stream()?;
    // Launch together: the sender checks the receiver's post only within 1 ms of its last chunk.
    ctx.bootstrap.barrier()?;
    let started = std::time::Instant::now();
    engine.run(&g.ops(), &stream)?;
    ctx.gpu.synchronize_stream(stream)?;
    let took = started.elapsed();
    let _ = ctx.gpu.destroy_stream(stream);
    let report = engine.check();
    let result = match (rank, &report) {
        (0 | 1, Err(Error::InvalidArgument(m))) => {
            let (me, peer) = if rank == 0 { (0, 1) } else { (1, 0) };
            if !(m.contains(&format!("rank {me}:")) && m.contains(&format!("rank {peer}"))) {
                Err(Error::Internal(format!(
                    "rank {rank}: the error does not name rank {me} and peer {peer}: {m}"
                )))
            } else if rank == 1 {
                let mut got = vec![0u8; received + GUARD];
                ctx.gpu.copy_from_device(&mut got, g.bufs[0].ptr)?;
                match got.iter().position(|&b| b != POISON) {
                    Some(at) => Err(Error::Internal(format!(
                        "rank 1: byte {at} of the receive buffer was written despite the mismatch"
                    ))),
                    // `m` begins with "rank 1:" already.
                    None => Ok(format!(
                        "{m} ({took:.1?}; {} chunks received, {} sent)",
                        chunks(received, slot),
                        chunks(sent, slot)
                    )),
                }
            } else {
                Ok(format!("{m} ({took:.1?})"))
            }
        }
        (0 | 1, other) => Err(Error::Internal(format!(
            "rank {rank}: expected a size-mismatch error naming both ranks, got {other:?}"
        ))),
        _ => Ok("not involved".into()),
    };
    // Every rank reaches this point (no hang), then the communicator goes.
    ctx.bootstrap.barrier()?;
    drop(g);
    drop(engine);
    result
}

/// [`size_mismatch`]'s first exchanges: `received` bytes from rank 0 into rank 1's buffer of
/// `g` until that receive went zero copy, every byte checked.
fn zero_copy_before_mismatch(
    ctx: &RankContext,
    engine: &P2pEngine,
    g: &Group,
    received: usize,
) -> Result<()> {
    let rank = ctx.rank();
    let sender;
    let matching = match rank {
        0 => {
            sender = Group::new(&ctx.gpu, 0, tagged(vec![(P2pKind::Send, 1, received)]))?;
            &sender
        }
        _ => g,
    };
    let stream = ctx.gpu.create_stream()?;
    let exchanges = (0..ZERO_COPY_EAGER_CALLS).try_for_each(|call| {
        let key = 0x600D ^ call;
        matching.fill(key)?;
        engine.run(&matching.ops(), &stream)?;
        ctx.gpu.synchronize_stream(stream)?;
        engine.check()?;
        matching.verify(key)
    });
    let _ = ctx.gpu.destroy_stream(stream);
    exchanges?;
    if rank == 1 {
        let direct = engine.last_zero_copied_bytes(0)?;
        if direct != received as u64 {
            return Err(Error::Internal(format!(
                "rank 1: after {ZERO_COPY_EAGER_CALLS} exchanges of {received} bytes rank 0 \
                 wrote {direct} bytes of the last one straight into the buffer ({received} \
                 expected): the mismatch would not meet a mapped buffer"
            )));
        }
    }
    Ok(())
}

/// One row of checks: its name, this rank's group, whether as a graph, and how many eager calls.
type Row = (String, Vec<Msg>, bool, u64);

/// Runs `rows` in order ([`check_group`], keys from `seed` and the running `case` count); after a
/// row that some rank did not complete, skips the rest on every rank. The outcome (the checks
/// passed, or the failures) and whether the rows stopped.
fn check_rows(
    ctx: &RankContext,
    engine: &impl Engine,
    rows: Vec<Row>,
    seed: u64,
    case: &mut u64,
) -> (Result<String>, bool) {
    let mut stopped: Option<String> = None;
    let mut tally = Tally::default();
    for (name, msgs, graph, repeats) in rows {
        *case += 1;
        let what = format!("{name} {}", if graph { "graph" } else { "eager" });
        if stopped.is_some() {
            continue;
        }
        let key = seed ^ case.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let r = check_group(ctx, engine, msgs, key, graph, repeats);
        let completed = ran_to_end(&r);
        stopped = tally.record(ctx, &what, r, completed).err();
    }
    let n = ctx.size();
    let outcome = tally.outcome(&stopped, |passed| {
        format!("{passed} checks passed on {n} ranks, every byte")
    });
    (outcome, stopped.is_some())
}

/// Runs the point-to-point checks on this rank; returns (check name, outcome) in order. After a
/// check that did not complete on some rank, the remaining ones are reported as not run.
pub fn run(ctx: &RankContext) -> Vec<(String, Result<String>)> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let engine = match P2pEngine::new(ctx.comm.clone()) {
        Ok(e) => e,
        Err(e) => return vec![("p2p setup".into(), Err(e))],
    };
    let seed = match ctx.shared_seed() {
        Ok(s) => s,
        Err(e) => return vec![("p2p run seed".into(), Err(e))],
    };
    let mut out: Vec<(String, Result<String>)> = vec![(
        "p2p engine device memory".into(),
        Ok(format!("{} bytes per rank", engine.device_bytes())),
    )];
    let mut case = 0u64;
    let pair_sizes = sizes(64 * MIB / n);
    let mut rows: Vec<Row> = Vec::new();
    for bytes in sizes(64 * MIB) {
        for graph in [false, true] {
            rows.push((format!("ring {bytes} B"), ring(rank, n, bytes), graph, 1));
        }
    }
    // 1 GiB per rank, eager only (graph replay is checked up to 64 MiB): 2 GiB of device memory per
    // rank, 16 GiB at 8 ranks on one GPU, and about a second of host-side checking.
    rows.push((format!("ring {GIB} B"), ring(rank, n, GIB), false, 1));
    for bytes in pair_sizes {
        for graph in [false, true] {
            rows.push((
                format!("all-pairs {bytes} B"),
                all_pairs(rank, n, |_, _| bytes),
                graph,
                1,
            ));
        }
    }
    let uneven = |s: usize, d: usize| pair_sizes[(s + 2 * d) % pair_sizes.len()];
    for graph in [false, true] {
        rows.push((
            "all-pairs uneven sizes".into(),
            all_pairs(rank, n, uneven),
            graph,
            1,
        ));
        rows.push((
            "three sends to one peer (order)".into(),
            ordered(rank, n),
            graph,
            1,
        ));
    }
    rows.push((
        "20 repeated groups".into(),
        ring(rank, n, 4096 + 8),
        false,
        20,
    ));
    let (outcome, stopped) = check_rows(ctx, &engine, rows, seed, &mut case);
    out.push((
        "p2p groups (ring, all-pairs, uneven, order, repeats; eager and graph)".into(),
        outcome,
    ));
    if stopped {
        return out;
    }
    let r = P2pEngine::new(ctx.comm.clone())
        .and_then(|second| two_streams(ctx, [&engine, &second], seed ^ 0xABCD));
    out.push((
        "p2p: two engines in flight on two streams".into(),
        r.map(|()| "both rings correct".into()),
    ));
    for bytes in [ZERO_COPY_MIN_BYTES, ZERO_COPY_MIN_BYTES + 3, 64 * MIB + 16] {
        if n < 2 {
            break;
        }
        case += 1;
        out.push((
            "p2p: zero copy on buffers used again (eager, then a graph)".into(),
            zero_copy(ctx, &engine, bytes, seed ^ case),
        ));
        out.push((
            "p2p: zero copy in a graph captured on new buffers".into(),
            zero_copy_captured_fresh(
                ctx,
                &engine,
                ("all-pairs", all_pairs(rank, n, |_, _| bytes)),
                seed ^ case ^ 0xF00D,
            ),
        ));
        if n > 2 {
            out.push((
                "p2p: zero copy in a ring captured on new buffers (send peer != receive peer)"
                    .into(),
                zero_copy_captured_fresh(
                    ctx,
                    &engine,
                    ("ring", ring(rank, n, bytes)),
                    seed ^ case ^ 0xBEEF,
                ),
            ));
        }
    }
    out.push((
        "p2p: one engine on two streams (ordered by the engine)".into(),
        two_streams(ctx, [&engine, &engine], seed ^ 0xBCDE).map(|()| "both rings correct".into()),
    ));
    if n >= 2 {
        for bytes in [64 << 10, ZERO_COPY_MIN_BYTES] {
            out.push((
                "p2p: host path of one eager group (thread CPU time per call)".into(),
                host_path(ctx, &engine, bytes),
            ));
        }
        for sizes in MISMATCHES {
            out.push((
                format!(
                    "p2p: size mismatch ({} B sent, {} B received) -> error naming rank and peer",
                    sizes.0, sizes.1
                ),
                size_mismatch(ctx, sizes, false),
            ));
        }
        for sizes in MAPPED_MISMATCHES {
            out.push((
                format!(
                    "p2p: size mismatch on a mapped buffer ({} B sent, {} B received; zero copy \
                     before) -> error naming rank and peer, nothing written",
                    sizes.0, sizes.1
                ),
                size_mismatch(ctx, sizes, true),
            ));
        }
    }
    out
}

/// Message sizes of the groups across hosts, drawn per (sender, receiver) pair: nothing, one byte,
/// odd sizes within a slot and across two, and several slots' worth (1 MiB + 3 is 17 chunks of
/// 64 KiB at up to 15 ranks, beyond the four slots a lane has in flight, so its credits come back
/// while it sends).
pub const ACROSS_HOST_SIZES: [usize; 7] = [0, 1, 3, 4096 + 8, 65_537, 3 * 65_536 + 5, MIB + 3];

/// (sent, received) of the mismatch checks across hosts: one chunk each; and a message of more
/// chunks than the lane's slots against a smaller one, whose sender completes only once the
/// receiver gives back the credits of the refused message.
const ACROSS_HOST_MISMATCHES: [(usize, usize); 2] = [(100, 200), (MIB + 100, MIB)];

/// An all-pairs group (every rank to and from every rank, itself included) whose pair `(s, d)`
/// moves a size drawn from [`ACROSS_HOST_SIZES`] by `draw` (the same on every rank).
fn random_all_pairs(rank: usize, n: usize, draw: u64) -> Vec<Msg> {
    all_pairs(rank, n, |s, d| {
        let mut r = SplitMix64(draw ^ ((s as u64) << 32 | d as u64));
        ACROSS_HOST_SIZES[(r.next_u64() % ACROSS_HOST_SIZES.len() as u64) as usize]
    })
}

/// The point-to-point checks of ranks on several hosts (`PortP2pEngine`, see the module docs) on
/// this rank; returns (check name, outcome) in order. Under MPS with more ranks on a GPU than
/// PortChannels take, the engine must refuse to start, naming the hazard: that is the one check.
/// The engine runs on a fresh communicator, so a failure here (sticky on its communicator) leaves
/// the suite's own healthy for the sections after.
pub fn run_across_hosts(ctx: &RankContext) -> Vec<(String, Result<String>)> {
    let (rank, n) = (ctx.rank(), ctx.size());
    if n < 2 {
        return vec![(
            "p2p across hosts".into(),
            Ok(format!("skipped: {n} rank(s)")),
        )];
    }
    let hazard = match mscclpp::core::env::Env::get() {
        Ok(env) => shared_queue_hazard(env, ctx.comm.mps_clients_per_gpu()),
        Err(e) => return vec![("p2p across hosts: environment".into(), Err(e))],
    };
    let built = ctx
        .fresh_communicator()
        .and_then(|comm| PortP2pEngine::new(comm, PortChannelConfig::default()));
    let engine = match (built, hazard) {
        (Ok(e), None) => e,
        (Err(e), None) => return vec![("p2p across hosts: setup".into(), Err(e))],
        (Err(Error::Unsupported(why)), Some(_)) => {
            return vec![("p2p across hosts: refused".into(), Ok(why))]
        }
        (other, Some(hazard)) => {
            let got = other.map(|_| "an engine".to_string());
            return vec![(
                "p2p across hosts: refused".into(),
                Err(Error::Internal(format!(
                    "rank {rank}: built {got:?} despite the hazard ({hazard}); it must refuse"
                ))),
            )];
        }
    };
    let seed = match ctx.shared_seed() {
        Ok(s) => s,
        Err(e) => return vec![("p2p across hosts: run seed".into(), Err(e))],
    };
    let layout = engine.layout();
    let mut out: Vec<(String, Result<String>)> = vec![(
        "p2p across hosts: engine device memory".into(),
        Ok(format!(
            "{} bytes per rank ({} B slots)",
            engine.device_bytes(),
            layout.slot_bytes
        )),
    )];
    let mut rows: Vec<Row> = Vec::new();
    for round in 0..3u64 {
        let draw = seed ^ round.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        rows.push((
            format!("random all-pairs #{round}"),
            random_all_pairs(rank, n, draw),
            false,
            3,
        ));
        rows.push((
            format!("random all-pairs #{round}"),
            random_all_pairs(rank, n, draw),
            true,
            1,
        ));
    }
    for graph in [false, true] {
        rows.push((
            "three sends to one peer (order)".into(),
            ordered(rank, n),
            graph,
            1,
        ));
    }
    rows.push((
        format!("ring {} B", 8 * MIB + 5),
        ring(rank, n, 8 * MIB + 5),
        false,
        1,
    ));
    rows.push((
        "20 repeated groups".into(),
        ring(rank, n, 4096 + 8),
        false,
        20,
    ));
    let mut case = 0u64;
    let (outcome, stopped) = check_rows(ctx, &engine, rows, seed, &mut case);
    out.push((
        "p2p across hosts: groups (random all-pairs with self, order, ring, repeats; eager and \
         graph)"
            .into(),
        outcome,
    ));
    drop(engine);
    if stopped {
        return out;
    }
    // The same groups through a session: its multi-host algorithms build their channels on the
    // communicator before its engine does.
    let session = ctx.fresh_communicator().and_then(CommSession::new);
    match session {
        Ok(session) => {
            let rows = (0..2u64)
                .flat_map(|round| {
                    let draw = seed ^ (round + 7).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    [false, true].map(|graph| {
                        let name = format!("session all-pairs #{round}");
                        (name, random_all_pairs(rank, n, draw), graph, 2)
                    })
                })
                .collect();
            let (outcome, stopped) = check_rows(ctx, &session, rows, seed, &mut case);
            out.push((
                "p2p across hosts through a CommSession (random all-pairs with self, eager and \
                 graph)"
                    .into(),
                outcome,
            ));
            if stopped {
                return out;
            }
        }
        Err(e) => out.push((
            "p2p across hosts through a CommSession: setup".into(),
            Err(e),
        )),
    }
    for sizes in ACROSS_HOST_MISMATCHES {
        out.push((
            format!(
                "p2p across hosts: size mismatch ({} B sent, {} B received) -> the receiver names \
                 both ranks, nothing written, the send completes",
                sizes.0, sizes.1
            ),
            size_mismatch_across_hosts(ctx, sizes),
        ));
    }
    out
}

/// Rank 0 sends `sent` bytes to the first rank on another host, which receives `received`, on a
/// fresh communicator (the error is sticky): the receiver must report an error naming both ranks,
/// with its buffer still poisoned, and the sender's send must complete without error (the
/// receiver gives back the credits of the refused message). Other ranks only take part in
/// building and tearing down.
fn size_mismatch_across_hosts(
    ctx: &RankContext,
    (sent, received): (usize, usize),
) -> Result<String> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let topology = ctx.comm.topology();
    let Some(receiver) = (1..n).find(|&r| !topology.same_host(0, r)) else {
        return Ok(format!(
            "skipped: every rank on the host of rank 0 ({topology})"
        ));
    };
    let engine = PortP2pEngine::new(ctx.fresh_communicator()?, PortChannelConfig::default())?;
    let slot = PortLayout::new(n)?.slot_bytes;
    let msgs = match rank {
        0 => tagged(vec![(P2pKind::Send, receiver, sent)]),
        r if r == receiver => tagged(vec![(P2pKind::Recv, 0, received)]),
        _ => Vec::new(),
    };
    let g = Group::new(&ctx.gpu, rank, msgs)?;
    g.fill(0xBAD)?;
    let stream = ctx.gpu.create_stream()?;
    ctx.bootstrap.barrier()?;
    let started = std::time::Instant::now();
    let ran = engine
        .run(&g.ops(), &stream)
        .and_then(|()| ctx.gpu.synchronize_stream(stream));
    let took = started.elapsed();
    let _ = ctx.gpu.destroy_stream(stream);
    let result = ran.and_then(|()| {
        let report = engine.check();
        match (rank, report) {
            (0, Ok(())) => Ok(format!(
                "rank 0: the send of {sent} B completed in {took:.1?} ({} chunks)",
                chunks(sent, slot)
            )),
            (0, Err(e)) => Err(Error::Internal(format!(
                "rank 0: the send of {sent} B to rank {receiver}, which receives {received} B, \
                 must complete, but: {e}"
            ))),
            (r, Err(Error::InvalidArgument(m))) if r == receiver => {
                if !(m.contains(&format!("rank {r}:")) && m.contains("rank 0")) {
                    return Err(Error::Internal(format!(
                        "rank {r}: the error does not name rank {r} and peer 0: {m}"
                    )));
                }
                let mut got = vec![0u8; received + GUARD];
                ctx.gpu.copy_from_device(&mut got, g.bufs[0].ptr)?;
                match got.iter().position(|&b| b != POISON) {
                    Some(at) => Err(Error::Internal(format!(
                        "rank {r}: byte {at} of the receive buffer was written despite the \
                         mismatch"
                    ))),
                    // `m` begins with "rank {r}:" already.
                    None => Ok(format!("{m} ({took:.1?})")),
                }
            }
            (r, other) if r == receiver => Err(Error::Internal(format!(
                "rank {r}: expected a size-mismatch error naming ranks {r} and 0, got {other:?}"
            ))),
            _ => Ok("not involved".into()),
        }
    });
    // Every rank reaches this point (no hang), then the communicator goes.
    ctx.bootstrap.barrier()?;
    drop(g);
    drop(engine);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's k-th send to p has the same size as p's k-th receive from it.
    fn consistent(groups: &[Vec<Msg>]) {
        for (r, g) in groups.iter().enumerate() {
            for m in g.iter().filter(|m| m.kind == P2pKind::Send) {
                let other = groups[m.peer]
                    .iter()
                    .find(|o| o.kind == P2pKind::Recv && o.peer == r && o.tag == m.tag)
                    .unwrap_or_else(|| {
                        panic!("rank {r}'s send #{} to {} unmatched", m.tag, m.peer)
                    });
                assert_eq!(other.bytes, m.bytes);
            }
        }
    }

    #[test]
    fn groups_of_the_checks_match_up() {
        for n in [1, 2, 3, 4, 8] {
            let s = sizes(64 * MIB / n);
            let uneven = |a: usize, b: usize| s[(a + 2 * b) % s.len()];
            consistent(&(0..n).map(|r| ring(r, n, 7)).collect::<Vec<_>>());
            consistent(&(0..n).map(|r| all_pairs(r, n, uneven)).collect::<Vec<_>>());
            consistent(&(0..n).map(|r| ordered(r, n)).collect::<Vec<_>>());
            let g = all_pairs(0, n, uneven);
            assert_eq!(g.len(), 2 * n);
        }
    }

    #[test]
    fn random_groups_across_hosts_match_up_and_cover_every_size() {
        for n in [2, 3, 4, 8] {
            let groups: Vec<_> = (0..n).map(|r| random_all_pairs(r, n, 0x5eed)).collect();
            consistent(&groups);
        }
        let drawn: std::collections::HashSet<usize> = (0..64u64)
            .flat_map(|draw| random_all_pairs(0, 8, draw))
            .map(|m| m.bytes)
            .collect();
        assert_eq!(drawn.len(), ACROSS_HOST_SIZES.len(), "{drawn:?}");
        // The largest size needs more chunks than a lane has slots, at every world size.
        let slots = mscclpp_kernels_cu::p2p::PORT_SLOTS as u64;
        for n in 2..=mscclpp_kernels_cu::p2p::MAX_PORT_RANKS {
            let slot = PortLayout::new(n).unwrap().slot_bytes;
            assert!(chunks(MIB + 3, slot) > slots, "{n} ranks");
            let (sent, received) = ACROSS_HOST_MISMATCHES[1];
            assert!(chunks(sent, slot) > slots && chunks(received, slot) > slots);
        }
    }

    /// The second mismatch shares its chunk count at every world size (the receiver can only tell
    /// by the count in each chunk), and both are larger than a channel's slots.
    #[test]
    fn mismatches_cover_an_equal_chunk_count_at_every_world_size() {
        for n in 2..=8 {
            let slot = layout(n).slot_bytes;
            let (sent, received) = MISMATCHES[1];
            assert_eq!(chunks(sent, slot), chunks(received, slot), "{n} ranks");
            for (sent, received) in MISMATCHES {
                let slots = layout(n).slots as u64;
                assert!(chunks(sent.min(received), slot) > slots, "{n} ranks");
            }
        }
    }
}
