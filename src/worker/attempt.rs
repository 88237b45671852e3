//! One delivery of a task: claim the attempt, run the handler, record the outcome, ack.
//!
//! Every state write is a compare-and-set on the record revision this delivery read or
//! wrote, so a delivery that was overtaken (its worker paused past the ack wait and the
//! task went to another worker) has its result refused and does not ack.

use super::rate::TimeoutRate;
use super::{is_json, Handler, Task, TaskError};
use crate::metrics as m;
use crate::names;
use crate::state::{ErrorInfo, StateError, TaskRecord, TaskState, TaskStore};
use crate::task::{header, now_ms, TaskMeta};
use async_nats::jetstream::{self, AckKind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, warn};

/// State shared by all attempts of one worker.
pub(crate) struct Shared {
    pub(crate) js: jetstream::Context,
    pub(crate) tasks: TaskStore,
    pub(crate) queue: String,
    pub(crate) worker_id: String,
    pub(crate) handler: Handler,
    pub(crate) slots: Arc<Semaphore>,
    pub(crate) concurrency: usize,
    /// Handlers running now (slots held by the fetcher for a pull are not busy).
    pub(crate) running: AtomicUsize,
    pub(crate) heartbeat: Duration,
    pub(crate) shutdown: CancellationToken,
    pub(crate) hard_stop: CancellationToken,
    pub(crate) rate: TimeoutRate,
    pub(crate) tracker: TaskTracker,
}

/// Retry pause when the broker cannot be reached for a state read or write.
const BROKER_RETRY: Duration = Duration::from_secs(1);

/// Runs one delivery in the worker's tracker; `permit` is its handler slot if already taken.
pub(crate) fn spawn(
    shared: &Arc<Shared>,
    msg: jetstream::Message,
    permit: Option<OwnedSemaphorePermit>,
) {
    let sh = shared.clone();
    shared.tracker.spawn(async move {
        tokio::select! {
            _ = heartbeat(&msg, sh.heartbeat) => {}
            _ = process(&sh, &msg, permit) => {}
        }
    });
}

/// Sends `+WPI` (AckProgress) every `every` for as long as the delivery is held.
async fn heartbeat(msg: &jetstream::Message, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        if let Err(e) = msg.ack_with(AckKind::Progress).await {
            debug!(cause = %e, "heartbeat failed");
        }
    }
}

async fn reply(msg: &jetstream::Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        warn!(cause = %e, ?kind, "could not answer the delivery; it will be redelivered");
    }
}

fn busy_gauge(sh: &Shared, change: isize) {
    let busy = if change > 0 {
        sh.running.fetch_add(1, Ordering::Relaxed) + 1
    } else {
        sh.running.fetch_sub(1, Ordering::Relaxed) - 1
    };
    metrics::gauge!(m::WORKER_BUSY_RATE, "queue" => sh.queue.clone())
        .set(busy as f64 / sh.concurrency as f64);
}

/// Header values may not hold line breaks; keep error text readable and bounded.
fn header_safe(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(1024)
        .collect()
}

enum Claim {
    Started(Box<TaskRecord>, u64),
    Again,
    Done,
}

async fn process(sh: &Shared, msg: &jetstream::Message, permit: Option<OwnedSemaphorePermit>) {
    let meta = match msg.headers.as_ref().map(TaskMeta::from_headers) {
        Some(Ok(meta)) => meta,
        Some(Err(e)) => return reject_malformed(sh, msg, &e.to_string()).await,
        None => return reject_malformed(sh, msg, "no headers").await,
    };
    let _permit = match permit {
        Some(p) => p,
        None => tokio::select! {
            p = sh.slots.clone().acquire_owned() => p.expect("never closed"),
            _ = sh.shutdown.cancelled() => return reply(msg, AckKind::Nak(None)).await,
        },
    };
    if sh.shutdown.is_cancelled() {
        // Fetched but not started: hand it back untouched (no attempt is counted).
        return reply(msg, AckKind::Nak(None)).await;
    }
    for _ in 0..3 {
        match claim(sh, &meta, msg).await {
            Claim::Started(rec, token) => return run(sh, &meta, msg, *rec, token).await,
            Claim::Again => continue,
            Claim::Done => return,
        }
    }
    reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
}

/// Moves the record to `running` for a new attempt; the new revision is the fencing token.
async fn claim(sh: &Shared, meta: &TaskMeta, msg: &jetstream::Message) -> Claim {
    let seq = msg.info().map_or(0, |i| i.stream_sequence);
    let (mut rec, rev) = match sh.tasks.get(&meta.id).await {
        Ok(Some(found)) => found,
        Ok(None) => {
            // Accepted, but the submitter died before writing the record: write it now.
            let rec = TaskRecord::new(meta).transition(TaskState::Pending);
            match sh.tasks.create(&rec).await {
                Ok(rev) => (rec, rev),
                Err(StateError::Exists(_)) => return Claim::Again,
                Err(e) => {
                    warn!(task_id = %meta.id, cause = %e, "cannot create record");
                    reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
                    return Claim::Done;
                }
            }
        }
        Err(e) => {
            warn!(task_id = %meta.id, cause = %e, "cannot read record");
            reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
            return Claim::Done;
        }
    };
    match rec.state {
        TaskState::Succeeded => {
            // A duplicate delivery of a finished task (e.g. its ack was lost).
            reply(msg, AckKind::Ack).await;
            return Claim::Done;
        }
        TaskState::Dead => {
            // Dead was written but the dead letter or the Term may be missing.
            let error = rec.last_error.clone().unwrap_or(ErrorInfo {
                class: "dead".into(),
                message: String::new(),
            });
            publish_dead_letter_and_term(sh, meta, msg, &rec, &error).await;
            return Claim::Done;
        }
        TaskState::Running if rec.ready_seq.is_some() && rec.ready_seq != Some(seq) => {
            // Another message of the same task holds the running attempt: this one is a
            // duplicate published after the dedup window (e.g. a dispatcher restarted
            // late). Retire it without running the task twice at once.
            warn!(task_id = %meta.id, seq, "duplicate task message retired");
            reply(msg, AckKind::Term).await;
            return Claim::Done;
        }
        TaskState::Running => {
            // The attempt before this delivery stopped heartbeating (crash, pause, network).
            metrics::counter!(m::TIMEOUTS, "queue" => sh.queue.clone(), "kind" => "heartbeat")
                .increment(1);
            metrics::gauge!(m::TASK_TIMEOUT_RATE, "queue" => sh.queue.clone())
                .set(sh.rate.record(true));
            rec.last_error = Some(ErrorInfo {
                class: "heartbeat_timeout".into(),
                message: format!(
                    "attempt {} on worker {} stopped heartbeating",
                    rec.attempt,
                    rec.worker.as_deref().unwrap_or("?")
                ),
            });
        }
        _ => {}
    }
    if rec.attempt >= meta.max_attempts {
        let error = rec.last_error.clone().unwrap_or(ErrorInfo {
            class: "attempts_exhausted".into(),
            message: format!("{} attempts made", rec.attempt),
        });
        finish_dead(sh, meta, msg, rec, rev, error).await;
        return Claim::Done;
    }
    rec.attempt += 1;
    rec.started_at_ms = Some(now_ms());
    rec.worker = Some(sh.worker_id.clone());
    rec.ready_seq = Some(seq);
    let rec = rec.transition(TaskState::Running);
    match sh.tasks.cas(&rec, rev).await {
        Ok(token) => Claim::Started(Box::new(rec), token),
        Err(StateError::Stale { .. }) => Claim::Again,
        Err(e) => {
            warn!(task_id = %meta.id, cause = %e, "cannot claim attempt");
            reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
            Claim::Done
        }
    }
}

async fn run(sh: &Shared, meta: &TaskMeta, msg: &jetstream::Message, rec: TaskRecord, token: u64) {
    let queue = sh.queue.clone();
    if rec.attempt == 1 {
        let ready_at = meta.run_at_ms.unwrap_or(meta.created_at_ms);
        metrics::histogram!(m::QUEUE_WAIT, "queue" => queue.clone())
            .record(now_ms().saturating_sub(ready_at) as f64 / 1000.0);
    }
    busy_gauge(sh, 1);
    let task = Task {
        id: meta.id.clone(),
        name: meta.name.clone(),
        queue: meta.queue.clone(),
        priority: meta.priority,
        payload: msg.payload.clone(),
        is_json: is_json(meta.content_type),
        attempt: rec.attempt,
        max_attempts: meta.max_attempts,
        fencing_token: token,
        idempotency_key: meta.idempotency_key.clone(),
        created_at_ms: meta.created_at_ms,
        run_at_ms: meta.run_at_ms,
    };
    let started = Instant::now();
    let outcome = tokio::select! {
        r = tokio::time::timeout(meta.timeout, (sh.handler)(task)) => Some(r),
        _ = sh.hard_stop.cancelled() => None,
    };
    metrics::histogram!(m::RUN_DURATION, "queue" => queue.clone(), "task" => meta.name.clone())
        .record(started.elapsed().as_secs_f64());
    match outcome {
        Some(Ok(Ok(()))) => {
            metrics::gauge!(m::TASK_TIMEOUT_RATE, "queue" => queue.clone())
                .set(sh.rate.record(false));
            let done = rec.transition(TaskState::Succeeded);
            if write(sh, &done, token).await {
                metrics::counter!(m::SUCCEEDED, "queue" => queue, "task" => meta.name.clone())
                    .increment(1);
                reply(msg, AckKind::Ack).await;
            }
        }
        Some(Ok(Err(e))) => fail(sh, meta, msg, rec, token, e, false).await,
        Some(Err(_elapsed)) => {
            metrics::counter!(m::TIMEOUTS, "queue" => queue, "kind" => "hard").increment(1);
            let e = TaskError::new(
                "timeout",
                format!(
                    "attempt exceeded its {} ms timeout",
                    meta.timeout.as_millis()
                ),
            );
            fail(sh, meta, msg, rec, token, e, true).await;
        }
        None => {
            // Shutdown grace is over: hand the task back for another worker.
            let mut back = rec.transition(TaskState::Retrying);
            back.last_error = Some(ErrorInfo {
                class: "shutdown".into(),
                message: "worker shut down during the attempt".into(),
            });
            back.next_retry_at_ms = Some(now_ms());
            if write(sh, &back, token).await {
                reply(msg, AckKind::Nak(None)).await;
            }
        }
    }
    busy_gauge(sh, -1);
}

/// Writes `rec` under `token`, retrying a broker failure a few times. False if the token
/// is stale (another attempt took over: the result is refused) or the broker stayed down
/// (the delivery is left to be redelivered).
async fn write(sh: &Shared, rec: &TaskRecord, token: u64) -> bool {
    for _ in 0..3 {
        match sh.tasks.cas(rec, token).await {
            Ok(_) => return true,
            Err(StateError::Stale { .. }) => {
                metrics::counter!(m::STALE_RESULTS, "queue" => sh.queue.clone()).increment(1);
                warn!(task_id = %rec.id, attempt = rec.attempt, state = %rec.state,
                    "result refused: another attempt took over (stale fencing token)");
                return false;
            }
            Err(e) => {
                warn!(task_id = %rec.id, cause = %e, "state write failed; retrying");
                tokio::time::sleep(BROKER_RETRY).await;
            }
        }
    }
    false
}

async fn fail(
    sh: &Shared,
    meta: &TaskMeta,
    msg: &jetstream::Message,
    rec: TaskRecord,
    token: u64,
    e: TaskError,
    timed_out: bool,
) {
    let queue = sh.queue.clone();
    metrics::counter!(m::FAILED, "queue" => queue.clone(), "task" => meta.name.clone(), "class" => e.class.clone())
        .increment(1);
    metrics::gauge!(m::TASK_TIMEOUT_RATE, "queue" => queue.clone()).set(sh.rate.record(timed_out));
    let error = ErrorInfo {
        class: e.class.clone(),
        message: e.message.clone(),
    };
    let retry = !e.permanent && meta.retryable(&e.class) && rec.attempt < meta.max_attempts;
    if !retry {
        return finish_dead(sh, meta, msg, rec, token, error).await;
    }
    let delay = meta.backoff.delay(rec.attempt);
    let mut next = rec.transition(TaskState::Retrying);
    next.last_error = Some(error);
    next.next_retry_at_ms = Some(now_ms() + delay.as_millis() as u64);
    if write(sh, &next, token).await {
        metrics::counter!(m::RETRIED, "queue" => queue, "task" => meta.name.clone()).increment(1);
        debug!(task_id = %meta.id, attempt = next.attempt, ?delay, "retry scheduled");
        reply(msg, AckKind::Nak(Some(delay))).await;
    }
}

async fn finish_dead(
    sh: &Shared,
    meta: &TaskMeta,
    msg: &jetstream::Message,
    rec: TaskRecord,
    token: u64,
    error: ErrorInfo,
) {
    let mut dead = rec.transition(TaskState::Dead);
    dead.last_error = Some(error.clone());
    if write(sh, &dead, token).await {
        metrics::counter!(m::DEAD, "queue" => sh.queue.clone(), "task" => meta.name.clone())
            .increment(1);
        error!(task_id = %meta.id, queue = %meta.queue, class = %error.class,
            cause = %error.message, attempts = dead.attempt, "task dead");
        publish_dead_letter_and_term(sh, meta, msg, &dead, &error).await;
    }
}

/// Publishes the dead letter (idempotent by message id), then terminates the delivery.
async fn publish_dead_letter_and_term(
    sh: &Shared,
    meta: &TaskMeta,
    msg: &jetstream::Message,
    rec: &TaskRecord,
    error: &ErrorInfo,
) {
    let mut headers = meta.to_headers();
    headers.insert("Nats-Msg-Id", meta.id.as_str());
    headers.insert(header::ERROR_CLASS, header_safe(&error.class).as_str());
    headers.insert(header::ERROR_MESSAGE, header_safe(&error.message).as_str());
    headers.insert(header::ATTEMPTS, rec.attempt.to_string().as_str());
    dead_letter_and_term(sh, &meta.queue, msg, headers).await;
}

/// A message on a ready subject that is not a task ax can read: dead-letter it as is.
async fn reject_malformed(sh: &Shared, msg: &jetstream::Message, why: &str) {
    error!(subject = %msg.subject, cause = why, "malformed task message; dead-lettered");
    let mut headers = msg.headers.clone().unwrap_or_default();
    headers.insert(header::ERROR_CLASS, "bad_message");
    headers.insert(header::ERROR_MESSAGE, header_safe(why).as_str());
    dead_letter_and_term(sh, &sh.queue, msg, headers).await;
}

/// Stores the delivery's payload in `AX_DEAD` with `headers`, then Terms the delivery; if
/// the dead letter is not acknowledged, naks it instead so a redelivery tries again.
async fn dead_letter_and_term(
    sh: &Shared,
    queue: &str,
    msg: &jetstream::Message,
    headers: async_nats::HeaderMap,
) {
    let publish = jetstream::message::PublishMessage::build()
        .headers(headers)
        .payload(msg.payload.clone());
    let sent = match sh
        .js
        .send_publish(names::dead_subject(queue), publish)
        .await
    {
        Ok(ack) => ack.await.map(|_| ()),
        Err(e) => Err(e),
    };
    match sent {
        Ok(()) => reply(msg, AckKind::Term).await,
        Err(e) => {
            warn!(subject = %msg.subject, cause = %e, "dead letter not stored; will retry on redelivery");
            reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
        }
    }
}
