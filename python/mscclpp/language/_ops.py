"""The ops of one threadblock, as the DSL records them and as the plan's JSON spells them.

Each op knows four things: its JSON (`to_dict`), the local buffer ranges it reads and writes
(`accesses`, for the hazard nops), how it moves when a program is replicated into instances
(`replicate`), and which op it becomes when fused with the op that follows it (`fuse`).

Fusion (MSCCL++'s rules): two signals (or waits) on disjoint channels of one type become one op
over both; flushes, semaphore acquires or releases merge; puts of one kind and size merge into
one op with several destinations; read-put-packets of one source fan out (`rppkt` with several
destinations); reduces of one source and destination merge their sources; a reduce followed by
a put of its result becomes reduce-and-send (`res`, `rres`, `respkt`), a packet reduce followed
by a packet copy of its result `recpkt`, and that followed by put-packets or read-put-packets of
its result `recspkt`; a switch reduce followed by a broadcast of its result `glres`. A
synchronising op next to a sync (an explicit nop, a barrier, or another op's sync on that side)
drops its own sync on that side, since one `__syncthreads` serves both.
"""

import copy
import itertools
from dataclasses import dataclass
from typing import List, Optional

from .types import BufferType, ChannelType, Chunk, SyncType

_serials = itertools.count()


@dataclass(frozen=True)
class Ref:
    """A local range: a buffer of this rank, `index`, `size` (in chunks)."""

    type: BufferType
    index: int
    size: int

    def to_dict(self):
        return {"type": self.type.value, "index": self.index, "size": self.size}

    def moved(self, index):
        return Ref(self.type, index, self.size)


@dataclass(frozen=True)
class RemoteRef:
    """A peer's range: `buffer_id` is the threadblock's index of the remote buffer (among those
    it accesses over the op's channel type)."""

    buffer_id: int
    index: int
    size: int

    def to_dict(self):
        return {"buffer_id": self.buffer_id, "index": self.index, "size": self.size}

    def moved(self, index):
        return RemoteRef(self.buffer_id, index, self.size)


@dataclass(frozen=True)
class Access:
    """One local range an op reads ("r") or writes ("w")."""

    buffer: BufferType
    start: int
    end: int  # exclusive
    kind: str
    op: int  # the serial of the op (a pipeline's for the ops inside it)

    def conflicts(self, other):
        return (
            self.buffer == other.buffer
            and self.start < other.end
            and other.start < self.end
            and self.op != other.op
            and "w" in (self.kind, other.kind)
        )


def _reads(refs, op):
    return [Access(r.type, r.index, r.index + r.size, "r", op) for r in refs]


def _writes(refs, op):
    return [Access(r.type, r.index, r.index + r.size, "w", op) for r in refs]


class Op:
    """Base of every op. `origin` is the program line that made it; `rank`/`tb` where it runs."""

    name = ""

    def __init__(self, origin):
        self.origin = origin
        self.serial = next(_serials)

    def accesses(self) -> List[Access]:
        return []

    def replicate(self, shift_index, shift_id):
        """This op for one instance: chunk indices through `shift_index(index, size)`,
        semaphore and barrier ids through `shift_id(id)`. Channel and remote-buffer ids are the
        threadblock's own indices, which replication keeps."""
        return copy.copy(self)

    def fuse(self, nxt) -> Optional["Op"]:
        return None

    def to_dict(self):
        return {"name": self.name}


class SyncingOp(Op):
    """An op that may `__syncthreads` before and/or after itself (`data_sync`)."""

    def __init__(self, origin, data_sync):
        super().__init__(origin)
        self.data_sync = data_sync

    def drop_sync(self, side):
        self.data_sync = self.data_sync ^ (self.data_sync & side)

    def _next_syncs_before(self, nxt):
        return (
            isinstance(nxt, (Nop, Barrier))
            or (isinstance(nxt, SyncingOp) and nxt.data_sync.has(SyncType.before))
            or (isinstance(nxt, Pipeline) and nxt.edge_syncs().has(SyncType.before))
        )

    def fuse(self, nxt):
        merged = self.merge(nxt)
        if merged is None and self._next_syncs_before(nxt):
            self.drop_sync(SyncType.after)
        return merged

    def merge(self, nxt):
        return None


class Nop(Op):
    """`__syncthreads()` of the threadblock."""

    name = "nop"

    def fuse(self, nxt):
        if isinstance(nxt, Nop):
            return Nop(self.origin)
        if isinstance(nxt, Barrier):
            return nxt
        if isinstance(nxt, Pipeline) and nxt.edge_syncs().has(SyncType.before):
            return nxt
        if isinstance(nxt, SyncingOp):
            nxt.drop_sync(SyncType.before)
        return None


class Barrier(Op):
    """A barrier of several threadblocks of one rank (`barrier_id` per rank and block set)."""

    name = "barrier"

    def __init__(self, origin, barrier_id, num_threadblocks):
        super().__init__(origin)
        self.barrier_id = barrier_id
        self.num_threadblocks = num_threadblocks

    def replicate(self, shift_index, shift_id):
        op = copy.copy(self)
        op.barrier_id = shift_id(self.barrier_id)
        return op

    def fuse(self, nxt):
        if isinstance(nxt, SyncingOp):
            nxt.drop_sync(SyncType.before)
        elif isinstance(nxt, Nop):
            return self
        return None

    def to_dict(self):
        return {"name": self.name, "barrier_id": self.barrier_id, "num_threadblocks": self.num_threadblocks}


class Semaphore(SyncingOp):
    """`sem_acquire` / `sem_release` of semaphores of this rank."""

    def __init__(self, origin, name, semaphore_ids, data_sync):
        super().__init__(origin, data_sync)
        self.name = name
        self.semaphore_ids = list(semaphore_ids)

    def replicate(self, shift_index, shift_id):
        op = copy.copy(self)
        op.semaphore_ids = [shift_id(i) for i in self.semaphore_ids]
        return op

    def merge(self, nxt):
        if isinstance(nxt, Semaphore) and nxt.name == self.name:
            return Semaphore(
                self.origin, self.name, self.semaphore_ids + nxt.semaphore_ids, self.data_sync | nxt.data_sync
            )
        return None

    def to_dict(self):
        return {"name": self.name, "semaphore_ids": list(self.semaphore_ids)}


class ChannelSync(SyncingOp):
    """`signal`, `wait`, their relaxed forms, and `flush`, over channels of one type (the
    threadblock's channel indices)."""

    def __init__(self, origin, name, channel_ids, channel_type, data_sync, peers):
        super().__init__(origin, data_sync)
        self.name = name
        self.channel_ids = sorted(set(channel_ids))
        self.channel_type = channel_type
        self.peers = list(peers)  # (src_rank, dst_rank) of each call, for error messages

    def merge(self, nxt):
        if not (isinstance(nxt, ChannelSync) and nxt.name == self.name and nxt.channel_type == self.channel_type):
            return None
        # Two signals (waits) on one channel stay two ops: each must be counted by the peer.
        if self.name != "flush" and set(self.channel_ids) & set(nxt.channel_ids):
            return None
        return ChannelSync(
            self.origin,
            self.name,
            self.channel_ids + nxt.channel_ids,
            self.channel_type,
            self.data_sync | nxt.data_sync,
            self.peers + nxt.peers,
        )

    def to_dict(self):
        return {"name": self.name, "channel_ids": list(self.channel_ids), "channel_type": self.channel_type.value}


class _Moving(Op):
    """An op over local and remote ranges, with an optional threadblock-group share."""

    tbg = None  # (tb_id, tbg_size)

    def _tbg_dict(self, d):
        if self.tbg is not None:
            d["tbg_info"] = {"tb_id": self.tbg[0], "tbg_size": self.tbg[1]}
        return d


def _shift(refs, shift_index):
    return [r.moved(shift_index(r.index, r.size)) for r in refs]


class Copy(_Moving):
    """`copy`, `cpkt` (into packets) or `upkt` (out of packets), local to one rank."""

    def __init__(self, origin, name, src, dst, tbg):
        super().__init__(origin)
        self.name, self.src, self.dst, self.tbg = name, list(src), list(dst), tbg

    def accesses(self):
        # Packets carry their own flags: reading or writing them needs no threadblock sync.
        out = [] if self.name == "upkt" else _reads(self.src, self.serial)
        if self.name != "cpkt":
            out += _writes(self.dst, self.serial)
        return out

    def replicate(self, shift_index, shift_id):
        op = copy.copy(self)
        op.src, op.dst = _shift(self.src, shift_index), _shift(self.dst, shift_index)
        return op

    def to_dict(self):
        return self._tbg_dict(
            {"name": self.name, "src_buff": [r.to_dict() for r in self.src], "dst_buff": [r.to_dict() for r in self.dst]}
        )


class Transfer(_Moving):
    """`put`, `ppkt`, `rppkt`, `pws`, `pwsf` (local to remote) and `get` (remote to local)."""

    def __init__(self, origin, name, src, dst, channel_ids, channel_type, tbg):
        super().__init__(origin)
        self.name, self.src, self.dst, self.tbg = name, list(src), list(dst), tbg
        self.channel_ids = list(channel_ids)
        self.channel_type = channel_type

    def accesses(self):
        if self.name == "get":
            return _writes(self.dst, self.serial)
        if self.name == "rppkt":
            return []
        return _reads(self.src, self.serial)

    def replicate(self, shift_index, shift_id):
        op = copy.copy(self)
        op.src, op.dst = _shift(self.src, shift_index), _shift(self.dst, shift_index)
        return op

    def fuse(self, nxt):
        if not (
            isinstance(nxt, Transfer)
            and nxt.name == self.name
            and nxt.channel_type == self.channel_type
            and nxt.tbg == self.tbg
        ):
            return None
        if self.name == "rppkt":
            if nxt.src != self.src:
                return None
            src = self.src
        elif self.src[0].size == nxt.src[0].size:
            src = self.src + nxt.src
        else:
            return None
        return Transfer(
            self.origin,
            self.name,
            src,
            self.dst + nxt.dst,
            self.channel_ids + nxt.channel_ids,
            self.channel_type,
            self.tbg,
        )

    def to_dict(self):
        d = {"name": self.name, "src_buff": [r.to_dict() for r in self.src], "dst_buff": [r.to_dict() for r in self.dst]}
        # Memory-channel transfers address the peer's buffer directly; only the proxy (port
        # channels) and gets need to know the channel.
        if self.channel_type == ChannelType.port or self.name == "get":
            d["channel_ids"] = list(self.channel_ids)
        d["channel_type"] = self.channel_type.value
        return self._tbg_dict(d)


class Reduce(_Moving):
    """The reduce family. `src[0]` is the local range reduced into, `src[1:]` the other local
    sources (packets for the packet forms), `remote_src` peers' ranges read over memory
    channels; `dst` the local result, `pkt_dst` a local copy of it in packets, `remote_dst`
    peers' ranges it is sent to."""

    def __init__(self, origin, src, dst, reduce_op, tbg, packet, remote_src=(), remote_dst=(), pkt_dst=(),
                 channel_type=ChannelType.none):
        super().__init__(origin)
        self.src, self.dst, self.pkt_dst = list(src), list(dst), list(pkt_dst)
        self.remote_src, self.remote_dst = list(remote_src), list(remote_dst)
        self.reduce_op, self.tbg, self.packet = reduce_op, tbg, packet
        self.channel_type = channel_type
        self.name = self._opcode()

    def _opcode(self):
        sends = bool(self.remote_dst)
        if self.packet:
            base = "recpkt" if self.pkt_dst else "repkt"
            return {"repkt": "respkt", "recpkt": "recspkt"}[base] if sends else base
        if self.remote_src:
            return "rres" if sends else "rre"
        return "res" if sends else "re"

    def accesses(self):
        srcs = self.src[:1] if self.packet else self.src
        return _reads(srcs, self.serial) + _writes(self.dst, self.serial)

    def replicate(self, shift_index, shift_id):
        op = copy.copy(self)
        for field in ("src", "dst", "pkt_dst", "remote_src", "remote_dst"):
            setattr(op, field, _shift(getattr(self, field), shift_index))
        return op

    def _with(self, **changes):
        fields = dict(
            src=self.src, dst=self.dst, reduce_op=self.reduce_op, tbg=self.tbg, packet=self.packet,
            remote_src=self.remote_src, remote_dst=self.remote_dst, pkt_dst=self.pkt_dst,
            channel_type=self.channel_type,
        )
        fields.update(changes)
        return Reduce(self.origin, **fields)

    def fuse(self, nxt):
        if getattr(nxt, "tbg", None) != self.tbg:
            return None
        if (
            isinstance(nxt, Reduce)
            and self.name in ("re", "repkt", "rre")
            and nxt.name == self.name
            and nxt.src[0] == self.src[0]
            and nxt.dst == self.dst
            and nxt.channel_type == self.channel_type
            and nxt.reduce_op == self.reduce_op
        ):
            return self._with(src=self.src + nxt.src[1:], remote_src=self.remote_src + nxt.remote_src)
        if isinstance(nxt, Transfer) and nxt.channel_type == ChannelType.memory:
            sends_result = nxt.src[0] == self.dst[0]
            if nxt.name == "put" and not self.packet and sends_result:
                return self._with(remote_dst=self.remote_dst + nxt.dst, channel_type=ChannelType.memory)
            if nxt.name == "ppkt" and self.packet and sends_result:
                return self._with(remote_dst=self.remote_dst + nxt.dst, channel_type=ChannelType.memory)
            if nxt.name == "rppkt" and self.pkt_dst and nxt.src[0] == self.pkt_dst[0]:
                return self._with(remote_dst=self.remote_dst + nxt.dst, channel_type=ChannelType.memory)
        if (
            isinstance(nxt, Copy)
            and nxt.name == "cpkt"
            and self.name == "repkt"
            and nxt.src[0] == self.dst[0]
        ):
            return self._with(pkt_dst=nxt.dst)
        return None

    def to_dict(self):
        d = {
            "name": self.name,
            "src_buff": [r.to_dict() for r in self.src + self.remote_src],
            "dst_buff": [r.to_dict() for r in self.dst + self.pkt_dst + self.remote_dst],
        }
        if self.channel_type != ChannelType.none:
            d["channel_type"] = self.channel_type.value
        d["reduce_op"] = self.reduce_op.value
        return self._tbg_dict(d)


class SwitchReduce(Op):
    """A switch channel's load-reduce into a local chunk (`glre`). The plan format has no op for
    it alone: it must be followed by a broadcast of its result, with which it fuses (`glres`)."""

    name = "glre"

    def __init__(self, origin, buffer_type, offset, size, dst_chunk, channel_id, reduce_op, where):
        super().__init__(origin)
        self.buffer_type, self.offset, self.size = buffer_type, offset, size
        self.dst_chunk, self.channel_id, self.reduce_op = dst_chunk, channel_id, reduce_op
        self.where = where

    def replicate(self, shift_index, shift_id):
        op = copy.copy(self)
        op.offset = shift_index(self.offset, self.size)
        c = self.dst_chunk
        op.dst_chunk = Chunk(c.rank, c.buffer, shift_index(c.index, c.size), c.size)
        return op

    def fuse(self, nxt):
        if (
            isinstance(nxt, SwitchStore)
            and nxt.name == "gstore"
            and nxt.buffer_type == self.buffer_type
            and nxt.size == self.size
            and nxt.src_chunk == self.dst_chunk
            and nxt.channel_id == self.channel_id
        ):
            return SwitchReduceStore(self.origin, self.size, self.offset, nxt.offset, self.channel_id, self.reduce_op)
        return None


class SwitchStore(Op):
    """A switch channel's broadcast of a local chunk (`gstore`, `gstorepkt`)."""

    def __init__(self, origin, name, src_chunk, buffer_type, offset, size, channel_id):
        super().__init__(origin)
        self.name, self.src_chunk, self.buffer_type = name, src_chunk, buffer_type
        self.offset, self.size, self.channel_id = offset, size, channel_id

    def accesses(self):
        if self.name == "gstorepkt":
            return []
        c = self.src_chunk
        return [Access(c.buffer, c.index, c.index + c.size, "r", self.serial)]

    def replicate(self, shift_index, shift_id):
        op = copy.copy(self)
        op.offset = shift_index(self.offset, self.size)
        c = self.src_chunk
        op.src_chunk = Chunk(c.rank, c.buffer, shift_index(c.index, c.size), c.size)
        return op

    def to_dict(self):
        return {
            "name": self.name,
            "src_buff": [self.src_chunk.to_dict()],
            "dst_buff": [{"switch_channel_id": self.channel_id, "index": self.offset, "size": self.size}],
            "channel_type": "switch",
        }


class SwitchReduceStore(Op):
    """`glres`: load-reduce through a switch channel and store the result back through it."""

    name = "glres"

    def __init__(self, origin, size, src_offset, dst_offset, channel_id, reduce_op):
        super().__init__(origin)
        self.size, self.src_offset, self.dst_offset = size, src_offset, dst_offset
        self.channel_id, self.reduce_op = channel_id, reduce_op

    def replicate(self, shift_index, shift_id):
        op = copy.copy(self)
        op.src_offset = shift_index(self.src_offset, self.size)
        op.dst_offset = shift_index(self.dst_offset, self.size)
        return op

    def to_dict(self):
        ref = lambda index: {"switch_channel_id": self.channel_id, "index": index, "size": self.size}  # noqa: E731
        return {
            "name": self.name,
            "src_buff": [ref(self.src_offset)],
            "dst_buff": [ref(self.dst_offset)],
            "channel_type": "switch",
            "reduce_op": self.reduce_op.value,
        }


class Pipeline(Op):
    """The ops of one threadblock inside a `LoopIterationContext`, run once per `unit_size`
    slice of their chunks."""

    name = "pipeline"

    def __init__(self, origin, unit_size, num_chunks, ops=None):
        super().__init__(origin)
        self.unit_size, self.num_chunks = unit_size, num_chunks
        self.ops = list(ops or [])

    def edge_syncs(self):
        """Whether the first op syncs before it / the last op syncs after it."""
        out = SyncType.none
        if not self.ops:
            return out
        first, last = self.ops[0], self.ops[-1]
        if isinstance(first, (Nop, Barrier)) or (isinstance(first, SyncingOp) and first.data_sync.has(SyncType.before)):
            out |= SyncType.before
        if isinstance(last, (Nop, Barrier)) or (isinstance(last, SyncingOp) and last.data_sync.has(SyncType.after)):
            out |= SyncType.after
        return out

    def accesses(self):
        return [Access(a.buffer, a.start, a.end, a.kind, self.serial) for op in self.ops for a in op.accesses()]

    def replicate(self, shift_index, shift_id):
        op = copy.copy(self)
        op.ops = [o.replicate(shift_index, shift_id) for o in self.ops]
        return op

    def fuse(self, nxt):
        if self.edge_syncs().has(SyncType.after):
            if isinstance(nxt, Nop):
                return self
            if isinstance(nxt, SyncingOp):
                nxt.drop_sync(SyncType.before)
        return None

    def to_dict(self):
        return {
            "name": self.name,
            "iter_context": {"unit_size": self.unit_size, "num_chunks": self.num_chunks},
            "ops": [op.to_dict() for op in self.ops],
        }


def fuse_all(ops):
    """Fuses each op with the ops that follow it while they fuse (inside pipelines too)."""
    out = []
    i = 0
    while i < len(ops):
        current = ops[i]
        if isinstance(current, Pipeline):
            current.ops = fuse_all(current.ops)
        j = i + 1
        while j < len(ops):
            fused = current.fuse(ops[j])
            if fused is None:
                break
            current = fused
            j += 1
        out.append(current)
        i = j
    return out


def add_sync_nops(ops):
    """Turns each synchronising op's `data_sync` into nops before/after it."""
    out = []
    for op in ops:
        if isinstance(op, Pipeline):
            op.ops = add_sync_nops(op.ops)
        syncs = op.data_sync if isinstance(op, SyncingOp) else SyncType.none
        if syncs.has(SyncType.before):
            out.append(Nop(op.origin))
        out.append(op)
        if syncs.has(SyncType.after):
            out.append(Nop(op.origin))
    return out


def add_hazard_nops(ops):
    """Puts a nop before each op that touches a local range an earlier op of the threadblock
    wrote (or writes one it read) since the last nop or barrier: the threads of a block split
    each op's elements their own way, so only `__syncthreads` orders two ops' accesses."""
    out = []
    seen = []
    for op in ops:
        if isinstance(op, (Nop, Barrier)):
            seen = []
            out.append(op)
            continue
        if isinstance(op, Pipeline):
            op.ops = add_hazard_nops(op.ops)
        mine = op.accesses()
        if any(a.conflicts(b) for a in mine for b in seen):
            out.append(Nop(op.origin))
            seen = []
        seen.extend(mine)
        out.append(op)
    return out
