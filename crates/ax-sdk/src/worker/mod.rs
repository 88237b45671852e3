//! The Rust worker SDK: pull tasks of one queue, run a handler, report the result.
//!
//! ```no_run
//! # async fn demo(client: async_nats::Client) -> Result<(), ax_sdk::worker::WorkerError> {
//! use ax_sdk::worker::{Task, TaskError, Worker};
//! let worker = Worker::builder("emails")
//!     .concurrency(32)
//!     .handler(|task: Task| async move {
//!         let to: String = task.json()?;
//!         if to.is_empty() {
//!             return Err(TaskError::permanent("validation", "no recipient"));
//!         }
//!         Ok(())
//!     })
//!     .build()?;
//! worker.run(client, tokio_util::sync::CancellationToken::new()).await
//! # }
//! ```
//!
//! A worker may serve several task names, each with its own handler and options (which
//! apply where the submit left them unset), and return outputs:
//!
//! ```no_run
//! # fn demo() -> Result<ax_sdk::worker::Worker, ax_sdk::worker::WorkerError> {
//! use ax_sdk::worker::{Task, TaskOptions, Worker};
//! use std::time::Duration;
//! Worker::builder("media")
//!     .task_with(
//!         "resize",
//!         TaskOptions::new().timeout(Duration::from_secs(120)).max_attempts(3).concurrency(4),
//!         |task: Task| async move {
//!             let width: u32 = task.json()?;
//!             Ok(serde_json::json!({ "width": width, "url": "s3://bucket/thumb.png" }))
//!         },
//!     )
//!     .task("ping", |_task: Task| async { Ok(()) })
//!     .build()
//! # }
//! ```
//!
//! What the SDK guarantees (see docs/ARCHITECTURE.md for the why):
//! - **Ack after success only**: a task is acknowledged after its handler returned
//!   `Ok` and the `succeeded` state was written under the attempt's fencing token.
//! - **Retries**: a retryable error writes `retrying` and naks with the task's exponential
//!   backoff + jitter; a non-retryable error, or the last attempt, writes `dead`, publishes a
//!   dead letter to `ax.dead.<queue>` and terminates the message.
//! - **Hard timeout**: the handler future is dropped when the task's timeout passes.
//! - **Soft timeout**: with [`TaskOptions::heartbeat_timeout`], a handler that has not
//!   called [`Task::heartbeat`] for that long is dropped too, the attempt failed with class
//!   `heartbeat_timeout`.
//! - **Stored settings**: a name's settings stored apart from code ([`crate::settings`])
//!   go over its declared options from the next attempt, without a restart.
//! - **Heartbeats**: while a task is held the SDK sends `+WPI` every ack-wait / 3;
//!   a worker that stops (crash, SIGSTOP) has the task redelivered after the ack wait, and
//!   its late result is refused by compare-and-set on the task record (nats-server #4786).
//! - **Priority**: see [`fetch`] for the pick policy.
//! - **Shutdown**: cancel the token to stop pulling; running handlers get
//!   [`WorkerBuilder::shutdown_grace`] to finish, then are aborted and handed back (nak).

mod attempt;
mod beat;
mod claim;
mod fence;
pub mod fetch;
mod inflight;
mod labels;
pub(crate) mod options;
mod rate;
mod settle;
mod slots;
pub(crate) mod status;

pub use options::TaskOptions;
pub use status::WorkerStatus;

use crate::names::{self, Priority};
use crate::output::{IntoOutput, Output, ResultStore};
use crate::state::TaskStore;
use crate::task::ContentType;
use async_nats::jetstream::{self, consumer::PullConsumer};
use bytes::Bytes;
use futures::future::BoxFuture;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A task as the handler sees it.
#[derive(Debug, Clone)]
pub struct Task {
    /// Task id.
    pub id: String,
    /// Task name.
    pub name: String,
    /// Queue.
    pub queue: String,
    /// Priority.
    pub priority: Priority,
    /// The payload bytes (JSON text unless submitted as `payload_base64`).
    pub payload: Bytes,
    /// True if the payload is JSON.
    pub is_json: bool,
    /// This attempt, 1-based.
    pub attempt: u32,
    /// Attempts allowed in all.
    pub max_attempts: u32,
    /// Business idempotency key, if the producer gave one.
    pub idempotency_key: Option<String>,
    /// When the task was accepted, ms since the Unix epoch.
    pub created_at_ms: u64,
    /// Due time of a delayed task, ms since the Unix epoch.
    pub run_at_ms: Option<u64>,
    /// The W3C trace context the task was submitted with, if any.
    pub traceparent: Option<String>,
    /// The business id the task works for, if the producer (or its flow run) gave one.
    pub business_id: Option<String>,
    pub(crate) fence: Arc<fence::Fence>,
    pub(crate) cancel: tokio_util::sync::CancellationToken,
    pub(crate) beats: Arc<beat::Beats>,
}

impl Task {
    /// The fencing token of this attempt: the revision of its `running` record,
    /// strictly greater than any earlier attempt's token for this task. Pass it to systems
    /// you write to, and have them refuse writes with a smaller token.
    ///
    /// A task's first attempt starts without its `running` write (docs/PROTOCOL.md §3);
    /// asking for the token makes that write now (one round trip), so only handlers that
    /// use fencing pay for it. Errors: `overtaken` (another attempt took the task over:
    /// stop, this attempt's result will be refused) or `unavailable` (JetStream could not
    /// be reached; retryable).
    pub async fn fencing_token(&self) -> Result<u64, TaskError> {
        self.fence.token().await
    }

    /// Cancelled when an operator cancels this task while the attempt runs. The worker
    /// then drops the handler's future (as on a timeout) and records the task
    /// `cancelled`; work the handler spawned elsewhere can watch this token to stop too.
    pub fn cancellation(&self) -> tokio_util::sync::CancellationToken {
        self.cancel.clone()
    }

    /// Says the handler still makes progress. A name with a soft timeout
    /// ([`TaskOptions::heartbeat_timeout`], or the stored setting `heartbeat_timeout_ms`)
    /// must call this at least that often, or the attempt is stopped and failed with class
    /// `heartbeat_timeout`; without one it costs an atomic add. The broker's ack-wait
    /// heartbeat is separate and automatic.
    pub fn heartbeat(&self) {
        self.beats.beat();
    }

    /// Decodes the JSON payload; a decode error is a non-retryable `bad_payload`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, TaskError> {
        serde_json::from_slice(&self.payload)
            .map_err(|e| TaskError::permanent("bad_payload", e.to_string()))
    }
}

/// A handler's failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{class}: {message}")]
pub struct TaskError {
    /// Error class, matched against the task's `retry_on` / `no_retry_on`.
    pub class: String,
    /// Message, stored as the task's last error.
    pub message: String,
    /// Never retry, whatever the task's lists say.
    pub permanent: bool,
    /// More than the message (a stack trace, a response body), kept in the record's
    /// `last_error.detail` up to 8 KiB and shown on the console's task page.
    pub detail: Option<String>,
}

impl TaskError {
    /// A failure that is retried unless the task's lists refuse its class.
    pub fn new(class: impl Into<String>, message: impl Into<String>) -> Self {
        TaskError {
            class: class.into(),
            message: message.into(),
            permanent: false,
            detail: None,
        }
    }

    /// Adds a detail (a stack trace, a response body) to the error.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// The downstream pushes back (an HTTP 429, a slow database): a retried failure of
    /// class `pressure`, which lowers the rate of an adaptive limit that applies to the
    /// task (docs/PROTOCOL.md §7, "Adaptive rates").
    pub fn pressure(message: impl Into<String>) -> Self {
        TaskError::new(crate::limits::model::PRESSURE_CLASS, message)
    }

    /// A failure that is never retried.
    pub fn permanent(class: impl Into<String>, message: impl Into<String>) -> Self {
        TaskError {
            permanent: true,
            ..TaskError::new(class, message)
        }
    }
}

type Handler = Arc<dyn Fn(Task) -> BoxFuture<'static, Result<Output, TaskError>> + Send + Sync>;

fn boxed<F, Fut, O>(f: F) -> Handler
where
    F: Fn(Task) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<O, TaskError>> + Send + 'static,
    O: IntoOutput + 'static,
{
    Arc::new(move |task| {
        let run = f(task);
        Box::pin(async move { run.await.map(IntoOutput::into_output) })
    })
}

/// Errors that stop a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// No handler was set.
    #[error("worker for queue {0}: no handler set")]
    NoHandler(String),
    /// The queue name is invalid.
    #[error("invalid queue name {0:?}")]
    InvalidQueue(String),
    /// The queue's consumers do not exist.
    #[error("queue {queue} is not declared (run `ax streams apply --queue {queue}`): {source}")]
    QueueNotDeclared {
        /// Queue.
        queue: String,
        /// Lookup error.
        source: async_nats::Error,
    },
    /// Opening the task bucket failed.
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    /// The broker failed.
    #[error("worker {op}: {source}")]
    Broker {
        /// Operation.
        op: &'static str,
        /// Underlying error.
        source: async_nats::Error,
    },
}

impl WorkerError {
    /// What kind of failure this is.
    pub fn kind(&self) -> crate::error::ErrorKind {
        use crate::error::ErrorKind;
        match self {
            WorkerError::NoHandler(_) | WorkerError::InvalidQueue(_) => ErrorKind::Invalid,
            WorkerError::QueueNotDeclared { .. } => ErrorKind::NotFound,
            WorkerError::State(e) => e.kind(),
            WorkerError::Broker { source, .. } => ErrorKind::of(source.as_ref()),
        }
    }
}

/// A worker for one queue. Build with [`Worker::builder`].
pub struct Worker {
    queue: String,
    concurrency: usize,
    routes: options::Routes,
    id: String,
    shutdown_grace: Duration,
    idle_poll: Duration,
    max_batch: usize,
    weights: [u32; 3],
    lean_first_attempt: bool,
    group_commit: crate::atomic::GroupCommit,
    flags: status::Flags,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("queue", &self.queue)
            .field("concurrency", &self.concurrency)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// Builder for [`Worker`].
pub struct WorkerBuilder {
    worker: Worker,
}

impl Worker {
    /// A builder for a worker of `queue` with the documented defaults.
    pub fn builder(queue: impl Into<String>) -> WorkerBuilder {
        WorkerBuilder {
            worker: Worker {
                queue: queue.into(),
                concurrency: 16,
                routes: Default::default(),
                id: format!("{}-{}", std::process::id(), nuid::next()),
                shutdown_grace: Duration::from_secs(30),
                idle_poll: Duration::from_millis(500),
                max_batch: 256,
                weights: fetch::DEFAULT_WEIGHTS,
                lean_first_attempt: false,
                group_commit: crate::atomic::GroupCommit::Auto,
                flags: Default::default(),
            },
        }
    }

    /// A handle on what this worker knows of its queue (ready, paused), for a health
    /// check: take it before [`run`](Self::run).
    pub fn status(&self) -> WorkerStatus {
        self.flags.status()
    }

    /// Pulls and runs tasks until `shutdown` is cancelled, then drains (see module docs).
    ///
    /// A worker may start before NATS, JetStream or any ax server: until its queue's
    /// consumers and the task bucket exist it waits, retrying with backoff, and says so in
    /// one log line. It learns the ack wait from its consumers.
    pub async fn run(
        self,
        client: async_nats::Client,
        shutdown: CancellationToken,
    ) -> Result<(), WorkerError> {
        let js = jetstream::new(client);
        let what = format!(
            "queue {q} to be declared (by an ax server, or `ax streams apply --queue {q}`)",
            q = self.queue
        );
        let queue = self.queue.clone();
        let group_commit = self.group_commit;
        let ready = crate::retry::until_ok(&what, &shutdown, || {
            let (js, queue) = (js.clone(), queue.clone());
            async move {
                let tasks = TaskStore::open(&js).await?.grouped(group_commit);
                let mut consumers: Vec<PullConsumer> = Vec::with_capacity(3);
                for p in Priority::ALL {
                    let name = names::consumer_name(&queue, p);
                    let consumer = js
                        .get_consumer_from_stream(&name, &p.ready_stream())
                        .await
                        .map_err(|e| WorkerError::QueueNotDeclared {
                            queue: queue.clone(),
                            source: e.into(),
                        })?;
                    consumers.push(consumer);
                }
                let results =
                    ResultStore::open(&js)
                        .await
                        .map_err(|source| WorkerError::Broker {
                            op: "open the AX_RESULTS bucket",
                            source,
                        })?;
                Ok::<_, WorkerError>((tasks, results, consumers))
            }
        })
        .await;
        let Some((tasks, results, consumers)) = ready else {
            return Ok(()); // shut down while waiting
        };
        let ack_wait = consumers[0].cached_info().config.ack_wait;
        fetch::run(self, js, (tasks, results), consumers, ack_wait, shutdown).await
    }
}

impl WorkerBuilder {
    /// Most tasks run at once by this worker (default 16).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.worker.concurrency = n.max(1);
        self
    }
    /// The catch-all handler: runs every task whose name has no handler of its own
    /// ([`WorkerBuilder::task`]), once per attempt. It returns `()` or an output ([`Output`],
    /// or a `serde_json::Value`), stored with the task's `succeeded` write (see
    /// [`crate::output`]).
    pub fn handler<F, Fut, O>(mut self, f: F) -> Self
    where
        F: Fn(Task) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, TaskError>> + Send + 'static,
        O: IntoOutput + 'static,
    {
        self.worker.routes.fallback = Some(boxed(f));
        self
    }
    /// The handler of tasks named `name`. Without a catch-all [`WorkerBuilder::handler`],
    /// a task of a name this worker does not serve is handed back (nak with a delay of one
    /// second per delivery so far, at most 30 s, for a worker that serves it) and counted in
    /// `ax_worker_unserved_total`; it is not failed and no attempt is counted.
    pub fn task<F, Fut, O>(self, name: impl Into<String>, f: F) -> Self
    where
        F: Fn(Task) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, TaskError>> + Send + 'static,
        O: IntoOutput + 'static,
    {
        self.task_with(name, TaskOptions::new(), f)
    }
    /// Like [`WorkerBuilder::task`], with options for this name (timeout, attempts,
    /// backoff, retry lists, concurrency) that apply where the submit left them unset.
    pub fn task_with<F, Fut, O>(
        mut self,
        name: impl Into<String>,
        options: TaskOptions,
        f: F,
    ) -> Self
    where
        F: Fn(Task) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, TaskError>> + Send + 'static,
        O: IntoOutput + 'static,
    {
        self.worker.routes.add(name.into(), options, boxed(f));
        self
    }
    /// Worker id stored in task records (default `<pid>-<nuid>`).
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.worker.id = id.into();
        self
    }
    /// How long running handlers may finish after shutdown before they are aborted and
    /// handed back (default 30 s).
    pub fn shutdown_grace(mut self, d: Duration) -> Self {
        self.worker.shutdown_grace = d;
        self
    }
    /// Expiry of the long-poll pull used when every priority is empty (default 500 ms).
    /// A task arriving while idle is delivered at once; this only bounds how stale an idle
    /// worker's view of its concurrency can get.
    pub fn idle_poll(mut self, d: Duration) -> Self {
        self.worker.idle_poll = d.max(Duration::from_millis(10));
        self
    }
    /// Most messages per pull request (default 256).
    pub fn max_batch(mut self, n: usize) -> Self {
        self.worker.max_batch = n.max(1);
        self
    }
    /// Start an immediate task's first attempt without its `running` write (default
    /// off; docs/PROTOCOL.md §3, "the lean first attempt"): the write is made when the
    /// handler calls [`Task::fencing_token`] or after one second. It saves one stored write
    /// per quick task, but a result write that fails for longer than the ack wait less a
    /// heartbeat (a broker restart with a short ack wait) runs such a task again where the
    /// written `running` would have kept it from starting; on this machine it bought no
    /// measurable throughput (docs/PERFORMANCE.md), so it is off unless asked for.
    pub fn lean_first_attempt(mut self, on: bool) -> Self {
        self.worker.lean_first_attempt = on;
        self
    }
    /// Write the records of attempts that end at the same moment as one atomic batch:
    /// one stored write, one fsync under `sync_interval: always`, for many tasks
    /// ([`TaskStore::grouped`]). Default [`GroupCommit::Auto`](crate::atomic::GroupCommit):
    /// batches while the broker answers them faster than single writes (it fsyncs each
    /// write), single writes while not. `true` / `false` are `Always` / `Never`.
    pub fn group_commit(mut self, mode: impl Into<crate::atomic::GroupCommit>) -> Self {
        self.worker.group_commit = mode.into();
        self
    }
    /// Pick weights of high, normal and low (default 6 / 3 / 1), see [`fetch`].
    pub fn weights(mut self, weights: [u32; 3]) -> Self {
        self.worker.weights = weights;
        self
    }
    /// Finishes the builder.
    pub fn build(self) -> Result<Worker, WorkerError> {
        if !names::valid_queue(&self.worker.queue) {
            return Err(WorkerError::InvalidQueue(self.worker.queue));
        }
        if self.worker.routes.is_empty() {
            return Err(WorkerError::NoHandler(self.worker.queue));
        }
        Ok(self.worker)
    }
}

pub(crate) fn is_json(ct: ContentType) -> bool {
    ct == ContentType::Json
}
