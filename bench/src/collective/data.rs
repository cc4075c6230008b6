//! Benchmark data: element encoding for every [`DataType`], and inputs that every rank can
//! regenerate for every other rank.
//!
//! Inputs are counter-based: element `i` of rank `r` is a pure function of `(seed, r, i)`, so a
//! rank checks any slice of any rank's input (a reduce-scatter chunk, an all-gather block) without
//! holding all inputs in memory, and the check of a 1 GiB message streams.
//!
//! Values are chosen so that the reference never leaves the type's range: floats in
//! `[-A, A]` with `A = min(1, max/(2n))` (sums of `n` ranks stay below `max/2`), products of `n`
//! ranks within `2^±min(4, log2(max)/2)`; integers small enough that sums cannot overflow and
//! products wrap identically in any order. Every generated float is rounded to the type first,
//! so the host reference uses exactly the value the device sees.

use half::{bf16, f16};
use mscclpp_core::fp8;
use mscclpp_core::{DataType, ReduceOp};

/// Largest finite value of a float type (integers: their maximum as f64).
pub fn max_finite(dtype: DataType) -> f64 {
    if let Some(f) = fp8::format_of(dtype) {
        return f64::from(f.max_value());
    }
    match dtype {
        DataType::F32 => f64::from(f32::MAX),
        DataType::F64 => f64::MAX,
        DataType::F16 => f64::from(f16::MAX),
        DataType::Bf16 => f64::from(bf16::MAX),
        DataType::I8 => f64::from(i8::MAX),
        DataType::U8 => f64::from(u8::MAX),
        DataType::I32 => f64::from(i32::MAX),
        DataType::U32 => f64::from(u32::MAX),
        DataType::I64 => i64::MAX as f64,
        _ => u64::MAX as f64,
    }
}

/// Unit roundoff `u = 2^-p` of a float type of precision `p` (significand bits, implicit one
/// included); 0 for integers.
pub fn unit_roundoff(dtype: DataType) -> f64 {
    if let Some(f) = fp8::format_of(dtype) {
        return 2f64.powi(-(f.man_bits as i32 + 1));
    }
    match dtype {
        DataType::F32 => 2f64.powi(-24),
        DataType::F64 => 2f64.powi(-53),
        DataType::F16 => 2f64.powi(-11),
        DataType::Bf16 => 2f64.powi(-8),
        _ => 0.0,
    }
}

/// Smallest positive (subnormal) value of a float type: the absolute rounding step near zero.
pub fn smallest_subnormal(dtype: DataType) -> f64 {
    if let Some(f) = fp8::format_of(dtype) {
        return 2f64.powi(1 - f.bias - f.man_bits as i32);
    }
    match dtype {
        DataType::F32 => 2f64.powi(-149),
        DataType::F64 => 2f64.powi(-1074),
        DataType::F16 => 2f64.powi(-24),
        DataType::Bf16 => 2f64.powi(-133),
        _ => 0.0,
    }
}

/// Writes `v` as one element of `dtype` into `out` (`dtype.size()` bytes), rounding to nearest
/// (floats) or truncating to the width (integers, which the generator keeps in range).
pub fn encode(dtype: DataType, v: f64, out: &mut [u8]) {
    if let Some(f) = fp8::format_of(dtype) {
        out[0] = f.encode(v as f32);
        return;
    }
    match dtype {
        DataType::F32 => out.copy_from_slice(&(v as f32).to_le_bytes()),
        DataType::F64 => out.copy_from_slice(&v.to_le_bytes()),
        DataType::F16 => out.copy_from_slice(&f16::from_f64(v).to_le_bytes()),
        DataType::Bf16 => out.copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
        DataType::I8 => out[0] = v as i64 as i8 as u8,
        DataType::U8 => out[0] = v as i64 as u8,
        DataType::I32 => out.copy_from_slice(&(v as i64 as i32).to_le_bytes()),
        DataType::U32 => out.copy_from_slice(&(v as i64 as u32).to_le_bytes()),
        DataType::I64 => out.copy_from_slice(&(v as i64).to_le_bytes()),
        _ => out.copy_from_slice(&(v as i128 as u64).to_le_bytes()),
    }
}

/// The byte output buffers are filled with before a checked call: its value in `dtype` is one
/// the generator's data never produces (NaN or beyond the range of floats; beyond the reachable
/// sums of integers), so an element the collective failed to write is counted wrong.
pub fn poison_byte(dtype: DataType) -> u8 {
    match dtype {
        // 0x7f..: 127 for i8 (sums of 8 ranks reach at most 120), huge for wider types; 0xff would
        // be -1, a value sums can produce.
        DataType::I8 | DataType::I32 | DataType::I64 => 0x7f,
        // Unsigned: the type's maximum. Floats: NaN, or -max where the format has no NaN there.
        _ => 0xff,
    }
}

fn word(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    let n = bytes.len().min(8);
    w[..n].copy_from_slice(&bytes[..n]);
    u64::from_le_bytes(w)
}

/// Value of one float element (`dtype.size()` bytes). Integers decode exactly too, for display.
pub fn decode_float(dtype: DataType, bytes: &[u8]) -> f64 {
    let raw = word(bytes);
    if let Some(f) = fp8::format_of(dtype) {
        return f64::from(f.decode(raw as u8));
    }
    match dtype {
        DataType::F32 => f64::from(f32::from_bits(raw as u32)),
        DataType::F64 => f64::from_bits(raw),
        DataType::F16 => f16::from_bits(raw as u16).to_f64(),
        DataType::Bf16 => bf16::from_bits(raw as u16).to_f64(),
        _ => decode_int(dtype, bytes) as f64,
    }
}

/// Exact value of one integer element.
pub fn decode_int(dtype: DataType, bytes: &[u8]) -> i128 {
    let raw = word(bytes);
    match dtype {
        DataType::I8 => i128::from(raw as u8 as i8),
        DataType::U8 => i128::from(raw as u8),
        DataType::I32 => i128::from(raw as u32 as i32),
        DataType::U32 => i128::from(raw as u32),
        DataType::I64 => i128::from(raw as i64),
        _ => i128::from(raw),
    }
}

/// `v` rounded to the nearest value of `dtype`.
pub fn round_to(dtype: DataType, v: f64) -> f64 {
    let mut buf = [0u8; 8];
    let b = &mut buf[..dtype.size()];
    encode(dtype, v, b);
    decode_float(dtype, b)
}

/// Threads worth using for `elements` elements of host work: one below a million elements
/// (starting threads would cost more than it saves), else every core up to 32.
pub fn worker_threads(elements: usize) -> usize {
    if elements < (1 << 20) {
        return 1;
    }
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 32)
}

/// SplitMix64's finaliser: a good 64-bit mix, so neighbouring counters give unrelated values.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What one configuration's inputs are: every rank derives the same from the same fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputSpec {
    pub seed: u64,
    pub dtype: DataType,
    /// The reduction the data feeds (`None` for pure data movement).
    pub op: Option<ReduceOp>,
    pub nranks: usize,
}

impl InputSpec {
    fn bits(&self, rank: usize, index: usize) -> u64 {
        mix(self.seed
            ^ mix((rank as u64 + 1).wrapping_mul(0xd6e8_feb8_6659_fd93))
            ^ mix(index as u64))
    }

    /// Element `index` of `rank`'s input, exactly representable in the type.
    pub fn value(&self, rank: usize, index: usize) -> f64 {
        let r = self.bits(rank, index);
        let n = self.nranks.max(1) as f64;
        let dtype = self.dtype;
        // 53 random bits as a fraction in [0, 1).
        let unit = (r >> 11) as f64 / (1u64 << 53) as f64;
        if dtype.is_float() {
            if self.op == Some(ReduceOp::Prod) {
                let b = (max_finite(dtype).log2() / 2.0).min(4.0) / n;
                let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
                round_to(dtype, sign * (b * (2.0 * unit - 1.0)).exp2())
            } else {
                let a = (max_finite(dtype) / (2.0 * n)).min(1.0);
                round_to(dtype, a * (2.0 * unit - 1.0))
            }
        } else {
            let signed = matches!(dtype, DataType::I8 | DataType::I32 | DataType::I64);
            let pick = |lo: i64, hi: i64| lo + (r % (hi - lo + 1) as u64) as i64;
            let v = if self.op == Some(ReduceOp::Prod) {
                pick(1, 3)
            } else if dtype.size() == 1 {
                // n <= 8 ranks of |x| <= 15 (signed) or x <= 31 (unsigned) cannot overflow a byte.
                if signed {
                    pick(-15, 15)
                } else {
                    pick(0, 31)
                }
            } else if signed {
                pick(-1000, 1000)
            } else {
                pick(0, 1000)
            };
            v as f64
        }
    }

    /// `rank`'s elements `[start, start + count)`, encoded. Large ranges are split over threads
    /// (a 1 GiB input is 256 Mi f32 elements).
    pub fn encode_range(&self, rank: usize, start: usize, count: usize) -> Vec<u8> {
        let size = self.dtype.size();
        let mut out = vec![0u8; count * size];
        let parts = worker_threads(count);
        let per = count.div_ceil(parts).max(1);
        std::thread::scope(|scope| {
            for (p, part) in out.chunks_mut(per * size).enumerate() {
                scope.spawn(move || {
                    for (k, chunk) in part.chunks_exact_mut(size).enumerate() {
                        encode(self.dtype, self.value(rank, start + p * per + k), chunk);
                    }
                });
            }
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[test]
    fn every_type_round_trips_its_generated_values() {
        for dtype in DataType::ALL {
            for op in [None, Some(ReduceOp::Sum), Some(ReduceOp::Prod)] {
                let spec = InputSpec {
                    seed: 42,
                    dtype,
                    op,
                    nranks: 8,
                };
                let bytes = spec.encode_range(3, 100, 64);
                for (k, b) in bytes.chunks_exact(dtype.size()).enumerate() {
                    let want = spec.value(3, 100 + k);
                    if dtype.is_float() {
                        assert_eq!(decode_float(dtype, b), want, "{dtype} {op:?} #{k}");
                    } else {
                        assert_eq!(decode_int(dtype, b) as f64, want, "{dtype} {op:?} #{k}");
                    }
                }
            }
        }
    }

    #[test]
    fn values_depend_on_rank_index_and_seed_only() {
        let a = InputSpec {
            seed: 1,
            dtype: DataType::F32,
            op: Some(ReduceOp::Sum),
            nranks: 2,
        };
        assert_eq!(a.value(0, 5), a.value(0, 5));
        assert_ne!(a.encode_range(0, 0, 16), a.encode_range(1, 0, 16));
        assert_ne!(
            a.encode_range(0, 0, 16),
            InputSpec { seed: 2, ..a }.encode_range(0, 0, 16)
        );
        // A slice regenerated from its offset equals the same slice of the whole.
        assert_eq!(
            a.encode_range(1, 0, 32)[40..80],
            a.encode_range(1, 10, 10)[..]
        );
        // The threaded path gives the same bytes as element-by-element encoding.
        let big = (1 << 20) + 3;
        let all = a.encode_range(1, 0, big);
        assert_eq!(all.len(), big * 4);
        let mut one = [0u8; 4];
        for i in [0, 1 << 19, big - 1] {
            encode(DataType::F32, a.value(1, i), &mut one);
            assert_eq!(all[i * 4..i * 4 + 4], one, "element {i}");
        }
    }

    #[rstest]
    #[case(DataType::Fp8E4M3B15)]
    #[case(DataType::Fp8E4M3)]
    #[case(DataType::F16)]
    fn sums_and_products_stay_in_range(#[case] dtype: DataType) {
        for op in [ReduceOp::Sum, ReduceOp::Prod] {
            let spec = InputSpec {
                seed: 9,
                dtype,
                op: Some(op),
                nranks: 8,
            };
            for i in 0..2000 {
                let vals: Vec<f64> = (0..8).map(|r| spec.value(r, i)).collect();
                let total = if op == ReduceOp::Sum {
                    vals.iter().map(|v| v.abs()).sum::<f64>()
                } else {
                    vals.iter().map(|v| v.abs()).product::<f64>()
                };
                assert!(total <= max_finite(dtype), "{dtype} {op} #{i}: {total}");
            }
        }
    }

    #[test]
    fn float_constants() {
        assert_eq!(unit_roundoff(DataType::Bf16), 1.0 / 256.0);
        assert_eq!(unit_roundoff(DataType::Fp8E5M2), 0.125);
        assert_eq!(max_finite(DataType::Fp8E4M3), 448.0);
        assert_eq!(smallest_subnormal(DataType::Fp8E4M3), 2f64.powi(-9));
        assert_eq!(smallest_subnormal(DataType::F16), 2f64.powi(-24));
        assert_eq!(round_to(DataType::Bf16, 1.0 + 1.0 / 512.0), 1.0);
        assert_eq!(unit_roundoff(DataType::I32), 0.0);
    }
}
