//! The plan model: one Rust type per object of MSCCL++'s JSON execution-plan format, and the parser.
//!
//! The parser walks the document level by level (plan, gpu, threadblock, op) so that a type or key
//! error is reported with the JSON path of the object it is in, not only serde's line and column.
//! Keys MSCCL++ does not read are ignored, as MSCCL++ does, so plans from newer DSL versions load.

use crate::error::{PlanError, Result};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};
use std::path::Path;

/// Plans larger than this are refused before parsing: a plan is a few hundred KiB at most, and a
/// hostile file must not make us allocate without bound.
pub const MAX_PLAN_BYTES: usize = 64 << 20;
/// Nesting MSCCL++ plans use is 6 levels (plan, gpus, threadblocks, ops, pipeline ops, buffers).
const MAX_DEPTH: usize = 16;

/// The collective a plan computes (the `collective` key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Collective {
    Allreduce,
    Allgather,
    Reducescatter,
    Alltoall,
    Broadcast,
    Reduce,
    Sendrecv,
}

impl Collective {
    /// The JSON spelling (`allreduce`), which is also MSCCL++'s collective name.
    pub fn name(self) -> &'static str {
        match self {
            Collective::Allreduce => "allreduce",
            Collective::Allgather => "allgather",
            Collective::Reducescatter => "reducescatter",
            Collective::Alltoall => "alltoall",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::Sendrecv => "sendrecv",
        }
    }
}

/// `protocol`: `Simple` moves data then signals; `LL` packs a flag next to every 4 (LL8) or 8 (LL16)
/// bytes of data so the receiver polls the data itself. `LL8`/`LL16` name the packet size explicitly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Protocol {
    Simple,
    #[serde(rename = "LL")]
    Ll,
    #[serde(rename = "LL8")]
    Ll8,
    #[serde(rename = "LL16")]
    Ll16,
}

/// Which buffer of a rank a chunk reference points into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
pub enum BufferType {
    #[serde(rename = "i")]
    Input,
    #[serde(rename = "o")]
    Output,
    #[serde(rename = "s")]
    Scratch,
}

impl BufferType {
    pub fn name(self) -> &'static str {
        match self {
            BufferType::Input => "input",
            BufferType::Output => "output",
            BufferType::Scratch => "scratch",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChannelType {
    Memory,
    Port,
    Switch,
    None,
}

impl ChannelType {
    pub fn name(self) -> &'static str {
        match self {
            ChannelType::Memory => "memory",
            ChannelType::Port => "port",
            ChannelType::Switch => "switch",
            ChannelType::None => "none",
        }
    }
}

/// `reduce_op` of a reducing op. MSCCL++ ignores it (every plan sums); we honour it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PlanReduceOp {
    #[default]
    Sum,
    Min,
    Max,
    Prod,
}

/// The 30 op codes of MSCCL++'s executor, by their JSON names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpCode {
    Nop,
    Barrier,
    /// Simple put to a peer's buffer.
    Put,
    /// Put as LL packets (source is plain data).
    Ppkt,
    /// Put of packets already in packet form (read packets, forward them).
    Rppkt,
    /// Put with signal.
    Pws,
    /// Put with signal and flush.
    Pwsf,
    Get,
    Copy,
    /// Copy plain data into packet form.
    Cpkt,
    /// Unpack packets into plain data.
    Upkt,
    Signal,
    Wait,
    Flush,
    /// Read-reduce: dst = `src[0]` (op) every further src.
    Re,
    /// Reduce packets into plain data.
    Repkt,
    /// Reduce plain + packets, write plain result and packet copies.
    Recpkt,
    /// Reduce and send (put result to remote dsts).
    Res,
    /// Reduce packets and send as packets.
    Respkt,
    /// Reduce, copy as packet, send packets.
    Recspkt,
    /// Read-reduce with remote sources.
    Rre,
    /// Read-reduce remote sources and send.
    Rres,
    /// Multimem (switch) load-reduce then store.
    Glres,
    Rlxsignal,
    Rlxwait,
    /// Loop of nested ops over `iter_context`.
    Pipeline,
    SemRelease,
    SemAcquire,
    /// Multimem (switch) store.
    Gstore,
    Gstorepkt,
}

impl OpCode {
    pub const ALL: [OpCode; 30] = [
        OpCode::Nop,
        OpCode::Barrier,
        OpCode::Put,
        OpCode::Ppkt,
        OpCode::Rppkt,
        OpCode::Pws,
        OpCode::Pwsf,
        OpCode::Get,
        OpCode::Copy,
        OpCode::Cpkt,
        OpCode::Upkt,
        OpCode::Signal,
        OpCode::Wait,
        OpCode::Flush,
        OpCode::Re,
        OpCode::Repkt,
        OpCode::Recpkt,
        OpCode::Res,
        OpCode::Respkt,
        OpCode::Recspkt,
        OpCode::Rre,
        OpCode::Rres,
        OpCode::Glres,
        OpCode::Rlxsignal,
        OpCode::Rlxwait,
        OpCode::Pipeline,
        OpCode::SemRelease,
        OpCode::SemAcquire,
        OpCode::Gstore,
        OpCode::Gstorepkt,
    ];
}

/// A run of `size` chunks starting at chunk `index`, in exactly one of: a local buffer (`type`), a
/// peer's buffer reached through the threadblock's remote-buffer refs (`buffer_id`), or the multicast
/// buffer of a switch channel (`switch_channel_id`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct BufferRef {
    #[serde(rename = "type")]
    pub buffer_type: Option<BufferType>,
    pub buffer_id: Option<u32>,
    pub switch_channel_id: Option<u32>,
    pub index: u32,
    pub size: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct TbgInfo {
    pub tb_id: u32,
    pub tbg_size: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct IterContext {
    pub unit_size: u64,
    pub num_chunks: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Op {
    pub name: OpCode,
    #[serde(default)]
    pub src_buff: Vec<BufferRef>,
    #[serde(default)]
    pub dst_buff: Vec<BufferRef>,
    #[serde(default)]
    pub channel_ids: Vec<u32>,
    pub channel_type: Option<ChannelType>,
    pub reduce_op: Option<PlanReduceOp>,
    #[serde(default)]
    pub semaphore_ids: Vec<u32>,
    pub tbg_info: Option<TbgInfo>,
    pub iter_context: Option<IterContext>,
    /// `barrier`: which barrier and how many threadblocks meet at it.
    pub barrier_id: Option<u32>,
    pub num_threadblocks: Option<u32>,
    /// `pipeline`: the ops run once per unit.
    #[serde(skip)]
    pub ops: Vec<Op>,
}

impl Op {
    /// A data op that moves without reducing (put, ppkt, get, copy, cpkt, upkt) and has one
    /// source per destination, split into one op per pair: MSCCL++'s executor moves source d to
    /// destination d (a fused put of several chunks to several peers), it does not combine the
    /// sources. `None` for every other op, which the interpreters run as it is.
    pub fn pairs(&self) -> Option<Vec<Op>> {
        use OpCode::*;
        let n = self.src_buff.len();
        if !matches!(self.name, Put | Ppkt | Get | Copy | Cpkt | Upkt)
            || n < 2
            || n != self.dst_buff.len()
        {
            return None;
        }
        Some(
            (0..n)
                .map(|d| Op {
                    src_buff: vec![self.src_buff[d].clone()],
                    dst_buff: vec![self.dst_buff[d].clone()],
                    channel_ids: self
                        .channel_ids
                        .get(d)
                        .map(|&c| vec![c])
                        .unwrap_or_default(),
                    ..self.clone()
                })
                .collect(),
        )
    }
}

/// One entry of a threadblock's `channels`: which of the GPU's channels of a type it drives; an op's
/// `channel_ids` index this list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TbChannels {
    pub channel_type: ChannelType,
    pub channel_ids: Vec<u32>,
}

/// A threadblock's view of the GPU's remote buffers for one channel type; an op's `buffer_id`
/// indexes `remote_buffer_ids`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RemoteBufferRef {
    pub access_channel_type: ChannelType,
    pub remote_buffer_ids: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Threadblock {
    pub id: u32,
    #[serde(default)]
    pub channels: Vec<TbChannels>,
    #[serde(default)]
    pub remote_buffer_refs: Vec<RemoteBufferRef>,
    #[serde(skip)]
    pub ops: Vec<Op>,
    /// Ops the loader added before and after the plan's own ([`crate::call_bounds`]): `ops`
    /// index `entry + o` is the JSON's op `o`.
    #[serde(skip)]
    pub added: AddedOps,
}

/// How many of a threadblock's ops the loader added at each end ([`crate::call_bounds`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AddedOps {
    pub entry: usize,
    pub exit: usize,
}

impl Threadblock {
    /// Where op `o` of `ops` comes from, for messages: the JSON's op index, or which handshake
    /// the loader added it for.
    pub fn json_op(&self, o: usize) -> std::result::Result<usize, &'static str> {
        if o < self.added.entry {
            Err("the entry handshake")
        } else if o >= self.ops.len() - self.added.exit {
            Err("the exit handshake")
        } else {
            Ok(o - self.added.entry)
        }
    }

    /// The GPU-wide index of this threadblock's `id`-th channel of type `ty` (what an op's
    /// `channel_ids` entry names).
    pub fn channel(&self, ty: ChannelType, id: u32) -> Option<u32> {
        self.channels
            .iter()
            .filter(|c| c.channel_type == ty)
            .flat_map(|c| c.channel_ids.iter())
            .nth(id as usize)
            .copied()
    }

    /// The GPU-wide index (into `remote_buffers`) of this threadblock's `id`-th remote buffer
    /// reached through `ty` channels (what a source or destination's `buffer_id` names).
    pub fn remote_buffer(&self, ty: ChannelType, id: u32) -> Option<u32> {
        self.remote_buffer_refs
            .iter()
            .filter(|rr| rr.access_channel_type == ty)
            .flat_map(|rr| rr.remote_buffer_ids.iter())
            .nth(id as usize)
            .copied()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RankGroup {
    pub size: u32,
    pub ranks: Vec<u32>,
}

/// A GPU's channels of one type: memory/port channels list one peer per channel (`connected_to`);
/// a switch channel binds a buffer to a multicast group (`rank_groups`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Channel {
    pub channel_type: ChannelType,
    #[serde(default)]
    pub connected_to: Vec<u32>,
    #[serde(default, alias = "buffer_type")]
    pub buff: Option<BufferType>,
    #[serde(default)]
    pub rank_groups: Vec<RankGroup>,
}

/// A peer's buffer this GPU accesses directly.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RemoteBuffer {
    pub rank: u32,
    #[serde(rename = "type")]
    pub buffer_type: BufferType,
    #[serde(default)]
    pub access_channel_types: Vec<ChannelType>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct Semaphore {
    pub init_value: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Gpu {
    pub id: u32,
    pub input_chunks: u32,
    pub output_chunks: u32,
    pub scratch_chunks: u32,
    #[serde(default)]
    pub channels: Vec<Channel>,
    #[serde(default)]
    pub remote_buffers: Vec<RemoteBuffer>,
    #[serde(default)]
    pub semaphores: Vec<Semaphore>,
    #[serde(skip)]
    pub threadblocks: Vec<Threadblock>,
}

impl Gpu {
    /// Peers of this GPU's channels of type `ty`, in global channel order. A rank's k-th channel
    /// to a peer pairs with the peer's k-th channel to it.
    pub fn channel_peers(&self, ty: ChannelType) -> Vec<usize> {
        self.channels
            .iter()
            .filter(|c| c.channel_type == ty)
            .flat_map(|c| c.connected_to.iter().map(|&p| p as usize))
            .collect()
    }

    /// Number of chunks of a local buffer type.
    pub fn chunks(&self, buffer: BufferType) -> u32 {
        match buffer {
            BufferType::Input => self.input_chunks,
            BufferType::Output => self.output_chunks,
            BufferType::Scratch => self.scratch_chunks,
        }
    }
}

fn default_alignment() -> u32 {
    16
}
fn default_threads() -> u32 {
    1024
}
fn default_max_size() -> u64 {
    u64::MAX
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Plan {
    pub name: String,
    pub collective: Collective,
    pub protocol: Protocol,
    pub inplace: bool,
    #[serde(default)]
    pub reuse_resources: bool,
    #[serde(default)]
    pub use_double_scratch_buffer: bool,
    #[serde(default = "default_alignment")]
    pub buffer_alignment: u32,
    #[serde(default)]
    pub min_message_size: u64,
    #[serde(default = "default_max_size")]
    pub max_message_size: u64,
    #[serde(default = "default_threads")]
    pub num_threads_per_block: u32,
    #[serde(skip)]
    pub gpus: Vec<Gpu>,
}

impl Plan {
    /// Reads, parses and validates a plan file.
    pub fn load(path: &Path) -> Result<Plan> {
        let len = std::fs::metadata(path)
            .map_err(|e| PlanError::new("", format!("{}: {e}", path.display())))?
            .len();
        if len > MAX_PLAN_BYTES as u64 {
            return Err(PlanError::new(
                "",
                format!(
                    "{}: {len} bytes, larger than the {MAX_PLAN_BYTES}-byte limit",
                    path.display()
                ),
            ));
        }
        let text = std::fs::read(path)
            .map_err(|e| PlanError::new("", format!("{}: {e}", path.display())))?;
        Plan::from_json(&text)
    }

    /// Parses and validates a plan, and adds the handshakes it needs at the boundaries of a call
    /// ([`crate::call_bounds`]).
    pub fn from_json(bytes: &[u8]) -> Result<Plan> {
        let mut plan = Plan::parse(bytes)?;
        crate::validate::validate(&plan)?;
        crate::call_bounds::add_handshakes(&mut plan);
        Ok(plan)
    }

    /// Parses without validating (the validator's tests start from here).
    pub fn parse(bytes: &[u8]) -> Result<Plan> {
        if bytes.len() > MAX_PLAN_BYTES {
            return Err(PlanError::new(
                "",
                format!("plan larger than {MAX_PLAN_BYTES} bytes"),
            ));
        }
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| PlanError::new("", format!("not valid JSON: {e}")))?;
        check_depth(&value, 0)?;
        let (mut doc, gpus): (Plan, _) = split(value, "", "gpus")?;
        doc.gpus = gpus
            .into_iter()
            .enumerate()
            .map(|(g, v)| parse_gpu(v, &format!("gpus[{g}]")))
            .collect::<Result<_>>()?;
        Ok(doc)
    }

    pub fn world_size(&self) -> usize {
        self.gpus.len()
    }

    /// Whether `buffer` holds LL packets: the scratch of an LL plan does, input and output hold
    /// plain data.
    pub fn holds_packets(&self, buffer: BufferType) -> bool {
        self.protocol != Protocol::Simple && buffer == BufferType::Scratch
    }

    /// Whether any GPU uses a switch (NVLink multicast) channel.
    pub fn needs_switch(&self) -> bool {
        self.gpus.iter().any(|g| {
            g.channels
                .iter()
                .any(|c| c.channel_type == ChannelType::Switch)
        })
    }
}

/// serde_json's recursion limit (128) keeps parsing safe; this keeps our recursive walks shallow.
fn check_depth(v: &Value, depth: usize) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(PlanError::new(
            "",
            format!("nested deeper than {MAX_DEPTH} levels"),
        ));
    }
    match v {
        Value::Array(a) => a.iter().try_for_each(|x| check_depth(x, depth + 1)),
        Value::Object(o) => o.values().try_for_each(|x| check_depth(x, depth + 1)),
        _ => Ok(()),
    }
}

/// Deserializes `value` as `T` after taking out its child list `key` (absent = empty for `ops` of
/// non-pipeline ops, required otherwise), which the caller parses with its own path.
fn split<T: DeserializeOwned>(value: Value, path: &str, key: &str) -> Result<(T, Vec<Value>)> {
    let Value::Object(mut map) = value else {
        return Err(PlanError::new(path, "expected a JSON object"));
    };
    let children = take_list(&mut map, path, key)?;
    let parsed = serde_json::from_value(Value::Object(map))
        .map_err(|e| PlanError::new(path, e.to_string()))?;
    Ok((parsed, children))
}

fn take_list(map: &mut Map<String, Value>, path: &str, key: &str) -> Result<Vec<Value>> {
    let child_path = join(path, key);
    match map.remove(key) {
        Some(Value::Array(a)) => Ok(a),
        Some(_) => Err(PlanError::new(child_path, "expected a list")),
        None if key == "ops" && path.contains(".ops[") => Ok(Vec::new()),
        None => Err(PlanError::new(child_path, "missing")),
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn parse_gpu(value: Value, path: &str) -> Result<Gpu> {
    let (mut gpu, tbs): (Gpu, _) = split(value, path, "threadblocks")?;
    gpu.threadblocks = tbs
        .into_iter()
        .enumerate()
        .map(|(t, v)| {
            let tb_path = format!("{path}.threadblocks[{t}]");
            let (mut tb, ops): (Threadblock, _) = split(v, &tb_path, "ops")?;
            tb.ops = parse_ops(ops, &tb_path)?;
            Ok(tb)
        })
        .collect::<Result<_>>()?;
    Ok(gpu)
}

fn parse_ops(ops: Vec<Value>, parent: &str) -> Result<Vec<Op>> {
    ops.into_iter()
        .enumerate()
        .map(|(o, v)| {
            let op_path = format!("{parent}.ops[{o}]");
            let (mut op, nested): (Op, _) = split(v, &op_path, "ops")?;
            op.ops = parse_ops(nested, &op_path)?;
            Ok(op)
        })
        .collect()
}
