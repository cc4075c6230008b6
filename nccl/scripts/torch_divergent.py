#!/usr/bin/env python3
"""Collectives over buffers whose addresses differ from rank to rank: libmscclpp_nccl.so under PyTorch.

Why: the zero-copy algorithms register user buffers with their peers. PyTorch's caching allocator gives
each rank its own address history, so a rank can see an address again (a reused block) while its peer's
buffer for the same call is new; a registration cached on the assumption that every rank's addresses
follow the same pattern then reads or writes a stale peer pointer, with no error, only wrong data. This
program makes the ranks' allocation histories differ on purpose and checks every element of every result.

What it does, per collective (a schedule drawn from one RNG seeded by --seed, the same on every rank, so
every rank issues the same collectives with the same sizes in the same order):
  - before it, each rank allocates tensors of random sizes, keeps some in a pool for a while and drops
    others at once, and some ranks call torch.cuda.empty_cache() now and then (an RNG of (seed, rank),
    with rank-dependent rates: rank % 3 == 0 never empties the cache);
  - each rank places the collective's buffers its own way: fresh, a view at an odd element offset into a
    larger tensor (big[off:off+n], contiguous), or inside a tensor of the pool at an odd offset;
  - outputs are poisoned first (NaN for floats, a sentinel for integers), so an element no one wrote fails;
  - about half the calls are async_op=True: the inputs of out-of-place calls are dropped right after
    issuing, more allocations follow, and the work is waited on later (up to three calls in flight on one
    group; a ring exchange or a call on the other group drains them first);
  - every element is checked on the CPU against a reference: rank r's input at step s comes from a CPU
    torch.Generator seeded by (seed, s, r), so every rank rebuilds every peer's input; reductions are
    computed in float64 (int64 for integers); moved data (gathers, broadcast, all-to-all, send/recv) must
    match bit for bit.
Operations: all_reduce (sum, prod, min, max, avg for floats), all_gather_into_tensor (out of place and in
place), all_gather (list), reduce_scatter_tensor (out of place and in place), broadcast (random root),
reduce (random root, checked on the root), all_to_all_single (equal splits, and unequal splits with
input_split_sizes / output_split_sizes), a batch_isend_irecv ring exchange (both directions), each on the
default group or on a second group over all ranks (dist.new_group), interleaved. dtypes float32,
bfloat16, float16, int32, int64, float64. Message sizes straddle the selector's thresholds: 1 element,
1, 16, 64, 256, 512 KiB, 1, 2, 4, 8, 16 MiB and (rarer) 32 MiB, each exact, +-1 element or +-16 bytes
(for all_gather, reduce_scatter and all_to_all the size is the whole buffer, all ranks' parts together,
as the selector measures them; for 30% of the gathers and reduce-scatters it is one rank's part), no
buffer above --max-bytes. --quick: 1 element, 1, 64, 512 KiB, 2, 8 MiB, nudged by +-1 element only.

Phases (between them every call is waited for, a barrier, and the pass/fail counts are summed over
a gloo group, so the verdict does not travel through the library under test):
  eager    --iters collectives as above;
  graph    two torch.cuda.CUDAGraphs, each capturing on a side stream an in-place all_reduce at a packet
           size (up to 256 KiB), one at a zero-copy size at any world size (8 or 16 MiB) and an
           all_gather_into_tensor (1 to 8 MiB in all; the second graph's small all_reduce on the
           second group), their tensors allocated inside the capture (the graph's
           pool, with rank-dependent padding allocations between them); each replay gets fresh inputs
           (input.copy_(...)) and poisoned outputs and is checked; eager collectives with their own
           allocation churn run between replays;
  after    eager collectives once the graphs and their pools are gone (their blocks handed out again).

Numbers: the inputs of sum (and avg) are small integers stored in any type (|x| <= 128 / world, so every
partial sum is an integer bf16 holds exactly): sums, min and max are compared exactly, as are integers
(prod of integers takes values in -2..2). avg and the prod of floats (inputs in [0.75, 1.25)) are compared
with |got - want| <= REL_TOL[dtype] * world * scale, scale = sum|x_r| / world (avg) or prod|x_r| (prod):

    dtype     REL_TOL   (times the world size)
    float64   1e-12
    float32   1e-5
    float16   1e-3
    bfloat16  1e-2

Run (under the shim; ranks may share one GPU: rank r uses cuda:(LOCAL_RANK % device count)):
    LD_PRELOAD=.gpu/lib/libmscclpp_nccl.so torchrun --nproc_per_node=N .gpu/torch_divergent.py \\
        [--iters 2000] [--seed S] [--max-bytes 33554432] [--graph-replays 5] [--quick]
Rank 0 prints the seed first; the same --seed (and the same world size and options) replays the same
schedule, inputs and per-rank allocation decisions (the addresses the caching allocator hands out can
still vary a little: a dropped input's block comes back when its stream has passed it). Failures print
`[rank r] FAIL step ...` with the operation, dtype, size, group, sync/async, in place, that rank's
placement of its buffers (fresh / view +offset / pool +offset, in elements) and address, how many
elements are wrong, the first wrong index (and whose part it is) and got / expected; the run goes on and
counts them (the first 100 failures of a rank are printed). At the end each rank prints `[rank r] checks: ...,
collectives issued: ...` (with how many of its buffers landed at an address an earlier buffer had: the
situation the bug needed) and rank 0 `N passed, M failed` (checks over all ranks; a check is one
collective's result on one rank, or one received message of a ring exchange); the exit status is 1 on
every rank if any check failed anywhere, and on any exception (its traceback printed first). A rank that
makes no progress for --stall-timeout seconds prints every thread's stack and exits 1.

--cpu runs the eager phases on CPU tensors over gloo (no GPU, no shim, no graph phase): a check of this
program itself (its schedule, placements and references), not of the shim.
"""
import argparse
import datetime
import faulthandler
import hashlib
import inspect
import math
import os
import random
import sys
import time
import traceback

import torch
import torch.distributed as dist

KiB, MiB = 1 << 10, 1 << 20

# Message sizes (bytes; 0 stands for one element) and their weights in the schedule: the large ones are
# rarer, since eight ranks may share one GPU and each rank rebuilds every peer's input on the CPU.
SIZES = [(0, 1.0), (KiB, 1.0), (16 * KiB, 1.0), (64 * KiB, 1.0), (256 * KiB, 1.0), (512 * KiB, 1.0),
         (MiB, 1.0), (2 * MiB, 1.0), (4 * MiB, 1.0), (8 * MiB, 0.6), (16 * MiB, 0.3), (32 * MiB, 0.1)]
QUICK_SIZES = [(0, 1.0), (KiB, 1.0), (64 * KiB, 1.0), (512 * KiB, 1.0), (2 * MiB, 1.0), (8 * MiB, 0.5)]
# How a size is nudged: exactly, one element either side, 16 bytes either side.
VARIANTS = ["exact", "exact", "+1 element", "-1 element", "+16 B", "-16 B"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int32": torch.int32, "int64": torch.int64, "float64": torch.float64}
DTYPE_WEIGHTS = {"float32": 3, "bfloat16": 2, "float16": 1, "int32": 1, "int64": 1, "float64": 1}

# Relative tolerance per dtype for avg and prod of floats, multiplied by the world size (see above).
REL_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}

REDOPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
          "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}

# Integer outputs are poisoned with a value no input or result takes.
SENTINEL = {torch.int32: -1515870811, torch.int64: -6510615555426900571}
# Integer types of each element size, to compare floats bit for bit.
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

MAX_FAIL_LINES = 100  # per rank; later failures are counted only
MAX_IN_FLIGHT = 3  # async calls waiting on one group


def say(text):
    """One line to stdout in one write, so lines of ranks sharing a terminal or pipe never interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def is_float(dtype):
    return dtype.is_floating_point


_ELSIZE = {}


def elsize(dtype):
    if dtype not in _ELSIZE:
        _ELSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return _ELSIZE[dtype]


# ---------------------------------------------------------------- inputs and references

def input_seed(seed, step, rank, tag):
    """A generator seed of (seed, step, rank, tag), the same in every process."""
    text = f"{seed}/{step}/{rank}/{tag}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def make_input(seed, step, rank, count, dtype, kind, world, tag=0):
    """Rank `rank`'s input of step `step`, on the CPU: every rank can build every rank's input.
    kind: "sum" / "avg" small integers, "prod" near-1 floats or -2..2, "min" / "max" / "data" any
    values of the type."""
    g = torch.Generator().manual_seed(input_seed(seed, step, rank, tag))
    if kind in ("sum", "avg"):  # integers, generated in the type itself (floats hold them exactly)
        lim = max(1, 128 // world) if is_float(dtype) else 1000
        return torch.randint(-lim, lim + 1, (count,), generator=g, dtype=dtype)
    if kind == "prod":
        if is_float(dtype):
            return (0.75 + 0.5 * torch.rand(count, generator=g, dtype=torch.float64)).to(dtype)
        lim = 2 if world <= 30 else 1
        return torch.randint(-lim, lim + 1, (count,), generator=g, dtype=dtype)
    if is_float(dtype):
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        return torch.randn(count, generator=g, dtype=wide).to(dtype)
    hi = 1 << (31 if dtype == torch.int32 else 62)
    return torch.randint(-hi + 1, hi, (count,), generator=g, dtype=torch.int64).to(dtype)


def make_parts(seed, step, rank, counts, dtype, kind, world):
    """An input made of parts (reduce_scatter, all_to_all): part p from its own generator (tag p), so
    a peer rebuilds only the part it receives."""
    return torch.cat([make_input(seed, step, rank, n, dtype, kind, world, tag=p) for p, n in enumerate(counts)])


def reduce_reference(xs, redop, dtype):
    """(want, scale): the reduction of the inputs `xs` in float64 (int64 for integers) and, where the
    comparison has a tolerance (avg, prod of floats), the magnitude it scales with; scale None: exact."""
    n = len(xs)
    wide = torch.float64 if is_float(dtype) else torch.int64
    acc = xs[0].to(wide, copy=True)  # a copy even where xs[0] is already float64 / int64
    toleranced = is_float(dtype) and redop in ("avg", "prod")
    mag = acc.abs() if toleranced else None
    for x in xs[1:]:
        w = x.to(wide)
        if redop in ("sum", "avg"):
            acc += w
            if toleranced:
                mag += w.abs()
        elif redop == "prod":
            acc *= w
            if toleranced:
                mag *= w.abs()
        elif redop == "min":
            torch.minimum(acc, w, out=acc)
        elif redop == "max":
            torch.maximum(acc, w, out=acc)
        else:
            raise ValueError(redop)
    if redop == "avg":
        acc /= n
        mag /= n
    return acc, mag


def wrong_mask(got, want, scale, dtype, nranks, bits):
    """A boolean mask of the wrong elements of `got` (CPU). bits: `want` has `got`'s dtype and must match
    bit for bit; else `want` is float64 / int64, exact unless `scale` gives the tolerance's magnitude."""
    if bits:
        it = BITS[got.element_size()]
        return got.view(it) != want.view(it)
    if is_float(dtype):
        g = got.to(torch.float64)
        if scale is None:
            return ~(g == want)  # NaN is never equal
        return ~((g - want).abs() <= REL_TOL[dtype] * nranks * scale)
    return got.to(torch.int64) != want


def fmt(v):
    return f"{v:.7g}" if isinstance(v, float) else str(v)


def poison(t):
    """Fills an output with a value no result has: NaN for floats, SENTINEL for integers."""
    if t.numel():
        t.fill_(float("nan") if is_float(t.dtype) else SENTINEL[t.dtype])


# ---------------------------------------------------------------- the shared schedule

class Step:
    """One collective of the schedule (identical on every rank). count: elements of the buffer
    (all_reduce, broadcast, reduce, the ring's forward message) or of one rank's part (gathers,
    reduce_scatter, equal all-to-all); splits: unequal all-to-all, splits[s][d] elements from s to d."""
    FIELDS = ("index", "op", "dtype", "count", "size", "redop", "root", "inplace", "async_op", "wait",
              "group", "splits", "count2")

    def __init__(self, **kw):
        for f in self.FIELDS:
            setattr(self, f, kw.pop(f, None))
        assert not kw, kw

    def key(self):
        return repr(tuple(getattr(self, f) for f in self.FIELDS))

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]


class Planner:
    """Draws the schedule from one RNG seeded by the seed alone; it never looks at the rank."""
    OPS = {"all_reduce": 26, "all_gather_into_tensor": 12, "all_gather": 6, "reduce_scatter_tensor": 10,
           "broadcast": 10, "reduce": 8, "all_to_all_single": 10, "ring": 8}

    def __init__(self, seed, world, max_bytes, quick, ops=None, sync_only=False, one_group=False):
        self.rng = random.Random(f"schedule/{seed}")
        self.sync_only, self.one_group = sync_only, one_group
        self.world = world
        self.max_bytes = max_bytes
        sizes = QUICK_SIZES if quick else SIZES
        self.sizes = [(b, w) for b, w in sizes if b <= max_bytes] or [(0, 1.0)]
        self.variants = VARIANTS[:4] if quick else VARIANTS
        self.next_index = 0
        self.ops = {op: w for op, w in self.OPS.items()
                    if (op != "ring" or world > 1) and (not ops or op in ops)}

    def _choice(self, weighted):
        keys = list(weighted)
        return self.rng.choices(keys, weights=[weighted[k] for k in keys])[0]

    def index(self, n=1):
        i = self.next_index
        self.next_index += n
        return i

    def size(self, dtype, per=1, cap=None, sizes=None):
        """(elements, label): a message of one of the sizes, nudged, divided into `per` parts
        (the elements of one part), at least one element, parts * elements * elsize <= cap (+16 B)."""
        cap = self.max_bytes if cap is None else cap
        esz = elsize(DTYPES[dtype])
        pool = [(b, w) for b, w in (sizes or self.sizes) if b <= cap] or \
            [max([(b, w) for b, w in self.sizes if b <= cap] or [(0, 1.0)])]  # else the largest that fits
        base = self.rng.choices([b for b, _ in pool], weights=[w for _, w in pool])[0]
        variant = self.rng.choice(self.variants)
        if base == 0:  # one element, or two
            return (2, "2 elements") if variant == "+1 element" else (1, "1 element")
        delta = {"exact": 0, "+1 element": 1, "-1 element": -1, "+16 B": max(1, 16 // esz),
                 "-16 B": -max(1, 16 // esz)}[variant]
        label = (f"{base // MiB} MiB" if base >= MiB else f"{base // KiB} KiB") + \
            ("" if variant == "exact" else f" {variant}")
        return max(1, base // esz // per + delta), label

    def dtype(self, floats_only=False):
        names = {k: w for k, w in DTYPE_WEIGHTS.items() if not floats_only or is_float(DTYPES[k])}
        return self._choice(names)

    def redop(self, dtype):
        ops = {"sum": 4, "prod": 1, "min": 1, "max": 1}
        if is_float(DTYPES[dtype]):
            ops["avg"] = 1
        return self._choice(ops)

    def step(self):
        r, world = self.rng, self.world
        op = self._choice(self.ops)
        dtype = self.dtype()
        kw = dict(op=op, dtype=dtype, redop="sum", root=0, inplace=False, splits=(), count2=0,
                  group="second" if r.random() < 0.3 and not self.one_group else "world")
        if op in ("all_reduce", "reduce"):
            kw["count"], kw["size"] = self.size(dtype)
            kw["redop"] = self.redop(dtype)
            kw["root"] = r.randrange(world)
        elif op == "broadcast":
            kw["count"], kw["size"] = self.size(dtype)
            kw["root"] = r.randrange(world)
        elif op in ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor"):
            # The size is the whole buffer (the selector's measure), sometimes one rank's part.
            kw["count"], kw["size"] = self.size(dtype, per=world)
            if r.random() < 0.3:
                count, label = self.size(dtype, cap=self.max_bytes // world)
                kw["count"], kw["size"] = count, label + " per rank"
            kw["inplace"] = op != "all_gather" and r.random() < 0.3
            if op == "reduce_scatter_tensor":
                kw["redop"] = self.redop(dtype)
        elif op == "all_to_all_single":
            if r.random() < 0.5:
                kw["count"], kw["size"] = self.size(dtype, per=world)
            else:  # unequal: each part 0.5x to 1.5x the mean, some empty (never a rank's part for itself)
                total, label = self.size(dtype, cap=self.max_bytes * 2 // 3)
                mean = max(1, total // world)
                splits = [[0 if (s != d and r.random() < 0.1) else r.randint(mean - mean // 2, mean + mean // 2)
                           for d in range(world)] for s in range(world)]
                for s in range(world):
                    splits[s][s] = max(1, splits[s][s])
                kw["splits"] = tuple(tuple(row) for row in splits)
                kw["count"], kw["size"] = total, label + " in all, unequal splits"
        elif op == "ring":
            kw["count"], kw["size"] = self.size(dtype)
            kw["count2"], label2 = self.size(dtype)
            kw["size"] += f" / {label2}"
        # batch_isend_irecv is always async
        kw["async_op"] = op == "ring" or (r.random() < 0.5 and not self.sync_only)
        kw["wait"] = not kw["async_op"] or r.random() < 0.4
        return Step(index=self.index(), **kw)

    def graph(self, second_group):
        """The ops one CUDA graph captures: (op, dtype, count, redop, group) each: an all-reduce at a
        packet size, one at a zero-copy size at every world size (above 4 MiB), an all-gather of
        1 to 8 MiB in all (zero-copy from 2 MiB, or 512 KiB from 5 ranks on)."""
        small = [(b, w) for b, w in SIZES if b <= 256 * KiB]
        large = [(8 * MiB, 1.0), (16 * MiB, 0.5)]
        gather = [(MiB, 0.5), (4 * MiB, 1.0), (8 * MiB, 1.0)]
        dt1, dt2, dt3 = self.dtype(floats_only=True), self.dtype(), self.dtype()
        return [
            ("all_reduce", dt1, self.size(dt1, sizes=small)[0], self.rng.choice(["sum", "max"]),
             "second" if second_group else "world"),
            ("all_reduce", dt2, self.size(dt2, sizes=large)[0], "sum", "world"),
            ("all_gather_into_tensor", dt3, self.size(dt3, per=self.world, sizes=gather)[0], "sum", "world"),
        ]


def build_schedule(args, world):
    """Every phase's steps, drawn up front (so every rank can check it holds the same schedule)."""
    p = Planner(args.seed, world, args.max_bytes, args.quick,
                ops=args.ops.split(",") if args.ops else None, sync_only=args.sync_only,
                one_group=args.one_group)
    sched = {"eager": [p.step() for _ in range(args.iters)], "graphs": []}
    for gi in range(2):
        ops = p.graph(second_group=gi == 1)
        base = p.index(len(ops) * args.graph_replays)
        between = [[p.step() for _ in range(p.rng.randint(2, 6))] for _ in range(args.graph_replays)]
        sched["graphs"].append({"ops": ops, "base": base, "between": between})
    sched["after"] = [p.step() for _ in range(max(50, args.iters // 10))]
    return sched


def schedule_digest(sched):
    h = hashlib.sha256()
    for st in sched["eager"] + sched["after"]:
        h.update(st.key().encode())
    for g in sched["graphs"]:
        h.update(repr(g["ops"]).encode() + str(g["base"]).encode())
        for steps in g["between"]:
            for st in steps:
                h.update(st.key().encode())
    return int.from_bytes(h.digest()[:7], "little")


# ---------------------------------------------------------------- rank-dependent allocations

class Allocator:
    """This rank's own allocation behaviour, from an RNG of (seed, rank): extra allocations before each
    collective, a pool of tensors kept for a while, empty_cache on some ranks, and where a collective's
    buffers go (fresh, a view at an odd offset into a larger tensor, or inside a pool tensor)."""

    def __init__(self, seed, rank, dev, max_bytes):
        self.rng = r = random.Random(f"alloc/{seed}/{rank}")
        self.dev = dev
        self.cuda = dev.type == "cuda"
        self.burst = 1 + rank % 4  # most extra allocations at a time
        self.keep = 0.2 + 0.6 * r.random()  # the share of them kept in the pool
        self.empty_cache = 0.0 if rank % 3 == 0 else 0.01 + 0.02 * r.random()
        self.view_share = 0.2 + 0.4 * r.random()
        self.pool_share = 0.1 + 0.3 * r.random()
        self.pool_cap = 3 * max_bytes
        self.extra_log2 = math.log2(max(64, max_bytes // 2))
        self.pool = []  # [tensor (uint8), drop after step, busy with step or None]
        self.seen = set()  # addresses of earlier collective buffers
        self.buffers = self.reused = 0  # collective buffers placed, and how many at a seen address

    def describe(self):
        return (f"burst {self.burst}, keep {self.keep:.2f}, empty_cache {self.empty_cache:.3f}, "
                f"views {self.view_share:.2f}, in pool {self.pool_share:.2f}")

    def churn(self, step, during=False):
        """Extra allocations of random sizes, some kept, some dropped at once; old pool entries expire.
        during: while a collective is in flight (fewer, no empty_cache)."""
        r = self.rng
        self.pool = [e for e in self.pool if e[1] > step]
        if r.random() < 0.005:
            self.pool = [e for e in self.pool if e[2] is not None]  # drop everything idle at once
        for _ in range(r.randint(0, 1 if during else self.burst)):
            nbytes = int(2 ** r.uniform(0, self.extra_log2)) + r.randrange(0, 64)
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
            if r.random() < self.keep:
                self.pool.append([t, step + r.randint(1, 100), None])
            del t  # the rest goes back to the allocator's cache at once
        while sum(e[0].numel() for e in self.pool) > self.pool_cap:
            self.pool.pop(r.randrange(len(self.pool)))
        if self.cuda and not during and r.random() < self.empty_cache:
            torch.cuda.empty_cache()

    def buffer(self, count, dtype, step):
        """(tensor, where): `count` contiguous elements placed this rank's way; `where` says how."""
        t, where = self._place(count, dtype, step)
        self.buffers += 1
        if t.data_ptr() in self.seen:
            self.reused += 1
        self.seen.add(t.data_ptr())
        return t, where

    def _place(self, count, dtype, step):
        r = self.rng
        u = r.random()
        esz = elsize(dtype)
        if count and u < self.view_share:
            off = 2 * r.randrange(0, 1024) + 1
            big = torch.empty(off + count + r.randrange(0, 1024), dtype=dtype, device=self.dev)
            return big[off:off + count], f"view +{off}"
        if count and u < self.view_share + self.pool_share:
            idle = [e for e in self.pool if e[2] is None and e[0].numel() >= (count + 2) * esz]
            if idle:
                e = r.choice(idle)
                room = e[0].numel() // esz - count  # >= 2
                off = 2 * r.randrange(0, (room + 1) // 2) + 1
                e[2] = step
                return e[0][off * esz:(off + count) * esz].view(dtype), f"pool +{off}"
        return torch.empty(count, dtype=dtype, device=self.dev), "fresh"

    def release(self, step):
        for e in self.pool:
            if e[2] == step:
                e[2] = None

    def graph_buffer(self, count, dtype):
        """Inside a capture (the graph's pool): a rank-dependent padding allocation, then a view at an
        odd offset into a larger tensor; returns (view, where, padding)."""
        r = self.rng
        pad = torch.empty(r.randrange(1, 1 << 20), dtype=torch.uint8, device=self.dev)
        off = 2 * r.randrange(0, 512) + 1
        big = torch.empty(off + count + r.randrange(0, 512), dtype=dtype, device=self.dev)
        return big[off:off + count], f"graph pool view +{off}", pad


# ---------------------------------------------------------------- the run

class Run:
    def __init__(self, args, rank, world, dev, groups, verdict_group):
        self.args, self.rank, self.world, self.dev = args, rank, world, dev
        self.seed = args.seed
        self.groups = groups  # "world" / "second" -> process group
        self.verdict_group = verdict_group
        self.alloc = Allocator(args.seed, rank, dev, args.max_bytes)
        self.passed = self.failed = self.issued = 0
        self.fail_lines = 0
        self.pending = []  # (works, step, checker) of the calls in flight, oldest first
        self.cuda = dev.type == "cuda"

    # ------------------------------------------------ reporting

    def report_fail(self, what, detail):
        self.failed += 1
        if self.fail_lines < MAX_FAIL_LINES:
            self.fail_lines += 1
            say(f"[rank {self.rank}] FAIL {what}: {detail}")
        elif self.fail_lines == MAX_FAIL_LINES:
            self.fail_lines += 1
            say(f"[rank {self.rank}] (further failures are counted, not printed)")

    def check(self, what, got, want, scale=None, bits=False, where="", part=None):
        """One check: every element of `got` (device) against `want` (CPU). part: elements of each rank's
        part of the output, to name the rank a wrong element came from."""
        got = got.cpu()
        dtype = got.dtype
        if got.shape != want.shape:
            self.report_fail(what, f"shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            return
        bad = wrong_mask(got, want, scale, dtype, self.world, bits)
        if not bad.any():
            self.passed += 1
            if self.args.verbose:
                say(f"[rank {self.rank}] PASS {what} ({got.numel()} elements)")
            return
        idx = bad.nonzero()
        i = idx[0].item()
        g, w = got[i].item(), want[i].item()
        whose = f" (rank {i // part}'s part, element {i % part})" if part else ""
        tol = f", tolerance {REL_TOL[dtype] * self.world * scale[i].item():.3g}" if scale is not None else ""
        self.report_fail(what, f"{where}: {idx.numel()} of {got.numel()} elements wrong, first at "
                               f"index {i}{whose}: got {fmt(g)}, expected {fmt(w)}{tol}")

    @staticmethod
    def label(st, name=None):
        mode = ("async" if st.async_op else "sync") + (", in place" if st.inplace else "")
        op = name or st.op
        if st.op in ("all_reduce", "reduce_scatter_tensor", "reduce"):
            op += f" {st.redop}"
        if st.op in ("broadcast", "reduce"):
            op += f" root={st.root}"
        return (f"step {st.index} {op} {st.dtype} n={st.count} ({st.size}) group={st.group} {mode}")

    # ------------------------------------------------ issuing and waiting

    def inputs(self, st, count, kind, tag=0):
        """Every rank's input (or part `tag` of it) of step `st`, rebuilt on the CPU."""
        return [make_input(self.seed, st.index, r, count, st.torch_dtype, kind, self.world, tag)
                for r in range(self.world)]

    def own_input(self, st, count, kind, tag=0):
        return make_input(self.seed, st.index, self.rank, count, st.torch_dtype, kind, self.world, tag)

    def submit(self, st, works, checker):
        """Queues a call's check: at once for a sync call, after its works for an async one."""
        self.issued += 1
        self.pending.append((works, st, checker))
        self.alloc.churn(st.index, during=True)
        if not st.async_op or st.wait:
            self.drain()

    def drain(self):
        """Waits for every call in flight, oldest first, and checks each."""
        pending, self.pending = self.pending, []
        for works, st, checker in pending:
            for w in works:
                w.wait()
            checker()
            self.alloc.release(st.index)

    def run_step(self, st):
        faulthandler.dump_traceback_later(self.args.stall_timeout, exit=True)
        # Calls in flight share one stream only within a group, and torch may run point-to-point
        # batches on a stream of their own: two spinning kernels of one rank on different streams can
        # wait for each other when ranks share a GPU, so a ring exchange or a change of group drains.
        last = self.pending[-1][1] if self.pending else None
        if last and ("ring" in (st.op, last.op) or st.group != last.group or len(self.pending) >= MAX_IN_FLIGHT):
            self.drain()
        self.alloc.churn(st.index)
        OPS[st.op](self, st)

    def works(self, st, result):
        return [result] if st.async_op else []

    # ------------------------------------------------ one function per operation

    def op_all_reduce(self, st):
        """In place; the result against the reduction of every rank's input."""
        buf, where = self.alloc.buffer(st.count, st.torch_dtype, st.index)
        buf.copy_(self.own_input(st, st.count, st.redop))
        w = dist.all_reduce(buf, op=REDOPS[st.redop], group=self.groups[st.group], async_op=st.async_op)

        def checker():
            want, scale = reduce_reference(self.inputs(st, st.count, st.redop), st.redop, st.torch_dtype)
            self.check(self.label(st), buf, want, scale, where=f"{where} ptr {buf.data_ptr():#x}")
        self.submit(st, self.works(st, w), checker)

    def op_all_gather_into_tensor(self, st):
        """Out of place (the input dropped once issued when async) or in place (the input is this
        rank's part of the output); the output against every rank's input, bit for bit."""
        c, dt = st.count, st.torch_dtype
        out, where = self.alloc.buffer(self.world * c, dt, st.index)
        poison(out)
        if st.inplace:
            inp = out[self.rank * c:(self.rank + 1) * c]
        else:
            inp, iwhere = self.alloc.buffer(c, dt, st.index)
            where += f", input {iwhere}"
        inp.copy_(self.own_input(st, c, "data"))
        w = dist.all_gather_into_tensor(out, inp, group=self.groups[st.group], async_op=st.async_op)
        del inp  # for an async call: the input's only reference is the work's now

        def checker():
            self.check(self.label(st), out, torch.cat(self.inputs(st, c, "data")), bits=True,
                       where=f"output {where}; output ptr {out.data_ptr():#x}", part=c)
        self.submit(st, self.works(st, w), checker)

    def op_all_gather(self, st):
        """Into a list of separately placed tensors; the input dropped once issued when async."""
        c, dt = st.count, st.torch_dtype
        placed = [self.alloc.buffer(c, dt, st.index) for _ in range(self.world)]
        outs = [t for t, _ in placed]
        for t in outs:
            poison(t)
        inp, iwhere = self.alloc.buffer(c, dt, st.index)
        inp.copy_(self.own_input(st, c, "data"))
        w = dist.all_gather(outs, inp, group=self.groups[st.group], async_op=st.async_op)
        del inp
        where = "outputs " + ", ".join(wh for _, wh in placed) + f"; input {iwhere}"

        def checker():
            got = torch.cat([t.cpu() for t in outs])
            self.check(self.label(st), got, torch.cat(self.inputs(st, c, "data")), bits=True,
                       where=where, part=c)
        self.submit(st, self.works(st, w), checker)

    def op_reduce_scatter_tensor(self, st):
        """Out of place (output poisoned; input dropped once issued when async) or in place (the output
        is this rank's part of the input); this rank's part of the reduction."""
        c, dt, world = st.count, st.torch_dtype, self.world
        kind = st.redop
        inp, where = self.alloc.buffer(world * c, dt, st.index)
        inp.copy_(make_parts(self.seed, st.index, self.rank, [c] * world, dt, kind, world))
        if st.inplace:
            out = inp[self.rank * c:(self.rank + 1) * c]
        else:
            out, owhere = self.alloc.buffer(c, dt, st.index)
            poison(out)
            where += f", output {owhere}"
        w = dist.reduce_scatter_tensor(out, inp, op=REDOPS[st.redop], group=self.groups[st.group],
                                       async_op=st.async_op)
        del inp

        def checker():
            want, scale = reduce_reference(self.inputs(st, c, kind, tag=self.rank), st.redop, dt)
            self.check(self.label(st), out, want, scale, where=f"input {where}; output ptr {out.data_ptr():#x}")
        self.submit(st, self.works(st, w), checker)

    def op_broadcast(self, st):
        """The root's input on every rank (the others' buffers poisoned), bit for bit."""
        buf, where = self.alloc.buffer(st.count, st.torch_dtype, st.index)
        if self.rank == st.root:
            buf.copy_(self.own_input(st, st.count, "data"))
        else:
            poison(buf)
        w = dist.broadcast(buf, src=st.root, group=self.groups[st.group], async_op=st.async_op)

        def checker():
            want = make_input(self.seed, st.index, st.root, st.count, st.torch_dtype, "data", self.world)
            self.check(self.label(st), buf, want, bits=True, where=f"{where} ptr {buf.data_ptr():#x}")
        self.submit(st, self.works(st, w), checker)

    def op_reduce(self, st):
        """In place; the reduction checked on the root only."""
        buf, where = self.alloc.buffer(st.count, st.torch_dtype, st.index)
        buf.copy_(self.own_input(st, st.count, st.redop))
        w = dist.reduce(buf, dst=st.root, op=REDOPS[st.redop], group=self.groups[st.group],
                        async_op=st.async_op)

        def checker():
            if self.rank != st.root:
                return
            want, scale = reduce_reference(self.inputs(st, st.count, st.redop), st.redop, st.torch_dtype)
            self.check(self.label(st), buf, want, scale, where=f"{where} ptr {buf.data_ptr():#x}")
        self.submit(st, self.works(st, w), checker)

    def op_all_to_all_single(self, st):
        """Equal parts, or the schedule's unequal splits; the input dropped once issued when async; the
        output (poisoned first) against each rank's part for this rank, bit for bit."""
        dt, world, me = st.torch_dtype, self.world, self.rank
        if st.splits:
            sends = list(st.splits[me])
            recvs = [st.splits[s][me] for s in range(world)]
        else:
            sends = recvs = [st.count] * world
        inp, iwhere = self.alloc.buffer(sum(sends), dt, st.index)
        out, where = self.alloc.buffer(sum(recvs), dt, st.index)
        poison(out)
        inp.copy_(make_parts(self.seed, st.index, me, sends, dt, "data", world))
        kw = dict(output_split_sizes=recvs, input_split_sizes=sends) if st.splits else {}
        w = dist.all_to_all_single(out, inp, group=self.groups[st.group], async_op=st.async_op, **kw)
        del inp
        where += f", input {iwhere}"

        def checker():  # part `me` of each rank's input
            want = torch.cat([make_input(self.seed, st.index, s, recvs[s], dt, "data", world, tag=me)
                              for s in range(world)])
            self.check(self.label(st), out, want, bits=True, where=f"output {where}; output ptr {out.data_ptr():#x}",
                       part=None if st.splits else st.count)
        self.submit(st, self.works(st, w), checker)

    def op_ring(self, st):
        """batch_isend_irecv: to the next rank and from the previous one (count elements), and the
        other way round (count2); the send buffers dropped once issued; both messages bit for bit."""
        dt, world, me = st.torch_dtype, self.world, self.rank
        nxt, prv = (me + 1) % world, (me - 1) % world
        fwd, fwhere = self.alloc.buffer(st.count, dt, st.index)
        bwd, bwhere = self.alloc.buffer(st.count2, dt, st.index)
        got_f, rwhere_f = self.alloc.buffer(st.count, dt, st.index)
        got_b, rwhere_b = self.alloc.buffer(st.count2, dt, st.index)
        fwd.copy_(self.own_input(st, st.count, "data", tag=1))
        bwd.copy_(self.own_input(st, st.count2, "data", tag=2))
        poison(got_f)
        poison(got_b)
        g = self.groups[st.group]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, fwd, nxt, g), dist.P2POp(dist.irecv, got_f, prv, g),
                                        dist.P2POp(dist.isend, bwd, prv, g), dist.P2POp(dist.irecv, got_b, nxt, g)])
        del fwd, bwd

        def checker():
            def mk(r, n, tag):
                return make_input(self.seed, st.index, r, n, dt, "data", world, tag)
            self.check(self.label(st, f"ring from rank {prv}"), got_f, mk(prv, st.count, 1), bits=True,
                       where=f"receive {rwhere_f} ptr {got_f.data_ptr():#x}; sends {fwhere}, {bwhere}")
            self.check(self.label(st, f"ring from rank {nxt}") + f" n2={st.count2}", got_b, mk(nxt, st.count2, 2),
                       bits=True, where=f"receive {rwhere_b} ptr {got_b.data_ptr():#x}")
        self.submit(st, works or [], checker)

    # ------------------------------------------------ phases

    def eager(self, name, steps):
        t0 = time.time()
        for i, st in enumerate(steps):
            self.run_step(st)
            if self.rank == 0 and (i + 1) % 250 == 0:
                say(f"[rank 0] {name}: {i + 1}/{len(steps)} collectives, {time.time() - t0:.1f} s")
        self.drain()

    def graph_phase(self, specs):
        """Captures each spec's collectives into a CUDA graph (tensors from the graph's pool), replays
        each --graph-replays times with fresh inputs, checking each replay, eager steps in between."""
        faulthandler.dump_traceback_later(self.args.stall_timeout, exit=True)
        side = torch.cuda.Stream(device=self.dev)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch asks before capturing
            for g in self.groups.values():
                dist.all_reduce(torch.ones(16, device=self.dev), group=g)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graphs = []
        for gi, spec in enumerate(specs):
            self.alloc.churn(spec["base"])
            captured = []
            pads = []
            graph = torch.cuda.CUDAGraph()
            faulthandler.dump_traceback_later(self.args.stall_timeout, exit=True)
            with torch.cuda.graph(graph, stream=side):
                for opname, dtname, count, redop, group in spec["ops"]:
                    dt = DTYPES[dtname]
                    if opname == "all_reduce":
                        x, where, pad = self.alloc.graph_buffer(count, dt)
                        dist.all_reduce(x, op=REDOPS[redop], group=self.groups[group])
                        captured.append((opname, dtname, count, redop, group, x, None, where))
                    else:
                        x, where, pad = self.alloc.graph_buffer(count, dt)
                        out, owhere, pad2 = self.alloc.graph_buffer(self.world * count, dt)
                        pads.append(pad2)
                        dist.all_gather_into_tensor(out, x, group=self.groups[group])
                        captured.append((opname, dtname, count, redop, group, x, out,
                                         f"input {where}, output {owhere}"))
                    if self.alloc.rng.random() < 0.5:
                        pads.append(pad)  # kept; else its block is free for the next allocation
                    del pad
            torch.cuda.synchronize()
            graphs.append((gi, spec, graph, captured, pads))
            if self.rank == 0:
                ops = ", ".join(f"{c[0]} {c[1]} n={c[2]} {c[3]} group={c[4]}" for c in captured)
                say(f"[rank 0] graph {gi}: captured {ops}")
        for rep in range(self.args.graph_replays):
            faulthandler.dump_traceback_later(self.args.stall_timeout, exit=True)
            for gi, spec, graph, captured, _ in graphs:
                self.replay(gi, spec, graph, captured, rep)
            for gi, spec, _, _, _ in graphs:
                for st in spec["between"][rep]:
                    self.run_step(st)
                self.drain()
        for entry in graphs:
            entry[2].reset()
        del graphs, captured, pads
        torch.cuda.synchronize()

    def replay(self, gi, spec, graph, captured, rep):
        nops = len(spec["ops"])
        steps = []
        for j, (opname, dtname, count, redop, group, x, out, where) in enumerate(captured):
            idx = spec["base"] + rep * nops + j
            st = Step(index=idx, op=opname, dtype=dtname, count=count, size="graph", redop=redop, root=0,
                      inplace=opname == "all_reduce", async_op=False, wait=True, group=group, splits=(), count2=0)
            kind = redop if opname == "all_reduce" else "data"
            x.copy_(self.own_input(st, count, kind))
            if out is not None:
                poison(out)
            steps.append((st, kind, x, out, where))
        graph.replay()
        self.issued += nops
        torch.cuda.synchronize()
        for st, kind, x, out, where in steps:
            name = self.label(st, f"graph {gi} replay {rep}: {st.op}")
            if out is None:
                want, scale = reduce_reference(self.inputs(st, st.count, kind), st.redop, st.torch_dtype)
                self.check(name, x, want, scale, where=f"{where} ptr {x.data_ptr():#x}")
            else:
                self.check(name, out, torch.cat(self.inputs(st, st.count, kind)), bits=True,
                           where=f"{where} ptr {out.data_ptr():#x}", part=st.count)

    def agree(self, phase, t0):
        """Between phases: every call waited for, a barrier, and the counts summed over all ranks."""
        self.drain()
        faulthandler.dump_traceback_later(self.args.stall_timeout, exit=True)
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t = torch.tensor([self.passed, self.failed, self.issued], dtype=torch.int64)
        if self.verdict_group is None:  # no gloo: over the collective backend itself
            t = t.to(self.dev)
        dist.all_reduce(t, group=self.verdict_group)
        passed, failed, issued = (int(v) for v in t.cpu().tolist())
        if self.rank == 0:
            say(f"[rank 0] after phase {phase} ({time.time() - t0:.1f} s): {passed} checks passed, "
                f"{failed} failed over all ranks; {issued} collectives issued over all ranks")
        return passed, failed


OPS = {"all_reduce": Run.op_all_reduce, "all_gather_into_tensor": Run.op_all_gather_into_tensor,
       "all_gather": Run.op_all_gather, "reduce_scatter_tensor": Run.op_reduce_scatter_tensor,
       "broadcast": Run.op_broadcast, "reduce": Run.op_reduce, "all_to_all_single": Run.op_all_to_all_single,
       "ring": Run.op_ring}


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=2000, help="collectives in the eager phase")
    p.add_argument("--seed", type=int, default=None, help="schedule and allocation seed (default: from rank 0's clock)")
    p.add_argument("--max-bytes", type=int, default=32 * MiB, help="largest buffer of any collective")
    p.add_argument("--graph-replays", type=int, default=5, help="replays of each CUDA graph")
    p.add_argument("--quick", action="store_true", help="fewer sizes (up to 8 MiB)")
    p.add_argument("--verbose", action="store_true", help="print every passing check too")
    p.add_argument("--ops", default="", help="comma list: only these operations (of Planner.OPS)")
    p.add_argument("--sync-only", action="store_true", help="no async_op=True calls (but the ring)")
    p.add_argument("--one-group", action="store_true", help="every call on the default group")
    p.add_argument("--stall-timeout", type=float, default=300.0,
                   help="seconds without progress after which a rank prints its stacks and exits 1")
    p.add_argument("--cpu", action="store_true",
                   help="CPU tensors over gloo, no graph phase: checks this program, not the shim")
    return p.parse_args(argv)


def agree_seed(args, dev, verdict):
    """Rank 0's seed (--seed, else one from its clock) on every rank."""
    mine = args.seed if args.seed is not None else int(time.time() * 1000) % 1_000_000_007
    t = torch.tensor([mine], dtype=torch.int64)
    if verdict is None:
        t = t.to(dev)
    dist.broadcast(t, src=0, group=verdict)
    args.seed = int(t.item())


def init(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # The ranks of a host share its cores for the CPU references.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    timeout = datetime.timedelta(seconds=120)
    if args.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    else:
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            dist.init_process_group("nccl", timeout=timeout, device_id=dev)
        else:
            dist.init_process_group("nccl", timeout=timeout)
    second = dist.new_group(list(range(world)), timeout=timeout)
    # The pass/fail counts are summed over gloo (the host), not through the library under test.
    verdict = None
    if args.cpu or dist.is_gloo_available():
        verdict = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    return rank, world, dev, {"world": None, "second": second}, verdict


def main(argv=None):
    args = parse_args(argv)
    rank, world, dev, groups, verdict = init(args)
    agree_seed(args, dev, verdict)
    if rank == 0:
        say(f"[rank 0] torch_divergent seed {args.seed}: {world} ranks, --iters {args.iters} --max-bytes "
            f"{args.max_bytes} --graph-replays {args.graph_replays}{' --quick' if args.quick else ''}"
            f"{' --cpu' if args.cpu else ''} (replay with the same --seed, options and rank count)")
    sched = build_schedule(args, world)
    digest = torch.tensor([schedule_digest(sched)], dtype=torch.int64)
    digests = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    if verdict is not None:
        dist.all_gather(digests, digest, group=verdict)
    else:
        gathered = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
        dist.all_gather(gathered, digest.to(dev))
        digests = [d.cpu() for d in gathered]
    if len({int(d.item()) for d in digests}) != 1:
        raise RuntimeError(f"the ranks drew different schedules: {[int(d.item()) for d in digests]}")
    run = Run(args, rank, world, dev, groups, verdict)
    nccl = "" if args.cpu else f", NCCL version seen {torch.cuda.nccl.version()}"
    say(f"[rank {rank}] device {dev}{nccl}; allocations: {run.alloc.describe()}")
    t0 = time.time()

    run.eager("eager", sched["eager"])
    run.agree("eager", t0)
    if run.cuda:
        run.graph_phase(sched["graphs"])
        run.agree("graph", t0)
    elif rank == 0:
        say("[rank 0] phase graph skipped: no CUDA device (--cpu)")
    run.alloc.pool.clear()
    if run.cuda and rank % 2 == 1:
        torch.cuda.empty_cache()
    run.eager("after", sched["after"])
    passed, failed = run.agree("after", t0)
    faulthandler.cancel_dump_traceback_later()

    say(f"[rank {rank}] checks: {run.passed} ok and {run.failed} wrong on this rank, "
        f"collectives issued: {run.issued}; buffers placed: {run.alloc.buffers}, "
        f"{run.alloc.reused} at an address an earlier one had")
    dist.barrier(group=verdict)
    if rank == 0:
        say(f"{passed} passed, {failed} failed")
    dist.destroy_process_group()
    return 1 if failed else 0


def cli():
    """main() with its exit status; any exception prints its traceback and exits 1 at once."""
    try:
        code = main()
    except BaseException as e:  # noqa: BLE001 -- report anything, then exit non-zero rather than hang
        if isinstance(e, SystemExit) and e.code in (0, None):  # --help
            raise
        print(f"[rank {os.environ.get('RANK', '?')}] FAIL exception: {e!r}", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # Not sys.exit: the process group's teardown can wait on peers stuck in a collective.
        os._exit(1)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    cli()
