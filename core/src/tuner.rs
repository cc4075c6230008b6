//! Tuning tables: the measured best (algorithm, nblocks, nthreads) per collective, element type,
//! world size and power-of-two message size, saved and loaded as YAML, and a [`Selector`] that
//! answers from such a table.
//!
//! The measuring itself needs GPUs and lives in `mscclpp-collectives` (`tune`); this module is
//! plain data so every rule about it (file format, size buckets, fallback) is tested on the CPU.
//!
//! # Size buckets
//! An entry for `bytes = 2^k` covers messages of `(2^(k-1), 2^k]` bytes (per-rank input bytes, as
//! [`SelectionContext::message_bytes`]). A lookup rounds the message up to the next power of two
//! and takes the smallest bucket at or above it; a message larger than the largest bucket takes
//! the largest one, a message smaller than the smallest takes the smallest ("clamped to the
//! table's range"). A table with gaps (merged by hand) thus answers with the next larger measured
//! size, which is the safer extrapolation for latency-bound algorithms.
//!
//! # File format
//! ```yaml
//! version: 1
//! device: NVIDIA H100 80GB HBM3 (sm_90)   # optional, informative
//! entries:
//!   - collective: allreduce
//!     dtype: bf16
//!     world_size: 8
//!     bytes: 1024
//!     algorithm: default_allreduce_allpair_packet
//!     nblocks: 8          # optional: absent lets the algorithm choose
//!     nthreads: 512       # optional
//!     time_us: 6.1
//! ```

use crate::algorithm::{Algorithm, Collective, ExecuteArgs};
use crate::algorithm_collection::{AlgorithmCollection, SelectionContext, Selector};
use crate::dtype::DataType;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// Version written to and accepted from tuning files.
pub const TUNING_FILE_VERSION: u32 = 1;

/// What the table says to run for one bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct TunedLaunch {
    /// MSCCL++ name of the algorithm.
    pub algorithm: String,
    /// Launch geometry; `None` lets the algorithm choose.
    pub nblocks: Option<u32>,
    pub nthreads: Option<u32>,
    /// Mean over ranks of the measured time per call, microseconds.
    pub time_us: f64,
}

impl TunedLaunch {
    /// Puts the tuned geometry into `args` (a `None` here leaves the algorithm's default).
    pub fn apply(&self, args: &mut ExecuteArgs) {
        args.nblocks = self.nblocks;
        args.nthreads = self.nthreads;
    }
}

/// Which calls one entry serves (all but the bucket; the bucket is the inner map's key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Group {
    collective: u8,
    dtype: DataType,
    world_size: usize,
}

fn collective_index(c: Collective) -> u8 {
    // Ordering only; Collective has no Ord and is a fixed contract.
    match c {
        Collective::AllReduce => 0,
        Collective::AllGather => 1,
        Collective::ReduceScatter => 2,
        Collective::Broadcast => 3,
        Collective::AllToAll => 4,
        Collective::SendRecv => 5,
        Collective::Reduce => 6,
        Collective::Gather => 7,
        Collective::Scatter => 8,
    }
}

/// One row of a tuning file (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryRow {
    collective: Collective,
    dtype: String,
    world_size: usize,
    bytes: usize,
    algorithm: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    nblocks: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    nthreads: Option<u32>,
    time_us: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TableFile {
    version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    device: Option<String>,
    #[serde(default)]
    entries: Vec<EntryRow>,
}

/// Tuned launches by (collective, dtype, world size, power-of-two size bucket).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TuningTable {
    /// Where the measurements were taken (device name and arch); informative only.
    pub device: Option<String>,
    groups: BTreeMap<Group, BTreeMap<usize, (Collective, TunedLaunch)>>,
}

/// The bucket of `bytes`: the next power of two at or above it (0 and 1 both give 1); `None` when
/// that power does not fit a `usize`.
pub fn size_bucket(bytes: usize) -> Option<usize> {
    bytes.max(1).checked_next_power_of_two()
}

impl TuningTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.groups.values().map(BTreeMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records `launch` for messages in the bucket of `bucket_bytes`, replacing an earlier entry.
    /// `bucket_bytes` must be a power of two, `world_size` and the geometry positive, the time
    /// finite and not negative, the algorithm named.
    pub fn insert(
        &mut self,
        collective: Collective,
        dtype: DataType,
        world_size: usize,
        bucket_bytes: usize,
        launch: TunedLaunch,
    ) -> Result<()> {
        let what =
            || format!("tuning entry {collective} {dtype} x{world_size} at {bucket_bytes} bytes");
        if !bucket_bytes.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "{}: bytes must be a power of two",
                what()
            )));
        }
        if world_size == 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: world_size must be at least 1",
                what()
            )));
        }
        if launch.algorithm.trim().is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{}: the algorithm name is empty",
                what()
            )));
        }
        if launch.nblocks == Some(0) || launch.nthreads == Some(0) {
            return Err(Error::InvalidArgument(format!(
                "{}: nblocks and nthreads must be positive when given",
                what()
            )));
        }
        if !launch.time_us.is_finite() || launch.time_us < 0.0 {
            return Err(Error::InvalidArgument(format!(
                "{}: time_us {} is not a finite, non-negative time",
                what(),
                launch.time_us
            )));
        }
        let group = Group {
            collective: collective_index(collective),
            dtype,
            world_size,
        };
        self.groups
            .entry(group)
            .or_default()
            .insert(bucket_bytes, (collective, launch));
        Ok(())
    }

    /// The launch for a message of `message_bytes` (see "Size buckets" in the module docs), or
    /// `None` when the table has nothing for this collective, dtype and world size.
    pub fn lookup(
        &self,
        collective: Collective,
        dtype: DataType,
        world_size: usize,
        message_bytes: usize,
    ) -> Option<&TunedLaunch> {
        let group = Group {
            collective: collective_index(collective),
            dtype,
            world_size,
        };
        let buckets = self.groups.get(&group)?;
        // A size beyond usize's largest power of two is beyond any bucket: clamp to the top.
        let wanted = size_bucket(message_bytes).unwrap_or(usize::MAX);
        buckets
            .range(wanted..)
            .next()
            .or_else(|| buckets.iter().next_back())
            .map(|(_, (_, launch))| launch)
    }

    /// [`TuningTable::lookup`] for one call.
    pub fn lookup_ctx(&self, ctx: &SelectionContext) -> Option<&TunedLaunch> {
        self.lookup(ctx.collective, ctx.dtype, ctx.world_size, ctx.message_bytes)
    }

    /// The table's answer for one call: [`TuningTable::lookup_ctx`], except that an NVLS entry
    /// while NVLS is not allowed is no answer (the collection would refuse it; see
    /// `algorithm_collection`'s safety rule).
    pub fn choice(&self, ctx: &SelectionContext) -> Option<&TunedLaunch> {
        self.lookup_ctx(ctx)
            .filter(|l| ctx.nvls_allowed || !l.algorithm.to_ascii_lowercase().contains("nvls"))
    }

    /// Every entry as (collective, dtype, world size, bucket bytes, launch), in a stable order.
    pub fn entries(
        &self,
    ) -> impl Iterator<Item = (Collective, DataType, usize, usize, &TunedLaunch)> {
        self.groups.iter().flat_map(|(g, buckets)| {
            buckets
                .iter()
                .map(move |(&bytes, (c, l))| (*c, g.dtype, g.world_size, bytes, l))
        })
    }

    /// Adds every entry of `other`, which wins where both have one.
    pub fn merge(&mut self, other: &TuningTable) -> Result<()> {
        for (c, d, w, b, l) in other.entries() {
            self.insert(c, d, w, b, l.clone())?;
        }
        if self.device.is_none() {
            self.device.clone_from(&other.device);
        }
        Ok(())
    }

    /// The table as YAML text (the format in the module docs).
    pub fn to_yaml(&self) -> Result<String> {
        let file = TableFile {
            version: TUNING_FILE_VERSION,
            device: self.device.clone(),
            entries: self
                .entries()
                .map(|(c, d, w, b, l)| EntryRow {
                    collective: c,
                    dtype: d.name().to_string(),
                    world_size: w,
                    bytes: b,
                    algorithm: l.algorithm.clone(),
                    nblocks: l.nblocks,
                    nthreads: l.nthreads,
                    time_us: l.time_us,
                })
                .collect(),
        };
        serde_norway::to_string(&file)
            .map_err(|e| Error::Internal(format!("serialising a tuning table as YAML: {e}")))
    }

    /// Parses YAML text; `source` names it in errors (a path, or `"<string>"`).
    pub fn from_yaml(text: &str, source: &str) -> Result<Self> {
        let bad = |m: String| Error::InvalidArgument(format!("tuning table {source}: {m}"));
        let file: TableFile = serde_norway::from_str(text).map_err(|e| bad(e.to_string()))?;
        if file.version != TUNING_FILE_VERSION {
            return Err(bad(format!(
                "version {} is not supported (this build reads version {TUNING_FILE_VERSION})",
                file.version
            )));
        }
        let mut table = TuningTable {
            device: file.device,
            groups: BTreeMap::new(),
        };
        for (i, row) in file.entries.into_iter().enumerate() {
            let dtype: DataType = row
                .dtype
                .parse()
                .map_err(|e| bad(format!("entry {i}: {e}")))?;
            let group = Group {
                collective: collective_index(row.collective),
                dtype,
                world_size: row.world_size,
            };
            if table
                .groups
                .get(&group)
                .is_some_and(|b| b.contains_key(&row.bytes))
            {
                return Err(bad(format!(
                    "entry {i}: a second entry for {} {dtype} x{} at {} bytes",
                    row.collective, row.world_size, row.bytes
                )));
            }
            table
                .insert(
                    row.collective,
                    dtype,
                    row.world_size,
                    row.bytes,
                    TunedLaunch {
                        algorithm: row.algorithm,
                        nblocks: row.nblocks,
                        nthreads: row.nthreads,
                        time_us: row.time_us,
                    },
                )
                .map_err(|e| bad(format!("entry {i}: {e}")))?;
        }
        Ok(table)
    }

    /// Writes the table to `path` as YAML.
    pub fn save_yaml(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let text = self.to_yaml()?;
        std::fs::write(path, text)
            .map_err(|e| Error::io(format!("writing the tuning table {}", path.display()), e))
    }

    /// Reads a table written by [`TuningTable::save_yaml`] (or by hand); a malformed file is an
    /// error naming the file and the problem (with YAML line and column where the parser has
    /// them).
    pub fn load_yaml(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading the tuning table {}", path.display()), e))?;
        Self::from_yaml(&text, &path.display().to_string())
    }
}

/// A selector that answers from `table` where it has an entry for the call and defers to
/// `fallback` otherwise (see [`TuningTable::choice`]). The geometry is not part of a selector's
/// answer: callers that want it look it up with [`TuningTable::choice`] on the same table and
/// [`TunedLaunch::apply`] it, or use [`select_tuned`], which does both.
pub fn tuned_selector(table: Arc<TuningTable>, fallback: Selector) -> Selector {
    Box::new(move |ctx: &SelectionContext| match table.choice(ctx) {
        Some(l) => Some(l.algorithm.clone()),
        None => fallback(ctx),
    })
}

/// The algorithm for `ctx`: the table's choice when it has one that `collection` registers,
/// with its launch geometry; else the collection's own selector, with no geometry. A table entry
/// naming an algorithm this build does not register (a file from another build) defers too,
/// with a warning, rather than failing the call.
pub fn select_tuned<'t>(
    table: &'t TuningTable,
    collection: &AlgorithmCollection,
    ctx: &SelectionContext,
) -> Result<(Arc<dyn Algorithm>, Option<&'t TunedLaunch>)> {
    if let Some(l) = table.choice(ctx) {
        match collection.get(ctx.collective, &l.algorithm) {
            Some(a) => return Ok((a, Some(l))),
            None => tracing::warn!(
                "the tuning table names {} for {} of {} bytes, which is not registered; \
                 using the selector",
                l.algorithm,
                ctx.collective,
                ctx.message_bytes
            ),
        }
    }
    Ok((collection.select(ctx)?, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn launch(name: &str, blocks: Option<u32>, threads: Option<u32>, us: f64) -> TunedLaunch {
        TunedLaunch {
            algorithm: name.into(),
            nblocks: blocks,
            nthreads: threads,
            time_us: us,
        }
    }

    /// allreduce bf16 x2 at 1K (a), 4K (b), 16K (c); allgather f32 x8 at 64 (g).
    fn sample() -> TuningTable {
        let mut t = TuningTable::new();
        t.device = Some("NVIDIA H100 (sm_90)".into());
        let ar = |t: &mut TuningTable, b, l| {
            t.insert(Collective::AllReduce, DataType::Bf16, 2, b, l)
                .expect("insert")
        };
        ar(&mut t, 1024, launch("a", Some(4), Some(512), 3.25));
        ar(&mut t, 4096, launch("b", None, Some(256), 4.5));
        ar(&mut t, 16384, launch("c", Some(32), None, 7.0));
        t.insert(
            Collective::AllGather,
            DataType::F32,
            8,
            64,
            launch("g", None, None, 1.0),
        )
        .expect("insert");
        t
    }

    #[test]
    fn yaml_round_trip_through_a_file() {
        let t = sample();
        let dir = std::env::temp_dir().join(format!("mscclpp-tuner-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("table.yaml");
        t.save_yaml(&path).expect("save");
        let text = std::fs::read_to_string(&path).expect("read back");
        assert!(text.contains("collective: allreduce"), "{text}");
        assert!(text.contains("dtype: bf16"), "{text}");
        let back = TuningTable::load_yaml(&path).expect("load");
        assert_eq!(back, t);
        assert_eq!(back.len(), 4);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn hand_written_file_with_optional_fields() {
        let text = "version: 1\nentries:\n  - collective: broadcast\n    dtype: float\n    \
                    world_size: 4\n    bytes: 2048\n    algorithm: default_broadcast_zero_copy\n    \
                    time_us: 9\n";
        let t = TuningTable::from_yaml(text, "<test>").expect("parse");
        let l = t
            .lookup(Collective::Broadcast, DataType::F32, 4, 100)
            .expect("entry");
        assert_eq!(l, &launch("default_broadcast_zero_copy", None, None, 9.0));
        assert!(TuningTable::from_yaml("version: 1\n", "<test>")
            .expect("empty")
            .is_empty());
    }

    #[rstest]
    #[case("version: 1\nentries: [", "while parsing")]
    #[case("version: 2\nentries: []\n", "version 2")]
    #[case("entries: []\n", "version")]
    #[case("version: 1\nextra: 3\n", "extra")]
    #[case(
        "version: 1\nentries:\n  - {collective: allreduce, dtype: f128, world_size: 2, bytes: 8, algorithm: a, time_us: 1}\n",
        "f128"
    )]
    #[case(
        "version: 1\nentries:\n  - {collective: allsum, dtype: f32, world_size: 2, bytes: 8, algorithm: a, time_us: 1}\n",
        "allsum"
    )]
    #[case(
        "version: 1\nentries:\n  - {collective: allreduce, dtype: f32, world_size: 2, bytes: 24, algorithm: a, time_us: 1}\n",
        "power of two"
    )]
    #[case(
        "version: 1\nentries:\n  - {collective: allreduce, dtype: f32, world_size: 2, bytes: 8, algorithm: a, nblocks: 0, time_us: 1}\n",
        "positive"
    )]
    #[case(
        "version: 1\nentries:\n  - {collective: allreduce, dtype: f32, world_size: 2, bytes: 8, algorithm: a, time_us: -1}\n",
        "time_us -1"
    )]
    #[case(
        "version: 1\nentries:\n  - {collective: allreduce, dtype: f32, world_size: 2, bytes: 8, algorithm: a, time_us: 1}\n  - {collective: allreduce, dtype: f32, world_size: 2, bytes: 8, algorithm: b, time_us: 2}\n",
        "entry 1: a second entry"
    )]
    #[case(
        "version: 1\nentries:\n  - {collective: allreduce, dtype: f32, bytes: 8, algorithm: a, time_us: 1}\n",
        "world_size"
    )]
    fn malformed_yaml_names_the_file_and_problem(#[case] text: &str, #[case] needle: &str) {
        let err = TuningTable::from_yaml(text, "/etc/tune.yaml").expect_err("must fail");
        let msg = err.to_string();
        assert!(msg.contains("tuning table /etc/tune.yaml"), "{msg}");
        assert!(msg.contains(needle), "{msg} lacks {needle}");
    }

    #[test]
    fn load_errors_name_the_path() {
        let err = TuningTable::load_yaml("/nonexistent/mscclpp/t.yaml").expect_err("missing");
        assert!(
            err.to_string().contains("/nonexistent/mscclpp/t.yaml"),
            "{err}"
        );
        let dir = std::env::temp_dir().join(format!("mscclpp-tuner-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("bad.yaml");
        std::fs::write(&path, "version: 1\nentries: 7\n").expect("write");
        let err = TuningTable::load_yaml(&path).expect_err("malformed");
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[rstest]
    #[case(0, "a")] // below the range: the smallest bucket
    #[case(1, "a")]
    #[case(1023, "a")]
    #[case(1024, "a")] // exactly a power of two stays in its bucket
    #[case(1025, "b")] // one byte more goes to the next measured bucket (2K is a gap -> 4K)
    #[case(2048, "b")]
    #[case(4096, "b")]
    #[case(4097, "c")]
    #[case(16384, "c")]
    #[case(16385, "c")] // above the range: the largest bucket
    #[case(usize::MAX, "c")]
    fn bucket_edges(#[case] bytes: usize, #[case] want: &str) {
        let t = sample();
        let l = t
            .lookup(Collective::AllReduce, DataType::Bf16, 2, bytes)
            .expect("in table");
        assert_eq!(l.algorithm, want, "{bytes} bytes");
    }

    #[test]
    fn other_groups_have_no_answer() {
        let t = sample();
        assert!(t
            .lookup(Collective::AllReduce, DataType::F16, 2, 1024)
            .is_none());
        assert!(t
            .lookup(Collective::AllReduce, DataType::Bf16, 4, 1024)
            .is_none());
        assert!(t
            .lookup(Collective::Broadcast, DataType::Bf16, 2, 1024)
            .is_none());
        assert_eq!(size_bucket(0), Some(1));
        assert_eq!(size_bucket(3), Some(4));
        assert_eq!(size_bucket(usize::MAX), None);
    }

    #[test]
    fn insert_checks_its_input() {
        let mut t = TuningTable::new();
        let mut ins = |b, w, l| t.insert(Collective::AllReduce, DataType::F32, w, b, l);
        assert!(ins(3, 2, launch("x", None, None, 1.0)).is_err());
        assert!(ins(4, 0, launch("x", None, None, 1.0)).is_err());
        assert!(ins(4, 2, launch(" ", None, None, 1.0)).is_err());
        assert!(ins(4, 2, launch("x", None, Some(0), 1.0)).is_err());
        assert!(ins(4, 2, launch("x", None, None, f64::NAN)).is_err());
        ins(4, 2, launch("x", None, None, 1.0)).expect("valid");
        ins(4, 2, launch("y", None, None, 0.5)).expect("replaces");
        assert_eq!(t.len(), 1);
        let mut other = sample();
        other.merge(&t).expect("merge");
        assert_eq!(other.len(), 5);
    }

    fn ctx(c: Collective, bytes: usize, nvls: bool) -> SelectionContext {
        SelectionContext {
            collective: c,
            message_bytes: bytes,
            dtype: DataType::Bf16,
            world_size: 2,
            local_world_size: 2,
            symmetric_memory: false,
            capturing: true,
            arch: "sm_90".into(),
            nvls_allowed: nvls,
            in_place: false,
            op: None,
        }
    }

    #[test]
    fn selector_answers_from_the_table_and_falls_back_otherwise() {
        let mut t = sample();
        t.insert(
            Collective::ReduceScatter,
            DataType::Bf16,
            2,
            1 << 20,
            launch("default_reducescatter_nvls", None, None, 1.0),
        )
        .expect("insert");
        let table = Arc::new(t);
        let sel = tuned_selector(table.clone(), Box::new(|_| Some("fallback".into())));
        assert_eq!(
            sel(&ctx(Collective::AllReduce, 3000, false)).as_deref(),
            Some("b")
        );
        assert_eq!(
            sel(&ctx(Collective::Broadcast, 3000, false)).as_deref(),
            Some("fallback")
        );
        // NVLS entries defer unless NVLS is allowed.
        assert_eq!(
            sel(&ctx(Collective::ReduceScatter, 8, false)).as_deref(),
            Some("fallback")
        );
        assert_eq!(
            sel(&ctx(Collective::ReduceScatter, 8, true)).as_deref(),
            Some("default_reducescatter_nvls")
        );
        let none = tuned_selector(table.clone(), Box::new(|_| None));
        assert_eq!(none(&ctx(Collective::Broadcast, 8, false)), None);
        // The geometry comes from the same table.
        let l = table
            .lookup_ctx(&ctx(Collective::AllReduce, 100, false))
            .expect("entry");
        let mut args = ExecuteArgs {
            input: 0,
            output: 0,
            input_bytes: 100,
            output_bytes: 100,
            dtype: DataType::Bf16,
            op: crate::dtype::ReduceOp::Sum,
            accum: crate::dtype::AccumType::Auto,
            root: 0,
            stream: crate::gpu::Stream::DEFAULT,
            nblocks: Some(99),
            nthreads: Some(99),
        };
        l.apply(&mut args);
        assert_eq!((args.nblocks, args.nthreads), (Some(4), Some(512)));
    }

    struct Named(&'static str);
    impl Algorithm for Named {
        fn name(&self) -> &str {
            self.0
        }
        fn collective(&self) -> Collective {
            Collective::AllReduce
        }
        fn check(&self, _: &ExecuteArgs) -> Result<()> {
            Ok(())
        }
        fn execute(&self, _: &ExecuteArgs) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn select_tuned_prefers_registered_table_entries() {
        let mut b = AlgorithmCollection::builder();
        for n in ["a", "fallback"] {
            b.add_algorithm(Arc::new(Named(n))).expect("add");
        }
        b.set_selector(Box::new(|_| Some("fallback".into())));
        let coll = b.build();
        let t = sample();
        // 1K -> "a", registered: the table's choice with its geometry.
        let (algo, l) =
            select_tuned(&t, &coll, &ctx(Collective::AllReduce, 1000, false)).expect("selected");
        assert_eq!(algo.name(), "a");
        assert_eq!(l.map(|l| l.nblocks), Some(Some(4)));
        // 4K -> "b", not registered: the collection's selector, no geometry.
        let (algo, l) =
            select_tuned(&t, &coll, &ctx(Collective::AllReduce, 4000, false)).expect("selected");
        assert_eq!((algo.name(), l), ("fallback", None));
        // No entry for the group: the selector.
        let mut c = ctx(Collective::AllReduce, 4000, false);
        c.world_size = 4;
        let (algo, l) = select_tuned(&t, &coll, &c).expect("selected");
        assert_eq!((algo.name(), l), ("fallback", None));
    }
}
