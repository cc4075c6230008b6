#!/usr/bin/env python3
"""Times every execution plan of a folder that can run here against the native algorithm of the
same collective (issue #22, item 3: plan time <= 1.15 x the native's at every size of the plan's
range), through mscclpp-bench, one launch per plan and one per (collective, buffer mode) for the
natives. Run on the GPU machine from the repository root (gpu-stage.sh copies it into .gpu/):

  python3 .gpu/plan-bench.py [--plans .gpu/plans] [--ranks 2] [-d bf16] [-b 1K] [-e 1G] [-G 5]
  python3 .gpu/plan-bench.py table OUT   (the tables again, from OUT/plan-bench.json)

Plans are left out, with the reason printed, when written for another world size, when they use
a switch (NVLink multicast) channel, or when their collective is not one the bench measures. Each
plan runs as `mscclpp-bench collective -c C --plan FILE --algo NAME` in its own buffer mode (the
fixtures are in place); the natives run under the default selector (`--algo auto`, no plan) with
the same options. Sizes come from -b/-e; the bench skips those outside the range a plan takes
here (its JSON's `plans` entry: the file's range capped by the scratch), and the table leaves
them out. Graph mode (-G > 0, the default) times the GPU's work; -G 0 times eager calls.

Each launch is bounded by --run-timeout and the whole by --budget seconds (launches that no
longer fit are reported as not run). Writes into --out (default $OUT, else ./gpu-out/plans):
one JSON and one log per launch, plan-bench.json (what ran, for `table`) and plan-bench.md (the
tables, also printed). NVLink multicast stays off (the variables of gpu-run.sh). Exits 1 when a
size inside a plan's range went unmeasured (a skip, a crash, a time limit) or an element was
wrong; targets not met are results, not failures."""
import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

TARGET = 1.15
# The bench's names for the collectives it measures (mscclpp-bench collective -c).
BENCH_COLLECTIVES = ("allreduce", "allgather", "reducescatter")
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "MSCCLPP_FORCE_DISABLE_NVLS": "1",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_LAUNCHER = "torchrun --no-python --nproc_per_node={ranks} --master_port={port}"

# Sizes and numbers are read and written as torch_bench.py does (beside this file in .gpu/, in
# nccl/scripts/ of the repository; it imports torch only when it runs collectives).
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "nccl", "scripts")]
from torch_bench import fmt_bw, fmt_size, fmt_us, parse_size  # noqa: E402


def parse_args(argv):
    if argv[:1] == ["table"]:
        p = argparse.ArgumentParser(prog="plan-bench.py table")
        p.add_argument("out", help="the --out folder of an earlier run")
        args = p.parse_args(argv[1:])
        args.command = "table"
        return args
    p = argparse.ArgumentParser(prog="plan-bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", default=".gpu/plans", help="a plan file or a folder of them")
    p.add_argument("--ranks", type=int, default=2, help="ranks, one per GPU (default 2)")
    p.add_argument("-d", "--datatype", default="bf16")
    p.add_argument("-b", "--minbytes", type=parse_size, default=1 << 10)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=1 << 30)
    p.add_argument("-G", "--cudagraph", type=int, default=5, help="graph replays per batch, 0: eager (default 5)")
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("-m", "--batches", type=int, default=5)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--run-timeout", type=int, default=120, help="seconds per launch (default 120)")
    p.add_argument("--budget", type=int, default=420, help="seconds for every launch together (default 420)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "./gpu-out"), "plans"))
    p.add_argument("--bench", default=".gpu/bin/mscclpp-bench")
    p.add_argument("--launcher", default=DEFAULT_LAUNCHER,
                   help="command before the bench ({ranks}, {port} filled in; empty: none)")
    p.add_argument("--port", type=int, default=29611, help="first master port (one more per launch)")
    args = p.parse_args(argv)
    args.command = "run"
    if args.minbytes < 1 or args.minbytes > args.maxbytes:
        p.error(f"-b {args.minbytes} must be at least 1 and at most -e {args.maxbytes}")
    return args


def plan_files(path):
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".json"))
    return [path]


def select_plans(files, ranks):
    """(chosen, left_out): chosen as dicts (file, name, collective, in_place), left_out as
    (file, reason)."""
    chosen, left_out = [], []
    for f in files:
        try:
            with open(f) as fh:
                plan = json.load(fh)
            gpus, name, collective = plan["gpus"], plan["name"], plan["collective"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            left_out.append((f, f"unreadable: {e}"))
            continue
        switch = any(c.get("channel_type") == "switch" for g in gpus for c in g.get("channels", []))
        if len(gpus) != ranks:
            left_out.append((f, f"written for {len(gpus)} ranks"))
        elif switch:
            left_out.append((f, "NVLS (a switch channel)"))
        elif collective not in BENCH_COLLECTIVES:
            left_out.append((f, f"collective {collective}: the bench measures {', '.join(BENCH_COLLECTIVES)}"))
        else:
            chosen.append({"file": f, "name": name, "collective": collective,
                           "in_place": bool(plan.get("inplace", True))})
    return chosen, left_out


def placement(in_place):
    return "in_place" if in_place else "out_of_place"


def bench_args(args, collective, in_place, json_path, plan=None):
    cmd = [args.bench, "collective", "-c", collective, "-d", args.datatype,
           "-b", str(args.minbytes), "-e", str(args.maxbytes), "-n", str(args.iters),
           "-m", str(args.batches), "-w", str(args.warmup), "-G", str(args.cudagraph),
           "--inplace-only" if in_place else "--outofplace-only", "--json", json_path]
    if plan:
        cmd += ["--plan", plan["file"], "--algo", plan["name"]]
    return cmd


def jobs_for(args, plans):
    """The launches: one native per (collective, buffer mode) the plans need, then each plan."""
    jobs, natives = [], []
    for p in plans:
        key = (p["collective"], p["in_place"])
        if key not in natives:
            natives.append(key)
    for collective, in_place in natives:
        stem = f"native-{collective}-{'ip' if in_place else 'oop'}"
        jobs.append({"kind": "native", "stem": stem, "collective": collective, "in_place": in_place})
    for p in plans:
        stem = "plan-" + os.path.splitext(os.path.basename(p["file"]))[0]
        jobs.append(dict(p, kind="plan", stem=stem))
    for j in jobs:
        j["json"] = os.path.join(args.out, j["stem"] + ".json")
        j["log"] = os.path.join(args.out, j["stem"] + ".log")
        j["cmd"] = bench_args(args, j["collective"], j["in_place"], j["json"], j if j["kind"] == "plan" else None)
    return jobs


def launch(args, job, port, seconds):
    """Runs one launch under `seconds`; returns (exit code or a reason, seconds taken)."""
    prefix = shlex.split(args.launcher.format(ranks=args.ranks, port=port)) if args.launcher else []
    env = dict(os.environ, **NVLS_OFF)
    env.pop("MSCCLPP_ENABLE_NVLS", None)
    env.setdefault("MSCCLPP_CACHE_DIR", "/tmp/mscclpp-cache")
    start = time.monotonic()
    with open(job["log"], "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in prefix + job["cmd"]) + "\n")
        log.flush()
        # Its own session, so a launch past its time is ended with every rank it started.
        proc = subprocess.Popen(prefix + job["cmd"], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = f"time limit ({seconds} s)"
    return code, time.monotonic() - start


def run(args):
    os.makedirs(args.out, exist_ok=True)
    plans, left_out = select_plans(plan_files(args.plans), args.ranks)
    for f, why in left_out:
        print(f"left out {os.path.basename(f)}: {why}", flush=True)
    if not plans:
        print(f"no plan of {args.plans} runs on {args.ranks} ranks without NVLS", flush=True)
        return 1
    jobs = jobs_for(args, plans)
    manifest = {"options": {k: v for k, v in vars(args).items() if k != "command"},
                "left_out": [{"file": f, "reason": why} for f, why in left_out], "jobs": jobs}
    deadline = time.monotonic() + args.budget
    for i, job in enumerate(jobs):
        left = int(deadline - time.monotonic())
        if left < 15:
            job["status"] = f"not run: {args.budget} s budget spent"
        else:
            code, took = launch(args, job, args.port + i, min(args.run_timeout, left))
            job["status"] = "ok" if code == 0 else f"exit {code}" if isinstance(code, int) else code
            job["seconds"] = round(took, 1)
        print(f"{job['stem']}: {job['status']}" + (f" in {job['seconds']} s" if "seconds" in job else ""), flush=True)
        with open(os.path.join(args.out, "plan-bench.json"), "w") as f:
            json.dump(manifest, f, indent=1)
    return table(args.out)


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def measured(row, where):
    """The row's measurement in `where` (in_place / out_of_place), or (None, skip reason)."""
    o = row.get(where)
    if isinstance(o, dict) and "measured" in o:
        return o["measured"], None
    if isinstance(o, dict) and "skipped" in o:
        return None, o["skipped"]
    return None, "not requested"


def input_bytes(collective, size, ranks):
    """The selector's measure of a row (input bytes per rank) from the bench's size column."""
    return size // ranks if collective == "allgather" else size


def last_line(path):
    try:
        with open(path) as f:
            lines = [line.strip() for line in f if line.strip()]
        return lines[-1] if lines else "(empty log)"
    except OSError:
        return "(no log)"


def requested_sizes(options):
    out, size = [], options["minbytes"]
    while size <= options["maxbytes"]:
        out.append(size)
        size *= 2
    return out


def plan_table(job, native, ranks, sizes):
    """(detail lines, summary cells, failures) for one plan against its native run. Every
    requested size inside the plan's range must be measured on both sides: one that is not (a
    skip, or a run stopped before it) is a failure, and so is a wrong element; a non-zero exit by
    itself is not (the bench also exits 1 when rows outside a plan's range ran nothing)."""
    where = placement(job["in_place"])
    failures = []
    status = job.get("status", "not run")
    run_cell = status if status == "ok" or status.startswith("not run") else f"{status}: {last_line(job['log'])}"
    result = load_json(job["json"])
    if not result:
        failures.append(f"{job['stem']}: no results: {run_cell}")
        return [], ["-", "-", "-", "no results", run_cell], failures
    entry = next((p for p in result.get("plans", []) if p.get("name") == job["name"]), None)
    lo, hi = (entry["min_bytes"], entry["max_bytes"]) if entry else (0, 1 << 64)
    rows = {r["size_bytes"]: r for r in result.get("rows", [])}
    nat_rows = {r["size_bytes"]: r for r in (native or {}).get("rows", [])}
    lines = [f"#### {job['name']} ({os.path.basename(job['file'])}, {job['collective']}, "
             f"{'in place' if job['in_place'] else 'out of place'}; takes {lo}..={hi} input bytes per rank)", "",
             "| size | plan µs | native µs | ratio | native algorithm | plan busbw GB/s | wrong | <= 1.15 |",
             "|---|---|---|---|---|---|---|---|"]
    missed, unmeasured, worst, measured_sizes = [], [], None, 0
    for size in sizes:
        if not lo <= input_bytes(job["collective"], size, ranks) <= hi:
            continue
        row, nrow = rows.get(size), nat_rows.get(size)
        m, why = measured(row, where) if row else (None, f"no row (the plan's run: {status})")
        n, nwhy = measured(nrow, where) if nrow else (None, "no row in the native run")
        ratio = m["time_us"] / n["time_us"] if m and n and n["time_us"] > 0 else None
        wrong = (m["wrong"] if m else 0) + (n["wrong"] if n else 0)
        if wrong:
            failures.append(f"{job['stem']} {fmt_size(size)}: {wrong} wrong elements (plan and native)")
        if ratio is None:
            unmeasured.append(fmt_size(size))
            verdict = f"not measured: {why or nwhy}"
            failures.append(f"{job['stem']} {fmt_size(size)}: {verdict}")
        else:
            measured_sizes += 1
            if worst is None or ratio > worst[0]:
                worst = (ratio, size)
            if ratio > TARGET:
                missed.append(fmt_size(size))
            verdict = "met" if ratio <= TARGET else "NOT MET"
        lines.append(f"| {fmt_size(size)} | {fmt_us(m and m['time_us'])} | {fmt_us(n and n['time_us'])} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {nrow['algorithm'] if nrow else '-'} | "
                     f"{fmt_bw(m)} | {wrong} | {verdict} |")
    if missed:
        verdict = "NOT MET at " + ", ".join(missed)
    elif measured_sizes and not unmeasured:
        verdict = "met at every size"
    elif measured_sizes:
        verdict = "met where measured"
    else:
        verdict = "not measured"
    if unmeasured:
        verdict += "; not measured at " + ", ".join(unmeasured)
    worst_cell = "-" if worst is None else f"{worst[0]:.2f} at {fmt_size(worst[1])}"
    return lines + [""], [f"{fmt_size(lo)}..{fmt_size(hi) if hi < 1 << 63 else 'max'}",
                          str(measured_sizes), worst_cell, verdict, run_cell], failures


def table(out):
    manifest = load_json(os.path.join(out, "plan-bench.json"))
    if not manifest:
        print(f"{out}/plan-bench.json: missing or unreadable", flush=True)
        return 1
    o, jobs = manifest["options"], manifest["jobs"]
    ranks, sizes = o["ranks"], requested_sizes(o)
    natives = {(j["collective"], j["in_place"]): j for j in jobs if j["kind"] == "native"}
    first = next(filter(None, (load_json(j["json"]) for j in jobs)), {})
    lines = [f"device: {first.get('device', '?')}",
             f"`mscclpp-bench collective -d {o['datatype']} -b {fmt_size(o['minbytes'])} -e {fmt_size(o['maxbytes'])} "
             f"-n {o['iters']} -m {o['batches']} -w {o['warmup']} -G {o['cudagraph']}` ({first.get('mode', '?')}), "
             f"{ranks} ranks; ratio = plan time / native time (target <= {TARGET})", ""]
    lines += [f"- left out: {os.path.basename(x['file'])} ({x['reason']})" for x in manifest.get("left_out", [])]
    lines += [f"- native run {j['stem']}: {j.get('status', 'not run')}" for j in natives.values()]
    failures = []
    summary = ["", "| plan | collective | range (input B/rank) | sizes measured | worst ratio | <= 1.15 at every size | run |",
               "|---|---|---|---|---|---|---|"]
    details = []
    for j in jobs:
        if j["kind"] != "plan":
            continue
        native = load_json(natives[(j["collective"], j["in_place"])]["json"])
        d, cells, f = plan_table(j, native, ranks, sizes)
        details += d
        failures += f
        summary.append(f"| {j['name']} ({os.path.basename(j['file'])}) | {j['collective']} | " + " | ".join(cells) + " |")
    lines += summary + [""] + details
    if failures:
        lines += ["### FAILURES", ""] + [f"- {x}" for x in failures]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    with open(os.path.join(out, "plan-bench.md"), "w") as f:
        f.write(text)
    return 1 if failures else 0


def main(argv):
    args = parse_args(argv)
    return table(args.out) if args.command == "table" else run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
