//! Logging through `tracing` (being written).
