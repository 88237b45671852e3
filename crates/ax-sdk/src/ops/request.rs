//! The task operations API's requests (`ax.task.<op>`, PROTOCOL.md §8) as one typed enum.

use super::query::{ListRequest, TaskQuery};
use crate::api::{Api, Request};
use serde::{Deserialize, Serialize};

/// A request to the task operations API: the variant is the operation, its content the
/// body. `by` (default `api`) names who acted, in the task's record and the audit log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "body", rename_all = "snake_case")]
pub enum TaskRequest {
    /// A task's record, revision and stored history.
    Get(TaskRef),
    /// Every change of a task.
    Events(TaskRef),
    /// A task's payload.
    Payload(TaskRef),
    /// Cancel a task.
    Cancel(TaskRef),
    /// Run a dead task again.
    Retry(TaskRetry),
    /// Start a scheduled or retrying task now.
    RunNow(TaskRef),
    /// Pause a queue.
    Pause(QueuePause),
    /// Resume a paused queue.
    Resume(QueuePause),
    /// Find tasks (the index).
    List(ListRequest),
    /// Every queue with tasks (the index).
    Queues {},
    /// Per-minute counts of the last hour (the index).
    Series(SeriesFilter),
    /// Retry the dead tasks matching a query (the index).
    Replay(TaskBulk),
    /// Cancel the unfinished tasks matching a query (the index; `reset_attempts` is
    /// refused).
    CancelMany(TaskBulk),
    /// Delete finished tasks matching a query (the index).
    Purge(TaskPurge),
    /// Store a task name's settings, replacing what was stored (PROTOCOL.md §8).
    OptionsPut(crate::settings::StoredSettings),
    /// A task name's stored settings.
    OptionsGet(crate::settings::SettingsName),
    /// The stored settings of one queue's names, or of every queue's.
    OptionsList(crate::settings::SettingsFilter),
    /// Delete a task name's stored settings.
    OptionsDelete(crate::settings::SettingsName),
    /// An operation this enum does not have (never sent).
    #[doc(hidden)]
    #[serde(other)]
    Unknown,
}

fn by_api() -> String {
    "api".into()
}

fn is_api(by: &str) -> bool {
    by == "api"
}

/// Names one task: `{"id", "by"?}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskRef {
    /// The task's id.
    pub id: String,
    /// Who acts (default `api`).
    #[serde(default = "by_api", skip_serializing_if = "is_api")]
    pub by: String,
}

impl TaskRef {
    /// Task `id`, acted on by `api`.
    pub fn new(id: impl Into<String>) -> TaskRef {
        TaskRef {
            id: id.into(),
            by: by_api(),
        }
    }
}

/// Retries one dead task: `{"id", "reset_attempts"?, "by"?}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskRetry {
    /// The task's id.
    pub id: String,
    /// Start its attempts from zero.
    #[serde(default)]
    pub reset_attempts: bool,
    /// Who acts (default `api`).
    #[serde(default = "by_api", skip_serializing_if = "is_api")]
    pub by: String,
}

/// Pauses or resumes a queue: `{"queue", "reason"?, "by"?}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueuePause {
    /// The queue.
    pub queue: String,
    /// Why (shown to other operators).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who acts (default `api`).
    #[serde(default = "by_api", skip_serializing_if = "is_api")]
    pub by: String,
}

/// Picks the series of one queue (`{"queue"}`) or of all (`{}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeriesFilter {
    /// Only this queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

/// A bulk action over the tasks a query finds: the query's fields, plus `limit`,
/// `reset_attempts`, `dry_run`, `by`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskBulk {
    /// Which tasks.
    #[serde(flatten)]
    pub query: TaskQuery,
    /// At most this many (default and most 10,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    /// `replay`: start their attempts from zero.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reset_attempts: bool,
    /// Only say which.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    /// Who acts (default `api`).
    #[serde(default = "by_api", skip_serializing_if = "is_api")]
    pub by: String,
}

impl TaskBulk {
    /// The tasks `query` finds, no other option set.
    pub fn new(query: TaskQuery) -> TaskBulk {
        TaskBulk {
            query,
            limit: None,
            reset_attempts: false,
            dry_run: false,
            by: by_api(),
        }
    }
}

/// Deletes finished tasks: the query's fields, plus `older_than_ms` (required), `limit`,
/// `dry_run`, `by`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskPurge {
    /// Which tasks.
    #[serde(flatten)]
    pub query: TaskQuery,
    /// Only tasks last changed more than this long ago.
    pub older_than_ms: u64,
    /// At most this many (default and most 10,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    /// Only say which.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    /// Who acts (default `api`).
    #[serde(default = "by_api", skip_serializing_if = "is_api")]
    pub by: String,
}

impl Request for TaskRequest {
    const API: Api = Api::Task;
    fn is_unknown(&self) -> bool {
        matches!(self, TaskRequest::Unknown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::TaskState;

    #[test]
    fn bulk_bodies_are_flat_and_refuse_unknown_fields() {
        let ok = TaskRequest::decode("replay", br#"{"queue":"q","dry_run":true}"#).unwrap();
        let TaskRequest::Replay(bulk) = &ok else {
            panic!("{ok:?}")
        };
        assert_eq!(
            (bulk.query.queue.as_deref(), bulk.dry_run),
            (Some("q"), true)
        );
        assert!(TaskRequest::decode("replay", br#"{"queue":"q","dryrun":true}"#).is_err());
        let list = TaskRequest::decode("list", br#"{"state":"dead","limit":5}"#).unwrap();
        let TaskRequest::List(req) = list else {
            panic!()
        };
        assert_eq!(
            (req.query.state, req.limit),
            (Some(TaskState::Dead), Some(5))
        );
    }
}
