//! `default_allreduce_copy_engine`: large all-reduces whose data the copy engines move while the
//! SMs reduce (`crate::copy_engine` has the schedule; kernels `allreduce_ce_reduce` and
//! `allreduce_ce_sync`). The peers' pieces land in the output where the call allows it, else in a
//! ring in the collection's scratch (`copy_engine::Staging`).

use crate::copy_engine::{CallPlan, CopyEngine, Staging};
use crate::geometry;
use crate::native::{NativeBase, NativeKind, DEFAULT_THREADS};
use crate::resources::CollectionResources;
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::Result;
use std::sync::Arc;

/// See the module docs.
pub struct AllreduceCopyEngine {
    // Before `base`: the copy stream drains before anything else goes.
    engine: CopyEngine,
    base: NativeBase,
}

impl AllreduceCopyEngine {
    /// Collective: sets it up for `comm`, borrowing the collection's `resources`.
    pub fn new(comm: Arc<Communicator>, resources: Arc<CollectionResources>) -> Result<Self> {
        Ok(AllreduceCopyEngine {
            engine: CopyEngine::new(&comm, resources.clone())?,
            base: NativeBase::new(NativeKind::AllreduceCopyEngine, comm, resources)?,
        })
    }

    fn run(&self, args: &ExecuteArgs, count: usize) -> Result<()> {
        let base = &self.base;
        let reduce = base.function(args)?;
        let sync = base.entry_point(args, "allreduce_ce_sync")?;
        let inputs = base.rank_ptrs(args.input, args.input_bytes)?;
        let outputs = if args.in_place() {
            inputs.clone()
        } else {
            base.rank_ptrs(args.output, args.input_bytes)?
        };
        let comm = base.comm();
        let (n, rank) = (comm.size(), comm.rank());
        let (input, output, bytes) = (args.input, args.output, args.input_bytes as u64);
        let disjoint = input + bytes <= output || output + bytes <= input;
        let staging = Staging::for_call(args.in_place(), disjoint, count, args.dtype.size(), n);
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

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        match self.base.begin(args)? {
            Some(count) => self.run(args, count),
            None => Ok(()),
        }
    }
}
