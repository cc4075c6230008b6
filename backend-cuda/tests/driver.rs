//! The driver probe: on machines without libcuda (CI, laptops) constructing the backend must give a
//! clear, skippable error and never panic inside cudarc's loader.

use mscclpp_core::gpu::Gpu;
use mscclpp_core::Error;
use mscclpp_cuda::CudaGpu;

#[test]
fn new_reports_missing_driver_clearly_or_works() {
    let outcome = std::panic::catch_unwind(CudaGpu::new);
    let result = outcome.expect("CudaGpu::new panicked instead of returning an error");
    match result {
        Ok(gpu) => {
            let n = gpu.device_count().expect("device_count");
            eprintln!("libcuda present: {n} device(s)");
            assert_eq!(gpu.backend_name(), "cuda");
        }
        Err(e) => {
            assert!(
                e.is_unavailable(),
                "absence must be an 'unavailable' error: {e}"
            );
            match &e {
                Error::BackendUnavailable { backend, reason } => {
                    assert_eq!(backend, "cuda");
                    assert!(reason.contains("libcuda.so.1"), "{reason}");
                }
                other => panic!("expected BackendUnavailable, got {other:?}"),
            }
            // Asking again gives the same answer (the probe is cached, not retried into a panic).
            assert!(CudaGpu::new().is_err());
        }
    }
}
