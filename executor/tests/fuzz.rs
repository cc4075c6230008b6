//! Bounded, seeded fuzzing of the parser, the validator, the reference interpreter and the GPU
//! encoding, starting from the fixture plans: every mutation must give a plan or an error, never
//! a panic. `MSCCLPP_FUZZ_SEED=S` picks the seeds (each test prints the one it ran) and
//! `MSCCLPP_FUZZ_ROUNDS=N` multiplies the iterations, for long runs by hand.

mod common;

use mscclpp_executor::Plan;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

const ITERATIONS_PER_FIXTURE: usize = 150;

/// The seed of a test: `default`, or MSCCLPP_FUZZ_SEED plus `default` (so each test still draws
/// its own sequence), printed so that a failure can be repeated.
fn seed(test: &str, default: u64) -> StdRng {
    let base = std::env::var("MSCCLPP_FUZZ_SEED").ok().map(|s| {
        s.parse::<u64>()
            .expect("MSCCLPP_FUZZ_SEED is an unsigned integer")
    });
    let seed = base.map_or(default, |b| b.wrapping_add(default));
    eprintln!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

/// How many times each test repeats its iterations (MSCCLPP_FUZZ_ROUNDS, default 1).
fn rounds() -> usize {
    std::env::var("MSCCLPP_FUZZ_ROUNDS")
        .ok()
        .map_or(1, |s| s.parse().expect("MSCCLPP_FUZZ_ROUNDS is a count"))
}

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
    let mut rng = seed("mutated_fixtures_never_panic", 18);
    let mut rejected = 0;
    let mut total = 0;
    for (_, bytes) in common::fixtures() {
        let base: Value = serde_json::from_slice(&bytes).unwrap();
        for _ in 0..ITERATIONS_PER_FIXTURE * rounds() {
            let mut v = base.clone();
            for _ in 0..rng.random_range(1..4) {
                mutate_value(&mut v, &mut rng);
            }
            let text = serde_json::to_vec(&v).unwrap();
            total += 1;
            rejected += Plan::from_json(&text).is_err() as usize;
            // Raw byte damage: truncation and flipped bytes. A truncation that cuts only the
            // trailing whitespace leaves the same document.
            let mut raw = bytes.clone();
            let at = rng.random_range(0..raw.len());
            if rng.random_bool(0.5) {
                raw.truncate(at);
            } else {
                raw[at] = rng.random();
            }
            let cut_whitespace = bytes[raw.len()..].iter().all(u8::is_ascii_whitespace);
            assert!(
                Plan::from_json(&raw).is_err() || raw.len() == bytes.len() || cut_whitespace,
                "a plan truncated to {at} of {} bytes was accepted",
                bytes.len()
            );
        }
    }
    eprintln!("{rejected} of {total} mutated plans rejected");
}

/// Mutated plans that still validate must get a result or a check error from the reference
/// interpreter, and an encoding or an encoding error on every rank, never a panic or a hang: the
/// GPU side encodes whatever the validator lets through, behind the NCCL shim's and the Python
/// package's FFI.
#[test]
fn mutated_fixtures_never_panic_the_reference_or_the_encoding() {
    use mscclpp_core::DataType;
    use mscclpp_executor::algorithm::runnable_message_range;
    use mscclpp_executor::call_bounds::{add_handshakes, needs};
    use mscclpp_executor::encode::encode;
    use mscclpp_executor::reference::{run, RunConfig};
    let mut rng = seed(
        "mutated_fixtures_never_panic_the_reference_or_the_encoding",
        81,
    );
    let (mut ran, mut encoded) = (0, 0);
    for (_, bytes) in common::fixtures() {
        let base: Value = serde_json::from_slice(&bytes).unwrap();
        for _ in 0..120 * rounds() {
            let mut v = base.clone();
            for _ in 0..rng.random_range(1..3) {
                mutate_value(&mut v, &mut rng);
            }
            let Ok(mut plan) = Plan::from_json(&serde_json::to_vec(&v).unwrap()) else {
                continue;
            };
            ran += 1;
            let _ = run(
                &plan,
                RunConfig {
                    dtype: DataType::F32,
                    elems_per_chunk: rng.random_range(1..4),
                    seed: 3,
                },
            );
            let _ = runnable_message_range(&plan);
            let _ = needs(&plan);
            add_handshakes(&mut plan);
            for rank in 0..plan.world_size() {
                if let Ok(e) = encode(&plan, rank, false) {
                    encoded += 1;
                    let _ = (
                        e.device_program(),
                        e.largest_program_bytes(),
                        e.replication(),
                    );
                }
            }
        }
    }
    eprintln!("{ran} mutated plans validated and ran, {encoded} rank encodings made");
}
