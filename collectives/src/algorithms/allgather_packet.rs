//! `default_allgather_packet`: all-gather through LL128 lines in the peers' scratch (kernel
//! `allgather_packet`; byte-oriented).

use super::{native_algorithm, packet};
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    AllgatherPacket,
    NativeKind::AllgatherPacket
);

impl AllgatherPacket {
    // Byte-oriented: the kernel counts bytes, not elements.
    fn run(&self, args: &ExecuteArgs, _count: usize) -> Result<()> {
        packet::launch(&self.base, args, args.input_bytes as u64)
    }
}
