//! The producer SDK: submit tasks and read their state.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use ax_sdk::{Client, Priority, TaskSpec};
//! use std::time::Duration;
//! let nats = async_nats::connect("nats://127.0.0.1:4222").await?;
//! let ax = Client::new(nats);
//! let accepted = ax
//!     .submit(
//!         "emails",
//!         TaskSpec::new("send_welcome")
//!             .json(&serde_json::json!({"to": "a@example.com"}))
//!             .priority(Priority::High)
//!             .delay(Duration::from_secs(60))
//!             .idempotency_key("welcome:user-42"),
//!     )
//!     .await?;
//! println!("task {}", accepted.id);
//! # Ok(()) }
//! ```

use crate::names::{self, Priority};
use crate::output::{ResultStore, TaskOutput};
use crate::protocol::{BackoffRequest, SubmitAccepted, SubmitReply, SubmitRequest, WireError};
use crate::state::{ListFilter, StateError, TaskRecord, TaskStore};
use base64::Engine;
use std::time::Duration;

/// A finished task: its final record and revision, and its output if it returned one.
#[derive(Debug, Clone)]
pub struct Finished {
    /// The `succeeded` or `dead` record.
    pub record: TaskRecord,
    /// Its revision.
    pub revision: u64,
    /// The handler's output (`succeeded` tasks that returned one).
    pub output: Option<TaskOutput>,
}

/// A task to submit: a builder over the wire [`SubmitRequest`]; unset options take the
/// server's defaults (normal priority, 5 attempts, 30 s timeout, 1 s..10 min backoff).
#[derive(Debug, Clone)]
pub struct TaskSpec(SubmitRequest);

impl TaskSpec {
    /// A task named `name` with a `null` JSON payload.
    pub fn new(name: impl Into<String>) -> TaskSpec {
        TaskSpec(SubmitRequest {
            name: name.into(),
            ..SubmitRequest::default()
        })
    }
    /// A JSON payload.
    pub fn json<T: serde::Serialize>(mut self, value: &T) -> TaskSpec {
        self.0.payload = Some(serde_json::to_value(value).expect("payload serializes to JSON"));
        self.0.payload_base64 = None;
        self
    }
    /// A binary payload.
    pub fn bytes(mut self, payload: &[u8]) -> TaskSpec {
        self.0.payload_base64 = Some(base64::engine::general_purpose::STANDARD.encode(payload));
        self.0.payload = None;
        self
    }
    /// Priority (default normal).
    pub fn priority(mut self, p: Priority) -> TaskSpec {
        self.0.priority = Some(p.as_str().to_string());
        self
    }
    /// Run after `d`.
    pub fn delay(mut self, d: Duration) -> TaskSpec {
        self.0.delay_ms = Some(d.as_millis().min(i64::MAX as u128) as i64);
        self
    }
    /// Run at an RFC 3339 time.
    pub fn run_at(mut self, rfc3339: impl Into<String>) -> TaskSpec {
        self.0.run_at = Some(rfc3339.into());
        self
    }
    /// Business idempotency key.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> TaskSpec {
        self.0.idempotency_key = Some(key.into());
        self
    }
    /// Debounce under `key`: the submits of one key in this queue become one task, run once
    /// the key has been quiet for `period` (at most `max_wait` after the burst's first
    /// submit: default 10 periods), with the last submit's payload and options (the first's
    /// with `keep_first`). Every submit of a burst answers the same task id. Not with a
    /// delay, a run time or an idempotency key (docs/PROTOCOL.md §2, "Debounce").
    pub fn debounce(mut self, key: impl Into<String>, period: Duration) -> TaskSpec {
        let d = self.0.debounce.get_or_insert_with(Default::default);
        d.key = key.into();
        d.period_ms = period.as_millis().min(i64::MAX as u128) as i64;
        self
    }
    /// The longest wait of a debounced task after its burst's first submit (with
    /// [`TaskSpec::debounce`]; default 10 periods).
    pub fn debounce_max_wait(mut self, max_wait: Duration) -> TaskSpec {
        let d = self.0.debounce.get_or_insert_with(Default::default);
        d.max_wait_ms = Some(max_wait.as_millis().min(i64::MAX as u128) as i64);
        self
    }
    /// A debounced task runs with its burst's first submit's payload and options rather
    /// than the last's (with [`TaskSpec::debounce`]).
    pub fn debounce_keep_first(mut self) -> TaskSpec {
        let d = self.0.debounce.get_or_insert_with(Default::default);
        d.keep = Some("first".into());
        self
    }
    /// Batch under `key`: the submits (items) of one key in this queue become one task
    /// whose payload is the JSON list of their payloads in the order stored, due once
    /// `size` items arrived or `timeout` after the batch's first item. The task has the
    /// name and options of its batch's first item; every item of a batch answers its id.
    /// A JSON payload only; not with a delay, a run time or a debounce. An idempotency key
    /// is the item's: a retried item is held once, and answers its batch's id
    /// (docs/PROTOCOL.md §2, "Batching").
    pub fn batch(mut self, key: impl Into<String>, size: usize, timeout: Duration) -> TaskSpec {
        self.0.batch = Some(crate::protocol::BatchRequest {
            key: key.into(),
            size: size.min(i64::MAX as usize) as i64,
            timeout_ms: timeout.as_millis().min(i64::MAX as u128) as i64,
        });
        self
    }
    /// The caller's W3C trace context (`00-<trace id>-<parent id>-<flags>`): every attempt
    /// of the task logs inside a span carrying it.
    pub fn traceparent(mut self, traceparent: impl Into<String>) -> TaskSpec {
        self.0.traceparent = Some(traceparent.into());
        self
    }
    /// The business id the task works for (an order number, a batch id): in its record
    /// and every attempt's logs.
    pub fn business_id(mut self, id: impl Into<String>) -> TaskSpec {
        self.0.business_id = Some(id.into());
        self
    }
    /// The key per-key limits count this task under (a customer id, a tenant).
    pub fn limit_key(mut self, key: impl Into<String>) -> TaskSpec {
        self.0.limit_key = Some(key.into());
        self
    }
    /// The tenant this task's fair share is counted under: tasks with a fair key reach
    /// workers in weighted fair order between tenants (docs/guides/limits.md, "Fair
    /// shares"); 1..=64 of `A-Z a-z 0-9 _ - . : @`.
    pub fn fair_key(mut self, key: impl Into<String>) -> TaskSpec {
        self.0.fair_key = Some(key.into());
        self
    }
    /// A singleton key: at most one task of `key` in this queue waits or runs at a time,
    /// and a submit that finds one that has not ended does what `on_collision` says —
    /// [`Collision::CancelNew`](crate::Collision::CancelNew) refuses it
    /// ([`crate::ClientError::Refused`] with code `running` and the holder's id in
    /// `task_id`), [`Collision::CancelInProgress`](crate::Collision::CancelInProgress)
    /// cancels the holder (its handler is told) and accepts it. 1..=64 of
    /// `A-Z a-z 0-9 _ - . : @`; not with a debounce or a batch key (docs/PROTOCOL.md §2,
    /// "Singleton keys").
    pub fn singleton(mut self, key: impl Into<String>, on_collision: crate::Collision) -> TaskSpec {
        self.0.singleton = Some(crate::protocol::SingletonRequest {
            key: key.into(),
            on_collision: on_collision.as_str().into(),
        });
        self
    }
    /// Attempts in all (default 5).
    pub fn max_attempts(mut self, n: u32) -> TaskSpec {
        self.0.max_attempts = Some(i64::from(n));
        self
    }
    /// Hard timeout of one attempt (default 30 s).
    pub fn timeout(mut self, d: Duration) -> TaskSpec {
        self.0.timeout_ms = Some(d.as_millis().min(i64::MAX as u128) as i64);
        self
    }
    /// Backoff base, max and jitter fraction.
    pub fn backoff(mut self, base: Duration, max: Duration, jitter: f64) -> TaskSpec {
        self.0.backoff = Some(BackoffRequest {
            base_ms: Some(base.as_millis() as i64),
            max_ms: Some(max.as_millis() as i64),
            jitter: Some(jitter),
        });
        self
    }
    /// Retry only these error classes.
    pub fn retry_on<I: IntoIterator<Item = S>, S: Into<String>>(mut self, classes: I) -> Self {
        self.0.retry_on = Some(classes.into_iter().map(Into::into).collect());
        self
    }
    /// Never retry these error classes.
    pub fn no_retry_on<I: IntoIterator<Item = S>, S: Into<String>>(mut self, classes: I) -> Self {
        self.0.no_retry_on = Some(classes.into_iter().map(Into::into).collect());
        self
    }
    /// A task from a wire request as it is (e.g. a line of `ax submit --file`).
    pub fn from_request(request: SubmitRequest) -> TaskSpec {
        TaskSpec(request)
    }
    /// The wire request.
    pub fn into_request(self) -> SubmitRequest {
        self.0
    }
}

/// Errors of the producer client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server refused the task (see [`WireError::code`]).
    #[error("submit refused: {0}")]
    Refused(#[from] WireError),
    /// No reply: no ax server is listening, or it timed out. The task may or may not have
    /// been accepted; resubmit with an idempotency key to be sure.
    #[error("submit request: {0}")]
    Request(#[from] async_nats::RequestError),
    /// The reply was not valid JSON of the protocol's shape.
    #[error("bad reply: {0}")]
    BadReply(#[from] serde_json::Error),
    /// Reading task state failed.
    #[error(transparent)]
    State(#[from] StateError),
    /// Reading a flow run failed.
    #[error(transparent)]
    Flows(#[from] crate::flow::store::FlowStoreError),
    /// A wait could not follow its record: the subscription that wakes it failed.
    #[error(transparent)]
    Follow(#[from] crate::key_wait::FollowError),
    /// Reading a task's output from `AX_RESULTS` failed, or the output it names is gone.
    #[error("task {id}: output not readable: {source}")]
    Output {
        /// Task id.
        id: String,
        /// Why.
        source: async_nats::Error,
    },
}

impl ClientError {
    /// What kind of failure this is: a refusal's kind follows its code (`busy` and
    /// `unavailable` are [`ErrorKind::Unavailable`](crate::error::ErrorKind::Unavailable),
    /// `not_found` and `unknown_queue` are `NotFound`, …); no answer is `TimedOut`, no
    /// server listening `Unavailable`.
    pub fn kind(&self) -> crate::error::ErrorKind {
        use crate::error::ErrorKind;
        match self {
            ClientError::Refused(e) => e.kind(),
            ClientError::Request(e) => ErrorKind::of(e),
            ClientError::BadReply(_) => ErrorKind::Invalid,
            ClientError::State(e) => e.kind(),
            ClientError::Flows(e) => e.kind(),
            ClientError::Output { source, .. } => ErrorKind::of(source.as_ref()),
            ClientError::Follow(e) => ErrorKind::of(e.source.as_ref()),
        }
    }
}

/// A producer handle: cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    pub(crate) nats: async_nats::Client,
    wait_for_server: Duration,
    /// The buckets it reads, opened on first use (an open is a round trip to JetStream)
    /// and shared by the clones; a failed open is tried again at the next call.
    tasks: std::sync::Arc<tokio::sync::OnceCell<TaskStore>>,
    pub(crate) flows: std::sync::Arc<tokio::sync::OnceCell<crate::flow::store::FlowStore>>,
    /// Submits published straight to JetStream ([`Client::direct_submits`]); `None`: by
    /// request to a server.
    direct: Option<std::sync::Arc<crate::direct::Direct>>,
}

/// Direct publishes of one [`Client::submit_many`] awaiting their acknowledgement at once.
const DIRECT_IN_FLIGHT: usize = 1024;

/// Default of [`Client::wait_for_server`].
pub const DEFAULT_WAIT_FOR_SERVER: Duration = Duration::from_secs(30);

impl Client {
    /// Wraps a connected NATS client.
    pub fn new(nats: async_nats::Client) -> Client {
        Client {
            nats,
            wait_for_server: DEFAULT_WAIT_FOR_SERVER,
            tasks: Default::default(),
            flows: Default::default(),
            direct: None,
        }
    }

    /// Submits a task without an idempotency key by publishing its message to JetStream
    /// itself, as the server would store it (docs/PROTOCOL.md §2, "Direct submits"): no ax
    /// server on its path, one round trip to the broker. The task is validated here with
    /// the default bounds ([`Limits`](crate::Limits)), its queue must be declared,
    /// and a full queue is refused `busy`, as by a server. Tasks with an idempotency key
    /// still go by request. Default off; the producer needs publish permission on its
    /// queues' subjects (`deploy/nats-auth.conf`).
    pub fn direct_submits(mut self, on: bool) -> Client {
        self.direct =
            on.then(|| std::sync::Arc::new(crate::direct::Direct::new(self.nats.clone())));
        self
    }

    /// How long a request waits for an ax server to appear when none is listening yet
    /// (NATS answers "no responders": nothing was received, so retrying is safe, even
    /// without an idempotency key). Default 30 s; zero fails at once.
    pub fn wait_for_server(mut self, wait: Duration) -> Client {
        self.wait_for_server = wait;
        self
    }

    /// A request that waits (with backoff, one log line) while no server listens.
    pub(crate) async fn request(
        &self,
        subject: String,
        body: bytes::Bytes,
    ) -> Result<async_nats::Message, async_nats::RequestError> {
        let started = std::time::Instant::now();
        let mut pause = Duration::from_millis(50);
        let mut told = false;
        loop {
            match self.nats.request(subject.clone(), body.clone()).await {
                Err(e)
                    if e.kind() == async_nats::RequestErrorKind::NoResponders
                        && started.elapsed() + pause < self.wait_for_server =>
                {
                    if !told {
                        tracing::info!(%subject, wait = ?self.wait_for_server,
                            "no ax server answers yet; waiting for one");
                        told = true;
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                other => return other,
            }
        }
    }

    /// Submits a task to `queue` and waits for the server's answer.
    pub async fn submit(&self, queue: &str, task: TaskSpec) -> Result<SubmitAccepted, ClientError> {
        if let Some(direct) = self
            .direct
            .as_ref()
            .filter(|_| crate::direct::Direct::takes(&task.0))
        {
            return direct
                .submit(queue, task.0)
                .await
                .map_err(ClientError::Refused);
        }
        let body = serde_json::to_vec(&task.0).expect("request serializes");
        self.submit_raw(queue, body).await
    }

    /// Submits a raw JSON body (for tools and tests of the wire protocol).
    pub async fn submit_raw(
        &self,
        queue: &str,
        body: Vec<u8>,
    ) -> Result<SubmitAccepted, ClientError> {
        let msg = self
            .request(names::submit_subject(queue), body.into())
            .await?;
        match serde_json::from_slice::<SubmitReply>(&msg.payload)? {
            SubmitReply::Accepted(a) => Ok(a),
            SubmitReply::Error { error } => Err(ClientError::Refused(error)),
        }
    }

    /// Submits many tasks to `queue` in batch requests (docs/PROTOCOL.md §2, "Many tasks in one request") and returns
    /// one answer per task, in order: each task is accepted or refused on its own.
    ///
    /// Tasks are sent in batches of at most [`MAX_BATCH`](crate::protocol::MAX_BATCH) that
    /// fit the server's largest message, up to four batches in flight. A batch that gets no
    /// answer (a timeout, no server) gives each of its tasks an `unavailable` refusal whose
    /// message says the task may or may not be stored: resubmit those with idempotency keys
    /// to be sure.
    pub async fn submit_many<I>(
        &self,
        queue: &str,
        tasks: I,
    ) -> Vec<Result<SubmitAccepted, WireError>>
    where
        I: IntoIterator<Item = TaskSpec>,
    {
        use futures::StreamExt;
        let tasks: Vec<TaskSpec> = tasks.into_iter().collect();
        if let Some(direct) = self
            .direct
            .as_ref()
            .filter(|_| tasks.iter().all(|t| crate::direct::Direct::takes(&t.0)))
        {
            // One publish a task, many in flight, answers in order.
            return futures::stream::iter(tasks)
                .map(|t| direct.submit(queue, t.0))
                .buffered(DIRECT_IN_FLIGHT)
                .collect()
                .await;
        }
        let max_bytes = self.nats.server_info().max_payload.max(64 * 1024) - 1024;
        let mut batches: Vec<(usize, Vec<u8>)> = Vec::new();
        let mut body = Vec::new();
        let mut count = 0usize;
        for task in tasks {
            let one = serde_json::to_vec(&task.0).expect("request serializes");
            if count > 0
                && (count == crate::protocol::MAX_BATCH || body.len() + one.len() + 2 > max_bytes)
            {
                body.push(b']');
                batches.push((count, std::mem::take(&mut body)));
                count = 0;
            }
            body.push(if count == 0 { b'[' } else { b',' });
            body.extend_from_slice(&one);
            count += 1;
        }
        if count > 0 {
            body.push(b']');
            batches.push((count, body));
        }
        let subject = names::submit_subject(queue);
        let answers: Vec<Vec<Result<SubmitAccepted, WireError>>> = futures::stream::iter(batches)
            .map(|(count, body)| {
                let subject = subject.clone();
                async move { self.submit_batch(subject, count, body).await }
            })
            .buffered(4)
            .collect()
            .await;
        answers.into_iter().flatten().collect()
    }

    /// Sends one batch of `count` tasks; every failure becomes a refusal of each task.
    async fn submit_batch(
        &self,
        subject: String,
        count: usize,
        body: Vec<u8>,
    ) -> Vec<Result<SubmitAccepted, WireError>> {
        let each = |error: WireError| vec![Err(error); count];
        let msg = match self.request(subject, body.into()).await {
            Ok(msg) => msg,
            Err(e) => {
                return each(WireError::new(
                    crate::protocol::ErrorCode::Unavailable,
                    format!("no answer to the batch ({e}): the task may or may not be stored"),
                ))
            }
        };
        match serde_json::from_slice::<Vec<SubmitReply>>(&msg.payload) {
            Ok(replies) if replies.len() == count => replies
                .into_iter()
                .map(|r| match r {
                    SubmitReply::Accepted(a) => Ok(a),
                    SubmitReply::Error { error } => Err(error),
                })
                .collect(),
            Ok(replies) => each(WireError::new(
                crate::protocol::ErrorCode::Unavailable,
                format!("{} answers to a batch of {count}: the task may or may not be stored", replies.len()),
            )),
            Err(_) => match serde_json::from_slice::<SubmitReply>(&msg.payload) {
                Ok(SubmitReply::Error { error }) => each(error),
                _ => each(WireError::new(
                    crate::protocol::ErrorCode::Unavailable,
                    "a batch answer that is not JSON of the protocol's shape: the task may or may not be stored",
                )),
            },
        }
    }

    async fn store(&self) -> Result<TaskStore, ClientError> {
        let open =
            || async { TaskStore::open(&async_nats::jetstream::new(self.nats.clone())).await };
        Ok(self.tasks.get_or_try_init(open).await?.clone())
    }

    /// The current record of a task and its revision. A task whose submit stored no
    /// record and that no worker has claimed yet answers the `pending` record its message
    /// stands for, at revision 0 ([`TaskStore::find`]).
    pub async fn task(&self, id: &str) -> Result<Option<(TaskRecord, u64)>, ClientError> {
        Ok(self.store().await?.find(id).await?)
    }

    /// The task's stored record and its revision, if it has one: a single read. A task
    /// whose submit stored no record and that no worker has claimed yet has none; poll
    /// with this, and look such a task up once with [`Client::task`] (which walks its
    /// queue's ready messages to find it).
    pub async fn record(&self, id: &str) -> Result<Option<(TaskRecord, u64)>, ClientError> {
        Ok(self.store().await?.get(id).await?)
    }

    /// A task's stored transitions, oldest first.
    pub async fn history(&self, id: &str) -> Result<Vec<(TaskRecord, u64)>, ClientError> {
        Ok(self.store().await?.history(id).await?)
    }

    /// A request to a management API (`<prefix><op>`), its `ok` value or its refusal.
    /// Sends a typed request of one of the request APIs (`ax.<api>.<op>`) and returns its
    /// `ok` value; an `error` answer is [`ClientError::Refused`].
    pub async fn call<R: crate::api::Request>(
        &self,
        request: &R,
    ) -> Result<serde_json::Value, ClientError> {
        let (op, body) = request.encode();
        self.management(R::API.prefix(), &op, &body).await
    }

    pub(crate) async fn management(
        &self,
        prefix: &str,
        op: &str,
        body: &serde_json::Value,
    ) -> Result<serde_json::Value, ClientError> {
        let payload = serde_json::to_vec(body).expect("JSON serializes");
        let msg = self
            .request(format!("{prefix}{op}"), payload.into())
            .await?;
        let mut reply: serde_json::Value = serde_json::from_slice(&msg.payload)?;
        if let Some(error) = reply.get("error") {
            return Err(ClientError::Refused(serde_json::from_value(error.clone())?));
        }
        Ok(reply["ok"].take())
    }

    /// Waits until task `id` is finished (`succeeded`, `dead` or `cancelled`) and returns
    /// its final record with its output. Pushed, not polled, and without a consumer
    /// ([`crate::key_wait`]): a core subscription to the record's subject wakes it, and a
    /// read from the bucket's leader confirms; it returns at once for a finished task and
    /// within a round trip of the final write otherwise (a task with no record yet is
    /// waited for too). The subscription ends with the wait: any number of waits leave
    /// nothing on the server. It has no deadline of its own: wrap it in
    /// `tokio::time::timeout`.
    pub async fn wait(&self, id: &str) -> Result<Finished, ClientError> {
        let store = self.store().await?;
        let subject = store.subject(id);
        let (record, revision) = crate::key_wait::until(
            &self.nats,
            subject,
            |msg| {
                serde_json::from_slice::<TaskRecord>(&msg.payload)
                    .map_or(true, |rec| rec.state.is_terminal())
            },
            || async {
                Ok::<_, ClientError>(
                    store
                        .get_latest(id)
                        .await?
                        .filter(|(rec, _)| rec.state.is_terminal()),
                )
            },
        )
        .await?;
        let output = self.output(&record).await?;
        Ok(Finished {
            record,
            revision,
            output,
        })
    }

    /// The output of a finished task's record: inline, or read from `AX_RESULTS`.
    pub async fn output(&self, record: &TaskRecord) -> Result<Option<TaskOutput>, ClientError> {
        let Some(stored) = &record.output else {
            return Ok(None);
        };
        if let Some(out) = stored.inline() {
            return Ok(Some(out));
        }
        let failed = |source: async_nats::Error| ClientError::Output {
            id: record.id.clone(),
            source,
        };
        let results = ResultStore::open(&async_nats::jetstream::new(self.nats.clone()))
            .await
            .map_err(failed)?;
        match results.read(stored).await.map_err(failed)? {
            Some(out) => Ok(Some(out)),
            None => Err(failed(
                format!("no entry {:?} in AX_RESULTS", stored.key).into(),
            )),
        }
    }

    /// Task records matching `filter`.
    pub async fn list(&self, filter: &ListFilter) -> Result<Vec<TaskRecord>, ClientError> {
        Ok(self.store().await?.list(filter).await?)
    }
}
