//! Whether this copy of the shim is embedded in a host stack (`libmscclpp_embed`, whose exports
//! carry the `mscclpp_` prefix) rather than standing in for NCCL.
//!
//! Embedded, the host stack is itself the NCCL ABI and serves what we do not: this copy loads no
//! fallback library of its own, whatever `MSCCLPP_NCCL_LIB_PATH` says, and a call without a native
//! path fails naming the reason, for the host to take its own path. A run-time switch rather than
//! a cargo feature: features unify across a workspace build, and the plain `libmscclpp_nccl.so`
//! built beside the embedded library must keep its fallback.

use std::sync::atomic::{AtomicBool, Ordering};

static EMBEDDED: AtomicBool = AtomicBool::new(false);

/// Declares this copy embedded; every entry point of the embedded library calls it first.
pub fn declare() {
    EMBEDDED.store(true, Ordering::Relaxed);
}

/// Whether [`declare`] was called in this copy of the shim.
pub fn active() -> bool {
    EMBEDDED.load(Ordering::Relaxed)
}

/// Why an embedded communicator has no fallback (the text a refused call carries).
pub const NO_FALLBACK: &str =
    "embedded in a host stack (libmscclpp_embed), which loads no NCCL of its own: the host \
     stack's own path serves this call";
