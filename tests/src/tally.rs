//! The outcome of a section's checks, kept the same way by every section that runs a matrix of
//! collective checks (`p2p`, `alltoall`, `port_allreduce`): each check passes or fails, and fails
//! either after running to its end (wrong data) or before (an error on the way). After every check
//! the ranks agree on whether it ran to its end everywhere; after one that did not, every rank skips
//! the remaining checks together instead of each timing out in the next.

use crate::RankContext;
use mscclpp::core::{Error, Result};

/// Passed checks and failures of one row of a matrix.
#[derive(Debug, Default)]
pub struct Tally {
    passed: usize,
    failures: Vec<String>,
}

/// Whether a check that returned `r` ran to its end: it passed, or found wrong data
/// (`Error::Internal`, as the checks report it); any other error stopped it on the way.
pub fn ran_to_end(r: &Result<()>) -> bool {
    !matches!(r, Err(e) if !matches!(e, Error::Internal(_)))
}

impl Tally {
    /// Records check `what` with outcome `r` (`completed`: it ran to its end on this rank), then
    /// agrees with every rank. `Err(why)` when some rank did not complete it (or the ranks could
    /// not agree): the caller skips the remaining checks, as every rank does.
    pub fn record(
        &mut self,
        ctx: &RankContext,
        what: &str,
        r: Result<()>,
        completed: bool,
    ) -> std::result::Result<(), String> {
        match r {
            Ok(()) => self.passed += 1,
            Err(e) => self.failures.push(format!("{what}: {e}")),
        }
        match ctx.all_completed(completed) {
            Ok(true) => Ok(()),
            Ok(false) => Err(format!("a rank failed to complete {what}")),
            Err(e) => Err(format!("agreeing on {what}: {e}")),
        }
    }

    /// The row's outcome: `passed(count)` when every check passed and none stopped the section
    /// (`stopped`), else the failures, and why the remaining checks were skipped.
    pub fn outcome(
        mut self,
        stopped: &Option<String>,
        passed: impl FnOnce(usize) -> String,
    ) -> Result<String> {
        if self.failures.is_empty() && stopped.is_none() {
            return Ok(passed(self.passed));
        }
        if let Some(why) = stopped {
            self.failures
                .push(format!("remaining checks skipped: {why}"));
        }
        Err(Error::Internal(format!(
            "{} failed, {} passed: {}",
            self.failures.len(),
            self.passed,
            self.failures.join("; ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_data_runs_to_the_end_other_errors_do_not() {
        assert!(ran_to_end(&Ok(())));
        assert!(ran_to_end(&Err(Error::Internal("3 wrong bytes".into()))));
        assert!(!ran_to_end(&Err(Error::InvalidArgument("bad".into()))));
    }

    #[test]
    fn outcomes_name_failures_and_the_reason_to_stop() {
        let ok = Tally {
            passed: 3,
            failures: vec![],
        };
        assert_eq!(ok.outcome(&None, |n| format!("{n} ok")).unwrap(), "3 ok");
        let failed = Tally {
            passed: 2,
            failures: vec!["1 B eager: 1 wrong".into()],
        };
        let e = failed
            .outcome(&Some("a rank failed to complete x".into()), |_| {
                String::new()
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 failed, 2 passed: 1 B eager: 1 wrong; remaining checks skipped: a rank failed to complete x"), "{e}");
    }
}
