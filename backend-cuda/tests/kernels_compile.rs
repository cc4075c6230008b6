//! Every kernel translation unit of `mscclpp-kernels-cu`, and the device headers checked against the
//! Rust layout of `mscclpp_core::device`, compile through NVRTC for sm_80, sm_90 and sm_100 (every
//! unit optimised for sm_90, the architecture-dependent ones for all three; the rest through the
//! front end there: [`optimised_everywhere`]).
//!
//! A broken kernel or an ABI drift between `core/src/device.rs` and the `.cuh` headers fails here,
//! on machines without a GPU. Without NVRTC the tests print why they skip, unless
//! `MSCCLPP_REQUIRE_NVRTC=1` (CI), which turns absence into a failure.

mod common;

use common::nvrtc_or_skip;
use mscclpp_core::device::layout_static_asserts;
use mscclpp_core::{AccumType, DataType, Error};
use mscclpp_cuda::compile_test::{for_each_on_all_cores, has_symbol, SYNTAX_ONLY};
use mscclpp_cuda::{CompileRequest, CompiledKernel, Nvrtc};
use mscclpp_kernels_cu::{
    allreduce_entry_point, AllreduceKernel, KernelSource, HEADERS, KERNELS, PRIMITIVE_KERNELS,
    SWITCH_CHANNEL_KERNELS, TARGET_DEPENDENT_KERNELS,
};
use rstest::rstest;

const ARCHS: [&str; 3] = ["sm_80", "sm_90", "sm_100"];

fn compile(
    nvrtc: &Nvrtc,
    name: &str,
    source: &str,
    arch: &str,
    options: &[String],
) -> Result<CompiledKernel, Error> {
    nvrtc.compile(&CompileRequest {
        name,
        source,
        arch,
        headers: HEADERS,
        options,
    })
}

/// A translation unit that includes every header, then the static_asserts generated from Rust.
fn layout_unit(asserts: &str) -> String {
    let mut src: String = HEADERS
        .iter()
        .map(|(name, _)| format!("#include \"{name}\"\n"))
        .collect();
    src.push_str(asserts);
    src
}

/// Entry points the Rust side will ask for in the all-reduce unit of `dtype`.
fn expected_allreduce_entries(dtype: DataType) -> Vec<String> {
    let mut out = Vec::new();
    for kind in AllreduceKernel::ALL {
        for acc in [AccumType::Auto, AccumType::F16, AccumType::F32] {
            if let Ok((_, name)) = allreduce_entry_point(kind, dtype, acc) {
                out.push(name);
            }
        }
    }
    out
}

/// The target every unit is optimised for: the runtime's GPUs (H100, H200) with CUDA 13's NVRTC.
const PRIMARY_ARCH: &str = "sm_90";

/// Whether `unit` is optimised on the other targets (sm_80 and sm_100 with CUDA 13, sm_90 with
/// CUDA 12's NVRTC in scripts/test.sh), where every other unit goes through the front end only:
/// the code that differs between architectures and toolkits ([`TARGET_DEPENDENT_KERNELS`]), and
/// OCP e5m2, whose sm_89+ conversion is an instruction of its own. The other types (f64,
/// integers, the FNUZ and b15 fp8 formats in software) only instantiate the same templates with
/// other arithmetic, which the front end checks and the primary target optimises; the fp8
/// all-reduce units take 11-31 s each to optimise, and optimising every unit on all four targets
/// was about 520 s of CI's CPU.
fn optimised_everywhere(unit: &str) -> bool {
    TARGET_DEPENDENT_KERNELS.contains(&unit) || unit == "simple_allreduce_fp8_e5m2"
}

/// Entry points the unit's CUBIN must define.
fn expected_entries(unit: &str) -> Vec<String> {
    match unit {
        "primitives" => PRIMITIVE_KERNELS.iter().map(|s| s.to_string()).collect(),
        "switch_channel" => SWITCH_CHANNEL_KERNELS
            .iter()
            .map(|s| s.to_string())
            .collect(),
        _ => {
            let dtype = DataType::ALL
                .into_iter()
                .find(|d| unit == format!("simple_allreduce_{d}"))
                .unwrap_or_else(|| panic!("unit {unit} names no data type"));
            expected_allreduce_entries(dtype)
        }
    }
}

/// Every unit for every architecture ([`ARCHS`], or only `MSCCLPP_GATE_ARCH`): a CUBIN with its
/// entry points on the primary target and for [`optimised_everywhere`], the front end for the
/// rest; the (architecture, unit) pairs spread over every core.
#[test]
fn every_kernel_unit_compiles() {
    let Some(nvrtc) = nvrtc_or_skip("every_kernel_unit_compiles") else {
        return;
    };
    // scripts/test.sh's CUDA 12 pass builds one architecture (the others ran with CUDA 13).
    let only = std::env::var("MSCCLPP_GATE_ARCH").ok();
    if let Some(only) = &only {
        assert!(
            ARCHS.contains(&only.as_str()),
            "MSCCLPP_GATE_ARCH={only} is none of {ARCHS:?}"
        );
    }
    let primary_toolkit = nvrtc.version().0 >= 13;
    let jobs: Vec<(&str, &KernelSource)> = ARCHS
        .iter()
        .filter(|a| only.as_deref().is_none_or(|o| o == **a))
        .flat_map(|&a| KERNELS.iter().map(move |u| (a, u)))
        .collect();
    let failures = std::sync::Mutex::new(Vec::new());
    for_each_on_all_cores(&jobs, |&(arch, unit)| {
        let optimise = (primary_toolkit && arch == PRIMARY_ARCH) || optimised_everywhere(unit.name);
        let result = if optimise {
            compile(&nvrtc, unit.name, unit.source, arch, &[]).map(|k| {
                expected_entries(unit.name)
                    .into_iter()
                    .filter(|e| !has_symbol(&k.image, e))
                    .collect::<Vec<_>>()
            })
        } else {
            compile(
                &nvrtc,
                unit.name,
                unit.source,
                arch,
                &[SYNTAX_ONLY.to_string()],
            )
            .map(|_| Vec::new())
        };
        let failure = match result {
            Ok(missing) if missing.is_empty() => return,
            Ok(missing) => format!(
                "{} for {arch}: entry points missing from the image: {missing:?}",
                unit.name
            ),
            Err(e) => format!(
                "{} for {arch}{}: {e}",
                unit.name,
                if optimise { "" } else { " (front end only)" }
            ),
        };
        failures.lock().unwrap().push(failure);
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[rstest]
#[case(ARCHS[0])]
#[case(ARCHS[1])]
#[case(ARCHS[2])]
fn headers_match_the_rust_layout(#[case] arch: &str) {
    let Some(nvrtc) = nvrtc_or_skip("headers_match_the_rust_layout") else {
        return;
    };
    let src = layout_unit(&layout_static_asserts());
    if let Err(e) = compile(&nvrtc, "device_abi_layout", &src, arch, &[]) {
        panic!("device ABI layout check for {arch} failed:\n{e}");
    }
}

/// The check has teeth: a wrong size in the generated asserts is a compile error naming the struct.
#[test]
fn a_layout_mismatch_fails_to_compile() {
    let Some(nvrtc) = nvrtc_or_skip("a_layout_mismatch_fails_to_compile") else {
        return;
    };
    let asserts = layout_static_asserts();
    let needle = "sizeof(mscclpp::D2DSemaphoreHandle) == 40";
    assert!(asserts.contains(needle), "generated asserts changed shape");
    let broken = asserts.replace(needle, "sizeof(mscclpp::D2DSemaphoreHandle) == 48");
    match compile(
        &nvrtc,
        "device_abi_layout_broken",
        &layout_unit(&broken),
        "sm_90",
        &[],
    ) {
        Ok(_) => panic!("a wrong D2DSemaphoreHandle size compiled"),
        Err(Error::Compile { log, .. }) => {
            assert!(log.contains("D2DSemaphoreHandle"), "unexpected log: {log}")
        }
        Err(other) => panic!("expected a compile error, got {other}"),
    }
}
