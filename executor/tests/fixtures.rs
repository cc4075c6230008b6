//! Every MSCCL++ fixture plan parses and validates, and broken copies of them get path-named errors.

use mscclpp_executor::{OpCode, Plan};
use serde_json::Value;
mod common;

use common::fixtures;

#[test]
fn every_fixture_parses_and_validates() {
    for (name, bytes) in fixtures() {
        let plan = Plan::from_json(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(plan.world_size() >= 2, "{name}");
        assert_eq!(plan.needs_switch(), name.contains("nvls"), "{name}");
    }
}

fn mutate(name: &str, f: impl Fn(&mut Value)) -> String {
    let bytes = fixtures()
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, b)| b);
    let Some(bytes) = bytes else {
        return "skipped".into();
    };
    let mut v: Value = serde_json::from_slice(&bytes).unwrap();
    f(&mut v);
    let err = Plan::from_json(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    err.to_string()
}

#[test]
fn chunk_out_of_range_names_path() {
    let e = mutate("reduce_2gpu.json", |v| {
        v["gpus"][1]["threadblocks"][0]["ops"][0]["src_buff"][0]["index"] = 9.into();
        v["gpus"][1]["threadblocks"][0]["ops"][0]["src_buff"][0]["size"] = 1.into();
        v["gpus"][1]["threadblocks"][0]["ops"][0]["dst_buff"][0]["size"] = 1.into();
    });
    if e != "skipped" {
        assert_eq!(e, "gpus[1].threadblocks[0].ops[0].src_buff[0].index: chunk 9 out of range (4 input chunks)");
    }
}

/// A change to a fixture that must make it invalid.
type Mutation = Box<dyn Fn(&mut Value)>;

#[test]
fn bad_values_name_their_path() {
    let cases: Vec<(&str, Mutation, &str)> = vec![
        ("reduce_2gpu.json", Box::new(|v| v["gpus"][0]["threadblocks"][0]["ops"][0]["name"] = "frobnicate".into()), "gpus[0].threadblocks[0].ops[0]: unknown variant `frobnicate`"),
        ("reduce_2gpu.json", Box::new(|v| v["gpus"][1]["id"] = 0.into()), "gpus[1].id: 0 but this is entry 1"),
        ("reduce_2gpu.json", Box::new(|v| v["gpus"][0]["channels"][0]["connected_to"][0] = 7.into()), "gpus[0].channels[0].connected_to[0]: rank 7 out of range (2 GPUs)"),
        ("reduce_2gpu.json", Box::new(|v| v["protocol"] = "Fast".into()), ": unknown variant `Fast`"),
        ("reduce_2gpu.json", Box::new(|v| v["gpus"][0]["threadblocks"] = 3.into()), "gpus[0].threadblocks: expected a list"),
        ("reduce_2gpu.json", Box::new(|v| { v.as_object_mut().unwrap().remove("gpus"); }), "gpus: missing"),
        ("reduce_2gpu.json", Box::new(|v| v["num_threads_per_block"] = 1000.into()), "num_threads_per_block: 1000 is not a multiple of 32"),
        ("allreduce_nvls_pipeline_4gpu.json", Box::new(|v| v["gpus"][0]["threadblocks"][0]["ops"][0]["ops"][0]["semaphore_ids"][0] = 5.into()), "gpus[0].threadblocks[0].ops[0].ops[0].semaphore_ids[0]: semaphore 5 out of range (3 semaphores)"),
    ];
    for (name, f, want) in cases {
        let e = mutate(name, f);
        if e != "skipped" {
            assert!(
                e.contains(want) || (want.starts_with(": ") && e.contains(&want[2..])),
                "got `{e}`, want `{want}`"
            );
        }
    }
}

#[test]
fn not_json_is_an_error() {
    for bad in [
        &b""[..],
        b"[]",
        b"{",
        b"null",
        b"{\"gpus\": []}",
        &[0xff, 0xfe],
    ] {
        assert!(Plan::from_json(bad).is_err());
    }
    let deep = "[".repeat(100) + &"]".repeat(100);
    assert!(Plan::from_json(deep.as_bytes()).is_err());
}

#[test]
fn thirty_op_codes_by_their_json_names() {
    let names = "nop barrier put ppkt rppkt pws pwsf get copy cpkt upkt signal wait flush re repkt recpkt res \
                 respkt recspkt rre rres glres rlxsignal rlxwait pipeline sem_release sem_acquire gstore gstorepkt";
    let parsed: Vec<OpCode> = names
        .split_whitespace()
        .map(|n| serde_json::from_value(n.into()).unwrap())
        .collect();
    assert_eq!(parsed, OpCode::ALL);
}
