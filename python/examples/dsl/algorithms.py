"""Collectives written with `mscclpp.language`, one function per algorithm: each takes an AlgoSpec
and returns the CollectiveProgram it wrote, as `mscclpp.compile` expects. Together they use every
op and feature of the DSL; CI proves each plan on the CPU (python/tests/test_dsl_plans.py) at
2, 4 and 8 ranks, and python/tests/gpu_dsl_check.py runs them on a GPU.

Run one to print its plan: `python algorithms.py allreduce_packet 4`.
"""

import sys

from mscclpp.language import (
    AlgoSpec,
    AllGather,
    AllReduce,
    AllToAll,
    Buffer,
    BufferType,
    CollectiveProgram,
    LoopIterationContext,
    MemoryChannel,
    PortChannel,
    Rank,
    ReduceScatter,
    Semaphore,
    SendRecv,
    SwitchChannel,
    SyncType,
    ThreadBlockGroup,
)


def _peers(n, r):
    return [p for p in range(n) if p != r]


def _channels(kind, n):
    """One channel per ordered pair of ranks: channels[(src, dst)]."""
    return {(r, p): kind(p, r) for r in range(n) for p in _peers(n, r)}


def _barrier_all(channels, n, tb, relaxed=False):
    """Every rank tells every peer it is done and waits until every peer is."""
    for r in range(n):
        for p in _peers(n, r):
            if relaxed:
                channels[(r, p)].signal(tb, relaxed=True)
            else:
                channels[(r, p)].signal(tb)
    for r in range(n):
        for p in _peers(n, r):
            if relaxed:
                channels[(r, p)].wait(tb, relaxed=True)
            else:
                channels[(r, p)].wait(tb)


def allreduce_read_reduce(spec):
    """Simple: rank r reads chunk r of every peer's input over memory channels, reduces it with its
    own (one `rre`), writes the sum to every peer's output (fused: `rres`), then all sync."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        ch = _channels(MemoryChannel, n)
        for r in range(n):
            rank = Rank(r)
            inp, out = rank.get_input_buffer(), rank.get_output_buffer()
            rank.copy(out[r : r + 1], inp[r : r + 1], tb=0)
            for p in _peers(n, r):
                peer_in = Rank(p).get_input_buffer()
                ch[(r, p)].reduce(out[r : r + 1], [peer_in[r : r + 1]], tb=0)
            for p in _peers(n, r):
                ch[(r, p)].put(Rank(p).get_output_buffer()[r : r + 1], out[r : r + 1], tb=0)
        _barrier_all(ch, n, tb=0)
    return prog


def allreduce_packet(spec):
    """LL: every rank sends peer p's chunk of its input as packets to p's scratch, reduces the
    packets it got for its own chunk and sends the result as packets to every peer (one
    `respkt`), then unpacks the peers' results. No signal: packets carry their own flags."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        scratch = [Buffer(r, 2 * n) for r in range(n)]
        ch = _channels(MemoryChannel, n)
        for r in range(n):
            inp = Rank(r).get_input_buffer()
            for p in _peers(n, r):
                ch[(r, p)].put_packets(scratch[p][r : r + 1], inp[p : p + 1], tb=0)
        for r in range(n):
            rank = Rank(r)
            inp, out = rank.get_input_buffer(), rank.get_output_buffer()
            rank.reduce(inp[r : r + 1], [scratch[r][p : p + 1] for p in _peers(n, r)], tb=0,
                        dst_chunk=out[r : r + 1], packet=True)
            for p in _peers(n, r):
                ch[(r, p)].put_packets(scratch[p][n + r : n + r + 1], out[r : r + 1], tb=0)
            for p in _peers(n, r):
                rank.unpack_packets(out[p : p + 1], scratch[r][n + p : n + p + 1], tb=0)
    return prog


def allreduce_packet_forward(spec):
    """LL over two threadblock groups: the reduced chunk is also kept as packets in local
    scratch (`recpkt`), which `read_put_packets` forwards to every peer (fused: `recspkt`)."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        scratch = [Buffer(r, 2 * n + 1) for r in range(n)]
        ch = _channels(MemoryChannel, n)
        send, reduce_group = ThreadBlockGroup([0, 1]), ThreadBlockGroup([2, 3])
        for r in range(n):
            inp = Rank(r).get_input_buffer()
            for p in _peers(n, r):
                ch[(r, p)].put_packets(scratch[p][r : r + 1], inp[p : p + 1], tb_group=send)
        for r in range(n):
            rank = Rank(r)
            inp, out = rank.get_input_buffer(), rank.get_output_buffer()
            mine = scratch[r][2 * n : 2 * n + 1]
            rank.reduce(inp[r : r + 1], [scratch[r][p : p + 1] for p in _peers(n, r)], tb_group=reduce_group,
                        dst_chunk=out[r : r + 1], packet=True)
            rank.copy_packets(mine, out[r : r + 1], tb_group=reduce_group)
            for p in _peers(n, r):
                ch[(r, p)].read_put_packets(scratch[p][n + r : n + r + 1], mine, tb_group=reduce_group)
            for p in _peers(n, r):
                rank.unpack_packets(out[p : p + 1], scratch[r][n + p : n + p + 1], tb=4)
    return prog


def allreduce_switch(spec):
    """Simple, through a switch channel (NVLink multicast): rank r load-reduces chunk r of every
    rank's input and stores the sum back to all of them (`glres`), between two barriers, then
    copies its input (now the sums) to its output. Proved on
    the CPU (switch channels emulated); NVLS stays gated on the GPU, so it does not run there."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        ch = _channels(MemoryChannel, n)
        switch = SwitchChannel(list(range(n)), BufferType.input)
        _barrier_all(ch, n, tb=0)
        for r in range(n):
            inp = Rank(r).get_input_buffer()
            view = switch.at_rank(r)
            view.reduce(r, 1, inp[r : r + 1], tb=0)
            view.broadcast(inp[r : r + 1], r, 1, tb=0)
        _barrier_all(ch, n, tb=0)
        for r in range(n):
            rank = Rank(r)
            rank.copy(rank.get_output_buffer()[0:n], rank.get_input_buffer()[0:n], tb=0)
    return prog


def allgather_put(spec):
    """Simple: every rank writes its input into its slot of every peer's output (one fused
    `put` of several pairs) and its own, then signals every peer and waits for every peer."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        ch = _channels(MemoryChannel, n)
        for r in range(n):
            rank = Rank(r)
            inp, out = rank.get_input_buffer(), rank.get_output_buffer()
            rank.copy(out[r : r + 1], inp[0:1], tb=0)
            for p in _peers(n, r):
                ch[(r, p)].put(Rank(p).get_output_buffer()[r : r + 1], inp[0:1], tb=0)
        _barrier_all(ch, n, tb=0)
    return prog


def allgather_get(spec):
    """Simple: after a relaxed handshake, every rank reads every peer's input into its output
    (`get`), one threadblock per peer, then the ranks sync so no input is overwritten early."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        ch = _channels(MemoryChannel, n)
        _barrier_all(ch, n, tb=0, relaxed=True)
        for r in range(n):
            rank = Rank(r)
            inp, out = rank.get_input_buffer(), rank.get_output_buffer()
            rank.copy(out[r : r + 1], inp[0:1], tb=0)
            for i, p in enumerate(_peers(n, r)):
                ch[(r, p)].get(out[p : p + 1], Rank(p).get_input_buffer()[0:1], tb=0)
        _barrier_all(ch, n, tb=0)
    return prog


def allgather_packet_semaphore(spec):
    """LL on two threadblocks: threadblock 0 sends the input as packets to every peer and releases
    a semaphore; threadblock 1 acquires it and then copies the input to the own slot; threadblock
    2 unpacks the peers' packets. A barrier of blocks 0 and 1 closes the plan."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        scratch = [Buffer(r, n) for r in range(n)]
        ch = _channels(MemoryChannel, n)
        for r in range(n):
            rank = Rank(r)
            inp, out = rank.get_input_buffer(), rank.get_output_buffer()
            sem = Semaphore(r, 0)
            for p in _peers(n, r):
                ch[(r, p)].put_packets(scratch[p][r : r + 1], inp[0:1], tb=0)
            sem.release(0)
            sem.acquire(1)
            rank.copy(out[r : r + 1], inp[0:1], tb=1)
            for p in _peers(n, r):
                rank.unpack_packets(out[p : p + 1], scratch[r][p : p + 1], tb=2)
            rank.barrier([0, 1])
    return prog


def allgather_pipelined(spec):
    """Simple: the copy and the puts run as a pipeline (`LoopIterationContext`) over slices of the
    chunk, so the puts of one slice overlap the copy of the next."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        ch = _channels(MemoryChannel, n)
        with LoopIterationContext(unit=1 << 16, num_chunks=1):
            for r in range(n):
                rank = Rank(r)
                inp, out = rank.get_input_buffer(), rank.get_output_buffer()
                rank.copy(out[r : r + 1], inp[0:1], tb=0)
                for p in _peers(n, r):
                    ch[(r, p)].put(Rank(p).get_output_buffer()[r : r + 1], inp[0:1], tb=0)
        _barrier_all(ch, n, tb=0)
    return prog


def reducescatter_port(spec):
    """Simple over port channels: rank q sends chunk r of its input to rank r's scratch with
    `put_with_signal` (one op, the proxy orders the signal after the data); rank r waits for
    every peer, reduces, and flushes its own sends before the plan ends."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        scratch = [Buffer(r, n) for r in range(n)]
        ch = _channels(PortChannel, n)
        for q in range(n):
            inp = Rank(q).get_input_buffer()
            for r in _peers(n, q):
                ch[(q, r)].put_with_signal(scratch[r][q : q + 1], inp[r : r + 1], tb=0)
        for r in range(n):
            rank = Rank(r)
            inp, out = rank.get_input_buffer(), rank.get_output_buffer()
            for q in _peers(n, r):
                ch[(r, q)].wait(tb=0, data_sync=SyncType.after)
            rank.reduce(inp[r : r + 1], [scratch[r][q : q + 1] for q in _peers(n, r)], tb=0, dst_chunk=out[0:1])
            for q in _peers(n, r):
                ch[(r, q)].flush(tb=0)
    return prog


def reducescatter_packet(spec):
    """LL: rank q sends chunk r of its input as packets to rank r, which reduces them into its
    output."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        scratch = [Buffer(r, n) for r in range(n)]
        ch = _channels(MemoryChannel, n)
        for q in range(n):
            inp = Rank(q).get_input_buffer()
            for r in _peers(n, q):
                ch[(q, r)].put_packets(scratch[r][q : q + 1], inp[r : r + 1], tb=0)
        for r in range(n):
            rank = Rank(r)
            inp, out = rank.get_input_buffer(), rank.get_output_buffer()
            rank.reduce(inp[r : r + 1], [scratch[r][q : q + 1] for q in _peers(n, r)], tb=1, dst_chunk=out[0:1],
                        packet=True)
    return prog


def alltoall_put(spec):
    """Simple: rank r writes chunk p of its input into slot r of rank p's output (one threadblock
    per peer), copies its own, and the ranks sync."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        ch = _channels(MemoryChannel, n)
        for r in range(n):
            rank = Rank(r)
            inp, out = rank.get_input_buffer(), rank.get_output_buffer()
            rank.copy(out[r : r + 1], inp[r : r + 1], tb=0)
            for i, p in enumerate(_peers(n, r)):
                ch[(r, p)].put(Rank(p).get_output_buffer()[r : r + 1], inp[p : p + 1], tb=1 + i)
                ch[(r, p)].signal(tb=1 + i)
                ch[(r, p)].wait(tb=1 + i)
    return prog


def sendrecv_ring(spec):
    """Simple over port channels: rank r sends its input to rank r+1 (`put_with_signal_and_flush`)
    and waits for rank r-1's."""
    n = spec.world_size
    with CollectiveProgram.from_spec(spec) as prog:
        ch = _channels(PortChannel, n)
        for r in range(n):
            nxt = (r + 1) % n
            ch[(r, nxt)].put_with_signal_and_flush(Rank(nxt).get_output_buffer()[0:1],
                                                   Rank(r).get_input_buffer()[0:1], tb=0)
        for r in range(n):
            ch[(r, (r - 1) % n)].wait(tb=0)
    return prog


def allreduce_two_nodes(spec):
    """LL, in place: the default plans' hierarchical all-reduce (mscclpp.default_algos) with the
    ranks split into two nodes, so its port channels (between the halves) run on one machine."""
    from mscclpp.default_algos import allreduce_multi_nodes

    return allreduce_multi_nodes(spec, gpus_per_node=max(1, spec.world_size // 2), thread_block_group_size=2)


# name -> (program, collective class, chunk_factor, protocol, instances, runs on the GPU interpreter)
ALGORITHMS = {
    "allreduce_read_reduce": (allreduce_read_reduce, AllReduce, 1, "Simple", 1, True),
    "allreduce_read_reduce_x2": (allreduce_read_reduce, AllReduce, 1, "Simple", 2, True),
    "allreduce_packet": (allreduce_packet, AllReduce, 1, "LL", 1, True),
    "allreduce_packet_forward": (allreduce_packet_forward, AllReduce, 1, "LL", 1, True),
    "allreduce_switch": (allreduce_switch, AllReduce, 1, "Simple", 1, False),
    "allgather_put": (allgather_put, AllGather, 1, "Simple", 1, True),
    "allgather_put_x3": (allgather_put, AllGather, 1, "Simple", 3, True),
    "allgather_get": (allgather_get, AllGather, 1, "Simple", 1, True),
    "allgather_packet_semaphore": (allgather_packet_semaphore, AllGather, 1, "LL", 1, True),
    "allgather_pipelined": (allgather_pipelined, AllGather, 1, "Simple", 1, True),
    "reducescatter_port": (reducescatter_port, ReduceScatter, 1, "Simple", 1, True),
    "reducescatter_packet": (reducescatter_packet, ReduceScatter, 1, "LL", 2, True),
    "alltoall_put": (alltoall_put, AllToAll, 1, "Simple", 1, True),
    "sendrecv_ring": (sendrecv_ring, SendRecv, 1, "Simple", 1, True),
    "allreduce_two_nodes": (allreduce_two_nodes, AllReduce, 1, "LL", 1, True),
}
# Programs that work in place (the input buffer is the output).
IN_PLACE = {"allreduce_two_nodes"}


def spec_for(name, world_size, in_place=None, **overrides):
    """The AlgoSpec ALGORITHMS gives `name` at `world_size` ranks (fields overridable; in place
    where IN_PLACE says, unless `in_place` says otherwise)."""
    _, collective, chunk_factor, protocol, instances, _ = ALGORITHMS[name]
    if in_place is None:
        in_place = name in IN_PLACE
    fields = dict(
        name=f"{name}_{world_size}",
        collective=collective(world_size, chunk_factor, in_place),
        nranks_per_node=world_size,
        world_size=world_size,
        in_place=in_place,
        instances=instances,
        protocol=protocol,
    )
    fields.update(overrides)
    return AlgoSpec(**fields)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ALGORITHMS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(ALGORITHMS)}}} NRANKS")
    algo_name, ranks = sys.argv[1], int(sys.argv[2])
    print(ALGORITHMS[algo_name][0](spec_for(algo_name, ranks)).to_json())
