// mscclpp-rs: the interpreter of MSCCL++ JSON execution plans.
//
// One launch per execution, `replicas` blocks per plan threadblock (blocks b * replicas ..
// (b + 1) * replicas - 1 run threadblock b). Each walks the threadblock's program (its ops and the
// references and ids they name: Program, copied into shared memory), encoded once per plan by
// mscclpp-executor (encode.rs) from the validated JSON; the struct layouts are mirrored by
// kernels-cu/src/executor.rs and checked by the static_asserts it generates.
//
// Specialised units (MSCCLPP_PLAN_STATIC, run_static_program below): where a rank's program has
// few data ops, the host compiles it into the unit as code, every op a run_op on constants, so
// each op gets straight-line code with its kinds, references and counts folded in, and nothing
// is decoded at run time (threadblocks of one shape share a case, their chunk indices and ids
// worked out from tb). The 2-rank fixture plans timed faster specialised than interpreted at
// small sizes and no slower at any size measured. Consecutive plain data ops that can run as one
// pass are one run_fused ("Fused data ops" below), which took less time than the ops one by one.
//
// Block size: the plan's num_threads_per_block, at most kMaxBlockThreads, and no more warps than a
// chunk has units (mscclpp_executor's call_threads: small messages). Every thread walks the
// interpreter's bookkeeping for every op, so fewer warps cost less per op; and the launch bounds
// (512 threads, at least one block per SM) let a thread use 128 registers, where 1024 threads had
// 64 and spilled the loop's state to local memory on every op (with the bound of 512 alone,
// ptxas still chose 64 registers and spills for some units). Against 1024 threads the 2-rank
// fixture plans timed faster at almost every size measured. Such a block takes a whole SM's
// registers, so the host counts one block per SM towards co-residency.
//
// Replicas: one block of a threadblock moves a small part of a link's bandwidth, so a plan of few threadblocks (MSCCL++'s 2-rank plans have 1 to 8) cannot use the GPU. The host
// gives each plan threadblock `replicas` blocks where the chunk is large enough and the plan allows
// it (mscclpp_executor::encode::Replication: memory-channel data, signal, wait, flush and nop ops
// only). Replica k of a threadblock does part k of every op's part of every chunk (the op's
// threadblock-group part cut again into `replicas` parts of whole units), so a unit of a chunk
// always falls to the same replica and an op reads what the replica's earlier ops wrote. Replica 0
// alone runs the synchronisation ops (but counted waits, which every replica runs:
// wait_counted); the replicas meet (Replicas, on arrival stamps) where the
// threadblock goes from data to a wait, signal or flush (replica 0 waits for every replica's
// writes before it signals), from a wait back to data (no replica moves on before the wait is
// over) and from data cut one way to data cut another (on a generation and an arrivals counter;
// with atomics instead, plans with many replicas took longer). A nop stays the block's own
// barrier: within a cut, each replica reads only what it wrote itself. (Meetings at nops made
// plans slower at every size, even at one replica, where a meeting costs nothing, for a reason
// not found.) Replicas that meet must all be resident at once: the host keeps their number to
// Residency::max_meeting_blocks. How many replicas a call gets is a local choice: signals,
// packets, flags and stamps are the same for any number.
//
// Every data-moving op is one kind (kData) with the meaning the CPU reference interpreter gives
// it: read every source, wait for LL packets where the source holds packets, reduce the sources
// with the plan's op (accumulating in MSCCLPP_PLAN_ACC), write the result to every destination,
// as packets where the destination holds packets. A single source is copied bit for bit.
// A block moves an op's chunk with every thread and several loads in flight per thread: a block's
// bandwidth is its bytes in flight over the memory (or NVLink) latency, and one 8-byte access per
// thread at a time caps 1024 threads at 8 KiB per latency. Plain-only chunks whose
// references are all 16-byte aligned go as 16-byte words (copy.cuh's unrolled copy, or
// kReduceUnroll words per thread and source); packets, odd alignments and a chunk's tail go unit
// by unit, kUnitBatch units per thread with every load issued before any packet is waited for.
// Work is cut in units of 8 payload bytes (4 for LL8): unit u of a chunk is packet u of that chunk
// in a packet buffer, and a threadblock group splits every chunk by whole units (as
// mscclpp_executor::encode::part_range, which the CPU reference uses), so no two blocks
// write one packet.
//
// CUDA-graph safe: nothing is set by the host per call. The LL flag of an execution is the
// threadblock's execution count + 1, which every threadblock of every rank agrees on (each runs
// every execution). Each replica keeps its own copy of the count (counter slot k of the
// threadblock, read by replica k alone), and at the end writes the new count into every slot
// congruent to its own modulo this call's replicas (as the natives' finish_call): every slot is
// written once per execution by a block that read nothing but its own, so the next call, with
// any number of replicas, finds the count in each slot, with no atomic or fence on the way out
// (counting the replicas out, with a device fence before the count, cost time on every call: the
// fence waits for the block's NVLink stores). LL scratch alternates
// two halves by the flag's parity, so a fast writer of execution k + 1 never overwrites packets
// of execution k that a slow reader has not read. Channel semaphores, local semaphores and
// barriers are counters that only grow (or come back to their initial value), so replays need
// no reset. A counted wait's target comes from the flag too (wait_counted): the plan's channel
// semaphores are its own, zero when it is set up, as the counts are.
// Every wait is bounded by spin_until (error.cuh): on a timeout or an abort the block stops.
//
// Port-channel ops (kPort): thread 0 pushes the proxy's triggers (a put per chunk part, then the
// signals, then a flush), offsets relative to the rank's registered plan block (block_offsets: the
// host stages port-channel plans in one block per rank that the proxy knows). A `pipeline` (kPipeline,
// followed by its nids ops) runs its ops once per iteration over a window of every op's units: unit
// i of an op counts its chunks' units in order (only the threadblock group member's part of each).
#include "mscclpp/common.cuh"
#include "mscclpp/copy.cuh"
#include "mscclpp/error.cuh"
#include "mscclpp/packet.cuh"
#include "mscclpp/port_channel.cuh"
#include "mscclpp/reduce.cuh"
#include "mscclpp/semaphore.cuh"

#ifndef MSCCLPP_PLAN_T
#define MSCCLPP_PLAN_T float
#define MSCCLPP_PLAN_ACC float
#define MSCCLPP_PLAN_OP 0
#endif
#ifndef MSCCLPP_PLAN_FEATURES
#define MSCCLPP_PLAN_FEATURES 7
#endif

namespace mscclpp {
namespace plan {

constexpr u32 kMaxPlanBuffers = 32;
constexpr u16 kFirstRemoteSlot = 3;

constexpr u8 kNop = 0;
constexpr u8 kData = 1;
constexpr u8 kSignal = 2;
constexpr u8 kRelaxedSignal = 3;
constexpr u8 kWait = 4;
constexpr u8 kRelaxedWait = 5;
constexpr u8 kFlush = 6;
constexpr u8 kSemRelease = 7;
constexpr u8 kSemAcquire = 8;
constexpr u8 kBarrier = 9;
constexpr u8 kPipeline = 10;

// Most blocks a plan threadblock runs as (PlanArgs::replicas; mscclpp_kernels_cu::executor::
// MAX_REPLICAS).
constexpr u32 kMaxReplicas = 64;

// u32 words of `flags` per plan threadblock: kMaxReplicas counter slots (the execution count, one
// copy per replica: "CUDA-graph safe" above), then kMaxReplicas u64 arrival stamps (Replicas).
constexpr u32 kTbWords = kMaxReplicas * 3;

// Most threads a block of the interpreter has (its launch bound; see "Block size" above).
constexpr u32 kMaxBlockThreads = 512;

// What the plan uses (mscclpp_kernels_cu::executor::PlanFeatures; every feature where the unit was
// not specialised): code for a feature the plan lacks is left out of its unit. It would never run
// there, but compiled in it slowed every op of a Simple memory-channel plan by about a third at
// small sizes.
constexpr bool kHasPackets = (MSCCLPP_PLAN_FEATURES & 1) != 0;
constexpr bool kHasPorts = (MSCCLPP_PLAN_FEATURES & 2) != 0;
constexpr bool kHasPipelines = (MSCCLPP_PLAN_FEATURES & 4) != 0;

constexpr u8 kSignalAfter = 1;
constexpr u8 kFlushAfter = 2;
constexpr u8 kPort = 4;

struct PlanOp {
  u8 kind;
  u8 flags;
  u8 nsrc;
  u8 ndst;
  u16 nids;
  u16 tbg_part;
  u16 tbg_parts;
  u16 barrier_tbs;
  u16 wait_index;
  u16 waits_per_execution;
  u32 first_ref;
  u32 first_id;
};

struct PlanRef {
  u16 slot;
  u16 packets;
  u32 index;
  u32 size;
};

struct PlanArgs {
  const PlanOp* ops;
  const u32* tb_starts;
  const PlanRef* refs;
  const u32* ids;
  D2DSemaphoreHandle* channels;
  const PortChannelHandle* port_channels;
  u32* semaphores;
  u64* barriers;
  u32* flags;
  u32* error_word;
  u64 buffers[kMaxPlanBuffers];
  u64 block_offsets[kMaxPlanBuffers];
  u64 chunk_bytes;
  u64 scratch_half_bytes;
  u64 max_spin;
  u32 packet_bytes;
  u32 unit_bytes;
  u32 replicas;
};

// An op with its references and ids found: `nsrc + ndst` PlanRefs at `refs`, `nids` ids at `ids`
// (a pipeline's three words at `ids`), in the block's Program.
struct Op : PlanOp {
  const PlanRef* refs;
  const u32* ids;
};

// An op of a program: `p` with its references and ids at `refs` and `ids`.
MSCCLPP_DEVICE_INLINE Op make_op(const PlanOp& p, const PlanRef* refs, const u32* ids) {
  Op op;
  static_cast<PlanOp&>(op) = p;
  op.refs = refs;
  op.ids = ids;
  return op;
}

// Units [begin, end) of every op a step runs (a pipeline iteration's window, or everything).
struct Window {
  u64 begin;
  u64 end;
};

typedef MSCCLPP_PLAN_T T;
typedef MSCCLPP_PLAN_ACC Acc;
constexpr int kOp = MSCCLPP_PLAN_OP;

// The two halves of the batched data path (run_plain_words, run_units) are functions of their own
// on HIP. Inlined, as on CUDA, they put their unrolled reductions (16 lanes of software fp8 or
// int8 arithmetic per 16-byte word) into plan_execute, and clang-19's AMDGPU 'Structurize control
// flow' pass crashed on that one huge function (in SSAUpdater, on a few of the 1-byte type units,
// different ones each run; seen when they sat there twice). One call per chunk costs nothing next
// to the chunk's bytes.
#if defined(MSCCLPP_HIP)
#define MSCCLPP_PLAN_DATA_PATH __device__ __attribute__((noinline))
#else
#define MSCCLPP_PLAN_DATA_PATH MSCCLPP_DEVICE_INLINE
#endif

// Loads `n` (<= 8) bytes; whole aligned words in one access, anything else byte by byte (chunks
// of an odd number of bytes land anywhere).
MSCCLPP_DEVICE_INLINE u64 load_bytes(const u8* p, u32 n) {
  const u64 addr = reinterpret_cast<u64>(p);
  if (n == 8 && (addr & 7) == 0) return *reinterpret_cast<const u64*>(p);
  if (n == 4 && (addr & 3) == 0) return *reinterpret_cast<const u32*>(p);
  u64 v = 0;
  for (u32 i = 0; i < n; ++i) v |= static_cast<u64>(p[i]) << (8 * i);
  return v;
}

MSCCLPP_DEVICE_INLINE void store_bytes(u8* p, u32 n, u64 v) {
  const u64 addr = reinterpret_cast<u64>(p);
  if (n == 8 && (addr & 7) == 0) {
    *reinterpret_cast<u64*>(p) = v;
  } else if (n == 4 && (addr & 3) == 0) {
    *reinterpret_cast<u32*>(p) = static_cast<u32>(v);
  } else {
    for (u32 i = 0; i < n; ++i) p[i] = static_cast<u8>(v >> (8 * i));
  }
}

// Address of unit `u` of chunk `chunk` of a reference: plain data at its byte offset, packets at
// packet (chunk * units_per_chunk + u) of the execution's scratch half.
MSCCLPP_DEVICE_INLINE u8* unit_address(const PlanArgs& a, const PlanRef& r, u64 chunk, u64 u,
                                       u64 units_per_chunk, u32 flag) {
  u8* base = reinterpret_cast<u8*>(a.buffers[r.slot]);
  const u64 c = r.index + chunk;
  if (kHasPackets && r.packets) {
    return base + (flag & 1) * a.scratch_half_bytes +
           (c * units_per_chunk + u) * static_cast<u64>(a.packet_bytes);
  }
  return base + c * a.chunk_bytes + u * a.unit_bytes;
}

// Whole units in `bytes`. unit_bytes is 8 or 4 (mscclpp_executor::encode::unit_bytes), so this is a
// shift: a 64-bit division by a value known only at run time is a subroutine of some 70
// instructions, and every thread of the block runs the interpreter's arithmetic for every op.
MSCCLPP_DEVICE_INLINE u64 bytes_to_units(const PlanArgs& a, u64 bytes) {
  return a.unit_bytes == 8 ? bytes >> 3 : bytes >> 2;
}

// Units of a chunk (the last one may be short).
MSCCLPP_DEVICE_INLINE u64 units_per_chunk(const PlanArgs& a) {
  return bytes_to_units(a, a.chunk_bytes + a.unit_bytes - 1);
}

// Payload bytes of unit `u` of a chunk: a whole unit, or what is left of the chunk at its end.
MSCCLPP_DEVICE_INLINE u32 unit_len(const PlanArgs& a, u64 u) {
  const u64 left = a.chunk_bytes - u * a.unit_bytes;
  return left < a.unit_bytes ? static_cast<u32>(left) : a.unit_bytes;
}

// Reads one unit (`n` payload bytes); false when a packet did not come (timeout or abort).
MSCCLPP_DEVICE_INLINE bool read_unit(const PlanArgs& a, const PlanRef& r, u64 chunk, u64 u,
                                     u64 units_per_chunk, u32 n, u32 flag, u64& out) {
  const u8* p = unit_address(a, r, chunk, u, units_per_chunk, flag);
  if (!kHasPackets || !r.packets) {
    out = load_bytes(p, n);
    return true;
  }
  if (a.packet_bytes == 16) {
    u64 v = 0;
    const bool ok = reinterpret_cast<const LL16Packet*>(p)->read(flag, v, a.max_spin, a.error_word);
    out = v;
    return ok;
  }
  u32 v = 0;
  const bool ok = reinterpret_cast<const LL8Packet*>(p)->read(flag, v, a.max_spin, a.error_word);
  out = v;
  return ok;
}

// The units of an op: `chunks` chunks (the fewest any reference names), of which the op does units
// [u0, u0 + per_chunk) each; its unit i is unit u0 + i % per_chunk of chunk i / per_chunk.
struct OpUnits {
  u64 upc;  // units per chunk
  u64 u0;
  u64 per_chunk;
  u64 chunks;
  u64 total;
};

// The block's part of each chunk is part tbg_part * replicas + replica of tbg_parts * replicas:
// the replicas' parts put together are the threadblock's part (floor(x * k / k) = floor(x)).
// `chunks`: the fewest any reference of the op names (op_units), or what a fused group's
// references all name.
MSCCLPP_DEVICE_INLINE OpUnits chunk_units(const PlanArgs& a, const Op& op, u32 chunks,
                                          u32 replica) {
  const u64 part = static_cast<u64>(op.tbg_part) * a.replicas + replica;
  const u64 parts = static_cast<u64>(op.tbg_parts) * a.replicas;
  OpUnits n;
  n.upc = units_per_chunk(a);
  // One part (no group, no replicas) is the common case: no division.
  n.u0 = parts == 1 ? 0 : n.upc * part / parts;
  n.per_chunk = parts == 1 ? n.upc : n.upc * (part + 1) / parts - n.u0;
  n.chunks = chunks;
  n.total = n.per_chunk * chunks;
  return n;
}

MSCCLPP_DEVICE_INLINE OpUnits op_units(const PlanArgs& a, const Op& op, u32 replica) {
  const PlanRef* refs = op.refs;
  const u32 nrefs = static_cast<u32>(op.nsrc) + op.ndst;
  u32 chunks = refs[0].size;
  for (u32 i = 1; i < nrefs; ++i) chunks = refs[i].size < chunks ? refs[i].size : chunks;
  return chunk_units(a, op, chunks, replica);
}

// Units a thread has in flight in the per-unit path: a lone 8-byte access per thread leaves a
// block latency-bound at a few GB/s over NVLink.
constexpr u32 kUnitBatch = 4;

// Packets u + k * stride (k < kUnitBatch, those below `end`) of `p`, into w[k]: every packet is
// looked at once before any is waited for, so a thread has kUnitBatch reads in flight.
template <typename Pkt>
MSCCLPP_DEVICE_INLINE bool read_packets(const PlanArgs& a, const Pkt* p, u64 u, u64 stride, u64 end,
                                        u32 flag, u64 (&w)[kUnitBatch]) {
  typename Pkt::Payload v[kUnitBatch];
  bool got[kUnitBatch];
  // No branch between the looks (a unit past `end` looks at unit u, which the caller has): with
  // one, each look would wait for the previous one's flag.
#pragma unroll
  for (u32 k = 0; k < kUnitBatch; ++k) {
    const u64 x = u + k * stride;
    got[k] = p[x < end ? x : u].try_read(flag, v[k]);
  }
#pragma unroll
  for (u32 k = 0; k < kUnitBatch; ++k) {
    const u64 x = u + k * stride;
    if (x >= end) continue;
    if (!got[k] && !p[x].read(flag, v[k], a.max_spin, a.error_word)) return false;
    w[k] = v[k];
  }
  return true;
}

// Units u + k * stride (k < kUnitBatch, those below `end`) of reference r in chunk c, into w[k].
MSCCLPP_DEVICE_INLINE bool read_batch(const PlanArgs& a, const PlanRef& r, u64 c, u64 u,
                                      u64 stride, u64 end, u64 upc, u32 flag,
                                      u64 (&w)[kUnitBatch]) {
  const u8* base = unit_address(a, r, c, 0, upc, flag);
  if (kHasPackets && r.packets && a.packet_bytes == 16) {
    return read_packets(a, reinterpret_cast<const LL16Packet*>(base), u, stride, end, flag, w);
  }
  if (kHasPackets && r.packets) {
    return read_packets(a, reinterpret_cast<const LL8Packet*>(base), u, stride, end, flag, w);
  }
  // Every unit a whole aligned word (the common case): plain loads with no branch between them,
  // so they are all in flight at once (a unit past `end` reads unit u again).
  const u64 unit_mask = a.unit_bytes - 1;
  if ((reinterpret_cast<u64>(base) & unit_mask) == 0 && (a.chunk_bytes & unit_mask) == 0) {
#pragma unroll
    for (u32 k = 0; k < kUnitBatch; ++k) {
      const u64 x = u + k * stride < end ? u + k * stride : u;
      w[k] = a.unit_bytes == 8 ? reinterpret_cast<const u64*>(base)[x]
                               : reinterpret_cast<const u32*>(base)[x];
    }
    return true;
  }
#pragma unroll
  for (u32 k = 0; k < kUnitBatch; ++k) {
    const u64 x = u + k * stride;
    if (x < end) w[k] = load_bytes(base + x * a.unit_bytes, unit_len(a, x));
  }
  return true;
}

// Writes w[k] to units u + k * stride (k < kUnitBatch, those below `end`) of reference r in
// chunk c, as packets where r holds packets.
MSCCLPP_DEVICE_INLINE void write_batch(const PlanArgs& a, const PlanRef& r, u64 c, u64 u,
                                       u64 stride, u64 end, u64 upc, u32 flag,
                                       const u64 (&w)[kUnitBatch]) {
  u8* base = unit_address(a, r, c, 0, upc, flag);
#pragma unroll
  for (u32 k = 0; k < kUnitBatch; ++k) {
    const u64 x = u + k * stride;
    if (x >= end) continue;
    if (!kHasPackets || !r.packets) {
      store_bytes(base + x * a.unit_bytes, unit_len(a, x), w[k]);
    } else if (a.packet_bytes == 16) {
      reinterpret_cast<LL16Packet*>(base)[x].write(w[k], flag);
    } else {
      reinterpret_cast<LL8Packet*>(base)[x].write(static_cast<u32>(w[k]), flag);
    }
  }
}

// Units [u, end) of chunk c, unit by unit (packets, odd alignments, tails), cooperatively by the
// block. Sources reduce in order in Acc (lanes past a short unit's payload are never stored).
MSCCLPP_PLAN_DATA_PATH bool run_units(const PlanArgs& a, const Op& op, const PlanRef* refs,
                                      u64 c, u64 u, u64 end, u64 upc, u32 flag) {
  const u64 stride = blockDim.x;
  for (u64 x = u + threadIdx.x; x < end; x += kUnitBatch * stride) {
    u64 word[kUnitBatch] = {};
    if (!read_batch(a, refs[0], c, x, stride, end, upc, flag, word)) return false;
    if (op.nsrc > 1) {
      VecAccumulator<T, Acc, kOp, u64> acc[kUnitBatch];
#pragma unroll
      for (u32 k = 0; k < kUnitBatch; ++k) acc[k].init(word[k]);
      for (u32 s = 1; s < op.nsrc; ++s) {
        u64 other[kUnitBatch] = {};
        if (!read_batch(a, refs[s], c, x, stride, end, upc, flag, other)) return false;
#pragma unroll
        for (u32 k = 0; k < kUnitBatch; ++k) acc[k].add(other[k]);
      }
#pragma unroll
      for (u32 k = 0; k < kUnitBatch; ++k) word[k] = acc[k].finish(1);
    }
    for (u32 d = 0; d < op.ndst; ++d) {
      write_batch(a, refs[op.nsrc + d], c, x, stride, end, upc, flag, word);
    }
  }
  return true;
}

// 16-byte words in flight per thread and source in the vector reduction: 4 where the running value
// is the word itself (Acc == T), 2 where it is wider (more spilled inside the loop when a thread
// had 64 registers, checked with ptxas -v and the SASS; not re-tuned for the 128 it has now).
constexpr u32 kReduceUnroll = IsSame<T, Acc>::value ? 4 : 2;

// Address of byte `from` of chunk c of a plain reference.
MSCCLPP_DEVICE_INLINE u8* plain_address(const PlanArgs& a, const PlanRef& r, u64 c, u64 from) {
  return reinterpret_cast<u8*>(a.buffers[r.slot]) + (r.index + c) * a.chunk_bytes + from;
}

// Words i + k * stride (k < kN) of the op's plain references from byte `from` of chunk c: the
// sources reduced in order (an op that reduces has at least two), written to every destination.
// Both first sources' loads are issued before any arithmetic, so they are in flight together.
// Their words are s0 and s1, found once per chunk by the caller: worked out here, each pass
// reloaded both references (the stores may alias them) and the values kept for it spilled
// inside the loop (ptxas -v and the SASS of the bf16 unit).
template <u32 kN>
MSCCLPP_DEVICE_INLINE void reduce_words(const PlanArgs& a, const Op& op, const PlanRef* refs,
                                        u64 c, u64 from, u64 i, u64 stride, const uint4* s0,
                                        const uint4* s1) {
  uint4 x[kN];
  uint4 y[kN];
#pragma unroll
  for (u32 k = 0; k < kN; ++k) x[k] = s0[i + k * stride];
#pragma unroll
  for (u32 k = 0; k < kN; ++k) y[k] = s1[i + k * stride];
  VecAccumulator<T, Acc, kOp, uint4> acc[kN];
#pragma unroll
  for (u32 k = 0; k < kN; ++k) {
    acc[k].init(x[k]);
    acc[k].add(y[k]);
  }
  for (u32 s = 2; s < op.nsrc; ++s) {
    const uint4* src = reinterpret_cast<const uint4*>(plain_address(a, refs[s], c, from));
#pragma unroll
    for (u32 k = 0; k < kN; ++k) y[k] = src[i + k * stride];
#pragma unroll
    for (u32 k = 0; k < kN; ++k) acc[k].add(y[k]);
  }
  for (u32 d = 0; d < op.ndst; ++d) {
    uint4* dst = reinterpret_cast<uint4*>(plain_address(a, refs[op.nsrc + d], c, from));
#pragma unroll
    for (u32 k = 0; k < kN; ++k) dst[i + k * stride] = acc[k].finish(1);
  }
}

// Units [u, end) of chunk c of an op on plain data only, as 16-byte words while every reference is
// 16-byte aligned there (copies through copy.cuh's unrolled body, reductions kReduceUnroll words
// per thread and source). Returns the first unit it left to run_units: the tail after the last
// whole word, or u itself when a reference is misaligned.
MSCCLPP_PLAN_DATA_PATH u64 run_plain_words(const PlanArgs& a, const Op& op,
                                           const PlanRef* refs, u64 c, u64 u, u64 end) {
  const u64 from = u * a.unit_bytes;
  const u64 to = end * a.unit_bytes < a.chunk_bytes ? end * a.unit_bytes : a.chunk_bytes;
  const u64 words = to > from ? (to - from) / sizeof(uint4) : 0;
  const u32 nrefs = static_cast<u32>(op.nsrc) + op.ndst;
  u64 misaligned = 0;
  for (u32 r = 0; r < nrefs; ++r) {
    misaligned |= reinterpret_cast<u64>(plain_address(a, refs[r], c, from));
  }
  if (words == 0 || op.nsrc == 0 || (misaligned % sizeof(uint4)) != 0) return u;
  if (op.nsrc == 1) {
    const uint4* src0 = reinterpret_cast<const uint4*>(plain_address(a, refs[0], c, from));
    for (u32 d = 0; d < op.ndst; ++d) {
      uint4* dst = reinterpret_cast<uint4*>(plain_address(a, refs[1 + d], c, from));
      copy_body<uint4>(dst, src0, words, threadIdx.x, blockDim.x);
    }
  } else {
    const u64 stride = blockDim.x;
    const uint4* s0 = reinterpret_cast<const uint4*>(plain_address(a, refs[0], c, from));
    const uint4* s1 = reinterpret_cast<const uint4*>(plain_address(a, refs[1], c, from));
    u64 i = threadIdx.x;
    for (; i + (kReduceUnroll - 1) * stride < words; i += kReduceUnroll * stride) {
      reduce_words<kReduceUnroll>(a, op, refs, c, from, i, stride, s0, s1);
    }
    for (; i < words; i += stride) reduce_words<1>(a, op, refs, c, from, i, stride, s0, s1);
  }
  return u + bytes_to_units(a, words * sizeof(uint4));
}

// Units from unit u of chunk c of a plain reference to its next 16-byte boundary (0 where u is on
// one, or where no whole unit lands on one: the reference is misaligned for words anyway).
MSCCLPP_DEVICE_INLINE u64 units_to_word(const PlanArgs& a, const PlanRef& r, u64 c, u64 u) {
  const u64 gap = (sizeof(uint4) - reinterpret_cast<u64>(plain_address(a, r, c, u * a.unit_bytes)) %
                                       sizeof(uint4)) %
                  sizeof(uint4);
  return (gap & (a.unit_bytes - 1)) == 0 ? bytes_to_units(a, gap) : 0;
}

// One data op over the window `w`, cooperatively by every thread of the block, chunk by chunk
// (the window's units of chunk c are a contiguous run [u, end)). False when a packet read gave up.
MSCCLPP_DEVICE_INLINE bool run_data(const PlanArgs& a, const Op& op, u32 flag, Window w,
                                     u32 replica) {
  const PlanRef* refs = op.refs;
  const OpUnits n = op_units(a, op, replica);
  const u32 nrefs = static_cast<u32>(op.nsrc) + op.ndst;
  bool packets = false;
  for (u32 r = 0; kHasPackets && r < nrefs; ++r) packets |= refs[r].packets != 0;
  for (u64 c = 0; n.per_chunk > 0 && c < n.chunks; ++c) {
    const u64 first = c * n.per_chunk;
    const u64 lo = w.begin > first ? w.begin : first;
    const u64 hi = w.end < first + n.per_chunk ? w.end : first + n.per_chunk;
    if (lo >= hi) continue;
    u64 u = n.u0 + lo - first;
    const u64 end = n.u0 + hi - first;
    // Unit by unit to `stop`, then (plain data) as words from there, then the tail unit by unit.
    // Packets go unit by unit throughout. A plain part that starts inside a 16-byte word (replicas
    // and group members start at any unit) takes units alone up to the next word, so the rest can
    // go as words. One call of each (a loop, not two calls): both are inlined on CUDA, and every
    // copy of them is compile time (NVRTC's and ptxas's) in every unit.
    u64 stop = packets ? end : u + units_to_word(a, refs[0], c, u);
    stop = stop < end ? stop : end;
    for (;;) {
      if (!run_units(a, op, refs, c, u, stop, n.upc, flag)) return false;
      if (stop == end) break;
      u = run_plain_words(a, op, refs, c, stop, end);
      stop = end;
    }
  }
  return true;
}

// Waits until a channel's inbound count reaches `target`.
MSCCLPP_DEVICE_INLINE bool await_inbound(const PlanArgs& a, const D2DSemaphoreHandle& s,
                                         u64 target, bool relaxed) {
  const u64* in = s.inbound;
  if (relaxed) {
    return spin_until([in, target] { return atomic_load_relaxed_sys(in) >= target; }, a.max_spin,
                      a.error_word, kErrorSemaphoreWaitTimeout);
  }
  return spin_until([in, target] { return atomic_load_acquire_sys(in) >= target; }, a.max_spin,
                    a.error_word, kErrorSemaphoreWaitTimeout);
}

// A channel wait of replica 0. `expected` is advanced atomically: plans may share one channel
// between blocks.
MSCCLPP_DEVICE_INLINE bool wait_channel(const PlanArgs& a, const D2DSemaphoreHandle& s,
                                        bool relaxed) {
  const u64 target =
      atomicAdd(reinterpret_cast<unsigned long long*>(s.expected), 1ull) + 1ull;
  return await_inbound(a, s, target, relaxed);
}

// A counted wait (PlanOp::waits_per_execution > 0; mscclpp_executor::encode says which waits
// are): its channels are waited on by one threadblock only, never in a pipeline, so their
// inbound counts are known from the execution's flag: `waits_per_execution` signals came in each
// earlier execution, and `wait_index` so far in this one. Every replica waits for itself (thread
// 0), with no atomic on `expected` (which these channels never use) and no stamp from replica 0
// after it: the fixture plans took less time that way, the most where they have many replicas.
MSCCLPP_DEVICE_INLINE bool wait_counted(const PlanArgs& a, const Op& op, u32 flag) {
  const u64 target =
      static_cast<u64>(flag - 1) * op.waits_per_execution + op.wait_index + 1ull;
  for (u32 i = 0; i < op.nids; ++i) {
    if (!await_inbound(a, a.channels[op.ids[i]], target, op.kind == kRelaxedWait)) return false;
  }
  return true;
}

// Takes one unit of a local semaphore once it has one.
MSCCLPP_DEVICE_INLINE bool acquire_semaphore(const PlanArgs& a, u32* sem) {
  const bool ok = spin_until(
      [sem] {
        u32 v = *reinterpret_cast<volatile u32*>(sem);
        while (v > 0) {
          const u32 old = atomicCAS(sem, v, v - 1);
          if (old == v) return true;
          v = old;
        }
        return false;
      },
      a.max_spin, a.error_word, kErrorSemaphoreWaitTimeout);
  __threadfence();
  return ok;
}

// `n` blocks of this rank meet: arrivals only grow, a generation is complete at the next multiple
// of `n`.
MSCCLPP_DEVICE_INLINE bool barrier(const PlanArgs& a, u32 id, u32 n) {
  u64* counter = a.barriers + id;
  __threadfence();
  const u64 arrival = atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull);
  const u64 target = (arrival / n + 1) * n;
  const bool ok = spin_until(
      [counter, target] { return *reinterpret_cast<volatile u64*>(counter) >= target; },
      a.max_spin, a.error_word, kErrorSemaphoreWaitTimeout);
  __threadfence();
  return ok;
}

// Waits until the source packets of the op's units in the window have come (every thread).
MSCCLPP_DEVICE_INLINE bool await_packets(const PlanArgs& a, const Op& op, u32 flag, Window w,
                                          u32 replica) {
  const PlanRef* refs = op.refs;
  const OpUnits n = op_units(a, op, replica);
  const u64 end = w.end < n.total ? w.end : n.total;
  for (u64 i = w.begin + threadIdx.x; i < end; i += blockDim.x) {
    for (u32 s = 0; s < op.nsrc; ++s) {
      u64 v = 0;
      if (refs[s].packets && !read_unit(a, refs[s], i / n.per_chunk, n.u0 + i % n.per_chunk, n.upc,
                                        a.unit_bytes, flag, v)) {
        return false;
      }
    }
  }
  return true;
}

// Where units [u, v) of chunk c of a reference lie in its owner's block: (offset, bytes). Packets
// are copied as they are (ppkt / rppkt over port channels move LL scratch packets, as MSCCL++
// does), into the same scratch half of the peer.
MSCCLPP_DEVICE_INLINE void block_range(const PlanArgs& a, const PlanRef& r, u64 c, u64 u, u64 v,
                                       u64 upc, u32 flag, u64& offset, u64& bytes) {
  if (r.packets) {
    offset = a.block_offsets[r.slot] + (flag & 1) * a.scratch_half_bytes +
             ((r.index + c) * upc + u) * static_cast<u64>(a.packet_bytes);
    bytes = (v - u) * a.packet_bytes;
    return;
  }
  const u64 from = u * a.unit_bytes;
  const u64 to = v * a.unit_bytes < a.chunk_bytes ? v * a.unit_bytes : a.chunk_bytes;
  offset = a.block_offsets[r.slot] + (r.index + c) * a.chunk_bytes + from;
  bytes = to > from ? to - from : 0;
}

// A put over port channels, by thread 0: destination d gets source d (or the only source) through
// the op's channel d, one trigger per chunk part in the window; then the signals and the flush of
// pws / pwsf. The proxy works through its FIFO in order, so a signal follows the data it covers.
MSCCLPP_DEVICE_INLINE bool run_port_put(const PlanArgs& a, const Op& op, u32 flag, Window w,
                                         u32 replica) {
  const PlanRef* refs = op.refs;
  const u32* ids = op.ids;
  const OpUnits n = op_units(a, op, replica);
  for (u32 d = 0; d < op.ndst; ++d) {
    const PlanRef& src = refs[op.nsrc == op.ndst ? d : 0];
    const PlanRef& dst = refs[op.nsrc + d];
    const PortChannelHandle& ch = a.port_channels[ids[d]];
    for (u64 c = 0; n.per_chunk > 0 && c * n.per_chunk < n.total; ++c) {
      const u64 first = c * n.per_chunk;
      const u64 lo = w.begin > first ? w.begin : first;
      const u64 hi = w.end < first + n.per_chunk ? w.end : first + n.per_chunk;
      if (lo >= hi) continue;
      const u64 u = n.u0 + lo - first;
      const u64 v = n.u0 + hi - first;
      u64 src_off = 0, dst_off = 0, bytes = 0;
      block_range(a, src, c, u, v, n.upc, flag, src_off, bytes);
      block_range(a, dst, c, u, v, n.upc, flag, dst_off, bytes);
      if (bytes == 0) continue;
      if (ch.push_transfer(dst_off, src_off, bytes, 0) == kFifoPushFailed) return false;
    }
  }
  if (op.flags & kSignalAfter) {
    for (u32 d = 0; d < op.ndst; ++d) a.port_channels[ids[d]].signal();
  }
  if (op.flags & kFlushAfter) {
    for (u32 d = 0; d < op.ndst; ++d) {
      if (!a.port_channels[ids[d]].flush()) return false;
    }
  }
  return true;
}

// signal / wait / flush over port channels, by thread 0.
MSCCLPP_DEVICE_INLINE bool run_port_sync(const PlanArgs& a, const Op& op) {
  const u32* ids = op.ids;
  for (u32 i = 0; i < op.nids; ++i) {
    const PortChannelHandle& ch = a.port_channels[ids[i]];
    switch (op.kind) {
      case kSignal:
      case kRelaxedSignal:
        ch.signal();
        break;
      case kWait:
      case kRelaxedWait:
        if (!ch.wait()) return false;
        break;
      default:  // kFlush
        if (!ch.flush()) return false;
        break;
    }
  }
  return true;
}

// The synchronisation ops, run by thread 0 after the block's earlier writes (a __syncthreads
// orders them before; the release of a signal publishes them, by cumulativity).
MSCCLPP_DEVICE_INLINE bool run_sync(const PlanArgs& a, const Op& op) {
  if (kHasPorts && (op.flags & kPort) && op.kind != kData) return run_port_sync(a, op);
  const u32* ids = op.ids;
  switch (op.kind) {
    case kSignal:
    case kRelaxedSignal:
    case kData:  // pws / pwsf: the signal after the data
      if (op.flags & kFlushAfter) fence_acq_rel_sys();
      for (u32 i = 0; i < op.nids; ++i) {
        if (op.kind == kRelaxedSignal) {
          a.channels[ids[i]].relaxed_signal();
        } else {
          a.channels[ids[i]].signal();
        }
      }
      return true;
    case kWait:
    case kRelaxedWait:
      for (u32 i = 0; i < op.nids; ++i) {
        if (!wait_channel(a, a.channels[ids[i]], op.kind == kRelaxedWait)) return false;
      }
      return true;
    case kFlush:
      fence_acq_rel_sys();
      return true;
    case kSemRelease:
      __threadfence();
      for (u32 i = 0; i < op.nids; ++i) atomicAdd(a.semaphores + ids[i], 1u);
      return true;
    case kSemAcquire:
      for (u32 i = 0; i < op.nids; ++i) {
        if (!acquire_semaphore(a, a.semaphores + ids[i])) return false;
      }
      return true;
    case kBarrier:
      return barrier(a, ids[0], op.barrier_tbs);
    default:  // kNop
      return true;
  }
}

// How the replicas of a threadblock meet: each replica has an arrival stamp (kTbWords), which
// only its own thread 0 writes, with a release store after the block's writes, and which the
// others poll (acquire loads), a thread per replica: a meeting costs the last to arrive one store
// and the others one load that sees it, with no atomic and nothing to reset. A stamp is the
// execution's flag in its high half and the meeting's place in the execution in its low half, the
// same sequence in every replica (all run the same ops); `stamp` has come when the slot holds it
// or a later meeting of the same execution (an earlier execution's stamp is below it, and the
// next execution cannot start before this one ends).
MSCCLPP_DEVICE_INLINE u64* arrival_slots(u32* words) {
  return reinterpret_cast<u64*>(words + kMaxReplicas);
}

// Waits until every replica in [from, to) but `self` has stamped `stamp` or a later meeting (every
// thread of the block calls it; thread k polls replica k). Out of line: a plan with one replica
// never calls it, and inlined at every meeting it made the units larger and one-replica plans
// slower.
__device__ __attribute__((noinline)) bool await_stamps(const u64* slots, u64 stamp, u32 from,
                                                       u32 to, u32 self, u64 max_spin,
                                                       u32* error_word) {
  bool ok = true;
  for (u32 k = from + threadIdx.x; k < to; k += blockDim.x) {
    if (k == self) continue;
    const u64* slot = slots + k;
    ok = ok && spin_until(
                   [slot, stamp] { return atomic_load_acquire_sys(slot) - stamp < (1ull << 32); },
                   max_spin, error_word, kErrorSemaphoreWaitTimeout);
  }
  return !__syncthreads_or(!ok);
}

// A block's place among its threadblock's replicas, and what the replicas did since they last
// met. Replica 0 alone runs the synchronisation ops (a counted wait is every replica's own and
// no meeting), so:
// - data, then a signal, flush or wait: every replica stamps its arrival; replica 0 waits for the
//   others' before it runs the op (its signal publishes every replica's writes, by cumulativity),
//   the others go on;
// - a wait, then data: replica 0 stamps once the wait is over; the others wait for that stamp;
// - data cut into parts by `key`, then data cut otherwise (it reads units another replica
//   wrote): every replica waits for every other's arrival, at the stamp they gave on their way
//   to a signal since, or at a new one.
// With one replica every step is free.
struct Replicas {
  static constexpr u32 kSinceNothing = 0;
  static constexpr u32 kSinceData = 1;
  static constexpr u32 kSinceArrival = 2;  // data, then ops every replica stamped its arrival for
  static constexpr u32 kSinceWait = 3;
  u32* words;
  u64 flag_high;  // this execution's flag << 32
  u32 since;
  u32 key;
  u32 meetings;   // meetings so far in this execution
  u64 stamp;      // the last meeting's stamp
  u32 index;      // this block's place among the replicas (blockIdx.x % replicas, found once)

  // Whether this block runs the synchronisation ops (replica 0; every block when alone).
  MSCCLPP_DEVICE_INLINE bool runs_sync() const { return index == 0; }
  // Waits for replicas [from, to) to have stamped `stamp`.
  MSCCLPP_DEVICE_INLINE bool await(const PlanArgs& a, u32 from, u32 to) const {
    return await_stamps(arrival_slots(words), stamp, from, to, index, a.max_spin, a.error_word);
  }
  // Moves on to the next meeting; thread 0 stamps this replica's arrival at it.
  MSCCLPP_DEVICE_INLINE void arrive() {
    stamp = flag_high | ++meetings;
    if (threadIdx.x == 0) atomic_store_release_sys(arrival_slots(words) + index, stamp);
  }
  // Before a data op: after a wait, replica 0's stamp; after data cut into other parts, every
  // replica's.
  MSCCLPP_DEVICE_INLINE bool before_data(const PlanArgs& a, const Op& op) {
    if (a.replicas == 1) return true;
    const u32 k = (static_cast<u32>(op.tbg_part) << 16) | op.tbg_parts;
    const u32 was = since;
    const bool recut = key != k;
    since = kSinceData;
    key = k;
    if (was == kSinceWait) return index == 0 || await(a, 0, 1);
    if (!recut || was == kSinceNothing) return true;
    if (was == kSinceData) arrive();
    return await(a, 0, a.replicas);
  }
  // Before a synchronisation op (or a data op's signal): after data, every replica stamps its
  // arrival and replica 0 waits for the others'.
  MSCCLPP_DEVICE_INLINE bool before_sync(const PlanArgs& a) {
    if (a.replicas == 1 || since != kSinceData) return true;
    since = kSinceArrival;
    arrive();
    return index != 0 || await(a, 1, a.replicas);
  }
  // After a synchronisation op: a wait over, replica 0 stamps it for the others.
  MSCCLPP_DEVICE_INLINE void after_sync(const PlanArgs& a, const Op& op) {
    if (a.replicas == 1 || (op.kind != kWait && op.kind != kRelaxedWait)) return;
    since = kSinceWait;
    stamp = flag_high | ++meetings;
    if (index == 0 && threadIdx.x == 0) atomic_store_release_sys(arrival_slots(words), stamp);
  }
};

// One op over the window `w`, called by every thread of the block; false (in every thread) when
// the block gives up. A block that gave up still meets the others at the __syncthreads_or.
MSCCLPP_DEVICE_INLINE bool run_op(const PlanArgs& a, const Op& op, u32 flag, Window w,
                                  Replicas& r) {
  bool ok = true;
  if (kHasPorts && op.kind == kData && (op.flags & kPort)) {
    // The proxy's copy engine reads what this block wrote (or received): publish it first.
    ok = await_packets(a, op, flag, w, r.index);
    __threadfence_system();
    if (__syncthreads_or(!ok)) return false;
    if (threadIdx.x == 0) ok = run_port_put(a, op, flag, w, r.index);
    return !__syncthreads_or(!ok);
  }
  if (op.kind == kData) {
    if (!r.before_data(a, op)) return false;
    ok = run_data(a, op, flag, w, r.index);
    if (__syncthreads_or(!ok)) return false;
    if (!(op.flags & kSignalAfter)) return true;
    if (!r.before_sync(a)) return false;
    if (r.runs_sync() && threadIdx.x == 0) run_sync(a, op);
    return true;
  }
  if (op.waits_per_execution != 0) {
    // A counted wait: every replica waits for itself, so the replicas need not meet, before or
    // after it (data before it is still stamped before the next signal or recut, as `since`
    // stays).
    if (threadIdx.x == 0) ok = wait_counted(a, op, flag);
    return !__syncthreads_or(!ok);
  }
  if (op.kind == kNop) {  // the block's barrier and nothing else (see "Replicas" above)
    __syncthreads();
    return true;
  }
  if (!r.before_sync(a)) return false;
  if (r.runs_sync() && threadIdx.x == 0) ok = run_sync(a, op);
  if (ok) r.after_sync(a, op);
  return !__syncthreads_or(!ok);
}

// Fused data ops (specialised units only; mscclpp_kernels_cu::fused_ops chooses them and mirrors
// kFusedMaxSrcs and kFusedMaxDsts): consecutive plain data ops of one cut, with nops between them
// at most, whose references are pairwise equal or disjoint, run as one pass. Each thread takes
// one unit (or one 16-byte word) of every op in turn: it loads every source of every op first, so
// their memory round trips overlap where the ops one by one pay one each, then reduces and stores
// op by op. A source that is an earlier op's destination in the group takes the value that op
// stored instead of reading it back: kFeed holds 4 bits per op j and source s (at bit
// 4 * (j * kFusedMaxSrcs + s)), the feeding op's place in the group plus one, or 0 for memory; a
// template constant, so every choice is made at compile time and the values stay in registers.
// The same thread does a unit of every op, so the nops between them (the block's barriers) have
// nothing left to order.
constexpr u32 kFusedMaxSrcs = 4;
constexpr u32 kFusedMaxDsts = 4;

// Where source s of op j of a fused group comes from: an earlier op's place in the group, or -1.
template <u64 kFeed>
MSCCLPP_DEVICE_INLINE int fed_from(u32 j, u32 s) {
  return static_cast<int>((kFeed >> (4 * (j * kFusedMaxSrcs + s))) & 15) - 1;
}

// K units or words of every op of a fused group; load(ref, k) and store(ref, k, value) address
// item k. Every source of every item is loaded before the first is reduced, so a thread has all
// of them in flight at once (items are different units, so no store of one meets a load of
// another: a group's references are equal or disjoint).
template <u64 kFeed, typename W, u32 K, u32 N, typename Load, typename Store>
MSCCLPP_DEVICE_INLINE void fused_items(const Op (&ops)[N], Load load, Store store) {
  W src[K][N][kFusedMaxSrcs];
#pragma unroll
  for (u32 k = 0; k < K; ++k) {
#pragma unroll
    for (u32 j = 0; j < N; ++j) {
#pragma unroll
      for (u32 s = 0; s < kFusedMaxSrcs; ++s) {
        if (s < ops[j].nsrc && fed_from<kFeed>(j, s) < 0) src[k][j][s] = load(ops[j].refs[s], k);
      }
    }
  }
#pragma unroll
  for (u32 k = 0; k < K; ++k) {
    W val[N];
#pragma unroll
    for (u32 j = 0; j < N; ++j) {
      const auto source = [&](u32 s) {
        const int from = fed_from<kFeed>(j, s);
        return from < 0 ? src[k][j][s] : val[from];
      };
      if (ops[j].nsrc == 1) {
        val[j] = source(0);
      } else {
        VecAccumulator<T, Acc, kOp, W> acc;
        acc.init(source(0));
#pragma unroll
        for (u32 s = 1; s < kFusedMaxSrcs; ++s) {
          if (s < ops[j].nsrc) acc.add(source(s));
        }
        val[j] = acc.finish(1);
      }
#pragma unroll
      for (u32 d = 0; d < kFusedMaxDsts; ++d) {
        if (d < ops[j].ndst) store(ops[j].refs[ops[j].nsrc + d], k, val[j]);
      }
    }
  }
}

// Units [u, end) of chunk c of a fused group, unit by unit. (Out of line on HIP, as the data
// path, for the reason given there.)
template <u64 kFeed, u32 N>
MSCCLPP_PLAN_DATA_PATH void fused_units(const PlanArgs& a, const Op (&ops)[N], u64 c, u64 u,
                                       u64 end) {
  for (u64 x = u + threadIdx.x; x < end; x += blockDim.x) {
    const u32 len = unit_len(a, x);
    const u64 from = x * a.unit_bytes;
    fused_items<kFeed, u64, 1>(
        ops, [&](const PlanRef& r, u32) { return load_bytes(plain_address(a, r, c, from), len); },
        [&](const PlanRef& r, u32, u64 v) { store_bytes(plain_address(a, r, c, from), len, v); });
  }
}

// Words i + k * blockDim.x (k < K) of chunk c of a fused group, from byte `from` of every
// reference.
template <u64 kFeed, u32 K, u32 N>
MSCCLPP_DEVICE_INLINE void fused_word_items(const PlanArgs& a, const Op (&ops)[N], u64 c, u64 from,
                                            u64 i) {
  const auto word = [&](const PlanRef& r, u32 k) {
    return reinterpret_cast<uint4*>(plain_address(a, r, c, from)) + i + k * blockDim.x;
  };
  fused_items<kFeed, uint4, K>(
      ops, [&](const PlanRef& r, u32 k) { return *word(r, k); },
      [&](const PlanRef& r, u32 k, uint4 v) { *word(r, k) = v; });
}

// Units [u, end) of chunk c of a fused group as 16-byte words (every reference aligned at u),
// kUnroll words per thread at a time; returns the first unit after the last whole word.
template <u64 kFeed, u32 kUnroll, u32 N>
MSCCLPP_PLAN_DATA_PATH u64 fused_words(const PlanArgs& a, const Op (&ops)[N], u64 c, u64 u,
                                      u64 end) {
  const u64 from = u * a.unit_bytes;
  const u64 to = end * a.unit_bytes < a.chunk_bytes ? end * a.unit_bytes : a.chunk_bytes;
  const u64 words = to > from ? (to - from) / sizeof(uint4) : 0;
  const u64 stride = blockDim.x;
  u64 i = threadIdx.x;
  for (; i + (kUnroll - 1) * stride < words; i += kUnroll * stride) {
    fused_word_items<kFeed, kUnroll>(a, ops, c, from, i);
  }
  for (; i < words; i += stride) fused_word_items<kFeed, 1>(a, ops, c, from, i);
  return u + bytes_to_units(a, words * sizeof(uint4));
}

// A fused group (see above): every chunk's part from the first reference's next 16-byte word as
// words where every reference is aligned there (kUnroll words per thread at a time: the
// generator keeps kUnroll times the words a unit loads within a thread's registers), the rest unit
// by unit.
template <u64 kFeed, u32 kUnroll, u32 N>
MSCCLPP_DEVICE_INLINE bool run_fused(const PlanArgs& a, const Op (&ops)[N], Replicas& r) {
  if (!r.before_data(a, ops[0])) return false;
  const OpUnits n = chunk_units(a, ops[0], ops[0].refs[0].size, r.index);
  for (u64 c = 0; n.per_chunk > 0 && c < n.chunks; ++c) {
    const u64 u = n.u0;
    const u64 end = n.u0 + n.per_chunk;
    u64 stop = u + units_to_word(a, ops[0].refs[0], c, u);
    stop = stop < end ? stop : end;
    u64 misaligned = 0;
#pragma unroll
    for (u32 j = 0; j < N; ++j) {
#pragma unroll
      for (u32 k = 0; k < kFusedMaxSrcs + kFusedMaxDsts; ++k) {
        if (k < static_cast<u32>(ops[j].nsrc) + ops[j].ndst) {
          misaligned |=
              reinterpret_cast<u64>(plain_address(a, ops[j].refs[k], c, stop * a.unit_bytes));
        }
      }
    }
    if (misaligned % sizeof(uint4) != 0) stop = end;
    fused_units<kFeed>(a, ops, c, u, stop);
    if (stop < end) {
      fused_units<kFeed>(a, ops, c, fused_words<kFeed, kUnroll>(a, ops, c, stop, end), end);
    }
  }
  __syncthreads();
  return true;
}

// What a threadblock runs from ops[o] on: the ops [begin, end), `iters` times, iteration `it` over
// the window of units [it * per_iter, (it + 1) * per_iter). A pipeline (kPipeline) is its nids ops
// after it, in windows of unit_size bytes of units covering num_chunks whole chunks (ids: unit_size
// low and high word, num_chunks); any other op runs once over every unit. Pipelines and plain ops
// go through this one loop so that run_op (and the data path inlined in it) is in the kernel once:
// each copy of it is compile time in every unit.
struct Step {
  u32 begin;
  u32 end;
  u64 iters;
  u64 per_iter;
};

MSCCLPP_DEVICE_INLINE Step step_at(const PlanArgs& a, const Op& op, u32 o) {
  if (!kHasPipelines || op.kind != kPipeline) return {o, o + 1, 1, ~0ull};
  const u32* p = op.ids;
  const u64 unit_size = static_cast<u64>(p[0]) | (static_cast<u64>(p[1]) << 32);
  const u64 per_iter = bytes_to_units(a, unit_size) > 0 ? bytes_to_units(a, unit_size) : 1;
  const u64 upc = units_per_chunk(a);
  return {o + 1, o + 1 + op.nids, (p[2] * upc + per_iter - 1) / per_iter, per_iter};
}

// A block's threadblock program: its ops, and the references and ids they name (an op's first_ref
// and first_id count from the program's own, so the program moves as one piece). Copied into
// shared memory by every thread at once (the host gives each block the largest program's bytes and
// refuses plans whose programs do not fit), so each op costs shared-memory reads instead of a
// chain of dependent global ones (the op, then its references or ids) on its critical path; and
// the compiler knows where the tables are (a pointer that could be either global or shared memory
// made every read a generic load, which slowed the LL fixture plans).
// MSCCL++ copies its ops into shared memory for the same reason.
struct Program {
  const PlanOp* ops;
  const PlanRef* refs;
  const u32* ids;
  u32 nops;

  MSCCLPP_DEVICE_INLINE Op op(u32 j) const {
    return make_op(ops[j], refs + ops[j].first_ref, ids + ops[j].first_id);
  }
};

// Threadblock tb's program: ops[s[0]..s[3]], refs[s[1]..s[4]], ids[s[2]..s[5]] with s =
// tb_starts + 3 * tb. Called by every thread before wait_prior_grids (the program never changes
// after the host uploads it, so it may be read while the previous grid still runs).
MSCCLPP_DEVICE_INLINE Program load_program(const PlanArgs& a, u32 tb) {
  const u32* s = a.tb_starts + 3 * tb;
  const u32 op0 = s[0], ref0 = s[1], id0 = s[2];
  const u32 nops = s[3] - op0, nrefs = s[4] - ref0, nids = s[5] - id0;
  // One shared-memory image, words of ops then references then ids (all three are arrays of u32
  // words: static_asserts below), each thread copying words with its loads all in flight.
  extern __shared__ u32 program_words[];
  const u32 op_words = nops * (sizeof(PlanOp) / 4);
  const u32 ref_words = nrefs * (sizeof(PlanRef) / 4);
  const u32 words = op_words + ref_words + nids;
  const u32* op_src = reinterpret_cast<const u32*>(a.ops + op0);
  const u32* ref_src = reinterpret_cast<const u32*>(a.refs + ref0);
  const u32* id_src = a.ids + id0;
  for (u32 i = threadIdx.x; i < words; i += blockDim.x) {
    program_words[i] = i < op_words              ? op_src[i]
                       : i < op_words + ref_words ? ref_src[i - op_words]
                                                  : id_src[i - op_words - ref_words];
  }
  __syncthreads();
  return {reinterpret_cast<const PlanOp*>(program_words),
          reinterpret_cast<const PlanRef*>(program_words + op_words),
          program_words + op_words + ref_words, nops};
}
static_assert(sizeof(PlanOp) % 4 == 0 && alignof(PlanOp) == 4, "PlanOp: whole u32 words");
static_assert(sizeof(PlanRef) % 4 == 0 && alignof(PlanRef) == 4, "PlanRef: whole u32 words");

#if defined(MSCCLPP_PLAN_STATIC)
// A specialised unit (mscclpp_kernels_cu::executor::specialised_unit_source) carries its rank's
// program as code, written after this file: every threadblock's ops in order, each a run_op on
// an op made of constants (the same steps as the loop of plan_execute, pipelines included), so the
// compiler folds each op's kind, references, slots and counts into its own straight-line code,
// where the interpreter decodes them from shared memory at run time. The program tables and
// dynamic shared memory go unused.
MSCCLPP_DEVICE_INLINE bool run_static_program(const PlanArgs& a, u32 tb, u32 flag, Replicas& r);
#endif

}  // namespace plan
}  // namespace mscclpp

// __grid_constant__: the functions above take the argument by reference, which must not make a
// local copy of it (a copy costs microseconds a call when the data path is out of line).
#if defined(MSCCLPP_HIP)
#define MSCCLPP_PLAN_ARGS const mscclpp::plan::PlanArgs
#else
#define MSCCLPP_PLAN_ARGS const __grid_constant__ mscclpp::plan::PlanArgs
#endif

extern "C" __global__ void __launch_bounds__(mscclpp::plan::kMaxBlockThreads, 1)
    plan_execute(MSCCLPP_PLAN_ARGS a) {
  using namespace mscclpp;
  using namespace mscclpp::plan;
  const u32 tb = blockIdx.x / a.replicas;
#if !defined(MSCCLPP_PLAN_STATIC)
  const Program program = load_program(a, tb);
#endif
  // Before anything else reads memory (the host may launch this grid programmatically); the
  // abort check comes after it (collective_common.cuh says why). The execution counter is read
  // before the check's barrier, so the two memory round trips overlap.
  wait_prior_grids();
  u32* words = a.flags + kTbWords * tb;
  const u32 replica = blockIdx.x - tb * a.replicas;
  const u32 flag = words[replica] + 1;
  if (mscclpp::block_aborted(a.error_word)) return;
  Replicas r = {words, static_cast<u64>(flag) << 32, Replicas::kSinceNothing, 0, 0, 0, replica};
#if defined(MSCCLPP_PLAN_STATIC)
  if (!run_static_program(a, tb, flag, r)) return;
#else
  for (u32 o = 0; o < program.nops;) {
    const Op head = program.op(o);
    const Step step = step_at(a, head, o);
    for (u64 it = 0; it < step.iters; ++it) {
      const Window w = {it * step.per_iter, (it + 1) * step.per_iter};
      for (u32 j = step.begin; j < step.end; ++j) {
        // A plain op is its step's only op, already loaded; a pipeline's ops follow it.
        const Op op = j == o ? head : program.op(j);
        if (!run_op(a, op, flag, w, r)) return;
      }
    }
    o = step.end;
  }
#endif
  // Every thread has read this replica's slot before it is written; a plan with no op still needs
  // that order. No other block reads the slots written here during this call.
  __syncthreads();
  for (u32 k = replica + threadIdx.x * a.replicas; k < kMaxReplicas; k += blockDim.x * a.replicas) {
    words[k] = flag;
  }
}
