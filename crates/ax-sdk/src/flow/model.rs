//! What a flow run stores: the run (key `<run>` in `AX_FLOW_RUNS`) and one record per
//! step (key `<run>.<step>`), and the ids of step tasks.

use super::def::FlowDef;
use crate::state::ErrorInfo;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Where a run is. Every run ends `succeeded`, `failed` or `cancelled`, with a reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// Steps are running or waiting for their parents.
    Running,
    /// Every step ended and none failed.
    Succeeded,
    /// A step failed for good (the reason names it).
    Failed,
    /// Cancelled on request.
    Cancelled,
}

impl RunState {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Running => "running",
            RunState::Succeeded => "succeeded",
            RunState::Failed => "failed",
            RunState::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for RunState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a step is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepState {
    /// Its trigger rule is not met yet.
    #[default]
    Waiting,
    /// Its tasks are submitted and not all finished.
    Running,
    /// Every task of the step succeeded.
    Succeeded,
    /// A task of the step failed for good (or its input could not be built).
    Failed,
    /// It cannot run: a parent failed (rule `all_success`).
    UpstreamFailed,
    /// Its rule can no longer be met, and nothing failed (e.g. `one_failed` after all
    /// parents succeeded).
    Skipped,
    /// Cancelled: the run was cancelled, or failed fast before this step could start.
    Cancelled,
}

impl StepState {
    /// True once the step will not change again (until a re-run).
    pub fn is_terminal(self) -> bool {
        !matches!(self, StepState::Waiting | StepState::Running)
    }

    /// True for `failed` and `upstream_failed`.
    pub fn is_failure(self) -> bool {
        matches!(self, StepState::Failed | StepState::UpstreamFailed)
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            StepState::Waiting => "waiting",
            StepState::Running => "running",
            StepState::Succeeded => "succeeded",
            StepState::Failed => "failed",
            StepState::UpstreamFailed => "upstream_failed",
            StepState::Skipped => "skipped",
            StepState::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for StepState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A run (JSON at key `<run>` of `AX_FLOW_RUNS`). The definition is copied in at start,
/// so changing the flow never changes a run already going.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlowRun {
    /// Run id (`[A-Za-z0-9]{22}`).
    pub id: String,
    /// Flow name.
    pub flow: String,
    /// The definition the run follows.
    pub def: FlowDef,
    /// The run's input (JSON; `null` if none was given).
    #[serde(default)]
    pub input: serde_json::Value,
    /// Run state.
    pub state: RunState,
    /// Why the run ended as it did (set with every final state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Created, ms since the epoch.
    pub created_at_ms: u64,
    /// Last change, ms since the epoch.
    pub updated_at_ms: u64,
    /// When it reached a final state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    /// The run this one re-runs as a new run (lineage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rerun_of: Option<String>,
    /// Times this run was re-run from its failed steps.
    #[serde(default)]
    pub reruns: u32,
    /// Set by `cancel`; the engine ends the run `cancelled`.
    #[serde(default)]
    pub cancel_requested: bool,
    /// The business id the run works for (`business_id` of its start): every step task
    /// is submitted with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub business_id: Option<String>,
    /// The trigger whose fire started the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<String>,
    /// Why that trigger fired: `schedule`, `manual` or `event`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger_source: Option<String>,
    /// The scheduled time that fire stands for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduled_at_ms: Option<u64>,
    /// The step whose child this run is (a `child_flow` step of another run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentRef>,
    /// Fields this version does not know, kept as they were.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Where a child run comes from: the parent run, its step, the step's wait task (which
/// the child's end ends) and how deep the child is (1: a child of a run started
/// otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParentRef {
    /// The parent run's id.
    pub run: String,
    /// The parent's step.
    pub step: String,
    /// The step's wait task for this child.
    pub task: String,
    /// Levels below a run that has no parent.
    pub depth: u32,
}

/// One step of a run (JSON at key `<run>.<step>`; no key = `waiting`, epoch 0).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRun {
    /// Step state.
    pub state: StepState,
    /// Bumped by each re-run of the step; part of its task ids, so a re-run makes new tasks
    /// and a late finish of an old one is ignored.
    #[serde(default)]
    pub epoch: u32,
    /// Tasks of this epoch: 1, or the fan-out's item count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items: Option<u32>,
    /// When its rule was met and its tasks were submitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    /// When it reached a final state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    /// Most attempts any of its tasks took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    /// Why it failed, was skipped or cancelled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorInfo>,
}

/// The task id of item `i` of `step` in epoch `epoch` of `run`:
/// `<queue>.fl.<run>.<step>.<epoch>.<i>`. The same on every server and every retry, so a
/// re-submission is a no-op (message id, then the record's create-if-absent); the `fl`
/// token lets the engine follow only step tasks' records (`$KV.AX_TASKS.*.fl.>`).
pub fn step_task_id(queue: &str, run: &str, step: &str, epoch: u32, i: u32) -> String {
    format!("{queue}.fl.{run}.{step}.{epoch}.{i}")
}

/// A step task id taken apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepTask<'a> {
    /// Run id.
    pub run: &'a str,
    /// Step name.
    pub step: &'a str,
    /// Epoch.
    pub epoch: u32,
    /// Item index.
    pub item: u32,
}

/// Parses `<queue>.fl.<run>.<step>.<epoch>.<i>`.
pub fn parse_step_task(id: &str) -> Option<StepTask<'_>> {
    let mut parts = id.split('.');
    let (_queue, fl, run, step) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let epoch = parts.next()?.parse().ok()?;
    let item = parts.next()?.parse().ok()?;
    (fl == "fl" && parts.next().is_none()).then_some(StepTask {
        run,
        step,
        epoch,
        item,
    })
}

/// The key of a step's record.
pub fn step_key(run: &str, step: &str) -> String {
    format!("{run}.{step}")
}

/// True for a well-formed run id: 1..=64 of `A-Z a-z 0-9` (a NUID for runs started by
/// request, `t` + 32 hex digits for runs started by a trigger's fire).
pub fn valid_run_id(id: &str) -> bool {
    (1..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// The run id of the child run that wait task `task` (a `child_flow` step's) starts:
/// the same on every server and every retry, so starting it again is a no-op.
/// `c` + two 64-bit FNV-1a hashes in hex.
pub fn child_run_id(task: &str) -> String {
    format!("c{}", fnv_hex(task))
}

/// Two 64-bit FNV-1a hashes of `text` (different offset bases) in hex.
fn fnv_hex(text: &str) -> String {
    let fnv = |basis: u64| {
        text.bytes().fold(basis, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    format!(
        "{:016x}{:016x}",
        fnv(0xcbf2_9ce4_8422_2325),
        fnv(0x6c62_272e_07bb_0142)
    )
}

/// The run id of flow start `j` of trigger `trigger`'s fire `tag`: the same on every
/// server and every retry of that fire, so starting it again is a no-op (the run key's
/// create-if-absent). `t` + two 64-bit FNV-1a hashes (different offset bases) in hex.
pub fn trigger_run_id(trigger: &str, tag: &str, j: usize) -> String {
    format!("t{}", fnv_hex(&format!("{trigger}\u{0}{tag}\u{0}{j}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_task_ids_round_trip() {
        let id = step_task_id("media", "R1", "resize-2", 3, 17);
        assert_eq!(id, "media.fl.R1.resize-2.3.17");
        assert_eq!(
            parse_step_task(&id),
            Some(StepTask {
                run: "R1",
                step: "resize-2",
                epoch: 3,
                item: 17
            })
        );
        assert_eq!(parse_step_task("media.tr.x.1.0"), None);
        assert_eq!(parse_step_task("media.fl.R1.s.x.0"), None);
        assert_eq!(parse_step_task("media.fl.R1.s.0.0.9"), None);
        let id = trigger_run_id("nightly", "1764400000000", 0);
        assert_eq!(id, trigger_run_id("nightly", "1764400000000", 0));
        assert_ne!(id, trigger_run_id("nightly", "1764400000000", 1));
        assert!(valid_run_id(&id) && id.len() == 33, "{id}");
        let child = child_run_id("q.fl.R1.s.0.3");
        assert_eq!(child, child_run_id("q.fl.R1.s.0.3"));
        assert_ne!(child, child_run_id("q.fl.R1.s.1.3"));
        assert!(valid_run_id(&child) && child.starts_with('c'), "{child}");
    }
}
