//! The trigger engine inside `ax server`: one leader fires, the others stand by.
//!
//! Leadership is the lease in `AX_LEASES` (see `lease`); its revision is the leader's
//! fencing token, stored in every trigger state the leader writes. The leader follows
//! `AX_TRIGGERS` (definitions, hot-reloaded) and `AX_TRIGGER_STATE` (manual runs made
//! through any server), both pulled in batches (`trigger/feed.rs`), keeps a timer heap of next fire times, and follows the records of
//! trigger tasks with a KV watch on `AX_TASKS` keys `*.tr.>` (an ordered consumer: no
//! message is dropped, whatever the load) to know when they finish (overlap policies,
//! fixed-delay). Completion tracking is recoverable: on every (re)load of a trigger, and at
//! most every few seconds while a trigger waits on unfinished tasks, the unfinished ids are
//! re-checked against their records.
//!
//! A fire is: submit each template as task `<queue>.tr.<trigger>.<scheduled ms>.<i>`, then
//! compare-and-set the trigger's state. A crash in between is repaired by the next leader
//! re-planning the same scheduled time: the same task ids make the re-submission a no-op
//! (the message id within the 2-minute window, the record's create-if-absent after it). If
//! the state changed meanwhile (a manual run), the fire is merged into the new state, never
//! re-planned, so a fired time is never recorded as skipped.
//!
//! **No fire over an unrecorded one.** A fire whose state write failed or went unanswered
//! (or whose submit was refused, which may still have stored its task) leaves the trigger
//! *unsure*: nothing of it is planned until the state is read again from the store, the
//! fires found as tasks but missing from it are written into it (`recover.rs`), and that
//! write has succeeded. So a leader whose state writes fail fires a trigger at most once
//! until the broker takes its writes again, and every fire it made is in the stored state
//! before the next one (a leader that kept firing with each fire unrecorded would
//! undercount them in its state). A leader that
//! stops leading aborts the fires it still has in flight, as a crash would.
//!
//! **Each term claims a state before firing it.** A new leader's first fire job of a
//! trigger first writes the state as read with its own token (compare-and-set): a previous
//! leader's job that outlived its lease (its leader stalled) then fails its write and steps
//! down, instead of landing a fire this leader makes too. A fire is merged only into a
//! state this leader claimed (a manual run's write keeps the token), never into another
//! leader's.

mod book;
mod error;
mod held;
mod overlap;
mod recover;

use super::clock::Clock;
use super::fire::{fire, scheduled_tag, tracked_ids, trigger_of_task, unfinished};
use super::model::TriggerDef;
use super::plan::{plan, Plan, Source, TriggerState};
use super::recur::Recurrence;
use super::store::{TriggerStore, TriggerStoreError};
use crate::context::Context;
use crate::lease::{run_as_leader, Leader, Lease, Stop, TRIGGERS_KEY};
use crate::trigger::Validate;
use async_nats::jetstream::kv;
use ax_core::names::LEASES_BUCKET;
use ax_core::state::TaskRecord;
use book::{Book, Rest, Seen};
use error::broker;
pub(crate) use error::EngineError;
use futures::{FutureExt, StreamExt};
use held::{
    merge_fire, tracks_every_fire, Held, Outcome, Recorded, MERGE_ATTEMPTS, RECHECK, RETRY_MS,
};
use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};

/// Most triggers fired at once by the leader.
const MAX_CONCURRENT_FIRES: usize = 512;
/// How long a fire job fires one scheduled time again while the broker answers
/// `unavailable`, before it leaves the trigger to be repaired and planned again.
const FIRE_RETRY_FOR: Duration = Duration::from_secs(15);

pub(crate) struct Engine {
    pub(crate) ctx: Arc<Context>,
    /// Task operations: overlap `cancel_in_progress` cancels as an operator does.
    pub(crate) ops: crate::ops::actions::Ops,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) lease_ttl: Duration,
    pub(crate) id: String,
    /// How far ahead a trigger is held whole (`ServerBuilder::trigger_hold`).
    pub(crate) hold: Duration,
}

/// Why leading stopped.
/// The engine's term as leader, for [`run_as_leader`].
struct Leading<'a> {
    engine: &'a Engine,
    store: &'a TriggerStore,
}

impl Leader for Leading<'_> {
    type Error = EngineError;

    async fn lead(
        &self,
        lease: &mut Lease,
        shutdown: &CancellationToken,
    ) -> Result<Stop, EngineError> {
        self.engine.lead(self.store, lease, shutdown).await
    }
}

impl Engine {
    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), EngineError> {
        let js = self.ctx.js.clone();
        let store = TriggerStore::open(&js)
            .await?
            .faults(self.ctx.faults.clone());
        let kv = js
            .get_key_value(LEASES_BUCKET)
            .await
            .map_err(|e| broker("open leases")(e.into()))?;
        let lease = Lease::new(
            js.client(),
            kv,
            TRIGGERS_KEY,
            self.id.clone(),
            self.lease_ttl,
        );
        let leading = Leading {
            engine: &self,
            store: &store,
        };
        let stood_down = || {
            for how in ["whole", "resting"] {
                metrics::gauge!(ax_core::metrics::TRIGGERS_HELD, "how" => how).set(0.0);
            }
        };
        run_as_leader("trigger engine", &leading, lease, &shutdown, stood_down).await;
        Ok(())
    }

    /// Reads back a trigger held as its name alone ([`Book::rest`]): as a new leader
    /// loads one. `None` if its definition is gone or no longer valid.
    async fn read_back(
        &self,
        store: &TriggerStore,
        name: &str,
    ) -> Result<Option<Held>, EngineError> {
        let Some((def, _)) = store.def(name).await? else {
            return Ok(None);
        };
        let Ok(rec) = def.validate() else {
            return Ok(None);
        };
        self.load(store, def, rec).await.map(Some)
    }

    /// Loads a trigger's state (creating it if missing) and re-checks its unfinished tasks.
    async fn load(
        &self,
        store: &TriggerStore,
        def: TriggerDef,
        rec: Recurrence,
    ) -> Result<Held, EngineError> {
        let name = def.name.clone();
        let (state, revision) = match store.state(&name).await? {
            Some(found) => found,
            None => {
                let state = TriggerState {
                    created_at_ms: self.clock.now_ms(),
                    ..Default::default()
                };
                match store.put_state(&name, &state, None).await {
                    Ok(rev) => (state, rev),
                    Err(TriggerStoreError::Stale(_)) => store
                        .state(&name)
                        .await?
                        .ok_or_else(|| TriggerStoreError::Stale(name.clone()))?,
                    Err(e) => return Err(e.into()),
                }
            }
        };
        let active = unfinished(&self.ctx, tracked_ids(&state)).await;
        let mut h = Held {
            def,
            rec,
            state,
            revision,
            active,
            early_done: HashSet::new(),
            checked_at: Some(Instant::now()),
            unsure: true,
            fresh: true,
            unstored: false,
            dirty: false,
            known: Default::default(),
            made: Default::default(),
            planned: Vec::new(),
        };
        self.settle(&mut h);
        Ok(h)
    }

    async fn lead(
        &self,
        store: &TriggerStore,
        lease: &mut Lease,
        shutdown: &CancellationToken,
    ) -> Result<Stop, EngineError> {
        let watch = super::feed::definitions(&self.ctx.js).await?;
        tokio::pin!(watch);
        // Every write to a trigger task's record, delivered by an ordered consumer.
        let mut completions = self
            .ctx
            .tasks
            .watch_trigger_tasks()
            .await
            .map_err(|e| broker("follow trigger task records")(e.into()))?;
        // State written by others (a manual run on another server) is taken in at once.
        let state_watch = super::feed::states(&self.ctx.js).await?;
        tokio::pin!(state_watch);
        let mut renew = tokio::time::interval(self.lease_ttl / 3);
        // Fires run as tasks so the timer loop never waits on the broker; a trigger is not
        // planned again while its fire is in flight (the book remembers it was due).
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<(String, Outcome)>();
        // Dropped when leading stops: fires still in flight are aborted, as a crash would,
        // instead of landing under whoever leads next.
        let mut firing = tokio::task::JoinSet::new();
        let mut term = Term {
            engine: self,
            store,
            token: lease.token().unwrap_or_default(),
            book: Book::holding(self.hold),
            fire_slots: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_FIRES)),
            done: done_tx,
            shown: None,
        };
        loop {
            term.show_held();
            let next_wake = term.book.next_wake();
            let sleep = next_wake.map_or(Duration::from_secs(3600), |at| {
                Duration::from_millis(at.saturating_sub(self.clock.now_ms()))
            });
            let mut due: Vec<String> = Vec::new();
            let stop = tokio::select! {
                _ = shutdown.cancelled() => Some(Stop::Shutdown),
                _ = renew.tick() => (!lease.hold().await).then_some(Stop::StepDown("lease lost")),
                write = watch.next() => match write {
                    None => Some(Stop::StepDown("definition feed ended")),
                    Some(write) => term.definition(write?, &mut due).await?,
                },
                write = state_watch.next() => match write {
                    None => Some(Stop::StepDown("state feed ended")),
                    Some(write) => term.state(write?, &mut due).await,
                },
                entry = completions.next() => match entry {
                    None => Some(Stop::StepDown("task record watch ended")),
                    Some(entry) => {
                        let entry = entry.map_err(|e| broker("follow trigger task records")(e.into()))?;
                        term.completion(&entry, &mut due);
                        None
                    }
                },
                Some((name, outcome)) = done_rx.recv() => term.fire_done(name, outcome, &mut due),
                // Reap finished fire tasks (their outcomes come through `done_rx`).
                Some(_) = firing.join_next(), if !firing.is_empty() => None,
                _ = tokio::time::sleep(sleep), if next_wake.is_some() => {
                    term.book.take_woken(self.clock.now_ms(), &mut due);
                    None
                }
            };
            if let Some(stop) = stop {
                return Ok(stop);
            }
            if !lease.valid() {
                return Ok(Stop::StepDown("lease not renewed within its TTL"));
            }
            // Plan each due trigger, then fire and store them concurrently.
            let mut jobs = Vec::new();
            for name in term.book.plannable(due) {
                if let Some(stop) = term.plan(name, &mut jobs).await {
                    return Ok(stop);
                }
            }
            term.start(jobs, &mut firing);
        }
    }
}

/// One term as leader: what the leader holds and does between events. Each event's
/// handler says whether leading must stop; the book (`book.rs`) decides, pure.
struct Term<'a> {
    engine: &'a Engine,
    store: &'a TriggerStore,
    /// The lease's revision: state written by a newer leader carries a greater one.
    token: u64,
    book: Book,
    fire_slots: Arc<tokio::sync::Semaphore>,
    done: tokio::sync::mpsc::UnboundedSender<(String, Outcome)>,
    /// The counts `ax_triggers_held` last showed: set again only when they change.
    shown: Option<(usize, usize)>,
}

const NEWER_LEADER: Stop = Stop::StepDown("a newer leader wrote trigger state");

impl Term<'_> {
    fn show_held(&mut self) {
        let counts = (self.book.held.len(), self.book.dormant.len());
        if self.shown != Some(counts) {
            self.shown = Some(counts);
            metrics::gauge!(ax_core::metrics::TRIGGERS_HELD, "how" => "whole").set(counts.0 as f64);
            metrics::gauge!(ax_core::metrics::TRIGGERS_HELD, "how" => "resting")
                .set(counts.1 as f64);
        }
    }

    /// A definition was written or deleted.
    async fn definition(
        &mut self,
        write: super::feed::KvWrite,
        due: &mut Vec<String>,
    ) -> Result<Option<Stop>, EngineError> {
        let super::feed::KvWrite { name, value, .. } = write;
        let Some(value) = value else {
            self.book.held.remove(&name);
            self.book.dormant.remove(&name);
            return Ok(None);
        };
        let Ok(def) = serde_json::from_slice::<TriggerDef>(&value) else {
            warn!(trigger = %name, "stored definition does not decode; ignored");
            return Ok(None);
        };
        let Ok(rec) = def.validate() else {
            warn!(trigger = %name, "stored definition is invalid; ignored");
            return Ok(None);
        };
        let h = self.engine.load(self.store, def, rec).await?;
        if h.state.leader > self.token {
            return Ok(Some(NEWER_LEADER));
        }
        self.book.dormant.remove(&name);
        self.book.held.insert(name.clone(), h);
        due.push(name);
        Ok(None)
    }

    /// A trigger's state was written (by anyone: our own writes are skipped while in flight).
    async fn state(&mut self, write: super::feed::KvWrite, due: &mut Vec<String>) -> Option<Stop> {
        let super::feed::KvWrite {
            name,
            value,
            revision,
        } = write;
        let value = value.filter(|_| !self.book.in_flight(&name))?;
        let Some(h) = self.book.held.get_mut(&name) else {
            // Changed while held as its name alone: read back and planned.
            if self.book.dormant.contains_key(&name) {
                due.push(name);
            }
            return None;
        };
        if revision <= h.revision {
            return None;
        }
        let state = serde_json::from_slice::<TriggerState>(&value).ok()?;
        if state.leader > self.token {
            return Some(NEWER_LEADER);
        }
        self.engine.take_state(h, state, revision).await;
        due.push(name);
        None
    }

    /// A trigger task's record was written.
    fn completion(&mut self, entry: &kv::Entry, due: &mut Vec<String>) {
        let Some(name) = trigger_of_task(&entry.key) else {
            return;
        };
        if entry.operation != kv::Operation::Put {
            return;
        }
        let Ok(rec) = serde_json::from_slice::<TaskRecord>(&entry.value) else {
            return;
        };
        match self
            .book
            .task_record(name, &entry.key, &rec, self.engine.clock.now_ms())
        {
            Seen::Nothing => {}
            Seen::Due(name) => due.push(name),
            Seen::Adopted(name, scheduled) => warn!(trigger = %name, scheduled,
                "a previous leader's fire landed after this leader had handled its time; recorded it as fired"),
        }
    }

    /// A fire job ended.
    fn fire_done(&mut self, name: String, outcome: Outcome, due: &mut Vec<String>) -> Option<Stop> {
        let now = self.engine.clock.now_ms();
        let free = self.fire_slots.available_permits();
        match self.book.fire_done(name, outcome, self.token, now, free) {
            Ok(mut again) => {
                due.append(&mut again);
                None
            }
            Err(why) => Some(Stop::StepDown(why)),
        }
    }

    /// Plans due trigger `name`: a job for `jobs` if it fires (or must store its state),
    /// else it rests or waits for its next wake.
    async fn plan(&mut self, name: String, jobs: &mut Vec<Job>) -> Option<Stop> {
        let (engine, token) = (self.engine, self.token);
        if !self.book.held.contains_key(&name) && self.book.dormant.contains_key(&name) {
            match engine.read_back(self.store, &name).await {
                Ok(Some(h)) if h.state.leader > token => return Some(NEWER_LEADER),
                Ok(Some(h)) => {
                    self.book.dormant.remove(&name);
                    self.book.held.insert(name.clone(), h);
                }
                Ok(None) => {
                    self.book.dormant.remove(&name);
                    return None;
                }
                Err(e) => {
                    warn!(trigger = %name, cause = %e, "trigger not read back; trying again in 1 s");
                    self.book.wake(engine.clock.now_ms() + RETRY_MS, name);
                    return None;
                }
            }
        }
        let h = self.book.held.get_mut(&name)?;
        if h.unsure || h.unstored {
            match engine.record_unrecorded(self.store, h, token).await {
                Recorded::Yes => {}
                Recorded::Later => {
                    // The broker did not let it finish: fire nothing yet, look again.
                    self.book.wake(engine.clock.now_ms() + RETRY_MS, name);
                    return None;
                }
                Recorded::StepDown => return Some(NEWER_LEADER),
            }
        }
        if h.waits_on_tasks() && h.checked_at.is_none_or(|at| at.elapsed() >= RECHECK) {
            // Recover completions no feed delivered (belt and braces).
            h.active = unfinished(&engine.ctx, h.active.iter()).await;
            h.checked_at = Some(Instant::now());
            engine.settle(h);
        }
        let now = engine.clock.now_ms();
        let p = plan(&h.def, &h.rec, &h.state, now, !h.active.is_empty());
        if !p.fires.is_empty() || p.state != h.state {
            h.planning(&p.fires);
            let active = h.active.iter().cloned().collect();
            jobs.push(Job::of(name, h, p, active, token, now));
            return None;
        }
        let mut wake = p.next_wake_ms;
        if h.waits_on_tasks() {
            // Look at the records again in a while, whatever the feed says.
            let again = now + RECHECK.as_millis() as u64;
            wake = Some(wake.map_or(again, |w| w.min(again)));
        }
        match self.book.rest(&name, wake, now) {
            Rest::Rested => {}
            // Its last fire's end goes to the store (a plan that fires nothing), then it
            // rests.
            Rest::StoreFirst => {
                let h = &self.book.held[&name];
                jobs.push(Job::of(name, h, p, Vec::new(), token, now));
            }
            Rest::Kept => {
                if let Some(wake) = wake {
                    self.book.wake(wake, name);
                }
            }
        }
        None
    }

    /// Starts the planned jobs, each in `firing` while a fire slot is free.
    fn start(&mut self, jobs: Vec<Job>, firing: &mut tokio::task::JoinSet<()>) {
        for job in jobs {
            let Ok(permit) = self.fire_slots.clone().try_acquire_owned() else {
                // All fire slots busy: plan it again when one frees up.
                self.book.fire_starved(job.name);
                continue;
            };
            self.book.fire_started(&job.name);
            let (ctx, store) = (self.engine.ctx.clone(), self.store.clone());
            let ops = self.engine.ops.clone();
            let done = self.done.clone();
            firing.spawn(async move {
                let name = job.name.clone();
                // A panic (a bug) still reports: the fire may have been made, so the
                // trigger's fires are recovered before it is planned again.
                let outcome = AssertUnwindSafe(execute(&ctx, &ops, &store, job))
                    .catch_unwind()
                    .await
                    .unwrap_or_else(|_| {
                        error!(trigger = %name, "fire job panicked (a bug); its fires are recovered before the next");
                        Outcome::Unrecorded { made: Vec::new() }
                    });
                drop(permit);
                let _ = done.send((name, outcome));
            });
        }
    }
}

/// A planned trigger to fire and store.
struct Job {
    name: String,
    def: TriggerDef,
    plan: Plan,
    /// The state the plan was made from: the one stored at `revision`, with what is not
    /// written yet of its last fire's end.
    stored: TriggerState,
    revision: u64,
    /// Its unfinished task ids when planned.
    active: Vec<String>,
    token: u64,
    now: u64,
}

impl Job {
    fn of(name: String, h: &Held, plan: Plan, active: Vec<String>, token: u64, now: u64) -> Job {
        Job {
            name,
            def: h.def.clone(),
            plan,
            stored: h.state.clone(),
            revision: h.revision,
            active,
            token,
            now,
        }
    }
}

/// Makes a trigger's stored state this leader's (`token`) before its first fire of the
/// term, written as it was read (`state`, not the plan's, which counts times handled that
/// are not fired yet): the compare-and-set against the revision the plan was made from fences off a
/// previous leader's fire job still running (a leader stalled past its lease, its jobs
/// alive): its state write, against the same revision, now fails and it steps down. Without
/// it, that write could land first and this job would merge its fire into a state that
/// already counts it (the R3 campaign seed 4955772603497125947, 2026-12-06: four triggers
/// each counting one fire twice after a broker restart). Answers the new revision, or the
/// outcome the job ends with: the state as stored now to plan from again, a newer leader,
/// or unknown (broker errors).
async fn claim(
    store: &TriggerStore,
    name: &str,
    state: &TriggerState,
    revision: u64,
    token: u64,
) -> Result<u64, Outcome> {
    let mut claimed = state.clone();
    claimed.leader = token;
    let cause = match store.put_state(name, &claimed, Some(revision)).await {
        Ok(revision) => return Ok(revision),
        Err(TriggerStoreError::Stale(_)) => match store.state(name).await {
            Ok(Some((current, _))) if current.leader > token => return Err(Outcome::StepDown),
            Ok(Some((current, rev))) => return Err(Outcome::Reload(current, rev)),
            Ok(None) => return Err(Outcome::Unrecorded { made: Vec::new() }),
            Err(e) => e,
        },
        Err(e) => e,
    };
    warn!(trigger = %name, cause = %cause, "trigger state not claimed; nothing is fired until it is");
    Err(Outcome::Unrecorded { made: Vec::new() })
}

/// Fires a planned trigger and stores its new state.
async fn execute(
    ctx: &Context,
    ops: &crate::ops::actions::Ops,
    store: &TriggerStore,
    job: Job,
) -> Outcome {
    let Job {
        name,
        def,
        plan,
        stored,
        revision,
        active,
        token,
        now,
    } = job;
    let mut revision = revision;
    if !plan.fires.is_empty() && plan.state.leader != token {
        // The first fire of this term: the state is made ours before anything is fired.
        match claim(store, &name, &stored, revision, token).await {
            Ok(claimed) => revision = claimed,
            Err(outcome) => return outcome,
        }
    }
    if !plan.fires.is_empty() && ctx.faults.fire_panics(&name) {
        panic!("injected fault: a fire job of trigger {name} panicked");
    }
    if plan.cancel_active {
        // Overlap `cancel_in_progress`: the previous fire's tasks go first.
        overlap::cancel_previous(ops, &name, &active).await;
    }
    let mut ids = Vec::new();
    let mut made = Vec::new();
    for &scheduled in &plan.fires {
        let tag = scheduled_tag(scheduled);
        let until = tokio::time::Instant::now() + FIRE_RETRY_FOR;
        loop {
            match fire(ctx, &def, scheduled, Source::Schedule, &tag, None).await {
                Ok(mut fired) => {
                    ids.append(&mut fired);
                    made.push(scheduled);
                    break;
                }
                // Its publish may be stored though unanswered: the same fire again is a
                // no-op if so (message id, create-if-absent record), and a plan made
                // instead could count the time skipped while its task runs.
                Err(e)
                    if e.code == ax_core::protocol::ErrorCode::Unavailable
                        && tokio::time::Instant::now() < until =>
                {
                    warn!(trigger = %name, scheduled, cause = %e, "fire not accepted; firing the same time again in 1 s");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => {
                    // Busy (nothing stored), or unavailable for too long: keep the state as
                    // it was; the trigger is looked at again (its fires repaired) shortly.
                    warn!(trigger = %name, cause = %e, "fire not accepted; retrying in 1 s");
                    return Outcome::Unrecorded { made };
                }
            }
        }
    }
    if !plan.fires.is_empty() {
        ctx.faults.pass(ax_core::faults::Abort::AfterFire);
    }
    let mut state = plan.state.clone();
    state.leader = token;
    state.active = if ids.is_empty() || tracks_every_fire(&def) {
        active
    } else {
        Vec::new()
    };
    state.record_fire(&plan.fires, now, Source::Schedule, &ids);
    if !plan.fires.is_empty() {
        debug!(trigger = %name, scheduled = ?plan.fires.last(), tasks = ids.len(), "fired");
    }
    // What this job changed is measured from the state its plan was made from (the plan's
    // skips included).
    let base = stored;
    for _ in 0..MERGE_ATTEMPTS {
        match store.put_state(&name, &state, Some(revision)).await {
            Ok(revision) => {
                return Outcome::Stored {
                    state,
                    revision,
                    ids,
                    next_wake_ms: plan.next_wake_ms,
                }
            }
            Err(TriggerStoreError::Stale(_)) => {}
            Err(e) => {
                warn!(trigger = %name, cause = %e, fired = plan.fires.len(),
                    "trigger state not written; nothing more is fired until it is");
                return Outcome::Unrecorded { made };
            }
        }
        // Changed elsewhere (a manual run, or a newer leader).
        let (current, rev) = match store.state(&name).await {
            Ok(Some(found)) => found,
            Ok(None) => return Outcome::Unrecorded { made }, // deleted meanwhile
            Err(e) => {
                warn!(trigger = %name, cause = %e, "trigger state not read; nothing more is fired until it is");
                return Outcome::Unrecorded { made };
            }
        };
        if current.leader > token {
            return Outcome::StepDown;
        }
        if current.leader != token && !plan.fires.is_empty() {
            // An older leader's write (claimed states refuse those, so this is a state
            // never claimed): it may hold our fires already. Merging would count them
            // twice; the repair reads what it has and records only what it lacks.
            warn!(trigger = %name, "trigger state written by an older leader meanwhile; recording this fire from what is stored");
            return Outcome::Unrecorded { made };
        }
        if plan.fires.is_empty() {
            // Nothing fired: plan again from what is stored.
            return Outcome::Reload(current, rev);
        }
        // Something fired: record it into the current state, never re-plan it.
        state = merge_fire(&base, &state, current, token);
        revision = rev;
    }
    warn!(trigger = %name, "trigger state kept changing; fire made but not recorded yet");
    Outcome::Unrecorded { made }
}
