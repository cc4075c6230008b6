//! The InfiniBand verbs transport of mscclpp-rs (MSCCL++'s `IBConnection`), for InfiniBand and RoCE.
//!
//! libibverbs is loaded at run time ([`library`]), so this crate builds and its binaries start on
//! hosts without rdma-core; there [`open_ib`] answers with `Error::IbUnavailable` saying why, in the
//! words of the IB-less stub (`mscclpp-noib`).
//!
//! PortChannel algorithms reach IB through [`VerbsConnector`], which the core's `connect_peers`
//! is handed (see [`connector`]); the example below is the lower-level use, one connection by hand.
//!
//! ```no_run
//! # fn demo(env: &mscclpp_core::env::Env, bootstrap: &dyn mscclpp_core::bootstrap::Bootstrap) -> mscclpp_core::Result<()> {
//! use mscclpp_core::Transport;
//! use mscclpp_ib::{open_ib, IbConfig, IbTransport};
//! let ctx = open_ib(env)?;
//! let mut buf = vec![0u8; 1 << 20];
//! // SAFETY: `buf` outlives `mem`.
//! let mem = unsafe { ctx.register(buf.as_mut_ptr(), buf.len())? };
//! let conn = IbTransport::connect_bootstrap(&ctx, IbConfig::new(0, 1), bootstrap, 7)?;
//! // ... exchange `mem.remote()` with the peer, then conn.write(...), conn.flush(...)
//! # Ok(()) }
//! ```

pub mod conn_info;
pub mod connector;
pub mod device;
pub mod ffi;
pub mod library;
pub mod transport;

pub use conn_info::{IbConnInfo, MemoryTable};
pub use connector::{IbPeerTransport, VerbsConnector};
pub use device::{HcaSpec, IbContext, IbMemory, PortInfo};
pub use library::Verbs;
pub use transport::{IbConfig, IbTransport};

use mscclpp_core::env::Env;
use mscclpp_core::{Error, Result};
use mscclpp_noib::IbUnavailableReason;
use std::sync::Arc;

/// Opens the first IB device (`TransportKind::Ib(0)`); see [`open_ib_index`].
pub fn open_ib(env: &Env) -> Result<IbContext> {
    open_ib_index(env, 0)
}

/// Opens HCA entry `index` of `MSCCLPP_HCA_DEVICES` (or of the devices libibverbs lists).
///
/// `Error::IbUnavailable`, most specific cause first: `MSCCLPP_DISABLE_IB_TESTS=1`; libibverbs
/// missing (naming each file tried); no device, or none of those named. Other failures (a verb
/// failing on a present device) are `Error::Driver` naming the verb, device and port.
pub fn open_ib_index(env: &Env, index: u8) -> Result<IbContext> {
    if env.disable_ib_tests {
        return Err(IbUnavailableReason::DisabledByEnv.into());
    }
    let verbs = Arc::new(Verbs::load(env)?);
    let found = verbs.device_names()?;
    if found.is_empty() {
        return Err(IbUnavailableReason::NoDevice {
            requested: env.hca_devices.clone(),
            found,
        }
        .into());
    }
    IbContext::open(verbs, env, index)
}

/// Why IB cannot be used here, or `None` if [`open_ib`] succeeds: what tests print when skipping.
pub fn ib_skip_reason(env: &Env) -> Option<String> {
    match open_ib(env) {
        Ok(_) => None,
        Err(e @ Error::IbUnavailable(_)) => Some(e.to_string()),
        Err(e) => Some(format!("opening IB failed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Env {
        Env::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()))).unwrap()
    }

    #[test]
    fn disabled_by_env_wins() {
        // Even with a library path that would fail, the explicit switch is the reason given.
        let e = open_ib(&env(&[
            ("MSCCLPP_DISABLE_IB_TESTS", "1"),
            ("MSCCLPP_IBV_SO", "/nonexistent/libibverbs.so"),
        ]))
        .unwrap_err();
        assert!(e.is_unavailable(), "{e:?}");
        assert!(e.to_string().contains("MSCCLPP_DISABLE_IB_TESTS=1"), "{e}");
    }

    #[test]
    fn absent_library_is_unavailable() {
        let e = open_ib(&env(&[("MSCCLPP_IBV_SO", "/nonexistent/libibverbs.so.1")])).unwrap_err();
        assert!(matches!(e, Error::IbUnavailable(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.starts_with("InfiniBand is unavailable: libibverbs could not be loaded"),
            "{msg}"
        );
        assert!(msg.contains("/nonexistent/libibverbs.so.1"), "{msg}");
    }

    /// Whatever this host has, `open_ib` either works or says why in an `IbUnavailable`/`Driver`
    /// error; it never panics. On a host without HCAs (this CI) the reason is printed.
    #[test]
    fn host_default_opens_or_explains() {
        match open_ib(&env(&[])) {
            Ok(ctx) => eprintln!("IB available here: {ctx:?}"),
            Err(e) => {
                eprintln!("no IB here (expected on CI): {e}");
                assert!(
                    matches!(e, Error::IbUnavailable(_) | Error::Driver { .. }),
                    "{e:?}"
                );
            }
        }
    }

    #[test]
    fn skip_reason_mentions_cause() {
        let r = ib_skip_reason(&env(&[("MSCCLPP_DISABLE_IB_TESTS", "true")]));
        assert!(r.is_some_and(|r| r.contains("disabled")));
    }
}
