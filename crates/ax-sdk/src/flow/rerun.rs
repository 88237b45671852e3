//! The re-run modes of `ax.flow.rerun`.

use serde::Deserialize;

/// What a re-run starts again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RerunMode {
    /// The steps that did not succeed; succeeded steps keep their outputs.
    Failed,
    /// Those, and every step downstream of a failed one (even if it succeeded).
    FailedAndDownstream,
    /// The whole run, as a new run linked to this one (`rerun_of`).
    Whole,
}
