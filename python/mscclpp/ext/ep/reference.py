"""The reference of the normal and low-latency modes in plain PyTorch: every rank of a group
simulated in one process (lists indexed by rank), on any device, CPU included. It is written from
the spec in `mscclpp.ext.ep`'s module doc, rank by rank and block by block, and shares no code with
`Buffer` but the fp8 cast that the spec is defined by, so a GPU run can be checked against it bit
for bit (dispatch only copies; combine adds in fp32 in the same order and rounds once, which is
exact IEEE arithmetic on any device)."""

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


def tokens_per_host(is_token_in_rank: torch.Tensor, num_hosts: int):
    """`num_tokens_per_rdma_rank [H]` int32 of one rank's layout across H hosts of R / H
    consecutive ranks each: the tokens with any expert on each host, once per host."""
    num_tokens, num_ranks = is_token_in_rank.shape
    per_host = num_ranks // num_hosts
    counts = [0] * num_hosts
    for row in is_token_in_rank.tolist():
        for h in range(num_hosts):
            if any(row[h * per_host:(h + 1) * per_host]):
                counts[h] += 1
    return torch.tensor(counts, dtype=torch.int32)


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
    """Every rank's receive: `xs[r]` `[T_r, H]` (or an fp8 pair `(tokens [T_r, H], scales
    [T_r, ...])`, whose rows both move), `topk_idxs[r]` `[T_r, K]` int64 (-1: none),
    `topk_weights[r]` `[T_r, K]` f32 (or None for neither). Returns one `Received` per rank,
    `recv_x` a pair where the input is."""
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
        if isinstance(xs[0], tuple):
            recv_x = tuple(torch.cat([xs[s][i][chosen[s]] for s in range(num_ranks)])
                           for i in range(2))
        else:
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


@dataclass
class LowLatencyReceived:
    """What one rank receives from a low-latency dispatch. Rows of `recv_x` (and its scales) past
    `recv_count[l]` are zero here; the spec leaves them unspecified."""

    # [L, R * M, H] bf16, or (e4m3 rows, scales [L, R * M, S]) with fp8.
    recv_x: object
    recv_count: torch.Tensor
    # [L, R * M] int32: the row's token index on its source, -1 past the count.
    src_info: torch.Tensor
    # [L, R] int64: (begin << 32) | count of source s's block among expert l's rows.
    layout_range: torch.Tensor


def low_latency_dispatch(xs, topk_idxs, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                         use_fp8: bool = False, round_scale: bool = False,
                         use_ue8m0: bool = False):
    """Every rank's low-latency receive: for each local expert, blocks by source ascending, each
    block the source's tokens that chose the expert, in token order. With `use_fp8` the rows are
    the spec's fp8 cast of the source's tokens (`low_latency.cast_fp8`, the one function the
    spec defines the cast by). Returns one `LowLatencyReceived` per rank."""
    from .low_latency import cast_fp8

    num_ranks, capacity = len(xs), num_max_dispatch_tokens_per_rank * len(xs)
    per_rank = num_experts // num_ranks
    payloads = [cast_fp8(x, round_scale, use_ue8m0) if use_fp8 else (x,) for x in xs]
    out = []
    for me in range(num_ranks):
        rows = [torch.zeros(per_rank, capacity, *p.shape[1:], dtype=p.dtype)
                for p in payloads[0]]
        src_info = torch.full((per_rank, capacity), -1, dtype=torch.int32)
        layout_range = torch.zeros(per_rank, num_ranks, dtype=torch.int64)
        count = torch.zeros(per_rank, dtype=torch.int32)
        for local in range(per_rank):
            expert, filled = me * per_rank + local, 0
            for s in range(num_ranks):
                begin = filled
                for t, experts in enumerate(topk_idxs[s].tolist()):
                    if expert in experts:
                        for dst, src in zip(rows, payloads[s]):
                            dst[local, filled] = src[t]
                        src_info[local, filled] = t
                        filled += 1
                layout_range[local, s] = (begin << 32) | (filled - begin)
            count[local] = filled
        recv_x = tuple(rows) if use_fp8 else rows[0]
        out.append(LowLatencyReceived(recv_x, count, src_info, layout_range))
    return out


def low_latency_combine(topk_idxs, topk_weights, expert_outputs, received):
    """Every source rank's low-latency combine: `expert_outputs[r]` rank r's `[L, R * M, H]` rows
    in its dispatch packing, `received[r]` its `LowLatencyReceived`. Per token, in fp32, for each
    top-k slot in order that names an expert, weight times the expert's row for that token, the
    sum rounded once to bf16."""
    num_ranks = len(expert_outputs)
    per_rank = expert_outputs[0].shape[0]
    out = []
    for s in range(num_ranks):
        tokens, hidden = topk_idxs[s].shape[0], expert_outputs[0].shape[2]
        combined = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
        for t, experts in enumerate(topk_idxs[s].tolist()):
            acc = torch.zeros(hidden, dtype=torch.float32)
            for k, expert in enumerate(experts):
                if expert < 0:
                    continue
                d, local = divmod(expert, per_rank)
                packed = int(received[d].layout_range[local, s])
                begin, count = packed >> 32, packed & 0xFFFFFFFF
                block = received[d].src_info[local, begin:begin + count].tolist()
                row = expert_outputs[d][local, begin + block.index(t)]
                acc = acc + topk_weights[s][t, k] * row.float()
            combined[t] = acc.to(torch.bfloat16)
        out.append(combined)
    return out
