//! Helpers for the workspace's compile-only kernel tests (NVRTC on a machine with no GPU). They
//! panic by design: a unit that does not compile must fail its test, naming the unit.
//! [`for_each_on_all_cores`] also spreads the build tool's compiles (`mscclpp-aot`).

use crate::nvrtc::{CompileRequest, Nvrtc};

/// NVRTC, or `None` after printing why `test` is skipped. With `MSCCLPP_REQUIRE_NVRTC=1` (CI) an
/// absent NVRTC fails the test instead, so CI never skips a compile silently.
pub fn nvrtc_or_skip(test: &str) -> Option<Nvrtc> {
    match Nvrtc::load() {
        Ok(n) => Some(n),
        Err(e) if std::env::var("MSCCLPP_REQUIRE_NVRTC").as_deref() == Ok("1") => {
            panic!("{test}: MSCCLPP_REQUIRE_NVRTC=1 but NVRTC is unavailable: {e}")
        }
        Err(e) => {
            eprintln!("skipping {test}: {e}");
            None
        }
    }
}

/// Compiles `source` for `arch` with the in-memory `headers` and returns the CUBIN; panics with
/// NVRTC's log, naming `name` and `arch`, if it does not compile or yields no CUBIN.
pub fn compile_cubin(
    nvrtc: &Nvrtc,
    name: &str,
    source: &str,
    arch: &str,
    headers: &[(&str, &str)],
) -> Vec<u8> {
    let req = CompileRequest {
        name,
        source,
        arch,
        headers,
        options: &[],
    };
    let k = nvrtc
        .compile(&req)
        .unwrap_or_else(|e| panic!("{name} for {arch}: {e}"));
    assert!(
        k.image.starts_with(b"\x7fELF"),
        "{name} for {arch}: not a CUBIN"
    );
    k.image
}

/// NVRTC's option that stops after the front end: the source is parsed and every template the
/// entry points use is instantiated and type-checked, but no PTX or CUBIN is generated.
pub const SYNTAX_ONLY: &str = "-fdevice-syntax-only";

/// Runs NVRTC's front end on `source` for `arch` ([`SYNTAX_ONLY`]); panics with NVRTC's log, naming
/// `name` and `arch`, if it does not compile. About 0.2 s a unit where a CUBIN takes 1-6 s: the
/// gates optimise one variant of each kind to a CUBIN and put the rest through the front end,
/// where the variants differ (the reduction op is a template parameter).
pub fn check_syntax(nvrtc: &Nvrtc, name: &str, source: &str, arch: &str, headers: &[(&str, &str)]) {
    let options = [SYNTAX_ONLY.to_string()];
    let req = CompileRequest {
        name,
        source,
        arch,
        headers,
        options: &options,
    };
    if let Err(e) = nvrtc.compile(&req) {
        panic!("{name} for {arch} (front end only): {e}");
    }
}

/// Whether the compiled `image` names the (extern "C", so unmangled) entry point `entry`.
pub fn has_symbol(image: &[u8], entry: &str) -> bool {
    let sym = format!("{entry}\0");
    image.windows(sym.len()).any(|w| w == sym.as_bytes())
}

/// Runs `f` on every item from as many threads as the machine has cores: NVRTC compiles a unit on
/// one thread, and a gate's units are independent, so on CI's two cores a serial loop leaves one
/// idle. A panic in `f` (a unit that does not compile) fails the caller once the threads are done.
pub fn for_each_on_all_cores<T: Sync>(items: &[T], f: impl Fn(&T) + Sync) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..workers.min(items.len()) {
            s.spawn(|| {
                while let Some(item) = items.get(next.fetch_add(1, Ordering::Relaxed)) {
                    f(item);
                }
            });
        }
    });
}
