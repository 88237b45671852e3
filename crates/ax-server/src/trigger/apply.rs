//! `ax.trigger.apply` and `ax.trigger.names`: a whole file of definitions at once.
//!
//! A file that fits in one request is checked whole, then stored, then the stored triggers
//! it does not name are deleted (`prune`). A larger one is sent in parts by the client
//! (`Client::apply_triggers`): every part checked first (`check`), so that an invalid
//! definition anywhere changes nothing, then every part stored, then the names read a page
//! at a time (`names`) and the ones the file does not have deleted.

use super::api::TriggerApi;
use super::model::TriggerDef;
use ax_core::protocol::WireError;
use ax_sdk::trigger::TriggerApply;
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Value};

/// Definitions stored at once by one `apply` (each is a few reads and up to two writes).
const IN_FLIGHT: usize = 64;

/// Bytes of names a `names` page holds at most, below the default max payload.
const NAMES_PAGE_BYTES: usize = 512 * 1024;

/// `e` about the definition at position `i` of the file.
fn at(i: usize, mut e: WireError) -> WireError {
    e.field = Some(format!("triggers[{i}].{}", e.field.unwrap_or_default()));
    e
}

impl TriggerApi {
    pub(super) async fn apply(&self, req: TriggerApply) -> Result<Value, WireError> {
        // Decode and check everything first: an invalid definition changes nothing.
        let offset = req.offset;
        let mut defs = Vec::with_capacity(req.triggers.len());
        for (i, value) in req.triggers.into_iter().enumerate() {
            defs.push(TriggerDef::decode(value).map_err(|e| at(offset.saturating_add(i), e))?);
        }
        // Checked concurrently (a flow's existence is a read); the first error in file
        // order is the answer.
        let mut checks = Vec::with_capacity(defs.len());
        for (i, def) in defs.iter().enumerate() {
            checks.push(async move {
                self.check(def)
                    .await
                    .map_err(|e| at(offset.saturating_add(i), e))
            });
        }
        futures::stream::iter(checks)
            .buffered(IN_FLIGHT)
            .try_collect::<Vec<()>>()
            .await?;
        if req.check {
            return Ok(json!({ "checked": defs.len() }));
        }
        let wanted: std::collections::HashSet<String> =
            defs.iter().map(|d| d.name.clone()).collect();
        let stored: Vec<Result<(String, &'static str), WireError>> =
            futures::stream::iter(defs.into_iter().map(|def| async move {
                let name = def.name.clone();
                self.store_checked(def).await.map(|o| (name, o))
            }))
            .buffered(IN_FLIGHT)
            .collect()
            .await;
        let mut report = Vec::with_capacity(stored.len());
        for one in stored {
            let (name, outcome) = one?;
            report.push(json!({ "name": name, "outcome": outcome }));
        }
        if req.prune {
            for name in self.store.names().await.map_err(WireError::unavailable)? {
                if !wanted.contains(&name) {
                    self.store
                        .delete(&name)
                        .await
                        .map_err(WireError::unavailable)?;
                    report.push(json!({ "name": name, "outcome": "deleted" }));
                }
            }
        }
        Ok(Value::Array(report))
    }

    /// The stored names after `after`, sorted, as many as fit in [`NAMES_PAGE_BYTES`]:
    /// `{"names", "more"}`.
    pub(super) async fn names(&self, after: Option<String>) -> Result<Value, WireError> {
        let all = self.store.names().await.map_err(WireError::unavailable)?;
        let page_bytes = self.ctx.faults.page_bytes().unwrap_or(NAMES_PAGE_BYTES);
        let mut page = Vec::new();
        let mut bytes = 0;
        let mut more = false;
        for name in all
            .into_iter()
            .filter(|n| after.as_ref().is_none_or(|a| n > a))
        {
            bytes += name.len() + 3;
            if bytes > page_bytes {
                more = true;
                break;
            }
            page.push(name);
        }
        Ok(json!({ "names": page, "more": more }))
    }
}
