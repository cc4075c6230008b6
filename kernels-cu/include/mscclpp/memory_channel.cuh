// mscclpp-rs device library: MemoryChannel, the peer-to-peer channel whose data moves by the SMs
// themselves (loads/stores to a peer's memory mapped over NVLink/PCIe P2P).
//
// Buffers, as the host builds the handle:
//   src            local buffer: the source of put and put_packets, the destination of get and
//                  unpack_packets;
//   dst            the peer's buffer mapped here: the destination of put and put_packets (for
//                  put_packets it is the peer's packet buffer), the source of get;
//   packet_buffer  local scratch the peer's put_packets write into, read by read_packet(s).
// Offsets are in bytes. put/get/put_packets/unpack_packets are cooperative: every thread of the
// group calls them with its (thread_id, num_threads). signal/wait/flush are called by one thread.
#pragma once
#include "mscclpp/common.cuh"
#include "mscclpp/copy.cuh"
#include "mscclpp/packet.cuh"
#include "mscclpp/semaphore.cuh"

namespace mscclpp {

// Layout is mirrored by core/src/device.rs::MemoryChannelHandle (64 bytes).
struct MemoryChannelHandle {
  D2DSemaphoreHandle semaphore;
  void* dst;
  void* src;
  void* packet_buffer;

  // ---- data ----
  MSCCLPP_DEVICE_INLINE void put(u64 dst_offset, u64 src_offset, u64 bytes, u32 thread_id,
                                 u32 num_threads) const {
    copy(static_cast<u8*>(dst) + dst_offset, static_cast<const u8*>(src) + src_offset, bytes,
         thread_id, num_threads);
  }
  MSCCLPP_DEVICE_INLINE void put(u64 offset, u64 bytes, u32 thread_id, u32 num_threads) const {
    put(offset, offset, bytes, thread_id, num_threads);
  }

  // Reads the peer's `dst` buffer into the local `src` buffer.
  MSCCLPP_DEVICE_INLINE void get(u64 dst_offset, u64 src_offset, u64 bytes, u32 thread_id,
                                 u32 num_threads) const {
    copy(static_cast<u8*>(src) + src_offset, static_cast<const u8*>(dst) + dst_offset, bytes,
         thread_id, num_threads);
  }
  MSCCLPP_DEVICE_INLINE void get(u64 offset, u64 bytes, u32 thread_id, u32 num_threads) const {
    get(offset, offset, bytes, thread_id, num_threads);
  }

  // ---- packets ----
  // Packs `bytes` of local src (from src_offset) into packets written at byte offset
  // `dst_offset` of the peer's packet buffer (`dst`).
  template <typename Pkt = LL16Packet>
  MSCCLPP_DEVICE_INLINE void put_packets(u64 dst_offset, u64 src_offset, u64 bytes, u32 thread_id,
                                         u32 num_threads, u32 flag) const {
    mscclpp::put_packets<Pkt>(reinterpret_cast<Pkt*>(static_cast<u8*>(dst) + dst_offset),
                              static_cast<const u8*>(src) + src_offset, bytes, thread_id,
                              num_threads, flag);
  }

  // Waits for packet `index` (counted from byte offset `offset` of the local packet buffer) to
  // carry `flag` and returns its payload through `payload`.
  template <typename Pkt = LL16Packet>
  MSCCLPP_DEVICE_INLINE bool read_packet(u64 offset, u64 index, u32 flag,
                                         typename Pkt::Payload& payload) const {
    const Pkt* p = reinterpret_cast<const Pkt*>(static_cast<const u8*>(packet_buffer) + offset);
    return p[index].read(flag, payload, semaphore.max_spin, semaphore.error_word);
  }

  // Cooperative: unpacks `bytes` of payload from the local packet buffer (from byte offset
  // `packet_offset`) into local src at `src_offset`.
  template <typename Pkt = LL16Packet>
  MSCCLPP_DEVICE_INLINE bool unpack_packets(u64 src_offset, u64 packet_offset, u64 bytes,
                                            u32 thread_id, u32 num_threads, u32 flag) const {
    return get_packets<Pkt>(
        static_cast<u8*>(src) + src_offset,
        reinterpret_cast<const Pkt*>(static_cast<const u8*>(packet_buffer) + packet_offset), bytes,
        thread_id, num_threads, flag, semaphore.max_spin, semaphore.error_word);
  }

  // Cooperative: as unpack_packets but into any local pointer (e.g. an output buffer).
  template <typename Pkt = LL16Packet>
  MSCCLPP_DEVICE_INLINE bool read_packets(void* out, u64 packet_offset, u64 bytes, u32 thread_id,
                                          u32 num_threads, u32 flag) const {
    return get_packets<Pkt>(
        out, reinterpret_cast<const Pkt*>(static_cast<const u8*>(packet_buffer) + packet_offset),
        bytes, thread_id, num_threads, flag, semaphore.max_spin, semaphore.error_word);
  }

  // ---- synchronisation (one thread) ----
  MSCCLPP_DEVICE_INLINE void signal() const { semaphore.signal(); }
  MSCCLPP_DEVICE_INLINE void relaxed_signal() const { semaphore.relaxed_signal(); }
  MSCCLPP_DEVICE_INLINE bool poll() const { return semaphore.poll(); }
  MSCCLPP_DEVICE_INLINE bool wait() const { return semaphore.wait(); }
  MSCCLPP_DEVICE_INLINE bool relaxed_wait() const { return semaphore.relaxed_wait(); }
  // Stores by SMs complete on their own; flush only orders them system-wide before what follows
  // (e.g. a relaxed_signal).
  MSCCLPP_DEVICE_INLINE void flush() const { fence_acq_rel_sys(); }
};

}  // namespace mscclpp
