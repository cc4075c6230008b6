// SwitchChannel (NVLS) kernels. They instantiate the device methods of switch_channel.cuh for
// every vector type so that CI compiles the multimem PTX for sm_90/sm_100 (and the trap path for
// sm_80). The runtime does not launch them yet: an NVLS algorithm will, behind the NVLS gate.
#include "mscclpp/common.cuh"
#include "mscclpp/switch_channel.cuh"

using namespace mscclpp;

// In-place all-reduce of bytes [begin, end) of the channel (both multiples of 16), the grid's
// threads striding over 16-byte vectors: sum every rank's vector in the switch, then write the
// sum to every rank. Ranks split the range between them; the caller synchronises the ranks before
// (inputs written) and after (results complete) with semaphores.
template <typename V>
MSCCLPP_DEVICE_INLINE void reduce_broadcast(const SwitchChannelHandle& chan, u64 begin, u64 end) {
  const u64 stride = 16ull * global_num_threads();
  for (u64 off = begin + 16ull * global_thread_id(); off + 16 <= end; off += stride) {
    const V sum = chan.reduce<V>(off);
    chan.broadcast<V>(off, sum);
  }
}

extern "C" __global__ void switch_channel_reduce_broadcast_f32(SwitchChannelHandle chan, u64 begin,
                                                               u64 end) {
  reduce_broadcast<f32x4>(chan, begin, end);
}

extern "C" __global__ void switch_channel_reduce_broadcast_f16(SwitchChannelHandle chan, u64 begin,
                                                               u64 end) {
  reduce_broadcast<f16x8>(chan, begin, end);
}

extern "C" __global__ void switch_channel_reduce_broadcast_bf16(SwitchChannelHandle chan,
                                                                u64 begin, u64 end) {
  reduce_broadcast<bf16x8>(chan, begin, end);
}
