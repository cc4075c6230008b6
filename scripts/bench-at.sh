#!/usr/bin/env bash
# Builds mscclpp-bench at each commit named and copies it into .gpu/bench-<short hash> (stripped), so
# one device call can time several commits on the same machine: `BENCH_BIN=.gpu/bench-<hash> bash
# .gpu/gpu-run.sh bench ...`, or plan-bench.py's `--bench`. Run it after gpu-stage.sh (which
# empties .gpu/); the device tool carries at most 64 MiB, about five of these beside a staged .gpu.
#   bash scripts/bench-at.sh 37e8921 a379af4 f6a36b7
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: bash scripts/bench-at.sh COMMIT..." >&2; exit 2; }
[ -d .gpu ] || { echo "bench-at: no .gpu/: run scripts/gpu-stage.sh first" >&2; exit 2; }
work=/tmp/bench-at
mkdir -p "$work"
for commit in "$@"; do
  short=$(git rev-parse --short "$commit^{commit}")
  tree="$work/$short"
  [ -d "$tree" ] || git worktree add --detach "$tree" "$short" >/dev/null
  # A target folder per commit. Cargo names a workspace crate's build by its path inside the
  # workspace, not the worktree's, so in a shared folder an older worktree's sources (checked out
  # earlier) looked up to date against a newer commit's build: session 19 timed such a binary as
  # another commit's.
  (cd "$tree" && CARGO_TARGET_DIR="$work/target-$short" cargo build --release -q -p mscclpp-bench)
  cp "$work/target-$short/release/mscclpp-bench" ".gpu/bench-$short"
  if command -v strip >/dev/null; then strip --strip-debug ".gpu/bench-$short"; fi
  echo "bench-at: .gpu/bench-$short ($(git log -1 --format=%s "$short" | cut -c1-70))"
done
git worktree prune
