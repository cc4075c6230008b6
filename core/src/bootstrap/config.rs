//! `BootstrapConfig`: the explicit settings every `TcpBootstrap` constructor takes.
//!
//! Constructors never read the process environment themselves, so tests and embedders can run
//! several differently configured bootstraps in one process; [`BootstrapConfig::from_env`] is the
//! one place that maps `MSCCLPP_*` variables onto it.

use super::wire::Secret;
use crate::env::{Env, SocketFamily};
use std::time::Duration;

/// How a `TcpBootstrap` picks addresses and how long it waits.
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapConfig {
    /// Interface(s) for this rank's listening socket and the root's, NCCL syntax
    /// (`eth`, `=eth0`, `^docker`); `MSCCLPP_SOCKET_IFNAME`. `None`: the interface that routes to
    /// the root (for the root itself: the first up non-loopback interface).
    pub interface: Option<String>,
    /// Restrict addresses to IPv4 or IPv6; `MSCCLPP_SOCKET_FAMILY`. `None`: either, IPv4 first.
    pub family: Option<SocketFamily>,
    /// Bound on every blocking step: joining, connecting, each send and receive, each collective.
    /// `MSCCLPP_BOOTSTRAP_TIMEOUT`.
    pub timeout: Duration,
    /// A peer whose heartbeat (sent every few hundred milliseconds by a thread of its own once a
    /// communicator watches the bootstrap's failures) has been silent this long is stalled
    /// (stopped, hung): the job is aborted, blaming it. `MSCCLPP_LIVENESS_TIMEOUT`, by default
    /// `MSCCLPP_DEVICE_WAIT_TIMEOUT`.
    pub liveness_timeout: Duration,
    /// Job secret for address-based bootstraps (`from_address`, `from_env`), where no UniqueId
    /// carries a random one. `None`: derived from the root address, which keeps other jobs from
    /// joining by accident but is no protection against someone who knows the address.
    pub secret: Option<Secret>,
}

impl BootstrapConfig {
    /// Default bound on each step when nothing else is configured; matches `Env`'s default.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

    /// The settings the environment asks for.
    pub fn from_env(env: &Env) -> Self {
        BootstrapConfig {
            interface: env.socket_ifname.clone(),
            family: env.socket_family,
            timeout: env.bootstrap_timeout,
            liveness_timeout: env.liveness_timeout,
            secret: None,
        }
    }

    /// Same settings with another timeout (handy in tests).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Same settings with another liveness timeout (handy in tests).
    pub fn with_liveness_timeout(mut self, timeout: Duration) -> Self {
        self.liveness_timeout = timeout;
        self
    }
}

impl Default for BootstrapConfig {
    fn default() -> Self {
        BootstrapConfig {
            interface: None,
            family: None,
            timeout: Self::DEFAULT_TIMEOUT,
            liveness_timeout: crate::env::DEFAULT_DEVICE_WAIT_TIMEOUT,
            secret: None,
        }
    }
}

/// The secret must not be printed.
impl std::fmt::Debug for BootstrapConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapConfig")
            .field("interface", &self.interface)
            .field("family", &self.family)
            .field("timeout", &self.timeout)
            .field("liveness_timeout", &self.liveness_timeout)
            .field("secret", &self.secret.map(|_| "<redacted>"))
            .finish()
    }
}
