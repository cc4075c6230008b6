"""Execution plans, MSCCL++'s way: `ExecutionPlan(path)` loads a JSON plan (as MSCCL++'s DSL
emits it) and `Executor(comm.communicator).execute(...)` runs it; `Algorithm(execution_plan=...)`
makes a plan an algorithm a collection can hold and its selector can pick."""

from . import _mscclpp
from ._teardown import track
from ._types import PacketType
from .algorithm import _native_comm, _runtime_dtype

ExecutionPlan = _mscclpp.ExecutionPlan


class Executor:
    """Runs execution plans on one communicator (a Communicator or a CommGroup). A plan is set up
    on its first run, collectively: every rank runs the same plans in the same order."""

    def __init__(self, comm):
        self._native = _mscclpp.NativeExecutor(_native_comm(comm))
        track(self)

    def execute(
        self,
        rank,
        send_buff,
        recv_buff,
        send_buff_size,
        recv_buff_size,
        data_type,
        plan,
        stream=0,
        packet_type=PacketType.LL16,
    ):
        """Enqueues `plan` on `stream` (an int handle) over device addresses `send_buff` and
        `recv_buff` (sizes in bytes); `rank` is this rank. Does not wait for the GPU; a plan's
        first run sets it up and must not be captured into a CUDA graph."""
        if not isinstance(plan, ExecutionPlan):
            raise TypeError(f"plan must be an mscclpp.ExecutionPlan, not {type(plan).__name__}")
        self._native.execute(
            int(rank), int(send_buff), int(recv_buff), int(send_buff_size), int(recv_buff_size),
            _runtime_dtype(data_type), plan, int(stream), PacketType(packet_type).value,
        )

    def reset(self):
        """Frees every plan's set-up; only while none of this executor's runs is in flight."""
        self._native.reset()

    def _close(self):
        self._native = None


__all__ = ["ExecutionPlan", "Executor", "PacketType"]
