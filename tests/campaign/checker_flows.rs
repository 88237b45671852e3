//! Flow rules, over the runs' and steps' records in `AX_FLOW_RUNS`, the task
//! records and the journal (handler starts, which deterministic step task ids cannot hide):
//!
//! - **a run ends, in the state its policy says**: every run the campaign started ends;
//!   `fan` succeeds (unless its list fails at epoch 0 and no re-run of the failed step was
//!   acknowledged: then it fails), `chain` succeeds, `ff` and `cont` fail; each step ends as
//!   its rule and the failure policy say; a run whose cancel was acknowledged while it ran
//!   ends `cancelled`; `reruns` counts the acknowledged in-place re-runs; a fan-out has one
//!   item per element of its list;
//! - **each step task runs once per epoch**: a handler starts only for a step task of an
//!   epoch the run made (epoch ≤ the step's last ≤ the run's re-runs), of an item the step
//!   has, never for a step its policy ended without running (`upstream_failed`, `skipped`);
//! - **parents first**: a step task (rule `all_success`) starts only after every parent had
//!   all its tasks of one epoch succeed (a sleep step's wait task included: its child
//!   starts after it ended);
//! - **a sleep ends once, never early, never on a worker**: a sleep step's wait task
//!   (`ax.sleep`) reaches one final state once (`succeeded`, or `cancelled` by its run's
//!   cancel), `succeeded` no earlier than its due time, and no handler ever starts it.

use crate::checker::{wait_ends, Histories, Invocation};
use crate::flows::RunNote;
use ax_sdk::flow::model::parse_step_task;
use ax_sdk::flow::{FlowRun, RunState, StepRun, StepState, TriggerRule};
use ax_sdk::TaskState;
use std::collections::{BTreeMap, HashMap};

/// A run as the checker sees it: what the campaign asked of it, and its records.
pub struct RunSeen<'a> {
    pub note: Option<&'a RunNote>,
    pub run: Option<&'a (FlowRun, Vec<StepRun>)>,
}

/// The step states each flow's policy leads to (when not cancelled), by step.
fn expected_steps(flow: &str, succeeds: bool) -> Vec<(&'static str, &'static [StepState])> {
    use StepState::*;
    const OK: &[StepState] = &[Succeeded];
    match (flow, succeeds) {
        ("fan", true) => vec![("list", OK), ("item", OK), ("gather", OK)],
        ("fan", false) => vec![
            ("list", &[Failed]),
            ("item", &[UpstreamFailed]),
            ("gather", &[UpstreamFailed]),
        ],
        ("chain", _) => vec![("a", OK), ("nap", OK), ("b", OK), ("c", OK), ("d", OK)],
        ("nest", _) => vec![("list", OK), ("kids", OK), ("gather", OK)],
        ("paid", _) => vec![("a", OK), ("w", OK), ("b", OK)],
        ("gate", true) => vec![("a", OK), ("g", OK), ("b", OK)],
        ("gate", false) => vec![("a", OK), ("g", &[Failed]), ("b", &[UpstreamFailed])],
        // `side` ran beside the failure: finished first, or cancelled by fail_fast.
        ("ff", _) => vec![
            ("a", OK),
            ("boom", &[Failed]),
            ("after", &[UpstreamFailed]),
            ("cleanup", OK),
            ("side", &[Succeeded, Cancelled]),
        ],
        ("cont", _) => vec![
            ("a", OK),
            ("boom", &[Failed]),
            ("after", &[UpstreamFailed]),
            ("side", OK),
            ("fin", OK),
        ],
        _ => Vec::new(),
    }
}

/// The run state the campaign's requests and the flow's policy lead to; `None` when a
/// request went unanswered (its effect is unknown).
pub fn expected_state(note: &RunNote) -> Option<RunState> {
    if note.unanswered > 0 {
        return None;
    }
    if note.cancels.iter().any(|c| c.state == "running") {
        return Some(RunState::Cancelled);
    }
    if let Some(c) = note.cancels.first() {
        // Ended before the cancel: its own state, as answered.
        return serde_json::from_value(serde_json::json!(c.state)).ok();
    }
    Some(match note.flow.as_str() {
        "fan" => {
            let fails_first = note.input["fail_first"] == serde_json::json!(true);
            let rerun = note.reruns.iter().any(|r| r.mode != "whole");
            if fails_first && !rerun {
                RunState::Failed
            } else {
                RunState::Succeeded
            }
        }
        "chain" | "paid" | "nest" => RunState::Succeeded,
        "gate" if note.decided.iter().any(|(d, _)| d == "rejected") => RunState::Failed,
        "gate" => RunState::Succeeded,
        _ => RunState::Failed,
    })
}

/// What the campaign asked of a run and how its steps ended, for a violation's message.
fn story(note: &RunNote, run: &FlowRun, steps: &[StepRun]) -> String {
    let asked: Vec<String> = note
        .cancels
        .iter()
        .map(|c| format!("cancel answered {} at {}", c.state, c.ack_ms))
        .chain(
            note.reruns
                .iter()
                .map(|r| format!("re-run {} at {}", r.mode, r.ack_ms)),
        )
        .collect();
    let steps: Vec<String> = run
        .def
        .steps
        .iter()
        .zip(steps)
        .map(|(d, s)| {
            format!(
                "{} {}#{} {:?}..{:?}",
                d.name, s.state, s.epoch, s.started_at_ms, s.finished_at_ms
            )
        })
        .collect();
    format!(
        "input {}, asked {asked:?}, {} re-runs recorded, ended {:?} ({:?}); steps {steps:?}",
        note.input, run.reruns, run.finished_at_ms, run.reason
    )
}

/// Rule "a run ends, in the state its policy says".
pub fn check_ends(runs: &BTreeMap<String, RunSeen<'_>>) -> Vec<String> {
    let mut v = Vec::new();
    for (id, seen) in runs {
        let Some(note) = seen.note else { continue };
        let Some((run, steps)) = seen.run else {
            v.push(format!(
                "flow run {id} ({}): acknowledged but not stored",
                note.flow
            ));
            continue;
        };
        if run.state == RunState::Running {
            v.push(format!(
                "flow run {id} ({}): never ended (created at {}, last changed at {}): {}",
                note.flow,
                run.created_at_ms,
                run.updated_at_ms,
                story(note, run, steps)
            ));
            continue;
        }
        let Some(want) = expected_state(note) else {
            continue;
        };
        if run.state != want {
            v.push(format!(
                "flow run {id} ({}): ended {} where its policy says {want}: {}",
                note.flow,
                run.state,
                story(note, run, steps)
            ));
            continue;
        }
        let in_place = note.reruns.iter().filter(|r| r.mode != "whole").count() as u32;
        if run.reruns != in_place {
            v.push(format!(
                "flow run {id} ({}): {in_place} re-runs acknowledged: {}",
                note.flow,
                story(note, run, steps)
            ));
        }
        let names: Vec<&str> = run.def.steps.iter().map(|s| s.name.as_str()).collect();
        let state_of = |name: &str| names.iter().position(|n| *n == name).map(|i| &steps[i]);
        if want == RunState::Cancelled {
            for (name, step) in names.iter().zip(steps) {
                if !step.state.is_terminal() {
                    v.push(format!(
                        "flow run {id} ({}): cancelled with step {name} still {}: {}",
                        note.flow,
                        step.state,
                        story(note, run, steps)
                    ));
                }
            }
            continue;
        }
        for (name, allowed) in expected_steps(&note.flow, want == RunState::Succeeded) {
            match state_of(name) {
                Some(step) if allowed.contains(&step.state) => {}
                other => v.push(format!(
                    "flow run {id} ({} {}): step {name} ended {:?} where its policy says {allowed:?}: {}",
                    note.flow,
                    run.state,
                    other.map(|s| s.state),
                    story(note, run, steps)
                )),
            }
        }
        if note.flow == "fan" && want == RunState::Succeeded {
            let n = note.input["n"].as_u64().unwrap_or(0) as u32;
            if let Some(item) = state_of("item").filter(|s| s.items != Some(n)) {
                v.push(format!(
                    "flow run {id}: fan-out over {n} items made {:?}",
                    item.items
                ));
            }
        }
    }
    v
}

/// Rules "each step task runs once per epoch" and "parents first", over every handler start
/// of a step task in the journal.
pub fn check_steps(
    runs: &BTreeMap<String, RunSeen<'_>>,
    journal: &HashMap<String, Vec<Invocation>>,
    histories: &Histories,
) -> Vec<String> {
    let mut v = Vec::new();
    // When each (run, step, epoch) had all its tasks succeed: the latest finish among them.
    let mut done: HashMap<(&str, &str, u32), Option<u64>> = HashMap::new();
    for (id, history) in histories {
        let (Some(t), Some((_, rec))) = (parse_step_task(id), history.last()) else {
            continue;
        };
        let slot = done.entry((t.run, t.step, t.epoch)).or_insert(Some(0));
        *slot = match (*slot, rec.state == TaskState::Succeeded) {
            (Some(at), true) => Some(at.max(rec.finished_at_ms.unwrap_or(u64::MAX))),
            _ => None,
        };
    }
    // Per (run, step): when its earliest epoch whose tasks all succeeded did (`None`: no
    // epoch did).
    let mut ready: HashMap<(&str, &str), Option<u64>> = HashMap::new();
    for ((run, step, _), at) in &done {
        let slot = ready.entry((run, step)).or_insert(None);
        if let Some(at) = at {
            *slot = Some(slot.map_or(*at, |s: u64| s.min(*at)));
        }
    }
    let mut ids: Vec<&String> = journal.keys().collect();
    ids.sort();
    for id in ids {
        let Some(t) = parse_step_task(id) else {
            continue;
        };
        let starts = &journal[id];
        let Some((run, steps)) = runs.get(t.run).and_then(|s| s.run) else {
            v.push(format!(
                "{id}: a step task of a run that is not stored started"
            ));
            continue;
        };
        let Some(i) = run.def.steps.iter().position(|s| s.name == t.step) else {
            v.push(format!(
                "{id}: a task of a step its run does not have started"
            ));
            continue;
        };
        let step = &steps[i];
        if t.epoch > step.epoch || step.epoch > run.reruns {
            v.push(format!(
                "{id}: started in epoch {} (the step's last is {}, the run was re-run {} times): a step ran again without a re-run",
                t.epoch, step.epoch, run.reruns
            ));
        }
        if t.epoch == step.epoch {
            if matches!(step.state, StepState::UpstreamFailed | StepState::Skipped) {
                v.push(format!(
                    "{id}: started although its step ended {} (its policy never runs it)",
                    step.state
                ));
            }
            if step.items.is_some_and(|n| t.item >= n) {
                v.push(format!(
                    "{id}: item {} started, the step has {:?} items",
                    t.item, step.items
                ));
            }
        }
        if run.def.steps[i].trigger != TriggerRule::AllSuccess {
            continue;
        }
        let first = starts.iter().map(|s| s.start_ms).min().unwrap_or(0);
        for parent in &run.def.steps[i].needs {
            // A for_each parent with no items has no tasks: nothing to compare.
            let Some(ready) = ready.get(&(t.run, parent.as_str())) else {
                continue;
            };
            match ready {
                Some(at) if *at <= first => {}
                _ => v.push(format!(
                    "{id}: started at {first} before its parent {parent} had succeeded (at {ready:?})"
                )),
            }
        }
    }
    v
}

/// Rule "a sleep ends once, never early, never on a worker"; answers the rule's
/// violations and how many sleeps it judged.
pub fn check_sleeps(
    histories: &Histories,
    journal: &HashMap<String, Vec<Invocation>>,
) -> (Vec<String>, usize) {
    let mut v = Vec::new();
    let (ends, judged) = wait_ends(
        histories,
        journal,
        ax_sdk::flow::SLEEP_TASK,
        "a sleep",
        &mut v,
    );
    for (id, end) in ends {
        let (done, due) = (end.finished_at_ms.unwrap_or(0), end.run_at_ms.unwrap_or(0));
        if end.state == TaskState::Succeeded && done < due {
            v.push(format!(
                "{id}: a sleep ended at {done}, {} ms before its due time",
                due - done
            ));
        }
        if !matches!(end.state, TaskState::Succeeded | TaskState::Cancelled) {
            v.push(format!("{id}: a sleep ended {}", end.state));
        }
    }
    (v, judged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flows::{CancelAck, RerunAck};
    use serde_json::json;

    fn note(flow: &str, input: serde_json::Value) -> RunNote {
        RunNote {
            run: "r1".into(),
            flow: flow.into(),
            input,
            ..RunNote::default()
        }
    }

    fn run(
        flow: &str,
        state: RunState,
        steps: &[(&str, &[&str], StepState, u32)],
    ) -> (FlowRun, Vec<StepRun>) {
        let defs: Vec<_> = steps
            .iter()
            .map(|(name, needs, _, _)| json!({"name": name, "needs": needs, "task": {"name": "step", "queue": "x"}}))
            .collect();
        let def = ax_sdk::flow::FlowDef::decode(json!({"name": flow, "steps": defs})).unwrap();
        let run: FlowRun = serde_json::from_value(json!({"id": "r1", "flow": flow, "def": def,
            "state": state, "created_at_ms": 0, "updated_at_ms": 0}))
        .unwrap();
        let steps = steps
            .iter()
            .map(|(_, _, state, epoch)| StepRun {
                state: *state,
                epoch: *epoch,
                ..Default::default()
            })
            .collect();
        (run, steps)
    }

    #[test]
    fn a_run_must_end_as_its_policy_says() {
        use StepState::*;
        let chain_steps = [
            ("a", &[][..], Succeeded, 0),
            ("b", &["a"][..], Succeeded, 0),
            ("c", &["b"][..], Succeeded, 0),
            ("d", &["c"][..], Failed, 0),
        ];
        let chain = run("chain", RunState::Failed, &chain_steps);
        let n = note("chain", json!({}));
        let runs = BTreeMap::from([(
            "r1".to_string(),
            RunSeen {
                note: Some(&n),
                run: Some(&chain),
            },
        )]);
        assert_eq!(check_ends(&runs).len(), 1, "a chain that failed");
        // Cancelled while running: must end cancelled.
        let mut cancelled = note("chain", json!({}));
        cancelled.cancels.push(CancelAck {
            ack_ms: 1,
            state: "running".into(),
        });
        let ok = run(
            "chain",
            RunState::Succeeded,
            &chain_steps.map(|(a, b, _, e)| (a, b, Succeeded, e)),
        );
        let runs = BTreeMap::from([(
            "r1".to_string(),
            RunSeen {
                note: Some(&cancelled),
                run: Some(&ok),
            },
        )]);
        assert_eq!(
            check_ends(&runs).len(),
            1,
            "a cancel acknowledged while it ran"
        );
        // A fan whose list fails first succeeds only after a re-run of the failed step.
        let mut fan = note("fan", json!({"n": 2, "fail_first": true}));
        let failed = run(
            "fan",
            RunState::Failed,
            &[
                ("list", &[], Failed, 0),
                ("item", &["list"], UpstreamFailed, 0),
                ("gather", &["item"], UpstreamFailed, 0),
            ],
        );
        let runs = BTreeMap::from([(
            "r1".to_string(),
            RunSeen {
                note: Some(&fan),
                run: Some(&failed),
            },
        )]);
        assert!(check_ends(&runs).is_empty());
        fan.reruns.push(RerunAck {
            mode: "failed",
            ack_ms: 1,
        });
        let runs = BTreeMap::from([(
            "r1".to_string(),
            RunSeen {
                note: Some(&fan),
                run: Some(&failed),
            },
        )]);
        assert_eq!(
            check_ends(&runs).len(),
            1,
            "re-run acknowledged, still failed"
        );
    }

    #[test]
    fn a_step_runs_only_in_epochs_and_items_its_run_made() {
        use StepState::*;
        let r = run(
            "ff",
            RunState::Failed,
            &[
                ("a", &[], Succeeded, 0),
                ("after", &["a"], UpstreamFailed, 0),
            ],
        );
        let runs = BTreeMap::from([(
            "r1".to_string(),
            RunSeen {
                note: None,
                run: Some(&r),
            },
        )]);
        let start = |at| Invocation {
            attempt: 1,
            start_ms: at,
            ..Default::default()
        };
        let rec = |id: &str, state, at| {
            let mut rec: ax_sdk::TaskRecord = serde_json::from_value(json!({"id": id, "queue": "x",
                "name": "step", "priority": "normal", "state": state, "attempt": 1, "max_attempts": 5,
                "created_at_ms": 0, "updated_at_ms": at})).unwrap();
            rec.finished_at_ms = Some(at);
            rec
        };
        let histories: Histories = BTreeMap::from([(
            "x.fl.r1.a.0.0".to_string(),
            vec![(1, rec("x.fl.r1.a.0.0", "succeeded", 100))],
        )]);
        let mut journal = HashMap::new();
        journal.insert("x.fl.r1.a.0.0".to_string(), vec![start(10)]);
        assert!(check_steps(&runs, &journal, &histories).is_empty());
        // A second epoch without a re-run, a step that ended upstream_failed, and a child
        // before its parent finished.
        journal.insert("x.fl.r1.a.1.0".to_string(), vec![start(10)]);
        journal.insert("x.fl.r1.after.0.0".to_string(), vec![start(50)]);
        let v = check_steps(&runs, &journal, &histories);
        assert_eq!(v.len(), 3, "{v:#?}");
    }

    #[test]
    fn a_sleep_ended_twice_early_or_on_a_worker_is_reported() {
        let rec = |state: &str, finished: Option<u64>| -> ax_sdk::TaskRecord {
            let mut v = json!({"id": "x.fl.r1.nap.0.0", "queue": "x", "name": "ax.sleep",
                "priority": "normal", "state": state, "attempt": 1, "max_attempts": 5,
                "created_at_ms": 0, "updated_at_ms": 0, "run_at_ms": 1_000});
            if let Some(at) = finished {
                v["finished_at_ms"] = json!(at);
            }
            serde_json::from_value(v).unwrap()
        };
        let mut histories = Histories::new();
        let id = "x.fl.r1.nap.0.0".to_string();
        histories.insert(
            id.clone(),
            vec![
                (1, rec("scheduled", None)),
                (2, rec("succeeded", Some(1_005))),
            ],
        );
        let none = HashMap::new();
        assert_eq!(
            check_sleeps(&histories, &none),
            (vec![], 1),
            "on time, once"
        );
        histories.insert(
            id.clone(),
            vec![
                (1, rec("scheduled", None)),
                (2, rec("succeeded", Some(990))),
            ],
        );
        assert_eq!(check_sleeps(&histories, &none).0.len(), 1, "early");
        histories.insert(
            id.clone(),
            vec![
                (1, rec("succeeded", Some(1_005))),
                (2, rec("succeeded", Some(1_010))),
            ],
        );
        assert_eq!(check_sleeps(&histories, &none).0.len(), 1, "twice");
        histories.insert(
            id.clone(),
            vec![
                (1, rec("scheduled", None)),
                (2, rec("succeeded", Some(1_005))),
            ],
        );
        let mut journal = HashMap::new();
        let start = Invocation {
            attempt: 1,
            start_ms: 1_001,
            ..Default::default()
        };
        journal.insert(id.clone(), vec![start]);
        assert_eq!(check_sleeps(&histories, &journal).0.len(), 1, "on a worker");
    }
}
