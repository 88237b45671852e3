//! The flow engine inside `ax server`: one leader (lease `flows` in `AX_LEASES`) drives
//! every running run; the other servers stand by and take over within the lease TTL.
//!
//! The leader follows two KV feeds, both ordered consumers (no message dropped, whatever
//! the load): the run keys of `AX_FLOW_RUNS` (with history, so a new leader finds every
//! running run) and the records of step tasks (`$KV.AX_TASKS.*.fl.>`, from now on).
//!
//! A running run is a small struct in a map ([`super::actor::Run`]: its steps' states and
//! a tally of their tasks' ends), not a task of its own. The feeds' events are applied to
//! it in place; when there is something to do (load it, a step whose tasks have all
//! ended, a newer run key, step tasks to submit again), it gets a *turn*: a spawned task
//! that owns the run while it reads, advances, writes and submits, then hands it back.
//! At most [`MAX_TURNS`] turns run at once; events for a run in a turn wait beside it.
//! Task completions before a run was loaded are in the records its load reads, so nothing
//! is missed between a leader's start and a run's load.

use super::actor::{Event, Outcome, Run};
use super::model::{parse_step_task, RunState};
use super::shared::*;
use super::store::{FlowStore, FlowStoreError};
use crate::context::Context;
use crate::lease::{run_as_leader, Leader, Lease, Stop};
use async_nats::jetstream::kv;
use ax_core::metrics as m;
use ax_core::names::LEASES_BUCKET;
use ax_core::results::ResultStore;
use ax_core::state::TaskRecord;
use futures::StreamExt;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

/// The key of the flow engine's lease in `AX_LEASES`.
pub(crate) const FLOWS_KEY: &str = "flows";

/// Most run turns (load, advance, writes, submits) in flight at once; more runs wait for
/// one in a queue, as a few bytes each.
const MAX_TURNS: usize = 256;
/// Most bytes of step outputs and run inputs the leader holds for steps not started yet,
/// across runs (like the delayed index's `--max-held-bytes`). Beyond it they are read back
/// from the task records and run keys when a step starts.
const HELD_BYTES: usize = 64 << 20;

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
    pub(crate) ctx: Arc<Context>,
    pub(crate) lease_ttl: Duration,
    pub(crate) id: String,
    pub(crate) alerts: Option<crate::ops::alerts::Alerts>,
}

/// A running run in the leader's map: 24 bytes beside its id.
enum Slot {
    /// Between turns.
    Idle(Box<Run>),
    /// A turn has it; the events that came meanwhile.
    InTurn(Vec<Event>),
}

type TurnEnd = (Arc<str>, Box<Run>, Outcome);

/// The runs the leader drives, their turns and timers.
struct Runs {
    shared: Arc<Shared>,
    slots: HashMap<Arc<str>, Slot>,
    queue: VecDeque<Arc<str>>,
    timers: BTreeSet<(Instant, Arc<str>)>,
    turns: JoinSet<TurnEnd>,
    in_turn: HashMap<tokio::task::Id, Arc<str>>,
}

impl Runs {
    fn new(shared: Arc<Shared>) -> Runs {
        Runs {
            shared,
            slots: HashMap::new(),
            queue: VecDeque::new(),
            timers: BTreeSet::new(),
            turns: JoinSet::new(),
            in_turn: HashMap::new(),
        }
    }

    /// A write of run key `id` (the run now `state`) at `revision`.
    fn on_run(&mut self, id: &str, state: RunState, revision: u64) {
        if self.deliver(id, Event::Run(revision)) || state != RunState::Running {
            return;
        }
        let id: Arc<str> = id.into();
        let mut run = Run::new(id.clone());
        run.apply(Event::Run(revision), &self.shared.held);
        self.slots.insert(id.clone(), Slot::Idle(run));
        self.schedule(&id);
    }

    /// Applies `event` to run `id` (or keeps it for after its turn); false if the run is
    /// not driven here.
    fn deliver(&mut self, id: &str, event: Event) -> bool {
        let Some(slot) = self.slots.get_mut(id) else {
            return false;
        };
        match slot {
            Slot::Idle(run) => {
                run.apply(event, &self.shared.held);
                if run.wants_turn() && run.sched.failures == 0 && !run.sched.queued {
                    run.sched.queued = true;
                    let key = self.slots.get_key_value(id).expect("slot").0.clone();
                    self.queue.push_back(key);
                }
            }
            Slot::InTurn(pending) => pending.push(event),
        }
        true
    }

    /// Queues run `id` for a turn (if it is between turns and not queued yet).
    fn schedule(&mut self, id: &Arc<str>) {
        if let Some(Slot::Idle(run)) = self.slots.get_mut(id) {
            if !run.sched.queued {
                run.sched.queued = true;
                self.queue.push_back(id.clone());
            }
        }
    }

    /// Starts turns for queued runs while there is room.
    fn start_turns(&mut self) {
        while self.turns.len() < MAX_TURNS {
            let Some(id) = self.queue.pop_front() else {
                return;
            };
            let Some(slot) = self.slots.get_mut(&id) else {
                continue;
            };
            let Slot::Idle(_) = slot else { continue };
            let Slot::Idle(mut run) = std::mem::replace(slot, Slot::InTurn(Vec::new())) else {
                unreachable!("matched above");
            };
            run.sched.queued = false;
            let shared = self.shared.clone();
            let key = id.clone();
            let handle = self.turns.spawn(async move {
                let outcome = run.turn(&shared).await;
                (key, run, outcome)
            });
            self.in_turn.insert(handle.id(), id);
        }
    }

    /// A turn ended (or panicked).
    fn turn_ended(&mut self, ended: Result<(tokio::task::Id, TurnEnd), tokio::task::JoinError>) {
        let (id, mut run, outcome) = match ended {
            Ok((task, (id, run, outcome))) => {
                self.in_turn.remove(&task);
                (id, run, outcome)
            }
            Err(e) => {
                let Some(id) = self.in_turn.remove(&e.id()) else {
                    return;
                };
                error!(run = %id, cause = %e, "flow run: its turn panicked (a bug); reading it again");
                (id.clone(), Run::new(id), Outcome::Failed)
            }
        };
        let Some(slot) = self.slots.get_mut(&id) else {
            return;
        };
        if let Slot::InTurn(pending) = slot {
            for event in pending.drain(..) {
                run.apply(event, &self.shared.held);
            }
        }
        let reloading = run.reloading();
        let sched = &mut run.sched;
        sched.wake = match outcome {
            Outcome::Done if !reloading => {
                self.slots.remove(&id);
                return;
            }
            Outcome::Done => None,
            Outcome::Idle => {
                sched.failures = 0;
                None
            }
            Outcome::Retry(after) => {
                sched.failures = 0;
                Some(Instant::now() + after)
            }
            Outcome::Failed => {
                sched.failures += 1;
                let pause = ax_core::retry::pause((sched.failures - 1).min(6));
                Some(Instant::now() + pause)
            }
        };
        if let (Outcome::Done, true) = (&outcome, reloading) {
            // A re-run (or another write) came after the final state: drive it again (from
            // a read no older than that write).
            run = run.afresh();
        }
        if let Some(at) = run.sched.wake {
            self.timers.insert((at, id.clone()));
        }
        let wanted = run.sched.failures == 0 && run.wants_turn();
        *slot = Slot::Idle(run);
        if wanted {
            self.schedule(&id);
        }
    }

    fn next_wake(&self) -> Option<Instant> {
        self.timers.first().map(|(at, _)| *at)
    }

    /// Schedules the runs whose timer is due.
    fn wake_due(&mut self) {
        let now = Instant::now();
        while let Some((at, id)) = self.timers.first().cloned() {
            if at > now {
                return;
            }
            self.timers.pop_first();
            if let Some(Slot::Idle(run)) = self.slots.get_mut(&id) {
                if run.sched.wake == Some(at) {
                    run.sched.wake = None;
                    self.schedule(&id);
                }
            }
        }
    }
}

/// What the leader reads of a run key's value: the rest (the definition, the input) is
/// read when the run loads.
#[derive(serde::Deserialize)]
struct RunBrief {
    id: String,
    state: RunState,
}

/// The engine's term as leader, for [`run_as_leader`].
struct Leading<'a> {
    engine: &'a FlowEngine,
    store: &'a FlowStore,
    results: &'a ResultStore,
}

impl Leader for Leading<'_> {
    type Error = FlowEngineError;

    async fn lead(
        &self,
        lease: &mut Lease,
        shutdown: &CancellationToken,
    ) -> Result<Stop, FlowEngineError> {
        self.engine
            .lead(self.store, self.results, lease, shutdown)
            .await
    }
}

impl FlowEngine {
    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), FlowEngineError> {
        let js = self.ctx.js.clone();
        let opened = ax_core::retry::until_ok(
            "the flow buckets (AX_FLOWS, AX_FLOW_RUNS; `ax streams apply`)",
            &shutdown,
            || async {
                let store = FlowStore::open(&js).await?;
                let results = ResultStore::open(&js).await?;
                let kv = js.get_key_value(LEASES_BUCKET).await?;
                Ok::<_, async_nats::Error>((store, results, kv))
            },
        )
        .await;
        let Some((store, results, kv)) = opened else {
            return Ok(()); // shut down while waiting
        };
        let lease = Lease::new(js.client(), kv, FLOWS_KEY, self.id.clone(), self.lease_ttl);
        let leading = Leading {
            engine: &self,
            store: &store,
            results: &results,
        };
        run_as_leader("flow engine", &leading, lease, &shutdown, || {
            metrics::gauge!(m::FLOW_RUNS_ACTIVE).set(0.0)
        })
        .await;
        Ok(())
    }

    async fn lead(
        &self,
        store: &FlowStore,
        results: &ResultStore,
        lease: &mut Lease,
        shutdown: &CancellationToken,
    ) -> Result<Stop, FlowEngineError> {
        // Task records first: a completion after this point reaches a run either by the
        // feed or by the records the run reads when it loads.
        let mut tasks = self
            .ctx
            .tasks
            .watch_flow_tasks()
            .await
            .map_err(|e| broker("follow step task records")(e.into()))?;
        let mut feed = store.watch_runs().await?;
        let shared = Arc::new(Shared {
            ctx: self.ctx.clone(),
            store: store.clone(),
            results: results.clone(),
            alerts: self.alerts.clone(),
            shapes: Shapes::default(),
            held: Budget::new(HELD_BYTES),
            retries: SubmitRetries::default(),
        });
        // Dropped on return: the turns in flight are aborted with it.
        let mut runs = Runs::new(shared.clone());
        let mut renew = tokio::time::interval(self.lease_ttl / 3);
        let mut summary = tokio::time::interval(Duration::from_secs(2));
        loop {
            runs.start_turns();
            let wake = runs.next_wake();
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(Stop::Shutdown),
                _ = renew.tick() => {
                    if !lease.hold().await {
                        return Ok(Stop::StepDown("lease lost"));
                    }
                }
                _ = summary.tick() => shared.retries.flush(),
                entry = feed.next() => {
                    let Some(entry) = entry else { return Ok(Stop::StepDown("run watch ended")) };
                    let entry = entry.map_err(|e| broker("watch runs")(e.into()))?;
                    if entry.operation != kv::Operation::Put {
                        continue;
                    }
                    let Ok(run) = serde_json::from_slice::<RunBrief>(&entry.value) else {
                        warn!(run = %entry.key, "stored run does not decode; ignored");
                        continue;
                    };
                    runs.on_run(&run.id, run.state, entry.revision);
                }
                entry = tasks.next() => {
                    let Some(entry) = entry else { return Ok(Stop::StepDown("task record watch ended")) };
                    let entry = entry.map_err(|e| broker("follow step task records")(e.into()))?;
                    if entry.operation != kv::Operation::Put {
                        continue;
                    }
                    let Some(task) = parse_step_task(&entry.key) else { continue };
                    if !runs.slots.contains_key(task.run) {
                        continue;
                    }
                    let Ok(rec) = serde_json::from_slice::<TaskRecord>(&entry.value) else { continue };
                    runs.deliver(task.run, Event::Task {
                        step: task.step.to_string(),
                        epoch: task.epoch,
                        item: task.item,
                        rec: Box::new(rec),
                    });
                }
                Some(ended) = runs.turns.join_next_with_id(), if !runs.turns.is_empty() => {
                    runs.turn_ended(ended);
                }
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {
                    runs.wake_due();
                }
            }
            metrics::gauge!(m::FLOW_RUNS_ACTIVE).set(runs.slots.len() as f64);
            if !lease.valid() {
                return Ok(Stop::StepDown("lease not renewed within its TTL"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes this thread has allocated and not freed (the lib's tests count allocations
    /// per thread; see `counting`).
    fn allocated() -> isize {
        counting::NET.with(std::cell::Cell::get)
    }

    #[test]
    fn a_waiting_diamond_run_holds_less_than_a_kibibyte() {
        let limits = ax_core::task::Limits::default();
        let def = crate::flow::actor::tests::diamond("diamond");
        let shapes = Shapes::default();
        let budget = Budget::new(HELD_BYTES);
        let _first = shapes.get("diamond", def.clone(), &limits).expect("valid");
        let runs = 20_000;
        let before = allocated();
        let mut slots: HashMap<Arc<str>, Slot> = HashMap::new();
        for k in 0..runs {
            // What a load leaves: each run key's copy of the definition is decoded and
            // dropped for the shared shape; step a runs, its task refused for now.
            let id: Arc<str> = format!("{k:0>22}").into();
            let mut run = Run::new(id.clone());
            let shape = shapes.get("diamond", def.clone(), &limits).expect("valid");
            let input = serde_json::to_vec(&serde_json::json!({ "i": k })).unwrap();
            run.install(&budget, shape, false, input, vec![None; 4]);
            run.running_for_test(0, 1, true);
            slots.insert(id, Slot::Idle(run));
        }
        let per_run = (allocated() - before) / runs;
        println!(
            "sizes: slot {} bytes, run {}, step {}",
            std::mem::size_of::<Slot>(),
            std::mem::size_of::<Run>(),
            std::mem::size_of::<crate::flow::advance::Tracked>()
        );
        println!(
            "a waiting diamond run: {per_run} bytes (map entry, id, run, steps, input, retry)"
        );
        assert!(per_run < 1024, "{per_run} bytes per waiting run");
        assert_eq!(
            shapes.0.lock().unwrap()["diamond"].len(),
            1,
            "one shared shape"
        );
        drop(slots);
        assert_eq!(budget.used(), 0, "the inputs' bytes are given back");
    }

    #[test]
    fn a_budget_refuses_beyond_its_limit_and_frees_on_drop() {
        let budget = Budget::new(100);
        let mut a = budget.take(60).expect("fits");
        assert!(budget.take(50).is_none());
        assert!(a.grow(&budget, 40));
        assert!(!a.grow(&budget, 1));
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 0);
        assert!(budget.take(100).is_some());
    }
}

/// The lib's unit tests count each thread's allocations (for the memory bound above).
#[cfg(test)]
mod counting {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        pub(super) static NET: Cell<isize> = const { Cell::new(0) };
    }

    fn add(bytes: isize) {
        let _ = NET.try_with(|n| n.set(n.get() + bytes));
    }

    struct Counting;

    // SAFETY: every call is passed on to the system allocator unchanged.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            add(layout.size() as isize);
            System.alloc(layout)
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            add(-(layout.size() as isize));
            System.dealloc(ptr, layout)
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            add(layout.size() as isize);
            System.alloc_zeroed(layout)
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            add(new_size as isize - layout.size() as isize);
            System.realloc(ptr, layout, new_size)
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;
}
