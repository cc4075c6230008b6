//! `default_reducescatter_packet`: reduce-scatter through LL128 lines in the peers' scratch (kernel
//! `reducescatter_packet`).

use super::{native_algorithm, packet};
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    ReducescatterPacket,
    NativeKind::ReducescatterPacket
);

impl ReducescatterPacket {
    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        // The kernel counts the elements of one chunk.
        packet::launch(&self.base, args, (count / self.base.comm().size()) as u64)
    }
}
