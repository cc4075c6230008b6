"""CPU tests of the TorchComms backend "mscclpp": entry-point discovery, registration, torchcomms'
rank and size rules, the store bootstrap across processes, argument checks, and the async/work
contract (streams, events, timeouts) against a recording stand-in of torch's CUDA API.

They need neither torch nor a GPU, and run against the real torchcomms where it is installed (the
stand-in in standin/ otherwise; see torchcomms_support.py)."""

import contextlib
import gc
import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys
import weakref
from datetime import timedelta
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

import mscclpp
from mscclpp import torchcomms_backend as tb
from torchcomms_support import FileStore, import_torchcomms, is_standin

torchcomms = import_torchcomms()
import mscclpp_torchcomms  # noqa: E402  (after torchcomms is importable)

print(f"torchcomms under test: {'stand-in' if is_standin(torchcomms) else 'real'} "
      f"{getattr(torchcomms, '__version__', '?')}")


# ---- discovery and registration --------------------------------------------------------------

@pytest.mark.parametrize("group", ["torchcomms.backends", "torch.comms.backends"])
def test_the_wheel_declares_the_entry_point(group):
    found = list(entry_points(group=group, name="mscclpp"))
    assert [ep.value for ep in found] == ["mscclpp_torchcomms:MscclppBackend"]
    assert found[0].load() is mscclpp_torchcomms.MscclppBackend


def test_importing_registers_a_torchcommbackend_subclass():
    assert issubclass(mscclpp_torchcomms.MscclppBackend, torchcomms.TorchCommBackend)
    assert torchcomms._is_backend_registered("mscclpp")
    backend = mscclpp_torchcomms.MscclppBackend()
    assert backend.get_backend_name() == "mscclpp"
    assert mscclpp_torchcomms.TORCHCOMMS_PROTOCOL_VERSION == "0.3"


def test_importing_without_torchcomms_says_what_is_missing(tmp_path):
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here, so torch.comms may be importable")
    code = "import mscclpp_torchcomms"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                          cwd=str(tmp_path))
    assert done.returncode != 0
    assert "registers a backend with torchcomms (>= 0.3) or torch.comms" in done.stderr


def test_every_protocol_method_is_served():
    methods = ["init", "finalize", "get_rank", "get_size", "get_backend_name", "get_comm_name",
               "all_reduce", "all_gather", "all_gather_v", "all_gather_single", "reduce_scatter",
               "reduce_scatter_v", "reduce_scatter_single", "all_to_all", "all_to_all_single",
               "all_to_all_v_single", "broadcast", "reduce", "send", "recv", "barrier", "scatter",
               "gather", "split", "set_timeout"]
    missing = [m for m in methods if not callable(getattr(mscclpp_torchcomms.MscclppBackend, m, None))]
    assert missing == []


# ---- rank and size, store keys ---------------------------------------------------------------

@pytest.mark.parametrize("env, expected", [
    ({"TORCHCOMM_RANK": "1", "TORCHCOMM_SIZE": "4", "RANK": "3", "WORLD_SIZE": "8"}, (1, 4)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "RANK": "0", "WORLD_SIZE": "3"}, (2, 3)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 2)),
    ({"PALS_RANKID": "5", "WORLD_SIZE": "6"}, (5, 6)),
    ({"RANK": "0", "WORLD_SIZE": "2"}, (0, 2)),
    ({"TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD": "torchrun", "OMPI_COMM_WORLD_RANK": "1",
      "OMPI_COMM_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "2"}, (0, 2)),
])
def test_rank_and_size_follow_torchcomms_rules(env, expected):
    assert tb.query_rank_size(env) == expected


@pytest.mark.parametrize("env, message", [
    ({}, "set TORCHCOMM_RANK and TORCHCOMM_SIZE"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is not below the world size 2"),
    ({"TORCHCOMM_BOOTSTRAP_RANKSIZE_QUERY_METHOD": "slurm"}, "expected auto, mpi, pals or torchrun"),
])
def test_rank_and_size_errors_say_what_to_set(env, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        tb.query_rank_size(env)


def test_store_keys_carry_the_name_and_a_counter():
    assert tb.store_key("keys-test") == "mscclpp_torchcomms/keys-test/0"
    assert tb.store_key("keys-test") == "mscclpp_torchcomms/keys-test/1"
    assert tb.store_key("other") == "mscclpp_torchcomms/other/0"


def test_without_store_or_master_addr_the_error_says_what_to_pass():
    with pytest.raises(RuntimeError, match="pass store= to new_comm"):
        tb.env_store(0, 2, 10, environ={})


# ---- bootstrap through a store, across processes ---------------------------------------------

def _bootstrap_rank(folder, rank, size, out):
    boot = tb.bootstrap(FileStore(folder), "boot-test", rank, size, timedelta(seconds=30))
    out.put((rank, boot.all_gather(bytes([rank]))))


def _new_comm_rank(folder, rank, size, out):
    os.environ.update(TORCHCOMM_RANK=str(rank), TORCHCOMM_SIZE=str(size))
    tc = import_torchcomms()
    device = SimpleNamespace(type="cuda", index=0)
    try:
        comm = tc.new_comm("mscclpp", device, name="cpu-newcomm", store=FileStore(folder),
                           timeout=timedelta(seconds=30))
        out.put((rank, "ok", comm.get_rank(), comm.get_size()))
        comm.finalize()
    except Exception as e:  # no torch or no GPU here: after the bootstrap
        out.put((rank, type(e).__name__, str(e), None))


def _run_ranks(target, size, folder):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(folder, r, size, out)) for r in range(size)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


def test_bootstrap_through_a_store_across_processes(tmp_path):
    results = _run_ranks(_bootstrap_rank, 3, str(tmp_path))
    assert [r[1] for r in results] == [[b"\x00", b"\x01", b"\x02"]] * 3
    log = FileStore(str(tmp_path)).log()
    assert ["set", "mscclpp_torchcomms/boot-test/0"] in log
    assert log.count(["get", "mscclpp_torchcomms/boot-test/0"]) == 2


@pytest.mark.skipif(not is_standin(torchcomms), reason="the real torchcomms takes torch devices only")
def test_new_comm_finds_the_backend_and_bootstraps_through_the_store(tmp_path):
    results = _run_ranks(_new_comm_rank, 2, str(tmp_path))
    log = FileStore(str(tmp_path)).log()
    # Both ranks got past the store exchange: rank 0 published, rank 1 read.
    assert ["set", "mscclpp_torchcomms/cpu-newcomm/0"] in log
    assert ["get", "mscclpp_torchcomms/cpu-newcomm/0"] in log
    for rank, kind, detail, _ in results:
        if kind != "ok":
            # Without torch or a GPU the init stops after the bootstrap, saying which.
            assert kind in ("ImportError", "MscclppError"), (rank, kind, detail)
            assert "torch" in detail or "GPU" in detail or "CUDA" in detail or "unavailable" in detail


# ---- argument checks -------------------------------------------------------------------------

class FakeTensor:
    """What the backend reads of a torch tensor, recording what is done to it."""

    def __init__(self, numel, dtype="torch.float32", contiguous=True, device_index=0, ptr=0x1000,
                 log=None, element_size=4):
        self._numel, self.dtype, self._contiguous = numel, dtype, contiguous
        self.device = SimpleNamespace(type="cuda", index=device_index)
        self._ptr, self._element_size = ptr, element_size
        self.log = [] if log is None else log
        self.shape = (numel,)

    def numel(self):
        return self._numel

    def element_size(self):
        return self._element_size

    def data_ptr(self):
        return self._ptr

    def is_contiguous(self):
        return self._contiguous

    def stride(self):
        return (1,) if self._contiguous else (2,)

    def mul_(self, factor):
        self.log.append(("mul_", self._ptr, factor))
        return self

    def copy_(self, other):
        self.log.append(("copy_", self._ptr, other.data_ptr()))
        return self

    def record_stream(self, stream):
        self.log.append(("record_stream", self._ptr, stream.name))


class FakeEvent:
    def __init__(self, log):
        self.log, self.done = log, False

    def record(self, stream):
        self.done = False
        self.log.append(("record", id(self), stream.name))

    def query(self):
        return self.done


class FakeStream:
    def __init__(self, name, handle, log):
        self.name, self.cuda_stream, self.log = name, handle, log

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, id(event)))


class FakeCuda:
    def __init__(self, log):
        self.log = log
        self.current = FakeStream("current", 0x10, log)
        self.capturing = False
        self._stack = []

    def current_stream(self, device=None):
        return self._stack[-1] if self._stack else self.current

    def is_current_stream_capturing(self):
        return self.capturing

    @contextlib.contextmanager
    def device(self, index):
        yield

    @contextlib.contextmanager
    def stream(self, s):
        self._stack.append(s)
        try:
            yield
        finally:
            self._stack.pop()

    def Event(self):  # noqa: N802 (torch's spelling)
        return FakeEvent(self.log)


class FakeSession:
    def __init__(self, log):
        self.log, self.error, self.aborted = log, None, None

    def run(self, *args):
        self.log.append(("run",) + args)

    def p2p(self, ops, stream):
        self.log.append(("p2p", ops, stream))

    def check(self):
        if self.error is not None:
            raise self.error

    def abort(self, reason):
        self.aborted = reason


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_backend(rank=1, size=2, timeout=60, hints=None, abort_process=False):
    """A backend on recording stand-ins of the session and of torch's CUDA API."""
    log = []
    backend = mscclpp_torchcomms.MscclppBackend()
    options = torchcomms.CommOptions()
    options.timeout = timedelta(seconds=timeout)
    options.abort_process_on_timeout_or_error = abort_process
    options.hints = dict(hints or {})
    backend._setup_options("t", options, rank, size)
    cuda = FakeCuda(log)
    backend._torch = SimpleNamespace(cuda=cuda)
    backend._session = FakeSession(log)
    backend._device_index = 0
    backend._stream = FakeStream("backend", 0x20, log)
    backend._barrier_buffer = FakeTensor(1, ptr=0xb0, log=log)
    backend._events = tb.EventPool(cuda.Event)
    return backend, log


# A PREMUL_SUM(2.0) whose factor is readable whichever torchcomms is under test.
PREMUL_SUM_2 = SimpleNamespace(type=SimpleNamespace(name="PREMUL_SUM"), factor=2.0)


def runs(log):
    return [entry[1:] for entry in log if entry[0] == "run"]


def test_non_contiguous_tensor_is_refused_not_copied():
    backend, log = make_backend()
    with pytest.raises(ValueError, match=r"all_reduce: tensor is not contiguous.*\.contiguous\(\)"):
        backend.all_reduce(FakeTensor(8, contiguous=False, log=log), torchcomms.ReduceOp.SUM, False)
    assert log == []


def test_tensor_on_another_device_is_refused():
    backend, _ = make_backend()
    with pytest.raises(ValueError, match="broadcast: tensor is on .* the communicator is on cuda:0"):
        backend.broadcast(FakeTensor(8, device_index=1), 0, False)


def test_unsupported_dtype_is_refused_naming_it():
    backend, _ = make_backend()
    with pytest.raises(ValueError, match="all_reduce: tensor: torch dtype torch.complex64"):
        backend.all_reduce(FakeTensor(8, dtype="torch.complex64"), torchcomms.ReduceOp.SUM, False)


@pytest.mark.parametrize("call, message", [
    (lambda b: b.broadcast(FakeTensor(4), 2, False), "broadcast: root 2 is not a rank"),
    (lambda b: b.send(FakeTensor(4), 1, False), "send: dst 1 is this rank"),
    (lambda b: b.recv(FakeTensor(4), -1, False), "recv: src -1 is not a rank"),
    (lambda b: b.all_gather([FakeTensor(4)], FakeTensor(4), False), "tensor_list has 1 tensors"),
    (lambda b: b.all_gather_single(FakeTensor(4), FakeTensor(4), False), "output has 4 elements, expected 8"),
    (lambda b: b.reduce_scatter_single(FakeTensor(4), FakeTensor(6), torchcomms.ReduceOp.SUM, False),
     "input has 6 elements, expected 8"),
    (lambda b: b.all_to_all_single(FakeTensor(5), FakeTensor(5), False), "5 elements do not split into 2"),
    (lambda b: b.all_reduce(FakeTensor(4), torchcomms.ReduceOp.BAND, False), "BAND needs an integer type"),
    (lambda b: b.all_reduce(FakeTensor(4, dtype="torch.int32"), PREMUL_SUM_2, False),
     "PREMUL_SUM needs a floating type"),
    (lambda b: b.all_gather_single(FakeTensor(8, dtype="torch.float16", element_size=2), FakeTensor(4), False),
     "tensors of different types"),
])
def test_bad_arguments_are_named(call, message):
    backend, log = make_backend()
    with pytest.raises(ValueError, match=message):
        call(backend)
    assert runs(log) == []


def test_split_rules():
    assert tb.check_split_ranks([2, 0], 0, 4) == [2, 0]
    assert tb.check_split_ranks([], 3, 4) == []
    with pytest.raises(ValueError, match="rank 1 appears more than once"):
        tb.check_split_ranks([1, 1], 1, 4)
    with pytest.raises(ValueError, match=r"this rank \(3\) is not in \[0, 1\]"):
        tb.check_split_ranks([0, 1], 3, 4)
    with pytest.raises(ValueError, match="split rank 4 is not a rank"):
        tb.check_split_ranks([4], 0, 4)


def test_reduce_ops_map_onto_the_runtime():
    R = torchcomms.ReduceOp
    assert [tb.reduce_op(op)[0] for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG)] == \
        ["sum", "prod", "min", "max", "avg"]
    assert [tb.reduce_op(op)[0] for op in (R.BAND, R.BOR, R.BXOR)] == ["BAND", "BOR", "BXOR"]
    if is_standin(torchcomms):
        assert tb.reduce_op(R.PREMUL_SUM(2.0)) == ("premul_sum", 2.0)
    no_factor = SimpleNamespace(type=SimpleNamespace(name="PREMUL_SUM"))
    with pytest.raises(ValueError, match="does not give Python backends the PREMUL_SUM factor"):
        tb.reduce_op(no_factor)


def test_accumulation_type_comes_from_a_hint():
    assert tb.accum_dtype({}) is None
    assert tb.accum_dtype({"mscclpp.accum_dtype": "float32"}) == "f32"
    assert tb.accum_dtype({"mscclpp.accum_dtype": "half"}) == "f16"
    with pytest.raises(ValueError, match="mscclpp.accum_dtype='int8'"):
        tb.accum_dtype({"mscclpp.accum_dtype": "int8"})
    backend, log = make_backend(hints={"mscclpp.accum_dtype": "float16"})
    backend.all_reduce(FakeTensor(4, dtype="torch.float8_e4m3fn", element_size=1),
                       torchcomms.ReduceOp.SUM, False)
    assert runs(log)[0][-1] == "f16"
    backend.all_reduce(FakeTensor(4, dtype="torch.int32"), torchcomms.ReduceOp.SUM, False)
    assert runs(log)[1][-1] is None, "types the kernels cannot widen keep their own"
    assert tb.accumulator("bf16", "f32") == "f32" and tb.accumulator("bf16", "f16") is None


# ---- the work contract -----------------------------------------------------------------------

def test_sync_operation_runs_on_the_current_stream_and_returns_none():
    backend, log = make_backend()
    t = FakeTensor(16, log=log)
    assert backend.all_reduce(t, torchcomms.ReduceOp.SUM, False) is None
    assert runs(log) == [("allreduce", 0x1000, 0x1000, 64, 64, "f32", "sum", 0, 0x10, None)]
    assert not any(e[0] in ("record", "wait_event") for e in log), "no events in the sync path"


def test_async_operation_waits_for_the_current_stream_and_returns_a_work():
    backend, log = make_backend()
    t = FakeTensor(16, log=log)
    work = backend.all_reduce(t, torchcomms.ReduceOp.MAX, True)
    kinds = [e[0] for e in log]
    # Ordered after the caller's stream, run on the backend's, the tensor kept for that stream.
    assert kinds == ["record", "wait_event", "run", "record_stream", "record"]
    assert log[0][2] == "current" and log[1][1] == "backend"
    assert runs(log) == [("allreduce", 0x1000, 0x1000, 64, 64, "f32", "max", 0, 0x20, None)]
    assert log[-1][2] == "backend"
    assert not work.is_completed()
    work.wait()
    assert log[-1][:2] == ("wait_event", "current"), "wait() orders the current stream after it"
    work._event.done = True
    assert work.is_completed()
    assert work._event in backend._events._free, "the event goes back to the pool"


def test_events_come_from_a_pool():
    backend, _ = make_backend()
    t = FakeTensor(4)
    first = backend.all_reduce(t, torchcomms.ReduceOp.SUM, True)
    first._event.done = True
    assert first.is_completed()
    pooled = first._event
    second = backend.all_reduce(t, torchcomms.ReduceOp.SUM, True)
    assert second._event is pooled


def test_input_deleted_before_wait_stays_alive_until_done():
    backend, _ = make_backend()
    t = FakeTensor(4)
    alive = weakref.ref(t)
    work = backend.all_reduce(t, torchcomms.ReduceOp.SUM, True)
    del t
    gc.collect()
    assert alive() is not None, "the work holds its tensors"
    work._event.done = True
    work.wait()
    del work
    backend.barrier(False)  # any later call retires completed works
    gc.collect()
    assert alive() is None


def test_premul_sum_scales_by_the_factor_then_sums():
    if not is_standin(torchcomms):
        pytest.skip("the real torchcomms does not give Python backends the factor")
    backend, log = make_backend()
    t = FakeTensor(4, log=log)
    backend.all_reduce(t, torchcomms.ReduceOp.PREMUL_SUM(2.0), False)
    assert log[0] == ("mul_", 0x1000, 2.0)
    assert runs(log)[0][5:7] == ("f32", "sum")


def test_zero_elements_enqueue_nothing():
    backend, log = make_backend()
    backend.all_reduce(FakeTensor(0), torchcomms.ReduceOp.SUM, False)
    backend.all_gather_single(FakeTensor(0), FakeTensor(0), False)
    assert runs(log) == []


def test_list_variants_are_one_group_of_sends_and_receives():
    backend, log = make_backend(rank=0, size=3)
    out = [FakeTensor(4, ptr=0x100 * (i + 1), log=log) for i in range(3)]
    mine = FakeTensor(4, ptr=0x9000, log=log)
    backend.all_gather(out, mine, False)
    (p2p,) = [e for e in log if e[0] == "p2p"]
    # The copy into this rank's own slot is the group's send to itself.
    assert p2p[1] == [("send", 0, 0x9000, 16), ("send", 1, 0x9000, 16), ("send", 2, 0x9000, 16),
                      ("recv", 0, 0x100, 16), ("recv", 1, 0x200, 16), ("recv", 2, 0x300, 16)]


def test_timeout_aborts_and_names_the_operation_and_rank():
    backend, _ = make_backend(timeout=5)
    clock = Clock()
    t = FakeTensor(4)
    work = backend.all_reduce(t, torchcomms.ReduceOp.SUM, True)
    work._clock, work._start = clock, 0.0
    clock.now = 4.0
    assert not work.is_completed()
    clock.now = 6.0
    with pytest.raises(TimeoutError, match="all_reduce on rank 1 of communicator 't' did not complete"):
        work.is_completed()
    assert "all_reduce on rank 1" in backend._session.aborted
    assert backend.is_aborted()
    with pytest.raises(mscclpp.MscclppError, match="broadcast on rank 1 of communicator 't': aborted"):
        backend.broadcast(t, 0, False)


def test_an_error_the_runtime_recorded_names_the_operation():
    backend, _ = make_backend()
    backend._session.error = RuntimeError("rank 0 died")
    with pytest.raises(RuntimeError, match="reduce on rank 1 of communicator 't': rank 0 died"):
        backend.reduce(FakeTensor(4), 0, torchcomms.ReduceOp.SUM, False)
    assert backend._session.aborted is not None


def test_abort_is_the_communicators():
    backend, _ = make_backend()
    backend.abort("user asked")
    assert backend._session.aborted == "user asked"
    with pytest.raises(mscclpp.MscclppError, match="aborted .user asked."):
        backend.barrier(False)


def test_capture_polls_nothing():
    backend, _ = make_backend(timeout=1)
    backend._torch.cuda.capturing = True
    work = backend.all_reduce(FakeTensor(4), torchcomms.ReduceOp.SUM, True)
    work._start = -100.0
    assert not work.is_completed(), "event queries are not allowed while capturing"
    work.wait()


@pytest.mark.parametrize("rank", [0, 1])
def test_scatter_and_gather_are_one_group_each(rank):
    backend, log = make_backend(rank=rank, size=2)
    parts = [FakeTensor(4, ptr=0x100), FakeTensor(4, ptr=0x200)] if rank == 0 else []
    out = FakeTensor(4, ptr=0x900)
    backend.scatter(out, parts, 0, False)
    backend.gather(parts, out, 0, False)
    groups = [e[1] for e in log if e[0] == "p2p"]
    if rank == 0:
        assert groups == [
            [("send", 0, 0x100, 16), ("send", 1, 0x200, 16), ("recv", 0, 0x900, 16)],
            [("send", 0, 0x900, 16), ("recv", 0, 0x100, 16), ("recv", 1, 0x200, 16)],
        ]
    else:
        assert groups == [[("recv", 0, 0x900, 16)], [("send", 0, 0x900, 16)]]


def test_the_event_pool_keeps_at_most_its_size():
    made = []
    pool = tb.EventPool(lambda: made.append(object()) or made[-1], max_size=1)
    a, b = pool.get(), pool.get()
    pool.put(a)
    pool.put(b)
    assert len(pool) == 1 and pool.get() is a
