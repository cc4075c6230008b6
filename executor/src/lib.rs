//! MSCCL++ JSON execution plans: the plan model ([`plan`]) and its validation ([`validate`]), the
//! CPU reference interpreter that proves a plan ([`reference`](mod@reference), [`check`]), and
//! the GPU side: the op encoding the interpreter kernel walks ([`encode`]),
//! [`algorithm::PlanAlgorithm`] (a plan as an `Algorithm` of the collection) and where plans are
//! loaded from ([`load`]).
//!
//! A plan is parsed and validated in one step by [`Plan::load`] / [`Plan::from_json`]; every error
//! names the JSON path of the offending value and the reason, so a user can fix a hand-edited or
//! vendor-tuned plan without reading our code.

pub mod algorithm;
pub mod builder;
pub mod call_bounds;
pub mod check;
pub mod encode;
pub mod error;
pub mod load;
pub mod plan;
pub mod reference;
pub mod validate;

pub use error::{PlanError, Result};
pub use plan::{
    AddedOps, BufferRef, BufferType, Channel, ChannelType, Collective, Gpu, IterContext, Op,
    OpCode, Plan, PlanReduceOp, Protocol, RankGroup, RemoteBuffer, RemoteBufferRef, Semaphore,
    TbChannels, TbgInfo, Threadblock,
};
