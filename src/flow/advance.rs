//! The flow state machine as a pure function: given the steps' states and how the tasks of
//! running steps have ended, what changes? No broker, no clock (like `worker::claim`):
//! the engine applies the answer, and the same facts always give the same answer, so a
//! leader that re-reads a run after a crash takes the same decisions again.

use super::def::{FailurePolicy, FlowDef, TriggerRule};
use super::model::{RunState, StepRun, StepState};
use crate::state::ErrorInfo;

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
    let first_failed = steps.iter().position(|s| s.state == StepState::Failed);
    for &i in order {
        if steps[i].state != StepState::Waiting {
            continue;
        }
        let mine = &parents[i];
        let state = |p: &usize| steps[*p].state;
        let all_done = mine.iter().all(|p| state(p).is_terminal());
        let failed_parent = mine.iter().find(|p| state(p).is_failure());
        let all_ok = mine.iter().all(|p| state(p) == StepState::Succeeded);
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
                    let p = *mine
                        .iter()
                        .find(|p| state(p) != StepState::Succeeded)
                        .expect("not all succeeded");
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
        } else if let Some(f) = steps.iter().position(|s| s.state == StepState::Failed) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::def::Plan;
    use crate::task::Limits;
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
}
