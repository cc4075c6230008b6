// mscclpp-rs device library: the device error word.
//
// Device code never hangs and never traps: a bounded wait that gives up records a code in a
// host-mapped u32 (first error wins) and returns false. The word is sticky: the host never clears
// it, so once a communicator failed every later wait and kernel of it returns at once, and every
// later host call on it reports the error. The host reads it with one load (no stream sync) and
// turns a non-zero value into Error::DeviceTimeout / Error::Aborted. The codes are mirrored in
// core/src/device.rs.
#pragma once
#include "mscclpp/common.cuh"

namespace mscclpp {

constexpr u32 kErrorNone = 0;
constexpr u32 kErrorSemaphoreWaitTimeout = 1;
constexpr u32 kErrorPacketReadTimeout = 2;
constexpr u32 kErrorFifoPushTimeout = 3;
constexpr u32 kErrorFifoFlushTimeout = 4;
// A PortChannel request that cannot be encoded in a ProxyTrigger (offset >= 2^32).
constexpr u32 kErrorTriggerOverflow = 5;
// The communicator was aborted (by the host, a dead peer, or a wait that timed out elsewhere).
constexpr u32 kErrorAborted = 6;
// An all-to-all sender and receiver disagree on the bytes between them (alltoall.cu).
constexpr u32 kErrorCountMismatch = 7;

// Records `code` unless an earlier error is already recorded. `word` may be null (no reporting).
MSCCLPP_DEVICE_INLINE void record_error(u32* word, u32 code) {
  if (word != nullptr) {
    atomic_cas_relaxed_sys(word, kErrorNone, code);
  }
}

// True once the communicator's error word holds any error (a timed-out wait, an abort, a dead
// peer): kernels return at entry and waits give up, so a queue of launches behind a failure drains
// at once instead of each kernel spinning out its own timeout. `word` may be null (never aborted).
MSCCLPP_DEVICE_INLINE bool aborted(const u32* word) {
  return word != nullptr && atomic_load_acquire_sys(word) != kErrorNone;
}

// aborted() at a kernel's entry, where every thread of the block calls it: thread 0 alone reads the
// word and the block shares the answer. The word is host memory: every warp reading it made 4,224
// PCIe reads of one address per launch of a 132-block, 1024-thread grid, and a queue of CUDA-graph
// replays (20 kernels each) behind a failure took 13 s to drain with 4 ranks on one H100, 15 times
// the eager queue's time, which fits a per-launch cost of that size (inferred, not profiled).
MSCCLPP_DEVICE_INLINE bool block_aborted(const u32* word) {
  return __syncthreads_or(threadIdx.x == 0 && aborted(word)) != 0;
}

// The error word's page: the host allocates 8 bytes, `word[0]` is the error code above and
// `word[1]` the wait budget in milliseconds the host wrote at setup (MSCCLPP_DEVICE_WAIT_TIMEOUT;
// 0 = no time budget, only the spin bound). Layout mirrored in core/src/device.rs.
MSCCLPP_DEVICE_INLINE u32 wait_budget_ms(const u32* word) {
  return word == nullptr ? 0u : *reinterpret_cast<const volatile u32*>(word + 1);
}

// A wait looks at the error word and the clock once per this many unsuccessful polls: a read of
// host-mapped memory costs a PCIe round trip (about 1 us), so checking every poll would slow the
// waits that succeed after a few polls, while every 256 polls costs under 1% and still notices an
// abort within microseconds.
constexpr u64 kWaitCheckInterval = 256;

// Nanoseconds of a clock that runs at a fixed rate whatever the SM clock does.
MSCCLPP_DEVICE_INLINE u64 wall_clock_ns() {
#if defined(MSCCLPP_CUDA)
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  // gfx9 (MI200/MI300): s_memrealtime counts at a constant 100 MHz.
  return __builtin_amdgcn_s_memrealtime() * 10ull;
#endif
}

// Bounded wait: calls `ready()` until it returns true. Gives up and returns false when
//  - the error word already holds an error (an abort, a dead peer, a wait that timed out in an
//    earlier kernel): nothing is recorded, the first error stays;
//  - the time budget in the error word's page passed (wall clock, so time-slicing and MPS sharing
//    count as they do for the host), or `max_spin` polls passed: `code` is recorded.
// The first poll is made before anything else, so a wait that is already satisfied costs one load.
// One implementation for every wait in the library so the timeout policy lives in one place.
template <typename Ready>
MSCCLPP_DEVICE_INLINE bool spin_until(Ready ready, u64 max_spin, u32* error_word, u32 code) {
  if (ready()) return true;
  const u64 limit = effective_max_spin(max_spin);
  const u64 start = wall_clock_ns();
  u64 budget_ns = 0;  // read on the first check, off the fast path
  for (u64 spin = 1; spin < limit; ++spin) {
    if (ready()) return true;
    if (spin % kWaitCheckInterval == 0) {
      if (aborted(error_word)) return false;
      if (budget_ns == 0) budget_ns = static_cast<u64>(wait_budget_ms(error_word)) * 1000000ull;
      if (budget_ns != 0 && wall_clock_ns() - start > budget_ns) break;
    }
  }
  // One last look: the condition may have become true during the final iteration.
  if (ready()) return true;
  record_error(error_word, code);
  return false;
}

}  // namespace mscclpp
