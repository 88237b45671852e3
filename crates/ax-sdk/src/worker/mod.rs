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

mod aging;
mod attempt;
mod beat;
mod claim;
mod config;
mod error;
mod fence;
pub mod fetch;
mod handler;
mod inflight;
mod labels;
pub(crate) mod options;
mod rate;
mod settle;
mod signals;
mod slots;
pub(crate) mod status;

pub use error::{TaskError, WorkerError};
pub use handler::Task;
pub use options::TaskOptions;
pub use status::WorkerStatus;

use crate::names::{self, Priority};
use crate::output::{IntoOutput, ResultStore};
use crate::state::TaskStore;
use async_nats::jetstream::{self, consumer::PullConsumer};
use config::Config;
use handler::boxed;
use std::future::Future;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A worker for one queue. Build with [`Worker::builder`].
pub struct Worker {
    config: Config,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("queue", &self.config.queue)
            .field("concurrency", &self.config.concurrency)
            .field("id", &self.config.id)
            .finish_non_exhaustive()
    }
}

/// Builder for [`Worker`].
pub struct WorkerBuilder {
    config: Config,
}

impl Worker {
    /// A builder for a worker of `queue` with the documented defaults.
    pub fn builder(queue: impl Into<String>) -> WorkerBuilder {
        WorkerBuilder {
            config: Config {
                queue: queue.into(),
                concurrency: 16,
                routes: Default::default(),
                id: format!("{}-{}", std::process::id(), nuid::next()),
                shutdown_grace: Duration::from_secs(30),
                idle_poll: Duration::from_millis(500),
                max_batch: 256,
                weights: fetch::DEFAULT_WEIGHTS,
                aging: None,
                lean_first_attempt: false,
                group_commit: crate::atomic::GroupCommit::Auto,
                faults: Default::default(),
                flags: Default::default(),
            },
        }
    }

    /// A handle on what this worker knows of its queue (ready, paused), for a health
    /// check: take it before [`run`](Self::run).
    pub fn status(&self) -> WorkerStatus {
        self.config.flags.status()
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
            q = self.config.queue
        );
        let queue = self.config.queue.clone();
        let group_commit = self.config.group_commit;
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
        fetch::run(
            self.config,
            js,
            (tasks, results),
            consumers,
            ack_wait,
            shutdown,
        )
        .await
    }
}

impl WorkerBuilder {
    /// Most tasks run at once by this worker (default 16).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.config.concurrency = n.max(1);
        self
    }
    /// The catch-all handler: runs every task whose name has no handler of its own
    /// ([`WorkerBuilder::task`]), once per attempt. It returns `()` or an output ([`Output`](crate::Output),
    /// or a `serde_json::Value`), stored with the task's `succeeded` write (see
    /// [`crate::output`]).
    pub fn handler<F, Fut, O>(mut self, f: F) -> Self
    where
        F: Fn(Task) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, TaskError>> + Send + 'static,
        O: IntoOutput + 'static,
    {
        self.config.routes.fallback = Some(boxed(f));
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
        self.config.routes.add(name.into(), options, boxed(f));
        self
    }
    /// Worker id stored in task records (default `<pid>-<nuid>`).
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.config.id = id.into();
        self
    }
    /// How long running handlers may finish after shutdown before they are aborted and
    /// handed back (default 30 s).
    pub fn shutdown_grace(mut self, d: Duration) -> Self {
        self.config.shutdown_grace = d;
        self
    }
    /// Expiry of the long-poll pull used when every priority is empty (default 500 ms).
    /// A task arriving while idle is delivered at once; this only bounds how stale an idle
    /// worker's view of its concurrency can get.
    pub fn idle_poll(mut self, d: Duration) -> Self {
        self.config.idle_poll = d.max(Duration::from_millis(10));
        self
    }
    /// Most messages per pull request (default 256).
    pub fn max_batch(mut self, n: usize) -> Self {
        self.config.max_batch = n.max(1);
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
        self.config.lean_first_attempt = on;
        self
    }
    /// Write the records of attempts that end at the same moment as one atomic batch:
    /// one stored write, one fsync under `sync_interval: always`, for many tasks
    /// ([`TaskStore::grouped`]). Default [`GroupCommit::Auto`](crate::atomic::GroupCommit):
    /// batches while the broker answers them faster than single writes (it fsyncs each
    /// write), single writes while not. `true` / `false` are `Always` / `Never`.
    pub fn group_commit(mut self, mode: impl Into<crate::atomic::GroupCommit>) -> Self {
        self.config.group_commit = mode.into();
        self
    }
    /// Runs with the faults of `faults` (tests; default: none).
    #[doc(hidden)]
    pub fn faults(mut self, faults: crate::faults::Faults) -> Self {
        self.config.faults = faults;
        self
    }
    /// Pick weights of high, normal and low (default 6 / 3 / 1), see [`fetch`].
    pub fn weights(mut self, weights: [u32; 3]) -> Self {
        self.config.weights = weights;
        self
    }
    /// Priority aging (default off): a priority whose oldest waiting task has waited
    /// `after` is picked as the one above it (`low` as `normal`), after twice `after` as
    /// the one above that (`low` as `high`), so old low-priority work is served sooner
    /// under a sustained high-priority load. Tasks are not moved (docs/PROTOCOL.md §3,
    /// "Priority aging").
    pub fn aging(mut self, after: Duration) -> Self {
        self.config.aging = Some(after.max(Duration::from_millis(1)));
        self
    }
    /// Finishes the builder.
    pub fn build(self) -> Result<Worker, WorkerError> {
        if !names::valid_queue(&self.config.queue) {
            return Err(WorkerError::InvalidQueue(self.config.queue));
        }
        if self.config.routes.is_empty() {
            return Err(WorkerError::NoHandler(self.config.queue));
        }
        Ok(Worker {
            config: self.config,
        })
    }
}
