//! Where plans come from, as MSCCL++ finds them — a file, a directory of `*.json` plans, or, by
//! default, `MSCCLPP_EXECUTION_PLAN_DIR` and the plan cache under `MSCCLPP_CACHE_DIR` (its
//! `default/` folder, where the DSL's plans are installed, and the folder itself) — and how
//! they join an algorithm collection: as [`PlanAlgorithm`]s under their names, with a selector
//! that prefers a plan whose collective, world size and message range match the call and
//! otherwise asks the selector it wraps.

use crate::algorithm::PlanAlgorithm;
use crate::error::PlanError;
use crate::plan::Plan;
use mscclpp_core::algorithm::{Algorithm, Collective};
use mscclpp_core::algorithm_collection::{AlgorithmCollectionBuilder, SelectionContext, Selector};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::env::Env;
use mscclpp_core::{Error, ReduceOp, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The plan files at `path`: the file itself, or the `*.json` files of a directory, sorted.
pub fn plan_files(path: &Path) -> std::result::Result<Vec<PathBuf>, PlanError> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries = std::fs::read_dir(path)
        .map_err(|e| PlanError::new("", format!("{}: {e}", path.display())))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    Ok(files)
}

/// The directories plans are looked for in when none is given (those that exist):
/// `MSCCLPP_EXECUTION_PLAN_DIR` and the cache's `default/` (`python -m mscclpp --install`). Not
/// the cache itself: `mscclpp.compile` keeps every plan it compiled there, and a plan a program
/// compiled but did not register must not serve its calls (nor a later program's).
pub fn default_plan_dirs(env: &Env) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = env.execution_plan_dir.iter().cloned().collect();
    dirs.push(env.cache_dir.join("default"));
    dirs.into_iter().filter(|d| d.is_dir()).collect()
}

/// Loads and validates every plan at `path`; errors name the file and the JSON path.
pub fn load_plans(path: &Path) -> Result<Vec<Arc<Plan>>> {
    plan_files(path)
        .and_then(|files| {
            files
                .iter()
                .map(|f| {
                    Plan::load(f).map(Arc::new).map_err(|e| {
                        PlanError::new(e.path.clone(), format!("{}: {}", f.display(), e.reason))
                    })
                })
                .collect()
        })
        .map_err(|e| Error::InvalidArgument(e.to_string()))
}

/// The plans of the default directories ([`default_plan_dirs`]) that can run on `comm`, in
/// directory order; unreadable or invalid files are logged and left out, as are plans for
/// other world sizes or with ops the GPU interpreter refuses ([`runnable_plans`]).
pub fn default_plans(comm: &Communicator, env: &Env) -> Vec<Arc<Plan>> {
    let mut plans = Vec::new();
    for dir in default_plan_dirs(env) {
        for file in plan_files(&dir).unwrap_or_default() {
            match Plan::load(&file) {
                Ok(p) => plans.push(Arc::new(p)),
                Err(e) => {
                    tracing::info!(target: "mscclpp::plan", "{}: left out: {e}", file.display())
                }
            }
        }
    }
    runnable_plans(comm, plans)
}

/// Collective: the plans of `plans` (found in `source`: the default directories, plans a
/// program registered) that every rank of `comm` found alike. Each rank gathers its own (another
/// host's directories may differ, a program may register differently per rank), and setting a
/// plan up is collective, so the ranks compare what they found (names and contents) in one
/// all-gather first. Where any rank differs, no rank takes any plan: each logs which rank
/// differed and goes on with the native algorithms.
pub fn agreed_plans(
    comm: &Communicator,
    plans: Vec<Arc<Plan>>,
    source: &str,
) -> Result<Vec<Arc<Plan>>> {
    let mine = plan_set_identity(&plans);
    let all = comm.bootstrap().all_gather(mine.as_bytes())?;
    if let Some(other) = all.iter().position(|theirs| theirs != mine.as_bytes()) {
        tracing::warn!(
            target: "mscclpp::plan",
            "rank {}: the execution plans found in {source} differ from rank {other}'s (every \
             rank must see the same plans): none is used",
            comm.rank(),
        );
        return Ok(Vec::new());
    }
    Ok(plans)
}

/// The names and a digest of the contents of `plans`, in order: equal on two ranks exactly when
/// they loaded the same plans (the digest is deterministic across processes of one build).
fn plan_set_identity(plans: &[Arc<Plan>]) -> String {
    use std::hash::{Hash, Hasher};
    plans
        .iter()
        .map(|p| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            format!("{p:?}").hash(&mut h);
            format!("{}:{:016x}\n", p.name, h.finish())
        })
        .collect()
}

/// Collective: sets up `plans` for `comm` and adds them to `builder`, with the preferring
/// selector. Every plan must run here (right world size, no port or switch op): the error names
/// the plan and the op otherwise. Use [`runnable_plans`] to keep only those of a directory that
/// do.
pub fn add_plans(
    comm: &Arc<Communicator>,
    builder: &mut AlgorithmCollectionBuilder,
    plans: &[Arc<Plan>],
) -> Result<Vec<Arc<PlanAlgorithm>>> {
    let algos = plans
        .iter()
        .map(|plan| PlanAlgorithm::new(comm.clone(), plan.clone()).map(Arc::new))
        .collect::<Result<Vec<_>>>()?;
    register_plans(builder, &algos)?;
    Ok(algos)
}

/// Adds plan algorithms already set up (e.g. by the Python package's `Executor`, which owns them)
/// to `builder`, with the preferring selector.
pub fn register_plans(
    builder: &mut AlgorithmCollectionBuilder,
    algos: &[Arc<PlanAlgorithm>],
) -> Result<()> {
    for algo in algos {
        builder.add_algorithm(algo.clone())?;
    }
    let table = algos
        .iter()
        .map(|a| {
            let (min, max) = a.message_range();
            PlanEntry {
                name: a.name().to_string(),
                collective: a.collective(),
                world_size: a.plan().world_size(),
                min_bytes: min,
                max_bytes: max,
                in_place: a.plan().inplace,
                input_chunks: a.input_chunks(),
                widest_element: a.widest_element(),
                reduce_op: a.collective().reduces().then(|| a.reduce_op()),
            }
        })
        .collect();
    let fallback = builder.take_selector();
    builder.set_selector(preferring_plans(table, fallback));
    Ok(())
}

/// What the selector knows of a loaded plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanEntry {
    pub name: String,
    pub collective: Collective,
    pub world_size: usize,
    pub min_bytes: u64,
    pub max_bytes: u64,
    /// The plan's buffer mode (its `inplace` key).
    pub in_place: bool,
    /// Chunks a rank's input is cut into, each a whole number of elements.
    pub input_chunks: usize,
    /// The widest element its protocol carries.
    pub widest_element: usize,
    /// The reduction it applies, if it reduces.
    pub reduce_op: Option<ReduceOp>,
}

impl PlanEntry {
    /// Whether the plan can run the call `ctx` describes: everything `PlanAlgorithm`'s check
    /// of a call asks that the selector is told, so that a call the plan cannot cut, carry or
    /// reduce goes to the next choice instead of failing (PyTorch's one-element barrier
    /// all-reduces, a max where the plan sums).
    pub fn takes(&self, ctx: &SelectionContext) -> bool {
        let bytes = ctx.message_bytes as u64;
        let element = ctx.dtype.size();
        self.collective == ctx.collective
            && self.world_size == ctx.world_size
            && (self.min_bytes..=self.max_bytes).contains(&bytes)
            && self.in_place == ctx.in_place
            && element <= self.widest_element
            && ctx.message_bytes % (self.input_chunks * element) == 0
            && (self.reduce_op.is_none() || ctx.op.is_none() || self.reduce_op == ctx.op)
    }
}

/// A selector that answers with the first plan of `table` that takes the call
/// ([`PlanEntry::takes`]: collective, world size, message size, buffer mode, element size and
/// reduction), and asks `fallback` otherwise.
pub fn preferring_plans(table: Vec<PlanEntry>, fallback: Option<Selector>) -> Selector {
    Box::new(move |ctx: &SelectionContext| {
        table
            .iter()
            .find(|p| p.takes(ctx))
            .map(|p| p.name.clone())
            .or_else(|| fallback.as_ref().and_then(|f| f(ctx)))
    })
}

/// The plans of `plans` that can run on `comm` (world size, op kinds); the others are logged
/// with the reason and left out.
pub fn runnable_plans(comm: &Communicator, plans: Vec<Arc<Plan>>) -> Vec<Arc<Plan>> {
    let nvls = Env::get().map(|e| e.nvls_allowed()).unwrap_or(false);
    plans
        .into_iter()
        .filter(|p| {
            let why = if p.world_size() != comm.size() {
                Some(format!("written for {} ranks", p.world_size()))
            } else {
                crate::encode::encode(p, comm.rank(), nvls)
                    .err()
                    .map(|e| e.to_string())
            };
            if let Some(why) = &why {
                tracing::info!(target: "mscclpp::plan", "plan {} left out: {why}", p.name);
            }
            why.is_none()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::DataType;

    fn ctx(collective: Collective, bytes: usize, world: usize) -> SelectionContext {
        SelectionContext {
            collective,
            message_bytes: bytes,
            dtype: DataType::F32,
            world_size: world,
            local_world_size: world,
            symmetric_memory: false,
            capturing: false,
            arch: "sm_90".into(),
            nvls_allowed: false,
            in_place: true,
            op: None,
        }
    }

    #[test]
    fn a_matching_plan_is_preferred_and_the_rest_falls_back() {
        let table = vec![PlanEntry {
            name: "allreduce_2gpu".into(),
            collective: Collective::AllReduce,
            world_size: 2,
            min_bytes: 1024,
            max_bytes: 1 << 20,
            in_place: true,
            input_chunks: 2,
            widest_element: 4,
            reduce_op: Some(ReduceOp::Sum),
        }];
        let fallback: Selector = Box::new(|_| Some("default_allreduce_packet".into()));
        let select = preferring_plans(table, Some(fallback));
        let pick = |c, b, w| select(&ctx(c, b, w));
        assert_eq!(
            pick(Collective::AllReduce, 4096, 2).as_deref(),
            Some("allreduce_2gpu")
        );
        for (c, b, w) in [
            (Collective::AllReduce, 512, 2),
            (Collective::AllReduce, 2 << 20, 2),
            (Collective::AllReduce, 4096, 4),
            (Collective::AllGather, 4096, 2),
        ] {
            assert_eq!(pick(c, b, w).as_deref(), Some("default_allreduce_packet"));
        }
        // An out-of-place call of the same shape does not get the in-place plan.
        let out_of_place = SelectionContext {
            in_place: false,
            op: None,
            ..ctx(Collective::AllReduce, 4096, 2)
        };
        assert_eq!(
            select(&out_of_place).as_deref(),
            Some("default_allreduce_packet")
        );
        // Nor a call it cannot cut into its chunks, carry, or reduce: 257 f32 (1028 bytes) in
        // 2 chunks, as PyTorch's one-element barrier is, an f64 in LL8 packets, a max where it
        // sums. A call that does not say its reduction gets it.
        let call = |bytes, dtype, op| SelectionContext {
            dtype,
            op,
            ..ctx(Collective::AllReduce, bytes, 2)
        };
        use mscclpp_core::DataType;
        for other in [
            call(1028, DataType::F32, Some(ReduceOp::Sum)),
            call(4096, DataType::F64, Some(ReduceOp::Sum)),
            call(4096, DataType::F32, Some(ReduceOp::Max)),
        ] {
            assert_eq!(
                select(&other).as_deref(),
                Some("default_allreduce_packet"),
                "{other:?}"
            );
        }
        for taken in [
            call(1032, DataType::F32, Some(ReduceOp::Sum)),
            call(4096, DataType::F32, None),
        ] {
            assert_eq!(
                select(&taken).as_deref(),
                Some("allreduce_2gpu"),
                "{taken:?}"
            );
        }
    }

    #[test]
    fn a_directory_lists_its_json_files_sorted() {
        let dir = std::env::temp_dir().join(format!("mscclpp-plan-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["b.json", "a.json", "notes.txt"] {
            std::fs::write(dir.join(f), "{}").unwrap();
        }
        let files = plan_files(&dir).unwrap();
        let names: Vec<_> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_owned())
            .collect();
        assert_eq!(names, ["a.json", "b.json"]);
        let err = load_plans(&dir).unwrap_err().to_string();
        assert!(err.contains("a.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The cache's `default/` holds plans to serve; the cache itself holds what `mscclpp.compile`
    /// compiled, which only a registration may serve.
    #[test]
    fn compiled_plans_in_the_cache_are_not_default_plans() {
        let cache = std::env::temp_dir().join(format!("mscclpp-plan-cache-{}", std::process::id()));
        std::fs::create_dir_all(cache.join("default")).unwrap();
        let env = |dir: Option<&std::path::Path>| {
            let mut vars = vec![("MSCCLPP_CACHE_DIR".to_string(), cache.display().to_string())];
            if let Some(d) = dir {
                vars.push(("MSCCLPP_EXECUTION_PLAN_DIR".into(), d.display().to_string()));
            }
            Env::from_vars(vars).unwrap()
        };
        assert_eq!(default_plan_dirs(&env(None)), [cache.join("default")]);
        let plans = cache.join("plans");
        std::fs::create_dir_all(&plans).unwrap();
        assert_eq!(
            default_plan_dirs(&env(Some(&plans))),
            [plans, cache.join("default")]
        );
        std::fs::remove_dir_all(&cache).unwrap();
    }

    /// Every rank takes the plans of its directories only when all ranks found the same ones:
    /// two loopback ranks, with the builder's 2-rank all-reduce in a plan directory both see,
    /// then with it missing on rank 1 (no rank takes it, none waits for the other).
    #[test]
    fn plans_are_taken_only_where_every_rank_found_the_same() {
        use crate::builder::allreduce;
        use crate::plan::{PlanReduceOp, Protocol};
        use mscclpp_core::bootstrap::on_loopback_ranks;
        use mscclpp_core::port_channel::test_gpu::HostGpu;
        let root =
            std::env::temp_dir().join(format!("mscclpp-agreed-plans-{}", std::process::id()));
        let (with, without, cache) = (root.join("with"), root.join("without"), root.join("cache"));
        for d in [&with, &without, &cache] {
            std::fs::create_dir_all(d).unwrap();
        }
        let plan = allreduce(2, Protocol::Simple, PlanReduceOp::Sum);
        std::fs::write(with.join("allreduce.json"), plan.to_string()).unwrap();
        for (rank1_dir, want) in [(&with, 1), (&without, 0)] {
            let dirs = [with.clone(), rank1_dir.clone()];
            let cache = cache.clone();
            let found =
                on_loopback_ranks(2, std::time::Duration::from_secs(20), move |rank, boot| {
                    let env = Env::from_vars([
                        (
                            "MSCCLPP_EXECUTION_PLAN_DIR".to_string(),
                            dirs[rank].display().to_string(),
                        ),
                        ("MSCCLPP_CACHE_DIR".to_string(), cache.display().to_string()),
                    ])
                    .unwrap();
                    let comm = Communicator::new(boot, Arc::new(HostGpu::new()), 0).unwrap();
                    agreed_plans(&comm, default_plans(&comm, &env), "the test's directories")
                        .unwrap()
                        .len()
                });
            assert_eq!(
                found,
                [want, want],
                "rank 1's directory {}",
                rank1_dir.display()
            );
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
