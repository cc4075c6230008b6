#!/usr/bin/env python3
"""Splits an eager PyTorch all_reduce's time into PyTorch's own host work and the NCCL library's.

  torchrun --nproc_per_node=N host_cost.py [--sizes 1K,1M] [--calls 1000] [--batches 5]

Run it twice: with the shim preloaded (LD_PRELOAD=libmscclpp_nccl.so) and without (PyTorch's own
NCCL, one GPU a rank: NCCL refuses ranks sharing a GPU; with the shim they may, rank r on GPU
LOCAL_RANK % GPUs, as `NRANKS=n MPS=1 bash .gpu/gpu-run.sh nccl hostcost` runs it). Small eager collectives are bound by the host: each call's CPU work outlasts its kernel, so
torch_bench.py's eager time per call is PyTorch's work plus the library's. This tool times, in one
process and on the same stream:
  library  ncclAllReduce called directly through ctypes on a communicator of its own (the library
           that serves the process: the preloaded shim, else the libnccl PyTorch mapped);
  torch    dist.all_reduce on PyTorch's "nccl" process group (PyTorch's work + that library's).
Per size, `--calls` back-to-back bf16 sum calls a batch after a warm-up, median of `--batches`:
"host" is the CPU time to issue them (perf_counter before the first and after the last, no sync),
"wall" also waits for the GPU to finish. torch host - library host is PyTorch's own cost per call,
which no library can remove: eager targets below it cannot be met under that PyTorch build.
Rank 0 prints a Markdown table.
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

from torch_bench import parse_size  # beside this file (nccl/scripts, .gpu)

# NCCL ABI constants (nccl.h): ncclBfloat16 and ncclSum.
NCCL_BFLOAT16 = 9
NCCL_SUM = 0


class UniqueId(ctypes.Structure):
    """ncclUniqueId: 128 opaque bytes, passed by value to ncclCommInitRank."""
    _fields_ = [("internal", ctypes.c_ubyte * 128)]


def serving_library():
    """(label, path) of the library that serves this process's NCCL calls."""
    try:
        ctypes.CDLL(None).mscclppGetVersion
        preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if "mscclpp" in p]
        if preload:
            return "mscclpp shim", preload[0]
    except AttributeError:
        pass
    with open("/proc/self/maps") as f:
        mapped = sorted({line.split()[-1] for line in f if "libnccl.so" in line.split()[-1]})
    if not mapped:
        raise SystemExit("no libnccl mapped in this process and no shim preloaded")
    return "NCCL", mapped[0]


def check(rc, what):
    if rc != 0:
        raise SystemExit(f"{what} returned {rc}")


def timed(torch, barrier, issue, calls, batches, warmup):
    """Median (host, wall) microseconds per call over `batches` batches of `calls` calls."""
    for _ in range(warmup):
        issue()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(batches):
        barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            issue()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6 / calls)
        wall.append((t2 - t0) * 1e6 / calls)
    return statistics.median(host), statistics.median(wall)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1K,64K,1M", help="bytes per call, comma-separated (K, M, G)")
    p.add_argument("--calls", type=int, default=1000, help="calls per timed batch")
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--warmup", type=int, default=100)
    a = p.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]

    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    cpu = dist.new_group(backend="gloo")
    label, path = serving_library()
    lib = ctypes.CDLL(path)

    # A communicator of the library's own, its id shared over gloo.
    uid = UniqueId()
    if rank == 0:
        check(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    box = [bytes(uid) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=cpu)
    uid = UniqueId.from_buffer_copy(box[0])
    comm = ctypes.c_void_p()
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
    check(lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")
    lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]

    barrier = lambda: dist.barrier(group=cpu)
    rows = []
    for size in sizes:
        x = torch.zeros(size // 2, dtype=torch.bfloat16, device=dev)
        stream = torch.cuda.current_stream().cuda_stream
        ptr, count = x.data_ptr(), x.numel()

        def direct():
            check(lib.ncclAllReduce(ptr, ptr, count, NCCL_BFLOAT16, NCCL_SUM, comm, stream), "ncclAllReduce")

        lib_host, lib_wall = timed(torch, barrier, direct, a.calls, a.batches, a.warmup)
        torch_host, torch_wall = timed(torch, barrier, lambda: dist.all_reduce(x), a.calls, a.batches, a.warmup)
        rows.append((size, lib_host, lib_wall, torch_host, torch_wall))

    every = [None] * world
    dist.all_gather_object(every, rows, group=cpu)
    if rank == 0:
        props = torch.cuda.get_device_properties(dev)
        print(f"# {label} ({path}); {world} ranks, {props.name}; torch {torch.__version__}; "
              f"{a.calls} calls a batch, median of {a.batches}, mean over ranks, bf16 sum in place")
        print("| size | library host µs | library wall µs | torch host µs | torch wall µs | torch's own host µs |")
        print("|---|---|---|---|---|---|")
        for i, size in enumerate(sizes):
            mean = [statistics.fmean(r[i][k] for r in every) for k in range(1, 5)]
            print(f"| {size} | {mean[0]:.2f} | {mean[1]:.2f} | {mean[2]:.2f} | {mean[3]:.2f} | "
                  f"{mean[2] - mean[0]:.2f} |")
    barrier()
    lib.ncclCommDestroy(comm)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
