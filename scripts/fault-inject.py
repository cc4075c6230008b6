#!/usr/bin/env python3
"""Fault injection: kill or stop one rank of a running job and check that every other rank fails
fast, with an error naming that rank.

Each run starts N ranks of `mscclpp-bench collective` on this machine's GPU(s) (several ranks share
a GPU when N exceeds the GPUs, optionally under MPS), waits until rank 0 has printed its table
header (communicator and algorithms up) and --settle seconds more (the loop is running, its launch
queue full), or --delay seconds in all when given, then SIGKILLs or SIGSTOPs one rank (the victim).
It passes when every survivor exits non-zero within MSCCLPP_DEVICE_WAIT_TIMEOUT + --slack seconds
of the signal and its error output names the victim ("rank V"). Survivors still running at
--hang-after seconds are killed and the run fails. The liveness timeout (MSCCLPP_LIVENESS_TIMEOUT)
follows MSCCLPP_DEVICE_WAIT_TIMEOUT unless the environment sets it.

Ranks are started directly with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), not under torchrun: torchrun's agent tears the job down itself when one worker dies,
which would hide whether the survivors notice on their own.

Workloads (the bench's options; each run is a long loop the signal lands in):
  eager   allreduce (--size), launched back to back: a deep launch queue behind the failure
  graph   allreduce captured into a CUDA graph of --graph-calls calls, replayed many times
  small   as eager with 1 KiB messages (packet kernels, many launches per second)
  port    PortChannel traffic: port_allreduce (1 MiB, eager), the ranks split into two simulated
          hosts by MSCCLPP_HOSTID (CudaIpc within a half, the Ethernet transport between halves;
          the host proxy threads carry every transfer)

Configurations are every combination of --ranks, --signals, --workloads and --mps (or the
--config list), run one after another (never concurrently: ranks of two jobs sharing the GPU would slow each other and the times
would not be the job's own). --budget S shares S seconds equally among the configurations: each
runs until it has --runs runs or its share is spent (at least one run), so one command fits a
device call's time limit whatever the machine's speed.

Examples (from the repository root on the GPU machine, after scripts/gpu-stage.sh):
  python3 .gpu/fault-inject.py --ranks 2,4 --signals KILL,STOP --workloads eager,graph \
      --mps 0,1 --runs 3
Prints one line per run and a summary table: per configuration the runs passed, the
min/median/max of the slowest survivor's time and when its timed loop stopped (the rest is
draining and teardown), the kind of error the survivors reported (died, stalled, device timeout,
other, ended before the signal) with one example, what became of a stopped victim once
continued, and whether a new process could still create a CUDA context afterwards (MPS health).
Exit status 0 only when every run passed.

A stopped victim is sent SIGCONT once the survivors ended and given as long as they had to end by
itself; only then is it SIGKILLed (killing a stopped MPS client with work queued can leave the
MPS server refusing new clients).

Files (few, so a device call brings them all back): OUT/fault-inject/summary.md (the table),
summary.json (the same, with every run's time), failures.log (every failed run and warm-up, each
rank's log shortened to its first and last lines) and passes.log (one passing run per
configuration). Every rank's whole log stays in the temporary directory printed at the start.
"""

import argparse
import datetime
import json
import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

NVLS_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "MSCCLPP_FORCE_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


WORKLOADS = ("eager", "small", "graph", "port")


def workload_args(name, size, short=False):
    """The bench's arguments; `short` makes a run of a few calls (to fill the kernel cache)."""
    common = ["collective", "-c", "allreduce", "-d", "bf16", "-w", "1", "-m", "1", "--inplace-only"]
    if name == "eager":
        return common + ["-b", size, "-e", size, "-n", "5" if short else "1000000"]
    if name == "small":
        return common + ["-b", "1K", "-e", "1K", "-n", "5" if short else "100000000"]
    if name == "graph":
        return common + ["-b", size, "-e", size, "-n", "20", "-G", "2" if short else "1000000"]
    if name == "port":
        return common + ["-b", "1M", "-e", "1M", "--algo", "port_allreduce",
                         "-n", "5" if short else "1000000"]
    raise SystemExit(f"unknown workload {name!r} ({', '.join(WORKLOADS)})")


def rank_env(workload, rank, nranks):
    """Per-rank variables beyond the launcher's: the port workload's simulated host."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank)}
    if workload == "port":
        env["MSCCLPP_HOSTID"] = f"sim-host-{rank * 2 // nranks}"
    return env


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
        return max(1, len(out.stdout.strip().splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return 1


class Mps:
    """An MPS server for the ranks of one configuration (started fresh, quit afterwards)."""

    def __init__(self, nranks, ngpu, workdir):
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": os.path.join(workdir, "mps-pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(workdir, "mps-log"),
        }
        for d in self.env.values():
            os.makedirs(d, exist_ok=True)
        if nranks > ngpu:
            # Every native kernel needs its whole grid resident: hold each rank to its share.
            self.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 * ngpu // nranks)

    def start(self):
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **self.env}, check=True)

    def stop(self):
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True,
                       env={**os.environ, **self.env}, check=False)
        time.sleep(1)


def gpu_usable(extra_env, wait=15.0):
    """Whether a new process can still create a CUDA context (a killed MPS client, or a fault of
    one, can make the MPS server refuse clients until every client of the GPU exited and it
    recreated its context). Tries for up to `wait` seconds; answers "yes", "yes after N s (first
    error E)" or "NO (error E)", E being the driver's CUresult or the probe's failure."""
    probe = "import ctypes, sys; c = ctypes.CDLL('libcuda.so.1'); r = c.cuInit(0); " \
            "d = ctypes.c_int(); r = r or c.cuDeviceGet(ctypes.byref(d), 0); " \
            "x = ctypes.c_void_p(); r = r or c.cuDevicePrimaryCtxRetain(ctypes.byref(x), d); " \
            "print(r); sys.exit(1 if r else 0)"
    start, first = time.monotonic(), None
    while True:
        try:
            r = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **extra_env},
                               capture_output=True, text=True, timeout=60)
            code = (r.stdout.strip() or r.stderr.strip()[-80:] or str(r.returncode))
            ok = r.returncode == 0
        except subprocess.TimeoutExpired:
            code, ok = "the probe hung for 60 s", False
        waited = time.monotonic() - start
        if ok:
            return "yes" if first is None else f"yes after {waited:.0f} s (first error {first})"
        first = first or code
        if waited >= wait:
            return f"NO (error {code})"
        time.sleep(1.0)


def warm_up(a, nranks, workload, extra_env, port, rundir):
    """One short run without a signal, so the timed runs do not wait for NVRTC. Returns its
    combined log when a rank failed, else None."""
    env = {**os.environ, **NVLS_OFF, **extra_env, "MSCCLPP_CACHE_DIR": a.cache_dir,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(nranks), "LOCAL_WORLD_SIZE": str(nranks)}
    env.pop("MSCCLPP_ENABLE_NVLS", None)
    args = [a.bench] + (a.bench_args.split() if a.bench_args else
                        workload_args(workload, a.size, short=True))
    procs = []
    path = os.path.join(rundir, f"warm-n{nranks}-{workload}.log")
    with open(path, "w") as log:
        for r in range(nranks):
            procs.append(subprocess.Popen(args, env={**env, **rank_env(workload, r, nranks)},
                                          stdout=log, stderr=subprocess.STDOUT))
        for p in procs:
            try:
                p.wait(timeout=300)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if all(p.returncode == 0 for p in procs):
        return None
    with open(path) as log:
        return ANSI.sub("", log.read())


def wait_until_running(a, procs, log0):
    """Returns once the loop the signal must land in runs: --delay seconds after the start when
    given, else --settle seconds after rank 0 printed its table header (the bench prints it once
    the communicator and the algorithms are up), or when a rank ended early."""
    if a.delay > 0 or a.bench_args:
        # Another command prints no bench header: a fixed delay.
        time.sleep(a.delay or 3.0)
        return
    start = time.monotonic()
    while time.monotonic() - start < a.hang_after:
        if any(p.poll() is not None for p in procs):
            return
        log0.seek(0)
        if "# rank 0 thread:" in log0.read():
            break
        time.sleep(0.05)
    time.sleep(a.settle)


def classify(error, early=False):
    """The kind of failure a survivor reported, for the summary."""
    if early:
        return "ended before the signal"
    if "stalled" in error:
        return "stalled"
    if "died" in error:
        return "died"
    if "device-side timeout" in error or "timed out" in error:
        return "timeout"
    return "other"


LOOP_STOPPED = "the timed loop stopped"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z")


def noticed_at(text):
    """Unix time of the bench's warning that its timed loop stopped on the failure (its log lines
    start with a UTC timestamp), or None."""
    for line in text.splitlines():
        if LOOP_STOPPED in line:
            m = STAMP.match(line.strip())
            if m:
                whole, _, frac = m.group(1).partition(".")
                t = datetime.datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S")
                return t.replace(tzinfo=datetime.timezone.utc).timestamp() + float("0." + (frac or "0"))
    return None


def one_run(a, nranks, sig, workload, extra_env, port, rundir, tag):
    """One signalled run. Returns the victim, one verdict per survivor (rank, seconds from the
    signal to its exit, why it failed or None, its last error line, seconds from the signal to
    the moment its loop stopped or None), what became of the victim, and every rank's log."""
    victim = a.victim if a.victim >= 0 else nranks - 1
    env = {**os.environ, **NVLS_OFF, **extra_env,
           "MSCCLPP_DEVICE_WAIT_TIMEOUT": str(a.timeout),
           "MSCCLPP_BOOTSTRAP_TIMEOUT": str(a.bootstrap_timeout),
           "MSCCLPP_CACHE_DIR": a.cache_dir,
           # Warnings carry the timestamps: when the loop stopped, how long the drain took.
           "MSCCLPP_LOG_LEVEL": os.environ.get("MSCCLPP_LOG_LEVEL", "WARN"),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(nranks), "LOCAL_WORLD_SIZE": str(nranks)}
    env.pop("MSCCLPP_ENABLE_NVLS", None)
    args = [a.bench] + (a.bench_args.split() if a.bench_args else workload_args(workload, a.size))
    procs, logs = [], []
    for r in range(nranks):
        log = open(os.path.join(rundir, f"{tag}.rank{r}.log"), "w+")
        procs.append(subprocess.Popen(args, env={**env, **rank_env(workload, r, nranks)},
                                      stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    wait_until_running(a, procs, logs[0])
    early = [r for r, p in enumerate(procs) if p.poll() is not None]
    sent, sent_wall = time.monotonic(), time.time()
    if not early:
        os.kill(procs[victim].pid, SIGNALS[sig])
    survivors = [r for r in range(nranks) if r != victim]
    ended = {}
    while len(ended) < len(survivors) and time.monotonic() - sent < a.hang_after:
        for r in survivors:
            if r not in ended and procs[r].poll() is not None:
                ended[r] = time.monotonic() - sent
        time.sleep(0.01)
    # A stopped victim is continued and given the time a survivor gets to end by itself: a
    # SIGKILL of a stopped MPS client whose kernels are still queued or running can leave the
    # MPS server refusing every later client (seen after 2-rank STOP graph runs on an H100).
    # Continued, it finds its peers gone (bootstrap), aborts, drains and exits on its own.
    victim_end = "killed by the signal" if sig == "KILL" else "-"
    if sig == "STOP" and not early:
        procs[victim].send_signal(signal.SIGCONT)
        continued = time.monotonic()
        try:
            procs[victim].wait(timeout=a.timeout + a.slack)
            victim_end = f"continued, exited by itself in {time.monotonic() - continued:.2f} s"
        except subprocess.TimeoutExpired:
            victim_end = f"continued, still running after {a.timeout + a.slack} s: SIGKILLed"
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    named = re.compile(rf"\brank {victim}\b")
    budget = a.timeout + a.slack
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(ANSI.sub("", log.read()))
        log.close()
    verdicts = []
    for r in survivors:
        text = texts[r]
        # The bench's last word: "mscclpp-bench (rank R): error: ...".
        errors = [l for l in text.splitlines() if ": error:" in l]
        last = errors[-1] if errors else (text.strip().splitlines() or [""])[-1]
        last = re.sub(r"^mscclpp-bench \(rank \d+\): error: ", "", last)
        t = ended.get(r)
        noticed = noticed_at(text)
        noticed = None if noticed is None or early else noticed - sent_wall
        if early:
            why = f"rank(s) {early} ended before the signal"
        elif t is None:
            why = f"still running after {a.hang_after} s (hang)"
        elif procs[r].returncode == 0:
            why = "exited 0"
        elif t > budget:
            why = f"took {t:.2f} s > {budget} s"
        elif not named.search("\n".join(errors)):
            why = f"error does not name rank {victim}"
        else:
            why = None
        verdicts.append((r, t, why, last, noticed))
    return victim, verdicts, victim_end, texts, bool(early)


def excerpt(text, head=15, tail=60):
    """A rank's log, shortened to its first and last lines (the setup and the failure)."""
    lines = text.splitlines()
    if len(lines) <= head + tail:
        return text
    return "\n".join(lines[:head] + [f"[... {len(lines) - head - tail} lines left out ...]"]
                     + lines[-tail:])


def append_run(path, title, texts):
    with open(path, "a") as f:
        f.write(f"\n===== {title} =====\n")
        for r, text in enumerate(texts):
            f.write(f"----- rank {r} -----\n{excerpt(text)}\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default=".gpu/bin/mscclpp-bench")
    p.add_argument("--ranks", default="2", help="comma list of rank counts (default 2)")
    p.add_argument("--signals", default="KILL,STOP", help="KILL, STOP (comma list)")
    p.add_argument("--workloads", default="eager,graph", help=f"{', '.join(WORKLOADS)} (comma list)")
    p.add_argument("--mps", default="0", help="0, 1 or 0,1: without / with an MPS server")
    p.add_argument("--config", action="append", default=[], help="RANKS:SIGNAL:WORKLOAD:MPS, e.g. "
                   "4:KILL:graph:0 (repeatable): run these configurations instead of every "
                   "combination of --ranks, --signals, --workloads and --mps")
    p.add_argument("--runs", type=int, default=3, help="runs per configuration")
    p.add_argument("--victim", type=int, default=-1, help="rank to signal (default: the last)")
    p.add_argument("--delay", type=float, default=0.0, help="seconds from launch to the signal "
                   "(default: --settle seconds after rank 0's table header)")
    p.add_argument("--settle", type=float, default=1.5, help="seconds from rank 0's table header "
                   "to the signal (warm-up call, graph capture, a full launch queue)")
    p.add_argument("--budget", type=float, default=0.0, help="seconds for the whole matrix, shared "
                   "equally among the configurations (0: no limit, --runs each)")
    p.add_argument("--timeout", type=int, default=3, help="MSCCLPP_DEVICE_WAIT_TIMEOUT (seconds)")
    p.add_argument("--slack", type=float, default=2.0, help="allowed beyond the timeout (seconds)")
    p.add_argument("--bootstrap-timeout", type=int, default=30, help="MSCCLPP_BOOTSTRAP_TIMEOUT")
    p.add_argument("--hang-after", type=float, default=60.0, help="seconds before a survivor counts as hung")
    p.add_argument("--size", default="8M", help="message size of the eager and graph workloads "
                   "(a SIGSTOPped rank's already-queued kernels still run: larger messages make its "
                   "queue, and so the survivors' time, longer)")
    p.add_argument("--cache-dir", default="/tmp/mscclpp-cache")
    p.add_argument("--bench-args", default="", help="the bench's arguments instead of a workload's "
                   "(e.g. 'bootstrap --iters 100000000' checks bootstrap liveness without a GPU)")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU probe after each configuration")
    p.add_argument("--out", default=os.environ.get("OUT", "./gpu-out"), help="logs go to OUT/fault-inject/")
    a = p.parse_args()

    ngpu = gpu_count()
    logdir = os.path.join(a.out, "fault-inject")
    os.makedirs(logdir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="mscclpp-fault-")
    rundir = os.path.join(workdir, "logs")
    os.makedirs(rundir)
    # A handful of files come back from a device call: every rank's whole log stays in rundir;
    # logdir gets the summary and, in two files, the failed runs' logs and one passing run's
    # per configuration (each rank's log shortened to its first and last lines).
    failures_log = os.path.join(logdir, "failures.log")
    passes_log = os.path.join(logdir, "passes.log")
    for path in (failures_log, passes_log):
        open(path, "w").close()
    if a.config:
        configs = []
        for c in a.config:
            parts = c.split(":")
            if len(parts) != 4:
                raise SystemExit(f"--config {c!r}: expected RANKS:SIGNAL:WORKLOAD:MPS, e.g. 4:KILL:graph:0")
            configs.append((int(parts[0]), parts[1].upper(), parts[2], parts[3] == "1"))
    else:
        configs = list(itertools.product(
            [int(x) for x in a.ranks.split(",")], a.signals.upper().split(","),
            a.workloads.split(","), [x == "1" for x in a.mps.split(",")]))
    print(f"fault injection: {ngpu} GPU(s), MSCCLPP_DEVICE_WAIT_TIMEOUT={a.timeout}, pass within "
          f"{a.timeout + a.slack} s, {a.runs} run(s) per configuration; summary and kept logs in "
          f"{logdir}, every log in {rundir}", flush=True)
    for _, sig, workload, _ in configs:
        if sig not in SIGNALS:
            raise SystemExit(f"unknown signal {sig} (KILL, STOP)")
        if workload not in WORKLOADS and not a.bench_args:
            raise SystemExit(f"unknown workload {workload!r} ({', '.join(WORKLOADS)})")
    table, port, all_ok, warmed = [], 29600, True, set()
    matrix_start = time.monotonic()
    for index, (nranks, sig, workload, mps) in enumerate(configs):
        name = f"{nranks} ranks {sig:4} {workload:5} {'MPS' if mps else 'no MPS'}"
        config_start = time.monotonic()
        share = None
        if a.budget > 0:
            share = (a.budget - (config_start - matrix_start)) / (len(configs) - index)
        server = Mps(nranks, ngpu, workdir) if mps else None
        extra = server.env if server else {}
        if server:
            server.start()
        row = {"configuration": name, "ranks": nranks, "signal": sig, "workload": workload,
               "mps": mps, "runs": 0, "passed": 0, "times": [], "noticed": [], "kinds": {},
               "example": None, "victim": [], "gpu_usable_after": None}
        if not a.bench_args and (nranks, workload, mps) not in warmed:
            port += 10
            failed_warm_up = warm_up(a, nranks, workload, extra, port, rundir)
            if failed_warm_up is not None:
                print(f"[{name}] warm-up failed (log in failures.log)", flush=True)
                with open(failures_log, "a") as f:
                    f.write(f"\n===== [{name}] warm-up =====\n{excerpt(failed_warm_up)}\n")
            warmed.add((nranks, workload, mps))
        kept_pass = False
        for run in range(a.runs):
            if run > 0 and share is not None and time.monotonic() - config_start > share:
                print(f"[{name}] budget share of {share:.0f} s spent after {run} run(s)", flush=True)
                break
            row["runs"] += 1
            port += 10  # the bootstrap root takes MASTER_PORT + 1
            tag = f"n{nranks}-{sig}-{workload}-{'mps' if mps else 'nomps'}-{run}"
            victim, verdicts, victim_end, texts, early = one_run(
                a, nranks, sig, workload, extra, port, rundir, tag)
            slowest = max(verdicts, key=lambda v: -1 if v[1] is None else v[1])
            failed = [v for v in verdicts if v[2]]
            if slowest[1] is not None:
                row["times"].append(slowest[1])
                if slowest[4] is not None:
                    row["noticed"].append(slowest[4])
            row["passed"] += not failed
            for _, _, _, last, _ in verdicts:
                kind = classify(last, early)
                row["kinds"][kind] = row["kinds"].get(kind, 0) + 1
                row["example"] = row["example"] or last
            row["victim"].append(victim_end)
            status = "PASS" if not failed else "FAIL"
            shown = f"{slowest[1]:.2f} s" if slowest[1] is not None else "-"
            print(f"[{name}] run {run}: {status}, victim rank {victim} ({victim_end}), slowest "
                  f"survivor {shown}", flush=True)
            for r, t, why, last, noticed in verdicts:
                mark = f"FAIL ({why})" if why else "ok"
                tt = f"{t:.2f} s" if t is not None else "-"
                seen = f" (loop stopped at {noticed:.2f} s)" if noticed is not None else ""
                print(f"    rank {r}: {tt}{seen} {mark}: {last[:240]}", flush=True)
            title = f"[{name}] run {run}: {status}, victim rank {victim} ({victim_end})"
            if failed:
                append_run(failures_log, title, texts)
            elif not kept_pass:
                append_run(passes_log, title, texts)
                kept_pass = True
        usable = "yes (not checked)" if a.no_gpu else gpu_usable(extra)
        row["gpu_usable_after"] = usable
        if server:
            server.stop()
        if usable != "yes" and not a.no_gpu:
            print(f"[{name}] WARNING: creating a CUDA context afterwards: {usable}", flush=True)
        all_ok &= row["passed"] == row["runs"] and (a.no_gpu or usable == "yes")
        table.append(row)
    intro = (f"fault injection: {time.monotonic() - matrix_start:.0f} s in all; times are the "
             f"slowest survivor's, from the signal to its exit (\"loop stopped\": to the moment its "
             f"timed loop stopped on the failure; the rest is draining and teardown); pass within "
             f"{a.timeout + a.slack} s (MSCCLPP_DEVICE_WAIT_TIMEOUT={a.timeout})")
    lines = ["| configuration | pass | min s | median s | max s | loop stopped, median s | "
             "survivors' errors | example | stopped victim | GPU usable after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in table:
        times = row["times"]
        stats = (f"{min(times):.2f} | {statistics.median(times):.2f} | {max(times):.2f}"
                 if times else "- | - | -")
        noticed = f"{statistics.median(row['noticed']):.2f}" if row["noticed"] else "-"
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(row["kinds"].items(), key=lambda kv: -kv[1]))
        example = (row["example"] or "-")[:110].replace("|", "/")
        ends = sorted(set(re.sub(r"[0-9.]+ s", "N s", v) for v in row["victim"]))
        lines.append(f"| {row['configuration']} | {row['passed']}/{row['runs']} | {stats} | "
                     f"{noticed} | {kinds or '-'} | {example} | {'; '.join(ends)} | "
                     f"{row['gpu_usable_after']} |")
    summary = intro + "\n\n" + "\n".join(lines) + "\n"
    print("\n" + summary)
    with open(os.path.join(logdir, "summary.md"), "w") as f:
        f.write(summary)
    with open(os.path.join(logdir, "summary.json"), "w") as f:
        json.dump({"timeout": a.timeout, "slack": a.slack, "configurations": table}, f, indent=1)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
