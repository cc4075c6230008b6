// mscclpp-rs all-reduce (sum) over NVLink multicast (NVLS). kernels-cu/src/nvls_units.rs builds one
// unit per element type: it #defines MSCCLPP_NVLS_T (float, f16, bf16) and MSCCLPP_NVLS_V (the
// 16-byte multimem vector: f32x4, f16x8, bf16x8), then prepends collective_common.cuh, then this text.
//
// SAFETY (DESIGN.md, "Safety on shared GPUs"): these kernels dereference multicast addresses. The
// host launches them only through collectives/src/nvls.rs, whose constructors refuse unless the
// NVLS gate is open (MSCCLPP_ENABLE_NVLS=1) and the device supports multicast.
//
// Entry points (every grid co-resident, same geometry on every rank, blockDim.x a multiple of 32 and
// larger than the number of peers):
//   allreduce_nvls_zero_copy       the user's input and output buffers are themselves bound to
//                                  multicast objects: each rank reduces its 1/nranks share of the
//                                  16-byte vectors in the switch (ld_reduce) and writes the sums to
//                                  every rank's output (st); one barrier before, one after.
//   allreduce_nvls_block_pipeline  the message goes through a multicast-bound scratch in chunks; each
//   allreduce_nvls_warp_pipeline   block (resp. warp) owns a fixed region of the scratch and runs
//                                  its own chunk sequence (copy in, barrier, reduce + broadcast of
//                                  its share, barrier, copy out) with barriers only between the
//                                  same-numbered unit of every rank, so units of one rank are at
//                                  different stages at once: that is the pipeline. Warps give more,
//                                  smaller stages (lower latency per stage, more semaphores).
//   allreduce_nvls_packet          small messages: every rank writes its input as LL16 packets into
//                                  its own slot of every rank's scratch with one multimem store per
//                                  packet, then reduces the nranks slots from its local scratch.
//
// Memory ordering between the unicast and the multicast alias of one buffer: the switch reads
// (ld_reduce) what a GPU wrote through its unicast address, and a GPU reads through its unicast
// address what the switch wrote (st). A `fence.proxy.alias` orders a thread's accesses through one
// virtual alias before its later accesses through another; the sys-scope fence + semaphore
// barrier then orders them against the other ranks.
#include "mscclpp/switch_channel.cuh"

using namespace mscclpp;
using namespace mscclpp::coll;

typedef MSCCLPP_NVLS_T NvlsT;
typedef MSCCLPP_NVLS_V NvlsV;
static_assert(sizeof(NvlsV) == 16, "multimem vectors are 16 bytes");

constexpr u64 kVecBytes = 16;

// The one parameter of every kernel below; each reads the fields its protocol needs. Mirrored by
// mscclpp_kernels_cu::nvls_units::NvlsArgs (152 bytes).
struct NvlsArgs {
  SwitchChannelHandle scratch;         // multicast-bound scratch (packet, pipelines)
  SwitchChannelHandle input_channel;   // the user's buffers bound to multicast objects (zero copy)
  SwitchChannelHandle output_channel;
  const void* input;
  void* output;
  u64 count;       // elements (packet)
  u64 bytes;       // zero copy, pipelines
  u64 unit_bytes;  // scratch bytes of one pipeline unit
  CallState* state;
  u32* error_word;
  const D2DSemaphoreHandle* sems;
  u64 max_spin;
  u32 rank;
  u32 nranks;
};

MSCCLPP_DEVICE_INLINE void alias_fence() {
#if MSCCLPP_HAS_MULTIMEM
  asm volatile("fence.proxy.alias;" ::: "memory");
#endif
}

// The [begin, end) range of 16-byte vectors, out of `nvec`, that `rank` reduces and broadcasts.
MSCCLPP_DEVICE_INLINE void rank_share(u64 nvec, u32 rank, u32 nranks, u64& begin, u64& end) {
  const u64 per = (nvec + nranks - 1) / nranks;
  begin = min(static_cast<u64>(rank) * per, nvec);
  end = min(begin + per, nvec);
}

// Sum in the switch and write to every rank: vectors [begin, end) at byte offset `base` of the
// channels, spread over (tid, nthreads).
MSCCLPP_DEVICE_INLINE void reduce_broadcast_range(const SwitchChannelHandle& src, const SwitchChannelHandle& dst,
                                                  u64 base, u64 begin, u64 end, u64 tid, u64 nthreads) {
  for (u64 v = begin + tid; v < end; v += nthreads) {
    const NvlsV sum = src.reduce<NvlsV>(base + v * kVecBytes);
    dst.broadcast<NvlsV>(base + v * kVecBytes, sum);
  }
}

// Barrier of one warp with the same-numbered warp of every peer through sems[warp * npeers + lane]
// (the warp analogue of coll::block_barrier; npeers < 32). Returns false if a peer did not arrive
// within the spin bound (the error word says so).
MSCCLPP_DEVICE_INLINE bool warp_barrier(const D2DSemaphoreHandle* sems, u64 warp, u32 npeers, bool publish) {
  if (publish) fence_acq_rel_sys();
  __syncwarp();
  const u32 lane = threadIdx.x % 32;
  bool ok = true;
  if (lane < npeers) {
    const D2DSemaphoreHandle& s = sems[warp * npeers + lane];
    s.signal();
    ok = s.wait();
  }
  return __all_sync(0xffffffffu, ok) != 0;
}

// The pipeline's unit of independent progress: a block or a warp.
struct BlockUnit {
  static MSCCLPP_DEVICE_INLINE u64 id() { return blockIdx.x; }
  static MSCCLPP_DEVICE_INLINE u64 count() { return gridDim.x; }
  static MSCCLPP_DEVICE_INLINE u32 tid() { return threadIdx.x; }
  static MSCCLPP_DEVICE_INLINE u32 nthreads() { return blockDim.x; }
  static MSCCLPP_DEVICE_INLINE void sync() { __syncthreads(); }
  static MSCCLPP_DEVICE_INLINE bool barrier(const D2DSemaphoreHandle* sems, u32 npeers, bool publish) {
    return block_barrier(sems, npeers, publish);
  }
};

struct WarpUnit {
  static MSCCLPP_DEVICE_INLINE u64 id() { return global_thread_id() / 32; }
  static MSCCLPP_DEVICE_INLINE u64 count() { return global_num_threads() / 32; }
  static MSCCLPP_DEVICE_INLINE u32 tid() { return threadIdx.x % 32; }
  static MSCCLPP_DEVICE_INLINE u32 nthreads() { return 32; }
  static MSCCLPP_DEVICE_INLINE void sync() { __syncwarp(); }
  static MSCCLPP_DEVICE_INLINE bool barrier(const D2DSemaphoreHandle* sems, u32 npeers, bool publish) {
    return warp_barrier(sems, id(), npeers, publish);
  }
};

// The pipelined all-reduce of `bytes` bytes. Unit u owns scratch bytes [u * unit_bytes, (u + 1) *
// unit_bytes) (unit_bytes a multiple of 16; the host checks count() * unit_bytes <= scratch.size)
// and handles chunks c = u, u + count(), ... of unit_bytes each. Every rank runs the same chunk
// list, so the k-th barrier of unit u pairs with the k-th barrier of unit u on every peer. A chunk
// whose length is not a multiple of 16 is zero-padded in the scratch; only its real bytes are
// copied out, so any element count works. A failed wait is recorded and the unit carries on, so
// barrier counts stay paired.
template <typename Unit>
MSCCLPP_DEVICE_INLINE void pipeline(const void* input, void* output, u64 bytes, const SwitchChannelHandle& scratch,
                                    u64 unit_bytes, u32 rank, u32 nranks, const D2DSemaphoreHandle* sems) {
  const u32 npeers = nranks - 1;
  const u64 unit = Unit::id();
  const u64 units = Unit::count();
  const u32 tid = Unit::tid();
  const u32 nt = Unit::nthreads();
  const u64 region = unit * unit_bytes;
  u8* local = static_cast<u8*>(scratch.device_ptr) + region;
  const u64 nchunks = (bytes + unit_bytes - 1) / unit_bytes;
  for (u64 c = unit; c < nchunks; c += units) {
    const u64 off = c * unit_bytes;
    const u64 len = min(unit_bytes, bytes - off);
    const u64 padded = (len + kVecBytes - 1) / kVecBytes * kVecBytes;
    copy(local, static_cast<const u8*>(input) + off, len, tid, nt);
    for (u64 b = len + tid; b < padded; b += nt) local[b] = 0;
    alias_fence();
    Unit::barrier(sems, npeers, true);  // every rank's chunk is in its scratch
    u64 begin, end;
    rank_share(padded / kVecBytes, rank, nranks, begin, end);
    reduce_broadcast_range(scratch, scratch, region, begin, end, tid, nt);
    alias_fence();
    Unit::barrier(sems, npeers, true);  // every share's sum is in every rank's scratch
    copy(static_cast<u8*>(output) + off, local, len, tid, nt);
    // The next chunk's copy-in overwrites what other threads of the unit may still be copying out.
    Unit::sync();
  }
}

// input/output: SwitchChannels whose device_ptr/mc_ptr address the user's buffers (the same
// channel twice in place). bytes: a multiple of 16 (the host refuses others).
extern "C" __global__ void __launch_bounds__(1024, 1) allreduce_nvls_zero_copy(const NvlsArgs args) {
  wait_prior_grids();
  const SwitchChannelHandle input = args.input_channel;
  const SwitchChannelHandle output = args.output_channel;
  const u64 bytes = args.bytes;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  const D2DSemaphoreHandle* sems = args.sems;
  const u32 npeers = nranks - 1;
  // A peer block past this barrier means the peer's kernel started, so everything its stream wrote
  // to its input before is complete.
  block_barrier(sems, npeers, false);
  u64 begin, end;
  rank_share(bytes / kVecBytes, rank, nranks, begin, end);
  reduce_broadcast_range(input, output, 0, begin, end, global_thread_id(), global_num_threads());
  alias_fence();
  // When every block of this rank is past it, every block of every peer has broadcast its share.
  block_barrier(sems, npeers, true);
}

// scratch: multicast-bound, unit_bytes per block. sems: gridDim.x blocks x npeers.
extern "C" __global__ void __launch_bounds__(1024, 1) allreduce_nvls_block_pipeline(const NvlsArgs args) {
  wait_prior_grids();
  pipeline<BlockUnit>(args.input, args.output, args.bytes, args.scratch, args.unit_bytes, args.rank, args.nranks,
                  args.sems);
}

// scratch: multicast-bound, unit_bytes per warp. sems: (gridDim.x * blockDim.x / 32) warps x npeers.
extern "C" __global__ void __launch_bounds__(1024, 1) allreduce_nvls_warp_pipeline(const NvlsArgs args) {
  wait_prior_grids();
  pipeline<WarpUnit>(args.input, args.output, args.bytes, args.scratch, args.unit_bytes, args.rank, args.nranks,
                  args.sems);
}

// count elements. scratch: multicast-bound, 2 parity halves x nranks slots of ceil(bytes / 8) LL16
// packets (the host checks the size). Rank s writes slot s of the half (call & 1) of every rank; the
// flag changes every call, so nothing is reset. Why two halves suffice: a peer that writes call
// N + 2 into the half of call N has read this rank's call-N+1 packets, which this rank writes only
// after its call-N kernel (stream order) has finished reading that half.
// Each packet index is read from the input and written to the output by the same thread, so the
// kernel is correct in place. Sums run in rank order: every rank gets bit-identical results.
extern "C" __global__ void __launch_bounds__(1024, 1) allreduce_nvls_packet(const NvlsArgs args) {
  wait_prior_grids();
  const void* input = args.input;
  void* output = args.output;
  const u64 count = args.count;
  const SwitchChannelHandle scratch = args.scratch;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  CallState* state = args.state;
  u32* error_word = args.error_word;
  const u64 max_spin = args.max_spin;
  const u64 calls = load_call_count(state);
  const u32 flag = call_flag(calls);
  const u64 bytes = count * sizeof(NvlsT);
  const u64 npk = packet_count<LL16Packet>(bytes);
  const u64 half = (calls & 1) * nranks * npk;
  const u8* in = static_cast<const u8*>(input);
  u8* out = static_cast<u8*>(output);
  const bool in_aligned = reinterpret_cast<u64>(in) % LL16Packet::kPayloadBytes == 0;
  const bool out_aligned = reinterpret_cast<u64>(out) % LL16Packet::kPayloadBytes == 0;
  const u64 tid = global_thread_id();
  const u64 nthreads = global_num_threads();
  for (u64 i = tid; i < npk; i += nthreads) {
    const u64 p = load_payload<LL16Packet>(in, bytes, i, in_aligned);
    // The packet's {data1, flag1, data2, flag2} words as one 16-byte multimem store; a store moves
    // the bits unchanged, so the f32 vector is only a carrier.
    f32x4 w;
    w.data[0] = __uint_as_float(static_cast<u32>(p));
    w.data[1] = __uint_as_float(flag);
    w.data[2] = __uint_as_float(static_cast<u32>(p >> 32));
    w.data[3] = __uint_as_float(flag);
    scratch.broadcast<f32x4>((half + rank * npk + i) * sizeof(LL16Packet), w);
  }
  const LL16Packet* local = static_cast<const LL16Packet*>(scratch.device_ptr);
  for (u64 i = tid; i < npk; i += nthreads) {
    VecAccumulator<NvlsT, NvlsT, kReduceSum, u64> acc;
    for (u32 s = 0; s < nranks; ++s) {
      u64 v = 0;
      if (s == rank) {
        v = load_payload<LL16Packet>(in, bytes, i, in_aligned);
      } else if (!local[half + s * npk + i].read(flag, v, max_spin, error_word)) {
        v = 0;  // recorded in the error word; the host reports it after synchronising
      }
      if (s == 0) {
        acc.init(v);
      } else {
        acc.add(v);
      }
    }
    store_payload<LL16Packet>(out, bytes, i, acc.finish(nranks), out_aligned);
  }
  finish_call(state, calls);
}
