//! Typed `MSCCLPP_*` environment (being written).
