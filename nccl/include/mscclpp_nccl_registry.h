/*
 * mscclpp_nccl_registry.h of mscclpp-rs: what a program registers with libmscclpp_nccl.so for
 * its NCCL calls, beside nccl.h. The mscclpp Python package calls these for the plans and the
 * selector given to its AlgorithmCollectionBuilder when the shim is loaded in its process; C and
 * C++ programs can call them too. nccl/README.md ("Registered in the process") has the rules:
 *
 * - A plan (MSCCL++'s JSON execution-plan format) joins every communicator created after it is
 *   registered, ahead of the native algorithms for the calls it matches, when every rank
 *   registered the same plans. A plan of the same name replaces the earlier one.
 * - The selector is asked before every collective of every communicator, on the calling thread,
 *   possibly from several threads at once. It writes an algorithm's name (a plan's or a native
 *   algorithm's, NUL-terminated, at most `capacity` bytes with the NUL) and returns 1, returns 0
 *   to leave the choice to the shim, or returns a negative value to fail the call. Every rank must
 *   answer alike for the same call.
 *
 * Every function returns ncclSuccess, or an error code with the reason in ncclGetLastError.
 */
#ifndef MSCCLPP_NCCL_REGISTRY_H_
#define MSCCLPP_NCCL_REGISTRY_H_

#include <stddef.h>

#include "nccl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What the selector is told about a call. */
typedef struct {
  const char* collective; /* MSCCL++'s name: "allreduce", "allgather", "reducescatter", ... */
  size_t message_size;    /* bytes of the call's input buffer on this rank */
  const char* dtype;      /* the runtime's name: "bf16", "f32", "i32", ... */
  int world_size;
  int nranks_per_node; /* ranks on this rank's host */
  int rank;
  void* stream;         /* the call's cudaStream_t */
  int in_place;         /* non-zero: the buffers are in place, in MSCCL++'s meaning */
  int symmetric_memory; /* non-zero: the caller promised symmetric memory */
} mscclppNcclSelectionRequest;

typedef int (*mscclppNcclSelector)(const mscclppNcclSelectionRequest* request, char* name,
                                   size_t capacity, void* context);

/* Registers the plan `json` for communicators created from now on; malformed or invalid plans
 * are refused with ncclInvalidArgument. */
ncclResult_t mscclppNcclRegisterPlan(const char* json);

/* Sets the selector (NULL clears it); `context` is handed back to it on every call. */
ncclResult_t mscclppNcclSetSelector(mscclppNcclSelector selector, void* context);

/* Forgets every registered plan and the selector (communicators keep the plans they took). */
ncclResult_t mscclppNcclClearRegistry(void);

/* What is registered ("plans: a, b; selector: set"), copied NUL-terminated into `text` (cut at
 * `capacity` bytes); its full length without the NUL goes to `length` unless it is NULL. */
ncclResult_t mscclppNcclDescribeRegistry(char* text, size_t capacity, size_t* length);

/* Asks the selector about `request` as a communicator would: `*answered` is 1 and `name` holds
 * its answer, or 0 and `name` is "". A selector's failure is ncclInvalidArgument. */
ncclResult_t mscclppNcclAskSelector(const mscclppNcclSelectionRequest* request, char* name,
                                    size_t capacity, int* answered);

#ifdef __cplusplus
}
#endif

#endif /* MSCCLPP_NCCL_REGISTRY_H_ */
