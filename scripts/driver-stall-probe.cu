// Which CUDA calls of one thread stall while another thread of the same process waits in a
// pageable device-to-host copy queued behind a kernel? The proxy and the Ethernet receiver make
// such calls while a send/recv group's kernel waits for them, and a user's `tensor.cpu()` of the
// group's result is such a copy (docs/pending-gpu-checks.md, the host-read row).
//
// Each case: thread A launches a kernel that spins until a device flag is set (or about 2 s
// pass), then copies 4 bytes of its result into pageable memory on the same stream. Thread B,
// 0.3 s later, makes the case's calls on a non-blocking stream of its own, then sets the flag
// with a pinned host-to-device copy. "in time" means B's calls went through while A waited;
// "STALLED" that they waited for the kernel's limit. The last case repeats the first with A's
// copy into pinned memory, as the control. The `ipc` cases copy to or write into memory that a
// child process exported (cudaIpcGetMemHandle), as the proxy does towards a peer on its host.
// The creation cases (a stream, an event, pinned or registered host memory, device memory, a
// peer's mapping) are what a transport thread would make if it set up a resource on first use.
// They leak their resource: a free may synchronise the device, which is not what they ask.
//
// The `queues` mode asks what a transport thread can do while a kernel waits on a hardware queue
// its copies would share: CUDA spreads a context's streams over CUDA_DEVICE_MAX_CONNECTIONS
// queues in creation order, and work queued behind a waiting kernel on the same queue waits for
// it (the Ethernet receiver's stall, docs/troubleshooting.md). It first finds which of the 2N
// streams made after A's share A's queue (B's flag copy on each), then tries ways to set the
// flag that no queue can hold up: a stream of a second context on the same device, into
// device memory of the VMM (reachable from every context) and into cudaMalloc memory; and a CPU
// store into a mapped pinned word that the kernel polls (no CUDA call at all). Run it with the
// variable at 8 (CUDA's default) and again under MPS.
//
// On a GPU machine: nvcc -O2 -o /tmp/stall-probe scripts/driver-stall-probe.cu -lcuda
//                   /tmp/stall-probe
//                   CUDA_DEVICE_MAX_CONNECTIONS=8 /tmp/stall-probe queues
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                               \
    }                                                                             \
  } while (0)

__global__ void spin(volatile int* flag, long long limit, int* out) {
  long long t0 = clock64();
  while (*flag == 0 && clock64() - t0 < limit) {
  }
  *out = *flag;
}

__global__ void store_one(int* where) { *where = 1; }

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Probe {
  int* flag;        // what the spinning kernel polls
  int* out;         // what A copies to the host
  int* dsrc;        // a device word holding 1
  int* one;         // a pinned host word holding 1
  int* pinned_in;   // pinned, for B's device-to-host copy
  char* dbig;       // 16 MiB of device memory
  int* ipc;         // the child's exported memory, mapped here
  cudaStream_t a, b;
  cudaEvent_t event;
  cudaIpcMemHandle_t late_handle;  // the child's second export, opened by the ipc-open case
};

// B's calls for `name` (before the flag is set by a pinned copy).
static void calls(const Probe& p, const std::string& name) {
  if (name == "h2d") {
    // nothing more: the flag's pinned host-to-device copy alone
  } else if (name == "d2h") {
    CHECK(cudaMemcpyAsync(p.pinned_in, p.dsrc, 4, cudaMemcpyDeviceToHost, p.b));
    CHECK(cudaStreamSynchronize(p.b));
  } else if (name == "d2h-4MiB") {
    CHECK(cudaMemcpyAsync(p.pinned_in, p.dbig, 4 << 20, cudaMemcpyDeviceToHost, p.b));
    CHECK(cudaStreamSynchronize(p.b));
  } else if (name == "d2d") {
    CHECK(cudaMemcpyAsync(p.dbig, p.dbig + (8 << 20), 4 << 20, cudaMemcpyDeviceToDevice, p.b));
    CHECK(cudaStreamSynchronize(p.b));
  } else if (name == "ipc-d2d") {
    CHECK(cudaMemcpyAsync(p.ipc, p.dsrc, 4, cudaMemcpyDeviceToDevice, p.b));
    CHECK(cudaStreamSynchronize(p.b));
  } else if (name == "ipc-d2d-4MiB") {
    CHECK(cudaMemcpyAsync(p.ipc, p.dbig, 4 << 20, cudaMemcpyDeviceToDevice, p.b));
    CHECK(cudaStreamSynchronize(p.b));
  } else if (name == "ipc-write-value") {
    CUresult r = cuStreamWriteValue32(reinterpret_cast<CUstream>(p.b),
                                      reinterpret_cast<CUdeviceptr>(p.ipc), 1, 0);
    if (r != CUDA_SUCCESS) std::printf("cuStreamWriteValue32: error %d\n", static_cast<int>(r));
    CHECK(cudaStreamSynchronize(p.b));
  } else if (name == "write-value") {
    CUresult r = cuStreamWriteValue32(reinterpret_cast<CUstream>(p.b),
                                      reinterpret_cast<CUdeviceptr>(p.dsrc), 1, 0);
    if (r != CUDA_SUCCESS) std::printf("cuStreamWriteValue32: error %d\n", static_cast<int>(r));
    CHECK(cudaStreamSynchronize(p.b));
  } else if (name == "event") {
    CHECK(cudaEventRecord(p.event, p.b));
    while (cudaEventQuery(p.event) == cudaErrorNotReady) {
    }
  } else if (name == "memset") {
    CHECK(cudaMemsetAsync(p.dbig, 0, 4 << 20, p.b));
    CHECK(cudaStreamSynchronize(p.b));
  } else if (name == "stream-create") {
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  } else if (name == "event-create") {
    cudaEvent_t e;
    CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  } else if (name == "host-alloc") {
    void* h;
    CHECK(cudaHostAlloc(&h, 1 << 20, cudaHostAllocMapped | cudaHostAllocPortable));
  } else if (name == "host-register") {
    // What our alloc_host_mapped does: pages of our own, registered with the driver.
    void* h = mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (h == MAP_FAILED) std::exit(2);
    CHECK(cudaHostRegister(h, 1 << 20, cudaHostRegisterMapped | cudaHostRegisterPortable));
  } else if (name == "malloc") {
    void* d;
    CHECK(cudaMalloc(&d, 1 << 20));
  } else if (name == "ipc-open") {
    void* d;
    CHECK(cudaIpcOpenMemHandle(&d, p.late_handle, cudaIpcMemLazyEnablePeerAccess));
  } else if (name == "launch") {
    store_one<<<1, 1, 0, p.b>>>(reinterpret_cast<int*>(p.dbig));
    CHECK(cudaStreamSynchronize(p.b));
  } else {
    std::printf("unknown case %s\n", name.c_str());
    std::exit(2);
  }
}

// A's kernel on stream `a` spins on `flag` (or for about 2 s), then A copies its result into
// `result` (`how`: pageable or pinned); 0.3 s in, thread B runs `set`, which sets the flag its
// own way. Prints whether A got the flag back in time, or only after the kernel's limit.
template <class Set>
static bool race(const std::string& name, cudaStream_t a, int* flag, int* out, int* result,
                 const char* how, Set set) {
  *result = -1;
  double start = now();
  spin<<<1, 1, 0, a>>>(flag, 4000000000LL, out);
  double b_took = 0;
  std::thread b([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    double s = now();
    set();
    b_took = now() - s;
  });
  CHECK(cudaMemcpyAsync(result, out, 4, cudaMemcpyDeviceToHost, a));
  CHECK(cudaStreamSynchronize(a));
  double a_took = now() - start;
  b.join();
  bool in_time = *result == 1;
  std::printf("%-32s A's %s copy back after %.3f s, B's calls took %.3f s: %s\n", name.c_str(),
              how, a_took, b_took, in_time ? "in time" : "STALLED");
  std::fflush(stdout);
  return in_time;
}

static void run(const Probe& p, const std::string& name, bool pageable) {
  CHECK(cudaMemset(p.flag, 0, 4));
  CHECK(cudaDeviceSynchronize());
  std::vector<int> host_page(1, -1);
  int* host = pageable ? host_page.data() : p.pinned_in;
  race(name, p.a, p.flag, p.out, host, pageable ? "pageable" : "pinned", [&] {
    calls(p, name);
    CHECK(cudaMemcpyAsync(p.flag, p.one, 4, cudaMemcpyHostToDevice, p.b));
    CHECK(cudaStreamSynchronize(p.b));
  });
}

#define CU_CHECK(x)                                                       \
  do {                                                                    \
    CUresult r_ = (x);                                                    \
    if (r_ != CUDA_SUCCESS) {                                             \
      const char* s_ = nullptr;                                           \
      cuGetErrorString(r_, &s_);                                          \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_ ? s_ : "?"); \
      std::exit(2);                                                       \
    }                                                                     \
  } while (0)

// One int of device memory through the VMM (as our CUDA backend allocates), readable and
// writable by device 0 from any context of this process.
static int* vmm_word() {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t granularity = 0;
  CU_CHECK(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemGenericAllocationHandle handle;
  CU_CHECK(cuMemCreate(&handle, granularity, &prop, 0));
  CUdeviceptr at = 0;
  CU_CHECK(cuMemAddressReserve(&at, granularity, 0, 0, 0));
  CU_CHECK(cuMemMap(at, granularity, 0, handle, 0));
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_CHECK(cuMemSetAccess(at, granularity, &access, 1));
  return reinterpret_cast<int*>(at);
}

static int queue_cases() {
  const char* set = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  int queues = set ? std::atoi(set) : 8;
  std::printf("CUDA_DEVICE_MAX_CONNECTIONS %s (%d queues)\n", set ? set : "unset", queues);
  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(nullptr));
  int *flag, *out, *one, *result, *mapped_flag, *mapped_flag_dev;
  CHECK(cudaMalloc(&flag, 4));
  CHECK(cudaMalloc(&out, 4));
  // Portable: pinned for the second context's copies too.
  CHECK(cudaHostAlloc(&one, 4, cudaHostAllocPortable));
  CHECK(cudaHostAlloc(&result, 4, cudaHostAllocPortable));
  CHECK(cudaHostAlloc(&mapped_flag, 4, cudaHostAllocMapped | cudaHostAllocPortable));
  CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_flag_dev), mapped_flag, 0));
  *one = 1;
  int* vmm_flag = vmm_word();
  cudaStream_t a;
  CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  std::vector<cudaStream_t> after(2 * queues);
  for (auto& s : after) CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  auto reset = [&](int* device_flag) {
    CHECK(cudaMemset(device_flag, 0, 4));
    CHECK(cudaDeviceSynchronize());
  };
  int shared = -1;
  for (int i = 0; i < static_cast<int>(after.size()); i++) {
    reset(flag);
    bool in_time = race("h2d on stream " + std::to_string(i + 1) + " after A's", a, flag, out,
                        result, "pinned", [&] {
                          CHECK(cudaMemcpyAsync(flag, one, 4, cudaMemcpyHostToDevice, after[i]));
                          CHECK(cudaStreamSynchronize(after[i]));
                        });
    if (!in_time && shared < 0) shared = i;
  }
  std::printf("first stream sharing A's queue: %s\n",
              shared < 0 ? "none" : std::to_string(shared + 1).c_str());

  // A second context on the same device: its streams are queues of its own.
  CUdevice dev;
  CU_CHECK(cuDeviceGet(&dev, 0));
  CUcontext primary, second = nullptr;
  CU_CHECK(cuCtxGetCurrent(&primary));
#if CUDA_VERSION >= 13000
  CUresult made = cuCtxCreate(&second, nullptr, 0, dev);
#else
  CUresult made = cuCtxCreate(&second, 0, dev);
#endif
  CUstream second_stream = nullptr;
  if (made == CUDA_SUCCESS) made = cuStreamCreate(&second_stream, CU_STREAM_NON_BLOCKING);
  CU_CHECK(cuCtxSetCurrent(primary));
  if (made != CUDA_SUCCESS) {
    const char* text = nullptr;
    cuGetErrorString(made, &text);
    std::printf("second context: %s (its cases skipped)\n", text ? text : "?");
  }
  for (int* target : {vmm_flag, flag}) {
    if (made != CUDA_SUCCESS) break;
    reset(target);
    const char* what = target == vmm_flag ? "vmm" : "cudaMalloc";
    race(std::string("second context h2d, ") + what, a, target, out, result, "pinned", [&] {
      CU_CHECK(cuCtxSetCurrent(second));
      CUresult r = cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(target), one, 4, second_stream);
      if (r == CUDA_SUCCESS) r = cuStreamSynchronize(second_stream);
      if (r != CUDA_SUCCESS) {
        const char* text = nullptr;
        cuGetErrorString(r, &text);
        std::printf("  second context copy into %s memory: %s\n", what, text ? text : "?");
        // The kernel still waits: let it go, from the primary context.
        CU_CHECK(cuCtxSetCurrent(primary));
        CHECK(cudaMemcpy(target, one, 4, cudaMemcpyHostToDevice));
      }
    });
  }
  CU_CHECK(cuCtxSetCurrent(primary));
  // No CUDA call: a store into mapped pinned memory the kernel polls.
  *mapped_flag = 0;
  race("cpu store into mapped pinned", a, mapped_flag_dev, out, result, "pinned", [&] {
    *reinterpret_cast<volatile int*>(mapped_flag) = 1;
  });
  // The control last: the flag's copy on the shared stream again.
  if (shared >= 0) {
    reset(flag);
    race("h2d on the shared stream again", a, flag, out, result, "pinned", [&] {
      CHECK(cudaMemcpyAsync(flag, one, 4, cudaMemcpyHostToDevice, after[shared]));
      CHECK(cudaStreamSynchronize(after[shared]));
    });
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "queues") return queue_cases();
  // The child exports 4 MiB of device memory through a pipe before the parent touches CUDA
  // (a process must not fork after CUDA is initialised).
  int handle_pipe[2], done_pipe[2];
  if (pipe(handle_pipe) != 0 || pipe(done_pipe) != 0) return 2;
  pid_t child = fork();
  if (child == 0) {
    close(handle_pipe[0]);
    close(done_pipe[1]);
    void* mem[2];
    cudaIpcMemHandle_t h[2];
    CHECK(cudaSetDevice(0));
    for (int i = 0; i < 2; i++) {
      CHECK(cudaMalloc(&mem[i], 4 << 20));
      CHECK(cudaIpcGetMemHandle(&h[i], mem[i]));
    }
    if (write(handle_pipe[1], h, sizeof h) != static_cast<ssize_t>(sizeof h)) return 2;
    char c;
    if (read(done_pipe[0], &c, 1) != 1) return 2;
    return 0;
  }
  // Without the child's ends open here, a child that fails ends the reads with an error.
  close(handle_pipe[1]);
  close(done_pipe[0]);
  cudaIpcMemHandle_t h[2];
  if (read(handle_pipe[0], h, sizeof h) != static_cast<ssize_t>(sizeof h)) return 2;
  Probe p{};
  p.late_handle = h[1];
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&p.flag, 4));
  CHECK(cudaMalloc(&p.out, 4));
  CHECK(cudaMalloc(&p.dsrc, 4));
  CHECK(cudaMalloc(&p.dbig, 16 << 20));
  CHECK(cudaHostAlloc(&p.one, 4, cudaHostAllocDefault));
  CHECK(cudaHostAlloc(&p.pinned_in, 4 << 20, cudaHostAllocDefault));
  *p.one = 1;
  CHECK(cudaMemcpy(p.dsrc, p.one, 4, cudaMemcpyHostToDevice));
  void* ipc;
  CHECK(cudaIpcOpenMemHandle(&ipc, h[0], cudaIpcMemLazyEnablePeerAccess));
  p.ipc = static_cast<int*>(ipc);
  CHECK(cudaStreamCreateWithFlags(&p.a, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&p.b, cudaStreamNonBlocking));
  CHECK(cudaEventCreateWithFlags(&p.event, cudaEventDisableTiming));
  for (const char* name : {"h2d", "d2h", "d2h-4MiB", "d2d", "ipc-d2d", "ipc-d2d-4MiB",
                           "ipc-write-value", "write-value", "event", "memset", "stream-create",
                           "event-create", "host-alloc", "host-register", "malloc", "ipc-open",
                           "launch"}) {
    run(p, name, true);
  }
  run(p, "h2d", false);
  CHECK(cudaIpcCloseMemHandle(ipc));
  if (write(done_pipe[1], "x", 1) != 1) return 2;
  waitpid(child, nullptr, 0);
  return 0;
}
