"""The plans of our DSL programs (python/examples/dsl/algorithms.py), CPU only: each is proved
by the executor's reference interpreter on random data of every dtype (`check_plan`, what
`mscclpp-bench plan-check` runs) at 2, 4 and 8 ranks, and matches its golden plan; then
`mscclpp.compile` and its cache; then a fuzz of DSL calls that must give an error or a valid
plan, never a plan the executor refuses.

Golden plans: python/tests/golden/dsl/ holds the 2-rank plans whole and a digest of the 4- and
8-rank ones. After an intended change, rewrite them with MSCCLPP_UPDATE_GOLDEN=1 and review the
diff."""

import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import mscclpp
from mscclpp import _mscclpp
from mscclpp.language import (AlgoSpec, AllGather, AllReduce, Buffer, CollectiveProgram, DslError,
                              MemoryChannel, PortChannel, Rank, ReplicationPolicy, ThreadBlockGroup)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "dsl"))
import algorithms  # noqa: E402

GOLDEN = HERE / "golden" / "dsl"
UPDATE = os.environ.get("MSCCLPP_UPDATE_GOLDEN") == "1"
CASES = [(name, n) for name in algorithms.ALGORITHMS for n in (2, 4, 8)]


def plan_of(name, n):
    program = algorithms.ALGORITHMS[name][0]
    return program(algorithms.spec_for(name, n)).to_dict()


def digest(plan):
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("name, n", CASES)
def test_every_plan_is_proved_on_random_data(name, n):
    text = json.dumps(plan_of(name, n))
    line = _mscclpp.check_plan(text, f"{name}@{n}", n)
    assert ": ok:" in line, line


# The all-reduce programs compiled in place, as the interposition example and
# gpu_dsl_shim_check.py register them for dist.all_reduce.
IN_PLACE_CASES = [(name, n) for name, entry in algorithms.ALGORITHMS.items()
                  if entry[1] is AllReduce and entry[5] for n in (2, 4, 8)]


@pytest.mark.parametrize("name, n", IN_PLACE_CASES)
def test_every_all_reduce_is_proved_in_place_too(name, n):
    plan = algorithms.ALGORITHMS[name][0](algorithms.spec_for(name, n, in_place=True)).to_dict()
    assert plan["inplace"]
    line = _mscclpp.check_plan(json.dumps(plan), f"{name}@{n} in place", n)
    assert ": ok:" in line, line


def test_plans_match_their_golden_copies():
    digests_path = GOLDEN / "digests.json"
    digests = {f"{name}_{n}": digest(plan_of(name, n)) for name, n in CASES if n != 2}
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name in algorithms.ALGORITHMS:
            (GOLDEN / f"{name}_2.json").write_text(json.dumps(plan_of(name, 2), indent=1) + "\n")
        digests_path.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    changed = [name for name in algorithms.ALGORITHMS
               if json.loads((GOLDEN / f"{name}_2.json").read_text()) != plan_of(name, 2)]
    want = json.loads(digests_path.read_text())
    changed += [k for k in digests if want.get(k) != digests[k]]
    assert not changed, f"plans differ from python/tests/golden/dsl (MSCCLPP_UPDATE_GOLDEN=1 rewrites): {changed}"


def test_a_wrong_plan_is_caught_by_the_checker():
    plan = plan_of("allgather_put", 2)
    # Rank 0 forgets its own slot: its output element 0 is never written.
    ops = plan["gpus"][0]["threadblocks"][0]["ops"]
    ops[:] = [op for op in ops if op["name"] != "copy"]
    with pytest.raises(ValueError, match="wrong result"):
        _mscclpp.check_plan(json.dumps(plan), "broken", 2)


# The default plans (mscclpp.default_algos) and `python -m mscclpp --install`.

@pytest.mark.parametrize("nodes, gpus", [(1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (3, 2)])
@pytest.mark.parametrize("group", [1, 2])
def test_the_multi_node_allreduce_is_proved(nodes, gpus, group):
    from mscclpp.default_algos import allreduce_multi_nodes

    world = nodes * gpus
    spec = AlgoSpec(name="ml", collective=AllReduce(world, 1, True), nranks_per_node=gpus, world_size=world,
                    in_place=True, instances=1, protocol="LL", use_double_scratch_buffer=True)
    text = allreduce_multi_nodes(spec, thread_block_group_size=group).to_json()
    assert ": ok:" in _mscclpp.check_plan(text, f"ml {nodes}x{gpus}", world)


def test_install_writes_the_default_plans_and_each_is_proved(tmp_path):
    env = dict(os.environ, MSCCLPP_CACHE_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-m", "mscclpp", "--install"], check=True, env=env, capture_output=True)
    files = sorted((tmp_path / "default").glob("*.json"))
    assert [f.name for f in files] == ["allreduce_2nodes_128K_2M.json", "allreduce_2nodes_1K_64K.json",
                                       "allreduce_4nodes_128K_2M.json", "allreduce_4nodes_1K_64K.json"]
    for f in files:
        plan = mscclpp.ExecutionPlan(str(f))
        nodes = int(f.name.split("_")[1][0])
        assert (plan.world_size, plan.collective, plan.protocol, plan.inplace) == (8 * nodes, "allreduce", "LL", True)
        small = "1K_64K" in f.name
        assert (plan.min_message_size, plan.max_message_size) == ((1 << 10, 64 << 10) if small else (128 << 10, 2 << 20))
        assert ": ok:" in _mscclpp.check_plan(f.read_text(), f.name, plan.world_size)


# The sizes the GPU check runs each plan at (gpu_dsl_check.py, through dsl_check_sizes).

@pytest.mark.parametrize("name, n", CASES)
def test_the_gpu_check_runs_every_plan_within_its_runnable_range(name, n, tmp_path):
    from dsl_check_sizes import CHUNK_ELEMS, chunk_sizes

    path = tmp_path / f"{name}_{n}.json"
    plan_dict = plan_of(name, n)
    path.write_text(json.dumps(plan_dict))
    algo = mscclpp.Algorithm(execution_plan=mscclpp.ExecutionPlan(str(path)))
    low, high = algo.message_size_range
    assert (low, high) == algo.execution_plan.runnable_message_size_range
    assert low == plan_dict["min_message_size"] and high <= plan_dict["max_message_size"]
    chunks = plan_dict["gpus"][0]["input_chunks"]
    for itemsize in (4, 2):  # float32, bfloat16
        sizes, notes = chunk_sizes((low, high), chunks, itemsize)
        assert sizes, notes
        assert all(low <= chunks * e * itemsize <= high for e in sizes), (sizes, low, high)
        assert len(notes) == sum(chunks * e * itemsize > high or chunks * e * itemsize < low for e in CHUNK_ELEMS)


def test_the_two_node_allreduce_is_not_run_beyond_its_staging(tmp_path):
    # Session 34's GPU check ran it at 64 Ki float32 per chunk (512 KiB), which its port channels'
    # staging cannot hold: refused by the executor. The check now runs the largest size that fits.
    from dsl_check_sizes import chunk_sizes

    path = tmp_path / "two_nodes.json"
    path.write_text(json.dumps(plan_of("allreduce_two_nodes", 2)))
    plan = mscclpp.ExecutionPlan(str(path))
    low, high = plan.runnable_message_size_range
    assert high < plan.max_message_size and high < 2 * 65536 * 4
    sizes, notes = chunk_sizes((low, high), 2, 4)
    assert sizes[-1] * 2 * 4 <= high < sizes[-1] * 2 * 4 * 2 and len(notes) == 1, (sizes, notes)


# mscclpp.compile and its cache.

def spec(**changes):
    return dataclasses.replace(algorithms.spec_for("allgather_put", 2), **changes)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MSCCLPP_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_compile_returns_a_dsl_algorithm_with_the_specs_tags(cache):
    algo = mscclpp.compile(algo=algorithms.allgather_put, algo_spec=spec(tags={"tier": "fast"}), rank=1)
    assert isinstance(algo, mscclpp.Algorithm) and algo.is_dsl_algorithm()
    assert algo.tags == {"tier": "fast"} and algo.collective == "allgather"
    assert algo.execution_plan.world_size == 2 and algo.execution_plan.name == "allgather_put_2"
    (path,) = cache.glob("*.json")
    assert algo.id == path.stem and algo.execution_plan.path == str(path)
    assert not list(cache.glob(".*tmp")), "no temporary file is left behind"


def test_the_cache_key_covers_every_spec_field_and_argument(cache):
    base = spec()
    variants = [
        base,
        dataclasses.replace(base, name="other"),
        dataclasses.replace(base, collective=AllGather(2, 2, False)),
        dataclasses.replace(base, nranks_per_node=1),
        dataclasses.replace(base, in_place=True),
        dataclasses.replace(base, instances=2),
        dataclasses.replace(base, protocol="LL"),
        dataclasses.replace(base, instr_fusion=False),
        dataclasses.replace(base, auto_sync=False),
        dataclasses.replace(base, replication_policy=ReplicationPolicy.none),
        dataclasses.replace(base, reuse_resources=True),
        dataclasses.replace(base, num_threads_per_block=512),
        dataclasses.replace(base, use_double_scratch_buffer=True),
        dataclasses.replace(base, buffer_alignment=32),
        dataclasses.replace(base, min_message_size=1),
        dataclasses.replace(base, max_message_size=1 << 20),
        dataclasses.replace(base, tags={"a": 1}),
    ]
    ids = {mscclpp.compile(algorithms.allgather_put, v, 0).id for v in variants}
    assert len(ids) == len(variants)
    assert mscclpp.compile(algorithms.allgather_put, base, 1).id in ids, "the rank is not part of the key"
    assert len({mscclpp.compile(algorithms.allgather_put, base, 0).id,
                mscclpp.compile(algorithms.allgather_get, base, 0).id}) == 2, "the program is"


def test_compile_post_processes_once(cache):
    algo = mscclpp.compile(algorithms.allgather_put, spec(instances=3), 0)
    plan = json.loads(Path(algo.execution_plan.path).read_text())
    assert len(plan["gpus"][0]["threadblocks"]) == 3


def test_a_corrupt_cache_file_is_rebuilt_not_trusted(cache):
    calls = []

    def counting(s):
        calls.append(s)
        return algorithms.allgather_put(s)

    first = mscclpp.compile(counting, spec(), 0)
    path = Path(first.execution_plan.path)
    good = path.read_text()
    mscclpp.compile(counting, spec(), 0)
    assert len(calls) == 1, "a whole cached plan is reused"
    for broken in (good[: len(good) // 2], good.replace('"copy"', '"put"', 1), "{}", ""):
        path.write_text(broken)
        again = mscclpp.compile(counting, spec(), 0)
        assert path.read_text() == good and again.id == first.id
    assert len(calls) == 5


def test_compile_rejects_bad_arguments(cache):
    with pytest.raises(TypeError, match="algo_spec must be"):
        mscclpp.compile(algorithms.allgather_put, {"name": "x"}, 0)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        mscclpp.compile(algorithms.allgather_put, spec(), 2)
    with pytest.raises(TypeError, match="returned None"):
        mscclpp.compile(lambda s: None, spec(), 0)


# Fuzz: random DSL calls give a DslError at the call or when lowered, or a plan the executor
# loads and validates. A Python exception of any other kind, or a refused plan, fails.

def _random_program(rng, path):
    n = rng.choice([2, 3, 4])
    collective = rng.choice([AllReduce(n, 1, False), AllGather(n, 1, False)])
    with CollectiveProgram("fuzz", collective, n, instances=rng.choice([1, 2]),
                           protocol=rng.choice(["Simple", "LL"])) as prog:
        ranks = list(range(n + 1))  # one out of range
        scratch = {r: Buffer(r, rng.randint(1, 4)) for r in range(n)}
        channels = []
        for _ in range(rng.randint(0, 12)):
            try:
                kind = rng.random()
                r = rng.choice(ranks)
                tb = rng.choice([0, 1, 2, -1]) if rng.random() < 0.9 else None
                bufs = lambda rank: [Rank(rank).get_input_buffer(), Rank(rank).get_output_buffer(),  # noqa: E731
                                     scratch.get(rank, Rank(rank).get_input_buffer())]
                def chunk(rank):
                    buf = rng.choice(bufs(rank))
                    a = rng.randint(0, 3)
                    return buf[a : a + rng.randint(0, 2)]
                if kind < 0.2:
                    channels.append(rng.choice([MemoryChannel, PortChannel])(rng.choice(ranks), r))
                elif kind < 0.4 and channels:
                    ch = rng.choice(channels)
                    getattr(ch, rng.choice(["put", "put_packets", "read_put_packets"]))(
                        chunk(ch.dst_rank), chunk(ch.src_rank), tb=tb)
                elif kind < 0.55 and channels:
                    ch = rng.choice(channels)
                    getattr(ch, rng.choice(["signal", "wait"]))(tb=tb if tb is not None else 0)
                elif kind < 0.75:
                    Rank(r).copy(chunk(r), chunk(r), tb=tb)
                elif kind < 0.9:
                    Rank(r).reduce(chunk(r), [chunk(r)], tb=tb, packet=rng.random() < 0.5)
                else:
                    Rank(r).copy(chunk(r), chunk(r), tb_group=ThreadBlockGroup(rng.sample(range(4), 2)))
            except DslError:
                pass
    text = prog.to_json()
    path.write_text(text)
    mscclpp.ExecutionPlan(str(path))


def test_fuzzed_programs_give_an_error_or_a_valid_plan(tmp_path):
    rng = random.Random(58)
    outcomes = {"plan": 0, "error": 0}
    for i in range(300):
        try:
            _random_program(rng, tmp_path / f"{i}.json")
            outcomes["plan"] += 1
        except DslError:
            outcomes["error"] += 1
    assert outcomes["plan"] > 20 and outcomes["error"] > 20, outcomes
