#!/usr/bin/env bash
# Runs the GPU suite and the benchmark on the device machine (from the repository root there).
# Usage: [NGPU=k] [NRANKS=n] [MPS=1] [HOSTS=h] bash .gpu/gpu-run.sh [suite|bench|all|fault] [extra args for the binary]
#        [NRANKS=n] [MPS=1] [SHIM_CHECK_QUICK=1] bash .gpu/gpu-run.sh nccl [torch|initall|inplace|kill|abort|watchdog|fallback|bench|hostcost]
#        [TORCH_BENCH_TIMEOUT=s] bash .gpu/gpu-run.sh nccl bench [torch_bench.py run options]
# Writes logs into $OUT (or ./gpu-out when $OUT is unset).
set -uo pipefail
# SAFETY: NVLink multicast can take shared GPUs out of service; it stays off for us and for NCCL.
export NCCL_NVLS_ENABLE=0 MSCCLPP_FORCE_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset MSCCLPP_ENABLE_NVLS
export MSCCLPP_CACHE_DIR="${MSCCLPP_CACHE_DIR:-/tmp/mscclpp-cache}"
out="${OUT:-./gpu-out}"; mkdir -p "$out"
what="${1:-all}"; shift || true
# NGPU=k runs k ranks on the first k GPUs (a 2-rank run on a bigger machine, say).
# Without NGPU, a CUDA_VISIBLE_DEVICES already set is kept: several runs can then share one machine,
# each on its own GPUs (give each its own PORT).
if [ -n "${NGPU:-}" ]; then
  ngpu="$NGPU"; export CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((NGPU - 1)))"
elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  ngpu=$(tr , '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
else
  ngpu=$(nvidia-smi -L | wc -l)
fi
# NRANKS=n runs n ranks (default: one per GPU). More ranks than GPUs share them, which checks the
# suite's results at a world size the machine lacks GPUs for (NCCL refuses shared GPUs, so the
# benchmark runs that way only without --vs-nccl). MPS=1 starts an MPS server first (mps.sh).
# Ranks of one process (`nccl initall`) divide the SMs among themselves (Communicator::multiprocessors).
nranks="${NRANKS:-$ngpu}"
echo "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1) x $ngpu, $nranks ranks"
if [ "${MPS:-0}" = 1 ]; then
  # shellcheck source=scripts/mps.sh
  source "$(dirname "$0")/mps.sh"
  start_mps "$nranks" "$ngpu"
fi
nvidia-smi topo -m 2>/dev/null | head -n 4
# NCCL for the same-run baseline: PyTorch's copy.
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib", "libnccl.so.2"))' 2>/dev/null)
[ -n "$nccl" ] && export MSCCLPP_NCCL_LIB_PATH="$nccl"
# HOSTS=h makes the ranks pose as h hosts (MSCCLPP_HOSTID per block of local ranks, see
# simulate-hosts.sh): traffic between the "hosts" takes the Ethernet transport over this machine.
# The suite then runs its cross-host sections only: port_allreduce, p2p (send/recv through
# PortChannels) and multi_host (those send/recv checks, and the matrices of
# default_allreduce_hierarchical, port_allreduce and the all-gather and broadcast through them).
# HOSTS=2 NRANKS=4 is 2 hosts x 2 ranks, HOSTS=2 NRANKS=8 2 x 4, e.g.
# `HOSTS=2 NRANKS=8 bash .gpu/gpu-run.sh suite --only multi_host`; without MPS=1 (the proxy's
# copies must not queue behind other clients' spinning kernels).
wrap=()
if [ -n "${HOSTS:-}" ]; then wrap=(.gpu/simulate-hosts.sh); echo "simulating $HOSTS hosts"; fi
launch() { torchrun --no-python --nproc_per_node="$nranks" --master_port="${PORT:-29511}" "${wrap[@]}" "$@"; }
# The fault-injection check (#15, docs/fail-fast.md): one run of every configuration of
# fault-inject.py at this world size (at least 2 ranks): a rank SIGKILLed, then one SIGSTOPped,
# during eager calls, graph replays, PortChannel traffic, zero-copy point-to-point sends and (at
# 2, 4 and 8 ranks, where gpu-stage.sh writes the builder's plans) an execution plan; every
# survivor must fail naming it in time. Under MPS=1 the script starts the MPS server of its
# own phase, so ours stops first.
# One world at a time: without MPS, worlds beside each other on the same GPUs take turns on them
# (time slices), and a warm-up call outlasted the 2 s wait (4 x H200, 2026-11-27: 3 of 6
# configurations failed before their signal with 4 worlds of 4 ranks at once).
fault_check() {
  if [ "${MPS:-0}" = 1 ]; then stop_mps; fi
  local world=$((nranks < 2 ? 2 : nranks)) workloads=eager,graph,port,sendrecv
  if [ -f ".gpu/builder-plans/builder_allreduce_simple_${world}gpu.json" ]; then workloads+=,plan; fi
  python3 "$(dirname "$0")/fault-inject.py" --ranks "$world" --parallel-ranks "$world" --signals KILL,STOP \
    --workloads "$workloads" --mps "${MPS:-0}" --runs 1 --timeout 2 --settle 3 --out "$out" 2>&1 |
    tee "$out/fault.log"
  return "${PIPESTATUS[0]}"
}
rc=0
if [ "$what" = fault ]; then fault_check || rc=1; fi
if [ "$what" = suite ] || [ "$what" = all ]; then
  # MPS clients share the GPU's hardware queues: with more than 2 ranks a GPU, a PortChannel proxy's
  # copy can queue behind a spinning kernel, and port_allreduce timed out (4 and 8 ranks; it passes
  # without MPS), so there it refuses to start (port_channel::shared_queue_hazard), which the MPS
  # run checks. Its matrix then runs after, without MPS.
  port_apart=0
  if [ "${MPS:-0}" = 1 ] && [ "$nranks" -gt $((2 * ngpu)) ] && [ -z "${HOSTS:-}" ]; then
    case " $* " in *" --only "*) [[ "$*" == *port_allreduce* ]] && port_apart=1 ;; *) port_apart=1 ;; esac
  fi
  if [ "$port_apart" = 1 ]; then
    launch .gpu/bin/mscclpp-gpu-suite "$@" 2>&1 | tee "$out/suite.log"
    rc=$((rc | PIPESTATUS[0]))
    stop_mps
    echo "== port_allreduce without MPS (MPS clients share hardware queues)" | tee -a "$out/suite.log"
    launch .gpu/bin/mscclpp-gpu-suite --only port_allreduce 2>&1 | tee -a "$out/suite.log"
    rc=$((rc | PIPESTATUS[0]))
  else
    launch .gpu/bin/mscclpp-gpu-suite "$@" 2>&1 | tee "$out/suite.log"; rc=$((rc | PIPESTATUS[0]))
  fi
  # The whole suite (no section named, not --quick) ends with the fault-injection check, after the
  # benchmark of `all` (the check stops our MPS server).
  case " $* " in
    *" --only "* | *" --quick "* | *" --primitives-only "*) ;;
    *) if [ -z "${HOSTS:-}" ]; then what_after=fault; fi ;;
  esac
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  # BENCH_BIN=path times another build of the benchmark (a same-machine A/B of two commits).
  launch "${BENCH_BIN:-.gpu/bin/mscclpp-bench}" "$@" 2>&1 | tee "$out/bench.log"; rc=$((rc | PIPESTATUS[0]))
fi
if [ "${what_after:-}" = fault ]; then
  echo "== fault injection" | tee -a "$out/suite.log"
  fault_check || rc=1
fi
if [ "$what" = nccl ]; then
  # The NCCL shim: PyTorch's backend="nccl" with the shim preloaded (torch), one process driving
  # NRANKS ranks (initall), faults (kill, abort, watchdog: 2 ranks), and the fallback at world size 1 with
  # every operation sent to PyTorch's NCCL (fallback). The real library is used from a copy, so
  # the shim's dlopen loads it afresh (RTLD_DEEPBIND) instead of finding PyTorch's already loaded.
  # NCCL_SHIM: another build of the shim, e.g. the wheel's
  # (NCCL_SHIM=$(PYTHONPATH=/tmp/site python3 -m mscclpp --nccl-lib)).
  shim="${NCCL_SHIM:-$PWD/.gpu/lib/libmscclpp_nccl.so}"
  export NCCL_SHIM_LIB="$shim" MSCCLPP_DEVICE_WAIT_TIMEOUT="${MSCCLPP_DEVICE_WAIT_TIMEOUT:-10}"
  if [ -n "${MSCCLPP_NCCL_LIB_PATH:-}" ]; then
    mkdir -p /tmp/real-nccl && cp "$MSCCLPP_NCCL_LIB_PATH" /tmp/real-nccl/libnccl.so.2
    export MSCCLPP_NCCL_LIB_PATH=/tmp/real-nccl/libnccl.so.2
  fi
  mode="${1:-torch}"
  script=.gpu/torch_check.py
  case "$mode" in
    initall) NRANKS="$nranks" python3 "$script" initall ;;
    # nccl-tests' in-place calls, one process a rank, through the C interface (bounded: a call
    # that never finishes is the failure it looks for).
    inplace) env -u MSCCLPP_NCCL_LIB_PATH timeout -k 10 "${SHIM_CHECK_TIMEOUT:-540}" \
               torchrun --nproc_per_node="$nranks" --master_port="${PORT:-29511}" "$script" inplace ;;
    kill|abort) env -u MSCCLPP_NCCL_LIB_PATH torchrun --nproc_per_node=2 --master_port="${PORT:-29511}" "$script" "$mode" ;;
    # PyTorch's watchdog aborting the shim's communicator while rank 0 is inside a call; the
    # script starts both ranks itself (with the shim preloaded) to see rank 0's own exit status,
    # which must be an exception's code, never a signal (torch_check.py, watchdog).
    # WATCHDOG_CASES narrows it (e.g. 2:sleep); MPS=1 puts both ranks on one GPU under MPS.
    watchdog) timeout -k 10 "${SHIM_CHECK_TIMEOUT:-540}" env -u MSCCLPP_NCCL_LIB_PATH python3 "$script" watchdog ;;
    fallback) LD_PRELOAD="$shim" MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION=all \
                torchrun --nproc_per_node=1 --master_port="${PORT:-29511}" "$script" torch ;;
    # PyTorch's collectives timed with PyTorch's NCCL, then with the shim preloaded, then compared
    # (torch_bench.py; one GPU a rank, NCCL refuses shared GPUs). TORCH_BENCH_TIMEOUT seconds
    # (default 400) bound the three together: each run gets half of what the comparison leaves,
    # the shim's also what NCCL's left unused. A run cut short still leaves the rows it measured.
    bench) limit="${TORCH_BENCH_TIMEOUT:-400}" start=$SECONDS code=0
       shift
       bench_run() {  # label, seconds, then the launcher's environment prefix
         local label="$1" seconds="$2"; shift 2
         echo "== torch_bench with $label (at most $seconds s)"
         timeout -k 10 "$seconds" env "$@" torchrun --nproc_per_node="$nranks" \
           --master_port="${PORT:-29511}" .gpu/torch_bench.py run --json "$out/torch-$label.json" "${args[@]}"
         local c=$?; echo "torch_bench with $label: exit $c in $((SECONDS - start)) s"; return $c
       }
       args=("$@")
       bench_run nccl $(((limit - 20) / 2)) LD_PRELOAD= || code=1
       PORT=$((${PORT:-29511} + 1)) bench_run mscclpp $((limit - 20 - (SECONDS - start))) LD_PRELOAD="$shim" || code=1
       python3 .gpu/torch_bench.py compare "$out/torch-nccl.json" "$out/torch-mscclpp.json" \
         --out "$out/torch-compare.md" || code=1
       exit $code ;;
    # PyTorch's own host work per eager all_reduce against the library's (host_cost.py), with
    # PyTorch's NCCL (one GPU a rank: NCCL refuses ranks sharing a GPU, so it is left out then),
    # then with the shim preloaded (ranks may share GPUs, NRANKS=n MPS=1).
    hostcost) shift
       if [ "$nranks" -le "$ngpu" ]; then
         torchrun --nproc_per_node="$nranks" --master_port="${PORT:-29511}" .gpu/host_cost.py "$@" || rc=1
       else
         echo "host_cost with PyTorch's NCCL left out: $nranks ranks on $ngpu GPU(s), and NCCL refuses ranks sharing a GPU"
       fi
       LD_PRELOAD="$shim" torchrun --nproc_per_node="$nranks" --master_port="$((${PORT:-29511} + 1))" \
         .gpu/host_cost.py "$@" || rc=1
       exit $rc ;;
    # A hang must not eat the machine: the whole run is bounded (SHIM_CHECK_TIMEOUT seconds).
    *) start=$SECONDS
       timeout -k 10 "${SHIM_CHECK_TIMEOUT:-540}" \
         env LD_PRELOAD="$shim" torchrun --nproc_per_node="$nranks" --master_port="${PORT:-29511}" "$script" torch
       code=$?; echo "nccl torch: $nranks ranks in $((SECONDS - start)) s (exit $code)"; exit $code ;;
  esac 2>&1 | tee "$out/nccl-$mode.log"; rc=$((rc | PIPESTATUS[0]))
fi
exit $rc
