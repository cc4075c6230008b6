#!/usr/bin/env python3
"""CPU test of scripts/docs-gen.py (run by scripts/test.sh, well under a second): on a scratch copy
of the files it reads,

- `add` wraps a `mscclpp-bench --json` report as a record, drops the rows of older records it
  measures again, deletes a record left with no row, and re-renders docs/performance.md;
- `--check` fails on a stale page, on a superseded row left in a record, on a record with wrong
  elements, and on a variable core/src/env.rs reads but does not document;
- the environment table keeps the text outside its markers and the variables of a row written
  with shared prefixes (`OMPI_COMM_WORLD_RANK _SIZE`) count as documented;
- a relative link to a missing page or heading fails the check (links in HTML comments do not)."""
import contextlib
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile

sys.dont_write_bytecode = True
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAILURES = []


def check(what, ok):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def load():
    spec = importlib.util.spec_from_file_location("docs_gen", os.path.join(ROOT, "scripts", "docs-gen.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ENV_RS = '''//! # Variables
//!
//! | Variable | Field | Values | Default |
//! |---|---|---|---|
//! | `MSCCLPP_A` | `a` | bool; see [`crate::topology`] | false |
//! | `OMPI_COMM_WORLD_RANK _SIZE` | `launcher` | integers | - |
//!
//! After the table.
pub const VARIABLES: &[&str] = &[
    "MSCCLPP_A",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "HOME",
];
'''


def report(sizes, time_us, wrong=0):
    rows = [
        {
            "collective": "allreduce",
            "size_bytes": s,
            "count": s // 2,
            "dtype": "bf16",
            "redop": "sum",
            "root": -1,
            "algorithm": "default_allreduce_packet",
            "out_of_place": {"measured": {"time_us": time_us, "busbw_gbs": 1.0, "wrong": wrong, "nccl_time_us": 2 * time_us}},
            "in_place": "not_requested",
        }
        for s in sizes
    ]
    return {"device": "2 x Test GPU", "nranks": 2, "collective": "allreduce", "mode": "graph (20 calls per graph, 10 replays per batch)",
            "rows": rows, "total_wrong": wrong * len(rows)}


def run(dg, *argv):
    old = sys.argv
    sys.argv = ["docs-gen.py", *argv]
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = dg.main()
    finally:
        sys.argv = old
    return code, err.getvalue()


def main():
    dg = load()
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "core", "src"))
        os.makedirs(os.path.join(tmp, "docs"))
        with open(os.path.join(tmp, "core", "src", "env.rs"), "w") as f:
            f.write(ENV_RS)
        with open(os.path.join(tmp, "docs", "environment.md"), "w") as f:
            f.write(f"# Env\n\nbefore\n\n{dg.BEGIN}\nold\n{dg.END}\n\nafter\n")
        # The pages the generated performance page links to.
        with open(os.path.join(tmp, "CONTRIBUTING.md"), "w") as f:
            f.write("# Contributing\n")
        with open(os.path.join(tmp, "docs", "execution-plans.md"), "w") as f:
            f.write("# Plans\n\n## Performance\n")
        dg.ROOT = tmp
        dg.RECORDS = os.path.join(tmp, "bench", "results")
        dg.PERFORMANCE = os.path.join(tmp, "docs", "performance.md")
        dg.ENV_RS = os.path.join(tmp, "core", "src", "env.rs")
        dg.ENV_DOC = os.path.join(tmp, "docs", "environment.md")

        code, err = run(dg, "--check")
        check("--check fails while the pages are stale", code == 1 and "out of date" in err)
        code, _ = run(dg)
        check("rendering succeeds", code == 0)
        env = open(dg.ENV_DOC).read()
        check("env table rendered between the markers, the text around kept",
              "before" in env and "after" in env and "`MSCCLPP_A`" in env and "old" not in env)
        check("intra-doc links become code spans", "see `crate::topology`" in env)
        check("--check passes once rendered", run(dg, "--check")[0] == 0)

        first = os.path.join(tmp, "r1.json")
        with open(first, "w") as f:
            json.dump(report([1024, 2048], 3.0), f)
        code, err = run(dg, "add", first, "--machine", "2 x Test", "--commit", "aaaaaaa", "--command", "bench A",
                        "--date", "2026-11-01")
        check("add writes a record", code == 0 and len(os.listdir(dg.RECORDS)) == 1)
        perf = open(dg.PERFORMANCE).read()
        check("the page shows the row, its command and commit",
              "| 1 KiB | 3.00 | 6.00 | 0.50 |" in perf and "`bench A`, commit aaaaaaa" in perf)

        second = os.path.join(tmp, "r2.json")
        with open(second, "w") as f:
            r2 = report([1024, 8192], 2.5)
            r2["rows"][1]["out_of_place"] = {"skipped": "the algorithm does not take 8 KiB"}
            json.dump(r2, f)
        code, _ = run(dg, "add", second, "--machine", "2 x Test", "--commit", "bbbbbbb", "--command", "bench B",
                      "--date", "2026-11-02")
        records = [json.load(open(os.path.join(dg.RECORDS, n))) for n in sorted(os.listdir(dg.RECORDS))]
        sizes = sorted((r["commit"], [row["size_bytes"] for row in r["report"]["rows"]]) for r in records)
        check("a newer record supersedes the older one's row of the same size; skipped rows are left out",
              code == 0 and sizes == [("aaaaaaa", [2048]), ("bbbbbbb", [1024])])
        third = os.path.join(tmp, "r3.json")
        with open(third, "w") as f:
            json.dump(report([2048], 2.0), f)
        run(dg, "add", third, "--machine", "2 x Test", "--commit", "ccccccc", "--command", "bench C", "--date", "2026-11-03")
        check("a record whose every row is superseded is deleted",
              sorted(json.load(open(os.path.join(dg.RECORDS, n)))["commit"] for n in os.listdir(dg.RECORDS)) == ["bbbbbbb", "ccccccc"])
        check("--check passes after add", run(dg, "--check")[0] == 0)

        # A superseded row left in a record by hand.
        old = dict(json.load(open(os.path.join(dg.RECORDS, sorted(os.listdir(dg.RECORDS))[0]))))
        old.update(measured_on="2026-10-01", commit="0000000")
        with open(os.path.join(dg.RECORDS, "stale.json"), "w") as f:
            json.dump(old, f)
        code, err = run(dg, "--check")
        check("--check names a superseded row", code == 1 and "superseded" in err and "stale.json" in err)
        os.remove(os.path.join(dg.RECORDS, "stale.json"))

        bad = os.path.join(tmp, "bad.json")
        with open(bad, "w") as f:
            json.dump(report([4096], 1.0, wrong=3), f)
        code, err = run(dg, "add", bad, "--machine", "2 x Test", "--commit", "ddddddd", "--command", "x")
        check("a report with wrong elements is refused", code == 1 and "wrong elements" in err)

        guide = os.path.join(tmp, "docs", "guide.md")
        with open(guide, "w") as f:
            f.write("# Guide\n\n## The `Env` type\n\n[ok](environment.md) [ok](#the-env-type) "
                    "[ok](https://example.invalid/x.md)\n<!-- [later](later.md) -->\n"
                    "[bad](missing.md) [bad](execution-plans.md#nowhere)\n")
        code, err = run(dg, "--check")
        check("--check names broken links and only those",
              code == 1 and "missing.md (no such file)" in err
              and "execution-plans.md#nowhere (no such heading)" in err
              and "later.md" not in err and "#the-env-type" not in err)
        os.remove(guide)

        with open(dg.ENV_RS, "a") as f:
            f.write('pub const OTHER: &[&str] = &[];\n')
        text = open(dg.ENV_RS).read().replace('    "HOME",\n', '    "HOME",\n    "MSCCLPP_NEW",\n')
        with open(dg.ENV_RS, "w") as f:
            f.write(text)
        code, err = run(dg, "--check")
        check("an undocumented variable fails the check, named", code == 1 and "MSCCLPP_NEW" in err)
    if FAILURES:
        print(f"{len(FAILURES)} failed", file=sys.stderr)
        return 1
    print("docs-gen: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
