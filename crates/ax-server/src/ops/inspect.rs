//! `ax.task.payload`: a task's payload and options, read from the message that carries
//! it (the task record holds neither). Where the message is depends on the state: the
//! delayed stream while scheduled, the ready stream until a worker acks it, the dead
//! letter once dead; a finished task's message is gone (the ready streams keep work,
//! not history).

use super::actions::Ops;
use ax_core::names;
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::state::TaskState;
use ax_core::task::{ContentType, TaskMeta};
use base64::Engine;
use bytes::Bytes;
use serde_json::{json, Value};

/// Most payload bytes answered; a larger payload is cut and said so.
const MAX_SHOWN: usize = 64 * 1024;

/// The options a task carries in its message headers, as JSON.
fn options(meta: &TaskMeta) -> Value {
    json!({
        "priority": meta.priority,
        "max_attempts": meta.max_attempts,
        "timeout_ms": meta.timeout.as_millis() as u64,
        "backoff": {
            "base_ms": meta.backoff.base.as_millis() as u64,
            "max_ms": meta.backoff.max.as_millis() as u64,
            "jitter": meta.backoff.jitter,
        },
        "retry_on": meta.retry_on,
        "no_retry_on": meta.no_retry_on,
        "run_at_ms": meta.run_at_ms,
        "limit_key": meta.limit_key,
        "content_type": match meta.content_type {
            ContentType::Json => "application/json",
            ContentType::Bytes => "application/octet-stream",
        },
    })
}

/// The payload as JSON when it is JSON, else base64; cut at [`MAX_SHOWN`].
fn shown(payload: &Bytes, content: ContentType) -> Value {
    let cut = payload.len() > MAX_SHOWN;
    let bytes = &payload[..payload.len().min(MAX_SHOWN)];
    let json = (content == ContentType::Json && !cut)
        .then(|| serde_json::from_slice::<Value>(bytes).ok())
        .flatten();
    match json {
        Some(v) => json!({"json": v, "bytes": payload.len()}),
        None => json!({
            "base64": base64::engine::general_purpose::STANDARD.encode(bytes),
            "bytes": payload.len(),
            "truncated": cut,
        }),
    }
}

impl Ops {
    /// The payload and options of task `id`; `{"gone": reason}` when its message is no
    /// longer stored.
    pub(crate) async fn payload(&self, id: &str) -> Result<Value, WireError> {
        if names::queue_of_task_id(id).is_none() {
            return Err(WireError::field("id", "not a task id"));
        }
        let (rec, _) = self
            .tasks
            .find(id)
            .await
            .map_err(|e| WireError::new(ErrorCode::Unavailable, e.to_string()))?
            .ok_or_else(|| WireError::new(ErrorCode::NotFound, format!("no task {id}")))?;
        let found = match (rec.state, rec.delayed_seq, rec.ready_seq) {
            (TaskState::Dead, _, _) => self.dead_letter(id).await.map(|m| ("dead letter", m)),
            (TaskState::Scheduled, Some(seq), _) => self
                .message(names::DELAYED_STREAM, seq)
                .await
                .map(|m| ("delayed", m)),
            (TaskState::Succeeded | TaskState::Cancelled, _, _) => {
                return Ok(json!({"id": id, "gone": format!(
                    "the task has finished ({}): its message was acked and is no longer stored", rec.state
                )}))
            }
            (_, _, Some(seq)) => self
                .message(&rec.priority.ready_stream(), seq)
                .await
                .map(|m| ("ready", m)),
            _ => return Ok(json!({"id": id, "gone": "the record names no stored message"})),
        };
        let (source, (headers, payload)) = match found {
            Ok(f) => f,
            Err(e) if matches!(e.code, ErrorCode::NotFound | ErrorCode::Conflict) => {
                return Ok(json!({"id": id, "gone": e.message}))
            }
            Err(e) => return Err(e),
        };
        let meta = TaskMeta::from_headers(&headers)
            .map_err(|e| WireError::new(ErrorCode::Unavailable, e.to_string()))?;
        Ok(json!({
            "id": id,
            "source": source,
            "options": options(&meta),
            "payload": shown(&payload, meta.content_type),
        }))
    }
}

impl Ops {
    /// The declared queues (those with a consumer on the normal ready stream), with or
    /// without tasks; empty if the broker cannot be asked.
    pub(crate) async fn declared(&self) -> Vec<String> {
        use futures::StreamExt;
        let normal = names::Priority::Normal;
        let Ok(stream) = self.js.get_stream(normal.ready_stream()).await else {
            return Vec::new();
        };
        let suffix = format!("_{normal}");
        let mut out = Vec::new();
        let mut consumers = stream.consumer_names();
        while let Some(Ok(name)) = consumers.next().await {
            if let Some(q) = name
                .strip_prefix("ax_")
                .and_then(|n| n.strip_suffix(&suffix))
            {
                if names::valid_queue(q) && names::consumer_name(q, normal) == name {
                    out.push(q.to_string());
                }
            }
        }
        out
    }
}
