//! `default_allreduce_rsag_zero_copy`: large all-reduces on registered buffers; each rank reads its
//! chunk from every peer's input over NVLink and writes the reduced chunk into every rank's output
//! (kernel `allreduce_rsag_zero_copy`).

use super::{native_algorithm, zero_copy};
use crate::native::NativeKind;
use crate::user_buffers::UserBuffer;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::ZeroCopyArgs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    AllreduceRsagZeroCopy,
    NativeKind::AllreduceRsagZeroCopy
);

impl AllreduceRsagZeroCopy {
    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        // Both buffers on every rank, in place or not: a peer's call may differ.
        let agreed = self.base.agree(&[
            UserBuffer::new(args.input, args.input_bytes),
            UserBuffer::new(args.output, args.input_bytes),
        ])?;
        let kernel_args = ZeroCopyArgs {
            inputs: agreed.peers(0)?,
            outputs: agreed.peers(1)?,
            count: count as u64,
            ..ZeroCopyArgs::default()
        };
        zero_copy::launch(&self.base, args, kernel_args)
    }
}
