// mscclpp-rs device library: semaphores (monotonic 64-bit counters).
//
// A semaphore is a counter the *signaller* increments and the *waiter* compares against its own
// private expectation. Counters only grow, so nothing is ever reset between uses and a signal that
// arrives before its wait is never lost.
//
// Both handles are used by ONE thread at a time (typically thread 0 of a block after a
// __syncthreads): `expected` is a plain local counter, not an atomic.
#pragma once
#include "mscclpp/common.cuh"
#include "mscclpp/error.cuh"

namespace mscclpp {

// Device-to-device semaphore: both sides are GPU threads (peers over NVLink/PCIe P2P).
// Layout is mirrored by core/src/device.rs::D2DSemaphoreHandle (40 bytes).
struct D2DSemaphoreHandle {
  u64* inbound;         // local; the peer adds to it
  u64* expected;        // local device memory; only this rank touches it
  u64* remote_inbound;  // the peer's `inbound`, mapped into this process
  u32* error_word;      // host-mapped DeviceErrorWord (may be null)
  u64 max_spin;         // spin bound in iterations; 0 = kDefaultMaxSpin

  // Publishes every write this thread has made (and, by cumulativity, every write it observed,
  // e.g. through a preceding __syncthreads) before the peer can see the increment.
  MSCCLPP_DEVICE_INLINE void signal() const { atomic_add_release_sys(remote_inbound, 1); }

  // Increment without ordering: for pure rendezvous where no data is published.
  MSCCLPP_DEVICE_INLINE void relaxed_signal() const { atomic_add_relaxed_sys(remote_inbound, 1); }

  // True (and consumes one signal) if the peer has signalled past our expectation; never blocks.
  MSCCLPP_DEVICE_INLINE bool poll() const {
    const u64 next = *expected + 1;
    if (atomic_load_acquire_sys(inbound) >= next) {
      *expected = next;
      return true;
    }
    return false;
  }

  // Waits for one more signal, with acquire semantics (data the peer published is visible after).
  // Returns false and records kErrorSemaphoreWaitTimeout if it does not come within max_spin.
  MSCCLPP_DEVICE_INLINE bool wait() const {
    const u64 target = ++*expected;
    const u64* in = inbound;
    return spin_until([in, target] { return atomic_load_acquire_sys(in) >= target; }, max_spin,
                      error_word, kErrorSemaphoreWaitTimeout);
  }

  // As wait(), with relaxed loads: pairs with relaxed_signal() for pure synchronisation.
  MSCCLPP_DEVICE_INLINE bool relaxed_wait() const {
    const u64 target = ++*expected;
    const u64* in = inbound;
    return spin_until([in, target] { return atomic_load_relaxed_sys(in) >= target; }, max_spin,
                      error_word, kErrorSemaphoreWaitTimeout);
  }
};

// Host-to-device semaphore: the increment is made by the host proxy (a DMA/RDMA atomic or a write
// after the data transfer completed), so the device side only waits or polls. Signalling the peer
// goes through a PortChannel trigger (FLAG), not through this handle.
// Layout is mirrored by core/src/device.rs::H2DSemaphoreHandle (32 bytes).
struct H2DSemaphoreHandle {
  u64* inbound;     // device memory the proxy (on behalf of the peer) increments
  u64* expected;    // local device memory; only this rank touches it
  u32* error_word;  // host-mapped DeviceErrorWord (may be null)
  u64 max_spin;     // spin bound in iterations; 0 = kDefaultMaxSpin

  MSCCLPP_DEVICE_INLINE bool poll() const {
    const u64 next = *expected + 1;
    if (atomic_load_acquire_sys(inbound) >= next) {
      *expected = next;
      return true;
    }
    return false;
  }

  MSCCLPP_DEVICE_INLINE bool wait() const {
    const u64 target = ++*expected;
    const u64* in = inbound;
    return spin_until([in, target] { return atomic_load_acquire_sys(in) >= target; }, max_spin,
                      error_word, kErrorSemaphoreWaitTimeout);
  }
};

}  // namespace mscclpp
