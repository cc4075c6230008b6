//! `default_allreduce_copy_engine`: large all-reduces whose data the copy engines move while the
//! SMs reduce (`crate::copy_engine` has the schedule; kernels `allreduce_ce_reduce` and
//! `allreduce_ce_sync`). The peers' pieces land in the output where every rank's call allows it,
//! else in a ring in the collection's scratch (`copy_engine::Staging`); a call in place on some
//! ranks only runs the zero-copy kernel, as those ranks do (`CallPath`).

use super::zero_copy;
use crate::copy_engine::{CallPlan, CopyEngine, Staging};
use crate::geometry;
use crate::native::{NativeBase, NativeKind, DEFAULT_THREADS};
use crate::resources::CollectionResources;
use crate::user_buffers::{Agreed, UserBuffer};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::device::ZeroCopyArgs;
use mscclpp_core::Result;
use std::sync::Arc;

/// See the module docs.
pub struct AllreduceCopyEngine {
    // Before `base`: the copy stream drains before anything else goes.
    engine: CopyEngine,
    base: NativeBase,
    /// The zero-copy all-reduce, for calls some ranks make in place and others not (see
    /// [`CallPath`]).
    zero_copy: NativeBase,
}

/// How a call runs, decided from what every rank passed (so the same on every rank). The selector
/// sends an in-place call to the zero-copy all-reduce and an out-of-place one here; a call that is
/// in place on some ranks only therefore reaches both, and both run the zero-copy kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallPath {
    Staged(Staging),
    ZeroCopy,
}

impl CallPath {
    fn of(agreed: &Agreed, count: usize, elem_bytes: usize) -> CallPath {
        let n = agreed.ranks();
        let in_place = |r: usize| agreed.passed(r, 0).ptr == agreed.passed(r, 1).ptr;
        let disjoint = |r: usize| {
            let (i, o) = (agreed.passed(r, 0), agreed.passed(r, 1));
            i.ptr + i.bytes as u64 <= o.ptr || o.ptr + o.bytes as u64 <= i.ptr
        };
        match (0..n).filter(|&r| in_place(r)).count() {
            // In place everywhere: only an explicit choice of this algorithm gets here.
            k if k == n => CallPath::Staged(Staging::ScratchRing),
            0 => CallPath::Staged(Staging::for_call(
                false,
                (0..n).all(disjoint),
                count,
                elem_bytes,
                n,
            )),
            _ => CallPath::ZeroCopy,
        }
    }
}

impl AllreduceCopyEngine {
    /// Collective: sets it up for `comm`, borrowing the collection's `resources`.
    pub fn new(comm: Arc<Communicator>, resources: Arc<CollectionResources>) -> Result<Self> {
        Ok(AllreduceCopyEngine {
            engine: CopyEngine::new(&comm, resources.clone())?,
            base: NativeBase::new(
                NativeKind::AllreduceCopyEngine,
                comm.clone(),
                resources.clone(),
            )?,
            zero_copy: NativeBase::new(NativeKind::AllreduceRsagZeroCopy, comm, resources)?,
        })
    }

    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        let base = &self.base;
        let agreed = base.agree(&[
            UserBuffer::new(args.input, args.input_bytes),
            UserBuffer::new(args.output, args.input_bytes),
        ])?;
        let staging = match CallPath::of(&agreed, count, args.dtype.size()) {
            CallPath::Staged(staging) => staging,
            CallPath::ZeroCopy => {
                let kernel_args = ZeroCopyArgs {
                    inputs: agreed.peers(0)?,
                    outputs: agreed.peers(1)?,
                    count: count as u64,
                    ..ZeroCopyArgs::default()
                };
                return zero_copy::launch(&self.zero_copy, args, kernel_args);
            }
        };
        let reduce = base.function(args)?;
        let sync = base.entry_point(args, "allreduce_ce_sync")?;
        let (inputs, outputs) = (agreed.ptrs(0), agreed.ptrs(1));
        let comm = base.comm();
        let (n, rank) = (comm.size(), comm.rank());
        // The reduction's grid is sized for the largest scratch piece (a whole slot), whatever this
        // call's: larger pieces only loop more.
        let slot_vectors = self.engine.slot_bytes() / geometry::VECTOR_BYTES;
        let threads = args.nthreads.unwrap_or(DEFAULT_THREADS);
        let reduce_config = geometry::launch_config(
            args.nblocks,
            args.nthreads,
            (slot_vectors as u32).div_ceil(threads).min(base.sm()),
            DEFAULT_THREADS,
            base.max_blocks(threads),
        )?;
        let plan = CallPlan {
            reduce,
            sync,
            semaphores: base.semaphores()?.0,
            error_word: comm.error_word_device_ptr(),
            inputs: &inputs,
            outputs: &outputs,
            count,
            elem_bytes: args.dtype.size(),
            stream: args.stream,
            reduce_config,
            staging,
        };
        self.engine.enqueue(&plan, rank, n)
    }
}

impl Algorithm for AllreduceCopyEngine {
    fn name(&self) -> &str {
        self.base.kind().name()
    }

    fn collective(&self) -> Collective {
        Collective::AllReduce
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        self.base.check(args)
    }

    fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        self.base.prepare(args)?;
        self.zero_copy.prepare(args)
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        match self.base.begin(args)? {
            Some(count) => self.run(args, count),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's (input, output) of `bytes` each.
    fn agreed(buffers: &[(u64, u64)], bytes: usize) -> Agreed {
        let passed: Vec<Vec<UserBuffer>> = buffers
            .iter()
            .map(|&(i, o)| vec![UserBuffer::new(i, bytes), UserBuffer::new(o, bytes)])
            .collect();
        Agreed::of_passed(&passed)
    }

    #[test]
    fn every_rank_decides_the_same_path_from_everyone_s_buffers() {
        let (mib, count, es) = (1u64 << 20, 1 << 18, 4);
        let bytes = count * es;
        // Out of place and disjoint everywhere: staged in the outputs.
        let apart = agreed(&[(0, 8 * mib), (16 * mib, 32 * mib)], bytes);
        assert_eq!(
            CallPath::of(&apart, count, es),
            CallPath::Staged(Staging::Output)
        );
        // One rank's buffers overlap: the scratch ring on every rank.
        let overlap = agreed(&[(0, 8 * mib), (16 * mib, 16 * mib + 64)], bytes);
        assert_eq!(
            CallPath::of(&overlap, count, es),
            CallPath::Staged(Staging::ScratchRing)
        );
        // In place on one rank only: the zero-copy kernel, as that rank's algorithm runs it.
        let mixed = agreed(&[(0, 0), (16 * mib, 32 * mib)], bytes);
        assert_eq!(CallPath::of(&mixed, count, es), CallPath::ZeroCopy);
        // In place everywhere (this algorithm chosen by name): the scratch ring.
        let in_place = agreed(&[(0, 0), (16 * mib, 16 * mib)], bytes);
        assert_eq!(
            CallPath::of(&in_place, count, es),
            CallPath::Staged(Staging::ScratchRing)
        );
    }
}
