/*
 * mscclpp.h of mscclpp-rs: the C API below the NCCL ABI, for stacks that want our runtime rather
 * than NCCL's shape. Served by libmscclpp_embed.a / libmscclpp_embed.so, beside the prefixed NCCL
 * ABI of mscclpp_nccl.h; docs/embedding.md is the guide.
 *
 * Errors: every function returning mscclppResult_t returns mscclppSuccess or a failure code, and
 * after a failure mscclppGetLastError() on the same thread says which call failed and why
 * (naming the argument, rank or peer at fault). Nothing unwinds out of the library: an internal
 * bug is mscclppInternalError with its message.
 *
 * Threads: each function says who may call it.
 *  - "any thread": at any time, concurrently with anything.
 *  - "one thread per communicator": calls on one communicator must not overlap (NCCL's rule);
 *    different communicators may be driven from different threads at once.
 *  - "collective": every rank of the communicator calls it, in the same order relative to the
 *    other collective calls.
 *
 * Handles: an mscclppComm_t is a key into the library's table, never dereferenced; a destroyed,
 * aborted or made-up handle is mscclppInvalidArgument naming it. The same handle is an
 * ncclComm_t of mscclpp_nccl.h (mscclpp_ncclCommFromMscclpp), so mscclpp_ncclAllReduce and the
 * other prefixed collectives run on communicators made here.
 *
 * No CUDA header is needed: cudaStream_t is declared as CUDA declares it.
 */
#ifndef MSCCLPP_H_
#define MSCCLPP_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st* cudaStream_t;

/* The layout of mscclppBootstrap this header describes: mscclppCommInitBootstrap refuses a
 * struct of another version, naming both. */
#define MSCCLPP_BOOTSTRAP_VERSION 1

/* Result codes: the values of NCCL's ncclResult_t (plain ints, so they compare with either). */
typedef int mscclppResult_t;
#define mscclppSuccess 0
#define mscclppUnhandledCudaError 1 /* a driver or GPU runtime call failed, or no GPU */
#define mscclppSystemError 2        /* socket, bootstrap (the host's callback failed), OS */
#define mscclppInternalError 3      /* a bug in mscclpp-rs */
#define mscclppInvalidArgument 4    /* the message names the argument */
#define mscclppInvalidUsage 5       /* not supported here; the message says what */
#define mscclppRemoteError 6        /* a peer failed or did not answer in time */
#define mscclppInProgress 7

/* Element types and reduction operators: the values of NCCL's ncclDataType_t and ncclRedOp_t
 * (ncclFloat32 = 7, ncclBfloat16 = 9, ncclSum = 0, ...), passed as int. */

typedef struct mscclppComm* mscclppComm_t;

/* A job identifier made by rank 0's mscclppGetUniqueId (or mscclpp_ncclGetUniqueId) and handed
 * to every rank by the host: 128 opaque bytes, the layout of ncclUniqueId. */
typedef struct {
  char internal[128];
} mscclppUniqueId;

/* Collectives, for the algorithm collection. */
typedef enum {
  mscclppCollAllReduce = 0,
  mscclppCollAllGather = 1,
  mscclppCollReduceScatter = 2,
  mscclppCollBroadcast = 3,
  mscclppCollAllToAll = 4,
  mscclppCollReduce = 5,
  mscclppCollGather = 6,
  mscclppCollScatter = 7
} mscclppCollective_t;

/* Room for any algorithm or plan name with its NUL. */
#define MSCCLPP_MAX_NAME_BYTES 256

/* ---- Versions and errors ---- */

/* This library's version, MAJOR*10000 + MINOR*100 + PATCH. Any thread. nccl.h declares it too
 * (returning ncclResult_t, the same values); whichever header comes first declares it. */
#ifndef MSCCLPP_GET_VERSION_DECLARED
#define MSCCLPP_GET_VERSION_DECLARED
mscclppResult_t mscclppGetVersion(int* version);
#endif

/* A static text for a result code. Any thread. */
const char* mscclppGetErrorString(mscclppResult_t result);

/* The last failure of a call on the calling thread ("" if none): "call: reason". The pointer
 * stays valid until this thread's next failing call. Any thread (each sees its own). The
 * prefixed NCCL calls record here too, under their NCCL names. */
const char* mscclppGetLastError(void);

/* ---- Communicators ---- */

/* A fresh job identifier; rank 0 of the job must then init from this process. Any thread. */
mscclppResult_t mscclppGetUniqueId(mscclppUniqueId* uniqueId);

/* Collective: joins job `uniqueId` as `rank` of `nranks` on GPU `device` over our own TCP
 * bootstrap (MSCCLPP_SOCKET_IFNAME, MSCCLPP_BOOTSTRAP_TIMEOUT). Blocks until every rank joined
 * or the bootstrap timeout names the missing rank; a failed init leaves *comm NULL.
 * One thread per communicator being made. */
mscclppResult_t mscclppCommInitRank(mscclppComm_t* comm, int nranks, mscclppUniqueId uniqueId,
                                    int rank, int device);

/* The host stack's own exchange, so an embedded communicator needs no second TCP bootstrap.
 *
 * allGather: every rank passes a buffer of nranks * bytesPerRank bytes whose part at
 *   rank * bytesPerRank holds its own contribution; on return the buffer holds every rank's
 *   (NCCL's bootstrapAllGather). Required.
 * barrier: returns once every rank entered it. Required.
 * send / recv: one message of exactly `bytes` to / from `peer` under `tag` (a non-negative
 *   int), delivered in order per (sender, receiver, tag); recv blocks until it arrives. Both or
 *   neither: without them, what needs messages between two ranks (ncclSend/ncclRecv's
 *   zero-copy offers, InfiniBand connections between hosts) fails with mscclppInvalidUsage.
 *
 * Each returns 0 on success, anything else on failure (the code is quoted in our error). The
 * callbacks may be called from any thread of ours, one at a time per communicator (we serialise
 * them), during init, during collective calls whose buffers are new to the communicator (their
 * descriptions are exchanged), and during destroy. They must not throw. They must return,
 * failing, when the host gives up (a timeout, a dead peer): their waits are not ours to break,
 * so a callback that never returns is a hang. `ctx` is passed to each and must stay valid
 * until the communicator is destroyed or aborted (the struct itself is copied at init). */
typedef struct {
  int version; /* MSCCLPP_BOOTSTRAP_VERSION */
  int rank;
  int nranks;
  void* ctx;
  int (*allGather)(void* ctx, void* allData, size_t bytesPerRank);
  int (*barrier)(void* ctx);
  int (*send)(void* ctx, int peer, int tag, const void* data, size_t bytes);
  int (*recv)(void* ctx, int peer, int tag, void* data, size_t bytes);
} mscclppBootstrap;

/* Collective (over the host's exchange): a communicator of bootstrap->nranks ranks on GPU
 * `device`. The first exchange checks that the ranks' descriptions agree (every rank's rank and
 * nranks, the all-gather's layout): a mismatch is mscclppInvalidArgument naming the slot.
 * Blocking. One thread per communicator being made. */
mscclppResult_t mscclppCommInitBootstrap(mscclppComm_t* comm, const mscclppBootstrap* bootstrap,
                                         int device);

/* Destroys the communicator: its teardown (which meets the peers, so every rank destroys) runs
 * now, or when a call still running on it on another thread returns. A second destroy, or one
 * after an abort, is a no-op. Any thread. */
mscclppResult_t mscclppCommDestroy(mscclppComm_t comm);

/* Gives up on the communicator without meeting the peers: its kernels return at entry, device
 * waits end within about a millisecond, a call blocked in one of our host waits returns with the
 * error (a call inside the host's own callback returns when the callback does). Then as destroy.
 * What a host calls when its bootstrap sees a peer die. Any thread, at any time. */
mscclppResult_t mscclppCommAbort(mscclppComm_t comm);

/* The communicator's asynchronous error (mscclppSuccess while healthy; mscclppInProgress during
 * init; after a destroy or abort, the error it ended with). Any thread, at any time. */
mscclppResult_t mscclppCommGetAsyncError(mscclppComm_t comm, mscclppResult_t* asyncError);

/* This rank, and the number of ranks. Any thread. */
mscclppResult_t mscclppCommRank(mscclppComm_t comm, int* rank);
mscclppResult_t mscclppCommSize(mscclppComm_t comm, int* size);

/* ---- Memory registration ---- */

/* Registers [buff, buff + bytes) with the communicator (as ncclCommRegister): a handle to
 * deregister. Calls on user buffers are correct with or without it (each rank describes its
 * buffers at the call); registering is not a promise that ranks call with buffers in the same
 * pattern (MSCCLPP_NCCL_SYMMETRIC_MEMORY=1 is). One thread per communicator. */
mscclppResult_t mscclppCommRegister(mscclppComm_t comm, void* buff, size_t bytes, void** handle);
mscclppResult_t mscclppCommDeregister(mscclppComm_t comm, void* handle);

/* ---- The algorithm collection ---- */

/* How many algorithms the communicator has for `coll` (the native collection's, then the loaded
 * execution plans), and the name of the index-th (0-based) into name[nameBytes]. Any thread. */
mscclppResult_t mscclppAlgorithmCount(mscclppComm_t comm, mscclppCollective_t coll, int* count);
mscclppResult_t mscclppAlgorithmName(mscclppComm_t comm, mscclppCollective_t coll, int index,
                                     char* name, size_t nameBytes);

/* The name of the native algorithm the default selector picks for this call (the one
 * mscclpp_ncclAllReduce and friends would run), checked against it. Nothing is launched.
 * One thread per communicator. */
mscclppResult_t mscclppAlgorithmSelect(mscclppComm_t comm, mscclppCollective_t coll,
                                       const void* input, void* output, size_t inputBytes,
                                       size_t outputBytes, int datatype, cudaStream_t stream,
                                       char* name, size_t nameBytes);

/* Collective: runs the algorithm `name` (MSCCL++'s names, e.g. default_allreduce_packet, or a
 * loaded plan's) on `stream`, enqueued without host synchronisation (capturable in a CUDA
 * graph). Sizes are per rank in bytes (all-gather: inputBytes per rank, outputBytes the whole);
 * `op` a built-in ncclRedOp_t (ignored where nothing reduces), `root` for rooted collectives.
 * nblocks / nthreads: the launch geometry, 0 to let the algorithm choose; a geometry the
 * algorithm cannot run (more blocks than may be resident at once, say) is refused, naming the
 * limit. Ordered after the communicator's previous operation on any stream, like the NCCL calls.
 * Not part of mscclpp_ncclGroupStart groups. One thread per communicator. */
mscclppResult_t mscclppAlgorithmExecute(mscclppComm_t comm, mscclppCollective_t coll,
                                        const char* name, const void* input, void* output,
                                        size_t inputBytes, size_t outputBytes, int datatype,
                                        int op, int root, cudaStream_t stream, int nblocks,
                                        int nthreads);

/* ---- Execution plans ---- */

/* Collective (every rank loads the same plan in the same order): loads the MSCCL++ JSON
 * execution plan at `path` (one file, written for this communicator's size) as an algorithm of
 * this communicator, and writes its name into name[nameBytes] (name may be NULL). Then
 * mscclppAlgorithmExecute runs it by that name. Errors name the file and the JSON path at
 * fault. One thread per communicator. */
mscclppResult_t mscclppExecutionPlanLoad(mscclppComm_t comm, const char* path, char* name,
                                         size_t nameBytes);

#ifdef __cplusplus
}
#endif

#endif /* MSCCLPP_H_ */
