"""A stand-in for the `torchcomms` package (>= 0.3), for the tests of mscclpp-rs's TorchComms
backend on machines where torchcomms cannot be installed (PyPI holds only a placeholder).

It is written from torchcomms' documented Python protocol, not from its code, and has only what a
Python backend meets:
  - `register_backend(name, cls)` and `new_comm(backend, device, name=..., ...)`: new_comm first
    loads the backend's `torchcomms.backends` entry point (an import that registers it), then
    instantiates the registered class, calls `init(device, name, options)` and wraps it in a
    `TorchComm`;
  - `TorchCommBackend`, the base class backends subclass;
  - `CommOptions` (abort_process_on_timeout_or_error, timeout, store, enable_reconfigure, hints),
    `ReduceOp` (SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG, PREMUL_SUM(factor); `.type`),
    `RedOpType`;
  - the work contract: a backend method returns None (done, synchronously) or an object with
    `wait()`; `TorchComm`'s methods always return a `TorchWork` (`wait()`, `is_completed()`).
The one liberty: `ReduceOp.PREMUL_SUM(f).factor` is readable, which torchcomms' own binding does
not offer Python backends (the backend says so when it is missing).

Import it only where the real package is absent: tests put its folder on sys.path after trying
the real one. It needs torch only for what needs a device.
"""

import enum
from datetime import timedelta
from importlib.metadata import entry_points

__version__ = "0.3.0+standin"
IS_STANDIN = True

DEFAULT_TIMEOUT = timedelta(seconds=600)


class RedOpType(enum.Enum):
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    PREMUL_SUM = 7
    AVG = 8


class ReduceOp:
    """A reduction: its `type` (RedOpType) and, for PREMUL_SUM, the `factor` (a number or a
    one-element tensor) each rank's input is multiplied by before the sum."""

    def __init__(self, op_type, factor=None):
        if not isinstance(op_type, RedOpType):
            raise TypeError(f"ReduceOp takes a RedOpType, not {op_type!r}")
        if (op_type is RedOpType.PREMUL_SUM) != (factor is not None):
            raise ValueError("PREMUL_SUM, and only PREMUL_SUM, takes a factor")
        self._type = op_type
        self._factor = factor

    @property
    def type(self):
        return self._type

    @property
    def factor(self):
        return self._factor

    @staticmethod
    def PREMUL_SUM(factor):  # noqa: N802 (torchcomms' spelling)
        return ReduceOp(RedOpType.PREMUL_SUM, factor)

    def __repr__(self):
        extra = "" if self._factor is None else f"({self._factor!r})"
        return f"ReduceOp.{self._type.name}{extra}"


for _t in RedOpType:
    if _t is not RedOpType.PREMUL_SUM:
        setattr(ReduceOp, _t.name, ReduceOp(_t))


class CommOptions:
    def __init__(self):
        self.abort_process_on_timeout_or_error = True
        self.timeout = DEFAULT_TIMEOUT
        self.store = None
        self.enable_reconfigure = False
        self.hints = {}


class TorchCommBackend:
    """Base class of Python backends."""

    def __init__(self):
        pass


_registry = {}


def register_backend(name, backend_class):
    if not isinstance(backend_class, type) or not issubclass(backend_class, TorchCommBackend):
        raise TypeError(f"register_backend({name!r}): {backend_class!r} is not a TorchCommBackend class")
    _registry[name] = backend_class


def _is_backend_registered(name):
    return name in _registry


def _load_backend(backend):
    found = entry_points(group="torchcomms.backends", name=backend)
    if not found:
        raise ModuleNotFoundError(f"no torchcomms.backends entry point named {backend!r}")
    next(iter(found)).load()


def is_backend_built(backend):
    return bool(entry_points(group="torchcomms.backends", name=backend))


def built_backends():
    return [ep.name for ep in entry_points(group="torchcomms.backends")]


class TorchWork:
    """What TorchComm's operations return: the backend's work, or a completed one for None."""

    def __init__(self, backend_work):
        self._work = backend_work

    def wait(self):
        if self._work is not None:
            self._work.wait()

    def is_completed(self):
        if self._work is None:
            return True
        probe = getattr(self._work, "is_completed", None)
        return True if probe is None else bool(probe())

    def wait_blocking(self):
        blocking = getattr(self._work, "wait_blocking", None)
        if blocking is not None:
            blocking()
        else:
            self.wait()


def new_comm(backend, device, name=None, abort_process_on_timeout_or_error=None, timeout=None,
             is_high_priority_stream=None, store=None, enable_reconfigure=False, hints=None):
    """Collective: every rank of the new communicator calls it at the same time."""
    try:
        _load_backend(backend)
    except Exception:
        if backend not in _registry:
            raise
    if backend not in _registry:
        raise RuntimeError(f"backend {backend!r} did not register itself when loaded")
    options = CommOptions()
    if abort_process_on_timeout_or_error is not None:
        options.abort_process_on_timeout_or_error = abort_process_on_timeout_or_error
    if timeout is not None:
        options.timeout = timeout
    options.store = store
    options.enable_reconfigure = enable_reconfigure
    options.hints = dict(hints or {})
    if is_high_priority_stream is not None:
        options.hints["is_high_priority_stream"] = str(bool(is_high_priority_stream)).lower()
    impl = _registry[backend]()
    impl.init(device, name, options)
    return TorchComm(backend, impl, options)


class TorchComm:
    """A communicator: each operation forwards to the backend and returns a TorchWork."""

    def __init__(self, backend, impl, options):
        self._backend = backend
        self._impl = impl
        self._options = options

    def finalize(self):
        self._impl.finalize()

    def get_rank(self):
        return self._impl.get_rank()

    def get_size(self):
        return self._impl.get_size()

    def get_name(self):
        return self._impl.get_comm_name()

    def get_backend(self):
        return self._backend

    def get_backend_impl(self):
        return self._impl

    def get_options(self):
        return self._options

    def get_device(self):
        return self._impl.get_device()

    def set_timeout(self, timeout):
        self._impl.set_timeout(timeout)

    def split(self, ranks, name, hints=None, timeout=None):
        options = CommOptions()
        options.hints = dict(hints or {})
        options.timeout = timeout if timeout is not None else self._options.timeout
        options.abort_process_on_timeout_or_error = self._options.abort_process_on_timeout_or_error
        child = self._impl.split(list(ranks), name, options)
        return None if child is None else TorchComm(self._backend, child, options)

    def send(self, tensor, dst, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.send(tensor, dst, async_op))

    def recv(self, tensor, src, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.recv(tensor, src, async_op))

    def broadcast(self, tensor, root, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.broadcast(tensor, root, async_op))

    def all_reduce(self, tensor, op, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.all_reduce(tensor, op, async_op))

    def reduce(self, tensor, root, op, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.reduce(tensor, root, op, async_op))

    def all_gather(self, tensor_list, tensor, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.all_gather(tensor_list, tensor, async_op))

    def all_gather_v(self, tensor_list, tensor, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.all_gather_v(tensor_list, tensor, async_op))

    def all_gather_single(self, output, input, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.all_gather_single(output, input, async_op))

    def reduce_scatter(self, output, input_list, op, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.reduce_scatter(output, input_list, op, async_op))

    def reduce_scatter_v(self, output, input_list, op, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.reduce_scatter_v(output, input_list, op, async_op))

    def reduce_scatter_single(self, output, input, op, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.reduce_scatter_single(output, input, op, async_op))

    def all_to_all_single(self, output, input, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.all_to_all_single(output, input, async_op))

    def all_to_all_v_single(self, output, input, output_split_sizes, input_split_sizes, async_op,
                            hints=None, timeout=None):
        return TorchWork(self._impl.all_to_all_v_single(
            output, input, output_split_sizes, input_split_sizes, async_op))

    def all_to_all(self, output_tensor_list, input_tensor_list, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.all_to_all(output_tensor_list, input_tensor_list, async_op))

    def barrier(self, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.barrier(async_op))

    def scatter(self, output_tensor, input_tensor_list, root, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.scatter(output_tensor, input_tensor_list, root, async_op))

    def gather(self, output_tensor_list, input_tensor, root, async_op, hints=None, timeout=None):
        return TorchWork(self._impl.gather(output_tensor_list, input_tensor, root, async_op))
