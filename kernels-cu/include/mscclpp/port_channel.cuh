// mscclpp-rs device library: PortChannel, the channel whose data is moved by a host proxy (DMA
// engine, RDMA NIC) on the GPU's request. The GPU only pushes triggers into the FIFO; completion of
// the peer's transfers into this rank is observed through the host-to-device semaphore.
//
// Memory ids name buffers registered with the proxy (9 bits); offsets and sizes are bytes and must
// fit the trigger fields (offsets < 2^32; larger sizes are split into several triggers).
#pragma once
#include "mscclpp/common.cuh"
#include "mscclpp/error.cuh"
#include "mscclpp/fifo.cuh"
#include "mscclpp/semaphore.cuh"

namespace mscclpp {

// Layout is mirrored by core/src/device.rs::PortChannelHandle (104 bytes).
struct PortChannelHandle {
  FifoHandle fifo;
  H2DSemaphoreHandle semaphore;
  u32 semaphore_id;   // the proxy's id of the peer-side semaphore FLAG triggers increment
  u32 dst_memory_id;  // the peer's registered buffer
  u32 src_memory_id;  // the local registered buffer
  u32 pad;

  // Pushes DATA (and the extra `flags`, FLAG and/or SYNC, on the last piece) for [offset, +bytes).
  // Returns the position of the last trigger or kFifoPushFailed.
  MSCCLPP_DEVICE_INLINE u64 push_transfer(u64 dst_offset, u64 src_offset, u64 bytes,
                                          u64 flags) const {
    if (dst_offset + bytes - (bytes ? 1 : 0) > kTriggerMaxOffset ||
        src_offset + bytes - (bytes ? 1 : 0) > kTriggerMaxOffset) {
      record_error(fifo.error_word, kErrorTriggerOverflow);
      return kFifoPushFailed;
    }
    // Pieces of at most 2^31 bytes so each size fits in 32 bits with room to spare.
    constexpr u64 kPiece = 1ull << 31;
    u64 pos = kFifoPushFailed;
    do {
      const u64 n = bytes > kPiece ? kPiece : bytes;
      const bool last = n == bytes;
      pos = fifo.push(ProxyTrigger::make(kTriggerData | (last ? flags : 0), dst_memory_id,
                                         dst_offset, src_memory_id, src_offset, n, semaphore_id));
      if (pos == kFifoPushFailed) return pos;
      dst_offset += n;
      src_offset += n;
      bytes -= n;
    } while (bytes > 0);
    return pos;
  }

  MSCCLPP_DEVICE_INLINE void put(u64 dst_offset, u64 src_offset, u64 bytes) const {
    push_transfer(dst_offset, src_offset, bytes, 0);
  }
  MSCCLPP_DEVICE_INLINE void put(u64 offset, u64 bytes) const { put(offset, offset, bytes); }

  // Increments the peer's semaphore after every transfer pushed before it has landed. Returns the
  // trigger's position (for fifo.sync) or kFifoPushFailed.
  MSCCLPP_DEVICE_INLINE u64 signal() const {
    return fifo.push(ProxyTrigger::make(kTriggerFlag, dst_memory_id, 0, src_memory_id, 0, 0, semaphore_id));
  }

  MSCCLPP_DEVICE_INLINE void put_with_signal(u64 dst_offset, u64 src_offset, u64 bytes) const {
    push_transfer(dst_offset, src_offset, bytes, kTriggerFlag);
  }
  MSCCLPP_DEVICE_INLINE void put_with_signal(u64 offset, u64 bytes) const {
    put_with_signal(offset, offset, bytes);
  }

  // Returns once the proxy has completed everything pushed so far (false on timeout).
  MSCCLPP_DEVICE_INLINE bool put_with_signal_and_flush(u64 dst_offset, u64 src_offset,
                                                       u64 bytes) const {
    return fifo.sync(push_transfer(dst_offset, src_offset, bytes, kTriggerFlag | kTriggerSync));
  }
  MSCCLPP_DEVICE_INLINE bool put_with_signal_and_flush(u64 offset, u64 bytes) const {
    return put_with_signal_and_flush(offset, offset, bytes);
  }

  MSCCLPP_DEVICE_INLINE bool flush() const {
    return fifo.sync(fifo.push(
        ProxyTrigger::make(kTriggerSync, dst_memory_id, 0, src_memory_id, 0, 0, semaphore_id)));
  }

  // Waits for the peer's next signal (its data has landed here).
  MSCCLPP_DEVICE_INLINE bool wait() const { return semaphore.wait(); }
  MSCCLPP_DEVICE_INLINE bool poll() const { return semaphore.poll(); }
};

}  // namespace mscclpp
