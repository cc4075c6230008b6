//! The compact op encoding the GPU interpreter (`kernels-cu/src/kernels/executor.cu`) walks, built
//! once per (plan, rank) from a validated plan.
//!
//! Every data-moving op code becomes one [`OpKind::Data`] (sources read, reduced with the plan's
//! op, written to every destination), which is how the CPU reference ([`crate::reference`]) runs
//! them too; both resolve channels, remote buffers and packet buffers through the same plan
//! methods (`Threadblock::channel`, `Threadblock::remote_buffer`, `Plan::holds_packets`). A
//! `pipeline` runs its ops once over whole chunks, as the reference does.
//!
//! What the interpreter does not run is refused here, with the op's JSON path: port-channel ops
//! (the interpreter drives memory channels only) and switch-channel ops (NVLink multicast, only
//! behind the NVLS gate, and not run by the interpreter even then).

use crate::error::{PlanError, Result};
use crate::plan::{BufferRef, BufferType, ChannelType, Op, OpCode, Plan, Protocol};
use mscclpp_kernels_cu::executor::{
    OpKind, PlanOp, PlanRef, FIRST_REMOTE_SLOT, FLAG_FLUSH_AFTER, FLAG_SIGNAL_AFTER,
    MAX_PLAN_BUFFERS, SLOT_INPUT, SLOT_OUTPUT, SLOT_SCRATCH,
};

/// One rank's plan as the interpreter reads it, plus what the host must set up for it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EncodedPlan {
    pub ops: Vec<PlanOp>,
    /// Threadblock `b`'s ops are `ops[tb_ops[b]..tb_ops[b + 1]]`.
    pub tb_ops: Vec<u32>,
    pub refs: Vec<PlanRef>,
    /// Channel (global memory-channel index), semaphore and barrier ids of the ops.
    pub ids: Vec<u32>,
    /// The peer of every memory channel of this rank, by global index.
    pub channel_peers: Vec<usize>,
    /// Initial values of the local semaphores.
    pub semaphores: Vec<u32>,
    /// Barrier ids used: `0..barriers`.
    pub barriers: u32,
    /// The remote buffer at slot `FIRST_REMOTE_SLOT + k`: (rank, buffer).
    pub remote_buffers: Vec<(usize, BufferType)>,
}

impl EncodedPlan {
    pub fn threadblocks(&self) -> usize {
        self.tb_ops.len().saturating_sub(1)
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
        channel_peers: gpu.channel_peers(ChannelType::Memory),
        semaphores: gpu.semaphores.iter().map(|s| s.init_value).collect(),
        remote_buffers: gpu
            .remote_buffers
            .iter()
            .map(|rb| (rb.rank as usize, rb.buffer_type))
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
            let op_path = format!("{path}.threadblocks[{t}].ops[{o}]");
            if op.name == OpCode::Pipeline {
                for (i, inner) in op.ops.iter().enumerate() {
                    encoder.op(&mut enc, t, inner, &format!("{op_path}.ops[{i}]"))?;
                }
            } else {
                encoder.op(&mut enc, t, op, &op_path)?;
            }
        }
        enc.tb_ops.push(enc.ops.len() as u32);
    }
    Ok(enc)
}

struct Encoder<'a> {
    plan: &'a Plan,
    rank: usize,
    nvls_allowed: bool,
}

impl Encoder<'_> {
    fn op(&self, enc: &mut EncodedPlan, t: usize, op: &Op, path: &str) -> Result<()> {
        use OpCode::*;
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
        match channel_type {
            ChannelType::Port => {
                return Err(PlanError::new(
                    path,
                    format!(
                        "{name} over port channels: the GPU interpreter drives memory channels \
                         only (this plan runs on the CPU reference, not on the GPU)"
                    ),
                ))
            }
            ChannelType::Switch => return Err(refuse_switch()),
            ChannelType::Memory | ChannelType::None => {}
        }
        let mut encoded = PlanOp {
            tbg_parts: 1,
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
            Signal | Rlxsignal | Wait | Rlxwait => {
                let ids = self.channels(t, op, path)?;
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
                    if matches!(op.name, Pws | Pwsf) {
                        let ids = self.channels(t, op, path)?;
                        self.ids(enc, &mut encoded, &ids, path)?;
                        encoded.flags = FLAG_SIGNAL_AFTER;
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

    /// The op's channels as global memory-channel indices.
    fn channels(&self, t: usize, op: &Op, path: &str) -> Result<Vec<u32>> {
        let tb = &self.plan.gpus[self.rank].threadblocks[t];
        op.channel_ids
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                tb.channel(ChannelType::Memory, id).ok_or_else(|| {
                    PlanError::new(
                        format!("{path}.channel_ids[{i}]"),
                        format!("memory channel {id} is not one of the threadblock's"),
                    )
                })
            })
            .collect()
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
    fn port_channel_ops_are_refused_naming_the_op() {
        let json = builder::allreduce(2, Protocol::Simple, PlanReduceOp::Sum).to_string();
        let plan = Plan::from_json(json.replace("\"memory\"", "\"port\"").as_bytes())
            .expect("a port-channel plan is valid");
        let err = encode(&plan, 0, false).unwrap_err().to_string();
        assert!(err.contains("over port channels"), "{err}");
        assert!(err.starts_with("gpus[0].threadblocks[0].ops[0]"), "{err}");
    }
}
