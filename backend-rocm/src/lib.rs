//! ROCm backend (being written).
