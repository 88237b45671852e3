//! A cancel of a task that has no `running` record yet, while a worker may hold its
//! message: an attempt can start there without writing `running` first (an unrecorded
//! task's first attempt, a retry; docs/PROTOCOL.md §3 step 4), and a `cancelled` record
//! alone would not stop it. The holder is signalled as a running attempt's is
//! (`ax.cancel.<queue>`) *before* the record is written: its handler does not start or is
//! stopped, and its answer says whether it had started, so the one `cancelled` record
//! counts that attempt. Once the record is written the signal goes out again, for a
//! worker that got the message in between. A holder that answers neither (stopped, cut
//! off) starts no handler after the cancel's answer: an unwritten start that comes later
//! than 250 ms after its claim read the record writes `running` first (`ax_sdk`'s
//! `LATE_START`), and that write meets the `cancelled` record. The operations API's
//! cancel and the flow engine's fail-fast cancel both go through [`Holders`].

use super::actions::Ops;
use async_nats::jetstream;
use ax_core::names;
use ax_core::state::{ErrorInfo, StateError, TaskRecord, TaskState, TaskStore};
use bytes::Bytes;
use serde_json::Value;
use std::time::Duration;
use tracing::{info, warn};

/// How long a cancel waits for the holder of a task's message to answer. Longer than the
/// worker's `LATE_START` (250 ms), so a start the signal missed writes `running` first.
pub(crate) const HOLDER_WAIT: Duration = Duration::from_millis(500);

/// Compare-and-set tries of the attempt count.
const COUNT_TRIES: usize = 3;

/// Who holds a task's ready message, by the answer to a cancel signal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Holder {
    /// Not delivered yet (or the task has no ready message): nobody holds it, and a
    /// worker that gets it later reads the `cancelled` record in its claim.
    Nobody,
    /// Delivered, and no worker answered: none holds it now (it waits to be delivered
    /// again), or the one that does is stopped or cut off.
    Silent,
    /// This worker held it and stopped its attempt; `started` is the attempt whose
    /// handler it had started (0: none, and none will).
    Answered { worker: String, started: u32 },
}

impl Holder {
    /// The worker that answered.
    pub(crate) fn worker(&self) -> Option<String> {
        match self {
            Holder::Answered { worker, .. } => Some(worker.clone()),
            _ => None,
        }
    }

    /// The attempt a holder had started (0: none known).
    pub(crate) fn started(&self) -> u32 {
        match self {
            Holder::Answered { started, .. } => *started,
            _ => 0,
        }
    }
}

/// What signalling a holder and counting its attempt need: the operations API
/// ([`Ops::holders`]) and the flow engine's fail-fast cancel use it.
pub(crate) struct Holders<'a> {
    pub(crate) js: &'a jetstream::Context,
    pub(crate) tasks: &'a TaskStore,
}

impl Ops {
    /// The holder signalling of this server's connection and task store.
    pub(crate) fn holders(&self) -> Holders<'_> {
        Holders {
            js: &self.js,
            tasks: &self.tasks,
        }
    }
}

impl Holders<'_> {
    /// Cancels task `id` if no attempt of it has started by its record (`scheduled`,
    /// `pending` or `retrying`), as [`TaskStore::cancel_unstarted`] does, but signals
    /// the worker that may hold its message first, so an attempt that started there
    /// without a `running` write (a retry) is stopped and counted. Returns the state it
    /// ends in, or `None` when there is no record.
    pub(crate) async fn cancel_unstarted(
        &self,
        id: &str,
        reason: &str,
    ) -> Result<Option<TaskState>, StateError> {
        loop {
            let Some((rec, revision)) = self.tasks.get(id).await? else {
                return Ok(None);
            };
            if !matches!(
                rec.state,
                TaskState::Scheduled | TaskState::Pending | TaskState::Retrying
            ) {
                return Ok(Some(rec.state));
            }
            let holder = self.stop_holder(&rec).await;
            let mut cancelled = rec.transition(TaskState::Cancelled);
            cancelled.attempt = cancelled.attempt.max(holder.started());
            cancelled.last_error = Some(ErrorInfo {
                detail: None,
                class: "cancelled".into(),
                message: reason.to_string(),
            });
            match self.tasks.cas(&cancelled, revision).await {
                Ok(revision) => {
                    self.stop_late_holder(&holder, &cancelled, revision).await;
                    return Ok(Some(TaskState::Cancelled));
                }
                Err(StateError::Stale { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Signals the worker that may hold `rec`'s ready message (a `pending` or `retrying`
    /// task) to stop the attempt it may be starting there.
    pub(crate) async fn stop_holder(&self, rec: &TaskRecord) -> Holder {
        let Some(seq) = rec
            .ready_seq
            .filter(|_| matches!(rec.state, TaskState::Pending | TaskState::Retrying))
        else {
            return Holder::Nobody;
        };
        if !self.maybe_delivered(rec, seq).await {
            return Holder::Nobody;
        }
        self.signal(rec).await
    }

    /// After `cancelled` was stored at `revision`, following `first`: signals again (a
    /// worker that got the message between the first signal and the write), and counts
    /// an attempt such a worker had started. The worker that answered, if one did.
    pub(crate) async fn stop_late_holder(
        &self,
        first: &Holder,
        cancelled: &TaskRecord,
        revision: u64,
    ) -> Option<String> {
        if *first == Holder::Nobody {
            // Not delivered when the signal was considered: it may have been since, to a
            // worker whose claim read the record before this write and now starts
            // unwritten within its `LATE_START` (found by the R3 campaign, seed
            // 4955772603497125947: a resumed worker's backlog met a burst of
            // `cancel_in_progress` fires). Looked at again; signalled if so.
            let delivered_since = match cancelled.ready_seq {
                Some(seq) => self.maybe_delivered(cancelled, seq).await,
                None => false,
            };
            if !delivered_since {
                return None;
            }
        }
        let again = self.signal(cancelled).await;
        if again.started() > cancelled.attempt {
            self.count_attempt(cancelled, revision, again.started())
                .await;
        }
        again.worker()
    }

    async fn signal(&self, rec: &TaskRecord) -> Holder {
        let signal = tokio::time::timeout(
            HOLDER_WAIT,
            self.js.client().request(
                names::cancel_subject(&rec.queue),
                Bytes::from(rec.id.clone()),
            ),
        )
        .await;
        let Ok(Ok(reply)) = signal else {
            return Holder::Silent;
        };
        let answer = serde_json::from_slice::<Value>(&reply.payload).unwrap_or_default();
        let worker = answer["worker"].as_str().unwrap_or("?").to_string();
        // An answer without a usable count (an older worker, a number out of range)
        // counts no started attempt.
        let started = answer["started"]
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(0);
        info!(task_id = %rec.id, %worker, started, "cancel signalled to the worker holding the task's message");
        Holder::Answered { worker, started }
    }

    /// Whether a worker may hold message `seq` of `rec`'s ready stream: the queue's
    /// consumer has delivered it (or cannot be asked). A message past the consumer's
    /// last delivery reaches a worker only after the `cancelled` write, which its claim
    /// then reads.
    async fn maybe_delivered(&self, rec: &TaskRecord, seq: u64) -> bool {
        let stream = match self
            .js
            .get_stream_no_info(rec.priority.ready_stream())
            .await
        {
            Ok(stream) => stream,
            Err(_) => return true,
        };
        match stream
            .consumer_info(names::consumer_name(&rec.queue, rec.priority))
            .await
        {
            Ok(info) => seq <= info.delivered.stream_sequence,
            Err(_) => true,
        }
    }

    /// Makes the `cancelled` record count attempt `started`, whose handler a worker that
    /// got the message after the first signal had begun before the second stopped it.
    async fn count_attempt(&self, cancelled: &TaskRecord, revision: u64, started: u32) {
        let (mut rec, mut rev) = (cancelled.clone(), revision);
        for _ in 0..COUNT_TRIES {
            rec.attempt = started;
            match self.tasks.cas(&rec, rev).await {
                Ok(_) => return,
                Err(StateError::Stale { .. }) => match self.tasks.get_latest(&rec.id).await {
                    Ok(Some((now, now_rev)))
                        if now.state == TaskState::Cancelled && now.attempt < started =>
                    {
                        (rec, rev) = (now, now_rev);
                    }
                    _ => return,
                },
                Err(e) => {
                    warn!(task_id = %rec.id, cause = %e, "cancelled record does not count the attempt its worker had started");
                    return;
                }
            }
        }
    }
}
