//! Finding a task that has no record yet.
//!
//! A task submitted without an idempotency key stores one message and no record (header
//! `Ax-Unrecorded`): the worker that claims it writes the first record. Until then the
//! message is the task, and this module finds it. While it is delayed, its message has a
//! subject of its own: one direct get ([`find_delayed`]). Once due (or if it never was
//! delayed) it waits on a ready subject shared by its queue: its queue is in its id, so it walks
//! that queue's three ready subjects (direct gets, `next_by_subj`, high priority first)
//! until a message carries the id. A task with a fair key waits first in `AX_FAIR`, under
//! a subject that ends with its id ([`find_fair`]). A pending task waits in a bounded ready subject, so the
//! walk reads at most the queue's capacity (1,000 + 5,000 + 10,000 messages by default).
//! docs/PROTOCOL.md §3, "Unrecorded tasks".

use crate::names::{self, Priority};
use crate::state::{StateError, TaskRecord};
use crate::task::{header, TaskMeta};
use async_nats::jetstream::{self, stream::DirectGetErrorKind};

/// A broker failure of the lookup `op` of task `id`.
fn broker<'a>(id: &'a str, op: &'static str) -> impl Fn(async_nats::Error) -> StateError + 'a {
    move |source| StateError::Broker {
        id: id.to_string(),
        op,
        source,
    }
}

/// The ready message of task `id` if one is stored: its metadata and stream sequence.
/// `Ok(None)` if no ready subject of its queue holds it (or `id` is not a task id).
pub async fn find_ready(
    js: &jetstream::Context,
    id: &str,
) -> Result<Option<(TaskMeta, u64)>, StateError> {
    let Some(queue) = names::queue_of_task_id(id) else {
        return Ok(None);
    };
    let broker = broker(id, "find ready message");
    for priority in Priority::ALL {
        let stream = match js.get_stream_no_info(priority.ready_stream()).await {
            Ok(stream) => stream,
            Err(e) => return Err(broker(e.into())),
        };
        let subject = names::ready_subject(queue, priority);
        if let Some(found) = next_carrying(&stream, &subject, 1, id)
            .await
            .map_err(&broker)?
        {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

/// The delayed message of task `id` if one is stored under its own subject
/// (`ax.delayed.<queue>.<priority>.<partition>.<id>`): its metadata and `AX_DELAYED`
/// sequence. One direct get per priority, high first. `Ok(None)` if none holds it (or `id`
/// is not a task id).
pub async fn find_delayed(
    js: &jetstream::Context,
    id: &str,
) -> Result<Option<(TaskMeta, u64)>, StateError> {
    let Some(queue) = names::queue_of_task_id(id) else {
        return Ok(None);
    };
    let broker = broker(id, "find delayed message");
    let stream = match js.get_stream_no_info(names::DELAYED_STREAM).await {
        Ok(stream) => stream,
        Err(e) => return Err(broker(e.into())),
    };
    if let Some(window) = crate::debounce::window_subject_of(id) {
        return find_in_window(&stream, window, id).await.map_err(broker);
    }
    for priority in Priority::ALL {
        let subject = names::delayed_subject(queue, priority, id);
        let msg = match stream.direct_get_last_for_subject(subject).await {
            Ok(msg) => msg,
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => continue,
            Err(e) => return Err(broker(e.into())),
        };
        if msg.headers.get(header::ID).map(|v| v.as_str()) != Some(id) {
            continue;
        }
        if let Ok(meta) = TaskMeta::from_headers(&msg.headers) {
            return Ok(Some((meta, msg.sequence)));
        }
    }
    Ok(None)
}

/// The held message of task `id` if it waits in `AX_FAIR` for its fair share (subject
/// `ax.fair.<queue>.<priority>.<hex fair key>.<id>`): its metadata and `AX_FAIR` sequence.
/// One direct get with a wildcard filter (`ax.fair.<queue>.*.*.<id>`): the tenant and the
/// priority are not in the id. `Ok(None)` if none holds it.
pub async fn find_fair(
    js: &jetstream::Context,
    id: &str,
) -> Result<Option<(TaskMeta, u64)>, StateError> {
    let Some(queue) = names::queue_of_task_id(id) else {
        return Ok(None);
    };
    let broker = broker(id, "find held fair message");
    let stream = match js.get_stream_no_info(names::FAIR_STREAM).await {
        Ok(stream) => stream,
        Err(e) => return Err(broker(e.into())),
    };
    let filter = format!("ax.fair.{queue}.*.*.{id}");
    next_carrying(&stream, &filter, 1, id).await.map_err(broker)
}

/// A debounced task's message on its key's window subject: the last of the few messages
/// there (the open window, a closed one not yet dispatched, a replaced one not yet
/// deleted) that carries `id`.
async fn find_in_window(
    stream: &jetstream::stream::Stream<()>,
    subject: String,
    id: &str,
) -> Result<Option<(TaskMeta, u64)>, async_nats::Error> {
    let mut found = None;
    let mut from = 1;
    while let Some((meta, seq)) = next_carrying(stream, &subject, from, id).await? {
        from = seq + 1;
        found = Some((meta, seq));
    }
    Ok(found)
}

/// The first message of `subject` from sequence `from` on that carries task `id` and a
/// readable task (direct gets, `next_by_subj`), with its sequence.
async fn next_carrying(
    stream: &jetstream::stream::Stream<()>,
    subject: &str,
    mut from: u64,
    id: &str,
) -> Result<Option<(TaskMeta, u64)>, async_nats::Error> {
    loop {
        let msg = match stream
            .direct_get_next_for_subject(subject.to_string(), Some(from))
            .await
        {
            Ok(msg) => msg,
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        from = msg.sequence + 1;
        if msg.headers.get(header::ID).map(|v| v.as_str()) != Some(id) {
            continue;
        }
        // A message that carries the id but not a readable task is not one.
        if let Ok(meta) = TaskMeta::from_headers(&msg.headers) {
            return Ok(Some((meta, msg.sequence)));
        }
    }
}

/// The record a delayed task that has no record yet would have: `scheduled`, naming its
/// delayed message.
pub fn scheduled_record(meta: &TaskMeta, seq: u64) -> TaskRecord {
    let mut rec = meta.record();
    rec.delayed_seq = Some(seq);
    rec
}

/// The record a task that has no record yet would have: `pending`, naming its message.
pub fn pending_record(meta: &TaskMeta, seq: u64) -> TaskRecord {
    let mut rec = meta.record();
    rec.ready_seq = Some(seq);
    rec
}
