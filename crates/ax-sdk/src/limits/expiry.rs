//! Writes of concurrency slots with a per-message TTL (server ≥ 2.11, `allow_msg_ttl` on
//! `KV_AX_LIMIT_SLOTS`): each slot expires after *its own queue's* ack wait, not after one
//! bucket-wide `max_age` shared by every queue (a queue with a 60 s ack wait made a 4 s
//! queue's dead holder block its singleton for a minute). A KV create over a deleted key
//! and a KV update carry no TTL in async-nats, so slots are written here as the KV API
//! writes them: a publish to `$KV.AX_LIMIT_SLOTS.<key>` expecting the key's last revision,
//! with `Nats-TTL`.

use crate::names::LIMIT_SLOTS_BUCKET;
use async_nats::jetstream::{self, context, kv};
use bytes::Bytes;
use std::time::Duration;

/// Why a slot write did not happen.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WriteError {
    /// The key is not at the expected revision: another holder has it (or it expired
    /// and was taken).
    #[error("the slot is held by another attempt")]
    Taken,
    /// The bucket does not allow per-message TTLs (made before this version, and
    /// `ax streams apply` not run since).
    #[error("AX_LIMIT_SLOTS allows no per-message TTL")]
    TtlDisabled,
    /// The broker could not be asked.
    #[error("{0}")]
    Broker(String),
}

fn classify(e: &context::PublishError) -> WriteError {
    if e.kind() == context::PublishErrorKind::WrongLastSequence {
        return WriteError::Taken;
    }
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(src) = cur {
        if let Some(js) = src.downcast_ref::<jetstream::Error>() {
            match js.error_code() {
                jetstream::ErrorCode::MESSAGE_TTL_DISABLED => return WriteError::TtlDisabled,
                jetstream::ErrorCode::STREAM_WRONG_LAST_SEQUENCE
                | jetstream::ErrorCode::STREAM_WRONG_LAST_SEQUENCE_CONSTANT => {
                    return WriteError::Taken
                }
                _ => {}
            }
        }
        cur = src.source();
    }
    WriteError::Broker(e.to_string())
}

/// Writes `value` at `key` if its last revision is `expected` (0: never written), to
/// expire `ttl` after (none: the bucket's max age). Answers the new revision.
pub(crate) async fn write(
    js: &jetstream::Context,
    key: &str,
    value: Bytes,
    expected: u64,
    ttl: Option<Duration>,
) -> Result<u64, WriteError> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        "Nats-Expected-Last-Subject-Sequence",
        expected.to_string().as_str(),
    );
    if let Some(ttl) = ttl {
        let secs = ttl.as_secs_f64().ceil().max(1.0) as u64;
        headers.insert("Nats-TTL", format!("{secs}s").as_str());
    }
    let subject = format!("$KV.{LIMIT_SLOTS_BUCKET}.{key}");
    let ack = js
        .publish_with_headers(subject, headers, value)
        .await
        .map_err(|e| classify(&e))?;
    let ack = ack.await.map_err(|e| classify(&e))?;
    Ok(ack.sequence)
}

/// Creates `key` if no one holds it: never written, deleted (released) or purged.
pub(crate) async fn create(
    js: &jetstream::Context,
    slots: &kv::Store,
    key: &str,
    value: Bytes,
    ttl: Option<Duration>,
) -> Result<u64, WriteError> {
    match write(js, key, value.clone(), 0, ttl).await {
        Err(WriteError::Taken) => {}
        other => return other,
    }
    let entry = slots
        .entry(key)
        .await
        .map_err(|e| WriteError::Broker(e.to_string()))?;
    match entry {
        Some(e) if matches!(e.operation, kv::Operation::Delete | kv::Operation::Purge) => {
            write(js, key, value, e.revision, ttl).await
        }
        // Held; or it expired between the two reads: the next delivery tries again.
        _ => Err(WriteError::Taken),
    }
}
