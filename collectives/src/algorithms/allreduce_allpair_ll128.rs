//! `default_allreduce_allpair_ll128`: mid-sized all-reduces; every rank sends its whole input to
//! every peer as LL128 lines and reduces what it receives (kernel `allreduce_allpair_ll128`, CUDA
//! only). The all-pair schedule of `default_allreduce_allpair_packet` with 1.07x the message's
//! bytes on the wire instead of 2x: slower where latency sets the time (its reads vote across a
//! warp), faster once the bytes do (`algorithm_collection::allpair_ll128_from`).

use super::{native_algorithm, packet};
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    AllreduceAllpairLl128,
    NativeKind::AllreduceAllpairLl128
);

impl AllreduceAllpairLl128 {
    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        packet::launch(&self.base, args, count as u64)
    }
}
