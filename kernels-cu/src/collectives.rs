//! The native collective kernels (all-reduce, all-gather, reduce-scatter, broadcast, reduce) as run-time
//! compiled translation units.
//!
//! Each unit is `collective_common.cuh` followed by one kernel file. Reducing units are built for
//! one (data type, accumulation type, op) triple, selected by `#define`s put in front, so a program
//! compiles exactly the variants it uses and each variant is its own cache entry. Every kernel takes
//! one `#[repr(C)]` argument struct of its family ([`PacketArgs`], [`PipelineArgs`],
//! [`ZeroCopyArgs`], [`CopyEngineArgs`], declared in `mscclpp_core::device` next to the channel
//! handles); [`layout_asserts`] turns their Rust layout and [`CallState`]'s into static_asserts that
//! a test compiles through NVRTC.

use mscclpp_core::{AccumType, DataType, Error, ReduceOp, Result};

/// Shared device code, prepended to every unit.
pub const COMMON: &str = include_str!("kernels/collective_common.cuh");
/// All-reduce kernels (reducing).
pub const ALLREDUCE: &str = include_str!("kernels/allreduce.cu");
/// All-gather kernels (byte-oriented).
pub const ALLGATHER: &str = include_str!("kernels/allgather.cu");
/// Reduce-scatter kernels (reducing).
pub const REDUCE_SCATTER: &str = include_str!("kernels/reduce_scatter.cu");
/// Broadcast kernels (byte-oriented).
pub const BROADCAST: &str = include_str!("kernels/broadcast.cu");
/// Reduce (to one root) kernels (reducing).
pub const REDUCE: &str = include_str!("kernels/reduce.cu");

pub use mscclpp_core::device::{
    CopyEngineArgs, PacketArgs, PeerPtrs, PipelineArgs, PortAllreduceArgs, ZeroCopyArgs,
    COLL_MAX_RANKS as MAX_RANKS,
};
/// All-to-all family kernels (byte-oriented; see `crate::alltoall`).
pub const ALLTOALL: &str = include_str!("kernels/alltoall.cu");
/// The point-to-point engine's kernel (byte-oriented; see `crate::p2p`).
pub const P2P: &str = include_str!("kernels/p2p.cu");
/// Expert-parallel dispatch and combine, intranode (see `crate::ep`).
pub const EP_INTRANODE: &str = include_str!("kernels/ep_intranode.cu");

/// Largest grid of a kernel that uses [`CallState`] (`coll::kMaxPacketBlocks`); hosts must cap the
/// packet kernels' grids at this.
pub const MAX_PACKET_BLOCKS: usize = 1024;

/// `coll::CallState`: device-resident call counter of one algorithm object, one slot per block
/// (zero-initialised). Each call advances every slot exactly once, whatever its grid size, so the
/// kernels need no cross-block atomics (see collective_common.cuh).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallState {
    pub calls: [u64; MAX_PACKET_BLOCKS],
}

impl Default for CallState {
    fn default() -> Self {
        CallState {
            calls: [0; MAX_PACKET_BLOCKS],
        }
    }
}

/// Entry points built for CUDA only (`#if !defined(MSCCLPP_HIP)` in their .cu file):
/// `allreduce_rsag_push` has not run on an AMD GPU and is never selected by default, and its
/// instance of the scratch pipeline doubles the all-reduce unit's compile time, which the ROCm
/// compile gate would pay for every type pair; `allreduce_allpair_ll128` has not run on an AMD GPU
/// either (where an LL128 line carries 64 bytes, not 120). On AMD the collection leaves their
/// algorithms out.
pub const CUDA_ONLY_ENTRY_POINTS: &[&str] = &["allreduce_rsag_push", "allreduce_allpair_ll128"];

/// The kernel files, one per collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveFile {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
    P2p,
    Reduce,
    EpIntranode,
}

impl CollectiveFile {
    pub const ALL: [CollectiveFile; 8] = [
        CollectiveFile::AllReduce,
        CollectiveFile::AllGather,
        CollectiveFile::ReduceScatter,
        CollectiveFile::Broadcast,
        CollectiveFile::AllToAll,
        CollectiveFile::P2p,
        CollectiveFile::Reduce,
        CollectiveFile::EpIntranode,
    ];

    pub const fn source(self) -> &'static str {
        match self {
            CollectiveFile::AllReduce => ALLREDUCE,
            CollectiveFile::AllGather => ALLGATHER,
            CollectiveFile::ReduceScatter => REDUCE_SCATTER,
            CollectiveFile::Broadcast => BROADCAST,
            CollectiveFile::AllToAll => ALLTOALL,
            CollectiveFile::P2p => P2P,
            CollectiveFile::Reduce => REDUCE,
            CollectiveFile::EpIntranode => EP_INTRANODE,
        }
    }

    pub const fn stem(self) -> &'static str {
        match self {
            CollectiveFile::AllReduce => "allreduce",
            CollectiveFile::AllGather => "allgather",
            CollectiveFile::ReduceScatter => "reduce_scatter",
            CollectiveFile::Broadcast => "broadcast",
            CollectiveFile::AllToAll => "alltoall",
            CollectiveFile::P2p => "p2p",
            CollectiveFile::Reduce => "reduce",
            CollectiveFile::EpIntranode => "ep_intranode",
        }
    }

    /// Whether units of this file are specialised per (dtype, accumulation, op).
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            CollectiveFile::AllReduce | CollectiveFile::ReduceScatter | CollectiveFile::Reduce
        )
    }

    /// The kernel entry points the file defines (on ROCm less [`CUDA_ONLY_ENTRY_POINTS`]).
    pub const fn entry_points(self) -> &'static [&'static str] {
        match self {
            CollectiveFile::AllReduce => &[
                "allreduce_allpair_packet",
                "allreduce_allpair_ll128",
                "allreduce_packet",
                "allreduce_rsag_zero_copy",
                "allreduce_rsag",
                "allreduce_rsag_push",
                "allreduce_fullmesh",
                "allreduce_ce_reduce",
                "allreduce_ce_sync",
            ],
            CollectiveFile::AllGather => &[
                "allgather_packet",
                "allgather_fullmesh2",
                "allgather_fullmesh",
            ],
            CollectiveFile::ReduceScatter => &["reducescatter_packet", "reducescatter_zero_copy"],
            CollectiveFile::Broadcast => &["broadcast_zero_copy"],
            CollectiveFile::AllToAll => &[
                "alltoallv_zero_copy",
                "alltoallv_zero_copy_pull",
                "alltoallv_zero_copy_swap",
                "alltoallv_device_counts",
                "alltoall_packet",
            ],
            CollectiveFile::P2p => &["p2p_group", "p2p_port_group"],
            CollectiveFile::Reduce => &["reduce_zero_copy"],
            CollectiveFile::EpIntranode => &["ep_notify", "ep_reset", "ep_dispatch", "ep_combine"],
        }
    }
}

/// What a reducing unit is specialised for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReduceSpec {
    pub dtype: DataType,
    /// The resolved accumulation type (see [`resolve_accumulator`]).
    pub acc: DataType,
    pub op: ReduceOp,
}

/// The device library's C++ name of `dtype`.
pub const fn cxx_type(dtype: DataType) -> &'static str {
    match dtype {
        DataType::F32 => "float",
        DataType::F64 => "double",
        DataType::F16 => "f16",
        DataType::Bf16 => "bf16",
        DataType::I8 => "i8",
        DataType::U8 => "u8",
        DataType::I32 => "i32",
        DataType::U32 => "u32",
        DataType::I64 => "i64",
        DataType::U64 => "u64",
        DataType::Fp8E4M3 => "fp8_e4m3",
        DataType::Fp8E4M3Fnuz => "fp8_e4m3fnuz",
        DataType::Fp8E5M2 => "fp8_e5m2",
        DataType::Fp8E4M3B15 => "fp8_e4m3b15",
    }
}

/// The accumulation type reductions of `dtype` run in for `accum`. Only widening is offered: `Auto`
/// (the input type), F32 for f16/bf16/fp8, F16 for fp8. Anything else is `Error::Unsupported`
/// naming the pair, so a caller never gets a silently narrowed result.
pub fn resolve_accumulator(dtype: DataType, accum: AccumType) -> Result<DataType> {
    let acc = accum.resolve(dtype)?;
    let ok = acc == dtype
        || (acc == DataType::F32 && matches!(dtype, DataType::F16 | DataType::Bf16))
        || (acc == DataType::F32 && dtype.is_fp8())
        || (acc == DataType::F16 && dtype.is_fp8());
    if ok {
        Ok(acc)
    } else {
        Err(Error::Unsupported(format!(
            "reducing {dtype} while accumulating in {acc}: only wider accumulators are offered \
             (f32 for f16/bf16/fp8, f16 for fp8)"
        )))
    }
}

/// Name (logs, kernel cache) of the unit of `file` for `spec` (ignored by byte-oriented files).
pub fn unit_name(file: CollectiveFile, spec: Option<ReduceSpec>) -> String {
    match (file.reduces(), spec) {
        (true, Some(s)) => format!(
            "coll_{}_{}_acc_{}_{}",
            file.stem(),
            s.dtype.name(),
            s.acc.name(),
            s.op.name()
        ),
        _ => format!("coll_{}", file.stem()),
    }
}

/// The complete source of the unit of `file` for `spec`. Reducing files need a spec (else
/// `Error::InvalidArgument`); its accumulator must come from [`resolve_accumulator`].
pub fn unit_source(file: CollectiveFile, spec: Option<ReduceSpec>) -> Result<String> {
    let mut text = String::with_capacity(COMMON.len() + file.source().len() + 256);
    if file.reduces() {
        let s = spec.ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the {} kernels reduce: a (dtype, accumulator, op) is needed",
                file.stem()
            ))
        })?;
        resolve_accumulator(s.dtype, acc_request(s.dtype, s.acc)?)?;
        text.push_str(&format!(
            "#define MSCCLPP_COLL_T {}\n#define MSCCLPP_COLL_ACC {}\n#define MSCCLPP_COLL_OP {}\n",
            cxx_type(s.dtype),
            cxx_type(s.acc),
            s.op.to_nccl()
        ));
    }
    text.push_str(COMMON);
    text.push('\n');
    text.push_str(file.source());
    Ok(text)
}

/// The [`AccumType`] that resolves to `acc` for `dtype` (used to re-validate a spec).
pub fn acc_request(dtype: DataType, acc: DataType) -> Result<AccumType> {
    match acc {
        a if a == dtype => Ok(AccumType::Auto),
        DataType::F32 => Ok(AccumType::F32),
        DataType::F16 => Ok(AccumType::F16),
        other => Err(Error::Unsupported(format!(
            "accumulating {dtype} in {other}"
        ))),
    }
}

/// Every (dtype, accumulator) pair the reducing units are offered for.
pub fn reduce_type_pairs() -> Vec<(DataType, DataType)> {
    let mut out = Vec::new();
    for dtype in DataType::ALL {
        for accum in [AccumType::Auto, AccumType::F16, AccumType::F32] {
            if let Ok(acc) = resolve_accumulator(dtype, accum) {
                if !out.contains(&(dtype, acc)) {
                    out.push((dtype, acc));
                }
            }
        }
    }
    out
}

/// A CUDA snippet of static_asserts checking the kernels' view of the argument structs,
/// [`CallState`] and the limits against the Rust side; append it to any unit and compile.
pub fn layout_asserts() -> String {
    format!(
        "{}static_assert(sizeof(mscclpp::coll::CallState) == {}, \"CallState size\");\n\
         static_assert(mscclpp::coll::kMaxRanks == {}, \"kMaxRanks\");\n\
         static_assert(mscclpp::coll::kMaxPacketBlocks == {}, \"kMaxPacketBlocks\");\n",
        mscclpp_core::device::collective_layout_static_asserts(),
        std::mem::size_of::<CallState>(),
        MAX_RANKS,
        MAX_PACKET_BLOCKS
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[test]
    fn every_kernel_waits_for_the_prior_grid_first() {
        // The native collectives launch every kernel programmatically (it may start before the
        // stream's previous kernel ends), which is only safe if it waits before touching memory.
        for file in CollectiveFile::ALL {
            let src = file.source();
            let mut rest = src;
            let mut kernels = 0;
            while let Some(at) = rest.find("extern \"C\" __global__") {
                let body = &rest[at..];
                let open = body.find('{').expect("kernel body");
                let first = body[open + 1..].trim_start();
                // The name is the identifier before the parameter list (the header's last
                // parenthesised group; `__launch_bounds__(...)` comes earlier).
                let header = body[..open].trim_end();
                let mut depth = 0;
                let params = header
                    .char_indices()
                    .rev()
                    .find(|&(_, c)| {
                        depth += match c {
                            ')' => 1,
                            '(' => -1,
                            _ => 0,
                        };
                        c == '(' && depth == 0
                    })
                    .map_or(0, |(i, _)| i);
                let name = header[..params].split_whitespace().last().unwrap_or("?");
                assert!(
                    first.starts_with("wait_prior_grids();"),
                    "{}.cu: `{name}` must begin with wait_prior_grids()",
                    file.stem()
                );
                kernels += 1;
                rest = &body[open..];
            }
            assert!(kernels >= file.entry_points().len(), "{}.cu", file.stem());
        }
    }

    #[test]
    fn every_entry_point_is_defined_by_its_file() {
        for file in CollectiveFile::ALL {
            for e in file.entry_points() {
                assert!(
                    file.source().contains(&format!("{e}(")),
                    "{e} missing from {}.cu",
                    file.stem()
                );
            }
        }
    }

    #[rstest]
    #[case(DataType::F16, AccumType::F32, Some(DataType::F32))]
    #[case(DataType::Bf16, AccumType::Auto, Some(DataType::Bf16))]
    #[case(DataType::Fp8E4M3, AccumType::F16, Some(DataType::F16))]
    #[case(DataType::Fp8E5M2, AccumType::F32, Some(DataType::F32))]
    #[case(DataType::F32, AccumType::F16, None)]
    #[case(DataType::F64, AccumType::F32, None)]
    #[case(DataType::Bf16, AccumType::F16, None)]
    #[case(DataType::I32, AccumType::F32, None)]
    fn accumulators(#[case] d: DataType, #[case] a: AccumType, #[case] want: Option<DataType>) {
        match (resolve_accumulator(d, a), want) {
            (Ok(got), Some(w)) => assert_eq!(got, w),
            (Err(e), None) => {
                assert!(matches!(e, Error::Unsupported(_)), "{e}");
                assert!(e.to_string().contains(d.name()), "{e}");
            }
            (got, want) => panic!("{d} {a:?}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn reducing_units_need_a_spec_and_carry_it() {
        assert!(unit_source(CollectiveFile::AllReduce, None).is_err());
        let spec = ReduceSpec {
            dtype: DataType::Bf16,
            acc: DataType::F32,
            op: ReduceOp::Min,
        };
        let src = unit_source(CollectiveFile::AllReduce, Some(spec)).expect("unit");
        assert!(src.starts_with(
            "#define MSCCLPP_COLL_T bf16\n#define MSCCLPP_COLL_ACC float\n#define MSCCLPP_COLL_OP 3\n"
        ));
        assert_eq!(
            unit_name(CollectiveFile::AllReduce, Some(spec)),
            "coll_allreduce_bf16_acc_f32_min"
        );
        let bad = ReduceSpec {
            dtype: DataType::F32,
            acc: DataType::F16,
            op: ReduceOp::Sum,
        };
        assert!(unit_source(CollectiveFile::ReduceScatter, Some(bad)).is_err());
        let ag = unit_source(CollectiveFile::AllGather, None).expect("unit");
        assert!(!ag.contains("#define MSCCLPP_COLL_T"));
        assert_eq!(
            unit_name(CollectiveFile::AllGather, Some(spec)),
            "coll_allgather"
        );
    }

    #[test]
    fn pairs_cover_every_type() {
        let pairs = reduce_type_pairs();
        for d in DataType::ALL {
            assert!(pairs.contains(&(d, d)), "{d}");
        }
        assert_eq!(pairs.len(), 14 + 2 + 4 * 2);
    }

    #[test]
    fn peer_ptrs_bounds() {
        assert_eq!(std::mem::size_of::<PeerPtrs>(), 64);
        assert_eq!(std::mem::size_of::<CallState>(), 8 * MAX_PACKET_BLOCKS);
        assert!(CallState::default().calls.iter().all(|&c| c == 0));
        let p = PeerPtrs::from_slice(&[1, 2, 3]).expect("3 ranks");
        assert_eq!(&p.p[..4], &[1, 2, 3, 0]);
        assert!(PeerPtrs::from_slice(&[0; 9]).is_err());
    }
}
