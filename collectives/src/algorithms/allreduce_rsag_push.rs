//! `default_allreduce_rsag_push`: large all-reduces where every byte crosses NVLink as a write
//! (kernel `allreduce_rsag_push`, the pipelined rsag body of allreduce.cu). Per step, each rank
//! pushes chunk p of its input into rank p's scratch, then reduces its own chunk from its scratch
//! and pushes the result into every rank's registered output, one block barrier per step. Why:
//! `default_allreduce_rsag_zero_copy` reads three peers at 4 ranks and stays below NCCL's
//! bandwidth there; posted writes need no round trip per load. Measured, it was slower than both
//! (the steps through the scratch barrier too often), so the default selector does not take it:
//! `--algo`, the tuner and the GPU suite reach it by name.
//!
//! User buffers: only the outputs are agreed with the peers (`crate::user_buffers`, as the
//! zero-copy kernels do); the input is read locally and staged through the collection's scratch,
//! so a call holds no device memory of its own.

use super::{native_algorithm, scratch_pipeline, zero_copy};
use crate::geometry;
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    AllreduceRsagPush,
    NativeKind::AllreduceRsagPush
);

impl AllreduceRsagPush {
    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        let (es, n) = (args.dtype.size(), self.base.comm().size());
        let scratch = 2 * self.base.scratch()?.half_bytes();
        let g = geometry::push_geometry(count, es, scratch, n);
        let outputs = zero_copy::peers(&self.base, args.output, args.input_bytes)?;
        scratch_pipeline::launch(&self.base, args, count as u64, g, outputs)
    }
}
