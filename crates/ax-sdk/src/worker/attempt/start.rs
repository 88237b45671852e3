//! Before the handler: claim the attempt (a compare-and-set on the record), wait for its
//! limits and its due time, note why it waits.

use crate::idempotency::Verdict;
use crate::limits::gate::{Gate, Reason};
use crate::metrics as m;
use crate::state::{StateError, TaskRecord, TaskState};
use crate::task::TaskMeta;
use crate::time::now_ms;
use crate::worker::claim::{decide, Decision, Delivery};
use async_nats::jetstream::{self, AckKind};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::finish::{dead_written, publish_dead_letter_and_term};
use super::shared::*;

/// Observes how long a task starting now waited for a limit (from its record's
/// `waiting.since_ms`).
pub(super) fn observe_limit_wait(sh: &Shared, found: Option<&(TaskRecord, u64)>) {
    if let Some(w) = found.and_then(|(rec, _)| rec.waiting.as_ref()) {
        metrics::histogram!(m::LIMIT_WAIT, "queue" => sh.queue.clone(), "limit" => w.limit.clone())
            .record(now_ms().saturating_sub(w.since_ms) as f64 / 1000.0);
    }
}

/// Writes why a task waits into its record (`waiting`), so an operator sees why it has
/// not started; cleared by the transition that starts it. Best effort.
pub(super) async fn note_waiting(sh: &Shared, meta: &TaskMeta, reason: Reason, limit: &str) {
    let (mut rec, rev) = match sh.tasks.get(&meta.id).await {
        Ok(Some(found)) => found,
        // Its first record was left to the worker (a deferred write) and is not made yet:
        // make it now, waiting, as the claim would (create-if-absent: a writer that won the
        // race keeps its record).
        // A keyed task's record is made only by its claim, after the key check
        // (`crate::idempotency::Keys::check`): a copy that lost its key must not get one.
        Ok(None) if meta.idempotency_key.is_some() => return,
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
pub(super) async fn start_when_due(
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

pub(super) enum Claim {
    /// Run this attempt.
    Started(Claimed),
    Again,
    Done,
}

/// An attempt claimed: its record, the token its outcome is written under, and whether
/// its `running` record is not written yet (a first attempt on its first delivery: see
/// [`first_delivery`]).
pub(super) struct Claimed {
    pub(super) rec: Box<TaskRecord>,
    pub(super) token: u64,
    pub(super) deferred: bool,
}

impl Claim {
    fn started(rec: Box<TaskRecord>, token: u64, deferred: bool) -> Claim {
        Claim::Started(Claimed {
            rec,
            token,
            deferred,
        })
    }
}

/// Reads the record and carries out [`decide`]'s decision. `after_lost_race`: an earlier
/// round lost a write to another writer of the record; it is read from the bucket's
/// leader, which has that writer's record, where a replica behind may not (read there
/// again, a claim whose create lost to its submitter's found no record five times over
/// and handed its delivery back for a second: the likely cause of one flow step started
/// 1,042 ms late in the flows' events bench on three nodes).
pub(super) async fn claim(
    sh: &Shared,
    meta: &TaskMeta,
    msg: &jetstream::Message,
    after_lost_race: bool,
) -> Claim {
    let delivered = msg.info().map_or(1, |i| i.delivered);
    let delivery = Delivery {
        seq: msg.info().map_or(0, |i| i.stream_sequence),
        worker: &sh.worker_id,
        now_ms: now_ms(),
        unrecorded_first: meta.unrecorded && delivered == 1,
    };
    // Read even on an unrecorded task's first delivery, where no record is expected: a
    // redelivery whose count a restarted nats-server lost looks like a first one, and the
    // read is what finds its outcome already stored (docs/DECISIONS.md: skipping it saved
    // nothing measurable).
    sh.faults.reading_record().await;
    let client = sh.js.client();
    let read = || async {
        match after_lost_race {
            true => sh.tasks.get_latest(&meta.id).await,
            false => sh.tasks.get(&meta.id).await,
        }
    };
    let found = match ax_core::follow::across_reconnects(&client, read).await {
        Ok(found) => found,
        Err(e) => {
            warn!(task_id = %meta.id, cause = %e, "cannot read record");
            reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
            return Claim::Done;
        }
    };
    // A keyed task without a record: its submit stored the message before the key, so
    // the key says which of the copies such submits may leave behind runs.
    if found.is_none() && meta.unrecorded && meta.idempotency_key.is_some() {
        let published_ms = msg.info().map_or(i128::from(now_ms()), |i| {
            i.published.unix_timestamp_nanos() / 1_000_000
        });
        // Run again whole after a reconnect: its create is followed by a read (see `check`).
        let check = || sh.keys.check(meta, published_ms);
        match ax_core::follow::across_reconnects(&client, check).await {
            Ok(Verdict::Run) => {}
            Ok(Verdict::Stray(named)) => {
                warn!(task_id = %meta.id, seq = delivery.seq, key_names = %named, "copy of a submit that lost its idempotency key retired");
                reply(msg, AckKind::Term).await;
                return Claim::Done;
            }
            Err(e) => {
                warn!(task_id = %meta.id, cause = %e, "cannot check idempotency key");
                reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
                return Claim::Done;
            }
        }
    }
    let revision = found.as_ref().map_or(0, |(_, rev)| *rev);
    // An operator's retry publishes its message, then moves the `dead` record to
    // `pending`: a delivery faster than that write waits for it (a bounded number of
    // times: if the write never comes, the retry was lost and the task stays dead).
    if let Some((rec, rev)) = &found {
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
        // An unrecorded immediate task's first delivery (a keyed one's after its key
        // check): its `running` record is created later (or never, if the attempt ends
        // within a second), create-if-absent (revision 0). An operator's cancel meanwhile
        // creates `cancelled` and signals this worker, which stops the attempt (or never
        // starts it: `Slot::start`, `LATE_START`). An unrecorded delayed task's is
        // created now (the last arm, CAS on 0): the dispatcher may have published its
        // ready message twice (killed between the publish and the delete, restarted after
        // the duplicate window), and the record naming this message is what retires the
        // other copy.
        Decision::Start { rec, lost: false } if found.is_none() && meta.run_at_ms.is_none() => {
            Claim::started(rec, 0, true)
        }
        Decision::Start { rec, lost: false }
            if sh.lean_first_attempt
                && first_delivery(found.as_ref().map(|(r, _)| r), msg, delivery.seq) =>
        {
            Claim::started(rec, revision, true)
        }
        Decision::Start { rec, lost: false }
            if retry_delivery(found.as_ref().map(|(r, _)| r), delivery.seq) =>
        {
            Claim::started(rec, revision, true)
        }
        Decision::Start { rec, lost } => match sh.tasks.cas(&rec, revision).await {
            Ok(token) => {
                if lost {
                    count_lost_heartbeat(sh, None);
                }
                Claim::started(rec, token, false)
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

/// Writes the `running` record of an attempt that was to start unwritten, now that its
/// start comes late ([`LATE_START`]): [`Claim::Started`] with its token (written), or
/// [`Claim::Again`] if the record moved (a cancel, another attempt), or [`Claim::Done`]
/// (answered) if the write failed otherwise.
pub(super) async fn late_start(
    sh: &Shared,
    meta: &TaskMeta,
    msg: &jetstream::Message,
    claimed: Claimed,
) -> Claim {
    let Claimed { mut rec, token, .. } = claimed;
    rec.updated_at_ms = now_ms();
    match sh.tasks.cas(&rec, token).await {
        Ok(token) => Claim::started(rec, token, false),
        Err(StateError::Stale { .. }) => {
            debug!(task_id = %meta.id, "record moved before a late start; claiming again");
            Claim::Again
        }
        Err(e) => {
            warn!(task_id = %meta.id, cause = %e, "cannot write running before a late start");
            reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
            Claim::Done
        }
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
pub(super) fn first_delivery(
    found: Option<&TaskRecord>,
    msg: &jetstream::Message,
    seq: u64,
) -> bool {
    let Some(rec) = found else { return false };
    let delivered = msg.info().map_or(0, |i| i.delivered);
    delivered == 1
        && rec.attempt == 0
        && rec.state == TaskState::Pending
        && rec.ready_seq == Some(seq)
}

/// True if this delivery is a retry of the message the last attempt ran from: the record
/// is `retrying` (written by that attempt's end, so it is over) and names this message.
/// Its attempt starts without writing `running` first, like a first attempt: the token is
/// the `retrying` revision until the write, made after a second or when the handler asks
/// for its token (docs/PROTOCOL.md §3 step 4, "retries").
pub(super) fn retry_delivery(found: Option<&TaskRecord>, seq: u64) -> bool {
    found.is_some_and(|rec| rec.state == TaskState::Retrying && rec.ready_seq == Some(seq))
}

/// How long a first attempt may run before its `running` record is written: states that
/// last longer than a second are visible in the record.
pub(crate) const FIRST_WRITE_AFTER: Duration = Duration::from_secs(1);

/// The attempt before this delivery stopped heartbeating (crash, pause, network).
pub(super) fn count_lost_heartbeat(sh: &Shared, running: Option<&TaskRecord>) {
    if running.is_some_and(|r| r.state != TaskState::Running) {
        return;
    }
    metrics::counter!(m::TIMEOUTS, "queue" => sh.queue.clone(), "kind" => "heartbeat").increment(1);
    metrics::gauge!(m::TASK_TIMEOUT_RATE, "queue" => sh.queue.clone()).set(sh.rate.record(true));
}
