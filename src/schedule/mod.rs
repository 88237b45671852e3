//! Delayed tasks: held in `AX_DELAYED`, moved to their ready subject when due (S2-5).
//!
//! The server keeps a timer index built from an ordered consumer over `AX_DELAYED`: on
//! start it replays every held task, then it follows new ones. Tasks due within the
//! *horizon* (default 30 s) are held with their message (headers + payload), so dispatching
//! them costs no read; tasks further out are held as `(due, stream sequence)` only, 16 bytes
//! each, and their messages are read back by sequence as they cross into the horizon. The
//! index is a cache: the stream is the truth, so a server killed at any line rebuilds it and
//! loses nothing.
//!
//! At the due instant a task is published to its ready subject with `Nats-Msg-Id` = task id,
//! then its delayed message is deleted. A crash in between repeats the publish on restart;
//! the message id makes it a no-op within the duplicate window. A full ready subject leaves
//! the task in `AX_DELAYED` and retries with backoff (counted in `ax_pending_dispatch`),
//! never spinning or dropping it. The record stays `scheduled` until a worker claims it
//! (see docs/ARCHITECTURE.md for why no `pending` write is made here).

use crate::metrics as m;
use crate::names::{self, DELAYED_STREAM};
use crate::submit::publish_task;
use crate::task::{header, now_ms, TaskMeta};
use async_nats::jetstream::{self, consumer, stream};
use async_nats::HeaderMap;
use bytes::Bytes;
use futures::StreamExt;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Semaphore};
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

/// A held delayed message.
type Body = (HeaderMap, Bytes);

pub(crate) struct Scheduler {
    pub(crate) js: jetstream::Context,
    pub(crate) lookahead: Duration,
    pub(crate) horizon: Duration,
    pub(crate) max_inflight: usize,
}

/// Most concurrent reads of far tasks' messages as they cross into the horizon.
const MAX_LOADS: usize = 256;

impl Scheduler {
    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), ScheduleError> {
        let stream = self
            .js
            .get_stream(DELAYED_STREAM)
            .await
            .map_err(|e| err("get stream")(e.into()))?;
        let mut feed = follow(&stream, 0).await?;
        let mut last_seq = 0u64;
        // An ordered consumer notices a restarted nats-server only after two missed 15 s
        // heartbeats; watching the client's reconnect count lets the index resume within
        // a quarter second.
        let stats = self.js.client().statistics();
        let mut connects = stats.connects.load(Ordering::Relaxed);
        let mut watch = tokio::time::interval(Duration::from_millis(250));
        let horizon_ms = self.horizon.as_millis() as u64;
        let lookahead_ms = self.lookahead.as_millis() as u64;
        let inflight = Arc::new(Semaphore::new(self.max_inflight));
        let loads = Arc::new(Semaphore::new(MAX_LOADS));
        let (loaded_tx, mut loaded) = mpsc::channel::<(u64, u64, Option<Body>)>(MAX_LOADS);
        let tracker = TaskTracker::new();
        // Due within the horizon, message held; beyond it, only (due, sequence).
        let mut near: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
        let mut bodies: HashMap<u64, Body> = HashMap::new();
        let mut far: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
        let idle = Duration::from_secs(3600);
        loop {
            let now = now_ms();
            let next_dispatch = near
                .peek()
                .map(|Reverse((at, _))| at.saturating_sub(lookahead_ms));
            let next_load = far
                .peek()
                .map(|Reverse((at, _))| at.saturating_sub(horizon_ms));
            let wake = match (next_dispatch, next_load) {
                (None, None) => Instant::now() + idle,
                (a, b) => instant_at(a.unwrap_or(u64::MAX).min(b.unwrap_or(u64::MAX)).max(now)),
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = watch.tick() => {
                    let now_connects = stats.connects.load(Ordering::Relaxed);
                    if now_connects != connects {
                        debug!(last_seq, "reconnected: following AX_DELAYED again");
                        match follow(&stream, last_seq + 1).await {
                            Ok(f) => {
                                feed = f;
                                connects = now_connects;
                            }
                            Err(e) => warn!(cause = %e, "cannot follow AX_DELAYED yet; retrying"),
                        }
                    }
                }
                next = feed.next() => match next {
                    Some(Ok(msg)) => {
                        let Ok(info) = msg.info() else { continue };
                        let seq = info.stream_sequence;
                        last_seq = last_seq.max(seq);
                        let at = msg.headers.as_ref()
                            .and_then(|h| h.get(header::RUN_AT_MS))
                            .and_then(|v| v.as_str().parse::<u64>().ok());
                        match at {
                            Some(at) if at <= now + horizon_ms => {
                                let headers = msg.headers.clone().unwrap_or_default();
                                bodies.insert(seq, (headers, msg.payload.clone()));
                                near.push(Reverse((at, seq)));
                            }
                            Some(at) => far.push(Reverse((at, seq))),
                            None => warn!(seq, "delayed message without a valid Ax-Run-At-Ms; left in place"),
                        }
                    }
                    Some(Err(e)) => warn!(cause = %e, "delayed index feed error; the ordered consumer resets itself"),
                    None => return Err(err("follow stream")("feed ended".into())),
                },
                Some((at, seq, body)) = loaded.recv() => {
                    if let Some(body) = body {
                        bodies.insert(seq, body);
                        near.push(Reverse((at, seq)));
                    }
                }
                _ = tokio::time::sleep_until(wake), if next_dispatch.is_some() || next_load.is_some() => {
                    let now = now_ms();
                    while let Some(Reverse((at, seq))) = far.peek().copied() {
                        if at > now + horizon_ms {
                            break;
                        }
                        far.pop();
                        let permit = loads.clone().acquire_owned().await.expect("never closed");
                        let (stream, tx) = (stream.clone(), loaded_tx.clone());
                        tracker.spawn(async move {
                            let body = load(&stream, seq).await;
                            let _ = tx.send((at, seq, body)).await;
                            drop(permit);
                        });
                    }
                    while let Some(Reverse((at, seq))) = near.peek().copied() {
                        if at > now + lookahead_ms {
                            break;
                        }
                        near.pop();
                        let Some(body) = bodies.remove(&seq) else { continue };
                        let permit = inflight.clone().acquire_owned().await.expect("never closed");
                        let (js, token) = (self.js.clone(), shutdown.clone());
                        tracker.spawn(async move {
                            tokio::select! {
                                _ = token.cancelled() => {}
                                _ = dispatch(&js, at, seq, body) => {}
                            }
                            drop(permit);
                        });
                    }
                }
            }
            metrics::gauge!(m::DELAYED_TRACKED).set(
                (near.len() + far.len() + self.max_inflight - inflight.available_permits()) as f64,
            );
        }
        tracker.close();
        tracker.wait().await;
        Ok(())
    }
}

/// An ordered consumer over `AX_DELAYED` from `start` (0: from the first message).
async fn follow(
    stream: &stream::Stream,
    start: u64,
) -> Result<consumer::pull::Ordered, ScheduleError> {
    let deliver_policy = match start {
        0 => consumer::DeliverPolicy::All,
        start_sequence => consumer::DeliverPolicy::ByStartSequence { start_sequence },
    };
    stream
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy,
            ..Default::default()
        })
        .await
        .map_err(|e| err("create index consumer")(e.into()))?
        .messages()
        .await
        .map_err(|e| err("follow stream")(e.into()))
}

/// Reads a far task's message back by sequence; `None` if it is gone (another server moved
/// it, or it was removed by hand).
async fn load(stream: &stream::Stream, seq: u64) -> Option<Body> {
    match stream.direct_get(seq).await {
        Ok(msg) => Some((msg.headers, msg.payload)),
        Err(e) => {
            debug!(seq, cause = %e, "delayed message not readable; skipped");
            None
        }
    }
}

/// Moves one delayed task to its ready subject at its due time.
async fn dispatch(js: &jetstream::Context, at: u64, seq: u64, body: Body) {
    let (headers, payload) = body;
    let meta = match TaskMeta::from_headers(&headers) {
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
        match publish_task(js, subject.clone(), &meta, payload.clone()).await {
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
    // Delete without the secure erase (overwriting the stored bytes) that
    // `Stream::delete_message` asks for: the task lives on in the ready stream anyway.
    let request = serde_json::json!({ "seq": seq, "no_erase": true });
    let deleted: Result<serde_json::Value, _> = js
        .request(format!("STREAM.MSG.DELETE.{DELAYED_STREAM}"), &request)
        .await;
    if let Err(e) = deleted {
        debug!(seq, cause = %e, "delayed message not deleted; a restart re-publishes it (deduplicated)");
    }
}
