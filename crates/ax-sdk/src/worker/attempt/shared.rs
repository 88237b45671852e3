//! What every attempt of one worker shares, and the small helpers each step uses.

use crate::metrics as m;
use crate::output::ResultStore;
use crate::state::{StateError, TaskRecord, TaskStore};
use crate::worker::handler::Handler;
use crate::worker::inflight::{Held, InFlight};
use crate::worker::labels::Labels;
use crate::worker::options::Routes;
use crate::worker::rate::TimeoutRate;
use async_nats::jetstream::{self, AckKind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

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
    /// See [`WorkerBuilder::lean_first_attempt`](crate::worker::WorkerBuilder::lean_first_attempt).
    pub(crate) lean_first_attempt: bool,
    /// The tasks held here now: one attempt of a task at a time.
    pub(crate) inflight: Arc<InFlight>,
    /// Failed attempts in a row per task name (`ax_task_consecutive_failures`).
    pub(crate) streaks: std::sync::Mutex<std::collections::HashMap<String, u64>>,
    /// Faults a test armed (a slower claim); none by default.
    pub(crate) faults: crate::faults::Faults,
    /// Reconnects of the client, across which a cancel signal may be lost.
    pub(crate) reconnected: crate::worker::signals::Reconnected,
}

/// Deliveries of an operator's retry that wait for its record write (200 ms apart).
pub(super) const RETRY_WAITS: i64 = 25;

/// An attempt that would start without its `running` write more than this long after its
/// claim read the record writes it first. Shorter than the wait of an operator's cancel
/// for the holder's answer (`ax-server`'s `ops::holder::HOLDER_WAIT`, 500 ms): a cancel
/// answered without one was made more than this before any such start, so the write
/// sees it.
pub(crate) const LATE_START: Duration = Duration::from_millis(250);

/// Retry pause when the broker cannot be reached for a state read or write.
pub(super) const BROKER_RETRY: Duration = Duration::from_secs(1);

/// The handler a delivery runs, its name's own slots if the name has a limit, and its
/// soft timeout if it has one.
pub(super) struct Route<'a> {
    pub(super) handler: &'a Handler,
    pub(super) name_slots: Option<Arc<crate::worker::slots::Slots>>,
    pub(super) heartbeat_timeout: Option<Duration>,
}

/// Sends `+WPI` (AckProgress) every `every` for as long as the delivery is held, asking
/// the broker to confirm each.
pub(super) async fn heartbeat(msg: &jetstream::Message, every: Duration, held: &Held) {
    loop {
        tokio::time::sleep(every).await;
        match msg.double_ack_with(AckKind::Progress).await {
            Ok(()) => held.confirmed(),
            Err(e) => debug!(cause = %e, "heartbeat not confirmed"),
        }
    }
}

pub(super) async fn reply(msg: &jetstream::Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        warn!(cause = %e, ?kind, "could not answer the delivery; it will be redelivered");
    }
}

/// Counts a running handler in `ax_worker_busy_rate` for as long as it lives, whatever
/// way the handler ends (a panic included).
pub(super) struct Busy<'a>(&'a Shared);

impl<'a> Busy<'a> {
    pub(super) fn start(sh: &'a Shared) -> Busy<'a> {
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

/// The concurrency slots an attempt holds: lost if any is found lost.
#[derive(Clone, Copy)]
pub(super) struct Lost<'a>(pub(super) &'a [crate::limits::gate::Slot]);

impl Lost<'_> {
    /// Waits until a slot is found lost (forever if none is held).
    pub(super) async fn wait(self) {
        if self.0.is_empty() {
            return std::future::pending().await;
        }
        futures::future::select_all(self.0.iter().map(|s| Box::pin(s.lost().cancelled()))).await;
    }

    pub(super) fn is_lost(self) -> bool {
        self.0.iter().any(|s| s.lost().is_cancelled())
    }
}

/// Runs `op` (a write for task `id`), retrying errors that `retry` accepts with backoff
/// (100 ms doubling to 1 s) for as long as the delivery is still ours: until an ack wait
/// (less one heartbeat) has passed since the broker last confirmed it, so a broker outage
/// shorter than that does not run a finished task again. Returns the last error otherwise.
pub(super) async fn while_held<T, E, Fut>(
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
pub(super) async fn write(sh: &Shared, rec: &TaskRecord, token: u64, held: &Held) -> bool {
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
