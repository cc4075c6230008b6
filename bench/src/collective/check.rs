//! Correctness check of one collective call against a host reference.
//!
//! Reductions are compared with a float64 reference (integers: exact, wrapped to the type's width
//! after every step as fixed-width device arithmetic does); copies (all-gather, broadcast) must be
//! bit-exact. The float tolerance covers the roundings a reduction in the input type makes:
//!
//! - sum: `|got - ref| <= n·u·Σ|xᵢ| + n·s`
//! - avg: `|got - ref| <= (n+1)·u·Σ|xᵢ|/n + n·s`
//! - prod: `|got - ref| <= n·u·|ref|·2 + n·s`
//! - min, max: exact
//!
//! with `u` the type's unit roundoff and `s` its smallest subnormal ([`TOLERANCE_TEXT`]). A
//! reduction over one rank does no arithmetic, so its output must be its input bit for bit.
//! Checking splits the elements over threads: a 1 GiB message is hundreds of millions of them.

use super::data::{
    float_of_word, int_of_word, smallest_subnormal, unit_roundoff, word, worker_threads, InputSpec,
    RankInput,
};
use super::shape::Shape;
use mscclpp_core::{Collective, DataType, ReduceOp};

/// The tolerance rule, as printed in the benchmark's header.
pub const TOLERANCE_TEXT: &str =
    "floats: sum |got-ref| <= n*u*sum|x| + n*s, avg <= (n+1)*u*sum|x|/n + n*s, \
prod <= 2*n*u*|ref| + n*s (u: unit roundoff, s: smallest subnormal of the type); \
min/max, integers, copies and reductions over one rank exact";

/// Result of checking one output buffer.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CheckResult {
    pub wrong: usize,
    /// The first mismatch, described (index, got, expected).
    pub first: Option<String>,
}

/// Integer `v` wrapped to `dtype`'s width.
fn wrap(dtype: DataType, v: i128) -> i128 {
    match dtype {
        DataType::I8 => i128::from(v as i8),
        DataType::U8 => i128::from(v as u8),
        DataType::I32 => i128::from(v as i32),
        DataType::U32 => i128::from(v as u32),
        DataType::I64 => i128::from(v as i64),
        _ => i128::from(v as u64),
    }
}

/// Reference of an integer reduction of `vals` (exact values of the ranks' elements).
pub fn int_reference(dtype: DataType, op: ReduceOp, vals: &[i128]) -> i128 {
    let sum = || vals.iter().fold(0, |a, &b| wrap(dtype, a + b));
    match op {
        ReduceOp::Sum => sum(),
        // The wrapped sum divided by n, truncating toward zero (C++ integer division).
        ReduceOp::Avg => wrap(dtype, sum() / vals.len().max(1) as i128),
        ReduceOp::Prod => vals.iter().fold(1, |a, &b| wrap(dtype, a * b)),
        ReduceOp::Min => vals.iter().copied().min().unwrap_or(0),
        ReduceOp::Max => vals.iter().copied().max().unwrap_or(0),
    }
}

/// The constants of a type's float tolerance (see the module docs), worked out once per check.
#[derive(Debug, Clone, Copy)]
pub struct Rounding {
    /// Unit roundoff.
    u: f64,
    /// Smallest subnormal.
    s: f64,
}

impl Rounding {
    pub fn of(dtype: DataType) -> Rounding {
        Rounding {
            u: unit_roundoff(dtype),
            s: smallest_subnormal(dtype),
        }
    }

    /// Reference of a float reduction of `vals` and the tolerance around it.
    pub fn reference(&self, op: ReduceOp, vals: &[f64]) -> (f64, f64) {
        let n = vals.len().max(1) as f64;
        let (u, s) = (self.u, self.s);
        let abs_sum: f64 = vals.iter().map(|v| v.abs()).sum();
        match op {
            ReduceOp::Sum => (vals.iter().sum(), n * u * abs_sum + n * s),
            ReduceOp::Avg => (
                vals.iter().sum::<f64>() / n,
                (n + 1.0) * u * abs_sum / n + n * s,
            ),
            ReduceOp::Prod => {
                let p: f64 = vals.iter().product();
                (p, 2.0 * n * u * p.abs() + n * s)
            }
            ReduceOp::Min => (vals.iter().copied().fold(f64::INFINITY, f64::min), 0.0),
            ReduceOp::Max => (vals.iter().copied().fold(f64::NEG_INFINITY, f64::max), 0.0),
        }
    }
}

/// Counts wrong elements of `got` (this rank's output, `shape.output_bytes` long) for the call
/// described by `shape` on `rank`, whose inputs are `spec`'s; `root` is the rooted collectives'
/// root (broadcast, reduce, gather, scatter).
pub fn check_output(
    shape: &Shape,
    spec: &InputSpec,
    op: ReduceOp,
    rank: usize,
    root: usize,
    got: &[u8],
) -> CheckResult {
    // Reduce and gather write the root's output only (nccl-tests checks only the root's too).
    if matches!(shape.collective, Collective::Reduce | Collective::Gather) && rank != root {
        return CheckResult::default();
    }
    let esize = spec.dtype.size();
    let elems = got.len() / esize;
    let parts = worker_threads(elems);
    let per = elems.div_ceil(parts).max(1);
    let results: Vec<CheckResult> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..parts)
            .map(|p| {
                let range = (p * per).min(elems)..((p + 1) * per).min(elems);
                scope.spawn(move || check_range(shape, spec, op, rank, root, got, range))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| CheckResult {
                    wrong: 1,
                    first: Some("a checking thread panicked".into()),
                })
            })
            .collect()
    });
    let mut total = CheckResult::default();
    for r in results {
        total.wrong += r.wrong;
        if total.first.is_none() {
            total.first = r.first;
        }
    }
    total
}

/// nccl-tests' sendrecv ring: (the rank `rank` sends to, the rank it receives from).
pub fn sendrecv_peers(rank: usize, nranks: usize) -> (usize, usize) {
    let n = nranks.max(1);
    ((rank + 1) % n, (rank + n - 1) % n)
}

/// For each source s, where its part starts in `rank`'s output and in s's input (elements), in
/// an all-to-all of traffic matrix `m` (`[src][dst]`, parts packed in rank order).
fn part_starts(m: &[Vec<usize>], rank: usize) -> (Vec<usize>, Vec<usize>) {
    let recv = m
        .iter()
        .scan(0, |at, row| {
            let start = *at;
            *at += row[rank];
            Some(start)
        })
        .collect();
    let send = m.iter().map(|row| row[..rank].iter().sum()).collect();
    (recv, send)
}

fn check_range(
    shape: &Shape,
    spec: &InputSpec,
    op: ReduceOp,
    rank: usize,
    root: usize,
    got: &[u8],
    range: std::ops::Range<usize>,
) -> CheckResult {
    let dtype = spec.dtype;
    let esize = dtype.size();
    let n = spec.nranks;
    let inputs: Vec<RankInput> = (0..n.max(root + 1)).map(|r| spec.rank(r)).collect();
    let rounding = Rounding::of(dtype);
    let mut out = CheckResult::default();
    let mut fvals = vec![0f64; n];
    let mut ivals = vec![0i128; n];
    // The skewed all-to-all-v: where each source's part starts in this rank's output, and in
    // the source's input.
    let (recv_starts, send_starts) = if shape.skewed {
        part_starts(&shape.traffic(), rank)
    } else {
        Default::default()
    };
    for i in range {
        let g = word(&got[i * esize..(i + 1) * esize]);
        // Only the first mismatch is described: a wrong 1 GiB output has millions.
        let describe = out.first.is_none();
        let wrong = |text: &dyn Fn() -> String| Some(if describe { text() } else { String::new() });
        let mismatch: Option<String> = match shape.collective {
            // A reduction over one rank does no arithmetic: it is checked as the copy it is,
            // bit for bit (below), which is stricter and a quarter of the work.
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce if n > 1 => {
                // Element i of the output is element `offset + i` of every input.
                let offset = if shape.collective == Collective::ReduceScatter {
                    rank * shape.per_rank_count
                } else {
                    0
                };
                if dtype.is_float() {
                    for (v, input) in fvals.iter_mut().zip(&inputs) {
                        *v = input.value(offset + i);
                    }
                    let (want, tol) = rounding.reference(op, &fvals);
                    let value = float_of_word(dtype, g);
                    // False for NaN, which is always wrong.
                    if (value - want).abs() <= tol {
                        None
                    } else {
                        wrong(&|| {
                            format!("element {i}: got {value}, expected {want} (tolerance {tol:e})")
                        })
                    }
                } else {
                    for (v, input) in ivals.iter_mut().zip(&inputs) {
                        *v = input.value(offset + i) as i128;
                    }
                    let want = int_reference(dtype, op, &ivals);
                    let value = int_of_word(dtype, g);
                    if value == want {
                        None
                    } else {
                        wrong(&|| format!("element {i}: got {value}, expected {want}"))
                    }
                }
            }
            Collective::AllGather
            | Collective::Gather
            | Collective::Broadcast
            | Collective::Scatter
            | Collective::AllToAll
            | Collective::SendRecv
            | Collective::AllReduce
            | Collective::ReduceScatter
            | Collective::Reduce => {
                // Data movement: which rank's input element lands at output element i (for
                // all-to-all, chunk s of the output is chunk `rank` of rank s's input; for a
                // reduction over one rank, element i of its own input).
                let c = shape.per_rank_count.max(1);
                let (src_rank, src_index) = match shape.collective {
                    Collective::AllGather | Collective::Gather => (i / c, i % c),
                    Collective::AllToAll if shape.skewed => {
                        // The last source whose part starts at or before i (parts are in rank
                        // order without gaps; an empty part shares its start with the next).
                        let s = recv_starts.partition_point(|&start| start <= i) - 1;
                        (s, send_starts[s] + i - recv_starts[s])
                    }
                    Collective::AllToAll => (i / c, rank * c + i % c),
                    Collective::Scatter => (root, rank * c + i),
                    Collective::SendRecv => (sendrecv_peers(rank, n).1, i),
                    _ => (root, i),
                };
                let (want, _) = inputs[src_rank].element(src_index);
                if g == want {
                    None
                } else {
                    wrong(&|| {
                        format!(
                            "element {i}: got bytes {:02x?}, expected {:02x?} (rank {src_rank}'s element {src_index})",
                            &g.to_le_bytes()[..esize],
                            &want.to_le_bytes()[..esize]
                        )
                    })
                }
            }
        };
        if let Some(m) = mismatch {
            out.wrong += 1;
            if out.first.is_none() {
                out.first = Some(m);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::data::encode_word;
    use super::*;
    use rstest::rstest;

    fn spec(dtype: DataType, op: Option<ReduceOp>, nranks: usize) -> InputSpec {
        InputSpec {
            seed: 7,
            dtype,
            op,
            nranks,
        }
    }

    fn put(dtype: DataType, v: f64, out: &mut [u8]) {
        out.copy_from_slice(&encode_word(dtype, v).to_le_bytes()[..dtype.size()]);
    }

    /// What a correct device would write: the reference rounded to the type.
    fn correct_output(shape: &Shape, s: &InputSpec, op: ReduceOp, rank: usize) -> Vec<u8> {
        let e = s.dtype.size();
        let count = shape.output_bytes / e;
        let mut out = vec![0u8; shape.output_bytes];
        for i in 0..count {
            let chunk = &mut out[i * e..(i + 1) * e];
            match shape.collective {
                Collective::AllGather => {
                    let (r, j) = (i / shape.per_rank_count, i % shape.per_rank_count);
                    put(s.dtype, s.rank(r).value(j), chunk)
                }
                Collective::Gather => {
                    let (r, j) = (i / shape.per_rank_count, i % shape.per_rank_count);
                    put(s.dtype, s.rank(r).value(j), chunk)
                }
                Collective::Broadcast => put(s.dtype, s.rank(0).value(i), chunk),
                Collective::Scatter => put(
                    s.dtype,
                    s.rank(0).value(rank * shape.per_rank_count + i),
                    chunk,
                ),
                Collective::AllToAll => {
                    let c = shape.per_rank_count;
                    put(s.dtype, s.rank(i / c).value(rank * c + i % c), chunk)
                }
                Collective::SendRecv => put(
                    s.dtype,
                    s.rank(sendrecv_peers(rank, s.nranks).1).value(i),
                    chunk,
                ),
                c => {
                    let off = if c == Collective::ReduceScatter {
                        rank * shape.per_rank_count
                    } else {
                        0
                    };
                    if s.dtype.is_float() {
                        let v: Vec<f64> = (0..s.nranks).map(|r| s.rank(r).value(off + i)).collect();
                        put(s.dtype, Rounding::of(s.dtype).reference(op, &v).0, chunk)
                    } else {
                        let v: Vec<i128> = (0..s.nranks)
                            .map(|r| s.rank(r).value(off + i) as i128)
                            .collect();
                        put(s.dtype, int_reference(s.dtype, op, &v) as f64, chunk)
                    }
                }
            }
        }
        out
    }

    #[rstest]
    #[case(Collective::AllReduce, DataType::F32, ReduceOp::Sum)]
    #[case(Collective::AllReduce, DataType::Bf16, ReduceOp::Avg)]
    #[case(Collective::AllReduce, DataType::Fp8E4M3, ReduceOp::Prod)]
    #[case(Collective::AllReduce, DataType::I32, ReduceOp::Min)]
    #[case(Collective::AllReduce, DataType::U8, ReduceOp::Prod)]
    #[case(Collective::ReduceScatter, DataType::F16, ReduceOp::Max)]
    #[case(Collective::ReduceScatter, DataType::I8, ReduceOp::Avg)]
    #[case(Collective::AllGather, DataType::Fp8E5M2, ReduceOp::Sum)]
    #[case(Collective::Broadcast, DataType::U32, ReduceOp::Sum)]
    #[case(Collective::AllToAll, DataType::Bf16, ReduceOp::Sum)]
    #[case(Collective::SendRecv, DataType::I64, ReduceOp::Sum)]
    #[case(Collective::Reduce, DataType::F32, ReduceOp::Max)]
    #[case(Collective::Reduce, DataType::I32, ReduceOp::Sum)]
    #[case(Collective::Gather, DataType::Bf16, ReduceOp::Sum)]
    #[case(Collective::Scatter, DataType::U8, ReduceOp::Sum)]
    fn correct_outputs_pass_and_corruption_is_counted(
        #[case] c: Collective,
        #[case] dtype: DataType,
        #[case] op: ReduceOp,
    ) {
        let n = 4;
        let shape = Shape::new(c, dtype, 4096, n).expect("shape");
        let s = spec(dtype, c.reduces().then_some(op), n);
        let rank = 2;
        // Reduce and gather are checked on their root only: make this rank the root.
        let root = if matches!(c, Collective::Reduce | Collective::Gather) {
            rank
        } else {
            0
        };
        let mut out = correct_output(&shape, &s, op, rank);
        let ok = check_output(&shape, &s, op, rank, root, &out);
        assert_eq!(ok.wrong, 0, "{c} {dtype} {op}: {:?}", ok.first);
        // Corrupt three elements: flipping bit 6 of the top byte moves a float's exponent (or
        // turns 0 into 2) and an integer by at least 64.
        let e = dtype.size();
        for i in [0, 5, shape.output_bytes / e - 1] {
            out[(i + 1) * e - 1] ^= 0x40;
        }
        let bad = check_output(&shape, &s, op, rank, root, &out);
        assert_eq!(bad.wrong, 3, "{c} {dtype} {op}");
        if root == rank {
            // Off the root the output is not the collective's: nothing is counted there.
            assert_eq!(check_output(&shape, &s, op, rank, 0, &out).wrong, 0);
        }
        assert!(
            bad.first.as_deref().unwrap_or("").contains("element 0"),
            "{bad:?}"
        );
    }

    /// The device check (bench_data.cu) of `args`, run here with data.rs's generator: what the
    /// kernel computes, so that its mapping from output elements to inputs is tested on the CPU.
    fn device_check_on_the_host(
        s: &InputSpec,
        op: ReduceOp,
        args: &mscclpp_kernels_cu::bench_data::BenchDataArgs,
        got: &[u8],
    ) -> usize {
        use mscclpp_kernels_cu::bench_data::{MODE_CHECK_BLOCKS, MODE_CHECK_COPY};
        let e = s.dtype.size();
        (0..args.count as usize)
            .filter(|&i| {
                let g = word(&got[i * e..(i + 1) * e]);
                let (base, block) = (args.base as usize, args.block as usize);
                match args.mode {
                    MODE_CHECK_COPY => g != s.rank(args.rank as usize).element(base + i).0,
                    MODE_CHECK_BLOCKS => g != s.rank(i / block).element(base + i % block).0,
                    _ if s.dtype.is_float() => {
                        let v: Vec<f64> =
                            (0..s.nranks).map(|r| s.rank(r).value(base + i)).collect();
                        let (want, tol) = Rounding::of(s.dtype).reference(op, &v);
                        (float_of_word(s.dtype, g) - want).abs() > tol
                            || float_of_word(s.dtype, g).is_nan()
                    }
                    _ => {
                        let v: Vec<i128> = (0..s.nranks)
                            .map(|r| s.rank(r).value(base + i) as i128)
                            .collect();
                        int_of_word(s.dtype, g) != int_reference(s.dtype, op, &v)
                    }
                }
            })
            .count()
    }

    #[rstest]
    fn the_device_plan_reads_the_inputs_the_host_check_reads(
        #[values(
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::Reduce,
            Collective::AllGather,
            Collective::Gather,
            Collective::Broadcast,
            Collective::Scatter,
            Collective::AllToAll,
            Collective::SendRecv
        )]
        c: Collective,
        #[values(1, 3, 4)] n: usize,
    ) {
        use super::super::device_data::{CheckPlan, DeviceData};
        for (dtype, op) in [
            (DataType::Bf16, ReduceOp::Sum),
            (DataType::F32, ReduceOp::Avg),
            (DataType::I8, ReduceOp::Prod),
            (DataType::U32, ReduceOp::Max),
        ] {
            let shape = Shape::new(c, dtype, 96 * n * dtype.size(), n).expect("shape");
            let s = spec(dtype, c.reduces().then_some(op), n);
            for rank in 0..n {
                // correct_output draws the broadcast and the scatter from rank 0; reduce and
                // gather are checked on their root only.
                let root = if matches!(c, Collective::Reduce | Collective::Gather) {
                    n - 1
                } else {
                    0
                };
                let mut out = correct_output(&shape, &s, op, rank);
                let plan = DeviceData::plan(&shape, &s, op, (rank, root));
                let args = match plan {
                    CheckPlan::Unchecked => {
                        assert!(
                            matches!(c, Collective::Reduce | Collective::Gather) && rank != root
                        );
                        continue;
                    }
                    CheckPlan::Host => panic!("{c} {dtype} {op}: not planned for the device"),
                    CheckPlan::Device(args) => args,
                };
                assert_eq!(args.count as usize, shape.output_bytes / dtype.size());
                let host = check_output(&shape, &s, op, rank, root, &out).wrong;
                let device = device_check_on_the_host(&s, op, &args, &out);
                assert_eq!(
                    (host, device),
                    (0, 0),
                    "{c} {dtype} {op} rank {rank} of {n}"
                );
                let e = dtype.size();
                for i in [0, args.count as usize / 2, args.count as usize - 1] {
                    out[(i + 1) * e - 1] ^= 0x40;
                }
                let host = check_output(&shape, &s, op, rank, root, &out).wrong;
                let device = device_check_on_the_host(&s, op, &args, &out);
                assert_eq!(
                    host, device,
                    "{c} {dtype} {op} rank {rank} of {n}, corrupted"
                );
                assert!(host >= 1, "{c} {dtype} {op} rank {rank} of {n}, corrupted");
            }
        }
    }

    #[rstest]
    #[case(DataType::Bf16, 2)]
    #[case(DataType::I32, 3)]
    #[case(DataType::U8, 8)]
    fn skewed_alltoallv_outputs_are_checked_part_by_part(
        #[case] dtype: DataType,
        #[case] n: usize,
    ) {
        let shape = Shape::skewed_alltoallv(dtype, 3 << 12, n).expect("shape");
        let m = shape.traffic();
        let s = spec(dtype, None, n);
        for rank in 0..n {
            // What every source sends this rank, in source order, from the sender's side.
            let mut out = Vec::new();
            for (src, row) in m.iter().enumerate() {
                let start: usize = row[..rank].iter().sum();
                out.extend(s.encode_range(src, start, row[rank]));
            }
            assert_eq!(out.len(), shape.output_bytes);
            let ok = check_output(&shape, &s, ReduceOp::Sum, rank, 0, &out);
            assert_eq!(ok.wrong, 0, "{dtype} rank {rank}: {:?}", ok.first);
            // Every element of the first source's part, corrupted, is counted.
            let e = dtype.size();
            let first = m[0][rank] * e;
            out[..first].iter_mut().for_each(|b| *b ^= 0x40);
            let bad = check_output(&shape, &s, ReduceOp::Sum, rank, 0, &out);
            assert_eq!(bad.wrong, first / e, "{dtype} rank {rank}");
        }
    }

    #[test]
    fn a_reduction_over_one_rank_must_be_its_input_bit_for_bit() {
        for (c, dtype, op) in [
            (Collective::AllReduce, DataType::Bf16, ReduceOp::Sum),
            (Collective::AllReduce, DataType::F32, ReduceOp::Prod),
            (Collective::ReduceScatter, DataType::F16, ReduceOp::Avg),
            (Collective::Reduce, DataType::I32, ReduceOp::Sum),
        ] {
            let shape = Shape::new(c, dtype, 4096, 1).expect("shape");
            let s = spec(dtype, Some(op), 1);
            let mut out = s.encode_range(0, 0, shape.output_bytes / dtype.size());
            assert_eq!(
                check_output(&shape, &s, op, 0, 0, &out).wrong,
                0,
                "{c} {dtype}"
            );
            // One unit in the last place off: within a sum's tolerance, but no arithmetic ran.
            out[0] ^= 1;
            let bad = check_output(&shape, &s, op, 0, 0, &out);
            assert_eq!(bad.wrong, 1, "{c} {dtype} {op}");
        }
    }

    #[test]
    fn an_output_left_poisoned_is_entirely_wrong_for_every_type() {
        use super::super::data::poison_byte;
        for dtype in DataType::ALL {
            for (c, op) in [
                (Collective::AllReduce, ReduceOp::Sum),
                (Collective::AllReduce, ReduceOp::Min),
                (Collective::AllGather, ReduceOp::Sum),
            ] {
                for n in [2, 8] {
                    let shape = Shape::new(c, dtype, 8 * 512, n).expect("shape");
                    let s = spec(dtype, c.reduces().then_some(op), n);
                    let out = vec![poison_byte(dtype); shape.output_bytes];
                    let r = check_output(&shape, &s, op, 1, 0, &out);
                    let count = shape.output_bytes / dtype.size();
                    assert_eq!(r.wrong, count, "{c} {dtype} {op} on {n} ranks: {r:?}");
                }
            }
        }
    }

    #[test]
    fn a_missing_rank_is_caught_in_f32() {
        let shape = Shape::new(Collective::AllReduce, DataType::F32, 1024, 2).expect("shape");
        let s = spec(DataType::F32, Some(ReduceOp::Sum), 2);
        // Only rank 0's input, as if the peer's contribution were lost.
        let out = s.encode_range(0, 0, 256);
        let r = check_output(&shape, &s, ReduceOp::Sum, 0, 0, &out);
        assert!(r.wrong > 250, "{r:?}");
    }

    #[test]
    fn references() {
        assert_eq!(int_reference(DataType::U8, ReduceOp::Sum, &[200, 100]), 44);
        assert_eq!(int_reference(DataType::I8, ReduceOp::Prod, &[2; 8]), 0);
        assert_eq!(int_reference(DataType::I32, ReduceOp::Avg, &[-3, 0]), -1);
        assert_eq!(
            Rounding::of(DataType::F32).reference(ReduceOp::Min, &[1.0, -2.0]),
            (-2.0, 0.0)
        );
        let (v, tol) = Rounding::of(DataType::Bf16).reference(ReduceOp::Sum, &[1.0, -0.5]);
        assert_eq!(v, 0.5);
        assert!(tol > 0.0 && tol < 0.02, "{tol}");
    }

    #[test]
    fn large_checks_split_over_threads_and_agree() {
        let shape = Shape::new(Collective::AllGather, DataType::U8, 3 << 20, 3).expect("shape");
        let s = spec(DataType::U8, None, 3);
        let mut out = correct_output(&shape, &s, ReduceOp::Sum, 1);
        assert_eq!(check_output(&shape, &s, ReduceOp::Sum, 1, 0, &out).wrong, 0);
        out[(2 << 20) + 17] ^= 0x80;
        let r = check_output(&shape, &s, ReduceOp::Sum, 1, 0, &out);
        assert_eq!(r.wrong, 1);
        assert!(r.first.unwrap_or_default().contains("rank 2"));
    }
}
