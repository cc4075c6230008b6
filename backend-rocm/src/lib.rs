//! ROCm backend of mscclpp-rs: the `Gpu` trait over HIP, and hiprtc, both loaded at run time.
//!
//! Nothing links against ROCm at build time, so this crate builds and its CPU tests run on any
//! machine; [`RocmGpu::new`] and [`Hiprtc::load`] say which library they looked for, and where,
//! when ROCm is absent. A release build embeds code objects for gfx90a and gfx942 compiled ahead
//! of time ([`aot`]), so hiprtc runs only for what they do not cover, through the disk cache
//! ([`KernelCache`]).

pub mod aot;
pub mod clang;
pub mod gpu;
pub mod hiprtc;
pub mod ipc_cache;
pub mod loader;
pub mod sys;

pub use gpu::RocmGpu;
pub use hiprtc::{CompileRequest, CompiledKernel, Hiprtc};

/// hiprtc's output on disk (`mscclpp_core::kernel_cache`).
pub type KernelCache = mscclpp_core::kernel_cache::KernelCache<Hiprtc>;
