//! Results: one [`Row`] per (size, type, op), printed as nccl-tests columns and written as JSON.

use super::shape::Shape;
use serde::Serialize;

/// One placement's measurement of one row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measure {
    /// Median batch, microseconds per call (mean over ranks).
    pub time_us: f64,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
    /// Wrong elements over all ranks.
    pub wrong: usize,
    /// The first wrong element, described, when any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_wrong: Option<String>,
    /// NCCL's time for the same call in the same run (`--vs-nccl`), microseconds per call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nccl_time_us: Option<f64>,
    /// Why NCCL has no time here, when it was asked for and has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nccl_note: Option<String>,
}

impl Measure {
    pub fn new(shape: &Shape, time_us: f64, wrong: usize, first_wrong: Option<String>) -> Measure {
        Measure {
            time_us,
            algbw_gbs: shape.algbw(time_us),
            busbw_gbs: shape.busbw(time_us),
            wrong,
            first_wrong,
            nccl_time_us: None,
            nccl_note: None,
        }
    }

    /// Ours over NCCL's time (below 1: we are faster).
    pub fn ratio(&self) -> Option<f64> {
        self.nccl_time_us
            .filter(|t| *t > 0.0)
            .map(|t| self.time_us / t)
    }
}

/// What happened to one placement of a row.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Measured(Measure),
    /// Not run, and why (e.g. the algorithm cannot take the size); not an error.
    Skipped(String),
    /// Not asked for (`--inplace-only` / `--outofplace-only`).
    NotRequested,
}

/// One line of the table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub collective: String,
    pub size_bytes: usize,
    pub count: usize,
    pub dtype: String,
    /// `none` for data movement, as nccl-tests prints it.
    pub redop: String,
    /// `-1` for unrooted collectives, as nccl-tests prints it.
    pub root: i64,
    /// The algorithm that ran (the selector's choice under `--algo auto`).
    pub algorithm: String,
    pub out_of_place: Outcome,
    pub in_place: Outcome,
}

impl Row {
    /// Wrong elements over both placements.
    pub fn wrong(&self) -> usize {
        [&self.out_of_place, &self.in_place]
            .iter()
            .map(|o| match o {
                Outcome::Measured(m) => m.wrong,
                _ => 0,
            })
            .sum()
    }
}

/// The rows where nothing ran although something was requested, each as `size type redop: why`
/// (the first skip reason): a benchmark whose rows all skipped measured nothing and must not pass.
pub fn rows_that_ran_nothing(rows: &[Row]) -> Vec<String> {
    rows.iter()
        .filter_map(|r| {
            let placements = [&r.out_of_place, &r.in_place];
            if placements.iter().any(|o| matches!(o, Outcome::Measured(_))) {
                return None;
            }
            let why = placements.iter().find_map(|o| match o {
                Outcome::Skipped(why) => Some(why.as_str()),
                _ => None,
            })?;
            Some(format!(
                "{} {} B {} {}: {why}",
                r.collective, r.size_bytes, r.dtype, r.redop
            ))
        })
        .collect()
}

/// Table header lines (each starting with `#`), with the NCCL columns when `vs_nccl`.
pub fn header(vs_nccl: bool) -> String {
    let group = if vs_nccl {
        format!(
            "{:>7} {:>7} {:>7} {:>6} {:>8} {:>6}",
            "time", "algbw", "busbw", "#wrong", "nccl", "ratio"
        )
    } else {
        format!(
            "{:>7} {:>7} {:>7} {:>6}",
            "time", "algbw", "busbw", "#wrong"
        )
    };
    let units = if vs_nccl {
        format!(
            "{:>7} {:>7} {:>7} {:>6} {:>8} {:>6}",
            "(us)", "(GB/s)", "(GB/s)", "", "(us)", ""
        )
    } else {
        format!("{:>7} {:>7} {:>7} {:>6}", "(us)", "(GB/s)", "(GB/s)", "")
    };
    let width = group.len();
    format!(
        "#{:>51}  {:^width$}  {:^width$}\n#{:>12} {:>12} {:>12} {:>6} {:>5}  {group}  {group}  algorithm\n#{:>12} {:>12} {:>12} {:>6} {:>5}  {units}  {units}\n",
        "",
        "out-of-place",
        "in-place",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "(B)",
        "(elements)",
        "",
        "",
        "",
    )
}

/// Formats a time the way nccl-tests does: more decimals for short times.
fn time_cell(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{us:>7.0}")
    } else if us >= 100.0 {
        format!("{us:>7.1}")
    } else {
        format!("{us:>7.2}")
    }
}

fn group_cells(o: &Outcome, vs_nccl: bool) -> String {
    let width = if vs_nccl {
        7 + 1 + 7 + 1 + 7 + 1 + 6 + 1 + 8 + 1 + 6
    } else {
        7 + 1 + 7 + 1 + 7 + 1 + 6
    };
    match o {
        Outcome::Measured(m) => {
            let mut s = format!(
                "{} {:>7.2} {:>7.2} {:>6}",
                time_cell(m.time_us),
                m.algbw_gbs,
                m.busbw_gbs,
                m.wrong
            );
            if vs_nccl {
                match (m.nccl_time_us, m.ratio()) {
                    (Some(t), Some(r)) => {
                        s.push_str(&format!(" {:>8} {r:>6.2}", time_cell(t).trim()))
                    }
                    _ => s.push_str(&format!(" {:>8} {:>6}", "n/a", "-")),
                }
            }
            s
        }
        Outcome::Skipped(_) => format!("{:>width$}", "skipped"),
        Outcome::NotRequested => format!("{:>width$}", "-"),
    }
}

/// One table line for `row`.
pub fn format_row(row: &Row, vs_nccl: bool) -> String {
    format!(
        "{:>13} {:>12} {:>12} {:>6} {:>5}  {}  {}  {}",
        row.size_bytes,
        row.count,
        row.dtype,
        row.redop,
        row.root,
        group_cells(&row.out_of_place, vs_nccl),
        group_cells(&row.in_place, vs_nccl),
        row.algorithm
    )
}

/// Notes printed under a row: skips, first wrong elements, and why NCCL has no time.
pub fn row_notes(row: &Row) -> Vec<String> {
    let mut notes = Vec::new();
    for (name, o) in [
        ("out-of-place", &row.out_of_place),
        ("in-place", &row.in_place),
    ] {
        match o {
            Outcome::Skipped(why) => notes.push(format!("#  {name} skipped: {why}")),
            Outcome::Measured(m) => {
                if let Some(first) = &m.first_wrong {
                    notes.push(format!("#  {name}: {} wrong; first: {first}", m.wrong));
                }
                if let Some(why) = &m.nccl_note {
                    notes.push(format!("#  {name}: no NCCL time: {why}"));
                }
            }
            Outcome::NotRequested => {}
        }
    }
    notes
}

/// An execution plan loaded by `--plan`, with the message range it takes here: its file's range
/// capped by the scratch, in input bytes per rank (the selector's measure; all-gather's `size`
/// column is the gathered output, `world_size` times more).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadedPlan {
    pub name: String,
    pub collective: &'static str,
    pub world_size: usize,
    pub min_bytes: u64,
    pub max_bytes: u64,
    /// The plan's buffer mode: it runs only calls of this placement.
    pub in_place: bool,
}

impl LoadedPlan {
    /// The header line printed for it.
    pub fn describe(&self) -> String {
        format!(
            "# plan {} ({}, {} ranks, {}..={} bytes, {})",
            self.name,
            self.collective,
            self.world_size,
            self.min_bytes,
            self.max_bytes,
            if self.in_place {
                "in place"
            } else {
                "out of place"
            }
        )
    }
}

/// The whole run as JSON: the device line, the options as given, the tolerance, every row, and
/// the plans loaded (absent without `--plan`).
#[derive(Debug, Clone, Serialize)]
pub struct JsonReport<'a> {
    pub device: &'a str,
    pub nccl: &'a str,
    pub nranks: usize,
    pub collective: &'a str,
    pub mode: String,
    pub iters: usize,
    pub warmup: usize,
    pub batches: usize,
    pub graph_replays: usize,
    pub tolerance: &'a str,
    pub rows: &'a [Row],
    pub total_wrong: usize,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub plans: &'a [LoadedPlan],
}

/// Serialises `report` with two-space indentation.
pub fn to_json(report: &JsonReport<'_>) -> String {
    serde_json::to_string_pretty(report)
        .unwrap_or_else(|e| format!("{{\"error\": \"serialising the report: {e}\"}}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::{Collective, DataType};

    fn row(vs: bool) -> Row {
        let shape = Shape::new(Collective::AllReduce, DataType::F32, 1 << 20, 2).expect("shape");
        let mut m = Measure::new(&shape, 20.0, 0, None);
        if vs {
            m.nccl_time_us = Some(25.0);
        }
        Row {
            collective: "allreduce".into(),
            size_bytes: shape.size_bytes,
            count: shape.count,
            dtype: "f32".into(),
            redop: "sum".into(),
            root: -1,
            algorithm: "default_allreduce_packet".into(),
            out_of_place: Outcome::Measured(m),
            in_place: Outcome::Skipped("too large for the scratch".into()),
        }
    }

    /// A row with one measured placement ran something; one whose requested placements all
    /// skipped is reported with its first reason; placements not requested do not count.
    #[test]
    fn rows_that_ran_nothing_are_named_with_the_reason() {
        let measured = row(false);
        let mut skipped = row(false);
        skipped.out_of_place =
            Outcome::Skipped("no algorithm for allreduce: the ranks span several hosts".into());
        let mut one_requested = row(false);
        one_requested.out_of_place = Outcome::NotRequested;
        let mut nothing_requested = row(false);
        nothing_requested.out_of_place = Outcome::NotRequested;
        nothing_requested.in_place = Outcome::NotRequested;
        let got = rows_that_ran_nothing(&[measured, skipped, one_requested, nothing_requested]);
        assert_eq!(
            got,
            vec![
                "allreduce 1048576 B f32 sum: no algorithm for allreduce: the ranks span several hosts"
                    .to_string(),
                "allreduce 1048576 B f32 sum: too large for the scratch".to_string(),
            ]
        );
    }

    #[test]
    fn table_columns_line_up_with_the_header() {
        for vs in [false, true] {
            let h = header(vs);
            let line = format_row(&row(vs), vs);
            let titles = h.lines().nth(1).expect("second header line");
            // The algorithm column starts at the same place in the header and in the row.
            let at_header = titles.find("algorithm").expect("algorithm title");
            let at_row = line
                .find("default_allreduce_packet")
                .expect("algorithm cell");
            assert_eq!(at_header, at_row, "\n{h}{line}");
            assert!(line.contains("1048576"), "{line}");
            assert!(line.contains("262144"), "{line}");
            // 1 MiB in 20 us: 52.43 GB/s algbw, and the same busbw at 2 ranks.
            assert!(line.contains("52.43"), "{line}");
            assert!(line.contains("skipped"), "{line}");
            if vs {
                assert!(line.contains(" 0.80"), "ratio 20/25: {line}");
                assert!(h.contains("ratio") && h.contains("nccl"), "{h}");
            } else {
                assert!(!h.contains("ratio"), "{h}");
            }
        }
    }

    #[test]
    fn notes_and_wrong_counts() {
        let mut r = row(false);
        if let Outcome::Measured(m) = &mut r.out_of_place {
            m.wrong = 3;
            m.first_wrong = Some("element 7: got 1, expected 2".into());
            m.nccl_note = Some("NCCL has no data type for fp8_e4m3b15".into());
        }
        assert_eq!(r.wrong(), 3);
        let notes = row_notes(&r).join("\n");
        assert!(notes.contains("3 wrong; first: element 7"), "{notes}");
        assert!(notes.contains("in-place skipped: too large"), "{notes}");
        assert!(notes.contains("no NCCL time"), "{notes}");
    }

    #[test]
    fn json_has_every_row_and_field() {
        let rows = vec![row(true)];
        let j = to_json(&JsonReport {
            device: "NVIDIA H200 x2",
            nccl: "2.28.9",
            nranks: 2,
            collective: "allreduce",
            mode: "eager".into(),
            iters: 20,
            warmup: 5,
            batches: 5,
            graph_replays: 0,
            tolerance: "exact",
            rows: &rows,
            total_wrong: 0,
            plans: &[],
        });
        let v: serde_json::Value = serde_json::from_str(&j).expect("valid JSON");
        assert!(v.get("plans").is_none(), "no --plan, no plans key: {j}");
        let r = &v["rows"][0];
        assert_eq!(r["size_bytes"], 1 << 20);
        assert_eq!(r["out_of_place"]["measured"]["nccl_time_us"], 25.0);
        assert_eq!(r["in_place"]["skipped"], "too large for the scratch");
        assert_eq!(v["device"], "NVIDIA H200 x2");
        assert_eq!(v["total_wrong"], 0);
    }

    /// The plans loaded are reported with their range and buffer mode (scripts/plan-bench.py
    /// reads them to tell the sizes a plan takes from those it refuses).
    #[test]
    fn json_reports_the_loaded_plans() {
        let plans = vec![LoadedPlan {
            name: "allreduce_pkt".into(),
            collective: "allreduce",
            world_size: 2,
            min_bytes: 0,
            max_bytes: 50 << 20,
            in_place: true,
        }];
        let j = to_json(&JsonReport {
            device: "d",
            nccl: "n",
            nranks: 2,
            collective: "allreduce",
            mode: "eager".into(),
            iters: 1,
            warmup: 1,
            batches: 1,
            graph_replays: 0,
            tolerance: "exact",
            rows: &[],
            total_wrong: 0,
            plans: &plans,
        });
        let v: serde_json::Value = serde_json::from_str(&j).expect("valid JSON");
        let p = &v["plans"][0];
        assert_eq!(p["name"], "allreduce_pkt");
        assert_eq!(p["collective"], "allreduce");
        assert_eq!(p["world_size"], 2);
        assert_eq!(p["max_bytes"], 50 << 20);
        assert_eq!(p["in_place"], true);
        assert_eq!(
            plans[0].describe(),
            "# plan allreduce_pkt (allreduce, 2 ranks, 0..=52428800 bytes, in place)"
        );
    }
}
