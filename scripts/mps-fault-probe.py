#!/usr/bin/env python3
"""What the driver does to the other processes on a GPU when one process is SIGKILLed while its
GPU work touches a given kind of memory (docs/fail-fast.md, "A dead peer's memory").

Each trial starts a victim process that keeps the GPU busy in one way (below), a bystander process
that launches small kernels on the same GPU and synchronises after each (in some modes reading the
victim's memory through CUDA IPC), SIGKILLs the victim while both run, and records whether the
bystander's context survived (the first CUresult it got, or "ok") and whether a new process can
still create a context right after. With --mps 1 both are clients of one MPS server (started and
quit around each trial), where a fatal fault of any client is delivered to every client of the GPU
and the server refuses new clients until all of them exited.

Victim modes (what the victim's GPU work is doing when it dies):
  device-spin      a kernel polls a word of its own device memory (cuMemAlloc)
  hostalloc-spin   a kernel polls a word of pinned host memory from cuMemHostAlloc (DEVICEMAP)
  register-spin    a kernel polls a word of mmap'ed host memory pinned by cuMemHostRegister
  hostalloc-copy   the host thread copies 64 MiB device -> cuMemHostAlloc memory in a loop
  register-copy    the same into cuMemHostRegister'ed memory
  pageable-copy    the same into pageable memory (the driver stages it through its own buffers)
Bystander modes (what the bystander reads while the victim dies):
  ipc-legacy       the victim's cuMemAlloc buffer, imported with cuIpcOpenMemHandle
  ipc-vmm          the victim's cuMemCreate buffer, its POSIX fd taken with pidfd_getfd and
                   imported with cuMemImportFromShareableHandle (needs ptrace rights on the victim)

Kernels are hand-written PTX (JIT-compiled by the driver), so the probe needs only libcuda and
Python. Usage (one GPU; NVLink multicast is never touched):
  python3 scripts/mps-fault-probe.py --mps 0,1 --trials 3 [--modes device-spin,register-spin]
Writes a markdown table to stdout and to OUT/mps-fault-probe.md when OUT is set.
"""
import argparse
import ctypes
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time

MODES = ("device-spin", "hostalloc-spin", "register-spin", "hostalloc-copy", "register-copy",
         "pageable-copy", "ipc-legacy", "ipc-vmm")

PTX = rb"""
.version 7.0
.target sm_70
.address_size 64

// Polls the u32 at `addr` until it is non-zero or `loops` polls passed.
.visible .entry spin(.param .u64 addr, .param .u64 loops)
{
  .reg .pred p;
  .reg .b32 v;
  .reg .b64 a, n, i;
  ld.param.u64 a, [addr];
  ld.param.u64 n, [loops];
  mov.u64 i, 0;
LOOP:
  ld.volatile.global.u32 v, [a];
  add.u64 i, i, 1;
  setp.ne.u32 p, v, 0;
  @p bra DONE;
  setp.lt.u64 p, i, n;
  @p bra LOOP;
DONE:
  ret;
}

// Sums `words` u32 from `addr` (one thread; enough to touch every page) into `out`.
.visible .entry sum(.param .u64 addr, .param .u64 words, .param .u64 out)
{
  .reg .pred p;
  .reg .b32 v, s;
  .reg .b64 a, n, i, o;
  ld.param.u64 a, [addr];
  ld.param.u64 n, [words];
  ld.param.u64 o, [out];
  mov.u64 i, 0;
  mov.u32 s, 0;
LOOP:
  ld.volatile.global.u32 v, [a];
  add.u32 s, s, v;
  add.u64 a, a, 4096;
  add.u64 i, i, 1024;
  setp.lt.u64 p, i, n;
  @p bra LOOP;
  st.global.u32 [o], s;
  ret;
}
"""

CU_MEMHOSTALLOC_PORTABLE = 1
CU_MEMHOSTALLOC_DEVICEMAP = 2
CU_MEMHOSTREGISTER_PORTABLE = 1
CU_MEMHOSTREGISTER_DEVICEMAP = 2
BIG = 64 << 20
SMALL = 2 << 20


class Cuda:
    """The few driver calls the probe needs; every failure raises CudaError with the CUresult."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check(self.lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.dev = dev.value
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.dev), "ctx retain")
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        mod = ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(PTX)), "module")
        self.fn = {}
        for name in (b"spin", b"sum"):
            f = ctypes.c_void_p()
            self.check(self.lib.cuModuleGetFunction(ctypes.byref(f), mod, name), "function")
            self.fn[name.decode()] = f

    @staticmethod
    def check(r, what):
        if r != 0:
            raise CudaError(r, what)

    def malloc(self, size):
        p = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size)), "cuMemAlloc")
        self.check(self.lib.cuMemsetD8_v2(p, 0, ctypes.c_size_t(size)), "cuMemset")
        return p.value

    def host_alloc(self, size):
        h = ctypes.c_void_p()
        flags = CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE
        self.check(self.lib.cuMemHostAlloc(ctypes.byref(h), ctypes.c_size_t(size), flags),
                   "cuMemHostAlloc")
        ctypes.memset(h, 0, size)
        return h.value, self.device_pointer(h.value)

    def host_register(self, size):
        m = mmap.mmap(-1, size)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        flags = CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE
        self.check(self.lib.cuMemHostRegister_v2(ctypes.c_void_p(addr), ctypes.c_size_t(size),
                                                 flags), "cuMemHostRegister")
        self._keep = m
        return addr, self.device_pointer(addr)

    def device_pointer(self, host):
        d = ctypes.c_uint64()
        self.check(self.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(d), ctypes.c_void_p(host), 0),
                   "cuMemHostGetDevicePointer")
        return d.value

    def launch(self, name, *args):
        vals = [ctypes.c_uint64(a) for a in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                                 for v in vals])
        self.check(self.lib.cuLaunchKernel(self.fn[name], 1, 1, 1, 1, 1, 1, 0, None, params, None),
                   "cuLaunchKernel")

    def sync(self):
        self.check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")


class IpcHandle(ctypes.Structure):
    """CUipcMemHandle, passed by value to cuIpcOpenMemHandle."""
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaError(Exception):
    def __init__(self, code, what):
        super().__init__(f"{what}: CUresult {code}")
        self.code = code


# --- VMM (ipc-vmm) -------------------------------------------------------------------------------

class AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("handle_types", ctypes.c_uint32),
                ("loc_type", ctypes.c_uint32), ("loc_id", ctypes.c_int32),
                ("win32", ctypes.c_void_p), ("flags", ctypes.c_uint8 * 8)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("loc_type", ctypes.c_uint32), ("loc_id", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


def vmm_prop(dev):
    # CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, on device `dev`.
    return AllocProp(type=1, handle_types=1, loc_type=1, loc_id=dev)


def vmm_map(cu, handle, size):
    ptr = ctypes.c_uint64()
    cu.check(cu.lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size),
                                        ctypes.c_size_t(0), ctypes.c_uint64(0),
                                        ctypes.c_uint64(0)), "cuMemAddressReserve")
    cu.check(cu.lib.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                             ctypes.c_uint64(0)), "cuMemMap")
    access = AccessDesc(loc_type=1, loc_id=cu.dev, flags=3)  # READWRITE
    cu.check(cu.lib.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(access),
                                   ctypes.c_size_t(1)), "cuMemSetAccess")
    return ptr.value


def vmm_export(cu, size):
    handle = ctypes.c_uint64()
    prop = vmm_prop(cu.dev)
    cu.check(cu.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                                ctypes.c_uint64(0)), "cuMemCreate")
    ptr = vmm_map(cu, handle, size)
    cu.check(cu.lib.cuMemsetD8_v2(ctypes.c_uint64(ptr), 1, ctypes.c_size_t(size)), "cuMemset")
    fd = ctypes.c_int()
    cu.check(cu.lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, 1, ctypes.c_uint64(0)),
             "cuMemExportToShareableHandle")
    return fd.value


def vmm_import(cu, pid, fd, size):
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    local = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
    if local < 0:
        raise OSError(ctypes.get_errno(), "pidfd_getfd (ptrace rights on the victim?)")
    handle = ctypes.c_uint64()
    cu.check(cu.lib.cuMemImportFromShareableHandle(ctypes.byref(handle),
                                                   ctypes.c_void_p(local), 1),
             "cuMemImportFromShareableHandle")
    return vmm_map(cu, handle, size)


# --- the two processes ---------------------------------------------------------------------------

def victim(mode):
    cu = Cuda()
    info = "-"
    if mode == "device-spin":
        cu.launch("spin", cu.malloc(4096), 1 << 62)
    elif mode == "hostalloc-spin":
        cu.launch("spin", cu.host_alloc(4096)[1], 1 << 62)
    elif mode == "register-spin":
        cu.launch("spin", cu.host_register(mmap.PAGESIZE)[1], 1 << 62)
    elif mode == "ipc-legacy":
        dptr = cu.malloc(SMALL)
        handle = IpcHandle()
        cu.check(cu.lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(dptr)),
                 "cuIpcGetMemHandle")
        info = bytes(handle).hex()
    elif mode == "ipc-vmm":
        info = f"{os.getpid()}:{vmm_export(cu, SMALL)}"
    print(f"ready {info}", flush=True)
    if mode.endswith("-copy"):
        src = cu.malloc(BIG)
        if mode == "hostalloc-copy":
            dst = cu.host_alloc(BIG)[0]
        elif mode == "register-copy":
            dst = cu.host_register(BIG)[0]
        else:
            keep = ctypes.create_string_buffer(BIG)
            dst = ctypes.addressof(keep)
        while True:
            cu.check(cu.lib.cuMemcpyDtoH_v2(ctypes.c_void_p(dst), ctypes.c_uint64(src),
                                            ctypes.c_size_t(BIG)), "cuMemcpyDtoH")
    time.sleep(3600)


def bystander(mode, info, seconds):
    """Launches a kernel and synchronises, over and over, for `seconds`; prints the outcome."""
    start = time.monotonic()
    launches = 0
    try:
        cu = Cuda()
        own = cu.malloc(4096)
        target, words = own, 1024
        if mode == "ipc-legacy":
            handle = IpcHandle.from_buffer_copy(bytes.fromhex(info))
            p = ctypes.c_uint64()
            cu.check(cu.lib.cuIpcOpenMemHandle_v2(ctypes.byref(p), handle, 1),
                     "cuIpcOpenMemHandle")
            target, words = p.value, SMALL // 4
        elif mode == "ipc-vmm":
            pid, fd = (int(x) for x in info.split(":"))
            target, words = vmm_import(cu, pid, fd, SMALL), SMALL // 4
        print("running", flush=True)
        while time.monotonic() - start < seconds:
            cu.launch("sum", target, words, own + 64)
            cu.sync()
            launches += 1
        print(f"ok ({launches} kernels)", flush=True)
    except (CudaError, OSError) as e:
        print(f"error after {time.monotonic() - start:.2f} s, {launches} kernels: {e}", flush=True)
        sys.exit(1)


def new_context_result(env):
    code = ("import ctypes; c = ctypes.CDLL('libcuda.so.1'); r = c.cuInit(0); d = ctypes.c_int(); "
            "r = r or c.cuDeviceGet(ctypes.byref(d), 0); x = ctypes.c_void_p(); "
            "r = r or c.cuDevicePrimaryCtxRetain(ctypes.byref(x), d); "
            "r = r or c.cuCtxSetCurrent(x); p = ctypes.c_uint64(); "
            "r = r or c.cuMemAlloc_v2(ctypes.byref(p), 4096); print(r)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=30)
    r = out.stdout.strip() or out.stderr.strip()[-80:]
    return "ok" if r == "0" else f"CUresult {r}"


def trial(mode, mps, workdir):
    env = dict(os.environ)
    if mps:
        env["CUDA_MPS_PIPE_DIRECTORY"] = os.path.join(workdir, "pipe")
        env["CUDA_MPS_LOG_DIRECTORY"] = os.path.join(workdir, "log")
        for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            os.makedirs(env[key], exist_ok=True)
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
    me = os.path.abspath(__file__)
    v = subprocess.Popen([sys.executable, me, "--victim", mode], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    b = None
    try:
        line = v.stdout.readline().strip()
        if not line.startswith("ready"):
            last = (line + "\n" + v.communicate(timeout=30)[0]).strip().splitlines()[-1]
            return f"victim failed: {last[-120:]}", "-"
        b = subprocess.Popen([sys.executable, me, "--bystander", mode, "--info", line.split()[1],
                              "--seconds", "4"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        first = b.stdout.readline().strip()
        if first != "running":
            last = (first + "\n" + b.communicate(timeout=30)[0]).strip().splitlines()[-1]
            return f"bystander failed at start: {last[-120:]}", "-"
        time.sleep(1.0)
        v.send_signal(signal.SIGKILL)
        v.wait()
        outcome = (b.communicate(timeout=30)[0].strip().splitlines() or ["(nothing)"])[-1]
        after = new_context_result(env)
        return outcome, after
    finally:
        for p in (v, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if mps:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=env,
                           check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and subprocess.run(
                    ["pgrep", "-f", "nvidia-cuda-mps-server"], capture_output=True).returncode == 0:
                time.sleep(0.2)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--mps", default="0,1", help="0, 1 or 0,1")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--victim", help=argparse.SUPPRESS)
    p.add_argument("--bystander", help=argparse.SUPPRESS)
    p.add_argument("--info", default="-", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=4.0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.victim:
        return victim(a.victim)
    if a.bystander:
        return bystander(a.bystander, a.info, a.seconds)
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    lines = ["| victim's work | MPS | trial | bystander | new context after |", "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory(prefix="mps-probe-") as workdir:
        for mps in [m == "1" for m in a.mps.split(",")]:
            for mode in modes:
                for k in range(a.trials):
                    try:
                        outcome, after = trial(mode, mps, workdir)
                    except subprocess.TimeoutExpired:
                        outcome, after = "bystander still running 30 s after the kill", "-"
                    row = f"| {mode} | {'yes' if mps else 'no'} | {k + 1} | {outcome} | {after} |"
                    lines.append(row)
                    print(row, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "mps-fault-probe.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
