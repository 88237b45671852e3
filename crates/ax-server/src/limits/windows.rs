//! `ax.limit.windows`: the debounce windows and batches that wait now (docs/PROTOCOL.md
//! §7, "Windows"). Each is the last message of its key's delayed subject
//! (`ax.delayed.<queue>.normal.<partition>.<queue>.=d|=b.<hex key>`): the stream's subject
//! counts find the subjects, and a direct get of each subject's last message says what
//! waits there.

use async_nats::jetstream::stream::DirectGetErrorKind;
use ax_core::names::DELAYED_STREAM;
use ax_core::protocol::WireError;
use ax_core::task::header;
use ax_core::{batching, debounce};
use futures::StreamExt;
use serde_json::{json, Value};

/// Most windows one answer lists (the subject counts beyond are counted, not listed).
pub(crate) const MAX_LISTED: usize = 1000;

/// The waiting windows of `queue` (or of every queue): `{"windows": [...], "more": n}`,
/// each `{"queue", "kind" (debounce | batch), "key", "id", "due_ms", "items"?, "closed"}`.
pub(crate) async fn list(
    js: &async_nats::jetstream::Context,
    queue: Option<&str>,
) -> Result<Value, WireError> {
    let stream = js
        .get_stream_no_info(DELAYED_STREAM)
        .await
        .map_err(WireError::unavailable)?;
    let q = queue.unwrap_or("*");
    let mut windows = Vec::new();
    let mut more = 0usize;
    for (mark, kind) in [("=d", "debounce"), ("=b", "batch")] {
        let filter = format!("ax.delayed.{q}.normal.*.*.{mark}.*");
        let mut subjects = stream
            .info_with_subjects(&filter)
            .await
            .map_err(WireError::unavailable)?;
        let mut found = Vec::new();
        while let Some(s) = subjects.next().await {
            let (subject, _) = s.map_err(WireError::unavailable)?;
            match found.len() + windows.len() < MAX_LISTED {
                true => found.push(subject),
                false => more += 1,
            }
        }
        found.sort();
        for subject in found {
            let msg = match stream.direct_get_last_for_subject(subject.as_str()).await {
                Ok(msg) => msg,
                Err(e) if e.kind() == DirectGetErrorKind::NotFound => continue,
                Err(e) => return Err(WireError::unavailable(e)),
            };
            let h = &msg.headers;
            let text = |name: &str| h.get(name).map(|v| v.as_str().to_string());
            let number = |name: &str| text(name).and_then(|v| v.parse::<u64>().ok());
            let mut w = json!({
                "queue": subject.split('.').nth(2).unwrap_or_default(),
                "kind": kind,
                "key": text(debounce::KEY),
                "id": text(header::ID),
                "due_ms": number(header::RUN_AT_MS),
                "closed": h.get(debounce::FIRED).is_some(),
            });
            if let Some(items) = number(batching::COUNT) {
                w["items"] = json!(items);
            }
            windows.push(w);
        }
    }
    Ok(json!({"windows": windows, "more": more}))
}
