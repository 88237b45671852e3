//! A flow's wait task (header `Ax-Wait`, docs/PROTOCOL.md §6 "Waits") when its delayed
//! message is due: no worker runs it. A sleep's record is moved to `succeeded`; a wait
//! for an event that no event ended has timed out: `dead` (class `wait_timed_out`), or
//! `succeeded` with no output for `event-or-null`. Each by compare-and-set (read again
//! on a lost race, so two servers dispatching the same message, or the matcher and a
//! timeout, end it once), then its delayed message is deleted. Killed in between, the
//! message is dispatched again and finds the record ended: only the delete is left to do.
//! A wait that ended meanwhile (an event, the run's cancel) keeps its record. The
//! registration of a wait for an event is removed by the matcher (`event_wait`).

use super::outcome::Outcome;
use ax_core::admit::delete_delayed;
use ax_core::event::OnTimeout;
use ax_core::names::DELAYED_STREAM;
use ax_core::state::ErrorInfo;
use ax_core::state::TaskStore;
use ax_core::task::{header, Wait};
use tracing::{debug, warn};

/// Ends the wait task stored at `seq` of `AX_DELAYED` (`wait`: its `Ax-Wait` value).
pub(super) async fn wake(
    js: &async_nats::jetstream::Context,
    tasks: &TaskStore,
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
    let ended = match Wait::parse(wait) {
        Some(Wait::Sleep) | Some(Wait::Event(OnTimeout::Continue)) => {
            tasks.succeed_unstarted(&id, None).await
        }
        Some(Wait::Event(OnTimeout::Fail)) => {
            let error = ErrorInfo {
                detail: None,
                class: "wait_timed_out".into(),
                message: "no matching event came before the wait's timeout".into(),
            };
            tasks.fail_unstarted(&id, error).await
        }
        None => {
            warn!(seq, task_id = %id, wait, "wait task of a kind this server does not know; left in place");
            return Outcome::Bad;
        }
    };
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
