//! Device library sources (being written).
