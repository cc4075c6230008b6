#!/usr/bin/env python3
"""GPU checks of libmscclpp_nccl.so under PyTorch and from C (through ctypes).

Modes (run through `.gpu/gpu-run.sh nccl MODE`, which preloads the shim and sets the launcher):
  torch     under torchrun: every torch.distributed operation of backend="nccl", each result
            checked element by element against a CPU reference computed from every rank's inputs
            (integers exact, floats against float64 with a per-type tolerance);
  initall   one process, NRANKS ranks through ncclCommInitAll (ranks may share one GPU):
            all-reduce and all-gather in one group, then ncclReduce, ncclGather, ncclScatter at
            every root and ncclAlltoAll (gather, scatter and all-to-all also in place), each a
            group over every communicator; each rank on one of
            PyTorch's streams, or with INITALL_STREAMS=raw on one created through the driver;
            INITALL_COUNT sets the first group's element count (100003); INITALL_FIRST picks
            what that group holds: both (all-reduce then all-gather, the default), allreduce,
            allgather (of the unreduced inputs), or apart (the two in separate groups, synced
            between), to tell one kernel's fault from the two's interplay;
  inplace   under torchrun, NRANKS processes (ranks may share a GPU under MPS): nccl-tests'
            in-place calls through the C interface (ncclScatter, ncclGather, ncclAlltoAll, also
            with rank 0 alone in place, ncclAllGather, ncclReduceScatter), each after the same call
            out of place in the same buffers, 128 B to 64 MiB (INPLACE_MAX_BYTES; gather and
            scatter to 4 MiB, INPLACE_ROOTED_MAX_BYTES);
  kill      under torchrun, 2 ranks: rank 1 exits without teardown while rank 0 is in an
            all-reduce; rank 0 must see ncclCommGetAsyncError report an error, not hang;
  abort     under torchrun, 2 ranks: rank 0 is blocked in an all-reduce rank 1 never joins, and
            another thread calls ncclCommAbort; it must return within 1 s and the stream drain;
  watchdog  PyTorch's own watchdog aborting the shim's communicator (the shim preloaded, 2 ranks
            started here with torchrun's environment, so each rank's own exit status is seen):
            after a warm-up all_reduce rank 1 stops taking part (sleeps, or SIGSTOPs itself)
            while rank 0 calls all_reduce again (its kernel waits for rank 1 until
            MSCCLPP_DEVICE_WAIT_TIMEOUT, 5 s here) and then all_reduce on a new 64 MiB tensor
            (whose registration waits for rank 1 on the host), with init_process_group's timeout
            10 s and TORCH_NCCL_ASYNC_ERROR_HANDLING set; PyTorch's watchdog then calls
            ncclCommGetAsyncError and ncclCommAbort from its own thread while rank 0's main thread
            may still be inside the shim. Rank 0 must end with a Python exception (an exit code
            1-127), never by a signal: SIGSEGV is the failure this mode looks for. With
            TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (TearDown) PyTorch itself ends the process with
            std::abort once it aborted the communicators, so SIGABRT is accepted there and only
            there. After an error PyTorch itself sleeps before the process can end: its
            watchdog TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (60 s by default) before handling the
            failure, and with the dump on (its default) its heartbeat monitor
            TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (480 s), which the interpreter's exit joins. This mode
            sets them to 10 s and 30 s unless they are set, so each case ends in about 45 s.
            WATCHDOG_CASES picks the runs (handling:peer, comma separated; default
            2:sleep,2:stop,1:sleep; peer sleep or stop); WATCHDOG_LIMIT (seconds, default 105)
            is how long rank 0 may take to end;
SHIM_CHECK_QUICK=1 makes the all_reduce matrix's largest size 65541 elements instead of 1 Mi + 5
and the other operations' 65537 instead of 1 Mi (the CPU references dominate the run time when
ranks share a GPU): with it, 4 ranks sharing one GPU (NRANKS=4 MPS=1) finish in a few minutes.
Rooted operations (broadcast, reduce, gather, scatter) run at every root; data movement
(all-to-all, gather, scatter) is checked bit-exact, off-root reduce buffers must stay unchanged.
Prints one line per check (PASS / FAIL / UNSUPPORTED with the reason) and a summary; exits 1 on
any FAIL. UNSUPPORTED means the shim refused the call with an error that says why (for example
point-to-point without a native path and without a usable NCCL fallback), or, for a combination
NCCL itself lacks (fp8 avg at world size 1), that the real NCCL behind the fallback refused it as
an invalid argument; never a wrong result;
SKIPPED means torch itself refused the combination (say AVG of booleans) before calling NCCL.
"""
import ctypes
import os
import re
import sys
import threading
import time

import torch

RESULTS = {"PASS": 0, "FAIL": 0, "UNSUPPORTED": 0, "SKIPPED": 0}


def report(status, name, detail=""):
    RESULTS[status] += 1
    rank = os.environ.get("RANK", "0")
    print(f"[rank {rank}] {status:11s} {name} {detail}", flush=True)


def shim():
    path = os.environ.get("NCCL_SHIM_LIB", ".gpu/lib/libmscclpp_nccl.so")
    lib = ctypes.CDLL(path)
    lib.ncclGetLastError.restype = ctypes.c_char_p
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    return lib


def last_error(lib):
    return lib.ncclGetLastError(None).decode(errors="replace")


# ---------------------------------------------------------------- references

def tolerance(dtype, nranks):
    return {
        torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3 * nranks,
        torch.bfloat16: 1.6e-2 * nranks,
    }.get(dtype, 0.13 * nranks)  # fp8: a few steps of the 3-bit (e4m3) mantissa


def is_float(dtype):
    return dtype.is_floating_point


def make_input(dtype, count, rank, seed, op=None):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    if is_float(dtype):
        if op == "prod":
            x = 0.75 + 0.5 * torch.rand(count, generator=g, dtype=torch.float64)
        else:
            x = torch.rand(count, generator=g, dtype=torch.float64) * 2 - 1
        return x.to(dtype)
    lo, hi = (-2, 3) if op == "prod" else (-20, 21)
    if dtype == torch.uint8:
        lo, hi = (0, 3) if op == "prod" else (0, 40)
    return torch.randint(lo, hi, (count,), generator=g).to(dtype)


def reduce_ref(inputs, op, dtype):
    n = len(inputs)
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        return stack.any(0) if op in ("sum", "max") else stack.all(0)
    wide = torch.float64 if is_float(dtype) else torch.int64
    stack = torch.stack([x.to(wide) for x in inputs])
    if op == "sum":
        r = stack.sum(0)
    elif op == "prod":
        r = stack.prod(0)
    elif op == "max":
        r = stack.max(0).values
    elif op == "min":
        r = stack.min(0).values
    elif is_float(dtype):  # avg
        r = stack.sum(0) / n
    else:
        # NCCL's integer average: the sum in the type itself (wrapping, as every rank's partial
        # sums do), then divided by the ranks, truncating (8-bit sums wrap from 8 ranks on).
        r = torch.div(stack.sum(0).to(dtype).to(wide), n, rounding_mode="trunc")
    return r


def compare(got, want, dtype, nranks):
    got = got.cpu()
    if dtype == torch.bool or not is_float(dtype):
        bad = (got.to(torch.int64) != want.to(dtype).to(torch.int64)).sum().item()
        return bad, "exact"
    g, w = got.to(torch.float64), want.to(torch.float64)
    tol = tolerance(dtype, nranks) * max(1.0, w.abs().max().item())
    bad = ((g - w).abs() > tol).sum().item() + torch.isnan(g).sum().item()
    return bad, f"tol {tol:.3g}"


def check(name, got, want, dtype, nranks):
    bad, how = compare(got, want, dtype, nranks)
    report("PASS" if bad == 0 else "FAIL", name, f"({got.numel()} elements, {how}, {bad} wrong)")


def check_exact(name, got, want):
    """Data that is moved, not combined: every element bit for bit (NaN payloads included)."""
    g, w = got.cpu().contiguous(), want.cpu().contiguous()
    if g.shape != w.shape:
        report("FAIL", name, f"(shape {tuple(g.shape)}, expected {tuple(w.shape)})")
        return
    bad = (g.view(torch.uint8).reshape(g.numel(), -1) != w.view(torch.uint8).reshape(w.numel(), -1)).any(1)
    report("PASS" if not bad.any() else "FAIL", name,
           f"({g.numel()} elements, exact, {bad.sum().item()} wrong)")


# The shim's text when the real NCCL it forwarded a call to (fallback) refused it as an invalid
# argument (nccl/src/fallback.rs names the result code).
REAL_NCCL_REFUSED = re.compile(r"in the real NCCL \(.*\) failed with ncclInvalidArgument")


def real_nccl_lacks(opname, dtype):
    """A combination NCCL 2.28 itself refuses on some paths: its one-rank path (world size 1, as in
    `gpu-run.sh nccl fallback`) has no fp8 kernel for avg and returns ncclInvalidArgument."""
    return opname == "avg" and str(dtype) in ("torch.float8_e4m3fn", "torch.float8_e5m2")


def guarded(name, fn, real_nccl_may_refuse=False):
    """Runs one check; an exception is SKIPPED (torch refused), UNSUPPORTED (the shim refused,
    saying why; or, where `real_nccl_may_refuse`, the real NCCL refused the call as an invalid
    argument) or FAIL."""
    try:
        fn()
    except Exception as e:
        text = str(e)
        if "nccl" not in text.lower():
            status = "SKIPPED"  # torch refused the combination before reaching NCCL
        elif "no fallback" in text or "no native" in text:
            status = "UNSUPPORTED"  # the shim refused, saying why
        elif real_nccl_may_refuse and REAL_NCCL_REFUSED.search(text):
            status = "UNSUPPORTED"  # NCCL itself lacks it; the shim passed its answer on
        else:
            status = "FAIL"
        report(status, name, text.splitlines()[-1][:300] if text else repr(e))


# ---------------------------------------------------------------- torch mode

def torch_mode():
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    print(f"[rank {rank}] torch {torch.__version__}, NCCL version seen {torch.cuda.nccl.version()}",
          flush=True)
    ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
              torch.uint8, torch.int32, torch.int64, torch.bool]
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            dtypes.append(getattr(torch, name))
    quick = os.environ.get("SHIM_CHECK_QUICK") == "1"
    counts = [1, 1003, 65541 if quick else (1 << 20) + 5]
    seed = 7

    def inputs(dtype, count, op=None):
        return [make_input(dtype, count, r, seed, op) for r in range(world)]

    for dtype in dtypes:
        for opname, op in ops.items():
            for count in counts:
                name = f"all_reduce {str(dtype)[6:]} {opname} n={count}"

                def run(dtype=dtype, opname=opname, op=op, count=count, name=name):
                    xs = inputs(dtype, count, opname)
                    x = xs[rank].to(dev)
                    dist.all_reduce(x, op=op)
                    torch.cuda.synchronize()
                    check(name, x, reduce_ref(xs, opname, dtype), dtype, world)
                guarded(name, run, real_nccl_may_refuse=real_nccl_lacks(opname, dtype))

    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.uint8):
        for count in (1, 4099, 65537 if quick else 1 << 20):
            tag = f"{str(dtype)[6:]} n={count}"
            xs = inputs(dtype, count)

            def ag():
                out = torch.full((world * count,), 0, dtype=dtype, device=dev)
                dist.all_gather_into_tensor(out, xs[rank].to(dev))
                torch.cuda.synchronize()
                check(f"all_gather_into_tensor {tag}", out, torch.cat(xs), dtype, world)
            guarded(f"all_gather_into_tensor {tag}", ag)

            def ag_list():
                outs = [torch.zeros(count, dtype=dtype, device=dev) for _ in range(world)]
                dist.all_gather(outs, xs[rank].to(dev))
                torch.cuda.synchronize()
                check(f"all_gather {tag}", torch.cat(outs), torch.cat(xs), dtype, world)
            guarded(f"all_gather {tag}", ag_list)

            def rs():
                big = inputs(dtype, count * world)
                out = torch.zeros(count, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(out, big[rank].to(dev))
                torch.cuda.synchronize()
                want = reduce_ref(big, "sum", dtype)[rank * count:(rank + 1) * count]
                check(f"reduce_scatter_tensor {tag}", out, want, dtype, world)
            guarded(f"reduce_scatter_tensor {tag}", rs)

            for root in range(world):
                def bc(root=root):
                    x = xs[rank].to(dev)
                    dist.broadcast(x, src=root)
                    torch.cuda.synchronize()
                    check(f"broadcast root={root} {tag}", x, xs[root], dtype, world)
                guarded(f"broadcast root={root} {tag}", bc)

            for root in range(world):
                def rd(root=root):
                    x = xs[rank].to(dev)
                    dist.reduce(x, dst=root)
                    torch.cuda.synchronize()
                    if rank == root:
                        check(f"reduce root={root} {tag}", x, reduce_ref(xs, "sum", dtype), dtype, world)
                    else:  # NCCL leaves a non-root's receive buffer (here its input) alone
                        check_exact(f"reduce root={root} {tag} (non-root unchanged)", x, xs[rank])
                guarded(f"reduce root={root} {tag}", rd)

    # Every op of reduce, on the last rank as root.
    for dtype in (torch.float32, torch.float16, torch.int32, torch.int64):
        for opname, op in ops.items():
            name = f"reduce {str(dtype)[6:]} {opname} root={world - 1} n=3001"

            def rd_op(dtype=dtype, opname=opname, op=op, name=name):
                xs = inputs(dtype, 3001, opname)
                x = xs[rank].to(dev)
                dist.reduce(x, dst=world - 1, op=op)
                torch.cuda.synchronize()
                if rank == world - 1:
                    check(name, x, reduce_ref(xs, opname, dtype), dtype, world)
            guarded(name, rd_op)

    def graph():
        x_in = inputs(torch.float32, 1 << 16)
        x = x_in[rank].to(dev)
        out = torch.zeros(world * x.numel(), device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            dist.all_reduce(x.clone())
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dist.all_reduce(x)
            dist.all_gather_into_tensor(out, x)
        for it in range(3):
            fresh = inputs(torch.float32, 1 << 16)
            x.copy_(fresh[rank].to(dev))
            g.replay()
            torch.cuda.synchronize()
            want = reduce_ref(fresh, "sum", torch.float32)
            check(f"cuda graph replay {it}: all_reduce", x, want, torch.float32, world)
            check(f"cuda graph replay {it}: all_gather", out, want.repeat(world), torch.float32, world)
    guarded("cuda graph capture", graph)

    def subgroups():
        evens, odds = list(range(0, world, 2)), list(range(1, world, 2))
        groups = [dist.new_group(evens), dist.new_group(odds) if odds else None]
        mine = evens if rank % 2 == 0 else odds
        group = groups[rank % 2]
        xs = inputs(torch.float32, 5000)
        x = xs[rank].to(dev)
        dist.all_reduce(x, group=group)
        torch.cuda.synchronize()
        check(f"new_group {mine} all_reduce", x, reduce_ref([xs[r] for r in mine], "sum",
                                                            torch.float32), torch.float32, len(mine))
    guarded("new_group", subgroups)
    guarded("barrier", lambda: (dist.barrier(), report("PASS", "barrier")))

    # All-to-all, gather, scatter and point-to-point last: torch runs the uneven all-to-all, gather
    # and scatter as grouped sends and receives, which run on the native point-to-point engine (also
    # with ranks sharing a GPU). Equal splits go through ncclAlltoAll where torch's NCCL has it.
    def a2a(uneven, dtype, chunk):
        if uneven:
            splits = [[(s + d) % 3 + 1 + chunk * ((s + d) % 2) for d in range(world)] for s in range(world)]
        else:
            splits = [[chunk] * world for _ in range(world)]
        xs = [make_input(dtype, sum(splits[r]), r, seed) for r in range(world)]
        ins, outs = splits[rank], [splits[s][rank] for s in range(world)]
        out = torch.zeros(sum(outs), dtype=dtype, device=dev)
        dist.all_to_all_single(out, xs[rank].to(dev), output_split_sizes=outs, input_split_sizes=ins)
        torch.cuda.synchronize()
        want = torch.cat([xs[s][sum(splits[s][:rank]):sum(splits[s][:rank + 1])] for s in range(world)])
        check_exact(f"all_to_all_single {'uneven' if uneven else 'equal'} {str(dtype)[6:]} chunk~{chunk}",
                    out, want)
    for dtype in (torch.float32, torch.int32, torch.bfloat16):
        for chunk in (1, 64, 33333):
            for uneven in (False, True):
                guarded(f"all_to_all_single {'uneven' if uneven else 'equal'} {str(dtype)[6:]} chunk~{chunk}",
                        lambda u=uneven, d=dtype, c=chunk: a2a(u, d, c))

    def gather(root, dtype, count):
        xs = inputs(dtype, count)
        outs = [torch.zeros(count, dtype=dtype, device=dev) for _ in range(world)] if rank == root else None
        dist.gather(xs[rank].to(dev), gather_list=outs, dst=root)
        torch.cuda.synchronize()
        if rank == root:
            check_exact(f"gather root={root} {str(dtype)[6:]} n={count}", torch.cat(outs), torch.cat(xs))

    def scatter(root, dtype, count):
        xs = inputs(dtype, count * world)
        chunks = [x.to(dev) for x in xs[root].chunk(world)] if rank == root else None
        out = torch.zeros(count, dtype=dtype, device=dev)
        dist.scatter(out, scatter_list=chunks, src=root)
        torch.cuda.synchronize()
        check_exact(f"scatter root={root} {str(dtype)[6:]} n={count}", out,
                    xs[root][rank * count:(rank + 1) * count])
    for root in range(world):
        for dtype, count in ((torch.float32, 1), (torch.int32, 4099), (torch.bfloat16, 65537)):
            if hasattr(dist, "gather"):
                guarded(f"gather root={root} {str(dtype)[6:]} n={count}",
                        lambda r=root, d=dtype, c=count: gather(r, d, c))
            if hasattr(dist, "scatter"):
                guarded(f"scatter root={root} {str(dtype)[6:]} n={count}",
                        lambda r=root, d=dtype, c=count: scatter(r, d, c))

    def p2p(batched, count, calls):
        # `calls` rings on new tensors (the caching allocator hands its segments out again), each
        # with other data (scaled by a power of two: exact), so a message left from an earlier
        # call shows. From 1 MiB on the engine writes straight into the receiving tensor once its
        # sender has mapped the segment (after the first calls).
        xs = inputs(torch.float32, count)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        for call in range(calls):
            scale = 2.0 ** call
            out = torch.zeros(count, device=dev)
            send = (xs[rank] * scale).to(dev)
            if batched:
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt),
                                              dist.P2POp(dist.irecv, out, prv)])
                for r in reqs:
                    r.wait()
            elif rank % 2 == 0:
                dist.send(send, nxt)
                dist.recv(out, prv)
            else:
                dist.recv(out, prv)
                dist.send(send, nxt)
            torch.cuda.synchronize()
            name = f"{'batch_isend_irecv' if batched else 'send/recv'} ring n={count}"
            check_exact(name + (f" call {call + 1}" if calls > 1 else ""), out, xs[prv] * scale)
    def p2p_all_pairs(dtype):
        # One batch: every rank sends to and receives from every other rank, each pair its own
        # size (1 element up to 64 Ki + 3), plus two more messages to the next rank whose order
        # must hold (the k-th isend to p matches p's k-th irecv from us).
        size = lambda s, d: [1, 3, 1027, 65539][(s + 2 * d) % 4]
        xs = {(s, d, k): make_input(dtype, size(s, d) + k * 5, s * 64 + d * 8 + k, seed)
              for s in range(world) for d in range(world) for k in range(3) if s != d}
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        ops, outs = [], {}
        for k in range(3):
            for d in range(world):
                if d == rank or (k > 0 and d != nxt):
                    continue
                ops.append(dist.P2POp(dist.isend, xs[(rank, d, k)].to(dev), d))
            for s in range(world):
                if s == rank or (k > 0 and s != prv):
                    continue
                outs[(s, k)] = torch.zeros(size(s, rank) + k * 5, dtype=dtype, device=dev)
                ops.append(dist.P2POp(dist.irecv, outs[(s, k)], s))
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        torch.cuda.synchronize()
        got = torch.cat([outs[key].cpu() for key in sorted(outs)])
        want = torch.cat([xs[(s, rank, k)] for (s, k) in sorted(outs)])
        if torch.equal(got, want):  # bytes move unchanged: exact, floats too
            report("PASS", f"batch_isend_irecv all pairs + order {dtype}", f"{got.numel()} elements")
        else:
            bad = (got != want).nonzero()
            report("FAIL", f"batch_isend_irecv all pairs + order {dtype}",
                   f"{bad.numel()} wrong elements, first at {bad[0].item() if bad.numel() else '?'}")

    if world > 1:
        for count, calls in ((777, 1), ((1 << 20) + 3, 4)):
            guarded("send/recv", lambda c=count, k=calls: p2p(False, c, k))
            guarded("batch_isend_irecv", lambda c=count, k=calls: p2p(True, c, k))
        for dtype in (torch.float32, torch.bfloat16, torch.int8):
            guarded(f"batch_isend_irecv all pairs + order {dtype}",
                    lambda dtype=dtype: p2p_all_pairs(dtype))

    dist.destroy_process_group()
    report("PASS", "destroy_process_group")


# ---------------------------------------------------------------- ctypes modes

NCCL_INT32, NCCL_FLOAT, NCCL_SUM, NCCL_MAX = 2, 7, 0, 2
NCCL_INVALID_USAGE = 5


def async_errors(lib, comms, name):
    """After a sync: ncclCommGetAsyncError of every communicator must say ncclSuccess, so a device
    wait that timed out (its output incomplete) fails here even where ncclGroupEnd and the stream
    sync returned success; returns whether all did."""
    ok = True
    for r, c in enumerate(comms):
        state = ctypes.c_int(-1)
        rc = lib.ncclCommGetAsyncError(ctypes.c_void_p(c), ctypes.byref(state))
        if rc != 0 or state.value != 0:
            report("FAIL", f"{name}: ncclCommGetAsyncError rank {r}",
                   f"(rc {rc}, async error {state.value}: {last_error(lib)})")
            ok = False
    return ok


def grouped(lib, name, comms, streams, call):
    """call(r) enqueues rank r's part; one group over every communicator, then every stream, then
    every communicator's asynchronous error."""
    n = len(streams)
    for s in streams:  # the inputs and poisoned outputs were written on the default streams
        torch.cuda.synchronize(s.device)
    lib.ncclGroupStart()
    bad = [r for r in range(n) if call(r) != 0]
    if bad:
        report("FAIL", f"{name}: enqueue on ranks {bad}", last_error(lib))
    rc = lib.ncclGroupEnd()
    if rc != 0:
        report("FAIL", f"{name}: ncclGroupEnd", last_error(lib))
    for s in streams:
        s.synchronize()
    healthy = async_errors(lib, comms, name)
    return not bad and rc == 0 and healthy


def rooted_and_exchanges(lib, comms, devs, streams):
    """ncclReduce, ncclGather, ncclScatter at every root and ncclAlltoAll, called directly (torch
    runs gather and scatter as sends and receives): integers exact, moved data bit-exact."""
    n = len(comms)
    size_t, ptr = ctypes.c_size_t, lambda t: ctypes.c_void_p(t.data_ptr())
    comm = [ctypes.c_void_p(c) for c in comms]
    stream = [ctypes.c_void_p(s.cuda_stream) for s in streams]
    on = [f"cuda:{d}" for d in devs]
    count = 4099
    for root in range(n):
        for dtype, code, opname, op in ((torch.int32, NCCL_INT32, "sum", NCCL_SUM),
                                        (torch.float32, NCCL_FLOAT, "max", NCCL_MAX)):
            xs = [make_input(dtype, count, r, 11 + root, opname) for r in range(n)]
            ins = [xs[r].to(on[r]) for r in range(n)]
            outs = [torch.full((count,), -7, dtype=dtype, device=on[r]) for r in range(n)]
            name = f"initall ncclReduce {str(dtype)[6:]} {opname} root={root}"
            if grouped(lib, name, comms, streams, lambda r: lib.ncclReduce(
                    ptr(ins[r]), ptr(outs[r]), size_t(count), code, op, root, comm[r], stream[r])):
                check(name, outs[root], reduce_ref(xs, opname, dtype), dtype, n)
        xs = [make_input(torch.float32, count, r, 13 + root) for r in range(n)]
        ins = [xs[r].to(on[r]) for r in range(n)]
        outs = [torch.zeros(count * n, device=on[r]) for r in range(n)]
        name = f"initall ncclGather root={root}"
        if grouped(lib, name, comms, streams, lambda r: lib.ncclGather(
                ptr(ins[r]), ptr(outs[r]), size_t(count), NCCL_FLOAT, root, comm[r], stream[r])):
            check_exact(name, outs[root], torch.cat(xs))
        big = make_input(torch.int32, count * n, root, 17)
        ins = [big.to(on[r]) for r in range(n)]
        outs = [torch.zeros(count, dtype=torch.int32, device=on[r]) for r in range(n)]
        name = f"initall ncclScatter root={root}"
        if grouped(lib, name, comms, streams, lambda r: lib.ncclScatter(
                ptr(ins[r]), ptr(outs[r]), size_t(count), NCCL_INT32, root, comm[r], stream[r])):
            for r in range(n):
                check_exact(f"{name} rank {r}", outs[r], big[r * count:(r + 1) * count])
        # In place at NCCL's offsets on every rank: scatter recvbuff = sendbuff + r * count, gather
        # sendbuff = recvbuff + r * count.
        bufs = [big.to(on[r]) if r == root else torch.zeros_like(big, device=on[r]) for r in range(n)]
        name = f"initall ncclScatter in place root={root}"
        if grouped(lib, name, comms, streams, lambda r: lib.ncclScatter(
                ptr(bufs[r]), ptr(bufs[r][r * count:]), size_t(count), NCCL_INT32, root, comm[r], stream[r])):
            for r in range(n):
                want = torch.zeros_like(big)
                want[r * count:(r + 1) * count] = big[r * count:(r + 1) * count]
                check_exact(f"{name} rank {r}", bufs[r], big if r == root else want)
        bufs = [torch.zeros(count * n, device=on[r]) for r in range(n)]
        for r in range(n):
            bufs[r][r * count:(r + 1) * count].copy_(xs[r])
        name = f"initall ncclGather in place root={root}"
        if grouped(lib, name, comms, streams, lambda r: lib.ncclGather(
                ptr(bufs[r][r * count:]), ptr(bufs[r]), size_t(count), NCCL_FLOAT, root, comm[r], stream[r])):
            check_exact(name, bufs[root], torch.cat(xs))
    for chunk in (1, 3, 70001, 1 << 20):
        xs = [make_input(torch.float32, chunk * n, r, 19) for r in range(n)]
        ins = [xs[r].to(on[r]) for r in range(n)]
        outs = [torch.zeros(chunk * n, device=on[r]) for r in range(n)]
        name = f"initall ncclAlltoAll chunk={chunk}"
        if grouped(lib, name, comms, streams, lambda r: lib.ncclAlltoAll(
                ptr(ins[r]), ptr(outs[r]), size_t(chunk), NCCL_FLOAT, comm[r], stream[r])):
            for r in range(n):
                want = torch.cat([xs[s][r * chunk:(r + 1) * chunk] for s in range(n)])
                check_exact(f"{name} rank {r}", outs[r], want)
        # In place: every rank's one buffer (copied through the engine's stage within it, swapped
        # pair by pair beyond it).
        bufs = [xs[r].to(on[r]) for r in range(n)]
        name = f"initall ncclAlltoAll in place chunk={chunk}"
        if grouped(lib, name, comms, streams, lambda r: lib.ncclAlltoAll(
                ptr(bufs[r]), ptr(bufs[r]), size_t(chunk), NCCL_FLOAT, comm[r], stream[r])):
            for r in range(n):
                want = torch.cat([xs[s][r * chunk:(r + 1) * chunk] for s in range(n)])
                check_exact(f"{name} rank {r}", bufs[r], want)


def rank_stream(device):
    """The stream one rank's operations run on in initall: one of PyTorch's pooled streams, or, with
    INITALL_STREAMS=raw, a non-blocking stream created here through the driver. The driver spreads a
    process's streams over CUDA_DEVICE_MAX_CONNECTIONS hardware queues by creation order; two ranks
    whose streams share a queue cannot run at once (a kernel waits behind a peer's kernel that waits
    for it). Streams created one after another land on distinct queues up to that count, so a run
    with raw streams tells a shared queue from other causes of a device timeout."""
    if os.environ.get("INITALL_STREAMS", "torch") != "raw":
        return torch.cuda.Stream(device=device)
    cuda = ctypes.CDLL("libcuda.so.1")
    raw = ctypes.c_void_p()
    rc = cuda.cuStreamCreate(ctypes.byref(raw), 1)  # CU_STREAM_NON_BLOCKING
    if rc != 0:
        raise RuntimeError(f"cuStreamCreate failed with CUresult {rc}")
    return torch.cuda.ExternalStream(raw.value, device=device)


def initall_mode():
    lib = shim()
    n = int(os.environ.get("NRANKS", "2"))
    ngpu = torch.cuda.device_count()
    devs = [r % ngpu for r in range(n)]
    comms = (ctypes.c_void_p * n)()
    rc = lib.ncclCommInitAll(comms, n, (ctypes.c_int * n)(*devs))
    if rc != 0:
        report("FAIL", f"ncclCommInitAll {n} ranks on devices {devs}", last_error(lib))
        return
    report("PASS", f"ncclCommInitAll {n} ranks on devices {devs}")
    for r in range(n):
        d = ctypes.c_int(-1)
        lib.ncclCommCuDevice(ctypes.c_void_p(comms[r]), ctypes.byref(d))
        report("PASS" if d.value == devs[r] else "FAIL", f"ncclCommCuDevice rank {r}", f"= {d.value}")
    # INITALL_COUNT moves the first group to other algorithms (at 4 ranks: up to 131072 elements
    # the all-gather is default_allgather_packet, above it default_allgather_fullmesh2).
    count = int(os.environ.get("INITALL_COUNT", "100003"))
    xs = [make_input(torch.float32, count, r, 3) for r in range(n)]
    bufs, streams = [], []
    for r in range(n):
        torch.cuda.set_device(devs[r])
        bufs.append(xs[r].to(f"cuda:{devs[r]}"))
        streams.append(rank_stream(devs[r]))
    outs = [torch.zeros(count * n, device=f"cuda:{devs[r]}") for r in range(n)]
    for d in set(devs):  # the outputs were zeroed on the default streams
        torch.cuda.synchronize(d)
    first = os.environ.get("INITALL_FIRST", "both")
    if first not in ("both", "allreduce", "allgather", "apart"):
        raise SystemExit(f"INITALL_FIRST={first}: expected both, allreduce, allgather or apart")
    reduce_ = first != "allgather"
    gather = first != "allreduce"
    # One group per entry: the operations each holds.
    groups = [("allreduce", "allgather")] if first == "both" else (
        [("allreduce",), ("allgather",)] if first == "apart" else [(first,)])
    for ops in groups:
        lib.ncclGroupStart()
        for r in range(n):
            p = ctypes.c_void_p(bufs[r].data_ptr())
            s = ctypes.c_void_p(streams[r].cuda_stream)
            rc = 0
            if "allreduce" in ops:
                rc |= lib.ncclAllReduce(p, p, ctypes.c_size_t(count), NCCL_FLOAT, NCCL_SUM,
                                        ctypes.c_void_p(comms[r]), s)
            if "allgather" in ops:
                rc |= lib.ncclAllGather(p, ctypes.c_void_p(outs[r].data_ptr()), ctypes.c_size_t(count),
                                        NCCL_FLOAT, ctypes.c_void_p(comms[r]), s)
            if rc:
                report("FAIL", f"enqueue rank {r}", last_error(lib))
        rc = lib.ncclGroupEnd()
        report("PASS" if rc == 0 else "FAIL", f"ncclGroupEnd over all communicators ({' + '.join(ops)})",
               last_error(lib) if rc else "")
        torch.cuda.synchronize()
    if async_errors(lib, list(comms), f"initall first group ({first})"):
        report("PASS", "ncclCommGetAsyncError after the group: every rank ncclSuccess")
    want = reduce_ref(xs, "sum", torch.float32) if reduce_ else None
    for r in range(n):
        if reduce_:
            check(f"initall all_reduce rank {r}", bufs[r], want, torch.float32, n)
        if gather:
            name = f"initall all_gather ({'after all_reduce' if reduce_ else 'of the inputs'}) rank {r}"
            if reduce_:
                check(name, outs[r], want.repeat(n), torch.float32, n)
            else:
                check_exact(name, outs[r], torch.cat(xs))
    rooted_and_exchanges(lib, list(comms), devs, streams)
    lib.ncclGroupStart()
    for r in range(n):
        lib.ncclCommDestroy(ctypes.c_void_p(comms[r]))
    lib.ncclGroupEnd()
    report("PASS", "ncclCommDestroy of every rank")


def comm_pair(lib, n=2):
    """n ranks (two by default) under torchrun: the id goes through torchrun's store."""
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), n, False)
    uid = ctypes.create_string_buffer(128)
    if rank == 0:
        assert lib.ncclGetUniqueId(uid) == 0, last_error(lib)
        store.set("mscclpp-nccl-fault-id", uid.raw)
    else:
        uid = ctypes.create_string_buffer(store.get("mscclpp-nccl-fault-id"), 128)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())

    class Id(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_ubyte * 128)]
    comm = ctypes.c_void_p()
    rc = lib.ncclCommInitRank(ctypes.byref(comm), n, Id.from_buffer_copy(uid.raw), rank)
    if rc:
        raise RuntimeError(f"init: {last_error(lib)}")
    return rank, comm, store


def fault_mode(kind):
    lib = shim()
    rank, comm, store = comm_pair(lib)
    x = torch.ones(1 << 20, device="cuda")
    stream = torch.cuda.Stream()
    if rank == 1:
        store.set("rank1-ready", b"1")
        if kind == "kill":
            time.sleep(1)
            os._exit(0)  # no teardown: the peer sees a rank vanish
        time.sleep(30)  # abort: never joins the all-reduce
        os._exit(0)
    store.wait(["rank1-ready"])
    time.sleep(2 if kind == "kill" else 0)
    p = ctypes.c_void_p(x.data_ptr())
    rc = lib.ncclAllReduce(p, p, ctypes.c_size_t(x.numel()), NCCL_FLOAT, NCCL_SUM, comm,
                           ctypes.c_void_p(stream.cuda_stream))
    start = time.time()
    limit = float(os.environ.get("MSCCLPP_DEVICE_WAIT_TIMEOUT", "10")) + 15
    if kind == "abort":
        took = []
        t = threading.Thread(target=lambda: (time.sleep(1), took.append(time.time()),
                                             lib.ncclCommAbort(comm), took.append(time.time())))
        t.start()
        t.join()
        dt = took[1] - took[0]
        report("PASS" if dt < 1.0 else "FAIL", "ncclCommAbort returns within 1 s", f"({dt:.3f} s)")
        while not stream.query() and time.time() - start < limit:
            time.sleep(0.05)
        drained = stream.query()
        report("PASS" if drained else "FAIL", "the blocked all-reduce ends after the abort",
               f"({time.time() - start:.1f} s; enqueue rc {rc})")
        os._exit(0 if drained else 1)
    state = ctypes.c_int(0)
    while time.time() - start < limit:
        lib.ncclCommGetAsyncError(comm, ctypes.byref(state))
        if state.value not in (0, 7):
            break
        time.sleep(0.1)
    ok = state.value in (2, 6)
    report("PASS" if ok else "FAIL", "peer death reported by ncclCommGetAsyncError",
           f"(code {state.value} after {time.time() - start:.1f} s; enqueue rc {rc}: {last_error(lib)})")
    os._exit(0 if ok else 1)


# ---------------------------------------------------------------- watchdog mode

WATCHDOG_BIG = 64 << 20  # bytes of the new tensor rank 0 all-reduces last


def watchdog_rank():
    """One rank of a watchdog run (started by `watchdog_mode` with the shim preloaded)."""
    import datetime
    import signal
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    peer = os.environ.get("WATCHDOG_PEER", "sleep")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    timeout = float(os.environ.get("WATCHDOG_TORCH_TIMEOUT", "10"))
    dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=timeout))
    small = torch.ones(1 << 10, device=dev)
    dist.all_reduce(small)  # warm-up on both ranks: kernels loaded, `small` known to both
    torch.cuda.synchronize()
    print(f"[rank {rank}] warm-up all_reduce done ({small[0].item():.0f})", flush=True)
    if rank == 1:
        if peer == "stop":
            # Stops every thread of this process (the shim's heartbeat too): rank 0's bootstrap
            # blames it after MSCCLPP_LIVENESS_TIMEOUT (by default the device wait timeout).
            threading.Thread(target=lambda: (time.sleep(0.2), os.kill(os.getpid(), signal.SIGSTOP)),
                             daemon=True).start()
        time.sleep(3600)  # never takes part again; the driver ends it
        os._exit(0)
    time.sleep(1)  # rank 1 is past its warm-up and quiet
    t0 = time.time()
    try:
        dist.all_reduce(small)  # launched; its kernel waits for rank 1 until the device wait budget
        print("[rank 0] all_reduce launched; rank 1 will not join", flush=True)
        big = torch.ones(WATCHDOG_BIG // 4, device=dev)
        # A new buffer: the first call on it exchanges its registration with rank 1 over the
        # bootstrap (a host wait inside the shim), where the algorithm registers user buffers.
        dist.all_reduce(big)
        print(f"[rank 0] all_reduce of {WATCHDOG_BIG >> 20} MiB returned after {time.time() - t0:.1f} s",
              flush=True)
        limit = float(os.environ.get("MSCCLPP_DEVICE_WAIT_TIMEOUT", "5")) + timeout + 30
        while time.time() - t0 < limit:
            dist.all_reduce(small)
            torch.cuda.synchronize()
            time.sleep(0.1)
    except Exception as e:
        lines = [l for l in str(e).splitlines() if l.strip()]
        print(f"[rank 0] python exception after {time.time() - t0:.1f} s: {type(e).__name__}: "
              f"{(lines[0] if lines else '')[:300]}", flush=True)
        raise  # the interpreter's own exit with the exception: code 1
    print(f"[rank 0] no error within {time.time() - t0:.0f} s", flush=True)
    sys.exit(0)


def watchdog_verdict(rc, handling):
    """(status, detail) for rank 0's return code (Popen's: negative for a signal, None: hung)."""
    import signal
    if rc is None:
        return "FAIL", "rank 0 hung (killed by the driver)"
    if rc == 0:
        return "FAIL", "rank 0 exited 0: the stalled peer went unnoticed"
    if rc > 0:
        return "PASS", f"rank 0 exited with code {rc} (a Python exception), not by a signal"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"

    if -rc == signal.SIGABRT and handling == "1":
        return "PASS", ("rank 0 ended by SIGABRT: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (TearDown) "
                        "calls std::abort after aborting the communicators (PyTorch's choice, not a crash)")
    return "FAIL", f"rank 0 was killed by {name}"


def watchdog_mode():
    """Runs `watchdog_rank` on 2 ranks per case and judges rank 0's exit (see the module docs)."""
    import signal
    import socket
    import subprocess
    shim_lib = os.environ.get("NCCL_SHIM_LIB", ".gpu/lib/libmscclpp_nccl.so")
    cases = [c.split(":") for c in os.environ.get("WATCHDOG_CASES", "2:sleep,2:stop,1:sleep").split(",") if c]
    device_timeout = os.environ.get("WATCHDOG_DEVICE_TIMEOUT", "5")
    for handling, peer in cases:
        name = f"watchdog TORCH_NCCL_ASYNC_ERROR_HANDLING={handling} peer={peer}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # NCCL_SHIM_LIB=none runs the same job on PyTorch's own NCCL, to compare how it ends.
        preload = {} if shim_lib == "none" else {"LD_PRELOAD": os.path.abspath(shim_lib)}
        # PyTorch's own sleeps after an error, shortened (see the module docs) unless set.
        sleeps = {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "10000", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "30"}
        env = dict({**sleeps, **os.environ}, **preload, WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCH_NCCL_ASYNC_ERROR_HANDLING=handling, WATCHDOG_PEER=peer,
                   MSCCLPP_DEVICE_WAIT_TIMEOUT=device_timeout, PYTHONUNBUFFERED="1",
                   # A fatal signal then prints every Python thread's stack before the process
                   # dies by it (the status still says which signal).
                   PYTHONFAULTHANDLER="1")
        env.pop("MSCCLPP_NCCL_LIB_PATH", None)  # the shim's own path only, no fallback NCCL
        procs, readers = [], []
        for r in range(2):
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "watchdog-rank"],
                                 env=dict(env, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0"),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 errors="replace")
            out = []

            def pump(p=p, out=out, r=r):
                for line in p.stdout:
                    out.append(line)
                    print(f"  [{name}] rank {r}| {line}", end="", flush=True)
            t = threading.Thread(target=pump, daemon=True)
            t.start()
            procs.append(p)
            readers.append((t, out))
        limit = float(os.environ.get("WATCHDOG_LIMIT", 0)) or \
            float(device_timeout) + float(os.environ.get("WATCHDOG_TORCH_TIMEOUT", "10")) + 90
        start = time.time()
        try:
            rc = procs[0].wait(timeout=limit)
        except subprocess.TimeoutExpired:
            procs[0].kill()
            procs[0].wait()
            rc = None
        took = time.time() - start
        # Rank 1 sleeps or is stopped, with no kernel of its own running: continue and end it.
        p1 = procs[1]
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                p1.send_signal(sig)
            except ProcessLookupError:
                pass
        try:
            p1.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p1.kill()
            p1.wait()
        for t, _ in readers:
            t.join(timeout=5)
        status, detail = watchdog_verdict(rc, handling)
        text = "".join(readers[0][1])
        if status == "PASS" and rc is not None and rc > 0 and "Traceback" not in text:
            detail += " (no Python traceback in its output)"
        if "Segmentation fault" in text or "Bus error" in text:
            status, detail = "FAIL", detail + "; its output mentions a segmentation fault"
        report(status, name, f"({detail}; {took:.1f} s)")


def inplace_mode():
    """nccl-tests' in-place calls, one process a rank (WORLD_SIZE of them, under torchrun; ranks
    may share a GPU under MPS), called through the C interface as nccl-tests calls them: per size,
    a send buffer S and a receive buffer R allocated once, the call out of place, then in place in
    R at NCCL's offsets on every rank (scatter recvbuff = R + rank * count, gather sendbuff = R +
    rank * count, all-to-all R both, all-gather sendbuff = R + rank * count, reduce-scatter
    recvbuff = R + rank * count), root 0; plus an all-to-all with rank 0 in place and the others out
    of place. Each call is synchronised and checked (moved data bit-exact, the sum against float64);
    a call that does not finish is what SHIM_CHECK_TIMEOUT bounds. Sizes are nccl-tests' totals
    from 128 B: up to INPLACE_ROOTED_MAX_BYTES (4 MiB) for gather and scatter, whose in-place form
    hung at 128 B when each rank kept its own cache of registered buffers, and up to
    INPLACE_MAX_BYTES (64 MiB) for the rest. In-place all-to-all is served at every size; rank 0
    alone in place is served up to the engine's stage (about 7 MiB a rank), and beyond it every
    rank must get ncclInvalidUsage saying that every rank must be in place."""
    lib = shim()
    n = int(os.environ["WORLD_SIZE"])
    rank, comm, _store = comm_pair(lib, n)
    stream = torch.cuda.Stream()
    sptr = ctypes.c_void_p(stream.cuda_stream)
    size_t = ctypes.c_size_t
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())
    rooted_max = int(os.environ.get("INPLACE_ROOTED_MAX_BYTES", str(4 << 20)))
    most = int(os.environ.get("INPLACE_MAX_BYTES", str(64 << 20)))
    sizes = [128 << (2 * i) for i in range(12) if 128 << (2 * i) <= most]
    root = 0

    def run(name, call):
        """One call on the stream, synchronised; whether it succeeded, with the error reported."""
        torch.cuda.synchronize()
        rc = call()
        if rc != 0:
            report("FAIL", f"{name}: rc {rc}", last_error(lib))
            return False
        stream.synchronize()
        state = ctypes.c_int(-1)
        lib.ncclCommGetAsyncError(comm, ctypes.byref(state))
        if state.value != 0:
            report("FAIL", f"{name}: async error {state.value}", last_error(lib))
            return False
        return True

    for total in sizes:
        count = total // (4 * n)
        if count == 0:
            continue
        every = [make_input(torch.int32, count * n, r, 23 + total % 97) for r in range(n)]
        mine = every[rank].cuda()
        S = mine.clone()
        R = torch.full((count * n,), -3, dtype=torch.int32, device="cuda")
        chunk = lambda t, r: t[r * count:(r + 1) * count]
        if total <= rooted_max:
            # Scatter: the root's S (then R) holds every rank's chunk.
            name = f"inplace ncclScatter {total} B out of place rank {rank}"
            if run(name, lambda: lib.ncclScatter(ptr(S), ptr(R), size_t(count), NCCL_INT32, root, comm, sptr)):
                check_exact(name, R[:count], chunk(every[root], rank))
            R.copy_(mine)
            name = f"inplace ncclScatter {total} B in place rank {rank}"
            if run(name, lambda: lib.ncclScatter(ptr(R), ptr(chunk(R, rank)), size_t(count), NCCL_INT32,
                                                 root, comm, sptr)):
                check_exact(name, chunk(R, rank), chunk(every[root], rank))
            # Gather: every rank's first chunk, into the root's R.
            R.fill_(-3)
            name = f"inplace ncclGather {total} B out of place rank {rank}"
            want = torch.cat([chunk(every[r], 0) for r in range(n)])
            if run(name, lambda: lib.ncclGather(ptr(S), ptr(R), size_t(count), NCCL_INT32, root, comm, sptr)) \
                    and rank == root:
                check_exact(name, R, want)
            R.fill_(-3)
            chunk(R, rank).copy_(chunk(mine, 0))
            name = f"inplace ncclGather {total} B in place rank {rank}"
            if run(name, lambda: lib.ncclGather(ptr(chunk(R, rank)), ptr(R), size_t(count), NCCL_INT32,
                                                root, comm, sptr)) and rank == root:
                check_exact(name, R, want)
        want = torch.cat([chunk(every[s], rank) for s in range(n)])
        for placement in ("out of place", "in place", "in place on rank 0 only"):
            if total > (7 << 20) and placement == "in place on rank 0 only":
                # Beyond the stage every rank refuses at once, before anything moves.
                torch.cuda.synchronize()
                src = R if rank == 0 else S
                rc = lib.ncclAlltoAll(ptr(src), ptr(R), size_t(count), NCCL_INT32, comm, sptr)
                why = last_error(lib)
                refused = rc == NCCL_INVALID_USAGE and "needs every rank in place" in why
                report("PASS" if refused else "FAIL",
                       f"inplace ncclAlltoAll {total} B in place on rank 0 only rank {rank} refused",
                       f"(rc {rc}: {why})")
                continue
            R.fill_(-3)
            here = placement == "in place" or (placement != "out of place" and rank == 0)
            if here:
                R.copy_(mine)
            src = R if here else S
            name = f"inplace ncclAlltoAll {total} B {placement} rank {rank}"
            if run(name, lambda: lib.ncclAlltoAll(ptr(src), ptr(R), size_t(count), NCCL_INT32, comm, sptr)):
                check_exact(name, R, want)
        # All-gather and reduce-scatter at NCCL's in-place offsets.
        R.fill_(-3)
        chunk(R, rank).copy_(chunk(mine, 0))
        name = f"inplace ncclAllGather {total} B in place rank {rank}"
        if run(name, lambda: lib.ncclAllGather(ptr(chunk(R, rank)), ptr(R), size_t(count), NCCL_INT32,
                                               comm, sptr)):
            check_exact(name, R, torch.cat([chunk(every[r], 0) for r in range(n)]))
        F = every[rank].float().cuda()
        name = f"inplace ncclReduceScatter {total} B in place rank {rank}"
        if run(name, lambda: lib.ncclReduceScatter(ptr(F), ptr(chunk(F, rank)), size_t(count), NCCL_FLOAT,
                                                   NCCL_SUM, comm, sptr)):
            ref = reduce_ref([chunk(x, rank).float() for x in every], "sum", torch.float32)
            check(name, chunk(F, rank), ref, torch.float32, n)
    lib.ncclCommDestroy(comm)
    report("PASS", f"inplace: ncclCommDestroy rank {rank}")


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "torch"
    {"torch": torch_mode, "initall": initall_mode, "inplace": inplace_mode,
     "kill": lambda: fault_mode("kill"), "abort": lambda: fault_mode("abort"),
     "watchdog": watchdog_mode, "watchdog-rank": watchdog_rank}[mode]()
    print(f"[rank {os.environ.get('RANK', '0')}] SUMMARY {RESULTS}", flush=True)
    sys.exit(1 if RESULTS["FAIL"] else 0)
