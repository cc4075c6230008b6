#!/usr/bin/env bash
# Builds the blob of kernels compiled ahead of time (aot/, `mscclpp-aot`) that release builds
# embed (MSCCLPP_AOT_BLOB at build time, see backend-cuda/src/aot.rs), with the NVRTC of
# scripts/nvrtc-env.sh, and prints its path last. The blob is kept under target/aot/ by a hash of
# everything it depends on (the kernel sources, the tool, the key's code, the NVRTC pin and the
# architectures), so a second build with nothing changed takes no time.
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
mapfile -t inputs < <(git ls-files -- kernels-cu aot collectives/src/port_allreduce.rs \
  backend-cuda/src/aot.rs backend-cuda/src/cache.rs backend-cuda/src/nvrtc.rs scripts/nvrtc-env.sh Cargo.lock)
hash=$( (echo "$archs $ptx"; cat "${inputs[@]}") | sha256sum | cut -c1-16)
blob="$PWD/target/aot/kernels-${archs//,/-}-$ptx-$hash.aot"
if [ ! -f "$blob" ]; then
  mkdir -p target/aot
  cargo build -q --release -p mscclpp-aot
  "${CARGO_TARGET_DIR:-target}/release/mscclpp-aot" -o "$blob.tmp" --archs "$archs" --ptx "$ptx" >&2
  mv "$blob.tmp" "$blob"
fi
echo "$blob"
