//! GPU checks of `port_allreduce` (all-reduce over PortChannels: the proxy moves the data with the
//! copy engine). Every rank of the job takes part; the suite calls [`run`] on every rank and prints
//! one PASS/FAIL line per entry.
//!
//! Matrix, through `mscclpp_collectives::testing::run_collective_check` (random data, outputs
//! poisoned, every element compared with the host reference): bf16 sum, f32 sum, i32 sum and max;
//! 1, 3 and 1023 elements, 4 KiB + 8 B, 1 MiB - 1 element, 64 MiB, 64 MiB + 3 elements and (bf16)
//! 1 GiB, the last two in segments of the 64 MiB slots; out of place and in place;
//! eager and CUDA-graph (one capture, two replays on fresh data, each checked). One line per dtype
//! reports the number of checks. A last line checks the proxy: no error, triggers handled.
//!
//! After every check the ranks agree (bootstrap all-gather) on whether it ran to completion: an
//! error (a device timeout, a failed launch) may leave the channels' signal counts out of step, so
//! the remaining checks are then skipped on every rank instead of each timing out.
//!
//! Under MPS with more than `MPS_PORT_RANKS_PER_GPU` ranks on a GPU the algorithm must refuse
//! to start, naming MPS (`port_channel::shared_queue_hazard`): that refusal is the one check.

use crate::tally::Tally;
use crate::{RankContext, MIB};
use mscclpp::core::port_channel::{PortChannelConfig, MPS_PORT_RANKS_PER_GPU};
use mscclpp::core::{DataType, Error, ReduceOp, Result};
use mscclpp_collectives::port_allreduce::PortAllreduce;
use mscclpp_collectives::testing::run_collective_check;
use std::sync::Arc;

/// The algorithm's slot size; larger messages of the matrix run in segments of this.
const MAX_BYTES: usize = 64 * MIB;
const GIB: usize = 1 << 30;
/// Device spin bound of the channel waits: a lost signal fails in tens of seconds, not hours, while
/// a peer that is still compiling its first kernel (under a second) is waited for.
const MAX_SPIN: u64 = 1 << 28;

/// (dtype, ops) rows of the matrix; one report line per row.
const ROWS: [(DataType, &[ReduceOp]); 3] = [
    (DataType::Bf16, &[ReduceOp::Sum]),
    (DataType::F32, &[ReduceOp::Sum]),
    (DataType::I32, &[ReduceOp::Sum, ReduceOp::Max]),
];

/// Element counts of the matrix for `dtype`: 1, 3, 1023 elements, 4 KiB + 8 B, 1 MiB - 1 element,
/// 64 MiB (one whole segment), 64 MiB + 3 elements (a second, short segment), and for bf16 1 GiB
/// (16 segments; one type only, as the host reference alone takes seconds).
pub fn matrix_counts(dtype: DataType) -> Vec<usize> {
    let es = dtype.size();
    let mut counts = vec![
        1,
        3,
        1023,
        (4096usize + 8).div_ceil(es),
        MIB / es - 1,
        MAX_BYTES / es,
        MAX_BYTES / es + 3,
    ];
    if dtype == DataType::Bf16 {
        counts.push(GIB / es);
    }
    counts
}

/// Runs the `port_allreduce` checks on this rank; returns (check name, outcome) in order.
pub fn run(ctx: &RankContext) -> Vec<(String, Result<String>)> {
    if ctx.size() < 2 {
        return vec![(
            "port_allreduce".into(),
            Ok(format!(
                "skipped: {} rank(s); an all-reduce over PortChannels needs at least 2",
                ctx.size()
            )),
        )];
    }
    let run_seed = match ctx.shared_seed() {
        Ok(s) => s,
        Err(e) => return vec![("port_allreduce run seed".into(), Err(e))],
    };
    let config = PortChannelConfig {
        max_spin: MAX_SPIN,
        ..Default::default()
    };
    if let Some(n) = ctx
        .comm
        .mps_clients_per_gpu()
        .filter(|&n| n > MPS_PORT_RANKS_PER_GPU)
    {
        let refused = match PortAllreduce::new(ctx.comm.clone(), MAX_BYTES, config) {
            Err(Error::Unsupported(why)) if why.contains("MPS") => Ok(format!("refused: {why}")),
            Err(e) => Err(e),
            Ok(_) => Err(Error::Internal(format!(
                "built with {n} MPS clients on a GPU; it must refuse (its proxy's copies can \
                 queue behind the kernels that wait for them)"
            ))),
        };
        return vec![("port_allreduce under MPS".into(), refused)];
    }
    let algo = match PortAllreduce::new(ctx.comm.clone(), MAX_BYTES, config) {
        Ok(a) => Arc::new(a),
        Err(e) => return vec![("port_allreduce setup".into(), Err(e))],
    };
    let mut out = Vec::new();
    let mut aborted: Option<String> = None;
    let mut case = 0u64;
    for (dtype, ops) in ROWS {
        let name = format!("port_allreduce {dtype} ({})", op_names(ops));
        if let Some(why) = &aborted {
            out.push((name, Err(Error::Internal(format!("not run: {why}")))));
            continue;
        }
        let mut tally = Tally::default();
        'row: for &op in ops {
            for count in matrix_counts(dtype) {
                for graph in [false, true] {
                    for in_place in [false, true] {
                        case += 1;
                        let seed = run_seed ^ case.wrapping_mul(0x2545_f491_4f6c_dd1d);
                        let what = format!(
                            "{dtype} {op} count {count} {} {}",
                            if in_place { "in place" } else { "out of place" },
                            if graph { "graph" } else { "eager" }
                        );
                        let r = run_collective_check(
                            &ctx.comm,
                            algo.as_ref(),
                            dtype,
                            op,
                            count,
                            in_place,
                            seed,
                            graph,
                            None,
                        );
                        // Wrong elements complete the check; an error stops it on the way.
                        let completed = r.is_ok();
                        let r = r.and_then(|rep| match rep.wrong {
                            0 => Ok(()),
                            wrong => Err(Error::Internal(format!(
                                "{wrong} wrong, first {:?} (tol {})",
                                rep.first_wrong, rep.tolerance
                            ))),
                        });
                        if let Err(why) = tally.record(ctx, &what, r, completed) {
                            aborted = Some(why);
                            break 'row;
                        }
                    }
                }
            }
        }
        let result = tally.outcome(&aborted, |passed| {
            format!(
                "{passed} checks passed (sizes {:?} elements, in/out of place, eager/graph with \
                 2 replays, on {} ranks)",
                matrix_counts(dtype),
                ctx.size()
            )
        });
        out.push((name, result));
    }
    let proxy = algo
        .check_proxy()
        .and_then(|()| algo.proxy_stats())
        .and_then(|s| match s.errors {
            0 => Ok(format!("{} triggers handled, no errors", s.handled)),
            n => Err(Error::Internal(format!(
                "{n} of {} triggers failed",
                s.handled
            ))),
        });
    out.push(("port_allreduce proxy".into(), proxy));
    // Dropping the algorithm stops its proxy and waits (bootstrap barrier) for every peer to have
    // stopped too before the scratch is freed.
    drop(algo);
    out
}

fn op_names(ops: &[ReduceOp]) -> String {
    ops.iter().map(|o| o.name()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matrix_sizes_match_the_brief() {
        assert_eq!(
            matrix_counts(DataType::Bf16),
            vec![
                1,
                3,
                1023,
                2052,
                MIB / 2 - 1,
                32 * MIB,
                32 * MIB + 3,
                512 * MIB
            ]
        );
        assert_eq!(
            matrix_counts(DataType::F32),
            vec![1, 3, 1023, 1026, MIB / 4 - 1, 16 * MIB, 16 * MIB + 3]
        );
        for (dtype, _) in ROWS {
            let counts = matrix_counts(dtype);
            // One exact slot, then a message one segment and 3 elements long; 4 KiB + 8 B is
            // whole elements.
            assert_eq!(counts[5], MAX_BYTES / dtype.size());
            assert_eq!(counts[6], counts[5] + 3);
            assert_eq!(counts[3] * dtype.size(), 4096 + 8);
        }
    }
}
