"""`LoopIterationContext`: ops that run as a pipeline over slices of their chunks."""

from . import _context, _ops
from .types import call_site, fail

__all__ = ["LoopIterationContext"]


class LoopIterationContext:
    """Inside `with LoopIterationContext(unit, num_chunks):` each threadblock's ops become one
    `pipeline` op: the executor runs them once per slice of `unit` bytes of their chunks, over
    `num_chunks` chunks, so a later op's slice overlaps an earlier op's next one."""

    def __init__(self, unit, num_chunks):
        for v, what in ((unit, "unit"), (num_chunks, "num_chunks")):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                fail(f"LoopIterationContext {what} must be a positive integer, not {v!r}")
        self.unit = unit
        self.num_chunks = num_chunks
        self.operations = []

    def __enter__(self):
        self._program = _context.current()
        self._origin = call_site()
        self._program.set_loop_context(self)
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self._program.set_loop_context(None)
        if exc_type is not None:
            return False
        pipelines = {}
        for rank, tb, op in self.operations:
            key = (rank, tb)
            if key not in pipelines:
                pipelines[key] = _ops.Pipeline(self._origin, self.unit, self.num_chunks)
            pipelines[key].ops.append(op)
        for (rank, tb), pipeline in pipelines.items():
            self._program.add_operation(rank, tb, pipeline)
        return False

    def add_operation(self, rank, tb, op):
        self.operations.append((rank, tb, op))
