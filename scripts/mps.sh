# Sourced by gpu-run.sh and python-run.sh (copied into .gpu/ by gpu-stage.sh).
# start_mps NRANKS NGPU: starts an MPS server so that ranks sharing a GPU run their kernels side by
# side instead of time-slicing; it is stopped when the calling script exits (and goes away with the
# machine). Every native kernel needs its whole grid resident while it waits for its peers, so when
# ranks outnumber GPUs each is held to its share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
# which the SM count the rank reads reflects). MPS clients share hardware queues, where
# port_allreduce hangs: gpu-run.sh runs that section without MPS (stop_mps).
start_mps() {
  local nranks="$1" ngpu="$2"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if [ "$nranks" -gt "$ngpu" ]; then
    export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 * ngpu / nranks))
  fi
  nvidia-cuda-mps-control -d && echo "MPS server started (active thread percentage ${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-100})"
  trap stop_mps EXIT
}
# stop_mps: quits the server; later processes of the calling script run without MPS.
stop_mps() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
}
