"""`Config`: the tuning of one high-throughput dispatch or combine (DeepEP's `Config`), the
recommended tables, and the bytes of the NVLink buffer a call needs.

The layout those bytes describe is the intranode kernels' (kernels-cu/src/ep.rs, BufferLayout):
a count area of `num_ranks x (num_ranks + 1024)` ints, four 8-byte ring counters per (channel,
peer), then per (channel, peer) a ring of `num_max_nvl_chunked_recv_tokens` slots, each holding a
token's hidden bytes, its source index (8 bytes), its top-k indices (int64) and weights (f32), and
its fp8 scales (f32), rounded up to 16 bytes. A channel is two SMs' worth of work (a sender and a
receiver). `get_nvl_buffer_size_hint` is that size at the largest top-k and scale counts, so a
buffer sized by the hint fits every call of that config.
"""

# The most ranks one NVLink domain holds (DeepEP's NUM_MAX_NVL_PEERS).
MAX_NVL_PEERS = 8
# The most ranks of a group across hosts: each rank sends to and receives from every rank in one
# point-to-point group, of at most 64 operations (mscclpp_kernels_cu::p2p::MAX_OPS).
MAX_RANKS = 32
# The largest top-k and per-token scale counts the hint provisions for (DeepEP's assumptions).
MAX_TOPK = 128
MAX_SCALES = 128
# The experts per rank the count area holds (mscclpp_kernels_cu::ep::MAX_LOCAL_EXPERTS).
MAX_LOCAL_EXPERTS = 1024
_INT, _INT64, _FLOAT = 4, 8, 4


def _align(n, to):
    return (n + to - 1) // to * to


class Config:
    """DeepEP's `Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)`: `num_sms` SMs (an even
    number: each channel is a sender and a receiver block), token chunks of at most
    `num_max_nvl_chunked_send_tokens` into rings of `num_max_nvl_chunked_recv_tokens` slots, and
    the RDMA pair for the internode mode (checked as DeepEP checks it, rounded up the same way)."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6,
                 num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
                 num_max_rdma_chunked_recv_tokens=256):
        ints = dict(num_sms=num_sms,
                    num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                    num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                    num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                    num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in ints.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Config: {name} must be an int, not {type(value).__name__}")
        if num_sms < 0:
            raise ValueError(f"Config: num_sms={num_sms} must not be negative")
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                f"Config: num_max_nvl_chunked_send_tokens={num_max_nvl_chunked_send_tokens} must "
                f"be positive and below num_max_nvl_chunked_recv_tokens="
                f"{num_max_nvl_chunked_recv_tokens} (a ring holds more than one chunk)")
        if num_max_rdma_chunked_send_tokens <= 0 or num_max_rdma_chunked_recv_tokens <= 0:
            raise ValueError("Config: num_max_rdma_chunked_send_tokens and "
                             "num_max_rdma_chunked_recv_tokens must be positive")
        # The RDMA ring holds whole chunks, and a sender always finds room for one (at most half).
        rdma_recv = _align(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        if num_max_rdma_chunked_send_tokens > rdma_recv // 2:
            raise ValueError(
                f"Config: num_max_rdma_chunked_send_tokens={num_max_rdma_chunked_send_tokens} "
                f"must be at most half of num_max_rdma_chunked_recv_tokens={rdma_recv}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    @property
    def num_channels(self):
        return self.num_sms // 2

    def __repr__(self):
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """Bytes of NVLink buffer that every dispatch and combine of this config needs for tokens of
        `hidden_bytes` among `num_ranks` ranks."""
        check_ranks(num_ranks, "get_nvl_buffer_size_hint: num_ranks")
        return _align(self.buffer_bytes(hidden_bytes, num_ranks, MAX_TOPK, MAX_SCALES), 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        """0: across hosts the rows go through the runtime's point-to-point engine, whose
        staging slots are its own (collectives/src/p2p/port.rs), not through an RDMA buffer of
        the Buffer's."""
        check_ranks(num_ranks, "get_rdma_buffer_size_hint: num_ranks")
        return 0

    def buffer_bytes(self, hidden_bytes, num_ranks, num_topk, num_scales=0):
        """The NVLink buffer bytes a dispatch or combine of `num_topk` experts uses: the layout of
        `mscclpp_kernels_cu::ep::BufferLayout` (the module doc), plus `num_scales` f32 per slot
        for fp8 tokens."""
        if self.num_sms % 2 or self.num_sms == 0:
            raise ValueError(f"config.num_sms={self.num_sms} must be a positive even number "
                             "(each channel is a sender and a receiver)")
        meta = _align(num_ranks * (num_ranks + MAX_LOCAL_EXPERTS) * _INT, 16)
        ctrl = self.num_channels * num_ranks * 4 * _INT64
        slot = _align(hidden_bytes + _INT64 + num_topk * (_INT64 + _FLOAT) + num_scales * _FLOAT,
                      16)
        return meta + ctrl + self.num_channels * num_ranks * self.num_max_nvl_chunked_recv_tokens \
            * slot


def check_ranks(num_ranks, what):
    """Refuses a rank count that is not a positive int or is beyond what a group takes."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"{what}={num_ranks!r} must be a positive int")
    if num_ranks > MAX_RANKS:
        raise NotImplementedError(
            f"{what}={num_ranks}: at most {MAX_RANKS} ranks (each rank sends to and receives "
            "from every rank in one point-to-point group of at most 64 operations)")


def host_blocks(host_ranks, num_ranks):
    """The number of hosts of a group whose hosts hold `host_ranks` (lists of ranks), checked: one
    host of at most 8 ranks, or hosts of equal blocks of consecutive ranks (DeepEP's numbering:
    rank r is NVLink rank r % k of RDMA rank r // k), at most `MAX_RANKS` ranks in all."""
    check_ranks(num_ranks, "Buffer: the group's size")
    hosts = len(host_ranks)
    if hosts == 1:
        if num_ranks > MAX_NVL_PEERS:
            raise NotImplementedError(
                f"Buffer: {num_ranks} ranks on one host: one NVLink domain holds at most "
                f"{MAX_NVL_PEERS}")
        return 1
    k = num_ranks // hosts
    blocks = [list(range(h * k, (h + 1) * k)) for h in range(hosts)]
    if num_ranks % hosts or sorted(map(list, host_ranks)) != blocks:
        raise NotImplementedError(
            f"Buffer: the ranks on each host are {[list(r) for r in host_ranks]}: across hosts "
            "each host must hold as many ranks as the others, consecutive ones (DeepEP's RDMA "
            "rank r // k, NVLink rank r % k)")
    if k > MAX_NVL_PEERS:
        raise NotImplementedError(
            f"Buffer: {k} ranks a host: one NVLink domain holds at most {MAX_NVL_PEERS}")
    return hosts


# DeepEP's recommended (nvl_send, nvl_recv, rdma_send, rdma_recv) by rank count, the same numbers,
# so the same buffer sizes come out of the hints.
_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128),
             16: (36, 288, 20, 128), 24: (8, 288, 32, 128), 32: (32, 288, 32, 128),
             64: (20, 288, 28, 128), 128: (20, 560, 32, 128), 144: (32, 720, 12, 128),
             160: (28, 720, 12, 128)}
_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128),
            16: (4, 288, 12, 128), 24: (1, 288, 8, 128), 32: (1, 288, 8, 128),
            64: (1, 288, 20, 128), 128: (1, 560, 12, 128), 144: (2, 720, 8, 128),
            160: (2, 720, 8, 128)}


def recommended(table_name, num_ranks, num_sms):
    table = _DISPATCH if table_name == "dispatch" else _COMBINE
    if num_ranks not in table:
        raise ValueError(f"get_{table_name}_config: no recommended config for num_ranks="
                         f"{num_ranks} (known: {', '.join(map(str, sorted(table)))})")
    return Config(num_sms, *table[num_ranks])
