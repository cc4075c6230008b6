// mscclpp-rs: the interpreter of MSCCL++ JSON execution plans.
//
// One launch per execution, one block per plan threadblock. Block b walks its ops
// (ops[tb_ops[b]..tb_ops[b+1]]), encoded once per plan by mscclpp-executor (encode.rs) from the
// validated JSON; the struct layouts are mirrored by kernels-cu/src/executor.rs and checked by the
// static_asserts it generates.
//
// Every data-moving op is one kind (kData) with the meaning the CPU reference interpreter gives
// it: read every source, wait for LL packets where the source holds packets, reduce the sources
// with the plan's op (accumulating in MSCCLPP_PLAN_ACC), write the result to every destination,
// as packets where the destination holds packets. A single source is copied bit for bit.
// Work is cut in units of 8 payload bytes (4 for LL8): unit u of a chunk is packet u of that chunk
// in a packet buffer, and a threadblock group splits every chunk by whole units (as
// mscclpp_executor::encode::part_range, which the CPU reference uses), so no two blocks
// write one packet.
//
// CUDA-graph safe: nothing is set by the host per call. The LL flag of an execution is the
// per-block execution counter (flags[b] + 1, stored back at the end; every block of every rank
// runs every execution, so the counters agree across ranks), and LL scratch alternates two halves
// by the flag's parity, so a fast writer of execution k + 1 never overwrites packets of execution
// k that a slow reader has not read. Channel semaphores, local semaphores and barriers are counters
// that only grow (or come back to their initial value), so replays need no reset.
// Every wait is bounded by spin_until (error.cuh): on a timeout or an abort the block stops.
#include "mscclpp/common.cuh"
#include "mscclpp/error.cuh"
#include "mscclpp/packet.cuh"
#include "mscclpp/reduce.cuh"
#include "mscclpp/semaphore.cuh"

#ifndef MSCCLPP_PLAN_T
#define MSCCLPP_PLAN_T float
#define MSCCLPP_PLAN_ACC float
#define MSCCLPP_PLAN_OP 0
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

constexpr u8 kSignalAfter = 1;
constexpr u8 kFlushAfter = 2;

struct PlanOp {
  u8 kind;
  u8 flags;
  u8 nsrc;
  u8 ndst;
  u16 nids;
  u16 tbg_part;
  u16 tbg_parts;
  u16 barrier_tbs;
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
  const u32* tb_ops;
  const PlanRef* refs;
  const u32* ids;
  D2DSemaphoreHandle* channels;
  u32* semaphores;
  u64* barriers;
  u32* flags;
  u32* error_word;
  u64 buffers[kMaxPlanBuffers];
  u64 chunk_bytes;
  u64 scratch_half_bytes;
  u64 max_spin;
  u32 packet_bytes;
  u32 unit_bytes;
};

typedef MSCCLPP_PLAN_T T;
typedef MSCCLPP_PLAN_ACC Acc;
constexpr int kOp = MSCCLPP_PLAN_OP;
// Elements of T in one 8-byte unit (the host refuses element types wider than the unit).
constexpr u32 kLanes = sizeof(T) <= 8 ? 8 / sizeof(T) : 1;

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
  if (r.packets) {
    return base + (flag & 1) * a.scratch_half_bytes +
           (c * units_per_chunk + u) * static_cast<u64>(a.packet_bytes);
  }
  return base + c * a.chunk_bytes + u * a.unit_bytes;
}

// Reads one unit (`n` payload bytes); false when a packet did not come (timeout or abort).
MSCCLPP_DEVICE_INLINE bool read_unit(const PlanArgs& a, const PlanRef& r, u64 chunk, u64 u,
                                     u64 units_per_chunk, u32 n, u32 flag, u64& out) {
  const u8* p = unit_address(a, r, chunk, u, units_per_chunk, flag);
  if (!r.packets) {
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

MSCCLPP_DEVICE_INLINE void write_unit(const PlanArgs& a, const PlanRef& r, u64 chunk, u64 u,
                                      u64 units_per_chunk, u32 n, u32 flag, u64 v) {
  u8* p = unit_address(a, r, chunk, u, units_per_chunk, flag);
  if (!r.packets) {
    store_bytes(p, n, v);
  } else if (a.packet_bytes == 16) {
    reinterpret_cast<LL16Packet*>(p)->write(v, flag);
  } else {
    reinterpret_cast<LL8Packet*>(p)->write(static_cast<u32>(v), flag);
  }
}

MSCCLPP_DEVICE_INLINE T lane(u64 word, u32 i) {
  T x;
  memcpy(&x, reinterpret_cast<const u8*>(&word) + i * sizeof(T), sizeof(T));
  return x;
}

MSCCLPP_DEVICE_INLINE void set_lane(u64& word, u32 i, T x) {
  memcpy(reinterpret_cast<u8*>(&word) + i * sizeof(T), &x, sizeof(T));
}

// One data op, cooperatively by every thread of the block. False when a packet read gave up.
MSCCLPP_DEVICE_INLINE bool run_data(const PlanArgs& a, const PlanOp& op, u32 flag) {
  const PlanRef* refs = a.refs + op.first_ref;
  const u32 nrefs = static_cast<u32>(op.nsrc) + op.ndst;
  u32 chunks = refs[0].size;
  for (u32 i = 1; i < nrefs; ++i) chunks = refs[i].size < chunks ? refs[i].size : chunks;
  const u64 upc = (a.chunk_bytes + a.unit_bytes - 1) / a.unit_bytes;
  const u64 u0 = upc * op.tbg_part / op.tbg_parts;
  const u64 u1 = upc * (op.tbg_part + 1) / op.tbg_parts;
  const u64 per_chunk = u1 - u0;
  const u64 total = per_chunk * chunks;
  const u32 lanes_per_unit = a.unit_bytes / sizeof(T) > 0 ? a.unit_bytes / sizeof(T) : 1;
  for (u64 i = threadIdx.x; i < total; i += blockDim.x) {
    const u64 chunk = i / per_chunk;
    const u64 u = u0 + i % per_chunk;
    const u64 left = a.chunk_bytes - u * a.unit_bytes;
    const u32 n = left < a.unit_bytes ? static_cast<u32>(left) : a.unit_bytes;
    u64 word = 0;
    if (!read_unit(a, refs[0], chunk, u, upc, n, flag, word)) return false;
    if (op.nsrc > 1) {
      const u32 lanes = (n / sizeof(T)) < lanes_per_unit ? n / sizeof(T) : lanes_per_unit;
      Acc acc[kLanes];
#pragma unroll
      for (u32 l = 0; l < kLanes; ++l) {
        if (l < lanes) acc[l] = convert<Acc>(lane(word, l));
      }
      for (u32 s = 1; s < op.nsrc; ++s) {
        u64 other = 0;
        if (!read_unit(a, refs[s], chunk, u, upc, n, flag, other)) return false;
#pragma unroll
        for (u32 l = 0; l < kLanes; ++l) {
          if (l < lanes) acc[l] = ReduceFn<kOp>::apply(acc[l], convert<Acc>(lane(other, l)));
        }
      }
#pragma unroll
      for (u32 l = 0; l < kLanes; ++l) {
        if (l < lanes) set_lane(word, l, convert<T>(acc[l]));
      }
    }
    for (u32 d = 0; d < op.ndst; ++d) write_unit(a, refs[op.nsrc + d], chunk, u, upc, n, flag, word);
  }
  return true;
}

// A channel wait. `expected` is advanced atomically: plans may share one channel between blocks.
MSCCLPP_DEVICE_INLINE bool wait_channel(const PlanArgs& a, const D2DSemaphoreHandle& s,
                                        bool relaxed) {
  const u64 target =
      atomicAdd(reinterpret_cast<unsigned long long*>(s.expected), 1ull) + 1ull;
  const u64* in = s.inbound;
  if (relaxed) {
    return spin_until([in, target] { return atomic_load_relaxed_sys(in) >= target; }, a.max_spin,
                      a.error_word, kErrorSemaphoreWaitTimeout);
  }
  return spin_until([in, target] { return atomic_load_acquire_sys(in) >= target; }, a.max_spin,
                    a.error_word, kErrorSemaphoreWaitTimeout);
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

// The synchronisation ops, run by thread 0 after the block's earlier writes (a __syncthreads
// orders them before; the release of a signal publishes them, by cumulativity).
MSCCLPP_DEVICE_INLINE bool run_sync(const PlanArgs& a, const PlanOp& op) {
  const u32* ids = a.ids + op.first_id;
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

}  // namespace plan
}  // namespace mscclpp

extern "C" __global__ void __launch_bounds__(1024) plan_execute(mscclpp::plan::PlanArgs a) {
  using namespace mscclpp;
  using namespace mscclpp::plan;
  if (mscclpp::block_aborted(a.error_word)) return;
  const u32 block = blockIdx.x;
  const u32 flag = a.flags[block] + 1;
  for (u32 o = a.tb_ops[block]; o < a.tb_ops[block + 1]; ++o) {
    const PlanOp op = a.ops[o];
    bool ok = true;
    if (op.kind == kData) {
      ok = run_data(a, op, flag);
      // A block that gave up still meets the others here, then every thread leaves.
      if (__syncthreads_or(!ok)) return;
      if ((op.flags & kSignalAfter) && threadIdx.x == 0) run_sync(a, op);
    } else {
      if (threadIdx.x == 0) ok = run_sync(a, op);
      if (__syncthreads_or(!ok)) return;
    }
  }
  // Every thread has read flags[block] before the first __syncthreads_or; a plan with no op
  // still needs that order.
  __syncthreads();
  if (threadIdx.x == 0) a.flags[block] = flag;
}
