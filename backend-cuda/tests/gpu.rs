//! Driver-backed tests. Each one prints why it skips when no CUDA driver or device is present.
//!
//! The cross-process IPC test re-runs this test binary as a child (`ipc_child_entry`, active only
//! when MSCCLPP_TEST_IPC_CHILD is set) so legacy handles and VMM descriptors cross a real process
//! boundary, as they do between ranks.

mod common;

use common::{gpu_or_skip, nvrtc_or_skip, SAMPLE_HEADERS, SAMPLE_KERNEL};
use mscclpp_core::gpu::{Gpu, IpcMemHandle, LaunchConfig, MemoryKind, Stream};
use mscclpp_cuda::{CacheOutcome, CompileRequest, CudaGpu, KernelCache};
use rstest::rstest;
use std::ffi::c_void;
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "MSCCLPP_TEST_IPC_CHILD";

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn properties_are_sane() {
    let Some(gpu) = gpu_or_skip("properties_are_sane", 1) else {
        return;
    };
    for d in 0..gpu.device_count().unwrap() {
        let p = gpu.properties(d).expect("properties");
        eprintln!("device {d}: {p:?}");
        assert!(p.arch.starts_with("sm_"), "{}", p.arch);
        assert_eq!(p.arch, format!("sm_{}{}", p.compute_major, p.compute_minor));
        assert!(p.multiprocessors > 0 && p.warp_size == 32 && p.total_memory > 0);
        assert_eq!(p.pci_bus_id.len(), 12, "{}", p.pci_bus_id);
    }
    assert!(gpu.properties(1 << 20).is_err());
    assert!(gpu.set_device(1 << 20).is_err());
}

#[rstest]
#[case(MemoryKind::Plain, 1)]
#[case(MemoryKind::Plain, 1 << 20)]
#[case(MemoryKind::Vmm, 1)]
#[case(MemoryKind::Vmm, (3 << 20) + 5)]
fn alloc_copy_memset_round_trip(#[case] kind: MemoryKind, #[case] size: usize) {
    let Some(gpu) = gpu_or_skip("alloc_copy_memset_round_trip", 1) else {
        return;
    };
    let a = gpu.alloc(size, kind).expect("alloc a");
    let b = gpu.alloc(size, kind).expect("alloc b");
    assert_eq!(a.kind, kind);
    assert!(a.reserved >= size);
    let data = pattern(size, 7);
    gpu.copy_to_device(a.ptr, &data).expect("h2d");
    let s = gpu.create_stream().expect("stream");
    assert!(!gpu.is_capturing(s).expect("is_capturing"));
    gpu.memcpy_async(b.ptr, a.ptr, size, s).expect("d2d");
    gpu.synchronize_stream(s).expect("sync");
    let mut back = vec![0u8; size];
    gpu.copy_from_device(&mut back, b.ptr).expect("d2h");
    assert_eq!(back, data);
    gpu.memset_async(b.ptr, 0x5a, size, s).expect("memset");
    gpu.synchronize_stream(s).expect("sync");
    gpu.copy_from_device(&mut back, b.ptr).expect("d2h");
    assert!(back.iter().all(|&x| x == 0x5a));
    gpu.destroy_stream(s).expect("destroy stream");
    gpu.free(&a).expect("free a");
    gpu.free(&b).expect("free b");
    assert!(gpu.alloc(0, kind).is_err());
}

#[test]
fn host_mapped_is_zeroed_and_device_visible() {
    let Some(gpu) = gpu_or_skip("host_mapped_is_zeroed_and_device_visible", 1) else {
        return;
    };
    let m = gpu.alloc_host_mapped(4096).expect("host mapped");
    // SAFETY: 4096 pinned bytes, not yet used by the device.
    let host = unsafe { std::slice::from_raw_parts(m.host_ptr, m.size) };
    assert!(host.iter().all(|&b| b == 0));
    gpu.memset_async(m.device_ptr, 0x11, 4096, Stream::DEFAULT)
        .expect("memset");
    gpu.synchronize_device().expect("sync");
    // SAFETY: the device finished writing.
    let host = unsafe { std::slice::from_raw_parts(m.host_ptr, m.size) };
    assert!(host.iter().all(|&b| b == 0x11));
    gpu.free_host_mapped(&m).expect("free");
}

#[test]
fn compiled_kernel_runs_and_cache_reports_times() {
    let Some(gpu) = gpu_or_skip("compiled_kernel_runs", 1) else {
        return;
    };
    let Some(nvrtc) = nvrtc_or_skip("compiled_kernel_runs") else {
        return;
    };
    let arch = gpu.properties(0).expect("props").arch;
    let dir = std::env::temp_dir().join(format!("mscclpp-gpu-cache-{}", std::process::id()));
    let cache = KernelCache::new(&dir, nvrtc).expect("cache");
    let req = CompileRequest {
        name: "scale",
        source: SAMPLE_KERNEL,
        arch: &arch,
        headers: SAMPLE_HEADERS,
        options: &[],
    };
    let first = cache.get_or_compile(&req).expect("compile");
    let second = cache.get_or_compile(&req).expect("cached");
    assert_eq!(
        (first.outcome, second.outcome),
        (CacheOutcome::Compiled, CacheOutcome::Hit)
    );
    eprintln!(
        "NVRTC {:?} for {arch}: first-use compile {:?}, cached load {:?}",
        cache.compiler().version(),
        first.elapsed,
        second.elapsed
    );

    let module = gpu.load_module(&second.kernel.image).expect("load module");
    let f = gpu.get_function(module, "scale").expect("function");
    assert!(gpu.get_function(module, "no_such_kernel").is_err());

    let n: i32 = 1000;
    let count = n as usize;
    // bf16 of small integers: the top half of the f32 bits is exact.
    let x: Vec<u8> = (0..count)
        .flat_map(|i| ((((i % 100) as f32).to_bits() >> 16) as u16).to_le_bytes())
        .collect();
    let xb = gpu.alloc(count * 2, MemoryKind::Plain).expect("x");
    let yb = gpu.alloc(count, MemoryKind::Plain).expect("y");
    let flag = gpu.alloc_host_mapped(8).expect("flag");
    gpu.copy_to_device(xb.ptr, &x).expect("h2d");
    let s = gpu.create_stream().expect("stream");
    let (e0, e1) = (
        gpu.create_event().expect("e0"),
        gpu.create_event().expect("e1"),
    );
    gpu.record_event(e0, s).expect("record");
    let (mut px, mut py, mut pf, mut pn) = (xb.ptr, yb.ptr, flag.device_ptr, n);
    let mut params: Vec<*mut c_void> = vec![
        (&mut px as *mut u64).cast(),
        (&mut py as *mut u64).cast(),
        (&mut pf as *mut u64).cast(),
        (&mut pn as *mut i32).cast(),
    ];
    // SAFETY: parameters match `scale(bf16*, fp8*, u64*, int)`; buffers live until the sync below.
    unsafe {
        gpu.launch(
            f,
            LaunchConfig::linear(((n + 255) / 256) as u32, 256),
            s,
            &mut params,
        )
    }
    .expect("launch");
    gpu.record_event(e1, s).expect("record");
    gpu.synchronize_stream(s).expect("sync");
    let ms = gpu.elapsed_ms(e0, e1).expect("elapsed");
    assert!(ms >= 0.0);
    let mut out = vec![0u8; count * 2];
    gpu.copy_from_device(&mut out, xb.ptr).expect("d2h");
    for i in 0..count {
        let bits = u16::from_le_bytes([out[2 * i], out[2 * i + 1]]);
        let v = f32::from_bits(u32::from(bits) << 16);
        assert_eq!(v, 2.0 * (i % 100) as f32, "element {i}");
    }
    // SAFETY: the kernel finished; 8 pinned bytes.
    let flag_value = unsafe { std::ptr::read_volatile(flag.host_ptr as *const u64) };
    assert_eq!(flag_value, 1);

    gpu.destroy_event(e0).expect("event");
    gpu.destroy_event(e1).expect("event");
    gpu.destroy_stream(s).expect("stream");
    gpu.unload_module(module).expect("unload");
    gpu.free(&xb).expect("free");
    gpu.free(&yb).expect("free");
    gpu.free_host_mapped(&flag).expect("free flag");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn allocation_of_finds_base_and_kind() {
    let Some(gpu) = gpu_or_skip("allocation_of_finds_base_and_kind", 1) else {
        return;
    };
    for kind in [MemoryKind::Plain, MemoryKind::Vmm] {
        let a = gpu.alloc(1 << 21, kind).expect("alloc");
        let found = gpu.allocation_of(a.ptr + 4096).expect("allocation_of");
        assert_eq!((found.ptr, found.kind, found.device), (a.ptr, kind, 0));
        assert!(found.size >= a.size);
        gpu.free(&a).expect("free");
    }
}

#[test]
fn vmm_import_in_process_is_cached_and_refcounted() {
    let Some(gpu) = gpu_or_skip("vmm_import_in_process", 1) else {
        return;
    };
    let a = gpu.alloc(1 << 21, MemoryKind::Vmm).expect("alloc");
    gpu.copy_to_device(a.ptr, &pattern(1 << 21, 3))
        .expect("h2d");
    let h = gpu.export_memory(&a, a.ptr + 512, 1024).expect("export");
    assert_eq!(
        h,
        gpu.export_memory(&a, a.ptr + 512, 1024)
            .expect("export again")
    );
    assert!(gpu.export_memory(&a, a.ptr + (1 << 21), 1).is_err());
    let m1 = match gpu.import_memory(&h, None) {
        Ok(m) => m,
        Err(e) if e.to_string().contains("pidfd") => {
            eprintln!("skipping vmm_import_in_process: {e}");
            gpu.free(&a).expect("free");
            return;
        }
        Err(e) => panic!("import: {e}"),
    };
    let m2 = gpu.import_memory(&h, None).expect("second import");
    assert_eq!(m1, m2);
    assert_eq!(gpu.imported_mappings(), 1);
    let mut back = vec![0u8; 1024];
    gpu.copy_from_device(&mut back, m1.ptr)
        .expect("read through import");
    assert_eq!(back, pattern(1 << 21, 3)[512..1536]);
    gpu.close_imported(&m1).expect("close 1");
    assert_eq!(gpu.imported_mappings(), 1);
    gpu.close_imported(&m2).expect("close 2");
    assert_eq!(gpu.imported_mappings(), 0);
    assert!(
        gpu.close_imported(&m2).is_err(),
        "closing twice must be an error"
    );
    gpu.free(&a).expect("free");
}

/// #58's DSL check: a VMM buffer exported and imported, then freed while the import is still held
/// (another registration of it alive), then a new buffer of the same size exported, often under
/// the same descriptor number. Its import must read the new buffer, not the old one's memory.
#[test]
fn vmm_export_after_a_free_is_never_served_the_old_mapping() {
    let Some(gpu) = gpu_or_skip("vmm_export_after_a_free", 1) else {
        return;
    };
    let size = 1 << 21;
    let a = gpu.alloc(size, MemoryKind::Vmm).expect("alloc a");
    gpu.copy_to_device(a.ptr, &pattern(size, 1)).expect("h2d a");
    let ha = gpu.export_memory(&a, a.ptr, size).expect("export a");
    let ma = match gpu.import_memory(&ha, None) {
        Ok(m) => m,
        Err(e) if e.to_string().contains("pidfd") => {
            eprintln!("skipping vmm_export_after_a_free: {e}");
            gpu.free(&a).expect("free");
            return;
        }
        Err(e) => panic!("import a: {e}"),
    };
    gpu.free(&a).expect("free a");
    let b = gpu.alloc(size, MemoryKind::Vmm).expect("alloc b");
    gpu.copy_to_device(b.ptr, &pattern(size, 2)).expect("h2d b");
    let hb = gpu.export_memory(&b, b.ptr, size).expect("export b");
    let fd = |h: &IpcMemHandle| match h {
        IpcMemHandle::PosixFd { fd, .. } => *fd,
        IpcMemHandle::Legacy { .. } => -1,
    };
    eprintln!(
        "descriptor {} then {} (number reused: {})",
        fd(&ha),
        fd(&hb),
        fd(&ha) == fd(&hb)
    );
    let mb = gpu.import_memory(&hb, None).expect("import b");
    assert_ne!(mb.base, ma.base, "b's import was given a's mapping");
    let mut back = vec![0u8; 4096];
    gpu.copy_from_device(&mut back, mb.ptr).expect("read b");
    assert_eq!(back, pattern(size, 2)[..4096], "b read through its import");
    gpu.close_imported(&mb).expect("close b");
    gpu.close_imported(&ma).expect("close a");
    assert_eq!(gpu.imported_mappings(), 0);
    gpu.free(&b).expect("free b");
}

/// The legacy side of the same hazard: imports of cudaMalloc memory are keyed by the IPC handle's
/// bytes, so a new allocation at a freed one's address must get other bytes, or its importers
/// would be handed the old mapping.
#[test]
fn a_plain_allocation_at_a_freed_address_gets_a_new_ipc_handle() {
    let Some(gpu) = gpu_or_skip("plain_allocation_new_handle", 1) else {
        return;
    };
    let size = 1 << 21;
    let a = gpu.alloc(size, MemoryKind::Plain).expect("alloc a");
    let ha = gpu.export_memory(&a, a.ptr, size).expect("export a");
    gpu.free(&a).expect("free a");
    let b = gpu.alloc(size, MemoryKind::Plain).expect("alloc b");
    let hb = gpu.export_memory(&b, b.ptr, size).expect("export b");
    eprintln!(
        "address {:#x} then {:#x} (reused: {})",
        a.ptr,
        b.ptr,
        a.ptr == b.ptr
    );
    if a.ptr == b.ptr {
        assert_ne!(
            ha, hb,
            "a new allocation at a freed address kept the old IPC handle"
        );
    }
    gpu.free(&b).expect("free b");
}

/// The child half of `ipc_across_processes`: imports each handle twice, checks the pattern, writes
/// 0xAB over it, closes both imports.
#[test]
fn ipc_child_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let handles: Vec<IpcMemHandle> = serde_json::from_str(&spec).expect("handles");
    let gpu = CudaGpu::new().expect("child: CudaGpu::new");
    for h in &handles {
        let m = match gpu.import_memory(h, None) {
            Ok(m) => m,
            Err(e)
                if matches!(h, IpcMemHandle::PosixFd { .. }) && e.to_string().contains("pidfd") =>
            {
                eprintln!("child: VMM import unavailable here: {e}");
                continue;
            }
            Err(e) => panic!("child: import {h:?}: {e}"),
        };
        let again = gpu.import_memory(h, None).expect("child: second import");
        assert_eq!(m.ptr, again.ptr);
        let mut got = vec![0u8; m.size];
        gpu.copy_from_device(&mut got, m.ptr).expect("child: read");
        assert_eq!(got, pattern(m.size, 9), "child: data of {h:?}");
        gpu.copy_to_device(m.ptr, &vec![0xAB; m.size])
            .expect("child: write");
        gpu.synchronize_device().expect("child: sync");
        gpu.close_imported(&again).expect("child: close");
        gpu.close_imported(&m).expect("child: close");
    }
    assert_eq!(gpu.imported_mappings(), 0);
}

#[test]
fn ipc_across_processes() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let Some(gpu) = gpu_or_skip("ipc_across_processes", 1) else {
        return;
    };
    let size = 4096usize;
    let plain = gpu.alloc(1 << 20, MemoryKind::Plain).expect("plain");
    let vmm = gpu.alloc(1 << 20, MemoryKind::Vmm).expect("vmm");
    let off = 8192u64;
    let mut handles = Vec::new();
    for a in [&plain, &vmm] {
        gpu.copy_to_device(a.ptr + off, &pattern(size, 9))
            .expect("h2d");
        handles.push(gpu.export_memory(a, a.ptr + off, size).expect("export"));
    }
    let exe = std::env::current_exe().expect("current_exe");
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "ipc_child_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, serde_json::to_string(&handles).expect("json"))
        .spawn()
        .expect("spawn child");
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("IPC child did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "IPC child failed: {status}");
    let mut got = vec![0u8; size];
    gpu.copy_from_device(&mut got, plain.ptr + off)
        .expect("d2h");
    assert!(
        got.iter().all(|&b| b == 0xAB),
        "legacy IPC write not visible"
    );
    gpu.copy_from_device(&mut got, vmm.ptr + off).expect("d2h");
    if !got.iter().all(|&b| b == 0xAB) {
        eprintln!("VMM cross-process write not seen (child reported pidfd unavailability above)");
    }
    gpu.free(&plain).expect("free");
    gpu.free(&vmm).expect("free");
}

#[test]
fn threads_use_their_own_device_binding() {
    let Some(gpu) = gpu_or_skip("threads_use_their_own_device_binding", 1) else {
        return;
    };
    let n = gpu.device_count().unwrap();
    std::thread::scope(|s| {
        for t in 0..4 {
            let gpu = &gpu;
            s.spawn(move || {
                let d = t % n;
                gpu.set_device(d).expect("set_device");
                assert_eq!(gpu.current_device().unwrap(), d);
                let a = gpu.alloc(4096, MemoryKind::Plain).expect("alloc");
                assert_eq!(a.device, d);
                assert_eq!(gpu.allocation_of(a.ptr).expect("of").device, d);
                if n > 1 {
                    gpu.enable_peer_access((d + 1) % n).expect("peer access");
                    gpu.enable_peer_access((d + 1) % n)
                        .expect("peer access twice");
                }
                gpu.free(&a).expect("free");
            });
        }
    });
}
