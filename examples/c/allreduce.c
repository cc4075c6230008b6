/*
 * An all-reduce through the NCCL C interface, served by libmscclpp_nccl.so: one process drives
 * NRANKS ranks (default: one per visible GPU; more ranks than GPUs share them round-robin) with
 * ncclCommInitAll, sums a buffer of floats in one group call and checks every element.
 *
 * Build against our nccl.h (or NVIDIA's: the ABI is the same) and the CUDA runtime, e.g.
 *   cc -std=c11 examples/c/allreduce.c -I nccl/include -I "$CUDA_HOME/include" \
 *     -L DIR_WITH_LIBNCCL_SO -lnccl -L "$CUDA_HOME/lib64" -lcudart -o allreduce
 * where DIR_WITH_LIBNCCL_SO holds libnccl.so and libnccl.so.2, both links to
 * target/release/libmscclpp_nccl.so: the linker reads libnccl.so, and the program then asks the
 * loader for the SONAME, libnccl.so.2. Run it with that folder in LD_LIBRARY_PATH (or link with
 * -Wl,-rpath,DIR_WITH_LIBNCCL_SO); otherwise the loader may find another libnccl.so.2 (NVIDIA's,
 * which refuses two ranks on one GPU).
 * A program already linked to NVIDIA's NCCL runs on the shim unchanged:
 *   LD_PRELOAD=target/release/libmscclpp_nccl.so ./program
 * Without a GPU it prints why and exits successfully.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#include "nccl.h"

#define MAX_RANKS 8
#define COUNT ((size_t)1 << 20)

#define CUDA_OK(call)                                                        \
  do {                                                                       \
    cudaError_t e_ = (call);                                                 \
    if (e_ != cudaSuccess) {                                                 \
      fprintf(stderr, "allreduce: %s: %s\n", #call, cudaGetErrorString(e_)); \
      return 1;                                                              \
    }                                                                        \
  } while (0)

#define NCCL_OK(call)                                                                        \
  do {                                                                                       \
    ncclResult_t r_ = (call);                                                                \
    if (r_ != ncclSuccess) {                                                                 \
      fprintf(stderr, "allreduce: %s: %s: %s\n", #call, ncclGetErrorString(r_),              \
              ncclGetLastError(NULL));                                                       \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

int main(void) {
  int version = 0;
  NCCL_OK(ncclGetVersion(&version));
  int ngpus = 0;
  cudaError_t probe = cudaGetDeviceCount(&ngpus);
  if (probe != cudaSuccess || ngpus == 0) {
    printf("SKIP: no GPU (%s); linked to NCCL interface %d\n",
           probe != cudaSuccess ? cudaGetErrorString(probe) : "0 devices", version);
    return 0;
  }
  const char* env = getenv("NRANKS");
  int nranks = env ? atoi(env) : ngpus;
  if (nranks < 1 || nranks > MAX_RANKS) {
    fprintf(stderr, "allreduce: NRANKS must be 1..%d, not %s\n", MAX_RANKS, env);
    return 1;
  }

  int devices[MAX_RANKS];
  ncclComm_t comms[MAX_RANKS];
  cudaStream_t streams[MAX_RANKS];
  float* buffers[MAX_RANKS];
  for (int r = 0; r < nranks; ++r) devices[r] = r % ngpus;
  NCCL_OK(ncclCommInitAll(comms, nranks, devices));

  float* host = malloc(COUNT * sizeof(float));
  if (host == NULL) return 1;
  /* Rank r contributes r + 1 in every element: the sum is n (n + 1) / 2 everywhere. */
  for (int r = 0; r < nranks; ++r) {
    for (size_t i = 0; i < COUNT; ++i) host[i] = (float)(r + 1);
    CUDA_OK(cudaSetDevice(devices[r]));
    CUDA_OK(cudaStreamCreate(&streams[r]));
    CUDA_OK(cudaMalloc((void**)&buffers[r], COUNT * sizeof(float)));
    CUDA_OK(cudaMemcpy(buffers[r], host, COUNT * sizeof(float), cudaMemcpyHostToDevice));
  }

  /* One thread, several ranks: the group makes the calls one collective. */
  NCCL_OK(ncclGroupStart());
  for (int r = 0; r < nranks; ++r) {
    NCCL_OK(ncclAllReduce(buffers[r], buffers[r], COUNT, ncclFloat, ncclSum, comms[r], streams[r]));
  }
  NCCL_OK(ncclGroupEnd());

  const float want = (float)(nranks * (nranks + 1) / 2);
  size_t wrong = 0;
  for (int r = 0; r < nranks; ++r) {
    CUDA_OK(cudaSetDevice(devices[r]));
    CUDA_OK(cudaStreamSynchronize(streams[r]));
    CUDA_OK(cudaMemcpy(host, buffers[r], COUNT * sizeof(float), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < COUNT; ++i) wrong += host[i] != want;
    CUDA_OK(cudaFree(buffers[r]));
    CUDA_OK(cudaStreamDestroy(streams[r]));
    NCCL_OK(ncclCommDestroy(comms[r]));
  }
  free(host);
  if (wrong > 0) {
    fprintf(stderr, "allreduce: %zu of %zu elements are not %g\n", wrong, COUNT * nranks, want);
    return 1;
  }
  printf("%d ranks on %d GPU(s): all-reduce of %zu floats correct (NCCL interface %d)\n", nranks,
         ngpus, COUNT, version);
  return 0;
}
