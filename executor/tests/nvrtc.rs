//! The GPU interpreter's unit compiles through NVRTC for every (dtype, accumulator) pair, with
//! the static_asserts of its structs against the Rust layout (skipped with a printed reason when
//! NVRTC is absent, unless MSCCLPP_REQUIRE_NVRTC=1).

use mscclpp_core::{AccumType, DataType, ReduceOp};
use mscclpp_cuda::compile_test::{compile_cubin, has_symbol, nvrtc_or_skip};
use mscclpp_kernels_cu::collectives::reduce_type_pairs;
use mscclpp_kernels_cu::executor::{layout_asserts, unit_source, PlanFeatures, ENTRY};

fn accum_for(dtype: DataType, acc: DataType) -> AccumType {
    match acc {
        a if a == dtype => AccumType::Auto,
        DataType::F16 => AccumType::F16,
        _ => AccumType::F32,
    }
}

/// Every (dtype, accumulator) pair with Sum on sm_90, the other ops on three types, and two other
/// architectures.
fn cases() -> Vec<(DataType, DataType, ReduceOp, &'static str)> {
    let mut cases: Vec<(DataType, DataType, ReduceOp, &str)> = reduce_type_pairs()
        .into_iter()
        .map(|(d, a)| (d, a, ReduceOp::Sum, "sm_90"))
        .collect();
    for op in [ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
        cases.push((DataType::F32, DataType::F32, op, "sm_90"));
        cases.push((DataType::Fp8E4M3, DataType::F32, op, "sm_90"));
        cases.push((DataType::I32, DataType::I32, op, "sm_90"));
    }
    cases.push((DataType::Bf16, DataType::F32, ReduceOp::Sum, "sm_80"));
    cases.push((DataType::F16, DataType::F16, ReduceOp::Max, "sm_100"));
    cases
}

/// Compiles every `SHARDS`-th case from `shard`: the shards are separate tests, so the test
/// harness compiles them side by side (each unit takes NVRTC most of a minute; CI has 2 cores).
fn compile_shard(test: &str, shard: usize) {
    let Some(nvrtc) = nvrtc_or_skip(test) else {
        return;
    };
    for (dtype, acc, op, arch) in cases().into_iter().skip(shard).step_by(SHARDS) {
        let (name, mut src) =
            unit_source(dtype, accum_for(dtype, acc), op, PlanFeatures::ALL).expect("source");
        src.push_str(&layout_asserts());
        let image = compile_cubin(&nvrtc, &name, &src, arch, mscclpp_kernels_cu::HEADERS);
        assert!(has_symbol(&image, ENTRY), "{name} for {arch} lacks {ENTRY}");
    }
}

const SHARDS: usize = 2;

#[test]
fn interpreter_compiles_for_every_type_and_op_shard_0() {
    compile_shard("interpreter_compiles_for_every_type_and_op_shard_0", 0);
}

#[test]
fn interpreter_compiles_for_every_type_and_op_shard_1() {
    compile_shard("interpreter_compiles_for_every_type_and_op_shard_1", 1);
}

/// The specialised units (a plan without packets, port channels or pipelines leaves their code
/// out): each combination of one feature at a time, and none, compiles.
#[test]
fn interpreter_compiles_without_the_features_a_plan_lacks() {
    let Some(nvrtc) = nvrtc_or_skip("interpreter_compiles_without_the_features_a_plan_lacks")
    else {
        return;
    };
    let none = PlanFeatures::default();
    for features in [
        none,
        PlanFeatures {
            packets: true,
            ..none
        },
        PlanFeatures {
            ports: true,
            ..none
        },
        PlanFeatures {
            pipelines: true,
            ..none
        },
    ] {
        let (name, mut src) =
            unit_source(DataType::Bf16, AccumType::Auto, ReduceOp::Sum, features).expect("source");
        src.push_str(&layout_asserts());
        let image = compile_cubin(&nvrtc, &name, &src, "sm_90", mscclpp_kernels_cu::HEADERS);
        assert!(has_symbol(&image, ENTRY), "{name} lacks {ENTRY}");
    }
}
