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
//
// Port-channel ops (kPort): thread 0 pushes the proxy's triggers (a put per chunk part, then the
// signals, then a flush), offsets relative to the rank's registered plan block (block_offsets: the
// host stages port-channel plans in one block per rank that the proxy knows). A `pipeline` (kPipeline,
// followed by its nids ops) runs its ops once per iteration over a window of every op's units: unit
// i of an op counts its chunks' units in order (only the threadblock group member's part of each).
#include "mscclpp/common.cuh"
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
};

// Units [begin, end) of every op a step runs (a pipeline iteration's window, or everything).
struct Window {
  u64 begin;
  u64 end;
};
constexpr Window kWhole = {0, ~0ull};

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

// The units of an op: `chunks` chunks (the fewest any reference names), of which the op does units
// [u0, u0 + per_chunk) each; its unit i is unit u0 + i % per_chunk of chunk i / per_chunk.
struct OpUnits {
  u64 upc;  // units per chunk
  u64 u0;
  u64 per_chunk;
  u64 total;
};

MSCCLPP_DEVICE_INLINE OpUnits op_units(const PlanArgs& a, const PlanOp& op) {
  const PlanRef* refs = a.refs + op.first_ref;
  const u32 nrefs = static_cast<u32>(op.nsrc) + op.ndst;
  u32 chunks = refs[0].size;
  for (u32 i = 1; i < nrefs; ++i) chunks = refs[i].size < chunks ? refs[i].size : chunks;
  OpUnits n;
  n.upc = (a.chunk_bytes + a.unit_bytes - 1) / a.unit_bytes;
  n.u0 = n.upc * op.tbg_part / op.tbg_parts;
  n.per_chunk = n.upc * (op.tbg_part + 1) / op.tbg_parts - n.u0;
  n.total = n.per_chunk * chunks;
  return n;
}

// One data op, cooperatively by every thread of the block. False when a packet read gave up.
MSCCLPP_DEVICE_INLINE bool run_data(const PlanArgs& a, const PlanOp& op, u32 flag, Window w) {
  const PlanRef* refs = a.refs + op.first_ref;
  const OpUnits n = op_units(a, op);
  const u64 upc = n.upc;
  const u64 end = w.end < n.total ? w.end : n.total;
  const u32 lanes_per_unit = a.unit_bytes / sizeof(T) > 0 ? a.unit_bytes / sizeof(T) : 1;
  for (u64 i = w.begin + threadIdx.x; i < end; i += blockDim.x) {
    const u64 chunk = i / n.per_chunk;
    const u64 u = n.u0 + i % n.per_chunk;
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

// Waits until the source packets of the op's units in the window have come (every thread).
MSCCLPP_DEVICE_INLINE bool await_packets(const PlanArgs& a, const PlanOp& op, u32 flag, Window w) {
  const PlanRef* refs = a.refs + op.first_ref;
  const OpUnits n = op_units(a, op);
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
MSCCLPP_DEVICE_INLINE bool run_port_put(const PlanArgs& a, const PlanOp& op, u32 flag, Window w) {
  const PlanRef* refs = a.refs + op.first_ref;
  const u32* ids = a.ids + op.first_id;
  const OpUnits n = op_units(a, op);
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
MSCCLPP_DEVICE_INLINE bool run_port_sync(const PlanArgs& a, const PlanOp& op) {
  const u32* ids = a.ids + op.first_id;
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
MSCCLPP_DEVICE_INLINE bool run_sync(const PlanArgs& a, const PlanOp& op) {
  if ((op.flags & kPort) && op.kind != kData) return run_port_sync(a, op);
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

// One op over the window `w`, called by every thread of the block; false (in every thread) when
// the block gives up. A block that gave up still meets the others at the __syncthreads_or.
MSCCLPP_DEVICE_INLINE bool run_op(const PlanArgs& a, const PlanOp& op, u32 flag, Window w) {
  bool ok = true;
  if (op.kind == kData && (op.flags & kPort)) {
    // The proxy's copy engine reads what this block wrote (or received): publish it first.
    ok = await_packets(a, op, flag, w);
    __threadfence_system();
    if (__syncthreads_or(!ok)) return false;
    if (threadIdx.x == 0) ok = run_port_put(a, op, flag, w);
    return !__syncthreads_or(!ok);
  }
  if (op.kind == kData) {
    ok = run_data(a, op, flag, w);
    if (__syncthreads_or(!ok)) return false;
    if ((op.flags & kSignalAfter) && threadIdx.x == 0) run_sync(a, op);
    return true;
  }
  if (threadIdx.x == 0) ok = run_sync(a, op);
  return !__syncthreads_or(!ok);
}

// A pipeline at ops[o]: its nids ops, iteration by iteration. The window is unit_size bytes of
// units; the iterations cover num_chunks whole chunks (ids: unit_size low and high word,
// num_chunks).
MSCCLPP_DEVICE_INLINE bool run_pipeline(const PlanArgs& a, u32 o, u32 flag) {
  const PlanOp& op = a.ops[o];
  const u32* p = a.ids + op.first_id;
  const u64 unit_size = static_cast<u64>(p[0]) | (static_cast<u64>(p[1]) << 32);
  const u64 per_iter = unit_size / a.unit_bytes > 0 ? unit_size / a.unit_bytes : 1;
  const u64 upc = (a.chunk_bytes + a.unit_bytes - 1) / a.unit_bytes;
  const u64 iters = (p[2] * upc + per_iter - 1) / per_iter;
  for (u64 it = 0; it < iters; ++it) {
    const Window w = {it * per_iter, (it + 1) * per_iter};
    for (u32 j = 1; j <= op.nids; ++j) {
      if (!run_op(a, a.ops[o + j], flag, w)) return false;
    }
  }
  return true;
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
    if (op.kind == kPipeline) {
      if (!run_pipeline(a, o, flag)) return;
      o += op.nids;
    } else if (!run_op(a, op, flag, kWhole)) {
      return;
    }
  }
  // Every thread has read flags[block] before the first __syncthreads_or; a plan with no op
  // still needs that order.
  __syncthreads();
  if (threadIdx.x == 0) a.flags[block] = flag;
}
