"""The argument checks of `Buffer`'s calls, each error naming the argument (and, where it matters,
the value and the rule). Host-side only, so they run, and are tested, without a GPU; the one check
that reads tensor values (`topk_idx` in range) costs a host synchronisation."""

import torch

# Tokens move in 16-byte units (the kernels' int4 copies).
HIDDEN_ALIGN_BYTES = 16


def tensor(what, t, dtype, dim, rows=None, cols=None):
    """`t` is a contiguous `dim`-dimensional tensor of `dtype`, of `rows` x `cols` where given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{what} must be {dtype}, not {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{what} must be {dim}-dimensional, not of shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (shape {tuple(t.shape)}, strides "
                         f"{tuple(t.stride())}): pass .contiguous()")
    for axis, want in ((0, rows), (1, cols)):
        if want is not None and t.shape[axis] != want:
            raise ValueError(f"{what} has shape {tuple(t.shape)}: dimension {axis} must be {want}")


def hidden(what, x):
    """`x` `[T, H]` bf16 with rows of whole 16-byte units."""
    if isinstance(x, tuple):
        raise NotImplementedError(
            f"{what}: fp8 input (a (tensor, scales) pair) is not implemented yet in "
            "mscclpp.ext.ep; pass bf16 tokens")
    tensor(what, x, torch.bfloat16, 2)
    row_bytes = x.shape[1] * x.element_size()
    if row_bytes % HIDDEN_ALIGN_BYTES:
        raise ValueError(f"{what}: hidden size {x.shape[1]} is not supported: a token's "
                         f"{row_bytes} bytes must be a multiple of {HIDDEN_ALIGN_BYTES} "
                         f"(hidden a multiple of {HIDDEN_ALIGN_BYTES // x.element_size()})")


def num_experts(value, num_ranks):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"num_experts={value!r} must be a positive int")
    if value % num_ranks:
        raise ValueError(f"num_experts={value} does not split into {num_ranks} ranks (each rank "
                         "holds num_experts / num_ranks experts)")


def topk_range(topk_idx, experts):
    """Every entry of `topk_idx` is an expert id or -1 (reads the values: a host sync)."""
    if topk_idx.numel() == 0:
        return
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if lo < -1 or hi >= experts:
        raise ValueError(f"topk_idx holds values in [{lo}, {hi}]: each must be -1 (no expert) or "
                         f"an expert id in [0, {experts})")


def positive_int(what, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what}={value!r} must be an int of at least {minimum}")


def buffer_size(what, num_nvl_bytes, needed, config):
    if needed > num_nvl_bytes:
        raise ValueError(
            f"{what}: num_nvl_bytes={num_nvl_bytes} of this Buffer is too small for {config}: it "
            f"needs {needed} bytes (size the Buffer with config.get_nvl_buffer_size_hint)")


def stream_events(previous_event, async_finish, allocate_on_comm_stream):
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError("allocate_on_comm_stream=True needs previous_event and "
                         "async_finish=True (the caller then owns the stream order)")
