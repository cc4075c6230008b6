//! IB-less stub (being written).
