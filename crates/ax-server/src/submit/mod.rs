//! Level-1 admission: validate, de-duplicate, store, answer.
//!
//! A request is answered "accepted" only after its message is in JetStream (a ready subject,
//! or `AX_DELAYED` for a task with a due time) and, for an immediate task with an
//! idempotency key, its key in `AX_IDEMPOTENCY` (a delayed one with a key: its key, then
//! its message, then its state record in `AX_TASKS`). The message goes before the record:
//! it is what runs the task, and a full priority subject refuses it with nothing stored
//! (`busy`). If ax dies between the writes, the worker (or the dispatcher) creates the
//! missing record from the message headers, or the claim the missing key, so nothing
//! accepted is lost. Every other task stores its message alone (`unrecorded`).

use crate::context::Context;
use ax_core::idempotency::KeyValue;
use ax_core::names;
use ax_core::protocol::{ErrorCode, SubmitAccepted, WireError};
use ax_core::state::{StateError, TaskState};
use ax_core::task::TaskMeta;
use bytes::Bytes;
use tracing::warn;

mod batch;
mod batching;
mod debounce;
mod item_keys;
pub(crate) mod lanes;
pub(crate) use batch::is_batch;
pub use batch::{BatchAnswers, MAX_BATCH};

pub use ax_core::admit::is_full;
pub(crate) use ax_core::admit::{publish_headers, publish_task, unrecorded};

fn state_unavailable(e: StateError) -> WireError {
    WireError::new(ErrorCode::Unavailable, e.to_string())
}

/// The answer of an accepted, new task.
fn accepted(meta: &TaskMeta) -> SubmitAccepted {
    SubmitAccepted {
        id: meta.id.clone(),
        duplicate: false,
        state: if meta.run_at_ms.is_some() {
            TaskState::Scheduled
        } else {
            TaskState::Pending
        },
    }
}

/// The task an idempotency key names, as a duplicate submit sees it.
enum Named {
    /// Answer the producer this (`duplicate: true`).
    Answer(SubmitAccepted),
    /// The key was written before the task and no record shows it stored: finish the
    /// task under this id.
    Unstored(String),
}

impl Context {
    /// Admits a decoded single submit into the debounce window or batch it joins.
    /// `crate::intake` admits every other submit (a singleton key claimed in
    /// `crate::singleton`, a plain one by [`Context::submit_prepared`]).
    pub(crate) async fn submit_window(
        &self,
        meta: TaskMeta,
        payload: Bytes,
        window: ax_core::debounce::Window,
    ) -> Result<SubmitAccepted, WireError> {
        use ax_core::debounce::Window;
        match window {
            Window::Debounce(d) => Box::pin(self.submit_debounced(meta, payload, d)).await,
            Window::Batch(b) => Box::pin(self.submit_batched(meta, payload, b)).await,
            Window::Singleton(_) => Err(WireError::new(
                ErrorCode::Unavailable,
                "a singleton submit reached the window submit path (a bug)",
            )),
        }
    }

    /// Admits a validated task (idempotency, store); used by submits and trigger fires.
    pub(crate) async fn submit_prepared(
        &self,
        meta: TaskMeta,
        payload: Bytes,
    ) -> Result<SubmitAccepted, WireError> {
        self.queues.check(&self.js, &meta.queue).await?;
        let mut approval = None;
        match meta.wait {
            Some(ax_core::task::Wait::Event(_)) => self.register_wait(&payload).await?,
            Some(ax_core::task::Wait::Approval(_)) => {
                approval = Some(crate::approval::register(self, &payload).await?);
            }
            _ => {}
        }
        let answer = if meta.idempotency_key.is_none() {
            self.store(&meta, payload).await?;
            accepted(&meta)
        } else {
            // Boxed: the key's reads and writes make a future several times the size of a
            // plain submit's, which every submit would otherwise carry (and move) with it
            // (docs/PERFORMANCE.md, "Counted in instructions").
            Box::pin(self.submit_with_key(meta, payload)).await?
        };
        if let Some(stored) = &approval {
            // Once stored: whoever gets the token finds the approval's record.
            crate::approval::announce(self, stored).await?;
        }
        Ok(answer)
    }

    /// Stores a wait for an event's registration (its task's payload) in `AX_WAITS`
    /// before its task is stored: an accepted wait is one the matcher knows.
    async fn register_wait(&self, payload: &Bytes) -> Result<(), WireError> {
        let reg: ax_core::event::WaitRegistration =
            serde_json::from_slice(payload).map_err(|e| {
                WireError::new(
                    ErrorCode::BadRequest,
                    format!("a wait for an event's payload is not its registration: {e}"),
                )
            })?;
        self.waits.put(&reg).await.map_err(|e| {
            WireError::new(
                ErrorCode::Unavailable,
                format!("storing the wait in {}: {e}", names::WAITS_BUCKET),
            )
        })?;
        Ok(())
    }

    /// [`Context::submit_prepared`] of a task with an idempotency key.
    async fn submit_with_key(
        &self,
        mut meta: TaskMeta,
        payload: Bytes,
    ) -> Result<SubmitAccepted, WireError> {
        let queue = meta.queue.clone();
        let queue = queue.as_str();
        // The key this submit created, so a definite refusal can release it.
        let mut claimed: Option<(String, u64)> = None;
        if let Some(key) = meta.idempotency_key.clone() {
            let kv_key = names::idempotency_kv_key(queue, &key);
            if meta.unrecorded {
                return self.submit_keyed(meta, payload, kv_key).await;
            }
            let value = KeyValue {
                id: meta.id.clone(),
                stored: false,
            };
            match self.idempotency.create(&kv_key, value.encode()).await {
                Ok(revision) => claimed = Some((kv_key, revision)),
                Err(e) if ax_core::state::create_lost(&e) => {
                    if let Some(first) = self.key_value(&kv_key).await? {
                        match self.named(queue, first).await? {
                            Named::Answer(accepted) => return Ok(accepted),
                            // The first submit stored its key but died before its task:
                            // finish it under the first id (the message id de-duplicates
                            // a re-publish).
                            Named::Unstored(first) => meta.id = first,
                        }
                    }
                }
                Err(e) => return Err(WireError::new(ErrorCode::Unavailable, e.to_string())),
            }
        }
        if let Err(e) = self.store(&meta, payload).await {
            if let (ErrorCode::Busy, Some((kv_key, revision))) = (e.code, claimed) {
                // Nothing was stored: release the key, so a refused submit leaves nothing
                // behind. If that fails, say so (`unavailable`, not `busy`): a retry with
                // the key finishes this task under its id, which is safe.
                if let Err(release) = self
                    .idempotency
                    .delete_expect_revision(&kv_key, Some(revision))
                    .await
                {
                    warn!(key = %kv_key, cause = %release, "could not release the idempotency key of a refused submit");
                    return Err(WireError::new(
                        ErrorCode::Unavailable,
                        format!(
                            "{}; its idempotency key could not be released: retry",
                            e.message
                        ),
                    ));
                }
            }
            return Err(e);
        }
        Ok(accepted(&meta))
    }

    /// An immediate task with an idempotency key: no record until its claim. The key is
    /// read first (a duplicate stores nothing), the message stored, then the key created
    /// naming it (`"<id> stored"`). A submit that loses the key to a concurrent one
    /// deletes its message and answers the winner's task; if that delete is lost, the
    /// claim retires the copy, since the key names another task
    /// (`ax_core::idempotency::Keys::check`). If ax dies between the two writes (or the
    /// key's write fails: `unavailable`), the claim writes the key. Three stored writes a
    /// task: message, key, outcome (a first attempt that ends within a second writes no
    /// `running`).
    async fn submit_keyed(
        &self,
        meta: TaskMeta,
        payload: Bytes,
        kv_key: String,
    ) -> Result<SubmitAccepted, WireError> {
        if let Some(first) = self.key_value(&kv_key).await? {
            return match self.named(&meta.queue, first).await? {
                Named::Answer(accepted) => Ok(accepted),
                // A key written first by an older server (or for a delayed task) whose
                // task may not be stored: finish it under that id, recorded.
                Named::Unstored(first) => {
                    let meta = TaskMeta {
                        id: first,
                        unrecorded: false,
                        ..meta
                    };
                    self.store(&meta, payload).await?;
                    Ok(accepted(&meta))
                }
            };
        }
        let seq = self.store(&meta, payload).await?;
        let value = KeyValue {
            id: meta.id.clone(),
            stored: true,
        };
        let created = self.idempotency.create(&kv_key, value.encode()).await;
        let Err(e) = created else {
            return Ok(accepted(&meta));
        };
        // Refused (a concurrent submit's key, or a worker's), or no answer: the stream's
        // leader says what the key holds (a replica may be behind and answer "absent").
        let named = ax_core::kv_read::latest(&self.idempotency, &kv_key)
            .await
            .map_err(|e| WireError::new(ErrorCode::Unavailable, e.to_string()))?
            .filter(|entry| entry.operation == async_nats::jetstream::kv::Operation::Put)
            .map(|entry| KeyValue::parse(&entry.value));
        match named {
            // This submit's create was stored, or a worker claimed the task first and
            // wrote its key.
            Some(v) if v.id == meta.id => Ok(accepted(&meta)),
            Some(v) => {
                self.retract(&meta, seq).await;
                match self.named(&meta.queue, v).await? {
                    Named::Answer(accepted) => Ok(accepted),
                    // An older server's submit of the same key, in flight.
                    Named::Unstored(first) => Ok(SubmitAccepted {
                        id: first,
                        duplicate: true,
                        state: TaskState::Pending,
                    }),
                }
            }
            // Not accepted: the key does not name this task, and a retry with the key,
            // finding none, would store another that the key then names (this one's
            // claim retires it as a copy; or, if no retry comes, writes its key and runs
            // it).
            None => {
                warn!(task_id = %meta.id, cause = %e, "task stored but its idempotency key not written; answered unavailable");
                Err(WireError::new(
                    ErrorCode::Unavailable,
                    format!("idempotency key {kv_key} not written ({e}): retry with the key"),
                ))
            }
        }
    }

    /// The value of an idempotency key, if it is set.
    async fn key_value(&self, kv_key: &str) -> Result<Option<KeyValue>, WireError> {
        self.idempotency
            .get(kv_key)
            .await
            .map_err(|e| WireError::new(ErrorCode::Unavailable, e.to_string()))
            .map(|v| v.map(|v| KeyValue::parse(&v)))
    }

    /// What a duplicate submit answers about the task a key names: its record's state;
    /// `pending` for a task stored before its key and not claimed yet; or
    /// [`Named::Unstored`] when the key came first and no record shows the task stored.
    async fn named(&self, queue: &str, first: KeyValue) -> Result<Named, WireError> {
        let state = match self.tasks.get(&first.id).await.map_err(state_unavailable)? {
            Some((rec, _)) => rec.state,
            None if first.stored => TaskState::Pending,
            None => return Ok(Named::Unstored(first.id)),
        };
        metrics::counter!(ax_core::metrics::SUBMIT_DUPLICATES, "queue" => queue.to_string())
            .increment(1);
        Ok(Named::Answer(SubmitAccepted {
            id: first.id,
            duplicate: true,
            state,
        }))
    }

    /// Deletes the message of a submit that lost its key (ready, or held for its fair
    /// share); best effort.
    async fn retract(&self, meta: &TaskMeta, seq: u64) {
        let stream = ax_core::admit::stream(meta);
        let deleted = match self.js.get_stream_no_info(&stream).await {
            Ok(stream) => stream
                .delete_message(seq)
                .await
                .map_err(async_nats::Error::from),
            Err(e) => Err(e.into()),
        };
        if let Err(cause) = deleted {
            warn!(task_id = %meta.id, seq, %cause, "could not delete the message of a submit that lost its idempotency key; its claim retires it");
        }
    }

    /// Stores the task (its message, and its record unless it is unrecorded); answers
    /// the message's stream sequence.
    async fn store(&self, meta: &TaskMeta, payload: Bytes) -> Result<u64, WireError> {
        if let (true, Some(groups)) = (meta.unrecorded, &self.ready) {
            // Published once, under a fresh id: the worker that claims it writes its first
            // record (create-if-absent), and until then it is found by its message. With
            // the other submits of the moment, as one atomic batch (group commit).
            let seq = groups.store(&self.js, meta, payload).await?;
            self.faults.pass(ax_core::faults::Abort::AfterPublish);
            return Ok(seq);
        }
        // Boxed, as `submit_prepared` boxes the keyed path: the plain path stays small.
        Box::pin(self.store_recorded(meta, payload)).await
    }

    /// [`Context::store`] of a task published alone: recorded, or without group commit.
    async fn store_recorded(&self, meta: &TaskMeta, payload: Bytes) -> Result<u64, WireError> {
        let subject = ax_core::admit::subject(meta);
        let seq = publish_task(&self.js, subject, meta, payload).await?;
        self.faults.pass(ax_core::faults::Abort::AfterPublish);
        if meta.unrecorded {
            return Ok(seq);
        }
        let lost =
            (meta.lineage.as_ref()).and_then(|l| self.faults.trigger_state_write(&l.trigger));
        if lost == Some(ax_core::faults::StateWriteFault::LostWithRecords) {
            warn!(task_id = %meta.id, "injected fault: the fire's record not written");
            return Ok(seq);
        }
        let mut record = meta.record();
        if meta.run_at_ms.is_none() {
            // The record names its ready message: a worker may start the first attempt of
            // exactly that message without a `running` write, and retires any other copy
            // (docs/PROTOCOL.md §3).
            record.ready_seq = Some(seq);
        } else {
            // "Run now" reads a scheduled task's message by this sequence.
            record.delayed_seq = Some(seq);
        }
        // Sent again if the client connects anew while it waits (a create the broker had
        // when it stopped is never answered); one whose first sending was stored is `Exists`.
        let client = self.js.client();
        let created = ax_core::follow::across_reconnects(&client, || self.tasks.create(&record));
        match created.await {
            // Exists: a worker already picked the task up and wrote its record (or this
            // create's first sending did).
            Ok(_) | Err(StateError::Exists(_)) => Ok(seq),
            // The task is stored and will run: it is accepted. Answering `unavailable`
            // would make a producer without an idempotency key submit it twice. The worker
            // that claims it writes the record from the message headers.
            Err(e) => {
                warn!(task_id = %meta.id, cause = %e, "task stored but its record not written; the worker will write it");
                metrics::counter!(ax_core::metrics::RECORD_DEFERRED, "queue" => meta.queue.clone())
                    .increment(1);
                Ok(seq)
            }
        }
    }
}
