//! `ax.task.purge`: deletes the records of finished tasks (`succeeded`, `dead`,
//! `cancelled`) last changed before a time, with their outputs kept in `AX_RESULTS`. A
//! record that changed since it was found (a dead task retried meanwhile) is kept: the
//! purge is conditional on the revision the index holds.

use super::actions::Ops;
use super::index::TaskQuery;
use crate::protocol::{ErrorCode, WireError};
use crate::state::TaskState;
use serde::Deserialize;
use serde_json::{json, Value};

/// Most tasks one purge removes.
const MAX_PURGE: usize = 10_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Purge {
    #[serde(flatten)]
    query: TaskQuery,
    /// Only tasks last changed more than this long ago (required).
    older_than_ms: u64,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    dry_run: bool,
    #[serde(default = "super::api::by_default")]
    pub(crate) by: String,
}

impl Ops {
    pub(crate) async fn purge(&self, r: Purge, now_ms: u64) -> Result<Value, WireError> {
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
        let (rows, total) = {
            let index = self.index_or_refuse()?.index.read().expect("not poisoned");
            let mut rows = Vec::new();
            let mut total = Some(0usize);
            for s in states {
                let q = TaskQuery {
                    state: Some(s),
                    to_ms: Some(r.query.to_ms.map_or(before, |t| t.min(before))),
                    ..r.query.clone()
                };
                let (found, n) = index.find(&q, limit - rows.len(), None, 100_000);
                rows.extend(found);
                total = total.zip(n).map(|(a, b)| a + b);
                if rows.len() >= limit {
                    break;
                }
            }
            (rows, total)
        };
        if r.dry_run {
            let ids: Vec<&str> = rows.iter().map(|t| t.id.as_str()).collect();
            return Ok(json!({"matched": total, "would_purge": ids.len(), "ids": ids}));
        }
        let results = crate::output::ResultStore::open(&self.js).await.ok();
        let mut purged = 0usize;
        let mut failed = Vec::new();
        for row in &rows {
            match self
                .purge_one(&row.id, row.revision, results.as_ref())
                .await
            {
                Ok(()) => purged += 1,
                Err(e) => failed.push(json!({"id": row.id, "error": e})),
            }
        }
        tracing::info!(purged, by = %r.by, "finished tasks purged");
        Ok(json!({"matched": total, "purged": purged, "failed": failed}))
    }

    async fn purge_one(
        &self,
        id: &str,
        revision: u64,
        results: Option<&crate::output::ResultStore>,
    ) -> Result<(), WireError> {
        let unavailable =
            |e: crate::state::StateError| WireError::new(ErrorCode::Unavailable, e.to_string());
        let Some((rec, rev)) = self.tasks.get(id).await.map_err(unavailable)? else {
            return Ok(()); // gone already
        };
        if rev != revision || !rec.state.is_terminal() {
            return Err(WireError::new(
                ErrorCode::Conflict,
                format!("task {id} changed since it was found ({}): kept", rec.state),
            ));
        }
        if let (Some(results), Some(key)) =
            (results, rec.output.as_ref().and_then(|o| o.key.as_ref()))
        {
            results
                .delete(key)
                .await
                .map_err(|e| WireError::new(ErrorCode::Unavailable, e.to_string()))?;
        }
        self.tasks.purge(id, rev).await.map_err(|e| match e {
            crate::state::StateError::Broker { .. } => WireError::new(
                ErrorCode::Conflict,
                format!("task {id} changed while it was purged: kept"),
            ),
            other => unavailable(other),
        })?;
        if let Some(index) = &self.index {
            index.index.write().expect("not poisoned").remove(id);
        }
        Ok(())
    }
}
