//! NVRTC compiles (skipped with a printed reason when NVRTC is absent, unless
//! MSCCLPP_REQUIRE_NVRTC=1) and the on-disk kernel cache.

mod common;

use common::{nvrtc_or_skip, SAMPLE_HEADERS, SAMPLE_KERNEL};
use mscclpp_core::Error;
use mscclpp_cuda::{CacheOutcome, CompileRequest, KernelCache};
use rstest::rstest;
use std::path::PathBuf;

fn request<'a>(arch: &'a str, options: &'a [String]) -> CompileRequest<'a> {
    CompileRequest {
        name: "scale",
        source: SAMPLE_KERNEL,
        arch,
        headers: SAMPLE_HEADERS,
        options,
    }
}

/// A fresh, empty folder for one test (removed by the guard).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("mscclpp-cuda-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn version_is_a_known_major() {
    let Some(nvrtc) = nvrtc_or_skip("version_is_a_known_major") else {
        return;
    };
    let (major, minor) = nvrtc.version();
    eprintln!("NVRTC {major}.{minor} from {}", nvrtc.location());
    assert!(major >= 12, "NVRTC {major}.{minor}");
    assert!(
        !nvrtc.include_dirs().is_empty(),
        "no folder with cuda_fp16.h found; bf16/fp8 kernels cannot compile"
    );
}

#[rstest]
#[case("sm_80")]
#[case("sm_90")]
#[case("sm_100")]
fn bf16_fp8_kernel_compiles_to_cubin(#[case] arch: &str) {
    let Some(nvrtc) = nvrtc_or_skip("bf16_fp8_kernel_compiles_to_cubin") else {
        return;
    };
    let k = nvrtc
        .compile(&request(arch, &[]))
        .unwrap_or_else(|e| panic!("{arch}: {e}"));
    assert!(
        k.image.starts_with(b"\x7fELF"),
        "{arch}: CUBIN is not an ELF image"
    );
    assert!(
        k.image.len() > 512,
        "{arch}: CUBIN of {} bytes",
        k.image.len()
    );
}

#[test]
fn compute_target_gives_ptx() {
    let Some(nvrtc) = nvrtc_or_skip("compute_target_gives_ptx") else {
        return;
    };
    let k = nvrtc.compile(&request("compute_90", &[])).expect("compile");
    let text = String::from_utf8_lossy(&k.image);
    assert!(text.contains(".target sm_90"), "not PTX for sm_90");
    assert!(text.contains("red.release.sys"), "inline PTX lost");
}

#[test]
fn caller_options_reach_the_compiler() {
    let Some(nvrtc) = nvrtc_or_skip("caller_options_reach_the_compiler") else {
        return;
    };
    let src = "#ifndef MUST_BE_SET\n#error MUST_BE_SET missing\n#endif\n#ifndef MSCCLPP_NVRTC\n#error no MSCCLPP_NVRTC\n#endif\nextern \"C\" __global__ void k() {}\n";
    let mut req = request("sm_90", &[]);
    req.source = src;
    assert!(matches!(nvrtc.compile(&req), Err(Error::Compile { .. })));
    let opts = ["-DMUST_BE_SET=1".to_string()];
    req.options = &opts;
    nvrtc.compile(&req).expect("compile with the define");
}

#[test]
fn broken_kernel_reports_the_nvrtc_log() {
    let Some(nvrtc) = nvrtc_or_skip("broken_kernel_reports_the_nvrtc_log") else {
        return;
    };
    let req = CompileRequest {
        name: "broken_kernel",
        source: "extern \"C\" __global__ void k(int* p) { p[0] = undeclared_name; }\n",
        arch: "sm_90",
        headers: &[],
        options: &[],
    };
    match nvrtc.compile(&req) {
        Err(Error::Compile { name, log }) => {
            assert_eq!(name, "broken_kernel");
            assert!(
                log.contains("undeclared_name"),
                "log does not name the problem: {log}"
            );
        }
        other => panic!("expected Error::Compile, got {other:?}"),
    }
}

#[test]
fn bad_arch_is_an_invalid_argument() {
    let Some(nvrtc) = nvrtc_or_skip("bad_arch_is_an_invalid_argument") else {
        return;
    };
    let err = nvrtc.compile(&request("gfx942", &[])).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.contains("gfx942")),
        "{err}"
    );
}

#[test]
fn cache_hits_on_second_use_and_keys_differ_by_arch() {
    let Some(nvrtc) = nvrtc_or_skip("cache_hits_on_second_use") else {
        return;
    };
    let dir = TempDir::new("cache-hit");
    let cache = KernelCache::new(&dir.0, nvrtc).expect("cache");
    let first = cache.get_or_compile(&request("sm_90", &[])).expect("first");
    assert_eq!(first.outcome, CacheOutcome::Compiled);
    let second = cache
        .get_or_compile(&request("sm_90", &[]))
        .expect("second");
    assert_eq!(second.outcome, CacheOutcome::Hit);
    assert_eq!(first.kernel, second.kernel);
    assert_eq!(first.key, second.key);
    eprintln!(
        "compile {:?}, cached load {:?}",
        first.elapsed, second.elapsed
    );

    let other = cache.get_or_compile(&request("sm_80", &[])).expect("sm_80");
    assert_eq!(other.outcome, CacheOutcome::Compiled);
    assert_ne!(other.key, first.key);
    let opts = ["-DEXTRA=1".to_string()];
    assert_ne!(
        cache.key(&request("sm_90", &opts)),
        cache.key(&request("sm_90", &[]))
    );

    let s = cache.stats();
    assert_eq!((s.compiles, s.hits, s.rebuilt), (2, 1, 0));
    assert!(s.compile_time >= first.elapsed);
}

#[rstest]
#[case::flipped_byte(|b: &mut Vec<u8>| { let i = b.len() / 2; b[i] ^= 0xff; })]
#[case::truncated(|b: &mut Vec<u8>| b.truncate(b.len() / 3))]
#[case::empty(|b: &mut Vec<u8>| b.clear())]
fn corrupt_cache_entry_is_rebuilt(#[case] damage: fn(&mut Vec<u8>)) {
    let Some(nvrtc) = nvrtc_or_skip("corrupt_cache_entry_is_rebuilt") else {
        return;
    };
    let dir = TempDir::new(&format!("cache-corrupt-{:p}", damage as *const ()));
    let cache = KernelCache::new(&dir.0, nvrtc).expect("cache");
    let req = request("sm_90", &[]);
    let good = cache.get_or_compile(&req).expect("compile");
    let path = cache.entry_path(&req);
    let mut bytes = std::fs::read(&path).expect("entry written");
    damage(&mut bytes);
    std::fs::write(&path, &bytes).expect("damage entry");

    let again = cache.get_or_compile(&req).expect("rebuild");
    assert_eq!(again.outcome, CacheOutcome::Rebuilt);
    assert_eq!(again.kernel.image, good.kernel.image);
    // The entry was replaced by a valid one.
    assert_eq!(
        cache.get_or_compile(&req).expect("hit").outcome,
        CacheOutcome::Hit
    );
    assert_eq!(cache.stats().rebuilt, 1);
}

/// Three threads (each its own open file description of the lock, as separate processes would have)
/// ask for one kernel at once: one compiles, the others wait for its entry and load it.
#[test]
fn concurrent_compiles_publish_one_valid_entry() {
    let Some(nvrtc) = nvrtc_or_skip("concurrent_compiles_publish_one_valid_entry") else {
        return;
    };
    let dir = TempDir::new("cache-race");
    let cache = KernelCache::new(&dir.0, nvrtc).expect("cache");
    let req = request("sm_80", &[]);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| s.spawn(|| cache.get_or_compile(&req)))
            .collect();
        for h in handles {
            h.join().expect("thread").expect("compile");
        }
    });
    assert_eq!(
        cache.get_or_compile(&req).expect("hit").outcome,
        CacheOutcome::Hit
    );
    let stats = cache.stats();
    assert_eq!((stats.compiles, stats.hits), (1, 3), "{stats:?}");
    // The entry and its lock file, no temp files.
    let mut files: Vec<String> = std::fs::read_dir(&dir.0)
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(
        files[0].ends_with(".kbin") && files[1].ends_with(".lock"),
        "{files:?}"
    );
}
