//! Embeds the HIP code objects compiled ahead of time (`mscclpp-aot --hip`, see `src/aot.rs`) when
//! `MSCCLPP_AOT_HIP_BLOB` names their blob at build time; without it the build embeds nothing and
//! hiprtc compiles every kernel at run time, as in the test builds.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(mscclpp_aot_hip)");
    println!("cargo::rerun-if-env-changed=MSCCLPP_AOT_HIP_BLOB");
    let Some(blob) = std::env::var_os("MSCCLPP_AOT_HIP_BLOB").filter(|v| !v.is_empty()) else {
        return;
    };
    // A relative path would be taken from backend-rocm/ (where build scripts run) and by
    // include_bytes! from src/: only an absolute one means one file.
    let given = std::path::Path::new(&blob);
    if given.is_relative() {
        panic!(
            "MSCCLPP_AOT_HIP_BLOB={} must be an absolute path (scripts/aot-blob.sh --hip prints one)",
            given.display()
        );
    }
    let path = std::fs::canonicalize(given).unwrap_or_else(|e| {
        panic!(
            "MSCCLPP_AOT_HIP_BLOB={}: {e} (scripts/aot-blob.sh --hip builds the blob)",
            given.display()
        )
    });
    println!("cargo::rerun-if-changed={}", path.display());
    println!("cargo::rustc-cfg=mscclpp_aot_hip");
    println!(
        "cargo::rustc-env=MSCCLPP_AOT_HIP_BLOB_PATH={}",
        path.display()
    );
}
