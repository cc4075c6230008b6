"""The Torch integration guide's approach 2 (DSL execution plans), checked. MSCCL++'s DSL emits
JSON execution plans; this program loads the all-reduce and all-gather plans of PLAN_DIRs written
for the job's world size (NVLS plans left out) and runs each of them two ways:
  1. as the guide does: `Algorithm(execution_plan=ExecutionPlan(path)).execute(...,
     executor=Executor(comm.communicator))`, plus `Executor.execute` with LL8 packets for LL plans;
  2. registered: `AlgorithmCollectionBuilder().add_algorithm_builder(...)` then
     `build_default_algorithms()`: `select` picks a plan for the sizes a plan covers, and every
     registered plan runs from the collection without an executor, eagerly and under
     torch.cuda.graph (replayed on fresh data).
Random data, outputs poisoned first, every element checked against a float64 reference.
Run: torchrun --nproc_per_node=N customized_comm_with_dsl.py PLAN_DIR...
(after scripts/gpu-stage.sh: .gpu/plans, the fixtures for 2 and 4 ranks, and .gpu/builder-plans,
the builder's all-reduce plans for 2, 4 and 8 ranks)."""

import os
import sys

import torch

import mscclpp
import mscclpp.utils as mscclpp_utils
from _common import check, init_comm_group

# Elements per rank: multiples of 64 so that every plan's chunks hold whole elements; the largest
# (512 KiB of float32) fits every staged plan's scratch.
COUNTS = [64, 64 * 257, 64 * 2048]
POISON = -7777.0


def load_plans(plan_dirs, world_size):
    plans = []
    for f in sorted(os.path.join(d, f) for d in plan_dirs for f in os.listdir(d)):
        if not f.endswith(".json") or "nvls" in os.path.basename(f):
            continue
        plan = mscclpp.ExecutionPlan(f)
        if plan.world_size == world_size and plan.collective in ("allreduce", "allgather"):
            plans.append(plan)
    return plans


class Buffers:
    """One VMM buffer (RawGpuBuffer through DLPack, as the guide allocates) that every call's
    input and output are cut from, so a call with the same plan and count reuses its addresses."""

    def __init__(self, nbytes):
        self.raw = mscclpp.RawGpuBuffer(nbytes)
        self.bytes = torch.utils.dlpack.from_dlpack(self.raw.to_dlpack(data_type=str(torch.uint8)))

    def fill(self, group, plan, dtype, count, seed):
        """Poisons the output, writes this rank's input; returns (input, output, want, summed)."""
        rank, n = group.my_rank, group.nranks
        gen = torch.Generator().manual_seed(seed)
        inputs = [torch.randn(count, generator=gen).to(dtype) for _ in range(n)]
        flat = self.bytes.view(dtype)
        gather = plan.collective == "allgather"
        out_count = count * n if gather else count
        out = flat[:out_count]
        out.fill_(POISON)
        if gather:
            want, summed = torch.cat([x.double() for x in inputs]), None
            inp = out[rank * count:(rank + 1) * count] if plan.inplace else flat[out_count:out_count + count]
        else:
            want, summed = torch.stack([x.double() for x in inputs]).sum(0), inputs
            inp = out if plan.inplace else flat[out_count:out_count + count]
        inp.copy_(inputs[rank])
        torch.cuda.synchronize()
        group.barrier()  # every rank's input is in place before any peer's kernel reads it
        return inp, out, want, summed


def call_args(group, inp, out, dtype, stream):
    return dict(
        comm=group.communicator,
        input_buffer=inp.data_ptr(),
        output_buffer=out.data_ptr(),
        input_size=inp.nbytes,
        output_size=out.nbytes,
        dtype=mscclpp_utils.torch_dtype_to_mscclpp_dtype(dtype),
        stream=stream.cuda_stream,
    )


def finish(group, label, out, want, dtype, summed):
    torch.cuda.synchronize()
    check(label, out, want, dtype, summed)
    group.barrier()


def with_executor(group, buffers, plans):
    """Approach 2 as the guide writes it: each plan run by an explicit Executor."""
    executor = mscclpp.Executor(group.communicator)
    stream = torch.cuda.current_stream()
    for p, plan in enumerate(plans):
        algo = mscclpp.Algorithm(execution_plan=plan)
        for dtype in (torch.float32, torch.bfloat16):
            for c, count in enumerate(COUNTS):
                inp, out, want, summed = buffers.fill(group, plan, dtype, count, 1000 * p + c)
                algo.execute(executor=executor, **call_args(group, inp, out, dtype, stream))
                finish(group, f"executor {plan.name} {dtype} {count}", out, want, dtype, summed)
        if plan.protocol == "LL":
            for c, count in enumerate(COUNTS):
                dtype = torch.float32
                inp, out, want, summed = buffers.fill(group, plan, dtype, count, 2000 * p + c)
                executor.execute(
                    group.my_rank, inp.data_ptr(), out.data_ptr(), inp.nbytes, out.nbytes,
                    mscclpp.DataType.float32, plan, stream.cuda_stream,
                    packet_type=mscclpp.PacketType.LL8,
                )
                finish(group, f"executor LL8 {plan.name} {count}", out, want, dtype, summed)
        if group.my_rank == 0:
            print(f"executor: {plan.name} ({plan.collective}, {plan.protocol}) correct", flush=True)
    executor.reset()  # every rank at the same point: set-ups are freed collectively


def registered(group, buffers, plans):
    """Plans registered with the builder: the selector's choice, and each plan eager and graph."""
    builder = mscclpp.AlgorithmCollectionBuilder()
    for plan in plans:
        builder.add_algorithm_builder(mscclpp.Algorithm(execution_plan=plan))
    algos = builder.build_default_algorithms(rank=group.my_rank)
    stream = torch.cuda.current_stream()
    dtype = torch.float32
    for collective in sorted({plan.collective for plan in plans}):
        # Plans are chosen only for calls of their buffer mode (the plan's `inplace`).
        in_place = any(plan.inplace for plan in plans if plan.collective == collective)
        for c, count in enumerate(COUNTS):
            chosen = algos.select(group, collective, count * 4, mscclpp.DataType.float32,
                                  stream=stream.cuda_stream, in_place=in_place)
            if not chosen.is_dsl_algorithm():
                raise AssertionError(f"select chose {chosen.name}, not a registered plan")
            inp, out, want, summed = buffers.fill(group, chosen.execution_plan, dtype, count, 3000 + c)
            chosen.execute(op=mscclpp.ReduceOp.SUM, **call_args(group, inp, out, dtype, stream))
            finish(group, f"selected {chosen.name} {count}", out, want, dtype, summed)
    for p, plan in enumerate(plans):
        algo = algos.by_collective()[plan.collective][plan.name]
        for c, count in enumerate(COUNTS):
            inp, out, want, summed = buffers.fill(group, plan, dtype, count, 4000 + 10 * p + c)
            algo.execute(**call_args(group, inp, out, dtype, stream))
            finish(group, f"registered {plan.name} {count}", out, want, dtype, summed)
            # The same call captured into a CUDA graph, replayed on fresh data.
            g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            with torch.cuda.graph(g, stream=side):
                algo.execute(**call_args(group, inp, out, dtype, side))
            inp, out, want, summed = buffers.fill(group, plan, dtype, count, 5000 + 10 * p + c)
            g.replay()
            finish(group, f"graph {plan.name} {count}", out, want, dtype, summed)
        if group.my_rank == 0:
            print(f"registered: {plan.name} selected, eager and graph correct", flush=True)


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: customized_comm_with_dsl.py PLAN_DIR...")
    group = init_comm_group()
    plans = load_plans(sys.argv[1:], group.nranks)
    if not plans:
        sys.exit(f"no all-reduce or all-gather plan for {group.nranks} ranks in {sys.argv[1:]}")
    if group.my_rank == 0:
        print(f"plans for {group.nranks} ranks: {', '.join(p.name for p in plans)}", flush=True)
    buffers = Buffers(2 * group.nranks * max(COUNTS) * 4)
    with_executor(group, buffers, plans)
    registered(group, buffers, plans)
    group.barrier()
    if group.my_rank == 0:
        print("PASS customized_comm_with_dsl", flush=True)


if __name__ == "__main__":
    main()
