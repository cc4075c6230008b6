"""The DSL guide's NCCL-interposition flow, checked: compile a DSL all-reduce
(`allreduce_packet` of dsl/algorithms.py), register it and a selector with
`AlgorithmCollectionBuilder`, then `dist.init_process_group("nccl")` with the NCCL shim preloaded:
the shim's communicator takes the plan, and the selector is asked before each of its
collectives. The plan is written in place, as dist.all_reduce calls it; the selector answers with
it for in-place float32 all-reduces that its range covers and that cut into one chunk a rank,
and leaves the rest to the shim. CALLS all-reduces (default 300) of sizes drawn from a shared
seed (DSL_NCCL_SEED, printed) on tensors every rank places in its own pattern, as a caching
allocator gives them: rank-dependent padding allocations kept or dropped, views at odd offsets,
empty_cache() on odd ranks now and then. Random data, every element checked against a float64
reference; the selector's answers are counted, and a call it sent to the plan would have failed
had the shim's communicator not taken the plan (an unknown name is an error).
Run: LD_PRELOAD=$(python -m mscclpp --nccl-lib) torchrun --nproc_per_node=N dsl_with_nccl_api.py"""

import os
import random
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dsl"))
import mscclpp  # noqa: E402
from mscclpp import _shim  # noqa: E402
import algorithms  # noqa: E402

# Elements per rank (float32): inside the plan's range, then beyond what its scratch holds.
COUNTS = [1024, 64 * 257, 1 << 20]
CALLS = int(os.environ.get("DSL_NCCL_CALLS", "300"))


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local % torch.cuda.device_count())
    if not _shim.in_process():
        sys.exit("dsl_with_nccl_api: preload the shim: LD_PRELOAD=$(python -m mscclpp --nccl-lib)")
    # dist.all_reduce is in place: so is the plan (a plan refuses buffers it was not written for).
    spec = algorithms.spec_for("allreduce_packet", world, in_place=True)
    algo = mscclpp.compile(algo=algorithms.allreduce_packet, algo_spec=spec, rank=rank)
    low, high = algo.message_size_range
    answers = {"plan": 0, "shim": 0}

    def selector(by_collective, request):
        # The plan cuts the buffer into one chunk a rank: PyTorch's own 1-element all-reduces
        # (a barrier) go to the shim.
        if (request.collective == "allreduce" and request.dtype == mscclpp.DataType.float32
                and request.in_place and low <= request.message_size <= high
                and request.message_size % (4 * world) == 0):
            answers["plan"] += 1
            return by_collective["allreduce"][algo.name]
        answers["shim"] += 1
        return None

    builder = mscclpp.AlgorithmCollectionBuilder()
    builder.add_algorithm_builder(algo)
    builder.set_algorithm_selector(selector)
    dist.init_process_group("nccl")
    seed = int(os.environ.get("DSL_NCCL_SEED", "20261203"))
    shared, mine = random.Random(seed), random.Random(seed + 1000 + 7 * rank)
    if rank == 0:
        print(f"dsl_with_nccl_api: {CALLS} all-reduces, DSL_NCCL_SEED={seed}", flush=True)
    failures, kept = 0, []
    for call in range(CALLS):
        count = shared.choice(COUNTS)
        for _ in range(mine.randrange(4)):
            pad = torch.empty(mine.randrange(1, 1 << 20), dtype=torch.uint8, device="cuda")
            if mine.random() < 0.5:
                kept.append(pad)
        if len(kept) > 16 or mine.random() < 0.1:
            kept = kept[mine.randrange(len(kept) + 1):]
        if rank % 2 and mine.random() < 0.05:
            torch.cuda.empty_cache()
        gen = torch.Generator().manual_seed(1000 * call + 17)
        inputs = [torch.randn(count, generator=gen) for _ in range(world)]
        want = torch.stack([x.double() for x in inputs]).sum(0)
        off = mine.randrange(0, 64) * 2 + 1
        tensor = torch.empty(count + off + 64, device="cuda")[off:off + count]
        tensor.copy_(inputs[rank])
        dist.all_reduce(tensor)
        got = tensor.double().cpu()
        tol = world * 2.0**-24 * torch.stack([x.double().abs() for x in inputs]).sum(0) + 1e-30
        wrong = int(((got - want).abs() > tol).sum())
        if wrong:
            failures += 1
            print(f"rank {rank}: FAIL call {call}, all_reduce of {count} float32: {wrong} elements "
                  f"wrong (DSL_NCCL_SEED={seed})", flush=True)
        del tensor
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: {CALLS} all-reduces checked, {failures} wrong; the selector sent "
          f"{answers['plan']} to {algo.name} (range {low}-{high} bytes) and left {answers['shim']} "
          "to the shim", flush=True)
    if failures or answers["plan"] == 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
