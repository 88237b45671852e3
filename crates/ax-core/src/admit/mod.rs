//! Admission written once, for the server and for a client that submits directly
//! (docs/PROTOCOL.md §2, "Direct submits"): which tasks are stored as their message alone,
//! the subject a task's message goes to, its publish (`Nats-Msg-Id` = the task id, a full
//! subject refused as `busy`), and the declared queues.

use crate::protocol::{ErrorCode, WireError};
use crate::task::TaskMeta;
use async_nats::jetstream::{self, context::PublishError};
use bytes::Bytes;

mod groups;
mod queues;
pub use groups::Groups;
pub use queues::Queues;

/// JetStream's error code for a publish refused by a stream or per-subject limit.
const JS_STORE_FAILED: u64 = 10077;

/// True if a publish was refused because the stream or subject is full (`discard: new`).
pub fn is_full(err: &PublishError) -> bool {
    std::error::Error::source(err)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .is_some_and(|e| e.error_code().0 == JS_STORE_FAILED)
}

/// A producer's task is stored as its message alone (header `Ax-Unrecorded`), unless it
/// is delayed and has an idempotency key: nothing needs its record before a worker claims
/// it. An immediate one is published once, under an id made for it, so no copy can start
/// beside its first attempt (one with a key may leave a copy under another id if its
/// submit loses the key; the claim retires that copy by the key); a delayed one is found
/// by its message's own subject while it waits, and its claim writes `running` before it
/// starts (the dispatcher may publish it twice: docs/PROTOCOL.md §3). Delayed tasks with
/// a key, trigger fires and flow steps keep the record made at submit: their duplicate
/// checks and engines read it.
pub fn unrecorded(mut meta: TaskMeta) -> TaskMeta {
    meta.unrecorded = meta.idempotency_key.is_none() || meta.run_at_ms.is_none();
    meta
}

/// The subject a task's message is stored under: its delayed subject in `AX_DELAYED` if
/// it has a due time, else its fair subject in `AX_FAIR` if it has a fair key, else its
/// queue's ready subject of its priority.
pub fn subject(meta: &TaskMeta) -> String {
    match (meta.run_at_ms, &meta.fair_key) {
        (Some(_), _) => crate::names::delayed_subject(&meta.queue, meta.priority, &meta.id),
        (None, Some(key)) => crate::names::fair_subject(&meta.queue, meta.priority, key, &meta.id),
        (None, None) => crate::names::ready_subject(&meta.queue, meta.priority),
    }
}

/// The stream a task's first message is stored in ([`subject`]).
pub fn stream(meta: &TaskMeta) -> String {
    match (meta.run_at_ms, &meta.fair_key) {
        (Some(_), _) => crate::names::DELAYED_STREAM.to_string(),
        (None, Some(_)) => crate::names::FAIR_STREAM.to_string(),
        (None, None) => meta.priority.ready_stream(),
    }
}

/// The headers a task's message is first stored with. An immediate task's carry
/// `Nats-Msg-Id` = its id (a re-publish within the ready stream's duplicate window is
/// stored once). A delayed task's carry `Nats-Expected-Last-Subject-Sequence: 0` instead:
/// its subject is its own, so "store it only if that subject is empty" de-duplicates a
/// re-publish for as long as the task waits, and the stream keeps no id for it (a
/// duplicate window of a million delayed tasks' ids cost nats-server ~115 MiB;
/// docs/PERFORMANCE.md, W4).
pub fn first_headers(meta: &TaskMeta) -> async_nats::HeaderMap {
    let mut headers = meta.to_headers();
    match meta.run_at_ms {
        Some(_) => headers.insert(EXPECTED_EMPTY, "0"),
        None => headers.insert("Nats-Msg-Id", meta.id.as_str()),
    }
    headers
}

/// The header of a conditional publish: stored only if the subject's last message has
/// this sequence (`0`: create-if-absent).
pub const EXPECTED_LAST: &str = "Nats-Expected-Last-Subject-Sequence";
const EXPECTED_EMPTY: &str = EXPECTED_LAST;

/// JetStream's error code for a publish whose `Nats-Expected-Last-Subject-Sequence` did
/// not hold.
const JS_WRONG_LAST_SEQUENCE: u64 = 10071;
/// "wrong last sequence" of a replicated stream with a write to the subject in flight.
const JS_WRONG_LAST_SEQUENCE_IN_FLIGHT: u64 = 10164;

/// True if a create-if-absent publish found its subject holding a message already: for a
/// task's own delayed subject, the task was stored (by an earlier publish of the same
/// message whose answer was lost).
pub fn is_stored_already(err: &PublishError) -> bool {
    std::error::Error::source(err)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .is_some_and(|e| e.error_code().0 == JS_WRONG_LAST_SEQUENCE)
}

/// The sequence of the message a delayed task's subject holds: what a create-if-absent
/// publish that found it stored answers.
pub async fn stored_delayed_seq(js: &jetstream::Context, subject: &str) -> Result<u64, WireError> {
    Ok(last_delayed(js, subject).await?.sequence)
}

/// The last message of `subject` in `AX_DELAYED`, by a direct get: what a producer may be
/// allowed for its own queues' subjects alone
/// (`$JS.API.DIRECT.GET.AX_DELAYED.ax.delayed.<queue>.>`). It may come from a replica
/// that is behind.
async fn last_delayed(
    js: &jetstream::Context,
    subject: &str,
) -> Result<async_nats::jetstream::message::StreamMessage, WireError> {
    let stream = js
        .get_stream_no_info(crate::names::DELAYED_STREAM)
        .await
        .map_err(WireError::unavailable)?;
    stream
        .direct_get_last_for_subject(subject)
        .await
        .map_err(|e| WireError::new(ErrorCode::Unavailable, format!("{subject}: {e}")))
}

/// Stores a task's first message (headers: [`first_headers`]), mapping a full subject to
/// `busy`; answers its stream sequence. A delayed task found stored already answers the
/// sequence it is stored under.
pub async fn publish_task(
    js: &jetstream::Context,
    subject: String,
    meta: &TaskMeta,
    payload: Bytes,
) -> Result<u64, WireError> {
    let publish = jetstream::message::PublishMessage::build()
        .headers(first_headers(meta))
        .payload(payload);
    let ack = send_again(js, &subject, publish).await;
    match ack {
        Ok(ack) => Ok(ack.sequence),
        Err(e) if meta.run_at_ms.is_some() && is_stored_already(&e) => {
            stored_delayed_seq(js, &subject).await
        }
        Err(e) => Err(refusal(&subject, &e)),
    }
}

/// Publishes task headers as they are (plus `Nats-Msg-Id` = `id`), mapping a full subject
/// to `busy`: the delayed-task dispatcher forwards a stored message this way without
/// decoding and re-encoding all its headers.
pub async fn publish_headers(
    js: &jetstream::Context,
    subject: String,
    headers: async_nats::HeaderMap,
    id: &str,
    payload: Bytes,
) -> Result<jetstream::publish::PublishAck, WireError> {
    // A stored message copied (a retry, a run-now, a due delayed task) may carry the
    // headers of the atomic batch that stored it: not this publish's.
    let mut headers = crate::atomic::without_publish_headers(headers);
    headers.insert("Nats-Msg-Id", id);
    let publish = jetstream::message::PublishMessage::build()
        .headers(headers)
        .payload(payload);
    let ack = send_again(js, &subject, publish).await;
    ack.map_err(|e| refusal(&subject, &e))
}

/// Sends a publish and waits for its JetStream acknowledgement.
async fn send(
    js: &jetstream::Context,
    subject: &str,
    publish: jetstream::message::PublishMessage,
) -> Result<jetstream::publish::PublishAck, PublishError> {
    match js.send_publish(subject.to_string(), publish).await {
        Ok(future) => future.await,
        Err(e) => Err(e),
    }
}

/// [`send`] of a publish the stream stores once however often it is sent (a message id,
/// or an expected-empty subject): sent again if the client connects anew while it waits.
/// A publish the broker had when it stopped is never acknowledged, and would hold its
/// caller for the whole acknowledgement timeout (a trigger's fire, 5 s).
async fn send_again(
    js: &jetstream::Context,
    subject: &str,
    publish: jetstream::message::PublishMessage,
) -> Result<jetstream::publish::PublishAck, PublishError> {
    let client = js.client();
    crate::follow::across_reconnects(&client, || send(js, subject, publish.clone())).await
}

/// A publish that failed: `busy` if the subject is full, else `unavailable`.
pub fn refusal(subject: &str, e: &PublishError) -> WireError {
    if is_full(e) {
        WireError::new(
            ErrorCode::Busy,
            format!(
                "{subject} is at capacity; retry later, or raise the queue's capacity: \
                 `ax streams apply --capacity high,normal,low` (the capacities a new queue \
                 gets: `ax server --capacity`)"
            ),
        )
    } else {
        WireError::new(ErrorCode::Unavailable, format!("{subject}: {e}"))
    }
}

/// What a [`publish_expecting`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expected {
    /// Stored under this stream sequence.
    Stored(u64),
    /// The subject's last message is not the one expected (JetStream 10071): it moved on.
    MovedOn,
    /// A replicated stream had another write to the subject in flight (JetStream 10164,
    /// no sequence given): that write may yet land or fail, so the subject has not surely
    /// moved on. A writer that appends reads again and retries; a close retries later.
    InFlight,
}

/// Publishes `headers` and `payload` to `subject` of `AX_DELAYED` only if the subject's
/// last message has sequence `expect` (0: none): what it found ([`Expected`]), or the
/// refusal.
///
/// The message carries an id of this write (`Ax-Write`) and is sent again, the same, if
/// the client connects anew while it waits: a write the broker stored but never answered
/// would otherwise hold its caller for the acknowledgement timeout. Sent again, such a
/// write finds the subject moved on (the stream checks the expectation before any message
/// id): it is taken as stored if the subject's last message carries its id, and is
/// `unavailable` (unknown) if another writer wrote after it — that writer may have carried
/// its items on, so its caller must not apply it again.
pub async fn publish_expecting(
    js: &jetstream::Context,
    subject: String,
    mut headers: async_nats::HeaderMap,
    expect: u64,
    payload: Bytes,
) -> Result<Expected, WireError> {
    headers = crate::atomic::without_publish_headers(headers);
    headers.insert(EXPECTED_LAST, expect.to_string().as_str());
    let write = nuid::next().to_string();
    headers.insert(crate::debounce::WRITE, write.as_str());
    let publish = jetstream::message::PublishMessage::build()
        .headers(headers)
        .payload(payload);
    let mut sends = 0u32;
    let client = js.client();
    let ack = crate::follow::across_reconnects(&client, || {
        sends += 1;
        send(js, &subject, publish.clone())
    })
    .await;
    match ack {
        Ok(ack) => Ok(Expected::Stored(ack.sequence)),
        Err(e) if is_stored_already(&e) && sends > 1 => own_write(js, &subject, &write).await,
        Err(e) if is_stored_already(&e) => Ok(Expected::MovedOn),
        Err(e) if js_error_code(&e) == Some(JS_WRONG_LAST_SEQUENCE_IN_FLIGHT) => {
            Ok(Expected::InFlight)
        }
        Err(e) => Err(refusal(&subject, &e)),
    }
}

/// What a write sent again after a reconnect, refused as moved on, was: stored, if the
/// subject's last message carries its id; else unknown (also when the read came from a
/// replica that is behind: never taken as stored wrongly).
async fn own_write(
    js: &jetstream::Context,
    subject: &str,
    write: &str,
) -> Result<Expected, WireError> {
    let unknown = |why: &str| {
        WireError::unavailable(format!(
            "{subject}: a write sent again after a reconnect found the subject moved on, \
             and whether its first sending was stored is unknown ({why})"
        ))
    };
    let last = last_delayed(js, subject)
        .await
        .map_err(|e| unknown(&e.message))?;
    match last.headers.get(crate::debounce::WRITE) {
        Some(id) if id.as_str() == write => Ok(Expected::Stored(last.sequence)),
        _ => Err(unknown("another write is the subject's last")),
    }
}

/// The JetStream error code of a refused publish, if it carries one.
fn js_error_code(err: &PublishError) -> Option<u64> {
    std::error::Error::source(err)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .map(|e| e.error_code().0)
}

/// Deletes message `seq` of `stream` without the secure erase (overwriting the stored
/// bytes) that `Stream::delete_message` asks for: what it held lives on elsewhere (a
/// dispatched delayed task, a replaced debounce window, a cancelled task's message).
pub async fn delete_message(js: &jetstream::Context, stream: &str, seq: u64) -> Result<(), String> {
    let request = serde_json::json!({ "seq": seq, "no_erase": true });
    let deleted: Result<serde_json::Value, _> = js
        .request(format!("STREAM.MSG.DELETE.{stream}"), &request)
        .await;
    deleted.map(|_| ()).map_err(|e| e.to_string())
}

/// [`delete_message`] of `AX_DELAYED`.
pub async fn delete_delayed(js: &jetstream::Context, seq: u64) -> Result<(), String> {
    delete_message(js, crate::names::DELAYED_STREAM, seq).await
}
