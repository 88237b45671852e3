//! Overlap `cancel_in_progress`: the previous fire's tasks are ended before the new fire
//! is made (the new one wins).

use crate::ops::actions::Ops;
use crate::ops::stop::{Stopping, CANCEL_ROUNDS};
use tracing::{debug, warn};

/// Cancels each of `active` (trigger `name`'s previous fire's tasks) until its record is
/// final or its cancel recorded ([`Ops::cancel_until_stopped`]: a cancel answered while
/// the task moved on is made again). One that cannot be cancelled now, or is still live
/// after [`CANCEL_ROUNDS`] cancels, is logged, and the new fire goes anyway.
pub(super) async fn cancel_previous(ops: &Ops, name: &str, active: &[String]) {
    let by = format!("trigger:{name}");
    for id in active {
        match ops.cancel_until_stopped(id, &by).await {
            Ok(Stopping::Stopped) => {
                debug!(trigger = %name, task_id = %id, "previous fire's task stopped")
            }
            Ok(Stopping::Live) => warn!(trigger = %name, task_id = %id,
                "previous fire's task still live after {CANCEL_ROUNDS} cancels; firing anyway"),
            Err(e) => warn!(trigger = %name, task_id = %id, cause = %e,
                "previous fire's task not cancelled; firing anyway"),
        }
    }
}
