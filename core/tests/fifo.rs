//! FIFO protocol tests over heap memory with host pushers (the device protocol, run by threads).

use mscclpp_core::device::trigger_bits::VALID_BIT as TRIGGER_VALID;
use mscclpp_core::fifo::{Fifo, FifoRaw, ProxyTrigger};
use mscclpp_core::Error;
use rstest::rstest;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(20);

/// A trigger whose both words identify sequence number `i` (bit 63 is left to the pusher).
fn trigger(i: u64) -> ProxyTrigger {
    ProxyTrigger {
        fst: i,
        snd: i.wrapping_mul(0x9e37_79b9_7f4a_7c15) & !TRIGGER_VALID,
    }
}

fn check(t: ProxyTrigger, i: u64) {
    let want = trigger(i);
    assert_eq!(t.fst, want.fst, "trigger {i}: fst");
    assert_eq!(t.snd, want.snd | TRIGGER_VALID, "trigger {i}: snd");
}

#[rstest]
#[case(1)]
#[case(3)]
#[case(4)]
#[case(7)]
#[case(64)]
#[case(1000)]
#[case(1024)]
fn order_and_wrap_around(#[case] depth: u32) {
    let mut fifo = Fifo::new(depth).unwrap();
    let pusher = fifo.pusher();
    assert!(fifo.poll().is_none());
    let mut next = 0u64;
    // Several rounds with different fill levels so slots wrap at every offset.
    for round in 0..5u64 {
        let batch = (u64::from(depth) - round % 2).max(1);
        for k in 0..batch {
            let pos = pusher.push(trigger(next + k), T).unwrap();
            assert_eq!(pos, next + k);
        }
        for _ in 0..batch {
            let t = fifo.poll().expect("a pushed trigger is visible");
            check(t, next);
            // Polling twice does not consume.
            assert_eq!(fifo.poll(), Some(t));
            fifo.pop();
            next += 1;
        }
        assert!(fifo.poll().is_none(), "round {round}: empty after draining");
        assert_eq!(fifo.tail(), next);
        assert_eq!(fifo.head(), Some(next));
        pusher.sync(next - 1, T).unwrap();
    }
}

#[test]
fn zero_depth_is_rejected() {
    let err = Fifo::new(0).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
fn from_raw_checks_pointers() {
    let mut words = vec![0u64; 16];
    let base = words.as_mut_ptr();
    let raw = FifoRaw {
        // Deliberately 8 bytes off the 16-byte alignment the ring needs.
        triggers: if base as usize % 16 == 0 {
            base.wrapping_add(1)
        } else {
            base
        }
        .cast(),
        tail: base,
        head: None,
        depth: 2,
    };
    let err = unsafe { Fifo::from_raw(raw, Box::new(())) }.unwrap_err();
    assert!(err.to_string().contains("triggers"), "{err}");
}

#[test]
fn from_raw_round_trip() {
    // 4 slots + tail, 16-byte aligned through u128.
    let mut mem = vec![0u128; 5];
    let base = mem.as_mut_ptr();
    let raw = FifoRaw {
        triggers: base.cast(),
        tail: unsafe { base.add(4) }.cast(),
        head: None,
        depth: 4,
    };
    let mut fifo = unsafe { Fifo::from_raw(raw, Box::new(())) }.unwrap();
    assert_eq!(fifo.head(), None, "no host-readable head was given");
    let p = fifo.pusher();
    for i in 0..10 {
        p.push(trigger(i), T).unwrap();
        check(fifo.poll().unwrap(), i);
        fifo.pop();
    }
    // The tail word the device reads is in the caller's memory.
    assert_eq!(unsafe { *base.add(4).cast::<u64>() }, 10);
    drop(fifo);
    drop(mem);
}

/// Triggers pushed from another thread: none lost, duplicated or reordered. 10^7 through the
/// large rings; 10^6 through the 4-slot ring, where every fourth trigger forces a hand-off between
/// the two threads, which costs a scheduler round trip when the 2-core CI machine is busy.
#[rstest]
#[case(4, 1_000_000)]
#[case(1000, 10_000_000)]
#[case(1024, 10_000_000)]
fn threaded_stream_in_order(#[case] depth: u32, #[case] count: u64) {
    let mut fifo = Fifo::new(depth).unwrap();
    let pusher = fifo.pusher();
    let start = Instant::now();
    let producer = std::thread::spawn(move || {
        for i in 0..count {
            pusher.push(trigger(i), T)?;
        }
        Ok::<_, Error>(())
    });
    // A stall is no progress for this long (not a total budget: a loaded machine is slow, not
    // stuck).
    let stall = Duration::from_secs(30);
    let mut last_progress = Instant::now();
    let mut next = 0u64;
    let mut spins = 0u32;
    while next < count {
        match fifo.poll() {
            Some(t) => {
                if t.fst != next {
                    panic!("trigger {next}: got fst {} (lost or reordered)", t.fst);
                }
                check(t, next);
                fifo.pop();
                next += 1;
                spins = 0;
            }
            None => {
                spins += 1;
                if spins % 64 == 0 {
                    std::thread::yield_now();
                    if spins % 4096 == 0 {
                        let now = Instant::now();
                        if producer.is_finished() {
                            let r = producer.join().unwrap();
                            panic!("producer stopped at trigger {next}: {r:?}");
                        }
                        if spins == 4096 {
                            last_progress = now;
                        }
                        assert!(
                            now - last_progress < stall,
                            "no trigger for {stall:?} at {next}"
                        );
                    }
                }
            }
        }
    }
    producer.join().unwrap().unwrap();
    assert!(fifo.poll().is_none(), "nothing beyond the pushed triggers");
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "fifo depth {depth}: {count} triggers in {secs:.2} s ({:.1} M/s)",
        count as f64 / secs / 1e6
    );
}

#[test]
fn several_pushers_each_keep_their_order() {
    let per: u64 = 50_000;
    let mut fifo = Fifo::new(16).unwrap();
    let threads: Vec<_> = (0..3u64)
        .map(|p| {
            let pusher = fifo.pusher();
            std::thread::spawn(move || {
                for i in 0..per {
                    pusher
                        .push(
                            ProxyTrigger {
                                fst: (p << 32) | i,
                                snd: p,
                            },
                            T,
                        )
                        .unwrap();
                }
            })
        })
        .collect();
    let mut next = [0u64; 3];
    let deadline = Instant::now() + Duration::from_secs(60);
    while next.iter().sum::<u64>() < 3 * per {
        if let Some(t) = fifo.poll() {
            let p = (t.fst >> 32) as usize;
            assert_eq!(t.snd, p as u64 | TRIGGER_VALID);
            assert_eq!(t.fst & 0xffff_ffff, next[p], "pusher {p} out of order");
            next[p] += 1;
            fifo.pop();
        } else {
            assert!(Instant::now() < deadline, "stalled at {next:?}");
            std::thread::yield_now();
        }
    }
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn full_fifo_times_out_instead_of_overwriting() {
    let depth = 4;
    let fifo = Fifo::new(depth).unwrap();
    let pusher = fifo.pusher();
    for i in 0..u64::from(depth) {
        pusher.push(trigger(i), T).unwrap();
    }
    let timeout = Duration::from_millis(200);
    let start = Instant::now();
    let err = pusher.push(trigger(99), timeout).unwrap_err();
    let waited = start.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("FIFO space"), "{err}");
    assert!(
        waited >= timeout && waited < timeout + Duration::from_secs(2),
        "waited {waited:?}"
    );
    // The oldest trigger is intact: nothing was overwritten.
    check(fifo.poll().unwrap(), 0);
    let err = pusher.sync(0, Duration::from_millis(50)).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
}

#[test]
fn pusher_waits_for_space_then_proceeds() {
    let mut fifo = Fifo::new(2).unwrap();
    let pusher = fifo.pusher();
    pusher.push(trigger(0), T).unwrap();
    pusher.push(trigger(1), T).unwrap();
    let blocked = std::thread::spawn(move || pusher.push(trigger(2), T));
    std::thread::sleep(Duration::from_millis(50));
    check(fifo.poll().unwrap(), 0);
    fifo.pop();
    assert_eq!(blocked.join().unwrap().unwrap(), 2);
    check(fifo.poll().unwrap(), 1);
    fifo.pop();
    check(fifo.poll().unwrap(), 2);
}
