//! Rule "a child flow step ends once, with its child", over the child flow steps' wait
//! tasks (`ax.child_flow`), the journal and the child runs they name (read back):
//!
//! - the wait task reaches one final state once, and no handler ever starts it;
//! - its child run names it as `parent` and has ended (the parent's end or cancel reaches
//!   it);
//! - a wait task `succeeded` with an output: its child run `succeeded`, and the output
//!   holds exactly the child's leaf steps; `dead` with class `child_failed` /
//!   `child_cancelled`: its child `failed` / `cancelled`; `cancelled` (its run's cancel or
//!   fail-fast): its child `cancelled`, or ended on its own first; nothing else (the
//!   campaign's children have no timeout);
//! - a child run exists only for a stored wait task (none is started twice: its id is the
//!   task's).

use crate::checker::{wait_ends, Histories, Invocation};
use ax_sdk::flow::model::child_run_id;
use ax_sdk::flow::{FlowRun, RunState, StepRun};
use ax_sdk::TaskState;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};

/// The wait tasks of child flow steps, by id, from the histories.
pub fn wait_tasks(histories: &Histories) -> Vec<String> {
    histories
        .iter()
        .filter(|(_, h)| {
            h.last()
                .is_some_and(|(_, r)| r.name == ax_sdk::flow::CHILD_FLOW_TASK)
        })
        .map(|(id, _)| id.clone())
        .collect()
}

/// The rule's violations and how many child steps' items it judged (and how many of
/// them succeeded).
pub fn check_children(
    histories: &Histories,
    journal: &HashMap<String, Vec<Invocation>>,
    children: &BTreeMap<String, Option<(FlowRun, Vec<StepRun>)>>,
) -> (Vec<String>, usize, usize) {
    let mut v = Vec::new();
    let mut succeeded = 0;
    let what = "a child flow step";
    let (ends, judged) = wait_ends(
        histories,
        journal,
        ax_sdk::flow::CHILD_FLOW_TASK,
        what,
        &mut v,
    );
    for (id, end) in ends {
        let child_id = child_run_id(id);
        let child = children.get(&child_id).and_then(Option::as_ref);
        if let Some((run, _)) = child {
            if run.parent.as_ref().map(|p| &p.task) != Some(id) {
                v.push(format!(
                    "{id}: its child run {child_id} names parent {:?}",
                    run.parent
                ));
            }
            if run.state == RunState::Running {
                v.push(format!(
                    "{id}: its child run {child_id} never ended (the step ended {})",
                    end.state
                ));
                continue;
            }
        }
        let class = end.last_error.as_ref().map(|e| e.class.as_str());
        let output: Option<Value> = end.output.as_ref().and_then(|o| o.json.clone());
        let child_state = child.map(|(r, _)| r.state);
        let fine = match (end.state, class, child_state) {
            (TaskState::Succeeded, _, Some(RunState::Succeeded)) => {
                succeeded += 1;
                let (run, steps) = child.expect("matched");
                let leaves = leaf_names(run, steps);
                let keys: Vec<String> = output
                    .as_ref()
                    .and_then(Value::as_object)
                    .map(|o| o.keys().cloned().collect())
                    .unwrap_or_default();
                if keys != leaves {
                    v.push(format!(
                        "{id}: succeeded with output {output:?}, its child's leaves are {leaves:?}"
                    ));
                }
                true
            }
            (TaskState::Dead, Some("child_failed"), Some(RunState::Failed)) => true,
            (TaskState::Dead, Some("child_cancelled"), Some(RunState::Cancelled)) => true,
            // The run's cancel or fail-fast: the child is cancelled, or ended first, or
            // was never started (cancelled between the submit and the start).
            (TaskState::Cancelled, _, _) => true,
            _ => false,
        };
        if !fine {
            v.push(format!(
                "{id}: ended {} (class {class:?}, output {output:?}) with its child {child_id} {child_state:?}",
                end.state
            ));
        }
    }
    (v, judged, succeeded)
}

/// The names of a child run's leaf steps (no step needs them) that succeeded, sorted.
fn leaf_names(run: &FlowRun, steps: &[StepRun]) -> Vec<String> {
    let needed: Vec<&String> = run.def.steps.iter().flat_map(|s| &s.needs).collect();
    let mut out: Vec<String> = run
        .def
        .steps
        .iter()
        .zip(steps)
        .filter(|(d, s)| {
            !needed.contains(&&d.name) && s.state == ax_sdk::flow::StepState::Succeeded
        })
        .map(|(d, _)| d.name.clone())
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(id: &str, state: &str, extra: Value) -> ax_sdk::TaskRecord {
        let mut v = json!({"id": id, "queue": "x", "name": "ax.child_flow", "priority": "normal",
            "state": state, "attempt": 1, "max_attempts": 1, "created_at_ms": 1, "updated_at_ms": 2});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    fn child(id: &str, state: RunState, parent_task: &str) -> (FlowRun, Vec<StepRun>) {
        let run: FlowRun = serde_json::from_value(json!({"id": child_run_id(id), "flow": "kid",
            "def": {"name": "kid", "steps": [
                {"name": "k1", "task": {"name": "step", "queue": "x"}},
                {"name": "k2", "needs": ["k1"], "task": {"name": "step", "queue": "x"}}]},
            "state": state, "created_at_ms": 1, "updated_at_ms": 2,
            "parent": {"run": "R", "step": "kids", "task": parent_task, "depth": 1}}))
        .unwrap();
        let ok = StepRun {
            state: ax_sdk::flow::StepState::Succeeded,
            ..StepRun::default()
        };
        (run, vec![ok.clone(), ok])
    }

    #[test]
    fn an_end_its_child_does_not_explain_a_double_end_and_a_running_child_are_reported() {
        let ok = "x.fl.R.kids.0.0";
        let mut histories: Histories = BTreeMap::new();
        let out = json!({"content_type": "application/json", "size": 10, "json": {"k2": 1}});
        histories.insert(
            ok.into(),
            vec![
                (1, rec(ok, "scheduled", json!({}))),
                (2, rec(ok, "succeeded", json!({"output": out}))),
            ],
        );
        let mut children = BTreeMap::new();
        children.insert(child_run_id(ok), Some(child(ok, RunState::Succeeded, ok)));
        let (v, judged, succeeded) = check_children(&histories, &HashMap::new(), &children);
        assert_eq!((v.len(), judged, succeeded), (0, 1, 1), "{v:?}");
        // Its child failed, yet it succeeded; another ended twice; a third's child runs on.
        children.insert(child_run_id(ok), Some(child(ok, RunState::Failed, ok)));
        let twice = "x.fl.R.kids.0.1";
        histories.insert(
            twice.into(),
            vec![
                (1, rec(twice, "succeeded", json!({}))),
                (2, rec(twice, "scheduled", json!({}))),
                (3, rec(twice, "cancelled", json!({}))),
            ],
        );
        let on = "x.fl.R.kids.0.2";
        histories.insert(on.into(), vec![(1, rec(on, "cancelled", json!({})))]);
        children.insert(child_run_id(on), Some(child(on, RunState::Running, on)));
        let (v, _, _) = check_children(&histories, &HashMap::new(), &children);
        assert_eq!(v.len(), 3, "{v:?}");
        for want in ["with its child", "ended 2 times", "never ended"] {
            assert!(v.iter().any(|l| l.contains(want)), "{want}: {v:?}");
        }
    }
}
