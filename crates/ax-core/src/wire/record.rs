//! A task's record in the `AX_TASKS` bucket (docs/PROTOCOL.md §4): its state, its last
//! error and its output, as JSON. Pure data: the store that reads and writes records is
//! [`crate::state`].

use crate::wire::names::Priority;
use crate::wire::time::now_ms;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Where a task is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskState {
    /// Held until its due time.
    Scheduled,
    /// In the ready queue, waiting for a worker.
    Pending,
    /// A worker is running an attempt.
    Running,
    /// An attempt failed; waiting for its backoff before the next one.
    Retrying,
    /// Finished successfully.
    Succeeded,
    /// Failed for good (non-retryable error or attempts exhausted); in the dead-letter stream.
    Dead,
    /// Cancelled by an operator or its flow run (cancelled or failing fast): an attempt
    /// not started never runs; a running one is signalled, its handler dropped, and the
    /// worker writes `cancelled`.
    Cancelled,
}

impl TaskState {
    /// True for `succeeded`, `dead` and `cancelled`: no further transition happens.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Succeeded | TaskState::Dead | TaskState::Cancelled
        )
    }

    /// The lowercase wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Scheduled => "scheduled",
            TaskState::Pending => "pending",
            TaskState::Running => "running",
            TaskState::Retrying => "retrying",
            TaskState::Succeeded => "succeeded",
            TaskState::Dead => "dead",
            TaskState::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for TaskState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TaskState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        serde_json::from_value(serde_json::Value::String(s.to_string()))
            .map_err(|_| format!("unknown state {s:?}"))
    }
}

/// The last error of a task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorInfo {
    /// Error class (what `retry_on` / `no_retry_on` match).
    pub class: String,
    /// Message.
    pub message: String,
    /// What the worker sent beyond the message (a stack trace, a response body), at most
    /// 8 KiB; none if it sent nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// The stored state of one task (JSON in `AX_TASKS`, key = task id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    /// Task id.
    pub id: String,
    /// Queue.
    pub queue: String,
    /// Task name.
    pub name: String,
    /// Priority.
    pub priority: Priority,
    /// Current state.
    pub state: TaskState,
    /// Attempts started so far (0 before the first).
    pub attempt: u32,
    /// Attempts allowed in all.
    pub max_attempts: u32,
    /// Created, ms since the epoch.
    pub created_at_ms: u64,
    /// Last transition, ms since the epoch.
    pub updated_at_ms: u64,
    /// Due time of a delayed task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_at_ms: Option<u64>,
    /// Start of the current / last attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    /// When the task reached `succeeded` or `dead`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    /// When the next attempt is due, while `retrying`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_retry_at_ms: Option<u64>,
    /// The last error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<ErrorInfo>,
    /// Worker that runs / ran the current attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// Ready-stream sequence of the message the current attempt was claimed from; tells a
    /// redelivery of that message from a stray duplicate message of the same task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_seq: Option<u64>,
    /// Business idempotency key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// The trigger that created the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<String>,
    /// Why it fired: `schedule` or `manual`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger_source: Option<String>,
    /// The scheduled time the fire stands for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduled_at_ms: Option<u64>,
    /// The output of a `succeeded` task, if its handler returned one (inline, or the key
    /// of its bytes in `AX_RESULTS`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<super::output::StoredOutput>,
    /// `AX_DELAYED` sequence of a scheduled task's message (set at submit): "run now"
    /// reads the message from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delayed_seq: Option<u64>,
    /// A ready message that "run now" replaced with a fresh copy: a delivery of it is
    /// retired (Term) instead of starting an attempt early.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub superseded_seq: Option<u64>,
    /// Set on a `running` record when an operator cancelled the task and no worker
    /// answered the cancel signal: the next delivery records it `cancelled` unrun.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel_requested_at_ms: Option<u64>,
    /// The last operator action on the task (`cancel`, `retry`, `run_now`), with who and
    /// when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<OpNote>,
    /// W3C trace context of the submit (`traceparent`), carried into every attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The business id the task works for (`business_id` of the submit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub business_id: Option<String>,
    /// Why the task has not started yet, while a limit holds it back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Waiting>,
    /// Fields this version does not know, kept as they were so that a newer writer's
    /// fields survive this one's writes (docs/PROTOCOL.md §3).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// An operator action recorded on a task (`op` in its record).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpNote {
    /// `cancel`, `retry` or `run_now`.
    pub op: String,
    /// Who asked (the API caller's `by`, default `api`).
    pub by: String,
    /// When, ms since the epoch.
    pub at_ms: u64,
}

/// Why a task waits (`waiting` in its record).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiting {
    /// `rate_limit`, `concurrency` or `limits_unavailable`.
    pub reason: String,
    /// The limit's name.
    pub limit: String,
    /// When it was first seen waiting, ms since the epoch.
    pub since_ms: u64,
}

impl TaskRecord {
    /// Moves to `state`, stamping the update time with now.
    pub fn transition(self, state: TaskState) -> TaskRecord {
        self.transition_at(state, now_ms())
    }

    /// Moves to `state` at `now_ms`: sets `updated_at_ms`; `finished_at_ms` on reaching
    /// `succeeded`, `dead` or `cancelled`; clears `next_retry_at_ms` unless the new state is
    /// `retrying`. Every other field is kept (`last_error` stays the latest failure).
    pub fn transition_at(mut self, state: TaskState, now_ms: u64) -> TaskRecord {
        self.state = state;
        self.updated_at_ms = now_ms;
        if state.is_terminal() {
            self.finished_at_ms = Some(self.updated_at_ms);
        }
        if state != TaskState::Retrying {
            self.next_retry_at_ms = None;
        }
        self.waiting = None;
        self
    }
}
