//! Rule "an approval ends once, as its answered completion says", over the approvals'
//! wait tasks (`ax.approval`), the journal and the completions the flow load noted:
//!
//! - the wait task reaches one final state once, and no handler ever starts it;
//! - two completions answered with different decisions never happen (the first wins,
//!   the other is refused);
//! - an answered `approved` ends it `succeeded` with output `{"decision": "approved", …}`;
//!   an answered `rejected` ends it `dead`, class `approval_rejected`;
//! - with no completion answered (and none unanswered), it times out: `succeeded` with
//!   output `null` (policy `continue`), no earlier than its due time; or its run's
//!   cancel ended it.

use crate::checker::{wait_ends, Histories, Invocation};
use crate::flows::RunNote;
use ax_sdk::flow::model::parse_step_task;
use ax_sdk::TaskState;
use serde_json::Value;
use std::collections::HashMap;

/// The rule's violations and how many approvals it judged (and how many had an
/// answered completion).
pub fn check_approvals(
    histories: &Histories,
    journal: &HashMap<String, Vec<Invocation>>,
    notes: &[RunNote],
) -> (Vec<String>, usize, usize) {
    let mut v = Vec::new();
    let mut decided = 0;
    let what = "an approval";
    let (ends, judged) = wait_ends(
        histories,
        journal,
        ax_sdk::flow::APPROVAL_TASK,
        what,
        &mut v,
    );
    for (id, end) in ends {
        let output: Option<Value> = end.output.as_ref().and_then(|o| o.json.clone());
        let class = end.last_error.as_ref().map(|e| e.class.as_str());
        let got = match (end.state, &output, class) {
            (TaskState::Cancelled, _, _) => continue,
            (TaskState::Succeeded, Some(out), _) if out["decision"] == "approved" => "approved",
            (TaskState::Succeeded, None, _) => "timed_out",
            (TaskState::Dead, _, Some("approval_rejected")) => "rejected",
            (state, _, _) => {
                v.push(format!(
                    "{id}: an approval ended {state} ({output:?}, {class:?})"
                ));
                continue;
            }
        };
        if got == "timed_out" {
            let (done, due) = (end.finished_at_ms.unwrap_or(0), end.run_at_ms.unwrap_or(0));
            if done < due {
                v.push(format!(
                    "{id}: an approval timed out {} ms early",
                    due - done
                ));
            }
        }
        let Some(note) = parse_step_task(id).and_then(|s| notes.iter().find(|n| n.run == s.run))
        else {
            continue;
        };
        let answered: Vec<&str> = note.decided.iter().map(|(d, _)| d.as_str()).collect();
        if !answered.is_empty() {
            decided += 1;
        }
        if answered.iter().any(|d| *d != answered[0]) {
            v.push(format!("{id}: completions answered {answered:?}: both won"));
            continue;
        }
        match answered.first() {
            Some(want) if *want != got => v.push(format!(
                "{id}: a completion answered {want}, and it ended {got}"
            )),
            None if got != "timed_out" && note.unanswered == 0 => v.push(format!(
                "{id}: no completion was answered, and it ended {got}"
            )),
            _ => {}
        }
    }
    (v, judged, decided)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// An approval's history: its states, the last with `output` or a rejection.
    fn history(states: &[TaskState], end: &str, finished: u64) -> Vec<(u64, ax_sdk::TaskRecord)> {
        states
            .iter()
            .enumerate()
            .map(|(k, state)| {
                let mut r = json!({"id": "x.fl.r1.g.0.0", "queue": "x", "name": "ax.approval",
                    "state": state, "attempt": 0, "max_attempts": 1, "priority": "normal",
                    "created_at_ms": 0, "updated_at_ms": 0, "run_at_ms": 10_000,
                    "finished_at_ms": finished});
                if state.is_terminal() && end == "approved" {
                    r["output"] = json!({"content_type": "application/json", "size": 1,
                        "json": {"decision": "approved", "payload": null}});
                }
                if state.is_terminal() && end == "rejected" {
                    r["last_error"] = json!({"class": "approval_rejected", "message": "no"});
                }
                (k as u64 + 1, serde_json::from_value(r).unwrap())
            })
            .collect()
    }

    #[test]
    fn an_end_that_no_answer_explains_a_double_winner_and_a_double_end_are_reported() {
        use TaskState::*;
        let none = HashMap::new();
        let judge = |h: Vec<(u64, ax_sdk::TaskRecord)>, decided: &[&str], unanswered: usize| {
            let note = RunNote {
                run: "r1".into(),
                flow: "gate".into(),
                decided: decided.iter().map(|d| (d.to_string(), 1)).collect(),
                unanswered,
                ..RunNote::default()
            };
            let histories: Histories = [("x.fl.r1.g.0.0".to_string(), h)].into();
            check_approvals(&histories, &none, &[note]).0
        };
        let approved = || history(&[Scheduled, Succeeded], "approved", 500);
        let rejected = || history(&[Scheduled, Dead], "rejected", 500);
        assert!(judge(approved(), &["approved", "approved"], 0).is_empty());
        assert!(judge(rejected(), &["rejected"], 0).is_empty());
        assert!(judge(history(&[Scheduled, Succeeded], "", 10_000), &[], 0).is_empty());
        assert!(
            judge(approved(), &[], 1).is_empty(),
            "an unanswered completion may have won"
        );
        assert_eq!(
            judge(approved(), &["rejected"], 0).len(),
            1,
            "answered rejected"
        );
        assert_eq!(judge(approved(), &[], 0).len(), 1, "approved by no one");
        assert_eq!(
            judge(rejected(), &["rejected", "approved"], 0).len(),
            1,
            "two winners"
        );
        let early = history(&[Scheduled, Succeeded], "", 9_000);
        assert_eq!(judge(early, &[], 0).len(), 1, "early");
        let twice = history(
            &[Scheduled, Succeeded, Scheduled, Succeeded],
            "approved",
            500,
        );
        assert_eq!(judge(twice, &["approved"], 0).len(), 1, "twice");
    }
}
