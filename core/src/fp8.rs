//! Host reference conversions for the 8-bit float formats, bit-exact with the device library
//! (kernels-cu `fp8.cuh` software path, kernels-hip `fp8_fnuz.h`).
//!
//! Decoding is exact. Encoding rounds to nearest, ties to even, and saturates: |x| beyond the
//! largest finite value and ±inf become ±max (cuda_fp8.h's `__NV_SATFINITE`); NaN becomes the
//! format's NaN (`S.1111111` for OCP formats, `0x80` for FNUZ) or +max for e4m3b15, which has no NaN.
//! Test suites use these to build float64 references for fp8 collectives.

/// How a format spends its top codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    /// OCP "fn": NaN = S.1...1, no infinity (e4m3).
    Fn,
    /// AMD FNUZ: NaN = 0x80, no negative zero, no infinity.
    Fnuz,
    /// IEEE-like: the top exponent holds infinities and NaNs (OCP e5m2).
    Ieee,
    /// Every code is finite (e4m3b15).
    Finite,
}

/// An 8-bit float format: 1 sign bit, `exp_bits` exponent bits, `man_bits` mantissa bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Format {
    pub exp_bits: u32,
    pub man_bits: u32,
    pub bias: i32,
    pub special: Special,
}

/// OCP e4m3 (`__nv_fp8_e4m3`): bias 7, max 448.
pub const E4M3: Fp8Format = Fp8Format {
    exp_bits: 4,
    man_bits: 3,
    bias: 7,
    special: Special::Fn,
};
/// OCP e5m2 (`__nv_fp8_e5m2`): bias 15, max 57344, with infinities.
pub const E5M2: Fp8Format = Fp8Format {
    exp_bits: 5,
    man_bits: 2,
    bias: 15,
    special: Special::Ieee,
};
/// e4m3 with bias 15 (MSCCL++ `FLOAT8_E4M3B15`): max 1.875, no specials.
pub const E4M3B15: Fp8Format = Fp8Format {
    exp_bits: 4,
    man_bits: 3,
    bias: 15,
    special: Special::Finite,
};
/// AMD FNUZ e4m3 (gfx942 native): bias 8, max 240, NaN 0x80.
pub const E4M3_FNUZ: Fp8Format = Fp8Format {
    exp_bits: 4,
    man_bits: 3,
    bias: 8,
    special: Special::Fnuz,
};
/// AMD FNUZ e5m2 (gfx942 native): bias 16, max 57344, NaN 0x80.
pub const E5M2_FNUZ: Fp8Format = Fp8Format {
    exp_bits: 5,
    man_bits: 2,
    bias: 16,
    special: Special::Fnuz,
};

/// The format of an fp8 `DataType` (None for the other types). The host references of the test
/// suite and the benchmark both build their data through this.
pub fn format_of(dtype: crate::dtype::DataType) -> Option<Fp8Format> {
    use crate::dtype::DataType;
    match dtype {
        DataType::Fp8E4M3 => Some(E4M3),
        DataType::Fp8E4M3Fnuz => Some(E4M3_FNUZ),
        DataType::Fp8E5M2 => Some(E5M2),
        DataType::Fp8E4M3B15 => Some(E4M3B15),
        _ => None,
    }
}

impl Fp8Format {
    /// The format's NaN code (FNUZ: 0x80; OCP: 0x7f), or `None` for e4m3b15.
    pub const fn nan_code(self) -> Option<u8> {
        match self.special {
            Special::Fnuz => Some(0x80),
            Special::Fn | Special::Ieee => Some(0x7f),
            Special::Finite => None,
        }
    }

    /// Largest finite magnitude code.
    pub const fn max_code(self) -> u8 {
        match self.special {
            Special::Fn => 0x7e,
            Special::Ieee => {
                ((((1u32 << self.exp_bits) - 2) << self.man_bits) | ((1 << self.man_bits) - 1))
                    as u8
            }
            Special::Fnuz | Special::Finite => 0x7f,
        }
    }

    /// Largest finite value.
    pub fn max_value(self) -> f32 {
        self.decode(self.max_code())
    }

    /// Whether `code` is a NaN of this format.
    pub fn is_nan(self, code: u8) -> bool {
        self.decode(code).is_nan()
    }

    /// Exact value of `code`.
    pub fn decode(self, code: u8) -> f32 {
        let negative = code & 0x80 != 0;
        let mag = u32::from(code & 0x7f);
        let exp_max = (1u32 << self.exp_bits) - 1;
        let e = mag >> self.man_bits;
        let m = mag & ((1 << self.man_bits) - 1);
        match self.special {
            Special::Fnuz if code == 0x80 => return f32::NAN,
            Special::Fn if mag == 0x7f => return if negative { -f32::NAN } else { f32::NAN },
            Special::Ieee if e == exp_max => {
                let v = if m == 0 { f32::INFINITY } else { f32::NAN };
                return if negative { -v } else { v };
            }
            _ => {}
        }
        let man = self.man_bits as i32;
        let magnitude = if e == 0 {
            m as f32 * 2f32.powi(1 - self.bias - man)
        } else {
            ((1u32 << self.man_bits) + m) as f32 * 2f32.powi(e as i32 - self.bias - man)
        };
        if negative {
            -magnitude
        } else {
            magnitude
        }
    }

    /// Nearest code to `x` (ties to even), saturating; see the module docs for NaN and infinity.
    pub fn encode(self, x: f32) -> u8 {
        let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
        if x.is_nan() {
            return match self.special {
                Special::Fnuz => 0x80,
                Special::Finite => self.max_code(),
                Special::Fn | Special::Ieee => sign | 0x7f,
            };
        }
        let a = f64::from(x.abs());
        let code = if a == 0.0 {
            0
        } else if a.is_infinite() {
            u32::from(self.max_code())
        } else {
            // `a` is a normal f64 (every f32 is), so its exponent field gives floor(log2 a).
            let e = ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023;
            let man = self.man_bits as i32;
            let min_normal = 1 - self.bias;
            // Units of the target's spacing in this binade (or of the subnormal step); scaling by
            // a power of two is exact, so the only rounding is the one we ask for.
            let unit_exp = e.max(min_normal) - man;
            let q = (a * 2f64.powi(-unit_exp)).round_ties_even();
            let code = if e < min_normal {
                // Subnormal: the code is the count of steps; 2^man steps is the smallest normal,
                // which is exactly the next code.
                q
            } else {
                // Normal: exponent field plus mantissa; a carry into the exponent is plain addition.
                f64::from((e + self.bias) << man) + q - f64::from(1u32 << man)
            };
            (code as u32).min(u32::from(self.max_code()))
        };
        if code == 0 && self.special == Special::Fnuz {
            return 0;
        }
        sign | code as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    const ALL: [Fp8Format; 5] = [E4M3, E5M2, E4M3B15, E4M3_FNUZ, E5M2_FNUZ];

    /// Brute force: the nearest finite code by distance, ties to the even code, beyond max -> max.
    fn nearest(f: Fp8Format, x: f32) -> u8 {
        let a = f64::from(x.abs());
        let max = f64::from(f.max_value());
        let mag = if a >= max {
            f.max_code()
        } else {
            let mut best = 0u8;
            let mut best_d = f64::INFINITY;
            for c in 0..=f.max_code() {
                let d = (f64::from(f.decode(c)) - a).abs();
                if d < best_d || (d == best_d && c % 2 == 0) {
                    best = c;
                    best_d = d;
                }
            }
            best
        };
        if mag == 0 && f.special == Special::Fnuz {
            0
        } else if x.is_sign_negative() {
            mag | 0x80
        } else {
            mag
        }
    }

    #[rstest]
    #[case(E4M3, 448.0)]
    #[case(E5M2, 57344.0)]
    #[case(E4M3B15, 1.875)]
    #[case(E4M3_FNUZ, 240.0)]
    #[case(E5M2_FNUZ, 57344.0)]
    fn max_values(#[case] f: Fp8Format, #[case] max: f32) {
        assert_eq!(f.max_value(), max);
        assert_eq!(f.encode(1e30), f.max_code());
        assert_eq!(f.encode(f32::INFINITY), f.max_code());
        assert_eq!(f.encode(f32::NEG_INFINITY), f.max_code() | 0x80);
    }

    #[test]
    fn every_code_round_trips() {
        for f in ALL {
            for c in 0..=255u8 {
                let v = f.decode(c);
                if v.is_nan() {
                    assert!(
                        f.nan_code().is_some(),
                        "{f:?} has no NaN but decoded {c:#x} as NaN"
                    );
                    assert!(f.decode(f.encode(v)).is_nan(), "{f:?} NaN {c:#x}");
                } else if v.is_infinite() {
                    assert_eq!(
                        f.encode(v),
                        f.max_code() | (c & 0x80),
                        "{f:?} inf saturates"
                    );
                } else if f.special == Special::Fnuz && c == 0 {
                    assert_eq!(f.encode(v), 0);
                } else {
                    assert_eq!(f.encode(v), c, "{f:?} code {c:#x} value {v}");
                }
            }
        }
    }

    #[test]
    fn fnuz_nan_is_0x80_and_has_no_negative_zero() {
        for f in [E4M3_FNUZ, E5M2_FNUZ] {
            assert!(f.decode(0x80).is_nan());
            assert_eq!(f.encode(f32::NAN), 0x80);
            assert_eq!(f.encode(-0.0), 0x00);
            assert_eq!(f.encode(-1e-30), 0x00);
            assert_eq!((0..=255u8).filter(|&c| f.decode(c).is_nan()).count(), 1);
        }
        assert_eq!(E4M3_FNUZ.decode(0x01), 2f32.powi(-10));
        assert_eq!(E4M3_FNUZ.decode(0x40), 1.0);
        assert_eq!(E5M2_FNUZ.decode(0x40), 1.0);
    }

    #[test]
    fn ocp_specials() {
        assert!(E4M3.decode(0x7f).is_nan() && E4M3.decode(0xff).is_nan());
        assert_eq!(E4M3.encode(f32::NAN), 0x7f);
        assert_eq!(E5M2.decode(0x7c), f32::INFINITY);
        assert_eq!(E5M2.decode(0xfc), f32::NEG_INFINITY);
        assert!(E5M2.decode(0x7d).is_nan());
        assert_eq!(E4M3B15.encode(f32::NAN), 0x7f);
        assert_eq!(E4M3B15.decode(0x80), 0.0);
        assert!(E4M3B15.decode(0x80).is_sign_negative());
    }

    #[test]
    fn ties_go_to_even() {
        // 1.0 = 0x38 in e4m3, next is 1.125 (0x39); halfway 1.0625 goes to the even 0x38, and
        // halfway 1.1875 between 0x39 and 1.25 (0x3a) goes to 0x3a.
        assert_eq!(E4M3.encode(1.0625), 0x38);
        assert_eq!(E4M3.encode(1.1875), 0x3a);
        // Half the smallest subnormal rounds to zero, just above it rounds up.
        let tiny = E4M3.decode(1);
        assert_eq!(E4M3.encode(tiny / 2.0), 0);
        assert_eq!(E4M3.encode(tiny * 0.51), 1);
    }

    #[test]
    fn encode_matches_brute_force() {
        // A deterministic sweep over f32 bit patterns covering every binade the formats touch,
        // plus every exact midpoint between neighbouring codes (where ties matter).
        for f in ALL {
            let mut x: u32 = 0x2f00_0000;
            while x < 0x4880_0000 {
                let v = f32::from_bits(x);
                for s in [v, -v] {
                    assert_eq!(f.encode(s), nearest(f, s), "{f:?} {s:e}");
                }
                x += 0x1_3579;
            }
            for c in 0..f.max_code() {
                let mid = (f.decode(c) + f.decode(c + 1)) / 2.0;
                assert_eq!(
                    f.encode(mid),
                    nearest(f, mid),
                    "{f:?} midpoint after {c:#x}"
                );
            }
        }
    }
}
