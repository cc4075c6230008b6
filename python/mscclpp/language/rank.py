"""A rank's local side: `Rank` (its buffers, local copies and reduces, barriers), buffers and
their chunks (`BaseBuffer`, scratch `Buffer`), and `Semaphore`s between its threadblocks."""

from . import _context, _ops
from .thread_block_group import ThreadBlockGroup, threadblocks, where
from .types import BufferType, Chunk, ReduceOperationType, SyncType, call_site, fail

__all__ = [
    "BaseBuffer",
    "Buffer",
    "BufferType",
    "Chunk",
    "Rank",
    "ReduceOperationType",
    "Semaphore",
    "SyncType",
    "ThreadBlockGroup",
]


def check_chunk(chunk, what):
    if not isinstance(chunk, Chunk):
        fail(f"{what} must be a chunk (a slice of a buffer, e.g. buffer[0:1]), not {chunk!r}")
    return chunk


def local_ref(chunk):
    return _ops.Ref(chunk.buffer, chunk.index, chunk.size)


class Rank:
    """One rank of the program: `Rank(r)` for r in 0..num_ranks-1."""

    def __init__(self, rank):
        self.rank = _context.current().check_rank(rank)

    def __repr__(self):
        return f"Rank({self.rank})"

    def get_input_buffer(self):
        return _context.current().buffers[self.rank][BufferType.input]

    def get_output_buffer(self):
        return _context.current().buffers[self.rank][BufferType.output]

    def _local(self, chunk, what):
        check_chunk(chunk, what)
        if chunk.rank != self.rank:
            fail(f"{what} {chunk} is not on rank {self.rank}")
        return chunk

    def _copy(self, dst_chunk, src_chunk, tb, tb_group, name, verb):
        prog = _context.current()
        verb = f"{verb} on rank {self.rank}, {where(tb, tb_group)}"
        dst = self._local(dst_chunk, f"{verb}: destination")
        src = self._local(src_chunk, f"{verb}: source")
        if dst.size != src.size:
            fail(f"{verb}: destination {dst} and source {src} differ in size")
        if name == "upkt" and src.buffer != BufferType.scratch:
            fail(f"{verb}: the source {src} must be in scratch (packets live there)")
        if name == "cpkt" and dst.buffer != BufferType.scratch:
            fail(f"{verb}: the destination {dst} must be in scratch (packets live there)")
        origin = call_site()
        for t, tbg in threadblocks(tb, tb_group, verb):
            prog.add_operation(self.rank, t, _ops.Copy(origin, name, [local_ref(src)], [local_ref(dst)], tbg))

    def copy(self, dst_chunk, src_chunk, tb=None, tb_group=None):
        """Copies `src_chunk` to `dst_chunk` (both on this rank)."""
        self._copy(dst_chunk, src_chunk, tb, tb_group, "copy", "copy")

    def copy_packets(self, dst_chunk, src_chunk, tb=None, tb_group=None):
        """Copies `src_chunk` into packets in the scratch chunk `dst_chunk`."""
        self._copy(dst_chunk, src_chunk, tb, tb_group, "cpkt", "copy_packets")

    def unpack_packets(self, dst_chunk, src_chunk, tb=None, tb_group=None):
        """Waits for the packets of the scratch chunk `src_chunk` and copies their data to `dst_chunk`."""
        self._copy(dst_chunk, src_chunk, tb, tb_group, "upkt", "unpack_packets")

    def reduce(self, src_chunk, other_chunks, tb=None, tb_group=None, dst_chunk=None,
               reduce_op=ReduceOperationType.sum, packet=False):
        """Reduces `src_chunk` with `other_chunks` (all on this rank) into `dst_chunk` (default
        `src_chunk`); with `packet=True` the other chunks are packets in scratch."""
        prog = _context.current()
        verb = f"reduce on rank {self.rank}, {where(tb, tb_group)}"
        src = self._local(src_chunk, f"{verb}: source")
        dst = self._local(dst_chunk if dst_chunk is not None else src_chunk, f"{verb}: destination")
        if not isinstance(reduce_op, ReduceOperationType):
            fail(f"{verb}: reduce_op must be a ReduceOperationType, not {reduce_op!r}")
        others = list(other_chunks)
        if not others:
            fail(f"{verb}: other_chunks is empty (nothing to reduce {src} with)")
        for c in others:
            self._local(c, f"{verb}: other chunk")
            if c.size != src.size:
                fail(f"{verb}: other chunk {c} and source {src} differ in size")
            if packet and c.buffer != BufferType.scratch:
                fail(f"{verb}: with packet=True the other chunk {c} must be in scratch")
        if dst.size != src.size:
            fail(f"{verb}: destination {dst} and source {src} differ in size")
        origin = call_site()
        for t, tbg in threadblocks(tb, tb_group, verb):
            op = _ops.Reduce(origin, [local_ref(src)] + [local_ref(c) for c in others], [local_ref(dst)],
                             reduce_op, tbg, bool(packet))
            prog.add_operation(self.rank, t, op)

    def barrier(self, tb_list):
        """Syncs threadblocks `tb_list` of this rank (one block: a `__syncthreads`)."""
        prog = _context.current()
        tbs = list(tb_list)
        if not tbs:
            fail(f"barrier on rank {self.rank}: tb_list is empty")
        ThreadBlockGroup(tbs)  # checks the ids
        origin = call_site()
        if len(tbs) == 1:
            prog.add_operation(self.rank, tbs[0], _ops.Nop(origin))
            return
        barrier_id = prog.ranks[self.rank].barrier_id(tbs)
        for t in tbs:
            prog.add_operation(self.rank, t, _ops.Barrier(origin, barrier_id, len(tbs)))


class BaseBuffer:
    """One buffer of one rank, `size` chunks from `offset`; slicing it (`buf[a:b]`) gives a
    Chunk of chunks a..b-1 counted from `offset`."""

    def __init__(self, rank, buffer_type, offset, size):
        self.rank = rank
        self.buffer_type = buffer_type
        self.offset = offset
        self.size = size

    def __len__(self):
        return self.size

    def __repr__(self):
        return f"{self.buffer_type.label} buffer of rank {self.rank} ({self.size} chunks from {self.offset})"

    def __getitem__(self, key):
        if not isinstance(key, slice):
            fail(f"{self!r}: index it with a slice (buf[a:b]), not {key!r}")
        if key.step not in (None, 1):
            fail(f"{self!r}: slices with a step ({key}) are not chunks")
        start = 0 if key.start is None else key.start
        stop = self.size if key.stop is None else key.stop
        for v in (start, stop):
            if isinstance(v, bool) or not isinstance(v, int):
                fail(f"{self!r}: slice bounds must be integers, not {v!r}")
        if not 0 <= start < stop <= self.size:
            fail(f"{self!r}: slice [{start}:{stop}] is empty or outside 0..{self.size}")
        return Chunk(self.rank, self.buffer_type, self.offset + start, stop - start)


class Buffer(BaseBuffer):
    """A scratch buffer of `size` chunks on `rank`, placed after the rank's earlier ones."""

    def __init__(self, rank, size):
        prog = _context.current()
        prog.check_rank(rank)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            fail(f"Buffer on rank {rank}: size must be a positive number of chunks, not {size!r}")
        prog.check_open()
        state = prog.ranks[rank]
        super().__init__(rank, BufferType.scratch, state.chunks[BufferType.scratch], size)
        state.chunks[BufferType.scratch] += size


class Semaphore:
    """A semaphore of `rank`, between its threadblocks: `release` adds one, `acquire` waits for a
    positive value and takes one."""

    def __init__(self, rank, initial_value):
        prog = _context.current()
        prog.check_rank(rank)
        if isinstance(initial_value, bool) or not isinstance(initial_value, int) or initial_value < 0:
            fail(f"Semaphore on rank {rank}: initial_value must be a non-negative integer, not {initial_value!r}")
        prog.check_open()
        state = prog.ranks[rank]
        self.rank = rank
        self.initial_value = initial_value
        self.id = len(state.semaphores)
        state.semaphores.append(initial_value)

    def _op(self, name, tb, data_sync):
        prog = _context.current()
        threadblocks(tb, None, f"{name} of semaphore {self.id} on rank {self.rank}")
        if not isinstance(data_sync, SyncType):
            fail(f"data_sync must be a SyncType, not {data_sync!r}")
        prog.add_operation(self.rank, tb, _ops.Semaphore(call_site(), name, [self.id], data_sync))

    def acquire(self, tb, data_sync=SyncType.both):
        self._op("sem_acquire", tb, data_sync)

    def release(self, tb, data_sync=SyncType.both):
        self._op("sem_release", tb, data_sync)


