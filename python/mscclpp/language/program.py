"""`CollectiveProgram`: the container a DSL program writes into, and its JSON execution plan."""

import json
from collections import defaultdict

from . import _context
from ._plan import RankState, check_signal_wait_pairing
from .channel import MemoryChannel, PortChannel, SwitchChannel
from .collectives import AllGather, AllReduce, AllToAll, Collective, ReduceScatter, SendRecv, TestCollective
from .rank import Buffer, Rank, Semaphore
from .types import BufferType, ChannelType, ReplicationPolicy, SyncType, fail
from .utils import AlgoSpec

__all__ = [
    "AlgoSpec",
    "AllGather",
    "AllReduce",
    "AllToAll",
    "Buffer",
    "BufferType",
    "ChannelType",
    "CollectiveProgram",
    "MemoryChannel",
    "PortChannel",
    "Rank",
    "ReduceScatter",
    "ReplicationPolicy",
    "Semaphore",
    "SendRecv",
    "SwitchChannel",
    "SyncType",
    "TestCollective",
]

PROTOCOLS = ("Simple", "LL")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fail(f"{name} must be a positive integer, not {value!r}")
    return value


class CollectiveProgram:
    """A collective written as per-rank, per-threadblock ops over chunks of each rank's input,
    output and scratch buffers; `to_json()` lowers it to an MSCCL++ JSON execution plan.

    Use it as a context manager: DSL calls (`Rank`, channels, `Buffer`, ...) made inside the
    `with` block add to it. `instances` copies of the program run side by side on their own
    threadblocks, channels and semaphores, sharing the buffers as `replication_policy` says.
    `instr_fusion` fuses adjacent ops into the plan format's combined ops; `auto_sync` adds the
    threadblock syncs that order ops touching the same local data.
    """

    def __init__(
        self,
        name,
        collective,
        num_ranks,
        instances=1,
        protocol="Simple",
        instr_fusion=True,
        auto_sync=True,
        replication_policy=ReplicationPolicy.interleaved,
        reuse_resources=False,
        num_threads_per_block=1024,
        use_double_scratch_buffer=False,
        buffer_alignment=16,
        min_message_size=0,
        max_message_size=2**64 - 1,
    ):
        if not isinstance(collective, Collective):
            fail(f"collective must be a Collective (AllReduce(...), AllGather(...), ...), not {collective!r}")
        self.num_ranks = _positive_int("num_ranks", num_ranks)
        if collective.num_ranks != num_ranks:
            fail(f"the collective is for {collective.num_ranks} ranks but the program for {num_ranks}")
        if protocol not in PROTOCOLS:
            fail(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
        if not isinstance(replication_policy, ReplicationPolicy):
            fail(f"replication_policy must be a ReplicationPolicy, not {replication_policy!r}")
        if not 0 <= min_message_size <= max_message_size < 2**64:
            fail(f"message sizes must satisfy 0 <= min ({min_message_size}) <= max ({max_message_size}) < 2**64")
        self.name = str(name)
        self.collective = collective
        self.instances = _positive_int("instances", instances)
        self.protocol = protocol
        self.instr_fusion = bool(instr_fusion)
        self.auto_sync = bool(auto_sync)
        self.replication_policy = replication_policy
        self.reuse_resources = bool(reuse_resources)
        self.num_threads_per_block = _positive_int("num_threads_per_block", num_threads_per_block)
        self.use_double_scratch_buffer = bool(use_double_scratch_buffer)
        self.buffer_alignment = _positive_int("buffer_alignment", buffer_alignment)
        self.min_message_size = int(min_message_size)
        self.max_message_size = int(max_message_size)
        self.buffers = collective.init_buffers()
        self.ranks = [
            RankState(r, self.buffers[r][BufferType.input].size, self.buffers[r][BufferType.output].size)
            for r in range(num_ranks)
        ]
        self.loop_context = None
        self._signals = defaultdict(list)
        self._waits = defaultdict(list)
        self._plan = None

    @classmethod
    def from_spec(cls, spec):
        """The program an `AlgoSpec` describes (its collective, world size and options)."""
        if not isinstance(spec, AlgoSpec):
            fail(f"from_spec takes an AlgoSpec, not {spec!r}")
        return cls(
            spec.name,
            spec.collective,
            spec.world_size,
            instances=spec.instances,
            protocol=spec.protocol,
            instr_fusion=spec.instr_fusion,
            auto_sync=spec.auto_sync,
            replication_policy=spec.replication_policy,
            reuse_resources=spec.reuse_resources,
            num_threads_per_block=spec.num_threads_per_block,
            use_double_scratch_buffer=spec.use_double_scratch_buffer,
            buffer_alignment=spec.buffer_alignment,
            min_message_size=spec.min_message_size,
            max_message_size=spec.max_message_size,
        )

    def __enter__(self):
        _context.enter(self)
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        _context.leave(self)
        return False

    # Used by the DSL's calls (rank.py, channel.py, loop.py).

    def check_rank(self, rank, what="rank"):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            fail(f"{what} {rank!r} is out of range: the program has ranks 0..{self.num_ranks - 1}")
        return rank

    def check_open(self):
        if self._plan is not None:
            fail(f"program {self.name!r} was already lowered to JSON: no op can be added after to_json()")

    def add_operation(self, rank, tb, op):
        self.check_open()
        if self.loop_context is not None:
            self.loop_context.add_operation(rank, tb, op)
        else:
            self.ranks[rank].threadblock(tb).ops.append(op)

    def register_signal(self, src, dst, channel_type, origin):
        self._signals[(src, dst, channel_type)].append(origin)

    def register_wait(self, src, dst, channel_type, origin):
        self._waits[(src, dst, channel_type)].append(origin)

    def set_loop_context(self, loop_context):
        if self.loop_context is not None and loop_context is not None:
            fail("loop iteration contexts do not nest")
        self.loop_context = loop_context

    # Lowering.

    def post_process_operations(self):
        """Lowers the program once (pairing check, fusion, syncs, replication) and keeps the
        result: later calls, `to_json()` and `JSON()` all return the same plan."""
        if self._plan is None:
            if self.loop_context is not None:
                fail("the program is lowered inside a LoopIterationContext: close it first")
            check_signal_wait_pairing(self._signals, self._waits)
            lowered = [r.lowered_ops(self) for r in self.ranks]
            self._plan = {
                "name": self.name,
                "collective": self.collective.name,
                "protocol": self.protocol,
                "inplace": self.collective.inplace,
                "reuse_resources": self.reuse_resources,
                "gpus": [r.to_dict(self, ops) for r, ops in zip(self.ranks, lowered)],
                "num_threads_per_block": self.num_threads_per_block,
                "use_double_scratch_buffer": self.use_double_scratch_buffer,
                "buffer_alignment": self.buffer_alignment,
                "min_message_size": self.min_message_size,
                "max_message_size": self.max_message_size,
            }
        return self._plan

    def to_dict(self):
        """The execution plan as a dict (a fresh copy; see `to_json`)."""
        return json.loads(json.dumps(self.post_process_operations()))

    def to_json(self, indent=2, **kwargs):
        """The execution plan, MSCCL++'s JSON format (json.dumps keywords are passed on)."""
        return json.dumps(self.post_process_operations(), indent=indent, **kwargs)

