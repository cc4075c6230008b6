// mscclpp-rs native all-reduce kernels (see collective_common.cuh for the shared conventions).
// The unit is built for one (T, AccT, Op) triple: MSCCLPP_COLL_T, MSCCLPP_COLL_ACC and
// MSCCLPP_COLL_OP are #defined before this text by kernels-cu/src/collectives.rs.
//
// Entry points:
//   allreduce_allpair_packet   small messages: everyone sends everything to everyone as LL16 packets
//   allreduce_allpair_ll128    the same through LL128 lines (CUDA only), for mid-sized messages
//   allreduce_packet           two-phase (reduce-scatter + all-gather) through LL128 lines
//   allreduce_rsag_zero_copy   large messages on registered buffers: read peers' inputs over NVLink,
//                              write each reduced chunk into every rank's output
//   allreduce_rsag             reduce-scatter + all-gather staged through the scratch (unregistered
//                              buffers); several double-buffered steps for messages beyond the
//                              scratch (default_allreduce_rsag_pipeline)
//   allreduce_rsag_push        the same pipeline with the all-gather written straight into the
//                              peers' registered outputs: every byte moves by NVLink writes
//   allreduce_fullmesh         every rank pushes its whole input into every peer's scratch and
//                              reduces all of it locally (unregistered buffers, pipelined by steps)

using namespace mscclpp;
using namespace mscclpp::coll;

typedef LL16Packet Pkt;

// ------------------------------------------------------------------------------------------------
// All-pair packet all-reduce.
//   peer_scratch  every rank's scratch mapped here (own entry unused)
//   local_scratch this rank's scratch: 2 halves (call-count parity) x nranks slots of slot_bytes;
//                 rank s writes its packets into slot s of the current half of each peer.
// Why parity double buffering is enough: a rank that starts call N+2 (which reuses call N's half)
// has finished call N+1, which needed every peer's call-N+1 packets, which every peer sends only
// after it finished reading call N's packets.
// The same thread handles payload j in both loops, so in-place (input == output) is safe.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024, 1)
    allreduce_allpair_packet(const PacketArgs args) {
  wait_prior_grids();
  const void* input = args.input;
  void* output = args.output;
  const u64 count = args.count;
  const PeerPtrs& peer_scratch = args.peer_scratch;
  const void* local_scratch = args.local_scratch;
  const u64 slot_bytes = args.slot_bytes;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  CallState* state = args.state;
  u32* error_word = args.error_word;
  const u64 max_spin = args.max_spin;
  const u64 bytes = count * sizeof(CollT);
  const u64 npkt = packet_count<Pkt>(bytes);
  const u8* in = static_cast<const u8*>(input);
  u8* out = static_cast<u8*>(output);
  const bool in_aligned = reinterpret_cast<u64>(in) % Pkt::kPayloadBytes == 0;
  const bool out_aligned = reinterpret_cast<u64>(out) % Pkt::kPayloadBytes == 0;
  const u32 npeers = nranks - 1;
  const u64 tid = global_thread_id();
  const u64 stride = global_num_threads();
  // A thread's first payload (at small sizes its only one) is read before the entry's barrier, so
  // its memory round trip overlaps the entry's reads instead of following them.
  const u64 first = tid < npkt ? load_payload<Pkt>(in, bytes, tid, in_aligned) : 0;
  u64 calls;
  if (block_enter(error_word, state, calls)) return;
  const u32 flag = call_flag(calls);
  const u64 half = (calls & 1) * args.half_bytes;

  for (u64 j = tid; j < npkt; j += stride) {
    const u64 v = j == tid ? first : load_payload<Pkt>(in, bytes, j, in_aligned);
    for (u32 i = 0; i < npeers; ++i) {
      Pkt* dst = reinterpret_cast<Pkt*>(static_cast<u8*>(peer_scratch.p[peer_rank(i, rank)]) + half +
                                        rank * slot_bytes);
      dst[j].write(v, flag);
    }
  }
  const u8* scratch = static_cast<const u8*>(local_scratch) + half;
  for (u64 j = tid; j < npkt; j += stride) {
    // Peers in rank order (own input at its place) so every rank computes bit-identical results.
    VecAccumulator<CollT, CollAcc, kCollOp, u64> acc;
    bool ok = true;
    for (u32 s = 0; s < nranks && ok; ++s) {
      u64 v;
      if (s == rank) {
        v = j == tid ? first : load_payload<Pkt>(in, bytes, j, in_aligned);
      } else {
        ok = reinterpret_cast<const Pkt*>(scratch + s * slot_bytes)[j].read(flag, v, max_spin, error_word);
      }
      if (s == 0) {
        acc.init(v);
      } else {
        acc.add(v);
      }
    }
    if (!ok) break;  // recorded in the error word; later packets would time out too
    store_payload<Pkt>(out, bytes, j, acc.finish(nranks), out_aligned);
  }
  finish_call(state, calls);
}

// ------------------------------------------------------------------------------------------------
// All-pair all-reduce through LL128 lines: allreduce_allpair_packet's schedule with 1.07x its
// bytes on the wire instead of 2x, which wins once the message's bytes, not the latency, set the
// time (default_allreduce_allpair_ll128: the selector takes it above 32 KiB at 3-4 ranks and above
// 128 KiB at 2, see allpair_ll128_from).
//   local_scratch  this rank's part of the LL128 scratch: 2 halves (call-count parity) x nranks
//                  slots of slot_bytes (whole lines); rank s writes its input, line by line, into
//                  slot s of the current half of each peer.
// Lines go 4 to a warp (LineLanes); the reading loop is warp-uniform because a read votes. Parity
// double buffering is safe for the reason given at allreduce_allpair_packet. The same lanes handle
// line j in both loops, so in-place is safe. CUDA only (CUDA_ONLY_ENTRY_POINTS): not run on an AMD
// GPU yet, where an LL128 line carries 64 bytes.
// ------------------------------------------------------------------------------------------------
#if !defined(MSCCLPP_HIP)
extern "C" __global__ void __launch_bounds__(1024, 1)
    allreduce_allpair_ll128(const PacketArgs args) {
  wait_prior_grids();
  u64 calls;
  if (block_enter(args.error_word, args.state, calls)) return;
  const u64 bytes = args.count * sizeof(CollT);
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  const u32 npeers = nranks - 1;
  const u64 slot_bytes = args.slot_bytes;
  const u64 flag = call_flag(calls);
  const u64 half = (calls & 1) * args.half_bytes;
  const u64 nlines = LL128::lines(bytes);
  const u8* in = static_cast<const u8*>(args.input);
  u8* out = static_cast<u8*>(args.output);
  const bool in_aligned = reinterpret_cast<u64>(in) % 8 == 0;
  const bool out_aligned = reinterpret_cast<u64>(out) % 8 == 0;
  const LineLanes me;
  const u32 t = me.t;
  const bool has_second = LL128::has_second(t);
  for (u64 base = me.first; base < nlines; base += me.stride) {
    const u64 j = base + me.sub;
    if (j >= nlines) continue;
    const u64 a = LL128::load_word(in, bytes, in_aligned, j, t, 0);
    const u64 b = has_second ? LL128::load_word(in, bytes, in_aligned, j, t, 1) : flag;
    for (u32 i = 0; i < npeers; ++i) {
      u8* dst = static_cast<u8*>(args.peer_scratch.p[peer_rank(i, rank)]) + half + rank * slot_bytes +
                j * LL128::kLineBytes;
      LL128::store(dst, t, a, b);
    }
  }
  const u8* scratch = static_cast<const u8*>(args.local_scratch) + half;
  bool ok = true;
  for (u64 base = me.first; ok && base < nlines; base += me.stride) {
    const u64 j = base + me.sub;
    const bool active = j < nlines;
    u64 r0, r1;
    ok = reduce_line<CollT, CollAcc, kCollOp>(in, bytes, in_aligned, j, t, active, scratch, slot_bytes,
                                              j * LL128::kLineBytes, rank, nranks, flag, args.max_spin,
                                              args.error_word, r0, r1);
    // A timeout is recorded in the error word; later lines would time out too.
    if (ok && active) LL128::unpack(out, bytes, out_aligned, j, t, r0, r1);
  }
  finish_call(args.state, calls);
}
#endif

// ------------------------------------------------------------------------------------------------
// Two-phase packet all-reduce through LL128 lines (packet.cuh): 120 payload bytes per 128-byte line,
// so each phase moves 1.07x its bytes where LL16 packets moved 2x. The message's 8-byte words are
// cut into lines of 15 words; rank r owns lines [r * per, (r + 1) * per), per = ceil(lines / nranks).
//   phase 1: send the lines of chunk p of my input to peer p (its RS region, slot `rank`)
//   phase 2: reduce my chunk from my input and the peers' RS lines, store it, send the result to
//            every peer (its AG region, slot `rank`)
//   phase 3: receive every peer's reduced chunk from my AG region into my output
// Lines go 4 to a warp (LineLanes); the loops that read are warp-uniform because a read votes
// across the warp. local_scratch layout: [parity half][RS, AG][nranks slots of slot_bytes];
// slot_bytes >= per * 128. Parity double buffering is safe for the reason given at
// allreduce_allpair_packet (every call reads every peer's lines of that call). In place is safe:
// output chunk q is written only after peer q's result arrived, and that result needs my phase-1
// lines of chunk q, which read my input first.
// ------------------------------------------------------------------------------------------------
// Below this input size the two-phase all-reduce spreads its warps over the SMs (LineLanes).
constexpr u64 kSpreadLinesBelowBytes = 1 << 20;

extern "C" __global__ void __launch_bounds__(1024, 1)
    allreduce_packet(const PacketArgs args) {
  wait_prior_grids();
  u64 calls;
  if (block_enter(args.error_word, args.state, calls)) return;
  const void* input = args.input;
  void* output = args.output;
  const u64 count = args.count;
  const PeerPtrs& peer_scratch = args.peer_scratch;
  const void* local_scratch = args.local_scratch;
  const u64 slot_bytes = args.slot_bytes;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  CallState* state = args.state;
  u32* error_word = args.error_word;
  const u64 max_spin = args.max_spin;
  const u64 flag = call_flag(calls);
  const u64 region = nranks * slot_bytes;
  const u64 half = (calls & 1) * args.half_bytes;
  const u64 bytes = count * sizeof(CollT);
  const u64 nlines = LL128::lines(bytes);
  const u64 per = (nlines + nranks - 1) / nranks;
  const u8* in = static_cast<const u8*>(input);
  u8* out = static_cast<u8*>(output);
  const bool in_aligned = reinterpret_cast<u64>(in) % 8 == 0;
  const bool out_aligned = reinterpret_cast<u64>(out) % 8 == 0;
  const u32 npeers = nranks - 1;
  const LineLanes me(bytes < kSpreadLinesBelowBytes);
  const u32 t = me.t;
  const bool has_second = LL128::has_second(t);  // CUDA: lane 7's second word is the flag
  const u8* scratch = static_cast<const u8*>(local_scratch) + half;
  const u64 my_begin = min(static_cast<u64>(rank) * per, nlines);
  const u64 my_end = min(my_begin + per, nlines);
  bool ok = true;

  // Phase 1: one flat loop over (peer, line) so all warps stay busy whatever the sizes.
  for (u64 x = me.first + me.sub; x < npeers * per; x += me.stride) {
    const u32 p = peer_rank(static_cast<u32>(x / per), rank);
    const u64 j = p * per + x % per;
    if (j >= nlines) continue;
    u8* dst = static_cast<u8*>(peer_scratch.p[p]) + half + rank * slot_bytes + (j - p * per) * LL128::kLineBytes;
    LL128::send(dst, in, bytes, in_aligned, j, t, flag);
  }
  // Phase 2 (warp-uniform loop: the reads vote).
  for (u64 base = my_begin + me.first; ok && base < my_end; base += me.stride) {
    const u64 j = base + me.sub;
    const bool active = j < my_end;
    const u64 at = (j - my_begin) * LL128::kLineBytes;
    u64 r0, r1;
    ok = reduce_line<CollT, CollAcc, kCollOp>(in, bytes, in_aligned, j, t, active, scratch, slot_bytes, at, rank,
                                              nranks, flag, max_spin, error_word, r0, r1);
    if (!ok || !active) continue;
    for (u32 i = 0; i < npeers; ++i) {
      u8* dst = static_cast<u8*>(peer_scratch.p[peer_rank(i, rank)]) + half + region + rank * slot_bytes + at;
      LL128::store(dst, t, r0, has_second ? r1 : flag);
    }
    LL128::unpack(out, bytes, out_aligned, j, t, r0, r1);
  }
  // Phase 3 (skipped after a timeout: the error word already says why the call failed).
  for (u64 base = me.first; ok && base < npeers * per; base += me.stride) {
    const u64 x = base + me.sub;
    const u32 q = peer_rank(static_cast<u32>(min(x, npeers * per - 1) / per), rank);
    const u64 k = x % per;
    const u64 j = q * per + k;
    const bool active = x < npeers * per && j < nlines;
    u64 a = 0, b = 0;
    ok = LL128::read(scratch + region + q * slot_bytes + k * LL128::kLineBytes, t, active, flag, a, b, max_spin,
                     error_word);
    if (ok && active) LL128::unpack(out, bytes, out_aligned, j, t, a, b);
  }
  finish_call(state, calls);
}

// ------------------------------------------------------------------------------------------------
// Zero-copy reduce-scatter + all-gather on registered ("symmetric") buffers.
//   inputs, outputs  every rank's input/output mapped here (own at `rank`)
//   sems             per (block, peer) semaphores: sems[b * (nranks - 1) + i]
// Rank r owns elements [r * per, (r + 1) * per) with per a whole number of 16-byte vectors; it reads
// them from every input, reduces in rank order and stores the result into every output.
// Start barrier: peers' inputs hold this call's data and their outputs may be written.
// End barrier (with a system fence): my stores into peers' outputs are visible to them, and no peer
// returns (and lets its input be reused) while I may still read it.
// In-place is safe: each element is read and written only by the one thread that reduces it.
// No call counter: semaphores are monotonic counters, so nothing here depends on the call number.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024, 1)
    allreduce_rsag_zero_copy(const ZeroCopyArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  const PeerPtrs& inputs = args.inputs;
  const PeerPtrs& outputs = args.outputs;
  const u64 count = args.count;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  const D2DSemaphoreHandle* sems = args.sems;
  constexpr u64 kVec = sizeof(uint4) / sizeof(CollT);
  const u32 npeers = nranks - 1;
  const u64 per = ((count + kVec - 1) / kVec + nranks - 1) / nranks * kVec;
  const u64 begin = min(static_cast<u64>(rank) * per, count);
  const u64 end = min(begin + per, count);
  if (block_barrier(sems, npeers, false)) {
    reduce_to_all<CollT, CollAcc, kCollOp>(inputs, nranks, begin, outputs, nranks, begin, end - begin, nranks,
                                           rank);
    block_barrier(sems, npeers, true);
  }
}

// ------------------------------------------------------------------------------------------------
// Reduce-scatter + all-gather through the scratch (see "Scratch pipelines" in collective_common.cuh),
// one body for two entry points: allreduce_rsag (kPush false) and allreduce_rsag_push (kPush true).
//   per         elements of each rank's chunk per step (a whole number of 16-byte vectors,
//               per * sizeof(T) <= slot_bytes); step k covers the window [k * W, (k + 1) * W) of the
//               message, W = nranks * per, and chunk q of it starts at k * W + q * per (clamped to
//               count: the last window's chunks may be short or empty).
//   scratch     half h at h * half_bytes. rsag: [RS: nranks slots][AG: nranks slots] of slot_bytes,
//               sender s in RS slot s. push: RS only, nranks - 1 slots, sender s in slot
//               push_slot(s, receiver) (the receiver's own chunk never goes through its scratch),
//               so a step is twice as large (and more) in the same scratch.
// Per step k:
//   A(k) send:   chunk p of my window -> RS slot of mine at peer p (remote stores)
//   B(k) reduce: my chunk from my input and my RS slots, in rank order -> my output, and
//                rsag: AG slot `rank` of every peer (remote stores);
//                push: chunk `rank` of window k of every peer's registered output (remote stores)
//   C(k) gather (rsag only): AG slot q -> chunk q of my output, q != rank (local)
// So push moves every byte over NVLink by writes, as rsag does, and skips the local gather copy
// (and the AG region); allreduce_rsag_zero_copy instead reads the peers' inputs.
// Schedule: A(0); then barriers j = 1..nsteps + 1, each publishing what came before it and followed
// by B(j - 1), A(j), C(j - 2) where they exist: RS(k) is published by barrier k + 1 and AG(k) by
// barrier k + 2 (push: B(k)'s stores into the outputs by barrier k + 2, the last by the final
// barrier nsteps + 1, after which every peer's stores into my output are visible), so a pipelined
// call costs nsteps + 1 barriers, not 2 * nsteps.
// Scratch reuse: B(k) writes AG half (k) of a peer, which that peer last read in C(k - 2), before its
// barrier k + 1; A(k) writes RS half (k), last read in B(k - 2), before barrier k. Both barriers are
// behind us when we write. default_allreduce_rsag is the same kernel on a message that fits one
// step (the host guarantees it).
// Peers' outputs (push): B(k) of block b writes peer q's output at the elements q's block b read
// from its input in its A(k) (the same memory in place), before barrier k + 1, which our block b has
// passed; so q is in this call too (its previous kernel on its stream is done with the output).
// Every block uses the same partition of every chunk, so the barrier of block b orders exactly the
// elements it writes.
// In place: A(k) reads window k before the barriers after which C(k) and B(k) (mine or, push, the
// peers') write it, and B's element e of my chunk is read and written by the same thread; windows of
// different steps are disjoint.
// ------------------------------------------------------------------------------------------------
// RS slot of `sender` in `receiver`'s scratch half under push: its peer index as the receiver sees it.
MSCCLPP_DEVICE_INLINE u32 push_slot(u32 sender, u32 receiver) { return sender < receiver ? sender : sender - 1; }

template <bool kPush>
MSCCLPP_DEVICE_INLINE void rsag_pipeline(const PipelineArgs& args) {
  const void* input = args.input;
  void* output = args.output;
  const u64 count = args.count;
  const PeerPtrs& peer_scratch = args.peer_scratch;
  void* local_scratch = args.local_scratch;
  const u64 slot_bytes = args.slot_bytes;
  const u64 half_bytes = args.half_bytes;
  const u64 per = args.step;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  const D2DSemaphoreHandle* sems = args.sems;
  CallState* state = args.state;
  constexpr u64 kVec = sizeof(uint4) / sizeof(CollT);
  const u64 calls = load_call_count(state);
  const u32 npeers = nranks - 1;
  const u64 window = per * nranks;
  const u64 nsteps = (count + window - 1) / window;
  const u64 slot = slot_bytes / sizeof(CollT);
  const u64 region = nranks * slot;  // elements from RS slot 0 to AG slot 0 (rsag)
  u64 b0, b1;
  block_range(per, kVec, b0, b1);
  const CollT* in = static_cast<const CollT*>(input);
  CollT* out = static_cast<CollT*>(output);
  // This block's elements [lo, hi) of chunk q of step k; when non-empty, lo sits at b0 of its slot.
  auto chunk = [&](u64 k, u32 q, u64& lo, u64& hi) {
    const u64 base = k * window + static_cast<u64>(q) * per;
    lo = min(base + b0, count);
    hi = min(base + b1, count);
  };
  auto half = [&](void* scratch, u64 k) {
    return reinterpret_cast<CollT*>(static_cast<u8*>(scratch) + pipeline_half(calls, k, half_bytes));
  };
  // Element offset, in a half of `receiver`, of the RS slot `sender` writes.
  auto rs_slot = [&](u32 sender, u32 receiver) { return (kPush ? push_slot(sender, receiver) : sender) * slot; };
  auto send = [&](u64 k) {
    for (u32 i = 0; i < npeers; ++i) {
      // Each rank starts with a different peer so the links share the load.
      const u32 p = (rank + 1 + i) % nranks;
      u64 lo, hi;
      chunk(k, p, lo, hi);
      if (lo < hi) {
        copy(half(peer_scratch.p[p], k) + rs_slot(rank, p) + b0, in + lo, (hi - lo) * sizeof(CollT), threadIdx.x,
             blockDim.x);
      }
    }
  };
  auto reduce = [&](u64 k) {
    u64 lo, hi;
    chunk(k, rank, lo, hi);
    if (lo >= hi) return;
    PeerPtrs srcs, dsts;
    CollT* rs = half(local_scratch, k);
    for (u32 r = 0; r < nranks; ++r) {
      srcs.p[r] = r == rank ? const_cast<CollT*>(in + lo) : rs + rs_slot(r, rank) + b0;
      if (r == rank) {
        dsts.p[r] = out + lo;
      } else if (kPush) {
        dsts.p[r] = static_cast<CollT*>(args.peer_outputs.p[r]) + lo;
      } else {
        dsts.p[r] = half(peer_scratch.p[r], k) + region + rank * slot + b0;
      }
    }
    reduce_to_all<CollT, CollAcc, kCollOp>(srcs, nranks, 0, dsts, nranks, 0, hi - lo, nranks, rank,
                                           threadIdx.x, blockDim.x);
  };
  auto gather = [&](u64 k) {
    const CollT* ag = half(local_scratch, k) + region;
    for (u32 i = 0; i < npeers; ++i) {
      const u32 q = (rank + 1 + i) % nranks;
      u64 lo, hi;
      chunk(k, q, lo, hi);
      if (lo < hi) copy(out + lo, ag + q * slot + b0, (hi - lo) * sizeof(CollT), threadIdx.x, blockDim.x);
    }
  };
  send(0);
  for (u64 j = 1; j <= nsteps + 1; ++j) {
    // Every thread gets the same answer, so the whole block leaves together on a timeout (recorded
    // in the error word); the call counter still advances below, keeping later calls in step.
    if (!block_barrier(sems, npeers, true)) break;
    if (j <= nsteps) reduce(j - 1);
    if (j < nsteps) send(j);
    if (!kPush && j >= 2) gather(j - 2);
  }
  finish_call(state, calls, nsteps);
}

extern "C" __global__ void __launch_bounds__(1024, 1)
    allreduce_rsag(const PipelineArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  rsag_pipeline<false>(args);
}

// CUDA only for now (CUDA_ONLY_ENTRY_POINTS in collectives.rs): it has not run on an AMD GPU, the
// selector never takes it, and its instance of the pipeline doubles this unit's compile time,
// which the ROCm compile gate pays for every type pair.
#if !defined(MSCCLPP_HIP)
extern "C" __global__ void __launch_bounds__(1024, 1)
    allreduce_rsag_push(const PipelineArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  rsag_pipeline<true>(args);
}
#endif

// ------------------------------------------------------------------------------------------------
// Full-mesh all-reduce through the scratch (see "Scratch pipelines" in collective_common.cuh): every
// rank pushes its whole input into every peer's scratch and reduces all inputs locally, trading
// (nranks - 1) x the NVLink traffic of rsag for one barrier per step and no second exchange.
//   step     elements per step (a whole number of 16-byte vectors, step * sizeof(T) <= slot_bytes)
//   scratch  half h at h * half_bytes: nranks slots of slot_bytes; rank s pushes into slot s.
// Schedule: A(0); then barriers j = 1..nsteps, each followed by A(j) (push window j) and B(j - 1)
// (reduce window j - 1 from my input and my slots, in rank order, into my output).
// Scratch reuse: A(k) writes half (k) of a peer, last read there in B(k - 2), before its barrier k.
// In place: A(k) reads window k before barrier k + 1, after which B(k) writes it, element by element
// in the thread that read it; windows of different steps are disjoint.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024, 1)
    allreduce_fullmesh(const PipelineArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  const void* input = args.input;
  void* output = args.output;
  const u64 count = args.count;
  const PeerPtrs& peer_scratch = args.peer_scratch;
  void* local_scratch = args.local_scratch;
  const u64 slot_bytes = args.slot_bytes;
  const u64 half_bytes = args.half_bytes;
  const u64 step = args.step;
  const u32 rank = args.rank;
  const u32 nranks = args.nranks;
  const D2DSemaphoreHandle* sems = args.sems;
  CallState* state = args.state;
  constexpr u64 kVec = sizeof(uint4) / sizeof(CollT);
  const u64 calls = load_call_count(state);
  const u32 npeers = nranks - 1;
  const u64 nsteps = (count + step - 1) / step;
  const u64 slot = slot_bytes / sizeof(CollT);
  u64 b0, b1;
  block_range(step, kVec, b0, b1);
  const CollT* in = static_cast<const CollT*>(input);
  CollT* out = static_cast<CollT*>(output);
  auto half = [&](void* scratch, u64 k) {
    return reinterpret_cast<CollT*>(static_cast<u8*>(scratch) + pipeline_half(calls, k, half_bytes));
  };
  auto send = [&](u64 k) {
    const u64 lo = min(k * step + b0, count);
    const u64 hi = min(k * step + b1, count);
    if (lo >= hi) return;
    for (u32 i = 0; i < npeers; ++i) {
      const u32 p = (rank + 1 + i) % nranks;
      copy(half(peer_scratch.p[p], k) + rank * slot + b0, in + lo, (hi - lo) * sizeof(CollT), threadIdx.x,
           blockDim.x);
    }
  };
  auto reduce = [&](u64 k) {
    const u64 lo = min(k * step + b0, count);
    const u64 hi = min(k * step + b1, count);
    if (lo >= hi) return;
    PeerPtrs srcs, dsts;
    CollT* mine = half(local_scratch, k);
    for (u32 r = 0; r < nranks; ++r) srcs.p[r] = r == rank ? const_cast<CollT*>(in + lo) : mine + r * slot + b0;
    dsts.p[0] = out + lo;
    reduce_to_all<CollT, CollAcc, kCollOp>(srcs, nranks, 0, dsts, 1, 0, hi - lo, nranks, 0, threadIdx.x,
                                           blockDim.x);
  };
  send(0);
  for (u64 j = 1; j <= nsteps; ++j) {
    if (!block_barrier(sems, npeers, true)) break;  // recorded in the error word
    if (j < nsteps) send(j);
    reduce(j - 1);
  }
  finish_call(state, calls, nsteps);
}

// ------------------------------------------------------------------------------------------------
// Copy-engine all-reduce (default_allreduce_copy_engine). The copy engines move every byte
// (host-enqueued copies, see collectives/src/copy_engine.rs); these two kernels reduce one staged
// chunk and synchronise the ranks between the phases.
//   allreduce_ce_reduce  output[e] = reduce over s of srcs.p[s][e], sources in rank order (own input
//                        at its rank, peers' copies from the scratch elsewhere), so every rank
//                        computes bit-identical results.
//   allreduce_ce_sync    one block of >= npeers threads over sems[peer index]: mode bit 0 signals
//                        every peer after a system-scope fence (the peers' copy engines then read
//                        what the earlier kernels wrote), bit 1 waits for one signal of every peer.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024, 1)
    allreduce_ce_reduce(const CopyEngineArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  PeerPtrs dsts;
  dsts.p[0] = args.output;
  reduce_to_all<CollT, CollAcc, kCollOp>(args.srcs, args.nsrc, 0, dsts, 1, 0, args.count, args.nranks, 0);
}

extern "C" __global__ void allreduce_ce_sync(const CopyEngineArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  if (threadIdx.x >= args.npeers) return;
  const D2DSemaphoreHandle& s = args.sems[threadIdx.x];
  if (args.mode & 1) {
    fence_acq_rel_sys();
    s.signal();
  }
  if (args.mode & 2) s.wait();
}
