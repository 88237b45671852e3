//! `ax server`: applies the topology, answers submit requests, dispatches delayed tasks.
//!
//! Any number of servers may run against one NATS: submit handlers share the queue group
//! `ax`; delayed tasks are split into partitions, each indexed and dispatched by one server
//! (`schedule::partitions`), and a dispatch is idempotent (message ids, delete by
//! sequence), so a partition moving between servers never runs a task twice.

use crate::flow::api::FlowApi;
use crate::flow::engine::FlowEngine;
use crate::flow::store::FlowStore;
use crate::limits::api::LimitApi;
use crate::schedule::partitions::Partitions;
use crate::schedule::{Scheduler, Totals};
use crate::streams::{self, Outcome, StreamsError, Topology};
use crate::submit::Admission;
use crate::trigger::api::TriggerApi;
use crate::trigger::clock::{Clock, SystemClock};
use crate::trigger::engine::Engine;
use crate::trigger::events::EventRouter;
use crate::trigger::store::TriggerStore;
use ax_sdk::api::Api;
use ax_sdk::metrics as m;
use ax_sdk::names::{self, TRIGGER_API_PREFIX};
use ax_sdk::retry;
use ax_sdk::state::StateError;
use ax_sdk::supervisor::Supervisor;
use ax_sdk::task::Limits;
use futures::{FutureExt, StreamExt};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

pub(crate) mod handle;

/// Errors that stop a server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Applying streams failed.
    #[error(transparent)]
    Streams(#[from] StreamsError),
    /// Opening a bucket failed.
    #[error(transparent)]
    State(#[from] StateError),
    /// Opening the trigger or flow buckets failed.
    #[error(transparent)]
    Buckets(#[from] ax_sdk::typed_kv::KvError),
    /// The console could not start.
    #[error(transparent)]
    Console(#[from] crate::console::ConsoleError),
    /// Registering the service `ax` or one of its endpoints failed.
    #[error("service endpoint {subject}: {source}")]
    Service {
        /// Subject.
        subject: String,
        /// Underlying error.
        source: async_nats::Error,
    },
    /// Subscribing to the submit subject failed.
    #[error("subscribe to {subject}: {source}")]
    Subscribe {
        /// Subject.
        subject: String,
        /// Underlying error.
        source: async_nats::SubscribeError,
    },
}

impl ServerError {
    /// What kind of failure this is.
    pub fn kind(&self) -> ax_sdk::error::ErrorKind {
        use ax_sdk::error::ErrorKind;
        match self {
            ServerError::Streams(e) => e.kind(),
            ServerError::State(e) => e.kind(),
            ServerError::Buckets(e) => e.kind(),
            ServerError::Subscribe { source, .. } => ErrorKind::of(source),
            ServerError::Service { source, .. } => ErrorKind::of(source.as_ref()),
            ServerError::Console(_) => ErrorKind::Invalid,
        }
    }
}

/// Server settings. Build with [`Server::builder`].
#[derive(Debug, Clone)]
pub struct Server {
    queues: Vec<String>,
    topology: Topology,
    limits: Limits,
    apply_streams: bool,
    max_inflight_submits: usize,
    dispatch_lookahead: Duration,
    dispatch_horizon: Duration,
    max_inflight_dispatch: usize,
    triggers: bool,
    trigger_engine: bool,
    flow_engine: bool,
    task_index: bool,
    console: Option<crate::console::ConsoleConfig>,
    alerts: crate::ops::AlertConfig,
    max_held_bytes: usize,
    lease_ttl: Duration,
    partition_ttl: Duration,
    clock: Arc<dyn Clock>,
    id: String,
}

/// Builder for [`Server`].
///
/// ```
/// let server = ax_server::Server::builder()
///     .queues(["emails", "reports"])
///     .capacity([100, 1000, 5000])
///     .build();
/// # let _ = server;
/// ```
#[derive(Debug, Clone)]
pub struct ServerBuilder(Server);

impl Default for ServerBuilder {
    fn default() -> Self {
        ServerBuilder(Server {
            queues: vec!["default".to_string()],
            topology: Topology::default(),
            limits: Limits::default(),
            apply_streams: true,
            max_inflight_submits: 4096,
            dispatch_lookahead: Duration::from_millis(200),
            dispatch_horizon: Duration::from_secs(30),
            max_inflight_dispatch: 20_000,
            triggers: true,
            trigger_engine: true,
            flow_engine: true,
            task_index: false,
            console: None,
            alerts: Default::default(),
            max_held_bytes: 64 << 20,
            lease_ttl: Duration::from_secs(3),
            partition_ttl: Duration::from_millis(1500),
            clock: Arc::new(SystemClock::default()),
            id: format!("{}-{}", std::process::id(), nuid::next()),
        })
    }
}

impl ServerBuilder {
    /// Queues to declare at start (default `["default"]`). Queues declared elsewhere (by
    /// `ax streams apply --queue` or another server) are accepted too.
    pub fn queues<I: IntoIterator<Item = S>, S: Into<String>>(mut self, queues: I) -> Self {
        self.0.queues = queues.into_iter().map(Into::into).collect();
        self
    }
    /// Stream topology (capacities, ack wait, replicas); default [`Topology::default`].
    pub fn topology(mut self, topology: Topology) -> Self {
        self.0.topology = topology;
        self
    }
    /// Per-queue capacity of the high, normal and low ready subjects (default
    /// 1000 / 5000 / 10000).
    pub fn capacity(mut self, capacity: [i64; 3]) -> Self {
        self.0.topology.capacity = capacity;
        self
    }
    /// Ack wait / heartbeat timeout of the ready consumers (default 30 s).
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.0.topology.ack_wait = ack_wait;
        self
    }
    /// Submit limits (payload size, delay, attempts, timeout); default [`Limits::default`].
    pub fn limits(mut self, limits: Limits) -> Self {
        self.0.limits = limits;
        self
    }
    /// Apply `streams/` at start (default true).
    pub fn apply_streams(mut self, apply: bool) -> Self {
        self.0.apply_streams = apply;
        self
    }
    /// Most submit requests handled at once (default 4096); more wait in the client buffer.
    pub fn max_inflight_submits(mut self, n: usize) -> Self {
        self.0.max_inflight_submits = n.max(1);
        self
    }
    /// How long before its due time a delayed task is read and armed (default 200 ms).
    pub fn dispatch_lookahead(mut self, d: Duration) -> Self {
        self.0.dispatch_lookahead = d;
        self
    }
    /// Delayed tasks due within this window are held in memory with their message; later
    /// ones only as (due, sequence) and read back as they enter it (default 30 s).
    pub fn dispatch_horizon(mut self, d: Duration) -> Self {
        self.0.dispatch_horizon = d.max(self.0.dispatch_lookahead);
        self
    }
    /// Run the trigger engine and the trigger API (default true).
    pub fn triggers(mut self, on: bool) -> Self {
        self.0.triggers = on;
        self
    }
    /// Take part in the trigger engine's leader election and fire triggers (default true).
    /// Off, the server still answers the trigger API and serves event triggers; another
    /// server fires scheduled triggers.
    pub fn trigger_engine(mut self, on: bool) -> Self {
        self.0.trigger_engine = on;
        self
    }
    /// Take part in the flow engine's leader election and drive flow runs (default true).
    /// Off, the server still answers the flow API; another server drives the runs.
    pub fn flow_engine(mut self, on: bool) -> Self {
        self.0.flow_engine = on;
        self
    }
    /// Serve the web console (default: none). It needs the task index, so it turns that on
    /// too. Refused at start on a non-loopback address without a token.
    pub fn console(mut self, console: crate::console::ConsoleConfig) -> Self {
        self.0.console = Some(console);
        self.0.task_index = true;
        self
    }
    /// Keep every task-state change for 30 days in `AX_TASK_EVENTS` (default false; see
    /// [`Topology::task_events`]). Only creates the stream when it is missing.
    pub fn task_events(mut self, on: bool) -> Self {
        self.0.topology.task_events = on;
        self
    }
    /// Keep the task index and answer `ax.task.list`, `replay` and `queues` (default
    /// false). The index follows every task-state change (one more delivery per record
    /// write, and about 450 bytes of memory per task: docs/PERFORMANCE.md), so it runs
    /// only where asked for: one or two servers of a cluster, or the console's.
    pub fn task_index(mut self, on: bool) -> Self {
        self.0.task_index = on;
        self
    }
    /// Alerts on terminal failures: dedup window, webhook, console link (default: 10 min
    /// window, no webhook, no link). See [`crate::ops::AlertConfig`].
    pub fn alerts(mut self, alerts: crate::ops::AlertConfig) -> Self {
        self.0.alerts = alerts;
        self
    }
    /// Most payload and header bytes of delayed tasks held in memory ahead of their due
    /// time (default 64 MiB). Tasks beyond it are kept as (due, sequence) and read back
    /// when due, so this bounds memory, not how many tasks may wait.
    pub fn max_held_bytes(mut self, bytes: usize) -> Self {
        self.0.max_held_bytes = bytes;
        self
    }
    /// Lease TTL of the trigger engine's leader (default 3 s; renewed every third of it):
    /// a standby takes over at most this long (plus one poll, a third of it) after the
    /// leader dies. (1.5 s was tried: the R3 fault campaign then found a trigger state
    /// counting a fire whose task does not exist, so it stays at 3 s until that is
    /// understood.) Fires are fenced by the lease revision, so a leader that loses its
    /// lease to a slow renewal cannot fire twice; it only hands over early.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.0.lease_ttl = ttl.max(Duration::from_millis(300));
        self
    }
    /// Lease TTL of the delayed-task partitions this server owns (default 1.5 s, renewed
    /// every fifth of it): a killed server's partitions are taken over about this long
    /// after its last renewal.
    pub fn partition_ttl(mut self, ttl: Duration) -> Self {
        self.0.partition_ttl = ttl.max(Duration::from_millis(300));
        self
    }
    /// The clock that decides when triggers are due (default: the system clock).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.0.clock = clock;
        self
    }
    /// This server's id in leases (default `<pid>-<nuid>`).
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.0.id = id.into();
        self
    }
    /// Finishes the builder.
    pub fn build(self) -> Server {
        self.0
    }
}

impl Server {
    /// A builder with the documented defaults.
    pub fn builder() -> ServerBuilder {
        ServerBuilder::default()
    }

    /// Runs until `shutdown` is cancelled, then stops taking requests, finishes the ones in
    /// flight and returns.
    ///
    /// At start the server creates whatever part of the topology is missing (never changing
    /// an existing stream or consumer: `ax streams apply` does that), or with
    /// [`ServerBuilder::apply_streams`]`(false)` waits until an admin has applied it. It
    /// waits for NATS and JetStream with backoff and one log line, so it may be started
    /// before them.
    pub async fn run(
        self,
        client: async_nats::Client,
        shutdown: CancellationToken,
    ) -> Result<(), ServerError> {
        let js = async_nats::jetstream::new(client.clone());
        // Headline gauges exist from the start, not only after their first change.
        metrics::gauge!(m::PENDING_DISPATCH).set(0.0);
        metrics::gauge!(m::DELAYED_TRACKED).set(0.0);
        if !self.prepare_topology(&js, &shutdown).await? {
            return Ok(()); // shut down while waiting
        }
        let admission =
            Arc::new(Admission::open(js.clone(), self.limits.clone(), &self.queues).await?);
        // Every request API is an endpoint of the NATS service `ax` (`nats micro ls`,
        // `info`, `stats`), served in the queue group `ax`.
        use async_nats::service::ServiceExt;
        let service = client
            .service_builder()
            .description("ax task scheduler: submit, triggers, flows, limits, task operations")
            .metadata(std::collections::HashMap::from([(
                "server_id".to_string(),
                self.id.clone(),
            )]))
            .queue_group(names::SERVER_QUEUE_GROUP)
            .start(names::SERVICE_NAME, env!("CARGO_PKG_VERSION"))
            .await
            .map_err(|source| ServerError::Service {
                subject: "$SRV".into(),
                source,
            })?;
        let endpoint = |name: String, subject: String, group: &'static str| {
            let builder = service.endpoint_builder().name(name).queue_group(group);
            async move {
                builder
                    .add(subject.clone())
                    .await
                    .map_err(|source| ServerError::Service { subject, source })
            }
        };
        let subscribe = |subject: String| {
            let name = subject
                .trim_start_matches("ax.")
                .trim_end_matches(".*")
                .replace('.', "-");
            endpoint(name, subject, names::SERVER_QUEUE_GROUP)
        };
        let mut requests = subscribe("ax.submit.*".to_string()).await?;
        let trigger_api = if self.triggers {
            Some(Arc::new(TriggerApi {
                admission: admission.clone(),
                store: TriggerStore::open(&js).await?,
                clock: self.clock.clone(),
            }))
        } else {
            None
        };
        let flow_api = FlowApi {
            admission: admission.clone(),
            store: FlowStore::open(&js).await?,
        };
        let limit_api =
            LimitApi::open(admission.clone())
                .await
                .map_err(|e| StateError::Broker {
                    id: "*".into(),
                    op: "open the limits bucket",
                    source: e,
                })?;
        let alerts = crate::ops::alerts::Alerts::open(&js, self.alerts.clone())
            .await
            .map_err(|e| StateError::Broker {
                id: "*".into(),
                op: "open the alerts bucket",
                source: e,
            })?;
        // Every long-running part is a named service: one that stops while the server runs
        // is logged, counted and started again (`supervisor`).
        let mut services = Supervisor::new(self.id.clone(), shutdown.clone());
        {
            let alerts = alerts.clone();
            services.spawn("alerts", move |token| {
                alerts.clone().follow(token).map(Ok::<(), Infallible>)
            });
        }
        let task_index = self
            .task_index
            .then(|| crate::ops::feed::TaskIndex::start(js.clone(), &mut services));
        let ops = crate::ops::actions::Ops {
            js: js.clone(),
            tasks: ax_sdk::state::TaskStore::open(&js).await?,
            limits: limit_api.defs.clone(),
            index: task_index.clone(),
        };
        // The management APIs, merged into one stream of requests. The task index's
        // operations go only to servers that keep one (their own queue group).
        let mut management = vec![
            subscribe(format!("{}*", names::LIMIT_API_PREFIX)).await?,
            subscribe(format!("{}*", names::FLOW_API_PREFIX)).await?,
        ];
        if self.triggers {
            management.push(subscribe(format!("{TRIGGER_API_PREFIX}*")).await?);
        }
        // One subscription per task operation (the API registry): the index's go to the
        // index servers' queue group, and only where this server keeps one.
        for op in ax_sdk::api::operations(Api::Task) {
            let subject = Api::Task.subject(op.name);
            if !op.needs_index {
                management.push(subscribe(subject).await?);
            } else if self.task_index {
                let name = format!("task-{}", op.name);
                management.push(endpoint(name, subject, names::INDEX_QUEUE_GROUP).await?);
            }
        }
        let mut management = futures::stream::select_all(management);
        if self.triggers && self.trigger_engine {
            let (admission, clock, lease_ttl, id) = (
                admission.clone(),
                self.clock.clone(),
                self.lease_ttl,
                self.id.clone(),
            );
            services.spawn("trigger-engine", move |token| {
                Engine {
                    admission: admission.clone(),
                    clock: clock.clone(),
                    lease_ttl,
                    id: id.clone(),
                }
                .run(token)
            });
        }
        if self.flow_engine {
            let (admission, lease_ttl, id, alerts) = (
                admission.clone(),
                self.lease_ttl,
                self.id.clone(),
                alerts.clone(),
            );
            services.spawn("flow-engine", move |token| {
                FlowEngine {
                    admission: admission.clone(),
                    lease_ttl,
                    id: id.clone(),
                    alerts: Some(alerts.clone()),
                }
                .run(token)
            });
        }
        if self.triggers {
            let (admission, store) = (admission.clone(), TriggerStore::open(&js).await?);
            services.spawn("event-router", move |token| {
                EventRouter {
                    admission: admission.clone(),
                    store: store.clone(),
                }
                .run(token)
            });
        }
        let scheduler = Scheduler {
            js: js.clone(),
            lookahead: self.dispatch_lookahead,
            horizon: self.dispatch_horizon,
            max_inflight: self.max_inflight_dispatch,
            max_held_bytes: self.max_held_bytes,
            filters: Vec::new(),
            slot: 0,
            totals: Arc::new(Totals::new(names::DELAYED_PARTITIONS as usize)),
        };
        let (id, ttl) = (self.id.clone(), self.partition_ttl);
        services.spawn("delayed-dispatch", move |token| {
            Partitions {
                scheduler: scheduler.clone(),
                id: id.clone(),
                ttl,
            }
            .run(token)
        });
        info!(queues = ?self.queues, "ax server ready");

        let permits = Arc::new(Semaphore::new(self.max_inflight_submits));
        let tracker = TaskTracker::new();
        let apis = Arc::new(handle::Apis {
            triggers: trigger_api,
            flows: flow_api,
            limits: limit_api,
            tasks: ops,
        });
        // The console binds at start (a taken address fails the start), then serves as a
        // service of its own.
        if let (Some(config), Some(index)) = (&self.console, &task_index) {
            let health = services.health();
            let console =
                crate::console::start(config.clone(), apis.clone(), index.clone(), health).await?;
            services.spawn("console", move |token| {
                console.clone().serve(token).map(Ok::<(), Infallible>)
            });
        }
        // A management request (triggers, flows, limits) runs in the tracker on its slot.
        let serve = |req: async_nats::service::Request,
                     permit: tokio::sync::OwnedSemaphorePermit| {
            let apis = apis.clone();
            tracker.spawn(async move {
                apis.handle(req).await;
                drop(permit);
            });
        };
        loop {
            // A free handler slot first, so the request arms below never wait on one.
            let permit = tokio::select! {
                _ = shutdown.cancelled() => break,
                p = permits.clone().acquire_owned() => p.expect("never closed"),
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                msg = management.next() => {
                    let Some(msg) = msg else { break };
                    serve(msg, permit);
                }
                req = requests.next() => {
                    let Some(req) = req else { break };
                    let admission = admission.clone();
                    tracker.spawn(async move {
                        handle::submit(&admission, req).await;
                        drop(permit);
                    });
                }
            }
        }
        drop((requests, management));
        if let Err(e) = service.stop().await {
            warn!(cause = %e, "service endpoints not stopped cleanly");
        }
        services.stop().await;
        tracker.close();
        tracker.wait().await;
        info!("ax server stopped");
        Ok(())
    }

    /// Creates what is missing of the topology, or waits for it; false if `shutdown` came
    /// first.
    async fn prepare_topology(
        &self,
        js: &async_nats::jetstream::Context,
        shutdown: &CancellationToken,
    ) -> Result<bool, ServerError> {
        // What cannot get better by waiting fails at once.
        streams::stream_configs(&self.topology)?;
        if let Some(bad) = self.queues.iter().find(|q| !names::valid_queue(q)) {
            return Err(StreamsError::InvalidQueue(bad.clone()).into());
        }
        if !self.apply_streams {
            let queues = &self.queues;
            let ready = retry::until_ok(
                "the JetStream topology (apply it with `ax streams apply`)",
                shutdown,
                || async move {
                    match streams::missing(js, queues).await {
                        Ok(missing) if missing.is_empty() => Ok(()),
                        Ok(missing) => Err(format!("missing {}", missing.join(", "))),
                        Err(e) => Err(e.to_string()),
                    }
                },
            )
            .await;
            return Ok(ready.is_some());
        }
        let report = retry::until_ok("NATS JetStream, to create the topology", shutdown, || {
            streams::ensure(js, &self.topology, &self.queues)
        })
        .await;
        let Some(report) = report else {
            return Ok(false);
        };
        for applied in report {
            match applied.outcome {
                Outcome::Created => info!(object = %applied.object, "topology: created"),
                Outcome::Kept => {
                    for d in &applied.differences {
                        warn!(object = %applied.object, field = %d.field, on_server = %d.existing,
                            this_server = %d.desired,
                            "topology differs from this server's settings; kept as it is (change it with `ax streams apply`)");
                    }
                }
                Outcome::Unchanged | Outcome::Updated => {}
            }
        }
        Ok(true)
    }
}
