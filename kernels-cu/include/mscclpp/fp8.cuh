// mscclpp-rs device library: the four 8-bit float formats of core/src/dtype.rs and their
// conversions to/from float.
//
//   fp8_e4m3      OCP E4M3 ("fn"): bias 7, no infinities, NaN = S.1111.111, max 448.
//   fp8_e4m3fnuz  AMD FNUZ E4M3: bias 8, no infinities, no negative zero, NaN = 0x80, max 240.
//   fp8_e5m2      OCP E5M2: bias 15, IEEE-like (infinities S.11111.00, NaNs), max 57344.
//   fp8_e4m3b15   E4M3 with bias 15: every code is finite (no NaN/inf), max 1.875.
//
// Conversions to fp8 round to nearest even and saturate (|x| beyond max and +-inf become +-max, the
// behaviour of cuda_fp8.h's __NV_SATFINITE); NaN becomes the format's NaN, or +max for e4m3b15,
// which has none. On CUDA sm_89+ the OCP formats use cuda_fp8.h (hardware cvt instructions); every
// other case uses the software path below, which is exact and branch-light. HIP's native gfx942
// FNUZ conversions live in kernels-hip (MSCCLPP_ROCM_USE_FNUZ_FP8 below).
#pragma once
#include "mscclpp/common.cuh"

#if defined(MSCCLPP_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
#include <cuda_fp8.h>
#define MSCCLPP_HW_FP8 1
#endif

// AMD, as MSCCL++: MSCCLPP_ROCM_USE_FNUZ_FP8=1 says the target's fp8 hardware is FNUZ (gfx940-942;
// gfx950 is OCP), so fp8_e4m3fnuz converts with it (kernels-hip's fp8_fnuz.h); the OCP formats and
// e4m3b15 stay in software. Default: on for gfx940-942, off elsewhere; a -D overrides it.
#if defined(MSCCLPP_HIP)
#if !defined(MSCCLPP_ROCM_USE_FNUZ_FP8)
#if defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
#define MSCCLPP_ROCM_USE_FNUZ_FP8 1
#else
#define MSCCLPP_ROCM_USE_FNUZ_FP8 0
#endif
#endif
#if MSCCLPP_ROCM_USE_FNUZ_FP8
#include "mscclpp_hip/fp8_fnuz.h"
#define MSCCLPP_HW_FP8_FNUZ 1
#endif
#endif

namespace mscclpp {

struct fp8_e4m3 { u8 bits; };
struct fp8_e4m3fnuz { u8 bits; };
struct fp8_e5m2 { u8 bits; };
struct fp8_e4m3b15 { u8 bits; };

static_assert(sizeof(fp8_e4m3) == 1 && sizeof(fp8_e4m3fnuz) == 1 && sizeof(fp8_e5m2) == 1 &&
                  sizeof(fp8_e4m3b15) == 1,
              "fp8 types are one byte");

// How a format spends its top codes.
enum Fp8Special : int {
  kFp8Fn = 0,      // NaN = S.1...1 (all exponent and mantissa bits), no infinity
  kFp8Fnuz = 1,    // NaN = 0x80, no negative zero, no infinity
  kFp8Ieee = 2,    // top exponent holds infinity (mantissa 0) and NaNs
  kFp8Finite = 3,  // no specials at all
};

template <int ExpBits, int ManBits, int Bias, int Special>
struct Fp8Format {
  static constexpr u32 kExpMax = (1u << ExpBits) - 1;
  static constexpr u32 kManMask = (1u << ManBits) - 1;
  // Largest finite magnitude code.
  static constexpr u32 kMaxCode = Special == kFp8Fn     ? 0x7Eu
                                  : Special == kFp8Ieee ? (((kExpMax - 1) << ManBits) | kManMask)
                                                        : 0x7Fu;

  static MSCCLPP_DEVICE_INLINE float decode(u8 c) {
    const u32 sign = static_cast<u32>(c & 0x80) << 24;
    const u32 mag = c & 0x7Fu;
    if (Special == kFp8Fnuz && c == 0x80) return __uint_as_float(0x7FC00000u);
    if (Special == kFp8Fn && mag == 0x7F) return __uint_as_float(sign | 0x7FC00000u);
    const u32 e = mag >> ManBits;
    const u32 m = mag & kManMask;
    if (Special == kFp8Ieee && e == kExpMax) {
      return __uint_as_float(sign | (m == 0 ? 0x7F800000u : 0x7FC00000u));
    }
    if (e == 0) {
      // Subnormal: m * 2^(1 - Bias - ManBits), exact in float.
      const float unit = __uint_as_float(static_cast<u32>(127 + 1 - Bias - ManBits) << 23);
      return __uint_as_float(sign | __float_as_uint(static_cast<float>(m) * unit));
    }
    return __uint_as_float(sign | ((e - Bias + 127) << 23) | (m << (23 - ManBits)));
  }

  static MSCCLPP_DEVICE_INLINE u8 encode(float x) {
    const u32 bits = __float_as_uint(x);
    const u32 sign = (bits >> 24) & 0x80u;
    const u32 fexp = (bits >> 23) & 0xFFu;
    const u32 fman = bits & 0x7FFFFFu;
    if (fexp == 0xFF && fman != 0) {  // NaN
      if (Special == kFp8Fnuz) return 0x80;
      if (Special == kFp8Finite) return static_cast<u8>(kMaxCode);
      return static_cast<u8>(sign | 0x7F);
    }
    if (fexp == 0xFF) return static_cast<u8>(sign | kMaxCode);  // +-inf saturates
    if (fexp == 0) return Special == kFp8Fnuz ? 0 : static_cast<u8>(sign);  // zero, float subnormal
    const int e = static_cast<int>(fexp) - 127 + Bias;  // target biased exponent
    u32 code;
    if (e >= 1) {
      constexpr u32 shift = 23 - ManBits;
      u32 m = fman >> shift;
      const u32 rem = fman & ((1u << shift) - 1);
      const u32 half = 1u << (shift - 1);
      if (rem > half || (rem == half && (m & 1))) ++m;
      // A mantissa carry moves into the exponent field by plain addition.
      const u64 wide = (static_cast<u64>(e) << ManBits) + m;
      code = wide > kMaxCode ? kMaxCode : static_cast<u32>(wide);
    } else {
      // Target subnormal: units of 2^(1-Bias-ManBits); full = 1.fman as a 24-bit integer.
      const u32 full = fman | 0x800000u;
      const u32 shift = static_cast<u32>(23 - ManBits + 1 - e);
      if (shift >= 32) {
        code = 0;
      } else {
        u32 m = full >> shift;
        const u32 rem = full & ((1u << shift) - 1);
        const u32 half = 1u << (shift - 1);
        if (rem > half || (rem == half && (m & 1))) ++m;
        code = m;  // may round up to the smallest normal, which is the next code
      }
    }
    if (Special == kFp8Fnuz && code == 0) return 0;  // FNUZ has no negative zero
    return static_cast<u8>(sign | code);
  }
};

typedef Fp8Format<4, 3, 7, kFp8Fn> Fp8E4M3Format;
typedef Fp8Format<4, 3, 8, kFp8Fnuz> Fp8E4M3FnuzFormat;
typedef Fp8Format<5, 2, 15, kFp8Ieee> Fp8E5M2Format;
typedef Fp8Format<4, 3, 15, kFp8Finite> Fp8E4M3B15Format;

MSCCLPP_DEVICE_INLINE float fp8_to_float(fp8_e4m3 x) {
#if defined(MSCCLPP_HW_FP8)
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E4M3)));
#else
  return Fp8E4M3Format::decode(x.bits);
#endif
}
MSCCLPP_DEVICE_INLINE float fp8_to_float(fp8_e5m2 x) {
#if defined(MSCCLPP_HW_FP8)
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E5M2)));
#else
  return Fp8E5M2Format::decode(x.bits);
#endif
}
MSCCLPP_DEVICE_INLINE float fp8_to_float(fp8_e4m3fnuz x) {
#if defined(MSCCLPP_HW_FP8_FNUZ)
  return mscclpp_hip::fp8_e4m3fnuz_to_float(x.bits);
#else
  return Fp8E4M3FnuzFormat::decode(x.bits);
#endif
}
MSCCLPP_DEVICE_INLINE float fp8_to_float(fp8_e4m3b15 x) { return Fp8E4M3B15Format::decode(x.bits); }

template <typename T>
MSCCLPP_DEVICE_INLINE T float_to_fp8(float x);
template <>
MSCCLPP_DEVICE_INLINE fp8_e4m3 float_to_fp8<fp8_e4m3>(float x) {
#if defined(MSCCLPP_HW_FP8)
  return fp8_e4m3{static_cast<u8>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3))};
#else
  return fp8_e4m3{Fp8E4M3Format::encode(x)};
#endif
}
template <>
MSCCLPP_DEVICE_INLINE fp8_e5m2 float_to_fp8<fp8_e5m2>(float x) {
#if defined(MSCCLPP_HW_FP8)
  return fp8_e5m2{static_cast<u8>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2))};
#else
  return fp8_e5m2{Fp8E5M2Format::encode(x)};
#endif
}
template <>
MSCCLPP_DEVICE_INLINE fp8_e4m3fnuz float_to_fp8<fp8_e4m3fnuz>(float x) {
#if defined(MSCCLPP_HW_FP8_FNUZ)
  return fp8_e4m3fnuz{mscclpp_hip::float_to_fp8_e4m3fnuz(x)};
#else
  return fp8_e4m3fnuz{Fp8E4M3FnuzFormat::encode(x)};
#endif
}
template <>
MSCCLPP_DEVICE_INLINE fp8_e4m3b15 float_to_fp8<fp8_e4m3b15>(float x) {
  return fp8_e4m3b15{Fp8E4M3B15Format::encode(x)};
}

}  // namespace mscclpp
