//! Host mirrors of the execution-plan interpreter's device data (`kernels/executor.cu`): the
//! kernel's one argument [`PlanArgs`] and the compact op list it walks ([`PlanOp`], [`PlanRef`]),
//! which `mscclpp-executor` encodes once per plan from the validated JSON. Layouts are checked
//! against the CUDA declarations by the static_asserts [`layout_asserts`] generates (appended to
//! the unit by the NVRTC tests).
//!
//! The unit is specialised per (data type, accumulation type, reduce op) by `#define`s put in
//! front, as the reducing collective units are, so a plan compiles only the variant it runs.

use crate::collectives::{cxx_type, resolve_accumulator};
use crate::fused_ops::{self, FusedGroup, FUSED_MAX_SRCS};
use mscclpp_core::{AccumType, DataType, ReduceOp, Result};
use std::mem::{offset_of, size_of};

/// The interpreter kernel's source (without the specialising `#define`s).
pub const SOURCE: &str = include_str!("kernels/executor.cu");

/// The interpreter's entry point: one block per plan threadblock, one launch per execution.
pub const ENTRY: &str = "plan_execute";

/// Buffers one rank's ops can name: input, output, scratch, then the plan's remote buffers
/// (`kMaxPlanBuffers`).
pub const MAX_PLAN_BUFFERS: usize = 32;
/// Slots of [`PlanArgs::buffers`] before the remote buffers.
pub const SLOT_INPUT: u16 = 0;
pub const SLOT_OUTPUT: u16 = 1;
pub const SLOT_SCRATCH: u16 = 2;
pub const FIRST_REMOTE_SLOT: u16 = 3;
/// Most blocks a plan threadblock runs as ([`PlanArgs::replicas`], `kMaxReplicas`).
pub const MAX_REPLICAS: u32 = 64;
/// `u32` words of [`PlanArgs::flags`] per plan threadblock (`kTbWords`): a counter slot per
/// replica, then a `u64` arrival stamp per replica (where the replicas meet).
pub const TB_WORDS: usize = MAX_REPLICAS as usize * 3;
/// Most threads a block of the interpreter has (`kMaxBlockThreads`, its launch bound: each thread
/// may use 128 registers, so a block of them takes a whole SM's registers).
pub const MAX_BLOCK_THREADS: u32 = 512;

/// What the kernel does for one op (`PlanOp::kind`). Every data-moving op code of the plan format
/// is one [`OpKind::Data`]: read every source (waiting for LL packets), reduce them with the
/// plan's op, write the result to every destination (as packets where the destination holds
/// packets) — the same reading the CPU reference gives them.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// A block-wide sync point and nothing else (`nop`).
    Nop = 0,
    Data = 1,
    Signal = 2,
    RelaxedSignal = 3,
    Wait = 4,
    RelaxedWait = 5,
    Flush = 6,
    SemRelease = 7,
    SemAcquire = 8,
    Barrier = 9,
    /// `pipeline`: the next `nids` ops run once per iteration over a window of their units;
    /// `ids[first_id..]` holds unit_size (low and high word) and num_chunks.
    Pipeline = 10,
}

/// `PlanOp::flags`: after the data, signal the op's channels (`pws`, `pwsf`)...
pub const FLAG_SIGNAL_AFTER: u8 = 1;
/// ... and flush first (`pwsf`; over port channels: flush after the signal).
pub const FLAG_FLUSH_AFTER: u8 = 2;
/// The op's channels are port channels: a data op is a put through the proxy (the `ids` are one
/// port channel per destination), signal / wait / flush use port channels.
pub const FLAG_PORT: u8 = 4;

/// One op as the kernel reads it: `nsrc` then `ndst` [`PlanRef`]s from `first_ref`, `nids`
/// channel / semaphore / barrier ids from `first_id`, and the op's part of every chunk when a
/// threadblock group shares it (`tbg_part` of `tbg_parts`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlanOp {
    pub kind: u8,
    pub flags: u8,
    pub nsrc: u8,
    pub ndst: u8,
    pub nids: u16,
    pub tbg_part: u16,
    pub tbg_parts: u16,
    /// `barrier`: how many threadblocks meet.
    pub barrier_tbs: u16,
    /// A counted wait (`waits_per_execution > 0`): its place among the waits on its channels in
    /// an execution...
    pub wait_index: u16,
    /// ... and how many there are; the kernel waits for inbound count `(executions so far) *
    /// waits_per_execution + wait_index + 1` in every replica (executor.cu's `wait_counted`).
    /// 0: the wait advances the channel's `expected` counter, in replica 0 only.
    pub waits_per_execution: u16,
    pub first_ref: u32,
    pub first_id: u32,
}

/// Most bytes of dynamic shared memory a block's program may take (what CUDA and HIP GPUs give a
/// block without opting in): every block copies its threadblock's program there first.
pub const MAX_SHARED_PROGRAM_BYTES: usize = 48 << 10;

/// Bytes of a threadblock program of `ops` ops, `refs` references and `ids` ids in shared memory
/// (executor.cu's `load_program`: the three arrays one after the other, as u32 words).
pub fn program_bytes(ops: usize, refs: usize, ids: usize) -> usize {
    ops * size_of::<PlanOp>() + refs * size_of::<PlanRef>() + ids * size_of::<u32>()
}

/// `size` chunks from chunk `index` of buffer `slot`; `packets` when the buffer holds LL packets.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlanRef {
    pub slot: u16,
    pub packets: u16,
    pub index: u32,
    pub size: u32,
}

/// `PlanArgs`: the one argument of [`ENTRY`]. Device pointers are `u64`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanArgs {
    /// `const PlanOp*`: every threadblock's ops, one list after the other.
    pub ops: u64,
    /// `const u32*`: threadblock `b`'s program is `ops[s[0]..s[3]]`, `refs[s[1]..s[4]]` and
    /// `ids[s[2]..s[5]]` with `s = &tb_starts[3 * b..]`; its ops' `first_ref` and `first_id`
    /// count from its own first reference and id.
    pub tb_starts: u64,
    /// `const PlanRef*`.
    pub refs: u64,
    /// `const u32*`: channel, semaphore and barrier ids of the ops.
    pub ids: u64,
    /// `D2DSemaphoreHandle*` by global memory-channel index.
    pub channels: u64,
    /// `const PortChannelHandle*` by global port-channel index.
    pub port_channels: u64,
    /// `u32*`: the plan's local semaphores (sem_release / sem_acquire).
    pub semaphores: u64,
    /// `u64*`: arrivals by barrier id (only grow).
    pub barriers: u64,
    /// `u32*`: [`TB_WORDS`] words per threadblock: executions so far (the LL flag of the next one
    /// is one more), one copy per replica slot, then the replicas' arrival stamps.
    pub flags: u64,
    pub error_word: u64,
    /// Addresses by slot: input, output, scratch, then remote buffer k at 3 + k.
    pub buffers: [u64; MAX_PLAN_BUFFERS],
    /// By slot: the buffer's offset in its rank's plan block, which port-channel puts address
    /// (the proxy knows the blocks, not the buffers).
    pub block_offsets: [u64; MAX_PLAN_BUFFERS],
    pub chunk_bytes: u64,
    /// LL plans alternate two halves of every scratch by execution; this is the second's offset.
    pub scratch_half_bytes: u64,
    pub max_spin: u64,
    /// 0 for Simple, 8 (LL8) or 16 (LL16).
    pub packet_bytes: u32,
    /// Payload bytes per unit of work: 4 for LL8, 8 otherwise.
    pub unit_bytes: u32,
    /// Blocks per plan threadblock (at least 1), each doing its part of every op's units: the
    /// grid has `threadblocks * replicas` blocks. More than 1 only for plans whose
    /// `mscclpp_executor::encode::Replication` allows it; at most [`MAX_REPLICAS`].
    pub replicas: u32,
}

impl Default for PlanArgs {
    fn default() -> Self {
        PlanArgs {
            ops: 0,
            tb_starts: 0,
            refs: 0,
            ids: 0,
            channels: 0,
            port_channels: 0,
            semaphores: 0,
            barriers: 0,
            flags: 0,
            error_word: 0,
            buffers: [0; MAX_PLAN_BUFFERS],
            block_offsets: [0; MAX_PLAN_BUFFERS],
            chunk_bytes: 0,
            scratch_half_bytes: 0,
            max_spin: 0,
            packet_bytes: 0,
            unit_bytes: 8,
            replicas: 1,
        }
    }
}

/// What a plan's ops use beyond plain memory-channel data and synchronisation
/// (`MSCCLPP_PLAN_FEATURES` in executor.cu): the unit of a plan leaves out the interpreter code of
/// the features it lacks. That code never runs for such a plan, but compiled in it cost every op
/// (it raised the spills of the 1024-thread kernel from 128 to 216 bytes a thread): without it
/// every 2-GPU fixture plan ran faster at every size measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PlanFeatures {
    /// LL packets in some buffer an op reads or writes (LL and LL8 plans).
    pub packets: bool,
    /// Port-channel ops (the host proxy's puts, signals, waits and flushes).
    pub ports: bool,
    /// `pipeline` ops.
    pub pipelines: bool,
}

impl PlanFeatures {
    /// Every feature: a unit that runs any plan.
    pub const ALL: PlanFeatures = PlanFeatures {
        packets: true,
        ports: true,
        pipelines: true,
    };

    /// The `MSCCLPP_PLAN_FEATURES` bit mask (executor.cu's kHasPackets, kHasPorts, kHasPipelines).
    pub fn mask(self) -> u32 {
        u32::from(self.packets) | u32::from(self.ports) << 1 | u32::from(self.pipelines) << 2
    }
}

/// Name (logs, kernel cache) of the unit for `dtype` accumulating in `acc` with `op`, for plans
/// with `features`.
pub fn unit_name(dtype: DataType, acc: DataType, op: ReduceOp, features: PlanFeatures) -> String {
    format!(
        "plan_executor_{}_acc_{}_{}_f{}",
        dtype.name(),
        acc.name(),
        op.name(),
        features.mask()
    )
}

/// The unit for `dtype` with the accumulator `accum` resolves to and `op`, for plans with
/// `features`; errors name a pair no kernel is offered for.
pub fn unit_source(
    dtype: DataType,
    accum: AccumType,
    op: ReduceOp,
    features: PlanFeatures,
) -> Result<(String, String)> {
    let acc = resolve_accumulator(dtype, accum)?;
    let text = format!(
        "#define MSCCLPP_PLAN_T {}\n#define MSCCLPP_PLAN_ACC {}\n#define MSCCLPP_PLAN_OP {}\n\
         #define MSCCLPP_PLAN_FEATURES {}\n{SOURCE}",
        cxx_type(dtype),
        cxx_type(acc),
        op.to_nccl(),
        features.mask()
    );
    Ok((unit_name(dtype, acc, op, features), text))
}

/// One rank's program for [`specialised_unit_source`]: threadblock `b`'s ops are
/// `ops[tb_ops[b]..tb_ops[b + 1]]`, each naming its references and ids by `first_ref` and
/// `first_id` in `refs` and `ids` (mscclpp-executor's encoding, before `device_program` counts
/// them per threadblock).
#[derive(Debug, Clone, Copy)]
pub struct StaticProgram<'a> {
    pub ops: &'a [PlanOp],
    pub tb_ops: &'a [u32],
    pub refs: &'a [PlanRef],
    pub ids: &'a [u32],
    /// Which memory remote slot `FIRST_REMOTE_SLOT + k` is: slots of one value may be one buffer
    /// (one peer's input and output, or a buffer the plan names twice); slots of two values never
    /// are. The fusion of data ops (`fused_ops`) keeps ops apart where buffers may overlap.
    pub remote_memory: &'a [u32],
}

/// The unit of [`unit_source`] with `program` compiled into it (executor.cu's
/// `MSCCLPP_PLAN_STATIC`): each op a call of the interpreter's `run_op` on constants (values
/// that differ between threadblocks of one shape worked out from the threadblock), so the
/// compiler gives every op code of its own, with nothing decoded at run time; consecutive data
/// ops that fuse ([`crate::fused_ops`]) one call of `run_fused`. Its name carries a hash of the
/// program (logs; the kernel cache keys by the source itself).
pub fn specialised_unit_source(
    dtype: DataType,
    accum: AccumType,
    op: ReduceOp,
    features: PlanFeatures,
    program: &StaticProgram,
) -> Result<(String, String)> {
    let (name, source) = unit_source(dtype, accum, op, features)?;
    let code = static_program_code(program);
    let hash = code.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    Ok((
        format!("{name}_program_{hash:016x}"),
        format!("#define MSCCLPP_PLAN_STATIC 1\n{source}\n{code}"),
    ))
}

/// A value of a threadblock's program that other threadblocks of the same shape may hold
/// differently: a reference's chunk index, an id (channel, semaphore, barrier), a group part.
#[derive(Clone, Copy)]
struct Hole {
    value: u32,
    /// Written as a PlanOp's u8 field (a group part) rather than a u32.
    byte: bool,
}

/// One threadblock's code with its [`Hole`]s as `@k@`: threadblocks whose texts are equal have
/// one shape and run one copy of the code.
struct TbCode {
    text: String,
    holes: Vec<Hole>,
}

impl TbCode {
    fn hole(&mut self, value: u32, byte: bool) -> String {
        self.holes.push(Hole { value, byte });
        format!("@{}@", self.holes.len() - 1)
    }
}

/// How a [`Hole`] is written in the code that threadblocks of one shape share: the same value in
/// every one of them, or an affine function of the threadblock (chunk `tb` of threadblock `tb`,
/// the usual case).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fill {
    Literal(u32),
    Affine { per_tb: i64, at_zero: i64 },
}

impl Fill {
    /// The fill of a hole whose values are `values[i]` in threadblock `tbs[i]`, if there is one.
    fn of(tbs: &[usize], values: &[u32]) -> Option<Fill> {
        let (b0, v0) = (tbs[0] as i64, i64::from(values[0]));
        if values.iter().all(|&v| i64::from(v) == v0) {
            return Some(Fill::Literal(values[0]));
        }
        let (b1, v1) = (tbs[1] as i64, i64::from(values[1]));
        if (v1 - v0) % (b1 - b0) != 0 {
            return None;
        }
        let per_tb = (v1 - v0) / (b1 - b0);
        let at_zero = v0 - per_tb * b0;
        tbs.iter()
            .zip(values)
            .all(|(&b, &v)| per_tb * b as i64 + at_zero == i64::from(v))
            .then_some(Fill::Affine { per_tb, at_zero })
    }

    /// The C++ expression (a u32, or a u8 for `byte`).
    fn code(self, byte: bool) -> String {
        let value = match self {
            Fill::Literal(v) if byte => return v.to_string(),
            Fill::Literal(v) => return format!("{v}u"),
            Fill::Affine {
                per_tb: 1,
                at_zero: 0,
            } => "tb".to_string(),
            Fill::Affine { per_tb, at_zero } => {
                format!("static_cast<u32>(static_cast<long long>(tb) * {per_tb} + {at_zero})")
            }
        };
        if byte {
            format!("static_cast<u8>({value})")
        } else {
            value
        }
    }
}

/// `run_static_program` (executor.cu) for `p`: per threadblock, the steps of plan_execute's loop
/// written out (a plain op once over every unit, a pipeline's ops once per iteration window).
/// Threadblocks of one shape (the same program on other chunks and channels: MSCCL++'s plans
/// give each chunk or channel a threadblock of its own) share one case, where the values that
/// differ between them are worked out from `tb`, so NVRTC optimises each shape once:
/// allreduce_2gpu.json's eight threadblocks compiled in 24.9 s as eight copies, 2.2 s as one
/// (sm_90, one core). Threadblocks whose values do not follow `tb` that way keep a case each.
fn static_program_code(p: &StaticProgram) -> String {
    let ntb = p.tb_ops.len().saturating_sub(1);
    let codes: Vec<TbCode> = (0..ntb).map(|b| tb_code(p, b)).collect();
    // Threadblocks with the same text, in order of their first one.
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for b in 0..ntb {
        match groups
            .iter_mut()
            .find(|g| codes[g[0]].text == codes[b].text)
        {
            Some(group) => group.push(b),
            None => groups.push(vec![b]),
        }
    }
    let mut out = String::from(
        "// Generated by mscclpp_kernels_cu::executor::specialised_unit_source.\n\
         namespace mscclpp {\nnamespace plan {\n\
         MSCCLPP_DEVICE_INLINE bool run_static_program(const PlanArgs& a, u32 tb, u32 flag, \
         Replicas& r) {\n  const Window all = {0, ~0ull};\n  switch (tb) {\n",
    );
    for group in groups {
        let shapes = match shape_fills(&codes, &group) {
            Some(fills) => vec![(group, fills)],
            None => group
                .into_iter()
                .map(|b| {
                    let fills = codes[b].holes.iter().map(|h| Fill::Literal(h.value));
                    (vec![b], fills.collect())
                })
                .collect(),
        };
        for (tbs, fills) in shapes {
            let mut text = codes[tbs[0]].text.clone();
            for (k, (fill, hole)) in fills.iter().zip(&codes[tbs[0]].holes).enumerate() {
                text = text.replacen(&format!("@{k}@"), &fill.code(hole.byte), 1);
            }
            for b in tbs {
                out += &format!("  case {b}:\n");
            }
            out += &format!("  {{\n{text}    return true;\n  }}\n");
        }
    }
    out += "  default:\n    return true;\n  }\n}\n}  // namespace plan\n}  // namespace mscclpp\n";
    out
}

/// The [`Fill`] of every hole of threadblocks `tbs`, whose texts are equal, where every hole has
/// one.
fn shape_fills(codes: &[TbCode], tbs: &[usize]) -> Option<Vec<Fill>> {
    (0..codes[tbs[0]].holes.len())
        .map(|k| {
            let values: Vec<u32> = tbs.iter().map(|&b| codes[b].holes[k].value).collect();
            Fill::of(tbs, &values)
        })
        .collect()
}

/// Threadblock `b`'s code (see [`static_program_code`]).
fn tb_code(p: &StaticProgram, b: usize) -> TbCode {
    let mut code = TbCode {
        text: String::new(),
        holes: Vec::new(),
    };
    let (mut o, end) = (p.tb_ops[b] as usize, p.tb_ops[b + 1] as usize);
    while o < end {
        let head = &p.ops[o];
        if head.kind == OpKind::Pipeline as u8 {
            // ids: unit_size (low, high word) and num_chunks; then `nids` ops.
            let ids = &p.ids[head.first_id as usize..head.first_id as usize + 3];
            let op = plan_op_literal(&mut code, head);
            code.text += &format!(
                "    {{\n      const u32 pipeline_ids[] = {{{}u, {}u, {}u}};\n      \
                 const Step step = step_at(a, make_op({op}, nullptr, pipeline_ids), 0);\n      \
                 for (u64 it = 0; it < step.iters; ++it) {{\n        \
                 const Window w = {{it * step.per_iter, (it + 1) * step.per_iter}};\n",
                ids[0], ids[1], ids[2],
            );
            let inner = o + 1..o + 1 + head.nids as usize;
            for op in &p.ops[inner.clone()] {
                static_op_code(&mut code, p, op, "w", "        ");
            }
            code.text += "      }\n    }\n";
            o = inner.end;
        } else if let Some(group) = fused_group(p, b, o) {
            fused_code(&mut code, p, &group);
            o = group.end;
        } else {
            static_op_code(&mut code, p, head, "all", "    ");
            o += 1;
        }
    }
    code
}

/// The fused group (executor.cu's `run_fused`) that starts at op `o` of threadblock `b`.
fn fused_group(p: &StaticProgram, b: usize, o: usize) -> Option<FusedGroup> {
    let tb = &p.ops[..p.tb_ops[b + 1] as usize];
    fused_ops::fused_group(tb, p.refs, p.remote_memory, o)
}

/// A fused group: each op's references as local constants, the ops, where their sources come
/// from, then run_fused.
fn fused_code(code: &mut TbCode, p: &StaticProgram, group: &FusedGroup) {
    let mut out = String::from("    {\n");
    let mut made = Vec::new();
    for (j, &o) in group.ops.iter().enumerate() {
        let op = &p.ops[o];
        let nrefs = usize::from(op.nsrc) + usize::from(op.ndst);
        let refs = &p.refs[op.first_ref as usize..op.first_ref as usize + nrefs];
        out += &format!(
            "      const PlanRef refs{j}[] = {{{}}};\n",
            ref_list(code, refs)
        );
        made.push(format!(
            "make_op({}, refs{j}, nullptr)",
            plan_op_literal(code, op)
        ));
    }
    // executor.cu's kFeed: 4 bits per (op, source), the feeding op's place plus one.
    let feed = group.feed.iter().enumerate().fold(0u64, |bits, (j, from)| {
        from.iter().enumerate().fold(bits, |bits, (s, k)| {
            bits | k.map_or(0, |k| (k as u64 + 1) << (4 * (j * FUSED_MAX_SRCS + s)))
        })
    });
    out += &format!(
        "      const Op ops[] = {{{}}};\n      \
         if (!run_fused<{feed:#x}ull, {}>(a, ops, r)) return false;\n    }}\n",
        made.join(", "),
        group.unroll(p.ops),
    );
    code.text += &out;
}

/// References as a C++ PlanRef initialiser list, their chunk indices holes.
fn ref_list(code: &mut TbCode, refs: &[PlanRef]) -> String {
    let list: Vec<String> = refs
        .iter()
        .map(|r| {
            let index = code.hole(r.index, false);
            format!("{{{}, {}, {index}, {}u}}", r.slot, r.packets, r.size)
        })
        .collect();
    list.join(", ")
}

/// One op of a [`StaticProgram`]: its references and ids as local constants, then run_op.
fn static_op_code(code: &mut TbCode, p: &StaticProgram, op: &PlanOp, window: &str, indent: &str) {
    let nrefs = usize::from(op.nsrc) + usize::from(op.ndst);
    let refs = &p.refs[op.first_ref as usize..op.first_ref as usize + nrefs];
    let ids = &p.ids[op.first_id as usize..op.first_id as usize + usize::from(op.nids)];
    let mut out = format!("{indent}{{\n");
    let refs_name = if refs.is_empty() {
        "nullptr"
    } else {
        out += &format!(
            "{indent}  const PlanRef refs[] = {{{}}};\n",
            ref_list(code, refs)
        );
        "refs"
    };
    let ids_name = if ids.is_empty() {
        "nullptr"
    } else {
        let list: Vec<String> = ids.iter().map(|&i| code.hole(i, false)).collect();
        out += &format!("{indent}  const u32 ids[] = {{{}}};\n", list.join(", "));
        "ids"
    };
    let literal = plan_op_literal(code, op);
    out += &format!(
        "{indent}  if (!run_op(a, make_op({literal}, {refs_name}, {ids_name}), flag, {window}, r)) return false;\n{indent}}}\n"
    );
    code.text += &out;
}

/// `op` as a C++ PlanOp value, its group part a hole (its `first_ref` and `first_id` are not read:
/// the op's references and ids are given beside it).
fn plan_op_literal(code: &mut TbCode, op: &PlanOp) -> String {
    let part = code.hole(u32::from(op.tbg_part), true);
    format!(
        "PlanOp{{{}, {}, {}, {}, {}, {part}, {}, {}, {}, {}, 0u, 0u}}",
        op.kind,
        op.flags,
        op.nsrc,
        op.ndst,
        op.nids,
        op.tbg_parts,
        op.barrier_tbs,
        op.wait_index,
        op.waits_per_execution
    )
}

/// C++ static_asserts of the interpreter's structs and constants against this file.
pub fn layout_asserts() -> String {
    let mut out =
        String::from("\n// Generated by mscclpp_kernels_cu::executor::layout_asserts().\n");
    let mut check = |ty: &str, field: &str, offset: usize| {
        out += &format!(
            "static_assert(offsetof(mscclpp::plan::{ty}, {field}) == {offset}, \"{ty}::{field}: offset differs from kernels-cu/src/executor.rs\");\n"
        );
    };
    macro_rules! fields {
        ($ty:ident: $($f:ident),+) => {
            $(check(stringify!($ty), stringify!($f), offset_of!($ty, $f));)+
        };
    }
    fields!(PlanOp: kind, flags, nsrc, ndst, nids, tbg_part, tbg_parts, barrier_tbs, wait_index,
        waits_per_execution, first_ref, first_id);
    fields!(PlanRef: slot, packets, index, size);
    fields!(PlanArgs: ops, tb_starts, refs, ids, channels, port_channels, semaphores, barriers, flags,
        error_word, buffers, block_offsets, chunk_bytes, scratch_half_bytes, max_spin, packet_bytes, unit_bytes, replicas);
    for (ty, size) in [
        ("PlanOp", size_of::<PlanOp>()),
        ("PlanRef", size_of::<PlanRef>()),
        ("PlanArgs", size_of::<PlanArgs>()),
    ] {
        out += &format!(
            "static_assert(sizeof(mscclpp::plan::{ty}) == {size}, \"{ty}: size differs from kernels-cu/src/executor.rs\");\n"
        );
    }
    out += &format!(
        "static_assert(mscclpp::plan::kMaxPlanBuffers == {MAX_PLAN_BUFFERS}, \"kMaxPlanBuffers\");\n\
         static_assert(mscclpp::plan::kFirstRemoteSlot == {FIRST_REMOTE_SLOT}, \"kFirstRemoteSlot\");\n\
         static_assert(mscclpp::plan::kMaxReplicas == {MAX_REPLICAS}, \"kMaxReplicas\");\n\
         static_assert(mscclpp::plan::kTbWords == {TB_WORDS}, \"kTbWords\");\n\
         static_assert(mscclpp::plan::kMaxBlockThreads == {MAX_BLOCK_THREADS}, \"kMaxBlockThreads\");\n\
         static_assert(mscclpp::plan::kSignalAfter == {FLAG_SIGNAL_AFTER}, \"kSignalAfter\");\n\
         static_assert(mscclpp::plan::kFlushAfter == {FLAG_FLUSH_AFTER}, \"kFlushAfter\");\n\
         static_assert(mscclpp::plan::kPort == {FLAG_PORT}, \"kPort\");\n"
    );
    for (name, kind) in [
        ("kNop", OpKind::Nop),
        ("kData", OpKind::Data),
        ("kSignal", OpKind::Signal),
        ("kRelaxedSignal", OpKind::RelaxedSignal),
        ("kWait", OpKind::Wait),
        ("kRelaxedWait", OpKind::RelaxedWait),
        ("kFlush", OpKind::Flush),
        ("kSemRelease", OpKind::SemRelease),
        ("kSemAcquire", OpKind::SemAcquire),
        ("kBarrier", OpKind::Barrier),
        ("kPipeline", OpKind::Pipeline),
    ] {
        out += &format!(
            "static_assert(mscclpp::plan::{name} == {}, \"{name}\");\n",
            kind as u8
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A program of two threadblocks: a copy and a signal; a pipeline of one reducing op.
    fn sample_program() -> (Vec<PlanOp>, Vec<u32>, Vec<PlanRef>, Vec<u32>) {
        let op = |kind: OpKind, nsrc, ndst, nids, first_ref, first_id| PlanOp {
            kind: kind as u8,
            nsrc,
            ndst,
            nids,
            tbg_parts: 1,
            first_ref,
            first_id,
            ..PlanOp::default()
        };
        let ops = vec![
            op(OpKind::Data, 1, 1, 0, 0, 0),
            op(OpKind::Signal, 0, 0, 2, 0, 0),
            op(OpKind::Pipeline, 0, 0, 1, 0, 2),
            op(OpKind::Data, 2, 1, 0, 2, 0),
        ];
        let r = |slot, index| PlanRef {
            slot,
            packets: 0,
            index,
            size: 1,
        };
        let refs = vec![r(0, 0), r(3, 1), r(0, 1), r(4, 0), r(1, 1)];
        (ops, vec![0, 2, 4], refs, vec![5, 6, 4096, 0, 2])
    }

    /// Fails naming the first of `pieces` missing from `code`.
    fn assert_contains(code: &str, pieces: &[&str]) {
        for piece in pieces {
            assert!(code.contains(piece), "missing {piece:?} in:\n{code}");
        }
    }

    #[test]
    fn a_specialised_unit_writes_every_op_out_with_its_references_and_ids() {
        let (ops, tb_ops, refs, ids) = sample_program();
        let program = StaticProgram {
            ops: &ops,
            tb_ops: &tb_ops,
            refs: &refs,
            ids: &ids,
            remote_memory: &[0, 1],
        };
        let (name, src) = specialised_unit_source(
            DataType::Bf16,
            AccumType::Auto,
            ReduceOp::Sum,
            PlanFeatures::ALL,
            &program,
        )
        .expect("a unit");
        assert!(
            name.starts_with("plan_executor_bf16_acc_bf16_sum_f7_program_"),
            "{name}"
        );
        assert!(src.starts_with("#define MSCCLPP_PLAN_STATIC 1\n#define MSCCLPP_PLAN_T"));
        let code = &src[src.find("// Generated by").expect("the program")..];
        // Threadblock 0: the copy (input chunk 0 to remote slot 3, chunk 1), then the signal on
        // channels 5 and 6; threadblock 1: the pipeline's ids, then its op once per window.
        assert_contains(
            code,
            &[
                "case 0:\n  {",
                "const PlanRef refs[] = {{0, 0, 0u, 1u}, {3, 0, 1u, 1u}};",
                "make_op(PlanOp{1, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0u, 0u}, refs, nullptr), flag, all, r)",
                "const u32 ids[] = {5u, 6u};",
                "make_op(PlanOp{2, 0, 0, 0, 2, 0, 1, 0, 0, 0, 0u, 0u}, nullptr, ids), flag, all, r)",
                "case 1:\n  {",
                "const u32 pipeline_ids[] = {4096u, 0u, 2u};",
                "const PlanRef refs[] = {{0, 0, 1u, 1u}, {4, 0, 0u, 1u}, {1, 0, 1u, 1u}};",
                "make_op(PlanOp{1, 0, 2, 1, 0, 0, 1, 0, 0, 0, 0u, 0u}, refs, nullptr), flag, w, r)",
            ],
        );
        assert_eq!(code.matches("run_op(").count(), 3, "{code}");
        // Another program is another unit.
        let other = StaticProgram {
            tb_ops: &tb_ops[..2],
            ..program
        };
        let (other_name, _) = specialised_unit_source(
            DataType::Bf16,
            AccumType::Auto,
            ReduceOp::Sum,
            PlanFeatures::ALL,
            &other,
        )
        .expect("a unit");
        assert_ne!(name, other_name);
    }

    #[test]
    fn layouts_are_the_documented_ones() {
        assert_eq!(size_of::<PlanOp>(), 24);
        assert_eq!(size_of::<PlanRef>(), 12);
        assert_eq!(offset_of!(PlanArgs, buffers), 80);
        assert_eq!(size_of::<PlanArgs>(), 80 + 2 * 8 * MAX_PLAN_BUFFERS + 40);
        let asserts = layout_asserts();
        assert!(asserts.contains("offsetof(mscclpp::plan::PlanOp, first_id) == 20"));
        assert!(asserts.contains("mscclpp::plan::kBarrier == 9"));
    }

    #[test]
    fn units_are_specialised_and_refuse_narrowing() {
        let all = PlanFeatures::ALL;
        let (name, src) =
            unit_source(DataType::Fp8E4M3, AccumType::F32, ReduceOp::Max, all).unwrap();
        assert_eq!(name, "plan_executor_fp8_e4m3_acc_f32_max_f7");
        assert!(
            src.starts_with("#define MSCCLPP_PLAN_T fp8_e4m3\n#define MSCCLPP_PLAN_ACC float\n")
        );
        assert!(src.contains("#define MSCCLPP_PLAN_FEATURES 7\n"));
        assert!(src.contains("plan_execute(MSCCLPP_PLAN_ARGS a)"));
        assert!(unit_source(DataType::F32, AccumType::F16, ReduceOp::Sum, all).is_err());
    }

    #[test]
    fn features_name_their_own_unit() {
        let packets_only = PlanFeatures {
            packets: true,
            ..PlanFeatures::default()
        };
        assert_eq!(PlanFeatures::default().mask(), 0);
        assert_eq!(packets_only.mask(), 1);
        assert_eq!(
            PlanFeatures {
                ports: true,
                ..PlanFeatures::default()
            }
            .mask(),
            2
        );
        assert_eq!(PlanFeatures::ALL.mask(), 7);
        let (name, src) =
            unit_source(DataType::Bf16, AccumType::Auto, ReduceOp::Sum, packets_only).unwrap();
        assert_eq!(name, "plan_executor_bf16_acc_bf16_sum_f1");
        assert!(src.contains("#define MSCCLPP_PLAN_FEATURES 1\n"));
    }

    #[test]
    fn a_hole_is_a_literal_or_an_affine_function_of_the_threadblock() {
        assert_eq!(Fill::of(&[0, 3], &[7, 7]), Some(Fill::Literal(7)));
        let tb = Fill::of(&[0, 1, 2, 3], &[0, 1, 2, 3]).expect("affine");
        assert_eq!(
            tb,
            Fill::Affine {
                per_tb: 1,
                at_zero: 0
            }
        );
        assert_eq!(tb.code(false), "tb");
        assert_eq!(tb.code(true), "static_cast<u8>(tb)");
        let shifted = Fill::of(&[2, 4, 6], &[0, 4, 8]).expect("affine");
        assert_eq!(
            shifted,
            Fill::Affine {
                per_tb: 2,
                at_zero: -4
            }
        );
        assert_eq!(
            shifted.code(false),
            "static_cast<u32>(static_cast<long long>(tb) * 2 + -4)"
        );
        // Not affine, or not in whole steps.
        assert_eq!(Fill::of(&[0, 1, 2], &[5, 9, 4]), None);
        assert_eq!(Fill::of(&[0, 2], &[0, 1]), None);
        assert_eq!(Fill::Literal(7).code(false), "7u");
        assert_eq!(Fill::Literal(7).code(true), "7");
    }

    #[test]
    fn threadblocks_of_one_shape_share_their_code() {
        // Threadblocks 0, 2 and 3 copy chunk tb and signal a channel (ids 0-2); threadblock 1
        // waits on a channel (id 3).
        let copy = |first_ref| PlanOp {
            kind: OpKind::Data as u8,
            nsrc: 1,
            ndst: 1,
            tbg_parts: 1,
            first_ref,
            ..PlanOp::default()
        };
        let sync = |kind: OpKind, first_id| PlanOp {
            kind: kind as u8,
            nids: 1,
            first_id,
            tbg_parts: 1,
            ..PlanOp::default()
        };
        let ops = vec![
            copy(0),
            sync(OpKind::Signal, 0),
            sync(OpKind::Wait, 3),
            copy(2),
            sync(OpKind::Signal, 1),
            copy(4),
            sync(OpKind::Signal, 2),
        ];
        let r = |slot, index| PlanRef {
            slot,
            packets: 0,
            index,
            size: 1,
        };
        let refs = vec![r(0, 0), r(3, 0), r(0, 2), r(3, 2), r(0, 3), r(3, 3)];
        let tb_ops = vec![0, 2, 3, 5, 7];
        let program = |ids: &[u32]| {
            static_program_code(&StaticProgram {
                ops: &ops,
                tb_ops: &tb_ops,
                refs: &refs,
                ids,
                remote_memory: &[0],
            })
        };
        // Channels 5, 9, 11 follow the threadblock (2 tb + 5): one case for the three.
        let code = program(&[5, 9, 11, 5]);
        assert_eq!(code.matches("run_op(").count(), 3, "{code}");
        assert_contains(
            &code,
            &[
                "  case 0:\n  case 2:\n  case 3:\n  {\n",
                "const PlanRef refs[] = {{0, 0, tb, 1u}, {3, 0, tb, 1u}};",
                "const u32 ids[] = {static_cast<u32>(static_cast<long long>(tb) * 2 + 5)};",
                "  case 1:\n  {\n",
                "const u32 ids[] = {5u};",
            ],
        );
        // Channels 5, 9, 4 do not: a case each, as written.
        let code = program(&[5, 9, 4, 5]);
        assert_eq!(code.matches("run_op(").count(), 7, "{code}");
        assert_contains(
            &code,
            &[
                "  case 0:\n  {\n",
                "const PlanRef refs[] = {{0, 0, 2u, 1u}, {3, 0, 2u, 1u}};",
                "const u32 ids[] = {4u};",
            ],
        );
        assert!(!code.contains(", tb,"), "{code}");
    }

    #[test]
    fn consecutive_data_ops_that_fuse_are_one_run_fused_with_their_feeds() {
        use crate::fused_ops::tests::{data, nop, r};
        let signal = PlanOp {
            kind: OpKind::Signal as u8,
            nids: 1,
            ..PlanOp::default()
        };
        // get (the peer's scratch 1 into scratch 1), nop, res (input 1 + scratch 1 into input 1
        // and the peer's input 1), signal.
        let ops = vec![data(1, 1, 0), nop(), data(2, 2, 2), signal];
        let refs = vec![r(3, 1), r(2, 1), r(0, 1), r(2, 1), r(0, 1), r(4, 1)];
        let code_with = |remote_memory: &[u32]| {
            static_program_code(&StaticProgram {
                ops: &ops,
                tb_ops: &[0, 4],
                refs: &refs,
                ids: &[0],
                remote_memory,
            })
        };
        let code = code_with(&[0, 1]);
        // res's second source (op 1, source 1: bits 20-23) is get's value (place 0, plus one).
        assert_contains(
            &code,
            &[
                "const PlanRef refs0[] = {{3, 0, 1u, 1u}, {2, 0, 1u, 1u}};",
                "const PlanRef refs1[] = {{0, 0, 1u, 1u}, {2, 0, 1u, 1u}, {0, 0, 1u, 1u}, {4, 0, 1u, 1u}};",
                "run_fused<0x100000ull, 4>(a, ops, r)",
            ],
        );
        assert_eq!(
            code.matches("run_op(").count(),
            1,
            "the signal alone: {code}"
        );
        // The peer's scratch and input as one memory: res's write could land on get's read.
        let code = code_with(&[0, 0]);
        assert!(!code.contains("run_fused"), "{code}");
    }
}
