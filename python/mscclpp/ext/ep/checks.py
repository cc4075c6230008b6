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
        raise ValueError(f"{what} must be a bf16 tensor here, not a (tokens, scales) pair: only "
                         "dispatch takes fp8 tokens")
    tensor(what, x, torch.bfloat16, 2)
    _whole_units(what, x)


def _whole_units(what, x):
    row_bytes = x.shape[1] * x.element_size()
    if row_bytes % HIDDEN_ALIGN_BYTES:
        raise ValueError(f"{what}: hidden size {x.shape[1]} is not supported: a token's "
                         f"{row_bytes} bytes must be a multiple of {HIDDEN_ALIGN_BYTES} "
                         f"(hidden a multiple of {HIDDEN_ALIGN_BYTES // x.element_size()})")


def tokens(what, x):
    """Dispatch's `x`: bf16 `[T, H]`, or DeepEP's fp8 pair `(tokens [T, H] of a 1-byte float8
    type, scales)` where the scales are f32 or int32 (UE8M0 exponents packed four to an int),
    `[T]` or `[T, S]`, any strides. Returns `(tokens, scales or None)`, the scales contiguous."""
    if not isinstance(x, tuple):
        hidden(what, x)
        return x, None
    if len(x) != 2:
        raise ValueError(f"{what}: an fp8 input is a (tokens, scales) pair, not {len(x)} items")
    data, scales = x
    if not isinstance(data, torch.Tensor) or not data.dtype.is_floating_point \
            or data.element_size() != 1:
        kind = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"{what}[0] must be a 1-byte float8 tensor (torch.float8_e4m3fn), not "
                         f"{kind}")
    tensor(f"{what}[0]", data, data.dtype, 2)
    _whole_units(f"{what}[0]", data)
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{what}[1] (the scales) must be a torch.Tensor, not "
                        f"{type(scales).__name__}")
    if scales.dtype not in (torch.float32, torch.int32):
        raise ValueError(f"{what}[1] (the scales) must be torch.float32 or torch.int32 (packed "
                         f"UE8M0), not {scales.dtype}")
    if scales.dim() not in (1, 2) or scales.shape[0] != data.shape[0]:
        raise ValueError(f"{what}[1] (the scales) has shape {tuple(scales.shape)}: it must be "
                         f"[{data.shape[0]}] or [{data.shape[0]}, num_scales], a row per token")
    return data, scales.contiguous()


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
