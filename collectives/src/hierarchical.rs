//! `default_allreduce_hierarchical`: the all-reduce of H hosts x k ranks (k equal on every host,
//! H and k in 2..=8), composed of algorithms that run on a GPU already, with no kernel of its own.
//!
//! # Setup (collective over the communicator)
//! Two sub-communicators ([`Communicator::split`], over the parent's bootstrap, sharing its health):
//! - the host group (the k ranks of this rank's host), with the single-host default collection
//!   built over it (`build_default_algorithms`: packet, zero-copy and scratch-staged kernels over
//!   CudaIpc/NVLink, and its selector);
//! - the cross-host group (the H ranks with this rank's local rank, one per host), with
//!   [`PortAllreduce`] over it (the proxy: Ethernet between hosts).
//!
//! # One call (`execute` enqueues only, on the caller's stream: stream order sequences the steps,
//! no host synchronisation, legal during CUDA-graph capture)
//! The [`steps`] of a call: for messages of at least [`SPLIT_MIN_BYTES`] and k elements,
//! 1. reduce-scatter in the host: local rank j gets the host's sum of chunk j (a k-th of the
//!    whole chunks), written into its own slice of the output;
//! 2. all-reduce of that slice across hosts (every host's rank j reduces chunk j);
//! 3. all-gather in the host, in place in the output (packets or staged through the scratch,
//!    never the zero-copy kernel: [`HierarchicalAllreduce`]'s `host_algorithm` says why);
//!
//! and the last `count % k` elements (and whole smaller messages): all-reduce in the host, then
//! all-reduce across hosts (every cross group reduces the same elements, so every rank ends with
//! them). Network traffic per rank is about 1/k of the message for the large path, which is where
//! the model in `docs/multi-host-model.md` puts the hierarchical algorithm's bandwidth.
//! Each step is the group's algorithm as its selector picks it (the host group's selector sees a
//! k-rank single-host call). Every step's kernels are loaded before the first is enqueued (CUDA's
//! lazy loading may wait for the running kernels of the context, among them the cross-host
//! exchange, which waits for this process's Ethernet receiver).
//!
//! # Integer averages
//! The host step's average is rounded (truncated) before the cross-host step averages again, and
//! `trunc(trunc(a / k) + trunc(b / k)) / 2` is not `trunc((a + b) / 2k)`: an integer `avg` runs
//! the flat all-reduce the collection passes in (one division of the whole sum, as on one host),
//! and is refused where there is none (more than 8 ranks). Float averages stay hierarchical (each
//! step's rounding is within the type's tolerance).
//!
//! # Device memory per rank
//! The host group's collection lends one scratch built from `scratch_bytes / 4`
//! ([`host_scratch_bytes`]: about 3.75 x that, 7.5 MiB for the default 8 MiB), the cross group's
//! `port_allreduce` takes `(2H + 1)` segments of [`port_segment_bytes`] (about `scratch_bytes`
//! in all), and the two sub-communicators' semaphore slabs `2 x (k + H) x 32 KiB`: about 16 MiB at
//! 2 hosts x 4 ranks with the default scratch.

use crate::port_allreduce::{self, PortAllreduce};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::{native_names, AlgorithmCollection, SelectionContext};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::port_channel::PortChannelConfig;
use mscclpp_core::{Error, ReduceOp, Result};
use mscclpp_kernels_cu::collectives::MAX_RANKS;
use std::sync::Arc;

/// The algorithm's name in selectors and reports.
pub const NAME: &str = native_names::ALLREDUCE_HIERARCHICAL;

/// Messages (bytes per rank) from which the three-step path runs; below, the two all-reduces (in
/// the host, across hosts) cost one launch less and move at most this much over the network. A
/// starting point; retune with `mscclpp-bench` on hosts with a network.
pub const SPLIT_MIN_BYTES: usize = 64 << 10;

/// The scratch the host group's collection is built from (`build_default_algorithms`' argument).
pub fn host_scratch_bytes(scratch_bytes: usize) -> usize {
    scratch_bytes / 4
}

/// Segment (bytes) of a PortChannel all-reduce over `nranks` ranks whose whole scratch (two
/// parity halves of a slot per rank, and the staging buffer: `2 x nranks + 1` segments) is about
/// `scratch_bytes`; at least one 16-byte vector.
pub fn port_segment_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    (scratch_bytes / (2 * nranks + 1) / 16 * 16).max(16)
}

/// One step of a call, on byte offsets of the caller's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Reduce-scatter in the host of input `[0, k * chunk)`: local rank j's share goes to
    /// output `[j * chunk, (j + 1) * chunk)`.
    HostReduceScatter { chunk: usize },
    /// All-reduce across hosts of output `[offset, offset + bytes)`, in place.
    CrossAllreduce { offset: usize, bytes: usize },
    /// All-gather in the host, in place: output `[j * chunk, (j + 1) * chunk)` of every local
    /// rank j into output `[0, k * chunk)`.
    HostAllgather { chunk: usize },
    /// All-reduce in the host of input `[offset, offset + bytes)` into the same bytes of the
    /// output.
    HostAllreduce { offset: usize, bytes: usize },
}

/// The steps of an all-reduce of `count` elements of `elem_bytes` bytes over hosts of `k` ranks,
/// for local rank `local` (see the module docs). The same sequence on every rank, so every
/// group's collectives match; only the offsets of the cross step differ by local rank. Pure, so
/// it is tested on the CPU.
pub fn steps(count: usize, elem_bytes: usize, k: usize, local: usize) -> Vec<Step> {
    let bytes = count * elem_bytes;
    let mut out = Vec::with_capacity(5);
    let whole = if bytes >= SPLIT_MIN_BYTES && k > 0 {
        count / k
    } else {
        0
    };
    if whole > 0 {
        let chunk = whole * elem_bytes;
        out.push(Step::HostReduceScatter { chunk });
        out.push(Step::CrossAllreduce {
            offset: local * chunk,
            bytes: chunk,
        });
        out.push(Step::HostAllgather { chunk });
    }
    let done = whole * k * elem_bytes;
    if done < bytes {
        let rest = bytes - done;
        out.push(Step::HostAllreduce {
            offset: done,
            bytes: rest,
        });
        out.push(Step::CrossAllreduce {
            offset: done,
            bytes: rest,
        });
    }
    out
}

/// The hierarchical all-reduce bound to one communicator. See the module docs.
pub struct HierarchicalAllreduce {
    // Field order is drop order: the groups' algorithms before the groups' communicators, all
    // before the parent.
    host: AlgorithmCollection,
    cross: Arc<PortAllreduce>,
    /// The flat all-reduce over the whole communicator, for integer averages.
    flat: Option<Arc<dyn Algorithm>>,
    host_comm: Arc<Communicator>,
    cross_comm: Arc<Communicator>,
    /// The device's architecture, for the host group's selector.
    arch: String,
    comm: Arc<Communicator>,
}

impl HierarchicalAllreduce {
    /// Collective over `comm`: splits it into its host and cross-host groups and builds each
    /// group's algorithms (see the module docs for what `scratch_bytes` buys). `flat`, an
    /// all-reduce over all of `comm`, runs the integer averages (module docs). `Unsupported`
    /// where the hierarchy does not apply (one host, one rank per host, uneven hosts, more than
    /// 8 hosts or 8 ranks per host), before anything collective, so every rank refuses alike.
    pub fn new(
        comm: Arc<Communicator>,
        scratch_bytes: usize,
        flat: Option<Arc<dyn Algorithm>>,
    ) -> Result<HierarchicalAllreduce> {
        let topology = comm.topology();
        let groups = topology.hierarchy(comm.rank()).ok_or_else(|| {
            Error::Unsupported(format!(
                "{NAME} needs at least 2 hosts with the same number (at least 2) of ranks each, \
                 not {topology}"
            ))
        })?;
        let (k, hosts) = (groups.host.len(), groups.cross.len());
        if k > MAX_RANKS || hosts > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "{NAME} takes up to {MAX_RANKS} hosts of up to {MAX_RANKS} ranks, not {topology}"
            )));
        }
        let arch = comm.gpu().properties(comm.device())?.arch;
        // Every rank splits its host group first, then its cross group: two parent collectives
        // in the same order everywhere; the groups' own setup then involves their members only.
        let host_comm = Arc::new(comm.split(&groups.host)?);
        let cross_comm = Arc::new(comm.split(&groups.cross)?);
        let host = crate::build_default_algorithms(
            &host_comm,
            host_scratch_bytes(scratch_bytes),
            AlgorithmCollection::builder(),
        )?
        .build();
        let cross = Arc::new(PortAllreduce::new(
            cross_comm.clone(),
            port_segment_bytes(scratch_bytes, hosts),
            PortChannelConfig::default(),
        )?);
        Ok(HierarchicalAllreduce {
            host,
            cross,
            flat,
            host_comm,
            cross_comm,
            arch,
            comm,
        })
    }

    /// Ranks per host.
    pub fn ranks_per_host(&self) -> usize {
        self.host_comm.size()
    }

    /// Hosts.
    pub fn hosts(&self) -> usize {
        self.cross_comm.size()
    }

    /// The first proxy error of the cross-host step not reported yet (see
    /// [`PortAllreduce::check_proxy`]).
    pub fn check_proxy(&self) -> Result<()> {
        self.cross.check_proxy()
    }

    /// The algorithm of the host group for `collective` on `args`: its selector's choice, except
    /// that the all-gather never takes the zero-copy `default_allgather_fullmesh2` but the
    /// scratch-staged `default_allgather_fullmesh` (the packet one where the selector picks it):
    /// the all-gather is enqueued after the cross-host step, whose exchange kernel spins until
    /// this process's Ethernet receiver has copied the peers' data in, and a zero-copy kernel
    /// registers a new user buffer first (driver calls that could wait on that kernel).
    fn host_algorithm(
        &self,
        collective: Collective,
        args: &ExecuteArgs,
    ) -> Result<Arc<dyn Algorithm>> {
        let k = self.host_comm.size();
        let ctx = SelectionContext {
            collective,
            message_bytes: args.input_bytes,
            dtype: args.dtype,
            world_size: k,
            local_world_size: k,
            symmetric_memory: false,
            capturing: self.comm.gpu().is_capturing(args.stream)?,
            arch: self.arch.clone(),
            // NVLink multicast stays behind its gate: not from here.
            nvls_allowed: false,
            in_place: SelectionContext::buffers_in_place(collective, args, self.host_comm.rank()),
        };
        let chosen = self.host.select(&ctx)?;
        if chosen.name() != native_names::ALLGATHER_FULLMESH2 {
            return Ok(chosen);
        }
        self.host
            .get(Collective::AllGather, native_names::ALLGATHER_FULLMESH)
            .ok_or_else(|| {
                Error::Internal(format!(
                    "{NAME}: the host group has no {}",
                    native_names::ALLGATHER_FULLMESH
                ))
            })
    }

    /// The call's steps as (algorithm, arguments), in enqueue order (see [`steps`]).
    fn calls(&self, args: &ExecuteArgs) -> Result<Vec<(Arc<dyn Algorithm>, ExecuteArgs)>> {
        let count = port_allreduce::check_args_of(NAME, args)?;
        if args.op == ReduceOp::Avg && !args.dtype.is_float() {
            let flat = self.flat.clone().ok_or_else(|| {
                Error::Unsupported(format!(
                    "{NAME}: the {} average over {} ranks needs one division of the whole sum \
                     (a hierarchical one truncates twice), and no flat all-reduce serves {} ranks",
                    args.dtype,
                    self.comm.size(),
                    self.comm.size()
                ))
            })?;
            return Ok(vec![(flat, *args)]);
        }
        let (k, local) = (self.host_comm.size(), self.host_comm.rank());
        let at = |base: u64, offset: usize| base + offset as u64;
        let cross: Arc<dyn Algorithm> = self.cross.clone();
        steps(count, args.dtype.size(), k, local)
            .into_iter()
            .map(|step| match step {
                Step::HostReduceScatter { chunk } => {
                    let a = ExecuteArgs {
                        input_bytes: k * chunk,
                        output: at(args.output, local * chunk),
                        output_bytes: chunk,
                        ..*args
                    };
                    Ok((self.host_algorithm(Collective::ReduceScatter, &a)?, a))
                }
                Step::CrossAllreduce { offset, bytes } => Ok((
                    cross.clone(),
                    ExecuteArgs {
                        input: at(args.output, offset),
                        output: at(args.output, offset),
                        input_bytes: bytes,
                        output_bytes: bytes,
                        ..*args
                    },
                )),
                Step::HostAllgather { chunk } => {
                    let a = ExecuteArgs {
                        input: at(args.output, local * chunk),
                        input_bytes: chunk,
                        output_bytes: k * chunk,
                        ..*args
                    };
                    Ok((self.host_algorithm(Collective::AllGather, &a)?, a))
                }
                Step::HostAllreduce { offset, bytes } => {
                    let a = ExecuteArgs {
                        input: at(args.input, offset),
                        output: at(args.output, offset),
                        input_bytes: bytes,
                        output_bytes: bytes,
                        ..*args
                    };
                    Ok((self.host_algorithm(Collective::AllReduce, &a)?, a))
                }
            })
            .collect()
    }
}

impl Algorithm for HierarchicalAllreduce {
    fn name(&self) -> &str {
        NAME
    }

    fn collective(&self) -> Collective {
        Collective::AllReduce
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        port_allreduce::check_args_of(NAME, args).map(|_| ())
    }

    /// Chooses and prepares (compiles, loads) every step's algorithm, enqueuing nothing.
    fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        self.comm.check(NAME)?;
        for (algo, a) in self.calls(args)? {
            algo.prepare(&a)?;
        }
        Ok(())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        self.comm.check(NAME)?;
        let calls = self.calls(args)?;
        // Every kernel of the call is loaded before the first step is enqueued: loading a kernel
        // may wait for the kernels running in this context (CUDA's lazy loading), among them the
        // cross-host exchange kernel, which waits for this process's Ethernet receiver, whose
        // copies into the device would then wait for the load: a hang.
        for (algo, a) in &calls {
            algo.prepare(a)?;
        }
        for (algo, a) in &calls {
            algo.execute(a)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    /// Which bytes each step touches, for every rank of a host: the reduce-scatter's shares tile
    /// the whole chunks, the cross steps cover each rank's share and the tail, and together the
    /// steps cover every byte of the message exactly once per phase.
    #[rstest]
    #[case(1, 4, 2)]
    #[case(3, 2, 4)]
    #[case(SPLIT_MIN_BYTES / 2, 2, 2)]
    #[case(SPLIT_MIN_BYTES / 2 - 1, 2, 2)]
    #[case(SPLIT_MIN_BYTES / 4 + 3, 4, 3)]
    #[case(SPLIT_MIN_BYTES, 1, 8)]
    #[case((1 << 30) / 2, 2, 8)]
    fn steps_cover_the_message(#[case] count: usize, #[case] es: usize, #[case] k: usize) {
        let bytes = count * es;
        for local in 0..k {
            let s = steps(count, es, k, local);
            let whole = if bytes >= SPLIT_MIN_BYTES {
                count / k
            } else {
                0
            };
            let chunk = whole * es;
            let mut want = Vec::new();
            if whole > 0 {
                want.push(Step::HostReduceScatter { chunk });
                want.push(Step::CrossAllreduce {
                    offset: local * chunk,
                    bytes: chunk,
                });
                want.push(Step::HostAllgather { chunk });
            }
            let done = k * chunk;
            if done < bytes {
                want.push(Step::HostAllreduce {
                    offset: done,
                    bytes: bytes - done,
                });
                want.push(Step::CrossAllreduce {
                    offset: done,
                    bytes: bytes - done,
                });
            }
            assert_eq!(s, want, "count {count} es {es} k {k} local {local}");
            // The tail is shorter than one element per local rank (or the whole small message).
            assert!(bytes < SPLIT_MIN_BYTES || bytes - done < k * es);
        }
    }

    /// Every rank of a host runs the same sequence of collectives (only offsets differ).
    #[test]
    fn every_local_rank_runs_the_same_collectives() {
        let kind = |s: &Step| std::mem::discriminant(s);
        for count in [1usize, 7, 40_000, 1 << 20, (1 << 20) + 5] {
            let first: Vec<_> = steps(count, 2, 4, 0).iter().map(kind).collect();
            for local in 1..4 {
                let other: Vec<_> = steps(count, 2, 4, local).iter().map(kind).collect();
                assert_eq!(first, other, "count {count}");
            }
        }
        assert!(steps(0, 4, 2, 0).is_empty());
    }

    /// The call's checks are the all-reduce's, naming this algorithm.
    #[test]
    fn bad_arguments_are_named() {
        use mscclpp_core::gpu::Stream;
        use mscclpp_core::{AccumType, DataType, ReduceOp};
        let args = ExecuteArgs {
            input: 0x1000,
            output: 0x2000,
            input_bytes: 64,
            output_bytes: 64,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            accum: AccumType::Auto,
            root: 0,
            stream: Stream::DEFAULT,
            nblocks: None,
            nthreads: None,
        };
        let check = |a: ExecuteArgs| port_allreduce::check_args_of(NAME, &a);
        assert_eq!(check(args).ok(), Some(16));
        let short = check(ExecuteArgs {
            output_bytes: 60,
            ..args
        });
        assert!(short.is_err_and(|e| e.to_string().contains(NAME)));
        let null = check(ExecuteArgs { output: 0, ..args });
        assert!(null.is_err_and(|e| e.to_string().contains("null output")));
        let ragged = check(ExecuteArgs {
            input_bytes: 6,
            ..args
        });
        assert!(ragged.is_err());
        let accum = check(ExecuteArgs {
            accum: AccumType::F16,
            ..args
        });
        assert!(accum
            .is_err_and(|e| matches!(e, Error::Unsupported(_)) && e.to_string().contains(NAME)));
        assert_eq!(
            check(ExecuteArgs {
                input_bytes: 0,
                input: 0,
                ..args
            })
            .ok(),
            Some(0)
        );
    }

    /// The host group's collection, built from a quarter of the default scratch, still has every
    /// part (the point-to-point region and the semaphores of a 132-SM or larger GPU taken out of
    /// the staging part), with room for the all-to-all tables, at every host size.
    #[test]
    fn the_host_groups_scratch_holds_a_collection() {
        use crate::native::NativeKind;
        use crate::resources::{private_tail_bytes, scratch_bounds};
        use mscclpp_core::device::D2DSemaphoreHandle;
        let s = host_scratch_bytes(crate::DEFAULT_SCRATCH_BYTES);
        for sm in [132u32, 256] {
            let blocks = NativeKind::ALL
                .iter()
                .map(|k| k.semaphore_blocks(sm))
                .max()
                .unwrap_or(0) as usize;
            for k in 2..=MAX_RANKS {
                let table = blocks * (k - 1) * std::mem::size_of::<D2DSemaphoreHandle>();
                let p2p = crate::p2p::plan::layout(k).region_bytes;
                let b = scratch_bounds(s, private_tail_bytes(table, p2p) + p2p);
                assert!(b.windows(2).all(|w| w[1] > w[0]), "{k} ranks: {b:?}");
                let staging = b[2] - b[1];
                assert!(
                    staging >= mscclpp_kernels_cu::alltoall::TABLE_SCRATCH_BYTES,
                    "{k} ranks: staging {staging}"
                );
            }
        }
    }

    #[test]
    fn scratch_shares_fit_the_budget() {
        let s = crate::DEFAULT_SCRATCH_BYTES;
        assert_eq!(host_scratch_bytes(s), 2 << 20);
        for n in 2..=MAX_RANKS {
            let seg = port_segment_bytes(s, n);
            assert_eq!(seg % 16, 0);
            assert!((2 * n + 1) * seg <= s, "{n} ranks");
            assert!((2 * n + 1) * (seg + 16) > s, "{n} ranks: not the largest");
        }
        assert_eq!(port_segment_bytes(0, 8), 16);
    }
}
