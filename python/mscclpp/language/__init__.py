"""`mscclpp.language`: write a collective as a Python program over ranks, channels and chunks
of buffers, and lower it to an MSCCL++ JSON execution plan (see docs/dsl.md).

`from mscclpp.language import *` gives every name a program uses; the submodules
(`collectives`, `program`, `rank`, `channel`, `general`, `loop`, `thread_block_group`, `utils`)
are MSCCL++'s, so its programs' import lines work unchanged.
"""

from .channel import MemoryChannel, PortChannel, SwitchChannel
from .collectives import AllGather, AllReduce, AllToAll, Collective, ReduceScatter, SendRecv, TestCollective
from .general import JSON
from .loop import LoopIterationContext
from .program import CollectiveProgram
from .rank import BaseBuffer, Buffer, Rank, Semaphore
from .thread_block_group import ThreadBlockGroup
from .types import BufferType, ChannelType, Chunk, DslError, ReduceOperationType, ReplicationPolicy, SyncType
from .utils import AlgoSpec

__all__ = [
    "AlgoSpec",
    "AllGather",
    "AllReduce",
    "AllToAll",
    "BaseBuffer",
    "Buffer",
    "BufferType",
    "ChannelType",
    "Chunk",
    "Collective",
    "CollectiveProgram",
    "DslError",
    "JSON",
    "LoopIterationContext",
    "MemoryChannel",
    "PortChannel",
    "Rank",
    "ReduceOperationType",
    "ReduceScatter",
    "ReplicationPolicy",
    "Semaphore",
    "SendRecv",
    "SwitchChannel",
    "SyncType",
    "TestCollective",
    "ThreadBlockGroup",
]
