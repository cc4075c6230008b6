//! The all-to-all family natively: all-to-all, all-to-all-v (per-peer counts and displacements),
//! gather and scatter, as one exchange with different splits.
//! - [`split`]: the split and displacement math and its validation (CPU-tested);
//! - [`packet`]: `default_alltoall_packet`, small chunks through LL128 lines in the peers' scratch;
//! - [`zero_copy`]: `default_alltoall_zero_copy` and the exchange engine over registered outputs;
//! - [`shift`]: `default_sendrecv_zero_copy`, the shift (ring) exchange on that engine.

pub mod packet;
pub mod shift;
pub mod split;
pub mod zero_copy;

pub use packet::AlltoallPacket;
pub use shift::ShiftSendRecv;
pub use split::{check_local, check_matrix, skewed_matrix, splits_of_matrix, Side, Split};
pub use zero_copy::{AlltoallZeroCopy, Buffer, Rooted, ALLTOALL_ZERO_COPY};
