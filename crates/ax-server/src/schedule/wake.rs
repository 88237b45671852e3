//! A flow's wait task (header `Ax-Wait`, docs/PROTOCOL.md §6 "Waits") when its delayed
//! message is due: no worker runs it. A sleep's record is moved to `succeeded`; a wait
//! for an event that no event ended has timed out: `dead` (class `wait_timed_out`), or
//! `succeeded` with no output for `event-or-null`. Each by compare-and-set (read again
//! on a lost race, so two servers dispatching the same message, or the matcher and a
//! timeout, end it once), then its delayed message is deleted. Killed in between, the
//! message is dispatched again and finds the record ended: only the delete is left to do.
//! A wait that ended meanwhile (an event, the run's cancel) keeps its record. A wait whose
//! record does not exist yet (the submit stores the message first, and may die before the
//! record) gets the record its message stands for, created here, and ends.
//!
//! A wait for an event times out only once the matcher (`event_wait`) has removed its
//! registration: it does so when it has read every event stored up to the timeout (and
//! ended the wait by its timeout's policy, or by the event that matched). Until then the message is
//! refused and retried with backoff, so an event stored in time is never lost to a
//! matcher that was down or behind when the timeout came (the R3 fault campaign found
//! one timed out 8.4 s after its event was stored, the matcher stalled on the broker).

use super::outcome::Outcome;
use ax_core::admit::delete_delayed;
use ax_core::event::OnTimeout;
use ax_core::names::DELAYED_STREAM;
use ax_core::state::ErrorInfo;
use ax_core::state::TaskStore;
use ax_core::task::{header, Wait};
use ax_core::waits::Waits;
use tracing::{debug, warn};

/// The error class of a child flow's wait that timed out (the flow engine then cancels
/// the child run).
pub(crate) const CHILD_TIMED_OUT: &str = "child_timed_out";

/// The group that waits for events due while the matcher holds them park in: one of them
/// is tried again at a time, with backoff, and the rest follow once it goes through.
const MATCHER_BEHIND: &str = "(wake: matcher behind)";

/// Ends the wait task stored at `seq` of `AX_DELAYED` (`wait`: its `Ax-Wait` value).
pub(super) async fn wake(
    js: &async_nats::jetstream::Context,
    tasks: &TaskStore,
    waits: &Waits,
    seq: u64,
    due: u64,
    wait: &str,
    headers: &async_nats::HeaderMap,
) -> Outcome {
    let Some(id) = headers.get(header::ID).map(|v| v.as_str().to_string()) else {
        warn!(
            seq,
            "wait task without Ax-Task-Id in {DELAYED_STREAM}; left in place"
        );
        return Outcome::Bad;
    };
    let Some(kind) = Wait::parse(wait) else {
        warn!(seq, task_id = %id, wait, "wait task of a kind this server does not know; left in place");
        return Outcome::Bad;
    };
    if let Wait::Event(_) = kind {
        let refused = |group: &str| Outcome::Refused {
            group: group.into(),
            due,
            seq,
            body: None,
        };
        match waits.registered(&id).await {
            Ok(false) => {}
            Ok(true) => {
                debug!(task_id = %id, "wait for an event due, its registration still held by the matcher; retried");
                return refused(MATCHER_BEHIND);
            }
            Err(e) => {
                debug!(task_id = %id, cause = %e, "wait for an event due, its registration not read; retried");
                return refused("(wake)");
            }
        }
    }
    let mut ended = end(tasks, &id, kind).await;
    if let Ok(None) = ended {
        // No record yet: its submit stores the message first and the record after (or
        // died in between, and no worker will ever claim a wait task). The record the
        // message stands for is created here (the submit's own create then finds it),
        // and the wait ended as due.
        ended = match create_from(tasks, headers, seq).await {
            Ok(()) => end(tasks, &id, kind).await,
            Err(e) => Err(e),
        };
    }
    match ended {
        Ok(Some(state)) => debug!(task_id = %id, %state, wait, "wait ended by its time"),
        Ok(None) => warn!(task_id = %id, "wait without a record; its message is dropped"),
        Err(e) => {
            debug!(task_id = %id, cause = %e, "wait not ended yet; retried");
            return Outcome::Refused {
                group: "(wake)".into(),
                due,
                seq,
                body: None,
            };
        }
    }
    if let Err(e) = delete_delayed(js, seq).await {
        debug!(seq, cause = %e, "ended wait's message not deleted; dispatched again, it finds the wait ended");
    }
    metrics::counter!(ax_core::metrics::DELAYED_DISPATCHED).increment(1);
    Outcome::Gone
}

/// Ends wait task `id` as its kind says when its time has come (also a run-now of it:
/// `ops::actions`).
pub(crate) async fn end(
    tasks: &TaskStore,
    id: &str,
    kind: Wait,
) -> Result<Option<ax_core::state::TaskState>, ax_core::state::StateError> {
    Ok(end_record(tasks, id, kind).await?.map(|rec| rec.state))
}

/// [`end`], answering the record as it stands after (`None`: no record).
pub(crate) async fn end_record(
    tasks: &TaskStore,
    id: &str,
    kind: Wait,
) -> Result<Option<ax_core::state::TaskRecord>, ax_core::state::StateError> {
    let ended = match kind {
        Wait::Sleep
        | Wait::Event(OnTimeout::Continue)
        | Wait::Approval(OnTimeout::Continue)
        | Wait::Flow(OnTimeout::Continue) => tasks.succeed_unstarted(id, None).await,
        Wait::Event(OnTimeout::Fail) => {
            let error = ErrorInfo {
                detail: None,
                class: "wait_timed_out".into(),
                message: "no matching event came before the wait's timeout".into(),
            };
            tasks.fail_unstarted(id, error).await
        }
        Wait::Approval(OnTimeout::Fail) => {
            let error = ErrorInfo {
                detail: None,
                class: crate::approval::TIMED_OUT.into(),
                message: "no one approved or rejected before the approval's timeout".into(),
            };
            tasks.fail_unstarted(id, error).await
        }
        Wait::Flow(OnTimeout::Fail) => {
            let error = ErrorInfo {
                detail: None,
                class: CHILD_TIMED_OUT.into(),
                message: "the child flow run did not end before the step's timeout".into(),
            };
            tasks.fail_unstarted(id, error).await
        }
    };
    ended
}

/// Creates the `scheduled` record the delayed message at `seq` stands for (one that
/// exists already is fine).
async fn create_from(
    tasks: &TaskStore,
    headers: &async_nats::HeaderMap,
    seq: u64,
) -> Result<(), ax_core::state::StateError> {
    let Ok(meta) = ax_core::task::TaskMeta::from_headers(headers) else {
        return Ok(()); // not a task's headers: left to the warning above
    };
    let mut record = meta.record();
    record.delayed_seq = Some(seq);
    match tasks.create(&record).await {
        Ok(_) | Err(ax_core::state::StateError::Exists(_)) => Ok(()),
        Err(e) => Err(e),
    }
}
