//! A small builder of our own for N-rank allreduce plans in MSCCL++'s JSON format (not a port of the
//! DSL): the tests use it to run plans for 8 ranks, which the fixtures do not have.
//!
//! Both plans are in place, one threadblock per rank, rank r owning chunk r of N:
//! - Simple: put chunk p to peer p's scratch slot r, signal/wait, reduce own chunk from scratch,
//!   put it to every peer's input, signal/wait.
//! - LL: the same two phases with packets (ppkt, repkt, ppkt, upkt) and no signals: every packet
//!   read waits for its data.
//! - Over port channels ([`port_allreduce`]), the host proxy moving the data. Simple: phase 1
//!   puts then one signal per peer, phase 2 puts with signal and flush (pwsf), a final flush;
//!   every wait covers the data a peer's signal follows. LL: the proxy copies packets as they
//!   are, so each send first packs its chunk into an outgoing scratch slot (cpkt), then ppkt
//!   moves those packets into the peer's scratch; a final flush.
//! - Simple pipelined ([`pipelined_allreduce`]): the Simple plan with phase 1 and the reduction
//!   in a `pipeline` of `unit_size`-byte windows: every iteration puts a window of each peer's
//!   chunk, signals, waits and reduces that window.

use crate::plan::{PlanReduceOp, Protocol};
use serde_json::{json, Value};

fn local(ty: &str, index: usize) -> Value {
    json!({"type": ty, "index": index, "size": 1})
}

fn remote(buffer_id: usize, index: usize) -> Value {
    json!({"buffer_id": buffer_id, "index": index, "size": 1})
}

/// An in-place allreduce plan for `ranks` ranks (2 or more) as JSON, over memory channels.
pub fn allreduce(ranks: usize, protocol: Protocol, reduce_op: PlanReduceOp) -> Value {
    build(ranks, protocol, reduce_op, "memory")
}

/// An in-place allreduce plan for `ranks` ranks (2 or more) over port channels.
pub fn port_allreduce(ranks: usize, protocol: Protocol, reduce_op: PlanReduceOp) -> Value {
    build(ranks, protocol, reduce_op, "port")
}

/// The Simple in-place allreduce (memory channels) with its puts, their signal and wait, and the
/// reduction in one `pipeline` over windows of `unit_size` bytes.
pub fn pipelined_allreduce(ranks: usize, reduce_op: PlanReduceOp, unit_size: u64) -> Value {
    let mut plan = allreduce(ranks, Protocol::Simple, reduce_op);
    plan["name"] = json!(format!("allreduce_pipelined_{ranks}rank"));
    for gpu in plan["gpus"].as_array_mut().into_iter().flatten() {
        let ops = gpu["threadblocks"][0]["ops"]
            .as_array_mut()
            .expect("the builder's ops are a list");
        // After the opening handshake: ranks - 1 puts, signal, wait, reduce.
        let inner: Vec<Value> = ops.drain(2..2 + ranks + 2).collect();
        ops.insert(
            2,
            json!({"name": "pipeline", "iter_context": {"unit_size": unit_size, "num_chunks": 1},
                   "ops": inner}),
        );
    }
    plan
}

fn build(ranks: usize, protocol: Protocol, reduce_op: PlanReduceOp, channel: &str) -> Value {
    let ll = protocol != Protocol::Simple;
    let port = channel == "port";
    let op_name = format!("{reduce_op:?}").to_lowercase();
    let gpus: Vec<Value> = (0..ranks)
        .map(|r| {
            let peers: Vec<usize> = (0..ranks).filter(|&p| p != r).collect();
            // Remote buffers: peer k's scratch at k, peer k's input at peers.len() + k (Simple only).
            let mut remote_buffers: Vec<Value> = peers
                .iter()
                .map(|&p| json!({"rank": p, "type": "s", "access_channel_types": [channel]}))
                .collect();
            if !ll {
                remote_buffers
                    .extend(peers.iter().map(|&p| json!({"rank": p, "type": "i", "access_channel_types": [channel]})));
            }
            let all_channels: Vec<usize> = (0..peers.len()).collect();
            let signal = |ops: &mut Vec<Value>| {
                ops.push(json!({"name": "signal", "channel_ids": all_channels, "channel_type": channel}));
            };
            let wait = |ops: &mut Vec<Value>| {
                ops.push(json!({"name": "wait", "channel_ids": all_channels, "channel_type": channel}));
            };
            let handshake = |ops: &mut Vec<Value>| {
                signal(ops);
                wait(ops);
            };
            // Scratch slot of a sender: Simple uses slot p for sender p; LL adds slots for phase 2,
            // and over port channels outgoing packet slots (2 * ranks + p, then 3 * ranks).
            let mut ops = Vec::new();
            if !ll {
                handshake(&mut ops);
            }
            for (k, &p) in peers.iter().enumerate() {
                let name = if ll { "ppkt" } else { "put" };
                let mut src = local("i", p);
                if ll && port {
                    let outgoing = local("s", 2 * ranks + p);
                    ops.push(json!({"name": "cpkt", "src_buff": [src], "dst_buff": [outgoing]}));
                    src = outgoing;
                }
                let mut put = json!({"name": name, "src_buff": [src], "dst_buff": [remote(k, r)],
                                     "channel_type": channel});
                if port {
                    put["channel_ids"] = json!([k]);
                }
                ops.push(put);
            }
            if !ll {
                handshake(&mut ops);
            }
            let mut srcs = vec![local("i", r)];
            srcs.extend(peers.iter().map(|&p| local("s", p)));
            ops.push(json!({"name": if ll { "repkt" } else { "re" }, "src_buff": srcs,
                            "dst_buff": [local("i", r)], "reduce_op": op_name}));
            let mut src = local("i", r);
            if ll && port {
                let outgoing = local("s", 3 * ranks);
                ops.push(json!({"name": "cpkt", "src_buff": [src], "dst_buff": [outgoing]}));
                src = outgoing;
            }
            for (k, _) in peers.iter().enumerate() {
                let (name, dst) = if ll { ("ppkt", remote(k, ranks + r)) } else { ("put", remote(peers.len() + k, r)) };
                let mut put = json!({"name": name, "src_buff": [src], "dst_buff": [dst], "channel_type": channel});
                if port {
                    put["name"] = json!(if ll { "ppkt" } else { "pwsf" });
                    put["channel_ids"] = json!([k]);
                }
                ops.push(put);
            }
            if ll {
                for &p in &peers {
                    ops.push(json!({"name": "upkt", "src_buff": [local("s", ranks + p)], "dst_buff": [local("i", p)]}));
                }
                if port {
                    ops.push(json!({"name": "flush", "channel_ids": all_channels, "channel_type": channel}));
                }
            } else if port {
                wait(&mut ops);
                ops.push(json!({"name": "flush", "channel_ids": all_channels, "channel_type": channel}));
            } else {
                handshake(&mut ops);
            }
            json!({
                "id": r,
                "input_chunks": ranks,
                "output_chunks": ranks,
                "scratch_chunks": match (ll, port) {
                    (false, _) => ranks,
                    (true, false) => 2 * ranks,
                    (true, true) => 3 * ranks + 1,
                },
                "channels": [{"channel_type": channel, "connected_to": peers}],
                "remote_buffers": remote_buffers,
                "semaphores": [],
                "threadblocks": [{
                    "id": 0,
                    "channels": [{"channel_type": channel, "channel_ids": all_channels}],
                    "remote_buffer_refs": [{"access_channel_type": channel,
                                            "remote_buffer_ids": (0..remote_buffers.len()).collect::<Vec<_>>()}],
                    "ops": ops,
                }],
            })
        })
        .collect();
    json!({
        "name": format!(
            "allreduce_{}{}_{ranks}rank",
            if port { "port_" } else { "" },
            if ll { "packet" } else { "simple" }
        ),
        "collective": "allreduce",
        "protocol": if ll { "LL" } else { "Simple" },
        "inplace": true,
        "reuse_resources": false,
        "use_double_scratch_buffer": false,
        "buffer_alignment": 16,
        "num_threads_per_block": 1024,
        "min_message_size": 0,
        "max_message_size": u64::MAX,
        "gpus": gpus,
    })
}
