//! docs/nccl-shim.md, the table of how every export is served, against the code: one row per name
//! of `exports.txt` and no other, a known way of serving in each, and for the operations of
//! `src/ops.rs` the way their code takes (a native path or none).

use std::collections::BTreeMap;
use std::path::Path;

const CRATE: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &str) -> String {
    let p = Path::new(CRATE).join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn exports() -> Vec<String> {
    read("exports.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

/// The table's rows: export name -> how it is served.
fn table() -> BTreeMap<String, String> {
    let mut rows = BTreeMap::new();
    for line in read("../docs/nccl-shim.md").lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // "| `name` | served | how |" splits into ["", "`name`", served, how, ""].
        let Some(name) = cells
            .get(1)
            .and_then(|c| c.strip_prefix('`')?.strip_suffix('`'))
        else {
            continue;
        };
        let served = cells.get(2).copied().unwrap_or_default().to_string();
        assert!(
            rows.insert(name.to_string(), served).is_none(),
            "{name} has two rows"
        );
    }
    rows
}

#[test]
fn the_table_has_one_row_per_export() {
    let rows = table();
    let names = exports();
    for name in &names {
        let served = rows
            .get(name)
            .unwrap_or_else(|| panic!("docs/nccl-shim.md has no row for {name}"));
        assert!(
            ["native", "fallback", "error"].contains(&served.as_str()),
            "{name}: served {served:?}, expected native, fallback or error"
        );
    }
    for name in rows.keys() {
        assert!(
            names.contains(name),
            "docs/nccl-shim.md lists {name}, which exports.txt lacks"
        );
    }
}

/// An operation whose code builds a native call (`Native::Run`, or a `P2pOp` for the point-to-point
/// engine) is native in the table; one whose code has none (`Native::None` only) is not.
#[test]
fn operations_are_served_as_their_code_says() {
    let rows = table();
    let ops = read("src/ops.rs");
    let mut checked = 0;
    for block in ops.split("nccl_export! {").skip(1) {
        let Some(name) = block.trim_start().strip_prefix("fn ") else {
            continue;
        };
        let name = name.split_whitespace().next().unwrap_or_default();
        let (run, none) = (
            block.contains("Native::Run(") || block.contains("P2pOp {"),
            block.contains("Native::None("),
        );
        if !run && !none {
            continue;
        }
        let served = rows.get(name).map(String::as_str);
        let want = if run { "native" } else { "fallback" };
        assert_eq!(served, Some(want), "{name} in docs/nccl-shim.md");
        checked += 1;
    }
    assert!(
        checked >= 10,
        "only {checked} operations found in src/ops.rs"
    );
}
