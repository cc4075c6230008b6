#!/usr/bin/env bash
# Runs one rank as if its machine were HOSTS hosts: sets MSCCLPP_HOSTID from the launcher's local
# rank so that the job's local ranks split into HOSTS equal blocks ("sim-host-0" takes local ranks
# 0..k-1, and so on), then runs the command. Ranks with different ids never map each other's memory:
# their traffic goes through the network transport (Ethernet over this machine's interfaces), as
# between real hosts. Usage under torchrun (or any launcher that sets LOCAL_RANK and
# LOCAL_WORLD_SIZE): HOSTS=2 torchrun --no-python --nproc_per_node=4 scripts/simulate-hosts.sh BINARY ARGS...
set -euo pipefail
hosts="${HOSTS:?set HOSTS to the number of hosts to simulate}"
local_rank="${LOCAL_RANK:-${OMPI_COMM_WORLD_LOCAL_RANK:?no LOCAL_RANK from the launcher}}"
local_size="${LOCAL_WORLD_SIZE:-${OMPI_COMM_WORLD_LOCAL_SIZE:?no LOCAL_WORLD_SIZE from the launcher}}"
if [ "$hosts" -lt 1 ] || [ "$hosts" -gt "$local_size" ]; then
  echo "simulate-hosts.sh: HOSTS=$hosts must lie in 1..=$local_size (the ranks on this machine)" >&2
  exit 2
fi
export MSCCLPP_HOSTID="sim-host-$((local_rank * hosts / local_size))"
exec "$@"
