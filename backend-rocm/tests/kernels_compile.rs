//! The HIP compile gate: every kernel unit compiles for gfx90a and gfx942, on a machine with no AMD
//! GPU. A broken HIP path fails here.
//!
//! - gfx90a goes through the backend's own hiprtc code path ([`Hiprtc::load`] and
//!   [`Hiprtc::compile`], exactly what `RocmGpu::build_module` calls) with whatever hiprtc is
//!   installed: Debian 12's ROCm 5.2 (hiprtc inside libamdhip64.so.5) in CI. ROCm 5.2 predates
//!   gfx942.
//! - gfx942 goes through clang (`MSCCLPP_HIP_CLANG`, default `clang-19`) the way hiprtc drives it:
//!   `-D__HIPCC_RTC__`, `-nogpuinc`, hiprtc's own runtime header (read from
//!   libhiprtc-builtins.so.5) as a forced include, and our in-memory headers as files
//!   (`mscclpp_rocm::clang`). The gate compiles the device code to gfx942 ISA (`-S`: every
//!   instruction selected, nothing linked), which is enough to find a broken unit and spares CI
//!   the link; [`runtime_units_link_into_code_objects_the_runtime_finds`] links a few units
//!   for both targets with ROCm 6.0's device libraries, as `mscclpp-aot --hip` links them all.
//!
//! Units: every unit of `mscclpp-kernels-cu` (primitives, switch channel, simple all-reduce per
//! type; optimised where the code differs by target, [`optimised_on_both`], and through gfx942's
//! front end for the other types), the native collectives, the PortChannel all-reduce, the plan
//! interpreter and the benchmark's data unit. Each (type, accumulator) pair of the reducing
//! collectives and of the PortChannel all-reduce is built for one op exactly as the runtime builds
//! it (`-O3`), rotating through the ops from pair to pair so each op is optimised for a fifth of
//! the pairs: on each target every pair but eight of the twelve fp8 ones, a different four fp8
//! pairs per target ([`GFX90A_FP8_PAIRS`], [`GFX942_FP8_PAIRS`]; the others' runtime units go
//! through gfx942's front end); the four other ops go in one program ([`every_op_source`]) through
//! clang's front end for gfx942 (`-fsyntax-only`: every template instantiated and type-checked; the
//! ops differ only in a template parameter, and the targets' own code, such as gfx942's fp8
//! conversions, is op-independent and optimised in the pair's runtime unit). Plan programs compiled
//! into the interpreter's unit (the executor's specialised units) come from the builder's plans
//! ([`specialised_plan_units`]). The plan interpreter is optimised for a spread of pairs
//! ([`INTERPRETER_PAIRS`]), one op each, rotating, and goes through gfx942's front end for the
//! others. Optimising every op was too slow for CI: optimising every op's software fp8 code took 66
//! to 129 s per fp8 pair of the all-reduce file alone on gfx90a (two busy shared cores), the 5 x 96
//! optimised units about 640 s of CPU on gfx942, and the every-op programs at `-O0` (instruction
//! selection for every op, on both targets until 2026-11-28) 3-9 s each where the front end takes
//! 0.5 s: three quarters of the gate's time. The interpreter's op only picks the `ReduceFn<Op>` it
//! applies to the pair's types, which the collectives build for every op. NVLS units are CUDA-only
//! (multicast) and not built for HIP.
//!
//! hiprtc compiles one program at a time per process, so the gfx90a test runs itself again as one
//! child process per core (`MSCCLPP_HIP_GATE_JOBS`), each compiling its share of the units.
//!
//! Without the toolchain the tests print why they skip, unless `MSCCLPP_REQUIRE_HIP=1` (CI, set
//! by scripts/hip-env.sh), which turns absence into a failure. Compiled units are remembered in
//! `MSCCLPP_HIP_GATE_CACHE` (a directory; unset: no cache) by a hash of source, headers, entry
//! points, compiler and whether only the front end ran, so an unchanged unit is not compiled
//! twice.

use mscclpp_collectives::port_allreduce;
use mscclpp_core::{DataType, ReduceOp};
use mscclpp_kernels_cu::collectives::{self as kc, CollectiveFile, ReduceSpec};
use mscclpp_kernels_cu::{bench_data, executor};
use mscclpp_kernels_cu::{KERNELS, PRIMITIVE_KERNELS, TARGET_DEPENDENT_KERNELS};
use mscclpp_rocm::clang::{inspect_code_object, ClangHip, Output};
use mscclpp_rocm::{aot, CompileRequest, Hiprtc};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// One translation unit and the entry points its code object must define.
struct Unit {
    name: String,
    source: String,
    entries: Vec<String>,
    /// Only through clang's front end, for gfx942: the [`every_op_source`] programs, the plan
    /// interpreter beyond [`INTERPRETER_PAIRS`] and the simple all-reduce beyond
    /// [`optimised_on_both`] and [`KERNELS_OPTIMISED_ON_GFX942`] (module docs).
    front_end_only: bool,
    /// Built for gfx90a through hiprtc too ([`on_gfx90a`]).
    gfx90a: bool,
}

/// The fp8 (type, accumulator) pairs gfx90a builds: one per fp8 type, every kind of accumulator
/// among them. gfx90a has no fp8 instructions: ROCm 5.2's hiprtc takes 30-40 s over each fp8
/// all-reduce unit's software conversions (~6 s for bf16), and the twelve fp8 pairs of every
/// reducing file were most of the gate's time; gfx942 optimises [`GFX942_FP8_PAIRS`].
const GFX90A_FP8_PAIRS: [(DataType, DataType); 4] = [
    (DataType::Fp8E4M3, DataType::F32),
    (DataType::Fp8E4M3Fnuz, DataType::Fp8E4M3Fnuz),
    (DataType::Fp8E5M2, DataType::F16),
    (DataType::Fp8E4M3B15, DataType::F32),
];

/// The (type, accumulator) pairs whose plan-interpreter unit is optimised, on both targets: a
/// float, a 16-bit float with a wider accumulator, an integer, and fp8 in both encodings (OCP, and
/// gfx942's own FNUZ). The interpreter's per-type code is the `ReduceFn` of the pair, which the
/// collectives' units optimise for every pair; the other pairs go through the front end (5.8 s an
/// optimised unit on gfx942, 140 s for the 24 pairs).
const INTERPRETER_PAIRS: [(DataType, DataType); 5] = [
    (DataType::F32, DataType::F32),
    (DataType::Bf16, DataType::F32),
    (DataType::I32, DataType::I32),
    (DataType::Fp8E4M3, DataType::F32),
    (DataType::Fp8E4M3Fnuz, DataType::Fp8E4M3Fnuz),
];

/// Whether a unit of `mscclpp-kernels-cu` (the channel primitives, and the simple all-reduce of
/// the GPU suite, one unit per type) is optimised for gfx90a and gfx942:
/// [`TARGET_DEPENDENT_KERNELS`] (OCP e4m3 in software on both). The simple all-reduce of the
/// other types instantiates the same templates with other arithmetic: gfx942's front end checks
/// it ([`KERNELS_OPTIMISED_ON_GFX942`] aside), and the collectives' units optimise that arithmetic
/// for every pair. Optimising all fourteen types on both targets took about 270 s of CI's CPU (the
/// fp8 ones 20-30 s each).
fn optimised_on_both(unit: &str) -> bool {
    TARGET_DEPENDENT_KERNELS.contains(&unit)
}

/// Optimised for gfx942 only: FNUZ fp8, which gfx942 converts with its own instructions.
const KERNELS_OPTIMISED_ON_GFX942: [&str; 1] = ["simple_allreduce_fp8_e4m3fnuz"];

/// The fp8 (type, accumulator) pairs gfx942 optimises: again one per fp8 type with every kind of
/// accumulator among them, the pairs gfx90a does not build (so 8 of the 12 are optimised on one
/// target or the other), FNUZ with a float accumulator among them (gfx942's own fp8 conversions).
/// The other fp8 pairs' runtime units go through gfx942's front end, as their other ops do
/// ([`every_op_source`]); every pair is optimised for sm_90 by the collectives' NVRTC test.
/// Optimising all twelve took 12-26 s of CPU per pair and file (the all-reduce's the most), about
/// 300 s of CI's CPU for the eight left out.
const GFX942_FP8_PAIRS: [(DataType, DataType); 4] = [
    (DataType::Fp8E4M3, DataType::F16),
    (DataType::Fp8E4M3Fnuz, DataType::F32),
    (DataType::Fp8E5M2, DataType::Fp8E5M2),
    (DataType::Fp8E4M3B15, DataType::Fp8E4M3B15),
];

/// Whether gfx90a builds the runtime units of the (type, accumulator) pair: every pair of the
/// other types, and [`GFX90A_FP8_PAIRS`].
fn on_gfx90a(dtype: DataType, acc: DataType) -> bool {
    !dtype.is_fp8() || GFX90A_FP8_PAIRS.contains(&(dtype, acc))
}

/// Whether gfx942 optimises the runtime units of the pair (the front end checks the others):
/// every pair of the other types, and [`GFX942_FP8_PAIRS`].
fn optimised_on_gfx942(dtype: DataType, acc: DataType) -> bool {
    !dtype.is_fp8() || GFX942_FP8_PAIRS.contains(&(dtype, acc))
}

fn required() -> bool {
    std::env::var("MSCCLPP_REQUIRE_HIP").is_ok_and(|v| v == "1")
}

/// Skips (prints why) or, when the toolchain is required, fails.
fn unavailable(test: &str, why: &str) {
    assert!(
        !required(),
        "{test}: MSCCLPP_REQUIRE_HIP=1 but {why} (run: source scripts/hip-env.sh)"
    );
    eprintln!("skipping {test}: {why}");
}

/// Namespace and entry-point suffix of `op`'s copy in an [`every_op_source`] program.
fn op_copy(op: ReduceOp) -> String {
    format!("mscclpp_gate_{}", op.name())
}

/// Several ops of one reducing unit in one program, so the per-program cost is paid once: the
/// unit for `ops[0]` exactly as the runtime builds it (`shipped`), then the kernel file
/// (`kernel_text`, the tail of `shipped`) again for each other op, with `MSCCLPP_COLL_OP`
/// redefined, inside a namespace of its own whose `kCollOp` hides `coll::kCollOp` (the file's
/// `using namespace` makes those visible as if declared at global scope, so the nearer one wins),
/// and the entry points renamed `<entry>_<namespace>` by `#define`, so the kernel text is compiled
/// unchanged. Headers are `#pragma once`: a copy's `#include`s add nothing.
fn every_op_source(shipped: &str, kernel_text: &str, entries: &[&str], ops: &[ReduceOp]) -> String {
    let mut text = shipped.to_string();
    for &op in &ops[1..] {
        let ns = op_copy(op);
        text.push_str(&format!(
            "\n#undef MSCCLPP_COLL_OP\n#define MSCCLPP_COLL_OP {}\n",
            op.to_nccl()
        ));
        for e in entries {
            text.push_str(&format!("#define {e} {e}_{ns}\n"));
        }
        text.push_str(&format!(
            "namespace {ns} {{\nconstexpr int kCollOp = MSCCLPP_COLL_OP;\n{kernel_text}\n}}  // namespace {ns}\n"
        ));
        for e in entries {
            text.push_str(&format!("#undef {e}\n"));
        }
    }
    text
}

/// The units of one reducing kernel file: for every (type, accumulator) pair, the runtime's unit
/// for one op (rotating from pair to pair) and one program holding the four other ops. `name`
/// and `source` give the runtime's unit for one variant.
fn reducing_units(
    kernel_text: &str,
    entries: &[&str],
    name: impl Fn(ReduceSpec) -> String,
    source: impl Fn(ReduceSpec) -> String,
) -> Vec<Unit> {
    let runtime_unit = |spec: ReduceSpec| Unit {
        name: name(spec),
        source: source(spec),
        entries: entries.iter().map(|e| e.to_string()).collect(),
        front_end_only: !optimised_on_gfx942(spec.dtype, spec.acc),
        gfx90a: on_gfx90a(spec.dtype, spec.acc),
    };
    let mut units = Vec::new();
    for (i, (dtype, acc)) in kc::reduce_type_pairs().into_iter().enumerate() {
        let spec = |op| ReduceSpec { dtype, acc, op };
        let n = ReduceOp::ALL.len();
        let rest: Vec<ReduceOp> = (1..n).map(|k| ReduceOp::ALL[(i + k) % n]).collect();
        units.push(runtime_unit(spec(ReduceOp::ALL[i % n])));
        let mut all = entries.iter().map(|e| e.to_string()).collect::<Vec<_>>();
        for &op in &rest[1..] {
            all.extend(entries.iter().map(|e| format!("{e}_{}", op_copy(op))));
        }
        units.push(Unit {
            name: format!("{}_and_{}_more_ops", name(spec(rest[0])), rest.len() - 1),
            source: every_op_source(&source(spec(rest[0])), kernel_text, entries, &rest),
            entries: all,
            front_end_only: true,
            gfx90a: false,
        });
    }
    units
}

fn every_unit() -> Vec<Unit> {
    let mut units = Vec::new();
    for k in KERNELS {
        let entries = match k.name {
            "primitives" => PRIMITIVE_KERNELS.iter().map(|s| s.to_string()).collect(),
            _ => Vec::new(),
        };
        let gfx90a = optimised_on_both(k.name);
        units.push(Unit {
            name: k.name.to_string(),
            source: k.source.to_string(),
            entries,
            front_end_only: !gfx90a && !KERNELS_OPTIMISED_ON_GFX942.contains(&k.name),
            gfx90a,
        });
    }
    for file in CollectiveFile::ALL {
        let entries: Vec<&str> = file
            .entry_points()
            .iter()
            .copied()
            .filter(|e| !kc::CUDA_ONLY_ENTRY_POINTS.contains(e))
            .collect();
        if file.reduces() {
            units.extend(reducing_units(
                file.source(),
                &entries,
                |spec| kc::unit_name(file, Some(spec)),
                |spec| kc::unit_source(file, Some(spec)).expect("reducing unit"),
            ));
        } else {
            units.push(Unit {
                name: kc::unit_name(file, None),
                source: kc::unit_source(file, None).expect("byte-oriented unit"),
                entries: entries.iter().map(|s| s.to_string()).collect(),
                front_end_only: false,
                gfx90a: true,
            });
        }
    }
    units.extend(reducing_units(
        port_allreduce::KERNEL_SOURCE,
        &[port_allreduce::EXCHANGE_ENTRY, port_allreduce::REDUCE_ENTRY],
        port_allreduce::unit_name,
        port_allreduce::unit_source,
    ));
    // The plan interpreter: every pair, one op each, rotating (see the module docs); optimised for
    // INTERPRETER_PAIRS.
    for (i, (dtype, acc)) in kc::reduce_type_pairs().into_iter().enumerate() {
        let optimised = INTERPRETER_PAIRS.contains(&(dtype, acc));
        let op = ReduceOp::ALL[i % ReduceOp::ALL.len()];
        let accum = kc::acc_request(dtype, acc).expect("an offered pair");
        let (name, source) = executor::unit_source(dtype, accum, op, executor::PlanFeatures::ALL)
            .expect("executor unit");
        units.push(Unit {
            name,
            source,
            entries: vec![executor::ENTRY.to_string()],
            front_end_only: !optimised,
            gfx90a: optimised,
        });
    }
    units.extend(specialised_plan_units());
    // The benchmark's device inputs and checks, with the layout asserts of its argument struct.
    units.push(Unit {
        name: bench_data::UNIT_NAME.to_string(),
        source: format!("{}{}", bench_data::SOURCE, bench_data::layout_asserts()),
        entries: vec![bench_data::ENTRY.to_string()],
        front_end_only: false,
        gfx90a: true,
    });
    units
}

/// Plan programs compiled into the interpreter's unit (`specialised_unit_source`, what the
/// executor runs for programs of few data ops), from the builder's 2-rank plans: a pipeline over
/// memory channels and Simple data ops run fused (`run_fused`) optimised for gfx942, LL packets
/// optimised for both targets, and port channels (Simple and LL) through gfx942's front end.
fn specialised_plan_units() -> Vec<Unit> {
    use mscclpp_executor::{builder, encode::encode, Plan, PlanReduceOp, Protocol};
    let plans = [
        (
            builder::pipelined_allreduce(2, PlanReduceOp::Sum, 4096),
            false,
            false,
        ),
        (
            builder::allreduce(2, Protocol::Simple, PlanReduceOp::Sum),
            false,
            false,
        ),
        (
            builder::allreduce(2, Protocol::Ll, PlanReduceOp::Sum),
            false,
            true,
        ),
        (
            builder::port_allreduce(2, Protocol::Simple, PlanReduceOp::Sum),
            true,
            false,
        ),
        (
            builder::port_allreduce(2, Protocol::Ll, PlanReduceOp::Sum),
            true,
            false,
        ),
    ];
    plans
        .into_iter()
        .map(|(json, front_end_only, gfx90a)| {
            let plan = Plan::from_json(json.to_string().as_bytes()).expect("a builder plan");
            let enc = encode(&plan, 0, false).expect("encodes");
            let (name, source) = executor::specialised_unit_source(
                DataType::Bf16,
                mscclpp_core::AccumType::Auto,
                ReduceOp::Sum,
                enc.features(),
                &enc.static_program(),
            )
            .expect("a specialised unit");
            Unit {
                name,
                source,
                entries: vec![executor::ENTRY.to_string()],
                front_end_only,
                gfx90a,
            }
        })
        .collect()
}

/// The on-disk cache of units already compiled by an identical compiler.
struct Cache(Option<PathBuf>);

impl Cache {
    fn from_env() -> Cache {
        Cache(std::env::var_os("MSCCLPP_HIP_GATE_CACHE").map(PathBuf::from))
    }
    fn key(compiler: &str, arch: &str, unit: &Unit, headers: &[(&str, &str)]) -> String {
        let mut h = Sha256::new();
        for part in [compiler, arch, &unit.name, &unit.source] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        for (n, t) in headers {
            h.update(n.as_bytes());
            h.update(t.as_bytes());
        }
        for e in &unit.entries {
            h.update(e.as_bytes());
            h.update([0]);
        }
        // A front-end pass proves less than a build: never taken for one.
        h.update([u8::from(unit.front_end_only)]);
        hex::encode(h.finalize())
    }
    fn hit(&self, key: &str) -> bool {
        self.0.as_ref().is_some_and(|d| d.join(key).exists())
    }
    fn record(&self, key: &str) {
        if let Some(d) = &self.0 {
            let _ = std::fs::create_dir_all(d);
            let _ = std::fs::write(d.join(key), b"ok");
        }
    }
}

/// Compiles every unit with `compile` on `workers` threads; returns the failures.
fn compile_all(
    units: &[Unit],
    workers: usize,
    compile: &(dyn Fn(&Unit) -> Result<(), String> + Sync),
) -> Vec<String> {
    let next = Mutex::new(0usize);
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..workers.max(1) {
            s.spawn(|| loop {
                let i = {
                    let mut n = next.lock().unwrap();
                    *n += 1;
                    *n - 1
                };
                let Some(unit) = units.get(i) else { break };
                if let Err(e) = compile(unit) {
                    failures.lock().unwrap().push(format!("{}: {e}", unit.name));
                }
            });
        }
    });
    failures.into_inner().unwrap()
}

/// Set in the child processes of the gfx90a gate to `i/n`: compile every n-th unit from the i-th.
const GFX90A_SHARD_ENV: &str = "MSCCLPP_HIP_GATE_GFX90A_SHARD";

/// This process's part of the gfx90a units (`GFX90A_SHARD_ENV`), if it is a child of the gate.
fn gfx90a_shard() -> Option<(usize, usize)> {
    let v = std::env::var(GFX90A_SHARD_ENV).ok()?;
    let (i, n) = v.split_once('/')?;
    let (i, n) = (i.parse().ok()?, n.parse().ok()?);
    (i < n).then_some((i, n))
}

/// hiprtc compiles one program at a time per process (`Hiprtc`'s lock: ROCm 5.2's crashes
/// otherwise), which left one of CI's cores idle for most of the gfx90a gate. So the gate runs
/// itself again as `shards` child processes of this test binary, each compiling every
/// `shards`-th unit, and fails if any of them does (their output, failures included, is
/// inherited).
fn compile_gfx90a_in_processes(test: &str, shards: usize) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let children: Vec<_> = (0..shards)
        .map(|i| {
            Command::new(&exe)
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(GFX90A_SHARD_ENV, format!("{i}/{shards}"))
                .spawn()
                .unwrap_or_else(|e| panic!("{test}: starting shard {i} of {shards}: {e}"))
        })
        .collect();
    let failed: Vec<usize> = children
        .into_iter()
        .enumerate()
        .filter_map(|(i, mut c)| (!c.wait().is_ok_and(|s| s.success())).then_some(i))
        .collect();
    assert!(
        failed.is_empty(),
        "{test}: shards {failed:?} of {shards} failed (their output is above)"
    );
}

/// Compiles at once: `MSCCLPP_HIP_GATE_JOBS`, else one per core.
fn workers() -> usize {
    std::env::var("MSCCLPP_HIP_GATE_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
}

fn missing_entries(unit: &Unit, has: impl Fn(&str) -> bool) -> Result<(), String> {
    let missing: Vec<&String> = unit.entries.iter().filter(|e| !has(e)).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "entry points missing from the code object: {missing:?}"
        ))
    }
}

#[test]
fn every_kernel_unit_compiles_for_gfx90a_through_hiprtc() {
    let test = "every_kernel_unit_compiles_for_gfx90a_through_hiprtc";
    let hiprtc = match Hiprtc::load() {
        Ok(h) => h,
        Err(e) => return unavailable(test, &e.to_string()),
    };
    let compiler = format!("hiprtc {:?} at {}", hiprtc.version(), hiprtc.location());
    let (shard, shards) = match gfx90a_shard() {
        Some(s) => s,
        None if workers() > 1 => return compile_gfx90a_in_processes(test, workers()),
        None => (0, 1),
    };
    eprintln!("{test}: {compiler}, shard {shard} of {shards}");
    let headers = mscclpp_kernels_hip::all_headers();
    let units: Vec<Unit> = every_unit()
        .into_iter()
        .filter(|u| u.gfx90a)
        .enumerate()
        .filter(|(i, _)| i % shards == shard)
        .map(|(_, u)| u)
        .collect();
    let cache = Cache::from_env();
    // One worker: hiprtc compiles one program at a time in a process anyway (`Hiprtc`).
    let failures = compile_all(&units, 1, &|unit| {
        let key = Cache::key(&compiler, "gfx90a", unit, &headers);
        if cache.hit(&key) {
            return Ok(());
        }
        let out = hiprtc
            .compile(&CompileRequest {
                name: &unit.name,
                source: &unit.source,
                arch: "gfx90a",
                headers: &headers,
                options: &[],
            })
            .map_err(|e| e.to_string())?;
        if out.image.is_empty() {
            return Err("empty code object".into());
        }
        missing_entries(unit, |e| {
            let sym = format!("{e}\0");
            out.image.windows(sym.len()).any(|w| w == sym.as_bytes())
        })?;
        cache.record(&key);
        Ok(())
    });
    assert!(
        failures.is_empty(),
        "{} of {} units failed for gfx90a:\n{}",
        failures.len(),
        units.len(),
        failures.join("\n\n")
    );
    eprintln!("{test}: {} units", units.len());
}

/// The gfx942 gate's compile of `unit`: its assembly, with its entry points checked, or the
/// front end alone.
fn compile_for_gfx942(clang: &ClangHip, unit: &Unit) -> Result<(), String> {
    let output = if unit.front_end_only {
        Output::SyntaxOnly
    } else {
        Output::Assembly
    };
    let asm = clang.compile(&unit.name, &unit.source, "gfx942", output)?;
    if unit.front_end_only {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&asm);
    missing_entries(unit, |e| text.contains(&format!(".amdhsa_kernel {e}\n")))
}

#[test]
fn every_kernel_unit_compiles_for_gfx942_through_clang() {
    let test = "every_kernel_unit_compiles_for_gfx942_through_clang";
    let headers = mscclpp_kernels_hip::all_headers();
    let clang = match ClangHip::new(&headers) {
        Ok(c) => c,
        Err(e) => return unavailable(test, &e),
    };
    eprintln!("{test}: {}", clang.version_line());
    let units = every_unit();
    let cache = Cache::from_env();
    let failures = compile_all(&units, workers(), &|unit| {
        let key = Cache::key(clang.version_line(), "gfx942", unit, &headers);
        if cache.hit(&key) {
            return Ok(());
        }
        compile_for_gfx942(&clang, unit)?;
        cache.record(&key);
        Ok(())
    });
    assert!(
        failures.is_empty(),
        "{} of {} units failed for gfx942:\n{}",
        failures.len(),
        units.len(),
        failures.join("\n\n")
    );
    eprintln!("{test}: {} units", units.len());
}

/// The gate has teeth: a unit that does not compile for HIP is reported with the compiler's log.
/// The fp8 pair lists name pairs the collectives offer, one per fp8 type each, and no pair twice.
#[test]
fn the_fp8_pair_lists_name_offered_pairs() {
    let offered = kc::reduce_type_pairs();
    for list in [GFX90A_FP8_PAIRS, GFX942_FP8_PAIRS] {
        for pair in list {
            assert!(offered.contains(&pair), "{pair:?} is not an offered pair");
        }
        let mut types: Vec<DataType> = list.iter().map(|p| p.0).collect();
        types.dedup();
        assert_eq!(types.len(), 4, "one pair per fp8 type: {list:?}");
    }
    assert!(GFX90A_FP8_PAIRS
        .iter()
        .all(|p| !GFX942_FP8_PAIRS.contains(p)));
}

#[test]
fn a_broken_unit_fails_the_hiprtc_gate() {
    let Ok(hiprtc) = Hiprtc::load() else {
        return unavailable("a_broken_unit_fails_the_hiprtc_gate", "hiprtc is absent");
    };
    let headers = mscclpp_kernels_hip::all_headers();
    let err = hiprtc
        .compile(&CompileRequest {
            name: "broken",
            source: "#include \"mscclpp/common.cuh\"\nextern \"C\" __global__ void k() { undeclared(); }\n",
            arch: "gfx90a",
            headers: &headers,
            options: &[],
        })
        .expect_err("a call to an undeclared function compiled");
    let msg = err.to_string();
    assert!(
        msg.contains("broken for gfx90a") && msg.contains("undeclared"),
        "{msg}"
    );
}

/// An every-op program builds each copy with its own op: kernel text broken for min on HIP only
/// fails the program whose min copy sits in a namespace (not first), and the same text without a
/// min copy passes.
#[test]
fn an_op_broken_on_hip_fails_its_every_op_program() {
    let test = "an_op_broken_on_hip_fails_its_every_op_program";
    let headers = mscclpp_kernels_hip::all_headers();
    let clang = match ClangHip::new(&headers) {
        Ok(c) => c,
        Err(e) => return unavailable(test, &e),
    };
    let file = CollectiveFile::Reduce;
    let brk = "\n#if defined(MSCCLPP_HIP)\nstatic_assert(kCollOp != kReduceMin, \"min is broken on HIP\");\n#endif\n";
    let kernel_text = format!("{}{brk}", file.source());
    let spec = ReduceSpec {
        dtype: mscclpp_core::DataType::F32,
        acc: mscclpp_core::DataType::F32,
        op: ReduceOp::Sum,
    };
    let shipped = format!("{}{brk}", kc::unit_source(file, Some(spec)).expect("unit"));
    let compile = |ops: &[ReduceOp]| {
        compile_for_gfx942(
            &clang,
            &Unit {
                name: "reduce_every_op".into(),
                source: every_op_source(&shipped, &kernel_text, file.entry_points(), ops),
                entries: Vec::new(),
                front_end_only: true,
                gfx90a: false,
            },
        )
    };
    compile(&[ReduceOp::Sum, ReduceOp::Max]).expect("sum and max are not broken");
    let err = compile(&[ReduceOp::Sum, ReduceOp::Min]).expect_err("the min copy compiled");
    assert!(err.contains("min is broken on HIP"), "{err}");
}

/// What `mscclpp-aot --hip` embeds, end to end on a few runtime units: clang links each into a
/// code object for gfx90a and gfx942 with ROCm's device libraries; the ELF header names the
/// target and the symbol table every entry point; a blob of them serves the runtime's own
/// request (`aot::find`, the key `RocmGpu::build_module` asks with) byte for byte.
#[test]
fn runtime_units_link_into_code_objects_the_runtime_finds() {
    use mscclpp_core::kernel_image::testing::compress_fast;
    use mscclpp_core::kernel_image::{encode, Blob, FrameImages};
    let test = "runtime_units_link_into_code_objects_the_runtime_finds";
    let headers = mscclpp_kernels_hip::all_headers();
    if std::env::var_os("MSCCLPP_HIP_DEVICE_LIBS").is_none() {
        return unavailable(test, "MSCCLPP_HIP_DEVICE_LIBS is not set");
    }
    let clang = match ClangHip::new(&headers) {
        Ok(c) => c,
        Err(e) => return unavailable(test, &e),
    };
    let spec = ReduceSpec {
        dtype: DataType::Bf16,
        acc: DataType::F32,
        op: ReduceOp::Sum,
    };
    let entries = |file: CollectiveFile| -> Vec<String> {
        let mut e: Vec<String> = file
            .entry_points()
            .iter()
            .filter(|e| !kc::CUDA_ONLY_ENTRY_POINTS.contains(e))
            .map(|e| e.to_string())
            .collect();
        e.sort();
        e
    };
    let (plan_name, plan_source) = executor::unit_source(
        DataType::Bf16,
        mscclpp_core::AccumType::Auto,
        ReduceOp::Sum,
        executor::PlanFeatures::ALL,
    )
    .expect("executor unit");
    let units = [
        (
            kc::unit_name(CollectiveFile::AllReduce, Some(spec)),
            kc::unit_source(CollectiveFile::AllReduce, Some(spec)).expect("unit"),
            entries(CollectiveFile::AllReduce),
        ),
        (
            kc::unit_name(CollectiveFile::AllGather, None),
            kc::unit_source(CollectiveFile::AllGather, None).expect("unit"),
            entries(CollectiveFile::AllGather),
        ),
        (plan_name, plan_source, vec![executor::ENTRY.to_string()]),
    ];
    let archs = ["gfx90a", "gfx942"];
    fn request<'a>(
        unit: &'a (String, String, Vec<String>),
        arch: &'a str,
        headers: &'a [(&'a str, &'a str)],
    ) -> CompileRequest<'a> {
        CompileRequest {
            name: &unit.0,
            source: &unit.1,
            arch,
            headers,
            options: &[],
        }
    }
    let mut frames = Vec::new();
    for arch in archs {
        let mut frame = FrameImages::default();
        for unit in &units {
            let image = clang
                .compile(&unit.0, &unit.1, arch, Output::CodeObject)
                .unwrap_or_else(|e| panic!("{} for {arch}: {e}", unit.0));
            let info = inspect_code_object(&image).expect("a code object");
            assert_eq!(info.arch, arch, "{}", unit.0);
            for e in &unit.2 {
                assert!(
                    info.kernels.contains(e),
                    "{} for {arch} lacks {e}: {info:?}",
                    unit.0
                );
            }
            frame
                .images
                .push((aot::embedded_key(&request(unit, arch, &headers)), image));
        }
        frames.push(frame);
    }
    let archs: Vec<String> = archs.iter().map(|a| a.to_string()).collect();
    let bytes = encode(clang.version(), &archs, &frames, compress_fast).expect("encode");
    let blob = Blob::parse(&bytes).expect("parse");
    for (arch, frame) in archs.iter().zip(&frames) {
        for (unit, (_, image)) in units.iter().zip(&frame.images) {
            let found = aot::find(&blob, &request(unit, arch, &headers)).expect("found");
            assert_eq!(found, &image[..], "{} for {arch}", unit.0);
        }
    }
    eprintln!(
        "{test}: {} code objects by {}, {} bytes in the blob",
        units.len() * archs.len(),
        clang.version_line(),
        bytes.len()
    );
}

/// hiprtc's output goes through the disk cache (`RocmGpu::build_module`'s path for what the build
/// does not embed): the first request compiles and stores, the second loads the same image, and a
/// damaged entry is compiled again, never loaded.
#[test]
fn hiprtc_output_is_cached_on_disk() {
    use mscclpp_core::kernel_cache::CacheOutcome;
    let test = "hiprtc_output_is_cached_on_disk";
    let hiprtc = match Hiprtc::load() {
        Ok(h) => h,
        Err(e) => return unavailable(test, &e.to_string()),
    };
    let dir = std::env::temp_dir().join(format!("mscclpp-hip-cache-{}", std::process::id()));
    let cache = mscclpp_rocm::KernelCache::new(&dir, hiprtc).expect("cache");
    let headers = mscclpp_kernels_hip::all_headers();
    let req = CompileRequest {
        name: "cached",
        source: "#include \"mscclpp/common.cuh\"\nextern \"C\" __global__ void cached(int* p) { p[threadIdx.x] = 1; }\n",
        arch: "gfx90a",
        headers: &headers,
        options: &[],
    };
    let first = cache.get_or_compile(&req).expect("compiled");
    assert_eq!(first.outcome, CacheOutcome::Compiled);
    let info = inspect_code_object(&first.kernel.image).expect("a code object");
    assert_eq!(info.arch, "gfx90a");
    assert_eq!(info.kernels, ["cached"]);
    let second = cache.get_or_compile(&req).expect("loaded");
    assert_eq!(second.outcome, CacheOutcome::Hit);
    assert_eq!(second.kernel, first.kernel);
    let entry = cache.entry_path(&req);
    let mut bytes = std::fs::read(&entry).expect("the entry");
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&entry, bytes).expect("damaged");
    let third = cache.get_or_compile(&req).expect("rebuilt");
    assert_eq!(third.outcome, CacheOutcome::Rebuilt);
    assert_eq!(third.kernel.image, first.kernel.image);
    let _ = std::fs::remove_dir_all(&dir);
}
