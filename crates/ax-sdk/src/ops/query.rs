//! The task query of the operations API: what to find, one row found, and pages
//! (`ax.task.list`, PROTOCOL.md §8).

use crate::state::TaskState;
use serde::{Deserialize, Serialize};

/// What to find (every given filter must match). Times are on `updated_at_ms`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskQuery {
    /// Only this state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<TaskState>,
    /// Only this queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// Only this task name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Only tasks whose last error has this class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_class: Option<String>,
    /// Only tasks made by this trigger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<String>,
    /// Only step tasks of this flow run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_run: Option<String>,
    /// Only the task with this idempotency key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Only the task with this id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Only tasks whose last error's `class: message` contains this text (ignoring case;
    /// the first 256 bytes of the error are searched).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_text: Option<String>,
    /// Only tasks last changed at or after this time (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_ms: Option<u64>,
    /// Only tasks last changed before this time (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_ms: Option<u64>,
}

/// One task found: enough for a table row (read the record for the rest).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRow {
    /// Task id.
    pub id: String,
    /// Queue.
    pub queue: String,
    /// Task name.
    pub name: String,
    /// State.
    pub state: TaskState,
    /// Attempts started.
    pub attempt: u32,
    /// Class of the last error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_class: Option<String>,
    /// Trigger that made it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<String>,
    /// Created, ms since the epoch.
    pub created_at_ms: u64,
    /// Last change, ms since the epoch.
    pub updated_at_ms: u64,
    /// Revision of the record indexed.
    pub revision: u64,
}

/// Where a page continues (the last row's `updated_at_ms` and `id`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PageCursor {
    /// The last row's `updated_at_ms`.
    pub updated_at_ms: u64,
    /// The last row's id.
    pub id: String,
}

/// A `list` request: a query, a page size and where to continue.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListRequest {
    /// The filters.
    #[serde(flatten)]
    pub query: TaskQuery,
    /// Rows wanted (default 50, at most 1,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    /// Continue after this row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<PageCursor>,
}

/// A `list` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListReply {
    /// The rows, most recently changed first.
    pub tasks: Vec<TaskRow>,
    /// How many tasks match in all; null past 100,000.
    pub total: Option<usize>,
    /// Where the next page starts; null on the last page.
    pub next: Option<PageCursor>,
    /// False while the index is still loading after a server start (results partial).
    pub complete: bool,
}
