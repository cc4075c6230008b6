//! Every native collective kernel variant compiles through NVRTC for sm_90 (skipped with a printed
//! reason when NVRTC is absent, unless MSCCLPP_REQUIRE_NVRTC=1).

use mscclpp_core::{DataType, ReduceOp};
use mscclpp_cuda::compile_test::{compile_cubin, for_each_on_all_cores, has_symbol, nvrtc_or_skip};
use mscclpp_cuda::Nvrtc;
use mscclpp_kernels_cu::collectives::{self as kc, CollectiveFile, ReduceSpec};

fn compile(nvrtc: &Nvrtc, name: &str, source: &str) -> Vec<u8> {
    compile_for(nvrtc, name, source, "sm_90")
}

fn compile_for(nvrtc: &Nvrtc, name: &str, source: &str, arch: &str) -> Vec<u8> {
    compile_cubin(nvrtc, name, source, arch, mscclpp_kernels_cu::HEADERS)
}

#[test]
fn every_collective_variant_compiles_for_sm_90() {
    let Some(nvrtc) = nvrtc_or_skip("every_collective_variant_compiles_for_sm_90") else {
        return;
    };
    let mut units = Vec::new();
    for file in CollectiveFile::ALL {
        if !file.reduces() {
            let mut src = kc::unit_source(file, None).expect("source");
            src.push_str(&kc::layout_asserts());
            units.push((kc::unit_name(file, None), src));
            continue;
        }
        for (dtype, acc) in kc::reduce_type_pairs() {
            for op in ReduceOp::ALL {
                let spec = Some(ReduceSpec { dtype, acc, op });
                let src = kc::unit_source(file, spec).expect("source");
                units.push((kc::unit_name(file, spec), src));
            }
        }
    }
    for_each_on_all_cores(&units, |(name, src)| {
        compile(&nvrtc, name, src);
    });
}

/// The scratch pipeline kernels (default_allreduce_rsag[_pipeline], default_allreduce_rsag_push,
/// default_allreduce_fullmesh, default_allgather_fullmesh) on the other architectures CI targets, for a spread of element
/// sizes, accumulators and ops; every type and op for sm_90 is covered above. Each entry point must
/// be in the CUBIN's symbols (extern "C", so unmangled).
#[test]
fn scratch_pipeline_kernels_compile_for_sm_80_and_sm_100() {
    let Some(nvrtc) = nvrtc_or_skip("scratch_pipeline_kernels_compile_for_sm_80_and_sm_100") else {
        return;
    };
    let specs = [
        (DataType::F32, DataType::F32, ReduceOp::Sum),
        (DataType::Bf16, DataType::F32, ReduceOp::Avg),
        (DataType::Fp8E4M3, DataType::F16, ReduceOp::Max),
        (DataType::U8, DataType::U8, ReduceOp::Prod),
        (DataType::F64, DataType::F64, ReduceOp::Min),
    ];
    for arch in ["sm_80", "sm_100"] {
        for (dtype, acc, op) in specs {
            let spec = Some(ReduceSpec { dtype, acc, op });
            let name = kc::unit_name(CollectiveFile::AllReduce, spec);
            let src = kc::unit_source(CollectiveFile::AllReduce, spec).expect("source");
            let image = compile_for(&nvrtc, &name, &src, arch);
            for entry in [
                "allreduce_rsag",
                "allreduce_rsag_push",
                "allreduce_fullmesh",
            ] {
                assert!(has_symbol(&image, entry), "{name} for {arch} lacks {entry}");
            }
        }
        let name = kc::unit_name(CollectiveFile::AllGather, None);
        let src = kc::unit_source(CollectiveFile::AllGather, None).expect("source");
        let image = compile_for(&nvrtc, &name, &src, arch);
        assert!(
            has_symbol(&image, "allgather_fullmesh"),
            "{name} for {arch}"
        );
    }
}

/// `file`'s unit with `asserts` (the static_asserts of its argument structs against the Rust
/// layout) compiles for every architecture CI targets, with every entry point in the CUBIN.
fn unit_compiles_for_every_arch(test: &str, file: CollectiveFile, asserts: &str) {
    let Some(nvrtc) = nvrtc_or_skip(test) else {
        return;
    };
    let mut src = kc::unit_source(file, None).expect("source");
    src.push_str(asserts);
    for arch in ["sm_80", "sm_90", "sm_100"] {
        let image = compile_for(&nvrtc, &kc::unit_name(file, None), &src, arch);
        for entry in file.entry_points() {
            assert!(has_symbol(&image, entry), "{entry} missing for {arch}");
        }
    }
}

#[test]
fn alltoall_unit_compiles_for_every_arch() {
    unit_compiles_for_every_arch(
        "alltoall_unit_compiles_for_every_arch",
        CollectiveFile::AllToAll,
        &mscclpp_kernels_cu::alltoall::layout_asserts(),
    );
}

#[test]
fn p2p_unit_compiles_for_every_arch() {
    unit_compiles_for_every_arch(
        "p2p_unit_compiles_for_every_arch",
        CollectiveFile::P2p,
        &mscclpp_kernels_cu::p2p::layout_asserts(),
    );
}
