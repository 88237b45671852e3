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

/// Starts a run: `{"flow", "input"?}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
