//! Operation rules, over the acknowledged operations, the task records and
//! the journal:
//!
//! - **cancel**: a cancelled task never starts after its cancel was acknowledged, and ends
//!   as the answer said (`cancelled`, or the state it had already finished in);
//! - **retry**: a retried dead task runs again (a handler start of a later attempt) and,
//!   failing only at its first attempt, ends `succeeded`;
//! - **run now**: the task's next attempt starts, and ends `succeeded`; and if the run now
//!   was acknowledged at least [`RUN_NOW_MARGIN_MS`] before the task was due (its due time,
//!   or its next retry: 20–30 s ahead when the operation is sent), that attempt started
//!   before the due time — nothing but the run now starts a task before it is due, so the
//!   start proves it took effect. An acknowledgement that came later (the operation was
//!   held up past the due time, e.g. through an election) proves nothing about speed: the
//!   rule is then the plain one;
//! - **pause**: no task of the paused queue starts from [`PAUSE_SLACK_MS`] after the pause
//!   was acknowledged until the resume was sent (workers follow the pause key with a KV
//!   watch; a start already past its claim when the key arrived may land just after),
//!   except a worker's starts from its `SIGSTOP` to the slack after its `SIGCONT` (claimed
//!   before it was stopped; a start timed before the recorded `SIGCONT` is the resume, read
//!   on the worker's clock before the nemesis read its own).

use crate::checker::{Histories, Invocation};
use crate::cluster::Timeline;
use crate::ops::{CancelNote, RetryNote, RunNowNote};
use ax_sdk::TaskState;
use std::collections::HashMap;

/// A run now acknowledged at least this long before the task was due must start it before
/// then: the time a worker has to start it under the nemesis (a worker stopped past its 2 s
/// ack wait holding the copy, the other one busy).
pub const RUN_NOW_MARGIN_MS: u64 = 5_000;
/// Starts of a paused queue's tasks are tolerated this long after the pause's answer.
pub const PAUSE_SLACK_MS: u64 = 500;

fn last_state(histories: &Histories, id: &str) -> Option<TaskState> {
    histories
        .get(id)
        .and_then(|h| h.last())
        .map(|(_, r)| r.state)
}

/// Rule "cancel".
pub fn check_cancels(
    cancels: &[CancelNote],
    journal: &HashMap<String, Vec<Invocation>>,
    histories: &Histories,
) -> Vec<String> {
    let mut v = Vec::new();
    for c in cancels {
        for run in journal.get(&c.id).into_iter().flatten() {
            if run.start_ms > c.ack_ms {
                v.push(format!(
                    "{}: started (attempt {}, worker {}) {} ms after its cancel was acknowledged ({})",
                    c.id,
                    run.attempt,
                    run.worker,
                    run.start_ms - c.ack_ms,
                    c.state
                ));
            }
        }
        let want = if c.state.is_terminal() {
            c.state
        } else {
            TaskState::Cancelled
        };
        let got = last_state(histories, &c.id);
        if got != Some(want) {
            v.push(format!(
                "{}: cancel answered {}, the task ended {got:?}",
                c.id, c.state
            ));
        }
    }
    v
}

/// Rule "retry".
pub fn check_retries(
    retries: &[RetryNote],
    journal: &HashMap<String, Vec<Invocation>>,
    histories: &Histories,
) -> Vec<String> {
    let mut v = Vec::new();
    for r in retries {
        // A retry grants one more attempt (PROTOCOL §8): a worker killed or stopped past
        // its ack wait while it held that attempt (after its claim, before or during its
        // handler) leaves it dead of a lost heartbeat. The retry took effect; the nemesis
        // took the attempt.
        let last = histories
            .get(&r.id)
            .and_then(|h| h.last())
            .map(|(_, rec)| rec);
        let lost = last.is_some_and(|rec| {
            rec.state == TaskState::Dead
                && rec.attempt > r.dead_attempt
                && rec
                    .last_error
                    .as_ref()
                    .is_some_and(|e| e.class == "heartbeat_timeout")
        });
        if lost {
            continue;
        }
        let ran = journal
            .get(&r.id)
            .into_iter()
            .flatten()
            .any(|run| run.attempt > r.dead_attempt);
        if !ran {
            v.push(format!(
                "{}: retried after dying at attempt {}, never ran again",
                r.id, r.dead_attempt
            ));
        }
        let got = last_state(histories, &r.id);
        if got != Some(TaskState::Succeeded) {
            v.push(format!("{}: retried, ended {got:?} (not succeeded)", r.id));
        }
    }
    v
}

/// Rule "run now".
pub fn check_run_nows(
    run_nows: &[RunNowNote],
    journal: &HashMap<String, Vec<Invocation>>,
    histories: &Histories,
) -> Vec<String> {
    let mut v = Vec::new();
    for r in run_nows {
        let first = journal
            .get(&r.id)
            .into_iter()
            .flatten()
            .filter(|run| run.attempt > r.attempt)
            .map(|run| run.start_ms)
            .min();
        // Judged from the acknowledgement: only one that came early enough can be held to
        // a start before the due time.
        let in_time = r.ack_ms + RUN_NOW_MARGIN_MS <= r.due_ms;
        match first {
            Some(at) if !in_time || at < r.due_ms => {}
            other => v.push(format!(
                "{}: run now acknowledged at {}, due at {}, next attempt started at {other:?}",
                r.id, r.ack_ms, r.due_ms
            )),
        }
        let got = last_state(histories, &r.id);
        if got != Some(TaskState::Succeeded) {
            v.push(format!("{}: run now, ended {got:?} (not succeeded)", r.id));
        }
    }
    v
}

/// Rule "pause": starts of `queue`'s tasks while it was paused.
pub fn check_pauses(
    queue: &str,
    pauses: &[(u64, u64)],
    journal: &HashMap<String, Vec<Invocation>>,
    timeline: &Timeline,
) -> Vec<String> {
    let prefix = format!("{queue}.");
    // When each worker first started a handler (a process started by the nemesis).
    let mut first: HashMap<&str, u64> = HashMap::new();
    for run in journal.values().flatten() {
        let at = first.entry(run.worker.as_str()).or_insert(run.start_ms);
        *at = (*at).min(run.start_ms);
    }
    let mut v = Vec::new();
    for (id, runs) in journal {
        if !id.starts_with(&prefix) {
            continue;
        }
        for run in runs {
            let Some((paused, resumed)) = pauses
                .iter()
                .find(|(p, r)| (p + PAUSE_SLACK_MS..*r).contains(&run.start_ms))
            else {
                continue;
            };
            // From the stop on: a stopped worker runs nothing, so a start journaled before
            // the recorded `SIGCONT` is the resume itself, timed before the nemesis read its
            // clock after sending the signal (seen: 1 ms before, seeds 7612214179525511733
            // and 8141705213271473606).
            let just_resumed = timeline.stops.iter().any(|(w, stop, cont)| {
                *w == run.worker && (*stop..=cont + PAUSE_SLACK_MS).contains(&run.start_ms)
            });
            let disturbed = crate::checker_limits::broker_disturbed(timeline, run.start_ms);
            if !just_resumed && !disturbed {
                let new = first
                    .get(run.worker.as_str())
                    .is_some_and(|at| *at > *paused);
                v.push(format!(
                    "{id} ({}): started (worker {}{}) {} ms into a pause of queue {queue} ({paused}..{resumed})",
                    run.name,
                    run.worker,
                    if new { ", its first start: a worker started during the pause" } else { "" },
                    run.start_ms - paused
                ));
            }
        }
    }
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn history(id: &str, state: &str) -> Vec<(u64, ax_sdk::TaskRecord)> {
        let rec = serde_json::from_value(json!({"id": id, "queue": "x", "name": "t",
            "priority": "normal", "state": state, "attempt": 1, "max_attempts": 5,
            "created_at_ms": 0, "updated_at_ms": 0}))
        .unwrap();
        vec![(1, rec)]
    }

    fn start(attempt: u32, at: u64) -> Invocation {
        Invocation {
            attempt,
            start_ms: at,
            worker: "x0".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_start_after_an_acknowledged_cancel_is_caught() {
        let cancels = [CancelNote {
            id: "x.a".into(),
            ack_ms: 1000,
            state: TaskState::Cancelled,
        }];
        let histories = Histories::from([("x.a".to_string(), history("x.a", "cancelled"))]);
        let mut journal = HashMap::from([("x.a".to_string(), vec![start(1, 900)])]);
        assert!(check_cancels(&cancels, &journal, &histories).is_empty());
        journal.get_mut("x.a").unwrap().push(start(2, 1001));
        assert_eq!(check_cancels(&cancels, &journal, &histories).len(), 1);
        // Answered cancelled, ended succeeded.
        let done = Histories::from([("x.a".to_string(), history("x.a", "succeeded"))]);
        assert_eq!(check_cancels(&cancels, &HashMap::new(), &done).len(), 1);
    }

    #[test]
    fn retries_and_run_nows_must_take_effect() {
        let histories = Histories::from([("x.a".to_string(), history("x.a", "succeeded"))]);
        let retried = [RetryNote {
            id: "x.a".into(),
            dead_attempt: 1,
        }];
        let journal = HashMap::from([("x.a".to_string(), vec![start(1, 10)])]);
        assert_eq!(
            check_retries(&retried, &journal, &histories).len(),
            1,
            "never ran again"
        );
        let journal = HashMap::from([("x.a".to_string(), vec![start(1, 10), start(2, 20)])]);
        assert!(check_retries(&retried, &journal, &histories).is_empty());
        let now = [RunNowNote {
            id: "x.a".into(),
            ack_ms: 15,
            due_ms: 20_000,
            attempt: 1,
        }];
        assert!(check_run_nows(&now, &journal, &histories).is_empty());
        let late = HashMap::from([("x.a".to_string(), vec![start(1, 10), start(2, 20_000)])]);
        assert_eq!(
            check_run_nows(&now, &late, &histories).len(),
            1,
            "ran at its due time"
        );
    }

    /// CI, seed 12035618627834268037 (R3): the run now was acknowledged 784 ms after the
    /// retry was due; no start could have come 5 s before it.
    #[test]
    fn a_run_now_acknowledged_after_its_due_time_is_held_to_the_plain_rule() {
        let histories = Histories::from([("x.a".to_string(), history("x.a", "succeeded"))]);
        let late_ack = [RunNowNote {
            id: "x.a".into(),
            ack_ms: 1_796_313_788_774,
            due_ms: 1_796_313_787_990,
            attempt: 1,
        }];
        let journal = HashMap::from([(
            "x.a".to_string(),
            vec![start(1, 1_796_313_763_000), start(2, 1_796_313_789_878)],
        )]);
        assert!(check_run_nows(&late_ack, &journal, &histories).is_empty());
        // Still: the next attempt must start, and the task end succeeded.
        let never = HashMap::from([("x.a".to_string(), vec![start(1, 1_796_313_763_000)])]);
        assert_eq!(check_run_nows(&late_ack, &never, &histories).len(), 1);
        let dead = Histories::from([("x.a".to_string(), history("x.a", "dead"))]);
        assert_eq!(check_run_nows(&late_ack, &journal, &dead).len(), 1);
        // Acknowledged 5 s before due: a start before due is owed, however close to it.
        let early = [RunNowNote {
            ack_ms: 15_000,
            ..late_ack[0].clone()
        }]
        .map(|r| RunNowNote {
            due_ms: 20_000,
            ..r
        });
        let close = HashMap::from([("x.a".to_string(), vec![start(1, 10), start(2, 19_999)])]);
        assert!(check_run_nows(&early, &close, &histories).is_empty());
        let at_due = HashMap::from([("x.a".to_string(), vec![start(1, 10), start(2, 20_000)])]);
        assert_eq!(check_run_nows(&early, &at_due, &histories).len(), 1);
    }

    #[test]
    fn a_retried_attempt_lost_with_its_worker_is_not_a_failed_retry() {
        let retried = [RetryNote {
            id: "x.a".into(),
            dead_attempt: 1,
        }];
        let dead = |class: &str| {
            let rec = serde_json::from_value(json!({"id": "x.a", "queue": "x", "name": "t",
                "priority": "normal", "state": "dead", "attempt": 2, "max_attempts": 2,
                "created_at_ms": 0, "updated_at_ms": 0,
                "last_error": {"class": class, "message": "m"}}))
            .unwrap();
            Histories::from([("x.a".to_string(), vec![(2, rec)])])
        };
        let journal = HashMap::from([("x.a".to_string(), vec![start(1, 10)])]);
        // Claimed, then its worker killed: dead of a lost heartbeat at attempt 2.
        assert!(check_retries(&retried, &journal, &dead("heartbeat_timeout")).is_empty());
        // Dead at attempt 2 of anything else is a retry that failed the checker.
        assert_eq!(check_retries(&retried, &journal, &dead("io")).len(), 2);
    }

    #[test]
    fn a_start_inside_a_pause_is_caught() {
        let journal = HashMap::from([
            ("x.a".to_string(), vec![start(1, 1200)]),
            ("x.b".to_string(), vec![start(1, 1600)]),
            ("xl.c".to_string(), vec![start(1, 2000)]),
        ]);
        let pauses = [(1000, 3000)];
        // x.a is within the slack; xl.c is another queue.
        let v = check_pauses("x", &pauses, &journal, &Timeline::default());
        assert_eq!(v.len(), 1, "{v:?}");
        // Its worker had just been resumed.
        let t = Timeline {
            stops: vec![("x0".into(), 0, 1300)],
            ..Default::default()
        };
        assert!(check_pauses("x", &pauses, &journal, &t).is_empty());
        // Journaled a millisecond before its `SIGCONT` was recorded: the resume itself.
        let t = Timeline {
            stops: vec![("x0".into(), 1400, 1601)],
            ..Default::default()
        };
        assert!(check_pauses("x", &pauses, &journal, &t).is_empty());
    }
}
