//! Writes the builder's all-reduce plans ([`mscclpp_executor::builder`]) as MSCCL++ JSON plan
//! files, one Simple and one LL plan per world size, for programs that read plan files: the Python
//! DSL example on the GPU machine (`scripts/gpu-stage.sh` writes them into `.gpu/plans`, beside
//! the fixtures, which have plans for 2 and 4 ranks only).
//!
//! Usage: `cargo run -p mscclpp-executor --example builder_plans -- DIR RANKS...`

use mscclpp_executor::builder;
use mscclpp_executor::{Plan, PlanReduceOp, Protocol};
use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (Some(dir), ranks) = (args.next().map(PathBuf::from), args.collect::<Vec<_>>()) else {
        eprintln!("usage: builder_plans DIR RANKS...");
        return ExitCode::FAILURE;
    };
    for r in &ranks {
        let Some(n) = r.parse::<usize>().ok().filter(|&n| n >= 2) else {
            eprintln!("builder_plans: {r:?} is not a world size of 2 or more");
            return ExitCode::FAILURE;
        };
        for (protocol, kind) in [(Protocol::Simple, "simple"), (Protocol::Ll, "packet")] {
            let json = builder::allreduce(n, protocol, PlanReduceOp::Sum).to_string();
            // The plan is checked as a user's would be before it is written.
            if let Err(e) = Plan::from_json(json.as_bytes()) {
                eprintln!("builder_plans: the {kind} plan for {n} ranks is invalid: {e}");
                return ExitCode::FAILURE;
            }
            let path = dir.join(format!("builder_allreduce_{kind}_{n}gpu.json"));
            if let Err(e) = std::fs::write(&path, json) {
                eprintln!("builder_plans: {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
