//! The native algorithms, one module and one small type each, named as MSCCL++ names them
//! (`default_allreduce_rsag_zero_copy` is [`allreduce_rsag_zero_copy::AllreduceRsagZeroCopy`]).
//! Algorithms that share a kernel family share its launcher: [`packet`] (LL packets through the
//! collection's scratch), [`scratch_pipeline`] (unregistered buffers staged through it),
//! [`zero_copy`] (registered user buffers). Each kernel family takes one argument struct of
//! `mscclpp_core::device` (`PacketArgs`, `PipelineArgs`, `ZeroCopyArgs`, `CopyEngineArgs`).
//!
//! Every algorithm borrows the collection's `resources::CollectionResources` (scratch, call
//! counter, semaphores; read its rule on streams) and holds a `native::NativeBase`.

pub mod allgather_fullmesh;
pub mod allgather_fullmesh2;
pub mod allgather_packet;
pub mod allreduce_allpair_ll128;
pub mod allreduce_allpair_packet;
pub mod allreduce_copy_engine;
pub mod allreduce_fullmesh;
pub mod allreduce_packet;
pub mod allreduce_rsag;
pub mod allreduce_rsag_pipeline;
pub mod allreduce_rsag_push;
pub mod allreduce_rsag_zero_copy;
pub mod broadcast_zero_copy;
pub mod packet;
pub mod reduce_zero_copy;
pub mod reducescatter_packet;
pub mod reducescatter_zero_copy;
pub mod scratch_pipeline;
pub mod zero_copy;

use crate::native::NativeKind;
use crate::resources::CollectionResources;
use mscclpp_core::algorithm::Algorithm;
use mscclpp_core::communicator::Communicator;
use mscclpp_core::Result;
use std::sync::Arc;

/// Collective: the algorithm of `kind` for `comm`, borrowing the collection's `resources`.
pub fn build(
    kind: NativeKind,
    comm: &Arc<Communicator>,
    resources: &Arc<CollectionResources>,
) -> Result<Arc<dyn Algorithm>> {
    let (c, r) = (comm.clone(), resources.clone());
    Ok(match kind {
        NativeKind::AllreduceAllpairPacket => {
            Arc::new(allreduce_allpair_packet::AllreduceAllpairPacket::new(c, r)?)
        }
        NativeKind::AllreduceAllpairLl128 => {
            Arc::new(allreduce_allpair_ll128::AllreduceAllpairLl128::new(c, r)?)
        }
        NativeKind::AllreducePacket => Arc::new(allreduce_packet::AllreducePacket::new(c, r)?),
        NativeKind::AllreduceRsagZeroCopy => {
            Arc::new(allreduce_rsag_zero_copy::AllreduceRsagZeroCopy::new(c, r)?)
        }
        NativeKind::AllgatherFullmesh2 => {
            Arc::new(allgather_fullmesh2::AllgatherFullmesh2::new(c, r)?)
        }
        NativeKind::AllgatherPacket => Arc::new(allgather_packet::AllgatherPacket::new(c, r)?),
        NativeKind::ReducescatterZeroCopy => {
            Arc::new(reducescatter_zero_copy::ReducescatterZeroCopy::new(c, r)?)
        }
        NativeKind::ReducescatterPacket => {
            Arc::new(reducescatter_packet::ReducescatterPacket::new(c, r)?)
        }
        NativeKind::BroadcastZeroCopy => {
            Arc::new(broadcast_zero_copy::BroadcastZeroCopy::new(c, r)?)
        }
        NativeKind::AllreduceRsag => Arc::new(allreduce_rsag::AllreduceRsag::new(c, r)?),
        NativeKind::AllreduceRsagPipeline => {
            Arc::new(allreduce_rsag_pipeline::AllreduceRsagPipeline::new(c, r)?)
        }
        NativeKind::AllreduceFullmesh => {
            Arc::new(allreduce_fullmesh::AllreduceFullmesh::new(c, r)?)
        }
        NativeKind::AllgatherFullmesh => {
            Arc::new(allgather_fullmesh::AllgatherFullmesh::new(c, r)?)
        }
        NativeKind::AllreduceCopyEngine => {
            Arc::new(allreduce_copy_engine::AllreduceCopyEngine::new(c, r)?)
        }
        NativeKind::ReduceZeroCopy => Arc::new(reduce_zero_copy::ReduceZeroCopy::new(c, r)?),
        NativeKind::AllreduceRsagPush => {
            Arc::new(allreduce_rsag_push::AllreduceRsagPush::new(c, r)?)
        }
    })
}

/// Declares the type of one native algorithm: a `NativeBase` of `$kind`, its constructor, and
/// the `Algorithm` methods they share; the module supplies `fn run(&self, args, count)`, the
/// launch of a checked call with work to do.
macro_rules! native_algorithm {
    ($(#[$doc:meta])* $ty:ident, $kind:expr) => {
        $(#[$doc])*
        pub struct $ty {
            base: $crate::native::NativeBase,
        }

        impl $ty {
            /// Collective: sets it up for `comm`, borrowing the collection's `resources`.
            pub fn new(
                comm: std::sync::Arc<mscclpp_core::communicator::Communicator>,
                resources: std::sync::Arc<$crate::resources::CollectionResources>,
            ) -> mscclpp_core::Result<Self> {
                Ok($ty {
                    base: $crate::native::NativeBase::new($kind, comm, resources)?,
                })
            }
        }

        impl mscclpp_core::algorithm::Algorithm for $ty {
            fn name(&self) -> &str {
                self.base.kind().name()
            }

            fn collective(&self) -> mscclpp_core::algorithm::Collective {
                self.base.kind().collective()
            }

            fn check(&self, args: &mscclpp_core::algorithm::ExecuteArgs) -> mscclpp_core::Result<()> {
                self.base.check(args)
            }

            fn execute(&self, args: &mscclpp_core::algorithm::ExecuteArgs) -> mscclpp_core::Result<()> {
                match self.base.begin(args)? {
                    Some(count) => self.run(args, count),
                    None => Ok(()),
                }
            }

            fn prepare(&self, args: &mscclpp_core::algorithm::ExecuteArgs) -> mscclpp_core::Result<()> {
                self.base.prepare(args)
            }
        }
    };
}
pub(crate) use native_algorithm;
