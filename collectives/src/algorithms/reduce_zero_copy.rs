//! `default_reduce_zero_copy`: reduce to one root on registered inputs; the root reads every
//! rank's input over NVLink and reduces it into its output, the others wait in the closing
//! barrier until it is done (kernel `reduce_zero_copy`). Ours: MSCCL++ has no native reduce.
//! Every rank's input is agreed with every peer on every call (`crate::user_buffers`), as the
//! other zero-copy algorithms do; nothing else is allocated, and the barriers use the
//! collection's semaphores.

use super::{native_algorithm, zero_copy};
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::ZeroCopyArgs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    ReduceZeroCopy,
    NativeKind::ReduceZeroCopy
);

impl ReduceZeroCopy {
    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        let kernel_args = ZeroCopyArgs {
            inputs: zero_copy::peers(&self.base, args.input, args.input_bytes)?,
            output: args.output,
            count: count as u64,
            root: args.root as u32,
            ..ZeroCopyArgs::default()
        };
        zero_copy::launch(&self.base, args, kernel_args)
    }
}
