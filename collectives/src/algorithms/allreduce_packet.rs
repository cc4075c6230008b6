//! `default_allreduce_packet`: two-phase (reduce-scatter + all-gather) all-reduce through LL128
//! lines in the scratch (kernel `allreduce_packet`).

use super::{native_algorithm, packet};
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    AllreducePacket,
    NativeKind::AllreducePacket
);

impl AllreducePacket {
    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        packet::launch(&self.base, args, count as u64)
    }
}
