"""Channels between ranks: `MemoryChannel` (peer memory mapped, GPU threads move the data),
`PortChannel` (a host proxy or DMA engine moves it; flush waits for it), `SwitchChannel`
(NVLink switch multicast over a group of ranks).

A channel belongs to its source rank (`src_rank`), which runs its ops; `dst_rank` is the peer.
A signal on the channel is met by a wait on the peer's channel back (`MemoryChannel(src, dst)`
on rank dst); the program is checked for that when it is lowered.
"""

from . import _context, _ops
from .rank import check_chunk, local_ref
from .thread_block_group import ThreadBlockGroup, threadblocks, where
from .types import BufferType, ChannelType, Chunk, ReduceOperationType, SyncType, call_site, fail

__all__ = [
    "BufferType",
    "ChannelType",
    "Chunk",
    "MemoryChannel",
    "PortChannel",
    "ReduceOperationType",
    "SwitchChannel",
    "SyncType",
    "ThreadBlockGroup",
]


class _PeerChannel:
    channel_type = ChannelType.none

    def __init__(self, dst_rank, src_rank):
        prog = _context.current()
        prog.check_rank(src_rank, "source rank")
        prog.check_rank(dst_rank, "destination rank")
        if src_rank == dst_rank:
            fail(f"a {type(self).__name__} connects two ranks; both are {src_rank} (the executor has no "
                 "channel from a rank to itself: use Rank.copy)")
        prog.check_open()
        self.src_rank = src_rank
        self.dst_rank = dst_rank
        self.channel_id = prog.ranks[src_rank].add_channel(self.channel_type, dst_rank)

    def __repr__(self):
        return f"{type(self).__name__}(rank {self.src_rank} -> rank {self.dst_rank}, id {self.channel_id})"

    def _what(self, verb, tb=None, tb_group=None):
        return f"{self!r}.{verb} on rank {self.src_rank}, {where(tb, tb_group)}"

    def _channel_index(self, prog, tb):
        return prog.ranks[self.src_rank].threadblock(tb).channel_index(self.channel_type, self.channel_id)

    def _remote_index(self, prog, tb, chunk):
        state = prog.ranks[self.src_rank]
        buffer_id = state.remote_buffer(self.dst_rank, chunk.buffer, self.channel_type)
        return state.threadblock(tb).remote_buffer_index(self.channel_type, buffer_id)

    def _sync(self, name, tb, data_sync):
        prog = _context.current()
        threadblocks(tb, None, self._what(name, tb))
        if not isinstance(data_sync, SyncType):
            fail(f"{self._what(name, tb)}: data_sync must be a SyncType, not {data_sync!r}")
        origin = call_site()
        index = self._channel_index(prog, tb)
        op = _ops.ChannelSync(origin, name, [index], self.channel_type, data_sync, [(self.src_rank, self.dst_rank)])
        prog.add_operation(self.src_rank, tb, op)
        if name in ("signal", "rlxsignal"):
            prog.register_signal(self.src_rank, self.dst_rank, self.channel_type, origin)
        elif name in ("wait", "rlxwait"):
            prog.register_wait(self.src_rank, self.dst_rank, self.channel_type, origin)

    def _check_pair(self, what, local, remote, local_is_src=True):
        """Checks a local chunk of the source rank and a remote chunk of the peer."""
        check_chunk(local, f"{what}: {'source' if local_is_src else 'destination'}")
        check_chunk(remote, f"{what}: {'destination' if local_is_src else 'source'}")
        if local.rank != self.src_rank:
            fail(f"{what}: {local} is not on the channel's own rank {self.src_rank}")
        if remote.rank != self.dst_rank:
            fail(f"{what}: {remote} is not on the channel's peer rank {self.dst_rank}")
        if local.size != remote.size:
            fail(f"{what}: {local} and {remote} differ in size")

    def _transfer(self, name, verb, dst_chunk, src_chunk, tb, tb_group):
        prog = _context.current()
        what = self._what(verb, tb, tb_group)
        if name == "get":
            self._check_pair(what, dst_chunk, src_chunk, local_is_src=False)
        else:
            self._check_pair(what, src_chunk, dst_chunk)
        if name in ("ppkt", "rppkt") and dst_chunk.buffer != BufferType.scratch:
            fail(f"{what}: the destination {dst_chunk} must be in scratch (packets live there)")
        if name == "rppkt" and src_chunk.buffer != BufferType.scratch:
            fail(f"{what}: the source {src_chunk} must be packets in scratch")
        origin = call_site()
        for t, tbg in threadblocks(tb, tb_group, what):
            index = self._channel_index(prog, t)
            if name == "get":
                remote = _ops.RemoteRef(self._remote_index(prog, t, src_chunk), src_chunk.index, src_chunk.size)
                src, dst = [remote], [local_ref(dst_chunk)]
            else:
                remote = _ops.RemoteRef(self._remote_index(prog, t, dst_chunk), dst_chunk.index, dst_chunk.size)
                src, dst = [local_ref(src_chunk)], [remote]
            prog.add_operation(self.src_rank, t, _ops.Transfer(origin, name, src, dst, [index], self.channel_type, tbg))
            if name in ("pws", "pwsf"):
                prog.register_signal(self.src_rank, self.dst_rank, self.channel_type, origin)

    def signal(self, tb, data_sync=SyncType.both):
        self._sync("signal", tb, data_sync)

    def wait(self, tb, data_sync=SyncType.both):
        self._sync("wait", tb, data_sync)

    def put(self, dst_chunk, src_chunk, tb=None, tb_group=None):
        """Writes the local `src_chunk` into the peer's `dst_chunk`."""
        self._transfer("put", "put", dst_chunk, src_chunk, tb, tb_group)

    def put_packets(self, dst_chunk, src_chunk, tb=None, tb_group=None):
        """Writes the local `src_chunk` as packets into the peer's scratch chunk `dst_chunk`."""
        self._transfer("ppkt", "put_packets", dst_chunk, src_chunk, tb, tb_group)

    def read_put_packets(self, dst_chunk, src_chunk, tb=None, tb_group=None):
        """Forwards the packets of the local scratch chunk `src_chunk` (waiting for them) into the
        peer's scratch chunk `dst_chunk`."""
        self._transfer("rppkt", "read_put_packets", dst_chunk, src_chunk, tb, tb_group)


class MemoryChannel(_PeerChannel):
    """A channel from `src_rank` to `dst_rank` over mapped peer memory."""

    channel_type = ChannelType.memory

    def signal(self, tb, data_sync=SyncType.both, relaxed=False):
        """Tells the peer that this rank's writes before it are visible (relaxed: no ordering)."""
        self._sync("rlxsignal" if relaxed else "signal", tb, data_sync)

    def wait(self, tb, data_sync=SyncType.both, relaxed=False):
        """Waits for the peer's next signal on its channel to this rank."""
        self._sync("rlxwait" if relaxed else "wait", tb, data_sync)

    def get(self, dst_chunk, src_chunk, tb=None, tb_group=None):
        """Reads the peer's `src_chunk` into the local `dst_chunk`."""
        self._transfer("get", "get", dst_chunk, src_chunk, tb, tb_group)

    def reduce(self, local_src_chunk, remote_src_chunks, tb=None, tb_group=None, local_dst_chunk=None,
               reduce_op=ReduceOperationType.sum):
        """Reduces the local `local_src_chunk` with the peer's `remote_src_chunks` (read over the
        channel) into `local_dst_chunk` (default `local_src_chunk`)."""
        prog = _context.current()
        verb = self._what("reduce", tb, tb_group)
        dst_chunk = local_src_chunk if local_dst_chunk is None else local_dst_chunk
        remotes = list(remote_src_chunks)
        if not remotes:
            fail(f"{verb}: remote_src_chunks is empty")
        for r in remotes:
            self._check_pair(verb, local_src_chunk, r)
        check_chunk(dst_chunk, f"{verb}: destination")
        if dst_chunk.rank != self.src_rank or dst_chunk.size != local_src_chunk.size:
            fail(f"{verb}: destination {dst_chunk} must be on rank {self.src_rank} and the size of {local_src_chunk}")
        if not isinstance(reduce_op, ReduceOperationType):
            fail(f"{verb}: reduce_op must be a ReduceOperationType, not {reduce_op!r}")
        origin = call_site()
        for t, tbg in threadblocks(tb, tb_group, verb):
            self._channel_index(prog, t)
            remote = [_ops.RemoteRef(self._remote_index(prog, t, r), r.index, r.size) for r in remotes]
            op = _ops.Reduce(origin, [local_ref(local_src_chunk)], [local_ref(dst_chunk)], reduce_op, tbg, False,
                             remote_src=remote, channel_type=self.channel_type)
            prog.add_operation(self.src_rank, t, op)


class PortChannel(_PeerChannel):
    """A channel from `src_rank` to `dst_rank` whose transfers a proxy (DMA/RDMA) carries out."""

    channel_type = ChannelType.port

    def flush(self, tb, data_sync=SyncType.both):
        """Waits until the channel's earlier transfers have completed."""
        self._sync("flush", tb, data_sync)

    def put(self, dst_chunk, src_chunk, tb=None, tb_group=None):
        self._transfer("put", "put", dst_chunk, src_chunk, tb, tb_group)

    def put_with_signal(self, dst_chunk, src_chunk, tb=None, tb_group=None):
        """A put followed by a signal to the peer (counted as a signal for the pairing check)."""
        self._transfer("pws", "put_with_signal", dst_chunk, src_chunk, tb, tb_group)

    def put_with_signal_and_flush(self, dst_chunk, src_chunk, tb=None, tb_group=None):
        self._transfer("pwsf", "put_with_signal_and_flush", dst_chunk, src_chunk, tb, tb_group)


class SwitchChannel:
    """A multicast channel over `rank_list` on buffers of `buffer_type`: `at_rank(r).reduce`
    reads every member's range through the switch and reduces it, `broadcast` writes a chunk to
    every member's range."""

    def __init__(self, rank_list, buffer_type):
        prog = _context.current()
        ranks = list(rank_list)
        if len(ranks) < 2 or len(set(ranks)) != len(ranks):
            fail(f"a SwitchChannel needs two or more distinct ranks, not {ranks}")
        for r in ranks:
            prog.check_rank(r)
        if not isinstance(buffer_type, BufferType):
            fail(f"SwitchChannel buffer_type must be a BufferType, not {buffer_type!r}")
        prog.check_open()
        self.rank_group = ranks
        self.buffer_type = buffer_type
        self.channel_type = ChannelType.switch
        self.channel_ids = {r: prog.ranks[r].add_switch_channel(buffer_type, ranks) for r in ranks}

    def __repr__(self):
        return f"SwitchChannel({self.rank_group}, {self.buffer_type.label})"

    def at_rank(self, rank):
        if rank not in self.rank_group:
            fail(f"rank {rank} is not in {self!r}")
        return SwitchChannel.SwitchChannelRankView(self, rank)

    def _check_range(self, prog, verb, rank, offset, size):
        for v, what in ((offset, "buffer_offset"), (size, "size")):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                fail(f"{self!r}.{verb} on rank {rank}: {what} {v!r} is not a non-negative integer")
        if size == 0:
            fail(f"{self!r}.{verb} on rank {rank}: size is 0")
        for r in self.rank_group:
            have = prog.ranks[r].chunks[self.buffer_type]
            if offset + size > have:
                fail(f"{self!r}.{verb} on rank {rank}: range [{offset}:{offset + size}] is outside rank {r}'s "
                     f"{self.buffer_type.label} buffer of {have} chunks")

    def _local_chunk(self, verb, rank, chunk, size, what):
        check_chunk(chunk, f"{self!r}.{verb}: {what}")
        if chunk.rank != rank:
            fail(f"{self!r}.{verb} on rank {rank}: {what} {chunk} is not on rank {rank}")
        if chunk.size != size:
            fail(f"{self!r}.{verb} on rank {rank}: {what} {chunk} is not {size} chunks")

    def reduce(self, rank, buffer_offset, size, dst_chunk, tb, reduce_op=ReduceOperationType.sum):
        prog = _context.current()
        self._check_range(prog, "reduce", rank, buffer_offset, size)
        self._local_chunk("reduce", rank, dst_chunk, size, "destination")
        threadblocks(tb, None, f"{self!r}.reduce on rank {rank}")
        origin = call_site()
        index = prog.ranks[rank].threadblock(tb).channel_index(ChannelType.switch, self.channel_ids[rank])
        where = f"{self!r}.reduce on rank {rank}, threadblock {tb}"
        op = _ops.SwitchReduce(origin, self.buffer_type, buffer_offset, size, dst_chunk, index, reduce_op, where)
        prog.add_operation(rank, tb, op)

    def _store(self, name, verb, rank, src_chunk, buffer_offset, size, tb):
        prog = _context.current()
        self._check_range(prog, verb, rank, buffer_offset, size)
        self._local_chunk(verb, rank, src_chunk, size, "source")
        if name == "gstorepkt" and (src_chunk.buffer != BufferType.scratch or self.buffer_type != BufferType.scratch):
            fail(f"{self!r}.{verb} on rank {rank}: packets go from scratch to scratch ({src_chunk})")
        threadblocks(tb, None, f"{self!r}.{verb} on rank {rank}")
        origin = call_site()
        index = prog.ranks[rank].threadblock(tb).channel_index(ChannelType.switch, self.channel_ids[rank])
        prog.add_operation(rank, tb, _ops.SwitchStore(origin, name, src_chunk, self.buffer_type, buffer_offset,
                                                      size, index))

    def broadcast(self, rank, src_chunk, buffer_offset, size, tb):
        self._store("gstore", "broadcast", rank, src_chunk, buffer_offset, size, tb)

    def broadcast_packets(self, rank, src_chunk, buffer_offset, size, tb):
        self._store("gstorepkt", "broadcast_packets", rank, src_chunk, buffer_offset, size, tb)

    class SwitchChannelRankView:
        """The channel as seen from one of its ranks."""

        def __init__(self, channel, rank):
            self._channel = channel
            self._rank = rank

        def reduce(self, buffer_offset, size, dst_chunk, tb, reduce_op=ReduceOperationType.sum):
            return self._channel.reduce(self._rank, buffer_offset, size, dst_chunk, tb, reduce_op)

        def broadcast(self, src_chunk, buffer_offset, size, tb):
            return self._channel.broadcast(self._rank, src_chunk, buffer_offset, size, tb)

        def broadcast_packets(self, src_chunk, buffer_offset, size, tb):
            return self._channel.broadcast_packets(self._rank, src_chunk, buffer_offset, size, tb)
