#!/usr/bin/env bash
# The embedded library's GPU checks, on the GPU machine from the repository root, after
# `bash scripts/gpu-stage.sh` (which packages libmscclpp_embed into .gpu/embed/):
#   [NRANKS="2 4 8"] [MPS=1] bash .gpu/embed/gpu-run.sh [gpu|kill|all]
# Builds tests/c/stack.c (a host stack in RCCL's shape) with gcc against the static library and
# the CUDA runtime, then for each world size runs its ranks on one GPU (rank % GPU count):
#   gpu   every all-reduce size on both paths (ours below 1 MiB, the stack's ring above), in and
#         out of place, every element checked; a CUDA graph replayed; the algorithm collection
#         by name (with a geometry), and the builder's execution plan for that world size;
#   kill  one rank SIGKILLed while all loop on all-reduces: every survivor must get an error
#         (its bootstrap tells it, it aborts our communicator) within 60 s, never hang.
# Logs go to $OUT (or ./gpu-out). Exit status: 0 when every run passed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# SAFETY: NVLink multicast can take shared GPUs out of service; it stays off.
export NCCL_NVLS_ENABLE=0 MSCCLPP_FORCE_DISABLE_NVLS=1
unset MSCCLPP_ENABLE_NVLS MSCCLPP_NCCL_LIB_PATH
export MSCCLPP_CACHE_DIR="${MSCCLPP_CACHE_DIR:-/tmp/mscclpp-cache}"
export STACK_PLAN_DIR="${STACK_PLAN_DIR:-$here/../builder-plans}"
out="${OUT:-./gpu-out}"; mkdir -p "$out"
what="${1:-all}"
cuda="${CUDA_HOME:-/usr/local/cuda}"
if [ ! -f "$cuda/include/cuda_runtime.h" ] && command -v nvcc >/dev/null; then
  cuda="$(dirname "$(dirname "$(command -v nvcc)")")"
fi
exe=/tmp/embed-stack lib=/tmp/libmscclpp_embed.a
# gpu-stage.sh ships the archive gzipped.
if [ -f "$here/lib/libmscclpp_embed.a.gz" ]; then gunzip -c "$here/lib/libmscclpp_embed.a.gz" > "$lib"; else lib="$here/lib/libmscclpp_embed.a"; fi
# shellcheck disable=SC2046
gcc -std=c11 -O2 -Wall -Wextra -Werror -DSTACK_CUDA -I"$here/include" -I"$cuda/include" "$here/stack.c" \
  "$lib" -L"$cuda/lib64" -lcudart -Wl,-rpath,"$cuda/lib64" $(cat "$here/link-flags") \
  -o "$exe" || { echo "FAIL: building the stack"; exit 1; }
ngpu=$(nvidia-smi -L | wc -l)
rc=0
for n in ${NRANKS:-2 4 8}; do
  if [ "${MPS:-0}" = 1 ]; then
    # shellcheck source=scripts/mps.sh
    source "$here/../mps.sh"
    start_mps "$n" "$ngpu"
  fi
  for mode in gpu kill; do
    [ "$what" = all ] || [ "$what" = "$mode" ] || continue
    echo "== stack $mode, $n ranks on $ngpu GPU(s), MPS=${MPS:-0}"
    timeout 600 "$exe" "$mode" "$n" 2>&1 | tee "$out/embed-$mode-$n.log"
    status=${PIPESTATUS[0]}
    [ "$status" = 0 ] || { echo "FAIL: stack $mode $n (exit $status; 124: the launcher timed out)"; rc=1; }
  done
  if [ "${MPS:-0}" = 1 ]; then stop_mps; fi
done
exit $rc
