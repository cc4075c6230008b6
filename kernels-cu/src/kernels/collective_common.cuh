// mscclpp-rs native collectives: pieces shared by allreduce.cu, allgather.cu, reduce_scatter.cu,
// broadcast.cu and reduce.cu. kernels-cu/src/collectives.rs prepends this text (after the per-unit
// #defines of MSCCLPP_COLL_T / MSCCLPP_COLL_ACC / MSCCLPP_COLL_OP where the unit reduces) to each
// kernel file, so every translation unit is self-contained and only the device library's headers
// are #included.
//
// Conventions of every native collective kernel:
//   - Grids are co-resident (the host caps blocks so that all of them fit on the GPU at once): blocks
//     wait for peers' blocks, and a peer's block that could never be scheduled would dead-lock them.
//   - Every block runs to the end (to finish_call) even when a wait gave up, so the call counter
//     advances exactly once per call on every rank and the next call stays in step.
//   - Peers are numbered by "peer index" i in [0, nranks-1): i -> rank (i < rank ? i : i + 1).
//   - Every kernel begins with wait_prior_grids(), so the host may launch it programmatically
//     (LaunchConfig::programmatic): its launch overlaps the end of the stream's previous kernel.
//   - Then `if (block_aborted(args.error_word)) return;` (or block_enter, which also reads the call
//     counter): after an abort or a timed-out wait anywhere on the communicator, every later kernel
//     drains at once. The check comes after the wait, not before: a grid that returned before
//     griddepcontrol.wait could complete while its predecessor still runs, and the stream's next
//     kernel (waiting only on us) would then overlap it.
#pragma once
#include "mscclpp/common.cuh"
#include "mscclpp/copy.cuh"
#include "mscclpp/error.cuh"
#include "mscclpp/packet.cuh"
#include "mscclpp/reduce.cuh"
#include "mscclpp/semaphore.cuh"

namespace mscclpp {
// Complete in port_channel.cuh, which the units of port_allreduce include.
struct PortChannelHandle;

namespace coll {

// Largest world size the native collectives support (one NVLink domain of one host). Mirrored by
// mscclpp_kernels_cu::collectives::MAX_RANKS.
constexpr u32 kMaxRanks = 8;

// Per-rank addresses, indexed by rank, passed by value as a kernel parameter (so nothing has to be
// uploaded per call). Mirrored by mscclpp_kernels_cu::collectives::PeerPtrs (64 bytes).
struct PeerPtrs {
  void* p[kMaxRanks];
};

// Largest grid of any kernel that uses CallState. The host caps the packet kernels' grids at this
// (mscclpp_kernels_cu::collectives::MAX_PACKET_BLOCKS).
constexpr u32 kMaxPacketBlocks = 1024;

// Device-resident call counter of one algorithm object, one copy per block slot. The kernel itself
// advances it, so CUDA-graph replays keep packet flags fresh with no host involvement. Mirrored by
// mscclpp_kernels_cu::collectives::CallState (8 KiB, zero-initialised by the host).
//
// Why one slot per block instead of one shared counter: a shared counter needs the blocks of a call
// to agree on who advances it (an atomic arrival count plus fences), which sat on the critical path
// of every small call. Here block b reads only calls[b] and, when done, writes every slot
// k = b (mod gridDim.x). Every slot is written by exactly one block per call, so after each call all
// slots hold the same count and a later call with any grid size (<= kMaxPacketBlocks) reads the same
// value in every block. Within a call no block reads a slot another block writes (block b' reads
// slot b' < gridDim.x, which only block b' writes), so no ordering between blocks is needed; the
// next call sees the writes because kernels on one stream are ordered.
struct CallState {
  u64 calls[kMaxPacketBlocks];
};

// Kernel arguments: every native kernel takes exactly one of these structs by value, the one of its
// family. Each is declared once here and once in Rust (mscclpp_core::device, same names and field
// order); static_asserts generated from the Rust layout are compiled against this file
// (mscclpp_kernels_cu::collectives::layout_asserts), so the two cannot drift. Every struct carries
// the communicator's error word and the spin bound of every wait (0 = kDefaultMaxSpin).

// The LL-packet kernels. `count`: elements (all-reduce), bytes (all-gather), elements per chunk
// (reduce-scatter). The call with counter c uses the scratch half at (c & 1) * half_bytes.
struct PacketArgs {
  const void* input;
  void* output;
  u64 count;
  PeerPtrs peer_scratch;
  const void* local_scratch;
  u64 slot_bytes;
  u64 half_bytes;
  CallState* state;
  u32* error_word;
  u64 max_spin;
  u32 rank;
  u32 nranks;
};

// The scratch pipelines (see "Scratch pipelines" below). `peer_outputs` (every rank's registered
// output) is read by allreduce_rsag_push only.
struct PipelineArgs {
  const void* input;
  void* output;
  u64 count;
  PeerPtrs peer_scratch;
  PeerPtrs peer_outputs;
  void* local_scratch;
  u64 slot_bytes;
  u64 half_bytes;
  u64 step;
  const D2DSemaphoreHandle* sems;
  CallState* state;
  u32* error_word;
  u64 max_spin;
  u32 rank;
  u32 nranks;
};

// The kernels on registered user buffers; each reads the fields its collective needs.
struct ZeroCopyArgs {
  PeerPtrs inputs;
  PeerPtrs outputs;
  const void* input;
  void* output;
  u64 count;
  const D2DSemaphoreHandle* sems;
  u32* error_word;
  u64 max_spin;
  u32 rank;
  u32 root;
  u32 nranks;
  u32 pad;
};

// The copy-engine all-reduce: allreduce_ce_reduce reads srcs..nranks, allreduce_ce_sync sems,
// npeers and mode.
struct CopyEngineArgs {
  PeerPtrs srcs;
  void* output;
  u64 count;
  const D2DSemaphoreHandle* sems;
  u32* error_word;
  u64 max_spin;
  u32 nsrc;
  u32 nranks;
  u32 npeers;
  u32 mode;
};

// The PortChannel all-reduce (collectives/src/port_allreduce.cu): port_allreduce_exchange reads
// chans, calls, bytes, slot_stride, npeers, rank and nranks; port_allreduce_reduce input,
// output, scratch, calls, count, slot_stride, rank and nranks.
struct PortAllreduceArgs {
  const PortChannelHandle* chans;
  const void* input;
  void* output;
  void* scratch;
  u64* calls;
  u64 bytes;
  u64 count;
  u64 slot_stride;
  u32 npeers;
  u32 rank;
  u32 nranks;
  u32 pad;
};

MSCCLPP_DEVICE_INLINE u32 peer_rank(u32 index, u32 rank) { return index < rank ? index : index + 1; }

// The packet flag of call number `calls`: never 0 (fresh scratch is zero) and different from the
// previous call's flag, also across the wrap-around.
MSCCLPP_DEVICE_INLINE u32 call_flag(u64 calls) { return static_cast<u32>(calls % 0xFFFFFFFFull) + 1u; }

// Reads this block's slot of the call counter once per block (thread 0, shared with the block).
MSCCLPP_DEVICE_INLINE u64 load_call_count(const CallState* state) {
  __shared__ u64 calls;
  if (threadIdx.x == 0) calls = state->calls[blockIdx.x];
  __syncthreads();
  return calls;
}

// The entry of a kernel with a call counter, after wait_prior_grids(): block_aborted and
// load_call_count in one. Thread 0 sends both reads out before it waits for either and the block
// meets once; read in turn they were two memory round trips, one after the other, on the critical
// path of every small call. True when the communicator failed (the kernel returns); `calls` is
// this block's call count otherwise.
MSCCLPP_DEVICE_INLINE bool block_enter(const u32* error_word, const CallState* state, u64& calls) {
  __shared__ u64 shared_calls;
  bool failed = false;
  if (threadIdx.x == 0) {
    shared_calls = state->calls[blockIdx.x];
    failed = aborted_at_entry(error_word);
  }
  if (__syncthreads_or(failed)) return true;
  calls = shared_calls;
  return false;
}

// Calls f(k) for every k < copies that this block owns (k = blockIdx.x mod gridDim.x), spread over
// its threads: how a kernel whose blocks each read their own copy of a counter (copy blockIdx.x)
// leaves the advanced count in every copy for the next kernel, whatever its grid, with no block
// waiting for another (finish_call; the point-to-point engine's p2p_finish).
template <typename F>
MSCCLPP_DEVICE_INLINE void for_each_owned_copy(u32 copies, F f) {
  for (u32 k = blockIdx.x + threadIdx.x * gridDim.x; k < copies; k += blockDim.x * gridDim.x) f(k);
}

// Every block calls this last, with the count load_call_count or block_enter gave: advances the
// slots this block owns (for_each_owned_copy) by `steps`. No
// barrier is needed: the block's own slot was read before the barrier of load_call_count (or
// block_enter), and the other slots it writes are read by no block of this call. The packet
// kernels advance by one (one flag per call); the scratch pipelines advance by their step count, so
// the parity of the counter alternates their double-buffered halves step after step, across calls
// too.
MSCCLPP_DEVICE_INLINE void finish_call(CallState* state, u64 calls, u64 steps = 1) {
  const u64 next = calls + steps;
  for_each_owned_copy(kMaxPacketBlocks, [&](u32 k) { state->calls[k] = next; });
}

// Barrier of this block with the same-numbered block of every peer, through the block's own
// semaphores sems[blockIdx.x * npeers + i]. `publish`: every thread first fences its earlier writes
// (remote stores into peers' buffers) at system scope, so the peers see them once they pass the
// barrier. Returns false (error word set) if a peer did not arrive within the spin bound.
// Requires blockDim.x >= npeers.
MSCCLPP_DEVICE_INLINE bool block_barrier(const D2DSemaphoreHandle* sems, u32 npeers, bool publish) {
  __shared__ int ok;
  if (publish) fence_acq_rel_sys();
  __syncthreads();
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  if (threadIdx.x < npeers) {
    const D2DSemaphoreHandle& s = sems[static_cast<u64>(blockIdx.x) * npeers + threadIdx.x];
    s.signal();
    if (!s.wait()) ok = 0;
  }
  __syncthreads();
  return ok != 0;
}

// Scratch pipelines (allreduce_rsag, allreduce_rsag_push, allreduce_fullmesh, allgather_fullmesh):
// inputs that are not registered are staged through the algorithm's scratch, which every peer maps
// (allreduce_rsag_push registers only the outputs). The
// message is cut into steps that fit the scratch; per step a rank pushes (remote stores) into the
// peers' scratch, then the block barrier publishes the stores, then each rank consumes its own
// scratch locally. Rules that make the reuse of scratch safe without extra barriers:
//   - Within a call every step uses the same per-block partition (block_range of the fixed step
//     size, the last step clamped to the message), so block b of every rank touches the same scratch
//     bytes in every step and its barrier with the peers' block b orders exactly those bytes.
//   - Double-buffered halves alternate by the parity of (CallState count + step index); the kernel
//     advances the count by its step count, so halves keep alternating across calls (and CUDA-graph
//     replays) with no host involvement. A push into half h of step k waits for nothing: the peer's
//     last reads of half h were in step k - 2, before the barrier of step k - 1 that this rank
//     already passed (for k < 2, the previous call: this rank's previous kernel passed every barrier
//     of it, so every block of every peer finished its reads of that call).
// Their argument is PipelineArgs; slot_bytes and half_bytes are multiples of 16, step is in the
// kernel's units (elements or bytes) and a whole number of 16-byte vectors.

// Which half of a scratch pipeline step k of the call that read `calls` uses, as a byte offset.
MSCCLPP_DEVICE_INLINE u64 pipeline_half(u64 calls, u64 k, u64 half_bytes) { return ((calls + k) & 1) * half_bytes; }

// Splits `n` items over the grid's blocks in contiguous ranges of whole `align`-item groups; the
// last block also takes the remainder. Used by the copy kernels, whose per-block copies use the
// block's threads.
MSCCLPP_DEVICE_INLINE void block_range(u64 n, u64 align, u64& begin, u64& end) {
  const u64 groups = (n + align - 1) / align;
  const u64 per = (groups + gridDim.x - 1) / gridDim.x;
  begin = min(static_cast<u64>(blockIdx.x) * per * align, n);
  end = min(begin + per * align, n);
}

// One LL128 line of a packet reduction, for lane t of its 8 lanes: line j of this rank's own data
// (`own`, `bytes` long) reduced with every peer's line in `scratch` (peer s's at
// s * slot_bytes + at), in rank order so every rank computes bit-identical results. Every lane of
// the warp must call it together (the reads vote); inactive lanes read nothing. Returns false
// after a timed-out read (recorded in the error word); {r0, r1} is lane t's part of the result.
template <typename T, typename AccT, int Op>
MSCCLPP_DEVICE_INLINE bool reduce_line(const u8* own, u64 bytes, bool own_aligned, u64 j, u32 t, bool active,
                                       const u8* scratch, u64 slot_bytes, u64 at, u32 rank, u32 nranks, u64 flag,
                                       u64 max_spin, u32* error_word, u64& r0, u64& r1) {
  VecAccumulator<T, AccT, Op, u64> acc0, acc1;
  bool ok = true;
  for (u32 s = 0; s < nranks && ok; ++s) {
    u64 a = 0, b = 0;
    if (s == rank) {
      if (active) {
        a = LL128::load_word(own, bytes, own_aligned, j, t, 0);
        b = LL128::has_second(t) ? LL128::load_word(own, bytes, own_aligned, j, t, 1) : 0;
      }
    } else {
      ok = LL128::read(scratch + s * slot_bytes + at, t, active, flag, a, b, max_spin, error_word);
    }
    if (s == 0) {
      acc0.init(a);
      acc1.init(b);
    } else {
      acc0.add(a);
      acc1.add(b);
    }
  }
  r0 = acc0.finish(nranks);
  r1 = acc1.finish(nranks);
  return ok;
}

// Cooperative reduction of `n` elements by `stride` threads (this one is number `tid`): for each
// element e,
//   dsts.p[d][dst_off + e] = reduce over k in [0, nsrc) of srcs.p[k][src_off + e]   for d < ndst.
// Sources are combined in the order first, first + 1, ... (mod nsrc), and destinations written in
// that order too. Where several ranks compute the same element they must pass the same `first` (0)
// so their results are bit-identical; where one rank owns each element (the zero-copy kernels) it
// passes its own rank, so the ranks' reads and writes start at different peers instead of every
// rank hitting rank 0's links first. Uses 16-byte loads/stores when every address involved is 16-byte
// aligned, else element accesses. Each element is read and written by one thread, so a destination
// may alias a source (in place).
template <typename T, typename AccT, int Op>
MSCCLPP_DEVICE_INLINE void reduce_to_all(const PeerPtrs& srcs, u32 nsrc, u64 src_off, const PeerPtrs& dsts,
                                         u32 ndst, u64 dst_off, u64 n, u32 nranks, u32 first, u64 tid,
                                         u64 stride) {
  // Source / destination number j of the rotated order.
  auto src = [&](u32 j) { return static_cast<const T*>(srcs.p[(first + j) % nsrc]) + src_off; };
  auto dst = [&](u32 j) { return static_cast<T*>(dsts.p[(first + j) % ndst]) + dst_off; };
  constexpr u64 kVec = sizeof(uint4) / sizeof(T);
  // Vectors each thread keeps in flight per source: NVLink reads need many outstanding loads.
  constexpr u32 kReduceUnroll = 4;
  bool aligned = true;
  for (u32 k = 0; k < nsrc; ++k) aligned = aligned && reinterpret_cast<u64>(src(k)) % 16 == 0;
  for (u32 d = 0; d < ndst; ++d) aligned = aligned && reinterpret_cast<u64>(dst(d)) % 16 == 0;
  u64 scalar_begin = 0;
  if (aligned) {
    const u64 nv = n / kVec;
    u64 v = tid;
    for (; v + (kReduceUnroll - 1) * stride < nv; v += kReduceUnroll * stride) {
      VecAccumulator<T, AccT, Op, uint4> acc[kReduceUnroll];
      uint4 w[kReduceUnroll];
      const uint4* s0 = reinterpret_cast<const uint4*>(src(0));
#pragma unroll
      for (u32 u = 0; u < kReduceUnroll; ++u) w[u] = s0[v + u * stride];
#pragma unroll
      for (u32 u = 0; u < kReduceUnroll; ++u) acc[u].init(w[u]);
      for (u32 k = 1; k < nsrc; ++k) {
        const uint4* s = reinterpret_cast<const uint4*>(src(k));
#pragma unroll
        for (u32 u = 0; u < kReduceUnroll; ++u) w[u] = s[v + u * stride];
#pragma unroll
        for (u32 u = 0; u < kReduceUnroll; ++u) acc[u].add(w[u]);
      }
#pragma unroll
      for (u32 u = 0; u < kReduceUnroll; ++u) w[u] = acc[u].finish(nranks);
      for (u32 d = 0; d < ndst; ++d) {
        uint4* o = reinterpret_cast<uint4*>(dst(d));
#pragma unroll
        for (u32 u = 0; u < kReduceUnroll; ++u) o[v + u * stride] = w[u];
      }
    }
    for (; v < nv; v += stride) {
      VecAccumulator<T, AccT, Op, uint4> acc;
      acc.init(reinterpret_cast<const uint4*>(src(0))[v]);
      for (u32 k = 1; k < nsrc; ++k) acc.add(reinterpret_cast<const uint4*>(src(k))[v]);
      const uint4 r = acc.finish(nranks);
      for (u32 d = 0; d < ndst; ++d) reinterpret_cast<uint4*>(dst(d))[v] = r;
    }
    scalar_begin = nv * kVec;
  }
  for (u64 e = scalar_begin + tid; e < n; e += stride) {
    VecAccumulator<T, AccT, Op, T> acc;
    acc.init(src(0)[e]);
    for (u32 k = 1; k < nsrc; ++k) acc.add(src(k)[e]);
    const T r = acc.finish(nranks);
    for (u32 d = 0; d < ndst; ++d) dst(d)[e] = r;
  }
}

// reduce_to_all over the whole grid (zero-copy kernels, whose data needs no per-block handshake).
template <typename T, typename AccT, int Op>
MSCCLPP_DEVICE_INLINE void reduce_to_all(const PeerPtrs& srcs, u32 nsrc, u64 src_off, const PeerPtrs& dsts,
                                         u32 ndst, u64 dst_off, u64 n, u32 nranks, u32 first) {
  reduce_to_all<T, AccT, Op>(srcs, nsrc, src_off, dsts, ndst, dst_off, n, nranks, first, global_thread_id(),
                             global_num_threads());
}

// The zero-copy reductions of registered inputs into one local output (reduce_zero_copy,
// reducescatter_zero_copy; ZeroCopyArgs): `args.count` elements at element `src_off` of every rank's
// input, read directly over NVLink, are reduced into `args.output` (in rank order from `first`)
// where `reduces` is set; the other ranks only take part in the barriers. Start barrier: every
// input holds this call's data. End barrier: no rank returns (and lets its input be reused) while
// another may still read it. Only local stores happen, so the end barrier publishes nothing. In
// place (the output over the reduced part of this rank's input) is safe: each element is read and
// written by the one thread that reduces it.
template <typename T, typename AccT, int Op>
MSCCLPP_DEVICE_INLINE void zero_copy_reduce(const ZeroCopyArgs& args, bool reduces, u64 src_off, u32 first) {
  const u32 npeers = args.nranks - 1;
  if (!block_barrier(args.sems, npeers, false)) return;
  if (reduces) {
    PeerPtrs out;
    out.p[0] = args.output;
    reduce_to_all<T, AccT, Op>(args.inputs, args.nranks, src_off, out, 1, 0, args.count, args.nranks, first);
  }
  block_barrier(args.sems, npeers, false);
}

#ifdef MSCCLPP_COLL_T
// A reducing unit's element type, accumulator and op, from the #defines collectives.rs prepends.
typedef MSCCLPP_COLL_T CollT;
typedef MSCCLPP_COLL_ACC CollAcc;
constexpr int kCollOp = MSCCLPP_COLL_OP;
#endif

}  // namespace coll
}  // namespace mscclpp
