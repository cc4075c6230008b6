// mscclpp-rs HIP device library: wavefront size.
//
// CDNA GPUs (gfx90a, gfx942) run 64-lane wavefronts; RDNA GPUs default to 32. Kernels written for
// 32-lane warps (lane masks in 32-bit words, `threadIdx.x & 31`, shuffles over 32 lanes) must use
// these names instead, so one source serves both. `__AMDGCN_WAVEFRONT_SIZE` is the compiler's
// own answer for the target being compiled; 64 is the CDNA default when it is absent.
#pragma once

#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define MSCCLPP_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#elif defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC_RTC__)
#define MSCCLPP_WARP_SIZE 64
#else
#define MSCCLPP_WARP_SIZE 32
#endif

// Lane masks are one bit per lane, so a 64-lane wavefront needs 64-bit masks.
#if MSCCLPP_WARP_SIZE == 64
typedef unsigned long long mscclpp_lane_mask_t;
#else
typedef unsigned int mscclpp_lane_mask_t;
#endif

#define MSCCLPP_LANE_ID(tid) ((tid) & (MSCCLPP_WARP_SIZE - 1))
#define MSCCLPP_WARP_ID(tid) ((tid) / MSCCLPP_WARP_SIZE)
