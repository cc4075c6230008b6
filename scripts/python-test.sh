#!/usr/bin/env bash
# The Python package's CPU check: builds the wheel users get (scripts/build-wheel.sh, dev profile:
# the extension, the NCCL shim, manylinux_2_28), checks it as a user meets it
# (scripts/wheel-check.sh: fresh venv without Rust, import, version, `--nccl-lib`, the shim's
# exports, the README example as far as it runs without a GPU), then adds pytest to that venv and
# runs python/tests there. No GPU or CUDA toolkit needed. mscclpp.ext.ep's CPU tests need torch,
# which the package does not: they run again in a venv of their own with torch (kept in target/,
# torch installed once, the same wheel put in each run), and are skipped in the first. Last, the
# aarch64 wheel (zig cross-links it) gets the same user's checks under qemu's user-mode emulation
# (scripts/emu-python-root.sh), where rustup can add the aarch64 standard library.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/nvrtc-env.sh
source scripts/nvrtc-env.sh >/dev/null
rm -rf target/wheels
whl=$(bash scripts/build-wheel.sh --profile dev -o target/wheels | tail -n 1)
venv=target/py-venv
bash scripts/wheel-check.sh "$whl" "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check pytest
# Run from outside the source tree so the installed package, not python/mscclpp, is imported.
# pytest's exit 5 (no tests collected) fails like any other non-zero status.
(cd target && "../$venv/bin/python" -m pytest -q ../python/tests)
tvenv=target/py-venv-torch
[ -x "$tvenv/bin/python" ] || python3 -m venv "$tvenv"
"$tvenv/bin/python" -c 'import torch, pytest' 2>/dev/null ||
  "$tvenv/bin/pip" install -q --disable-pip-version-check torch pytest
"$tvenv/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$whl"
(cd target && "../$tvenv/bin/python" -m pytest -q ../python/tests/test_ep_cpu.py)
if rustup target add aarch64-unknown-linux-gnu >/dev/null 2>&1; then
  arm_whl=$(bash scripts/build-wheel.sh --profile dev --arch aarch64 -o target/wheels | tail -n 1)
  if ! command -v qemu-aarch64-static >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-user-static >/dev/null
  fi
  emu_root="${XDG_CACHE_HOME:-$HOME/.cache}/mscclpp-emu/aarch64"
  bash scripts/emu-python-root.sh aarch64 "$emu_root"
  MSCCLPP_EMU_ROOT="$emu_root" bash scripts/wheel-check.sh "$arm_whl" target/py-site-aarch64
else
  echo "python-test: skipping the aarch64 wheel: rustup cannot add aarch64-unknown-linux-gnu here"
fi
