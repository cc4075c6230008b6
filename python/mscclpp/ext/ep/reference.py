"""The reference of the intranode normal mode in plain PyTorch: every rank of a group simulated in
one process (lists indexed by rank), on any device, CPU included. It is written from the spec in
`mscclpp.ext.ep`'s module doc, rank by rank and block by block, and shares no code with `Buffer`,
so a GPU run can be checked against it bit for bit (dispatch only copies; combine adds in fp32 in
the same order and rounds once, which is exact IEEE arithmetic on any device)."""

from dataclasses import dataclass
from typing import List, Optional

import torch


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """One rank's layout: `(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
    is_token_in_rank [T, R] bool)`. Expert e lives on rank e // (E / R); -1 selects nothing; a
    token counts once per rank however many of its experts live there."""
    experts_per_rank = num_experts // num_ranks
    num_tokens = topk_idx.shape[0]
    in_rank = [[False] * num_ranks for _ in range(num_tokens)]
    per_expert = [0] * num_experts
    for t, experts in enumerate(topk_idx.tolist()):
        for e in experts:
            if e >= 0:
                per_expert[e] += 1
                in_rank[t][e // experts_per_rank] = True
    is_token_in_rank = torch.tensor(in_rank, dtype=torch.bool).reshape(num_tokens, num_ranks)
    return (is_token_in_rank.sum(0, dtype=torch.int32),
            torch.tensor(per_expert, dtype=torch.int32), is_token_in_rank)


@dataclass
class Received:
    """What one rank receives from a dispatch."""

    recv_x: torch.Tensor
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    # The received token's index on its source rank.
    recv_src_idx: torch.Tensor
    # Per local expert, the (token, expert) pairs received, rounded up to expert_alignment.
    num_recv_tokens_per_expert: List[int]
    # [R, R]: row i, column j = tokens ranks 0..i send to rank j (the same on every rank).
    rank_prefix_matrix: torch.Tensor


def dispatch(xs, topk_idxs, topk_weights, num_experts: int, expert_alignment: int = 1):
    """Every rank's receive: `xs[r]` `[T_r, H]`, `topk_idxs[r]` `[T_r, K]` int64 (-1: none),
    `topk_weights[r]` `[T_r, K]` f32 (or None for neither). Returns one `Received` per rank."""
    num_ranks = len(xs)
    per_rank = num_experts // num_ranks
    routes = [layout(topk_idxs[r], num_experts, num_ranks)[2] for r in range(num_ranks)]
    counts = torch.stack([routes[s].sum(0, dtype=torch.int32) for s in range(num_ranks)])
    rank_prefix_matrix = counts.cumsum(0, dtype=torch.int32)
    out = []
    for me in range(num_ranks):
        lo, hi = me * per_rank, (me + 1) * per_rank
        # Blocks by source rank ascending; within a block the source's tokens in index order.
        chosen = [routes[s][:, me].nonzero().flatten() for s in range(num_ranks)]
        recv_x = torch.cat([xs[s][chosen[s]] for s in range(num_ranks)])
        recv_src_idx = torch.cat(chosen).to(torch.int32)
        recv_topk_idx = recv_topk_weights = None
        if topk_weights is not None:
            idx = torch.cat([topk_idxs[s][chosen[s]] for s in range(num_ranks)])
            w = torch.cat([topk_weights[s][chosen[s]] for s in range(num_ranks)])
            local = (idx >= lo) & (idx < hi)
            recv_topk_idx = torch.where(local, idx - lo, torch.full_like(idx, -1))
            recv_topk_weights = torch.where(local, w, torch.zeros_like(w))
        per_expert = []
        for e in range(lo, hi):
            n = sum(int((topk_idxs[s] == e).sum()) for s in range(num_ranks))
            per_expert.append((n + expert_alignment - 1) // expert_alignment * expert_alignment)
        out.append(Received(recv_x, recv_topk_idx, recv_topk_weights, recv_src_idx, per_expert,
                            rank_prefix_matrix))
    return out


def combine(is_token_in_rank, recv_xs, recv_topk_weights=None, biases=None):
    """Every source rank's combine: `is_token_in_rank[s]` is rank s's `[T_s, R]` routing,
    `recv_xs[r]` rank r's rows in its dispatch receive order, `recv_topk_weights[r]` its `[N_r, K]`
    weights (or None), `biases[s]` None, a tensor or a pair of tensors `[T_s, H]`. Per token: fp32
    of bias 0 plus bias 1 (0 without), then each rank's row that the token went to added in fp32
    in ascending rank order, rounded once to the input's type. Returns `[(x, topk_weights)]`."""
    num_ranks = len(recv_xs)
    out = []
    for s in range(num_ranks):
        route = is_token_in_rank[s]
        num_tokens, hidden = route.shape[0], recv_xs[0].shape[1]
        bias = biases[s] if biases is not None else None
        bias = [b for b in (bias if isinstance(bias, tuple) else (bias,)) if b is not None]
        acc = torch.zeros(num_tokens, hidden, dtype=torch.float32)
        if bias:
            acc = bias[0].float() + (bias[1].float() if len(bias) > 1 else 0.0)
        w_acc = None
        if recv_topk_weights is not None:
            w_acc = torch.zeros(num_tokens, recv_topk_weights[0].shape[1], dtype=torch.float32)
        for r in range(num_ranks):
            # Rank r's block from s starts after the tokens ranks 0..s-1 sent it.
            start = sum(int(is_token_in_rank[q][:, r].sum()) for q in range(s))
            rows = route[:, r].nonzero().flatten()
            block = slice(start, start + rows.numel())
            acc[rows] += recv_xs[r][block].float()
            if w_acc is not None:
                w_acc[rows] += recv_topk_weights[r][block].float()
        out.append((acc.to(recv_xs[0].dtype), w_acc))
    return out
