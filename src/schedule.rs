//! Delayed tasks: held in `AX_DELAYED`, moved to their ready subject when due (S2-5).
//!
//! The server keeps a timer index of `(due, stream sequence)` pairs, 16 bytes a task, built
//! from a headers-only ordered consumer over `AX_DELAYED`: on start it replays every held
//! task, then it follows new ones. The index is a cache: the stream is the truth, so a server
//! killed at any line rebuilds it and loses nothing.
//!
//! Shortly before a task is due (the look-ahead, default 200 ms) its message is read by
//! sequence; at the due instant it is published to the ready subject with `Nats-Msg-Id` =
//! task id, then its record moves `scheduled → pending`, then the delayed message is deleted.
//! A crash between those steps repeats them on restart; the message id makes the re-publish
//! a no-op within the duplicate window. A full ready subject leaves the task in `AX_DELAYED`
//! and retries with backoff (counted in `ax_pending_dispatch`), never spinning or dropping.

use crate::metrics as m;
use crate::names::{self, DELAYED_STREAM};
use crate::state::{StateError, TaskRecord, TaskState, TaskStore};
use crate::submit::publish_task;
use crate::task::{header, now_ms, TaskMeta};
use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

/// Errors of the scheduler loop.
#[derive(Debug, thiserror::Error)]
#[error("delayed-task scheduler: {op}: {source}")]
pub struct ScheduleError {
    op: &'static str,
    source: async_nats::Error,
}

fn err(op: &'static str) -> impl FnOnce(async_nats::Error) -> ScheduleError {
    move |source| ScheduleError { op, source }
}

/// The instant a wall-clock time (ms since the epoch) is reached, by the monotonic clock.
pub(crate) fn instant_at(at_ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(at_ms.saturating_sub(now_ms()))
}

pub(crate) struct Scheduler {
    pub(crate) js: jetstream::Context,
    pub(crate) tasks: TaskStore,
    pub(crate) lookahead: Duration,
    pub(crate) max_inflight: usize,
}

struct Ctx {
    js: jetstream::Context,
    stream: stream::Stream,
    tasks: TaskStore,
}

impl Scheduler {
    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), ScheduleError> {
        let stream = self
            .js
            .get_stream(DELAYED_STREAM)
            .await
            .map_err(|e| err("get stream")(e.into()))?;
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig {
                headers_only: true,
                deliver_policy: consumer::DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .map_err(|e| err("create index consumer")(e.into()))?;
        let mut feed = consumer
            .messages()
            .await
            .map_err(|e| err("follow stream")(e.into()))?;
        let ctx = Arc::new(Ctx {
            js: self.js.clone(),
            stream,
            tasks: self.tasks.clone(),
        });
        let inflight = Arc::new(Semaphore::new(self.max_inflight));
        let tracker = TaskTracker::new();
        let mut index: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
        let far = Duration::from_secs(3600);
        loop {
            let wake = index
                .peek()
                .map_or(Instant::now() + far, |Reverse((at, _))| {
                    instant_at(*at)
                        .checked_sub(self.lookahead)
                        .unwrap_or_else(Instant::now)
                });
            tokio::select! {
                _ = shutdown.cancelled() => break,
                next = feed.next() => match next {
                    Some(Ok(msg)) => {
                        let Ok(info) = msg.info() else { continue };
                        let seq = info.stream_sequence;
                        match msg.headers.as_ref().and_then(|h| h.get(header::RUN_AT_MS)) {
                            Some(at) => match at.as_str().parse::<u64>() {
                                Ok(at) => index.push(Reverse((at, seq))),
                                Err(_) => warn!(seq, "delayed message with a bad Ax-Run-At-Ms; left in place"),
                            },
                            None => warn!(seq, "delayed message without Ax-Run-At-Ms; left in place"),
                        }
                    }
                    Some(Err(e)) => warn!(cause = %e, "delayed index feed error; the ordered consumer resets itself"),
                    None => return Err(err("follow stream")("feed ended".into())),
                },
                _ = tokio::time::sleep_until(wake), if !index.is_empty() => {
                    let horizon = now_ms() + self.lookahead.as_millis() as u64;
                    while let Some(Reverse((at, seq))) = index.peek().copied() {
                        if at > horizon {
                            break;
                        }
                        index.pop();
                        let permit = inflight.clone().acquire_owned().await.expect("never closed");
                        let ctx = ctx.clone();
                        let token = shutdown.clone();
                        tracker.spawn(async move {
                            tokio::select! {
                                _ = token.cancelled() => {}
                                _ = dispatch(&ctx, at, seq) => {}
                            }
                            drop(permit);
                        });
                    }
                }
            }
            metrics::gauge!(m::DELAYED_TRACKED)
                .set((index.len() + self.max_inflight - inflight.available_permits()) as f64);
        }
        tracker.close();
        tracker.wait().await;
        Ok(())
    }
}

/// Moves one delayed task to its ready subject at its due time.
async fn dispatch(ctx: &Ctx, at: u64, seq: u64) {
    let msg = match ctx.stream.direct_get(seq).await {
        Ok(msg) => msg,
        Err(e) => {
            // Gone: another server moved it, or it was removed by hand.
            debug!(seq, cause = %e, "delayed message not readable; skipped");
            return;
        }
    };
    let meta = match TaskMeta::from_headers(&msg.headers) {
        Ok(meta) => meta,
        Err(e) => {
            warn!(seq, cause = %e, "delayed message with bad headers; left in place");
            return;
        }
    };
    tokio::time::sleep_until(instant_at(at)).await;
    let gauge = metrics::gauge!(m::PENDING_DISPATCH);
    gauge.increment(1.0);
    let subject = names::ready_subject(&meta.queue, meta.priority);
    let mut pause = Duration::from_millis(20);
    loop {
        match publish_task(&ctx.js, subject.clone(), &meta, msg.payload.clone()).await {
            Ok(_) => break,
            Err(e) => {
                debug!(task_id = %meta.id, cause = %e, "ready publish refused; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
    gauge.decrement(1.0);
    metrics::histogram!(m::DISPATCH_LAG).record(now_ms().saturating_sub(at) as f64 / 1000.0);
    metrics::counter!(m::DELAYED_DISPATCHED).increment(1);
    if let Err(e) = mark_pending(&ctx.tasks, &meta).await {
        warn!(task_id = %meta.id, cause = %e, "could not mark task pending; the worker will");
    }
    if let Err(e) = ctx.stream.delete_message(seq).await {
        debug!(seq, cause = %e, "delayed message already gone");
    }
}

async fn mark_pending(tasks: &TaskStore, meta: &TaskMeta) -> Result<(), StateError> {
    match tasks.get(&meta.id).await? {
        Some((rec, rev)) if rec.state == TaskState::Scheduled => {
            match tasks.cas(&rec.transition(TaskState::Pending), rev).await {
                Ok(_) | Err(StateError::Stale { .. }) => Ok(()),
                Err(e) => Err(e),
            }
        }
        Some(_) => Ok(()),
        None => {
            let rec = TaskRecord::new(meta).transition(TaskState::Pending);
            match tasks.create(&rec).await {
                Ok(_) | Err(StateError::Exists(_)) => Ok(()),
                Err(e) => Err(e),
            }
        }
    }
}
