"""GPU check of the DSL under torchrun (ranks may share one GPU): every program of
python/examples/dsl/algorithms.py that the GPU interpreter runs (all but the switch-channel one:
NVLS stays gated) is compiled with `mscclpp.compile` at the job's world size (the two-node
all-reduce of the default plans with the ranks split into two simulated nodes, over port channels,
included) and run three ways:
through `Algorithm.execute` without an executor, with an explicit `mscclpp.Executor`, and captured
into a CUDA graph and replayed on fresh data. float32 and bfloat16, three sizes each; outputs
poisoned first, every element checked against a float64 reference (integers would be exact;
floats within one rounding per summed term). Exit status 1 on any wrong element.
Run: torchrun --nproc_per_node=N gpu_dsl_check.py  (or: NRANKS=N bash .gpu/python-run.sh dslc)"""

import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "dsl"))
import mscclpp  # noqa: E402
import mscclpp.utils as mscclpp_utils  # noqa: E402
import algorithms  # noqa: E402
from _common import check, init_comm_group  # noqa: E402

POISON = -7777.0
DTYPES = (torch.float32, torch.bfloat16)
# Elements per chunk of the plan: small, odd-ish multiple of 16-byte words, and large.
CHUNK_ELEMS = (64, 64 * 33, 64 * 1024)


def expected(collective, inputs, rank, out_count):
    """(this rank's output in float64, the summed inputs or None)."""
    n = len(inputs)
    x = [t.double() for t in inputs]
    if collective == "allreduce":
        return torch.stack(x).sum(0), inputs
    if collective == "allgather":
        return torch.cat(x), None
    if collective == "reducescatter":
        return torch.stack([t[rank * out_count:(rank + 1) * out_count] for t in x]).sum(0), inputs
    if collective == "alltoall":
        k = out_count // n
        return torch.cat([t[rank * k:(rank + 1) * k] for t in x]), None
    if collective == "sendrecv":  # the ring of sendrecv_ring: from rank - 1
        return x[(rank - 1) % n], None
    raise ValueError(collective)


class Case:
    """One compiled algorithm with its buffers cut from one VMM allocation (RawGpuBuffer)."""

    def __init__(self, group, name, algo):
        self.group, self.name, self.algo = group, name, algo
        with open(algo.execution_plan.path) as f:
            plan = json.load(f)
        gpu0 = plan["gpus"][0]
        self.in_chunks, self.out_chunks = gpu0["input_chunks"], gpu0["output_chunks"]
        self.in_place = plan["inplace"]
        most = max(self.in_chunks, self.out_chunks) * max(CHUNK_ELEMS) * 4
        self.raw = mscclpp.RawGpuBuffer(2 * most)
        self.bytes = torch.utils.dlpack.from_dlpack(self.raw.to_dlpack(data_type=str(torch.uint8)))
        self.half = most

    def fill(self, dtype, elems, seed):
        n, rank = self.group.nranks, self.group.my_rank
        in_count, out_count = self.in_chunks * elems, self.out_chunks * elems
        gen = torch.Generator().manual_seed(seed)
        inputs = [torch.randn(in_count, generator=gen).to(dtype) for _ in range(n)]
        flat = self.bytes.view(dtype)
        inp = flat[: in_count]
        out = flat[self.half // dtype.itemsize: self.half // dtype.itemsize + out_count]
        if self.in_place:  # the all-reduce's output is its input
            out = inp
        out.fill_(POISON)
        inp.copy_(inputs[rank])
        want, summed = expected(self.algo.collective, inputs, rank, out_count)
        torch.cuda.synchronize()
        self.group.barrier()  # every input is in place before any peer reads it
        return inp, out, want, summed

    def args(self, inp, out, dtype, stream):
        return dict(comm=self.group.communicator, input_buffer=inp.data_ptr(), output_buffer=out.data_ptr(),
                    input_size=inp.nbytes, output_size=out.nbytes,
                    dtype=mscclpp_utils.torch_dtype_to_mscclpp_dtype(dtype), stream=stream.cuda_stream)

    def finish(self, label, out, want, dtype, summed):
        torch.cuda.synchronize()
        check(f"{self.name} {label}", out, want, dtype, summed)
        self.group.barrier()


def run_case(case, executor, seed):
    stream = torch.cuda.current_stream()
    for dtype in DTYPES:
        for elems in CHUNK_ELEMS:
            label = f"{dtype} {elems}/chunk"
            inp, out, want, summed = case.fill(dtype, elems, seed)
            case.algo.execute(**case.args(inp, out, dtype, stream))
            case.finish(f"own executor {label}", out, want, dtype, summed)
            inp, out, want, summed = case.fill(dtype, elems, seed + 1)
            case.algo.execute(executor=executor, **case.args(inp, out, dtype, stream))
            case.finish(f"executor {label}", out, want, dtype, summed)
            g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            with torch.cuda.graph(g, stream=side):
                case.algo.execute(**case.args(inp, out, dtype, side))
            inp, out, want, summed = case.fill(dtype, elems, seed + 2)
            g.replay()
            case.finish(f"graph {label}", out, want, dtype, summed)
            seed += 3


def main():
    group = init_comm_group()
    n, rank = group.nranks, group.my_rank
    os.environ.setdefault("MSCCLPP_CACHE_DIR", os.path.join(tempfile.gettempdir(), "mscclpp-dsl-check"))
    executor = mscclpp.Executor(group.communicator)
    failures = []
    for i, (name, entry) in enumerate(algorithms.ALGORITHMS.items()):
        if not entry[5]:
            if rank == 0:
                print(f"skip {name}: switch channels need NVLink multicast, which stays gated", flush=True)
            continue
        algo = mscclpp.compile(algo=entry[0], algo_spec=algorithms.spec_for(name, n), rank=rank)
        case = Case(group, name, algo)
        try:
            run_case(case, executor, 1000 * i)
            if rank == 0:
                print(f"ok {name} on {n} ranks: own executor, Executor, graph; {len(DTYPES)} dtypes x "
                      f"{len(CHUNK_ELEMS)} sizes", flush=True)
        except AssertionError as e:
            failures.append(str(e))
            print(f"rank {rank}: FAIL {e}", flush=True)
            torch.cuda.synchronize()
            group.barrier()
    executor.reset()
    group.barrier()
    if failures:
        sys.exit(1)
    if rank == 0:
        print(f"PASS gpu_dsl_check on {n} ranks", flush=True)


if __name__ == "__main__":
    main()
