//! GPU checks of the execution-plan interpreter (suite section `plans`): every non-NVLS fixture
//! plan written for this world size, and the builder's all-reduce plans (Simple and LL, every
//! reduce op; the Simple plan with phase 1 in a `pipeline`; at 2 ranks also the Simple and LL
//! plans over port channels, whose data the host proxy moves) at this world size, run through `PlanAlgorithm` on fresh random inputs.
//!
//! Sizes span each plan's message range: 1, 3 and 257 elements per chunk (odd sizes) and the
//! largest chunk the plan takes (capped at [`MAX_CHECK_BYTES`] of input per rank); for the first
//! type also up to `LARGE_CHECK_BYTES`, where the interpreter runs the most replicas. Each size
//! runs eagerly and as a captured CUDA graph replayed twice, with fresh inputs before every replay.
//! Outputs are poisoned first; every element is checked: integers and moved (not reduced) values
//! exactly, reduced floats against the float64 reduction within the CPU reference's tolerance
//! (`mscclpp_executor::reference::tolerance`: one rounding of the type per rank, plus one).
//!
//! Plans come from `MSCCLPP_PLAN_FIXTURES`, else `plans/` beside the suite's `bin/` (where
//! `scripts/gpu-stage.sh` copies ../shared/fixtures/plans to: `.gpu/plans`).

use crate::{seed, RankContext};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::gpu::{MemoryKind, Stream};
use mscclpp_core::{fp8, AccumType, DataType, Error, ReduceOp, Result};
use mscclpp_executor::algorithm::PlanAlgorithm;
use mscclpp_executor::builder;
use mscclpp_executor::reference::{plan_reduce_op, random_input, reduced, tolerance, within};
use mscclpp_executor::{Plan, PlanReduceOp, Protocol};
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::path::PathBuf;
use std::sync::Arc;

/// `--only` name of the section.
pub const SECTION: &str = "plans";

/// Largest input per rank a check of every type uses (ranks may share one GPU).
pub const MAX_CHECK_BYTES: u64 = 2 << 20;

/// Largest input per rank the check of a plan's first type uses: where the fixtures' threadblocks
/// get the most replicas the GPU holds (replicas that meet take 32 KiB of a chunk each, up to 64
/// of them: 2 MiB chunks for a plan of one threadblock, 512 KiB for one of eight). Only 2 MiB
/// were checked until replicas that meet were found to outnumber what an MPS client's SMs held,
/// at 4 MiB (2026-11-29).
const LARGE_CHECK_BYTES: u64 = 16 << 20;

/// Elements per chunk tried below the plan's largest (odd ones included).
const CHUNK_ELEMS: [usize; 3] = [1, 3, 257];

/// Graph replays per size (fresh inputs before each).
const REPLAYS: usize = 2;

/// Where the fixture plans are on the GPU machine.
fn fixture_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("MSCCLPP_PLAN_FIXTURES") {
        return Some(PathBuf::from(dir));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?.join("plans");
    dir.is_dir().then_some(dir)
}

/// The plans to check at this world size, by label; fixtures of other world sizes and NVLS
/// fixtures are left out (NVLS is never enabled here), with a note.
fn plans(ctx: &RankContext) -> Vec<(String, Result<Arc<Plan>>)> {
    let n = ctx.size();
    let mut out = Vec::new();
    match fixture_dir() {
        Some(dir) => {
            let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
                .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
                .unwrap_or_default();
            files.retain(|p| p.extension().is_some_and(|e| e == "json"));
            files.sort();
            for f in files {
                let label = f
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                match Plan::load(&f) {
                    Ok(p) if p.needs_switch() => note(
                        ctx,
                        &format!("{label}: left out (switch channels need NVLS)"),
                    ),
                    Ok(p) if p.world_size() != n => note(
                        ctx,
                        &format!("{label}: left out ({} ranks)", p.world_size()),
                    ),
                    Ok(p) => out.push((label, Ok(Arc::new(p)))),
                    Err(e) => out.push((label, Err(Error::InvalidArgument(e.to_string())))),
                }
            }
        }
        None => note(
            ctx,
            "no fixture plans (set MSCCLPP_PLAN_FIXTURES or stage .gpu/plans)",
        ),
    }
    if n >= 2 {
        for protocol in [Protocol::Simple, Protocol::Ll] {
            for op in [
                PlanReduceOp::Sum,
                PlanReduceOp::Max,
                PlanReduceOp::Min,
                PlanReduceOp::Prod,
            ] {
                let json = builder::allreduce(n, protocol, op).to_string();
                let label = format!("builder allreduce {n} ranks {protocol:?} {op:?}");
                let plan = Plan::from_json(json.as_bytes())
                    .map(Arc::new)
                    .map_err(|e| Error::InvalidArgument(e.to_string()));
                out.push((label, plan));
            }
        }
        // A pipeline: windows of 3000 bytes (not a multiple of every chunk, so last windows are
        // partial; a 1 MiB chunk takes 350 iterations).
        let json = builder::pipelined_allreduce(n, PlanReduceOp::Sum, 3000).to_string();
        let plan = Plan::from_json(json.as_bytes())
            .map(Arc::new)
            .map_err(|e| Error::InvalidArgument(e.to_string()));
        out.push((
            format!("builder pipelined allreduce {n} ranks Simple Sum"),
            plan,
        ));
        // Port channels (host proxy): at 2 ranks only. With ranks sharing one GPU the proxy's
        // copies queue behind the spinning kernels (port_allreduce's experience: flushes time out
        // at 8 ranks under MPS); 2 ranks is where that was seen to pass.
        if n == 2 {
            for (protocol, op) in [
                (Protocol::Simple, PlanReduceOp::Sum),
                (Protocol::Simple, PlanReduceOp::Max),
                (Protocol::Ll, PlanReduceOp::Sum),
            ] {
                let json = builder::port_allreduce(n, protocol, op).to_string();
                let label = format!("builder port allreduce {n} ranks {protocol:?} {op:?}");
                let plan = Plan::from_json(json.as_bytes())
                    .map(Arc::new)
                    .map_err(|e| Error::InvalidArgument(e.to_string()));
                out.push((label, plan));
            }
        } else {
            note(ctx, "builder port allreduce: run at 2 ranks only");
        }
    }
    out
}

fn note(ctx: &RankContext, what: &str) {
    if ctx.rank() == 0 {
        println!("plans: {what}");
    }
}

/// The checks of the section, by name.
pub fn run(ctx: &RankContext) -> Vec<(String, Result<String>)> {
    let run_seed = match ctx.shared_seed() {
        Ok(s) => s,
        Err(e) => return vec![("plans run seed".into(), Err(e))],
    };
    let stream = match ctx.gpu.create_stream() {
        Ok(s) => s,
        Err(e) => return vec![("plans stream".into(), Err(e))],
    };
    let mut out = Vec::new();
    for (case, (label, plan)) in plans(ctx).into_iter().enumerate() {
        let result = plan.and_then(|plan| {
            let seed = seed(run_seed, case as u64, 0);
            check_plan(ctx, &plan, &label, seed, stream)
        });
        out.push((format!("plan {label}"), result));
    }
    let _ = ctx.gpu.destroy_stream(stream);
    out
}

/// The element types a plan is checked with (reducing plans: every kind of type, fp8 with a wider
/// accumulator; the builder's plans a spread; data-moving plans: a float and bytes).
fn types(plan: &Plan, label: &str) -> Vec<(DataType, AccumType)> {
    use DataType::*;
    let ll8 = plan.protocol == Protocol::Ll8;
    let mut t = if plan.collective != mscclpp_executor::Collective::Allreduce {
        vec![(F32, AccumType::Auto), (U8, AccumType::Auto)]
    } else if label.starts_with("builder") {
        vec![
            (F32, AccumType::Auto),
            (I32, AccumType::Auto),
            (Bf16, AccumType::F32),
        ]
    } else {
        vec![
            (F32, AccumType::Auto),
            (F16, AccumType::Auto),
            (Bf16, AccumType::F32),
            (F64, AccumType::Auto),
            (I32, AccumType::Auto),
            (U8, AccumType::Auto),
            (I64, AccumType::Auto),
            (Fp8E4M3, AccumType::F32),
            (Fp8E5M2, AccumType::F16),
        ]
    };
    // LL8 packets carry 4 bytes: wider elements are refused by the plan (checked below).
    t.retain(|(d, _)| !ll8 || d.size() <= 4);
    t
}

fn check_plan(
    ctx: &RankContext,
    plan: &Arc<Plan>,
    label: &str,
    seed: u64,
    stream: Stream,
) -> Result<String> {
    let algo = PlanAlgorithm::new(ctx.comm.clone(), plan.clone())?;
    let op = plan_reduce_op(plan).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let (min, max) = algo.message_range();
    let chunks = plan.gpus[0].input_chunks as u64;
    let mut runs = 0;
    for (t, (dtype, accum)) in types(plan, label).into_iter().enumerate() {
        let unit = chunks * dtype.size() as u64;
        let largest = (max.min(MAX_CHECK_BYTES) / unit) as usize;
        let mut sizes: Vec<usize> = CHUNK_ELEMS
            .iter()
            .copied()
            .filter(|&e| e < largest)
            .collect();
        sizes.push(largest);
        let large = (max.min(LARGE_CHECK_BYTES) / unit) as usize;
        if t == 0 && large > largest {
            sizes.push(large);
        }
        sizes.retain(|&e| e > 0 && e as u64 * unit >= min);
        for (s, &elems) in sizes.iter().enumerate() {
            for graph in [false, true] {
                let case = Case {
                    dtype,
                    accum,
                    op,
                    elems,
                    graph,
                    seed: seed ^ ((t as u64) << 40) ^ ((s as u64) << 32) ^ graph as u64,
                };
                let r = case.run(ctx, &algo, plan, stream);
                // Every rank stops at the first failure of any rank: the next case is collective.
                let ok = all_ok(ctx, r.is_ok())?;
                r.map_err(|e| {
                    Error::Internal(format!(
                        "{} {elems} elements/chunk{}: {e}",
                        dtype.name(),
                        if graph { " (graph)" } else { "" }
                    ))
                })?;
                if !ok {
                    return Err(Error::Internal(format!(
                        "another rank failed {} with {elems} elements per chunk",
                        dtype.name()
                    )));
                }
                runs += 1;
            }
        }
    }
    Ok(format!(
        "{runs} runs ({} threadblocks, {:?}, sizes up to {} bytes), every element checked",
        plan.gpus[ctx.rank()].threadblocks.len(),
        plan.protocol,
        max.min(LARGE_CHECK_BYTES)
    ))
}

fn all_ok(ctx: &RankContext, ok: bool) -> Result<bool> {
    let all = ctx.bootstrap.all_gather(&[u8::from(ok)])?;
    Ok(all.iter().all(|v| v.first() == Some(&1)))
}

struct Case {
    dtype: DataType,
    accum: AccumType,
    op: PlanReduceOp,
    elems: usize,
    graph: bool,
    seed: u64,
}

impl Case {
    fn run(
        &self,
        ctx: &RankContext,
        algo: &PlanAlgorithm,
        plan: &Plan,
        stream: Stream,
    ) -> Result<()> {
        let (n, rank) = (ctx.size(), ctx.rank());
        let gpu = &ctx.gpu;
        let count = self.elems * plan.gpus[0].input_chunks as usize;
        let size = self.dtype.size();
        let in_bytes = count * size;
        let allgather = algo.collective() == Collective::AllGather;
        if !plan.inplace
            || !matches!(
                algo.collective(),
                Collective::AllReduce | Collective::AllGather
            )
        {
            return Err(Error::Unsupported(format!(
                "no GPU check for {} plans {}",
                algo.collective(),
                if plan.inplace {
                    "in place"
                } else {
                    "out of place"
                }
            )));
        }
        let out_bytes = if allgather { n * in_bytes } else { in_bytes };
        let buf = gpu.alloc(out_bytes, MemoryKind::Plain)?;
        let result = (|| {
            let input = buf.ptr
                + if allgather {
                    (rank * in_bytes) as u64
                } else {
                    0
                };
            let args = ExecuteArgs {
                input,
                output: buf.ptr,
                input_bytes: in_bytes,
                output_bytes: out_bytes,
                dtype: self.dtype,
                op: match self.op {
                    PlanReduceOp::Sum => ReduceOp::Sum,
                    PlanReduceOp::Min => ReduceOp::Min,
                    PlanReduceOp::Max => ReduceOp::Max,
                    PlanReduceOp::Prod => ReduceOp::Prod,
                },
                accum: self.accum,
                root: 0,
                stream,
                nblocks: None,
                nthreads: None,
            };
            let fill = |round: u64| -> Result<Vec<Vec<f64>>> {
                let inputs: Vec<Vec<f64>> = (0..n)
                    .map(|r| {
                        let mut rng = StdRng::seed_from_u64(
                            self.seed ^ (round << 48) ^ ((r as u64 + 1) << 56),
                        );
                        (0..count)
                            .map(|_| random_input(self.dtype, self.op, n, &mut rng))
                            .collect()
                    })
                    .collect();
                gpu.memset_async(buf.ptr, 0xa5, out_bytes, stream)?;
                gpu.synchronize_stream(stream)?;
                gpu.copy_to_device(input, &encode(self.dtype, &inputs[rank]))?;
                Ok(inputs)
            };
            // Every rank has its inputs in place (and its output poisoned) before any rank's
            // kernel may write into it.
            if !self.graph {
                let inputs = fill(0)?;
                ctx.bootstrap.barrier()?;
                algo.execute(&args)?;
                gpu.synchronize_stream(stream)?;
                ctx.comm.check_device_errors()?;
                return self.verify(ctx, allgather, buf.ptr, out_bytes, &inputs);
            }
            let inputs = fill(1)?;
            ctx.bootstrap.barrier()?;
            gpu.begin_capture(stream)?;
            let captured = algo.execute(&args);
            let ended = gpu.end_capture(stream);
            captured?;
            let g = ended?;
            let replays = (|| {
                let mut inputs = inputs;
                for round in 0..REPLAYS as u64 {
                    if round > 0 {
                        ctx.bootstrap.barrier()?;
                        inputs = fill(round + 1)?;
                    }
                    ctx.bootstrap.barrier()?;
                    gpu.launch_graph(g, stream)?;
                    gpu.synchronize_stream(stream)?;
                    ctx.comm.check_device_errors()?;
                    self.verify(ctx, allgather, buf.ptr, out_bytes, &inputs)?;
                }
                Ok(())
            })();
            let _ = gpu.destroy_graph(g);
            replays
        })();
        // Nobody frees a buffer a peer may still write.
        ctx.bootstrap.barrier()?;
        gpu.free(&buf)?;
        result
    }

    /// Every output element against the collective of `inputs` in f64.
    fn verify(
        &self,
        ctx: &RankContext,
        allgather: bool,
        ptr: u64,
        bytes: usize,
        inputs: &[Vec<f64>],
    ) -> Result<()> {
        let n = ctx.size();
        let mut raw = vec![0u8; bytes];
        ctx.gpu.copy_from_device(&mut raw, ptr)?;
        let got = decode(self.dtype, &raw);
        let count = inputs[0].len();
        let mut wrong = 0;
        let mut first = None;
        for (e, &g) in got.iter().enumerate() {
            let (want, tol) = if allgather {
                (inputs[e / count][e % count], 0.0)
            } else {
                let vals: Vec<f64> = inputs.iter().map(|x| x[e]).collect();
                let (want, scale) = reduced(self.op, &vals);
                (want, tolerance(self.dtype, n, scale))
            };
            let ok = if allgather {
                g == want
            } else {
                within(self.dtype, g, want, tol)
            };
            if !ok {
                wrong += 1;
                first.get_or_insert(format!(
                    "element {e}: got {g}, want {want} (tolerance {tol:.3e})"
                ));
            }
        }
        match first {
            None => Ok(()),
            Some(f) => Err(Error::Internal(format!(
                "rank {}: {wrong} of {} elements wrong, first {f}",
                ctx.rank(),
                got.len()
            ))),
        }
    }
}

/// Little-endian bytes of `values` as `dtype` (each value is already one `dtype` holds).
fn encode(dtype: DataType, values: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &x in values {
        match dtype {
            DataType::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
            DataType::F64 => out.extend_from_slice(&x.to_le_bytes()),
            DataType::F16 => out.extend_from_slice(&half::f16::from_f64(x).to_le_bytes()),
            DataType::Bf16 => out.extend_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
            DataType::I8 => out.push(x as i8 as u8),
            DataType::U8 => out.push(x as u8),
            DataType::I32 => out.extend_from_slice(&(x as i32).to_le_bytes()),
            DataType::U32 => out.extend_from_slice(&(x as u32).to_le_bytes()),
            DataType::I64 => out.extend_from_slice(&(x as i64).to_le_bytes()),
            DataType::U64 => out.extend_from_slice(&(x as u64).to_le_bytes()),
            d => out.push(fp8::format_of(d).map_or(0, |f| f.encode(x as f32))),
        }
    }
    out
}

/// The values of little-endian `dtype` elements (poison included, so it shows in a report).
fn decode(dtype: DataType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| {
            let w = |n: usize| {
                let mut b = [0u8; 8];
                b[..n].copy_from_slice(&c[..n]);
                u64::from_le_bytes(b)
            };
            match dtype {
                DataType::F32 => f32::from_bits(w(4) as u32) as f64,
                DataType::F64 => f64::from_bits(w(8)),
                DataType::F16 => half::f16::from_bits(w(2) as u16).to_f64(),
                DataType::Bf16 => half::bf16::from_bits(w(2) as u16).to_f64(),
                DataType::I8 => c[0] as i8 as f64,
                DataType::U8 => c[0] as f64,
                DataType::I32 => w(4) as u32 as i32 as f64,
                DataType::U32 => w(4) as u32 as f64,
                DataType::I64 => w(8) as i64 as f64,
                DataType::U64 => w(8) as f64,
                d => fp8::format_of(d).map_or(f64::NAN, |f| f.decode(c[0]) as f64),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_executor::reference::quantize;

    #[test]
    fn elements_round_trip_through_their_bytes() {
        let mut rng = StdRng::seed_from_u64(7);
        for dtype in DataType::ALL {
            let values: Vec<f64> = (0..64)
                .map(|_| random_input(dtype, PlanReduceOp::Sum, 4, &mut rng))
                .collect();
            let back = decode(dtype, &encode(dtype, &values));
            for (v, b) in values.iter().zip(&back) {
                assert_eq!(*b, quantize(dtype, *v), "{dtype}");
                assert_eq!(v, b, "{dtype}: inputs are already in the type's values");
            }
        }
    }
}
