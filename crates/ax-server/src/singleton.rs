//! Singleton keys at submit (docs/PROTOCOL.md §2, "Singleton keys";
//! [`ax_core::singleton`]): a submit claims its key in `AX_IDEMPOTENCY` before it stores
//! its task; a key held by a task that has not ended refuses the submit (`cancel_new`) or
//! has that task cancelled first (`cancel_in_progress`).
//!
//! The key names its task; the task's state decides. A key is created, or taken over from
//! a task that has ended (or that no one stored within [`GRACE`]) by a compare-and-set on
//! its revision: of two submits racing for one key, one wins and the other looks again.
//! A singleton task is stored with its record, so a collision finds its state with one
//! read. Above `submit` and `ops`: cancelling the holder is a task operation; below
//! `intake`, the entry of every single submit.

use crate::ops::actions::Ops;
use crate::ops::stop::Stopping;
use async_nats::jetstream::kv::Operation;
use ax_core::protocol::{ErrorCode, SubmitAccepted, WireError};
use ax_core::singleton::{Collision, Holder, Singleton, GRACE};
use ax_core::task::TaskMeta;
use bytes::Bytes;
use std::time::Duration;
use tracing::{debug, info, warn};

/// How long a submit keeps trying to claim a contended key before it answers
/// `unavailable`.
const CLAIM_FOR: Duration = Duration::from_secs(30);
/// Pause before looking at a key again (its holder not stored yet, or a lost race).
const AGAIN_AFTER: Duration = Duration::from_millis(50);

/// What looking at a held key decided.
enum Collided {
    /// The key is this submit's now, at this revision.
    Taken(u64),
    /// Answer this (a retry of the holder's own submit: its idempotency key).
    Answer(SubmitAccepted),
    /// Look at the key again.
    Again,
}

pub(crate) async fn submit_singleton(
    ops: &Ops,
    s: &Singleton,
    meta: TaskMeta,
    payload: Bytes,
) -> Result<SubmitAccepted, WireError> {
    let ctx = &ops.ctx;
    ctx.queues.check(&ctx.js, &meta.queue).await?;
    let kv_key = s.kv_key(&meta.queue);
    let idempotency_key = meta.idempotency_key.clone();
    let holder = |task_id: &str| {
        Holder {
            task_id: task_id.to_string(),
            idempotency_key: idempotency_key.clone(),
        }
        .encode()
    };
    let id = holder(&meta.id);
    let until = tokio::time::Instant::now() + CLAIM_FOR;
    let revision = loop {
        if tokio::time::Instant::now() > until {
            return Err(WireError::unavailable(format!(
                "singleton key {} stayed contended for {CLAIM_FOR:?}: retry",
                s.key
            )));
        }
        match ctx.idempotency.create(&kv_key, id.clone()).await {
            Ok(revision) => break revision,
            Err(e) if ax_core::state::create_lost(&e) => {}
            Err(e) => return Err(WireError::unavailable(e)),
        }
        match collide(ops, s, &kv_key, &meta).await? {
            Collided::Taken(revision) => break revision,
            Collided::Answer(accepted) => return Ok(accepted),
            Collided::Again => tokio::time::sleep(AGAIN_AFTER).await,
        }
    };
    ctx.faults.pass(ax_core::faults::Abort::AfterClaim);
    let claimed = meta.id.clone();
    match ctx.submit_prepared(meta, payload).await {
        Ok(accepted) if accepted.id == claimed => Ok(accepted),
        Ok(accepted) => {
            // Its idempotency key named another task: that one holds the singleton key.
            let named = holder(&accepted.id);
            if let Err(e) = ctx.idempotency.update(&kv_key, named, revision).await {
                debug!(key = %kv_key, cause = %e, "singleton key not moved to the task an idempotency key named");
            }
            Ok(accepted)
        }
        Err(e) => {
            // A definite refusal stored nothing: free the key. After `unavailable` the
            // task may be stored; the key stays (it names the task, or expires by GRACE).
            if e.code != ErrorCode::Unavailable {
                if let Err(cause) = ctx
                    .idempotency
                    .delete_expect_revision(&kv_key, Some(revision))
                    .await
                {
                    debug!(key = %kv_key, %cause, "singleton key of a refused submit not freed; it frees itself after its grace");
                }
            }
            Err(e)
        }
    }
}

/// Looks at a key that a create found taken: takes it over from a task that has ended,
/// refuses or cancels one that has not.
async fn collide(
    ops: &Ops,
    s: &Singleton,
    kv_key: &str,
    meta: &TaskMeta,
) -> Result<Collided, WireError> {
    let ctx = &ops.ctx;
    let entry = ax_core::kv_read::latest(&ctx.idempotency, kv_key)
        .await
        .map_err(WireError::unavailable)?;
    let Some(entry) = entry else {
        return Ok(Collided::Again);
    };
    if entry.operation == Operation::Put {
        let Holder {
            task_id: holder,
            idempotency_key: holder_key,
        } = Holder::decode(&entry.value);
        // An earlier attempt of this very submit (its retry: the same idempotency key)
        // that is not stored: taken over at once. Should that attempt still store its
        // task, the idempotency key makes one of the two the other's duplicate.
        let own_attempt = holder_key.is_some() && holder_key == meta.idempotency_key;
        let mut found = ctx
            .tasks
            .get_latest(&holder)
            .await
            .map_err(WireError::unavailable)?;
        let age = ax_core::time::now_ms()
            .saturating_sub(entry.created.unix_timestamp_nanos() as u64 / 1_000_000);
        if found.is_none() && u128::from(age) >= GRACE.as_millis() {
            // Stored without its record (its server died between the two writes, or the
            // record write failed): then its message is the task (PROTOCOL.md §4).
            found = ctx
                .tasks
                .find(&holder)
                .await
                .map_err(WireError::unavailable)?;
        }
        let alive = match &found {
            Some((rec, _)) => !rec.state.is_terminal(),
            // Its submit may be storing it now.
            None => u128::from(age) < GRACE.as_millis() && !own_attempt,
        };
        if alive {
            if let (Some(key), Some((rec, _))) = (&meta.idempotency_key, &found) {
                if rec.idempotency_key.as_ref() == Some(key) {
                    return Ok(Collided::Answer(SubmitAccepted {
                        id: holder,
                        duplicate: true,
                        state: rec.state,
                    }));
                }
            }
            let state = found
                .as_ref()
                .map_or("being stored", |(rec, _)| rec.state.as_str());
            match s.on_collision {
                Collision::CancelNew => {
                    let mut e = WireError::new(
                        ErrorCode::Running,
                        format!(
                            "singleton key {} is held by task {holder} ({state}); on_collision cancel_new refuses this task",
                            s.key
                        ),
                    );
                    e.task_id = Some(holder);
                    return Err(e);
                }
                // Cancel it once its submit has stored it.
                Collision::CancelInProgress if found.is_none() => return Ok(Collided::Again),
                Collision::CancelInProgress => {
                    let by = format!("singleton:{}", s.key);
                    // Until it is stopped (or ended meanwhile): a cancel answered while
                    // the task moved on is made again.
                    match ops.cancel_until_stopped(&holder, &by).await? {
                        Stopping::Stopped => {
                            info!(task_id = %holder, by, "task cancelled: a new task took its singleton key")
                        }
                        Stopping::Live => warn!(task_id = %holder, by,
                            "task still live after its cancels; a new task takes its singleton key anyway"),
                    }
                }
            }
        }
    }
    match ctx
        .idempotency
        .update(
            kv_key,
            Holder {
                task_id: meta.id.clone(),
                idempotency_key: meta.idempotency_key.clone(),
            }
            .encode(),
            entry.revision,
        )
        .await
    {
        Ok(revision) => Ok(Collided::Taken(revision)),
        Err(e) => {
            // Another submit changed the key first (or no answer): look again.
            debug!(key = %kv_key, cause = %e, "singleton key changed while being taken over; looking again");
            Ok(Collided::Again)
        }
    }
}
