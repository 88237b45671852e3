//! After the handler: the attempt's log line, failures and dead letters.

use crate::metrics as m;
use crate::names;
use crate::state::{ErrorInfo, TaskRecord};
use crate::task::{header, TaskMeta};
use crate::time::now_ms;
use crate::worker::error::TaskError;
use crate::worker::inflight::Held;
use crate::worker::settle::{settle, After, End};
use async_nats::jetstream::{self, AckKind};
use tracing::{debug, error, info, warn};

use super::end::AttemptEnd;
use super::shared::*;

/// The trace id of a W3C `traceparent` (its second field).
pub(super) fn trace_id(traceparent: &str) -> &str {
    traceparent.split('-').nth(1).unwrap_or("")
}

/// One log line per finished attempt (target `ax_sdk::attempt`, in the task's span): outcome,
/// error class, duration, input and output sizes.
pub(super) fn log_attempt(
    span: &tracing::Span,
    end: &AttemptEnd,
    took: std::time::Duration,
    input_bytes: usize,
) {
    let (result, class, output_bytes) = end.log_fields();
    info!(target: "ax_sdk::attempt", parent: span, outcome = result, class,
        duration_ms = took.as_millis() as u64, input_bytes, output_bytes, "attempt finished");
}

/// Counts a failed attempt of a task name in a row, or ends the run of failures with a
/// success: the gauge `ax_task_consecutive_failures{queue, task}` of this worker.
pub(super) fn streak(sh: &Shared, task_label: &str, failed: bool) {
    let n = {
        let mut streaks = sh.streaks.lock().expect("not poisoned");
        match (failed, streaks.get_mut(task_label)) {
            (true, Some(n)) => {
                *n += 1;
                *n
            }
            (true, None) => {
                streaks.insert(task_label.to_string(), 1);
                1
            }
            (false, Some(n)) if *n > 0 => {
                *n = 0;
                0
            }
            (false, _) => return,
        }
    };
    metrics::gauge!(m::CONSECUTIVE_FAILURES, "queue" => sh.queue.clone(), "task" => task_label.to_string())
        .set(n as f64);
}

/// Stores a large output in `AX_RESULTS`, retrying like [`write`]; false if the delivery
/// was lost meanwhile (it will be redelivered).
pub(super) async fn put_output(
    sh: &Shared,
    id: &str,
    key: &str,
    bytes: bytes::Bytes,
    held: &Held,
) -> bool {
    let put = || sh.results.put(key, bytes.clone());
    while_held(sh, held, id, "output write", put, |_| true)
        .await
        .is_ok()
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn fail(
    sh: &Shared,
    meta: &TaskMeta,
    msg: &jetstream::Message,
    rec: TaskRecord,
    token: u64,
    e: TaskError,
    timed_out: bool,
    held: &Held,
) {
    let queue = sh.queue.clone();
    let task_label = sh.labels.task(&meta.name);
    metrics::counter!(m::FAILED, "queue" => queue.clone(), "task" => task_label.clone(), "class" => sh.labels.class(&e.class))
        .increment(1);
    metrics::gauge!(m::TASK_TIMEOUT_RATE, "queue" => queue.clone()).set(sh.rate.record(timed_out));
    streak(sh, &task_label, true);
    let error = ErrorInfo {
        detail: e
            .detail
            .as_deref()
            .map(|d| truncate(d, MAX_DETAIL).to_string()),
        class: e.class.clone(),
        message: e.message.clone(),
    };
    // A class an adaptive limit listens to lowers its rate (shared by every worker).
    tokio::spawn({
        let (gate, meta, class) = (sh.gate.clone(), meta.clone(), e.class.clone());
        let started = rec.started_at_ms.unwrap_or(0);
        async move { gate.pressure(&meta, &class, started).await }
    });
    let delay = meta.backoff.delay(rec.attempt);
    let end = End::Failed {
        error: error.clone(),
        permanent: e.permanent,
    };
    let (record, after) = settle(meta, rec, end, now_ms(), delay);
    if !write(sh, &record, token, held).await {
        return;
    }
    if after == After::DeadLetter {
        dead_written(sh, meta, &record, &error);
        publish_dead_letter_and_term(sh, meta, msg, &record, &error).await;
    } else {
        metrics::counter!(m::RETRIED, "queue" => queue, "task" => task_label).increment(1);
        debug!(task_id = %meta.id, attempt = record.attempt, ?delay, "retry scheduled");
        reply(msg, ack_kind(after)).await;
    }
}

/// The broker's answer for a settled attempt that is not a dead letter.
pub(super) fn ack_kind(after: After) -> AckKind {
    match after {
        After::Nak(delay) => AckKind::Nak(delay),
        After::Ack | After::DeadLetter => AckKind::Ack,
    }
}

pub(super) fn dead_written(sh: &Shared, meta: &TaskMeta, dead: &TaskRecord, error: &ErrorInfo) {
    metrics::counter!(m::DEAD, "queue" => sh.queue.clone(), "task" => sh.labels.task(&meta.name))
        .increment(1);
    error!(task_id = %meta.id, queue = %meta.queue, class = %error.class,
        cause = %error.message, attempts = dead.attempt, "task dead");
}

/// Publishes the dead letter (idempotent by message id), then terminates the delivery.
pub(super) async fn publish_dead_letter_and_term(
    sh: &Shared,
    meta: &TaskMeta,
    msg: &jetstream::Message,
    rec: &TaskRecord,
    error: &ErrorInfo,
) {
    let mut headers = meta.to_headers();
    // One dead letter per death: a redelivery of the same message repeats the id, a task
    // retried after it died dies again under a new one (its retry is a new message).
    let seq = msg.info().map_or(0, |i| i.stream_sequence);
    headers.insert("Nats-Msg-Id", format!("{}.{seq}", meta.id).as_str());
    let class = match header_safe(&error.class) {
        c if c.is_empty() => "unknown".to_string(),
        c => c,
    };
    headers.insert(header::ERROR_CLASS, class.as_str());
    headers.insert(header::ERROR_MESSAGE, header_safe(&error.message).as_str());
    headers.insert(header::ATTEMPTS, rec.attempt.to_string().as_str());
    dead_letter_and_term(sh, names::task_dead_subject(&meta.id), msg, headers).await;
}

/// A message on a ready subject that is not a task ax can read: dead-letter it as is.
pub(super) async fn reject_malformed(sh: &Shared, msg: &jetstream::Message, why: &str) {
    error!(subject = %msg.subject, cause = why, "malformed task message; dead-lettered");
    let headers = msg.headers.clone().unwrap_or_default();
    let mut headers = crate::atomic::without_publish_headers(headers);
    headers.insert(header::ERROR_CLASS, "bad_message");
    headers.insert(header::ERROR_MESSAGE, header_safe(why).as_str());
    dead_letter_and_term(sh, names::dead_subject(&sh.queue), msg, headers).await;
}

/// Stores the delivery's payload in `AX_DEAD` with `headers`, then Terms the delivery; if
/// the dead letter is not acknowledged, naks it instead so a redelivery tries again.
pub(super) async fn dead_letter_and_term(
    sh: &Shared,
    subject: String,
    msg: &jetstream::Message,
    headers: async_nats::HeaderMap,
) {
    let publish = |subject: String, headers| async {
        let publish = jetstream::message::PublishMessage::build()
            .headers(headers)
            .payload(msg.payload.clone());
        match sh.js.send_publish(subject, publish).await {
            Ok(ack) => ack.await.map(|_| ()),
            Err(e) => Err(e),
        }
    };
    let mut sent = publish(subject.clone(), headers.clone()).await;
    if let Err(e) = &sent {
        // An `AX_DEAD` made before dead letters were per task (subjects `ax.dead.*`) does
        // not take `ax.dead.<task id>`: store it under the queue's subject, as then.
        let queue_subject = names::dead_subject(
            names::queue_of_task_id(subject.strip_prefix("ax.dead.").unwrap_or_default())
                .unwrap_or(&sh.queue),
        );
        if e.kind() == jetstream::context::PublishErrorKind::StreamNotFound
            && queue_subject != subject
        {
            sent = publish(queue_subject, headers).await;
        }
    }
    match sent {
        Ok(()) => reply(msg, AckKind::Term).await,
        Err(e) => {
            warn!(subject = %msg.subject, cause = %e, "dead letter not stored; will retry on redelivery");
            reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
        }
    }
}

/// Most bytes of an error's detail kept in the record.
pub(super) const MAX_DETAIL: usize = 8 * 1024;

/// `s` cut to at most `max` bytes, at a character boundary.
pub(super) fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
