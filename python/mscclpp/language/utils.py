"""`AlgoSpec`: what `mscclpp.compile` and `CollectiveProgram.from_spec` build a program from."""

from dataclasses import dataclass, field

from .collectives import Collective
from .types import ReplicationPolicy

__all__ = ["AlgoSpec", "ReplicationPolicy"]


@dataclass(frozen=True)
class AlgoSpec:
    """An algorithm to compile: its name, collective (a Collective instance), ranks
    (`world_size`, `nranks_per_node`), `in_place`, `instances`, `protocol` ("Simple" or "LL"),
    the CollectiveProgram options, the message range it serves and `tags` for selectors."""

    name: str
    collective: Collective
    nranks_per_node: int
    world_size: int
    in_place: bool
    instances: int
    protocol: str
    instr_fusion: bool = True
    auto_sync: bool = True
    replication_policy: ReplicationPolicy = ReplicationPolicy.interleaved
    reuse_resources: bool = False
    num_threads_per_block: int = 1024
    use_double_scratch_buffer: bool = False
    buffer_alignment: int = 16
    min_message_size: int = 0
    max_message_size: int = 2**64 - 1
    tags: dict = field(default_factory=dict)
