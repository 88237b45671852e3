//! One running run, driven by the engine's leader: load it (run, steps, the records of
//! its running steps' tasks), advance it with [`super::advance`], apply the decisions
//! (write step records, submit step tasks, cancel queued ones, end the run), then wait for
//! the next completion.
//!
//! Exactly once per step: a step's tasks have deterministic ids per (run, step, epoch,
//! item), so submitting them again (after a crash, or by a second leader) is a no-op;
//! every write is a compare-and-set, and a lost one makes the actor read everything again
//! and decide again from the same facts. Task completions are facts in `AX_TASKS`, read
//! durably; this actor's memory is a cache of them.

use super::advance::{advance, Progress};
use super::def::{Plan, MAX_FAN_OUT};
use super::input::{output_value, Parent, StepInput};
use super::model::{step_task_id, FlowRun, RunState, StepRun, StepState};
use super::store::{FlowStore, FlowStoreError};
use crate::metrics as m;
use crate::output::{ResultStore, StoredOutput};
use crate::protocol::{ErrorCode, WireError};
use crate::state::{ErrorInfo, TaskRecord, TaskState};
use crate::submit::Admission;
use crate::task::TaskMeta;
use crate::time::now_ms;
use futures::StreamExt;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Most step-task submits or record reads in flight per run.
const CONCURRENCY: usize = 128;

pub(crate) struct Shared {
    pub(crate) admission: Arc<Admission>,
    pub(crate) store: FlowStore,
    pub(crate) results: ResultStore,
    pub(crate) alerts: Option<crate::ops::alerts::Alerts>,
}

/// What the leader routes to a run's actor.
pub(crate) enum Event {
    /// The run key was written at this revision.
    Run(u64),
    /// A step task's record was written.
    Task {
        step: String,
        epoch: u32,
        item: u32,
        rec: Box<TaskRecord>,
    },
}

/// A finished step task, as far as the flow cares.
#[derive(Debug, Clone)]
struct Done {
    state: TaskState,
    output: Option<StoredOutput>,
    error: Option<ErrorInfo>,
    attempt: u32,
    finished_at_ms: u64,
}

impl Done {
    fn of(rec: &TaskRecord) -> Option<Done> {
        rec.state.is_terminal().then(|| Done {
            state: rec.state,
            output: rec.output.clone(),
            error: rec.last_error.clone(),
            attempt: rec.attempt,
            finished_at_ms: rec.finished_at_ms.unwrap_or(rec.updated_at_ms),
        })
    }
}

#[derive(Debug, thiserror::Error)]
enum Fault {
    #[error("{0}")]
    Store(#[from] FlowStoreError),
    #[error("{0}")]
    Other(String),
}

enum Outcome {
    Idle,
    Ended,
}

pub(crate) struct Actor {
    sh: Arc<Shared>,
    id: String,
    run: Option<(FlowRun, u64)>,
    plan: Plan,
    index: HashMap<String, usize>,
    steps: Vec<StepRun>,
    revs: Vec<Option<u64>>,
    items: Vec<Vec<Option<Done>>>,
    progress: Vec<Progress>,
    first_failed_item: Vec<Option<u32>>,
    last_finish: Vec<u64>,
    observed: Vec<bool>,
    queued_cancelled: Vec<bool>,
    outputs: Vec<Option<Value>>,
    /// Items of running steps without a record (a crash between the step write and its
    /// submits): submitted again.
    resubmit: Vec<(usize, Vec<u32>)>,
    /// Just loaded: tasks of steps started now may exist already (a crash after their
    /// submits, before the step write): read their records back.
    verify: bool,
    token: CancellationToken,
}

impl Actor {
    pub(crate) fn new(sh: Arc<Shared>, id: String) -> Actor {
        Actor {
            sh,
            id,
            run: None,
            plan: Plan {
                parents: Vec::new(),
                order: Vec::new(),
            },
            index: HashMap::new(),
            steps: Vec::new(),
            revs: Vec::new(),
            items: Vec::new(),
            progress: Vec::new(),
            first_failed_item: Vec::new(),
            last_finish: Vec::new(),
            observed: Vec::new(),
            queued_cancelled: Vec::new(),
            outputs: Vec::new(),
            resubmit: Vec::new(),
            verify: false,
            token: CancellationToken::new(),
        }
    }

    /// Drives the run until it ends or `token` is cancelled (the leader stepped down).
    pub(crate) async fn drive(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Event>,
        token: CancellationToken,
    ) {
        self.token = token.clone();
        let mut loaded = false;
        let mut failures = 0u32;
        loop {
            if token.is_cancelled() {
                return;
            }
            if !loaded {
                match self.load().await {
                    Ok(true) => loaded = true,
                    Ok(false) => return,
                    Err(e) => {
                        warn!(run = %self.id, cause = %e, "flow run: cannot load; retrying");
                        if !self.pause(failures).await {
                            return;
                        }
                        failures += 1;
                        continue;
                    }
                }
            }
            while let Ok(event) = rx.try_recv() {
                loaded &= !self.apply(event);
            }
            if !loaded {
                continue;
            }
            match self.step().await {
                Ok(Outcome::Ended) => return,
                Ok(Outcome::Idle) => failures = 0,
                Err(e) => {
                    debug!(run = %self.id, cause = %e, "flow run: reading it again");
                    loaded = false;
                    if !self.pause(failures).await {
                        return;
                    }
                    failures += 1;
                    continue;
                }
            }
            tokio::select! {
                _ = token.cancelled() => return,
                event = rx.recv() => match event {
                    None => return,
                    Some(event) => loaded &= !self.apply(event),
                },
            }
        }
    }

    async fn pause(&self, failures: u32) -> bool {
        tokio::select! {
            _ = self.token.cancelled() => false,
            _ = tokio::time::sleep(crate::retry::pause(failures.min(6))) => true,
        }
    }

    fn run(&self) -> &FlowRun {
        &self.run.as_ref().expect("loaded").0
    }

    /// Applies an event; true if the run must be read again.
    fn apply(&mut self, event: Event) -> bool {
        match event {
            Event::Run(revision) => self.run.as_ref().is_none_or(|(_, rev)| revision > *rev),
            Event::Task {
                step,
                epoch,
                item,
                rec,
            } => {
                let Some(&i) = self.index.get(&step) else {
                    return false;
                };
                if self.steps[i].epoch != epoch || self.steps[i].state != StepState::Running {
                    return false;
                }
                if rec.state == TaskState::Running && !self.observed[i] {
                    self.observe_start(i, &rec);
                }
                if let Some(done) = Done::of(&rec) {
                    self.finish_item(i, item, done);
                }
                false
            }
        }
    }

    /// Step latency: last parent task finished → this step's first task started.
    fn observe_start(&mut self, i: usize, rec: &TaskRecord) {
        self.observed[i] = true;
        let ready = self.plan.parents[i]
            .iter()
            .map(|&p| self.last_finish[p])
            .max();
        if let (Some(ready), Some(started)) = (ready.filter(|r| *r > 0), rec.started_at_ms) {
            let flow = self.run().flow.clone();
            metrics::histogram!(m::FLOW_STEP_LATENCY, "flow" => flow)
                .record(started.saturating_sub(ready) as f64 / 1000.0);
        }
    }

    fn finish_item(&mut self, i: usize, item: u32, done: Done) {
        let Some(slot) = self.items[i].get_mut(item as usize) else {
            return;
        };
        if slot.is_some() {
            return;
        }
        let p = &mut self.progress[i];
        match done.state {
            TaskState::Succeeded => p.succeeded += 1,
            TaskState::Cancelled => p.cancelled += 1,
            _ => {
                p.failed += 1;
                if self.first_failed_item[i].is_none_or(|f| item < f) {
                    self.first_failed_item[i] = Some(item);
                    p.first_error = Some(done.error.clone().unwrap_or(ErrorInfo {
                        detail: None,
                        class: "dead".into(),
                        message: String::new(),
                    }));
                }
            }
        }
        p.attempts = p.attempts.max(done.attempt);
        self.last_finish[i] = self.last_finish[i].max(done.finished_at_ms);
        *slot = Some(done);
    }

    fn reset_step(&mut self, i: usize, n: u32) {
        self.items[i] = vec![None; n as usize];
        self.progress[i] = Progress {
            total: Some(n),
            ..Progress::default()
        };
        self.first_failed_item[i] = None;
        self.last_finish[i] = 0;
        self.observed[i] = false;
        self.queued_cancelled[i] = false;
        self.outputs[i] = None;
    }

    fn task_id(&self, i: usize, item: u32) -> String {
        let run = self.run();
        let def = &run.def.steps[i];
        let queue = def.task.queue.as_deref().unwrap_or_default();
        step_task_id(queue, &run.id, &def.name, self.steps[i].epoch, item)
    }

    /// Reads the run, its steps and the records of its running steps' tasks. False if the
    /// run is gone or has ended.
    async fn load(&mut self) -> Result<bool, Fault> {
        let Some((run, rev)) = self.sh.store.run(&self.id).await? else {
            return Ok(false);
        };
        if run.state != RunState::Running {
            return Ok(false);
        }
        let plan = match run.def.validate(&self.sh.admission.limits) {
            Ok(plan) => plan,
            Err(e) => {
                self.run = Some((run, rev));
                self.end(
                    RunState::Failed,
                    format!("the definition is no longer valid: {e}"),
                )
                .await?;
                return Ok(false);
            }
        };
        let n = run.def.steps.len();
        let stored = self.sh.store.steps(&run).await?;
        self.index = run
            .def
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        self.plan = plan;
        self.steps = Vec::with_capacity(n);
        self.revs = Vec::with_capacity(n);
        for found in stored {
            let (step, rev) = found.map_or((StepRun::default(), None), |(s, r)| (s, Some(r)));
            self.steps.push(step);
            self.revs.push(rev);
        }
        self.items = vec![Vec::new(); n];
        self.progress = vec![Progress::default(); n];
        self.first_failed_item = vec![None; n];
        self.last_finish = vec![0; n];
        self.observed = vec![true; n];
        self.queued_cancelled = vec![false; n];
        self.outputs = vec![None; n];
        self.resubmit.clear();
        self.run = Some((run, rev));
        for i in 0..n {
            if self.steps[i].state != StepState::Running {
                continue;
            }
            let Some(items) = self.steps[i].items else {
                // Running without its items is not a state the engine writes: start again.
                self.steps[i].state = StepState::Waiting;
                continue;
            };
            self.reset_step(i, items);
            self.observed[i] = true;
            let missing = self.read_items(i).await?;
            if !missing.is_empty() {
                self.resubmit.push((i, missing));
            }
        }
        self.verify = true;
        Ok(true)
    }

    /// Reads the records of step `i`'s tasks into `items`; returns the items without one.
    async fn read_items(&mut self, i: usize) -> Result<Vec<u32>, Fault> {
        let n = self.items[i].len() as u32;
        let tasks = &self.sh.admission.tasks;
        let ids: Vec<(u32, String)> = (0..n)
            .filter(|&k| self.items[i][k as usize].is_none())
            .map(|k| (k, self.task_id(i, k)))
            .collect();
        let reads: Vec<_> = ids
            .into_iter()
            .map(|(k, id)| async move { (k, tasks.get(&id).await) })
            .collect::<Vec<_>>();
        let reads: Vec<_> = futures::stream::iter(reads)
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let mut missing = Vec::new();
        for (k, read) in reads {
            match read.map_err(|e| Fault::Other(e.to_string()))? {
                Some((rec, _)) => {
                    if let Some(done) = Done::of(&rec) {
                        self.finish_item(i, k, done);
                    }
                }
                None => missing.push(k),
            }
        }
        missing.sort_unstable();
        Ok(missing)
    }

    /// Advances until nothing changes; applies each decision.
    async fn step(&mut self) -> Result<Outcome, Fault> {
        loop {
            let cancel = self.run().cancel_requested;
            // Disjoint fields: the definition and plan are read while the steps change.
            let def = &self.run.as_ref().expect("loaded").0.def;
            let adv = advance(
                def,
                &self.plan.parents,
                &self.plan.order,
                cancel,
                &mut self.steps,
                &self.progress,
                now_ms(),
            );
            let cancel_queued: Vec<usize> = adv
                .cancel_queued
                .iter()
                .copied()
                .filter(|&i| !self.queued_cancelled[i])
                .collect();
            if adv.changed.is_empty() && self.resubmit.is_empty() && cancel_queued.is_empty() {
                self.verify = false;
                return match adv.end {
                    Some((state, reason)) => {
                        self.end(state, reason).await?;
                        Ok(Outcome::Ended)
                    }
                    None => Ok(Outcome::Idle),
                };
            }
            let mut changed: BTreeSet<usize> = adv.changed.iter().copied().collect();
            let mut submits: Vec<(usize, Vec<Built>)> = Vec::new();
            let starts = adv.start.iter().map(|&i| (i, None));
            let resubmits = std::mem::take(&mut self.resubmit)
                .into_iter()
                .map(|(i, missing)| (i, Some(missing)));
            for (i, only) in starts.collect::<Vec<_>>().into_iter().chain(resubmits) {
                match self.build(i).await {
                    Ok(mut tasks) => {
                        match only {
                            None => {
                                let n = tasks.len() as u32;
                                self.steps[i].items = Some(n);
                                self.reset_step(i, n);
                            }
                            Some(missing) => tasks.retain(|(k, _, _)| missing.contains(k)),
                        }
                        submits.push((i, tasks));
                    }
                    Err(error) => {
                        warn!(run = %self.id, step = %self.run().def.steps[i].name, class = %error.class,
                            cause = %error.message, "flow step cannot start; it fails");
                        let step = &mut self.steps[i];
                        step.state = StepState::Failed;
                        step.error = Some(error);
                        step.finished_at_ms = Some(now_ms());
                        if only.is_none() {
                            step.items = Some(0);
                            self.reset_step(i, 0);
                        }
                    }
                }
                changed.insert(i);
            }
            let (written, refused) =
                tokio::join!(self.write_steps(&changed), self.submit_all(&submits));
            for (i, rev) in written? {
                self.revs[i] = Some(rev);
            }
            for (i, item, done) in refused? {
                self.finish_item(i, item, done);
            }
            let why = if cancel {
                "the flow run was cancelled"
            } else {
                "a step failed and the flow fails fast"
            };
            for i in cancel_queued {
                self.cancel_queued(i, why).await?;
            }
            if self.verify {
                for &i in &adv.start {
                    if self.steps[i].state == StepState::Running {
                        self.read_items(i).await?;
                    }
                }
            }
        }
    }

    /// Writes the records of `changed` steps concurrently; returns their new revisions.
    async fn write_steps(&self, changed: &BTreeSet<usize>) -> Result<Vec<(usize, u64)>, Fault> {
        let run = self.run();
        let writes = changed.iter().map(|&i| {
            let name = &run.def.steps[i].name;
            let (step, rev) = (&self.steps[i], self.revs[i]);
            async move { (i, self.sh.store.put_step(&run.id, name, step, rev).await) }
        });
        let writes: Vec<_> = writes.collect();
        let results: Vec<_> = futures::stream::iter(writes)
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let mut revs = Vec::with_capacity(results.len());
        for (i, r) in results {
            revs.push((i, r?));
        }
        Ok(revs)
    }

    /// The output of succeeded step `p` as its children see it: the task's output, or for
    /// a fan-out step the list of its tasks' outputs in item order.
    async fn output_of(&mut self, p: usize) -> Result<Value, ErrorInfo> {
        if let Some(v) = &self.outputs[p] {
            return Ok(v.clone());
        }
        let n = self.steps[p].items.unwrap_or(0);
        if self.items[p].len() != n as usize || self.items[p].iter().any(Option::is_none) {
            // A parent that ended before this actor loaded: read its tasks' records.
            if self.items[p].len() != n as usize {
                self.items[p] = vec![None; n as usize];
            }
            self.read_items(p).await.map_err(|e| ErrorInfo {
                detail: None,
                class: "input_unavailable".into(),
                message: format!("reading parent {:?}: {e}", self.run().def.steps[p].name),
            })?;
        }
        let mut values = Vec::with_capacity(n as usize);
        for k in 0..n as usize {
            let stored = self.items[p][k].as_ref().and_then(|d| d.output.clone());
            let out = match stored {
                None => None,
                Some(stored) => match stored.inline() {
                    Some(out) => Some(out),
                    None => self.sh.results.read(&stored).await.map_err(|e| ErrorInfo {
                        detail: None,
                        class: "input_unavailable".into(),
                        message: format!(
                            "reading an output of {:?}: {e}",
                            self.run().def.steps[p].name
                        ),
                    })?,
                },
            };
            values.push(output_value(out));
        }
        let value = if self.run().def.steps[p].for_each.is_some() {
            Value::Array(values)
        } else {
            values.pop().unwrap_or(Value::Null)
        };
        self.outputs[p] = Some(value.clone());
        Ok(value)
    }

    /// The payloads of step `i`'s tasks (one, or one per fan-out item).
    async fn payloads(&mut self, i: usize) -> Result<Vec<Value>, ErrorInfo> {
        let step = self.run().def.steps[i].clone();
        let mut parents = Vec::new();
        let mut fan_out = None;
        for p in self.plan.parents[i].clone() {
            let name = self.run().def.steps[p].name.clone();
            let parent = match self.steps[p].state {
                StepState::Succeeded => Parent::Output(self.output_of(p).await?),
                other => Parent::Ended {
                    state: other.as_str(),
                    error: self.steps[p].error.clone(),
                },
            };
            if step.for_each.as_deref() == Some(name.as_str()) {
                fan_out = Some(parent);
            } else {
                parents.push((name, parent));
            }
        }
        let run = self.run();
        let input = StepInput {
            flow: &run.flow,
            run: &run.id,
            step: &step.name,
            input: &run.input,
            parents: parents
                .iter()
                .map(|(n, p)| (n.as_str(), p.clone()))
                .collect(),
            args: step.task.payload.as_ref(),
        };
        let Some(fan_out) = fan_out else {
            return Ok(vec![input.payload(None)]);
        };
        let over = step.for_each.as_deref().unwrap_or_default();
        let list = match fan_out {
            Parent::Output(Value::Array(list)) => list,
            Parent::Output(other) => {
                return Err(ErrorInfo {
                    detail: None,
                    class: "bad_fan_out".into(),
                    message: format!(
                        "for_each {over:?}: its output is not a JSON array but {}",
                        kind(&other)
                    ),
                })
            }
            Parent::Ended { state, .. } => {
                return Err(ErrorInfo {
                    detail: None,
                    class: "bad_fan_out".into(),
                    message: format!("for_each {over:?}: it ended {state}, with no output"),
                })
            }
        };
        if list.len() > MAX_FAN_OUT {
            return Err(ErrorInfo {
                detail: None,
                class: "fan_out_too_large".into(),
                message: format!(
                    "for_each {over:?}: {} items, at most {MAX_FAN_OUT}",
                    list.len()
                ),
            });
        }
        Ok(list
            .iter()
            .enumerate()
            .map(|(k, v)| input.payload(Some((k as u32, v))))
            .collect())
    }

    /// Builds step `i`'s tasks, each checked as its submit would be. An error fails the
    /// step (never a stuck run).
    async fn build(&mut self, i: usize) -> Result<Vec<Built>, ErrorInfo> {
        let payloads = self.payloads(i).await?;
        let limits = &self.sh.admission.limits;
        let template = &self.run().def.steps[i].task;
        let queue = template.queue.clone().unwrap_or_default();
        let mut built = Vec::with_capacity(payloads.len());
        for (k, payload) in payloads.into_iter().enumerate() {
            let mut req = template.clone();
            req.payload = Some(payload);
            let (mut meta, body) = TaskMeta::from_request(&queue, req, limits).map_err(|e| {
                let class = match (e.code, e.field.as_deref()) {
                    (ErrorCode::PayloadTooLarge, _) | (_, Some("payload")) => "input_too_large",
                    _ => "invalid_step_task",
                };
                ErrorInfo {
                    detail: None,
                    class: class.into(),
                    message: e.message,
                }
            })?;
            meta.id = self.task_id(i, k as u32);
            built.push((k as u32, meta, body));
        }
        Ok(built)
    }

    /// Submits step tasks; a full queue or an unreachable broker is retried (with backoff)
    /// until it takes them. Returns tasks refused for good, as failed items.
    async fn submit_all(
        &self,
        submits: &[(usize, Vec<Built>)],
    ) -> Result<Vec<(usize, u32, Done)>, Fault> {
        let admission = &self.sh.admission;
        let token = &self.token;
        let all = submits
            .iter()
            .flat_map(|(i, tasks)| tasks.iter().map(move |t| (*i, t)));
        let answers: Vec<_> = all
            .map(|(i, (k, meta, body))| async move {
                let mut n = 0u32;
                loop {
                    match admission.submit_prepared(meta.clone(), body.clone()).await {
                        Ok(_) => return Ok(None),
                        Err(e) if matches!(e.code, ErrorCode::Busy | ErrorCode::Unavailable) => {
                            if n == 0 {
                                warn!(task_id = %meta.id, cause = %e.message, "flow step task not accepted yet; retrying");
                            }
                            tokio::select! {
                                _ = token.cancelled() => return Err(Fault::Other("stopped".into())),
                                _ = tokio::time::sleep(crate::retry::pause(n.min(6))) => {}
                            }
                            n += 1;
                        }
                        Err(e) => return Ok(Some((i, *k, refused(e)))),
                    }
                }
            })
            .collect::<Vec<_>>();
        let answers: Vec<_> = futures::stream::iter(answers)
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let mut refusals = Vec::new();
        for answer in answers {
            if let Some(r) = answer? {
                refusals.push(r);
            }
        }
        Ok(refusals)
    }

    /// Cancels step `i`'s tasks that have not started; running ones finish.
    async fn cancel_queued(&mut self, i: usize, reason: &str) -> Result<(), Fault> {
        self.queued_cancelled[i] = true;
        let tasks = &self.sh.admission.tasks;
        let ids: Vec<(u32, String)> = (0..self.items[i].len() as u32)
            .filter(|&k| self.items[i][k as usize].is_none())
            .map(|k| (k, self.task_id(i, k)))
            .collect();
        let answers: Vec<_> = ids
            .into_iter()
            .map(|(k, id)| async move { (k, tasks.cancel_unstarted(&id, reason).await) })
            .collect::<Vec<_>>();
        let answers: Vec<_> = futures::stream::iter(answers)
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for (k, answer) in answers {
            if answer.map_err(|e| Fault::Other(e.to_string()))? == Some(TaskState::Cancelled) {
                let done = Done {
                    state: TaskState::Cancelled,
                    output: None,
                    error: None,
                    attempt: 0,
                    finished_at_ms: now_ms(),
                };
                self.finish_item(i, k, done);
            }
        }
        Ok(())
    }

    /// Writes the run's final state.
    async fn end(&mut self, state: RunState, reason: String) -> Result<(), Fault> {
        let (mut run, rev) = self.run.clone().expect("loaded");
        let now = now_ms();
        run.state = state;
        run.reason = Some(reason.clone());
        run.updated_at_ms = now;
        run.finished_at_ms = Some(now);
        let new = self.sh.store.put_run(&run, Some(rev)).await?;
        info!(run = %run.id, flow = %run.flow, state = %state, reason = %reason, "flow run ended");
        metrics::counter!(m::FLOW_RUNS_ENDED, "flow" => run.flow.clone(), "state" => state.as_str())
            .increment(1);
        if let (RunState::Failed, Some(alerts)) = (state, &self.sh.alerts) {
            alerts.flow_failed(&run, &reason, new).await;
        }
        self.run = Some((run, new));
        Ok(())
    }
}

/// A step task ready to submit: item index, headers, payload.
type Built = (u32, TaskMeta, bytes::Bytes);

/// A step task the admission refused for good (e.g. its queue is not declared).
fn refused(e: WireError) -> Done {
    Done {
        state: TaskState::Dead,
        output: None,
        error: Some(ErrorInfo {
            detail: None,
            class: e.code.as_str().to_string(),
            message: e.message,
        }),
        attempt: 0,
        finished_at_ms: now_ms(),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
