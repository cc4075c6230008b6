//! `default_reducescatter_zero_copy`: reduce-scatter on registered buffers; each rank reduces its
//! chunk from every peer's input (kernel `reducescatter_zero_copy`).

use super::{native_algorithm, zero_copy};
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::ZeroCopyArgs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    ReducescatterZeroCopy,
    NativeKind::ReducescatterZeroCopy
);

impl ReducescatterZeroCopy {
    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        let kernel_args = ZeroCopyArgs {
            inputs: zero_copy::peers(&self.base, args.input, args.input_bytes)?,
            output: args.output,
            count: (count / self.base.comm().size()) as u64,
            ..ZeroCopyArgs::default()
        };
        zero_copy::launch(&self.base, args, kernel_args)
    }
}
