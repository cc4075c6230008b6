"""Per-rank and per-threadblock state of a program being written, and its lowering to the plan:
fusion, sync nops, hazard nops, replication into instances, JSON.

Ids a plan uses are allocated here, per program (never per process, so two programs in one
process get the same ids for the same code): channels per rank and type in creation order,
remote buffers per rank in first-use order (one per peer and buffer type, with the channel
types it is accessed over in first-use order), semaphores per rank, barriers per rank and set of
threadblocks. A threadblock refers to channels and remote buffers by its own indices (the order
it first uses them), which the ops carry.
"""

from collections import OrderedDict

from . import _ops
from .types import BufferType, ReplicationPolicy, fail


class ThreadBlockState:
    def __init__(self, tb_id):
        self.id = tb_id
        self.ops = []
        self.channels = OrderedDict()  # ChannelType -> [rank's channel id]
        self.remote_buffers = OrderedDict()  # ChannelType -> [rank's remote buffer id]

    def channel_index(self, channel_type, channel_id):
        ids = self.channels.setdefault(channel_type, [])
        if channel_id not in ids:
            ids.append(channel_id)
        return ids.index(channel_id)

    def remote_buffer_index(self, channel_type, buffer_id):
        ids = self.remote_buffers.setdefault(channel_type, [])
        if buffer_id not in ids:
            ids.append(buffer_id)
        return ids.index(buffer_id)

    def to_dict(self, ops):
        return {
            "id": self.id,
            "ops": [op.to_dict() for op in ops],
            "channels": [
                {"channel_type": t.value, "channel_ids": list(ids)} for t, ids in self.channels.items() if ids
            ],
            "remote_buffer_refs": [
                {"access_channel_type": t.value, "remote_buffer_ids": list(ids)}
                for t, ids in self.remote_buffers.items()
            ],
        }


class RankState:
    def __init__(self, rank, input_chunks, output_chunks):
        self.rank = rank
        self.chunks = {BufferType.input: input_chunks, BufferType.output: output_chunks, BufferType.scratch: 0}
        self.threadblocks = []
        self.channels = OrderedDict()  # ChannelType -> [peer rank], index = channel id
        self.switch_channels = []  # (buffer type, [ranks])
        self.remote_buffers = OrderedDict()  # (peer, BufferType) -> [ChannelType]
        self.semaphores = []  # initial values
        self.barriers = {}  # tuple(tbs) -> barrier id

    def threadblock(self, tb):
        while len(self.threadblocks) <= tb:
            self.threadblocks.append(ThreadBlockState(len(self.threadblocks)))
        return self.threadblocks[tb]

    def add_channel(self, channel_type, peer):
        peers = self.channels.setdefault(channel_type, [])
        peers.append(peer)
        return len(peers) - 1

    def add_switch_channel(self, buffer_type, ranks):
        self.switch_channels.append((buffer_type, list(ranks)))
        return len(self.switch_channels) - 1

    def remote_buffer(self, peer, buffer_type, channel_type):
        key = (peer, buffer_type)
        types = self.remote_buffers.setdefault(key, [])
        if channel_type not in types:
            types.append(channel_type)
        return list(self.remote_buffers).index(key)

    def barrier_id(self, tbs):
        return self.barriers.setdefault(tuple(tbs), len(self.barriers))

    def lowered_ops(self, program):
        """Each threadblock's ops after fusion, sync nops and hazard nops."""
        out = []
        for tb in self.threadblocks:
            ops = list(tb.ops)
            if program.instr_fusion:
                ops = _ops.fuse_all(ops)
            ops = _ops.add_sync_nops(ops)
            if program.auto_sync:
                ops = _ops.add_hazard_nops(ops)
            for op in _walk(ops):
                if isinstance(op, _ops.SwitchReduce):
                    fail(
                        f"{op.where}: a switch channel reduce must be followed, in the same threadblock, by a "
                        f"broadcast of its result ({op.dst_chunk}) through the same channel: the plan format "
                        "has only the fused reduce-and-broadcast (glres)",
                        op.origin,
                    )
            out.append(ops)
        return out

    def to_dict(self, program, lowered):
        n = program.instances
        shift_id = None
        threadblocks = []
        for tb, ops in zip(self.threadblocks, lowered):
            for i in range(n):
                shift_id = _id_shift(i, n)
                shift_index = _index_shift(program.replication_policy, i, n)
                copy_tb = tb.to_dict([op.replicate(shift_index, shift_id) for op in ops])
                copy_tb["id"] = shift_id(tb.id)
                for ch in copy_tb["channels"]:
                    ch["channel_ids"] = [shift_id(c) for c in ch["channel_ids"]]
                threadblocks.append(copy_tb)
        chunk_factor = n if program.replication_policy == ReplicationPolicy.interleaved else 1
        channels = [
            {"channel_type": t.value, "connected_to": [p for p in peers for _ in range(n)]}
            for t, peers in self.channels.items()
        ]
        channels += [
            {
                "channel_type": "switch",
                "buffer_type": buffer_type.value,
                "rank_groups": [{"size": len(ranks), "ranks": list(ranks)}],
            }
            for buffer_type, ranks in self.switch_channels
            for _ in range(n)
        ]
        return {
            "id": self.rank,
            "input_chunks": self.chunks[BufferType.input] * chunk_factor,
            "output_chunks": self.chunks[BufferType.output] * chunk_factor,
            "scratch_chunks": self.chunks[BufferType.scratch] * chunk_factor,
            "threadblocks": threadblocks,
            "channels": channels,
            "remote_buffers": [
                {"rank": peer, "type": buffer_type.value, "access_channel_types": [t.value for t in types]}
                for (peer, buffer_type), types in self.remote_buffers.items()
            ],
            "semaphores": [{"init_value": v} for v in self.semaphores for _ in range(n)],
        }


def _walk(ops):
    for op in ops:
        yield op
        if isinstance(op, _ops.Pipeline):
            yield from _walk(op.ops)


def _id_shift(instance, n):
    """Instance `instance` of `n` gets id `id*n + instance` of every replicated resource."""
    return lambda value: value * n + instance


def _index_shift(policy, instance, n):
    if policy == ReplicationPolicy.interleaved:
        return lambda index, size: index * n + instance * size
    return lambda index, size: index


def check_signal_wait_pairing(signals, waits):
    """Every signal from rank a to rank b over one channel type must be met by one wait of b
    for a over that type (else a peer blocks forever, or a later wait passes early).
    `signals`/`waits` map (src, dst, type) to the program lines of the calls."""
    for src, dst, channel_type in sorted(
        set(signals) | {(d, s, t) for (s, d, t) in waits}, key=lambda k: (k[0], k[1], k[2].value)
    ):
        sent = signals.get((src, dst, channel_type), [])
        awaited = waits.get((dst, src, channel_type), [])
        if len(sent) != len(awaited):
            lines = ", ".join(sorted(set(sent + awaited))[:6])
            fail(
                f"rank {src} signals rank {dst} {len(sent)} time(s) over {channel_type.value} channels, but rank "
                f"{dst} waits for rank {src} {len(awaited)} time(s); each signal needs one wait on the peer "
                f"(calls at {lines})",
                (sent or awaited)[0],
            )
