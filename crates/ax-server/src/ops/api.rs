//! The task operations API: requests on `ax.task.<op>` with JSON bodies, answered
//! `{"ok": …}` or `{"error": …}` (docs/PROTOCOL.md §8).

use super::actions::Ops;
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::state::TaskState;
use ax_sdk::api::{unknown_operation, Api, Request};
use ax_sdk::ops::{ListReply, ListRequest, PageCursor, TaskQuery};
use ax_sdk::ops::{QueuePause, SeriesFilter, TaskBulk, TaskRef, TaskRequest};
use serde_json::{json, Value};
use std::time::Duration;

/// Most rows one `list` answers; most tasks one `replay` retries.
pub(crate) const MAX_LIST: usize = 1000;
pub(crate) const MAX_REPLAY: usize = 10_000;
/// A `list` counts matches up to this many; beyond, `total` is null.
const COUNT_CAP: usize = 100_000;

fn check_by(by: &str) -> Result<(), WireError> {
    if by.is_empty() || by.len() > 128 || by.chars().any(char::is_control) {
        return Err(WireError::field(
            "by",
            "1–128 characters, no control characters",
        ));
    }
    Ok(())
}

impl Ops {
    pub(crate) async fn handle(&self, op: &str, body: &[u8]) -> Result<Value, WireError> {
        match TaskRequest::decode(op, body)? {
            TaskRequest::Get(TaskRef { id, .. }) => {
                let (record, revision) = self.get(&id).await?;
                let history = self
                    .tasks
                    .history(&id)
                    .await
                    .map_err(|e| WireError::new(ErrorCode::Unavailable, e.to_string()))?;
                let history: Vec<Value> = history
                    .into_iter()
                    .map(|(rec, rev)| json!({"revision": rev, "record": rec}))
                    .collect();
                Ok(json!({"record": record, "revision": revision, "history": history}))
            }
            TaskRequest::List(req) => {
                Ok(serde_json::to_value(self.list(&req).await?).expect("serializes"))
            }
            TaskRequest::Cancel(TaskRef { id, by }) => {
                check_by(&by)?;
                self.cancel(&id, &by).await
            }
            TaskRequest::Retry(r) => {
                check_by(&r.by)?;
                self.retry(&r.id, r.reset_attempts, &r.by).await
            }
            TaskRequest::RunNow(TaskRef { id, by }) => {
                check_by(&by)?;
                self.run_now(&id, &by).await
            }
            TaskRequest::Replay(r) => {
                check_by(&r.by)?;
                self.replay(r).await
            }
            TaskRequest::CancelMany(r) => {
                if r.reset_attempts {
                    return Err(WireError::field("reset_attempts", "not a cancel option"));
                }
                check_by(&r.by)?;
                self.cancel_many(r).await
            }
            TaskRequest::Pause(p) => self.pause_request(p, true).await,
            TaskRequest::Resume(p) => self.pause_request(p, false).await,
            TaskRequest::Queues {} => self.queues().await,
            TaskRequest::Series(SeriesFilter { queue }) => {
                let index = self.index()?;
                let ix = index.index.read().expect("not poisoned");
                Ok(ix.series.answer(queue.as_deref(), ax_core::time::now_ms()))
            }
            TaskRequest::Purge(r) => {
                check_by(&r.by)?;
                self.purge(r, ax_core::time::now_ms()).await
            }
            TaskRequest::Payload(TaskRef { id, .. }) => self.payload(&id).await,
            TaskRequest::Events(TaskRef { id, .. }) => {
                let (events, complete) = self.events(&id).await?;
                Ok(json!({"id": id, "events": events, "complete": complete}))
            }
            TaskRequest::OptionsPut(s) => self.put_settings(s).await,
            TaskRequest::OptionsGet(n) => self.get_settings(n).await,
            TaskRequest::OptionsList(f) => self.list_settings(f).await,
            TaskRequest::OptionsDelete(n) => self.delete_settings(n).await,
            TaskRequest::Unknown => Err(unknown_operation(Api::Task, op)),
        }
    }

    async fn pause_request(&self, p: QueuePause, pause: bool) -> Result<Value, WireError> {
        check_by(&p.by)?;
        self.pause(&p.queue, pause, p.reason.as_deref(), &p.by)
            .await
    }

    async fn get(&self, id: &str) -> Result<(ax_sdk::TaskRecord, u64), WireError> {
        if ax_core::names::queue_of_task_id(id).is_none() {
            return Err(WireError::field("id", "not a task id"));
        }
        self.tasks
            .find(id)
            .await
            .map_err(|e| WireError::new(ErrorCode::Unavailable, e.to_string()))?
            .ok_or_else(|| WireError::new(ErrorCode::NotFound, format!("no task {id}")))
    }

    /// The index, or the error a server without one answers (it subscribes to the index
    /// operations only when it keeps one, so this answers only a misrouted request).
    pub(super) fn index_or_refuse(&self) -> Result<&super::feed::TaskIndex, WireError> {
        self.index()
    }

    fn index(&self) -> Result<&super::feed::TaskIndex, WireError> {
        self.index.as_deref().ok_or_else(|| {
            WireError::new(
                ErrorCode::Unavailable,
                "this server keeps no task index (start one with `ax server --task-index`)",
            )
        })
    }

    async fn list(&self, req: &ListRequest) -> Result<ListReply, WireError> {
        let index = self.index()?;
        // A fresh server answers from what it has read so far, saying so.
        let complete = index.loaded() || index.wait_loaded(Duration::from_secs(2)).await;
        let limit = req.limit.unwrap_or(50).clamp(1, MAX_LIST);
        let cursor = req.after.as_ref().map(|c| (c.updated_at_ms, c.id.clone()));
        let (tasks, total) = index.index.read().expect("not poisoned").find(
            &req.query,
            limit,
            cursor.as_ref(),
            COUNT_CAP,
        );
        let next = (tasks.len() == limit).then(|| {
            let last = tasks.last().expect("a full page");
            PageCursor {
                updated_at_ms: last.updated_at_ms,
                id: last.id.clone(),
            }
        });
        Ok(ListReply {
            tasks,
            total,
            next,
            complete,
        })
    }

    async fn replay(&self, r: TaskBulk) -> Result<Value, WireError> {
        let mut query = r.query;
        if query.state.is_some_and(|s| s != TaskState::Dead) {
            return Err(WireError::field("state", "replay retries dead tasks only"));
        }
        query.state = Some(TaskState::Dead);
        let limit = r.limit.unwrap_or(MAX_REPLAY).clamp(1, MAX_REPLAY);
        let (rows, total) = self
            .index()?
            .index
            .read()
            .expect("not poisoned")
            .find(&query, limit, None, COUNT_CAP);
        if r.dry_run {
            let ids: Vec<&str> = rows.iter().map(|t| t.id.as_str()).collect();
            return Ok(json!({"matched": total, "would_retry": ids.len(), "ids": ids}));
        }
        let mut retried = 0usize;
        let mut failed = Vec::new();
        for row in &rows {
            match self.retry(&row.id, r.reset_attempts, &r.by).await {
                Ok(_) => retried += 1,
                Err(e) => failed.push(json!({"id": row.id, "error": e})),
            }
        }
        Ok(json!({"matched": total, "retried": retried, "failed": failed}))
    }

    /// Cancels every task matching the filters that is not finished (at most `limit`),
    /// 32 at a time; a dry run only says which.
    async fn cancel_many(&self, r: TaskBulk) -> Result<Value, WireError> {
        if r.query.state.is_some_and(TaskState::is_terminal) {
            return Err(WireError::field(
                "state",
                "finished tasks cannot be cancelled",
            ));
        }
        let limit = r.limit.unwrap_or(MAX_REPLAY).clamp(1, MAX_REPLAY);
        let (rows, total) = {
            let index = self.index()?.index.read().expect("not poisoned");
            if r.query.state.is_some() {
                index.find(&r.query, limit, None, COUNT_CAP)
            } else {
                // Every state a task can be cancelled in, newest first within each.
                let states = [
                    TaskState::Scheduled,
                    TaskState::Pending,
                    TaskState::Retrying,
                    TaskState::Running,
                ];
                index.find_in_states(&r.query, &states, limit, COUNT_CAP)
            }
        };
        if r.dry_run {
            let ids: Vec<&str> = rows.iter().map(|t| t.id.as_str()).collect();
            return Ok(json!({"matched": total, "would_cancel": ids.len(), "ids": ids}));
        }
        let mut cancelled = 0usize;
        let mut failed = Vec::new();
        for chunk in rows.chunks(32) {
            let outcomes =
                futures::future::join_all(chunk.iter().map(|row| self.cancel(&row.id, &r.by)))
                    .await;
            for (row, outcome) in chunk.iter().zip(outcomes) {
                match outcome {
                    Ok(_) => cancelled += 1,
                    Err(e) => failed.push(json!({"id": row.id, "error": e})),
                }
            }
        }
        Ok(json!({"matched": total, "cancelled": cancelled, "failed": failed}))
    }

    async fn queues(&self) -> Result<Value, WireError> {
        let paused = self.paused().await?;
        let index = self.index()?;
        let counts = index.index.read().expect("not poisoned").counts();
        let mut names: Vec<String> = counts.iter().map(|(q, _)| q.clone()).collect();
        names.extend(paused.iter().map(|(q, _)| q.clone()));
        names.extend(self.declared().await);
        names.sort();
        names.dedup();
        let mut out = Vec::new();
        for queue in names {
            let c = counts
                .iter()
                .find(|(q, _)| *q == queue)
                .map_or([0; 7], |(_, c)| *c);
            let pause = paused
                .iter()
                .find(|(q, _)| *q == queue)
                .map(|(_, v)| v.clone());
            let depth = self.depth(&queue).await;
            let states: serde_json::Map<String, Value> = [
                TaskState::Scheduled,
                TaskState::Pending,
                TaskState::Running,
                TaskState::Retrying,
                TaskState::Succeeded,
                TaskState::Dead,
                TaskState::Cancelled,
            ]
            .iter()
            .map(|s| (s.to_string(), json!(c[*s as usize])))
            .collect();
            out.push(json!({
                "queue": queue,
                "paused": pause.is_some(),
                "pause": pause,
                "ready": {"high": depth[0], "normal": depth[1], "low": depth[2]},
                "tasks": states,
            }));
        }
        // Throughput over the last minute, all queues: tasks that reached each end state.
        let since = ax_core::time::now_ms().saturating_sub(60_000);
        let ix = index.index.read().expect("not poisoned");
        let per_minute = |s: TaskState| {
            let q = TaskQuery {
                state: Some(s),
                from_ms: Some(since),
                ..Default::default()
            };
            ix.find(&q, 0, None, COUNT_CAP).1
        };
        let last_minute = json!({
            "succeeded": per_minute(TaskState::Succeeded),
            "dead": per_minute(TaskState::Dead),
            "retrying": per_minute(TaskState::Retrying),
        });
        drop(ix);
        Ok(json!({"queues": out, "complete": index.loaded(), "last_minute": last_minute}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_request_is_flat_and_refuses_unknown_fields() {
        let req: ListRequest =
            serde_json::from_str(r#"{"state":"dead","error_class":"timeout","limit":5}"#).unwrap();
        assert_eq!(req.query.state, Some(TaskState::Dead));
        assert_eq!(req.query.error_class.as_deref(), Some("timeout"));
        assert_eq!(req.limit, Some(5));
        assert!(serde_json::from_str::<ListRequest>(r#"{"stat":"dead"}"#).is_err());
    }
}
