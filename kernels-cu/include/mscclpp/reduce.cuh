// mscclpp-rs device library: element-wise reductions for every DataType of core/src/dtype.rs.
//
//   accumulate<T, AccT, Op>(a, b)             one element: convert to AccT, reduce, convert back
//   accumulate_packed<T, AccT, Op>(wa, wb)    every lane of a 4/8/16-byte word (u32, u64, uint2, uint4)
//   VecAccumulator<T, AccT, Op, Word>         many words into one, keeping AccT precision between
//                                             steps (init, add..., finish -> Word)
//
// Op uses ncclRedOp_t numbering (kReduceSum=0, Prod=1, Max=2, Min=3, Avg=4). Avg reduces as Sum;
// VecAccumulator::finish(n) divides by n, other callers scale at the end themselves.
// AccT is T itself (MSCCL++'s default) or, for float types, __half or float (AccumType in Rust).
// Arithmetic on fp8 values happens in float and rounds back to fp8 after every operation.
#pragma once
#include "mscclpp/common.cuh"
#include "mscclpp/fp8.cuh"

#if defined(MSCCLPP_CUDA)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef __nv_bfloat16 mscclpp_bf16_t;
typedef __nv_bfloat162 mscclpp_bf16x2_t;
#else
// f16/bf16 of our own (kernels-hip): hiprtc lacks hip_fp16.h / hip_bf16.h on some ROCm versions.
#include "mscclpp_hip/half.h"
#endif

namespace mscclpp {

typedef __half f16;
typedef mscclpp_bf16_t bf16;

constexpr int kReduceSum = 0;
constexpr int kReduceProd = 1;
constexpr int kReduceMax = 2;
constexpr int kReduceMin = 3;
constexpr int kReduceAvg = 4;

template <typename A, typename B>
struct IsSame {
  static constexpr bool value = false;
};
template <typename A>
struct IsSame<A, A> {
  static constexpr bool value = true;
};

// ---------------------------------------------------------------------------------------------
// Conversions. Every float type goes through float; identical types are free; the 64-bit and
// integer types only ever convert to themselves (AccumType::resolve refuses anything else).
// ---------------------------------------------------------------------------------------------
MSCCLPP_DEVICE_INLINE float to_float(float x) { return x; }
MSCCLPP_DEVICE_INLINE float to_float(f16 x) { return __half2float(x); }
MSCCLPP_DEVICE_INLINE float to_float(bf16 x) { return __bfloat162float(x); }
MSCCLPP_DEVICE_INLINE float to_float(fp8_e4m3 x) { return fp8_to_float(x); }
MSCCLPP_DEVICE_INLINE float to_float(fp8_e4m3fnuz x) { return fp8_to_float(x); }
MSCCLPP_DEVICE_INLINE float to_float(fp8_e5m2 x) { return fp8_to_float(x); }
MSCCLPP_DEVICE_INLINE float to_float(fp8_e4m3b15 x) { return fp8_to_float(x); }

template <typename T>
struct FromFloat;
template <>
struct FromFloat<float> {
  static MSCCLPP_DEVICE_INLINE float apply(float x) { return x; }
};
template <>
struct FromFloat<f16> {
  static MSCCLPP_DEVICE_INLINE f16 apply(float x) { return __float2half_rn(x); }
};
template <>
struct FromFloat<bf16> {
  static MSCCLPP_DEVICE_INLINE bf16 apply(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct FromFloat<fp8_e4m3> {
  static MSCCLPP_DEVICE_INLINE fp8_e4m3 apply(float x) { return float_to_fp8<fp8_e4m3>(x); }
};
template <>
struct FromFloat<fp8_e4m3fnuz> {
  static MSCCLPP_DEVICE_INLINE fp8_e4m3fnuz apply(float x) { return float_to_fp8<fp8_e4m3fnuz>(x); }
};
template <>
struct FromFloat<fp8_e5m2> {
  static MSCCLPP_DEVICE_INLINE fp8_e5m2 apply(float x) { return float_to_fp8<fp8_e5m2>(x); }
};
template <>
struct FromFloat<fp8_e4m3b15> {
  static MSCCLPP_DEVICE_INLINE fp8_e4m3b15 apply(float x) { return float_to_fp8<fp8_e4m3b15>(x); }
};

template <typename To, typename From>
struct Convert {
  static MSCCLPP_DEVICE_INLINE To apply(From x) { return FromFloat<To>::apply(to_float(x)); }
};
template <typename T>
struct Convert<T, T> {
  static MSCCLPP_DEVICE_INLINE T apply(T x) { return x; }
};

template <typename To, typename From>
MSCCLPP_DEVICE_INLINE To convert(From x) {
  return Convert<To, From>::apply(x);
}

// ---------------------------------------------------------------------------------------------
// Arithmetic per accumulation type: add, mul, min, max, and division by a rank count (for Avg).
// ---------------------------------------------------------------------------------------------
template <typename T>
struct Arith {  // integers
  static MSCCLPP_DEVICE_INLINE T add(T a, T b) { return static_cast<T>(a + b); }
  static MSCCLPP_DEVICE_INLINE T mul(T a, T b) { return static_cast<T>(a * b); }
  static MSCCLPP_DEVICE_INLINE T min(T a, T b) { return b < a ? b : a; }
  static MSCCLPP_DEVICE_INLINE T max(T a, T b) { return a < b ? b : a; }
  static MSCCLPP_DEVICE_INLINE T div(T a, u32 n) { return static_cast<T>(a / static_cast<T>(n)); }
};
template <>
struct Arith<float> {
  static MSCCLPP_DEVICE_INLINE float add(float a, float b) { return a + b; }
  static MSCCLPP_DEVICE_INLINE float mul(float a, float b) { return a * b; }
  static MSCCLPP_DEVICE_INLINE float min(float a, float b) { return fminf(a, b); }
  static MSCCLPP_DEVICE_INLINE float max(float a, float b) { return fmaxf(a, b); }
  static MSCCLPP_DEVICE_INLINE float div(float a, u32 n) { return a / static_cast<float>(n); }
};
template <>
struct Arith<double> {
  static MSCCLPP_DEVICE_INLINE double add(double a, double b) { return a + b; }
  static MSCCLPP_DEVICE_INLINE double mul(double a, double b) { return a * b; }
  static MSCCLPP_DEVICE_INLINE double min(double a, double b) { return fmin(a, b); }
  static MSCCLPP_DEVICE_INLINE double max(double a, double b) { return fmax(a, b); }
  static MSCCLPP_DEVICE_INLINE double div(double a, u32 n) { return a / static_cast<double>(n); }
};
template <>
struct Arith<f16> {
  static MSCCLPP_DEVICE_INLINE f16 add(f16 a, f16 b) { return __hadd(a, b); }
  static MSCCLPP_DEVICE_INLINE f16 mul(f16 a, f16 b) { return __hmul(a, b); }
  static MSCCLPP_DEVICE_INLINE f16 min(f16 a, f16 b) { return __hmin(a, b); }
  static MSCCLPP_DEVICE_INLINE f16 max(f16 a, f16 b) { return __hmax(a, b); }
  static MSCCLPP_DEVICE_INLINE f16 div(f16 a, u32 n) {
    return __float2half_rn(__half2float(a) / static_cast<float>(n));
  }
};
template <>
struct Arith<bf16> {
  static MSCCLPP_DEVICE_INLINE bf16 add(bf16 a, bf16 b) { return __hadd(a, b); }
  static MSCCLPP_DEVICE_INLINE bf16 mul(bf16 a, bf16 b) { return __hmul(a, b); }
  static MSCCLPP_DEVICE_INLINE bf16 min(bf16 a, bf16 b) { return __hmin(a, b); }
  static MSCCLPP_DEVICE_INLINE bf16 max(bf16 a, bf16 b) { return __hmax(a, b); }
  static MSCCLPP_DEVICE_INLINE bf16 div(bf16 a, u32 n) {
    return __float2bfloat16_rn(__bfloat162float(a) / static_cast<float>(n));
  }
};
// fp8 arithmetic: in float, rounded back after each operation.
template <typename T>
struct Fp8Arith {
  static MSCCLPP_DEVICE_INLINE T add(T a, T b) { return FromFloat<T>::apply(to_float(a) + to_float(b)); }
  static MSCCLPP_DEVICE_INLINE T mul(T a, T b) { return FromFloat<T>::apply(to_float(a) * to_float(b)); }
  static MSCCLPP_DEVICE_INLINE T min(T a, T b) { return FromFloat<T>::apply(fminf(to_float(a), to_float(b))); }
  static MSCCLPP_DEVICE_INLINE T max(T a, T b) { return FromFloat<T>::apply(fmaxf(to_float(a), to_float(b))); }
  static MSCCLPP_DEVICE_INLINE T div(T a, u32 n) {
    return FromFloat<T>::apply(to_float(a) / static_cast<float>(n));
  }
};
template <>
struct Arith<fp8_e4m3> : Fp8Arith<fp8_e4m3> {};
template <>
struct Arith<fp8_e4m3fnuz> : Fp8Arith<fp8_e4m3fnuz> {};
template <>
struct Arith<fp8_e5m2> : Fp8Arith<fp8_e5m2> {};
template <>
struct Arith<fp8_e4m3b15> : Fp8Arith<fp8_e4m3b15> {};

template <int Op>
struct ReduceFn;
template <>
struct ReduceFn<kReduceSum> {
  template <typename A>
  static MSCCLPP_DEVICE_INLINE A apply(A a, A b) { return Arith<A>::add(a, b); }
};
template <>
struct ReduceFn<kReduceAvg> : ReduceFn<kReduceSum> {};
template <>
struct ReduceFn<kReduceProd> {
  template <typename A>
  static MSCCLPP_DEVICE_INLINE A apply(A a, A b) { return Arith<A>::mul(a, b); }
};
template <>
struct ReduceFn<kReduceMin> {
  template <typename A>
  static MSCCLPP_DEVICE_INLINE A apply(A a, A b) { return Arith<A>::min(a, b); }
};
template <>
struct ReduceFn<kReduceMax> {
  template <typename A>
  static MSCCLPP_DEVICE_INLINE A apply(A a, A b) { return Arith<A>::max(a, b); }
};

template <typename T, typename AccT, int Op>
MSCCLPP_DEVICE_INLINE T accumulate(T a, T b) {
  return convert<T>(ReduceFn<Op>::apply(convert<AccT>(a), convert<AccT>(b)));
}

// ---------------------------------------------------------------------------------------------
// Packed words. Lanes are addressed with compile-time indices only (fully unrolled), so they stay
// in registers.
// ---------------------------------------------------------------------------------------------
template <typename T, typename Word>
struct Lanes {
  static_assert(sizeof(Word) % sizeof(T) == 0 && sizeof(Word) >= sizeof(T),
                "word must hold a whole number of elements");
  static constexpr int kCount = sizeof(Word) / sizeof(T);
};

// Two-lane f16/bf16 operations for the AccT == T case.
template <int Op>
MSCCLPP_DEVICE_INLINE __half2 reduce_pair(__half2 a, __half2 b) {
  if (Op == kReduceProd) return __hmul2(a, b);
  if (Op == kReduceMin) return __hmin2(a, b);
  if (Op == kReduceMax) return __hmax2(a, b);
  return __hadd2(a, b);
}
template <int Op>
MSCCLPP_DEVICE_INLINE mscclpp_bf16x2_t reduce_pair(mscclpp_bf16x2_t a, mscclpp_bf16x2_t b) {
  if (Op == kReduceProd) return __hmul2(a, b);
  if (Op == kReduceMin) return __hmin2(a, b);
  if (Op == kReduceMax) return __hmax2(a, b);
  return __hadd2(a, b);
}

template <typename T>
struct PairOf {
  typedef T type;  // unused for types without a two-lane form
};
template <>
struct PairOf<f16> {
  typedef __half2 type;
};
template <>
struct PairOf<bf16> {
  typedef mscclpp_bf16x2_t type;
};

template <typename T, typename AccT, int Op, typename Word>
MSCCLPP_DEVICE_INLINE Word accumulate_packed(Word a, Word b) {
  Word out;
  if constexpr (IsSame<T, AccT>::value && (IsSame<T, f16>::value || IsSame<T, bf16>::value) &&
                sizeof(Word) >= 4) {
    typedef typename PairOf<T>::type Pair;
    constexpr int n = sizeof(Word) / sizeof(Pair);
    const Pair* pa = reinterpret_cast<const Pair*>(&a);
    const Pair* pb = reinterpret_cast<const Pair*>(&b);
    Pair* po = reinterpret_cast<Pair*>(&out);
#pragma unroll
    for (int i = 0; i < n; ++i) po[i] = reduce_pair<Op>(pa[i], pb[i]);
  } else {
    constexpr int n = Lanes<T, Word>::kCount;
    const T* ea = reinterpret_cast<const T*>(&a);
    const T* eb = reinterpret_cast<const T*>(&b);
    T* eo = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int i = 0; i < n; ++i) eo[i] = accumulate<T, AccT, Op>(ea[i], eb[i]);
  }
  return out;
}

// Reduces several words lane by lane, holding the running value in AccT.
template <typename T, typename AccT, int Op, typename Word>
struct VecAccumulator {
  static constexpr int kCount = Lanes<T, Word>::kCount;
  AccT acc[kCount];

  MSCCLPP_DEVICE_INLINE void init(Word w) {
    const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
    for (int i = 0; i < kCount; ++i) acc[i] = convert<AccT>(e[i]);
  }
  MSCCLPP_DEVICE_INLINE void add(Word w) {
    const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
    for (int i = 0; i < kCount; ++i) acc[i] = ReduceFn<Op>::apply(acc[i], convert<AccT>(e[i]));
  }
  // `nranks` is used by Avg only.
  MSCCLPP_DEVICE_INLINE Word finish(u32 nranks) const {
    Word out;
    T* e = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const AccT v = Op == kReduceAvg ? Arith<AccT>::div(acc[i], nranks) : acc[i];
      e[i] = convert<T>(v);
    }
    return out;
  }
};

// Same-type accumulation keeps the word itself, so f16/bf16 use the two-lane instructions.
template <typename T, int Op, typename Word>
struct VecAccumulator<T, T, Op, Word> {
  Word acc;
  MSCCLPP_DEVICE_INLINE void init(Word w) { acc = w; }
  MSCCLPP_DEVICE_INLINE void add(Word w) { acc = accumulate_packed<T, T, Op>(acc, w); }
  MSCCLPP_DEVICE_INLINE Word finish(u32 nranks) const {
    if (Op != kReduceAvg) return acc;
    Word out = acc;
    T* e = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int i = 0; i < Lanes<T, Word>::kCount; ++i) e[i] = Arith<T>::div(e[i], nranks);
    return out;
  }
};

}  // namespace mscclpp
