//! Debounced submits: the window of a key is the last message of its delayed subject
//! (`ax_core::debounce`). A submit reads it and replaces it with a publish that expects
//! its sequence; a lost race (another submit, or the dispatcher closing the window) reads
//! again. Stored in `AX_DELAYED` before the answer, as every delayed task.

use crate::context::Context;
use async_nats::jetstream::stream::DirectGetErrorKind;
use async_nats::HeaderMap;
use ax_core::admit::{delete_delayed, publish_expecting, Expected};
use ax_core::debounce::{self, Debounce, Keep};
use ax_core::names::DELAYED_STREAM;
use ax_core::protocol::{ErrorCode, SubmitAccepted, WireError};
use ax_core::state::TaskState;
use ax_core::task::{header, TaskMeta};
use ax_core::time::now_ms;
use bytes::Bytes;
use tracing::debug;

/// Reads and conditional publishes one submit tries before it answers `unavailable`
/// (each lost race means another writer of the same key made progress).
const MAX_TRIES: usize = 64;

impl Context {
    /// Admits one debounced submit: joins the key's open window (the task runs `period`
    /// after this submit, by its `until` at the latest) or opens a new one.
    pub(crate) async fn submit_debounced(
        &self,
        meta: TaskMeta,
        payload: Bytes,
        d: Debounce,
    ) -> Result<SubmitAccepted, WireError> {
        let queue = meta.queue.clone();
        self.queues.check(&self.js, &queue).await?;
        let stream = self
            .js
            .get_stream_no_info(DELAYED_STREAM)
            .await
            .map_err(WireError::unavailable)?;
        let subject = d.subject(&queue);
        for tries in 0..MAX_TRIES {
            let last = match stream.direct_get_last_for_subject(subject.as_str()).await {
                Ok(msg) => Some(msg),
                Err(e) if e.kind() == DirectGetErrorKind::NotFound => None,
                Err(e) => return Err(WireError::unavailable(format!("{subject}: {e}"))),
            };
            let now = now_ms();
            let open = last.as_ref().filter(|m| debounce::is_open(&m.headers));
            let (headers, body, id, replaces) = match open {
                Some(window) => {
                    let id = window.headers.get(header::ID).map(|v| v.to_string());
                    let until = window
                        .headers
                        .get(debounce::UNTIL_MS)
                        .and_then(|v| v.as_str().parse::<u64>().ok());
                    let (Some(id), Some(until)) = (id, until) else {
                        return Err(WireError::unavailable(format!(
                            "{subject}: the open window's message has no task id or due bound"
                        )));
                    };
                    let due = d.due(now, until);
                    let (mut headers, body) = match d.keep {
                        Keep::First => (window.headers.clone(), window.payload.clone()),
                        Keep::Last => (
                            window_headers(&meta, &id, due, until, &d.key),
                            payload.clone(),
                        ),
                    };
                    headers.insert(header::RUN_AT_MS, due.to_string().as_str());
                    (headers, body, id, Some(window.sequence))
                }
                None => {
                    let id = d.window_id(&queue);
                    let until = d.until(now);
                    let h = window_headers(&meta, &id, d.due(now, until), until, &d.key);
                    (h, payload.clone(), id, None)
                }
            };
            let expect = last.as_ref().map_or(0, |m| m.sequence);
            match publish_expecting(&self.js, subject.clone(), headers, expect, body).await? {
                Expected::Stored(_) => {
                    if let Some(old) = replaces {
                        // A message left behind is dropped by the dispatcher when due (its
                        // close expects its sequence, which is no longer the last).
                        if let Err(e) = delete_delayed(&self.js, old).await {
                            debug!(seq = old, cause = %e, "replaced debounce window not deleted; dropped when due");
                        }
                    }
                    metrics::counter!(ax_core::metrics::DEBOUNCED, "joined" => if replaces.is_some() { "true" } else { "false" }).increment(1);
                    return Ok(SubmitAccepted {
                        id,
                        duplicate: false,
                        state: TaskState::Scheduled,
                    });
                }
                // Another writer of the key went first (or has a write in flight), or the
                // replica read lags the leader: read again (after a pause once it keeps
                // happening).
                Expected::MovedOn | Expected::InFlight if tries < 4 => continue,
                Expected::MovedOn | Expected::InFlight => {
                    tokio::time::sleep(std::time::Duration::from_millis(5 * tries as u64)).await
                }
            }
        }
        Err(WireError::new(
            ErrorCode::Unavailable,
            format!(
                "debounce key {} too contended to join its window; retry",
                d.key
            ),
        ))
    }
}

/// The headers of a window's message as submit `meta` describes its task: the window's
/// id, due at `due`, stored as its message alone (the claim writes its record), with the
/// window's latest due time and key.
pub(super) fn window_headers(
    meta: &TaskMeta,
    id: &str,
    due: u64,
    until: u64,
    key: &str,
) -> HeaderMap {
    let mut task = meta.clone();
    task.id = id.to_string();
    task.run_at_ms = Some(due);
    task.unrecorded = true;
    let mut headers = task.to_headers();
    headers.insert(debounce::UNTIL_MS, until.to_string().as_str());
    headers.insert(debounce::KEY, key);
    headers
}
