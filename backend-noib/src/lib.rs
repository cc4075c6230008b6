//! The IB-less transport stub: builds everywhere and answers every InfiniBand request with
//! [`Error::IbUnavailable`] saying exactly why IB cannot be used here.
//!
//! The facade uses [`NoIbTransport`] wherever an IB connection is asked for and the build has no
//! IB transport, or the run-time check ([`ib_unavailable_reason`]) rules IB out. Failing at the first
//! call with a reason (rather than at link time, or silently falling back to another transport)
//! keeps the user's choice of transport visible: an IB job that would run over TCP at a tenth of the
//! speed is worse than one that stops and says why.

use mscclpp_core::env::Env;
use mscclpp_core::transport::{MemoryRegion, Transport, TransportKind};
use mscclpp_core::{Error, Result};
use std::fmt;
use std::path::Path;
use std::time::Duration;

/// Where Linux lists RDMA devices (one directory per HCA, e.g. `mlx5_0`).
pub const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";

/// Why InfiniBand cannot be used in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IbUnavailableReason {
    /// This build has no IB transport (the facade's `ib` feature is off).
    NotBuilt,
    /// No usable HCA: none found at all, or `MSCCLPP_HCA_DEVICES` names none of those found.
    NoDevice {
        /// The HCAs `MSCCLPP_HCA_DEVICES` asked for (empty: any).
        requested: Vec<String>,
        /// The HCAs present on this host.
        found: Vec<String>,
    },
    /// `MSCCLPP_DISABLE_IB_TESTS` is set true.
    DisabledByEnv,
}

impl fmt::Display for IbUnavailableReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IbUnavailableReason::NotBuilt => f.write_str(
                "mscclpp-rs was built without the `ib` feature; rebuild with `--features ib` to use \
                 InfiniBand",
            ),
            IbUnavailableReason::NoDevice { requested, found } if requested.is_empty() => {
                write!(f, "no InfiniBand HCA found under {SYSFS_INFINIBAND}")?;
                if !found.is_empty() {
                    write!(f, " (found: {})", found.join(", "))?;
                }
                Ok(())
            }
            IbUnavailableReason::NoDevice { requested, found } => {
                write!(
                    f,
                    "MSCCLPP_HCA_DEVICES={} names none of the HCAs on this host ({})",
                    requested.join(","),
                    if found.is_empty() {
                        "none found".to_string()
                    } else {
                        format!("found: {}", found.join(", "))
                    }
                )
            }
            IbUnavailableReason::DisabledByEnv => {
                f.write_str("InfiniBand is disabled by MSCCLPP_DISABLE_IB_TESTS=1")
            }
        }
    }
}

impl From<IbUnavailableReason> for Error {
    fn from(reason: IbUnavailableReason) -> Self {
        Error::IbUnavailable(reason.to_string())
    }
}

/// HCA names listed in `sysfs_dir`, sorted; a missing directory means none.
pub fn list_hcas(sysfs_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = match std::fs::read_dir(sysfs_dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect(),
        Err(_) => Vec::new(),
    };
    names.sort();
    names
}

/// Decides at run time why IB is unavailable, most specific reason first: the user's explicit
/// switch, then missing hardware, then (hardware present, nothing forbids it) the build.
pub fn ib_unavailable_reason(env: &Env) -> IbUnavailableReason {
    ib_unavailable_reason_in(env, Path::new(SYSFS_INFINIBAND))
}

/// [`ib_unavailable_reason`] with the sysfs directory given (tests point it at a fake tree).
pub fn ib_unavailable_reason_in(env: &Env, sysfs_dir: &Path) -> IbUnavailableReason {
    if env.disable_ib_tests {
        return IbUnavailableReason::DisabledByEnv;
    }
    let found = list_hcas(sysfs_dir);
    // NCCL-style entries may carry a port (`mlx5_0:1`); the device name is what must exist.
    let wanted = |name: &str| {
        env.hca_devices
            .iter()
            .any(|r| r.split(':').next() == Some(name))
    };
    let usable = if env.hca_devices.is_empty() {
        !found.is_empty()
    } else {
        found.iter().any(|n| wanted(n))
    };
    if usable {
        IbUnavailableReason::NotBuilt
    } else {
        IbUnavailableReason::NoDevice {
            requested: env.hca_devices.clone(),
            found,
        }
    }
}

/// A connection of kind `Ib(index)` that refuses every operation with its reason.
#[derive(Debug, Clone)]
pub struct NoIbTransport {
    index: u8,
    remote_rank: usize,
    reason: IbUnavailableReason,
}

impl NoIbTransport {
    pub fn new(index: u8, remote_rank: usize, reason: IbUnavailableReason) -> Self {
        NoIbTransport {
            index,
            remote_rank,
            reason,
        }
    }

    /// A stub whose reason is decided from `env` and this host.
    pub fn from_env(env: &Env, index: u8, remote_rank: usize) -> Self {
        Self::new(index, remote_rank, ib_unavailable_reason(env))
    }

    pub fn reason(&self) -> &IbUnavailableReason {
        &self.reason
    }

    fn refuse<T>(&self, op: &str) -> Result<T> {
        Err(Error::IbUnavailable(format!(
            "{op} to rank {} over IB{}: {}",
            self.remote_rank, self.index, self.reason
        )))
    }
}

impl Transport for NoIbTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Ib(self.index)
    }

    fn remote_rank(&self) -> usize {
        self.remote_rank
    }

    fn write(
        &self,
        _dst: &MemoryRegion,
        _dst_offset: u64,
        _src: &MemoryRegion,
        _src_offset: u64,
        _bytes: u64,
    ) -> Result<()> {
        self.refuse("write")
    }

    fn update_and_sync(
        &self,
        _dst: &MemoryRegion,
        _dst_offset: u64,
        _new_value: u64,
    ) -> Result<()> {
        self.refuse("update_and_sync")
    }

    fn flush(&self, _timeout: Duration) -> Result<()> {
        self.refuse("flush")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;
    use std::path::PathBuf;

    /// A sysfs-like directory holding one entry per HCA name.
    fn fake_sysfs(tag: &str, hcas: &[&str]) -> std::io::Result<PathBuf> {
        let dir = std::env::temp_dir().join(format!("mscclpp-noib-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        for h in hcas {
            std::fs::create_dir(dir.join(h))?;
        }
        Ok(dir)
    }

    fn env(pairs: &[(&str, &str)]) -> Env {
        Env::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()))).unwrap()
    }

    #[rstest]
    #[case("none", &[], &[], "no InfiniBand HCA found under /sys/class/infiniband")]
    #[case("some", &["mlx5_0", "mlx5_1"], &[], "built without the `ib` feature")]
    #[case("named", &["mlx5_0", "mlx5_1"], &[("MSCCLPP_HCA_DEVICES", "mlx5_1:1")], "built without the `ib` feature")]
    #[case("wrong", &["mlx5_0"], &[("MSCCLPP_HCA_DEVICES", "mlx5_7,mlx5_8")],
           "MSCCLPP_HCA_DEVICES=mlx5_7,mlx5_8 names none of the HCAs on this host (found: mlx5_0)")]
    #[case("wrongempty", &[], &[("MSCCLPP_HCA_DEVICES", "mlx5_7")],
           "MSCCLPP_HCA_DEVICES=mlx5_7 names none of the HCAs on this host (none found)")]
    #[case("disabled", &["mlx5_0"], &[("MSCCLPP_DISABLE_IB_TESTS", "1")], "disabled by MSCCLPP_DISABLE_IB_TESTS=1")]
    fn reason_decided_at_run_time(
        #[case] tag: &str,
        #[case] hcas: &[&str],
        #[case] vars: &[(&str, &str)],
        #[case] text: &str,
    ) {
        let dir = fake_sysfs(tag, hcas).unwrap();
        let reason = ib_unavailable_reason_in(&env(vars), &dir);
        let _ = std::fs::remove_dir_all(&dir);
        let shown = reason.to_string();
        assert!(shown.contains(text), "{shown:?} lacks {text:?}");
    }

    #[test]
    fn missing_sysfs_means_no_device() {
        let reason = ib_unavailable_reason_in(&env(&[]), Path::new("/nonexistent/infiniband"));
        assert_eq!(
            reason,
            IbUnavailableReason::NoDevice {
                requested: vec![],
                found: vec![]
            }
        );
    }

    #[rstest]
    #[case(IbUnavailableReason::NotBuilt, "`ib` feature")]
    #[case(IbUnavailableReason::DisabledByEnv, "MSCCLPP_DISABLE_IB_TESTS=1")]
    #[case(IbUnavailableReason::NoDevice { requested: vec![], found: vec![] }, "no InfiniBand HCA")]
    fn every_method_refuses_with_the_reason(
        #[case] reason: IbUnavailableReason,
        #[case] text: &str,
    ) {
        let t = NoIbTransport::new(2, 5, reason);
        assert_eq!(t.kind(), TransportKind::Ib(2));
        assert_eq!(t.remote_rank(), 5);
        let region = MemoryRegion {
            addr: 0,
            size: 64,
            key: 0,
        };
        let errors = [
            t.write(&region, 0, &region, 0, 8).unwrap_err(),
            t.update_and_sync(&region, 0, 1).unwrap_err(),
            t.flush(Duration::from_millis(1)).unwrap_err(),
        ];
        for (e, op) in errors.iter().zip(["write", "update_and_sync", "flush"]) {
            assert!(matches!(e, Error::IbUnavailable(_)), "{e:?}");
            assert!(e.is_unavailable());
            let msg = e.to_string();
            assert!(msg.starts_with("InfiniBand is unavailable: "), "{msg}");
            assert!(
                msg.contains(op) && msg.contains("rank 5") && msg.contains("IB2"),
                "{msg}"
            );
            assert!(msg.contains(text), "{msg}");
        }
    }

    #[test]
    fn reason_converts_into_error() {
        let e: Error = IbUnavailableReason::NotBuilt.into();
        assert!(matches!(e, Error::IbUnavailable(ref m) if m.contains("--features ib")));
    }
}
