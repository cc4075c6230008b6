"""GPU check of `mscclpp.ext.ep` under torchrun (ranks may share one GPU, with or without MPS):
every case's layout, dispatch (non-cached, cached, async with allocate_on_comm_stream,
num_worst_tokens) and combine (with and without bias) compared bit for bit with
`mscclpp.ext.ep.reference`, which each rank computes on the CPU for all ranks from the shared
seed. Cases: random routing with -1 holes, every token to one rank, a rank receiving nothing,
1 token, 0 tokens, and 4096 tokens x 7168 hidden x top-8 of 256 experts. Payloads are small
integers, so `combine(dispatch(x))` is exactly x times the ranks each token reached; that is
checked too. Then fp8 tokens (e4m3 rows with f32 scales per 128 channels, non-cached and cached,
bit for bit, at a hidden size whose packed row the kernels pad and one they do not), the
low-latency mode (bf16 and the three fp8
scale formats: each local expert's rows, counts, source indices and layout ranges against
`reference.low_latency_dispatch`, the weighted combine against `reference.low_latency_combine`,
asynchronous with a receive hook, then dispatch and combine captured in one CUDA graph and
replayed on fresh data), the normal mode captured in a CUDA graph (dispatch with
num_worst_tokens, then combine, replayed on doubled tokens; refused by the kernels), and the
refusals: a handle made with another num_sms, on every rank.
Prints the seed; exit status 1 on any mismatch or error.
With --kernels, through the intranode kernels instead of the point-to-point groups.
Run: torchrun --nproc_per_node=N ep_gpu_check.py [--seed S] [--quick] [--kernels] [--num-sms N]"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from mscclpp.ext.ep import Buffer, Config, reference


def case_inputs(seed, num_ranks, num_tokens, num_topk, num_experts, hidden, route):
    """Every rank's (x, topk_idx, topk_weights) on the CPU, the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    per_rank = num_experts // num_ranks
    xs, idxs, ws = [], [], []
    for _ in range(num_ranks):
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        if route == "one_rank":  # only the last rank's experts
            scores[:, :(num_ranks - 1) * per_rank] = -1
        if route == "empty_rank":  # nothing for rank 0's experts
            scores[:, :per_rank] = -1
        idx = scores.topk(num_topk, dim=1).indices
        idx[scores.gather(1, idx) < 0] = -1
        if route in ("holes", "empty_rank"):
            idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1
        xs.append(torch.randint(-8, 9, (num_tokens, hidden), generator=gen).to(torch.bfloat16))
        idxs.append(idx)
        ws.append(torch.rand(num_tokens, num_topk, generator=gen))
    return xs, idxs, ws


def same(name, got, want, failures):
    got = got.cpu() if isinstance(got, torch.Tensor) else got
    if isinstance(want, torch.Tensor) and want.element_size() == 1:  # fp8: compare the bits
        want = want.view(torch.uint8)
        got = got.view(torch.uint8) if isinstance(got, torch.Tensor) else got
    if isinstance(want, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and got.shape == want.shape and \
            got.dtype == want.dtype and torch.equal(got, want)
    else:
        ok = got == want
    if not ok:
        failures.append(name)


def run_case(buf, name, seed, num_tokens, num_topk, num_experts, hidden, route):
    R, r, dev = buf.group_size, buf.rank, torch.device("cuda", torch.cuda.current_device())
    xs, idxs, ws = case_inputs(seed, R, num_tokens, num_topk, num_experts, hidden, route)
    biases = [torch.randint(-4, 5, (num_tokens, hidden),
                            generator=torch.Generator().manual_seed(seed + 1 + s))
              .to(torch.bfloat16) for s in range(R)]
    want = reference.dispatch(xs, idxs, ws, num_experts, expert_alignment=8)
    routes = [reference.layout(i, num_experts, R)[2] for i in idxs]
    x, idx, w = xs[r].to(dev), idxs[r].to(dev), ws[r].to(dev)
    f = []

    per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    for got, exp, what in zip((per_rank, per_expert, in_rank),
                              reference.layout(idxs[r], num_experts, R),
                              ("num_tokens_per_rank", "num_tokens_per_expert",
                               "is_token_in_rank")):
        same(f"layout {what}", got, exp, f)
    hosts = buf.get_num_rdma_ranks()
    if hosts > 1:
        same("layout num_tokens_per_rdma_rank", per_host,
             reference.tokens_per_host(reference.layout(idxs[r], num_experts, R)[2], hosts), f)
    else:
        same("layout num_tokens_per_rdma_rank", per_host, None, f)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=w, expert_alignment=8)
    mine = want[r]
    same("recv_x", recv_x, mine.recv_x, f)
    same("recv_topk_idx", recv_idx, mine.recv_topk_idx, f)
    same("recv_topk_weights", recv_w, mine.recv_topk_weights, f)
    same("num_recv_tokens_per_expert_list", counts, mine.num_recv_tokens_per_expert, f)
    same("rank_prefix_matrix", handle[0], mine.rank_prefix_matrix, f)
    same("recv_src_idx", handle[3], mine.recv_src_idx, f)

    # Cached, asynchronous, tensors owned by the communication stream.
    cached = buf.dispatch(x * 2, handle=handle, previous_event=Buffer.capture(),
                          async_finish=True, allocate_on_comm_stream=True)
    cached[5].current_stream_wait()
    same("cached recv_x", cached[0], mine.recv_x * 2, f)

    # Combine without bias: x times the ranks reached; with bias: the reference.
    combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    reached = routes[r].sum(1, keepdim=True).float()
    same("combine round trip", combined, (xs[r].float() * reached).to(torch.bfloat16), f)
    out = reference.combine(routes, [g.recv_x for g in want], [g.recv_topk_weights for g in want],
                            biases)
    combined, combined_w, event = buf.combine(recv_x, handle, topk_weights=recv_w,
                                              bias=biases[r].to(dev), async_finish=True)
    event.current_stream_wait()
    same("combine with bias", combined, out[r][0], f)
    same("combined topk_weights", combined_w, out[r][1], f)

    # num_worst_tokens: the same rows first, the rest without expert.
    worst = max(g.recv_x.shape[0] for g in want) + 3
    recv_x, recv_idx, _, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
        num_worst_tokens=worst)
    n = mine.recv_x.shape[0]
    same("num_worst_tokens recv_x", recv_x[:n], mine.recv_x, f)
    same("num_worst_tokens padding", bool((recv_idx[n:] == -1).all()), True, f)
    same("num_worst_tokens list", counts, [], f)
    return [f"{name}: {x}" for x in f]


def run_fp8_case(buf, seed, kernels):
    """fp8 dispatch: e4m3 rows and f32 scales move bit for bit, non-cached and cached (through the
    kernels as one packed row of bytes a token: 512 + 16 bytes fill it, 384 + 12 are padded)."""
    return [m for hidden in (512, 384) for m in fp8_case_at(buf, seed, hidden)]


def fp8_case_at(buf, seed, hidden):
    R, r, dev = buf.group_size, buf.rank, torch.device("cuda", torch.cuda.current_device())
    experts = 8 * R
    xs, idxs, ws = case_inputs(seed, R, 77, 4, experts, hidden, "holes")
    gen = torch.Generator().manual_seed(seed + 1)
    fp8 = [(x.to(torch.float8_e4m3fn), torch.rand(x.shape[0], hidden // 128, generator=gen))
           for x in xs]
    want = reference.dispatch(fp8, idxs, ws, experts)[r]
    x = (fp8[r][0].to(dev), fp8[r][1].to(dev))
    idx, w = idxs[r].to(dev), ws[r].to(dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    f = []
    try:
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    except NotImplementedError as e:
        return [f"fp8 hidden {hidden}: refused: {e}"]
    for i, part in enumerate(("rows", "scales")):
        same(f"recv_x {part}", recv_x[i], want.recv_x[i], f)
    same("recv_topk_idx", recv_idx, want.recv_topk_idx, f)
    same("recv_topk_weights", recv_w, want.recv_topk_weights, f)
    same("num_recv_tokens_per_expert_list", counts, want.num_recv_tokens_per_expert, f)
    cached = buf.dispatch(x, handle=handle)[0]
    for i, part in enumerate(("rows", "scales")):
        same(f"cached recv_x {part}", cached[i], want.recv_x[i], f)
    return [f"fp8 hidden {hidden}: {m}" for m in f]


def run_graph_case(buf, seed, kernels):
    """The normal mode captured in one CUDA graph: dispatch (num_worst_tokens) and combine."""
    R, r, dev = buf.group_size, buf.rank, torch.device("cuda", torch.cuda.current_device())
    experts = 8 * R
    xs, idxs, ws = case_inputs(seed, R, 64, 4, experts, 256, "holes")
    want = reference.dispatch([2 * t for t in xs], idxs, ws, experts)[r]
    routes = [reference.layout(i, experts, R)[2] for i in idxs]
    x, idx, w = xs[r].to(dev), idxs[r].to(dev), ws[r].to(dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    worst = max(g.recv_x.shape[0] for g in reference.dispatch(xs, idxs, ws, experts)) + 3
    f = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
                    x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                    num_worst_tokens=worst)
                combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    except RuntimeError as e:
        if not kernels or "through the intranode kernels" not in str(e):
            f.append(f"capture failed: {e}")
        return [f"graph: {m}" for m in f]
    if kernels:
        f.append("the kernels were captured, which they refuse")
    torch.cuda.current_stream().wait_stream(stream)
    x.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    n = want.recv_x.shape[0]
    same("graph recv_x", recv_x[:n], want.recv_x, f)
    same("graph recv_topk_idx", recv_idx[:n], want.recv_topk_idx, f)
    same("graph padding", bool((recv_idx[n:] == -1).all()), True, f)
    reached = routes[r].sum(1, keepdim=True).float()
    same("graph combine", combined, (2 * xs[r].float() * reached).to(torch.bfloat16), f)
    return [f"graph: {m}" for m in f]


def run_low_latency_case(buf, seed, num_tokens, num_max, hidden, num_topk, num_experts):
    """The low-latency mode against the reference: eager in each format, then in a CUDA graph."""
    R, r, dev = buf.group_size, buf.rank, torch.device("cuda", torch.cuda.current_device())
    L = num_experts // R
    f = []
    xs, idxs, ws = case_inputs(seed, R, num_tokens, num_topk, num_experts, hidden, "holes")
    gen = torch.Generator().manual_seed(seed + 7)
    outputs = [torch.randint(-8, 9, (L, R * num_max, hidden), generator=gen).to(torch.bfloat16)
               for _ in range(R)]
    x, idx, w, y = xs[r].to(dev), idxs[r].to(dev), ws[r].to(dev), outputs[r].to(dev)

    def compare(tag, got, count, handle, want):
        same(f"{tag} recv_count", count, want.recv_count, f)
        same(f"{tag} layout_range", handle[1], want.layout_range, f)
        parts = got if isinstance(got, tuple) else (got,)
        want_parts = want.recv_x if isinstance(want.recv_x, tuple) else (want.recv_x,)
        for local in range(L):
            n = int(want.recv_count[local])
            same(f"{tag} src_info of expert {local}", handle[0][local, :n],
                 want.src_info[local, :n], f)
            for i, (a, b) in enumerate(zip(parts, want_parts)):
                same(f"{tag} recv_x[{i}] of expert {local}", a[local, :n].contiguous(),
                     b[local, :n].contiguous(), f)

    combined_want = None
    for tag, flags in (("bf16", dict(use_fp8=False)), ("fp8", dict(use_fp8=True)),
                       ("fp8 rounded", dict(use_fp8=True, round_scale=True)),
                       ("fp8 ue8m0", dict(use_fp8=True, round_scale=True, use_ue8m0=True))):
        want = reference.low_latency_dispatch(xs, idxs, num_max, num_experts, **flags)
        got, count, handle, event, hook = buf.low_latency_dispatch(
            x, idx, num_max, num_experts, async_finish=True, return_recv_hook=True, **flags)
        event.current_stream_wait()
        hook()
        compare(f"low-latency {tag}", got, count, handle, want[r])
        if combined_want is None:
            combined_want = reference.low_latency_combine(idxs, ws, outputs, want)[r]
        combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
        same(f"low-latency combine after {tag}", combined, combined_want, f)

    # Captured: dispatch and combine in one graph, replayed on other tokens of the same routing.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            got, count, handle, _, _ = buf.low_latency_dispatch(x, idx, num_max, num_experts,
                                                                use_fp8=True)
            combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
    torch.cuda.current_stream().wait_stream(stream)
    x.mul_(-1)
    graph.replay()
    torch.cuda.synchronize()
    want = reference.low_latency_dispatch([-t for t in xs], idxs, num_max, num_experts,
                                          use_fp8=True)
    compare("low-latency graph replay", got, count, handle, want[r])
    same("low-latency graph replay combine", combined, combined_want, f)
    return [f"low-latency: {m}" for m in f]


def check_refusals(buf, failures):
    dev = torch.device("cuda", torch.cuda.current_device())
    idx = torch.zeros(4, 1, dtype=torch.int64, device=dev)
    x = torch.ones(4, 64, dtype=torch.bfloat16, device=dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, buf.group_size)
    recv = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx,
                        topk_weights=torch.ones(4, 1, device=dev))
    try:
        buf.combine(recv[0], recv[4], config=Config(Buffer.num_sms + 2, 4, 256))
        failures.append("refusals: a handle of another num_sms was taken")
    except ValueError as e:
        if "handle was made with num_sms" not in str(e):
            failures.append(f"refusals: unexpected error {e}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=None,
                        help="default: rank 0's clock, shared with every rank")
    parser.add_argument("--quick", action="store_true", help="skip the 4096 x 7168 case")
    parser.add_argument("--kernels", action="store_true",
                        help="the intranode kernels (Buffer.use_kernels), not point-to-point")
    parser.add_argument("--num-sms", type=int, default=Buffer.num_sms,
                        help="Buffer.set_num_sms (the kernels' grid: 2 * num_sms * ranks blocks "
                             "for a dispatch; lower it where ranks share a GPU under MPS)")
    args = parser.parse_args()
    Buffer.use_kernels = args.kernels
    Buffer.set_num_sms(args.num_sms)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    # gloo: the group only bootstraps the Buffer, and NCCL refuses ranks sharing a GPU.
    dist.init_process_group("gloo")
    R, r = dist.get_world_size(), dist.get_rank()
    # Every rank builds every rank's inputs from the seed: all must use rank 0's.
    seed = [args.seed if args.seed is not None else int(time.time()) % 100000]
    dist.broadcast_object_list(seed, src=0)
    args.seed = seed[0]
    if r == 0:
        print(f"ep_gpu_check: {R} ranks, seed {args.seed}, num_sms {args.num_sms}, "
              f"{'kernels' if args.kernels else 'point-to-point'}", flush=True)
    hidden_big = 7168
    hints = [c.get_nvl_buffer_size_hint(hidden_big * 2, R)
             for c in (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R))]
    ll = dict(num_tokens=48, num_max=64, hidden=2048, num_topk=4, num_experts=4 * R)
    rdma = Buffer.get_low_latency_rdma_size_hint(ll["num_max"], ll["hidden"], R,
                                                 ll["num_experts"])
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=max(hints), num_rdma_bytes=rdma,
                 low_latency_mode=True, explicitly_destroy=True)
    if r == 0 and buf.get_num_rdma_ranks() > 1:
        print(f"  across {buf.get_num_rdma_ranks()} hosts of {buf.get_num_nvl_ranks()} ranks",
              flush=True)
    experts = 8 * R
    cases = [("random with holes", 100, 4, experts, 256, "holes"),
             ("every token to one rank", 64, 4, experts, 256, "one_rank"),
             ("a rank receives nothing", 64, 4, experts, 256, "empty_rank"),
             ("1 token", 1, 2, experts, 128, "holes"),
             ("0 tokens", 0, 2, experts, 128, "holes")]
    if not args.quick and 256 % R == 0:
        cases.append(("4096 x 7168 top-8 of 256", 4096, 8, 256, hidden_big, "plain"))
    failures = []

    def case(name, run, *case_args, **case_kwargs):
        """Runs one case; its failures (or its exception) are reported, its time printed."""
        start = time.time()
        try:
            failures.extend(run(*case_args, **case_kwargs))
        except Exception as e:  # noqa: BLE001 (reported, then the exit status says it)
            failures.append(f"{name}: {type(e).__name__}: {e}")
        if r == 0:
            print(f"  {name}: done in {time.time() - start:.1f} s", flush=True)

    for i, (name, tokens, topk, num_experts, hidden, route) in enumerate(cases):
        case(name, run_case, buf, name, args.seed + 1000 * i, tokens, topk, num_experts, hidden,
             route)
    case("fp8", run_fp8_case, buf, args.seed + 999, args.kernels)
    case("normal mode in a CUDA graph", run_graph_case, buf, args.seed + 3000, args.kernels)
    case("low-latency", run_low_latency_case, buf, args.seed + 2000, **ll)
    try:
        check_refusals(buf, failures)
    except Exception as e:  # noqa: BLE001
        failures.append(f"refusals: {type(e).__name__}: {e}")
    for line in failures:
        print(f"rank {r}: FAILED {line}", flush=True)
    bad = torch.tensor([len(failures)])
    dist.all_reduce(bad)
    buf.destroy()
    if r == 0:
        total = len(cases) + 4
        print(f"ep_gpu_check: {'FAILED ' + str(int(bad)) + ' checks' if bad else 'all passed'}"
              f" ({total} cases on {R} ranks, seed {args.seed})", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
