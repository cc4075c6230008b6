// mscclpp-rs native reduce-scatter kernel (see collective_common.cuh for the shared conventions).
// The unit is built for one (T, AccT, Op) triple (#defines prepended by collectives.rs).
//
// Entry points:
//   reducescatter_packet     small messages: chunk p of every input travels to rank p in LL128 lines
//   reducescatter_zero_copy  large messages on registered inputs (read over NVLink, two barriers)
//
// reducescatter_zero_copy (registered inputs): rank r reduces chunk r (count elements at element
// offset r * count) of every rank's input, read directly over NVLink, into its own output.
//   inputs  every rank's input mapped here (own at `rank`), nranks * count elements each
//   sems    per (block, peer) semaphores: sems[b * (nranks - 1) + i]
// Start barrier: peers' inputs hold this call's data. End barrier: no peer returns (and lets its
// input be reused) while I may still read it. In-place (output == chunk `rank` of my input) is safe:
// each element is read and written by the one thread that reduces it.

using namespace mscclpp;
using namespace mscclpp::coll;

extern "C" __global__ void __launch_bounds__(1024, 1)
    reducescatter_zero_copy(const ZeroCopyArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  zero_copy_reduce<CollT, CollAcc, kCollOp>(args, true, static_cast<u64>(args.rank) * args.count, args.rank);
}

// ------------------------------------------------------------------------------------------------
// Packet reduce-scatter through LL128 lines (packet.cuh): no semaphores, no barriers; the lines'
// flags are the only synchronisation. `count` is the per-rank output count; the input holds nranks
// chunks of count elements and chunk p is reduced on rank p.
//   peer_scratch  every rank's scratch mapped here (own entry unused)
//   local_scratch this rank's scratch: 2 halves (call-count parity) x nranks slots of slot_bytes
//                 (slot_bytes >= lines(chunk) * 128); rank s writes its chunk for me into slot s.
// Send: chunk p of my input -> slot `rank` of peer p. Reduce: my chunk from my input and every
// peer's lines, in rank order, so the result is bit-identical to reducescatter_zero_copy (which
// also combines in rank order, element by element). The reduce loop is warp-uniform (reads vote).
// Parity double buffering is enough for the reason given at allreduce_allpair_packet (every call
// reads every peer's lines of that call).
// In place (output == chunk `rank` of my input): the send phase reads only the other chunks, and
// each word of my chunk is read and then overwritten by the same lane.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024, 1)
    reducescatter_packet(const PacketArgs args) {
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
  const u64 half = (calls & 1) * args.half_bytes;
  const u64 bytes = count * sizeof(CollT);  // one chunk
  const u64 nlines = LL128::lines(bytes);
  const u8* in = static_cast<const u8*>(input);
  u8* out = static_cast<u8*>(output);
  const u32 npeers = nranks - 1;
  const LineLanes me;
  const u32 t = me.t;

  // Send: one flat loop over (peer index, line) so all warps stay busy whatever the sizes.
  for (u64 x = me.first + me.sub; x < npeers * nlines; x += me.stride) {
    const u32 p = peer_rank(static_cast<u32>(x / nlines), rank);
    const u64 j = x % nlines;
    const u8* src = in + static_cast<u64>(p) * bytes;
    u8* dst = static_cast<u8*>(peer_scratch.p[p]) + half + static_cast<u64>(rank) * slot_bytes + j * LL128::kLineBytes;
    LL128::send(dst, src, bytes, reinterpret_cast<u64>(src) % 8 == 0, j, t, flag);
  }
  // Reduce my chunk.
  const u8* mine = in + static_cast<u64>(rank) * bytes;
  const bool mine_aligned = reinterpret_cast<u64>(mine) % 8 == 0;
  const bool out_aligned = reinterpret_cast<u64>(out) % 8 == 0;
  const u8* scratch = static_cast<const u8*>(local_scratch) + half;
  bool ok = true;
  for (u64 base = me.first; ok && base < nlines; base += me.stride) {
    const u64 j = base + me.sub;
    const bool active = j < nlines;
    u64 r0, r1;
    ok = reduce_line<CollT, CollAcc, kCollOp>(mine, bytes, mine_aligned, j, t, active, scratch, slot_bytes,
                                              j * LL128::kLineBytes, rank, nranks, flag, max_spin, error_word, r0,
                                              r1);
    if (ok && active) LL128::unpack(out, bytes, out_aligned, j, t, r0, r1);
  }
  finish_call(state, calls);
}
