//! The SwitchChannel (NVLS) device code compiles to the multimem instructions on sm_90+ and to the
//! trap path on sm_80, through NVRTC and without a GPU. Nothing here runs device code: NVLS must
//! never run on shared machines unless MSCCLPP_ENABLE_NVLS=1 (DESIGN.md, "Safety on shared GPUs").

mod common;

use common::nvrtc_or_skip;
use mscclpp_cuda::CompileRequest;
use mscclpp_kernels_cu::{kernel, HEADERS, SWITCH_CHANNEL_KERNELS};
use rstest::rstest;

/// PTX of the `switch_channel` unit for `arch` (`compute_XX`), as text.
fn ptx(arch: &str) -> Option<String> {
    let nvrtc = nvrtc_or_skip("switch_channel_compile")?;
    let unit = kernel("switch_channel").expect("switch_channel unit is embedded");
    let compiled = nvrtc
        .compile(&CompileRequest {
            name: unit.name,
            source: unit.source,
            arch,
            headers: HEADERS,
            options: &[],
        })
        .unwrap_or_else(|e| panic!("switch_channel for {arch}: {e}"));
    Some(
        String::from_utf8_lossy(&compiled.image)
            .trim_end_matches('\0')
            .to_string(),
    )
}

#[rstest]
#[case::hopper("compute_90")]
#[case::blackwell("compute_100")]
fn multimem_instructions_on_sm90_and_newer(#[case] arch: &str) {
    let Some(text) = ptx(arch) else { return };
    for k in SWITCH_CHANNEL_KERNELS {
        assert!(
            text.contains(&format!(".entry {k}(")),
            "{arch}: entry {k} missing"
        );
    }
    for insn in [
        "multimem.ld_reduce.relaxed.sys.global.add.v4.f32",
        "multimem.ld_reduce.relaxed.sys.global.add.v4.f16x2",
        "multimem.ld_reduce.relaxed.sys.global.add.v4.bf16x2",
        "multimem.st.relaxed.sys.global.v4.f32",
        "multimem.st.relaxed.sys.global.v4.f16x2",
        "multimem.st.relaxed.sys.global.v4.bf16x2",
    ] {
        assert!(text.contains(insn), "{arch}: {insn} missing from the PTX");
    }
}

#[test]
fn sm80_compiles_to_the_trap_path() {
    let Some(text) = ptx("compute_80") else {
        return;
    };
    assert!(!text.contains("multimem"), "compute_80 PTX uses multimem");
    assert!(text.contains("trap;"), "compute_80 PTX has no trap");
    for k in SWITCH_CHANNEL_KERNELS {
        assert!(text.contains(&format!(".entry {k}(")), "entry {k} missing");
    }
}
