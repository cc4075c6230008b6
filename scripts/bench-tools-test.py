#!/usr/bin/env python3
"""CPU test of the timing tools of issue #22 (no torch, no GPU; run by scripts/test.sh, ~4 s):

- nccl/scripts/torch_bench.py: argument parsing, sizes and busbw factors, and `compare` on
  synthetic run files (sides told by the library field, each target met and not met, a failed
  check making it exit 1, rows only one side has);
- torch_bench.py's run on a stand-in torch (Python lists, a world of one rank, graphs that record
  the calls captured): every row timed and checked, a broken all_gather and a refused capture
  reported;
- scripts/gpu-run.sh `nccl bench` with a fake torchrun and nvidia-smi: PyTorch's NCCL, then the
  shim preloaded, NVLS off, options passed on, the comparison written; `nccl hostcost` likewise
  (nccl/scripts/host_cost.py, whose --help needs no torch); `fault` and the whole `suite` end
  with fault-inject.py at the run's world size, sections and --quick without it;
- scripts/plan-bench.py: the choice of plans among the fixtures (other world sizes and NVLS left
  out), the bench command lines, and a whole run against a fake mscclpp-bench (a few lines of
  Python writing the bench's JSON) with a plan that meets the target, one that misses it at large
  sizes, one whose range stops early (the sizes beyond are left out, not failed), one that
  hangs (ended by its time limit and reported), then `table` rebuilding the same tables."""
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAILURES = []


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def expect(cond, what):
    print(("ok     " if cond else "FAILED ") + what, flush=True)
    if not cond:
        FAILURES.append(what)


def quiet(fn, *a):
    """fn(*a) with its stdout captured: (result, text)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        r = fn(*a)
    return r, buf.getvalue()


# ---------------------------------------------------------------- torch_bench.py

def torch_bench_tests():
    tb = load("torch_bench", "nccl/scripts/torch_bench.py")
    a = tb.parse_args(["run", "--json", "x.json"])
    expect((a.min, a.max, a.dtype, a.collectives, a.modes) ==
           (1024, 1 << 30, "bf16", list(tb.COLLECTIVES), ["eager", "graph"]), "torch_bench run defaults")
    expect(len(tb.sizes(a.min, a.max)) == 21, "1K..1G is 21 sizes")
    a = tb.parse_args(["run", "--json", "x", "--collectives", "all_reduce", "--modes", "graph", "-b", "4K",
                       "-e", "1M", "-k", "8", "-G", "3"])
    expect((a.collectives, a.modes, a.min, a.max, a.graph_calls, a.graph_replays) ==
           (["all_reduce"], ["graph"], 4096, 1 << 20, 8, 3), "torch_bench narrowed run")
    for bad in (["run"], ["run", "--json", "x", "--collectives", "all_to_all"], ["run", "--json", "x", "-b", "2M", "-e", "1M"],
                ["run", "--json", "x", "-n", "0"], ["run", "--json", "x", "-b", "1X"], ["compare", "a.json"]):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                tb.parse_args(bad)
            expect(False, f"torch_bench refuses {bad}")
        except SystemExit as e:
            expect(e.code == 2, f"torch_bench refuses {bad}")
    # nccl-tests factors at 2 ranks: all_reduce 1, the others 1/2. 1 GiB in 1000 us: 1073.74 GB/s algbw.
    expect(abs(tb.busbw("all_reduce", 1 << 30, 2, 1000.0) - 1073.741824) < 1e-6, "all_reduce busbw factor")
    expect(abs(tb.busbw("all_gather", 1 << 30, 2, 1000.0) - 536.870912) < 1e-6, "all_gather busbw factor")
    expect(abs(tb.bus_factor("reduce_scatter", 8) - 0.875) < 1e-12, "reduce_scatter factor at 8 ranks")

    def run_file(name, times, check=None):
        rows = []
        for (collective, mode, size), t in times.items():
            rows.append({"collective": collective, "mode": mode, "size_bytes": size, "time_us": t,
                         "time_us_ranks": [t, t], "busbw_gbs": tb.busbw(collective, size, 2, t),
                         "check": (check or {}).get((collective, mode, size), "ok")})
        served = "mscclpp-rs NCCL shim 0.1.0 (NCCL ABI 2.28.9)" if name == "mscclpp" else "NCCL 2.28.9"
        return {"tool": "torch_bench", "library": {"name": name, "served": served}, "device": "2 ranks, H200",
                "torch": "2.9", "world_size": 2, "dtype": "bf16", "options": {"iters": 20}, "rows": rows}

    K, M = 1 << 10, 1 << 20
    nccl = run_file("nccl", {("all_reduce", "graph", K): 11.05, ("all_reduce", "eager", K): 20.0,
                             ("all_reduce", "eager", M): 30.0, ("all_reduce", "eager", 2 * M): 40.0,
                             ("all_gather", "graph", 4 * M): 50.0, ("reduce_scatter", "eager", K): 10.0})
    ours = run_file("mscclpp", {("all_reduce", "graph", K): 2.4, ("all_reduce", "eager", K): 11.0,
                                ("all_reduce", "eager", M): 15.0, ("all_reduce", "eager", 2 * M): 41.0,
                                ("all_gather", "graph", 4 * M): 45.0, ("all_gather", "graph", 8 * M): 70.0})
    # The shim's file given first: the library fields decide the sides.
    (text, failed), _ = quiet(tb.compare, ours, nccl)
    expect(not failed, "compare: no failed checks")
    expect("| 1K | 2.40 | 11.05 | 0.22 |" in text and "<= 2.5 us: met" in text, "compare: graph 1K target met")
    expect("| 1K | 11.00 | 20.00 | 0.55 |" in text, "compare: eager 1K ratio 0.55")
    expect("| 1M | 15.00 | 30.00 | 0.50 |" in text, "compare: eager 1M ratio 0.50")
    line = next((x for x in text.splitlines() if x.startswith("| 2M | 41.00 |")), "")
    expect("busbw >= NCCL: NOT MET" in line and "0.6 x" not in line, "compare: eager 2M busbw not met, no ratio target")
    expect("all_reduce eager, <= 0.6 x NCCL: met (2 sizes)" in text, "compare: eager ratio target summary")
    expect("all_reduce eager, busbw >= NCCL: NOT MET at 2M" in text, "compare: busbw target summary")
    expect("all_gather graph, busbw >= NCCL: met where measured; not measured at 8M" in text,
           "compare: a size NCCL lacks is not measured")
    expect("| 8M | 70.00 | - | - |" in text, "compare: a row only ours has")
    expect("| 1K | - | 10.00 | - |" in text and "reduce_scatter eager, <= 0.6 x NCCL: not measured" in text,
           "compare: a row only NCCL has")
    expect("note:" not in text, "compare: no note when the library fields tell the sides")
    slow = run_file("mscclpp", {("all_reduce", "graph", K): 2.6, ("all_reduce", "eager", K): 13.0},
                    check={("all_reduce", "eager", K): "rank 1: 3 of 512 wrong"})
    (text, failed), _ = quiet(tb.compare, nccl, slow)
    expect("<= 2.5 us: NOT MET" in text and "<= 0.6 x NCCL: NOT MET" in text, "compare: targets not met")
    expect(len(failed) == 1 and "3 of 512 wrong" in text and "FAILED CHECKS" in text, "compare: a failed check")
    errored = dict(ours, skipped=[{"collective": "all_gather", "mode": "graph", "size_bytes": K,
                                   "why": "rank 0: error: RuntimeError: capture refused"}])
    (text, failed), _ = quiet(tb.compare, nccl, errored)
    expect(failed == ["all_gather graph 1K ours: not measured: rank 0: error: RuntimeError: capture refused"],
           "compare: a row not measured is listed as a failure")
    both = dict(nccl, library={"name": "nccl"})
    (text, _), _ = quiet(tb.compare, both, dict(both))
    expect("note: neither file says the shim served" in text, "compare: positional sides, said so")
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for name, run in (("n.json", nccl), ("o.json", slow)):
            paths.append(os.path.join(d, name))
            with open(paths[-1], "w") as f:
                json.dump(run, f)
        md = os.path.join(d, "cmp.md")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "nccl/scripts/torch_bench.py"), "compare",
                            *paths, "--out", md], capture_output=True, text=True)
        expect(p.returncode == 1 and os.path.exists(md) and "FAILED CHECKS" in p.stdout,
               "compare from the command line: exit 1 on a failed check, tables written")


class FakeTensor:
    """The few tensor operations torch_bench.py's run uses, on a Python list (one rank, no GPU)."""

    def __init__(self, values):
        self.v = list(values)

    def _other(self, o):
        return o.v if isinstance(o, FakeTensor) else [o] * len(self.v)

    def __add__(self, o):
        return FakeTensor(a + b for a, b in zip(self.v, self._other(o)))

    def __sub__(self, o):
        return FakeTensor(a - b for a, b in zip(self.v, self._other(o)))

    def __mul__(self, o):
        return FakeTensor(a * b for a, b in zip(self.v, self._other(o)))

    def __ne__(self, o):
        return FakeTensor(a != b for a, b in zip(self.v, self._other(o)))

    def __gt__(self, o):
        return FakeTensor(a > b for a, b in zip(self.v, self._other(o)))

    def __getitem__(self, i):
        return FakeTensor([self.v[i]])

    def to(self, *_):
        return FakeTensor(self.v)

    float = clone = to

    def repeat(self, k):
        return FakeTensor(self.v * k)

    def abs(self):
        return FakeTensor(abs(a) for a in self.v)

    def nonzero(self):
        return FakeTensor(i for i, a in enumerate(self.v) if a)

    def numel(self):
        return len(self.v)

    def item(self):
        return self.v[0]

    def element_size(self):
        return 2

    def fill_(self, x):
        self.v = [x] * len(self.v)

    def zero_(self):
        self.fill_(0)

    def copy_(self, o):
        self.v = list(o.v)


def fake_torch(broken_all_gather=False, refuse_capture=False):
    """(torch, torch.distributed) stand-ins for one rank: the collectives of a world of 1 (copies),
    CUDA graphs that record the calls made while capturing, events 1 ms apart."""
    import types
    from contextlib import nullcontext
    torch, dist, cuda = types.ModuleType("torch"), types.ModuleType("torch.distributed"), types.SimpleNamespace()
    capturing = []

    class Graph:
        def __init__(self):
            self.calls = []

        def replay(self):
            for c in self.calls:
                c()

    @contextlib.contextmanager
    def graph(g):
        if refuse_capture:
            raise RuntimeError("capture refused")
        capturing.append(g)
        yield
        capturing.pop()

    def collective(fn):
        def call(*a):
            (capturing[-1].calls.append(lambda: fn(*a)) if capturing else fn(*a))
        return call

    def all_gather(out, x):
        if not broken_all_gather:
            out.copy_(x)

    class Event:
        def __init__(self, **_):
            pass

        record = synchronize = lambda self: None

        def elapsed_time(self, _end):
            return 1.0

    cuda.device_count = lambda: 1
    cuda.set_device = cuda.synchronize = lambda *a: None
    cuda.get_device_properties = lambda _d: types.SimpleNamespace(name="Fake GPU", total_memory=80 << 30)
    cuda.Event, cuda.CUDAGraph, cuda.graph = Event, Graph, graph
    cuda.Stream = lambda: types.SimpleNamespace(wait_stream=lambda s: None)
    cuda.current_stream = cuda.Stream
    cuda.stream = lambda s: nullcontext()
    cuda.nccl = types.SimpleNamespace(version=lambda: (2, 28, 9))
    torch.cuda, torch.bfloat16, torch.float32, torch.__version__ = cuda, "bf16", "f32", "fake"
    torch.version = types.SimpleNamespace(cuda="13.0")
    torch.device = lambda kind, i: f"{kind}:{i}"
    torch.tensor = lambda v, dtype=None: FakeTensor(v)
    torch.arange = lambda n, device=None: FakeTensor(range(n))
    torch.empty = lambda n, dtype=None, device=None: FakeTensor([0] * n)
    torch.cat = lambda ts: FakeTensor(a for t in ts for a in t.v)
    dist.init_process_group = dist.barrier = dist.destroy_process_group = lambda *a, **k: None
    dist.new_group = lambda **k: "gloo"
    dist.all_reduce = collective(lambda x: None)
    dist.all_gather_into_tensor = collective(all_gather)
    dist.reduce_scatter_tensor = collective(lambda out, x: out.copy_(x))

    def all_gather_object(out, obj, group=None):
        out[0] = obj
    dist.all_gather_object = all_gather_object
    torch.distributed = dist
    return torch, dist


def torch_bench_run_test():
    """torch_bench.py's run on the stand-ins: every row timed and checked, a broken all_gather
    caught, a refused capture recorded as not measured; the JSON compares."""
    saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LD_PRELOAD")}
    saved_mods = {k: sys.modules.get(k) for k in ("torch", "torch.distributed")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.pop("LD_PRELOAD", None)
    try:
        tb = load("torch_bench", "nccl/scripts/torch_bench.py")
        with tempfile.TemporaryDirectory() as d:
            results = {}
            for name, kw in (("good", {}), ("broken", {"broken_all_gather": True}), ("nograph", {"refuse_capture": True})):
                sys.modules["torch"], sys.modules["torch.distributed"] = fake_torch(**kw)
                path = os.path.join(d, name + ".json")
                code, text = quiet(tb.main, ["run", "--json", path, "-b", "1K", "-e", "4K", "-n", "4", "-k", "5", "-G", "2"])
                with open(path) as f:
                    results[name] = (code, json.load(f), text)
            code, run, text = results["good"]
            rows = run["rows"]
            expect(code == 0 and len(rows) == 18 and all(r["check"] == "ok" for r in rows),
                   f"torch_bench run: 3 collectives x 2 modes x 3 sizes checked ({code}, {len(rows)} rows)")
            eager = next(r for r in rows if r["mode"] == "eager")
            graph = next(r for r in rows if r["mode"] == "graph")
            expect(eager["time_us"] == 250.0 and graph["time_us"] == 100.0,
                   "torch_bench run: 1 ms batches over 4 calls (eager) and 2 replays x 5 calls (graph)")
            expect(run["library"]["name"] == "nccl" and run["library"]["served"] == "NCCL 2.28.9",
                   "torch_bench run: PyTorch's NCCL told without the shim")
            expect(any(line.split()[:4] == ["all_reduce", "eager", "1024", "250.0"] for line in text.splitlines()),
                   "torch_bench run: a table line per row")
            code, run, _ = results["broken"]
            bad = [r for r in run["rows"] if r["check"] != "ok"]
            expect(code == 1 and len(bad) == 6 and all(r["collective"] == "all_gather" for r in bad)
                   and "got -1" in bad[0]["check"], "torch_bench run: an all_gather that writes nothing fails its check")
            code, run, _ = results["nograph"]
            expect(code == 1 and len(run["rows"]) == 9 and len(run["skipped"]) == 9
                   and "capture refused" in run["skipped"][0]["why"], "torch_bench run: a refused capture is not measured")
            (_, failed), _ = quiet(tb.compare, results["good"][1], results["broken"][1])
            expect(len(failed) == 6, "torch_bench: run files compare")
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for k, v in saved_mods.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


# A torchrun standing in for the real one under `gpu-run.sh nccl bench`: it logs how it was
# called and writes a run file as torch_bench.py would, from the shim when LD_PRELOAD names it.
FAKE_TORCHRUN = r'''#!/usr/bin/env python3
import json, os, sys
a = sys.argv[1:]
pre = os.environ.get("LD_PRELOAD", "")
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"args": a, "preload": pre, "nvls": os.environ.get("NCCL_NVLS_ENABLE")}) + "\n")
ours = pre.endswith("libmscclpp_nccl.so")
t = 2.4 if ours else 11.05
if "--json" in a:
    json.dump({"library": {"name": "mscclpp" if ours else "nccl", "served": "x"}, "rows": [
        {"collective": "all_reduce", "mode": "graph", "size_bytes": 1024, "time_us": t, "busbw_gbs": 1024 / t / 1e3,
         "check": "ok"}]}, open(a[a.index("--json") + 1], "w"))
'''


def fake_gpu_dir(d):
    """A fake torchrun and nvidia-smi on PATH, and .gpu/ with the shim's name and the timing
    scripts; returns the environment that runs gpu-run.sh against them."""
    bin_dir, gpu = os.path.join(d, "bin"), os.path.join(d, ".gpu")
    os.makedirs(bin_dir)
    os.makedirs(os.path.join(gpu, "lib"))
    for name, text in (("torchrun", FAKE_TORCHRUN), ("nvidia-smi", "#!/bin/sh\necho 'GPU 0: fake'\necho 'GPU 1: fake'\n")):
        with open(os.path.join(bin_dir, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(bin_dir, name), 0o755)
    open(os.path.join(gpu, "lib", "libmscclpp_nccl.so"), "w").close()
    for script in ("torch_bench.py", "host_cost.py"):
        with open(os.path.join(ROOT, "nccl/scripts", script)) as f, open(os.path.join(gpu, script), "w") as g:
            g.write(f.read())
    return dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], OUT=os.path.join(d, "out"),
                FAKE_LOG=os.path.join(d, "calls.log"), TORCH_BENCH_TIMEOUT="60", PYTHONDONTWRITEBYTECODE="1")


def gpu_run_hostcost_test():
    with tempfile.TemporaryDirectory() as d:
        env = fake_gpu_dir(d)
        p = subprocess.run(["bash", os.path.join(ROOT, "scripts/gpu-run.sh"), "nccl", "hostcost", "--sizes", "1K"],
                           cwd=d, env=env, capture_output=True, text=True)
        with open(env["FAKE_LOG"]) as f:
            calls = [json.loads(line) for line in f]
        expect(p.returncode == 0 and len(calls) == 2 and calls[0]["preload"] == ""
               and calls[1]["preload"] == os.path.join(d, ".gpu/lib/libmscclpp_nccl.so")
               and all(c["args"][-3:] == [".gpu/host_cost.py", "--sizes", "1K"] for c in calls)
               and calls[0]["args"][1] != calls[1]["args"][1],
               f"gpu-run.sh nccl hostcost: PyTorch's NCCL, then the shim, options passed on ({p.returncode})")
        open(env["FAKE_LOG"], "w").close()
        p = subprocess.run(["bash", os.path.join(ROOT, "scripts/gpu-run.sh"), "nccl", "hostcost"],
                           cwd=d, env=dict(env, NRANKS="4"), capture_output=True, text=True)
        with open(env["FAKE_LOG"]) as f:
            calls = [json.loads(line) for line in f]
        expect(p.returncode == 0 and len(calls) == 1 and calls[0]["preload"].endswith("libmscclpp_nccl.so")
               and "NCCL refuses ranks sharing a GPU" in p.stdout,
               "gpu-run.sh nccl hostcost, 4 ranks on 2 GPUs: the shim only, PyTorch's NCCL left out by name")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "nccl/scripts/host_cost.py"), "--help"],
                       cwd=os.path.join(ROOT, "nccl/scripts"), capture_output=True, text=True)
    expect(p.returncode == 0 and "torch host" in p.stdout, "host_cost.py --help without torch")


FAKE_FAULT_INJECT = r'''#!/usr/bin/env python3
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"fault_inject": sys.argv[1:]}) + "\n")
'''


def gpu_run_fault_test():
    """The fault-injection check: `gpu-run.sh fault`, and after the whole suite only."""
    with tempfile.TemporaryDirectory() as d:
        env = fake_gpu_dir(d)
        with open(os.path.join(d, ".gpu", "fault-inject.py"), "w") as f:
            f.write(FAKE_FAULT_INJECT)
        shutil.copy(os.path.join(ROOT, "scripts/gpu-run.sh"), os.path.join(d, ".gpu", "gpu-run.sh"))

        def run(args, **extra):
            open(env["FAKE_LOG"], "w").close()
            p = subprocess.run(["bash", ".gpu/gpu-run.sh"] + args, cwd=d, env=dict(env, **extra),
                               capture_output=True, text=True)
            with open(env["FAKE_LOG"]) as f:
                return p.returncode, [json.loads(line) for line in f]

        code, calls = run(["fault"])
        fi = [c["fault_inject"] for c in calls if "fault_inject" in c]
        expect(code == 0 and len(fi) == 1 and fi[0][fi[0].index("--ranks") + 1] == "2"
               and fi[0][fi[0].index("--mps") + 1] == "0" and "port" in fi[0][fi[0].index("--workloads") + 1],
               f"gpu-run.sh fault: one fault-inject run of 2 ranks (2 GPUs here: {fi})")
        code, calls = run(["suite"], NRANKS="4")
        order = ["suite" if "args" in c else "fault" for c in calls]
        fi = [c["fault_inject"] for c in calls if "fault_inject" in c]
        expect(code == 0 and order == ["suite", "fault"] and fi[0][fi[0].index("--ranks") + 1] == "4"
               and fi[0][fi[0].index("--parallel-ranks") + 1] == "4",
               f"gpu-run.sh suite: the suite, then the fault check at its world size, one world at a time ({order})")
        for args in (["suite", "--quick"], ["suite", "--only", "plans"]):
            code, calls = run(args)
            expect(code == 0 and not any("fault_inject" in c for c in calls),
                   f"gpu-run.sh {' '.join(args)}: no fault check")
        code, calls = run(["suite"], HOSTS="2", NRANKS="4")
        expect(not any("fault_inject" in c for c in calls), "gpu-run.sh suite with HOSTS: no fault check")


def gpu_run_bench_test():
    with tempfile.TemporaryDirectory() as d:
        env = fake_gpu_dir(d)
        log, out = env["FAKE_LOG"], env["OUT"]
        p = subprocess.run(["bash", os.path.join(ROOT, "scripts/gpu-run.sh"), "nccl", "bench", "--collectives", "all_reduce"],
                           cwd=d, env=env, capture_output=True, text=True)
        with open(log) as f:
            calls = [json.loads(line) for line in f]
        expect(p.returncode == 0, f"gpu-run.sh nccl bench: exit 0 ({p.returncode}: {p.stderr[-300:]})")
        expect(len(calls) == 2 and calls[0]["preload"] == "" and calls[1]["preload"] == os.path.join(d, ".gpu/lib/libmscclpp_nccl.so"),
               "gpu-run.sh nccl bench: PyTorch's NCCL first, then the shim preloaded")
        expect(all(c["nvls"] == "0" and c["args"][-2:] == ["--collectives", "all_reduce"] for c in calls),
               "gpu-run.sh nccl bench: NVLS off, extra options passed on")
        expect(calls[0]["args"][1] != calls[1]["args"][1], "gpu-run.sh nccl bench: a master port each")
        md = os.path.join(out, "torch-compare.md")
        expect(os.path.exists(md) and "| 1K | 2.40 | 11.05 | 0.22 |" in open(md).read()
               and os.path.exists(os.path.join(out, "nccl-bench.log")), "gpu-run.sh nccl bench: comparison and log written")


# ---------------------------------------------------------------- plan-bench.py

FAKE_BENCH = r'''#!/usr/bin/env python3
import json, sys, time
a = sys.argv[1:]
opt = lambda f, d=None: a[a.index(f) + 1] if f in a else d
name = opt("--algo", "auto")
if name == "hang_plan":
    time.sleep(60)
lo, hi, c = int(opt("-b")), int(opt("-e")), opt("-c")
where = "in_place" if "--inplace-only" in a else "out_of_place"
other = "out_of_place" if where == "in_place" else "in_place"
cap = 64 << 10 if name == "short_plan" else (1 << 64) - 1
rows, s = [], lo
while s <= hi:
    native = 2.0 + s / 4e5
    inp = s // 2 if c == "allgather" else s
    t = native * (1.05 if name == "good_plan" else 1.3 if name == "slow_plan" and s >= 1 << 20 else 1.0)
    m = {"time_us": t, "algbw_gbs": s / t / 1e3, "busbw_gbs": s / t / 1e3, "wrong": 0}
    if name == "short_plan" and inp > cap:
        out = {"skipped": f"plan short_plan: {inp}-byte input outside the plan's range 0..={cap} bytes"}
    else:
        out = {"measured": m}
    algo = name if name != "auto" else ("default_packet" if s < 1 << 20 else "default_zero_copy")
    rows.append({"collective": c, "size_bytes": s, "count": s // 2, "dtype": "bf16", "redop": "sum", "root": -1,
                 "algorithm": algo, where: out, other: "not_requested"})
    s *= 2
report = {"device": "2 x fake GPU", "nccl": "NCCL: not requested", "nranks": 2, "collective": c,
          "mode": "graph (10 calls per graph, 5 replays per batch)", "rows": rows, "total_wrong": 0}
if "--plan" in a:
    report["plans"] = [{"name": name, "collective": c, "world_size": 2, "min_bytes": 0, "max_bytes": cap,
                        "in_place": True}]
json.dump(report, open(opt("--json"), "w"))
if name == "short_plan":  # as the real bench does when some rows ran nothing
    sys.exit("mscclpp-bench: error: 6 of 13 requested rows ran nothing (first: allgather 131072 B ...)")
print("fake bench done")
'''


def plan(name, collective, ranks=2, switch=False):
    chans = [{"channel_type": "memory", "connected_to": [1]}]
    if switch:
        chans.append({"channel_type": "switch", "buffer_type": "i"})
    return {"name": name, "collective": collective, "inplace": True,
            "gpus": [{"id": r, "channels": chans} for r in range(ranks)]}


def plan_bench_tests():
    pb = load("plan_bench", "scripts/plan-bench.py")
    # Beside the repository, as the executor's tests find them (a worktree sits one level deeper).
    candidates = [os.environ.get("MSCCLPP_PLAN_FIXTURES", ""), os.path.join(ROOT, "..", "shared", "fixtures", "plans"),
                  os.path.join(ROOT, "..", "..", "shared", "fixtures", "plans")]
    fixtures = next((c for c in candidates if c and os.path.isdir(c)), candidates[1])
    if os.path.isdir(fixtures):
        chosen, left = pb.select_plans(pb.plan_files(fixtures), 2)
        names = sorted(os.path.basename(p["file"]) for p in chosen)
        left_names = {os.path.basename(f): why for f, why in left}
        expect(len(chosen) == 9 and all("nvls" not in n and "4gpu" not in n for n in names),
               f"fixtures: the 9 non-NVLS 2-GPU plans chosen ({names})")
        expect(left_names.get("reduce_nvls_2gpu.json") == "NVLS (a switch channel)"
               and left_names.get("allreduce_packet_4gpu.json") == "written for 4 ranks", "fixtures: left out, why")
    else:
        print(f"skipped: the fixture plans ({fixtures}) are missing")
    with tempfile.TemporaryDirectory() as d:
        plans = os.path.join(d, "plans")
        os.makedirs(plans)
        for stem, p in (("a_good", plan("good_plan", "allreduce")), ("b_slow", plan("slow_plan", "allreduce")),
                        ("c_short", plan("short_plan", "allgather")), ("d_hang", plan("hang_plan", "allreduce")),
                        ("e_nvls", plan("nvls_plan", "allreduce", switch=True)),
                        ("f_four", plan("four_plan", "allreduce", ranks=4)),
                        ("g_bcast", plan("bcast_plan", "broadcast"))):
            with open(os.path.join(plans, stem + ".json"), "w") as f:
                json.dump(p, f)
        with open(os.path.join(plans, "h_broken.json"), "w") as f:
            f.write("{")
        fake = os.path.join(d, "fake-bench")
        with open(fake, "w") as f:
            f.write(FAKE_BENCH)
        os.chmod(fake, 0o755)
        out = os.path.join(d, "out")
        args = pb.parse_args(["--plans", plans, "--out", out, "--bench", fake, "--launcher", "", "-b", "1K", "-e", "4M",
                              "--run-timeout", "2", "--budget", "60"])
        jobs = pb.jobs_for(args, pb.select_plans(pb.plan_files(plans), 2)[0])
        expect([j["stem"] for j in jobs] == ["native-allreduce-ip", "native-allgather-ip", "plan-a_good", "plan-b_slow",
                                              "plan-c_short", "plan-d_hang"], "plan-bench: one native per collective first")
        cmd = jobs[2]["cmd"]
        expect(cmd[:5] == [fake, "collective", "-c", "allreduce", "-d"] and "--inplace-only" in cmd
               and cmd[-4:] == ["--plan", os.path.join(plans, "a_good.json"), "--algo", "good_plan"]
               and "-G" in cmd and cmd[cmd.index("-G") + 1] == "5", "plan-bench: plan command line")
        expect("--plan" not in jobs[0]["cmd"], "plan-bench: natives run without a plan")
        code, text = quiet(pb.main, ["--plans", plans, "--out", out, "--bench", fake, "--launcher", "", "-b", "1K",
                                     "-e", "4M", "--run-timeout", "2", "--budget", "60"])
        expect(code == 1, "plan-bench: exit 1 (a launch hit its time limit)")
        expect("left out e_nvls.json: NVLS" in text and "left out f_four.json: written for 4 ranks" in text
               and "left out g_bcast.json: collective broadcast" in text and "left out h_broken.json: unreadable" in text,
               "plan-bench: left-out plans named with the reason")
        expect("| good_plan (a_good.json) | allreduce | 0..max | 13 | 1.05 at 1K | met at every size |" in text,
               "plan-bench: a plan within 1.15 at every size")
        expect("| slow_plan (b_slow.json) | allreduce | 0..max | 13 | 1.30 at 1M | NOT MET at 1M, 2M, 4M |" in text,
               "plan-bench: a plan over 1.15 at large sizes")
        expect("| short_plan (c_short.json) | allgather | 0..64K | 8 | 1.00 at 1K | met at every size |" in text,
               "plan-bench: sizes beyond a plan's range left out (allgather: input = size / ranks)")
        expect("| 128K | 2.33 | 2.33 | 1.00 | default_packet |" in text and "| 256K |" not in text.split("#### short_plan")[1],
               "plan-bench: the short plan's table stops at its range")
        expect("| hang_plan (d_hang.json) | allreduce | - | - | - | no results | time limit (2 s): $ " in text
               and "- plan-d_hang: no results: time limit (2 s)" in text, "plan-bench: a hanging plan ended and reported")
        failures = text.split("### FAILURES")[1]
        expect("exit 1: mscclpp-bench: error: 6 of 13 requested rows ran nothing" in text and "c_short" not in failures
               and "a_good" not in failures and "b_slow" not in failures,
               "plan-bench: the bench's exit 1 for rows beyond a plan's range is no failure")
        expect("| 2M | 9.42 | 7.24 | 1.30 | default_zero_copy |" in text.split("#### slow_plan")[1],
               "plan-bench: detail row with the native algorithm")
        with open(os.path.join(out, "plan-bench.md")) as f:
            md = f.read()
        code2, text2 = quiet(pb.main, ["table", out])
        expect(code2 == 1 and text2 == md == text.split("plan-d_hang: time limit (2 s) in")[1].split("\n", 1)[1],
               "plan-bench table: the same tables from the saved run")
        args = pb.parse_args(["--plans", plans, "--out", os.path.join(d, "out2"), "--bench", fake, "--launcher", "",
                              "--budget", "10"])
        code3, text3 = quiet(pb.run, args)
        expect(code3 == 1 and "native-allreduce-ip: not run: 10 s budget spent" in text3
               and "- plan-a_good: no results: not run: 10 s budget spent\n" in text3, "plan-bench: budget respected")


if __name__ == "__main__":
    torch_bench_tests()
    torch_bench_run_test()
    gpu_run_bench_test()
    gpu_run_hostcost_test()
    gpu_run_fault_test()
    plan_bench_tests()
    print(f"bench-tools-test: {len(FAILURES)} failed" if FAILURES else "bench-tools-test: all passed")
    sys.exit(1 if FAILURES else 0)
