//! The CPU reference interpreter proves every fixture plan, and catches broken ones.

mod common;

use mscclpp_core::DataType;
use mscclpp_executor::reference::{prove, run, CheckError, RunConfig};
use mscclpp_executor::Plan;
use serde_json::Value;

#[test]
fn every_fixture_plan_computes_its_collective() {
    let mut failures = Vec::new();
    for (name, bytes) in common::fixtures() {
        let plan = Plan::from_json(&bytes).unwrap();
        match prove(&plan) {
            Ok(sizes) => eprintln!(
                "{name}: {:?} proved, input bytes per rank {sizes:?}",
                plan.collective
            ),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn fixture_value(name: &str) -> Option<Value> {
    let bytes = common::fixtures().into_iter().find(|(n, _)| n == name)?.1;
    Some(serde_json::from_slice(&bytes).unwrap())
}

fn plan_of(v: &Value) -> Plan {
    Plan::from_json(&serde_json::to_vec(v).unwrap()).unwrap()
}

fn f32_run(plan: &Plan) -> Result<(), CheckError> {
    run(
        plan,
        RunConfig {
            dtype: DataType::F32,
            elems_per_chunk: 3,
            seed: 1,
        },
    )
}

/// Sets `reduce_op` on every reducing op (nested pipeline ops included).
fn set_reduce_op(v: &mut Value, op: &str) {
    match v {
        Value::Object(o) => {
            if o.contains_key("reduce_op") {
                o.insert("reduce_op".into(), op.into());
            }
            o.values_mut().for_each(|x| set_reduce_op(x, op));
        }
        Value::Array(a) => a.iter_mut().for_each(|x| set_reduce_op(x, op)),
        _ => {}
    }
}

#[test]
fn reduce_op_is_honoured() {
    for name in [
        "reduce_2gpu.json",
        "allreduce_packet_4gpu.json",
        "reduce_nvls_2gpu.json",
    ] {
        let Some(base) = fixture_value(name) else {
            return;
        };
        for op in ["sum", "min", "max", "prod"] {
            let mut v = base.clone();
            set_reduce_op(&mut v, op);
            prove(&plan_of(&v)).unwrap_or_else(|e| panic!("{name} {op}: {e}"));
        }
    }
}

#[test]
fn a_missing_signal_is_a_deadlock_named_by_rank_threadblock_op() {
    let Some(mut v) = fixture_value("reduce_2gpu.json") else {
        return;
    };
    // Rank 1 never signals: rank 0's first wait can never finish.
    for op in v["gpus"][1]["threadblocks"][0]["ops"]
        .as_array_mut()
        .unwrap()
    {
        if op["name"] == "signal" {
            *op = serde_json::json!({"name": "nop"});
        }
    }
    let err = f32_run(&plan_of(&v)).unwrap_err();
    let CheckError::Deadlock(blocked) = &err else {
        panic!("{err}")
    };
    assert!(
        blocked
            .iter()
            .any(|b| b.starts_with("rank 0 threadblock 0 op 4 (wait)")),
        "{err}"
    );
}

#[test]
fn two_unordered_writers_are_a_race() {
    let Some(mut v) = fixture_value("allgather_packet_2gpu.json") else {
        return;
    };
    // Rank 0 writes its own scratch chunk 1, which rank 1 also writes, with nothing ordering them.
    v["gpus"][0]["threadblocks"][0]["ops"][0]["dst_buff"][0] =
        serde_json::json!({"type": "s", "index": 1, "size": 1});
    let err = f32_run(&plan_of(&v)).unwrap_err();
    assert!(matches!(err, CheckError::Race(_)), "{err}");
    assert!(err.to_string().contains("rank 0 scratch element"), "{err}");
}

#[test]
fn a_wrong_plan_is_caught() {
    let Some(mut v) = fixture_value("allgather_packet_2gpu.json") else {
        return;
    };
    // Unpack into the wrong output chunk: the gathered output misses rank 1's data.
    v["gpus"][0]["threadblocks"][1]["ops"][0]["dst_buff"][0]["index"] = 0.into();
    let err = f32_run(&plan_of(&v)).unwrap_err();
    assert!(
        matches!(err, CheckError::Mismatch(_) | CheckError::Race(_)),
        "{err}"
    );
}

#[test]
fn plan_check_lines() {
    use mscclpp_executor::check::{check_file, plan_files};
    let dir = std::env::temp_dir().join(format!("plan-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("bad.json"), br#"{"name": "x"}"#).unwrap();
    let files = plan_files(std::slice::from_ref(&dir)).unwrap();
    let line = check_file(&files[0], None);
    assert!(
        !line.ok && line.text.ends_with("bad.json: FAILED: gpus: missing"),
        "{}",
        line.text
    );
    if let Some((name, bytes)) = common::fixtures()
        .into_iter()
        .find(|(n, _)| n == "reduce_2gpu.json")
    {
        std::fs::write(dir.join(&name), bytes).unwrap();
        let ok = check_file(&dir.join(&name), Some(2));
        assert!(
            ok.ok && ok.text.contains("ok: allreduce (sum) over 2 ranks"),
            "{}",
            ok.text
        );
        let wrong = check_file(&dir.join(&name), Some(8));
        assert!(
            !wrong.ok && wrong.text.contains("written for 2 ranks, not 8"),
            "{}",
            wrong.text
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eight_rank_plans_from_our_builder_are_proved() {
    use mscclpp_executor::builder::allreduce;
    use mscclpp_executor::{PlanReduceOp, Protocol};
    for protocol in [Protocol::Simple, Protocol::Ll] {
        for op in [
            PlanReduceOp::Sum,
            PlanReduceOp::Min,
            PlanReduceOp::Max,
            PlanReduceOp::Prod,
        ] {
            let plan = plan_of(&allreduce(8, protocol, op));
            prove(&plan).unwrap_or_else(|e| panic!("{protocol:?} {op:?}: {e}"));
        }
    }
}

#[test]
fn a_read_no_signal_orders_is_a_race() {
    let Some(mut v) = fixture_value("reduce_2gpu.json") else {
        return;
    };
    // Rank 0 stops waiting for rank 1's "data ready" signal and reads rank 1's scratch anyway.
    let ops = v["gpus"][0]["threadblocks"][0]["ops"]
        .as_array_mut()
        .unwrap();
    let first_wait = ops.iter().position(|op| op["name"] == "wait").unwrap();
    ops[first_wait] = serde_json::json!({"name": "nop"});
    let err = f32_run(&plan_of(&v)).unwrap_err();
    assert!(matches!(err, CheckError::Race(_)), "{err}");
}

#[test]
fn port_channel_plans_from_our_builder_are_proved() {
    use mscclpp_executor::builder::port_allreduce;
    use mscclpp_executor::{PlanReduceOp, Protocol};
    for ranks in [2, 4, 8] {
        for protocol in [Protocol::Simple, Protocol::Ll] {
            for op in [PlanReduceOp::Sum, PlanReduceOp::Max] {
                let plan = plan_of(&port_allreduce(ranks, protocol, op));
                prove(&plan).unwrap_or_else(|e| panic!("{ranks} ranks {protocol:?} {op:?}: {e}"));
            }
        }
    }
}

/// A port put happens when the proxy gets to it: a source rewritten before a signal or flush
/// covers the put is read late, and the plan's result is wrong.
#[test]
fn a_port_put_reads_its_source_only_when_a_signal_or_flush_covers_it() {
    use mscclpp_executor::builder::port_allreduce;
    use mscclpp_executor::{PlanReduceOp, Protocol};
    let mut v = port_allreduce(2, Protocol::Simple, PlanReduceOp::Sum);
    // Rank 0: after its phase-1 put of input chunk 1 (not yet signalled), overwrite chunk 1.
    let ops = v["gpus"][0]["threadblocks"][0]["ops"]
        .as_array_mut()
        .unwrap();
    let put = ops.iter().position(|op| op["name"] == "put").unwrap();
    ops.insert(
        put + 1,
        serde_json::json!({"name": "copy", "src_buff": [{"type": "i", "index": 0, "size": 1}],
                           "dst_buff": [{"type": "i", "index": 1, "size": 1}]}),
    );
    let err = f32_run(&plan_of(&v)).unwrap_err();
    assert!(matches!(err, CheckError::Mismatch(_)), "{err}");
    // A flush between the put and the overwrite: the proxy has read the source by then, and the
    // chunk overwritten is one the peer's phase-2 put replaces anyway.
    let ops = v["gpus"][0]["threadblocks"][0]["ops"]
        .as_array_mut()
        .unwrap();
    ops.insert(
        put + 1,
        serde_json::json!({"name": "flush", "channel_ids": [0], "channel_type": "port"}),
    );
    f32_run(&plan_of(&v)).unwrap_or_else(|e| panic!("{e}"));
}

/// A pipeline runs its ops once per iteration: a wait inside it consumes one signal per
/// iteration, so a sender that signals once leaves the second iteration waiting.
#[test]
fn pipelines_iterate_over_windows_of_their_ops() {
    use mscclpp_executor::builder::allreduce;
    use mscclpp_executor::builder::pipelined_allreduce;
    use mscclpp_executor::{PlanReduceOp, Protocol};
    // 4-byte windows of 8-byte units: one unit per iteration (a chunk of 8 f32 takes 4).
    for ranks in [2, 4, 8] {
        let plan = plan_of(&pipelined_allreduce(ranks, PlanReduceOp::Sum, 4));
        prove(&plan).unwrap_or_else(|e| panic!("{ranks} ranks: {e}"));
    }
    let base = allreduce(2, Protocol::Simple, PlanReduceOp::Sum);
    // Rank 1 pipelines its wait alone (2 iterations for 3 f32 per chunk): its second iteration
    // takes the signal meant for a later wait, so rank 1 ends up waiting for one that never comes.
    let mut v = base;
    let ops = v["gpus"][1]["threadblocks"][0]["ops"]
        .as_array_mut()
        .unwrap();
    let wait = ops.remove(4);
    ops.insert(
        4,
        serde_json::json!({"name": "pipeline", "iter_context": {"unit_size": 8, "num_chunks": 1},
                           "ops": [wait]}),
    );
    let err = f32_run(&plan_of(&v)).unwrap_err();
    assert!(
        matches!(&err, CheckError::Deadlock(b) if b.iter().any(|s| s.starts_with("rank 1 threadblock 0"))),
        "{err}"
    );
}

/// An all-gather over 3 ranks whose puts are fused as MSCCL++'s DSL fuses them: one `put` with a
/// source and a destination per peer (here the same source twice), optionally inside a pipeline.
fn fused_put_allgather(pipelined: bool) -> Value {
    let gpus: Vec<Value> = (0..3u32)
        .map(|r| {
            let peers: Vec<u32> = (0..3).filter(|&p| p != r).collect();
            let out = serde_json::json!({"type": "o", "index": r, "size": 1});
            let input = serde_json::json!({"type": "i", "index": 0, "size": 1});
            let put = serde_json::json!({
                "name": "put",
                "src_buff": [input, input],
                "dst_buff": [{"buffer_id": 0, "index": r, "size": 1},
                             {"buffer_id": 1, "index": r, "size": 1}],
                "channel_type": "memory"
            });
            let moves = vec![
                serde_json::json!({"name": "copy", "src_buff": [input], "dst_buff": [out]}),
                put,
            ];
            let mut ops = if pipelined {
                vec![serde_json::json!({"name": "pipeline",
                    "iter_context": {"unit_size": 1 << 16, "num_chunks": 1}, "ops": moves})]
            } else {
                moves
            };
            ops.extend([
                serde_json::json!({"name": "nop"}),
                serde_json::json!({"name": "signal", "channel_ids": [0, 1], "channel_type": "memory"}),
                serde_json::json!({"name": "wait", "channel_ids": [0, 1], "channel_type": "memory"}),
                serde_json::json!({"name": "nop"}),
            ]);
            serde_json::json!({
                "id": r, "input_chunks": 1, "output_chunks": 3, "scratch_chunks": 0,
                "threadblocks": [{"id": 0, "ops": ops,
                    "channels": [{"channel_type": "memory", "channel_ids": [0, 1]}],
                    "remote_buffer_refs": [{"access_channel_type": "memory", "remote_buffer_ids": [0, 1]}]}],
                "channels": [{"channel_type": "memory", "connected_to": peers}],
                "remote_buffers": peers.iter().map(|&p| serde_json::json!(
                    {"rank": p, "type": "o", "access_channel_types": ["memory"]})).collect::<Vec<_>>(),
                "semaphores": []
            })
        })
        .collect();
    serde_json::json!({"name": "fused_put_allgather", "collective": "allgather", "protocol": "Simple",
        "inplace": false, "gpus": gpus})
}

#[test]
fn a_fused_put_moves_each_source_to_its_destination() {
    for pipelined in [false, true] {
        let plan = plan_of(&fused_put_allgather(pipelined));
        prove(&plan).unwrap_or_else(|e| panic!("pipelined {pipelined}: {e}"));
    }
}

/// A send/receive ring over 3 ranks: rank r puts its input into rank r+1's output.
fn sendrecv_ring(skip_rank: Option<u32>) -> Value {
    let gpus: Vec<Value> = (0..3u32)
        .map(|r| {
            let (next, prev) = ((r + 1) % 3, (r + 2) % 3);
            let mut ops = vec![
                serde_json::json!({"name": "put", "src_buff": [{"type": "i", "index": 0, "size": 1}],
                    "dst_buff": [{"buffer_id": 0, "index": 0, "size": 1}], "channel_type": "memory"}),
                serde_json::json!({"name": "nop"}),
                serde_json::json!({"name": "signal", "channel_ids": [0], "channel_type": "memory"}),
                serde_json::json!({"name": "wait", "channel_ids": [1], "channel_type": "memory"}),
            ];
            if skip_rank == Some(r) {
                ops.remove(0);
            }
            serde_json::json!({
                "id": r, "input_chunks": 1, "output_chunks": 1, "scratch_chunks": 0,
                "threadblocks": [{"id": 0, "ops": ops,
                    "channels": [{"channel_type": "memory", "channel_ids": [0, 1]}],
                    "remote_buffer_refs": [{"access_channel_type": "memory", "remote_buffer_ids": [0]}]}],
                "channels": [{"channel_type": "memory", "connected_to": [next, prev]}],
                "remote_buffers": [{"rank": next, "type": "o", "access_channel_types": ["memory"]}],
                "semaphores": []
            })
        })
        .collect();
    serde_json::json!({"name": "ring", "collective": "sendrecv", "protocol": "Simple",
        "inplace": false, "gpus": gpus})
}

#[test]
fn a_sendrecv_is_proved_by_the_pairs_it_makes() {
    prove(&plan_of(&sendrecv_ring(None))).unwrap();
    // Rank 1 sends nothing: rank 2's output is nobody's input.
    let err = f32_run(&plan_of(&sendrecv_ring(Some(1)))).unwrap_err();
    assert!(
        err.to_string()
            .contains("rank 2's output is not the input of another rank"),
        "{err}"
    );
}
