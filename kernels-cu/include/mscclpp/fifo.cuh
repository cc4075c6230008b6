// mscclpp-rs device library: the device-to-proxy FIFO and its trigger encoding.
//
// GPU threads push 16-byte ProxyTriggers into a ring in host-mapped memory; a host proxy thread
// polls the ring, performs the transfer/signal/flush, zeroes the slot and advances `tail`.
// Bit layout (mirrored and unit-tested in core/src/device.rs):
//   fst: [0,32) size in bytes | [32,64) src_offset
//   snd: [0,32) dst_offset | [32,41) src_memory_id | [41,50) dst_memory_id | [50,53) type
//        | [53,63) semaphore_id | bit 63 valid
#pragma once
#include "mscclpp/common.cuh"
#include "mscclpp/error.cuh"

namespace mscclpp {

constexpr u64 kTriggerData = 1;  // copy size bytes src_memory_id+src_offset -> dst_memory_id+dst_offset
constexpr u64 kTriggerFlag = 2;  // signal semaphore semaphore_id on the peer (after the data)
constexpr u64 kTriggerSync = 4;  // flush the connection before the proxy advances the tail

constexpr u32 kTriggerSizeBits = 32;
constexpr u32 kTriggerOffsetBits = 32;
constexpr u32 kTriggerMemoryIdBits = 9;
constexpr u32 kTriggerTypeBits = 3;
constexpr u32 kTriggerSemaphoreIdBits = 10;
constexpr u32 kTriggerSrcMemoryIdShift = 32;
constexpr u32 kTriggerDstMemoryIdShift = 41;
constexpr u32 kTriggerTypeShift = 50;
constexpr u32 kTriggerSemaphoreIdShift = 53;
constexpr u64 kTriggerValid = 1ull << 63;
constexpr u64 kTriggerMaxSize = (1ull << kTriggerSizeBits) - 1;
constexpr u64 kTriggerMaxOffset = (1ull << kTriggerOffsetBits) - 1;

// Layout is mirrored by core/src/device.rs::ProxyTrigger (16 bytes, 16-byte aligned).
struct __align__(16) ProxyTrigger {
  u64 fst;
  u64 snd;

  // Fields are masked to their widths; callers range-check offsets (see PortChannelHandle).
  MSCCLPP_HOST_DEVICE_INLINE static ProxyTrigger make(u64 type, u32 dst_memory_id, u64 dst_offset,
                                                      u32 src_memory_id, u64 src_offset, u64 size,
                                                      u32 semaphore_id) {
    ProxyTrigger t;
    t.fst = (size & kTriggerMaxSize) | ((src_offset & kTriggerMaxOffset) << kTriggerSizeBits);
    t.snd = (dst_offset & kTriggerMaxOffset) |
            ((static_cast<u64>(src_memory_id) & ((1ull << kTriggerMemoryIdBits) - 1))
             << kTriggerSrcMemoryIdShift) |
            ((static_cast<u64>(dst_memory_id) & ((1ull << kTriggerMemoryIdBits) - 1))
             << kTriggerDstMemoryIdShift) |
            ((type & ((1ull << kTriggerTypeBits) - 1)) << kTriggerTypeShift) |
            ((static_cast<u64>(semaphore_id) & ((1ull << kTriggerSemaphoreIdBits) - 1))
             << kTriggerSemaphoreIdShift) |
            kTriggerValid;
    return t;
  }
};

// Returned by FifoHandle::push when the ring stayed full for max_spin iterations.
constexpr u64 kFifoPushFailed = ~0ull;

// Layout is mirrored by core/src/device.rs::FifoHandle (56 bytes).
struct FifoHandle {
  ProxyTrigger* triggers;  // host-mapped ring of `size` slots
  u64* head;               // device memory: next position to hand out (atomic add by pushers)
  u64* tail;               // host-mapped: triggers consumed so far (written by the proxy)
  u32 size;                // slots in the ring
  u32 pad;
  u32* error_word;  // host-mapped DeviceErrorWord (may be null)
  u64 max_spin;     // spin bound in iterations; 0 = kDefaultMaxSpin
  u64* tail_cache;  // device memory: the largest tail a pusher has read (never ahead of `tail`)

  // Pushes one trigger; any number of threads may push concurrently. Returns the trigger's position
  // (for sync), or kFifoPushFailed after recording kErrorFifoPushTimeout.
  MSCCLPP_DEVICE_INLINE u64 push(ProxyTrigger trigger) const {
    const u64 pos = atomic_fetch_add_relaxed_gpu(head, 1);
    const u64 slots = size;
    // The slot is free once the proxy has consumed the trigger `size` positions earlier. Reading
    // the host-mapped tail costs a PCIe round trip (about 1 us), so pushers first consult the
    // device-side cache and read the real tail only when the cache says the ring may be full.
    // The cache is only ever raised to a value read from `tail`, so it never claims a free slot
    // that is not. Ordering chain: proxy frees slot -> release tail -> some pusher's acquire of
    // tail -> its release max into the cache -> our acquire of the cache -> our slot write.
    if (pos >= atomic_load_acquire_gpu(tail_cache) + slots) {
      const u64* t = tail;
      u64* cache = tail_cache;
      if (!spin_until(
              [t, cache, pos, slots] {
                const u64 seen = atomic_load_acquire_sys(t);
                atomic_max_release_gpu(cache, seen);
                return pos < seen + slots;
              },
              max_spin, error_word, kErrorFifoPushTimeout)) {
        return kFifoPushFailed;
      }
    }
    ProxyTrigger* slot = &triggers[pos % slots];
    // One 16-byte release store: a proxy that sees the valid bit in snd sees fst too, and the
    // trigger leaves without first waiting for a separate fst write to reach host memory.
    store_pair_release_sys(&slot->fst, trigger.fst, trigger.snd);
    return pos;
  }

  // Waits until the proxy has consumed (handled) the trigger at `pos`. False on timeout (recorded
  // as kErrorFifoFlushTimeout) or when `pos` is kFifoPushFailed.
  MSCCLPP_DEVICE_INLINE bool sync(u64 pos) const {
    if (pos == kFifoPushFailed) return false;
    const u64* t = tail;
    return spin_until([t, pos] { return atomic_load_acquire_sys(t) > pos; }, max_spin, error_word,
                      kErrorFifoFlushTimeout);
  }
};

}  // namespace mscclpp
