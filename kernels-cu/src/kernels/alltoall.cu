// mscclpp-rs native all-to-all family (see collective_common.cuh for the shared conventions).
// Byte-oriented: one unit serves every data type, and all-to-all, all-to-all-v, gather and scatter
// are the same exchange with different (count, displacement) tables.
//
// alltoallv_zero_copy (push: registered outputs) and alltoallv_zero_copy_pull (pull: registered
// inputs): with SM loads and stores over NVLink, every rank moves the bytes between itself and
// each peer straight between the sender's input and the receiver's output (alltoallv_zero_copy_swap,
// below, swaps in place).
//   1. Each block writes this rank's table (the bytes it sends to and expects from every rank, and
//      the displacements of its registered side) into its own slot of this rank's table space,
//      which every peer maps.
//   2. Start barrier (publishing): the tables are visible, and every registered buffer may be used.
//   3. Every block checks the whole count matrix (sender s's send[d] against receiver d's recv[s])
//      from its own slot of every table. Every block of every rank reads the same tables, so all
//      reach the same verdict: either every pair agrees and the data moves, or nothing moves
//      anywhere and every rank records kErrorCountMismatch (and the first disagreement, row-major
//      by (sender, receiver), in its AlltoallState for the host to name the two ranks).
//   4. Per peer (self first, then rank + 1, ...) the block copies its share of the chunk: push
//      stores into the peer's output at the peer's receive displacement; pull loads from the
//      peer's input at the peer's send displacement.
//   5. End barrier (publishing), always, also after a mismatch: every rank's output is complete and
//      every pull is done before any kernel ends, and no rank overwrites its table (next call)
//      before every peer's same-numbered block read it. A failed call records its error only
//      after the last block of its grid passed this barrier (finish_failed_call): a block that saw
//      the error word set at its entry would return and leave the peers' blocks waiting.
// Block b only ever reads slot b of a peer's table, and the end barrier of block b orders those reads
// before the peer's next write of slot b, so the tables need no per-call flag.
// Every rank must launch the same grid (blocks pair up with the peers' same-numbered blocks).

using namespace mscclpp;
using namespace mscclpp::coll;

// What one rank publishes for one exchange, by rank, in bytes. Mirrored by
// mscclpp_kernels_cu::alltoall::ExchangeTable.
struct ExchangeTable {
  u64 send[kMaxRanks];    // bytes this rank sends to each rank
  u64 recv[kMaxRanks];    // bytes this rank expects from each rank
  u64 displs[kMaxRanks];  // where in its registered side: receive (push) or send (pull) displacements
};

// The first disagreement a call found. kAnyRank stands for every rank of that side together.
// Mirrored by mscclpp_kernels_cu::alltoall::CountMismatch.
struct CountMismatch {
  u32 sender;
  u32 receiver;
  u64 sent;
  u64 expected;
};
constexpr u32 kAnyRank = 0xFFFFFFFFu;

// Per-rank state of the exchange kernels (zeroed by the host at setup). Mirrored by
// mscclpp_kernels_cu::alltoall::AlltoallState.
struct AlltoallState {
  u32 finished;  // blocks of the failing call that are done (reset by the last one)
  u32 found;     // 1 once `mismatch` holds a report
  CountMismatch mismatch;
};

// The one kernel argument. Mirrored by mscclpp_kernels_cu::alltoall::AlltoallArgs (432 bytes; the
// static_asserts the NVRTC test generates from the Rust layout check every offset).
struct AlltoallArgs {
  u8* local;        // this rank's input (push) or output (pull)
  PeerPtrs remote;  // every rank's registered output (push) or input (pull), mapped here
  PeerPtrs tables;  // every rank's ExchangeTable[kMaxAlltoallBlocks] space, mapped here
  u64 send_counts[kMaxRanks];
  u64 send_displs[kMaxRanks];
  u64 recv_counts[kMaxRanks];
  u64 recv_displs[kMaxRanks];
  const D2DSemaphoreHandle* sems;  // sems[b * (nranks - 1) + i]
  AlltoallState* state;
  u32* error_word;
  u64 max_spin;  // reserved for waits of future protocols; the semaphores carry their own bound
  u32 rank;
  u32 nranks;
};

// Largest grid of the exchange kernels (slots per rank in the table space). Mirrored by
// mscclpp_kernels_cu::alltoall::MAX_ALLTOALL_BLOCKS.
constexpr u32 kMaxAlltoallBlocks = 128;

// This block's slot of rank r's table.
MSCCLPP_DEVICE_INLINE ExchangeTable* table_of(const PeerPtrs& tables, u32 r) {
  return reinterpret_cast<ExchangeTable*>(tables.p[r]) + blockIdx.x;
}

// Every block of a call that found a mismatch calls this after its end barrier; the last block of
// the grid to arrive records the error (see step 5 above) and resets the count for the next call.
MSCCLPP_DEVICE_INLINE void finish_failed_call(AlltoallState* state, u32* error_word) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&state->finished, 1u) == gridDim.x - 1) {
      state->finished = 0;
      record_error(error_word, kErrorCountMismatch);
    }
  }
}

// Block 0 stores the call's first disagreement (every rank stores the same one).
MSCCLPP_DEVICE_INLINE void report_mismatch(AlltoallState* state, u32 sender, u32 receiver, u64 sent, u64 expected) {
  state->mismatch = CountMismatch{sender, receiver, sent, expected};
  __threadfence_system();
  state->found = 1;
}

// How an exchange moves the bytes between a pair of ranks (steps 4 above and "swap" below).
enum class Move { kPush, kPull, kSwap };

template <Move kMove>
MSCCLPP_DEVICE_INLINE void exchange(const AlltoallArgs& args) {
  constexpr bool kPull = kMove == Move::kPull;
  const u32 n = args.nranks, rank = args.rank, npeers = n - 1;
  ExchangeTable* mine = table_of(args.tables, rank);
  for (u32 r = threadIdx.x; r < n; r += blockDim.x) {
    mine->send[r] = args.send_counts[r];
    mine->recv[r] = args.recv_counts[r];
    mine->displs[r] = kPull ? args.send_displs[r] : args.recv_displs[r];
  }
  if (!block_barrier(args.sems, npeers, true)) return;
  // The whole matrix, so that every rank reaches the same verdict (step 3).
  __shared__ u32 first;
  if (threadIdx.x == 0) first = kAnyRank;
  __syncthreads();
  for (u32 x = threadIdx.x; x < n * n; x += blockDim.x) {
    if (table_of(args.tables, x / n)->send[x % n] != table_of(args.tables, x % n)->recv[x / n]) atomicMin(&first, x);
  }
  __syncthreads();
  const bool mismatch = first != kAnyRank;
  if (mismatch) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      const u32 s = first / n, d = first % n;
      report_mismatch(args.state, s, d, table_of(args.tables, s)->send[d], table_of(args.tables, d)->recv[s]);
    }
  } else {
    for (u32 i = 0; i < n; ++i) {
      const u32 peer = (rank + i) % n;
      const u64 theirs = table_of(args.tables, peer)->displs[rank];
      if (kMove == Move::kSwap) {
        // This rank's region for the peer holds what it sends there and receives what the peer
        // sends back (the counts agree both ways, as the check above proved). The pair splits it:
        // the lower rank swaps the first half, the higher one the rest, so every byte has one owner.
        if (peer == rank) continue;
        const u64 bytes = args.send_counts[peer], half = (bytes / 2) & ~u64{15};
        const u64 from = rank < peer ? 0 : half, to = rank < peer ? half : bytes;
        u64 begin, end;
        block_range(to - from, 16, begin, end);
        swap_copy(args.local + args.send_displs[peer] + from + begin,
                  static_cast<u8*>(args.remote.p[peer]) + theirs + from + begin, end - begin, threadIdx.x, blockDim.x);
        continue;
      }
      const u64 bytes = kPull ? args.recv_counts[peer] : args.send_counts[peer];
      u64 begin, end;
      block_range(bytes, 16, begin, end);
      u8* remote = static_cast<u8*>(args.remote.p[peer]) + theirs;
      u8* dst = kPull ? args.local + args.recv_displs[peer] : remote;
      const u8* src = kPull ? remote : args.local + args.send_displs[peer];
      copy(dst + begin, src + begin, end - begin, threadIdx.x, blockDim.x);
    }
  }
  block_barrier(args.sems, npeers, true);
  if (mismatch) finish_failed_call(args.state, args.error_word);
}

extern "C" __global__ void __launch_bounds__(1024, 1) alltoallv_zero_copy(AlltoallArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  exchange<Move::kPush>(args);
}

extern "C" __global__ void __launch_bounds__(1024, 1) alltoallv_zero_copy_pull(AlltoallArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  exchange<Move::kPull>(args);
}

// alltoallv_zero_copy_swap (in place beyond the all-to-all stage, every rank in place): the same
// exchange over the registered buffers, each being its rank's input and output at once, with
// each region a rank holds for a peer swapped with the peer's region for it. Every byte of a pair
// is loaded on both sides by one thread of one of the two ranks before it stores either (swap_copy),
// so nothing is overwritten before it is read, and neither rank stages anything; the start and end
// barriers order the swaps after both ranks' earlier work and before their next.
extern "C" __global__ void __launch_bounds__(1024, 1) alltoallv_zero_copy_swap(AlltoallArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  exchange<Move::kSwap>(args);
}

// ------------------------------------------------------------------------------------------------
// alltoallv_device_counts (MoE routing: counts decided on the device, registered outputs): the same
// exchange as alltoallv_zero_copy, but each rank gives only its send counts, in device memory, and
// both sides are packed in rank order. Each block publishes this rank's send counts (bytes), its
// output capacity (displs[0]) and its input size (displs[1]) in its table slot; after the start
// barrier every rank knows every rank's counts, so rank r's bytes for rank d land in d's output
// after those of ranks < r. Block 0 writes what this rank receives from each rank (in units) to
// `recv_counts`, for the caller. Every rank checks every rank's totals: if any receiver's incoming
// total exceeds its capacity, or any sender's counts exceed its input, nothing moves anywhere and
// every rank records kErrorCountMismatch after the end barrier, as in alltoallv_zero_copy.
// ------------------------------------------------------------------------------------------------

// Mirrored by mscclpp_kernels_cu::alltoall::AlltoallDeviceArgs.
struct AlltoallDeviceArgs {
  const u8* input;
  u64 input_bytes;
  PeerPtrs outputs;
  PeerPtrs tables;
  const u64* send_counts;  // device, nranks entries, in units of unit_bytes
  u64* recv_counts;        // device, nranks entries, written by the kernel (units)
  u64 unit_bytes;
  u64 output_bytes;        // this rank's output capacity
  const D2DSemaphoreHandle* sems;
  AlltoallState* state;
  u32* error_word;
  u64 max_spin;  // reserved, as in AlltoallArgs
  u32 rank;
  u32 nranks;
};

extern "C" __global__ void __launch_bounds__(1024, 1) alltoallv_device_counts(AlltoallDeviceArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  const u32 n = args.nranks, rank = args.rank, npeers = n - 1;
  ExchangeTable* mine = table_of(args.tables, rank);
  for (u32 r = threadIdx.x; r < n; r += blockDim.x) mine->send[r] = args.send_counts[r] * args.unit_bytes;
  if (threadIdx.x == 0) {
    mine->displs[0] = args.output_bytes;
    mine->displs[1] = args.input_bytes;
  }
  if (!block_barrier(args.sems, npeers, true)) return;
  auto table = [&](u32 r) { return table_of(args.tables, r); };
  if (blockIdx.x == 0) {
    for (u32 s = threadIdx.x; s < n; s += blockDim.x) args.recv_counts[s] = table(s)->send[rank] / args.unit_bytes;
  }
  // Rank r's totals: what it receives (against its capacity) and sends (against its input).
  auto totals = [&](u32 r, u64& in, u64& out) {
    in = out = 0;
    for (u32 k = 0; k < n; ++k) {
      in += table(k)->send[r];
      out += table(r)->send[k];
    }
  };
  // First failing check, as 2 * rank (capacity) or 2 * rank + 1 (input).
  __shared__ u32 first;
  if (threadIdx.x == 0) first = kAnyRank;
  __syncthreads();
  for (u32 r = threadIdx.x; r < n; r += blockDim.x) {
    u64 in, out;
    totals(r, in, out);
    if (in > table(r)->displs[0]) atomicMin(&first, 2 * r);
    if (out > table(r)->displs[1]) atomicMin(&first, 2 * r + 1);
  }
  __syncthreads();
  const bool mismatch = first != kAnyRank;
  if (mismatch) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      const u32 r = first / 2;
      u64 in, out;
      totals(r, in, out);
      if (first % 2 == 0) {
        report_mismatch(args.state, kAnyRank, r, in, table(r)->displs[0]);
      } else {
        report_mismatch(args.state, r, kAnyRank, out, table(r)->displs[1]);
      }
    }
  } else {
    u64 send_off = 0;
    for (u32 d = 0; d < n; ++d) {
      const u64 bytes = mine->send[d];
      u64 recv_off = 0;
      for (u32 s = 0; s < rank; ++s) recv_off += table(s)->send[d];
      u64 begin, end;
      block_range(bytes, 16, begin, end);
      u8* out = static_cast<u8*>(args.outputs.p[d]) + recv_off;
      copy(out + begin, args.input + send_off + begin, end - begin, threadIdx.x, blockDim.x);
      send_off += bytes;
    }
  }
  block_barrier(args.sems, npeers, true);
  if (mismatch) finish_failed_call(args.state, args.error_word);
}

// ------------------------------------------------------------------------------------------------
// alltoall_packet (small messages, any buffers): chunk d of every rank's input goes, in LL128 lines
// (packet.cuh), into slot `rank` of the current half of rank d's LL128 part of the collection's
// scratch; each rank unpacks slot s of its own part into chunk s of its output. No semaphores, no
// barriers: the lines' flags are the only synchronisation, and the halves alternate by the parity of
// the collection's shared call counter, which keeps one call's lines from overwriting those a peer
// still reads, for the reason given at mscclpp_collectives::resources::CollectionResources.
// Own chunk: copied directly. In place works as it is: a lane's stores into the output (line j of
// chunk s) are the words it loaded from the input for line j of chunk s in the send loop before
// (the same lanes take the same (peer, line) in both loops, and the same alignment), no peer
// writes this rank's output, and the own chunk copies onto itself.
// ------------------------------------------------------------------------------------------------

// The one argument of alltoall_packet. Mirrored by mscclpp_kernels_cu::alltoall::AlltoallPacketArgs.
struct AlltoallPacketArgs {
  const u8* input;
  u8* output;
  u64 bytes;             // per chunk (input and output hold nranks chunks)
  PeerPtrs peer_scratch; // every rank's scratch mapped here
  const u8* local_scratch;
  u64 slot_bytes;        // >= LL128::lines(bytes) * 128; nranks slots per half
  u64 half_bytes;        // offset of the second half (>= nranks * slot_bytes)
  CallState* state;      // the collection's shared call counter
  u32* error_word;
  u64 max_spin;
  u32 rank;
  u32 nranks;
};

extern "C" __global__ void __launch_bounds__(1024, 1) alltoall_packet(AlltoallPacketArgs args) {
  wait_prior_grids();
  u64 calls;
  if (block_enter(args.error_word, args.state, calls)) return;
  const u64 flag = call_flag(calls);
  const u32 rank = args.rank, nranks = args.nranks, npeers = nranks - 1;
  const u64 bytes = args.bytes;
  const u64 half = (calls & 1) * args.half_bytes;
  const u64 nlines = LL128::lines(bytes);
  const u64 total = npeers * nlines;
  const LineLanes me;
  const u32 t = me.t;
  // Send: line j of chunk d -> slot `rank` of rank d's current half.
  for (u64 x = me.first + me.sub; x < total; x += me.stride) {
    const u32 d = peer_rank(static_cast<u32>(x / nlines), rank);
    const u64 j = x % nlines;
    const u8* src = args.input + static_cast<u64>(d) * bytes;
    u8* line = static_cast<u8*>(args.peer_scratch.p[d]) + half + static_cast<u64>(rank) * args.slot_bytes +
               j * LL128::kLineBytes;
    LL128::send(line, src, bytes, reinterpret_cast<u64>(src) % 8 == 0, j, t, flag);
  }
  // Own chunk.
  u64 begin, end;
  block_range(bytes, 16, begin, end);
  const u64 own = static_cast<u64>(rank) * bytes;
  copy(args.output + own + begin, args.input + own + begin, end - begin, threadIdx.x, blockDim.x);
  // Receive: one warp-uniform loop over (peer index, line) (reads vote).
  const u8* scratch = args.local_scratch + half;
  bool ok = true;
  for (u64 base = me.first; ok && base < total; base += me.stride) {
    const u64 x = base + me.sub;
    const bool active = x < total;
    const u32 s = peer_rank(static_cast<u32>(min(x, total - 1) / nlines), rank);
    const u64 j = x % nlines;
    u64 a = 0, b = 0;
    ok = LL128::read(scratch + s * args.slot_bytes + j * LL128::kLineBytes, t, active, flag, a, b, args.max_spin,
                     args.error_word);
    if (ok && active) {
      u8* dst = args.output + static_cast<u64>(s) * bytes;
      LL128::unpack(dst, bytes, reinterpret_cast<u64>(dst) % 8 == 0, j, t, a, b);
    }
  }
  finish_call(args.state, calls);
}
