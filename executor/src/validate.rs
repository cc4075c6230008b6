//! Plan validation: everything the executors index with a plan's numbers is checked here, once, so
//! neither the CPU interpreter nor the GPU kernel can be led out of bounds by a plan.

use crate::error::{PlanError, Result};
use crate::plan::{BufferRef, BufferType, ChannelType, Gpu, Op, OpCode, Plan, Threadblock};

/// Upper bounds that keep device-side tables small; MSCCL++'s own plans stay far below them.
const MAX_RANKS: usize = 1024;
const MAX_THREADBLOCKS: usize = 1024;
const MAX_CHUNKS: u32 = 1 << 16;

/// Checks a parsed plan; the first problem found is returned with its JSON path.
pub fn validate(plan: &Plan) -> Result<()> {
    let world = plan.gpus.len();
    if world == 0 {
        return Err(PlanError::new("gpus", "no GPUs"));
    }
    if world > MAX_RANKS {
        return Err(PlanError::new(
            "gpus",
            format!("{world} GPUs, more than {MAX_RANKS}"),
        ));
    }
    if plan.min_message_size > plan.max_message_size {
        return Err(PlanError::new(
            "min_message_size",
            format!(
                "{} is above max_message_size {}",
                plan.min_message_size, plan.max_message_size
            ),
        ));
    }
    if !plan.buffer_alignment.is_power_of_two() {
        return Err(PlanError::new(
            "buffer_alignment",
            format!("{} is not a power of two", plan.buffer_alignment),
        ));
    }
    let threads = plan.num_threads_per_block;
    if threads == 0 || threads > 1024 || threads % 32 != 0 {
        return Err(PlanError::new(
            "num_threads_per_block",
            format!("{threads} is not a multiple of 32 in 32..=1024"),
        ));
    }
    for (g, gpu) in plan.gpus.iter().enumerate() {
        validate_gpu(plan, g, gpu, &format!("gpus[{g}]"))?;
    }
    Ok(())
}

fn validate_gpu(plan: &Plan, rank: usize, gpu: &Gpu, path: &str) -> Result<()> {
    let world = plan.gpus.len();
    if gpu.id as usize != rank {
        return Err(PlanError::new(
            format!("{path}.id"),
            format!(
                "{} but this is entry {rank}; gpus must be listed by rank",
                gpu.id
            ),
        ));
    }
    for (key, chunks) in [
        ("input_chunks", gpu.input_chunks),
        ("output_chunks", gpu.output_chunks),
        ("scratch_chunks", gpu.scratch_chunks),
    ] {
        if chunks > MAX_CHUNKS {
            return Err(PlanError::new(
                format!("{path}.{key}"),
                format!("{chunks} chunks, more than {MAX_CHUNKS}"),
            ));
        }
    }
    for (c, ch) in gpu.channels.iter().enumerate() {
        let cpath = format!("{path}.channels[{c}]");
        match ch.channel_type {
            ChannelType::Memory | ChannelType::Port => {
                for (i, &peer) in ch.connected_to.iter().enumerate() {
                    check_peer(peer, rank, world, &format!("{cpath}.connected_to[{i}]"))?;
                }
            }
            ChannelType::Switch => {
                if ch.buff.is_none() {
                    return Err(PlanError::new(
                        format!("{cpath}.buff"),
                        "switch channel without a buffer",
                    ));
                }
                if ch.rank_groups.is_empty() {
                    return Err(PlanError::new(
                        format!("{cpath}.rank_groups"),
                        "switch channel without a group",
                    ));
                }
                for (r, group) in ch.rank_groups.iter().enumerate() {
                    let gpath = format!("{cpath}.rank_groups[{r}]");
                    if group.size as usize != group.ranks.len() {
                        return Err(PlanError::new(
                            format!("{gpath}.size"),
                            format!("{} but {} ranks are listed", group.size, group.ranks.len()),
                        ));
                    }
                    for (i, &member) in group.ranks.iter().enumerate() {
                        if member as usize >= world {
                            return Err(PlanError::new(
                                format!("{gpath}.ranks[{i}]"),
                                format!("rank {member} out of range ({world} GPUs)"),
                            ));
                        }
                    }
                }
            }
            ChannelType::None => {
                return Err(PlanError::new(
                    format!("{cpath}.channel_type"),
                    "\"none\" is not a channel",
                ));
            }
        }
    }
    for (b, rb) in gpu.remote_buffers.iter().enumerate() {
        let bpath = format!("{path}.remote_buffers[{b}]");
        check_peer(rb.rank, rank, world, &format!("{bpath}.rank"))?;
    }
    for (s, sem) in gpu.semaphores.iter().enumerate() {
        if sem.init_value > i32::MAX as u32 {
            return Err(PlanError::new(
                format!("{path}.semaphores[{s}].init_value"),
                format!("{} does not fit a device semaphore", sem.init_value),
            ));
        }
    }
    if gpu.threadblocks.len() > MAX_THREADBLOCKS {
        return Err(PlanError::new(
            format!("{path}.threadblocks"),
            format!(
                "{} threadblocks, more than {MAX_THREADBLOCKS}",
                gpu.threadblocks.len()
            ),
        ));
    }
    for (t, tb) in gpu.threadblocks.iter().enumerate() {
        let tpath = format!("{path}.threadblocks[{t}]");
        if tb.id as usize != t {
            return Err(PlanError::new(
                format!("{tpath}.id"),
                format!("{} but this is entry {t}", tb.id),
            ));
        }
        validate_threadblock(plan, gpu, tb, &tpath)?;
    }
    Ok(())
}

fn check_peer(peer: u32, rank: usize, world: usize, path: &str) -> Result<()> {
    if peer as usize >= world {
        return Err(PlanError::new(
            path,
            format!("rank {peer} out of range ({world} GPUs)"),
        ));
    }
    if peer as usize == rank {
        return Err(PlanError::new(
            path,
            format!("rank {peer} is this GPU itself"),
        ));
    }
    Ok(())
}

/// Number of a GPU's channels of one type: the flat index space of threadblock `channel_ids`.
pub fn channel_count(gpu: &Gpu, ty: ChannelType) -> usize {
    gpu.channels
        .iter()
        .filter(|c| c.channel_type == ty)
        .map(|c| {
            if ty == ChannelType::Switch {
                1
            } else {
                c.connected_to.len()
            }
        })
        .sum()
}

fn validate_threadblock(plan: &Plan, gpu: &Gpu, tb: &Threadblock, path: &str) -> Result<()> {
    for (c, tc) in tb.channels.iter().enumerate() {
        let count = channel_count(gpu, tc.channel_type);
        for (i, &id) in tc.channel_ids.iter().enumerate() {
            if id as usize >= count {
                return Err(PlanError::new(
                    format!("{path}.channels[{c}].channel_ids[{i}]"),
                    format!(
                        "channel {id} out of range ({count} {} channels)",
                        tc.channel_type.name()
                    ),
                ));
            }
        }
    }
    for (r, rr) in tb.remote_buffer_refs.iter().enumerate() {
        for (i, &id) in rr.remote_buffer_ids.iter().enumerate() {
            let rpath = format!("{path}.remote_buffer_refs[{r}].remote_buffer_ids[{i}]");
            let Some(rb) = gpu.remote_buffers.get(id as usize) else {
                return Err(PlanError::new(
                    rpath,
                    format!(
                        "remote buffer {id} out of range ({} remote buffers)",
                        gpu.remote_buffers.len()
                    ),
                ));
            };
            if !rb.access_channel_types.is_empty()
                && !rb.access_channel_types.contains(&rr.access_channel_type)
            {
                return Err(PlanError::new(
                    rpath,
                    format!(
                        "remote buffer {id} is not accessible through {} channels",
                        rr.access_channel_type.name()
                    ),
                ));
            }
        }
    }
    let ctx = OpContext { plan, gpu, tb };
    for (o, op) in tb.ops.iter().enumerate() {
        ctx.op(op, &format!("{path}.ops[{o}]"), false)?;
    }
    Ok(())
}

struct OpContext<'a> {
    plan: &'a Plan,
    gpu: &'a Gpu,
    tb: &'a Threadblock,
}

/// What an op may reference, by op code.
struct Shape {
    /// Needs `channel_ids` (signal/wait/flush/put...).
    channels: bool,
    /// Minimum number of src and dst refs.
    src: usize,
    dst: usize,
    semaphores: bool,
}

fn shape(code: OpCode) -> Shape {
    use OpCode::*;
    let s = |channels, src, dst, semaphores| Shape {
        channels,
        src,
        dst,
        semaphores,
    };
    match code {
        Nop | Barrier | Pipeline => s(false, 0, 0, false),
        Signal | Wait | Flush | Rlxsignal | Rlxwait => s(true, 0, 0, false),
        SemRelease | SemAcquire => s(false, 0, 0, true),
        Put | Ppkt | Rppkt | Pws | Pwsf | Get | Copy | Cpkt | Upkt | Gstore | Gstorepkt => {
            s(false, 1, 1, false)
        }
        Re | Repkt | Rre => s(false, 2, 1, false),
        Recpkt | Res | Respkt | Recspkt | Rres => s(false, 2, 1, false),
        Glres => s(false, 1, 1, false),
    }
}

impl OpContext<'_> {
    fn op(&self, op: &Op, path: &str, in_pipeline: bool) -> Result<()> {
        let sh = shape(op.name);
        if op.name == OpCode::Pipeline {
            if in_pipeline {
                return Err(PlanError::new(
                    format!("{path}.name"),
                    "pipeline inside a pipeline",
                ));
            }
            let Some(it) = op.iter_context else {
                return Err(PlanError::new(
                    format!("{path}.iter_context"),
                    "pipeline without iter_context",
                ));
            };
            if it.unit_size == 0 || it.num_chunks == 0 {
                return Err(PlanError::new(
                    format!("{path}.iter_context"),
                    "unit_size and num_chunks must be positive",
                ));
            }
            for (o, inner) in op.ops.iter().enumerate() {
                self.op(inner, &format!("{path}.ops[{o}]"), true)?;
            }
        } else if !op.ops.is_empty() {
            return Err(PlanError::new(
                format!("{path}.ops"),
                "only a pipeline has nested ops",
            ));
        }
        if let Some(tbg) = op.tbg_info {
            if tbg.tbg_size == 0 || tbg.tb_id >= tbg.tbg_size {
                return Err(PlanError::new(
                    format!("{path}.tbg_info.tb_id"),
                    format!("{} out of range (group of {})", tbg.tb_id, tbg.tbg_size),
                ));
            }
        }
        if op.name == OpCode::Barrier {
            let n = op
                .num_threadblocks
                .unwrap_or(self.gpu.threadblocks.len() as u32);
            if n == 0 || n as usize > self.gpu.threadblocks.len() {
                return Err(PlanError::new(
                    format!("{path}.num_threadblocks"),
                    format!(
                        "{n} out of range ({} threadblocks)",
                        self.gpu.threadblocks.len()
                    ),
                ));
            }
        }
        if sh.channels && op.channel_ids.is_empty() {
            return Err(PlanError::new(
                format!("{path}.channel_ids"),
                format!("{:?} needs channels", op.name),
            ));
        }
        if !op.channel_ids.is_empty() || sh.channels {
            let ty = op.channel_type.ok_or_else(|| {
                PlanError::new(
                    format!("{path}.channel_type"),
                    "channel_ids given without a channel_type",
                )
            })?;
            let count = self.tb_channels(ty);
            for (i, &id) in op.channel_ids.iter().enumerate() {
                if id as usize >= count {
                    return Err(PlanError::new(
                        format!("{path}.channel_ids[{i}]"),
                        format!(
                            "channel {id} out of range (threadblock has {count} {} channels)",
                            ty.name()
                        ),
                    ));
                }
            }
        }
        if sh.semaphores && op.semaphore_ids.is_empty() {
            return Err(PlanError::new(
                format!("{path}.semaphore_ids"),
                format!("{:?} needs semaphores", op.name),
            ));
        }
        for (i, &id) in op.semaphore_ids.iter().enumerate() {
            if id as usize >= self.gpu.semaphores.len() {
                return Err(PlanError::new(
                    format!("{path}.semaphore_ids[{i}]"),
                    format!(
                        "semaphore {id} out of range ({} semaphores)",
                        self.gpu.semaphores.len()
                    ),
                ));
            }
        }
        if op.src_buff.len() < sh.src {
            return Err(PlanError::new(
                format!("{path}.src_buff"),
                format!(
                    "{:?} needs at least {} source(s), got {}",
                    op.name,
                    sh.src,
                    op.src_buff.len()
                ),
            ));
        }
        if op.dst_buff.len() < sh.dst {
            return Err(PlanError::new(
                format!("{path}.dst_buff"),
                format!(
                    "{:?} needs at least {} destination(s), got {}",
                    op.name,
                    sh.dst,
                    op.dst_buff.len()
                ),
            ));
        }
        for (i, r) in op.src_buff.iter().enumerate() {
            self.buffer_ref(op, r, &format!("{path}.src_buff[{i}]"))?;
        }
        for (i, r) in op.dst_buff.iter().enumerate() {
            self.buffer_ref(op, r, &format!("{path}.dst_buff[{i}]"))?;
        }
        // Every ref of one op moves the same amount of data.
        if let Some(first) = op.src_buff.first().or(op.dst_buff.first()) {
            for (i, r) in op.src_buff.iter().chain(&op.dst_buff).enumerate() {
                if r.size != first.size {
                    let (list, j) = if i < op.src_buff.len() {
                        ("src_buff", i)
                    } else {
                        ("dst_buff", i - op.src_buff.len())
                    };
                    return Err(PlanError::new(
                        format!("{path}.{list}[{j}].size"),
                        format!(
                            "{} chunks but the op's first buffer has {}",
                            r.size, first.size
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Number of channels of one type the threadblock drives (an op's `channel_ids` index them).
    fn tb_channels(&self, ty: ChannelType) -> usize {
        self.tb
            .channels
            .iter()
            .filter(|c| c.channel_type == ty)
            .map(|c| c.channel_ids.len())
            .sum()
    }

    fn buffer_ref(&self, op: &Op, r: &BufferRef, path: &str) -> Result<()> {
        let kinds = r.buffer_type.is_some() as u8
            + r.buffer_id.is_some() as u8
            + r.switch_channel_id.is_some() as u8;
        if kinds != 1 {
            return Err(PlanError::new(
                path,
                "needs exactly one of type (local), buffer_id (remote) or switch_channel_id",
            ));
        }
        if r.size == 0 {
            return Err(PlanError::new(format!("{path}.size"), "zero chunks"));
        }
        let (owner, buffer): (&Gpu, BufferType) = if let Some(ty) = r.buffer_type {
            (self.gpu, ty)
        } else if let Some(id) = r.buffer_id {
            let ty = op.channel_type.ok_or_else(|| {
                PlanError::new(
                    format!("{path}.buffer_id"),
                    "remote buffer without the op's channel_type",
                )
            })?;
            let ids: Vec<u32> = self
                .tb
                .remote_buffer_refs
                .iter()
                .filter(|rr| rr.access_channel_type == ty)
                .flat_map(|rr| rr.remote_buffer_ids.iter().copied())
                .collect();
            let Some(&global) = ids.get(id as usize) else {
                return Err(PlanError::new(
                    format!("{path}.buffer_id"),
                    format!(
                        "remote buffer {id} out of range (threadblock has {} {} remote buffers)",
                        ids.len(),
                        ty.name()
                    ),
                ));
            };
            // In range: validate_threadblock checked every remote_buffer_ids entry.
            let rb = &self.gpu.remote_buffers[global as usize];
            (&self.plan.gpus[rb.rank as usize], rb.buffer_type)
        } else {
            let id = r.switch_channel_id.unwrap_or_default();
            let count = self.tb_channels(ChannelType::Switch);
            if id as usize >= count {
                return Err(PlanError::new(
                    format!("{path}.switch_channel_id"),
                    format!("switch channel {id} out of range (threadblock has {count})"),
                ));
            }
            let global = self
                .tb
                .channels
                .iter()
                .filter(|c| c.channel_type == ChannelType::Switch)
                .flat_map(|c| c.channel_ids.iter().copied())
                .nth(id as usize)
                .unwrap_or_default();
            let ch = self
                .gpu
                .channels
                .iter()
                .filter(|c| c.channel_type == ChannelType::Switch)
                .nth(global as usize);
            // validate_gpu requires `buff` on every switch channel.
            let ty = ch.and_then(|c| c.buff).unwrap_or(BufferType::Input);
            (self.gpu, ty)
        };
        let chunks = self.buffer_chunks(owner, buffer);
        let end = r.index as u64 + r.size as u64;
        if end > chunks as u64 {
            let what = if r.index >= chunks {
                "chunk"
            } else {
                "chunks up to"
            };
            let shown = if r.index >= chunks {
                r.index
            } else {
                (end - 1) as u32
            };
            return Err(PlanError::new(
                format!("{path}.index"),
                format!(
                    "{what} {shown} out of range ({chunks} {} chunks)",
                    buffer.name()
                ),
            ));
        }
        Ok(())
    }

    /// Chunks of a buffer; an in-place plan's output is its input, so output refs may use input's
    /// chunk count when the plan lists no output chunks.
    fn buffer_chunks(&self, gpu: &Gpu, buffer: BufferType) -> u32 {
        if self.plan.inplace && buffer == BufferType::Output && gpu.output_chunks == 0 {
            gpu.input_chunks
        } else {
            gpu.chunks(buffer)
        }
    }
}
