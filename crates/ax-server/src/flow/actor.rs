//! One running run, driven by the engine's leader: load it (run, steps, the records of
//! its running steps' tasks), advance it with [`super::advance`], apply the decisions
//! (write step records, submit step tasks, cancel queued ones, end the run), then wait for
//! the next completion.
//!
//! Exactly once per step: a step's tasks have deterministic ids per (run, step, epoch,
//! item), so submitting them again (after a crash, by a second leader, or after a full
//! queue refused them) is a no-op; every write is a compare-and-set, and a lost one makes
//! the run be read again and decided again from the same facts. Task completions are facts
//! in `AX_TASKS`, read durably; a [`Run`] holds only what it needs to decide: the shared
//! definition, each step's record and a tally of its tasks' ends (`Tracked`). Outputs a
//! step not started yet will need are held within the engine's byte budget and otherwise
//! read back from the task records when that step starts; so is the run's input.

use super::advance::{advance, Tracked};
use super::model::{step_task_id, FlowRun, RunState, StepRun, StepState};
use super::shared::{Budget, Reserved, Shape, Shared};
use super::store::FlowStoreError;
use ax_core::metrics as m;
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::state::{ErrorInfo, TaskRecord, TaskState};
use ax_core::task::TaskMeta;
use ax_core::time::now_ms;
use ax_core::wire::output::{StoredOutput, TaskOutput};
use bytes::Bytes;
use futures::StreamExt;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, info, warn};

/// Most step-task submits or record reads in flight per run.
pub(super) const CONCURRENCY: usize = 128;
/// What holding one output costs beyond its bytes (the entry, the allocation).
const HELD_ENTRY: usize = 64;
/// Loads in a row that may find a run key older than its feed announced before the run is
/// taken as gone.
const STALE_READS: u32 = 5;

/// What the leader routes to a run.
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

/// How a turn ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Nothing to do until the next event.
    Idle,
    /// Step tasks were not accepted yet (a full queue, the broker away): turn again after
    /// this pause, or at the next event.
    Retry(Duration),
    /// A read or write failed, or a compare-and-set was lost: read the run again after a
    /// pause.
    Failed,
    /// The run ended (its final state is written), is gone or is no longer running.
    Done,
}

/// A finished step task, as far as the tally cares.
#[derive(Debug, Clone)]
pub(super) struct Done {
    pub(super) state: TaskState,
    pub(super) error: Option<ErrorInfo>,
    pub(super) attempt: u32,
    pub(super) finished_at_ms: u64,
}

impl Done {
    pub(super) fn of(rec: &TaskRecord) -> Option<Done> {
        rec.state.is_terminal().then(|| Done {
            state: rec.state,
            error: rec.last_error.clone(),
            attempt: rec.attempt,
            finished_at_ms: rec.finished_at_ms.unwrap_or(rec.updated_at_ms),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub(super) enum Fault {
    #[error("{0}")]
    Store(#[from] FlowStoreError),
    #[error("{0}")]
    Other(String),
}

/// Outputs of one step's succeeded tasks, held for children not started yet.
#[derive(Debug)]
pub(super) struct Held {
    pub(super) step: usize,
    reserved: Reserved,
    pub(super) outputs: Vec<(u32, Option<TaskOutput>)>,
}

/// A step task ready to submit: item index, headers, payload.
pub(super) type Built = (u32, TaskMeta, Bytes);

/// One running run, as the leader holds it between turns.
pub(crate) struct Run {
    pub(super) id: Arc<str>,
    /// The definition (shared with the other runs of the same one); `None` until loaded.
    shape: Option<Arc<Shape>>,
    /// Revision of the run key last read or written (0: none).
    rev: u64,
    /// Newest revision of the run key the leader's feed announced (0: none).
    seen: u64,
    cancel: bool,
    loaded: bool,
    /// A newer revision of the run key was seen: read everything again.
    reload: bool,
    /// Just loaded: tasks of steps started now may exist already (a crash after their
    /// submits, before the step write): read their records back.
    verify: bool,
    /// Step tasks were refused for now in this turn: not submitted again before the next.
    parked: bool,
    /// Turns in a row whose submits were all or partly refused (the retry's backoff).
    refusals: u32,
    /// The run's input as JSON text, if the budget had room.
    pub(super) input: Option<(Reserved, Box<[u8]>)>,
    /// The business id its step tasks carry.
    pub(super) business_id: Option<Box<str>>,
    /// How deep a child run it is (0: it has no parent).
    pub(super) depth: u32,
    /// Child runs whose wait tasks ended without them: cancelled before the next step
    /// write.
    pub(super) orphans: Vec<Box<str>>,
    pub(super) steps: Box<[Tracked]>,
    pub(super) held: Vec<Held>,
    /// (step, item) of tasks of running steps without a record (a crash between the step
    /// write and its submits, or refused for now): submitted again. Sorted.
    resubmit: Vec<(u32, u32)>,
    /// When the leader turns it next (kept here so that an idle run is one allocation).
    pub(crate) sched: Sched,
}

/// How the leader schedules a run's turns.
#[derive(Debug, Default)]
pub(crate) struct Sched {
    /// In the queue for a turn.
    pub(crate) queued: bool,
    /// A timer wakes it then (a retry after a refusal or a fault).
    pub(crate) wake: Option<tokio::time::Instant>,
    /// Faults in a row (backoff); events do not wake a run waiting after a fault.
    pub(crate) failures: u32,
}

impl Run {
    pub(crate) fn new(id: Arc<str>) -> Box<Run> {
        Box::new(Run {
            id,
            shape: None,
            rev: 0,
            seen: 0,
            cancel: false,
            loaded: false,
            reload: false,
            verify: false,
            parked: false,
            refusals: 0,
            input: None,
            business_id: None,
            depth: 0,
            orphans: Vec::new(),
            steps: Box::default(),
            held: Vec::new(),
            resubmit: Vec::new(),
            sched: Sched::default(),
        })
    }

    /// The run to be read again from scratch, knowing the newest revision announced.
    pub(crate) fn afresh(&self) -> Box<Run> {
        let mut run = Run::new(self.id.clone());
        run.seen = self.seen;
        run
    }

    pub(super) fn shape(&self) -> &Arc<Shape> {
        self.shape.as_ref().expect("loaded")
    }

    /// True if a newer write of the run key was seen than the one last read or written.
    pub(crate) fn reloading(&self) -> bool {
        self.reload
    }

    /// True if a turn has something to do: load, read again, decide on a step whose tasks
    /// have all ended, or submit again what was refused (when not waiting to).
    pub(crate) fn wants_turn(&self) -> bool {
        !self.loaded
            || self.reload
            || (!self.parked && !self.resubmit.is_empty())
            || self.steps.iter().any(Tracked::all_ended)
    }

    /// Applies an event (in the leader's loop, between turns); outputs a child will need
    /// are held within `held`. No I/O: unit-tested without NATS.
    pub(crate) fn apply(&mut self, event: Event, held: &Budget) {
        match event {
            Event::Run(revision) => {
                self.seen = self.seen.max(revision);
                self.reload |= revision > self.rev;
            }
            Event::Task {
                step,
                epoch,
                item,
                rec,
            } => {
                // Not loaded, or to be read again: the load reads what this says.
                if !self.loaded || self.reload {
                    return;
                }
                let Some(&i) = self.shape().index.get(&step) else {
                    return;
                };
                let s = &self.steps[i];
                if s.epoch != epoch || s.state != StepState::Running {
                    return;
                }
                if rec.state == TaskState::Running && !s.observed {
                    self.observe_start(i, &rec);
                }
                if let Some(done) = Done::of(&rec) {
                    self.finish_item(held, i, item, done, rec.output.as_ref());
                }
            }
        }
    }

    /// One turn: load if needed, then advance until nothing changes.
    pub(crate) async fn turn(&mut self, sh: &Shared) -> Outcome {
        if sh.ctx.faults.turn_panics(&self.id) {
            panic!("injected fault: a turn of flow run {} panicked", self.id);
        }
        self.parked = false;
        if self.reload {
            self.loaded = false;
        }
        if !self.loaded {
            match self.load(sh).await {
                Ok(true) => {}
                Ok(false) => return Outcome::Done,
                Err(e) => {
                    warn!(run = %self.id, cause = %e, "flow run: cannot load; retrying");
                    return Outcome::Failed;
                }
            }
        }
        match self.step(sh).await {
            Ok(outcome) => outcome,
            Err(e) => {
                debug!(run = %self.id, cause = %e, "flow run: reading it again");
                self.loaded = false;
                Outcome::Failed
            }
        }
    }

    /// Step latency: last parent task finished → this step's first task started.
    fn observe_start(&mut self, i: usize, rec: &TaskRecord) {
        self.steps[i].observed = true;
        let shape = self.shape();
        let ready = shape.plan.parents[i]
            .iter()
            .map(|&p| self.steps[p].last_finish)
            .max();
        if let (Some(ready), Some(started)) = (ready.filter(|r| *r > 0), rec.started_at_ms) {
            metrics::histogram!(m::FLOW_STEP_LATENCY, "flow" => shape.flow.clone())
                .record(started.saturating_sub(ready) as f64 / 1000.0);
        }
    }

    /// Counts item `item` of step `i` as ended; holds its output if a child not started
    /// yet will need it and the budget has room.
    pub(super) fn finish_item(
        &mut self,
        budget: &Budget,
        i: usize,
        item: u32,
        done: Done,
        output: Option<&StoredOutput>,
    ) {
        let counted = self.steps[i].end_task(
            item,
            done.state,
            done.error.as_ref(),
            done.attempt,
            done.finished_at_ms,
        );
        if counted {
            self.note_orphan(i, item, &done, output);
        }
        if !counted || done.state != TaskState::Succeeded || !self.awaited(i) {
            return;
        }
        let out = match output {
            None => None,
            // A reference to `AX_RESULTS` is read back with the record when needed.
            Some(stored) => match stored.inline() {
                Some(out) => Some(out),
                None => return,
            },
        };
        let bytes = HELD_ENTRY + out.as_ref().map_or(0, |o| o.bytes.len());
        match self.held.iter_mut().find(|h| h.step == i) {
            Some(held) => {
                if held.reserved.grow(budget, bytes) {
                    held.outputs.push((item, out));
                }
            }
            None => {
                if let Some(reserved) = budget.take(bytes) {
                    self.held.push(Held {
                        step: i,
                        reserved,
                        outputs: vec![(item, out)],
                    });
                }
            }
        }
    }

    /// True if a child of step `i` has not started yet, or has tasks to submit again.
    fn awaited(&self, i: usize) -> bool {
        self.shape().children[i].iter().any(|&c| {
            self.steps[c].state == StepState::Waiting
                || self.resubmit.iter().any(|r| r.0 as usize == c)
        })
    }

    /// Drops held outputs no child will read any more.
    fn release_outputs(&mut self) {
        let keep: Vec<bool> = self.held.iter().map(|h| self.awaited(h.step)).collect();
        let mut keep = keep.into_iter();
        self.held.retain(|_| keep.next().unwrap_or(false));
    }

    pub(super) fn task_id(&self, i: usize, item: u32) -> String {
        let def = &self.shape().def.steps[i];
        let queue = def.task.queue.as_deref().unwrap_or_default();
        step_task_id(queue, &self.id, &def.name, self.steps[i].epoch, item)
    }

    /// Reads the run, its steps and the records of its running steps' tasks. False if the
    /// run is gone or has ended.
    async fn load(&mut self, sh: &Shared) -> Result<bool, Fault> {
        self.reload = false;
        self.held.clear();
        self.resubmit.clear();
        self.orphans.clear();
        self.input = None;
        let found = match sh.store.run(&self.id).await {
            Err(FlowStoreError::Corrupt { source, .. }) => {
                warn!(run = %self.id, cause = %source, "stored run does not decode; ignored");
                None
            }
            found => found?,
        };
        // Older than the feed announced (a read answered by a replica behind the leader):
        // read again rather than drop a running run (a few times: a run key that vanished
        // for good, expired, is let go).
        let stale = match &found {
            Some((_, rev)) => *rev < self.seen,
            None => self.seen > 0 && self.sched.failures < STALE_READS,
        };
        if stale {
            return Err(Fault::Other(format!(
                "read revision {:?}, the feed announced {}: a replica behind; reading again",
                found.as_ref().map(|f| f.1),
                self.seen
            )));
        }
        let Some((run, rev)) = found else {
            self.rev = 0;
            return Ok(false);
        };
        self.rev = rev;
        if run.state != RunState::Running {
            return Ok(false);
        }
        let stored = sh.store.steps(&run).await?;
        let input = serde_json::to_vec(&run.input).expect("a JSON value serializes");
        let FlowRun {
            flow,
            def,
            cancel_requested,
            business_id,
            parent,
            ..
        } = run;
        self.business_id = business_id.map(String::into_boxed_str);
        self.depth = parent.map_or(0, |p| p.depth);
        let shape = match sh.shapes.get(&flow, def, &sh.ctx.limits) {
            Ok(shape) => shape,
            Err(e) => {
                let reason = format!("the definition is no longer valid: {e}");
                self.end(sh, RunState::Failed, reason).await?;
                return Ok(false);
            }
        };
        self.install(&sh.held, shape, cancel_requested, input, stored);
        for i in 0..self.steps.len() {
            if self.steps[i].state != StepState::Running {
                continue;
            }
            let Some(items) = self.steps[i].items else {
                // Running without its items is not a state the engine writes: start again.
                self.steps[i].state = StepState::Waiting;
                continue;
            };
            self.steps[i].start(items);
            self.steps[i].observed = true;
            let missing = self.read_items(sh, i).await?;
            if self.shape().def.steps[i].child_flow.is_some() {
                // Stored wait tasks whose child runs a leader killed after the submit
                // may not have started: started (again: a no-op once made).
                let stored: Vec<u32> = (0..items)
                    .filter(|k| !self.steps[i].has_ended(*k) && missing.binary_search(k).is_err())
                    .collect();
                if !stored.is_empty() {
                    let built = self.build(sh, i, Some(&stored)).await.map_err(|e| {
                        Fault::Other(format!("child runs not started again: {}", e.message))
                    })?;
                    self.start_children(sh, i, &built.iter().collect::<Vec<_>>())
                        .await?;
                }
            }
            self.resubmit
                .extend(missing.into_iter().map(|k| (i as u32, k)));
        }
        self.loaded = true;
        self.verify = true;
        Ok(true)
    }

    /// Takes what a load read: the shared shape, the cancel flag, the input (held if the
    /// budget has room) and the step records.
    pub(crate) fn install(
        &mut self,
        held: &super::shared::Budget,
        shape: Arc<Shape>,
        cancel: bool,
        input: Vec<u8>,
        stored: Vec<Option<(StepRun, u64)>>,
    ) {
        self.cancel = cancel;
        self.input = held
            .take(input.len())
            .map(|r| (r, input.into_boxed_slice()));
        self.steps = stored
            .into_iter()
            .map(|found| match found {
                Some((step, rev)) => Tracked::new(step, Some(rev)),
                None => Tracked::new(StepRun::default(), None),
            })
            .collect();
        self.shape = Some(shape);
    }

    /// Reads the records of step `i`'s tasks not counted yet; returns the items without one.
    async fn read_items(&mut self, sh: &Shared, i: usize) -> Result<Vec<u32>, Fault> {
        let n = self.steps[i].items.unwrap_or(0);
        let tasks = &sh.ctx.tasks;
        let ids: Vec<(u32, String)> = (0..n)
            .filter(|&k| !self.steps[i].has_ended(k))
            .map(|k| (k, self.task_id(i, k)))
            .collect();
        let reads: Vec<_> = futures::stream::iter(
            ids.into_iter()
                .map(|(k, id)| async move { (k, tasks.get_latest(&id).await) }),
        )
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
        let mut missing = Vec::new();
        for (k, read) in reads {
            match read.map_err(|e| Fault::Other(e.to_string()))? {
                Some((rec, _)) => {
                    if let Some(done) = Done::of(&rec) {
                        self.finish_item(&sh.held, i, k, done, rec.output.as_ref());
                    }
                }
                None => missing.push(k),
            }
        }
        missing.sort_unstable();
        Ok(missing)
    }

    /// Advances until nothing changes; applies each decision.
    async fn step(&mut self, sh: &Shared) -> Result<Outcome, Fault> {
        let shape = self.shape().clone();
        loop {
            // Before any step's end is written: a child whose step ended without it.
            self.cancel_orphans(sh).await?;
            let mut records: Vec<StepRun> = self.steps.iter().map(Tracked::record).collect();
            let progress: Vec<_> = self.steps.iter().map(Tracked::progress).collect();
            let adv = advance(
                &shape.def,
                &shape.plan.parents,
                &shape.plan.order,
                self.cancel,
                &mut records,
                &progress,
                now_ms(),
            );
            for &i in &adv.changed {
                self.steps[i].set_record(std::mem::take(&mut records[i]));
            }
            let mut cancel_queued: Vec<usize> = adv
                .cancel_queued
                .iter()
                .copied()
                .filter(|&i| !self.steps[i].queued_cancelled)
                .collect();
            let again = if self.parked {
                Vec::new()
            } else {
                by_step(&std::mem::take(&mut self.resubmit))
            };
            if adv.changed.is_empty() && again.is_empty() && cancel_queued.is_empty() {
                self.verify = false;
                self.release_outputs();
                if let Some((state, reason)) = adv.end {
                    self.end(sh, state, reason).await?;
                    return Ok(Outcome::Done);
                }
                return Ok(match self.parked {
                    true => Outcome::Retry(ax_core::retry::pause(self.refusals.min(7) - 1)),
                    false => Outcome::Idle,
                });
            }
            let mut changed: BTreeSet<usize> = adv.changed.iter().copied().collect();
            let mut submits: Vec<(usize, Vec<Built>)> = Vec::new();
            let starts = adv.start.iter().map(|&i| (i, None));
            let again = again.into_iter().map(|(i, missing)| (i, Some(missing)));
            for (i, only) in starts.collect::<Vec<_>>().into_iter().chain(again) {
                match self.build(sh, i, only.as_deref()).await {
                    Ok(tasks) => {
                        if only.is_none() {
                            self.steps[i].start(tasks.len() as u32);
                        }
                        submits.push((i, tasks));
                    }
                    Err(error) => {
                        warn!(run = %self.id, step = %shape.def.steps[i].name, class = %error.class,
                            cause = %error.message, "flow step cannot start; it fails");
                        let mut record = self.steps[i].record();
                        record.state = StepState::Failed;
                        record.error = Some(error);
                        record.finished_at_ms = Some(now_ms());
                        self.steps[i].set_record(record);
                        if only.is_none() {
                            self.steps[i].start(0);
                        }
                        changed.insert(i);
                    }
                }
                if only.is_none() {
                    changed.insert(i);
                }
            }
            let (written, answers) = tokio::join!(
                self.write_steps(sh, &changed),
                self.submit_all(sh, &submits)
            );
            for (i, rev) in written? {
                self.steps[i].set_rev(rev);
            }
            let Submitted { refused, later } = answers;
            for (i, item, done) in &refused {
                self.finish_item(&sh.held, *i, *item, done.clone(), None);
            }
            // Child runs start once their wait tasks are stored.
            for (i, tasks) in &submits {
                if shape.def.steps[*i].child_flow.is_none() {
                    continue;
                }
                let not = |k: &u32| {
                    refused.iter().any(|r| (r.0, r.1) == (*i, *k)) || later.contains(&(*i, *k))
                };
                let stored: Vec<&Built> = tasks.iter().filter(|t| !not(&t.0)).collect();
                sh.ctx.faults.pass(ax_core::faults::Abort::AfterChildSubmit);
                self.start_children(sh, *i, &stored).await?;
            }
            if !submits.is_empty() {
                self.note_refusals(later);
            }
            // Tasks submitted again into a step whose queued tasks were cancelled are
            // cancelled too (as they would have been, had they been accepted at once).
            for (i, _) in &submits {
                if self.steps[*i].queued_cancelled && !cancel_queued.contains(i) {
                    cancel_queued.push(*i);
                }
            }
            let why = if self.cancel {
                "the flow run was cancelled"
            } else {
                "a step failed and the flow fails fast"
            };
            for i in cancel_queued {
                self.cancel_queued(sh, i, why).await?;
            }
            if self.verify {
                for &i in &adv.start {
                    if self.steps[i].state == StepState::Running {
                        self.read_items(sh, i).await?;
                    }
                }
            }
        }
    }

    /// Keeps step tasks refused for now to submit again after a pause.
    fn note_refusals(&mut self, later: Vec<(usize, u32)>) {
        if later.is_empty() {
            self.refusals = 0;
            return;
        }
        self.refusals += 1;
        self.parked = true;
        self.resubmit
            .extend(later.into_iter().map(|(i, k)| (i as u32, k)));
        self.resubmit.sort_unstable();
        self.resubmit.dedup();
        self.resubmit.shrink_to_fit();
    }

    /// Writes the records of `changed` steps concurrently; returns their new revisions.
    async fn write_steps(
        &self,
        sh: &Shared,
        changed: &BTreeSet<usize>,
    ) -> Result<Vec<(usize, u64)>, Fault> {
        let shape = self.shape();
        let writes = changed.iter().map(|&i| {
            let name = &shape.def.steps[i].name;
            let (step, rev) = (self.steps[i].record(), self.steps[i].rev());
            async move { (i, sh.store.put_step(&self.id, name, &step, rev).await) }
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

    /// Submits step tasks once each. A full queue or an unreachable broker leaves a task
    /// for later (counted, summed up in one line now and then); a refusal for good makes
    /// it a failed item.
    async fn submit_all(&self, sh: &Shared, submits: &[(usize, Vec<Built>)]) -> Submitted {
        let ctx = &sh.ctx;
        let all = submits
            .iter()
            .flat_map(|(i, tasks)| tasks.iter().map(move |t| (*i, t)));
        let answers: Vec<_> = all
            .map(|(i, (k, meta, body))| async move {
                (
                    i,
                    *k,
                    meta,
                    ctx.submit_prepared(meta.clone(), body.clone()).await,
                )
            })
            .collect();
        let answers: Vec<_> = futures::stream::iter(answers)
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let mut out = Submitted::default();
        for (i, k, meta, answer) in answers {
            match answer {
                Ok(_) => {}
                Err(e) if matches!(e.code, ErrorCode::Busy | ErrorCode::Unavailable) => {
                    debug!(task_id = %meta.id, cause = %e.message, "flow step task not accepted yet; retrying");
                    sh.retries.record(&meta.queue, &e.message);
                    out.later.push((i, k));
                }
                Err(e) => out.refused.push((i, k, refused(e))),
            }
        }
        out
    }

    /// Cancels step `i`'s tasks that have not started; running ones finish.
    async fn cancel_queued(&mut self, sh: &Shared, i: usize, reason: &str) -> Result<(), Fault> {
        self.steps[i].queued_cancelled = true;
        // A worker may be starting one of them without a `running` write (a retry): it
        // is signalled before the record is written (ops::holder).
        let holders = crate::ops::holder::Holders {
            js: &sh.ctx.js,
            tasks: &sh.ctx.tasks,
        };
        let holders = &holders;
        let ids: Vec<(u32, String)> = (0..self.steps[i].items.unwrap_or(0))
            .filter(|&k| !self.steps[i].has_ended(k))
            .map(|k| (k, self.task_id(i, k)))
            .collect();
        let answers: Vec<_> = futures::stream::iter(
            ids.into_iter()
                .map(|(k, id)| async move { (k, holders.cancel_unstarted(&id, reason).await) }),
        )
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
        let def = &self.shape().def.steps[i];
        let registered = def.wait_for_event.is_some() || def.approval.is_some();
        for (k, answer) in answers {
            if answer.map_err(|e| Fault::Other(e.to_string()))? == Some(TaskState::Cancelled) {
                if registered {
                    // The matcher need not keep a cancelled wait until its timeout; if this
                    // removal fails, its sweep removes it then.
                    let id = self.task_id(i, k);
                    if let Err(e) = sh.ctx.waits.remove(&id).await {
                        debug!(task_id = %id, cause = %e, "a cancelled wait's registration not removed; the matcher's sweep will");
                    }
                }
                let done = Done {
                    state: TaskState::Cancelled,
                    error: None,
                    attempt: 0,
                    finished_at_ms: now_ms(),
                };
                self.finish_item(&sh.held, i, k, done, None);
            }
        }
        Ok(())
    }

    /// Writes the run's final state (the run key is read back: its definition and input
    /// are not held).
    async fn end(&mut self, sh: &Shared, state: RunState, reason: String) -> Result<(), Fault> {
        let Some((mut run, rev)) = sh.store.run(&self.id).await? else {
            return Err(Fault::Other("the run is gone".into()));
        };
        if rev != self.rev {
            return Err(FlowStoreError::Stale(self.id.to_string()).into());
        }
        if let Some(parent) = &run.parent {
            let state = match self.shape.is_some() {
                true => state,
                false => RunState::Failed, // its definition did not load: no outputs
            };
            self.end_parent(sh, parent, &run.flow, state, &reason)
                .await?;
        }
        let now = now_ms();
        run.state = state;
        run.reason = Some(reason.clone());
        run.updated_at_ms = now;
        run.finished_at_ms = Some(now);
        let new = sh.store.put_run(&run, Some(rev)).await?;
        self.rev = new;
        info!(run = %run.id, flow = %run.flow, state = %state, reason = %reason, "flow run ended");
        metrics::counter!(m::FLOW_RUNS_ENDED, "flow" => run.flow.clone(), "state" => state.as_str())
            .increment(1);
        if let (RunState::Failed, Some(alerts)) = (state, &sh.alerts) {
            alerts.flow_failed(&run, &reason, new).await;
        }
        Ok(())
    }
}

#[cfg(test)]
impl Run {
    /// As a turn leaves a run whose step `i` runs `n` tasks, none ended yet, and (if
    /// `refused`) its item 0 refused for now by a full queue.
    pub(crate) fn running_for_test(&mut self, i: usize, n: u32, refused: bool) {
        let mut rec = self.steps[i].record();
        rec.state = StepState::Running;
        rec.started_at_ms = Some(now_ms());
        self.steps[i].set_record(rec);
        self.steps[i].set_rev(2);
        self.steps[i].start(n);
        if refused {
            self.note_refusals(vec![(i, 0)]);
        }
        self.loaded = true;
        self.rev = 1;
    }
}

/// Sorted (step, item) pairs as each step's items.
fn by_step(pairs: &[(u32, u32)]) -> Vec<(usize, Vec<u32>)> {
    let mut out: Vec<(usize, Vec<u32>)> = Vec::new();
    for &(i, k) in pairs {
        match out.last_mut() {
            Some((last, items)) if *last == i as usize => items.push(k),
            _ => out.push((i as usize, vec![k])),
        }
    }
    out
}

/// The answers to one round of submits.
#[derive(Default)]
struct Submitted {
    /// Refused for good, as failed items.
    refused: Vec<(usize, u32, Done)>,
    /// Not accepted yet: submitted again later.
    later: Vec<(usize, u32)>,
}

/// A step task the admission refused for good (e.g. its queue is not declared).
fn refused(e: WireError) -> Done {
    Done {
        state: TaskState::Dead,
        error: Some(ErrorInfo {
            detail: None,
            class: e.code.as_str().to_string(),
            message: e.message,
        }),
        attempt: 0,
        finished_at_ms: now_ms(),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::shared::{Budget, Shapes};
    use super::*;
    use crate::flow::def::{FlowDef, StepDef};
    use ax_sdk::client::TaskSpec;

    /// Flow `diamond` on queue `queue`: a; b and c after a; d after b and c.
    pub(in crate::flow) fn diamond(queue: &str) -> FlowDef {
        let step = |name: &str| StepDef::new(name, queue, TaskSpec::new("step"));
        FlowDef::new("diamond")
            .step(step("a"))
            .step(step("b").needs(["a"]))
            .step(step("c").needs(["a"]))
            .step(step("d").needs(["b", "c"]))
    }

    /// A diamond flow's run whose step `a` runs two tasks (b and c wait on a, d on both).
    fn running_diamond() -> (Box<Run>, Budget) {
        let limits = ax_core::task::Limits::default();
        let shape = Shapes::default()
            .get("diamond", diamond("q"), &limits)
            .expect("valid");
        let budget = Budget::new(1 << 20);
        let mut run = Run::new("r1".into());
        run.install(&budget, shape, false, b"{}".to_vec(), vec![None; 4]);
        run.running_for_test(0, 2, false);
        (run, budget)
    }

    fn task(step: &str, epoch: u32, item: u32, state: &str) -> Event {
        let rec = serde_json::from_value(serde_json::json!({"id": format!("q.fl.{item}"),
            "queue": "q", "name": "step", "priority": "normal", "state": state, "attempt": 1,
            "max_attempts": 3, "created_at_ms": 1, "updated_at_ms": 2, "started_at_ms": 1}))
        .expect("a record");
        Event::Task {
            step: step.into(),
            epoch,
            item,
            rec: Box::new(rec),
        }
    }

    #[test]
    fn a_step_wants_its_turn_once_each_task_ended_and_each_end_counts_once() {
        let (mut run, budget) = running_diamond();
        let epoch = run.steps[0].epoch;
        assert!(!run.wants_turn(), "nothing ended yet");
        run.apply(task("a", epoch, 0, "running"), &budget);
        run.apply(task("a", epoch, 0, "succeeded"), &budget);
        run.apply(task("a", epoch, 0, "succeeded"), &budget);
        assert!(!run.wants_turn(), "one of two ended, seen twice");
        run.apply(task("a", epoch, 1, "dead"), &budget);
        assert!(run.wants_turn());
        // b and c wait on a: the succeeded task's output is held for them, the dead one's
        // is not.
        assert_eq!(run.held.len(), 1);
        assert_eq!(run.held[0].outputs.len(), 1);
    }

    #[test]
    fn events_of_another_epoch_or_step_or_while_reloading_are_left_to_the_load() {
        let (mut run, budget) = running_diamond();
        let epoch = run.steps[0].epoch;
        run.apply(task("a", epoch + 1, 0, "succeeded"), &budget);
        run.apply(task("a", epoch + 1, 1, "succeeded"), &budget);
        run.apply(task("b", epoch, 0, "succeeded"), &budget);
        run.apply(task("nope", epoch, 0, "succeeded"), &budget);
        assert!(!run.wants_turn(), "nothing of this epoch's step a ended");
        // A newer write of the run key: read everything again; task events wait for it.
        run.apply(Event::Run(run.rev), &budget);
        assert!(!run.reloading(), "the revision it holds is not newer");
        run.apply(Event::Run(run.rev + 1), &budget);
        assert!(run.reloading() && run.wants_turn());
        run.apply(task("a", epoch, 0, "succeeded"), &budget);
        run.apply(task("a", epoch, 1, "succeeded"), &budget);
        assert!(
            !run.steps[0].all_ended(),
            "counted by the load, not by events"
        );
    }
}
