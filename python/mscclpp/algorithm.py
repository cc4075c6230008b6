"""Algorithms the MSCCL++ way: `AlgorithmCollectionBuilder().build_default_algorithms(...)` gives
a collection of `Algorithm`s with `.name`, `.collective` and `.execute(comm, ...)`.

MSCCL++ builds its default algorithms before any communicator is known and sets each up on its
first `execute`; the runtime builds algorithms for a communicator. So an `Algorithm` here is a
name, and the collection builds the runtime's algorithms for a communicator the first time any of
them runs on it (collective: every rank makes the same first call, so every rank builds at the same
point), then reuses them.

An execution plan becomes an algorithm as in MSCCL++: `Algorithm(execution_plan=plan)` (a "DSL
algorithm", run by an `Executor`). Added to a builder (`add_algorithm_builder`), it joins the
collection, whose default selector prefers it for the calls it covers (collective, world size,
message size) and whose own executor runs it when `execute` is given none.

`Algorithm.execute` returns MSCCL++'s `CommResult` code, as MSCCL++'s does: `COMM_SUCCESS` (0)
once the collective is enqueued, and `COMM_INVALID_ARGUMENT` (4) when the algorithm cannot run with
the `nblocks`/`nthreads_per_block` asked for on this device (e.g. more blocks than can be resident
at once, or threads not a multiple of 32 up to 1024): nothing is enqueued and another shape may
run, so a tuning loop can `continue` past it (the limits follow the device and the rank's share
of it, so ranks on alike shares decide alike). Every other failure raises: bad buffers, sizes or
arguments (`ValueError`), a type or op the algorithm does not support, an aborted communicator or
a failed peer (`MscclppError`), a device-side timeout (`TimeoutError`). Execution plans run
with their own launch shape and ignore `nblocks`/`nthreads_per_block`, so for them any shape
returns 0.
"""

from collections import namedtuple

from . import _mscclpp
from . import _shim
from ._teardown import track
from ._types import CommResult, DataType, ReduceOp

CollectiveRequest = namedtuple(
    "CollectiveRequest",
    "collective message_size dtype world_size rank stream symmetric_memory in_place "
    "nranks_per_node",
    defaults=(False, None),
)


def _native_comm(comm):
    """The native communicator of `comm`, which may be a CommGroup or its `.communicator`."""
    native = getattr(comm, "communicator", comm)
    if not isinstance(native, _mscclpp.Communicator):
        raise TypeError(
            f"comm must be an mscclpp Communicator or CommGroup, not {type(comm).__name__}"
        )
    return native


def _runtime_dtype(dtype):
    if isinstance(dtype, DataType):
        return dtype.value
    raise TypeError(f"dtype must be an mscclpp.DataType, not {dtype!r}")


class Algorithm:
    """One algorithm: a native one of a collection (see AlgorithmCollectionBuilder), or, built with
    `Algorithm(execution_plan=mscclpp.ExecutionPlan(path))`, an execution plan run by an Executor
    (MSCCL++'s DSL algorithm; `id` and `tags` are kept for selectors)."""

    def __init__(self, id=None, execution_plan=None, tags=None, constraint=None):
        if not isinstance(execution_plan, _mscclpp.ExecutionPlan):
            raise TypeError(
                "Algorithm(...) makes a DSL algorithm from execution_plan=mscclpp.ExecutionPlan(path); "
                "native algorithms come from AlgorithmCollectionBuilder"
            )
        self._set(None, execution_plan.name, execution_plan.collective, execution_plan)
        self.id = execution_plan.name if id is None else id
        self.tags = dict(tags or {})
        self.constraint = constraint

    @classmethod
    def _of_collection(cls, collection, name, collective, plan=None):
        algo = cls.__new__(cls)
        algo._set(collection, name, collective, plan)
        return algo

    def _set(self, collection, name, collective, plan):
        self._collection = collection
        self.name = name
        self.collective = collective
        self.execution_plan = plan
        self.id, self.tags, self.constraint = name, {}, None

    def __repr__(self):
        return f"Algorithm({self.name!r}, {self.collective!r})"

    def is_dsl_algorithm(self):
        """Whether this is an execution plan (run by an Executor)."""
        return self.execution_plan is not None

    def is_native_algorithm(self):
        return self.execution_plan is None

    @property
    def message_size_range(self):
        """`(min, max)` input bytes per rank this algorithm runs with: for a plan, its range capped
        by the scratch and staging its set-up gets (`ExecutionPlan.runnable_message_size_range`;
        a call outside it is refused), any size for native algorithms."""
        if self.execution_plan is None:
            return (0, 2**64 - 1)
        return self.execution_plan.runnable_message_size_range

    def execute(
        self,
        comm,
        input_buffer,
        output_buffer,
        input_size,
        output_size,
        dtype,
        op=ReduceOp.NOP,
        stream=0,
        executor=None,
        nblocks=0,
        nthreads_per_block=0,
        symmetric_memory=False,
        accum_dtype=None,
        extras=None,
    ):
        """Enqueues the collective on `stream` (an int handle: `torch.cuda.current_stream().cuda_stream`).

        Buffers are device addresses (`tensor.data_ptr()`), sizes in bytes. Returns without
        waiting for the GPU, so it can be captured into a CUDA graph (an execution plan after its
        first run). `executor` runs execution plans (default: the collection's own for this
        communicator); native algorithms take none. A plan applies its own reduction (`op` NOP)
        and thread-block geometry (`nblocks`/`nthreads_per_block` ignored). `extras` is for
        algorithms that take extra pointers, which the default ones do not. `symmetric_memory`
        is a hint for selectors. Returns a `CommResult`: `COMM_SUCCESS` (0), or
        `COMM_INVALID_ARGUMENT` for an `nblocks`/`nthreads_per_block` this algorithm cannot run
        with here (nothing enqueued); every other failure raises (see the module docs).
        """
        if executor is not None and self.execution_plan is None:
            raise TypeError(f"{self.name} is a native algorithm: it takes no executor")
        native = _native_comm(comm)
        op = ReduceOp(op)
        args = (native, int(input_buffer), int(output_buffer), int(input_size), int(output_size),
                dtype, op, int(stream))
        if self.execution_plan is not None:
            return self._run_plan(*args, executor, accum_dtype, extras or {})
        if op == ReduceOp.NOP and self.collective in ("allreduce", "reducescatter"):
            raise ValueError(f"{self.name} reduces: op must not be ReduceOp.NOP")
        return self._launch(*args, int(nblocks), int(nthreads_per_block), accum_dtype, extras or {})

    def _run_plan(self, native, input_buffer, output_buffer, input_size, output_size, dtype, op,
                  stream, executor, accum_dtype, extras):
        if extras or accum_dtype is not None:
            raise ValueError(f"{self.name} is an execution plan: it takes no extras or accum_dtype")
        if executor is not None:
            runner = getattr(executor, "_native", None)
            if not isinstance(runner, _mscclpp.NativeExecutor):
                raise TypeError(f"executor must be an mscclpp.Executor, not {type(executor).__name__}")
        elif self._collection is not None:
            runner = self._collection._executor(native, stream)
        else:
            runner = self._own_executor(native)
        runner.execute(
            native.rank, input_buffer, output_buffer, input_size, output_size,
            _runtime_dtype(dtype), self.execution_plan, stream, "LL16",
            None if op == ReduceOp.NOP else op.value,
        )
        return CommResult.COMM_SUCCESS

    def _own_executor(self, native):
        """The executor this plan runs on when no executor or collection is given (one per
        communicator, made on the plan's first run there, which is collective like any plan's
        first run)."""
        if getattr(self, "_executors", None) is None:
            self._executors = {}
            track(self)
        entry = self._executors.get(id(native))
        if entry is None or entry[0] is not native:
            entry = (native, _mscclpp.NativeExecutor(native))
            self._executors[id(native)] = entry
        return entry[1]

    def _close(self):
        self._executors = {}

    def _launch(self, native, input_buffer, output_buffer, input_size, output_size, dtype, op,
                stream, nblocks, nthreads_per_block, accum_dtype, extras):
        if extras:
            raise ValueError(f"{self.name} takes no extras (got {sorted(extras)})")
        algo = self._collection._native(native, self, stream)
        return CommResult(algo.execute(
            native, input_buffer, output_buffer, input_size, output_size,
            _runtime_dtype(dtype),
            "sum" if op == ReduceOp.NOP else op.value,  # ignored by collectives that do not reduce
            stream, nblocks, nthreads_per_block,
            None if accum_dtype is None else _runtime_dtype(accum_dtype),
        ))

    def reset(self):
        """MSCCL++ frees an algorithm's per-buffer contexts here. The runtime keeps them with the
        collection (freed when it is), so there is nothing to free early; kept so programs
        written for MSCCL++ run unchanged."""


class CustomAlgorithm(Algorithm):
    """An algorithm whose launch is written in Python, typically over a kernel compiled with
    `mscclpp.compile_native` and channels from `Communicator.memory_channels`.

    `launch(comm, input_buffer, output_buffer, input_size, output_size, dtype, op, stream,
    nblocks, nthreads_per_block, extras)` enqueues the work (comm is the native Communicator);
    `execute` checks its arguments as for every algorithm, calls it and returns what it returns
    (a `CommResult` code, e.g. `COMM_INVALID_ARGUMENT` for a launch shape it cannot run), or
    `COMM_SUCCESS` where it returns None.
    """

    def __init__(self, name, collective, launch):
        self._set(None, name, collective, None)
        self._user_launch = launch

    def _launch(self, native, input_buffer, output_buffer, input_size, output_size, dtype, op,
                stream, nblocks, nthreads_per_block, accum_dtype, extras):
        if accum_dtype is not None:
            raise ValueError(f"{self.name} takes no accum_dtype")
        rc = self._user_launch(native, input_buffer, output_buffer, input_size, output_size,
                               dtype, op, stream, nblocks, nthreads_per_block, extras)
        return CommResult.COMM_SUCCESS if rc is None else rc


class AlgorithmCollection:
    """The algorithms of a builder, iterable, plus selection and tuning."""

    def __init__(self, names, scratch_bytes, rank, selector=None, plans=(), defaults=True):
        self._algorithms = [Algorithm._of_collection(self, n, c) for n, c in names]
        for p in plans:
            algo = Algorithm._of_collection(self, p.name, p.collective, p.execution_plan)
            algo.id, algo.tags = p.id, dict(p.tags)
            self._algorithms.append(algo)
        self._plans = [p.execution_plan for p in plans]
        self._defaults = defaults
        self._scratch_bytes = scratch_bytes
        self._rank = rank
        self._selector = selector
        self._tuning = None
        # id(native communicator) -> (communicator, collection, by name, executor of its plans)
        self._built = {}
        track(self)

    def __iter__(self):
        return iter(self._algorithms)

    def __len__(self):
        return len(self._algorithms)

    def by_collective(self):
        """`{collective: {name: Algorithm}}`, what a selector is handed."""
        out = {}
        for a in self._algorithms:
            out.setdefault(a.collective, {})[a.name] = a
        return out

    def native_collection(self, comm, stream=0):
        """The runtime's collection for `comm` (built on first use; collective; refused while
        `stream` is being captured into a CUDA graph)."""
        native = _native_comm(comm)
        if self._rank is not None and native.rank != self._rank:
            raise ValueError(
                f"the algorithms were built for rank {self._rank}, the communicator is rank {native.rank}"
            )
        entry = self._built.get(id(native))
        if entry is None:
            executor = _mscclpp.NativeExecutor(native)
            collection = _mscclpp.NativeAlgorithmCollection.build_default(
                native, self._scratch_bytes, stream, self._plans, executor, self._defaults
            )
            by_name = {(a.collective, a.name): a for a in collection.algorithms()}
            # Algorithms only some machines build (NVLS, behind its gate) join the list now.
            known = {(a.collective, a.name) for a in self._algorithms}
            self._algorithms += [
                Algorithm._of_collection(self, n, c) for c, n in by_name if (c, n) not in known
            ]
            # The communicator is kept so its id cannot be reused while the entry lives.
            entry = (native, collection, by_name, executor)
            self._built[id(native)] = entry
        return entry[1]

    def _native(self, native, algorithm, stream):
        self.native_collection(native, stream)
        found = self._built[id(native)][2].get((algorithm.collective, algorithm.name))
        if found is None:
            raise ValueError(f"{algorithm.name} is not available on this machine")
        return found

    def _executor(self, native, stream):
        """The executor that runs this collection's plans on `native` (built with the collection)."""
        self.native_collection(native, stream)
        return self._built[id(native)][3]

    def select(self, comm, collective, message_size, dtype, stream=0, symmetric_memory=False,
               in_place=False):
        """The Algorithm for a call: the user selector's answer if it gives one, else the tuning
        table's (see `load_tuning`), else the runtime's default selector. `in_place`: the call's
        buffers are in place (MSCCL++'s meaning: all-gather input = this rank's slice of the
        output, reduce-scatter output = this rank's slice of the input, else input = output);
        execution plans are chosen only for calls of their buffer mode."""
        native = _native_comm(comm)
        if self._selector is not None:
            request = CollectiveRequest(
                collective, message_size, dtype, native.size, native.rank, stream, symmetric_memory,
                in_place, native.nranks_per_node,
            )
            chosen = self._selector(self.by_collective(), request)
            if chosen is not None:
                return chosen
        name = None
        if self._tuning is not None:
            hit = self._tuning.lookup(collective, _runtime_dtype(dtype), native.size, message_size)
            name = hit and hit[0]
        if name is None:
            name = self.native_collection(native, stream).select(
                collective, message_size, _runtime_dtype(dtype), stream, symmetric_memory, in_place
            ).name
        return self.by_collective()[collective][name]

    def tune(self, comm, collective, dtype, sizes, algorithms=None, nblocks=(0,),
             nthreads_per_block=(0,), iters=20):
        """Collective: the in-library tuner (CUDA graphs, every candidate checked); returns a
        TuningTable (`.to_yaml()`, `.save_yaml(path)`, `.entries()`)."""
        return self.native_collection(comm).tune(
            collective, _runtime_dtype(dtype), list(sizes), algorithms, list(nblocks),
            list(nthreads_per_block), iters,
        )

    def load_tuning(self, table):
        """Makes `select` follow `table` (a TuningTable, or a YAML path) where it has an entry."""
        if not isinstance(table, _mscclpp.TuningTable):
            table = _mscclpp.TuningTable.load_yaml(str(table))
        self._tuning = table

    def _close(self):
        self._built.clear()


class AlgorithmCollectionBuilder:
    """Builds an AlgorithmCollection: the default algorithms and the execution plans added."""

    def __init__(self):
        self._selector = None
        self._plans = []
        self._shared = None

    def set_algorithm_selector(self, selector):
        """`selector(algorithms_by_collective, request) -> Algorithm or None` (None: default).
        Where the NCCL shim is loaded in this process it becomes the shim's selector too, asked
        before each of its collectives with this builder's algorithms (`_shim.share_selector`)."""
        self._selector = selector
        _shim.share_selector(selector, self._shared_algorithms)

    def _shared_algorithms(self):
        """`{collective: {name: Algorithm}}` of the default algorithms and the plans added, as
        the shim's selector is handed them (rebuilt only when a plan was added)."""
        if self._shared is None or self._shared[0] != len(self._plans):
            view = AlgorithmCollection(_mscclpp.default_algorithm_names(), 0, None, None,
                                       list(self._plans))
            self._shared = (len(self._plans), view.by_collective())
        return self._shared[1]

    def add_algorithm_builder(self, algorithm_builder):
        """Adds an execution plan (`Algorithm(execution_plan=...)`) to the collections built
        after this call, and, where the NCCL shim is loaded in this process, to the communicators
        it creates after this call (`_shim.share_plan`; every rank must add the same plans)."""
        if not (isinstance(algorithm_builder, Algorithm) and algorithm_builder.is_dsl_algorithm()):
            raise ValueError(
                "add_algorithm_builder takes a DSL algorithm: "
                "mscclpp.Algorithm(execution_plan=mscclpp.ExecutionPlan(path))"
            )
        _shim.share_plan(algorithm_builder.execution_plan)
        self._plans.append(algorithm_builder)

    def build(self):
        """A collection of the added execution plans alone (no default algorithms)."""
        return AlgorithmCollection([], 0, None, self._selector, list(self._plans), defaults=False)

    def build_default_algorithms(self, scratch_buffer=0, scratch_buffer_size=0, rank=None):
        """The default algorithms, plus the execution plans added (MSCCL++ adds those only in
        `build`; here the default selector prefers a plan for the calls it covers). Until the
        runtime takes a caller's scratch, each scratch-staged algorithm keeps its own of
        min(scratch_buffer_size, DEFAULT_SCRATCH_BYTES) bytes (the default when 0) and
        `scratch_buffer` is only kept alive by the caller."""
        limit = _mscclpp.DEFAULT_SCRATCH_BYTES
        scratch = min(int(scratch_buffer_size), limit) if scratch_buffer_size else limit
        return AlgorithmCollection(
            _mscclpp.default_algorithm_names(), scratch, rank, self._selector, list(self._plans)
        )
