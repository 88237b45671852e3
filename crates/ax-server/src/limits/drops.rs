//! Rate limits whose excess is dropped (`"excess": "drop"`, docs/PROTOCOL.md §7): a submit
//! takes the limit's token here, in the server, and one over the rate is refused
//! (`rate_limited`, with `retry_after_ms`) with nothing stored. Workers do not take that
//! token again (`LimitDef::throttles`).
//!
//! The token is the one workers take for a throttled limit: the bucket's TAT in
//! `AX_LIMIT_STATE` (key [`bucket_key`]), moved on by compare-and-set ([`gcra::take`]). The
//! definitions are followed from `AX_LIMITS` with a KV watch (history first); until it has
//! delivered them, a submit to a queue waits for it (at most [`READY_WAIT`]) rather than
//! pass a limit it has not read yet.

use async_nats::jetstream::{self, kv};
use ax_core::names::{LIMITS_BUCKET, LIMIT_STATE_BUCKET};
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::task::TaskMeta;
use ax_sdk::limits::gcra;
use ax_sdk::limits::model::bucket_key;
use ax_sdk::limits::{Excess, LimitDef};
use bytes::Bytes;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::RwLock;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The longest a submit waits for the definitions to be read before it answers
/// `unavailable`.
const READY_WAIT: Duration = Duration::from_secs(5);
/// Most compare-and-set tries for one token before the submit answers `unavailable`.
const CAS_TRIES: usize = 8;

/// The dropping limits of every queue, as `AX_LIMITS` holds them.
#[derive(Debug)]
pub(crate) struct Drops {
    /// Queue → its dropping limits (key `<queue>.<name>` → definition).
    by_queue: RwLock<HashMap<String, HashMap<String, LimitDef>>>,
    /// True once the watch delivered every stored definition.
    ready: watch::Sender<bool>,
    /// `AX_LIMIT_STATE`, once open.
    state: RwLock<Option<kv::Store>>,
}

impl Default for Drops {
    fn default() -> Drops {
        Drops {
            by_queue: RwLock::default(),
            ready: watch::Sender::new(false),
            state: RwLock::default(),
        }
    }
}

impl Drops {
    /// Whether [`Drops::check`] has anything to do for `meta`: the definitions are not read
    /// yet, or its queue has a dropping limit. A submit asks this first, so the check's
    /// large future is made only when it is needed (`crate::intake`).
    pub(crate) fn may_apply(&self, meta: &TaskMeta) -> bool {
        !*self.ready.borrow()
            || self
                .by_queue
                .read()
                .expect("not poisoned")
                .contains_key(&meta.queue)
    }

    /// Takes a token of every dropping limit that applies to `meta`; refuses the submit
    /// (`rate_limited`) at the first that has none. A queue with no dropping limit costs
    /// one map look-up.
    pub(crate) async fn check(&self, meta: &TaskMeta) -> Result<(), WireError> {
        if !*self.ready.borrow() {
            let mut ready = self.ready.subscribe();
            let waited = tokio::time::timeout(READY_WAIT, ready.wait_for(|r| *r)).await;
            if !matches!(waited, Ok(Ok(_))) {
                return Err(WireError::unavailable(
                    "the rate limits (AX_LIMITS) are not read yet: retry",
                ));
            }
        }
        let applying: Vec<LimitDef> = {
            let all = self.by_queue.read().expect("not poisoned");
            let Some(defs) = all.get(&meta.queue) else {
                return Ok(());
            };
            let mut found: Vec<LimitDef> = defs
                .values()
                .filter(|d| d.applies(&meta.name, meta.limit_key.as_deref()))
                .cloned()
                .collect();
            found.sort_by(|a, b| a.name.cmp(&b.name));
            found
        };
        if applying.is_empty() {
            return Ok(());
        }
        let state = self.state.read().expect("not poisoned").clone();
        let Some(state) = state else {
            return Err(WireError::unavailable(
                "AX_LIMIT_STATE is not open yet: retry",
            ));
        };
        for def in &applying {
            take(&state, def, meta.limit_key.as_deref()).await?;
        }
        Ok(())
    }

    /// Follows `AX_LIMITS` until `shutdown`: from the history, and again after a watch
    /// that ends or a reconnect (a watch may stall after one).
    pub(crate) async fn follow(&self, js: jetstream::Context, shutdown: CancellationToken) {
        loop {
            let opened = ax_core::retry::until_ok(
                "the limit buckets (AX_LIMITS, AX_LIMIT_STATE)",
                &shutdown,
                || async {
                    let defs = js.get_key_value(LIMITS_BUCKET).await?;
                    let state = js.get_key_value(LIMIT_STATE_BUCKET).await?;
                    let watch = defs.watch_with_history(">").await?;
                    // Nothing stored: the watch delivers nothing to wait for.
                    let mut stored = defs
                        .stream
                        .info_with_subjects(format!("$KV.{LIMITS_BUCKET}.>"))
                        .await?;
                    let none = stored.next().await.is_none();
                    Ok::<_, async_nats::Error>((state, watch, none))
                },
            )
            .await;
            let Some((state, mut watch, none)) = opened else {
                return;
            };
            *self.state.write().expect("not poisoned") = Some(state);
            // The keys this watch's history holds: once it is read, a limit an earlier
            // watch kept and this one did not deliver was deleted meanwhile.
            let mut seen = Some(std::collections::HashSet::new());
            if none {
                self.by_queue.write().expect("not poisoned").clear();
                seen = None;
                self.ready.send_replace(true);
            }
            let mut reconnects = ax_core::follow::Reconnects::new(&js.client());
            loop {
                let entry = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    entry = watch.next() => entry,
                    _ = reconnects.changed() => {
                        info!("rate limits: reconnected; following again");
                        break;
                    }
                };
                let Some(Ok(entry)) = entry else {
                    warn!("rate limits: watch ended; following again");
                    break;
                };
                self.apply(&entry);
                if let Some(keys) = &mut seen {
                    keys.insert(entry.key.clone());
                    if entry.delta == 0 {
                        let mut all = self.by_queue.write().expect("not poisoned");
                        for defs in all.values_mut() {
                            defs.retain(|k, _| keys.contains(k));
                        }
                        all.retain(|_, defs| !defs.is_empty());
                        seen = None;
                    }
                }
                if entry.delta == 0 {
                    self.ready.send_replace(true);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Applies one entry of `AX_LIMITS`: a dropping limit's definition is kept, anything
    /// else (a throttled limit, a pause, settings, a deleted key) forgets the key.
    fn apply(&self, entry: &kv::Entry) {
        let Some((queue, _)) = entry.key.split_once('.') else {
            return;
        };
        let def = (entry.operation == kv::Operation::Put)
            .then(|| serde_json::from_slice::<LimitDef>(&entry.value).ok())
            .flatten()
            .filter(|d| d.excess == Excess::Drop && d.validate().is_ok());
        let mut all = self.by_queue.write().expect("not poisoned");
        match def {
            Some(def) => {
                if !all.get(queue).is_some_and(|d| d.contains_key(&entry.key)) {
                    info!(queue, limit = %def.name, rate = ?def.rate, "a rate limit drops its excess at submit");
                }
                all.entry(queue.to_string())
                    .or_default()
                    .insert(entry.key.clone(), def);
            }
            None => {
                if let Some(defs) = all.get_mut(queue) {
                    defs.remove(&entry.key);
                    if defs.is_empty() {
                        all.remove(queue);
                    }
                }
            }
        }
    }
}

/// Takes one token of `def`'s bucket for a task with `limit_key`, or refuses.
async fn take(state: &kv::Store, def: &LimitDef, limit_key: Option<&str>) -> Result<(), WireError> {
    let key = bucket_key(def, limit_key);
    let interval = gcra::interval_us(def.rate.unwrap_or(0.0));
    for _ in 0..CAS_TRIES {
        let entry = state.entry(&key).await.map_err(WireError::unavailable)?;
        let (tat, revision) = match &entry {
            Some(e) if e.operation == kv::Operation::Put => (
                std::str::from_utf8(&e.value)
                    .ok()
                    .and_then(|v| v.split_whitespace().next())
                    .and_then(|t| t.parse::<u64>().ok()),
                Some(e.revision),
            ),
            Some(e) => (None, Some(e.revision)),
            None => (None, None),
        };
        let next = match gcra::take(tat, ax_core::time::now_us(), interval, def.burst()) {
            Ok(next) => next,
            Err(wait_us) => {
                let mut e = WireError::new(
                    ErrorCode::RateLimited,
                    format!(
                        "over the rate limit {} ({} per second, excess dropped): nothing stored",
                        def.name,
                        def.rate.unwrap_or_default()
                    ),
                );
                e.retry_after_ms = Some(wait_us.div_ceil(1000));
                return Err(e);
            }
        };
        let value = Bytes::from(next.to_string());
        let written = match revision {
            Some(rev) => state
                .update(&key, value, rev)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            None => state
                .create(&key, value)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
        };
        if written.is_ok() {
            return Ok(());
        }
    }
    Err(WireError::unavailable(format!(
        "the rate limit {}'s bucket stayed contended: retry",
        def.name
    )))
}
