//! HIP device pieces (being written).
