#!/usr/bin/env bash
# The CI matrix: {CUDA 12, CUDA 13, ROCm 6} x {with IB, without IB}. Each row builds the workspace with
# that row's features and runs the CPU suite; the CUDA rows compile every kernel with that CUDA major's
# NVRTC (from PyPI). Rows without IB set MSCCLPP_DISABLE_IB_TESTS=1 and build without the `ib` feature,
# so the IB-less stub is what answers. The ROCm rows are compile-only (no AMD GPU is lent): the ROCm
# backend's tests against a fake HIP, and the HIP compile gate (every kernel unit for gfx90a through
# hiprtc and for gfx942 through clang-19, toolchain from scripts/hip-env.sh). On GPU hosts (the docker
# images) the same rows run the GPU suite.
# .ci/run runs every row after scripts/test.sh with MSCCLPP_MATRIX_SKIP_GATES=1: the NVRTC and HIP
# compile gates and the feature-independent crates already ran in that job, so each row builds its
# feature set and runs what depends on it.
# Usage: ci/matrix.sh [row ...]   rows: cuda12-ib cuda12-noib cuda13-ib cuda13-noib rocm6-ib rocm6-noib
set -euo pipefail
cd "$(dirname "$0")/.."
rows=("$@")
[ ${#rows[@]} -gt 0 ] || rows=(cuda12-ib cuda12-noib cuda13-ib cuda13-noib rocm6-ib rocm6-noib)
for row in "${rows[@]}"; do
  platform=${row%-*}; ib=${row#*-}
  case "$platform" in
    cuda12) features=cuda; flavour=cu12 ;;
    cuda13) features=cuda; flavour=cu13 ;;
    rocm6) features=rocm; flavour= ;;
    *) echo "unknown row $row" >&2; exit 2 ;;
  esac
  if [ "$ib" = ib ]; then features="$features,ib"; unset MSCCLPP_DISABLE_IB_TESTS; else export MSCCLPP_DISABLE_IB_TESTS=1; fi
  echo "== $row (features: $features)"
  (
    if [ -n "$flavour" ]; then export MSCCLPP_NVRTC_FLAVOUR=$flavour; source scripts/nvrtc-env.sh; fi
    gates="${MSCCLPP_MATRIX_SKIP_GATES:-0}"
    cargo test -p mscclpp --no-default-features --features "$features"
    # Feature-independent; under .ci/run they already ran in the workspace pass.
    if [ "$gates" != 1 ]; then cargo test -p mscclpp-core -p mscclpp-noib; fi
    if [ "$flavour" = cu13 ]; then
      if [ "$gates" = 1 ]; then cargo test -p mscclpp-cuda --lib; else cargo test -p mscclpp-cuda; fi
    fi
    # NVRTC 12 lacks __builtin_offsetof, so the cu12 rows compile the kernels without layout asserts.
    if [ "$flavour" = cu12 ] && [ "$gates" != 1 ]; then
      cargo test -p mscclpp-cuda --test kernels_compile every_kernel_unit_compiles
    fi
    if [ "$platform" = rocm6 ]; then
      if [ "$gates" = 1 ]; then
        cargo test -p mscclpp-kernels-hip --lib
        cargo test -p mscclpp-rocm --lib --test fake_hip
      else
        source scripts/hip-env.sh
        cargo test -p mscclpp-rocm -p mscclpp-kernels-hip
      fi
    fi
  )
done
