// mscclpp-rs device library: LL ("low latency") packets.
//
// A packet carries data and a flag in one store that the hardware performs as a unit, so a reader
// that sees the expected flag also sees the data written with it: no separate semaphore, no fence.
// Callers pass a flag that is non-zero and different on every call (monotonically increasing), so
// packet buffers never need to be reset.
//
//   LL16Packet: {data1, flag1, data2, flag2}, 8 payload bytes per 16-byte packet.
//   LL8Packet:  {data, flag},                 4 payload bytes per 8-byte packet.
//
// On CUDA, LL16 is one 16-byte volatile vector store; on HIP (where only 8-byte single-copy
// atomicity is guaranteed) it is two 8-byte stores, which is still correct because each 8-byte half
// carries its own flag.
#pragma once
#include "mscclpp/common.cuh"
#include "mscclpp/error.cuh"

namespace mscclpp {

struct __align__(16) LL16Packet {
  u32 data1;
  u32 flag1;
  u32 data2;
  u32 flag2;

  static constexpr u32 kPayloadBytes = 8;
  typedef u64 Payload;

  MSCCLPP_DEVICE_INLINE void write(u32 v1, u32 v2, u32 flag) {
#if defined(MSCCLPP_CUDA)
    asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(this), "r"(v1), "r"(flag),
                 "r"(v2), "r"(flag)
                 : "memory");
#else
    volatile u64* p = reinterpret_cast<volatile u64*>(this);
    p[0] = (static_cast<u64>(flag) << 32) | v1;
    p[1] = (static_cast<u64>(flag) << 32) | v2;
#endif
  }
  MSCCLPP_DEVICE_INLINE void write(u64 payload, u32 flag) {
    write(static_cast<u32>(payload), static_cast<u32>(payload >> 32), flag);
  }

  // One non-blocking attempt: true and `payload` set when both halves carry `flag`.
  MSCCLPP_DEVICE_INLINE bool try_read(u32 flag, u64& payload) const {
    u32 d1, f1, d2, f2;
#if defined(MSCCLPP_CUDA)
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d1), "=r"(f1), "=r"(d2), "=r"(f2)
                 : "l"(this)
                 : "memory");
#else
    const volatile u64* p = reinterpret_cast<const volatile u64*>(this);
    const u64 lo = p[0];
    const u64 hi = p[1];
    d1 = static_cast<u32>(lo);
    f1 = static_cast<u32>(lo >> 32);
    d2 = static_cast<u32>(hi);
    f2 = static_cast<u32>(hi >> 32);
#endif
    payload = (static_cast<u64>(d2) << 32) | d1;
    return f1 == flag && f2 == flag;
  }

  // Bounded wait for `flag`; on timeout records kErrorPacketReadTimeout and returns false.
  MSCCLPP_DEVICE_INLINE bool read(u32 flag, u64& payload, u64 max_spin, u32* error_word) const {
    return spin_until([&] { return try_read(flag, payload); }, max_spin, error_word,
                      kErrorPacketReadTimeout);
  }
};

struct __align__(8) LL8Packet {
  u32 data;
  u32 flag;

  static constexpr u32 kPayloadBytes = 4;
  typedef u32 Payload;

  MSCCLPP_DEVICE_INLINE void write(u32 v, u32 flag_value) {
#if defined(MSCCLPP_CUDA)
    asm volatile("st.volatile.global.v2.u32 [%0], {%1,%2};" ::"l"(this), "r"(v), "r"(flag_value)
                 : "memory");
#else
    *reinterpret_cast<volatile u64*>(this) = (static_cast<u64>(flag_value) << 32) | v;
#endif
  }

  MSCCLPP_DEVICE_INLINE bool try_read(u32 flag_value, u32& payload) const {
    u32 d, f;
#if defined(MSCCLPP_CUDA)
    asm volatile("ld.volatile.global.v2.u32 {%0,%1}, [%2];"
                 : "=r"(d), "=r"(f)
                 : "l"(this)
                 : "memory");
#else
    const u64 w = *reinterpret_cast<const volatile u64*>(this);
    d = static_cast<u32>(w);
    f = static_cast<u32>(w >> 32);
#endif
    payload = d;
    return f == flag_value;
  }

  MSCCLPP_DEVICE_INLINE bool read(u32 flag_value, u32& payload, u64 max_spin,
                                  u32* error_word) const {
    return spin_until([&] { return try_read(flag_value, payload); }, max_spin, error_word,
                      kErrorPacketReadTimeout);
  }
};

static_assert(sizeof(LL16Packet) == 16, "LL16Packet must be 16 bytes");
static_assert(sizeof(LL8Packet) == 8, "LL8Packet must be 8 bytes");

// Number of packets (and bytes of packet buffer) needed to carry `data_bytes`.
template <typename Pkt>
MSCCLPP_HOST_DEVICE_INLINE u64 packet_count(u64 data_bytes) {
  return (data_bytes + Pkt::kPayloadBytes - 1) / Pkt::kPayloadBytes;
}
template <typename Pkt>
MSCCLPP_HOST_DEVICE_INLINE u64 packet_buffer_bytes(u64 data_bytes) {
  return packet_count<Pkt>(data_bytes) * sizeof(Pkt);
}

// Loads/stores the `n` (< sizeof(Word)) valid bytes of a partial payload; the rest reads as zero.
// Only the last packet of a transfer takes this path.
template <typename Word>
MSCCLPP_DEVICE_INLINE Word load_partial(const u8* p, u32 n) {
  Word w = 0;
  for (u32 i = 0; i < n; ++i) w |= static_cast<Word>(p[i]) << (8 * i);
  return w;
}
template <typename Word>
MSCCLPP_DEVICE_INLINE void store_partial(u8* p, Word w, u32 n) {
  for (u32 i = 0; i < n; ++i) p[i] = static_cast<u8>(w >> (8 * i));
}

// Loads payload `index` of `src` (bytes long). Full payloads use one aligned load when `src` is
// payload-aligned, else byte loads.
template <typename Pkt>
MSCCLPP_DEVICE_INLINE typename Pkt::Payload load_payload(const u8* src, u64 bytes, u64 index,
                                                        bool aligned) {
  typedef typename Pkt::Payload Word;
  const u64 off = index * Pkt::kPayloadBytes;
  const u64 left = bytes - off;
  if (left >= Pkt::kPayloadBytes) {
    if (aligned) return *reinterpret_cast<const Word*>(src + off);
    return load_partial<Word>(src + off, Pkt::kPayloadBytes);
  }
  return load_partial<Word>(src + off, static_cast<u32>(left));
}

template <typename Pkt>
MSCCLPP_DEVICE_INLINE void store_payload(u8* dst, u64 bytes, u64 index,
                                         typename Pkt::Payload value, bool aligned) {
  typedef typename Pkt::Payload Word;
  const u64 off = index * Pkt::kPayloadBytes;
  const u64 left = bytes - off;
  if (left >= Pkt::kPayloadBytes) {
    if (aligned) {
      *reinterpret_cast<Word*>(dst + off) = value;
    } else {
      store_partial<Word>(dst + off, value, Pkt::kPayloadBytes);
    }
    return;
  }
  store_partial<Word>(dst + off, value, static_cast<u32>(left));
}

// Cooperative pack: threads (tid of num_threads) turn `bytes` of `src` into packets at `dst`
// (typically a peer's packet buffer mapped here).
template <typename Pkt>
MSCCLPP_DEVICE_INLINE void put_packets(Pkt* dst, const void* src, u64 bytes, u32 tid, u32 num_threads,
                                       u32 flag) {
  const u8* s = static_cast<const u8*>(src);
  const bool aligned = (reinterpret_cast<u64>(s) % Pkt::kPayloadBytes) == 0;
  const u64 n = packet_count<Pkt>(bytes);
  for (u64 i = tid; i < n; i += num_threads) {
    dst[i].write(load_payload<Pkt>(s, bytes, i, aligned), flag);
  }
}

// Cooperative unpack: waits (bounded) for each packet of `src` to carry `flag` and writes its
// payload to `dst`. Returns false if any packet timed out (the error word says so).
template <typename Pkt>
MSCCLPP_DEVICE_INLINE bool get_packets(void* dst, const Pkt* src, u64 bytes, u32 tid, u32 num_threads,
                                       u32 flag, u64 max_spin, u32* error_word) {
  u8* d = static_cast<u8*>(dst);
  const bool aligned = (reinterpret_cast<u64>(d) % Pkt::kPayloadBytes) == 0;
  const u64 n = packet_count<Pkt>(bytes);
  bool ok = true;
  for (u64 i = tid; i < n; i += num_threads) {
    typename Pkt::Payload v;
    if (!src[i].read(flag, v, max_spin, error_word)) {
      ok = false;
      break;  // the error is recorded; waiting on the next packets would only multiply the delay
    }
    store_payload<Pkt>(d, bytes, i, v, aligned);
  }
  return ok;
}

// LL128 lines (CUDA, NVLink): 128 bytes = 16 words of 8 bytes; words 0..14 carry 120 payload bytes,
// word 15 the flag. A line is written and read by 8 consecutive lanes of one warp, lane t holding
// words 2t and 2t + 1 (lane 7: word 14 and the flag), each with one 16-byte access. What makes the
// flag safe is the hardware's handling of such a warp-wide access: the 8 lanes' stores to one
// 128-byte line travel as one NVLink write and the 8 lanes' loads are served as one read, so a
// reader whose flag lane sees the new flag sees the new payload in the other 7 lanes too (the
// property NCCL's LL128 protocol rests on, on NVLink-connected sm_70+ GPUs). Payload overhead is
// 8/128 instead of LL16's 8/16.
//
// HIP documents only 8-byte single-copy atomicity, so there a line falls back to LL8: lane t's 16
// bytes are one LL16Packet, i.e. two self-flagged {data, flag} words (see LL16Packet::write), and
// a line carries 64 payload bytes (one payload word per lane, no flag lane). Kernels use the same
// interface on both: `has_second(t)` says whether lane t carries a second payload word, and the
// host sizes buffers with `kPayloadBytes` of the platform.
struct LL128 {
  static constexpr u32 kLineBytes = 128;
  static constexpr u32 kLanesPerLine = 8;
#if defined(MSCCLPP_CUDA)
  static constexpr u32 kPayloadBytes = 120;
  static constexpr u32 kWordsPerLine = 15;  // payload words
  static constexpr u32 kWordsPerLane = 2;
  static constexpr u32 kFlagLane = 7;

  MSCCLPP_DEVICE_INLINE static bool has_second(u32 t) { return t != kFlagLane; }

  // Lane `t` of the line's 8 lanes stores words {a, b} at their place (lane 7: b is the flag).
  MSCCLPP_DEVICE_INLINE static void store(void* line, u32 t, u64 a, u64 b) {
    asm volatile("st.volatile.global.v2.u64 [%0], {%1,%2};" ::"l"(static_cast<u8*>(line) + 16 * t), "l"(a),
                 "l"(b)
                 : "memory");
  }

  // One attempt: lane t's words; true unless this is the flag lane and the flag is not `flag` yet.
  MSCCLPP_DEVICE_INLINE static bool try_load(const void* line, u32 t, u64 flag, u64& a, u64& b) {
    asm volatile("ld.volatile.global.v2.u64 {%0,%1}, [%2];"
                 : "=l"(a), "=l"(b)
                 : "l"(static_cast<const u8*>(line) + 16 * t)
                 : "memory");
    return t != kFlagLane || b == flag;
  }

  MSCCLPP_DEVICE_INLINE static bool warp_all(bool ok) { return __all_sync(0xffffffffu, ok) != 0; }
#else
  static constexpr u32 kPayloadBytes = 64;
  static constexpr u32 kWordsPerLine = 8;
  static constexpr u32 kWordsPerLane = 1;

  MSCCLPP_DEVICE_INLINE static bool has_second(u32) { return false; }

  // Lane `t` stores payload word `a` flagged with `flag` (the low 32 bits, as LL8 flags are).
  MSCCLPP_DEVICE_INLINE static void store(void* line, u32 t, u64 a, u64 flag) {
    reinterpret_cast<LL16Packet*>(static_cast<u8*>(line) + 16 * t)->write(a, static_cast<u32>(flag));
  }

  // One attempt: true when both halves of lane t's packet carry `flag`; `b` is the flag.
  MSCCLPP_DEVICE_INLINE static bool try_load(const void* line, u32 t, u64 flag, u64& a, u64& b) {
    b = flag;
    return reinterpret_cast<const LL16Packet*>(static_cast<const u8*>(line) + 16 * t)
        ->try_read(static_cast<u32>(flag), a);
  }

  // A vote over the whole wavefront (64 lanes on CDNA).
  MSCCLPP_DEVICE_INLINE static bool warp_all(bool ok) { return __all(ok) != 0; }
#endif

  // Bounded wait until every active line of the warp carries `flag`; every lane of the warp must
  // call it together (it votes). Inactive lanes load nothing and agree. On timeout records
  // kErrorPacketReadTimeout and returns false in every lane.
  MSCCLPP_DEVICE_INLINE static bool read(const void* line, u32 t, bool active, u64 flag, u64& a, u64& b,
                                         u64 max_spin, u32* error_word) {
    return spin_until(
        [&] {
          bool ok = true;
          if (active) ok = try_load(line, t, flag, a, b);
          return warp_all(ok);
        },
        max_spin, error_word, kErrorPacketReadTimeout);
  }

  // Lines that carry `bytes`.
  MSCCLPP_DEVICE_INLINE static u64 lines(u64 bytes) { return (bytes + kPayloadBytes - 1) / kPayloadBytes; }

  // Word k (0, or 1 where has_second(t)) of lane t's part of line j of a `bytes`-byte buffer; 0
  // past its end.
  MSCCLPP_DEVICE_INLINE static u64 load_word(const u8* base, u64 bytes, bool aligned, u64 j, u32 t, u32 k) {
    const u64 w = j * kWordsPerLine + kWordsPerLane * t + k;
    return w * 8 < bytes ? load_payload<LL16Packet>(base, bytes, w, aligned) : 0;
  }
  MSCCLPP_DEVICE_INLINE static void store_word(u8* base, u64 bytes, bool aligned, u64 j, u32 t, u32 k, u64 v) {
    const u64 w = j * kWordsPerLine + kWordsPerLane * t + k;
    if (w * 8 < bytes) store_payload<LL16Packet>(base, bytes, w, v, aligned);
  }

  // Lane t's part of line j of `src` (a `bytes`-byte buffer) into `line`, flagged.
  MSCCLPP_DEVICE_INLINE static void send(void* line, const u8* src, u64 bytes, bool aligned, u64 j, u32 t,
                                         u64 flag) {
    store(line, t, load_word(src, bytes, aligned, j, t, 0), has_second(t) ? load_word(src, bytes, aligned, j, t, 1) : flag);
  }
  // Lane t's words {a, b} of a line read, into line j of `dst` (b is data only where has_second(t)).
  MSCCLPP_DEVICE_INLINE static void unpack(u8* dst, u64 bytes, bool aligned, u64 j, u32 t, u64 a, u64 b) {
    store_word(dst, bytes, aligned, j, t, 0, a);
    if (has_second(t)) store_word(dst, bytes, aligned, j, t, 1, b);
  }
};
static_assert(LL128::kWordsPerLine * 8 == LL128::kPayloadBytes, "LL128 payload words");

// Where a thread sits in the LL128 layout of a grid: lines go 8 lanes each, so 4 to a 32-lane warp
// and 8 to a 64-lane wavefront; loops that read lines step by whole warps (`first`, `stride` in
// lines) so every lane votes in every round.
// Order of the warps over the lines. `spread` (the default): warp w of block b is the grid's warp
// w * gridDim.x + b, so consecutive warps of the line order sit on different SMs. A packet kernel's
// grid is sized for its whole message, and a phase with fewer lines (the two-phase all-reduce's
// reduction, a small all-gather) would otherwise fall on the first few blocks only, whose NVLink
// stores and polls then queue behind each other while the other SMs idle. Spread, at 4 ranks on
// 4 x H200 (2026-11-28): reduce-scatter 2-8 % and all-gather 7-15 %
// less time at 16-64 KiB, the two-phase all-reduce up to 5 % less at 256 KiB. Block order (warp
// b * warps_per_block + w, each block on one run of adjacent lines) measured 2-3 % faster for that
// all-reduce from 1 MiB, which asks for it there. Either order gives each thread the same lines in
// every loop of a kernel.
struct LineLanes {
  u32 t;        // my lane within my line
  u32 sub;      // my line among my warp's lines
  u64 first;    // my warp's first line
  u64 stride;   // lines the grid covers per round
  MSCCLPP_DEVICE_INLINE explicit LineLanes(bool spread = true) {
    const u32 lane = threadIdx.x % MSCCLPP_WARP_SIZE;
    t = lane % LL128::kLanesPerLine;
    sub = lane / LL128::kLanesPerLine;
    constexpr u32 kLinesPerWarp = MSCCLPP_WARP_SIZE / LL128::kLanesPerLine;
    const u32 warps_per_block = (blockDim.x + MSCCLPP_WARP_SIZE - 1) / MSCCLPP_WARP_SIZE;
    const u32 w = threadIdx.x / MSCCLPP_WARP_SIZE;
    const u64 warp = spread ? static_cast<u64>(w) * gridDim.x + blockIdx.x
                            : static_cast<u64>(blockIdx.x) * warps_per_block + w;
    first = warp * kLinesPerWarp;
    stride = static_cast<u64>(warps_per_block) * gridDim.x * kLinesPerWarp;
  }
};

}  // namespace mscclpp
