//! mscclpp-rs: GPU-driven collective communication. This facade picks the GPU backend at run time
//! and re-exports the vendor-neutral core.
//!
//! # Backends
//! The features `cuda` and `rocm` (both on by default) compile in the backend crates; each loads its
//! driver library at run time, so one binary runs on NVIDIA and AMD hosts and on hosts with neither
//! (where it reports why it cannot run instead of failing to start). [`select_backend`] chooses:
//! - `MSCCLPP_GPU_BACKEND=cuda` or `rocm`: that backend or an error saying why not (not compiled in:
//!   which feature to enable; driver missing: which library was looked for, and where);
//! - unset or `auto`: CUDA first, then ROCm; the first whose driver loads and shows at least one
//!   device wins, and if none does the error lists every attempt and its reason.
//!
//! # Static dispatch
//! [`GpuBackend`] is an enum over the compiled-in backends implementing [`Gpu`] by forwarding each
//! call with a `match`, so calls are direct (inlinable) rather than through a vtable. DESIGN.md
//! suggests `enum_dispatch`, but that macro must see the trait definition in the same crate as the
//! enum and `Gpu` lives in `mscclpp-core`, so a small `macro_rules!` dispatcher does the same job.
//! When the `Gpu` trait gains a method, add its forwarding line below; a missing line silently
//! falls back to the trait's default body (usually `Unsupported`).

// With no backend compiled in, every forwarding method body is an empty match, so its arguments
// and the backend helpers are unused; that build exists to report "enable a feature" clearly.
#![cfg_attr(
    not(any(feature = "cuda", feature = "rocm")),
    allow(unused_variables, dead_code)
)]

pub use mscclpp_core as core;
pub use mscclpp_core::env::Env;
pub use mscclpp_core::log::init_logging;
pub use mscclpp_core::{Error, Gpu, Result};
#[cfg(feature = "ib")]
pub use mscclpp_ib as ib;
pub use mscclpp_noib as noib;

#[cfg(feature = "cuda")]
pub use mscclpp_cuda::driver::default_hardware_queues;
#[cfg(feature = "cuda")]
pub use mscclpp_cuda::CudaGpu;
#[cfg(feature = "rocm")]
pub use mscclpp_rocm::RocmGpu;

use mscclpp_core::env::BackendChoice;
use mscclpp_core::gpu::{
    Allocation, CaptureMode, DeviceProperties, DevicePtr, Event, Function, Graph, HostMapped,
    ImportedMemory, IpcMemHandle, LaunchConfig, MemoryKind, Module, MulticastExport,
    MulticastHandle, Stream,
};
use std::ffi::c_void;

/// The GPU backends compiled into this build. Features remove variants; with neither feature the
/// enum is empty and [`select_backend`] always returns an error naming the features.
pub enum GpuBackend {
    #[cfg(feature = "cuda")]
    Cuda(CudaGpu),
    #[cfg(feature = "rocm")]
    Rocm(RocmGpu),
}

/// Forwards one call to whichever backend `$self` holds. Matching on `*$self` (with `ref`
/// bindings) keeps the expansion valid when no backend is compiled in: an empty match on an
/// uninhabited place type-checks as any type.
macro_rules! dispatch {
    ($self:ident, $g:ident => $body:expr) => {
        match *$self {
            #[cfg(feature = "cuda")]
            GpuBackend::Cuda(ref $g) => $body,
            #[cfg(feature = "rocm")]
            GpuBackend::Rocm(ref $g) => $body,
        }
    };
}

impl GpuBackend {
    /// The backend as a trait object, for code that stores `&dyn Gpu`.
    pub fn as_gpu(&self) -> &dyn Gpu {
        dispatch!(self, g => g)
    }
}

impl std::fmt::Debug for GpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuBackend({})", self.backend_name())
    }
}

impl Gpu for GpuBackend {
    fn backend_name(&self) -> &'static str {
        dispatch!(self, g => g.backend_name())
    }
    fn device_count(&self) -> Result<usize> {
        dispatch!(self, g => g.device_count())
    }
    fn set_device(&self, device: usize) -> Result<()> {
        dispatch!(self, g => g.set_device(device))
    }
    fn current_device(&self) -> Result<usize> {
        dispatch!(self, g => g.current_device())
    }
    fn properties(&self, device: usize) -> Result<DeviceProperties> {
        dispatch!(self, g => g.properties(device))
    }
    fn shared_memory_kind(&self, device: usize) -> MemoryKind {
        dispatch!(self, g => g.shared_memory_kind(device))
    }
    fn is_mps_client(&self, device: usize) -> bool {
        dispatch!(self, g => g.is_mps_client(device))
    }
    fn alloc(&self, size: usize, kind: MemoryKind) -> Result<Allocation> {
        dispatch!(self, g => g.alloc(size, kind))
    }
    fn free(&self, alloc: &Allocation) -> Result<()> {
        dispatch!(self, g => g.free(alloc))
    }
    fn alloc_host_mapped(&self, size: usize) -> Result<HostMapped> {
        dispatch!(self, g => g.alloc_host_mapped(size))
    }
    fn free_host_mapped(&self, mem: &HostMapped) -> Result<()> {
        dispatch!(self, g => g.free_host_mapped(mem))
    }
    fn memcpy_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        dispatch!(self, g => g.memcpy_async(dst, src, bytes, stream))
    }
    fn copy_to_device(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        dispatch!(self, g => g.copy_to_device(dst, src))
    }
    fn copy_from_device(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        dispatch!(self, g => g.copy_from_device(dst, src))
    }
    fn memset_async(&self, dst: DevicePtr, value: u8, bytes: usize, stream: Stream) -> Result<()> {
        dispatch!(self, g => g.memset_async(dst, value, bytes, stream))
    }
    fn create_stream(&self) -> Result<Stream> {
        dispatch!(self, g => g.create_stream())
    }
    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        dispatch!(self, g => g.destroy_stream(stream))
    }
    fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        dispatch!(self, g => g.synchronize_stream(stream))
    }
    fn synchronize_device(&self) -> Result<()> {
        dispatch!(self, g => g.synchronize_device())
    }
    fn create_event(&self) -> Result<Event> {
        dispatch!(self, g => g.create_event())
    }
    fn destroy_event(&self, event: Event) -> Result<()> {
        dispatch!(self, g => g.destroy_event(event))
    }
    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        dispatch!(self, g => g.record_event(event, stream))
    }
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        dispatch!(self, g => g.stream_wait_event(stream, event))
    }
    fn elapsed_ms(&self, start: Event, end: Event) -> Result<f32> {
        dispatch!(self, g => g.elapsed_ms(start, end))
    }
    fn query_event(&self, event: Event) -> Result<bool> {
        dispatch!(self, g => g.query_event(event))
    }
    fn stream_write_u64(&self, stream: Stream, addr: DevicePtr, value: u64) -> Result<()> {
        dispatch!(self, g => g.stream_write_u64(stream, addr, value))
    }
    fn export_memory(
        &self,
        alloc: &Allocation,
        ptr: DevicePtr,
        size: usize,
    ) -> Result<IpcMemHandle> {
        dispatch!(self, g => g.export_memory(alloc, ptr, size))
    }
    fn import_memory(&self, handle: &IpcMemHandle, fd: Option<i32>) -> Result<ImportedMemory> {
        dispatch!(self, g => g.import_memory(handle, fd))
    }
    fn close_imported(&self, mem: &ImportedMemory) -> Result<()> {
        dispatch!(self, g => g.close_imported(mem))
    }
    fn allocation_of(&self, ptr: DevicePtr) -> Result<Allocation> {
        dispatch!(self, g => g.allocation_of(ptr))
    }
    fn buffer_id(&self, ptr: DevicePtr) -> Result<u64> {
        dispatch!(self, g => g.buffer_id(ptr))
    }
    fn enable_peer_access(&self, peer: usize) -> Result<()> {
        dispatch!(self, g => g.enable_peer_access(peer))
    }
    fn load_module(&self, image: &[u8]) -> Result<Module> {
        dispatch!(self, g => g.load_module(image))
    }
    fn get_function(&self, module: Module, name: &str) -> Result<Function> {
        dispatch!(self, g => g.get_function(module, name))
    }
    unsafe fn launch(
        &self,
        function: Function,
        config: LaunchConfig,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: forwarded unchanged; the caller upholds `Gpu::launch`'s contract.
        dispatch!(self, g => unsafe { g.launch(function, config, stream, params) })
    }
    fn build_module(&self, name: &str, source: &str) -> Result<Module> {
        dispatch!(self, g => g.build_module(name, source))
    }
    fn is_capturing(&self, stream: Stream) -> Result<bool> {
        dispatch!(self, g => g.is_capturing(stream))
    }
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        dispatch!(self, g => g.exchange_capture_mode(mode))
    }
    fn begin_capture(&self, stream: Stream) -> Result<()> {
        dispatch!(self, g => g.begin_capture(stream))
    }
    fn end_capture(&self, stream: Stream) -> Result<Graph> {
        dispatch!(self, g => g.end_capture(stream))
    }
    fn launch_graph(&self, graph: Graph, stream: Stream) -> Result<()> {
        dispatch!(self, g => g.launch_graph(graph, stream))
    }
    fn destroy_graph(&self, graph: Graph) -> Result<()> {
        dispatch!(self, g => g.destroy_graph(graph))
    }
    fn is_nvls_supported(&self, device: usize) -> Result<bool> {
        dispatch!(self, g => g.is_nvls_supported(device))
    }
    fn create_multicast(&self, size: usize, num_devices: usize) -> Result<MulticastHandle> {
        dispatch!(self, g => g.create_multicast(size, num_devices))
    }
    fn multicast_add_device(&self, handle: &MulticastHandle, device: usize) -> Result<()> {
        dispatch!(self, g => g.multicast_add_device(handle, device))
    }
    fn multicast_bind_memory(
        &self,
        handle: &MulticastHandle,
        alloc: &Allocation,
        offset: usize,
        size: usize,
    ) -> Result<()> {
        dispatch!(self, g => g.multicast_bind_memory(handle, alloc, offset, size))
    }
    fn multicast_unbind(&self, handle: &MulticastHandle, device: usize, size: usize) -> Result<()> {
        dispatch!(self, g => g.multicast_unbind(handle, device, size))
    }
    fn map_multicast(&self, handle: &MulticastHandle) -> Result<DevicePtr> {
        dispatch!(self, g => g.map_multicast(handle))
    }
    fn unmap_multicast(&self, handle: &MulticastHandle, ptr: DevicePtr) -> Result<()> {
        dispatch!(self, g => g.unmap_multicast(handle, ptr))
    }
    fn export_multicast(&self, handle: &MulticastHandle) -> Result<MulticastExport> {
        dispatch!(self, g => g.export_multicast(handle))
    }
    fn import_multicast(
        &self,
        export: &MulticastExport,
        fd: Option<i32>,
    ) -> Result<MulticastHandle> {
        dispatch!(self, g => g.import_multicast(export, fd))
    }
    fn free_multicast(&self, handle: &MulticastHandle) -> Result<()> {
        dispatch!(self, g => g.free_multicast(handle))
    }
}

/// Why one backend could not be used, for the combined error of `auto`.
fn reason_of(err: &Error) -> String {
    match err {
        Error::BackendUnavailable { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

/// A backend that loaded must also show a device: a driver with zero visible devices (e.g.
/// `CUDA_VISIBLE_DEVICES=""`) cannot run anything, and under `auto` the next backend may.
fn require_devices(backend: GpuBackend) -> Result<GpuBackend> {
    let name = backend.backend_name();
    match backend.device_count()? {
        0 => Err(Error::BackendUnavailable {
            backend: name.to_string(),
            reason:
                "the driver loaded but reports no visible devices (check CUDA_VISIBLE_DEVICES / \
                     HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES)"
                    .to_string(),
        }),
        _ => Ok(backend),
    }
}

#[cfg(any(not(feature = "cuda"), not(feature = "rocm"), test))]
fn not_compiled(backend: &str) -> Error {
    Error::BackendUnavailable {
        backend: backend.to_string(),
        reason: format!(
            "this build of mscclpp does not include it; enable the `{backend}` feature of the \
             `mscclpp` crate"
        ),
    }
}

fn try_cuda() -> Result<GpuBackend> {
    #[cfg(feature = "cuda")]
    {
        require_devices(GpuBackend::Cuda(CudaGpu::new()?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(not_compiled("cuda"))
    }
}

fn try_rocm() -> Result<GpuBackend> {
    #[cfg(feature = "rocm")]
    {
        require_devices(GpuBackend::Rocm(RocmGpu::new()?))
    }
    #[cfg(not(feature = "rocm"))]
    {
        Err(not_compiled("rocm"))
    }
}

/// Chooses and opens the GPU backend as `env.gpu_backend` (`MSCCLPP_GPU_BACKEND`) says; see the
/// crate docs for the rules. Never panics: every failure is an error naming what was tried.
pub fn select_backend(env: &Env) -> Result<GpuBackend> {
    match env.gpu_backend.unwrap_or(BackendChoice::Auto) {
        BackendChoice::Cuda => try_cuda(),
        BackendChoice::Rocm => try_rocm(),
        BackendChoice::Auto => {
            let mut tried = Vec::new();
            for (name, attempt) in [
                ("cuda", try_cuda as fn() -> Result<GpuBackend>),
                ("rocm", try_rocm),
            ] {
                match attempt() {
                    Ok(backend) => {
                        tracing::info!(target: mscclpp_core::log::target::GPU, "selected GPU backend {name}");
                        return Ok(backend);
                    }
                    Err(e) => {
                        tracing::debug!(target: mscclpp_core::log::target::GPU, "GPU backend {name} unusable: {e}");
                        tried.push(format!("{name}: {}", reason_of(&e)));
                    }
                }
            }
            Err(Error::BackendUnavailable {
                backend: "auto".to_string(),
                reason: format!("no GPU backend works here; tried {}", tried.join("; ")),
            })
        }
    }
}

/// [`select_backend`] on the process environment ([`Env::get`]).
pub fn select_backend_from_env() -> Result<GpuBackend> {
    select_backend(Env::get()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn env(pairs: &[(&str, &str)]) -> Result<Env> {
        Env::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    /// What a failed selection must say, per choice and build.
    fn expected_words(choice: &str) -> Vec<&'static str> {
        match choice {
            "cuda" if cfg!(feature = "cuda") => vec!["libcuda"],
            "cuda" => vec!["`cuda` feature"],
            "rocm" if cfg!(feature = "rocm") => vec!["libamdhip64"],
            "rocm" => vec!["`rocm` feature"],
            _ => vec!["tried", "cuda: ", "rocm: "],
        }
    }

    #[rstest]
    #[case("cuda")]
    #[case("rocm")]
    #[case("auto")]
    #[case("")]
    fn no_gpu_gives_a_clear_error(#[case] choice: &str) {
        let e = env(&[("MSCCLPP_GPU_BACKEND", choice)]).unwrap();
        match select_backend(&e) {
            Ok(backend) => {
                eprintln!(
                    "skipping: a GPU backend ({}) works on this machine",
                    backend.backend_name()
                )
            }
            Err(err) => {
                let msg = err.to_string();
                eprintln!("MSCCLPP_GPU_BACKEND={choice:?}: {msg}");
                assert!(matches!(err, Error::BackendUnavailable { .. }), "{err:?}");
                assert!(err.is_unavailable());
                for word in expected_words(if choice.is_empty() { "auto" } else { choice }) {
                    assert!(msg.contains(word), "{msg:?} lacks {word:?}");
                }
            }
        }
    }

    /// The methods a block of Rust source defines at the first indentation level, from its
    /// first line starting with `head` to the next closing brace at column 0.
    fn methods_of(source: &str, head: &str) -> Vec<String> {
        let block = source
            .lines()
            .skip_while(|l| !l.starts_with(head))
            .take_while(|l| *l != "}");
        block
            .filter_map(|l| {
                let l = l.strip_prefix("    ")?;
                let l = l.strip_prefix("unsafe ").unwrap_or(l);
                let name = l.strip_prefix("fn ")?.split(['(', '<']).next()?;
                Some(name.to_string())
            })
            .collect()
    }

    /// Every method of the `Gpu` trait is forwarded (a missing one would silently fall back to
    /// the trait's default for every backend).
    #[test]
    fn gpu_backend_forwards_every_method() {
        let trait_methods = methods_of(include_str!("../core/src/gpu.rs"), "pub trait Gpu");
        let forwarded = methods_of(include_str!("lib.rs"), "impl Gpu for GpuBackend");
        assert!(trait_methods.len() > 40, "{trait_methods:?}");
        let missing: Vec<_> = trait_methods
            .iter()
            .filter(|m| !forwarded.contains(m))
            .collect();
        assert!(
            missing.is_empty(),
            "GpuBackend does not forward {missing:?}"
        );
    }

    #[test]
    fn bogus_backend_is_an_env_error() {
        match env(&[("MSCCLPP_GPU_BACKEND", "metal")]) {
            Err(Error::Env { var, value, reason }) => {
                assert_eq!(var, "MSCCLPP_GPU_BACKEND");
                assert_eq!(value, "metal");
                assert!(
                    reason.contains("cuda") && reason.contains("rocm"),
                    "{reason}"
                );
            }
            other => panic!("expected an Env error, got {other:?}"),
        }
    }

    #[test]
    fn not_compiled_names_the_feature() {
        let msg = not_compiled("rocm").to_string();
        assert!(msg.contains("enable the `rocm` feature"), "{msg}");
    }
}
