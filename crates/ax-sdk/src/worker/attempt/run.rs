//! The handler's run under the attempt's fencing token: heartbeats, timeout, cancel, the
//! writes of its outcome.

use crate::metrics as m;
use crate::output::{Output, StoredOutput, MAX_OUTPUT_BYTES};
use crate::task::TaskMeta;
use crate::time::now_ms;
use crate::worker::error::TaskError;
use crate::worker::fence::Fence;
use crate::worker::handler::{is_json, Task};
use crate::worker::inflight::Slot;
use crate::worker::settle::{settle, End};
use async_nats::jetstream::{self};
use futures::FutureExt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

use super::end::{AttemptEnd, Stopped};
use super::finish::{ack_kind, fail, log_attempt, put_output, streak, trace_id};
use super::shared::*;
use super::start::{Claimed, FIRST_WRITE_AFTER};

/// The error class of an attempt stopped by its soft timeout.
pub(crate) const STALLED: &str = "heartbeat_timeout";

pub(super) async fn run(
    sh: &Shared,
    meta: &TaskMeta,
    route: &Route<'_>,
    msg: &jetstream::Message,
    claimed: Claimed,
    slot: &Slot,
    lost: Lost<'_>,
) {
    let Claimed {
        rec,
        token,
        deferred,
    } = claimed;
    let rec = *rec;
    let held = &slot.held;
    let queue = sh.queue.clone();
    let task_label = sh.labels.task(&meta.name);
    if rec.attempt == 1 {
        let ready_at = meta.run_at_ms.unwrap_or(meta.created_at_ms);
        metrics::histogram!(m::QUEUE_WAIT, "queue" => queue.clone())
            .record(now_ms().saturating_sub(ready_at) as f64 / 1000.0);
    }
    let fence = Arc::new(Fence::new(sh.tasks.clone(), rec.clone(), token, !deferred));
    let task = Task {
        id: meta.id.clone(),
        name: meta.name.clone(),
        queue: meta.queue.clone(),
        priority: meta.priority,
        payload: msg.payload.clone(),
        is_json: is_json(meta.content_type),
        attempt: rec.attempt,
        max_attempts: meta.max_attempts,
        fence: fence.clone(),
        idempotency_key: meta.idempotency_key.clone(),
        created_at_ms: meta.created_at_ms,
        run_at_ms: meta.run_at_ms,
        traceparent: meta.traceparent.clone(),
        business_id: meta.business_id.clone(),
        cancel: slot.cancel.clone(),
        beats: Default::default(),
    };
    let beats = task.beats.clone();
    // Every attempt runs in a span with the task's identity: the handler's own log
    // lines carry it.
    let span = tracing::info_span!(
        "task",
        task_id = %meta.id,
        name = %meta.name,
        queue = %meta.queue,
        attempt = rec.attempt,
        idempotency_key = tracing::field::Empty,
        trigger = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        business_id = tracing::field::Empty,
    );
    if let Some(key) = &meta.idempotency_key {
        span.record("idempotency_key", tracing::field::display(key));
    }
    if let Some(l) = &meta.lineage {
        span.record("trigger", tracing::field::display(&l.trigger));
    }
    if let Some(t) = &meta.traceparent {
        span.record("trace_id", tracing::field::display(trace_id(t)));
    }
    if let Some(id) = &meta.business_id {
        span.record("business_id", tracing::field::display(id));
    }
    let input_bytes = msg.payload.len();
    let started = Instant::now();
    let outcome = {
        let _busy = Busy::start(sh);
        let handler = AssertUnwindSafe(tracing::Instrument::instrument(
            (route.handler)(task),
            span.clone(),
        ))
        .catch_unwind();
        // The soft timeout: no heartbeat for that long stops the handler.
        let soft = route.heartbeat_timeout;
        let handler = async {
            tokio::select! {
                r = handler => r,
                _ = beats.stalled(soft) => {
                    let ms = soft.map_or(0, |d| d.as_millis());
                    Ok(Err(TaskError::new(STALLED, format!(
                        "no heartbeat for {ms} ms (its heartbeat_timeout); {} heartbeats before",
                        beats.count()))))
                }
            }
        };
        // Marked started as it is first polled, unless a cancel signal came first (the
        // signal's answer says which: `Slot::start`).
        let number = rec.attempt;
        let handler = async {
            if !slot.start(number) {
                return None;
            }
            Some(handler.await)
        };
        let mut attempt = std::pin::pin!(async {
            // Biased: a task cancelled (or a slot lost) before its start, while it waited
            // for its token or a resume, never has its handler polled.
            tokio::select! {
                biased;
                _ = sh.hard_stop.cancelled() => None,
                _ = slot.cancel.cancelled() => None,
                _ = lost.wait() => None,
                r = tokio::time::timeout(meta.timeout, handler) => match r {
                    Ok(None) => None,
                    Ok(Some(r)) => Some(Ok(r)),
                    Err(elapsed) => Some(Err(elapsed)),
                },
            }
        });
        if deferred {
            let first_write = FIRST_WRITE_AFTER.min(sh.heartbeat);
            tokio::select! {
                outcome = &mut attempt => outcome,
                _ = tokio::time::sleep(first_write) => {
                    tokio::join!(&mut attempt, fence.write_running()).0
                }
            }
        } else {
            attempt.await
        }
    };
    let end = AttemptEnd::of(outcome, || {
        if slot.cancel.is_cancelled() {
            Stopped::Cancelled
        } else if lost.is_lost() {
            Stopped::SlotLost
        } else {
            Stopped::Shutdown
        }
    });
    log_attempt(&span, &end, started.elapsed(), input_bytes);
    // The revision the outcome is written against (the `running` write's, if made).
    let token = fence.revision().await;
    metrics::histogram!(m::RUN_DURATION, "queue" => queue.clone(), "task" => task_label.clone())
        .record(started.elapsed().as_secs_f64());
    match end {
        AttemptEnd::Returned(Output(Some(out))) if out.bytes.len() > MAX_OUTPUT_BYTES => {
            let e = TaskError::permanent(
                "output_too_large",
                format!(
                    "the output is {} bytes; at most {MAX_OUTPUT_BYTES} are stored",
                    out.bytes.len()
                ),
            );
            fail(sh, meta, msg, rec, token, e, false, held).await
        }
        AttemptEnd::Returned(output) => {
            metrics::gauge!(m::TASK_TIMEOUT_RATE, "queue" => queue.clone())
                .set(sh.rate.record(false));
            let mut stored = None;
            if let Output(Some(out)) = output {
                // Under a key of this attempt: a stale attempt never overwrites the
                // output the record names; stored before the record names it.
                let named = StoredOutput::of(&out, &format!("{}.{}", rec.id, rec.attempt));
                if let Some(key) = &named.key {
                    if !put_output(sh, &rec.id, key, out.bytes, held).await {
                        return;
                    }
                }
                stored = Some(named);
            }
            let (done, after) = settle(meta, rec, End::Succeeded(stored), now_ms(), Duration::ZERO);
            if write(sh, &done, token, held).await {
                streak(sh, &task_label, false);
                metrics::counter!(m::SUCCEEDED, "queue" => queue, "task" => task_label)
                    .increment(1);
                reply(msg, ack_kind(after)).await;
            }
        }
        AttemptEnd::Failed(e) if e.class == STALLED && !e.permanent => {
            metrics::counter!(m::TIMEOUTS, "queue" => queue, "kind" => "soft").increment(1);
            fail(sh, meta, msg, rec, token, e, true, held).await
        }
        AttemptEnd::Failed(e) => fail(sh, meta, msg, rec, token, e, false, held).await,
        AttemptEnd::Panicked(what) => {
            warn!(task_id = %meta.id, cause = %what, "handler panicked; the attempt failed");
            let e = TaskError::new("panic", what);
            fail(sh, meta, msg, rec, token, e, false, held).await;
        }
        AttemptEnd::TimedOut => {
            metrics::counter!(m::TIMEOUTS, "queue" => queue, "kind" => "hard").increment(1);
            let e = TaskError::new(
                "timeout",
                format!(
                    "attempt exceeded its {} ms timeout",
                    meta.timeout.as_millis()
                ),
            );
            fail(sh, meta, msg, rec, token, e, true, held).await;
        }
        // An operator cancelled the task while it ran (`ax.cancel.<queue>`); or a
        // concurrency slot expired under the attempt (the worker stalled past the ack wait)
        // and may be held by another attempt: the handler was stopped so the cap holds, and
        // the task goes back unless another attempt took it over (then this write is stale
        // and refused); or the shutdown grace is over: handed back for another worker.
        AttemptEnd::Stopped(why) => {
            let mut rec = rec;
            // An attempt that was to start unwritten and never started is not counted
            // (its claim counted it in the record it was going to write).
            if deferred && slot.started() != rec.attempt {
                rec.attempt = rec.attempt.saturating_sub(1);
            }
            let attempt = rec.attempt;
            let end = match why {
                Stopped::Cancelled => End::Cancelled,
                Stopped::SlotLost => End::SlotLost,
                Stopped::Shutdown => End::Shutdown,
            };
            let (record, after) = settle(meta, rec, end.clone(), now_ms(), Duration::ZERO);
            if write(sh, &record, token, held).await {
                match end {
                    End::Cancelled => info!(task_id = %meta.id, attempt, "attempt cancelled"),
                    End::SlotLost => {
                        warn!(task_id = %meta.id, "attempt stopped: its concurrency slot was lost")
                    }
                    _ => {}
                }
                reply(msg, ack_kind(after)).await;
            }
        }
    }
}
