//! mscclpp-rs facade: run-time backend selection and re-exports (being written).
pub use mscclpp_core as core;
