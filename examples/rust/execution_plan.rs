//! An MSCCL++ JSON execution plan: load and validate it, prove it on the CPU reference interpreter
//! (every data type, odd chunk sizes; no GPU needed), then, on GPUs with the plan's world size,
//! run it as an algorithm of a collection and check the result.
//!
//!   cargo run -p mscclpp-examples --example execution_plan [PLAN.json]
//!   torchrun --no-python --nproc_per_node=2 target/debug/examples/execution_plan
//! The default plan, examples/plans/allreduce_2ranks.json, is the 2-rank Simple all-reduce of
//! `mscclpp_executor::builder`. The NCCL shim and the Python package pick plans up from
//! MSCCLPP_EXECUTION_PLAN_DIR the same way.

#[path = "common.rs"]
mod common;

use mscclpp::core::algorithm_collection::AlgorithmCollection;
use mscclpp::{Error, Result};
use mscclpp_executor::{load, reference, Plan};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

const COUNT: usize = 1 << 20;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("execution_plan: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let path = std::env::args_os().nth(1).map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("plans/allreduce_2ranks.json"),
        PathBuf::from,
    );
    // Every error names the JSON path of the offending value.
    let plan = Plan::load(&path).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let sizes = reference::prove(&plan).map_err(|e| Error::Internal(e.to_string()))?;
    println!(
        "{}: plan {:?} for {} ranks proved on the CPU (f32 input bytes per rank {sizes:?})",
        path.display(),
        plan.name,
        plan.world_size()
    );

    let Some(job) = common::join_job()? else {
        return Ok(());
    };
    if job.comm.size() != plan.world_size() {
        println!(
            "SKIP: the plan is for {} ranks, this job has {}",
            plan.world_size(),
            job.comm.size()
        );
        return Ok(());
    }
    let in_place = plan.inplace;
    let mut builder = AlgorithmCollection::builder();
    let added = load::add_plans(&job.comm, &mut builder, &[Arc::new(plan)])?;
    common::sum_and_check(&job, added[0].as_ref(), COUNT, in_place)
}
