//! `default_broadcast_zero_copy`: the root writes its input into every rank's registered output
//! (kernel `broadcast_zero_copy`).

use super::{native_algorithm, zero_copy};
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::ZeroCopyArgs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    BroadcastZeroCopy,
    NativeKind::BroadcastZeroCopy
);

impl BroadcastZeroCopy {
    // Byte-oriented: the kernel counts bytes, not elements.
    fn run(&self, args: &ExecuteArgs, _count: usize) -> Result<()> {
        let kernel_args = ZeroCopyArgs {
            input: args.input,
            outputs: zero_copy::peers(&self.base, args.output, args.input_bytes)?,
            count: args.input_bytes as u64,
            root: args.root as u32,
            ..ZeroCopyArgs::default()
        };
        zero_copy::launch(&self.base, args, kernel_args)
    }
}
