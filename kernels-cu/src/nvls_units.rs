//! The NVLS (NVLink multicast) all-reduce kernels as run-time compiled translation units: one unit
//! per element type that `multimem.ld_reduce` can add (f32, f16, bf16), each defining the four
//! entry points of [`NvlsKernel`]. See `kernels/allreduce_nvls.cu` for the protocols.
//!
//! Launching them is gated (DESIGN.md, "Safety on shared GPUs"): only `mscclpp-collectives`'s
//! `nvls` module does, after the NVLS gate and the device agree. Compiling them is always safe, and
//! CI compiles every unit for sm_80 (trap path), sm_90 and sm_100.

use crate::collectives::{cxx_type, COMMON};
use mscclpp_core::{DataType, Error, Result};

/// The kernel file, after `collective_common.cuh` in every unit.
pub const ALLREDUCE_NVLS: &str = include_str!("kernels/allreduce_nvls.cu");

/// The element types the NVLS kernels reduce (what `multimem.ld_reduce ... add` supports).
pub const NVLS_DTYPES: [DataType; 3] = [DataType::F32, DataType::F16, DataType::Bf16];

/// The four NVLS all-reduce kernels (entry points of every unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NvlsKernel {
    /// LL16 packets written through the multicast scratch (small messages).
    Packet,
    /// The user's buffers bound to multicast objects; reduce and broadcast in place of a copy.
    ZeroCopy,
    /// Chunks through a multicast-bound scratch, one pipeline stage per warp.
    WarpPipeline,
    /// Chunks through a multicast-bound scratch, one pipeline stage per block.
    BlockPipeline,
}

impl NvlsKernel {
    pub const ALL: [NvlsKernel; 4] = [
        NvlsKernel::Packet,
        NvlsKernel::ZeroCopy,
        NvlsKernel::WarpPipeline,
        NvlsKernel::BlockPipeline,
    ];

    /// The `extern "C"` name of the kernel in every unit.
    pub const fn entry_point(self) -> &'static str {
        match self {
            NvlsKernel::Packet => "allreduce_nvls_packet",
            NvlsKernel::ZeroCopy => "allreduce_nvls_zero_copy",
            NvlsKernel::WarpPipeline => "allreduce_nvls_warp_pipeline",
            NvlsKernel::BlockPipeline => "allreduce_nvls_block_pipeline",
        }
    }
}

/// The 16-byte multimem vector type (switch_channel.cuh) of `dtype`; `Error::Unsupported` naming
/// the type for anything multimem cannot add.
pub fn nvls_vector_type(dtype: DataType) -> Result<&'static str> {
    match dtype {
        DataType::F32 => Ok("f32x4"),
        DataType::F16 => Ok("f16x8"),
        DataType::Bf16 => Ok("bf16x8"),
        other => Err(Error::Unsupported(format!(
            "NVLS all-reduce of {other}: NVLink multicast reduces only f32, f16 and bf16"
        ))),
    }
}

/// Name (logs, kernel cache) of the unit for `dtype`.
pub fn nvls_unit_name(dtype: DataType) -> Result<String> {
    nvls_vector_type(dtype)?;
    Ok(format!("allreduce_nvls_{}", dtype.name()))
}

/// The complete source of the unit for `dtype`.
pub fn nvls_unit_source(dtype: DataType) -> Result<String> {
    let vector = nvls_vector_type(dtype)?;
    let mut text = String::with_capacity(COMMON.len() + ALLREDUCE_NVLS.len() + 128);
    text.push_str(&format!(
        "#define MSCCLPP_NVLS_T {}\n#define MSCCLPP_NVLS_V {vector}\n",
        cxx_type(dtype)
    ));
    text.push_str(COMMON);
    text.push('\n');
    text.push_str(ALLREDUCE_NVLS);
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[test]
    fn every_entry_point_is_a_kernel_of_the_file() {
        for k in NvlsKernel::ALL {
            let decl = format!("{}(", k.entry_point());
            assert!(
                ALLREDUCE_NVLS.contains(&decl),
                "{} missing",
                k.entry_point()
            );
        }
        assert!(ALLREDUCE_NVLS.contains("#include \"mscclpp/switch_channel.cuh\""));
    }

    #[rstest]
    #[case(DataType::F32, "float", "f32x4")]
    #[case(DataType::F16, "f16", "f16x8")]
    #[case(DataType::Bf16, "bf16", "bf16x8")]
    fn units_are_specialised_per_type(#[case] dtype: DataType, #[case] t: &str, #[case] v: &str) {
        let src = nvls_unit_source(dtype).expect("unit");
        assert!(src.starts_with(&format!(
            "#define MSCCLPP_NVLS_T {t}\n#define MSCCLPP_NVLS_V {v}\n"
        )));
        assert!(
            src.contains("namespace coll"),
            "collective_common.cuh is prepended"
        );
        assert_eq!(
            nvls_unit_name(dtype).expect("name"),
            format!("allreduce_nvls_{}", dtype.name())
        );
    }

    #[test]
    fn other_types_are_refused_by_name() {
        for dtype in DataType::ALL
            .into_iter()
            .filter(|d| !NVLS_DTYPES.contains(d))
        {
            let e = nvls_unit_source(dtype).unwrap_err();
            assert!(matches!(e, Error::Unsupported(_)), "{e}");
            assert!(e.to_string().contains(dtype.name()), "{e}");
            assert!(nvls_unit_name(dtype).is_err());
        }
    }
}
