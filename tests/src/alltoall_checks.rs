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
        Op::SendRecv | Op::Alltoallv => bytes,
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
    /// Through `default_gather_zero_copy` / `default_scatter_zero_copy`'s `execute` at a root,
    /// with the caller's (nblocks, nthreads) where given.
    Gather(usize, Option<Geometry>),
    Scatter(usize, Option<Geometry>),
}

/// A caller's launch geometry: (nblocks, nthreads).
type Geometry = (u32, u32);

/// Every rank's (send, receive) split for `op` with `bytes` (per peer, or per rank for v).
fn splits(op: Op, n: usize, bytes: usize, skew: f64) -> Result<Vec<(Split, Split)>> {
    Ok(match op {
        Op::Alltoall | Op::AlltoallPacket => (0..n)
            .map(|_| (Split::uniform(n, bytes), Split::uniform(n, bytes)))
            .collect(),
        Op::SendRecv => (0..n).map(|r| shift_splits(r, n, 1, bytes)).collect(),
        Op::Alltoallv => {
            let m = skewed_matrix(n, bytes, skew);
            (0..n)
                .map(|r| splits_of_matrix(&m, r, 1))
                .collect::<Result<_>>()?
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

/// Device buffers of one rank for one exchange, filled and poisoned.
struct Buffers {
    input: mscclpp::core::gpu::Allocation,
    output: mscclpp::core::gpu::Allocation,
    in_bytes: usize,
    out_bytes: usize,
    gpu: Arc<dyn Gpu>,
}

impl Buffers {
    fn new(gpu: &Arc<dyn Gpu>, in_bytes: usize, out_bytes: usize) -> Result<Buffers> {
        Ok(Buffers {
            input: gpu.alloc(in_bytes.max(16), MemoryKind::Plain)?,
            output: gpu.alloc(out_bytes.max(16), MemoryKind::Plain)?,
            in_bytes,
            out_bytes,
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

    /// Uploads this rank's send data for `key` and poisons the output.
    fn fill(&self, key: u64, rank: usize, send: &Split) -> Result<()> {
        let mut data = vec![POISON; self.in_bytes];
        for (dst, (&c, &d)) in send.counts.iter().zip(&send.displs).enumerate() {
            byte_pattern::fill(&mut data[d..d + c], message_key(key, rank, dst, 0));
        }
        self.gpu.copy_to_device(self.input.ptr, &data)?;
        self.gpu.memset_async(
            self.output.ptr,
            POISON,
            self.out_bytes.max(16),
            Stream::DEFAULT,
        )?;
        self.gpu.synchronize_stream(Stream::DEFAULT)
    }

    /// Checks the whole output; the first wrong byte is described.
    fn verify(&self, key: u64, rank: usize, recv: &Split) -> Result<()> {
        let mut got = vec![0u8; self.out_bytes];
        self.gpu.copy_from_device(&mut got, self.output.ptr)?;
        let mut want = vec![POISON; self.out_bytes];
        for (src, (&c, &d)) in recv.counts.iter().zip(&recv.displs).enumerate() {
            byte_pattern::fill(&mut want[d..d + c], message_key(key, src, rank, 0));
        }
        if let Some((at, wrong)) = byte_pattern::differences(&got, &want) {
            let region = (0..recv.counts.len())
                .find(|&s| {
                    recv.counts[s] > 0
                        && (recv.displs[s]..recv.displs[s] + recv.counts[s]).contains(&at)
                })
                .map_or("outside every region".to_string(), |s| {
                    format!("from rank {s}")
                });
            return Err(Error::Internal(format!(
                "rank {rank}: {wrong} wrong bytes, first at {at} ({region}): got {:#04x}, want {:#04x}",
                got[at], want[at]
            )));
        }
        Ok(())
    }

    fn input(&self) -> Buffer {
        Buffer {
            ptr: self.input.ptr,
            bytes: self.in_bytes,
        }
    }
    fn output(&self) -> Buffer {
        Buffer {
            ptr: self.output.ptr,
            bytes: self.out_bytes,
        }
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        let _ = self.gpu.free(&self.input);
        let _ = self.gpu.free(&self.output);
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
        input_bytes: b.in_bytes,
        output_bytes: b.out_bytes,
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
        Op::Alltoallv => engine.alltoallv(b.input(), b.output(), send, recv, stream, None, None),
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
fn check_one(
    ctx: &RankContext,
    engines: &Engines,
    op: Op,
    bytes: usize,
    skew: f64,
    key: u64,
    graph: bool,
) -> Result<()> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let all = splits(op, n, bytes, skew)?;
    let (send, recv) = &all[rank];
    let b = Buffers::for_splits(&ctx.gpu, rank, send, recv)?;
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
    let rows: [(String, Op, Vec<usize>, &[f64]); 8] = [
        (
            format!("{SENDRECV_ZERO_COPY} (ring)"),
            Op::SendRecv,
            chunk_sizes(1),
            &[0.0],
        ),
        (
            ALLTOALL_ZERO_COPY.to_string(),
            Op::Alltoall,
            chunk_sizes(n),
            &[0.0],
        ),
        (
            ALLTOALL_PACKET.to_string(),
            Op::AlltoallPacket,
            vec![0, 1, 3, 4096 + 8, 64 << 10, packet_max],
            &[0.0],
        ),
        (
            "alltoallv (skewed)".into(),
            Op::Alltoallv,
            ALLTOALLV_SIZES.to_vec(),
            &SKEWS,
        ),
        (
            format!("gather (root {root})"),
            Op::Gather(root, None),
            chunk_sizes(n),
            &[0.0],
        ),
        (
            format!("scatter (root {root})"),
            Op::Scatter(root, None),
            chunk_sizes(n),
            &[0.0],
        ),
        (
            format!("gather (root 0, nblocks {} nthreads {})", asked.0, asked.1),
            Op::Gather(0, Some(asked)),
            vec![4096 + 8, MIB - 1],
            &[0.0],
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
        ),
    ];
    let mut out = Vec::new();
    let mut aborted: Option<String> = None;
    let mut case = 0u64;
    for (name, op, sizes, skews) in rows {
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
                    let r = check_one(ctx, &engines, op, bytes, skew, key, graph);
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
}
