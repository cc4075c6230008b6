/*
 * mscclpp_nccl.h of mscclpp-rs: the NCCL 2.28 C interface under the mscclpp_ prefix, served by
 * libmscclpp_embed.a / libmscclpp_embed.so for stacks that are themselves the NCCL ABI
 * (RCCL-style) and link us in beside their own ncclX symbols. docs/embedding.md is the guide.
 *
 * Each mscclpp_ncclX behaves as ncclX of libmscclpp_nccl.so (nccl.h documents the ABI; the shim's
 * README the semantics), with one difference: there is no fallback library. What has no native
 * path here fails with ncclInvalidUsage and mscclpp_ncclGetLastError says why, for the host to
 * take its own path; MSCCLPP_NCCL_LIB_PATH is ignored. No ncclX or pncclX symbol is exported.
 *
 * The types are NCCL's: include the host's own nccl.h first (NCCL 2.28's, or a header declaring
 * the same types), or let this header include ours (nccl.h beside it). A communicator made with
 * mscclpp.h (say over the host's own bootstrap) is an ncclComm_t here:
 * mscclpp_ncclCommFromMscclpp converts the handle type.
 *
 * Threads: as in NCCL. Calls on one communicator come from one thread at a time, except
 * mscclpp_ncclCommGetAsyncError, mscclpp_ncclCommAbort and mscclpp_ncclCommDestroy, which any
 * thread may call at any time (a watchdog); the version, error-string and unique-id functions
 * are safe from any thread.
 */
#ifndef MSCCLPP_NCCL_H_
#define MSCCLPP_NCCL_H_

#include "nccl.h"
#include "mscclpp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The same handle, seen by the NCCL ABI. */
static inline ncclComm_t mscclpp_ncclCommFromMscclpp(mscclppComm_t comm) {
  return (ncclComm_t)(void*)comm;
}

/* Versions and errors. */
ncclResult_t mscclpp_ncclGetVersion(int* version);
const char* mscclpp_ncclGetErrorString(ncclResult_t result);
const char* mscclpp_ncclGetLastError(ncclComm_t comm);
void mscclpp_ncclResetDebugInit(void);

/* Memory usable by every algorithm, zero-copy ones included (VMM allocations). */
ncclResult_t mscclpp_ncclMemAlloc(void** ptr, size_t size);
ncclResult_t mscclpp_ncclMemFree(void* ptr);

/* Communicator lifecycle. */
ncclResult_t mscclpp_ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t mscclpp_ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t mscclpp_ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                            ncclConfig_t* config);
ncclResult_t mscclpp_ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId,
                                              ncclUniqueId* commIds, ncclConfig_t* config);
ncclResult_t mscclpp_ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist);
ncclResult_t mscclpp_ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                   ncclConfig_t* config);
ncclResult_t mscclpp_ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
                                    ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags);
ncclResult_t mscclpp_ncclCommFinalize(ncclComm_t comm);
ncclResult_t mscclpp_ncclCommDestroy(ncclComm_t comm);
ncclResult_t mscclpp_ncclCommAbort(ncclComm_t comm);
ncclResult_t mscclpp_ncclCommRevoke(ncclComm_t comm, int revokeFlags);
ncclResult_t mscclpp_ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
ncclResult_t mscclpp_ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t mscclpp_ncclCommCuDevice(const ncclComm_t comm, int* device);
ncclResult_t mscclpp_ncclCommUserRank(const ncclComm_t comm, int* rank);

/* Buffer registration. */
ncclResult_t mscclpp_ncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle);
ncclResult_t mscclpp_ncclCommDeregister(const ncclComm_t comm, void* handle);
ncclResult_t mscclpp_ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win,
                                            int winFlags);
ncclResult_t mscclpp_ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);

/* NCCL's device API is not offered: these two refuse with ncclInvalidUsage. */
ncclResult_t mscclpp_ncclDevCommCreate(ncclComm_t comm, const ncclDevCommRequirements* reqs,
                                       ncclDevComm* outDevComm);
ncclResult_t mscclpp_ncclDevCommDestroy(ncclComm_t comm, const ncclDevComm* devComm);

/* Custom reduction: sum of the inputs each multiplied by *scalar first. */
ncclResult_t mscclpp_ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
                                              ncclScalarResidence_t residence, ncclComm_t comm);
ncclResult_t mscclpp_ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);

/* Collectives and point-to-point: each returns once its work is enqueued on `stream`. */
ncclResult_t mscclpp_ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                                   ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                   cudaStream_t stream);
ncclResult_t mscclpp_ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                   ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t mscclpp_ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                       ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                       cudaStream_t stream);
ncclResult_t mscclpp_ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                                   ncclDataType_t datatype, int root, ncclComm_t comm,
                                   cudaStream_t stream);
ncclResult_t mscclpp_ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root,
                               ncclComm_t comm, cudaStream_t stream);
ncclResult_t mscclpp_ncclReduce(const void* sendbuff, void* recvbuff, size_t count,
                                ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                                cudaStream_t stream);
ncclResult_t mscclpp_ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count,
                                  ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t mscclpp_ncclGather(const void* sendbuff, void* recvbuff, size_t count,
                                ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t mscclpp_ncclScatter(const void* sendbuff, void* recvbuff, size_t count,
                                 ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t mscclpp_ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                              ncclComm_t comm, cudaStream_t stream);
ncclResult_t mscclpp_ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                              ncclComm_t comm, cudaStream_t stream);

/* Groups: calls between Start and End (nestable) are launched together at the outermost End. */
ncclResult_t mscclpp_ncclGroupStart(void);
ncclResult_t mscclpp_ncclGroupEnd(void);
ncclResult_t mscclpp_ncclGroupSimulateEnd(ncclSimInfo_t* simInfo);

#ifdef __cplusplus
}
#endif

#endif /* MSCCLPP_NCCL_H_ */
