// mscclpp-rs native broadcast kernel (see collective_common.cuh for the shared conventions).
// Byte-oriented: one unit serves every data type.
//
// broadcast_zero_copy (registered outputs): the root pushes its input into every rank's output with
// SM stores over NVLink; other ranks only take part in the barriers (their input is ignored, as in
// NCCL, so it may be null).
//   input    the root's input (local; unused elsewhere)
//   outputs  every rank's output mapped here (own at `rank`)
//   sems     per (block, peer) semaphores: sems[b * (nranks - 1) + i]
// Start barrier: every output may be written. End barrier (with a system fence): the root's stores
// are visible to every rank before its kernel ends, and the root does not return (letting its input
// be reused) before it is done. In-place on the root (input == its output) skips the local copy.

using namespace mscclpp;
using namespace mscclpp::coll;

extern "C" __global__ void __launch_bounds__(1024, 1)
    broadcast_zero_copy(const ZeroCopyArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  const void* input = args.input;
  const PeerPtrs& outputs = args.outputs;
  const u64 bytes = args.count;
  const u32 rank = args.rank;
  const u32 root = args.root;
  const u32 nranks = args.nranks;
  const D2DSemaphoreHandle* sems = args.sems;
  const u32 npeers = nranks - 1;
  u64 begin, end;
  block_range(bytes, 16, begin, end);
  if (block_barrier(sems, npeers, false)) {
    if (rank == root) {
      for (u32 i = 0; i < nranks; ++i) {
        const u32 dst_rank = (rank + 1 + i) % nranks;
        u8* dst = static_cast<u8*>(outputs.p[dst_rank]);
        if (dst == input) continue;
        copy(dst + begin, static_cast<const u8*>(input) + begin, end - begin, threadIdx.x, blockDim.x);
      }
    }
    block_barrier(sems, npeers, true);
  }
}
