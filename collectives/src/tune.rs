//! The tuner: grid-searches (algorithm, nblocks, nthreads) for each power-of-two message size
//! under CUDA graphs and records the fastest in a [`TuningTable`].
//!
//! # Every rank decides the same
//! Collective kernels only finish when every rank runs the same one, so every rank must walk the
//! same sequence of (size, candidate) and reach the same winner. After each step every rank
//! contributes a status (a byte: done, declined, failed), a value (its f64 time) and a reason
//! through a bootstrap `all_gather`, and everyone acts on the gathered vector:
//! - any rank failed (a driver error, a timeout): every rank stops with an error naming that rank;
//! - any rank declined (`Unsupported`, `InvalidArgument`, `LaunchShape`, `Compile`: the candidate
//!   cannot run): every rank skips the candidate;
//! - otherwise the candidate's time is the mean of the gathered times.
//!
//! The issue asks for the per-rank times to be averaged by an allreduce. A bootstrap all_gather
//! followed by a local sum in rank order computes the same mean, and does it bit-identically on
//! every rank: each rank adds the same f64 values in the same order. A floating-point allreduce
//! does not promise that (its summation order may differ between ranks, and the last bit with it),
//! so two nearly tied candidates could be ordered differently on two ranks and the ranks would
//! then run different algorithms. The gathered vector is also what carries the status bytes, so
//! agreement on "skip" and on the times is one message.
//!
//! # Steps per candidate
//! 1. `check` on the host (local, no device work) — agreed before anything runs, so no rank
//!    enters a collective kernel its peers will not join;
//! 2. capture `iters` calls into one graph (nothing runs yet, so a refusal here is still safe);
//! 3. one untimed replay (uploads the graph, warms caches), then [`TIMED_REPLAYS`] replays, each
//!    started by a bootstrap barrier and timed with events; the median replay / `iters` is this
//!    rank's time per call.
//!
//! The winner (lowest mean) is verified once with
//! [`testing::run_collective_check`](crate::testing::run_collective_check) under a
//! graph and with the tuned geometry; a winner with wrong elements on any rank is dropped and the
//! next best is verified, so the table only holds launches that computed the right answer.

use crate::resources::DeviceBuffer;
use crate::testing::run_collective_check;
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::AlgorithmCollection;
use mscclpp_core::bootstrap::Bootstrap;
use mscclpp_core::communicator::Communicator;
use mscclpp_core::env::Env;
use mscclpp_core::gpu::{Event, Gpu, Graph, Stream};
use mscclpp_core::tuner::{TunedLaunch, TuningTable};
use mscclpp_core::{AccumType, DataType, Error, ReduceOp, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Timed replays of the captured graph per candidate; the median is kept.
pub const TIMED_REPLAYS: usize = 5;

const LOG: &str = "mscclpp::tune";

/// One point of the grid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub algorithm: String,
    /// `None`: the algorithm's own choice.
    pub nblocks: Option<u32>,
    pub nthreads: Option<u32>,
}

impl std::fmt::Display for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = |v: Option<u32>| v.map_or_else(|| "auto".to_string(), |v| v.to_string());
        write!(
            f,
            "{} (nblocks {}, nthreads {})",
            self.algorithm,
            n(self.nblocks),
            n(self.nthreads)
        )
    }
}

/// The search space: every algorithm with every nblocks and every nthreads option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CandidateGrid {
    pub algorithms: Vec<String>,
    /// `None` in a list stands for the algorithm's default.
    pub nblocks: Vec<Option<u32>>,
    pub nthreads: Vec<Option<u32>>,
}

impl CandidateGrid {
    /// Every algorithm `collection` has for `collective`, each with its default geometry.
    pub fn all_algorithms(collection: &AlgorithmCollection, collective: Collective) -> Self {
        CandidateGrid {
            algorithms: collection.names(collective),
            nblocks: vec![None],
            nthreads: vec![None],
        }
    }

    /// The grid's points in a fixed order (algorithm, then nblocks, then nthreads); an empty
    /// geometry list counts as `[None]`. The order is the tie-break between equal times.
    pub fn candidates(&self) -> Vec<Candidate> {
        let default = [None];
        let or_default = |v: &[Option<u32>]| -> Vec<Option<u32>> {
            if v.is_empty() {
                default.to_vec()
            } else {
                v.to_vec()
            }
        };
        let (blocks, threads) = (or_default(&self.nblocks), or_default(&self.nthreads));
        let mut out = Vec::new();
        for a in &self.algorithms {
            for &b in &blocks {
                for &t in &threads {
                    out.push(Candidate {
                        algorithm: a.clone(),
                        nblocks: b,
                        nthreads: t,
                    });
                }
            }
        }
        out
    }
}

/// The buffers of one tuned size, in bytes and in the element count the correctness check takes
/// (see `testing::run_collective_check`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TuneShape {
    pub input_bytes: usize,
    pub output_bytes: usize,
    pub check_count: usize,
}

/// The shape of a call whose per-rank input is `message_bytes` (as
/// `SelectionContext::message_bytes`), rounded down to whole elements (and, for reduce-scatter,
/// to a whole number of elements per rank). `None` when that leaves nothing to move.
pub fn tune_shape(
    collective: Collective,
    dtype: DataType,
    message_bytes: usize,
    nranks: usize,
) -> Result<Option<TuneShape>> {
    let es = dtype.size();
    let n = nranks.max(1);
    let shape = match collective {
        Collective::AllReduce | Collective::Broadcast => {
            let count = message_bytes / es;
            TuneShape {
                input_bytes: count * es,
                output_bytes: count * es,
                check_count: count,
            }
        }
        Collective::AllGather => {
            let count = message_bytes / es;
            TuneShape {
                input_bytes: count * es,
                output_bytes: count * es * n,
                check_count: count,
            }
        }
        Collective::ReduceScatter => {
            let count = message_bytes / (es * n);
            TuneShape {
                input_bytes: count * es * n,
                output_bytes: count * es,
                check_count: count,
            }
        }
        // Whole elements for every peer: the input is nranks equal chunks.
        Collective::AllToAll => {
            let count = message_bytes / (es * n) * n;
            TuneShape {
                input_bytes: count * es,
                output_bytes: count * es,
                check_count: count,
            }
        }
        other => {
            return Err(Error::Unsupported(format!(
                "tuning {other}: only allreduce, allgather, reducescatter, broadcast and alltoall \
                 are tuned"
            )))
        }
    };
    Ok((shape.check_count > 0).then_some(shape))
}

// ---------------------------------------------------------------------------------------------
// Agreement between ranks (pure over the bootstrap; tested on the CPU).

const DONE: u8 = 0;
const DECLINED: u8 = 1;
const FAILED: u8 = 2;

/// Errors every rank hits identically for the same candidate: it simply cannot run.
fn declines(e: &Error) -> bool {
    matches!(
        e,
        Error::Unsupported(_)
            | Error::InvalidArgument(_)
            | Error::LaunchShape(_)
            | Error::Compile { .. }
    )
}

/// This rank's contribution: status byte, f64 little-endian, reason text.
fn encode_status(local: &Result<f64>) -> Vec<u8> {
    let (status, value, reason) = match local {
        Ok(v) => (DONE, *v, String::new()),
        Err(e) if declines(e) => (DECLINED, 0.0, e.to_string()),
        Err(e) => (FAILED, 0.0, e.to_string()),
    };
    let mut out = Vec::with_capacity(9 + reason.len());
    out.push(status);
    out.extend_from_slice(&value.to_le_bytes());
    out.extend_from_slice(reason.as_bytes());
    out
}

/// What every rank concluded from one gathered step.
#[derive(Debug, Clone, PartialEq)]
enum Verdict {
    /// Every rank's value, by rank.
    Done(Vec<f64>),
    /// Some rank declined: skip, with the first rank's reason.
    Skip(String),
}

/// Reads the gathered statuses; identical input gives an identical verdict on every rank.
fn decode_statuses(what: &str, all: &[Vec<u8>]) -> Result<Verdict> {
    let mut values = Vec::with_capacity(all.len());
    let mut skip = None;
    for (rank, bytes) in all.iter().enumerate() {
        let (status, value, reason) = match bytes.split_first() {
            Some((&s, rest)) if rest.len() >= 8 => {
                let mut v = [0u8; 8];
                v.copy_from_slice(&rest[..8]);
                (
                    s,
                    f64::from_le_bytes(v),
                    String::from_utf8_lossy(&rest[8..]),
                )
            }
            _ => {
                return Err(Error::Peer {
                    rank,
                    message: format!(
                        "sent a {}-byte status after {what} (at least 9 expected)",
                        bytes.len()
                    ),
                })
            }
        };
        match status {
            DONE => values.push(value),
            DECLINED => {
                skip.get_or_insert_with(|| format!("rank {rank}: {reason}"));
            }
            FAILED => {
                return Err(Error::Peer {
                    rank,
                    message: format!("{what} failed: {reason}"),
                })
            }
            other => {
                return Err(Error::Peer {
                    rank,
                    message: format!("sent unknown status {other} after {what}"),
                })
            }
        }
    }
    Ok(match skip {
        Some(why) => Verdict::Skip(why),
        None => Verdict::Done(values),
    })
}

/// Gathers every rank's `local` outcome of step `what` (collective: every rank calls it).
fn agree(bootstrap: &dyn Bootstrap, what: &str, local: Result<f64>) -> Result<Verdict> {
    let all = bootstrap.all_gather(&encode_status(&local))?;
    if all.len() != bootstrap.size() {
        return Err(Error::Internal(format!(
            "all_gather after {what} returned {} contributions for {} ranks",
            all.len(),
            bootstrap.size()
        )));
    }
    decode_statuses(what, &all)
}

/// Mean in rank order (see the module docs for why this is the same on every rank).
fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// Index of the smallest time; the first one on ties (the grid order).
fn argmin(times: &[(usize, f64)]) -> Option<(usize, f64)> {
    times.iter().copied().reduce(|best, x| {
        if x.1.total_cmp(&best.1).is_lt() {
            x
        } else {
            best
        }
    })
}

/// The device work of one tuned size, behind a trait so the sequencing and agreement logic of
/// [`decide`] runs on the CPU in tests.
trait CandidateRunner {
    /// Host-side check that the candidate can take this size (no device work).
    fn check(&mut self, c: &Candidate) -> Result<()>;
    /// Captures the candidate's calls (no device work runs yet).
    fn capture(&mut self, c: &Candidate) -> Result<()>;
    /// Replays the captured calls; this rank's time per call in microseconds.
    fn time(&mut self) -> Result<f64>;
    /// Drops what `capture` made.
    fn discard(&mut self);
    /// Runs the candidate once, checked; the number of wrong elements on this rank.
    fn verify(&mut self, c: &Candidate) -> Result<usize>;
}

/// The agreed winner of one size among `candidates`, with its mean time, or `None` when none
/// could run (or every one that ran computed wrong results). Collective.
fn decide(
    bootstrap: &dyn Bootstrap,
    runner: &mut dyn CandidateRunner,
    candidates: &[Candidate],
) -> Result<Option<(usize, f64)>> {
    let mut times = Vec::with_capacity(candidates.len());
    for (i, c) in candidates.iter().enumerate() {
        let checked = runner.check(c).map(|()| 0.0);
        if let Verdict::Skip(why) = agree(bootstrap, &format!("checking {c}"), checked)? {
            tracing::debug!(target: LOG, "skipping {c}: {why}");
            continue;
        }
        let captured = runner.capture(c).map(|()| 0.0);
        let verdict = agree(bootstrap, &format!("capturing {c}"), captured);
        // The graph is dropped whatever the peers said, before a possible early return.
        if !matches!(verdict, Ok(Verdict::Done(_))) {
            runner.discard();
        }
        if let Verdict::Skip(why) = verdict? {
            tracing::debug!(target: LOG, "skipping {c}: {why}");
            continue;
        }
        let timed = runner.time();
        runner.discard();
        match agree(bootstrap, &format!("timing {c}"), timed)? {
            Verdict::Skip(why) => tracing::debug!(target: LOG, "skipping {c}: {why}"),
            Verdict::Done(t) => {
                let m = mean(&t);
                tracing::debug!(target: LOG, "{c}: {m:.3} us per call (per rank: {t:?})");
                times.push((i, m));
            }
        }
    }
    // Verify the best; a wrong winner makes way for the next best.
    while let Some((i, m)) = argmin(&times) {
        let c = &candidates[i];
        let wrong = runner.verify(c).map(|w| w as f64);
        match agree(bootstrap, &format!("verifying {c}"), wrong)? {
            Verdict::Done(w) if w.iter().all(|&x| x == 0.0) => return Ok(Some((i, m))),
            Verdict::Done(w) => tracing::warn!(
                target: LOG,
                "{c} was fastest but computed {} wrong elements (by rank: {w:?}); dropped",
                w.iter().sum::<f64>()
            ),
            Verdict::Skip(why) => {
                tracing::warn!(target: LOG, "{c} was fastest but its check declined: {why}")
            }
        }
        times.retain(|&(j, _)| j != i);
    }
    Ok(None)
}

// ---------------------------------------------------------------------------------------------
// The GPU side.

/// A stream and two events, destroyed on drop.
struct TimingStream {
    gpu: Arc<dyn Gpu>,
    stream: Stream,
    start: Event,
    end: Event,
    timeout: Duration,
}

impl TimingStream {
    fn new(gpu: &Arc<dyn Gpu>, timeout: Duration) -> Result<Self> {
        let stream = gpu.create_stream()?;
        let events = gpu
            .create_event()
            .and_then(|s| gpu.create_event().map(|e| (s, e)));
        match events {
            Ok((start, end)) => Ok(TimingStream {
                gpu: gpu.clone(),
                stream,
                start,
                end,
                timeout,
            }),
            Err(e) => {
                let _ = gpu.destroy_stream(stream);
                Err(e)
            }
        }
    }

    /// Waits, at most `timeout`, until `end` (recorded last on the stream) has completed. Polls
    /// the event so the wait is bounded; a backend without event queries falls back to a plain
    /// stream synchronisation.
    fn wait_end(&self, rank: usize) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        loop {
            match self.gpu.query_event(self.end) {
                Ok(true) => return Ok(()),
                Ok(false) if Instant::now() >= deadline => {
                    return Err(Error::Timeout {
                        what: format!("rank {rank}'s tuning stream (a collective did not finish)"),
                        timeout: self.timeout,
                    })
                }
                Ok(false) => std::thread::sleep(Duration::from_micros(50)),
                Err(Error::Unsupported(_)) => return self.gpu.synchronize_stream(self.stream),
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for TimingStream {
    fn drop(&mut self) {
        for r in [
            self.gpu.destroy_event(self.start),
            self.gpu.destroy_event(self.end),
            self.gpu.destroy_stream(self.stream),
        ] {
            if let Err(e) = r {
                tracing::warn!(target: LOG, "releasing the tuning stream failed: {e}");
            }
        }
    }
}

/// An algorithm run with fixed launch geometry, so the correctness check runs what was timed.
struct WithLaunch<'a> {
    inner: &'a dyn Algorithm,
    nblocks: Option<u32>,
    nthreads: Option<u32>,
}

impl WithLaunch<'_> {
    fn adjust(&self, args: &ExecuteArgs) -> ExecuteArgs {
        ExecuteArgs {
            nblocks: self.nblocks,
            nthreads: self.nthreads,
            ..*args
        }
    }
}

impl Algorithm for WithLaunch<'_> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn collective(&self) -> Collective {
        self.inner.collective()
    }
    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        self.inner.check(&self.adjust(args))
    }
    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        self.inner.execute(&self.adjust(args))
    }
}

/// [`CandidateRunner`] on the GPU for one size.
struct GpuRunner<'a> {
    comm: &'a Communicator,
    collection: &'a AlgorithmCollection,
    collective: Collective,
    dtype: DataType,
    shape: TuneShape,
    timing: &'a TimingStream,
    input: DeviceBuffer,
    output: DeviceBuffer,
    iters: usize,
    seed: u64,
    graph: Option<Graph>,
}

impl GpuRunner<'_> {
    fn algorithm(&self, c: &Candidate) -> Result<Arc<dyn Algorithm>> {
        self.collection
            .get(self.collective, &c.algorithm)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "no {} algorithm named {} (registered: {})",
                    self.collective,
                    c.algorithm,
                    self.collection.names(self.collective).join(", ")
                ))
            })
    }

    fn args(&self, c: &Candidate) -> ExecuteArgs {
        ExecuteArgs {
            input: self.input.ptr(),
            output: self.output.ptr(),
            input_bytes: self.shape.input_bytes,
            output_bytes: self.shape.output_bytes,
            dtype: self.dtype,
            op: ReduceOp::Sum,
            accum: AccumType::Auto,
            root: 0,
            stream: self.timing.stream,
            nblocks: c.nblocks,
            nthreads: c.nthreads,
        }
    }
}

impl CandidateRunner for GpuRunner<'_> {
    fn check(&mut self, c: &Candidate) -> Result<()> {
        let algo = self.algorithm(c)?;
        algo.check(&self.args(c))
    }

    fn capture(&mut self, c: &Candidate) -> Result<()> {
        self.discard();
        let algo = self.algorithm(c)?;
        let args = self.args(c);
        let gpu = self.comm.gpu();
        gpu.begin_capture(self.timing.stream)?;
        let mut enqueued = Ok(());
        for _ in 0..self.iters {
            enqueued = algo.execute(&args);
            if enqueued.is_err() {
                break;
            }
        }
        // The capture must end even after a failed call, or the stream stays unusable.
        let ended = gpu.end_capture(self.timing.stream);
        match (enqueued, ended) {
            (Ok(()), Ok(g)) => {
                self.graph = Some(g);
                Ok(())
            }
            (Err(e), Ok(g)) => {
                let _ = gpu.destroy_graph(g);
                Err(e)
            }
            (Ok(()), Err(e)) | (Err(e), Err(_)) => Err(e),
        }
    }

    fn time(&mut self) -> Result<f64> {
        let graph = self
            .graph
            .ok_or_else(|| Error::Internal("timing a candidate that was not captured".into()))?;
        let gpu = self.comm.gpu();
        let t = self.timing;
        let rank = self.comm.rank();
        // Untimed first replay: uploads the graph and warms the caches.
        gpu.launch_graph(graph, t.stream)?;
        gpu.record_event(t.end, t.stream)?;
        t.wait_end(rank)?;
        let mut per_call = Vec::with_capacity(TIMED_REPLAYS);
        for _ in 0..TIMED_REPLAYS {
            // Ranks start together so one rank's host noise is not its peers' waiting time.
            self.comm.bootstrap().barrier()?;
            gpu.record_event(t.start, t.stream)?;
            gpu.launch_graph(graph, t.stream)?;
            gpu.record_event(t.end, t.stream)?;
            t.wait_end(rank)?;
            let ms = f64::from(gpu.elapsed_ms(t.start, t.end)?);
            per_call.push(ms * 1e3 / self.iters as f64);
        }
        self.comm.check_device_errors()?;
        per_call.sort_by(f64::total_cmp);
        Ok(per_call[per_call.len() / 2])
    }

    fn discard(&mut self) {
        if let Some(g) = self.graph.take() {
            if let Err(e) = self.comm.gpu().destroy_graph(g) {
                tracing::warn!(target: LOG, "destroying a tuning graph failed: {e}");
            }
        }
    }

    fn verify(&mut self, c: &Candidate) -> Result<usize> {
        let algo = self.algorithm(c)?;
        let fixed = WithLaunch {
            inner: algo.as_ref(),
            nblocks: c.nblocks,
            nthreads: c.nthreads,
        };
        let report = run_collective_check(
            self.comm,
            &fixed,
            self.dtype,
            ReduceOp::Sum,
            self.shape.check_count,
            false,
            self.seed,
            true,
            None,
        )?;
        if report.wrong > 0 {
            tracing::warn!(
                target: LOG,
                "rank {}: {c} computed {} wrong elements (first: {:?}, tolerance {})",
                self.comm.rank(),
                report.wrong,
                report.first_wrong,
                report.tolerance
            );
        }
        Ok(report.wrong)
    }
}

impl Drop for GpuRunner<'_> {
    fn drop(&mut self) {
        self.discard();
    }
}

/// Collective: tunes `collective` on `dtype` for every size in `sizes` (per-rank input bytes,
/// each a power of two) over the `candidates` grid, capturing `iters` calls per graph, and
/// returns the winners (see the module docs). Every rank must call it with the same arguments;
/// every rank returns the same table. Sizes where no candidate runs correctly get no entry.
#[allow(clippy::too_many_arguments)]
pub fn tune(
    comm: &Communicator,
    collection: &AlgorithmCollection,
    collective: Collective,
    dtype: DataType,
    sizes: &[usize],
    candidates: &CandidateGrid,
    iters: usize,
) -> Result<TuningTable> {
    if iters == 0 {
        return Err(Error::InvalidArgument(
            "tuning needs at least 1 call per graph (iters 0)".into(),
        ));
    }
    if let Some(bad) = sizes.iter().find(|s| !s.is_power_of_two()) {
        return Err(Error::InvalidArgument(format!(
            "tuning size {bad} bytes is not a power of two (tables are keyed by power-of-two \
             buckets)"
        )));
    }
    let list = candidates.candidates();
    if list.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "the candidate grid for {collective} names no algorithm"
        )));
    }
    let gpu = comm.gpu();
    let (rank, nranks) = (comm.rank(), comm.size());
    let props = gpu.properties(comm.device())?;
    let timing = TimingStream::new(gpu, Env::get()?.device_wait_timeout)?;
    let mut table = TuningTable::new();
    table.device = Some(format!("{} ({})", props.name, props.arch));
    for (k, &size) in sizes.iter().enumerate() {
        let Some(shape) = tune_shape(collective, dtype, size, nranks)? else {
            if rank == 0 {
                tracing::info!(
                    target: LOG,
                    "{collective} {dtype} at {size} bytes: not a whole element per rank; skipped"
                );
            }
            continue;
        };
        let mut runner = GpuRunner {
            comm,
            collection,
            collective,
            dtype,
            shape,
            timing: &timing,
            input: DeviceBuffer::zeroed(gpu, shape.input_bytes)?,
            output: DeviceBuffer::zeroed(gpu, shape.output_bytes)?,
            iters,
            seed: 0x7u64 ^ (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            graph: None,
        };
        match decide(comm.bootstrap().as_ref(), &mut runner, &list)? {
            Some((i, time_us)) => {
                let c = &list[i];
                if rank == 0 {
                    tracing::info!(target: LOG, "{collective} {dtype} at {size} bytes: {c}, {time_us:.3} us");
                }
                table.insert(
                    collective,
                    dtype,
                    nranks,
                    size,
                    TunedLaunch {
                        algorithm: c.algorithm.clone(),
                        nblocks: c.nblocks,
                        nthreads: c.nthreads,
                        time_us,
                    },
                )?;
            }
            None if rank == 0 => tracing::warn!(
                target: LOG,
                "{collective} {dtype} at {size} bytes: no candidate ran correctly; no entry"
            ),
            None => {}
        }
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;
    use std::sync::{Barrier, Mutex};

    /// Ranks as threads sharing one all_gather slot table.
    struct ThreadBootstrap {
        rank: usize,
        shared: Arc<(Barrier, Mutex<Vec<Vec<u8>>>)>,
    }

    impl Bootstrap for ThreadBootstrap {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.shared.1.lock().map(|v| v.len()).unwrap_or(0)
        }
        fn send(&self, _: usize, _: u64, _: &[u8]) -> Result<()> {
            Err(Error::Unsupported("send in the test bootstrap".into()))
        }
        fn recv(&self, _: usize, _: u64) -> Result<Vec<u8>> {
            Err(Error::Unsupported("recv in the test bootstrap".into()))
        }
        fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
            let (barrier, slots) = &*self.shared;
            slots.lock().expect("slots")[self.rank] = data.to_vec();
            barrier.wait();
            let all = slots.lock().expect("slots").clone();
            // Nobody writes the next round before everyone has read this one.
            barrier.wait();
            Ok(all)
        }
        fn barrier(&self) -> Result<()> {
            self.shared.0.wait();
            Ok(())
        }
        fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
            Ok(self.all_gather(data)?.swap_remove(root))
        }
    }

    /// Per-rank fake device: times and refusals by candidate index.
    #[derive(Clone, Default)]
    struct Fake {
        times: Vec<f64>,
        check_declines: Vec<usize>,
        capture_declines: Vec<usize>,
        time_fails: Vec<usize>,
        wrong: Vec<usize>,
        current: Option<usize>,
        captured: usize,
        discarded: usize,
        verified: Vec<usize>,
    }

    fn index(c: &Candidate) -> usize {
        c.algorithm.parse().expect("numeric test name")
    }

    impl CandidateRunner for Fake {
        fn check(&mut self, c: &Candidate) -> Result<()> {
            if self.check_declines.contains(&index(c)) {
                return Err(Error::Unsupported(format!("{} too large", c.algorithm)));
            }
            Ok(())
        }
        fn capture(&mut self, c: &Candidate) -> Result<()> {
            if self.capture_declines.contains(&index(c)) {
                return Err(Error::LaunchShape("nblocks too large".into()));
            }
            self.captured += 1;
            self.current = Some(index(c));
            Ok(())
        }
        fn time(&mut self) -> Result<f64> {
            let i = self.current.expect("captured");
            if self.time_fails.contains(&i) {
                return Err(Error::DeviceTimeout("the barrier".into()));
            }
            Ok(self.times[i])
        }
        fn discard(&mut self) {
            if self.current.take().is_some() {
                self.discarded += 1;
            }
        }
        fn verify(&mut self, c: &Candidate) -> Result<usize> {
            self.verified.push(index(c));
            Ok(if self.wrong.contains(&index(c)) { 3 } else { 0 })
        }
    }

    fn grid(n: usize) -> Vec<Candidate> {
        CandidateGrid {
            algorithms: (0..n).map(|i| i.to_string()).collect(),
            nblocks: vec![],
            nthreads: vec![],
        }
        .candidates()
    }

    /// One rank's decision and its fake device afterwards.
    type RankOutcome = (Result<Option<(usize, f64)>>, Fake);

    /// Runs `decide` on one thread per fake rank.
    fn run_ranks(fakes: Vec<Fake>, n: usize) -> Vec<RankOutcome> {
        let ranks = fakes.len();
        let shared = Arc::new((Barrier::new(ranks), Mutex::new(vec![Vec::new(); ranks])));
        let handles: Vec<_> = fakes
            .into_iter()
            .enumerate()
            .map(|(rank, mut fake)| {
                let b = ThreadBootstrap {
                    rank,
                    shared: shared.clone(),
                };
                std::thread::spawn(move || {
                    let r = decide(&b, &mut fake, &grid(n));
                    (r, fake)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    }

    fn fake(times: &[f64]) -> Fake {
        Fake {
            times: times.to_vec(),
            ..Fake::default()
        }
    }

    #[test]
    fn every_rank_takes_the_argmin_of_the_mean() {
        // Rank 0 alone would pick 0, rank 1 alone would pick 1; the mean picks 1 (5.5 vs 6.0).
        let out = run_ranks(vec![fake(&[2.0, 3.0, 9.0]), fake(&[10.0, 8.0, 9.0])], 3);
        for (r, f) in &out {
            assert_eq!(r.as_ref().expect("decided"), &Some((1, 5.5)));
            assert_eq!(f.verified, vec![1]);
            assert_eq!(f.captured, f.discarded, "every graph is dropped");
        }
    }

    #[test]
    fn a_refusal_on_one_rank_skips_the_candidate_everywhere() {
        let mut r0 = fake(&[1.0, 5.0, 4.0]);
        r0.check_declines = vec![0];
        let mut r1 = fake(&[1.0, 5.0, 4.0]);
        r1.capture_declines = vec![2];
        let out = run_ranks(vec![r0, r1, fake(&[1.0, 5.0, 4.0])], 3);
        for (r, f) in &out {
            assert_eq!(r.as_ref().expect("decided"), &Some((1, 5.0)));
            assert_eq!(
                f.captured, f.discarded,
                "a declined capture's peers drop theirs"
            );
        }
    }

    #[test]
    fn a_wrong_winner_makes_way_for_the_next_best() {
        let mut r1 = fake(&[1.0, 2.0, 3.0]);
        r1.wrong = vec![0];
        let out = run_ranks(vec![fake(&[1.0, 2.0, 3.0]), r1], 3);
        for (r, f) in &out {
            assert_eq!(r.as_ref().expect("decided"), &Some((1, 2.0)));
            assert_eq!(f.verified, vec![0, 1]);
        }
    }

    #[test]
    fn nothing_runnable_gives_no_winner() {
        let mut r0 = fake(&[1.0, 2.0]);
        r0.check_declines = vec![0, 1];
        let out = run_ranks(vec![r0, fake(&[1.0, 2.0])], 2);
        for (r, _) in &out {
            assert_eq!(r.as_ref().expect("decided"), &None);
        }
    }

    #[test]
    fn a_failure_on_one_rank_stops_every_rank_naming_it() {
        let mut r1 = fake(&[1.0, 2.0]);
        r1.time_fails = vec![1];
        let out = run_ranks(vec![fake(&[1.0, 2.0]), r1, fake(&[1.0, 2.0])], 2);
        for (r, f) in &out {
            let e = r.as_ref().expect_err("stopped");
            assert!(e.to_string().starts_with("rank 1: timing 1"), "{e}");
            assert_eq!(f.captured, f.discarded);
        }
    }

    #[test]
    fn ties_go_to_the_first_candidate() {
        assert_eq!(argmin(&[(0, 2.0), (3, 1.0), (5, 1.0)]), Some((3, 1.0)));
        assert_eq!(argmin(&[]), None);
    }

    #[test]
    fn statuses_round_trip_and_bad_ones_name_the_rank() {
        let all = vec![
            encode_status(&Ok(1.5)),
            encode_status(&Err(Error::Unsupported("fp8".into()))),
        ];
        assert_eq!(
            decode_statuses("x", &all).expect("decoded"),
            Verdict::Skip("rank 1: unsupported: fp8".into())
        );
        let ok = vec![encode_status(&Ok(1.5)), encode_status(&Ok(2.5))];
        assert_eq!(
            decode_statuses("x", &ok).expect("decoded"),
            Verdict::Done(vec![1.5, 2.5])
        );
        let e = decode_statuses("x", &[vec![0u8; 9], vec![1u8, 2]]).expect_err("short");
        assert!(e.to_string().contains("rank 1"), "{e}");
        let e = decode_statuses("x", &[vec![7u8; 9]]).expect_err("unknown");
        assert!(e.to_string().contains("unknown status 7"), "{e}");
    }

    #[test]
    fn grid_order_and_defaults() {
        let g = CandidateGrid {
            algorithms: vec!["a".into(), "b".into()],
            nblocks: vec![Some(8), None],
            nthreads: vec![Some(256)],
        };
        let c = g.candidates();
        assert_eq!(c.len(), 4);
        assert_eq!(c[1].to_string(), "a (nblocks auto, nthreads 256)");
        assert_eq!(c[2].algorithm, "b");
        assert_eq!(grid(2)[0].nblocks, None);
    }

    #[rstest]
    #[case(Collective::AllReduce, DataType::Bf16, 1024, 2, Some((1024, 1024, 512)))]
    #[case(Collective::AllReduce, DataType::F32, 2, 2, None)]
    #[case(Collective::AllGather, DataType::F32, 1024, 4, Some((1024, 4096, 256)))]
    #[case(Collective::ReduceScatter, DataType::F32, 1024, 3, Some((1020, 340, 85)))]
    #[case(Collective::ReduceScatter, DataType::F64, 8, 2, None)]
    #[case(Collective::Broadcast, DataType::U8, 4, 8, Some((4, 4, 4)))]
    #[case(Collective::AllToAll, DataType::Bf16, 1024, 3, Some((1020, 1020, 510)))]
    #[case(Collective::AllToAll, DataType::F32, 8, 4, None)]
    fn shapes(
        #[case] c: Collective,
        #[case] d: DataType,
        #[case] bytes: usize,
        #[case] n: usize,
        #[case] want: Option<(usize, usize, usize)>,
    ) {
        let got = tune_shape(c, d, bytes, n)
            .expect("tunable")
            .map(|s| (s.input_bytes, s.output_bytes, s.check_count));
        assert_eq!(got, want);
    }

    #[test]
    fn untunable_collectives_are_refused() {
        let e = tune_shape(Collective::SendRecv, DataType::F32, 8, 2).expect_err("refused");
        assert!(e.to_string().contains("sendrecv"), "{e}");
    }
}
