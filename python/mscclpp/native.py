"""Native customisation: CUDA source compiled at run time (NVRTC) with the device library's headers."""

import os

from . import _mscclpp


def compile_native(name, file=None, source=None, device=None):
    """Compiles a `.cu` file (or `source` text) for this GPU and loads it: a NativeModule whose
    `launch(kernel, grid, block, args, shared_mem=0, stream=0)` starts an `extern "C"` kernel.
    `#include "mscclpp/memory_channel.cuh"` (packet.cuh, semaphore.cuh...) works without a CUDA
    toolkit install beyond the driver and NVRTC. Compiled code is cached on disk by content."""
    if (file is None) == (source is None):
        raise ValueError("compile_native takes exactly one of file= and source=")
    if file is not None:
        with open(os.fspath(file)) as f:
            source = f.read()
    return _mscclpp.compile_native(name, source, device)
