//! CUDA backend of mscclpp-rs.
//!
//! - [`CudaGpu`]: the [`mscclpp_core::Gpu`] trait over the CUDA driver API (cudarc's raw bindings,
//!   loaded at run time; a missing driver is a clear error, never a panic).
//! - [`Nvrtc`]: run-time compilation with whichever NVRTC (CUDA 12 or 13) is installed, including
//!   PyPI's `nvidia-cuda-nvrtc`; [`KernelCache`] keeps its output on disk; [`aot`] serves the
//!   kernels a release build embeds precompiled, before either.
//! - Memory sharing between processes on one host: legacy IPC handles and VMM file descriptors
//!   (see [`ipc`]).
//!
//! Environment: `MSCCLPP_NVRTC_LIB` (NVRTC library file or folder), `CUDA_HOME` / `CUDA_PATH`
//! (toolkit roots for NVRTC and its headers), `MSCCLPP_NVRTC_FORCE` (compile even what is
//! embedded); at build time `MSCCLPP_AOT_BLOB` (the blob to embed, see [`aot`]).

pub mod aot;
pub mod compile_test;
pub mod driver;
pub mod gpu;
mod graph_launch;
pub mod ipc;
pub mod nvrtc;
pub mod toolkit;

pub use gpu::CudaGpu;
pub use mscclpp_core::kernel_cache::{CacheOutcome, CacheStats, CachedKernel};
pub use nvrtc::{cuda_include_dirs, CompileRequest, CompiledKernel, Nvrtc};

/// NVRTC's output on disk (`mscclpp_core::kernel_cache`).
pub type KernelCache = mscclpp_core::kernel_cache::KernelCache<Nvrtc>;
