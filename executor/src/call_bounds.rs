//! The boundaries of a call: no rank may touch a peer's buffers before the peer's call has
//! started, nor after it has returned. A collective is stream-ordered on every rank, so a
//! program may write its output or input just before the call (PyTorch fills, copies, or hands a
//! block of its caching allocator to a new tensor while the block's last kernel still runs) and
//! reuse them as soon as the call is done. A plan that puts into a peer's output, or reads a
//! peer's input, without first hearing from that peer, races with the peer's program: on one
//! H200 MSCCL++-style all-gather and all-to-all plans (`put` straight into the peers' outputs)
//! lost chunks under PyTorch when a fast rank's CUDA-graph replay wrote before a slow rank's
//! `fill_` had run. MSCCL++'s DSL writes such plans (its quick-start all-gather is one), and its
//! executor runs them as written.
//!
//! So [`Plan::from_json`](crate::Plan::from_json) adds, where a plan needs them:
//! - an entry handshake: every threadblock first signals every channel it drives, then waits on
//!   each, so a threadblock moves no data before every peer it has a channel to has started its
//!   call (its program's earlier work on those buffers is done: stream order). Needed where a
//!   rank reaches a peer's input or output, or (protocol Simple) a peer's scratch, which the
//!   peer's previous call may still be reading; LL plans alternate scratch halves by their flag
//!   and need none for it.
//! - an exit handshake: the same after a threadblock's last op, where a rank reads a peer's input
//!   or output, so no rank's call returns while a peer still reads its buffers. (A peer's writes
//!   into a rank's buffers are already followed by a signal the rank waits for, or the plan
//!   computes wrong results; the CPU reference rejects such plans.)
//!
//! Each channel's handshake is done by one threadblock, the one whose ops signal or wait on it (a
//! semaphore's wait count belongs to one threadblock; MSCCL++ plans let other threadblocks move
//! data through it), else the first that lists it: one signal and one wait on each of its channels
//! at each boundary, so the counts stay balanced with the peers' matching channels whichever
//! threadblocks those are. Where a threadblock reaches a peer through a channel another one owns,
//! every threadblock of the rank also meets at a barrier after the entry handshake and before the
//! exit one, so that it too is ordered by the owner's handshake. A threadblock whose program already opens (or closes) with a signal and a wait on every channel
//! it drives keeps its own, so plans written with the handshake (the builder's) pay nothing more,
//! and adding the handshakes twice changes nothing. Switch channels carry no semaphores: a plan
//! that reaches peers' buffers only through them gets no handshake (NVLink multicast stays gated).
//! The CPU reference models the callers' use of their buffers around the call
//! ([`crate::reference`]), so a plan without the handshakes it needs fails its proof.

use crate::plan::{
    AddedOps, BufferRef, BufferType, ChannelType, Gpu, Op, OpCode, Plan, Protocol, Threadblock,
};
use std::collections::HashMap;

/// Which handshakes a plan needs (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Needs {
    pub entry: bool,
    pub exit: bool,
}

/// The channel types a handshake goes over: the ones with semaphores.
const HANDSHAKE_TYPES: [ChannelType; 2] = [ChannelType::Memory, ChannelType::Port];

/// What `plan` needs at its boundaries.
pub fn needs(plan: &Plan) -> Needs {
    let user = |b: BufferType| b != BufferType::Scratch;
    let entry = plan.gpus.iter().any(|g| {
        g.remote_buffers
            .iter()
            .any(|rb| user(rb.buffer_type) || plan.protocol == Protocol::Simple)
    });
    let exit = plan.gpus.iter().any(|g| {
        g.threadblocks.iter().any(|tb| {
            every_op(&tb.ops).any(|op| {
                op.src_buff
                    .iter()
                    .any(|r| remote_type(g, tb, op, r).is_some_and(user))
            })
        })
    });
    Needs { entry, exit }
}

/// Adds the handshakes `plan` needs to every threadblock that does not already have them.
pub fn add_handshakes(plan: &mut Plan) {
    let needs = needs(plan);
    if !needs.entry && !needs.exit {
        return;
    }
    for gpu in &mut plan.gpus {
        if gpu
            .threadblocks
            .iter()
            .any(|tb| tb.added != AddedOps::default())
        {
            continue; // done already
        }
        let owners = channel_owners(gpu);
        let owns = |t: usize, tb: &Threadblock, ty: ChannelType| -> Vec<u32> {
            local_channels(tb, ty)
                .filter(|&(_, global)| owners.get(&(ty, global)) == Some(&t))
                .map(|(local, _)| local)
                .collect()
        };
        // A threadblock that reaches a peer through a channel another threadblock owns hears of
        // the peer's start, and tells it of its own end, only through that one: then every
        // threadblock of the rank meets the others after the entry handshake and before the exit
        // one.
        let shares = gpu.threadblocks.iter().enumerate().any(|(t, tb)| {
            HANDSHAKE_TYPES.iter().any(|&ty| {
                local_channels(tb, ty).any(|(_, global)| owners.get(&(ty, global)) != Some(&t))
            })
        });
        let barrier = shares.then(|| barrier_op(unused_barrier_id(gpu), gpu.threadblocks.len()));
        let handshakes: Vec<Vec<Op>> = gpu
            .threadblocks
            .iter()
            .enumerate()
            .map(|(t, tb)| handshake_ops(|ty| owns(t, tb, ty)))
            .collect();
        for (tb, handshake) in gpu.threadblocks.iter_mut().zip(handshakes) {
            // With a barrier every threadblock adds both (they must meet as often as each other).
            let own = |ops: &[Op]| {
                barrier.is_none() && !handshake.is_empty() && ops.len() >= handshake.len()
            };
            let mut entry = handshake.clone();
            let mut exit: Vec<Op> = barrier.iter().cloned().collect();
            entry.extend(barrier.iter().cloned());
            exit.extend(handshake.iter().cloned());
            let has_entry = own(&tb.ops) && same_ops(&tb.ops[..handshake.len()], &handshake);
            if needs.entry && !entry.is_empty() && !has_entry {
                tb.added.entry = entry.len();
                tb.ops.splice(0..0, entry);
            }
            // The plan's own ops only: an entry handshake is not an exit one.
            let body = &tb.ops[tb.added.entry..];
            let has_exit = own(body) && same_ops(&body[body.len() - handshake.len()..], &handshake);
            if needs.exit && !exit.is_empty() && !has_exit {
                tb.added.exit = exit.len();
                tb.ops.extend(exit);
            }
        }
    }
}

/// The threadblock that does the handshake on each channel, by (type, GPU-wide index): the one
/// whose ops signal or wait on it (a semaphore's wait count is one threadblock's), else the first
/// that lists it.
fn channel_owners(gpu: &Gpu) -> HashMap<(ChannelType, u32), usize> {
    let mut owners = HashMap::new();
    for (t, tb) in gpu.threadblocks.iter().enumerate() {
        for op in every_op(&tb.ops).filter(|op| synchronises(op.name)) {
            let ty = op.channel_type.unwrap_or(ChannelType::Memory);
            for &id in &op.channel_ids {
                if let Some(global) = tb.channel(ty, id) {
                    owners.entry((ty, global)).or_insert(t);
                }
            }
        }
    }
    for (t, tb) in gpu.threadblocks.iter().enumerate() {
        for ty in HANDSHAKE_TYPES {
            for (_, global) in local_channels(tb, ty) {
                owners.entry((ty, global)).or_insert(t);
            }
        }
    }
    owners
}

/// Ops that signal, wait on or flush their channels.
fn synchronises(code: OpCode) -> bool {
    use OpCode::*;
    matches!(
        code,
        Signal | Wait | Rlxsignal | Rlxwait | Flush | Pws | Pwsf
    )
}

/// The (local id, GPU-wide index) of each channel of type `ty` that `tb` lists.
fn local_channels(tb: &Threadblock, ty: ChannelType) -> impl Iterator<Item = (u32, u32)> + '_ {
    tb.channels
        .iter()
        .filter(move |c| c.channel_type == ty)
        .flat_map(|c| c.channel_ids.iter().copied())
        .enumerate()
        .map(|(local, global)| (local as u32, global))
}

/// A barrier id no op of `gpu` uses.
fn unused_barrier_id(gpu: &Gpu) -> u32 {
    gpu.threadblocks
        .iter()
        .flat_map(|tb| every_op(&tb.ops))
        .filter_map(|op| op.barrier_id)
        .map(|id| id + 1)
        .max()
        .unwrap_or(0)
}

fn barrier_op(id: u32, threadblocks: usize) -> Op {
    Op {
        barrier_id: Some(id),
        num_threadblocks: Some(threadblocks as u32),
        ..op(OpCode::Barrier, None, Vec::new())
    }
}

fn op(name: OpCode, channel_type: Option<ChannelType>, channel_ids: Vec<u32>) -> Op {
    Op {
        name,
        src_buff: Vec::new(),
        dst_buff: Vec::new(),
        channel_ids,
        channel_type,
        reduce_op: None,
        semaphore_ids: Vec::new(),
        tbg_info: None,
        iter_context: None,
        barrier_id: None,
        num_threadblocks: None,
        ops: Vec::new(),
    }
}

/// A signal on each channel `owned` names of every handshake type, then a wait on each (empty
/// where it names none).
fn handshake_ops(owned: impl Fn(ChannelType) -> Vec<u32>) -> Vec<Op> {
    let mut signals = Vec::new();
    let mut waits = Vec::new();
    for ty in HANDSHAKE_TYPES {
        let ids = owned(ty);
        if ids.is_empty() {
            continue;
        }
        signals.push(op(OpCode::Signal, Some(ty), ids.clone()));
        waits.push(op(OpCode::Wait, Some(ty), ids));
    }
    signals.extend(waits);
    signals
}

/// The same synchronisation: kinds, channel types and channel sets in order (a plan may list
/// the channels in another order).
fn same_ops(a: &[Op], b: &[Op]) -> bool {
    let key = |op: &Op| {
        let mut ids = op.channel_ids.clone();
        ids.sort_unstable();
        (op.name, op.channel_type.unwrap_or(ChannelType::Memory), ids)
    };
    a.iter().map(key).eq(b.iter().map(key))
}

/// Every op of `ops`, a pipeline's inner ops included.
fn every_op(ops: &[Op]) -> impl Iterator<Item = &Op> {
    ops.iter()
        .flat_map(|op| std::iter::once(op).chain(op.ops.iter()))
}

/// The type of the peer's buffer `r` names, where it names a peer's buffer through a channel.
fn remote_type(gpu: &Gpu, tb: &Threadblock, op: &Op, r: &BufferRef) -> Option<BufferType> {
    let id = r.buffer_id?;
    let ty = op.channel_type.unwrap_or(ChannelType::Memory);
    let global = tb.remote_buffer(ty, id)?;
    gpu.remote_buffers
        .get(global as usize)
        .map(|rb| rb.buffer_type)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// An all-gather of `ranks` ranks in one threadblock each: `put` of the own chunk into every
    /// peer's output (or, with `get`, reads of every peer's input), then a signal and a wait.
    fn allgather(ranks: u32, get: bool, protocol: &str) -> Value {
        let gpus: Vec<Value> = (0..ranks)
            .map(|r| {
                let peers: Vec<u32> = (0..ranks).filter(|&p| p != r).collect();
                let kind = if get { "i" } else { "o" };
                let remote: Vec<Value> = peers
                    .iter()
                    .map(|&p| json!({"rank": p, "type": kind, "access_channel_types": ["memory"]}))
                    .collect();
                let all: Vec<usize> = (0..peers.len()).collect();
                let mut ops = Vec::new();
                for (k, &p) in peers.iter().enumerate() {
                    ops.push(if get {
                        json!({"name": "get", "src_buff": [{"buffer_id": k, "index": 0, "size": 1}],
                               "dst_buff": [{"type": "o", "index": p, "size": 1}],
                               "channel_ids": [k], "channel_type": "memory"})
                    } else {
                        json!({"name": "put", "src_buff": [{"type": "i", "index": 0, "size": 1}],
                               "dst_buff": [{"buffer_id": k, "index": r, "size": 1}],
                               "channel_ids": [k], "channel_type": "memory"})
                    });
                }
                ops.push(json!({"name": "copy", "src_buff": [{"type": "i", "index": 0, "size": 1}],
                                "dst_buff": [{"type": "o", "index": r, "size": 1}]}));
                if !get {
                    ops.push(json!({"name": "signal", "channel_ids": all, "channel_type": "memory"}));
                    ops.push(json!({"name": "wait", "channel_ids": all, "channel_type": "memory"}));
                }
                json!({
                    "id": r, "input_chunks": 1, "output_chunks": ranks, "scratch_chunks": 0,
                    "channels": [{"channel_type": "memory", "connected_to": peers}],
                    "remote_buffers": remote,
                    "semaphores": [],
                    "threadblocks": [{
                        "id": 0, "ops": ops,
                        "channels": [{"channel_type": "memory", "channel_ids": all}],
                        "remote_buffer_refs": [{"access_channel_type": "memory", "remote_buffer_ids": all}],
                    }],
                })
            })
            .collect();
        json!({
            "name": "allgather_test", "collective": "allgather", "protocol": protocol,
            "inplace": false, "reuse_resources": false, "use_double_scratch_buffer": false,
            "min_message_size": 0, "max_message_size": u64::MAX, "num_threads_per_block": 256,
            "gpus": gpus,
        })
    }

    fn parsed(v: &Value) -> Plan {
        let plan = Plan::parse(v.to_string().as_bytes()).expect("parses");
        crate::validate::validate(&plan).expect("valid");
        plan
    }

    fn names(plan: &Plan) -> Vec<OpCode> {
        plan.gpus[0].threadblocks[0]
            .ops
            .iter()
            .map(|o| o.name)
            .collect()
    }

    #[test]
    fn puts_into_peers_outputs_need_an_entry_handshake_reads_an_exit_one() {
        let put = parsed(&allgather(3, false, "Simple"));
        assert_eq!(
            needs(&put),
            Needs {
                entry: true,
                exit: false
            }
        );
        let get = parsed(&allgather(3, true, "Simple"));
        assert_eq!(
            needs(&get),
            Needs {
                entry: true,
                exit: true
            }
        );
    }

    #[test]
    fn handshakes_go_first_and_last_once() {
        use OpCode::*;
        let mut plan = parsed(&allgather(3, true, "Simple"));
        add_handshakes(&mut plan);
        assert_eq!(names(&plan), [Signal, Wait, Get, Get, Copy, Signal, Wait]);
        let once = plan.clone();
        add_handshakes(&mut plan);
        assert_eq!(plan, once, "a plan that has its handshakes gets no more");
        let first = &plan.gpus[1].threadblocks[0].ops[0];
        assert_eq!(first.channel_ids, [0, 1]);
        assert_eq!(first.channel_type, Some(ChannelType::Memory));
    }

    #[test]
    fn a_plan_that_closes_with_a_handshake_keeps_its_own() {
        use OpCode::*;
        let mut plan = parsed(&allgather(2, false, "Simple"));
        add_handshakes(&mut plan);
        assert_eq!(names(&plan), [Signal, Wait, Put, Copy, Signal, Wait]);
    }

    #[test]
    fn the_builders_plans_have_their_handshakes_already() {
        use crate::builder::{allreduce, port_allreduce};
        use crate::plan::PlanReduceOp;
        for ranks in [2, 4, 8] {
            for protocol in [Protocol::Simple, Protocol::Ll] {
                for json in [
                    allreduce(ranks, protocol, PlanReduceOp::Sum),
                    port_allreduce(ranks, protocol, PlanReduceOp::Sum),
                ] {
                    let plan = Plan::from_json(json.to_string().as_bytes()).expect("valid");
                    for tb in plan.gpus.iter().flat_map(|g| &g.threadblocks) {
                        assert_eq!(tb.added, AddedOps::default(), "{ranks} ranks {protocol:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_channel_other_threadblocks_move_data_through_adds_a_barrier() {
        use OpCode::*;
        // Threadblock 1 gets through rank 0's channel 0, which threadblock 0 waits on.
        let mut v = allgather(2, true, "Simple");
        for r in 0..2 {
            let gpu = &mut v["gpus"][r];
            gpu["channels"] = json!([{"channel_type": "memory", "connected_to": [1 - r, 1 - r]}]);
            let mut tb1 = gpu["threadblocks"][0].clone();
            tb1["id"] = json!(1);
            tb1["channels"] = json!([{"channel_type": "memory", "channel_ids": [1, 0]}]);
            tb1["ops"] = json!([{"name": "signal", "channel_ids": [0], "channel_type": "memory"},
                                {"name": "wait", "channel_ids": [0], "channel_type": "memory"}]);
            gpu["threadblocks"][0]["ops"]
                .as_array_mut()
                .unwrap()
                .push(json!({"name": "signal", "channel_ids": [0], "channel_type": "memory"}));
            gpu["threadblocks"][0]["ops"]
                .as_array_mut()
                .unwrap()
                .push(json!({"name": "wait", "channel_ids": [0], "channel_type": "memory"}));
            gpu["threadblocks"].as_array_mut().unwrap().push(tb1);
        }
        let mut plan = parsed(&v);
        add_handshakes(&mut plan);
        let tb = |t: usize| {
            plan.gpus[0].threadblocks[t]
                .ops
                .iter()
                .map(|o| o.name)
                .collect::<Vec<_>>()
        };
        assert_eq!(tb(0)[..3], [Signal, Wait, Barrier]);
        assert_eq!(
            tb(1),
            [Signal, Wait, Barrier, Signal, Wait, Barrier, Signal, Wait]
        );
        assert_eq!(
            plan.gpus[0].threadblocks[1].ops[0].channel_ids,
            [0],
            "its own channel only"
        );
        let barrier = &plan.gpus[0].threadblocks[1].ops[2];
        assert_eq!(barrier.num_threadblocks, Some(2));
        crate::reference::prove(&plan).expect("proved");
    }

    #[test]
    fn the_reference_rejects_the_plan_without_them_and_proves_it_with_them() {
        for get in [false, true] {
            let raw = parsed(&allgather(3, get, "Simple"));
            let e = crate::reference::prove(&raw).expect_err("races with the peers' callers");
            assert!(e.to_string().contains("s program"), "{e}");
            let mut fixed = raw.clone();
            add_handshakes(&mut fixed);
            crate::reference::prove(&fixed).unwrap_or_else(|e| panic!("get {get}: {e}"));
        }
    }
}
