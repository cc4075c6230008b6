//! The GPU suite's own measurement kernels compile through NVRTC for sm_90, so a typo in them
//! fails CI instead of a device run (skipped with a printed reason when NVRTC is absent, unless
//! MSCCLPP_REQUIRE_NVRTC=1).

use mscclpp_cuda::{CompileRequest, Nvrtc};

#[test]
fn suite_measurement_kernels_compile_for_sm_90() {
    let nvrtc = match Nvrtc::load() {
        Ok(n) => n,
        Err(e) if std::env::var("MSCCLPP_REQUIRE_NVRTC").as_deref() == Ok("1") => {
            panic!("MSCCLPP_REQUIRE_NVRTC=1 but NVRTC is unavailable: {e}")
        }
        Err(e) => {
            eprintln!("skipping suite_measurement_kernels_compile_for_sm_90: {e}");
            return;
        }
    };
    for (name, source) in [
        ("gpu_suite_measure", mscclpp_tests::SUITE_KERNELS),
        (
            "port_channel_checks",
            mscclpp_tests::port_channel_checks::KERNELS,
        ),
    ] {
        let req = CompileRequest {
            name,
            source,
            arch: "sm_90",
            headers: mscclpp_kernels_cu::HEADERS,
            options: &[],
        };
        let k = nvrtc
            .compile(&req)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(k.image.starts_with(b"\x7fELF"), "{name}: not a CUBIN");
    }
}
