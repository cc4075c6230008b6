//! `default_allgather_fullmesh2`: all-gather on registered buffers; each rank writes its input into
//! every peer's output (kernel `allgather_fullmesh2`).

use super::{native_algorithm, zero_copy};
use crate::native::NativeKind;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::ZeroCopyArgs;
use mscclpp_core::Result;

native_algorithm!(
    /// See the module docs.
    AllgatherFullmesh2,
    NativeKind::AllgatherFullmesh2
);

impl AllgatherFullmesh2 {
    // Byte-oriented: the kernel counts bytes, not elements.
    fn run(&self, args: &ExecuteArgs, _count: usize) -> Result<()> {
        let n = self.base.comm().size();
        let kernel_args = ZeroCopyArgs {
            input: args.input,
            outputs: zero_copy::peers(&self.base, args.output, n * args.input_bytes)?,
            count: args.input_bytes as u64,
            ..ZeroCopyArgs::default()
        };
        zero_copy::launch(&self.base, args, kernel_args)
    }
}
