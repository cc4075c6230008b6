//! Command-line options of the collective benchmark, spelled as in nccl-tests where it has them.

use super::shape::{call_name, Shape};
use mscclpp_core::{Collective, DataType, Error, ReduceOp, Result};
use std::path::PathBuf;

/// The usage text (`--help`).
pub const USAGE: &str = "\
mscclpp-bench: collective benchmark over all local GPUs (nccl-tests columns)

Options:
  -b, --minbytes SIZE      smallest size (default 1K); sizes take K, M, G suffixes (powers of 1024)
  -e, --maxbytes SIZE      largest size (default 256M)
  -f, --stepfactor N       multiply the size by N between steps (default 2)
  -d, --datatype LIST      f32 f16 bf16 f64 i8 u8 i32 u32 i64 u64 fp8_e4m3 fp8_e5m2 fp8_e4m3fnuz
                           fp8_e4m3b15, comma-separated, or all (default f32)
  -o, --op LIST            sum prod min max avg, comma-separated, or all (default sum)
  -c, --collective NAME    allreduce allgather reducescatter broadcast alltoall alltoallv
                           sendrecv reduce gather scatter
                           (sendrecv: each rank to the next, as nccl-tests, on the point-to-point
                           engine, default_sendrecv_p2p; alltoallv: a skewed split, rank s to
                           rank d a share ((s + d) mod n + 1)^2 of its buffer, on the engine's
                           all-to-all-v; default allreduce)
  -r, --root N             root of broadcast, reduce, gather and scatter (default 0)
  -n, --iters N            timed calls per batch (default 20)
  -w, --warmup_iters N     warm-up calls (default 5)
  -m, --batches N          timed batches; the median batch is reported (default 5)
  -G, --cudagraph N        0: eager calls; N > 0: capture the iters calls in one CUDA graph and
                           replay it N times per batch (default 0)
      --algo NAME|auto     algorithm by MSCCL++ name, or the selector's choice (default auto)
      --nblocks N          thread blocks per kernel (default: the algorithm's choice)
      --nthreads N         threads per block (default: the algorithm's choice)
      --tuning FILE        choose algorithm and launch geometry from a tuning table written by
                           `mscclpp-bench tune` (sizes it lacks use the selector; explicit
                           --nblocks/--nthreads still win); excludes --algo NAME
      --plan FILE|DIR|default
                           load MSCCL++ JSON execution plans (a file or a directory of them;
                           default: those of MSCCLPP_EXECUTION_PLAN_DIR and MSCCLPP_CACHE_DIR that
                           run here) into the collection; the selector prefers a plan whose
                           collective, world size and size range match (or name it with --algo);
                           a plan runs only the buffer mode it was written for
      --inplace-only       measure in-place calls only
      --outofplace-only    measure out-of-place calls only
      --json FILE          also write the results as JSON
      --vs-nccl            measure NCCL (MSCCLPP_NCCL_LIB_PATH or libnccl.so.2) in the same run
      --cpu-bind gpu|none  gpu: run each rank on the CPUs next to its GPU, as `mpirun --bind-to`
                           would (default); none: leave the launcher's placement
      --check device|host|both
                           where the checks draw inputs and compare outputs: device (default;
                           the host checks what the GPU kernel does not, and describes every
                           mismatch), host, or both (one element planted wrong in every output;
                           the two checks must agree and both see it)
  -h, --help               this text
";

/// Where the checks draw their inputs and compare outputs (`--check`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckPlace {
    Device,
    Host,
    Both,
}

/// Which algorithm runs each call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AlgoChoice {
    /// The collection's selector picks per call.
    Auto,
    /// One algorithm by name, for every size (sizes it cannot take are reported, not run).
    Named(String),
}

/// Out-of-place (separate input and output) or in-place (nccl-tests' offsets) calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    OutOfPlace,
    InPlace,
}

/// Parsed options. See [`USAGE`].
#[derive(Debug, Clone, PartialEq)]
pub struct BenchOptions {
    pub min_bytes: usize,
    pub max_bytes: usize,
    pub step_factor: usize,
    pub dtypes: Vec<DataType>,
    pub ops: Vec<ReduceOp>,
    pub collective: Collective,
    /// `-c alltoallv`: the skewed all-to-all-v (`collective` is all-to-all).
    pub skewed_alltoallv: bool,
    pub root: usize,
    pub iters: usize,
    pub warmup: usize,
    pub batches: usize,
    pub graph_replays: usize,
    pub algo: AlgoChoice,
    pub nblocks: Option<u32>,
    pub nthreads: Option<u32>,
    /// `--tuning FILE`: a tuning table (YAML) consulted before the selector.
    pub tuning: Option<PathBuf>,
    /// `--plan FILE|DIR`: execution plans added to the collection.
    pub plan: Option<PathBuf>,
    pub placements: Vec<Placement>,
    pub json: Option<PathBuf>,
    pub vs_nccl: bool,
    /// `--cpu-bind gpu`: bind each rank's thread to its GPU's local CPUs.
    pub cpu_bind: bool,
    pub check: CheckPlace,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            min_bytes: 1 << 10,
            max_bytes: 256 << 20,
            step_factor: 2,
            dtypes: vec![DataType::F32],
            ops: vec![ReduceOp::Sum],
            collective: Collective::AllReduce,
            skewed_alltoallv: false,
            root: 0,
            iters: 20,
            warmup: 5,
            batches: 5,
            graph_replays: 0,
            algo: AlgoChoice::Auto,
            nblocks: None,
            nthreads: None,
            tuning: None,
            plan: None,
            placements: vec![Placement::OutOfPlace, Placement::InPlace],
            json: None,
            vs_nccl: false,
            cpu_bind: true,
            check: CheckPlace::Device,
        }
    }
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Help,
    Run(Box<BenchOptions>),
}

/// `1024`, `4K`, `128M`, `1G` (powers of 1024, as nccl-tests reads them).
pub fn parse_size(s: &str) -> Result<usize> {
    let t = s.trim();
    let (digits, shift) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 10),
        Some('M') => (&t[..t.len() - 1], 20),
        Some('G') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let n: usize = digits.parse().map_err(|_| {
        Error::InvalidArgument(format!(
            "size {s:?} is not a number with an optional K, M or G"
        ))
    })?;
    n.checked_mul(1usize << shift)
        .ok_or_else(|| Error::InvalidArgument(format!("size {s:?} is too large")))
}

fn parse_list<T>(what: &str, s: &str, all: &[T], one: impl Fn(&str) -> Result<T>) -> Result<Vec<T>>
where
    T: Copy + PartialEq,
{
    if s.eq_ignore_ascii_case("all") {
        return Ok(all.to_vec());
    }
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let v = one(part)?;
        if !out.contains(&v) {
            out.push(v);
        }
    }
    if out.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{what} list {s:?} is empty"
        )));
    }
    Ok(out)
}

/// Data types (`-d`); `all` is every type.
pub fn parse_dtypes(s: &str) -> Result<Vec<DataType>> {
    parse_list("data type", s, &DataType::ALL, |p| p.parse())
}

/// Reduction operators (`-o`); `all` is every operator.
pub fn parse_ops(s: &str) -> Result<Vec<ReduceOp>> {
    parse_list("reduce op", s, &ReduceOp::ALL, |p| p.parse())
}

/// The benchmark's `-c`: a collective, or `alltoallv` (the skewed all-to-all-v, reported as
/// `(AllToAll, true)`).
pub fn parse_bench_collective(s: &str) -> Result<(Collective, bool)> {
    if s.to_ascii_lowercase().replace(['_', '-'], "") == "alltoallv" {
        return Ok((Collective::AllToAll, true));
    }
    parse_collective(s)
        .map(|c| (c, false))
        .map_err(|e| Error::InvalidArgument(format!("{e}; or alltoallv")))
}

/// `-c`: the collectives of the runtime.
pub fn parse_collective(s: &str) -> Result<Collective> {
    match s.to_ascii_lowercase().replace(['_', '-'], "").as_str() {
        "allreduce" => Ok(Collective::AllReduce),
        "allgather" => Ok(Collective::AllGather),
        "reducescatter" => Ok(Collective::ReduceScatter),
        "broadcast" => Ok(Collective::Broadcast),
        "alltoall" => Ok(Collective::AllToAll),
        "sendrecv" => Ok(Collective::SendRecv),
        "reduce" => Ok(Collective::Reduce),
        "gather" => Ok(Collective::Gather),
        "scatter" => Ok(Collective::Scatter),
        _ => Err(Error::InvalidArgument(format!(
            "unknown collective {s:?} (expected allreduce, allgather, reducescatter, broadcast, \
             alltoall, sendrecv, reduce, gather or scatter)"
        ))),
    }
}

fn parse_number<T: std::str::FromStr>(flag: &str, s: &str) -> Result<T> {
    s.trim()
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("{flag} {s:?} is not a non-negative integer")))
}

/// Parses the arguments after the program name. `--flag=value` and `--flag value` both work.
pub fn parse_args<I, S>(args: I) -> Result<Command>
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    let mut o = BenchOptions::default();
    let mut inplace_only = false;
    let mut outofplace_only = false;
    let mut it = args.into_iter().map(Into::into);
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = |name: &str| -> Result<String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => it
                    .next()
                    .ok_or_else(|| Error::InvalidArgument(format!("{name} needs a value"))),
            }
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "-b" | "--minbytes" => o.min_bytes = parse_size(&value(&flag)?)?,
            "-e" | "--maxbytes" => o.max_bytes = parse_size(&value(&flag)?)?,
            "-f" | "--stepfactor" => o.step_factor = parse_number(&flag, &value(&flag)?)?,
            "-d" | "--datatype" => o.dtypes = parse_dtypes(&value(&flag)?)?,
            "-o" | "--op" => o.ops = parse_ops(&value(&flag)?)?,
            "-c" | "--collective" => {
                (o.collective, o.skewed_alltoallv) = parse_bench_collective(&value(&flag)?)?
            }
            "-r" | "--root" => o.root = parse_number(&flag, &value(&flag)?)?,
            "-n" | "--iters" => o.iters = parse_number(&flag, &value(&flag)?)?,
            "-w" | "--warmup_iters" | "--warmup-iters" => {
                o.warmup = parse_number(&flag, &value(&flag)?)?
            }
            "-m" | "--batches" => o.batches = parse_number(&flag, &value(&flag)?)?,
            "-G" | "--cudagraph" | "--graph-replays" => {
                o.graph_replays = parse_number(&flag, &value(&flag)?)?
            }
            "--algo" => {
                let v = value(&flag)?;
                o.algo = if v.eq_ignore_ascii_case("auto") {
                    AlgoChoice::Auto
                } else {
                    AlgoChoice::Named(v)
                };
            }
            "--nblocks" => o.nblocks = Some(parse_number(&flag, &value(&flag)?)?),
            "--nthreads" => o.nthreads = Some(parse_number(&flag, &value(&flag)?)?),
            "--tuning" => o.tuning = Some(PathBuf::from(value(&flag)?)),
            "--plan" => o.plan = Some(PathBuf::from(value(&flag)?)),
            "--inplace-only" => inplace_only = true,
            "--outofplace-only" => outofplace_only = true,
            "--json" => o.json = Some(PathBuf::from(value(&flag)?)),
            "--vs-nccl" => o.vs_nccl = true,
            "--cpu-bind" => {
                o.cpu_bind = match value(&flag)?.as_str() {
                    "gpu" => true,
                    "none" => false,
                    other => {
                        return Err(Error::InvalidArgument(format!(
                            "--cpu-bind {other}: expected gpu or none"
                        )))
                    }
                }
            }
            "--check" => {
                o.check = match value(&flag)?.as_str() {
                    "device" => CheckPlace::Device,
                    "host" => CheckPlace::Host,
                    "both" => CheckPlace::Both,
                    other => {
                        return Err(Error::InvalidArgument(format!(
                            "--check {other}: expected device, host or both"
                        )))
                    }
                }
            }
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown option {other:?} (see --help)"
                )))
            }
        }
    }
    if inplace_only && outofplace_only {
        return Err(Error::InvalidArgument(
            "--inplace-only and --outofplace-only exclude each other".into(),
        ));
    }
    if inplace_only {
        o.placements = vec![Placement::InPlace];
    } else if outofplace_only {
        o.placements = vec![Placement::OutOfPlace];
    }
    o.validate()?;
    Ok(Command::Run(Box::new(o)))
}

impl BenchOptions {
    /// Rejects combinations that can never run, naming the option.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.min_bytes == 0 {
            return bad("-b (minbytes) must be at least 1".into());
        }
        if self.min_bytes > self.max_bytes {
            return bad(format!(
                "-b {} is larger than -e {}",
                self.min_bytes, self.max_bytes
            ));
        }
        if self.step_factor < 2 && self.min_bytes != self.max_bytes {
            return bad(format!(
                "-f (stepfactor) {} must be at least 2",
                self.step_factor
            ));
        }
        if self.iters == 0 {
            return bad("-n (iters) must be at least 1".into());
        }
        if self.batches == 0 {
            return bad("-m (batches) must be at least 1".into());
        }
        if self.nblocks == Some(0) || self.nthreads == Some(0) {
            return bad("--nblocks and --nthreads must be positive".into());
        }
        if self.skewed_alltoallv {
            let other = match (&self.algo, &self.tuning, &self.plan) {
                (AlgoChoice::Named(name), _, _) => Some(format!("--algo {name}")),
                (_, Some(t), _) => Some(format!("--tuning {}", t.display())),
                (_, _, Some(p)) => Some(format!("--plan {}", p.display())),
                _ => None,
            };
            if let Some(option) = other {
                return bad(format!(
                    "{option}: -c alltoallv runs the all-to-all engine's all-to-all-v only (no \
                     algorithm of the collection takes per-peer splits)"
                ));
            }
        }
        if let (Some(t), AlgoChoice::Named(name)) = (&self.tuning, &self.algo) {
            return bad(format!(
                "--tuning {} and --algo {name} exclude each other (the table chooses the \
                 algorithm)",
                t.display()
            ));
        }
        Ok(())
    }

    /// The shape of one call of the benchmarked collective.
    pub fn shape(&self, dtype: DataType, size: usize, nranks: usize) -> Result<Shape> {
        if self.skewed_alltoallv {
            Shape::skewed_alltoallv(dtype, size, nranks)
        } else {
            Shape::new(self.collective, dtype, size, nranks)
        }
    }

    /// The name of the benchmarked collective (`alltoallv` for the skewed all-to-all-v).
    pub fn collective_name(&self) -> &'static str {
        call_name(self.collective, self.skewed_alltoallv)
    }

    /// The requested sizes, nccl-tests style: min, min*f, ... up to max.
    pub fn sizes(&self) -> Vec<usize> {
        let mut out = Vec::new();
        let mut s = self.min_bytes;
        while s <= self.max_bytes {
            out.push(s);
            match s.checked_mul(self.step_factor.max(2)) {
                Some(next) => s = next,
                None => break,
            }
        }
        out
    }

    /// The operators a run iterates over: only the first matters for data movement, which has
    /// none, and it is not printed there.
    pub fn ops_for(&self) -> Vec<Option<ReduceOp>> {
        if self.collective.reduces() {
            self.ops.iter().copied().map(Some).collect()
        } else {
            vec![None]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn run(args: &[&str]) -> Result<BenchOptions> {
        match parse_args(args.iter().copied())? {
            Command::Run(o) => Ok(*o),
            Command::Help => Err(Error::Internal("help".into())),
        }
    }

    #[test]
    fn defaults() {
        let o = run(&[]).expect("defaults parse");
        assert_eq!(o, BenchOptions::default());
        assert_eq!(
            o.placements,
            vec![Placement::OutOfPlace, Placement::InPlace]
        );
        assert_eq!(o.sizes().first(), Some(&1024));
        assert_eq!(o.sizes().last(), Some(&(256 << 20)));
        assert_eq!(o.sizes().len(), 19);
    }

    #[test]
    fn every_option() {
        let o = run(&[
            "-b",
            "8",
            "-e",
            "128M",
            "-f",
            "4",
            "-d",
            "bf16,fp8_e4m3",
            "-o",
            "all",
            "-c",
            "reducescatter",
            "-n",
            "50",
            "-w",
            "3",
            "-m",
            "7",
            "-G",
            "10",
            "--algo",
            "default_reducescatter_zero_copy",
            "--nblocks=16",
            "--nthreads",
            "256",
            "--outofplace-only",
            "--json",
            "/tmp/x.json",
            "--vs-nccl",
            "-r",
            "1",
            "--cpu-bind",
            "none",
            "--plan",
            "plans/allreduce_2gpu.json",
            "--check",
            "both",
        ])
        .expect("parses");
        assert_eq!(o.check, CheckPlace::Both);
        assert_eq!(o.plan, Some(PathBuf::from("plans/allreduce_2gpu.json")));
        assert_eq!((o.min_bytes, o.max_bytes, o.step_factor), (8, 128 << 20, 4));
        assert_eq!(o.dtypes, vec![DataType::Bf16, DataType::Fp8E4M3]);
        assert_eq!(o.ops.len(), 5);
        assert_eq!(o.collective, Collective::ReduceScatter);
        assert_eq!(
            (o.iters, o.warmup, o.batches, o.graph_replays),
            (50, 3, 7, 10)
        );
        assert_eq!(
            o.algo,
            AlgoChoice::Named("default_reducescatter_zero_copy".into())
        );
        assert_eq!((o.nblocks, o.nthreads), (Some(16), Some(256)));
        assert_eq!(o.placements, vec![Placement::OutOfPlace]);
        assert_eq!(o.json, Some(PathBuf::from("/tmp/x.json")));
        assert!(o.vs_nccl);
        assert_eq!(o.root, 1);
        assert!(!o.cpu_bind);
        assert_eq!(
            o.sizes(),
            vec![
                8, 32, 128, 512, 2048, 8192, 32768, 131072, 524288, 2097152, 8388608, 33554432,
                134217728
            ]
        );
        assert_eq!(o.ops_for().len(), 5);
    }

    #[rstest]
    #[case("1", 1)]
    #[case("4K", 4096)]
    #[case("128m", 128 << 20)]
    #[case("1G", 1 << 30)]
    fn sizes_parse(#[case] s: &str, #[case] want: usize) {
        assert_eq!(parse_size(s).expect("size"), want);
    }

    #[rstest]
    #[case(&["-b"], "needs a value")]
    #[case(&["-b", "1X"], "\"1X\"")]
    #[case(&["-d", "f128"], "f128")]
    #[case(&["-o", "xor"], "xor")]
    #[case(&["-c", "gatherv"], "gatherv")]
    #[case(&["-b", "2M", "-e", "1M"], "larger than")]
    #[case(&["-n", "0"], "iters")]
    #[case(&["-f", "1", "-e", "4M"], "stepfactor")]
    #[case(&["--inplace-only", "--outofplace-only"], "exclude")]
    #[case(&["--cpu-bind", "socket"], "--cpu-bind socket")]
    #[case(&["--check", "gpu"], "--check gpu: expected device, host or both")]
    #[case(&["--frobnicate"], "--frobnicate")]
    #[case(&["--nblocks", "-3"], "--nblocks")]
    #[case(&["--tuning", "t.yaml", "--algo", "x"], "exclude each other")]
    #[case(&["--tuning"], "--tuning needs a value")]
    #[case(&["-c", "alltoallv", "--algo", "x"], "--algo x: -c alltoallv runs")]
    #[case(&["-c", "alltoallv", "--plan", "p.json"], "--plan p.json: -c alltoallv runs")]
    fn bad_options_name_the_problem(#[case] args: &[&str], #[case] needle: &str) {
        let err = run(args).expect_err("must fail");
        assert!(err.to_string().contains(needle), "{err} lacks {needle}");
    }

    #[test]
    fn all_lists_help_and_data_movement() {
        assert_eq!(parse_dtypes("all").expect("all").len(), DataType::ALL.len());
        assert_eq!(
            parse_dtypes("f32,float,f32").expect("dedup"),
            vec![DataType::F32]
        );
        assert_eq!(parse_args(["--help"]).expect("help"), Command::Help);
        let o = run(&["-c", "all_gather", "-o", "all"]).expect("allgather");
        assert_eq!(o.collective, Collective::AllGather);
        assert_eq!(o.ops_for(), vec![None]);
        let tuned = run(&["--tuning=t.yaml", "--nblocks", "4"]).expect("tuning");
        assert_eq!(tuned.tuning, Some(PathBuf::from("t.yaml")));
        let single = run(&["-b", "1M", "-e", "1M", "-f", "1"]).expect("single size");
        assert_eq!(single.sizes(), vec![1 << 20]);
        let v = run(&["-c", "all_to_all_v"]).expect("alltoallv");
        assert_eq!(
            (v.collective, v.skewed_alltoallv),
            (Collective::AllToAll, true)
        );
        assert_eq!(v.collective_name(), "alltoallv");
        assert!(v.shape(DataType::F32, 4096, 4).expect("shape").skewed);
        let err = run(&["-c", "gatherv"]).expect_err("gatherv");
        assert!(err.to_string().contains("or alltoallv"), "{err}");
    }
}
