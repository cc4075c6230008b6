//! The GPU suite of the channel primitives: one process per GPU, started by a launcher
//! (`torchrun --no-python --nproc_per_node=N mscclpp-gpu-suite`). Ranks are paired (0-1, 2-3, ...)
//! for the point-to-point checks; the all-reduce checks use every rank.
//!
//! Each check prints one line (`PASS`/`FAIL` with numbers); rank 0 prints the measurements as a
//! table at the end and the closing line `N passed, M failed`. Without a GPU it prints why and
//! exits 0.
//!
//! Flags: `--quick` (no per-algorithm matrix), `--only NAME[,NAME...]` (those sections alone:
//! algorithm names for their matrices, `primitives`, `port_channel`, `port_allreduce`,
//! `p2p` (the point-to-point engine), `alltoall` (the whole all-to-all family, gather and scatter
//! included), `reduce` (`default_reduce_zero_copy` at every root), `plans` (execution plans: the
//! fixtures at this world size and the builder's), `resources`: device memory per rank, which fails
//! above 32 MiB, and set-up times), `divergent_buffers` (the zero-copy algorithms on buffers every
//! rank places and frees differently, `mscclpp_tests::divergent_buffers`), `multi_host` (ranks on
//! several hosts: the send/recv checks through PortChannels, `p2p_checks::run_across_hosts`, which
//! `p2p` selects alone there, and the matrix of every
//! algorithm of the multi-host collection, `default_allreduce_hierarchical`, the flat
//! `port_allreduce`, `default_allgather_via_allreduce`, `default_broadcast_via_allreduce`,
//! `default_reducescatter_via_allreduce`; the algorithm names select one),
//! `--primitives-only`, `--cpu-bind none` (leave the launcher's CPU placement; by default each
//! rank's thread runs on its GPU's local CPUs, as in mscclpp-bench).

use mscclpp::core::communicator::RegisteredMemory;
use mscclpp::core::device::{D2DSemaphoreHandle, DeviceRepr, MemoryChannelHandle};
use mscclpp::core::gpu::{Function, LaunchConfig, MemoryKind, Module, Stream};
use mscclpp::core::{DataType, Error, ReduceOp, Result};
use mscclpp_tests::host_cost::per_call_cost;
use mscclpp_tests::*;
use std::time::Instant;

struct Suite {
    ctx: RankContext,
    run_seed: u64,
    passed: usize,
    failed: usize,
    measurements: Vec<(String, String)>,
    stream: Stream,
}

impl Suite {
    fn record(&mut self, name: &str, result: Result<String>) {
        let rank = self.ctx.rank();
        match result {
            Ok(detail) => {
                self.passed += 1;
                println!("[rank {rank}] PASS {name}: {detail}");
            }
            Err(e) => {
                self.failed += 1;
                println!("[rank {rank}] FAIL {name}: {e}");
            }
        }
    }

    fn measure(&mut self, name: &str, value: String) {
        self.measurements.push((name.to_string(), value));
    }

    fn peer(&self) -> Option<usize> {
        let p = self.ctx.rank() ^ 1;
        (p < self.ctx.size()).then_some(p)
    }

    fn function(&self, module: Module, name: &str) -> Result<Function> {
        self.ctx.gpu.get_function(module, name)
    }

    fn launch(&self, f: Function, cfg: LaunchConfig, args: &mut KernelArgs) -> Result<()> {
        let mut ptrs = args.pointers();
        // SAFETY: each caller passes exactly the kernel's parameters, by value, in order; every
        // pointer argument refers to live device memory owned by the caller.
        unsafe { self.ctx.gpu.launch(f, cfg, self.stream, &mut ptrs) }
    }

    fn sync_and_check(&self) -> Result<()> {
        self.ctx.gpu.synchronize_stream(self.stream)?;
        self.ctx.comm.check_device_errors()
    }

    /// Registers `buf` and maps every rank's copy; returns the peer's (or our own when alone).
    fn exchange(&self, buf: &DeviceBuffer) -> Result<Vec<RegisteredMemory>> {
        let local = self
            .ctx
            .comm
            .register(&buf.alloc, buf.ptr(), buf.alloc.size)?;
        self.ctx.comm.exchange(local)
    }

    fn time<F: FnMut() -> Result<()>>(&self, mut body: F) -> Result<f64> {
        let gpu = &self.ctx.gpu;
        let (a, b) = (gpu.create_event()?, gpu.create_event()?);
        gpu.record_event(a, self.stream)?;
        body()?;
        gpu.record_event(b, self.stream)?;
        gpu.synchronize_stream(self.stream)?;
        let ms = gpu.elapsed_ms(a, b)? as f64;
        gpu.destroy_event(a)?;
        gpu.destroy_event(b)?;
        Ok(ms)
    }
}

fn main() {
    match run() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("mscclpp-gpu-suite: {e}");
            std::process::exit(2);
        }
    }
}

fn run() -> Result<i32> {
    let Some(ctx) = RankContext::from_launcher()? else {
        println!("0 passed, 0 failed, 1 skipped");
        return Ok(0);
    };
    let props = ctx.gpu.properties(ctx.device)?;
    // As mscclpp-bench does: each rank on its GPU's CPUs unless `--cpu-bind none`.
    let argv: Vec<String> = std::env::args().collect();
    let unbound = argv
        .windows(2)
        .any(|w| w[0] == "--cpu-bind" && w[1] == "none");
    let cpu_binding = if unbound {
        "left to the launcher (--cpu-bind none)".to_string()
    } else {
        mscclpp::core::affinity::bind_current_thread_near(&props.pci_bus_id)
    };
    let stream = ctx.gpu.create_stream()?;
    let run_seed = ctx.shared_seed()?;
    if ctx.rank() == 0 {
        println!(
            "device: {} ({}, {} SMs), {} ranks, backend {}; rank 0 thread: {cpu_binding}",
            props.name,
            props.arch,
            props.multiprocessors,
            ctx.size(),
            ctx.gpu.backend_name()
        );
    }
    let mut suite = Suite {
        ctx,
        run_seed,
        passed: 0,
        failed: 0,
        measurements: Vec::new(),
        stream,
    };

    // `--only NAME[,NAME...]` runs those sections alone (plus the kernel build checks). Ranks on
    // several hosts (MSCCLPP_HOSTID, scripts/simulate-hosts.sh) run the sections whose algorithms
    // cross hosts only (those `--only` names, the others map every peer's memory).
    let multi_host = !suite.ctx.comm.topology().is_single_host();
    let only = if multi_host {
        let cross_host = CROSS_HOST_SECTIONS.map(str::to_string).to_vec();
        let picked: Vec<String> = match only_sections() {
            Some(names) => names
                .into_iter()
                .filter(|n| cross_host.contains(n))
                .collect(),
            None => cross_host,
        };
        if suite.ctx.rank() == 0 {
            println!(
                "ranks on {}: running the cross-host sections only: {}",
                suite.ctx.comm.topology(),
                picked.join(", ")
            );
        }
        Some(picked)
    } else {
        only_sections()
    };
    let wants = |section: &str| is_selected(only.as_deref(), section);
    let modules = compile_modules(&mut suite);
    if let (Ok((primitives, measure)), true) = (modules, wants(PRIMITIVES)) {
        if suite.peer().is_some() {
            let r = ping_pong(&mut suite, primitives, measure);
            suite.record("memory_channel ping-pong", r);
            let r = put_bandwidth(&mut suite, measure);
            suite.record("memory_channel put bandwidth", r);
            let r = packet_exchange(&mut suite, primitives);
            suite.record("LL packet exchange", r);
            let r = semaphore_stress(&mut suite, primitives);
            suite.record("semaphore stress 10^6", r);
            let r = peer_stops(&mut suite, primitives);
            suite.record("peer stops -> timeout error", r);
        }
        for dtype in [DataType::F32, DataType::Bf16] {
            let r = simple_allreduce(&mut suite, dtype);
            suite.record(&format!("simple allreduce {dtype}"), r);
        }
    }
    if suite.peer().is_some() && wants(PORT_CHANNEL) {
        for (name, result) in mscclpp_tests::port_channel_checks::run(&suite.ctx) {
            suite.record(&name, result);
        }
    }
    // Collective over every rank (not only pairs).
    if wants(mscclpp_collectives::port_allreduce::NAME) {
        for (name, result) in mscclpp_tests::port_allreduce_checks::run(&suite.ctx) {
            suite.record(&name, result);
        }
    }
    // The point-to-point engine over every rank; across hosts the PortChannel one, which the
    // `multi_host` section runs too.
    if multi_host && (wants(P2P) || wants(MULTI_HOST)) {
        for (name, result) in mscclpp_tests::p2p_checks::run_across_hosts(&suite.ctx) {
            suite.record(&name, result);
        }
    } else if wants(P2P) {
        for (name, result) in mscclpp_tests::p2p_checks::run(&suite.ctx) {
            suite.record(&name, result);
        }
    }
    // The all-to-all family (alltoall, alltoallv, sendrecv, gather, scatter) over every rank.
    if wants(mscclpp_collectives::alltoall::ALLTOALL_ZERO_COPY)
        || wants(ALLTOALL)
        || wants(GATHER_SCATTER)
    {
        for (name, result) in mscclpp_tests::alltoall_checks::run(&suite.ctx) {
            suite.record(&name, result);
        }
    }
    // Execution plans through the GPU interpreter (fixtures at this world size, builder plans).
    if wants(mscclpp_tests::plan_checks::SECTION) {
        for (name, result) in mscclpp_tests::plan_checks::run(&suite.ctx) {
            suite.record(&name, result);
        }
    }
    let only_primitives = std::env::args().any(|a| a == "--primitives-only");
    if !only_primitives && multi_host && (wants(MULTI_HOST) || only_names_an_algorithm(&only)) {
        // The host groups of the multi-host algorithms run the single-host kernels: compiled
        // first, shared out among the ranks (on-disk cache), so no first call waits for NVRTC
        // while its peers' kernels wait for it.
        let r = precompile_collectives(&mut suite);
        let ok = r.is_ok();
        suite.record("precompile collective kernels", r);
        if ok {
            multi_host_matrices(&mut suite, only.as_deref());
        }
    }
    if !only_primitives && !multi_host {
        let r = precompile_collectives(&mut suite);
        let ok = r.is_ok();
        suite.record("precompile collective kernels", r);
        if ok && wants(REDUCE) {
            let r = reduce_at_every_root(&mut suite);
            suite.record("reduce at every root (default_reduce_zero_copy)", r);
        }
        if ok && wants(mscclpp_tests::divergent_buffers::SECTION) {
            divergent_buffers(&mut suite);
        }
        if ok && wants(RESOURCES) {
            let r = resources(&mut suite);
            suite.record("device memory and set-up time of the default collection", r);
        }
        if ok {
            collectives_matrix(&mut suite, only.as_deref());
        }
    }

    // A rank that does not arrive is a failure of its own; the summary still prints, so the checks
    // that passed before it stay on record.
    if let Err(e) = suite.ctx.bootstrap.barrier() {
        suite.record("every rank reaches the end of the suite", Err(e));
    }
    if suite.ctx.rank() == 0 {
        println!("\n| measurement | value |\n|---|---|");
        for (k, v) in &suite.measurements {
            println!("| {k} | {v} |");
        }
    }
    println!("{} passed, {} failed", suite.passed, suite.failed);
    Ok(if suite.failed == 0 { 0 } else { 1 })
}

/// `--only` section: device memory per rank and set-up times (see [`resources`]).
const RESOURCES: &str = "resources";

/// Device memory one rank's library may hold with the default collection (issue #24): the
/// `resources` section fails above it.
const MAX_DEVICE_BYTES_PER_RANK: u64 = 32 << 20;

/// The default collection's all-to-all family, as the `resources` section runs it.
const ALLTOALL_FAMILY: [(mscclpp::core::algorithm::Collective, &str); 3] = {
    use mscclpp::core::algorithm::Collective;
    use mscclpp::core::algorithm_collection::native_names as names;
    [
        (Collective::AllToAll, names::ALLTOALL_ZERO_COPY),
        (Collective::AllToAll, names::ALLTOALL_PACKET),
        (Collective::SendRecv, names::SENDRECV_ZERO_COPY),
    ]
};

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / MIB as f64)
}

/// Device memory this rank's library holds (`live_device_bytes`, exact under MPS) after the
/// communicator's init, after building the default collection with the point-to-point engine as
/// the NCCL shim builds it (on the collection's region: no allocation of its own), and after
/// running each default algorithm once and one ring group of the engine (small and 4 MiB
/// messages, and 4 KiB per peer for the all-to-all family: every
/// scratch and semaphore a call touches is allocated by then; the check's own buffers are freed
/// before each reading), with the communicator's init time and the collection's build time. Fails
/// when the per-rank total passes [`MAX_DEVICE_BYTES_PER_RANK`]. Every rank prints its own line;
/// rank 0's figures go to the measurements table.
fn resources(s: &mut Suite) -> Result<String> {
    use mscclpp::core::gpu::live_device_bytes;
    use mscclpp_collectives::{testing::run_collective_check, NativeKind};
    let comm = s.ctx.comm.clone();
    let rank = s.ctx.rank();
    let after_init = s.ctx.bytes_after_comm_init;
    let before_build = live_device_bytes();
    let started = Instant::now();
    let (builder, collection_resources) =
        mscclpp_collectives::build_default_algorithms_with_resources(
            &comm,
            mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
            mscclpp::core::algorithm_collection::AlgorithmCollection::builder(),
        )?;
    let coll = builder.build();
    // The point-to-point engine as the NCCL shim builds it: on the collection's region.
    let collection_resources = collection_resources
        .ok_or_else(|| Error::Internal("the default collection lent no resources".into()))?;
    let p2p = mscclpp_collectives::p2p::P2pEngine::with_resources(
        comm.clone(),
        collection_resources.clone(),
    )?;
    let build = started.elapsed();
    let after_build = live_device_bytes();
    let mut per_algorithm = Vec::new();
    let mut wrong = Vec::new();
    for (i, kind) in NativeKind::ALL.into_iter().enumerate() {
        let algo = coll
            .get(kind.collective(), kind.name())
            .ok_or_else(|| Error::Internal(format!("{} missing", kind.name())))?;
        for bytes in [4096usize, 4 * MIB] {
            let seed = s.run_seed ^ (0x5e50 + i as u64 * 2 + (bytes > 4096) as u64);
            let count = bytes / DataType::F32.size();
            match run_collective_check(
                &comm,
                algo.as_ref(),
                DataType::F32,
                ReduceOp::Sum,
                count,
                false,
                seed,
                false,
                None,
            ) {
                Ok(r) if r.wrong == 0 => {}
                Ok(r) => wrong.push(format!("{} {bytes} B: {} wrong", kind.name(), r.wrong)),
                // Beyond a packet algorithm's scratch: refused by design.
                Err(Error::InvalidArgument(_)) => {}
                Err(e) => wrong.push(format!("{} {bytes} B: {e}", kind.name())),
            }
        }
        per_algorithm.push(format!("{} {}", kind.name(), mib(live_device_bytes())));
    }
    // The all-to-all family borrows the same resources: run it too.
    for (i, (collective, name)) in ALLTOALL_FAMILY.into_iter().enumerate() {
        let algo = coll
            .get(collective, name)
            .ok_or_else(|| Error::Internal(format!("{name} missing")))?;
        let seed = s.run_seed ^ (0xa11 + i as u64);
        let r = mscclpp_tests::alltoall_checks::check_uniform(&s.ctx, algo.as_ref(), 4096, seed);
        if let Err(e) = r {
            wrong.push(format!("{name} 4096 B per peer: {e}"));
        }
        per_algorithm.push(format!("{name} {}", mib(live_device_bytes())));
    }
    // The engine's ring once, and a second engine on the same region refused.
    if let Err(e) =
        mscclpp_tests::p2p_checks::ring_once(&s.ctx, &p2p, 4096 + 8, s.run_seed ^ 0x9292)
    {
        wrong.push(format!("p2p ring on the collection's region: {e}"));
    }
    if mscclpp_collectives::p2p::P2pEngine::with_resources(comm.clone(), collection_resources)
        .is_ok()
    {
        wrong.push("a second p2p engine took the collection's region".into());
    }
    per_algorithm.push(format!(
        "p2p engine ({} bytes in the collection's allocation) {}",
        p2p.device_bytes(),
        mib(live_device_bytes())
    ));
    let after_all = live_device_bytes();
    if after_all > MAX_DEVICE_BYTES_PER_RANK {
        wrong.push(format!(
            "device memory per rank {} exceeds the {} budget",
            mib(after_all),
            mib(MAX_DEVICE_BYTES_PER_RANK)
        ));
    }
    let line = format!(
        "context creation {:.1} ms; communicator init {:.1} ms, {}; default collection built in \
         {:.1} ms, {} (+{}); after running every algorithm {} (+{} over init): per-rank total {} \
         (budget {})",
        s.ctx.context_init.as_secs_f64() * 1e3,
        s.ctx.comm_init.as_secs_f64() * 1e3,
        mib(after_init),
        build.as_secs_f64() * 1e3,
        mib(after_build),
        mib(after_build.saturating_sub(before_build)),
        mib(after_all),
        mib(after_all.saturating_sub(after_init)),
        mib(after_all),
        mib(MAX_DEVICE_BYTES_PER_RANK),
    );
    println!(
        "[rank {rank}] resources: {line}\n[rank {rank}] resources per algorithm (after its calls): {}",
        per_algorithm.join(", ")
    );
    if rank == 0 {
        let n = s.ctx.size();
        s.measurements.push((
            format!("device memory per rank after communicator init ({n} ranks)"),
            mib(after_init),
        ));
        s.measurements.push((
            format!("device memory per rank, default collection built ({n} ranks)"),
            mib(after_build),
        ));
        s.measurements.push((
            format!("device memory per rank after every default algorithm ran ({n} ranks)"),
            mib(after_all),
        ));
        s.measurements.push((
            format!("communicator init ({n} ranks)"),
            format!("{:.1} ms", s.ctx.comm_init.as_secs_f64() * 1e3),
        ));
        s.measurements.push((
            format!("default collection build ({n} ranks)"),
            format!("{:.1} ms", build.as_secs_f64() * 1e3),
        ));
    }
    drop(coll);
    if wrong.is_empty() {
        Ok(line)
    } else {
        Err(Error::Internal(wrong.join("; ")))
    }
}

/// `--only` section names: the channel primitives and the two PortChannel sections.
const PRIMITIVES: &str = "primitives";
const PORT_CHANNEL: &str = "port_channel";
/// `--only` name of the point-to-point engine's checks (`p2p_checks`).
const P2P: &str = "p2p";
/// `--only` name of the all-to-all family's checks (also `default_alltoall_zero_copy`).
const ALLTOALL: &str = "alltoall";
/// Another `--only` name of the all-to-all family's checks (kept for the commands of earlier runs).
const GATHER_SCATTER: &str = "gather_scatter";

/// `--only` section: `default_reduce_zero_copy` at every root ([`reduce_at_every_root`]).
const REDUCE: &str = "reduce";

/// `--only` section of ranks on several hosts: [`multi_host_matrices`].
const MULTI_HOST: &str = "multi_host";
/// The sections that run when the ranks span hosts (the others map every peer's memory):
/// `port_allreduce`'s own checks, the send/recv checks through PortChannels, and the multi-host
/// collection's matrices (all, or one by name). `--only port_allreduce` runs both its own checks
/// and its matrix in the multi-host collection.
const CROSS_HOST_SECTIONS: [&str; 7] = [
    mscclpp_collectives::port_allreduce::NAME,
    P2P,
    MULTI_HOST,
    mscclpp_collectives::hierarchical::NAME,
    mscclpp::core::algorithm_collection::native_names::ALLGATHER_VIA_ALLREDUCE,
    mscclpp::core::algorithm_collection::native_names::BROADCAST_VIA_ALLREDUCE,
    mscclpp::core::algorithm_collection::native_names::REDUCESCATTER_VIA_ALLREDUCE,
];

/// Whether `only` (on several hosts, already cut to [`CROSS_HOST_SECTIONS`]) names one of the
/// multi-host collection's algorithms (whose matrix [`multi_host_matrices`] runs).
fn only_names_an_algorithm(only: &Option<Vec<String>>) -> bool {
    only.as_deref()
        .is_some_and(|names| names.iter().any(|n| n != MULTI_HOST && n != P2P))
}

/// The names given to `--only`, if it was given.
fn only_sections() -> Option<Vec<String>> {
    let argv: Vec<String> = std::env::args().collect();
    let i = argv.iter().position(|a| a == "--only")?;
    Some(
        argv.get(i + 1)
            .map(|names| names.split(',').map(str::to_string).collect())
            .unwrap_or_default(),
    )
}

/// Whether `--only` (if given) names `section`.
fn is_selected(only: Option<&[String]>, section: &str) -> bool {
    only.map_or(true, |names| names.iter().any(|n| n == section))
}

fn compile_modules(s: &mut Suite) -> Result<(Module, Module)> {
    let gpu = s.ctx.gpu.clone();
    let primitives = mscclpp_kernels_cu::kernel("primitives")
        .ok_or_else(|| Error::Internal("no primitives kernel unit".into()))?;
    // First use compiles (or loads what an earlier run cached); the second call is a cache load.
    let t0 = Instant::now();
    let first = gpu.build_module(primitives.name, primitives.source);
    let first_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t1 = Instant::now();
    let second = gpu.build_module(primitives.name, primitives.source);
    let second_ms = t1.elapsed().as_secs_f64() * 1e3;
    let measure = gpu.build_module("gpu_suite_measure", mscclpp_tests::SUITE_KERNELS);
    let result = match (first, second, measure) {
        (Ok(p), Ok(_), Ok(m)) => {
            s.measure(
                "primitives module: first build_module (compile or disk cache)",
                format!("{first_ms:.1} ms"),
            );
            s.measure(
                "primitives module: second build_module (disk cache)",
                format!("{second_ms:.2} ms"),
            );
            Ok((p, m))
        }
        (Err(e), ..) | (_, Err(e), _) | (.., Err(e)) => Err(e),
    };
    let record = result
        .as_ref()
        .map(|_| format!("first {first_ms:.1} ms, cached {second_ms:.2} ms"))
        .map_err(|e| Error::Internal(e.to_string()));
    s.record("kernel build (NVRTC + cache)", record);
    result
}

/// A MemoryChannel to the pair peer over `buf` (ours) and the peer's mapping of its `buf`.
fn pair_channel(
    s: &Suite,
    mems: &[RegisteredMemory],
    src: u64,
    packet_buffer: u64,
    sem: D2DSemaphoreHandle,
) -> Result<MemoryChannelHandle> {
    let peer = s
        .peer()
        .ok_or_else(|| Error::Internal("no pair peer".into()))?;
    Ok(s.ctx
        .comm
        .memory_channel(sem, &mems[peer], src, packet_buffer))
}

/// Semaphores towards the pair peer. Every rank calls `d2d_semaphores` for the same peers in the
/// same order, so slot reservations stay aligned.
fn pair_semaphores(s: &Suite, count: usize) -> Result<Vec<D2DSemaphoreHandle>> {
    let peer = s
        .peer()
        .ok_or_else(|| Error::Internal("no pair peer".into()))?;
    s.ctx.comm.d2d_semaphores(peer, count)
}

fn ping_pong(s: &mut Suite, primitives: Module, measure: Module) -> Result<String> {
    let gpu = s.ctx.gpu.clone();
    let buf = DeviceBuffer::new(&gpu, MIB, MemoryKind::Plain)?;
    let mems = s.exchange(&buf)?;
    let sem = pair_semaphores(s, 1)?[0];
    let chan = pair_channel(s, &mems, buf.ptr(), 0, sem)?;
    let f = s.function(primitives, "memory_channel_ping_pong")?;
    let sem_pp = s.function(measure, "semaphore_ping_pong")?;
    let initiator = (s.ctx.rank() % 2 == 0) as u32;
    let iters: u32 = 20_000;
    let mut lines = Vec::new();
    // Each variant: a warm-up, then a timed run of `iters` round trips with no payload.
    for variant in [
        "MemoryChannel ping-pong (block, release/acquire)",
        "semaphore ping-pong (1 thread, release/acquire)",
        "semaphore ping-pong (1 thread, relaxed)",
    ] {
        let mut rtt_us = 0.0;
        for n in [100u32, iters] {
            s.ctx.bootstrap.barrier()?;
            let ms = s.time(|| {
                let mut args = KernelArgs::new();
                if variant.starts_with("MemoryChannel") {
                    args.push(chan).push(0u64).push(n).push(initiator);
                    s.launch(f, LaunchConfig::linear(1, 32), &mut args)
                } else {
                    let relaxed = variant.ends_with("relaxed)") as u32;
                    args.push(chan.semaphore)
                        .push(n)
                        .push(initiator)
                        .push(relaxed);
                    s.launch(sem_pp, LaunchConfig::linear(1, 1), &mut args)
                }
            })?;
            s.ctx.comm.check_device_errors()?;
            rtt_us = ms * 1e3 / n as f64;
        }
        s.measure(&format!("round trip, {variant}"), format!("{rtt_us:.2} µs"));
        lines.push(format!("{variant}: {rtt_us:.2} µs"));
    }
    Ok(format!("{iters} round trips each; {}", lines.join(", ")))
}

fn put_bandwidth(s: &mut Suite, measure: Module) -> Result<String> {
    const BYTES: usize = 1 << 30;
    let gpu = s.ctx.gpu.clone();
    let src = DeviceBuffer::new(&gpu, BYTES, MemoryKind::Plain)?;
    let dst = DeviceBuffer::new(&gpu, BYTES, MemoryKind::Plain)?;
    gpu.memset_async(src.ptr(), 0x5a, BYTES, s.stream)?;
    gpu.synchronize_stream(s.stream)?;
    let mems = s.exchange(&dst)?;
    let sem = pair_semaphores(s, 1)?[0];
    let chan = pair_channel(s, &mems, src.ptr(), 0, sem)?;
    let peer = s.peer().ok_or_else(|| Error::Internal("no peer".into()))?;
    let peer_dst = mems[peer].ptr();
    let put = s.function(measure, "put_bandwidth")?;
    let copy = s.function(measure, "plain_copy")?;
    let sms = gpu.properties(s.ctx.device)?.multiprocessors;
    let cfg = LaunchConfig::linear(sms * 2, 1024);
    let mut line = String::new();
    // Only the even rank of each pair sends (one direction: GPU r -> GPU r+1).
    if s.ctx.rank() % 2 == 0 {
        let reps = 5;
        let mut best = [f64::MAX; 3];
        for _ in 0..reps {
            let ms = [
                s.time(|| {
                    let mut a = KernelArgs::new();
                    a.push(chan).push(BYTES as u64);
                    s.launch(put, cfg, &mut a)
                })?,
                s.time(|| {
                    let mut a = KernelArgs::new();
                    a.push(peer_dst).push(src.ptr()).push((BYTES / 16) as u64);
                    s.launch(copy, cfg, &mut a)
                })?,
                s.time(|| gpu.memcpy_async(peer_dst, src.ptr(), BYTES, s.stream))?,
            ];
            for (b, m) in best.iter_mut().zip(ms) {
                *b = b.min(m);
            }
        }
        s.ctx.comm.check_device_errors()?;
        let gbs = best.map(|ms| BYTES as f64 / (ms * 1e-3) / 1e9);
        line = format!(
            "put {:.1} GB/s, plain SM copy {:.1} GB/s ({:.1}%), copy engine {:.1} GB/s",
            gbs[0],
            gbs[1],
            100.0 * gbs[0] / gbs[1],
            gbs[2]
        );
        s.measure(
            "MemoryChannel put 1 GiB, one way",
            format!("{:.1} GB/s", gbs[0]),
        );
        s.measure(
            "plain SM store copy 1 GiB, one way",
            format!("{:.1} GB/s", gbs[1]),
        );
        s.measure(
            "copy engine (cuMemcpyAsync) 1 GiB, one way",
            format!("{:.1} GB/s", gbs[2]),
        );
    }
    s.ctx.bootstrap.barrier()?;
    // The receiver checks that the put landed (a sample of the buffer, every 4 KiB).
    if s.ctx.rank() % 2 == 1 {
        let got = dst.download(BYTES)?;
        let bad = got.iter().step_by(4096).filter(|&&b| b != 0x5a).count();
        if bad != 0 {
            return Err(Error::Internal(format!(
                "{bad} sampled bytes wrong after put"
            )));
        }
        line = "received data verified".into();
    }
    Ok(line)
}

fn packet_exchange(s: &mut Suite, primitives: Module) -> Result<String> {
    let gpu = s.ctx.gpu.clone();
    let max_bytes = MIB;
    let src = DeviceBuffer::new(&gpu, max_bytes, MemoryKind::Plain)?;
    // LL16 doubles the bytes; keep room for either packet kind.
    let scratch = DeviceBuffer::new(&gpu, 2 * max_bytes + 64, MemoryKind::Plain)?;
    scratch.poison(0)?;
    let out = DeviceBuffer::new(&gpu, max_bytes, MemoryKind::Plain)?;
    let mems = s.exchange(&scratch)?;
    let sem = pair_semaphores(s, 1)?[0];
    let chan = pair_channel(s, &mems, src.ptr(), scratch.ptr(), sem)?;
    let peer = s.peer().ok_or_else(|| Error::Internal("no peer".into()))?;
    let mut flag = 0u32;
    let mut checked = 0;
    for kernel in ["ll_packet_exchange_ll16", "ll_packet_exchange_ll8"] {
        let f = s.function(primitives, kernel)?;
        for (case, bytes) in [1usize, 3, 8, 1023, 4104, 65_536 + 4, max_bytes]
            .into_iter()
            .enumerate()
        {
            flag += 1;
            let mine = seed(s.run_seed, 100 + case as u64, s.ctx.rank());
            let theirs = seed(s.run_seed, 100 + case as u64, peer);
            let data = |sd: u64| {
                let mut r = SplitMix64(sd);
                (0..bytes).map(|_| r.next_u64() as u8).collect::<Vec<u8>>()
            };
            src.upload(&data(mine))?;
            out.poison(0xee)?;
            s.ctx.bootstrap.barrier()?;
            let mut a = KernelArgs::new();
            a.push(chan).push(out.ptr()).push(bytes as u64).push(flag);
            s.launch(f, LaunchConfig::linear(4, 256), &mut a)?;
            s.sync_and_check()?;
            let got = out.download(bytes)?;
            if got != data(theirs) {
                let i = got.iter().zip(data(theirs)).position(|(a, b)| *a != b);
                return Err(Error::Internal(format!(
                    "{kernel}, {bytes} B: first wrong byte at {i:?}"
                )));
            }
            checked += 1;
            // Both ranks must be done reading before the next round's packets overwrite scratch.
            s.ctx.bootstrap.barrier()?;
        }
    }
    Ok(format!(
        "{checked} exchanges (LL16 and LL8, 1 B to 1 MiB) exact"
    ))
}

fn semaphore_stress(s: &mut Suite, primitives: Module) -> Result<String> {
    let gpu = s.ctx.gpu.clone();
    let iters: u32 = 1_000_000;
    let f = s.function(primitives, "semaphore_stress")?;
    let completed = DeviceBuffer::new(&gpu, 4, MemoryKind::Plain)?;
    let chans_dev = DeviceBuffer::new(
        &gpu,
        std::mem::size_of::<MemoryChannelHandle>(),
        MemoryKind::Plain,
    )?;
    let mut lines = Vec::new();
    for mode in 0u32..3 {
        let sem = pair_semaphores(s, 1)?[0];
        let chan = MemoryChannelHandle {
            semaphore: sem,
            ..Default::default()
        };
        chans_dev.upload(chan.as_bytes())?;
        completed.poison(0)?;
        s.ctx.bootstrap.barrier()?;
        let ms = s.time(|| {
            let mut a = KernelArgs::new();
            a.push(chans_dev.ptr())
                .push(1u32)
                .push(iters)
                .push(mode)
                .push(completed.ptr());
            s.launch(f, LaunchConfig::linear(1, 32), &mut a)
        })?;
        s.ctx.comm.check_device_errors()?;
        let done = u32::from_le_bytes(
            completed.download(4)?[..4]
                .try_into()
                .map_err(|_| Error::Internal("4 bytes".into()))?,
        );
        if done != iters {
            return Err(Error::Internal(format!(
                "mode {mode}: {done} of {iters} waits completed"
            )));
        }
        lines.push(format!("mode {mode}: {iters} in {ms:.0} ms"));
    }
    Ok(lines.join(", "))
}

fn peer_stops(s: &mut Suite, primitives: Module) -> Result<String> {
    let gpu = s.ctx.gpu.clone();
    let f = s.function(primitives, "semaphore_stress")?;
    let mut sem = pair_semaphores(s, 1)?[0];
    // About a million polls: long enough for a live peer, short enough for a test.
    sem.max_spin = 1 << 20;
    // A private error word: the communicator's is sticky, and the later sections still use it.
    let word = gpu.alloc_host_mapped(mscclpp::core::device::ERROR_WORD_BYTES)?;
    sem.error_word = word.device_ptr;
    let result = peer_stops_with(s, f, sem, &word);
    gpu.free_host_mapped(&word)?;
    result
}

fn peer_stops_with(
    s: &mut Suite,
    f: Function,
    sem: D2DSemaphoreHandle,
    word: &mscclpp::core::gpu::HostMapped,
) -> Result<String> {
    let gpu = s.ctx.gpu.clone();
    let completed = DeviceBuffer::new(&gpu, 4, MemoryKind::Plain)?;
    let chans_dev = DeviceBuffer::new(
        &gpu,
        std::mem::size_of::<MemoryChannelHandle>(),
        MemoryKind::Plain,
    )?;
    let chan = MemoryChannelHandle {
        semaphore: sem,
        ..Default::default()
    };
    chans_dev.upload(chan.as_bytes())?;
    s.ctx.bootstrap.barrier()?;
    let mut detail = "peer idled".to_string();
    // The even rank waits for a signal its peer never sends.
    if s.ctx.rank() % 2 == 0 {
        let t = Instant::now();
        let mut a = KernelArgs::new();
        a.push(chans_dev.ptr())
            .push(1u32)
            .push(1u32)
            .push(0u32)
            .push(completed.ptr());
        s.launch(f, LaunchConfig::linear(1, 32), &mut a)?;
        s.ctx.gpu.synchronize_stream(s.stream)?;
        // SAFETY: the word is live host-mapped memory, read once the kernel finished.
        let code = unsafe { (word.host_ptr as *const u32).read_volatile() };
        match mscclpp::core::device::check_device_error(code, "the lone wait") {
            Err(Error::DeviceTimeout(msg)) => {
                detail = format!(
                    "timeout reported after {:.0} ms: {msg}",
                    t.elapsed().as_secs_f64() * 1e3
                )
            }
            Err(e) => return Err(e),
            Ok(()) => {
                return Err(Error::Internal(
                    "a wait without a signal did not time out".into(),
                ))
            }
        }
    }
    s.ctx.bootstrap.barrier()?;
    Ok(detail)
}

fn simple_allreduce(s: &mut Suite, dtype: DataType) -> Result<String> {
    use mscclpp_kernels_cu::{allreduce_entry_point, AllreduceKernel};
    let gpu = s.ctx.gpu.clone();
    let (rank, nranks) = (s.ctx.rank(), s.ctx.size());
    let esize = dtype.size();
    let max_count = 256 * MIB / esize;
    let nblocks = 32u32;
    let (unit, put_name) = allreduce_entry_point(AllreduceKernel::Put, dtype, Default::default())?;
    let (_, packet_name) =
        allreduce_entry_point(AllreduceKernel::Packet, dtype, Default::default())?;
    let module = gpu.build_module(unit.name, unit.source)?;
    let put = gpu.get_function(module, &put_name)?;
    let packet = gpu.get_function(module, &packet_name)?;
    // Scratch: the put kernel needs nranks slots of the message; the packet kernel twice nranks
    // slots of LL16 packets (2x the payload) for messages up to 1 MiB.
    let scratch_bytes = (nranks * (max_count * esize + 16)).max(2 * nranks * 2 * MIB + 4096);
    let scratch = DeviceBuffer::new(&gpu, scratch_bytes, MemoryKind::Plain)?;
    scratch.poison(0)?;
    let mems = s.exchange(&scratch)?;
    // nblocks x (nranks-1) channels, block-major: block b's channel to the i-th peer.
    let mut chans = Vec::new();
    let peers: Vec<usize> = (0..nranks).filter(|&p| p != rank).collect();
    let mut sems = Vec::new();
    for &p in &peers {
        sems.push(s.ctx.comm.d2d_semaphores(p, nblocks as usize)?);
    }
    for b in 0..nblocks as usize {
        for (peer_sems, &p) in sems.iter().zip(&peers) {
            chans.push(
                s.ctx
                    .comm
                    .memory_channel(peer_sems[b], &mems[p], 0, scratch.ptr()),
            );
        }
    }
    let chan_bytes = DeviceRepr::slice_as_bytes(&chans);
    let chans_dev = DeviceBuffer::new(&gpu, chan_bytes.len(), MemoryKind::Plain)?;
    chans_dev.upload(chan_bytes)?;
    let input = DeviceBuffer::new(&gpu, max_count * esize, MemoryKind::Plain)?;
    let output = DeviceBuffer::new(&gpu, max_count * esize, MemoryKind::Plain)?;
    let counts = [
        1usize,
        3,
        1023,
        (4096 + 8) / esize,
        MIB / esize - 1,
        64 * MIB / esize,
        max_count,
    ];
    let mut flag = 0u32;
    let mut checks = 0;
    for (case, &count) in counts.iter().enumerate() {
        for in_place in [false, true] {
            for kernel in [AllreduceKernel::Packet, AllreduceKernel::Put] {
                if kernel == AllreduceKernel::Packet && count * esize > MIB {
                    continue;
                }
                let case_id = 1000
                    + (case * 4) as u64
                    + in_place as u64 * 2
                    + (kernel == AllreduceKernel::Put) as u64;
                let inputs: Vec<Vec<f64>> = (0..nranks)
                    .map(|r| {
                        random_elements(dtype, count, seed(s.run_seed, case_id, r)).map(|x| x.1)
                    })
                    .collect::<Result<_>>()?;
                let (mine, _) = random_elements(dtype, count, seed(s.run_seed, case_id, rank))?;
                input.upload(&mine)?;
                let out = if in_place {
                    &input
                } else {
                    output.poison(0xff)?;
                    &output
                };
                s.ctx.bootstrap.barrier()?;
                let mut a = KernelArgs::new();
                a.push(chans_dev.ptr())
                    .push(input.ptr())
                    .push(out.ptr())
                    .push(count as u64);
                a.push(rank as u32).push(nranks as u32);
                let (f, cfg) = if kernel == AllreduceKernel::Packet {
                    flag += 1;
                    a.push(flag);
                    (packet, LaunchConfig::linear(8, 512))
                } else {
                    (put, LaunchConfig::linear(nblocks, 512))
                };
                a.push(ReduceOp::Sum.to_nccl());
                s.launch(f, cfg, &mut a)?;
                s.sync_and_check()?;
                let got = decode_elements(dtype, &out.download(count * esize)?)?;
                let (wrong, first) = check_sum(dtype, &got, &inputs, (nranks - 1).max(1) as f64);
                if wrong != 0 {
                    return Err(Error::Internal(format!(
                        "{kernel:?} count {count} in_place {in_place}: {wrong} wrong; {}",
                        first.unwrap_or_default()
                    )));
                }
                checks += 1;
                s.ctx.bootstrap.barrier()?;
            }
        }
    }
    Ok(format!(
        "{checks} checks (1 to {max_count} elements, in/out of place, packet and put), every element within 1 ulp of the float64 sum"
    ))
}

/// Compiles every collective kernel unit into the shared disk cache before the checks, spread over
/// the ranks and over threads (NVRTC is CPU-bound; one unit takes about half a second), so the
/// checks below only load cached images.
fn precompile_collectives(s: &mut Suite) -> Result<String> {
    use mscclpp_kernels_cu::collectives::{unit_name, unit_source, CollectiveFile, ReduceSpec};
    let mut units = Vec::new();
    for file in CollectiveFile::ALL {
        if file.reduces() {
            for dtype in DataType::ALL {
                for op in ReduceOp::ALL {
                    units.push((
                        file,
                        Some(ReduceSpec {
                            dtype,
                            acc: dtype,
                            op,
                        }),
                    ));
                }
            }
        } else {
            units.push((file, None));
        }
    }
    let (rank, size) = (s.ctx.rank(), s.ctx.size());
    let mine: Vec<_> = units.iter().skip(rank).step_by(size).copied().collect();
    let threads = 8;
    let t = Instant::now();
    let errors: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|w| {
                let gpu = s.ctx.gpu.clone();
                let device = s.ctx.device;
                let part: Vec<_> = mine.iter().skip(w).step_by(threads).copied().collect();
                scope.spawn(move || {
                    let mut errs = Vec::new();
                    if let Err(e) = gpu.set_device(device) {
                        return vec![e.to_string()];
                    }
                    for (file, spec) in part {
                        let r = unit_source(file, spec)
                            .and_then(|src| gpu.build_module(&unit_name(file, spec), &src));
                        if let Err(e) = r {
                            errs.push(format!("{}: {e}", unit_name(file, spec)));
                        }
                    }
                    errs
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join()
                    .unwrap_or_else(|_| vec!["a compile thread panicked".into()])
            })
            .collect()
    });
    s.ctx.bootstrap.barrier()?;
    if !errors.is_empty() {
        return Err(Error::Internal(errors.join("; ")));
    }
    let secs = t.elapsed().as_secs_f64();
    s.measure(
        "collective kernel units compiled (all ranks, 8 threads each)",
        format!("{} units in {secs:.1} s", units.len()),
    );
    Ok(format!(
        "{} units ({} here) in {secs:.1} s",
        units.len(),
        mine.len()
    ))
}

/// `default_reduce_zero_copy` at every root: every type and op at 1 element, 3 elements and
/// 4 KiB + 8 bytes (odd sizes, in whole elements), every type's sum at 1 MiB less one element,
/// f32 and i32 sums at 64 MiB; in and out of place; bf16, f32 and i32 sums captured in a CUDA
/// graph and replayed twice on fresh data. Integers exact; floats against the float64 reference
/// within 1e-3 + rtol * (sum/avg: sum |x|, else |want|), rtol one rounding of the type per rank
/// (`testing`). Off the root the output must be untouched (the poison, or in place the input).
fn reduce_at_every_root(s: &mut Suite) -> Result<String> {
    use mscclpp::core::algorithm::Collective;
    use mscclpp::core::algorithm_collection::native_names::REDUCE_ZERO_COPY;
    use mscclpp_collectives::testing::run_collective_check;
    let comm = s.ctx.comm.clone();
    let coll = mscclpp_collectives::default_algorithm_collection(
        &comm,
        mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
    )?;
    let algo = coll
        .get(Collective::Reduce, REDUCE_ZERO_COPY)
        .ok_or_else(|| Error::Internal(format!("{REDUCE_ZERO_COPY} is not in the collection")))?;
    // (dtype, ops, element counts, graph)
    let mut plan: Vec<(DataType, Vec<ReduceOp>, Vec<usize>, bool)> = Vec::new();
    for dtype in DataType::ALL {
        let es = dtype.size();
        plan.push((
            dtype,
            ReduceOp::ALL.to_vec(),
            vec![1, 3, (4096 + 8) / es],
            false,
        ));
        plan.push((dtype, vec![ReduceOp::Sum], vec![MIB / es - 1], false));
    }
    for dtype in [DataType::Bf16, DataType::F32, DataType::I32] {
        let es = dtype.size();
        plan.push((dtype, vec![ReduceOp::Sum], vec![3, MIB / es - 1], true));
    }
    for dtype in [DataType::F32, DataType::I32] {
        plan.push((dtype, vec![ReduceOp::Sum], vec![64 * MIB / 4], false));
    }
    let t = Instant::now();
    let (mut checks, mut failures) = (0usize, Vec::new());
    let mut case = 0u64;
    for root in 0..s.ctx.size() {
        for (dtype, ops, counts, graph) in &plan {
            for &op in ops {
                for &count in counts {
                    for in_place in [false, true] {
                        case += 1;
                        let seed = s.run_seed ^ case.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                        let what = format!(
                            "root {root} {dtype} {op} count {count} in_place {in_place} graph {graph}"
                        );
                        match run_collective_check(
                            &comm,
                            algo.as_ref(),
                            *dtype,
                            op,
                            count,
                            in_place,
                            seed,
                            *graph,
                            Some(root),
                        ) {
                            Ok(r) if r.wrong == 0 => checks += 1,
                            Ok(r) => failures.push(format!(
                                "{what}: {} wrong, first {:?} (tol {})",
                                r.wrong, r.first_wrong, r.tolerance
                            )),
                            // A device error is sticky on the communicator: stop here.
                            Err(e) => {
                                return Err(Error::Internal(format!(
                                    "{what}: {e} ({checks} passed before)"
                                )))
                            }
                        }
                        if failures.len() > 20 {
                            break;
                        }
                    }
                }
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    matrix_result(
        checks,
        &failures,
        format!(
            "{checks} checks exact/within tolerance at {} roots, {secs:.1} s",
            s.ctx.size()
        ),
    )
}

/// A check matrix's outcome: `passed` when nothing failed, else the failures (the first six).
fn matrix_result(checks: usize, failures: &[String], passed: String) -> Result<String> {
    if failures.is_empty() {
        return Ok(passed);
    }
    Err(Error::Internal(format!(
        "{} failures ({checks} passed): {}",
        failures.len(),
        failures[..failures.len().min(6)].join(" | ")
    )))
}

/// Every native algorithm x data type x op x size x placement x eager/graph, checked element by
/// element against the host reference. The full type/op matrix runs at the small sizes; large sizes
/// run a representative subset so the suite fits in a few minutes.
fn collectives_matrix(s: &mut Suite, only: Option<&[String]>) {
    use mscclpp_collectives::NativeKind;
    let comm = s.ctx.comm.clone();
    let coll = match mscclpp_collectives::default_algorithm_collection(
        &comm,
        mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
    ) {
        Ok(c) => c,
        Err(e) => {
            s.record("build the native algorithms", Err(e));
            return;
        }
    };
    let r = host_path_cost(s, &coll);
    s.record("host path of one eager allreduce call", r);
    let mut case = 0u64;
    // `--quick`: the host path and the two-communicator check only, not the per-algorithm matrix;
    // `--only NAME,...`: the matrices of the algorithms named there only.
    let quick = std::env::args().any(|a| a == "--quick");
    let kinds = NativeKind::ALL
        .into_iter()
        .filter(|k| !quick && is_selected(only, k.name()));
    for kind in kinds {
        let Some(algo) = coll.get(kind.collective(), kind.name()) else {
            s.record(
                kind.name(),
                Err(Error::Internal("not in the collection".into())),
            );
            continue;
        };
        // 1 GiB: the host reference alone takes seconds, so only the large-message all-reduces
        // (for the push pipeline, hundreds of steps through both halves).
        let gib = matches!(
            kind,
            NativeKind::AllreduceRsagZeroCopy
                | NativeKind::AllreduceCopyEngine
                | NativeKind::AllreduceRsagPush
        );
        let result = algorithm_matrix(s, &comm, algo.as_ref(), (gib, true), &mut case);
        s.record(kind.name(), result);
    }
    let r = two_communicators(s, &coll);
    s.record("two communicators in one process", r);
}

/// The user-buffer rule's check (`divergent_buffers`), on a default collection of its own.
fn divergent_buffers(s: &mut Suite) {
    let comm = s.ctx.comm.clone();
    match mscclpp_collectives::default_algorithm_collection(
        &comm,
        mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
    ) {
        Ok(coll) => {
            for (name, result) in mscclpp_tests::divergent_buffers::run(&s.ctx, &coll) {
                s.record(&name, result);
            }
        }
        Err(e) => s.record("build the native algorithms", Err(e)),
    }
}

/// One algorithm's matrix: every data type x op (for reductions) x size x placement, eager, and
/// the graph and large-size tiers, each check element by element against the host reference
/// (`run_collective_check`); `gib` adds a 1 GiB bf16 sum. Where `may_refuse`, a call refused as
/// an invalid argument or unsupported counts as refused by design (a packet algorithm's scratch
/// bounds its sizes), else as a failure. `case` numbers the checks of the run (each check's seed
/// follows from it).
fn algorithm_matrix(
    s: &Suite,
    comm: &std::sync::Arc<mscclpp::core::communicator::Communicator>,
    algo: &dyn mscclpp::core::algorithm::Algorithm,
    (gib, may_refuse): (bool, bool),
    case: &mut u64,
) -> Result<String> {
    use mscclpp::core::algorithm::Collective;
    use mscclpp_collectives::testing::run_collective_check;
    let reduces = algo.collective().reduces();
    let ops: &[ReduceOp] = if reduces {
        &ReduceOp::ALL
    } else {
        &[ReduceOp::Sum]
    };
    // (dtype, ops, sizes in bytes, graph) tiers.
    // 3072 bytes: whole 16-byte vectors per rank at 2, 3, 4, 6 and 8 ranks (the copy-engine
    // all-reduce's output staging, in a single piece).
    let small = [1usize, 3, 1023, 3072, 4096 + 8];
    let mut plan: Vec<(DataType, Vec<ReduceOp>, Vec<usize>, bool)> = Vec::new();
    for dtype in DataType::ALL {
        let es = dtype.size();
        plan.push((
            dtype,
            ops.to_vec(),
            small.iter().map(|b| b.div_ceil(es) * es).collect(),
            false,
        ));
        plan.push((dtype, vec![ReduceOp::Sum], vec![MIB - es], false));
    }
    for dtype in [DataType::Bf16, DataType::F32] {
        plan.push((
            dtype,
            vec![ReduceOp::Sum],
            vec![4096 + 8, MIB - dtype.size()],
            true,
        ));
        plan.push((
            dtype,
            vec![ReduceOp::Sum, ReduceOp::Max],
            vec![64 * MIB],
            false,
        ));
    }
    // 48 MiB: every rank's share whole 16-byte vectors at 2, 3, 4, 6 and 8 ranks, which the
    // copy-engine all-reduce needs to stage in the output (64 MiB is not, at 3 ranks).
    plan.push((DataType::I32, vec![ReduceOp::Sum], vec![48 * MIB], true));
    if gib {
        plan.push((DataType::Bf16, vec![ReduceOp::Sum], vec![1 << 30], false));
    }
    let (mut checks, mut failures, mut skipped) = (0usize, Vec::new(), 0usize);
    let t = Instant::now();
    for (dtype, ops, sizes, graph) in plan {
        for op in ops {
            for &bytes in &sizes {
                // The natural per-rank unit: allgather input, reduce-scatter output.
                let count = match algo.collective() {
                    Collective::AllGather | Collective::ReduceScatter => {
                        (bytes / dtype.size() / s.ctx.size()).max(1)
                    }
                    _ => bytes / dtype.size(),
                };
                for in_place in [false, true] {
                    *case += 1;
                    let seed = s.run_seed ^ case.wrapping_mul(0x2545_f491_4f6c_dd1d);
                    match run_collective_check(
                        comm, algo, dtype, op, count, in_place, seed, graph, None,
                    ) {
                        Ok(r) if r.wrong == 0 => checks += 1,
                        Ok(r) => failures.push(format!(
                            "{dtype} {op} count {count} in_place {in_place} graph {graph}: {} wrong, first {:?} (tol {})",
                            r.wrong, r.first_wrong, r.tolerance
                        )),
                        // Sizes beyond a packet algorithm's scratch are refused by design.
                        Err(Error::InvalidArgument(_)) | Err(Error::Unsupported(_))
                            if may_refuse =>
                        {
                            skipped += 1
                        }
                        Err(e) => failures.push(format!(
                            "{dtype} {op} count {count} in_place {in_place} graph {graph}: {e}"
                        )),
                    }
                    if failures.len() > 20 {
                        break;
                    }
                }
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    matrix_result(
        checks,
        &failures,
        format!("{checks} checks exact/within tolerance, {skipped} refused by design, {secs:.1} s"),
    )
}

/// Ranks on several hosts: the matrix of every algorithm of the multi-host collection
/// (`default_allreduce_hierarchical` for H hosts x k ranks, the flat `port_allreduce` up to 8
/// ranks, `default_allgather_via_allreduce`, `default_broadcast_via_allreduce`,
/// `default_reducescatter_via_allreduce`), the same matrix
/// as the single-host algorithms' ([`algorithm_matrix`], 1 GiB for the all-reduces). `--only
/// multi_host` runs them all, an algorithm's name its own.
///
/// The collection is built once on the suite's communicator (the algorithms it lists) and torn
/// down as its own check (teardown is collective: scratch and sub-communicator barriers). Each
/// algorithm's matrix then runs on a fresh communicator and collection, torn down with it: a
/// device timeout is sticky on its communicator, so on a shared one the first failure failed every
/// later algorithm's checks at once, and results stopped saying which algorithm failed.
fn multi_host_matrices(s: &mut Suite, only: Option<&[String]>) {
    use mscclpp::core::algorithm::Collective;
    let t = Instant::now();
    let coll = match mscclpp_collectives::default_algorithm_collection(
        &s.ctx.comm,
        mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
    ) {
        Ok(c) => c,
        Err(e) => {
            s.record("build the multi-host algorithms", Err(e));
            return;
        }
    };
    let algos: Vec<(Collective, String)> = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::Broadcast,
    ]
    .into_iter()
    .flat_map(|c| coll.names(c).into_iter().map(move |n| (c, n)))
    .collect();
    let names: Vec<&str> = algos.iter().map(|(_, n)| n.as_str()).collect();
    s.record(
        "build the multi-host algorithms",
        if names.is_empty() {
            Err(Error::Internal(format!(
                "no all-reduce for ranks on {}",
                s.ctx.comm.topology()
            )))
        } else {
            Ok(format!(
                "{} in {:.1} s",
                names.join(", "),
                t.elapsed().as_secs_f64()
            ))
        },
    );
    let r = tear_down(s, Some(coll), None).map(|secs| format!("{secs:.1} s, then a barrier"));
    let torn_down = r.is_ok();
    s.record("tear down the multi-host algorithms", r);
    if !torn_down {
        return;
    }
    let mut case = 0u64;
    // `--quick`: the build only, as for the single-host matrices.
    let quick = std::env::args().any(|a| a == "--quick");
    for (collective, name) in &algos {
        if quick || !(is_selected(only, MULTI_HOST) || is_selected(only, name)) {
            continue;
        }
        let result = fresh_matrix(s, *collective, name, &mut case);
        s.record(&format!("{MULTI_HOST} {name}"), result);
    }
}

/// One algorithm's matrix on a fresh communicator and multi-host collection (see
/// [`multi_host_matrices`]), both torn down after it; the teardown's time is in the result. Every
/// path ends in [`tear_down`]'s barrier on the suite's bootstrap, so ranks stay in step whatever
/// failed.
fn fresh_matrix(
    s: &Suite,
    collective: mscclpp::core::algorithm::Collective,
    name: &str,
    case: &mut u64,
) -> Result<String> {
    use mscclpp::core::algorithm::Collective;
    let comm = match s.ctx.fresh_communicator() {
        Ok(c) => c,
        Err(e) => {
            let _ = tear_down(s, None, None);
            return Err(e);
        }
    };
    let (result, coll) = match mscclpp_collectives::default_algorithm_collection(
        &comm,
        mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
    ) {
        Ok(coll) => {
            // Every size must run: these algorithms have no scratch bound. 1 GiB for the
            // all-reduces, as for the single-host large-message all-reduces.
            let gib = collective == Collective::AllReduce;
            let result = match coll.get(collective, name) {
                Some(algo) => algorithm_matrix(s, &comm, algo.as_ref(), (gib, false), case),
                None => Err(Error::Internal(format!(
                    "{name} is not in a fresh collection"
                ))),
            };
            (result, Some(coll))
        }
        Err(e) => (Err(e), None),
    };
    let teardown = tear_down(s, coll, Some(comm));
    match (result, teardown) {
        (Ok(text), Ok(secs)) => Ok(format!("{text}; torn down in {secs:.1} s")),
        (Err(e), _) => Err(e),
        (Ok(_), Err(e)) => Err(Error::Internal(format!(
            "every check passed, the teardown failed: {e}"
        ))),
    }
}

/// Drops `coll`, then `comm` (the last holder of a fresh communicator: its drop barriers over its
/// own bootstrap), then meets every rank on the suite's bootstrap, so a rank whose teardown hangs
/// is named here rather than in the next section. Seconds the drops took.
fn tear_down(
    s: &Suite,
    coll: Option<mscclpp::core::algorithm_collection::AlgorithmCollection>,
    comm: Option<std::sync::Arc<mscclpp::core::communicator::Communicator>>,
) -> Result<f64> {
    let t = Instant::now();
    drop(coll);
    drop(comm);
    let secs = t.elapsed().as_secs_f64();
    s.ctx.bootstrap.barrier()?;
    Ok(secs)
}

/// A second communicator in the same process (its own bootstrap from a UniqueId that rank 0
/// creates, its own semaphores, scratch and algorithms), used interleaved with the first: each
/// check on one communicator is followed by one on the other, so their device state must stay apart.
fn two_communicators(
    s: &mut Suite,
    coll1: &mscclpp::core::algorithm_collection::AlgorithmCollection,
) -> Result<String> {
    use mscclpp::core::algorithm::Collective;
    use mscclpp_collectives::testing::run_collective_check;
    let comm2 = s.ctx.fresh_communicator()?;
    let coll2 = mscclpp_collectives::default_algorithm_collection(
        &comm2,
        mscclpp_collectives::DEFAULT_SCRATCH_BYTES,
    )?;
    let comm1 = s.ctx.comm.clone();
    let mut checks = 0;
    for (case, count) in [1usize, 1023, 65_536, 1 << 22].into_iter().enumerate() {
        for name in [
            "default_allreduce_allpair_packet",
            "default_allreduce_rsag_zero_copy",
        ] {
            for (which, comm, coll) in [(1, &comm1, coll1), (2, &comm2, &coll2)] {
                let algo = coll
                    .get(Collective::AllReduce, name)
                    .ok_or_else(|| Error::Internal(format!("{name} missing")))?;
                let seed = s.run_seed ^ (0x7777 + case as u64 * 16 + which);
                match run_collective_check(
                    comm,
                    algo.as_ref(),
                    DataType::Bf16,
                    ReduceOp::Sum,
                    count,
                    false,
                    seed,
                    false,
                    None,
                ) {
                    Ok(r) if r.wrong == 0 => checks += 1,
                    Ok(r) => {
                        return Err(Error::Internal(format!(
                            "communicator {which}, {name}, {count} elements: {} wrong",
                            r.wrong
                        )))
                    }
                    // The packet algorithm refuses sizes beyond its scratch by design.
                    Err(Error::InvalidArgument(_)) => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(format!(
        "{checks} interleaved checks on two communicators, all exact"
    ))
}

/// CPU time of one `execute` (the eager host path): 1 KiB bf16 allreduce through the selector's
/// small-message algorithm, 200 calls timed on the host without waiting for the GPU.
fn host_path_cost(
    s: &mut Suite,
    coll: &mscclpp::core::algorithm_collection::AlgorithmCollection,
) -> Result<String> {
    use mscclpp::core::algorithm::{Collective, ExecuteArgs};
    use mscclpp::core::algorithm_collection::SelectionContext;
    let gpu = s.ctx.gpu.clone();
    let bytes = 1024;
    let buf = DeviceBuffer::new(&gpu, 2 * bytes, MemoryKind::Plain)?;
    let props = gpu.properties(s.ctx.device)?;
    let ctx = SelectionContext {
        collective: Collective::AllReduce,
        message_bytes: bytes,
        dtype: DataType::Bf16,
        world_size: s.ctx.size(),
        local_world_size: s.ctx.size(),
        symmetric_memory: false,
        capturing: false,
        arch: props.arch.clone(),
        nvls_allowed: false,
        // The call below uses two halves of one buffer.
        in_place: false,
        op: Some(ReduceOp::Sum),
    };
    let algo = coll.select(&ctx)?;
    let args = ExecuteArgs {
        input: buf.ptr(),
        output: buf.ptr() + bytes as u64,
        input_bytes: bytes,
        output_bytes: bytes,
        dtype: DataType::Bf16,
        op: ReduceOp::Sum,
        accum: Default::default(),
        root: 0,
        stream: s.stream,
        nblocks: None,
        nthreads: None,
    };
    for _ in 0..20 {
        algo.execute(&args)?;
    }
    s.sync_and_check()?;
    s.ctx.bootstrap.barrier()?;
    let c = host_path_measure(s, &gpu, &*algo, &args)?;
    let selected = per_call_cost(|| coll.select(&ctx)?.execute(&args))?;
    s.sync_and_check()?;
    let text = format!(
        "{:.2} µs of thread CPU time ({:.2} µs wall) per call ({}), {:.2} µs with the selector's \
         choice each call; an empty 11-parameter kernel: cuLaunchKernel {:.2} µs CPU ({:.2} wall), \
         cuLaunchKernelEx programmatic {:.2} ({:.2}), cuGraphLaunch of it captured {:.2} ({:.2}), \
         our cached-graph launch {:.2} ({:.2}) with unchanged parameters, {:.2} ({:.2}) with new \
         ones each call",
        c.ours.1,
        c.ours.0,
        algo.name(),
        selected.1,
        c.empty.1,
        c.empty.0,
        c.empty_programmatic.1,
        c.empty_programmatic.0,
        c.empty_graph.1,
        c.empty_graph.0,
        c.cached_same.1,
        c.cached_same.0,
        c.cached_changing.1,
        c.cached_changing.0,
    );
    s.measure(
        &format!("host CPU time of one eager execute ({})", algo.name()),
        text.clone(),
    );
    // Ranks sharing a GPU share its driver too (under MPS every launch goes through the server).
    if (c.ours.1 > HOST_PATH_TARGET_US || selected.1 > HOST_PATH_TARGET_US) && !s.ctx.shares_gpu {
        return Err(Error::Internal(format!(
            "target missed (<= {HOST_PATH_TARGET_US} µs of CPU per call): {text}"
        )));
    }
    Ok(text)
}

/// Issue target: the host path of one eager call costs at most this much CPU time.
const HOST_PATH_TARGET_US: f64 = 3.0;

/// Per-call (wall µs, thread CPU µs) of one eager execute and of the driver's own launch paths
/// under it; see `host_path_cost`.
struct HostPathCosts {
    ours: (f64, f64),
    /// An empty kernel with as many parameters (11 words), cuLaunchKernel.
    empty: (f64, f64),
    /// The same through cuLaunchKernelEx with the programmatic-launch attribute (what the native
    /// collectives use on sm_90+; harmless for a kernel that touches no memory).
    empty_programmatic: (f64, f64),
    /// The same kernel captured once into a CUDA graph, replayed by cuGraphLaunch.
    empty_graph: (f64, f64),
    /// Through `LaunchConfig::cached_graph` (what the native collectives use outside capture),
    /// with the same parameter values every call, and with a new value every call.
    cached_same: (f64, f64),
    cached_changing: (f64, f64),
}

fn host_path_measure(
    s: &mut Suite,
    gpu: &std::sync::Arc<dyn mscclpp::core::gpu::Gpu>,
    algo: &dyn mscclpp::core::algorithm::Algorithm,
    args: &mscclpp::core::algorithm::ExecuteArgs,
) -> Result<HostPathCosts> {
    let ours = per_call_cost(|| algo.execute(args))?;
    s.sync_and_check()?;
    let module = gpu.build_module(
        "gpu_suite_empty_launch",
        "extern \"C\" __global__ void empty11(unsigned long long a0, unsigned long long a1, \
         unsigned long long a2, unsigned long long a3, unsigned long long a4, \
         unsigned long long a5, unsigned long long a6, unsigned long long a7, \
         unsigned long long a8, unsigned long long a9, unsigned long long a10) {}",
    )?;
    let empty = gpu.get_function(module, "empty11")?;
    let mut words = [0u64; 11];
    let launch = |programmatic: bool, cached: bool, words: &mut [u64; 11]| {
        let mut ptrs = words
            .each_mut()
            .map(|w| (w as *mut u64).cast::<std::ffi::c_void>());
        let cfg = LaunchConfig::linear(1, 32)
            .with_programmatic(programmatic)
            .with_cached_graph(cached);
        // SAFETY: empty11 takes 11 u64 by value; `words` outlives the launch.
        unsafe { gpu.launch(empty, cfg, s.stream, &mut ptrs) }
    };
    let plain = per_call_cost(|| launch(false, false, &mut words))?;
    let programmatic = per_call_cost(|| launch(true, false, &mut words))?;
    let cached_same = per_call_cost(|| launch(false, true, &mut words))?;
    let cached_changing = per_call_cost(|| {
        words[0] += 1;
        launch(false, true, &mut words)
    })?;
    gpu.begin_capture(s.stream)?;
    let captured = launch(false, false, &mut words);
    let graph = gpu.end_capture(s.stream);
    captured?;
    let graph = graph?;
    let replayed = per_call_cost(|| gpu.launch_graph(graph, s.stream));
    s.sync_and_check()?;
    gpu.destroy_graph(graph)?;
    Ok(HostPathCosts {
        ours,
        empty: plain,
        empty_programmatic: programmatic,
        empty_graph: replayed?,
        cached_same,
        cached_changing,
    })
}
