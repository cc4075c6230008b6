//! Element types and reduction operations, with their NCCL ABI numbers.
//!
//! The NCCL numbering is the ABI that `libmscclpp_nccl.so` must honour (nccl.h's `ncclDataType_t`
//! and `ncclRedOp_t`). Types NCCL does not have (FNUZ fp8, e4m3b15) get no NCCL number.

use crate::error::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// Element type of a collective's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DataType {
    F32,
    F16,
    Bf16,
    F64,
    I8,
    U8,
    I32,
    U32,
    I64,
    U64,
    /// OCP fp8 e4m3 (`__nv_fp8_e4m3`): bias 7, no infinities, NaN = S.1111.111, max 448.
    Fp8E4M3,
    /// AMD FNUZ fp8 e4m3 (gfx942 native): bias 8, no negative zero, NaN = 0x80, max 240.
    Fp8E4M3Fnuz,
    /// OCP fp8 e5m2 (`__nv_fp8_e5m2`): bias 15, IEEE-like with infinities.
    Fp8E5M2,
    /// fp8 e4m3 with exponent bias 15 (MSCCL++'s `FLOAT8_E4M3B15`): range ±1.875, finer near zero.
    Fp8E4M3B15,
}

impl DataType {
    /// Every type, in a stable order (tests iterate over this).
    pub const ALL: [DataType; 14] = [
        DataType::F32,
        DataType::F16,
        DataType::Bf16,
        DataType::F64,
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::Fp8E4M3,
        DataType::Fp8E4M3Fnuz,
        DataType::Fp8E5M2,
        DataType::Fp8E4M3B15,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::F64 | DataType::I64 | DataType::U64 => 8,
            DataType::F32 | DataType::I32 | DataType::U32 => 4,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I8
            | DataType::U8
            | DataType::Fp8E4M3
            | DataType::Fp8E4M3Fnuz
            | DataType::Fp8E5M2
            | DataType::Fp8E4M3B15 => 1,
        }
    }

    /// Canonical short name, also the name the CUDA/HIP kernels are specialised under.
    pub const fn name(self) -> &'static str {
        match self {
            DataType::F32 => "f32",
            DataType::F16 => "f16",
            DataType::Bf16 => "bf16",
            DataType::F64 => "f64",
            DataType::I8 => "i8",
            DataType::U8 => "u8",
            DataType::I32 => "i32",
            DataType::U32 => "u32",
            DataType::I64 => "i64",
            DataType::U64 => "u64",
            DataType::Fp8E4M3 => "fp8_e4m3",
            DataType::Fp8E4M3Fnuz => "fp8_e4m3fnuz",
            DataType::Fp8E5M2 => "fp8_e5m2",
            DataType::Fp8E4M3B15 => "fp8_e4m3b15",
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F32 | DataType::F16 | DataType::Bf16 | DataType::F64
        ) || self.is_fp8()
    }

    pub const fn is_fp8(self) -> bool {
        matches!(
            self,
            DataType::Fp8E4M3 | DataType::Fp8E4M3Fnuz | DataType::Fp8E5M2 | DataType::Fp8E4M3B15
        )
    }

    /// `ncclDataType_t` value, or `None` for types NCCL does not define.
    pub const fn to_nccl(self) -> Option<i32> {
        Some(match self {
            DataType::I8 => 0,
            DataType::U8 => 1,
            DataType::I32 => 2,
            DataType::U32 => 3,
            DataType::I64 => 4,
            DataType::U64 => 5,
            DataType::F16 => 6,
            DataType::F32 => 7,
            DataType::F64 => 8,
            DataType::Bf16 => 9,
            DataType::Fp8E4M3 => 10,
            DataType::Fp8E5M2 => 11,
            DataType::Fp8E4M3Fnuz | DataType::Fp8E4M3B15 => return None,
        })
    }

    /// Inverse of [`DataType::to_nccl`]; an unknown number is an error naming it.
    pub fn from_nccl(value: i32) -> Result<Self> {
        Ok(match value {
            0 => DataType::I8,
            1 => DataType::U8,
            2 => DataType::I32,
            3 => DataType::U32,
            4 => DataType::I64,
            5 => DataType::U64,
            6 => DataType::F16,
            7 => DataType::F32,
            8 => DataType::F64,
            9 => DataType::Bf16,
            10 => DataType::Fp8E4M3,
            11 => DataType::Fp8E5M2,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown ncclDataType_t value {other}"
                )))
            }
        })
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = Error;

    /// Accepts our names plus the common aliases of NCCL, PyTorch and MSCCL++
    /// (`float`, `half`, `bfloat16`, `float8_e4m3`...).
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        let t = match lower.as_str() {
            "f32" | "float" | "float32" | "fp32" => DataType::F32,
            "f16" | "half" | "float16" | "fp16" => DataType::F16,
            "bf16" | "bfloat16" => DataType::Bf16,
            "f64" | "double" | "float64" | "fp64" => DataType::F64,
            "i8" | "int8" | "char" => DataType::I8,
            "u8" | "uint8" => DataType::U8,
            "i32" | "int32" | "int" => DataType::I32,
            "u32" | "uint32" => DataType::U32,
            "i64" | "int64" => DataType::I64,
            "u64" | "uint64" => DataType::U64,
            "fp8_e4m3" | "e4m3" | "float8_e4m3" | "float8_e4m3fn" => DataType::Fp8E4M3,
            "fp8_e4m3fnuz" | "e4m3fnuz" | "float8_e4m3fnuz" => DataType::Fp8E4M3Fnuz,
            "fp8_e5m2" | "e5m2" | "float8_e5m2" => DataType::Fp8E5M2,
            "fp8_e4m3b15" | "e4m3b15" | "float8_e4m3b15" => DataType::Fp8E4M3B15,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown data type {s:?} (expected one of: {})",
                    DataType::ALL.map(|t| t.name()).join(", ")
                )))
            }
        };
        Ok(t)
    }
}

/// Reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Prod,
    Min,
    Max,
    /// Sum divided by the number of ranks.
    Avg,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// `ncclRedOp_t` value.
    pub const fn to_nccl(self) -> i32 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Avg => 4,
        }
    }

    pub fn from_nccl(value: i32) -> Result<Self> {
        Ok(match value {
            0 => ReduceOp::Sum,
            1 => ReduceOp::Prod,
            2 => ReduceOp::Max,
            3 => ReduceOp::Min,
            4 => ReduceOp::Avg,
            other => {
                return Err(Error::Unsupported(format!(
                    "ncclRedOp_t value {other} (custom PreMulSum ops are not supported)"
                )))
            }
        })
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "mean" => ReduceOp::Avg,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown reduce op {s:?} (expected sum, prod, min, max or avg)"
                )))
            }
        })
    }
}

/// Type in which reductions accumulate. `Auto` accumulates in the input type (MSCCL++'s default);
/// fp8 inputs may ask for `F16` or `F32` to keep precision across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AccumType {
    #[default]
    Auto,
    F16,
    F32,
}

impl AccumType {
    /// The concrete type reductions of `input` run in.
    pub fn resolve(self, input: DataType) -> Result<DataType> {
        match self {
            AccumType::Auto => Ok(input),
            AccumType::F16 | AccumType::F32 if !input.is_float() => Err(Error::Unsupported(
                format!("accumulation type {self:?} for integer input {input}"),
            )),
            AccumType::F16 => Ok(DataType::F16),
            AccumType::F32 => Ok(DataType::F32),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[test]
    fn nccl_round_trip_for_every_type_nccl_has() {
        for t in DataType::ALL {
            if let Some(n) = t.to_nccl() {
                assert_eq!(DataType::from_nccl(n).unwrap(), t);
            }
        }
        assert!(DataType::from_nccl(12).is_err());
        assert!(DataType::from_nccl(-1).is_err());
    }

    #[rstest]
    #[case(DataType::F32, 4)]
    #[case(DataType::Bf16, 2)]
    #[case(DataType::U64, 8)]
    #[case(DataType::Fp8E4M3B15, 1)]
    fn sizes(#[case] t: DataType, #[case] size: usize) {
        assert_eq!(t.size(), size);
    }

    #[test]
    fn names_parse_back() {
        for t in DataType::ALL {
            assert_eq!(t.name().parse::<DataType>().unwrap(), t);
        }
        for op in ReduceOp::ALL {
            assert_eq!(op.name().parse::<ReduceOp>().unwrap(), op);
            assert_eq!(ReduceOp::from_nccl(op.to_nccl()).unwrap(), op);
        }
        let err = "f128".parse::<DataType>().unwrap_err().to_string();
        assert!(err.contains("f128"), "{err}");
    }

    #[test]
    fn accumulation_type() {
        assert_eq!(
            AccumType::Auto.resolve(DataType::Fp8E4M3).unwrap(),
            DataType::Fp8E4M3
        );
        assert_eq!(
            AccumType::F32.resolve(DataType::Fp8E5M2).unwrap(),
            DataType::F32
        );
        assert!(AccumType::F16.resolve(DataType::I32).is_err());
    }
}
