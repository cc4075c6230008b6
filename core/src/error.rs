//! The one error type of mscclpp-rs.
//!
//! Every variant names what went wrong in words a user can act on: the variable, the rank, the driver
//! call and its code. Backends convert their driver failures into [`Error::Driver`] with the call name,
//! so an error read in a log says which API failed and why.

use std::time::Duration;

/// Result alias used across the workspace.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in mscclpp-rs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An `MSCCLPP_*` (or launcher) environment variable holds a value that cannot be used.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    Env {
        var: &'static str,
        value: String,
        reason: String,
    },

    /// A caller passed something that can never work (wrong size, null pointer, bad rank...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The request is well formed but this build, backend, or device does not support it
    /// (e.g. an unsupported dtype/op pair, NVLS while it is disabled).
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// A launch shape (`nblocks`, `nthreads`) an algorithm cannot run with on this device, e.g.
    /// more blocks than can be resident at once: the call is well formed and another shape may
    /// run. Kept apart from [`Error::InvalidArgument`] so a tuner can skip the shape, and
    /// MSCCL++'s Python API returns it as a [`CommResult`](crate::algorithm::CommResult) code.
    #[error("unsupported launch shape: {0}")]
    LaunchShape(String),

    /// A backend was asked for but cannot be used: not compiled in, or its driver library is missing.
    #[error("GPU backend {backend} is unavailable: {reason}")]
    BackendUnavailable { backend: String, reason: String },

    /// A driver/runtime/compiler call failed. `call` is the API name (e.g. `cuMemCreate`).
    #[error("{call} failed with code {code} ({message})")]
    Driver {
        call: &'static str,
        code: i64,
        message: String,
    },

    /// Run-time kernel compilation (NVRTC/hiprtc) failed; `log` is the compiler's own output.
    #[error("compiling {name} failed: {log}")]
    Compile { name: String, log: String },

    /// InfiniBand was requested but cannot be used; the reason says which of build, device or
    /// environment rules it out.
    #[error("InfiniBand is unavailable: {0}")]
    IbUnavailable(String),

    /// A bounded wait expired. `what` names the thing waited for (and the peer rank where known).
    #[error("timed out after {timeout:?} waiting for {what}")]
    Timeout { what: String, timeout: Duration },

    /// A peer rank failed, disconnected, or sent something we cannot accept.
    #[error("rank {rank}: {message}")]
    Peer { rank: usize, message: String },

    /// The bootstrap could not be set up or was violated (bad UniqueId, secret mismatch, ...).
    #[error("bootstrap: {0}")]
    Bootstrap(String),

    /// An execution plan (MSCCL++ JSON) is malformed or inconsistent.
    #[error("execution plan: {0}")]
    Plan(String),

    /// An operating-system I/O failure, with what we were doing at the time.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// A device-side wait recorded a timeout in the host-visible error word.
    #[error("device-side timeout in {0}")]
    DeviceTimeout(String),

    /// The communicator was aborted (by `Communicator::abort`, or because a peer died or a wait
    /// timed out); the message says why and names the rank where known.
    #[error("communicator aborted: {0}")]
    Aborted(String),

    /// An internal invariant failed; this is a bug in mscclpp-rs.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// Wraps an I/O error with the context of what was being attempted.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// True for errors that mean "not here": a missing backend, IB, or feature. Tests use this to
    /// decide to skip with a printed reason instead of failing.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            Error::BackendUnavailable { .. } | Error::IbUnavailable(_) | Error::Unsupported(_)
        )
    }
}

/// Adds context to `std::io::Result`s.
pub trait IoContext<T> {
    fn io_context(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn io_context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::io(context(), e))
    }
}
