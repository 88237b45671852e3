//! Flow definitions: named steps, `needs:` edges, fan-out, trigger rules, a failure
//! policy; checked whole before anything is stored.
//!
//! ```yaml
//! name: thumbnails
//! failure: fail_fast          # or continue
//! steps:
//!   - name: list
//!     task: {name: list_images, queue: media}
//!   - name: resize
//!     needs: [list]
//!     for_each: list          # one task per item of list's output (a JSON array)
//!     task: {name: resize, queue: media}
//!   - name: report
//!     needs: [resize]         # gets resize's outputs as one list, in item order
//!     task: {name: report, queue: media}
//!   - name: cleanup
//!     needs: [resize]
//!     trigger: one_failed     # a compensation step: runs only if a parent failed
//!     task: {name: cleanup, queue: media}
//! ```

use crate::error::{ErrorCode, WireError};
use crate::names;
use crate::protocol::SubmitRequest;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Most steps in one flow.
pub const MAX_STEPS: usize = 1_000;
/// Most parents of one step.
pub const MAX_NEEDS: usize = 64;
/// Most tasks one `for_each` step fans out to (a longer list fails the step).
pub const MAX_FAN_OUT: usize = 10_000;
const MAX_NAME: usize = 64;

/// What a flow does when a step fails for good.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailurePolicy {
    /// Every step not started yet that depends on the failed one ends `upstream_failed`,
    /// queued ones are cancelled, running ones finish; the run ends `failed`.
    #[default]
    FailFast,
    /// Branches that do not depend on the failed step go on.
    Continue,
}

/// When a step runs, given how its parents ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TriggerRule {
    /// Every parent succeeded.
    #[default]
    AllSuccess,
    /// Every parent ended, whatever the outcome (the step sees their errors).
    AllDone,
    /// At least one parent failed (a compensation or cleanup step).
    OneFailed,
}

/// What a step's failure does to the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnFailure {
    /// The failure counts: its dependants follow their trigger rules, the failure policy
    /// applies, and the run ends `failed`.
    #[default]
    Fail,
    /// The failure only alerts (the task's dead letter raises its `task_dead` alert): the
    /// step ends `failed`, but for its dependants and for the run it counts as done —
    /// `all_success` children run (the step's output absent from `parents`, its error in
    /// `errors`), no fail-fast, and the run can still succeed.
    NotifyOnly,
}

impl OnFailure {
    fn is_fail(&self) -> bool {
        *self == OnFailure::Fail
    }
}

/// One step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepDef {
    /// Name, unique in the flow, 1..=64 of `A-Z a-z 0-9 _ -`.
    pub name: String,
    /// The steps this one waits for.
    #[serde(default)]
    pub needs: Vec<String>,
    /// Fan out: one task per item of this parent's output (a JSON array).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub for_each: Option<String>,
    /// When the step runs.
    #[serde(default)]
    pub trigger: TriggerRule,
    /// What its failure does (default `fail`).
    #[serde(default, skip_serializing_if = "OnFailure::is_fail")]
    pub on_failure: OnFailure,
    /// The task it submits: a submit request with a `queue`, and without `delay_ms`,
    /// `run_at` or `idempotency_key` (the flow keys each step's tasks itself). Its
    /// `payload`, if any, reaches the task as `args` (see `flow::input`). A sleep step
    /// gives none: [`FlowDef::decode`] fills in its wait task ([`SLEEP_TASK`]).
    #[serde(default)]
    pub task: SubmitRequest,
    /// A durable sleep instead of a task: the step succeeds (output `null`) once the time
    /// it names has come.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep: Option<SleepDef>,
    /// A wait for an event instead of a task: the step succeeds with the first matching
    /// event's payload as its output, or times out as its `on_timeout` says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_for_event: Option<WaitForEventDef>,
    /// An approval instead of a task: the step waits until its token is completed
    /// (approved: it succeeds with `{"decision": "approved", "payload"}`; rejected: it
    /// fails, class `approval_rejected`) or times out as its `on_timeout` says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalDef>,
    /// A child flow run instead of a task (one per item in a fan-out step): the step
    /// ends with it, its output the child's leaf outputs by name
    /// ([`ChildFlowDef`](super::child::ChildFlowDef)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub child_flow: Option<super::child::ChildFlowDef>,
}

impl StepDef {
    /// The wait task's name and queue of a wait step (a sleep, a wait for an event, an
    /// approval, a child flow); `None` for a step that runs a task.
    fn wait_kind(&self) -> Option<(&'static str, Option<&String>)> {
        if let Some(s) = &self.sleep {
            return Some((SLEEP_TASK, s.queue.as_ref()));
        }
        if let Some(w) = &self.wait_for_event {
            return Some((WAIT_FOR_EVENT_TASK, w.queue.as_ref()));
        }
        if let Some(a) = &self.approval {
            return Some((APPROVAL_TASK, a.queue.as_ref()));
        }
        let c = self.child_flow.as_ref()?;
        Some((super::child::CHILD_FLOW_TASK, c.queue.as_ref()))
    }
}

/// The name of an approval's wait task.
pub const APPROVAL_TASK: &str = "ax.approval";

/// An approval step: a token is drawn when the step starts (announced on
/// `ax.events.approval.requested`, docs/PROTOCOL.md §6, "Approvals"); whoever presents it
/// approves (with a payload) or rejects, once, until `timeout_ms` from the step's start.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalDef {
    /// What the approver is asked (at most 1,000 bytes), shown in the console and the
    /// announcement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// How long the step waits (1 ..= the server's max delay, the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// What a timeout does: `fail` the step (default; class `approval_timed_out`) or
    /// `continue` with output `null`.
    #[serde(default)]
    pub on_timeout: ax_core::event::OnTimeout,
    /// The queue whose delayed tasks hold the approval's timeout (no worker of it runs
    /// anything for it); default: the queue of the flow's first step with a task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

/// The name of a wait for an event's wait task.
pub const WAIT_FOR_EVENT_TASK: &str = "ax.wait_for_event";

/// What a step waits for: the first event `event` (published on `ax.events.<event>`)
/// whose payload has the values `match` names, stored at most `lookback_ms` before the
/// step started, or after; until `timeout_ms` from the step's start.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitForEventDef {
    /// The event name: 1..=8 dot-separated tokens of `A-Z a-z 0-9 _ -`.
    pub event: String,
    /// Dotted field path of the event's payload → the value it must equal. A string
    /// value `"$input.order_id"` or `"$parents.<step>.field"` is read from the step's
    /// input document (what a task of the step would get) when the step starts; `"$$…"`
    /// is the literal `"$…"`. Empty: any event of the name.
    #[serde(default, rename = "match")]
    pub matches: serde_json::Map<String, serde_json::Value>,
    /// How long the step waits (1 ..= the server's max delay, the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// What a timeout does: `fail` the step (default) or `continue` with output `null`.
    #[serde(default)]
    pub on_timeout: ax_core::event::OnTimeout,
    /// How long before the step's start a matching event still counts (default
    /// 300,000: 5 minutes; at most 3,600,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookback_ms: Option<u64>,
    /// The queue whose delayed tasks hold the wait's timeout (no worker of it runs
    /// anything for it); default: the queue of the flow's first step with a task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

/// A wait's lookback when its step gives none (5 minutes).
const DEFAULT_LOOKBACK_MS: u64 = 300_000;
/// The longest lookback a wait may ask for (an hour: what a server keeps of recent
/// events in memory to match new waits against).
const MAX_LOOKBACK_MS: u64 = 3_600_000;

impl WaitForEventDef {
    /// The lookback in ms (its default filled in).
    pub fn lookback(&self) -> u64 {
        self.lookback_ms.unwrap_or(DEFAULT_LOOKBACK_MS)
    }
}

/// The name of a sleep step's wait task.
pub const SLEEP_TASK: &str = "ax.sleep";

/// How long a sleep step sleeps: `for_ms` from the step's start, or `until` a time.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SleepDef {
    /// Milliseconds from the step's start (1 ..= the server's max delay, 30 days by
    /// default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub for_ms: Option<u64>,
    /// A time (RFC 3339); one in the past ends the sleep at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
    /// The queue whose delayed tasks hold the sleep's timer (no worker of it runs
    /// anything for it); default: the queue of the flow's first step with a task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

/// A flow definition. Decode with [`FlowDef::decode`], check with [`FlowDef::validate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowDef {
    /// Name, 1..=64 of `A-Z a-z 0-9 _ -`.
    pub name: String,
    /// Failure policy (default `fail_fast`).
    #[serde(default)]
    pub failure: FailurePolicy,
    /// The steps, in any order.
    pub steps: Vec<StepDef>,
}

/// A checked flow: each step's parents by index, and an order in which every step comes
/// after its parents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// `parents[i]`: the indexes of step `i`'s `needs`, in the order given.
    pub parents: Vec<Vec<usize>>,
    /// Every step index, parents first.
    pub order: Vec<usize>,
}

fn invalid(field: String, message: impl Into<String>) -> WireError {
    WireError::field(&field, message)
}

impl FlowDef {
    /// Decodes a definition, refusing unknown fields by name; a wait step (a sleep, a
    /// wait for an event) without a task gets its wait task ([`SLEEP_TASK`],
    /// [`WAIT_FOR_EVENT_TASK`], on the wait's queue).
    pub fn decode(value: serde_json::Value) -> Result<FlowDef, WireError> {
        let mut def: FlowDef = serde_json::from_value(value)
            .map_err(|e| WireError::new(ErrorCode::BadRequest, e.to_string()))?;
        let first_queue = def
            .steps
            .iter()
            .find(|s| s.wait_kind().is_none())
            .and_then(|s| s.task.queue.clone());
        for step in &mut def.steps {
            let Some((name, queue)) = step.wait_kind() else {
                continue;
            };
            if step.task == SubmitRequest::default() {
                let queue = queue.cloned();
                step.task = SubmitRequest {
                    name: name.into(),
                    queue: queue.or_else(|| first_queue.clone()),
                    ..SubmitRequest::default()
                };
            }
        }
        Ok(def)
    }

    /// Checks every field and the graph; the error names the field (`steps[2].needs`) and,
    /// for a cycle, the steps on it (`a → b → a`).
    pub fn validate(&self, limits: &crate::task::Limits) -> Result<Plan, WireError> {
        if !names::valid_token(&self.name, MAX_NAME) {
            return Err(invalid("name".into(), "must be 1..=64 of A-Z a-z 0-9 _ -"));
        }
        if self.steps.is_empty() || self.steps.len() > MAX_STEPS {
            return Err(invalid(
                "steps".into(),
                format!("give 1..={MAX_STEPS} steps"),
            ));
        }
        let mut index: HashMap<&str, usize> = HashMap::new();
        for (i, step) in self.steps.iter().enumerate() {
            if !names::valid_token(&step.name, MAX_NAME) {
                return Err(invalid(
                    format!("steps[{i}].name"),
                    "must be 1..=64 of A-Z a-z 0-9 _ -",
                ));
            }
            if index.insert(step.name.as_str(), i).is_some() {
                return Err(invalid(
                    format!("steps[{i}].name"),
                    format!("step {:?} is defined twice", step.name),
                ));
            }
        }
        let mut parents = Vec::with_capacity(self.steps.len());
        for (i, step) in self.steps.iter().enumerate() {
            let field = |f: &str| format!("steps[{i}].{f}");
            if step.needs.len() > MAX_NEEDS {
                return Err(invalid(
                    field("needs"),
                    format!("at most {MAX_NEEDS} parents"),
                ));
            }
            let mut mine = Vec::with_capacity(step.needs.len());
            for need in &step.needs {
                let Some(&p) = index.get(need.as_str()) else {
                    return Err(invalid(field("needs"), format!("unknown step {need:?}")));
                };
                if mine.contains(&p) {
                    return Err(invalid(
                        field("needs"),
                        format!("step {need:?} is listed twice"),
                    ));
                }
                mine.push(p);
            }
            if let Some(over) = &step.for_each {
                if !step.needs.contains(over) {
                    return Err(invalid(
                        field("for_each"),
                        format!("{over:?} must be one of the step's needs"),
                    ));
                }
            }
            if step.trigger == TriggerRule::OneFailed && step.needs.is_empty() {
                return Err(invalid(
                    field("trigger"),
                    "one_failed needs at least one parent",
                ));
            }
            if let Some(sleep) = &step.sleep {
                check_sleep(step, sleep, limits).map_err(|mut e| {
                    e.field = Some(field(e.field.as_deref().unwrap_or("sleep")));
                    e
                })?;
            }
            if let Some(wait) = &step.wait_for_event {
                check_wait_for_event(step, wait, limits).map_err(|mut e| {
                    e.field = Some(field(e.field.as_deref().unwrap_or("wait_for_event")));
                    e
                })?;
            }
            if let Some(approval) = &step.approval {
                check_approval(step, approval, limits).map_err(|mut e| {
                    e.field = Some(field(e.field.as_deref().unwrap_or("approval")));
                    e
                })?;
            }
            if let Some(child) = &step.child_flow {
                let other_wait = step.sleep.is_some()
                    || step.wait_for_event.is_some()
                    || step.approval.is_some();
                super::child::check_child_flow(child, other_wait, &step.task, limits).map_err(
                    |mut e| {
                        e.field = Some(field(e.field.as_deref().unwrap_or("child_flow")));
                        e
                    },
                )?;
            }
            check_template(&step.task, limits).map_err(|mut e| {
                e.field = Some(field(&format!("task.{}", e.field.as_deref().unwrap_or(""))));
                e
            })?;
            parents.push(mine);
        }
        let order = topological(&self.steps, &parents)?;
        Ok(Plan { parents, order })
    }
}

/// A sleep step: one of `for_ms` (within the max delay) and `until` (RFC 3339), no task
/// of its own, no fan-out, a queue for its timer.
fn check_sleep(
    step: &StepDef,
    sleep: &SleepDef,
    limits: &crate::task::Limits,
) -> Result<(), WireError> {
    match (sleep.for_ms, &sleep.until) {
        (Some(_), Some(_)) | (None, None) => {
            return Err(WireError::field(
                "sleep",
                "give for_ms or until, one of them",
            ))
        }
        (Some(ms), None) => {
            let most = limits.max_delay.as_millis() as u64;
            if ms == 0 || ms > most {
                return Err(WireError::field(
                    "sleep.for_ms",
                    format!("must be 1..={most} (the server's max delay)"),
                ));
            }
        }
        (None, Some(until)) => {
            crate::time::parse_rfc3339_ms(until)
                .map_err(|e| WireError::field("sleep.until", e.to_string()))?;
        }
    }
    wait_step_shape(step, SLEEP_TASK, "sleep")
}

/// A wait for an event: a valid event name and match paths, a timeout within the max
/// delay, a lookback within an hour, no task of its own, no fan-out, a queue.
fn check_wait_for_event(
    step: &StepDef,
    wait: &WaitForEventDef,
    limits: &crate::task::Limits,
) -> Result<(), WireError> {
    if step.sleep.is_some() {
        return Err(WireError::field(
            "wait_for_event",
            "a step sleeps or waits for an event, not both",
        ));
    }
    if !names::valid_event_name(&wait.event) {
        return Err(WireError::field(
            "wait_for_event.event",
            "1..=8 dot-separated tokens of A-Z a-z 0-9 _ - (200 bytes at most)",
        ));
    }
    for path in wait.matches.keys() {
        if path.is_empty() || path.len() > 200 || path.split('.').any(str::is_empty) {
            return Err(WireError::field(
                "wait_for_event.match",
                format!("{path:?} is not a dotted field path"),
            ));
        }
    }
    let most = limits.max_delay.as_millis() as u64;
    if wait.timeout_ms.is_some_and(|ms| ms == 0 || ms > most) {
        return Err(WireError::field(
            "wait_for_event.timeout_ms",
            format!("must be 1..={most} (the server's max delay)"),
        ));
    }
    if wait.lookback() > MAX_LOOKBACK_MS {
        return Err(WireError::field(
            "wait_for_event.lookback_ms",
            format!("at most {MAX_LOOKBACK_MS} (an hour)"),
        ));
    }
    wait_step_shape(step, WAIT_FOR_EVENT_TASK, "wait_for_event")
}

/// An approval: one kind of wait per step, a message within 1,000 bytes, a timeout
/// within the max delay, no task of its own, no fan-out, a queue.
fn check_approval(
    step: &StepDef,
    approval: &ApprovalDef,
    limits: &crate::task::Limits,
) -> Result<(), WireError> {
    if step.sleep.is_some() || step.wait_for_event.is_some() {
        return Err(WireError::field(
            "approval",
            "a step sleeps, waits for an event or waits for an approval: one of them",
        ));
    }
    if approval.message.as_ref().is_some_and(|m| m.len() > 1_000) {
        return Err(WireError::field("approval.message", "at most 1,000 bytes"));
    }
    let most = limits.max_delay.as_millis() as u64;
    if approval.timeout_ms.is_some_and(|ms| ms == 0 || ms > most) {
        return Err(WireError::field(
            "approval.timeout_ms",
            format!("must be 1..={most} (the server's max delay)"),
        ));
    }
    wait_step_shape(step, APPROVAL_TASK, "approval")
}

/// A wait step of kind `kind` runs its wait task `task` (none of its own), does not fan
/// out and has a queue for its timer.
fn wait_step_shape(step: &StepDef, task: &str, kind: &str) -> Result<(), WireError> {
    let what = kind.replace('_', " ");
    if step.task.name != task {
        return Err(WireError::field(
            "task",
            format!("a {what} step has no task (its timer is a wait task ax runs itself)"),
        ));
    }
    if step.for_each.is_some() {
        return Err(WireError::field(
            "for_each",
            format!("a {what} step does not fan out"),
        ));
    }
    if !step.task.queue.as_deref().is_some_and(names::valid_queue) {
        return Err(WireError::field(
            &format!("{kind}.queue"),
            "a valid queue is required when no step of the flow has a task to take it from",
        ));
    }
    Ok(())
}

/// A step's task template is checked as its submit would be.
fn check_template(task: &SubmitRequest, limits: &crate::task::Limits) -> Result<(), WireError> {
    let queue = match &task.queue {
        Some(q) if names::valid_queue(q) => q.clone(),
        _ => return Err(WireError::field("queue", "a valid queue is required")),
    };
    if task.delay_ms.is_some() || task.run_at.is_some() {
        return Err(WireError::field(
            "delay_ms",
            "a step runs when its parents let it",
        ));
    }
    if task.payload_base64.is_some() {
        return Err(WireError::field(
            "payload_base64",
            "a step's task takes JSON (it reaches the task as `args`)",
        ));
    }
    if task.idempotency_key.is_some() {
        return Err(WireError::field(
            "idempotency_key",
            "the flow keys each step's tasks by run, step and epoch",
        ));
    }
    crate::task::TaskMeta::from_request(&queue, task.clone(), limits).map(|_| ())
}

/// Parents-first order, or the error naming a cycle.
fn topological(steps: &[StepDef], parents: &[Vec<usize>]) -> Result<Vec<usize>, WireError> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    let mut mark = vec![Mark::New; steps.len()];
    let mut order = Vec::with_capacity(steps.len());
    for start in 0..steps.len() {
        if mark[start] != Mark::New {
            continue;
        }
        // Depth-first over parents, with an explicit stack: (step, next parent to visit).
        let mut stack: Vec<(usize, usize)> = vec![(start, 0)];
        mark[start] = Mark::Open;
        while let Some((step, next)) = stack.last_mut() {
            let step = *step;
            if let Some(&p) = parents[step].get(*next) {
                *next += 1;
                match mark[p] {
                    Mark::Done => {}
                    Mark::New => {
                        mark[p] = Mark::Open;
                        stack.push((p, 0));
                    }
                    Mark::Open => {
                        // `p` is on the stack: the path from it to `step` plus the edge
                        // back is the cycle, read in the direction the work flows.
                        let from = stack.iter().position(|(s, _)| *s == p).expect("open");
                        let mut cycle: Vec<&str> = stack[from..]
                            .iter()
                            .rev()
                            .map(|(s, _)| steps[*s].name.as_str())
                            .collect();
                        cycle.push(steps[step].name.as_str());
                        let i = step;
                        return Err(invalid(
                            format!("steps[{i}].needs"),
                            format!("cycle: {}", cycle.join(" → ")),
                        ));
                    }
                }
            } else {
                mark[step] = Mark::Done;
                order.push(step);
                stack.pop();
            }
        }
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::Limits;
    use serde_json::json;

    fn step(name: &str, needs: &[&str]) -> serde_json::Value {
        json!({"name": name, "needs": needs, "task": {"name": name, "queue": "q"}})
    }

    fn check(steps: Vec<serde_json::Value>) -> Result<Plan, WireError> {
        FlowDef::decode(json!({"name": "f", "steps": steps}))?.validate(&Limits::default())
    }

    #[test]
    fn a_diamond_is_ordered_parents_first() {
        let plan = check(vec![
            step("d", &["b", "c"]),
            step("b", &["a"]),
            step("c", &["a"]),
            step("a", &[]),
        ])
        .unwrap();
        let pos = |i: usize| plan.order.iter().position(|s| *s == i).unwrap();
        assert_eq!(plan.parents[0], vec![1, 2]);
        assert!(pos(3) < pos(1) && pos(3) < pos(2) && pos(1) < pos(0) && pos(2) < pos(0));
        assert_eq!(plan.order.len(), 4);
    }

    #[test]
    fn a_cycle_is_refused_and_named() {
        let e = check(vec![
            step("a", &["c"]),
            step("b", &["a"]),
            step("c", &["b"]),
            step("x", &[]),
        ])
        .unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidField);
        let message = e.message.clone();
        assert!(
            ["a → b → c → a", "b → c → a → b", "c → a → b → c"]
                .iter()
                .any(|c| message.contains(c)),
            "{message}"
        );
        let e = check(vec![step("a", &["a"])]).unwrap_err();
        assert!(e.message.contains("cycle: a → a"), "{}", e.message);
    }

    #[test]
    fn bad_graphs_and_templates_are_refused_by_field() {
        let field = |steps| check(steps).unwrap_err().field.unwrap();
        assert_eq!(field(vec![step("a", &["nope"])]), "steps[0].needs");
        assert_eq!(field(vec![step("a", &[]), step("a", &[])]), "steps[1].name");
        assert_eq!(
            field(vec![step("a", &[]), step("b", &["a", "a"])]),
            "steps[1].needs"
        );
        let mut fan = step("b", &[]);
        fan["for_each"] = json!("a");
        assert_eq!(field(vec![step("a", &[]), fan]), "steps[1].for_each");
        let mut cleanup = step("c", &[]);
        cleanup["trigger"] = json!("one_failed");
        assert_eq!(field(vec![cleanup]), "steps[0].trigger");
        let mut no_queue = step("a", &[]);
        no_queue["task"] = json!({"name": "a"});
        assert_eq!(field(vec![no_queue]), "steps[0].task.queue");
        let mut keyed = step("a", &[]);
        keyed["task"]["idempotency_key"] = json!("k");
        assert_eq!(field(vec![keyed]), "steps[0].task.idempotency_key");
        let mut bad_attempts = step("a", &[]);
        bad_attempts["task"]["max_attempts"] = json!(0);
        assert_eq!(field(vec![bad_attempts]), "steps[0].task.max_attempts");
        assert_eq!(check(vec![]).unwrap_err().field.unwrap(), "steps");
        let many: Vec<_> = (0..=MAX_STEPS)
            .map(|i| step(&format!("s{i}"), &[]))
            .collect();
        assert_eq!(field(many), "steps");
        let unknown = FlowDef::decode(json!({"name": "f", "steps": [], "retries": 3})).unwrap_err();
        assert!(
            unknown.message.contains("unknown field `retries`"),
            "{}",
            unknown.message
        );
    }

    #[test]
    fn fan_out_and_rules_parse() {
        let mut fan = step("b", &["a"]);
        fan["for_each"] = json!("a");
        let mut done = step("c", &["b"]);
        done["trigger"] = json!("all_done");
        let def = FlowDef::decode(json!({"name": "f", "failure": "continue",
            "steps": [step("a", &[]), fan, done]}))
        .unwrap();
        assert_eq!(def.failure, FailurePolicy::Continue);
        assert_eq!(def.steps[1].for_each.as_deref(), Some("a"));
        assert_eq!(def.steps[2].trigger, TriggerRule::AllDone);
        assert!(def.validate(&Limits::default()).is_ok());
    }

    #[test]
    fn a_sleep_step_gets_its_wait_task() {
        let def = FlowDef::decode(json!({"name": "f", "steps": [
            {"name": "a", "task": {"name": "a", "queue": "media"}},
            {"name": "z", "needs": ["a"], "sleep": {"for_ms": 500}},
            {"name": "y", "sleep": {"until": "2030-01-01T00:00:00Z", "queue": "other"}}]}))
        .unwrap();
        assert!(def.validate(&Limits::default()).is_ok());
        let (z, y) = (&def.steps[1], &def.steps[2]);
        assert_eq!(
            (z.task.name.as_str(), z.task.queue.as_deref()),
            (SLEEP_TASK, Some("media"))
        );
        assert_eq!(y.task.queue.as_deref(), Some("other"), "its own queue wins");
        // Stored and read back, it is the same definition (the wait task is kept).
        let again = FlowDef::decode(serde_json::to_value(&def).unwrap()).unwrap();
        assert_eq!(again, def);
    }
}
