//! Idempotency keys (`AX_IDEMPOTENCY`, key `<queue>.<hex of the key>`): which task a
//! producer's key names, and the claim's check of a keyed task that has no record.
//!
//! An immediate task submitted with a key stores its ready message first and its key
//! second, naming it; it has no record until a worker claims it (docs/PROTOCOL.md §2,
//! "Idempotency keys"). Two submits of one key that race, or a submit whose producer
//! retried after the first one died between the two writes, can each store a message:
//! the key names one of them, and the claim ([`Keys::check`]) runs only that one.

use crate::names;
use crate::state::StateError;
use crate::task::TaskMeta;
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use std::time::Duration;
use tokio::sync::OnceCell;

/// What an idempotency key holds: the id of the task it names and whether that task's
/// message was stored before the key was written (`"<id> stored"`, written by submits
/// since 2026-12-03), or the key came first (`"<id>"`: delayed tasks, and every key written
/// before then), in which case the task may never have been stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The task the key names.
    pub id: String,
    /// True if its message was stored before the key was written.
    pub stored: bool,
}

impl KeyValue {
    /// The value as written to the bucket.
    pub fn encode(&self) -> Bytes {
        match self.stored {
            true => Bytes::from(format!("{} stored", self.id)),
            false => Bytes::from(self.id.clone()),
        }
    }

    /// Reads a stored value (anything after the id other than ` stored` is ignored).
    pub fn parse(value: &[u8]) -> KeyValue {
        let text = String::from_utf8_lossy(value);
        match text.split_once(' ') {
            Some((id, rest)) => KeyValue {
                id: id.to_string(),
                stored: rest == "stored",
            },
            None => KeyValue {
                id: text.into_owned(),
                stored: false,
            },
        }
    }
}

/// What the claim of a keyed task without a record may do ([`Keys::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The key names this task (now, if it named none): run it.
    Run,
    /// The key names another task, written while this one's key would still have held:
    /// this message is the copy of a submit that lost the key. Retire it unrun.
    Stray(String),
}

/// The idempotency bucket, opened when first needed (a worker that never sees a keyed
/// task without a record never opens it).
#[derive(Debug, Clone)]
pub struct Keys {
    js: jetstream::Context,
    opened: std::sync::Arc<OnceCell<(kv::Store, Duration)>>,
}

impl Keys {
    /// Keys of the bucket [`names::IDEMPOTENCY_BUCKET`] reached through `js`.
    pub fn new(js: jetstream::Context) -> Keys {
        Keys {
            js,
            opened: Default::default(),
        }
    }

    /// The bucket and how long a key is kept (its `max_age`; zero: for ever).
    async fn store(&self, id: &str) -> Result<&(kv::Store, Duration), StateError> {
        self.opened
            .get_or_try_init(|| async {
                let broker = |e: async_nats::Error| StateError::Broker {
                    id: id.to_string(),
                    op: "open the idempotency bucket",
                    source: e,
                };
                let store = self
                    .js
                    .get_key_value(names::IDEMPOTENCY_BUCKET)
                    .await
                    .map_err(|e| broker(e.into()))?;
                let status = store.status().await.map_err(|e| broker(e.into()))?;
                let window = status.max_age();
                Ok((store, window))
            })
            .await
    }

    /// Decides whether the message of keyed task `meta`, stored at `published_ms` (Unix
    /// milliseconds, the stream's time of the message), may run
    /// when the task has no record: the key names it (or named nothing, and now names
    /// it: a submit that died between its message and its key) → [`Verdict::Run`]; the
    /// key names another task and was written less than the key window after this
    /// message (so this message's own key, had it won, would still hold) →
    /// [`Verdict::Stray`]. A key written later than that belongs to a newer task with
    /// the same key: this one's had expired, and it runs.
    pub async fn check(&self, meta: &TaskMeta, published_ms: i128) -> Result<Verdict, StateError> {
        let Some(key) = meta.idempotency_key.as_deref() else {
            return Ok(Verdict::Run);
        };
        let (store, window) = self.store(&meta.id).await?;
        let kv_key = names::idempotency_kv_key(&meta.queue, key);
        let broker = |op: &'static str, e: async_nats::Error| StateError::Broker {
            id: meta.id.clone(),
            op,
            source: e,
        };
        let decide = |entry: &kv::Entry| {
            let named = KeyValue::parse(&entry.value);
            if named.id == meta.id {
                return Verdict::Run;
            }
            let written_ms = entry.created.unix_timestamp_nanos() / 1_000_000;
            let expired = !window.is_zero()
                && written_ms >= published_ms.saturating_add(window.as_millis() as i128);
            match expired {
                true => Verdict::Run,
                false => Verdict::Stray(named.id),
            }
        };
        // The common case, a key naming this task, from any replica (a direct get). An
        // absent key or one naming another task is read again from the stream's leader
        // before it decides anything: a replica catching up after a restart answers
        // "absent" for keys written long ago (docs/ARCHITECTURE.md, "What JetStream does
        // for us, and what we built").
        let direct = store
            .entry(&kv_key)
            .await
            .map_err(|e| broker("read idempotency key", e.into()))?;
        if let Some(entry) = direct.filter(|e| e.operation == kv::Operation::Put) {
            if KeyValue::parse(&entry.value).id == meta.id {
                return Ok(Verdict::Run);
            }
        }
        for _ in 0..3 {
            let latest = crate::kv_read::latest(store, &kv_key)
                .await
                .map_err(|e| broker("read idempotency key from the stream leader", e))?;
            if let Some(entry) = latest.filter(|e| e.operation == kv::Operation::Put) {
                return Ok(decide(&entry));
            }
            let value = KeyValue {
                id: meta.id.clone(),
                stored: true,
            };
            // Any failure is followed by a read: a create that was stored but not
            // answered, or refused because the key exists, shows there.
            if store.create(&kv_key, value.encode()).await.is_ok() {
                return Ok(Verdict::Run);
            }
        }
        Err(StateError::Broker {
            id: meta.id.clone(),
            op: "read idempotency key",
            source: "the key kept changing while it was read".into(),
        })
    }
}

/// Records the item keys of batch `batch_id` in `queue` (the hex tokens of its
/// `Ax-Batch-Keys`, [`crate::batching::KEYS`]), each naming the batch (`"<id> stored"`:
/// its items are stored in it), as a batch is closed: until then a retried item finds
/// its key in the open batch's message, from then on in the bucket. A key already there
/// is left as it is (a close tried again writes the same). Errs if a key is neither
/// written nor found after three tries; the batch must then stay open.
pub async fn write_item_keys(
    store: &kv::Store,
    queue: &str,
    batch_id: &str,
    hex_keys: Vec<String>,
) -> Result<(), async_nats::Error> {
    use futures::StreamExt;
    let value = KeyValue {
        id: batch_id.to_string(),
        stored: true,
    }
    .encode();
    let writes = hex_keys.into_iter().map(|hex| {
        let kv_key = format!("{queue}.{hex}");
        let value = value.clone();
        async move {
            for _ in 0..3 {
                if store.create(&kv_key, value.clone()).await.is_ok() {
                    return Ok(());
                }
                // Refused (it exists, or a write of it is in flight on a replicated
                // bucket) or unanswered: the stream's leader says whether it is there.
                let found = crate::kv_read::latest(store, &kv_key).await?;
                if let Some(entry) = found.filter(|e| e.operation == kv::Operation::Put) {
                    let named = KeyValue::parse(&entry.value).id;
                    if named != batch_id {
                        tracing::warn!(key = %kv_key, batch = %batch_id, named = %named, "a batch item's idempotency key names another task");
                    }
                    return Ok(());
                }
            }
            Err::<(), async_nats::Error>(format!("idempotency key {kv_key} not written").into())
        }
    });
    let mut writes = futures::stream::iter(writes).buffer_unordered(32);
    while let Some(done) = writes.next().await {
        done?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_old_values_read_as_unstored() {
        for stored in [true, false] {
            let v = KeyValue {
                id: "q.ABC123".into(),
                stored,
            };
            assert_eq!(KeyValue::parse(&v.encode()), v);
        }
        assert_eq!(
            KeyValue::parse(b"q.ABC123"),
            KeyValue {
                id: "q.ABC123".into(),
                stored: false
            }
        );
        assert!(!KeyValue::parse(b"q.ABC123 other").stored);
    }
}
