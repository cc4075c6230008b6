"""The EP benchmark, `python -m mscclpp.ext.ep.bench` (also `mscclpp-bench ep`), one process per
rank under torchrun: DeepEP's figures for `mscclpp.ext.ep.Buffer` as rows in nccl-tests' style.

- Normal mode (`--num-tokens`, default DeepEP's 4096 x 7168, top-8 of 256 experts): dispatch in
  bf16 and in fp8, and combine; GB/s is the bytes a rank receives (bf16 rows; fp8 rows scaled as
  DeepEP's test_intranode scales them, by (1 + 4 / 128) / 2) over the mean time of a call.
- Low-latency mode (`--ll-tokens`, default 128): dispatch (fp8 and bf16) and combine, the time
  of a call and DeepEP's test_low_latency bandwidth (per selected expert, an fp8 row with its
  scales and a 16-byte header, or a bf16 row).

Before it is timed, every call is checked exactly: payloads are small integers and weights
quarters, so `combine(dispatch(x))` is `x` times the ranks each token reached (normal mode) or
the sum of its weights (low-latency mode, fp8 rows dequantized first: power-of-two scales make
that exact). Times are CUDA events around batches of `--iters` calls on the current stream, the
median batch per call, the mean over ranks. Where ranks share a GPU the times are not comparable
(the header says so): run one rank per GPU for numbers. Exit status 1 if a check fails."""

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

from .buffer import Buffer
from .low_latency import SCALE_GROUP, UE8M0_PER_INT, cast_fp8

# DeepEP's accounting: an fp8 row is hidden bytes plus an f32 scale per 128 channels, half of a
# bf16 row's bytes plus the scales (test_intranode); a low-latency fp8 message adds a 16-byte
# header (test_low_latency).
FP8_FACTOR = (1 + 4 / SCALE_GROUP) / 2
LL_HEADER_BYTES = 16


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m mscclpp.ext.ep.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-tokens", type=int, default=4096, help="normal mode tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--num-topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--ll-tokens", type=int, default=128,
                   help="low-latency tokens per rank (num_max_dispatch_tokens_per_rank)")
    p.add_argument("--modes", default="normal,low-latency",
                   help="comma-separated: normal, low-latency")
    p.add_argument("--iters", type=int, default=20, help="timed calls per batch")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first")
    p.add_argument("--batches", type=int, default=5, help="timed batches (median reported)")
    p.add_argument("--num-sms", type=int, default=Buffer.num_sms,
                   help="Buffer.set_num_sms (the kernels' SMs)")
    p.add_argument("--kernels", action="store_true",
                   help="normal mode through the intranode kernels (Buffer.use_kernels)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in ("normal", "low-latency"):
            p.error(f"--modes: unknown mode {m!r} (normal, low-latency)")
    for name in ("num_tokens", "hidden", "num_topk", "num_experts", "ll_tokens", "iters",
                 "batches"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.hidden % (SCALE_GROUP * UE8M0_PER_INT):
        p.error(f"--hidden {args.hidden}: fp8 scales need a multiple of "
                f"{SCALE_GROUP * UE8M0_PER_INT}")
    if args.num_topk > args.num_experts:
        p.error(f"--num-topk {args.num_topk} exceeds --num-experts {args.num_experts}")
    return args


def normal_recv_bytes(num_recv_tokens, hidden, fp8):
    """Bytes a rank receives in a normal dispatch, as DeepEP's test_intranode counts them."""
    bf16 = num_recv_tokens * hidden * 2
    return bf16 * FP8_FACTOR if fp8 else bf16


def low_latency_bytes(num_selections, hidden, fp8):
    """Bytes of a rank's low-latency messages for `num_selections` (token, expert) pairs, as
    DeepEP's test_low_latency counts them: fp8 rows with scales and a header, or bf16 rows."""
    per = hidden + hidden // SCALE_GROUP * 4 + LL_HEADER_BYTES if fp8 else hidden * 2
    return num_selections * per


HEADER = (f"{'mode':>22} {'tokens':>7} {'hidden':>7} {'top-k':>6} {'experts':>8} "
          f"{'time(us)':>10} {'GB/s':>9}  check")


def format_row(mode, tokens, hidden, topk, experts, time_us, nbytes, check):
    gbps = nbytes / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0
    return (f"{mode:>22} {tokens:>7} {hidden:>7} {topk:>6} {experts:>8} {time_us:>10.2f} "
            f"{gbps:>9.2f}  {check}")


def routing(seed, tokens, hidden, topk, experts, device):
    """This rank's tokens (small integers), distinct top-k experts and quarter weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (tokens, hidden), generator=gen).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    w = torch.randint(0, 4, (tokens, topk), generator=gen).float() / 4
    return x.to(device), idx.to(device), w.to(device)


def dequantize(rows, scales):
    """bf16 of fp8 `rows [..., H]` times their per-128-channel `scales [..., H / 128]` (f32, or
    int32 packed UE8M0 exponents)."""
    if scales.dtype == torch.int32:
        exponents = scales.contiguous().view(torch.uint8).to(torch.int32) - 127
        scales = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)
    per_channel = scales.float().repeat_interleave(SCALE_GROUP, dim=-1)
    return (rows.float() * per_channel).to(torch.bfloat16)


def timed(call, args):
    """Median over batches of the mean time of one call (us), CUDA events on the current stream."""
    for _ in range(args.warmup):
        call()
    means = []
    for _ in range(args.batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            call()
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) * 1e3 / args.iters)
    return statistics.median(means)


def mean_over_ranks(value):
    t = torch.tensor([float(value)])
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def verdict(ok):
    """"ok" if every rank's check passed, else the number of ranks that failed."""
    bad = torch.tensor([0 if ok else 1])
    dist.all_reduce(bad)
    return "ok" if int(bad) == 0 else f"FAILED on {int(bad)} rank(s)"


def bench_normal(buf, args, rows):
    R, r, dev = buf.group_size, buf.rank, torch.device("cuda", torch.cuda.current_device())
    T, H, K, E = args.num_tokens, args.hidden, args.num_topk, args.num_experts
    x, idx, w = routing(args.seed * 1000 + r, T, H, K, E, dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    reached = in_rank.sum(1, keepdim=True).float()
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    x_fp8 = cast_fp8(x, round_scale=True, use_ue8m0=False)
    want = (x.float() * reached).to(torch.bfloat16)

    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **layout)
    combined = buf.combine(recv_x, handle, topk_weights=recv_w)[0]
    ok_bf16 = torch.equal(combined, want)
    num_recv = recv_x.shape[0]
    cases = [("dispatch bf16", lambda: buf.dispatch(x, **layout),
              normal_recv_bytes(num_recv, H, False), ok_bf16)]
    recv_fp8, _, _, _, handle_fp8, _ = buf.dispatch(x_fp8, **layout)
    ok_fp8 = torch.equal(buf.combine(dequantize(*recv_fp8), handle_fp8)[0], want)
    cases.append(("dispatch fp8", lambda: buf.dispatch(x_fp8, **layout),
                  normal_recv_bytes(num_recv, H, True), ok_fp8))
    cases.append(("combine bf16", lambda: buf.combine(recv_x, handle, topk_weights=recv_w),
                  normal_recv_bytes(num_recv, H, False), ok_bf16))
    for mode, call, nbytes, ok in cases:
        t = mean_over_ranks(timed(call, args))
        rows.append(format_row(mode, T, H, K, E, t, mean_over_ranks(nbytes), verdict(ok)))


def bench_low_latency(buf, args, rows):
    r, dev = buf.rank, torch.device("cuda", torch.cuda.current_device())
    M, H, K, E = args.ll_tokens, args.hidden, args.num_topk, args.num_experts
    x, idx, w = routing(args.seed * 1000 + 500 + r, M, H, K, E, dev)
    selections = int((idx >= 0).sum())
    want = (x.float() * torch.where(idx >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)) \
        .to(torch.bfloat16)

    def round_trip(**flags):
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, **flags)
        rows_bf16 = dequantize(*recv) if flags.get("use_fp8") else recv
        return torch.equal(buf.low_latency_combine(rows_bf16, idx, w, handle)[0], want), \
            rows_bf16, handle

    ok_fp8, _, _ = round_trip(use_fp8=True, round_scale=True)
    ok_ue8m0, _, _ = round_trip(use_fp8=True, round_scale=True, use_ue8m0=True)
    ok_bf16, expert_rows, handle = round_trip(use_fp8=False)
    for mode, call, nbytes, ok in (
            ("ll dispatch fp8", lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=True),
             low_latency_bytes(selections, H, True), ok_fp8 and ok_ue8m0),
            ("ll dispatch bf16", lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False),
             low_latency_bytes(selections, H, False), ok_bf16),
            ("ll combine bf16", lambda: buf.low_latency_combine(expert_rows, idx, w, handle),
             low_latency_bytes(selections, H, False), ok_bf16)):
        t = mean_over_ranks(timed(call, args))
        rows.append(format_row(mode, M, H, K, E, t, mean_over_ranks(nbytes), verdict(ok)))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    # gloo: the group only bootstraps the Buffer (and NCCL refuses ranks sharing a GPU).
    dist.init_process_group("gloo")
    R, r = dist.get_world_size(), dist.get_rank()
    Buffer.use_kernels = args.kernels
    Buffer.set_num_sms(args.num_sms)
    nvl = max(c.get_nvl_buffer_size_hint(args.hidden * 2, R)
              for c in (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)))
    rdma = Buffer.get_low_latency_rdma_size_hint(args.ll_tokens, args.hidden, R,
                                                 args.num_experts)
    buf = Buffer(dist.group.WORLD, num_nvl_bytes=nvl, num_rdma_bytes=rdma,
                 low_latency_mode="low-latency" in args.modes, explicitly_destroy=True)
    shared = int(os.environ.get("LOCAL_WORLD_SIZE", R)) > torch.cuda.device_count()
    path = f"kernels, {args.num_sms} SMs" if args.kernels else "point-to-point groups"
    if r == 0:
        print(f"# mscclpp-bench ep: {R} ranks on {torch.cuda.get_device_name()}, normal mode "
              f"through {path}, low-latency mode through point-to-point groups; {args.warmup} "
              f"warm-up calls, {args.batches} batches of {args.iters}, median batch, mean over "
              "ranks", flush=True)
        if shared:
            print("# ranks share a GPU: the times are not comparable (one rank per GPU for "
                  "numbers)", flush=True)
        print(HEADER, flush=True)
    rows = []
    for mode, run in (("normal", bench_normal), ("low-latency", bench_low_latency)):
        if mode in args.modes:
            run(buf, args, rows)
    failed = [row for row in rows if "FAILED" in row]
    if r == 0:
        for row in rows:
            print(row, flush=True)
        print(f"# {len(rows)} rows, {len(failed)} failed checks", flush=True)
    buf.destroy()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
