// mscclpp-rs point-to-point engine (collectives/src/p2p): one kernel runs one NCCL-style group of
// sends and receives to many peers, on any (unregistered) buffers. `p2p_group` runs where every
// peer's memory is mapped (one host; described first); `p2p_port_group` moves the data through
// PortChannels, across hosts (see "Across hosts" at its definition).
//
// Channels. Every ordered pair (sender s, receiver r) has a channel in r's engine region, which every
// rank maps: `slots` slots of `slot_bytes` data each, plus a 16-byte header per slot (ready, bytes).
// The sender writes chunk g of the channel (g counts chunks over the channel's whole life) into slot
// g % slots, then the message's word (its seq and byte count, as in a post) into the header and
// `ready = g + 1` with a release store. The receiver waits for `ready >= g + 1`, checks the header's
// word against its own message's, copies the chunk out, and returns the slot's credit by storing `ack = g + 1` into the sender's region. The
// sender reuses a slot for chunk g only once `ack + slots > g` (chunk g - slots was copied out).
// A message of n bytes is max(1, ceil(n / slot_bytes)) chunks, so a zero-byte message still matches.
//
// Order. The k-th send from s to r matches r's k-th receive from s because both sides number the
// channel's messages and chunks from device-resident counters (P2pState) that the kernel itself
// advances at its end, so graph replays stay in step with no host involvement. Every counter has
// kP2pCounterSlots copies, one per block index (as the collectives' call counts, finish_call): block
// b reads copy b at its entry and, at its end, writes the advanced counters of the group's channels
// into every copy k = b mod gridDim.x, so the next kernel, with any grid, finds the new counts in
// every copy. No block waits for another at the end: the last-block count this replaced (a device
// fence and an atomic after every block's work) cost time on every call at every size.
// Within a group the host gives each op its offsets (msg_offset, chunk_offset) after the earlier
// ops of the same (peer, direction).
//
// Size check on both sides. The receiver posts what it expects, (message seq, bytes), into the
// sender's region at the start of each receive (`posts`, a ring of kP2pPosts entries per peer). The
// receiver compares the header's word with its own on every chunk, in every block, before it copies
// anything of it: a chunk of a message of another size, or of another message (the sender's had fewer
// chunks), is never copied, whichever block meets it first. The sender, after writing
// its last chunk, compares with the receiver's post of that message if it comes within
// kP2pPostGraceNs (and while waiting for slot credit it gives up as soon as a mismatching post is
// there, so a message larger than the slots is always checked on both sides; a chunk it gives up on
// while its slot is free still gets its header, without data, so the receiver names the mismatch too
// instead of waiting out its timeout). Either side that finds a
// mismatch fills the engine's host-mapped P2pMismatch record (peer and both counts) and records
// kErrorCountMismatch; the receiver never copies a chunk whose header disagrees, so nothing of a
// mismatched message is written. The ring cannot lap: the host caps the ops per (peer, direction) of one
// group at kP2pMaxOps and kP2pPosts > 2 * kP2pMaxOps, while a receiver can post at most one group
// ahead of the sender it waits for.
//
// Blocks. The host gives every op its own blocks (first_block, nblocks; 1 to `slots / 2` of them):
// ops never wait for one another inside a kernel, so any set of groups that NCCL completes completes
// here. Block j of an op handles chunks j, j + nblocks, ..., so with slots / 2 blocks each block
// alternates between two slots and fills one while the receiver drains the other. A self op (copy) splits its bytes among
// its blocks. Every wait is spin_until (bounded, error word, wait budget). Every decision a block
// acts on is thread 0's, shared (p2p_block_agrees, block_aborted): a block whose warps read the error
// word apart once split around two barriers, and the warps that missed the error copied their share
// of a chunk whose mismatch thread 0 had seen.
//
// Zero copy (large messages). The slots bound a channel to its chunks in flight (a round trip each),
// so a message of 1 MiB or more goes straight into the receiver's buffer once the sender has it
// mapped. The receiver's host registers the buffer's allocation and offers it to the sender's host
// (bootstrap), which maps it, writes its address, tagged with the offer's key, into the engine's
// pinned host table (`zc_staging[peer][key % kP2pZcEntries]`) and answers. The first send that
// needs the key copies the entry into the device table (P2pState::zc_table, zeroed with the
// engine), where later sends read it: a kernel's read of host memory is a slow PCIe round trip,
// paid once per key that way. A key whose allocation was freed gives its entry to a later key: a send whose
// word's key has another tag than both tables' entries takes the slots. No stream operation is
// involved, so the handshake also completes while a graph is being captured (the receiver's host
// then waits for the answer a bounded time; collectives/src/p2p/zero_copy.rs). From then on the
// receiver's host gives its receives into that allocation a word of key and offset (`aux`) when
// the receive is the only op of its channel in the group, and the sender's host marks its large
// sends to a peer of which it mapped a buffer (`aux` = 1).
//
// Every receive stores its word (0: slots) into the channel's P2pZeroCopy entry in the sender's
// region before it posts; one with a word first sets its own `done` to p2p_post(msg, 0). A marked
// send waits for the receiver's post; if the word is set, its table entry is there and the sizes
// agree, each of its blocks writes its share of the message into the mapped buffer, fences, and
// adds its byte count to the receiver's `done`. Otherwise it takes the slots as any send. The
// receiver's blocks wait until `done` is p2p_post(msg, bytes) (the tag keeps an earlier message's
// count from passing) or until the header of their first chunk arrives, and then take the slots
// too, so both sides always agree (a sender of another size also publishes that header: both
// sides name the mismatch). After a zero-copy message block 0 returns the credits of every slot
// its chunks map to: the message consumes its chunk numbers as any other, so the counters never
// depend on the path taken, and every earlier chunk of the channel was received, and credited, by
// an earlier kernel, since the receive is its channel's only op in its group. For the same reason
// one word per channel is enough: the receiver posts nothing more on the channel before the
// sender, which read the word before it wrote anything, has delivered the message.

#include "mscclpp/port_channel.cuh"

using namespace mscclpp;
using namespace mscclpp::coll;

// Most ops one kernel takes (the argument struct carries them by value). Mirrored by
// mscclpp_kernels_cu::p2p::MAX_OPS.
constexpr u32 kP2pMaxOps = 64;
// Entries of each peer's post ring. Mirrored by mscclpp_kernels_cu::p2p::POSTS.
constexpr u32 kP2pPosts = 256;

// How long a send waits at its end for the receiver's post of the message (see p2p_send).
constexpr u64 kP2pPostGraceNs = 1000000;

// Entries of each peer's zero-copy table: registrations of one engine in use at once (key k takes
// entry k % kP2pZcEntries), and the tags that tell the keys of an entry apart. Mirrored by
// mscclpp_kernels_cu::p2p::ZC_ENTRIES and ZC_TAGS.
constexpr u32 kP2pZcEntries = 32;
constexpr u32 kP2pZcTags = 0xFFFF;

constexpr u32 kP2pSend = 0;
constexpr u32 kP2pRecv = 1;
constexpr u32 kP2pCopy = 2;

// Copies of every counter (see Order above): the largest grid of a p2p_group launch. Mirrored by
// mscclpp_kernels_cu::p2p::COUNTER_SLOTS.
constexpr u32 kP2pCounterSlots = 128;

// One op of a group. Mirrored by mscclpp_kernels_cu::p2p::P2pOpArgs (56 bytes).
struct P2pOpArgs {
  u64 ptr;           // send: source; recv and copy: destination
  u64 aux;           // copy: source; recv: a zero-copy word or 0; send: 1 if it may go zero copy
  u64 bytes;
  u64 chunk_offset;  // chunks of the earlier ops of this (peer, direction) in the group
  u32 kind;          // kP2pSend, kP2pRecv, kP2pCopy
  u32 peer;
  u32 first_block;
  u32 nblocks;
  u32 msg_offset;    // earlier ops of this (peer, direction) in the group
  u32 last;          // 1: no later op of the group has this (peer, direction)
};

// Device-resident state of one engine (private memory, zero at creation): per peer, the counters
// of send messages, send chunks, receive messages, receive chunks, each in kP2pCounterSlots copies;
// and the zero-copy table, per peer rank and key the peer's offered buffer as mapped here (0: not
// mapped; written by the host only). Mirrored by mscclpp_kernels_cu::p2p::P2pState.
struct P2pState {
  u64 counters[kMaxRanks][4][kP2pCounterSlots];
  u64 zc_table[kMaxRanks][kP2pZcEntries];
};

// `theirs` of a receive that met a chunk of another message: the peer's message has another chunk
// count, its size is not in the chunk. Mirrored by mscclpp_kernels_cu::p2p::OTHER_SIZE.
constexpr u64 kP2pOtherSize = ~0ull;

// Host-mapped record of the first size mismatch this rank saw. Mirrored by
// mscclpp_kernels_cu::p2p::P2pMismatch.
struct P2pMismatch {
  u32 claimed;  // 0 until a mismatch is recorded (first one wins)
  u32 is_send;  // 1: this rank's send, 0: its receive
  u64 peer;
  u64 mine;     // this rank's byte count
  u64 theirs;   // the peer's, or kP2pOtherSize
};

// The one kernel argument. Mirrored by mscclpp_kernels_cu::p2p::P2pArgs.
struct P2pArgs {
  PeerPtrs regions;     // every rank's engine region, mapped here
  u8* local;            // this rank's region
  P2pState* state;
  P2pMismatch* mismatch;
  u32* error_word;
  u64 max_spin;
  u64 slot_bytes;       // data bytes per slot, a multiple of 16
  u64 headers_offset;   // region offsets (bytes) of the slot headers, the acks and the posts
  u64 acks_offset;
  u64 posts_offset;
  u64 zc_offset;        // region offset of the P2pZeroCopy entries, one per peer index
  const u64* zc_staging;  // host-mapped [kMaxRanks][kP2pZcEntries]: the host's table (see Zero copy)
  u32 slots;
  u32 rank;
  u32 nranks;
  u32 nops;
  P2pOpArgs ops[kP2pMaxOps];
};

struct P2pSlotHeader {
  u64 ready;    // chunk sequence + 1 of the data in the slot
  u64 message;  // p2p_post(seq, bytes) of the message the chunk belongs to
};

// Zero-copy words of one channel in a rank's region, per peer index (see Zero copy above).
struct P2pZeroCopy {
  u64 word;  // written by that peer as receiver: its current post's zero-copy word (0: slots)
  u64 done;  // added to by that peer as sender: p2p_post(msg, bytes written into this rank's buffer)
};

// Index of `rank` among the peers of `owner` (the region layout is per peer index).
MSCCLPP_DEVICE_INLINE u32 p2p_peer_index(u32 rank, u32 owner) { return rank < owner ? rank : rank - 1; }

// Post (and header) word: (message seq mod 2^24 - 1) + 1 in the high 24 bits, bytes in the low 40
// (the host refuses messages of 2^40 bytes or more). Never 0, so a fresh ring holds no post.
MSCCLPP_DEVICE_INLINE u64 p2p_post(u64 msg, u64 bytes) { return ((msg % 0xFFFFFFull + 1) << 40) | bytes; }
MSCCLPP_DEVICE_INLINE bool p2p_post_is(u64 post, u64 msg) { return (post >> 40) == msg % 0xFFFFFFull + 1; }
MSCCLPP_DEVICE_INLINE u64 p2p_post_bytes(u64 post) { return post & ((1ull << 40) - 1); }

// Zero-copy word of a receive: (key + 1) in the high 24 bits, its offset in the offered allocation
// in the low 40. Built by the host (mscclpp_kernels_cu::p2p::zc_word).
MSCCLPP_DEVICE_INLINE u32 p2p_zc_key(u64 zc) { return static_cast<u32>(zc >> 40) - 1; }
MSCCLPP_DEVICE_INLINE u64 p2p_zc_offset(u64 zc) { return zc & ((1ull << 40) - 1); }
// A table entry: the tag of its key in the high 16 bits (never 0), the mapped address in the low
// 48. Built by the host (mscclpp_kernels_cu::p2p::zc_entry).
constexpr u64 kP2pZcTagMask = 0xFFFFull << 48;
MSCCLPP_DEVICE_INLINE u64 p2p_zc_tag(u32 key) { return static_cast<u64>(key % kP2pZcTags + 1) << 48; }

MSCCLPP_DEVICE_INLINE u64 p2p_chunks(u64 bytes, u64 slot_bytes) {
  return bytes == 0 ? 1 : (bytes + slot_bytes - 1) / slot_bytes;
}

// Fills the mismatch record `m` (first one wins) and raises the error word. One thread.
MSCCLPP_DEVICE_INLINE void p2p_mismatch(P2pMismatch* m, u32* error_word, bool is_send, u32 peer, u64 mine,
                                        u64 theirs) {
  if (m != nullptr && atomic_cas_relaxed_sys(&m->claimed, 0u, 1u) == 0u) {
    m->is_send = is_send ? 1u : 0u;
    m->peer = peer;
    m->mine = mine;
    m->theirs = theirs;
    fence_acq_rel_sys();
  }
  record_error(error_word, kErrorCountMismatch);
}

// Thread 0 decides, the block follows.
MSCCLPP_DEVICE_INLINE bool p2p_block_agrees(bool ok) {
  __shared__ int shared_ok;
  if (threadIdx.x == 0) shared_ok = ok ? 1 : 0;
  __syncthreads();
  const bool r = shared_ok != 0;
  __syncthreads();
  return r;
}

// A chunk in registers, kP2pWords 16-byte words a thread at most, between a load and a store that
// a block decision separates: the sender reads its source before it waits for the slot's credit,
// the receiver reads the slot while thread 0 checks the header's word, so each side's read
// overlaps the round trip it waits for instead of following it. Chunks that do not fit (a tail of
// odd bytes, a buffer not 16-byte aligned) go through copy() after the decision.
constexpr u32 kP2pWords = 2;

struct P2pWords {
  uint4 w[kP2pWords];

  MSCCLPP_DEVICE_INLINE static bool fit(const u8* dst, const u8* src, u64 n) {
    return n % 16 == 0 && n <= 16ull * kP2pWords * blockDim.x &&
           (reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src)) % 16 == 0;
  }
  MSCCLPP_DEVICE_INLINE void load(const u8* src, u64 n) {
#pragma unroll
    for (u32 k = 0; k < kP2pWords; ++k) {
      const u64 i = threadIdx.x + static_cast<u64>(k) * blockDim.x;
      if (16 * i < n) w[k] = reinterpret_cast<const uint4*>(src)[i];
    }
  }
  MSCCLPP_DEVICE_INLINE void store(u8* dst, u64 n) const {
#pragma unroll
    for (u32 k = 0; k < kP2pWords; ++k) {
      const u64 i = threadIdx.x + static_cast<u64>(k) * blockDim.x;
      if (16 * i < n) reinterpret_cast<uint4*>(dst)[i] = w[k];
    }
  }
};

// A send that may go zero copy (see Zero copy above): waits for the receiver's post of message
// `msg`; if it carries a zero-copy word for a message of this size, writes block j's share straight
// into the mapped buffer and adds its bytes to the receiver's `done` word. False: the slots carry
// the message (no word, another size, or a wait that gave up: the slot loop then names the
// mismatch, or returns at once on the recorded error).
MSCCLPP_DEVICE_INLINE bool p2p_send_zero_copy(const P2pArgs& a, const P2pOpArgs& op, u32 j, u64 msg, const u64* post,
                                              const u64* word, u64* done) {
  __shared__ u64 shared_dst;
  if (threadIdx.x == 0) {
    u64 dst = 0;
    if (spin_until([&] { return p2p_post_is(atomic_load_acquire_sys(post), msg); }, a.max_spin, a.error_word,
                   kErrorSemaphoreWaitTimeout) &&
        p2p_post_bytes(atomic_load_acquire_sys(post)) == op.bytes) {
      // The receiver stored the word before its release of the post.
      const u64 zc = atomic_load_relaxed_sys(word);
      if (zc != 0) {
        const u32 key = p2p_zc_key(zc);
        const u64 tag = p2p_zc_tag(key);
        u64* entry = &a.state->zc_table[op.peer][key % kP2pZcEntries];
        u64 e = atomic_load_relaxed_sys(entry);
        if ((e & kP2pZcTagMask) != tag) {
          // First use of the key: the host's copy, kept on the device for the next sends.
          e = atomic_load_relaxed_sys(&a.zc_staging[op.peer * kP2pZcEntries + key % kP2pZcEntries]);
          if ((e & kP2pZcTagMask) == tag) {
            atomic_store_relaxed_sys(entry, e);
          } else {
            e = 0;
          }
        }
        if (e != 0) dst = (e & ~kP2pZcTagMask) + p2p_zc_offset(zc);
      }
    }
    shared_dst = dst;
  }
  __syncthreads();
  u8* dst = reinterpret_cast<u8*>(shared_dst);
  if (dst == nullptr) return false;
  const u64 per = ((op.bytes + op.nblocks - 1) / op.nblocks + 15) / 16 * 16;
  const u64 begin = min(static_cast<u64>(j) * per, op.bytes);
  const u64 n = min(begin + per, op.bytes) - begin;
  copy(dst + begin, reinterpret_cast<const u8*>(op.ptr) + begin, n, threadIdx.x, blockDim.x);
  fence_acq_rel_sys();
  __syncthreads();
  if (threadIdx.x == 0 && n > 0) atomic_add_release_sys(done, n);
  return true;
}

// `base`: the (peer, direction) channel's messages and chunks before this group.
MSCCLPP_DEVICE_INLINE void p2p_send(const P2pArgs& a, const P2pOpArgs& op, u32 j, const u64* base) {
  const u32 peer = op.peer;
  const u64 msg = base[0] + op.msg_offset;
  const u64 first = base[1] + op.chunk_offset;
  const u64 nchunks = p2p_chunks(op.bytes, a.slot_bytes);
  const u32 me_there = p2p_peer_index(a.rank, peer), peer_here = p2p_peer_index(peer, a.rank);
  u8* remote = static_cast<u8*>(a.regions.p[peer]);
  u8* data = remote + static_cast<u64>(me_there) * a.slots * a.slot_bytes;
  P2pSlotHeader* headers = reinterpret_cast<P2pSlotHeader*>(remote + a.headers_offset) + me_there * a.slots;
  const u64* acks = reinterpret_cast<const u64*>(a.local + a.acks_offset) + peer_here * a.slots;
  const u64* post = reinterpret_cast<const u64*>(a.local + a.posts_offset) + peer_here * kP2pPosts + msg % kP2pPosts;
  // A post of this message with another count: the receiver stopped, so credit will never come.
  auto refused = [&]() {
    const u64 p = atomic_load_acquire_sys(post);
    return p2p_post_is(p, msg) && p2p_post_bytes(p) != op.bytes;
  };
  auto publish = [&](u32 slot, u64 g) {
    atomic_store_relaxed_sys(&headers[slot].message, p2p_post(msg, op.bytes));
    atomic_store_release_sys(&headers[slot].ready, g + 1);
  };
  const u8* src = reinterpret_cast<const u8*>(op.ptr);
  if (op.aux != 0) {
    const P2pZeroCopy* here = reinterpret_cast<const P2pZeroCopy*>(a.local + a.zc_offset) + peer_here;
    P2pZeroCopy* there = reinterpret_cast<P2pZeroCopy*>(remote + a.zc_offset) + me_there;
    if (p2p_send_zero_copy(a, op, j, msg, post, &here->word, &there->done)) return;
  }
  for (u64 c = j; c < nchunks; c += op.nblocks) {
    const u64 g = first + c;
    const u32 slot = static_cast<u32>(g % a.slots);
    const u64 begin = c * a.slot_bytes;
    const u64 n = min(a.slot_bytes, op.bytes - min(begin, op.bytes));
    u8* dst = data + slot * a.slot_bytes;
    const bool held = P2pWords::fit(dst, src + begin, n);
    P2pWords words;
    if (held) words.load(src + begin, n);
    bool ok = true;
    if (threadIdx.x == 0) {
      auto credit = [&] { return atomic_load_acquire_sys(&acks[slot]) + a.slots > g; };
      ok = spin_until([&] { return credit() || refused(); }, a.max_spin, a.error_word, kErrorSemaphoreWaitTimeout);
      if (ok && refused()) {
        // The receiver may have posted before any chunk came: the header alone (the slot is ours)
        // lets it see the mismatch on its side too. Its check keeps it from copying the stale data.
        if (credit()) publish(slot, g);
        p2p_mismatch(a.mismatch, a.error_word, true, peer, op.bytes, p2p_post_bytes(atomic_load_acquire_sys(post)));
        ok = false;
      }
    }
    if (!p2p_block_agrees(ok)) return;
    if (held) {
      words.store(dst, n);
    } else {
      copy(dst, src + begin, n, threadIdx.x, blockDim.x);
    }
    __syncthreads();
    if (threadIdx.x == 0) publish(slot, g);
  }
  // The size check on this side: the receiver's post of this message, waited for at most
  // kP2pPostGraceNs (a message that needed credit found it long ago). A send must not wait for its
  // receiver beyond that: NCCL completes a small send into the peer's buffer without it, and code
  // that sends before it receives on both sides relies on that. Past the grace the receiver's own
  // check stands alone.
  if (j == 0 && threadIdx.x == 0) {
    const u64 start = wall_clock_ns();
    while (!p2p_post_is(atomic_load_acquire_sys(post), msg) && wall_clock_ns() - start < kP2pPostGraceNs) {
    }
    if (refused()) {
      p2p_mismatch(a.mismatch, a.error_word, true, peer, op.bytes, p2p_post_bytes(atomic_load_acquire_sys(post)));
    }
  }
}

MSCCLPP_DEVICE_INLINE void p2p_recv(const P2pArgs& a, const P2pOpArgs& op, u32 j, const u64* base) {
  const u32 peer = op.peer;
  const u64 msg = base[0] + op.msg_offset;
  const u64 first = base[1] + op.chunk_offset;
  const u64 nchunks = p2p_chunks(op.bytes, a.slot_bytes);
  const u32 me_there = p2p_peer_index(a.rank, peer), peer_here = p2p_peer_index(peer, a.rank);
  u8* remote = static_cast<u8*>(a.regions.p[peer]);
  const u8* data = a.local + static_cast<u64>(peer_here) * a.slots * a.slot_bytes;
  const P2pSlotHeader* headers = reinterpret_cast<const P2pSlotHeader*>(a.local + a.headers_offset) + peer_here * a.slots;
  u64* acks = reinterpret_cast<u64*>(remote + a.acks_offset) + me_there * a.slots;
  u64* done = &(reinterpret_cast<P2pZeroCopy*>(a.local + a.zc_offset) + peer_here)->done;
  if (j == 0 && threadIdx.x == 0) {
    if (op.aux != 0) atomic_store_relaxed_sys(done, p2p_post(msg, 0));
    atomic_store_relaxed_sys(&(reinterpret_cast<P2pZeroCopy*>(remote + a.zc_offset) + me_there)->word, op.aux);
    u64* post = reinterpret_cast<u64*>(remote + a.posts_offset) + me_there * kP2pPosts + msg % kP2pPosts;
    atomic_store_release_sys(post, p2p_post(msg, op.bytes));
  }
  if (op.aux != 0) {
    // Zero copy offered (see Zero copy above): the sender either writes the message into the
    // output and adds its bytes to `done`, or, when it took the slots after all (a sender of
    // another size), publishes this block's first chunk, which the slot loop below then handles.
    const u64 target = p2p_post(msg, op.bytes);
    const u64 g = first + j;
    const P2pSlotHeader& header = headers[g % a.slots];
    bool zero_copied = false;
    if (threadIdx.x == 0) {
      spin_until(
          [&] {
            zero_copied = atomic_load_acquire_sys(done) == target;
            return zero_copied || atomic_load_acquire_sys(&header.ready) > g;
          },
          a.max_spin, a.error_word, kErrorSemaphoreWaitTimeout);
    }
    if (p2p_block_agrees(zero_copied)) {
      // Block 0 returns the credit of every slot the message's chunks map to, each slot's at its
      // last chunk (the sender waits for `ack + slots > g` before it reuses a slot).
      if (j == 0) {
        for (u64 s = threadIdx.x; s < min(nchunks, static_cast<u64>(a.slots)); s += blockDim.x) {
          const u64 last = first + s + (nchunks - 1 - s) / a.slots * a.slots;
          atomic_store_release_sys(&acks[last % a.slots], last + 1);
        }
      }
      return;
    }
  }
  for (u64 c = j; c < nchunks; c += op.nblocks) {
    const u64 g = first + c;
    const u32 slot = static_cast<u32>(g % a.slots);
    bool ok = true;
    if (threadIdx.x == 0) {
      ok = spin_until([&] { return atomic_load_acquire_sys(&headers[slot].ready) > g; }, a.max_spin, a.error_word,
                      kErrorSemaphoreWaitTimeout);
    }
    if (!p2p_block_agrees(ok)) return;
    // The chunk is here (thread 0's acquire, then the barrier): every thread reads its share while
    // thread 0 checks the header's word.
    const u64 begin = c * a.slot_bytes;
    const u64 n = min(a.slot_bytes, op.bytes - min(begin, op.bytes));
    const u8* src = data + slot * a.slot_bytes;
    u8* dst = reinterpret_cast<u8*>(op.ptr) + begin;
    const bool held = P2pWords::fit(dst, src, n);
    P2pWords words;
    if (held) words.load(src, n);
    if (threadIdx.x == 0) {
      const u64 word = atomic_load_relaxed_sys(&headers[slot].message);
      if (word != p2p_post(msg, op.bytes)) {
        const u64 theirs = p2p_post_is(word, msg) ? p2p_post_bytes(word) : kP2pOtherSize;
        p2p_mismatch(a.mismatch, a.error_word, false, peer, op.bytes, theirs);
        ok = false;
      }
    }
    // Thread 0 alone saw the header: no thread writes a byte of a chunk it refused.
    if (!p2p_block_agrees(ok)) return;
    if (held) {
      // Every thread read its share before the barriers above: the slot goes back to the sender
      // while the output is written.
      if (threadIdx.x == 0) atomic_store_release_sys(&acks[slot], g + 1);
      words.store(dst, n);
    } else {
      copy(dst, src, n, threadIdx.x, blockDim.x);
      // Every thread's reads of the slot are done before the credit goes back.
      __syncthreads();
      if (threadIdx.x == 0) atomic_store_release_sys(&acks[slot], g + 1);
    }
  }
}

MSCCLPP_DEVICE_INLINE void p2p_copy(const P2pOpArgs& op, u32 j) {
  const u64 per = ((op.bytes + op.nblocks - 1) / op.nblocks + 15) / 16 * 16;
  const u64 begin = min(static_cast<u64>(j) * per, op.bytes);
  const u64 end = min(begin + per, op.bytes);
  copy(reinterpret_cast<u8*>(op.ptr) + begin, reinterpret_cast<const u8*>(op.aux) + begin, end - begin, threadIdx.x,
       blockDim.x);
}

// Called by every block last (also after a failure), with the counters it read at its entry:
// writes the advanced counters of every channel of the group (from the op that is the last of its
// channel) into the copies this block owns (for_each_owned_copy). No barrier: the block read only
// its own copy, before its entry's barrier, and no other block of this launch reads the copies it
// writes.
MSCCLPP_DEVICE_INLINE void p2p_finish(const P2pArgs& a, const u64 (*base)[2]) {
  for (u32 i = 0; i < a.nops; ++i) {
    const P2pOpArgs& op = a.ops[i];
    if (op.kind == kP2pCopy || op.last == 0) continue;
    const u64 msgs = base[i][0] + op.msg_offset + 1;
    const u64 chunks = base[i][1] + op.chunk_offset + p2p_chunks(op.bytes, a.slot_bytes);
    u64(*c)[kP2pCounterSlots] = a.state->counters[op.peer] + (op.kind == kP2pSend ? 0 : 2);
    for_each_owned_copy(kP2pCounterSlots, [&](u32 k) {
      c[0][k] = msgs;
      c[1][k] = chunks;
    });
  }
}

extern "C" __global__ void __launch_bounds__(1024, 1) p2p_group(P2pArgs args) {
  wait_prior_grids();
  // The entry's reads go out together: thread i < nops reads op i's channel counters (this block's
  // copy) while thread 0 also reads the error word; the block meets once. Every block reads every
  // op's counters, as every block writes every channel's at its end (p2p_finish).
  __shared__ u64 base[kP2pMaxOps][2];
  bool failed = false;
  if (threadIdx.x < args.nops) {
    const P2pOpArgs& op = args.ops[threadIdx.x];
    if (op.kind != kP2pCopy) {
      const u64(*c)[kP2pCounterSlots] = args.state->counters[op.peer] + (op.kind == kP2pSend ? 0 : 2);
      base[threadIdx.x][0] = c[0][blockIdx.x];
      base[threadIdx.x][1] = c[1][blockIdx.x];
    }
  }
  if (threadIdx.x == 0) failed = aborted_at_entry(args.error_word);
  // One read of the error word for the whole block (see Blocks above).
  if (!__syncthreads_or(failed)) {
    u32 o = 0;
    while (o + 1 < args.nops && blockIdx.x >= args.ops[o + 1].first_block) ++o;
    const P2pOpArgs& op = args.ops[o];
    const u32 j = blockIdx.x - op.first_block;
    if (op.kind == kP2pSend) {
      p2p_send(args, op, j, base[o]);
    } else if (op.kind == kP2pRecv) {
      p2p_recv(args, op, j, base[o]);
    } else {
      p2p_copy(op, j);
    }
  }
  p2p_finish(args, base);
}

// Across hosts (p2p_port_group; host side: collectives/src/p2p/port.rs). A peer on another host maps
// none of this rank's memory, so every byte goes through PortChannels: a block pushes a trigger into
// the FIFO, the host proxy moves the bytes (Ethernet, IB, or the copy engine towards a peer of this
// host) and then signals the peer's semaphore. Memory of each rank, slots of `stride = 16 +
// slot_bytes` bytes:
//   inbound[src][s]  exchanged with every rank; kP2pPortSlots slots per source rank, written only by
//                    that rank's puts;
//   staging[dst][s]  private: the source of this rank's puts towards dst (a put reads registered
//                    memory, and the caller's buffers are not registered);
//   state            per peer, the messages and chunks sent and received so far.
// A slot holds a P2pPortHeader (the message's p2p_post word and the chunk's sequence number over
// the channel's life) and then up to slot_bytes of data, so one put carries both and one signal
// tells that both landed. Per peer two channels: `data` (put with signal from staging[peer][s] into
// the peer's inbound[rank][s]) and `credit` (signals only), each on a connection of its own: an IB
// connection in write-with-immediate mode delivers its signals into one semaphore only.
//
// Lanes. A lane is every op of one (peer, direction) in the group, in the caller's order, and one
// block runs one lane: a semaphore counts signals, not which chunk they were for, so the chunks of
// one direction of a channel must go and be consumed in order, by one thread's waits; and the
// block owns the lane's counters, read at its entry and written at its end. Lanes never wait for
// one another inside the kernel, so any set of groups NCCL completes completes here (as long as the
// grid is resident, which the host checks). Self ops are copies, one lane each.
//
// Protocol of chunk g of the channel (sender s, receiver r), slot g % kP2pPortSlots:
//   s: from g = kP2pPortSlots on, thread 0 waits for one more credit: the k-th credit says chunk
//      k - 1 was copied out of r's inbound, and that chunk had been read from s's staging by the
//      proxy before it reached r, so chunk g - kP2pPortSlots frees the slot on both sides. The block
//      copies the chunk into staging and thread 0 the header; after a barrier and a system fence
//      thread 0 pushes the put with signal.
//   r: thread 0 waits for one more data signal (signals arrive in the order of the puts, so the
//      (g + 1)-th one means chunk g is in its slot) and checks the header: message seq, the message's
//      byte count and the chunk seq must be its own. The block copies the data into the output,
//      and after a barrier (every read of the slot done) thread 0 returns the credit.
// A message of n bytes is p2p_chunks(n, slot_bytes) chunks, so a zero-byte message still matches
// and every chunk carries the byte count: a receiver never copies a byte of a message of another
// size. On a mismatch, where only the size differs, it first returns the credits the sender's
// message still needs (at most kP2pPortDrainMax) and waits for its proxy to have sent them, so the
// sender completes its send instead of waiting out the device timeout (its puts land in slots no
// one reads any more); then it fills the P2pMismatch record and raises kErrorCountMismatch (its
// communicator is finished: every later kernel returns at entry, and its proxy drops triggers). Waits are the semaphores' (spin_until: bounded, error word); a block that failed
// one stops, and so does a block whose thread 0 found a mismatch (p2p_block_agrees).
//
// Graphs: the counters and the semaphores' `expected` words live in device memory and only the
// kernel advances them, so replays stay in step with the peers, as p2p_group's counters do.

// Slots of each (peer, direction), threads of each block, the largest world, and the most credits a
// receiver returns for a mismatched message. Mirrored by mscclpp_kernels_cu::p2p::PORT_SLOTS,
// PORT_THREADS, MAX_PORT_RANKS and PORT_DRAIN_MAX.
constexpr u32 kP2pPortSlots = 4;
constexpr u32 kP2pPortThreads = 512;
constexpr u32 kP2pPortMaxRanks = 64;
constexpr u64 kP2pPortDrainMax = 1ull << 16;

struct P2pPortHeader {
  u64 message;  // p2p_post(message seq, message bytes)
  u64 chunk;    // the chunk's seq over the channel's life
};
constexpr u64 kP2pPortHeaderBytes = sizeof(P2pPortHeader);

// One op of a lane. Mirrored by mscclpp_kernels_cu::p2p::P2pPortOp (32 bytes).
struct P2pPortOp {
  u64 ptr;  // send: source; recv and copy: destination
  u64 aux;  // copy: source
  u64 bytes;
  u32 kind;  // kP2pSend, kP2pRecv, kP2pCopy
  u32 peer;
};

// One lane: ops[first, first + count), all of `kind` with `peer`. Mirrored by
// mscclpp_kernels_cu::p2p::P2pPortLane.
struct P2pPortLane {
  u32 first;
  u32 count;
  u32 kind;
  u32 peer;
};

// Per peer rank: send messages, send chunks, receive messages, receive chunks (zero at creation).
// Mirrored by mscclpp_kernels_cu::p2p::P2pPortState.
struct P2pPortState {
  u64 counters[kP2pPortMaxRanks][4];
};

// The one kernel argument; block b runs lanes[b]. Mirrored by mscclpp_kernels_cu::p2p::P2pPortArgs.
struct P2pPortArgs {
  const PortChannelHandle* channels;  // [rank][2]: data, credit (this rank's entries unused)
  u8* inbound;
  u8* staging;
  P2pPortState* state;
  P2pMismatch* mismatch;
  u32* error_word;
  u64 slot_bytes;  // a multiple of 16
  u32 rank;
  u32 nlanes;
  P2pPortOp ops[kP2pMaxOps];
  P2pPortLane lanes[kP2pMaxOps];
};

// Gives a sender whose `chunks`-chunk message was refused the credits it still needs to finish it.
// At the message's first chunk g it holds min(g, kP2pPortSlots) unused credits (one came for each
// earlier chunk, one went for each from kP2pPortSlots on) and the message needs one per chunk at or
// after kP2pPortSlots: either way chunks - kP2pPortSlots more, if positive. Returns once the proxy
// has handled them: the caller records the mismatch only then, since a proxy whose communicator
// has failed drops every trigger. One thread.
MSCCLPP_DEVICE_INLINE void p2p_port_drain(const PortChannelHandle& credit, u64 chunks) {
  const u64 extra = chunks > kP2pPortSlots ? min(chunks - kP2pPortSlots, kP2pPortDrainMax) : 0;
  u64 last = kFifoPushFailed;
  for (u64 k = 0; k < extra; ++k) {
    last = credit.signal();
    if (last == kFifoPushFailed) return;
  }
  if (extra > 0) credit.fifo.sync(last);
}

MSCCLPP_DEVICE_INLINE void p2p_port_send(const P2pPortArgs& a, const P2pPortLane& lane) {
  const PortChannelHandle& data = a.channels[2 * lane.peer];
  const PortChannelHandle& credit = a.channels[2 * lane.peer + 1];
  const u64 stride = kP2pPortHeaderBytes + a.slot_bytes;
  const u64 staging = static_cast<u64>(lane.peer) * kP2pPortSlots * stride;
  const u64 remote = static_cast<u64>(a.rank) * kP2pPortSlots * stride;
  // Every thread reads the counters before its first barrier; thread 0 writes them after its last.
  u64* counters = a.state->counters[lane.peer];
  u64 msg = counters[0], g = counters[1];
  bool ok = true;  // thread 0's: its waits and pushes so far succeeded
  for (u32 i = 0; i < lane.count; ++i, ++msg) {
    const P2pPortOp& op = a.ops[lane.first + i];
    const u8* src = reinterpret_cast<const u8*>(op.ptr);
    const u64 nchunks = p2p_chunks(op.bytes, a.slot_bytes);
    for (u64 c = 0; c < nchunks; ++c, ++g) {
      const u64 at = (g % kP2pPortSlots) * stride;  // the slot's offset among the peer's
      if (threadIdx.x == 0 && ok && g >= kP2pPortSlots) ok = credit.wait();
      if (!p2p_block_agrees(ok)) return;
      const u64 begin = c * a.slot_bytes;
      const u64 n = min(a.slot_bytes, op.bytes - min(begin, op.bytes));
      u8* chunk = a.staging + staging + at;
      copy(chunk + kP2pPortHeaderBytes, src + begin, n, threadIdx.x, blockDim.x);
      if (threadIdx.x == 0) {
        P2pPortHeader* h = reinterpret_cast<P2pPortHeader*>(chunk);
        h->message = p2p_post(msg, op.bytes);
        h->chunk = g;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        // The block's writes (seen by thread 0 through the barrier) reach memory before the
        // proxy, which reads the trigger from host memory, reads the slot.
        fence_acq_rel_sys();
        ok = data.push_transfer(remote + at, staging + at, kP2pPortHeaderBytes + n, kTriggerFlag) !=
             kFifoPushFailed;
      }
    }
  }
  if (threadIdx.x == 0) {
    counters[0] = msg;
    counters[1] = g;
  }
}

MSCCLPP_DEVICE_INLINE void p2p_port_recv(const P2pPortArgs& a, const P2pPortLane& lane) {
  const PortChannelHandle& data = a.channels[2 * lane.peer];
  const PortChannelHandle& credit = a.channels[2 * lane.peer + 1];
  const u64 stride = kP2pPortHeaderBytes + a.slot_bytes;
  const u8* inbound = a.inbound + static_cast<u64>(lane.peer) * kP2pPortSlots * stride;
  // As in p2p_port_send: read by every thread before its first barrier, written by thread 0 last.
  u64* counters = a.state->counters[lane.peer] + 2;
  u64 msg = counters[0], g = counters[1];
  for (u32 i = 0; i < lane.count; ++i, ++msg) {
    const P2pPortOp& op = a.ops[lane.first + i];
    u8* dst = reinterpret_cast<u8*>(op.ptr);
    const u64 nchunks = p2p_chunks(op.bytes, a.slot_bytes);
    for (u64 c = 0; c < nchunks; ++c, ++g) {
      const u8* chunk = inbound + (g % kP2pPortSlots) * stride;
      bool ok = true;
      if (threadIdx.x == 0) {
        ok = data.wait();
        if (ok) {
          // The proxy wrote the slot with DMA: system-scope loads (the wait's acquire orders them
          // after the signal) see the new header, not a line of the slot's previous chunk.
          const P2pPortHeader* h = reinterpret_cast<const P2pPortHeader*>(chunk);
          const u64 word = atomic_load_relaxed_sys(&h->message);
          const u64 seq = atomic_load_relaxed_sys(&h->chunk);
          if (word != p2p_post(msg, op.bytes) || seq != g) {
            const bool size_only = p2p_post_is(word, msg) && seq == g;
            const u64 theirs = size_only ? p2p_post_bytes(word) : kP2pOtherSize;
            if (size_only) p2p_port_drain(credit, p2p_chunks(theirs, a.slot_bytes));
            p2p_mismatch(a.mismatch, a.error_word, false, lane.peer, op.bytes, theirs);
            ok = false;
          }
        }
      }
      // Thread 0 alone saw the header: no thread writes a byte of a chunk it refused.
      if (!p2p_block_agrees(ok)) return;
      const u64 begin = c * a.slot_bytes;
      copy(dst + begin, chunk + kP2pPortHeaderBytes, min(a.slot_bytes, op.bytes - min(begin, op.bytes)),
           threadIdx.x, blockDim.x);
      // Every thread's reads of the slot are done before the credit lets the sender overwrite it.
      __syncthreads();
      if (threadIdx.x == 0) credit.signal();
    }
  }
  if (threadIdx.x == 0) {
    counters[0] = msg;
    counters[1] = g;
  }
}

// At most kP2pPortThreads threads, and at least two blocks an SM (64 registers a thread), as the
// host counts residency (geometry::Residency): several lanes, and under MPS several ranks' grids,
// share an SM.
extern "C" __global__ void __launch_bounds__(kP2pPortThreads, 2) p2p_port_group(P2pPortArgs args) {
  wait_prior_grids();
  if (block_aborted(args.error_word)) return;
  const P2pPortLane& lane = args.lanes[blockIdx.x];
  if (lane.kind == kP2pSend) {
    p2p_port_send(args, lane);
  } else if (lane.kind == kP2pRecv) {
    p2p_port_recv(args, lane);
  } else {
    for (u32 i = 0; i < lane.count; ++i) {
      const P2pPortOp& op = args.ops[lane.first + i];
      copy(reinterpret_cast<u8*>(op.ptr), reinterpret_cast<const u8*>(op.aux), op.bytes, threadIdx.x,
           blockDim.x);
    }
  }
}
