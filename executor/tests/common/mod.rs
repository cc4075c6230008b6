//! The fixture plans the tests start from.

use std::path::PathBuf;

/// The shared fixtures live beside the repository (../shared/fixtures/plans); CI checks them out there.
fn fixture_dir() -> Option<PathBuf> {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let candidates = [
        std::env::var_os("MSCCLPP_PLAN_FIXTURES").map(PathBuf::from),
        Some(here.join("../../shared/fixtures/plans")),
        Some(here.join("../shared/fixtures/plans")),
        Some(PathBuf::from("/work/shared/fixtures/plans")),
    ];
    candidates.into_iter().flatten().find(|p| p.is_dir())
}

pub fn fixtures() -> Vec<(String, Vec<u8>)> {
    let Some(dir) = fixture_dir() else {
        eprintln!("skipped: no fixture plans found (set MSCCLPP_PLAN_FIXTURES)");
        return Vec::new();
    };
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}
