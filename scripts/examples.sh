#!/usr/bin/env bash
# Builds and runs every program of examples/ (examples/README.md). Without a GPU, building is the
# check and each program prints why it skips; the execution plan is proved on the CPU either way.
# Python: the interpreter given as $1 (one with the mscclpp wheel installed), else skipped with
# the reason. CI runs it after scripts/python-test.sh, with that script's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
# The build of scripts/test.sh (its environment: CUDA_HOME feeds dependencies' build scripts; the
# same packages, so the same features), which holds the examples and the shim: after a test run
# nothing rebuilds.
# shellcheck source=scripts/nvrtc-env.sh
source scripts/nvrtc-env.sh >/dev/null
# A test build leaves its example programs (no harness: examples/Cargo.toml) under hashed names
# only: cargo says which.
examples=$(cargo test -q --workspace --all-targets --no-run --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "example" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])')
example() {
  local path
  path=$(awk -v n="$1" '$1 == n { print $2 }' <<<"$examples" | tail -n 1)
  [ -x "$path" ] || { echo "examples: example $1 was not built" >&2; exit 1; }
  echo "$path"
}
shim="$PWD/target/debug/deps/libmscclpp_nccl.so"
[ -f "$shim" ] || { echo "examples: $shim was not built" >&2; exit 1; }

echo "-- Rust API (examples/rust/allreduce.rs) and an execution plan (examples/rust/execution_plan.rs)"
"$(example allreduce)"
"$(example execution_plan)"

echo "-- C against the NCCL ABI (examples/c/allreduce.c), linked to the shim as libnccl"
# The CUDA runtime's headers and library from PyPI (the NVRTC environment above has no crt/).
venv=.venv-tools
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
  nvidia-cuda-runtime==13.5.37 nvidia-cuda-crt==13.5.37
cuda="$(dirname "$(find "$venv" -path '*/include/crt/host_defines.h' | head -n 1)")/../.."
cudart="$(find "$cuda/lib" -name 'libcudart.so.*' | head -n 1)"
out=target/examples-c
mkdir -p "$out/lib"
ln -sf "$shim" "$out/lib/libnccl.so"
ln -sf "$shim" "$out/lib/libnccl.so.2"
"${CC:-cc}" -std=c11 -Wall -Wextra -Werror examples/c/allreduce.c -I nccl/include -I "$cuda/include" \
  -L "$out/lib" -lnccl -L "$(dirname "$cudart")" -l:"$(basename "$cudart")" \
  -Wl,-rpath,"$PWD/$out/lib" -Wl,-rpath,"$(cd "$(dirname "$cudart")" && pwd)" -o "$out/allreduce"
"$out/allreduce"

echo "-- Python (examples/python/allreduce.py)"
python="${1:-}"
if [ -n "$python" ] && "$python" -c 'import mscclpp' 2>/dev/null; then
  "$python" examples/python/allreduce.py
else
  python3 -c 'import sys; compile(open(sys.argv[1]).read(), sys.argv[1], "exec")' examples/python/allreduce.py
  echo "SKIP: no Python with the mscclpp wheel given (scripts/examples.sh PYTHON); compiled only"
fi
