//! The operations calls of [`Client`]: find tasks, cancel, retry, replay, run now, pause
//! and resume queues (docs/PROTOCOL.md §8).

use super::query::{ListReply, ListRequest, TaskQuery};
use super::request::{
    QueuePause, SeriesFilter, TaskBulk, TaskPurge, TaskRef, TaskRequest, TaskRetry,
};
use crate::client::{Client, ClientError};
use crate::names::TASK_API_PREFIX;
use crate::state::TaskState;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What an operation on one task left it as.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpOutcome {
    /// Task id.
    pub id: String,
    /// The task's state after the operation.
    pub state: TaskState,
    /// Cancel of a running task: the worker that stopped it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// Cancel of a running task no worker answered for: recorded, applied at its next
    /// delivery.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cancel_requested: bool,
}

/// The answer to a replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayOutcome {
    /// Dead tasks matching the filter (null past 100,000).
    pub matched: Option<usize>,
    /// Tasks retried (absent for a dry run).
    #[serde(default)]
    pub retried: usize,
    /// Tasks a dry run would retry.
    #[serde(default)]
    pub would_retry: usize,
    /// Ids a dry run would retry.
    #[serde(default)]
    pub ids: Vec<String>,
    /// Tasks that could not be retried, with why.
    #[serde(default)]
    pub failed: Vec<Value>,
}

/// How long an index operation waits for a server that keeps the index.
const INDEX_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

impl Client {
    /// An operation only servers with a task index answer: without one, a clear refusal
    /// instead of a wait.
    async fn index_call(&self, request: &TaskRequest) -> Result<Value, ClientError> {
        let client = self.clone().wait_for_server(INDEX_WAIT);
        match client.call(request).await {
            Err(ClientError::Request(e))
                if e.kind() == async_nats::RequestErrorKind::NoResponders =>
            {
                Err(ClientError::Refused(crate::protocol::WireError::new(
                    crate::protocol::ErrorCode::Unavailable,
                    "no ax server keeps a task index: start one with `ax server --task-index` \
                     (the console's server keeps one)",
                )))
            }
            other => other,
        }
    }

    /// Calls the task operations API: `op` is `get`, `list`, `events`, `payload`,
    /// `cancel`, `retry`, `replay`, `cancel_many`, `run_now`, `pause`, `resume`, `queues`,
    /// `series` or `purge` (docs/PROTOCOL.md §8); returns the `ok` value.
    pub async fn task_op(&self, op: &str, body: &Value) -> Result<Value, ClientError> {
        self.management(TASK_API_PREFIX, op, body).await
    }

    /// Finds tasks through the servers' index (most recently changed first).
    pub async fn find_tasks(&self, req: &ListRequest) -> Result<ListReply, ClientError> {
        let ok = self.index_call(&TaskRequest::List(req.clone())).await?;
        Ok(serde_json::from_value(ok)?)
    }

    /// Cancels a task: not started, it never runs; running, its handler is stopped and the
    /// attempt ends `cancelled`. Refused `conflict` for a finished task.
    pub async fn cancel_task(&self, id: &str) -> Result<OpOutcome, ClientError> {
        let ok = self.call(&TaskRequest::Cancel(TaskRef::new(id))).await?;
        Ok(serde_json::from_value(ok)?)
    }

    /// Runs a dead task again: one more attempt, or with `reset_attempts` all its attempts
    /// from zero. Refused `conflict` unless the task is dead.
    pub async fn retry_task(
        &self,
        id: &str,
        reset_attempts: bool,
    ) -> Result<OpOutcome, ClientError> {
        let retry = TaskRetry {
            id: id.to_string(),
            reset_attempts,
            by: "api".into(),
        };
        let ok = self.call(&TaskRequest::Retry(retry)).await?;
        Ok(serde_json::from_value(ok)?)
    }

    /// Retries every dead task matching `query` (at most `limit`, default 10,000);
    /// `dry_run` only says which.
    pub async fn replay_dead(
        &self,
        query: &TaskQuery,
        limit: Option<usize>,
        reset_attempts: bool,
        dry_run: bool,
    ) -> Result<ReplayOutcome, ClientError> {
        let bulk = TaskBulk {
            limit,
            reset_attempts,
            dry_run,
            ..TaskBulk::new(query.clone())
        };
        let ok = self.index_call(&TaskRequest::Replay(bulk)).await?;
        Ok(serde_json::from_value(ok)?)
    }

    /// Cancels every unfinished task matching `query` (at most `limit`, default 10,000);
    /// `dry_run` only says which. Answers `{matched, cancelled, failed}` (a dry run:
    /// `{matched, would_cancel, ids}`).
    pub async fn cancel_matching(
        &self,
        query: &TaskQuery,
        limit: Option<usize>,
        dry_run: bool,
    ) -> Result<Value, ClientError> {
        let bulk = TaskBulk {
            limit,
            dry_run,
            ..TaskBulk::new(query.clone())
        };
        self.index_call(&TaskRequest::CancelMany(bulk)).await
    }

    /// Deletes finished tasks (`succeeded`, `dead`, `cancelled`) matching `query` and last
    /// changed more than `older_than` ago: their records (a KV purge, history included)
    /// and their outputs in `AX_RESULTS`, at most `limit` (default and most 10,000);
    /// `dry_run` only says which. A task that changed since the index found it, or whose
    /// idempotency key still names it, is kept (listed in `failed`). A `state` that is
    /// not finished is refused (`invalid_field`). Answers `{matched, purged, failed}` (a
    /// dry run: `{matched, would_purge, ids}`).
    pub async fn purge_tasks(
        &self,
        query: &TaskQuery,
        older_than: std::time::Duration,
        limit: Option<usize>,
        dry_run: bool,
    ) -> Result<Value, ClientError> {
        let purge = TaskPurge {
            query: query.clone(),
            older_than_ms: older_than.as_millis().min(u128::from(u64::MAX)) as u64,
            limit,
            dry_run,
            by: "api".into(),
        };
        self.index_call(&TaskRequest::Purge(purge)).await
    }

    /// Per queue, what happened in each of the last 60 minutes (oldest first):
    /// `{"now_ms", "minute_ms", "queues": {<queue>: [{"t", "succeeded", "retried",
    /// "dead", "wait_p50_ms", "wait_p95_ms", "run_p50_ms", "run_p95_ms"}]}}`; only `queue`
    /// if given.
    pub async fn task_series(&self, queue: Option<&str>) -> Result<Value, ClientError> {
        let filter = SeriesFilter {
            queue: queue.map(str::to_string),
        };
        self.index_call(&TaskRequest::Series(filter)).await
    }

    /// Starts a scheduled or retrying task now.
    pub async fn run_now(&self, id: &str) -> Result<OpOutcome, ClientError> {
        let ok = self.call(&TaskRequest::RunNow(TaskRef::new(id))).await?;
        Ok(serde_json::from_value(ok)?)
    }

    /// Pauses a queue: workers take none of its tasks until it is resumed (running ones
    /// finish; submits are still accepted).
    pub async fn pause_queue(&self, queue: &str, reason: Option<&str>) -> Result<(), ClientError> {
        let pause = QueuePause {
            queue: queue.to_string(),
            reason: reason.map(str::to_string),
            by: "api".into(),
        };
        self.call(&TaskRequest::Pause(pause)).await.map(|_| ())
    }

    /// Resumes a paused queue.
    pub async fn resume_queue(&self, queue: &str) -> Result<(), ClientError> {
        let resume = QueuePause {
            queue: queue.to_string(),
            reason: None,
            by: "api".into(),
        };
        self.call(&TaskRequest::Resume(resume)).await.map(|_| ())
    }

    /// Every change of a task, oldest first: `{event, at_ms, state, attempt, actor,
    /// reason, next_retry_at_ms}`. With the `AX_TASK_EVENTS` stream (`--task-events`)
    /// every change of the last 30 days (`complete` true); without it, the record's last
    /// 16 changes.
    pub async fn task_events(&self, id: &str) -> Result<(Vec<Value>, bool), ClientError> {
        let mut ok = self.call(&TaskRequest::Events(TaskRef::new(id))).await?;
        let complete = ok["complete"].as_bool().unwrap_or(false);
        Ok((serde_json::from_value(ok["events"].take())?, complete))
    }

    /// Every queue with tasks: paused or not, ready depth per priority, tasks by state.
    pub async fn queues(&self) -> Result<Value, ClientError> {
        self.index_call(&TaskRequest::Queues {}).await
    }
}
