//! The GPU interpreter's unit compiles through NVRTC for every (dtype, accumulator) pair, with
//! the static_asserts of its structs against the Rust layout (skipped with a printed reason when
//! NVRTC is absent, unless MSCCLPP_REQUIRE_NVRTC=1).

use mscclpp_core::{AccumType, DataType, ReduceOp};
use mscclpp_cuda::compile_test::{compile_cubin, has_symbol, nvrtc_or_skip};
use mscclpp_kernels_cu::collectives::reduce_type_pairs;
use mscclpp_kernels_cu::executor::{layout_asserts, unit_source, ENTRY};

fn accum_for(dtype: DataType, acc: DataType) -> AccumType {
    match acc {
        a if a == dtype => AccumType::Auto,
        DataType::F16 => AccumType::F16,
        _ => AccumType::F32,
    }
}

#[test]
fn interpreter_compiles_for_every_type_and_op() {
    let Some(nvrtc) = nvrtc_or_skip("interpreter_compiles_for_every_type_and_op") else {
        return;
    };
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
    for (dtype, acc, op, arch) in cases {
        let (name, mut src) = unit_source(dtype, accum_for(dtype, acc), op).expect("source");
        src.push_str(&layout_asserts());
        let image = compile_cubin(&nvrtc, &name, &src, arch, mscclpp_kernels_cu::HEADERS);
        assert!(has_symbol(&image, ENTRY), "{name} for {arch} lacks {ENTRY}");
    }
}
