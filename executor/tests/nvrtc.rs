//! The GPU interpreter's unit compiles through NVRTC for every (dtype, accumulator) pair and goes
//! through the front end for every op, with the static_asserts of its structs against the Rust
//! layout (skipped with a printed reason when NVRTC is absent, unless MSCCLPP_REQUIRE_NVRTC=1);
//! and every plan program compiled into its unit (the executor's specialised units) does too.

mod common;

use mscclpp_core::{AccumType, DataType, ReduceOp};
use mscclpp_cuda::compile_test::{
    check_syntax, compile_cubin, for_each_on_all_cores, has_symbol, nvrtc_or_skip,
};
use mscclpp_executor::encode::encode;
use mscclpp_executor::{builder, Plan, PlanReduceOp, Protocol};
use mscclpp_kernels_cu::collectives::reduce_type_pairs;
use mscclpp_kernels_cu::executor::{
    layout_asserts, specialised_unit_source, unit_source, PlanFeatures, ENTRY,
};

fn accum_for(dtype: DataType, acc: DataType) -> AccumType {
    match acc {
        a if a == dtype => AccumType::Auto,
        DataType::F16 => AccumType::F16,
        _ => AccumType::F32,
    }
}

/// Every (dtype, accumulator) pair with Sum on sm_90, and two other architectures; the other ops
/// go through the front end below.
fn cases() -> Vec<(DataType, DataType, ReduceOp, &'static str)> {
    let mut cases: Vec<(DataType, DataType, ReduceOp, &str)> = reduce_type_pairs()
        .into_iter()
        .map(|(d, a)| (d, a, ReduceOp::Sum, "sm_90"))
        .collect();
    cases.push((DataType::Bf16, DataType::F32, ReduceOp::Sum, "sm_80"));
    cases.push((DataType::F16, DataType::F16, ReduceOp::Max, "sm_100"));
    cases
}

/// Every op of every pair through NVRTC's front end (every template instantiated and checked,
/// ~0.2 s a unit where a CUBIN takes most of a minute): the op only picks the `ReduceFn<Op>`
/// applied to the pair's types, which the CUBINs above optimise for Sum.
#[test]
fn interpreter_passes_the_front_end_for_every_op() {
    let Some(nvrtc) = nvrtc_or_skip("interpreter_passes_the_front_end_for_every_op") else {
        return;
    };
    let mut units = Vec::new();
    for (dtype, acc) in reduce_type_pairs() {
        for op in ReduceOp::ALL {
            let (name, mut src) =
                unit_source(dtype, accum_for(dtype, acc), op, PlanFeatures::ALL).expect("source");
            src.push_str(&layout_asserts());
            units.push((name, src));
        }
    }
    for_each_on_all_cores(&units, |(name, src)| {
        check_syntax(&nvrtc, name, src, "sm_90", mscclpp_kernels_cu::HEADERS);
    });
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

/// Every rank's program of every non-NVLS fixture plan and of the builder's plans (pipelines
/// and port channels, which the fixtures lack), compiled into its unit
/// (`specialised_unit_source`): through the front end for every rank, and optimised to a CUBIN
/// with the entry point for rank 0 of one plan per kind of program (Simple with signals and
/// waits, LL packets, a pipeline, port channels; 1-7 s each, where the fixtures' largest unit
/// takes 22 s).
#[test]
fn every_plan_program_compiles_specialised() {
    let Some(nvrtc) = nvrtc_or_skip("every_plan_program_compiles_specialised") else {
        return;
    };
    const OPTIMISED: [&str; 4] = [
        "reduce_2gpu.json",
        "reduce_pack_2gpu.json",
        "builder pipelined",
        "builder port",
    ];
    let mut plans: Vec<(String, Plan)> = common::fixtures()
        .into_iter()
        .map(|(name, bytes)| {
            let plan = Plan::from_json(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, plan)
        })
        .filter(|(_, plan)| !plan.needs_switch())
        .collect();
    for (name, json) in [
        (
            "builder pipelined",
            builder::pipelined_allreduce(2, PlanReduceOp::Sum, 4096),
        ),
        (
            "builder port",
            builder::port_allreduce(2, Protocol::Simple, PlanReduceOp::Sum),
        ),
        (
            "builder port LL",
            builder::port_allreduce(2, Protocol::Ll, PlanReduceOp::Max),
        ),
    ] {
        let plan = Plan::from_json(json.to_string().as_bytes()).expect("a builder plan");
        plans.push((name.to_string(), plan));
    }
    let mut jobs = Vec::new();
    for (name, plan) in &plans {
        for rank in 0..plan.world_size() {
            let enc = encode(plan, rank, false).unwrap_or_else(|e| panic!("{name}: {e}"));
            let (unit, src) = specialised_unit_source(
                DataType::Bf16,
                AccumType::Auto,
                ReduceOp::Sum,
                enc.features(),
                &enc.static_program(),
            )
            .expect("source");
            let optimise = rank == 0 && OPTIMISED.contains(&name.as_str());
            jobs.push((format!("{name}, rank {rank}"), unit, src, optimise));
        }
    }
    for_each_on_all_cores(&jobs, |(what, unit, src, optimise)| {
        if *optimise {
            let image = compile_cubin(&nvrtc, unit, src, "sm_90", mscclpp_kernels_cu::HEADERS);
            assert!(has_symbol(&image, ENTRY), "{what}: {unit} lacks {ENTRY}");
        } else {
            check_syntax(&nvrtc, unit, src, "sm_90", mscclpp_kernels_cu::HEADERS);
        }
    });
}
