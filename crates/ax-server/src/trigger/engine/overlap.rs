//! Overlap `cancel_in_progress`: the previous fire's tasks are ended before the new fire
//! is made (the new one wins).

use crate::context::Context;
use crate::ops::actions::Ops;
use ax_core::protocol::ErrorCode;
use tracing::{debug, warn};

/// How many times a previous fire's task is cancelled before the new fire goes anyway.
const CANCEL_ROUNDS: usize = 3;

/// Cancels each of `active` (trigger `name`'s previous fire's tasks) as an operator does,
/// then reads its record from the bucket's leader: one that is still live (its cancel was
/// answered while the task moved on: handed back by an attempt that ended otherwise, or
/// delivered again) is cancelled again, up to [`CANCEL_ROUNDS`] times. A task counts as
/// stopped once its record is final, or `running` with its cancel recorded (no worker
/// answered: the next delivery ends it without running it). One that ended meanwhile is
/// refused (`conflict`) and is fine; one that cannot be cancelled now is logged, and the
/// new fire goes anyway.
pub(super) async fn cancel_previous(ctx: &Context, ops: &Ops, name: &str, active: &[String]) {
    let by = format!("trigger:{name}");
    for id in active {
        for round in 1..=CANCEL_ROUNDS {
            match ops.cancel(id, &by).await {
                Ok(_) => debug!(trigger = %name, task_id = %id, round, "previous fire cancelled"),
                Err(e) if e.code == ErrorCode::Conflict => {
                    debug!(trigger = %name, task_id = %id, cause = %e, "previous fire's task had ended")
                }
                Err(e) => {
                    warn!(trigger = %name, task_id = %id, cause = %e,
                        "previous fire's task not cancelled; firing anyway");
                    break;
                }
            }
            let live = match ctx.tasks.get_latest(id).await {
                Ok(Some((rec, _))) => {
                    !rec.state.is_terminal() && rec.cancel_requested_at_ms.is_none()
                }
                Ok(None) => false,
                Err(e) => {
                    warn!(trigger = %name, task_id = %id, cause = %e,
                        "previous fire's task not read after its cancel; firing anyway");
                    false
                }
            };
            if !live {
                break;
            }
            if round == CANCEL_ROUNDS {
                warn!(trigger = %name, task_id = %id,
                    "previous fire's task still live after {CANCEL_ROUNDS} cancels; firing anyway");
            } else {
                debug!(trigger = %name, task_id = %id, round, "previous fire's task still live after its cancel; cancelling it again");
            }
        }
    }
}
