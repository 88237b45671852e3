//! Cancelling a task until it is stopped, for the server's own cancels that must not let a
//! task run on beside what replaces it: a `cancel_in_progress` trigger's fire, a singleton
//! key taken over, a flow singleton's step tasks.

use super::actions::Ops;
use ax_core::protocol::{ErrorCode, WireError};
use tracing::debug;

/// How many times a task is cancelled before its caller goes on anyway.
pub(crate) const CANCEL_ROUNDS: usize = 3;

/// How [`Ops::cancel_until_stopped`] came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stopping {
    /// Its record is final (cancelled, or ended otherwise first), or `running` with its
    /// cancel recorded (no worker answered: the next delivery ends it without running it),
    /// or there is no such task.
    Stopped,
    /// Still live after [`CANCEL_ROUNDS`] cancels.
    Live,
}

impl Ops {
    /// Cancels task `id` as [`Ops::cancel`] does, then reads its record from the bucket's
    /// leader: one still live (the cancel was answered while the task moved on: handed
    /// back by an attempt that ended otherwise, or delivered again) is cancelled again, up
    /// to [`CANCEL_ROUNDS`] times. A task that ended or is unknown meanwhile (`conflict`,
    /// `not_found`) counts as stopped; other errors are answered.
    pub(crate) async fn cancel_until_stopped(
        &self,
        id: &str,
        by: &str,
    ) -> Result<Stopping, WireError> {
        for round in 1..=CANCEL_ROUNDS {
            match self.cancel(id, by).await {
                Ok(_) => {}
                Err(e) if matches!(e.code, ErrorCode::Conflict | ErrorCode::NotFound) => {}
                Err(e) => return Err(e),
            }
            let live = match self.tasks.get_latest(id).await {
                Ok(Some((rec, _))) => {
                    !rec.state.is_terminal() && rec.cancel_requested_at_ms.is_none()
                }
                Ok(None) => false,
                Err(e) => return Err(WireError::unavailable(e)),
            };
            if !live {
                return Ok(Stopping::Stopped);
            }
            debug!(task_id = %id, by, round, "task still live after its cancel; cancelling it again");
        }
        Ok(Stopping::Live)
    }
}
