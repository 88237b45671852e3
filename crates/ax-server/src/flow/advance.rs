//! The flow state machine as a pure function: given the steps' states and how the tasks of
//! running steps have ended, what changes? No broker, no clock (like `worker::claim`):
//! the engine applies the answer, and the same facts always give the same answer, so a
//! leader that re-reads a run after a crash takes the same decisions again.
//!
//! `Tracked` is what the engine holds of a step between completions: its record and a
//! tally of its tasks' ends, compactly (one bit per task, not the tasks' records).

use super::def::{FailurePolicy, FlowDef, OnFailure, TriggerRule};
use super::model::{RunState, StepRun, StepState};
use ax_core::state::{ErrorInfo, TaskState};

/// How the tasks of one running step have ended so far (the engine counts them from the
/// task records of the step's current epoch).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// Tasks of the step (known once it started).
    pub total: Option<u32>,
    /// Tasks that succeeded.
    pub succeeded: u32,
    /// Tasks that failed for good.
    pub failed: u32,
    /// Tasks cancelled before they started.
    pub cancelled: u32,
    /// The error of the first failed task (by item index).
    pub first_error: Option<ErrorInfo>,
    /// Most attempts of any finished task.
    pub attempts: u32,
}

impl Progress {
    fn finished(&self) -> bool {
        self.total
            .is_some_and(|t| self.succeeded + self.failed + self.cancelled >= t)
    }
}

/// What [`advance`] decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Advance {
    /// Steps whose record changed (write them).
    pub changed: Vec<usize>,
    /// Steps that start now: build their inputs and submit their tasks.
    pub start: Vec<usize>,
    /// Running steps whose tasks not started yet are to be cancelled.
    pub cancel_queued: Vec<usize>,
    /// The run's final state and reason, once every step has ended.
    pub end: Option<(RunState, String)>,
}

fn why(class: &str, message: String) -> Option<ErrorInfo> {
    Some(ErrorInfo {
        detail: None,
        class: class.to_string(),
        message,
    })
}

/// Moves the run on as far as the facts allow. `order` lists steps parents first.
pub fn advance(
    def: &FlowDef,
    parents: &[Vec<usize>],
    order: &[usize],
    cancel: bool,
    steps: &mut [StepRun],
    progress: &[Progress],
    now_ms: u64,
) -> Advance {
    let mut out = Advance::default();
    // Running steps whose tasks have all ended.
    for (i, step) in steps.iter_mut().enumerate() {
        let p = &progress[i];
        if step.state != StepState::Running || !p.finished() {
            continue;
        }
        step.state = if p.failed > 0 {
            step.error = p.first_error.clone();
            StepState::Failed
        } else if p.cancelled > 0 {
            step.error = why("cancelled", format!("{} task(s) cancelled", p.cancelled));
            StepState::Cancelled
        } else {
            step.error = None;
            StepState::Succeeded
        };
        step.attempts = Some(p.attempts);
        step.finished_at_ms = Some(now_ms);
        out.changed.push(i);
    }
    if cancel {
        for (i, step) in steps.iter_mut().enumerate() {
            if step.state.is_terminal() {
                continue;
            }
            if step.state == StepState::Running {
                out.cancel_queued.push(i);
            }
            step.state = StepState::Cancelled;
            step.error = why("cancelled", "the run was cancelled".into());
            step.finished_at_ms = Some(now_ms);
            out.changed.push(i);
        }
    }
    let fail_fast = def.failure == FailurePolicy::FailFast;
    // A failed `notify_only` step only alerts: for its children and the run it is done.
    let tolerated = |steps: &[StepRun], p: usize| {
        steps[p].state == StepState::Failed && def.steps[p].on_failure == OnFailure::NotifyOnly
    };
    let counts_failed =
        |steps: &[StepRun], p: usize| steps[p].state == StepState::Failed && !tolerated(steps, p);
    let first_failed = (0..steps.len()).find(|&p| counts_failed(steps, p));
    for &i in order {
        if steps[i].state != StepState::Waiting {
            continue;
        }
        let mine = &parents[i];
        let state = |p: &usize| steps[*p].state;
        let all_done = mine.iter().all(|p| state(p).is_terminal());
        let ok = |p: &usize| state(p) == StepState::Succeeded || tolerated(steps, *p);
        let failed_parent = mine
            .iter()
            .find(|p| state(p).is_failure() && !tolerated(steps, **p));
        let all_ok = mine.iter().all(ok);
        let parent_name = |p: usize| def.steps[p].name.clone();
        let (next, error) = match def.steps[i].trigger {
            TriggerRule::AllSuccess => {
                if let Some(&p) = failed_parent {
                    (
                        Some(StepState::UpstreamFailed),
                        why(
                            "upstream_failed",
                            format!("parent {:?} {}", parent_name(p), steps[p].state),
                        ),
                    )
                } else if let (true, Some(f)) = (fail_fast, first_failed) {
                    (
                        Some(StepState::Cancelled),
                        why(
                            "fail_fast",
                            format!("step {:?} failed and the flow fails fast", parent_name(f)),
                        ),
                    )
                } else if all_ok {
                    (Some(StepState::Running), None)
                } else if all_done {
                    let p = *mine.iter().find(|p| !ok(p)).expect("not all succeeded");
                    let next = if state(&p) == StepState::Cancelled {
                        StepState::Cancelled
                    } else {
                        StepState::Skipped
                    };
                    let message = format!("parent {:?} {}", parent_name(p), state(&p));
                    (Some(next), why("upstream_not_succeeded", message))
                } else {
                    (None, None)
                }
            }
            TriggerRule::AllDone => (all_done.then_some(StepState::Running), None),
            TriggerRule::OneFailed => {
                if failed_parent.is_some() {
                    (Some(StepState::Running), None)
                } else if all_done {
                    let message = "no parent failed (trigger one_failed)".to_string();
                    (Some(StepState::Skipped), why("skipped", message))
                } else {
                    (None, None)
                }
            }
        };
        let Some(next) = next else { continue };
        let step = &mut steps[i];
        step.state = next;
        step.error = error;
        if next == StepState::Running {
            step.items = None;
            step.started_at_ms = Some(now_ms);
            step.finished_at_ms = None;
            step.attempts = None;
            out.start.push(i);
        } else {
            step.finished_at_ms = Some(now_ms);
        }
        out.changed.push(i);
    }
    if let (true, Some(_)) = (fail_fast, first_failed) {
        for (i, step) in steps.iter().enumerate() {
            if step.state == StepState::Running
                && def.steps[i].trigger == TriggerRule::AllSuccess
                && !out.start.contains(&i)
            {
                out.cancel_queued.push(i);
            }
        }
    }
    if steps.iter().all(|s| s.state.is_terminal()) {
        out.end = Some(if cancel {
            (RunState::Cancelled, "cancelled on request".to_string())
        } else if let Some(f) = (0..steps.len()).find(|&p| counts_failed(steps, p)) {
            let error = steps[f]
                .error
                .as_ref()
                .map(|e| format!(": {}: {}", e.class, e.message))
                .unwrap_or_default();
            (
                RunState::Failed,
                format!("step {:?} failed{error}", def.steps[f].name),
            )
        } else {
            let skipped = steps.iter().filter(|s| s.state != StepState::Succeeded);
            match skipped.count() {
                0 => (RunState::Succeeded, "every step succeeded".to_string()),
                n => (
                    RunState::Succeeded,
                    format!("no step failed ({n} skipped or cancelled)"),
                ),
            }
        });
    }
    out
}

/// One step of a running run as the engine holds it between completions: the step's record
/// (a [`StepRun`], with its error boxed) and its revision, and a tally of how the tasks of
/// its current epoch have ended — counts, one bit per task (so a completion seen twice, in
/// the feed and in a record read, counts once), the first failure by item index. Task
/// records and outputs are not held: they stay in `AX_TASKS`.
#[derive(Debug, Default)]
pub(crate) struct Tracked {
    /// Step state.
    pub(crate) state: StepState,
    /// The start of its first task was seen (the step-latency metric is recorded once).
    pub(crate) observed: bool,
    /// Its queued tasks were cancelled (fail-fast or a run cancel); not done twice.
    pub(crate) queued_cancelled: bool,
    /// Epoch.
    pub(crate) epoch: u32,
    /// Tasks of this epoch, once started.
    pub(crate) items: Option<u32>,
    attempts: Option<u32>,
    /// 0 for none (times are ms since the epoch), as `rev`: 8 bytes each, not 16.
    started_at_ms: u64,
    finished_at_ms: u64,
    /// Why it failed, was skipped or cancelled.
    pub(crate) error: Option<Box<ErrorInfo>>,
    /// Revision of its record in `AX_FLOW_RUNS` (0: never written; revisions start at 1).
    rev: u64,
    /// Latest finish time of its tasks, ms (0: none yet).
    pub(crate) last_finish: u64,
    succeeded: u32,
    failed: u32,
    cancelled: u32,
    max_attempt: u32,
    first_failed: Option<Box<(u32, ErrorInfo)>>,
    done: Bits,
}

impl Tracked {
    /// A step as stored (`rec`) at revision `rev`, no task ends counted yet.
    pub(crate) fn new(rec: StepRun, rev: Option<u64>) -> Tracked {
        let mut step = Tracked {
            rev: rev.unwrap_or(0),
            observed: true,
            ..Tracked::default()
        };
        step.set_record(rec);
        step
    }

    /// The step's record.
    pub(crate) fn record(&self) -> StepRun {
        StepRun {
            state: self.state,
            epoch: self.epoch,
            items: self.items,
            started_at_ms: (self.started_at_ms > 0).then_some(self.started_at_ms),
            finished_at_ms: (self.finished_at_ms > 0).then_some(self.finished_at_ms),
            attempts: self.attempts,
            error: self.error.as_deref().cloned(),
        }
    }

    /// Takes the record's fields (after [`advance`] changed it); the tally stays.
    pub(crate) fn set_record(&mut self, rec: StepRun) {
        self.state = rec.state;
        self.epoch = rec.epoch;
        self.items = rec.items;
        self.started_at_ms = rec.started_at_ms.unwrap_or(0);
        self.finished_at_ms = rec.finished_at_ms.unwrap_or(0);
        self.attempts = rec.attempts;
        self.error = rec.error.map(Box::new);
    }

    /// Revision of its record (`None`: never written).
    pub(crate) fn rev(&self) -> Option<u64> {
        (self.rev > 0).then_some(self.rev)
    }

    /// Its record was written at `rev`.
    pub(crate) fn set_rev(&mut self, rev: u64) {
        self.rev = rev;
    }

    /// The tally as [`advance`] takes it.
    pub(crate) fn progress(&self) -> Progress {
        Progress {
            total: self.items,
            succeeded: self.succeeded,
            failed: self.failed,
            cancelled: self.cancelled,
            first_error: self.first_failed.as_ref().map(|f| f.1.clone()),
            attempts: self.max_attempt,
        }
    }

    /// The step has `n` tasks from now on (it started, or was read running): the tally
    /// starts again.
    pub(crate) fn start(&mut self, n: u32) {
        self.items = Some(n);
        self.succeeded = 0;
        self.failed = 0;
        self.cancelled = 0;
        self.max_attempt = 0;
        self.first_failed = None;
        self.done = Bits::new(n);
        self.last_finish = 0;
        self.observed = false;
        self.queued_cancelled = false;
    }

    /// True if task `item` has ended (as far as the tally knows).
    pub(crate) fn has_ended(&self, item: u32) -> bool {
        self.done.get(item)
    }

    /// Counts task `item` as ended in `state` (a terminal task state); false if it is not a
    /// task of this step or was counted already.
    pub(crate) fn end_task(
        &mut self,
        item: u32,
        state: TaskState,
        error: Option<&ErrorInfo>,
        attempt: u32,
        finished_at_ms: u64,
    ) -> bool {
        if item >= self.items.unwrap_or(0) || !self.done.set(item) {
            return false;
        }
        match state {
            TaskState::Succeeded => self.succeeded += 1,
            TaskState::Cancelled => self.cancelled += 1,
            _ => {
                self.failed += 1;
                if self.first_failed.as_ref().is_none_or(|f| item < f.0) {
                    let error = error.cloned().unwrap_or(ErrorInfo {
                        detail: None,
                        class: "dead".into(),
                        message: String::new(),
                    });
                    self.first_failed = Some(Box::new((item, error)));
                }
            }
        }
        self.max_attempt = self.max_attempt.max(attempt);
        self.last_finish = self.last_finish.max(finished_at_ms);
        true
    }

    /// Running, and every task of it has ended: [`advance`] has something to decide.
    pub(crate) fn all_ended(&self) -> bool {
        self.state == StepState::Running && self.progress_done()
    }

    fn progress_done(&self) -> bool {
        self.items
            .is_some_and(|n| self.succeeded + self.failed + self.cancelled >= n)
    }
}

/// One bit per task: inline up to 64 tasks, else one word per 64.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Bits {
    Small(u64),
    Large(Box<[u64]>),
}

impl Default for Bits {
    fn default() -> Bits {
        Bits::Small(0)
    }
}

impl Bits {
    fn new(n: u32) -> Bits {
        if n <= 64 {
            Bits::Small(0)
        } else {
            Bits::Large(vec![0; n.div_ceil(64) as usize].into_boxed_slice())
        }
    }

    fn word(&self, k: u32) -> Option<u64> {
        match self {
            Bits::Small(w) => (k < 64).then_some(*w),
            Bits::Large(words) => words.get((k / 64) as usize).copied(),
        }
    }

    fn get(&self, k: u32) -> bool {
        self.word(k).is_some_and(|w| w & (1 << (k % 64)) != 0)
    }

    /// Sets bit `k`; false if it was set already (or is out of range).
    fn set(&mut self, k: u32) -> bool {
        let word = match self {
            Bits::Small(w) if k < 64 => w,
            Bits::Small(_) => return false,
            Bits::Large(words) => match words.get_mut((k / 64) as usize) {
                Some(w) => w,
                None => return false,
            },
        };
        let bit = 1 << (k % 64);
        let new = *word & bit == 0;
        *word |= bit;
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::def::Plan;
    use ax_core::task::Limits;
    use serde_json::json;

    fn flow(failure: &str, steps: &[(&str, &[&str], &str)]) -> (FlowDef, Plan) {
        let steps: Vec<_> = steps
            .iter()
            .map(|(name, needs, rule)| {
                json!({"name": name, "needs": needs, "trigger": rule,
                       "task": {"name": name, "queue": "q"}})
            })
            .collect();
        let def = FlowDef::decode(json!({"name": "f", "failure": failure, "steps": steps}))
            .expect("decodes");
        let plan = def.validate(&Limits::default()).expect("valid");
        (def, plan)
    }

    struct Run {
        def: FlowDef,
        plan: Plan,
        steps: Vec<StepRun>,
        progress: Vec<Progress>,
        cancel: bool,
    }

    impl Run {
        fn new(failure: &str, steps: &[(&str, &[&str], &str)]) -> Run {
            let (def, plan) = flow(failure, steps);
            let n = def.steps.len();
            Run {
                def,
                plan,
                steps: vec![StepRun::default(); n],
                progress: vec![Progress::default(); n],
                cancel: false,
            }
        }

        fn step(&mut self) -> Advance {
            let out = advance(
                &self.def,
                &self.plan.parents,
                &self.plan.order,
                self.cancel,
                &mut self.steps,
                &self.progress,
                1,
            );
            for &i in &out.start {
                self.progress[i].total = Some(1);
            }
            out
        }

        fn finish(&mut self, i: usize, ok: bool) {
            let p = &mut self.progress[i];
            if ok {
                p.succeeded = 1;
            } else {
                p.failed = 1;
                p.first_error = why("boom", "x".into());
            }
        }

        fn states(&self) -> Vec<&'static str> {
            self.steps.iter().map(|s| s.state.as_str()).collect()
        }
    }

    const ALL: &str = "all_success";

    #[test]
    fn a_diamond_runs_parents_first_and_succeeds() {
        let mut r = Run::new(
            "fail_fast",
            &[
                ("a", &[], ALL),
                ("b", &["a"], ALL),
                ("c", &["a"], ALL),
                ("d", &["b", "c"], ALL),
            ],
        );
        assert_eq!(r.step().start, vec![0]);
        r.finish(0, true);
        let mut started = r.step().start;
        started.sort();
        assert_eq!(started, vec![1, 2]);
        r.finish(1, true);
        assert!(r.step().start.is_empty(), "d waits for c");
        r.finish(2, true);
        assert_eq!(r.step().start, vec![3]);
        r.finish(3, true);
        let out = r.step();
        assert_eq!(out.end.unwrap().0, RunState::Succeeded);
    }

    #[test]
    fn a_notify_only_failure_lets_its_children_run_and_the_run_succeed() {
        // a → b (notify_only) → c ; a → c.
        let mut r = Run::new(
            "fail_fast",
            &[("a", &[], ALL), ("b", &["a"], ALL), ("c", &["a", "b"], ALL)],
        );
        r.def.steps[1].on_failure = OnFailure::NotifyOnly;
        r.step();
        r.finish(0, true);
        assert_eq!(r.step().start, vec![1]);
        r.finish(1, false);
        let out = r.step();
        assert_eq!(out.start, vec![2], "the failure does not block its child");
        assert!(out.cancel_queued.is_empty(), "nor fail fast");
        r.finish(2, true);
        let (state, reason) = r.step().end.expect("ended");
        assert_eq!(
            (state, r.states()),
            (
                RunState::Succeeded,
                vec!["succeeded", "failed", "succeeded"]
            )
        );
        assert!(
            reason.contains("1 skipped or cancelled") || reason.contains("no step failed"),
            "{reason}"
        );
        // The same failure without the policy fails the run.
        let mut r = Run::new(
            "fail_fast",
            &[("a", &[], ALL), ("b", &["a"], ALL), ("c", &["a", "b"], ALL)],
        );
        r.step();
        r.finish(0, true);
        r.step();
        r.finish(1, false);
        assert_eq!(r.step().end.expect("ended").0, RunState::Failed);
    }

    #[test]
    fn fail_fast_stops_new_work_lets_cleanup_run_and_ends_failed() {
        // a → b → d ; c independent (running) ; e = one_failed cleanup after b.
        let mut r = Run::new(
            "fail_fast",
            &[
                ("a", &[], ALL),
                ("b", &["a"], ALL),
                ("c", &[], ALL),
                ("d", &["b"], ALL),
                ("e", &["b"], "one_failed"),
                ("f", &["c"], ALL),
            ],
        );
        let mut started = r.step().start;
        started.sort();
        assert_eq!(started, vec![0, 2]);
        r.finish(0, true);
        assert_eq!(r.step().start, vec![1]);
        r.finish(1, false);
        let out = r.step();
        assert_eq!(out.start, vec![4], "the cleanup step runs");
        assert_eq!(out.cancel_queued, vec![2], "c's queued tasks are cancelled");
        assert_eq!(
            r.states(),
            [
                "succeeded",
                "failed",
                "running",
                "upstream_failed",
                "running",
                "cancelled"
            ]
        );
        assert!(out.end.is_none(), "running steps finish first");
        r.finish(2, true);
        r.finish(4, true);
        let out = r.step();
        let (state, reason) = out.end.expect("ended");
        assert_eq!(state, RunState::Failed);
        assert!(reason.contains("step \"b\" failed: boom"), "{reason}");
    }

    #[test]
    fn continue_lets_independent_branches_run_and_all_done_sees_the_end() {
        let mut r = Run::new(
            "continue",
            &[
                ("a", &[], ALL),
                ("b", &[], ALL),
                ("c", &["a"], ALL),
                ("d", &["b"], ALL),
                ("e", &["c", "d"], "all_done"),
                ("g", &["a"], "one_failed"),
            ],
        );
        r.step();
        r.finish(0, false);
        let out = r.step();
        assert!(out.cancel_queued.is_empty());
        assert_eq!(out.start, vec![5]);
        r.finish(1, true);
        assert_eq!(r.step().start, vec![3], "the independent branch goes on");
        r.finish(3, true);
        r.finish(5, true);
        assert_eq!(
            r.step().start,
            vec![4],
            "all_done runs after an upstream failure"
        );
        r.finish(4, true);
        let (state, _) = r.step().end.expect("ended");
        assert_eq!(state, RunState::Failed);
        assert_eq!(r.states()[2], "upstream_failed");
    }

    #[test]
    fn one_failed_is_skipped_when_nothing_failed() {
        let mut r = Run::new("fail_fast", &[("a", &[], ALL), ("g", &["a"], "one_failed")]);
        r.step();
        r.finish(0, true);
        let out = r.step();
        assert_eq!(r.states(), ["succeeded", "skipped"]);
        assert_eq!(
            out.end,
            Some((
                RunState::Succeeded,
                "no step failed (1 skipped or cancelled)".into()
            ))
        );
    }

    #[test]
    fn cancel_ends_every_step_and_the_run_at_once() {
        let mut r = Run::new("fail_fast", &[("a", &[], ALL), ("b", &["a"], ALL)]);
        r.step();
        r.cancel = true;
        let out = r.step();
        assert_eq!(out.cancel_queued, vec![0]);
        assert_eq!(r.states(), ["cancelled", "cancelled"]);
        assert_eq!(out.end.unwrap().0, RunState::Cancelled);
    }

    #[test]
    fn an_empty_fan_out_succeeds_at_once() {
        let mut r = Run::new("fail_fast", &[("a", &[], ALL)]);
        r.step();
        r.progress[0].total = Some(0);
        r.step();
        assert_eq!(r.states(), ["succeeded"]);
    }

    fn error(class: &str) -> ErrorInfo {
        ErrorInfo {
            detail: None,
            class: class.into(),
            message: "m".into(),
        }
    }

    #[test]
    fn a_tracked_step_counts_each_task_once_and_keeps_the_first_failure_by_item() {
        let mut step = Tracked::new(StepRun::default(), None);
        step.state = StepState::Running;
        step.start(130);
        assert!(step.end_task(3, TaskState::Dead, Some(&error("late")), 2, 50));
        assert!(
            !step.end_task(3, TaskState::Succeeded, None, 1, 60),
            "counted once"
        );
        assert!(step.end_task(129, TaskState::Succeeded, None, 4, 40));
        assert!(
            !step.end_task(130, TaskState::Succeeded, None, 1, 40),
            "not an item"
        );
        assert!(step.end_task(1, TaskState::Dead, Some(&error("first")), 1, 45));
        assert!(step.end_task(2, TaskState::Cancelled, None, 0, 46));
        assert!(step.has_ended(129) && !step.has_ended(0));
        let p = step.progress();
        assert_eq!(
            (p.total, p.succeeded, p.failed, p.cancelled, p.attempts),
            (Some(130), 1, 2, 1, 4)
        );
        assert_eq!(p.first_error.unwrap().class, "first");
        assert_eq!(step.last_finish, 50);
        assert!(!step.all_ended());
        for k in 0..130 {
            step.end_task(k, TaskState::Succeeded, None, 1, 1);
        }
        assert!(step.all_ended());
        step.start(1);
        assert_eq!(step.progress().succeeded, 0, "a new epoch counts again");
        assert!(step.end_task(0, TaskState::Succeeded, None, 1, 1) && step.all_ended());
    }

    #[test]
    fn a_tracked_step_gives_back_its_record_and_stays_small() {
        let rec = StepRun {
            state: StepState::Failed,
            epoch: 2,
            items: Some(3),
            started_at_ms: Some(10),
            finished_at_ms: Some(20),
            attempts: Some(5),
            error: Some(error("boom")),
        };
        let step = Tracked::new(rec.clone(), Some(7));
        assert_eq!(step.record(), rec);
        assert_eq!(step.rev(), Some(7));
        let none = Tracked::new(StepRun::default(), None);
        assert_eq!((none.record(), none.rev()), (StepRun::default(), None));
        // What a waiting run costs per step: the record and tally, no outputs.
        let size = std::mem::size_of::<Tracked>();
        assert!(size <= 112, "Tracked is {size} bytes");
    }
}
