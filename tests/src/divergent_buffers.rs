//! GPU check of the user-buffer rule (`mscclpp_collectives::user_buffers`): every algorithm that
//! reads or writes peers' user buffers, called on buffers that every rank places differently, as
//! a caching allocator gives them.
//!
//! Each rank keeps an arena of a few device allocations ("segments", like PyTorch's) and places
//! each call's buffers in them at offsets of its own choosing, at odd element offsets too. Between
//! calls each rank, on its own random schedule, frees a segment and allocates another (a new
//! buffer id, at a new address or at the one just freed), so one rank's buffer is new while a
//! peer's was seen before, and a peer's old address now holds other data. The collectives, sizes
//! (either side of the selector's thresholds), types and roots follow a schedule every rank shares;
//! whether a call is in place is each rank's own choice where NCCL allows that (all-reduce,
//! broadcast, reduce), and an all-reduce takes the algorithm the default selector would give that
//! rank (the copy-engine all-reduce out of place, the zero-copy one in place), so a call can reach
//! two algorithms at once. Every output is poisoned first and every element checked against the
//! host reference (`testing::check_collective_at`). The seed is printed, so a failure replays
//! (`MSCCLPP_DIVERGENT_SEED`); `MSCCLPP_DIVERGENT_CALLS` sets the number of calls (default 2000,
//! 500 under the suite's `--quick`).

use crate::{RankContext, SplitMix64, MIB};
use mscclpp::core::algorithm::{Algorithm, Collective};
use mscclpp::core::algorithm_collection::{native_names as names, AlgorithmCollection};
use mscclpp::core::gpu::{DevicePtr, MemoryKind, Stream};
use mscclpp::core::{DataType, Error, ReduceOp, Result};
use mscclpp_collectives::testing::check_collective_at;
use std::sync::Arc;

/// `--only` name of this section.
pub const SECTION: &str = "divergent_buffers";

/// Segments each rank keeps, and their sizes: room for the largest call's buffers in one.
const SEGMENTS: usize = 3;
const SEGMENT_BYTES: [usize; 3] = [40 * MIB, 48 * MIB, 56 * MIB];

/// Message sizes (bytes of a call's larger buffer), either side of the packet and zero-copy
/// thresholds; each also one element less and more.
const SIZES: [usize; 9] = [
    1,
    1024,
    64 << 10,
    256 << 10,
    MIB,
    2 * MIB,
    4 * MIB,
    8 * MIB,
    16 * MIB,
];

/// What the schedule picks from: the algorithms that touch peers' user buffers. `None` in the
/// all-reduce slot stands for the selector's choice by placement (see the module docs).
const CALLS: [(Collective, Option<&str>); 7] = [
    (Collective::AllReduce, None),
    (Collective::AllReduce, Some(names::ALLREDUCE_RSAG_ZERO_COPY)),
    (Collective::AllGather, Some(names::ALLGATHER_FULLMESH2)),
    (
        Collective::ReduceScatter,
        Some(names::REDUCESCATTER_ZERO_COPY),
    ),
    (Collective::Broadcast, Some(names::BROADCAST_ZERO_COPY)),
    (Collective::Reduce, Some(names::REDUCE_ZERO_COPY)),
    (Collective::AllToAll, Some(names::ALLTOALL_ZERO_COPY)),
];

const DTYPES: [DataType; 4] = [DataType::F32, DataType::Bf16, DataType::I32, DataType::F64];

/// One rank's arena: its segments, replaced on its own schedule.
struct Arena {
    gpu: Arc<dyn mscclpp::core::gpu::Gpu>,
    segments: Vec<crate::DeviceBuffer>,
    /// A small allocation made and kept now and then, so that a replaced segment does not always
    /// land where the freed one was.
    spacers: Vec<crate::DeviceBuffer>,
    rng: SplitMix64,
    replaced: usize,
}

impl Arena {
    fn new(ctx: &RankContext, seed: u64) -> Result<Arena> {
        let mut rng = SplitMix64(crate::seed(seed, 0xa11c, ctx.rank()));
        let mut segments = Vec::with_capacity(SEGMENTS);
        // Ranks allocate their segments in different orders and sizes.
        for i in 0..SEGMENTS {
            let bytes = SEGMENT_BYTES[(i + ctx.rank() + rng.next_u64() as usize) % 3];
            segments.push(crate::DeviceBuffer::new(
                &ctx.gpu,
                bytes,
                MemoryKind::Plain,
            )?);
        }
        Ok(Arena {
            gpu: ctx.gpu.clone(),
            segments,
            spacers: Vec::new(),
            rng,
            replaced: 0,
        })
    }

    /// Frees and allocates again on this rank's own schedule (about one call in eight).
    fn churn(&mut self) -> Result<()> {
        if self.rng.next_u64() % 8 != 0 {
            return Ok(());
        }
        let i = (self.rng.next_u64() % SEGMENTS as u64) as usize;
        let bytes = SEGMENT_BYTES[(self.rng.next_u64() % 3) as usize];
        // Free first: the new segment may take the same address, with a new buffer id.
        self.segments[i] = crate::DeviceBuffer::new(&self.gpu, 1, MemoryKind::Plain)?;
        if self.rng.next_u64() % 3 == 0 {
            let spacer = (1 + self.rng.next_u64() % 4) as usize * 2 * MIB;
            self.spacers.push(crate::DeviceBuffer::new(
                &self.gpu,
                spacer,
                MemoryKind::Plain,
            )?);
            if self.spacers.len() > 4 {
                self.spacers.remove(0);
            }
        }
        self.segments[i] = crate::DeviceBuffer::new(&self.gpu, bytes, MemoryKind::Plain)?;
        self.replaced += 1;
        Ok(())
    }

    /// `bytes` at an offset of this rank's choosing in a segment of its choosing: a multiple of
    /// 512 bytes, or of the element size (odd) one call in four.
    fn place(&mut self, bytes: usize, elem: usize) -> Result<DevicePtr> {
        let i = (self.rng.next_u64() % SEGMENTS as u64) as usize;
        let seg = &self.segments[i];
        let room = seg.alloc.size.saturating_sub(bytes);
        if room < 1024 {
            return Err(Error::Internal(format!(
                "a segment of {} bytes cannot hold {bytes}",
                seg.alloc.size
            )));
        }
        let mut offset = (self.rng.next_u64() as usize % (room - 1024)) / 512 * 512;
        if self.rng.next_u64() % 4 == 0 {
            offset += elem * (1 + 2 * (self.rng.next_u64() % 7) as usize);
        }
        Ok(seg.ptr() + offset as u64)
    }
}

/// Runs the section: one entry with the calls made and their checks, or the first failure.
pub fn run(ctx: &RankContext, coll: &AlgorithmCollection) -> Vec<(String, Result<String>)> {
    let name = format!("{SECTION}: zero-copy calls on buffers placed differently per rank");
    vec![(name, run_calls(ctx, coll))]
}

fn run_calls(ctx: &RankContext, coll: &AlgorithmCollection) -> Result<String> {
    let seed = match std::env::var("MSCCLPP_DIVERGENT_SEED") {
        Ok(s) => s
            .parse::<u64>()
            .map_err(|e| Error::InvalidArgument(format!("MSCCLPP_DIVERGENT_SEED={s}: {e}")))?,
        Err(_) => ctx.shared_seed()?,
    };
    let calls = match std::env::var("MSCCLPP_DIVERGENT_CALLS") {
        Ok(s) => s
            .parse::<usize>()
            .map_err(|e| Error::InvalidArgument(format!("MSCCLPP_DIVERGENT_CALLS={s}: {e}")))?,
        // The suite's `--quick` keeps a quarter of the calls.
        Err(_) if std::env::args().any(|a| a == "--quick") => 500,
        Err(_) => 2000,
    };
    let (rank, n) = (ctx.rank(), ctx.size());
    if rank == 0 {
        println!(
            "{SECTION}: seed {seed} (MSCCLPP_DIVERGENT_SEED={seed} replays it), {calls} calls"
        );
    }
    let stream = ctx.gpu.create_stream()?;
    let result = run_with(ctx, coll, seed, calls, stream);
    let _ = ctx.gpu.destroy_stream(stream);
    let (checked, replaced) = result?;
    Ok(format!(
        "{checked} calls checked on rank {rank} of {n}, {replaced} segments replaced here (seed \
         {seed})"
    ))
}

fn run_with(
    ctx: &RankContext,
    coll: &AlgorithmCollection,
    seed: u64,
    calls: usize,
    stream: Stream,
) -> Result<(usize, usize)> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let mut shared = SplitMix64(crate::seed(seed, 0x5c4e, 0));
    let mut arena = Arena::new(ctx, seed)?;
    for call in 0..calls {
        let (collective, named) = CALLS[(shared.next_u64() % CALLS.len() as u64) as usize];
        let dtype = DTYPES[(shared.next_u64() % DTYPES.len() as u64) as usize];
        let op = if collective.reduces() {
            [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min][(shared.next_u64() % 3) as usize]
        } else {
            ReduceOp::Sum
        };
        let es = dtype.size();
        // The sizes are of the larger buffer: an all-gather's output and a reduce-scatter's input
        // are n units.
        let mut base = SIZES[(shared.next_u64() % SIZES.len() as u64) as usize];
        if matches!(
            collective,
            Collective::AllGather | Collective::ReduceScatter
        ) {
            base = (base / n).max(1);
        }
        let nudge = [0i64, -1, 1][(shared.next_u64() % 3) as usize];
        // Elements of the collective's unit: whole chunks where it splits into ranks' pieces.
        let mut count = ((base / es).max(1) as i64 + nudge).max(1) as usize;
        if collective == Collective::AllToAll {
            count = count.div_ceil(n) * n;
        }
        let root = (shared.next_u64() % n as u64) as usize;
        let case_seed = crate::seed(seed, call as u64, 0);
        arena.churn()?;
        let (in_count, out_count) = match collective {
            Collective::AllGather => (count, count * n),
            Collective::ReduceScatter => (count * n, count),
            _ => (count, count),
        };
        // In place where every rank may choose it alone (the all-gather's and reduce-scatter's
        // slices are left to the matrices).
        let own_choice = matches!(
            collective,
            Collective::AllReduce | Collective::Broadcast | Collective::Reduce
        );
        let in_place = own_choice && arena.rng.next_u64() % 2 == 0;
        let in_bytes = in_count.max(out_count) * es;
        let input = arena.place(in_bytes, es)?;
        let mut output = input;
        // Out of place the two must not overlap (NCCL's rule): placed again until they do not.
        while !in_place
            && output < input + in_bytes as u64
            && input < output + (out_count * es) as u64
        {
            output = arena.place(out_count * es, es)?;
        }
        let algo = pick(coll, collective, named, in_place, count * es, n)?;
        let report = check_collective_at(
            &ctx.comm,
            algo.as_ref(),
            dtype,
            op,
            count,
            case_seed,
            Some(root),
            (input, output),
            stream,
        );
        let ok = matches!(&report, Ok(r) if r.wrong == 0);
        if rank == 0 && (call + 1) % PROGRESS_EVERY == 0 {
            println!("{SECTION}: {} calls made", call + 1);
        }
        // Every rank learns whether every rank's result was right before the next call.
        if !ctx.all_completed(ok)? {
            let what = format!(
                "call {call} (seed {seed}): {} {collective} {dtype} {op} count {count} root {root}, \
                 rank {rank} {} at input {input:#x} output {output:#x}",
                algo.name(),
                if in_place { "in place" } else { "out of place" }
            );
            return Err(match report {
                Ok(r) if r.wrong > 0 => Error::Internal(format!(
                    "{what}: {} wrong elements, first {:?}",
                    r.wrong, r.first_wrong
                )),
                Ok(_) => Error::Internal(format!("{what}: right here, wrong on a peer")),
                Err(e) => Error::Internal(format!("{what}: {e}")),
            });
        }
    }
    Ok((calls, arena.replaced))
}

/// Rank 0 says how far the run is every this many calls (a long run cut by a time limit still
/// tells how far it got).
const PROGRESS_EVERY: usize = 250;

/// The algorithm of a call: the named one, or for an all-reduce the one the default selector
/// gives this rank's placement among the large-message kinds (the copy engine from 1 MiB here,
/// at the 2 to 4 ranks it serves, so that mixed calls come often).
fn pick(
    coll: &AlgorithmCollection,
    collective: Collective,
    named: Option<&str>,
    in_place: bool,
    bytes: usize,
    n: usize,
) -> Result<Arc<dyn Algorithm>> {
    let copy_engine = !in_place
        && (2..=4).contains(&n)
        && bytes >= MIB
        && mscclpp::core::algorithm_collection::copy_engine_equal_shares(bytes, n);
    let name = named.unwrap_or(if copy_engine {
        names::ALLREDUCE_COPY_ENGINE
    } else {
        names::ALLREDUCE_RSAG_ZERO_COPY
    });
    coll.get(collective, name)
        .ok_or_else(|| Error::Internal(format!("{name} is not in the collection")))
}
