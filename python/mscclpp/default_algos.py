"""The default plans `python -m mscclpp --install` writes, written with our DSL.

`allreduce_multi_nodes`: a hierarchical LL all-reduce for `nnodes` nodes of `gpus_per_node`
GPUs, in place. Chunk j (one per rank) is finished by rank j. Rank (node n, local g):
  1. sends, as packets over memory channels, the chunks its node's peer h finishes the node
     partial of (those with j % G == h) to that peer;
  2. reduces the packets it got for its own class of chunks into its input (the node's partials)
     and sends partial k*G+g, through a port channel, to rank (k, g) of every other node;
  3. rank j reduces the node partials of chunk j (the final sum), keeps it, sends it as packets
     to its node's peers and, through port channels, to the ranks of its class on other nodes;
  4. a rank that gets a final chunk of its class from another node unpacks it and forwards the
     packets to its node's peers; every rank unpacks the finals its peers sent.
Packets carry their own flags, so no signal is needed; port channels move packets as they are
(from a packet copy in local scratch).
"""

from .language import AlgoSpec, AllReduce, Buffer, CollectiveProgram, MemoryChannel, PortChannel, Rank, ThreadBlockGroup

__all__ = ["DEFAULT_PLANS", "allreduce_multi_nodes"]


def allreduce_multi_nodes(spec, gpus_per_node=None, thread_block_group_size=1):
    """The program for `spec` (an in-place LL all-reduce over `spec.world_size` ranks,
    `spec.nranks_per_node` per node unless `gpus_per_node` says otherwise)."""
    G = gpus_per_node or spec.nranks_per_node
    W = spec.world_size
    if W % G:
        raise ValueError(f"world size {W} is not a multiple of {G} GPUs per node")
    N = W // G
    tbg = ThreadBlockGroup(list(range(thread_block_group_size)))
    with CollectiveProgram.from_spec(spec) as prog:
        # Scratch of every rank: A[g][k] phase-1 packets from local peer g for chunk k*G+me;
        # P[k] partial k*G+me as packets to send off-node; B[n] node n's partial of my chunk;
        # F my final chunk as packets; C[k] final of chunk k*G+me from node k; D[h][k] final of
        # chunk k*G+h from local peer h.
        A, P, B, F, C, D = 0, W, W + N, W + 2 * N, W + 2 * N + 1, W + 3 * N + 1
        scratch = [Buffer(r, 2 * W + 3 * N + 1) for r in range(W)]

        def s(r, base, i=0):
            return scratch[r][base + i: base + i + 1]

        mem = {}
        port = {}
        for r in range(W):
            n, g = divmod(r, G)
            for h in range(G):
                if h != g:
                    mem[(r, n * G + h)] = MemoryChannel(n * G + h, r)
            for k in range(N):
                if k != n:
                    port[(r, k * G + g)] = PortChannel(k * G + g, r)
        for r in range(W):  # 1. the node's partials, gathered by local index
            n, g = divmod(r, G)
            inp = Rank(r).get_input_buffer()
            for h in range(G):
                if h != g:
                    peer = n * G + h
                    for k in range(N):
                        mem[(r, peer)].put_packets(s(peer, A, g * N + k), inp[k * G + h: k * G + h + 1], tb_group=tbg)
        for r in range(W):  # 2. node partials of my class, the off-node ones sent on
            n, g = divmod(r, G)
            rank = Rank(r)
            inp = rank.get_input_buffer()
            for k in range(N):
                j = k * G + g
                others = [s(r, A, h * N + k) for h in range(G) if h != g]
                if others:
                    rank.reduce(inp[j: j + 1], others, tb_group=tbg, packet=True)
                if k != n:
                    rank.copy_packets(s(r, P, k), inp[j: j + 1], tb_group=tbg)
                    port[(r, k * G + g)].read_put_packets(s(k * G + g, B, n), s(r, P, k), tb_group=tbg)
        for r in range(W):  # 3. my chunk's final sum, sent to every rank that needs it
            n, g = divmod(r, G)
            rank = Rank(r)
            inp = rank.get_input_buffer()
            mine = inp[r: r + 1]
            if N > 1:
                rank.reduce(mine, [s(r, B, k) for k in range(N) if k != n], tb_group=tbg, packet=True)
            rank.copy_packets(s(r, F), mine, tb_group=tbg)
            for h in range(G):
                if h != g:
                    mem[(r, n * G + h)].read_put_packets(s(n * G + h, D, g * N + n), s(r, F), tb_group=tbg)
            for k in range(N):
                if k != n:
                    port[(r, k * G + g)].read_put_packets(s(k * G + g, C, n), s(r, F), tb_group=tbg)
        for r in range(W):  # 4. finals of my class from other nodes, forwarded; the peers' unpacked
            n, g = divmod(r, G)
            rank = Rank(r)
            inp = rank.get_input_buffer()
            for k in range(N):
                if k != n:
                    j = k * G + g
                    rank.unpack_packets(inp[j: j + 1], s(r, C, k), tb_group=tbg)
                    for h in range(G):
                        if h != g:
                            mem[(r, n * G + h)].read_put_packets(s(n * G + h, D, g * N + k), s(r, C, k),
                                                                 tb_group=tbg)
            for h in range(G):
                if h != g:
                    for k in range(N):
                        j = k * G + h
                        rank.unpack_packets(inp[j: j + 1], s(r, D, h * N + k), tb_group=tbg)
    return prog


def _spec(nodes, lo, hi, label):
    world = nodes * 8
    return AlgoSpec(
        name=f"allreduce_{nodes}nodes_{label}",
        collective=AllReduce(world, 1, True),
        nranks_per_node=8,
        world_size=world,
        in_place=True,
        instances=1,
        protocol="LL",
        use_double_scratch_buffer=True,
        min_message_size=lo,
        max_message_size=hi,
        tags={"default": 1},
    )


# (file name, program, spec, keyword arguments): MSCCL++'s default set (multi-node all-reduce for 2
# and 4 nodes of 8 GPUs, 1 KiB-64 KiB and 128 KiB-2 MiB), as our program.
DEFAULT_PLANS = [
    (f"allreduce_{nodes}nodes_{label}.json", allreduce_multi_nodes, _spec(nodes, lo, hi, label), {"thread_block_group_size": tbg})
    for nodes in (2, 4)
    for lo, hi, label, tbg in ((1 << 10, 64 << 10, "1K_64K", 1), (128 << 10, 2 << 20, "128K_2M", 4))
]
