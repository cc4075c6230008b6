//! `default_allreduce_fullmesh`: every rank pushes its whole input into every peer's scratch and
//! reduces locally, in steps (kernel `allreduce_fullmesh`).

use super::{native_algorithm, scratch_pipeline};
use crate::geometry;
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::PeerPtrs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    AllreduceFullmesh,
    NativeKind::AllreduceFullmesh
);

impl AllreduceFullmesh {
    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        let (es, n) = (args.dtype.size(), self.base.comm().size());
        let scratch = 2 * self.base.scratch()?.half_bytes();
        let g = geometry::fullmesh_geometry(count, es, scratch, n);
        scratch_pipeline::launch(&self.base, args, count as u64, g, PeerPtrs::default())
    }
}
