"""GPU check of the TorchComms backend "mscclpp" under torchrun (ranks may share one GPU), after
torchcomms' own integration tests: every operation at counts {0, 4, 1024, 1M} and dtypes float,
half, bf16, int, int8, double, run sync (result and work), async (wait, then check), async with the
input deleted before the wait, and captured into a CUDA graph replayed 3 times; reductions SUM,
MAX, MIN, AVG, PREMUL_SUM(2.0) (bf16 with a tensor factor) and the bitwise ones on integers; fp8
with an float32 accumulation hint; two communicators used in turn; split into two halves and into
one group with the rest passing []. Outputs are poisoned first and every element is compared with
the exact expected value (the inputs are small integers, exact in every dtype).

torchcomms is the real package where it imports, else the stand-in in standin/ (the GPU machines
have PyTorch but not torchcomms). The stand-in hands PREMUL_SUM's factor to the backend; the
real torchcomms does not, so there PREMUL_SUM is reported as declined.

Run: torchrun --nproc_per_node=N torchcomms_gpu_check.py [--quick]
     (--quick: counts {0, 4, 1024} and no graph mode). Exit status 1 on any wrong element or error.
"""

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchcomms_support import import_torchcomms, is_standin  # noqa: E402

QUICK = "--quick" in sys.argv
COUNTS = [0, 4, 1024] if QUICK else [0, 4, 1024, 1 << 20]
DTYPES = [torch.float, torch.half, torch.bfloat16, torch.int, torch.int8, torch.double]
MODES = ["sync", "sync_work", "async", "async_deleted"] + ([] if QUICK else ["graph"])
REPLAYS = 3


def main():
    if not torch.cuda.is_available():
        print("torchcomms_gpu_check: skipped: no CUDA device visible to torch")
        return 0
    tc = import_torchcomms()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    comm = tc.new_comm("mscclpp", device, name="gpu-check", abort_process_on_timeout_or_error=False)
    check = Check(tc, comm, device)
    if check.rank == 0:
        print(f"torchcomms {'stand-in' if is_standin(tc) else 'real'} {getattr(tc, '__version__', '?')}, "
              f"{check.size} ranks on {torch.cuda.device_count()} GPU(s), modes {MODES}, counts {COUNTS}",
              flush=True)
    check.run_all()
    second = tc.new_comm("mscclpp", device, name="gpu-check-second",
                         abort_process_on_timeout_or_error=False)
    check.two_communicators(second)
    check.splits()
    check.fp8(tc.new_comm("mscclpp", device, name="gpu-check-fp8",
                          abort_process_on_timeout_or_error=False,
                          hints={"mscclpp.accum_dtype": "float32"}))
    second.finalize()
    comm.barrier(False)
    torch.cuda.synchronize()
    comm.finalize()
    return check.report()


def resets(issue, *outputs):
    """`issue`, whose reset() poisons `outputs` again."""
    issue.reset = lambda: [o.fill_(-3) for o in outputs]
    return issue


class Check:
    def __init__(self, tc, comm, device):
        self.tc, self.comm, self.device = tc, comm, device
        self.rank, self.size = comm.get_rank(), comm.get_size()
        self.failures, self.declined, self.cases = [], [], 0

    # -- helpers ---------------------------------------------------------------------------

    def full(self, count, value, dtype):
        return torch.full((count,), value, dtype=dtype, device=self.device)

    def poison(self, count, dtype):
        return self.full(count, -3, dtype)

    def expect(self, what, got, want):
        want = want.to(got.dtype) if isinstance(want, torch.Tensor) else torch.full_like(got, want)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            first = bad[0].tolist() if bad.numel() else "?"
            raise AssertionError(f"{what}: {bad.shape[0]} wrong elements, first at {first}: "
                                 f"got {got.flatten()[:4].tolist()} want {want.flatten()[:4].tolist()}")

    def case(self, name, count, dtype, mode, setup):
        """`setup()` makes the tensors and returns (issue, verify, drop): issue(async_op) issues
        the operation and returns its work (issue.reset(), where set, restores its inputs and
        poisons its outputs before a graph replay), verify() checks the outputs, drop() deletes
        the inputs the operation reads (for async_deleted)."""
        label = f"{name} count={count} dtype={str(dtype).replace('torch.', '')} mode={mode}"
        self.cases += 1
        try:
            issue, verify, drop = setup()
            if mode == "graph":
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        issue(False)
                    for _ in range(REPLAYS):
                        # Inputs restored (in-place operations) and outputs poisoned again, so
                        # every replay is checked on its own.
                        reset = getattr(issue, "reset", None)
                        if reset:
                            reset()
                        graph.replay()
                        stream.synchronize()
                        verify()
                torch.cuda.current_stream().wait_stream(stream)
                return
            work = issue(mode.startswith("async"))
            if mode == "sync_work" or mode == "async":
                work.wait()
            elif mode == "async_deleted":
                drop()
                work.wait()
            verify()
        except ValueError as e:
            if "PREMUL_SUM factor" in str(e):
                self.declined.append(f"{label}: {e}")
            else:
                self.fail(label, e)
        except Exception as e:  # noqa: BLE001 (every failure is reported, then the next case runs)
            self.fail(label, e)

    def fail(self, label, e):
        self.failures.append(f"rank {self.rank}: {label}: {type(e).__name__}: {e}")
        if len(self.failures) <= 3:
            traceback.print_exc()

    def report(self):
        for d in self.declined[:5]:
            print(f"declined: {d}")
        for f in self.failures[:40]:
            print(f"FAILED {f}", flush=True)
        status = "FAILED" if self.failures else "ok"
        print(f"rank {self.rank}: {self.cases} cases, {len(self.failures)} failed, "
              f"{len(self.declined)} declined: {status}", flush=True)
        return 1 if self.failures else 0

    def reductions(self, dtype):
        R = self.tc.ReduceOp
        ops = [("SUM", R.SUM), ("MAX", R.MAX), ("MIN", R.MIN)]
        if dtype.is_floating_point:
            ops.append(("AVG", R.AVG))
            factor = torch.ones(1, dtype=dtype, device=self.device) * 2.0 if dtype == torch.bfloat16 else 2.0
            ops.append(("PREMUL_SUM(2.0)", R.PREMUL_SUM(factor)))
        else:
            ops += [("BAND", R.BAND), ("BOR", R.BOR), ("BXOR", R.BXOR)]
        return ops

    def reduced(self, name, values):
        """The reduction `name` of the per-rank values (Python numbers)."""
        if name == "SUM":
            return sum(values)
        if name == "MAX":
            return max(values)
        if name == "MIN":
            return min(values)
        if name == "AVG":
            return sum(values) / len(values)
        if name.startswith("PREMUL_SUM"):
            return 2 * sum(values)
        acc = values[0]
        for v in values[1:]:
            acc = {"BAND": acc & v, "BOR": acc | v, "BXOR": acc ^ v}[name]
        return acc

    # -- the matrix ------------------------------------------------------------------------

    def run_all(self):
        start = time.monotonic()
        for count in COUNTS:
            for dtype in DTYPES:
                for mode in MODES:
                    self.matrix(count, dtype, mode)
            if self.rank == 0:  # a stop between these lines is a hang, not slowness
                print(f"count {count}: {self.cases} cases done after {time.monotonic() - start:.0f} s",
                      flush=True)

    def matrix(self, count, dtype, mode):
        n, r, c = self.size, self.rank, self.comm
        mine = r + 1
        values = [p + 1 for p in range(n)]
        for opname, op in self.reductions(dtype):
            def all_reduce(op=op, opname=opname):
                t = self.full(count, mine, dtype)

                def issue(async_op):
                    return c.all_reduce(t, op, async_op)
                issue.reset = lambda: t.fill_(mine)
                return issue, lambda: self.expect("all_reduce", t, self.reduced(opname, values)), lambda: None
            self.case(f"all_reduce {opname}", count, dtype, mode, all_reduce)

            root = n - 1

            def reduce(op=op, opname=opname, root=root):
                t = self.full(count, mine, dtype)

                def issue(async_op):
                    return c.reduce(t, root, op, async_op)
                issue.reset = lambda: t.fill_(mine)

                def verify():
                    if r == root:
                        self.expect("reduce", t, self.reduced(opname, values))
                return issue, verify, lambda: None
            self.case(f"reduce {opname} root={root}", count, dtype, mode, reduce)

            def reduce_scatter_single(op=op, opname=opname):
                src = [self.full(count * n, mine, dtype)]
                out = self.poison(count, dtype)
                return (resets(lambda a: c.reduce_scatter_single(out, src[0], op, a), out),
                        lambda: self.expect("reduce_scatter_single", out, self.reduced(opname, values)),
                        lambda: src.clear())
            self.case(f"reduce_scatter_single {opname}", count, dtype, mode, reduce_scatter_single)

            def reduce_scatter(op=op, opname=opname):
                src = [[self.full(count, mine, dtype) for _ in range(n)]]
                out = self.poison(count, dtype)
                return (resets(lambda a: c.reduce_scatter(out, src[0], op, a), out),
                        lambda: self.expect("reduce_scatter", out, self.reduced(opname, values)),
                        lambda: src.clear())
            self.case(f"reduce_scatter {opname}", count, dtype, mode, reduce_scatter)

            def reduce_scatter_v(op=op, opname=opname):
                src = [[self.full(count + p, mine, dtype) for p in range(n)]]
                out = self.poison(count + r, dtype)
                return (resets(lambda a: c.reduce_scatter_v(out, src[0], op, a), out),
                        lambda: self.expect("reduce_scatter_v", out, self.reduced(opname, values)),
                        lambda: src.clear())
            self.case(f"reduce_scatter_v {opname}", count, dtype, mode, reduce_scatter_v)

        for root in sorted({0, n - 1}):
            def broadcast(root=root):
                t = self.full(count, mine, dtype)

                def issue(async_op):
                    return c.broadcast(t, root, async_op)
                issue.reset = lambda: t.fill_(mine)
                return issue, lambda: self.expect("broadcast", t, root + 1), lambda: None
            self.case(f"broadcast root={root}", count, dtype, mode, broadcast)

        def ranks_cat(counts):
            return torch.cat([self.full(k, p + 1, dtype) for p, k in enumerate(counts)])

        def all_gather_single():
            src = [self.full(count, mine, dtype)]
            out = self.poison(count * n, dtype)
            return (resets(lambda a: c.all_gather_single(out, src[0], a), out),
                    lambda: self.expect("all_gather_single", out, ranks_cat([count] * n)),
                    lambda: src.clear())
        self.case("all_gather_single", count, dtype, mode, all_gather_single)

        def all_gather():
            src = [self.full(count, mine, dtype)]
            outs = [self.poison(count, dtype) for _ in range(n)]
            return (resets(lambda a: c.all_gather(outs, src[0], a), *outs),
                    lambda: self.expect("all_gather", torch.cat(outs), ranks_cat([count] * n)),
                    lambda: src.clear())
        self.case("all_gather", count, dtype, mode, all_gather)

        def all_gather_v():
            src = [self.full(count + r, mine, dtype)]
            outs = [self.poison(count + p, dtype) for p in range(n)]
            return (resets(lambda a: c.all_gather_v(outs, src[0], a), *outs),
                    lambda: self.expect("all_gather_v", torch.cat(outs),
                                        ranks_cat([count + p for p in range(n)])),
                    lambda: src.clear())
        self.case("all_gather_v", count, dtype, mode, all_gather_v)

        # All-to-all: chunk p of rank r holds r * n + p + 1 (at most 64 at 8 ranks: exact in int8).
        def chunks(sender_major, sizes):
            return torch.cat([self.full(k, (r * n + p if sender_major else p * n + r) + 1, dtype)
                              for p, k in enumerate(sizes)])

        def all_to_all_single():
            src = [chunks(True, [count] * n)]
            out = self.poison(count * n, dtype)
            return (resets(lambda a: c.all_to_all_single(out, src[0], a), out),
                    lambda: self.expect("all_to_all_single", out, chunks(False, [count] * n)),
                    lambda: src.clear())
        self.case("all_to_all_single", count, dtype, mode, all_to_all_single)

        def all_to_all_v_single():
            # Rank r sends count + p elements to p, so it receives count + r from each.
            in_splits = [count + p for p in range(n)]
            out_splits = [count + r] * n
            src = [chunks(True, in_splits)]
            out = self.poison(sum(out_splits), dtype)
            return (resets(lambda a: c.all_to_all_v_single(out, src[0], out_splits, in_splits, a), out),
                    lambda: self.expect("all_to_all_v_single", out, chunks(False, out_splits)),
                    lambda: src.clear())
        self.case("all_to_all_v_single", count, dtype, mode, all_to_all_v_single)

        def all_to_all():
            src = [[self.full(count, r * n + p + 1, dtype) for p in range(n)]]
            outs = [self.poison(count, dtype) for _ in range(n)]
            return (resets(lambda a: c.all_to_all(outs, src[0], a), *outs),
                    lambda: self.expect("all_to_all", torch.cat(outs), chunks(False, [count] * n)),
                    lambda: src.clear())
        self.case("all_to_all", count, dtype, mode, all_to_all)

        for root in sorted({0, n - 1}):
            def scatter(root=root):
                src = [[self.full(count, p + 1, dtype) for p in range(n)] if r == root else []]
                out = self.poison(count, dtype)
                return (resets(lambda a: c.scatter(out, src[0], root, a), out),
                        lambda: self.expect("scatter", out, mine), lambda: src.clear())
            self.case(f"scatter root={root}", count, dtype, mode, scatter)

            def gather(root=root):
                src = [self.full(count, mine, dtype)]
                outs = [self.poison(count, dtype) for _ in range(n)] if r == root else []

                def verify():
                    if r == root:
                        self.expect("gather", torch.cat(outs), ranks_cat([count] * n))
                return (resets(lambda a: c.gather(outs, src[0], root, a), *outs), verify,
                        lambda: src.clear())
            self.case(f"gather root={root}", count, dtype, mode, gather)

        def send_recv():
            # A ring: even ranks send first, odd ranks receive first, so every pair meets.
            src = [self.full(count, mine, dtype)]
            out = self.poison(count, dtype)
            nxt, prv = (r + 1) % n, (r - 1) % n

            def issue(async_op):
                if r % 2 == 0:
                    c.send(src[0], nxt, async_op)
                    return c.recv(out, prv, async_op)
                c.recv(out, prv, async_op)
                return c.send(src[0], nxt, async_op)
            return resets(issue, out), lambda: self.expect("send/recv", out, prv + 1), lambda: src.clear()
        if n % 2 == 0:
            self.case("send_recv ring", count, dtype, mode, send_recv)

        def barrier():
            return (lambda a: c.barrier(a), lambda: None, lambda: None)
        if count == 0:
            self.case("barrier", count, dtype, mode, barrier)

    # -- several communicators, split, fp8 -------------------------------------------------

    def two_communicators(self, second):
        n, mine = self.size, self.rank + 1
        for count in (4, 1 << 16):
            a = self.full(count, mine, torch.float)
            b = self.full(count, 2 * mine, torch.float)
            w1 = self.comm.all_reduce(a, self.tc.ReduceOp.SUM, True)
            w2 = second.all_reduce(b, self.tc.ReduceOp.SUM, True)
            w2.wait()
            w1.wait()
            self.cases += 1
            try:
                self.expect("first communicator", a, n * (n + 1) // 2)
                self.expect("second communicator", b, n * (n + 1))
            except AssertionError as e:
                self.fail(f"two communicators count={count}", e)

    def splits(self):
        n, r = self.size, self.rank
        halves = [p for p in range(n) if p % 2 == r % 2]
        sub = self.comm.split(halves, f"half-{r % 2}")
        self.cases += 1
        try:
            assert sub.get_size() == len(halves) and sub.get_rank() == halves.index(r)
            t = self.full(1024, r + 1, torch.float)
            sub.all_reduce(t, self.tc.ReduceOp.SUM, False)
            self.expect("split halves", t, sum(p + 1 for p in halves))
            sub.finalize()
        except Exception as e:  # noqa: BLE001
            self.fail("split into halves", e)
        first_two = [0, 1] if r < 2 else []
        sub = self.comm.split(first_two, "first-two")
        self.cases += 1
        try:
            if r >= 2:
                assert sub is None, "a rank passing [] gets no communicator"
            else:
                t = self.full(16, r + 1, torch.float)
                sub.all_reduce(t, self.tc.ReduceOp.SUM, False)
                self.expect("split first two", t, 3)
                sub.finalize()
        except Exception as e:  # noqa: BLE001
            self.fail("split with []", e)

    def fp8(self, comm):
        n = self.size
        for count in (4, 4096):
            self.cases += 1
            try:
                t = self.full(count, float(self.rank + 1), torch.float).to(torch.float8_e4m3fn)
                comm.all_reduce(t, self.tc.ReduceOp.SUM, False)
                self.expect("fp8 e4m3 sum (f32 accumulation)", t.float(), float(n * (n + 1) // 2))
            except Exception as e:  # noqa: BLE001
                self.fail(f"fp8 count={count}", e)
        comm.finalize()


if __name__ == "__main__":
    sys.exit(main())
