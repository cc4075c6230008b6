"""mscclpp-rs: MSCCL++'s Python API (the Torch integration guide's) on the mscclpp-rs runtime.

CUDA or ROCm is loaded when first needed, so `import mscclpp` works on any machine; calls that
need a GPU raise `MscclppError` saying why when there is none.
"""

import os

# CUDA spreads a process's streams over CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by default)
# in creation order. A copy of the proxy's or of the Ethernet receiver's whose stream shares a
# queue with a kernel that waits for that copy waits behind the kernel until the device wait
# timeout: across simulated hosts at 2 x 4 ranks on one H100 this stalled every run with 8 queues
# and none with 32 (docs/troubleshooting.md). 32 is CUDA's most: two streams then share a queue
# only 32 creations apart. It counts only if set before the process's CUDA context exists (before
# PyTorch's first CUDA call); a user's own value stays (1 is refused where it would hang). The NCCL
# shim and the Rust CUDA backend give the same default (mscclpp_cuda::driver).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

from . import ext, language, utils
from ._mscclpp import (
    CommSession,
    Communicator,
    MemoryChannels,
    MscclppError,
    NativeModule,
    RawGpuBuffer,
    TcpBootstrap,
    TuningTable,
    __version__,
    backend_name,
    env,
    is_nvls_supported,
)
from ._types import CommResult, DataType, PacketType, ReduceOp
from .algorithm import (
    Algorithm,
    AlgorithmCollection,
    AlgorithmCollectionBuilder,
    CollectiveRequest,
    CustomAlgorithm,
)
from .executor import ExecutionPlan, Executor
from .native import compile_native
from ._compiler import DslCompiler, compile  # noqa: A004 (MSCCL++'s name: mscclpp.compile)
from .comm import CommGroup

__all__ = [
    "Algorithm",
    "AlgorithmCollection",
    "AlgorithmCollectionBuilder",
    "CollectiveRequest",
    "CommGroup",
    "CommResult",
    "CommSession",
    "Communicator",
    "CustomAlgorithm",
    "DslCompiler",
    "MemoryChannels",
    "NativeModule",
    "DataType",
    "ExecutionPlan",
    "Executor",
    "MscclppError",
    "PacketType",
    "RawGpuBuffer",
    "ReduceOp",
    "TcpBootstrap",
    "TuningTable",
    "__version__",
    "backend_name",
    "compile",
    "compile_native",
    "env",
    "is_nvls_supported",
    "ext",
    "language",
    "utils",
]
