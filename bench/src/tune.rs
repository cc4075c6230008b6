//! `mscclpp-bench tune`: runs the tuner (`mscclpp_collectives::tune`) over every local GPU and
//! writes the tuning table (rank 0) as YAML, for `collective --tuning FILE` and for users'
//! `tuned_selector`s.
//!
//! Launching is the collective benchmark's: one rank under a launcher, or `--ranks N` local ranks
//! spawned from this process (default: every visible GPU), each started with the `tune` mode
//! word.

use crate::collective::entry::split_ranks;
use crate::collective::options::{parse_collective, parse_dtypes, parse_size};
use crate::selfcheck;
use mscclpp_collectives::tune::{tune, CandidateGrid};
use mscclpp_core::bootstrap::{Bootstrap, TcpBootstrap};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::env::Env;
use mscclpp_core::tuner::TuningTable;
use mscclpp_core::{Collective, DataType, Error, Gpu, Result};
use std::path::PathBuf;
use std::sync::Arc;

/// The usage text of the mode.
pub const USAGE: &str = "\
usage: mscclpp-bench tune [options] --out FILE

Grid-searches (algorithm, nblocks, nthreads) for every power-of-two size under CUDA graphs; every
rank takes the same decision; rank 0 writes the winners as a YAML tuning table.

Options:
  -c, --collective NAME    allreduce allgather reducescatter broadcast alltoall sendrecv
                           (default allreduce)
  -d, --datatype LIST      element types, comma-separated, or all (default bf16)
  -b, --minbytes SIZE      smallest size, rounded up to a power of two (default 1K)
  -e, --maxbytes SIZE      largest size, rounded down to a power of two (default 1G)
      --algos LIST|all     algorithms to try, by MSCCL++ name (default all of the collective)
      --nblocks LIST       thread-block counts to try; `auto` is the algorithm's choice
                           (default auto), e.g. auto,8,16,32
      --nthreads LIST      threads per block to try, as --nblocks (default auto), e.g. 256,512,1024
  -n, --iters N            calls captured in each timed graph (default 20)
      --out FILE           where rank 0 writes the table (required)
      --ranks N            local ranks to spawn without a launcher (default: every GPU)
  -h, --help               this text
";

/// Parsed options of the mode.
#[derive(Debug, Clone, PartialEq)]
pub struct TuneArgs {
    pub collective: Collective,
    pub dtypes: Vec<DataType>,
    pub min_bytes: usize,
    pub max_bytes: usize,
    /// `None`: every algorithm of the collective.
    pub algos: Option<Vec<String>>,
    pub nblocks: Vec<Option<u32>>,
    pub nthreads: Vec<Option<u32>>,
    pub iters: usize,
    pub out: PathBuf,
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum TuneCommand {
    Help,
    Run(Box<TuneArgs>),
}

/// `auto,8,16`: geometry options; `auto` is `None`.
fn parse_geometry(flag: &str, s: &str) -> Result<Vec<Option<u32>>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let v = if part.eq_ignore_ascii_case("auto") {
            None
        } else {
            match part.parse::<u32>() {
                Ok(n) if n > 0 => Some(n),
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "{flag} {part:?} is neither a positive integer nor auto"
                    )))
                }
            }
        };
        if !out.contains(&v) {
            out.push(v);
        }
    }
    if out.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{flag} list {s:?} is empty"
        )));
    }
    Ok(out)
}

/// Parses the arguments after the mode word (and after `--ranks` was split off).
pub fn parse_tune_args(args: &[String]) -> Result<TuneCommand> {
    let mut o = TuneArgs {
        collective: Collective::AllReduce,
        dtypes: vec![DataType::Bf16],
        min_bytes: 1 << 10,
        max_bytes: 1 << 30,
        algos: None,
        nblocks: vec![None],
        nthreads: vec![None],
        iters: 20,
        out: PathBuf::new(),
    };
    let mut out = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = || -> Result<String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => it
                    .next()
                    .cloned()
                    .ok_or_else(|| Error::InvalidArgument(format!("{flag} needs a value"))),
            }
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(TuneCommand::Help),
            "-c" | "--collective" => {
                o.collective = parse_collective(&value()?)?;
                // The tuner's table has no root: rooted collectives are served by one algorithm.
                if matches!(
                    o.collective,
                    Collective::Reduce | Collective::Gather | Collective::Scatter
                ) {
                    return Err(Error::InvalidArgument(format!(
                        "-c {}: the tuner tunes allreduce, allgather, reducescatter, broadcast \
                         and alltoall",
                        o.collective
                    )));
                }
            }
            "-d" | "--datatype" => o.dtypes = parse_dtypes(&value()?)?,
            "-b" | "--minbytes" => o.min_bytes = parse_size(&value()?)?,
            "-e" | "--maxbytes" => o.max_bytes = parse_size(&value()?)?,
            "--algos" => {
                let v = value()?;
                o.algos = if v.eq_ignore_ascii_case("all") {
                    None
                } else {
                    let names: Vec<String> = v
                        .split(',')
                        .map(str::trim)
                        .filter(|p| !p.is_empty())
                        .map(String::from)
                        .collect();
                    if names.is_empty() {
                        return Err(Error::InvalidArgument(format!(
                            "--algos list {v:?} is empty"
                        )));
                    }
                    Some(names)
                };
            }
            "--nblocks" => o.nblocks = parse_geometry(&flag, &value()?)?,
            "--nthreads" => o.nthreads = parse_geometry(&flag, &value()?)?,
            "-n" | "--iters" => {
                let v = value()?;
                o.iters = v.parse().ok().filter(|&n: &usize| n > 0).ok_or_else(|| {
                    Error::InvalidArgument(format!("{flag} {v:?} is not a positive integer"))
                })?;
            }
            "--out" => out = Some(PathBuf::from(value()?)),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown tune option {other:?} (see `mscclpp-bench tune --help`)"
                )))
            }
        }
    }
    o.out = out.ok_or_else(|| {
        Error::InvalidArgument("tune needs --out FILE (where to write the table)".into())
    })?;
    if o.sizes().is_empty() {
        return Err(Error::InvalidArgument(format!(
            "-b {} .. -e {} holds no power of two",
            o.min_bytes, o.max_bytes
        )));
    }
    Ok(TuneCommand::Run(Box::new(o)))
}

impl TuneArgs {
    /// Every power of two in `min_bytes..=max_bytes`.
    pub fn sizes(&self) -> Vec<usize> {
        let mut out = Vec::new();
        let mut s = self.min_bytes.max(1).checked_next_power_of_two();
        while let Some(v) = s.filter(|&v| v <= self.max_bytes) {
            out.push(v);
            s = v.checked_mul(2);
        }
        out
    }
}

/// Runs the mode with the arguments after `tune`.
pub fn run(args: &[String], env: &'static Env) -> Result<()> {
    let (ranks, rest) = split_ranks(args)?;
    let opts = match parse_tune_args(&rest)? {
        TuneCommand::Help => {
            println!("{USAGE}");
            return Ok(());
        }
        TuneCommand::Run(o) => o,
    };
    let gpu: Arc<dyn Gpu> = Arc::new(mscclpp::select_backend(env)?);
    let Some(launcher) = env.launcher.as_ref() else {
        let n = match ranks {
            Some(n) => n,
            None => gpu.device_count()?,
        };
        // The parent only spawns; its backend must not hold a context the children compete with.
        drop(gpu);
        let mut child = vec!["tune".to_string()];
        child.extend(rest);
        return selfcheck::spawn_local(n, &child, env)
            .map_err(|e| selfcheck::ranks_failed("tuning did not finish", e));
    };
    mscclpp::init_logging(env)?;
    let bootstrap: Arc<dyn Bootstrap> = Arc::new(TcpBootstrap::from_env(env)?);
    // Rank r on GPU LOCAL_RANK % GPUs, as the benchmark and the GPU suite place it.
    let device = launcher.local_rank % gpu.device_count()?.max(1);
    let comm = Arc::new(Communicator::new(bootstrap, gpu, device)?);
    let collection = mscclpp_collectives::default_algorithm_collection(
        &comm,
        mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
    )?;
    let registered = collection.names(opts.collective);
    let algorithms = match &opts.algos {
        None => registered.clone(),
        Some(names) => {
            if let Some(bad) = names.iter().find(|n| !registered.contains(n)) {
                return Err(Error::InvalidArgument(format!(
                    "--algos {bad}: no such {} algorithm (available: {})",
                    opts.collective,
                    registered.join(", ")
                )));
            }
            names.clone()
        }
    };
    let grid = CandidateGrid {
        algorithms,
        nblocks: opts.nblocks.clone(),
        nthreads: opts.nthreads.clone(),
    };
    let sizes = opts.sizes();
    let rank0 = comm.rank() == 0;
    if rank0 {
        println!(
            "# tuning {} over {} ranks: {} sizes ({} .. {} bytes) x {} candidates, {} calls per graph",
            opts.collective,
            comm.size(),
            sizes.len(),
            sizes.first().copied().unwrap_or(0),
            sizes.last().copied().unwrap_or(0),
            grid.candidates().len(),
            opts.iters
        );
    }
    let mut table = TuningTable::new();
    for &dtype in &opts.dtypes {
        let t = tune(
            &comm,
            &collection,
            opts.collective,
            dtype,
            &sizes,
            &grid,
            opts.iters,
        )?;
        table.merge(&t)?;
    }
    let saved = if rank0 {
        println!("{}", describe(&table));
        table.save_yaml(&opts.out).map(|()| {
            println!("# wrote {} entries to {}", table.len(), opts.out.display());
        })
    } else {
        Ok(())
    };
    // Nobody leaves (and tears down its connections) while rank 0 still writes; rank 0 reports a
    // failed write only after the barrier, so its peers are not left waiting for it.
    comm.bootstrap().barrier()?;
    saved?;
    Ok(())
}

/// The table as aligned text rows.
fn describe(table: &TuningTable) -> String {
    let n = |v: Option<u32>| v.map_or_else(|| "auto".to_string(), |v| v.to_string());
    let mut out = format!(
        "# {:>12} {:>6} {:<40} {:>8} {:>8} {:>10}",
        "bytes", "type", "algorithm", "nblocks", "nthreads", "time(us)"
    );
    for (_, dtype, _, bytes, l) in table.entries() {
        out.push_str(&format!(
            "\n  {:>12} {:>6} {:<40} {:>8} {:>8} {:>10.2}",
            bytes,
            dtype.name(),
            l.algorithm,
            n(l.nblocks),
            n(l.nthreads),
            l.time_us
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn parse(s: &str) -> Result<TuneArgs> {
        match parse_tune_args(&argv(s))? {
            TuneCommand::Run(o) => Ok(*o),
            TuneCommand::Help => Err(Error::Internal("help".into())),
        }
    }

    #[test]
    fn the_issue_command_parses() {
        let o = parse("-c allreduce -d bf16 -b 1K -e 1G --out table.yaml").expect("parses");
        assert_eq!(o.collective, Collective::AllReduce);
        assert_eq!(o.dtypes, vec![DataType::Bf16]);
        assert_eq!(o.out, PathBuf::from("table.yaml"));
        let sizes = o.sizes();
        assert_eq!((sizes.len(), sizes[0], sizes[20]), (21, 1024, 1 << 30));
        assert_eq!((o.nblocks.clone(), o.iters), (vec![None], 20));
    }

    #[test]
    fn grids_and_rounding() {
        let o = parse(
            "-c allgather -b 1000 -e 5000 --algos a,b --nblocks auto,8,8 --nthreads=256,512 \
             -n 5 --out=t.yaml",
        )
        .expect("parses");
        assert_eq!(o.sizes(), vec![1024, 2048, 4096]);
        assert_eq!(o.algos, Some(vec!["a".to_string(), "b".to_string()]));
        assert_eq!(o.nblocks, vec![None, Some(8)]);
        assert_eq!(o.nthreads, vec![Some(256), Some(512)]);
        assert_eq!(o.iters, 5);
        assert_eq!(
            parse_tune_args(&argv("--help")).expect("help"),
            TuneCommand::Help
        );
    }

    #[rstest]
    #[case("-c allreduce", "--out")]
    #[case("--out t.yaml -b 3000 -e 4000 -b 5000", "no power of two")]
    #[case("--out t.yaml --nblocks 0", "--nblocks \"0\"")]
    #[case("--out t.yaml --nthreads x", "--nthreads \"x\"")]
    #[case("--out t.yaml --algos ,", "--algos")]
    #[case("--out t.yaml -n 0", "-n \"0\"")]
    #[case("--out t.yaml -c gather", "gather")]
    #[case("--out t.yaml --frob", "--frob")]
    #[case("--out", "--out needs a value")]
    fn bad_arguments_name_the_problem(#[case] args: &str, #[case] needle: &str) {
        let e = parse(args).expect_err("must fail");
        assert!(e.to_string().contains(needle), "{e} lacks {needle}");
    }

    #[test]
    fn describe_lists_every_entry() {
        let mut t = TuningTable::new();
        t.insert(
            Collective::AllReduce,
            DataType::Bf16,
            2,
            1024,
            mscclpp_core::tuner::TunedLaunch {
                algorithm: "default_allreduce_packet".into(),
                nblocks: Some(8),
                nthreads: None,
                time_us: 4.25,
            },
        )
        .expect("insert");
        let text = describe(&t);
        assert!(text.contains("default_allreduce_packet"), "{text}");
        assert!(text.contains("auto"), "{text}");
        assert!(text.contains("4.25"), "{text}");
    }
}
