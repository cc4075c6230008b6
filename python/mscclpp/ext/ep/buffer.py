"""`Buffer`: DeepEP V1's expert-parallel buffer (deep_ep/buffer.py at v1.2.1, same signatures and
defaults) on this runtime: the intranode normal mode over one of two data paths, and the
low-latency mode.

The point-to-point path (the default): the layout and all planning are PyTorch ops on the
communication stream; the counts every rank needs are exchanged in one point-to-point group of
the runtime (`CommSession.p2p`, one kernel, sends and receives matched in order per peer) and read
on the host; the tokens then move in a second group, each rank sending to each peer the rows it
selects for it, packed in token order, into that peer's receive block for this source (a row and
its metadata as one run of bytes: one send and one receive a peer). Combine
sends the rows back the same way and reduces them in fp32 in ascending rank order. An eager call
reads a few counts on the host (so a receive beyond `num_worst_tokens` is a ValueError on every
rank). Under CUDA-graph capture (a dispatch needs `num_worst_tokens` > 0 there, as in DeepEP; a
cached dispatch and a combine need nothing) nothing is read on the host: every rank sends each
rank a block of as many rows as it has tokens, the receiver packs the real ones with searches over
running counts, and more than `num_worst_tokens` arriving is a device-side assertion, as in
DeepEP.

The kernel path (`Buffer.use_kernels = True`; on one H200 it matched the reference bit for bit at 2
ranks with fp8 and the 4096 x 7168 case, and at 8 under MPS on the quick cases): `ep_notify`
exchanges the counts through every rank's NVLink buffer and the host reads them once per
non-cached dispatch;
`ep_dispatch` and `ep_combine` move the rows through rings in the receivers' buffers
(kernels-cu/src/kernels/ep_intranode.cu); a cached dispatch and a combine read nothing on the host.
The data path's refusals come from the runtime before anything is enqueued: a buffer too small
for the kernels' layout, a grid that the ranks sharing the GPU could not all keep resident (naming
`num_sms`).

On both, each argument refusal is raised before anything is enqueued, and a refusal that depends
on other ranks' arguments is raised on every rank. fp8 rows move as bytes with their scales (f32
or int32, bit for bit): on the point-to-point path as extra int32 columns of the row's metadata,
through the kernels as one row of bytes a token (rows, scales, zero padding to 16 bytes), split
again on arrival.

The low-latency calls always take the point-to-point path, with every size fixed by the call's
shapes, so they read nothing on the host and may be captured in a CUDA graph (`low_latency`'s doc).
"""

import json
import math
import time
import weakref
from typing import NamedTuple

import torch

from ... import _mscclpp
from ...comm import CommGroup
from . import checks, low_latency
from .config import host_blocks, recommended
from .utils import EventHandle, EventOverlap

# What the layout and dispatch bring to a 6-tuple handle, by position (DeepEP's order).
_HANDLE_LEN = 6


def _not_in_phase_1(what):
    raise NotImplementedError(f"{what} is not implemented yet in mscclpp.ext.ep, which has the "
                              "intranode normal mode and the low-latency mode")


def _not_masked(what):
    raise NotImplementedError(
        f"{what}: masking ranks out of the low-latency mode is not implemented: DeepEP masks a "
        "failed rank to go on without it, while this runtime's communicator fails every rank's "
        "calls when a peer dies or stalls (an error naming the peer, within the device wait "
        "timeout); make a new Buffer over the survivors instead")


def _to_host(t, check):
    """`t` on the host once the current stream's work before it is done: a non-blocking copy into
    pinned memory and an event polled, so that no thread of this process waits inside the driver
    while a point-to-point group may still need the proxy's work. A pageable `t.cpu()` right
    after a group across hosts stalled it until the device timeout (while a thread waits in a
    pageable copy behind a kernel, the driver holds back other threads' work:
    python/tests/p2p_host_read_check.py, docs/pending-gpu-checks.md), and the EP check across
    hosts passed only with the host polling after its groups. `check` (the session's or the
    kernels' error check) runs while polling and after: a kernel's waits end at the device wait
    timeout with the communicator's error, which it raises."""
    if not t.is_cuda:
        check()
        return t
    # device="cpu": under torch.set_default_device("cuda") (DeepEP's own tests set it) a
    # factory without a device would make a CUDA tensor, which cannot be pinned.
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    _poll(torch.cuda.current_stream(t.device), check)
    return host


def _poll(stream, check):
    """Returns once `stream`'s work so far is done, polling an event (no thread of this process
    waits inside the driver) and running `check` while it polls and after."""
    done = torch.cuda.Event()
    done.record(stream)
    while not done.query():
        check()
        # Yields the GIL and the CPU without a sleep's tens of microseconds.
        time.sleep(0)
    check()


class Buffer:
    """The expert-parallel communication buffer of one rank of `group` (DeepEP's `Buffer`).

    `group` is a torch.distributed process group or a `mscclpp.CommGroup` (`comm`, an mpi4py
    communicator, when `group` is None); creating a Buffer is collective. `num_nvl_bytes` is the
    NVLink buffer, sized with `Config.get_nvl_buffer_size_hint`. With `low_latency_mode=True`
    the low-latency calls take `num_rdma_bytes` of at least `get_low_latency_rdma_size_hint` for
    their shapes (checked; their point-to-point path allocates what a call moves from PyTorch's
    allocator, so the bytes are not reserved up front). `num_qps_per_rank`,
    `allow_nvlink_for_low_latency_mode` and `allow_mnnvl` are accepted and unused, as in DeepEP
    within one NVLink domain. A group may span hosts (unless `Buffer.allow_internode` is False)
    (`config.host_blocks`: equal blocks of consecutive ranks, at most 8 a host, 32 in all); its
    rows then cross hosts through the runtime's point-to-point engine over PortChannels.
    """

    num_sms: int = 20
    # The data path of the Buffers made from now on: False, the runtime's point-to-point groups
    # (see the module doc); True, the intranode kernels (kernels-cu/src/kernels/ep_intranode.cu:
    # counts and rings through every rank's NVLink buffer). Every rank must set the same.
    use_kernels: bool = False
    # Groups across hosts (DeepEP's internode mode) for the Buffers made from now on; False
    # refuses them, for a program that wants its groups kept inside a host (docs/ep.md).
    allow_internode: bool = True

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 explicitly_destroy=False, comm=None):
        checks.positive_int("num_nvl_bytes", num_nvl_bytes, 0)
        checks.positive_int("num_rdma_bytes", num_rdma_bytes, 0)
        checks.positive_int("num_qps_per_rank", num_qps_per_rank, 1)
        if group is None and comm is None:
            raise ValueError("Buffer: either group (a torch.distributed group or a "
                             "mscclpp.CommGroup) or comm (an mpi4py communicator) must be given")
        if isinstance(group, CommGroup):
            size = group.nranks
        elif group is not None:
            size = group.size()
        else:
            size = comm.Get_size()
        if not torch.cuda.is_available():
            raise RuntimeError("Buffer needs a CUDA device (torch.cuda.is_available() is False)")
        device = torch.cuda.current_device()
        if isinstance(group, CommGroup):
            self._comm_group = group
        elif group is not None:
            self._comm_group = CommGroup(torch_group=group, device=device)
        else:
            self._comm_group = CommGroup(mpi_comm=comm, device=device)
        self.group = group if group is not None else comm
        self.rank = self._comm_group.my_rank
        self.group_size = self._comm_group.nranks
        # DeepEP's NVLink and RDMA ranks: the hosts (simulated ones included), which the
        # internode mode needs in equal blocks of consecutive ranks, as DeepEP numbers them.
        self._hosts = host_blocks(self._comm_group.communicator.host_ranks, size)
        if self._hosts > 1 and not Buffer.allow_internode:
            raise NotImplementedError(
                f"Buffer: this group spans {self._hosts} hosts and Buffer.allow_internode is "
                "False (set it True on every rank for the internode mode; see docs/ep.md)")
        if self._hosts > 1 and Buffer.use_kernels:
            raise NotImplementedError(
                "Buffer.use_kernels: the intranode kernels need every peer's memory mapped, "
                f"and this group spans {self._hosts} hosts; use the point-to-point path "
                "(Buffer.use_kernels = False), which crosses hosts")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = explicitly_destroy
        self._device = torch.device("cuda", device)
        self._session = _mscclpp.CommSession(self._comm_group.communicator)
        why = self._session.p2p_unavailable()
        if why is not None:
            raise RuntimeError(f"Buffer: this communicator cannot send and receive: {why}")
        self._stream = torch.cuda.Stream(device=self._device)
        # The kernels' NVLink buffer is the runtime's (every peer maps it); the point-to-point
        # path keeps a plain one for get_local_buffer_tensor.
        self._ep = _mscclpp.EpBuffer(self._comm_group.communicator, num_nvl_bytes) \
            if Buffer.use_kernels else None
        self._nvl = None if self._ep is not None else torch.zeros(
            num_nvl_bytes, dtype=torch.uint8, device=self._device)
        # The handles this Buffer made: id of the handle's first tensor -> (a weak reference to
        # it, what a later call needs of it: the channel count of a normal-mode handle, the
        # combine plan of a low-latency one). Weak, so a dropped handle is forgotten.
        self._handles = {}
        # The low-latency combine's zero-copy input (get_next_low_latency_combine_buffer).
        self._ll_combine_input = None

    # ---- configuration -----------------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled():
        """DeepEP's test of its build for the fp8 and Hopper paths. Ours compiles its kernels for
        the device at run time and moves fp8 rows on every architecture: always True."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms):
        """The SMs the high-throughput kernels use (even: each channel is a sender and a receiver
        block); the configs made after this call use it."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms <= 0 \
                or new_num_sms % 2:
            raise ValueError(f"set_num_sms: new_num_sms={new_num_sms!r} must be a positive even "
                             "int")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks):
        """DeepEP's recommended dispatch config for `num_ranks` with `Buffer.num_sms`."""
        return recommended("dispatch", num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        """DeepEP's recommended combine config for `num_ranks` with `Buffer.num_sms`."""
        return recommended("combine", num_ranks, Buffer.num_sms)

    @staticmethod
    def capture():
        """An event on the current stream, to pass as a later call's `previous_event`."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts):
        """The `num_rdma_bytes` a low-latency Buffer needs for these shapes (at least: a larger
        buffer is fine); every rank must use the same shapes."""
        what = "get_low_latency_rdma_size_hint"
        checks.positive_int(f"{what}: num_max_dispatch_tokens_per_rank",
                            num_max_dispatch_tokens_per_rank, 1)
        checks.positive_int(f"{what}: hidden", hidden, 1)
        checks.positive_int(f"{what}: num_ranks", num_ranks, 1)
        checks.num_experts(num_experts, num_ranks)
        return low_latency.rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                          num_experts)

    def get_comm_stream(self):
        """The stream this Buffer's dispatches and combines run on."""
        return self._stream

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        """This rank's NVLink buffer from byte `offset` as a `dtype` tensor (its first
        `size.numel()` elements shaped `size` when given)."""
        self._live("get_local_buffer_tensor")
        if use_rdma_buffer:
            _not_in_phase_1("get_local_buffer_tensor(use_rdma_buffer=True): the RDMA buffer")
        if self._ep is not None:
            _not_in_phase_1("get_local_buffer_tensor with Buffer.use_kernels: the kernels' buffer "
                            "as a tensor")
        if not 0 <= offset <= self.num_nvl_bytes:
            raise ValueError(f"get_local_buffer_tensor: offset={offset} is outside the "
                             f"{self.num_nvl_bytes}-byte buffer")
        element = torch.empty((), dtype=dtype, device="cpu").element_size()
        count = (self.num_nvl_bytes - offset) // element
        tensor = self._nvl[offset:offset + count * element].view(dtype)
        if size is None:
            return tensor
        if tensor.numel() < size.numel():
            raise ValueError(f"get_local_buffer_tensor: size {tuple(size)} needs {size.numel()} "
                             f"elements, the buffer has {tensor.numel()} from offset {offset}")
        return tensor[:size.numel()].view(size)

    def destroy(self):
        """Releases the buffer and the communicator (needs `explicitly_destroy=True`)."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy: this Buffer was made with explicitly_destroy=False; its "
                               "resources go with the object")
        self._live("destroy")
        torch.cuda.current_stream().wait_stream(self._stream)
        self._stream.synchronize()
        self._session = self._comm_group = self._nvl = self._ep = None
        self._handles.clear()

    # ---- the calls ---------------------------------------------------------------------------

    def get_num_rdma_ranks(self):
        """The hosts the group spans (DeepEP's RDMA ranks; 1 within one NVLink domain)."""
        return self._hosts

    def get_num_nvl_ranks(self):
        """The ranks of each host (DeepEP's NVLink ranks)."""
        return self.group_size // self._hosts

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """Per rank and per expert how many tokens go there, and which token goes to which rank:
        `(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank, num_tokens_per_expert [E]
        int32, is_token_in_rank [T, R] bool, event)`. `topk_idx` `[T, K]` int64, -1 for no
        expert. `num_tokens_per_rdma_rank` is None within one host, else `[hosts]` int32: the
        tokens with an expert on each host, counted once per host."""
        self._enter("get_dispatch_layout", previous_event, async_finish, allocate_on_comm_stream,
                    graph_note=None)
        checks.tensor("topk_idx", topk_idx, torch.int64, 2)
        self._on_device("topk_idx", topk_idx)
        checks.num_experts(num_experts, self.group_size)
        compute = self._wait(previous_event)
        with self._on_stream():
            if not self._capturing():  # the range check reads the values
                checks.topk_range(topk_idx, num_experts)
            per_rank, per_expert, in_rank = _layout(topk_idx, num_experts, self.group_size)
            per_host = None if self._hosts == 1 else _per_host(in_rank, self._hosts)
        outputs = [t for t in (per_rank, per_host, per_expert, in_rank) if t is not None]
        event = self._finish(compute, [topk_idx], outputs, async_finish)
        return per_rank, per_host, per_expert, in_rank, event

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """Sends each token to every rank that holds one of its experts. Returns `(recv_x,
        recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)`; with
        `handle` (cached mode) only `recv_x` and `event` (the rest None), the routing reused.
        The order and values are the spec of `mscclpp.ext.ep`."""
        what = "dispatch"
        scales = None

        def check():
            nonlocal x, scales
            if self._ep is not None:
                note = "through the intranode kernels (Buffer.use_kernels): not yet"
            elif handle is None and not num_worst_tokens:
                note = ("without num_worst_tokens, whose receive size is read on the host: "
                        "pass num_worst_tokens > 0, as DeepEP requires")
            else:
                note = None
            self._enter(what, previous_event, async_finish, allocate_on_comm_stream, note)
            cfg = self.get_dispatch_config(self.group_size) if config is None else config
            x, scales = checks.tokens("x", x)
            self._on_device("x", x)
            if scales is not None:
                self._on_device("x's scales", scales)
            checks.positive_int("expert_alignment", expert_alignment, 1)
            checks.positive_int("num_worst_tokens", num_worst_tokens, 0)
            R, T = self.group_size, x.shape[0]
            if num_tokens_per_rdma_rank is not None and handle is None and self._hosts > 1:
                checks.tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, torch.int32,
                              1, self._hosts)
                self._on_device("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank)
            num_topk = num_experts = 0
            if handle is not None:
                if topk_idx is not None or topk_weights is not None:
                    raise ValueError("dispatch: a cached dispatch (handle given) takes neither "
                                     "topk_idx nor topk_weights: the handle holds the routing")
                self._check_handle(what, handle, cfg)
                checks.tensor("handle's is_token_in_rank", handle[4], torch.bool, 2, T, R)
            else:
                for name, value in (("num_tokens_per_rank", num_tokens_per_rank),
                                    ("is_token_in_rank", is_token_in_rank),
                                    ("num_tokens_per_expert", num_tokens_per_expert)):
                    if value is None:
                        raise ValueError(f"dispatch: {name} is needed without a handle (from "
                                         "get_dispatch_layout)")
                checks.tensor("num_tokens_per_rank", num_tokens_per_rank, torch.int32, 1, R)
                checks.tensor("is_token_in_rank", is_token_in_rank, torch.bool, 2, T, R)
                checks.tensor("num_tokens_per_expert", num_tokens_per_expert, torch.int32, 1)
                num_experts = num_tokens_per_expert.shape[0]
                checks.num_experts(num_experts, R)
                if (topk_idx is None) != (topk_weights is None):
                    raise ValueError("dispatch: topk_idx and topk_weights come together (both "
                                     "or neither)")
                if topk_idx is not None:
                    checks.tensor("topk_idx", topk_idx, torch.int64, 2, T)
                    num_topk = topk_idx.shape[1]
                    checks.tensor("topk_weights", topk_weights, torch.float32, 2, T, num_topk)
                elif num_worst_tokens:
                    raise ValueError("dispatch: num_worst_tokens needs topk_idx and topk_weights")
                for name, t in (("num_tokens_per_rank", num_tokens_per_rank),
                                ("is_token_in_rank", is_token_in_rank),
                                ("num_tokens_per_expert", num_tokens_per_expert),
                                ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
                    if t is not None:
                        self._on_device(name, t)
            num_scales = 0 if scales is None else math.prod(scales.shape[1:])
            needed = cfg.buffer_bytes(x.shape[1] * x.element_size(), R, num_topk, num_scales)
            checks.buffer_size(what, self.num_nvl_bytes, needed, cfg)
            # num_worst_tokens is agreed: every rank refuses a value below what any rank
            # receives from the same counts, so a refusal is never one rank's alone. So is the
            # tokens' format, down to the scales' shape: the rows each rank moves must match.
            agreed = dict(hidden=x.shape[1], cached=handle is not None, num_topk=num_topk,
                          num_experts=num_experts, num_worst_tokens=num_worst_tokens,
                          num_sms=cfg.num_sms, dtype=str(x.dtype),
                          scales=None if scales is None else
                          f"{scales.dtype} x {list(scales.shape[1:])}")
            return agreed, cfg, T

        config, tokens_of = self._collectively(what, check)
        compute = self._wait(previous_event)
        in_graph = self._capturing()
        with self._on_stream():
            if self._ep is not None:
                in_rank = handle[4] if handle is not None else is_token_in_rank
                result, outputs = self._kernel_dispatch(
                    x, scales, handle, in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                    expert_alignment, num_worst_tokens, config)
            elif handle is not None:
                rank_prefix, _, _, recv_src_idx, in_rank, _ = handle
                rows = recv_src_idx.shape[0]
                parts = [x] if scales is None else [x, _as_columns(scales)]
                if in_graph:
                    to_me = _counts_of(rank_prefix)[:, self.rank]
                    moved = self._move_tokens_in_graph(parts, in_rank, to_me, rows, tokens_of)[0]
                else:
                    counts = _counts_of(_to_host(rank_prefix, self._session.check))
                    moved = self._move_tokens(parts, in_rank, counts, rows)
                recv_x = moved[0] if scales is None else _with_scales(*moved, scales)
                outputs = [recv_x] if scales is None else list(recv_x)
                result = (recv_x, None, None, None, None)
            else:
                in_rank = is_token_in_rank
                per_host = num_tokens_per_rdma_rank if self._hosts > 1 else None
                result, outputs = self._dispatch(x, scales, num_tokens_per_rank, per_host, in_rank,
                                                 num_tokens_per_expert, topk_idx, topk_weights,
                                                 expert_alignment, num_worst_tokens, config,
                                                 tokens_of if in_graph else None)
        inputs = [t for t in (x, scales, num_tokens_per_rank, in_rank, num_tokens_per_expert,
                              topk_idx, topk_weights) if t is not None]
        return result + (self._finish(compute, inputs, outputs, async_finish),)

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        """Sends each received row back to its source rank and sums there, per token, bias 0 plus
        bias 1 then the rows from ranks 0, 1, ... in fp32, rounded once to bf16 (no weights
        applied). Returns `(combined_x, combined_topk_weights, event)`."""
        what = "combine"
        biases = [b for b in (bias if isinstance(bias, tuple) else (bias,)) if b is not None]

        def check():
            note = "through the intranode kernels (Buffer.use_kernels): not yet" \
                if self._ep is not None else None
            self._enter(what, previous_event, async_finish, allocate_on_comm_stream, note)
            cfg = self.get_combine_config(self.group_size) if config is None else config
            checks.hidden("x", x)
            self._on_device("x", x)
            self._check_handle(what, handle, cfg)
            recv_src_idx, in_rank = handle[3], handle[4]
            checks.tensor("x", x, torch.bfloat16, 2, recv_src_idx.shape[0])
            num_topk = 0
            if topk_weights is not None:
                checks.tensor("topk_weights", topk_weights, torch.float32, 2, x.shape[0])
                self._on_device("topk_weights", topk_weights)
                num_topk = topk_weights.shape[1]
            if isinstance(bias, tuple) and len(bias) != 2:
                raise ValueError(f"combine: bias is a tensor or a pair, not {len(bias)} tensors")
            for i, b in enumerate(biases):
                checks.tensor(f"bias[{i}]", b, torch.bfloat16, 2, in_rank.shape[0], x.shape[1])
                self._on_device(f"bias[{i}]", b)
            needed = cfg.buffer_bytes(x.shape[1] * x.element_size(), self.group_size, num_topk)
            checks.buffer_size(what, self.num_nvl_bytes, needed, cfg)
            return dict(hidden=x.shape[1], num_topk=num_topk, num_sms=cfg.num_sms), cfg, \
                in_rank.shape[0]

        config, tokens_of = self._collectively(what, check)
        compute = self._wait(previous_event)
        rank_prefix, _, _, recv_src_idx, in_rank, send_head = handle
        with self._on_stream():
            if self._ep is not None:
                combined, combined_w = self._kernel_combine(x, handle, topk_weights, biases, config)
            else:
                combined, combined_w = self._combine(
                    x, topk_weights, biases, in_rank, send_head, rank_prefix,
                    tokens_of if self._capturing() else None)
        inputs = [x, rank_prefix, recv_src_idx, in_rank, send_head] + biases
        if topk_weights is not None:
            inputs.append(topk_weights)
        event = self._finish(compute, inputs, [combined, combined_w], async_finish)
        return combined, combined_w, event

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None,
                           num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                           num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment=1, config=None, previous_event=None,
                           async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's internode dispatch, which its `dispatch` calls across hosts: here one data
        path serves both, so this is `dispatch`. Its parameters are DeepEP's, in DeepEP's order
        (no `num_worst_tokens`, which DeepEP's internode mode refuses), so positional calls
        written for DeepEP mean the same here."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                             expert_alignment, 0, config, previous_event, async_finish,
                             allocate_on_comm_stream)

    # DeepEP's internode combine, with combine's parameters in DeepEP too: `combine` itself.
    internode_combine = combine

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """DeepEP zeroes the parts of its buffer its low-latency kernels count in; the
        point-to-point path keeps no such state, so this checks the shapes and clears the
        zero-copy combine input."""
        self._low_latency("clean_low_latency_buffer", num_max_dispatch_tokens_per_rank, hidden,
                          num_experts)
        if self._ll_combine_input is not None:
            self._ll_combine_input.zero_()

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False,
                             use_ue8m0=False, async_finish=False, return_recv_hook=False):
        """Sends each token to the ranks of its experts, for each expert. Returns `(recv_x,
        recv_count, handle, event, hook)`: `recv_x` `[L, R * M, H]` (bf16, or with `use_fp8` the
        e4m3 rows and their scales, `[L, R * M, H / 128]` f32 or with `use_ue8m0` `[L, R * M, H /
        512]` int32, column-major in the last two dimensions), valid up to `recv_count[l]` rows
        per local expert; the order and the handle are the spec of `mscclpp.ext.ep`. Nothing is
        read on the host, so the call may be captured in a CUDA graph. The data has arrived
        when the call's work is done: the hook (with `return_recv_hook`) has nothing left to
        receive. `dispatch_wait_recv_cost_stats` is checked and left as it is (the
        point-to-point path has no per-token wait to time)."""
        what = "low_latency_dispatch"
        M, E = num_max_dispatch_tokens_per_rank, num_experts

        def check():
            checks.hidden("x", x)
            T, H = x.shape
            self._low_latency(what, M, H, E)
            self._on_device("x", x)
            checks.tensor("topk_idx", topk_idx, torch.int64, 2, T)
            self._on_device("topk_idx", topk_idx)
            if T > M:
                raise ValueError(f"{what}: x has {T} tokens, more than "
                                 f"num_max_dispatch_tokens_per_rank={M}")
            if use_ue8m0 and not round_scale:
                raise ValueError(f"{what}: use_ue8m0=True needs round_scale=True (UE8M0 scales "
                                 "are powers of two)")
            if (round_scale or use_ue8m0) and not use_fp8:
                raise ValueError(f"{what}: round_scale and use_ue8m0 shape fp8 scales: they "
                                 "need use_fp8=True")
            group = low_latency.SCALE_GROUP * (low_latency.UE8M0_PER_INT if use_ue8m0 else 1)
            if use_fp8 and H % group:
                raise ValueError(f"{what}: hidden size {H} is not supported with use_fp8"
                                 f"{' and use_ue8m0' if use_ue8m0 else ''}: it must be a "
                                 f"multiple of {group} (a scale per {low_latency.SCALE_GROUP} "
                                 "channels)")
            L = E // self.group_size
            stats = cumulative_local_expert_recv_stats
            if stats is not None:
                checks.tensor("cumulative_local_expert_recv_stats", stats, torch.int32, 1, L)
                self._on_device("cumulative_local_expert_recv_stats", stats)
            waits = dispatch_wait_recv_cost_stats
            if waits is not None and (waits.dtype != torch.int64
                                      or waits.numel() not in (self.group_size,
                                                               self.group_size ** 2)):
                raise ValueError(f"{what}: dispatch_wait_recv_cost_stats must be int64 with "
                                 f"{self.group_size} or {self.group_size ** 2} elements, not "
                                 f"{waits.dtype} of shape {tuple(waits.shape)}")
            if not self._capturing():
                checks.topk_range(topk_idx, E)
            return dict(hidden=H, num_max_dispatch_tokens_per_rank=M, num_experts=E,
                        num_topk=topk_idx.shape[1], use_fp8=bool(use_fp8),
                        round_scale=bool(round_scale), use_ue8m0=bool(use_ue8m0)), None, T

        self._collectively(what, check)
        compute = self._wait(None)
        with self._on_stream():
            recv_x, recv_count, handle, plan = self._ll_dispatch(x, topk_idx, M, E, use_fp8,
                                                                 round_scale, use_ue8m0)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(recv_count)
        self._remember(handle, plan)
        received = list(recv_x) if use_fp8 else [recv_x]
        outputs = received + [recv_count, handle[0], handle[1]]
        inputs = [t for t in (x, topk_idx, cumulative_local_expert_recv_stats) if t is not None]
        event = self._finish(compute, inputs, outputs, async_finish)
        return recv_x, recv_count, handle, event, _arrived if return_recv_hook else None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False, out=None,
                            combine_wait_recv_cost_stats=None):
        """Returns each expert output row to its token's rank and sums there, per token, in fp32
        in top-k slot order, weight times row for each slot naming an expert, rounded once to
        bf16. Returns `(combined_x [T, H] bf16, event, hook)`. `x` `[L, R * M, H]` bf16 in the
        dispatch's packing (with `zero_copy`, the rows are read from
        `get_next_low_latency_combine_buffer(handle)` instead); `topk_idx` and `topk_weights`
        are the dispatched tokens'. Rows travel in bf16 whatever `use_logfmt` says (so the
        result is the exact one); `combine_wait_recv_cost_stats` is left as it is."""
        what = "low_latency_combine"

        def check():
            plan = self._ll_handle(what, handle)
            M, H, E = handle[2], handle[3], handle[4]
            self._low_latency(what, M, H, E)
            R = self.group_size
            checks.tensor("x", x, torch.bfloat16, 3, E // R, R * M)
            if x.shape[2] != H:
                raise ValueError(f"{what}: x has hidden size {x.shape[2]}, the handle's dispatch "
                                 f"had {H}")
            self._on_device("x", x)
            checks.tensor("topk_idx", topk_idx, torch.int64, 2, None, plan.num_topk)
            checks.tensor("topk_weights", topk_weights, torch.float32, 2, topk_idx.shape[0],
                          plan.num_topk)
            if topk_idx.shape[0] != plan.num_tokens:
                raise ValueError(f"{what}: topk_idx has {topk_idx.shape[0]} tokens, the "
                                 f"handle's dispatch sent {plan.num_tokens}")
            for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
                self._on_device(name, t)
            if out is not None:
                checks.tensor("out", out, torch.bfloat16, 2, topk_idx.shape[0], H)
                self._on_device("out", out)
            staged = self._ll_combine_input
            if zero_copy and (staged is None or staged.shape != x.shape):
                raise ValueError(f"{what}: zero_copy=True reads the rows from "
                                 "get_next_low_latency_combine_buffer(handle), which was not "
                                 "taken for these shapes")
            if not self._capturing():
                checks.topk_range(topk_idx, E)
            return dict(hidden=H, num_max_dispatch_tokens_per_rank=M, num_experts=E,
                        num_topk=plan.num_topk, zero_copy=bool(zero_copy)), None, \
                topk_idx.shape[0]

        self._collectively(what, check)
        plan = self._ll_handle(what, handle)
        rows = self._ll_combine_input if zero_copy else x
        compute = self._wait(None)
        with self._on_stream():
            combined = self._ll_combine(rows, topk_idx, topk_weights, handle, plan)
            if out is not None:
                out.copy_(combined)
                combined = out
        inputs = [x, topk_idx, topk_weights, handle[0], handle[1]]
        event = self._finish(compute, inputs, [combined], async_finish)
        return combined, event, _arrived if return_recv_hook else None

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        _not_masked("low_latency_update_mask_buffer")

    def low_latency_query_mask_buffer(self, mask_status):
        _not_masked("low_latency_query_mask_buffer")

    def low_latency_clean_mask_buffer(self):
        _not_masked("low_latency_clean_mask_buffer")

    def get_next_low_latency_combine_buffer(self, handle):
        """The `[L, R * M, H]` bf16 tensor a `zero_copy` low-latency combine reads its rows from
        (the same tensor for every handle of these shapes)."""
        what = "get_next_low_latency_combine_buffer"
        self._ll_handle(what, handle)
        M, H, E = handle[2], handle[3], handle[4]
        self._low_latency(what, M, H, E)
        R = self.group_size
        shape = (E // R, R * M, H)
        if self._ll_combine_input is None or tuple(self._ll_combine_input.shape) != shape:
            self._ll_combine_input = torch.zeros(shape, dtype=torch.bfloat16, device=self._device)
        return self._ll_combine_input

    # ---- the work ----------------------------------------------------------------------------

    def _dispatch(self, x, scales, num_tokens_per_rank, num_tokens_per_host, in_rank,
                  num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                  num_worst_tokens, config, tokens_of=None):
        """A non-cached dispatch on the point-to-point path. With `tokens_of` (every rank's token
        count: the call is being captured, and num_worst_tokens > 0) nothing is read on the host:
        the blocks have fixed sizes (`_move_tokens_in_graph`)."""
        R, me, dev = self.group_size, self.rank, self._device
        E = num_tokens_per_expert.shape[0]
        L, C = E // R, config.num_channels
        in_graph = tokens_of is not None
        channel_prefix = _channel_prefix(in_rank, C)
        # What every rank needs of every other: its per-rank and per-expert counts, its channel
        # prefix rows, and which of its num_tokens_per_rank (bit 0) and num_tokens_per_rdma_rank
        # (bit 1) disagree with its is_token_in_rank (so a caller's inconsistent layout is an
        # error on every rank, not a size mismatch mid-transfer). In a graph the counts are the
        # routing's own and nothing can be raised: the flags go unread.
        per_rank = in_rank.sum(0, dtype=torch.int32)
        disagrees = (per_rank != num_tokens_per_rank).any().to(torch.int32)
        if num_tokens_per_host is not None:
            host_disagrees = (_per_host(in_rank, self._hosts) != num_tokens_per_host).any()
            disagrees = disagrees | host_disagrees.to(torch.int32) * 2
        mine = torch.cat([per_rank if in_graph else num_tokens_per_rank, num_tokens_per_expert,
                          channel_prefix.flatten(), disagrees.reshape(1)])
        table = torch.empty(R, mine.numel(), dtype=torch.int32, device=dev)
        self._exchange([[mine]] * R, [[table[p]] for p in range(R)])
        if not in_graph:
            table = _to_host(table, self._session.check)
            for bit, name in ((1, "num_tokens_per_rank"), (2, "num_tokens_per_rdma_rank")):
                bad = [r for r in range(R) if int(table[r, -1]) & bit]
                if bad:
                    raise ValueError(f"dispatch: {name} disagrees with is_token_in_rank on "
                                     f"rank(s) {bad} (pass both from the same "
                                     "get_dispatch_layout)")
        counts = table[:, :R]
        rank_prefix = counts.cumsum(0, dtype=torch.int32)
        per_expert = []
        if in_graph:
            rows = num_worst_tokens
        else:
            received = counts.sum(0)
            if num_worst_tokens and int(received.max()) > num_worst_tokens:
                over = {r: int(received[r]) for r in range(R) if received[r] > num_worst_tokens}
                raise ValueError(f"dispatch: num_worst_tokens={num_worst_tokens} is below what "
                                 f"rank(s) receive: {over}")
            rows = num_worst_tokens if num_worst_tokens else int(received[me])
            if not num_worst_tokens:
                per_expert = table[:, R + me * L:R + (me + 1) * L].sum(0)
                per_expert = ((per_expert + expert_alignment - 1) // expert_alignment
                              * expert_alignment).tolist()
        # Where channel c of source s starts in this rank's receive: the source's block start
        # plus the tokens of its channels before c.
        chan = table[:, R + E + me * C:R + E + (me + 1) * C]
        starts = rank_prefix[:, me] - counts[:, me]
        recv_channel_prefix = (starts[:, None] + torch.cat(
            [torch.zeros_like(chan[:, :1]), chan[:, :-1]], 1)).to(torch.int32)

        # Each row's meta travels as int32 columns: its source index, top-k indices and weights,
        # and its scales (f32 or int32, bit for bit).
        K = 0 if topk_idx is None else topk_idx.shape[1]
        meta = [torch.arange(x.shape[0], dtype=torch.int32, device=dev)[:, None]]
        if topk_idx is not None:
            meta += [topk_idx.to(torch.int32), topk_weights.view(torch.int32)]
        if scales is not None:
            meta.append(_as_columns(scales))
        meta = torch.cat(meta, 1)
        if in_graph:
            (recv_x, recv_meta), arrived = self._move_tokens_in_graph(
                [x, meta], in_rank, counts[:, me], rows, tokens_of)
        else:
            recv_x, recv_meta = self._move_tokens([x, meta], in_rank, counts, rows)
            arrived = torch.arange(rows, device=dev) < int(counts[:, me].sum())
        recv_src_idx = recv_meta[:, 0].contiguous()
        if scales is not None:
            recv_x = _with_scales(recv_x, recv_meta[:, 1 + 2 * K:], scales)
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            expert = recv_meta[:, 1:1 + K].to(torch.int64)
            weight = recv_meta[:, 1 + K:1 + 2 * K].contiguous().view(torch.float32)
            local = (expert >= me * L) & (expert < (me + 1) * L)
            recv_topk_idx = torch.where(local, expert - me * L, torch.full_like(expert, -1))
            recv_topk_weights = torch.where(local, weight, torch.zeros_like(weight))
        # Rows past what arrived (num_worst_tokens): no expert, no weight, no source.
        recv_src_idx = torch.where(arrived, recv_src_idx, torch.full_like(recv_src_idx, -1))
        if recv_topk_idx is not None:
            recv_topk_idx = torch.where(arrived[:, None], recv_topk_idx,
                                        torch.full_like(recv_topk_idx, -1))
            recv_topk_weights = torch.where(arrived[:, None], recv_topk_weights,
                                            torch.zeros_like(recv_topk_weights))
        handle = (rank_prefix.to(dev), channel_prefix, recv_channel_prefix.to(dev), recv_src_idx,
                  in_rank, _send_head(in_rank))
        self._remember(handle, C)
        result = (recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle)
        received = list(recv_x) if scales is not None else [recv_x]
        outputs = received + [recv_topk_idx, recv_topk_weights] + list(handle)
        return result, outputs

    def _move_tokens(self, parts, in_rank, counts, rows):
        """One transfer: to each rank the rows of `parts` (tensors of one row per token) it
        selects in `in_rank`, in token order, into that rank's `rows`-row receive, blocks by
        source ascending. `counts` is the host `[R, R]` count matrix (row: source, column:
        destination). Returns the received parts."""
        order = in_rank.t().nonzero()[:, 1]
        received = self._send_rows(_row_bytes(parts).index_select(0, order),
                                   [int(c) for c in counts[self.rank]],
                                   [int(c) for c in counts[:, self.rank]], rows)
        return _split_row_bytes(received, parts)

    def _move_tokens_in_graph(self, parts, in_rank, to_me, rows, tokens_of):
        """`_move_tokens` with nothing read on the host, for CUDA-graph capture: each rank sends
        every rank a block of as many rows as it has tokens (those it selects for that rank, in
        order, then zeros), and the receiver packs the `to_me[s]` real rows of each source's block
        into `rows` rows, blocks by source ascending (`tokens_of`: every rank's token count, from
        the call's agreement). More than `rows` arriving is a device-side assertion, as in
        DeepEP: it cannot be raised. Returns (the received parts, which rows arrived)."""
        R, dev, T = self.group_size, self._device, in_rank.shape[0]
        token = low_latency.slots_of(in_rank, T)
        payload = _row_bytes(parts)
        payload = torch.cat([payload, payload.new_zeros(1, payload.shape[1])])
        recv = self._send_rows(payload.index_select(0, token.flatten()), [T] * R, tokens_of,
                               sum(tokens_of), zero_rows=1)
        block, row = _block_rows(tokens_of, dev)
        real = row < to_me[block]
        total = real.sum()
        torch._assert_async(total <= rows, f"dispatch: more tokens arrived than the {rows} rows "
                            "of num_worst_tokens")
        running = real.cumsum(0)
        pick = torch.searchsorted(running, torch.arange(1, rows + 1, device=dev))
        received = recv.index_select(0, pick)
        return _split_row_bytes(received, parts), torch.arange(rows, device=dev) < total

    def _combine(self, x, topk_weights, biases, in_rank, send_head, rank_prefix, tokens_of):
        """A combine on the point-to-point path: each received row back to its source, then per
        token, in fp32, bias 0 plus bias 1, then the rows from ranks 0, 1, ... in order, rounded
        once. With `tokens_of` (in a graph) the blocks have fixed sizes and nothing is read on
        the host."""
        R, me, dev = self.group_size, self.rank, self._device
        T, H = in_rank.shape[0], x.shape[1]
        parts = [x] if topk_weights is None else [x, topk_weights]
        rows_out = _row_bytes(parts)
        if tokens_of is None:
            counts = _counts_of(_to_host(rank_prefix, self._session.check))
            # The rows this rank received from each peer go back to it; each peer's rows for
            # this rank's tokens come back in the send layout (blocks by destination, in order).
            n_to = [int(c) for c in counts[me]]
            back = self._send_rows(rows_out, [int(c) for c in counts[:, me]], n_to, sum(n_to),
                                   zero_rows=1)
            starts = [sum(n_to[:d]) for d in range(R)]
        else:
            # Back to each source a block of as many rows as it has tokens: the rows received
            # from it, then zeros.
            to_me = _counts_of(rank_prefix)[:, me]
            begin = rank_prefix[:, me] - to_me
            block, row = _block_rows(tokens_of, dev)
            take = torch.where(row < to_me[block], begin[block] + row,
                               torch.full_like(row, x.shape[0]))
            padded = torch.cat([rows_out, rows_out.new_zeros(1, rows_out.shape[1])])
            back = self._send_rows(padded.index_select(0, take), tokens_of, [T] * R, R * T,
                                   zero_rows=1)
            starts = [d * T for d in range(R)]
        back_x, back_w = (_split_row_bytes(back, parts) + [None])[:2]
        # Bias 0 plus bias 1 (0 for a missing one) first, as the spec adds them.
        acc = torch.zeros(T, H, dtype=torch.float32, device=dev)
        if biases:
            acc = biases[0].float() + (biases[1].float() if len(biases) > 1 else 0.0)
        acc_w = None if topk_weights is None else torch.zeros(
            T, topk_weights.shape[1], dtype=torch.float32, device=dev)
        last = back.shape[0] - 1  # the zero row
        for d in range(R):
            went = in_rank[:, d]
            at = torch.where(went, starts[d] + send_head[:, d].to(torch.int64),
                             torch.full((T,), last, dtype=torch.int64, device=dev))
            acc = torch.where(went[:, None], acc + back_x.index_select(0, at).float(), acc)
            if acc_w is not None:
                acc_w = torch.where(went[:, None], acc_w + back_w.index_select(0, at), acc_w)
        return acc.to(x.dtype), acc_w

    def _send_rows(self, rows_out, n_out, n_in, rows_in, zero_rows=0):
        """One point-to-point group: `rows_out` `[N, B]` bytes, blocks of `n_out[p]` rows to each
        peer p in order, into a `[rows_in, B]` receive holding `n_in[p]` rows from each peer p,
        blocks by peer ascending, followed by `zero_rows` rows of zeros. One send and one receive
        a peer (a group needs a resident block for each, so fewer pieces let more ranks share a
        GPU)."""
        received = torch.empty(rows_in + zero_rows, rows_out.shape[1], dtype=torch.uint8,
                               device=rows_out.device)
        received[rows_in:].zero_()
        sends, recvs, sent, got = [], [], 0, 0
        for p in range(self.group_size):
            sends.append([rows_out[sent:sent + n_out[p]]])
            recvs.append([received[got:got + n_in[p]]])
            sent, got = sent + n_out[p], got + n_in[p]
        self._exchange(sends, recvs)
        return received

    def _kernel_dispatch(self, x, scales, handle, in_rank, num_tokens_per_expert, topk_idx,
                         topk_weights, expert_alignment, num_worst_tokens, config):
        """Dispatch through the kernels: ep_notify (counts, prefix sums, ring reset) and one host
        read of the counts, or, cached, ep_reset; then ep_dispatch. fp8 rows travel with their
        scales as one row of bytes (`_packed_rows`), unpacked on arrival."""
        tokens = x
        if scales is not None:
            x = _packed_rows(tokens, scales)
        R, dev, C = self.group_size, self._device, config.num_channels
        T, H = x.shape
        K = 0 if topk_idx is None else topk_idx.shape[1]
        recv_channel_prefix = torch.empty(R, C, dtype=torch.int32, device=dev)
        if handle is not None:
            rank_prefix, channel_prefix, _, old_src_idx, _, _ = handle
            rows, L = old_src_idx.shape[0], 0
            self._launch("reset", config, x, 0)
        else:
            L = num_tokens_per_expert.shape[0] // R
            channel_prefix = _channel_prefix(in_rank, C)
            rank_prefix = torch.empty(R, R, dtype=torch.int32, device=dev)
            counts = torch.empty(L + 1, dtype=torch.int32, device=dev)
            # The per-rank counts the kernel moves by are the routing's own (a caller's
            # num_tokens_per_rank that disagreed would size the receive wrong).
            self._launch("notify", config, x, K,
                         num_tokens_per_rank=in_rank.sum(0, dtype=torch.int32),
                         num_tokens_per_expert=num_tokens_per_expert, rank_prefix=rank_prefix,
                         recv_expert_counts=counts, experts_per_rank=L,
                         expert_alignment=expert_alignment)
            # This rank's counts, and every rank's total (the prefix matrix's last row).
            host = _to_host(torch.cat([counts, rank_prefix[-1]]), self._ep.check)
            received = host[L + 1:]
            if num_worst_tokens and int(received.max()) > num_worst_tokens:
                over = {r: int(received[r]) for r in range(R) if received[r] > num_worst_tokens}
                raise ValueError(f"dispatch: num_worst_tokens={num_worst_tokens} is below what "
                                 f"rank(s) receive: {over}")
            num_recv = int(host[L])
            rows = num_worst_tokens if num_worst_tokens else num_recv
            per_expert = [] if num_worst_tokens else host[:L].tolist()
            send_head = _send_head(in_rank)
        recv_x = torch.empty(rows, H, dtype=x.dtype, device=dev)
        recv_src_idx = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        recv_topk_idx = recv_topk_weights = None
        if K:
            recv_topk_idx = torch.full((rows, K), -1, dtype=torch.int64, device=dev)
            recv_topk_weights = torch.zeros(rows, K, dtype=torch.float32, device=dev)
        self._launch("dispatch", config, x, K, x=x, is_token_in_rank=in_rank,
                     channel_prefix=channel_prefix, topk_idx=topk_idx, topk_weights=topk_weights,
                     rank_prefix=rank_prefix, recv_x=recv_x, recv_src_idx=recv_src_idx,
                     recv_topk_idx=recv_topk_idx, recv_topk_weights=recv_topk_weights,
                     recv_channel_prefix=recv_channel_prefix, num_tokens=T,
                     experts_per_rank=L)
        received = [recv_x]
        if scales is not None:
            recv_x = _unpacked_rows(recv_x, tokens, scales)
            received = list(recv_x)
        if handle is not None:
            return (recv_x, None, None, None, None), received + [recv_src_idx, recv_channel_prefix]
        handle = (rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank,
                  send_head)
        self._remember(handle, C)
        outputs = received + [recv_topk_idx, recv_topk_weights] + list(handle)
        return (recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle), outputs

    def _kernel_combine(self, x, handle, topk_weights, biases, config):
        """Combine through the kernels: ep_reset, then ep_combine (no host read)."""
        rank_prefix, _, recv_channel_prefix, _, in_rank, _ = handle
        T, H = in_rank.shape[0], x.shape[1]
        K = 0 if topk_weights is None else topk_weights.shape[1]
        combined = torch.empty(T, H, dtype=x.dtype, device=self._device)
        combined_w = None if topk_weights is None else torch.empty(
            T, K, dtype=torch.float32, device=self._device)
        self._launch("reset", config, x, K)
        self._launch("combine", config, x, K, x=x, topk_weights=topk_weights,
                     recv_channel_prefix=recv_channel_prefix, rank_prefix=rank_prefix,
                     is_token_in_rank=in_rank, bias0=biases[0] if biases else None,
                     bias1=biases[1] if len(biases) > 1 else None, combined=combined,
                     combined_weights=combined_w, num_tokens=T)
        return combined, combined_w

    def _ll_dispatch(self, x, topk_idx, M, E, use_fp8, round_scale, use_ue8m0):
        """The low-latency dispatch's work (`low_latency`'s module doc): one block of M rows to
        every rank, then the packing per local expert. A block row is one run of bytes (the
        token's row, its fp8 scales, its metadata), so each peer takes one send and one receive
        (a point-to-point group needs a resident block per send and receive)."""
        R, dev = self.group_size, x.device
        L, (T, H), K = E // R, x.shape, topk_idx.shape[1]
        rank, local = low_latency.route(topk_idx, R, L)
        token, _ = low_latency.send_slots(rank, R, M)
        meta = low_latency.block_meta(token, rank, local, T)
        parts = list(low_latency.cast_fp8(x, round_scale, use_ue8m0)) if use_fp8 else [x]
        widths = [p.shape[1] * p.element_size() for p in parts]
        payload = torch.cat([p.view(torch.uint8) for p in parts], 1)
        # A zero padding row at T: the rows of a block past its tokens.
        payload = torch.cat([payload, payload.new_zeros(1, payload.shape[1])])
        send = torch.cat([payload.index_select(0, token.flatten()).view(R, M, -1),
                          meta.view(torch.uint8)], 2)
        # Received rows, flattened over (source, row), and a zero padding row at R * M.
        recv = self._send_rows(send.view(R * M, -1), [M] * R, [M] * R, R * M, zero_rows=1)
        recv_meta = recv[:-1, sum(widths):].view(torch.int32).view(R, M, 1 + K)
        row, count, layout_range, slot = low_latency.unpack(recv_meta, L)
        pick = row.flatten()
        # Each part gathered on its own columns, so the rows come out contiguous.
        rows = recv[:, :widths[0]].index_select(0, pick).view(parts[0].dtype).view(L, R * M, H)
        if use_fp8:
            num_scales = parts[1].shape[1]
            # Column-major in the last two dimensions (DeepEP's layout, for TMA loads).
            scales = torch.empty(L, num_scales, R * M, dtype=parts[1].dtype,
                                 device=dev).transpose(1, 2)
            scales.copy_(recv[:, widths[0]:sum(widths)].index_select(0, pick)
                         .view(parts[1].dtype).view(L, R * M, num_scales))
            recv_x = (rows, scales)
        else:
            recv_x = rows
        sources = torch.cat([recv_meta[..., 0].flatten(),
                             torch.full((1,), -1, dtype=torch.int32, device=dev)])
        src_info = sources.index_select(0, pick).view(L, R * M)
        handle = (src_info, layout_range, M, H, E)
        plan = _LowLatencyPlan(low_latency.combine_index(recv_meta, slot, L), T, K)
        return recv_x, count, handle, plan

    def _ll_combine(self, x, topk_idx, topk_weights, handle, plan):
        """The low-latency combine's work: M x K rows back to every source, summed there."""
        R, M = self.group_size, handle[2]
        K, H = plan.num_topk, x.shape[2]
        index = plan.index.flatten()
        rows = x.reshape(-1, H).index_select(0, index.clamp(min=0))
        back = torch.where((index >= 0)[:, None], rows, torch.zeros_like(rows))
        returned = self._send_rows(back.view(torch.uint8), [M * K] * R, [M * K] * R, R * M * K)
        returned = returned.view(x.dtype)
        rank, _ = low_latency.route(topk_idx, R, handle[4] // R)
        _, position = low_latency.send_slots(rank, R, M)
        return low_latency.combine_rows(returned, rank, position, topk_weights, M)

    def _launch(self, kernel, config, rows, num_topk, **fields):
        """Enqueues one EP kernel on the Buffer's stream: tensors by address (None: null), the
        call's shape from `config`, `rows` (the tokens' tensor, for the hidden size) and
        `num_topk`."""
        args = dict(hidden_bytes=rows.shape[1] * rows.element_size(), num_topk=num_topk,
                    num_channels=config.num_channels,
                    ring_slots=config.num_max_nvl_chunked_recv_tokens,
                    chunk=config.num_max_nvl_chunked_send_tokens)
        for name, value in fields.items():
            if isinstance(value, torch.Tensor):
                args[name] = value.data_ptr()
            elif value is not None:
                args[name] = int(value)
        self._ep.launch(kernel, args, self._stream.cuda_stream)

    def _exchange(self, sends, recvs):
        """One point-to-point group: `sends[p]` to and `recvs[p]` from peer p, matched in order
        (empty pieces skipped on both sides alike: their sizes come from the same counts)."""
        ops = []
        for p in range(self.group_size):
            for kind, pieces in (("send", sends[p]), ("recv", recvs[p])):
                for t in pieces:
                    if t.numel():
                        ops.append((kind, p, t.data_ptr(), t.numel() * t.element_size()))
        if ops:
            self._session.p2p(ops, self._stream.cuda_stream)
            # Across hosts the group waits for the proxy and the Ethernet receiver, whose CUDA
            # calls take the context's lock. Under lazy module loading (CUDA_MODULE_LOADING=LAZY,
            # PyTorch's default) a kernel's first launch holds that lock while it waits for the
            # device to drain, so a first-time torch kernel launched while the group runs would
            # wait for the group, and the group for it, until the device wait timeout. So the
            # host waits for the group here. A graph's replay launches nothing for the first
            # time: no wait is captured.
            if self._hosts > 1 and not self._capturing():
                _poll(self._stream, self._session.check)

    # ---- bookkeeping -------------------------------------------------------------------------

    def _live(self, what):
        if self._session is None:
            raise RuntimeError(f"{what}: this Buffer was destroyed")

    def _enter(self, what, previous_event, async_finish, allocate_on_comm_stream, graph_note):
        """The checks every normal-mode call makes first; `graph_note`, when the call cannot be
        captured in a CUDA graph, says why (refused while capturing)."""
        self._live(what)
        checks.stream_events(previous_event, async_finish, allocate_on_comm_stream)
        if graph_note is not None and self._capturing():
            raise RuntimeError(f"{what}: cannot be captured in a CUDA graph {graph_note}")

    # The CUDA stream and graph state, in methods of their own so the CPU tests can stand in.
    def _capturing(self):
        return torch.cuda.is_current_stream_capturing()

    def _on_stream(self):
        return torch.cuda.stream(self._stream)

    def _on_device(self, what, t):
        if t.device != self._device:
            raise ValueError(f"{what} is on {t.device}, this Buffer on {self._device}")

    def _collectively(self, what, check):
        """Runs `check` (the call's argument checks: it returns the values every rank must share,
        the call's config and this rank's token count, or raises) on every rank, then compares
        on the bootstrap, before any device work: a refusal on one rank, or ranks that disagree,
        is an error on every rank (a lone refusal would leave the others waiting for it).
        Returns the config and every rank's token count."""
        self._live(what)
        try:
            values, config, tokens = check()
            mine = {"values": values, "tokens": tokens}
        except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
            error, mine = e, {"error": f"{type(e).__name__}: {e}"}
        else:
            error = None
        payload = json.dumps(mine, sort_keys=True).encode()
        every = [json.loads(bytes(b)) for b in self._comm_group.bootstrap.all_gather(payload)]
        if error is not None:
            raise error
        refused = {r: e["error"] for r, e in enumerate(every) if "error" in e}
        if refused:
            raise ValueError(f"{what}: refused on rank(s) {refused}")
        for key in values:
            seen = {r: e["values"][key] for r, e in enumerate(every)}
            if len(set(seen.values())) > 1:
                raise ValueError(f"{what}: the ranks disagree on {key}: {seen}")
        return config, [e["tokens"] for e in every]

    def _wait(self, previous_event):
        compute = torch.cuda.current_stream()
        if previous_event is not None:
            if previous_event.event is None:
                raise ValueError("previous_event holds no event")
            self._stream.wait_event(previous_event.event.event)
        else:
            self._stream.wait_stream(compute)
        return compute

    def _finish(self, compute, inputs, outputs, async_finish):
        # The outputs were made on the communication stream and are used on the compute stream.
        for t in outputs:
            if t is not None:
                t.record_stream(compute)
        if not async_finish:
            compute.wait_stream(self._stream)
            return EventOverlap(None)
        for t in inputs:
            t.record_stream(self._stream)
        return EventOverlap(EventHandle(self._stream))

    def _remember(self, handle, what_it_needs):
        key, handles = id(handle[0]), self._handles
        handles[key] = (weakref.ref(handle[0], lambda _: handles.pop(key, None)), what_it_needs)

    def _low_latency(self, what, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Refuses a low-latency call on a Buffer not made for it, or too small for its shapes."""
        self._live(what)
        if not self.low_latency_mode:
            raise ValueError(f"{what}: this Buffer was made with low_latency_mode=False")
        checks.positive_int("num_max_dispatch_tokens_per_rank",
                            num_max_dispatch_tokens_per_rank, 1)
        checks.num_experts(num_experts, self.group_size)
        needed = low_latency.rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden,
                                            self.group_size, num_experts)
        if self.num_rdma_bytes < needed:
            raise ValueError(
                f"{what}: num_rdma_bytes={self.num_rdma_bytes} of this Buffer is too small: "
                f"{needed} bytes are needed for num_max_dispatch_tokens_per_rank="
                f"{num_max_dispatch_tokens_per_rank}, hidden={hidden}, num_experts={num_experts} "
                "(size it with Buffer.get_low_latency_rdma_size_hint)")

    def _ll_handle(self, what, handle):
        """The combine plan of a low-latency dispatch's handle, refusing any other handle."""
        if not isinstance(handle, tuple) or len(handle) != 5:
            raise ValueError(f"{what}: handle must be the 5-tuple a low_latency_dispatch of this "
                             "Buffer returned")
        entry = self._handles.get(id(handle[0]))
        if entry is None or entry[0]() is not handle[0] \
                or not isinstance(entry[1], _LowLatencyPlan):
            raise ValueError(f"{what}: handle was not made by this Buffer's low_latency_dispatch "
                             "(it comes from another Buffer, or its tensors were copied)")
        return entry[1]

    def _check_handle(self, what, handle, config):
        if not isinstance(handle, tuple) or len(handle) != _HANDLE_LEN:
            raise ValueError(f"{what}: handle must be the {_HANDLE_LEN}-tuple a dispatch of this "
                             "Buffer returned")
        entry = self._handles.get(id(handle[0]))
        if entry is None or entry[0]() is not handle[0]:
            raise ValueError(f"{what}: handle was not made by this Buffer (it comes from another "
                             "Buffer, or its tensors were copied)")
        if entry[1] != config.num_channels:
            raise ValueError(f"{what}: handle was made with num_sms={2 * entry[1]}, the config "
                             f"has num_sms={config.num_sms}: use the same num_sms")


class _LowLatencyPlan(NamedTuple):
    """What a low-latency combine needs of its dispatch: for each source's block row and top-k
    slot the flat index of its expert output here (`low_latency.combine_index`), and the
    dispatch's token and top-k counts."""

    index: torch.Tensor
    num_tokens: int
    num_topk: int


def _arrived():
    """The receive hook of a low-latency call: the call's own work already received the data."""


def _per_host(in_rank, hosts):
    """Tokens with an expert on each host, once per host (`num_tokens_per_rdma_rank`): hosts are
    equal blocks of consecutive ranks."""
    T, R = in_rank.shape
    return in_rank.view(T, hosts, R // hosts).any(2).sum(0, dtype=torch.int32)


def _layout(topk_idx, num_experts, num_ranks):
    """`(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)` of `topk_idx`."""
    valid = topk_idx >= 0
    per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    rank_of = torch.where(valid, topk_idx // (num_experts // num_ranks), 0)
    hits = torch.nn.functional.one_hot(rank_of, num_ranks).bool() & valid[..., None]
    in_rank = hits.any(1)
    return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank.contiguous()


def _channel_prefix(in_rank, num_channels):
    """`[R, C]`: per destination, the tokens it selects in channels 0..c (inclusive), channel c
    being tokens [c * ceil(T / C), (c + 1) * ceil(T / C)) (DeepEP's split)."""
    T, R = in_rank.shape
    per = -(-T // num_channels)
    padded = torch.zeros(num_channels * per, R, dtype=torch.int32, device=in_rank.device)
    padded[:T] = in_rank.to(torch.int32)
    per_channel = padded.view(num_channels, per, R).sum(1, dtype=torch.int32)
    return per_channel.t().cumsum(1, dtype=torch.int32).contiguous()


def _send_head(in_rank):
    """`[T, R]`: a token's row in its block of the destination's receive, -1 if not sent."""
    position = in_rank.to(torch.int32).cumsum(0, dtype=torch.int32) - 1
    return torch.where(in_rank, position, torch.full_like(position, -1))


def _row_bytes(parts):
    """Several `[N, ...]` tensors as one `[N, B]` uint8 tensor: each row's parts side by side."""
    return torch.cat([p.reshape(p.shape[0], math.prod(p.shape[1:])).view(torch.uint8)
                      for p in parts], 1)


def _split_row_bytes(rows, like):
    """`_row_bytes`'s inverse for `[N, B]` rows: one contiguous tensor per part of `like`."""
    out, at = [], 0
    for part in like:
        width = math.prod(part.shape[1:]) * part.element_size()
        piece = rows[:, at:at + width].contiguous().view(part.dtype)
        out.append(piece.view((rows.shape[0],) + tuple(part.shape[1:])))
        at += width
    return out


def _block_rows(sizes, device):
    """For rows flattened over consecutive blocks of `sizes` (host ints): each row's block and
    its index in the block, built from scalars on the device (no copy from the host, so that a
    CUDA graph can capture it)."""
    flat = torch.arange(sum(sizes), device=device)
    block = torch.zeros_like(flat)
    start = torch.zeros_like(flat)
    at = 0
    for b, n in enumerate(sizes[:-1]):
        at += n
        later = flat >= at
        block = torch.where(later, torch.full_like(block, b + 1), block)
        start = torch.where(later, torch.full_like(start, at), start)
    return block, flat - start


def _as_columns(scales):
    """fp8 scales `[T]` or `[T, S]` (f32 or int32) as `[T, S]` int32 columns, bit for bit."""
    return scales.reshape(scales.shape[0], math.prod(scales.shape[1:])).view(torch.int32)


def _with_scales(recv_x, columns, scales):
    """The received fp8 pair: the rows and their scales in the sender's dtype and shape."""
    shape = (columns.shape[0],) + tuple(scales.shape[1:])
    return recv_x, columns.contiguous().view(scales.dtype).reshape(shape)


# The kernels' rings move rows whose length is a multiple of this many bytes.
_KERNEL_ROW_ALIGN = 16


def _packed_rows(x, scales):
    """fp8 rows `[T, H]` and their scales (`_as_columns`) as one uint8 row a token, zero-padded
    to the kernels' row alignment: `[T, H + 4 S + pad]`, what the kernels' rings carry."""
    columns = _as_columns(scales).contiguous()
    # Flat first: a [T, 1] column counts as contiguous whatever its stride, which a byte view
    # of its rows would refuse.
    scale_bytes = columns.reshape(-1).view(torch.uint8).reshape(x.shape[0], 4 * columns.shape[1])
    parts = [x.view(torch.uint8), scale_bytes]
    pad = -sum(p.shape[1] for p in parts) % _KERNEL_ROW_ALIGN
    if pad:
        parts.append(torch.zeros(x.shape[0], pad, dtype=torch.uint8, device=x.device))
    return torch.cat(parts, dim=1)


def _unpacked_rows(packed, x, scales):
    """The fp8 pair in `_packed_rows`' received rows: the rows in `x`'s dtype, the scales in the
    sender's dtype and shape."""
    H, S = x.shape[1], math.prod(scales.shape[1:])
    rows = packed[:, :H].contiguous().view(x.dtype)
    return _with_scales(rows, packed[:, H:H + 4 * S].contiguous().view(torch.int32), scales)


def _counts_of(rank_prefix):
    """The `[R, R]` count matrix (source, destination) of a rank prefix matrix."""
    return torch.diff(rank_prefix, dim=0, prepend=torch.zeros_like(rank_prefix[:1]))
