// mscclpp-rs expert-parallel (MoE) dispatch and combine, intranode normal mode (mscclpp.ext.ep;
// the semantics are in python/mscclpp/ext/ep/__init__.py). kernels-cu/src/ep.rs mirrors the
// argument struct and computes the buffer layout; collective_common.cuh is prepended.
//
// Every rank has one NVLink buffer that every peer maps (bufs.p[r]), laid out by the host:
//   meta: [src rank][nranks + experts_per_rank] i32, what src published for this rank in
//         ep_notify: its tokens per rank, then its tokens per expert of this rank's experts;
//   ctrl: [channel][peer][4] u64: tail, head, start + 1, end + 1 of the ring (channel, peer);
//   ring: [channel][peer][ring_slots] slots of slot_bytes: hidden bytes, then (dispatch) the
//         source index (8 bytes), the top-k indices (i64) and weights (f32), or (combine) the
//         top-k weights.
// A ring lives in its receiver's buffer. The sender stores slots and then the tail (release,
// system scope) into the receiver's buffer and reads the receiver's head; the receiver reads the
// tail (acquire), copies the slots out and then stores its head. start/end (0 = not yet written)
// tell the receiver which of the sender's rows the ring carries. Counters start at 0 each call:
// ep_notify and ep_reset zero this rank's ctrl between two barriers of all ranks, so no peer's
// previous call still uses the rings and no peer's next kernel writes them before they are zero.
//
// Channels: tokens [c * ceil(T / C), (c + 1) * ceil(T / C)) of a rank form its channel c. Dispatch
// and combine give every ring its own sender block and receiver block (block per (channel, peer)),
// so a ring only waits on its own two ends and no ring can hold another back; the combine's
// receiver is one block per channel, reading its rings in token order (a ring's oldest row always
// belongs to the token the receiver is at, so a full ring never blocks it). Blocks wait for peers'
// blocks: the host refuses a grid whose blocks, times the ranks sharing the GPU, might not all be
// resident (no cooperative launch). Every wait is spin_until, bounded by the device wait timeout;
// a block whose wait gave up skips the rest (the error word fails the call on the host).

using namespace mscclpp;
using namespace mscclpp::coll;

// Mirrored by mscclpp_kernels_cu::ep::EpArgs (the static_asserts ep::layout_asserts generates
// check every offset).
struct EpArgs {
  PeerPtrs bufs;                   // every rank's NVLink buffer, mapped here
  const D2DSemaphoreHandle* sems;  // [npeers]: the barrier of ep_notify and ep_reset
  u32* error_word;
  u64 max_spin;
  u64 meta_offset;   // byte offsets in each rank's buffer
  u64 ctrl_offset;
  u64 ring_offset;
  u64 slot_bytes;    // a multiple of 16
  u64 hidden_bytes;  // a multiple of 16
  // Dispatch side (this rank's tokens).
  const u8* x;                      // [num_tokens][hidden_bytes]
  const bool* is_token_in_rank;     // [num_tokens][nranks]
  const i32* num_tokens_per_rank;   // [nranks]
  const i32* num_tokens_per_expert; // [nranks * experts_per_rank]
  const i32* channel_prefix;        // [nranks][num_channels]: inclusive prefix per destination
  const i64* topk_idx;              // [num_tokens][num_topk] or null
  const float* topk_weights;        // [num_tokens][num_topk] or null
  // Receive side, and the handle.
  i32* rank_prefix;                 // [nranks][nranks]: written by ep_notify
  i32* recv_expert_counts;          // [experts_per_rank + 1]: aligned counts, then the total
  u8* recv_x;                       // [num_recv][hidden_bytes]
  i32* recv_src_idx;                // [num_recv]
  i64* recv_topk_idx;               // [num_recv][num_topk] or null
  float* recv_topk_weights;         // [num_recv][num_topk] or null
  i32* recv_channel_prefix;         // [nranks][num_channels]: start row of (source, channel)
  // Combine: x is [num_recv][hidden] (bf16) here, the output [num_tokens][hidden].
  const u8* bias0;                  // [num_tokens][hidden] bf16 or null
  const u8* bias1;
  u8* combined;                     // [num_tokens][hidden] bf16
  float* combined_weights;          // [num_tokens][num_topk] or null
  u32 num_tokens;
  u32 num_topk;
  u32 experts_per_rank;
  u32 expert_alignment;
  u32 num_channels;
  u32 ring_slots;
  u32 chunk;  // rows a sender stores before it publishes the tail
  u32 rank;
  u32 nranks;
  u32 pad;
};

constexpr u32 kCtrlTail = 0, kCtrlHead = 1, kCtrlStart = 2, kCtrlEnd = 3;

MSCCLPP_DEVICE_INLINE u64* ctrl_of(const EpArgs& a, u32 owner, u32 c, u32 peer) {
  return reinterpret_cast<u64*>(static_cast<u8*>(a.bufs.p[owner]) + a.ctrl_offset) +
         (static_cast<u64>(c) * a.nranks + peer) * 4;
}

MSCCLPP_DEVICE_INLINE u8* slot_of(const EpArgs& a, u32 owner, u32 c, u32 peer, u64 i) {
  return static_cast<u8*>(a.bufs.p[owner]) + a.ring_offset +
         ((static_cast<u64>(c) * a.nranks + peer) * a.ring_slots + i % a.ring_slots) * a.slot_bytes;
}

MSCCLPP_DEVICE_INLINE i32* meta_of(const EpArgs& a, u32 owner, u32 src) {
  return reinterpret_cast<i32*>(static_cast<u8*>(a.bufs.p[owner]) + a.meta_offset) +
         static_cast<u64>(src) * (a.nranks + a.experts_per_rank);
}

MSCCLPP_DEVICE_INLINE void channel_range(u32 num_tokens, u32 channels, u32 c, u32& begin, u32& end) {
  const u32 per = (num_tokens + channels - 1) / channels;
  begin = min(per * c, num_tokens);
  end = min(begin + per, num_tokens);
}

// Thread 0 waits for `*word >= target` (acquire, system scope); every thread of the block learns
// whether it came and the value thread 0 saw (`seen`): one value for the whole block, since the
// word may grow while the threads read it and they must all work on the same range.
MSCCLPP_DEVICE_INLINE bool block_wait_at_least(const EpArgs& a, const u64* word, u64 target, u64& seen) {
  __shared__ int ok;
  __shared__ u64 value;
  if (threadIdx.x == 0) {
    u64 v = 0;
    ok = spin_until([word, target, &v] { return (v = atomic_load_acquire_sys(word)) >= target; },
                    a.max_spin, a.error_word, kErrorSemaphoreWaitTimeout);
    value = v;
  }
  __syncthreads();
  const bool came = ok != 0;
  seen = value;
  // Every thread has read `ok` and `value` before thread 0 may write them for the next wait.
  __syncthreads();
  return came;
}

MSCCLPP_DEVICE_INLINE bool block_wait_at_least(const EpArgs& a, const u64* word, u64 target) {
  u64 seen;
  return block_wait_at_least(a, word, target, seen);
}

// Zeroes this rank's ctrl words between two barriers of all ranks (see the top of the file).
MSCCLPP_DEVICE_INLINE bool reset_rings(const EpArgs& a) {
  const u32 npeers = a.nranks - 1;
  if (!block_barrier(a.sems, npeers, true)) return false;
  u64* ctrl = ctrl_of(a, a.rank, 0, 0);
  const u64 words = static_cast<u64>(a.num_channels) * a.nranks * 4;
  for (u64 i = threadIdx.x; i < words; i += blockDim.x) ctrl[i] = 0;
  return block_barrier(a.sems, npeers, true);
}

// One block: publishes this rank's counts to every peer, then (after the barrier) derives the
// rank prefix matrix and this rank's aligned per-expert counts from what every rank published.
extern "C" __global__ void ep_notify(EpArgs a) {
  wait_prior_grids();
  if (block_aborted(a.error_word)) return;
  const u32 n = a.nranks, L = a.experts_per_rank, row = n + L;
  for (u32 i = threadIdx.x; i < n * row; i += blockDim.x) {
    const u32 peer = i / row, k = i % row;
    meta_of(a, peer, a.rank)[k] =
        k < n ? a.num_tokens_per_rank[k] : a.num_tokens_per_expert[peer * L + (k - n)];
  }
  const u32 npeers = n - 1;
  if (!block_barrier(a.sems, npeers, true)) return;
  // Column j of the rank prefix matrix: what ranks 0..i send to j, for every i.
  for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
    i32 sum = 0;
    for (u32 i = 0; i < n; ++i) {
      sum += meta_of(a, a.rank, i)[j];
      a.rank_prefix[i * n + j] = sum;
    }
  }
  for (u32 l = threadIdx.x; l <= L; l += blockDim.x) {
    i32 sum = 0;
    for (u32 src = 0; src < n; ++src) sum += meta_of(a, a.rank, src)[l < L ? n + l : a.rank];
    if (l < L) sum = (sum + static_cast<i32>(a.expert_alignment) - 1) / static_cast<i32>(a.expert_alignment) *
                     static_cast<i32>(a.expert_alignment);
    a.recv_expert_counts[l] = sum;  // l == L: the tokens this rank receives, unaligned
  }
  reset_rings(a);
}

// One block: the barrier and ring reset before a combine or a cached dispatch.
extern "C" __global__ void ep_reset(EpArgs a) {
  wait_prior_grids();
  if (block_aborted(a.error_word)) return;
  reset_rings(a);
}

// The start row, in rank `dst`'s receive, of the block this rank sends it: the tokens ranks
// 0..rank-1 send it (from the rank prefix matrix every rank computed alike).
MSCCLPP_DEVICE_INLINE i32 block_start(const EpArgs& a, u32 src, u32 dst) {
  return src == 0 ? 0 : a.rank_prefix[(src - 1) * a.nranks + dst];
}

// Sender block of ring (c, dst) in dst's buffer: stores this rank's channel-c tokens for dst.
MSCCLPP_DEVICE_INLINE void dispatch_send(const EpArgs& a, u32 c, u32 dst) {
  __shared__ u32 rows[64];
  __shared__ u32 found;
  u32 begin, end;
  channel_range(a.num_tokens, a.num_channels, c, begin, end);
  u64* ctrl = ctrl_of(a, dst, c, a.rank);
  const i32 start = c == 0 ? 0 : a.channel_prefix[dst * a.num_channels + c - 1];
  const i32 stop = a.channel_prefix[dst * a.num_channels + c];
  if (threadIdx.x == 0) {
    atomic_store_release_sys(ctrl + kCtrlStart, static_cast<u64>(start) + 1);
    atomic_store_release_sys(ctrl + kCtrlEnd, static_cast<u64>(stop) + 1);
  }
  const u32 chunk = min(min(a.chunk, a.ring_slots), 64u);
  const u64 topk_off = a.hidden_bytes + 8, w_off = topk_off + 8ull * a.num_topk;
  u64 sent = 0;
  u32 t = begin;
  while (sent < static_cast<u64>(stop - start)) {
    if (threadIdx.x == 0) {
      u32 k = 0;
      for (; t < end && k < chunk; ++t)
        if (a.is_token_in_rank[static_cast<u64>(t) * a.nranks + dst]) rows[k++] = t;
      found = k;
    }
    __syncthreads();
    const u32 k = found;
    if (k == 0) {
      // The channel prefix promised more rows than is_token_in_rank holds: the caller passed a
      // handle or layout of other tokens. Fail the call (the receiver's wait gives up too).
      if (threadIdx.x == 0) record_error(a.error_word, kErrorCountMismatch);
      return;
    }
    // Room for k more rows: the receiver has consumed all but ring_slots - k of them.
    if (!block_wait_at_least(a, ctrl + kCtrlHead, sent + k > a.ring_slots ? sent + k - a.ring_slots : 0))
      return;
    for (u32 i = 0; i < k; ++i) {
      const u64 token = rows[i];
      u8* slot = slot_of(a, dst, c, a.rank, sent + i);
      copy(slot, a.x + token * a.hidden_bytes, a.hidden_bytes, threadIdx.x, blockDim.x);
      if (threadIdx.x == 0) *reinterpret_cast<i64*>(slot + a.hidden_bytes) = static_cast<i64>(token);
      for (u32 j = threadIdx.x; j < a.num_topk; j += blockDim.x) {
        reinterpret_cast<i64*>(slot + topk_off)[j] = a.topk_idx[token * a.num_topk + j];
        reinterpret_cast<float*>(slot + w_off)[j] = a.topk_weights[token * a.num_topk + j];
      }
    }
    sent += k;
    fence_acq_rel_sys();
    __syncthreads();
    if (threadIdx.x == 0) atomic_store_release_sys(ctrl + kCtrlTail, sent);
  }
}

// Receiver block of ring (c, src) in this rank's buffer: copies src's channel-c rows out to
// their rows of the receive (src's block, then the channel's start within it).
MSCCLPP_DEVICE_INLINE void dispatch_recv(const EpArgs& a, u32 c, u32 src) {
  u64* ctrl = ctrl_of(a, a.rank, c, src);
  u64 start_word, end_word;
  if (!block_wait_at_least(a, ctrl + kCtrlStart, 1, start_word) ||
      !block_wait_at_least(a, ctrl + kCtrlEnd, 1, end_word))
    return;
  const u64 start = start_word - 1, total = end_word - 1 - start;
  const u64 base = static_cast<u64>(block_start(a, src, a.rank)) + start;
  if (threadIdx.x == 0) a.recv_channel_prefix[src * a.num_channels + c] = static_cast<i32>(base);
  const u64 topk_off = a.hidden_bytes + 8, w_off = topk_off + 8ull * a.num_topk;
  const i64 lo = static_cast<i64>(a.rank) * a.experts_per_rank, hi = lo + a.experts_per_rank;
  u64 got = 0;
  while (got < total) {
    u64 tail;
    if (!block_wait_at_least(a, ctrl + kCtrlTail, got + 1, tail)) return;
    const u64 ready = min(tail, total);
    for (u64 i = got; i < ready; ++i) {
      const u8* slot = slot_of(a, a.rank, c, src, i);
      const u64 row = base + i;
      copy(a.recv_x + row * a.hidden_bytes, slot, a.hidden_bytes, threadIdx.x, blockDim.x);
      if (threadIdx.x == 0)
        a.recv_src_idx[row] = static_cast<i32>(*reinterpret_cast<const i64*>(slot + a.hidden_bytes));
      if (a.recv_topk_idx != nullptr) {
        for (u32 j = threadIdx.x; j < a.num_topk; j += blockDim.x) {
          const i64 e = reinterpret_cast<const i64*>(slot + topk_off)[j];
          const bool local = e >= lo && e < hi;
          a.recv_topk_idx[row * a.num_topk + j] = local ? e - lo : -1;
          a.recv_topk_weights[row * a.num_topk + j] = local ? reinterpret_cast<const float*>(slot + w_off)[j] : 0.0f;
        }
      }
    }
    got = ready;
    __syncthreads();
    if (threadIdx.x == 0) atomic_store_release_sys(ctrl + kCtrlHead, got);
  }
}

// Grid: num_channels * nranks sender blocks (block b: channel b / nranks, destination b % nranks),
// then as many receiver blocks (channel, source).
extern "C" __global__ void ep_dispatch(EpArgs a) {
  wait_prior_grids();
  if (block_aborted(a.error_word)) return;
  const u32 rings = a.num_channels * a.nranks;
  const u32 b = blockIdx.x % rings;
  if (blockIdx.x < rings) {
    dispatch_send(a, b / a.nranks, b % a.nranks);
  } else {
    dispatch_recv(a, b / a.nranks, b % a.nranks);
  }
}

// Combine sender of ring (c, dst) in dst's buffer (dst: the rank the rows came from): this rank's
// received rows of (dst, c), in order, with their top-k weights.
MSCCLPP_DEVICE_INLINE void combine_send(const EpArgs& a, u32 c, u32 dst) {
  const u64 first = static_cast<u64>(a.recv_channel_prefix[dst * a.num_channels + c]);
  const u64 last = c + 1 < a.num_channels ? static_cast<u64>(a.recv_channel_prefix[dst * a.num_channels + c + 1])
                                          : static_cast<u64>(a.rank_prefix[dst * a.nranks + a.rank]);
  u64* ctrl = ctrl_of(a, dst, c, a.rank);
  const u32 chunk = max(1u, min(a.chunk, a.ring_slots));
  for (u64 sent = 0; sent < last - first;) {
    const u64 k = min(static_cast<u64>(chunk), last - first - sent);
    if (!block_wait_at_least(a, ctrl + kCtrlHead, sent + k > a.ring_slots ? sent + k - a.ring_slots : 0)) return;
    for (u64 i = 0; i < k; ++i) {
      const u64 row = first + sent + i;
      u8* slot = slot_of(a, dst, c, a.rank, sent + i);
      copy(slot, a.x + row * a.hidden_bytes, a.hidden_bytes, threadIdx.x, blockDim.x);
      if (a.topk_weights != nullptr)
        for (u32 j = threadIdx.x; j < a.num_topk; j += blockDim.x)
          reinterpret_cast<float*>(slot + a.hidden_bytes)[j] = a.topk_weights[row * a.num_topk + j];
    }
    sent += k;
    fence_acq_rel_sys();
    __syncthreads();
    if (threadIdx.x == 0) atomic_store_release_sys(ctrl + kCtrlTail, sent);
  }
}

// Combine receiver of channel c: per token in order, bias 0 + bias 1, then the row of every rank
// the token went to, ranks ascending, in fp32; rounded once to bf16.
MSCCLPP_DEVICE_INLINE void combine_recv(const EpArgs& a, u32 c) {
  __shared__ u64 pos[kMaxRanks];
  __shared__ u32 sent_to;  // bit r: the token went to rank r
  u32 begin, end;
  channel_range(a.num_tokens, a.num_channels, c, begin, end);
  if (threadIdx.x < a.nranks) pos[threadIdx.x] = 0;
  const u64 elems = a.hidden_bytes / sizeof(bf16);
  for (u32 t = begin; t < end; ++t) {
    if (threadIdx.x == 0) {
      u32 bits = 0;
      for (u32 r = 0; r < a.nranks; ++r)
        if (a.is_token_in_rank[static_cast<u64>(t) * a.nranks + r]) bits |= 1u << r;
      sent_to = bits;
    }
    __syncthreads();
    const u32 bits = sent_to;
    for (u32 r = 0; r < a.nranks; ++r)
      if ((bits >> r) & 1u) {
        if (!block_wait_at_least(a, ctrl_of(a, a.rank, c, r) + kCtrlTail, pos[r] + 1)) return;
      }
    const bf16* b0 = reinterpret_cast<const bf16*>(a.bias0);
    const bf16* b1 = reinterpret_cast<const bf16*>(a.bias1);
    bf16* out = reinterpret_cast<bf16*>(a.combined) + static_cast<u64>(t) * elems;
    for (u64 j = threadIdx.x; j < elems; j += blockDim.x) {
      const u64 at = static_cast<u64>(t) * elems + j;
      float v = (b0 != nullptr ? to_float(b0[at]) : 0.0f) + (b1 != nullptr ? to_float(b1[at]) : 0.0f);
      for (u32 r = 0; r < a.nranks; ++r)
        if ((bits >> r) & 1u) v += to_float(reinterpret_cast<const bf16*>(slot_of(a, a.rank, c, r, pos[r]))[j]);
      out[j] = FromFloat<bf16>::apply(v);
    }
    if (a.combined_weights != nullptr) {
      for (u32 k = threadIdx.x; k < a.num_topk; k += blockDim.x) {
        float w = 0.0f;
        for (u32 r = 0; r < a.nranks; ++r)
          if ((bits >> r) & 1u)
            w += reinterpret_cast<const float*>(slot_of(a, a.rank, c, r, pos[r]) + a.hidden_bytes)[k];
        a.combined_weights[static_cast<u64>(t) * a.num_topk + k] = w;
      }
    }
    __syncthreads();
    if (threadIdx.x < a.nranks && ((bits >> threadIdx.x) & 1u)) {
      pos[threadIdx.x] += 1;
      atomic_store_release_sys(ctrl_of(a, a.rank, c, threadIdx.x) + kCtrlHead, pos[threadIdx.x]);
    }
    __syncthreads();
  }
}

// Grid: num_channels * nranks sender blocks (channel, destination), then num_channels receivers.
extern "C" __global__ void ep_combine(EpArgs a) {
  wait_prior_grids();
  if (block_aborted(a.error_word)) return;
  const u32 rings = a.num_channels * a.nranks;
  if (blockIdx.x < rings) {
    combine_send(a, blockIdx.x / a.nranks, blockIdx.x % a.nranks);
  } else {
    combine_recv(a, blockIdx.x - rings);
  }
}
