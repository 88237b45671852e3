//! An attempt's `running` write and the fencing token it gives, made at most once.
//!
//! A retry or a redelivery writes `running` before its handler starts. A task's first
//! attempt on its message's first delivery starts without it (one stored write less per
//! task): the write is made when the handler asks for its fencing token, or once the
//! attempt has run for a second, whichever comes first. A token is only ever handed out
//! after its write succeeded, so every token is the revision of a `running` record and is
//! larger than any earlier attempt's, even if the broker lost track of deliveries.

use super::error::TaskError;
use crate::state::{StateError, TaskRecord, TaskStore};
use crate::time::now_ms;
use std::fmt;
use tokio::sync::Mutex;
use tracing::warn;

/// See the module docs.
pub(crate) struct Fence {
    tasks: TaskStore,
    state: Mutex<State>,
}

struct State {
    /// The `running` record of this attempt.
    rec: TaskRecord,
    /// The revision this attempt's next write is checked against.
    revision: u64,
    /// True once `running` is stored at `revision`.
    written: bool,
    /// True if the `running` write was refused: another attempt took over.
    overtaken: bool,
}

impl fmt::Debug for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Fence")
    }
}

impl Fence {
    /// An attempt whose `running` record is stored at `revision` (written) or still to be
    /// written over `revision` (not written).
    pub(crate) fn new(tasks: TaskStore, rec: TaskRecord, revision: u64, written: bool) -> Fence {
        Fence {
            tasks,
            state: Mutex::new(State {
                rec,
                revision,
                written,
                overtaken: false,
            }),
        }
    }

    /// The attempt's fencing token, writing `running` first if that is not done yet.
    pub(crate) async fn token(&self) -> Result<u64, TaskError> {
        let mut s = self.state.lock().await;
        if s.written {
            return Ok(s.revision);
        }
        if s.overtaken {
            return Err(overtaken());
        }
        let mut rec = s.rec.clone();
        rec.updated_at_ms = now_ms();
        match self.tasks.cas(&rec, s.revision).await {
            Ok(revision) => {
                s.revision = revision;
                s.written = true;
                Ok(revision)
            }
            Err(StateError::Stale { .. }) => {
                warn!(task_id = %rec.id, "attempt overtaken before its running write; its result will be refused");
                s.overtaken = true;
                Err(overtaken())
            }
            Err(e) => Err(TaskError::new("unavailable", e.to_string())),
        }
    }

    /// Writes `running` if not done yet (after the attempt's first second); a failure is
    /// logged and leaves the outcome write to decide.
    pub(crate) async fn write_running(&self) {
        if let Err(e) = self.token().await {
            if e.class == "unavailable" {
                warn!(cause = %e.message, "cannot write running; the attempt goes on");
            }
        }
    }

    /// The revision the attempt's outcome is written against.
    pub(crate) async fn revision(&self) -> u64 {
        self.state.lock().await.revision
    }
}

fn overtaken() -> TaskError {
    TaskError::new(
        "overtaken",
        "another attempt took this task over; this attempt's result will be refused",
    )
}
