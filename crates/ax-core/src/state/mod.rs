//! Task state records in the `AX_TASKS` KV bucket.
//!
//! One key per task id; every transition is a compare-and-set on the key's revision, so two
//! writers (a late worker and the one that took over its redelivered attempt) can never both
//! win. The revision written when an attempt starts is that attempt's fencing token.

mod error;

use crate::names::TASKS_BUCKET;
pub use crate::typed_kv::create_lost;
use crate::typed_kv::{self, KvError};
pub use crate::wire::record::{ErrorInfo, OpNote, TaskRecord, TaskState, Waiting};
use async_nats::jetstream::{self, kv};
pub use error::StateError;
use futures::StreamExt;

/// The `AX_TASKS` bucket.
#[derive(Clone, Debug)]
pub struct TaskStore {
    kv: kv::Store,
    js: jetstream::Context,
    /// Group commit of [`TaskStore::cas`] writes ([`TaskStore::grouped`]).
    group: Option<crate::atomic::Grouped>,
}

/// Filter for [`TaskStore::list`].
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only this queue.
    pub queue: Option<String>,
    /// Only this state.
    pub state: Option<TaskState>,
    /// At most this many records (0: no limit).
    pub limit: usize,
}

/// A task-store error from the typed KV store's: a lost create is [`StateError::Exists`],
/// a lost compare-and-set against `expected` is [`StateError::Stale`].
fn from_kv(id: &str, expected: Option<u64>, e: KvError) -> StateError {
    match (e, expected) {
        (KvError::Stale(_), None) => StateError::Exists(id.to_string()),
        (KvError::Stale(_), Some(expected)) => StateError::Stale {
            id: id.to_string(),
            expected,
        },
        (KvError::Corrupt { source, .. }, _) => StateError::Corrupt {
            id: id.to_string(),
            source,
        },
        (e @ KvError::TooLarge { .. }, _) => broker(id, "write", e),
        (KvError::Broker { op, source, .. }, _) => StateError::Broker {
            id: id.to_string(),
            op,
            source,
        },
    }
}

impl TaskStore {
    /// Opens the bucket (it must exist: `ax streams apply`).
    pub async fn open(js: &jetstream::Context) -> Result<TaskStore, StateError> {
        let kv = js
            .get_key_value(TASKS_BUCKET)
            .await
            .map_err(|e| broker("*", "open bucket", e))?;
        Ok(TaskStore {
            kv,
            js: js.clone(),
            group: None,
        })
    }

    /// Stores the first record; fails with [`StateError::Exists`] if the id is taken.
    pub async fn create(&self, rec: &TaskRecord) -> Result<u64, StateError> {
        typed_kv::put(&self.kv, &rec.id, rec, None)
            .await
            .map_err(|e| from_kv(&rec.id, None, e))
    }

    /// Removes a record and its history, if it is still at `revision` (an operator's
    /// purge of a finished task): [`StateError::Stale`] if it moved on. The bucket keeps
    /// a purge marker in its place (`KV-Operation: PURGE`), which watchers see.
    pub async fn purge(&self, id: &str, revision: u64) -> Result<(), StateError> {
        self.kv
            .purge_expect_revision(id, Some(revision))
            .await
            .map_err(|e| {
                if crate::error::ErrorKind::of(&e) == crate::error::ErrorKind::Conflict {
                    StateError::Stale {
                        id: id.to_string(),
                        expected: revision,
                    }
                } else {
                    broker(id, "purge", e)
                }
            })
    }

    /// The current record and its revision.
    pub async fn get(&self, id: &str) -> Result<Option<(TaskRecord, u64)>, StateError> {
        typed_kv::get_any(&self.kv, id)
            .await
            .map_err(|e| from_kv(id, None, e))
    }

    /// The subject a task's record writes are published on (`$KV.AX_TASKS.<id>`).
    pub fn subject(&self, id: &str) -> String {
        format!("{}{id}", self.kv.prefix)
    }

    /// The current record and its revision as the bucket's leader has it: never older than
    /// an acknowledged write ([`crate::kv_read`]), where [`TaskStore::get`] may answer from
    /// a replica that is behind. For reads whose answer decides without a compare-and-set.
    pub async fn get_latest(&self, id: &str) -> Result<Option<(TaskRecord, u64)>, StateError> {
        typed_kv::get(&self.kv, id)
            .await
            .map_err(|e| from_kv(id, None, e))
    }

    /// The task as it stands, recorded or not: its record, or, for a task whose submit
    /// stored none and that no worker has claimed yet, the `scheduled` record its delayed
    /// message stands for or the `pending` record its ready message stands for, at
    /// revision 0 ([`crate::unclaimed`]). A compare-and-set against revision 0 creates the
    /// record. `None`: no such task.
    pub async fn find(&self, id: &str) -> Result<Option<(TaskRecord, u64)>, StateError> {
        if let Some(found) = self.get(id).await? {
            return Ok(Some(found));
        }
        // The delayed message first: the dispatcher publishes a due task's ready message
        // before it deletes the delayed one, so a task not found delayed is found ready
        // (or, claimed meanwhile, recorded).
        if let Some((meta, seq)) = crate::unclaimed::find_delayed(&self.js, id).await? {
            if let Some(found) = self.get(id).await? {
                return Ok(Some(found));
            }
            return Ok(Some((crate::unclaimed::scheduled_record(&meta, seq), 0)));
        }
        // Held for its fair share: the fair dispatcher publishes its ready message before
        // it purges the held one, so one not found held is found ready.
        if let Some((meta, _)) = crate::unclaimed::find_fair(&self.js, id).await? {
            if let Some(found) = self.get(id).await? {
                return Ok(Some(found));
            }
            return Ok(Some((meta.record(), 0)));
        }
        if let Some((meta, seq)) = crate::unclaimed::find_ready(&self.js, id).await? {
            // Claimed between the two reads: the record exists now.
            if let Some(found) = self.get(id).await? {
                return Ok(Some(found));
            }
            return Ok(Some((crate::unclaimed::pending_record(&meta, seq), 0)));
        }
        // Its message was acknowledged after the first read: the worker wrote its record
        // before the ack.
        self.get(id).await
    }

    /// This store with its [`TaskStore::cas`] writes group-committed: the writes made at
    /// the same moment (a worker's outcomes of many tasks) stored as one atomic batch, one
    /// stored write (and one fsync) for all ([`crate::atomic::Grouped`]). The bucket's
    /// stream must allow atomic publish; a group it refuses falls back to single writes.
    /// `mode` says when ([`crate::atomic::GroupCommit`]; `Never` leaves the store as it is).
    pub fn grouped(mut self, mode: crate::atomic::GroupCommit) -> TaskStore {
        if mode != crate::atomic::GroupCommit::Never {
            let stream = format!("KV_{TASKS_BUCKET}");
            self.group = Some(crate::atomic::Grouped::start_distinct(
                self.js.clone(),
                mode,
                &stream,
            ));
        }
        self
    }

    /// Writes `rec` if the key is still at `revision`; returns the new revision. Revision
    /// 0 creates the record if there is none ([`StateError::Stale`] if there is).
    ///
    /// Sent again if the client connects anew while it waits (a write the broker had when
    /// it stopped is never answered: a worker's slot was held for the request timeout), and
    /// then taken as written if its first sending was stored ([`typed_kv::write_again`]).
    pub async fn cas(&self, rec: &TaskRecord, revision: u64) -> Result<u64, StateError> {
        let body: bytes::Bytes = serde_json::to_vec(rec).expect("a record serializes").into();
        let expected = (revision != 0).then_some(revision);
        let lost = |e: &StateError| matches!(e, StateError::Stale { .. });
        let unsure = |e| broker(&rec.id, "read", e);
        let client = self.js.client();
        typed_kv::write_again(
            &client,
            &self.kv,
            &rec.id,
            &body,
            expected,
            lost,
            unsure,
            || self.cas_once(rec, &body, revision),
        )
        .await
    }

    async fn cas_once(
        &self,
        rec: &TaskRecord,
        body: &bytes::Bytes,
        revision: u64,
    ) -> Result<u64, StateError> {
        if let Some(group) = &self.group {
            return self.cas_grouped(group, rec, body, revision).await;
        }
        let expected = (revision != 0).then_some(revision);
        typed_kv::put_bytes(&self.kv, &rec.id, body.clone(), expected)
            .await
            .map_err(|e| from_kv(&rec.id, Some(revision), e))
    }

    async fn cas_grouped(
        &self,
        group: &crate::atomic::Grouped,
        rec: &TaskRecord,
        body: &bytes::Bytes,
        revision: u64,
    ) -> Result<u64, StateError> {
        let mut headers = async_nats::HeaderMap::new();
        let expected = revision.to_string();
        headers.insert("Nats-Expected-Last-Subject-Sequence", expected.as_str());
        let prefix = self.kv.put_prefix.as_ref().unwrap_or(&self.kv.prefix);
        let msg = crate::atomic::Outgoing {
            subject: format!("{prefix}{}", rec.id),
            headers,
            payload: body.clone(),
        };
        let publish = || group.publish(msg.clone());
        typed_kv::past_in_flight(&rec.id, publish)
            .await
            .map_err(|e| {
                // 10071 (a claim racing the submitter's record write, say), or 10164 still
                // after `past_in_flight`'s sendings: a lost race.
                if crate::error::ErrorKind::of(&e) == crate::error::ErrorKind::Conflict {
                    StateError::Stale {
                        id: rec.id.clone(),
                        expected: revision,
                    }
                } else {
                    broker(&rec.id, "write", e)
                }
            })
    }

    /// Cancels task `id` if no attempt of it has started (`scheduled`, `pending` or
    /// `retrying`): compare-and-set to `cancelled`, read again on a lost race. Returns the
    /// state it ends in (`running` and finished states are left as they are), or `None`
    /// when there is no record. It does not signal a worker that may be starting an
    /// attempt without a `running` write (a retry, an unrecorded task's first attempt):
    /// the server's cancels do (docs/ARCHITECTURE.md, "The path of a task").
    pub async fn cancel_unstarted(
        &self,
        id: &str,
        reason: &str,
    ) -> Result<Option<TaskState>, StateError> {
        let ended = self
            .end_unstarted(id, |rec| {
                let mut cancelled = rec.transition(TaskState::Cancelled);
                cancelled.last_error = Some(ErrorInfo {
                    detail: None,
                    class: "cancelled".into(),
                    message: reason.to_string(),
                });
                cancelled
            })
            .await?;
        Ok(ended.map(|rec| rec.state))
    }

    /// Ends a flow's wait task (`Ax-Wait`, which no worker runs) `succeeded` with
    /// `output` (an event's payload; `None` for a sleep) if it has not ended:
    /// compare-and-set from `scheduled`, `pending` or `retrying`, read again on a lost
    /// race. Returns the record it ends with (this end's, or the one that ended it
    /// before: a cancelled wait stays cancelled), or `None` when there is no record.
    pub async fn succeed_unstarted(
        &self,
        id: &str,
        output: Option<crate::wire::output::StoredOutput>,
    ) -> Result<Option<TaskRecord>, StateError> {
        self.end_unstarted(id, |rec| {
            let mut done = rec.transition(TaskState::Succeeded);
            done.attempt = done.attempt.max(1);
            done.output = output.clone();
            done
        })
        .await
    }

    /// Ends a flow's wait task `dead` with `error` (a wait for an event that timed out) if
    /// it has not ended, as [`TaskStore::succeed_unstarted`] does.
    pub async fn fail_unstarted(
        &self,
        id: &str,
        error: ErrorInfo,
    ) -> Result<Option<TaskRecord>, StateError> {
        self.end_unstarted(id, |rec| {
            let mut dead = rec.transition(TaskState::Dead);
            dead.attempt = dead.attempt.max(1);
            dead.last_error = Some(error.clone());
            dead
        })
        .await
    }

    /// Moves task `id` from `scheduled`, `pending` or `retrying` to the record `end`
    /// makes of it, by compare-and-set, read again on a lost race; the record it ends
    /// with (others are left as they are), or `None` when there is no record. The read is
    /// asked again if the client connects anew while it waits, as the write is sent again
    /// ([`TaskStore::cas`]): one the broker had when it stopped would hold the end (a met
    /// wait, a cancel) for the client's request timeout (10 s), longer than a wait's own.
    async fn end_unstarted(
        &self,
        id: &str,
        end: impl Fn(TaskRecord) -> TaskRecord,
    ) -> Result<Option<TaskRecord>, StateError> {
        let client = self.js.client();
        loop {
            let read = crate::follow::across_reconnects(&client, || self.get(id));
            let Some((rec, revision)) = read.await? else {
                return Ok(None);
            };
            if !matches!(
                rec.state,
                TaskState::Scheduled | TaskState::Pending | TaskState::Retrying
            ) {
                return Ok(Some(rec));
            }
            let ended = end(rec);
            match self.cas(&ended, revision).await {
                Ok(_) => return Ok(Some(ended)),
                Err(StateError::Stale { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// A live feed of every write to a flow step task's record (keys `*.fl.>`), from now
    /// on, delivered by an ordered consumer.
    pub async fn watch_flow_tasks(&self) -> Result<kv::Watch, kv::WatchError> {
        self.kv.watch("*.fl.>").await
    }

    /// A live feed of every write to a trigger task's record (keys `*.tr.>`), from now on,
    /// delivered by an ordered consumer (no message is lost to a slow reader).
    pub async fn watch_trigger_tasks(&self) -> Result<kv::Watch, kv::WatchError> {
        self.kv.watch("*.tr.>").await
    }

    /// The stored transitions of a task, oldest first (as many as the bucket's history keeps).
    pub async fn history(&self, id: &str) -> Result<Vec<(TaskRecord, u64)>, StateError> {
        let mut entries = self
            .kv
            .history(id)
            .await
            .map_err(|e| broker(id, "history", e))?;
        let mut out = Vec::new();
        while let Some(entry) = entries.next().await {
            let entry = entry.map_err(|e| broker(id, "history", e))?;
            if let Some(found) =
                typed_kv::decode(id, Some(entry)).map_err(|e| from_kv(id, None, e))?
            {
                out.push(found);
            }
        }
        Ok(out)
    }

    /// Lists current records matching `filter`. This reads the whole bucket (an operator
    /// command, never on the task path).
    pub async fn list(&self, filter: &ListFilter) -> Result<Vec<TaskRecord>, StateError> {
        let mut watch = self
            .kv
            .watch_with_history(">")
            .await
            .map_err(|e| broker("*", "list", e))?;
        let mut out = Vec::new();
        // Fresh: `kv::Store::status` answers the stream info read when the store was
        // opened, and a store may be long-lived (the `Client` opens its buckets once).
        let total = self
            .kv
            .stream
            .get_info()
            .await
            .map_err(|e| broker("*", "list", e))?
            .state
            .messages;
        if total == 0 {
            return Ok(out);
        }
        // A key written while we read arrives again (its newer revision): keep the newest.
        let mut at: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        let mut slots: Vec<Option<TaskRecord>> = Vec::new();
        let mut found = 0usize;
        while let Some(entry) = watch.next().await {
            let entry = entry.map_err(|e| broker("*", "list", e))?;
            let rec = match entry.operation {
                kv::Operation::Put => serde_json::from_slice::<TaskRecord>(&entry.value).ok(),
                _ => None,
            };
            let keep = rec.filter(|rec| {
                filter.queue.as_ref().is_none_or(|q| *q == rec.queue)
                    && filter.state.is_none_or(|s| s == rec.state)
            });
            let added = usize::from(keep.is_some());
            match at.get(&entry.key) {
                Some(&i) => {
                    found = found + added - usize::from(slots[i].is_some());
                    slots[i] = keep;
                }
                None => {
                    found += added;
                    at.insert(entry.key.clone(), slots.len());
                    slots.push(keep);
                }
            }
            if entry.delta == 0 || (filter.limit > 0 && found >= filter.limit) {
                break;
            }
        }
        out.extend(slots.into_iter().flatten());
        Ok(out)
    }
}

fn broker(id: &str, op: &'static str, e: impl Into<async_nats::Error>) -> StateError {
    StateError::Broker {
        id: id.to_string(),
        op,
        source: e.into(),
    }
}
