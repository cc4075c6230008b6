"""GPU check of the DSL through the NCCL shim under PyTorch (ranks may share one GPU): every
program of python/examples/dsl/algorithms.py whose collective PyTorch calls (all-reduce,
all-gather, reduce-scatter, all-to-all; not the switch-channel one, NVLS stays gated, nor the
send/recv ring, since the shim serves point-to-point calls with its engine, not with plans) is
compiled at the job's world size, the all-reduces in place as dist.all_reduce calls them, and
registered with `AlgorithmCollectionBuilder`. A selector answers with the program under test
for the call it makes, and nothing else; then `dist.init_process_group("nccl")` with the shim
preloaded and no real NCCL behind it, so a call the plan did not serve fails. Each program runs
float32 and bfloat16 at the sizes its runnable range allows (dsl_check_sizes.py), eager and
captured into a CUDA graph replayed on fresh data, on tensors of PyTorch's caching allocator;
outputs poisoned first, every element checked against a float64 reference. The selector's
answers are counted: every call must have reached the plan. Exit status 1 on any failure.
Run: LD_PRELOAD=$(python -m mscclpp --nccl-lib) torchrun --nproc_per_node=N gpu_dsl_shim_check.py
(or: NRANKS=N bash .gpu/python-run.sh dslshim)"""

import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "dsl"))
import mscclpp  # noqa: E402
from mscclpp import _shim  # noqa: E402
import algorithms  # noqa: E402
from _common import check  # noqa: E402
from dsl_check_sizes import chunk_sizes  # noqa: E402
from gpu_dsl_check import POISON, SHARED_GPU_REFUSALS, expected  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)
# How PyTorch calls each collective: (output, input) tensors of the plan's chunk counts.
TORCH_CALLS = {
    "allreduce": lambda out, inp: dist.all_reduce(inp),
    "allgather": lambda out, inp: dist.all_gather_into_tensor(out, inp),
    "reducescatter": lambda out, inp: dist.reduce_scatter_tensor(out, inp),
    "alltoall": lambda out, inp: dist.all_to_all_single(out, inp),
}


# Most MPS clients a GPU may have where port channels run (core/src/port_channel.rs).
MPS_PORT_CLIENTS = 2


def crowded_mps(world):
    """Whether the ranks run as MPS clients (mps.sh sets the pipe folder), more of them a GPU
    than port channels take."""
    return "CUDA_MPS_PIPE_DIRECTORY" in os.environ and \
        world > MPS_PORT_CLIENTS * torch.cuda.device_count()


def uses_ports(name, world):
    """Whether program `name` at `world` ranks has port channels (its plan built in memory, not
    compiled into the plan cache)."""
    spec = algorithms.spec_for(name, world)
    plan = json.loads(algorithms.ALGORITHMS[name][0](spec).to_json())
    return any(c["channel_type"] == "port" for g in plan["gpus"] for c in g["channels"])


class Program:
    """One compiled program and the chunk counts and sizes its calls use."""

    def __init__(self, name, world, rank):
        collective = algorithms.ALGORITHMS[name][1].__name__.lower()
        in_place = collective == "allreduce"
        spec = algorithms.spec_for(name, world, in_place=in_place)
        self.name, self.algo = name, mscclpp.compile(algo=algorithms.ALGORITHMS[name][0],
                                                     algo_spec=spec, rank=rank)
        self.collective = self.algo.collective
        with open(self.algo.execution_plan.path) as f:
            gpu0 = json.load(f)["gpus"][0]
        self.in_chunks, self.out_chunks = gpu0["input_chunks"], gpu0["output_chunks"]
        self.sizes = {d: chunk_sizes(self.algo.message_size_range, self.in_chunks, d.itemsize)[0]
                      for d in DTYPES}


def run_program(p, i, world, rank, current, failures):
    """Runs program `p` (the `i`th) at every dtype and size, eager and in a graph, through
    PyTorch's call for its collective; appends what was wrong to `failures` and returns the
    number of calls made."""
    call = TORCH_CALLS[p.collective]
    calls = 0
    for dtype in DTYPES:
        for elems in p.sizes[dtype]:
            in_count, out_count = p.in_chunks * elems, p.out_chunks * elems
            inp = torch.empty(in_count, dtype=dtype, device="cuda")
            out = inp if p.collective == "allreduce" else torch.empty(out_count, dtype=dtype,
                                                                      device="cuda")
            current.update(program=p, bytes=inp.nbytes)
            for mode in ("eager", "graph"):
                gen = torch.Generator().manual_seed(1000 * i + 7 * elems + (mode == "graph"))
                inputs = [torch.randn(in_count, generator=gen).to(dtype) for _ in range(world)]
                want, summed = expected(p.collective, inputs, rank, out_count)
                out.fill_(POISON)
                inp.copy_(inputs[rank])
                torch.cuda.synchronize()
                if mode == "eager":
                    call(out, inp)
                else:
                    # Captured on poisoned data, replayed on fresh inputs.
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        call(out, inp)
                    out.fill_(POISON)
                    inp.copy_(inputs[rank])
                    torch.cuda.synchronize()
                    graph.replay()
                calls += 1
                torch.cuda.synchronize()
                try:
                    check(f"{p.name} {mode} {dtype} {elems}/chunk", out, want, dtype, summed)
                except AssertionError as e:
                    failures.append(str(e))
                    print(f"rank {rank}: FAIL {e}", flush=True)
    return calls


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if not _shim.in_process():
        sys.exit("gpu_dsl_shim_check: preload the shim: LD_PRELOAD=$(python -m mscclpp --nccl-lib)")
    programs = []
    for name, entry in algorithms.ALGORITHMS.items():
        collective = entry[1].__name__.lower()
        if not entry[5] or collective not in TORCH_CALLS:
            if rank == 0:
                why = ("switch channels need NVLink multicast, which stays gated" if not entry[5]
                       else "the shim serves point-to-point calls with its engine, not with plans")
                print(f"skip {name}: {why}", flush=True)
            continue
        if name == "allreduce_two_nodes":
            if rank == 0:
                print(f"skip {name}: it splits the ranks into two simulated nodes over port "
                      "channels, which the shim's communicator of one host does not", flush=True)
            continue
        if uses_ports(name, world) and crowded_mps(world):
            # Every plan the shim takes is built when the communicator is, so one refusal would
            # fail dist.init_process_group (gpu_dsl_check.py skips these on the same refusal). The
            # shim also takes the plans compile() left in the plan cache (executor/src/load.rs,
            # default_plan_dirs): this one is never compiled.
            if rank == 0:
                print(f"skip {name}: port channels with more than {MPS_PORT_CLIENTS} MPS clients a "
                      "GPU are refused (core/src/port_channel.rs)", flush=True)
            continue
        programs.append(Program(name, world, rank))
    # The call being made: the selector answers with its program for it and nothing else.
    current = {"program": None, "bytes": None, "answers": 0}

    def selector(by_collective, request):
        p = current["program"]
        if p is None or request.collective != p.collective or request.message_size != current["bytes"]:
            return None
        current["answers"] += 1
        return by_collective[p.collective][p.algo.name]

    builder = mscclpp.AlgorithmCollectionBuilder()
    for p in programs:
        builder.add_algorithm_builder(p.algo)
    builder.set_algorithm_selector(selector)
    dist.init_process_group("nccl")
    failures, calls = [], 0
    for i, p in enumerate(programs):
        try:
            calls += run_program(p, i, world, rank, current, failures)
        except RuntimeError:
            # A plan's refusal of a GPU crowded past what it can run comes at its first call,
            # alike on every rank; PyTorch's exception names only the code, ncclGetLastError
            # the reason. A skip with its reason; any other error fails the check.
            reason = _shim.last_error() or ""
            if not any(words in reason for words in SHARED_GPU_REFUSALS):
                raise
            if rank == 0:
                print(f"skip {p.name}: {reason}", flush=True)
            continue
        finally:
            current["program"] = None
        if rank == 0:
            print(f"{p.name}: {p.collective} through the shim, eager and graph, per chunk "
                  f"{'; '.join(f'{d}: {p.sizes[d]}' for d in DTYPES)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # A graph's capture asks the selector once; its replay runs what was captured.
    print(f"rank {rank}: {calls} calls checked, {len(failures)} wrong; the selector answered "
          f"{current['answers']} times with the program under test", flush=True)
    if failures or current["answers"] < calls:
        print(f"FAILED gpu_dsl_shim_check on rank {rank}", flush=True)
        sys.exit(1)
    if rank == 0:
        print(f"PASS gpu_dsl_shim_check on {world} ranks", flush=True)


if __name__ == "__main__":
    main()
