//! Two-process RDMA loopback over a real HCA: rank 0 (the test process) and rank 1 (the same test
//! binary re-run as a child) connect one RC queue pair each through a local TCP socket, then
//! ping-pong a 1 MiB buffer: rank 0 writes it and signals; rank 1 waits for the signal, checks the
//! bytes, writes them back and signals. Two rounds check the semaphore's running value.
//!
//! Runs in both signalling modes. Skips with a printed reason when `MSCCLPP_DISABLE_IB_TESTS=1`,
//! when libibverbs is absent, or when no HCA exists (the development machine and CI have none).

use mscclpp_core::env::Env;
use mscclpp_core::transport::{HostMemoryRegistry, MemoryRegion, MemoryResolver};
use mscclpp_core::{Error, Result, Transport};
use mscclpp_ib::{ib_skip_reason, open_ib, IbConfig, IbContext, IbTransport};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ROLE_VAR: &str = "MSCCLPP_IB_LOOPBACK_ROLE";
const PORT_VAR: &str = "MSCCLPP_IB_LOOPBACK_PORT";
const BYTES: usize = 1 << 20;
const ROUNDS: u64 = 2;
const WAIT: Duration = Duration::from_secs(30);

/// Zeroed, page-aligned host memory the HCA may write; freed on drop.
struct Buffer {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Buffer {
    fn new(len: usize) -> Buffer {
        let layout = std::alloc::Layout::from_size_align(len, 4096).expect("valid layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocating {len} bytes");
        Buffer { ptr, layout }
    }

    /// A copy of the contents; called only after the semaphore that orders the RDMA writes.
    fn snapshot(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.layout.size()];
        // SAFETY: `ptr` holds `size` bytes; volatile-free copy is fine after the acquire load.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, v.as_mut_ptr(), v.len()) };
        v
    }

    fn fill(&self, seed: u8) {
        for i in 0..self.layout.size() {
            // SAFETY: in bounds.
            unsafe { *self.ptr.add(i) = seed.wrapping_add((i % 251) as u8) };
        }
    }

    fn word(&self) -> &AtomicU64 {
        // SAFETY: page-aligned, at least 8 bytes, and only accessed atomically by us.
        unsafe { &*(self.ptr as *const AtomicU64) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

fn send_msg(s: &mut TcpStream, b: &[u8]) -> Result<()> {
    let io = |e| Error::io("loopback exchange send", e);
    s.write_all(&(b.len() as u32).to_le_bytes()).map_err(io)?;
    s.write_all(b).map_err(io)
}

fn recv_msg(s: &mut TcpStream) -> Result<Vec<u8>> {
    let io = |e| Error::io("loopback exchange recv", e);
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(io)?;
    let mut b = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut b).map_err(io)?;
    Ok(b)
}

fn exchange(s: &mut TcpStream, b: &[u8]) -> Result<Vec<u8>> {
    send_msg(s, b)?;
    recv_msg(s)
}

fn region_bytes(r: &MemoryRegion) -> Vec<u8> {
    [
        r.addr.to_le_bytes().as_slice(),
        &r.size.to_le_bytes(),
        &r.key.to_le_bytes(),
    ]
    .concat()
}

fn region_from(b: &[u8]) -> MemoryRegion {
    assert_eq!(b.len(), 20, "region message");
    MemoryRegion {
        addr: u64::from_le_bytes(b[0..8].try_into().unwrap()),
        size: u64::from_le_bytes(b[8..16].try_into().unwrap()),
        key: u32::from_le_bytes(b[16..20].try_into().unwrap()),
    }
}

fn wait_for(word: &AtomicU64, value: u64, what: &str) {
    let start = Instant::now();
    while word.load(Ordering::Acquire) < value {
        assert!(
            start.elapsed() < WAIT,
            "timed out waiting for {what} to reach {value}"
        );
        std::hint::spin_loop();
    }
}

/// One rank's side of the ping-pong.
fn run_rank(rank: usize, ctx: &IbContext, mut sock: TcpStream) {
    sock.set_read_timeout(Some(WAIT)).unwrap();
    let peer = 1 - rank;
    let data = Buffer::new(BYTES);
    let sem = Buffer::new(4096);
    // SAFETY: both buffers outlive their registrations (dropped after them, below).
    let data_mr = unsafe { ctx.register(data.ptr, BYTES) }.expect("register data");
    let sem_mr = unsafe { ctx.register(sem.ptr, 4096) }.expect("register semaphore");
    let conn = IbTransport::connect(ctx, IbConfig::new(rank, peer), |b| exchange(&mut sock, b))
        .expect("connect");
    eprintln!("rank {rank}: {conn:?}");
    if conn.is_no_atomic() {
        let registry = Arc::new(HostMemoryRegistry::new());
        // SAFETY: `sem` outlives the transport; we only read it atomically.
        let local = unsafe { registry.register(sem.ptr, 4096) }.unwrap();
        conn.set_signal_destination(registry as Arc<dyn MemoryResolver>, local, 0)
            .expect("signal destination");
    }
    let peer_data = region_from(&exchange(&mut sock, &region_bytes(&data_mr.remote())).unwrap());
    let peer_sem = region_from(&exchange(&mut sock, &region_bytes(&sem_mr.remote())).unwrap());
    for round in 1..=ROUNDS {
        if rank == 0 {
            data.fill(round as u8);
            conn.write(&peer_data, 0, &data_mr.local(), 0, BYTES as u64)
                .unwrap();
            conn.update_and_sync(&peer_sem, 0, round).unwrap();
            conn.flush(WAIT).unwrap();
            let sent = data.snapshot();
            wait_for(sem.word(), round, "the echo signal");
            assert!(
                data.snapshot() == sent,
                "round {round}: echoed bytes differ"
            );
        } else {
            wait_for(sem.word(), round, "the data signal");
            let got = data.snapshot();
            let want: Vec<u8> = (0..BYTES)
                .map(|i| (round as u8).wrapping_add((i % 251) as u8))
                .collect();
            assert!(got == want, "round {round}: received bytes differ");
            conn.write(&peer_data, 0, &data_mr.local(), 0, BYTES as u64)
                .unwrap();
            conn.update_and_sync(&peer_sem, 0, round).unwrap();
            conn.flush(WAIT).unwrap();
        }
    }
    // Both sides finish before either tears down its queue pair.
    exchange(&mut sock, b"done").unwrap();
    drop(conn);
    drop((data_mr, sem_mr));
}

fn loopback(test_name: &str, mode: &str) {
    if std::env::var(ROLE_VAR).as_deref() == Ok("child") {
        let port: u16 = std::env::var(PORT_VAR).unwrap().parse().unwrap();
        let ctx = open_ib(Env::get().unwrap()).expect("child: open_ib");
        let sock = TcpStream::connect(("127.0.0.1", port)).expect("child: connect to parent");
        run_rank(1, &ctx, sock);
        return;
    }
    let env = match Env::get() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("skipping {test_name}: the environment does not parse: {e}");
            return;
        }
    };
    if let Some(reason) = ib_skip_reason(env) {
        eprintln!("skipping {test_name}: {reason}");
        return;
    }
    // Each process reads MSCCLPP_IBV_MODE from its environment; the child gets `mode` explicitly
    // and the parent's mode is irrelevant because the connection negotiates no-atomic if either
    // side asks; for the atomic case the parent must not ask for it either.
    if mode == "host" && env.ibv_mode != mscclpp_core::env::IbvMode::Host {
        eprintln!("skipping {test_name}: MSCCLPP_IBV_MODE forces no-atomic in this process");
        return;
    }
    let ctx = open_ib(env).expect("open_ib");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_VAR, "child")
        .env(PORT_VAR, port.to_string())
        .env("MSCCLPP_IBV_MODE", mode)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawning the rank-1 process");
    listener.set_nonblocking(true).unwrap();
    let start = Instant::now();
    let sock = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("rank 1 exited before connecting: {status}");
                }
                assert!(start.elapsed() < WAIT, "rank 1 did not connect");
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    sock.set_nonblocking(false).unwrap();
    run_rank(0, &ctx, sock);
    let deadline = Instant::now() + WAIT;
    loop {
        match child.try_wait().unwrap() {
            Some(status) => {
                assert!(status.success(), "rank 1 failed: {status}");
                break;
            }
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                panic!("rank 1 did not exit within {WAIT:?}");
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

#[test]
fn two_process_rdma_loopback_atomic() {
    loopback("two_process_rdma_loopback_atomic", "host");
}

#[test]
fn two_process_rdma_loopback_write_with_imm() {
    loopback("two_process_rdma_loopback_write_with_imm", "host-no-atomic");
}
