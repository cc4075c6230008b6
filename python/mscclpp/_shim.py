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
