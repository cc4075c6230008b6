// The benchmark's inputs and checks on the device (mscclpp-bench; host side in
// kernels-cu/src/bench_data.rs and bench/src/collective/device_data.rs).
//
// Element i of rank r's input is a pure function of (seed, r, i), the generator of
// bench/src/collective/data.rs, reproduced here operation for operation (every rounding an
// explicit _rn intrinsic, so no contraction can change a value): a kernel writes a rank's input
// where the host would have uploaded it, and another checks an output against the reference
// without copying it back. A check counts the wrong elements and keeps the lowest wrong index;
// the host describes a mismatch from its own check of that output, so the text is the one the
// host check gives.
//
// Modes:
//   FILL            data[i] = element(rank, base + i)
//   CHECK_COPY      data[i] == element(rank, base + i), bit for bit
//   CHECK_BLOCKS    data[i] == element(i / block, base + i % block), bit for bit
//   CHECK_REDUCE    data[i] within the tolerance of op over element(r, base + i), r < nranks
//                   (integers exact, wrapped to the type's width after every step; float
//                   products stay on the host, since their inputs are drawn through exp2)
#include "mscclpp/common.cuh"

#if !defined(MSCCLPP_HIP)
#include <cuda_fp16.h>
#endif

using namespace mscclpp;

#define BENCH_MAX_RANKS 64

enum BenchDtype : u32 {
  kF32 = 0, kF64 = 1, kF16 = 2, kBf16 = 3, kI8 = 4, kU8 = 5, kI32 = 6, kU32 = 7, kI64 = 8, kU64 = 9
};
enum BenchDraw : u32 { kDrawFloat = 0, kDrawInt = 1 };
enum BenchMode : u32 { kFill = 0, kCheckCopy = 1, kCheckBlocks = 2, kCheckReduce = 3 };
// NCCL's numbering, as ReduceOp::to_nccl gives it.
enum BenchOp : u32 { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4 };

struct BenchDataArgs {
  u64 data;
  u64 count;
  u64 wrong;  // device u64: wrong elements, added to
  u64 first;  // device u64: the lowest wrong index, lowered to
  u64 keys[BENCH_MAX_RANKS];
  double scale;  // kDrawFloat: values scale * t, t uniform in [-1, 1)
  double u;      // unit roundoff of the type
  double s;      // smallest subnormal of the type
  i64 lo;        // kDrawInt: values lo + (bits % span)
  u64 span;
  u64 block;
  u64 base;
  u32 dtype;
  u32 draw;
  u32 mode;
  u32 op;
  u32 nranks;
  u32 rank;
};

// f16: the 16 bits of float f rounded to nearest even, and the float of 16 bits. HIP's is the
// compiler's _Float16 (hiprtc's runtime header declares its own __half besides the device
// library's, so the CUDA names would be ambiguous there).
MSCCLPP_DEVICE_INLINE u16 bench_f16_bits(float f) {
#if defined(MSCCLPP_HIP)
  _Float16 h = static_cast<_Float16>(f);
  u16 bits;
  __builtin_memcpy(&bits, &h, sizeof bits);
  return bits;
#else
  return __half_as_ushort(__float2half_rn(f));
#endif
}

MSCCLPP_DEVICE_INLINE float bench_f16_float(u16 bits) {
#if defined(MSCCLPP_HIP)
  _Float16 h;
  __builtin_memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
#else
  return __half2float(__ushort_as_half(bits));
#endif
}

MSCCLPP_DEVICE_INLINE u64 bench_mix(u64 z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

MSCCLPP_DEVICE_INLINE u32 bench_size(u32 dtype) {
  switch (dtype) {
    case kF64: case kI64: case kU64: return 8;
    case kF32: case kI32: case kU32: return 4;
    case kF16: case kBf16: return 2;
    default: return 1;
  }
}

MSCCLPP_DEVICE_INLINE u64 bench_width_mask(u32 dtype) {
  u32 bits = 8 * bench_size(dtype);
  return bits == 64 ? ~0ull : (1ull << bits) - 1;
}

// An integer of the type, sign-extended (signed types) or zero-extended from its width.
MSCCLPP_DEVICE_INLINE i64 bench_wrap(u32 dtype, i64 v) {
  switch (dtype) {
    case kI8: return (i64)(i8)v;
    case kU8: return (i64)(u8)v;
    case kI32: return (i64)(i32)v;
    case kU32: return (i64)(u32)v;
    default: return v;  // 64-bit: two's complement wrapping, as the host's cast does
  }
}

// The encoding (low bytes of the word) and exact value of float v rounded to the type, as
// data.rs's encode_word then float_of_word give them.
MSCCLPP_DEVICE_INLINE u64 bench_encode_float(u32 dtype, double v, double* value) {
  switch (dtype) {
    case kF64:
      *value = v;
      return (u64)__double_as_longlong(v);
    case kF16: {
      u16 bits = bench_f16_bits(__double2float_rn(v));
      *value = (double)bench_f16_float(bits);
      return (u64)bits;
    }
    case kBf16: {
      u32 x = __float_as_uint(__double2float_rn(v));
      u32 b = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
      *value = (double)__uint_as_float(b << 16);
      return (u64)b;
    }
    default: {
      float f = __double2float_rn(v);
      *value = (double)f;
      return (u64)__float_as_uint(f);
    }
  }
}

// Rank `rank`'s element `index`: its encoding, and its value (floats) or integer (ints).
MSCCLPP_DEVICE_INLINE u64 bench_element(const BenchDataArgs& a, u32 rank, u64 index, double* value,
                                        i64* integer) {
  u64 r = bench_mix(a.keys[rank] ^ bench_mix(index));
  if (a.draw == kDrawInt) {
    i64 v = a.lo + (i64)(r % a.span);
    *integer = v;
    *value = (double)v;
    return (u64)v & bench_width_mask(a.dtype);
  }
  double t = __dadd_rn(__dmul_rn(2.0, __ddiv_rn((double)(r >> 11), 9007199254740992.0)), -1.0);
  *integer = 0;
  return bench_encode_float(a.dtype, __dmul_rn(a.scale, t), value);
}

MSCCLPP_DEVICE_INLINE u64 bench_load(u32 dtype, const u8* data, u64 i) {
  switch (bench_size(dtype)) {
    case 8: return reinterpret_cast<const u64*>(data)[i];
    case 4: return reinterpret_cast<const u32*>(data)[i];
    case 2: return reinterpret_cast<const u16*>(data)[i];
    default: return data[i];
  }
}

MSCCLPP_DEVICE_INLINE void bench_store(u32 dtype, u8* data, u64 i, u64 bits) {
  switch (bench_size(dtype)) {
    case 8: reinterpret_cast<u64*>(data)[i] = bits; break;
    case 4: reinterpret_cast<u32*>(data)[i] = (u32)bits; break;
    case 2: reinterpret_cast<u16*>(data)[i] = (u16)bits; break;
    default: data[i] = (u8)bits; break;
  }
}

MSCCLPP_DEVICE_INLINE double bench_decode_float(u32 dtype, u64 bits) {
  switch (dtype) {
    case kF64: return __longlong_as_double((long long)bits);
    case kF16: return (double)bench_f16_float((u16)bits);
    case kBf16: return (double)__uint_as_float((u32)bits << 16);
    default: return (double)__uint_as_float((u32)bits);
  }
}

MSCCLPP_DEVICE_INLINE bool bench_is_float(u32 dtype) { return dtype <= kBf16; }

// Whether output bits `got` at index i (source index base + i) are right for a reduction.
MSCCLPP_DEVICE_INLINE bool bench_reduce_ok(const BenchDataArgs& a, u64 index, u64 got) {
  double value;
  i64 integer;
  if (bench_is_float(a.dtype)) {
    // Products of floats are drawn through exp2, which the device would not round as the host
    // does: the host checks those (device_data.rs).
    double sum = 0.0, abs_sum = 0.0, lo = __longlong_as_double(0x7ff0000000000000ll), hi = -lo;
    for (u32 r = 0; r < a.nranks; ++r) {
      bench_element(a, r, index, &value, &integer);
      sum = __dadd_rn(sum, value);
      abs_sum = __dadd_rn(abs_sum, fabs(value));
      lo = fmin(lo, value);
      hi = fmax(hi, value);
    }
    double n = (double)a.nranks, want, tol;
    switch (a.op) {
      case kMax: want = hi; tol = 0.0; break;
      case kMin: want = lo; tol = 0.0; break;
      case kAvg:
        want = __ddiv_rn(sum, n);
        tol = __dadd_rn(__ddiv_rn(__dmul_rn(__dmul_rn(__dadd_rn(n, 1.0), a.u), abs_sum), n),
                        __dmul_rn(n, a.s));
        break;
      default:
        want = sum;
        tol = __dadd_rn(__dmul_rn(__dmul_rn(n, a.u), abs_sum), __dmul_rn(n, a.s));
        break;
    }
    // False for NaN, which is always wrong.
    return fabs(__dadd_rn(bench_decode_float(a.dtype, got), -want)) <= tol;
  }
  i64 acc = a.op == kProd ? 1 : 0, lo = 0, hi = 0;
  for (u32 r = 0; r < a.nranks; ++r) {
    bench_element(a, r, index, &value, &integer);
    if (r == 0 || integer < lo) lo = integer;
    if (r == 0 || integer > hi) hi = integer;
    acc = a.op == kProd ? bench_wrap(a.dtype, (i64)((u64)acc * (u64)integer))
                        : bench_wrap(a.dtype, (i64)((u64)acc + (u64)integer));
  }
  i64 want;
  switch (a.op) {
    case kMax: want = hi; break;
    case kMin: want = lo; break;
    case kAvg:
      want = a.dtype == kU64 ? (i64)((u64)acc / (u64)a.nranks)
                             : bench_wrap(a.dtype, acc / (i64)a.nranks);
      break;
    default: want = acc; break;
  }
  return ((u64)want & bench_width_mask(a.dtype)) == got;
}

extern "C" __global__ void bench_data(BenchDataArgs a) {
  u8* data = reinterpret_cast<u8*>(a.data);
  u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < a.count; i += stride) {
    double value;
    i64 integer;
    if (a.mode == kFill) {
      bench_store(a.dtype, data, i, bench_element(a, a.rank, a.base + i, &value, &integer));
      continue;
    }
    u64 got = bench_load(a.dtype, data, i);
    bool ok;
    switch (a.mode) {
      case kCheckCopy: ok = got == bench_element(a, a.rank, a.base + i, &value, &integer); break;
      case kCheckBlocks:
        ok = got == bench_element(a, (u32)(i / a.block), a.base + i % a.block, &value, &integer);
        break;
      default: ok = bench_reduce_ok(a, a.base + i, got); break;
    }
    if (!ok) {
      atomicAdd(reinterpret_cast<unsigned long long*>(a.wrong), 1ull);
      atomicMin(reinterpret_cast<unsigned long long*>(a.first), (unsigned long long)i);
    }
  }
}
