// mscclpp-rs native all-reduce kernels (see collective_common.cuh for the shared conventions).
// The unit is built for one (T, AccT, Op) triple: MSCCLPP_COLL_T, MSCCLPP_COLL_ACC and
// MSCCLPP_COLL_OP are #defined before this text by kernels-cu/src/collectives.rs.
//
// Entry points:
//   allreduce_allpair_packet   small messages: everyone sends everything to everyone as LL16 packets
//   allreduce_packet           two-phase (reduce-scatter + all-gather) through LL16 packets
//   allreduce_rsag_zero_copy   large messages on registered buffers: read peers' inputs over NVLink,
//                              write each reduced chunk into every rank's output

using namespace mscclpp;
using namespace mscclpp::coll;

typedef MSCCLPP_COLL_T CollT;
typedef MSCCLPP_COLL_ACC CollAcc;
constexpr int kCollOp = MSCCLPP_COLL_OP;
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
    allreduce_allpair_packet(const void* input, void* output, u64 count, PeerPtrs peer_scratch,
                             const void* local_scratch, u64 slot_bytes, u32 rank, u32 nranks,
                             CallState* state, u32* error_word, u64 max_spin) {
  const u64 calls = load_call_count(state);
  const u32 flag = call_flag(calls);
  const u64 half = (calls & 1) * nranks * slot_bytes;
  const u64 bytes = count * sizeof(CollT);
  const u64 npkt = packet_count<Pkt>(bytes);
  const u8* in = static_cast<const u8*>(input);
  u8* out = static_cast<u8*>(output);
  const bool in_aligned = reinterpret_cast<u64>(in) % Pkt::kPayloadBytes == 0;
  const bool out_aligned = reinterpret_cast<u64>(out) % Pkt::kPayloadBytes == 0;
  const u32 npeers = nranks - 1;
  const u64 tid = global_thread_id();
  const u64 stride = global_num_threads();

  for (u64 j = tid; j < npkt; j += stride) {
    const u64 v = load_payload<Pkt>(in, bytes, j, in_aligned);
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
        v = load_payload<Pkt>(in, bytes, j, in_aligned);
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
// Two-phase packet all-reduce. The message's npkt LL16 payloads are cut into nranks chunks of
// per = ceil(npkt / nranks) payloads; rank r owns chunk r.
//   phase 1: send chunk p of my input to peer p (its RS region, slot `rank`)
//   phase 2: reduce my chunk from my input and the peers' RS packets, store it, send the result to
//            every peer (its AG region, slot `rank`)
//   phase 3: receive every peer's reduced chunk from my AG region into my output
// local_scratch layout: [parity half][RS, AG][nranks slots of slot_bytes]; slot_bytes >= per * 16.
// Parity double buffering is safe for the reason given above (every call reads every peer's
// packets of that call). In-place is safe: output chunk q is written only after peer q's result
// arrived, and that result needs my phase-1 packets of chunk q, which read my input first.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024, 1)
    allreduce_packet(const void* input, void* output, u64 count, PeerPtrs peer_scratch,
                     const void* local_scratch, u64 slot_bytes, u32 rank, u32 nranks, CallState* state,
                     u32* error_word, u64 max_spin) {
  const u64 calls = load_call_count(state);
  const u32 flag = call_flag(calls);
  const u64 region = nranks * slot_bytes;
  const u64 half = (calls & 1) * 2 * region;
  const u64 bytes = count * sizeof(CollT);
  const u64 npkt = packet_count<Pkt>(bytes);
  const u64 per = (npkt + nranks - 1) / nranks;
  const u8* in = static_cast<const u8*>(input);
  u8* out = static_cast<u8*>(output);
  const bool in_aligned = reinterpret_cast<u64>(in) % Pkt::kPayloadBytes == 0;
  const bool out_aligned = reinterpret_cast<u64>(out) % Pkt::kPayloadBytes == 0;
  const u32 npeers = nranks - 1;
  const u64 tid = global_thread_id();
  const u64 stride = global_num_threads();
  const u8* scratch = static_cast<const u8*>(local_scratch) + half;
  const u64 my_begin = min(static_cast<u64>(rank) * per, npkt);
  const u64 my_end = min(my_begin + per, npkt);
  bool ok = true;

  // Phase 1: one flat loop over (peer, payload) so all threads stay busy whatever the sizes.
  for (u64 t = tid; t < npeers * per; t += stride) {
    const u32 p = peer_rank(static_cast<u32>(t / per), rank);
    const u64 j = p * per + t % per;
    if (j >= npkt) continue;
    Pkt* dst = reinterpret_cast<Pkt*>(static_cast<u8*>(peer_scratch.p[p]) + half + rank * slot_bytes);
    dst[j - p * per].write(load_payload<Pkt>(in, bytes, j, in_aligned), flag);
  }
  // Phase 2.
  for (u64 j = my_begin + tid; j < my_end && ok; j += stride) {
    VecAccumulator<CollT, CollAcc, kCollOp, u64> acc;
    for (u32 s = 0; s < nranks && ok; ++s) {
      u64 v;
      if (s == rank) {
        v = load_payload<Pkt>(in, bytes, j, in_aligned);
      } else {
        ok = reinterpret_cast<const Pkt*>(scratch + s * slot_bytes)[j - my_begin].read(flag, v, max_spin,
                                                                                         error_word);
      }
      if (s == 0) {
        acc.init(v);
      } else {
        acc.add(v);
      }
    }
    if (!ok) break;
    const u64 r = acc.finish(nranks);
    for (u32 i = 0; i < npeers; ++i) {
      Pkt* dst = reinterpret_cast<Pkt*>(static_cast<u8*>(peer_scratch.p[peer_rank(i, rank)]) + half +
                                        region + rank * slot_bytes);
      dst[j - my_begin].write(r, flag);
    }
    store_payload<Pkt>(out, bytes, j, r, out_aligned);
  }
  // Phase 3 (skipped after a timeout: the error word already says why the call failed).
  for (u64 t = tid; ok && t < npeers * per; t += stride) {
    const u32 q = peer_rank(static_cast<u32>(t / per), rank);
    const u64 k = t % per;
    const u64 j = q * per + k;
    if (j >= npkt) continue;
    u64 v;
    ok = reinterpret_cast<const Pkt*>(scratch + region + q * slot_bytes)[k].read(flag, v, max_spin, error_word);
    if (ok) store_payload<Pkt>(out, bytes, j, v, out_aligned);
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
    allreduce_rsag_zero_copy(PeerPtrs inputs, PeerPtrs outputs, u64 count, u32 rank, u32 nranks,
                             const D2DSemaphoreHandle* sems) {
  constexpr u64 kVec = sizeof(uint4) / sizeof(CollT);
  const u32 npeers = nranks - 1;
  const u64 per = ((count + kVec - 1) / kVec + nranks - 1) / nranks * kVec;
  const u64 begin = min(static_cast<u64>(rank) * per, count);
  const u64 end = min(begin + per, count);
  if (block_barrier(sems, npeers, false)) {
    reduce_to_all<CollT, CollAcc, kCollOp>(inputs, nranks, begin, outputs, nranks, begin, end - begin, nranks);
    block_barrier(sems, npeers, true);
  }
}
