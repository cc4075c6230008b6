//! Logging through `tracing`, configured from [`Env`].
//!
//! Each subsystem of `MSCCLPP_DEBUG_SUBSYS` is a `tracing` target (see [`target`]); code logs with
//! `tracing::info!(target: log::target::NET, ...)`. The filter works like NCCL's:
//! - the level (`MSCCLPP_LOG_LEVEL` / `MSCCLPP_DEBUG`) bounds everything; unset means `ERROR`, the
//!   MSCCL++ default;
//! - the subsystem list decides which subsystems may log below `WARN`; warnings and errors pass
//!   whatever the list says, because a user narrowing the list to `NET` still needs to see why a
//!   collective failed elsewhere;
//! - events with any other target (a module path) are treated like an enabled subsystem when the
//!   list is `ALL`, and like a disabled one otherwise;
//! - `VERSION` prints the version banner only, `NONE`/`OFF` prints nothing.
//!
//! Output goes to the log file (`MSCCLPP_LOG_FILE`, appended to) or to stderr.

use crate::env::{Env, LogLevel, Subsystem};
use crate::error::{Error, Result};
use std::fs::OpenOptions;
use std::sync::{Mutex, OnceLock};
use tracing::level_filters::LevelFilter;
use tracing::Subscriber;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;

/// The `tracing` target of each subsystem.
pub mod target {
    pub const ENV: &str = "mscclpp::env";
    pub const GPU: &str = "mscclpp::gpu";
    pub const NET: &str = "mscclpp::net";
    pub const CONN: &str = "mscclpp::conn";
    pub const EXEC: &str = "mscclpp::exec";
    pub const NCCL: &str = "mscclpp::nccl";
    pub const ALGO: &str = "mscclpp::algo";
    /// The version banner; shown at `VERSION` and at `INFO` or louder.
    pub const VERSION: &str = "mscclpp::version";
}

/// The target a subsystem logs under.
pub const fn target_of(subsystem: Subsystem) -> &'static str {
    match subsystem {
        Subsystem::Env => target::ENV,
        Subsystem::Gpu => target::GPU,
        Subsystem::Net => target::NET,
        Subsystem::Conn => target::CONN,
        Subsystem::Exec => target::EXEC,
        Subsystem::Nccl => target::NCCL,
        Subsystem::Algo => target::ALGO,
    }
}

/// Level used when neither `MSCCLPP_LOG_LEVEL` nor `MSCCLPP_DEBUG` is set (MSCCL++'s default).
pub const DEFAULT_LEVEL: LogLevel = LogLevel::Error;

fn level_filter(level: LogLevel) -> LevelFilter {
    match level {
        LogLevel::Off | LogLevel::Version => LevelFilter::OFF,
        // ABORT keeps only what precedes an abort, which we log as errors.
        LogLevel::Abort | LogLevel::Error => LevelFilter::ERROR,
        LogLevel::Warn => LevelFilter::WARN,
        LogLevel::Info => LevelFilter::INFO,
        LogLevel::Debug => LevelFilter::DEBUG,
        LogLevel::Trace => LevelFilter::TRACE,
    }
}

/// The per-target filter described in the module docs.
pub fn filter(env: &Env) -> Targets {
    let level = env.log_level.unwrap_or(DEFAULT_LEVEL);
    let full = level_filter(level);
    // What a disabled subsystem keeps: warnings and errors, never more than the level allows.
    let quiet = full.min(LevelFilter::WARN);
    let default = if env.debug_subsys.is_all() {
        full
    } else {
        quiet
    };
    let mut targets = Targets::new().with_default(default);
    for sub in Subsystem::ALL {
        let lf = if env.debug_subsys.contains(sub) {
            full
        } else {
            quiet
        };
        targets = targets.with_target(target_of(sub), lf);
    }
    let version = if level == LogLevel::Version || full >= LevelFilter::INFO {
        LevelFilter::INFO
    } else {
        LevelFilter::OFF
    };
    targets.with_target(target::VERSION, version)
}

/// A subscriber for `env` without installing it: tests use it with
/// `tracing::subscriber::with_default`, and [`init_logging`] installs it globally.
pub fn subscriber(env: &Env) -> Result<Box<dyn Subscriber + Send + Sync>> {
    let base = tracing_subscriber::registry().with(filter(env));
    match &env.log_file {
        Some(path) => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(|e| {
                    Error::io(
                        format!(
                            "creating the directory of the log file {} (MSCCLPP_LOG_FILE)",
                            path.display()
                        ),
                        e,
                    )
                })?;
            }
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| {
                    Error::io(
                        format!("opening the log file {} (MSCCLPP_LOG_FILE)", path.display()),
                        e,
                    )
                })?;
            let layer = tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_thread_ids(true)
                .with_writer(Mutex::new(file));
            Ok(Box::new(base.with(layer)))
        }
        None => {
            let layer = tracing_subscriber::fmt::layer()
                .with_thread_ids(true)
                .with_writer(std::io::stderr);
            Ok(Box::new(base.with(layer)))
        }
    }
}

static INSTALLED: OnceLock<()> = OnceLock::new();

/// Installs the global subscriber for `env`. Idempotent: later calls do nothing. If the
/// application already installed its own global subscriber, ours is not forced on it (our events
/// then go to theirs) and this still returns `Ok`.
pub fn init_logging(env: &Env) -> Result<()> {
    if INSTALLED.get().is_some() {
        return Ok(());
    }
    let sub = subscriber(env)?;
    let ours = tracing::subscriber::set_global_default(sub).is_ok();
    // Two threads may race here; only the one whose subscriber was installed logs the banner.
    if INSTALLED.set(()).is_ok() && ours {
        log_environment(env);
    }
    Ok(())
}

/// Logs the version and the variables in effect (like MSCCL++ at start-up), and warns about
/// unknown `MSCCLPP_*` names, which are usually typos.
pub fn log_environment(env: &Env) {
    tracing::info!(target: target::VERSION, "mscclpp-rs version {}", env!("CARGO_PKG_VERSION"));
    for (var, value) in &env.recognized {
        tracing::info!(target: target::ENV, "{var}={value}");
    }
    for var in &env.unknown {
        tracing::warn!(target: target::ENV, "{var} is set but is not an mscclpp-rs variable (typo?)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;
    use tracing::Level;

    fn env(pairs: &[(&str, &str)]) -> Env {
        Env::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()))).unwrap()
    }

    fn enabled(env: &Env, target: &str, level: Level) -> bool {
        filter(env).would_enable(target, &level)
    }

    #[rstest]
    #[case(&[], target::NET, Level::ERROR, true)]
    #[case(&[], target::NET, Level::WARN, false)]
    #[case(&[("MSCCLPP_DEBUG", "INFO")], target::NET, Level::INFO, true)]
    #[case(&[("MSCCLPP_DEBUG", "INFO")], target::NET, Level::DEBUG, false)]
    #[case(&[("MSCCLPP_DEBUG", "INFO"), ("MSCCLPP_DEBUG_SUBSYS", "NET")], target::NET, Level::INFO, true)]
    #[case(&[("MSCCLPP_DEBUG", "INFO"), ("MSCCLPP_DEBUG_SUBSYS", "NET")], target::CONN, Level::INFO, false)]
    #[case(&[("MSCCLPP_DEBUG", "INFO"), ("MSCCLPP_DEBUG_SUBSYS", "NET")], target::CONN, Level::WARN, true)]
    #[case(&[("MSCCLPP_DEBUG", "INFO"), ("MSCCLPP_DEBUG_SUBSYS", "^NET")], target::NET, Level::INFO, false)]
    #[case(&[("MSCCLPP_DEBUG", "TRACE")], "mscclpp_core::bootstrap", Level::TRACE, true)]
    #[case(&[("MSCCLPP_DEBUG", "TRACE"), ("MSCCLPP_DEBUG_SUBSYS", "GPU")], "mscclpp_core::bootstrap", Level::DEBUG, false)]
    #[case(&[("MSCCLPP_DEBUG", "NONE")], target::NET, Level::ERROR, false)]
    #[case(&[("MSCCLPP_DEBUG", "VERSION")], target::VERSION, Level::INFO, true)]
    #[case(&[("MSCCLPP_DEBUG", "VERSION")], target::ENV, Level::ERROR, false)]
    #[case(&[("MSCCLPP_DEBUG", "WARN")], target::VERSION, Level::INFO, false)]
    #[case(&[("MSCCLPP_DEBUG", "ABORT")], target::EXEC, Level::ERROR, true)]
    fn filter_decisions(
        #[case] pairs: &[(&str, &str)],
        #[case] target: &'static str,
        #[case] level: Level,
        #[case] want: bool,
    ) {
        assert_eq!(
            enabled(&env(pairs), target, level),
            want,
            "{pairs:?} {target} {level}"
        );
    }

    #[test]
    fn file_gets_enabled_subsystem_only() {
        let dir = std::env::temp_dir().join(format!("mscclpp-log-test-{}", std::process::id()));
        let path = dir.join("sub").join("log.%p.txt");
        let e = env(&[
            ("MSCCLPP_LOG_LEVEL", "INFO"),
            ("MSCCLPP_DEBUG_SUBSYS", "NET,ALGO"),
            ("MSCCLPP_LOG_FILE", path.to_str().unwrap()),
        ]);
        let sub = subscriber(&e).unwrap();
        tracing::subscriber::with_default(sub, || {
            tracing::info!(target: target::NET, "net-line-visible");
            tracing::info!(target: target::ALGO, "algo-line-visible");
            tracing::info!(target: target::CONN, "conn-line-hidden");
            tracing::debug!(target: target::NET, "net-debug-hidden");
            tracing::warn!(target: target::CONN, "conn-warning-visible");
        });
        let text = std::fs::read_to_string(e.log_file.as_ref().unwrap()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(text.contains("net-line-visible"), "{text}");
        assert!(text.contains("algo-line-visible"), "{text}");
        assert!(text.contains("conn-warning-visible"), "{text}");
        assert!(!text.contains("conn-line-hidden"), "{text}");
        assert!(!text.contains("net-debug-hidden"), "{text}");
    }

    #[test]
    fn unopenable_log_file_names_the_path() {
        let e = env(&[("MSCCLPP_LOG_FILE", "/proc/no-such-dir/x.log")]);
        let msg = subscriber(&e)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            msg.contains("/proc/no-such-dir") && msg.contains("MSCCLPP_LOG_FILE"),
            "{msg}"
        );
    }
}
