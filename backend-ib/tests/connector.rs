//! `VerbsConnector` over a real HCA, as `connect_peers` drives it: two ranks (threads of this
//! process, one bootstrap) open the HCA with their memory registered, connect through the
//! bootstrap handshake, and rank 0 writes into rank 1's buffer and signals it naming memory by
//! address only (key 0), as the PortChannel proxy does; the transport adds lkey and rkey. A write
//! outside the peer's registered memory fails naming it.
//!
//! Host memory here (the GPU path differs only in `ibv_reg_mr` on a device pointer). Signalling
//! follows `MSCCLPP_IBV_MODE`; run it in both modes. Skips with a printed reason without an HCA,
//! libibverbs, or with `MSCCLPP_DISABLE_IB_TESTS=1` (the development machine and CI).

use mscclpp_core::bootstrap::{Bootstrap, BootstrapConfig, TcpBootstrap};
use mscclpp_core::env::Env;
use mscclpp_core::transport::connect::IbConnector;
use mscclpp_core::transport::{HostMemoryRegistry, MemoryRegion, MemoryResolver};
use mscclpp_core::Error;
use mscclpp_ib::{ib_skip_reason, VerbsConnector};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BYTES: usize = 1 << 20;
/// The signal word sits at offset 0, the data from here on.
const DATA: u64 = 64;
const WAIT: Duration = Duration::from_secs(30);

fn run_rank(rank: usize, boot: TcpBootstrap, env: &Env) {
    let peer = 1 - rank;
    let len = DATA as usize + BYTES;
    let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
    // SAFETY: non-zero size; freed at the end, after every registration is gone.
    let buf = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!buf.is_null());
    let addr = buf as u64;
    let endpoint = VerbsConnector
        .open(env, 0, &[(addr, len)])
        .expect("open the HCA and register the buffer");
    eprintln!("rank {rank}: {}", endpoint.describe());
    let registry = Arc::new(HostMemoryRegistry::new());
    // SAFETY: `buf` outlives the registry's use (the transport is dropped before it is freed);
    // we read the word atomically and the data only after the signal.
    let word = unsafe { registry.register(buf, 8) }.unwrap();
    let link = endpoint
        .connect(&boot, peer, registry.clone() as Arc<dyn MemoryResolver>)
        .expect("connect");
    link.deliver_signals_to(word).expect("signal word");
    let addrs = boot.all_gather(&addr.to_le_bytes()).unwrap();
    let peer_addr = u64::from_le_bytes(addrs[peer][..8].try_into().unwrap());
    let by_address = |addr| MemoryRegion {
        addr,
        size: len as u64,
        key: 0,
    };
    if rank == 0 {
        for i in 0..BYTES {
            // SAFETY: in bounds; nobody writes into rank 0's buffer.
            unsafe { *buf.add(DATA as usize + i) = (i % 251) as u8 };
        }
        let (dst, src) = (by_address(peer_addr), by_address(addr));
        link.write(&dst, DATA, &src, DATA, BYTES as u64).unwrap();
        link.update_and_sync(&dst, 0, 1).unwrap();
        link.flush(WAIT).unwrap();
        let outside = by_address(peer_addr + len as u64);
        match link.write(&outside, 0, &src, DATA, 8) {
            Err(Error::InvalidArgument(m)) => {
                assert!(m.contains("registered with its HCA"), "{m}")
            }
            other => panic!("a write outside rank 1's memory: {other:?}"),
        }
    } else {
        // SAFETY: 8-byte aligned and only accessed atomically while the HCA may write it.
        let signal = unsafe { &*(buf as *const AtomicU64) };
        let start = Instant::now();
        while signal.load(Ordering::Acquire) < 1 {
            assert!(start.elapsed() < WAIT, "rank 1: no signal from rank 0");
            std::hint::spin_loop();
        }
        for i in 0..BYTES {
            // SAFETY: in bounds; written before the signal that was just observed.
            let got = unsafe { *buf.add(DATA as usize + i) };
            assert_eq!(got, (i % 251) as u8, "byte {i}");
        }
    }
    boot.barrier().unwrap();
    drop(link);
    drop(endpoint);
    // SAFETY: allocated above with this layout; its registrations are gone.
    unsafe { std::alloc::dealloc(buf, layout) };
}

#[test]
fn verbs_connector_writes_and_signals_by_address() {
    let env = match Env::get() {
        Ok(env) => env,
        Err(e) => return eprintln!("skipping: the environment does not parse: {e}"),
    };
    if let Some(reason) = ib_skip_reason(env) {
        return eprintln!("skipping: {reason}");
    }
    let cfg = BootstrapConfig::default().with_timeout(WAIT);
    let id = TcpBootstrap::create_unique_id(&cfg).unwrap();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let (id, cfg) = (id.clone(), cfg.clone());
            std::thread::spawn(move || {
                let boot = TcpBootstrap::new(rank, 2, &id, &cfg).unwrap();
                run_rank(rank, boot, env);
            })
        })
        .collect();
    for r in ranks {
        r.join().expect("rank");
    }
}
