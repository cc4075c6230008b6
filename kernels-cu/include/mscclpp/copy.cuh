// mscclpp-rs device library: cooperative memory copy.
//
// `copy(dst, src, bytes, tid, num_threads)` is called by `num_threads` threads at once, each with its
// own `tid`; together they copy `bytes`. It picks the widest access the two pointers' relative
// alignment allows (16-byte vectors, else 4-byte words, else bytes), copies the unaligned head and
// tail byte-wise and the body with several independent loads in flight per thread, which is what
// keeps NVLink busy. Used by MemoryChannel put/get and by kernels. `swap_copy` exchanges two
// ranges the same way.
#pragma once
#include "mscclpp/common.cuh"

namespace mscclpp {

// Loads in flight per thread in the body loop.
constexpr u32 kCopyUnroll = 4;

template <typename Word>
MSCCLPP_DEVICE_INLINE void copy_body(Word* d, const Word* s, u64 count, u32 tid, u32 num_threads) {
  u64 i = tid;
  const u64 stride = static_cast<u64>(num_threads);
  for (; i + (kCopyUnroll - 1) * stride < count; i += kCopyUnroll * stride) {
    Word r[kCopyUnroll];
#pragma unroll
    for (u32 k = 0; k < kCopyUnroll; ++k) r[k] = s[i + k * stride];
#pragma unroll
    for (u32 k = 0; k < kCopyUnroll; ++k) d[i + k * stride] = r[k];
  }
  for (; i < count; i += stride) d[i] = s[i];
}

MSCCLPP_DEVICE_INLINE void copy_bytes(u8* d, const u8* s, u64 bytes, u32 tid, u32 num_threads) {
  for (u64 i = tid; i < bytes; i += num_threads) d[i] = s[i];
}

// Copies with `Word` accesses once `d` is Word-aligned; requires (d - s) % sizeof(Word) == 0.
template <typename Word>
MSCCLPP_DEVICE_INLINE void copy_aligned(u8* d, const u8* s, u64 bytes, u32 tid, u32 num_threads) {
  const u64 mis = reinterpret_cast<u64>(d) % sizeof(Word);
  u64 head = mis == 0 ? 0 : sizeof(Word) - mis;
  if (head > bytes) head = bytes;
  copy_bytes(d, s, head, tid, num_threads);
  const u64 count = (bytes - head) / sizeof(Word);
  copy_body<Word>(reinterpret_cast<Word*>(d + head), reinterpret_cast<const Word*>(s + head), count,
                  tid, num_threads);
  const u64 done = head + count * sizeof(Word);
  copy_bytes(d + done, s + done, bytes - done, tid, num_threads);
}

MSCCLPP_DEVICE_INLINE void copy(void* dst, const void* src, u64 bytes, u32 tid, u32 num_threads) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  const u64 rel = reinterpret_cast<u64>(d) ^ reinterpret_cast<u64>(s);
  if ((rel & 15) == 0) {
    copy_aligned<uint4>(d, s, bytes, tid, num_threads);
  } else if ((rel & 3) == 0) {
    copy_aligned<u32>(d, s, bytes, tid, num_threads);
  } else {
    copy_bytes(d, s, bytes, tid, num_threads);
  }
}

// Exchanges `bytes` between `a` and `b`, called like copy(): every element is loaded from both sides
// by one thread before that thread stores either, so `a` and `b` may be the two ends of an in-place
// exchange that nothing else touches meanwhile (each element's old values are read before either is
// overwritten, whichever side is local).
template <typename Word>
MSCCLPP_DEVICE_INLINE void swap_copy_body(Word* a, Word* b, u64 count, u32 tid, u32 num_threads) {
  u64 i = tid;
  const u64 stride = static_cast<u64>(num_threads);
  for (; i + (kCopyUnroll - 1) * stride < count; i += kCopyUnroll * stride) {
    Word x[kCopyUnroll], y[kCopyUnroll];
#pragma unroll
    for (u32 k = 0; k < kCopyUnroll; ++k) {
      x[k] = a[i + k * stride];
      y[k] = b[i + k * stride];
    }
#pragma unroll
    for (u32 k = 0; k < kCopyUnroll; ++k) {
      a[i + k * stride] = y[k];
      b[i + k * stride] = x[k];
    }
  }
  for (; i < count; i += stride) {
    const Word x = a[i], y = b[i];
    a[i] = y;
    b[i] = x;
  }
}

// swap_copy() with `Word` accesses once `a` is Word-aligned; requires (a - b) % sizeof(Word) == 0.
template <typename Word>
MSCCLPP_DEVICE_INLINE void swap_copy_aligned(u8* a, u8* b, u64 bytes, u32 tid, u32 num_threads) {
  const u64 mis = reinterpret_cast<u64>(a) % sizeof(Word);
  u64 head = mis == 0 ? 0 : sizeof(Word) - mis;
  if (head > bytes) head = bytes;
  swap_copy_body<u8>(a, b, head, tid, num_threads);
  const u64 count = (bytes - head) / sizeof(Word);
  swap_copy_body<Word>(reinterpret_cast<Word*>(a + head), reinterpret_cast<Word*>(b + head), count, tid, num_threads);
  const u64 done = head + count * sizeof(Word);
  swap_copy_body<u8>(a + done, b + done, bytes - done, tid, num_threads);
}

MSCCLPP_DEVICE_INLINE void swap_copy(void* a, void* b, u64 bytes, u32 tid, u32 num_threads) {
  u8* x = static_cast<u8*>(a);
  u8* y = static_cast<u8*>(b);
  const u64 rel = reinterpret_cast<u64>(x) ^ reinterpret_cast<u64>(y);
  if ((rel & 15) == 0) {
    swap_copy_aligned<uint4>(x, y, bytes, tid, num_threads);
  } else if ((rel & 3) == 0) {
    swap_copy_aligned<u32>(x, y, bytes, tid, num_threads);
  } else {
    swap_copy_body<u8>(x, y, bytes, tid, num_threads);
  }
}

}  // namespace mscclpp
