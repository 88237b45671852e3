//! Delayed tasks: held in `AX_DELAYED`, moved to their ready subject when due.
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
//! never spinning or dropping it. No record is written here: a task with a key keeps its
//! `scheduled` record until a worker claims it (see docs/ARCHITECTURE.md for why no
//! `pending` write is made), and one without a key has none until its claim.

use crate::submit::publish_headers;
use async_nats::jetstream::{self, consumer, stream};
use ax_core::admit::delete_delayed;
use ax_core::debounce;
use ax_core::faults::Faults;
use ax_core::follow::Reconnects;
use ax_core::metrics as m;
use ax_core::names::DELAYED_STREAM;
use ax_core::task::{header, TaskMeta};
use ax_core::time::now_ms;
use futures::StreamExt;
use index::{Body, Due, Index};
use outcome::Outcome;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

mod index;
mod outcome;
pub(crate) mod partitions;
pub(crate) mod wake;
mod window;

/// Errors of the scheduler loop.
#[derive(Debug, thiserror::Error)]
#[error("delayed-task scheduler: {op}: {source}")]
pub struct ScheduleError {
    pub(crate) op: &'static str,
    pub(crate) source: async_nats::Error,
}

impl ScheduleError {
    /// What kind of failure this is.
    pub fn kind(&self) -> ax_core::error::ErrorKind {
        ax_core::error::ErrorKind::of(self.source.as_ref())
    }
}

fn err(op: &'static str) -> impl FnOnce(async_nats::Error) -> ScheduleError {
    move |source| ScheduleError { op, source }
}

/// The instant a wall-clock time (ms since the epoch) is reached, by the monotonic clock.
pub(crate) fn instant_at(at_ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(at_ms.saturating_sub(now_ms()))
}

/// The index and dispatcher of one delayed-task partition (`partitions` runs one per
/// partition this server owns).
#[derive(Clone)]
pub(crate) struct Scheduler {
    pub(crate) js: jetstream::Context,
    pub(crate) lookahead: Duration,
    pub(crate) horizon: Duration,
    pub(crate) max_inflight: usize,
    pub(crate) max_held_bytes: usize,
    /// The subjects of `AX_DELAYED` this scheduler follows: the first is the one new
    /// messages are stored under, the rest are older layouts (`names::delayed_filters`).
    pub(crate) filters: Vec<String>,
    /// Its slot in `totals`.
    pub(crate) slot: usize,
    /// Gauge contributions of every scheduler of this process.
    pub(crate) totals: std::sync::Arc<Totals>,
    /// Faults a test armed (an abort between a dispatch and its delete).
    pub(crate) faults: ax_core::faults::Faults,
    /// Task records: a flow's wait task ([`wake`]) is ended here, not by a worker.
    pub(crate) tasks: ax_core::state::TaskStore,
    /// The flows' waits for events: one times out only once the matcher let it go.
    pub(crate) waits: ax_core::waits::Waits,
    /// `AX_IDEMPOTENCY`: a batch's item keys are written there as it is closed.
    pub(crate) idempotency: jetstream::kv::Store,
}

/// Per-scheduler counts behind the process-wide gauges `ax_pending_dispatch` and
/// `ax_delayed_tracked`, which show their sums.
#[derive(Debug, Default)]
pub(crate) struct Totals {
    pending: Vec<std::sync::atomic::AtomicUsize>,
    tracked: Vec<std::sync::atomic::AtomicUsize>,
}

impl Totals {
    pub(crate) fn new(slots: usize) -> Totals {
        Totals {
            pending: (0..slots).map(|_| Default::default()).collect(),
            tracked: (0..slots).map(|_| Default::default()).collect(),
        }
    }

    /// Sets one scheduler's counts and the gauges to the sums.
    pub(crate) fn set(&self, slot: usize, pending: usize, tracked: usize) {
        self.pending[slot].store(pending, Ordering::Relaxed);
        self.tracked[slot].store(tracked, Ordering::Relaxed);
        let sum = |v: &[std::sync::atomic::AtomicUsize]| {
            v.iter().map(|a| a.load(Ordering::Relaxed)).sum::<usize>() as f64
        };
        metrics::gauge!(m::PENDING_DISPATCH).set(sum(&self.pending));
        metrics::gauge!(m::DELAYED_TRACKED).set(sum(&self.tracked));
    }
}

/// Most concurrent read-aheads of delayed messages.
const MAX_LOADS: usize = 256;

impl Scheduler {
    /// The filter of the subjects new delayed messages are stored under. Once the replay
    /// of every stored message is done the feed follows it alone: a consumer with
    /// several filters costs nats-server a walk over every subject of the partition
    /// each time it finds no next message, that is after each new message
    /// (docs/PERFORMANCE.md, W4; no server stores the older layouts any more).
    fn live(&self) -> &[String] {
        &self.filters[..self.filters.len().min(1)]
    }

    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), ScheduleError> {
        // A cluster electing leaders (a node lost) answers nothing for a few seconds: wait
        // with backoff rather than end, which would stop the partition.
        let started =
            ax_core::retry::until_ok("AX_DELAYED, to index delayed tasks", &shutdown, || async {
                let stream = self
                    .js
                    .get_stream(DELAYED_STREAM)
                    .await
                    .map_err(|e| err("get stream")(e.into()))?;
                let (feed, pending) = follow(&stream, &self.filters, 0).await?;
                if pending == 0 && self.filters.len() > 1 {
                    // Nothing stored yet: the live subjects alone from the start.
                    let (feed, _) = follow(&stream, self.live(), 0).await?;
                    return Ok((stream, feed, false));
                }
                Ok::<_, ScheduleError>((stream, feed, self.filters.len() > 1))
            })
            .await;
        let Some((stream, mut feed, mut catching_up)) = started else {
            return Ok(()); // shut down while waiting
        };
        let mut last_seq = 0u64;
        // Follows again within a quarter second of a reconnect (`ax_core::follow`).
        let mut reconnects = Reconnects::new(&self.js.client());
        let horizon_ms = self.horizon.as_millis() as u64;
        let lookahead_ms = self.lookahead.as_millis() as u64;
        let mut index = Index::new(self.max_held_bytes);
        // Batches of dispatches; `inflight` counts the tasks in them.
        let mut dispatching: JoinSet<Vec<(Option<String>, Outcome)>> = JoinSet::new();
        let mut inflight = 0usize;
        let mut loads: JoinSet<(u64, Option<Body>)> = JoinSet::new();
        loop {
            // Start what there is room for; nothing below waits for room.
            let now = now_ms();
            let free = self.max_inflight.saturating_sub(inflight);
            let mut due = index.probes(Instant::now());
            due.truncate(free);
            let more = free - due.len();
            due.extend(index.take_due(now + lookahead_ms, more));
            inflight += due.len();
            while !due.is_empty() {
                let rest = due.split_off(due.len().min(BATCH));
                let batch = std::mem::replace(&mut due, rest);
                let (js, stream, token) = (self.js.clone(), stream.clone(), shutdown.clone());
                let (faults, tasks) = (self.faults.clone(), self.tasks.clone());
                let (waits, idempotency) = (self.waits.clone(), self.idempotency.clone());
                dispatching.spawn(async move {
                    let n = batch.len();
                    let to = To {
                        js: &js,
                        stream: &stream,
                        faults: &faults,
                        tasks: &tasks,
                        waits: &waits,
                        idempotency: &idempotency,
                    };
                    tokio::select! {
                        _ = token.cancelled() => (0..n).map(|_| (None, Outcome::Gone)).collect(),
                        out = dispatch_batch(&to, batch) => out,
                    }
                });
            }
            let room = MAX_LOADS.saturating_sub(loads.len());
            for seq in index.take_loads(now + horizon_ms, room) {
                let stream = stream.clone();
                loads.spawn(async move { (seq, load(&stream, seq).await.ok().flatten()) });
            }
            self.totals
                .set(self.slot, index.parked() + inflight, index.len() + inflight);

            let mut wake: Option<Instant> = index.next_probe();
            if inflight < self.max_inflight {
                if let Some(at) = index.next_due() {
                    wake = earliest(wake, instant_at(at.saturating_sub(lookahead_ms)));
                }
            }
            if loads.len() < MAX_LOADS {
                if let Some(at) = index.next_load_due() {
                    wake = earliest(wake, instant_at(at.saturating_sub(horizon_ms)));
                }
            }
            let sleep = wake.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = reconnects.changed() => {
                    debug!(last_seq, "reconnected: following AX_DELAYED again");
                    let filters = if catching_up { &self.filters[..] } else { self.live() };
                    match follow(&stream, filters, last_seq + 1).await {
                        Ok((f, _)) => {
                            feed = f;
                            reconnects.mark();
                        }
                        Err(e) => warn!(cause = %e, "cannot follow AX_DELAYED yet; retrying"),
                    }
                }
                next = feed.next() => match next {
                    Some(Ok(msg)) => {
                        let Ok(info) = msg.info() else { continue };
                        let seq = info.stream_sequence;
                        if seq <= last_seq {
                            continue; // seen before a re-follow
                        }
                        last_seq = seq;
                        let at = msg.headers.as_ref()
                            .and_then(|h| h.get(header::RUN_AT_MS))
                            .and_then(|v| v.as_str().parse::<u64>().ok());
                        match at {
                            Some(at) => {
                                let body = (msg.headers.clone().unwrap_or_default(), msg.payload.clone());
                                index.add(at, seq, Some(body), now_ms(), horizon_ms);
                            }
                            None => warn!(seq, "delayed message without a valid Ax-Run-At-Ms; left in place"),
                        }
                        if catching_up && info.pending == 0 {
                            match follow(&stream, self.live(), last_seq + 1).await {
                                Ok((f, _)) => {
                                    feed = f;
                                    catching_up = false;
                                }
                                Err(e) => debug!(cause = %e, "cannot follow the live delayed subjects alone yet; the next message tries again"),
                            }
                        }
                    }
                    Some(Err(e)) => warn!(cause = %e, "delayed index feed error; the ordered consumer resets itself"),
                    None => return Err(err("follow stream")("feed ended".into())),
                },
                Some(done) = dispatching.join_next(), if !dispatching.is_empty() => {
                    let Ok(outcomes) = done else {
                        // A batch task failed (a bug): its tasks are still in AX_DELAYED,
                        // and the next replay picks them up.
                        warn!("a delayed-dispatch batch failed");
                        continue;
                    };
                    inflight = inflight.saturating_sub(outcomes.len());
                    for (probe_of, outcome) in outcomes { match outcome {
                        Outcome::Done { subject } => {
                            index.unpark(&subject);
                            if let Some(group) = probe_of {
                                index.unpark(&group);
                            }
                        }
                        Outcome::Refused { group, due, seq, body } => {
                            index.park(group, due, seq, body, Instant::now(), probe_of.as_deref());
                        }
                        Outcome::Gone | Outcome::Bad => {
                            if let Some(group) = probe_of {
                                index.unpark(&group);
                            }
                        }
                    } }
                }
                Some(done) = loads.join_next(), if !loads.is_empty() => {
                    if let Ok((seq, body)) = done {
                        index.loaded(seq, body);
                    }
                }
                _ = tokio::time::sleep_until(sleep) => {}
            }
        }
        dispatching.shutdown().await;
        loads.shutdown().await;
        self.totals.set(self.slot, 0, 0);
        Ok(())
    }
}

fn earliest(a: Option<Instant>, b: Instant) -> Option<Instant> {
    Some(a.map_or(b, |a| a.min(b)))
}

/// An ordered consumer over `AX_DELAYED` from `start` (0: from the first message), and
/// how many stored messages it has to deliver. Pull requests expire after 2 s with a 1 s
/// idle heartbeat, so a consumer lost with a cluster node is noticed (two missed
/// heartbeats) and recreated within a few seconds rather than after the default 15 s.
async fn follow(
    stream: &stream::Stream,
    filters: &[String],
    start: u64,
) -> Result<(consumer::pull::Ordered, u64), ScheduleError> {
    ax_core::follow::ordered_from(stream, filters.to_vec(), start)
        .await
        .map_err(err("follow stream"))
}

/// Reads a delayed message back by sequence: `Ok(None)` if it is gone (another server
/// moved it, or it was removed by hand), `Err` if the broker could not answer.
async fn load(stream: &stream::Stream, seq: u64) -> Result<Option<Body>, String> {
    match stream.direct_get(seq).await {
        Ok(msg) => Ok(Some((msg.headers, msg.payload))),
        // A direct get may be answered by any replica, and one that lags (catching up after
        // a node was lost) may say "not found" for a message that is stored: only the
        // stream leader's word drops a task from the index (it would stay in AX_DELAYED,
        // undispatched until a restart).
        Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => {
            match stream.get_raw_message(seq).await {
                Ok(msg) => Ok(Some((msg.headers, msg.payload))),
                Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
                Err(e) => {
                    debug!(seq, cause = %e, "delayed message not confirmed gone by the leader");
                    Err(e.to_string())
                }
            }
        }
        Err(e) => {
            debug!(seq, cause = %e, "delayed message not readable now");
            Err(e.to_string())
        }
    }
}

/// Most tasks one dispatch batch carries.
const BATCH: usize = 256;

/// Moves delayed tasks to their ready subjects at their due times, a batch at a time: the
/// tasks due by now are read (if their bodies are not held) and published together, their
/// publish acks awaited together, and their delayed messages deleted together. One task
/// per batch rather than per message keeps a burst of 100,000 cheap to start.
async fn dispatch_batch(to: &To<'_>, mut batch: Vec<Due>) -> Vec<(Option<String>, Outcome)> {
    batch.sort_by_key(|d| d.due);
    let mut out = Vec::with_capacity(batch.len());
    let mut rest = batch.into_iter().peekable();
    while let Some(first) = rest.peek() {
        tokio::time::sleep_until(instant_at(first.due)).await;
        let now = now_ms();
        let mut ready = Vec::new();
        while let Some(d) = rest.next_if(|d| d.due <= now) {
            ready.push(d);
        }
        let round = ready.into_iter().map(|d| async move {
            let probe_of = d.probe_of.clone();
            (probe_of, dispatch(to, d).await)
        });
        out.extend(futures::future::join_all(round).await);
    }
    out
}

/// What a dispatch works with.
struct To<'a> {
    js: &'a jetstream::Context,
    stream: &'a stream::Stream,
    faults: &'a Faults,
    tasks: &'a ax_core::state::TaskStore,
    waits: &'a ax_core::waits::Waits,
    idempotency: &'a jetstream::kv::Store,
}

/// Moves one delayed task to its ready subject (it is due).
async fn dispatch(to: &To<'_>, d: Due) -> Outcome {
    let To {
        js, stream, faults, ..
    } = *to;
    let Due { due, seq, body, .. } = d;
    let (headers, payload) = match body {
        Some(body) => body,
        None => match load(stream, seq).await {
            Ok(Some(body)) => body,
            Ok(None) => {
                debug!(
                    seq,
                    "delayed message gone (moved by another server, or removed)"
                );
                return Outcome::Gone;
            }
            Err(_) => {
                return Outcome::Refused {
                    group: "(read)".into(),
                    due,
                    seq,
                    body: None,
                }
            }
        },
    };
    if debounce::is_open(&headers) {
        return window::close(js, to.idempotency, seq, due, headers, payload, faults).await;
    }
    if let Some(wait) = headers.get(header::WAIT) {
        return wake::wake(to.js, to.tasks, to.waits, seq, due, wait.as_str(), &headers).await;
    }
    let (subject, id) = match TaskMeta::ready_route(&headers) {
        Ok((subject, id)) => (subject, id.to_string()),
        Err(e) => {
            warn!(seq, cause = %e, "delayed message with bad headers; left in place");
            return Outcome::Bad;
        }
    };
    // A closed window's fired copy (a debounce window or a batch): [`window::retire`].
    let window = headers
        .get(debounce::FIRED)
        .and_then(|_| debounce::window_subject_of(&id));
    if let Err(e) = publish_headers(js, subject.clone(), headers, &id, payload).await {
        // Parked without its body (read back when it is retried): refusals are rare, and
        // keeping the headers would cost a copy of every one on the way out.
        debug!(task_id = %id, cause = %e, "ready publish refused; parked");
        return Outcome::Refused {
            group: subject,
            due,
            seq,
            body: None,
        };
    }
    metrics::histogram!(m::DISPATCH_LAG).record(now_ms().saturating_sub(due) as f64 / 1000.0);
    metrics::counter!(m::DELAYED_DISPATCHED).increment(1);
    faults.pass(ax_core::faults::Abort::AfterDispatch);
    // The task lives on in the ready stream.
    let removed = match window {
        Some(window) => window::retire(js, stream, &window, seq).await,
        None => delete_delayed(js, seq).await,
    };
    if let Err(e) = removed {
        debug!(seq, cause = %e, "delayed message not deleted; a restart re-publishes it (deduplicated)");
    }
    Outcome::Done { subject }
}
