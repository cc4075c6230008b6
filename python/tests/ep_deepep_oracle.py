"""Differential check of `mscclpp.ext.ep.Buffer` against DeepEP itself (deep_ep v1.2.1, its
intranode normal mode): layout, dispatch (bf16, fp8, cached, async, num_worst_tokens) and combine
compared bit for bit on the same inputs. deep_ep is built by hand on the GPU machine (no NVSHMEM)
and never committed; without it the check is skipped.
Run: torchrun --nproc_per_node 2 python/tests/ep_deepep_oracle.py [--kernels] [--seed S]
     [--quick] (2, 4 or 8 ranks, which may share one GPU). Exit status 1 on any difference."""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from mscclpp.ext.ep import Buffer

try:
    import deep_ep
except Exception as e:  # noqa: BLE001 (any failure to import means there is nothing to compare)
    if os.environ.get("RANK", "0") == "0":
        print(f"ep_deepep_oracle: skipped: deep_ep is not importable ({e})", flush=True)
    sys.exit(0)

# An integer dtype of each element size: floats are compared as their bits (NaN, -0 included).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    return t.view(_BITS[t.element_size()]) if t.dtype.is_floating_point else t


def difference(ours, theirs):
    """None when `ours` equals DeepEP's `theirs` (tensors bit for bit, shape and dtype too; lists
    and other values by value), else what differs."""
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        ours, theirs = (torch.tensor(v, dtype=torch.int64) for v in (ours, theirs))
    if not isinstance(ours, torch.Tensor) or not isinstance(theirs, torch.Tensor):
        if isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor) or ours != theirs:
            return f"ours is {ours!r}, DeepEP's {theirs!r}"
        return None
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
        return (f"ours is {ours.dtype} {tuple(ours.shape)}, DeepEP's {theirs.dtype} "
                f"{tuple(theirs.shape)}")
    differ = bits(ours) != bits(theirs.to(ours.device))
    count = int(differ.sum())
    if not count:
        return None
    first = tuple(differ.nonzero()[0].tolist())
    return f"{count} of {differ.numel()} elements differ, first at index {first}"


class Tally:
    """This rank's checks: how many ran, how many differed (each difference printed)."""

    def __init__(self, rank):
        self.rank, self.total, self.failed = rank, 0, 0

    def fail(self, case, check, why):
        self.failed += 1
        print(f"rank {self.rank}: FAILED {case}: {check}: {why}", flush=True)

    def same(self, case, check, ours, theirs):
        self.total += 1
        why = difference(ours, theirs)
        if why is not None:
            self.fail(case, check, why)
        return why is None


def case_inputs(seed, num_tokens, hidden, num_experts, num_topk, routing, num_ranks, dev):
    """This rank's (x, topk_idx, topk_weights, bias 0, bias 1), drawn on the CPU from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    if routing == "rank 0":  # every token's experts among rank 0's
        scores = torch.rand(num_tokens, num_experts // num_ranks, generator=gen)
    else:
        scores = torch.rand(num_tokens, num_experts, generator=gen)
    topk_idx = scores.topk(num_topk, dim=1).indices
    if routing == "holes":
        topk_idx[torch.rand(topk_idx.shape, generator=gen) < 0.1] = -1
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    topk_weights = torch.rand(num_tokens, num_topk, generator=gen)
    b0, b1 = (torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16) for _ in range(2))
    return [t.to(dev) for t in (x, topk_idx, topk_weights, b0, b1)]


def to_fp8(x):
    """Our per-token fp8 cast: for each 128 channels of a token, scale = absmax / 448 (absmax at
    least 1e-4) and rows x / scale in e4m3; the scales `[T, H / 128]` f32 column-major, as
    DeepEP's own test passes them."""
    T, H = x.shape
    blocks = x.float().view(T, H // 128, 128)
    scales = blocks.abs().amax(2).clamp(min=1e-4) / 448
    rows = (blocks / scales[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(T, H)
    return rows, scales.T.contiguous().T


def row_factor(num_rows, dev):
    """The bf16 factor each received row is multiplied by before combine: row % 7 + 1."""
    return (torch.arange(num_rows, device=dev) % 7 + 1).to(torch.bfloat16)[:, None]


def combine_reference(x, in_rank, rank_prefix, rank, biases):
    """Check 7's combine in float64, from this rank's tokens alone: per token, bias 0 + bias 1,
    then for each rank d the token went to, ascending, the row d returns: x times the
    `row_factor` of its row in d's receive (in d's block for this rank, after this rank's
    earlier tokens that went to d), in bf16."""
    T, R = in_rank.shape
    acc = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for b in biases:
        acc += b.double()
    before = rank_prefix[rank - 1].long() if rank else torch.zeros(R, dtype=torch.long,
                                                                   device=x.device)
    for d in range(R):
        went = in_rank[:, d]
        row = before[d] + went.long().cumsum(0) - 1
        y = x * ((row % 7 + 1).to(torch.bfloat16))[:, None]
        acc += torch.where(went[:, None], y.double(), torch.zeros_like(acc))
    return acc


def off_reference(combined, ref):
    diff = (combined.double() - ref).abs()
    wrong = int((bits(combined) != bits(ref.to(torch.bfloat16))).sum())
    return f"max |x - ref| {float(diff.max()) if diff.numel() else 0.0:.4g}, {wrong} elements " \
           "differ from ref rounded to bf16"


def run_case(ours, theirs, tally, name, seed, tokens, hidden, num_experts, num_topk, routing):
    R, r = ours.group_size, ours.rank
    dev = torch.device("cuda", torch.cuda.current_device())
    x, idx, w, b0, b1 = case_inputs(seed, tokens[r], hidden, num_experts, num_topk, routing, R,
                                    dev)

    def same(check, a, b):
        return tally.same(name, check, a, b)

    # 1. The layout, each library's own passed to its dispatches below.
    layouts = [buf.get_dispatch_layout(idx, num_experts) for buf in (ours, theirs)]
    for i, what in ((0, "num_tokens_per_rank"), (1, "num_tokens_per_rdma_rank (None)"),
                    (2, "num_tokens_per_expert"), (3, "is_token_in_rank")):
        same(f"layout {what}", layouts[0][i], layouts[1][i])

    def dispatch(tokens_in, **kwargs):
        """The same non-cached dispatch on ours, then on DeepEP: the two results."""
        return [buf.dispatch(tokens_in, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                             num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w, **kwargs)
                for buf, lay in zip((ours, theirs), layouts)]

    # 2. Non-cached bf16 dispatch.
    for alignment in (1, 4):
        o, t = dispatch(x, expert_alignment=alignment)
        tag = f"dispatch (expert_alignment {alignment})"
        for i, what in ((0, "recv_x"), (1, "recv_topk_idx"), (2, "recv_topk_weights"),
                        (3, "num_recv_tokens_per_expert_list")):
            same(f"{tag} {what}", o[i], t[i])
        same(f"{tag} rank_prefix_matrix", o[4][0], t[4][0])
        same(f"{tag} recv_src_idx", o[4][3], t[4][3])
        if alignment == 1:
            first = (o, t)
    received = int(first[1][4][0][R - 1, r])

    # 3. num_worst_tokens: the received rows first, then rows without an expert.
    o, t = dispatch(x, num_worst_tokens=max(tokens) * R)
    for i, what in ((0, "recv_x"), (1, "recv_topk_idx"), (2, "recv_topk_weights")):
        same(f"num_worst_tokens {what}[:received]", o[i][:received], t[i][:received])
    same("num_worst_tokens recv_topk_idx[received:]", o[1][received:], t[1][received:])
    same("num_worst_tokens DeepEP's recv_topk_idx[received:] all -1",
         bool((t[1][received:] == -1).all()), True)
    same("num_worst_tokens num_recv_tokens_per_expert_list", o[3], t[3])

    # 4. Cached dispatch through each library's own handle from 2.
    o, t = (buf.dispatch(x, handle=res[4]) for buf, res in zip((ours, theirs), first))
    same("cached dispatch recv_x", o[0], t[0])

    # 5. fp8 dispatch: the e4m3 rows and their scales.
    o, t = dispatch(to_fp8(x))
    same("fp8 dispatch recv_x rows", o[0][0], t[0][0])
    same("fp8 dispatch recv_x scales", o[0][1], t[0][1])

    # 6. Asynchronous, after an event captured on the compute stream.
    results = []
    for buf, lay in zip((ours, theirs), layouts):
        res = buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                           num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w,
                           previous_event=buf.capture(), async_finish=True)
        res[5].current_stream_wait()
        results.append(res)
    same("async dispatch recv_x", results[0][0], results[1][0])

    # 7. Combine of the received rows scaled per row, without and with two biases.
    for tag, bias in (("combine", None), ("combine with bias", (b0, b1))):
        o, t = (buf.combine(res[0] * row_factor(res[0].shape[0], dev), res[4],
                            topk_weights=res[2], bias=bias)
                for buf, res in zip((ours, theirs), first))
        if not same(f"{tag} combined_x", o[0], t[0]) and o[0].shape == t[0].shape == x.shape:
            ref = combine_reference(x, layouts[1][3], first[1][4][0], r,
                                    [] if bias is None else list(bias))
            print(f"rank {r}: {name}: {tag} against float64: ours {off_reference(o[0], ref)}; "
                  f"DeepEP's {off_reference(t[0], ref)}", flush=True)
        same(f"{tag} combined_topk_weights", o[1], t[1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=None,
                        help="default: rank 0's clock, shared with every rank")
    parser.add_argument("--kernels", action="store_true",
                        help="ours through the intranode kernels (Buffer.use_kernels), not "
                             "point-to-point")
    parser.add_argument("--quick", action="store_true", help="skip the 4096 x 7168 case")
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    # gloo: the group only bootstraps the Buffers, and NCCL refuses ranks sharing a GPU.
    dist.init_process_group("gloo")
    R, r = dist.get_world_size(), dist.get_rank()
    if R not in (2, 4, 8):
        if r == 0:
            print(f"ep_deepep_oracle: needs 2, 4 or 8 ranks (DeepEP's config tables), not {R}",
                  flush=True)
        dist.destroy_process_group()
        sys.exit(1)
    seed = [args.seed if args.seed is not None else int(time.time()) % 100000]
    dist.broadcast_object_list(seed, src=0)
    seed = seed[0]
    path = "kernels" if args.kernels else "p2p"
    if r == 0:
        print(f"seed {seed}", flush=True)

    # (name, tokens on each rank, hidden, experts, top-k, routing)
    cases = [("random with -1 holes", [333] * R, 2048, 8 * R, 4, "holes"),
             ("skewed: every token to rank 0's experts", [128] * R, 1024, 4 * R, 2, "rank 0"),
             ("one token", [1] * R, 512, 2 * R, 2, "random"),
             (f"empty rank: rank {R - 1} sends nothing", [64] * (R - 1) + [0], 512, 4 * R, 2,
              "random")]
    if not args.quick:
        # R (2, 4 or 8) divides 256.
        cases.append(("4096 x 7168 top-8 of 256", [4096] * R, 7168, 256, 8, "random"))

    hidden_bytes = max(c[2] for c in cases) * 2

    def nvl_bytes(lib):
        return max(c.get_nvl_buffer_size_hint(hidden_bytes, R)
                   for c in (lib.get_dispatch_config(R), lib.get_combine_config(R)))

    Buffer.use_kernels = args.kernels
    group = dist.group.WORLD
    theirs = deep_ep.Buffer(group, num_nvl_bytes=nvl_bytes(deep_ep.Buffer),
                            explicitly_destroy=True)
    ours = Buffer(group, num_nvl_bytes=nvl_bytes(Buffer), explicitly_destroy=True)
    tally = Tally(r)
    for index, (name, *case) in enumerate(cases):
        start = time.time()
        try:
            run_case(ours, theirs, tally, name, seed * 1000 + 10 * index + r, *case)
        except Exception as e:  # noqa: BLE001 (reported, then the exit status says it)
            tally.total += 1
            tally.fail(name, "error", f"{type(e).__name__}: {e}")
        if r == 0:
            print(f"  {name}: done in {time.time() - start:.1f} s", flush=True)
    ours.destroy()
    theirs.destroy()

    counts = torch.tensor([tally.total, tally.failed])
    dist.all_reduce(counts)
    total, failed = (int(c) for c in counts)
    if r == 0:
        what = f"all {total} checks matched DeepEP" if not failed else \
            f"{failed} of {total} checks differ from DeepEP"
        print(f"ep_deepep_oracle: {what} on {R} ranks (seed {seed}, path {path})", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
