//! The limits API: requests on `ax.limit.<op>` (`put`, `get`, `list`, `delete`,
//! `status`, `windows`, `fair_put`, `fair_get`) with JSON bodies, answered `{"ok": …}` or `{"error": …}` (docs/PROTOCOL.md
//! §7). Definitions live in `AX_LIMITS`; every worker of the queue follows them and
//! applies a change to its next deliveries within a second, to tasks already queued too
//! (a task handed back by a rate comes back within one interval of the old rate, at most
//! an hour). A delete of a limit that does not exist answers `deleted: false`.

use super::model::LimitDef;
use crate::context::Context;
use async_nats::jetstream::kv;
use ax_core::names::LIMITS_BUCKET;
use ax_core::protocol::{ErrorCode, WireError};
use ax_sdk::api::{unknown_operation, Api, Request};
use ax_sdk::limits::fair::{fair_key, FairDef, FairQueue};
use ax_sdk::limits::{LimitFilter, LimitName, LimitRequest};
use futures::StreamExt;
use serde_json::{json, Value};
use std::sync::Arc;

pub(crate) struct LimitApi {
    pub(crate) ctx: Arc<Context>,
    pub(crate) defs: kv::Store,
}

/// The key of limit `name` of `queue`, both checked first (an invalid key would be an
/// `unavailable` broker error, not the caller's `invalid_field`).
fn limit_key(queue: &str, name: &str) -> Result<String, WireError> {
    if !ax_core::names::valid_queue(queue) || !ax_core::names::valid_token(name, 64) {
        return Err(WireError::field("name", "not a limit name"));
    }
    Ok(format!("{queue}.{name}"))
}

impl LimitApi {
    pub(crate) async fn open(ctx: Arc<Context>) -> Result<LimitApi, async_nats::Error> {
        let defs = ctx.js.get_key_value(LIMITS_BUCKET).await?;
        Ok(LimitApi { ctx, defs })
    }

    pub(crate) async fn handle(&self, op: &str, body: &[u8]) -> Result<Value, WireError> {
        match LimitRequest::decode(op, body)? {
            LimitRequest::Put(mut def) => {
                if def.queue.is_empty() {
                    def.queue = def.queues.first().cloned().unwrap_or_default();
                }
                def.validate()?;
                let copies = self.copies(&def).await?;
                for copy in &copies {
                    self.ctx.queues.check(&self.ctx.js, &copy.queue).await?;
                }
                if !def.queues.is_empty() {
                    // One shared limit of a name: its copies on queues it no longer names go.
                    for old in self.list(">").await? {
                        if old.name == def.name
                            && !old.queues.is_empty()
                            && !def.queues.contains(&old.queue)
                        {
                            self.delete(&old.key()).await?;
                        }
                    }
                }
                for copy in &copies {
                    let value = serde_json::to_vec(copy).expect("serializes");
                    self.defs
                        .put(copy.key(), value.into())
                        .await
                        .map_err(WireError::unavailable)?;
                }
                Ok(serde_json::to_value(&def).expect("serializes"))
            }
            LimitRequest::Get(LimitName { queue, name }) => {
                let key = limit_key(&queue, &name)?;
                match self.defs.get(&key).await.map_err(WireError::unavailable)? {
                    Some(v) => serde_json::from_slice(&v).map_err(WireError::unavailable),
                    None => Err(WireError::new(
                        ErrorCode::NotFound,
                        format!("no limit {name:?} on queue {queue:?}"),
                    )),
                }
            }
            LimitRequest::Delete(LimitName { queue, name }) => {
                let key = limit_key(&queue, &name)?;
                // A shared limit goes from every queue it spans.
                let shared = match self.defs.get(&key).await.map_err(WireError::unavailable)? {
                    Some(v) => serde_json::from_slice::<LimitDef>(&v)
                        .map(|d| d.queues)
                        .unwrap_or_default(),
                    None => Vec::new(),
                };
                let mut deleted = self.delete(&key).await?;
                for other in shared.iter().filter(|q| **q != queue) {
                    deleted |= self.delete(&limit_key(other, &name)?).await?;
                }
                Ok(json!({"queue": queue, "name": name, "deleted": deleted}))
            }
            LimitRequest::List(LimitFilter { queue }) => Ok(json!(self.list_of(queue).await?)),
            LimitRequest::Status(LimitFilter { queue }) => {
                let defs = self.list_of(queue).await?;
                self.status(defs).await
            }
            LimitRequest::Windows(LimitFilter { queue }) => {
                if queue
                    .as_deref()
                    .is_some_and(|q| !ax_core::names::valid_queue(q))
                {
                    return Err(WireError::field("queue", "not a queue name"));
                }
                super::windows::list(&self.ctx.js, queue.as_deref()).await
            }
            LimitRequest::FairPut(def) => {
                def.validate()?;
                self.ctx.queues.check(&self.ctx.js, &def.queue).await?;
                let value = serde_json::to_vec(&def).expect("serializes");
                self.defs
                    .put(fair_key(&def.queue), value.into())
                    .await
                    .map_err(WireError::unavailable)?;
                Ok(serde_json::to_value(&def).expect("serializes"))
            }
            LimitRequest::FairGet(FairQueue { queue: None }) => {
                Ok(json!({ "reports": crate::fair::reports(&self.ctx.js).await? }))
            }
            LimitRequest::FairGet(FairQueue { queue: Some(queue) }) => {
                if !ax_core::names::valid_queue(&queue) {
                    return Err(WireError::field("queue", "not a queue name"));
                }
                let def = match self
                    .defs
                    .get(fair_key(&queue))
                    .await
                    .map_err(WireError::unavailable)?
                {
                    Some(v) => serde_json::from_slice(&v).map_err(WireError::unavailable)?,
                    None => FairDef::default_for(&queue),
                };
                let status = crate::fair::status(&self.ctx.js, &queue).await?;
                Ok(json!({"fair": def, "status": status}))
            }
            LimitRequest::Unknown => Err(unknown_operation(Api::Limit, op)),
        }
    }

    /// The limits of `queue`, or of every queue.
    async fn list_of(&self, queue: Option<String>) -> Result<Vec<LimitDef>, WireError> {
        let filter = match &queue {
            Some(q) if ax_core::names::valid_queue(q) => format!("{q}.>"),
            Some(_) => return Err(WireError::field("queue", "not a queue name")),
            None => ">".to_string(),
        };
        self.list(&filter).await
    }

    /// Each limit with what it holds now: tokens left in a queue- or name-wide rate bucket
    /// (per-key buckets are many: not listed), an adaptive limit's rate in force
    /// (`rate_now`), and the concurrency slots held, by whom.
    async fn status(&self, defs: Vec<LimitDef>) -> Result<Value, WireError> {
        use ax_core::names::{LIMIT_SLOTS_BUCKET, LIMIT_STATE_BUCKET};
        let js = &self.ctx.js;
        let state = js
            .get_key_value(LIMIT_STATE_BUCKET)
            .await
            .map_err(WireError::unavailable)?;
        let slots = js
            .get_key_value(LIMIT_SLOTS_BUCKET)
            .await
            .map_err(WireError::unavailable)?;
        let mut held: Vec<(String, String)> = Vec::new();
        if slots
            .stream
            .get_info()
            .await
            .map_err(WireError::unavailable)?
            .state
            .messages
            > 0
        {
            let mut keys = slots.keys().await.map_err(WireError::unavailable)?;
            while let Some(key) = keys.next().await {
                let key = key.map_err(WireError::unavailable)?;
                if let Ok(Some(v)) = slots.get(&key).await {
                    held.push((key, String::from_utf8_lossy(&v).to_string()));
                }
            }
        }
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let mut out = Vec::new();
        for def in defs {
            let (tokens, rate_now) = match (def.rate, def.per_key) {
                (Some(_), false) => {
                    let key = ax_sdk::limits::model::bucket_key(&def, None);
                    let bucket = state
                        .get(&key)
                        .await
                        .ok()
                        .flatten()
                        .map(|v| super::adaptive::BucketState::parse(&v))
                        .unwrap_or_default();
                    let rate = bucket.rate(&def, now_us);
                    let interval = super::gcra::interval_us(rate);
                    let tokens = bucket.tat.map_or(f64::from(def.burst()), |t| {
                        super::gcra::tokens(t, now_us, interval, def.burst())
                    });
                    (Some(tokens), def.adaptive.is_some().then_some(rate))
                }
                _ => (None, None),
            };
            let prefix = format!("{}.", ax_sdk::limits::model::bucket_prefix(&def));
            let holders: Vec<Value> = held
                .iter()
                .filter(|(k, _)| k.starts_with(&prefix))
                .map(|(k, h)| json!({"slot": k, "holder": h}))
                .collect();
            let mut entry = json!({"limit": def, "tokens": tokens, "slots_held": holders});
            if let Some(rate) = rate_now {
                entry["rate_now"] = json!(rate);
            }
            out.push(entry);
        }
        Ok(Value::Array(out))
    }

    /// The definitions a put stores: the limit itself, or a copy under each queue a shared
    /// limit spans. A shared one may not take the name of another queue's own limit
    /// (`conflict`): the two would be mistaken for one.
    async fn copies(&self, def: &LimitDef) -> Result<Vec<LimitDef>, WireError> {
        if def.queues.is_empty() {
            return Ok(vec![def.clone()]);
        }
        let mut copies = Vec::new();
        for queue in &def.queues {
            let copy = LimitDef {
                queue: queue.clone(),
                ..def.clone()
            };
            if let Some(v) = self
                .defs
                .get(copy.key())
                .await
                .map_err(WireError::unavailable)?
            {
                if serde_json::from_slice::<LimitDef>(&v).is_ok_and(|d| d.queues.is_empty()) {
                    return Err(WireError::new(
                        ErrorCode::Conflict,
                        format!(
                            "queue {queue:?} has a limit {:?} of its own: delete it or choose another name",
                            def.name
                        ),
                    ));
                }
            }
            copies.push(copy);
        }
        Ok(copies)
    }

    /// Deletes a definition if there is one: `true` if it existed (a delete of the revision
    /// read, so a put racing it is not lost unseen: read again), `false` if not.
    async fn delete(&self, key: &str) -> Result<bool, WireError> {
        for _ in 0..8 {
            let entry = self.defs.entry(key).await.map_err(WireError::unavailable)?;
            let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
                return Ok(false);
            };
            match self
                .defs
                .delete_expect_revision(key, Some(entry.revision))
                .await
            {
                Ok(()) => return Ok(true),
                Err(e)
                    if ax_core::error::ErrorKind::of(&e) == ax_core::error::ErrorKind::Conflict =>
                {
                    continue
                }
                Err(e) => return Err(WireError::unavailable(e)),
            }
        }
        Err(WireError::unavailable(
            "the limit kept changing while being deleted",
        ))
    }

    async fn list(&self, filter: &str) -> Result<Vec<LimitDef>, WireError> {
        let info = self
            .defs
            .stream
            .get_info()
            .await
            .map_err(WireError::unavailable)?;
        if info.state.messages == 0 {
            return Ok(Vec::new());
        }
        let mut keys = self.defs.keys().await.map_err(WireError::unavailable)?;
        let mut out = Vec::new();
        while let Some(key) = keys.next().await {
            let key = key.map_err(WireError::unavailable)?;
            let matches = filter == ">" || key.starts_with(filter.trim_end_matches('>'));
            if !matches {
                continue;
            }
            if let Some(v) = self.defs.get(&key).await.map_err(WireError::unavailable)? {
                if let Ok(def) = serde_json::from_slice::<LimitDef>(&v) {
                    out.push(def);
                }
            }
        }
        out.sort_by(|a, b| (&a.queue, &a.name).cmp(&(&b.queue, &b.name)));
        Ok(out)
    }
}
