//! Socket plumbing shared by the root and the ranks: binding with clear errors, connecting with
//! retries until a deadline, and an accept loop that can be stopped.

use super::wire::remaining;
use crate::error::{Error, Result};
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How often a stoppable accept loop looks at its stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(50);

/// Binds a listener; "address in use" and "address not on this host" name the address and the
/// likely cause. `what` says whose listener it is.
pub(crate) fn bind_listener(addr: SocketAddr, what: &str) -> Result<TcpListener> {
    TcpListener::bind(addr).map_err(|e| match e.kind() {
        ErrorKind::AddrInUse => Error::Bootstrap(format!(
            "cannot listen on {addr} for {what}: address already in use (another job, or an \
             earlier run still holding the port?)"
        )),
        ErrorKind::AddrNotAvailable => Error::Bootstrap(format!(
            "cannot listen on {addr} for {what}: that address does not belong to this host"
        )),
        _ => Error::io(format!("binding {addr} for {what}"), e),
    })
}

/// Connects to `addr`, retrying refused/unreachable attempts (the listener may not exist yet)
/// until `deadline`. Sets TCP_NODELAY: bootstrap messages are small and latency-bound.
pub(crate) fn connect_until(
    addr: SocketAddr,
    deadline: Instant,
    timeout: Duration,
    what: &str,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(2);
    let mut last_err = None;
    while Instant::now() < deadline {
        let attempt = remaining(deadline).min(Duration::from_secs(2));
        match TcpStream::connect_timeout(&addr, attempt) {
            Ok(s) => {
                s.set_nodelay(true)
                    .map_err(|e| Error::io(format!("setting TCP_NODELAY on {what}"), e))?;
                return Ok(s);
            }
            Err(e) => {
                last_err = Some(e);
                std::thread::sleep(backoff.min(remaining(deadline)));
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
        }
    }
    Err(Error::Timeout {
        what: match last_err {
            Some(e) => format!("{what} to accept a connection (last attempt: {e})"),
            None => format!("{what} to accept a connection"),
        },
        timeout,
    })
}

/// Waits for the next connection, giving up (`Ok(None)`) once `stop` is set. Errors are returned
/// to the caller, which logs them and keeps accepting: a failed accept must not end the job.
pub(crate) fn accept_polled(
    listener: &TcpListener,
    stop: &AtomicBool,
) -> std::io::Result<Option<(TcpStream, SocketAddr)>> {
    listener.set_nonblocking(true)?;
    loop {
        if stop.load(Ordering::Acquire) {
            return Ok(None);
        }
        let mut pfd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ACCEPT_POLL.as_millis() as libc::c_int) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if rc == 0 {
            continue;
        }
        // The listener is non-blocking, so a connection that vanished between poll and accept
        // gives WouldBlock instead of blocking past a stop request.
        match listener.accept() {
            Ok((s, peer)) => {
                s.set_nonblocking(false)?;
                return Ok(Some((s, peer)));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}
