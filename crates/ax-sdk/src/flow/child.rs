//! Child flows: a step that starts a run of another flow (or of the same one, nested) and
//! ends when that run ends, its output the child's leaf steps' outputs by name
//! (docs/PROTOCOL.md §6, "Child flows"). A fan-out step starts one child run per item.
//!
//! ```yaml
//! - name: per_order
//!   needs: [orders]
//!   for_each: orders                  # one child run per order
//!   child_flow: {flow: invoice, input: "$item", timeout_ms: 3600000}
//! ```

use crate::error::WireError;
use crate::names;
use serde::{Deserialize, Serialize};

/// The name of a child flow step's wait task.
pub const CHILD_FLOW_TASK: &str = "ax.child_flow";

/// A step that runs flow `flow` as a child run and ends with it: succeeded with the
/// child's output (`{<leaf step>: <its output>}` for each leaf step that succeeded),
/// failed when the child failed (class `child_failed`) or was cancelled
/// (`child_cancelled`), or at its timeout as `on_timeout` says (the child is then
/// cancelled). The parent's cancel cancels the child. A step starts at most 1,000 child
/// runs (class `fan_out_too_large` past it), and children nest at most 8 levels deep
/// (class `too_deep`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildFlowDef {
    /// The flow to run: its definition as stored when the step starts.
    pub flow: String,
    /// The child run's input: JSON whose `"$…"` strings are read from the step's input
    /// document (`"$item"`, `"$input.order"`, `"$parents.<step>"`; `"$$…"` is the literal
    /// `"$…"`). Default `"$item"` in a fan-out step, else `"$input"` (the parent run's
    /// input).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<serde_json::Value>,
    /// How long the step waits for the child (1 ..= the server's max delay, the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// What a timeout does: `fail` the step (default; class `child_timed_out`) or
    /// `continue` with output `null`; either way the child run is cancelled.
    #[serde(default)]
    pub on_timeout: ax_core::event::OnTimeout,
    /// The queue whose delayed tasks hold the step's timeout (no worker of it runs
    /// anything for it); default: the queue of the flow's first step with a task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

impl ChildFlowDef {
    /// A child run of `flow` with the default input, no timeout but the server's max
    /// delay, failing at it.
    pub fn new(flow: impl Into<String>) -> ChildFlowDef {
        ChildFlowDef {
            flow: flow.into(),
            ..ChildFlowDef::default()
        }
    }
}

/// A child flow step (`other_wait`: it also sleeps or waits for something else; `task`:
/// its task, filled in by the decode): no other kind of wait, a valid flow name, a
/// timeout within the max delay, no task of its own, a queue for its timer (it may fan
/// out).
pub(super) fn check_child_flow(
    child: &ChildFlowDef,
    other_wait: bool,
    task: &crate::protocol::SubmitRequest,
    limits: &crate::task::Limits,
) -> Result<(), WireError> {
    if other_wait {
        return Err(WireError::field(
            "child_flow",
            "a step sleeps, waits for an event, for an approval or for a child flow: one of them",
        ));
    }
    if !names::valid_token(&child.flow, 64) {
        return Err(WireError::field(
            "child_flow.flow",
            "must be 1..=64 of A-Z a-z 0-9 _ -",
        ));
    }
    let most = limits.max_delay.as_millis() as u64;
    if child.timeout_ms.is_some_and(|ms| ms == 0 || ms > most) {
        return Err(WireError::field(
            "child_flow.timeout_ms",
            format!("must be 1..={most} (the server's max delay)"),
        ));
    }
    if task.name != CHILD_FLOW_TASK {
        return Err(WireError::field(
            "task",
            "a child flow step has no task (its timer is a wait task ax runs itself)",
        ));
    }
    if !task.queue.as_deref().is_some_and(names::valid_queue) {
        return Err(WireError::field(
            "child_flow.queue",
            "a valid queue is required when no step of the flow has a task to take it from",
        ));
    }
    Ok(())
}
