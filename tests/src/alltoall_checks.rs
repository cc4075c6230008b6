//! GPU checks of the all-to-all family (`mscclpp_collectives::alltoall`): `default_alltoall_zero_copy`
//! and `default_alltoall_packet` through the `Algorithm` trait, the ring `default_sendrecv_zero_copy`,
//! all-to-all-v on skewed splits, gather and scatter, all borrowing one set of collection resources
//! as in the default collection (`collection_resources`). Every rank of the job takes part; the
//! suite calls [`run`] on every rank and prints one PASS/FAIL line per entry.
//!
//! Bytes move unchanged, so data is bytes: the byte `i` that rank `s` sends to rank `d` is a hash of
//! (run seed, case, s, d, i) ([`byte_pattern`]), so every receiver computes what it must get without any exchange. The
//! whole output is poisoned first and checked whole: every received region byte for byte, and every
//! byte outside them still poisoned (nothing written where nothing was due).
//!
//! Matrix: per-peer chunks of 0, 1, 3, 4 KiB + 8 B, 1 MiB - 1 B, 64 MiB / nranks and 1 GiB / nranks
//! (zero-copy all-to-all, gather, scatter; the ring sendrecv: 64 MiB and 1 GiB), of 0, 1, 3,
//! 4 KiB + 8, 64 KiB and the scratch's capacity (packet); all-to-all-v of 0, 1, 3, 4 KiB + 8,
//! 1 MiB - 1, 64 MiB and 1 GiB per rank split with skews 0, 1.5 and 20 (the last leaves far peers
//! at zero bytes); each eager and, up to 64 MiB per rank, as a CUDA graph replayed twice on fresh
//! data (the 1 GiB exchanges eager only: 2 GiB of device memory per rank, 16 GiB at 8 ranks on one
//! GPU). Gather and scatter run through their collection algorithms
//! (`default_gather_zero_copy`, `default_scatter_zero_copy`), once more at other roots with the
//! caller's nblocks 3 and nthreads 128, and out-of-range requests must be refused by name on every
//! rank. Then two engines (the collection's and a stand-alone one, with
//! resources of its own) with calls in flight on two streams at once, all-to-all-v with
//! device-resident counts (MoE routing), and a deliberate count mismatch on a communicator of its
//! own (every rank's kernel detects it, nothing is written anywhere, every rank's error names the
//! two ranks, nothing hangs; the job's communicator stays healthy for later sections), and device
//! counts that overflow a receiver's output (likewise, on another communicator of its own).
//!
//! In place (one buffer per rank at NCCL's offsets: all-to-all(-v) `sendbuff == recvbuff`, gather
//! `sendbuff = recvbuff + rank * chunk`, scatter `recvbuff = sendbuff + rank * chunk`, on every
//! rank as nccl-tests passes them): zero-copy and packet all-to-all over the same sizes, also with
//! rank 0 alone in place (a mix NCCL allows), all-to-all-v with symmetric skewed splits (same send
//! and receive regions) and with skewed splits received in reverse rank order, so that regions
//! differ; in place on every rank at every size (copied whole into the engine's stage within it,
//! swapped pair by pair beyond it), the mixes and the differing regions only up to the stage, and
//! gather and scatter over their matrix sizes; the whole buffer is checked: the received regions,
//! and every other byte as it was uploaded. Beyond the stage, a mix (rank 0 alone in place) and
//! differing regions must fail on every rank, naming the problem, with nothing moved. Then
//! nccl-tests' own sequence: out of place, then in place in the same two buffers (the in-place
//! scatter that hung on a registration only rank 0 had cached).
//!
//! After every check the ranks agree (bootstrap all-gather) on whether it completed; after a
//! failure the remaining checks are skipped on every rank instead of each timing out.

use crate::byte_pattern::{self, message_key};
use crate::tally::{ran_to_end, Tally};
use crate::{RankContext, GIB, MIB};
use mscclpp::core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp::core::algorithm_collection::native_names::{ALLTOALL_PACKET, SENDRECV_ZERO_COPY};
use mscclpp::core::communicator::Communicator;
use mscclpp::core::gpu::{Gpu, MemoryKind, Stream};
use mscclpp::core::{AccumType, DataType, Error, ReduceOp, Result};
use mscclpp_collectives::alltoall::shift::shift_splits;
use mscclpp_collectives::alltoall::{
    skewed_matrix, splits_of_matrix, AlltoallPacket, AlltoallZeroCopy, Buffer, ShiftSendRecv, Side,
    Split, ALLTOALL_ZERO_COPY,
};
use mscclpp_collectives::gather_scatter::GatherScatter;
use std::cell::RefCell;
use std::sync::Arc;

const POISON: u8 = 0xA5;

/// Per-peer chunk sizes (bytes) of the all-to-all, gather and scatter checks on `n` ranks: the
/// largest two are 64 MiB and 1 GiB per rank in all.
pub fn chunk_sizes(n: usize) -> Vec<usize> {
    let n = n.max(1);
    vec![0, 1, 3, 4096 + 8, MIB - 1, 64 * MIB / n, GIB / n]
}

/// Bytes each rank sends in all in the all-to-all-v checks.
pub const ALLTOALLV_SIZES: [usize; 7] = [0, 1, 3, 4096 + 8, MIB - 1, 64 * MIB, GIB];

/// Bytes one rank sends in all (the root: moves) in `op` of `bytes` (per peer, or per rank for v)
/// on `n` ranks: the same on every rank.
fn bytes_per_rank(op: Op, bytes: usize, n: usize) -> usize {
    match op {
        Op::SendRecv | Op::Alltoallv | Op::AlltoallvSymmetric | Op::AlltoallvReversed => bytes,
        Op::Alltoall | Op::AlltoallPacket | Op::Gather(..) | Op::Scatter(..) => bytes * n,
    }
}

/// Whether `op` of `bytes` is also captured and replayed: up to 64 MiB per rank. The 1 GiB
/// exchanges run eager only, which keeps each at about a second of host-side checking.
fn with_graph(op: Op, bytes: usize, n: usize) -> bool {
    bytes_per_rank(op, bytes, n) < GIB
}

/// Skews of the all-to-all-v checks (`skewed_matrix`).
pub const SKEWS: [f64; 3] = [0.0, 1.5, 20.0];

/// One exchange of the matrix: every rank's splits (bytes), and how to run it.
#[derive(Clone, Copy)]
enum Op {
    /// Through `Algorithm::execute` with a uniform chunk: zero-copy, or packets.
    Alltoall,
    AlltoallPacket,
    /// `default_sendrecv_zero_copy` with shift 1 (the ring).
    SendRecv,
    Alltoallv,
    /// All-to-all-v of a symmetric skewed matrix: every rank's send and receive regions are the
    /// same.
    AlltoallvSymmetric,
    /// All-to-all-v of the skewed matrix with the receive regions packed in reverse rank order:
    /// every rank's send and receive regions differ (in place, copied whole into the stage).
    AlltoallvReversed,
    /// Through `default_gather_zero_copy` / `default_scatter_zero_copy`'s `execute` at a root,
    /// with the caller's (nblocks, nthreads) where given.
    Gather(usize, Option<Geometry>),
    Scatter(usize, Option<Geometry>),
}

/// A caller's launch geometry: (nblocks, nthreads).
type Geometry = (u32, u32);

/// Where a check's buffers lie.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Placement {
    /// An input and an output.
    Apart,
    /// One buffer per rank, at NCCL's in-place offsets ([`Buffers::place`]).
    InPlace,
    /// In place on rank 0 only, apart elsewhere.
    InPlaceOnRank0,
}

impl Placement {
    fn in_place(self, rank: usize) -> bool {
        match self {
            Placement::Apart => false,
            Placement::InPlace => true,
            Placement::InPlaceOnRank0 => rank == 0,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Placement::Apart => "",
            Placement::InPlace => " in place",
            Placement::InPlaceOnRank0 => " in place on rank 0",
        }
    }
}

/// `m` made symmetric (the upper triangle mirrored), so that packed splits of it give every rank
/// the same send and receive regions.
fn symmetric(m: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
    let n = m.len();
    (0..n)
        .map(|s| (0..n).map(|d| m[s.min(d)][s.max(d)]).collect())
        .collect()
}

/// Every rank's (send, receive) split for `op` with `bytes` (per peer, or per rank for v).
fn splits(op: Op, n: usize, bytes: usize, skew: f64) -> Result<Vec<(Split, Split)>> {
    Ok(match op {
        Op::Alltoall | Op::AlltoallPacket => (0..n)
            .map(|_| (Split::uniform(n, bytes), Split::uniform(n, bytes)))
            .collect(),
        Op::SendRecv => (0..n).map(|r| shift_splits(r, n, 1, bytes)).collect(),
        Op::Alltoallv | Op::AlltoallvSymmetric | Op::AlltoallvReversed => {
            let mut m = skewed_matrix(n, bytes, skew);
            if matches!(op, Op::AlltoallvSymmetric) {
                m = symmetric(m);
            }
            let mut all: Vec<(Split, Split)> = (0..n)
                .map(|r| splits_of_matrix(&m, r, 1))
                .collect::<Result<_>>()?;
            if matches!(op, Op::AlltoallvReversed) {
                for (_, recv) in &mut all {
                    let mut at = 0;
                    for p in (0..n).rev() {
                        recv.displs[p] = at;
                        at += recv.counts[p];
                    }
                }
            }
            all
        }
        Op::Gather(root, _) => (0..n)
            .map(|r| {
                let recv = if r == root {
                    Split::uniform(n, bytes)
                } else {
                    Split::only(n, root, 0)
                };
                (Split::only(n, root, bytes), recv)
            })
            .collect(),
        Op::Scatter(root, _) => (0..n)
            .map(|r| {
                let send = if r == root {
                    Split::uniform(n, bytes)
                } else {
                    Split::only(n, root, 0)
                };
                (send, Split::only(n, root, bytes))
            })
            .collect(),
    })
}

/// Device buffers of one rank for one exchange, filled and poisoned: an input and an output, or
/// (in place) both in one buffer.
struct Buffers {
    /// What this value frees (none for a view of another's allocation).
    allocs: Vec<mscclpp::core::gpu::Allocation>,
    input: Buffer,
    output: Buffer,
    /// In place: the one buffer, and the bytes last uploaded into it (what must still be there
    /// outside the received regions).
    shared: Option<(Buffer, RefCell<Vec<u8>>)>,
    gpu: Arc<dyn Gpu>,
}

impl Buffers {
    fn new(gpu: &Arc<dyn Gpu>, in_bytes: usize, out_bytes: usize) -> Result<Buffers> {
        let input = gpu.alloc(in_bytes.max(16), MemoryKind::Plain)?;
        let output = gpu.alloc(out_bytes.max(16), MemoryKind::Plain)?;
        Ok(Buffers {
            input: Buffer {
                ptr: input.ptr,
                bytes: in_bytes,
            },
            output: Buffer {
                ptr: output.ptr,
                bytes: out_bytes,
            },
            allocs: vec![input, output],
            shared: None,
            gpu: gpu.clone(),
        })
    }

    /// Buffers for this rank's (`rank`) `send` and `recv` splits.
    fn for_splits(gpu: &Arc<dyn Gpu>, rank: usize, send: &Split, recv: &Split) -> Result<Buffers> {
        Buffers::new(
            gpu,
            send.extent(rank, Side::Send)?,
            recv.extent(rank, Side::Recv)?,
        )
    }

    /// Buffers for `op` on this rank, in place or apart.
    fn place(
        gpu: &Arc<dyn Gpu>,
        op: Op,
        (rank, n): (usize, usize),
        (send, recv): (&Split, &Split),
        in_place: bool,
    ) -> Result<Buffers> {
        if !in_place {
            return Buffers::for_splits(gpu, rank, send, recv);
        }
        let (whole, _, _) = in_place_layout(op, (rank, n), (send, recv))?;
        let alloc = gpu.alloc(whole.max(16), MemoryKind::Plain)?;
        let mut b = Buffers::in_place_in(gpu, alloc.ptr, op, (rank, n), (send, recv))?;
        b.allocs.push(alloc);
        Ok(b)
    }

    /// A view of `op` in place in the buffer at `base` (owned elsewhere, at least as large as
    /// [`in_place_layout`] says).
    fn in_place_in(
        gpu: &Arc<dyn Gpu>,
        base: u64,
        op: Op,
        (rank, n): (usize, usize),
        (send, recv): (&Split, &Split),
    ) -> Result<Buffers> {
        let (whole, input, output) = in_place_layout(op, (rank, n), (send, recv))?;
        let at = |(offset, bytes): (usize, usize)| Buffer {
            ptr: base + offset as u64,
            bytes,
        };
        Ok(Buffers {
            allocs: Vec::new(),
            input: at(input),
            output: at(output),
            shared: Some((
                Buffer {
                    ptr: base,
                    bytes: whole,
                },
                RefCell::new(Vec::new()),
            )),
            gpu: gpu.clone(),
        })
    }

    /// Uploads this rank's send data for `key` and poisons the output (in place: poisons the
    /// buffer, then writes the send data at the input's place).
    fn fill(&self, key: u64, rank: usize, send: &Split) -> Result<()> {
        let mut data = vec![POISON; self.input.bytes];
        for (dst, (&c, &d)) in send.counts.iter().zip(&send.displs).enumerate() {
            byte_pattern::fill(&mut data[d..d + c], message_key(key, rank, dst, 0));
        }
        if let Some((whole, image)) = &self.shared {
            let mut all = vec![POISON; whole.bytes];
            let at = (self.input.ptr - whole.ptr) as usize;
            all[at..at + data.len()].copy_from_slice(&data);
            self.gpu.copy_to_device(whole.ptr, &all)?;
            *image.borrow_mut() = all;
            return Ok(());
        }
        self.gpu.copy_to_device(self.input.ptr, &data)?;
        self.gpu.memset_async(
            self.output.ptr,
            POISON,
            self.output.bytes.max(16),
            Stream::DEFAULT,
        )?;
        self.gpu.synchronize_stream(Stream::DEFAULT)
    }

    /// Checks the whole output (in place: the whole buffer, every byte outside the received
    /// regions as uploaded); the first wrong byte is described.
    fn verify(&self, key: u64, rank: usize, recv: &Split) -> Result<()> {
        let (base, at, mut want) = match &self.shared {
            Some((whole, image)) => (
                *whole,
                (self.output.ptr - whole.ptr) as usize,
                image.borrow().clone(),
            ),
            None => (self.output, 0, vec![POISON; self.output.bytes]),
        };
        let mut got = vec![0u8; base.bytes];
        self.gpu.copy_from_device(&mut got, base.ptr)?;
        for (src, (&c, &d)) in recv.counts.iter().zip(&recv.displs).enumerate() {
            byte_pattern::fill(
                &mut want[at + d..at + d + c],
                message_key(key, src, rank, 0),
            );
        }
        if let Some((wrong_at, wrong)) = byte_pattern::differences(&got, &want) {
            let region = (0..recv.counts.len())
                .find(|&s| {
                    recv.counts[s] > 0
                        && (at + recv.displs[s]..at + recv.displs[s] + recv.counts[s])
                            .contains(&wrong_at)
                })
                .map_or("outside every region".to_string(), |s| {
                    format!("from rank {s}")
                });
            let place = if self.shared.is_some() {
                format!(" of the in-place buffer, whose output starts at {at}")
            } else {
                String::new()
            };
            return Err(Error::Internal(format!(
                "rank {rank}: {wrong} wrong bytes, first at {wrong_at}{place} ({region}): got \
                 {:#04x}, want {:#04x}",
                got[wrong_at], want[wrong_at]
            )));
        }
        Ok(())
    }

    fn input(&self) -> Buffer {
        self.input
    }
    fn output(&self) -> Buffer {
        self.output
    }
}

/// (offset, bytes) of a buffer within the one buffer of an in-place check.
type Span = (usize, usize);

/// Where `op` lies in place on `rank` of `n` with its `send` and `recv` splits, as NCCL (and
/// nccl-tests, on every rank) places it: (bytes of the buffer, (offset, bytes) of the input,
/// (offset, bytes) of the output). Gather: the input at the rank's slot of the output; scatter: the
/// output at the rank's slot of the input; the all-to-alls: both at the start.
fn in_place_layout(
    op: Op,
    (rank, n): (usize, usize),
    (send, recv): (&Split, &Split),
) -> Result<(usize, Span, Span)> {
    Ok(match op {
        Op::Gather(root, _) => {
            let c = send.counts[root];
            (n * c, (rank * c, c), (0, n * c))
        }
        Op::Scatter(root, _) => {
            let c = recv.counts[root];
            (n * c, (0, n * c), (rank * c, c))
        }
        _ => {
            let whole = send
                .extent(rank, Side::Send)?
                .max(recv.extent(rank, Side::Recv)?);
            (whole, (0, whole), (0, whole))
        }
    })
}

impl Drop for Buffers {
    fn drop(&mut self) {
        for a in &self.allocs {
            let _ = self.gpu.free(a);
        }
    }
}

/// The algorithm objects under test.
struct Engines {
    zero_copy: Arc<AlltoallZeroCopy>,
    packet: AlltoallPacket,
    shift: ShiftSendRecv,
    gather: GatherScatter,
    scatter: GatherScatter,
}

/// A uniform exchange through `algo`'s `execute` (the sendrecv ring with shift 1).
fn execute_uniform(algo: &dyn Algorithm, b: &Buffers, stream: Stream) -> Result<()> {
    // The shift of the sendrecv (ignored by the all-to-alls).
    execute(algo, b, 1, None, stream)
}

/// `algo.execute` on `b` with `root` and the caller's `geometry` where given.
fn execute(
    algo: &dyn Algorithm,
    b: &Buffers,
    root: usize,
    geometry: Option<Geometry>,
    stream: Stream,
) -> Result<()> {
    algo.execute(&ExecuteArgs {
        input: b.input.ptr,
        output: b.output.ptr,
        input_bytes: b.input.bytes,
        output_bytes: b.output.bytes,
        dtype: DataType::U8,
        op: ReduceOp::Sum,
        accum: AccumType::Auto,
        root,
        stream,
        nblocks: geometry.map(|g| g.0),
        nthreads: geometry.map(|g| g.1),
    })
}

/// Enqueues `op` on `stream` (every rank does the same).
fn enqueue(
    engines: &Engines,
    op: Op,
    b: &Buffers,
    send: &Split,
    recv: &Split,
    stream: Stream,
) -> Result<()> {
    let engine = &engines.zero_copy;
    match op {
        Op::Alltoall => execute_uniform(engine.as_ref(), b, stream),
        Op::AlltoallPacket => execute_uniform(&engines.packet, b, stream),
        Op::SendRecv => execute_uniform(&engines.shift, b, stream),
        Op::Alltoallv | Op::AlltoallvSymmetric | Op::AlltoallvReversed => {
            engine.alltoallv(b.input(), b.output(), send, recv, stream, None, None)
        }
        Op::Gather(root, geometry) => execute(&engines.gather, b, root, geometry, stream),
        Op::Scatter(root, geometry) => execute(&engines.scatter, b, root, geometry, stream),
    }
}

/// One eager exchange of `bytes` per peer through `algo` (an all-to-all of a collection, or its
/// sendrecv ring with shift 1), checked whole: the suite's `resources` section runs the
/// collection's all-to-all family with it.
pub fn check_uniform(
    ctx: &RankContext,
    algo: &dyn Algorithm,
    bytes: usize,
    key: u64,
) -> Result<()> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let op = if algo.collective() == Collective::SendRecv {
        Op::SendRecv
    } else {
        Op::Alltoall
    };
    let all = splits(op, n, bytes, 0.0)?;
    let (send, recv) = &all[rank];
    let b = Buffers::for_splits(&ctx.gpu, rank, send, recv)?;
    b.fill(key, rank, send)?;
    execute_uniform(algo, &b, Stream::DEFAULT)?;
    ctx.gpu.synchronize_stream(Stream::DEFAULT)?;
    ctx.comm.check_device_errors()?;
    b.verify(key, rank, recv)
}

/// One checked exchange, eager or captured once and replayed twice on fresh data.
#[allow(clippy::too_many_arguments)]
fn check_one(
    ctx: &RankContext,
    engines: &Engines,
    op: Op,
    bytes: usize,
    skew: f64,
    key: u64,
    graph: bool,
    placement: Placement,
) -> Result<()> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let all = splits(op, n, bytes, skew)?;
    let (send, recv) = &all[rank];
    let b = Buffers::place(
        &ctx.gpu,
        op,
        (rank, n),
        (send, recv),
        placement.in_place(rank),
    )?;
    let gpu = &ctx.gpu;
    let stream = gpu.create_stream()?;
    let result = (|| {
        if !graph {
            b.fill(key, rank, send)?;
            enqueue(engines, op, &b, send, recv, stream)?;
            gpu.synchronize_stream(stream)?;
            ctx.comm.check_device_errors()?;
            return b.verify(key, rank, recv);
        }
        gpu.begin_capture(stream)?;
        let enqueued = enqueue(engines, op, &b, send, recv, stream);
        let ended = gpu.end_capture(stream);
        enqueued?;
        let g = ended?;
        let replays = (0..2u64).try_for_each(|replay| {
            let key = key ^ (replay + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            b.fill(key, rank, send)?;
            gpu.launch_graph(g, stream)?;
            gpu.synchronize_stream(stream)?;
            ctx.comm.check_device_errors()?;
            b.verify(key, rank, recv)
        });
        let _ = gpu.destroy_graph(g);
        replays
    })();
    let _ = gpu.destroy_stream(stream);
    result
}

/// Two engines with an all-to-all-v each in flight on two streams at once.
fn two_streams(ctx: &RankContext, engines: [&AlltoallZeroCopy; 2], key: u64) -> Result<()> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let gpu = &ctx.gpu;
    let mut jobs = Vec::new();
    for (j, skew) in [1.0, 0.0].into_iter().enumerate() {
        let all = splits(Op::Alltoallv, n, MIB + 5 + j, skew)?;
        let (send, recv) = all[rank].clone();
        let b = Buffers::for_splits(gpu, rank, &send, &recv)?;
        b.fill(key + j as u64, rank, &send)?;
        jobs.push((send, recv, b, gpu.create_stream()?));
    }
    let mut result = Ok(());
    for (j, (send, recv, b, stream)) in jobs.iter().enumerate() {
        result = result.and_then(|()| {
            // Two blocks each: both grids stay co-resident however many ranks share the GPU.
            engines[j].alltoallv(b.input(), b.output(), send, recv, *stream, Some(2), None)
        });
    }
    for (_, _, _, stream) in &jobs {
        result = result.and(gpu.synchronize_stream(*stream));
    }
    result = result.and_then(|()| ctx.comm.check_device_errors());
    for (j, (_, recv, b, _)) in jobs.iter().enumerate() {
        result = result.and_then(|()| b.verify(key + j as u64, rank, recv));
    }
    for (_, _, _, stream) in jobs {
        let _ = gpu.destroy_stream(stream);
    }
    result
}

/// All-to-all-v with the send counts in device memory (MoE routing): rows of 24 bytes split with
/// skew 1.5, counts uploaded to the device, the output 64 bytes larger than needed (which must stay
/// poisoned), the receive counts the kernel writes checked against the matrix; eager, then one
/// capture replayed twice on fresh data.
fn device_counts(ctx: &RankContext, engine: &AlltoallZeroCopy, key: u64) -> Result<String> {
    const UNIT: usize = 24;
    let (rank, n) = (ctx.rank(), ctx.size());
    let gpu = &ctx.gpu;
    let m = skewed_matrix(n, 40_000, 1.5);
    let (send, recv) = splits_of_matrix(&m, rank, UNIT)?;
    let in_bytes = send.total();
    let out_bytes = recv.total() + 64;
    let b = Buffers::new(gpu, in_bytes, out_bytes)?;
    let counts = DeviceCounts::new(gpu, &m[rank])?;
    let stream = gpu.create_stream()?;
    let call = || counts.exchange(engine, &b, UNIT, stream);
    let want: Vec<u64> = m.iter().map(|row| row[rank] as u64).collect();
    let check = |key: u64| -> Result<()> {
        gpu.synchronize_stream(stream)?;
        ctx.comm.check_device_errors()?;
        b.verify(key, rank, &recv)?;
        let got = counts.received()?;
        if got != want {
            return Err(Error::Internal(format!(
                "rank {rank}: receive counts {got:?}, expected {want:?}"
            )));
        }
        Ok(())
    };
    let result = (|| {
        counts.reset()?;
        b.fill(key, rank, &send)?;
        call()?;
        check(key)?;
        gpu.begin_capture(stream)?;
        let captured = call();
        let ended = gpu.end_capture(stream);
        captured?;
        let g = ended?;
        let replays = (1..=2u64).try_for_each(|replay| {
            let key = key ^ replay.wrapping_mul(0xD6E8_FEB8_6659_FD93);
            counts.reset()?;
            b.fill(key, rank, &send)?;
            gpu.launch_graph(g, stream)?;
            check(key)
        });
        let _ = gpu.destroy_graph(g);
        replays
    })();
    let _ = gpu.destroy_stream(stream);
    result.map(|()| {
        format!(
            "received {:?} rows; eager and 2 graph replays correct",
            want
        )
    })
}

/// The two device count arrays of [`device_counts`].
struct DeviceCounts {
    send: mscclpp::core::gpu::Allocation,
    recv: mscclpp::core::gpu::Allocation,
    n: usize,
    gpu: Arc<dyn Gpu>,
}

impl DeviceCounts {
    fn new(gpu: &Arc<dyn Gpu>, send_counts: &[usize]) -> Result<DeviceCounts> {
        let n = send_counts.len();
        let c = DeviceCounts {
            send: gpu.alloc(8 * n, MemoryKind::Plain)?,
            recv: gpu.alloc(8 * n, MemoryKind::Plain)?,
            n,
            gpu: gpu.clone(),
        };
        let bytes: Vec<u8> = send_counts
            .iter()
            .flat_map(|&v| (v as u64).to_le_bytes())
            .collect();
        gpu.copy_to_device(c.send.ptr, &bytes)?;
        Ok(c)
    }

    /// All-to-all-v of `b` on `engine` with these counts, in units of `unit` bytes, on `stream`.
    fn exchange(
        &self,
        engine: &AlltoallZeroCopy,
        b: &Buffers,
        unit: usize,
        stream: Stream,
    ) -> Result<()> {
        let (send, recv) = (self.send.ptr, self.recv.ptr);
        engine.alltoallv_device_counts(b.input(), b.output(), send, recv, unit, stream, None)
    }

    /// Poisons the receive counts.
    fn reset(&self) -> Result<()> {
        self.gpu
            .copy_to_device(self.recv.ptr, &vec![0xEE; 8 * self.n])
    }

    fn received(&self) -> Result<Vec<u64>> {
        let mut bytes = vec![0u8; 8 * self.n];
        self.gpu.copy_from_device(&mut bytes, self.recv.ptr)?;
        Ok(bytes
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
            .collect())
    }
}

impl Drop for DeviceCounts {
    fn drop(&mut self) {
        let _ = self.gpu.free(&self.send);
        let _ = self.gpu.free(&self.recv);
    }
}

/// Rank 0 expects one byte more from the last rank than that rank sends, on a communicator made
/// for the purpose (the mismatch fails it for good). With the debug host check the call is refused
/// on every rank before any launch; without it every rank's kernel sees the disagreement, nothing
/// is written anywhere (every output still poisoned), and every rank's
/// `AlltoallZeroCopy::check_device_errors` names both ranks, with no rank left waiting.
fn count_mismatch(ctx: &RankContext, comm: Arc<Communicator>) -> Result<String> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let last = n - 1;
    let mut all = splits(Op::Alltoall, n, 8, 0.0)?;
    all[0].1.counts[last] = 9;
    all[0].1.displs = (0..n).map(|p| p * 16).collect();
    let (send, recv) = &all[rank];
    let b = Buffers::new(&ctx.gpu, 8 * n, 16 * n)?;
    b.fill(7, rank, send)?;
    let named =
        format!("rank {last} sends to rank 0 8 bytes, but rank 0 receives from rank {last} 9");
    let call = |engine: &AlltoallZeroCopy| {
        engine.alltoallv(
            b.input(),
            b.output(),
            send,
            recv,
            Stream::DEFAULT,
            None,
            None,
        )
    };
    // The debug host check refuses the call on every rank, naming both ranks.
    let engine = AlltoallZeroCopy::new(comm.clone())?.with_host_check(true);
    match call(&engine) {
        Err(Error::InvalidArgument(m)) if m.contains(&named) => {}
        other => {
            return Err(Error::Internal(format!(
                "the host check should have refused with \"{named}\", got {other:?}"
            )))
        }
    }
    // On the device: every rank must fail with both ranks named.
    let engine = engine.with_host_check(false);
    call(&engine)?;
    ctx.gpu.synchronize_stream(Stream::DEFAULT)?;
    let outcome = match engine.check_device_errors() {
        Err(e) if e.to_string().contains(&named) => Ok(()),
        Err(e) => Err(Error::Internal(format!(
            "rank {rank}: the error does not name the two ranks (\"{named}\"): {e}"
        ))),
        Ok(()) => Err(Error::Internal(format!(
            "rank {rank}: no device error after the mismatch"
        ))),
    };
    // Nothing written anywhere: the whole output is still poison.
    let nothing = Split {
        counts: vec![0; n],
        displs: vec![0; n],
    };
    let outcome = outcome.and_then(|()| b.verify(7, rank, &nothing));
    let everyone = ctx.bootstrap.all_gather(&[u8::from(outcome.is_ok())])?;
    let failed: Vec<usize> = (0..n)
        .filter(|&r| everyone[r].first() != Some(&1))
        .collect();
    outcome?;
    if !failed.is_empty() {
        return Err(Error::Internal(format!(
            "ranks {failed:?} did not report the mismatch as expected (see their lines)"
        )));
    }
    Ok(format!(
        "the host check refused it; on the device every rank failed naming ranks {last} and 0, \
         nothing written, no hang"
    ))
}

/// Every rank sends one 8-byte row to every rank with device counts, but rank 0's output holds one
/// row too few, on a communicator made for the purpose: every rank's kernel sees it, nothing moves
/// anywhere, and every rank's error names rank 0 and both sizes.
fn device_counts_overflow(ctx: &RankContext, comm: Arc<Communicator>) -> Result<String> {
    const UNIT: usize = 8;
    let (rank, n) = (ctx.rank(), ctx.size());
    let send = Split::uniform(n, UNIT);
    let capacity = if rank == 0 { UNIT * (n - 1) } else { UNIT * n };
    let b = Buffers::new(&ctx.gpu, UNIT * n, capacity)?;
    b.fill(11, rank, &send)?;
    let counts = DeviceCounts::new(&ctx.gpu, &vec![1; n])?;
    let engine = AlltoallZeroCopy::new(comm)?;
    counts.exchange(&engine, &b, UNIT, Stream::DEFAULT)?;
    ctx.gpu.synchronize_stream(Stream::DEFAULT)?;
    let named = format!(
        "the senders to rank 0 send {} bytes in all, beyond its output's {}",
        UNIT * n,
        UNIT * (n - 1)
    );
    let outcome = match engine.check_device_errors() {
        Err(e) if e.to_string().contains(&named) => b.verify(
            11,
            rank,
            &Split {
                counts: vec![0; n],
                displs: vec![0; n],
            },
        ),
        other => Err(Error::Internal(format!(
            "rank {rank}: expected an error with \"{named}\", got {other:?}"
        ))),
    };
    let everyone = ctx.bootstrap.all_gather(&[u8::from(outcome.is_ok())])?;
    outcome?;
    if everyone.iter().any(|v| v.first() != Some(&1)) {
        return Err(Error::Internal(
            "another rank did not report the overflow as expected (see its line)".into(),
        ));
    }
    Ok("every rank failed naming rank 0's output, nothing written, no hang".into())
}

/// Beyond the stage, what no kernel can serve in place fails on every rank by name before anything
/// moves: rank 0 alone in place in an all-to-all (a swap needs both ranks of each pair, and a push
/// into rank 0 would overwrite what it has yet to send), then every rank in place in an
/// all-to-all-v whose receive regions differ from its send regions. Every buffer is checked
/// afterwards as it was uploaded (poison where nothing was sent).
fn in_place_refusals(ctx: &RankContext, engines: &Engines, key: u64) -> Result<String> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let beyond = engines.zero_copy.stage_bytes() + 16 * n;
    let nothing = Split {
        counts: vec![0; n],
        displs: vec![0; n],
    };
    let cases = [
        (
            Op::Alltoall,
            beyond.div_ceil(n),
            Placement::InPlaceOnRank0,
            "rank 0 is in place beyond its all-to-all stage".to_string(),
        ),
        (
            Op::AlltoallvReversed,
            beyond,
            Placement::InPlace,
            "with receive regions other than its send regions".to_string(),
        ),
    ];
    for (i, (op, bytes, placement, named)) in cases.into_iter().enumerate() {
        let all = splits(op, n, bytes, 1.5)?;
        let (send, recv) = &all[rank];
        let b = Buffers::place(
            &ctx.gpu,
            op,
            (rank, n),
            (send, recv),
            placement.in_place(rank),
        )?;
        b.fill(key ^ i as u64, rank, send)?;
        let outcome = match enqueue(engines, op, &b, send, recv, Stream::DEFAULT) {
            Err(e) if e.to_string().contains(&named) => {
                ctx.gpu.synchronize_stream(Stream::DEFAULT)?;
                b.verify(key ^ i as u64, rank, &nothing)
            }
            other => Err(Error::Internal(format!(
                "rank {rank}: {}{}: expected an error with \"{named}\", got {other:?}",
                op_name(op),
                placement.label()
            ))),
        };
        let everyone = ctx.bootstrap.all_gather(&[u8::from(outcome.is_ok())])?;
        outcome?;
        if everyone.iter().any(|v| v.first() != Some(&1)) {
            return Err(Error::Internal(format!(
                "{}{}: another rank did not fail as expected (see its line)",
                op_name(op),
                placement.label()
            )));
        }
    }
    Ok("every rank failed naming the problem, nothing moved, no hang".into())
}

/// What nccl-tests 2.19 does for scatter, gather and all-to-all at root 0: per size, a send buffer
/// S and a receive buffer R of `nranks` chunks each, the call out of place (S to R), then in place
/// in R at NCCL's offsets (scatter: `recvbuff = R + rank * chunk`, gather: `sendbuff = R + rank *
/// chunk`, all-to-all: R both), each checked. The in-place scatter hands rank 0 back the output it
/// had out of place while every other rank's output is new, which hung when a gather or scatter
/// registered its buffers through a per-rank cache (rank 0 in the kernel, the others in the
/// registration's exchange). Chunks of 64 B, 4 KiB + 8 and 1 MiB - 8 (within the engine's stage
/// gathers and scatters map no user buffer and the in-place all-to-all is copied; beyond it, at 8
/// ranks, they register and swap).
fn nccl_tests_sequence(ctx: &RankContext, engines: &Engines, key: u64) -> Result<String> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let mut done = 0;
    for (o, op) in [Op::Scatter(0, None), Op::Gather(0, None), Op::Alltoall]
        .into_iter()
        .enumerate()
    {
        for (i, bytes) in [64, 4096 + 8, MIB - 8].into_iter().enumerate() {
            let all = splits(op, n, bytes, 0.0)?;
            let (send, recv) = &all[rank];
            let whole = n * bytes;
            let mut apart = Buffers::new(&ctx.gpu, whole, whole)?;
            (apart.input.bytes, apart.output.bytes) = match op {
                Op::Gather(..) => (bytes, whole),
                Op::Scatter(..) => (whole, bytes),
                _ => (whole, whole),
            };
            let r = apart.output.ptr;
            let key = key ^ ((o * 8 + i) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for (placement, b) in [
                ("out of place", &apart),
                (
                    "in place",
                    &Buffers::in_place_in(&ctx.gpu, r, op, (rank, n), (send, recv))?,
                ),
            ] {
                b.fill(key, rank, send)?;
                enqueue(engines, op, b, send, recv, Stream::DEFAULT)?;
                ctx.gpu.synchronize_stream(Stream::DEFAULT)?;
                ctx.comm.check_device_errors()?;
                b.verify(key, rank, recv).map_err(|e| {
                    Error::Internal(format!("{} {bytes} B {placement}: {e}", op_name(op)))
                })?;
                done += 1;
            }
        }
    }
    Ok(format!(
        "{done} calls correct (scatter, gather, all-to-all at root 0)"
    ))
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Gather(..) => "gather",
        Op::Scatter(..) => "scatter",
        _ => "all-to-all",
    }
}

/// Gather and scatter with an out-of-range nblocks or nthreads: refused on every rank with an error
/// naming the rank and the value, before anything collective (so no rank is left waiting).
fn bad_geometry(ctx: &RankContext, engines: &Engines) -> Result<String> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let too_many = engines.zero_copy.max_blocks() + 1;
    let cases = [
        (Op::Gather(0, Some((0, 128))), "nblocks 0"),
        (
            Op::Scatter(0, Some((too_many, 512))),
            &*format!("nblocks {too_many}"),
        ),
        (Op::Gather(n - 1, Some((1, 100))), "nthreads 100"),
    ];
    for (op, named) in cases {
        let all = splits(op, n, 64, 0.0)?;
        let (send, recv) = &all[rank];
        let b = Buffers::for_splits(&ctx.gpu, rank, send, recv)?;
        match enqueue(engines, op, &b, send, recv, Stream::DEFAULT) {
            Err(Error::LaunchShape(m))
                if m.contains(named) && m.contains(&format!("rank {rank}")) => {}
            other => {
                return Err(Error::Internal(format!(
                    "rank {rank}: expected an error naming \"{named}\" and the rank, got {other:?}"
                )))
            }
        }
    }
    Ok("nblocks 0, nblocks beyond the grid and nthreads 100 each refused by name".into())
}

/// One row of the matrix: its name, the exchange, its sizes, skews and placement.
type Row = (String, Op, Vec<usize>, &'static [f64], Placement);

/// Runs the all-to-all family checks on this rank; returns (check name, outcome) in order.
pub fn run(ctx: &RankContext) -> Vec<(String, Result<String>)> {
    let n = ctx.size();
    let comm = &ctx.comm;
    let scratch = mscclpp_collectives::DEFAULT_SCRATCH_BYTES;
    let built = mscclpp_collectives::collection_resources(comm, scratch).and_then(|resources| {
        let zero_copy = Arc::new(AlltoallZeroCopy::with_resources(
            comm.clone(),
            resources.clone(),
        )?);
        Ok(Engines {
            shift: ShiftSendRecv::new(zero_copy.clone()),
            gather: GatherScatter::gather(zero_copy.clone()),
            scatter: GatherScatter::scatter(zero_copy.clone()),
            zero_copy,
            packet: AlltoallPacket::with_resources(comm.clone(), resources)?,
        })
    });
    let engines = match built {
        Ok(e) => e,
        Err(e) => return vec![("alltoall setup".into(), Err(e))],
    };
    let engine = &engines.zero_copy;
    let packet_max = engines.packet.max_chunk_bytes();
    let run_seed = match ctx.shared_seed() {
        Ok(s) => s,
        Err(e) => return vec![("alltoall run seed".into(), Err(e))],
    };
    let root = n / 2;
    // The caller's geometry reaches the gather and scatter kernels: a small grid of narrow blocks.
    let asked = (3, 128);
    let apart = Placement::Apart;
    let mut rows: Vec<Row> = vec![
        (
            format!("{SENDRECV_ZERO_COPY} (ring)"),
            Op::SendRecv,
            chunk_sizes(1),
            &[0.0],
            apart,
        ),
        (
            ALLTOALL_ZERO_COPY.to_string(),
            Op::Alltoall,
            chunk_sizes(n),
            &[0.0],
            apart,
        ),
        (
            ALLTOALL_PACKET.to_string(),
            Op::AlltoallPacket,
            vec![0, 1, 3, 4096 + 8, 64 << 10, packet_max],
            &[0.0],
            apart,
        ),
        (
            "alltoallv (skewed)".into(),
            Op::Alltoallv,
            ALLTOALLV_SIZES.to_vec(),
            &SKEWS,
            apart,
        ),
        (
            format!("gather (root {root})"),
            Op::Gather(root, None),
            chunk_sizes(n),
            &[0.0],
            apart,
        ),
        (
            format!("scatter (root {root})"),
            Op::Scatter(root, None),
            chunk_sizes(n),
            &[0.0],
            apart,
        ),
        (
            format!("gather (root 0, nblocks {} nthreads {})", asked.0, asked.1),
            Op::Gather(0, Some(asked)),
            vec![4096 + 8, MIB - 1],
            &[0.0],
            apart,
        ),
        (
            format!(
                "scatter (root {}, nblocks {} nthreads {})",
                n - 1,
                asked.0,
                asked.1
            ),
            Op::Scatter(n - 1, Some(asked)),
            vec![4096 + 8, MIB - 1],
            &[0.0],
            apart,
        ),
    ];
    // In place: every row above that NCCL runs in place, at NCCL's offsets (`Buffers::place`).
    let packet_sizes = vec![0, 1, 3, 4096 + 8, 64 << 10, packet_max];
    // Every rank in place is served at every size; a mix, or regions that differ, up to the
    // engine's stage (the input is copied there first; `in_place_refusals` beyond it).
    let stage = engine.stage_bytes();
    let fits = |op: Op, sizes: Vec<usize>| -> Vec<usize> {
        sizes
            .into_iter()
            .filter(|&b| bytes_per_rank(op, b, n) <= stage)
            .collect()
    };
    let in_place = Placement::InPlace;
    let mixed = Placement::InPlaceOnRank0;
    rows.extend([
        (
            ALLTOALL_ZERO_COPY.to_string(),
            Op::Alltoall,
            chunk_sizes(n),
            &[0.0][..],
            in_place,
        ),
        (
            ALLTOALL_ZERO_COPY.to_string(),
            Op::Alltoall,
            fits(Op::Alltoall, chunk_sizes(n)),
            &[0.0],
            mixed,
        ),
        (
            ALLTOALL_PACKET.to_string(),
            Op::AlltoallPacket,
            packet_sizes.clone(),
            &[0.0],
            in_place,
        ),
        (
            ALLTOALL_PACKET.to_string(),
            Op::AlltoallPacket,
            packet_sizes,
            &[0.0],
            mixed,
        ),
        (
            "alltoallv (skewed, symmetric)".into(),
            Op::AlltoallvSymmetric,
            ALLTOALLV_SIZES.to_vec(),
            &SKEWS,
            in_place,
        ),
        (
            "alltoallv (skewed, symmetric)".into(),
            Op::AlltoallvSymmetric,
            vec![4096 + 8, MIB - 1],
            &[1.5],
            mixed,
        ),
        // Regions that differ.
        (
            "alltoallv (skewed, received in reverse rank order)".into(),
            Op::AlltoallvReversed,
            vec![1, 3, 4096 + 8, MIB - 1],
            &SKEWS,
            in_place,
        ),
        (
            format!("gather (root {root})"),
            Op::Gather(root, None),
            chunk_sizes(n),
            &[0.0],
            in_place,
        ),
        (
            format!("scatter (root {root})"),
            Op::Scatter(root, None),
            chunk_sizes(n),
            &[0.0],
            in_place,
        ),
    ]);
    let mut out = Vec::new();
    let mut aborted: Option<String> = None;
    let mut case = 0u64;
    for (name, op, sizes, skews, placement) in rows {
        let name = format!("{name}{}", placement.label());
        if let Some(why) = &aborted {
            out.push((name, Err(Error::Internal(format!("not run: {why}")))));
            continue;
        }
        let mut tally = Tally::default();
        'row: for &bytes in &sizes {
            for &skew in skews {
                let modes: &[bool] = if with_graph(op, bytes, n) {
                    &[false, true]
                } else {
                    &[false]
                };
                for &graph in modes {
                    case += 1;
                    let key = run_seed ^ case.wrapping_mul(0x2545_f491_4f6c_dd1d);
                    let what = format!(
                        "{name} {bytes} B skew {skew} {}",
                        if graph { "graph" } else { "eager" }
                    );
                    let r = check_one(ctx, &engines, op, bytes, skew, key, graph, placement);
                    let completed = ran_to_end(&r);
                    if let Err(why) = tally.record(ctx, &what, r, completed) {
                        aborted = Some(why);
                        break 'row;
                    }
                }
            }
        }
        let outcome = tally.outcome(&aborted, |passed| {
            format!(
                "{passed} checks passed (sizes {sizes:?} bytes, eager, and graph with 2 replays \
                 below 1 GiB per rank, on {n} ranks)"
            )
        });
        out.push((name, outcome));
    }
    if aborted.is_none() {
        let second = AlltoallZeroCopy::new(ctx.comm.clone());
        let r = second.and_then(|s| two_streams(ctx, [engine, &s], run_seed ^ 0xABCD));
        out.push((
            "alltoallv: two engines in flight on two streams".into(),
            r.map(|()| "both exchanges correct".into()),
        ));
        out.push((
            "gather/scatter: bad nblocks or nthreads refused".into(),
            bad_geometry(ctx, &engines),
        ));
        out.push((
            "nccl-tests' sequence: out of place, then in place in the same buffers".into(),
            nccl_tests_sequence(ctx, &engines, run_seed ^ 0x1A5E),
        ));
        if n >= 2 {
            out.push((
                "in place beyond the stage: a mix, and differing regions, refused".into(),
                in_place_refusals(ctx, &engines, run_seed ^ 0x5A9),
            ));
        }
        out.push((
            "alltoallv: device counts (MoE routing)".into(),
            device_counts(ctx, engine, run_seed ^ 0x5EED),
        ));
        if n >= 2 {
            let r = ctx
                .fresh_communicator()
                .and_then(|comm| count_mismatch(ctx, comm));
            out.push(("alltoallv: count mismatch -> device error".into(), r));
            let r = ctx
                .fresh_communicator()
                .and_then(|comm| device_counts_overflow(ctx, comm));
            out.push((
                "alltoallv: device counts overflow -> device error".into(),
                r,
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_collectives::alltoall::check_matrix;

    #[test]
    fn every_op_of_the_matrix_is_a_consistent_exchange() {
        for n in [1, 2, 4, 8] {
            let ops = [
                Op::Alltoall,
                Op::AlltoallPacket,
                Op::SendRecv,
                Op::Alltoallv,
                Op::AlltoallvSymmetric,
                Op::AlltoallvReversed,
                Op::Gather(n / 2, None),
                Op::Scatter(n - 1, Some((3, 128))),
            ];
            for op in ops {
                for bytes in chunk_sizes(n).into_iter().chain(ALLTOALLV_SIZES) {
                    for skew in SKEWS {
                        let all = splits(op, n, bytes, skew).unwrap();
                        let (s, r): (Vec<_>, Vec<_>) = all.into_iter().unzip();
                        check_matrix(&s, &r).unwrap();
                    }
                }
            }
        }
    }

    /// The in-place all-to-all-v rows: the whole in-place buffer holds both sides, and the engine
    /// copies it whole within the stage, swaps symmetric regions beyond it and refuses the rest.
    #[test]
    fn in_place_rows_have_the_regions_the_engine_needs() {
        use mscclpp_collectives::alltoall::zero_copy::{in_place_plan, InPlace};
        for n in [2, 3, 8] {
            for &bytes in &ALLTOALLV_SIZES {
                for skew in SKEWS {
                    for (rank, (send, recv)) in splits(Op::AlltoallvSymmetric, n, bytes, skew)
                        .unwrap()
                        .iter()
                        .enumerate()
                    {
                        let (whole, input, output) =
                            in_place_layout(Op::AlltoallvSymmetric, (rank, n), (send, recv))
                                .unwrap();
                        assert_eq!((input, output), ((0, whole), (0, whole)));
                        // Copied whole within a 7 MiB stage, swapped beyond it.
                        let one = Buffer {
                            ptr: 1 << 40,
                            bytes: whole,
                        };
                        match in_place_plan("t", rank, (one, send), (one, recv), 7 * MIB) {
                            Ok(InPlace::No) => assert!(bytes == 0 || send.total() == 0),
                            Ok(InPlace::Copy { bytes: b }) => assert!(b <= 7 * MIB),
                            Ok(InPlace::Swap { bytes: b }) => assert!(b > 7 * MIB && b == whole),
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            }
        }
        // Gather and scatter at NCCL's offsets: the input at the rank's slot, or the output.
        let g = splits(Op::Gather(1, None), 4, 8, 0.0).unwrap();
        let layout = in_place_layout(Op::Gather(1, None), (2, 4), (&g[2].0, &g[2].1)).unwrap();
        assert_eq!(layout, (32, (16, 8), (0, 32)));
        let sc = splits(Op::Scatter(1, None), 4, 8, 0.0).unwrap();
        let layout = in_place_layout(Op::Scatter(1, None), (3, 4), (&sc[3].0, &sc[3].1)).unwrap();
        assert_eq!(layout, (32, (0, 32), (24, 8)));
    }
}
