//! One delivery of a task: claim the attempt, run the handler, record the outcome, ack.
//!
//! Every state write is a compare-and-set on the record revision this delivery read or
//! wrote, so a delivery that was overtaken (its worker paused past the ack wait and the
//! task went to another worker) has its result refused and does not ack. What the claim
//! does is decided by the pure [`claim::decide`](super::claim::decide).

use super::inflight::Slot;
use crate::limits::gate::Admit;
use crate::metrics as m;
use crate::task::TaskMeta;
use async_nats::jetstream::{self, AckKind};
use futures::FutureExt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::OwnedSemaphorePermit;
use tracing::{debug, error, warn};

mod end;
mod finish;
mod run;
mod shared;
mod start;

use finish::reject_malformed;
use run::run;
use shared::{heartbeat, reply, Lost, Route, BROKER_RETRY};
pub(crate) use shared::{Shared, LATE_START};
use start::{claim, late_start, note_waiting, start_when_due, Claim};

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
        if let Err(e) = meta.check_payload(&msg.payload) {
            return reject_malformed(&sh, &msg, &e.to_string()).await;
        }
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
    for round in 0..5 {
        let claiming = Instant::now();
        let connects = sh.reconnected.count();
        match claim(sh, meta, msg, round > 0).await {
            Claim::Started(claimed) => {
                sh.faults.claimed().await;
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
                // record (a rate token, a stalled process), or across a reconnect, writes
                // `running` first: an operator's cancel made meanwhile, whose signal this
                // worker may have missed, must not be outrun (`LATE_START`, `signals.rs`).
                let late =
                    claiming.elapsed() > LATE_START || sh.reconnected.around(claiming, connects);
                let claimed = match claimed.deferred && late {
                    false => claimed,
                    true => match late_start(sh, meta, msg, claimed).await {
                        Claim::Started(claimed) => claimed,
                        Claim::Again => continue,
                        Claim::Done => return,
                    },
                };
                let lost = Lost(&limit_slots);
                return run(sh, meta, route, msg, claimed, slot, lost).await;
            }
            Claim::Again => continue,
            Claim::Done => return,
        }
    }
    reply(msg, AckKind::Nak(Some(BROKER_RETRY))).await;
}
