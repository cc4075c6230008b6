"""The EP workload of scripts/fault-inject.py: `mscclpp.ext.ep` dispatch and combine in a loop that a
signal to one rank lands in (a killed or stopped peer mid-dispatch), one process per rank with
torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; fault-inject.py
starts the ranks itself, without torchrun's agent).

Each iteration dispatches fresh small-integer tokens through the point-to-point groups, combines
them, and checks every element: in the normal mode (the non-cached dispatch reads its counts on
the host, `Buffer._to_host`, which polls with the error check) `combine(dispatch(x)) == x * ranks
reached`; in the low-latency mode (`--low-latency`: nothing read on the host, bf16, unit weights,
each expert returning its rows) `combine(dispatch(x)) == x * top-k`. A wrong result is a failure
too, not only a hang. Ranks on several simulated hosts (MSCCLPP_HOSTID) run the internode mode.

Prints what fault-inject.py reads: rank 0's "# rank 0 thread:" header once the Buffer is up and
the first iteration passed; on a failure, a timestamped "the timed loop stopped: ..." line, the
error line "ep_fault_loop (rank R): error: ...", and a timestamped "torn down" once the Buffer is
destroyed; then it exits 1 without tearing down the gloo group, which would wait for the dead peer.
Exit 0 after --iterations iterations (fault-inject.py's warm-up job runs a few).
Run: python3 ep_fault_loop.py [--iterations N] [--tokens T] [--hidden H] [--seed S] [--low-latency]"""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

from mscclpp.ext.ep import Buffer


def stamp():
    """The timestamp fault-inject.py reads at a line's start (UTC, as the library's log lines)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def finished(buf, dev):
    """The iteration's work done, and the runtime's error if it failed: after a group that timed
    out, the outputs hold whatever the kernels left, which is the runtime's to report, not a wrong
    result of ours."""
    if dev.type == "cuda":
        torch.cuda.current_stream().synchronize()
    buf._session.check()


def iteration(buf, gen, num_tokens, hidden, num_experts, num_topk, dev, low_latency=False):
    """One dispatch and combine of fresh tokens; raises on a wrong element."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    topk_idx = scores.topk(num_topk, dim=1).indices.to(dev)
    topk_weights = torch.ones(num_tokens, num_topk, device=dev)
    x = torch.randint(-8, 9, (num_tokens, hidden), generator=gen).to(torch.bfloat16).to(dev)
    if low_latency:
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, num_tokens, num_experts,
                                                           use_fp8=False)
        combined, _, _ = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
        reached = torch.full((num_tokens, 1), float(num_topk), device=dev)
    else:
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
        recv_x, _, _, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
            topk_weights=topk_weights)
        combined, _, _ = buf.combine(recv_x, handle)
        reached = in_rank.sum(dim=1, keepdim=True).to(torch.float32)
    finished(buf, dev)
    want = x.to(torch.float32) * reached
    got = combined.to(torch.float32)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise RuntimeError(f"rank {buf.rank}: combine(dispatch(x)) differs from x times the ranks "
                           f"reached in {bad.shape[0]} elements, first at {bad[0].tolist()}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=1000000)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--low-latency", action="store_true", help="the low-latency mode's calls")
    a = p.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    # gloo: the group only bootstraps the Buffer, and NCCL refuses ranks sharing a GPU.
    dist.init_process_group("gloo")
    R, r = dist.get_world_size(), dist.get_rank()
    num_experts, num_topk = 4 * R, min(4, 4 * R)
    hint = max(c.get_nvl_buffer_size_hint(a.hidden * 2, R)
               for c in (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)))
    rdma = Buffer.get_low_latency_rdma_size_hint(a.tokens, a.hidden, R, num_experts)
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=hint, num_rdma_bytes=rdma if a.low_latency else 0,
                 low_latency_mode=a.low_latency, explicitly_destroy=True)
    # Every rank draws its own tokens; the routing reaches any rank.
    gen = torch.Generator().manual_seed(a.seed * 1000 + r)
    done = 0
    try:
        iteration(buf, gen, a.tokens, a.hidden, num_experts, num_topk, dev, a.low_latency)
        done = 1
        if r == 0:
            hosts = buf.get_num_rdma_ranks()
            mode = "low-latency" if a.low_latency else "normal"
            print(f"# rank 0 thread: ep {mode} dispatch and combine, {R} ranks on {hosts} host(s), "
                  f"{a.tokens} tokens x {a.hidden}, seed {a.seed}", flush=True)
        while done < a.iterations:
            iteration(buf, gen, a.tokens, a.hidden, num_experts, num_topk, dev, a.low_latency)
            done += 1
    except Exception as e:  # noqa: BLE001 (reported in fault-inject.py's words, then exit 1)
        what = f"{type(e).__name__}: {e}"
        where = "the timed loop stopped" if done else "the timed loop's set-up stopped in the first iteration"
        print(f"{stamp()}  WARN ep_fault_loop: rank {r}: {where} after {done} iterations: {what}",
              flush=True)
        print(f"ep_fault_loop (rank {r}): error: {what}", flush=True)
        try:
            buf.destroy()
        except Exception as d:  # noqa: BLE001 (the teardown's own failure is reported too)
            print(f"ep_fault_loop (rank {r}): destroying the Buffer: {type(d).__name__}: {d}",
                  flush=True)
        print(f"{stamp()}  WARN ep_fault_loop: torn down (rank {r}), exiting on the error", flush=True)
        sys.stdout.flush()
        os._exit(1)
    buf.destroy()
    dist.destroy_process_group()
    if r == 0:
        print(f"ep_fault_loop: {done} iterations, every element right", flush=True)


if __name__ == "__main__":
    main()
