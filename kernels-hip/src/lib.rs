//! HIP-only device pieces of mscclpp-rs, embedded as text for hiprtc: gfx942 FNUZ fp8 conversions,
//! the wavefront-size header and f16/bf16 (hiprtc offers no hip_fp16.h/hip_bf16.h on ROCm 5). The shared device library and collective kernels live in
//! `mscclpp-kernels-cu` and are compiled for HIP from the same sources (platform macros where the
//! two differ); this crate holds only what exists on AMD alone.

/// `mscclpp_hip/fp8_fnuz.h`: e4m3fnuz/e5m2fnuz <-> float (gfx942 builtins, software elsewhere).
pub const FP8_FNUZ_H: &str = include_str!("../include/mscclpp_hip/fp8_fnuz.h");

/// `mscclpp_hip/wave64.h`: `MSCCLPP_WARP_SIZE`, lane-mask type and lane/warp id macros.
pub const WAVE64_H: &str = include_str!("../include/mscclpp_hip/wave64.h");

/// `mscclpp_hip/half.h`: f16 (`_Float16`) and bf16 for `mscclpp/reduce.cuh` on HIP.
pub const HALF_H: &str = include_str!("../include/mscclpp_hip/half.h");

/// Every HIP-only header, as (include name, text).
pub const HEADERS: &[(&str, &str)] = &[
    ("mscclpp_hip/fp8_fnuz.h", FP8_FNUZ_H),
    ("mscclpp_hip/wave64.h", WAVE64_H),
    ("mscclpp_hip/half.h", HALF_H),
];

/// What a HIP compile of a kernel unit needs as in-memory headers: the shared device library
/// (`mscclpp-kernels-cu`, whose headers include these on HIP) followed by [`HEADERS`].
pub fn all_headers() -> Vec<(&'static str, &'static str)> {
    mscclpp_kernels_cu::HEADERS
        .iter()
        .chain(HEADERS)
        .copied()
        .collect()
}

#[cfg(test)]
mod tests;
