#!/usr/bin/env bash
# Builds the release binaries the GPU machine runs and copies them into .gpu/ (ignored by git; the
# device tool carries it). The GPU machine has no Rust: everything it runs is built here.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p mscclpp-bench -p mscclpp-tests --bins
rm -rf .gpu && mkdir -p .gpu/bin
for b in mscclpp-bench mscclpp-gpu-suite; do
  if [ -x "target/release/$b" ]; then cp "target/release/$b" .gpu/bin/; fi
done
# The device tool carries at most 64 MiB; debug info is most of each binary (symbols stay, so
# backtraces still name functions).
if command -v strip >/dev/null; then strip --strip-debug .gpu/bin/*; fi
cp scripts/gpu-run.sh scripts/simulate-hosts.sh scripts/fault-inject.py .gpu/
ls -la .gpu/bin
