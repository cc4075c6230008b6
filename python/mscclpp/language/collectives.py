"""The collectives a program implements: each fixes the collective's name in the plan and the
number of chunks of every rank's input and output buffers."""

from .rank import BaseBuffer
from .types import BufferType, fail

__all__ = ["AllGather", "AllReduce", "AllToAll", "Collective", "ReduceScatter", "SendRecv", "TestCollective"]


def _count(name, value, least=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        fail(f"{name} must be an integer >= {least}, not {value!r}")
    return value


class Collective:
    """Base of the collectives: `num_ranks` ranks, buffers in units of `chunk_factor` chunks,
    `inplace` when the output buffer is the input buffer."""

    name = "custom"

    def __init__(self, num_ranks, chunk_factor, inplace):
        self.num_ranks = _count("num_ranks", num_ranks)
        self.chunk_factor = _count("chunk_factor", chunk_factor)
        self.inplace = bool(inplace)

    def buffer_chunks(self):
        """(input chunks, output chunks) of each rank."""
        raise NotImplementedError

    def init_buffers(self):
        n_in, n_out = self.buffer_chunks()
        return [
            {
                BufferType.input: BaseBuffer(r, BufferType.input, 0, n_in),
                BufferType.output: BaseBuffer(r, BufferType.output, 0, n_out),
            }
            for r in range(self.num_ranks)
        ]

    def describe(self):
        """What identifies the collective (for the compile cache's key)."""
        return {"class": type(self).__name__, **{k: v for k, v in sorted(vars(self).items())}}

    def __repr__(self):
        return f"{type(self).__name__}({self.num_ranks} ranks, chunk_factor {self.chunk_factor}, inplace {self.inplace})"


class TestCollective(Collective):
    """A collective of given buffer sizes (in chunks), for testing the DSL."""

    name = "test"
    __test__ = False  # not a pytest test class

    def __init__(self, num_ranks, input_size, output_size):
        super().__init__(num_ranks, 1, False)
        self.input_size = _count("input_size", input_size, 0)
        self.output_size = _count("output_size", output_size, 0)

    def buffer_chunks(self):
        return self.input_size, self.output_size


class AllGather(Collective):
    """Every rank ends with every rank's input, in rank order: input `chunk_factor` chunks,
    output `num_ranks * chunk_factor`."""

    name = "allgather"

    def buffer_chunks(self):
        return self.chunk_factor, self.num_ranks * self.chunk_factor


class AllReduce(Collective):
    """Every rank ends with the reduction of all inputs: both buffers `num_ranks * chunk_factor`."""

    name = "allreduce"

    def buffer_chunks(self):
        return self.num_ranks * self.chunk_factor, self.num_ranks * self.chunk_factor


class ReduceScatter(Collective):
    """Rank r ends with part r of the reduction: input `num_ranks * chunk_factor`, output
    `chunk_factor`."""

    name = "reducescatter"

    def buffer_chunks(self):
        return self.num_ranks * self.chunk_factor, self.chunk_factor


class AllToAll(Collective):
    """Part j of rank i's input ends as part i of rank j's output: both `num_ranks * chunk_factor`."""

    name = "alltoall"

    def buffer_chunks(self):
        return self.num_ranks * self.chunk_factor, self.num_ranks * self.chunk_factor


class SendRecv(Collective):
    """Point to point: both buffers `chunk_factor` chunks."""

    name = "sendrecv"

    def buffer_chunks(self):
        return self.chunk_factor, self.chunk_factor
