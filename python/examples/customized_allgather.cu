// A user all-gather kernel over the device library's MemoryChannels, compiled at run time by
// mscclpp.compile_native (customized_allgather.py). Block b serves the channel to the b-th peer:
// it writes this rank's chunk (already at its place in the local output) into the same place of
// the peer's output, then tells the peer and waits for the peer's chunk.
#include "mscclpp/memory_channel.cuh"

extern "C" __global__ void allgather(const mscclpp::MemoryChannelHandle* channels, int rank,
                                     unsigned long long chunk_bytes) {
  const mscclpp::MemoryChannelHandle& channel = channels[blockIdx.x];
  // The peer's output must be free for writing: it reached this launch too.
  if (threadIdx.x == 0) {
    channel.signal();
    channel.wait();
  }
  __syncthreads();
  const unsigned long long offset = (unsigned long long)rank * chunk_bytes;
  channel.put(offset, chunk_bytes, threadIdx.x, blockDim.x);
  __syncthreads();
  // Release our writes to the peer, then acquire the peer's writes into our output.
  if (threadIdx.x == 0) {
    channel.signal();
    channel.wait();
  }
}
