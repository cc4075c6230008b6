"""The DSL's value types: the enums MSCCL++'s programs name (`BufferType`, `SyncType`,
`ReduceOperationType`, `ChannelType`, `ReplicationPolicy`), `Chunk`, and `DslError`.

The enums' values are the strings the JSON execution-plan format uses, so the emitter writes
`.value` and nothing translates between two spellings.
"""

import os
import sys
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "BufferType",
    "ChannelType",
    "Chunk",
    "DslError",
    "ReduceOperationType",
    "ReplicationPolicy",
    "SyncType",
]


class DslError(RuntimeError):
    """A program the DSL cannot turn into a correct plan. The message starts with the program
    line that made the offending call (`file:line`) and names the rank, threadblock and chunks
    involved. A RuntimeError, as MSCCL++'s DSL raises, so programs written for it catch it."""


class SyncType(Enum):
    """Where a synchronising op (signal, wait, flush, semaphores) also syncs the threads of its
    threadblock (`__syncthreads`): before it, after it, both or neither. Combine with `|`, `&`,
    `^` as bit sets (before = 1, after = 2)."""

    none = "none"
    before = "before"
    after = "after"
    both = "both"

    def __str__(self):
        return self.value

    @property
    def _bits(self):
        return _SYNC_BITS[self]

    @staticmethod
    def _of(bits):
        return _SYNC_OF_BITS[bits]

    def __or__(self, other):
        if not isinstance(other, SyncType):
            return NotImplemented
        return SyncType._of(self._bits | other._bits)

    def __and__(self, other):
        if not isinstance(other, SyncType):
            return NotImplemented
        return SyncType._of(self._bits & other._bits)

    def __xor__(self, other):
        if not isinstance(other, SyncType):
            return NotImplemented
        return SyncType._of(self._bits ^ other._bits)

    def has(self, part):
        """Whether every bit of `part` is set here (`SyncType.both.has(SyncType.after)`)."""
        return self & part == part


_SYNC_BITS = {SyncType.none: 0, SyncType.before: 1, SyncType.after: 2, SyncType.both: 3}
_SYNC_OF_BITS = {v: k for k, v in _SYNC_BITS.items()}


class ReduceOperationType(Enum):
    sum = "sum"
    min = "min"
    max = "max"

    def __str__(self):
        return self.value


class BufferType(Enum):
    """A rank's buffers: the collective's input and output, and the plan's scratch."""

    input = "i"
    output = "o"
    scratch = "s"

    def __str__(self):
        return self.value

    def __lt__(self, other):
        return self.value < other.value

    @property
    def label(self):
        return self.name


class ChannelType(Enum):
    memory = "memory"
    port = "port"
    switch = "switch"
    none = "none"

    def __str__(self):
        return self.value


class ReplicationPolicy(Enum):
    """How `instances` copies of a program share the buffers.

    `interleaved`: every chunk is split in `instances` parts, instance i takes part i (chunk k of
    the program becomes chunks k*n+i... of the plan), so the copies together cover the buffers
    and each runs on its own threadblocks, channels and semaphores.
    `none`: the copies get their own threadblocks, channels, semaphores and barriers but run on
    the program's chunks as written (chunk counts and indices unchanged): for programs whose
    copies must see the same data (e.g. to spread signalling over more threadblocks)."""

    interleaved = "interleaved"
    none = "none"

    def __str__(self):
        return self.value


@dataclass(frozen=True)
class Chunk:
    """A contiguous run of `size` chunks from `index` in one buffer of one rank; made by slicing
    a buffer (`rank.get_input_buffer()[2:4]`, `Buffer(rank, n)[0:1]`)."""

    rank: int
    buffer: BufferType
    index: int
    size: int

    def to_dict(self):
        return {"rank": self.rank, "type": self.buffer.value, "index": self.index, "size": self.size}

    def __str__(self):
        return f"rank {self.rank} {self.buffer.label}[{self.index}:{self.index + self.size}]"


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_COMPILER_FILE = os.path.join(os.path.dirname(_PACKAGE_DIR), "_compiler.py")


def call_site():
    """`file:line` of the user's program line that called into the DSL (the innermost frame
    outside this package and the compiler), for error messages."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if os.path.dirname(path) != _PACKAGE_DIR and path != _COMPILER_FILE:
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def fail(message, where=None):
    """Raises DslError for `message`, headed by the call site (or `where`)."""
    raise DslError(f"{where or call_site()}: {message}")
