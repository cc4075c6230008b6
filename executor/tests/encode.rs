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
