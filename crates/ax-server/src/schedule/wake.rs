//! A flow's wait task (header `Ax-Wait`, docs/PROTOCOL.md §6 "Waits") when its delayed
//! message is due: no worker runs it. A sleep's record is moved to `succeeded` by
//! compare-and-set (read again on a lost race, so two servers dispatching the same
//! message end it once), then its delayed message is deleted. Killed in between, the
//! message is dispatched again and finds the record ended: only the delete is left to do.
//! A wait that was cancelled meanwhile (the run's cancel) keeps its `cancelled` record.

use super::outcome::Outcome;
use ax_core::admit::delete_delayed;
use ax_core::names::DELAYED_STREAM;
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
    match Wait::parse(wait) {
        Some(Wait::Sleep) => {}
        None => {
            warn!(seq, task_id = %id, wait, "wait task of a kind this server does not know; left in place");
            return Outcome::Bad;
        }
    }
    match tasks.succeed_unstarted(&id).await {
        Ok(Some(state)) => debug!(task_id = %id, %state, "sleep ended"),
        Ok(None) => warn!(task_id = %id, "sleep without a record; its message is dropped"),
        Err(e) => {
            debug!(task_id = %id, cause = %e, "sleep not ended yet; retried");
            return Outcome::Refused {
                group: "(wake)".into(),
                due,
                seq,
                body: None,
            };
        }
    }
    if let Err(e) = delete_delayed(js, seq).await {
        debug!(seq, cause = %e, "ended sleep's message not deleted; dispatched again, it finds the sleep ended");
    }
    metrics::counter!(ax_core::metrics::DELAYED_DISPATCHED).increment(1);
    Outcome::Gone
}
