//! Process-wide paths of env + logging: `Env::get` reads the real environment and `init_logging`
//! installs the global subscriber. This file holds one test so that nothing else in the process
//! races on the environment or the global subscriber.

use mscclpp_core::env::Env;
use mscclpp_core::log::{init_logging, target};

#[test]
fn global_env_and_logging() {
    let dir = std::env::temp_dir().join(format!("mscclpp-env-logging-{}", std::process::id()));
    let file = dir.join("run.%p.log");
    // SAFETY (edition 2021: set_var is safe, but it is only sound while no other thread reads the
    // environment): this is the only test in this binary and it runs before anything else starts.
    std::env::set_var("MSCCLPP_LOG_LEVEL", "info");
    std::env::set_var("MSCCLPP_DEBUG_SUBSYS", "ENV,NET");
    std::env::set_var("MSCCLPP_LOG_FILE", &file);
    std::env::set_var("MSCCLPP_NOT_A_VARIABLE", "1");

    let env = Env::get().expect("the environment set above is valid");
    assert!(std::ptr::eq(env, Env::get().expect("second call")));
    init_logging(env).expect("installing the subscriber");
    init_logging(env).expect("a second init is a no-op");

    tracing::info!(target: target::NET, "net-visible");
    tracing::info!(target: target::GPU, "gpu-hidden");

    let path = env.log_file.clone().expect("log file parsed");
    let text = std::fs::read_to_string(&path).expect("log file written");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(text.contains("mscclpp-rs version"), "{text}");
    assert!(text.contains("MSCCLPP_DEBUG_SUBSYS=ENV,NET"), "{text}");
    assert!(
        text.contains("MSCCLPP_NOT_A_VARIABLE is set but is not"),
        "{text}"
    );
    assert!(text.contains("net-visible"), "{text}");
    assert!(!text.contains("gpu-hidden"), "{text}");
    assert_eq!(text.matches("mscclpp-rs version").count(), 1, "{text}");
}
