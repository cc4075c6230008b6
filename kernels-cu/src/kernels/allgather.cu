// mscclpp-rs native all-gather kernels (see collective_common.cuh for the shared conventions).
// Byte-oriented: one unit serves every data type.
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
    allgather_fullmesh2(const void* input, PeerPtrs outputs, u64 bytes, u32 rank, u32 nranks,
                        const D2DSemaphoreHandle* sems) {
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
