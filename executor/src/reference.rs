//! The CPU reference interpreter: runs a plan for all its ranks over host buffers, one thread per
//! (rank, threadblock), with the semaphore semantics of the device (a signal on a channel is seen by
//! the peer's matching channel; a wait consumes one signal), LL packets (a packet read waits for its
//! writer), local semaphores, barriers and switch channels emulated on the host. It then checks that
//! the outputs are the collective the plan names, element by element.
//!
//! Every op runs atomically under one lock, which keeps the emulation simple and makes deadlock
//! detection exact: when every live thread is blocked, nothing can ever signal them. Ordering is
//! tracked with vector clocks (signals, packets, semaphores and barriers carry the writer's clock),
//! so two writes to one element that no signal orders are reported as a race.
//!
//! Callers: each rank's program writes its input and output just before the call and uses them
//! again once the call has returned, so a peer's access to them that no signal from the rank
//! orders after the call's start, or before its end, is a race too ([`crate::call_bounds`]). Only
//! the one call is modelled: scratch reuse from one call to the next is not.
//!
//! Port channels: a put is the host proxy's, so it happens late: it is queued on its channel and
//! carried out (reading its source then) by the next signal or flush on that channel (a `pws` /
//! `pwsf` signals its own), when its threadblock ends, or when every threadblock waits (the proxy
//! goes on whatever the GPU does: LL packets need no signal). A plan that reuses a put's source before
//! a signal or flush covers the put computes the wrong result here, as it may on the GPU.
//! A `pipeline` runs its ops once per iteration over a window of their units
//! ([`crate::encode::pipeline_iterations`]), as the GPU interpreter does.

use crate::plan::{BufferRef, BufferType, ChannelType, Collective, Op, OpCode, Plan, PlanReduceOp};
use mscclpp_core::fp8;
use mscclpp_core::DataType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Condvar, Mutex, MutexGuard};

/// Why a plan failed its check.
#[derive(Debug, Clone, PartialEq)]
pub enum CheckError {
    /// The plan uses something the reference cannot check (says what).
    Unsupported(String),
    /// Every live threadblock waits; each entry names one (`rank 1 threadblock 0 op 3 (wait)`).
    Deadlock(Vec<String>),
    /// Two writes to one element without an ordering signal.
    Race(String),
    /// A result element differs from the collective's reference.
    Mismatch(String),
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckError::Unsupported(s) => write!(f, "unsupported: {s}"),
            CheckError::Deadlock(b) => write!(f, "deadlock: nothing will signal {}", b.join("; ")),
            CheckError::Race(s) => write!(f, "race: {s}"),
            CheckError::Mismatch(s) => write!(f, "wrong result: {s}"),
        }
    }
}

impl std::error::Error for CheckError {}

/// One run of the reference: the element type, the elements per chunk, the input seed.
#[derive(Debug, Clone, Copy)]
pub struct RunConfig {
    pub dtype: DataType,
    pub elems_per_chunk: usize,
    pub seed: u64,
}

/// Element sizes per chunk the proof tries (odd ones included).
pub const CHUNK_ELEMS_TRIED: [usize; 3] = [1, 3, 8];

/// Proves `plan` on every dtype and every size in [`CHUNK_ELEMS_TRIED`]; returns the input sizes in
/// bytes per rank tried (for the first dtype, f32).
pub fn prove(plan: &Plan) -> Result<Vec<usize>, CheckError> {
    let mut sizes = Vec::new();
    for (i, dtype) in DataType::ALL.into_iter().enumerate() {
        for (j, &elems) in CHUNK_ELEMS_TRIED.iter().enumerate() {
            run(
                plan,
                RunConfig {
                    dtype,
                    elems_per_chunk: elems,
                    seed: (i * 16 + j) as u64,
                },
            )?;
            if dtype == DataType::F32 {
                sizes.push(elems * plan.gpus[0].input_chunks as usize * dtype.size());
            }
        }
    }
    Ok(sizes)
}

/// The plan's reduction (every reducing op must agree; MSCCL++ plans without `reduce_op` sum).
pub fn plan_reduce_op(plan: &Plan) -> Result<PlanReduceOp, CheckError> {
    let mut found: Option<PlanReduceOp> = None;
    let mut visit = |op: &Op| -> Result<(), CheckError> {
        if is_reduce(op.name) {
            let r = op.reduce_op.unwrap_or_default();
            if found.is_some_and(|f| f != r) {
                return Err(CheckError::Unsupported(
                    "ops of one plan use different reduce_op values".into(),
                ));
            }
            found = Some(r);
        }
        Ok(())
    };
    for gpu in &plan.gpus {
        for tb in &gpu.threadblocks {
            for op in &tb.ops {
                visit(op)?;
                op.ops.iter().try_for_each(&mut visit)?;
            }
        }
    }
    Ok(found.unwrap_or_default())
}

fn is_reduce(code: OpCode) -> bool {
    use OpCode::*;
    matches!(
        code,
        Re | Repkt | Recpkt | Res | Respkt | Recspkt | Rre | Rres | Glres
    )
}

/// The reduction of `values` (one per rank) in f64 and the scale its tolerance is relative to
/// (the sum of magnitudes for a sum, the result's magnitude otherwise).
pub fn reduced(op: PlanReduceOp, values: &[f64]) -> (f64, f64) {
    let want = values[1..]
        .iter()
        .fold(values[0], |a, &b| combine(op, a, b));
    let scale = match op {
        PlanReduceOp::Sum => values.iter().map(|x| x.abs()).sum(),
        _ => want.abs(),
    };
    (want, scale)
}

/// The tolerance of a reduced element over `world` ranks: one rounding of `dtype` per step
/// (`epsilon * (world + 1) * scale`), 0 for integers (exact).
pub fn tolerance(dtype: DataType, world: usize, scale: f64) -> f64 {
    epsilon(dtype) * (world as f64 + 1.0) * scale
}

/// Whether `got` is `want` within `tol`, or `want` rounded to `dtype`.
pub fn within(dtype: DataType, got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() <= tol || got == quantize(dtype, want)
}

/// Rounds `x` to what an element of `dtype` holds.
pub fn quantize(dtype: DataType, x: f64) -> f64 {
    match dtype {
        DataType::F64 => x,
        DataType::F32 => x as f32 as f64,
        DataType::F16 => half::f16::from_f64(x).to_f64(),
        DataType::Bf16 => half::bf16::from_f64(x).to_f64(),
        d if d.is_fp8() => {
            let f = fp8::format_of(d).expect("fp8 dtype has a format");
            f.decode(f.encode(x as f32)) as f64
        }
        _ => x.round(),
    }
}

/// Machine epsilon of a float type (0 for integers: they must be exact).
fn epsilon(dtype: DataType) -> f64 {
    match dtype {
        DataType::F64 => f64::EPSILON,
        DataType::F32 => f32::EPSILON as f64,
        DataType::F16 => 1.0 / 1024.0,
        DataType::Bf16 => 1.0 / 128.0,
        DataType::Fp8E5M2 => 0.25,
        d if d.is_fp8() => 0.125,
        _ => 0.0,
    }
}

/// A random input element of `dtype` for `op` on `ranks` ranks: reductions of all ranks stay
/// in range (fp8 sums, integer products) and exact for integers.
pub fn random_input(dtype: DataType, op: PlanReduceOp, ranks: usize, rng: &mut StdRng) -> f64 {
    let x = match (dtype.is_float(), op) {
        (true, PlanReduceOp::Prod) => rng.random_range(0.5..1.5),
        // fp8 e4m3b15 tops out at 1.875: keep sums of all ranks in range.
        (true, _) if dtype.is_fp8() => rng.random_range(-1.5..1.5) / ranks as f64,
        (true, _) => rng.random_range(-1.0..1.0),
        (false, PlanReduceOp::Prod) => rng.random_range(0..2) as f64,
        (false, _) if dtype.size() == 1 => rng.random_range(0..(100 / ranks as i64).max(1)) as f64,
        (false, _) => rng.random_range(0..1000) as f64,
    };
    quantize(dtype, x)
}

fn combine(op: PlanReduceOp, a: f64, b: f64) -> f64 {
    match op {
        PlanReduceOp::Sum => a + b,
        PlanReduceOp::Prod => a * b,
        PlanReduceOp::Min => a.min(b),
        PlanReduceOp::Max => a.max(b),
    }
}

/// One element of an emulated buffer.
#[derive(Clone, Default)]
struct Cell {
    value: f64,
    /// LL packets: whether this execution's packet has arrived.
    packet_ready: bool,
    /// The last write: thread, its clock then, and the op that wrote (for race reports).
    last_write: Option<(usize, u32, usize)>,
    /// Clock of the packet's writer, joined by its reader (a packet read orders like a wait).
    packet_clock: Option<Vec<u32>>,
    /// Reads since the last write (thread, its clock then, op), one entry per thread: a write
    /// must be ordered after them.
    readers: Vec<(usize, u32, usize)>,
}

/// A signal counter with the join of its signallers' clocks.
#[derive(Clone, Default)]
struct Counter {
    value: i64,
    clock: Vec<u32>,
}

/// The signals a channel received: entry k is the join of the clocks of signals 0..=k, so the
/// k-th wait orders its threadblock after the signals it consumed and no later one (a join of
/// every signal so far would hide a race whenever a later signal happened to come first).
#[derive(Clone, Default)]
struct Signals {
    history: Vec<Vec<u32>>,
}

/// Where a buffer reference lands: a rank's buffer, the element ranges (start, len) in op order,
/// and whether it holds LL packets.
struct Span {
    rank: usize,
    buffer: BufferType,
    ranges: Vec<(usize, usize)>,
    packets: bool,
}

impl Span {
    fn elements(&self) -> impl Iterator<Item = usize> + '_ {
        self.ranges.iter().flat_map(|&(s, n)| s..s + n)
    }
}

/// Units of an op's work one step covers: a pipeline iteration's window, or [`WHOLE`]. An op's
/// units count its chunks' units (its group member's part of each) chunk after chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    begin: usize,
    end: usize,
}

const WHOLE: Window = Window {
    begin: 0,
    end: usize::MAX,
};

/// A put over a port channel the proxy has not carried out yet.
struct PendingPut {
    rank: usize,
    channel: usize,
    t: usize,
    tid: usize,
    o: usize,
    op: Op,
    win: Window,
}

/// A barrier a thread arrived at: ((rank, barrier id), the generation it must see complete).
type BarrierArrival = ((usize, u32), u64);

struct State {
    /// bufs[rank][buffer as input/output/scratch] elements.
    bufs: Vec<[Vec<Cell>; 3]>,
    /// Inbound signals of (rank, channel type, global channel index).
    inbound: HashMap<(usize, ChannelType, usize), Signals>,
    /// Signals a channel's waits consumed so far.
    consumed: HashMap<(usize, ChannelType, usize), i64>,
    semaphores: Vec<Vec<Counter>>,
    /// (rank, barrier id) -> (arrived, generation, joined clock).
    barriers: HashMap<(usize, u32), (u32, u64, Vec<u32>)>,
    clocks: Vec<Vec<u32>>,
    live: usize,
    blocked: Vec<Option<String>>,
    failure: Option<CheckError>,
    /// Port-channel puts queued for the proxy, in push order.
    pending: Vec<PendingPut>,
}

struct Machine<'a> {
    plan: &'a Plan,
    cfg: RunConfig,
    op: PlanReduceOp,
    /// Thread index of (rank, tb).
    tids: Vec<Vec<usize>>,
    /// Clock index of rank 0's caller; rank r's is `first_caller + r`.
    first_caller: usize,
    /// Op labels by (thread, op index) for race reports.
    labels: Vec<Vec<String>>,
    /// (rank, type, channel) -> (peer, peer's matching channel).
    peers: HashMap<(usize, ChannelType, usize), (usize, usize)>,
    state: Mutex<State>,
    wake: Condvar,
}

fn buffer_slot(b: BufferType) -> usize {
    match b {
        BufferType::Input => 0,
        BufferType::Output => 1,
        BufferType::Scratch => 2,
    }
}

/// The reference runs one OS thread per threadblock; more than this is not a plan to check here.
const MAX_THREADS: usize = 4096;

/// Runs the plan once and checks its outputs.
pub fn run(plan: &Plan, cfg: RunConfig) -> Result<(), CheckError> {
    let reduce = plan_reduce_op(plan)?;
    check_shape(plan)?;
    let threads: usize = plan.gpus.iter().map(|g| g.threadblocks.len()).sum();
    if threads > MAX_THREADS {
        return Err(CheckError::Unsupported(format!(
            "{threads} threadblocks in all, more than {MAX_THREADS}"
        )));
    }
    let machine = Machine::new(plan, cfg, reduce)?;
    let inputs = machine.fill_inputs();
    machine.callers_enter();
    std::thread::scope(|s| {
        for (rank, gpu) in plan.gpus.iter().enumerate() {
            for t in 0..gpu.threadblocks.len() {
                let m = &machine;
                s.spawn(move || m.run_threadblock(rank, t));
            }
        }
    });
    let state = machine.state.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(f) = &state.failure {
        return Err(f.clone());
    }
    machine.callers_leave(&state)?;
    check_outputs(plan, cfg, reduce, &inputs, &state.bufs)
}

impl<'a> Machine<'a> {
    fn new(plan: &'a Plan, cfg: RunConfig, op: PlanReduceOp) -> Result<Self, CheckError> {
        let m = cfg.elems_per_chunk;
        let mut tids = Vec::new();
        let mut labels = Vec::new();
        for (rank, gpu) in plan.gpus.iter().enumerate() {
            let mut row = Vec::new();
            for (t, tb) in gpu.threadblocks.iter().enumerate() {
                row.push(labels.len());
                labels.push(
                    tb.ops
                        .iter()
                        .enumerate()
                        .map(|(o, op)| {
                            let at = tb
                                .json_op(o)
                                .map_or_else(str::to_string, |k| format!("op {k}"));
                            format!("rank {rank} threadblock {t} {at} ({:?})", op.name)
                                .to_lowercase()
                        })
                        .collect(),
                );
            }
            tids.push(row);
        }
        let threads = labels.len();
        // The callers (module docs, "Callers"): one more clock entry per rank, after the
        // threadblocks'.
        for rank in 0..plan.gpus.len() {
            labels.push(vec![
                format!("rank {rank}'s program before its call"),
                format!("rank {rank}'s program after its call"),
            ]);
        }
        let width = labels.len();
        let mut peers = HashMap::new();
        for (rank, gpu) in plan.gpus.iter().enumerate() {
            for ty in [ChannelType::Memory, ChannelType::Port] {
                let conns: Vec<usize> = gpu.channel_peers(ty);
                for (c, &peer) in conns.iter().enumerate() {
                    let ordinal = conns[..c].iter().filter(|&&p| p == peer).count();
                    let theirs = plan.gpus[peer].channel_peers(ty);
                    let matching = theirs
                        .iter()
                        .enumerate()
                        .filter(|(_, &p)| p == rank)
                        .nth(ordinal);
                    let Some((pc, _)) = matching else {
                        return Err(CheckError::Unsupported(format!(
                            "gpus[{rank}]: {} channel {c} to rank {peer} has no counterpart on rank {peer}",
                            ty.name()
                        )));
                    };
                    peers.insert((rank, ty, c), (peer, pc));
                }
            }
        }
        let bufs = plan
            .gpus
            .iter()
            .map(|g| {
                [g.input_chunks, g.output_chunks, g.scratch_chunks]
                    .map(|c| vec![Cell::default(); c as usize * m])
            })
            .collect();
        let semaphores = plan
            .gpus
            .iter()
            .map(|g| {
                g.semaphores
                    .iter()
                    .map(|s| Counter {
                        value: s.init_value as i64,
                        clock: vec![0; width],
                    })
                    .collect()
            })
            .collect();
        Ok(Machine {
            plan,
            cfg,
            op,
            tids,
            first_caller: threads,
            labels,
            peers,
            state: Mutex::new(State {
                bufs,
                inbound: HashMap::new(),
                consumed: HashMap::new(),
                semaphores,
                barriers: HashMap::new(),
                clocks: vec![vec![0; width]; width],
                live: threads,
                blocked: vec![None; width],
                failure: None,
                pending: Vec::new(),
            }),
            wake: Condvar::new(),
        })
    }

    /// Random inputs per rank, written through the aliasing rules; returns them for the reference.
    fn fill_inputs(&self) -> Vec<Vec<f64>> {
        let mut rng = StdRng::seed_from_u64(self.cfg.seed);
        let ranks = self.plan.gpus.len();
        let mut st = self.state.lock().unwrap();
        let mut all = Vec::new();
        for (rank, gpu) in self.plan.gpus.iter().enumerate() {
            let n = gpu.input_chunks as usize * self.cfg.elems_per_chunk;
            let vals: Vec<f64> = (0..n)
                .map(|_| random_input(self.cfg.dtype, self.op, ranks, &mut rng))
                .collect();
            for (i, &v) in vals.iter().enumerate() {
                let (b, e) = self.alias(rank, BufferType::Input, i);
                st.bufs[rank][buffer_slot(b)][e].value = v;
            }
            all.push(vals);
        }
        all
    }

    fn alias(&self, rank: usize, buffer: BufferType, e: usize) -> (BufferType, usize) {
        alias(self.plan, self.cfg.elems_per_chunk, rank, buffer, e)
    }

    /// Callers: each rank's program writes its input and output just before its call (in stream
    /// order, so the rank's own threadblocks come after it) and nothing orders a peer's access
    /// after that but a signal from the rank ([`crate::call_bounds`]).
    fn callers_enter(&self) {
        let mut st = self.state.lock().unwrap();
        for rank in 0..self.plan.gpus.len() {
            let caller = self.first_caller + rank;
            st.clocks[caller][caller] = 1;
            for &tid in &self.tids[rank] {
                st.clocks[tid][caller] = 1;
            }
            for slot in [BufferType::Input, BufferType::Output].map(buffer_slot) {
                for cell in &mut st.bufs[rank][slot] {
                    cell.last_write = Some((caller, 1, 0));
                }
            }
        }
    }

    /// Each rank's program uses its input and output again once its call has returned, i.e.
    /// after every one of its threadblocks: every access of a peer to them must be ordered
    /// before that, by a signal the rank waited for.
    fn callers_leave(&self, st: &State) -> Result<(), CheckError> {
        for rank in 0..self.plan.gpus.len() {
            let caller = self.first_caller + rank;
            let mut clock = st.clocks[caller].clone();
            for &tid in &self.tids[rank] {
                join(&mut clock, &st.clocks[tid]);
            }
            let after = &self.labels[caller][1];
            for buffer in [BufferType::Input, BufferType::Output] {
                for (e, cell) in st.bufs[rank][buffer_slot(buffer)].iter().enumerate() {
                    if let Some((w, c, wo)) = cell.last_write {
                        if clock[w] < c {
                            return Err(CheckError::Race(format!(
                                "rank {rank} {} element {e}: written by {} with nothing ordering it before {after}",
                                buffer.name(),
                                self.labels[w][wo]
                            )));
                        }
                    }
                    if let Some(&(rt, _, ro)) =
                        cell.readers.iter().find(|&&(rt, rc, _)| clock[rt] < rc)
                    {
                        return Err(CheckError::Race(format!(
                            "rank {rank} {} element {e}: read by {} with nothing ordering it before {after}",
                            buffer.name(),
                            self.labels[rt][ro]
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    fn run_threadblock(&self, rank: usize, t: usize) {
        let tid = self.tids[rank][t];
        let tb = &self.plan.gpus[rank].threadblocks[t];
        for (o, op) in tb.ops.iter().enumerate() {
            let ok = match op.iter_context {
                Some(it) if op.name == OpCode::Pipeline => {
                    let unit = self.unit();
                    let per = crate::encode::units_per_iteration(it.unit_size, unit) as usize;
                    let upc = (self.cfg.elems_per_chunk * self.cfg.dtype.size()).div_ceil(unit);
                    let iters =
                        crate::encode::pipeline_iterations(it.num_chunks, upc as u64, per as u64);
                    (0..iters as usize).all(|i| {
                        let win = Window {
                            begin: i * per,
                            end: (i + 1) * per,
                        };
                        op.ops
                            .iter()
                            .all(|inner| self.step(rank, t, tid, o, inner, win))
                    })
                }
                _ => self.step(rank, t, tid, o, op, WHOLE),
            };
            if !ok {
                break;
            }
        }
        let mut st = self.state.lock().unwrap();
        // The proxy carries out what is still queued by this threadblock.
        if st.failure.is_none() {
            if let Err(e) = self.drain(&mut st, |p| p.tid == tid) {
                self.fail(&mut st, e);
            }
        }
        st.live -= 1;
        self.progress(&mut st);
    }

    /// Runs one op: waits (under the lock, on the condition variable) until it can proceed, then
    /// runs it atomically. False once the run has failed.
    fn step(&self, rank: usize, t: usize, tid: usize, o: usize, op: &Op, win: Window) -> bool {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let label = &self.labels[tid][o];
        let Some(mut st) = self.block_until(st, tid, label, |st| self.ready(st, rank, t, op, win))
        else {
            return false;
        };
        st.clocks[tid][tid] += 1;
        let arrived = match self.exec(&mut st, rank, t, tid, o, op, win) {
            Ok(arrived) => arrived,
            Err(e) => {
                self.fail(&mut st, e);
                return false;
            }
        };
        self.progress(&mut st);
        // A barrier's second half: wait until the generation we arrived in has completed.
        if let Some((key, generation)) = arrived {
            let done = |st: &State| Ok(st.barriers[&key].1 != generation);
            let Some(mut st) = self.block_until(st, tid, label, done) else {
                return false;
            };
            let clock = st.barriers[&key].2.clone();
            join(&mut st.clocks[tid], &clock);
        }
        true
    }

    /// Waits on the condition variable until `done` holds, listed as blocked on `label` meanwhile
    /// (what the deadlock check reports). None once the run has failed, `done`'s error included.
    fn block_until<'s>(
        &self,
        mut st: MutexGuard<'s, State>,
        tid: usize,
        label: &str,
        done: impl Fn(&State) -> Result<bool, CheckError>,
    ) -> Option<MutexGuard<'s, State>> {
        loop {
            if st.failure.is_some() {
                return None;
            }
            match done(&st) {
                Ok(true) => return Some(st),
                Ok(false) => {}
                Err(e) => {
                    self.fail(&mut st, e);
                    return None;
                }
            }
            st.blocked[tid] = Some(label.to_string());
            let carried_out = self.check_deadlock(&mut st);
            if st.failure.is_some() {
                return None;
            }
            if carried_out {
                continue;
            }
            st = self.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            st.blocked[tid] = None;
        }
    }

    /// Records the run's first failure and wakes every waiter to see it.
    fn fail(&self, st: &mut State, e: CheckError) {
        st.failure.get_or_insert(e);
        self.wake.notify_all();
    }

    /// Something changed: every waiter must look again before anyone may call it a deadlock.
    fn progress(&self, st: &mut State) {
        st.blocked.iter_mut().for_each(|b| *b = None);
        self.wake.notify_all();
    }

    /// Every live thread waits: the proxy still carries out the port puts queued (it does so
    /// whatever the GPU does), else nothing ever will signal them. True when queued puts were
    /// carried out: the caller looks again.
    fn check_deadlock(&self, st: &mut State) -> bool {
        let blocked: Vec<String> = st.blocked.iter().flatten().cloned().collect();
        if st.live > 0 && blocked.len() == st.live && st.failure.is_none() {
            if !st.pending.is_empty() {
                if let Err(e) = self.drain(st, |_| true) {
                    st.failure = Some(e);
                }
                self.progress(st);
                return true;
            }
            st.failure = Some(CheckError::Deadlock(blocked));
            self.wake.notify_all();
        }
        false
    }

    /// Global index of a threadblock-local channel id of one type.
    fn global_channel(&self, rank: usize, t: usize, ty: ChannelType, id: u32) -> usize {
        self.plan.gpus[rank].threadblocks[t]
            .channel(ty, id)
            .unwrap_or_default() as usize
    }

    /// Whether `op` can run now (its signals, semaphores and packets are there).
    fn ready(
        &self,
        st: &State,
        rank: usize,
        t: usize,
        op: &Op,
        win: Window,
    ) -> Result<bool, CheckError> {
        use OpCode::*;
        Ok(match op.name {
            Wait | Rlxwait => {
                let ty = op.channel_type.unwrap_or(ChannelType::Memory);
                let mut need: HashMap<usize, i64> = HashMap::new();
                for &id in &op.channel_ids {
                    *need
                        .entry(self.global_channel(rank, t, ty, id))
                        .or_default() += 1;
                }
                need.iter().all(|(&c, &n)| {
                    let got = st
                        .inbound
                        .get(&(rank, ty, c))
                        .map_or(0, |x| x.history.len() as i64);
                    let used = st.consumed.get(&(rank, ty, c)).copied().unwrap_or(0);
                    got - used >= n
                })
            }
            SemAcquire => {
                let mut need: HashMap<u32, i64> = HashMap::new();
                for &s in &op.semaphore_ids {
                    *need.entry(s).or_default() += 1;
                }
                need.iter()
                    .all(|(&s, &n)| st.semaphores[rank][s as usize].value >= n)
            }
            _ => {
                for r in &op.src_buff {
                    for span in self.resolve(rank, t, op, r, win)? {
                        let cells = &st.bufs[span.rank][buffer_slot(span.buffer)];
                        if span.packets && !span.elements().all(|e| cells[e].packet_ready) {
                            return Ok(false);
                        }
                    }
                }
                true
            }
        })
    }

    /// Where a buffer reference lands (several spans for a switch channel: one per group member).
    fn resolve(
        &self,
        rank: usize,
        t: usize,
        op: &Op,
        r: &BufferRef,
        win: Window,
    ) -> Result<Vec<Span>, CheckError> {
        let m = self.cfg.elems_per_chunk;
        let gpu = &self.plan.gpus[rank];
        let tb = &gpu.threadblocks[t];
        let targets: Vec<(usize, BufferType)> = if let Some(ty) = r.buffer_type {
            vec![(rank, ty)]
        } else if let Some(id) = r.buffer_id {
            let ty = op.channel_type.unwrap_or(ChannelType::Memory);
            let global = tb.remote_buffer(ty, id).unwrap_or_default();
            let rb = &gpu.remote_buffers[global as usize];
            vec![(rb.rank as usize, rb.buffer_type)]
        } else {
            let global = self.global_channel(
                rank,
                t,
                ChannelType::Switch,
                r.switch_channel_id.unwrap_or_default(),
            );
            let ch = gpu
                .channels
                .iter()
                .filter(|c| c.channel_type == ChannelType::Switch)
                .nth(global)
                .ok_or_else(|| {
                    CheckError::Unsupported(format!(
                        "gpus[{rank}]: switch channel {global} missing"
                    ))
                })?;
            let buffer = ch.buff.unwrap_or(BufferType::Input);
            let group = ch
                .rank_groups
                .iter()
                .find(|g| g.ranks.contains(&(rank as u32)));
            let group = group.ok_or_else(|| {
                CheckError::Unsupported(format!(
                    "gpus[{rank}]: switch channel {global} has no group holding this rank"
                ))
            })?;
            group.ranks.iter().map(|&p| (p as usize, buffer)).collect()
        };
        // A threadblock group splits every chunk of the op: member p does the p-th part of each.
        let (part, parts) = op
            .tbg_info
            .map_or((0, 1), |g| (g.tb_id as usize, g.tbg_size as usize));
        // Cut as the GPU interpreter cuts (whole payload units, so members never share a packet).
        let size = self.cfg.dtype.size();
        let unit = self.unit();
        let (lo, hi) = crate::encode::part_range(m * size, unit, part, parts);
        let (a, b) = (lo / size, hi / size);
        // The window in this op's units: chunk k holds units [k * per, (k + 1) * per).
        let per = (hi - lo).div_ceil(unit);
        let in_window = |k: usize| -> (usize, usize) {
            let clamp = |u: usize| u.saturating_sub(k * per).min(per) * unit / size;
            (clamp(win.begin), clamp(win.end).min(b - a))
        };
        targets
            .into_iter()
            .map(|(peer, buffer)| {
                let mut ranges = Vec::new();
                let mut resolved = buffer;
                for (k, chunk) in (r.index as usize..(r.index + r.size) as usize).enumerate() {
                    let (from, to) = in_window(k);
                    if from >= to {
                        continue;
                    }
                    let (buf, start) = self.alias(peer, buffer, chunk * m + a + from);
                    let size = self.state_len(peer, buf);
                    if start + (to - from) > size {
                        return Err(CheckError::Unsupported(format!(
                            "rank {peer} {} elements {start}..{} out of range ({size})",
                            buf.name(),
                            start + to - from
                        )));
                    }
                    resolved = buf;
                    ranges.push((start, to - from));
                }
                Ok(Span {
                    rank: peer,
                    buffer: resolved,
                    ranges,
                    packets: self.plan.holds_packets(resolved),
                })
            })
            .collect()
    }

    /// Payload bytes of one unit of work (and of an LL packet), as the GPU interpreter cuts.
    fn unit(&self) -> usize {
        (crate::encode::unit_bytes(self.plan.protocol) as usize).max(self.cfg.dtype.size())
    }

    fn state_len(&self, rank: usize, b: BufferType) -> usize {
        self.plan.gpus[rank].chunks(b) as usize * self.cfg.elems_per_chunk
    }

    /// Runs a ready op. Returns the barrier (key, generation) it arrived at, if it is a barrier.
    #[allow(clippy::too_many_arguments)]
    fn exec(
        &self,
        st: &mut State,
        rank: usize,
        t: usize,
        tid: usize,
        o: usize,
        op: &Op,
        win: Window,
    ) -> Result<Option<BarrierArrival>, CheckError> {
        use OpCode::*;
        let port = op.channel_type == Some(ChannelType::Port);
        match op.name {
            Flush if port => {
                for &id in &op.channel_ids {
                    let channel = self.global_channel(rank, t, ChannelType::Port, id);
                    self.drain(st, |p| p.rank == rank && p.channel == channel)?;
                }
            }
            Nop | Flush | Pipeline => {}
            Signal | Rlxsignal => self.signal(st, rank, t, tid, op)?,
            Wait | Rlxwait => {
                let ty = op.channel_type.unwrap_or(ChannelType::Memory);
                for &id in &op.channel_ids {
                    let key = (rank, ty, self.global_channel(rank, t, ty, id));
                    let used = st.consumed.entry(key).or_default();
                    *used += 1;
                    let nth = *used as usize - 1;
                    let clock = st
                        .inbound
                        .get(&key)
                        .and_then(|c| c.history.get(nth).cloned())
                        .unwrap_or_default();
                    join(&mut st.clocks[tid], &clock);
                }
            }
            SemRelease => {
                for &s in &op.semaphore_ids {
                    let clock = st.clocks[tid].clone();
                    let c = &mut st.semaphores[rank][s as usize];
                    c.value += 1;
                    join(&mut c.clock, &clock);
                }
            }
            SemAcquire => {
                for &s in &op.semaphore_ids {
                    st.semaphores[rank][s as usize].value -= 1;
                    let clock = st.semaphores[rank][s as usize].clock.clone();
                    join(&mut st.clocks[tid], &clock);
                }
            }
            Barrier => {
                let n = op
                    .num_threadblocks
                    .unwrap_or(self.plan.gpus[rank].threadblocks.len() as u32);
                let key = (rank, op.barrier_id.unwrap_or_default());
                let clock = st.clocks[tid].clone();
                let threads = clock.len();
                let entry = st.barriers.entry(key).or_insert((0, 0, vec![0; threads]));
                entry.0 += 1;
                join(&mut entry.2, &clock);
                let generation = entry.1;
                if entry.0 == n {
                    entry.0 = 0;
                    entry.1 += 1;
                    return Ok(None);
                }
                return Ok(Some((key, generation)));
            }
            _ => {
                if port && matches!(op.name, Put | Pws | Pwsf | Ppkt | Rppkt) {
                    self.queue_puts(st, rank, t, tid, o, op, win)?;
                } else if let Some(pairs) = op.pairs() {
                    for pair in &pairs {
                        self.move_data(st, rank, t, tid, o, pair, win)?;
                    }
                } else {
                    self.move_data(st, rank, t, tid, o, op, win)?;
                }
                if matches!(op.name, Pws | Pwsf) {
                    self.signal(st, rank, t, tid, op)?;
                }
            }
        }
        Ok(None)
    }

    fn signal(
        &self,
        st: &mut State,
        rank: usize,
        t: usize,
        tid: usize,
        op: &Op,
    ) -> Result<(), CheckError> {
        let ty = op.channel_type.unwrap_or(ChannelType::Memory);
        for &id in &op.channel_ids {
            let global = self.global_channel(rank, t, ty, id);
            if ty == ChannelType::Port {
                // The proxy signals after the puts queued before it on the channel.
                self.drain(st, |p| p.rank == rank && p.channel == global)?;
            }
            let clock = st.clocks[tid].clone();
            let &(peer, pc) = self.peers.get(&(rank, ty, global)).ok_or_else(|| {
                CheckError::Unsupported(format!(
                    "{} channel {global} of rank {rank} cannot signal",
                    ty.name()
                ))
            })?;
            let c = st.inbound.entry((peer, ty, pc)).or_default();
            let mut joined = c
                .history
                .last()
                .cloned()
                .unwrap_or_else(|| vec![0; clock.len()]);
            join(&mut joined, &clock);
            c.history.push(joined);
        }
        Ok(())
    }

    /// Queues a put over port channels for the proxy: destination d through the op's channel d,
    /// from source d (or the only source).
    #[allow(clippy::too_many_arguments)]
    fn queue_puts(
        &self,
        st: &mut State,
        rank: usize,
        t: usize,
        tid: usize,
        o: usize,
        op: &Op,
        win: Window,
    ) -> Result<(), CheckError> {
        let one_source = op.src_buff.len() == 1;
        if !one_source && op.src_buff.len() != op.dst_buff.len() {
            return Err(CheckError::Unsupported(format!(
                "{}: a put over port channels takes one source, or one per destination",
                self.labels[tid][o]
            )));
        }
        for (d, dst) in op.dst_buff.iter().enumerate() {
            let id = *op.channel_ids.get(d).ok_or_else(|| {
                CheckError::Unsupported(format!(
                    "{}: a put over port channels names a channel per destination",
                    self.labels[tid][o]
                ))
            })?;
            let src = &op.src_buff[if one_source { 0 } else { d }];
            st.pending.push(PendingPut {
                rank,
                channel: self.global_channel(rank, t, ChannelType::Port, id),
                t,
                tid,
                o,
                op: Op {
                    src_buff: vec![src.clone()],
                    dst_buff: vec![dst.clone()],
                    channel_ids: vec![id],
                    ..op.clone()
                },
                win,
            });
        }
        Ok(())
    }

    /// The proxy carries out the queued puts `which` selects, in push order.
    fn drain(&self, st: &mut State, which: impl Fn(&PendingPut) -> bool) -> Result<(), CheckError> {
        let (now, later): (Vec<PendingPut>, Vec<PendingPut>) = std::mem::take(&mut st.pending)
            .into_iter()
            .partition(|p| which(p));
        st.pending = later;
        for p in now {
            self.move_data(st, p.rank, p.t, p.tid, p.o, &p.op, p.win)?;
        }
        Ok(())
    }

    /// Data ops: every source span is read (packets join their writer's clock) and combined with
    /// the plan's reduction; the result is written to every destination span.
    #[allow(clippy::too_many_arguments)]
    fn move_data(
        &self,
        st: &mut State,
        rank: usize,
        t: usize,
        tid: usize,
        o: usize,
        op: &Op,
        win: Window,
    ) -> Result<(), CheckError> {
        let mut spans = Vec::new();
        for r in &op.src_buff {
            spans.extend(self.resolve(rank, t, op, r, win)?);
        }
        // Packets order their reader after their writer, like a wait.
        for span in spans.iter().filter(|s| s.packets) {
            let cells = &st.bufs[span.rank][buffer_slot(span.buffer)];
            let clocks: Vec<Vec<u32>> = span
                .elements()
                .filter_map(|e| cells[e].packet_clock.clone())
                .collect();
            for c in clocks {
                join(&mut st.clocks[tid], &c);
            }
        }
        let clock = st.clocks[tid].clone();
        let mut acc: Option<Vec<f64>> = None;
        for span in &spans {
            let mut values = Vec::with_capacity(span.elements().count());
            for e in span.elements() {
                let cell = &mut st.bufs[span.rank][buffer_slot(span.buffer)][e];
                if let Some((w, c, wo)) = cell.last_write {
                    if w != tid && clock[w] < c {
                        return Err(CheckError::Race(format!(
                            "rank {} {} element {e}: read by {} with no signal ordering it after the write by {}",
                            span.rank,
                            span.buffer.name(),
                            self.labels[tid][o],
                            self.labels[w][wo]
                        )));
                    }
                }
                cell.readers.retain(|r| r.0 != tid);
                cell.readers.push((tid, clock[tid], o));
                values.push(cell.value);
            }
            acc = Some(match acc {
                None => values,
                Some(a) => a
                    .iter()
                    .zip(&values)
                    .map(|(&x, &y)| combine(self.op, x, y))
                    .collect(),
            });
        }
        let Some(values) = acc else { return Ok(()) };
        for r in &op.dst_buff {
            for span in self.resolve(rank, t, op, r, win)? {
                for (e, &v) in span.elements().zip(&values) {
                    let cell = &mut st.bufs[span.rank][buffer_slot(span.buffer)][e];
                    if let Some((w, c, wo)) = cell.last_write {
                        if w != tid && clock[w] < c {
                            return Err(CheckError::Race(format!(
                                "rank {} {} element {e}: written by {} and by {} with no signal ordering them",
                                span.rank,
                                span.buffer.name(),
                                self.labels[w][wo],
                                self.labels[tid][o]
                            )));
                        }
                    }
                    if let Some(&(rt, _, ro)) = cell
                        .readers
                        .iter()
                        .find(|&&(rt, rc, _)| rt != tid && clock[rt] < rc)
                    {
                        return Err(CheckError::Race(format!(
                            "rank {} {} element {e}: written by {} while {} may still read it (no signal orders them)",
                            span.rank,
                            span.buffer.name(),
                            self.labels[tid][o],
                            self.labels[rt][ro]
                        )));
                    }
                    cell.readers.clear();
                    cell.value = quantize(self.cfg.dtype, v);
                    cell.last_write = Some((tid, clock[tid], o));
                    if span.packets {
                        cell.packet_ready = true;
                        cell.packet_clock = Some(clock.clone());
                    }
                }
            }
        }
        Ok(())
    }
}

/// The chunk counts every rank must have for the plan's collective (what the output check indexes).
fn check_shape(plan: &Plan) -> Result<(), CheckError> {
    let world = plan.gpus.len() as u32;
    for (rank, g) in plan.gpus.iter().enumerate() {
        let (i, o) = (g.input_chunks, g.output_chunks);
        let first = &plan.gpus[0];
        if (i, o) != (first.input_chunks, first.output_chunks) {
            return Err(CheckError::Mismatch(format!(
                "gpus[{rank}]: {i} input and {o} output chunks, rank 0 has {} and {}",
                first.input_chunks, first.output_chunks
            )));
        }
        let fits = match plan.collective {
            Collective::Allreduce => i > 0 && (o == i || (plan.inplace && o == 0)),
            Collective::Allgather => i > 0 && o == world * i,
            Collective::Reducescatter => o > 0 && i == world * o,
            Collective::Alltoall => i > 0 && i == o && i % world == 0,
            Collective::Sendrecv => i > 0 && o == i,
            other => {
                return Err(CheckError::Unsupported(format!(
                    "no reference for collective {other:?}"
                )))
            }
        };
        if !fits {
            return Err(CheckError::Mismatch(format!(
                "gpus[{rank}]: {i} input and {o} output chunks do not make a {:?} over {world} ranks",
                plan.collective
            )));
        }
    }
    Ok(())
}

/// In-place plans share memory between input and output: element `e` of `buffer` lives here.
fn alias(plan: &Plan, m: usize, rank: usize, buffer: BufferType, e: usize) -> (BufferType, usize) {
    let gpu = &plan.gpus[rank];
    if !plan.inplace {
        return (buffer, e);
    }
    match (plan.collective, buffer) {
        (Collective::Allgather, BufferType::Input) => {
            (BufferType::Output, rank * gpu.input_chunks as usize * m + e)
        }
        (Collective::Reducescatter, BufferType::Output) => {
            (BufferType::Input, rank * gpu.output_chunks as usize * m + e)
        }
        (Collective::Allgather | Collective::Reducescatter, _) => (buffer, e),
        (_, BufferType::Output) => (BufferType::Input, e),
        _ => (buffer, e),
    }
}

/// Checks every output element against the collective computed in f64 from the inputs.
fn check_outputs(
    plan: &Plan,
    cfg: RunConfig,
    op: PlanReduceOp,
    inputs: &[Vec<f64>],
    bufs: &[[Vec<Cell>; 3]],
) -> Result<(), CheckError> {
    let world = plan.gpus.len();
    let m = cfg.elems_per_chunk;
    let reduce = |vals: &mut dyn Iterator<Item = f64>| reduced(op, &vals.collect::<Vec<_>>());
    let senders = match plan.collective {
        Collective::Sendrecv => sendrecv_senders(plan, cfg, inputs, bufs)?,
        _ => Vec::new(),
    };
    for rank in 0..world {
        let gpu = &plan.gpus[rank];
        let in_elems = gpu.input_chunks as usize * m;
        let out_elems = match (plan.collective, plan.inplace) {
            (Collective::Allreduce, true) => in_elems,
            _ => gpu.output_chunks as usize * m,
        };
        for e in 0..out_elems {
            let (want, scale) = match plan.collective {
                Collective::Allreduce => reduce(&mut inputs.iter().map(|x| x[e])),
                Collective::Allgather => {
                    let (src, i) = (e / in_elems, e % in_elems);
                    (inputs[src][i], 0.0)
                }
                Collective::Reducescatter => {
                    reduce(&mut inputs.iter().map(|x| x[rank * out_elems + e]))
                }
                Collective::Alltoall => {
                    let k = out_elems / world;
                    (inputs[e / k][rank * k + e % k], 0.0)
                }
                Collective::Sendrecv => (inputs[senders[rank]][e], 0.0),
                other => {
                    return Err(CheckError::Unsupported(format!(
                        "no reference for collective {other:?}"
                    )));
                }
            };
            let (b, i) = alias(plan, m, rank, BufferType::Output, e);
            let got = bufs[rank][buffer_slot(b)][i].value;
            let tol = tolerance(cfg.dtype, world, scale);
            if !within(cfg.dtype, got, want, tol) {
                return Err(CheckError::Mismatch(format!(
                    "{} {}: rank {rank} output element {e} is {got}, want {want} (tolerance {tol:.3e})",
                    cfg.dtype.name(),
                    op_name(op)
                )));
            }
        }
    }
    Ok(())
}

/// A send/receive's pairs are the program's choice (a ring, pairs within groups...): each rank
/// must end with the whole input of one other rank, every rank's input received by one rank.
/// Returns the rank each rank received from.
fn sendrecv_senders(
    plan: &Plan,
    cfg: RunConfig,
    inputs: &[Vec<f64>],
    bufs: &[[Vec<Cell>; 3]],
) -> Result<Vec<usize>, CheckError> {
    let world = plan.gpus.len();
    let m = cfg.elems_per_chunk;
    let mut senders = Vec::with_capacity(world);
    for (rank, cells) in bufs.iter().enumerate().take(world) {
        let elems = plan.gpus[rank].output_chunks as usize * m;
        let got = |e: usize| {
            let (b, i) = alias(plan, m, rank, BufferType::Output, e);
            cells[buffer_slot(b)][i].value
        };
        // Small integer types may give two ranks equal inputs: take a sender no rank took yet.
        let sender = (0..world)
            .filter(|&s| s != rank && !senders.contains(&s))
            .find(|&s| (0..elems).all(|e| within(cfg.dtype, got(e), inputs[s][e], 0.0)))
            .ok_or_else(|| {
                CheckError::Mismatch(format!(
                    "{}: rank {rank}'s output is not the input of another rank (that no other \
                     rank received)",
                    cfg.dtype.name()
                ))
            })?;
        senders.push(sender);
    }
    Ok(senders)
}

fn op_name(op: PlanReduceOp) -> &'static str {
    match op {
        PlanReduceOp::Sum => "sum",
        PlanReduceOp::Min => "min",
        PlanReduceOp::Max => "max",
        PlanReduceOp::Prod => "prod",
    }
}

fn join(into: &mut [u32], other: &[u32]) {
    for (a, b) in into.iter_mut().zip(other) {
        *a = (*a).max(*b);
    }
}
