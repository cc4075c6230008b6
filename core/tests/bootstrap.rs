//! TcpBootstrap integration tests: ranks as threads and as processes, failure paths, IPv6.
//!
//! The process tests re-invoke this test binary with `BOOTSTRAP_TEST_ROLE` set; the child runs
//! [`child_rank_entry`] as one rank and reports on stdout.

use mscclpp_core::bootstrap::{
    Bootstrap, BootstrapConfig, FailureListener, TcpBootstrap, UniqueId,
};
use mscclpp_core::Error;
use rstest::rstest;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const ROLE_VAR: &str = "BOOTSTRAP_TEST_ROLE";
/// The children's liveness timeout in milliseconds, when set.
const LIVENESS_VAR: &str = "BT_LIVENESS_MS";

fn config(timeout_s: u64) -> BootstrapConfig {
    BootstrapConfig::default().with_timeout(Duration::from_secs(timeout_s))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("an ephemeral port on loopback")
}

/// Runs `f` as every rank of a job joined through a fresh UniqueId, one thread per rank.
fn run_threads<T: Send + 'static>(
    n: usize,
    cfg: BootstrapConfig,
    f: impl Fn(TcpBootstrap) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let id = TcpBootstrap::create_unique_id(&cfg).expect("unique id");
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (id, cfg, f) = (id.clone(), cfg.clone(), Arc::clone(&f));
            std::thread::spawn(move || {
                let b = TcpBootstrap::new(rank, n, &id, &cfg)
                    .unwrap_or_else(|e| panic!("rank {rank} failed to join: {e}"));
                f(b)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

fn pattern(rank: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ rank.wrapping_mul(131)) as u8)
        .collect()
}

#[rstest]
#[case(2)]
#[case(8)]
#[case(64)]
fn collectives_and_tags_over_threads(#[case] n: usize) {
    run_threads(n, config(30), move |b| {
        let r = b.rank();
        // all_gather with sizes that differ per rank.
        let all = b.all_gather(&pattern(r, r % 5 * 3)).unwrap();
        assert_eq!(all.len(), n);
        for (p, got) in all.iter().enumerate() {
            assert_eq!(got, &pattern(p, p % 5 * 3), "rank {r} block {p}");
        }
        b.barrier().unwrap();
        for root in [0, n - 1, n / 2] {
            let got = b.broadcast(root, &pattern(r, 100)).unwrap();
            assert_eq!(got, pattern(root, 100));
        }
        // Tagged messages to the next rank, several tags interleaved, in order per tag.
        let next = (r + 1) % n;
        let prev = (r + n - 1) % n;
        for i in 0..5u8 {
            b.send(next, 7, &[i, r as u8]).unwrap();
            b.send(next, 9, &[100 + i]).unwrap();
        }
        for i in 0..5u8 {
            assert_eq!(b.recv(prev, 9).unwrap(), vec![100 + i]);
        }
        for i in 0..5u8 {
            assert_eq!(b.recv(prev, 7).unwrap(), vec![i, prev as u8]);
        }
        b.barrier().unwrap();
    });
}

/// `try_recv` never waits: nothing before the peer sends, the message once it arrived (in order,
/// per tag), nothing again after it; a sub-bootstrap's tags map like its `recv`'s.
#[test]
fn try_recv_polls_without_waiting() {
    run_threads(2, config(30), |b| {
        let (r, peer) = (b.rank(), 1 - b.rank());
        let started = Instant::now();
        assert_eq!(b.try_recv(peer, 5).unwrap(), None);
        assert!(started.elapsed() < Duration::from_secs(1));
        b.barrier().unwrap();
        b.send(peer, 5, &[r as u8, 1]).unwrap();
        b.send(peer, 5, &[r as u8, 2]).unwrap();
        // The peer's sends came before its barrier: both are queued once the barrier returns.
        b.barrier().unwrap();
        assert_eq!(b.try_recv(peer, 5).unwrap(), Some(vec![peer as u8, 1]));
        assert_eq!(b.try_recv(peer, 5).unwrap(), Some(vec![peer as u8, 2]));
        assert_eq!(b.try_recv(peer, 5).unwrap(), None);
        assert!(matches!(b.try_recv(7, 5), Err(Error::InvalidArgument(_))));
        let b: Arc<dyn Bootstrap> = Arc::new(b);
        let sub = mscclpp_core::bootstrap::SubBootstrap::split(b, &[0, 1]).unwrap();
        sub.send(peer, 6, b"sub").unwrap();
        sub.barrier().unwrap();
        assert_eq!(sub.try_recv(peer, 6).unwrap(), Some(b"sub".to_vec()));
        assert_eq!(sub.try_recv(peer, 6).unwrap(), None);
        // A peer that shut down is an error once its queue is empty: stay until both polled.
        sub.barrier().unwrap();
    });
}

#[test]
fn send_recv_from_several_threads_at_once() {
    const THREADS: u64 = 4;
    const MSGS: u32 = 50;
    run_threads(4, config(30), |b| {
        let b = Arc::new(b);
        let (r, n) = (b.rank(), b.size());
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let mut hs = Vec::new();
        for t in 0..THREADS {
            let s = Arc::clone(&b);
            hs.push(std::thread::spawn(move || {
                for i in 0..MSGS {
                    s.send(next, t, &i.to_le_bytes()).unwrap();
                }
            }));
            let rcv = Arc::clone(&b);
            hs.push(std::thread::spawn(move || {
                for i in 0..MSGS {
                    let m = rcv.recv(prev, t).unwrap();
                    assert_eq!(m, i.to_le_bytes(), "tag {t} out of order");
                }
            }));
        }
        for h in hs {
            h.join().unwrap();
        }
        b.barrier().unwrap();
    });
}

#[rstest]
fn all_gather_sizes_exact(#[values(0, 1, 7, 4096, 1 << 20, 16 << 20)] len: usize) {
    run_threads(4, config(60), move |b| {
        let all = b.all_gather(&pattern(b.rank(), len)).unwrap();
        for (p, got) in all.iter().enumerate() {
            assert!(got == &pattern(p, len), "block {p} of {len} bytes differs");
        }
    });
}

#[test]
fn missing_rank_times_out_everywhere() {
    let timeout = Duration::from_secs(2);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let hs: Vec<_> = (0..3)
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let e = TcpBootstrap::from_address(rank, 4, &addr, &config(2))
                    .err()
                    .expect("rank 3 never joins, so joining must fail");
                (t0.elapsed(), e)
            })
        })
        .collect();
    for h in hs {
        let (took, e) = h.join().unwrap();
        assert!(took < timeout + Duration::from_millis(500), "took {took:?}");
        match e {
            Error::Timeout { what, .. } => assert!(what.contains('3'), "{what}"),
            other => panic!("expected a timeout naming rank 3, got {other}"),
        }
    }
}

#[test]
fn missing_root_times_out() {
    let addr = format!("127.0.0.1:{}", free_port());
    let t0 = Instant::now();
    let e = TcpBootstrap::from_address(1, 2, &addr, &config(1))
        .err()
        .unwrap();
    assert!(t0.elapsed() < Duration::from_millis(1500));
    assert!(
        matches!(&e, Error::Timeout { what, .. } if what.contains("rank 0")),
        "{e}"
    );
}

#[test]
fn closed_peer_wakes_blocked_receiver() {
    let out = run_threads(2, config(20), |b| {
        b.barrier().unwrap();
        if b.rank() == 0 {
            std::thread::sleep(Duration::from_millis(200));
            drop(b);
            None
        } else {
            let t0 = Instant::now();
            let e = b.recv(0, 1).unwrap_err();
            Some((t0.elapsed(), e))
        }
    });
    let (took, e) = out.into_iter().flatten().next().unwrap();
    assert!(took < Duration::from_secs(2), "receiver waited {took:?}");
    assert!(matches!(e, Error::Peer { rank: 0, .. }), "{e}");
}

/// `interrupt` from another thread releases a rank blocked in an all-gather its peer never joins
/// at once (not after the 20 s timeout), with the reason, and fails its later calls the same way;
/// it is local: the peer's bootstrap is not aborted, it learns only when rank 0's goes away
/// (a goodbye: a clean close, not a death), and no listener of either rank is told.
#[test]
fn an_interrupt_releases_a_blocked_collective_and_stays_local() {
    struct Count(Mutex<usize>);
    impl FailureListener for Count {
        fn job_failed(&self, _rank: usize, _reason: &str) {
            *self.0.lock().unwrap() += 1;
        }
    }
    let out = run_threads(2, config(20), |b| {
        let heard = Arc::new(Count(Mutex::new(0)));
        let listener: Weak<dyn FailureListener> = Arc::downgrade(&heard) as _;
        b.watch_failures(listener);
        b.barrier().unwrap();
        if b.rank() == 0 {
            let b = Arc::new(b);
            let blocked = {
                let b = Arc::clone(&b);
                std::thread::spawn(move || {
                    let t0 = Instant::now();
                    (b.all_gather(b"never met"), t0.elapsed())
                })
            };
            std::thread::sleep(Duration::from_millis(300));
            let t0 = Instant::now();
            b.interrupt("ncclCommAbort");
            let interrupt_took = t0.elapsed();
            let (r, took) = blocked.join().unwrap();
            let later = b.barrier();
            let sent = b.send(1, 7, b"x");
            // Rank 1 waits for this before it looks at its own bootstrap.
            std::thread::sleep(Duration::from_millis(300));
            let heard = *heard.0.lock().unwrap();
            drop(b);
            Ok((r.map(|_| ()), took, interrupt_took, later, sent, heard))
        } else {
            // Never joins rank 0's all-gather; meanwhile its bootstrap must stay healthy.
            std::thread::sleep(Duration::from_millis(500));
            let t0 = Instant::now();
            let closed = b.recv(0, 9).unwrap_err();
            let heard = *heard.0.lock().unwrap();
            Err((closed, t0.elapsed(), heard))
        }
    });
    let mut out = out.into_iter();
    let (r, took, interrupt_took, later, sent, heard0) = out.next().unwrap().unwrap();
    assert!(
        matches!(&r, Err(Error::Aborted(why)) if why == "ncclCommAbort"),
        "{r:?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "the blocked all-gather waited {took:?}"
    );
    assert!(
        interrupt_took < Duration::from_millis(100),
        "{interrupt_took:?}"
    );
    assert!(matches!(later, Err(Error::Aborted(_))), "{later:?}");
    assert!(matches!(sent, Err(Error::Aborted(_))), "{sent:?}");
    assert_eq!(heard0, 0, "an interrupt is not a job failure");
    let Err((closed, waited, heard1)) = out.next().unwrap() else {
        panic!("rank 1's result")
    };
    assert!(
        matches!(&closed, Error::Peer { rank: 0, message } if message.contains("shut down")),
        "{closed}"
    );
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert_eq!(heard1, 0, "rank 0's interrupt is not rank 1's failure");
}

/// Ranks that call different collectives at the same point (rank 0 a barrier or a broadcast, the
/// others an all_gather) all fail within a fraction of the 30 s timeout, naming both collectives.
/// A broadcast's root only sends, so its own call succeeds: it learns at its next call, from the
/// abort of the ranks that found out.
#[rstest]
fn ranks_out_of_step_all_fail_at_once_naming_both(
    #[values(2, 3)] n: usize,
    #[values("barrier", "broadcast")] odd: &'static str,
) {
    let out = run_threads(n, config(30), move |b| {
        // One collective in step first, so that the sequence numbers are not 0. A peer that has
        // passed it may go out of step and abort the job before this rank has read the barrier's
        // messages from the other peers (each link has its own reader thread): this rank's
        // barrier then fails with that abort, which names both collectives as well.
        let t0 = Instant::now();
        if let Err(e) = b.barrier() {
            return (t0.elapsed(), Some(e.to_string()));
        }
        let first = match (b.rank(), odd) {
            (0, "barrier") => b.barrier().err(),
            (0, _) => b.broadcast(0, b"x").err(),
            _ => b.all_gather(b"a memory descriptor").err(),
        };
        let e = first.or_else(|| b.barrier().err()).map(|e| e.to_string());
        (t0.elapsed(), e)
    });
    let theirs = match odd {
        "barrier" => "barrier #1",
        _ => "broadcast (root 0) #1",
    };
    for (r, (took, e)) in out.into_iter().enumerate() {
        let e = e.unwrap_or_else(|| panic!("rank {r} did not fail"));
        assert!(took < Duration::from_secs(5), "rank {r} took {took:?}: {e}");
        assert!(
            e.contains("out of step") && e.contains(theirs) && e.contains("all_gather #1"),
            "rank {r}: {e}"
        );
    }
}

#[test]
fn connections_without_the_secret_are_refused() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    // A stray client on the root port before anyone joins: wrong secret, and one sending nothing.
    let silent = std::thread::spawn(move || {
        let mut s = loop {
            if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
                break s;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut junk = b"MSCLPPRS".to_vec();
        junk.resize(60, 0xee);
        let _ = s.write_all(&junk);
        let mut buf = [0u8; 1];
        // Refused connections are closed by the root: EOF (or reset), never data.
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        matches!(s.read(&mut buf), Ok(0) | Err(_))
    });
    let hs: Vec<_> = (0..4)
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let b = TcpBootstrap::from_address(rank, 4, &addr, &config(10)).unwrap();
                // And a stray client on a rank's own listener, mid-job.
                let target = b.peer_addrs()[(rank + 1) % 4];
                let mut s = TcpStream::connect(target).unwrap();
                s.write_all(&[0u8; 60]).unwrap();
                let mut buf = [0u8; 1];
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                assert!(
                    matches!(s.read(&mut buf), Ok(0) | Err(_)),
                    "stray peer got data"
                );
                let all = b.all_gather(&[rank as u8]).unwrap();
                assert_eq!(all, (0..4u8).map(|r| vec![r]).collect::<Vec<_>>());
                b.barrier().unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert!(silent.join().unwrap(), "stray root client received data");
}

#[rstest]
#[case::short(&[0u8; 100][..], "100 bytes, expected 128")]
#[case::magic(&[0u8; 128][..], "bad magic")]
fn malformed_unique_id(#[case] bytes: &[u8], #[case] want: &str) {
    let e = UniqueId::from_bytes(bytes).unwrap_err();
    assert!(matches!(&e, Error::Bootstrap(m) if m.contains(want)), "{e}");
}

#[test]
fn unique_id_round_trips_and_detects_corruption() {
    let id = TcpBootstrap::create_unique_id(&config(5)).unwrap();
    let mut bytes = id.to_bytes();
    assert_eq!(UniqueId::from_bytes(&bytes).unwrap(), id);
    assert_eq!(id.to_hex().parse::<UniqueId>().unwrap(), id);
    bytes[20] ^= 0x40;
    let e = UniqueId::from_bytes(&bytes).unwrap_err().to_string();
    assert!(e.contains("checksum"), "{e}");
    assert!("zz".parse::<UniqueId>().is_err());
}

#[test]
fn port_in_use_names_the_address() {
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let e = TcpBootstrap::from_address(0, 1, &addr, &config(2))
        .err()
        .unwrap();
    let msg = e.to_string();
    assert!(
        msg.contains(&addr) && msg.contains("already in use"),
        "{msg}"
    );
}

#[test]
fn unknown_interface_lists_the_real_ones() {
    let cfg = BootstrapConfig {
        interface: Some("=nosuchif0".into()),
        ..config(2)
    };
    let msg = TcpBootstrap::create_unique_id(&cfg)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("nosuchif0") && msg.contains("lo ("), "{msg}");
}

#[test]
fn ipv6_loopback() {
    let port = match TcpListener::bind("[::1]:0").and_then(|l| l.local_addr()) {
        Ok(a) => a.port(),
        Err(e) => {
            eprintln!("skipping ipv6_loopback: no IPv6 loopback here ({e})");
            return;
        }
    };
    let addr = format!("[::1]:{port}");
    let hs: Vec<_> = (0..4)
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let b = TcpBootstrap::from_address(rank, 4, &addr, &config(10)).unwrap();
                assert!(b.listen_addr().is_ipv6());
                let all = b.all_gather(&pattern(rank, 9)).unwrap();
                for (p, got) in all.iter().enumerate() {
                    assert_eq!(got, &pattern(p, 9));
                }
                b.send((rank + 1) % 4, 3, b"v6").unwrap();
                assert_eq!(b.recv((rank + 3) % 4, 3).unwrap(), b"v6");
                b.barrier().unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

// ---- ranks as processes ----

fn median_us(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e6
}

/// The child side: does nothing unless this binary was re-invoked with `BOOTSTRAP_TEST_ROLE`.
#[test]
fn child_rank_entry() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap().parse::<usize>().unwrap();
    let (rank, size) = (var("BT_RANK"), var("BT_SIZE"));
    let addr = std::env::var("BT_ADDR").unwrap();
    let mut cfg = config(2);
    if let Ok(ms) = std::env::var(LIVENESS_VAR) {
        cfg = cfg.with_liveness_timeout(Duration::from_millis(ms.parse().unwrap()));
    }
    let b = TcpBootstrap::from_address(rank, size, &addr, &cfg).unwrap();
    match role.as_str() {
        "ok" => {
            let (mut ag, mut bar) = (Vec::new(), Vec::new());
            for i in 0..300u64 {
                let t = Instant::now();
                let all = b
                    .all_gather(&(i * 1000 + rank as u64).to_le_bytes())
                    .unwrap();
                ag.push(t.elapsed());
                for (p, got) in all.iter().enumerate() {
                    assert_eq!(got[..], (i * 1000 + p as u64).to_le_bytes());
                }
                let t = Instant::now();
                b.barrier().unwrap();
                bar.push(t.elapsed());
            }
            let got = b.broadcast(size - 1, &[rank as u8; 3]).unwrap();
            assert_eq!(got, vec![(size - 1) as u8; 3]);
            println!(
                "RESULT ok all_gather_median_us={:.1} barrier_median_us={:.1}",
                median_us(ag[50..].to_vec()),
                median_us(bar[50..].to_vec())
            );
        }
        "crash" => {
            for i in 0u64.. {
                if let Err(e) = b.all_gather(&i.to_le_bytes()) {
                    println!("RESULT error {e}");
                    std::io::stdout().flush().unwrap();
                    drop(b);
                    std::process::exit(3);
                }
                if i == 20 {
                    println!("RUNNING");
                    std::io::stdout().flush().unwrap();
                }
            }
        }
        "watch" => {
            // Subscribes like a communicator, then idles as a rank would inside a device wait:
            // it never calls the bootstrap again, so only the liveness path can tell it.
            let (tx, rx) = mpsc::channel();
            let listener = Arc::new(Notify(Mutex::new(tx)));
            let weak: Weak<dyn FailureListener> = Arc::downgrade(&listener) as _;
            b.watch_failures(weak);
            b.barrier().unwrap();
            println!("READY");
            std::io::stdout().flush().unwrap();
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok((blamed, reason)) => println!(
                    "RESULT failed at_unix_ns={} blamed={blamed} reason={reason}",
                    unix_ns()
                ),
                Err(_) => println!("RESULT no failure seen"),
            }
            std::io::stdout().flush().unwrap();
            // Stay up a moment so the other survivors hear of the death, not of our exit.
            std::thread::sleep(Duration::from_secs(2));
            drop(b);
            std::process::exit(3);
        }
        "busy" => {
            // Subscribes, then keeps its main thread busy on the host (no bootstrap call) for
            // several liveness timeouts: the heartbeat thread must keep it alive meanwhile.
            let (tx, rx) = mpsc::channel();
            let listener = Arc::new(Notify(Mutex::new(tx)));
            let weak: Weak<dyn FailureListener> = Arc::downgrade(&listener) as _;
            b.watch_failures(weak);
            b.barrier().unwrap();
            let until = Instant::now() + Duration::from_secs(3);
            let mut x = 0u64;
            while Instant::now() < until {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
            let barrier = b.barrier();
            match (rx.try_recv(), barrier) {
                (Err(_), Ok(())) => println!("RESULT ok"),
                (failed, barrier) => println!("RESULT failed {failed:?} {barrier:?}"),
            }
            std::io::stdout().flush().unwrap();
            drop(b);
            std::process::exit(0);
        }
        "ping" => {
            b.barrier().unwrap();
            println!("READY");
            std::io::stdout().flush().unwrap();
            if rank == 0 {
                // The parent stops the last rank meanwhile.
                std::thread::sleep(Duration::from_millis(1500));
                let silent = b.unresponsive_peers(Duration::from_millis(700));
                println!("RESULT silent={silent:?}");
                std::io::stdout().flush().unwrap();
            } else {
                std::thread::sleep(Duration::from_secs(4));
            }
            std::process::exit(0);
        }
        other => panic!("unknown role {other}"),
    }
}

/// Forwards the failure to the child's main thread.
struct Notify(Mutex<mpsc::Sender<(usize, String)>>);

impl FailureListener for Notify {
    fn job_failed(&self, rank: usize, reason: &str) {
        let _ = self.0.lock().unwrap().send((rank, reason.to_string()));
    }
}

fn unix_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// Reads lines from `c`'s stdout until one contains `what`.
fn wait_for_line(out: &mut impl BufRead, what: &str) {
    let mut line = String::new();
    while !line.contains(what) {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "ended before {what}");
    }
}

fn spawn_rank(role: &str, rank: usize, size: usize, addr: &str) -> Child {
    spawn_rank_with(role, rank, size, addr, &[])
}

fn spawn_rank_with(
    role: &str,
    rank: usize,
    size: usize,
    addr: &str,
    env: &[(&str, &str)],
) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .envs(env.iter().copied())
        .args([
            "child_rank_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, role)
        .env("BT_RANK", rank.to_string())
        .env("BT_SIZE", size.to_string())
        .env("BT_ADDR", addr)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

fn wait_with_deadline(c: &mut Child, deadline: Instant) -> ExitStatus {
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            panic!("rank process {} hung", c.id());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn result_line(c: &mut Child) -> String {
    result_of(&mut c.stdout.take().unwrap())
}

/// The RESULT line a child prints.
fn result_of(out: &mut impl Read) -> String {
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    // libtest prints "test child_rank_entry ... " before the child's own output on that line.
    rest.lines()
        .find_map(|l| l.find("RESULT").map(|at| l[at..].to_string()))
        .unwrap_or_default()
}

/// Every child's stdout, read up to the READY it prints once its listener runs.
fn ready_outputs(kids: &mut [Child]) -> Vec<BufReader<ChildStdout>> {
    kids.iter_mut()
        .map(|c| {
            let mut out = BufReader::new(c.stdout.take().unwrap());
            wait_for_line(&mut out, "READY");
            out
        })
        .collect()
}

/// How long after `event_ns` (Unix ns) rank `r`'s failure listener fired, by its exit status `st`
/// and RESULT `line`: it must have failed (exit code 3) blaming `victim`.
fn blamed_after(r: usize, st: ExitStatus, line: &str, victim: usize, event_ns: u128) -> Duration {
    assert_eq!(st.code(), Some(3), "rank {r}: {st} {line}");
    let at: u128 = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("at_unix_ns="))
        .unwrap_or_else(|| panic!("rank {r}: {line}"))
        .parse()
        .unwrap();
    assert!(
        line.contains(&format!("blamed={victim} ")),
        "rank {r} blamed the wrong rank: {line}"
    );
    Duration::from_nanos(at.saturating_sub(event_ns) as u64)
}

#[test]
fn eight_processes() {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut kids: Vec<Child> = (0..8).map(|r| spawn_rank("ok", r, 8, &addr)).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    for (r, c) in kids.iter_mut().enumerate() {
        let st = wait_with_deadline(c, deadline);
        let line = result_line(c);
        assert!(
            st.success() && line.starts_with("RESULT ok"),
            "rank {r}: {st} {line}"
        );
        if r == 0 {
            eprintln!("8 processes, rank 0: {line}");
        }
    }
}

#[test]
fn killed_process_fails_the_others() {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut kids: Vec<Child> = (0..8).map(|r| spawn_rank("crash", r, 8, &addr)).collect();
    // Wait until rank 3 is mid-run, then SIGKILL it.
    let mut out = BufReader::new(kids[3].stdout.take().unwrap());
    wait_for_line(&mut out, "RUNNING");
    kids[3].kill().unwrap();
    let _ = kids[3].wait();
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(10);
    for (r, c) in kids.iter_mut().enumerate() {
        if r == 3 {
            continue;
        }
        let st = wait_with_deadline(c, deadline);
        let line = result_line(c);
        assert_eq!(st.code(), Some(3), "rank {r}: {st} {line}");
        assert!(line.starts_with("RESULT error"), "rank {r}: {line}");
    }
    eprintln!("all surviving ranks failed within {:?}", t0.elapsed());
}

/// A SIGKILLed rank (no goodbye, no cooperation) makes every other rank's failure listener fire
/// within a second, blaming it, while those ranks make no bootstrap call at all.
#[rstest]
#[case::middle_of_four(4, 2)]
#[case::root_of_three(3, 0)]
#[case::last_of_five(5, 4)]
fn killed_rank_fires_every_listener_within_a_second(#[case] n: usize, #[case] victim: usize) {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut kids: Vec<Child> = (0..n).map(|r| spawn_rank("watch", r, n, &addr)).collect();
    let mut outs = ready_outputs(&mut kids);
    // Let the liveness links settle, then kill the victim outright.
    std::thread::sleep(Duration::from_millis(200));
    let killed_at = unix_ns();
    kids[victim].kill().unwrap();
    let _ = kids[victim].wait();
    let deadline = Instant::now() + Duration::from_secs(10);
    for (r, c) in kids.iter_mut().enumerate() {
        if r == victim {
            continue;
        }
        let st = wait_with_deadline(c, deadline);
        let line = result_of(&mut outs[r]);
        let after = blamed_after(r, st, &line, victim, killed_at);
        assert!(
            after < Duration::from_secs(1),
            "rank {r} heard after {after:?}: {line}"
        );
        eprintln!("rank {r}: failure seen {after:?} after the kill");
    }
}

/// A stopped rank (SIGSTOP: sockets open, nobody reading) is named by `unresponsive_peers`, and
/// only it.
#[test]
fn stopped_rank_is_named_unresponsive() {
    let n = 3;
    let addr = format!("127.0.0.1:{}", free_port());
    let mut kids: Vec<Child> = (0..n).map(|r| spawn_rank("ping", r, n, &addr)).collect();
    let mut outs = ready_outputs(&mut kids);
    let victim = kids[n - 1].id().to_string();
    let signal = |sig: &str| {
        let st = Command::new("kill").args([sig, &victim]).status().unwrap();
        assert!(st.success(), "kill {sig} {victim}");
    };
    signal("-STOP");
    let st = wait_with_deadline(&mut kids[0], Instant::now() + Duration::from_secs(10));
    signal("-CONT");
    let mut rest = String::new();
    outs[0].read_to_string(&mut rest).unwrap();
    for c in &mut kids[1..] {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert!(st.success(), "rank 0: {st} {rest}");
    assert!(
        rest.contains(&format!("RESULT silent=[{}]", n - 1)),
        "rank 0: {rest}"
    );
}

/// A SIGSTOPped rank (sockets open, every thread stopped) is blamed by the heartbeat: every other
/// rank's listener fires within the liveness timeout plus a beat, naming it as stalled, while
/// those ranks make no bootstrap call at all.
#[test]
fn stopped_rank_is_blamed_by_the_heartbeat() {
    let (n, victim, liveness) = (4, 1, Duration::from_millis(1500));
    let addr = format!("127.0.0.1:{}", free_port());
    let ms = liveness.as_millis().to_string();
    let mut kids: Vec<Child> = (0..n)
        .map(|r| spawn_rank_with("watch", r, n, &addr, &[(LIVENESS_VAR, ms.as_str())]))
        .collect();
    let mut outs = ready_outputs(&mut kids);
    std::thread::sleep(Duration::from_millis(300));
    let pid = kids[victim].id().to_string();
    let stopped_at = unix_ns();
    assert!(Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut results = Vec::new();
    for (r, c) in kids.iter_mut().enumerate() {
        if r != victim {
            let st = wait_with_deadline(c, deadline);
            results.push((r, st, result_of(&mut outs[r])));
        }
    }
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    let _ = kids[victim].kill();
    let _ = kids[victim].wait();
    for (r, st, line) in results {
        let after = blamed_after(r, st, &line, victim, stopped_at);
        assert!(
            line.contains(&format!("rank {victim} stalled: no heartbeat for")),
            "rank {r}: {line}"
        );
        // The victim's last beat came up to one period (liveness / 10) before the stop; the
        // upper bound leaves room for a loaded CI machine.
        assert!(
            after + liveness / 10 >= liveness && after < liveness + Duration::from_secs(2),
            "rank {r} heard after {after:?}: {line}"
        );
        eprintln!("rank {r}: stall seen {after:?} after the SIGSTOP");
    }
}

/// Ranks whose main threads are busy on the host for three liveness timeouts, with no bootstrap
/// call, are not blamed: the heartbeat runs on its own thread.
#[test]
fn busy_ranks_are_not_blamed() {
    let n = 3;
    let addr = format!("127.0.0.1:{}", free_port());
    let mut kids: Vec<Child> = (0..n)
        .map(|r| spawn_rank_with("busy", r, n, &addr, &[(LIVENESS_VAR, "1000")]))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    for (r, c) in kids.iter_mut().enumerate() {
        let st = wait_with_deadline(c, deadline);
        let line = result_line(c);
        assert!(st.success() && line == "RESULT ok", "rank {r}: {st} {line}");
    }
}
