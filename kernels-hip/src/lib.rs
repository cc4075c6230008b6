//! HIP-only device pieces of mscclpp-rs, embedded as text for hiprtc: gfx942 FNUZ fp8 conversions
//! and the wavefront-size header. The shared device library and collective kernels live in
//! `mscclpp-kernels-cu` and are compiled for HIP from the same sources (platform macros where the
//! two differ); this crate holds only what exists on AMD alone.

/// `mscclpp_hip/fp8_fnuz.h`: e4m3fnuz/e5m2fnuz <-> float (gfx942 builtins, software elsewhere).
pub const FP8_FNUZ_H: &str = include_str!("../include/mscclpp_hip/fp8_fnuz.h");

/// `mscclpp_hip/wave64.h`: `MSCCLPP_WARP_SIZE`, lane-mask type and lane/warp id macros.
pub const WAVE64_H: &str = include_str!("../include/mscclpp_hip/wave64.h");

/// Every header, as (include name, text), for hiprtc's in-memory headers.
pub const HEADERS: &[(&str, &str)] = &[
    ("mscclpp_hip/fp8_fnuz.h", FP8_FNUZ_H),
    ("mscclpp_hip/wave64.h", WAVE64_H),
];

#[cfg(test)]
mod tests;
