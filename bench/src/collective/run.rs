//! The benchmark loop of one rank: time our algorithm (and NCCL), check every configuration.
//!
//! For each (type, op, size) and placement (out-of-place, in-place), every rank, in the same
//! order:
//! 1. picks the algorithm (the selector, or `--algo`; with `--tuning FILE` the table's entry and
//!    its launch geometry first); one that cannot take the call is reported as skipped,
//!    identically on every rank (the choice depends only on shared inputs);
//! 2. times it: `warmup` eager calls, then `batches` batches of `iters` calls (eager), or of `G`
//!    replays of one CUDA graph holding `iters` calls (at most [`REPLAYS_IN_FLIGHT`] queued at a
//!    time, see there); each batch is timed with events on the
//!    stream and the median batch per call is this rank's time; the row shows the mean over ranks
//!    (nccl-tests' default);
//! 3. checks it: fresh inputs (counter-based, so every rank regenerates every rank's data), the
//!    output poisoned, one call made the way it was timed (eager, or a one-call graph), the output
//!    copied back and every element compared (`check`); `#wrong` sums all ranks;
//! 4. with `--vs-nccl`, times NCCL on the same buffers in the same mode.
//!
//! After each step the ranks agree over the bootstrap: when every rank failed with an error that
//! is the same everywhere (unsupported, compile), the cell is skipped with the reason; any other
//! failure ends the run with the rank and its error, so no rank waits for a peer that gave up.
//! Host waits on the stream are bounded by `MSCCLPP_DEVICE_WAIT_TIMEOUT`.

use super::alltoallv::{SkewedAlltoallv, SKEWED_ALLTOALLV};
use super::check::{check_output, sendrecv_peers, CheckResult, TOLERANCE_TEXT};
use super::data::{poison_byte, InputSpec};
use super::device_data::{cross_check, CheckPlan, DeviceData};
use super::device_line;
use super::options::{AlgoChoice, BenchOptions, CheckPlace, Placement};
use super::report::{self, JsonReport, LoadedPlan, Measure, Outcome, Row};
use super::shape::Shape;
use crate::nccl::{Nccl, NcclComm};
use mscclpp_collectives::alltoall::AlltoallZeroCopy;
use mscclpp_collectives::p2p::sendrecv::{P2pSendRecv, SENDRECV_P2P};
use mscclpp_collectives::resources::DeviceBuffer;
use mscclpp_core::algorithm_collection::{AlgorithmCollection, SelectionContext};
use mscclpp_core::bootstrap::Bootstrap;
use mscclpp_core::communicator::Communicator;
use mscclpp_core::env::Env;
use mscclpp_core::gpu::{DeviceProperties, DevicePtr, Event, Gpu, Stream};
use mscclpp_core::tuner::{select_tuned, TuningTable};
use mscclpp_core::{AccumType, Algorithm, Collective, Error, ExecuteArgs, ReduceOp, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::io::Write;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one rank needs to run the benchmark; `main` builds it from the launcher's variables.
pub struct RankSetup {
    pub env: &'static Env,
    pub gpu: Arc<dyn Gpu>,
    pub bootstrap: Arc<dyn Bootstrap>,
    /// The launcher's LOCAL_RANK: the rank drives GPU `device % GPUs visible`.
    pub device: usize,
}

/// The end of a run.
#[derive(Debug, Clone)]
pub struct Summary {
    pub rows: Vec<Row>,
    /// Wrong elements over every row and rank; non-zero makes the process fail.
    pub total_wrong: usize,
}

/// What a rank reports to its peers after a step.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Status<T> {
    Done(T),
    /// Failed in a way every rank reproduces (the call is not supported, a kernel does not
    /// compile): the cell is skipped when every rank says so.
    Declined(String),
    Failed(String),
}

/// The agreed result of a step.
enum Agreed<T> {
    All(Vec<T>),
    /// Every rank declined; the first reason.
    Skipped(String),
    /// Some ranks succeeded and some declined (the first reason).
    Mixed(String),
}

/// Errors every rank hits identically for the same call.
fn deterministic(e: &Error) -> bool {
    matches!(
        e,
        Error::Unsupported(_)
            | Error::Compile { .. }
            | Error::InvalidArgument(_)
            | Error::LaunchShape(_)
    )
}

fn any_error(_: &Error) -> bool {
    true
}

/// NCCL failures that leave nothing running: NCCL refused the call (its result code), or the
/// combination is one we know it lacks.
fn nccl_declined(e: &Error) -> bool {
    deterministic(e) || matches!(e, Error::Driver { .. })
}

/// Graph replays the timed loop keeps queued on the stream. Enough that the GPU never waits for
/// the host (a replay is `iters` calls; launching the next takes microseconds), and few, so that
/// after a failure the kernels still queued ahead of the error are few: each returns at its entry
/// check, but a replay of 20 calls still costs 20 launches, and an unbounded queue (the driver
/// accepts thousands of replays) took 2.4 s to drain on one H100 under MPS before the process
/// could unmap its peers' memory and exit.
const REPLAYS_IN_FLIGHT: usize = 4;

/// The collectives with a root (`--root`).
fn is_rooted(collective: Collective) -> bool {
    matches!(
        collective,
        Collective::Broadcast | Collective::Reduce | Collective::Gather | Collective::Scatter
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Waits for `stream` on a helper thread so the wait is bounded: a collective whose peer never
/// arrives would otherwise block the host forever. On timeout the helper stays blocked; the run
/// ends with the error and process exit reclaims it.
fn synchronize(gpu: &Arc<dyn Gpu>, stream: Stream, timeout: Duration, rank: usize) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    let g = gpu.clone();
    std::thread::Builder::new()
        .name("bench-stream-sync".into())
        .spawn(move || {
            // The receiver may be gone after a timeout; nothing to do then.
            let _ = tx.send(g.synchronize_stream(stream));
        })
        .map_err(|e| Error::io("starting the stream-synchronising thread", e))?;
    match rx.recv_timeout(timeout) {
        Ok(r) => r,
        Err(RecvTimeoutError::Timeout) => Err(Error::Timeout {
            what: format!("rank {rank}'s benchmark stream (a collective call did not complete)"),
            timeout,
        }),
        Err(RecvTimeoutError::Disconnected) => Err(Error::Internal(
            "the stream-synchronising thread ended without an answer".into(),
        )),
    }
}

struct Bench<'a> {
    opts: &'a BenchOptions,
    env: &'static Env,
    gpu: Arc<dyn Gpu>,
    bootstrap: Arc<dyn Bootstrap>,
    comm: Arc<Communicator>,
    algos: AlgorithmCollection,
    /// `--tuning FILE`, loaded.
    tuning: Option<TuningTable>,
    nccl: Option<NcclComm>,
    props: DeviceProperties,
    local_size: usize,
    stream: Stream,
    events: (Event, Event),
    /// One event per queued graph replay (see [`REPLAYS_IN_FLIGHT`]).
    replay_marks: Vec<Event>,
    /// Input and output buffers sized for the largest call.
    input: DeviceBuffer,
    output: DeviceBuffer,
    run_seed: u64,
    checks: u64,
    /// The checks' kernel (`--check device|both`), or why the host checks everything.
    device_data: std::result::Result<DeviceData, String>,
    /// The device line, printed first.
    device_text: String,
    /// Where this rank's thread runs (`--cpu-bind`), printed by rank 0.
    cpu_binding: String,
    /// Where this rank's wall time went, printed by rank 0 at the end.
    spent: Spent,
}

/// Wall time of one rank by phase: what to make faster when a run is slow.
#[derive(Debug, Default)]
struct Spent {
    /// From entering the benchmark to the first row: communicator, collection, buffers, NCCL.
    set_up: Duration,
    /// Our calls: warm-up, capture and timed batches.
    timing: Duration,
    /// NCCL's calls, the same way.
    nccl: Duration,
    /// The checks' inputs: drawn on the device, or on the host and uploaded.
    inputs: Duration,
    /// The checks' calls and outputs: the call, the comparison (and the copy back where the
    /// host compares).
    outputs: Duration,
}

impl Spent {
    fn line(&self) -> String {
        let s = |d: Duration| format!("{:.2} s", d.as_secs_f64());
        format!(
            "# rank 0's wall time: set-up {}, our timed calls {}, NCCL's {}, check inputs {}, \
             check calls and outputs {}",
            s(self.set_up),
            s(self.timing),
            s(self.nccl),
            s(self.inputs),
            s(self.outputs)
        )
    }
}

/// What the table's header and the JSON report say besides the rows, filled while setting up.
struct RunHeader {
    /// The device line.
    device: String,
    /// NCCL's version line, or why there is none.
    nccl: String,
    /// The execution plans `--plan` loaded.
    plans: Vec<LoadedPlan>,
}

/// Runs the benchmark on this rank (collective: every rank calls it with the same options).
/// Rank 0 prints the table as rows complete and writes `--json` at the end, also when the run
/// stops on an error (with the rows done so far).
pub fn run_rank(setup: RankSetup, opts: &BenchOptions) -> Result<Summary> {
    let (rank, nranks) = (setup.bootstrap.rank(), setup.bootstrap.size());
    let mut rows = Vec::new();
    let mut header = RunHeader {
        device: String::new(),
        nccl: String::from("NCCL: not requested"),
        plans: Vec::new(),
    };
    let result = run_rows(setup, opts, &mut rows, &mut header);
    let total_wrong = rows.iter().map(Row::wrong).sum();
    if rank == 0 {
        if let Some(path) = &opts.json {
            let text = report::to_json(&JsonReport {
                device: &header.device,
                nccl: &header.nccl,
                nranks,
                collective: opts.collective_name(),
                mode: mode_text(opts),
                iters: opts.iters,
                warmup: opts.warmup,
                batches: opts.batches,
                graph_replays: opts.graph_replays,
                tolerance: TOLERANCE_TEXT,
                rows: &rows,
                total_wrong,
                plans: &header.plans,
            });
            std::fs::write(path, text)
                .map_err(|e| Error::io(format!("writing the JSON report {}", path.display()), e))?;
        }
    }
    result?;
    Ok(Summary { rows, total_wrong })
}

fn mode_text(opts: &BenchOptions) -> String {
    if opts.graph_replays == 0 {
        "eager".into()
    } else {
        format!(
            "graph ({} calls per graph, {} replays per batch)",
            opts.iters, opts.graph_replays
        )
    }
}

fn run_rows(
    setup: RankSetup,
    opts: &BenchOptions,
    rows: &mut Vec<Row>,
    header: &mut RunHeader,
) -> Result<()> {
    let mut bench = Bench::new(setup, opts, header)?;
    let result = bench.run(rows);
    bench.release();
    result
}

impl<'a> Bench<'a> {
    fn new(setup: RankSetup, opts: &'a BenchOptions, header: &mut RunHeader) -> Result<Self> {
        let started = Instant::now();
        let RankSetup {
            env,
            gpu,
            bootstrap,
            device,
        } = setup;
        let (rank, nranks) = (bootstrap.rank(), bootstrap.size());
        // Read before any collective step: a bad file fails every rank the same way, at once.
        let tuning = opts
            .tuning
            .as_ref()
            .map(TuningTable::load_yaml)
            .transpose()?;
        if opts.root >= nranks {
            return Err(Error::InvalidArgument(format!(
                "-r {}: the root must be a rank of {nranks}",
                opts.root
            )));
        }
        // Rank r runs on GPU LOCAL_RANK % GPUs, as the GPU suite does: with more local ranks than
        // GPUs, ranks share one (results are checked as usual; timings are not comparable). NCCL
        // refuses two ranks of one communicator on one GPU, so only its baseline is refused there.
        let count = gpu.device_count()?;
        if count == 0 {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: no GPU is visible (CUDA_VISIBLE_DEVICES)"
            )));
        }
        let device = device % count;
        let props = gpu.properties(device)?;
        // Before the communicator allocates its pinned host memory, so that lands nearby too.
        let cpu_binding = if opts.cpu_bind {
            mscclpp_core::affinity::bind_current_thread_near(&props.pci_bus_id)
        } else {
            "left to the launcher (--cpu-bind none)".to_string()
        };
        let comm = Arc::new(Communicator::new(bootstrap.clone(), gpu.clone(), device)?);
        // Ranks that share a host by identity (MSCCLPP_HOSTID can split one machine), not by the
        // launcher's LOCAL_WORLD_SIZE: that is what decides which algorithms can run.
        let local_size = comm.topology().local_size(rank);
        if local_size > count && opts.vs_nccl {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: --vs-nccl needs a GPU per rank, but {local_size} local ranks share \
                 {count} GPU(s) (NCCL refuses two ranks on one GPU)"
            )));
        }
        let (mut builder, resources) =
            mscclpp_collectives::build_default_algorithms_with_resources(
                &comm,
                mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
                AlgorithmCollection::builder(),
            )?;
        if opts.skewed_alltoallv {
            // The engine's all-to-all-v, on the collection's resources as the default all-to-all.
            let engine = match &resources {
                Some(r) => AlltoallZeroCopy::with_resources(comm.clone(), r.clone())?,
                None => AlltoallZeroCopy::new(comm.clone())?,
            };
            builder.add_algorithm(Arc::new(SkewedAlltoallv::new(engine)))?;
        }
        if opts.collective == Collective::SendRecv {
            // The ring through the point-to-point engine (any buffers), the default below, on the
            // collection's point-to-point region as the NCCL shim builds it.
            use mscclpp_collectives::p2p::P2pEngine;
            let engine = match resources {
                Some(r) => P2pEngine::with_resources(comm.clone(), r)?,
                None => P2pEngine::new(comm.clone())?,
            };
            builder.add_algorithm(Arc::new(P2pSendRecv::new(engine)))?;
        }
        if let Some(path) = &opts.plan {
            // `--plan default`: the runnable plans of MSCCLPP_EXECUTION_PLAN_DIR and the cache.
            let plans = if path.as_os_str() == "default" {
                mscclpp_executor::load::default_plans(&comm, mscclpp_core::env::Env::get()?)
            } else {
                mscclpp_executor::load::load_plans(path)?
            };
            let added = mscclpp_executor::load::add_plans(&comm, &mut builder, &plans)?;
            for a in &added {
                let (min_bytes, max_bytes) = a.message_range();
                let loaded = LoadedPlan {
                    name: a.name().to_string(),
                    collective: a.collective().name(),
                    world_size: a.plan().world_size(),
                    min_bytes,
                    max_bytes,
                    in_place: a.plan().inplace,
                };
                if rank == 0 {
                    println!("{}", loaded.describe());
                }
                header.plans.push(loaded);
            }
        }
        let algos = builder.build();
        if let AlgoChoice::Named(name) = &opts.algo {
            if algos.get(opts.collective, name).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "--algo {name}: no such {} algorithm (available: {})",
                    opts.collective,
                    algos.names(opts.collective).join(", ")
                )));
            }
        }
        // Buffers for the largest call of any type; in-place calls live inside them.
        let (mut max_in, mut max_out) = (1usize, 1usize);
        for &dtype in &opts.dtypes {
            for &size in &opts.sizes() {
                if let Ok(s) = opts.shape(dtype, size, nranks) {
                    max_in = max_in.max(s.input_bytes);
                    max_out = max_out.max(s.output_bytes);
                }
            }
        }
        let input = DeviceBuffer::zeroed(&gpu, max_in)?;
        let output = DeviceBuffer::zeroed(&gpu, max_out)?;
        let stream = gpu.create_stream()?;
        let events = (gpu.create_event()?, gpu.create_event()?);
        let replay_marks = (0..REPLAYS_IN_FLIGHT)
            .map(|_| gpu.create_event())
            .collect::<Result<Vec<_>>>()?;
        // Every rank must draw the same data: rank 0's clock seeds the run.
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x5eed);
        let seed_bytes = bootstrap.broadcast(0, &clock.to_le_bytes())?;
        let run_seed = seed_bytes
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| Error::Peer {
                rank: 0,
                message: format!("sent a run seed of {} bytes instead of 8", seed_bytes.len()),
            })?;
        let device_data = match opts.check {
            CheckPlace::Host => Err("--check host".to_string()),
            CheckPlace::Device => DeviceData::load(&gpu).map_err(|e| e.to_string()),
            // Asked to compare the two, a rank that cannot is an error, not a fallback.
            CheckPlace::Both => Ok(DeviceData::load(&gpu)?),
        };
        let mut bench = Bench {
            opts,
            env,
            gpu,
            bootstrap,
            comm,
            algos,
            tuning,
            nccl: None,
            props,
            local_size,
            stream,
            events,
            replay_marks,
            input,
            output,
            run_seed,
            checks: 0,
            device_data,
            device_text: String::new(),
            cpu_binding,
            spent: Spent::default(),
        };
        header.nccl = bench.open_nccl()?;
        header.device = bench.describe(&header.nccl)?;
        bench.device_text = header.device.clone();
        bench.spent.set_up = started.elapsed();
        Ok(bench)
    }

    fn rank(&self) -> usize {
        self.bootstrap.rank()
    }
    fn nranks(&self) -> usize {
        self.bootstrap.size()
    }

    /// Waits for the stream; when that fails and the communicator has failed, the
    /// communicator's error (naming the peer) is the one reported.
    fn sync(&self) -> Result<()> {
        synchronize(
            &self.gpu,
            self.stream,
            self.env.device_wait_timeout,
            self.rank(),
        )
        .or_else(|e| self.comm.check("the benchmark stream").and(Err(e)))
    }

    /// Every rank's `local` result; see the module docs for how failures combine.
    fn agree<T: Serialize + DeserializeOwned>(
        &self,
        what: &str,
        local: Result<T>,
        tolerated: fn(&Error) -> bool,
    ) -> Result<Agreed<T>> {
        // A failed communicator ends the run on every rank, each from its own error word or its
        // bootstrap's liveness: agreeing first would wait on the dead or stopped peer.
        if let Err(e @ (Error::Aborted(_) | Error::DeviceTimeout(_))) = local {
            return Err(e);
        }
        let status = match local {
            Ok(v) => Status::Done(v),
            Err(e) if tolerated(&e) => Status::Declined(e.to_string()),
            Err(e) => Status::Failed(e.to_string()),
        };
        let bytes = serde_json::to_vec(&status)
            .map_err(|e| Error::Internal(format!("serialising a status: {e}")))?;
        let all = self.bootstrap.all_gather(&bytes)?;
        let mut done = Vec::with_capacity(all.len());
        let mut declined: Option<String> = None;
        let mut declined_all = true;
        for (rank, b) in all.iter().enumerate() {
            let s: Status<T> = serde_json::from_slice(b).map_err(|e| Error::Peer {
                rank,
                message: format!("sent an unreadable status after {what}: {e}"),
            })?;
            match s {
                Status::Done(v) => {
                    declined_all = false;
                    done.push(v);
                }
                Status::Declined(m) => {
                    declined.get_or_insert(format!("rank {rank}: {m}"));
                }
                Status::Failed(m) => {
                    return Err(Error::Peer {
                        rank,
                        message: format!("{what} failed: {m}"),
                    })
                }
            }
        }
        Ok(match declined {
            None => Agreed::All(done),
            Some(why) if declined_all => Agreed::Skipped(why),
            Some(why) => Agreed::Mixed(why),
        })
    }

    /// [`Bench::agree`] for collective steps, where a split outcome means some ranks ran a call
    /// that their peers did not join: the run cannot go on.
    fn agree_all<T: Serialize + DeserializeOwned>(
        &self,
        what: &str,
        local: Result<T>,
        tolerated: fn(&Error) -> bool,
    ) -> Result<std::result::Result<Vec<T>, String>> {
        match self.agree(what, local, tolerated)? {
            Agreed::All(v) => Ok(Ok(v)),
            Agreed::Skipped(why) => Ok(Err(why)),
            Agreed::Mixed(why) => Err(Error::Internal(format!(
                "{what}: the ranks disagree: some succeeded, and {why}"
            ))),
        }
    }

    /// Loads NCCL and creates its communicator when `--vs-nccl` asks; returns the header text.
    fn open_nccl(&mut self) -> Result<String> {
        if !self.opts.vs_nccl {
            return Ok("NCCL: not requested (--vs-nccl)".into());
        }
        let loaded = Nccl::load(self.env.nccl_lib_path.as_deref()).map(Arc::new);
        let describe = loaded
            .as_ref()
            .map(|n| format!("NCCL {} ({})", n.version_string(), n.location()))
            .map_err(clone_error);
        // Loading is local: ranks that disagree simply all go without the baseline.
        match self.agree("loading NCCL", describe, any_error)? {
            Agreed::All(_) => {}
            Agreed::Skipped(why) | Agreed::Mixed(why) => {
                return Ok(format!(
                    "NCCL: unavailable, running without the baseline ({why})"
                ))
            }
        }
        let nccl =
            loaded.map_err(|e| Error::Internal(format!("NCCL agreed but not loaded: {e}")))?;
        let text = format!("NCCL {} ({})", nccl.version_string(), nccl.location());
        // NCCL takes the device from the thread's current context.
        self.gpu.set_device(self.comm.device())?;
        let comm = NcclComm::init(nccl, self.bootstrap.as_ref());
        let status = comm.as_ref().map(|_| ()).map_err(clone_error);
        match self.agree_all("ncclCommInitRank", status, any_error)? {
            Ok(_) => {
                self.nccl = comm.ok();
                Ok(text)
            }
            Err(why) => Ok(format!(
                "{text}: no communicator, running without the baseline ({why})"
            )),
        }
    }

    /// The device line (rank 0 gathers every rank's device).
    fn describe(&self, nccl: &str) -> Result<String> {
        let mine = serde_json::to_vec(&self.props)
            .map_err(|e| Error::Internal(format!("serialising device properties: {e}")))?;
        let all = self.bootstrap.all_gather(&mine)?;
        let props: Vec<DeviceProperties> = all
            .iter()
            .enumerate()
            .map(|(rank, b)| {
                serde_json::from_slice(b).map_err(|e| Error::Peer {
                    rank,
                    message: format!("sent unreadable device properties: {e}"),
                })
            })
            .collect::<Result<_>>()?;
        let devices = device_line::describe_devices(&props);
        Ok(device_line::device_line(
            &devices,
            self.gpu.backend_name(),
            device_line::cuda_driver_version().as_deref(),
            device_line::nvrtc_version(self.gpu.as_ref()).as_deref(),
            nccl,
        ))
    }

    fn print(&self, text: &str) {
        if self.rank() == 0 {
            let mut out = std::io::stdout().lock();
            // A closed stdout (e.g. `| head`) must not stop the ranks mid-collective.
            let _ = writeln!(out, "{text}");
            let _ = out.flush();
        }
    }

    fn run(&mut self, rows: &mut Vec<Row>) -> Result<()> {
        let opts = self.opts;
        let n = self.nranks();
        self.print(&format!("# device: {}", self.device_text));
        self.print(&format!(
            "# mscclpp-bench {}: {n} ranks ({}), {}, {} warm-up calls, {} batches of {} calls, median batch, mean over ranks",
            opts.collective_name(),
            self.comm.topology(),
            mode_text(opts),
            opts.warmup,
            opts.batches,
            opts.iters,
        ));
        self.print(&format!("# check: {TOLERANCE_TEXT}"));
        self.print(&format!(
            "# check: {}",
            match (&self.device_data, opts.check) {
                (Ok(_), CheckPlace::Both) => "inputs drawn on the GPU, every output checked on \
                    the GPU and on the host with one element planted wrong (the two must agree)"
                    .to_string(),
                (Ok(_), _) => "inputs drawn and outputs compared on the GPU where its kernel can \
                    (the host draws fp8 and float products, checks the skewed all-to-all-v, and \
                    describes every mismatch)"
                    .to_string(),
                (Err(why), _) => format!("inputs drawn and outputs compared on the host ({why})"),
            }
        ));
        self.print(&format!("# rank 0 thread: {}", self.cpu_binding));
        self.print(report::header(self.nccl.is_some()).trim_end());
        let mut seen = HashSet::new();
        for &dtype in &opts.dtypes {
            for op in opts.ops_for() {
                for size in opts.sizes() {
                    let Ok(shape) = opts.shape(dtype, size, n) else {
                        continue;
                    };
                    // Rounding to whole elements can map two requested sizes to one call.
                    if !seen.insert((dtype, op.map(ReduceOp::name), shape.size_bytes)) {
                        continue;
                    }
                    let row = self.row(&shape, op)?;
                    self.print(&report::format_row(&row, self.nccl.is_some()));
                    for note in report::row_notes(&row) {
                        self.print(&note);
                    }
                    rows.push(row);
                }
            }
        }
        let wrong: usize = rows.iter().map(Row::wrong).sum();
        self.print(&format!(
            "# {} rows, {} wrong elements in total{}",
            rows.len(),
            wrong,
            if wrong == 0 { "" } else { ": FAILED" }
        ));
        for line in report::rows_that_ran_nothing(rows) {
            self.print(&format!("# ran nothing: {line}"));
        }
        self.print(&self.spent.line());
        Ok(())
    }

    fn row(&mut self, shape: &Shape, op: Option<ReduceOp>) -> Result<Row> {
        let mut row = Row {
            collective: shape.name().into(),
            size_bytes: shape.size_bytes,
            count: shape.count,
            dtype: shape.dtype.name().into(),
            redop: op.map_or("none", ReduceOp::name).into(),
            root: if is_rooted(shape.collective) {
                self.opts.root as i64
            } else {
                -1
            },
            algorithm: String::from("-"),
            out_of_place: Outcome::NotRequested,
            in_place: Outcome::NotRequested,
        };
        for placement in [Placement::OutOfPlace, Placement::InPlace] {
            if !self.opts.placements.contains(&placement) {
                continue;
            }
            let (outcome, algo) = self.placement(shape, op, placement)?;
            if let Some(name) = algo {
                if row.algorithm == "-" {
                    row.algorithm = name;
                } else if row.algorithm != name {
                    row.algorithm = format!("{}/{name}", row.algorithm);
                }
            }
            match placement {
                Placement::OutOfPlace => row.out_of_place = outcome,
                Placement::InPlace => row.in_place = outcome,
            }
        }
        Ok(row)
    }

    /// (input, output) device addresses of `shape` for `placement` (nccl-tests' in-place offsets).
    fn pointers(&self, shape: &Shape, placement: Placement) -> (DevicePtr, DevicePtr) {
        let (i, o) = (self.input.ptr(), self.output.ptr());
        let off = shape.in_place_offset(self.rank()) as u64;
        match (placement, shape.collective) {
            (Placement::OutOfPlace, _) => (i, o),
            (Placement::InPlace, Collective::AllGather | Collective::Gather) => (o + off, o),
            (Placement::InPlace, Collective::ReduceScatter | Collective::Scatter) => (i, i + off),
            (Placement::InPlace, _) => (i, i),
        }
    }

    /// The algorithm for the call (see the module docs, step 1); with `--tuning`, the table's
    /// geometry goes into `args` where `--nblocks`/`--nthreads` did not set it.
    fn choose(
        &self,
        shape: &Shape,
        args: &mut ExecuteArgs,
    ) -> std::result::Result<Arc<dyn Algorithm>, String> {
        let algo = match &self.opts.algo {
            AlgoChoice::Named(name) => self
                .algos
                .get(shape.collective, name)
                .ok_or_else(|| format!("no {} algorithm named {name}", shape.collective))?,
            // nccl-tests' sendrecv is a point-to-point exchange: the engine NCCL's send/recv use.
            AlgoChoice::Auto if shape.skewed => self
                .algos
                .get(shape.collective, SKEWED_ALLTOALLV)
                .ok_or_else(|| format!("no {SKEWED_ALLTOALLV} algorithm"))?,
            AlgoChoice::Auto if shape.collective == Collective::SendRecv => self
                .algos
                .get(shape.collective, SENDRECV_P2P)
                .ok_or_else(|| format!("no {SENDRECV_P2P} algorithm"))?,
            AlgoChoice::Auto => {
                let ctx = SelectionContext {
                    collective: shape.collective,
                    message_bytes: shape.input_bytes,
                    dtype: shape.dtype,
                    world_size: self.nranks(),
                    local_world_size: self.local_size,
                    symmetric_memory: false,
                    capturing: self.opts.graph_replays > 0,
                    arch: self.props.arch.clone(),
                    nvls_allowed: self.env.nvls_allowed() && self.props.supports_multicast,
                    in_place: SelectionContext::buffers_in_place(
                        shape.collective,
                        args,
                        self.rank(),
                    ),
                    op: Some(args.op),
                };
                match &self.tuning {
                    Some(table) => {
                        let (algo, launch) =
                            select_tuned(table, &self.algos, &ctx).map_err(|e| e.to_string())?;
                        if let Some(l) = launch {
                            args.nblocks = self.opts.nblocks.or(l.nblocks);
                            args.nthreads = self.opts.nthreads.or(l.nthreads);
                        }
                        algo
                    }
                    None => self.algos.select(&ctx).map_err(|e| e.to_string())?,
                }
            }
        };
        algo.check(args)
            .map_err(|e| format!("{}: {e}", algo.name()))?;
        Ok(algo)
    }

    fn placement(
        &mut self,
        shape: &Shape,
        op: Option<ReduceOp>,
        placement: Placement,
    ) -> Result<(Outcome, Option<String>)> {
        let (input, output) = self.pointers(shape, placement);
        let mut args = ExecuteArgs {
            input,
            output,
            input_bytes: shape.input_bytes,
            output_bytes: shape.output_bytes,
            dtype: shape.dtype,
            op: op.unwrap_or(ReduceOp::Sum),
            accum: AccumType::Auto,
            // For sendrecv the root is the shift of `default_sendrecv_zero_copy`: 1, the ring.
            root: if shape.collective == Collective::SendRecv {
                1
            } else {
                self.opts.root
            },
            stream: self.stream,
            nblocks: self.opts.nblocks,
            nthreads: self.opts.nthreads,
        };
        let algo = match self.choose(shape, &mut args) {
            Ok(a) => a,
            Err(why) => return Ok((Outcome::Skipped(why), None)),
        };
        let name = Some(algo.name().to_string());
        let args = args;
        let comm = self.comm.clone();
        let op_name = format!("{} ({})", shape.collective, algo.name());
        // One host load per call: a failed communicator (dead or stopped peer, abort) stops the
        // loop at the next call instead of queueing more kernels behind it.
        let call = || {
            comm.check(&op_name)?;
            algo.execute(&args)
        };
        let clock = Instant::now();
        let timed = self.time(&call);
        self.spent.timing += clock.elapsed();
        let times = match self.agree_all("timing", timed, deterministic)? {
            Ok(t) => t,
            Err(why) => return Ok((Outcome::Skipped(why), name)),
        };
        let time_us = times.iter().sum::<f64>() / times.len().max(1) as f64;
        let checked = self.check(shape, op, placement, &args, &call);
        let (wrong, first) = match self.agree_all("the correctness check", checked, |_| false)? {
            Ok(results) => {
                let wrong = results.iter().map(|r: &CheckResult| r.wrong).sum();
                let first = results
                    .iter()
                    .enumerate()
                    .find_map(|(r, c)| c.first.as_ref().map(|f| format!("rank {r}: {f}")));
                (wrong, first)
            }
            Err(why) => (0, Some(why)),
        };
        let mut m = Measure::new(shape, time_us, wrong, first);
        if self.nccl.is_some() {
            let clock = Instant::now();
            let nccl = self.nccl_time(shape, op, input, output);
            self.spent.nccl += clock.elapsed();
            match nccl? {
                Ok(t) => m.nccl_time_us = Some(t),
                Err(why) => m.nccl_note = Some(why),
            }
        }
        Ok((Outcome::Measured(m), name))
    }

    /// Runs `call` `n` times, or captures `n` calls into a graph; the graph is returned.
    fn capture(&self, call: &dyn Fn() -> Result<()>, n: usize) -> Result<mscclpp_core::gpu::Graph> {
        self.gpu.begin_capture(self.stream)?;
        let mut captured = Ok(());
        for _ in 0..n {
            captured = call();
            if captured.is_err() {
                break;
            }
        }
        // The capture must end even when a call failed, or the stream stays unusable.
        let ended = self.gpu.end_capture(self.stream);
        match (captured, ended) {
            (Ok(()), Ok(g)) => Ok(g),
            (Err(e), Ok(g)) => {
                let _ = self.gpu.destroy_graph(g);
                Err(e)
            }
            (Ok(()), Err(e)) | (Err(e), Err(_)) => Err(e),
        }
    }

    /// Median batch time per call (microseconds) of `call` on this rank.
    fn time(&self, call: &dyn Fn() -> Result<()>) -> Result<f64> {
        let o = self.opts;
        (0..o.warmup)
            .try_for_each(|_| call())
            .and_then(|_| self.sync())
            .map_err(|e| self.setup_stopped("the warm-up calls", e))?;
        let graph = if o.graph_replays > 0 {
            let g = self
                .capture(call, o.iters)
                .map_err(|e| self.setup_stopped("the graph capture", e))?;
            // The first replay uploads the graph; it is not timed.
            let first = self
                .gpu
                .launch_graph(g, self.stream)
                .and_then(|_| self.sync());
            if let Err(e) = first {
                let _ = self.gpu.destroy_graph(g);
                return Err(self.setup_stopped("the graph's first (untimed) replay", e));
            }
            Some(g)
        } else {
            None
        };
        let result = (|| -> Result<f64> {
            let (start, end) = self.events;
            let calls = (o.iters * o.graph_replays.max(1)) as f64;
            let mut per_call = Vec::with_capacity(o.batches);
            for _ in 0..o.batches {
                // Ranks start each batch together, so one rank's host noise is not counted
                // as its peers' waiting time.
                self.bootstrap.barrier()?;
                self.gpu.record_event(start, self.stream)?;
                match graph {
                    Some(g) => {
                        for i in 0..o.graph_replays {
                            self.comm.check("a graph replay")?;
                            let mark = self.replay_marks[i % REPLAYS_IN_FLIGHT];
                            if i >= REPLAYS_IN_FLIGHT {
                                self.comm.wait_event(
                                    mark,
                                    self.stream,
                                    "a graph replay",
                                    &|| Ok(()),
                                )?;
                            }
                            self.gpu.launch_graph(g, self.stream)?;
                            self.gpu.record_event(mark, self.stream)?;
                        }
                    }
                    None => {
                        for _ in 0..o.iters {
                            call()?;
                        }
                    }
                }
                self.gpu.record_event(end, self.stream)?;
                self.sync()?;
                let ms = f64::from(self.gpu.elapsed_ms(start, end)?);
                per_call.push(ms * 1e3 / calls);
            }
            self.comm.check_device_errors()?;
            Ok(median(per_call))
        })();
        if let Err(e) = &result {
            // Timestamped, so a fault-injection run can tell the time to notice the failure from
            // the time teardown takes after it.
            tracing::warn!(target: "mscclpp::bench", "rank {}: the timed loop stopped: {e}", self.rank());
        }
        if let Some(g) = graph {
            if let Err(e) = self.gpu.destroy_graph(g) {
                tracing::warn!("destroying the benchmark graph failed: {e}");
            }
        }
        result
    }

    /// Logs that [`Bench::time`] stopped before its timed batches, in `phase`, and returns `e`.
    /// Timestamped like "the timed loop stopped" but worded apart from it: a fault-injection run
    /// whose signal landed here (the harness waits a fixed time after the table header) tested
    /// the set-up, not the loop, and must say where. Errors every rank repeats (the cell is
    /// skipped and the table says why) are not logged.
    fn setup_stopped(&self, phase: &str, e: Error) -> Error {
        if !deterministic(&e) {
            tracing::warn!(target: "mscclpp::bench", "rank {}: the timed loop's set-up stopped in {phase}: {e}", self.rank());
        }
        e
    }

    /// One checked call; see the module docs.
    fn check(
        &mut self,
        shape: &Shape,
        op: Option<ReduceOp>,
        placement: Placement,
        args: &ExecuteArgs,
        call: &dyn Fn() -> Result<()>,
    ) -> Result<CheckResult> {
        self.checks += 1;
        let clock = Instant::now();
        let spec = InputSpec {
            seed: self.run_seed ^ self.checks.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            dtype: shape.dtype,
            op,
            nranks: self.nranks(),
        };
        let rank = self.rank();
        // Poison first, then upload: where the input overlaps the output (in-place) the upload
        // wins, everywhere else the collective must overwrite the poison.
        self.gpu.memset_async(
            args.output,
            poison_byte(shape.dtype),
            shape.output_bytes,
            self.stream,
        )?;
        // In place, a broadcast's or a scatter's output off the root is its input buffer (or
        // lies in it): writing the input there would overwrite the poison the call must replace.
        let root_only = matches!(
            shape.collective,
            Collective::Broadcast | Collective::Scatter
        ) && placement == Placement::InPlace
            && rank != self.opts.root;
        let count = shape.input_bytes / shape.dtype.size();
        let drawn_on_device = match &self.device_data {
            Ok(d) if !root_only => d.fill(&spec, rank, args.input, count, self.stream)?,
            _ => false,
        };
        self.sync()?;
        if !root_only && !drawn_on_device {
            let data = spec.encode_range(rank, 0, count);
            self.gpu.copy_to_device(args.input, &data)?;
        }
        self.bootstrap.barrier()?;
        self.spent.inputs += clock.elapsed();
        let clock = Instant::now();
        if self.opts.graph_replays > 0 {
            let g = self.capture(call, 1)?;
            let launched = self
                .gpu
                .launch_graph(g, self.stream)
                .and_then(|_| self.sync());
            if let Err(e) = self.gpu.destroy_graph(g) {
                tracing::warn!("destroying the check graph failed: {e}");
            }
            launched?;
        } else {
            call()?;
            self.sync()?;
        }
        self.comm.check_device_errors()?;
        let checked = self.compare(shape, &spec, op.unwrap_or(ReduceOp::Sum), args.output);
        self.spent.outputs += clock.elapsed();
        checked
    }

    /// This rank's verdict on the output of a checked call (see device_data.rs for where it is
    /// reached).
    fn compare(
        &self,
        shape: &Shape,
        spec: &InputSpec,
        op: ReduceOp,
        output: DevicePtr,
    ) -> Result<CheckResult> {
        let (rank, root) = (self.rank(), self.opts.root);
        let on_host = || -> Result<CheckResult> {
            let mut got = vec![0u8; shape.output_bytes];
            self.gpu.copy_from_device(&mut got, output)?;
            Ok(check_output(shape, spec, op, rank, root, &got))
        };
        let Ok(device) = &self.device_data else {
            return on_host();
        };
        let args = match DeviceData::plan(shape, spec, op, (rank, root)) {
            CheckPlan::Unchecked => return Ok(CheckResult::default()),
            CheckPlan::Host => return on_host(),
            CheckPlan::Device(args) => args,
        };
        let elements = args.count as usize;
        let sync = || self.sync();
        if self.opts.check == CheckPlace::Both && elements > 0 {
            let planted = (spec.seed % elements as u64) as usize;
            device.plant_wrong(spec, output, planted, self.stream)?;
            let counted = device.count_wrong(args, output, self.stream, &sync)?;
            return Ok(cross_check(counted, on_host()?, planted));
        }
        let counted = device.count_wrong(args, output, self.stream, &sync)?;
        if counted.wrong == 0 {
            return Ok(CheckResult::default());
        }
        // The host counts and describes what the device found wrong.
        on_host()
    }

    /// NCCL's time for the same call: `Ok(Ok(us))`, or `Ok(Err(why))` when NCCL cannot run it
    /// on any rank.
    fn nccl_time(
        &self,
        shape: &Shape,
        op: Option<ReduceOp>,
        input: DevicePtr,
        output: DevicePtr,
    ) -> Result<std::result::Result<f64, String>> {
        let Some(nccl) = &self.nccl else {
            return Ok(Err("NCCL is not loaded".into()));
        };
        if !nccl.nccl().supports(shape.dtype) {
            return Ok(Err(format!(
                "NCCL {} has no {}",
                nccl.nccl().version_string(),
                shape.dtype
            )));
        }
        let (dtype, stream, root) = (shape.dtype, self.stream, self.opts.root);
        let op = op.unwrap_or(ReduceOp::Sum);
        let traffic = shape.traffic();
        let call = || match shape.collective {
            Collective::AllReduce => nccl.all_reduce(input, output, shape.count, dtype, op, stream),
            Collective::AllGather => {
                nccl.all_gather(input, output, shape.per_rank_count, dtype, stream)
            }
            Collective::ReduceScatter => {
                nccl.reduce_scatter(input, output, shape.per_rank_count, dtype, op, stream)
            }
            Collective::Broadcast => {
                nccl.broadcast(input, output, shape.count, dtype, root, stream)
            }
            Collective::SendRecv => {
                let (to, from) = sendrecv_peers(self.rank(), shape.nranks);
                nccl.send_recv(input, output, shape.count, dtype, to, from, stream)
            }
            Collective::AllToAll => {
                nccl.all_to_all(input, output, &traffic, self.rank(), dtype, stream)
            }
            Collective::Reduce => nccl.reduce(input, output, shape.count, dtype, op, root, stream),
            Collective::Gather | Collective::Scatter => nccl.gather_or_scatter(
                shape.collective == Collective::Gather,
                input,
                output,
                shape.per_rank_count,
                dtype,
                root,
                (self.rank(), shape.nranks),
                stream,
            ),
        };
        let timed = self.time(&call);
        Ok(self
            .agree_all("the NCCL baseline", timed, nccl_declined)?
            .map(|t| t.iter().sum::<f64>() / t.len().max(1) as f64))
    }

    /// Frees the stream and events (buffers and algorithms free themselves on drop).
    fn release(&mut self) {
        let gpu = &self.gpu;
        let marks = self.replay_marks.iter().map(|&m| gpu.destroy_event(m));
        for r in [
            gpu.destroy_event(self.events.0),
            gpu.destroy_event(self.events.1),
        ]
        .into_iter()
        .chain(marks)
        .chain([gpu.destroy_stream(self.stream)])
        {
            if let Err(e) = r {
                tracing::warn!("releasing benchmark resources failed: {e}");
            }
        }
    }
}

/// `Error` is not `Clone`; the agreement step only needs its kind and text.
fn clone_error(e: &Error) -> Error {
    match e {
        Error::BackendUnavailable { backend, reason } => Error::BackendUnavailable {
            backend: backend.clone(),
            reason: reason.clone(),
        },
        other => Error::Internal(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wall_time_line_names_every_phase() {
        let spent = Spent {
            set_up: Duration::from_millis(1500),
            timing: Duration::from_millis(250),
            ..Spent::default()
        };
        assert_eq!(
            spent.line(),
            "# rank 0's wall time: set-up 1.50 s, our timed calls 0.25 s, NCCL's 0.00 s, check \
             inputs 0.00 s, check calls and outputs 0.00 s"
        );
    }

    #[test]
    fn median_of_batches() {
        assert_eq!(median(vec![5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(Vec::new()), 0.0);
    }

    #[test]
    fn deterministic_errors_are_the_ones_every_rank_repeats() {
        assert!(deterministic(&Error::Unsupported("fp8".into())));
        assert!(deterministic(&Error::Compile {
            name: "k".into(),
            log: "x".into()
        }));
        assert!(!deterministic(&Error::DeviceTimeout("w".into())));
        assert!(!deterministic(&Error::Timeout {
            what: "s".into(),
            timeout: Duration::from_secs(1)
        }));
    }

    #[test]
    fn statuses_round_trip_as_json() {
        let s: Status<f64> = Status::Done(12.345678901234567);
        let back: Status<f64> =
            serde_json::from_slice(&serde_json::to_vec(&s).expect("ser")).expect("de");
        match back {
            Status::Done(v) => assert_eq!(v, 12.345678901234567),
            other => panic!("{other:?}"),
        }
    }
}
