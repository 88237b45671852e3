//! What a handler gets ([`Task`]) and how handlers are held.

use super::beat::Beats;
use super::error::TaskError;
use super::fence::Fence;
use crate::names::Priority;
use crate::output::{IntoOutput, Output};
use crate::task::ContentType;
use bytes::Bytes;
use futures::future::BoxFuture;
use std::future::Future;
use std::sync::Arc;

/// A task as the handler sees it.
#[derive(Debug, Clone)]
pub struct Task {
    /// Task id.
    pub id: String,
    /// Task name.
    pub name: String,
    /// Queue.
    pub queue: String,
    /// Priority.
    pub priority: Priority,
    /// The payload bytes (JSON text unless submitted as `payload_base64`).
    pub payload: Bytes,
    /// True if the payload is JSON.
    pub is_json: bool,
    /// This attempt, 1-based.
    pub attempt: u32,
    /// Attempts allowed in all.
    pub max_attempts: u32,
    /// Business idempotency key, if the producer gave one.
    pub idempotency_key: Option<String>,
    /// When the task was accepted, ms since the Unix epoch.
    pub created_at_ms: u64,
    /// Due time of a delayed task, ms since the Unix epoch.
    pub run_at_ms: Option<u64>,
    /// The W3C trace context the task was submitted with, if any.
    pub traceparent: Option<String>,
    /// The business id the task works for, if the producer (or its flow run) gave one.
    pub business_id: Option<String>,
    pub(crate) fence: Arc<Fence>,
    pub(crate) cancel: tokio_util::sync::CancellationToken,
    pub(crate) beats: Arc<Beats>,
}

impl Task {
    /// The fencing token of this attempt: the revision of its `running` record,
    /// strictly greater than any earlier attempt's token for this task. Pass it to systems
    /// you write to, and have them refuse writes with a smaller token.
    ///
    /// A task's first attempt starts without its `running` write (docs/PROTOCOL.md §3);
    /// asking for the token makes that write now (one round trip), so only handlers that
    /// use fencing pay for it. Errors: `overtaken` (another attempt took the task over:
    /// stop, this attempt's result will be refused) or `unavailable` (JetStream could not
    /// be reached; retryable).
    pub async fn fencing_token(&self) -> Result<u64, TaskError> {
        self.fence.token().await
    }

    /// Cancelled when an operator cancels this task while the attempt runs. The worker
    /// then drops the handler's future (as on a timeout) and records the task
    /// `cancelled`; work the handler spawned elsewhere can watch this token to stop too.
    pub fn cancellation(&self) -> tokio_util::sync::CancellationToken {
        self.cancel.clone()
    }

    /// Says the handler still makes progress. A name with a soft timeout
    /// ([`TaskOptions::heartbeat_timeout`](super::TaskOptions::heartbeat_timeout), or the stored setting `heartbeat_timeout_ms`)
    /// must call this at least that often, or the attempt is stopped and failed with class
    /// `heartbeat_timeout`; without one it costs an atomic add. The broker's ack-wait
    /// heartbeat is separate and automatic.
    pub fn heartbeat(&self) {
        self.beats.beat();
    }

    /// Decodes the JSON payload; a decode error is a non-retryable `bad_payload`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, TaskError> {
        serde_json::from_slice(&self.payload)
            .map_err(|e| TaskError::permanent("bad_payload", e.to_string()))
    }
}

pub(crate) type Handler =
    Arc<dyn Fn(Task) -> BoxFuture<'static, Result<Output, TaskError>> + Send + Sync>;

pub(crate) fn boxed<F, Fut, O>(f: F) -> Handler
where
    F: Fn(Task) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<O, TaskError>> + Send + 'static,
    O: IntoOutput + 'static,
{
    Arc::new(move |task| {
        let run = f(task);
        Box::pin(async move { run.await.map(IntoOutput::into_output) })
    })
}

pub(crate) fn is_json(ct: ContentType) -> bool {
    ct == ContentType::Json
}
