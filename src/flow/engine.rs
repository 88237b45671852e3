//! The flow engine inside `ax server`: one leader (lease `flows` in `AX_LEASES`) drives
//! every running run; the other servers stand by and take over within the lease TTL.
//!
//! The leader follows two KV feeds, both ordered consumers (no message dropped, whatever
//! the load): the run keys of `AX_FLOW_RUNS` (with history, so a new leader finds every
//! running run) and the records of step tasks (`$KV.AX_TASKS.*.fl.>`, from now on). Each
//! running run gets an actor ([`super::actor`]) that loads the run, its steps and its
//! tasks' records, then advances on the completions routed to it. Task completions before
//! the actor existed are in the records it reads when it loads, so nothing is missed
//! between a leader's start and an actor's.

use super::actor::{Actor, Event, Shared};
use super::model::{parse_step_task, FlowRun, RunState};
use super::store::{FlowStore, FlowStoreError};
use crate::lease::Lease;
use crate::metrics as m;
use crate::names::LEASES_BUCKET;
use crate::output::ResultStore;
use crate::state::TaskRecord;
use crate::submit::Admission;
use async_nats::jetstream::kv;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The key of the flow engine's lease in `AX_LEASES`.
pub(crate) const FLOWS_KEY: &str = "flows";

/// Errors that stop the engine.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FlowEngineError {
    /// A bucket could not be opened or followed.
    #[error("flow engine: {0}")]
    Store(#[from] FlowStoreError),
    /// The broker failed.
    #[error("flow engine: {op}: {source}")]
    Broker {
        /// Operation.
        op: &'static str,
        /// Underlying error.
        source: async_nats::Error,
    },
}

fn broker(op: &'static str) -> impl FnOnce(async_nats::Error) -> FlowEngineError {
    move |source| FlowEngineError::Broker { op, source }
}

pub(crate) struct FlowEngine {
    pub(crate) admission: Arc<Admission>,
    pub(crate) lease_ttl: Duration,
    pub(crate) id: String,
    pub(crate) alerts: Option<crate::ops::alerts::Alerts>,
}

enum Stop {
    Shutdown,
    StepDown(&'static str),
}

struct Running {
    tx: mpsc::UnboundedSender<Event>,
    generation: u64,
}

/// Starts run actors, each with a generation so that a late "ended" of an old actor never
/// removes its successor.
struct Spawner {
    shared: Arc<Shared>,
    token: CancellationToken,
    ended: mpsc::UnboundedSender<(String, u64)>,
    generation: u64,
}

impl Spawner {
    fn spawn(&mut self, id: String) -> Running {
        self.generation += 1;
        let (tx, rx) = mpsc::unbounded_channel();
        let actor = Actor::new(self.shared.clone(), id.clone());
        let (token, ended, gen) = (self.token.clone(), self.ended.clone(), self.generation);
        tokio::spawn(async move {
            actor.drive(rx, token).await;
            let _ = ended.send((id, gen));
        });
        Running {
            tx,
            generation: self.generation,
        }
    }
}

impl FlowEngine {
    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), FlowEngineError> {
        let js = self.admission.js.clone();
        let opened = crate::retry::until_ok(
            "the flow buckets (AX_FLOWS, AX_FLOW_RUNS; `ax streams apply`)",
            &shutdown,
            || async {
                let store = FlowStore::open(&js).await.map_err(|e| e.to_string())?;
                let results = ResultStore::open(&js).await.map_err(|e| e.to_string())?;
                let kv = js
                    .get_key_value(LEASES_BUCKET)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>((store, results, kv))
            },
        )
        .await;
        let Some((store, results, kv)) = opened else {
            return Ok(()); // shut down while waiting
        };
        let mut lease = Lease::new(kv, FLOWS_KEY, self.id.clone(), self.lease_ttl);
        let poll = self.lease_ttl / 3;
        loop {
            if lease.hold().await {
                let token = lease.token().unwrap_or_default();
                info!(id = %self.id, token, "flow engine: leader");
                match self.lead(&store, &results, &mut lease, &shutdown).await {
                    Ok(Stop::Shutdown) => {
                        lease.release().await;
                        return Ok(());
                    }
                    Ok(Stop::StepDown(why)) => {
                        warn!(id = %self.id, why, "flow engine: stepping down")
                    }
                    Err(e) => {
                        warn!(cause = %e, "flow engine: leadership ended with an error");
                        lease.release().await;
                    }
                }
                metrics::gauge!(m::FLOW_RUNS_ACTIVE).set(0.0);
                info!(id = %self.id, "flow engine: standing by");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(poll) => {}
            }
        }
    }

    async fn lead(
        &self,
        store: &FlowStore,
        results: &ResultStore,
        lease: &mut Lease,
        shutdown: &CancellationToken,
    ) -> Result<Stop, FlowEngineError> {
        // Task records first: a completion after this point reaches an actor either by the
        // feed or by the records the actor reads when it loads.
        let mut tasks = self
            .admission
            .tasks
            .watch_flow_tasks()
            .await
            .map_err(|e| broker("follow step task records")(e.into()))?;
        let mut runs = store.watch_runs().await?;
        let actors_token = shutdown.child_token();
        let _stop_actors = actors_token.clone().drop_guard();
        let shared = Arc::new(Shared {
            admission: self.admission.clone(),
            store: store.clone(),
            results: results.clone(),
            alerts: self.alerts.clone(),
        });
        let (ended_tx, mut ended_rx) = mpsc::unbounded_channel::<(String, u64)>();
        let mut actors: HashMap<String, Running> = HashMap::new();
        let mut spawner = Spawner {
            shared,
            token: actors_token.clone(),
            ended: ended_tx,
            generation: 0,
        };
        let mut renew = tokio::time::interval(self.lease_ttl / 3);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(Stop::Shutdown),
                _ = renew.tick() => {
                    if !lease.hold().await {
                        return Ok(Stop::StepDown("lease lost"));
                    }
                }
                entry = runs.next() => {
                    let Some(entry) = entry else { return Ok(Stop::StepDown("run watch ended")) };
                    let entry = entry.map_err(|e| broker("watch runs")(e.into()))?;
                    if entry.operation != kv::Operation::Put {
                        continue;
                    }
                    let Ok(run) = serde_json::from_slice::<FlowRun>(&entry.value) else {
                        warn!(run = %entry.key, "stored run does not decode; ignored");
                        continue;
                    };
                    if let Some(actor) = actors.get(&run.id) {
                        if actor.tx.send(Event::Run(entry.revision)).is_ok() {
                            continue;
                        }
                    }
                    if run.state != RunState::Running {
                        continue;
                    }
                    let id = run.id.clone();
                    actors.insert(run.id, spawner.spawn(id));
                    metrics::gauge!(m::FLOW_RUNS_ACTIVE).set(actors.len() as f64);
                }
                entry = tasks.next() => {
                    let Some(entry) = entry else { return Ok(Stop::StepDown("task record watch ended")) };
                    let entry = entry.map_err(|e| broker("follow step task records")(e.into()))?;
                    if entry.operation != kv::Operation::Put {
                        continue;
                    }
                    let Some(task) = parse_step_task(&entry.key) else { continue };
                    let Some(actor) = actors.get(task.run) else { continue };
                    let Ok(rec) = serde_json::from_slice::<TaskRecord>(&entry.value) else { continue };
                    let _ = actor.tx.send(Event::Task {
                        step: task.step.to_string(),
                        epoch: task.epoch,
                        item: task.item,
                        rec: Box::new(rec),
                    });
                }
                Some((id, gen)) = ended_rx.recv() => {
                    if actors.get(&id).is_some_and(|a| a.generation == gen) {
                        actors.remove(&id);
                        // A re-run or a write that reached the actor as it was ending: the
                        // run is running again and needs an actor.
                        if let Ok(Some((run, _))) = store.run(&id).await {
                            if run.state == RunState::Running {
                                actors.insert(id.clone(), spawner.spawn(id));
                            }
                        }
                        metrics::gauge!(m::FLOW_RUNS_ACTIVE).set(actors.len() as f64);
                    }
                }
            }
            if !lease.valid() {
                return Ok(Stop::StepDown("lease not renewed within its TTL"));
            }
        }
    }
}
