// mscclpp-rs native all-gather kernels (see collective_common.cuh for the shared conventions).
// Byte-oriented: one unit serves every data type.
//
// Entry points:
//   allgather_packet     small messages: every rank sends its input to every peer in LL128 lines
//   allgather_fullmesh2  large messages on registered outputs (zero-copy, two barriers)
//   allgather_fullmesh   unregistered buffers: pushed through the peers' scratch in pipelined steps
//
// allgather_fullmesh2 (zero-copy, registered outputs): rank r pushes its input into slot r of every
// rank's output with SM stores over NVLink.
//   outputs  every rank's output mapped here (own at `rank`); slot r = [r * bytes, (r + 1) * bytes)
//   sems     per (block, peer) semaphores: sems[b * (nranks - 1) + i]
// Start barrier: every peer's output may be written (its earlier work on it is done).
// End barrier (with a system fence): my stores are visible to each peer, and theirs to me, before the
// kernel ends. In-place (input == my slot of my output) skips the local copy.

using namespace mscclpp;
using namespace mscclpp::coll;

extern "C" __global__ void __launch_bounds__(1024, 1)
    allgather_fullmesh2(const ZeroCopyArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  const void* input = args.input;
  const PeerPtrs& outputs = args.outputs;
  const u64 bytes = args.count;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  const D2DSemaphoreHandle* sems = args.sems;
  const u32 npeers = nranks - 1;
  u64 begin, end;
  block_range(bytes, 16, begin, end);
  const u8* src = static_cast<const u8*>(input);
  if (block_barrier(sems, npeers, false)) {
    // Peers first (in an order that differs per rank so no single link takes every block's traffic
    // at once), then the local slot.
    for (u32 i = 0; i < nranks; ++i) {
      const u32 dst_rank = (rank + 1 + i) % nranks;
      u8* dst = static_cast<u8*>(outputs.p[dst_rank]) + static_cast<u64>(rank) * bytes;
      if (dst == src) continue;
      copy(dst + begin, src + begin, end - begin, threadIdx.x, blockDim.x);
    }
    block_barrier(sems, npeers, true);
  }
}

// ------------------------------------------------------------------------------------------------
// Packet all-gather through LL128 lines (packet.cuh): no semaphores, no barriers; the lines' flags
// are the only synchronisation.
//   peer_scratch  every rank's scratch mapped here (own entry unused)
//   local_scratch this rank's scratch: 2 halves (call-count parity) x nranks slots of slot_bytes
//                 (slot_bytes >= lines(bytes) * 128); rank s writes its lines into slot s of the
//                 current half of each peer.
// Parity double buffering is enough for the reason given at allreduce_allpair_packet: a rank that
// starts call N+2 (reusing call N's half) has finished call N+1, so it has read every peer's
// call-N+1 lines, which each peer sends only after its call-N kernel (all its reads of half N)
// ended.
// In place (input == slot `rank` of output): the own slot is not copied, and no other slot overlaps
// the input, so reading the input and writing the peers' slots never conflict.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024, 1)
    allgather_packet(const PacketArgs args) {
  wait_prior_grids();
  u64 calls;
  if (block_enter(args.error_word, args.state, calls)) return;
  const void* input = args.input;
  void* output = args.output;
  const u64 bytes = args.count;
  const PeerPtrs& peer_scratch = args.peer_scratch;
  const void* local_scratch = args.local_scratch;
  const u64 slot_bytes = args.slot_bytes;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  CallState* state = args.state;
  u32* error_word = args.error_word;
  const u64 max_spin = args.max_spin;
  const u64 flag = call_flag(calls);
  const u64 half = (calls & 1) * args.half_bytes;
  const u64 nlines = LL128::lines(bytes);
  const u8* in = static_cast<const u8*>(input);
  u8* out = static_cast<u8*>(output);
  u8* own = out + static_cast<u64>(rank) * bytes;
  const bool copy_own = own != in;
  const bool in_aligned = reinterpret_cast<u64>(in) % 8 == 0;
  const bool own_aligned = reinterpret_cast<u64>(own) % 8 == 0;
  const u32 npeers = nranks - 1;
  const LineLanes me;
  const u32 t = me.t;
  const bool has_second = LL128::has_second(t);

  // Send: each lane's words are loaded once and stored to every peer (remote stores do not wait),
  // and to the own slot of the output.
  for (u64 j = me.first + me.sub; j < nlines; j += me.stride) {
    const u64 a = LL128::load_word(in, bytes, in_aligned, j, t, 0);
    const u64 b = has_second ? LL128::load_word(in, bytes, in_aligned, j, t, 1) : flag;
    for (u32 i = 0; i < npeers; ++i) {
      u8* dst = static_cast<u8*>(peer_scratch.p[peer_rank(i, rank)]) + half + static_cast<u64>(rank) * slot_bytes +
                j * LL128::kLineBytes;
      LL128::store(dst, t, a, b);
    }
    if (copy_own) LL128::unpack(own, bytes, own_aligned, j, t, a, b);
  }
  // Receive: one warp-uniform loop over (peer index, line) (reads vote).
  const u8* scratch = static_cast<const u8*>(local_scratch) + half;
  const u64 total = npeers * nlines;
  bool ok = true;
  for (u64 base = me.first; ok && base < total; base += me.stride) {
    const u64 x = base + me.sub;
    const bool active = x < total;
    const u32 s = peer_rank(static_cast<u32>(min(x, total - 1) / nlines), rank);
    const u64 j = x % nlines;
    u64 a = 0, b = 0;
    ok = LL128::read(scratch + s * slot_bytes + j * LL128::kLineBytes, t, active, flag, a, b, max_spin, error_word);
    if (ok && active) {
      u8* dst = out + static_cast<u64>(s) * bytes;
      LL128::unpack(dst, bytes, reinterpret_cast<u64>(dst) % 8 == 0, j, t, a, b);
    }
  }
  finish_call(state, calls);
}

// ------------------------------------------------------------------------------------------------
// Full-mesh all-gather through the scratch (see "Scratch pipelines" in collective_common.cuh), for
// outputs that are not registered.
//   bytes    input bytes per rank; output slot r = [r * bytes, (r + 1) * bytes)
//   step     bytes per step (a multiple of 16, <= slot_bytes); step k covers [k * step, (k + 1) * step)
//            of every rank's input, clamped to bytes
//   scratch  half h at h * half_bytes: nranks slots of slot_bytes; rank s pushes into slot s.
// Schedule: A(0); then barriers j = 1..nsteps, each followed by A(j) and C(j - 1).
//   A(k): window k of my input -> slot `rank` of every peer's half (k) (remote stores), and -> my own
//         output slot when not in place
//   C(k): slot q of my half (k) -> window k of output slot q, q != rank (local)
// Scratch reuse: A(k) writes half (k) of a peer, last read there in C(k - 2), before its barrier k.
// In place (input == my output slot): only other slots are written, so reads of the input never
// conflict with writes.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024, 1)
    allgather_fullmesh(const PipelineArgs args) {
  wait_prior_grids();
  u64 calls;
  if (block_enter(args.error_word, args.state, calls)) return;
  const void* input = args.input;
  void* output = args.output;
  const u64 bytes = args.count;
  const PeerPtrs& peer_scratch = args.peer_scratch;
  void* local_scratch = args.local_scratch;
  const u64 slot_bytes = args.slot_bytes;
  const u64 half_bytes = args.half_bytes;
  const u64 step = args.step;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  const D2DSemaphoreHandle* sems = args.sems;
  CallState* state = args.state;
  const u32 npeers = nranks - 1;
  const u64 nsteps = (bytes + step - 1) / step;
  u64 b0, b1;
  block_range(step, 16, b0, b1);
  const u8* in = static_cast<const u8*>(input);
  u8* out = static_cast<u8*>(output);
  u8* own = out + static_cast<u64>(rank) * bytes;
  auto half = [&](void* scratch, u64 k) { return static_cast<u8*>(scratch) + pipeline_half(calls, k, half_bytes); };
  auto send = [&](u64 k) {
    const u64 lo = min(k * step + b0, bytes);
    const u64 hi = min(k * step + b1, bytes);
    if (lo >= hi) return;
    for (u32 i = 0; i < npeers; ++i) {
      const u32 p = (rank + 1 + i) % nranks;
      copy(half(peer_scratch.p[p], k) + rank * slot_bytes + b0, in + lo, hi - lo, threadIdx.x, blockDim.x);
    }
    if (own != in) copy(own + lo, in + lo, hi - lo, threadIdx.x, blockDim.x);
  };
  auto gather = [&](u64 k) {
    const u64 lo = min(k * step + b0, bytes);
    const u64 hi = min(k * step + b1, bytes);
    if (lo >= hi) return;
    const u8* mine = half(local_scratch, k);
    for (u32 i = 0; i < npeers; ++i) {
      const u32 q = (rank + 1 + i) % nranks;
      copy(out + static_cast<u64>(q) * bytes + lo, mine + q * slot_bytes + b0, hi - lo, threadIdx.x, blockDim.x);
    }
  };
  send(0);
  for (u64 j = 1; j <= nsteps; ++j) {
    if (!block_barrier(sems, npeers, true)) break;  // recorded in the error word
    if (j < nsteps) send(j);
    gather(j - 1);
  }
  finish_call(state, calls, nsteps);
}
