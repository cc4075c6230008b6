//! The bootstrap self-check: every rank runs timed 8-byte all_gathers and barriers over the TCP
//! bootstrap, checks every all_gather result, and rank 0 prints median/p99 latencies.
//!
//! Launched plainly, the bench spawns N copies of itself on loopback and sets torchrun-style
//! variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) plus MSCCLPP_MASTER_ADDR/PORT for
//! them, so each child takes exactly the path a real launcher's rank would.

use mscclpp_core::bootstrap::{Bootstrap, TcpBootstrap};
use mscclpp_core::env::Env;
use mscclpp_core::{Error, Result};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, ChildStderr, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What one self-check run does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelfCheckArgs {
    pub iters: usize,
    pub warmup: usize,
}

/// Latency summary of one operation on one rank, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Stats {
    median_us: f64,
    p99_us: f64,
}

impl Stats {
    fn of(mut samples: Vec<Duration>) -> Stats {
        samples.sort();
        let at = |q: f64| {
            let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
            samples.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
        };
        Stats {
            median_us: at(0.5),
            p99_us: at(0.99),
        }
    }
}

/// Runs this process as one rank of the launcher's job.
pub fn run_rank(env: &Env, args: &SelfCheckArgs) -> Result<()> {
    let b = TcpBootstrap::from_env(env)?;
    let (rank, size) = (b.rank(), b.size());
    let mut ag = Vec::with_capacity(args.iters);
    let mut bar = Vec::with_capacity(args.iters);
    for i in 0..args.warmup + args.iters {
        let value = |r: usize| (i as u64) * (size as u64) + r as u64;
        let t = Instant::now();
        let all = b.all_gather(&value(rank).to_le_bytes())?;
        let t_ag = t.elapsed();
        for (p, got) in all.iter().enumerate() {
            if got[..] != value(p).to_le_bytes() {
                return Err(Error::Internal(format!(
                    "self-check: iteration {i}: rank {rank} received {got:?} from rank {p}, \
                     expected {:?}",
                    value(p).to_le_bytes()
                )));
            }
        }
        let t = Instant::now();
        b.barrier()?;
        let t_bar = t.elapsed();
        if i >= args.warmup {
            ag.push(t_ag);
            bar.push(t_bar);
        }
    }
    let (ag, bar) = (Stats::of(ag), Stats::of(bar));
    // Every rank's medians travel to rank 0, which reports the slowest rank alongside its own.
    let mine: Vec<u8> = [ag.median_us, bar.median_us]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let all = b.all_gather(&mine)?;
    let worst = |k: usize| {
        all.iter()
            .filter_map(|m| m.get(8 * k..8 * k + 8))
            .filter_map(|s| s.try_into().ok().map(f64::from_le_bytes))
            .fold(0.0f64, f64::max)
    };
    if rank == 0 {
        println!(
            "# mscclpp-bench bootstrap self-check: {size} ranks, {} iterations after {} warm-up, \
             root {}",
            args.iters,
            args.warmup,
            b.peer_addrs()[0]
        );
        println!("#");
        println!(
            "# {:<12} {:>6} {:>12} {:>10} {:>18}",
            "operation", "bytes", "median(us)", "p99(us)", "worst median(us)"
        );
        for (name, bytes, s, w) in [
            ("all_gather", 8, ag, worst(0)),
            ("barrier", 0, bar, worst(1)),
        ] {
            println!(
                "  {:<12} {:>6} {:>12.1} {:>10.1} {:>18.1}",
                name, bytes, s.median_us, s.p99_us, w
            );
        }
        println!("# self-check passed: every all_gather result verified on every rank");
    }
    b.barrier()?;
    Ok(())
}

fn free_loopback_port() -> Result<u16> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Error::io("finding a free port on 127.0.0.1 for the bootstrap root", e))
}

/// Spawns `n` ranks of this executable (same arguments) on loopback and waits for them. Each
/// rank bounds its own waits by the bootstrap timeout; `deadline` is a last resort against a
/// child that hangs anyway. The ranks' stderr passes through; a failure is reported as the first
/// failing rank's own error (`Error::Peer`), not as a failure of the spawn.
pub fn spawn_local(n: usize, passthrough: &[String], env: &Env) -> Result<()> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::io("locating the mscclpp-bench executable", e))?;
    let port = free_loopback_port()?;
    let mut kids: Vec<(usize, Child, Option<StderrTail>)> = Vec::with_capacity(n);
    for rank in 0..n {
        let spawned = Command::new(&exe)
            .args(passthrough)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MSCCLPP_MASTER_ADDR", "127.0.0.1")
            .env("MSCCLPP_MASTER_PORT", port.to_string())
            .stderr(Stdio::piped())
            .spawn();
        match spawned {
            Ok(mut c) => {
                let stderr = c.stderr.take();
                kids.push((rank, c, stderr.map(forward_stderr)));
            }
            Err(e) => {
                for (_, c, _) in &mut kids {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(Error::io(format!("spawning rank {rank} of {n}"), e));
            }
        }
    }
    let deadline = Instant::now() + env.bootstrap_timeout * 4 + Duration::from_secs(600);
    let mut failed = Vec::new();
    let mut first_error: Option<(usize, String)> = None;
    for (rank, c, stderr) in &mut kids {
        let status = loop {
            match c.try_wait() {
                Ok(Some(st)) => break Some(st),
                Ok(None) if Instant::now() > deadline => {
                    let _ = c.kill();
                    let _ = c.wait();
                    break None;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return Err(Error::io(format!("waiting for rank {rank}"), e)),
            }
        };
        let said = stderr.take().and_then(|h| h.join().ok().flatten());
        match status {
            Some(st) if st.success() => continue,
            Some(st) => failed.push(format!("rank {rank} exited with {st}")),
            None => failed.push(format!("rank {rank} hung and was killed")),
        }
        if first_error.is_none() {
            first_error = said.map(|m| (*rank, m));
        }
    }
    match (first_error, failed.is_empty()) {
        (_, true) => Ok(()),
        (Some((rank, message)), false) => Err(Error::Peer {
            rank,
            message: format!("{message} ({})", failed.join("; ")),
        }),
        (None, false) => Err(Error::Bootstrap(format!(
            "self-check failed: {}",
            failed.join("; ")
        ))),
    }
}

/// A failure of [`spawn_local`] as the caller reports it: a rank's own error as it is, anything
/// else (a hang, a crash without a message) under `what`.
pub fn ranks_failed(what: &str, e: Error) -> Error {
    match e {
        Error::Peer { .. } => e,
        other => Error::Internal(format!("{what}: {other}")),
    }
}

/// The thread forwarding one rank's stderr; it answers the rank's last error message.
type StderrTail = JoinHandle<Option<String>>;

/// Copies a rank's stderr to ours line by line; returns the text of its last error line (what
/// `main` prints after "error: "), if any.
fn forward_stderr(stderr: ChildStderr) -> StderrTail {
    std::thread::spawn(move || {
        let mut last = None;
        for line in BufReader::new(stderr)
            .lines()
            .map_while(std::io::Result::ok)
        {
            eprintln!("{line}");
            if let Some((_, message)) = line.split_once(": error: ") {
                last = Some(message.to_string());
            }
        }
        last
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_median_and_p99() {
        let s = Stats::of((1..=100).map(Duration::from_micros).collect());
        assert_eq!(s.median_us.round(), 51.0);
        assert_eq!(s.p99_us.round(), 99.0);
    }
}
