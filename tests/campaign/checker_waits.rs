//! Rule "a wait for an event ends once, with its event if it came in time", over the wait
//! tasks' records (`ax.wait_for_event`), the journal and what the flow load published:
//!
//! - the wait task reaches one final state once: `succeeded` (by its event, or by its
//!   timeout with output `null`: the `paid` flow goes on), or `cancelled` by its run's
//!   cancel; no handler ever starts it;
//! - ended by its timeout (no output), it ended no earlier than its due time;
//! - ended by an event, the event is its run's order's;
//! - if its run's event was acknowledged by its timeout (so stored by then) and no cancel
//!   of the run was acknowledged, it ended with that event: no event that matched is
//!   lost, whichever servers died meanwhile and however long the matcher took to read it
//!   (a wait's timeout waits for the matcher). An event acknowledged after the timeout
//!   may have been stored before it: either end is allowed.

use crate::checker::{wait_ends, Histories, Invocation};
use crate::flows::{Paid, RunNote};
use ax_sdk::flow::model::parse_step_task;
use ax_sdk::TaskState;
use serde_json::{json, Value};
use std::collections::HashMap;

/// The rule's violations and how many waits it judged.
pub fn check_waits(
    histories: &Histories,
    journal: &HashMap<String, Vec<Invocation>>,
    notes: &[RunNote],
) -> (Vec<String>, usize) {
    let mut v = Vec::new();
    let what = "a wait for an event";
    let (ends, judged) = wait_ends(
        histories,
        journal,
        ax_sdk::flow::WAIT_FOR_EVENT_TASK,
        what,
        &mut v,
    );
    for (id, end) in ends {
        let note = parse_step_task(id).and_then(|s| notes.iter().find(|n| n.run == s.run));
        let order = note.map(|n| n.input["order"].clone());
        let due = end.run_at_ms.unwrap_or(0);
        let output: Option<Value> = end.output.as_ref().and_then(|o| o.json.clone());
        match (end.state, &output) {
            (TaskState::Cancelled, _) => continue,
            (TaskState::Succeeded, None) => {
                let done = end.finished_at_ms.unwrap_or(0);
                if done < due {
                    v.push(format!(
                        "{id}: a wait timed out at {done}, {} ms before its timeout",
                        due - done
                    ));
                }
            }
            (TaskState::Succeeded, Some(event)) => {
                if let Some(order) = &order {
                    if *event != json!({ "order": order }) {
                        v.push(format!("{id}: a wait of order {order} ended with {event}"));
                    }
                }
            }
            (state, _) => v.push(format!("{id}: a wait ended {state}")),
        }
        let Some(note) = note else { continue };
        if let (Paid::Acked(at), true, None) = (note.paid, note.cancels.is_empty(), &output) {
            if at <= due {
                v.push(format!(
                    "{id}: its event was stored at {at}, {} ms before its timeout, and it timed out",
                    due - at
                ));
            }
        }
    }
    (v, judged)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(
        states: &[(TaskState, Option<Value>)],
        finished: u64,
    ) -> Vec<(u64, ax_sdk::TaskRecord)> {
        states
            .iter()
            .enumerate()
            .map(|(k, (state, out))| {
                let mut r = json!({"id": "x.fl.r1.w.0.0", "queue": "x", "name": "ax.wait_for_event",
                    "state": state, "attempt": 0, "max_attempts": 1, "priority": "normal",
                    "created_at_ms": 0, "updated_at_ms": 0, "run_at_ms": 10_000,
                    "finished_at_ms": finished});
                if let Some(out) = out {
                    r["output"] =
                        json!({"content_type": "application/json", "size": 1, "json": out});
                }
                (k as u64 + 1, serde_json::from_value(r).unwrap())
            })
            .collect()
    }

    fn note(paid: Paid) -> RunNote {
        RunNote {
            run: "r1".into(),
            flow: "paid".into(),
            input: json!({"order": "o1"}),
            paid,
            ..RunNote::default()
        }
    }

    #[test]
    fn a_lost_event_a_double_end_an_early_timeout_and_a_stranger_are_reported() {
        use TaskState::*;
        let none = HashMap::new();
        let judge = |h: Vec<(u64, ax_sdk::TaskRecord)>, paid: Paid| {
            let histories: Histories = [("x.fl.r1.w.0.0".to_string(), h)].into();
            check_waits(&histories, &none, &[note(paid)]).0
        };
        let met = Some(json!({"order": "o1"}));
        assert!(judge(
            history(&[(Scheduled, None), (Succeeded, met.clone())], 500),
            Paid::Acked(100)
        )
        .is_empty());
        assert!(judge(
            history(&[(Scheduled, None), (Succeeded, None)], 10_000),
            Paid::Never
        )
        .is_empty());
        // Timed out though its event was stored 9.9 s before: lost.
        assert_eq!(
            judge(
                history(&[(Scheduled, None), (Succeeded, None)], 10_000),
                Paid::Acked(100)
            )
            .len(),
            1
        );
        // Acknowledged at its timeout: owed. After it: either end.
        assert_eq!(
            judge(
                history(&[(Scheduled, None), (Succeeded, None)], 10_050),
                Paid::Acked(10_000)
            )
            .len(),
            1
        );
        assert!(judge(
            history(&[(Scheduled, None), (Succeeded, None)], 10_050),
            Paid::Acked(10_001)
        )
        .is_empty());
        assert_eq!(
            judge(
                history(&[(Scheduled, None), (Succeeded, None)], 9_000),
                Paid::Never
            )
            .len(),
            1,
            "early"
        );
        let stranger = Some(json!({"order": "o2"}));
        assert_eq!(
            judge(
                history(&[(Scheduled, None), (Succeeded, stranger)], 500),
                Paid::Never
            )
            .len(),
            1
        );
        let twice = history(
            &[
                (Scheduled, None),
                (Succeeded, met.clone()),
                (Scheduled, None),
                (Succeeded, met),
            ],
            500,
        );
        assert_eq!(judge(twice, Paid::Acked(100)).len(), 1, "twice");
    }
}
