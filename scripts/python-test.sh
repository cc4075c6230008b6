#!/usr/bin/env bash
# The Python package's CPU check: builds the wheel with maturin (dev profile, cargo's target dir, so
# the workspace's compiled dependencies are reused), installs it into a fresh venv with pytest, and
# runs python/tests there. No GPU or CUDA toolkit needed.
set -euo pipefail
cd "$(dirname "$0")/.."
# The environment of scripts/test.sh (CUDA_HOME is an input of dependencies' build scripts), so
# cargo reuses what the test run compiled instead of rebuilding it for the wheel.
# shellcheck source=scripts/nvrtc-env.sh
source scripts/nvrtc-env.sh >/dev/null
# shellcheck source=scripts/python-tools.sh
source scripts/python-tools.sh
rm -rf target/wheels
"$py_tools/bin/maturin" build -q -m python/Cargo.toml --profile dev -o target/wheels
venv=target/py-venv
rm -rf "$venv" && python3 -m venv "$venv"
"$venv/bin/pip" install -q pytest target/wheels/mscclpp_rs-*.whl
# Run from outside the source tree so the installed package, not python/mscclpp, is imported.
# pytest's exit 5 (no tests collected) fails like any other non-zero status.
(cd target && "../$venv/bin/python" -m pytest -q ../python/tests)
