// mscclpp-rs: kernels for the GPU test suite of the channel primitives. They also pull every
// header of the device library into one translation unit, so CI's NVRTC build covers them all.
#include "mscclpp/common.cuh"
#include "mscclpp/copy.cuh"
#include "mscclpp/error.cuh"
#include "mscclpp/fifo.cuh"
#include "mscclpp/memory_channel.cuh"
#include "mscclpp/packet.cuh"
#include "mscclpp/port_channel.cuh"
#include "mscclpp/reduce.cuh"
#include "mscclpp/semaphore.cuh"

using namespace mscclpp;

// Thread 0 runs `op` (a bool-returning semaphore step); the whole block learns whether it worked.
template <typename Op>
__device__ __forceinline__ bool block_single(Op op) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x == 0) ok = op() ? 1 : 0;
  __syncthreads();
  return ok != 0;
}

// memory_channel_ping_pong: rank A (initiator=1) puts `bytes` from its src to the peer's dst and
// signals; rank B (initiator=0) waits, puts its src (the buffer A wrote into) back to A's dst and
// signals. Repeats `iters` times.
//   chan       MemoryChannelHandle by value; src/dst sized >= bytes
//   bytes      bytes per put
//   iters      round trips
//   initiator  1 on the rank that starts, 0 on its peer
// Launch: one block (any size). Timeouts are reported through chan.semaphore.error_word.
extern "C" __global__ void memory_channel_ping_pong(MemoryChannelHandle chan, u64 bytes, u32 iters,
                                                    u32 initiator) {
  for (u32 it = 0; it < iters; ++it) {
    if (initiator) {
      chan.put(0, bytes, threadIdx.x, blockDim.x);
      if (!block_single([&] {
            chan.signal();
            return chan.wait();
          }))
        return;
    } else {
      if (!block_single([&] { return chan.wait(); })) return;
      chan.put(0, bytes, threadIdx.x, blockDim.x);
      block_single([&] {
        chan.signal();
        return true;
      });
    }
  }
}

// memory_channel_get: both ranks run it. Each iteration: rendezvous (both buffers ready), copy the
// peer's dst buffer into the local src buffer with get, rendezvous again (so neither rank changes
// its buffer while the peer still reads it).
//   chan   MemoryChannelHandle by value; dst = the peer's buffer, src = local destination
//   bytes  bytes to read
//   iters  repetitions
// Launch: one block.
extern "C" __global__ void memory_channel_get(MemoryChannelHandle chan, u64 bytes, u32 iters) {
  for (u32 it = 0; it < iters; ++it) {
    if (!block_single([&] {
          chan.signal();
          return chan.wait();
        }))
      return;
    chan.get(0, bytes, threadIdx.x, blockDim.x);
    if (!block_single([&] {
          chan.signal();
          return chan.wait();
        }))
      return;
  }
}

// ll_packet_exchange_{ll16,ll8}: both ranks run it. Packs `bytes` of the local src into packets in
// the peer's packet buffer (chan.dst), then unpacks the peer's packets from the local packet buffer
// (chan.packet_buffer) into `out`.
//   chan   MemoryChannelHandle by value; packet buffers sized >= packet_buffer_bytes(bytes)
//   out    local output, bytes long (receives the peer's src)
//   bytes  payload bytes (any value, need not be aligned)
//   flag   non-zero, different from every earlier call on the same buffers
// Launch: any grid; all threads of the grid cooperate.
template <typename Pkt>
__device__ __forceinline__ void ll_exchange(const MemoryChannelHandle& chan, void* out, u64 bytes,
                                            u32 flag) {
  const u32 tid = global_thread_id();
  const u32 n = global_num_threads();
  chan.put_packets<Pkt>(0, 0, bytes, tid, n, flag);
  chan.read_packets<Pkt>(out, 0, bytes, tid, n, flag);
}
extern "C" __global__ void ll_packet_exchange_ll16(MemoryChannelHandle chan, void* out, u64 bytes,
                                                   u32 flag) {
  ll_exchange<LL16Packet>(chan, out, bytes, flag);
}
extern "C" __global__ void ll_packet_exchange_ll8(MemoryChannelHandle chan, void* out, u64 bytes,
                                                  u32 flag) {
  ll_exchange<LL8Packet>(chan, out, bytes, flag);
}

// semaphore_stress: thread i (of the whole grid) drives channel i for `iters` rounds.
//   chans      device pointer to nchans MemoryChannelHandles (one per peer link)
//   nchans     number of channels; threads beyond it idle
//   iters      signals (and waits) per channel
//   mode       0: signal then wait, per round; 1: all signals first, then all waits (the counter
//              must accumulate); 2: as 0 with relaxed_signal / relaxed_wait
//   completed  device array of nchans u32: waits that succeeded (== iters unless a timeout)
// The peer runs the same kernel with the same iters and mode.
extern "C" __global__ void semaphore_stress(const MemoryChannelHandle* chans, u32 nchans, u32 iters,
                                            u32 mode, u32* completed) {
  const u32 i = global_thread_id();
  if (i >= nchans) return;
  const MemoryChannelHandle chan = chans[i];
  u32 done = 0;
  if (mode == 1) {
    for (u32 k = 0; k < iters; ++k) chan.signal();
    for (u32 k = 0; k < iters; ++k) {
      if (!chan.wait()) break;
      ++done;
    }
  } else {
    for (u32 k = 0; k < iters; ++k) {
      bool ok;
      if (mode == 2) {
        chan.relaxed_signal();
        ok = chan.relaxed_wait();
      } else {
        chan.signal();
        ok = chan.wait();
      }
      if (!ok) break;
      ++done;
    }
  }
  completed[i] = done;
}

// port_channel_put_signal: the GPU half of a PortChannel round trip (the proxy moves the data).
// Thread 0 pushes put_with_signal_and_flush for [0, bytes) when `sender` is 1, else waits for the
// peer's signal. Exercises the FIFO and the host-to-device semaphore.
//   chan    PortChannelHandle by value
//   bytes   bytes to transfer
//   sender  1 on the rank that sends, 0 on the receiver
//   result  device u32: 1 on success, 0 after a timeout
// Launch: one thread suffices.
extern "C" __global__ void port_channel_put_signal(PortChannelHandle chan, u64 bytes, u32 sender,
                                                   u32* result) {
  if (global_thread_id() != 0) return;
  const bool ok = sender ? chan.put_with_signal_and_flush(0, 0, bytes) : chan.wait();
  *result = ok ? 1u : 0u;
}
