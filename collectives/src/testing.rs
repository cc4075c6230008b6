//! Correctness checks the GPU suite calls (one process per GPU, every rank calls the same check).
//!
//! Every rank's input is a pure function of (seed, rank, index), a SplitMix64 hash, so a rank
//! encodes only its own input and computes each output element's float64 (or exact integer)
//! reference from the values of just the ranks that element combines: nothing holds every rank's
//! input (as f64 that would be 32 GiB per process at 8 ranks and 1 GiB), and both passes run in
//! parallel chunks over every core. Outputs are poisoned first, every
//! element is compared. Values are small multiples of 1/8, exactly
//! representable in every float type, so sums stay exact in f32/f64 and the tolerance only has to
//! cover f16/bf16 rounding: |got - want| <= 1e-3 + rtol * m, rtol = 2^-10 (f16) or 2^-7
//! (bf16) times the world size, 1e-6 (f32), 1e-12 (f64), where m is the sum of the terms'
//! magnitudes for sum (their mean for avg: the bound of rounded partial sums) and |want| otherwise. Integers must match exactly (wrapping).
//! fp8 values are quarter steps (eighths where a quarter per rank would not fit: e4m3b15 on 8
//! ranks) kept in range for every rank count, decoded with `mscclpp_core::fp8`.

use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::{DevicePtr, Graph, MemoryKind, Stream};
use mscclpp_core::{AccumType, DataType, ReduceOp, Result};
use std::num::NonZeroUsize;
use std::{panic, thread};

/// Outcome of one check.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckReport {
    pub algorithm: String,
    pub dtype: DataType,
    pub op: ReduceOp,
    pub count: usize,
    pub in_place: bool,
    pub wrong: usize,
    /// First mismatches (index, got, want), at most 8.
    pub first_wrong: Vec<(usize, f64, f64)>,
    pub tolerance: String,
}

fn f16_bits(x: f32) -> u16 {
    // Exact for the values generated here (normal, few mantissa bits) and for 0.
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    if x == 0.0 {
        return sign;
    }
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    sign | ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16
}

fn f16_value(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let man = (h & 0x3ff) as f64;
    sign * match exp {
        0 => man * 2f64.powi(-24),
        31 if man == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        e => (1.0 + man / 1024.0) * 2f64.powi(e - 15),
    }
}

/// SplitMix64's increment (2^64 / golden ratio, odd).
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function, a bijective 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The inputs of one check: every rank's value at every index, as a pure function of
/// (seed, rank, index), so any rank can compute any rank's value at any index directly, on any
/// thread, without generating (or storing) the values before it.
#[derive(Debug)]
struct Inputs {
    /// SplitMix64 stream key of each rank (hashed once here, not once per value).
    keys: Vec<u64>,
    nranks: usize,
    dtype: DataType,
    op: ReduceOp,
    /// Values are `step * k` with `k` uniform in `lo..lo + span`; f64, exactly representable in
    /// `dtype`.
    lo: i64,
    span: u64,
    step: f64,
}

impl Inputs {
    fn new(seed: u64, nranks: usize, dtype: DataType, op: ReduceOp) -> Self {
        let (lo, hi, step) = if let Some(f) = mscclpp_core::fp8::format_of(dtype) {
            if op == ReduceOp::Prod {
                // 0.75, 1 or 1.25: products stay near 1.
                (3, 5, 0.25)
            } else {
                // Sums over every rank stay in range (e4m3b15 tops out at 1.875): at most 8
                // quarter steps per rank, fewer as ranks grow, and eighths where not even one
                // quarter fits (e4m3b15 on 8 ranks, whose 8 * 0.25 would saturate).
                let budget = 0.9 * f64::from(f.max_value()) / nranks as f64;
                let mut step = 0.25;
                while step > budget {
                    step /= 2.0;
                }
                let limit = ((budget / step) as i64).min(8);
                (-limit, limit, step)
            }
        } else if dtype.is_float() {
            // k/8 for k in -64..=64; products stay near 1 so they neither vanish nor overflow.
            if op == ReduceOp::Prod {
                (6, 10, 0.125)
            } else {
                (-64, 64, 0.125)
            }
        } else if op == ReduceOp::Prod {
            (1, 3, 1.0)
        } else if matches!(dtype, DataType::U8 | DataType::U32 | DataType::U64) {
            (0, 100, 1.0)
        } else {
            (-50, 50, 1.0)
        };
        // SplitMix64 is counter based: output `index` of the stream keyed by `key` is
        // mix64(key + (index + 1) * GAMMA), so each rank gets its own key.
        let keys = (0..nranks as u64)
            .map(|r| mix64(seed ^ (r + 1).wrapping_mul(GAMMA)))
            .collect();
        Self {
            keys,
            nranks,
            dtype,
            op,
            lo,
            span: (hi - lo + 1) as u64,
            step,
        }
    }

    /// `rank`'s input at `index` (`rank < nranks`).
    fn value(&self, rank: usize, index: usize) -> f64 {
        let h = mix64(self.keys[rank].wrapping_add((index as u64 + 1).wrapping_mul(GAMMA)));
        // Multiply-shift maps the top 32 bits onto 0..span without a division (bias span / 2^32,
        // negligible).
        let k = self.lo + (((h >> 32) * self.span) >> 32) as i64;
        k as f64 * self.step
    }
}

/// Elements per chunk so that `count` elements make one chunk per available core.
fn chunk_elems(count: usize) -> usize {
    let threads = thread::available_parallelism().map_or(1, NonZeroUsize::get);
    count.div_ceil(threads).max(1)
}

/// Runs `f(chunk_index, chunk)` for every chunk on its own scoped thread and returns the results
/// in chunk order; a chunk that panics panics the caller with its payload.
fn in_parallel<C: Send, R: Send>(
    chunks: impl Iterator<Item = C>,
    f: impl Fn(usize, C) -> R + Sync,
) -> Vec<R> {
    thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = chunks
            .enumerate()
            .map(|(c, chunk)| s.spawn(move || f(c, chunk)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| panic::resume_unwind(e)))
            .collect()
    })
}

/// `value(i)` for every `i < count`, encoded as `dtype`, in parallel chunks.
fn encode_all(count: usize, dtype: DataType, value: impl Fn(usize) -> f64 + Sync) -> Vec<u8> {
    let es = dtype.size();
    let per = chunk_elems(count);
    let mut bytes = vec![0u8; count * es];
    in_parallel(bytes.chunks_mut(per * es), |c, chunk| {
        for (j, out) in chunk.chunks_exact_mut(es).enumerate() {
            encode(value(c * per + j), dtype, out);
        }
    });
    bytes
}

/// Writes `v` as one `dtype` element into `out` (exactly `dtype.size()` bytes).
fn encode(v: f64, dtype: DataType, out: &mut [u8]) {
    match dtype {
        DataType::F32 => out.copy_from_slice(&(v as f32).to_le_bytes()),
        DataType::F64 => out.copy_from_slice(&v.to_le_bytes()),
        DataType::F16 => out.copy_from_slice(&f16_bits(v as f32).to_le_bytes()),
        DataType::Bf16 => out.copy_from_slice(&(((v as f32).to_bits() >> 16) as u16).to_le_bytes()),
        DataType::I8 => out[0] = v as i8 as u8,
        DataType::U8 => out[0] = v as u8,
        DataType::I32 => out.copy_from_slice(&(v as i32).to_le_bytes()),
        DataType::U32 => out.copy_from_slice(&(v as u32).to_le_bytes()),
        DataType::I64 => out.copy_from_slice(&(v as i64).to_le_bytes()),
        DataType::U64 => out.copy_from_slice(&(v as u64).to_le_bytes()),
        DataType::Fp8E4M3 | DataType::Fp8E4M3Fnuz | DataType::Fp8E5M2 | DataType::Fp8E4M3B15 => {
            let f = mscclpp_core::fp8::format_of(dtype).unwrap_or(mscclpp_core::fp8::E4M3);
            out[0] = f.encode(v as f32)
        }
    }
}

/// Decodes element `i` of `bytes`: floats as f64; integers as their i128 value (as f64 only for
/// reporting; the comparison of integers is exact on the i128).
fn decode(bytes: &[u8], i: usize, dtype: DataType) -> (f64, i128) {
    let s = dtype.size();
    let b = &bytes[i * s..(i + 1) * s];
    let mut w = [0u8; 8];
    w[..s].copy_from_slice(b);
    let raw = u64::from_le_bytes(w);
    if let Some(f) = mscclpp_core::fp8::format_of(dtype) {
        return (f.decode(raw as u8) as f64, 0);
    }
    match dtype {
        DataType::F32 => (f32::from_bits(raw as u32) as f64, 0),
        DataType::F64 => (f64::from_bits(raw), 0),
        DataType::F16 => (f16_value(raw as u16), 0),
        DataType::Bf16 => (f32::from_bits((raw as u32) << 16) as f64, 0),
        DataType::I8 => (raw as u8 as i8 as f64, raw as u8 as i8 as i128),
        DataType::U8 => (raw as u8 as f64, raw as u8 as i128),
        DataType::I32 => (raw as u32 as i32 as f64, raw as u32 as i32 as i128),
        DataType::U32 => (raw as u32 as f64, raw as u32 as i128),
        DataType::I64 => (raw as i64 as f64, raw as i64 as i128),
        _ => (raw as f64, raw as i128),
    }
}

/// Wraps an exact integer result to `dtype`'s width, as the device's fixed-width arithmetic does.
fn wrap(v: i128, dtype: DataType) -> i128 {
    match dtype {
        DataType::I8 => v as i8 as i128,
        DataType::U8 => v as u8 as i128,
        DataType::I32 => v as i32 as i128,
        DataType::U32 => v as u32 as i128,
        DataType::I64 => v as i64 as i128,
        _ => v as u64 as i128,
    }
}

/// Relative tolerance: one rounding of `dtype` per combining step (rank), exact-ish for f32/f64.
fn rtol(dtype: DataType, nranks: usize) -> f64 {
    let steps = nranks as f64;
    match mscclpp_core::fp8::format_of(dtype) {
        Some(f) => steps * 2f64.powi(-(f.man_bits as i32)),
        None => match dtype {
            DataType::F16 => steps / 1024.0,
            DataType::Bf16 => steps / 128.0,
            DataType::F32 => 1e-6,
            _ => 1e-12,
        },
    }
}

/// Whether `got` is within tolerance of `want`, the exact reduction by `op` of `terms` (one value
/// per rank; empty for copies): |got - want| <= 1e-3 + rtol * m. For sum and avg m is the terms'
/// magnitude (their sum, or mean), not the result's: rounded partial sums err in proportion to
/// what they added up, so a sum that cancels to 0 may come back as one low-order step of its
/// partial sums (seen with fp8 on 4 ranks). Otherwise m = |want|.
fn float_close(got: f64, want: f64, terms: &[f64], op: ReduceOp, rtol: f64) -> bool {
    let magnitude = terms.iter().map(|v| v.abs()).sum::<f64>();
    let m = match op {
        ReduceOp::Sum if !terms.is_empty() => magnitude,
        ReduceOp::Avg if !terms.is_empty() => magnitude / terms.len() as f64,
        _ => want.abs(),
    };
    (got - want).abs() <= 1e-3 + rtol * m
}

/// The expected value of one output element: the reduction of `vals` (one per rank).
enum Want {
    Float(f64),
    Int(i128),
}

fn reduce(vals: &[f64], dtype: DataType, op: ReduceOp, n: usize) -> Want {
    if dtype.is_float() {
        let it = vals.iter().copied();
        Want::Float(match op {
            ReduceOp::Sum => it.sum::<f64>(),
            ReduceOp::Avg => it.sum::<f64>() / n as f64,
            ReduceOp::Prod => it.product::<f64>(),
            ReduceOp::Min => it.fold(f64::INFINITY, f64::min),
            ReduceOp::Max => it.fold(f64::NEG_INFINITY, f64::max),
        })
    } else {
        let it = vals.iter().map(|v| *v as i128);
        let sum = |it: &mut dyn Iterator<Item = i128>| it.fold(0, |a, b| wrap(a + b, dtype));
        Want::Int(match op {
            ReduceOp::Sum => sum(&mut it.clone()),
            // Integer average: the wrapped sum divided, truncating, as the kernel does.
            ReduceOp::Avg => wrap(sum(&mut it.clone()) / n as i128, dtype),
            ReduceOp::Prod => it.fold(1, |a, b| wrap(a * b, dtype)),
            ReduceOp::Min => it.min().unwrap_or(0),
            ReduceOp::Max => it.max().unwrap_or(0),
        })
    }
}

/// Compares every element of this rank's output `got` with the reference computed from `inputs`
/// and returns the number of mismatches and the first (lowest-index) 8 of them. Chunks are checked
/// in parallel, each keeping its own first 8, so the overall first 8 lead the chunks' lists
/// concatenated in chunk order.
fn check_output(
    got: &[u8],
    inputs: &Inputs,
    collective: Collective,
    rank: usize,
    count: usize,
    root: usize,
) -> (usize, Vec<(usize, f64, f64)>) {
    const SHOWN: usize = 8;
    let Inputs {
        dtype, op, nranks, ..
    } = *inputs;
    let es = dtype.size();
    let tol = rtol(dtype, nranks);
    let per = chunk_elems(got.len() / es);
    let chunks = in_parallel(got.chunks(per * es), |c, chunk| {
        let mut wrong = 0;
        let mut first = Vec::new();
        let mut vals = vec![0.0; nranks];
        for j in 0..chunk.len() / es {
            let i = c * per + j;
            // `terms`: whether the element combines one value per rank (in `vals`).
            let (want, terms) = match collective {
                // A reduce's output is checked on its root only (see `run_collective_check`).
                Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce => {
                    // A reduce-scatter's output is this rank's slice of the reduction.
                    let at = match collective {
                        Collective::ReduceScatter => rank * count + i,
                        _ => i,
                    };
                    for (r, v) in vals.iter_mut().enumerate() {
                        *v = inputs.value(r, at);
                    }
                    (reduce(&vals, dtype, op, nranks), true)
                }
                Collective::AllGather => (exact(inputs.value(i / count, i % count), dtype), false),
                // Chunk s of the output is chunk `rank` of rank s's input (count / nranks each).
                Collective::AllToAll => {
                    let chunk = (count / nranks).max(1);
                    let (s, j) = (i / chunk, i % chunk);
                    (exact(inputs.value(s, rank * chunk + j), dtype), false)
                }
                _ => (exact(inputs.value(root, i), dtype), false),
            };
            let (g, gi) = decode(chunk, j, dtype);
            let (ok, want) = match want {
                Want::Float(w) => {
                    let terms: &[f64] = if terms { &vals } else { &[] };
                    (float_close(g, w, terms, op, tol), w)
                }
                Want::Int(w) => (gi == w, w as f64),
            };
            if !ok {
                wrong += 1;
                if first.len() < SHOWN {
                    first.push((i, g, want));
                }
            }
        }
        (wrong, first)
    });
    let wrong = chunks.iter().map(|(w, _)| w).sum();
    let first = chunks
        .into_iter()
        .flat_map(|(_, f)| f)
        .take(SHOWN)
        .collect();
    (wrong, first)
}

/// Runs `algo` once and checks every output element against the host reference. `count` is the
/// per-rank element count of the collective's natural unit: the all-reduce/broadcast buffer, the
/// all-gather input, the reduce-scatter output. In place follows NCCL: the all-gather input and the
/// reduce-scatter output are this rank's slice of the other buffer. Rooted collectives use `root`
/// (`None`: `seed % nranks`); a reduce's output is the reduction on the root, elsewhere it must be
/// untouched: the poison out of place, the rank's own input in place. With `graph`, the call is
/// captured once into a CUDA graph and the graph is replayed twice, each replay on fresh data and
/// a freshly poisoned output, and both replays are checked (so device-side flags and counters must
/// stay right across replays). Collective: every rank calls it with the same arguments.
/// Synchronises the device (it is a test).
#[allow(clippy::too_many_arguments)]
pub fn run_collective_check(
    comm: &Communicator,
    algo: &dyn Algorithm,
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    in_place: bool,
    seed: u64,
    graph: bool,
    root: Option<usize>,
) -> Result<CheckReport> {
    let gpu = comm.gpu();
    let (rank, n) = (comm.rank(), comm.size());
    let shape = Shape::of(algo.collective(), dtype, op, count, n, root, seed);
    let es = dtype.size();
    // One allocation holds the larger buffer; in place, the other is a slice of it.
    let big = shape.in_count.max(shape.out_count) * es;
    let first = gpu.alloc(big.max(16), MemoryKind::Plain)?;
    let second = if in_place {
        None
    } else {
        Some(gpu.alloc((shape.out_count * es).max(16), MemoryKind::Plain)?)
    };
    let (input, output) = match &second {
        Some(out) => (first.ptr, out.ptr),
        None => shape.in_place_buffers(first.ptr, rank),
    };
    let mut poison = vec![(first.ptr, big.max(16))];
    if let Some(out) = &second {
        poison.push((out.ptr, (shape.out_count * es).max(16)));
    }
    let buffers = CallBuffers {
        input,
        output,
        poison,
    };
    let stream = gpu.create_stream()?;
    let mut captured = None;
    let mut result = check_once(
        comm,
        algo,
        &shape,
        &buffers,
        seed,
        stream,
        graph.then_some(&mut captured),
    );
    if graph {
        // A second replay on new data: flags and counters advanced by the first must still work.
        if let Ok(first_report) = &result {
            if first_report.wrong == 0 {
                let again = seed.wrapping_add(0x5eed);
                result = check_once(
                    comm,
                    algo,
                    &shape,
                    &buffers,
                    again,
                    stream,
                    Some(&mut captured),
                );
            }
        }
    }
    if let Some(g) = captured {
        let _ = gpu.destroy_graph(g);
    }
    let _ = gpu.destroy_stream(stream);
    if let Some(o) = &second {
        let _ = gpu.free(o);
    }
    let _ = gpu.free(&first);
    result
}

/// As [`run_collective_check`], eager, on buffers the caller placed: `input` and `output` (equal,
/// or the slices NCCL defines, in place), which must hold the collective's counts. Every rank may
/// place its buffers differently (the point: a caching allocator's addresses differ per rank).
/// Only the input and the output are poisoned. Collective.
#[allow(clippy::too_many_arguments)]
pub fn check_collective_at(
    comm: &Communicator,
    algo: &dyn Algorithm,
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    seed: u64,
    root: Option<usize>,
    (input, output): (DevicePtr, DevicePtr),
    stream: Stream,
) -> Result<CheckReport> {
    let shape = Shape::of(algo.collective(), dtype, op, count, comm.size(), root, seed);
    let es = dtype.size();
    let buffers = CallBuffers {
        input,
        output,
        poison: vec![(input, shape.in_count * es), (output, shape.out_count * es)],
    };
    check_once(comm, algo, &shape, &buffers, seed, stream, None)
}

/// What one check moves: the collective and its element counts per rank.
struct Shape {
    collective: Collective,
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    in_count: usize,
    out_count: usize,
    root: usize,
}

impl Shape {
    fn of(
        collective: Collective,
        dtype: DataType,
        op: ReduceOp,
        count: usize,
        n: usize,
        root: Option<usize>,
        seed: u64,
    ) -> Shape {
        let (in_count, out_count) = match collective {
            Collective::AllGather => (count, count * n),
            Collective::ReduceScatter => (count * n, count),
            _ => (count, count),
        };
        Shape {
            collective,
            dtype,
            op,
            count,
            in_count,
            out_count,
            root: root.unwrap_or((seed % n as u64) as usize),
        }
    }

    /// In place, the (input, output) of `rank` in the one buffer at `base`, as NCCL defines them.
    fn in_place_buffers(&self, base: DevicePtr, rank: usize) -> (DevicePtr, DevicePtr) {
        let slice = (rank * self.count * self.dtype.size()) as u64;
        match self.collective {
            Collective::AllGather => (base + slice, base),
            Collective::ReduceScatter => (base, base + slice),
            _ => (base, base),
        }
    }
}

/// Where one check's call reads and writes, and what to poison before it.
struct CallBuffers {
    input: DevicePtr,
    output: DevicePtr,
    poison: Vec<(DevicePtr, usize)>,
}

/// One call of `algo` (captured into `captured` on its first use and replayed, where given) on
/// fresh data of `seed`, then every output element checked.
fn check_once(
    comm: &Communicator,
    algo: &dyn Algorithm,
    shape: &Shape,
    buffers: &CallBuffers,
    seed: u64,
    stream: Stream,
    captured: Option<&mut Option<Graph>>,
) -> Result<CheckReport> {
    let gpu = comm.gpu();
    let (rank, n) = (comm.rank(), comm.size());
    let (dtype, op, es) = (shape.dtype, shape.op, shape.dtype.size());
    let in_place = buffers.input == buffers.output
        || buffers.input + (shape.in_count * es) as u64 > buffers.output
            && buffers.output + (shape.out_count * es) as u64 > buffers.input;
    let inputs = Inputs::new(seed, n, dtype, op);
    for &(ptr, bytes) in &buffers.poison {
        gpu.memset_async(ptr, 0xA5, bytes, stream)?;
    }
    gpu.synchronize_stream(stream)?;
    gpu.copy_to_device(
        buffers.input,
        &encode_all(shape.in_count, dtype, |i| inputs.value(rank, i)),
    )?;
    let args = ExecuteArgs {
        input: buffers.input,
        output: buffers.output,
        input_bytes: shape.in_count * es,
        output_bytes: shape.out_count * es,
        dtype,
        op,
        accum: AccumType::Auto,
        root: shape.root,
        stream,
        nblocks: None,
        nthreads: None,
    };
    match captured {
        Some(captured) => {
            if captured.is_none() {
                gpu.begin_capture(stream)?;
                let executed = algo.execute(&args);
                let ended = gpu.end_capture(stream);
                executed?;
                *captured = Some(ended?);
            }
            if let Some(g) = *captured {
                gpu.launch_graph(g, stream)?;
            }
        }
        None => algo.execute(&args)?,
    }
    gpu.synchronize_stream(stream)?;
    comm.check_device_errors()?;
    let mut got = vec![0u8; shape.out_count * es];
    gpu.copy_from_device(&mut got, buffers.output)?;
    let (wrong, first_wrong) = if shape.collective == Collective::Reduce && rank != shape.root {
        untouched(&got, in_place.then_some(&inputs), rank, dtype)
    } else {
        check_output(
            &got,
            &inputs,
            shape.collective,
            rank,
            shape.count,
            shape.root,
        )
    };
    let tol = rtol(dtype, n);
    Ok(CheckReport {
        algorithm: algo.name().to_string(),
        dtype,
        op,
        count: shape.count,
        in_place,
        wrong,
        first_wrong,
        tolerance: if dtype.is_float() {
            format!("1e-3 + {tol:e} * (sum/avg: sum|x|, else |want|)")
        } else {
            "exact".into()
        },
    })
}

/// The mismatches of an output the call must not have written: the poison byte everywhere, or
/// with `own` (in place) this rank's own input. Same report as [`check_output`].
fn untouched(
    got: &[u8],
    own: Option<&Inputs>,
    rank: usize,
    dtype: DataType,
) -> (usize, Vec<(usize, f64, f64)>) {
    let es = dtype.size();
    let mut want = vec![0xA5u8; got.len()];
    if let Some(inputs) = own {
        want = encode_all(got.len() / es, dtype, |i| inputs.value(rank, i));
    }
    let mut wrong = 0;
    let mut first = Vec::new();
    for (i, (g, w)) in got.chunks(es).zip(want.chunks(es)).enumerate() {
        if g != w {
            wrong += 1;
            if first.len() < 8 {
                first.push((i, decode(got, i, dtype).0, decode(&want, i, dtype).0));
            }
        }
    }
    (wrong, first)
}

/// A value that must arrive unchanged (gathers and broadcasts copy, they do not combine).
fn exact(v: f64, dtype: DataType) -> Want {
    if dtype.is_float() {
        Want::Float(v)
    } else {
        Want::Int(v as i128)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cancelling_sums_are_judged_by_their_terms() {
        // e5m2 on 4 ranks: 1.75 + 2 rounds to 4, so the sum that cancels comes back as 0.25.
        let terms = [1.75, 2.0, -2.0, -1.75];
        let tol = rtol(DataType::Fp8E5M2, 4);
        assert!(float_close(0.25, 0.0, &terms, ReduceOp::Sum, tol));
        assert!(float_close(0.0625, 0.0, &terms, ReduceOp::Avg, tol));
        // Copies and min/max stay judged by the result itself.
        assert!(!float_close(0.25, 0.0, &[], ReduceOp::Sum, tol));
        assert!(!float_close(0.25, 0.0, &terms, ReduceOp::Max, tol));
        // bf16: a wrong sum is still caught.
        let tol = rtol(DataType::Bf16, 2);
        assert!(!float_close(1.5, 1.0, &[0.5, 0.5], ReduceOp::Sum, tol));
    }

    #[test]
    fn an_alltoall_output_is_every_ranks_chunk_for_us() {
        let (n, rank, count, dtype) = (3, 1, 12, DataType::I32);
        let inputs = Inputs::new(11, n, dtype, ReduceOp::Sum);
        let chunk = count / n;
        let mut got = encode_all(count, dtype, |i| {
            inputs.value(i / chunk, rank * chunk + i % chunk)
        });
        let check = |got: &[u8]| check_output(got, &inputs, Collective::AllToAll, rank, count, 0);
        assert_eq!(check(&got).0, 0);
        // Our own input's chunks in place of the peers' are caught, every element but our own.
        let own = encode_all(count, dtype, |i| inputs.value(rank, i));
        assert_eq!(check(&own).0, count - chunk);
        got[0] ^= 1;
        assert_eq!(check(&got).0, 1);
    }

    /// Every rank count the suite runs on.
    const RANKS: std::ops::RangeInclusive<usize> = 1..=8;

    /// The distinct values `inputs` gives `rank` over its first `len` indices, in order.
    fn distinct_values(inputs: &Inputs, rank: usize, len: usize) -> Vec<f64> {
        let mut v: Vec<f64> = (0..len).map(|i| inputs.value(rank, i)).collect();
        v.sort_by(f64::total_cmp);
        v.dedup();
        v
    }

    #[test]
    fn values_are_exact_in_their_type() {
        for nranks in RANKS {
            for dtype in DataType::ALL {
                for op in ReduceOp::ALL {
                    let (inputs, rank) = (Inputs::new(7, nranks, dtype, op), nranks - 1);
                    let bytes = encode_all(1000, dtype, |i| inputs.value(rank, i));
                    for i in 0..1000 {
                        let want = inputs.value(rank, i);
                        let ctx = format!("{dtype} {op} {nranks} ranks #{i}");
                        assert_eq!(decode(&bytes, i, dtype).0, want, "{ctx}");
                        if !dtype.is_float() {
                            assert_eq!(decode(&bytes, i, dtype).1, want as i128, "{ctx}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn values_cover_each_types_range_and_nothing_else() {
        let quarters = |lo: i32, hi: i32| (lo..=hi).map(|k| k as f64 / 4.0).collect::<Vec<_>>();
        let eighths = |lo: i32, hi: i32| (lo..=hi).map(|k| k as f64 / 8.0).collect::<Vec<_>>();
        let ints = |lo: i32, hi: i32| (lo..=hi).map(f64::from).collect::<Vec<_>>();
        let cases = [
            (DataType::F32, ReduceOp::Sum, 8, eighths(-64, 64)),
            (DataType::Bf16, ReduceOp::Min, 2, eighths(-64, 64)),
            (DataType::F16, ReduceOp::Prod, 4, eighths(6, 10)),
            (DataType::I32, ReduceOp::Sum, 8, ints(-50, 50)),
            (DataType::I8, ReduceOp::Max, 2, ints(-50, 50)),
            (DataType::U8, ReduceOp::Avg, 8, ints(0, 100)),
            (DataType::U64, ReduceOp::Prod, 8, ints(1, 3)),
            (DataType::Fp8E4M3, ReduceOp::Prod, 8, quarters(3, 5)),
            (DataType::Fp8E4M3, ReduceOp::Sum, 8, quarters(-8, 8)),
            (DataType::Fp8E5M2, ReduceOp::Sum, 1, quarters(-8, 8)),
            (DataType::Fp8E4M3B15, ReduceOp::Sum, 1, quarters(-6, 6)),
            (DataType::Fp8E4M3B15, ReduceOp::Sum, 4, quarters(-1, 1)),
            (DataType::Fp8E4M3B15, ReduceOp::Sum, 8, eighths(-1, 1)),
        ];
        for (dtype, op, nranks, want) in cases {
            let inputs = Inputs::new(3, nranks, dtype, op);
            for rank in [0, nranks - 1] {
                let got = distinct_values(&inputs, rank, 20_000);
                assert_eq!(got, want, "{dtype} {op} {nranks} ranks, rank {rank}");
            }
        }
    }

    #[test]
    fn fp8_sums_over_every_rank_stay_in_range() {
        for dtype in DataType::ALL.into_iter().filter(|t| t.is_fp8()) {
            let max = f64::from(mscclpp_core::fp8::format_of(dtype).unwrap().max_value());
            for nranks in RANKS {
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    let inputs = Inputs::new(11, nranks, dtype, op);
                    // The largest magnitude any rank contributes, times every rank.
                    let largest = (0..nranks)
                        .flat_map(|r| distinct_values(&inputs, r, 2000))
                        .map(f64::abs)
                        .fold(0.0, f64::max);
                    let ctx = format!("{dtype} {op} {nranks} ranks");
                    assert!(largest > 0.0, "{ctx}");
                    assert!(nranks as f64 * largest <= max, "{ctx}: {largest} per rank");
                }
            }
        }
    }

    #[test]
    fn values_are_deterministic_and_differ_between_ranks_indices_and_seeds() {
        let inputs = Inputs::new(1, 2, DataType::F32, ReduceOp::Sum);
        let row =
            |inputs: &Inputs, rank| (0..64).map(|i| inputs.value(rank, i)).collect::<Vec<_>>();
        let a = row(&inputs, 0);
        assert_eq!(a, row(&Inputs::new(1, 2, DataType::F32, ReduceOp::Sum), 0));
        assert_ne!(a, row(&inputs, 1));
        assert_ne!(a, row(&Inputs::new(2, 2, DataType::F32, ReduceOp::Sum), 0));
        // Indices are not one repeated value (129 possible values, 64 draws).
        assert!(distinct_values(&inputs, 0, 64).len() > 32);
        // Indices past 2^32 still vary and stay in range.
        let far: Vec<f64> = (1 << 40..(1 << 40) + 64)
            .map(|i| inputs.value(0, i))
            .collect();
        assert_ne!(a, far);
        assert!(far.iter().all(|v| v.abs() <= 8.0));
    }

    #[test]
    fn correct_outputs_pass_and_the_first_mismatches_come_in_index_order() {
        let (nranks, count, rank) = (4, 3000, 1);
        let root = 2;
        let (dtype, op) = (DataType::Bf16, ReduceOp::Sum);
        let inputs = Inputs::new(5, nranks, dtype, op);
        let sum = |at: usize| (0..nranks).map(|r| inputs.value(r, at)).sum::<f64>();
        let outputs = [
            (Collective::AllReduce, encode_all(count, dtype, sum)),
            (
                Collective::ReduceScatter,
                encode_all(count, dtype, |i| sum(rank * count + i)),
            ),
            (
                Collective::AllGather,
                encode_all(nranks * count, dtype, |i| {
                    inputs.value(i / count, i % count)
                }),
            ),
            (
                Collective::Broadcast,
                encode_all(count, dtype, |i| inputs.value(root, i)),
            ),
        ];
        for (collective, got) in outputs {
            let report = check_output(&got, &inputs, collective, rank, count, root);
            assert_eq!(report, (0, vec![]), "{collective:?}");
        }
        // Mismatches (far beyond any sum of 4 ranks) spread over every chunk, made in reverse: the
        // report lists the lowest 8.
        let mut got = encode_all(count, dtype, sum);
        let wrong: Vec<usize> = (0..count).step_by(97).collect();
        for &i in wrong.iter().rev() {
            encode(1000.0, dtype, &mut got[2 * i..2 * i + 2]);
        }
        let (n_wrong, first) =
            check_output(&got, &inputs, Collective::AllReduce, rank, count, root);
        assert_eq!(n_wrong, wrong.len());
        let first: Vec<usize> = first.iter().map(|(i, _, _)| *i).collect();
        assert_eq!(first, wrong[..8]);
    }

    #[test]
    fn untouched_outputs_keep_the_poison_or_the_input() {
        let dtype = DataType::I32;
        let inputs = Inputs::new(3, 4, dtype, ReduceOp::Sum);
        let poison = vec![0xA5u8; 40];
        assert_eq!(untouched(&poison, None, 1, dtype).0, 0);
        let own = encode_all(10, dtype, |i| inputs.value(1, i));
        assert_eq!(untouched(&own, Some(&inputs), 1, dtype).0, 0);
        let (wrong, first) = untouched(&own, None, 1, dtype);
        assert!(wrong > 0 && first[0].0 == 0, "{wrong} {first:?}");
        let mut hit = poison.clone();
        hit[13] = 0;
        let (wrong, first) = untouched(&hit, None, 1, dtype);
        assert_eq!((wrong, first[0].0), (1, 3));
    }

    #[test]
    fn integer_outputs_must_match_exactly() {
        let inputs = Inputs::new(9, 3, DataType::I32, ReduceOp::Sum);
        let sum = |i: usize| (0..3).map(|r| inputs.value(r, i)).sum::<f64>();
        let mut got = encode_all(100, DataType::I32, sum);
        assert_eq!(
            check_output(&got, &inputs, Collective::AllReduce, 0, 100, 0).0,
            0
        );
        let off_by_one = sum(42) + 1.0;
        encode(off_by_one, DataType::I32, &mut got[4 * 42..4 * 43]);
        let (wrong, first) = check_output(&got, &inputs, Collective::AllReduce, 0, 100, 0);
        assert_eq!((wrong, first), (1, vec![(42, off_by_one, sum(42))]));
    }

    /// What one rank's check costs on the host for a 1 GiB bf16 all-reduce over 8 ranks: encoding
    /// its input and verifying its output. Run with
    /// `cargo test --release -p mscclpp-collectives --lib -- --ignored --nocapture one_gib`.
    #[test]
    #[ignore = "timing, 2 GiB of memory; run in release"]
    fn one_gib_bf16_allreduce_check_on_the_host() {
        let (nranks, count, dtype, op) = (8, (1 << 30) / 2, DataType::Bf16, ReduceOp::Sum);
        let inputs = Inputs::new(1, nranks, dtype, op);
        // What a correct device returns (not timed).
        let got = encode_all(count, dtype, |i| {
            (0..nranks).map(|r| inputs.value(r, i)).sum()
        });
        let start = std::time::Instant::now();
        let own = encode_all(count, dtype, |i| inputs.value(0, i));
        let generated = start.elapsed();
        let report = check_output(&got, &inputs, Collective::AllReduce, 0, count, 0);
        let verified = start.elapsed() - generated;
        let threads = thread::available_parallelism().map_or(1, NonZeroUsize::get);
        eprintln!(
            "{threads} threads: input {generated:?}, verification {verified:?}, total {:?}",
            generated + verified
        );
        assert_eq!(own.len(), count * dtype.size());
        assert_eq!(report, (0, vec![]));
    }

    #[test]
    fn integer_wrapping_matches_fixed_width() {
        assert_eq!(wrap(200, DataType::I8), -56);
        assert_eq!(wrap(-1, DataType::U32), u32::MAX as i128);
    }
}
