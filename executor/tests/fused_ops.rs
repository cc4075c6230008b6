//! The fusion of data ops (`mscclpp_kernels_cu::fused_ops`, run by executor.cu's `run_fused`)
//! leaves every buffer as the ops one after another would, on every group it finds in the fixture
//! plans and the builder's plans for 2, 4 and 8 ranks: a model of both on the CPU, with the input
//! and output as one buffer (in place) and as two, the group's units taken in either order and
//! in batches whose loads all come before their stores (run_fused's kUnroll words a thread).

mod common;

use mscclpp_executor::encode::{encode, EncodedPlan};
use mscclpp_executor::{builder, Plan, PlanReduceOp, Protocol};
use mscclpp_kernels_cu::executor::{OpKind, PlanOp, PlanRef, FIRST_REMOTE_SLOT, SLOT_SCRATCH};
use mscclpp_kernels_cu::fused_ops::{fused_group, FusedGroup};
use std::collections::HashMap;

/// Units per chunk in the model.
const UNITS: u32 = 3;

/// (memory, chunk, unit) -> value; a unit never written holds a value of its own.
#[derive(Clone, PartialEq, Debug, Default)]
struct Memory(HashMap<(u64, u32, u32), u64>);

impl Memory {
    fn get(&self, at: (u64, u32, u32)) -> u64 {
        self.0
            .get(&at)
            .copied()
            .unwrap_or(at.0 * 1_000_003 + u64::from(at.1) * 1_009 + u64::from(at.2))
    }
}

/// Where a reference's chunk c, unit u lies: the local input and output are memory 0 (in place)
/// or 0 and 1, the scratch 2, remote slots 10 + their `remote_memory`.
fn place(enc: &EncodedPlan, in_place: bool, r: &PlanRef, c: u32, u: u32) -> (u64, u32, u32) {
    let memory = match r.slot {
        0 => 0,
        1 => u64::from(!in_place),
        s if s == SLOT_SCRATCH => 2,
        s => 10 + u64::from(enc.remote_memory[usize::from(s - FIRST_REMOTE_SLOT)]),
    };
    (memory, r.index + c, u)
}

/// An op's value from its sources, in order (order matters here, so a source taken from the wrong
/// place shows).
fn combine(sources: &[u64]) -> u64 {
    sources[1..]
        .iter()
        .fold(sources[0], |h, &x| h.wrapping_mul(31).wrapping_add(x))
}

fn op_refs<'a>(enc: &'a EncodedPlan, op: &PlanOp) -> (&'a [PlanRef], &'a [PlanRef]) {
    let first = op.first_ref as usize;
    let refs = &enc.refs[first..first + usize::from(op.nsrc) + usize::from(op.ndst)];
    refs.split_at(usize::from(op.nsrc))
}

/// The group's ops one after another, each reading all its units before writing any.
fn one_by_one(enc: &EncodedPlan, in_place: bool, group: &FusedGroup, mut m: Memory) -> Memory {
    for &o in &group.ops {
        let (src, dst) = op_refs(enc, &enc.ops[o]);
        let mut writes = Vec::new();
        for c in 0..src[0].size {
            for u in 0..UNITS {
                let values: Vec<u64> = src
                    .iter()
                    .map(|r| m.get(place(enc, in_place, r, c, u)))
                    .collect();
                let v = combine(&values);
                writes.extend(dst.iter().map(|r| (place(enc, in_place, r, c, u), v)));
            }
        }
        m.0.extend(writes);
    }
    m
}

/// The group as run_fused runs it: units in batches of `batch` (in reverse order if `reverse`),
/// every source of every unit of a batch that no earlier op of the group feeds loaded first, then
/// unit by unit, op by op, its value stored.
fn fused(
    enc: &EncodedPlan,
    in_place: bool,
    group: &FusedGroup,
    reverse: bool,
    batch: usize,
    mut m: Memory,
) -> Memory {
    let chunks = op_refs(enc, &enc.ops[group.ops[0]]).0[0].size;
    let mut items: Vec<(u32, u32)> = (0..chunks)
        .flat_map(|c| (0..UNITS).map(move |u| (c, u)))
        .collect();
    if reverse {
        items.reverse();
    }
    for units in items.chunks(batch) {
        let loaded: Vec<Vec<Vec<u64>>> = units
            .iter()
            .map(|&(c, u)| {
                let of_op = |&o: &usize| {
                    let (src, _) = op_refs(enc, &enc.ops[o]);
                    src.iter()
                        .map(|r| m.get(place(enc, in_place, r, c, u)))
                        .collect()
                };
                group.ops.iter().map(of_op).collect()
            })
            .collect();
        for (&(c, u), loaded) in units.iter().zip(loaded) {
            let mut values = Vec::new();
            for (j, &o) in group.ops.iter().enumerate() {
                let (_, dst) = op_refs(enc, &enc.ops[o]);
                let sources: Vec<u64> = (0..loaded[j].len())
                    .map(|s| group.feed[j][s].map_or(loaded[j][s], |k| values[k]))
                    .collect();
                let v = combine(&sources);
                values.push(v);
                for r in dst {
                    m.0.insert(place(enc, in_place, r, c, u), v);
                }
            }
        }
    }
    m
}

/// Every group the static program of `enc` has (as kernels-cu's code writer finds them: at the
/// top level of each threadblock, outside pipelines).
fn groups(enc: &EncodedPlan) -> Vec<FusedGroup> {
    let mut out = Vec::new();
    for b in 0..enc.tb_ops.len() - 1 {
        let (mut o, end) = (enc.tb_ops[b] as usize, enc.tb_ops[b + 1] as usize);
        while o < end {
            let op = &enc.ops[o];
            if op.kind == OpKind::Pipeline as u8 {
                o += 1 + usize::from(op.nids);
            } else if let Some(g) = fused_group(&enc.ops[..end], &enc.refs, &enc.remote_memory, o) {
                o = g.end;
                out.push(g);
            } else {
                o += 1;
            }
        }
    }
    out
}

#[test]
fn fused_groups_leave_every_buffer_as_their_ops_one_after_another() {
    let mut plans: Vec<(String, Plan)> = common::fixtures()
        .into_iter()
        .map(|(name, bytes)| (name.clone(), Plan::from_json(&bytes).expect(&name)))
        .collect();
    for n in [2, 4, 8] {
        for protocol in [Protocol::Simple, Protocol::Ll] {
            let json = builder::allreduce(n, protocol, PlanReduceOp::Sum);
            let plan = Plan::from_json(json.to_string().as_bytes()).expect("a builder plan");
            plans.push((format!("builder {n} ranks {protocol:?}"), plan));
        }
        let json = builder::port_allreduce(n, Protocol::Simple, PlanReduceOp::Sum);
        let plan = Plan::from_json(json.to_string().as_bytes()).expect("a builder plan");
        plans.push((format!("builder port {n} ranks"), plan));
    }
    let mut checked = 0;
    for (name, plan) in &plans {
        for rank in 0..plan.world_size() {
            let Ok(enc) = encode(plan, rank, false) else {
                continue; // switch-channel plans: the interpreter refuses them
            };
            for group in groups(&enc) {
                for in_place in [true, false] {
                    let start = Memory::default();
                    let want = one_by_one(&enc, in_place, &group, start.clone());
                    // One unit at a time, kUnroll, every unit at once.
                    for (reverse, batch) in [false, true]
                        .into_iter()
                        .flat_map(|r| [1, group.unroll(&enc.ops), usize::MAX].map(|b| (r, b)))
                    {
                        let got = fused(&enc, in_place, &group, reverse, batch, start.clone());
                        assert_eq!(
                            got, want,
                            "{name}, rank {rank}, {group:?}, in place {in_place}, batch {batch}"
                        );
                    }
                }
                checked += 1;
            }
        }
    }
    // The reduce fixtures and the builder's Simple plans have groups: the check is not empty.
    assert!(checked >= 8, "{checked} groups checked");
    eprintln!("{checked} fused groups checked");
}
