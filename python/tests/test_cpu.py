"""CPU tests of the package: import, enums, dtype maps, bootstrap across processes, errors."""

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys

import pytest

import mscclpp
import mscclpp.utils as mscclpp_utils


def _gpu_usable():
    try:
        mscclpp.backend_name()
        return True
    except mscclpp.MscclppError:
        return False


def test_enums_use_the_runtime_spelling():
    assert mscclpp.DataType.bfloat16.value == "bf16"
    assert mscclpp.DataType.float8_e4m3.size == 1
    assert mscclpp.DataType.int32.size == 4
    assert mscclpp.DataType.uint64.size == 8
    assert {op.name for op in mscclpp.ReduceOp} == {"NOP", "SUM", "PROD", "MIN", "MAX", "AVG"}


@pytest.mark.parametrize(
    "torch_name, expected",
    [
        ("torch.float16", mscclpp.DataType.float16),
        ("torch.bfloat16", mscclpp.DataType.bfloat16),
        ("torch.float32", mscclpp.DataType.float32),
        ("torch.int32", mscclpp.DataType.int32),
        ("torch.uint8", mscclpp.DataType.uint8),
        ("torch.float8_e4m3fn", mscclpp.DataType.float8_e4m3),
        ("torch.float8_e5m2", mscclpp.DataType.float8_e5m2),
    ],
)
def test_torch_dtype_map(torch_name, expected):
    assert mscclpp_utils.torch_dtype_to_mscclpp_dtype(torch_name) is expected


def test_unknown_torch_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="torch.complex64 has no mscclpp DataType"):
        mscclpp_utils.torch_dtype_to_mscclpp_dtype("torch.complex64")


def test_default_algorithms_are_named_before_any_communicator():
    collection = mscclpp.AlgorithmCollectionBuilder().build_default_algorithms(
        scratch_buffer=0, scratch_buffer_size=1 << 27, rank=0
    )
    names = {(a.collective, a.name) for a in collection}
    assert ("allreduce", "default_allreduce_packet") in names
    assert ("allgather", "default_allgather_fullmesh2") in names
    assert ("reducescatter", "default_reducescatter_packet") in names
    assert ("broadcast", "default_broadcast_zero_copy") in names


def test_execute_refuses_what_it_cannot_run():
    algo = next(iter(mscclpp.AlgorithmCollectionBuilder().build_default_algorithms()))
    with pytest.raises(TypeError, match="takes no executor"):
        algo.execute(None, 0, 0, 4, 4, mscclpp.DataType.float32, executor=object())
    with pytest.raises(TypeError, match="comm must be an mscclpp Communicator or CommGroup"):
        algo.execute(None, 0, 0, 4, 4, mscclpp.DataType.float32, op=mscclpp.ReduceOp.SUM)


def test_nvls_is_off_unless_enabled():
    assert mscclpp.is_nvls_supported() is False


def test_env_lists_the_recognised_variables():
    # The environment is parsed once per process, so look at a fresh one.
    code = "import mscclpp; print(mscclpp.env()['MSCCLPP_BOOTSTRAP_TIMEOUT'])"
    env = dict(os.environ, MSCCLPP_BOOTSTRAP_TIMEOUT="17")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "17", out.stderr


def test_an_invalid_variable_is_an_error_naming_it():
    code = "import mscclpp; mscclpp.env()"
    env = dict(os.environ, MSCCLPP_BOOTSTRAP_TIMEOUT="soon")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "MSCCLPP_BOOTSTRAP_TIMEOUT" in out.stderr


@pytest.mark.parametrize("given, expected", [(None, "32"), ("1", "1"), ("8", "8")])
def test_import_gives_cuda_its_most_hardware_queues_unless_the_user_chose(given, expected):
    # A fresh process: the default must be in place when the import returns, before any CUDA call.
    code = "import os, mscclpp; print(os.environ['CUDA_DEVICE_MAX_CONNECTIONS'])"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if given is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = given
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == expected, out.stderr


def test_tuning_table_yaml_round_trip(tmp_path):
    table = mscclpp.TuningTable()
    path = tmp_path / "t.yaml"
    table.save_yaml(str(path))
    assert len(mscclpp.TuningTable.load_yaml(str(path))) == 0
    with pytest.raises(Exception, match="bad.yaml"):
        mscclpp.TuningTable.from_yaml("entries: [1, 2", "bad.yaml")


@pytest.mark.skipif(_gpu_usable(), reason="a GPU backend is usable here")
def test_no_gpu_is_an_exception_naming_why():
    with pytest.raises(mscclpp.MscclppError, match="unavailable"):
        mscclpp.RawGpuBuffer(1 << 20)
    with pytest.raises(mscclpp.MscclppError, match="unavailable"):
        mscclpp.CommGroup(interfaceIpPortTrio=f"127.0.0.1:{_free_port()}", rank=0, size=1)


def test_comm_group_arguments_are_checked():
    with pytest.raises(ValueError, match="needs rank and size"):
        mscclpp.CommGroup(interfaceIpPortTrio="lo:127.0.0.1:1")
    with pytest.raises(ValueError, match="takes one of"):
        mscclpp.CommGroup(interfaceIpPortTrio="lo:127.0.0.1:1", store=object(), rank=0, size=1)


def test_bad_bootstrap_arguments():
    with pytest.raises(ValueError, match="rank 3 is not in 0..2"):
        mscclpp.TcpBootstrap.from_address(f"127.0.0.1:{_free_port()}", 3, 2)
    with pytest.raises(Exception, match="(?i)unique ?id"):
        mscclpp.TcpBootstrap.from_unique_id(b"short", 0, 1)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_by_address(address, rank, size, out):
    boot = mscclpp.TcpBootstrap.from_address(address, rank, size)
    gathered = boot.all_gather(bytes([rank]) * (rank + 1))
    root = boot.broadcast(0, b"from-root" if rank == 0 else b"")
    boot.barrier()
    out.put((rank, boot.size, gathered, root))


def _rank_by_unique_id(ids, rank, size, out):
    if rank == 0:
        uid = mscclpp.TcpBootstrap.create_unique_id()
        for _ in range(size - 1):
            ids.put(uid)
    else:
        uid = ids.get(timeout=30)
    boot = mscclpp.TcpBootstrap.from_unique_id(uid, rank, size)
    out.put((rank, boot.size, boot.all_gather(bytes([rank])), b""))


def _run_ranks(target, size, *args):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, r, size, out)) for r in range(size)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


def test_bootstrap_across_processes_on_loopback():
    size = 3
    results = _run_ranks(_rank_by_address, size, f"127.0.0.1:{_free_port()}")
    for rank, (r, n, gathered, root) in enumerate(results):
        assert (r, n) == (rank, size)
        assert gathered == [bytes([p]) * (p + 1) for p in range(size)]
        assert root == b"from-root"


def test_bootstrap_from_a_unique_id():
    ctx = mp.get_context("spawn")
    results = _run_ranks(_rank_by_unique_id, 2, ctx.Queue())
    assert [r[2] for r in results] == [[b"\x00", b"\x01"]] * 2


def test_custom_algorithm_checks_its_arguments():
    calls = []
    algo = mscclpp.CustomAlgorithm("mine", "allgather", lambda *args: calls.append(args))
    assert (algo.name, algo.collective) == ("mine", "allgather")
    with pytest.raises(TypeError, match="comm must be"):
        algo.execute(object(), 0, 0, 4, 8, mscclpp.DataType.float32)
    assert calls == []


def test_compile_native_arguments():
    with pytest.raises(ValueError, match="exactly one of file= and source="):
        mscclpp.compile_native("k")


@pytest.mark.skipif(_gpu_usable(), reason="a GPU backend is usable here")
def test_compile_native_without_gpu_says_why():
    with pytest.raises(mscclpp.MscclppError, match="unavailable"):
        mscclpp.compile_native("k", source='extern "C" __global__ void k() {}')


def _fixture_dir():
    """The shared plan fixtures: MSCCLPP_PLAN_FIXTURES, else beside the repository (as CI checks
    them out), else the workspace's copy."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for d in (
        os.environ.get("MSCCLPP_PLAN_FIXTURES"),
        os.path.join(repo, "..", "shared", "fixtures", "plans"),
        "/work/shared/fixtures/plans",
    ):
        if d and os.path.isdir(d):
            return d
    return None


_FIXTURES = _fixture_dir()
_PLAN_FILES = sorted(f for f in os.listdir(_FIXTURES) if f.endswith(".json")) if _FIXTURES else []
needs_fixtures = pytest.mark.skipif(
    not _PLAN_FILES, reason="no fixture plans (set MSCCLPP_PLAN_FIXTURES)"
)


@needs_fixtures
@pytest.mark.parametrize("file", _PLAN_FILES)
def test_every_fixture_plan_parses(file):
    path = os.path.join(_FIXTURES, file)
    with open(path) as f:
        doc = json.load(f)
    plan = mscclpp.ExecutionPlan(path, 0)
    assert plan.name == doc["name"]
    assert plan.collective == doc["collective"]
    assert plan.protocol == doc["protocol"]
    assert plan.inplace == doc["inplace"]
    assert plan.world_size == len(doc["gpus"])
    assert plan.min_message_size == doc.get("min_message_size", 0)
    if "max_message_size" in doc:
        assert plan.max_message_size == doc["max_message_size"]
    assert plan.path == path and doc["name"] in repr(plan)


@needs_fixtures
def test_a_malformed_plan_is_a_value_error_naming_file_and_json_path(tmp_path):
    with open(os.path.join(_FIXTURES, "allreduce_packet_2gpu.json")) as f:
        doc = json.load(f)
    doc["gpus"][1]["threadblocks"][0]["ops"][0]["name"] = "teleport"
    bad = tmp_path / "bad_plan.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as err:
        mscclpp.ExecutionPlan(str(bad))
    message = str(err.value)
    assert "bad_plan.json" in message and "gpus[1].threadblocks[0].ops[0]" in message, message
    assert "teleport" in message, message
    with pytest.raises(ValueError, match="bad_plan.json: not valid JSON"):
        bad.write_text('{"name": ')
        mscclpp.ExecutionPlan(str(bad))
    with pytest.raises(ValueError, match="missing.json: no such file"):
        mscclpp.ExecutionPlan(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="is a directory"):
        mscclpp.ExecutionPlan(str(tmp_path))
    with pytest.raises(ValueError, match="rank 2 is not in 0..2"):
        mscclpp.ExecutionPlan(os.path.join(_FIXTURES, "allreduce_packet_2gpu.json"), rank=2)


@needs_fixtures
def test_a_registered_plan_joins_the_collection():
    plan = mscclpp.ExecutionPlan(os.path.join(_FIXTURES, "allreduce_packet_2gpu.json"))
    dsl = mscclpp.Algorithm("mine", execution_plan=plan, tags={"fast": 1})
    assert dsl.is_dsl_algorithm() and not dsl.is_native_algorithm()
    assert (dsl.name, dsl.collective, dsl.id) == ("allreduce_pkt", "allreduce", "mine")
    # The sizes it runs with: the plan's range, capped by its set-up's scratch (an LL plan's
    # unbounded range is not what a call may ask for).
    low, high = dsl.message_size_range
    assert (low, high) == plan.runnable_message_size_range
    assert low == plan.min_message_size and 0 < high <= plan.max_message_size
    assert high <= 8 << 20
    builder = mscclpp.AlgorithmCollectionBuilder()
    builder.add_algorithm_builder(dsl)
    algos = builder.build_default_algorithms(rank=0)
    by_name = algos.by_collective()["allreduce"]
    assert by_name["allreduce_pkt"].is_dsl_algorithm() and by_name["allreduce_pkt"].tags == {"fast": 1}
    assert by_name["default_allreduce_packet"].is_native_algorithm()
    assert [a.name for a in builder.build()] == ["allreduce_pkt"]
    with pytest.raises(ValueError, match="takes a DSL algorithm"):
        builder.add_algorithm_builder(by_name["default_allreduce_packet"])
    with pytest.raises(TypeError, match="makes a DSL algorithm from execution_plan"):
        mscclpp.Algorithm("x")
    with pytest.raises(TypeError, match="comm must be an mscclpp Communicator or CommGroup"):
        mscclpp.Executor(None)
    assert mscclpp.PacketType.LL8.value == "LL8"


class _FakeComm:
    rank, size = 0, 2


class _FakeExecutor:
    """Stands in for the native executor: records the plans it is asked to run."""

    made = []

    def __init__(self, comm):
        self.comm, self.runs = comm, []
        _FakeExecutor.made.append(self)

    def execute(self, rank, inp, out, in_size, out_size, dtype, plan, stream, packet, op=None):
        self.runs.append((rank, plan.name, dtype, packet, op))


class _FakeNativeAlgorithm:
    def __init__(self, name, collective):
        self.name, self.collective = name, collective


class _FakeCollection:
    """Stands in for the runtime's collection: keeps what it was built with; selects the first
    plan, as the runtime's selector does for a call a plan covers."""

    @staticmethod
    def build_default(comm, scratch_bytes, stream, plans, executor, defaults):
        c = _FakeCollection()
        c.plans, c.executor, c.defaults = plans, executor, defaults
        return c

    def algorithms(self):
        natives = [_FakeNativeAlgorithm("default_allreduce_packet", "allreduce")] if self.defaults else []
        return natives + [_FakeNativeAlgorithm(p.name, p.collective) for p in self.plans]

    def select(self, collective, message_size, dtype, stream, symmetric_memory, in_place):
        return _FakeNativeAlgorithm(self.plans[0].name, collective)


@needs_fixtures
def test_a_registered_plan_is_selected_and_runs_on_the_collections_executor(monkeypatch):
    from mscclpp import _mscclpp

    monkeypatch.setattr(_mscclpp, "Communicator", _FakeComm)
    monkeypatch.setattr(_mscclpp, "NativeExecutor", _FakeExecutor)
    monkeypatch.setattr(_mscclpp, "NativeAlgorithmCollection", _FakeCollection)
    plan = mscclpp.ExecutionPlan(os.path.join(_FIXTURES, "allreduce_packet_2gpu.json"))
    builder = mscclpp.AlgorithmCollectionBuilder()
    builder.add_algorithm_builder(mscclpp.Algorithm(execution_plan=plan))
    comm = _FakeComm()
    for algos, defaults in ((builder.build_default_algorithms(rank=0), True), (builder.build(), False)):
        chosen = algos.select(comm, "allreduce", 4096, mscclpp.DataType.float32)
        assert chosen.name == "allreduce_pkt" and chosen.is_dsl_algorithm()
        built = algos.native_collection(comm)
        assert built.defaults is defaults and built.plans == [plan]
        # Without an executor the collection's own runs the plan; with one, that one does.
        chosen.execute(comm, 1, 1, 4096, 4096, mscclpp.DataType.float32)
        assert built.executor.runs == [(0, "allreduce_pkt", "f32", "LL16", None)]
        mine = mscclpp.Executor(comm)
        chosen.execute(comm, 1, 1, 4096, 4096, mscclpp.DataType.bfloat16, op=mscclpp.ReduceOp.SUM,
                       executor=mine)
        assert mine._native.runs == [(0, "allreduce_pkt", "bf16", "LL16", "sum")]
        with pytest.raises(TypeError, match="executor must be an mscclpp.Executor"):
            chosen.execute(comm, 1, 1, 4096, 4096, mscclpp.DataType.float32, executor=object())
    # An Algorithm of no collection, given no executor, runs on one of its own per communicator.
    alone = mscclpp.Algorithm(execution_plan=plan)
    alone.execute(comm, 1, 1, 4096, 4096, mscclpp.DataType.float32)
    alone.execute(comm, 1, 1, 4096, 4096, mscclpp.DataType.float32)
    (own,) = [e for _, e in alone._executors.values()]
    assert own.runs == [(0, "allreduce_pkt", "f32", "LL16", None)] * 2
    mine.execute(0, 1, 1, 8, 8, mscclpp.DataType.float32, plan, packet_type=mscclpp.PacketType.LL8)
    assert mine._native.runs[-1] == (0, "allreduce_pkt", "f32", "LL8", None)


def test_comm_result_codes_are_mscclpps():
    assert [(c.name, int(c)) for c in mscclpp.CommResult] == [
        ("COMM_SUCCESS", 0),
        ("COMM_UNHANDLED_CUDA_ERROR", 1),
        ("COMM_SYSTEM_ERROR", 2),
        ("COMM_INTERNAL_ERROR", 3),
        ("COMM_INVALID_ARGUMENT", 4),
        ("COMM_INVALID_USAGE", 5),
        ("COMM_REMOTE_ERROR", 6),
        ("COMM_IN_PROGRESS", 7),
        ("COMM_NUM_RESULTS", 8),
    ]
    assert mscclpp.CommResult.COMM_SUCCESS == 0 and not mscclpp.CommResult.COMM_SUCCESS


class _ShapedNativeAlgorithm(_FakeNativeAlgorithm):
    """Stands in for a runtime algorithm: returns the runtime's codes (4 for a launch shape beyond
    66 blocks or threads not a multiple of 32, 0 once enqueued) and raises for a bad size."""

    def __init__(self, name, collective):
        super().__init__(name, collective)
        self.launched = []

    def execute(self, comm, inp, out, in_size, out_size, dtype, op, stream, nblocks, nthreads,
                accum):
        if in_size % 4:
            raise ValueError(f"input size {in_size} bytes is not a multiple of 4")
        if nblocks > 66 or nthreads % 32:
            return 4
        self.launched.append((nblocks, nthreads))
        return 0


class _ShapedCollection(_FakeCollection):
    @staticmethod
    def build_default(comm, scratch_bytes, stream, plans, executor, defaults):
        c = _ShapedCollection()
        c.plans, c.executor, c.defaults = plans, executor, defaults
        c.native = _ShapedNativeAlgorithm("default_allreduce_packet", "allreduce")
        return c

    def algorithms(self):
        return [self.native]


def test_the_guides_tuning_loop_skips_launch_shapes_by_their_code(monkeypatch):
    from mscclpp import _mscclpp

    monkeypatch.setattr(_mscclpp, "Communicator", _FakeComm)
    monkeypatch.setattr(_mscclpp, "NativeExecutor", _FakeExecutor)
    monkeypatch.setattr(_mscclpp, "NativeAlgorithmCollection", _ShapedCollection)
    algos = mscclpp.AlgorithmCollectionBuilder().build_default_algorithms(rank=0)
    algo = algos.by_collective()["allreduce"]["default_allreduce_packet"]
    comm, f32, ran = _FakeComm(), mscclpp.DataType.float32, []
    for nblocks in (128, 8):
        for nthreads in (100, 512):
            rc = algo.execute(comm, 1, 2, 4096, 4096, f32, op=mscclpp.ReduceOp.SUM,
                              nblocks=nblocks, nthreads_per_block=nthreads)
            assert isinstance(rc, int) and isinstance(rc, mscclpp.CommResult)
            if rc != 0:  # skip unsupported configs
                assert rc is mscclpp.CommResult.COMM_INVALID_ARGUMENT
                continue
            assert rc is mscclpp.CommResult.COMM_SUCCESS
            ran.append((nblocks, nthreads))
    assert ran == [(8, 512)] == algos.native_collection(comm).native.launched
    # Anything but a launch shape still raises.
    with pytest.raises(ValueError, match="not a multiple"):
        algo.execute(comm, 1, 2, 4097, 4097, f32, op=mscclpp.ReduceOp.SUM, nblocks=128)
    with pytest.raises(ValueError, match="op must not be ReduceOp.NOP"):
        algo.execute(comm, 1, 2, 4096, 4096, f32, nblocks=128)


def test_a_custom_algorithm_returns_its_launchs_code(monkeypatch):
    from mscclpp import _mscclpp

    monkeypatch.setattr(_mscclpp, "Communicator", _FakeComm)
    codes = iter([None, mscclpp.CommResult.COMM_INVALID_ARGUMENT])
    algo = mscclpp.CustomAlgorithm("mine", "allgather", lambda *args: next(codes))
    call = (_FakeComm(), 1, 2, 4, 8, mscclpp.DataType.float32)
    assert algo.execute(*call) is mscclpp.CommResult.COMM_SUCCESS
    assert algo.execute(*call, nblocks=1 << 16) == 4


@needs_fixtures
def test_a_plan_takes_any_launch_shape(monkeypatch):
    from mscclpp import _mscclpp

    monkeypatch.setattr(_mscclpp, "Communicator", _FakeComm)
    monkeypatch.setattr(_mscclpp, "NativeExecutor", _FakeExecutor)
    plan = mscclpp.ExecutionPlan(os.path.join(_FIXTURES, "allreduce_packet_2gpu.json"))
    comm = _FakeComm()
    mine = mscclpp.Executor(comm)
    rc = mscclpp.Algorithm(execution_plan=plan).execute(
        comm, 1, 1, 4096, 4096, mscclpp.DataType.float32, executor=mine, nblocks=1 << 16,
        nthreads_per_block=100,
    )
    assert rc is mscclpp.CommResult.COMM_SUCCESS and len(mine._native.runs) == 1
