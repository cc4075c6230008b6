// mscclpp-rs HIP device library: f16 and bf16 for the shared reductions (mscclpp/reduce.cuh).
//
// hiprtc does not offer hip_fp16.h / hip_bf16.h on every ROCm version (ROCm 5 has neither), so
// the device library brings its own: f16 is the compiler's _Float16, bf16 a 16-bit word converted
// through float with round-to-nearest-even (NaN stays NaN). The names are the CUDA ones reduce.cuh
// uses, declared inside namespace mscclpp, so unqualified lookup there finds these first and they
// never clash with a runtime header that declares the same names globally.
#pragma once
#include "mscclpp/common.cuh"

namespace mscclpp {

typedef _Float16 __half;
struct alignas(4) __half2 {
  __half x, y;
};

struct alignas(2) mscclpp_bf16_t {
  u16 bits;
};
struct alignas(4) mscclpp_bf16x2_t {
  mscclpp_bf16_t x, y;
};

MSCCLPP_DEVICE_INLINE float __half2float(__half h) { return static_cast<float>(h); }
MSCCLPP_DEVICE_INLINE __half __float2half_rn(float f) { return static_cast<__half>(f); }

MSCCLPP_DEVICE_INLINE float __bfloat162float(mscclpp_bf16_t h) {
  return __uint_as_float(static_cast<u32>(h.bits) << 16);
}
MSCCLPP_DEVICE_INLINE mscclpp_bf16_t __float2bfloat16_rn(float f) {
  const u32 u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return mscclpp_bf16_t{static_cast<u16>((u >> 16) | 0x40u)};
  const u32 rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return mscclpp_bf16_t{static_cast<u16>(rounded >> 16)};
}

// Scalar arithmetic: f16 natively; bf16 in float, rounded once. min/max return the other operand
// when one is NaN, as CUDA's __hmin/__hmax do.
MSCCLPP_DEVICE_INLINE __half __hadd(__half a, __half b) { return a + b; }
MSCCLPP_DEVICE_INLINE __half __hmul(__half a, __half b) { return a * b; }
MSCCLPP_DEVICE_INLINE __half __hmin(__half a, __half b) {
  return __float2half_rn(fminf(__half2float(a), __half2float(b)));
}
MSCCLPP_DEVICE_INLINE __half __hmax(__half a, __half b) {
  return __float2half_rn(fmaxf(__half2float(a), __half2float(b)));
}
MSCCLPP_DEVICE_INLINE mscclpp_bf16_t __hadd(mscclpp_bf16_t a, mscclpp_bf16_t b) {
  return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
}
MSCCLPP_DEVICE_INLINE mscclpp_bf16_t __hmul(mscclpp_bf16_t a, mscclpp_bf16_t b) {
  return __float2bfloat16_rn(__bfloat162float(a) * __bfloat162float(b));
}
MSCCLPP_DEVICE_INLINE mscclpp_bf16_t __hmin(mscclpp_bf16_t a, mscclpp_bf16_t b) {
  return __float2bfloat16_rn(fminf(__bfloat162float(a), __bfloat162float(b)));
}
MSCCLPP_DEVICE_INLINE mscclpp_bf16_t __hmax(mscclpp_bf16_t a, mscclpp_bf16_t b) {
  return __float2bfloat16_rn(fmaxf(__bfloat162float(a), __bfloat162float(b)));
}

// Two-lane forms, lane by lane.
#define MSCCLPP_HIP_PAIR_OP(name, scalar)                                           \
  MSCCLPP_DEVICE_INLINE __half2 name(__half2 a, __half2 b) {                          \
    return __half2{scalar(a.x, b.x), scalar(a.y, b.y)};                               \
  }                                                                                   \
  MSCCLPP_DEVICE_INLINE mscclpp_bf16x2_t name(mscclpp_bf16x2_t a, mscclpp_bf16x2_t b) { \
    return mscclpp_bf16x2_t{scalar(a.x, b.x), scalar(a.y, b.y)};                      \
  }
MSCCLPP_HIP_PAIR_OP(__hadd2, __hadd)
MSCCLPP_HIP_PAIR_OP(__hmul2, __hmul)
MSCCLPP_HIP_PAIR_OP(__hmin2, __hmin)
MSCCLPP_HIP_PAIR_OP(__hmax2, __hmax)
#undef MSCCLPP_HIP_PAIR_OP

}  // namespace mscclpp
