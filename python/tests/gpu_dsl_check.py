"""GPU check of the DSL under torchrun (ranks may share one GPU): every program of
python/examples/dsl/algorithms.py that the GPU interpreter runs (all but the switch-channel one:
NVLS stays gated) is compiled with `mscclpp.compile` at the job's world size (the two-node
all-reduce of the default plans with the ranks split into two simulated nodes, over port channels,
included) and run three ways:
through `Algorithm.execute` without an executor, with an explicit `mscclpp.Executor`, and captured
into a CUDA graph and replayed on fresh data; then once more each way without the graph on a new
allocation, the old one freed (its address and export descriptor free for reuse) while both
executors still hold imports of it. float32 and bfloat16, three sizes each, within the plan's
runnable range (`Algorithm.message_size_range`; a size outside it is replaced by the nearest that
fits, said in a `note` line); outputs poisoned first, every element checked against a float64
reference (integers would be exact; floats within one rounding per summed term). Every mode runs
even after another failed; a failure says, per output chunk, whether it was untouched (still
poison) or wrong and where. Exit status 1 on any wrong element.
MSCCLPP_DSL_CHECK_KEEP_BUFFERS=1 keeps every allocation to the end (no reuse).
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
from dsl_check_sizes import chunk_sizes  # noqa: E402

POISON = -7777.0
DTYPES = (torch.float32, torch.bfloat16)
# MSCCLPP_DSL_CHECK_KEEP_BUFFERS=1 keeps every program's buffers to the end, so no address or
# export descriptor is ever reused (a run that fails without it and passes with it points at
# buffer reuse).
KEEP_BUFFERS = os.environ.get("MSCCLPP_DSL_CHECK_KEEP_BUFFERS") == "1"
_kept = []


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
    """One compiled algorithm with its buffers cut from one VMM allocation (RawGpuBuffer), at the
    sizes its runnable range allows (`Algorithm.message_size_range`)."""

    def __init__(self, group, name, algo):
        self.group, self.name, self.algo = group, name, algo
        with open(algo.execution_plan.path) as f:
            plan = json.load(f)
        gpu0 = plan["gpus"][0]
        self.in_chunks, self.out_chunks = gpu0["input_chunks"], gpu0["output_chunks"]
        self.in_place = plan["inplace"]
        self.sizes, self.notes = {}, []
        for dtype in DTYPES:
            self.sizes[dtype], notes = chunk_sizes(algo.message_size_range, self.in_chunks, dtype.itemsize)
            self.notes += [f"{dtype}: {n}" for n in notes]
        largest = max((e * d.itemsize for d in DTYPES for e in self.sizes[d]), default=16)
        self.most = max(self.in_chunks, self.out_chunks) * largest
        self.fresh_buffers()

    def fresh_buffers(self):
        """A new allocation for the buffers (the old one is freed unless KEEP_BUFFERS)."""
        if KEEP_BUFFERS and getattr(self, "raw", None) is not None:
            _kept.append((self.raw, self.bytes))
        self.raw = mscclpp.RawGpuBuffer(2 * self.most)
        self.bytes = torch.utils.dlpack.from_dlpack(self.raw.to_dlpack(data_type=str(torch.uint8)))
        self.half = self.most

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

    def finish(self, label, out, want, dtype, summed, elems):
        """None when every element is right, else what is wrong (by output chunk); collective."""
        torch.cuda.synchronize()
        try:
            check(f"{self.name} {label}", out, want, dtype, summed)
            wrong = None
        except AssertionError as e:
            wrong = f"{e}; {diagnose(out, want, elems)}"
        self.group.barrier()
        return wrong


def diagnose(out, want, elems):
    """Per output chunk of `elems` elements: ok, untouched (still poison: nothing was written
    there) or wrong (from which index, how many). Chunk c of an all-gather's or all-to-all's
    output comes from rank c; of an all-reduce's, from the rank that reduces chunk c."""
    got, ref = out.cpu().double(), want.cpu().double()
    tol = 1e-2 * max(1.0, ref.abs().max().item())
    parts = []
    for c in range(got.numel() // elems):
        g, r = got[c * elems:(c + 1) * elems], ref[c * elems:(c + 1) * elems]
        bad = (g - r).abs() > tol
        if not bool(bad.any()):
            parts.append(f"chunk {c}: ok")
        elif bool((g == POISON).all()):
            parts.append(f"chunk {c}: untouched")
        else:
            i = int(bad.nonzero()[0])
            parts.append(f"chunk {c}: wrong from element {c * elems + i} ({g[i].item()} != {r[i].item()}, "
                         f"{int(bad.sum())} wrong, {int((g == POISON).sum())} poison)")
    return ", ".join(parts)


def run_case(case, executor, seed):
    """Every mode at every size; returns what failed (a mode's failure does not stop the others,
    so one run says which modes fail). The order of calls is the same on every rank."""
    stream = torch.cuda.current_stream()
    failures = []

    def record(wrong):
        if wrong is not None:
            failures.append(wrong)

    for dtype in DTYPES:
        for elems in case.sizes[dtype]:
            label = f"{dtype} {elems}/chunk"
            inp, out, want, summed = case.fill(dtype, elems, seed)
            case.algo.execute(**case.args(inp, out, dtype, stream))
            record(case.finish(f"own executor {label}", out, want, dtype, summed, elems))
            inp, out, want, summed = case.fill(dtype, elems, seed + 1)
            case.algo.execute(executor=executor, **case.args(inp, out, dtype, stream))
            record(case.finish(f"executor {label}", out, want, dtype, summed, elems))
            g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            with torch.cuda.graph(g, stream=side):
                case.algo.execute(**case.args(inp, out, dtype, side))
            inp, out, want, summed = case.fill(dtype, elems, seed + 2)
            g.replay()
            record(case.finish(f"graph {label}", out, want, dtype, summed, elems))
            del g
            seed += 3
    # New buffers of the same size in place of the old (freed: their address and export
    # descriptor free for reuse) while both executors still hold the old ones' imports.
    dtype, elems = DTYPES[0], case.sizes[DTYPES[0]][:1]
    if elems:
        torch.cuda.synchronize()
        case.group.barrier()
        case.fresh_buffers()
        for mode, kwargs in (("own executor", {}), ("executor", {"executor": executor})):
            inp, out, want, summed = case.fill(dtype, elems[0], seed)
            case.algo.execute(**kwargs, **case.args(inp, out, dtype, stream))
            record(case.finish(f"{mode} on new buffers {dtype} {elems[0]}/chunk", out, want, dtype, summed,
                               elems[0]))
            seed += 1
    return failures


# The words of the refusals a plan makes, on every rank alike, where ranks share a GPU beyond
# what it can run: port channels with too many MPS clients a GPU (core/src/port_channel.rs), and
# more threadblocks than a rank's share of the GPU keeps resident (executor/src/algorithm.rs).
SHARED_GPU_REFUSALS = ("share a GPU as MPS clients", "its share of the GPU keeps resident")


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
        if rank == 0:
            for note in case.notes:
                print(f"note {name}: {note}", flush=True)
        try:
            mine = run_case(case, executor, 1000 * i)
        except mscclpp.MscclppError as e:
            # A skip with its reason, not a failure; any other error fails the check.
            if not any(words in str(e) for words in SHARED_GPU_REFUSALS):
                raise
            if rank == 0:
                print(f"skip {name}: {e}", flush=True)
            del case, algo
            continue
        for f in mine:
            print(f"rank {rank}: FAIL {f}", flush=True)
        counts = [int(b) for b in group.bootstrap.all_gather(str(len(mine)).encode())]
        if any(counts):
            failures.append(name)
            if rank == 0:
                print(f"FAIL {name} on {n} ranks: failures by rank {counts}", flush=True)
        elif rank == 0:
            sizes = "; ".join(f"{d}: {case.sizes[d]}" for d in DTYPES)
            print(f"ok {name} on {n} ranks: own executor, Executor, graph, new buffers; per chunk {sizes}",
                  flush=True)
        if KEEP_BUFFERS:
            _kept.append((case.raw, case.bytes))
        del case, algo
    executor.reset()
    group.barrier()
    if failures:
        if rank == 0:
            print(f"FAILED gpu_dsl_check on {n} ranks: {', '.join(failures)}", flush=True)
        sys.exit(1)
    if rank == 0:
        print(f"PASS gpu_dsl_check on {n} ranks", flush=True)


if __name__ == "__main__":
    main()
