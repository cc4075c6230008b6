#!/usr/bin/env bash
# Builds the blob of kernels compiled ahead of time (aot/, `mscclpp-aot`) that release builds
# embed (MSCCLPP_AOT_BLOB at build time, see backend-cuda/src/aot.rs), with the NVRTC of
# scripts/nvrtc-env.sh, or with --hip the AMD code objects (MSCCLPP_AOT_HIP_BLOB,
# backend-rocm/src/aot.rs), and prints its path last. The blob is kept under target/aot/, one per
# set of architectures; the tool leaves it as it is when it holds exactly what it would compile
# (its keys hash the sources, headers and options), so a build with no kernel changed takes
# seconds.
#
# Usage: scripts/aot-blob.sh [ARCHS [PTX]]
#        scripts/aot-blob.sh --hip [TARGETS]
#   ARCHS    CUBIN targets, comma-separated (default sm_80,sm_90,sm_100,sm_120)
#   PTX      PTX targets for newer GPUs (default compute_120; `none` for none)
#   --hip    AMD code objects instead, by clang-19 and ROCm 6.0's device libraries
#            (scripts/hip-env.sh), for TARGETS (default gfx90a,gfx942); backend-rocm embeds them
#            under MSCCLPP_AOT_HIP_BLOB. About 3 min of CPU for both targets (90 s on two cores).
# Four architectures and PTX take about 15 min of CPU (half that on two cores); sm_90 alone, 3.
# MSCCLPP_AOT_PROFILE=dev builds the tool in the test builds' profile (CI, where the release
# profile is not built otherwise; the compilers do the work, not the tool).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p target/aot
if [ "${1:-}" = --hip ]; then
  targets=${2:-gfx90a,gfx942}
  # shellcheck source=scripts/hip-env.sh
  source scripts/hip-env.sh >&2
  blob="$PWD/target/aot/kernels-hip-${targets//,/-}.aot"
  args=(--hip "$targets")
else
  archs=${1:-sm_80,sm_90,sm_100,sm_120}
  ptx=${2:-compute_120}
  # shellcheck source=scripts/nvrtc-env.sh
  source scripts/nvrtc-env.sh >&2
  blob="$PWD/target/aot/kernels-${archs//,/-}-$ptx.aot"
  args=(--archs "$archs" --ptx "$ptx")
fi
profile=${MSCCLPP_AOT_PROFILE:-release}
case "$profile" in
  release) dir=release ;;
  dev) dir=debug ;;
  *) echo "aot-blob: MSCCLPP_AOT_PROFILE must be release or dev, not $profile" >&2; exit 2 ;;
esac
cargo build -q --profile "$profile" -p mscclpp-aot
"${CARGO_TARGET_DIR:-target}/$dir/mscclpp-aot" -o "$blob" "${args[@]}" >&2
echo "$blob"
