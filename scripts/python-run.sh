#!/usr/bin/env bash
# Runs the Python package's GPU check and examples on a GPU machine (copied into .gpu/ by
# gpu-stage.sh), under torchrun with NRANKS ranks (default 2) sharing the visible GPUs, NVLink
# multicast off; MPS=1 runs them under an MPS server, each rank held to its share of the SMs when
# ranks outnumber GPUs (mps.sh), as gpu-run.sh does. The wheel must be installed first, e.g.
#   pip install --no-deps --target /tmp/site .gpu/*.whl   (then PYTHONPATH=/tmp/site is used)
# Usage: [NRANKS=4] [MPS=1] bash .gpu/python-run.sh [check|default|dsl|dslc|dslshim|interpose|tuning|native|torchcomms|torchcomms-train|ep|ep-deepep|ep-bench|hostread|all]
# dsl runs the execution-plan example on the plans gpu-stage.sh put in .gpu/plans and
# .gpu/builder-plans; dslc compiles our DSL programs (python/examples/dsl) and runs their plans;
# interpose the DSL guide's NCCL-interposition flow (a DSL plan and a selector registered in
# Python, then torch.distributed over .gpu/lib/libmscclpp_nccl.so, preloaded); dslshim every DSL
# program PyTorch calls through that shim (tests/gpu_dsl_shim_check.py).
# torchcomms runs the TorchComms backend's check (TORCHCOMMS_QUICK=1: its quick matrix);
# torchcomms-train its training loop through the backend and through torch.distributed with
# .gpu/lib/libmscclpp_nccl.so preloaded, then compares them bit for bit.
# ep runs mscclpp.ext.ep's check against its reference (EP_SEED=S to repeat a seed, EP_QUICK=1
# without the 4096 x 7168 case, EP_KERNELS=1 through the intranode kernels, EP_NUM_SMS=N their
# grid), then the MoE example. ep-deepep compares it with DeepEP itself on the same inputs
# (tests/ep_deepep_oracle.py: deep_ep, built by hand, on PYTHONPATH; EP_SEED, EP_QUICK and
# EP_KERNELS as for ep). ep-bench runs the EP benchmark (python -m mscclpp.ext.ep.bench;
# EP_BENCH_ARGS are its options, e.g. "--num-tokens 512 --modes low-latency"), within
# TORCHCOMMS_TIMEOUT seconds (default 300). HOSTS=h runs ep's check as h simulated hosts (the
# internode mode; without MPS, which port channels refuse beyond 2 ranks a GPU).
# hostread reads a send/recv group's result on the host at once, in each of four ways
# (tests/p2p_host_read_check.py), each within 90 s; with HOSTS=h across simulated hosts, where a
# lower MSCCLPP_DEVICE_WAIT_TIMEOUT (e.g. 15) makes a stall an error sooner; HOSTREAD_OP=allreduce
# reads an all-reduce's result instead (HOSTS=2 on 3 ranks: the flat port_allreduce), and
# HOSTREAD_READS="pageable" runs only the ways it names.
# STACKS_AFTER=S (ep, hostread, torchcomms): S seconds into each bounded run, the native stacks of
# every thread of its first and last rank (one a host with HOSTS=2) go to OUT/stacks-<program>-<pid>.txt,
# through cuda-gdb (the lent machines have no gdb), to see where a rank waits when a run stalls
# (cuda-gdb stops the rank while it reads it, so its peers may time out on it, and its detach once
# killed the rank with SIGSEGV, 2026-12-07: for stalls only).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export NCCL_NVLS_ENABLE=0 MSCCLPP_FORCE_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="${PYTHONPATH:-/tmp/site}"
nranks="${NRANKS:-2}"
if [ "${MPS:-0}" = 1 ]; then
  # shellcheck source=scripts/mps.sh
  source "$here/mps.sh"
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then ngpu=$(tr , '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .); else ngpu=$(nvidia-smi -L | wc -l); fi
  start_mps "$nranks" "$ngpu"
fi
run() {
  echo "== $1 on $nranks ranks"
  torchrun --nproc_per_node="$nranks" --master_port="${PORT:-29521}" "$here/python/$1" "${@:2}"
}
# run within TORCHCOMMS_TIMEOUT seconds (default $1), so a hang cannot outlast one device command.
# HOSTS=h splits the ranks into h simulated hosts (simulate-hosts.sh: MSCCLPP_HOSTID per rank).
bounded() {
  local seconds="${TORCHCOMMS_TIMEOUT:-$1}"; shift
  local program=("$here/python/$1")
  if [ -n "${HOSTS:-}" ]; then
    program=(--no-python "$here/simulate-hosts.sh" "$(dirname "$(command -v torchrun)")/python" "${program[@]}")
  fi
  echo "== $1 on $nranks ranks${HOSTS:+ as $HOSTS simulated hosts} (at most $seconds s)"
  local watcher=""
  if [ -n "${STACKS_AFTER:-}" ]; then
    stacks_of "$(basename "$1")" & watcher=$!
  fi
  local status=0
  timeout -k 10 "$seconds" torchrun --nproc_per_node="$nranks" --master_port="${PORT:-29521}" \
    "${program[@]}" "${@:2}" || status=$?
  if [ -n "$watcher" ]; then kill "$watcher" 2>/dev/null || true; wait "$watcher" 2>/dev/null || true; fi
  return "$status"
}
# STACKS_AFTER seconds in, the stacks of the first and the last rank process running $1 (by pid,
# which follows the local rank; torchrun's own process names the program too and is left out).
stacks_of() {
  sleep "$STACKS_AFTER"
  local pid ranks
  ranks=$(pgrep -f -- "$1" | while read -r pid; do
    grep -q torchrun "/proc/$pid/cmdline" 2>/dev/null || echo "$pid"
  done)
  for pid in $(sed -n '1p;$p' <<<"$ranks" | sort -u); do
    echo "== native stacks of pid $pid ($1), ${STACKS_AFTER} s in"
    timeout 90 cuda-gdb -p "$pid" -batch -ex 'thread apply all bt' >"${OUT:-/tmp}/stacks-$1-$pid.txt" 2>&1 ||
      echo "== cuda-gdb on pid $pid: exit $? (see stacks-$1-$pid.txt)"
  done
}
# Every call native (no real NCCL behind the shim): a call the shim cannot serve fails.
interpose() {
  echo "== examples/dsl_with_nccl_api.py on $nranks ranks, the shim preloaded"
  env -u MSCCLPP_NCCL_LIB_PATH LD_PRELOAD="$here/lib/libmscclpp_nccl.so" torchrun \
    --nproc_per_node="$nranks" --master_port="${PORT:-29521}" "$here/python/examples/dsl_with_nccl_api.py"
}
case "${1:-all}" in
  check) run tests/gpu_check.py ;;
  default) run examples/customized_comm_with_default_algo.py ;;
  dsl) run examples/customized_comm_with_dsl.py "$here/plans" "$here/builder-plans" ;;
  dslc) run tests/gpu_dsl_check.py ;;
  interpose) interpose ;;
  dslshim)
    echo "== tests/gpu_dsl_shim_check.py on $nranks ranks, the shim preloaded"
    env -u MSCCLPP_NCCL_LIB_PATH LD_PRELOAD="$here/lib/libmscclpp_nccl.so" torchrun \
      --nproc_per_node="$nranks" --master_port="${PORT:-29521}" "$here/python/tests/gpu_dsl_shim_check.py" ;;
  hostread)
    # Every way is run and reported; any failure fails the mode.
    status=0
    for how in ${HOSTREAD_READS:-pinned event device pageable}; do
      bounded 90 tests/p2p_host_read_check.py --read "$how" --op "${HOSTREAD_OP:-sendrecv}" \
        || { echo "== --read $how FAILED"; status=1; }
    done
    exit "$status" ;;
  tuning) run examples/customized_comm_with_tuning.py ;;
  native) run examples/customized_allgather.py ;;
  torchcomms) bounded 540 tests/torchcomms_gpu_check.py ${TORCHCOMMS_QUICK:+--quick} ;;
  ep)
    bounded 540 tests/ep_gpu_check.py ${EP_SEED:+--seed "$EP_SEED"} ${EP_QUICK:+--quick} \
      ${EP_KERNELS:+--kernels} ${EP_NUM_SMS:+--num-sms "$EP_NUM_SMS"}
    bounded 120 examples/moe_ep.py
    ;;
  ep-deepep)
    # deep_ep (built by hand, never committed) must be importable, e.g. through PYTHONPATH.
    bounded 300 tests/ep_deepep_oracle.py ${EP_SEED:+--seed "$EP_SEED"} ${EP_QUICK:+--quick} \
      ${EP_KERNELS:+--kernels}
    ;;
  ep-bench)
    echo "== python -m mscclpp.ext.ep.bench on $nranks ranks"
    # shellcheck disable=SC2086 # EP_BENCH_ARGS is a list of options
    timeout -k 10 "${TORCHCOMMS_TIMEOUT:-300}" torchrun --nproc_per_node="$nranks" \
      --master_port="${PORT:-29521}" -m mscclpp.ext.ep.bench ${EP_BENCH_ARGS:-}
    ;;
  torchcomms-train)
    train="$(mktemp -d)"
    bounded 240 tests/torchcomms_training_check.py run torchcomms "$train"
    # Every call native (no real NCCL behind the shim), as through the backend.
    echo "== tests/torchcomms_training_check.py through torch.distributed + libmscclpp_nccl.so"
    timeout -k 10 "${TORCHCOMMS_TIMEOUT:-240}" env -u MSCCLPP_NCCL_LIB_PATH \
      LD_PRELOAD="$here/lib/libmscclpp_nccl.so" torchrun \
      --nproc_per_node="$nranks" --master_port="$((${PORT:-29521} + 1))" \
      "$here/python/tests/torchcomms_training_check.py" run dist "$train"
    python3 "$here/python/tests/torchcomms_training_check.py" compare "$train" "$nranks"
    ;;
  all)
    run tests/gpu_check.py
    run examples/customized_comm_with_default_algo.py
    run examples/customized_comm_with_dsl.py "$here/plans" "$here/builder-plans"
    run tests/gpu_dsl_check.py
    interpose
    run examples/customized_comm_with_tuning.py
    run examples/customized_allgather.py
    bounded 540 tests/torchcomms_gpu_check.py ${TORCHCOMMS_QUICK:+--quick}
    ;;
  *) echo "usage: $0 [check|default|dsl|dslc|dslshim|interpose|tuning|native|torchcomms|torchcomms-train|ep|ep-deepep|ep-bench|hostread|all]" >&2; exit 2 ;;
esac
