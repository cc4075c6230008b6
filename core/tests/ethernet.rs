//! EthernetTransport tests. The two-process tests spawn this test binary again as the peer, with
//! `MSCCLPP_ETH_TEST_ROLE` selecting what the child does (see `child_process_entry`).

use mscclpp_core::host_semaphore::{InboundWord, SemaphoreSignaller};
use mscclpp_core::transport::{
    EthernetConfig, EthernetListener, EthernetTransport, HostMemoryRegistry, MemoryRegion,
};
use mscclpp_core::{Error, Transport};
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ROLE: &str = "MSCCLPP_ETH_TEST_ROLE";
const ADDR: &str = "MSCCLPP_ETH_TEST_ADDR";
/// Regions of the parent that the child targets, as `addr:size:key` separated by `,`.
const REGIONS: &str = "MSCCLPP_ETH_TEST_REGIONS";
const SECRET: &[u8] = b"ethernet-test-secret";
const T: Duration = Duration::from_secs(60);
const PARENT: usize = 0;
const CHILD: usize = 1;
const MIB: usize = 1 << 20;
const POISON: u8 = 0xa5;
const GUARD: usize = 64;

/// Sizes that cross the 4 MiB staging chunk at different points, ending at 256 MiB.
const SIZES: &[usize] = &[
    0,
    1,
    2,
    3,
    7,
    8,
    13,
    4095,
    4096,
    4097,
    65_537,
    MIB + 3,
    4 * MIB - 1,
    4 * MIB,
    4 * MIB + 1,
    33 * MIB + 5,
    256 * MIB,
];

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Random bytes as a pure function of (stream, position), so either process can produce any part.
fn fill_random(out: &mut [u8], stream: u64, start: usize) {
    for (j, chunk) in out.chunks_mut(8).enumerate() {
        let word = splitmix((stream << 40) ^ ((start / 8 + j) as u64));
        chunk.copy_from_slice(&word.to_le_bytes()[..chunk.len()]);
    }
}

fn config(rank: usize, remote: usize) -> EthernetConfig {
    let mut c = EthernetConfig::new(rank, remote, SECRET.to_vec());
    c.connect_timeout = Duration::from_secs(30);
    c.io_timeout = Duration::from_secs(5);
    c
}

fn fmt_region(r: &MemoryRegion) -> String {
    format!("{}:{}:{}", r.addr, r.size, r.key)
}

fn parse_regions(s: &str) -> Vec<MemoryRegion> {
    s.split(',')
        .map(|r| {
            let v: Vec<u64> = r.split(':').map(|x| x.parse().unwrap()).collect();
            MemoryRegion {
                addr: v[0],
                size: v[1],
                key: v[2] as u32,
            }
        })
        .collect()
}

/// A page-aligned-enough heap buffer whose bytes are only touched through raw pointers while a
/// transport may write into them.
struct Buf {
    mem: Vec<u64>,
    len: usize,
}

impl Buf {
    fn new(len: usize, fill: u8) -> Self {
        let mut b = Buf {
            mem: vec![0u64; len.div_ceil(8).max(1)],
            len,
        };
        b.bytes_mut().fill(fill);
        b
    }
    fn ptr(&mut self) -> *mut u8 {
        self.mem.as_mut_ptr().cast()
    }
    fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr().cast(), self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.mem.as_mut_ptr().cast(), self.len) }
    }
    fn register(&mut self, reg: &HostMemoryRegistry) -> MemoryRegion {
        unsafe { reg.register(self.ptr(), self.len) }.unwrap()
    }
}

fn wait_word(word: &InboundWord, at_least: u64, what: &str) {
    let deadline = Instant::now() + T;
    while word.load() < at_least {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what} (word {} < {at_least})",
            word.load()
        );
        std::thread::yield_now();
    }
}

fn spawn_child(role: &str, addr: SocketAddr, regions: &[MemoryRegion]) -> Child {
    let exe = std::env::current_exe().unwrap();
    let regions: Vec<String> = regions.iter().map(fmt_region).collect();
    Command::new(exe)
        .args([
            "child_process_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .env(ADDR, addr.to_string())
        .env(REGIONS, regions.join(","))
        .spawn()
        .unwrap()
}

/// Kills the child if a test fails before waiting for it.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl ChildGuard {
    fn expect_success(&mut self) {
        let deadline = Instant::now() + T;
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                assert!(status.success(), "child failed: {status}");
                return;
            }
            assert!(Instant::now() < deadline, "child did not finish");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The parent's listener and registry, its inbound word, and a mailbox the child writes into.
struct Parent {
    listener: EthernetListener,
    reg: Arc<HostMemoryRegistry>,
    inbound: Box<InboundWord>,
    inbound_r: MemoryRegion,
    mailbox: Buf,
    mailbox_r: MemoryRegion,
}

impl Parent {
    fn new() -> Self {
        let listener = EthernetListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let reg = Arc::new(HostMemoryRegistry::new());
        let inbound = InboundWord::new();
        let inbound_r = unsafe { reg.register(inbound.as_ptr(), 8) }.unwrap();
        let mut mailbox = Buf::new(64, 0);
        let mailbox_r = mailbox.register(&reg);
        Parent {
            listener,
            reg,
            inbound,
            inbound_r,
            mailbox,
            mailbox_r,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap()
    }

    fn accept(&self) -> EthernetTransport {
        self.accept_naming(CHILD)
    }

    /// As `accept`, the child being rank `job_rank` of the whole job: a sub-communicator's link,
    /// where its rank in the group (CHILD) is another number.
    fn accept_naming(&self, job_rank: usize) -> EthernetTransport {
        let mut c = config(PARENT, CHILD);
        c.remote_job_rank = job_rank;
        self.listener.accept(&c, self.reg.clone()).unwrap()
    }

    /// The region the child posted into the mailbox (after signal 1).
    fn child_region(&self) -> MemoryRegion {
        wait_word(&self.inbound, 1, "the child's mailbox post");
        parse_regions(
            std::str::from_utf8(self.mailbox.bytes())
                .unwrap()
                .trim_end_matches('\0'),
        )[0]
    }
}

/// The child side: connects, and posts `region` into the parent's mailbox, then signal 1.
fn child_connect(reg: &Arc<HostMemoryRegistry>) -> (EthernetTransport, Vec<MemoryRegion>) {
    let addr: SocketAddr = std::env::var(ADDR).unwrap().parse().unwrap();
    let regions = parse_regions(&std::env::var(REGIONS).unwrap());
    let t = EthernetTransport::connect(addr, &config(CHILD, PARENT), reg.clone()).unwrap();
    (t, regions)
}

fn child_post(
    t: &EthernetTransport,
    reg: &HostMemoryRegistry,
    parent: &[MemoryRegion],
    mine: &MemoryRegion,
) {
    let mut text = Buf::new(64, 0);
    let s = fmt_region(mine);
    text.bytes_mut()[..s.len()].copy_from_slice(s.as_bytes());
    let text_r = text.register(reg);
    t.write(&parent[1], 0, &text_r, 0, 64).unwrap();
    t.update_and_sync(&parent[0], 0, 1).unwrap();
    t.flush(T).unwrap();
}

/// Entry point of the child process; does nothing in a normal test run.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let reg = Arc::new(HostMemoryRegistry::new());
    let (t, parent) = child_connect(&reg);
    match role.as_str() {
        // parent = [inbound, mailbox, dst]: send every size, one at a time, acked by the parent.
        "sender" => {
            let ack = InboundWord::new();
            let ack_r = unsafe { reg.register(ack.as_ptr(), 8) }.unwrap();
            child_post(&t, &reg, &parent, &ack_r);
            let max = *SIZES.iter().max().unwrap();
            let mut src = Buf::new(max, 0);
            let src_r = src.register(&reg);
            for (k, &size) in SIZES.iter().enumerate() {
                fill_random(&mut src.bytes_mut()[..size], k as u64, 0);
                let start = Instant::now();
                t.write(&parent[2], 0, &src_r, 0, size as u64).unwrap();
                t.update_and_sync(&parent[0], 0, k as u64 + 2).unwrap();
                t.flush(T).unwrap();
                let secs = start.elapsed().as_secs_f64();
                if size >= 32 * MIB {
                    println!(
                        "ethernet loopback: {size} B written and flushed in {:.1} ms = {:.2} GB/s",
                        secs * 1e3,
                        size as f64 / secs / 1e9
                    );
                }
                wait_word(&ack, k as u64 + 1, "the parent's check");
            }
        }
        // parent = [inbound, mailbox, data]: 10^4 (data, signal) pairs.
        "signaller" => {
            let mut word = Buf::new(8, 0);
            let word_r = word.register(&reg);
            for i in 1..=10_000u64 {
                // Only this thread touches `word` while no write of it is in flight: `write`
                // stages the bytes before returning.
                word.bytes_mut().copy_from_slice(&i.to_le_bytes());
                t.write(&parent[2], 0, &word_r, 0, 8).unwrap();
                t.update_and_sync(&parent[0], 0, i).unwrap();
            }
            t.flush(T).unwrap();
        }
        // parent = [inbound, mailbox, dst]: stream until killed.
        "endless_sender" => {
            let mut src = Buf::new(64 * MIB, 7);
            let src_r = src.register(&reg);
            t.update_and_sync(&parent[0], 0, 1).unwrap();
            let deadline = Instant::now() + T;
            while Instant::now() < deadline {
                t.write(&parent[2], 0, &src_r, 0, 64 * MIB as u64).unwrap();
            }
            panic!("the parent never killed the endless sender");
        }
        // parent = [inbound, mailbox]: post a 64 MiB destination, then wait to be killed.
        "sink" => {
            let mut dst = Buf::new(64 * MIB, 0);
            let dst_r = dst.register(&reg);
            child_post(&t, &reg, &parent, &dst_r);
            std::thread::sleep(T);
            panic!("the parent never killed the sink");
        }
        other => panic!("unknown {ROLE}={other}"),
    }
}

#[test]
fn writes_of_every_size_arrive_exact() {
    let p = Parent::new();
    let max = *SIZES.iter().max().unwrap();
    let mut dst = Buf::new(max + GUARD, POISON);
    let dst_r = dst.register(&p.reg);
    let mut child = ChildGuard(spawn_child(
        "sender",
        p.addr(),
        &[p.inbound_r, p.mailbox_r, dst_r],
    ));
    let t = p.accept();
    let ack = SemaphoreSignaller::new(Arc::new(t), p.child_region(), 0).unwrap();
    let mut expect = vec![0u8; 4 * MIB];
    for (k, &size) in SIZES.iter().enumerate() {
        wait_word(&p.inbound, k as u64 + 2, &format!("write of {size} bytes"));
        let got = dst.bytes();
        for start in (0..size).step_by(expect.len()) {
            let n = expect.len().min(size - start);
            fill_random(&mut expect[..n], k as u64, start);
            if got[start..start + n] != expect[..n] {
                let i = (0..n).find(|&i| got[start + i] != expect[i]).unwrap_or(0);
                panic!(
                    "size {size}: byte {} is {:#x}, expected {:#x}",
                    start + i,
                    got[start + i],
                    expect[i]
                );
            }
        }
        assert!(
            got[size..size + GUARD].iter().all(|&b| b == POISON),
            "size {size}: bytes past the end were written"
        );
        dst.bytes_mut()[..size + GUARD].fill(POISON);
        assert_eq!(ack.signal().unwrap(), k as u64 + 1);
    }
    child.expect_success();
}

#[test]
fn signals_are_counted_and_never_ahead_of_their_data() {
    let p = Parent::new();
    let mut data = Buf::new(8, 0);
    let data_r = data.register(&p.reg);
    let mut child = ChildGuard(spawn_child(
        "signaller",
        p.addr(),
        &[p.inbound_r, p.mailbox_r, data_r],
    ));
    let t = p.accept();
    let deadline = Instant::now() + T;
    let (mut last, mut observed) = (0u64, 0u64);
    while last < 10_000 {
        let v = p.inbound.load();
        assert!(v >= last, "semaphore went back from {last} to {v}");
        // Volatile: the receiver thread may be writing the next value right now.
        let d = unsafe { std::ptr::read_volatile(data.ptr().cast::<u64>()) };
        assert!(d >= v, "saw signal {v} before its data (data word {d})");
        if v != last {
            observed += 1;
        }
        last = v;
        assert!(Instant::now() < deadline, "stuck at signal {last}");
    }
    assert_eq!(last, 10_000);
    eprintln!("observed {observed} distinct semaphore values on the way to 10000");
    child.expect_success();
    t.check_receiver().unwrap();
}

#[test]
fn killed_sender_is_a_peer_error_on_the_receiver() {
    let p = Parent::new();
    let mut dst = Buf::new(64 * MIB, 0);
    let dst_r = dst.register(&p.reg);
    let mut child = ChildGuard(spawn_child(
        "endless_sender",
        p.addr(),
        &[p.inbound_r, p.mailbox_r, dst_r],
    ));
    let t = p.accept();
    wait_word(&p.inbound, 1, "the stream to start");
    std::thread::sleep(Duration::from_millis(100));
    child.0.kill().unwrap();
    let killed = Instant::now();
    let err = loop {
        if let Err(e) = t.check_receiver() {
            break e;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "no error 5 s after the peer died"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    eprintln!(
        "receiver error {:?} after the kill: {err}",
        killed.elapsed()
    );
    assert!(matches!(err, Error::Peer { rank: CHILD, .. }), "{err}");
}

/// The writer's errors name the dead peer by its rank in the whole job (a cross-host group's link
/// of a hierarchical algorithm once named its group rank, another process's number).
#[test]
fn killed_receiver_is_a_peer_error_on_the_writer() {
    const CHILD_JOB_RANK: usize = 7;
    let p = Parent::new();
    let mut child = ChildGuard(spawn_child("sink", p.addr(), &[p.inbound_r, p.mailbox_r]));
    let t = Arc::new(p.accept_naming(CHILD_JOB_RANK));
    let dst_r = p.child_region();
    let mut src = Buf::new(64 * MIB, 3);
    let src_r = src.register(&p.reg);
    let writer = {
        let t = Arc::clone(&t);
        std::thread::spawn(move || -> Result<(), Error> {
            loop {
                t.write(&dst_r, 0, &src_r, 0, 64 * MIB as u64)?;
                t.flush(T)?;
            }
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    child.0.kill().unwrap();
    let killed = Instant::now();
    let err: Error = writer.join().unwrap().unwrap_err();
    eprintln!("writer error {:?} after the kill: {err}", killed.elapsed());
    assert!(killed.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(
            err,
            Error::Peer {
                rank: CHILD_JOB_RANK,
                ..
            }
        ),
        "{err}"
    );
    // Every later call fails fast with the same cause.
    assert!(matches!(
        t.flush(T).unwrap_err(),
        Error::Peer {
            rank: CHILD_JOB_RANK,
            ..
        }
    ));
}

/// An in-process pair (both ends in this process).
fn pair(
    reg_a: &Arc<HostMemoryRegistry>,
    reg_b: &Arc<HostMemoryRegistry>,
) -> (EthernetTransport, EthernetTransport) {
    let listener = EthernetListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let rb = reg_b.clone();
    let accept = std::thread::spawn(move || listener.accept(&config(1, 0), rb));
    let a = EthernetTransport::connect(addr, &config(0, 1), reg_a.clone()).unwrap();
    (a, accept.join().unwrap().unwrap())
}

#[test]
fn both_directions_at_once() {
    let (ra, rb) = (
        Arc::new(HostMemoryRegistry::new()),
        Arc::new(HostMemoryRegistry::new()),
    );
    let (a, b) = pair(&ra, &rb);
    let n = 24 * MIB;
    let (mut sa, mut sb) = (Buf::new(n, 1), Buf::new(n, 2));
    let (mut da, mut db) = (Buf::new(n, 0), Buf::new(n, 0));
    let (sa_r, sb_r) = (sa.register(&ra), sb.register(&rb));
    let (da_r, db_r) = (da.register(&ra), db.register(&rb));
    // Large writes in both directions at once must not deadlock on full socket buffers. The thread
    // hands `a` back: dropping it early would close its receiver while `b` is still sending.
    let ta = std::thread::spawn(move || {
        a.write(&db_r, 0, &sa_r, 0, n as u64)
            .and_then(|()| a.flush(T))
            .map(|()| a)
    });
    b.write(&da_r, 0, &sb_r, 0, n as u64).unwrap();
    b.flush(T).unwrap();
    let _a = ta.join().unwrap().unwrap();
    assert!(da.bytes().iter().all(|&x| x == 2));
    assert!(db.bytes().iter().all(|&x| x == 1));
}

#[test]
fn bad_destination_is_reported_at_flush_and_the_link_survives() {
    let (ra, rb) = (
        Arc::new(HostMemoryRegistry::new()),
        Arc::new(HostMemoryRegistry::new()),
    );
    let (a, _b) = pair(&ra, &rb);
    let mut src = Buf::new(100, 9);
    let mut dst = Buf::new(100, 0);
    let src_r = src.register(&ra);
    let dst_r = dst.register(&rb);
    let forged = MemoryRegion {
        key: dst_r.key + 100,
        ..dst_r
    };
    a.write(&forged, 0, &src_r, 0, 100).unwrap();
    let err = a.flush(T).unwrap_err();
    assert!(matches!(&err, Error::Peer { rank: 1, .. }), "{err}");
    assert!(err.to_string().contains("not registered"), "{err}");
    // Out-of-range requests are refused locally, before anything is sent.
    let err = a.write(&dst_r, 1, &src_r, 0, 100).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let err = a.update_and_sync(&dst_r, 96, 1).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // The link is still in sync.
    a.write(&dst_r, 0, &src_r, 0, 100).unwrap();
    a.flush(T).unwrap();
    assert!(dst.bytes().iter().all(|&x| x == 9));
}

#[test]
fn wrong_secret_or_rank_is_refused() {
    let reg: Arc<HostMemoryRegistry> = Arc::new(HostMemoryRegistry::new());
    let listener = EthernetListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut cfg = config(1, 0);
    cfg.connect_timeout = Duration::from_millis(500);
    let r = reg.clone();
    let accept = std::thread::spawn(move || listener.accept(&cfg, r));
    let mut bad = config(0, 1);
    bad.secret = b"another job".to_vec();
    let err = EthernetTransport::connect(addr, &bad, reg.clone()).unwrap_err();
    assert!(err.to_string().contains("secret mismatch"), "{err}");
    let mut bad = config(0, 2);
    bad.remote_rank = 2;
    let err = EthernetTransport::connect(addr, &bad, reg.clone()).unwrap_err();
    assert!(err.to_string().contains("is not rank 2"), "{err}");
    // The listener never saw its real peer: a timeout naming the rank, not a hang.
    let err = accept.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("rank 0"), "{err}");
}

#[test]
fn connect_to_nobody_times_out() {
    // Bind and drop to find a port with no listener.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut cfg = config(0, 1);
    cfg.connect_timeout = Duration::from_millis(300);
    let start = Instant::now();
    let err =
        EthernetTransport::connect(addr, &cfg, Arc::new(HostMemoryRegistry::new())).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(3));
}
