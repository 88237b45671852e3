//! One delivery of a task: claim the attempt, run the handler, record the outcome, ack.
//!
//! Every state write is a compare-and-set on the record revision this delivery read or
//! wrote, so a delivery that was overtaken (its worker paused past the ack wait and the
//! task went to another worker) has its result refused and does not ack. What the claim
//! does is decided by the pure [`claim::decide`](super::claim::decide).

use super::claim::{decide, Decision, Delivery};
use super::fence::Fence;
use super::inflight::{Held, InFlight, Slot};
use super::labels::Labels;
use super::options::Routes;
use super::rate::TimeoutRate;
use super::settle::{settle, After, End};
use super::{is_json, Handler, Task, TaskError};
use crate::idempotency::Verdict;
use crate::limits::gate::{Admit, Gate, Reason};
use crate::metrics as m;
use crate::names;
use crate::output::{Output, ResultStore, StoredOutput, MAX_OUTPUT_BYTES};
use crate::state::{ErrorInfo, StateError, TaskRecord, TaskState, TaskStore};
use crate::task::{header, TaskMeta};
use crate::time::now_ms;
use async_nats::jetstream::{self, AckKind};
use futures::FutureExt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

mod finish;
mod run;
mod start;

use finish::*;
use run::*;
use start::*;

/// State shared by all attempts of one worker.
pub(crate) struct Shared {
    /// Rate limits and concurrency caps, checked before a claim.
    pub(crate) gate: Arc<crate::limits::gate::Gate>,
    pub(crate) js: jetstream::Context,
    pub(crate) tasks: TaskStore,
    /// Idempotency keys, read by the claim of a keyed task that has no record.
    pub(crate) keys: crate::idempotency::Keys,
    pub(crate) results: ResultStore,
    pub(crate) queue: String,
    pub(crate) worker_id: String,
    /// The handlers and options by task name.
    pub(crate) routes: Routes,
    pub(crate) slots: Arc<Semaphore>,
    pub(crate) concurrency: usize,
    /// Handlers running now (slots held by the fetcher for a pull are not busy).
    pub(crate) running: AtomicUsize,
    pub(crate) heartbeat: Duration,
    pub(crate) ack_wait: Duration,
    pub(crate) shutdown: CancellationToken,
    pub(crate) hard_stop: CancellationToken,
    pub(crate) rate: TimeoutRate,
    pub(crate) tracker: TaskTracker,
    pub(crate) labels: Labels,
    /// See [`WorkerBuilder::lean_first_attempt`](super::WorkerBuilder::lean_first_attempt).
    pub(crate) lean_first_attempt: bool,
    /// The tasks held here now: one attempt of a task at a time.
    pub(crate) inflight: Arc<InFlight>,
    /// Failed attempts in a row per task name (`ax_task_consecutive_failures`).
    pub(crate) streaks: std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

/// Deliveries of an operator's retry that wait for its record write (200 ms apart).
const RETRY_WAITS: i64 = 25;

/// An attempt that would start without its `running` write more than this long after its
/// claim read the record writes it first. Shorter than the wait of an operator's cancel
/// for the holder's answer (`ax-server`'s `ops::holder::HOLDER_WAIT`, 500 ms): a cancel
/// answered without one was made more than this before any such start, so the write
/// sees it.
pub(crate) const LATE_START: Duration = Duration::from_millis(250);

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
        let meta = match msg.headers.as_ref().map(TaskMeta::from_headers) {
            Some(Ok(meta)) if meta.queue == sh.queue => meta,
            Some(Ok(meta)) => {
                let why = format!(
                    "task of queue {} on a subject of queue {}",
                    meta.queue, sh.queue
                );
                return reject_malformed(&sh, &msg, &why).await;
            }
            Some(Err(e)) => return reject_malformed(&sh, &msg, &e.to_string()).await,
            None => return reject_malformed(&sh, &msg, "no headers").await,
        };
        let Some(found) = sh.routes.route(&meta.name) else {
            return unserved(&sh, &msg, &meta).await;
        };
        let mut meta = meta;
        super::options::apply(&found.settings, &mut meta);
        let route = Route {
            handler: found.handler,
            name_slots: found.slots,
            heartbeat_timeout: found.settings.heartbeat_timeout(),
        };
        // Every delivery of one task here shares its hold and takes turns (inflight.rs).
        let entry = sh.inflight.enter(&meta.id);
        let held = &entry.slot.held;
        let work = AssertUnwindSafe(process(&sh, &msg, &meta, &route, permit, &entry.slot))
            .catch_unwind();
        tokio::select! {
            _ = heartbeat(&msg, sh.heartbeat, held) => {}
            done = work => if done.is_err() {
                // A bug in the SDK: hand the delivery back rather than hold it until the
                // ack wait.
                error!(subject = %msg.subject, "worker panicked while processing a delivery; handed back");
                reply(&msg, AckKind::Nak(Some(BROKER_RETRY))).await;
            },
        }
    });
}

/// The handler a delivery runs, its name's own slots if the name has a limit, and its
/// soft timeout if it has one.
struct Route<'a> {
    handler: &'a Handler,
    name_slots: Option<Arc<super::slots::Slots>>,
    heartbeat_timeout: Option<Duration>,
}

/// How long a task of a name this worker does not serve waits before it is offered again:
/// one second per delivery so far, at most [`UNSERVED_MAX_DELAY`] (a worker that serves it
/// may be starting; an unserved backlog must not keep the workers busy handing it back).
fn unserved_delay(delivered: i64) -> Duration {
    Duration::from_secs(delivered.clamp(1, UNSERVED_MAX_DELAY.as_secs() as i64) as u64)
}
const UNSERVED_MAX_DELAY: Duration = Duration::from_secs(30);

/// Hands back a delivery whose task name this worker has no handler for: it is not
/// failed and no attempt is counted; another worker (or this one, redeployed) takes it.
async fn unserved(sh: &Shared, msg: &jetstream::Message, meta: &TaskMeta) {
    let task = sh.labels.task(&meta.name);
    metrics::counter!(m::UNSERVED, "queue" => sh.queue.clone(), "task" => task).increment(1);
    debug!(task_id = %meta.id, name = %meta.name, "no handler for this task name here; handed back");
    if sh.labels.first_unserved(&meta.name) {
        warn!(name = %meta.name, queue = %sh.queue,
            "tasks named {:?} arrive but this worker serves no handler for them; handing them back (after 1 s, 2 s, ... at most {:?})",
            meta.name, UNSERVED_MAX_DELAY);
    }
    let delivered = msg.info().map_or(1, |i| i.delivered);
    reply(msg, AckKind::Nak(Some(unserved_delay(delivered)))).await;
}

/// Sends `+WPI` (AckProgress) every `every` for as long as the delivery is held, asking
/// the broker to confirm each.
async fn heartbeat(msg: &jetstream::Message, every: Duration, held: &Held) {
    loop {
        tokio::time::sleep(every).await;
        match msg.double_ack_with(AckKind::Progress).await {
            Ok(()) => held.confirmed(),
            Err(e) => debug!(cause = %e, "heartbeat not confirmed"),
        }
    }
}

async fn reply(msg: &jetstream::Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        warn!(cause = %e, ?kind, "could not answer the delivery; it will be redelivered");
    }
}

/// Counts a running handler in `ax_worker_busy_rate` for as long as it lives, whatever
/// way the handler ends (a panic included).
struct Busy<'a>(&'a Shared);

impl<'a> Busy<'a> {
    fn start(sh: &'a Shared) -> Busy<'a> {
        let busy = sh.running.fetch_add(1, Ordering::Relaxed) + 1;
        set_busy(sh, busy);
        Busy(sh)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let busy = self.0.running.fetch_sub(1, Ordering::Relaxed) - 1;
        set_busy(self.0, busy);
    }
}

fn set_busy(sh: &Shared, busy: usize) {
    metrics::gauge!(m::WORKER_BUSY_RATE, "queue" => sh.queue.clone())
        .set(busy as f64 / sh.concurrency as f64);
}

/// Header values may not hold line breaks; keep error text readable and bounded: control
/// characters become spaces, surrounding whitespace is trimmed (header values are trimmed
/// on the wire), at most 1024 characters.
pub(crate) fn header_safe(text: &str) -> String {
    let clean: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(1024)
        .collect();
    clean.trim().to_string()
}

async fn process(
    sh: &Shared,
    msg: &jetstream::Message,
    meta: &TaskMeta,
    route: &Route<'_>,
    permit: Option<OwnedSemaphorePermit>,
    slot: &Slot,
) {
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
    // A name with its own limit waits for one of its slots (keeping the worker slot).
    let _name_permit = match &route.name_slots {
        Some(slots) => tokio::select! {
            p = slots.acquire() => Some(p),
            _ = sh.shutdown.cancelled() => return reply(msg, AckKind::Nak(None)).await,
        },
        None => None,
    };
    // A redelivery of a task whose attempt still runs here waits for it to end.
    let _turn = match slot.turn.try_lock() {
        Ok(turn) => turn,
        Err(_) => {
            debug!(task_id = %meta.id, "redelivered while its attempt runs here; waiting for it");
            tokio::select! {
                turn = slot.turn.lock() => turn,
                _ = sh.shutdown.cancelled() => return reply(msg, AckKind::Nak(None)).await,
            }
        }
    };
    // Limits: tokens, then slots; over a limit the delivery goes back (no attempt counted).
    let delivered = msg.info().map_or(1, |i| i.delivered);
    let (limit_slots, start_at) = match sh.gate.admit(meta, delivered).await {
        Admit::Go { slots, start_at } => (slots, start_at),
        Admit::Wait {
            delay,
            reason,
            limit,
        } => {
            metrics::counter!(m::LIMIT_WAITS, "queue" => sh.queue.clone(), "limit" => limit.clone(),
                "reason" => reason.as_str())
            .increment(1);
            // The first two deliveries (the first may have met a gate still reading its limits)
            // and every 20th say why in the record.
            if delivered <= 2 || delivered % 20 == 0 {
                note_waiting(sh, meta, reason, &limit).await;
            }
            debug!(task_id = %meta.id, limit = %limit, reason = reason.as_str(), ?delay, "over a limit; handed back");
            return reply(msg, AckKind::Nak(Some(delay))).await;
        }
    };
    // A revision conflict means another writer moved the record: read it again and decide
    // anew. A few in a row only happen under contention; then hand the delivery back.
    for _ in 0..5 {
        let claiming = Instant::now();
        match claim(sh, meta, msg).await {
            Claim::Started(rec, token, deferred) => {
                #[cfg(feature = "test-hooks")]
                crate::hooks::slow_claim().await;
                // Under a rate: the handler starts when its token is due (the claim ran in
                // the gate's lead, which follows the claim times), so starts keep the
                // tokens' spacing.
                if start_at.is_some() {
                    sh.gate.observe_claim(claiming.elapsed());
                }
                if !start_when_due(sh, meta, &slot.cancel, start_at).await {
                    // Shut down while waiting: the attempt never started.
                    return reply(msg, AckKind::Nak(None)).await;
                }
                // An attempt that would start unwritten long after its claim read the
                // record (a rate token, a stalled process) writes `running` first: an
                // operator's cancel made meanwhile, whose signal this worker may have
                // missed, must not be outrun (`LATE_START`).
                let (rec, token, deferred) = match deferred && claiming.elapsed() > LATE_START {
                    false => (rec, token, deferred),
                    true => match late_start(sh, meta, msg, rec, token).await {
                        Claim::Started(rec, token, deferred) => (rec, token, deferred),
                        Claim::Again => continue,
                        Claim::Done => return,
                    },
                };
                let lost = Lost(&limit_slots);
                return run(sh, meta, route, msg, *rec, token, deferred, slot, lost).await;
            }
            Claim::Again => continue,
            Claim::Done => return,
        }
    }
    reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
}
