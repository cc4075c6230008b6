// mscclpp-rs HIP device library: AMD FNUZ fp8 (e4m3fnuz, e5m2fnuz) <-> float.
//
//   e4m3fnuz: bias 8, max 240;   e5m2fnuz: bias 16, max 57344.
//   Both: no infinities, no negative zero, a single NaN = 0x80.
//
// To fp8: round to nearest even, saturating (|x| > max and +-inf give +-max), NaN gives 0x80 --
// the same results as core/src/fp8.rs, which tests use as the host reference. On gfx942 the
// hardware converts (v_cvt_f32_fp8 / v_cvt_pk_fp8_f32, which are FNUZ on that target); the
// hardware does not saturate, so inputs are clamped first, after NaN is handled (fmin/fmax would
// turn NaN into a number). Elsewhere the portable software path below is used.
#pragma once

#if !defined(MSCCLPP_HIP_DEVICE)
#define MSCCLPP_HIP_DEVICE __device__ __forceinline__
#endif

namespace mscclpp_hip {

// Software conversion for a FNUZ format with ExpBits/ManBits and Bias.
template <int ExpBits, int ManBits, int Bias>
struct FnuzSoft {
  static constexpr unsigned kManMask = (1u << ManBits) - 1;

  static MSCCLPP_HIP_DEVICE float decode(unsigned char c) {
    if (c == 0x80) return __builtin_nanf("");
    const unsigned mag = c & 0x7Fu;
    const unsigned e = mag >> ManBits;
    const unsigned m = mag & kManMask;
    float v;
    if (e == 0) {
      v = static_cast<float>(m) * __builtin_ldexpf(1.0f, 1 - Bias - ManBits);
    } else {
      v = static_cast<float>((1u << ManBits) + m) *
          __builtin_ldexpf(1.0f, static_cast<int>(e) - Bias - ManBits);
    }
    return (c & 0x80) ? -v : v;
  }

  static MSCCLPP_HIP_DEVICE unsigned char encode(float x) {
    unsigned bits;
    __builtin_memcpy(&bits, &x, 4);
    const unsigned sign = (bits >> 24) & 0x80u;
    const unsigned fexp = (bits >> 23) & 0xFFu;
    const unsigned fman = bits & 0x7FFFFFu;
    if (fexp == 0xFF && fman != 0) return 0x80;           // NaN
    if (fexp == 0xFF) return static_cast<unsigned char>(sign | 0x7F);  // +-inf saturates
    if (fexp == 0) return 0;                               // zero / float subnormal: no -0
    const int e = static_cast<int>(fexp) - 127 + Bias;     // target biased exponent
    // Round 1.fman (24-bit integer) to the target's spacing: normal targets keep ManBits bits,
    // subnormal ones fewer. `shift` is how many low bits go.
    const unsigned full = fman | 0x800000u;
    const int shift = (e >= 1 ? 0 : 1 - e) + 23 - ManBits;
    unsigned code;
    if (shift >= 32) {
      code = 0;
    } else {
      unsigned q = full >> shift;
      const unsigned rem = full & ((1u << shift) - 1);
      const unsigned half = 1u << (shift - 1);
      if (rem > half || (rem == half && (q & 1))) ++q;
      // Normal: exponent field plus mantissa (the implicit bit cancels against (e-1)<<ManBits);
      // a mantissa carry moves into the exponent by plain addition. Subnormal: q steps.
      const unsigned long long wide =
          e >= 1 ? (static_cast<unsigned long long>(e - 1) << ManBits) + q : q;
      code = wide > 0x7Fu ? 0x7Fu : static_cast<unsigned>(wide);
    }
    if (code == 0) return 0;
    return static_cast<unsigned char>(sign | code);
  }
};

typedef FnuzSoft<4, 3, 8> E4M3FnuzSoft;
typedef FnuzSoft<5, 2, 16> E5M2FnuzSoft;

MSCCLPP_HIP_DEVICE float fp8_e4m3fnuz_to_float(unsigned char c) {
#if defined(__gfx942__)
  return __builtin_amdgcn_cvt_f32_fp8(static_cast<int>(c), 0);
#else
  return E4M3FnuzSoft::decode(c);
#endif
}

MSCCLPP_HIP_DEVICE float fp8_e5m2fnuz_to_float(unsigned char c) {
#if defined(__gfx942__)
  return __builtin_amdgcn_cvt_f32_bf8(static_cast<int>(c), 0);
#else
  return E5M2FnuzSoft::decode(c);
#endif
}

MSCCLPP_HIP_DEVICE unsigned char float_to_fp8_e4m3fnuz(float x) {
#if defined(__gfx942__)
  if (x != x) return 0x80;
  x = __builtin_fminf(__builtin_fmaxf(x, -240.0f), 240.0f);
  return static_cast<unsigned char>(__builtin_amdgcn_cvt_pk_fp8_f32(x, x, 0, false) & 0xFF);
#else
  return E4M3FnuzSoft::encode(x);
#endif
}

MSCCLPP_HIP_DEVICE unsigned char float_to_fp8_e5m2fnuz(float x) {
#if defined(__gfx942__)
  if (x != x) return 0x80;
  x = __builtin_fminf(__builtin_fmaxf(x, -57344.0f), 57344.0f);
  return static_cast<unsigned char>(__builtin_amdgcn_cvt_pk_bf8_f32(x, x, 0, false) & 0xFF);
#else
  return E5M2FnuzSoft::encode(x);
#endif
}

}  // namespace mscclpp_hip
