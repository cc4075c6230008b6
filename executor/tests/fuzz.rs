//! Bounded, seeded fuzzing of the parser and validator, starting from the fixture plans: every
//! mutation must give a plan or an error, never a panic.

mod common;

use mscclpp_executor::Plan;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

const ITERATIONS_PER_FIXTURE: usize = 150;

/// Replaces one randomly chosen value of the document with a hostile one.
fn mutate_value(node: &mut Value, rng: &mut StdRng) {
    let children = match node {
        Value::Array(a) => a.len(),
        Value::Object(o) => o.len(),
        _ => 0,
    };
    if children > 0 && !rng.random_bool(0.2) {
        let i = rng.random_range(0..children);
        match &mut *node {
            Value::Array(a) => mutate_value(&mut a[i], rng),
            Value::Object(o) => mutate_value(o.values_mut().nth(i).unwrap(), rng),
            _ => unreachable!(),
        }
        return;
    }
    let replacement = match rng.random_range(0..9) {
        0 => Value::Null,
        1 => (-1).into(),
        2 => u64::MAX.into(),
        3 => rng.random_range(0..40u32).into(),
        4 => "x".into(),
        5 => Value::Array(Vec::new()),
        6 => Value::Object(Default::default()),
        7 => 1.5.into(),
        _ => {
            // Drop one key of an object, keeping the rest.
            if let Value::Object(o) = node {
                if let Some(k) = o.keys().nth(rng.random_range(0..o.len().max(1))).cloned() {
                    o.remove(&k);
                }
            }
            return;
        }
    };
    *node = replacement;
}

#[test]
fn mutated_fixtures_never_panic() {
    let mut rng = StdRng::seed_from_u64(18);
    let mut rejected = 0;
    let mut total = 0;
    for (_, bytes) in common::fixtures() {
        let base: Value = serde_json::from_slice(&bytes).unwrap();
        for _ in 0..ITERATIONS_PER_FIXTURE {
            let mut v = base.clone();
            for _ in 0..rng.random_range(1..4) {
                mutate_value(&mut v, &mut rng);
            }
            let text = serde_json::to_vec(&v).unwrap();
            total += 1;
            rejected += Plan::from_json(&text).is_err() as usize;
            // Raw byte damage: truncation and flipped bytes.
            let mut raw = bytes.clone();
            let at = rng.random_range(0..raw.len());
            if rng.random_bool(0.5) {
                raw.truncate(at);
            } else {
                raw[at] = rng.random();
            }
            assert!(Plan::from_json(&raw).is_err() || raw.len() == bytes.len());
        }
    }
    eprintln!("{rejected} of {total} mutated plans rejected");
}

/// Mutated plans that still validate must get a result or a check error from the reference
/// interpreter, never a panic or a hang.
#[test]
fn mutated_fixtures_never_panic_the_reference() {
    use mscclpp_core::DataType;
    use mscclpp_executor::reference::{run, RunConfig};
    let mut rng = StdRng::seed_from_u64(81);
    let mut ran = 0;
    for (_, bytes) in common::fixtures() {
        let base: Value = serde_json::from_slice(&bytes).unwrap();
        for _ in 0..120 {
            let mut v = base.clone();
            mutate_value(&mut v, &mut rng);
            if let Ok(plan) = Plan::from_json(&serde_json::to_vec(&v).unwrap()) {
                ran += 1;
                let _ = run(
                    &plan,
                    RunConfig {
                        dtype: DataType::F32,
                        elems_per_chunk: 2,
                        seed: 3,
                    },
                );
            }
        }
    }
    eprintln!("{ran} mutated plans validated and ran");
}
