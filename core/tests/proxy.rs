//! Proxy thread tests: draining, shutdown, handler errors, the default transport handler, latency.

use mscclpp_core::device::{ProxyTrigger, TriggerFields, TriggerType};
use mscclpp_core::fifo::{Fifo, HostFifoPusher};
use mscclpp_core::host_semaphore::{
    Host2DeviceSemaphore, Host2HostSemaphore, InboundWord, SemaphoreSignaller,
};
use mscclpp_core::proxy::{
    measure_host_trigger_latency, wait_handled, Proxy, ProxyAction, ProxyStats,
    TransportProxyHandler,
};
use mscclpp_core::transport::{
    EthernetConfig, EthernetListener, EthernetTransport, HostMemoryRegistry, MemoryRegion,
};
use mscclpp_core::{Error, Result, Transport, TransportKind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(20);

fn seq(i: u64) -> ProxyTrigger {
    ProxyTrigger { fst: i, snd: 0 }
}

fn push_all(p: &HostFifoPusher, n: u64) {
    for i in 0..n {
        p.push(seq(i), T).unwrap();
    }
}

#[test]
fn closure_handler_sees_every_trigger_in_order() {
    let n = 200_000u64;
    let fifo = Fifo::new(128).unwrap();
    let pusher = fifo.pusher();
    let seen = Arc::new(AtomicU64::new(0));
    let s = Arc::clone(&seen);
    let mut proxy = Proxy::start(fifo, move |t: ProxyTrigger| {
        let want = s.load(Ordering::Relaxed);
        if t.fst != want {
            return Err(Error::Internal(format!("got {} expected {want}", t.fst)));
        }
        s.store(want + 1, Ordering::Relaxed);
        Ok(ProxyAction::Continue)
    })
    .unwrap();
    push_all(&pusher, n);
    wait_handled(&proxy, n, T).unwrap();
    let stats = proxy.stop(T).unwrap();
    assert_eq!(
        stats,
        ProxyStats {
            handled: n,
            errors: 0
        }
    );
    assert_eq!(seen.load(Ordering::Relaxed), n);
}

#[test]
fn stop_drains_triggers_pushed_before_it() {
    let n = 2_000u64;
    let fifo = Fifo::new(n as u32).unwrap();
    let pusher = fifo.pusher();
    // A slow handler so that most triggers are still queued when stop is called.
    let mut proxy = Proxy::start(fifo, |_t: ProxyTrigger| {
        std::thread::sleep(Duration::from_micros(100));
        Ok(ProxyAction::Continue)
    })
    .unwrap();
    push_all(&pusher, n);
    let stats = proxy.stop(T).unwrap();
    assert_eq!(
        stats.handled, n,
        "every trigger pushed before stop is handled"
    );
    // Stopping again is harmless.
    assert_eq!(proxy.stop(T).unwrap().handled, n);
}

#[test]
fn handler_errors_are_kept_and_the_proxy_keeps_draining() {
    let fifo = Fifo::new(8).unwrap();
    let pusher = fifo.pusher();
    let mut proxy = Proxy::start(fifo, |t: ProxyTrigger| {
        if t.fst == 3 || t.fst == 7 {
            return Err(Error::Peer {
                rank: 5,
                message: format!("trigger {} failed", t.fst),
            });
        }
        if t.fst == 9 {
            panic!("handler bug on trigger 9");
        }
        Ok(ProxyAction::Continue)
    })
    .unwrap();
    push_all(&pusher, 20);
    wait_handled(&proxy, 20, T).unwrap();
    let err = proxy.check().unwrap_err();
    assert!(
        matches!(&err, Error::Peer { rank: 5, message } if message == "trigger 3 failed"),
        "the first error is kept: {err}"
    );
    proxy.check().unwrap(); // reported once
    let stats = proxy.stop(T).unwrap();
    assert_eq!(
        stats,
        ProxyStats {
            handled: 20,
            errors: 3
        }
    );
}

#[test]
fn stop_reports_an_unchecked_error() {
    let fifo = Fifo::new(4).unwrap();
    let pusher = fifo.pusher();
    let mut proxy = Proxy::start(fifo, |_t: ProxyTrigger| -> Result<ProxyAction> {
        Err(Error::InvalidArgument("bad trigger".into()))
    })
    .unwrap();
    pusher.push(seq(0), T).unwrap();
    let err = proxy.stop(T).unwrap_err();
    assert!(err.to_string().contains("bad trigger"), "{err}");
}

#[test]
fn stop_times_out_on_a_stuck_handler() {
    let fifo = Fifo::new(4).unwrap();
    let pusher = fifo.pusher();
    let mut proxy = Proxy::start(fifo, |_t: ProxyTrigger| {
        std::thread::sleep(Duration::from_secs(2));
        Ok(ProxyAction::Continue)
    })
    .unwrap();
    pusher.push(seq(0), T).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    let err = proxy.stop(Duration::from_millis(200)).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[test]
fn handler_can_stop_the_proxy() {
    let fifo = Fifo::new(4).unwrap();
    let pusher = fifo.pusher();
    let mut proxy = Proxy::start(fifo, |t: ProxyTrigger| {
        Ok(if t.fst == 1 {
            ProxyAction::Stop
        } else {
            ProxyAction::Continue
        })
    })
    .unwrap();
    push_all(&pusher, 2);
    wait_handled(&proxy, 2, T).unwrap();
    pusher.push(seq(2), T).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        proxy.stop(T).unwrap().handled,
        2,
        "nothing handled after Stop"
    );
}

/// A transport that records what it is asked to do.
#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<String>>,
}

impl Transport for Recorder {
    fn kind(&self) -> TransportKind {
        TransportKind::Ethernet
    }
    fn remote_rank(&self) -> usize {
        1
    }
    fn write(
        &self,
        dst: &MemoryRegion,
        dst_offset: u64,
        src: &MemoryRegion,
        src_offset: u64,
        bytes: u64,
    ) -> Result<()> {
        self.calls.lock().unwrap().push(format!(
            "write {:#x}+{dst_offset} <- {:#x}+{src_offset} {bytes}",
            dst.addr, src.addr
        ));
        Ok(())
    }
    fn update_and_sync(&self, dst: &MemoryRegion, dst_offset: u64, new_value: u64) -> Result<()> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("signal {:#x}+{dst_offset} = {new_value}", dst.addr));
        Ok(())
    }
    fn flush(&self, _timeout: Duration) -> Result<()> {
        self.calls.lock().unwrap().push("flush".into());
        Ok(())
    }
}

fn region(addr: u64) -> MemoryRegion {
    MemoryRegion {
        addr,
        size: 1 << 20,
        key: 0,
    }
}

fn trig(
    kind: TriggerType,
    sem: u32,
    dst: u32,
    dst_off: u64,
    src: u32,
    src_off: u64,
    size: u64,
) -> ProxyTrigger {
    ProxyTrigger::encode(&TriggerFields {
        kind,
        size,
        src_memory_id: src,
        src_offset: src_off,
        dst_memory_id: dst,
        dst_offset: dst_off,
        semaphore_id: sem,
    })
    .unwrap()
}

#[test]
fn default_handler_maps_trigger_types_to_the_transport() {
    let rec = Arc::new(Recorder::default());
    let conn: Arc<dyn Transport> = rec.clone();
    let mut handler = TransportProxyHandler::new(T);
    assert_eq!(handler.add_memory(region(0x1000)).unwrap(), 0);
    assert_eq!(handler.add_memory(region(0x2000)).unwrap(), 1);
    let sem = SemaphoreSignaller::new(conn, region(0x9000), 8).unwrap();
    let sem = Arc::new(Host2DeviceSemaphore::new(sem, region(0x8000)));
    assert_eq!(handler.add_semaphore(sem).unwrap(), 0);
    let fifo = Fifo::new(16).unwrap();
    let pusher = fifo.pusher();
    let mut proxy = Proxy::start(fifo, handler).unwrap();
    let all = TriggerType::DATA | TriggerType::FLAG | TriggerType::SYNC;
    for t in [
        trig(TriggerType::DATA, 0, 1, 64, 0, 32, 100),
        trig(TriggerType::FLAG, 0, 0, 0, 0, 0, 0),
        trig(TriggerType::SYNC, 0, 0, 0, 0, 0, 0),
        trig(all, 0, 0, 8, 1, 16, 7),
        trig(TriggerType::DATA, 3, 0, 0, 0, 0, 1), // unknown semaphore
        trig(TriggerType::DATA, 0, 9, 0, 0, 0, 1), // unknown memory
    ] {
        pusher.push(t, T).unwrap();
    }
    wait_handled(&proxy, 6, T).unwrap();
    let err = proxy.check().unwrap_err();
    assert!(err.to_string().contains("semaphore id 3"), "{err}");
    let stats = proxy.stop(T).unwrap();
    assert_eq!(stats.errors, 2);
    let calls = rec.calls.lock().unwrap().clone();
    assert_eq!(
        calls,
        [
            "write 0x2000+64 <- 0x1000+32 100",
            "signal 0x9000+8 = 1",
            "flush",
            "write 0x1000+8 <- 0x2000+16 7",
            "signal 0x9000+8 = 2",
            "flush",
        ]
    );
}

#[test]
fn trigger_to_handler_latency() {
    let stats = measure_host_trigger_latency(64, 20_000, T).unwrap();
    eprintln!(
        "host trigger -> handler latency over {} triggers: min {:?} p50 {:?} p99 {:?} max {:?} mean {:?}",
        stats.samples, stats.min, stats.p50, stats.p99, stats.max, stats.mean
    );
    assert_eq!(stats.samples, 20_000);
    assert!(stats.min <= stats.p50 && stats.p50 <= stats.p99 && stats.p99 <= stats.max);
}

/// The whole PortChannel path on the host: pusher -> FIFO -> proxy -> Ethernet (in-process
/// loopback) -> registered host memory -> host semaphore wait.
#[test]
fn proxy_over_ethernet_loopback() {
    let secret = b"proxy-test".to_vec();
    let reg_a = Arc::new(HostMemoryRegistry::new());
    let reg_b = Arc::new(HostMemoryRegistry::new());
    let listener = EthernetListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg_b = EthernetConfig::new(1, 0, secret.clone());
    let rb = reg_b.clone();
    let accept = std::thread::spawn(move || listener.accept(&cfg_b, rb));
    let a = Arc::new(
        EthernetTransport::connect(addr, &EthernetConfig::new(0, 1, secret), reg_a.clone())
            .unwrap(),
    );
    let b = accept.join().unwrap().unwrap();

    let n = 1 << 16;
    let mut src: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
    let mut dst = vec![0xa5u8; n];
    let src_r = unsafe { reg_a.register(src.as_mut_ptr(), n) }.unwrap();
    let dst_r = unsafe { reg_b.register(dst.as_mut_ptr(), n) }.unwrap();
    let inbound = InboundWord::new();
    let inbound_r = unsafe { reg_b.register(inbound.as_ptr(), 8) }.unwrap();
    // B's host semaphore (it waits); its signaller is unused here, so it points back at A.
    let back = SemaphoreSignaller::new(Arc::new(b), src_r, 0).unwrap();
    let mut waiter = Host2HostSemaphore::new(back, inbound);

    let conn: Arc<dyn Transport> = a.clone();
    let mut handler = TransportProxyHandler::new(T);
    let src_id = handler.add_memory(src_r).unwrap();
    let dst_id = handler.add_memory(dst_r).unwrap();
    let sem =
        Host2DeviceSemaphore::new(SemaphoreSignaller::new(conn, inbound_r, 0).unwrap(), src_r);
    let sem_id = handler.add_semaphore(Arc::new(sem)).unwrap();
    let fifo = Fifo::new(32).unwrap();
    let pusher = fifo.pusher();
    let mut proxy = Proxy::start(fifo, handler).unwrap();
    // Two halves, each a put-with-signal; the second also flushes.
    let half = (n / 2) as u64;
    pusher
        .push(
            trig(
                TriggerType::DATA | TriggerType::FLAG,
                sem_id,
                dst_id,
                0,
                src_id,
                0,
                half,
            ),
            T,
        )
        .unwrap();
    let all = TriggerType::DATA | TriggerType::FLAG | TriggerType::SYNC;
    let pos = pusher
        .push(trig(all, sem_id, dst_id, half, src_id, half, half), T)
        .unwrap();
    pusher.sync(pos, T).unwrap();
    waiter.wait(T).unwrap();
    waiter.wait(T).unwrap();
    assert!(!waiter.poll());
    assert_eq!(waiter.inbound().load(), 2);
    assert_eq!(
        proxy.stop(T).unwrap(),
        ProxyStats {
            handled: 2,
            errors: 0
        }
    );
    assert!(dst == src, "destination matches the source byte for byte");
    a.check_receiver().unwrap();
}
