// mscclpp-rs native all-to-all family (see collective_common.cuh for the shared conventions).
// Byte-oriented: one unit serves every data type, and all-to-all, all-to-all-v, gather and scatter
// are the same exchange with different (count, displacement) tables.
//
// alltoallv_zero_copy (registered outputs): every rank pushes, with SM stores over NVLink, the bytes
// it sends to each rank straight into that rank's output.
//   1. Each block writes this rank's receive table (how many bytes it expects from each rank and where
//      they go in its output) into its own slot of this rank's table scratch, which every peer maps.
//   2. Start barrier (publishing): the tables are visible, and every output may be written.
//   3. Per destination (self first, then rank + 1, ...), the block reads the destination's table from
//      its own slot, checks that the destination expects exactly the bytes this rank sends (else
//      records kErrorCountMismatch and sends nothing to it), and copies its share of the chunk.
//   4. End barrier (publishing): every rank's output is complete before its kernel ends, and no rank
//      overwrites its table (next call) before every peer's same-numbered block read it.
// Block b only ever reads slot b of a peer's table, and the end barrier of block b orders those reads
// before the peer's next write of slot b, so the tables need no per-call flag.
// Every rank must launch the same grid (blocks pair up with the peers' same-numbered blocks).

using namespace mscclpp;
using namespace mscclpp::coll;

// What one rank expects from every rank, by source rank, in bytes. Mirrored by
// mscclpp_kernels_cu::alltoall::RecvTable.
struct RecvTable {
  u64 counts[kMaxRanks];
  u64 displs[kMaxRanks];
};

// The one kernel argument. Mirrored by mscclpp_kernels_cu::alltoall::AlltoallArgs (424 bytes; the
// static_asserts the NVRTC test generates from the Rust layout check every offset).
struct AlltoallArgs {
  const u8* input;
  PeerPtrs outputs;  // every rank's output, mapped here
  PeerPtrs tables;   // every rank's RecvTable[kMaxAlltoallBlocks] scratch, mapped here
  u64 send_counts[kMaxRanks];
  u64 send_displs[kMaxRanks];
  u64 recv_counts[kMaxRanks];
  u64 recv_displs[kMaxRanks];
  const D2DSemaphoreHandle* sems;  // sems[b * (nranks - 1) + i]
  u32* error_word;
  u64 max_spin;  // reserved for waits of future protocols; the semaphores carry their own bound
  u32 rank;
  u32 nranks;
};

// Largest grid of alltoallv_zero_copy (slots per rank in the table scratch). Mirrored by
// mscclpp_kernels_cu::alltoall::MAX_ALLTOALL_BLOCKS.
constexpr u32 kMaxAlltoallBlocks = 128;

extern "C" __global__ void __launch_bounds__(1024, 1) alltoallv_zero_copy(AlltoallArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  const u32 npeers = args.nranks - 1;
  RecvTable* mine = reinterpret_cast<RecvTable*>(args.tables.p[args.rank]) + blockIdx.x;
  for (u32 r = threadIdx.x; r < args.nranks; r += blockDim.x) {
    mine->counts[r] = args.recv_counts[r];
    mine->displs[r] = args.recv_displs[r];
  }
  if (!block_barrier(args.sems, npeers, true)) return;
  for (u32 i = 0; i < args.nranks; ++i) {
    const u32 dst = (args.rank + i) % args.nranks;
    const RecvTable* theirs = reinterpret_cast<const RecvTable*>(args.tables.p[dst]) + blockIdx.x;
    const u64 bytes = args.send_counts[dst];
    if (theirs->counts[args.rank] != bytes) {
      if (threadIdx.x == 0) record_error(args.error_word, kErrorCountMismatch);
      continue;
    }
    u64 begin, end;
    block_range(bytes, 16, begin, end);
    u8* out = static_cast<u8*>(args.outputs.p[dst]) + theirs->displs[args.rank];
    copy(out + begin, args.input + args.send_displs[dst] + begin, end - begin, threadIdx.x, blockDim.x);
  }
  block_barrier(args.sems, npeers, true);
}

// ------------------------------------------------------------------------------------------------
// alltoallv_device_counts (MoE routing: counts decided on the device, registered outputs): the same
// exchange as alltoallv_zero_copy, but each rank gives only its send counts, in device memory, and
// both sides are packed in rank order. Each block publishes this rank's send counts (bytes) and its
// output capacity in its table slot (counts[], displs[0]); after the start barrier every rank knows
// every rank's counts, so rank r's bytes for rank d land in d's output after those of ranks < r.
// Block 0 writes what this rank receives from each rank (in units) to `recv_counts`, for the caller.
// A destination whose incoming total exceeds its capacity (or a sender whose counts exceed its
// input) gets nothing from anyone and kErrorCountMismatch is recorded; nothing hangs.
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
  u32* error_word;
  u64 max_spin;  // reserved, as in AlltoallArgs
  u32 rank;
  u32 nranks;
};

extern "C" __global__ void __launch_bounds__(1024, 1) alltoallv_device_counts(AlltoallDeviceArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  const u32 n = args.nranks, rank = args.rank, npeers = n - 1;
  RecvTable* mine = reinterpret_cast<RecvTable*>(args.tables.p[rank]) + blockIdx.x;
  for (u32 r = threadIdx.x; r < n; r += blockDim.x) mine->counts[r] = args.send_counts[r] * args.unit_bytes;
  if (threadIdx.x == 0) mine->displs[0] = args.output_bytes;
  if (!block_barrier(args.sems, npeers, true)) return;
  auto table = [&](u32 r) { return reinterpret_cast<const RecvTable*>(args.tables.p[r]) + blockIdx.x; };
  if (blockIdx.x == 0) {
    for (u32 s = threadIdx.x; s < n; s += blockDim.x) args.recv_counts[s] = table(s)->counts[rank] / args.unit_bytes;
  }
  u64 send_off = 0;
  for (u32 d = 0; d < n; ++d) {
    const u64 bytes = mine->counts[d];
    u64 recv_off = 0, total = 0;
    for (u32 s = 0; s < n; ++s) {
      const u64 c = table(s)->counts[d];
      if (s < rank) recv_off += c;
      total += c;
    }
    if (total > table(d)->displs[0] || send_off + bytes > args.input_bytes) {
      if (threadIdx.x == 0) record_error(args.error_word, kErrorCountMismatch);
    } else {
      u64 begin, end;
      block_range(bytes, 16, begin, end);
      u8* out = static_cast<u8*>(args.outputs.p[d]) + recv_off;
      copy(out + begin, args.input + send_off + begin, end - begin, threadIdx.x, blockDim.x);
    }
    send_off += bytes;
  }
  block_barrier(args.sems, npeers, true);
}

// ------------------------------------------------------------------------------------------------
// alltoall_packet (small messages, any buffers): chunk d of every rank's input goes, in LL128 lines
// (packet.cuh), into slot `rank` of the current half of rank d's scratch; each rank unpacks slot s
// of its own scratch into chunk s of its output. No semaphores, no barriers: the lines' flags are
// the only synchronisation, and parity double buffering (call count) keeps one call's lines from
// overwriting those of the call before, for the reason given at allgather_packet: a rank that
// starts call N+2 has finished call N+1, so every peer has sent it call N+1's lines, which each peer
// sends only after its call-N kernel (all its reads of that half) ended.
// Own chunk: copied directly. In place is not supported (the host refuses it).
// ------------------------------------------------------------------------------------------------

// The one argument of alltoall_packet. Mirrored by mscclpp_kernels_cu::alltoall::AlltoallPacketArgs.
struct AlltoallPacketArgs {
  const u8* input;
  u8* output;
  u64 bytes;             // per chunk (input and output hold nranks chunks)
  PeerPtrs peer_scratch; // every rank's scratch mapped here
  const u8* local_scratch;
  u64 slot_bytes;        // >= LL128::lines(bytes) * 128; scratch = 2 halves x nranks slots
  CallState* state;
  u32* error_word;
  u64 max_spin;
  u32 rank;
  u32 nranks;
};

extern "C" __global__ void __launch_bounds__(1024, 1) alltoall_packet(AlltoallPacketArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  const u64 calls = load_call_count(args.state);
  const u64 flag = call_flag(calls);
  const u32 rank = args.rank, nranks = args.nranks, npeers = nranks - 1;
  const u64 bytes = args.bytes;
  const u64 half = (calls & 1) * nranks * args.slot_bytes;
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
