//! The ROCm backend against a fake HIP runtime (tests/fake_hip/fake_hip.c, built here with the C
//! compiler): loader probing, the IPC handle cache, and every HIP error turned into ours with the
//! call's name, all on a machine without ROCm or an AMD GPU.

use mscclpp_core::gpu::{CaptureMode, Gpu, IpcMemHandle, MemoryKind, Stream};
use mscclpp_core::Error;
use mscclpp_rocm::RocmGpu;
use std::ffi::{c_char, c_int, CString};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Builds the fake library once per variant: `old` leaves out ROCm 6's
/// hipGetDevicePropertiesR0600, as ROCm 5 does.
fn fake_library(old: bool) -> String {
    static NEW: OnceLock<String> = OnceLock::new();
    static OLD: OnceLock<String> = OnceLock::new();
    let cell = if old { &OLD } else { &NEW };
    cell.get_or_init(|| {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fake_hip/fake_hip.c");
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(if old {
            "fake-rocm5/libamdhip64.so.5"
        } else {
            "fake-rocm6/libamdhip64.so.6"
        });
        std::fs::create_dir_all(out.parent().expect("dir")).expect("output dir");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let mut cmd = Command::new(&cc);
        cmd.args(["-shared", "-fPIC", "-O1", "-std=c11", "-o"])
            .arg(&out)
            .arg(&src);
        if old {
            cmd.arg("-DFAKE_HIP_OLD");
        }
        let status = cmd.status().unwrap_or_else(|e| {
            panic!("building the fake HIP library needs a C compiler ({cc}): {e}")
        });
        assert!(status.success(), "{cc} failed on {}", src.display());
        out.display().to_string()
    })
    .clone()
}

/// The fake's test controls, resolved from the same (already loaded) library.
struct Controls {
    _lib: libloading::Library,
    fail: unsafe extern "C" fn(*const c_char, c_int),
    opens: unsafe extern "C" fn() -> c_int,
    closes: unsafe extern "C" fn() -> c_int,
}

impl Controls {
    fn new() -> Controls {
        // SAFETY: the fake library has no initialisers; the symbols have these C signatures.
        unsafe {
            let lib = libloading::Library::new(fake_library(false)).expect("fake HIP");
            let fail = *lib
                .get::<unsafe extern "C" fn(*const c_char, c_int)>(b"fake_hip_fail\0")
                .expect("fake_hip_fail");
            let opens = *lib
                .get::<unsafe extern "C" fn() -> c_int>(b"fake_hip_ipc_opens\0")
                .expect("opens");
            let closes = *lib
                .get::<unsafe extern "C" fn() -> c_int>(b"fake_hip_ipc_closes\0")
                .expect("closes");
            Controls {
                _lib: lib,
                fail,
                opens,
                closes,
            }
        }
    }

    /// Makes `call` fail with `code` on this thread until [`Controls::heal`]. The name must stay
    /// alive while it is set: the fake keeps the pointer.
    fn fail(&self, call: &CString, code: c_int) {
        // SAFETY: a NUL-terminated string that outlives its use (the caller holds it).
        unsafe { (self.fail)(call.as_ptr(), code) }
    }
    fn heal(&self) {
        // SAFETY: NULL clears the failure.
        unsafe { (self.fail)(std::ptr::null(), 0) }
    }
    fn ipc_counts(&self) -> (i32, i32) {
        // SAFETY: plain getters.
        unsafe { ((self.opens)(), (self.closes)()) }
    }
}

fn fake_gpu() -> RocmGpu {
    RocmGpu::load_from(&fake_library(false)).expect("the fake HIP loads")
}

#[test]
fn a_missing_library_is_a_clear_error() {
    let err = RocmGpu::load_from("/nonexistent/rocm/lib/libamdhip64.so.6").unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::BackendUnavailable { ref backend, .. } if backend == "rocm"),
        "{msg}"
    );
    assert!(
        msg.contains("/nonexistent/rocm/lib/libamdhip64.so.6") && msg.contains("the HIP runtime"),
        "{msg}"
    );
}

#[test]
fn an_old_library_names_the_missing_entry_point_and_the_version_needed() {
    let path = fake_library(true);
    let msg = RocmGpu::load_from(&path).unwrap_err().to_string();
    assert!(msg.contains(&path), "{msg}");
    assert!(msg.contains("hipGetDevicePropertiesR0600"), "{msg}");
    assert!(msg.contains("ROCm 6 or newer is required"), "{msg}");
}

#[test]
fn probing_reads_the_device() {
    let gpu = fake_gpu();
    assert_eq!(gpu.device_count().unwrap(), 1);
    let p = gpu.properties(0).unwrap();
    assert_eq!(p.arch, "gfx942");
    assert_eq!(p.warp_size, 64);
    assert_eq!(p.multiprocessors, 304);
    assert_eq!((p.compute_major, p.compute_minor), (9, 4));
    assert_eq!(p.total_memory, 192 << 30);
    assert_eq!(p.pci_bus_id, "0000:0c:00.0");
    assert_eq!(p.name, "Fake AMD Instinct MI300X");
}

#[test]
fn memory_round_trips_through_the_backend() {
    let gpu = fake_gpu();
    let a = gpu.alloc(1000, MemoryKind::Plain).unwrap();
    let data: Vec<u8> = (0..1000).map(|i| (i * 7 % 251) as u8).collect();
    gpu.copy_to_device(a.ptr, &data).unwrap();
    let mut back = vec![0u8; 1000];
    gpu.copy_from_device(&mut back, a.ptr).unwrap();
    assert_eq!(back, data);
    let found = gpu.allocation_of(a.ptr + 10).unwrap();
    assert_eq!((found.ptr, found.size), (a.ptr, a.reserved));
    gpu.free(&a).unwrap();
}

#[test]
fn an_ipc_handle_is_opened_once_shared_and_closed_after_the_last_user() {
    let ctl = Controls::new();
    let gpu = fake_gpu();
    let a = gpu.alloc(4096, MemoryKind::Plain).unwrap();
    let h = gpu.export_memory(&a, a.ptr + 256, 1024).unwrap();
    assert!(matches!(h, IpcMemHandle::Legacy { offset: 256, .. }));
    let (opens0, closes0) = ctl.ipc_counts();
    let m1 = gpu.import_memory(&h, None).unwrap();
    let m2 = gpu.import_memory(&h, None).unwrap();
    assert_eq!(ctl.ipc_counts(), (opens0 + 1, closes0), "opened once");
    assert_eq!((m1.ptr, m1.base, m1.size), (a.ptr + 256, a.ptr, 1024));
    assert_eq!(m2.base, m1.base);
    gpu.close_imported(&m1).unwrap();
    gpu.close_imported(&m2).unwrap();
    assert!(gpu.close_imported(&m2).is_err(), "one close too many");
    // Idle, kept for reuse: importing again opens nothing.
    let m3 = gpu.import_memory(&h, None).unwrap();
    assert_eq!(ctl.ipc_counts(), (opens0 + 1, closes0));
    gpu.close_imported(&m3).unwrap();
    assert_eq!(gpu.open_ipc_mappings(), 1);
    drop(gpu);
    assert_eq!(
        ctl.ipc_counts(),
        (opens0 + 1, closes0 + 1),
        "closed with the backend"
    );
}

#[test]
fn a_wrong_sized_handle_is_refused() {
    let gpu = fake_gpu();
    let h = IpcMemHandle::Legacy {
        bytes: vec![0; 10],
        offset: 0,
        size: 8,
    };
    let msg = gpu.import_memory(&h, None).unwrap_err().to_string();
    assert!(msg.contains("64 bytes") && msg.contains("10"), "{msg}");
}

/// Every entry point the backend calls, made to fail in turn: the error is `Error::Driver` naming
/// that call, with HIP's code and its name and text.
#[test]
fn every_failing_call_becomes_an_error_naming_it() {
    let ctl = Controls::new();
    let gpu = fake_gpu();
    let a = gpu.alloc(4096, MemoryKind::Plain).unwrap();
    let handle = gpu.export_memory(&a, a.ptr, 64).unwrap();
    let stream = gpu.create_stream().unwrap();
    let event = gpu.create_event().unwrap();
    let module = gpu.load_module(b"\x7fELF").unwrap();
    let function = gpu.get_function(module, "k").unwrap();
    type Op<'a> = Box<dyn Fn(&RocmGpu) -> mscclpp_core::Result<()> + 'a>;
    let ops: Vec<(&str, &str, Op)> = vec![
        (
            "hipGetDeviceCount",
            "hipGetDeviceCount",
            Box::new(|g| g.device_count().map(drop)),
        ),
        (
            "hipSetDevice",
            "hipSetDevice",
            Box::new(|g| g.set_device(0)),
        ),
        (
            "hipGetDevice",
            "hipGetDevice",
            Box::new(|g| g.current_device().map(drop)),
        ),
        (
            "hipGetDevicePropertiesR0600",
            "hipGetDevicePropertiesR0600",
            Box::new(|g| g.properties(0).map(drop)),
        ),
        (
            "hipDeviceGetPCIBusId",
            "hipDeviceGetPCIBusId",
            Box::new(|g| g.properties(0).map(drop)),
        ),
        (
            "hipMalloc",
            "hipMalloc",
            Box::new(|g| g.alloc(8, MemoryKind::Plain).map(drop)),
        ),
        ("hipFree", "hipFree", Box::new(|g| g.free(&a))),
        (
            "hipHostMalloc",
            "hipHostMalloc",
            Box::new(|g| g.alloc_host_mapped(8).map(drop)),
        ),
        (
            "hipHostGetDevicePointer",
            "hipHostGetDevicePointer",
            Box::new(|g| g.alloc_host_mapped(8).map(drop)),
        ),
        (
            "hipMemGetAddressRange",
            "hipMemGetAddressRange",
            Box::new(|g| g.allocation_of(a.ptr).map(drop)),
        ),
        (
            "hipMemcpy",
            "hipMemcpy(HostToDevice)",
            Box::new(|g| g.copy_to_device(a.ptr, &[1])),
        ),
        (
            "hipMemcpyAsync",
            "hipMemcpyAsync",
            Box::new(|g| g.memcpy_async(a.ptr, a.ptr + 8, 8, stream)),
        ),
        (
            "hipMemsetAsync",
            "hipMemsetAsync",
            Box::new(|g| g.memset_async(a.ptr, 0, 8, stream)),
        ),
        (
            "hipStreamCreateWithFlags",
            "hipStreamCreateWithFlags",
            Box::new(|g| g.create_stream().map(drop)),
        ),
        (
            "hipStreamDestroy",
            "hipStreamDestroy",
            Box::new(|g| g.destroy_stream(Stream(1))),
        ),
        (
            "hipStreamQuery",
            "hipStreamQuery",
            Box::new(|g| g.synchronize_stream(stream)),
        ),
        (
            "hipStreamIsCapturing",
            "hipStreamIsCapturing",
            Box::new(|g| g.is_capturing(stream).map(drop)),
        ),
        (
            "hipThreadExchangeStreamCaptureMode",
            "hipThreadExchangeStreamCaptureMode",
            Box::new(|g| g.exchange_capture_mode(CaptureMode::Relaxed).map(drop)),
        ),
        (
            "hipEventCreate",
            "hipEventCreate",
            Box::new(|g| g.create_event().map(drop)),
        ),
        (
            "hipEventDestroy",
            "hipEventDestroy",
            Box::new(|g| g.destroy_event(event)),
        ),
        (
            "hipEventRecord",
            "hipEventRecord",
            Box::new(|g| g.record_event(event, stream)),
        ),
        (
            "hipStreamWaitEvent",
            "hipStreamWaitEvent",
            Box::new(|g| g.stream_wait_event(stream, event)),
        ),
        (
            "hipEventQuery",
            "hipEventQuery",
            Box::new(|g| g.elapsed_ms(event, event).map(drop)),
        ),
        (
            "hipEventElapsedTime",
            "hipEventElapsedTime",
            Box::new(|g| g.elapsed_ms(event, event).map(drop)),
        ),
        (
            "hipIpcGetMemHandle",
            "hipIpcGetMemHandle",
            Box::new(|g| g.export_memory(&a, a.ptr, 8).map(drop)),
        ),
        (
            "hipIpcOpenMemHandle",
            "hipIpcOpenMemHandle",
            Box::new(|g| g.import_memory(&handle, None).map(drop)),
        ),
        (
            "hipDeviceEnablePeerAccess",
            "hipDeviceEnablePeerAccess",
            Box::new(|g| g.enable_peer_access(1)),
        ),
        (
            "hipModuleLoadData",
            "hipModuleLoadData",
            Box::new(|g| g.load_module(b"\x7fELF").map(drop)),
        ),
        (
            "hipModuleGetFunction",
            "hipModuleGetFunction",
            Box::new(|g| g.get_function(module, "k").map(drop)),
        ),
        (
            "hipModuleLaunchKernel",
            "hipModuleLaunchKernel",
            // SAFETY: the fake launches nothing.
            Box::new(|g| unsafe {
                g.launch(
                    function,
                    mscclpp_core::gpu::LaunchConfig::linear(1, 64),
                    stream,
                    &mut [],
                )
            }),
        ),
        (
            "hipMemcpy",
            "hipMemcpy(DeviceToHost)",
            Box::new(|g| {
                let mut b = [0u8; 1];
                g.copy_from_device(&mut b, a.ptr)
            }),
        ),
    ];
    for (symbol, call, op) in &ops {
        let name = CString::new(*symbol).unwrap();
        ctl.fail(&name, 2); // hipErrorOutOfMemory
        let result = op(&gpu);
        ctl.heal();
        match result {
            Err(Error::Driver {
                call: c,
                code,
                message,
            }) => {
                assert_eq!(c, *call, "failing {symbol}");
                assert_eq!(code, 2, "failing {symbol}");
                assert!(
                    message.contains("hipErrorOutOfMemory"),
                    "failing {symbol}: {message}"
                );
            }
            other => panic!("failing {symbol}: expected an error naming {call}, got {other:?}"),
        }
    }
    // A kernel that is not in the module: the message names it.
    let msg = gpu.get_function(module, "missing").unwrap_err().to_string();
    assert!(
        msg.contains("hipModuleGetFunction") && msg.contains("kernel missing"),
        "{msg}"
    );
    gpu.free(&a).unwrap();
}

/// In builds that embed AMD code objects (`MSCCLPP_AOT_HIP_BLOB`): on the fake's gfx942,
/// `build_module` of a unit the blob holds loads that code object (the fake records the ELF
/// header it was given), with no hiprtc involved.
#[cfg(mscclpp_aot_hip)]
#[test]
fn build_module_loads_the_embedded_code_object_of_the_devices_target() {
    use mscclpp_core::{DataType, ReduceOp};
    use mscclpp_kernels_cu::collectives::{self as kc, CollectiveFile, ReduceSpec};
    use mscclpp_rocm::{aot, CompileRequest};
    let gpu = fake_gpu();
    let spec = ReduceSpec {
        dtype: DataType::Bf16,
        acc: DataType::F32,
        op: ReduceOp::Sum,
    };
    let name = kc::unit_name(CollectiveFile::AllReduce, Some(spec));
    let source = kc::unit_source(CollectiveFile::AllReduce, Some(spec)).expect("source");
    let headers = mscclpp_kernels_hip::all_headers();
    let expected = aot::find(
        aot::embedded().expect("this build embeds code objects"),
        &CompileRequest {
            name: &name,
            source: &source,
            arch: "gfx942",
            headers: &headers,
            options: &[],
        },
    )
    .expect("the blob holds the unit for gfx942");
    gpu.build_module(&name, &source).expect("built");
    // SAFETY: the fake's control, resolved from the library the backend already loaded.
    let header = unsafe {
        let lib = libloading::Library::new(fake_library(false)).expect("fake HIP");
        let loaded = *lib
            .get::<unsafe extern "C" fn(*mut u8) -> c_int>(b"fake_hip_loaded_header\0")
            .expect("fake_hip_loaded_header");
        let mut header = [0u8; 64];
        assert_eq!(loaded(header.as_mut_ptr()), 1, "nothing was loaded");
        header
    };
    assert_eq!(header[..], expected[..64], "another image was loaded");
}
