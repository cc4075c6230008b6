// mscclpp-rs native reduce-scatter kernel (see collective_common.cuh for the shared conventions).
// The unit is built for one (T, AccT, Op) triple (#defines prepended by collectives.rs).
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

typedef MSCCLPP_COLL_T CollT;
typedef MSCCLPP_COLL_ACC CollAcc;
constexpr int kCollOp = MSCCLPP_COLL_OP;

extern "C" __global__ void __launch_bounds__(1024, 1)
    reducescatter_zero_copy(PeerPtrs inputs, void* output, u64 count, u32 rank, u32 nranks,
                            const D2DSemaphoreHandle* sems) {
  const u32 npeers = nranks - 1;
  PeerPtrs out;
  out.p[0] = output;
  if (block_barrier(sems, npeers, false)) {
    reduce_to_all<CollT, CollAcc, kCollOp>(inputs, nranks, static_cast<u64>(rank) * count, out, 1, 0,
                                           count, nranks);
    // Only local stores happened, so nothing needs publishing: this barrier keeps every peer's
    // input alive until every rank is done reading it.
    block_barrier(sems, npeers, false);
  }
}
