//! `default_allgather_fullmesh`: all-gather pushed through the peers' scratch in steps, for
//! unregistered buffers (kernel `allgather_fullmesh`; byte-oriented).

use super::{native_algorithm, scratch_pipeline};
use crate::geometry;
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::PeerPtrs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    AllgatherFullmesh,
    NativeKind::AllgatherFullmesh
);

impl AllgatherFullmesh {
    // Byte-oriented: the kernel counts bytes, not elements.
    fn run(&self, args: &ExecuteArgs, _count: usize) -> Result<()> {
        let scratch = 2 * self.base.scratch()?.half_bytes();
        let bytes = args.input_bytes;
        let g = geometry::fullmesh_geometry(bytes, 1, scratch, self.base.comm().size());
        scratch_pipeline::launch(&self.base, args, bytes as u64, g, PeerPtrs::default())
    }
}
