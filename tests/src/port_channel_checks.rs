//! GPU checks of PortChannel over CudaIpc (the proxy moves data with the copy engine): ranks are
//! paired (0,1), (2,3), ...; the suite calls [`run`] and prints one PASS/FAIL line per entry.
//!
//! Checks, in order (each rank of a pair runs the same sequence, so signal counts stay balanced:
//! every `put_with_signal` of one side is matched by exactly one `wait` on the other):
//! 1. Trigger overhead of the proxy (per rank, before the service starts), 10 000 samples each,
//!    timed on the GPU with `%globaltimer`; the proxy thread runs on the GPU's local CPUs, as
//!    PortChannelService's does, and the rank's main thread waits by polling an event, not spinning
//!    in the driver. First, a round trip through a no-op handler: push, then wait until the proxy
//!    popped the trigger (`fifo.sync`). Second, trigger to copy start, one way: the handler copies
//!    an 8-byte word from this GPU into the peer's memory with cuMemcpyAsync on its own stream
//!    (what the CudaIpc transport does for a put), while a second warp keeps writing the GPU clock
//!    into that word, so the value that lands is the time the copy engine read its source: the
//!    copy's start, on the clock that timed the trigger. Target: its median <= 5 µs; a miss is a
//!    FAIL naming the numbers, with trigger-to-landed and the handler's own cuMemcpyAsync time
//!    (host clock) beside them.
//! 2. PortChannel ping-pong, 0-byte `put_with_signal` each way: the full GPU -> proxy ->
//!    cuStreamWriteValue64 into the peer -> peer GPU round trip, median of 10 000 (reported).
//! 3. Data exact: sizes 1 B, 4097 B, 1 MiB + 3 and 1 GiB in both directions; fresh random data
//!    per run, destination poisoned first, every byte compared, and the 64 bytes after the
//!    transfer must still hold the poison.
//! 4. Bandwidth at 1 GiB, even rank -> odd rank: `put_with_signal_and_flush` (kernel time, from
//!    launch to the proxy's flush returning) against `cuMemcpyAsync` device -> peer on the same
//!    pair of buffers (what `cudaMemcpyPeer` does between IPC-mapped buffers), best of 5 each.
//!    Target: >= 95% of the copy; a miss is a FAIL naming the numbers.
//! 5. Clean proxy shutdown: every trigger handled, no proxy error.
//!
//! The two targets are not judged when ranks share a GPU (`RankContext::shares_gpu`).

use crate::{seed, DeviceBuffer, KernelArgs, RankContext, SplitMix64, MIB};
use mscclpp::core::communicator::RegisteredMemory;
use mscclpp::core::device::PortChannelHandle;
use mscclpp::core::gpu::{Function, Gpu, LaunchConfig, MemoryKind, Stream};
use mscclpp::core::port_channel::{DeviceFifo, PortChannelConfig, PortChannelService};
use mscclpp::core::proxy::{LatencyStats, Proxy, ProxyAction};
use mscclpp::core::transport::CudaIpcTransport;
use mscclpp::core::{Error, Result};
use std::sync::Arc;
use std::time::Duration;

const GIB: usize = 1 << 30;
/// Bytes after every transfer that must keep the poison (overrun check).
const GUARD: usize = 64;
const POISON: u8 = 0xa5;
const ROUND_TRIPS: u32 = 10_000;
/// Device spin bound for these checks: a lost signal fails in seconds, not hours.
const MAX_SPIN: u64 = 1 << 26;
const TRIGGER_TARGET_US: f64 = 5.0;
const BANDWIDTH_TARGET: f64 = 0.95;

/// The measurement kernels of these checks (compiled at run time; CI compiles them through NVRTC).
pub const KERNELS: &str = r#"
#include "mscclpp/port_channel.cuh"
using namespace mscclpp;

__device__ __forceinline__ u64 global_timer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Both FIFO kernels take (fifo, iters, clock, remote, samples, done): `iters` rounds, each timed
// with globaltimer; samples[i] (and samples[iters + i]) get round i's nanoseconds, *done the rounds
// completed.
//
// fifo_round_trip: one thread pushes a FLAG trigger and waits until the proxy consumed it.
extern "C" __global__ void fifo_round_trip(FifoHandle fifo, u32 iters, u64* clock, u64* remote,
                                           u64* samples, u32* done) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const ProxyTrigger t = ProxyTrigger::make(kTriggerFlag, 0, 0, 0, 0, 0, 0);
  u32 i = 0;
  u64 prev = global_timer_ns();
  for (; i < iters; ++i) {
    if (!fifo.sync(fifo.push(t))) break;
    const u64 now = global_timer_ns();
    samples[i] = now - prev;
    prev = now;
  }
  *done = i;
}

// fifo_trigger_to_copy (64 threads): the proxy's handler copies the 8-byte word `clock` (local)
// to `remote` (the peer's memory, mapped here) with the copy engine. Warp 1 keeps writing the GPU
// clock into `clock`, so the word the copy engine reads IS the time it read it: the copy's start
// on the same clock as the trigger. Warp 0, per round: t0, push, spin until `remote` holds a newer
// stamp; samples[i] = stamp - t0 (trigger to copy start), samples[iters + i] = landed - t0.
extern "C" __global__ void fifo_trigger_to_copy(FifoHandle fifo, u32 iters, u64* clock,
                                                u64* remote, u64* samples, u32* done) {
  __shared__ volatile u32 stop;
  if (threadIdx.x == 0) stop = 0;
  __syncthreads();
  const u64 bound = effective_max_spin(fifo.max_spin);
  if (threadIdx.x == 32) {
    volatile u64* c = clock;
    for (u64 spins = 0; !stop && spins < bound; ++spins) *c = global_timer_ns();
    return;
  }
  if (threadIdx.x != 0) return;
  const ProxyTrigger t = ProxyTrigger::make(kTriggerFlag, 0, 0, 0, 0, 0, 0);
  volatile u64* dst = remote;
  u64 last = *dst;
  u32 i = 0;
  for (; i < iters; ++i) {
    const u64 t0 = global_timer_ns();
    fifo.push(t);
    u64 spins = 0, stamp = *dst;
    while (stamp <= last && ++spins < bound) stamp = *dst;
    if (stamp <= last) break;
    const u64 landed = global_timer_ns();
    samples[i] = stamp > t0 ? stamp - t0 : 0;
    samples[iters + i] = landed - t0;
    last = stamp;
  }
  *done = i;
  stop = 1;
}

// One thread: the initiator puts `bytes` with a signal and waits for the answer; the responder
// waits, then answers. samples[i] = globaltimer ns of round trip i; *done = completed rounds.
extern "C" __global__ void port_channel_ping_pong(PortChannelHandle chan, u64 bytes, u32 iters,
                                                  u32 initiator, u64* samples, u32* done) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  u32 i = 0;
  u64 prev = global_timer_ns();
  for (; i < iters; ++i) {
    if (initiator) {
      chan.put_with_signal(0, 0, bytes);
      if (!chan.wait()) break;
    } else {
      if (!chan.wait()) break;
      chan.put_with_signal(0, 0, bytes);
    }
    const u64 now = global_timer_ns();
    samples[i] = now - prev;
    prev = now;
  }
  *done = i;
}
"#;

/// What the checks of one pair share. Fields drop in order: the service (its proxy stops), then
/// the mappings, then the buffers.
struct Pair<'a> {
    ctx: &'a RankContext,
    gpu: Arc<dyn Gpu>,
    stream: Stream,
    peer: usize,
    run_seed: u64,
    service: PortChannelService,
    /// Every rank's `dst` (the peer's mapped here) and our `src`, registered for the proxy.
    _mems: Vec<RegisteredMemory>,
    _local_src: RegisteredMemory,
    chan: PortChannelHandle,
    src: DeviceBuffer,
    dst: DeviceBuffer,
    /// The peer's `dst`, mapped here.
    peer_dst: u64,
    put_signal: Function,
    ping_pong: Function,
    /// u32 result word of `port_channel_put_signal`, u32 `done` of the measurement kernels.
    result: DeviceBuffer,
}

impl Pair<'_> {
    fn launch(&self, f: Function, args: &mut KernelArgs) -> Result<()> {
        let mut ptrs = args.pointers();
        // SAFETY: every caller passes exactly the kernel's parameters, by value, in order; the
        // pointers refer to device memory that outlives the synchronisation that follows.
        unsafe {
            self.gpu
                .launch(f, LaunchConfig::linear(1, 32), self.stream, &mut ptrs)
        }
    }

    fn sync(&self, what: &str) -> Result<()> {
        self.gpu.synchronize_stream(self.stream)?;
        self.ctx.comm.check_device_errors()?;
        self.service
            .check()
            .map_err(|e| Error::Internal(format!("{what}: the proxy reported: {e}")))
    }

    fn read_u32(&self, buf: &DeviceBuffer) -> Result<u32> {
        let b = buf.download(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// Launches `port_channel_put_signal` as sender (put + signal + flush of `bytes`) or receiver
    /// (wait for the signal) on the pair's stream.
    fn put_signal(&self, bytes: u64, sender: bool) -> Result<()> {
        let mut a = KernelArgs::new();
        a.push(self.chan)
            .push(bytes)
            .push(u32::from(sender))
            .push(self.result.ptr());
        self.launch(self.put_signal, &mut a)
    }
}

/// Random bytes of (case, rank) for this run; every rank can regenerate any rank's data.
fn random_bytes(run_seed: u64, case: u64, rank: usize, len: usize) -> Vec<u8> {
    let mut rng = SplitMix64(seed(run_seed, case, rank));
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(len);
    out
}

fn median_us(samples: &mut [u64]) -> Result<LatencyStats> {
    LatencyStats::from_nanos(samples).ok_or_else(|| Error::Internal("no samples".into()))
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Runs the PortChannel checks on this rank; returns (check name, outcome) in order.
pub fn run(ctx: &RankContext) -> Vec<(String, Result<String>)> {
    let mut out = Vec::new();
    match setup(ctx) {
        Err(e) => out.push(("port_channel setup".to_string(), Err(e))),
        Ok(None) => out.push((
            "port_channel".to_string(),
            Ok(format!("skipped: rank {} has no pair peer", ctx.rank())),
        )),
        Ok(Some((mut pair, fifo_check))) => {
            out.push((
                "port_channel trigger overhead (FIFO -> proxy -> copy)".into(),
                fifo_check,
            ));
            let r = ping_pong(&pair);
            out.push(("port_channel ping-pong 0 B".into(), r));
            let r = data_exact(&pair);
            out.push((
                "port_channel put data exact (1 B .. 1 GiB, both ways)".into(),
                r,
            ));
            let r = bandwidth(&pair);
            out.push((
                "port_channel put bandwidth 1 GiB vs cuMemcpyAsync peer".into(),
                r,
            ));
            // Stop first (every trigger drained), then wait for the peer to have stopped too, so
            // neither side frees a buffer the other's proxy may still copy into.
            let r = pair
                .service
                .stop()
                .and_then(|stats| pair.ctx.bootstrap.barrier().map(|()| stats))
                .and_then(|stats| match stats.errors {
                    0 => Ok(format!("{} triggers handled, no errors", stats.handled)),
                    n => Err(Error::Internal(format!(
                        "{n} of {} triggers failed",
                        stats.handled
                    ))),
                });
            out.push(("port_channel proxy shutdown".into(), r));
            if let Err(e) = pair.gpu.destroy_stream(pair.stream) {
                eprintln!("destroying the PortChannel check stream: {e}");
            }
        }
    }
    out
}

/// Collective setup (every rank, paired or not, joins the memory exchange). Returns the pair's
/// state and the result of the FIFO round-trip check, which needs no peer but runs before the
/// service's proxy starts so the two proxies do not compete for a core.
fn setup(ctx: &RankContext) -> Result<Option<(Pair<'_>, Result<String>)>> {
    let gpu = ctx.gpu.clone();
    gpu.set_device(ctx.device)?;
    let run_seed = ctx.shared_seed()?;
    let module = gpu.build_module("port_channel_checks", KERNELS)?;
    let primitives = mscclpp_kernels_cu::kernel("primitives")
        .ok_or_else(|| Error::Internal("no primitives kernel unit".into()))?;
    let prim = gpu.build_module(primitives.name, primitives.source)?;
    let stream = gpu.create_stream()?;

    let src = DeviceBuffer::new(&gpu, GIB + GUARD, MemoryKind::Plain)?;
    let dst = DeviceBuffer::new(&gpu, GIB + GUARD, MemoryKind::Plain)?;
    let mems: Vec<RegisteredMemory> =
        ctx.comm
            .exchange(ctx.comm.register(&dst.alloc, dst.ptr(), dst.alloc.size)?)?;
    let peer = ctx.rank() ^ 1;
    if peer >= ctx.size() {
        return Ok(None);
    }
    // Before the service's proxy starts, so the two proxies do not compete for a core.
    let fifo_check = trigger_overhead(ctx, &gpu, stream, module, mems[peer].ptr());
    let local_src = ctx.comm.register(&src.alloc, src.ptr(), src.alloc.size)?;
    let config = PortChannelConfig {
        max_spin: MAX_SPIN,
        ..Default::default()
    };
    let mut service = PortChannelService::new(&ctx.comm, config)?;
    let dst_id = service.add_memory(&mems[peer])?;
    let src_id = service.add_memory(&local_src)?;
    let conn = Arc::new(CudaIpcTransport::new(gpu.clone(), ctx.device, peer)?);
    let sem = service.add_semaphore(&ctx.comm, conn)?;
    let chan = service.port_channel(sem, dst_id, src_id)?;
    service.start()?;
    let result = DeviceBuffer::new(&gpu, 8, MemoryKind::Plain)?;
    let pair = Pair {
        ctx,
        stream,
        peer,
        run_seed,
        service,
        chan,
        peer_dst: mems[peer].ptr(),
        _mems: mems,
        _local_src: local_src,
        src,
        dst,
        put_signal: gpu.get_function(prim, "port_channel_put_signal")?,
        ping_pong: gpu.get_function(module, "port_channel_ping_pong")?,
        result,
        gpu,
    };
    Ok(Some((pair, fifo_check)))
}

/// Check 1 (see the module docs). `remote` is 8 bytes of the peer's memory, mapped here, that
/// nothing else touches until the next barrier.
fn trigger_overhead(
    ctx: &RankContext,
    gpu: &Arc<dyn Gpu>,
    stream: Stream,
    module: mscclpp::core::gpu::Module,
    remote: u64,
) -> Result<String> {
    let round_trip = gpu.get_function(module, "fifo_round_trip")?;
    let to_copy = gpu.get_function(module, "fifo_trigger_to_copy")?;
    let noop = fifo_measure(ctx, gpu, stream, round_trip, None)?;
    let copy = fifo_measure(ctx, gpu, stream, to_copy, Some(remote))?;
    let (Some(landed), Some(submit)) = (copy.landed, copy.submit) else {
        return Err(Error::Internal("the copy run produced no samples".into()));
    };
    let line = format!(
        "trigger to copy start (the copy engine reading its source, GPU clock): {} (target median \
         <= {TRIGGER_TARGET_US} µs); trigger to 8 bytes landed in the peer's memory: {}; the \
         handler's cuMemcpyAsync call (host clock): {}; round trip through a no-op handler: {}",
        describe(&copy.first),
        describe(&landed),
        describe(&submit),
        describe(&noop.first)
    );
    if us(copy.first.p50) > TRIGGER_TARGET_US && !ctx.shares_gpu {
        return Err(Error::Internal(format!("target missed: {line}")));
    }
    Ok(line)
}

fn describe(s: &LatencyStats) -> String {
    format!(
        "median {:.2} µs, p99 {:.2} µs, min {:.2} µs over {}",
        us(s.p50),
        us(s.p99),
        us(s.min),
        s.samples
    )
}

/// What one FIFO run measured (see `fifo_measure`).
struct FifoRun {
    /// The kernel's first series: round trips, or trigger to copy start.
    first: LatencyStats,
    /// Copy runs: trigger to landed (GPU clock), and the handler's cuMemcpyAsync (host clock).
    landed: Option<LatencyStats>,
    submit: Option<LatencyStats>,
}

/// One FIFO measurement with `kernel` (see KERNELS) through a proxy of its own. With `copy_to`,
/// the handler copies the kernel's 8-byte clock word there on a stream of its own (what the
/// CudaIpc transport does for a put) and times each call.
fn fifo_measure(
    ctx: &RankContext,
    gpu: &Arc<dyn Gpu>,
    stream: Stream,
    kernel: Function,
    copy_to: Option<u64>,
) -> Result<FifoRun> {
    let (fifo, consumer) = DeviceFifo::new(gpu, 512)?;
    let clock = DeviceBuffer::new(gpu, 8, MemoryKind::Plain)?;
    gpu.memset_async(clock.ptr(), 0, 8, stream)?;
    let copy_stream = gpu.create_stream()?;
    let device = gpu.current_device()?;
    let (handler_gpu, clock_ptr) = (gpu.clone(), clock.ptr());
    let submit_ns = Arc::new(std::sync::Mutex::new(Vec::with_capacity(
        ROUND_TRIPS as usize + 100,
    )));
    let submit_log = submit_ns.clone();
    let mut bound = false;
    let handler = move |_| {
        if let Some(to) = copy_to {
            // The proxy thread starts on device 0; bind it to ours once.
            if !bound {
                handler_gpu.set_device(device)?;
                bound = true;
            }
            let start = std::time::Instant::now();
            handler_gpu.memcpy_async(to, clock_ptr, 8, copy_stream)?;
            let ns = start.elapsed().as_nanos() as u64;
            if let Ok(mut log) = submit_log.lock() {
                log.push(ns);
            }
        }
        Ok(ProxyAction::Continue)
    };
    let cpus = mscclpp::core::affinity::local_cpus(&gpu.properties(device)?.pci_bus_id);
    let mut proxy = Proxy::start_on(consumer, handler, cpus)?;
    let samples = DeviceBuffer::new(gpu, 2 * ROUND_TRIPS as usize * 8, MemoryKind::Plain)?;
    let done = DeviceBuffer::new(gpu, 4, MemoryKind::Plain)?;
    let handle = fifo.handle(ctx.comm.error_word_device_ptr(), MAX_SPIN);
    let finished = gpu.create_event()?;
    let mut run = None;
    // A short warm-up (first touches, clocks up), then the measured run.
    for iters in [100u32, ROUND_TRIPS] {
        if let Ok(mut log) = submit_ns.lock() {
            log.clear();
        }
        let mut a = KernelArgs::new();
        a.push(handle)
            .push(iters)
            .push(clock.ptr())
            .push(copy_to.unwrap_or(0))
            .push(samples.ptr())
            .push(done.ptr());
        let mut ptrs = a.pointers();
        // SAFETY: both FIFO kernels take (FifoHandle, u32, u64*, u64*, u64*, u32*); the buffers
        // (and the peer's word, mapped until the pair drops) live until the sync.
        unsafe { gpu.launch(kernel, LaunchConfig::linear(1, 64), stream, &mut ptrs) }?;
        wait_idle(gpu.as_ref(), stream, finished)?;
        ctx.comm.check_device_errors()?;
        let d = done.download(4)?;
        let completed = u32::from_le_bytes([d[0], d[1], d[2], d[3]]);
        if completed != iters {
            return Err(Error::Internal(format!(
                "{completed} of {iters} FIFO rounds completed"
            )));
        }
        let raw = samples.download(2 * iters as usize * 8)?;
        let mut ns: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect();
        let (first, second) = ns.split_at_mut(iters as usize);
        let mut submit = submit_ns.lock().map(|v| v.clone()).unwrap_or_default();
        run = Some(FifoRun {
            first: median_us(first)?,
            landed: copy_to.and_then(|_| LatencyStats::from_nanos(second)),
            submit: LatencyStats::from_nanos(&mut submit),
        });
    }
    // Surfaces any handler error; every handler call has returned once the proxy stopped.
    proxy.stop(Duration::from_secs(10))?;
    gpu.synchronize_stream(copy_stream)?;
    gpu.destroy_stream(copy_stream)?;
    gpu.destroy_event(finished)?;
    run.ok_or_else(|| Error::Internal("no FIFO run".into()))
}

fn wait_idle(gpu: &dyn Gpu, stream: Stream, event: mscclpp::core::gpu::Event) -> Result<()> {
    gpu.record_event(event, stream)?;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !gpu.query_event(event)? {
        if std::time::Instant::now() > deadline {
            return Err(Error::Timeout {
                what: "the FIFO measurement kernel".into(),
                timeout: Duration::from_secs(60),
            });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

fn ping_pong(p: &Pair) -> Result<String> {
    let samples = DeviceBuffer::new(&p.gpu, ROUND_TRIPS as usize * 8, MemoryKind::Plain)?;
    let initiator = p.ctx.rank() % 2 == 0;
    let mut line = String::new();
    for iters in [100u32, ROUND_TRIPS] {
        p.ctx.bootstrap.barrier()?;
        let mut a = KernelArgs::new();
        a.push(p.chan)
            .push(0u64)
            .push(iters)
            .push(u32::from(initiator))
            .push(samples.ptr())
            .push(p.result.ptr());
        p.launch(p.ping_pong, &mut a)?;
        p.sync("ping-pong")?;
        let completed = p.read_u32(&p.result)?;
        if completed != iters {
            return Err(Error::Internal(format!(
                "{completed} of {iters} round trips with rank {} completed",
                p.peer
            )));
        }
        let raw = samples.download(iters as usize * 8)?;
        let mut ns: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect();
        let s = median_us(&mut ns)?;
        line = format!(
            "{} round trips with rank {}: median {:.2} µs, p99 {:.2} µs, min {:.2} µs \
             (GPU %globaltimer, {})",
            s.samples,
            p.peer,
            us(s.p50),
            us(s.p99),
            us(s.min),
            if initiator { "initiator" } else { "responder" }
        );
    }
    Ok(line)
}

fn data_exact(p: &Pair) -> Result<String> {
    let rank = p.ctx.rank();
    let pair_base = rank & !1;
    let mut checked = Vec::new();
    for (case, &bytes) in [1usize, 4097, MIB + 3, GIB].iter().enumerate() {
        for direction in 0..2 {
            let sender = pair_base + direction;
            let case_id = 7000 + 2 * case as u64 + direction as u64;
            if rank == sender {
                p.src
                    .upload(&random_bytes(p.run_seed, case_id, sender, bytes))?;
            } else {
                p.dst.poison(POISON)?;
            }
            p.result.poison(0)?;
            p.ctx.bootstrap.barrier()?;
            p.put_signal(bytes as u64, rank == sender)?;
            p.sync(&format!("{bytes} B from rank {sender}"))?;
            if p.read_u32(&p.result)? != 1 {
                return Err(Error::Internal(format!(
                    "{bytes} B from rank {sender}: the kernel's {} timed out",
                    if rank == sender { "put+flush" } else { "wait" }
                )));
            }
            if rank != sender {
                let got = p.dst.download(bytes + GUARD)?;
                let want = random_bytes(p.run_seed, case_id, sender, bytes);
                if let Some(i) = got[..bytes].iter().zip(&want).position(|(a, b)| a != b) {
                    let wrong = got[..bytes]
                        .iter()
                        .zip(&want)
                        .filter(|(a, b)| a != b)
                        .count();
                    return Err(Error::Internal(format!(
                        "{bytes} B from rank {sender}: {wrong} bytes wrong, first at {i} \
                         (got {:#04x}, want {:#04x})",
                        got[i], want[i]
                    )));
                }
                if let Some(i) = got[bytes..].iter().position(|&b| b != POISON) {
                    return Err(Error::Internal(format!(
                        "{bytes} B from rank {sender}: wrote past the end (byte {})",
                        bytes + i
                    )));
                }
                checked.push(format!("{bytes} B"));
            }
            // The receiver is done reading before the next round overwrites its buffer.
            p.ctx.bootstrap.barrier()?;
        }
    }
    Ok(format!(
        "received from rank {} exact, guard intact: {}",
        p.peer,
        checked.join(", ")
    ))
}

fn bandwidth(p: &Pair) -> Result<String> {
    const REPS: usize = 5;
    let rank = p.ctx.rank();
    let sender = rank % 2 == 0;
    let mut line = format!("receiver of rank {}", p.peer);
    if sender {
        p.src.upload(&random_bytes(p.run_seed, 7100, rank, GIB))?;
    }
    p.ctx.bootstrap.barrier()?;
    if sender {
        let (a, b) = (p.gpu.create_event()?, p.gpu.create_event()?);
        let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
            p.gpu.record_event(a, p.stream)?;
            f()?;
            p.gpu.record_event(b, p.stream)?;
            p.sync("bandwidth")?;
            Ok(p.gpu.elapsed_ms(a, b)? as f64)
        };
        let (mut best_pc, mut best_ce) = (f64::MAX, f64::MAX);
        for _ in 0..REPS {
            best_pc = best_pc.min(time(&|| p.put_signal(GIB as u64, true))?);
            if p.read_u32(&p.result)? != 1 {
                return Err(Error::Internal("1 GiB put+flush timed out".into()));
            }
            best_ce = best_ce.min(time(&|| {
                p.gpu.memcpy_async(p.peer_dst, p.src.ptr(), GIB, p.stream)
            })?);
        }
        p.gpu.destroy_event(a)?;
        p.gpu.destroy_event(b)?;
        let gbs = |ms: f64| GIB as f64 / (ms * 1e-3) / 1e9;
        let ratio = gbs(best_pc) / gbs(best_ce);
        line = format!(
            "to rank {}: PortChannel {:.1} GB/s ({:.3} ms), cuMemcpyAsync peer {:.1} GB/s \
             ({:.3} ms): {:.1}% (best of {REPS}; target >= {:.0}%)",
            p.peer,
            gbs(best_pc),
            best_pc,
            gbs(best_ce),
            best_ce,
            100.0 * ratio,
            100.0 * BANDWIDTH_TARGET
        );
        if ratio < BANDWIDTH_TARGET && !p.ctx.shares_gpu {
            line = format!("target missed: {line}");
        }
    } else {
        // One wait per put the sender makes, so the semaphore stays balanced.
        for _ in 0..REPS {
            p.put_signal(GIB as u64, false)?;
        }
        p.sync("bandwidth receiver")?;
        if p.read_u32(&p.result)? != 1 {
            return Err(Error::Internal("a wait for a 1 GiB put timed out".into()));
        }
    }
    p.ctx.bootstrap.barrier()?;
    let spread = copy_engine_spread(p)?;
    if line.starts_with("target missed") {
        return Err(Error::Internal(format!("{line}; {spread}")));
    }
    Ok(format!("{line}; {spread}"))
}

/// Copy-engine throughput of 1 GiB split over 1, 2 and 4 streams, one way (even rank sends) and
/// both ways at once (what an allreduce's two phases load the link with). Host-timed from a
/// barrier to the last stream's completion, best of 3; reported, not judged.
fn copy_engine_spread(p: &Pair) -> Result<String> {
    let rank = p.ctx.rank();
    let streams: Vec<Stream> = (0..4)
        .map(|_| p.gpu.create_stream())
        .collect::<Result<_>>()?;
    let mut parts = Vec::new();
    for both_ways in [false, true] {
        for n in [1usize, 2, 4] {
            let sends = both_ways || rank % 2 == 0;
            let mut best = f64::MAX;
            for _ in 0..3 {
                p.ctx.bootstrap.barrier()?;
                let t0 = std::time::Instant::now();
                if sends {
                    let chunk = GIB / n;
                    for (i, &st) in streams.iter().take(n).enumerate() {
                        let off = (i * chunk) as u64;
                        p.gpu
                            .memcpy_async(p.peer_dst + off, p.src.ptr() + off, chunk, st)?;
                    }
                    for &st in streams.iter().take(n) {
                        p.gpu.synchronize_stream(st)?;
                    }
                }
                best = best.min(t0.elapsed().as_secs_f64());
            }
            if sends {
                parts.push(format!(
                    "{} {n} stream{}: {:.1} GB/s",
                    if both_ways { "both ways" } else { "one way" },
                    if n == 1 { "" } else { "s" },
                    GIB as f64 / best / 1e9
                ));
            }
        }
    }
    p.ctx.bootstrap.barrier()?;
    for st in streams {
        p.gpu.destroy_stream(st)?;
    }
    Ok(format!("copy engine, host-timed: {}", parts.join(", ")))
}
