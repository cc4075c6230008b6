//! `MSCCLPP_NVRTC_LIB` handling. Its own test binary (one process) because it changes the
//! environment, which other tests read concurrently.

mod common;

use mscclpp_core::Error;
use mscclpp_cuda::Nvrtc;

#[test]
fn nvrtc_lib_variable_is_honoured_and_checked() {
    // A working NVRTC first, if any: where the environment points (scripts/test.sh sets the
    // variable to PyPI's NVRTC in a virtualenv, which the search without it does not look into).
    let found =
        common::nvrtc_or_skip("nvrtc_lib_variable (valid path)").map(|n| n.location().to_string());

    std::env::set_var("MSCCLPP_NVRTC_LIB", "/nonexistent/libnvrtc.so.13");
    match Nvrtc::load() {
        Err(Error::Env { var, value, .. }) => {
            assert_eq!(var, "MSCCLPP_NVRTC_LIB");
            assert_eq!(value, "/nonexistent/libnvrtc.so.13");
        }
        other => panic!("expected Error::Env, got {other:?}"),
    }

    let empty = std::env::temp_dir().join(format!("mscclpp-no-nvrtc-{}", std::process::id()));
    std::fs::create_dir_all(&empty).expect("mkdir");
    std::env::set_var("MSCCLPP_NVRTC_LIB", &empty);
    let err = Nvrtc::load().expect_err("a folder without NVRTC must fail");
    assert!(err.is_unavailable(), "{err}");
    assert!(err.to_string().contains("MSCCLPP_NVRTC_LIB"), "{err}");
    let _ = std::fs::remove_dir(&empty);

    if let Some(path) = found {
        std::env::set_var("MSCCLPP_NVRTC_LIB", &path);
        let n = Nvrtc::load().expect("explicit path to a working NVRTC");
        assert_eq!(n.location(), path);
    }
    std::env::remove_var("MSCCLPP_NVRTC_LIB");
}
