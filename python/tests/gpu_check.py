"""GPU check of the package under torchrun (ranks may share one GPU): every default algorithm
through `execute` with torch tensors of every dtype, out of place and in place, eager and under
torch.cuda.graph; the RawGpuBuffer/DLPack round trip; an all-reduce without torch (raw pointers);
the Torch integration guide's tuning loop over launch shapes (a shape an algorithm cannot run
returns a non-zero CommResult and enqueues nothing, a valid one returns 0 and the right sum); the
zero-copy algorithms on tensors every rank allocates and places in its own pattern
(GPU_CHECK_DIVERGENT_CALLS, default 400; GPU_CHECK_SEED, default 20261202, printed, replays a
schedule and every rank's placements; GPU_CHECK_ONLY=divergent runs that part alone).
Outputs are poisoned first and every element is checked: integers exact, floats against the
float64 reference within one rounding per summed term relative to the largest sum of magnitudes.
A call an algorithm declines (an unsupported type, a message beyond its scratch, a count that does
not split into ranks) is listed, not failed. Exit status 1 on any wrong element or other error.
Run: torchrun --nproc_per_node=N gpu_check.py"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import mscclpp  # noqa: E402
import mscclpp.utils as mscclpp_utils  # noqa: E402
from _common import check, init_comm_group  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64]
COUNTS = [1, 1000, 33 * 1024 + 5, 1 << 20]
# What an algorithm says when it declines a call it was not built for (not a wrong answer).
REFUSALS = ("unsupported", "scratch capacity", "does not split into", "do not split into")
# Collectives whose algorithms are checked out of place only, at root (or shift) 0: the Rust suite
# covers their in-place forms and every root.
OUT_OF_PLACE_ONLY = ("reduce", "gather", "scatter", "alltoall", "sendrecv")


def shapes(collective, count, n):
    """(input count, output count) for `count` elements per rank of input."""
    if collective in ("allgather", "gather"):
        return count, count * n
    if collective in ("reducescatter", "scatter"):
        return count * n, count
    if collective == "alltoall":
        return count * n, count * n
    return count, count


def random(dtype, count, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(count, generator=gen).to(dtype)
    lo, hi = (0, 8) if dtype == torch.uint8 else (-8, 8)
    return torch.randint(lo, hi, (count,), generator=gen).to(dtype)


def expected(collective, inputs, rank):
    """This rank's output, or None where it has none (rooted collectives off the root, 0)."""
    n = len(inputs)
    if collective == "allreduce" or (collective == "reduce" and rank == 0):
        return torch.stack([x.double() for x in inputs]).sum(0)
    if collective == "allgather" or (collective == "gather" and rank == 0):
        return torch.cat([x.double() for x in inputs])
    if collective == "reducescatter":
        total = torch.stack([x.double() for x in inputs]).sum(0)
        return total.chunk(n)[rank]
    if collective == "scatter":
        return inputs[0].double().chunk(n)[rank]
    if collective == "alltoall":
        return torch.cat([x.double().chunk(n)[rank] for x in inputs])
    if collective == "sendrecv":
        return inputs[rank].double()  # a shift by 0 (`root`): every rank's own input
    if collective in ("reduce", "gather"):
        return None
    return inputs[0].double()  # broadcast from rank 0


def run_case(group, algo, dtype, count, in_place, graph, seed):
    rank, n = group.my_rank, group.nranks
    in_count, out_count = shapes(algo.collective, count, n)
    inputs = [random(dtype, in_count, seed + r) for r in range(n)]
    want = expected(algo.collective, inputs, rank)
    out = torch.full((out_count,), 7, dtype=dtype, device="cuda")
    if in_place:
        if algo.collective == "allgather":
            inp = out[rank * in_count:(rank + 1) * in_count]
        elif algo.collective == "reducescatter":
            inp = torch.empty(in_count, dtype=dtype, device="cuda")
            out = inp[rank * out_count:(rank + 1) * out_count]
        else:
            inp = out
    else:
        inp = torch.empty(in_count, dtype=dtype, device="cuda")
    stream = torch.cuda.Stream()
    reducing = ("allreduce", "reducescatter", "reduce")
    op = mscclpp.ReduceOp.SUM if algo.collective in reducing else mscclpp.ReduceOp.NOP

    def launch():
        rc = algo.execute(group.communicator, inp.data_ptr(), out.data_ptr(), inp.nbytes,
                          out.nbytes, mscclpp_utils.torch_dtype_to_mscclpp_dtype(dtype), op=op,
                          stream=stream.cuda_stream)
        assert rc == mscclpp.CommResult.COMM_SUCCESS, f"{algo.name}: execute returned {rc!r}"

    g = None
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            launch()
    if in_place and algo.collective == "reducescatter":
        inp.copy_(inputs[rank].cuda())
    else:
        if not in_place or algo.collective != "allgather":
            out.fill_(7)
        inp.copy_(inputs[rank].cuda())
    torch.cuda.synchronize()
    group.barrier()
    with torch.cuda.stream(stream):
        g.replay() if graph else launch()
    stream.synchronize()
    if want is None:
        return
    summed = inputs if algo.collective in reducing else None
    check(f"{algo.name} {dtype} count {count} in_place {in_place} graph {graph}", out, want, dtype,
          summed)


def dlpack_round_trip(group):
    buf = mscclpp.RawGpuBuffer(3 << 20)
    t = torch.utils.dlpack.from_dlpack(buf.to_dlpack(data_type=str(torch.float32)))
    assert t.data_ptr() == buf.data_ptr() and t.numel() == (3 << 20) // 4 and t.is_cuda
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    del buf  # the tensor keeps the memory alive
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.arange(t.numel(), dtype=torch.float32))


def raw_pointer_allreduce(group, collection):
    """The path without torch: VMM memory, host copies, a device pointer and the default stream."""
    import array

    n, rank, count = group.nranks, group.my_rank, 4099
    buf = mscclpp.RawGpuBuffer(count * 4)
    buf.write(array.array("f", [float(rank + 1 + i % 7) for i in range(count)]).tobytes())
    group.barrier()
    f32 = mscclpp.DataType.float32
    algo = collection.select(group, "allreduce", count * 4, f32)
    algo.execute(group.communicator, buf.data_ptr(), buf.data_ptr(), count * 4, count * 4, f32,
                 op=mscclpp.ReduceOp.SUM, stream=0)
    got = array.array("f")
    got.frombytes(buf.read(count * 4))  # ordered after the default stream's work
    want = [float(sum(r + 1 + i % 7 for r in range(n))) for i in range(count)]
    wrong = sum(1 for g, w in zip(got, want) if g != w)
    assert wrong == 0, f"raw-pointer allreduce with {algo.name}: {wrong} wrong elements"
    group.barrier()


def launch_shape_loop(group, collection):
    """The guide's loop: `if execute(..., nblocks=, nthreads_per_block=) != 0: continue`. A shape
    the algorithm cannot run returns COMM_INVALID_ARGUMENT without raising and without enqueuing
    anything (the output keeps its poison); the valid shape after it returns 0 and the right sum.
    Every rank asks for the same shapes, so every rank skips the same ones."""
    name = "default_allreduce_packet"
    algo = collection.by_collective()["allreduce"][name]
    n, rank, count = group.nranks, group.my_rank, 1000
    stream = torch.cuda.Stream()
    inp = torch.full((count,), float(rank + 1), dtype=torch.float32, device="cuda")
    out = torch.empty_like(inp)
    want = torch.full((count,), float(n * (n + 1) // 2), dtype=torch.float32)
    ran, skipped = [], []
    # 1 << 16 blocks are beyond any grid; 100 threads are not a multiple of 32.
    for nblocks in (1 << 16, 4):
        for nthreads in (100, 512):
            out.fill_(7)
            torch.cuda.synchronize()
            group.barrier()
            rc = algo.execute(group.communicator, inp.data_ptr(), out.data_ptr(), inp.nbytes,
                              out.nbytes, mscclpp.DataType.float32, op=mscclpp.ReduceOp.SUM,
                              stream=stream.cuda_stream, nblocks=nblocks,
                              nthreads_per_block=nthreads)
            stream.synchronize()
            assert isinstance(rc, int), f"{name} returned {rc!r}, not an int"
            if rc != 0:  # skip unsupported configs, as the guide does
                assert rc == mscclpp.CommResult.COMM_INVALID_ARGUMENT, (nblocks, nthreads, rc)
                assert (out == 7).all().item(), f"{name} ({nblocks}, {nthreads}) wrote its output"
                skipped.append((nblocks, nthreads))
                continue
            ran.append((nblocks, nthreads))
            check(f"{name} nblocks {nblocks} nthreads {nthreads}", out, want.double(),
                  torch.float32, None)
    assert ran == [(4, 512)] and len(skipped) == 3, f"ran {ran}, skipped {skipped}"
    group.barrier()
    if rank == 0:
        print(f"launch shapes: {name} skipped {skipped} (non-zero CommResult), ran {ran}",
              flush=True)


def user_selector(group):
    """A selector set on the builder answers first; its None falls back to the default one."""
    builder = mscclpp.AlgorithmCollectionBuilder()
    builder.set_algorithm_selector(
        lambda algos, req: algos[req.collective]["default_allreduce_fullmesh"]
        if req.message_size <= 4096 else None
    )
    collection = builder.build_default_algorithms(rank=group.my_rank)
    f32 = mscclpp.DataType.float32
    assert collection.select(group, "allreduce", 1024, f32).name == "default_allreduce_fullmesh"
    assert collection.select(group, "allreduce", 1 << 20, f32).collective == "allreduce"


# The zero-copy algorithms, which read or write the peers' buffers: checked on buffers every rank
# places differently (see `divergent_allocations`).
ZERO_COPY = ("default_allreduce_rsag_zero_copy", "default_allgather_fullmesh2",
             "default_reducescatter_zero_copy", "default_alltoall_zero_copy")


def divergent_allocations(group, collection, calls, seed):
    """The user-buffer rule through the package: `calls` zero-copy calls whose tensors every rank
    allocates in its own pattern, as PyTorch's caching allocator gives them (rank-dependent padding
    allocations kept or dropped, views at odd element offsets into larger tensors, empty_cache() on
    odd ranks now and then). The schedule (algorithm, dtype, size) is shared; each rank's placement
    is its own. Every element is checked. Returns the number of calls checked."""
    import random as rnd
    import time
    rank, n = group.my_rank, group.nranks
    start = time.monotonic()
    algos = [a for a in collection if a.name in ZERO_COPY]
    shared, mine = rnd.Random(seed), rnd.Random(seed + 1000 + 7 * rank)
    kept = []
    for call in range(calls):
        algo = algos[shared.randrange(len(algos))]
        dtype = shared.choice([torch.float32, torch.bfloat16, torch.int32])
        # Elements of the collective's unit per rank (`shapes`): the larger buffer stays the size drawn.
        per = 1 if algo.collective == "allreduce" else n
        count = max(1, shared.choice([4096, 65537, 1 << 18, 1 << 20]) // per)
        for _ in range(mine.randrange(4)):
            pad = torch.empty(mine.randrange(1, 1 << 20), dtype=torch.uint8, device="cuda")
            if mine.random() < 0.5:
                kept.append(pad)
        if len(kept) > 16 or mine.random() < 0.1:
            kept = kept[mine.randrange(len(kept) + 1):]
        if rank % 2 and mine.random() < 0.05:
            torch.cuda.empty_cache()
        in_count, out_count = shapes(algo.collective, count, n)
        inputs = [random(dtype, in_count, 31 * call + r) for r in range(n)]
        want = expected(algo.collective, inputs, rank)

        def view(length):
            off = mine.randrange(0, 64) * 2 + 1
            return torch.empty(length + off + 64, dtype=dtype, device="cuda")[off:off + length]
        inp, out = view(in_count), view(out_count)
        out.fill_(7)
        inp.copy_(inputs[rank].cuda())
        torch.cuda.synchronize()
        reduces = algo.collective in ("allreduce", "reducescatter")
        op = mscclpp.ReduceOp.SUM if reduces else mscclpp.ReduceOp.NOP
        rc = algo.execute(group.communicator, inp.data_ptr(), out.data_ptr(), inp.nbytes, out.nbytes,
                          mscclpp_utils.torch_dtype_to_mscclpp_dtype(dtype), op=op,
                          stream=torch.cuda.current_stream().cuda_stream)
        assert rc == mscclpp.CommResult.COMM_SUCCESS, f"{algo.name}: execute returned {rc!r}"
        torch.cuda.synchronize()
        summed = inputs if reduces else None
        check(f"divergent call {call}: {algo.name} {dtype} count {count}", out, want, dtype, summed)
        del inp, out
        if rank == 0 and (call + 1) % 500 == 0:  # a stop between these lines is a hang, not slowness
            print(f"divergent: {call + 1} of {calls} calls right after {time.monotonic() - start:.0f} s",
                  flush=True)
    return calls


def main():
    group = init_comm_group()
    rank = group.my_rank
    dlpack_round_trip(group)
    collection = mscclpp.AlgorithmCollectionBuilder().build_default_algorithms(rank=rank)
    raw_pointer_allreduce(group, collection)
    launch_shape_loop(group, collection)
    user_selector(group)
    divergent_seed = int(os.environ.get("GPU_CHECK_SEED", "20261202"))
    calls = divergent_allocations(group, collection, int(os.environ.get("GPU_CHECK_DIVERGENT_CALLS", "400")),
                                  divergent_seed)
    print(f"rank {rank}: {calls} zero-copy calls on buffers placed differently per rank "
          f"(GPU_CHECK_SEED={divergent_seed}, {group.nranks} ranks), all right", flush=True)
    if os.environ.get("GPU_CHECK_ONLY") == "divergent":
        group.barrier()
        sys.exit(0)
    passed, refused, failed = 0, [], []
    seed = 1
    for algo in collection:
        for dtype in DTYPES:
            for count in COUNTS:
                for in_place in (False,) if algo.collective in OUT_OF_PLACE_ONLY else (False, True):
                    for graph in (False, True):
                        seed += 100
                        try:
                            run_case(group, algo, dtype, count, in_place, graph, seed)
                            passed += 1
                        except (mscclpp.MscclppError, ValueError) as e:
                            if not any(w in str(e) for w in REFUSALS):
                                raise
                            refused.append(f"{algo.name} {dtype} {count} in_place={in_place}: {e}")
                            torch.cuda.synchronize()
                        except AssertionError as e:
                            failed.append(str(e))
                        group.barrier()
        if rank == 0:
            print(f"{algo.name}: done ({passed} passed so far, {len(failed)} failed)", flush=True)
    if rank == 0:
        for r in refused:
            print("REFUSED", r)
    for f in failed:
        print(f"rank {rank} FAIL {f}", flush=True)
    group.barrier()
    print(f"rank {rank}: {passed} passed, {len(refused)} refused, {len(failed)} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
