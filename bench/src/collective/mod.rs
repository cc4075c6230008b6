//! The collective benchmark: nccl-tests-style timing of the native algorithms, a correctness check
//! of every timed configuration, and NCCL measured in the same run (`--vs-nccl`). `main` enters
//! through [`entry::run`].

pub mod alltoallv;
pub mod check;
pub mod data;
pub mod device_data;
pub mod device_line;
pub mod entry;
pub mod options;
pub mod report;
pub mod run;
pub mod shape;
