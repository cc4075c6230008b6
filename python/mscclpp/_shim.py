"""Where the wheel keeps the NCCL shim (mscclpp/lib/libmscclpp_nccl.so, and beside it
libnccl.so.2, a stub that loads the shim under NCCL's name: scripts/build-wheel.sh), and the
registrations this package shares with a shim loaded in its process (nccl/src/registry.rs): the
plans and the selector of AlgorithmCollectionBuilder reach the NCCL calls too."""

import ctypes
import os
import traceback
from pathlib import Path

LIB_DIR = Path(__file__).resolve().parent / "lib"
SHIM = LIB_DIR / "libmscclpp_nccl.so"
NCCL_NAME = LIB_DIR / "libnccl.so.2"


def nccl_lib():
    """The shim's path, for LD_PRELOAD; raises FileNotFoundError saying how to get it when this
    install has none (a `pip install ./python` from source builds the extension only)."""
    if not SHIM.is_file():
        raise FileNotFoundError(
            f"{SHIM} is missing: this mscclpp was built without the NCCL shim. Install the wheel "
            "that scripts/build-wheel.sh builds, or build the shim from a checkout "
            "(cargo build --release -p mscclpp-nccl: target/release/libmscclpp_nccl.so)"
        )
    return SHIM


def _loaded():
    """The shim loaded in this process, as a ctypes library: preloaded (LD_PRELOAD puts its
    `mscclppGetVersion`, an export only ours has, in the global scope) or this wheel's copy
    opened by someone (found without loading it, RTLD_NOLOAD); None when neither."""
    try:
        process = ctypes.CDLL(None)
        if hasattr(process, "mscclppGetVersion"):
            return process
    except OSError:
        pass
    if SHIM.is_file():
        try:
            return ctypes.CDLL(str(SHIM), mode=os.RTLD_NOLOAD)
        except OSError:
            pass
    return None


def in_process():
    """Whether an mscclpp-rs NCCL shim is loaded in this process."""
    return _loaded() is not None


def _registry():
    """The loaded shim's registry exports (nccl/src/registry.rs), or None without a shim. A shim
    older than the registry is an error: registrations would silently not reach its calls."""
    lib = _loaded()
    if lib is None:
        return None
    if not hasattr(lib, "mscclppNcclRegisterPlan"):
        raise RuntimeError(
            "the NCCL shim loaded in this process has no registry (mscclppNcclRegisterPlan): it "
            "is older than this mscclpp; preload the shim this package holds "
            "(python -m mscclpp --nccl-lib)"
        )
    return lib


def last_error():
    """The loaded shim's `ncclGetLastError` text (what its last failed call said), or None
    without a shim. PyTorch's exception for a failed NCCL call names only the result code."""
    lib = _loaded()
    return None if lib is None else _last_error_of(lib)


def _last_error_of(lib):
    lib.ncclGetLastError.restype = ctypes.c_char_p
    return lib.ncclGetLastError(None).decode(errors="replace")


def _check(lib, code, what):
    if code != 0:
        raise ValueError(f"{what}: {_last_error_of(lib)}")


def share_plan(execution_plan):
    """Registers `execution_plan` (an ExecutionPlan) with the NCCL shim when one is loaded in this
    process, so the communicators it creates from now on take it (every rank must register the
    same plans). Without a shim, nothing."""
    lib = _registry()
    if lib is None:
        return
    with open(execution_plan.path, "rb") as f:
        text = f.read()
    lib.mscclppNcclRegisterPlan.argtypes = [ctypes.c_char_p]
    _check(lib, lib.mscclppNcclRegisterPlan(text), f"registering {execution_plan.path} with the shim")


# Every ctypes callback handed to the shim: a call may still be inside a replaced one.
_selectors_kept = []


def share_selector(selector, algorithms):
    """Makes `selector(algorithms_by_collective, request)` the NCCL shim's selector when one is
    loaded in this process: asked before every collective it runs, on the calling thread, with
    `algorithms()` (`{collective: {name: Algorithm}}`) and a CollectiveRequest. Its Algorithm runs
    (None: the shim's own choice); an exception it raises is printed and fails that call. None
    clears it. Without a shim, nothing."""
    lib = _registry()
    if lib is None:
        return
    callback_type = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.POINTER(SelectionRequest), ctypes.c_void_p, ctypes.c_size_t,
        ctypes.c_void_p,
    )
    lib.mscclppNcclSetSelector.argtypes = [callback_type, ctypes.c_void_p]
    if selector is None:
        _check(lib, lib.mscclppNcclSetSelector(callback_type(), None), "clearing the shim's selector")
        return

    def ask(request, name, capacity, _context):
        try:
            chosen = selector(algorithms(), request_of(request.contents))
            if chosen is None:
                return 0
            answer = chosen.name.encode() + b"\0"
            if len(answer) > capacity:
                raise ValueError(f"algorithm name {chosen.name!r} is longer than {capacity - 1} bytes")
            ctypes.memmove(name, answer, len(answer))
            return 1
        except BaseException:  # noqa: BLE001 - nothing may unwind into the shim
            traceback.print_exc()
            return -1

    callback = callback_type(ask)
    _selectors_kept.append(callback)
    _check(lib, lib.mscclppNcclSetSelector(callback, None), "setting the shim's selector")


class SelectionRequest(ctypes.Structure):
    """`mscclppNcclSelectionRequest` (nccl/src/registry.rs)."""

    _fields_ = [
        ("collective", ctypes.c_char_p),
        ("message_size", ctypes.c_size_t),
        ("dtype", ctypes.c_char_p),
        ("world_size", ctypes.c_int),
        ("nranks_per_node", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("stream", ctypes.c_void_p),
        ("in_place", ctypes.c_int),
        ("symmetric_memory", ctypes.c_int),
    ]


def request_of(r):
    """The CollectiveRequest a selector gets for the shim's SelectionRequest `r`."""
    from ._types import DataType
    from .algorithm import CollectiveRequest

    return CollectiveRequest(
        collective=r.collective.decode(), message_size=r.message_size,
        dtype=DataType(r.dtype.decode()), world_size=r.world_size, rank=r.rank,
        stream=r.stream or 0, symmetric_memory=bool(r.symmetric_memory), in_place=bool(r.in_place),
        nranks_per_node=r.nranks_per_node,
    )
