// mscclpp-rs device library: the device error page and word.
//
// Device code never hangs and never traps: a bounded wait that gives up records a code (first
// error wins) in the communicator's error page (device memory) and in its host-mapped error word,
// and returns false. Both are sticky: nothing clears them, so once a communicator failed every
// later wait and kernel of it returns at once, and every later host call on it reports the error.
// The host reads its word with one load (no stream sync) and turns a non-zero value into
// Error::DeviceTimeout / Error::Aborted; an abort from the host reaches the page through the waits
// (host_aborted). The codes are mirrored in core/src/device.rs.
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

// The error page a kernel gets as `error_word`: 16 bytes of device memory (in the communicator's
// semaphore slab) holding the code as this device knows it (u32 at 0), the wait budget in
// milliseconds the host wrote at setup (u32 at 4; MSCCLPP_DEVICE_WAIT_TIMEOUT, 0 = no time budget,
// only the spin bound), and the device address of the host-mapped word the host reads and aborts
// through (u64 at 8; null for a page that lives in host memory itself, as some tests' do). Layout
// mirrored in core/src/device.rs.
//
// Why two words: a GPU read of host memory is a PCIe round trip, and on virtualised machines many
// of them behave as if serialised across the whole GPU (inferred from timings, not profiled):
// reading the host word at every kernel's entry and every 256 polls of every wait made
// all-reduces many times slower there. So kernels read
// the page (device memory) at entry and while they wait, and a wait reads the host word only
// after it has waited kHostLookIntervalNs, copying an abort it finds into the page for every
// later kernel.
MSCCLPP_DEVICE_INLINE u32* host_error_word(const u32* page) {
  return reinterpret_cast<u32*>(*reinterpret_cast<const volatile u64*>(page + 2));
}

// Records `code` unless an earlier error is already recorded, in the page and in the host word.
// `word` may be null (no reporting).
MSCCLPP_DEVICE_INLINE void record_error(u32* word, u32 code) {
  if (word != nullptr) {
    atomic_cas_relaxed_sys(word, kErrorNone, code);
    u32* host = host_error_word(word);
    if (host != nullptr) atomic_cas_relaxed_sys(host, kErrorNone, code);
  }
}

// True once the communicator's error page holds any error (a timed-out wait, an abort a wait
// brought in from the host word, a dead peer): kernels return at entry and waits give up, so a
// queue of launches behind a failure drains at once instead of each kernel spinning out its own
// timeout. One read of device memory. `word` may be null (never aborted).
MSCCLPP_DEVICE_INLINE bool aborted(const u32* word) {
  return word != nullptr && atomic_load_acquire_sys(word) != kErrorNone;
}

// aborted() as a kernel's entry reads it: a relaxed load, because nothing the kernel reads depends
// on it (an acquire would hold every later read of the thread back until it completed, and the
// entry's other reads go out beside it: collective_common.cuh's block_enter).
MSCCLPP_DEVICE_INLINE bool aborted_at_entry(const u32* word) {
  return word != nullptr && atomic_load_relaxed_sys(word) != kErrorNone;
}

// The check at a kernel's entry, where every thread of the block calls it: thread 0 alone reads the
// page and the block shares the answer.
MSCCLPP_DEVICE_INLINE bool block_aborted(const u32* word) {
  return __syncthreads_or(threadIdx.x == 0 && aborted_at_entry(word)) != 0;
}

// Whether the host aborted the communicator (ncclCommAbort, a dead or stalled peer): one read of
// host memory. An abort found there is copied into the page, so later kernels stop at entry.
MSCCLPP_DEVICE_INLINE bool host_aborted(u32* word) {
  if (word == nullptr) return false;
  const u32* host = host_error_word(word);
  if (host == nullptr) return false;
  const u32 code = atomic_load_acquire_sys(host);
  if (code == kErrorNone) return false;
  atomic_cas_relaxed_sys(word, kErrorNone, code);
  return true;
}

MSCCLPP_DEVICE_INLINE u32 wait_budget_ms(const u32* word) {
  return word == nullptr ? 0u : *reinterpret_cast<const volatile u32*>(word + 1);
}

// A wait looks at the error page and the clock once per this many unsuccessful polls: cheap
// device reads, but every 256 polls keeps them under 1% of a wait that succeeds after a few polls.
constexpr u64 kWaitCheckInterval = 256;
// A wait reads the host word once it has waited this long, and again each time this passes: the
// waits of a healthy collective end well before, so they never cross PCIe, and an abort from the
// host still ends every wait within about a millisecond.
constexpr u64 kHostLookIntervalNs = 1000000;

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
  u64 host_looked = start;
  for (u64 spin = 1; spin < limit; ++spin) {
    if (ready()) return true;
    if (spin % kWaitCheckInterval == 0) {
      if (aborted(error_word)) return false;
      if (budget_ns == 0) budget_ns = static_cast<u64>(wait_budget_ms(error_word)) * 1000000ull;
      const u64 now = wall_clock_ns();
      if (now - host_looked >= kHostLookIntervalNs) {
        host_looked = now;
        if (host_aborted(error_word)) return false;
      }
      if (budget_ns != 0 && now - start > budget_ns) break;
    }
  }
  // One last look: the condition may have become true during the final iteration.
  if (ready()) return true;
  record_error(error_word, code);
  return false;
}

}  // namespace mscclpp
