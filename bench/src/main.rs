//! `mscclpp-bench`: the mscclpp-rs benchmark binary.
//!
//! Modes (first argument, optional):
//! - `auto` (default): the collective benchmark where GPUs are present (with no arguments: bf16
//!   allreduce, 1 KiB to 1 GiB, with the same-run NCCL ratio); with no GPU (or no usable
//!   GPU backend) it says so and runs the bootstrap self-check instead.
//! - `collective`: the collective benchmark (nccl-tests options, `collective --help`); its absence
//!   of a GPU is an error.
//! - `bootstrap`: the bootstrap self-check (8-byte all_gather and barrier latency).
//! - `tune`: the tuner: grid-searches (algorithm, nblocks, nthreads) per power-of-two size and
//!   writes a YAML tuning table (`tune --help`); `collective --tuning FILE` uses it.
//! - `plan-check FILE|DIR... [--ranks N]`: proves MSCCL++ JSON execution plans on the CPU reference
//!   interpreter; exits non-zero if any plan fails.
//!
//! Under a launcher (RANK/WORLD_SIZE, OMPI_COMM_WORLD_*, PMI_*, SLURM_*) the process is one rank.
//! Launched plainly it spawns `-n` local ranks of itself on loopback (default: one per local GPU,
//! or 8 without GPUs).

mod collective;
mod gpu_probe;
mod nccl;
mod plan_check;
mod selfcheck;
mod tune;

use mscclpp_core::env::Env;
use mscclpp_core::{Error, Result};
use selfcheck::SelfCheckArgs;
use std::process::ExitCode;

const USAGE: &str = "\
usage: mscclpp-bench [auto|collective] [collective options; see `mscclpp-bench collective --help`]
       mscclpp-bench tune [-c NAME] [-d LIST] [-b SIZE] [-e SIZE] --out FILE [see `tune --help`]
       mscclpp-bench [auto|bootstrap] [-n RANKS] [--iters N] [--warmup N]
       mscclpp-bench plan-check FILE|DIR... [--ranks N]
       mscclpp-bench ep [see `ep --help`]

  auto        collective benchmark on GPUs; bootstrap self-check when no GPU is found (default)
  collective  collective benchmark (nccl-tests columns, --vs-nccl for the same-run NCCL ratio)
  bootstrap   bootstrap self-check: 8-byte all_gather and barrier latency, median and p99
  tune        tuner: best (algorithm, nblocks, nthreads) per power-of-two size, written as YAML
              (e.g. `tune -c allreduce -d bf16 -b 1K -e 1G --out table.yaml`); the collective
              benchmark reads it with --tuning FILE
  plan-check  proves MSCCL++ JSON execution plans on the CPU reference interpreter (no GPU)
  ep          MoE dispatch and combine of mscclpp.ext.ep (DeepEP's figures), one process per
              rank (`torchrun --no-python ... mscclpp-bench ep`): runs `python3 -m
              mscclpp.ext.ep.bench`, which needs the Python package and torch
  -n RANKS    local ranks to spawn when not started by a launcher (default: local GPUs, or 8)
  --iters N   timed iterations (default 1000)
  --warmup N  untimed iterations first (default 100)

Bootstrap settings come from MSCCLPP_* variables (MSCCLPP_SOCKET_IFNAME, MSCCLPP_BOOTSTRAP_TIMEOUT...).";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Auto,
    Bootstrap,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Args {
    mode: Mode,
    ranks: Option<usize>,
    check: SelfCheckArgs,
    help: bool,
}

fn parse_args(argv: &[String]) -> Result<Args> {
    let mut args = Args {
        mode: Mode::Auto,
        ranks: None,
        check: SelfCheckArgs {
            iters: 1000,
            warmup: 100,
        },
        help: false,
    };
    let mut it = argv.iter();
    let number = |flag: &str, v: Option<&String>| -> Result<usize> {
        let v = v.ok_or_else(|| Error::InvalidArgument(format!("{flag} needs a value")))?;
        v.parse().map_err(|_| {
            Error::InvalidArgument(format!("{flag} {v:?} is not a non-negative integer"))
        })
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "auto" => args.mode = Mode::Auto,
            "bootstrap" => args.mode = Mode::Bootstrap,
            "-n" | "--ranks" => args.ranks = Some(number(a, it.next())?),
            "--iters" => args.check.iters = number(a, it.next())?,
            "--warmup" => args.check.warmup = number(a, it.next())?,
            "-h" | "--help" => args.help = true,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown argument {other:?}\n{USAGE}"
                )))
            }
        }
    }
    if args.ranks == Some(0) {
        return Err(Error::InvalidArgument("-n must be at least 1".into()));
    }
    if args.check.iters == 0 {
        return Err(Error::InvalidArgument("--iters must be at least 1".into()));
    }
    Ok(args)
}

/// `mscclpp-bench ep`: the EP benchmark lives beside the EP API in the Python package, so this
/// process becomes `python3 -m mscclpp.ext.ep.bench ARGS` (same environment, same rank).
fn run_ep(args: &[String]) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let failed = std::process::Command::new("python3")
        .args(["-m", "mscclpp.ext.ep.bench"])
        .args(args)
        .exec();
    Err(Error::io(
        "starting python3 -m mscclpp.ext.ep.bench (the EP benchmark needs python3 with the \
         mscclpp package and torch)"
            .to_string(),
        failed,
    ))
}

fn run(argv: &[String]) -> Result<()> {
    // The collective benchmark owns every argument after its mode word (nccl-tests options, where
    // -n means iterations), so it is dispatched before the self-check parses anything.
    let first = argv.first().map(String::as_str);
    // The tuner, likewise, owns its arguments and needs GPUs (no fallback).
    if first == Some("tune") {
        return tune::run(&argv[1..], Env::get()?);
    }
    if first == Some("plan-check") {
        return plan_check::run(&argv[1..]);
    }
    if first == Some("ep") {
        return run_ep(&argv[1..]);
    }
    let collective_mode = match first {
        Some("collective") => Some(true),
        Some("bootstrap" | "-h" | "--help") => None,
        _ => (gpu_probe::probe().total() > 0).then_some(false),
    };
    if let Some(explicit) = collective_mode {
        let rest = match first {
            Some("collective" | "auto") => &argv[1..],
            _ => argv,
        };
        // The README's main job is the plain command: bf16 allreduce over every local GPU, 1 KiB to
        // 1 GiB, against NCCL in the same run (skipped with a note when NCCL cannot be loaded).
        let main_job: Vec<String> = ["-d", "bf16", "-b", "1K", "-e", "1G", "--vs-nccl"]
            .map(String::from)
            .to_vec();
        let rest = if rest.is_empty() && !explicit {
            &main_job[..]
        } else {
            rest
        };
        let env = Env::get()?;
        match collective::entry::run(rest, env, explicit)? {
            collective::entry::Start::Done => return Ok(()),
            collective::entry::Start::Fallback(reason) => {
                if env.launcher.as_ref().map_or(true, |l| l.rank == 0) {
                    println!("# no usable GPU backend: {reason}");
                }
            }
        }
    }
    let args = parse_args(argv)?;
    if args.help {
        println!("{USAGE}");
        return Ok(());
    }
    let env = Env::get()?;
    let gpus = gpu_probe::probe();
    let launched = env.launcher.is_some();
    // Only the spawning parent (or rank 0 under a launcher) explains the mode choice.
    let speaks = !launched || env.launcher.as_ref().is_some_and(|l| l.rank == 0);
    if args.mode == Mode::Auto && speaks {
        if gpus.total() == 0 {
            println!(
                "# no GPU found (no /dev/nvidiaN device, no AMD KFD GPU node): running the \
                 bootstrap self-check instead"
            );
        } else {
            println!(
                "# {} GPU(s) found ({} NVIDIA, {} AMD) but none is usable (see above): running \
                 the bootstrap self-check instead",
                gpus.total(),
                gpus.nvidia,
                gpus.amd
            );
        }
    }
    if launched {
        return selfcheck::run_rank(env, &args.check);
    }
    let n = args
        .ranks
        .unwrap_or(if gpus.total() > 0 { gpus.total() } else { 8 });
    // Children get the mode spelled out, so they run the self-check without repeating the note.
    let mut child_argv: Vec<String> = argv
        .iter()
        .filter(|a| a.as_str() != "auto" && a.as_str() != "bootstrap")
        .cloned()
        .collect();
    child_argv.insert(0, "bootstrap".into());
    selfcheck::spawn_local(n, &child_argv, env)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    match run(&argv) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let who = std::env::var("RANK")
                .map(|r| format!(" (rank {r})"))
                .unwrap_or_default();
            // Timestamped: with "the timed loop stopped" it splits a failed run's exit time into
            // noticing, our teardown (drain, unmapping, freeing) and the process's own exit.
            tracing::warn!(target: "mscclpp::bench", "torn down{who}, exiting on the error");
            eprintln!("mscclpp-bench{who}: error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_modes_and_flags() {
        let a = parse_args(&argv("bootstrap -n 4 --iters 10 --warmup 2")).unwrap();
        assert_eq!(a.mode, Mode::Bootstrap);
        assert_eq!(a.ranks, Some(4));
        assert_eq!(
            a.check,
            SelfCheckArgs {
                iters: 10,
                warmup: 2
            }
        );
        assert_eq!(parse_args(&[]).unwrap().mode, Mode::Auto);
    }

    #[test]
    fn rejects_bad_arguments() {
        for bad in ["-n", "-n x", "-n 0", "--iters 0", "--frobnicate"] {
            assert!(parse_args(&argv(bad)).is_err(), "{bad}");
        }
    }
}
