#!/usr/bin/env bash
# Runs a job and, if it stalls, takes the native stacks of all its ranks at once (copied into .gpu/
# by gpu-stage.sh). Where python-run.sh's STACKS_AFTER reads two ranks at a fixed time, this waits
# until the job's output has been quiet for QUIET seconds, then reads every rank. That is how the
# 2 x 4 stall across hosts was found (troubleshooting.md, "8 queues").
#
# Usage: [READY=REGEX] bash .gpu/stall-stacks.sh QUIET PATTERN COMMAND...
#   QUIET    seconds without new output that count as a stall (the stacks are taken once)
#   PATTERN  what the rank processes' command lines hold (the program's name); launchers
#            (torchrun, timeout, this script) are left out
#   READY    a stall counts only once the output matches it (start-up is quiet too)
# The job's output goes to $OUT/job.log and is printed at the end; each rank's stacks go to
# $OUT/stacks-<pid>.txt (cuda-gdb, which the lent machines have; it stops each rank while it reads
# it, so peers may time out afterwards: the run is for diagnosis).
set -uo pipefail
quiet=$1 pattern=$2
shift 2
log="${OUT:?stall-stacks.sh: OUT must name a folder}/job.log"
"$@" >"$log" 2>&1 &
job=$!
caught=0
while kill -0 "$job" 2>/dev/null; do
  sleep 2
  age=$(($(date +%s) - $(stat -c %Y "$log")))
  if [ "$caught" = 0 ] && [ "$age" -ge "$quiet" ] && grep -qa -- "${READY:-}" "$log"; then
    caught=1
    pids=$(pgrep -f -- "$pattern" | while read -r p; do
      grep -qa 'torchrun\|distributed.run\|stall-stacks\|timeout' "/proc/$p/cmdline" 2>/dev/null || echo "$p"
    done)
    echo "== stall: no output for ${age} s at $(date +%T); stacks of pids" $pids
    readers=()
    for p in $pids; do
      echo "== pid $p: $(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep '^RANK=')" >"$OUT/stacks-$p.txt"
      timeout 60 cuda-gdb -p "$p" -batch -ex 'info threads' -ex 'thread apply all bt' >>"$OUT/stacks-$p.txt" 2>&1 &
      readers+=($!)
    done
    [ ${#readers[@]} -gt 0 ] && wait "${readers[@]}"
    echo "== stacks taken at $(date +%T)"
  fi
done
wait "$job"
code=$?
cat "$log"
exit "$code"
