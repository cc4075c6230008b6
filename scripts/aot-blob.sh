#!/usr/bin/env bash
# Builds the blob of kernels compiled ahead of time (aot/, `mscclpp-aot`) that release builds
# embed (MSCCLPP_AOT_BLOB at build time, see backend-cuda/src/aot.rs), with the NVRTC of
# scripts/nvrtc-env.sh, and prints its path last. The blob is kept under target/aot/, one per
# set of architectures; the tool leaves it as it is when it holds exactly what it would compile
# (its keys hash the sources, headers and options), so a build with no kernel changed takes
# seconds.
#
# Usage: scripts/aot-blob.sh [ARCHS [PTX]]
#   ARCHS  CUBIN targets, comma-separated (default sm_80,sm_90,sm_100,sm_120)
#   PTX    PTX targets for newer GPUs (default compute_120; `none` for none)
# Four architectures and PTX take about 15 min of CPU (half that on two cores); sm_90 alone, 3.
set -euo pipefail
cd "$(dirname "$0")/.."
archs=${1:-sm_80,sm_90,sm_100,sm_120}
ptx=${2:-compute_120}
# shellcheck source=scripts/nvrtc-env.sh
source scripts/nvrtc-env.sh >&2
blob="$PWD/target/aot/kernels-${archs//,/-}-$ptx.aot"
mkdir -p target/aot
cargo build -q --release -p mscclpp-aot
"${CARGO_TARGET_DIR:-target}/release/mscclpp-aot" -o "$blob" --archs "$archs" --ptx "$ptx" >&2
echo "$blob"
