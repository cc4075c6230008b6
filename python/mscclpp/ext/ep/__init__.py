"""`mscclpp.ext.ep`: expert-parallel MoE dispatch and combine with DeepEP V1's API (deep_ep at
v1.2.1), so code written against `deep_ep` runs with its import changed:
`from mscclpp.ext.ep import Buffer, Config, EventOverlap`. Needs torch.

Implemented: the intranode normal mode (1 to 8 ranks, one NVLink domain; ranks may share a GPU):
`get_dispatch_layout`, `dispatch` (bf16; non-cached and cached through the handle;
`expert_alignment`, `num_worst_tokens`; `previous_event`, `async_finish`,
`allocate_on_comm_stream`), `combine` (topk weights, bias), the configs and size hints,
`capture`, `destroy`, `get_local_buffer_tensor`. Not yet: fp8 input, the internode mode
(`num_rdma_bytes` across hosts), the low-latency mode; each raises NotImplementedError naming
what is missing. How the data moves (point-to-point groups, or the intranode kernels with
`Buffer.use_kernels = True`) is in `buffer`'s doc.

The spec (DeepEP's semantics; `reference` implements it in plain PyTorch, rank by rank)

Ranks r = 0..R-1; E experts, L = E / R per rank, expert e on rank e // L. Each rank has T tokens
`x [T, H]` and `topk_idx [T, K]` (int64, -1 = no expert) with `topk_weights [T, K]` (f32).
- Layout (local): `is_token_in_rank[t, r]` is true when any of token t's experts lives on r: a
  token goes to a rank once, however many of its experts live there. `num_tokens_per_rank[r]`
  counts those tokens; `num_tokens_per_expert[e]` counts the (token, k) pairs choosing e.
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
- Errors name the argument: a hidden size whose row is not a multiple of 16 bytes, `topk_idx` out
  of [-1, E), a `num_nvl_bytes` too small for the config, a handle from another Buffer or made
  with another `num_sms`, ranks that disagree. A refusal on one rank is raised on every rank.
"""

from .buffer import Buffer
from .config import Config
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]
