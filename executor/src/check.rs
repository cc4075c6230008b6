//! `plan-check`: loads plan files, proves each with the reference interpreter, one line per plan.

use crate::plan::Plan;
use crate::reference::{plan_reduce_op, prove, CHUNK_ELEMS_TRIED};
use std::path::{Path, PathBuf};

/// The outcome for one plan file: the line to print, and whether it passed.
pub struct CheckLine {
    pub text: String,
    pub ok: bool,
}

/// Expands directories into their `.json` files (sorted), keeping files as given.
pub fn plan_files(args: &[PathBuf]) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for a in args {
        if a.is_dir() {
            let mut inside: Vec<PathBuf> = std::fs::read_dir(a)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
                .collect();
            inside.sort();
            out.extend(inside);
        } else {
            out.push(a.clone());
        }
    }
    Ok(out)
}

/// Checks one plan file; `ranks`, when given, is the world size the user expects it to be for.
pub fn check_file(path: &Path, ranks: Option<usize>) -> CheckLine {
    let name = path.display().to_string();
    match Plan::load(path) {
        Ok(plan) => check_plan(&name, &plan, ranks),
        Err(e) => CheckLine {
            text: format!("{name}: FAILED: {e}"),
            ok: false,
        },
    }
}

/// Proves one parsed and validated plan (what [`check_file`] does once the file is loaded; the
/// Python package's DSL tests call it on the plans they generate, without writing files). `name`
/// heads the line.
pub fn check_plan(name: &str, plan: &Plan, ranks: Option<usize>) -> CheckLine {
    let fail = |why: String| CheckLine {
        text: format!("{name}: FAILED: {why}"),
        ok: false,
    };
    if let Some(n) = ranks.filter(|&n| n != plan.world_size()) {
        return fail(format!("written for {} ranks, not {n}", plan.world_size()));
    }
    match prove(plan) {
        Ok(sizes) => CheckLine {
            text: format!(
                "{name}: ok: {} ({}) over {} ranks, {} protocol{}{}, every dtype, chunks of {:?} elements \
                 (f32 input bytes per rank {:?})",
                format!("{:?}", plan.collective).to_lowercase(),
                reduce_name(plan),
                plan.world_size(),
                format!("{:?}", plan.protocol).to_uppercase().replace("SIMPLE", "Simple"),
                if plan.needs_switch() { ", switch channels emulated" } else { "" },
                added_handshakes(plan),
                CHUNK_ELEMS_TRIED,
                sizes
            ),
            ok: true,
        },
        Err(e) => fail(e.to_string()),
    }
}

/// What the loader added to the plan's own ops ([`crate::call_bounds`]), for the line.
fn added_handshakes(plan: &Plan) -> &'static str {
    let tbs = || plan.gpus.iter().flat_map(|g| &g.threadblocks);
    let entry = tbs().any(|tb| tb.added.entry > 0);
    let exit = tbs().any(|tb| tb.added.exit > 0);
    match (entry, exit) {
        (false, false) => "",
        (true, false) => ", with the entry handshake the loader added",
        (false, true) => ", with the exit handshake the loader added",
        (true, true) => ", with the entry and exit handshakes the loader added",
    }
}

fn reduce_name(plan: &Plan) -> String {
    match plan_reduce_op(plan) {
        Ok(op) => format!("{op:?}").to_lowercase(),
        Err(e) => e.to_string(),
    }
}
