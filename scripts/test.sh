#!/usr/bin/env bash
# The test command of the README: every CPU test of the workspace, with every kernel compiled through
# NVRTC (installed from PyPI, no GPU needed) and for AMD GPUs through hiprtc and clang (Debian 12).
# GPU tests print why they skip on a machine without GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/nvrtc-env.sh
source scripts/nvrtc-env.sh
# The HIP compile gate's toolchain (Debian 12 packages; every kernel for gfx90a and gfx942).
# shellcheck source=scripts/hip-env.sh
source scripts/hip-env.sh
export MSCCLPP_DISABLE_IB_TESTS="${MSCCLPP_DISABLE_IB_TESTS:-1}"
cargo test --workspace --all-targets "$@"
# The CUDA 12 NVRTC must compile the same kernels (users run CUDA 12 and CUDA 13): every unit of
# mscclpp-kernels-cu for sm_90 (a CUBIN where the code differs by toolkit, the front end for the
# rest: kernels_compile.rs's optimised_everywhere), and every collective variant through the front
# end, where the two toolkits' headers and C++ differ (the other architectures and the optimised
# collective units ran with CUDA 13 above). The layout asserts need __builtin_offsetof, which NVRTC only has from
# 13.5, so they run in the pass above.
if [ "${MSCCLPP_SKIP_CU12:-0}" != 1 ]; then
  MSCCLPP_NVRTC_FLAVOUR=cu12 bash -c 'source scripts/nvrtc-env.sh \
    && MSCCLPP_GATE_ARCH=sm_90 cargo test -p mscclpp-cuda --test kernels_compile every_kernel_unit_compiles \
    && cargo test -p mscclpp-collectives --test nvrtc every_collective_variant_passes_the_front_end'
fi
# The AMD code objects the release wheel embeds: every default unit linked for gfx90a and gfx942
# (scripts/aot-blob.sh --hip, ~90 s on two cores, kept under target/aot while no kernel changes),
# then the ROCm backend built with them, whose tests check the blob against the runtime's keys and
# that build_module loads the device's embedded code object (against the fake HIP library).
# (A plain assignment first: a failing substitution in front of a command would not stop the
# script, and the tests would run without the blob.)
hip_blob=$(MSCCLPP_AOT_PROFILE=dev bash scripts/aot-blob.sh --hip | tail -n 1)
MSCCLPP_AOT_HIP_BLOB="$hip_blob" cargo test -p mscclpp-rocm --lib --test fake_hip
# The fault-injection script's scheduling, timing and verdicts against a fake bench (~20 s, no GPU).
python3 scripts/fault-inject-test.py
# The timing tools of the same-run comparisons (torch_bench.py compare, gpu-run.sh nccl bench,
# plan-bench.py) against fakes (~3 s, no torch, no GPU).
python3 scripts/bench-tools-test.py
# docs/performance.md and the environment table of docs/environment.md are generated (from
# bench/results/*.json and core/src/env.rs): fail when either is stale or a relative link between
# the pages is broken, and test the generator (<1 s).
python3 scripts/docs-gen.py --check
python3 scripts/docs-gen-test.py
