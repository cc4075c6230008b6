//! `default_allreduce_rsag_zero_copy`: large all-reduces on registered buffers; each rank reads its
//! chunk from every peer's input over NVLink and writes the reduced chunk into every rank's output
//! (kernel `allreduce_rsag_zero_copy`).

use super::{native_algorithm, zero_copy};
use crate::native::NativeKind;
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
        let inputs = zero_copy::peers(&self.base, args.input, args.input_bytes)?;
        let outputs = if args.in_place() {
            inputs
        } else {
            zero_copy::peers(&self.base, args.output, args.input_bytes)?
        };
        let kernel_args = ZeroCopyArgs {
            inputs,
            outputs,
            count: count as u64,
            ..ZeroCopyArgs::default()
        };
        zero_copy::launch(&self.base, args, kernel_args)
    }
}
