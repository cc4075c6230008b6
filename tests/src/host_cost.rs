//! What a call costs the calling thread on the host: wall and thread CPU time per call, medians
//! of batches of back-to-back calls.

use mscclpp::core::Result;
use std::time::{Duration, Instant};

/// Batches of every measurement; the median one is reported.
const BATCHES: usize = 5;

/// Per-call cost of `call` on this thread: (wall µs, thread CPU µs), each the median of 5 batches
/// of 200 back-to-back calls.
pub fn per_call_cost(call: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    per_call_cost_settled(200, call, || Ok(()))
}

/// [`per_call_cost`] with `calls` calls a batch and `settle` run after each batch, untimed (a
/// stream sync, so that kernels slower than their launches never fill the launch queue).
pub fn per_call_cost_settled(
    calls: u32,
    mut call: impl FnMut() -> Result<()>,
    mut settle: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for _ in 0..BATCHES {
        let (t, c) = (Instant::now(), thread_cpu_time());
        for _ in 0..calls {
            call()?;
        }
        wall.push(t.elapsed().as_secs_f64() * 1e6 / f64::from(calls));
        cpu.push((thread_cpu_time() - c).as_secs_f64() * 1e6 / f64::from(calls));
        settle()?;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((median(&mut wall), median(&mut cpu)))
}

/// CPU time this thread has used (CLOCK_THREAD_CPUTIME_ID): what the host path costs the caller,
/// without time the thread spent descheduled.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec; the clock id is valid on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
