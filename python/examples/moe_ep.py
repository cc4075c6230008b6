"""A mixture-of-experts layer with expert parallelism through `mscclpp.ext.ep` (DeepEP's API): each
rank routes its tokens to the top-k of E experts spread over the ranks, dispatches them, applies
its local experts to what it received (expert e scales a token by e + 1), weights them, and
combines the results back. The output is checked against the same layer computed locally,
every expert on this rank. Ranks may share a GPU (the torch group is gloo: it only bootstraps).
Run: torchrun --nproc_per_node=N moe_ep.py"""

import os

import torch
import torch.distributed as dist

from mscclpp.ext.ep import Buffer

TOKENS, HIDDEN, TOPK, EXPERTS_PER_RANK = 256, 1024, 4, 4


def experts_apply(x, expert_ids, weights):
    """Sum over the token's k of weight_k * expert_k(x) in fp32; -1 selects nothing."""
    scale = torch.where(expert_ids >= 0, (expert_ids + 1).float() * weights, 0.0).sum(1)
    return x.float() * scale[:, None]


def main():
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    num_experts = EXPERTS_PER_RANK * size
    cfg = Buffer.get_dispatch_config(size), Buffer.get_combine_config(size)
    nvl_bytes = max(c.get_nvl_buffer_size_hint(HIDDEN * 2, size) for c in cfg)
    buffer = Buffer(dist.group.WORLD, num_nvl_bytes=nvl_bytes)

    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randint(-4, 5, (TOKENS, HIDDEN), device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.rand(TOKENS, num_experts, device="cuda", generator=gen)
    weights, topk_idx = logits.topk(TOPK, dim=1)
    weights = (weights / weights.sum(1, keepdim=True)).float()

    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)
    # recv_idx is local to this rank (-1 elsewhere): the global expert is rank * E/R + local.
    global_idx = torch.where(recv_idx >= 0, recv_idx + rank * EXPERTS_PER_RANK, -1)
    expert_out = experts_apply(recv_x, global_idx, recv_w).to(torch.bfloat16)
    out, _, _ = buffer.combine(expert_out, handle)

    # Each rank's partial was rounded to bf16 once before the combine: compare within that.
    want = experts_apply(x, topk_idx, weights)
    tolerance = 2 * torch.finfo(torch.bfloat16).eps * want.abs().max().item()
    error = (out.float() - want).abs().max().item()
    assert error <= tolerance, f"rank {rank}: combined output off by {error} (> {tolerance})"
    dist.barrier()
    if rank == 0:
        print(f"moe_ep: {size} ranks, {TOKENS} tokens x {HIDDEN} to top-{TOPK} of {num_experts} "
              f"experts: output checked (max error {error:.3g})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
