//! The GPU suite's own measurement kernels compile through NVRTC for sm_90, so a typo in them
//! fails CI instead of a device run (skipped with a printed reason when NVRTC is absent, unless
//! MSCCLPP_REQUIRE_NVRTC=1).

use mscclpp_cuda::compile_test::{compile_cubin, nvrtc_or_skip};

#[test]
fn suite_measurement_kernels_compile_for_sm_90() {
    let Some(nvrtc) = nvrtc_or_skip("suite_measurement_kernels_compile_for_sm_90") else {
        return;
    };
    for (name, source) in [
        ("gpu_suite_measure", mscclpp_tests::SUITE_KERNELS),
        (
            "port_channel_checks",
            mscclpp_tests::port_channel_checks::KERNELS,
        ),
    ] {
        compile_cubin(&nvrtc, name, source, "sm_90", mscclpp_kernels_cu::HEADERS);
    }
}
