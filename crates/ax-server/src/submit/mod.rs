//! Level-1 admission: validate, de-duplicate, store, answer.
//!
//! A request is answered "accepted" only after its message is in JetStream (a ready subject,
//! or `AX_DELAYED` for a task with a due time) and, for a task with an idempotency key,
//! its state record is in `AX_TASKS`. The message goes first: it is what
//! runs the task, and a full priority subject refuses it with nothing stored (`busy`). If
//! ax dies between the two writes, the worker (or the dispatcher) creates the missing
//! record from the message headers, so nothing accepted is lost. A task without a key
//! stores its message alone (`unrecorded`): one stored write.

use crate::context::Context;
use async_nats::jetstream::{self, context::PublishError};
use ax_sdk::names;
use ax_sdk::protocol::{ErrorCode, SubmitAccepted, WireError};
use ax_sdk::state::{StateError, TaskState};
use ax_sdk::task::{decode_submit, TaskMeta};
use bytes::Bytes;
use std::collections::HashSet;
use std::sync::RwLock;
use tracing::warn;

mod batch;
pub(crate) use batch::is_batch;
pub use batch::{BatchAnswers, MAX_BATCH};

/// JetStream's error code for a publish refused by a stream or per-subject limit.
const JS_STORE_FAILED: u64 = 10077;

/// True if a publish was refused because the stream or subject is full (`discard: new`).
pub fn is_full(err: &PublishError) -> bool {
    std::error::Error::source(err)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .is_some_and(|e| e.error_code().0 == JS_STORE_FAILED)
}

/// Publishes a task message with `Nats-Msg-Id` = task id, mapping a full subject to `busy`.
pub(crate) async fn publish_task(
    js: &jetstream::Context,
    subject: String,
    meta: &TaskMeta,
    payload: Bytes,
) -> Result<jetstream::publish::PublishAck, WireError> {
    publish_headers(js, subject, meta.to_headers(), &meta.id, payload).await
}

/// Publishes task headers as they are (plus `Nats-Msg-Id` = `id`), mapping a full subject
/// to `busy`: the delayed-task dispatcher forwards a stored message this way without
/// decoding and re-encoding all its headers.
pub(crate) async fn publish_headers(
    js: &jetstream::Context,
    subject: String,
    headers: async_nats::HeaderMap,
    id: &str,
    payload: Bytes,
) -> Result<jetstream::publish::PublishAck, WireError> {
    // A stored message copied (a retry, a run-now, a due delayed task) may carry the
    // headers of the atomic batch that stored it: not this publish's.
    let mut headers = ax_sdk::atomic::without_batch_headers(headers);
    headers.insert("Nats-Msg-Id", id);
    let publish = jetstream::message::PublishMessage::build()
        .headers(headers)
        .payload(payload);
    let ack = match js.send_publish(subject.clone(), publish).await {
        Ok(future) => future.await,
        Err(e) => Err(e),
    };
    ack.map_err(|e| refusal(&subject, &e))
}

/// A publish that failed: `busy` if the subject is full, else `unavailable`.
fn refusal(subject: &str, e: &PublishError) -> WireError {
    if is_full(e) {
        WireError::new(
            ErrorCode::Busy,
            format!("{subject} is at capacity; retry later"),
        )
    } else {
        WireError::new(ErrorCode::Unavailable, format!("{subject}: {e}"))
    }
}

/// Declared queues, looked up on the broker (a queue exists when its consumers do) and
/// cached once seen.
#[derive(Debug)]
pub(crate) struct Queues {
    known: RwLock<HashSet<String>>,
}

impl Queues {
    pub(crate) fn new(initial: &[String]) -> Queues {
        Queues {
            known: RwLock::new(initial.iter().cloned().collect()),
        }
    }

    /// The queue as a metric label if it is declared (seen by this server), else
    /// `_unknown`: requests to made-up queues must not create metric series.
    pub(crate) fn label(&self, queue: &str) -> String {
        if self.known.read().expect("not poisoned").contains(queue) {
            queue.to_string()
        } else {
            "_unknown".to_string()
        }
    }

    /// `Ok` if `queue` is declared; `unknown_queue` only when the broker says its consumer
    /// or stream does not exist, `unavailable` when it could not be asked (retry).
    pub(crate) async fn check(
        &self,
        js: &jetstream::Context,
        queue: &str,
    ) -> Result<(), WireError> {
        if !names::valid_queue(queue) {
            return Err(WireError::new(
                ErrorCode::UnknownQueue,
                format!("{queue:?} is not a valid queue name"),
            ));
        }
        if self.known.read().expect("not poisoned").contains(queue) {
            return Ok(());
        }
        let undeclared = || {
            WireError::new(
                ErrorCode::UnknownQueue,
                format!("queue {queue:?} is not declared (ax streams apply --queue {queue})"),
            )
        };
        let unavailable = |e: String| {
            WireError::new(
                ErrorCode::Unavailable,
                format!("cannot look up queue {queue:?}: {e}"),
            )
        };
        let stream = names::Priority::Normal.ready_stream();
        let consumer = names::consumer_name(queue, names::Priority::Normal);
        let stream = match js.get_stream(&stream).await {
            Ok(stream) => stream,
            Err(e) => {
                return Err(match e.kind() {
                    jetstream::context::GetStreamErrorKind::JetStream(js)
                        if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                    {
                        undeclared()
                    }
                    _ => unavailable(e.to_string()),
                })
            }
        };
        match stream.consumer_info(&consumer).await {
            Ok(_) => {
                self.known
                    .write()
                    .expect("not poisoned")
                    .insert(queue.to_string());
                Ok(())
            }
            Err(e) => Err(match e.kind() {
                jetstream::context::ConsumerInfoErrorKind::NotFound
                | jetstream::context::ConsumerInfoErrorKind::StreamNotFound => undeclared(),
                _ => unavailable(e.to_string()),
            }),
        }
    }
}

/// A producer's task without an idempotency key is stored as its message alone (header
/// `Ax-Unrecorded`), immediate or delayed: nothing needs its record before a worker claims
/// it. An immediate one is published exactly once, under an id made for it, so no copy can
/// start beside its first attempt; a delayed one is found by its message's own subject
/// while it waits, and its claim writes `running` before it starts (the dispatcher may
/// publish it twice: docs/PROTOCOL.md §3). Tasks with a key, trigger fires and flow steps
/// keep the record made at submit: their duplicate checks and engines read it.
pub(crate) fn unrecorded(mut meta: TaskMeta) -> TaskMeta {
    meta.unrecorded = meta.idempotency_key.is_none();
    meta
}

fn state_unavailable(e: StateError) -> WireError {
    WireError::new(ErrorCode::Unavailable, e.to_string())
}

impl Context {
    /// Handles one submit request for `queue`.
    pub(crate) async fn submit(
        &self,
        queue: &str,
        body: &[u8],
    ) -> Result<SubmitAccepted, WireError> {
        let (meta, payload) = decode_submit(queue, body, &self.limits)?;
        self.submit_prepared(unrecorded(meta), payload).await
    }

    /// Admits a validated task (idempotency, store); used by submits and trigger fires.
    pub(crate) async fn submit_prepared(
        &self,
        mut meta: TaskMeta,
        payload: Bytes,
    ) -> Result<SubmitAccepted, WireError> {
        let queue = meta.queue.clone();
        let queue = queue.as_str();
        self.queues.check(&self.js, queue).await?;
        // The key this submit created, so a definite refusal can release it.
        let mut claimed: Option<(String, u64)> = None;
        if let Some(key) = meta.idempotency_key.clone() {
            let kv_key = names::idempotency_kv_key(queue, &key);
            match self
                .idempotency
                .create(&kv_key, Bytes::from(meta.id.clone()))
                .await
            {
                Ok(revision) => claimed = Some((kv_key, revision)),
                Err(e) if ax_sdk::state::create_lost(&e) => {
                    let first = self
                        .idempotency
                        .get(&kv_key)
                        .await
                        .map_err(|e| WireError::new(ErrorCode::Unavailable, e.to_string()))?
                        .map(|v| String::from_utf8_lossy(&v).into_owned());
                    if let Some(first) = first {
                        if let Some((rec, _)) =
                            self.tasks.get(&first).await.map_err(state_unavailable)?
                        {
                            metrics::counter!(ax_sdk::metrics::SUBMIT_DUPLICATES, "queue" => queue.to_string())
                                .increment(1);
                            return Ok(SubmitAccepted {
                                id: first,
                                duplicate: true,
                                state: rec.state,
                            });
                        }
                        // The first submit stored its key but died before its task: finish
                        // it under the first id (the message id de-duplicates a re-publish).
                        meta.id = first;
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
        Ok(SubmitAccepted {
            id: meta.id,
            duplicate: false,
            state: if meta.run_at_ms.is_some() {
                TaskState::Scheduled
            } else {
                TaskState::Pending
            },
        })
    }

    async fn store(&self, meta: &TaskMeta, payload: Bytes) -> Result<(), WireError> {
        let subject = match meta.run_at_ms {
            Some(_) => names::delayed_subject(&meta.queue, meta.priority, &meta.id),
            None => names::ready_subject(&meta.queue, meta.priority),
        };
        if let (true, Some(ready)) = (meta.unrecorded, &self.ready) {
            // Published once, under a fresh id: the worker that claims it writes its first
            // record (create-if-absent), and until then it is found by its message. With
            // the other submits of the moment, as one atomic batch (group commit).
            let mut headers = meta.to_headers();
            headers.insert("Nats-Msg-Id", meta.id.as_str());
            let msg = ax_sdk::atomic::Outgoing {
                subject,
                headers,
                payload,
            };
            let subject = msg.subject.clone();
            ready[meta.priority.index()]
                .publish(msg)
                .await
                .map_err(|e| refusal(&subject, &e))?;
            #[cfg(feature = "test-hooks")]
            ax_sdk::hooks::after_publish();
            return Ok(());
        }
        let ack = publish_task(&self.js, subject, meta, payload).await?;
        #[cfg(feature = "test-hooks")]
        ax_sdk::hooks::after_publish();
        if meta.unrecorded {
            return Ok(());
        }
        let mut record = meta.record();
        if meta.run_at_ms.is_none() {
            // The record names its ready message: a worker may start the first attempt of
            // exactly that message without a `running` write, and retires any other copy
            // (docs/PROTOCOL.md §3).
            record.ready_seq = Some(ack.sequence);
        } else {
            // "Run now" reads a scheduled task's message by this sequence.
            record.delayed_seq = Some(ack.sequence);
        }
        match self.tasks.create(&record).await {
            // Exists: a worker already picked the task up and wrote its record.
            Ok(_) | Err(StateError::Exists(_)) => Ok(()),
            // The task is stored and will run: it is accepted. Answering `unavailable`
            // would make a producer without an idempotency key submit it twice. The worker
            // that claims it writes the record from the message headers.
            Err(e) => {
                warn!(task_id = %meta.id, cause = %e, "task stored but its record not written; the worker will write it");
                metrics::counter!(ax_sdk::metrics::RECORD_DEFERRED, "queue" => meta.queue.clone())
                    .increment(1);
                Ok(())
            }
        }
    }
}
