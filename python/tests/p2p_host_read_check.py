"""GPU check: the host reads a send/recv group's result at once, under torchrun (ranks may share
one GPU; with `HOSTS=h` in python-run.sh, as h simulated hosts, where the groups go through the
PortChannel engine across hosts). Each iteration queues one group (every rank sends a tensor of
its own to every rank, itself included, into one row of a table) on a side stream, then reads
the table on the host the way `--read` names, with no wait in between. With `--op allreduce` the
iteration is an int32 sum all-reduce of every rank's tensor through the session's selector
instead: across hosts of uneven rank counts (`HOSTS=2` on 3 ranks) it is the flat
`port_allreduce`, whose proxy also copies between the ranks of one host. The reads:
- `pageable`: `table.cpu()` on the group's stream (what most code does);
- `pinned`: a non-blocking copy into pinned memory, then a wait for the stream;
- `event`: an event recorded after the group and polled, then `table.cpu()`;
- `device`: `torch.cuda.synchronize()`, then `table.cpu()`.
Every element is checked exactly (int32, a value per source rank and iteration). A rank whose
group fails, or stops short of the device wait timeout, fails with the runtime's error.
On 2026-12-04 (one H200, 2 simulated hosts of 2 ranks) `pageable` timed out in the first group
on every rank: the Ethernet resolver made its stream and pinned buffer on its first copy, which
waited behind this thread's pageable copy. They are made at connect time now, and `pageable`
passes (one H100, 2026-12-07; docs/troubleshooting.md).
Run: torchrun --nproc_per_node=N p2p_host_read_check.py --read pageable|pinned|event|device
[--op sendrecv|allreduce]"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from mscclpp import CommGroup, _mscclpp

READS = ("pageable", "pinned", "event", "device")


def read(mode, table, stream):
    """`table` on the host, read as `mode` says, right after the group on `stream`."""
    if mode == "pageable":
        return table.cpu()
    if mode == "pinned":
        host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
        host.copy_(table, non_blocking=True)
        stream.synchronize()
        return host
    if mode == "event":
        done = torch.cuda.Event()
        done.record(stream)
        while not done.query():
            time.sleep(0.0005)
        return table.cpu()
    torch.cuda.synchronize()
    return table.cpu()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--read", choices=READS, required=True)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--op", choices=("sendrecv", "allreduce"), default="sendrecv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skip p2p_host_read_check: no CUDA device here", flush=True)
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    group = CommGroup(torch_group=dist.group.WORLD, device=torch.cuda.current_device())
    session = _mscclpp.CommSession(group.communicator)
    stream = torch.cuda.Stream()
    for it in range(args.iterations):
        # Odd sizes, a different one each iteration.
        n = 1000 + 37 * it
        if args.op == "allreduce":
            want = torch.full((n,), sum(p * 1000 + it for p in range(world)), dtype=torch.int32)
        else:
            want = torch.tensor([[p * 1000 + it] * n for p in range(world)], dtype=torch.int32)
        with torch.cuda.stream(stream):
            mine = torch.full((n,), rank * 1000 + it, dtype=torch.int32, device="cuda")
            out = torch.full(want.shape, -1, dtype=torch.int32, device="cuda")
            start = time.monotonic()
            if args.op == "allreduce":
                session.run("allreduce", mine.data_ptr(), out.data_ptr(), mine.nbytes, out.nbytes,
                            "int32", stream=stream.cuda_stream)
            else:
                ops = []
                for p in range(world):
                    ops.append(("send", p, mine.data_ptr(), mine.nbytes))
                    ops.append(("recv", p, out[p].data_ptr(), out[p].nbytes))
                session.p2p(ops, stream.cuda_stream)
            host = read(args.read, out, stream)
        session.check()
        wrong = int((host != want).sum())
        print(f"rank {rank}: {args.read} read, {args.op} {it} of {n} int32 a peer: "
              f"{'ok' if wrong == 0 else f'{wrong} elements WRONG'} in "
              f"{time.monotonic() - start:.3f} s", flush=True)
        if wrong:
            sys.exit(1)
    dist.barrier()
    if rank == 0:
        print(f"PASS p2p_host_read_check --read {args.read} --op {args.op} on {world} ranks",
              flush=True)


if __name__ == "__main__":
    main()
