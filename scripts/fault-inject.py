#!/usr/bin/env python3
"""Fault injection: kill or stop one rank of a running job and check that every other rank fails
fast, with an error naming that rank.

A run (a "world") starts N ranks of `mscclpp-bench collective` on this machine's GPU(s) (several
ranks share a GPU when N exceeds the GPUs, optionally under MPS), waits until rank 0 has printed its
table header (communicator and algorithms up) and --settle seconds more (the timed loop is running,
its launch queue full), or --delay seconds in all when given, then SIGKILLs or SIGSTOPs one rank
(the victim). It passes when every survivor exits non-zero within MSCCLPP_DEVICE_WAIT_TIMEOUT +
--slack seconds of that run's own signal, its error names the victim ("rank V"), and its log says
its timed loop stopped on the failure (so the signal landed in the loop, not in set-up; a survivor
whose log says its set-up stopped instead names the step, and --settle was too short), and no
survivor's log, nor a continued stopped victim's, shows a fault of its CUDA context. A run in which
any rank ended, or a survivor's timed loop stopped, before the signal fails too (a false timeout
under load is a failure, not a skipped run). After a KILL, survivors still running --hang-after
seconds after the signal are killed and the run fails; after a STOP the victim is continued then,
and survivors still running --timeout + --slack seconds later are killed. The liveness timeout
(MSCCLPP_LIVENESS_TIMEOUT) follows MSCCLPP_DEVICE_WAIT_TIMEOUT unless the environment sets it.

Ranks are started directly with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), not under torchrun: torchrun's agent tears the job down itself when one worker dies,
which would hide whether the survivors notice on their own.

Workloads (the bench's options; each run is a long loop the signal lands in):
  eager   allreduce (--size), launched back to back: a deep launch queue behind the failure
  graph   allreduce captured into a CUDA graph of 20 calls, replayed many times
  small   as eager with 1 KiB messages (packet kernels, many launches per second)
  port    PortChannel traffic: port_allreduce (1 MiB, eager), the ranks split into two simulated
          hosts by MSCCLPP_HOSTID (CudaIpc within a half, the Ethernet transport between halves;
          the host proxy threads carry every transfer)
  hosts   as port with the selector's choice: default_allreduce_hierarchical from 2 x 2 ranks on
          (reduce-scatter in each half, port_allreduce across, all-gather in each half)
  sendrecv        point-to-point: each rank sends 8 MiB to the next (nccl-tests' sendrecv),
                  eager; from its third call each message goes zero copy (the sender writes into
                  the receiver's buffer, the receiver waits on its `done` word)
  sendrecv-graph  as sendrecv, captured into a CUDA graph of 20 calls, replayed many times
  plan    an execution plan through the GPU interpreter: the builder's Simple all-reduce for the
          world's rank count (.gpu/builder-plans), 4 MiB, eager: its threadblock runs as many
          replicas that meet on arrival stamps, and its data ops run fused
  ep      mscclpp.ext.ep dispatch and combine through the point-to-point groups, every result
          checked (--ep-program, python/tests/ep_fault_loop.py; the wheel on PYTHONPATH): the
          signal lands mid-dispatch, while a host thread polls for the group's counts
  ep-hosts        as ep, the ranks split into two simulated hosts (the internode mode: the
                  port engine's proxy towards the other half, the kernel's copies within one)
  ep-ll           as ep in the low-latency mode (nothing read on the host: the failure shows in
                  the next call's check)

Configurations are every combination of --ranks, --signals, --workloads and --mps (or the --config
list). Several worlds run at once on the GPU, each with its own bootstrap port, victim and logs, as
long as their processes number at most --parallel-ranks (16: eight 2-rank worlds, four 4-rank, two
8-rank, or a mix); every run's time is still measured from its own signal. Worlds that run at once
slow each other: the times are those of a loaded GPU, and the summary says how many ranks ran at
once. Runs are queued round by round (run k of every configuration before run k+1 of any), larger
worlds first within a round, and started in that order as processes end, so a cut by --budget
leaves every configuration with about as many runs.

Configurations with and without MPS run in separate phases (MPS ones last): an MPS control daemon
serves every client started while it runs, so the phase starts one and quits it at its end. Its
timed worlds run one at a time: the server answers the SIGKILL of a client whose kernel is running
with a fatal fault in every client of the GPU (scripts/mps-fault-probe.py), so worlds beside it
would fail for the driver's reason. Such a fault in a survivor after a KILL under MPS is counted
as a note, not a failure (the run is judged on its time and error); without MPS, or after a STOP,
a context fault fails the run. Each MPS client is held to --mps-share percent of the SMs (default:
its world's share, 100 x GPUs / ranks): every native kernel needs its whole grid resident while it
waits for its peers. Each phase first runs one short job per rank count and workload without a
signal (smallest worlds first: they compile the kernels into the cache that the rest read), then
the timed runs, then checks that a new process can still create a CUDA context (the "GPU usable
after" column: a killed MPS client that took the server down shows here). A survivor still
running --hang-after seconds after the signal gets its threads' names, states, kernel wait
channels and kernel stacks (/proc, the stacks where readable) at that moment written into its log,
with the time it exited, if it did (a slow exit, say in the driver's context teardown, is not a
hang and shows where it spends the time).

--budget S bounds the whole command (warm-up, MPS start and stop, the probe included): a world is
started only if it should end in time by the mean duration of its configuration's finished runs;
those left are reported as not started, and --missing-from runs exactly those in a later call.

Examples (from the repository root on the GPU machine, after scripts/gpu-stage.sh):
  python3 .gpu/fault-inject.py --ranks 2,4,8 --signals KILL,STOP --workloads eager,graph,port \\
      --mps 1 --runs 20 --timeout 2 --parallel-ranks 16 --budget 520
  python3 .gpu/fault-inject.py --merge call1/fault-inject/summary.json call2/fault-inject/summary.json

Files (few, so a device call brings them all back), under OUT/fault-inject/: summary.md (the table;
each command appends its own), summary.json (every run's time; a later command in the same OUT
adds to it), failures.log (every failed run and warm-up, each rank's log shortened to its first and
last lines) and passes.log (one passing run per configuration). Every rank's whole log stays in the
temporary directory printed at the start. SIGTERM or Ctrl-C stops the worlds and still writes the
summary (marked INTERRUPTED) with every run that finished. Exit status: 0 when every run passed
and none was left out, 2 when all passed but the budget left runs out, 1 when a run failed, the GPU
was not usable at once after a phase, or the command was interrupted.
"""

import argparse
import datetime
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NVLS_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "MSCCLPP_FORCE_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}
EP_WORKLOADS = ("ep", "ep-hosts", "ep-ll")
WORKLOADS = ("eager", "small", "graph", "port", "hosts", "sendrecv", "sendrecv-graph", "plan") + \
    EP_WORKLOADS
# Workloads whose ranks split into two simulated hosts (MSCCLPP_HOSTID), and so run PortChannels.
TWO_HOSTS = ("port", "hosts", "ep-hosts")
# core/src/port_channel.rs's MPS_PORT_RANKS_PER_GPU.
MPS_PORT_RANKS_PER_GPU = 2
# Bootstrap roots listen on MASTER_PORT + 1; ports cycle below Linux's ephemeral range (32768 up),
# so no connection's local port can take one.
PORT_FIRST, PORT_LAST = 20000, 32000
# How long a warm-up job may take: the first ones compile the kernels (NVRTC, a cold cache), the
# later ones read the cache (a hung one must not eat the budget).
WARM_UP_LIMITS = (300.0, 60.0)
POLL = 0.01
# The probe's answers that are not failures ("yes after N s" is a server that had to recover).
HEALTHY = ("yes", "yes (not checked)")
# Every bench process started and not yet reaped: an interrupted script kills them all.
RUNNING = set()
# SIGTERM received (a device call's time limit).
TERMINATED = []

# The EP workloads' program: staged beside this script (.gpu/python/tests), or the repository's.
EP_PROGRAM = next((p for p in (os.path.join(HERE, "python", "tests", "ep_fault_loop.py"),
                               os.path.join(HERE, "..", "python", "tests", "ep_fault_loop.py"))
                   if os.path.exists(p)), "python/tests/ep_fault_loop.py")
LOOP_STOPPED = "the timed loop stopped"
# The bench's line when it stopped before its timed batches (warm-up, graph capture, the graph's
# first replay): the signal landed before the loop on that rank.
SETUP_STOPPED = re.compile(r"the timed loop's set-up stopped in (.+?): ")
# The bench's last timestamped line on a failure: everything it owned is torn down.
TORN_DOWN = "torn down"
HEADER = b"# rank 0 thread:"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A fault of the process's own context (sticky: the context is lost), or its MPS server gone. A
# survivor's or a continued victim's kernel touching memory a dead peer freed, or that the
# survivor unmapped under it, shows as one; under MPS one client's fault reaches every client.
CONTEXT_FAULT = re.compile(r"CUDA_ERROR_(?:ILLEGAL_ADDRESS|LAUNCH_FAILED|HARDWARE_STACK_ERROR|"
                           r"ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS|INVALID_ADDRESS_SPACE|INVALID_PC|"
                           r"ECC_UNCORRECTABLE|MPS_\w+)")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z")


def workload_args(name, size, nranks, short=False):
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
    if name == "hosts":
        # The selector's choice across two simulated hosts: default_allreduce_hierarchical from
        # 2 x 2 ranks on (host sub-communicators plus a cross-host port_allreduce), the flat
        # port_allreduce at 2 ranks.
        return common + ["-b", "1M", "-e", "1M", "-n", "5" if short else "1000000"]
    if name in ("sendrecv", "sendrecv-graph"):
        # Above the engine's zero-copy threshold (1 MiB): the warm-up maps the receive buffers.
        p2p = ["collective", "-c", "sendrecv", "-d", "bf16", "-w", "3", "-m", "1", "--outofplace-only",
               "-b", "8M", "-e", "8M"]
        if name == "sendrecv":
            return p2p + ["-n", "5" if short else "1000000"]
        return p2p + ["-n", "20", "-G", "2" if short else "1000000"]
    if name == "plan":
        return common + ["-b", "4M", "-e", "4M", "--plan",
                         f".gpu/builder-plans/builder_allreduce_simple_{nranks}gpu.json",
                         "--algo", f"allreduce_simple_{nranks}rank", "-n", "5" if short else "1000000"]
    if name in EP_WORKLOADS:
        mode = ["--low-latency"] if name == "ep-ll" else []
        return mode + ["--iterations", "5" if short else "1000000"]
    raise SystemExit(f"unknown workload {name!r} ({', '.join(WORKLOADS)})")


def workload_command(a, name, nranks, short=False):
    """The command line of one rank: the bench with the workload's arguments, or the EP loop."""
    if name in EP_WORKLOADS:
        return [sys.executable, a.ep_program] + workload_args(name, a.size, nranks, short)
    return [a.bench] + workload_args(name, a.size, nranks, short)


def rank_env(workload, rank, nranks):
    """Per-rank variables beyond the launcher's: the port and hosts workloads' simulated host."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank)}
    if workload in TWO_HOSTS:
        env["MSCCLPP_HOSTID"] = f"sim-host-{rank * 2 // nranks}"
    return env


def gpu_count():
    """The GPUs this command may use: CUDA_VISIBLE_DEVICES's list when set (a lane of a machine
    with several GPUs), else every GPU nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
        return max(1, len(out.stdout.strip().splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return 1


class Mps:
    """The MPS control daemon of one phase: every client started while it runs shares its server."""

    def __init__(self, share, workdir):
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": os.path.join(workdir, "mps-pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(workdir, "mps-log"),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share),
        }
        for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            os.makedirs(self.env[key], exist_ok=True)
        # The server sees only the GPUs visible when it starts, numbered from 0, and its clients
        # name GPUs by that numbering (CUDA_VISIBLE_DEVICES=2 would leave a client with no GPU):
        # the daemon keeps the caller's list, the clients get it renumbered.
        self.daemon_env = dict(self.env)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        if visible:
            self.env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpu_count()))

    def start(self):
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **self.daemon_env},
                       check=True)

    def stop(self):
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True,
                       env={**os.environ, **self.daemon_env}, check=False)
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


def classify(error, before=None):
    """The kind of failure a survivor reported, for the summary (`before`: the run's kind of
    failure before the signal, if it had one)."""
    if before:
        return before
    if "CUDA_ERROR" in error:
        return "CUDA/MPS error"
    if "stalled" in error:
        return "stalled"
    if "died" in error:
        return "died"
    if "device-side timeout" in error or "timed out" in error:
        return "timeout"
    return "other"


def stamped(text, marker):
    """Unix time of the bench's first log line holding `marker` (its log lines start with a UTC
    timestamp), or None."""
    for line in text.splitlines():
        if marker in line:
            m = STAMP.match(line.strip())
            if m:
                whole, _, frac = m.group(1).partition(".")
                t = datetime.datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S")
                return t.replace(tzinfo=datetime.timezone.utc).timestamp() + float("0." + (frac or "0"))
    return None


def config_name(cfg):
    nranks, sig, workload, mps = cfg
    return f"{nranks} ranks {sig:4} {workload:5} {'MPS' if mps else 'no MPS'}"


def kill_running():
    for p in list(RUNNING):
        p.kill()  # a stopped process dies too
        p.wait()
        RUNNING.discard(p)


class Interrupted(Exception):
    """SIGTERM (a device call's time limit): stop, keep what finished, write the summary."""


class Ports:
    """Bootstrap ports for the worlds: each gets the next pair (MASTER_PORT, MASTER_PORT + 1),
    from a random start, so that two commands at once rarely meet."""

    def __init__(self):
        self.next = PORT_FIRST + 2 * random.randrange((PORT_LAST - PORT_FIRST) // 2)

    def take(self):
        port = self.next
        self.next = port + 2 if port + 2 < PORT_LAST else PORT_FIRST
        return port


class World:
    """One job of N ranks: its own bootstrap port, victim and logs. Advanced by `step` without
    blocking, so that many run side by side; `result` is set once every process was reaped."""

    def __init__(self, a, cfg, port, rundir, tag, extra_env, signals_sent, warm_up=None):
        """`warm_up`: seconds a job without a signal may take (a warm-up), None for a timed run."""
        self.a, self.cfg, self.tag, self.warm_up = a, cfg, tag, warm_up
        nranks, sig, workload, _ = cfg
        self.victim = a.victim if a.victim >= 0 else nranks - 1
        self.survivors = [r for r in range(nranks) if r != self.victim]
        self.signals_sent = signals_sent
        level = os.environ.get("MSCCLPP_LOG_LEVEL", "WARN")
        env = {**os.environ, **NVLS_OFF, **extra_env,
               "MSCCLPP_DEVICE_WAIT_TIMEOUT": str(a.timeout),
               "MSCCLPP_BOOTSTRAP_TIMEOUT": str(a.bootstrap_timeout),
               "MSCCLPP_CACHE_DIR": a.cache_dir,
               # Warnings carry the timestamps: when the loop stopped, how long the drain took.
               "MSCCLPP_LOG_LEVEL": level if level.upper() in ("INFO", "DEBUG", "TRACE") else "WARN",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": str(nranks), "LOCAL_WORLD_SIZE": str(nranks)}
        env.pop("MSCCLPP_ENABLE_NVLS", None)
        if a.bench_args:
            args = [a.bench] + a.bench_args.split()
        else:
            args = workload_command(a, workload, nranks, short=warm_up is not None)
        self.procs = []
        self.paths = [os.path.join(rundir, f"{tag}.rank{r}.log") for r in range(nranks)]
        self.started = time.monotonic()
        for r, path in enumerate(self.paths):
            # The rank owns its log's descriptor: ours would share its file offset, and a read
            # of ours could then move where the rank writes.
            with open(path, "wb") as log:
                self.procs.append(subprocess.Popen(args, env={**env, **rank_env(workload, r, nranks)},
                                                   stdout=log, stderr=subprocess.STDOUT))
            RUNNING.add(self.procs[-1])
        self.state = "starting" if warm_up is None else "warming"
        self.reader, self.read_upto, self.header_at = open(self.paths[0], "rb"), 0, None
        self.sent = self.sent_wall = self.continued = self.load = None
        self.ended, self.early, self.not_running = {}, [], None
        self.late_dumps = {}
        self.victim_end = "-"
        self.result = None

    def live(self):
        return sum(p.poll() is None for p in self.procs)

    def _header(self):
        """Whether rank 0 printed its table header (read incrementally)."""
        self.reader.seek(self.read_upto)
        chunk = self.reader.read()
        # Keep a line's worth before the end: the header may arrive in pieces.
        self.read_upto = max(self.read_upto, self.read_upto + len(chunk) - len(HEADER))
        return HEADER in chunk

    def _send(self, now):
        sig = self.cfg[1]
        # The load the run saw: bench processes alive on the machine, this world's included.
        self.load = sum(p.poll() is None for p in RUNNING)
        self.sent, self.sent_wall = time.monotonic(), time.time()
        os.kill(self.procs[self.victim].pid, SIGNALS[sig])
        self.signals_sent.append((self.sent, self.tag, sig))
        self.state = "signalled"

    def step(self, now):
        """Advances the world; True once it is done (every process reaped, `result` set)."""
        a = self.a
        if self.state == "warming":
            if all(p.poll() is not None for p in self.procs):
                return self._finish()
            if now - self.started > self.warm_up:
                self.not_running = f"warm-up still running after {self.warm_up:.0f} s"
                return self._finish()
            return False
        if self.state in ("starting", "settling"):
            self.early = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if self.early:
                return self._finish()
            if a.delay > 0 or a.bench_args:
                # Another command prints no bench header: a fixed delay.
                if now - self.started >= (a.delay or 3.0):
                    self._send(now)
                return False
            if self.state == "starting":
                if self._header():
                    self.state, self.header_at = "settling", now
                elif now - self.started > a.start_limit:
                    self.not_running = f"no table header from rank 0 within {a.start_limit:.0f} s"
                    return self._finish()
                return False
            if now - self.header_at >= a.settle:
                self._send(now)
            return False
        if self.state in ("signalled", "continued"):
            # Survivors are timed until the world is reaped: one that exits while a stopped
            # victim runs again is slow, not hung.
            for r in self.survivors:
                if r not in self.ended and self.procs[r].poll() is not None:
                    self.ended[r] = now - self.sent
        if self.state == "signalled":
            if len(self.ended) == len(self.survivors) or now - self.sent > a.hang_after:
                # Where a survivor still running waits, seen at this moment: by the world's end
                # it may have exited (or, once the victim runs again, moved on).
                self.late_dumps = {r: thread_dump(self.procs[r].pid) for r in self.survivors
                                   if r not in self.ended and self.procs[r].poll() is None}
                if self.cfg[1] == "KILL":
                    self.victim_end = "killed by the signal"
                    return self._finish()
                # A stopped victim is continued and given the time a survivor gets to end by
                # itself: a SIGKILL of a stopped MPS client whose kernels are still queued or
                # running can leave the MPS server refusing every later client (seen after 2-rank
                # STOP graph runs on an H100). Continued, it finds its peers gone (bootstrap),
                # aborts, drains and exits on its own.
                self.procs[self.victim].send_signal(signal.SIGCONT)
                self.state, self.continued = "continued", now
            return False
        if self.state == "continued":
            waited = now - self.continued
            if self.victim_end == "-" and self.procs[self.victim].poll() is not None:
                self.victim_end = f"continued, exited by itself in {waited:.2f} s"
            if waited > a.timeout + a.slack:
                if self.victim_end == "-":
                    self.victim_end = (f"continued, still running after {a.timeout + a.slack} s: "
                                       "SIGKILLed")
                return self._finish()
            if self.victim_end != "-" and len(self.ended) == len(self.survivors):
                return self._finish()
            return False
        return self.state == "done"

    def _finish(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()  # a stopped process dies too
            p.wait()
            RUNNING.discard(p)
        self.finished = time.monotonic()
        texts = []
        self.reader.close()
        for path in self.paths:
            with open(path, "rb") as log:
                texts.append(ANSI.sub("", log.read().decode("utf-8", "replace")))
        for r, dump in self.late_dumps.items():
            t = self.ended.get(r)
            end = (f"it exited {t:.2f} s after the signal" if t is not None
                   else "it was killed at the world's end")
            texts[r] += (f"\n[fault-inject] rank {r} still running {self.a.hang_after:.0f} s after "
                         f"the signal ({end}); its threads then:\n{dump}\n")
        self.texts = texts
        self.result = self._verdicts() if self.warm_up is None else self._warm_up_result()
        self.state = "done"
        return True

    def _warm_up_result(self):
        ok = self.not_running is None and all(p.returncode == 0 for p in self.procs)
        return {"ok": ok, "why": self.not_running or f"exit codes {[p.returncode for p in self.procs]}"}

    def _verdicts(self):
        """One verdict per survivor: (rank, seconds from the signal to its exit, why it failed or
        None, its last error line, seconds from the signal to the moment its loop stopped and to
        the end of its teardown)."""
        a = self.a
        named = re.compile(rf"\brank {self.victim}\b")
        budget = a.timeout + a.slack
        # Under MPS the server answers the SIGKILL of a client whose kernel is running with a
        # fatal fault in every client of the GPU (scripts/mps-fault-probe.py: even a kernel that
        # only reads its own device memory): the driver's, not a survivor's own access. Such a
        # run is judged on the rest and the fault is counted as a note.
        driver_fault = self.cfg[3] and self.cfg[1] == "KILL"
        # A survivor whose timed loop stopped before the signal failed by itself (a false
        # timeout under load, say), even when it had not exited by the time the signal went out.
        stopped_early = []
        if self.sent_wall is not None:
            for r in self.survivors:
                stopped = stamped(self.texts[r], LOOP_STOPPED)
                if stopped is not None and stopped < self.sent_wall:
                    stopped_early.append(r)
        before = ("ended before the signal" if self.early else
                  "stopped before the signal" if stopped_early else
                  "not running in time" if self.not_running else None)
        verdicts = []
        for r in self.survivors:
            text = self.texts[r]
            # The program's last word: "mscclpp-bench (rank R): error: ..." (or ep_fault_loop's).
            errors = [line for line in text.splitlines() if ": error:" in line]
            last = errors[-1] if errors else (text.strip().splitlines() or [""])[-1]
            last = re.sub(r"^\S+ \(rank \d+\): error: ", "", last)
            t = self.ended.get(r)
            # Seconds from the signal to the moment the timed loop stopped, and to the end of
            # the bench's teardown: the rest of the exit time is the process's own exit.
            noticed, torn = (None if s is None or before else s - self.sent_wall
                             for s in (stamped(text, LOOP_STOPPED), stamped(text, TORN_DOWN)))
            if self.early:
                why = f"rank(s) {self.early} ended before the signal"
            elif stopped_early:
                why = f"rank(s) {stopped_early} stopped the timed loop before the signal"
            elif self.not_running:
                why = self.not_running
            elif t is None:
                why = f"still running after {a.hang_after} s (hang)"
            elif self.procs[r].returncode == 0:
                why = "exited 0"
            elif CONTEXT_FAULT.search(text) and not driver_fault:
                why = f"its context faulted ({CONTEXT_FAULT.search(text).group(0)})"
            elif t > budget:
                why = f"took {t:.2f} s > {budget} s"
            elif not named.search("\n".join(errors)):
                why = f"error does not name rank {self.victim}"
            elif not a.bench_args and LOOP_STOPPED not in text:
                setup = SETUP_STOPPED.search(text)
                why = (f"the signal landed before the timed loop, in {setup.group(1)} (raise --settle)"
                       if setup else
                       "no 'timed loop stopped' line: the signal landed outside the timed loop")
            else:
                why = None
            verdicts.append((r, t, why, last, noticed, torn))
        others = [f"{tag} {sig} at {t - self.sent if self.sent else t - self.started:+.2f} s"
                  for t, tag, sig in self.signals_sent
                  if tag != self.tag and self.started <= t <= self.finished]
        fault = CONTEXT_FAULT.search(self.texts[self.victim]) if self.cfg[1] == "STOP" else None
        victim_fault = f"the continued victim's context faulted ({fault.group(0)})" if fault else None
        driver_faults = sum(1 for r in self.survivors
                            if driver_fault and CONTEXT_FAULT.search(self.texts[r]))
        return {"verdicts": verdicts, "before": before, "others": others,
                "victim_fault": victim_fault, "driver_faults": driver_faults}


def thread_dump(pid):
    """Each thread of `pid`: its name, state, the kernel function it sleeps in and, where readable,
    its kernel stack (from /proc, so no debugger is needed on the GPU machine), to see where a
    survivor that has not exited waits."""
    lines = []
    try:
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            base = f"/proc/{pid}/task/{tid}"
            try:
                with open(f"{base}/comm") as f:
                    comm = f.read().strip()
                with open(f"{base}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                with open(f"{base}/wchan") as f:
                    wchan = f.read().strip() or "-"
            except OSError:
                continue
            lines.append(f"  thread {tid} {comm!r}: state {state}, waiting in {wchan}")
            try:
                # Root only: the kernel functions under the wait (the driver's, in an exit).
                with open(f"{base}/stack") as f:
                    frames = [l.split()[-1] for l in f.read().splitlines() if l.strip()]
                if frames:
                    lines.append(f"    kernel stack: {' <- '.join(frames[:8])}")
            except OSError:
                pass
    except OSError as e:
        lines.append(f"  (no thread list: {e})")
    return "\n".join(lines)


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


def new_row(cfg):
    nranks, sig, workload, mps = cfg
    return {"configuration": config_name(cfg), "ranks": nranks, "signal": sig,
            "workload": workload, "mps": mps, "runs": 0, "passed": 0, "times": [], "noticed": [],
            "torn_down": [],
            "kinds": {}, "reasons": {}, "example": None, "victim": [], "not_started": 0,
            "warm_up": [], "gpu_usable_after": [], "parallel_ranks": [], "load": []}


def key_of(row):
    return (row["ranks"], row["signal"], row["workload"], bool(row["mps"]))


def record(row, world, logs, kept):
    """Adds a finished timed world to its configuration's row; prints it; keeps its logs."""
    res = world.result
    verdicts = res["verdicts"]
    name = row["configuration"]
    slowest = max(verdicts, key=lambda v: -1 if v[1] is None else v[1])
    failed = [v[2] for v in verdicts if v[2]] + ([res["victim_fault"]] if res["victim_fault"] else [])
    row["runs"] += 1
    row["passed"] += not failed
    if slowest[1] is not None and not res["before"]:
        row["times"].append(round(slowest[1], 3))
        for k, i in (("noticed", 4), ("torn_down", 5)):
            if slowest[i] is not None:
                row[k].append(round(slowest[i], 3))
    for _, _, why, last, _, _ in verdicts:
        kind = classify(last, res["before"])
        row["kinds"][kind] = row["kinds"].get(kind, 0) + 1
        row["example"] = row["example"] or last
    if failed:
        reason = re.sub(r"[0-9.]+ s", "N s", failed[0])
        row["reasons"][reason] = row["reasons"].get(reason, 0) + 1
    row["victim"].append(world.victim_end)
    if res.get("driver_faults"):
        row["driver_faults"] = row.get("driver_faults", 0) + 1
    if world.load is not None:
        row["load"].append(world.load)
    status = "PASS" if not failed else "FAIL"
    shown = f"{slowest[1]:.2f} s" if slowest[1] is not None else "-"
    title = f"[{name}] {world.tag}: {status}, victim rank {world.victim} ({world.victim_end})"
    print(f"{title}, slowest survivor {shown}", flush=True)
    for r, t, why, last, noticed, torn in verdicts:
        mark = f"FAIL ({why})" if why else "ok"
        tt = f"{t:.2f} s" if t is not None else "-"
        seen = "".join(f" ({what} at {at:.2f} s)" for what, at in
                       (("loop stopped", noticed), ("torn down", torn)) if at is not None)
        print(f"    rank {r}: {tt}{seen} {mark}: {last[:240]}", flush=True)
    if res["victim_fault"]:
        print(f"    victim rank {world.victim}: FAIL ({res['victim_fault']})", flush=True)
    if failed:
        others = "; ".join(res["others"]) or "none"
        append_run(logs["failures"], f"{title}; other worlds signalled during it: {others}",
                   world.texts)
    elif key_of(row) not in kept:
        append_run(logs["passes"], title, world.texts)
        kept.add(key_of(row))
    return not failed


def estimate(a, cfg, durations):
    """Expected seconds of a world of `cfg` from start to its last process reaped: the mean of its
    (ranks, signal, MPS)'s finished worlds, else a guess (start-up, settle, detection, the victim)."""
    seen = durations.get(cfg[:2] + cfg[3:])
    if seen:
        return statistics.mean(seen)
    detect = a.timeout + 1.0 if cfg[1] == "STOP" else 1.0
    return 1.0 + 0.2 * cfg[0] + a.settle + detect


def run_worlds(a, pending, launch, on_done, deadline=None, estimate_of=None, one_at_a_time=False):
    """Starts the pending items in order as their processes fit under --parallel-ranks (or, with
    `one_at_a_time`, each once the one before ended), steps the running worlds, and hands each
    finished one to `on_done`. Items that would not end by `deadline` are dropped; returns them."""
    active, dropped = [], []
    pending = list(pending)
    while pending or active:
        if TERMINATED:
            raise Interrupted(f"signal {TERMINATED[0]}")
        now = time.monotonic()
        for w in list(active):
            if w.step(now):
                active.remove(w)
                on_done(w)
        used = sum(w.live() for w in active)
        while pending:
            item = pending[0]
            if active and (one_at_a_time or used + item[0] > a.parallel_ranks):
                break
            pending.pop(0)
            # Judged when it could start: by then the estimate has the latest finished runs.
            if deadline is not None and now + estimate_of(item) > deadline:
                dropped.append(item)
                continue
            w = launch(item)
            active.append(w)
            used += item[0]
        time.sleep(POLL)
    return dropped


def run_phase(a, mps, configs, rows, ngpu, workdir, rundir, logs, ports, phase_deadline, durations):
    """Every run of `configs` (all with or all without MPS): warm-up, timed runs, GPU probe."""
    label = "MPS" if mps else "no MPS"
    # Under MPS timed worlds run one at a time: a SIGKILLed client's running kernel makes the
    # server fault every client of the GPU (see _verdicts), so worlds beside it would fail for
    # the driver's reason. Each client is held to its world's share of the SMs.
    share = a.mps_share or 100
    server = Mps(share, workdir) if mps else None
    extra = server.env if server else {}

    def world_env(n):
        """A world's extra environment: under MPS without --mps-share, its clients' SM share."""
        if server and not a.mps_share:
            return {**extra, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, 100 * ngpu // n))}
        return extra
    signals_sent, kept = [], set()
    phase_start = time.monotonic()
    if server:
        server.start()
        held = f"{share} %" if a.mps_share else "its world's share (100 % / ranks)"
        print(f"[{label}] MPS server started, each client held to {held} of the SMs", flush=True)
    try:
        if not a.bench_args:
            # One short job per rank count and kernel family (graph replays launch the eager
            # kernels): the smallest worlds first, so they compile and the rest read the cache.
            family = {"graph": "eager", "sendrecv-graph": "sendrecv"}
            jobs = sorted({(n, family.get(w, w)) for n, _, w, _ in configs})
            smallest = {}
            for n, w in jobs:
                smallest.setdefault(w, n)
            waves = [[(n, w, WARM_UP_LIMITS[0]) for n, w in jobs if smallest[w] == n],
                     [(n, w, WARM_UP_LIMITS[1]) for n, w in jobs if smallest[w] != n]]

            def launch_warm(job):
                n, w, limit = job
                return World(a, (n, "KILL", w, mps), ports.take(), rundir,
                             f"warm-{'mps' if mps else 'nomps'}-n{n}-{w}", world_env(n), signals_sent,
                             warm_up=limit)

            def warm_done(world):
                n, _, w, _ = world.cfg
                ok = world.result["ok"]
                for cfg in configs:
                    if cfg[0] == n and family.get(cfg[2], cfg[2]) == w:
                        rows[cfg]["warm_up"].append("ok" if ok else "FAILED")
                if not ok:
                    print(f"[{label}] warm-up {n} ranks {w} FAILED ({world.result['why']}; "
                          f"log in failures.log)", flush=True)
                    append_run(logs["failures"], f"[{label}] warm-up {n} ranks {w}: "
                               f"{world.result['why']}", world.texts)

            warm_started = time.monotonic()
            for wave in waves:
                run_worlds(a, wave, launch_warm, warm_done, one_at_a_time=bool(server))
            print(f"[{label}] warm-up: {time.monotonic() - warm_started:.1f} s", flush=True)

        # Round by round, larger worlds first within a round.
        want = {cfg: a.runs - a.have.get(cfg, 0) for cfg in configs}
        queue = []
        for k in range(max(want.values(), default=0)):
            for cfg in sorted(configs, key=lambda c: (-c[0], c[1], c[2])):
                if k < want[cfg]:
                    queue.append(cfg)
        counter = itertools.count()

        def launch_run(cfg):
            n, sig, w, _ = cfg
            tag = f"n{n}-{sig}-{w}-{'mps' if mps else 'nomps'}-{next(counter)}"
            return World(a, cfg, ports.take(), rundir, tag, world_env(n), signals_sent)

        results = {"passed": 0, "failed": 0}

        def run_done(world):
            durations.setdefault(world.cfg[:2] + world.cfg[3:], []).append(
                world.finished - world.started)
            ok = record(rows[world.cfg], world, logs, kept)
            results["passed" if ok else "failed"] += 1

        # The probe and the MPS server's quit come after the last world.
        reserve = 0.0 if a.no_gpu else 17.0
        dropped = run_worlds(a, queue, launch_run, run_done, phase_deadline - reserve,
                             lambda cfg: estimate(a, cfg, durations), one_at_a_time=bool(server))
        for cfg in dropped:
            rows[cfg]["not_started"] += 1
        if dropped:
            print(f"[{label}] budget: {len(dropped)} run(s) not started", flush=True)
        usable = "yes (not checked)" if a.no_gpu else gpu_usable(extra)
        if usable not in HEALTHY:
            print(f"[{label}] WARNING: creating a CUDA context afterwards: {usable}", flush=True)
    finally:
        kill_running()  # interrupted: no client may outlive the server
        if server:
            server.stop()
    for cfg in configs:
        rows[cfg]["gpu_usable_after"].append(usable)
        rows[cfg]["parallel_ranks"].append(cfg[0] if server else a.parallel_ranks)
    print(f"[{label}] {results['passed']} passed, {results['failed']} failed, "
          f"{time.monotonic() - phase_start:.0f} s", flush=True)
    return len(dropped)


def percentile(values, q):
    """Nearest-rank percentile."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, -(-len(s) * q // 100) - 1))]


def table(rows, intro):
    lines = ["| configuration | pass | not started | min s | median s | p90 s | max s | "
             "loop stopped, median s | torn down, median s | survivors' errors | failures | example | stopped victim | "
             "ranks at once: limit (alive at the signal) | GPU usable after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        times = row["times"]
        stats = (f"{min(times):.2f} | {statistics.median(times):.2f} | "
                 f"{percentile(times, 90):.2f} | {max(times):.2f}" if times else "- | - | - | -")
        noticed, torn = (f"{statistics.median(row[k]):.2f}" if row.get(k) else "-"
                         for k in ("noticed", "torn_down"))
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(row["kinds"].items(), key=lambda kv: -kv[1]))
        reasons = "; ".join((["warm-up failed"] if "FAILED" in row["warm_up"] else [])
                            + [f"{k} ({n})" for k, n in row["reasons"].items()]
                            + ([f"not failures: the MPS server faulted the survivors' contexts after "
                                f"the kill ({row['driver_faults']} runs)"]
                               if row.get("driver_faults") else [])).replace("|", "/")
        example = (row["example"] or "-")[:110].replace("|", "/")
        ends = sorted(set(re.sub(r"[0-9.]+ s", "N s", v) for v in row["victim"]))
        usable = "; ".join(sorted(set(row["gpu_usable_after"]))) or "-"
        at_once = ", ".join(str(p) for p in sorted(set(row["parallel_ranks"]))) or "-"
        if row.get("load"):
            at_once += f" (at the signal: {min(row['load'])}-{max(row['load'])})"
        lines.append(f"| {row['configuration']} | {row['passed']}/{row['runs']} | "
                     f"{row['not_started']} | {stats} | {noticed} | {torn} | {kinds or '-'} | "
                     f"{reasons or '-'} | {example} | {'; '.join(ends) or '-'} | {at_once} | "
                     f"{usable} |")
    return intro + "\n\n" + "\n".join(lines) + "\n"


def merge_rows(documents):
    """Rows of several summary.json documents, one per configuration (their runs added up)."""
    merged, meta = {}, None
    for doc in documents:
        m = (doc["timeout"], doc["slack"])
        if meta is not None and m != meta:
            raise SystemExit(f"cannot merge runs with timeout/slack {meta} and {m}")
        meta = m
        for row in doc["configurations"]:
            row = dict(row, mps=bool(row["mps"]))
            into = merged.get(key_of(row))
            if into is None:
                merged[key_of(row)] = {k: (list(v) if isinstance(v, list) else
                                           dict(v) if isinstance(v, dict) else v)
                                       for k, v in row.items()}
                continue
            for k in ("runs", "passed"):
                into[k] += row[k]
            into["driver_faults"] = into.get("driver_faults", 0) + row.get("driver_faults", 0)
            # Runs left out by one document's budget and run by another's --missing-from.
            into["not_started"] = max(0, into["not_started"] + row["not_started"] - row["runs"])
            # "torn_down" came later: earlier summaries lack it.
            for k in ("times", "noticed", "torn_down", "victim", "warm_up", "gpu_usable_after",
                      "parallel_ranks", "load"):
                into[k] = into.get(k, []) + row.get(k, [])
            for k in ("kinds", "reasons"):
                for kind, n in row[k].items():
                    into[k][kind] = into[k].get(kind, 0) + n
            into["example"] = into["example"] or row["example"]
    order = sorted(merged.values(), key=lambda r: (r["mps"], r["ranks"], r["signal"], r["workload"]))
    return order, meta


def write_table(logdir, rows, intro, name="summary"):
    """Prints the table and appends it to OUT/fault-inject/NAME.md."""
    summary = table(rows, intro)
    print("\n" + summary)
    with open(os.path.join(logdir, f"{name}.md"), "a") as f:
        f.write(summary + "\n")


def merge_main(a):
    docs = []
    for path in a.merge:
        with open(path) as f:
            docs.append(json.load(f))
    rows, (timeout, slack) = merge_rows(docs)
    logdir = os.path.join(a.out, "fault-inject")
    os.makedirs(logdir, exist_ok=True)
    runs = sum(r["runs"] for r in rows)
    intro = (f"fault injection, {runs} runs merged from {', '.join(a.merge)}; times are the slowest "
             f"survivor's, from the signal to its exit; pass within {timeout + slack} s "
             f"(MSCCLPP_DEVICE_WAIT_TIMEOUT={timeout})")
    write_table(logdir, rows, intro, name="merged")
    with open(os.path.join(logdir, "merged.json"), "w") as f:
        json.dump({"timeout": timeout, "slack": slack, "configurations": rows}, f, indent=1)
    return 0 if all(r["passed"] == r["runs"] for r in rows) else 1


def parse_configs(a):
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
    for nranks, sig, workload, _ in configs:
        if sig not in SIGNALS:
            raise SystemExit(f"unknown signal {sig} (KILL, STOP)")
        if workload not in WORKLOADS and not a.bench_args:
            raise SystemExit(f"unknown workload {workload!r} ({', '.join(WORKLOADS)})")
        if nranks > a.parallel_ranks:
            raise SystemExit(f"{nranks} ranks do not fit under --parallel-ranks {a.parallel_ranks}")
        if not 0 <= (a.victim if a.victim >= 0 else nranks - 1) < nranks:
            raise SystemExit(f"--victim {a.victim} is not a rank of {nranks}")
    return list(dict.fromkeys(configs))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default=".gpu/bin/mscclpp-bench")
    p.add_argument("--ep-program", default=EP_PROGRAM, help="the EP workloads' program (default: "
                   "python/tests/ep_fault_loop.py beside this script, as gpu-stage.sh copies it, "
                   "or in the repository)")
    p.add_argument("--ranks", default="2", help="comma list of rank counts (default 2)")
    p.add_argument("--signals", default="KILL,STOP", help="KILL, STOP (comma list)")
    p.add_argument("--workloads", default="eager,graph", help=f"{', '.join(WORKLOADS)} (comma list)")
    p.add_argument("--mps", default="0", help="0, 1 or 0,1: without / with an MPS server")
    p.add_argument("--config", action="append", default=[], help="RANKS:SIGNAL:WORKLOAD:MPS, e.g. "
                   "4:KILL:graph:0 (repeatable): run these configurations instead of every "
                   "combination of --ranks, --signals, --workloads and --mps")
    p.add_argument("--runs", type=int, default=3, help="runs per configuration")
    p.add_argument("--parallel-ranks", type=int, default=16, help="at most this many bench processes "
                   "at once (worlds run side by side while they fit; 8 with 8-rank worlds: one at a "
                   "time)")
    p.add_argument("--mps-share", type=int, default=0, help="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of "
                   "each MPS client (default: its world's share, 100 x GPUs / ranks)")
    p.add_argument("--victim", type=int, default=-1, help="rank to signal (default: the last)")
    p.add_argument("--delay", type=float, default=0.0, help="seconds from launch to the signal "
                   "(default: --settle seconds after rank 0's table header)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds from rank 0's table header "
                   "to the signal (warm-up call, graph capture, a full launch queue; a run whose "
                   "survivors never reached the timed loop fails, so too short shows)")
    p.add_argument("--budget", type=float, default=0.0, help="seconds for the whole command "
                   "(0: no limit); worlds that would not end in time are not started")
    p.add_argument("--missing-from", action="append", default=[], metavar="SUMMARY_JSON",
                   help="run only what these earlier summaries lack to reach --runs per configuration")
    p.add_argument("--timeout", type=int, default=2, help="MSCCLPP_DEVICE_WAIT_TIMEOUT (seconds)")
    p.add_argument("--slack", type=float, default=2.0, help="allowed beyond the timeout (seconds)")
    p.add_argument("--bootstrap-timeout", type=int, default=30, help="MSCCLPP_BOOTSTRAP_TIMEOUT")
    p.add_argument("--start-limit", type=float, default=30.0, help="seconds from launch to rank 0's "
                   "table header before a run counts as failed to start")
    p.add_argument("--hang-after", type=float, default=15.0, help="seconds after the signal before "
                   "a survivor counts as hung (and is killed)")
    p.add_argument("--size", default="8M", help="message size of the eager and graph workloads "
                   "(a SIGSTOPped rank's already-queued kernels still run: larger messages make its "
                   "queue, and so the survivors' time, longer)")
    p.add_argument("--cache-dir", default="/tmp/mscclpp-cache")
    p.add_argument("--bench-args", default="", help="the bench's arguments instead of a workload's "
                   "(e.g. 'bootstrap --iters 100000000' checks bootstrap liveness without a GPU)")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU probe after each phase")
    p.add_argument("--merge", nargs="+", metavar="SUMMARY_JSON", help="merge earlier summaries into "
                   "OUT/fault-inject/merged.{md,json} and exit (no GPU needed)")
    p.add_argument("--out", default=os.environ.get("OUT", "./gpu-out"), help="logs go to OUT/fault-inject/")
    a = p.parse_args()
    if a.merge:
        return merge_main(a)

    command_start = time.monotonic()
    configs = parse_configs(a)
    a.have = {}
    if a.missing_from:
        docs = []
        for path in a.missing_from:
            with open(path) as f:
                docs.append(json.load(f))
        for row in merge_rows(docs)[0]:
            a.have[key_of(row)] = row["runs"]
    ngpu = 1 if a.no_gpu else gpu_count()
    # Under MPS with more than 2 ranks a GPU, port_allreduce refuses to start (its proxy's copies
    # can queue behind the kernels that wait for them: port_channel::shared_queue_hazard), so
    # there is no PortChannel traffic to fail in; the suite checks that refusal.
    refused = [c for c in configs if c[3] and c[2] in TWO_HOSTS
               and -(-c[0] // ngpu) > MPS_PORT_RANKS_PER_GPU]
    for c in refused:
        print(f"{config_name(c)}: not run: port_allreduce refuses more than "
              f"{MPS_PORT_RANKS_PER_GPU} ranks a GPU under MPS", flush=True)
    configs = [c for c in configs if c not in refused]
    if not configs:
        raise SystemExit("nothing to run")
    logdir = os.path.join(a.out, "fault-inject")
    os.makedirs(logdir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="mscclpp-fault-")
    rundir = os.path.join(workdir, "logs")
    os.makedirs(rundir)
    # A handful of files come back from a device call: every rank's whole log stays in rundir;
    # logdir gets the summary and, in two files, the failed runs' logs and one passing run's
    # per configuration (each rank's log shortened to its first and last lines).
    logs = {"failures": os.path.join(logdir, "failures.log"),
            "passes": os.path.join(logdir, "passes.log")}
    for path in logs.values():
        open(path, "a").close()
    print(f"fault injection: {ngpu} GPU(s), MSCCLPP_DEVICE_WAIT_TIMEOUT={a.timeout}, pass within "
          f"{a.timeout + a.slack} s, {a.runs} run(s) per configuration, at most {a.parallel_ranks} "
          f"ranks at once; summary and kept logs in {logdir}, every log in {rundir}", flush=True)

    configs = [c for c in configs if a.runs - a.have.get(c, 0) > 0]
    if not configs:
        print("every configuration already has its runs (--missing-from)")
        return 0
    rows = {cfg: new_row(cfg) for cfg in configs}
    ports, durations, not_started = Ports(), {}, 0
    phases = [(mps, [c for c in configs if c[3] == mps]) for mps in (False, True)]
    phases = [(mps, cs) for mps, cs in phases if cs]
    # A budget is shared among the phases by their share of the work (rank-runs, STOP counting
    # double: it waits for the liveness timeout).
    work = [sum(c[0] * (2 if c[1] == "STOP" else 1) * max(0, a.runs - a.have.get(c, 0)) for c in cs)
            + 1 for _, cs in phases]
    # Add to an earlier command's summary in the same OUT (several commands in one device call).
    path = os.path.join(logdir, "summary.json")
    earlier = []
    if os.path.exists(path):
        with open(path) as f:
            earlier = [json.load(f)]

    def save():
        mine = {"timeout": a.timeout, "slack": a.slack, "configurations": list(rows.values())}
        all_rows, _ = merge_rows(earlier + [mine])
        with open(path, "w") as f:
            json.dump({"timeout": a.timeout, "slack": a.slack, "configurations": all_rows}, f,
                      indent=1)
        return all_rows

    def interrupt(signum, frame):
        # Acted on by run_worlds between steps, never in the middle of starting a process.
        TERMINATED.append(signum)

    signal.signal(signal.SIGTERM, interrupt)
    interrupted = None
    try:
        for i, (mps, cs) in enumerate(phases):
            deadline = float("inf")
            if a.budget > 0:
                left = command_start + a.budget - time.monotonic()
                deadline = time.monotonic() + left * work[i] / sum(work[i:])
            not_started += run_phase(a, mps, cs, rows, ngpu, workdir, rundir, logs, ports,
                                     deadline, durations)
            save()  # a call cut short still brings back every finished phase
    except (Interrupted, KeyboardInterrupt) as e:
        interrupted = str(e) or "Ctrl-C"
        print(f"INTERRUPTED ({interrupted}): the summary has the runs that finished", flush=True)
        kill_running()
    all_rows = save()
    intro = (("INTERRUPTED: " if interrupted else "") +
             f"fault injection: {time.monotonic() - command_start:.0f} s in all, at most "
             f"{a.parallel_ranks} ranks at once (several worlds side by side); times are the "
             f"slowest survivor's, from its world's signal to its exit (\"loop stopped\": to the "
             f"moment its timed loop stopped on the failure; \"torn down\": to the end of its "
             f"draining and teardown; the rest is the process's exit); "
             f"pass within {a.timeout + a.slack} s (MSCCLPP_DEVICE_WAIT_TIMEOUT={a.timeout}), "
             f"settle {a.settle} s" + (f"; {not_started} run(s) not started (budget)"
                                       if not_started else ""))
    write_table(logdir, all_rows, intro)
    mine_ok = not interrupted and all(r["passed"] == r["runs"] for r in rows.values()) and all(
        u in HEALTHY for r in rows.values() for u in r["gpu_usable_after"])
    if not mine_ok:
        return 1
    return 2 if not_started else 0


if __name__ == "__main__":
    sys.exit(main())
