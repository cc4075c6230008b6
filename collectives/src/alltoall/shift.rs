//! `default_sendrecv_zero_copy`: the shift exchange nccl-tests' `sendrecv` measures, as one
//! collective call: every rank sends its input to rank `(rank + d) % n` and receives the input of
//! rank `(rank - d) % n` into its output, with `d` given as `ExecuteArgs::root` (1: a ring). It is
//! an all-to-all-v with one non-empty peer per side, on the [`AlltoallZeroCopy`] engine it shares.

use super::split::Split;
use super::zero_copy::{AlltoallZeroCopy, Buffer};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::native_names::SENDRECV_ZERO_COPY;
use mscclpp_core::{Error, Result};
use std::sync::Arc;

/// The shift exchange over a shared engine.
pub struct ShiftSendRecv {
    engine: Arc<AlltoallZeroCopy>,
}

impl ShiftSendRecv {
    pub fn new(engine: Arc<AlltoallZeroCopy>) -> Self {
        ShiftSendRecv { engine }
    }
}

/// (send split, receive split) of rank `rank` of `n` for a shift by `d` of `bytes`.
pub fn shift_splits(rank: usize, n: usize, d: usize, bytes: usize) -> (Split, Split) {
    let n = n.max(1);
    (
        Split::only(n, (rank + d) % n, bytes),
        Split::only(n, (rank + n - d % n) % n, bytes),
    )
}

impl Algorithm for ShiftSendRecv {
    fn name(&self) -> &str {
        SENDRECV_ZERO_COPY
    }

    fn collective(&self) -> Collective {
        Collective::SendRecv
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        let rank = self.engine.comm().rank();
        args.input_count()?;
        if args.output_bytes < args.input_bytes {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: {SENDRECV_ZERO_COPY}: the output holds {} bytes, the call needs {}",
                args.output_bytes, args.input_bytes
            )));
        }
        if args.in_place() && args.input_bytes > 0 {
            return Err(Error::Unsupported(format!(
                "rank {rank}: {SENDRECV_ZERO_COPY} in place (the peer would overwrite the input \
                 before it is sent)"
            )));
        }
        Ok(())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        self.check(args)?;
        if args.input_bytes == 0 {
            return Ok(());
        }
        let comm = self.engine.comm();
        let (send, recv) = shift_splits(comm.rank(), comm.size(), args.root, args.input_bytes);
        let blocks = args.nblocks.or(Some(crate::geometry::bandwidth_blocks(
            args.input_bytes,
            self.engine.max_blocks(),
        )));
        self.engine.alltoallv(
            Buffer {
                ptr: args.input,
                bytes: args.input_bytes,
            },
            Buffer {
                ptr: args.output,
                bytes: args.output_bytes,
            },
            &send,
            &recv,
            args.stream,
            blocks,
            args.nthreads,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alltoall::check_matrix;

    #[test]
    fn shifts_are_consistent_exchanges() {
        for n in 1..=8 {
            for d in [0, 1, 3, 9] {
                let (s, r): (Vec<_>, Vec<_>) =
                    (0..n).map(|rank| shift_splits(rank, n, d, 5)).unzip();
                check_matrix(&s, &r).unwrap();
            }
        }
        let (s, r) = shift_splits(0, 4, 1, 8);
        assert_eq!(s.counts, vec![0, 8, 0, 0]);
        assert_eq!(r.counts, vec![0, 0, 0, 8]);
    }
}
