# Sourced by gpu-run.sh and python-run.sh (copied into .gpu/ by gpu-stage.sh).
# start_mps NRANKS NGPU: starts an MPS server so that ranks sharing a GPU run their kernels side by
# side instead of time-slicing; it is stopped when the calling script exits (and goes away with the
# machine). Every native kernel needs its whole grid resident while it waits for its peers, so when
# ranks outnumber GPUs each is held to its share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
# which the SM count the rank reads reflects). MPS clients share hardware queues, where
# port_allreduce hangs: gpu-run.sh runs that section without MPS (stop_mps).
start_mps() {
  local nranks="$1" ngpu="$2"
  # One server per set of visible GPUs, so runs on other GPUs of the machine keep their own (or none).
  local devices="${CUDA_VISIBLE_DEVICES:-all}"
  export CUDA_MPS_PIPE_DIRECTORY="/tmp/mps-pipe-${devices//,/-}" CUDA_MPS_LOG_DIRECTORY="/tmp/mps-log-${devices//,/-}"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if [ "$nranks" -gt "$ngpu" ]; then
    export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 * ngpu / nranks))
  fi
  nvidia-cuda-mps-control -d && echo "MPS server started (active thread percentage ${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-100})"
  # The server sees only the GPUs that were visible when it started, numbered from 0, and a client
  # names GPUs by that numbering: CUDA_VISIBLE_DEVICES=2 would leave a client with no GPU.
  # stop_mps gives the machine's numbering back.
  mps_machine_devices="${CUDA_VISIBLE_DEVICES:-}"
  if [ -n "$mps_machine_devices" ]; then export CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((ngpu - 1)))"; fi
  trap stop_mps EXIT
}
# stop_mps: quits the server; later processes of the calling script run without MPS.
stop_mps() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
  if [ -n "${mps_machine_devices:-}" ]; then export CUDA_VISIBLE_DEVICES="$mps_machine_devices"; fi
}
