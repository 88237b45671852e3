//! `ax server`: applies the topology, answers submit requests, dispatches delayed tasks.
//!
//! Any number of servers may run against one NATS: submit handlers share the queue group
//! `ax`; delayed tasks are split into partitions, each indexed and dispatched by one server
//! (`schedule::partitions`), and a dispatch is idempotent (message ids, delete by
//! sequence), so a partition moving between servers never runs a task twice.

use crate::context::Context;
use crate::flow::api::FlowApi;
use crate::flow::engine::FlowEngine;
use crate::flow::store::FlowStore;
use crate::limits::api::LimitApi;
use crate::schedule::partitions::Partitions;
use crate::schedule::{Scheduler, Totals};
use crate::streams::{self, Outcome, StreamsError};
use crate::trigger::api::TriggerApi;
use crate::trigger::engine::Engine;
use crate::trigger::events::EventRouter;
use crate::trigger::store::TriggerStore;
use async_nats::service::{endpoint::Endpoint, Service};
use ax_core::metrics as m;
use ax_core::names::{self, TRIGGER_API_PREFIX};
use ax_core::retry;
use ax_core::state::StateError;
use ax_core::supervisor::Supervisor;
use ax_sdk::api::Api;
use futures::stream::SelectAll;
use futures::{FutureExt, StreamExt};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

mod builder;
pub(crate) mod handle;

pub use builder::{Server, ServerBuilder};

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
    Buckets(#[from] ax_core::typed_kv::KvError),
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
    pub fn kind(&self) -> ax_core::error::ErrorKind {
        use ax_core::error::ErrorKind;
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
        let mut ctx = Context::open(
            js.clone(),
            self.limits.clone(),
            &self.queues,
            self.group_commit,
            self.faults.clone(),
        )
        .await?;
        ctx.console_url = self.console.as_ref().and_then(|c| c.url.clone());
        let ctx = Arc::new(ctx);
        let (service, mut requests, mut management) = self.endpoints(&client).await?;
        let trigger_api = if self.triggers {
            Some(Arc::new(TriggerApi {
                ctx: ctx.clone(),
                store: TriggerStore::open(&js).await?.faults(ctx.faults.clone()),
                clock: self.clock.clone(),
            }))
        } else {
            None
        };
        let flow_api = FlowApi {
            ctx: ctx.clone(),
            store: FlowStore::open(&js).await?,
        };
        let limit_api = LimitApi::open(ctx.clone())
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
        let mut services =
            Supervisor::new(self.id.clone(), shutdown.clone()).faults(self.faults.clone());
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
            tasks: ax_core::state::TaskStore::open(&js).await?,
            limits: limit_api.defs.clone(),
            index: task_index.clone(),
            ctx: ctx.clone(),
        };
        self.spawn_services(&mut services, &ctx, &alerts, &ops)
            .await?;
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
            let changes = crate::console::Changes::start(&js, &mut services);
            let console =
                crate::console::start(config.clone(), apis.clone(), index.clone(), changes, health)
                    .await?;
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
                    let apis = apis.clone();
                    tracker.spawn(async move {
                        handle::submit(&apis.tasks, req).await;
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

    /// Starts the trigger engine, the flow engine, the event router, fair and delayed dispatch
    /// as named services of `services` (each as configured).
    async fn spawn_services(
        &self,
        services: &mut Supervisor,
        ctx: &Arc<Context>,
        alerts: &crate::ops::alerts::Alerts,
        ops: &crate::ops::actions::Ops,
    ) -> Result<(), ServerError> {
        let js = &ctx.js;
        if self.triggers && self.trigger_engine {
            let (ctx, ops, clock, lease_ttl, id, hold) = (
                ctx.clone(),
                ops.clone(),
                self.clock.clone(),
                self.lease_ttl,
                self.id.clone(),
                self.trigger_hold,
            );
            services.spawn("trigger-engine", move |token| {
                Engine {
                    ctx: ctx.clone(),
                    ops: ops.clone(),
                    clock: clock.clone(),
                    lease_ttl,
                    id: id.clone(),
                    hold,
                }
                .run(token)
            });
        }
        if self.flow_engine {
            let (ctx, lease_ttl, id, alerts) =
                (ctx.clone(), self.lease_ttl, self.id.clone(), alerts.clone());
            services.spawn("flow-engine", move |token| {
                FlowEngine {
                    ctx: ctx.clone(),
                    lease_ttl,
                    id: id.clone(),
                    alerts: Some(alerts.clone()),
                }
                .run(token)
            });
        }
        if self.flow_engine {
            let (ctx, lease_ttl, id) = (ctx.clone(), self.lease_ttl, self.id.clone());
            services.spawn("event-matcher", move |token| {
                crate::event_wait::EventWaits {
                    ctx: ctx.clone(),
                    lease_ttl,
                    id: id.clone(),
                }
                .run(token)
            });
        }
        if self.triggers {
            let ctx = ctx.clone();
            services.spawn("event-router", move |token| {
                EventRouter { ctx: ctx.clone() }.run(token)
            });
        }
        let drops_ctx = ctx.clone();
        services.spawn("drop-limits", move |token| {
            let ctx = drops_ctx.clone();
            async move { ctx.drops.follow(ctx.js.clone(), token).await }.map(Ok::<(), Infallible>)
        });
        let (fair_ctx, id, ttl, held) = (
            ctx.clone(),
            self.id.clone(),
            self.lease_ttl,
            self.max_held_bytes,
        );
        services.spawn("fair-dispatch", move |token| {
            crate::fair::FairDispatcher {
                ctx: fair_ctx.clone(),
                id: id.clone(),
                lease_ttl: ttl,
                max_held_bytes: held,
            }
            .run(token)
        });
        let scheduler = Scheduler {
            js: js.clone(),
            lookahead: self.dispatch_lookahead,
            horizon: self.dispatch_horizon,
            max_inflight: self.max_inflight_dispatch,
            max_held_bytes: self.max_held_bytes,
            filters: Vec::new(),
            slot: 0,
            totals: Arc::new(Totals::new(names::DELAYED_PARTITIONS as usize)),
            faults: ctx.faults.clone(),
            tasks: ctx.tasks.clone(),
            waits: ctx.waits.clone(),
            idempotency: ctx.idempotency.clone(),
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
        Ok(())
    }

    /// The server's endpoints of the NATS service `ax`: the service, the submit requests,
    /// and the management requests merged into one stream.
    async fn endpoints(
        &self,
        client: &async_nats::Client,
    ) -> Result<(Service, Endpoint, SelectAll<Endpoint>), ServerError> {
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
        let requests = subscribe("ax.submit.*".to_string()).await?;
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
        Ok((service, requests, futures::stream::select_all(management)))
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
