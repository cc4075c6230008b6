// mscclpp-rs device library: the device error word.
//
// Device code never hangs and never traps: a bounded wait that gives up records a code in a
// host-mapped u32 (first error wins) and returns false. The host reads the word after synchronising
// and turns a non-zero value into Error::DeviceTimeout. The codes are mirrored in core/src/device.rs.
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

// Bounded spin helper: calls `ready()` until it returns true or `max_spin` iterations passed; on
// timeout records `code` in `error_word` and returns false. One implementation for every wait in
// the library so the timeout policy lives in one place.
template <typename Ready>
MSCCLPP_DEVICE_INLINE bool spin_until(Ready ready, u64 max_spin, u32* error_word, u32 code) {
  const u64 limit = effective_max_spin(max_spin);
  for (u64 spin = 0; spin < limit; ++spin) {
    if (ready()) return true;
  }
  // One last look: the condition may have become true during the final iteration.
  if (ready()) return true;
  record_error(error_word, code);
  return false;
}

}  // namespace mscclpp
