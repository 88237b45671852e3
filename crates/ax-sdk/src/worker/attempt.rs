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

/// State shared by all attempts of one worker.
pub(crate) struct Shared {
    /// Rate limits and concurrency caps, checked before a claim.
    pub(crate) gate: Arc<crate::limits::gate::Gate>,
    pub(crate) js: jetstream::Context,
    pub(crate) tasks: TaskStore,
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
        if let Some(options) = found.options {
            options.apply(&mut meta);
        }
        let route = Route {
            handler: found.handler,
            name_slots: found.slots.cloned(),
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

/// The handler a delivery runs, and its name's own slots if the name has a limit.
struct Route<'a> {
    handler: &'a Handler,
    name_slots: Option<Arc<Semaphore>>,
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
            p = slots.clone().acquire_owned() => Some(p.expect("never closed")),
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
                let lost = Lost(&limit_slots);
                return run(
                    sh,
                    meta,
                    route.handler,
                    msg,
                    *rec,
                    token,
                    deferred,
                    slot,
                    lost,
                )
                .await;
            }
            Claim::Again => continue,
            Claim::Done => return,
        }
    }
    reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
}

/// Observes how long a task starting now waited for a limit (from its record's
/// `waiting.since_ms`).
fn observe_limit_wait(sh: &Shared, found: Option<&(TaskRecord, u64)>) {
    if let Some(w) = found.and_then(|(rec, _)| rec.waiting.as_ref()) {
        metrics::histogram!(m::LIMIT_WAIT, "queue" => sh.queue.clone(), "limit" => w.limit.clone())
            .record(now_ms().saturating_sub(w.since_ms) as f64 / 1000.0);
    }
}

/// Writes why a task waits into its record (`waiting`), so an operator sees why it has
/// not started; cleared by the transition that starts it. Best effort.
async fn note_waiting(sh: &Shared, meta: &TaskMeta, reason: Reason, limit: &str) {
    let (mut rec, rev) = match sh.tasks.get(&meta.id).await {
        Ok(Some(found)) => found,
        // Its first record was left to the worker (a deferred write) and is not made yet:
        // make it now, waiting, as the claim would (create-if-absent: a writer that won the
        // race keeps its record).
        Ok(None) => {
            let mut rec = meta.record().transition_at(TaskState::Pending, now_ms());
            rec.waiting = Some(crate::state::Waiting {
                reason: reason.as_str().to_string(),
                limit: limit.to_string(),
                since_ms: now_ms(),
            });
            let _ = sh.tasks.create(&rec).await;
            return;
        }
        Err(_) => return,
    };
    if rec.state.is_terminal() || rec.state == TaskState::Running {
        return;
    }
    let waiting = crate::state::Waiting {
        reason: reason.as_str().to_string(),
        limit: limit.to_string(),
        since_ms: rec.waiting.as_ref().map_or_else(now_ms, |w| w.since_ms),
    };
    if rec
        .waiting
        .as_ref()
        .is_some_and(|w| w.reason == waiting.reason && w.limit == waiting.limit)
    {
        return;
    }
    rec.waiting = Some(waiting);
    let _ = sh.tasks.cas(&rec, rev).await;
}

/// Waits until the handler of a claimed delivery may start. Under a rate, when its token
/// is due (`due`): a claim that outlasted the lead (a slow or restarting broker), or a
/// process that stalled while it waited, would start late, bunched with the starts due
/// after it, so the tokens are taken again; if none is due within the hold horizon (other
/// deliveries booked them), the delivery, claimed and kept alive by its heartbeat, asks
/// again when one will be. A task cancelled meanwhile ends `cancelled` without its handler
/// running. A rated delivery, held here for its token anyway, also waits out a pause
/// begun meanwhile (the claim ran in the lead, after the gate's pause check); one without
/// a rate starts at once, pause or not (a claimed attempt that waited through a pause was
/// lost with its worker, and the fault campaign's retried tasks, allowed one more attempt,
/// died of it). False if the worker shut down meanwhile.
async fn start_when_due(
    sh: &Shared,
    meta: &TaskMeta,
    cancel: &CancellationToken,
    mut due: Option<tokio::time::Instant>,
) -> bool {
    if due.is_none() {
        return true; // no rate applies
    }
    loop {
        if let Some(at) = due.filter(|&at| !Gate::too_late(at)) {
            tokio::time::sleep_until(at).await;
        }
        let on_time = due.is_some_and(|at| !Gate::too_late(at));
        if (on_time && !sh.gate.paused()) || cancel.is_cancelled() {
            return true;
        }
        if sh.gate.paused() {
            // Its token is given up: another is taken after the resume.
            debug!(task_id = %meta.id, "held for a rate token, then its queue was paused; waiting for the resume");
            tokio::select! {
                _ = sh.gate.wait_unpaused() => {}
                _ = cancel.cancelled() => return true,
                _ = sh.shutdown.cancelled() => return false,
            }
        }
        due = match sh.gate.retime(meta).await {
            Ok(next) => Some(next),
            Err(delay) => {
                debug!(task_id = %meta.id, ?delay, "claimed late and no rate token within the hold horizon; waiting for one");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => None,
                    _ = cancel.cancelled() => return true,
                    _ = sh.shutdown.cancelled() => return false,
                }
            }
        };
    }
}

enum Claim {
    /// Run the attempt of this record under this token; `true` if its `running` record is
    /// not written yet (a first attempt on its first delivery: see [`first_delivery`]).
    Started(Box<TaskRecord>, u64, bool),
    Again,
    Done,
}

/// Reads the record and carries out [`decide`]'s decision.
async fn claim(sh: &Shared, meta: &TaskMeta, msg: &jetstream::Message) -> Claim {
    let delivery = Delivery {
        seq: msg.info().map_or(0, |i| i.stream_sequence),
        worker: &sh.worker_id,
        now_ms: now_ms(),
    };
    let found = match sh.tasks.get(&meta.id).await {
        Ok(found) => found,
        Err(e) => {
            warn!(task_id = %meta.id, cause = %e, "cannot read record");
            reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
            return Claim::Done;
        }
    };
    let revision = found.as_ref().map_or(0, |(_, rev)| *rev);
    // An operator's retry publishes its message, then moves the `dead` record to
    // `pending`: a delivery faster than that write waits for it (a bounded number of
    // times: if the write never comes, the retry was lost and the task stays dead).
    if let Some((rec, rev)) = &found {
        let delivered = msg.info().map_or(1, |i| i.delivered);
        if rec.state == TaskState::Dead && meta.retry_of == Some(*rev) && delivered < RETRY_WAITS {
            debug!(task_id = %meta.id, "retry delivered before its record moved; waiting");
            reply(msg, AckKind::Nak(Some(Duration::from_millis(200)))).await;
            return Claim::Done;
        }
    }
    let decision = decide(found.as_ref().map(|(rec, _)| rec), meta, delivery);
    if matches!(decision, Decision::Start { .. }) {
        observe_limit_wait(sh, found.as_ref());
    }
    match decision {
        Decision::Create(rec) => match sh.tasks.create(&rec).await {
            Ok(_) | Err(StateError::Exists(_)) => Claim::Again,
            Err(e) => {
                warn!(task_id = %meta.id, cause = %e, "cannot create record");
                reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
                Claim::Done
            }
        },
        Decision::AckDuplicate => {
            reply(msg, AckKind::Ack).await;
            Claim::Done
        }
        Decision::AckCancelled => {
            debug!(task_id = %meta.id, "cancelled task not run");
            reply(msg, AckKind::Ack).await;
            Claim::Done
        }
        Decision::Cancel(cancelled) => match sh.tasks.cas(&cancelled, revision).await {
            Ok(_) => {
                info!(task_id = %meta.id, "cancelled while its worker was away; not run");
                reply(msg, AckKind::Ack).await;
                Claim::Done
            }
            Err(StateError::Stale { .. }) => Claim::Again,
            Err(e) => {
                warn!(task_id = %meta.id, cause = %e, "cannot write cancelled");
                reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
                Claim::Done
            }
        },
        Decision::FinishDead(error) => {
            let rec = found.map(|(rec, _)| rec).expect("dead implies a record");
            publish_dead_letter_and_term(sh, meta, msg, &rec, &error).await;
            Claim::Done
        }
        Decision::RetireStray => {
            warn!(task_id = %meta.id, seq = delivery.seq, "duplicate task message retired");
            reply(msg, AckKind::Term).await;
            Claim::Done
        }
        Decision::Dead(dead) => {
            count_lost_heartbeat(sh, found.as_ref().map(|(r, _)| r));
            match sh.tasks.cas(&dead, revision).await {
                Ok(_) => {
                    let error = dead.last_error.clone().expect("dead has an error");
                    dead_written(sh, meta, &dead, &error);
                    publish_dead_letter_and_term(sh, meta, msg, &dead, &error).await;
                    Claim::Done
                }
                Err(StateError::Stale { .. }) => Claim::Again,
                Err(e) => {
                    warn!(task_id = %meta.id, cause = %e, "cannot write dead");
                    reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
                    Claim::Done
                }
            }
        }
        Decision::Start { rec, lost: false }
            if sh.lean_first_attempt
                && first_delivery(found.as_ref().map(|(r, _)| r), msg, delivery.seq) =>
        {
            Claim::Started(rec, revision, true)
        }
        Decision::Start { rec, lost } => match sh.tasks.cas(&rec, revision).await {
            Ok(token) => {
                if lost {
                    count_lost_heartbeat(sh, None);
                }
                Claim::Started(rec, token, false)
            }
            Err(StateError::Stale { .. }) => Claim::Again,
            Err(e) => {
                warn!(task_id = %meta.id, cause = %e, "cannot claim attempt");
                reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
                Claim::Done
            }
        },
    }
}

/// True if this delivery may start its attempt without writing `running` first: the
/// task's first attempt (the record was never claimed: `pending`, attempt 0) on the first
/// delivery of the very message the record names (`ready_seq`, set at submit). A copy of
/// the message (a delayed task dispatched again after a restart, say) is never started
/// this way, so it cannot run beside an unwritten first attempt: delayed tasks, whose
/// records name no message, always write `running` first. Its fencing token
/// is then the revision the record was created with; an attempt that lasts longer than
/// [`FIRST_WRITE_AFTER`] (or a heartbeat) writes `running` then. Any later delivery (a
/// redelivery after a lost attempt, a retry) writes `running` before it starts, so its
/// token is larger and a stale first attempt cannot record a result (docs/PROTOCOL.md §3).
fn first_delivery(found: Option<&TaskRecord>, msg: &jetstream::Message, seq: u64) -> bool {
    let Some(rec) = found else { return false };
    let delivered = msg.info().map_or(0, |i| i.delivered);
    delivered == 1
        && rec.attempt == 0
        && rec.state == TaskState::Pending
        && rec.ready_seq == Some(seq)
}

/// How long a first attempt may run before its `running` record is written: states that
/// last longer than a second are visible in the record.
pub(crate) const FIRST_WRITE_AFTER: Duration = Duration::from_secs(1);

/// The attempt before this delivery stopped heartbeating (crash, pause, network).
fn count_lost_heartbeat(sh: &Shared, running: Option<&TaskRecord>) {
    if running.is_some_and(|r| r.state != TaskState::Running) {
        return;
    }
    metrics::counter!(m::TIMEOUTS, "queue" => sh.queue.clone(), "kind" => "heartbeat").increment(1);
    metrics::gauge!(m::TASK_TIMEOUT_RATE, "queue" => sh.queue.clone()).set(sh.rate.record(true));
}

#[allow(clippy::too_many_arguments)]
/// The concurrency slots an attempt holds: lost if any is found lost.
#[derive(Clone, Copy)]
struct Lost<'a>(&'a [crate::limits::gate::Slot]);

impl Lost<'_> {
    /// Waits until a slot is found lost (forever if none is held).
    async fn wait(self) {
        if self.0.is_empty() {
            return std::future::pending().await;
        }
        futures::future::select_all(self.0.iter().map(|s| Box::pin(s.lost().cancelled()))).await;
    }

    fn is_lost(self) -> bool {
        self.0.iter().any(|s| s.lost().is_cancelled())
    }
}

#[allow(clippy::too_many_arguments)]
async fn run(
    sh: &Shared,
    meta: &TaskMeta,
    handler: &Handler,
    msg: &jetstream::Message,
    rec: TaskRecord,
    token: u64,
    deferred: bool,
    slot: &Slot,
    lost: Lost<'_>,
) {
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
        cancel: slot.cancel.clone(),
    };
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
    let input_bytes = msg.payload.len();
    let started = Instant::now();
    let outcome = {
        let _busy = Busy::start(sh);
        let handler =
            AssertUnwindSafe(tracing::Instrument::instrument(handler(task), span.clone()))
                .catch_unwind();
        let mut attempt = std::pin::pin!(async {
            // Biased: a task cancelled (or a slot lost) before its start, while it waited
            // for its token or a resume, never has its handler polled.
            tokio::select! {
                biased;
                _ = sh.hard_stop.cancelled() => None,
                _ = slot.cancel.cancelled() => None,
                _ = lost.wait() => None,
                r = tokio::time::timeout(meta.timeout, handler) => Some(r),
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
    log_attempt(
        &span,
        &outcome,
        (slot, lost),
        started.elapsed(),
        input_bytes,
    );
    // The revision the outcome is written against (the `running` write's, if made).
    let token = fence.revision().await;
    metrics::histogram!(m::RUN_DURATION, "queue" => queue.clone(), "task" => task_label.clone())
        .record(started.elapsed().as_secs_f64());
    match outcome {
        Some(Ok(Ok(Ok(Output(Some(out)))))) if out.bytes.len() > MAX_OUTPUT_BYTES => {
            let e = TaskError::permanent(
                "output_too_large",
                format!(
                    "the output is {} bytes; at most {MAX_OUTPUT_BYTES} are stored",
                    out.bytes.len()
                ),
            );
            fail(sh, meta, msg, rec, token, e, false, held).await
        }
        Some(Ok(Ok(Ok(output)))) => {
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
        Some(Ok(Ok(Err(e)))) => fail(sh, meta, msg, rec, token, e, false, held).await,
        Some(Ok(Err(panic))) => {
            let what = crate::error::panic_text(panic.as_ref());
            warn!(task_id = %meta.id, cause = %what, "handler panicked; the attempt failed");
            let e = TaskError::new("panic", what);
            fail(sh, meta, msg, rec, token, e, false, held).await;
        }
        Some(Err(_elapsed)) => {
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
        None => {
            let attempt = rec.attempt;
            let end = if slot.cancel.is_cancelled() {
                End::Cancelled
            } else if lost.is_lost() {
                End::SlotLost
            } else {
                End::Shutdown
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

/// Runs `op` (a write for task `id`), retrying errors that `retry` accepts with backoff
/// (100 ms doubling to 1 s) for as long as the delivery is still ours: until an ack wait
/// (less one heartbeat) has passed since the broker last confirmed it, so a broker outage
/// shorter than that does not run a finished task again. Returns the last error otherwise.
async fn while_held<T, E, Fut>(
    sh: &Shared,
    held: &Held,
    id: &str,
    what: &str,
    mut op: impl FnMut() -> Fut,
    retry: impl Fn(&E) -> bool,
) -> Result<T, E>
where
    E: std::fmt::Display,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let keep_trying = sh.ack_wait.saturating_sub(sh.heartbeat);
    let mut pause = Duration::from_millis(100);
    loop {
        match op().await {
            Err(e) if retry(&e) && held.since() < keep_trying => {
                warn!(task_id = %id, cause = %e, "{what} failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(BROKER_RETRY);
            }
            Err(e) if retry(&e) => {
                warn!(task_id = %id, cause = %e,
                    "{what} failed for longer than the ack wait allows; the task will be redelivered");
                return Err(e);
            }
            done => return done,
        }
    }
}

/// Writes `rec` under `token`, retrying broker failures while the delivery is ours (see
/// [`while_held`]). False if the token is stale (another attempt took over: the result is
/// refused) or the delivery was lost meanwhile (it will be redelivered).
async fn write(sh: &Shared, rec: &TaskRecord, token: u64, held: &Held) -> bool {
    let stale = |e: &StateError| matches!(e, StateError::Stale { .. });
    let cas = || sh.tasks.cas(rec, token);
    match while_held(sh, held, &rec.id, "state write", cas, |e| !stale(e)).await {
        Ok(_) => true,
        Err(e) if stale(&e) => {
            metrics::counter!(m::STALE_RESULTS, "queue" => sh.queue.clone()).increment(1);
            warn!(task_id = %rec.id, attempt = rec.attempt, state = %rec.state,
                "result refused: another attempt took over (stale fencing token)");
            false
        }
        Err(_) => false,
    }
}

/// The trace id of a W3C `traceparent` (its second field).
fn trace_id(traceparent: &str) -> &str {
    traceparent.split('-').nth(1).unwrap_or("")
}

type Outcome = Option<
    Result<
        Result<Result<Output, TaskError>, Box<dyn std::any::Any + Send>>,
        tokio::time::error::Elapsed,
    >,
>;

/// One log line per finished attempt (target `ax_sdk::attempt`, in the task's span): outcome,
/// error class, duration, input and output sizes.
fn log_attempt(
    span: &tracing::Span,
    outcome: &Outcome,
    (slot, lost): (&Slot, Lost<'_>),
    took: std::time::Duration,
    input_bytes: usize,
) {
    let (result, class, output_bytes) = match outcome {
        Some(Ok(Ok(Ok(Output(out))))) => {
            ("succeeded", "", out.as_ref().map_or(0, |o| o.bytes.len()))
        }
        Some(Ok(Ok(Err(e)))) => ("failed", e.class.as_str(), 0),
        Some(Ok(Err(_))) => ("failed", "panic", 0),
        Some(Err(_)) => ("failed", "timeout", 0),
        None if slot.cancel.is_cancelled() => ("cancelled", "", 0),
        None if lost.is_lost() => ("stopped", "slot_lost", 0),
        None => ("handed_back", "shutdown", 0),
    };
    info!(target: "ax_sdk::attempt", parent: span, outcome = result, class,
        duration_ms = took.as_millis() as u64, input_bytes, output_bytes, "attempt finished");
}

/// Counts a failed attempt of a task name in a row, or ends the run of failures with a
/// success: the gauge `ax_task_consecutive_failures{queue, task}` of this worker.
fn streak(sh: &Shared, task_label: &str, failed: bool) {
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
async fn put_output(sh: &Shared, id: &str, key: &str, bytes: bytes::Bytes, held: &Held) -> bool {
    let put = || sh.results.put(key, bytes.clone());
    while_held(sh, held, id, "output write", put, |_| true)
        .await
        .is_ok()
}

#[allow(clippy::too_many_arguments)]
async fn fail(
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
fn ack_kind(after: After) -> AckKind {
    match after {
        After::Nak(delay) => AckKind::Nak(delay),
        After::Ack | After::DeadLetter => AckKind::Ack,
    }
}

fn dead_written(sh: &Shared, meta: &TaskMeta, dead: &TaskRecord, error: &ErrorInfo) {
    metrics::counter!(m::DEAD, "queue" => sh.queue.clone(), "task" => sh.labels.task(&meta.name))
        .increment(1);
    error!(task_id = %meta.id, queue = %meta.queue, class = %error.class,
        cause = %error.message, attempts = dead.attempt, "task dead");
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
async fn reject_malformed(sh: &Shared, msg: &jetstream::Message, why: &str) {
    error!(subject = %msg.subject, cause = why, "malformed task message; dead-lettered");
    let mut headers = msg.headers.clone().unwrap_or_default();
    headers.insert(header::ERROR_CLASS, "bad_message");
    headers.insert(header::ERROR_MESSAGE, header_safe(why).as_str());
    dead_letter_and_term(sh, names::dead_subject(&sh.queue), msg, headers).await;
}

/// Stores the delivery's payload in `AX_DEAD` with `headers`, then Terms the delivery; if
/// the dead letter is not acknowledged, naks it instead so a redelivery tries again.
async fn dead_letter_and_term(
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
const MAX_DETAIL: usize = 8 * 1024;

/// `s` cut to at most `max` bytes, at a character boundary.
fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
