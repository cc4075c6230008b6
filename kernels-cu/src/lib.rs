//! The CUDA C++ device library of mscclpp-rs and the kernels built on it, embedded as text.
//!
//! Nothing here is compiled at build time: the backends hand [`HEADERS`] and a [`KernelSource`] to
//! the run-time compiler (NVRTC, hiprtc) for the exact GPU they run on. The device-handle structs
//! in the headers mirror `mscclpp_core::device`; see `docs/device-abi.md`.
//!
//! Kernel translation units are small on purpose: the all-reduce kernels are one unit per data
//! type (`simple_allreduce_<dtype>`), so a program compiles only the types it uses.

pub mod alltoall;
pub mod bench_data;
pub mod collectives;
pub mod ep;
pub mod executor;
pub mod fused_ops;
pub mod nvls_units;
pub mod p2p;

use mscclpp_core::{AccumType, DataType, Error, Result};

/// One kernel translation unit: `name` identifies it (logs, cache keys); `source` is complete
/// CUDA C++ that includes only [`HEADERS`] and the toolkit's own headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    pub name: &'static str,
    pub source: &'static str,
}

macro_rules! header {
    ($file:literal) => {
        (
            concat!("mscclpp/", $file),
            include_str!(concat!("../include/mscclpp/", $file)),
        )
    };
}

/// Every header of the device library as (include name, text). Include names are what the sources
/// write in `#include "..."`; a compiler gets them as in-memory headers.
pub const HEADERS: &[(&str, &str)] = &[
    header!("common.cuh"),
    header!("error.cuh"),
    header!("copy.cuh"),
    header!("packet.cuh"),
    header!("semaphore.cuh"),
    header!("memory_channel.cuh"),
    header!("fifo.cuh"),
    header!("port_channel.cuh"),
    header!("fp8.cuh"),
    header!("reduce.cuh"),
    header!("switch_channel.cuh"),
];

/// The all-reduce templates; each [`KERNELS`] entry for a data type appends its instantiation line.
#[cfg(test)]
const SIMPLE_ALLREDUCE: &str = include_str!("kernels/simple_allreduce.cu");

macro_rules! allreduce_unit {
    ($dtype:literal) => {
        KernelSource {
            name: concat!("simple_allreduce_", $dtype),
            source: concat!(
                include_str!("kernels/simple_allreduce.cu"),
                "\nMSCCLPP_ALLREDUCE_FOR_",
                $dtype,
                "()\n"
            ),
        }
    };
}

/// Every kernel translation unit. Names of the per-type units are
/// `simple_allreduce_<DataType::name()>`.
pub const KERNELS: &[KernelSource] = &[
    KernelSource {
        name: "primitives",
        source: include_str!("kernels/primitives.cu"),
    },
    KernelSource {
        name: "switch_channel",
        source: include_str!("kernels/switch_channel.cu"),
    },
    allreduce_unit!("f32"),
    allreduce_unit!("f16"),
    allreduce_unit!("bf16"),
    allreduce_unit!("f64"),
    allreduce_unit!("i8"),
    allreduce_unit!("u8"),
    allreduce_unit!("i32"),
    allreduce_unit!("u32"),
    allreduce_unit!("i64"),
    allreduce_unit!("u64"),
    allreduce_unit!("fp8_e4m3"),
    allreduce_unit!("fp8_e4m3fnuz"),
    allreduce_unit!("fp8_e5m2"),
    allreduce_unit!("fp8_e4m3b15"),
];

/// The units of [`KERNELS`] whose code differs from GPU target to GPU target on every vendor: the
/// channel primitives' and multicast's inline device code, 16-bit float arithmetic (the vendors'
/// per-architecture intrinsics), and fp8 (OCP e4m3: hardware conversions on sm_89+, software
/// elsewhere). The compile gates optimise these for every target they check and put the other
/// per-type units (the same templates with other arithmetic) through the front end where the
/// target is not their primary one.
pub const TARGET_DEPENDENT_KERNELS: [&str; 6] = [
    "primitives",
    "switch_channel",
    "simple_allreduce_f32",
    "simple_allreduce_f16",
    "simple_allreduce_bf16",
    "simple_allreduce_fp8_e4m3",
];

/// Kernel entry points of the `primitives` unit.
pub const PRIMITIVE_KERNELS: &[&str] = &[
    "memory_channel_ping_pong",
    "memory_channel_get",
    "ll_packet_exchange_ll16",
    "ll_packet_exchange_ll8",
    "semaphore_stress",
    "port_channel_put_signal",
];

/// Kernel entry points of the `switch_channel` unit (NVLS; compiled in CI, launched only behind
/// the NVLS gate).
pub const SWITCH_CHANNEL_KERNELS: &[&str] = &[
    "switch_channel_reduce_broadcast_f32",
    "switch_channel_reduce_broadcast_f16",
    "switch_channel_reduce_broadcast_bf16",
];

/// The text of header `name` (e.g. `mscclpp/packet.cuh`).
pub fn header(name: &str) -> Option<&'static str> {
    HEADERS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, text)| *text)
}

/// The kernel translation unit called `name`.
pub fn kernel(name: &str) -> Option<&'static KernelSource> {
    KERNELS.iter().find(|k| k.name == name)
}

/// The two all-reduce kernels of `simple_allreduce.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllreduceKernel {
    /// One-pass LL16 packet exchange (small messages).
    Packet,
    /// put + semaphore rounds + local reduction (large messages).
    Put,
}

impl AllreduceKernel {
    pub const ALL: [AllreduceKernel; 2] = [AllreduceKernel::Packet, AllreduceKernel::Put];

    fn prefix(self) -> &'static str {
        match self {
            AllreduceKernel::Packet => "simple_allreduce_packet_",
            AllreduceKernel::Put => "simple_allreduce_",
        }
    }
}

/// The translation unit and entry-point name of an all-reduce kernel for `dtype` accumulating in
/// `acc`. Errors name the combination when no kernel exists for it (integer inputs with a float
/// accumulator, or an accumulator narrower than the input).
pub fn allreduce_entry_point(
    kind: AllreduceKernel,
    dtype: DataType,
    acc: AccumType,
) -> Result<(&'static KernelSource, String)> {
    let resolved = acc.resolve(dtype)?;
    let suffix = if resolved == dtype {
        ""
    } else {
        match (resolved, dtype) {
            (DataType::F16, DataType::Bf16) => "_acc_f16",
            (DataType::F16, d) if d.is_fp8() => "_acc_f16",
            (DataType::F32, DataType::F16 | DataType::Bf16) => "_acc_f32",
            (DataType::F32, d) if d.is_fp8() => "_acc_f32",
            _ => {
                return Err(Error::Unsupported(format!(
                    "all-reduce of {dtype} accumulating in {resolved}: the accumulator would be \
                     narrower than the data"
                )))
            }
        }
    };
    let unit_name = format!("simple_allreduce_{}", dtype.name());
    let unit = kernel(&unit_name).ok_or_else(|| {
        Error::Internal(format!(
            "kernel translation unit {unit_name} is not embedded"
        ))
    })?;
    Ok((unit, format!("{}{}{}", kind.prefix(), dtype.name(), suffix)))
}

/// Bytes of scratch (per rank, local) the packet all-reduce needs for `count` elements of `dtype`
/// on `nranks` ranks: two flag-parity halves of `nranks` LL16 slots.
pub fn allreduce_packet_scratch_bytes(dtype: DataType, count: usize, nranks: usize) -> usize {
    let packets = (count * dtype.size()).div_ceil(8);
    2 * nranks * packets * 16
}

/// Bytes of scratch (per rank, local) the put all-reduce needs: `nranks` slots of the data size
/// rounded up to 16 bytes.
pub fn allreduce_put_scratch_bytes(dtype: DataType, count: usize, nranks: usize) -> usize {
    nranks * (count * dtype.size()).next_multiple_of(16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;
    use std::collections::BTreeSet;
    use std::path::Path;

    fn includes(text: &str) -> Vec<&str> {
        text.lines()
            .filter_map(|l| l.trim().strip_prefix("#include \"mscclpp/"))
            .filter_map(|rest| rest.strip_suffix('"'))
            .collect()
    }

    #[test]
    fn every_header_on_disk_is_embedded() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/mscclpp");
        let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|e| format!("mscclpp/{}", e.unwrap().file_name().to_string_lossy()))
            .collect();
        let embedded: BTreeSet<String> = HEADERS.iter().map(|(n, _)| n.to_string()).collect();
        assert_eq!(on_disk, embedded);
    }

    /// A kernel reads the error word at entry once per block (`block_aborted`): warps that read it
    /// apart can disagree, meet different barriers and run on past an error the others saw (a p2p
    /// receiver copied part of a chunk it had refused). Waits inside one thread (spin_until) are the
    /// headers' business.
    #[test]
    fn kernels_read_the_error_word_once_per_block() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels");
        let mut checked = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "cu") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for (i, line) in text.lines().enumerate() {
                let bare = line.replace("block_aborted(", "");
                assert!(
                    !bare.contains("aborted("),
                    "{}:{}: a per-thread aborted() read; use block_aborted: {line}",
                    path.display(),
                    i + 1
                );
            }
            checked += 1;
        }
        assert!(
            checked > 5,
            "only {checked} kernel files in {}",
            dir.display()
        );
    }

    #[test]
    fn every_include_resolves_to_an_embedded_header() {
        let texts = HEADERS
            .iter()
            .map(|(n, t)| (*n, *t))
            .chain(KERNELS.iter().map(|k| (k.name, k.source)));
        for (name, text) in texts {
            for inc in includes(text) {
                assert!(
                    header(&format!("mscclpp/{inc}")).is_some(),
                    "{name} includes mscclpp/{inc}, which is not in HEADERS"
                );
            }
        }
    }

    #[test]
    fn primitives_include_every_header() {
        let prim = kernel("primitives").expect("primitives unit");
        let used: BTreeSet<String> = includes(prim.source)
            .into_iter()
            .map(|i| format!("mscclpp/{i}"))
            .collect();
        for (name, _) in HEADERS {
            // fp8.cuh comes in through reduce.cuh; switch_channel.cuh (NVLS) has its own unit.
            if *name != "mscclpp/fp8.cuh" && *name != "mscclpp/switch_channel.cuh" {
                assert!(
                    used.contains(*name),
                    "primitives.cu does not include {name}"
                );
            }
        }
        for k in PRIMITIVE_KERNELS {
            assert!(
                prim.source.contains(&format!("void {k}(")),
                "entry point {k} missing from primitives.cu"
            );
        }
    }

    #[test]
    fn switch_channel_unit_defines_its_entry_points() {
        let unit = kernel("switch_channel").expect("switch_channel unit");
        assert!(includes(unit.source).contains(&"switch_channel.cuh"));
        for k in SWITCH_CHANNEL_KERNELS {
            assert!(
                unit.source.contains(&format!("void {k}(")),
                "entry point {k} missing from switch_channel.cu"
            );
        }
        let header = header("mscclpp/switch_channel.cuh").expect("header");
        // The multimem paths exist only for sm_90+, with a trap otherwise.
        assert!(header.contains("__CUDA_ARCH__ >= 900"));
        assert!(header.contains("multimem.ld_reduce.relaxed.sys.global.add.v4.bf16x2"));
        assert!(header.contains("multimem.st.relaxed.sys.global.v4.f32"));
        assert!(header.contains("__trap()"));
    }

    #[test]
    fn one_allreduce_unit_per_dtype_with_its_instantiation() {
        for dtype in DataType::ALL {
            let unit = kernel(&format!("simple_allreduce_{dtype}"))
                .unwrap_or_else(|| panic!("no all-reduce unit for {dtype}"));
            let line = format!("MSCCLPP_ALLREDUCE_FOR_{}()", dtype.name());
            assert!(unit.source.trim_end().ends_with(&line), "{}", unit.name);
            assert!(
                SIMPLE_ALLREDUCE.contains(&format!("#define {line}")),
                "simple_allreduce.cu does not define {line}"
            );
        }
    }

    #[rstest]
    #[case(DataType::Bf16, AccumType::Auto, "simple_allreduce_packet_bf16")]
    #[case(DataType::Bf16, AccumType::F32, "simple_allreduce_packet_bf16_acc_f32")]
    #[case(
        DataType::Fp8E4M3,
        AccumType::F16,
        "simple_allreduce_packet_fp8_e4m3_acc_f16"
    )]
    #[case(DataType::F16, AccumType::F16, "simple_allreduce_packet_f16")]
    #[case(DataType::F32, AccumType::F32, "simple_allreduce_packet_f32")]
    #[case(DataType::U64, AccumType::Auto, "simple_allreduce_packet_u64")]
    fn entry_point_names(#[case] dtype: DataType, #[case] acc: AccumType, #[case] want: &str) {
        let (unit, name) =
            allreduce_entry_point(AllreduceKernel::Packet, dtype, acc).expect("entry point");
        assert_eq!(name, want);
        assert_eq!(unit.name, format!("simple_allreduce_{dtype}"));
        let (_, put) = allreduce_entry_point(AllreduceKernel::Put, dtype, acc).expect("entry");
        assert_eq!(put, want.replace("packet_", ""));
    }

    #[rstest]
    #[case(DataType::I32, AccumType::F32)]
    #[case(DataType::F64, AccumType::F32)]
    #[case(DataType::F32, AccumType::F16)]
    fn impossible_accumulators_are_refused(#[case] dtype: DataType, #[case] acc: AccumType) {
        let err = allreduce_entry_point(AllreduceKernel::Put, dtype, acc).unwrap_err();
        assert!(err.to_string().contains(dtype.name()), "{err}");
    }

    #[test]
    fn scratch_sizes() {
        // 3 bf16 = 6 bytes -> one LL16 packet per slot.
        assert_eq!(
            allreduce_packet_scratch_bytes(DataType::Bf16, 3, 4),
            2 * 4 * 16
        );
        assert_eq!(allreduce_put_scratch_bytes(DataType::Bf16, 3, 4), 4 * 16);
        assert_eq!(allreduce_put_scratch_bytes(DataType::F32, 8, 2), 2 * 32);
    }
}
