// mscclpp-rs: simple all-reduce kernels over MemoryChannels, templated over the element type T and
// the accumulation type AccT. The Rust side (kernels-cu/src/lib.rs) appends one
// `MSCCLPP_ALLREDUCE_FOR_<dtype>()` line, so each data type is its own translation unit and is
// compiled only when used. Entry points: simple_allreduce_packet_<name> and simple_allreduce_<name>,
// where <name> is DataType::name() optionally followed by _acc_f16 / _acc_f32.
//
// Common parameters:
//   chans    device pointer to MemoryChannelHandles, peers in rank order skipping `rank`:
//            channel i talks to rank (i < rank ? i : i + 1). chans[i].dst is that peer's scratch
//            mapped here; chans[i].packet_buffer is this rank's scratch (the same for every i).
//   input    count elements (may equal output: in-place is supported)
//   output   count elements
//   count    elements per rank
//   rank, nranks
//   op       ncclRedOp_t numbering: 0 sum, 1 prod, 2 max, 3 min, 4 avg (sum / nranks)
#include "mscclpp/common.cuh"
#include "mscclpp/copy.cuh"
#include "mscclpp/memory_channel.cuh"
#include "mscclpp/packet.cuh"
#include "mscclpp/reduce.cuh"

using namespace mscclpp;

__device__ __forceinline__ u32 peer_rank(u32 index, u32 rank) { return index < rank ? index : index + 1; }

// ------------------------------------------------------------------------------------------------
// Packet (LL16) all-reduce, for small messages: one pass, no semaphores.
//   flag     non-zero and different on every call (the caller's monotonically increasing counter)
//   scratch  (this rank's, through chans[*].packet_buffer) 2 * nranks * packet_buffer_bytes<LL16>(
//            count * sizeof(T)) bytes: two halves selected by flag parity, so a fast rank writing
//            call k+1 never overwrites packets a slow rank still reads for call k.
// Launch: any grid; all threads cooperate (grid-stride over 8-byte payloads).
// ------------------------------------------------------------------------------------------------
template <typename T, typename AccT, int Op>
__device__ void allreduce_packet(const MemoryChannelHandle* chans, const void* input, void* output,
                                 u64 count, u32 rank, u32 nranks, u32 flag) {
  typedef LL16Packet Pkt;
  const u64 bytes = count * sizeof(T);
  const u64 npkt = packet_count<Pkt>(bytes);
  const u64 slot_bytes = npkt * sizeof(Pkt);
  const u64 half = static_cast<u64>(flag & 1) * nranks * slot_bytes;
  const u32 npeers = nranks - 1;
  const u8* in = static_cast<const u8*>(input);
  u8* out = static_cast<u8*>(output);
  const bool in_aligned = reinterpret_cast<u64>(in) % Pkt::kPayloadBytes == 0;
  const bool out_aligned = reinterpret_cast<u64>(out) % Pkt::kPayloadBytes == 0;
  const u8* local_scratch = static_cast<const u8*>(chans[0].packet_buffer);
  u32* error_word = chans[0].semaphore.error_word;
  const u64 max_spin = chans[0].semaphore.max_spin;
  const u32 tid = global_thread_id();
  const u32 n = global_num_threads();

  // Phase 1: send my input to every peer's slot `rank`. Each payload is loaded once.
  for (u64 j = tid; j < npkt; j += n) {
    const u64 v = load_payload<Pkt>(in, bytes, j, in_aligned);
    for (u32 i = 0; i < npeers; ++i) {
      Pkt* dst = reinterpret_cast<Pkt*>(static_cast<u8*>(chans[i].dst) + half + rank * slot_bytes);
      dst[j].write(v, flag);
    }
  }
  // Phase 2: the same thread owns payload j in both phases, so in-place is safe.
  for (u64 j = tid; j < npkt; j += n) {
    VecAccumulator<T, AccT, Op, u64> acc;
    acc.init(load_payload<Pkt>(in, bytes, j, in_aligned));
    for (u32 i = 0; i < npeers; ++i) {
      const Pkt* src = reinterpret_cast<const Pkt*>(local_scratch + half +
                                                    peer_rank(i, rank) * slot_bytes);
      u64 v;
      if (!src[j].read(flag, v, max_spin, error_word)) return;
      acc.add(v);
    }
    store_payload<Pkt>(out, bytes, j, acc.finish(nranks), out_aligned);
  }
}

// ------------------------------------------------------------------------------------------------
// Put-based all-reduce, for large messages: every rank copies its input into every peer's scratch
// slot `rank`, a semaphore round tells the peer the slot is complete, each rank reduces locally,
// and a second round keeps a fast rank from overwriting a slot before its reader finished.
//   chans    gridDim.x * (nranks - 1) handles: block b uses chans[b * (nranks - 1) + i], so each
//            block synchronises its own part through its own semaphores.
//   scratch  nranks * slot bytes, slot = count * sizeof(T) rounded up to 16.
// Launch: any grid (the same on every rank); blocks own contiguous 16-byte-aligned ranges.
// ------------------------------------------------------------------------------------------------
template <typename T, typename AccT, int Op>
__device__ void allreduce_put(const MemoryChannelHandle* chans, const void* input, void* output,
                              u64 count, u32 rank, u32 nranks) {
  constexpr u64 kVecElems = sizeof(uint4) / sizeof(T);
  const u32 npeers = nranks - 1;
  const MemoryChannelHandle* my = chans + static_cast<u64>(blockIdx.x) * npeers;
  const u64 bytes = count * sizeof(T);
  const u64 slot = (bytes + 15) & ~15ull;

  // This block's element range [begin, end): whole vectors, the last block also takes the tail.
  const u64 nvec = count / kVecElems;
  const u64 vec_per_block = (nvec + gridDim.x - 1) / gridDim.x;
  const u64 vbegin = min(static_cast<u64>(blockIdx.x) * vec_per_block, nvec);
  const u64 vend = min(vbegin + vec_per_block, nvec);
  const u64 begin = vbegin * kVecElems;
  const u64 end = blockIdx.x == gridDim.x - 1 ? count : vend * kVecElems;
  const u64 off = begin * sizeof(T);
  const u64 len = (end - begin) * sizeof(T);

  for (u32 i = 0; i < npeers; ++i) {
    copy(static_cast<u8*>(my[i].dst) + rank * slot + off, static_cast<const u8*>(input) + off, len,
         threadIdx.x, blockDim.x);
  }
  __shared__ int ok;
  __syncthreads();  // every thread's puts happen-before the signals below (release is cumulative)
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  if (threadIdx.x < npeers) {
    my[threadIdx.x].signal();
    if (!my[threadIdx.x].wait()) ok = 0;
  }
  __syncthreads();
  if (!ok) return;

  const u8* scratch = static_cast<const u8*>(my[0].packet_buffer);
  const T* in = static_cast<const T*>(input);
  T* out = static_cast<T*>(output);
  const bool vec_ok = (reinterpret_cast<u64>(in) % 16 == 0) && (reinterpret_cast<u64>(out) % 16 == 0) &&
                      (reinterpret_cast<u64>(scratch) % 16 == 0);
  u64 scalar_begin = begin;
  if (vec_ok) {
    for (u64 v = vbegin + threadIdx.x; v < vend; v += blockDim.x) {
      VecAccumulator<T, AccT, Op, uint4> acc;
      acc.init(reinterpret_cast<const uint4*>(in)[v]);
      for (u32 i = 0; i < npeers; ++i) {
        acc.add(reinterpret_cast<const uint4*>(scratch + peer_rank(i, rank) * slot)[v]);
      }
      reinterpret_cast<uint4*>(out)[v] = acc.finish(nranks);
    }
    scalar_begin = vend * kVecElems;
  }
  for (u64 e = scalar_begin + threadIdx.x; e < end; e += blockDim.x) {
    VecAccumulator<T, AccT, Op, T> acc;
    acc.init(in[e]);
    for (u32 i = 0; i < npeers; ++i) {
      acc.add(reinterpret_cast<const T*>(scratch + peer_rank(i, rank) * slot)[e]);
    }
    out[e] = acc.finish(nranks);
  }

  // Second round: my reads of scratch are done before any peer's next call may write it.
  __syncthreads();
  if (threadIdx.x < npeers) {
    my[threadIdx.x].signal();
    my[threadIdx.x].wait();
  }
}

// Run-time op -> compile-time template. Unknown ops do nothing (the host validates op first).
template <typename T, typename AccT>
__device__ __forceinline__ void allreduce_packet_dispatch(const MemoryChannelHandle* chans,
                                                          const void* input, void* output, u64 count,
                                                          u32 rank, u32 nranks, u32 flag, i32 op) {
  switch (op) {
    case kReduceSum: allreduce_packet<T, AccT, kReduceSum>(chans, input, output, count, rank, nranks, flag); break;
    case kReduceProd: allreduce_packet<T, AccT, kReduceProd>(chans, input, output, count, rank, nranks, flag); break;
    case kReduceMax: allreduce_packet<T, AccT, kReduceMax>(chans, input, output, count, rank, nranks, flag); break;
    case kReduceMin: allreduce_packet<T, AccT, kReduceMin>(chans, input, output, count, rank, nranks, flag); break;
    case kReduceAvg: allreduce_packet<T, AccT, kReduceAvg>(chans, input, output, count, rank, nranks, flag); break;
    default: break;
  }
}

template <typename T, typename AccT>
__device__ __forceinline__ void allreduce_put_dispatch(const MemoryChannelHandle* chans,
                                                       const void* input, void* output, u64 count,
                                                       u32 rank, u32 nranks, i32 op) {
  switch (op) {
    case kReduceSum: allreduce_put<T, AccT, kReduceSum>(chans, input, output, count, rank, nranks); break;
    case kReduceProd: allreduce_put<T, AccT, kReduceProd>(chans, input, output, count, rank, nranks); break;
    case kReduceMax: allreduce_put<T, AccT, kReduceMax>(chans, input, output, count, rank, nranks); break;
    case kReduceMin: allreduce_put<T, AccT, kReduceMin>(chans, input, output, count, rank, nranks); break;
    case kReduceAvg: allreduce_put<T, AccT, kReduceAvg>(chans, input, output, count, rank, nranks); break;
    default: break;
  }
}

#define MSCCLPP_INSTANTIATE_ALLREDUCE(name, T, AccT)                                                 \
  extern "C" __global__ void simple_allreduce_packet_##name(                                         \
      const MemoryChannelHandle* chans, const void* input, void* output, u64 count, u32 rank,       \
      u32 nranks, u32 flag, i32 op) {                                                                \
    allreduce_packet_dispatch<T, AccT>(chans, input, output, count, rank, nranks, flag, op);        \
  }                                                                                                  \
  extern "C" __global__ void simple_allreduce_##name(const MemoryChannelHandle* chans,              \
                                                     const void* input, void* output, u64 count,     \
                                                     u32 rank, u32 nranks, i32 op) {                 \
    allreduce_put_dispatch<T, AccT>(chans, input, output, count, rank, nranks, op);                 \
  }

// One line per data type; kernels-cu/src/lib.rs appends the one its translation unit is for.
// Float types also get wider accumulation variants (AccumType::F16 / F32 in Rust).
#define MSCCLPP_ALLREDUCE_FOR_f32() MSCCLPP_INSTANTIATE_ALLREDUCE(f32, float, float)
#define MSCCLPP_ALLREDUCE_FOR_f64() MSCCLPP_INSTANTIATE_ALLREDUCE(f64, double, double)
#define MSCCLPP_ALLREDUCE_FOR_f16()                  \
  MSCCLPP_INSTANTIATE_ALLREDUCE(f16, f16, f16)       \
  MSCCLPP_INSTANTIATE_ALLREDUCE(f16_acc_f32, f16, float)
#define MSCCLPP_ALLREDUCE_FOR_bf16()                   \
  MSCCLPP_INSTANTIATE_ALLREDUCE(bf16, bf16, bf16)      \
  MSCCLPP_INSTANTIATE_ALLREDUCE(bf16_acc_f16, bf16, f16) \
  MSCCLPP_INSTANTIATE_ALLREDUCE(bf16_acc_f32, bf16, float)
#define MSCCLPP_ALLREDUCE_FOR_i8() MSCCLPP_INSTANTIATE_ALLREDUCE(i8, i8, i8)
#define MSCCLPP_ALLREDUCE_FOR_u8() MSCCLPP_INSTANTIATE_ALLREDUCE(u8, u8, u8)
#define MSCCLPP_ALLREDUCE_FOR_i32() MSCCLPP_INSTANTIATE_ALLREDUCE(i32, i32, i32)
#define MSCCLPP_ALLREDUCE_FOR_u32() MSCCLPP_INSTANTIATE_ALLREDUCE(u32, u32, u32)
#define MSCCLPP_ALLREDUCE_FOR_i64() MSCCLPP_INSTANTIATE_ALLREDUCE(i64, i64, i64)
#define MSCCLPP_ALLREDUCE_FOR_u64() MSCCLPP_INSTANTIATE_ALLREDUCE(u64, u64, u64)
#define MSCCLPP_ALLREDUCE_FOR_FP8(name, T)                 \
  MSCCLPP_INSTANTIATE_ALLREDUCE(name, T, T)                \
  MSCCLPP_INSTANTIATE_ALLREDUCE(name##_acc_f16, T, f16)    \
  MSCCLPP_INSTANTIATE_ALLREDUCE(name##_acc_f32, T, float)
#define MSCCLPP_ALLREDUCE_FOR_fp8_e4m3() MSCCLPP_ALLREDUCE_FOR_FP8(fp8_e4m3, fp8_e4m3)
#define MSCCLPP_ALLREDUCE_FOR_fp8_e4m3fnuz() MSCCLPP_ALLREDUCE_FOR_FP8(fp8_e4m3fnuz, fp8_e4m3fnuz)
#define MSCCLPP_ALLREDUCE_FOR_fp8_e5m2() MSCCLPP_ALLREDUCE_FOR_FP8(fp8_e5m2, fp8_e5m2)
#define MSCCLPP_ALLREDUCE_FOR_fp8_e4m3b15() MSCCLPP_ALLREDUCE_FOR_FP8(fp8_e4m3b15, fp8_e4m3b15)
