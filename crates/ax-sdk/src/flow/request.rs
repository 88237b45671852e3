//! The flow API's requests (`ax.flow.<op>`, PROTOCOL.md §6) as one typed enum.

use super::model::RunState;
use super::rerun::RerunMode;
use crate::api::{Api, Request};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A request to the flow API: the variant is the operation, its content the body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "body", rename_all = "snake_case")]
pub enum FlowRequest {
    /// Store a flow definition. Its body stays JSON here: the server checks it field by
    /// field ([`FlowDef::decode`](super::FlowDef::decode)) to name the field at fault.
    Put(Value),
    /// One definition.
    Def(FlowName),
    /// Every definition, in short.
    Defs {},
    /// Delete a definition (its runs stay).
    Delete(FlowName),
    /// Start a run.
    Run(FlowStart),
    /// One run with its steps.
    Get(RunRef),
    /// Runs, newest first.
    List(RunFilter),
    /// Which server's flow engine drives the runs now.
    Leader {},
    /// Cancel a run.
    Cancel(RunRef),
    /// Re-run an ended run.
    Rerun(FlowRerun),
    /// Approve or reject an approval by its token (whoever holds it).
    Approve(ax_core::event::ApprovalCompletion),
    /// Approve or reject an approval by its wait task id (an operator).
    ApproveTask(ax_core::event::ApprovalCompletion),
    /// The approvals waiting (without their tokens).
    Approvals {},
    /// An operation this enum does not have (never sent).
    #[doc(hidden)]
    #[serde(other)]
    Unknown,
}

/// Names one flow definition: `{"name"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowName {
    /// The flow's name.
    pub name: String,
}

/// Starts a run: `{"flow", "input"?, "business_id"?, "singleton"?}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowStart {
    /// The flow's name.
    pub flow: String,
    /// The run's input (default `null`).
    #[serde(default)]
    pub input: Value,
    /// The business id the run works for (an order number): every step task carries it
    /// (`business_id` of their submits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub business_id: Option<String>,
    /// The run's singleton key: while a run of this flow holding the key has not ended, a
    /// start with it does what `on_collision` says — `cancel_new` (refused: `running`,
    /// `run_id` the holder) or `cancel_in_progress` (the holder is cancelled, its running
    /// step tasks' handlers told) (docs/PROTOCOL.md §6, "Singleton runs").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub singleton: Option<ax_core::protocol::SingletonRequest>,
}

impl FlowStart {
    /// A start of flow `flow` with `input` (no business id, no singleton key).
    pub fn new(flow: impl Into<String>, input: Value) -> FlowStart {
        FlowStart {
            flow: flow.into(),
            input,
            ..FlowStart::default()
        }
    }

    /// With singleton key `key` (1..=64 of `A-Z a-z 0-9 _ - . : @`): a run of this flow
    /// holding it that has not ended makes this start do what `on_collision` says.
    pub fn singleton(
        mut self,
        key: impl Into<String>,
        on_collision: crate::Collision,
    ) -> FlowStart {
        self.singleton = Some(ax_core::protocol::SingletonRequest {
            key: key.into(),
            on_collision: on_collision.as_str().into(),
        });
        self
    }
}

/// Names one run: `{"run"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunRef {
    /// The run's id.
    pub run: String,
}

/// Picks runs: `{"flow"?, "state"?, "limit"?}` (default: any, 100 at most).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunFilter {
    /// Only runs of this flow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow: Option<String>,
    /// Only runs in this state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<RunState>,
    /// At most this many (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
}

/// Re-runs an ended run: `{"run", "mode", "input"?}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowRerun {
    /// The run's id.
    pub run: String,
    /// What to run again.
    pub mode: RerunMode,
    /// A new input (mode `whole` only; default: the original run's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<Value>,
}

impl Request for FlowRequest {
    const API: Api = Api::Flow;
    fn is_unknown(&self) -> bool {
        matches!(self, FlowRequest::Unknown)
    }
}
