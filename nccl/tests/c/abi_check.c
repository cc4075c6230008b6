/* The C side of the shim's CPU checks: built with `cc` against include/nccl.h and linked to
 * libmscclpp_nccl.so (as libnccl.so.2) by tests/c_abi.rs. No GPU needed: init stops with a clear
 * error after the bootstrap when there is none. Exits non-zero on the first failed check. */
#include <mscclpp_nccl_registry.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
      failures++;                                          \
    }                                                      \
  } while (0)

/* The call returned `want` and ncclGetLastError mentions `word`. */
static void expect(const char* what, ncclResult_t got, ncclResult_t want, const char* word) {
  const char* last = ncclGetLastError(NULL);
  CHECK(got == want, "%s: returned %d (%s), expected %d; last error: %s", what, got,
        ncclGetErrorString(got), want, last);
  if (word) CHECK(strstr(last, word) != NULL, "%s: last error lacks \"%s\": %s", what, word, last);
  printf("ok %-40s -> %s | %s\n", what, ncclGetErrorString(got), last);
}

struct init_args {
  ncclUniqueId id;
  int nranks, rank;
  ncclResult_t result;
  char error[512];
};

static void* init_rank(void* p) {
  struct init_args* a = (struct init_args*)p;
  ncclComm_t comm = NULL;
  a->result = ncclCommInitRank(&comm, a->nranks, a->id, a->rank);
  snprintf(a->error, sizeof a->error, "%s", ncclGetLastError(NULL));
  if (a->result == ncclSuccess) ncclCommDestroy(comm);
  return NULL;
}

/* Answers with what it was told, so the checks see the request's layout as C lays it out. */
static int echo_selector(const mscclppNcclSelectionRequest* r, char* name, size_t capacity,
                         void* context) {
  if (r->message_size == 0) return 0;
  if (r->message_size == 1) return -2;
  snprintf(name, capacity, "%s:%zu:%s:%d/%d@%d:%p:%d:%d:%s", r->collective, r->message_size,
           r->dtype, r->rank, r->world_size, r->nranks_per_node, r->stream, r->in_place,
           r->symmetric_memory, (const char*)context);
  return 1;
}

/* The registry (mscclpp_nccl_registry.h): a plan from the file MSCCLPP_TEST_PLAN names, a
 * malformed one, and the selector through mscclppNcclAskSelector. */
static void registry_checks(void) {
  expect("clear", mscclppNcclClearRegistry(), ncclSuccess, NULL);
  expect("register NULL", mscclppNcclRegisterPlan(NULL), ncclInvalidArgument, "NULL");
  expect("register malformed", mscclppNcclRegisterPlan("{\"name\": "), ncclInvalidArgument,
         "the plan is refused");
  const char* path = getenv("MSCCLPP_TEST_PLAN");
  CHECK(path != NULL, "MSCCLPP_TEST_PLAN is unset");
  FILE* f = path ? fopen(path, "rb") : NULL;
  CHECK(f != NULL, "cannot open %s", path ? path : "(null)");
  if (f) {
    static char json[1 << 20];
    size_t n = fread(json, 1, sizeof json - 1, f);
    fclose(f);
    json[n] = 0;
    expect("register the plan", mscclppNcclRegisterPlan(json), ncclSuccess, NULL);
    expect("register it again", mscclppNcclRegisterPlan(json), ncclSuccess, NULL);
  }
  static char tag[] = "ctx";
  expect("set the selector", mscclppNcclSetSelector(echo_selector, tag), ncclSuccess, NULL);
  char text[256];
  size_t length = 0;
  expect("describe", mscclppNcclDescribeRegistry(text, sizeof text, &length), ncclSuccess, NULL);
  CHECK(strcmp(text, "plans: allgather_put_2; selector: set") == 0 && length == strlen(text),
        "describe gave \"%s\" (length %zu)", text, length);
  mscclppNcclSelectionRequest request = {"allgather", 4096, "f32", 4, 2, 1, (void*)0x70, 1, 0};
  char name[128];
  int answered = -1;
  expect("ask", mscclppNcclAskSelector(&request, name, sizeof name, &answered), ncclSuccess, NULL);
  CHECK(answered == 1 && strcmp(name, "allgather:4096:f32:1/4@2:0x70:1:0:ctx") == 0,
        "ask gave %d \"%s\"", answered, name);
  request.message_size = 0;
  expect("ask, no answer", mscclppNcclAskSelector(&request, name, sizeof name, &answered),
         ncclSuccess, NULL);
  CHECK(answered == 0 && name[0] == 0, "no answer gave %d \"%s\"", answered, name);
  request.message_size = 1;
  expect("ask, the selector fails", mscclppNcclAskSelector(&request, name, sizeof name, &answered),
         ncclInvalidArgument, "the registered selector failed for allgather of 1 bytes");
  expect("clear again", mscclppNcclClearRegistry(), ncclSuccess, NULL);
  expect("describe, cut", mscclppNcclDescribeRegistry(text, 6, &length), ncclSuccess, NULL);
  CHECK(strcmp(text, "plans") == 0 && length == strlen("plans: none; selector: none"),
        "cut describe gave \"%s\" (length %zu)", text, length);
}

int main(void) {
  registry_checks();

  /* Versions. */
  int version = 0;
  CHECK(ncclGetVersion(&version) == ncclSuccess && version == NCCL_VERSION_CODE,
        "ncclGetVersion gave %d, header says %d", version, NCCL_VERSION_CODE);
  CHECK(NCCL_VERSION_CODE == 22809, "NCCL_VERSION_CODE %d", NCCL_VERSION_CODE);
  int ours = -1;
  CHECK(mscclppGetVersion(&ours) == ncclSuccess && ours >= 0, "mscclppGetVersion gave %d", ours);
  expect("ncclGetVersion(NULL)", ncclGetVersion(NULL), ncclInvalidArgument, "NULL");

  /* Error strings: one per code, distinct, and something for unknown codes. */
  for (int i = 0; i < ncclNumResults; i++) {
    const char* s = ncclGetErrorString((ncclResult_t)i);
    CHECK(s && *s, "no string for code %d", i);
    for (int j = 0; j < i; j++)
      CHECK(strcmp(s, ncclGetErrorString((ncclResult_t)j)) != 0, "codes %d and %d share text", i, j);
  }
  CHECK(ncclGetErrorString((ncclResult_t)99) != NULL, "no string for an unknown code");
  CHECK(ncclGetLastError(NULL) != NULL, "ncclGetLastError returned NULL");

  /* Layouts. */
  CHECK(sizeof(ncclUniqueId) == 128, "sizeof(ncclUniqueId) = %zu", sizeof(ncclUniqueId));
  CHECK(sizeof(ncclConfig_t) == 80, "sizeof(ncclConfig_t) = %zu", sizeof(ncclConfig_t));

  /* UniqueId: made here, copied by value, and refused when corrupted. */
  ncclUniqueId id, copy;
  CHECK(ncclGetUniqueId(&id) == ncclSuccess, "ncclGetUniqueId: %s", ncclGetLastError(NULL));
  memcpy(&copy, &id, sizeof id);
  int nonzero = 0;
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) nonzero |= copy.internal[i];
  CHECK(nonzero, "the unique id is all zeros");
  expect("ncclGetUniqueId(NULL)", ncclGetUniqueId(NULL), ncclInvalidArgument, "NULL");

  ncclComm_t comm = NULL;
  expect("init nranks 0", ncclCommInitRank(&comm, 0, id, 0), ncclInvalidArgument, "nranks");
  expect("init rank 2 of 2", ncclCommInitRank(&comm, 2, id, 2), ncclInvalidArgument, "rank 2");
  expect("init rank -1", ncclCommInitRank(&comm, 2, id, -1), ncclInvalidArgument, "rank -1");
  expect("init null comm", ncclCommInitRank(NULL, 1, id, 0), ncclInvalidArgument, "NULL");
  ncclUniqueId bad = id;
  bad.internal[50] ^= 1;
  expect("init corrupted id", ncclCommInitRank(&comm, 1, bad, 0), ncclInvalidArgument, "checksum");
  memset(&bad, 0, sizeof bad);
  expect("init foreign id", ncclCommInitRank(&comm, 1, bad, 0), ncclInvalidArgument, "magic");

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.magic = 0;
  expect("init config bad magic", ncclCommInitRankConfig(&comm, 1, id, 0, &config),
         ncclInvalidArgument, "magic");

  /* A missing rank: rank 0 of 2 alone; the timeout names rank 1. */
  expect("init with rank 1 missing", ncclCommInitRank(&comm, 2, id, 0), ncclRemoteError, "[1]");
  CHECK(comm == NULL, "a failed blocking init left a handle");

  /* Nonblocking: ncclInProgress, then the same failure through ncclCommGetAsyncError. */
  ncclUniqueId id2;
  CHECK(ncclGetUniqueId(&id2) == ncclSuccess, "second id");
  ncclConfig_t nb = NCCL_CONFIG_INITIALIZER;
  nb.blocking = 0;
  expect("nonblocking init", ncclCommInitRankConfig(&comm, 2, id2, 0, &nb), ncclInProgress, NULL);
  ncclResult_t state = ncclInProgress;
  while (state == ncclInProgress) CHECK(ncclCommGetAsyncError(comm, &state) == ncclSuccess, "poll");
  expect("nonblocking init outcome", state, ncclRemoteError, "[1]");
  expect("op on a failed comm", ncclAllReduce(NULL, NULL, 1, ncclFloat, ncclSum, comm, NULL),
         ncclRemoteError, "init failed");
  CHECK(ncclCommDestroy(comm) == ncclSuccess, "destroying a failed comm");

  /* Mismatched ids: two ranks, each with its own job id; each times out waiting for the other. */
  struct init_args a = {.nranks = 2, .rank = 0}, b = {.nranks = 2, .rank = 1};
  CHECK(ncclGetUniqueId(&a.id) == ncclSuccess && ncclGetUniqueId(&b.id) == ncclSuccess, "ids");
  pthread_t ta, tb;
  pthread_create(&ta, NULL, init_rank, &a);
  pthread_create(&tb, NULL, init_rank, &b);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  CHECK(a.result != ncclSuccess && b.result != ncclSuccess, "mismatched ids were accepted");
  printf("ok mismatched ids -> %d %d | %s | %s\n", a.result, b.result, a.error, b.error);

  /* The id round trip: two ranks with one id meet; without a GPU they then fail naming it. */
  struct init_args r0 = {.nranks = 2, .rank = 0}, r1 = {.nranks = 2, .rank = 1};
  CHECK(ncclGetUniqueId(&r0.id) == ncclSuccess, "id");
  r1.id = r0.id;
  pthread_create(&ta, NULL, init_rank, &r0);
  pthread_create(&tb, NULL, init_rank, &r1);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  printf("ok id round trip -> %d %d | %s\n", r0.result, r1.result, r0.error);
  CHECK(r0.result == ncclSuccess || (r0.result != ncclRemoteError && strstr(r0.error, "GPU")),
        "two ranks with one id did not get past the bootstrap: %s", r0.error);

  /* One thread, two ranks: grouped inits and ncclCommInitAll meet in the bootstrap (no timeout);
   * without a GPU they then fail naming it. */
  ncclUniqueId gid;
  ncclComm_t pair[2] = {NULL, NULL};
  CHECK(ncclGetUniqueId(&gid) == ncclSuccess, "id");
  CHECK(ncclGroupStart() == ncclSuccess, "group start");
  CHECK(ncclCommInitRank(&pair[0], 2, gid, 0) == ncclSuccess, "grouped init 0 is deferred");
  CHECK(ncclCommInitRank(&pair[1], 2, gid, 1) == ncclSuccess, "grouped init 1 is deferred");
  ncclResult_t g = ncclGroupEnd();
  printf("ok grouped init of 2 ranks -> %s | %s\n", ncclGetErrorString(g), ncclGetLastError(NULL));
  CHECK(g == ncclSuccess || (g != ncclRemoteError && strstr(ncclGetLastError(NULL), "GPU")),
        "grouped init: %s", ncclGetLastError(NULL));
  for (int i = 0; i < 2; i++) ncclCommDestroy(pair[i]);
  int devs[2] = {0, 0};
  ncclResult_t all = ncclCommInitAll(pair, 2, devs);
  printf("ok ncclCommInitAll of 2 ranks -> %s | %s\n", ncclGetErrorString(all), ncclGetLastError(NULL));
  CHECK(all == ncclSuccess || (all != ncclRemoteError && strstr(ncclGetLastError(NULL), "GPU")),
        "ncclCommInitAll: %s", ncclGetLastError(NULL));
  if (all == ncclSuccess) {
    int dev = -1, rank = -1, n = 0;
    CHECK(ncclCommCuDevice(pair[1], &dev) == ncclSuccess && dev == 0, "CuDevice %d", dev);
    CHECK(ncclCommUserRank(pair[1], &rank) == ncclSuccess && rank == 1, "UserRank %d", rank);
    CHECK(ncclCommCount(pair[1], &n) == ncclSuccess && n == 2, "Count %d", n);
    for (int i = 0; i < 2; i++) CHECK(ncclCommDestroy(pair[i]) == ncclSuccess, "destroy %d", i);
  }
  expect("ncclCommInitAll ndev 0", ncclCommInitAll(pair, 0, NULL), ncclInvalidArgument, "nranks");

  /* Handles that are not communicators. */
  int count = 0;
  expect("count of NULL", ncclCommCount(NULL, &count), ncclInvalidArgument, "NULL");
  expect("destroy of a made-up comm", ncclCommDestroy((ncclComm_t)0x1230), ncclInvalidArgument,
         "not a live communicator");
  expect("allreduce on NULL", ncclAllReduce(NULL, NULL, 1, ncclFloat, ncclSum, NULL, NULL),
         ncclInvalidArgument, "NULL");

  /* Groups nest; an unmatched end is refused. */
  CHECK(ncclGroupStart() == ncclSuccess && ncclGroupStart() == ncclSuccess, "group start");
  CHECK(ncclGroupEnd() == ncclSuccess && ncclGroupEnd() == ncclSuccess, "group end");
  expect("unmatched group end", ncclGroupEnd(), ncclInvalidUsage, "without a matching");
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  CHECK(ncclGroupStart() == ncclSuccess, "group start");
  CHECK(ncclGroupSimulateEnd(&sim) == ncclSuccess, "simulate end: %s", ncclGetLastError(NULL));

  /* Memory without a GPU: an error that says why, not a crash. */
  void* p = NULL;
  ncclResult_t m = ncclMemAlloc(&p, 1 << 20);
  printf("ok ncclMemAlloc -> %s | %s\n", ncclGetErrorString(m), ncclGetLastError(NULL));
  if (m == ncclSuccess) CHECK(ncclMemFree(p) == ncclSuccess, "ncclMemFree");
  expect("free of a foreign pointer", ncclMemFree((void*)0x1000), ncclInvalidArgument,
         "not allocated by ncclMemAlloc");

  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("all C ABI checks passed\n");
  return 0;
}
