//! The one error type of plan loading: where in the JSON, and why.

use std::fmt;

/// A plan that cannot be used: `path` is the JSON path of the offending value (`gpus[1].threadblocks[3]
/// .ops[7].src_buff[0].index`), empty for the document itself; `reason` says what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanError {
    pub path: String,
    pub reason: String,
}

impl PlanError {
    pub fn new(path: impl Into<String>, reason: impl Into<String>) -> Self {
        PlanError {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.reason)
        } else {
            write!(f, "{}: {}", self.path, self.reason)
        }
    }
}

impl std::error::Error for PlanError {}

pub type Result<T> = std::result::Result<T, PlanError>;
