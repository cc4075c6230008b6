//! `default_allreduce_rsag`: reduce-scatter + all-gather staged through one half of the scratch in
//! one step, for unregistered buffers that fit it (kernel `allreduce_rsag`).

use super::{native_algorithm, scratch_pipeline};
use crate::geometry;
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::PeerPtrs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    AllreduceRsag,
    NativeKind::AllreduceRsag
);

impl AllreduceRsag {
    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        let (es, n) = (args.dtype.size(), self.base.comm().size());
        let half = self.base.scratch()?.half_bytes();
        let g = geometry::rsag_geometry(count, es, half, n, false);
        scratch_pipeline::launch(&self.base, args, count as u64, g, PeerPtrs::default())
    }
}
