//! `default_allreduce_rsag_pipeline`: the rsag kernel in double-buffered steps of the scratch, any
//! message size (kernel `allreduce_rsag`).

use super::{native_algorithm, scratch_pipeline};
use crate::geometry;
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::PeerPtrs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    AllreduceRsagPipeline,
    NativeKind::AllreduceRsagPipeline
);

impl AllreduceRsagPipeline {
    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        let (es, n) = (args.dtype.size(), self.base.comm().size());
        let scratch = 2 * self.base.scratch()?.half_bytes();
        let g = geometry::rsag_geometry(count, es, scratch, n, true);
        scratch_pipeline::launch(&self.base, args, count as u64, g, PeerPtrs::default())
    }
}
