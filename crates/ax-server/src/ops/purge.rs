//! `ax.task.purge`: deletes the records of finished tasks (`succeeded`, `dead`,
//! `cancelled`) last changed before a time, with their outputs kept in `AX_RESULTS`. A
//! record that changed since it was found (a dead task retried meanwhile) is kept: the
//! purge is conditional on the revision the index holds.
//!
//! A task whose idempotency key still names it in `AX_IDEMPOTENCY` (kept 7 days after
//! the submit, the bucket's max age) is kept too: purged, a submit with that key would
//! find the key and no task, and run the task again under its id.

use super::actions::Ops;
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::state::TaskState;
use ax_sdk::ops::{TaskPurge, TaskQuery};
use serde_json::{json, Value};

/// Most tasks one purge removes.
const MAX_PURGE: usize = 10_000;

impl Ops {
    pub(crate) async fn purge(&self, r: TaskPurge, now_ms: u64) -> Result<Value, WireError> {
        let states = match r.query.state {
            Some(s) if !s.is_terminal() => {
                return Err(WireError::field(
                    "state",
                    "only finished tasks (succeeded, dead, cancelled) are purged",
                ))
            }
            Some(s) => vec![s],
            None => vec![TaskState::Succeeded, TaskState::Dead, TaskState::Cancelled],
        };
        let before = now_ms.saturating_sub(r.older_than_ms);
        let limit = r.limit.unwrap_or(MAX_PURGE).clamp(1, MAX_PURGE);
        let query = TaskQuery {
            to_ms: Some(r.query.to_ms.map_or(before, |t| t.min(before))),
            ..r.query.clone()
        };
        let (rows, total) = self
            .index_or_refuse()?
            .index
            .read()
            .expect("not poisoned")
            .find_in_states(&query, &states, limit, 100_000);
        if r.dry_run {
            let ids: Vec<&str> = rows.iter().map(|t| t.id.as_str()).collect();
            return Ok(json!({"matched": total, "would_purge": ids.len(), "ids": ids}));
        }
        let results = ax_core::results::ResultStore::open(&self.js).await.ok();
        let keys = self
            .js
            .get_key_value(ax_core::names::IDEMPOTENCY_BUCKET)
            .await
            .ok();
        let mut purged = 0usize;
        let mut failed = Vec::new();
        // 32 at a time: 10,000 one after another could outlast the caller's request.
        for chunk in rows.chunks(32) {
            let outcomes =
                futures::future::join_all(chunk.iter().map(|row| {
                    self.purge_one(&row.id, row.revision, results.as_ref(), keys.as_ref())
                }))
                .await;
            for (row, outcome) in chunk.iter().zip(outcomes) {
                match outcome {
                    Ok(()) => purged += 1,
                    Err(e) => failed.push(json!({"id": row.id, "error": e})),
                }
            }
        }
        tracing::info!(purged, failed = failed.len(), by = %r.by, "finished tasks purged");
        Ok(json!({"matched": total, "purged": purged, "failed": failed}))
    }

    async fn purge_one(
        &self,
        id: &str,
        revision: u64,
        results: Option<&ax_core::results::ResultStore>,
        keys: Option<&async_nats::jetstream::kv::Store>,
    ) -> Result<(), WireError> {
        let unavailable =
            |e: ax_core::state::StateError| WireError::new(ErrorCode::Unavailable, e.to_string());
        let Some((rec, rev)) = self.tasks.get(id).await.map_err(unavailable)? else {
            return Ok(()); // gone already
        };
        if rev != revision || !rec.state.is_terminal() {
            return Err(WireError::new(
                ErrorCode::Conflict,
                format!("task {id} changed since it was found ({}): kept", rec.state),
            ));
        }
        if let Some(key) = &rec.idempotency_key {
            let kv_key = ax_core::names::idempotency_kv_key(&rec.queue, key);
            let keys = keys.ok_or_else(|| {
                WireError::new(ErrorCode::Unavailable, "AX_IDEMPOTENCY could not be opened")
            })?;
            let named = keys
                .get(&kv_key)
                .await
                .map_err(|e| WireError::new(ErrorCode::Unavailable, e.to_string()))?;
            if named.is_some_and(|v| ax_core::idempotency::KeyValue::parse(&v).id == *id) {
                return Err(WireError::new(
                    ErrorCode::Conflict,
                    format!(
                        "task {id}: its idempotency key still names it (kept 7 days after the \
                         submit); purged now, a submit with the key would run it again: kept"
                    ),
                ));
            }
        }
        // The record first: a record never names an output that is gone. An output left
        // behind by a failure after it expires with the bucket's max age (90 days).
        self.tasks.purge(id, rev).await.map_err(|e| match e {
            ax_core::state::StateError::Stale { .. } => WireError::new(
                ErrorCode::Conflict,
                format!("task {id} changed while it was purged: kept"),
            ),
            other => unavailable(other),
        })?;
        if let Some(key) = rec.output.as_ref().and_then(|o| o.key.as_ref()) {
            let deleted = match results {
                Some(results) => results.delete(key).await.map_err(|e| e.to_string()),
                None => Err("AX_RESULTS not open".to_string()),
            };
            if let Err(e) = deleted {
                tracing::warn!(task_id = %id, key = %key, cause = %e,
                    "purged task's output not deleted (it expires with AX_RESULTS' max age)");
            }
        }
        if let Some(index) = &self.index {
            index.index.write().expect("not poisoned").remove(id);
        }
        Ok(())
    }
}
