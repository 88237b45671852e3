//! The trigger engine inside `ax server`: one leader fires, the others stand by.
//!
//! Leadership is a lease in `AX_LEASES` (key `triggers`) held by compare-and-set and
//! renewed every third of its TTL (default 3 s); its revision is a fencing token. The
//! leader follows `AX_TRIGGERS` (definitions, hot-reloaded), keeps a timer heap of next fire
//! times, and watches the task records of each trigger's latest fire on the core subject
//! `$KV.AX_TASKS.*` to know when they finish (overlap policies, fixed-delay). A fire is:
//! submit each template as task `tr-<scheduled ms>-<i>-<name>`, then compare-and-set the
//! trigger's state. A crash in between is repaired by the next leader re-planning the same
//! scheduled time: the same task ids make the re-submission a no-op (the message id within
//! the 2-minute window, the record's create-if-absent after it).

use super::clock::Clock;
use super::model::TriggerDef;
use super::plan::{plan, FireRecord, Source, TriggerState};
use super::recur::Recurrence;
use super::store::{TriggerStore, TriggerStoreError};
use crate::names::LEASES_BUCKET;
use crate::protocol::WireError;
use crate::state::{TaskRecord, TaskStore};
use crate::submit::Admission;
use crate::task::{Lineage, TaskMeta};
use async_nats::jetstream::kv;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Errors that stop the engine.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EngineError {
    /// A bucket could not be opened or followed.
    #[error("trigger engine: {0}")]
    Store(#[from] TriggerStoreError),
    /// The broker failed.
    #[error("trigger engine: {op}: {source}")]
    Broker {
        /// Operation.
        op: &'static str,
        /// Underlying error.
        source: async_nats::Error,
    },
}

fn broker(op: &'static str) -> impl FnOnce(async_nats::Error) -> EngineError {
    move |source| EngineError::Broker { op, source }
}

#[derive(Serialize, Deserialize)]
struct LeaseValue {
    holder: String,
    expires_at_ms: u64,
}

/// A lease held by compare-and-set on one KV key.
struct Lease {
    kv: kv::Store,
    holder: String,
    ttl: Duration,
    revision: Option<u64>,
}

const LEASE_KEY: &str = "triggers";

impl Lease {
    /// Takes or renews the lease; true while held.
    async fn hold(&mut self, now_ms: u64) -> bool {
        let value = LeaseValue {
            holder: self.holder.clone(),
            expires_at_ms: now_ms + self.ttl.as_millis() as u64,
        };
        let body: bytes::Bytes = serde_json::to_vec(&value).expect("serializes").into();
        let revision = match self.revision {
            Some(rev) => Some(rev),
            None => match self.kv.entry(LEASE_KEY).await {
                Ok(Some(e)) if e.operation == kv::Operation::Put => {
                    let current: Option<LeaseValue> = serde_json::from_slice(&e.value).ok();
                    match current {
                        Some(c) if c.holder != self.holder && c.expires_at_ms > now_ms => {
                            return false
                        }
                        _ => Some(e.revision),
                    }
                }
                Ok(Some(e)) => Some(e.revision),
                Ok(None) => None,
                Err(_) => return false,
            },
        };
        let written = match revision {
            Some(rev) => self.kv.update(LEASE_KEY, body, rev).await.ok(),
            None => self.kv.create(LEASE_KEY, body).await.ok(),
        };
        self.revision = written;
        written.is_some()
    }

    /// Gives the lease up so a standby takes over at once.
    async fn release(&mut self) {
        if let Some(rev) = self.revision.take() {
            let value = LeaseValue {
                holder: String::new(),
                expires_at_ms: 0,
            };
            let body = serde_json::to_vec(&value).expect("serializes").into();
            let _ = self.kv.update(LEASE_KEY, body, rev).await;
        }
    }
}

/// One trigger as the leader holds it.
struct Held {
    def: TriggerDef,
    rec: Recurrence,
    state: TriggerState,
    revision: u64,
    active: HashSet<String>,
}

pub(crate) struct Engine {
    pub(crate) admission: Arc<Admission>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) lease_ttl: Duration,
    pub(crate) id: String,
}

/// The task id of template `i` of a scheduled fire: the same for every server and every
/// retry, so the record's create-if-absent (and the message id) de-duplicate the fire.
pub(crate) fn scheduled_task_id(trigger: &str, scheduled_ms: u64, i: usize) -> String {
    format!("tr-{scheduled_ms}-{i}-{trigger}")
}

/// Submits one fire's tasks; returns their ids. Scheduled fires get deterministic ids;
/// event fires take the event's `Nats-Msg-Id` into theirs when it has one (so a re-sent
/// event is one fire); manual runs get fresh ids. An event's body becomes the payload of
/// templates without one (JSON if it parses, bytes otherwise).
pub(crate) async fn fire(
    admission: &Admission,
    def: &TriggerDef,
    scheduled_ms: u64,
    source: Source,
    event: Option<&async_nats::Message>,
) -> Result<Vec<String>, WireError> {
    let mut ids = Vec::with_capacity(def.tasks.len());
    let event_id = event
        .and_then(|m| m.headers.as_ref())
        .and_then(|h| h.get("Nats-Msg-Id"))
        .map(|v| {
            v.as_str()
                .bytes()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        });
    for (i, template) in def.tasks.iter().enumerate() {
        let mut req = template.clone();
        if let Some(msg) = event {
            if req.payload.is_none() && req.payload_base64.is_none() {
                match serde_json::from_slice::<serde_json::Value>(&msg.payload) {
                    Ok(v) => req.payload = Some(v),
                    Err(_) => {
                        use base64::Engine as _;
                        req.payload_base64 =
                            Some(base64::engine::general_purpose::STANDARD.encode(&msg.payload));
                    }
                }
            }
        }
        let queue = req.queue.clone().unwrap_or_default();
        let (mut meta, payload) = TaskMeta::from_request(&queue, req, &admission.limits)?;
        match (source, &event_id) {
            (Source::Schedule, _) => meta.id = scheduled_task_id(&def.name, scheduled_ms, i),
            (Source::Event, Some(eid)) => meta.id = format!("ev-{eid}-{i}-{}", def.name),
            _ => {}
        }
        meta.lineage = Some(Lineage {
            trigger: def.name.clone(),
            source: source.as_str().to_string(),
            scheduled_at_ms: scheduled_ms,
        });
        ids.push(admission.submit_prepared(meta, payload).await?.id);
    }
    Ok(ids)
}

/// Task ids among `ids` whose records are not finished.
pub(crate) async fn unfinished(tasks: &TaskStore, ids: &[String]) -> HashSet<String> {
    let mut out = HashSet::new();
    for id in ids {
        match tasks.get(id).await {
            Ok(Some((rec, _))) if rec.state.is_terminal() => {}
            // Unknown or unreadable counts as running: never fire over a task we cannot see.
            _ => {
                out.insert(id.clone());
            }
        }
    }
    out
}

impl Engine {
    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), EngineError> {
        let js = self.admission.js.clone();
        let store = TriggerStore::open(&js).await?;
        let kv = js
            .get_key_value(LEASES_BUCKET)
            .await
            .map_err(|e| broker("open leases")(e.into()))?;
        let mut lease = Lease {
            kv,
            holder: self.id.clone(),
            ttl: self.lease_ttl,
            revision: None,
        };
        let poll = self.lease_ttl / 3;
        loop {
            if lease.hold(self.clock.now_ms()).await {
                info!(id = %self.id, "trigger engine: leader");
                let led = self.lead(&store, &mut lease, &shutdown).await;
                if shutdown.is_cancelled() {
                    lease.release().await;
                    return led;
                }
                if let Err(e) = led {
                    warn!(cause = %e, "trigger engine: leadership ended with an error");
                }
                info!(id = %self.id, "trigger engine: standing by");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(poll) => {}
            }
        }
    }

    async fn lead(
        &self,
        store: &TriggerStore,
        lease: &mut Lease,
        shutdown: &CancellationToken,
    ) -> Result<(), EngineError> {
        let tasks = self.admission.tasks.clone();
        let mut watch = store
            .defs()
            .watch_with_history(">")
            .await
            .map_err(|e| broker("watch definitions")(e.into()))?;
        let mut feed = self
            .admission
            .js
            .client()
            .subscribe("$KV.AX_TASKS.*")
            .await
            .map_err(|e| broker("follow task records")(e.into()))?;
        // State written by others (a manual run on another server) is taken in at once.
        let mut state_watch = store
            .states()
            .watch_all()
            .await
            .map_err(|e| broker("watch trigger state")(e.into()))?;
        let mut held: HashMap<String, Held> = HashMap::new();
        let mut owner: HashMap<String, String> = HashMap::new();
        let mut wakes: BinaryHeap<Reverse<(u64, String)>> = BinaryHeap::new();
        let mut renew = tokio::time::interval(self.lease_ttl / 3);
        // Fires run as tasks so the timer loop never waits on the broker; a trigger is not
        // planned again while its fire is in flight (`recheck` remembers it was due).
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<(String, Outcome)>();
        let fire_slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_FIRES));
        let mut in_flight: HashSet<String> = HashSet::new();
        let mut recheck: HashSet<String> = HashSet::new();
        loop {
            let now = self.clock.now_ms();
            let sleep = wakes
                .peek()
                .map_or(Duration::from_secs(3600), |Reverse((at, _))| {
                    Duration::from_millis(at.saturating_sub(now))
                });
            let mut due: Vec<String> = Vec::new();
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = renew.tick() => {
                    if !lease.hold(self.clock.now_ms()).await {
                        warn!("trigger engine: lease lost");
                        return Ok(());
                    }
                }
                entry = watch.next() => {
                    let Some(entry) = entry else { return Ok(()) };
                    let entry = entry.map_err(|e| broker("watch definitions")(e.into()))?;
                    let name = entry.key.clone();
                    if entry.operation != kv::Operation::Put {
                        if let Some(h) = held.remove(&name) {
                            for id in h.active {
                                owner.remove(&id);
                            }
                        }
                        continue;
                    }
                    let Ok(def) = serde_json::from_slice::<TriggerDef>(&entry.value) else {
                        warn!(trigger = %name, "stored definition does not decode; ignored");
                        continue;
                    };
                    let Ok(rec) = def.validate() else {
                        warn!(trigger = %name, "stored definition is invalid; ignored");
                        continue;
                    };
                    let (state, revision) = match store.state(&name).await? {
                        Some(found) => found,
                        None => {
                            let state = TriggerState { created_at_ms: self.clock.now_ms(), ..Default::default() };
                            match store.put_state(&name, &state, None).await {
                                Ok(rev) => (state, rev),
                                Err(TriggerStoreError::Stale(_)) => store.state(&name).await?.expect("exists"),
                                Err(e) => return Err(e.into()),
                            }
                        }
                    };
                    let ids = state.last_fire.as_ref().map(|f| f.task_ids.clone()).unwrap_or_default();
                    let active = unfinished(&tasks, &ids).await;
                    for id in &active {
                        owner.insert(id.clone(), name.clone());
                    }
                    held.insert(name.clone(), Held { def, rec, state, revision, active });
                    due.push(name);
                }
                entry = state_watch.next() => {
                    let Some(entry) = entry else { return Ok(()) };
                    let entry = entry.map_err(|e| broker("watch trigger state")(e.into()))?;
                    let name = entry.key.clone();
                    // Our own writes are in flight until their outcome is applied.
                    if entry.operation != kv::Operation::Put || in_flight.contains(&name) {
                        continue;
                    }
                    let Some(h) = held.get_mut(&name) else { continue };
                    if entry.revision <= h.revision {
                        continue;
                    }
                    let Ok(state) = serde_json::from_slice::<TriggerState>(&entry.value) else { continue };
                    let ids = state.last_fire.as_ref().map(|f| f.task_ids.clone()).unwrap_or_default();
                    for old in h.active.drain() {
                        owner.remove(&old);
                    }
                    h.active = unfinished(&tasks, &ids).await;
                    for id in &h.active {
                        owner.insert(id.clone(), name.clone());
                    }
                    h.state = state;
                    h.revision = entry.revision;
                    due.push(name);
                }
                msg = feed.next() => {
                    let Some(msg) = msg else { return Ok(()) };
                    let id = msg.subject.rsplit('.').next().unwrap_or_default();
                    let Some(name) = owner.get(id).cloned() else { continue };
                    let Ok(rec) = serde_json::from_slice::<TaskRecord>(&msg.payload) else { continue };
                    if !rec.state.is_terminal() {
                        continue;
                    }
                    owner.remove(id);
                    if let Some(h) = held.get_mut(&name) {
                        h.active.remove(id);
                        h.state.last_result.push(rec.state.to_string());
                        if h.active.is_empty() {
                            h.state.last_completed_ms = Some(self.clock.now_ms());
                            due.push(name);
                        }
                    }
                }
                Some((name, outcome)) = done_rx.recv() => {
                    in_flight.remove(&name);
                    if let Some(h) = held.get_mut(&name) {
                        let wake = self.apply(h, &mut owner, &name, outcome).await?;
                        if let Some(wake) = wake {
                            wakes.push(Reverse((wake, name.clone())));
                        }
                    }
                    if recheck.remove(&name) {
                        due.push(name);
                    }
                }
                _ = tokio::time::sleep(sleep), if !wakes.is_empty() => {
                    let now = self.clock.now_ms();
                    while let Some(Reverse((at, _))) = wakes.peek() {
                        if *at > now {
                            break;
                        }
                        let Reverse((_, name)) = wakes.pop().expect("peeked");
                        due.push(name);
                    }
                }
            }
            due.sort();
            due.dedup();
            // Plan each due trigger, then fire and store them concurrently.
            let now = self.clock.now_ms();
            let mut jobs = Vec::new();
            for name in due {
                if in_flight.contains(&name) {
                    recheck.insert(name);
                    continue;
                }
                let Some(h) = held.get(&name) else { continue };
                let p = plan(&h.def, &h.rec, &h.state, now, !h.active.is_empty());
                if p.fires.is_empty() && p.state == h.state {
                    if let Some(wake) = p.next_wake_ms {
                        wakes.push(Reverse((wake, name)));
                    }
                    continue;
                }
                jobs.push(Job {
                    name,
                    def: h.def.clone(),
                    plan: p,
                    revision: h.revision,
                });
            }
            for job in jobs {
                in_flight.insert(job.name.clone());
                let permit = fire_slots
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("never closed");
                let (admission, store, done) =
                    (self.admission.clone(), store.clone(), done_tx.clone());
                tokio::spawn(async move {
                    let name = job.name.clone();
                    let outcome = execute(&admission, &store, job, now).await;
                    drop(permit);
                    let _ = done.send((name, outcome));
                });
            }
        }
    }

    /// Applies a fire's outcome to the held trigger; returns its next wake.
    async fn apply(
        &self,
        h: &mut Held,
        owner: &mut HashMap<String, String>,
        name: &str,
        outcome: Outcome,
    ) -> Result<Option<u64>, EngineError> {
        let now = self.clock.now_ms();
        Ok(match outcome {
            Outcome::Stored {
                state,
                revision,
                ids,
                next_wake_ms,
            } => {
                h.state = state;
                h.revision = revision;
                if !ids.is_empty() {
                    // Only the latest fire's tasks decide overlap and fixed-delay.
                    for old in h.active.drain() {
                        owner.remove(&old);
                    }
                    for id in ids {
                        owner.insert(id.clone(), name.to_string());
                        h.active.insert(id);
                    }
                }
                next_wake_ms
            }
            Outcome::Retry => Some(now + 1000),
            Outcome::Stale(Some((state, revision))) => {
                let ids = state
                    .last_fire
                    .as_ref()
                    .map(|f| f.task_ids.clone())
                    .unwrap_or_default();
                for old in h.active.drain() {
                    owner.remove(&old);
                }
                h.active = unfinished(&self.admission.tasks, &ids).await;
                for id in &h.active {
                    owner.insert(id.clone(), name.to_string());
                }
                h.state = state;
                h.revision = revision;
                Some(now)
            }
            Outcome::Stale(None) => None,
            Outcome::Failed(e) => return Err(e),
        })
    }
}

/// Fires a planned trigger and stores its new state.
async fn execute(admission: &Admission, store: &TriggerStore, job: Job, now: u64) -> Outcome {
    let Job {
        name,
        def,
        mut plan,
        revision,
    } = job;
    let mut ids = Vec::new();
    for &scheduled in &plan.fires {
        match fire(admission, &def, scheduled, Source::Schedule, None).await {
            Ok(mut fired) => ids.append(&mut fired),
            Err(e) => {
                // Busy or unavailable: keep the state as it was and try again shortly.
                warn!(trigger = %name, cause = %e, "fire not accepted; retrying in 1 s");
                return Outcome::Retry;
            }
        }
    }
    if let Some(&last) = plan.fires.last() {
        plan.state.fires += plan.fires.len() as u64;
        plan.state.last_result.clear();
        plan.state.last_completed_ms = None;
        plan.state.last_fire = Some(FireRecord {
            scheduled_ms: last,
            fired_at_ms: now,
            source: Source::Schedule,
            task_ids: ids.clone(),
        });
        debug!(trigger = %name, scheduled = last, tasks = ids.len(), "fired");
    }
    match store.put_state(&name, &plan.state, Some(revision)).await {
        Ok(revision) => Outcome::Stored {
            state: plan.state,
            revision,
            ids,
            next_wake_ms: plan.next_wake_ms,
        },
        // Changed elsewhere (a manual run): reload and plan again now.
        Err(TriggerStoreError::Stale(_)) => match store.state(&name).await {
            Ok(found) => Outcome::Stale(found),
            Err(e) => Outcome::Failed(e.into()),
        },
        Err(e) => Outcome::Failed(e.into()),
    }
}

/// Most triggers fired at once by the leader.
const MAX_CONCURRENT_FIRES: usize = 512;

/// A planned trigger to fire and store.
struct Job {
    name: String,
    def: TriggerDef,
    plan: super::plan::Plan,
    revision: u64,
}

/// What firing one trigger came to.
enum Outcome {
    Stored {
        state: TriggerState,
        revision: u64,
        ids: Vec<String>,
        next_wake_ms: Option<u64>,
    },
    Retry,
    Stale(Option<(TriggerState, u64)>),
    Failed(EngineError),
}
