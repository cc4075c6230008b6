"""Where the wheel keeps the NCCL shim: mscclpp/lib/libmscclpp_nccl.so, and beside it
libnccl.so.2, a stub that loads the shim under NCCL's name (scripts/build-wheel.sh)."""

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


def in_process():
    """Whether an mscclpp-rs NCCL shim is loaded in this process: preloaded (LD_PRELOAD puts its
    `mscclppGetVersion`, an export only ours has, in the global scope) or this wheel's copy
    opened by someone (found without loading it, RTLD_NOLOAD)."""
    import ctypes
    import os

    try:
        if hasattr(ctypes.CDLL(None), "mscclppGetVersion"):
            return True
    except OSError:
        pass
    if SHIM.is_file():
        try:
            ctypes.CDLL(str(SHIM), mode=os.RTLD_NOLOAD)
            return True
        except OSError:
            pass
    return False


_warned = False


def warn_registry_not_shared(what):
    """Warns once a process when Python registrations are made while the shim is loaded: they
    are not seen by its NCCL calls yet (the shim and this package hold separate runtimes)."""
    global _warned
    if _warned or not in_process():
        return
    _warned = True
    import warnings

    warnings.warn(
        f"{what}: the NCCL shim is loaded in this process, but it does not see algorithms or "
        "selectors registered in Python yet (it and this package each have their own runtime); "
        "NCCL calls run the shim's default algorithms",
        RuntimeWarning,
        stacklevel=3,
    )
