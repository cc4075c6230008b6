//! Correctness checks the GPU suite calls (one process per GPU, every rank calls the same check).
//!
//! Each rank fills its input from a generator seeded by (seed, rank), so every rank can rebuild all
//! ranks' inputs on the host and compute the float64 (or exact integer) reference itself. Outputs
//! are poisoned first, every element is compared. Values are small multiples of 1/8, exactly
//! representable in every float type, so sums stay exact in f32/f64 and the tolerance only has to
//! cover f16/bf16 rounding: |got - want| <= 1e-3 + rtol * |want|, rtol = 2^-10 (f16) or 2^-7
//! (bf16) times the world size, 1e-6 (f32), 1e-12 (f64). Integers must match exactly (wrapping).
//! fp8 inputs are refused (Error::Unsupported) until `mscclpp_core::fp8` is available here.

use mscclpp_core::algorithm::{Algorithm, ExecuteArgs};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::MemoryKind;
use mscclpp_core::{AccumType, DataType, Error, ReduceOp, Result};
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

/// The generated value of element `i` of `rank`'s input, as f64 (exact in `dtype`).
fn gen_values(seed: u64, rank: usize, count: usize, dtype: DataType, op: ReduceOp) -> Vec<f64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(
        seed ^ (rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
    );
    (0..count)
        .map(|_| {
            if dtype.is_float() {
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

fn encode(values: &[f64], dtype: DataType) -> Result<Vec<u8>> {
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
            fp8 => {
                return Err(Error::Unsupported(format!(
                    "run_allreduce_check for {fp8}: needs mscclpp_core::fp8"
                )))
            }
        }
    }
    Ok(out)
}

/// Decodes element `i` of `bytes`: floats as f64; integers as their i128 value (as f64 only for
/// reporting; the comparison of integers is exact on the i128).
fn decode(bytes: &[u8], i: usize, dtype: DataType) -> (f64, i128) {
    let s = dtype.size();
    let b = &bytes[i * s..(i + 1) * s];
    let mut w = [0u8; 8];
    w[..s].copy_from_slice(b);
    let raw = u64::from_le_bytes(w);
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

fn rtol(dtype: DataType, nranks: usize) -> f64 {
    match dtype {
        DataType::F16 => nranks as f64 / 1024.0,
        DataType::Bf16 => nranks as f64 / 128.0,
        DataType::F32 => 1e-6,
        _ => 1e-12,
    }
}

/// Runs `algo` once as an all-reduce of `count` elements and checks every element. Collective:
/// every rank calls it with the same arguments. Synchronises the device (it is a test).
pub fn run_allreduce_check(
    comm: &Communicator,
    algo: &dyn Algorithm,
    dtype: DataType,
    op: ReduceOp,
    count: usize,
    in_place: bool,
    seed: u64,
) -> Result<CheckReport> {
    let gpu = comm.gpu();
    let (rank, n) = (comm.rank(), comm.size());
    let bytes = count * dtype.size();
    let all: Vec<Vec<f64>> = (0..n)
        .map(|r| gen_values(seed, r, count, dtype, op))
        .collect();
    let input = gpu.alloc(bytes.max(16), MemoryKind::Plain)?;
    let output = if in_place {
        None
    } else {
        Some(gpu.alloc(bytes.max(16), MemoryKind::Plain)?)
    };
    let out_ptr = output.as_ref().map_or(input.ptr, |a| a.ptr);
    let stream = gpu.create_stream()?;
    let result = (|| -> Result<CheckReport> {
        if !in_place {
            gpu.memset_async(out_ptr, 0xA5, bytes.max(16), stream)?; // poison
        }
        gpu.copy_to_device(input.ptr, &encode(&all[rank], dtype)?)?;
        gpu.synchronize_stream(stream)?;
        let args = ExecuteArgs {
            input: input.ptr,
            output: out_ptr,
            input_bytes: bytes,
            output_bytes: bytes,
            dtype,
            op,
            accum: AccumType::Auto,
            root: 0,
            stream,
            nblocks: None,
            nthreads: None,
        };
        algo.execute(&args)?;
        gpu.synchronize_stream(stream)?;
        comm.check_device_errors()?;
        let mut got = vec![0u8; bytes];
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
                format!("1e-3 + {tol:e} * |want|")
            } else {
                "exact".into()
            },
        };
        for i in 0..count {
            let (g, gi) = decode(&got, i, dtype);
            let (ok, want) = if dtype.is_float() {
                let vals = all.iter().map(|v| v[i]);
                let want = match op {
                    ReduceOp::Sum => vals.sum::<f64>(),
                    ReduceOp::Avg => vals.sum::<f64>() / n as f64,
                    ReduceOp::Prod => vals.product::<f64>(),
                    ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
                    ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
                };
                ((g - want).abs() <= 1e-3 + tol * want.abs(), want)
            } else {
                let vals = all.iter().map(|v| v[i] as i128);
                let want = match op {
                    ReduceOp::Sum => wrap(vals.fold(0, |a, b| wrap(a + b, dtype)), dtype),
                    // Integer average: the wrapped sum divided, truncating, as the kernel does.
                    ReduceOp::Avg => {
                        wrap(vals.fold(0, |a, b| wrap(a + b, dtype)) / n as i128, dtype)
                    }
                    ReduceOp::Prod => vals.fold(1, |a, b| wrap(a * b, dtype)),
                    ReduceOp::Min => vals.min().unwrap_or(0),
                    ReduceOp::Max => vals.max().unwrap_or(0),
                };
                (gi == want, want as f64)
            };
            if !ok {
                report.wrong += 1;
                if report.first_wrong.len() < 8 {
                    report.first_wrong.push((i, g, want));
                }
            }
        }
        Ok(report)
    })();
    let _ = gpu.destroy_stream(stream);
    if let Some(o) = &output {
        let _ = gpu.free(o);
    }
    let _ = gpu.free(&input);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_values_round_trip_through_every_non_fp8_type() {
        for dtype in DataType::ALL.into_iter().filter(|d| !d.is_fp8()) {
            for op in ReduceOp::ALL {
                let v = gen_values(7, 1, 100, dtype, op);
                let bytes = encode(&v, dtype).expect("encode");
                for (i, want) in v.iter().enumerate() {
                    assert_eq!(decode(&bytes, i, dtype).0, *want, "{dtype} {op} #{i}");
                }
            }
        }
        assert!(encode(&[1.0], DataType::Fp8E4M3).is_err());
    }

    #[test]
    fn ranks_get_different_deterministic_data() {
        let a = gen_values(1, 0, 64, DataType::F32, ReduceOp::Sum);
        assert_eq!(a, gen_values(1, 0, 64, DataType::F32, ReduceOp::Sum));
        assert_ne!(a, gen_values(1, 1, 64, DataType::F32, ReduceOp::Sum));
    }

    #[test]
    fn integer_wrapping_matches_fixed_width() {
        assert_eq!(wrap(200, DataType::I8), -56);
        assert_eq!(wrap(-1, DataType::U32), u32::MAX as i128);
    }
}
