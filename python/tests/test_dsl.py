"""The DSL's own behaviour (CPU only): the public surface, fusion, sync and hazard nops,
replication, the signal/wait pairing check, errors that name the program line, rank,
threadblock and chunk, and the MSCCL++ DSL defects ours must not have."""

import json
import os
import subprocess
import sys

import pytest

import mscclpp
from mscclpp.language import *  # noqa: F403 (what MSCCL++'s quick-start does)
from mscclpp.language import DslError

HERE = os.path.abspath(__file__)


def ops_of(plan, rank=0, tb=0):
    return plan["gpus"][rank]["threadblocks"][tb]["ops"]


def names(plan, rank=0, tb=0):
    return [op["name"] for op in ops_of(plan, rank, tb)]


def two_rank(collective=None, **kwargs):
    return CollectiveProgram("t", collective or AllReduce(2, 1, False), 2, **kwargs)


def test_star_import_gives_what_programs_use():
    import mscclpp.language as language

    for name in ["CollectiveProgram", "AllReduce", "AllGather", "ReduceScatter", "AllToAll", "SendRecv",
                 "TestCollective", "Rank", "Buffer", "Semaphore", "MemoryChannel", "PortChannel",
                 "SwitchChannel", "ThreadBlockGroup", "LoopIterationContext", "SyncType", "BufferType",
                 "ReduceOperationType", "ReplicationPolicy", "AlgoSpec", "JSON"]:
        assert name in language.__all__ and name in globals(), name


def test_msccl_module_paths_import():
    code = (
        "from mscclpp.language.channel import *\nfrom mscclpp.language.rank import *\n"
        "from mscclpp.language.general import *\nfrom mscclpp.language.program import *\n"
        "from mscclpp.language.collectives import *\nfrom mscclpp.language.loop import *\n"
        "from mscclpp.language.thread_block_group import ThreadBlockGroup\n"
        "from mscclpp.language.utils import AlgoSpec, ReplicationPolicy\n"
        "assert MemoryChannel and Rank and JSON and CollectiveProgram and AllReduce and LoopIterationContext\n"
        "assert SyncType and BufferType and ThreadBlockGroup and Semaphore and Buffer\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_context_manager_and_json_function():
    with two_rank() as prog:
        Rank(0).copy(Rank(0).get_output_buffer()[0:1], Rank(0).get_input_buffer()[0:1], tb=0)
        text = JSON()
    assert json.loads(text) == prog.to_dict() == json.loads(prog.to_json())
    with pytest.raises(DslError, match="no program is being written"):
        Rank(0)


def test_from_spec_takes_every_option():
    spec = AlgoSpec(name="s", collective=AllGather(4, 1, False), nranks_per_node=4, world_size=4, in_place=False,
                    instances=2, protocol="LL", num_threads_per_block=512, use_double_scratch_buffer=True,
                    buffer_alignment=32, min_message_size=1024, max_message_size=4096, reuse_resources=True)
    with CollectiveProgram.from_spec(spec) as prog:
        pass
    plan = prog.to_dict()
    assert (plan["name"], plan["collective"], plan["protocol"], plan["num_threads_per_block"]) == (
        "s", "allgather", "LL", 512)
    assert plan["use_double_scratch_buffer"] and plan["reuse_resources"] and plan["buffer_alignment"] == 32
    assert (plan["min_message_size"], plan["max_message_size"]) == (1024, 4096)
    assert len(plan["gpus"]) == 4 and plan["gpus"][0]["output_chunks"] == 4 * 2


def test_signals_and_waits_fuse_and_their_syncs_merge():
    with CollectiveProgram("t", AllReduce(3, 1, False), 3) as prog:
        ch = {(r, p): MemoryChannel(p, r) for r in range(3) for p in range(3) if p != r}
        for r in range(3):
            for p in range(3):
                if p != r:
                    ch[(r, p)].signal(tb=0)
            for p in range(3):
                if p != r:
                    ch[(r, p)].wait(tb=0)
    plan = prog.to_dict()
    # One signal over both channels and one wait: one sync before, one between, one after.
    assert names(plan) == ["nop", "signal", "nop", "wait", "nop"]
    assert ops_of(plan)[1]["channel_ids"] == [0, 1]


def test_put_fusion_keeps_one_source_per_destination():
    with CollectiveProgram("t", AllGather(3, 1, False), 3) as prog:
        for p in (1, 2):
            MemoryChannel(p, 0).put(Rank(p).get_output_buffer()[0:1], Rank(0).get_input_buffer()[0:1], tb=0)
    op = ops_of(prog.to_dict())[0]
    assert op["name"] == "put" and len(op["src_buff"]) == len(op["dst_buff"]) == 2
    assert [d["buffer_id"] for d in op["dst_buff"]] == [0, 1]


def test_reduce_then_put_of_the_result_fuses_into_reduce_send():
    with two_rank() as prog:
        ch = MemoryChannel(1, 0)
        inp, out = Rank(0).get_input_buffer(), Rank(1).get_output_buffer()
        ch.reduce(inp[0:1], [Rank(1).get_input_buffer()[0:1]], tb=0)
        ch.put(out[0:1], inp[0:1], tb=0)
    assert names(prog.to_dict()) == ["rres"]


@pytest.mark.parametrize("forward", ["put_packets", "read_put_packets"])
def test_packet_reduce_copy_and_send_fuse(forward):
    with CollectiveProgram("t", AllReduce(2, 1, False), 2, protocol="LL") as prog:
        s0, s1 = Buffer(0, 2), Buffer(1, 2)
        rank, ch = Rank(0), MemoryChannel(1, 0)
        inp = rank.get_input_buffer()
        rank.reduce(inp[0:1], [s0[0:1]], tb=0, packet=True)
        rank.copy_packets(s0[1:2], inp[0:1], tb=0)
        if forward == "put_packets":
            ch.put_packets(s1[0:1], inp[0:1], tb=0)
        else:
            ch.read_put_packets(s1[0:1], s0[1:2], tb=0)
    assert names(prog.to_dict()) == ["recspkt"]


def test_read_put_packets_of_one_source_fan_out():
    with CollectiveProgram("t", AllGather(3, 1, False), 3, protocol="LL") as prog:
        scratch = [Buffer(r, 1) for r in range(3)]
        for p in (1, 2):
            MemoryChannel(p, 0).read_put_packets(scratch[p][0:1], scratch[0][0:1], tb=0)
    op = ops_of(prog.to_dict())[0]
    assert op["name"] == "rppkt" and len(op["src_buff"]) == 1 and len(op["dst_buff"]) == 2


def test_fusion_off_keeps_the_ops_and_auto_sync_orders_a_reuse():
    with two_rank(instr_fusion=False) as prog:
        rank = Rank(0)
        inp, out = rank.get_input_buffer(), rank.get_output_buffer()
        rank.copy(out[0:1], inp[0:1], tb=0)
        rank.copy(out[1:2], out[0:1], tb=0)  # reads what the first copy wrote
        rank.copy(out[0:1], inp[1:2], tb=0)  # overwrites what the second read
    assert names(prog.to_dict()) == ["copy", "nop", "copy", "nop", "copy"]


def test_auto_sync_off_adds_no_hazard_nop():
    with two_rank(auto_sync=False) as prog:
        rank = Rank(0)
        inp, out = rank.get_input_buffer(), rank.get_output_buffer()
        rank.copy(out[0:1], inp[0:1], tb=0)
        rank.copy(out[1:2], out[0:1], tb=0)
    assert names(prog.to_dict()) == ["copy", "copy"]


def test_packets_need_no_sync_between_their_writer_and_reader():
    with two_rank(protocol="LL") as prog:
        s = Buffer(0, 1)
        rank = Rank(0)
        rank.copy_packets(s[0:1], rank.get_input_buffer()[0:1], tb=0)
        rank.unpack_packets(rank.get_output_buffer()[0:1], s[0:1], tb=0)
    assert names(prog.to_dict()) == ["cpkt", "upkt"]


def test_instances_replicate_threadblocks_channels_chunks_and_ids():
    with CollectiveProgram("t", AllGather(2, 1, False), 2, instances=2) as prog:
        ch = MemoryChannel(1, 0)
        sem = Semaphore(0, 1)
        rank = Rank(0)
        ch.put(Rank(1).get_output_buffer()[0:1], rank.get_input_buffer()[0:1], tb=0)
        sem.release(0)
        sem.acquire(1)
        rank.barrier([0, 1])
    g = prog.to_dict()["gpus"][0]
    assert (g["input_chunks"], g["output_chunks"]) == (2, 4)
    assert g["channels"] == [{"channel_type": "memory", "connected_to": [1, 1]}]
    assert g["semaphores"] == [{"init_value": 1}, {"init_value": 1}]
    assert [tb["id"] for tb in g["threadblocks"]] == [0, 1, 2, 3]
    puts = [ops_of({"gpus": [g]}, 0, t)[0] for t in (0, 1)]
    assert [p["src_buff"][0]["index"] for p in puts] == [0, 1]
    assert [p["dst_buff"][0]["index"] for p in puts] == [0, 1]
    assert [tb["channels"][0]["channel_ids"] for tb in g["threadblocks"][:2]] == [[0], [1]]
    sems = [op["semaphore_ids"] for tb in g["threadblocks"] for op in tb["ops"] if op["name"].startswith("sem_")]
    assert sems == [[0], [1], [0], [1]]
    barriers = [op["barrier_id"] for tb in g["threadblocks"] for op in tb["ops"] if op["name"] == "barrier"]
    assert barriers == [0, 1, 0, 1]


def test_replication_policy_none_keeps_the_chunks():
    # MSCCL++ raises TypeError here (its "none" function takes one argument too few).
    with CollectiveProgram("t", AllGather(2, 1, False), 2, instances=2,
                           replication_policy=ReplicationPolicy.none) as prog:
        Rank(0).copy(Rank(0).get_output_buffer()[0:1], Rank(0).get_input_buffer()[0:1], tb=0)
    g = prog.to_dict()["gpus"][0]
    assert (g["input_chunks"], g["output_chunks"]) == (1, 2)
    assert [ops_of({"gpus": [g]}, 0, t)[0]["src_buff"][0]["index"] for t in (0, 1)] == [0, 0]


def test_lowering_twice_gives_the_same_plan():
    # MSCCL++'s compile() post-processed twice: instances² threadblocks.
    with CollectiveProgram("t", AllGather(2, 1, False), 2, instances=3) as prog:
        Rank(0).copy(Rank(0).get_output_buffer()[0:1], Rank(0).get_input_buffer()[0:1], tb=0)
    prog.post_process_operations()
    first = prog.to_json()
    assert prog.to_json() == first and JSON_of(prog) == first
    assert len(json.loads(first)["gpus"][0]["threadblocks"]) == 3
    with prog, pytest.raises(DslError, match="already lowered"):
        Rank(0).copy(Rank(0).get_output_buffer()[1:2], Rank(0).get_input_buffer()[0:1], tb=0)


def JSON_of(prog):
    with prog:
        return JSON()


def _barrier_program(name):
    with CollectiveProgram(name, AllGather(2, 1, False), 2) as prog:
        Rank(0).barrier([0, 1])
        Rank(0).barrier([2, 3])
    return prog.to_dict()


def test_barrier_ids_start_afresh_in_every_program():
    first, second = _barrier_program("a"), _barrier_program("b")
    ids = lambda plan: [op["barrier_id"] for tb in plan["gpus"][0]["threadblocks"] for op in tb["ops"]]  # noqa: E731
    assert ids(first) == ids(second) == [0, 0, 1, 1]


def test_access_channel_types_do_not_depend_on_the_hash_seed():
    code = (
        "from mscclpp.language import *\n"
        "with CollectiveProgram('t', AllGather(2, 1, False), 2) as prog:\n"
        "    out = Rank(1).get_output_buffer()\n"
        "    PortChannel(1, 0).put(out[0:1], Rank(0).get_input_buffer()[0:1], tb=0)\n"
        "    MemoryChannel(1, 0).put(out[1:2], Rank(0).get_input_buffer()[0:1], tb=1)\n"
        "print(prog.to_dict()['gpus'][0]['remote_buffers'])\n"
    )
    outputs = {
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout
        for seed in range(6)
    }
    assert len(outputs) == 1 and "['port', 'memory']" in outputs.pop()


def test_a_signal_without_its_wait_is_an_error_naming_the_ranks_and_line():
    with two_rank() as prog:
        MemoryChannel(1, 0).signal(tb=0)  # the line the error names
        line = sys._getframe().f_lineno - 1
    with pytest.raises(DslError) as e:
        prog.to_json()
    msg = str(e.value)
    assert f"{HERE}:{line}" in msg and "rank 0 signals rank 1 1 time(s)" in msg and "waits for rank 0 0" in msg


def test_put_with_signal_counts_as_a_signal():
    with two_rank() as prog:
        PortChannel(1, 0).put_with_signal(Rank(1).get_output_buffer()[0:1], Rank(0).get_input_buffer()[0:1], tb=0)
        PortChannel(0, 1).wait(tb=0)
    assert "pws" in names(prog.to_dict())


def test_out_of_range_rank_is_a_dsl_error_not_an_attribute_error():
    with two_rank():
        with pytest.raises(DslError, match=r"rank 2 is out of range: the program has ranks 0\.\.1"):
            Rank(2)
        with pytest.raises(DslError, match="out of range"):
            MemoryChannel(5, 0)
        with pytest.raises(DslError, match="out of range"):
            Buffer(-1, 1)


def test_chunk_errors_name_line_rank_threadblock_and_chunks():
    with two_rank():
        inp = Rank(0).get_input_buffer()
        with pytest.raises(DslError) as e:
            MemoryChannel(1, 0).put(Rank(1).get_output_buffer()[0:2], inp[0:1], tb=3)
        line = sys._getframe().f_lineno - 1
        msg = str(e.value)
        assert msg.startswith(f"{HERE}:{line}:")
        assert "on rank 0, threadblock 3" in msg and "differ in size" in msg
        assert "rank 0 input[0:1]" in msg and "rank 1 output[0:2]" in msg
        with pytest.raises(DslError, match=r"slice \[1:3\] is empty or outside 0\.\.2"):
            inp[1:3]
        with pytest.raises(DslError, match="not on the channel's peer rank 1"):
            MemoryChannel(1, 0).put(Rank(0).get_output_buffer()[0:1], inp[0:1], tb=0)
        with pytest.raises(DslError, match="threadblock -1 is not a non-negative integer"):
            Rank(0).copy(Rank(0).get_output_buffer()[0:1], inp[0:1], tb=-1)
        with pytest.raises(DslError, match="must be in scratch"):
            Rank(0).copy_packets(Rank(0).get_output_buffer()[0:1], inp[0:1], tb=0)


def test_a_switch_reduce_without_its_broadcast_names_rank_and_threadblock():
    with two_rank() as prog:
        sw = SwitchChannel([0, 1], BufferType.input)
        sw.at_rank(0).reduce(0, 1, Rank(0).get_output_buffer()[0:1], tb=2)
    with pytest.raises(DslError, match=r"on rank 0, threadblock 2: a switch channel reduce must be followed"):
        prog.to_json()


def test_switch_reduce_and_broadcast_fuse_into_glres():
    with two_rank() as prog:
        sw = SwitchChannel([0, 1], BufferType.input)
        chunk = Rank(0).get_input_buffer()[0:1]
        sw.at_rank(0).reduce(0, 1, chunk, tb=0)
        sw.at_rank(0).broadcast(chunk, 0, 1, tb=0)
    (op,) = ops_of(prog.to_dict())
    assert op["name"] == "glres" and op["dst_buff"][0]["index"] == 0


def test_glres_stores_at_the_broadcast_offset():
    # MSCCL++ writes the reduce's offset as the destination too.
    with two_rank() as prog:
        sw = SwitchChannel([0, 1], BufferType.input)
        chunk = Rank(0).get_output_buffer()[1:2]
        sw.at_rank(0).reduce(0, 1, chunk, tb=0)
        sw.at_rank(0).broadcast(chunk, 1, 1, tb=0)
    (op,) = ops_of(prog.to_dict())
    assert (op["src_buff"][0]["index"], op["dst_buff"][0]["index"]) == (0, 1)


def test_pipelines_wrap_each_threadblocks_ops():
    with two_rank() as prog:
        rank = Rank(0)
        with LoopIterationContext(unit=1024, num_chunks=1):
            rank.copy(rank.get_output_buffer()[0:1], rank.get_input_buffer()[0:1], tb=0)
            rank.copy(rank.get_output_buffer()[1:2], rank.get_input_buffer()[1:2], tb=1)
    plan = prog.to_dict()
    for tb in (0, 1):
        (op,) = ops_of(plan, 0, tb)
        assert op["name"] == "pipeline" and op["iter_context"] == {"unit_size": 1024, "num_chunks": 1}
        assert [o["name"] for o in op["ops"]] == ["copy"]


def test_thread_block_groups_split_an_op():
    with two_rank() as prog:
        rank = Rank(0)
        rank.copy(rank.get_output_buffer()[0:2], rank.get_input_buffer()[0:2], tb_group=ThreadBlockGroup([3, 5]))
    plan = prog.to_dict()
    assert [ops_of(plan, 0, t)[0]["tbg_info"] for t in (3, 5)] == [{"tb_id": 0, "tbg_size": 2},
                                                                   {"tb_id": 1, "tbg_size": 2}]
    with pytest.raises(DslError, match="more than once"):
        ThreadBlockGroup([1, 1])


def test_bad_program_options_are_errors():
    with pytest.raises(DslError, match="protocol 'LL128'"):
        CollectiveProgram("t", AllReduce(2, 1, False), 2, protocol="LL128")
    with pytest.raises(DslError, match="for 2 ranks but the program for 4"):
        CollectiveProgram("t", AllReduce(2, 1, False), 4)
    with pytest.raises(DslError, match="instances must be a positive integer"):
        CollectiveProgram("t", AllReduce(2, 1, False), 2, instances=0)


def test_dsl_error_is_a_runtime_error_as_in_msccl():
    assert issubclass(DslError, RuntimeError)
    assert mscclpp.language.DslError is DslError
