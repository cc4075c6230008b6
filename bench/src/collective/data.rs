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

/// `v` as bf16 bits: rounded to nearest even through f32 (bf16 is f32's top half). Rounded
/// twice, a value can land one step from the nearest bf16, which no check can notice: every value
/// the benchmark uses is the decoded bf16 it wrote. Finite values only, as the generator makes.
fn bf16_bits(v: f64) -> u16 {
    let x = (v as f32).to_bits();
    ((x + 0x7fff + ((x >> 16) & 1)) >> 16) as u16
}

/// `v` as one element of `dtype`, in the low `dtype.size()` bytes of a little-endian word:
/// rounded to nearest (floats) or truncated to the width (integers, which the generator keeps in
/// range).
pub fn encode_word(dtype: DataType, v: f64) -> u64 {
    // The common types first: this runs for every element of every check.
    match dtype {
        DataType::F32 => u64::from((v as f32).to_bits()),
        DataType::F64 => v.to_bits(),
        // Through f32, as the device draws it (bench_data.cu): half's f64 conversion drops the
        // low bits before rounding, which no device conversion does. Every value used is the
        // decoded one, so a second rounding changes no check.
        DataType::F16 => u64::from(f16::from_f32(v as f32).to_bits()),
        DataType::Bf16 => u64::from(bf16_bits(v)),
        DataType::I8 => u64::from(v as i64 as i8 as u8),
        DataType::U8 => u64::from(v as i64 as u8),
        DataType::I32 => u64::from(v as i64 as i32 as u32),
        DataType::U32 => u64::from(v as i64 as u32),
        DataType::I64 => v as i64 as u64,
        DataType::U64 => v as i128 as u64,
        fp8_type => fp8::format_of(fp8_type).map_or(0, |f| u64::from(f.encode(v as f32))),
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

/// One element's bytes (at most 8) as a little-endian word, the form [`encode_word`] gives.
pub fn word(bytes: &[u8]) -> u64 {
    // The element sizes spelled out: a copy of a length known only at run time would be a call
    // per element, and checks read hundreds of millions.
    match *bytes {
        [a] => u64::from(a),
        [a, b] => u64::from(u16::from_le_bytes([a, b])),
        [a, b, c, d] => u64::from(u32::from_le_bytes([a, b, c, d])),
        [a, b, c, d, e, f, g, h] => u64::from_le_bytes([a, b, c, d, e, f, g, h]),
        _ => {
            let mut w = [0u8; 8];
            let n = bytes.len().min(8);
            w[..n].copy_from_slice(&bytes[..n]);
            u64::from_le_bytes(w)
        }
    }
}

/// Stores `bits` (a [`word`]) as an element of `out.len()` bytes, the sizes spelled out as in
/// [`word`].
pub fn put_word(bits: u64, out: &mut [u8]) {
    match out.len() {
        1 => out[0] = bits as u8,
        2 => out.copy_from_slice(&(bits as u16).to_le_bytes()),
        4 => out.copy_from_slice(&(bits as u32).to_le_bytes()),
        8 => out.copy_from_slice(&bits.to_le_bytes()),
        n => out.copy_from_slice(&bits.to_le_bytes()[..n]),
    }
}

/// Value of one float element given as a [`word`]. Integers decode exactly too, for display.
pub fn float_of_word(dtype: DataType, raw: u64) -> f64 {
    match dtype {
        DataType::F32 => f64::from(f32::from_bits(raw as u32)),
        DataType::F64 => f64::from_bits(raw),
        DataType::F16 => f16::from_bits(raw as u16).to_f64(),
        DataType::Bf16 => f64::from(f32::from_bits((raw as u32 & 0xffff) << 16)),
        other => match fp8::format_of(other) {
            Some(f) => f64::from(f.decode(raw as u8)),
            None => int_of_word(other, raw) as f64,
        },
    }
}

/// Exact value of one integer element given as a [`word`].
pub fn int_of_word(dtype: DataType, raw: u64) -> i128 {
    match dtype {
        DataType::I8 => i128::from(raw as u8 as i8),
        DataType::U8 => i128::from(raw as u8),
        DataType::I32 => i128::from(raw as u32 as i32),
        DataType::U32 => i128::from(raw as u32),
        DataType::I64 => i128::from(raw as i64),
        _ => i128::from(raw),
    }
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
    /// How this configuration's values are drawn from random bits: see the module docs.
    pub(super) fn draw(&self) -> Draw {
        let n = self.nranks.max(1) as f64;
        let dtype = self.dtype;
        if dtype.is_float() {
            return if self.op == Some(ReduceOp::Prod) {
                Draw::Product {
                    b: (max_finite(dtype).log2() / 2.0).min(4.0) / n,
                }
            } else {
                Draw::Float {
                    scale: (max_finite(dtype) / (2.0 * n)).min(1.0),
                }
            };
        }
        let signed = matches!(dtype, DataType::I8 | DataType::I32 | DataType::I64);
        let (lo, hi) = if self.op == Some(ReduceOp::Prod) {
            (1, 3)
        } else if dtype.size() == 1 {
            // n <= 8 ranks of |x| <= 15 (signed) or x <= 31 (unsigned) cannot overflow a byte.
            if signed {
                (-15, 15)
            } else {
                (0, 31)
            }
        } else if signed {
            (-1000, 1000)
        } else {
            (0, 1000)
        };
        Draw::Int {
            lo,
            span: (hi - lo + 1) as u64,
        }
    }

    /// `rank`'s input, ready to give any of its elements.
    pub fn rank(&self, rank: usize) -> RankInput {
        RankInput {
            dtype: self.dtype,
            key: self.seed ^ mix((rank as u64 + 1).wrapping_mul(0xd6e8_feb8_6659_fd93)),
            draw: self.draw(),
        }
    }

    /// `rank`'s elements `[start, start + count)`, encoded. Large ranges are split over threads
    /// (a 1 GiB input is 256 Mi f32 elements).
    pub fn encode_range(&self, rank: usize, start: usize, count: usize) -> Vec<u8> {
        let size = self.dtype.size();
        let input = self.rank(rank);
        let mut out = vec![0u8; count * size];
        let parts = worker_threads(count);
        let per = count.div_ceil(parts).max(1);
        std::thread::scope(|scope| {
            for (p, part) in out.chunks_mut(per * size).enumerate() {
                let input = &input;
                scope.spawn(move || {
                    for (k, chunk) in part.chunks_exact_mut(size).enumerate() {
                        put_word(input.element(start + p * per + k).0, chunk);
                    }
                });
            }
        });
        out
    }
}

/// How values come from 53 random bits `t` in [0, 1), worked out once per input: a 1 GiB check
/// draws hundreds of millions of elements.
#[derive(Debug, Clone, Copy)]
pub(super) enum Draw {
    /// `scale · (2t - 1)`, rounded to the type.
    Float { scale: f64 },
    /// `±2^(b · (2t - 1))`, rounded to the type.
    Product { b: f64 },
    /// An integer in `[lo, lo + span)`.
    Int { lo: i64, span: u64 },
}

/// One rank's input (see [`InputSpec::rank`]).
#[derive(Debug, Clone, Copy)]
pub struct RankInput {
    dtype: DataType,
    /// The seed mixed with the rank, so each element costs one counter mix.
    key: u64,
    draw: Draw,
}

impl RankInput {
    /// The seed mixed with the rank: what the device generator starts from (device_data.rs).
    pub(super) fn key(&self) -> u64 {
        self.key
    }

    /// Element `index`: its encoding (the low `dtype.size()` bytes of a little-endian word, as
    /// [`encode_word`]) and its exact value.
    pub fn element(&self, index: usize) -> (u64, f64) {
        let r = mix(self.key ^ mix(index as u64));
        let t = 2.0 * ((r >> 11) as f64 / (1u64 << 53) as f64) - 1.0;
        let rounded = |v: f64| {
            let bits = encode_word(self.dtype, v);
            (bits, float_of_word(self.dtype, bits))
        };
        match self.draw {
            Draw::Float { scale } => rounded(scale * t),
            Draw::Product { b } => {
                let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
                rounded(sign * (b * t).exp2())
            }
            Draw::Int { lo, span } => {
                let v = (lo + (r % span) as i64) as f64;
                (encode_word(self.dtype, v), v)
            }
        }
    }

    /// Element `index`'s value.
    pub fn value(&self, index: usize) -> f64 {
        self.element(index).1
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
                    let want = spec.rank(3).value(100 + k);
                    if dtype.is_float() {
                        assert_eq!(float_of_word(dtype, word(b)), want, "{dtype} {op:?} #{k}");
                    } else {
                        assert_eq!(
                            int_of_word(dtype, word(b)) as f64,
                            want,
                            "{dtype} {op:?} #{k}"
                        );
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
        assert_eq!(a.rank(0).value(5), a.rank(0).value(5));
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
        for i in [0, 1 << 19, big - 1] {
            let one = a.rank(1).element(i).0.to_le_bytes();
            assert_eq!(all[i * 4..i * 4 + 4], one[..4], "element {i}");
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
                let vals: Vec<f64> = (0..8).map(|r| spec.rank(r).value(i)).collect();
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
    fn bf16_rounds_to_nearest_even_from_f32_and_words_round_trip() {
        let spec = InputSpec {
            seed: 3,
            dtype: DataType::F32,
            op: None,
            nranks: 1,
        };
        let input = spec.rank(0);
        for i in 0..20_000 {
            let v = input.value(i) * 3.0f64.powi(i as i32 % 40 - 20);
            assert_eq!(bf16_bits(v), bf16::from_f32(v as f32).to_bits(), "{v}");
        }
        // Ties go to even (bf16's step at 1 is 2^-7): 1 + 2^-8 down to 1, 1 + 3 * 2^-8 up to 1 + 2^-6.
        assert_eq!(bf16_bits(1.0 + 2f64.powi(-8)), bf16::ONE.to_bits());
        let up = bf16::from_f32(1.0 + 2f32.powi(-6)).to_bits();
        assert_eq!(bf16_bits(1.0 + 3.0 * 2f64.powi(-8)), up);
        for size in [1, 2, 4, 8] {
            let mut b = [0u8; 8];
            let bits = 0x0123_4567_89ab_cdefu64 & (u64::MAX >> (64 - 8 * size));
            put_word(bits, &mut b[..size]);
            assert_eq!(word(&b[..size]), bits, "{size} bytes");
        }
    }

    #[test]
    fn float_constants() {
        assert_eq!(unit_roundoff(DataType::Bf16), 1.0 / 256.0);
        assert_eq!(unit_roundoff(DataType::Fp8E5M2), 0.125);
        assert_eq!(max_finite(DataType::Fp8E4M3), 448.0);
        assert_eq!(smallest_subnormal(DataType::Fp8E4M3), 2f64.powi(-9));
        assert_eq!(smallest_subnormal(DataType::F16), 2f64.powi(-24));
        assert_eq!(
            float_of_word(
                DataType::Bf16,
                encode_word(DataType::Bf16, 1.0 + 1.0 / 512.0)
            ),
            1.0
        );
        assert_eq!(unit_roundoff(DataType::I32), 0.0);
    }
}
