// mscclpp-rs native reduce kernel (see collective_common.cuh for the shared conventions).
// The unit is built for one (T, AccT, Op) triple (#defines prepended by collectives.rs).
//
// Entry point:
//   reduce_zero_copy  registered inputs: the root reads every rank's input over NVLink and reduces
//                     it into its own output; the other ranks only take part in the barriers.
//
// reduce_zero_copy (ZeroCopyArgs):
//   inputs  every rank's input mapped here (own at `rank`), count elements each
//   output  the root's output (unused elsewhere, so it may be null there, as in NCCL)
//   root    the rank that receives the result
//   sems    per (block, peer) semaphores: sems[b * (nranks - 1) + i]
// Start barrier: every input holds this call's data. End barrier: no rank returns (and lets its
// input be reused) while the root may still read it, which is the root's "done". Every wait is a
// semaphore wait bounded by the spin limit and the communicator's error word, so an abort or a dead
// peer ends the kernel with the error set. In place on the root (output == its input) is safe: each
// element is read and written by the one thread that reduces it. Sources are combined in rank order
// starting at the root (its own input first), the same order on every call.

using namespace mscclpp;
using namespace mscclpp::coll;

extern "C" __global__ void __launch_bounds__(1024, 1)
    reduce_zero_copy(const ZeroCopyArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  zero_copy_reduce<CollT, CollAcc, kCollOp>(args, args.rank == args.root, 0, args.root);
}
