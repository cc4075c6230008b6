//! Correctness checks the GPU suite calls (one process per GPU, every rank calls the same check).
//!
//! Each rank fills its input from a generator seeded by (seed, rank), so every rank can rebuild all
//! ranks' inputs on the host and compute the float64 (or exact integer) reference itself. Outputs
//! are poisoned first, every element is compared. Values are small multiples of 1/8, exactly
//! representable in every float type, so sums stay exact in f32/f64 and the tolerance only has to
//! cover f16/bf16 rounding: |got - want| <= 1e-3 + rtol * m, rtol = 2^-10 (f16) or 2^-7
//! (bf16) times the world size, 1e-6 (f32), 1e-12 (f64), where m is the sum of the terms'
//! magnitudes for sum (their mean for avg: the bound of rounded partial sums) and |want| otherwise. Integers must match exactly (wrapping).
//! fp8 values are quarter steps kept in range for every rank count, decoded with `mscclpp_core::fp8`.

use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::MemoryKind;
use mscclpp_core::{AccumType, DataType, ReduceOp, Result};
use rand::{Rng, SeedableRng};

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

/// `rank`'s generated input, as f64 values exactly representable in `dtype`.
fn gen_values(
    seed: u64,
    rank: usize,
    count: usize,
    nranks: usize,
    dtype: DataType,
    op: ReduceOp,
) -> Vec<f64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(
        seed ^ (rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
    );
    // fp8: quarter steps small enough that sums over every rank stay in range (e4m3b15 tops out at
    // 1.875); products stay near 1.
    let fp8_limit = mscclpp_core::fp8::format_of(dtype).map(|f| {
        let max = f.max_value() as f64;
        ((0.9 * max / (nranks as f64 * 0.25)) as i32).clamp(1, 8)
    });
    (0..count)
        .map(|_| {
            if let Some(limit) = fp8_limit {
                if op == ReduceOp::Prod {
                    [0.75, 1.0, 1.25][rng.random_range(0..3usize)]
                } else {
                    rng.random_range(-limit..=limit) as f64 * 0.25
                }
            } else if dtype.is_float() {
                // Products stay near 1 so they neither vanish nor overflow.
                let k: i32 = if op == ReduceOp::Prod {
                    rng.random_range(6..=10)
                } else {
                    rng.random_range(-64..=64)
                };
                k as f64 / 8.0
            } else if op == ReduceOp::Prod {
                rng.random_range(1..=3) as f64
            } else if matches!(dtype, DataType::U8 | DataType::U32 | DataType::U64) {
                rng.random_range(0..=100) as f64
            } else {
                rng.random_range(-50..=50) as f64
            }
        })
        .collect()
}

fn encode(values: &[f64], dtype: DataType) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &v in values {
        match dtype {
            DataType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DataType::F64 => out.extend_from_slice(&v.to_le_bytes()),
            DataType::F16 => out.extend_from_slice(&f16_bits(v as f32).to_le_bytes()),
            DataType::Bf16 => {
                out.extend_from_slice(&(((v as f32).to_bits() >> 16) as u16).to_le_bytes())
            }
            DataType::I8 => out.push(v as i8 as u8),
            DataType::U8 => out.push(v as u8),
            DataType::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
            DataType::U32 => out.extend_from_slice(&(v as u32).to_le_bytes()),
            DataType::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
            DataType::U64 => out.extend_from_slice(&(v as u64).to_le_bytes()),
            DataType::Fp8E4M3
            | DataType::Fp8E4M3Fnuz
            | DataType::Fp8E5M2
            | DataType::Fp8E4M3B15 => {
                let f = mscclpp_core::fp8::format_of(dtype).unwrap_or(mscclpp_core::fp8::E4M3);
                out.push(f.encode(v as f32))
            }
        }
    }
    out
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

/// Runs `algo` once as an all-reduce of `count` elements and checks every element.
pub fn run_allreduce_check(
    comm: &Communicator,
    algo: &dyn Algorithm,
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    in_place: bool,
    seed: u64,
) -> Result<CheckReport> {
    run_collective_check(comm, algo, dtype, op, count, in_place, seed)
}

/// Runs `algo` once and checks every output element against the host reference. `count` is the
/// per-rank element count of the collective's natural unit: the all-reduce/broadcast buffer, the
/// all-gather input, the reduce-scatter output. In place follows NCCL: the all-gather input and the
/// reduce-scatter output are this rank's slice of the other buffer. Broadcasts use root
/// `seed % nranks`. Collective: every rank calls it with the same arguments. Synchronises the device
/// (it is a test).
pub fn run_collective_check(
    comm: &Communicator,
    algo: &dyn Algorithm,
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    in_place: bool,
    seed: u64,
) -> Result<CheckReport> {
    run_collective_check_mode(comm, algo, dtype, op, count, in_place, seed, false)
}

/// As [`run_collective_check`]; with `graph`, the call is captured once into a CUDA graph and the
/// graph is replayed twice, each replay on fresh data and a freshly poisoned output, and both
/// replays are checked (so device-side flags and counters must stay right across replays).
#[allow(clippy::too_many_arguments)]
pub fn run_collective_check_mode(
    comm: &Communicator,
    algo: &dyn Algorithm,
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    in_place: bool,
    seed: u64,
    graph: bool,
) -> Result<CheckReport> {
    let gpu = comm.gpu();
    let (rank, n) = (comm.rank(), comm.size());
    let collective = algo.collective();
    let es = dtype.size();
    let root = (seed % n as u64) as usize;
    let (in_count, out_count) = match collective {
        Collective::AllGather => (count, count * n),
        Collective::ReduceScatter => (count * n, count),
        _ => (count, count),
    };
    // One allocation holds the larger buffer; in place, the other is a slice of it.
    let big = in_count.max(out_count) * es;
    let first = gpu.alloc(big.max(16), MemoryKind::Plain)?;
    let second = if in_place {
        None
    } else {
        Some(gpu.alloc((out_count * es).max(16), MemoryKind::Plain)?)
    };
    let slice = (rank * count * es) as u64;
    let (in_ptr, out_ptr) = match (&second, collective) {
        (Some(out), _) => (first.ptr, out.ptr),
        (None, Collective::AllGather) => (first.ptr + slice, first.ptr),
        (None, Collective::ReduceScatter) => (first.ptr, first.ptr + slice),
        (None, _) => (first.ptr, first.ptr),
    };
    let stream = gpu.create_stream()?;
    let mut captured = None;
    let mut run_once = |seed: u64| -> Result<CheckReport> {
        let all: Vec<Vec<f64>> = (0..n)
            .map(|r| gen_values(seed, r, in_count, n, dtype, op))
            .collect();
        gpu.memset_async(first.ptr, 0xA5, big.max(16), stream)?; // poison
        if let Some(out) = &second {
            gpu.memset_async(out.ptr, 0xA5, (out_count * es).max(16), stream)?;
        }
        gpu.synchronize_stream(stream)?;
        gpu.copy_to_device(in_ptr, &encode(&all[rank], dtype))?;
        let args = ExecuteArgs {
            input: in_ptr,
            output: out_ptr,
            input_bytes: in_count * es,
            output_bytes: out_count * es,
            dtype,
            op,
            accum: AccumType::Auto,
            root,
            stream,
            nblocks: None,
            nthreads: None,
        };
        if graph {
            if captured.is_none() {
                gpu.begin_capture(stream)?;
                let executed = algo.execute(&args);
                let ended = gpu.end_capture(stream);
                executed?;
                captured = Some(ended?);
            }
            if let Some(g) = captured {
                gpu.launch_graph(g, stream)?;
            }
        } else {
            algo.execute(&args)?;
        }
        gpu.synchronize_stream(stream)?;
        comm.check_device_errors()?;
        let mut got = vec![0u8; out_count * es];
        gpu.copy_from_device(&mut got, out_ptr)?;
        let tol = rtol(dtype, n);
        let mut report = CheckReport {
            algorithm: algo.name().to_string(),
            dtype,
            op,
            count,
            in_place,
            wrong: 0,
            first_wrong: Vec::new(),
            tolerance: if dtype.is_float() {
                format!("1e-3 + {tol:e} * (sum/avg: sum|x|, else |want|)")
            } else {
                "exact".into()
            },
        };
        let mut vals = vec![0.0; n];
        for i in 0..out_count {
            // `terms`: whether the element combines one value per rank (in `vals`).
            let (want, terms) = match collective {
                Collective::AllReduce => {
                    vals.iter_mut().zip(&all).for_each(|(v, a)| *v = a[i]);
                    (reduce(&vals, dtype, op, n), true)
                }
                Collective::ReduceScatter => {
                    vals.iter_mut()
                        .zip(&all)
                        .for_each(|(v, a)| *v = a[rank * count + i]);
                    (reduce(&vals, dtype, op, n), true)
                }
                Collective::AllGather => (exact(all[i / count][i % count], dtype), false),
                _ => (exact(all[root][i], dtype), false),
            };
            let (g, gi) = decode(&got, i, dtype);
            let (ok, want) = match want {
                Want::Float(w) => {
                    let terms: &[f64] = if terms { &vals } else { &[] };
                    (float_close(g, w, terms, op, tol), w)
                }
                Want::Int(w) => (gi == w, w as f64),
            };
            if !ok {
                report.wrong += 1;
                if report.first_wrong.len() < 8 {
                    report.first_wrong.push((i, g, want));
                }
            }
        }
        Ok(report)
    };
    let mut result = run_once(seed);
    if graph {
        // A second replay on new data: flags and counters advanced by the first must still work.
        if let Ok(first_report) = &result {
            if first_report.wrong == 0 {
                result = run_once(seed.wrapping_add(0x5eed));
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
    fn generated_values_round_trip_through_every_non_fp8_type() {
        for dtype in DataType::ALL {
            for op in ReduceOp::ALL {
                let v = gen_values(7, 1, 100, 8, dtype, op);
                let bytes = encode(&v, dtype);
                for (i, want) in v.iter().enumerate() {
                    assert_eq!(decode(&bytes, i, dtype).0, *want, "{dtype} {op} #{i}");
                }
            }
        }
    }

    #[test]
    fn ranks_get_different_deterministic_data() {
        let a = gen_values(1, 0, 64, 2, DataType::F32, ReduceOp::Sum);
        assert_eq!(a, gen_values(1, 0, 64, 2, DataType::F32, ReduceOp::Sum));
        assert_ne!(a, gen_values(1, 1, 64, 2, DataType::F32, ReduceOp::Sum));
    }

    #[test]
    fn integer_wrapping_matches_fixed_width() {
        assert_eq!(wrap(200, DataType::I8), -56);
        assert_eq!(wrap(-1, DataType::U32), u32::MAX as i128);
    }
}
