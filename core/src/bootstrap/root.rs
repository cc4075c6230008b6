//! The bootstrap root: a thread in rank 0's process that collects every rank's listening address
//! and hands the complete table back to all of them, once.
//!
//! Each incoming connection is handshaken on its own short-lived thread, so a silent or hostile
//! connection cannot delay the others; connections without the job secret are logged and
//! dropped. If some rank has not joined by the deadline, every rank that did join is told which
//! ranks are missing, so all of them fail with the same clear error instead of each timing out.

use super::sock::accept_polled;
use super::wire::{read_exact_until, secrets_equal, Hello, HelloKind, RootReply, Secret};
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A running root. Dropping it stops it (joined ranks are told the root shut down).
pub(crate) struct RootServer {
    stop: Arc<AtomicBool>,
    coordinator: Option<JoinHandle<()>>,
    acceptor: Option<JoinHandle<()>>,
}

struct Joined {
    hello: Hello,
    stream: TcpStream,
    from: SocketAddr,
}

impl RootServer {
    /// Starts serving on `listener`. `deadline` bounds the whole join phase; `timeout` is the
    /// configured step bound, reported in errors.
    pub fn start(
        listener: TcpListener,
        size: usize,
        secret: Secret,
        deadline: Instant,
        timeout: Duration,
    ) -> std::io::Result<RootServer> {
        let stop = Arc::new(AtomicBool::new(false));
        let addr = listener.local_addr()?;
        let (tx, rx) = mpsc::channel::<Joined>();
        let acceptor = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("mscclpp-bootstrap-root-accept".into())
                .spawn(move || {
                    crate::process::run_guarded("mscclpp-bootstrap-root-accept", || {
                        accept_loop(listener, &stop, tx, secret, deadline, timeout)
                    })
                })?
        };
        let coordinator = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("mscclpp-bootstrap-root".into())
                .spawn(move || {
                    crate::process::run_guarded("mscclpp-bootstrap-root", || {
                        coordinate(addr, size, rx, &stop, deadline, timeout)
                    })
                })?
        };
        Ok(RootServer {
            stop,
            coordinator: Some(coordinator),
            acceptor: Some(acceptor),
        })
    }
}

impl Drop for RootServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for h in [self.coordinator.take(), self.acceptor.take()]
            .into_iter()
            .flatten()
        {
            if h.join().is_err() {
                tracing::error!("bootstrap root thread panicked");
            }
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    stop: &AtomicBool,
    tx: mpsc::Sender<Joined>,
    secret: Secret,
    deadline: Instant,
    timeout: Duration,
) {
    loop {
        match accept_polled(&listener, stop) {
            Ok(Some((stream, from))) => {
                let tx = tx.clone();
                // Detached on purpose: its life is bounded by the join deadline.
                let spawned = std::thread::Builder::new()
                    .name("mscclpp-bootstrap-root-hello".into())
                    .spawn(move || {
                        crate::process::run_guarded("mscclpp-bootstrap-root-hello", || {
                            if let Some(j) = handshake(stream, from, &secret, deadline, timeout) {
                                // The coordinator may be gone already (job started or failed).
                                let _ = tx.send(j);
                            }
                        })
                    });
                if let Err(e) = spawned {
                    tracing::warn!(
                        "bootstrap root: cannot spawn a handshake thread for {from}: {e}"
                    );
                }
            }
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("bootstrap root: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Reads and checks one rank's Root hello; `None` (after a warning) for anything that is not a
/// rank of this job.
fn handshake(
    mut stream: TcpStream,
    from: SocketAddr,
    secret: &Secret,
    deadline: Instant,
    timeout: Duration,
) -> Option<Joined> {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::warn!("bootstrap root: TCP_NODELAY on connection from {from}: {e}");
    }
    let mut buf = [0u8; Hello::LEN];
    if let Err(e) = read_exact_until(&mut stream, &mut buf, deadline, timeout, 0, "a handshake") {
        tracing::warn!("bootstrap root: refused connection from {from}: no valid handshake ({e})");
        return None;
    }
    let hello = match Hello::decode(&buf) {
        Ok(h) => h,
        Err(why) => {
            tracing::warn!("bootstrap root: refused connection from {from}: {why}");
            return None;
        }
    };
    if !secrets_equal(&hello.secret, secret) {
        tracing::warn!(
            "bootstrap root: refused connection from {from} claiming rank {}: wrong job secret \
             (a rank of another job, or a stray client)",
            hello.rank
        );
        return None;
    }
    if hello.kind != HelloKind::Root {
        tracing::warn!("bootstrap root: refused connection from {from}: not a join request");
        return None;
    }
    Some(Joined {
        hello,
        stream,
        from,
    })
}

fn reply(j: &mut Joined, r: &RootReply, timeout: Duration) {
    let sent = j
        .stream
        .set_write_timeout(Some(timeout))
        .and_then(|_| j.stream.write_all(&r.encode()));
    if let Err(e) = sent {
        tracing::warn!(
            "bootstrap root: cannot answer rank {} at {}: {e}",
            j.hello.rank,
            j.from
        );
    }
}

fn coordinate(
    addr: SocketAddr,
    size: usize,
    rx: mpsc::Receiver<Joined>,
    stop: &AtomicBool,
    deadline: Instant,
    timeout: Duration,
) {
    let mut joined: Vec<Option<Joined>> = (0..size).map(|_| None).collect();
    let mut count = 0;
    let failure = loop {
        if count == size {
            break None;
        }
        if stop.load(Ordering::Acquire) {
            break Some(format!(
                "the root at {addr} shut down before every rank joined"
            ));
        }
        let now = Instant::now();
        if now >= deadline {
            break Some(format!(
                "{count} of {size} ranks joined the root at {addr} within {timeout:?}"
            ));
        }
        let slice = (deadline - now).min(Duration::from_millis(50));
        let mut j = match rx.recv_timeout(slice) {
            Ok(j) => j,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                break Some(format!("the root at {addr} stopped accepting connections"))
            }
        };
        let (rank, their_size) = (j.hello.rank as usize, j.hello.size as usize);
        let problem = if their_size != size {
            Some(format!(
                "rank {rank} at {} says the job has {their_size} ranks, the root expects {size}",
                j.from
            ))
        } else if rank >= size {
            Some(format!(
                "rank {rank} at {} is out of range for {size} ranks",
                j.from
            ))
        } else if let Some(prev) = &joined[rank] {
            Some(format!(
                "rank {rank} joined twice: from {} and from {}",
                prev.from, j.from
            ))
        } else {
            None
        };
        match problem {
            Some(message) => {
                // Only this connection is refused; the right rank may still arrive.
                tracing::warn!("bootstrap root: {message}");
                reply(
                    &mut j,
                    &RootReply::Failed {
                        missing: Vec::new(),
                        message,
                    },
                    timeout,
                );
            }
            None => {
                joined[rank] = Some(j);
                count += 1;
            }
        }
    };
    let answer = match failure {
        None => RootReply::Table(joined.iter().flatten().map(|j| j.hello.listen).collect()),
        Some(message) => {
            let missing: Vec<u32> = (0..size)
                .filter(|&r| joined[r].is_none())
                .map(|r| r as u32)
                .collect();
            tracing::error!("bootstrap root: ranks {missing:?} did not join: {message}");
            RootReply::Failed { missing, message }
        }
    };
    for j in joined.iter_mut().flatten() {
        reply(j, &answer, timeout);
    }
    // Late connections have nothing to join any more: stop the acceptor too.
    stop.store(true, Ordering::Release);
    tracing::debug!("bootstrap root at {addr} done");
}
