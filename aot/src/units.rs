//! The kernel units the blob holds, each named and written by the function the runtime builds it
//! with, so that the key of an embedded image is the key of the runtime's request.
//!
//! Who loads what: the native collectives (`mscclpp-collectives`' `KernelTable`: one unit per
//! collective file, the reducing files one per (type, accumulator, op)), the port-channel
//! all-reduce (one per reduce spec), the NVLS all-reduce (one per type) and the plan executor's
//! interpreter (one per (type, accumulator, op, plan features)). A plan whose program is compiled
//! into its unit (few data ops), and a user's `compile_native` source, exist only at run time:
//! NVRTC compiles those.
//!
//! [`UnitSet::Default`] is what programs use, 137 units an architecture (134 for AMD). Every
//! variant would be 1,448, eleven times the compiles and the bytes (the plan interpreter's 960, one
//! per type, op and feature set, are most of them); the rest compile at run time on first use,
//! once per machine (the disk cache).

use mscclpp_collectives::port_allreduce;
use mscclpp_core::{AccumType, DataType, ReduceOp, Result};
use mscclpp_kernels_cu::bench_data;
use mscclpp_kernels_cu::collectives::{self as kc, CollectiveFile, ReduceSpec};
use mscclpp_kernels_cu::executor::{self as kx, PlanFeatures};
use mscclpp_kernels_cu::nvls_units::{nvls_unit_name, nvls_unit_source, NVLS_DTYPES};

/// One translation unit, as `build_module` gets it.
#[derive(Debug, Clone)]
pub struct Unit {
    /// The kernel file it is a variant of: a blob frame holds one family's images for one
    /// architecture (they compress well together).
    pub family: &'static str,
    pub name: String,
    pub source: String,
}

/// Which variants to compile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitSet {
    /// What training and serving programs reduce: f32, f16 and bf16 (each in its own type, the
    /// 16-bit ones also in f32) with sum, average, min and max, and i32/i64 (counters, token
    /// counts) with sum, min and max; the plan interpreter for f32, f16 and bf16 sums.
    Default,
    /// Every variant the runtime can load (see the module docs for why this is not the default).
    All,
}

impl UnitSet {
    /// The reduce specs of the reducing collective units and the port-channel all-reduce.
    fn reduce_specs(self) -> Vec<ReduceSpec> {
        let mut out = Vec::new();
        for (dtype, acc) in kc::reduce_type_pairs() {
            for op in ReduceOp::ALL {
                let floats = [DataType::F32, DataType::F16, DataType::Bf16];
                let common = match self {
                    UnitSet::All => true,
                    UnitSet::Default if floats.contains(&dtype) => {
                        (acc == dtype || acc == DataType::F32) && op != ReduceOp::Prod
                    }
                    UnitSet::Default => {
                        matches!(dtype, DataType::I32 | DataType::I64)
                            && matches!(op, ReduceOp::Sum | ReduceOp::Min | ReduceOp::Max)
                    }
                };
                if common {
                    out.push(ReduceSpec { dtype, acc, op });
                }
            }
        }
        out
    }

    /// The (type, op) pairs of the plan interpreter's units (each for every feature set).
    fn plan_variants(self) -> Vec<(DataType, AccumType, ReduceOp)> {
        match self {
            UnitSet::Default => [DataType::F32, DataType::F16, DataType::Bf16]
                .into_iter()
                .map(|d| (d, AccumType::Auto, ReduceOp::Sum))
                .collect(),
            UnitSet::All => self
                .reduce_specs()
                .into_iter()
                .map(|s| {
                    let accum = kc::acc_request(s.dtype, s.acc).expect("a pair the table offers");
                    (s.dtype, accum, s.op)
                })
                .collect(),
        }
    }
}

/// Every feature combination a plan can have (`PlanFeatures::mask` 0 to 7).
fn every_plan_features() -> impl Iterator<Item = PlanFeatures> {
    (0u32..8).map(|m| PlanFeatures {
        packets: m & 1 != 0,
        ports: m & 2 != 0,
        pipelines: m & 4 != 0,
    })
}

/// The units of `set`, family by family: for AMD GPUs (`hip`) all but the NVLS all-reduce, which
/// needs NVLink multicast.
pub fn units(set: UnitSet, hip: bool) -> Result<Vec<Unit>> {
    let mut out = Vec::new();
    let specs = set.reduce_specs();
    for file in CollectiveFile::ALL {
        let family = file.stem();
        if !file.reduces() {
            out.push(Unit {
                family,
                name: kc::unit_name(file, None),
                source: kc::unit_source(file, None)?,
            });
            continue;
        }
        for &spec in &specs {
            out.push(Unit {
                family,
                name: kc::unit_name(file, Some(spec)),
                source: kc::unit_source(file, Some(spec))?,
            });
        }
    }
    for &spec in &specs {
        out.push(Unit {
            family: "port_allreduce",
            name: port_allreduce::unit_name(spec),
            source: port_allreduce::unit_source(spec),
        });
    }
    for dtype in NVLS_DTYPES.into_iter().filter(|_| !hip) {
        out.push(Unit {
            family: "allreduce_nvls",
            name: nvls_unit_name(dtype)?,
            source: nvls_unit_source(dtype)?,
        });
    }
    // The benchmark's inputs and checks: the main job runs them before anything else.
    out.push(Unit {
        family: "bench_data",
        name: bench_data::UNIT_NAME.to_string(),
        source: bench_data::SOURCE.to_string(),
    });
    for (dtype, accum, op) in set.plan_variants() {
        for features in every_plan_features() {
            let (name, source) = kx::unit_source(dtype, accum, op, features)?;
            out.push(Unit {
                family: "plan_executor",
                name,
                source,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn names_are_unique_and_the_default_is_a_subset() {
        let all = units(UnitSet::All, false).expect("all");
        let names: HashSet<&str> = all.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names.len(), all.len(), "a unit name repeats");
        // The byte-oriented units: every file that does not reduce, one unit each.
        let plain = CollectiveFile::ALL.iter().filter(|f| !f.reduces()).count();
        assert_eq!(all.len(), plain + 3 * 120 + 120 + 3 + 1 + 120 * 8);
        let default = units(UnitSet::Default, false).expect("default");
        assert!(default.iter().all(|u| names.contains(u.name.as_str())));
        // f32, f16, bf16 in their own type and f16, bf16 in f32 (5 pairs) x 4 ops, and i32, i64 x
        // 3 ops: 26 specs, each in the 3 reducing files and the port-channel all-reduce.
        assert_eq!(default.len(), plain + 4 * 26 + 3 + 1 + 3 * 8);
        let hip = units(UnitSet::Default, true).expect("hip");
        assert_eq!(hip.len(), default.len() - 3, "all but the three NVLS units");
        assert!(hip.iter().all(|u| u.family != "allreduce_nvls"));
    }

    /// The units the README's first programs run are embedded: a bf16 sum all-reduce
    /// (the benchmark's default and the Python example's), accumulating in bf16 or f32.
    #[test]
    fn the_default_holds_the_first_programs_units() {
        let default = units(UnitSet::Default, false).expect("default");
        for acc in [DataType::Bf16, DataType::F32] {
            let spec = ReduceSpec {
                dtype: DataType::Bf16,
                acc,
                op: ReduceOp::Sum,
            };
            let name = kc::unit_name(CollectiveFile::AllReduce, Some(spec));
            assert!(default.iter().any(|u| u.name == name), "{name}");
        }
    }
}
