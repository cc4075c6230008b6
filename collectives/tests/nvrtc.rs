//! Every native collective kernel variant goes through NVRTC for sm_90: each through the front end,
//! one per type pair to a CUBIN (skipped with a printed reason when NVRTC is absent, unless
//! MSCCLPP_REQUIRE_NVRTC=1).

use mscclpp_core::{DataType, ReduceOp};
use mscclpp_cuda::compile_test::{
    check_syntax, compile_cubin, for_each_on_all_cores, has_symbol, nvrtc_or_skip,
};
use mscclpp_cuda::Nvrtc;
use mscclpp_kernels_cu::collectives::{self as kc, CollectiveFile, ReduceSpec};

fn compile(nvrtc: &Nvrtc, name: &str, source: &str) -> Vec<u8> {
    compile_for(nvrtc, name, source, "sm_90")
}

fn compile_for(nvrtc: &Nvrtc, name: &str, source: &str, arch: &str) -> Vec<u8> {
    compile_cubin(nvrtc, name, source, arch, mscclpp_kernels_cu::HEADERS)
}

/// Each byte-oriented unit, and for each (type, accumulator) pair of the reducing files (the
/// `i`-th pair) the variants of the ops `ops(i)`.
fn variants(ops: impl Fn(usize) -> Vec<ReduceOp>) -> Vec<(CollectiveFile, Option<ReduceSpec>)> {
    let mut variants = Vec::new();
    for file in CollectiveFile::ALL {
        if !file.reduces() {
            variants.push((file, None));
            continue;
        }
        for (i, (dtype, acc)) in kc::reduce_type_pairs().into_iter().enumerate() {
            for op in ops(i) {
                variants.push((file, Some(ReduceSpec { dtype, acc, op })));
            }
        }
    }
    variants
}

/// The op whose variant of the `pair`-th (type, accumulator) pair is compiled to a CUBIN: the ops
/// take turns from pair to pair, so every op is optimised for some pairs.
fn optimised_op(pair: usize) -> ReduceOp {
    ReduceOp::ALL[pair % ReduceOp::ALL.len()]
}

/// Every variant through NVRTC's front end for sm_90 (every template instantiated and
/// type-checked, ~0.2 s a unit). No layout asserts (they need NVRTC 13.5): CI runs this test with
/// the CUDA 12 NVRTC too.
#[test]
fn every_collective_variant_passes_the_front_end() {
    let Some(nvrtc) = nvrtc_or_skip("every_collective_variant_passes_the_front_end") else {
        return;
    };
    let units: Vec<(String, String)> = variants(|_| ReduceOp::ALL.to_vec())
        .into_iter()
        .map(|(file, spec)| {
            let src = kc::unit_source(file, spec).expect("source");
            (kc::unit_name(file, spec), src)
        })
        .collect();
    for_each_on_all_cores(&units, |(name, src)| {
        check_syntax(&nvrtc, name, src, "sm_90", mscclpp_kernels_cu::HEADERS);
    });
}

/// One variant of each (file, type, accumulator) compiled to a sm_90 CUBIN, as the runtime builds
/// it (the byte-oriented units with the layout asserts), with every entry point in it: optimisation
/// and ptxas see every type pair, and every op across the pairs ([`optimised_op`]). Optimising
/// every op of every pair took 11 minutes of CI's two cores; the ops differ only in the template
/// parameter the front end checks above.
#[test]
fn every_collective_type_pair_compiles_for_sm_90() {
    let Some(nvrtc) = nvrtc_or_skip("every_collective_type_pair_compiles_for_sm_90") else {
        return;
    };
    let units = variants(|pair| vec![optimised_op(pair)]);
    for_each_on_all_cores(&units, |&(file, spec)| {
        let name = kc::unit_name(file, spec);
        let mut src = kc::unit_source(file, spec).expect("source");
        if spec.is_none() {
            src.push_str(&kc::layout_asserts());
        }
        let image = compile(&nvrtc, &name, &src);
        for entry in file.entry_points() {
            assert!(has_symbol(&image, entry), "{name}: {entry} missing");
        }
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

#[test]
fn ep_intranode_unit_compiles_for_every_arch() {
    unit_compiles_for_every_arch(
        "ep_intranode_unit_compiles_for_every_arch",
        CollectiveFile::EpIntranode,
        &mscclpp_kernels_cu::ep::layout_asserts(),
    );
}

/// The benchmark's device inputs and checks (kernels/bench_data.cu), which the main job loads
/// from the ahead-of-time blob.
#[test]
fn bench_data_unit_compiles_for_every_arch() {
    use mscclpp_kernels_cu::bench_data;
    let Some(nvrtc) = nvrtc_or_skip("bench_data_unit_compiles_for_every_arch") else {
        return;
    };
    let src = format!("{}{}", bench_data::SOURCE, bench_data::layout_asserts());
    for arch in ["sm_80", "sm_90", "sm_100"] {
        let image = compile_for(&nvrtc, bench_data::UNIT_NAME, &src, arch);
        assert!(
            has_symbol(&image, bench_data::ENTRY),
            "{} missing for {arch}",
            bench_data::ENTRY
        );
    }
}
