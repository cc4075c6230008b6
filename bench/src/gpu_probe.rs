//! Counting local GPUs without loading any driver library.
//!
//! The bench must decide "GPU benchmark or bootstrap self-check" before it touches a backend, and
//! must not crash on a machine without drivers. Device nodes are what the drivers create per GPU:
//! `/dev/nvidiaN` (NVIDIA) and the KFD topology nodes with SIMD units (AMD; CPU nodes have none).
//! Once the facade crate exposes backend device enumeration, `main` can ask it instead.

use std::fs;
use std::path::Path;

/// GPUs found on this host, by vendor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuCount {
    pub nvidia: usize,
    pub amd: usize,
}

impl GpuCount {
    pub fn total(&self) -> usize {
        self.nvidia + self.amd
    }
}

pub fn probe() -> GpuCount {
    GpuCount {
        nvidia: count_nvidia(Path::new("/dev")),
        amd: count_amd(Path::new("/sys/class/kfd/kfd/topology/nodes")),
    }
}

/// `/dev/nvidia0`, `/dev/nvidia1`...; not `nvidiactl`, `nvidia-uvm` and friends.
fn count_nvidia(dev: &Path) -> usize {
    let Ok(entries) = fs::read_dir(dev) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("nvidia"))
                .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
        })
        .count()
}

/// KFD topology nodes whose `properties` list a non-zero `simd_count` are GPUs.
fn count_amd(nodes: &Path) -> usize {
    let Ok(entries) = fs::read_dir(nodes) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| {
            fs::read_to_string(e.path().join("properties")).is_ok_and(|p| {
                p.lines().any(|l| {
                    l.strip_prefix("simd_count ")
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .is_some_and(|v| v > 0)
                })
            })
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_device_nodes_only() {
        let dir = std::env::temp_dir().join(format!("mscclpp-bench-probe-{}", std::process::id()));
        let dev = dir.join("dev");
        fs::create_dir_all(&dev).unwrap();
        for n in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"] {
            fs::write(dev.join(n), b"").unwrap();
        }
        assert_eq!(count_nvidia(&dev), 2);
        let nodes = dir.join("nodes");
        for (i, simd) in [(0, 0), (1, 304), (2, 304)] {
            let d = nodes.join(i.to_string());
            fs::create_dir_all(&d).unwrap();
            fs::write(
                d.join("properties"),
                format!("cpu_cores_count 8\nsimd_count {simd}\n"),
            )
            .unwrap();
        }
        assert_eq!(count_amd(&nodes), 2);
        assert_eq!(count_amd(&dir.join("absent")), 0);
        fs::remove_dir_all(&dir).unwrap();
    }
}
