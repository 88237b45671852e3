//! The trigger buckets as the trigger leader and the event router follow them, **pulled**
//! in batches by an ordered pull consumer instead of pushed by a KV watch: every stored
//! definition (the last write of each name), then each change; and each new write of a
//! trigger's state.
//!
//! A KV watch pushes as fast as the broker sends, however slowly its reader goes. A new
//! leader loads each definition with a round trip (its state), so the replay of 100,000
//! definitions waited in the client's buffers — and so did the state writes of 100,000
//! triggers put through the API while the leader loaded their definitions (heaptrack,
//! CHANGELOG.md "Design history"). Pulled, at most a batch waits in the client
//! and the rest in the stream. Ordering and gap handling are the ordered consumer's, as
//! for the watch.

use super::engine::EngineError;
use async_nats::jetstream::{self, consumer::pull::OrderedConfig, consumer::DeliverPolicy};
use ax_core::names::{TRIGGERS_BUCKET, TRIGGER_STATE_BUCKET};
use bytes::Bytes;
use futures::{Stream, StreamExt};

/// Messages a pull asks for at a time (the client asks for more as they are used).
const BATCH: usize = 128;

/// One stored write of a key.
pub(crate) struct KvWrite {
    /// The key: a trigger's name.
    pub(crate) name: String,
    /// The value as stored; `None` when the key was deleted or purged.
    pub(crate) value: Option<Bytes>,
    /// The write's revision (its stream sequence).
    pub(crate) revision: u64,
}

/// Every stored definition, then every change, in stream order.
pub(crate) async fn definitions(
    js: &jetstream::Context,
) -> Result<impl Stream<Item = Result<KvWrite, EngineError>>, EngineError> {
    follow(
        js,
        TRIGGERS_BUCKET,
        DeliverPolicy::LastPerSubject,
        "follow definitions",
    )
    .await
}

/// Each write of a trigger's state from now on.
pub(crate) async fn states(
    js: &jetstream::Context,
) -> Result<impl Stream<Item = Result<KvWrite, EngineError>>, EngineError> {
    follow(
        js,
        TRIGGER_STATE_BUCKET,
        DeliverPolicy::New,
        "follow trigger state",
    )
    .await
}

async fn follow(
    js: &jetstream::Context,
    bucket: &str,
    deliver_policy: DeliverPolicy,
    op: &'static str,
) -> Result<impl Stream<Item = Result<KvWrite, EngineError>>, EngineError> {
    let broken = move |e: async_nats::Error| EngineError::Broker { op, source: e };
    let stream = js
        .get_stream(format!("KV_{bucket}"))
        .await
        .map_err(|e| broken(e.into()))?;
    let prefix = format!("$KV.{bucket}.");
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: format!("{prefix}>"),
            deliver_policy,
            max_batch: BATCH as i64,
            ..Default::default()
        })
        .await
        .map_err(|e| broken(e.into()))?;
    let messages = consumer.messages().await.map_err(|e| broken(e.into()))?;
    Ok(messages.map(move |m| {
        let m = m.map_err(|e| broken(e.into()))?;
        let revision = m.info().map_err(broken)?.stream_sequence;
        let name = m
            .subject
            .strip_prefix(prefix.as_str())
            .unwrap_or(&m.subject)
            .to_string();
        let removed = m
            .headers
            .as_ref()
            .and_then(|h| h.get("KV-Operation"))
            .is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"));
        Ok(KvWrite {
            name,
            value: (!removed).then(|| m.message.payload.clone()),
            revision,
        })
    }))
}
