//! `default_gather_zero_copy` and `default_scatter_zero_copy`: gather and scatter as collection
//! algorithms (`Collective::Gather`, `Collective::Scatter`, root in `ExecuteArgs::root`) on the
//! all-to-all exchange engine they share with `default_alltoall_zero_copy`. Ours: MSCCL++ has
//! neither. They are [`AlltoallZeroCopy::rooted`]'s [`Rooted::Gather`] (the root pulls from the
//! registered inputs) and [`Rooted::Scatter`] (the root pushes into the registered outputs).
//!
//! Sizes in `ExecuteArgs`, as NCCL's `ncclGather` / `ncclScatter` give them: gather's input is
//! one rank's chunk and the root's output holds `nranks` chunks; scatter's root input holds
//! `nranks` chunks and every output one. The buffers a rank does not use (gather's output and
//! scatter's input off the root) are never touched, so they may be null. `ExecuteArgs::nblocks` and
//! `nthreads` reach the engine's kernel as every algorithm takes them (`None`: the engine's choice,
//! by the bytes the root moves); a request out of range is an error naming the rank and the call.
//!
//! In place as NCCL defines it: gather's input is the root's own slot of its output
//! (`sendbuff == recvbuff + root * chunk`), scatter's output the root's own slot of its input
//! (`recvbuff == sendbuff + root * chunk`; nccl-tests passes the same offsets on every rank, where
//! only the root's matter). Only the root's own chunk meets itself, so nothing more is needed.
//! Up to the engine's stage ([`crate::alltoall::zero_copy::rooted_via_stage`]) a call maps no
//! user buffer at all: every sender copies its side into its stage and the receivers pull it from
//! there, which spares small calls the per-call buffer agreement.

use crate::alltoall::{AlltoallZeroCopy, Buffer, Rooted};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::native_names::{GATHER_ZERO_COPY, SCATTER_ZERO_COPY};
use mscclpp_core::{Error, Result};
use std::sync::Arc;

/// Gather or scatter over a shared engine. See the module docs.
pub struct GatherScatter {
    op: Rooted,
    engine: Arc<AlltoallZeroCopy>,
}

impl GatherScatter {
    pub fn gather(engine: Arc<AlltoallZeroCopy>) -> Self {
        GatherScatter {
            op: Rooted::Gather,
            engine,
        }
    }

    pub fn scatter(engine: Arc<AlltoallZeroCopy>) -> Self {
        GatherScatter {
            op: Rooted::Scatter,
            engine,
        }
    }

    /// Bytes of one rank's chunk, checked against the buffers this rank uses.
    fn chunk(&self, args: &ExecuteArgs) -> Result<usize> {
        let (rank, n) = (self.engine.comm().rank(), self.engine.comm().size());
        chunk_bytes(self.op, args, rank, n)
    }
}

/// Bytes of one rank's chunk of a gather or scatter `args` on `rank` of `nranks`; errors name the
/// algorithm, the rank and the sizes (no device access, so tested on the CPU).
pub fn chunk_bytes(op: Rooted, args: &ExecuteArgs, rank: usize, nranks: usize) -> Result<usize> {
    let gather = op == Rooted::Gather;
    let name = if gather {
        GATHER_ZERO_COPY
    } else {
        SCATTER_ZERO_COPY
    };
    if args.root >= nranks {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: {name}: root {} is not a rank of {nranks}",
            args.root
        )));
    }
    let dsize = args.dtype.size();
    // The side every rank has: gather's input, scatter's output.
    let chunk = if gather {
        args.input_bytes
    } else {
        args.output_bytes
    };
    if chunk % dsize != 0 {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: {name}: a chunk of {chunk} bytes is not a whole number of {} elements",
            args.dtype
        )));
    }
    if rank == args.root && chunk > 0 {
        let (what, have) = if gather {
            ("output", args.output_bytes)
        } else {
            ("input", args.input_bytes)
        };
        let want = chunk.saturating_mul(nranks);
        if have < want {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: {name}: the root's {what} holds {have} bytes, the call needs {want}"
            )));
        }
        // NCCL's in-place form puts the root's own chunk at its slot of the larger buffer, where
        // the exchange copies it onto itself; any other overlap would race.
        let (whole, part) = if gather {
            (args.output, args.input)
        } else {
            (args.input, args.output)
        };
        let in_place = part == whole.wrapping_add((args.root * chunk) as u64);
        let overlap = args.input < args.output.saturating_add(args.output_bytes as u64)
            && args.output < args.input.saturating_add(args.input_bytes as u64);
        if overlap && !in_place {
            return Err(Error::Unsupported(format!(
                "rank {rank}: {name} with overlapping input and output other than in place \
                 (the root's chunk at its own slot)"
            )));
        }
    }
    Ok(chunk)
}

impl Algorithm for GatherScatter {
    fn name(&self) -> &str {
        match self.op {
            Rooted::Gather => GATHER_ZERO_COPY,
            Rooted::Scatter => SCATTER_ZERO_COPY,
        }
    }

    fn collective(&self) -> Collective {
        match self.op {
            Rooted::Gather => Collective::Gather,
            Rooted::Scatter => Collective::Scatter,
        }
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        self.chunk(args).map(|_| ())
    }

    fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        let chunk = self.chunk(args)?;
        if chunk == 0 {
            return Ok(());
        }
        self.engine.prepare_rooted(self.op, chunk, args.root)
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        let chunk = self.chunk(args)?;
        if chunk == 0 {
            return Ok(());
        }
        let on_root = self.engine.comm().rank() == args.root;
        // The buffer a rank off the root does not use is never touched (it may be null).
        let buffer = |ptr, bytes, used: bool| {
            if used {
                Buffer { ptr, bytes }
            } else {
                Buffer { ptr: 0, bytes: 0 }
            }
        };
        let input = buffer(
            args.input,
            args.input_bytes,
            on_root || self.op == Rooted::Gather,
        );
        let output = buffer(
            args.output,
            args.output_bytes,
            on_root || self.op == Rooted::Scatter,
        );
        self.engine.rooted(
            self.op,
            input,
            output,
            chunk,
            args.root,
            args.stream,
            args.nblocks,
            args.nthreads,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::gpu::Stream;
    use mscclpp_core::{AccumType, DataType, ReduceOp};

    fn args(input_bytes: usize, output_bytes: usize, root: usize) -> ExecuteArgs {
        ExecuteArgs {
            input: 0x1000,
            output: 0x9000,
            input_bytes,
            output_bytes,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            accum: AccumType::Auto,
            root,
            stream: Stream::DEFAULT,
            nblocks: None,
            nthreads: None,
        }
    }

    #[test]
    fn chunks_and_their_errors() {
        let g = Rooted::Gather;
        let s = Rooted::Scatter;
        assert_eq!(chunk_bytes(g, &args(8, 32, 1), 1, 4).unwrap(), 8);
        // Off the root, the unused side may be anything.
        assert_eq!(chunk_bytes(g, &args(8, 0, 1), 0, 4).unwrap(), 8);
        assert_eq!(chunk_bytes(s, &args(0, 8, 1), 0, 4).unwrap(), 8);
        assert_eq!(chunk_bytes(s, &args(32, 8, 1), 1, 4).unwrap(), 8);
        let e = chunk_bytes(g, &args(8, 31, 1), 1, 4).unwrap_err();
        assert!(e.to_string().contains(GATHER_ZERO_COPY), "{e}");
        assert!(e.to_string().contains("32"), "{e}");
        let e = chunk_bytes(s, &args(16, 8, 1), 1, 4).unwrap_err();
        assert!(e.to_string().contains("input holds 16"), "{e}");
        assert!(
            chunk_bytes(g, &args(6, 24, 0), 0, 4).is_err(),
            "not whole f32s"
        );
        assert!(
            chunk_bytes(g, &args(8, 32, 4), 0, 4).is_err(),
            "root 4 of 4"
        );
        // In place: the root's chunk at its own slot; any other overlap is refused.
        let mut same = args(8, 32, 2);
        same.input = same.output + 16;
        assert_eq!(chunk_bytes(g, &same, 2, 4).unwrap(), 8);
        same.input = same.output + 8;
        assert!(matches!(
            chunk_bytes(g, &same, 2, 4),
            Err(Error::Unsupported(_))
        ));
        let mut same = args(32, 8, 1);
        same.output = same.input + 8;
        assert_eq!(chunk_bytes(s, &same, 1, 4).unwrap(), 8);
        // nccl-tests passes the in-place offsets on every rank: off the root they are taken too
        // (only the root's matter, and its own chunk is the one that meets itself).
        for rank in [0, 2, 3] {
            let mut scatter = args(32, 8, 1);
            scatter.output = scatter.input + 8 * rank as u64;
            assert_eq!(
                chunk_bytes(s, &scatter, rank, 4).unwrap(),
                8,
                "scatter rank {rank}"
            );
            let mut gather = args(8, 32, 1);
            gather.input = gather.output + 8 * rank as u64;
            assert_eq!(
                chunk_bytes(g, &gather, rank, 4).unwrap(),
                8,
                "gather rank {rank}"
            );
        }
    }
}
