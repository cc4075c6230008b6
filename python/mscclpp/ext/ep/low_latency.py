"""The low-latency mode's planning on the point-to-point path: every size a call moves is fixed
by its arguments (`num_max_dispatch_tokens_per_rank` M, the hidden size, top-k and rank count),
so nothing is read on the host and a call can be captured in a CUDA graph.

Dispatch: each rank sends every peer (itself included) one block of M rows: the tokens with at
least one expert on that peer, once each, in token order, padded to M, with per row its source
index and, for each top-k slot, the peer's local expert there or -1. The receiver packs, for each
local expert, the rows that chose it, blocks by source ascending and tokens in order within a
block (`unpack`). Combine: each rank returns to every source a block of M x K rows, the expert
output for each (row, top-k slot) of that source's dispatch block (zero where the slot is not
this rank's), and the source sums the rows of each token's top-k slots in fp32 in slot order,
weighted, and rounds once (`combine_rows`).

The fp8 cast is DeepEP's per-token, per-128-channel one (`cast_fp8`)."""

import torch

# The largest finite float8_e4m3fn value, the channels per fp8 scale, and the floor of a group's
# absolute maximum (so an all-zero group gets a finite scale), as DeepEP uses them.
FP8_MAX = 448.0
SCALE_GROUP = 128
AMAX_FLOOR = 1e-4
# UE8M0 scales: one exponent byte per group, four packed into an int32.
UE8M0_PER_INT = 4


def _align(n, to):
    return (n + to - 1) // to * to


def rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
    """The `num_rdma_bytes` a low-latency Buffer needs (DeepEP's layout sizes: two buffers, each
    with a send area, a receive area for every (expert, token) message and a count per expert;
    a dispatch message is a 16-byte header plus the larger of the bf16 row and the fp8 row with
    its scales, a combine message a bf16 row with a scale per 128 channels), 128-byte aligned."""
    m, scales = num_max_dispatch_tokens_per_rank, hidden // SCALE_GROUP
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(m * dispatch_msg, num_experts * m * combine_msg)
    recv = num_experts * m * max(dispatch_msg, combine_msg)
    signal = num_experts * 4
    return _align(2 * (send + recv + signal), 128)


def cast_fp8(x, round_scale, use_ue8m0):
    """`x` `[T, H]` bf16 as e4m3 rows and their scales: per token and 128 channels, amax = the
    largest |x| (at least 1e-4); without `round_scale` the rows are x * (448 / amax) and the scale
    amax * (1 / 448), in fp32; with it the scale is 2^ceil(log2(amax / 448)) and the rows x / scale.
    Rows are clamped to +-448 and rounded to nearest even. Scales are `[T, H / 128]` f32, or with
    `use_ue8m0` their exponent bytes (scale = 2^(byte - 127)) packed four to an int32, `[T, H /
    512]`, byte i of int j for group 4j + i."""
    tokens, hidden = x.shape
    groups = x.float().view(tokens, hidden // SCALE_GROUP, SCALE_GROUP)
    amax = groups.abs().amax(-1).clamp(min=AMAX_FLOOR)
    exponent = None
    if round_scale:
        mantissa, exponent = torch.frexp(amax * (1.0 / FP8_MAX))
        # ceil(log2(v)): frexp gives v = m * 2^e with m in [0.5, 1); a power of two has m = 0.5.
        exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
        one = torch.ones_like(amax)
        scale_inv, scale = torch.ldexp(one, exponent), torch.ldexp(one, -exponent)
    else:
        scale_inv, scale = amax * (1.0 / FP8_MAX), FP8_MAX / amax
    rows = (groups * scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(tokens, hidden)
    rows = rows.to(torch.float8_e4m3fn)
    if not use_ue8m0:
        return rows, scale_inv
    packed = hidden // (SCALE_GROUP * UE8M0_PER_INT)
    biased = (exponent + 127).to(torch.uint8).view(tokens, packed, UE8M0_PER_INT)
    return rows, biased.contiguous().view(torch.int32).view(tokens, packed)


def route(topk_idx, num_ranks, experts_per_rank):
    """`(rank [T, K], local [T, K])`: the rank of each top-k expert and its index there, -1 for
    a slot that names no expert (-1, or outside [0, E): the caller checks the range when it can
    read the values)."""
    num_experts = num_ranks * experts_per_rank
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    minus_one = torch.full_like(topk_idx, -1)
    rank = torch.where(valid, topk_idx // experts_per_rank, minus_one)
    local = torch.where(valid, topk_idx % experts_per_rank, minus_one)
    return rank, local


def send_slots(rank, num_ranks, num_max):
    """`(token [R, M], position [T, R])`: which token fills row j of the block for rank d (T, the
    padding row, past the tokens that go there), and each token's row in each block (-1 if it
    does not go there)."""
    goes = (rank[:, :, None] == torch.arange(num_ranks, device=rank.device)).any(1)  # [T, R]
    filled = goes.to(torch.int32).cumsum(0, dtype=torch.int32)
    position = torch.where(goes, filled - 1, torch.full_like(filled, -1))
    return slots_of(goes, num_max), position


def slots_of(goes, num_max):
    """`[R, M]`: for `goes [T, R]` (token t goes to rank d), which token fills row j of the block
    for rank d, tokens in order; T (a padding row) past the tokens that go there."""
    tokens, num_ranks = goes.shape
    filled = goes.to(torch.int32).cumsum(0, dtype=torch.int32).t().contiguous()  # [R, T]
    # Row j holds the first token whose running count reaches j + 1.
    wanted = torch.arange(1, num_max + 1, dtype=torch.int32, device=goes.device)
    token = torch.searchsorted(filled, wanted.expand(num_ranks, num_max).contiguous())
    return token.clamp(max=tokens)


def block_meta(token, rank, local, num_tokens):
    """`[R, M, 1 + K]` int32 for each destination block: the row's source index (-1 for padding)
    and, per top-k slot, the destination's local expert there or -1."""
    num_ranks = token.shape[0]
    pad = torch.full((1,) + tuple(local.shape[1:]), -1, dtype=local.dtype, device=local.device)
    local_p = torch.cat([local, pad])  # [T + 1, K]
    rank_p = torch.cat([rank, pad])
    dest = torch.arange(num_ranks, device=rank.device)[:, None, None]
    mine = torch.where(rank_p[token] == dest, local_p[token], torch.full_like(local_p[token], -1))
    source = torch.where(token < num_tokens, token, torch.full_like(token, -1))
    return torch.cat([source[..., None], mine], -1).to(torch.int32)


def unpack(meta, experts_per_rank):
    """The receiver's packing of `meta` `[R, M, 1 + K]` (the blocks from each source):
    `(row [L, R * M], count [L] int32, layout_range [L, R] int64, slot [L, R * M] int64)`. `row`
    indexes the received rows flattened over (source, row), R * M (a padding row) past a local
    expert's count; `layout_range[l, s]` is (begin << 32) | count of source s's block in expert
    l; `slot[l, f]` is the packed position of received row f in expert l's rows, valid where the
    row chose l."""
    num_ranks, num_max = meta.shape[0], meta.shape[1]
    local = meta[..., 1:]
    experts = torch.arange(experts_per_rank, device=meta.device)
    chose = (local[..., None] == experts).any(2)  # [R, M, L]
    per_source = chose.sum(1, dtype=torch.int32).t()  # [L, R]
    begin = per_source.cumsum(1, dtype=torch.int32) - per_source
    count = per_source.sum(1, dtype=torch.int32)
    layout_range = (begin.to(torch.int64) << 32) | per_source.to(torch.int64)
    running = chose.reshape(num_ranks * num_max, experts_per_rank).t().to(torch.int32) \
        .cumsum(1, dtype=torch.int32)  # [L, R * M]
    wanted = torch.arange(1, num_ranks * num_max + 1, dtype=torch.int32, device=meta.device)
    row = torch.searchsorted(running, wanted.expand(experts_per_rank, -1).contiguous())
    return row, count, layout_range, (running - 1).to(torch.int64)


def combine_index(meta, slot, experts_per_rank):
    """`[R, M, K]`: for each source's dispatch block row and top-k slot, the flat index of its
    expert output in this rank's `[L * R * M, H]` rows, or -1 where the slot is not this rank's."""
    num_ranks, num_max = meta.shape[0], meta.shape[1]
    local = meta[..., 1:].to(torch.int64)  # [R, M, K]
    received = torch.arange(num_ranks * num_max, device=meta.device).view(num_ranks, num_max, 1)
    position = slot[local.clamp(min=0), received.expand_as(local)]
    flat = local * (num_ranks * num_max) + position
    return torch.where(local >= 0, flat, torch.full_like(flat, -1))


def combine_rows(returned, rank, position, topk_weights, num_max):
    """The source's sum: `returned` `[R * M * K, H]` the rows every rank sent back (rank d's block
    first), `rank`/`position` the routing of this rank's tokens. Per token, in fp32, in top-k slot
    order, weight times row for each slot naming an expert; rounded once to bf16."""
    tokens, topk = rank.shape
    hidden = returned.shape[1]
    valid = rank >= 0
    row = position.gather(1, rank.clamp(min=0).to(torch.int64))  # [T, K]: the token's block row
    slots = torch.arange(topk, device=rank.device)
    flat = (rank.clamp(min=0).to(torch.int64) * num_max + row) * topk + slots
    rows = returned.index_select(0, torch.where(valid, flat, torch.zeros_like(flat)).flatten())
    rows = rows.view(tokens, topk, hidden).float()
    acc = torch.zeros(tokens, hidden, dtype=torch.float32, device=returned.device)
    for k in range(topk):
        acc = torch.where(valid[:, k, None], acc + topk_weights[:, k, None] * rows[:, k], acc)
    return acc.to(torch.bfloat16)
