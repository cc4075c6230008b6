//! Helpers shared by this crate's integration tests: skip-or-fail decisions for NVRTC and GPUs, and a
//! sample kernel that exercises the headers our device code needs.
#![allow(dead_code)] // each test binary uses a different subset

use mscclpp_core::gpu::Gpu;
use mscclpp_cuda::CudaGpu;

pub use mscclpp_cuda::compile_test::nvrtc_or_skip;

/// A CUDA GPU with at least `min_devices` devices, or `None` after printing why the test is skipped.
pub fn gpu_or_skip(test: &str, min_devices: usize) -> Option<CudaGpu> {
    let gpu = match CudaGpu::new() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("skipping {test}: {e}");
            return None;
        }
    };
    match gpu.device_count() {
        Ok(n) if n >= min_devices => Some(gpu),
        Ok(n) => {
            eprintln!("skipping {test}: needs {min_devices} CUDA device(s), found {n}");
            None
        }
        Err(e) => {
            eprintln!("skipping {test}: {e}");
            None
        }
    }
}

/// An in-memory header, included by [`SAMPLE_KERNEL`] by its include name.
pub const SAMPLE_HEADERS: &[(&str, &str)] = &[(
    "mscclpp/test_util.cuh",
    "#pragma once\nnamespace mscclpp_test {\n__device__ inline float twice(float v) { return v * 2.0f; }\n}\n",
)];

/// Doubles bf16 values, stores them as fp8 too, and bumps a flag with a system-scope release
/// reduction (the PTX our semaphores use).
pub const SAMPLE_KERNEL: &str = r#"
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "mscclpp/test_util.cuh"

extern "C" __global__ void scale(__nv_bfloat16* x, __nv_fp8_e4m3* y, unsigned long long* flag, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    float v = mscclpp_test::twice(__bfloat162float(x[i]));
    x[i] = __float2bfloat16(v);
    y[i] = __nv_fp8_e4m3(v);
  }
  if (i == 0) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" :: "l"(flag), "l"(1ull) : "memory");
  }
}
"#;
