"""`mscclpp.ext.ep`: expert-parallel MoE dispatch and combine with DeepEP V1's API (deep_ep at
v1.2.1), so code written against `deep_ep` runs with its import changed:
`from mscclpp.ext.ep import Buffer, Config, EventOverlap`. Needs torch.

Implemented, for 1 to 8 ranks on one host, or up to 32 across hosts in equal blocks of
consecutive ranks (ranks may share a GPU):
- the intranode normal mode: `get_dispatch_layout`, `dispatch` (bf16, or fp8 as DeepEP's
  `(tokens, scales)` pair; non-cached and cached through the handle; `expert_alignment`,
  `num_worst_tokens`; `previous_event`, `async_finish`, `allocate_on_comm_stream`), `combine`
  (topk weights, bias), the configs and size hints; with `num_worst_tokens` > 0 (and for cached
  dispatches and combines) capturable in a CUDA graph on the point-to-point path;
- the low-latency mode (`low_latency_mode=True`): `low_latency_dispatch` (bf16, or fp8 with f32,
  power-of-two or packed UE8M0 scales; `cumulative_local_expert_recv_stats`; `return_recv_hook`;
  capturable in a CUDA graph), `low_latency_combine` (weighted; `zero_copy` through
  `get_next_low_latency_combine_buffer`, `out`), `get_low_latency_rdma_size_hint`,
  `clean_low_latency_buffer`;
- `capture`, `destroy`, `get_local_buffer_tensor`.
- across hosts (DeepEP's internode mode, on unless `Buffer.allow_internode = False`:
  `get_num_rdma_ranks` > 1, `num_tokens_per_rdma_rank` from `get_dispatch_layout` and checked
  by `dispatch`, `internode_dispatch` and `internode_combine` as `dispatch` and `combine`), every
  call above with the same semantics: the point-to-point groups cross hosts through the
  runtime's PortChannel engine (Ethernet or IB), so a dead or stalled peer is an error on every
  rank within the device wait timeout.
How the data moves (point-to-point groups, or the intranode kernels with
`Buffer.use_kernels = True`, one host only) is in `buffer`'s and `low_latency`'s docs.

The spec (DeepEP's semantics; `reference` implements it in plain PyTorch, rank by rank)

Ranks r = 0..R-1; E experts, L = E / R per rank, expert e on rank e // L. Each rank has T tokens
`x [T, H]` and `topk_idx [T, K]` (int64, -1 = no expert) with `topk_weights [T, K]` (f32).
- Layout (local): `is_token_in_rank[t, r]` is true when any of token t's experts lives on r: a
  token goes to a rank once, however many of its experts live there. `num_tokens_per_rank[r]`
  counts those tokens; `num_tokens_per_expert[e]` counts the (token, k) pairs choosing e. Across
  H hosts of k = R / H consecutive ranks, `num_tokens_per_rdma_rank[h]` counts the tokens with
  an expert on host h (ranks h*k..h*k+k-1), once per host; within one host it is None.
- Dispatch: rank `me` receives blocks by source rank ascending (0, 1, ..., R-1); block s holds the
  tokens of rank s with `is_token_in_rank[t, me]`, in increasing token index. For each received
  row: `recv_topk_idx[k]` is `topk_idx[k] - me * L` where that expert is local to `me`, else -1;
  `recv_topk_weights[k]` is the weight where local, else 0. `recv_src_idx` is the token's index on
  its source. `num_recv_tokens_per_expert_list[l]` is the number of (token, k) pairs, over all
  sources, choosing local expert l, rounded up to a multiple of `expert_alignment` (DeepEP
  aligns these counts only; the rank prefix matrix stays exact). `rank_prefix_matrix[i][j]` is
  the tokens ranks 0..i send to rank j. With `num_worst_tokens` > 0 the received tensors have
  that many rows, the list is empty, and rows past what arrived have `recv_topk_idx` -1, weight 0.
- Combine (the inverse of a dispatch, given its handle): for each of its tokens, rank s computes
  in fp32 `bias_0 + bias_1` (0 for a missing bias), then adds, in ascending rank order r, the row
  rank r returns for that token, for each r the token was dispatched to; the sum is rounded once
  to bf16. No weights are applied. The returned top-k weights are the returned weight rows summed
  the same way (in fp32, not rounded). So with `bias` absent, `combine(dispatch(x))` is x times the
  number of ranks the token went to, exactly for small-integer payloads.
- fp8 dispatch: `x = (tokens [T, H] float8_e4m3fn, scales)` with scales f32 or int32, `[T]` or
  `[T, S]` (any strides); both move as bytes, so `recv_x` is the pair of the received rows and
  their scales, in the same order as bf16 rows.
- Low-latency dispatch (M = `num_max_dispatch_tokens_per_rank`, T <= M): rank `me` receives
  `recv_x [L, R * M, H]`; local expert l's rows are blocks by source rank ascending, block s the
  tokens of rank s with any top-k slot naming expert `me * L + l`, in increasing token index.
  `recv_count[l]` is the number of rows, `layout_range[l, s]` is `(begin << 32) | count` of block
  s, `src_info[l, i]` the row's token index on its source; rows past `recv_count[l]` are
  unspecified. (DeepEP's kernels fill a block in arrival order, so code that must run on both
  compares per (expert, source) block as sets.) With `use_fp8`, per token and 128 channels: amax
  = max |x| (at least 1e-4); scale = amax * (1/448) and rows = x * (448 / amax), or with
  `round_scale` scale = 2^ceil(log2(amax / 448)) and rows = x / scale; rows clamped to +-448 and
  rounded to nearest even e4m3; scales `[L, R * M, H / 128]` f32, or with `use_ue8m0` the
  exponent bytes (2^(byte - 127)) packed four to an int32, `[L, R * M, H / 512]`, both
  column-major in the last two dimensions.
- Low-latency combine (weighted, the inverse of a low-latency dispatch given its handle): for each
  of its tokens, rank s sums in fp32, over the top-k slots in order that name an expert, weight
  times the row the expert's rank returns for that token (its row in the dispatch packing), and
  rounds once to bf16; a token with no expert gets zeros.
- Errors name the argument: a hidden size whose row is not a multiple of 16 bytes, `topk_idx` out
  of [-1, E), a `num_nvl_bytes` too small for the config (or a `num_rdma_bytes` too small for the
  low-latency shapes), more tokens than `num_max_dispatch_tokens_per_rank`, a handle from another
  Buffer or made with another `num_sms`, ranks that disagree. A refusal on one rank is raised on
  every rank.
"""

from .buffer import Buffer
from .config import Config
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]
