#!/usr/bin/env python3
"""Times PyTorch's collectives (backend "nccl") under torchrun, with or without the shim preloaded,
and compares two such runs.

  torchrun --nproc_per_node=N torch_bench.py run [options] --json FILE
  python3 torch_bench.py compare NCCL.json OURS.json [--out FILE]

`run` times all_reduce, all_gather_into_tensor and reduce_scatter_tensor (bf16 by default) at every
power of two from --min to --max bytes, in two modes:
  eager  back-to-back calls on the current stream between two CUDA events, --iters calls a batch;
  graph  --graph-calls calls captured in one torch.cuda.graph, replayed --graph-replays times a
         batch; the time per call is the batch's time / (replays x calls).
Each mode runs --batches timed batches after --warmup untimed calls (or replays); a rank's time
is its median batch, the reported time the mean over ranks (as mscclpp-bench reports it). Sizes
are nccl-tests': the larger of input and output (all_gather: the gathered output, reduce_scatter:
the whole input); busbw uses nccl-tests' factors (all_reduce 2(n-1)/n, the others (n-1)/n).
Once per size and mode, before timing, the result of a call on known inputs is checked on the GPU:
rank r contributes (r+1) + (i mod 8) at element i (all_gather: 16 r + (i mod 8)), small integers
that bf16 holds exactly, so sums are checked exactly. In graph mode the check replays the
graph once (all_reduce is in place, so its k calls scale the sum by n^(k-1)). Timed all_reduce
calls run on zeros, which stay zeros.
A row that raises (say a graph capture the library refuses) is recorded as not measured, with the
error, and the run goes on. Rank 0 prints one table line per measurement as it goes and rewrites
the JSON after each, so a run cut by a time limit still leaves what it measured. The library that served the calls is told from
the process itself: the shim exports mscclppGetVersion (found through ctypes when it is preloaded),
and /proc/self/maps lists the NCCL libraries mapped.

`compare` pairs the rows of two `run` files (PyTorch's NCCL and the shim; which is which comes
from their `library` field, else the order given) and prints, per collective and mode, a Markdown
table: time, ratio ours/NCCL, busbw of both, the checks, and the targets of issue #22 (graph
all_reduce at 1 KiB <= 2.5 us; eager <= 0.6 x NCCL's time up to 1 MiB; busbw >= NCCL's from
2 MiB), then a summary of the targets. It exits 1 when a correctness check failed in either run
or a row could not be measured (an error, listed under the tables); targets not met are results,
not failures. It needs neither torch nor a GPU.
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
import time

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
MODES = ("eager", "graph")
DTYPES = ("bf16", "f32")
# Targets of issue #22, item 1.
GRAPH_1K_TARGET_US = 2.5
EAGER_RATIO_TARGET = 0.6
EAGER_RATIO_UP_TO = 1 << 20
BUSBW_FROM = 2 << 20


def parse_size(text):
    """`1024`, `4K`, `128M`, `1G` (powers of 1024, as nccl-tests and mscclpp-bench read them)."""
    t = text.strip()
    shift = {"K": 10, "M": 20, "G": 30}.get(t[-1:].upper(), 0)
    digits = t[:-1] if shift else t
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"size {text!r} is not a number with an optional K, M or G")
    return int(digits) << shift


def parse_list(allowed):
    def parse(text):
        items = [p.strip() for p in text.split(",") if p.strip()]
        if text.strip() == "all":
            return list(allowed)
        bad = [p for p in items if p not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(allowed)}")
        return items
    return parse


def positive(text):
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return n


def parse_args(argv):
    p = argparse.ArgumentParser(prog="torch_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="time the collectives (under torchrun)")
    r.add_argument("--collectives", type=parse_list(COLLECTIVES), default=list(COLLECTIVES),
                   help="comma-separated, or all (default all)")
    r.add_argument("--modes", type=parse_list(MODES), default=list(MODES), help="eager,graph (default both)")
    r.add_argument("--dtype", choices=DTYPES, default="bf16")
    r.add_argument("-b", "--min", type=parse_size, default=1 << 10, help="smallest size (default 1K)")
    r.add_argument("-e", "--max", type=parse_size, default=1 << 30, help="largest size (default 1G)")
    r.add_argument("-n", "--iters", type=positive, default=20, help="eager calls per batch (default 20)")
    r.add_argument("-w", "--warmup", type=positive, default=5, help="untimed calls or replays first (default 5)")
    r.add_argument("-m", "--batches", type=positive, default=5, help="timed batches, median taken (default 5)")
    r.add_argument("-k", "--graph-calls", type=positive, default=20, help="calls captured per graph (default 20)")
    r.add_argument("-G", "--graph-replays", type=positive, default=10, help="replays per batch (default 10)")
    r.add_argument("--json", required=True, help="results file (rewritten after every measurement)")
    c = sub.add_parser("compare", help="compare two run files (no torch needed)")
    c.add_argument("first", help="a run file (PyTorch's NCCL, unless its library field says otherwise)")
    c.add_argument("second", help="a run file (the shim, unless its library field says otherwise)")
    c.add_argument("--out", help="also write the tables into this file")
    args = p.parse_args(argv)
    if args.command == "run":
        if args.min < 1 or args.min > args.max:
            p.error(f"--min {args.min} must be at least 1 and at most --max {args.max}")
    return args


def sizes(lo, hi):
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def bus_factor(collective, n):
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def busbw(collective, size, n, time_us):
    """nccl-tests' bus bandwidth in GB/s (10^9 B/s)."""
    return size / (time_us * 1e-6) / 1e9 * bus_factor(collective, n) if time_us > 0 else 0.0


def fmt_size(b):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return str(b)


def fmt_bw(row):
    return "-" if not row else f"{row['busbw_gbs']:.2f}"


def fmt_us(t):
    return "-" if t is None else f"{t:.0f}" if t >= 10000 else f"{t:.1f}" if t >= 100 else f"{t:.2f}"


# ---------------------------------------------------------------- compare (no torch)

def is_ours(run):
    return run.get("library", {}).get("name") == "mscclpp"


def pick_sides(a, b):
    """(nccl, ours, note): by the files' library fields when exactly one is the shim, else as given."""
    if is_ours(a) != is_ours(b):
        return (b, a, "") if is_ours(a) else (a, b, "")
    which = "both" if is_ours(a) else "neither"
    return a, b, f"note: {which} file says the shim served; taking the first as NCCL, the second as ours\n"


def targets_for(collective, mode, size, ours, nccl, ratio):
    """The issue's targets that apply to one row, each as (name, met or None when unmeasured)."""
    out = []
    if collective == "all_reduce" and mode == "graph" and size == 1 << 10:
        out.append((f"<= {GRAPH_1K_TARGET_US} us", None if ours is None else ours["time_us"] <= GRAPH_1K_TARGET_US))
    if mode == "eager" and size <= EAGER_RATIO_UP_TO:
        out.append((f"<= {EAGER_RATIO_TARGET} x NCCL", None if ratio is None else ratio <= EAGER_RATIO_TARGET))
    if size >= BUSBW_FROM:
        met = None if ours is None or nccl is None else ours["busbw_gbs"] >= nccl["busbw_gbs"]
        out.append(("busbw >= NCCL", met))
    return out


def verdict(met):
    return "n/a" if met is None else "met" if met else "NOT MET"


def compare(a, b):
    """Returns (text, failed_checks): Markdown tables and the target summary."""
    nccl, ours, text = pick_sides(a, b)
    key = lambda r: (r["collective"], r["mode"], r["size_bytes"])
    rows_n = {key(r): r for r in nccl.get("rows", [])}
    rows_o = {key(r): r for r in ours.get("rows", [])}
    lines = [text] if text else []
    for name, run in (("NCCL", nccl), ("ours", ours)):
        lib = run.get("library", {})
        lines.append(f"- {name}: {lib.get('served', '?')}; {run.get('device', '?')}; torch {run.get('torch', '?')}, "
                     f"{run.get('world_size', '?')} ranks, {run.get('dtype', '?')}")
    opts = ours.get("options", {})
    lines.append(f"- options: {' '.join(f'{k}={v}' for k, v in sorted(opts.items()))}")
    failed, summary = [], {}
    order = sorted(set(rows_n) | set(rows_o),
                   key=lambda k: (COLLECTIVES.index(k[0]) if k[0] in COLLECTIVES else 9,
                                  MODES.index(k[1]) if k[1] in MODES else 9, k[2]))
    current = None
    for k in order:
        collective, mode, size = k
        if (collective, mode) != current:
            current = (collective, mode)
            lines += ["", f"### {collective}, {mode}", "",
                      "| size | ours µs | NCCL µs | ratio | ours busbw GB/s | NCCL busbw GB/s | check | targets |",
                      "|---|---|---|---|---|---|---|---|"]
        o, n = rows_o.get(k), rows_n.get(k)
        ratio = o["time_us"] / n["time_us"] if o and n and n["time_us"] > 0 else None
        checks = []
        for side, r in (("ours", o), ("NCCL", n)):
            if r and r.get("check") != "ok":
                checks.append(f"{side}: {r.get('check')}")
                failed.append(f"{collective} {mode} {fmt_size(size)} {side}: {r.get('check')}")
        tg = targets_for(collective, mode, size, o, n, ratio)
        for t, met in tg:
            summary.setdefault((t, collective, mode), []).append((size, met))
        lines.append(
            f"| {fmt_size(size)} | {fmt_us(o and o['time_us'])} | {fmt_us(n and n['time_us'])} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} | {fmt_bw(o)} | {fmt_bw(n)} | {'; '.join(checks) or 'ok'} | "
            f"{', '.join(f'{t}: {verdict(m)}' for t, m in tg) or '-'} |")
    lines += ["", "### targets (issue #22, item 1)", ""]
    for (t, collective, mode), results in summary.items():
        missed = [fmt_size(s) for s, m in results if m is False]
        unmeasured = [fmt_size(s) for s, m in results if m is None]
        state = "NOT MET at " + ", ".join(missed) if missed else "met" if not unmeasured else "not measured"
        if unmeasured and missed:
            state += "; not measured at " + ", ".join(unmeasured)
        elif unmeasured and len(unmeasured) < len(results):
            state = "met where measured; not measured at " + ", ".join(unmeasured)
        counted = f"{len(missed)} of {len(results)} sizes" if missed else f"{len(results)} sizes"
        lines.append(f"- {collective} {mode}, {t}: {state} ({counted})")
    for side, run in (("NCCL", nccl), ("ours", ours)):
        for r in run.get("skipped", []):
            failed.append(f"{r['collective']} {r['mode']} {fmt_size(r['size_bytes'])} {side}: not measured: {r['why']}")
    if failed:
        lines += ["", "### FAILED CHECKS AND ROWS NOT MEASURED", ""] + [f"- {f}" for f in failed]
    return "\n".join(lines) + "\n", failed


def compare_main(args):
    runs = []
    for path in (args.first, args.second):
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"compare: {path}: {e} (did that run start?)", file=sys.stderr)
            return 1
    a, b = runs
    text, failed = compare(a, b)
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 1 if failed else 0


# ---------------------------------------------------------------- run (torch, under torchrun)

def library():
    """Which library serves the process's NCCL calls: the shim when its own symbol is visible."""
    info = {"preload": os.environ.get("LD_PRELOAD", "")}
    try:
        import torch
        v = torch.cuda.nccl.version()
        info["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # the version is information, not a reason to stop
        info["nccl_version"] = f"unknown ({e})"
    try:
        with open("/proc/self/maps") as f:
            info["mapped"] = sorted({line.split()[-1] for line in f if "nccl" in line.split()[-1]})
    except OSError:
        info["mapped"] = []
    try:
        fn = ctypes.CDLL(None).mscclppGetVersion
        v = ctypes.c_int(0)
        fn(ctypes.byref(v))
        info["name"] = "mscclpp"
        info["served"] = (f"mscclpp-rs NCCL shim {v.value // 10000}.{v.value // 100 % 100}.{v.value % 100} "
                          f"(NCCL ABI {info['nccl_version']})")
    except AttributeError:
        info["name"] = "nccl"
        info["served"] = f"NCCL {info['nccl_version']}"
    return info


class Bench:
    def __init__(self, args):
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.args = torch, dist, args
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        self.dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(self.dev)
        try:
            dist.init_process_group("nccl", device_id=self.dev)
        except TypeError:  # torch before 2.3 has no device_id
            dist.init_process_group("nccl")
        # Times and verdicts travel over gloo: the library under test carries only timed calls.
        self.cpu = dist.new_group(backend="gloo")
        self.dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
        self.esize = torch.tensor([], dtype=self.dtype).element_size()
        self.rows, self.skipped = [], []
        props = torch.cuda.get_device_properties(self.dev)
        self.header = {
            "tool": "torch_bench", "library": library(), "torch": torch.__version__,
            "device": f"{self.world} ranks, {props.name} ({props.total_memory >> 30} GiB), CUDA {torch.version.cuda}",
            "world_size": self.world, "dtype": args.dtype,
            "options": {k: getattr(args, k) for k in ("min", "max", "iters", "warmup", "batches", "graph_calls",
                                                      "graph_replays")},
        }

    # Inputs, outputs and the expected result of one call at `size` bytes (None: no whole element
    # per rank at this size).
    def buffers(self, collective, size):
        torch, n, r = self.torch, self.world, self.rank
        count = size // self.esize
        if count % (8 * n):
            return None
        per = count // n
        pat = lambda c: torch.arange(8, device=self.dev).to(self.dtype).repeat(c // 8)
        total = n * (n + 1) // 2
        if collective == "all_reduce":
            x = pat(count) + (r + 1)
            want = pat(count) * n + total
            return x, x, want
        if collective == "all_gather":
            x = pat(per) + 16 * r
            out = torch.empty(count, dtype=self.dtype, device=self.dev)
            want = torch.cat([pat(per) + 16 * q for q in range(n)])
            return x, out, want
        x = pat(count) + (r + 1)
        out = torch.empty(per, dtype=self.dtype, device=self.dev)
        want = pat(per) * n + total  # chunk r starts at a multiple of 8, so its pattern restarts
        return x, out, want

    def call(self, collective, x, out):
        d = self.dist
        if collective == "all_reduce":
            d.all_reduce(x)
        elif collective == "all_gather":
            d.all_gather_into_tensor(out, x)
        else:
            d.reduce_scatter_tensor(out, x)

    def verdict(self, got, want, scale=1):
        if scale == 1:
            bad = (got != want).nonzero()
        else:  # n^(k-1) is inexact for n not a power of two: bf16's half step, relatively
            want = want.float() * scale
            bad = ((got.float() - want).abs() > want.abs() * 2.0 ** -7).nonzero()
        if bad.numel() == 0:
            return "ok"
        i = bad[0].item()
        return f"{bad.numel()} of {got.numel()} wrong, first at {i}: got {got[i].item()}, want {want[i].item()}"

    def timed(self, launch, per_batch, warmup):
        torch = self.torch
        for _ in range(warmup):
            launch()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.args.batches):
            # Ranks start each batch together (host-side barrier over gloo, after the GPU drains).
            self.dist.barrier(group=self.cpu)
            start.record()
            for _ in range(per_batch):
                launch()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def measure(self, collective, mode, size):
        torch, a = self.torch, self.args
        bufs = self.buffers(collective, size)
        if bufs is None:
            return None, "no whole 8-element pattern per rank at this size"
        x, out, want = bufs
        got = x if collective == "all_reduce" else out
        # Outputs start poisoned, so a call (or replay) that writes nothing fails its check
        # (all_reduce works in place: its input already differs from the result).
        poison = (lambda: None) if collective == "all_reduce" else (lambda: out.fill_(-1))
        if mode == "eager":
            poison()
            self.call(collective, x, out)
            torch.cuda.synchronize()
            check = self.verdict(got, want)
            if collective == "all_reduce":
                x.zero_()
            med = self.timed(lambda: self.call(collective, x, out), a.iters, a.warmup)
            return med / a.iters, check
        # Capture on a side stream after a few calls there (PyTorch's recipe for NCCL in graphs).
        seed = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.call(collective, x, out)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(a.graph_calls):
                self.call(collective, x, out)
        x.copy_(seed)
        poison()
        g.replay()
        torch.cuda.synchronize()
        scale = self.world ** (a.graph_calls - 1) if collective == "all_reduce" else 1
        check = self.verdict(got, want, scale)
        if collective == "all_reduce":
            x.zero_()
        med = self.timed(g.replay, a.graph_replays, a.warmup)
        del g
        return med / (a.graph_replays * a.graph_calls), check

    def run(self):
        a = self.args
        if self.rank == 0:
            lib = self.header["library"]
            print(f"# {lib['served']}; mapped: {', '.join(lib['mapped']) or 'none'}", flush=True)
            print(f"# {self.header['device']}, torch {self.header['torch']}, {a.dtype}", flush=True)
            print(f"# {'collective':>14} {'mode':>5} {'size':>11} {'time us':>9} {'busbw GB/s':>10}  check", flush=True)
        for collective in a.collectives:
            for mode in a.modes:
                for size in sizes(a.min, a.max):
                    try:
                        t, check = self.measure(collective, mode, size)
                    except Exception as e:  # e.g. a capture the library refuses: the next row may run
                        t, check = None, f"error: {type(e).__name__}: {e}"
                        self.torch.cuda.synchronize()
                    per_rank = [None] * self.world
                    self.dist.all_gather_object(per_rank, (t, check), group=self.cpu)
                    if self.rank == 0:
                        self.record(collective, mode, size, per_rank)
        self.dist.barrier(group=self.cpu)
        self.dist.destroy_process_group()
        return 0 if all(r["check"] == "ok" for r in self.rows) and not self.skipped else 1

    def record(self, collective, mode, size, per_rank):
        times = [t for t, _ in per_rank if t is not None]
        wrong = [f"rank {i}: {c}" for i, (_, c) in enumerate(per_rank) if c != "ok"]
        if len(times) < len(per_rank):
            why = "; ".join(wrong)
            self.skipped.append({"collective": collective, "mode": mode, "size_bytes": size, "why": why})
            print(f"# {collective:>14} {mode:>5} {size:>11} not measured: {why}", flush=True)
        else:
            t = statistics.fmean(times)
            row = {"collective": collective, "mode": mode, "size_bytes": size, "time_us": t,
                   "time_us_ranks": times, "busbw_gbs": busbw(collective, size, self.world, t),
                   "check": "ok" if not wrong else "; ".join(wrong)}
            self.rows.append(row)
            print(f"  {collective:>14} {mode:>5} {size:>11} {fmt_us(t):>9} {row['busbw_gbs']:>10.2f}  "
                  f"{row['check']}", flush=True)
        tmp = self.args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(self.header, rows=self.rows, skipped=self.skipped, written=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
                      f, indent=1)
        os.replace(tmp, self.args.json)


def main(argv):
    args = parse_args(argv)
    if args.command == "compare":
        return compare_main(args)
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
