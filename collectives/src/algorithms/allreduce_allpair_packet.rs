//! `default_allreduce_allpair_packet`: small all-reduces; every rank sends its whole input to every
//! peer as LL16 packets and reduces what it receives (kernel `allreduce_allpair_packet`).

use super::{native_algorithm, packet};
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    AllreduceAllpairPacket,
    NativeKind::AllreduceAllpairPacket
);

impl AllreduceAllpairPacket {
    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        packet::launch(&self.base, args, count as u64)
    }
}
