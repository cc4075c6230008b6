//! The collectives of a one-rank job: every collective's result is its input, so an out-of-place
//! call is one device-to-device copy on the caller's stream (`cuMemcpyAsync`, capturable into a
//! CUDA graph) and an in-place call does nothing. Any reduction of one value is that value (the
//! average divides by one).
//!
//! One small type serves every collective but send/recv; the default selector picks it whenever the world
//! size is 1, on any GPU the backend drives (no kernel is involved).

use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::native_names::single_rank_name;
use mscclpp_core::gpu::Gpu;
use mscclpp_core::{Error, Result};
use std::sync::Arc;

/// The collectives [`SingleRank`] serves.
pub const COLLECTIVES: [Collective; 8] = [
    Collective::AllReduce,
    Collective::AllGather,
    Collective::ReduceScatter,
    Collective::Broadcast,
    Collective::Reduce,
    Collective::AllToAll,
    Collective::Gather,
    Collective::Scatter,
];

/// One collective of a one-rank job. See the module docs.
pub struct SingleRank {
    collective: Collective,
    name: &'static str,
    gpu: Arc<dyn Gpu>,
}

impl SingleRank {
    /// `collective` on `gpu`; `Unsupported` for collectives that are not one of [`COLLECTIVES`].
    pub fn new(collective: Collective, gpu: Arc<dyn Gpu>) -> Result<SingleRank> {
        let name = single_rank_name(collective).ok_or_else(|| {
            Error::Unsupported(format!("no single-rank algorithm for {collective}"))
        })?;
        Ok(SingleRank {
            collective,
            name,
            gpu,
        })
    }
}

impl Algorithm for SingleRank {
    fn name(&self) -> &str {
        self.name
    }

    fn collective(&self) -> Collective {
        self.collective
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        check_args(self.collective, self.name, args)
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        self.check(args)?;
        if !needs_copy(args) {
            return Ok(());
        }
        self.gpu
            .memcpy_async(args.output, args.input, args.input_bytes, args.stream)
    }
}

/// Whether `args` is a call the one-rank job must check out (no device access).
fn check_args(collective: Collective, name: &str, args: &ExecuteArgs) -> Result<()> {
    let count = args.input_count()?;
    if args.output_bytes < args.input_bytes {
        return Err(Error::InvalidArgument(format!(
            "{name}: the output holds {} bytes, the call needs {}",
            args.output_bytes, args.input_bytes
        )));
    }
    let rooted = matches!(
        collective,
        Collective::Broadcast | Collective::Reduce | Collective::Gather | Collective::Scatter
    );
    if rooted && args.root != 0 {
        return Err(Error::InvalidArgument(format!(
            "{name}: root {} in a job of one rank",
            args.root
        )));
    }
    if count > 0 && (args.input == 0 || args.output == 0) {
        return Err(Error::InvalidArgument(format!("{name}: null buffer")));
    }
    Ok(())
}

/// Out of place and not empty: one copy; otherwise nothing to do.
fn needs_copy(args: &ExecuteArgs) -> bool {
    !args.in_place() && args.input_bytes > 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::algorithm_collection::native_names::*;
    use mscclpp_core::gpu::Stream;
    use mscclpp_core::{AccumType, DataType, ReduceOp};

    fn args(input: u64, output: u64, bytes: usize) -> ExecuteArgs {
        ExecuteArgs {
            input,
            output,
            input_bytes: bytes,
            output_bytes: bytes,
            dtype: DataType::F32,
            op: ReduceOp::Avg,
            accum: AccumType::Auto,
            root: 0,
            stream: Stream::DEFAULT,
            nblocks: None,
            nthreads: None,
        }
    }

    #[test]
    fn in_place_does_nothing_out_of_place_copies_once() {
        assert!(!needs_copy(&args(0x1000, 0x1000, 1 << 30)));
        assert!(needs_copy(&args(0x1000, 0x2000, 4)));
        assert!(!needs_copy(&args(0x1000, 0x2000, 0)));
    }

    #[test]
    fn bad_calls_are_named() {
        let ok = args(0x1000, 0x2000, 16);
        for c in COLLECTIVES {
            let name = single_rank_name(c).expect("named");
            check_args(c, name, &ok).expect("valid");
            let mut short = ok;
            short.output_bytes = 8;
            let e = check_args(c, name, &short).unwrap_err();
            assert!(e.to_string().contains(name), "{e}");
            let mut null = ok;
            null.input = 0;
            assert!(check_args(c, name, &null).is_err());
        }
        let mut rooted = ok;
        rooted.root = 1;
        let e = check_args(Collective::Broadcast, BROADCAST_SINGLE_RANK, &rooted).unwrap_err();
        assert!(e.to_string().contains("root 1"), "{e}");
        let e = check_args(Collective::Reduce, REDUCE_SINGLE_RANK, &rooted).unwrap_err();
        assert!(e.to_string().contains("root 1"), "{e}");
        assert!(check_args(Collective::AllReduce, ALLREDUCE_SINGLE_RANK, &rooted).is_ok());
        assert!(
            check_args(Collective::AllReduce, "x", &args(1, 2, 10)).is_err(),
            "10 bytes of f32"
        );
        assert_eq!(single_rank_name(Collective::SendRecv), None);
    }
}
