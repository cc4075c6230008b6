# Sourced on a lent GPU machine to run several checks in one call (copied into .gpu/ by
# gpu-stage.sh). A lent machine is given back soon after each call and the next one starts bare, so
# one call should carry a whole batch, and its kernel cache should travel to the next call:
#
#   source .gpu/gpu-steps.sh
#   step initall4 120 "NRANKS=4 bash .gpu/gpu-run.sh nccl initall"
#   step suite4 300 "NRANKS=4 MPS=1 bash .gpu/gpu-run.sh suite --only plans"
#   finish
#
# - The NVLink-multicast-off variables are exported for every step (as gpu-run.sh does).
# - The NVRTC kernel cache (MSCCLPP_CACHE_DIR, /tmp/mscclpp-cache) starts from .gpu/kcache.tgz when
#   present; `finish` saves it as OUT/kcache.tgz. Copy that file to .gpu-kcache.tgz at the repository
#   root and gpu-stage.sh puts it into the next .gpu/, so later machines skip the cold compiles (the
#   entries are keyed by source, options, architecture and NVRTC version: stale ones are never used).
# - `step NAME LIMIT COMMAND` runs COMMAND under a LIMIT-second timeout. Its output goes to the
#   terminal and to OUT/steps.log, its verdict (exit code, seconds) to OUT/steps.txt; the files it
#   writes into its own OUT (gpu-run.sh logs, fault-inject summaries) are packed by `finish` into
#   OUT/step-files.tgz. The device tool brings back at most 8 files: these are 4.
# - Lanes: on a machine with several GPUs, independent checks can run side by side, each in a
#   background subshell with its own GPUs and port, e.g.
#     ( export CUDA_VISIBLE_DEVICES=2 PORT=29620; step hosts 250 "HOSTS=2 NRANKS=4 bash .gpu/gpu-run.sh suite --only multi_host" ) &
#   then `wait` before `finish`. Each step's output is also kept whole in its own output.log.
#   Give MPS (MPS=1) to one lane at a time: when a third lane started its MPS server on
#   2026-11-26, two other lanes' MPS clients died of SIGSEGV at that instant (cause not proven).
# - A step whose LIMIT no longer fits in STEPS_BUDGET seconds (default 570) from the first `source`
#   is skipped and said so, so the call ends inside the tool's 600 s limit with every file written.
export NCCL_NVLS_ENABLE=0 MSCCLPP_FORCE_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset MSCCLPP_ENABLE_NVLS
export MSCCLPP_CACHE_DIR="${MSCCLPP_CACHE_DIR:-/tmp/mscclpp-cache}"
steps_out="${OUT:?gpu-steps.sh: OUT must name the folder the device tool brings back}"
steps_files=/tmp/gpu-steps
steps_deadline=$((SECONDS + ${STEPS_BUDGET:-570}))
mkdir -p "$steps_out" "$steps_files" "$MSCCLPP_CACHE_DIR"
if [ -f .gpu/kcache.tgz ]; then
  tar xzf .gpu/kcache.tgz -C "$MSCCLPP_CACHE_DIR" && echo "kernel cache: $(ls "$MSCCLPP_CACHE_DIR" | wc -l) entries restored"
fi

step() {
  local name="$1" limit="$2" command="$3" start=$SECONDS code
  if [ $((SECONDS + limit)) -gt "$steps_deadline" ]; then
    echo "$name: skipped, ${limit} s do not fit in the $((steps_deadline - SECONDS)) s left" | tee -a "$steps_out/steps.txt"
    return 0
  fi
  echo "===== $name (limit ${limit} s): $command" | tee -a "$steps_out/steps.log"
  mkdir -p "$steps_files/$name"
  OUT="$steps_files/$name" timeout -k 10 "$limit" bash -c "$command" 2>&1 |
    tee -a "$steps_out/steps.log" "$steps_files/$name/output.log"
  code=${PIPESTATUS[0]}
  # A step cut by its limit can leave its MPS server (mps.sh) running: the next step must not inherit it.
  # (Each server has the pipe folder of its GPUs, mps.sh; a step in a lane quits only its own.)
  local pipe="/tmp/mps-pipe-${CUDA_VISIBLE_DEVICES:-all}"
  pipe="${pipe//,/-}"
  if [ -d "$pipe" ] && pgrep -f 'nvidia-cuda-mps-control -d' >/dev/null; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY="$pipe" nvidia-cuda-mps-control; sleep 1
  fi
  echo "$name: exit $code$([ "$code" = 124 ] && echo ' (time limit)') in $((SECONDS - start)) s" | tee -a "$steps_out/steps.txt"
}

# The device tool brings back files of at most 16 MiB. Entries of kernels whose source changed are
# never read again but stay in the cache, so it outgrows that: past 15 MiB the oldest entries (by
# compile time; restored ones keep theirs) are left out, a tenth at a time, until the archive fits.
save_kernel_cache() {
  local list keep
  list=$(mktemp)
  # Entries only: the `.lock` files beside them (one compile per machine) carry nothing.
  (cd "$MSCCLPP_CACHE_DIR" && ls -t | grep '\.kbin$') >"$list"
  keep=$(wc -l <"$list")
  while :; do
    head -n "$keep" "$list" | tar czf "$steps_out/kcache.tgz" -C "$MSCCLPP_CACHE_DIR" -T -
    if [ "$(stat -c %s "$steps_out/kcache.tgz")" -le $((15 << 20)) ] || [ "$keep" -le 1 ]; then break; fi
    keep=$((keep * 9 / 10))
  done
  echo "kernel cache saved: $(du -h "$steps_out/kcache.tgz" | cut -f1), $keep of $(wc -l <"$list") entries"
  rm -f "$list"
}

finish() {
  tar czf "$steps_out/step-files.tgz" -C "$steps_files" .
  save_kernel_cache
}
