//! The compact op encoding the GPU interpreter (`kernels-cu/src/kernels/executor.cu`) walks, built
//! once per (plan, rank) from a validated plan.
//!
//! Every data-moving op code becomes one [`OpKind::Data`] (sources read, reduced with the plan's
//! op, written to every destination), which is how the CPU reference ([`crate::reference`]) runs
//! them too; both resolve channels, remote buffers and packet buffers through the same plan
//! methods (`Threadblock::channel`, `Threadblock::remote_buffer`, `Plan::holds_packets`). A
//! `pipeline` becomes an [`OpKind::Pipeline`] followed by its ops, which both interpreters run
//! once per iteration over a window of the ops' units ([`pipeline_iterations`]).
//!
//! Over port channels the interpreter runs what MSCCL++ runs there: `put`, `pws`, `pwsf` on plain
//! data and `ppkt`, `rppkt` on LL packets already in a packet buffer (a proxy copy per
//! destination, from this rank's memory into the peer of the op's channel of the same position),
//! `signal`, `wait` (and their relaxed forms) and `flush`. What the interpreter does not run is
//! refused here, with the op's JSON path: other ops over port channels (reductions, copies and
//! gets: MSCCL++ runs those on memory channels), and switch-channel ops (NVLink multicast, only
//! behind the NVLS gate, and not run by the interpreter even then).

use crate::error::{PlanError, Result};
use crate::plan::{BufferRef, BufferType, ChannelType, Op, OpCode, Plan, Protocol};
use mscclpp_kernels_cu::executor::{
    program_bytes, OpKind, PlanFeatures, PlanOp, PlanRef, StaticProgram, FIRST_REMOTE_SLOT,
    FLAG_FLUSH_AFTER, FLAG_PORT, FLAG_SIGNAL_AFTER, MAX_PLAN_BUFFERS, MAX_SHARED_PROGRAM_BYTES,
    SLOT_INPUT, SLOT_OUTPUT, SLOT_SCRATCH,
};

/// One rank's plan as the interpreter reads it, plus what the host must set up for it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EncodedPlan {
    pub ops: Vec<PlanOp>,
    /// Threadblock `b`'s ops are `ops[tb_ops[b]..tb_ops[b + 1]]`...
    pub tb_ops: Vec<u32>,
    /// ... its ops' references `refs[tb_refs[b]..tb_refs[b + 1]]`...
    pub tb_refs: Vec<u32>,
    /// ... and their ids `ids[tb_ids[b]..tb_ids[b + 1]]`.
    pub tb_ids: Vec<u32>,
    pub refs: Vec<PlanRef>,
    /// Channel (global memory- or port-channel index), semaphore and barrier ids of the ops, and
    /// the iteration context of pipelines.
    pub ids: Vec<u32>,
    /// The peer of every memory channel of this rank, by global index.
    pub channel_peers: Vec<usize>,
    /// The peer of every port channel of this rank, by global index.
    pub port_channel_peers: Vec<usize>,
    /// Initial values of the local semaphores.
    pub semaphores: Vec<u32>,
    /// Barrier ids used: `0..barriers`.
    pub barriers: u32,
    /// The remote buffer at slot `FIRST_REMOTE_SLOT + k`: (rank, buffer).
    pub remote_buffers: Vec<(usize, BufferType)>,
    /// Which memory each remote buffer is (`StaticProgram::remote_memory`): a peer's scratch, or
    /// its input and output (one buffer when it runs in place).
    pub remote_memory: Vec<u32>,
}

/// Whether the interpreter may run each plan threadblock as several CUDA blocks ("replicas",
/// each taking a contiguous share of the units of every chunk of every op, as a threadblock
/// group's members do), and at what price.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// A threadblock must stay one block: a pipeline (its windows count one block's units), a
    /// port-channel op (one thread pushes every trigger of the op), a local barrier or semaphore
    /// (they count blocks).
    Never,
    /// Data ops (and nops) only, each threadblock's cut into parts one way: replicas never meet
    /// (the same units of a chunk always fall to the same replica, so an op reads what the
    /// replica's earlier ops wrote; a nop is the block's own barrier).
    Free,
    /// Memory-channel signals, waits or flushes too, or a threadblock whose data ops are cut
    /// into parts in more than one way (threadblock groups): one replica runs the
    /// synchronisation and the replicas meet at a barrier where the threadblock goes from data to
    /// it or back, or from one cut to another. Replicas that meet must all be resident at once.
    Synced,
}

impl EncodedPlan {
    pub fn threadblocks(&self) -> usize {
        self.tb_ops.len().saturating_sub(1)
    }

    /// The ops as the GPU interpreter reads them, each threadblock's a program of its own (the
    /// kernel's `Program`): `first_ref` and `first_id` counted from the threadblock's first
    /// reference and id; and `PlanArgs::tb_starts`, the (op, reference, id) starts of every
    /// threadblock and of the end.
    pub fn device_program(&self) -> (Vec<PlanOp>, Vec<u32>) {
        let mut ops = self.ops.clone();
        for b in 0..self.threadblocks() {
            let (refs0, ids0) = (self.tb_refs[b], self.tb_ids[b]);
            for op in &mut ops[self.tb_ops[b] as usize..self.tb_ops[b + 1] as usize] {
                // An op that names no reference or id keeps 0.
                op.first_ref = op.first_ref.saturating_sub(refs0);
                op.first_id = op.first_id.saturating_sub(ids0);
            }
        }
        let starts = (0..self.tb_ops.len())
            .flat_map(|b| [self.tb_ops[b], self.tb_refs[b], self.tb_ids[b]])
            .collect();
        (ops, starts)
    }

    /// The program as a specialised unit compiles it in
    /// ([`mscclpp_kernels_cu::executor::specialised_unit_source`]).
    pub fn static_program(&self) -> StaticProgram<'_> {
        StaticProgram {
            ops: &self.ops,
            tb_ops: &self.tb_ops,
            refs: &self.refs,
            ids: &self.ids,
            remote_memory: &self.remote_memory,
        }
    }

    /// Bytes of the largest threadblock program in the interpreter's shared memory.
    pub fn largest_program_bytes(&self) -> usize {
        (0..self.threadblocks())
            .map(|b| self.program_bytes(b))
            .max()
            .unwrap_or(0)
    }

    /// Bytes of threadblock `b`'s program (its ops, references and ids) in shared memory.
    pub fn program_bytes(&self, b: usize) -> usize {
        let count = |starts: &[u32]| (starts[b + 1] - starts[b]) as usize;
        program_bytes(
            count(&self.tb_ops),
            count(&self.tb_refs),
            count(&self.tb_ids),
        )
    }

    /// What the rank's ops use, so its interpreter unit can leave out the rest.
    pub fn features(&self) -> PlanFeatures {
        PlanFeatures {
            packets: self.refs.iter().any(|r| r.packets != 0),
            ports: self.ops.iter().any(|op| op.flags & FLAG_PORT != 0),
            pipelines: self.ops.iter().any(|op| op.kind == OpKind::Pipeline as u8),
        }
    }

    pub fn replication(&self) -> Replication {
        let mut meets = false;
        for b in 0..self.threadblocks() {
            let mut cut = None;
            for op in &self.ops[self.tb_ops[b] as usize..self.tb_ops[b + 1] as usize] {
                if op.flags & FLAG_PORT != 0 {
                    return Replication::Never;
                }
                match op.kind {
                    k if k == OpKind::Data as u8 => {
                        meets |= op.flags & FLAG_SIGNAL_AFTER != 0;
                        let this = (op.tbg_part, op.tbg_parts);
                        meets |= cut.is_some_and(|c| c != this);
                        cut = Some(this);
                    }
                    k if k == OpKind::Nop as u8 => {}
                    k if k == OpKind::Signal as u8
                        || k == OpKind::RelaxedSignal as u8
                        || k == OpKind::Wait as u8
                        || k == OpKind::RelaxedWait as u8
                        || k == OpKind::Flush as u8 =>
                    {
                        meets = true
                    }
                    _ => return Replication::Never,
                }
            }
        }
        if meets {
            Replication::Synced
        } else {
            Replication::Free
        }
    }
}

/// LL packet bytes of a protocol (0 for Simple): MSCCL++'s `LL` is LL16.
pub fn packet_bytes(protocol: Protocol) -> u32 {
    match protocol {
        Protocol::Simple => 0,
        Protocol::Ll8 => 8,
        Protocol::Ll | Protocol::Ll16 => 16,
    }
}

/// Payload bytes per unit of the interpreter's work (and per packet).
pub fn unit_bytes(protocol: Protocol) -> u32 {
    if protocol == Protocol::Ll8 {
        4
    } else {
        8
    }
}

/// The bytes `[start, end)` of a chunk of `chunk_bytes` that member `part` of a threadblock group
/// of `parts` handles: whole units of `unit` payload bytes, so no two members write one LL packet.
/// The kernel's `run_data` cuts chunks the same way; the CPU reference uses this.
pub fn part_range(chunk_bytes: usize, unit: usize, part: usize, parts: usize) -> (usize, usize) {
    let units = chunk_bytes.div_ceil(unit);
    let at = |p: usize| (units * p / parts * unit).min(chunk_bytes);
    (at(part), at(part + 1))
}

/// Units of an op's work a pipeline iteration covers: `unit_size` bytes of `unit`-byte units
/// (at least one).
pub fn units_per_iteration(unit_size: u64, unit: usize) -> u64 {
    (unit_size / unit as u64).max(1)
}

/// Iterations of a pipeline over `num_chunks` chunks of `units_per_chunk` units: MSCCL++ runs
/// `ceil(num_chunks * chunk bytes / unit_size)`; counted in whole units here, as both
/// interpreters cut work. Iteration `i` covers units `[i * per_iteration, (i + 1) * per_iteration)`
/// of every pipelined op, an op's units counted chunk after chunk (its group member's part of
/// each chunk only).
pub fn pipeline_iterations(num_chunks: u32, units_per_chunk: u64, per_iteration: u64) -> u64 {
    (num_chunks as u64 * units_per_chunk).div_ceil(per_iteration)
}

/// Encodes `rank`'s part of a validated plan. `nvls_allowed` only changes the wording of a
/// switch-channel refusal.
pub fn encode(plan: &Plan, rank: usize, nvls_allowed: bool) -> Result<EncodedPlan> {
    let gpu = plan.gpus.get(rank).ok_or_else(|| {
        PlanError::new(
            "gpus",
            format!("no gpus[{rank}] ({} ranks)", plan.gpus.len()),
        )
    })?;
    let path = format!("gpus[{rank}]");
    if gpu.remote_buffers.len() > MAX_PLAN_BUFFERS - FIRST_REMOTE_SLOT as usize {
        return Err(PlanError::new(
            format!("{path}.remote_buffers"),
            format!(
                "{} remote buffers, the GPU interpreter takes at most {}",
                gpu.remote_buffers.len(),
                MAX_PLAN_BUFFERS - FIRST_REMOTE_SLOT as usize
            ),
        ));
    }
    let mut enc = EncodedPlan {
        tb_ops: vec![0],
        tb_refs: vec![0],
        tb_ids: vec![0],
        channel_peers: gpu.channel_peers(ChannelType::Memory),
        port_channel_peers: gpu.channel_peers(ChannelType::Port),
        semaphores: gpu.semaphores.iter().map(|s| s.init_value).collect(),
        remote_buffers: gpu
            .remote_buffers
            .iter()
            .map(|rb| (rb.rank as usize, rb.buffer_type))
            .collect(),
        remote_memory: gpu
            .remote_buffers
            .iter()
            .map(|rb| 2 * rb.rank + u32::from(rb.buffer_type == BufferType::Scratch))
            .collect(),
        ..EncodedPlan::default()
    };
    let encoder = Encoder {
        plan,
        rank,
        nvls_allowed,
    };
    for (t, tb) in gpu.threadblocks.iter().enumerate() {
        for (o, op) in tb.ops.iter().enumerate() {
            let op_path = match tb.json_op(o) {
                Ok(k) => format!("{path}.threadblocks[{t}].ops[{k}]"),
                Err(added) => format!("{path}.threadblocks[{t}] ({added})"),
            };
            if op.name == OpCode::Pipeline {
                let head = enc.ops.len();
                encoder.pipeline(&mut enc, op, &op_path)?;
                for (i, inner) in op.ops.iter().enumerate() {
                    encoder.op(&mut enc, t, inner, &format!("{op_path}.ops[{i}]"))?;
                }
                // The head counts encoded ops, which a split op (`Op::pairs`) makes more of.
                enc.ops[head].nids = narrow((enc.ops.len() - head - 1) as u32, &op_path, "ops")?;
            } else {
                encoder.op(&mut enc, t, op, &op_path)?;
            }
        }
        enc.tb_ops.push(enc.ops.len() as u32);
        enc.tb_refs.push(enc.refs.len() as u32);
        enc.tb_ids.push(enc.ids.len() as u32);
        let bytes = enc.program_bytes(t);
        if bytes > MAX_SHARED_PROGRAM_BYTES {
            return Err(PlanError::new(
                format!("{path}.threadblocks[{t}]"),
                format!(
                    "its ops take {bytes} bytes as the GPU interpreter encodes them (ops, buffer \
                     references and channel ids); a threadblock's program must fit the \
                     {MAX_SHARED_PROGRAM_BYTES} bytes of shared memory the interpreter copies it \
                     into (split the ops over more threadblocks)"
                ),
            ));
        }
    }
    count_waits(&mut enc);
    Ok(enc)
}

/// Marks the memory-channel waits the kernel counts (`PlanOp::waits_per_execution`, executor.cu's
/// `wait_counted`): those whose channels are waited on by one threadblock alone, never inside a
/// pipeline (which runs its ops a number of times that depends on the message), each channel
/// once, at one place among each channel's waits of an execution. Their inbound counts are then
/// known from the execution count, and every replica waits for itself; a channel that several
/// threadblocks wait on keeps the shared `expected` counter, which one replica advances with an
/// atomic. A channel is counted in all its waits or in none: the two ways cannot share a counter.
fn count_waits(enc: &mut EncodedPlan) {
    let mut tb_of = vec![0; enc.ops.len()];
    let mut in_pipeline = vec![false; enc.ops.len()];
    for b in 0..enc.threadblocks() {
        let mut pipelined = 0;
        for o in enc.tb_ops[b] as usize..enc.tb_ops[b + 1] as usize {
            tb_of[o] = b;
            if pipelined > 0 {
                in_pipeline[o] = true;
                pipelined -= 1;
            } else if enc.ops[o].kind == OpKind::Pipeline as u8 {
                pipelined = enc.ops[o].nids;
            }
        }
    }
    let ids = |op: &PlanOp| &enc.ids[op.first_id as usize..][..usize::from(op.nids)];
    let waits: Vec<usize> = (0..enc.ops.len())
        .filter(|&o| {
            let op = &enc.ops[o];
            (op.kind == OpKind::Wait as u8 || op.kind == OpKind::RelaxedWait as u8)
                && op.flags & FLAG_PORT == 0
        })
        .collect();
    // Each channel's waits of an execution, in order (ops are in program order).
    let mut by_channel = vec![Vec::new(); enc.channel_peers.len()];
    for &o in &waits {
        for &c in ids(&enc.ops[o]) {
            by_channel[c as usize].push(o);
        }
    }
    let mut counted: Vec<bool> = by_channel
        .iter()
        .map(|w| {
            !w.is_empty()
                && w.len() <= usize::from(u16::MAX)
                && w.iter()
                    .all(|&o| tb_of[o] == tb_of[w[0]] && !in_pipeline[o])
        })
        .collect();
    // (wait_index, waits_per_execution) of a wait whose channels are all counted and agree.
    let place = |o: usize, counted: &[bool]| -> Option<(u16, u16)> {
        let mut at = None;
        for &c in ids(&enc.ops[o]) {
            let w = &by_channel[c as usize];
            let index = w.iter().position(|&x| x == o)?;
            let once = w.iter().filter(|&&x| x == o).count() == 1;
            let this = (index as u16, w.len() as u16);
            if !counted[c as usize] || !once || at.is_some_and(|a| a != this) {
                return None;
            }
            at = Some(this);
        }
        at
    };
    // A wait left uncounted takes its channels with it, which may leave others uncounted.
    let mut changed = true;
    while changed {
        changed = false;
        for &o in &waits {
            if place(o, &counted).is_none() {
                for &c in ids(&enc.ops[o]) {
                    changed |= std::mem::replace(&mut counted[c as usize], false);
                }
            }
        }
    }
    let places: Vec<(usize, (u16, u16))> = waits
        .iter()
        .filter_map(|&o| place(o, &counted).map(|p| (o, p)))
        .collect();
    for (o, (index, per_execution)) in places {
        enc.ops[o].wait_index = index;
        enc.ops[o].waits_per_execution = per_execution;
    }
}

struct Encoder<'a> {
    plan: &'a Plan,
    rank: usize,
    nvls_allowed: bool,
}

impl Encoder<'_> {
    /// The pipeline's head: how many ops follow, and its iteration context in `ids`.
    fn pipeline(&self, enc: &mut EncodedPlan, op: &Op, path: &str) -> Result<()> {
        let it = op.iter_context.ok_or_else(|| {
            PlanError::new(
                format!("{path}.iter_context"),
                "pipeline without iter_context",
            )
        })?;
        let mut encoded = PlanOp {
            kind: OpKind::Pipeline as u8,
            tbg_parts: 1,
            ..PlanOp::default()
        };
        let context = [
            it.unit_size as u32,
            (it.unit_size >> 32) as u32,
            it.num_chunks,
        ];
        self.ids(enc, &mut encoded, &context, path)?;
        encoded.nids = narrow(op.ops.len() as u32, path, "ops")?;
        enc.ops.push(encoded);
        Ok(())
    }

    fn op(&self, enc: &mut EncodedPlan, t: usize, op: &Op, path: &str) -> Result<()> {
        use OpCode::*;
        // The kernel reduces an op's sources whenever it has several, so a fused put (copy,
        // get) of several pairs runs as one op per pair. Port channels pair them in port_put.
        if op.channel_type != Some(ChannelType::Port) {
            if let Some(pairs) = op.pairs() {
                return pairs
                    .iter()
                    .try_for_each(|pair| self.op(enc, t, pair, path));
            }
        }
        let name = format!("{:?}", op.name).to_lowercase();
        let refuse_switch = || {
            let why = if self.nvls_allowed {
                "the GPU interpreter does not run switch-channel (NVLink multicast) ops"
            } else {
                "switch channels need NVLink multicast, which is off (the NVLS gate is closed)"
            };
            PlanError::new(path, format!("{name}: {why}"))
        };
        let channel_type = op.channel_type.unwrap_or(ChannelType::Memory);
        let port = channel_type == ChannelType::Port;
        match channel_type {
            ChannelType::Port => {
                if !matches!(
                    op.name,
                    Put | Pws
                        | Pwsf
                        | Ppkt
                        | Rppkt
                        | Signal
                        | Rlxsignal
                        | Wait
                        | Rlxwait
                        | Flush
                        | Nop
                ) {
                    return Err(PlanError::new(
                        path,
                        format!(
                            "{name} over port channels: the GPU interpreter runs put, pws, pwsf, \
                             ppkt, rppkt, signal, wait and flush on port channels"
                        ),
                    ));
                }
            }
            ChannelType::Switch => return Err(refuse_switch()),
            ChannelType::Memory | ChannelType::None => {}
        }
        let mut encoded = PlanOp {
            tbg_parts: 1,
            flags: if port { FLAG_PORT } else { 0 },
            ..PlanOp::default()
        };
        let kind = match op.name {
            Nop | Pipeline => OpKind::Nop,
            Barrier => {
                let id = op.barrier_id.unwrap_or_default();
                enc.barriers = enc.barriers.max(id + 1);
                let tbs = op
                    .num_threadblocks
                    .unwrap_or(self.plan.gpus[self.rank].threadblocks.len() as u32);
                encoded.barrier_tbs = narrow(tbs, path, "num_threadblocks")?;
                self.ids(enc, &mut encoded, &[id], path)?;
                OpKind::Barrier
            }
            Flush if port => {
                let ids = self.channels(t, op, ChannelType::Port, path)?;
                self.ids(enc, &mut encoded, &ids, path)?;
                OpKind::Flush
            }
            Signal | Rlxsignal | Wait | Rlxwait => {
                let ids = self.channels(t, op, channel_type, path)?;
                self.ids(enc, &mut encoded, &ids, path)?;
                match op.name {
                    Signal => OpKind::Signal,
                    Rlxsignal => OpKind::RelaxedSignal,
                    Wait => OpKind::Wait,
                    _ => OpKind::RelaxedWait,
                }
            }
            Flush => OpKind::Flush,
            SemRelease | SemAcquire => {
                self.ids(enc, &mut encoded, &op.semaphore_ids, path)?;
                if op.name == SemRelease {
                    OpKind::SemRelease
                } else {
                    OpKind::SemAcquire
                }
            }
            Glres | Gstore | Gstorepkt => return Err(refuse_switch()),
            Put | Ppkt | Rppkt | Pws | Pwsf | Get | Copy | Cpkt | Upkt | Re | Repkt | Recpkt
            | Res | Respkt | Recspkt | Rre | Rres => {
                if op.src_buff.is_empty() || op.dst_buff.is_empty() {
                    OpKind::Nop
                } else {
                    encoded.nsrc = narrow(op.src_buff.len() as u32, path, "src_buff")?;
                    encoded.ndst = narrow(op.dst_buff.len() as u32, path, "dst_buff")?;
                    encoded.first_ref = enc.refs.len() as u32;
                    for (list, refs) in [("src_buff", &op.src_buff), ("dst_buff", &op.dst_buff)] {
                        for (i, r) in refs.iter().enumerate() {
                            let r_path = format!("{path}.{list}[{i}]");
                            enc.refs.push(self.buffer_ref(t, channel_type, r, &r_path)?);
                        }
                    }
                    if let Some(g) = op.tbg_info {
                        encoded.tbg_part = narrow(g.tb_id, path, "tbg_info.tb_id")?;
                        encoded.tbg_parts = narrow(g.tbg_size, path, "tbg_info.tbg_size")?;
                    }
                    if port {
                        self.port_put(enc, &mut encoded, t, op, path)?;
                    }
                    if matches!(op.name, Pws | Pwsf) {
                        if !port {
                            let ids = self.channels(t, op, channel_type, path)?;
                            self.ids(enc, &mut encoded, &ids, path)?;
                        }
                        encoded.flags |= FLAG_SIGNAL_AFTER;
                        if op.name == Pwsf {
                            encoded.flags |= FLAG_FLUSH_AFTER;
                        }
                    }
                    OpKind::Data
                }
            }
        };
        encoded.kind = kind as u8;
        enc.ops.push(encoded);
        Ok(())
    }

    /// The op's channels as global channel indices of type `ty`.
    fn channels(&self, t: usize, op: &Op, ty: ChannelType, path: &str) -> Result<Vec<u32>> {
        let tb = &self.plan.gpus[self.rank].threadblocks[t];
        op.channel_ids
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                tb.channel(ty, id).ok_or_else(|| {
                    PlanError::new(
                        format!("{path}.channel_ids[{i}]"),
                        format!("{} channel {id} is not one of the threadblock's", ty.name()),
                    )
                })
            })
            .collect()
    }

    /// A put over port channels: destination d goes through channel d, from source d (or the
    /// only source). The proxy copies bytes as they are: put / pws / pwsf move plain data, ppkt /
    /// rppkt move LL packets from packet buffer to packet buffer (MSCCL++'s reading of them).
    fn port_put(
        &self,
        enc: &mut EncodedPlan,
        encoded: &mut PlanOp,
        t: usize,
        op: &Op,
        path: &str,
    ) -> Result<()> {
        let name = format!("{:?}", op.name).to_lowercase();
        let (nsrc, ndst) = (op.src_buff.len(), op.dst_buff.len());
        if nsrc != 1 && nsrc != ndst {
            return Err(PlanError::new(
                format!("{path}.src_buff"),
                format!("{name} over port channels: {nsrc} sources for {ndst} destinations (one, or one per destination)"),
            ));
        }
        let refs = &enc.refs[encoded.first_ref as usize..][..nsrc + ndst];
        let packets = matches!(op.name, OpCode::Ppkt | OpCode::Rppkt);
        if let Some(i) = refs.iter().position(|r| (r.packets != 0) != packets) {
            let (list, at) = if i < nsrc {
                ("src_buff", i)
            } else {
                ("dst_buff", i - nsrc)
            };
            let why = if packets {
                "moves LL packets, from and into buffers that hold them (an LL plan's scratch)"
            } else {
                "moves plain data, not LL packets"
            };
            return Err(PlanError::new(
                format!("{path}.{list}[{at}]"),
                format!("{name} over port channels {why}"),
            ));
        }
        // The proxy copies from this rank's memory into the channel's peer's.
        if let Some(i) = refs[..nsrc]
            .iter()
            .position(|r| r.slot >= FIRST_REMOTE_SLOT)
        {
            return Err(PlanError::new(
                format!("{path}.src_buff[{i}]"),
                format!("{name} over port channels reads a local buffer, not a peer's"),
            ));
        }
        let ids = self.channels(t, op, ChannelType::Port, path)?;
        if ids.len() != ndst {
            return Err(PlanError::new(
                format!("{path}.channel_ids"),
                format!("{name} over port channels: {} channels for {ndst} destinations (one per destination)", ids.len()),
            ));
        }
        for (d, r) in refs[nsrc..].iter().enumerate() {
            let dst_path = format!("{path}.dst_buff[{d}]");
            let Some(k) = r.slot.checked_sub(FIRST_REMOTE_SLOT) else {
                return Err(PlanError::new(
                    dst_path,
                    format!("{name} over port channels writes a peer's buffer, not a local one"),
                ));
            };
            let owner = enc.remote_buffers.get(k as usize).map(|b| b.0);
            let peer = enc.port_channel_peers.get(ids[d] as usize).copied();
            if owner != peer {
                let (owner, peer) = (owner.unwrap_or(usize::MAX), peer.unwrap_or(usize::MAX));
                return Err(PlanError::new(
                    dst_path,
                    format!("a buffer of rank {owner} through channel_ids[{d}], a port channel to rank {peer}"),
                ));
            }
        }
        self.ids(enc, encoded, &ids, path)
    }

    fn ids(&self, enc: &mut EncodedPlan, op: &mut PlanOp, ids: &[u32], path: &str) -> Result<()> {
        op.first_id = enc.ids.len() as u32;
        op.nids = narrow(ids.len() as u32, path, "ids")?;
        enc.ids.extend_from_slice(ids);
        Ok(())
    }

    fn buffer_ref(
        &self,
        t: usize,
        channel_type: ChannelType,
        r: &BufferRef,
        path: &str,
    ) -> Result<PlanRef> {
        let gpu = &self.plan.gpus[self.rank];
        let (slot, buffer) = if let Some(ty) = r.buffer_type {
            let slot = match ty {
                BufferType::Input => SLOT_INPUT,
                BufferType::Output => SLOT_OUTPUT,
                BufferType::Scratch => SLOT_SCRATCH,
            };
            (slot, ty)
        } else if let Some(id) = r.buffer_id {
            let global = gpu.threadblocks[t]
                .remote_buffer(channel_type, id)
                .ok_or_else(|| {
                    PlanError::new(
                        path,
                        format!("remote buffer {id} is not one of the threadblock's"),
                    )
                })?;
            let rb = &gpu.remote_buffers[global as usize];
            (FIRST_REMOTE_SLOT + global as u16, rb.buffer_type)
        } else {
            let what = format!(
                "{path}: switch channel buffer{}",
                if self.nvls_allowed {
                    ": the GPU interpreter does not run switch-channel (NVLink multicast) ops"
                } else {
                    ": switch channels need NVLink multicast, which is off (the NVLS gate is closed)"
                }
            );
            return Err(PlanError::new(path, what));
        };
        Ok(PlanRef {
            slot,
            packets: self.plan.holds_packets(buffer) as u16,
            index: r.index,
            size: r.size,
        })
    }
}

fn narrow<T: TryFrom<u32>>(v: u32, path: &str, what: &str) -> Result<T> {
    T::try_from(v).map_err(|_| {
        PlanError::new(
            format!("{path}.{what}"),
            format!("{v} is more than the GPU interpreter encodes"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder;
    use crate::plan::PlanReduceOp;

    #[test]
    fn builder_plans_encode_at_8_ranks() {
        for protocol in [Protocol::Simple, Protocol::Ll] {
            let json = builder::allreduce(8, protocol, PlanReduceOp::Max);
            let plan = Plan::from_json(json.to_string().as_bytes()).expect("valid");
            for rank in 0..8 {
                let enc = encode(&plan, rank, false).expect("encodes");
                assert_eq!(enc.threadblocks(), 1);
                assert_eq!(enc.channel_peers.len(), 7);
                let data = enc.ops.iter().filter(|o| o.kind == OpKind::Data as u8);
                assert!(data.count() > 0);
            }
        }
    }

    /// Replicas meet only where the kernel's `Replicas` makes them: around signals, waits and
    /// flushes, and between data cut two ways in one threadblock; nops are the block's own.
    #[test]
    fn replicas_meet_at_synchronisation_and_between_cuts_only() {
        let op = |kind: OpKind, cut: (u16, u16)| PlanOp {
            kind: kind as u8,
            tbg_part: cut.0,
            tbg_parts: cut.1,
            ..PlanOp::default()
        };
        let replication = |tbs: &[&[PlanOp]]| {
            let mut enc = EncodedPlan {
                tb_ops: vec![0],
                ..EncodedPlan::default()
            };
            for ops in tbs {
                enc.ops.extend_from_slice(ops);
                enc.tb_ops.push(enc.ops.len() as u32);
            }
            enc.replication()
        };
        let (data, nop) = (op(OpKind::Data, (0, 1)), op(OpKind::Nop, (0, 1)));
        use Replication::*;
        assert_eq!(replication(&[&[data, nop, data, nop]]), Free);
        // Two threadblocks each cut one way (a group's members) never meet.
        let (half0, half1) = (op(OpKind::Data, (0, 2)), op(OpKind::Data, (1, 2)));
        assert_eq!(replication(&[&[half0, half0], &[half1]]), Free);
        assert_eq!(replication(&[&[half0, nop, data]]), Synced);
        for sync in [OpKind::Signal, OpKind::RelaxedWait, OpKind::Flush] {
            assert_eq!(replication(&[&[data], &[op(sync, (0, 1))]]), Synced);
        }
        let signal_after = PlanOp {
            flags: FLAG_SIGNAL_AFTER,
            ..data
        };
        assert_eq!(replication(&[&[signal_after]]), Synced);
        let port = PlanOp {
            flags: FLAG_PORT,
            ..data
        };
        assert_eq!(replication(&[&[data], &[port]]), Never);
        assert_eq!(replication(&[&[op(OpKind::Barrier, (0, 1))]]), Never);
    }

    /// A wait is counted where its channels are waited on by its threadblock alone, outside
    /// pipelines, each channel once, at one place in every channel's waits; otherwise it and every
    /// channel it names keep the `expected` counter.
    #[test]
    fn waits_are_counted_where_their_channels_are_one_threadblocks_alone() {
        let mut enc = EncodedPlan {
            tb_ops: vec![0],
            channel_peers: vec![1; 8],
            ..EncodedPlan::default()
        };
        let mut tb = |ops: &[(OpKind, u8, &[u32])]| {
            for &(kind, flags, ids) in ops {
                enc.ops.push(PlanOp {
                    kind: kind as u8,
                    flags,
                    nids: ids.len() as u16,
                    first_id: enc.ids.len() as u32,
                    tbg_parts: 1,
                    ..PlanOp::default()
                });
                enc.ids.extend_from_slice(ids);
            }
            enc.tb_ops.push(enc.ops.len() as u32);
        };
        use OpKind::*;
        // 0..3: channel 0 twice; channel 1 shared with threadblock 1; channels 2 and 3 at
        // different places (3 is waited on twice); 6 relaxed.
        tb(&[
            (Wait, 0, &[0]),
            (Data, 0, &[]),
            (Wait, 0, &[0]),
            (Wait, 0, &[1]),
        ]);
        tb(&[
            (Wait, 0, &[1]),
            (Wait, 0, &[2, 3]),
            (Wait, 0, &[3]),
            (RelaxedWait, 0, &[6]),
        ]);
        // A wait in a pipeline (its head's nids: the one op after it); a port channel's wait; a
        // channel named twice in one wait.
        tb(&[(Pipeline, 0, &[0]), (Wait, 0, &[4])]);
        tb(&[(Wait, FLAG_PORT, &[0]), (Wait, 0, &[5, 5])]);
        count_waits(&mut enc);
        // (op, wait_index, waits_per_execution) of the counted waits.
        let counted: Vec<(usize, u16, u16)> = (0..enc.ops.len())
            .filter(|&o| enc.ops[o].waits_per_execution != 0)
            .map(|o| (o, enc.ops[o].wait_index, enc.ops[o].waits_per_execution))
            .collect();
        assert_eq!(counted, [(0, 0, 2), (2, 1, 2), (7, 0, 1)]);
    }

    #[test]
    fn features_are_what_the_rank_uses() {
        let features = |json: serde_json::Value| {
            let plan = Plan::from_json(json.to_string().as_bytes()).expect("valid");
            encode(&plan, 1, false).expect("encodes").features()
        };
        let sum = PlanReduceOp::Sum;
        let none = PlanFeatures::default();
        assert_eq!(features(builder::allreduce(2, Protocol::Simple, sum)), none);
        let ll = features(builder::allreduce(2, Protocol::Ll, sum));
        assert_eq!(
            ll,
            PlanFeatures {
                packets: true,
                ..none
            }
        );
        let port = features(builder::port_allreduce(4, Protocol::Simple, sum));
        assert_eq!(
            port,
            PlanFeatures {
                ports: true,
                ..none
            }
        );
        let piped = features(builder::pipelined_allreduce(2, sum, 4096));
        assert!(piped.pipelines && !piped.ports);
    }

    #[test]
    fn group_members_tile_a_chunk_in_whole_units() {
        for (bytes, unit, parts) in [(3, 8, 2), (24, 8, 2), (100, 8, 3), (12, 4, 5), (0, 8, 2)] {
            let mut next = 0;
            for p in 0..parts {
                let (a, b) = part_range(bytes, unit, p, parts);
                assert_eq!(a, next, "{bytes} bytes, part {p} of {parts}");
                assert!(a % unit == 0 && (b % unit == 0 || b == bytes));
                next = b;
            }
            assert_eq!(next, bytes);
        }
    }

    #[test]
    fn port_plans_encode_proxy_puts_with_a_channel_per_destination() {
        for ranks in [2, 4, 8] {
            let json =
                builder::port_allreduce(ranks, Protocol::Simple, PlanReduceOp::Sum).to_string();
            let plan = Plan::from_json(json.as_bytes()).expect("valid");
            let enc = encode(&plan, 1, false).expect("encodes");
            assert_eq!(enc.port_channel_peers.len(), ranks - 1);
            assert!(enc.channel_peers.is_empty());
            let puts: Vec<&PlanOp> = enc
                .ops
                .iter()
                .filter(|o| o.kind == OpKind::Data as u8 && o.flags & FLAG_PORT != 0)
                .collect();
            assert_eq!(puts.len(), 2 * (ranks - 1));
            assert!(puts.iter().all(|o| o.nids == 1 && o.ndst == 1));
            let pwsf = FLAG_PORT | FLAG_SIGNAL_AFTER | FLAG_FLUSH_AFTER;
            assert_eq!(puts.iter().filter(|o| o.flags == pwsf).count(), ranks - 1);
            let flush = enc.ops.iter().find(|o| o.kind == OpKind::Flush as u8);
            assert_eq!(
                flush.map(|o| (o.flags, o.nids)),
                Some((FLAG_PORT, ranks as u16 - 1))
            );
        }
    }

    #[test]
    fn packet_puts_over_port_channels_move_packets_between_packet_buffers() {
        let json = builder::port_allreduce(4, Protocol::Ll, PlanReduceOp::Sum).to_string();
        let plan = Plan::from_json(json.as_bytes()).expect("valid");
        let enc = encode(&plan, 2, false).expect("encodes");
        let puts = enc
            .ops
            .iter()
            .filter(|o| o.kind == OpKind::Data as u8 && o.flags & FLAG_PORT != 0);
        for op in puts {
            let refs = &enc.refs[op.first_ref as usize..][..2];
            assert!(refs.iter().all(|r| r.packets == 1), "{refs:?}");
        }
        // The LL plan over memory channels packs plain input on the fly: not over port channels.
        let memory = builder::allreduce(2, Protocol::Ll, PlanReduceOp::Sum).to_string();
        let plan =
            Plan::from_json(memory.replace("\"memory\"", "\"port\"").as_bytes()).expect("valid");
        let err = encode(&plan, 0, false).unwrap_err().to_string();
        assert!(
            err.contains("src_buff[0]: ppkt over port channels moves LL packets"),
            "{err}"
        );
    }

    #[test]
    fn threadblock_programs_beyond_the_shared_memory_are_refused_naming_the_threadblock() {
        let json = builder::allreduce(2, Protocol::Simple, PlanReduceOp::Sum);
        let with_nops = |nops: usize| {
            let mut v = json.clone();
            let ops = v["gpus"][1]["threadblocks"][0]["ops"]
                .as_array_mut()
                .unwrap();
            ops.extend(std::iter::repeat_n(
                serde_json::json!({"name": "nop"}),
                nops,
            ));
            Plan::from_json(v.to_string().as_bytes()).expect("valid")
        };
        let fits = MAX_SHARED_PROGRAM_BYTES / size_of::<PlanOp>() / 2;
        let enc = encode(&with_nops(fits), 1, false).expect("fits");
        assert!(enc.largest_program_bytes() <= MAX_SHARED_PROGRAM_BYTES);
        let too_many = MAX_SHARED_PROGRAM_BYTES / size_of::<PlanOp>() + 1;
        let err = encode(&with_nops(too_many), 1, false)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("gpus[1].threadblocks[0]"), "{err}");
        assert!(err.contains("49152 bytes of shared memory"), "{err}");
        // Rank 0's threadblocks are as they were.
        assert!(encode(&with_nops(too_many), 0, false).is_ok());
    }

    #[test]
    fn port_channel_ops_the_interpreter_lacks_are_refused_naming_the_op() {
        let json = builder::allreduce(2, Protocol::Simple, PlanReduceOp::Sum).to_string();
        // A copy over port channels: MSCCL++ runs local copies without a channel.
        let json = json.replacen("\"memory\"", "\"port\"", usize::MAX);
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["gpus"][0]["threadblocks"][0]["ops"][0] = serde_json::json!({
            "name": "copy", "channel_type": "port", "channel_ids": [0],
            "src_buff": [{"type": "i", "index": 0, "size": 1}],
            "dst_buff": [{"type": "i", "index": 0, "size": 1}]});
        let plan = Plan::from_json(v.to_string().as_bytes()).expect("valid");
        let err = encode(&plan, 0, false).unwrap_err().to_string();
        assert!(err.starts_with("gpus[0].threadblocks[0].ops[0]"), "{err}");
        assert!(err.contains("copy over port channels"), "{err}");
        // A put over port channels without a channel per destination.
        let json = builder::port_allreduce(2, Protocol::Simple, PlanReduceOp::Sum).to_string();
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let ops = v["gpus"][1]["threadblocks"][0]["ops"]
            .as_array_mut()
            .unwrap();
        let put = ops.iter().position(|o| o["name"] == "put").unwrap();
        ops[put]["channel_ids"] = serde_json::json!([]);
        let plan = Plan::from_json(v.to_string().as_bytes()).expect("valid");
        let err = encode(&plan, 1, false).unwrap_err().to_string();
        assert!(err.contains(&format!("ops[{put}].channel_ids")), "{err}");
        assert!(err.contains("0 channels for 1 destinations"), "{err}");
        // A put whose destination is local: the proxy only writes into the channel's peer.
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["gpus"][1]["threadblocks"][0]["ops"][put]["dst_buff"] =
            serde_json::json!([{"type": "s", "index": 0, "size": 1}]);
        let plan = Plan::from_json(v.to_string().as_bytes()).expect("valid");
        let err = encode(&plan, 1, false).unwrap_err().to_string();
        assert!(err.contains(&format!("ops[{put}].dst_buff[0]")), "{err}");
        assert!(err.contains("writes a peer's buffer"), "{err}");
    }

    #[test]
    fn pipelines_encode_their_context_then_their_ops() {
        let json = builder::allreduce(2, Protocol::Simple, PlanReduceOp::Sum);
        let mut v = json.clone();
        let ops = v["gpus"][0]["threadblocks"][0]["ops"]
            .as_array_mut()
            .unwrap();
        let inner: Vec<serde_json::Value> = ops.drain(2..4).collect();
        ops.insert(
            2,
            serde_json::json!({"name": "pipeline",
            "iter_context": {"unit_size": (5u64 << 32) + 64, "num_chunks": 1}, "ops": inner}),
        );
        let plan = Plan::from_json(v.to_string().as_bytes()).expect("valid");
        let enc = encode(&plan, 0, false).expect("encodes");
        let head = enc.ops[2];
        assert_eq!(head.kind, OpKind::Pipeline as u8);
        assert_eq!(head.nids, 2);
        let at = head.first_id as usize;
        assert_eq!(&enc.ids[at..at + 3], &[64, 5, 1]);
        let plain = encode(
            &Plan::from_json(json.to_string().as_bytes()).unwrap(),
            0,
            false,
        )
        .unwrap();
        assert_eq!(enc.ops.len(), plain.ops.len() + 1);
        assert_eq!(pipeline_iterations(2, 4, units_per_iteration(16, 8)), 4);
        assert_eq!(pipeline_iterations(1, 3, units_per_iteration(4, 8)), 3);
    }
}
