"""mscclpp-rs: MSCCL++'s Python API (the Torch integration guide's) on the mscclpp-rs runtime.

CUDA or ROCm is loaded when first needed, so `import mscclpp` works on any machine; calls that
need a GPU raise `MscclppError` saying why when there is none.
"""

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
