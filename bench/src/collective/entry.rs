//! Start of the collective mode: options, then one rank under a launcher, or one local rank per
//! GPU spawned from this process (the same spawner as the self-check, with the `collective` mode
//! word so children never fall back).
//!
//! Besides the benchmark's options ([`super::options::USAGE`]) the mode takes `--ranks N`: how many local
//! ranks to spawn when no launcher started us (default: every visible GPU). `-n` keeps its
//! nccl-tests meaning (iterations).

use super::options::{parse_args, Command, USAGE};
use super::run::{run_rank, RankSetup};
use crate::selfcheck;
use mscclpp_core::bootstrap::{Bootstrap, TcpBootstrap};
use mscclpp_core::env::Env;
use mscclpp_core::{Error, Gpu, Result};
use std::sync::Arc;

/// How the mode ended.
#[derive(Debug)]
pub enum Start {
    Done,
    /// Chosen by `auto`, but no GPU backend works here: the caller runs the self-check instead.
    Fallback(String),
}

/// Splits `--ranks N` (or `--ranks=N`) off the benchmark's own arguments.
pub fn split_ranks(args: &[String]) -> Result<(Option<usize>, Vec<String>)> {
    let mut ranks = None;
    let mut rest = Vec::with_capacity(args.len());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let value = if a == "--ranks" {
            Some(
                it.next()
                    .ok_or_else(|| Error::InvalidArgument("--ranks needs a value".into()))?
                    .clone(),
            )
        } else {
            a.strip_prefix("--ranks=").map(str::to_string)
        };
        match value {
            Some(v) => {
                let n: usize = v.parse().map_err(|_| {
                    Error::InvalidArgument(format!("--ranks {v:?} is not a positive integer"))
                })?;
                if n == 0 {
                    return Err(Error::InvalidArgument("--ranks must be at least 1".into()));
                }
                ranks = Some(n);
            }
            None => rest.push(a.clone()),
        }
    }
    Ok((ranks, rest))
}

/// Runs the collective mode with `args` (after the mode word). `explicit`: the user named the
/// mode, so a missing GPU backend is an error rather than a fallback.
pub fn run(args: &[String], env: &'static Env, explicit: bool) -> Result<Start> {
    let (ranks, bench_args) = split_ranks(args)?;
    let opts = match parse_args(bench_args.iter().cloned())? {
        Command::Help => {
            println!("{USAGE}      --ranks N            local ranks to spawn without a launcher (default: every GPU)");
            return Ok(Start::Done);
        }
        Command::Run(o) => o,
    };
    let gpu: Arc<dyn Gpu> = match mscclpp::select_backend(env) {
        Ok(b) => Arc::new(b),
        Err(e) if !explicit => return Ok(Start::Fallback(e.to_string())),
        Err(e) => return Err(e),
    };
    let Some(launcher) = env.launcher.as_ref() else {
        let n = match ranks {
            Some(n) => n,
            None => gpu.device_count()?,
        };
        // The parent only spawns; its backend must not hold a context the children compete with.
        drop(gpu);
        let mut child = vec!["collective".to_string()];
        child.extend(bench_args);
        selfcheck::spawn_local(n, &child, env)
            .map_err(|e| selfcheck::ranks_failed("the collective benchmark did not pass", e))?;
        return Ok(Start::Done);
    };
    mscclpp::init_logging(env)?;
    let bootstrap: Arc<dyn Bootstrap> = Arc::new(TcpBootstrap::from_env(env)?);
    // More local ranks than GPUs share them round-robin, as the GPU suite does (results are
    // checked as usual; NCCL refuses shared GPUs, so leave out --vs-nccl then).
    let device = launcher.local_rank % gpu.device_count()?.max(1);
    let setup = RankSetup {
        env,
        gpu,
        bootstrap,
        device,
    };
    let summary = run_rank(setup, &opts)?;
    if summary.total_wrong > 0 {
        return Err(Error::Internal(format!(
            "{} wrong elements over {} rows: the collectives returned incorrect results (see #wrong)",
            summary.total_wrong,
            summary.rows.len()
        )));
    }
    let empty = super::report::rows_that_ran_nothing(&summary.rows);
    if let Some(first) = empty.first() {
        return Err(Error::Unsupported(format!(
            "{} of {} requested rows ran nothing (first: {first})",
            empty.len(),
            summary.rows.len()
        )));
    }
    Ok(Start::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn ranks_are_split_off_and_the_rest_kept_in_order() {
        let (r, rest) = split_ranks(&argv("-b 1K --ranks 2 -n 50 --vs-nccl")).expect("split");
        assert_eq!(r, Some(2));
        assert_eq!(rest, argv("-b 1K -n 50 --vs-nccl"));
        let (r, rest) = split_ranks(&argv("--ranks=4")).expect("split");
        assert_eq!((r, rest.len()), (Some(4), 0));
        for bad in ["--ranks", "--ranks 0", "--ranks x"] {
            assert!(split_ranks(&argv(bad)).is_err(), "{bad}");
        }
    }
}
