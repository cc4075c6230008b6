// mscclpp-rs device library: platform layer shared by every other header.
//
// The same sources compile with NVRTC (CUDA) and hiprtc/hipcc (HIP). Everything that differs between
// the two lives here: inline/attribute macros, fixed-width integer names (NVRTC has no <cstdint>),
// and atomics with an explicit memory order and scope. On CUDA the atomics are inline PTX so the
// order is exactly what the ABI document says (no reliance on libcu++ being available to NVRTC); on
// HIP they are the __hip_atomic builtins, which take the same order/scope pair.
#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC_RTC__) || defined(__HIP__)
#define MSCCLPP_HIP 1
#include "mscclpp_hip/wave64.h"  // MSCCLPP_WARP_SIZE: 64 on CDNA (kernels-hip)
#else
#define MSCCLPP_CUDA 1
#define MSCCLPP_WARP_SIZE 32
#endif

#define MSCCLPP_DEVICE_INLINE __device__ __forceinline__
#define MSCCLPP_HOST_DEVICE_INLINE __host__ __device__ __forceinline__

// NVRTC has no <cstddef>; the layout static_asserts generated from Rust use offsetof.
#ifndef offsetof
#define offsetof(type, field) __builtin_offsetof(type, field)
#endif

namespace mscclpp {

typedef signed char i8;
typedef unsigned char u8;
typedef short i16;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

static_assert(sizeof(u8) == 1 && sizeof(u16) == 2 && sizeof(u32) == 4 && sizeof(u64) == 8,
              "mscclpp: unexpected fundamental type sizes");
static_assert(sizeof(void*) == 8, "mscclpp: device handles assume 64-bit pointers");

// ---------------------------------------------------------------------------------------------
// Atomics. Naming: atomic_<op>_<order>_<scope>. `sys` scope is what cross-GPU (NVLink/PCIe) and
// host-mapped words need; `gpu` scope is enough for words only this GPU touches.
// ---------------------------------------------------------------------------------------------
#if defined(MSCCLPP_CUDA)

MSCCLPP_DEVICE_INLINE u64 atomic_load_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MSCCLPP_DEVICE_INLINE u64 atomic_load_relaxed_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MSCCLPP_DEVICE_INLINE u32 atomic_load_acquire_sys(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MSCCLPP_DEVICE_INLINE u32 atomic_load_relaxed_sys(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MSCCLPP_DEVICE_INLINE void atomic_store_release_sys(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MSCCLPP_DEVICE_INLINE void atomic_store_relaxed_sys(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// p[0] = lo, p[1] = hi (p 16-byte aligned) as ONE 16-byte store, after every earlier access of
// this thread: a single transaction, which host memory receives whole, so a reader that sees `hi`
// sees `lo` too, without a fence between the halves that would wait for `lo` to cross PCIe.
MSCCLPP_DEVICE_INLINE void store_pair_release_sys(u64* p, u64 lo, u64 hi) {
  asm volatile("st.release.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(lo), "l"(hi) : "memory");
}
// Fire-and-forget adds (`red`): the caller never needs the old value, and `red` does not wait for
// the round trip over NVLink that `atom` would.
MSCCLPP_DEVICE_INLINE void atomic_add_release_sys(u64* p, u64 v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MSCCLPP_DEVICE_INLINE void atomic_add_relaxed_sys(u64* p, u64 v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MSCCLPP_DEVICE_INLINE u64 atomic_fetch_add_relaxed_gpu(u64* p, u64 v) {
  u64 old;
  asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}
MSCCLPP_DEVICE_INLINE u64 atomic_load_acquire_gpu(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MSCCLPP_DEVICE_INLINE void atomic_max_release_gpu(u64* p, u64 v) {
  asm volatile("red.release.gpu.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MSCCLPP_DEVICE_INLINE u32 atomic_cas_relaxed_sys(u32* p, u32 expected, u32 desired) {
  u32 old;
  asm volatile("atom.relaxed.sys.global.cas.b32 %0, [%1], %2, %3;"
               : "=r"(old)
               : "l"(p), "r"(expected), "r"(desired)
               : "memory");
  return old;
}
// Orders every earlier memory access of this thread before every later one, for all observers
// (peer GPUs, the host proxy).
MSCCLPP_DEVICE_INLINE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

#else  // MSCCLPP_HIP

MSCCLPP_DEVICE_INLINE u64 atomic_load_acquire_sys(const u64* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
MSCCLPP_DEVICE_INLINE u64 atomic_load_relaxed_sys(const u64* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
MSCCLPP_DEVICE_INLINE u32 atomic_load_acquire_sys(const u32* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
MSCCLPP_DEVICE_INLINE u32 atomic_load_relaxed_sys(const u32* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
MSCCLPP_DEVICE_INLINE void atomic_store_release_sys(u64* p, u64 v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
MSCCLPP_DEVICE_INLINE void atomic_store_relaxed_sys(u64* p, u64 v) {
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// HIP has no 16-byte atomic store: `lo`, then `hi` with release ordering (so a reader that sees
// `hi` sees `lo`).
MSCCLPP_DEVICE_INLINE void store_pair_release_sys(u64* p, u64 lo, u64 hi) {
  atomic_store_relaxed_sys(p, lo);
  atomic_store_release_sys(p + 1, hi);
}
MSCCLPP_DEVICE_INLINE void atomic_add_release_sys(u64* p, u64 v) {
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
MSCCLPP_DEVICE_INLINE void atomic_add_relaxed_sys(u64* p, u64 v) {
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
MSCCLPP_DEVICE_INLINE u64 atomic_fetch_add_relaxed_gpu(u64* p, u64 v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
MSCCLPP_DEVICE_INLINE u64 atomic_load_acquire_gpu(const u64* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
MSCCLPP_DEVICE_INLINE void atomic_max_release_gpu(u64* p, u64 v) {
  __hip_atomic_fetch_max(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
MSCCLPP_DEVICE_INLINE u32 atomic_cas_relaxed_sys(u32* p, u32 expected, u32 desired) {
  __hip_atomic_compare_exchange_strong(p, &expected, desired, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       __HIP_MEMORY_SCOPE_SYSTEM);
  return expected;  // on failure the builtin stores the observed value here; on success it is unchanged
}
MSCCLPP_DEVICE_INLINE void fence_acq_rel_sys() {
  __atomic_thread_fence(__ATOMIC_ACQ_REL);  // HIP: system scope is the default for this builtin
}

#endif

// Spin bound used when a handle's `max_spin` is 0 (see docs/device-abi.md).
constexpr u64 kDefaultMaxSpin = 1ull << 32;

MSCCLPP_DEVICE_INLINE u64 effective_max_spin(u64 max_spin) {
  return max_spin == 0 ? kDefaultMaxSpin : max_spin;
}

// Grid-wide linear thread index and thread count, for cooperative copies spread over a whole grid.
MSCCLPP_DEVICE_INLINE u32 global_thread_id() { return blockIdx.x * blockDim.x + threadIdx.x; }
MSCCLPP_DEVICE_INLINE u32 global_num_threads() { return gridDim.x * blockDim.x; }

// First statement of every native collective kernel and of the plan interpreter. With
// programmatic dependent launch (sm_90+) this grid may start while the stream's previous grid still
// runs: griddepcontrol.wait returns once that grid has completed and its memory operations are
// visible, so nothing below reads an input or overwrites a buffer early. Launched normally, the wait returns at once. launch_dependents then lets
// the stream's next programmatic kernel start its own launch; it waits in turn, and since every block
// of this grid is resident by the time all have signalled, its blocks can never keep ours from
// being scheduled (the co-residency the peer waits rely on).
MSCCLPP_DEVICE_INLINE void wait_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace mscclpp
