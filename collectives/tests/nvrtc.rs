//! Every native collective kernel variant compiles through NVRTC for sm_90 (skipped with a printed
//! reason when NVRTC is absent, unless MSCCLPP_REQUIRE_NVRTC=1).

use mscclpp_core::ReduceOp;
use mscclpp_cuda::{CompileRequest, Nvrtc};
use mscclpp_kernels_cu::collectives::{self as kc, CollectiveFile, ReduceSpec};

fn nvrtc_or_skip(test: &str) -> Option<Nvrtc> {
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

fn compile(nvrtc: &Nvrtc, name: &str, source: &str) {
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

#[test]
fn every_collective_variant_compiles_for_sm_90() {
    let Some(nvrtc) = nvrtc_or_skip("every_collective_variant_compiles_for_sm_90") else {
        return;
    };
    for file in CollectiveFile::ALL {
        if !file.reduces() {
            let mut src = kc::unit_source(file, None).expect("source");
            src.push_str(&kc::layout_asserts());
            compile(&nvrtc, &kc::unit_name(file, None), &src);
            continue;
        }
        for (dtype, acc) in kc::reduce_type_pairs() {
            for op in ReduceOp::ALL {
                let spec = Some(ReduceSpec { dtype, acc, op });
                let src = kc::unit_source(file, spec).expect("source");
                compile(&nvrtc, &kc::unit_name(file, spec), &src);
            }
        }
    }
}
