//! An all-reduce through the Rust API: pick the GPU backend and join the job (common.rs), build
//! the native algorithms, let the selector choose one for the call, run it and check the result.
//!
//! One process per GPU under a launcher, or alone as a job of one rank:
//!   cargo build -p mscclpp-examples --example allreduce
//!   torchrun --no-python --nproc_per_node=2 target/debug/examples/allreduce
//! Without a GPU it prints why and exits successfully.

#[path = "common.rs"]
mod common;

use mscclpp::core::algorithm_collection::SelectionContext;
use mscclpp::core::{Collective, DataType, ReduceOp};
use mscclpp::Result;
use std::process::ExitCode;

const COUNT: usize = 1 << 20;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("allreduce: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let Some(job) = common::join_job()? else {
        return Ok(());
    };
    // Every native algorithm, sharing one scratch; building is collective (every rank maps every
    // peer's scratch now).
    let algorithms = mscclpp_collectives::default_algorithm_collection(
        &job.comm,
        mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
    )?;
    let algorithm = algorithms.select(&SelectionContext {
        collective: Collective::AllReduce,
        message_bytes: COUNT * DataType::F32.size(),
        dtype: DataType::F32,
        world_size: job.comm.size(),
        local_world_size: job.comm.topology().local_size(job.comm.rank()),
        symmetric_memory: false,
        capturing: false,
        arch: job.gpu.properties(job.comm.device())?.arch,
        nvls_allowed: false,
        in_place: true,
        op: Some(ReduceOp::Sum),
    })?;
    common::sum_and_check(&job, algorithm.as_ref(), COUNT, true)
}
