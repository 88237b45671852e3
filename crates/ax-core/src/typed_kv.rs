//! JSON values in a KV bucket, written only by create or compare-and-set: the idiom the
//! flow, trigger and task stores share, written once with one error type.
//!
//! - [`get`] reads a key's latest value and revision from the bucket's stream leader
//!   ([`kv_read`](crate::kv_read)): a reader that decides from what it reads sees every
//!   acknowledged write. [`get_any`] lets any replica answer, for a read that a
//!   compare-and-set checks anyway.
//! - [`put`] creates a key (`revision` `None`) or compare-and-sets it; a lost race is
//!   [`KvError::Stale`], never a broker error. [`put_again`] also sends the write again
//!   when the client connects anew while it waits.
//! - [`scan`] reads every current value of the keys matching a filter.

use crate::error::ErrorKind;
use async_nats::jetstream::kv;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Errors of a typed KV store.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// Another writer changed the key since it was read (or created it first).
    #[error("{0}: changed concurrently")]
    Stale(String),
    /// A stored value does not decode.
    #[error("{key}: corrupt value: {source}")]
    Corrupt {
        /// Key.
        key: String,
        /// Decode error.
        source: serde_json::Error,
    },
    /// The value is larger than the server accepts in one message (`max_payload`).
    #[error("{key}: {bytes} bytes is over the server's max payload")]
    TooLarge {
        /// Key.
        key: String,
        /// Size of the value.
        bytes: usize,
    },
    /// The broker failed.
    #[error("{key}: {op}: {source}")]
    Broker {
        /// Key (or bucket, or filter).
        key: String,
        /// Operation.
        op: &'static str,
        /// Underlying error.
        source: async_nats::Error,
    },
}

impl KvError {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            KvError::Stale(_) => ErrorKind::Conflict,
            KvError::Corrupt { .. } | KvError::TooLarge { .. } => ErrorKind::Invalid,
            KvError::Broker { source, .. } => ErrorKind::of(source.as_ref()),
        }
    }
}

/// A broker error of `op` on `key`.
pub fn broker(key: &str, op: &'static str, e: impl Into<async_nats::Error>) -> KvError {
    KvError::Broker {
        key: key.to_string(),
        op,
        source: e.into(),
    }
}

/// The value of `key` and its revision, read from the stream's leader; `None` if absent
/// or deleted.
pub async fn get<T: DeserializeOwned>(
    kv: &kv::Store,
    key: &str,
) -> Result<Option<(T, u64)>, KvError> {
    let entry = crate::kv_read::latest(kv, key)
        .await
        .map_err(|e| broker(key, "get", e))?;
    decode(key, entry)
}

/// Like [`get`], answered by any replica (a direct get where the bucket allows it): may be
/// older than an acknowledged write, so only for a read a compare-and-set will check.
pub async fn get_any<T: DeserializeOwned>(
    kv: &kv::Store,
    key: &str,
) -> Result<Option<(T, u64)>, KvError> {
    let entry = kv.entry(key).await.map_err(|e| broker(key, "get", e))?;
    decode(key, entry)
}

/// The value of a KV entry and its revision; `None` for no entry or a delete or purge
/// marker.
pub fn decode<T: DeserializeOwned>(
    key: &str,
    entry: Option<kv::Entry>,
) -> Result<Option<(T, u64)>, KvError> {
    match entry {
        Some(e) if e.operation == kv::Operation::Put => {
            let value = serde_json::from_slice(&e.value).map_err(|source| KvError::Corrupt {
                key: key.to_string(),
                source,
            })?;
            Ok(Some((value, e.revision)))
        }
        _ => Ok(None),
    }
}

/// Creates `key` (`revision` `None`) or compare-and-sets it against `revision`; answers
/// the new revision.
pub async fn put<T: Serialize>(
    kv: &kv::Store,
    key: &str,
    value: &T,
    revision: Option<u64>,
) -> Result<u64, KvError> {
    put_bytes(kv, key, to_body(value), revision).await
}

/// Like [`put`], but sent again if the client connects anew while it waits
/// ([`write_again`]).
pub async fn put_again<T: Serialize>(
    client: &async_nats::Client,
    kv: &kv::Store,
    key: &str,
    value: &T,
    revision: Option<u64>,
) -> Result<u64, KvError> {
    let body = to_body(value);
    let lost = |e: &KvError| matches!(e, KvError::Stale(_));
    let unsure = |e| broker(key, "get", e);
    write_again(client, kv, key, &body, revision, lost, unsure, || {
        put_bytes(kv, key, body.clone(), revision)
    })
    .await
}

/// Runs `write`, a create (`revision` `None`) or compare-and-set of `key` to `body`, and
/// runs it again if the client connects anew while it waits: a write the broker had when
/// it stopped is never answered, and would hold its caller for the client's request
/// timeout. A write that finds the key changed (an error `lost` tells) may be one whose
/// earlier sending was stored (sent again here, or by a group commit's fallback to single
/// writes after the group's answer was lost): it is taken as written (answering that
/// revision) when the key, read from its stream's leader, holds these very bytes at a
/// revision after `revision`; else the lost race stands. A failed read is `unsure` of it:
/// neither.
#[allow(clippy::too_many_arguments)]
pub async fn write_again<E, Fut>(
    client: &async_nats::Client,
    kv: &kv::Store,
    key: &str,
    body: &[u8],
    revision: Option<u64>,
    lost: impl Fn(&E) -> bool,
    unsure: impl FnOnce(async_nats::Error) -> E,
    write: impl FnMut() -> Fut,
) -> Result<u64, E>
where
    Fut: std::future::Future<Output = Result<u64, E>>,
{
    let written = crate::follow::across_reconnects(client, write).await;
    match &written {
        Err(e) if lost(e) => {}
        _ => return written,
    }
    let read = crate::follow::across_reconnects(client, || crate::kv_read::latest(kv, key));
    match read.await.map_err(unsure)? {
        Some(e)
            if e.operation == kv::Operation::Put
                && e.value.as_ref() == body
                && revision.is_none_or(|r| e.revision > r) =>
        {
            tracing::debug!(key, "a write sent again had been stored the first time");
            Ok(e.revision)
        }
        _ => written,
    }
}

fn to_body<T: Serialize>(value: &T) -> bytes::Bytes {
    serde_json::to_vec(value).expect("serializes").into()
}

/// Most sendings of a write that a replicated stream refuses because another write of
/// its key is in flight ([`past_in_flight`]).
const IN_FLIGHT_TRIES: u32 = 8;

/// Runs `write` (a compare-and-set) again, after a pause of 1, 2, 4 … 32 ms,
/// while a replicated stream refuses it because another write of the same key is in
/// flight (JetStream 10164, [`crate::error::is_write_in_flight`]): nothing of it was
/// stored, and the refusal does not say the key moved on (the write in flight may still
/// fail, or be this writer's own earlier sending). Sent again, it is stored or refused
/// against the key as it then is (10071: a lost race). After [`IN_FLIGHT_TRIES`] such
/// refusals the last one is answered (a lost race to callers that classify it).
///
/// [`put_bytes`]'s creates do not come here: a create that meets another create in flight
/// has lost (that one found no value and lands but for a broker fault), and a claim's
/// create racing its submitter's meets it hundreds of times in 10,000 flow events on
/// three nodes, where a compare-and-set met it 0–4 times (docs/PERFORMANCE.md, "Flows").
/// A group-committed write at revision 0 (`TaskStore::cas`) does: those seldom race.
pub(crate) async fn past_in_flight<T, E, Fut>(
    key: &str,
    mut write: impl FnMut() -> Fut,
) -> Result<T, E>
where
    Fut: std::future::Future<Output = Result<T, E>>,
    E: std::error::Error + 'static,
{
    let mut pause = std::time::Duration::from_millis(1);
    for _ in 1..IN_FLIGHT_TRIES {
        match write().await {
            Err(e) if crate::error::is_write_in_flight(&e) => {
                tracing::debug!(
                    key,
                    "a write met another write of its key in flight; sending it again"
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_millis(32));
            }
            done => return done,
        }
    }
    write().await
}

/// [`put`] of a value already serialized to `body`.
pub async fn put_bytes(
    kv: &kv::Store,
    key: &str,
    body: bytes::Bytes,
    revision: Option<u64>,
) -> Result<u64, KvError> {
    let bytes = body.len();
    let too_large = |e: &(dyn std::error::Error + 'static)| {
        crate::error::is_max_payload(e).then(|| KvError::TooLarge {
            key: key.to_string(),
            bytes,
        })
    };
    match revision {
        // A create that meets another create in flight (10164) has lost: that one passed
        // its check (no value) and lands but for a broker fault; `create_lost` reads both.
        None => kv.create(key, body).await.map_err(|e| {
            if create_lost(&e) {
                KvError::Stale(key.to_string())
            } else {
                too_large(&e).unwrap_or_else(|| broker(key, "create", e))
            }
        }),
        Some(rev) => past_in_flight(key, || kv.update(key, body.clone(), rev))
            .await
            .map_err(|e| {
                // 10071, or 10164 still after `past_in_flight`'s sendings: a lost race.
                if crate::error::ErrorKind::of(&e) == crate::error::ErrorKind::Conflict {
                    KvError::Stale(key.to_string())
                } else {
                    too_large(&e).unwrap_or_else(|| broker(key, "update", e))
                }
            }),
    }
}

/// Several keys of one bucket written together (one atomic batch, [`crate::atomic`]): each
/// `(key, value, revision)` is created (`None`) or compare-and-set against `revision`, and
/// either every write is stored or none is (a lost check is [`KvError::Stale`] naming the
/// keys). The bucket's stream must allow atomic publish.
pub async fn put_all<T: Serialize>(
    client: &async_nats::Client,
    kv: &kv::Store,
    writes: &[(String, &T, Option<u64>)],
) -> Result<(), KvError> {
    let prefix = kv.put_prefix.as_ref().unwrap_or(&kv.prefix);
    let msgs: Vec<crate::atomic::Outgoing> = writes
        .iter()
        .map(|(key, value, revision)| {
            let mut headers = async_nats::HeaderMap::new();
            let expected = revision.unwrap_or(0).to_string();
            headers.insert("Nats-Expected-Last-Subject-Sequence", expected.as_str());
            crate::atomic::Outgoing {
                subject: format!("{prefix}{key}"),
                headers,
                payload: serde_json::to_vec(value).expect("serializes").into(),
            }
        })
        .collect();
    let keys = || {
        let keys: Vec<&str> = writes.iter().map(|w| w.0.as_str()).collect();
        keys.join(", ")
    };
    let bytes = msgs.iter().map(|m| m.payload.len()).max();
    match crate::atomic::publish(client, msgs).await {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == ErrorKind::Conflict => Err(KvError::Stale(keys())),
        Err(e) if crate::error::is_max_payload(&e) => Err(KvError::TooLarge {
            key: keys(),
            bytes: bytes.unwrap_or_default(),
        }),
        Err(e) => Err(broker(&keys(), "atomic put", e)),
    }
}

/// Every current value of the keys matching `filter`, by key (values that do not decode
/// are left out), read from a watch with history.
pub async fn scan<T: DeserializeOwned>(
    kv: &kv::Store,
    filter: &str,
) -> Result<Vec<(String, T)>, KvError> {
    let mut watch = kv
        .watch_with_history(filter)
        .await
        .map_err(|e| broker(filter, "list", e))?;
    let mut out: std::collections::BTreeMap<String, T> = Default::default();
    // An empty bucket delivers nothing, so look first. (Fresh stream info: `status()`
    // answers from what was cached when the bucket was opened.)
    let pending = kv
        .stream
        .get_info()
        .await
        .map_err(|e| broker(filter, "list", e))?
        .state
        .messages;
    if pending == 0 {
        return Ok(Vec::new());
    }
    loop {
        let next = tokio::time::timeout(crate::follow::PULL_EXPIRES, watch.next()).await;
        let Ok(Some(entry)) = next else { break };
        let entry = entry.map_err(|e| broker(filter, "list", e))?;
        match entry.operation {
            kv::Operation::Put => {
                if let Ok(v) = serde_json::from_slice(&entry.value) {
                    out.insert(entry.key.clone(), v);
                }
            }
            _ => {
                out.remove(&entry.key);
            }
        }
        if entry.delta == 0 {
            break;
        }
    }
    Ok(out.into_iter().collect())
}

/// True if a KV create failed because the key exists. A create racing another create of
/// the same key can also come back as a "wrong last sequence" error (JetStream 10071 or
/// 10164) instead of `AlreadyExists`; both mean another writer created it first.
pub fn create_lost(e: &kv::CreateError) -> bool {
    e.kind() == kv::CreateErrorKind::AlreadyExists
        || crate::error::ErrorKind::of(e) == crate::error::ErrorKind::Conflict
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::jetstream::{self, context::PublishError, context::PublishErrorKind};
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A publish refused as a replicated stream refuses a write whose key has another
    /// write in flight (`code` 10164), or a lost compare-and-set (10071).
    fn refused(code: u64) -> PublishError {
        let js: jetstream::Error = serde_json::from_value(serde_json::json!({
            "code": 400, "err_code": code, "description": "wrong last sequence"
        }))
        .expect("a JetStream error");
        PublishError::with_source(PublishErrorKind::Other, js)
    }

    #[tokio::test]
    async fn a_write_refused_while_another_is_in_flight_is_sent_again() {
        // Stored on its fourth sending.
        let sent = AtomicU32::new(0);
        let out = past_in_flight("k", || async {
            match sent.fetch_add(1, Ordering::SeqCst) {
                0..=2 => Err(refused(10164)),
                _ => Ok(7),
            }
        })
        .await;
        assert_eq!(out.unwrap(), 7);
        assert_eq!(sent.load(Ordering::SeqCst), 4);
        // A lost race (10071) is answered at once.
        let sent = AtomicU32::new(0);
        let out: Result<u64, _> = past_in_flight("k", || async {
            sent.fetch_add(1, Ordering::SeqCst);
            Err(refused(10071))
        })
        .await;
        assert_eq!(ErrorKind::of(&out.unwrap_err()), ErrorKind::Conflict);
        assert_eq!(sent.load(Ordering::SeqCst), 1);
        // In flight every time: given up after IN_FLIGHT_TRIES sendings, a conflict.
        let sent = AtomicU32::new(0);
        let out: Result<u64, _> = past_in_flight("k", || async {
            sent.fetch_add(1, Ordering::SeqCst);
            Err(refused(10164))
        })
        .await;
        let e = out.unwrap_err();
        assert!(crate::error::is_write_in_flight(&e));
        assert_eq!(ErrorKind::of(&e), ErrorKind::Conflict);
        assert_eq!(sent.load(Ordering::SeqCst), IN_FLIGHT_TRIES);
    }
}
