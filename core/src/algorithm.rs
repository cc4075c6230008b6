//! The `Algorithm` trait: one way of running one collective, native or from an execution plan.
//!
//! Native kernels and MSCCL++ JSON execution plans implement the same trait so that one selector
//! serves both. Names follow MSCCL++ (`default_allreduce_packet`, ...), so users' selector tables
//! and tuning files carry over.
//!
//! # Contract
//! - An algorithm is constructed ready to run for one communicator (the builder that makes it
//!   registers memory and sets up channels); `execute` only enqueues work on the given stream.
//! - `execute` never synchronises the host with the device, so it is legal during CUDA-graph capture,
//!   and it stays correct when the same buffers are used by repeated calls or graph replays.
//! - An unsupported (dtype, op, size) combination is reported by `check` and by `execute` as
//!   [`Error::Unsupported`] naming the combination, never computed wrongly.
//! - A requested launch shape (`nblocks`, `nthreads`) the algorithm cannot run with is reported
//!   by `execute` as [`Error::LaunchShape`], before anything is enqueued or any state advances, so
//!   the caller may try another shape (MSCCL++'s Python API returns it as a [`CommResult`] code).
//!
//! # Thread safety
//! `Send + Sync`; concurrent `execute` calls on one algorithm object need distinct streams and
//! buffers, since algorithms keep per-buffer device state (flags, scratch).

use crate::dtype::{AccumType, DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::gpu::{DevicePtr, Stream};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The collective operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Collective {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
    SendRecv,
    /// Every rank's input reduced into the root's output.
    Reduce,
    /// Every rank's input, in rank order, into the root's output.
    Gather,
    /// Chunk `p` of the root's input into rank `p`'s output.
    Scatter,
}

impl Collective {
    pub const ALL: [Collective; 9] = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::Broadcast,
        Collective::AllToAll,
        Collective::SendRecv,
        Collective::Reduce,
        Collective::Gather,
        Collective::Scatter,
    ];

    /// The collective MSCCL++ spells `name` ([`name`](Self::name)).
    pub fn from_name(name: &str) -> Option<Collective> {
        Collective::ALL.into_iter().find(|c| c.name() == name)
    }

    /// MSCCL++ spelling (`allreduce`, ...), used in plan files and tuning tables.
    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::AllGather => "allgather",
            Collective::ReduceScatter => "reducescatter",
            Collective::Broadcast => "broadcast",
            Collective::AllToAll => "alltoall",
            Collective::SendRecv => "sendrecv",
            Collective::Reduce => "reduce",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
        }
    }

    /// Whether the collective combines values (so `op` and the accumulation type matter).
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        )
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// MSCCL++'s `CommResult` (`mscclpp/algorithm.hpp`): the code its `Algorithm::execute` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum CommResult {
    Success = 0,
    UnhandledCudaError = 1,
    SystemError = 2,
    InternalError = 3,
    InvalidArgument = 4,
    InvalidUsage = 5,
    RemoteError = 6,
    InProgress = 7,
    NumResults = 8,
}

impl CommResult {
    /// The code MSCCL++'s `execute` returns for the outcome of an `execute`, where a code stands
    /// for it: [`Success`](Self::Success), or [`InvalidArgument`](Self::InvalidArgument) for a
    /// launch shape the algorithm cannot run ([`Error::LaunchShape`]; MSCCL++'s algorithms return
    /// that code for a block count beyond their maximum). Every other error stays an error.
    pub fn of_execute(outcome: Result<()>) -> Result<CommResult> {
        match outcome {
            Ok(()) => Ok(CommResult::Success),
            Err(Error::LaunchShape(_)) => Ok(CommResult::InvalidArgument),
            Err(e) => Err(e),
        }
    }

    pub const fn code(self) -> i32 {
        self as i32
    }
}

/// Arguments of one collective call, in bytes as MSCCL++'s `execute` takes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExecuteArgs {
    pub input: DevicePtr,
    pub output: DevicePtr,
    pub input_bytes: usize,
    pub output_bytes: usize,
    pub dtype: DataType,
    pub op: ReduceOp,
    pub accum: AccumType,
    /// Root rank for rooted collectives (broadcast, reduce, gather, scatter); ignored otherwise.
    pub root: usize,
    pub stream: Stream,
    /// Launch geometry; `None` lets the algorithm choose.
    pub nblocks: Option<u32>,
    pub nthreads: Option<u32>,
}

impl ExecuteArgs {
    /// Element count of the input buffer; an input size that is not a whole number of elements is
    /// an error naming both numbers.
    pub fn input_count(&self) -> Result<usize> {
        let size = self.dtype.size();
        if self.input_bytes % size != 0 {
            return Err(Error::InvalidArgument(format!(
                "input size {} bytes is not a multiple of the {} element size {size}",
                self.input_bytes, self.dtype
            )));
        }
        Ok(self.input_bytes / size)
    }

    pub fn in_place(&self) -> bool {
        self.input == self.output
    }
}

/// One algorithm for one collective. See the module docs for the contract.
pub trait Algorithm: Send + Sync {
    /// MSCCL++-compatible name, e.g. `default_allreduce_packet`.
    fn name(&self) -> &str;

    fn collective(&self) -> Collective;

    /// Whether this algorithm can run `args`; the error says which part is not supported.
    fn check(&self, args: &ExecuteArgs) -> Result<()>;

    /// Enqueues the collective on `args.stream`. Calls `check` first.
    fn execute(&self, args: &ExecuteArgs) -> Result<()>;

    /// The host work of `execute(args)` that must not run while a peer's kernel in this process
    /// waits for this rank, done now without enqueuing anything: `check`, then compiling and
    /// loading the kernels the call launches (loading a kernel may synchronize the whole CUDA
    /// context under lazy loading, so it would wait for that peer's kernel, which waits for us
    /// until its device timeout). `execute` does the same work itself when it was not done. One
    /// thread driving several ranks of one process (ncclGroupEnd over ncclCommInitAll's
    /// communicators) prepares every rank's calls before launching any. Default: `check`.
    fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        self.check(args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn comm_result_codes_are_mscclpps() {
        let codes = [
            CommResult::Success,
            CommResult::UnhandledCudaError,
            CommResult::SystemError,
            CommResult::InternalError,
            CommResult::InvalidArgument,
            CommResult::InvalidUsage,
            CommResult::RemoteError,
            CommResult::InProgress,
            CommResult::NumResults,
        ];
        for (i, c) in codes.into_iter().enumerate() {
            assert_eq!(c.code(), i as i32, "{c:?}");
        }
    }

    /// Only success and a launch shape become codes; every other error, an invalid argument
    /// included, stays the error it was.
    #[test]
    fn only_a_launch_shape_becomes_a_code() {
        assert_eq!(
            CommResult::of_execute(Ok(())).ok(),
            Some(CommResult::Success)
        );
        let shape = Error::LaunchShape("nblocks 128: must be in 1..=66".into());
        assert_eq!(
            CommResult::of_execute(Err(shape)).ok(),
            Some(CommResult::InvalidArgument)
        );
        let errors = [
            Error::InvalidArgument("input size 3 bytes".into()),
            Error::Unsupported("f64 min".into()),
            Error::DeviceTimeout("allreduce".into()),
            Error::Timeout {
                what: "rank 1".into(),
                timeout: Duration::from_secs(1),
            },
            Error::Peer {
                rank: 1,
                message: "gone".into(),
            },
            Error::Aborted("by rank 0".into()),
        ];
        for e in errors {
            let text = e.to_string();
            let back = CommResult::of_execute(Err(e)).expect_err("stays an error");
            assert_eq!(back.to_string(), text);
        }
    }
}
