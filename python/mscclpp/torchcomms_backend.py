"""The TorchComms backend "mscclpp": `torchcomms.new_comm("mscclpp", device, name=...)` on the
mscclpp-rs runtime, written against torchcomms' Python backend protocol (torchcomms >= 0.3).

`MscclppBackendMethods` holds the whole backend; `backend_class(base)` makes the class torchcomms
instantiates, a subclass of `torchcomms.TorchCommBackend` (`mscclpp_torchcomms` does that and
registers it). Every collective runs on `mscclpp.CommSession`, the native entry point the NCCL shim
uses too, so a call means the same through TorchComms and through `libmscclpp_nccl.so`.

Semantics (docs/torchcomms.md has the table of operations):
  - `async_op=False` enqueues on the caller's current stream and returns None (torchcomms turns
    that into a completed work); `async_op=True` enqueues on the backend's own stream after
    waiting for the current one, keeps the tensors alive (and tells the caching allocator they are
    in use there), and returns an `MscclppWork` whose `wait()` makes the current stream wait on an
    event (from the backend's pool) and whose `is_completed()` polls it.
  - Neither waits on the host, so both can be captured into a CUDA graph.
  - A tensor that is not contiguous, not on the communicator's device, or of a type the runtime
    has no name for is refused with a ValueError naming the operation, the argument and the fix:
    nothing is copied behind the caller's back.
  - Work not completed within the communicator's timeout (CommOptions.timeout, `set_timeout`)
    aborts the communicator and raises TimeoutError naming the operation, the rank and the
    communicator; so does a device-side error the runtime recorded (naming what the runtime
    names). `abort()` is `Communicator::abort`.

The pure-Python parts (rank and size from the environment, the store bootstrap, argument checks)
need neither torch nor a GPU, so they are tested on CPU machines.
"""

import os
import sys
import threading
import time
from datetime import timedelta

from . import _mscclpp
from .utils import torch_dtype_to_mscclpp_dtype

BACKEND_NAME = "mscclpp"
# The torchcomms release whose Python backend protocol this backend implements.
TORCHCOMMS_PROTOCOL_VERSION = "0.3"
# Store keys: prefix, communicator name and how many communicators of that name this process made
# before, joined by the separator (the count keeps a name used again, after a finalize, apart).
STORE_KEY_PREFIX = "mscclpp_torchcomms"
STORE_KEY_SEPARATOR = "/"
DEFAULT_TIMEOUT = timedelta(seconds=600)
# CommOptions.hints keys this backend reads.
HINT_ACCUM_DTYPE = "mscclpp.accum_dtype"
# torchcomms' own hint names, as its NCCL backend reads them.
HINT_HIGH_PRIORITY_STREAM = "is_high_priority_stream"
HINT_MAX_EVENT_POOL_SIZE = "max_event_pool_size"
DEFAULT_MAX_EVENT_POOL_SIZE = 1000

_REDUCE_OPS = {"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max", "AVG": "avg"}
_BITWISE_OPS = ("BAND", "BOR", "BXOR")
_ACCUM_DTYPES = {"float32": "f32", "float": "f32", "f32": "f32", "float16": "f16",
                 "half": "f16", "f16": "f16", "auto": None}


# ---- rank and size (torchcomms' rules) -------------------------------------------------------

def query_rank_size(environ=None):
    """(rank, size) as torchcomms finds them: TORCHCOMM_RANK/TORCHCOMM_SIZE, else, as
    TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD allows (auto, mpi, pals, torchrun; default auto),
    Open MPI's, MPICH's, PALS' and torchrun's variables in that order."""
    env = os.environ if environ is None else environ

    def number(name):
        value = env.get(name, "").strip()
        if not value:
            return -1
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer") from None

    def pair(rank_var, size):
        rank = number(rank_var)
        return (rank, size) if rank >= 0 and size > 0 else None

    method = env.get("TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD", "auto").strip().lower()
    if method not in ("auto", "mpi", "pals", "torchrun"):
        raise ValueError(
            f"TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD={method!r} (expected auto, mpi, pals or torchrun)"
        )
    found = pair("TORCHCOMM_RANK", number("TORCHCOMM_SIZE"))
    if found is None and method in ("auto", "mpi"):
        found = pair("OMPI_COMM_WORLD_RANK", number("OMPI_COMM_WORLD_SIZE")) or pair(
            "PMI_RANK", number("PMI_SIZE")
        )
    if found is None and method in ("auto", "pals"):
        size = next((s for s in map(number, ("PALS_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                             "WORLD_SIZE")) if s > 0), -1)
        found = pair("PALS_RANKID", size)
    if found is None and method in ("auto", "torchrun"):
        found = pair("RANK", number("WORLD_SIZE"))
    if found is None:
        raise RuntimeError(
            "mscclpp: cannot tell this process's rank and the world size: set TORCHCOMM_RANK and "
            "TORCHCOMM_SIZE, or run under torchrun, mpirun or PALS"
        )
    rank, size = found
    if rank >= size:
        raise ValueError(f"mscclpp: rank {rank} is not below the world size {size}")
    return found


# ---- bootstrap through a c10d store ----------------------------------------------------------

_names_used = {}
_names_lock = threading.Lock()


def store_key(name):
    """The store key of this process's next communicator named `name` (every rank of a
    communicator makes the same sequence of communicators of that name, so they agree)."""
    with _names_lock:
        count = _names_used.get(name, 0)
        _names_used[name] = count + 1
    return STORE_KEY_SEPARATOR.join((STORE_KEY_PREFIX, name, str(count)))


def _seconds(timeout):
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


def exchange_unique_id(store, key, rank, timeout):
    """Rank 0 makes the job's UniqueId and publishes it under `key`; the others wait for it (up
    to `timeout`) and read it. `store` is a c10d Store (set/get/wait)."""
    if rank == 0:
        uid = _mscclpp.TcpBootstrap.create_unique_id()
        store.set(key, uid)
        return uid
    try:
        store.wait([key], timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout))
    except Exception as e:  # the store's own timeout type differs between torch versions
        raise TimeoutError(
            f"mscclpp: rank {rank} waited {_seconds(timeout):.0f} s for rank 0 to publish the job id "
            f"under store key {key!r}: {e}"
        ) from e
    return bytes(store.get(key))


def bootstrap(store, name, rank, size, timeout):
    """The TCP bootstrap of communicator `name`, its job id exchanged through `store`."""
    uid = exchange_unique_id(store, store_key(name), rank, timeout)
    return _mscclpp.TcpBootstrap.from_unique_id(uid, rank, size)


_env_stores = {}


def env_store(rank, size, timeout, environ=None):
    """The MASTER_ADDR/MASTER_PORT TCPStore, made once per process: under torchrun its agent's
    store (TORCHELASTIC_USE_AGENT_STORE), else hosted by rank 0."""
    env = os.environ if environ is None else environ
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port:
        raise RuntimeError(
            "mscclpp: no store given and MASTER_ADDR/MASTER_PORT unset: pass store= to new_comm or "
            "run under torchrun"
        )
    try:
        port = int(port)
    except ValueError:
        raise ValueError(f"MASTER_PORT={port!r} is not a port number") from None
    if (addr, port) not in _env_stores:
        import torch.distributed as dist

        agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        _env_stores[(addr, port)] = dist.TCPStore(
            addr, port, size, is_master=(rank == 0 and not agent),
            timeout=timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    return _env_stores[(addr, port)]


# ---- argument checks -------------------------------------------------------------------------

def reduce_op(op):
    """(kind, factor) of a torchcomms ReduceOp: kind is the runtime's op name, "premul_sum" or a
    bitwise op's name (BAND, BOR, BXOR); factor only for PREMUL_SUM."""
    kind = getattr(getattr(op, "type", None), "name", None)
    if kind in _REDUCE_OPS:
        return _REDUCE_OPS[kind], None
    if kind in _BITWISE_OPS:
        return kind, None
    if kind == "PREMUL_SUM":
        if not hasattr(op, "factor"):
            raise ValueError(
                "mscclpp: this torchcomms does not give Python backends the PREMUL_SUM factor "
                "(ReduceOp has no `factor`); scale the tensor and use ReduceOp.SUM"
            )
        return "premul_sum", op.factor
    raise ValueError(f"mscclpp: unknown reduce operation {op!r}")


def dtype_name(what, tensor):
    """The runtime's name of `tensor`'s element type."""
    try:
        return torch_dtype_to_mscclpp_dtype(tensor.dtype).value
    except ValueError as e:
        raise ValueError(f"mscclpp: {what}: {e}") from None


def nbytes(tensor):
    return tensor.numel() * tensor.element_size()


def check_tensor(what, tensor, device_index):
    """Refuses what the runtime cannot take as is: a tensor that is not contiguous (never copied
    behind the caller's back), on another device, or of a type the runtime has no name for."""
    device = tensor.device
    if device.type != "cuda" or (device_index is not None and device.index != device_index):
        raise ValueError(
            f"mscclpp: {what} is on {device}, the communicator is on cuda:{device_index}"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"mscclpp: {what} is not contiguous (shape {tuple(tensor.shape)}, strides "
            f"{tuple(tensor.stride())}): pass tensor.contiguous(); the backend does not copy it"
        )
    return dtype_name(what, tensor)


def same_dtype(what, tensors):
    kinds = {str(t.dtype) for t in tensors}
    if len(kinds) > 1:
        raise ValueError(f"mscclpp: {what}: tensors of different types ({', '.join(sorted(kinds))})")


def check_count(what, tensor, expected):
    if tensor.numel() != expected:
        raise ValueError(f"mscclpp: {what} has {tensor.numel()} elements, expected {expected}")


def check_rank(what, rank, size):
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"mscclpp: {what} {rank!r} is not a rank of this communicator (0..{size - 1})")
    return rank


def check_split_ranks(ranks, rank, size):
    """torchcomms' split rules: ranks of this communicator, each once, this rank among them (an
    empty list: this rank takes part and gets no communicator)."""
    seen = set()
    for r in ranks:
        check_rank("split rank", r, size)
        if r in seen:
            raise ValueError(f"mscclpp: split: rank {r} appears more than once in {list(ranks)}")
        seen.add(r)
    if ranks and rank not in seen:
        raise ValueError(f"mscclpp: split: this rank ({rank}) is not in {list(ranks)}")
    return list(ranks)


def accum_dtype(hints):
    value = (hints or {}).get(HINT_ACCUM_DTYPE)
    if value is None:
        return None
    try:
        return _ACCUM_DTYPES[str(value).lower()]
    except KeyError:
        raise ValueError(
            f"mscclpp: hint {HINT_ACCUM_DTYPE}={value!r} (expected one of {', '.join(_ACCUM_DTYPES)})"
        ) from None


def accumulator(dtype, accum):
    """The accumulation type a reduction of `dtype` takes from the hint: fp8 types accumulate in
    the hinted type, float16/bfloat16 in float32 when that is the hint; every other type in its
    own (the kernels offer only wider accumulators)."""
    if accum is None:
        return None
    if dtype.startswith("fp8") or (dtype in ("f16", "bf16") and accum == "f32"):
        return accum
    return None


# ---- work ------------------------------------------------------------------------------------

class EventPool:
    """CUDA events reused across works: an event goes back once its work is known complete (up
    to `max_size` kept; more are let go)."""

    def __init__(self, make, max_size=DEFAULT_MAX_EVENT_POOL_SIZE):
        self._make = make
        self._max_size = max_size
        self._free = []
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._make()

    def put(self, event):
        with self._lock:
            if len(self._free) < self._max_size:
                self._free.append(event)

    def __len__(self):
        return len(self._free)


class MscclppWork:
    """An operation enqueued with async_op=True. `wait()` orders the caller's current stream
    after it (no host wait); `is_completed()` polls its event. Past the communicator's timeout
    either raises TimeoutError (naming the operation, rank and communicator) and aborts the
    communicator."""

    def __init__(self, backend, operation, event, keep_alive, clock=time.monotonic):
        self._backend = backend
        self._operation = operation
        self._event = event
        self._keep_alive = keep_alive
        self._clock = clock
        self._start = clock()
        self._done = False

    @property
    def operation(self):
        return self._operation

    def _finish(self):
        if not self._done:
            self._done = True
            self._keep_alive = None
            self._backend._events.put(self._event)

    def is_completed(self):
        if self._done:
            return True
        if self._backend._capturing():
            return False
        # Polls every outstanding work of the communicator, this one included (and raises for
        # one past the timeout or an error the runtime recorded).
        self._backend._raise_async_error(self._operation)
        return self._done

    def wait(self):
        if self._done:
            return
        self._backend._raise_async_error(self._operation)
        self._backend._current_stream().wait_event(self._event)
        # The stream waits for the record current when the wait was enqueued, so the event may go
        # back to the pool (and be recorded again) as soon as it is known done.
        if not self._backend._capturing() and self._event.query():
            self._finish()

    def wait_blocking(self):
        """Waits on the host until done, within the communicator's timeout."""
        while not self.is_completed():
            time.sleep(0.0005)


def _import_torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"mscclpp: the TorchComms backend runs on torch tensors, and torch is not importable: {e}") from e
    return torch


# ---- the backend -----------------------------------------------------------------------------

class MscclppBackendMethods:
    """The TorchComms backend protocol on mscclpp-rs (see the module's docs)."""

    def __init__(self):
        super().__init__()
        self._session = None
        self._name = None
        self._rank = None
        self._size = None
        self._options = None
        self._timeout_s = DEFAULT_TIMEOUT.total_seconds()
        self._abort_process = False
        self._accum = None
        self._aborted = None
        self._pending = []

    # -- lifecycle ------------------------------------------------------------------------------

    def init(self, device, name, options):
        """Collective: joins the communicator `name` on `device` (torch.device; no index: this
        rank modulo the visible GPUs). Rank and size follow torchcomms' rules; the job id goes
        through options.store, else the MASTER_ADDR/MASTER_PORT TCPStore."""
        if getattr(device, "type", None) != "cuda":
            raise ValueError(f"mscclpp: the backend runs on CUDA devices, not {device}")
        rank, size = query_rank_size()
        self._setup_options(name, options, rank, size)
        store = getattr(options, "store", None)
        if store is None:
            store = env_store(rank, size, self._timeout_s)
        # The bootstrap first: it needs no GPU, and every rank reaches it whatever its device.
        boot = bootstrap(store, name, rank, size, self._timeout_s)
        torch = _import_torch()
        index = getattr(device, "index", None)
        if index is None:
            count = torch.cuda.device_count()
            if count == 0:
                raise _mscclpp.MscclppError("mscclpp: torch sees no CUDA device")
            index = rank % count
        communicator = _mscclpp.Communicator(boot, index)
        self._adopt(_mscclpp.CommSession(communicator), index)

    def _setup_options(self, name, options, rank, size):
        if not name:
            raise ValueError("mscclpp: a communicator needs a name (new_comm(..., name=...))")
        self._name, self._rank, self._size, self._options = name, rank, size, options
        timeout = getattr(options, "timeout", None)
        self._timeout_s = _seconds(timeout) if timeout is not None else DEFAULT_TIMEOUT.total_seconds()
        self._abort_process = bool(getattr(options, "abort_process_on_timeout_or_error", False))
        hints = getattr(options, "hints", None) or {}
        self._accum = accum_dtype(hints)
        self._high_priority = str(hints.get(HINT_HIGH_PRIORITY_STREAM, "")).lower() in ("1", "true")
        pool = hints.get(HINT_MAX_EVENT_POOL_SIZE, DEFAULT_MAX_EVENT_POOL_SIZE)
        try:
            self._max_events = int(pool)
        except ValueError:
            raise ValueError(f"mscclpp: hint {HINT_MAX_EVENT_POOL_SIZE}={pool!r} is not a number") from None

    def _adopt(self, session, index):
        torch = _import_torch()
        self._session = session
        self._device_index = index
        self._torch = torch
        with torch.cuda.device(index):
            self._stream = torch.cuda.Stream(index, priority=-1 if self._high_priority else 0)
            self._barrier_buffer = torch.zeros(1, dtype=torch.float32, device=f"cuda:{index}")
        self._events = EventPool(lambda: torch.cuda.Event(), self._max_events)

    def finalize(self):
        """Finishes this rank's outstanding work (within the timeout) and frees the communicator;
        later calls raise."""
        if self._session is None:
            return
        if self._aborted is None:
            for work in list(self._pending):
                work.wait_blocking()
        self._pending = []
        if self._aborted is None:
            self._stream.synchronize()
            self._torch.cuda.current_stream(self._device_index).synchronize()
        self._session = None

    def abort(self, reason=None):
        """Aborts the communicator (`Communicator::abort`): its kernels return at entry, device
        waits give up, and every later call raises."""
        reason = reason or f"communicator {self._name!r} aborted on rank {self._rank}"
        if self._aborted is None:
            self._aborted = reason
        if self._session is not None:
            self._session.abort(reason)

    def is_aborted(self):
        return self._aborted is not None

    def set_timeout(self, timeout):
        self._timeout_s = _seconds(timeout)

    def get_rank(self):
        return self._rank

    def get_size(self):
        return self._size

    def get_backend_name(self):
        return BACKEND_NAME

    def get_comm_name(self):
        return self._name

    def get_options(self):
        return self._options

    def get_device(self):
        return self._torch.device("cuda", self._device_index)

    def split(self, ranks, name, options):
        """Collective over this communicator: a communicator of `ranks` (in its rank order) on
        Communicator::split, or None for a rank passing an empty list."""
        ranks = check_split_ranks(ranks, self._rank, self._size)
        live = self._live("split")
        sub = live.split(ranks)
        if sub is None:
            return None
        child = type(self)()
        child._setup_options(name, options, ranks.index(self._rank), len(ranks))
        child._adopt(sub, self._device_index)
        return child

    # -- the machinery every operation shares --------------------------------------------------

    def _live(self, operation):
        if self._session is None:
            raise RuntimeError(f"mscclpp: {operation} on communicator {self._name!r} after finalize")
        self._raise_async_error(operation)
        return self._session

    def _raise_async_error(self, operation):
        if self._aborted is not None:
            raise _mscclpp.MscclppError(
                f"mscclpp: {operation} on rank {self._rank} of communicator {self._name!r}: "
                f"aborted ({self._aborted})"
            )
        if self._session is None:
            return
        self._poll_pending()
        try:
            self._session.check()
        except Exception as e:
            self._fail(type(e), f"{operation} on rank {self._rank} of communicator {self._name!r}: {e}")

    def _poll_pending(self):
        """Retires the async works that completed; one past the timeout fails the communicator."""
        if self._capturing():
            return
        still = []
        for work in self._pending:
            if work._done:
                continue
            if work._event.query():
                work._finish()
                continue
            elapsed = work._clock() - work._start
            if elapsed > self._timeout_s:
                self._pending = []
                self._time_out(work.operation, elapsed)
            still.append(work)
        self._pending = still

    def _time_out(self, operation, elapsed):
        self._fail(
            TimeoutError,
            f"{operation} on rank {self._rank} of communicator {self._name!r} did not complete "
            f"within the communicator's timeout of {self._timeout_s:g} s ({elapsed:.1f} s)",
        )

    def _fail(self, kind, message):
        message = f"mscclpp: {message}"
        self.abort(message)
        if self._abort_process:
            print(f"{message}; aborting the process (abort_process_on_timeout_or_error)",
                  file=sys.stderr, flush=True)
            os.abort()
        raise kind(message)

    def _current_stream(self):
        return self._torch.cuda.current_stream(self._device_index)

    def _capturing(self):
        return self._torch.cuda.is_current_stream_capturing()

    def _issue(self, operation, async_op, tensors, launch):
        """Runs `launch(stream)` (which returns temporaries to keep alive) on the current stream,
        or, with async_op, on the backend's stream after the current one, returning a work."""
        self._live(operation)
        current = self._current_stream()
        if not async_op:
            with self._torch.cuda.device(self._device_index):
                launch(current)
            return None
        stream = self._stream
        ready = self._events.get()
        ready.record(current)
        stream.wait_event(ready)
        self._events.put(ready)
        with self._torch.cuda.device(self._device_index), self._torch.cuda.stream(stream):
            temps = launch(stream) or []
        keep = list(tensors) + list(temps)
        if not self._capturing():
            # The caching allocator must not hand their memory out again before the backend's
            # stream is done with it (a graph's pool keeps its memory for the graph's life).
            for t in keep:
                t.record_stream(stream)
        done = self._events.get()
        done.record(stream)
        work = MscclppWork(self, operation, done, keep)
        # Outstanding until seen complete: its tensors live that long, and the timeout applies.
        self._pending.append(work)
        return work

    def _check(self, operation, what, tensor):
        return check_tensor(f"{operation}: {what}", tensor, self._device_index)

    def _run(self, collective, input, output, dtype, stream, op="sum", root=0,
             input_size=None, output_size=None):
        self._session.run(
            collective, input.data_ptr(), output.data_ptr(),
            nbytes(input) if input_size is None else input_size,
            nbytes(output) if output_size is None else output_size,
            dtype, op, root, stream.cuda_stream, accumulator(dtype, self._accum),
        )

    def _p2p(self, ops, stream):
        """One group of sends and receives, (kind, peer, tensor), as one kernel; a send to this
        rank is a copy into the group's receive from this rank."""
        ops = [(kind, peer, t.data_ptr(), nbytes(t)) for kind, peer, t in ops if t.numel() > 0]
        if ops:
            self._session.p2p(ops, stream.cuda_stream)

    def _reduction(self, operation, dtype, op):
        kind, factor = reduce_op(op)
        if kind in _BITWISE_OPS and not dtype.startswith(("i", "u")):
            raise ValueError(f"mscclpp: {operation}: {kind} needs an integer type, not {dtype}")
        if kind == "premul_sum" and not dtype.startswith(("f", "bf")):
            raise ValueError(f"mscclpp: {operation}: PREMUL_SUM needs a floating type, not {dtype}")
        return kind, factor

    def _gathered(self, tensor, dtype, stream):
        """Every rank's `tensor`, stacked (for the bitwise reductions, which the runtime's kernels
        do not have: gathered, then reduced here)."""
        out = self._torch.empty((self._size,) + tuple(tensor.shape), dtype=tensor.dtype,
                                device=tensor.device)
        self._run("allgather", tensor, out, dtype, stream)
        return out

    def _bitwise(self, kind, gathered):
        fold = {"BAND": self._torch.bitwise_and, "BOR": self._torch.bitwise_or,
                "BXOR": self._torch.bitwise_xor}[kind]
        result = gathered[0].clone()
        for part in gathered[1:]:
            result = fold(result, part)
        return result

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(self, tensor, op, async_op):
        dtype = self._check("all_reduce", "tensor", tensor)
        kind, factor = self._reduction("all_reduce", dtype, op)

        def launch(stream):
            if tensor.numel() == 0:
                return None
            if kind in _BITWISE_OPS:
                gathered = self._gathered(tensor, dtype, stream)
                tensor.copy_(self._bitwise(kind, gathered))
                return [gathered]
            if kind == "premul_sum":
                tensor.mul_(factor)
            self._run("allreduce", tensor, tensor, dtype, stream, "sum" if kind == "premul_sum" else kind)
            return None

        return self._issue("all_reduce", async_op, [tensor], launch)

    def reduce(self, tensor, root, op, async_op):
        dtype = self._check("reduce", "tensor", tensor)
        root = check_rank("reduce: root", root, self._size)
        kind, factor = self._reduction("reduce", dtype, op)

        def launch(stream):
            if tensor.numel() == 0:
                return None
            if kind in _BITWISE_OPS:
                gathered = self._gathered(tensor, dtype, stream)
                if self._rank == root:
                    tensor.copy_(self._bitwise(kind, gathered))
                return [gathered]
            if kind == "premul_sum":
                # Scaled apart: off the root the caller's tensor must stay as it was.
                scaled = tensor * factor
                self._run("reduce", scaled, tensor, dtype, stream, "sum", root)
                return [scaled]
            self._run("reduce", tensor, tensor, dtype, stream, kind, root)
            return None

        return self._issue("reduce", async_op, [tensor], launch)

    def broadcast(self, tensor, root, async_op):
        dtype = self._check("broadcast", "tensor", tensor)
        root = check_rank("broadcast: root", root, self._size)

        def launch(stream):
            if tensor.numel():
                self._run("broadcast", tensor, tensor, dtype, stream, root=root)

        return self._issue("broadcast", async_op, [tensor], launch)

    def all_gather_single(self, output, input, async_op):
        dtype = self._check("all_gather_single", "input", input)
        self._check("all_gather_single", "output", output)
        same_dtype("all_gather_single", [input, output])
        check_count("all_gather_single: output", output, input.numel() * self._size)

        def launch(stream):
            if input.numel():
                self._run("allgather", input, output, dtype, stream)

        return self._issue("all_gather_single", async_op, [input, output], launch)

    def _gather_to_all(self, operation, tensor_list, tensor, async_op, equal):
        self._check(operation, "tensor", tensor)
        if len(tensor_list) != self._size:
            raise ValueError(
                f"mscclpp: {operation}: tensor_list has {len(tensor_list)} tensors, the communicator "
                f"{self._size} ranks"
            )
        for i, t in enumerate(tensor_list):
            self._check(operation, f"tensor_list[{i}]", t)
            if equal:
                check_count(f"{operation}: tensor_list[{i}]", t, tensor.numel())
        same_dtype(operation, [tensor] + list(tensor_list))
        check_count(f"{operation}: tensor_list[{self._rank}] (this rank's)", tensor_list[self._rank],
                    tensor.numel())

        def launch(stream):
            # One group; the send to this rank is the copy into its own slot.
            ranks = range(self._size)
            self._p2p([("send", p, tensor) for p in ranks] + [("recv", p, tensor_list[p]) for p in ranks],
                      stream)

        return self._issue(operation, async_op, [tensor] + list(tensor_list), launch)

    def all_gather(self, tensor_list, tensor, async_op):
        return self._gather_to_all("all_gather", tensor_list, tensor, async_op, equal=True)

    def all_gather_v(self, tensor_list, tensor, async_op):
        return self._gather_to_all("all_gather_v", tensor_list, tensor, async_op, equal=False)

    def reduce_scatter_single(self, output, input, op, async_op):
        dtype = self._check("reduce_scatter_single", "input", input)
        self._check("reduce_scatter_single", "output", output)
        same_dtype("reduce_scatter_single", [input, output])
        check_count("reduce_scatter_single: input", input, output.numel() * self._size)
        kind, factor = self._reduction("reduce_scatter_single", dtype, op)

        def launch(stream):
            if output.numel() == 0:
                return None
            if kind in _BITWISE_OPS:
                gathered = self._gathered(input, dtype, stream)
                mine = self._bitwise(kind, gathered).view(self._size, -1)[self._rank]
                output.view(-1).copy_(mine)
                return [gathered]
            source = input * factor if kind == "premul_sum" else input
            self._run("reducescatter", source, output, dtype, stream,
                      "sum" if kind == "premul_sum" else kind)
            return [source] if source is not input else None

        return self._issue("reduce_scatter_single", async_op, [input, output], launch)

    def _reduce_scatter_list(self, operation, output, input_list, op, async_op, equal):
        dtype = self._check(operation, "output", output)
        if len(input_list) != self._size:
            raise ValueError(
                f"mscclpp: {operation}: input_list has {len(input_list)} tensors, the communicator "
                f"{self._size} ranks"
            )
        for i, t in enumerate(input_list):
            self._check(operation, f"input_list[{i}]", t)
            if equal:
                check_count(f"{operation}: input_list[{i}]", t, output.numel())
        same_dtype(operation, [output] + list(input_list))
        check_count(f"{operation}: input_list[{self._rank}] (this rank's)", input_list[self._rank],
                    output.numel())
        kind, factor = self._reduction(operation, dtype, op)

        def launch(stream):
            temps = []
            # One reduce per destination rank, each into that rank's output.
            for r, part in enumerate(input_list):
                if part.numel() == 0:
                    continue
                if kind in _BITWISE_OPS:
                    gathered = self._gathered(part, dtype, stream)
                    temps.append(gathered)
                    if r == self._rank:
                        output.copy_(self._bitwise(kind, gathered).view_as(output))
                    continue
                source = part * factor if kind == "premul_sum" else part
                if source is not part:
                    temps.append(source)
                self._run("reduce", source, output if r == self._rank else source, dtype, stream,
                          "sum" if kind == "premul_sum" else kind, r)
            return temps

        return self._issue(operation, async_op, [output] + list(input_list), launch)

    def reduce_scatter(self, output, input_list, op, async_op):
        return self._reduce_scatter_list("reduce_scatter", output, input_list, op, async_op, True)

    def reduce_scatter_v(self, output, input_list, op, async_op):
        return self._reduce_scatter_list("reduce_scatter_v", output, input_list, op, async_op, False)

    def all_to_all_single(self, output, input, async_op):
        dtype = self._check("all_to_all_single", "input", input)
        self._check("all_to_all_single", "output", output)
        same_dtype("all_to_all_single", [input, output])
        check_count("all_to_all_single: output", output, input.numel())
        if input.numel() % self._size:
            raise ValueError(
                f"mscclpp: all_to_all_single: {input.numel()} elements do not split into "
                f"{self._size} ranks"
            )

        def launch(stream):
            if input.numel():
                self._run("alltoall", input, output, dtype, stream)

        return self._issue("all_to_all_single", async_op, [input, output], launch)

    def all_to_all_v_single(self, output, input, output_split_sizes, input_split_sizes, async_op):
        operation = "all_to_all_v_single"
        self._check(operation, "input", input)
        self._check(operation, "output", output)
        same_dtype(operation, [input, output])
        ins = self._splits(operation, "input", input, input_split_sizes)
        outs = self._splits(operation, "output", output, output_split_sizes)

        def launch(stream):
            ranks = range(self._size)
            self._p2p([("send", p, ins[p]) for p in ranks] + [("recv", p, outs[p]) for p in ranks],
                      stream)

        return self._issue(operation, async_op, [input, output], launch)

    def _splits(self, operation, what, tensor, sizes):
        """`tensor` cut along dim 0 into `sizes` (every rank's share; empty sizes: equal shares)."""
        sizes = [int(s) for s in sizes]
        rows = tensor.shape[0] if tensor.dim() else tensor.numel()
        if not sizes:
            if rows % self._size:
                raise ValueError(f"mscclpp: {operation}: {what} of {rows} rows does not split into "
                                 f"{self._size} ranks")
            sizes = [rows // self._size] * self._size
        if len(sizes) != self._size or sum(sizes) != rows or min(sizes) < 0:
            raise ValueError(
                f"mscclpp: {operation}: {what}_split_sizes {sizes} must be {self._size} "
                f"non-negative sizes summing to {what}'s {rows} rows"
            )
        # Rows of `cols` elements (a view: `tensor` is contiguous); explicit so 0 rows work.
        cols = tensor.numel() // rows if rows else 0
        return list(tensor.view(rows, cols).split(sizes))

    def all_to_all(self, output_tensor_list, input_tensor_list, async_op):
        operation = "all_to_all"
        for what, lst in (("output_tensor_list", output_tensor_list),
                          ("input_tensor_list", input_tensor_list)):
            if len(lst) != self._size:
                raise ValueError(f"mscclpp: {operation}: {what} has {len(lst)} tensors, the "
                                 f"communicator {self._size} ranks")
            for i, t in enumerate(lst):
                self._check(operation, f"{what}[{i}]", t)
        same_dtype(operation, list(output_tensor_list) + list(input_tensor_list))
        check_count(f"{operation}: output_tensor_list[{self._rank}] (this rank's)",
                    output_tensor_list[self._rank], input_tensor_list[self._rank].numel())

        def launch(stream):
            ranks = range(self._size)
            self._p2p([("send", p, input_tensor_list[p]) for p in ranks]
                      + [("recv", p, output_tensor_list[p]) for p in ranks], stream)

        return self._issue(operation, async_op,
                           list(output_tensor_list) + list(input_tensor_list), launch)

    def scatter(self, output_tensor, input_tensor_list, root, async_op):
        operation = "scatter"
        self._check(operation, "output_tensor", output_tensor)
        root = check_rank("scatter: root", root, self._size)
        inputs = list(input_tensor_list) if self._rank == root else []
        if self._rank == root:
            if len(inputs) != self._size:
                raise ValueError(f"mscclpp: scatter: input_tensor_list has {len(inputs)} tensors "
                                 f"on the root, the communicator {self._size} ranks")
            for i, t in enumerate(inputs):
                self._check(operation, f"input_tensor_list[{i}]", t)
                check_count(f"scatter: input_tensor_list[{i}]", t, output_tensor.numel())
            same_dtype(operation, [output_tensor] + inputs)

        def launch(stream):
            sends = [("send", p, inputs[p]) for p in range(self._size)] if self._rank == root else []
            self._p2p(sends + [("recv", root, output_tensor)], stream)

        return self._issue(operation, async_op, [output_tensor] + inputs, launch)

    def gather(self, output_tensor_list, input_tensor, root, async_op):
        operation = "gather"
        self._check(operation, "input_tensor", input_tensor)
        root = check_rank("gather: root", root, self._size)
        outputs = list(output_tensor_list) if self._rank == root else []
        if self._rank == root:
            if len(outputs) != self._size:
                raise ValueError(f"mscclpp: gather: output_tensor_list has {len(outputs)} tensors "
                                 f"on the root, the communicator {self._size} ranks")
            for i, t in enumerate(outputs):
                self._check(operation, f"output_tensor_list[{i}]", t)
                check_count(f"gather: output_tensor_list[{i}]", t, input_tensor.numel())
            same_dtype(operation, [input_tensor] + outputs)

        def launch(stream):
            recvs = [("recv", p, outputs[p]) for p in range(self._size)] if self._rank == root else []
            self._p2p([("send", root, input_tensor)] + recvs, stream)

        return self._issue(operation, async_op, [input_tensor] + outputs, launch)

    def send(self, tensor, dst, async_op):
        self._check("send", "tensor", tensor)
        dst = check_rank("send: dst", dst, self._size)
        if dst == self._rank:
            raise ValueError(f"mscclpp: send: dst {dst} is this rank")

        def launch(stream):
            self._p2p([("send", dst, tensor)], stream)

        return self._issue("send", async_op, [tensor], launch)

    def recv(self, tensor, src, async_op):
        self._check("recv", "tensor", tensor)
        src = check_rank("recv: src", src, self._size)
        if src == self._rank:
            raise ValueError(f"mscclpp: recv: src {src} is this rank")

        def launch(stream):
            self._p2p([("recv", src, tensor)], stream)

        return self._issue("recv", async_op, [tensor], launch)

    def barrier(self, async_op):
        """A one-element all-reduce on the device: every rank's earlier work on this
        communicator's streams is done before any rank's later work starts."""

        def launch(stream):
            self._run("allreduce", self._barrier_buffer, self._barrier_buffer, "f32", stream)

        return self._issue("barrier", async_op, [], launch)


def backend_class(base):
    """The backend class torchcomms instantiates: MscclppBackendMethods over `base`
    (torchcomms.TorchCommBackend)."""
    return type("MscclppBackend", (MscclppBackendMethods, base), {
        "__module__": "mscclpp_torchcomms",
        "__doc__": MscclppBackendMethods.__doc__,
    })
