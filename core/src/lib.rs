//! Vendor-neutral core of mscclpp-rs.
//!
//! Everything here builds and is tested without any GPU driver: the traits that backends implement
//! ([`Gpu`], [`Transport`], [`Algorithm`]), the element and reduction types, the one error type, the
//! typed `MSCCLPP_*` environment, logging, and the TCP bootstrap that ranks use to find each other.

pub mod affinity;
pub mod algorithm;
pub mod algorithm_collection;
pub mod communicator;
pub mod device;
pub mod dtype;
pub mod error;
pub mod fifo;
pub mod gpu;
pub mod host_gather;
pub mod host_semaphore;
pub mod kernel_cache;
pub mod kernel_image;
pub mod port_channel;
pub mod process;
pub mod proxy;
pub mod switch_channel;
pub mod topology;
pub mod transport;
pub mod tuner;

pub use algorithm::{Algorithm, Collective, CommResult, ExecuteArgs};
pub use dtype::{AccumType, DataType, ReduceOp};
pub use error::{Error, Result};
pub use gpu::{DeviceProperties, Gpu, GpuVendor};
pub use transport::{Transport, TransportKind};
pub mod bootstrap;
pub mod env;
pub mod fp8;
pub mod log;
