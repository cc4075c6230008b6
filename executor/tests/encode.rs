//! The GPU interpreter's op encoding of the fixture plans: what runs, what is refused and why.

mod common;

use mscclpp_executor::encode::encode;
use mscclpp_executor::{BufferType, Plan};
use mscclpp_kernels_cu::executor::{OpKind, FIRST_REMOTE_SLOT, SLOT_SCRATCH};

#[test]
fn every_non_nvls_fixture_encodes_on_every_rank() {
    for (name, bytes) in common::fixtures() {
        let plan = Plan::from_json(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        for rank in 0..plan.world_size() {
            let result = encode(&plan, rank, false);
            if plan.needs_switch() {
                let err = result.expect_err("switch plans are refused").to_string();
                assert!(err.contains("NVLS gate is closed"), "{name}: {err}");
                assert!(
                    err.starts_with(&format!("gpus[{rank}].threadblocks[")),
                    "{name}: {err}"
                );
                continue;
            }
            let enc = result.unwrap_or_else(|e| panic!("{name} rank {rank}: {e}"));
            assert_eq!(
                enc.threadblocks(),
                plan.gpus[rank].threadblocks.len(),
                "{name}"
            );
            // Packets live exactly in scratch buffers (local or a peer's) of LL plans.
            for r in &enc.refs {
                let buffer = match r.slot {
                    SLOT_SCRATCH => BufferType::Scratch,
                    s if s >= FIRST_REMOTE_SLOT => {
                        enc.remote_buffers[(s - FIRST_REMOTE_SLOT) as usize].1
                    }
                    _ => BufferType::Input,
                };
                assert_eq!(r.packets == 1, plan.holds_packets(buffer), "{name}");
            }
            // Channel ids are global memory-channel indices.
            for op in &enc.ops {
                if [
                    OpKind::Signal,
                    OpKind::Wait,
                    OpKind::RelaxedSignal,
                    OpKind::RelaxedWait,
                ]
                .iter()
                .any(|k| *k as u8 == op.kind)
                {
                    let ids = &enc.ids[op.first_id as usize..][..op.nids as usize];
                    assert!(
                        ids.iter().all(|&c| (c as usize) < enc.channel_peers.len()),
                        "{name}"
                    );
                }
            }
        }
    }
}

#[test]
fn fixtures_replicate_as_their_ops_allow() {
    use mscclpp_executor::encode::Replication;
    let want = [
        ("allgather_packet_2gpu.json", Replication::Free),
        ("allreduce_packet_2gpu.json", Replication::Free),
        ("allreduce_2gpu.json", Replication::Synced),
        ("reduce_2gpu.json", Replication::Synced),
        ("reduce_pack_tbg_2gpu.json", Replication::Free),
    ];
    let fixtures = common::fixtures();
    for (file, replication) in want {
        let Some((_, bytes)) = fixtures.iter().find(|(name, _)| name == file) else {
            continue; // no fixtures here (printed by common::fixtures)
        };
        let plan = Plan::from_json(bytes).unwrap();
        for rank in 0..plan.world_size() {
            let enc = encode(&plan, rank, false).unwrap();
            assert_eq!(enc.replication(), replication, "{file} rank {rank}");
        }
    }
}

#[test]
fn threadblock_programs_name_the_references_and_ids_of_the_global_encoding() {
    use mscclpp_kernels_cu::executor::program_bytes;
    for (name, bytes) in common::fixtures() {
        let plan = Plan::from_json(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        if plan.needs_switch() {
            continue;
        }
        for rank in 0..plan.world_size() {
            let enc = encode(&plan, rank, false).unwrap_or_else(|e| panic!("{name}: {e}"));
            let (ops, starts) = enc.device_program();
            assert_eq!(starts.len(), 3 * (enc.threadblocks() + 1), "{name}");
            assert_eq!(
                starts[3 * enc.threadblocks()..],
                [
                    enc.ops.len() as u32,
                    enc.refs.len() as u32,
                    enc.ids.len() as u32
                ],
                "{name}: the last starts are the ends"
            );
            let mut largest = 0;
            for b in 0..enc.threadblocks() {
                let s = &starts[3 * b..3 * b + 6];
                let (refs, ids) = (
                    &enc.refs[s[1] as usize..s[4] as usize],
                    &enc.ids[s[2] as usize..s[5] as usize],
                );
                let range = s[0] as usize..s[3] as usize;
                for (o, (global, local)) in
                    enc.ops[range.clone()].iter().zip(&ops[range]).enumerate()
                {
                    let nrefs = (global.nsrc + global.ndst) as usize;
                    let f = global.first_ref as usize;
                    assert_eq!(
                        &refs[local.first_ref as usize..][..nrefs],
                        &enc.refs[f..f + nrefs],
                        "{name} rank {rank} op {o}"
                    );
                    // A pipeline's ids are its three context words, not nids.
                    let nids = if global.kind == OpKind::Pipeline as u8 {
                        3
                    } else {
                        global.nids as usize
                    };
                    let f = global.first_id as usize;
                    assert_eq!(
                        &ids[local.first_id as usize..][..nids],
                        &enc.ids[f..f + nids],
                        "{name} rank {rank} op {o}"
                    );
                }
                let count = |k: usize| (s[k + 3] - s[k]) as usize;
                largest = largest.max(program_bytes(count(0), count(1), count(2)));
            }
            assert_eq!(enc.largest_program_bytes(), largest, "{name}");
        }
    }
}

/// A fused put of several (source, destination) pairs runs as one op per pair on the GPU (the
/// kernel reduces an op's sources whenever it has several), and a pipeline counts the split ops.
#[test]
fn a_fused_put_encodes_as_one_op_per_pair() {
    let pairs = |d: u32| serde_json::json!({"type": "i", "index": d, "size": 1});
    let put = serde_json::json!({"name": "put", "src_buff": [pairs(1), pairs(2)],
        "dst_buff": [{"buffer_id": 0, "index": 0, "size": 1}, {"buffer_id": 1, "index": 0, "size": 1}],
        "channel_type": "memory"});
    let gpus: Vec<serde_json::Value> = (0..3u32)
        .map(|r| {
            let peers: Vec<u32> = (0..3).filter(|&p| p != r).collect();
            serde_json::json!({"id": r, "input_chunks": 3, "output_chunks": 3, "scratch_chunks": 0,
                "threadblocks": [{"id": 0, "ops": [{"name": "pipeline",
                    "iter_context": {"unit_size": 4096, "num_chunks": 1}, "ops": [put]}],
                    "channels": [{"channel_type": "memory", "channel_ids": [0, 1]}],
                    "remote_buffer_refs": [{"access_channel_type": "memory", "remote_buffer_ids": [0, 1]}]}],
                "channels": [{"channel_type": "memory", "connected_to": peers}],
                "remote_buffers": peers.iter().map(|&p| serde_json::json!(
                    {"rank": p, "type": "i", "access_channel_types": ["memory"]})).collect::<Vec<_>>()})
        })
        .collect();
    let plan = Plan::from_json(
        &serde_json::to_vec(&serde_json::json!({"name": "p", "collective": "alltoall",
            "protocol": "Simple", "inplace": false, "gpus": gpus}))
        .unwrap(),
    )
    .unwrap();
    let enc = encode(&plan, 0, false).unwrap();
    // The puts into the peers' inputs open with the loader's handshake (call_bounds).
    let head = plan.gpus[0].threadblocks[0].added.entry;
    assert_eq!(head, 2, "a signal and a wait");
    assert_eq!(
        enc.ops.len(),
        head + 3,
        "the pipeline head and one op per pair"
    );
    assert_eq!(enc.ops[head].kind, OpKind::Pipeline as u8);
    assert_eq!(enc.ops[head].nids, 2, "the head counts the encoded ops");
    for op in &enc.ops[head + 1..] {
        assert_eq!((op.nsrc, op.ndst), (1, 1));
    }
}
