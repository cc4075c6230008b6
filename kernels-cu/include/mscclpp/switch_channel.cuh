// mscclpp-rs device library: SwitchChannel (NVLink multicast, NVLS).
//
// Every rank binds one buffer to a multicast object; `mc_ptr` addresses the same bytes on every
// rank at once through the NVSwitch:
// - reduce<V>(offset): one `multimem.ld_reduce.relaxed.sys.global.add` = the element-wise sum of
//   the 16 bytes at `offset` over every rank's buffer, computed in the switch.
// - broadcast<V>(offset, v): one `multimem.st.relaxed.sys.global` = `v` written to `offset` of
//   every rank's buffer.
// `offset` is in bytes and a multiple of 16. Both accesses are relaxed: order them against other
// ranks with the semaphores (signal after broadcast, wait before reduce) as for any other channel.
//
// multimem.* needs sm_90 or newer (PTX ISA 8.1). For older architectures, and on HIP, the methods
// compile to a trap, so translation units that include this header still build everywhere; the
// host never creates a SwitchChannel there (Gpu::is_nvls_supported answers false).
//
// SAFETY (DESIGN.md, "Safety on shared GPUs"): the host side refuses to create the multicast object
// unless MSCCLPP_ENABLE_NVLS=1; without one, `mc_ptr` is null and nothing here may run.
// Layout is mirrored by core/src/device.rs::SwitchChannelHandle (24 bytes).
#pragma once
#include "mscclpp/common.cuh"

#if defined(MSCCLPP_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define MSCCLPP_HAS_MULTIMEM 1
#else
#define MSCCLPP_HAS_MULTIMEM 0
#endif

#if defined(MSCCLPP_CUDA)
#define MSCCLPP_MULTIMEM_TRAP() __trap()
#else
#define MSCCLPP_MULTIMEM_TRAP() __builtin_trap()
#endif

namespace mscclpp {

// The 16-byte vectors multimem reduces: four f32, or four packed pairs of f16 / bf16 (each u32
// holds two halves, low half = lower element).
struct alignas(16) f32x4 {
  float data[4];
};
struct alignas(16) f16x8 {
  u32 data[4];
};
struct alignas(16) bf16x8 {
  u32 data[4];
};

// One overload per vector type: a type without one fails to compile instead of reducing wrongly.
MSCCLPP_DEVICE_INLINE f32x4 multimem_ld_reduce_add(const f32x4* p) {
  f32x4 v;
#if MSCCLPP_HAS_MULTIMEM
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.data[0]), "=f"(v.data[1]), "=f"(v.data[2]), "=f"(v.data[3])
               : "l"(p)
               : "memory");
#else
  (void)p;
  v.data[0] = v.data[1] = v.data[2] = v.data[3] = 0.0f;
  MSCCLPP_MULTIMEM_TRAP();
#endif
  return v;
}

MSCCLPP_DEVICE_INLINE f16x8 multimem_ld_reduce_add(const f16x8* p) {
  f16x8 v;
#if MSCCLPP_HAS_MULTIMEM
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f16x2 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.data[0]), "=r"(v.data[1]), "=r"(v.data[2]), "=r"(v.data[3])
               : "l"(p)
               : "memory");
#else
  (void)p;
  v.data[0] = v.data[1] = v.data[2] = v.data[3] = 0u;
  MSCCLPP_MULTIMEM_TRAP();
#endif
  return v;
}

MSCCLPP_DEVICE_INLINE bf16x8 multimem_ld_reduce_add(const bf16x8* p) {
  bf16x8 v;
#if MSCCLPP_HAS_MULTIMEM
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.bf16x2 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.data[0]), "=r"(v.data[1]), "=r"(v.data[2]), "=r"(v.data[3])
               : "l"(p)
               : "memory");
#else
  (void)p;
  v.data[0] = v.data[1] = v.data[2] = v.data[3] = 0u;
  MSCCLPP_MULTIMEM_TRAP();
#endif
  return v;
}

MSCCLPP_DEVICE_INLINE void multimem_st(f32x4* p, const f32x4& v) {
#if MSCCLPP_HAS_MULTIMEM
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p),
               "f"(v.data[0]), "f"(v.data[1]), "f"(v.data[2]), "f"(v.data[3])
               : "memory");
#else
  (void)p;
  (void)v;
  MSCCLPP_MULTIMEM_TRAP();
#endif
}

MSCCLPP_DEVICE_INLINE void multimem_st(f16x8* p, const f16x8& v) {
#if MSCCLPP_HAS_MULTIMEM
  asm volatile("multimem.st.relaxed.sys.global.v4.f16x2 [%0], {%1, %2, %3, %4};" ::"l"(p),
               "r"(v.data[0]), "r"(v.data[1]), "r"(v.data[2]), "r"(v.data[3])
               : "memory");
#else
  (void)p;
  (void)v;
  MSCCLPP_MULTIMEM_TRAP();
#endif
}

MSCCLPP_DEVICE_INLINE void multimem_st(bf16x8* p, const bf16x8& v) {
#if MSCCLPP_HAS_MULTIMEM
  asm volatile("multimem.st.relaxed.sys.global.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(p),
               "r"(v.data[0]), "r"(v.data[1]), "r"(v.data[2]), "r"(v.data[3])
               : "memory");
#else
  (void)p;
  (void)v;
  MSCCLPP_MULTIMEM_TRAP();
#endif
}

struct SwitchChannelHandle {
  void* device_ptr;  // this rank's buffer (unicast)
  void* mc_ptr;      // the multicast address of every rank's buffer
  u64 size;          // usable bytes from both addresses

  // The sum over every rank of the 16 bytes at `offset` (V = f32x4, f16x8 or bf16x8).
  template <typename V>
  MSCCLPP_DEVICE_INLINE V reduce(u64 offset) const {
    return multimem_ld_reduce_add(reinterpret_cast<const V*>(static_cast<char*>(mc_ptr) + offset));
  }

  // Writes `value` to the 16 bytes at `offset` of every rank's buffer.
  template <typename V>
  MSCCLPP_DEVICE_INLINE void broadcast(u64 offset, const V& value) const {
    multimem_st(reinterpret_cast<V*>(static_cast<char*>(mc_ptr) + offset), value);
  }
};

}  // namespace mscclpp
