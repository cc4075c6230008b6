#!/usr/bin/env python3
"""CPU test of scripts/fault-inject.py: its scheduling, timing and verdicts against a fake bench
(a few lines of Python standing in for mscclpp-bench, no GPU). Run by scripts/test.sh (~20 s).

The fake bench: rank 0 listens on MASTER_PORT + 1, the other ranks connect and send a heartbeat
every 0.1 s; rank 0 blames a rank whose connection closes ("died") or who is silent for
MSCCLPP_DEVICE_WAIT_TIMEOUT seconds ("stalled") and tells the others, and every rank then logs the
bench's timestamped "the timed loop stopped" and "torn down" warnings and its error line, and exits
1. FAKE_MODE makes it misbehave: `early` (rank 1 fails before any signal), `hang` (survivors never exit),
`noloop` (no "timed loop stopped" line), `setup` (the bench's set-up line
instead: the signal landed in the graph capture), `fault` (a context fault logged before the error),
`slowexit` (every rank exits 2.5 s after its error)."""

import json
import os
import subprocess
import sys
import tempfile
import time

FAKE_BENCH = r'''#!/usr/bin/env python3
import datetime, os, select, socket, sys, time
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
port = int(os.environ["MASTER_PORT"]) + 1
timeout = float(os.environ["MSCCLPP_DEVICE_WAIT_TIMEOUT"])
mode = os.environ.get("FAKE_MODE", "")
if not any(x in sys.argv for x in ("1000000", "100000000")):
    time.sleep(0.2)  # a warm-up job: a few calls, then a clean exit
    sys.exit(0)

def fail(msg):
    if mode == "hang":
        time.sleep(3600)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")
    if mode == "fault":
        print("WARN drop: cuMemFree: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access", flush=True)
    if mode == "setup":
        print(f"{stamp}Z  WARN mscclpp::bench: rank {rank}: the timed loop's set-up stopped in the "
              f"graph capture: {msg}", flush=True)
    elif mode != "noloop":
        print(f"{stamp}Z  WARN mscclpp::bench: rank {rank}: the timed loop stopped: {msg}", flush=True)
    if mode != "noloop":
        time.sleep(0.1)  # teardown
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")
        print(f"{stamp}Z  WARN mscclpp::bench: torn down (rank {rank}), exiting on the error", flush=True)
    print(f"mscclpp-bench (rank {rank}): error: communicator aborted: rank {rank}: {msg}", flush=True)
    if mode == "slowexit":
        time.sleep(2.5)  # an exit that outlasts --hang-after (a slow context teardown, say)
    sys.exit(1)

if rank == 0:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(n)
    peers = {}
    while len(peers) < n - 1:
        c, _ = srv.accept()
        peers[int(c.recv(1)[0])] = c
    print("# rank 0 thread: fake", flush=True)
    heard = {r: time.monotonic() for r in peers}
    started = time.monotonic()
    while True:
        ready, _, _ = select.select(list(peers.values()), [], [], 0.05)
        for r, c in list(peers.items()):
            if c in ready:
                if not c.recv(64):
                    blame = f"rank {r} died: its bootstrap connection closed unexpectedly"
                    break
                heard[r] = time.monotonic()
        else:
            late = [r for r in peers if time.monotonic() - heard[r] > timeout]
            if mode == "early" and time.monotonic() - started > 0.05:
                late = [1]
            if not late:
                continue
            blame = f"rank {late[0]} stalled: no heartbeat for {timeout} s"
        for c in peers.values():
            try:
                c.sendall(blame.encode() + b"\n")
            except OSError:
                pass
        fail(blame)
else:
    deadline = time.monotonic() + 10
    while True:
        try:
            c = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    c.sendall(bytes([rank]))
    while True:
        if select.select([c], [], [], 0.1)[0]:
            data = c.recv(4096)
            fail(data.decode().strip() if data else "rank 0 died: its bootstrap connection closed")
        c.sendall(b".")
'''

HERE = os.path.dirname(os.path.abspath(__file__))


def run(tmp, name, args, env=None):
    out = os.path.join(tmp, name)
    cmd = [sys.executable, os.path.join(HERE, "fault-inject.py"), "--bench", os.path.join(tmp, "bench"),
           "--no-gpu", "--timeout", "1", "--settle", "0.2", "--out", out] + args
    start = time.monotonic()
    r = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                       timeout=120)
    took = time.monotonic() - start
    path = os.path.join(out, "fault-inject", "summary.json")
    rows = {}
    if os.path.exists(path):
        with open(path) as f:
            rows = {row["configuration"]: row for row in json.load(f)["configurations"]}
    return r, rows, took, path


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def check(cond, what, r=None):
    if not cond:
        if r is not None:
            lines = r.stdout.splitlines()
            print("\n".join(l for l in lines if "FAIL" in l or "error" in l)[-6000:])
            print(r.stdout[-3000:], r.stderr[-3000:])
        raise SystemExit(f"FAIL: {what}")
    print(f"ok: {what}")


def main():
    tmp = tempfile.mkdtemp(prefix="fault-inject-test-")
    bench = os.path.join(tmp, "bench")
    with open(bench, "w") as f:
        f.write(FAKE_BENCH)
    os.chmod(bench, 0o755)

    # Seven worlds' worth of runs, 8 processes at once: everything passes, times as designed.
    configs = ["2:KILL:eager:0", "2:STOP:graph:0", "4:KILL:port:0", "4:STOP:eager:0"]
    r, rows, took, first = run(tmp, "a", ["--runs", "3", "--parallel-ranks", "8"]
                               + [x for c in configs for x in ("--config", c)])
    check(r.returncode == 0, "every run passes (exit 0)", r)
    check(sum(row["runs"] for row in rows.values()) == 12 and
          all(row["passed"] == 3 for row in rows.values()), "3 of 3 runs per configuration", r)
    kill = rows["2 ranks KILL eager no MPS"]["times"] + rows["4 ranks KILL port  no MPS"]["times"]
    stop = rows["2 ranks STOP graph no MPS"]["times"] + rows["4 ranks STOP eager no MPS"]["times"]
    check(max(kill) < 1.0 and 0.9 < min(stop) and max(stop) < 2.0,
          f"KILL noticed in {min(kill):.2f}-{max(kill):.2f} s, STOP in {min(stop):.2f}-{max(stop):.2f} s")
    check(rows["4 ranks STOP eager no MPS"]["kinds"] == {"stalled": 9}, "STOP errors are 'stalled'")
    check(all(len(row["torn_down"]) == 3 and
              all(t - n >= 0.09 for n, t in zip(row["noticed"], row["torn_down"]))
              for row in rows.values()), "the teardown's end is timed, after the loop stopped")
    check(all(v.startswith("continued, exited by itself")
              for v in rows["2 ranks STOP graph no MPS"]["victim"]), "a stopped victim exits by itself")

    # The EP workloads run their own program (--ep-program; here the fake bench), the hosts one
    # on two simulated hosts.
    r, rows, _, _ = run(tmp, "ep", ["--runs", "1", "--ep-program", bench, "--config",
                                    "2:KILL:ep:0", "--config", "4:STOP:ep-hosts:0",
                                    "--config", "2:STOP:ep-ll:0"])
    check(r.returncode == 0 and sum(row["passed"] for row in rows.values()) == 3
          and len(rows) == 3, f"the EP workloads pass ({sorted(rows)})", r)

    # Six 2-rank worlds at once: one after another they would take 6 x (settle + timeout) = 7.2 s.
    r, rows, took, _ = run(tmp, "side", ["--runs", "6", "--parallel-ranks", "12", "--config",
                                         "2:STOP:eager:0"])
    check(r.returncode == 0 and took < 5.0, f"6 STOP runs side by side in {took:.1f} s", r)

    # A rank failing before the signal, a hang, a missing loop line and a set-up that stopped
    # instead (named) are failures.
    # `early` fails 0.05 s after start: the run ends before the signal or, on a loaded machine,
    # stops its loop before it and exits after it; both are named.
    for mode, reason in (("early", "before the signal"), ("hang", "hang"),
                         ("noloop", "no 'timed loop stopped' line"),
                         ("setup", "before the timed loop, in the graph capture (raise --settle)"),
                         ("fault", "context faulted")):
        r, rows, _, _ = run(tmp, mode, ["--runs", "1", "--config", "2:KILL:eager:0", "--hang-after",
                                        "2"], {"FAKE_MODE": mode})
        row = rows["2 ranks KILL eager no MPS"]
        check(r.returncode == 1 and row["passed"] == 0 and any(reason in k for k in row["reasons"]),
              f"FAKE_MODE={mode}: the run fails ({row['reasons']})", r)
        if mode == "hang":
            with open(os.path.join(tmp, mode, "fault-inject", "failures.log")) as f:
                log = f.read()
            check("still running 2 s after the signal (it was killed at the world's end); its "
                  "threads then:" in log and "thread " in log,
                  "a hung survivor's threads are in failures.log", r)

    # A survivor that exits after --hang-after while the stopped victim runs again is timed (a
    # slow exit), not counted as a hang, and its threads at --hang-after are in the log.
    r, rows, _, _ = run(tmp, "slowexit", ["--runs", "1", "--config", "2:STOP:eager:0",
                                          "--hang-after", "2"], {"FAKE_MODE": "slowexit"})
    row = rows["2 ranks STOP eager no MPS"]
    with open(os.path.join(tmp, "slowexit", "fault-inject", "failures.log")) as f:
        log = f.read()
    check(r.returncode == 1 and any(k.startswith("took ") for k in row["reasons"])
          and "still running 2 s after the signal (it exited 3." in log,
          f"a slow exit is timed, not a hang ({row['reasons']})", r)

    # PortChannel traffic under MPS at more than 2 ranks a GPU is refused by the library: not run.
    r, _, _, _ = run(tmp, "mpsport", ["--runs", "1", "--config", "4:KILL:port:1"])
    check(r.returncode != 0 and "refuses more than 2 ranks a GPU under MPS" in r.stdout
          and "nothing to run" in r.stderr, "port under MPS at 4 ranks a GPU is not run", r)

    # A budget too small for every run: the rest is reported as not started, then run by
    # --missing-from, and the summaries merge into 6 runs of that configuration.
    r, rows, _, cut = run(tmp, "budget", ["--runs", "6", "--budget", "6", "--parallel-ranks",
                                           "2", "--config", "2:STOP:eager:0"])
    row = rows["2 ranks STOP eager no MPS"]
    check(r.returncode == 2 and row["passed"] == row["runs"] and row["not_started"] == 6 - row["runs"]
          and 1 <= row["runs"] < 6, f"budget: {row['runs']} run(s), {row['not_started']} not started", r)
    r, rows, _, rest = run(tmp, "rest", ["--runs", "6", "--missing-from", cut,
                                         "--config", "2:STOP:eager:0"])
    check(r.returncode == 0 and rows["2 ranks STOP eager no MPS"]["runs"] == 6 - row["runs"],
          "--missing-from runs the rest", r)
    out = os.path.join(tmp, "merged")
    m = subprocess.run([sys.executable, os.path.join(HERE, "fault-inject.py"), "--merge", cut, rest,
                        first, "--out", out], capture_output=True, text=True)
    with open(os.path.join(out, "fault-inject", "merged.json")) as f:
        merged = {row["configuration"]: row for row in json.load(f)["configurations"]}
    row = merged["2 ranks STOP eager no MPS"]
    check(m.returncode == 0 and row["runs"] == 6 and row["not_started"] == 0 and len(row["times"]) == 6
          and len(merged) == 5, "--merge adds the runs up per configuration", m)

    # SIGTERM (a device call's limit): the bench processes go, the finished runs are written.
    out = os.path.join(tmp, "term")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "fault-inject.py"), "--bench", bench,
                             "--no-gpu", "--timeout", "1", "--settle", "0.2", "--out", out, "--runs",
                             "1000", "--config", "2:KILL:eager:0"], stdout=subprocess.DEVNULL)
    # Terminated once a run has finished (its pass is logged), long before the 1000 could: a fixed
    # sleep let a fast machine finish every run first.
    passes = os.path.join(out, "fault-inject", "passes.log")
    deadline = time.time() + 60
    while time.time() < deadline and not (os.path.exists(passes) and os.path.getsize(passes) > 0):
        time.sleep(0.05)
    proc.terminate()
    rc = proc.wait(timeout=30)
    with open(os.path.join(out, "fault-inject", "summary.json")) as f:
        runs = json.load(f)["configurations"][0]["runs"]
    with open(os.path.join(out, "fault-inject", "summary.md")) as f:
        marked = f.read().startswith("INTERRUPTED")
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and bench in cmdline(pid)]
    check(rc == 1 and marked and 1 <= runs < 1000 and not left,
          f"SIGTERM: exit 1, {runs} finished run(s) written, no bench process left ({left})")


if __name__ == "__main__":
    main()
