//! The shared library answers to `libnccl.so.2` (its SONAME), so it can stand in for NCCL on
//! `LD_LIBRARY_PATH` through a symlink of that name, and programs linked against it record the
//! NCCL name, not ours.
fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
