/*
 * A host stack in the shape of RCCL embedding mscclpp-rs: it is itself the NCCL ABI (it defines
 * ncclAllReduce), links libmscclpp_embed.a, and
 *  - initialises our communicator over its own bootstrap (mscclppCommInitBootstrap with its
 *    all-gather, barrier, send and recv), not ours;
 *  - sends all-reduces of at most STACK_MSCCLPP_THRESHOLD bytes (default 1 MiB, as
 *    RCCL_MSCCLPP_THRESHOLD) to mscclpp_ncclAllReduce and larger ones to its own path: a plain
 *    ring through the host, the stand-in for the stack's own kernels;
 *  - aborts our communicator when its bootstrap sees a peer die, as a host stack's watchdog does.
 *
 * The ranks are processes forked from one launcher, which is also the stack's bootstrap: a hub
 * that every rank reaches through a socket pair (all-gathers, barriers, messages), with a second
 * socket pair per rank on which it tells the rank that a peer died.
 *
 *   stack cpu            the CPU checks (CI): versions, error texts, thread-local errors, init
 *                        with bad arguments, two ranks whose descriptions disagree, an init that
 *                        reaches the GPU step (fails without a GPU, with its reason), the stack's
 *                        own ring, and the hub failing the survivors' calls when a rank is killed
 *   stack gpu NRANKS     every size from 1 element to 8 MiB on both paths, in and out of place,
 *                        every element checked; a CUDA graph of our all-reduce replayed
 *   stack kill NRANKS    a rank SIGKILLed while every rank loops on all-reduces: each survivor
 *                        must end with an error within STACK_KILL_DEADLINE s (default 60), not hang
 * gpu and kill need -DSTACK_CUDA (CUDA runtime); without it they say they skip.
 * Ranks share GPU (rank % device count): NRANKS=2, 4 and 8 on one GPU.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef STACK_CUDA
#include <cuda_runtime.h>
#endif

#include "mscclpp_nccl.h"

#define MAX_RANKS 16
/* How long a rank waits for the hub before its callback fails (the host's timeout). */
#define HUB_TIMEOUT_MS 120000

static int failures = 0;
#define CHECK(cond, ...)                                             \
  do {                                                               \
    if (!(cond)) {                                                   \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);           \
      fprintf(stderr, __VA_ARGS__);                                  \
      fprintf(stderr, " [last error: %s]\n", mscclppGetLastError()); \
      failures++;                                                    \
    }                                                                \
  } while (0)

/* ---------------------------------------------------------------- the hub (launcher side) */

/* OP_READY: a rank says it is in its loop (kill mode); OP_BYE: it is leaving cleanly. */
enum { OP_ALLGATHER = 1, OP_BARRIER, OP_SEND, OP_RECV, OP_READY, OP_BYE };
/* Channels: our library's traffic and the stack's own ring never see each other's messages. */
enum { CHAN_MSCCLPP = 0, CHAN_STACK = 1 };

typedef struct {
  int32_t op, chan, peer, tag;
  uint64_t bytes;
} Request;
typedef struct {
  int32_t status; /* 0, or -1: a peer died or the request was wrong */
  int32_t pad;
  uint64_t bytes;
} Reply;

typedef struct Message {
  int from, to, chan, tag;
  uint64_t bytes;
  char* data;
  struct Message* next;
} Message;

/* Writes n bytes to a socket; -1 when the other end is gone (no SIGPIPE: a rank the launcher
 * answers may have been killed a moment ago). */
static int write_all(int fd, const void* p, size_t n) {
  const char* c = p;
  while (n > 0) {
    ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    c += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Reads n bytes, waiting at most timeout_ms for each piece; -1 on EOF, error or timeout. */
static int read_all(int fd, void* p, size_t n, int timeout_ms) {
  char* c = p;
  while (n > 0) {
    struct pollfd pfd = {fd, POLLIN, 0};
    int rc = poll(&pfd, 1, timeout_ms);
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) return -1;
    ssize_t r = read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    c += r;
    n -= (size_t)r;
  }
  return 0;
}

typedef struct {
  int nranks;
  int fd[MAX_RANKS];      /* bootstrap socket of each rank (-1 once gone) */
  int control[MAX_RANKS]; /* where the hub tells a rank that a peer died */
  int dead;               /* a rank vanished without saying goodbye */
  int ready;              /* ranks that said they are in their loop (OP_READY) */
  /* The all-gather (and barrier) in progress: who arrived, and their parts. */
  int gather_op, gather_arrived[MAX_RANKS], gather_count;
  uint64_t gather_bytes;
  char* gather_buf;
  /* A receive each rank waits in, if any. */
  int recv_waiting[MAX_RANKS];
  Request recv_req[MAX_RANKS];
  Message* mail;
} Hub;

static void reply(Hub* h, int r, int status, const void* data, uint64_t bytes) {
  Reply rep = {status, 0, status == 0 ? bytes : 0};
  if (h->fd[r] < 0) return;
  if (write_all(h->fd[r], &rep, sizeof rep) != 0 ||
      (status == 0 && bytes > 0 && write_all(h->fd[r], data, bytes) != 0)) {
    /* A rank that cannot be answered is treated as gone when its EOF comes. */
  }
}

static void fail_everyone(Hub* h) {
  for (int r = 0; r < h->nranks; r++) {
    if (h->fd[r] < 0) continue;
    if (h->gather_arrived[r] || h->recv_waiting[r]) reply(h, r, -1, NULL, 0);
    h->gather_arrived[r] = 0;
    h->recv_waiting[r] = 0;
  }
  h->gather_count = 0;
}

static int deliver(Hub* h, int r) {
  Request* q = &h->recv_req[r];
  for (Message **m = &h->mail; *m; m = &(*m)->next) {
    Message* x = *m;
    if (x->to == r && x->from == q->peer && x->chan == q->chan && x->tag == q->tag) {
      *m = x->next;
      if (x->bytes != q->bytes) {
        fprintf(stderr, "hub: rank %d waits for %llu bytes from rank %d, the message has %llu\n",
                r, (unsigned long long)q->bytes, x->from, (unsigned long long)x->bytes);
        reply(h, r, -1, NULL, 0);
      } else {
        reply(h, r, 0, x->data, x->bytes);
      }
      free(x->data);
      free(x);
      h->recv_waiting[r] = 0;
      return 1;
    }
  }
  return 0;
}

/* One request from rank r; -1 when r is gone. */
static int serve(Hub* h, int r) {
  Request q;
  if (read_all(h->fd[r], &q, sizeof q, 10000) != 0) return -1;
  char* data = NULL;
  if ((q.op == OP_ALLGATHER || q.op == OP_SEND) && q.bytes > 0) {
    data = malloc(q.bytes);
    if (!data || read_all(h->fd[r], data, q.bytes, 10000) != 0) {
      free(data);
      return -1;
    }
  }
  if (q.op == OP_BYE) {
    free(data);
    return 1;
  }
  if (h->dead) { /* the job is over: every request fails at once */
    free(data);
    reply(h, r, -1, NULL, 0);
    return 0;
  }
  switch (q.op) {
    case OP_ALLGATHER:
    case OP_BARRIER:
      if (h->gather_count == 0) {
        h->gather_op = q.op;
        h->gather_bytes = q.bytes;
        free(h->gather_buf);
        h->gather_buf = calloc(1, q.bytes * (uint64_t)h->nranks + 1);
      }
      if (q.op != h->gather_op || q.bytes != h->gather_bytes) {
        fprintf(stderr, "hub: rank %d's collective (op %d, %llu bytes) is not the one in progress\n",
                r, q.op, (unsigned long long)q.bytes);
        reply(h, r, -1, NULL, 0);
        break;
      }
      if (q.bytes > 0) memcpy(h->gather_buf + (uint64_t)r * q.bytes, data, q.bytes);
      h->gather_arrived[r] = 1;
      if (++h->gather_count == h->nranks) {
        for (int p = 0; p < h->nranks; p++) {
          reply(h, p, 0, h->gather_buf, q.op == OP_ALLGATHER ? q.bytes * (uint64_t)h->nranks : 0);
          h->gather_arrived[p] = 0;
        }
        h->gather_count = 0;
      }
      break;
    case OP_SEND: {
      Message* m = calloc(1, sizeof *m);
      *m = (Message){r, q.peer, q.chan, q.tag, q.bytes, data, NULL};
      data = NULL;
      Message** end = &h->mail;
      while (*end) end = &(*end)->next;
      *end = m;
      reply(h, r, 0, NULL, 0);
      if (q.peer >= 0 && q.peer < h->nranks && h->recv_waiting[q.peer]) deliver(h, q.peer);
      break;
    }
    case OP_READY:
      h->ready++;
      reply(h, r, 0, NULL, 0);
      break;
    case OP_RECV:
      h->recv_req[r] = q;
      h->recv_waiting[r] = 1;
      deliver(h, r);
      break;
    default:
      reply(h, r, -1, NULL, 0);
  }
  free(data);
  return 0;
}

/* The kill mode's deadline: seconds a survivor may take to end after the kill. */
static double kill_deadline(void) {
  const char* d = getenv("STACK_KILL_DEADLINE");
  return d ? atof(d) : 60.0;
}

static double seconds_since(struct timespec t) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (double)(now.tv_sec - t.tv_sec) + (double)(now.tv_nsec - t.tv_nsec) * 1e-9;
}

/* Serves the ranks until every one has gone. `victim` >= 0 (kill mode): that rank gets SIGKILL
 * half a second after every rank said it is in its loop (OP_READY), and a survivor still running
 * kill_deadline() s later is reported as hung (1 is returned) and killed. A rank gone without a
 * goodbye fails every request in progress and later, and the others hear of it on their
 * control socket. */
static int run_hub(Hub* h, pid_t* pids, int victim) {
  int alive = h->nranks, hung = 0;
  struct timespec ready_at = {0, 0}, killed_at = {0, 0};
  while (alive > 0) {
    struct pollfd pfd[MAX_RANKS];
    for (int r = 0; r < h->nranks; r++) pfd[r] = (struct pollfd){h->fd[r], POLLIN, 0};
    int rc = poll(pfd, (nfds_t)h->nranks, 100);
    if (rc < 0 && errno != EINTR) break;
    if (victim >= 0 && h->ready == h->nranks) {
      if (ready_at.tv_sec == 0) clock_gettime(CLOCK_MONOTONIC, &ready_at);
      if (seconds_since(ready_at) > 0.5) {
        fprintf(stderr, "launcher: SIGKILL to rank %d (pid %d) while every rank is in its loop\n",
                victim, (int)pids[victim]);
        kill(pids[victim], SIGKILL);
        clock_gettime(CLOCK_MONOTONIC, &killed_at);
        victim = -1;
      }
    }
    if (killed_at.tv_sec != 0 && !hung && seconds_since(killed_at) > kill_deadline()) {
      for (int r = 0; r < h->nranks; r++) {
        if (h->fd[r] < 0) continue;
        fprintf(stderr, "launcher: HANG: rank %d has not ended %.0f s after the kill\n", r, kill_deadline());
        kill(pids[r], SIGKILL);
      }
      hung = 1;
    }
    for (int r = 0; r < h->nranks && rc > 0; r++) {
      if (h->fd[r] < 0 || !(pfd[r].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      int s = serve(h, r);
      if (s == 0) continue;
      if (s < 0) {
        h->dead = 1;
        fprintf(stderr, "launcher: rank %d is gone without a goodbye; telling the others\n", r);
        fail_everyone(h);
        for (int p = 0; p < h->nranks; p++) {
          char dead = (char)r;
          if (p != r && h->control[p] >= 0) (void)write_all(h->control[p], &dead, 1);
        }
      }
      close(h->fd[r]);
      h->fd[r] = -1;
      alive--;
    }
  }
  return hung;
}

/* ---------------------------------------------------------------- the ranks' side */

typedef struct {
  int rank, nranks, fd, control;
  pthread_mutex_t lock; /* one request at a time on the socket */
} Link;

static int hub_call(Link* l, Request q, const void* out, void* in, uint64_t in_bytes) {
  pthread_mutex_lock(&l->lock);
  Reply rep = {-1, 0, 0};
  int ok = write_all(l->fd, &q, sizeof q) == 0 &&
           (out == NULL || q.bytes == 0 || write_all(l->fd, out, q.bytes) == 0) &&
           read_all(l->fd, &rep, sizeof rep, HUB_TIMEOUT_MS) == 0 && rep.status == 0 &&
           rep.bytes == in_bytes && (in_bytes == 0 || read_all(l->fd, in, in_bytes, HUB_TIMEOUT_MS) == 0);
  pthread_mutex_unlock(&l->lock);
  return ok ? 0 : 1;
}

static int cb_all_gather(void* ctx, void* all, size_t bytes) {
  Link* l = ctx;
  Request q = {OP_ALLGATHER, CHAN_MSCCLPP, 0, 0, bytes};
  return hub_call(l, q, (char*)all + (size_t)l->rank * bytes, all, (uint64_t)bytes * l->nranks);
}
static int cb_barrier(void* ctx) {
  Request q = {OP_BARRIER, CHAN_MSCCLPP, 0, 0, 0};
  return hub_call(ctx, q, NULL, NULL, 0);
}
static int cb_send(void* ctx, int peer, int tag, const void* data, size_t bytes) {
  Request q = {OP_SEND, CHAN_MSCCLPP, peer, tag, bytes};
  return hub_call(ctx, q, data, NULL, 0);
}
static int cb_recv(void* ctx, int peer, int tag, void* data, size_t bytes) {
  Request q = {OP_RECV, CHAN_MSCCLPP, peer, tag, bytes};
  return hub_call(ctx, q, NULL, data, bytes);
}

static mscclppBootstrap bootstrap_of(Link* l) {
  mscclppBootstrap b = {MSCCLPP_BOOTSTRAP_VERSION, l->rank, l->nranks, l, cb_all_gather, cb_barrier, cb_send, cb_recv};
  return b;
}

typedef int (*RankMain)(Link* l, void* arg);

/* Exit status of a rank that found no GPU. */
#define RANK_SKIPS 3

/* Forks nranks ranks running `body`, serves them as their hub; 0 when every rank exited 0 (and,
 * with a victim, that one was killed), -1 when every rank found no GPU, else 1. */
static int launch(int nranks, RankMain body, void* arg, int victim) {
  Hub h;
  memset(&h, 0, sizeof h);
  h.nranks = nranks;
  pid_t pids[MAX_RANKS];
  fflush(stdout);
  fflush(stderr);
  for (int r = 0; r < nranks; r++) {
    int sv[2], cv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0 || socketpair(AF_UNIX, SOCK_STREAM, 0, cv) != 0) {
      perror("socketpair");
      return 1;
    }
    pid_t pid = fork();
    if (pid == 0) {
      for (int p = 0; p < r; p++) {
        close(h.fd[p]);
        close(h.control[p]);
      }
      close(sv[0]);
      close(cv[0]);
      Link l = {r, nranks, sv[1], cv[1], PTHREAD_MUTEX_INITIALIZER};
      int rc = body(&l, arg);
      Request bye = {OP_BYE, 0, 0, 0, 0};
      (void)write_all(l.fd, &bye, sizeof bye);
      fflush(stdout);
      fflush(stderr);
      _exit(rc);
    }
    close(sv[1]);
    close(cv[1]);
    h.fd[r] = sv[0];
    h.control[r] = cv[0];
    pids[r] = pid;
  }
  int bad = run_hub(&h, pids, victim), skipped = 0;
  for (int r = 0; r < nranks; r++) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == RANK_SKIPS) {
      skipped++;
      continue;
    }
    int killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    if (r == victim ? !killed : !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      fprintf(stderr, "launcher: rank %d ended with %s %d\n", r, WIFSIGNALED(status) ? "signal" : "status",
              WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
      bad = 1;
    }
    close(h.control[r]);
  }
  if (skipped == nranks) return -1;
  return bad || skipped ? 1 : 0;
}

/* ---------------------------------------------------------------- the stack's own path */

static int stack_send(Link* l, int peer, int tag, const void* data, size_t bytes) {
  Request q = {OP_SEND, CHAN_STACK, peer, tag, bytes};
  return hub_call(l, q, data, NULL, 0);
}
static int stack_recv(Link* l, int peer, int tag, void* data, size_t bytes) {
  Request q = {OP_RECV, CHAN_STACK, peer, tag, bytes};
  return hub_call(l, q, NULL, data, bytes);
}

/* A ring all-reduce (sum) of acc[count] in place over the stack's channel: reduce-scatter, then
 * all-gather, chunk c being rank c's share. 0 when done, else the hub failed a step. */
static int host_ring(Link* l, float* acc, size_t count) {
  int n = l->nranks, me = l->rank, next = (me + 1) % n, prev = (me + n - 1) % n, rc = 0;
  size_t chunk = (count + (size_t)n - 1) / (size_t)n;
  float* in = malloc(chunk * sizeof(float) + 1);
#define SLICE(c) ((size_t)(c) * chunk < count ? (size_t)(c) * chunk : count)
#define SLICE_LEN(c) (SLICE((c) + 1) - SLICE(c))
  for (int step = 0; step < n - 1 && rc == 0; step++) {
    int out_c = (me - step + n) % n, in_c = (me - step - 1 + 2 * n) % n;
    rc |= stack_send(l, next, step, acc + SLICE(out_c), SLICE_LEN(out_c) * sizeof(float));
    rc |= stack_recv(l, prev, step, in, SLICE_LEN(in_c) * sizeof(float));
    for (size_t i = 0; rc == 0 && i < SLICE_LEN(in_c); i++) acc[SLICE(in_c) + i] += in[i];
  }
  for (int step = 0; step < n - 1 && rc == 0; step++) {
    int out_c = (me + 1 - step + n) % n, in_c = (me - step + n) % n;
    rc |= stack_send(l, next, 1000 + step, acc + SLICE(out_c), SLICE_LEN(out_c) * sizeof(float));
    rc |= stack_recv(l, prev, 1000 + step, acc + SLICE(in_c), SLICE_LEN(in_c) * sizeof(float));
  }
#undef SLICE
#undef SLICE_LEN
  free(in);
  return rc;
}

/* Rank r's element i: small integers, so every sum is exact in float. */
static float value(int rank, size_t i) { return (float)((int)((i * 7 + (size_t)rank * 13) % 17) - 8); }

/* Elements of `got` that are not the sum over the ranks (at most 5 reported); 0 when right. */
static int wrong_sums(Link* l, const char* what, const float* got, size_t count) {
  int bad = 0;
  for (size_t i = 0; i < count && bad < 5; i++) {
    float want = 0;
    for (int r = 0; r < l->nranks; r++) want += value(r, i);
    if (got[i] != want) {
      fprintf(stderr, "rank %d: %s: element %zu of %zu is %g, want %g\n", l->rank, what, i, count, got[i], want);
      bad++;
    }
  }
  return bad;
}

/* The stack's own ring on the CPU, every element checked. */
static int rank_ring(Link* l, void* arg) {
  (void)arg;
  size_t counts[] = {1, 5, 1000, 65537};
  int bad = 0;
  for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
    float* acc = malloc(counts[c] * sizeof(float));
    for (size_t i = 0; i < counts[c]; i++) acc[i] = value(l->rank, i);
    if (host_ring(l, acc, counts[c]) != 0) {
      fprintf(stderr, "rank %d: the ring of %zu failed\n", l->rank, counts[c]);
      bad++;
    } else {
      bad += wrong_sums(l, "host ring", acc, counts[c]) != 0;
    }
    free(acc);
  }
  return bad ? 1 : 0;
}

/* The ring in a loop until the hub fails it (a peer was killed): 0 on that error, 1 past the
 * deadline. */
static int rank_ring_until_error(Link* l, void* arg) {
  (void)arg;
  float acc[4096];
  Request ready = {OP_READY, CHAN_STACK, 0, 0, 0};
  if (hub_call(l, ready, NULL, NULL, 0) != 0) return 1;
  struct timespec start;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (long i = 0; seconds_since(start) < kill_deadline(); i++) {
    for (size_t k = 0; k < 4096; k++) acc[k] = value(l->rank, k);
    if (host_ring(l, acc, 4096) != 0) {
      printf("rank %d: the ring failed after %ld rounds, %.2f s: a peer is gone\n", l->rank, i, seconds_since(start));
      return 0;
    }
  }
  return 1;
}

/* ---------------------------------------------------------------- CPU checks */

static void* other_thread_error(void* arg) {
  (void)arg;
  return (void*)(uintptr_t)strlen(mscclppGetLastError());
}

static int rank_disagreeing(Link* l, void* arg) {
  (void)arg;
  l->rank = 0; /* both ranks claim rank 0 (and their callbacks act on it) */
  mscclppBootstrap b = bootstrap_of(l);
  mscclppComm_t comm = NULL;
  mscclppResult_t rc = mscclppCommInitBootstrap(&comm, &b, 0);
  const char* e = mscclppGetLastError();
  if (rc != mscclppInvalidArgument || !strstr(e, "says it is rank 0 of 2") || comm != NULL) {
    fprintf(stderr, "a disagreeing init gave %d: %s\n", rc, e);
    return 1;
  }
  printf("a rank's disagreeing description refused: %s\n", e);
  return 0;
}

static int rank_init_until_gpu(Link* l, void* arg) {
  (void)arg;
  mscclppBootstrap b = bootstrap_of(l);
  mscclppComm_t comm = NULL;
  mscclppResult_t rc = mscclppCommInitBootstrap(&comm, &b, 0);
  if (rc == mscclppSuccess) {
    /* A machine with a GPU: the communicator is real; check it and tear it down. */
    int rank = -1, size = -1;
    if (mscclppCommRank(comm, &rank) || mscclppCommSize(comm, &size) || rank != l->rank || size != l->nranks) {
      fprintf(stderr, "rank %d: rank/size %d/%d\n", l->rank, rank, size);
      return 1;
    }
    printf("rank %d: init over the host's bootstrap succeeded (a GPU is present)\n", l->rank);
    return mscclppCommDestroy(comm) == mscclppSuccess ? 0 : 1;
  }
  const char* e = mscclppGetLastError();
  /* Without a GPU the bootstrap handshake passed and the GPU step names what is missing. */
  if (rc != mscclppUnhandledCudaError || strlen(e) == 0 || comm != NULL) {
    fprintf(stderr, "rank %d: init without a GPU gave %d: %s\n", l->rank, rc, e);
    return 1;
  }
  printf("rank %d: init reached the GPU step over the host's bootstrap: %s\n", l->rank, e);
  return 0;
}

static int cpu_checks(void) {
  /* Over the stack's own bootstrap, two ranks as processes; first, so that the launcher forks
   * before any call of ours starts a thread in it. */
  CHECK(launch(2, rank_disagreeing, NULL, -1) == 0, "disagreeing descriptions");
  CHECK(launch(2, rank_init_until_gpu, NULL, -1) == 0, "init over the host's bootstrap");
  /* The stack's own path and its hub's failure handling, which the GPU modes rely on. */
  CHECK(launch(3, rank_ring, NULL, -1) == 0, "the host ring");
  CHECK(launch(3, rank_ring_until_error, NULL, 2) == 0, "the host ring with a rank killed");

  int v = 0;
  CHECK(mscclppGetVersion(&v) == mscclppSuccess && v > 0, "mscclppGetVersion %d", v);
  int nv = 0;
  CHECK(mscclpp_ncclGetVersion(&nv) == ncclSuccess && nv == NCCL_VERSION_CODE, "mscclpp_ncclGetVersion %d", nv);
  CHECK(strlen(mscclppGetErrorString(mscclppInvalidArgument)) > 0, "error string");
  CHECK(mscclppGetVersion(NULL) == mscclppInvalidArgument, "NULL version");
  CHECK(strstr(mscclppGetLastError(), "mscclppGetVersion: version is NULL") != NULL, "message names the call");
  pthread_t t;
  void* len = NULL;
  pthread_create(&t, NULL, other_thread_error, NULL);
  pthread_join(t, &len);
  CHECK((uintptr_t)len == 0, "another thread sees no failure of its own (%zu bytes)", (size_t)(uintptr_t)len);

  mscclppComm_t comm = NULL;
  mscclppUniqueId id;
  CHECK(mscclppGetUniqueId(NULL) == mscclppInvalidArgument, "NULL unique id");
  CHECK(mscclppGetUniqueId(&id) == mscclppSuccess, "unique id");
  CHECK(mscclppCommInitRank(&comm, 0, id, 0, 0) == mscclppInvalidArgument, "nranks 0");
  CHECK(mscclppCommInitRank(&comm, 2, id, 2, 0) == mscclppInvalidArgument, "rank 2 of 2");
  CHECK(strstr(mscclppGetLastError(), "rank 2 is not in 0..2") != NULL, "names the rank");
  CHECK(mscclppCommInitRank(&comm, 2, id, 0, -1) == mscclppInvalidArgument, "device -1");
  CHECK(mscclppCommInitRank(NULL, 1, id, 0, 0) == mscclppInvalidArgument, "NULL comm");
  mscclppUniqueId junk;
  memset(&junk, 0x5a, sizeof junk);
  CHECK(mscclppCommInitRank(&comm, 1, junk, 0, 0) == mscclppInvalidArgument, "foreign id");

  Link l = {0, 2, -1, -1, PTHREAD_MUTEX_INITIALIZER};
  mscclppBootstrap good = bootstrap_of(&l), b;
  CHECK(mscclppCommInitBootstrap(&comm, NULL, 0) == mscclppInvalidArgument, "NULL bootstrap");
  CHECK(mscclppCommInitBootstrap(NULL, &good, 0) == mscclppInvalidArgument, "NULL comm");
  b = good;
  b.version = 99;
  CHECK(mscclppCommInitBootstrap(&comm, &b, 0) == mscclppInvalidArgument &&
            strstr(mscclppGetLastError(), "version is 99"),
        "bad version");
  b = good;
  b.rank = 5;
  CHECK(mscclppCommInitBootstrap(&comm, &b, 0) == mscclppInvalidArgument &&
            strstr(mscclppGetLastError(), "rank 5 is not in 0..2"),
        "rank out of range");
  b = good;
  b.nranks = 0;
  CHECK(mscclppCommInitBootstrap(&comm, &b, 0) == mscclppInvalidArgument, "nranks 0");
  b = good;
  b.allGather = NULL;
  CHECK(mscclppCommInitBootstrap(&comm, &b, 0) == mscclppInvalidArgument &&
            strstr(mscclppGetLastError(), "allGather and barrier are required"),
        "no allGather");
  b = good;
  b.recv = NULL;
  CHECK(mscclppCommInitBootstrap(&comm, &b, 0) == mscclppInvalidArgument &&
            strstr(mscclppGetLastError(), "send and recv come together"),
        "send without recv");
  CHECK(mscclppCommInitBootstrap(&comm, &good, -3) == mscclppInvalidArgument, "device -3");
  CHECK(comm == NULL, "no handle from failed inits");

  /* Handles that are not communicators. */
  int x = 0;
  mscclppComm_t bogus = (mscclppComm_t)(void*)&x;
  CHECK(mscclppCommDestroy(bogus) == mscclppInvalidArgument, "destroy of a made-up handle");
  CHECK(mscclppCommRank(bogus, &x) == mscclppInvalidArgument, "rank of a made-up handle");
  CHECK(mscclppAlgorithmCount(bogus, mscclppCollAllReduce, &x) == mscclppInvalidArgument, "algorithms");
  CHECK(mscclpp_ncclAllReduce(NULL, NULL, 1, ncclFloat32, ncclSum, mscclpp_ncclCommFromMscclpp(bogus), NULL) ==
            ncclInvalidArgument,
        "prefixed all-reduce on a made-up handle");
  CHECK(mscclppExecutionPlanLoad(bogus, "/nonexistent.json", NULL, 0) == mscclppInvalidArgument, "plan");
  return failures;
}

/* ---------------------------------------------------------------- the stack's NCCL ABI */

/* What a rank's stack knows of its communicator. */
typedef struct {
  Link* link;
  mscclppComm_t ours;
  size_t threshold;
  int routed_ours, routed_ring;
} StackComm;
static StackComm* stack_comm; /* one communicator per rank process in this test */

#ifdef STACK_CUDA
#define CUDA_OK(call)                                                                             \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      fprintf(stderr, "rank %d: %s: %s\n", stack_comm ? stack_comm->link->rank : -1, #call,       \
              cudaGetErrorString(e_));                                                            \
      return ncclUnhandledCudaError;                                                              \
    }                                                                                             \
  } while (0)

/* The stack's own path on the GPU: the host ring on a copy of the buffer. */
static ncclResult_t ring_all_reduce(const float* send, float* recv, size_t count, cudaStream_t stream) {
  float* acc = malloc(count * sizeof(float));
  CUDA_OK(cudaMemcpyAsync(acc, send, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  int rc = host_ring(stack_comm->link, acc, count);
  if (rc == 0) {
    CUDA_OK(cudaMemcpyAsync(recv, acc, count * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
  }
  free(acc);
  return rc == 0 ? ncclSuccess : ncclRemoteError;
}
#endif

/* The stack's ncclAllReduce: small ones to mscclpp-rs, the rest to its own path. */
ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  (void)comm;
  StackComm* s = stack_comm;
  size_t bytes = count * 4;
  if (datatype != ncclFloat32 || op != ncclSum) return ncclInvalidArgument; /* all this test needs */
  if (bytes <= s->threshold) {
    s->routed_ours++;
    return mscclpp_ncclAllReduce(sendbuff, recvbuff, count, datatype, op, mscclpp_ncclCommFromMscclpp(s->ours),
                                 stream);
  }
  s->routed_ring++;
#ifdef STACK_CUDA
  return ring_all_reduce(sendbuff, recvbuff, count, stream);
#else
  return ncclInvalidUsage;
#endif
}

/* ---------------------------------------------------------------- GPU checks */

#ifdef STACK_CUDA

static int stack_init(Link* l, StackComm* s) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) return -1;
  int device = l->rank % ndev;
  if (cudaSetDevice(device) != cudaSuccess) return -1;
  const char* t = getenv("STACK_MSCCLPP_THRESHOLD");
  s->link = l;
  s->threshold = t ? strtoull(t, NULL, 0) : (1u << 20);
  mscclppBootstrap b = bootstrap_of(l);
  mscclppResult_t rc = mscclppCommInitBootstrap(&s->ours, &b, device);
  if (rc != mscclppSuccess) {
    fprintf(stderr, "rank %d: mscclppCommInitBootstrap: %d: %s\n", l->rank, rc, mscclppGetLastError());
    return 1;
  }
  stack_comm = s;
  return 0;
}

/* One all-reduce through the stack, checked element by element; 0 when right. */
static int one_all_reduce(Link* l, size_t count, int in_place, cudaStream_t stream) {
  size_t bytes = count * sizeof(float);
  float *host = malloc(bytes), *dsend = NULL, *drecv = NULL;
  for (size_t i = 0; i < count; i++) host[i] = value(l->rank, i);
  if (cudaMalloc((void**)&dsend, bytes) != cudaSuccess || cudaMalloc((void**)&drecv, bytes) != cudaSuccess) return 1;
  /* On the call's stream: it is non-blocking, so copies on the legacy default stream would not
   * be ordered before the all-reduce (the poison could land after the result). */
  cudaMemcpyAsync(dsend, host, bytes, cudaMemcpyHostToDevice, stream);
  cudaMemsetAsync(drecv, 0xff, bytes, stream); /* poisoned: NaN everywhere */
  float* out = in_place ? dsend : drecv;
  ncclResult_t rc = ncclAllReduce(dsend, out, count, ncclFloat32, ncclSum, NULL, stream);
  cudaError_t ce = cudaStreamSynchronize(stream);
  int bad = 0;
  if (rc != ncclSuccess || ce != cudaSuccess) {
    fprintf(stderr, "rank %d: %zu floats (%s): nccl %d, cuda %s: %s\n", l->rank, count, in_place ? "in place" : "out of place",
            rc, cudaGetErrorString(ce), mscclpp_ncclGetLastError(NULL));
    bad = 1;
  } else {
    cudaMemcpy(host, out, bytes, cudaMemcpyDeviceToHost);
    bad = wrong_sums(l, in_place ? "all-reduce in place" : "all-reduce", host, count);
  }
  cudaFree(dsend);
  cudaFree(drecv);
  free(host);
  return bad;
}

/* A CUDA graph of our all-reduce (through the stack's routing), replayed three times. */
static int graph_all_reduce(Link* l, size_t count, cudaStream_t stream) {
  size_t bytes = count * sizeof(float);
  float *host = malloc(bytes), *dsend = NULL, *drecv = NULL;
  for (size_t i = 0; i < count; i++) host[i] = value(l->rank, i);
  cudaMalloc((void**)&dsend, bytes);
  cudaMalloc((void**)&drecv, bytes);
  cudaMemcpyAsync(dsend, host, bytes, cudaMemcpyHostToDevice, stream);
  if (cudaStreamSynchronize(stream) != cudaSuccess) return 1;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  int bad = 0;
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) != cudaSuccess) return 1;
  ncclResult_t rc = ncclAllReduce(dsend, drecv, count, ncclFloat32, ncclSum, NULL, stream);
  cudaError_t ce = cudaStreamEndCapture(stream, &graph);
  if (rc != ncclSuccess || ce != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
    fprintf(stderr, "rank %d: capture: nccl %d (%s), cuda %s\n", l->rank, rc, mscclpp_ncclGetLastError(NULL),
            cudaGetErrorString(ce));
    return 1;
  }
  for (int replay = 0; replay < 3 && !bad; replay++) {
    cudaMemsetAsync(drecv, 0xff, bytes, stream);
    cudaGraphLaunch(exec, stream);
    if (cudaStreamSynchronize(stream) != cudaSuccess) {
      fprintf(stderr, "rank %d: replay %d failed\n", l->rank, replay);
      bad = 1;
      break;
    }
    cudaMemcpy(host, drecv, bytes, cudaMemcpyDeviceToHost);
    bad = wrong_sums(l, "graph replay", host, count) != 0;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(dsend);
  cudaFree(drecv);
  free(host);
  return bad;
}

/* Runs `name` in place (execution plans are written in place) or out of place through
 * mscclppAlgorithmExecute with the given geometry and checks every element; 0 when right, 2 when
 * the algorithm refused the geometry (with its reason), 1 when wrong. */
static int execute_named(Link* l, mscclppComm_t comm, const char* name, size_t count, int in_place, int nblocks,
                         int nthreads, cudaStream_t stream) {
  size_t bytes = count * sizeof(float);
  float *host = malloc(bytes), *dsend = NULL, *drecv = NULL;
  for (size_t i = 0; i < count; i++) host[i] = value(l->rank, i);
  cudaMalloc((void**)&dsend, bytes);
  cudaMalloc((void**)&drecv, bytes);
  cudaMemcpyAsync(dsend, host, bytes, cudaMemcpyHostToDevice, stream);
  cudaMemsetAsync(drecv, 0xff, bytes, stream);
  float* out = in_place ? dsend : drecv;
  mscclppResult_t rc = mscclppAlgorithmExecute(comm, mscclppCollAllReduce, name, dsend, out, bytes, bytes,
                                               ncclFloat32, ncclSum, 0, stream, nblocks, nthreads);
  int bad = 0;
  if (rc == mscclppInvalidArgument && (nblocks || nthreads)) {
    printf("rank %d: %s refuses %d blocks x %d threads: %s\n", l->rank, name, nblocks, nthreads,
           mscclppGetLastError());
    bad = 2;
  } else if (rc != mscclppSuccess || cudaStreamSynchronize(stream) != cudaSuccess) {
    fprintf(stderr, "rank %d: %s (%zu floats): %d: %s\n", l->rank, name, count, rc, mscclppGetLastError());
    bad = 1;
  } else {
    cudaMemcpy(host, out, bytes, cudaMemcpyDeviceToHost);
    bad = wrong_sums(l, name, host, count) != 0;
  }
  cudaFree(dsend);
  cudaFree(drecv);
  free(host);
  return bad;
}

/* The C API's own path: the algorithm the selector picks, run by name with and without a
 * geometry of our choosing, and an execution plan loaded from STACK_PLAN_DIR. */
static int c_api_checks(Link* l, mscclppComm_t comm, cudaStream_t stream) {
  int bad = 0;
  size_t count = 1 << 14;
  char name[MSCCLPP_MAX_NAME_BYTES];
  float* probe = NULL;
  cudaMalloc((void**)&probe, count * sizeof(float));
  if (mscclppAlgorithmSelect(comm, mscclppCollAllReduce, probe, probe, count * 4, count * 4, ncclFloat32, stream,
                             name, sizeof name) != mscclppSuccess) {
    fprintf(stderr, "rank %d: select: %s\n", l->rank, mscclppGetLastError());
    return 1;
  }
  cudaFree(probe);
  if (l->rank == 0) printf("rank 0: the selector picks %s for %zu floats\n", name, count);
  bad += execute_named(l, comm, name, count, 0, 0, 0, stream) != 0;
  /* The same by name with 2 blocks of 512 threads: right, or refused with its reason. */
  bad += execute_named(l, comm, name, count, 0, 2, 512, stream) == 1;
  const char* dir = getenv("STACK_PLAN_DIR");
  if (dir == NULL) {
    if (l->rank == 0) printf("rank 0: STACK_PLAN_DIR unset: no execution plan checked\n");
    return bad;
  }
  char path[4096];
  snprintf(path, sizeof path, "%s/builder_allreduce_simple_%dgpu.json", dir, l->nranks);
  if (mscclppExecutionPlanLoad(comm, path, name, sizeof name) != mscclppSuccess) {
    fprintf(stderr, "rank %d: loading %s: %s\n", l->rank, path, mscclppGetLastError());
    return bad + 1;
  }
  if (l->rank == 0) printf("rank 0: loaded plan %s from %s\n", name, path);
  bad += execute_named(l, comm, name, (size_t)1 << 20, 1, 0, 0, stream) != 0;
  return bad;
}

static int rank_gpu(Link* l, void* arg) {
  (void)arg;
  StackComm s = {0};
  int init = stack_init(l, &s);
  if (init != 0) return init < 0 ? RANK_SKIPS : 1;
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  /* From 1 element through odd sizes to 8 MiB; the threshold (1 MiB) splits them. */
  size_t counts[] = {1, 3, 1000, 4096, 65537, 262144, 262145, 1 << 21};
  int bad = 0;
  for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
    for (int in_place = 0; in_place < 2; in_place++) bad += one_all_reduce(l, counts[c], in_place, stream) != 0;
  }
  /* Repeated calls on fresh buffers (the user-buffer exchange each time). */
  for (int i = 0; i < 20; i++) bad += one_all_reduce(l, 8192 + (size_t)i, 0, stream) != 0;
  bad += graph_all_reduce(l, 65536, stream) != 0;
  bad += c_api_checks(l, s.ours, stream);
  /* What the collection offers, and a named algorithm with its geometry. */
  int n = 0;
  char name[MSCCLPP_MAX_NAME_BYTES];
  if (mscclppAlgorithmCount(s.ours, mscclppCollAllReduce, &n) != mscclppSuccess || n == 0) bad++;
  for (int i = 0; i < n && l->rank == 0; i++) {
    if (mscclppAlgorithmName(s.ours, mscclppCollAllReduce, i, name, sizeof name) == mscclppSuccess)
      printf("rank 0: all-reduce algorithm %d: %s\n", i, name);
  }
  printf("rank %d: %d all-reduces to mscclpp-rs, %d to the stack's ring, %d failed\n", l->rank, s.routed_ours,
         s.routed_ring, bad);
  if (s.routed_ours == 0 || s.routed_ring == 0) bad++;
  if (mscclppCommDestroy(s.ours) != mscclppSuccess) bad++;
  cudaStreamDestroy(stream);
  return bad ? 1 : 0;
}

/* Kill mode: a watcher aborts our communicator when the stack's bootstrap says a peer died. */
static void* watch_peers(void* arg) {
  StackComm* s = arg;
  char dead;
  struct pollfd pfd = {s->link->control, POLLIN, 0};
  while (poll(&pfd, 1, -1) < 0 && errno == EINTR) {
  }
  if (read(s->link->control, &dead, 1) == 1) {
    fprintf(stderr, "rank %d: the stack's bootstrap says rank %d died: mscclppCommAbort\n", s->link->rank, dead);
    mscclppCommAbort(s->ours);
  }
  return NULL;
}

static int rank_kill(Link* l, void* arg) {
  (void)arg;
  StackComm s = {0};
  int init = stack_init(l, &s);
  if (init != 0) return init < 0 ? RANK_SKIPS : 1;
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  size_t count = 1 << 16;
  float *dsend, *drecv;
  cudaMalloc((void**)&dsend, count * 4);
  cudaMalloc((void**)&drecv, count * 4);
  cudaMemset(dsend, 0, count * 4);
  pthread_t watcher;
  pthread_create(&watcher, NULL, watch_peers, &s);
  /* The first call outside the timed loop (kernel loads), then tell the launcher we loop. */
  if (ncclAllReduce(dsend, drecv, count, ncclFloat32, ncclSum, NULL, stream) != ncclSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess)
    return 1;
  Request q = {OP_READY, CHAN_STACK, 0, 0, 0};
  if (hub_call(l, q, NULL, NULL, 0) != 0) return 1;
  struct timespec start;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (long i = 0;; i++) {
    ncclResult_t rc = ncclAllReduce(dsend, drecv, count, ncclFloat32, ncclSum, NULL, stream);
    cudaError_t ce = cudaStreamSynchronize(stream);
    mscclppResult_t async = mscclppSuccess;
    mscclppCommGetAsyncError(s.ours, &async);
    double t = seconds_since(start);
    if (rc != ncclSuccess || ce != cudaSuccess || async != mscclppSuccess) {
      printf("rank %d: after %ld calls and %.1f s: call %d, stream %s, async error %d: %s\n", l->rank, i, t, rc,
             cudaGetErrorString(ce), async, mscclpp_ncclGetLastError(NULL));
      mscclppCommDestroy(s.ours); /* a no-op after the watcher's abort */
      _exit(0);                   /* the watcher may still be waiting; the verdict is made */
    }
    if (t > kill_deadline()) {
      fprintf(stderr, "rank %d: still no error %.0f s after the start of the loop\n", l->rank, t);
      _exit(1);
    }
  }
}
#endif

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "cpu";
  int nranks = argc > 2 ? atoi(argv[2]) : 2;
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (strcmp(mode, "cpu") == 0) {
    int bad = cpu_checks();
    printf("%s: %d failure(s)\n", bad ? "FAIL" : "PASS", bad);
    return bad ? 1 : 0;
  }
  if (nranks < 2 || nranks > MAX_RANKS) {
    fprintf(stderr, "NRANKS %d: 2..%d\n", nranks, MAX_RANKS);
    return 2;
  }
#ifdef STACK_CUDA
  int rc;
  if (strcmp(mode, "gpu") == 0) {
    rc = launch(nranks, rank_gpu, NULL, -1);
  } else if (strcmp(mode, "kill") == 0) {
    rc = launch(nranks, rank_kill, NULL, nranks - 1);
  } else {
    fprintf(stderr, "modes: cpu, gpu NRANKS, kill NRANKS\n");
    return 2;
  }
  if (rc < 0) {
    printf("skip: stack %s: no CUDA device in the ranks\n", mode);
    return 0;
  }
  printf("%s: stack %s with %d ranks\n", rc ? "FAIL" : "PASS", mode, nranks);
  return rc;
#else
  printf("skip: %s needs a build with -DSTACK_CUDA (the CUDA runtime)\n", mode);
  return 0;
#endif
}
