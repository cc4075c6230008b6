/* A stand-in for ROCm's libamdhip64, for the backend's CPU tests: it exports the HIP entry points
 * the backend resolves (the ROCm 6 ABI, or with -DFAKE_HIP_OLD the ROCm 5 one, which lacks
 * hipGetDevicePropertiesR0600) and backs them with host memory. One device, gfx942, 64-lane
 * wavefronts.
 *
 * Test controls (per calling thread, so tests running in parallel do not disturb each other):
 *   fake_hip_fail(name, code)  the next calls of entry point `name` return `code` (NULL: none)
 *   fake_hip_ipc_opens/closes  how many hipIpcOpenMemHandle / hipIpcCloseMemHandle succeeded
 *   fake_hip_loaded_header(out) copies the first 64 bytes of the image hipModuleLoadData last
 *                              loaded (an ELF header: which code object it was), returns 0 if none
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int hipError_t;
enum { kSuccess = 0, kInvalidValue = 1, kOutOfMemory = 2, kInvalidDevice = 101 };

static _Thread_local const char *fail_name;
static _Thread_local hipError_t fail_code;
static _Thread_local int ipc_opens, ipc_closes;

void fake_hip_fail(const char *name, hipError_t code) {
  fail_name = name;
  fail_code = code;
}
int fake_hip_ipc_opens(void) { return ipc_opens; }
int fake_hip_ipc_closes(void) { return ipc_closes; }
static _Thread_local unsigned char loaded_header[64];
static _Thread_local int loaded_any;
int fake_hip_loaded_header(unsigned char *out) {
  memcpy(out, loaded_header, sizeof loaded_header);
  return loaded_any;
}

#define FAIL_IF_ASKED(name)                                   \
  do {                                                        \
    if (fail_name && strcmp(fail_name, name) == 0) return fail_code; \
  } while (0)

const char *hipGetErrorName(hipError_t e) {
  switch (e) {
    case kSuccess: return "hipSuccess";
    case kInvalidValue: return "hipErrorInvalidValue";
    case kOutOfMemory: return "hipErrorOutOfMemory";
    case kInvalidDevice: return "hipErrorInvalidDevice";
    default: return "hipErrorUnknown";
  }
}
const char *hipGetErrorString(hipError_t e) {
  return e == kSuccess ? "no error" : "fake HIP error";
}

hipError_t hipGetDeviceCount(int *n) {
  FAIL_IF_ASKED("hipGetDeviceCount");
  *n = 1;
  return kSuccess;
}
static _Thread_local int current;
hipError_t hipSetDevice(int d) {
  FAIL_IF_ASKED("hipSetDevice");
  if (d != 0) return kInvalidDevice;
  current = d;
  return kSuccess;
}
hipError_t hipGetDevice(int *d) {
  FAIL_IF_ASKED("hipGetDevice");
  *d = current;
  return kSuccess;
}

#ifndef FAKE_HIP_OLD
/* Offsets of hipDeviceProp_tR0600 on x86-64 (checked on the Rust side by sys::tests). */
hipError_t hipGetDevicePropertiesR0600(void *prop, int d) {
  FAIL_IF_ASKED("hipGetDevicePropertiesR0600");
  if (d != 0) return kInvalidDevice;
  char *p = (char *)prop;
  strcpy(p, "Fake AMD Instinct MI300X");
  uint64_t total = 192ull << 30;
  memcpy(p + 288, &total, 8);
  int warp = 64, major = 9, minor = 4, cus = 304;
  memcpy(p + 308, &warp, 4);
  memcpy(p + 360, &major, 4);
  memcpy(p + 364, &minor, 4);
  memcpy(p + 388, &cus, 4);
  strcpy(p + 1160, "gfx942:sramecc+:xnack-");
  return kSuccess;
}
#else
hipError_t hipGetDeviceProperties(void *prop, int d) { return kInvalidValue; }
#endif

hipError_t hipDeviceGetPCIBusId(char *bus, int len, int d) {
  FAIL_IF_ASKED("hipDeviceGetPCIBusId");
  if (len < 13) return kInvalidValue;
  strcpy(bus, "0000:0C:00.0");
  return kSuccess;
}

/* Allocations, so hipMemGetAddressRange can answer. */
#define MAX_ALLOCS 256
static struct { char *base; size_t size; } allocs[MAX_ALLOCS];

static hipError_t track(void *p, size_t size) {
  for (int i = 0; i < MAX_ALLOCS; ++i) {
    if (__sync_bool_compare_and_swap(&allocs[i].base, NULL, (char *)p)) {
      allocs[i].size = size;
      return kSuccess;
    }
  }
  return kOutOfMemory;
}
static int untrack(void *p) {
  for (int i = 0; i < MAX_ALLOCS; ++i) {
    if (allocs[i].base == p) {
      allocs[i].size = 0;
      __sync_synchronize();
      allocs[i].base = NULL;
      return 1;
    }
  }
  return 0;
}

hipError_t hipMalloc(void **p, size_t size) {
  FAIL_IF_ASKED("hipMalloc");
  if (size == 0) return kInvalidValue;
  *p = aligned_alloc(256, (size + 255) / 256 * 256);
  if (!*p) return kOutOfMemory;
  return track(*p, size);
}
hipError_t hipFree(void *p) {
  FAIL_IF_ASKED("hipFree");
  if (p && !untrack(p)) return kInvalidValue;
  free(p);
  return kSuccess;
}
hipError_t hipHostMalloc(void **p, size_t size, unsigned flags) {
  FAIL_IF_ASKED("hipHostMalloc");
  return hipMalloc(p, size);
}
hipError_t hipHostFree(void *p) {
  FAIL_IF_ASKED("hipHostFree");
  return hipFree(p);
}
hipError_t hipHostGetDevicePointer(void **dev, void *host, unsigned flags) {
  FAIL_IF_ASKED("hipHostGetDevicePointer");
  *dev = host;
  return kSuccess;
}
hipError_t hipMemGetAddressRange(void **base, size_t *size, void *p) {
  FAIL_IF_ASKED("hipMemGetAddressRange");
  for (int i = 0; i < MAX_ALLOCS; ++i) {
    char *b = allocs[i].base;
    if (b && (char *)p >= b && (char *)p < b + allocs[i].size) {
      *base = b;
      *size = allocs[i].size;
      return kSuccess;
    }
  }
  return kInvalidValue;
}
hipError_t hipMemcpy(void *dst, const void *src, size_t n, int kind) {
  FAIL_IF_ASKED("hipMemcpy");
  memmove(dst, src, n);
  return kSuccess;
}
hipError_t hipMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
  FAIL_IF_ASKED("hipMemcpyAsync");
  memmove(dst, src, n);
  return kSuccess;
}
hipError_t hipMemsetAsync(void *dst, int v, size_t n, void *stream) {
  FAIL_IF_ASKED("hipMemsetAsync");
  memset(dst, v, n);
  return kSuccess;
}

/* Streams and events are opaque non-null tokens; all work completes at once. */
static char token;
hipError_t hipStreamCreateWithFlags(void **s, unsigned flags) {
  FAIL_IF_ASKED("hipStreamCreateWithFlags");
  *s = &token;
  return kSuccess;
}
hipError_t hipStreamDestroy(void *s) { FAIL_IF_ASKED("hipStreamDestroy"); return kSuccess; }
hipError_t hipStreamQuery(void *s) { FAIL_IF_ASKED("hipStreamQuery"); return kSuccess; }
hipError_t hipStreamIsCapturing(void *s, int *status) {
  FAIL_IF_ASKED("hipStreamIsCapturing");
  *status = 0;
  return kSuccess;
}
hipError_t hipThreadExchangeStreamCaptureMode(int *mode) {
  FAIL_IF_ASKED("hipThreadExchangeStreamCaptureMode");
  *mode = 0;
  return kSuccess;
}
hipError_t hipDeviceSynchronize(void) { FAIL_IF_ASKED("hipDeviceSynchronize"); return kSuccess; }
hipError_t hipEventCreate(void **e) {
  FAIL_IF_ASKED("hipEventCreate");
  *e = &token;
  return kSuccess;
}
hipError_t hipEventDestroy(void *e) { FAIL_IF_ASKED("hipEventDestroy"); return kSuccess; }
hipError_t hipEventRecord(void *e, void *s) { FAIL_IF_ASKED("hipEventRecord"); return kSuccess; }
hipError_t hipStreamWaitEvent(void *s, void *e, unsigned flags) {
  FAIL_IF_ASKED("hipStreamWaitEvent");
  return kSuccess;
}
hipError_t hipEventQuery(void *e) { FAIL_IF_ASKED("hipEventQuery"); return kSuccess; }
hipError_t hipEventElapsedTime(float *ms, void *a, void *b) {
  FAIL_IF_ASKED("hipEventElapsedTime");
  *ms = 0.5f;
  return kSuccess;
}

/* IPC: the handle carries the base pointer (same process, so it maps to itself). */
typedef struct { unsigned char reserved[64]; } hipIpcMemHandle_t;
hipError_t hipIpcGetMemHandle(hipIpcMemHandle_t *h, void *p) {
  FAIL_IF_ASKED("hipIpcGetMemHandle");
  memset(h, 0, sizeof *h);
  memcpy(h->reserved, "FAKEHIP", 7);
  memcpy(h->reserved + 8, &p, sizeof p);
  return kSuccess;
}
hipError_t hipIpcOpenMemHandle(void **p, hipIpcMemHandle_t h, unsigned flags) {
  FAIL_IF_ASKED("hipIpcOpenMemHandle");
  if (memcmp(h.reserved, "FAKEHIP", 7) != 0) return kInvalidValue;
  memcpy(p, h.reserved + 8, sizeof *p);
  ++ipc_opens;
  return kSuccess;
}
hipError_t hipIpcCloseMemHandle(void *p) {
  FAIL_IF_ASKED("hipIpcCloseMemHandle");
  ++ipc_closes;
  return kSuccess;
}
hipError_t hipDeviceEnablePeerAccess(int peer, unsigned flags) {
  FAIL_IF_ASKED("hipDeviceEnablePeerAccess");
  return kSuccess;
}

/* Modules: any non-empty image loads; functions exist unless named "missing". */
hipError_t hipModuleLoadData(void **m, const void *image) {
  FAIL_IF_ASKED("hipModuleLoadData");
  memcpy(loaded_header, image, sizeof loaded_header);
  loaded_any = 1;
  *m = &token;
  return kSuccess;
}
hipError_t hipModuleGetFunction(void **f, void *m, const char *name) {
  FAIL_IF_ASKED("hipModuleGetFunction");
  if (strcmp(name, "missing") == 0) return 500; /* hipErrorNotFound */
  *f = &token;
  return kSuccess;
}
hipError_t hipModuleLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                 unsigned by, unsigned bz, unsigned shmem, void *stream,
                                 void **params, void **extra) {
  FAIL_IF_ASKED("hipModuleLaunchKernel");
  return kSuccess;
}
