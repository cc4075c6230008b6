//! The first line the benchmark prints: which GPUs, driver, compiler and NCCL the numbers are for.

use mscclpp_core::gpu::{DeviceProperties, Gpu};
use std::ffi::c_int;

/// CUDA driver version as `13.0`, read from `libcuda.so.1` (`cuDriverGetVersion`), or `None` where
/// there is no CUDA driver (ROCm hosts).
pub fn cuda_driver_version() -> Option<String> {
    // SAFETY: libcuda's initialisers have no preconditions; the backend has loaded it already.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }.ok()?;
    // SAFETY: `CUresult cuDriverGetVersion(int*)`, callable before cuInit.
    let f = unsafe { lib.get::<unsafe extern "C" fn(*mut c_int) -> c_int>(b"cuDriverGetVersion") }
        .ok()?;
    let mut v: c_int = 0;
    // SAFETY: writes one int.
    let r = unsafe { f(&mut v) };
    (r == 0).then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

/// NVRTC version as `13.0` on the CUDA backend.
pub fn nvrtc_version(gpu: &dyn Gpu) -> Option<String> {
    if gpu.backend_name() != "cuda" {
        return None;
    }
    let nvrtc = mscclpp_cuda::Nvrtc::load().ok()?;
    let (major, minor) = nvrtc.version();
    Some(format!("{major}.{minor}"))
}

/// `2 x NVIDIA H200 (sm_90, 132 SMs, 140 GiB)`, folding identical devices together.
pub fn describe_devices(props: &[DeviceProperties]) -> String {
    let mut groups: Vec<(String, usize)> = Vec::new();
    for p in props {
        let d = format!(
            "{} ({}, {} SMs, {} GiB)",
            p.name,
            p.arch,
            p.multiprocessors,
            p.total_memory >> 30
        );
        match groups.iter_mut().find(|(g, _)| *g == d) {
            Some((_, n)) => *n += 1,
            None => groups.push((d, 1)),
        }
    }
    groups
        .iter()
        .map(|(d, n)| format!("{n} x {d}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The device line, without the `# device: ` the table prints before it.
pub fn device_line(
    devices: &str,
    backend: &str,
    driver: Option<&str>,
    nvrtc: Option<&str>,
    nccl: &str,
) -> String {
    format!(
        "{devices}; backend {backend}, driver {}, NVRTC {}; {nccl}",
        driver.unwrap_or("n/a"),
        nvrtc.unwrap_or("n/a")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::gpu::GpuVendor;

    fn props(name: &str) -> DeviceProperties {
        DeviceProperties {
            vendor: GpuVendor::Nvidia,
            name: name.into(),
            arch: "sm_90".into(),
            compute_major: 9,
            compute_minor: 0,
            multiprocessors: 132,
            warp_size: 32,
            total_memory: 140 << 30,
            pci_bus_id: "0000:19:00.0".into(),
            supports_vmm: true,
            supports_multicast: true,
            mps_client: false,
        }
    }

    #[test]
    fn identical_devices_fold() {
        let d = describe_devices(&[props("NVIDIA H200"), props("NVIDIA H200")]);
        assert_eq!(d, "2 x NVIDIA H200 (sm_90, 132 SMs, 140 GiB)");
        let mixed = describe_devices(&[props("A"), props("B")]);
        assert!(
            mixed.starts_with("1 x A") && mixed.contains(", 1 x B"),
            "{mixed}"
        );
        let line = device_line(&d, "cuda", Some("13.0"), None, "NCCL 2.28.9");
        assert_eq!(
            line,
            "2 x NVIDIA H200 (sm_90, 132 SMs, 140 GiB); backend cuda, driver 13.0, NVRTC n/a; NCCL 2.28.9"
        );
    }
}
