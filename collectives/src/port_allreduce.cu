// mscclpp-rs all-reduce over PortChannels (the host proxy moves the data with the copy engine).
// collectives/src/port_allreduce.rs builds one unit per (T, AccT, Op): it #defines MSCCLPP_COLL_T,
// MSCCLPP_COLL_ACC and MSCCLPP_COLL_OP, then prepends collective_common.cuh (for PeerPtrs and
// reduce_to_all), then this text.
//
// One call = a copy-engine copy of the input into the registered staging buffer (host-enqueued),
// then the two kernels below on the same stream:
//   port_allreduce_exchange  one warp: lane i puts the staging buffer into peer i's scratch with a
//                            signal, flushes (the staging buffer may be rewritten by the next call
//                            only once the proxy has read it), then waits for peer i's signal.
//   port_allreduce_reduce    every block: output = reduction, in rank order, of the own input and
//                            the peers' scratch slots. A second launch instead of a grid barrier:
//                            stream order is the barrier, and it costs no co-residency constraint.
//
// Scratch layout (bytes, fixed for the algorithm object): 2 parity halves x nranks slots of
// slot_stride; rank s writes into slot s of half (call & 1) of every peer. The call counter lives in
// device memory and is advanced by the exchange kernel itself, so CUDA-graph replays alternate
// halves with no host involvement.
// Why double buffering replaces a second signal round: a peer that puts call N+2 into the half of
// call N has finished the exchange of call N+1, which waited for this rank's call-N+1 signal, which
// this rank sends only after its call-N reduce (stream order) has finished reading that half.
#include "mscclpp/port_channel.cuh"

using namespace mscclpp;
using namespace mscclpp::coll;

typedef MSCCLPP_COLL_T PortT;
typedef MSCCLPP_COLL_ACC PortAcc;
constexpr int kPortOp = MSCCLPP_COLL_OP;

// Both kernels take the one PortAllreduceArgs (collective_common.cuh) of the segment.
// chans[i]: the channel towards peer index i (peer_rank(i, rank)), dst = that peer's scratch,
// src = this rank's staging buffer. Launched with one block of 32 threads; npeers <= 31.
// Every lane runs its put, flush and wait even after a failure during this call (recorded in the
// error word), so signal counts stay balanced with the peers; the counter advances exactly once.
// A call that starts after a failure (the word is sticky: the communicator is finished) pushes
// nothing: the proxy would copy into a peer that may be dead, and a queue of calls behind the
// failure drains without a round trip through the proxy each.
// __launch_bounds__(1024, 1) for its register cap (64 a thread, as every kernel of the host
// collections): the hierarchical all-reduce runs this block beside its host group's grid, which
// leaves it room only if the block needs no more of an SM than 32 threads of that grid do
// (hierarchical.rs, "Residency").
extern "C" __global__ void __launch_bounds__(1024, 1) port_allreduce_exchange(const PortAllreduceArgs args) {
  const PortChannelHandle* chans = args.chans;
  const u32 npeers = args.npeers;
  const u64 bytes = args.bytes;
  const u64 slot_stride = args.slot_stride;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  u64* calls = args.calls;
  if (block_aborted(chans[0].fifo.error_word)) return;
  const u64 call = *calls;
  const u32 lane = threadIdx.x;
  if (blockIdx.x == 0 && lane < npeers) {
    const PortChannelHandle chan = chans[lane];
    const u64 dst_offset = ((call & 1) * nranks + rank) * slot_stride;
    chan.put_with_signal(dst_offset, 0, bytes);
    chan.flush();
    chan.wait();
  }
  // Every lane has read `call` before lane 0 replaces it.
  __syncthreads();
  if (blockIdx.x == 0 && lane == 0) *calls = call + 1;
}

// output[e] = reduce over ranks s (in rank order) of (s == rank ? input : scratch slot s)[e], for
// e < count. Any grid; in place (input == output) is safe because each element is read and written
// by the same thread. `calls` was advanced by this call's exchange kernel.
extern "C" __global__ void __launch_bounds__(1024, 1) port_allreduce_reduce(const PortAllreduceArgs args) {
  const void* input = args.input;
  void* output = args.output;
  const u64 count = args.count;
  void* scratch = args.scratch;
  const u64 slot_stride = args.slot_stride;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  const u64* calls = args.calls;
  const u64 half = ((*calls - 1) & 1) * nranks * slot_stride;
  PeerPtrs srcs;
  PeerPtrs dsts;
#pragma unroll
  for (u32 s = 0; s < kMaxRanks; ++s) {
    srcs.p[s] = nullptr;
    dsts.p[s] = nullptr;
  }
  for (u32 s = 0; s < nranks && s < kMaxRanks; ++s) {
    srcs.p[s] = s == rank ? const_cast<void*>(input) : static_cast<void*>(static_cast<u8*>(scratch) + half + s * slot_stride);
  }
  dsts.p[0] = output;
  // Every rank reduces every element: rank order (first = 0) keeps their results bit-identical.
  reduce_to_all<PortT, PortAcc, kPortOp>(srcs, nranks, 0, dsts, 1, 0, count, nranks, 0);
}
