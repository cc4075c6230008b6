"""CPU tests of `mscclpp.ext.ep`: the reference against the spec's cases, `Config` and its size
hints, the argument checks (each error naming the argument), DeepEP's signatures, and `Buffer`'s
planning: R ranks simulated as threads of one process, the runtime's point-to-point group and the
bootstrap's all-gather stood in by in-process exchanges, compared with the reference bit for bit.
The CUDA stream handling is what the stand-in replaces; ep_gpu_check.py runs the real thing."""

import contextlib
import inspect
import math
import threading
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import mscclpp.ext  # noqa: E402
from mscclpp.ext import ep  # noqa: E402
from mscclpp.ext.ep import checks, low_latency, reference  # noqa: E402
from mscclpp.ext.ep.buffer import Buffer  # noqa: E402
from mscclpp.ext.ep.config import Config  # noqa: E402
from mscclpp.ext.ep.utils import EventOverlap  # noqa: E402


def routing(seed, num_ranks, num_tokens, num_topk, num_experts, hidden, holes=True):
    """Every rank's (x, topk_idx, topk_weights): distinct experts per token, -1 holes, and
    small-integer payloads (exact in bf16 sums)."""
    gen = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for _ in range(num_ranks):
        idx = torch.stack([torch.randperm(num_experts, generator=gen)[:num_topk]
                           for _ in range(num_tokens)]) if num_tokens else \
            torch.empty(0, num_topk, dtype=torch.int64)
        if holes and idx.numel():
            idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1
        xs.append(torch.randint(-8, 9, (num_tokens, hidden), generator=gen).to(torch.bfloat16))
        idxs.append(idx)
        ws.append(torch.rand(num_tokens, num_topk, generator=gen))
    return xs, idxs, ws


# ---- the reference ---------------------------------------------------------------------------

def test_layout_counts_a_token_once_per_rank():
    # 4 experts on 2 ranks: experts 0, 1 on rank 0; 2, 3 on rank 1.
    topk = torch.tensor([[0, 1], [2, -1], [-1, -1], [1, 3]])
    per_rank, per_expert, in_rank = reference.layout(topk, 4, 2)
    assert per_rank.tolist() == [2, 2]
    assert per_expert.tolist() == [1, 2, 1, 1]
    assert in_rank.tolist() == [[True, False], [False, True], [False, False], [True, True]]


def test_dispatch_order_local_indices_and_alignment():
    x0 = torch.arange(3, dtype=torch.bfloat16)[:, None].repeat(1, 8)
    x1 = 10 + torch.arange(2, dtype=torch.bfloat16)[:, None].repeat(1, 8)
    idx0 = torch.tensor([[3, 0], [1, -1], [2, 3]])
    idx1 = torch.tensor([[2, 1], [0, 0]])
    w0, w1 = torch.full((3, 2), 0.5), torch.full((2, 2), 0.25)
    got = reference.dispatch([x0, x1], [idx0, idx1], [w0, w1], 4, expert_alignment=4)
    # Rank 1 (experts 2, 3): rank 0's tokens 0 and 2, then rank 1's token 0.
    r1 = got[1]
    assert r1.recv_x[:, 0].tolist() == [0, 2, 10]
    assert r1.recv_src_idx.tolist() == [0, 2, 0]
    assert r1.recv_topk_idx.tolist() == [[1, -1], [0, 1], [0, -1]]
    assert r1.recv_topk_weights.tolist() == [[0.5, 0], [0.5, 0.5], [0.25, 0]]
    assert r1.num_recv_tokens_per_expert == [4, 4]  # 2 and 2 pairs, aligned to 4
    # Rank 0 (experts 0, 1): rank 0's tokens 0, 1, then rank 1's 0 and 1 (which picks 0 twice).
    assert got[0].recv_src_idx.tolist() == [0, 1, 0, 1]
    assert got[0].num_recv_tokens_per_expert == [4, 4]  # 3 and 2 pairs
    assert got[0].rank_prefix_matrix.tolist() == [[2, 2], [4, 3]]


@pytest.mark.parametrize("case", ["random", "one_rank", "empty_rank", "one_token", "no_tokens"])
def test_combine_of_dispatch_is_x_times_the_ranks_reached(case):
    R, E = 4, 16
    T = {"one_token": 1, "no_tokens": 0}.get(case, 37)
    xs, idxs, ws = routing(7, R, T, 4, E, 32)
    if case == "one_rank":  # every token to rank 2's experts
        idxs = [torch.randint(8, 12, i.shape) for i in idxs]
    if case == "empty_rank":  # nothing for rank 3
        idxs = [torch.where(i >= 12, -1, i) for i in idxs]
    recv = reference.dispatch(xs, idxs, ws, E)
    routes = [reference.layout(i, E, R)[2] for i in idxs]
    if case == "empty_rank":
        assert recv[3].recv_x.shape[0] == 0
    out = reference.combine(routes, [r.recv_x for r in recv],
                            [r.recv_topk_weights for r in recv])
    for s in range(R):
        reached = routes[s].sum(1, keepdim=True).float()
        assert torch.equal(out[s][0], (xs[s].float() * reached).to(torch.bfloat16))
        assert torch.equal(out[s][1], torch.where(idxs[s] >= 0, ws[s], torch.zeros_like(ws[s])))


def test_combine_adds_bias_then_ranks_in_order_and_rounds_once():
    # One token to both ranks: 256 + 1 + 1 is 258 added in fp32 then rounded (bf16 has 8 bits of
    # mantissa, so rounding after each add would lose the ones: 256 + 1 rounds to 256).
    route = [torch.tensor([[True, True]]), torch.zeros(0, 2, dtype=torch.bool)]
    rows = [torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(1, 8, dtype=torch.bfloat16)]
    bias = torch.full((1, 8), 256, dtype=torch.bfloat16)
    out = reference.combine(route, rows, biases=[bias, None])
    assert out[0][0][0, 0].item() == 258


# ---- Config ----------------------------------------------------------------------------------

def test_config_defaults_tables_and_hints():
    c = Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == \
        (20, 6, 256, 6, 258)  # 256 RDMA slots rounded up to whole chunks of 6, as in DeepEP
    d, k = Buffer.get_dispatch_config(8), Buffer.get_combine_config(2)
    assert (d.num_max_nvl_chunked_send_tokens, d.num_max_nvl_chunked_recv_tokens) == (6, 256)
    assert (k.num_max_nvl_chunked_send_tokens, k.num_max_nvl_chunked_recv_tokens) == (10, 256)
    for r in (2, 4, 8):
        for cfg in (Buffer.get_dispatch_config(r), Buffer.get_combine_config(r)):
            hint = cfg.get_nvl_buffer_size_hint(7168 * 2, r)
            assert hint % 128 == 0
            assert hint >= cfg.buffer_bytes(7168 * 2, r, 128, 128)
            assert cfg.get_rdma_buffer_size_hint(7168 * 2, r) == 0
    assert d.get_rdma_buffer_size_hint(7168 * 2, 16) == 0  # across hosts: no RDMA buffer
    with pytest.raises(NotImplementedError, match="num_ranks=33: at most 32 ranks"):
        d.get_nvl_buffer_size_hint(7168 * 2, 33)
    # The kernels' layout (kernels-cu/src/ep.rs pins the same number).
    assert Config(20, 6, 256).buffer_bytes(7168 * 2, 8, 8) == 295_930_624
    with pytest.raises(ValueError, match="num_ranks=3"):
        Buffer.get_dispatch_config(3)


def test_config_refusals_name_the_field():
    with pytest.raises(ValueError, match="num_max_nvl_chunked_send_tokens=8"):
        Config(20, 8, 8)
    with pytest.raises(ValueError, match="num_sms=-2"):
        Config(-2)
    with pytest.raises(ValueError, match="num_sms=3"):
        Config(3).buffer_bytes(256, 2, 8)
    # RDMA receive slots round up to whole chunks, as DeepEP's do.
    assert Config(20, 6, 256, 6, 100).num_max_rdma_chunked_recv_tokens == 102


# ---- argument checks -------------------------------------------------------------------------

def test_check_errors_name_the_argument():
    with pytest.raises(ValueError, match="x: hidden size 7 is not supported"):
        checks.hidden("x", torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x must be torch.bfloat16"):
        checks.hidden("x", torch.zeros(2, 8))
    with pytest.raises(ValueError, match="only dispatch takes fp8"):
        checks.hidden("x", (torch.zeros(2, 128), torch.zeros(2, 1)))
    fp8 = torch.zeros(2, 128).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"x\[0\] must be a 1-byte float8 tensor"):
        checks.tokens("x", (torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 1)))
    with pytest.raises(ValueError, match=r"x\[1\] \(the scales\) must be torch.float32 or "
                                         r"torch.int32"):
        checks.tokens("x", (fp8, torch.zeros(2, 1, dtype=torch.float16)))
    with pytest.raises(ValueError, match=r"has shape \(3, 1\): it must be \[2\] or \[2, "):
        checks.tokens("x", (fp8, torch.zeros(3, 1)))
    with pytest.raises(ValueError, match="a \\(tokens, scales\\) pair, not 3 items"):
        checks.tokens("x", (fp8, torch.zeros(2, 1), None))
    with pytest.raises(ValueError, match=r"x\[0\]: hidden size 8 is not supported"):
        checks.tokens("x", (torch.zeros(2, 8).to(torch.float8_e4m3fn), torch.zeros(2)))
    # Scales of any strides are taken (DeepEP reads them through their strides).
    column_major = torch.zeros(1, 2).t()
    assert checks.tokens("x", (fp8, column_major))[1].is_contiguous()
    with pytest.raises(ValueError, match=r"topk_idx holds values in \[-1, 16\]"):
        checks.topk_range(torch.tensor([[0, 16], [-1, 3]]), 16)
    with pytest.raises(ValueError, match=r"topk_idx holds values in \[-2, 3\]"):
        checks.topk_range(torch.tensor([[-2, 3]]), 16)
    with pytest.raises(ValueError, match="num_experts=10 does not split into 4 ranks"):
        checks.num_experts(10, 4)
    with pytest.raises(ValueError, match="num_nvl_bytes=100 .* too small"):
        checks.buffer_size("dispatch", 100, 200, Config())
    with pytest.raises(ValueError, match="must be contiguous"):
        checks.tensor("topk_idx", torch.zeros(4, 4, dtype=torch.int64).t(), torch.int64, 2)
    with pytest.raises(ValueError, match="allocate_on_comm_stream"):
        checks.stream_events(None, True, True)


# ---- DeepEP's API ----------------------------------------------------------------------------

def test_the_signatures_are_deepeps():
    assert list(inspect.signature(Buffer.__init__).parameters.items())[1:] == list(
        inspect.signature(_deepep_buffer_init).parameters.items())[1:]
    dispatch = inspect.signature(Buffer.dispatch).parameters
    assert list(dispatch) == ["self", "x", "handle", "num_tokens_per_rank",
                              "num_tokens_per_rdma_rank", "is_token_in_rank",
                              "num_tokens_per_expert", "topk_idx", "topk_weights",
                              "expert_alignment", "num_worst_tokens", "config", "previous_event",
                              "async_finish", "allocate_on_comm_stream"]
    assert list(inspect.signature(Buffer.combine).parameters) == [
        "self", "x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
        "allocate_on_comm_stream"]
    # DeepEP's dispatch calls its internode dispatch positionally, without num_worst_tokens.
    assert list(inspect.signature(Buffer.internode_dispatch).parameters) == [
        p for p in dispatch if p != "num_worst_tokens"]
    assert list(inspect.signature(Buffer.internode_combine).parameters) == list(
        inspect.signature(Buffer.combine).parameters)
    # DeepEP's own tests ask it before they test fp8.
    assert Buffer.is_sm90_compiled() is True
    assert list(inspect.signature(Buffer.low_latency_dispatch).parameters) == [
        "self", "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
        "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "use_fp8",
        "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"]
    assert list(inspect.signature(Buffer.low_latency_combine).parameters) == [
        "self", "x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy",
        "async_finish", "return_recv_hook", "out", "combine_wait_recv_cost_stats"]
    assert inspect.signature(Buffer.low_latency_dispatch).parameters["use_fp8"].default is True
    assert Buffer.num_sms == 20
    assert {"Buffer", "Config", "EventOverlap", "EventHandle"} <= set(ep.__all__)
    assert {"AlgorithmCollection", "AlgorithmCollectionBuilder"} <= set(mscclpp.ext.__all__)


def _deepep_buffer_init(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                        num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True,
                        allow_mnnvl=False, explicitly_destroy=False, comm=None):
    """DeepEP v1.2.1's Buffer.__init__ signature, to compare ours with."""


def test_what_is_not_implemented_says_so():
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) % 128 == 0
    with pytest.raises(ValueError, match="num_experts=10 does not split into 4 ranks"):
        Buffer.get_low_latency_rdma_size_hint(128, 7168, 4, 10)
    for name, args in (("low_latency_update_mask_buffer", (1, True)),
                       ("low_latency_query_mask_buffer", (torch.zeros(2),)),
                       ("low_latency_clean_mask_buffer", ())):
        with pytest.raises(NotImplementedError, match=f"{name}: masking ranks .* fails every"):
            getattr(Buffer, name)(None, *args)
    with pytest.raises(ValueError, match="either group"):
        Buffer(None)
    with pytest.raises(ValueError, match="new_num_sms=3"):
        Buffer.set_num_sms(3)


# ---- Buffer's planning on simulated ranks ----------------------------------------------------

class World:
    """R ranks in threads: an all-gather and a point-to-point exchange through shared lists, each
    wait bounded (a rank that fails early breaks the barrier instead of hanging the others)."""

    def __init__(self, num_ranks):
        self.num_ranks = num_ranks
        self.barrier = threading.Barrier(num_ranks, timeout=20)
        self.slots = [None] * num_ranks

    def _swap(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()
        return every

    def all_gather(self, rank, data):
        return self._swap(rank, data)

    def exchange(self, rank, sends, recvs):
        every = self._swap(rank, sends)
        for p in range(self.num_ranks):
            theirs = [t for t in every[p][rank] if t.numel()]
            mine = [t for t in recvs[p] if t.numel()]
            assert [t.numel() * t.element_size() for t in theirs] == \
                [t.numel() * t.element_size() for t in mine], "send/recv size mismatch"
            for src, dst in zip(theirs, mine):
                dst.copy_(src)


class SimBuffer(Buffer):
    """A Buffer of one simulated rank: the planning is Buffer's, the transport World's."""

    def __init__(self, world, rank, num_nvl_bytes=1 << 30, num_rdma_bytes=0,
                 low_latency_mode=False, hosts=1):
        self.rank, self.group_size, self.group = rank, world.num_ranks, None
        self._hosts = hosts
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, False
        self._device, self._stream, self._handles = torch.device("cpu"), None, {}
        self._ll_combine_input = None
        self._ep = self._nvl = None  # the point-to-point path (the kernels need a GPU)
        self._world = world
        self._session = SimpleNamespace(check=lambda: None)
        self._comm_group = SimpleNamespace(bootstrap=SimpleNamespace(
            all_gather=lambda data: world.all_gather(rank, data)))

    def _capturing(self):
        return False

    def _on_stream(self):
        return contextlib.nullcontext()

    def _wait(self, previous_event):
        return None

    def _finish(self, compute, inputs, outputs, async_finish):
        return EventOverlap(None)

    def _exchange(self, sends, recvs):
        self._world.exchange(self.rank, sends, recvs)


def on_ranks(num_ranks, fn, buffer_class=SimBuffer, **kwargs):
    """fn(buffer) on every simulated rank at once; the per-rank results (or exceptions)."""
    world = World(num_ranks)
    buffers = [buffer_class(world, r, **kwargs) for r in range(num_ranks)]
    out = [None] * num_ranks

    def run(r):
        try:
            out[r] = fn(buffers[r])
        except Exception as e:  # noqa: BLE001 (handed back to the test to inspect)
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def raised(results):
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("num_ranks,num_tokens,case", [
    (2, 50, "random"), (4, 33, "random"), (8, 20, "random"), (4, 1, "random"),
    (4, 0, "random"), (4, 40, "one_rank"), (4, 40, "empty_rank"), (4, 33, "user_defaults")])
def test_buffer_matches_the_reference(num_ranks, num_tokens, case):
    E, K, H = 8 * num_ranks, 4, 64
    xs, idxs, ws = routing(num_ranks * 1000 + num_tokens, num_ranks, num_tokens, K, E, H)
    if case == "one_rank":
        idxs = [torch.where(i >= 0, 8 + i % 8, i) for i in idxs]  # all to rank 1
    if case == "empty_rank":
        idxs = [torch.where(i >= E - 8, -1, i) for i in idxs]
    biases = [torch.randint(-4, 5, (num_tokens, H)).to(torch.bfloat16) for _ in range(num_ranks)]
    want = reference.dispatch(xs, idxs, ws, E, expert_alignment=4)
    routes = [reference.layout(i, E, num_ranks)[2] for i in idxs]

    def rank(buf):
        if case != "user_defaults":
            return calls(buf)
        # DeepEP's tests set torch's default device and float type (to "cuda" and bf16): no
        # tensor of ours may follow them. The meta device stands in for "cuda" (its mode is
        # thread-local, so each rank's thread enters it).
        with torch.device("meta"):
            return calls(buf)

    def calls(buf):
        r = buf.rank
        per_rank, rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        assert rdma is None
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            xs[r], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idxs[r], topk_weights=ws[r],
            expert_alignment=4)
        cached = buf.dispatch(xs[r] * 2, handle=handle)
        combined = buf.combine(recv_x, handle, topk_weights=recv_w, bias=biases[r])
        return (per_rank, per_expert, in_rank), (recv_x, recv_idx, recv_w, counts, handle), \
            cached, combined

    default_dtype = torch.get_default_dtype()
    if case == "user_defaults":
        torch.set_default_dtype(torch.bfloat16)
    try:
        got = raised(on_ranks(num_ranks, rank))
    finally:
        torch.set_default_dtype(default_dtype)
    for r in range(num_ranks):
        layout, (recv_x, recv_idx, recv_w, counts, handle), cached, combined = got[r]
        for a, b in zip(layout, reference.layout(idxs[r], E, num_ranks)):
            assert torch.equal(a, b)
        w = want[r]
        assert torch.equal(recv_x, w.recv_x)
        assert torch.equal(recv_idx, w.recv_topk_idx)
        assert torch.equal(recv_w, w.recv_topk_weights)
        assert counts == w.num_recv_tokens_per_expert
        assert torch.equal(handle[0], w.rank_prefix_matrix)
        assert torch.equal(handle[3], w.recv_src_idx)
        assert torch.equal(cached[0], w.recv_x * 2) and cached[1:5] == (None,) * 4
    out = reference.combine(routes, [g[1][0] for g in got], [g[1][2] for g in got], biases)
    for r in range(num_ranks):
        assert torch.equal(got[r][3][0], out[r][0])
        assert torch.equal(got[r][3][1], out[r][1])


def fp8_tokens(xs, gen, scales_kind):
    """Every rank's fp8 pair from its bf16 tokens: e4m3 rows and scales of `scales_kind`."""
    out = []
    for x in xs:
        T, H = x.shape
        if scales_kind == "f32":
            scales = torch.rand(T, H // 128, generator=gen) + 0.5
        elif scales_kind == "per_token":
            scales = torch.rand(T, generator=gen)
        elif scales_kind == "ue8m0":
            scales = torch.randint(-2**31, 2**31 - 1, (T, H // 512), generator=gen,
                                   dtype=torch.int32)
        else:  # column-major f32, as DeepGEMM lays them out
            scales = torch.rand(H // 128, T, generator=gen).t()
        out.append((x.to(torch.float8_e4m3fn), scales))
    return out


def same_bits(a, b):
    if a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("num_ranks,scales_kind", [
    (2, "f32"), (4, "per_token"), (4, "ue8m0"), (8, "column_major")])
def test_fp8_dispatch_moves_rows_and_scales_bit_for_bit(num_ranks, scales_kind):
    E, K, H = 4 * num_ranks, 3, 512
    xs, idxs, ws = routing(num_ranks * 31, num_ranks, 17, K, E, H)
    fp8 = fp8_tokens(xs, torch.Generator().manual_seed(num_ranks), scales_kind)
    want = reference.dispatch([(d, s.contiguous()) for d, s in fp8], idxs, ws, E,
                              expert_alignment=2)

    def rank(buf):
        r = buf.rank
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            fp8[r], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idxs[r], topk_weights=ws[r],
            expert_alignment=2)
        cached = buf.dispatch(fp8[r], handle=handle)[0]
        worst = buf.dispatch(fp8[r], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert, topk_idx=idxs[r],
                             topk_weights=ws[r], num_worst_tokens=17 * num_ranks)[0]
        return recv_x, recv_idx, recv_w, counts, cached, worst

    for r, (recv_x, recv_idx, recv_w, counts, cached, worst) in enumerate(
            raised(on_ranks(num_ranks, rank))):
        w = want[r]
        n = w.recv_x[0].shape[0]
        for got in (recv_x, cached):
            assert isinstance(got, tuple) and len(got) == 2
            assert same_bits(got[0], w.recv_x[0]) and same_bits(got[1], w.recv_x[1])
        assert worst[0].shape[0] == 17 * num_ranks == worst[1].shape[0]
        assert same_bits(worst[0][:n], w.recv_x[0]) and same_bits(worst[1][:n], w.recv_x[1])
        assert torch.equal(recv_idx, w.recv_topk_idx)
        assert torch.equal(recv_w, w.recv_topk_weights)
        assert counts == w.num_recv_tokens_per_expert


def test_fp8_refusals_are_raised_on_every_rank():
    R, E = 2, 8
    xs, idxs, ws = routing(13, R, 6, 2, E, 256)
    fp8 = fp8_tokens(xs, torch.Generator().manual_seed(1), "f32")

    def rank(buf):
        r = buf.rank
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        x = xs[r] if r == 1 else fp8[r]
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idxs[r],
                            topk_weights=ws[r])

    results = on_ranks(R, rank)
    assert all(isinstance(e, ValueError) and "disagree on dtype" in str(e) for e in results)


@pytest.mark.parametrize("hidden", [128, 384, 512, 7168])
@pytest.mark.parametrize("scales_kind", ["f32", "per_token", "ue8m0", "column_major"])
def test_fp8_rows_pack_into_kernel_rows_and_back_bit_for_bit(hidden, scales_kind):
    """What the kernels' rings carry of an fp8 dispatch: one row of bytes a token (rows, scales,
    zero padding to the rings' 16 bytes), split on arrival into the sender's dtypes and shapes."""
    from mscclpp.ext.ep.buffer import _KERNEL_ROW_ALIGN, _packed_rows, _unpacked_rows
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(11, hidden, generator=gen).to(torch.bfloat16)
    [(rows, scales)] = fp8_tokens([x], gen, scales_kind)
    packed = _packed_rows(rows, scales)
    S = math.prod(scales.shape[1:])
    assert packed.dtype == torch.uint8 and packed.is_contiguous()
    assert packed.shape[1] % _KERNEL_ROW_ALIGN == 0
    assert packed.shape[1] - (hidden + 4 * S) < _KERNEL_ROW_ALIGN
    assert torch.equal(packed[:, hidden + 4 * S:], torch.zeros_like(packed[:, hidden + 4 * S:]))
    # A receiver gets the rows in another order, some twice: each is unpacked on its own.
    pick = torch.tensor([3, 0, 10, 3, 7])
    got_rows, got_scales = _unpacked_rows(packed[pick], rows, scales)
    assert same_bits(got_rows, rows[pick])
    assert same_bits(got_scales, scales[pick].contiguous())


def dispatch_with_worst(buf, xs, idxs, ws, num_experts, worst):
    """This rank's layout, then its dispatch with num_worst_tokens=worst."""
    r = buf.rank
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], num_experts)
    return buf.dispatch(xs[r], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idxs[r], topk_weights=ws[r],
                        num_worst_tokens=worst)


def test_num_worst_tokens_pads_and_refuses_too_few():
    R, E = 2, 8
    xs, idxs, ws = routing(3, R, 10, 2, E, 16)

    def rank(buf, worst):
        return dispatch_with_worst(buf, xs, idxs, ws, E, worst)

    want = reference.dispatch(xs, idxs, ws, E)
    got = raised(on_ranks(R, lambda b: rank(b, 20)))
    for r in range(R):
        recv_x, recv_idx, recv_w, counts, handle, _ = got[r]
        n = want[r].recv_x.shape[0]
        assert recv_x.shape[0] == 20 and counts == []
        assert torch.equal(recv_x[:n], want[r].recv_x)
        assert (recv_idx[n:] == -1).all() and (recv_w[n:] == 0).all()
        assert handle[3].shape[0] == 20
    results = on_ranks(R, lambda b: rank(b, 1))
    assert all(isinstance(e, ValueError) and "num_worst_tokens=1" in str(e) for e in results)


def test_handles_are_checked():
    R, E = 2, 8
    xs, idxs, ws = routing(5, R, 6, 2, E, 16)

    def rank(buf):
        r = buf.rank
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        recv = buf.dispatch(xs[r], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idxs[r],
                            topk_weights=ws[r])
        handle = recv[4]
        errors = []
        for attempt in (
                lambda: buf.combine(recv[0], handle, config=Config(10, 4, 256)),
                lambda: buf.combine(recv[0], tuple(t.clone() for t in handle)),
                lambda: buf.dispatch(xs[r], handle=handle, topk_idx=idxs[r])):
            try:
                attempt()
            except ValueError as e:
                errors.append(str(e))
        return errors

    for errors in raised(on_ranks(R, rank)):
        assert "handle was made with num_sms=20, the config has num_sms=10" in errors[0]
        assert "handle was not made by this Buffer" in errors[1]
        assert "takes neither topk_idx nor topk_weights" in errors[2]


def test_a_refusal_or_a_disagreement_is_raised_on_every_rank():
    R, E = 4, 16
    xs, idxs, ws = routing(9, R, 8, 2, E, 16)

    def rank(buf, hidden_of, too_small):
        r = buf.rank
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        if too_small and r == 1:
            buf.num_nvl_bytes = 1000
        x = xs[r] if hidden_of is None else torch.zeros(8, hidden_of(r), dtype=torch.bfloat16)
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idxs[r],
                            topk_weights=ws[r])

    results = on_ranks(R, lambda b: rank(b, lambda r: 16 if r else 24, False))
    assert all(isinstance(e, ValueError) and "disagree on hidden" in str(e) for e in results)
    results = on_ranks(R, lambda b: rank(b, lambda r: 7 if r == 2 else 16, False))
    assert "hidden size 7 is not supported" in str(results[2])
    assert all("refused on rank(s) {2: " in str(e) for i, e in enumerate(results) if i != 2)
    results = on_ranks(R, lambda b: rank(b, None, True))
    assert "num_nvl_bytes=1000" in str(results[1])
    assert all("refused on rank(s) {1: " in str(e) for i, e in enumerate(results) if i != 1)


def test_inconsistent_layout_is_refused_everywhere():
    R, E = 2, 8
    xs, idxs, ws = routing(11, R, 6, 2, E, 16)

    def rank(buf):
        r = buf.rank
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        if r == 0:
            per_rank = per_rank + 1
        return buf.dispatch(xs[r], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idxs[r],
                            topk_weights=ws[r])

    for e in on_ranks(R, rank):
        assert isinstance(e, ValueError)
        assert "num_tokens_per_rank disagrees with is_token_in_rank on rank(s) [0]" in str(e)


def test_layout_refuses_topk_out_of_range():
    def rank(buf):
        return buf.get_dispatch_layout(torch.tensor([[0, 9]]), 8)

    assert all("topk_idx holds values in [0, 9]" in str(e) for e in on_ranks(2, rank))


# ---- the low-latency mode --------------------------------------------------------------------

def test_fp8_cast_matches_hand_values():
    x = torch.zeros(3, 512)
    x[0, :3] = torch.tensor([448.0, -224.0, 1.0])  # amax 448: scale 1, the values exact
    x[1, 0] = 1000.0  # amax 1000
    x[2, 0], x[2, 128], x[2, 256], x[2, 384] = 1000.0, 300.0, 200.0, 2000.0
    x = x.to(torch.bfloat16)
    rows, scales = low_latency.cast_fp8(x, round_scale=False, use_ue8m0=False)
    assert rows.dtype == torch.float8_e4m3fn and scales.shape == (3, 4)
    assert rows[0, :3].float().tolist() == [448.0, -224.0, 1.0]
    assert scales[0, 0] == torch.tensor(448.0) * (1 / 448)
    # An all-zero group: amax floored at 1e-4, rows zero.
    assert scales[0, 1] == torch.tensor(1e-4) * (1 / 448) and rows[0, 128:].float().abs().sum() == 0
    # Rounded: 1000 / 448 = 2.23, so the scale is 4 and 1000 / 4 = 250 rounds to e4m3's 256; 300 /
    # 448 = 0.67, so the scale is 1 and 300 rounds to 288.
    rows, scales = low_latency.cast_fp8(x, round_scale=True, use_ue8m0=False)
    assert scales[1, 0] == 4.0 and rows[1, 0].float() == 256.0
    assert scales[2].tolist() == [4.0, 1.0, 0.5, 8.0] and rows[2, 128].float() == 288.0
    rows, packed = low_latency.cast_fp8(x, round_scale=True, use_ue8m0=True)
    assert packed.dtype == torch.int32 and packed.shape == (3, 1)
    assert packed[2:].view(torch.uint8).tolist() == [[129, 127, 126, 130]]


def ll_buffer(num_ranks, num_max, hidden, num_experts):
    return dict(low_latency_mode=True, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(
        num_max, hidden, num_ranks, num_experts))


@pytest.mark.parametrize("num_ranks,num_tokens,num_max,fp8,route", [
    (2, 9, 16, None, "random"), (4, 13, 13, "plain", "random"), (4, 7, 20, "round", "random"),
    (8, 5, 8, "ue8m0", "random"), (4, 0, 4, "plain", "random"), (4, 1, 4, None, "random"),
    (4, 11, 11, None, "one_rank")])
def test_low_latency_matches_the_reference(num_ranks, num_tokens, num_max, fp8, route):
    E, K, H = 4 * num_ranks, 3, 512
    L = E // num_ranks
    xs, idxs, ws = routing(num_ranks * 77 + num_tokens, num_ranks, num_tokens, K, E, H)
    if route == "one_rank":
        idxs = [torch.where(i >= 0, L + i % L, i) for i in idxs]
    flags = dict(use_fp8=fp8 is not None, round_scale=fp8 in ("round", "ue8m0"),
                 use_ue8m0=fp8 == "ue8m0")
    want = reference.low_latency_dispatch(xs, idxs, num_max, E, **flags)
    gen = torch.Generator().manual_seed(num_ranks)
    outputs = [torch.randint(-8, 9, (L, num_ranks * num_max, H), generator=gen)
               .to(torch.bfloat16) for _ in range(num_ranks)]
    combined_want = reference.low_latency_combine(idxs, ws, outputs, want)

    def rank(buf):
        r = buf.rank
        stats = torch.zeros(L, dtype=torch.int32)
        recv_x, count, handle, event, hook = buf.low_latency_dispatch(
            xs[r], idxs[r], num_max, E, cumulative_local_expert_recv_stats=stats,
            return_recv_hook=True, **flags)
        hook()
        combined, _, no_hook = buf.low_latency_combine(outputs[r], idxs[r], ws[r], handle)
        buf.get_next_low_latency_combine_buffer(handle).copy_(outputs[r])
        out = torch.empty(num_tokens, H, dtype=torch.bfloat16)
        zero_copy = buf.low_latency_combine(torch.empty_like(outputs[r]), idxs[r], ws[r],
                                            handle, zero_copy=True, out=out)[0]
        assert zero_copy is out and no_hook is None
        return recv_x, count, handle, stats, combined

    for r, (recv_x, count, handle, stats, combined) in enumerate(
            raised(on_ranks(num_ranks, rank, **ll_buffer(num_ranks, num_max, H, E)))):
        w = want[r]
        assert torch.equal(count, w.recv_count) and torch.equal(stats, w.recv_count)
        assert handle[2:] == (num_max, H, E)
        assert torch.equal(handle[1], w.layout_range)
        parts = recv_x if flags["use_fp8"] else (recv_x,)
        want_parts = w.recv_x if flags["use_fp8"] else (w.recv_x,)
        assert parts[0].shape == (L, num_ranks * num_max, H) and parts[0].is_contiguous()
        if flags["use_fp8"]:
            assert parts[0].dtype == torch.float8_e4m3fn
            assert parts[1].stride()[1] == 1  # column-major scales
        for local in range(L):
            n = int(count[local])
            assert torch.equal(handle[0][local, :n], w.src_info[local, :n])
            for got, exp in zip(parts, want_parts):
                assert same_bits(got[local, :n].contiguous(), exp[local, :n].contiguous())
        assert torch.equal(combined, combined_want[r])


def test_low_latency_combine_of_dispatch_weights_each_expert():
    # Small integers and weights of a few bits: every sum is exact, so the combine of the
    # dispatched rows is x times the sum of the token's weights.
    R, T, K, E, H, M = 4, 10, 4, 16, 256, 12
    xs, idxs, _ = routing(3, R, T, K, E, H)
    ws = [torch.randint(0, 4, i.shape).float() / 4 for i in idxs]

    def rank(buf):
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(xs[buf.rank], idxs[buf.rank], M, E,
                                                           use_fp8=False)
        return buf.low_latency_combine(recv_x, idxs[buf.rank], ws[buf.rank], handle)[0]

    for r, combined in enumerate(raised(on_ranks(R, rank, **ll_buffer(R, M, H, E)))):
        weight = torch.where(idxs[r] >= 0, ws[r], torch.zeros_like(ws[r])).sum(1, keepdim=True)
        assert torch.equal(combined, (xs[r].float() * weight).to(torch.bfloat16))


def test_low_latency_refusals_name_the_argument_on_every_rank():
    R, E, H, M = 2, 8, 256, 8
    xs, idxs, ws = routing(21, R, 6, 2, E, H)
    sized = ll_buffer(R, M, H, E)

    def attempt(call, **kwargs):
        def rank(buf):
            return call(buf, buf.rank)
        return on_ranks(R, rank, **kwargs)

    cases = [
        (lambda b, r: b.low_latency_dispatch(xs[r], idxs[r], M, E), {},
         "made with low_latency_mode=False"),
        (lambda b, r: b.low_latency_dispatch(xs[r], idxs[r], M, E),
         dict(low_latency_mode=True, num_rdma_bytes=1000), "num_rdma_bytes=1000"),
        (lambda b, r: b.low_latency_dispatch(xs[r], idxs[r], 4, E), sized,
         "x has 6 tokens, more than num_max_dispatch_tokens_per_rank=4"),
        (lambda b, r: b.low_latency_dispatch(xs[r], idxs[r], M, E, use_ue8m0=True), sized,
         "use_ue8m0=True needs round_scale=True"),
        (lambda b, r: b.low_latency_dispatch(xs[r], idxs[r], M, E, use_ue8m0=True,
                                             round_scale=True), sized,
         "hidden size 256 is not supported with use_fp8 and use_ue8m0"),
        (lambda b, r: b.low_latency_dispatch(xs[r], idxs[r] + 8, M, E), sized,
         "topk_idx holds values in"),
        (lambda b, r: b.low_latency_combine(
            torch.zeros(4, 16, H, dtype=torch.bfloat16), idxs[r], ws[r], (None,) * 5), sized,
         "handle was not made by this Buffer's low_latency_dispatch"),
        (lambda b, r: b.low_latency_combine(
            torch.zeros(4, 16, H, dtype=torch.bfloat16), idxs[r][:, :1].contiguous(),
            ws[r][:, :1].contiguous(),
            b.low_latency_dispatch(xs[r], idxs[r], M, E)[2]), sized,
         "topk_idx has shape (6, 1): dimension 1 must be 2"),
    ]
    for call, kwargs, message in cases:
        for e in attempt(call, **kwargs):
            assert isinstance(e, ValueError) and message in str(e), (message, e)


# ---- the benchmark (its GPU run is `python -m mscclpp.ext.ep.bench` under torchrun) ----------

def test_bench_accounting_and_options():
    from mscclpp.ext.ep import bench
    assert bench.normal_recv_bytes(10, 7168, False) == 10 * 7168 * 2
    assert bench.normal_recv_bytes(10, 7168, True) == 10 * 7168 * 2 * (1 + 4 / 128) / 2
    assert bench.low_latency_bytes(3, 7168, True) == 3 * (7168 + 56 * 4 + 16)
    assert bench.low_latency_bytes(3, 7168, False) == 3 * 7168 * 2
    row = bench.format_row("dispatch bf16", 4096, 7168, 8, 256, 100.0, 1e8, "ok")
    assert row.split() == ["dispatch", "bf16", "4096", "7168", "8", "256", "100.00", "1000.00",
                           "ok"]
    args = bench.parse_args(["--modes", "low-latency", "--ll-tokens", "64"])
    assert (args.modes, args.ll_tokens, args.num_tokens) == (["low-latency"], 64, 4096)
    for bad in (["--modes", "fast"], ["--hidden", "1000"], ["--iters", "0"],
                ["--num-topk", "9", "--num-experts", "8"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_the_benchmarks_exact_checks_hold(use_ue8m0):
    # The benchmark checks fp8 calls by dequantizing: with power-of-two scales, small-integer
    # tokens come back exactly, which its combine identities rely on.
    from mscclpp.ext.ep import bench
    x, idx, w = bench.routing(3, 16, 1024, 4, 32, torch.device("cpu"))
    rows, scales = low_latency.cast_fp8(x, round_scale=True, use_ue8m0=use_ue8m0)
    assert torch.equal(bench.dequantize(rows, scales), x)
    assert (idx.sort(1).values.diff(1) > 0).all() and ((w * 4).frac() == 0).all()


# ---- the normal mode under CUDA-graph capture (fixed-size blocks, nothing read on the host) ----

class CapturingSimBuffer(SimBuffer):
    """A simulated rank whose every call runs as if a CUDA graph were being captured."""

    def _capturing(self):
        return True


def on_capturing_ranks(num_ranks, fn, **kwargs):
    return on_ranks(num_ranks, fn, buffer_class=CapturingSimBuffer, **kwargs)


@pytest.mark.parametrize("num_ranks,fp8", [(2, False), (4, True), (8, False)])
def test_captured_dispatch_and_combine_match_the_reference(num_ranks, fp8):
    # Every rank with its own token count (0 on the last), as real batches differ.
    E, K, H = 4 * num_ranks, 3, 256
    xs, idxs, ws = routing(num_ranks * 5, num_ranks, 30, K, E, H)
    counts = [30 - 7 * (r % 4) for r in range(num_ranks - 1)] + [0]
    xs, idxs, ws = ([t[:n].contiguous() for t, n in zip(v, counts)] for v in (xs, idxs, ws))
    tokens = fp8_tokens(xs, torch.Generator().manual_seed(2), "f32") if fp8 else xs
    biases = [torch.randint(-4, 5, (n, H)).to(torch.bfloat16) for n in counts]
    want = reference.dispatch([(d, s) for d, s in tokens] if fp8 else tokens, idxs, ws, E)
    routes = [reference.layout(i, E, num_ranks)[2] for i in idxs]
    worst = max(w.recv_src_idx.shape[0] for w in want) + 5

    def rank(buf):
        r = buf.rank
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        recv_x, recv_idx, recv_w, listed, handle, _ = buf.dispatch(
            tokens[r], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idxs[r], topk_weights=ws[r],
            num_worst_tokens=worst)
        cached = buf.dispatch(tokens[r], handle=handle)[0]
        rows = recv_x[0] if fp8 else recv_x
        n = want[r].recv_src_idx.shape[0]
        # The combine's input: the received rows, padding rows zero (a model's output there
        # is whatever it computes; a combine ignores them).
        expert_out = values_as_bf16(rows) if fp8 else rows.clone()
        combined = buf.combine(expert_out, handle, topk_weights=recv_w, bias=biases[r])
        return recv_x, recv_idx, recv_w, listed, handle, cached, combined, n

    got = raised(on_capturing_ranks(num_ranks, rank))
    outs = []
    for r, (recv_x, recv_idx, recv_w, listed, handle, cached, combined, n) in enumerate(got):
        w = want[r]
        assert listed == [] and handle[3].shape[0] == worst
        parts = recv_x if fp8 else (recv_x,)
        want_parts = w.recv_x if fp8 else (w.recv_x,)
        for got_part, cached_part, exp in zip(parts, cached if fp8 else (cached,), want_parts):
            assert same_bits(got_part[:n].contiguous(), exp)
            assert same_bits(cached_part[:n].contiguous(), exp)
        assert torch.equal(recv_idx[:n], w.recv_topk_idx) and (recv_idx[n:] == -1).all()
        assert torch.equal(recv_w[:n], w.recv_topk_weights) and (recv_w[n:] == 0).all()
        assert torch.equal(handle[3][:n], w.recv_src_idx) and (handle[3][n:] == -1).all()
        assert torch.equal(handle[0], w.rank_prefix_matrix)
        outs.append(combined)
    rows = [(g[0][0] if fp8 else g[0])[:g[7]] for g in got]
    rows = [values_as_bf16(t) if fp8 else t for t in rows]
    want_combined = reference.combine(routes, rows, [g[2][:g[7]] for g in got], biases)
    for r in range(num_ranks):
        assert torch.equal(outs[r][0], want_combined[r][0])
        assert torch.equal(outs[r][1], want_combined[r][1])


def values_as_bf16(rows):
    """fp8 rows as the bf16 of their values (a stand-in for an expert's output)."""
    return rows.float().to(torch.bfloat16)


def test_capture_needs_num_worst_tokens_and_asserts_on_overflow():
    R, E = 2, 8
    xs, idxs, ws = routing(17, R, 12, 2, E, 16)

    def rank(buf, worst):
        return dispatch_with_worst(buf, xs, idxs, ws, E, worst)

    results = on_capturing_ranks(R, lambda b: rank(b, 0))
    assert all(isinstance(e, RuntimeError) and "without num_worst_tokens" in str(e)
               for e in results)
    # Too few rows: nothing can be raised in a graph, so the device asserts (here at once).
    results = on_capturing_ranks(R, lambda b: rank(b, 1))
    assert all(isinstance(e, RuntimeError) and "more tokens arrived than the 1 rows" in str(e)
               for e in results)


# ---- across hosts ----------------------------------------------------------------------------

def test_hosts_must_be_equal_blocks_of_consecutive_ranks():
    from mscclpp.ext.ep.config import host_blocks
    assert host_blocks([[0, 1, 2, 3]], 4) == 1
    assert host_blocks([[0, 1], [2, 3]], 4) == 2
    assert host_blocks([[4, 5, 6, 7], [0, 1, 2, 3]], 8) == 2
    for hosts, n, match in (([[0, 2], [1, 3]], 4, "consecutive"),
                            ([[0, 1, 2], [3]], 4, "as many ranks"),
                            ([list(range(9))], 9, "one NVLink domain holds at most 8"),
                            ([list(range(9)), list(range(9, 18))], 18, "9 ranks a host"),
                            ([[r] for r in range(33)], 33, "at most 32 ranks")):
        with pytest.raises(NotImplementedError, match=match):
            host_blocks(hosts, n)


@pytest.mark.parametrize("num_ranks,hosts", [(4, 2), (8, 2), (8, 4)])
def test_across_hosts_the_layout_counts_tokens_per_host(num_ranks, hosts):
    E, K, H = 4 * num_ranks, 3, 64
    xs, idxs, ws = routing(num_ranks * 77 + hosts, num_ranks, 23, K, E, H)
    want = reference.dispatch(xs, idxs, ws, E)

    def rank(buf):
        r = buf.rank
        assert (buf.get_num_rdma_ranks(), buf.get_num_nvl_ranks()) == (hosts, num_ranks // hosts)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        # Positionally, in DeepEP's order (its `dispatch` calls it so): handle, the four
        # layout tensors, topk_idx, topk_weights, expert_alignment, then config.
        recv_x = buf.internode_dispatch(xs[r], None, per_rank, per_host, in_rank, per_expert,
                                        idxs[r], ws[r], 1, buf.get_dispatch_config(num_ranks))[0]
        return per_host, in_rank, recv_x

    for r, (per_host, in_rank, recv_x) in enumerate(
            raised(on_ranks(num_ranks, rank, hosts=hosts))):
        assert torch.equal(per_host, reference.tokens_per_host(in_rank, hosts))
        assert torch.equal(recv_x, want[r].recv_x)


def test_a_wrong_num_tokens_per_rdma_rank_is_refused_on_every_rank():
    E = 16
    xs, idxs, ws = routing(5, 4, 12, 2, E, 64)

    def rank(buf):
        r = buf.rank
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        if r == 1:
            per_host = per_host + 1
        buf.dispatch(xs[r], num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host,
                     is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=idxs[r], topk_weights=ws[r])

    for result in on_ranks(4, rank, hosts=2):
        assert isinstance(result, ValueError), result
        assert "num_tokens_per_rdma_rank disagrees with is_token_in_rank on rank(s) [1]" \
            in str(result)


# ---- the fault-injection workload's iteration (python/tests/ep_fault_loop.py) -----------------

def _fault_loop():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_fault_loop.py")
    spec = importlib.util.spec_from_file_location("ep_fault_loop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("num_ranks,hosts,low_latency", [
    (2, 1, False), (4, 1, False), (4, 2, False), (2, 1, True), (4, 2, True)])
def test_the_fault_loops_iteration_checks_every_element(num_ranks, hosts, low_latency):
    loop = _fault_loop()
    tokens, hidden, experts = 24, 128, 4 * num_ranks
    extra = ll_buffer(num_ranks, tokens, hidden, experts) if low_latency else {}

    def rank(buf):
        gen = torch.Generator().manual_seed(5 + buf.rank)
        for _ in range(3):
            loop.iteration(buf, gen, tokens, hidden, experts, 4, torch.device("cpu"), low_latency)
        return True

    assert raised(on_ranks(num_ranks, rank, hosts=hosts, **extra)) == [True] * num_ranks


class CorruptingSimBuffer(SimBuffer):
    """In rank 1's combine (its second group of rows) the lowest bit of every received row's first
    byte flips: its first element changes, and the loop's check must see it."""

    def _exchange(self, sends, recvs):
        super()._exchange(sends, recvs)
        got = [t for per_peer in recvs for t in per_peer if t.numel()]
        if got and all(t.dtype == torch.uint8 for t in got):
            self._row_groups = getattr(self, "_row_groups", 0) + 1
            if self.rank == 1 and self._row_groups == 2:
                for t in got:
                    t[:, 0] ^= 1


def test_the_fault_loops_iteration_names_a_wrong_result():
    loop = _fault_loop()

    def rank(buf):
        gen = torch.Generator().manual_seed(9 + buf.rank)
        loop.iteration(buf, gen, 24, 32, 8, 4, torch.device("cpu"))

    results = on_ranks(2, rank, buffer_class=CorruptingSimBuffer)
    wrong = [r for r in results if isinstance(r, RuntimeError)]
    assert wrong and all("differs from x times the ranks reached" in str(e) for e in wrong), results
