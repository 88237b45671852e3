//! The claim step as a pure decision: given the stored record (if any) and a delivery,
//! what does the worker do? No broker, no clock: unit-tested branch by branch, like
//! `trigger::plan`. docs/PROTOCOL.md §3 spells out the same steps for other languages.

use crate::state::{ErrorInfo, TaskRecord, TaskState};
use crate::task::TaskMeta;

/// One delivery of a task message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Delivery<'a> {
    /// Stream sequence of the message.
    pub(crate) seq: u64,
    /// This worker's id.
    pub(crate) worker: &'a str,
    /// Now, ms since the epoch.
    pub(crate) now_ms: u64,
    /// The first delivery of a message whose submit stored no record (`Ax-Unrecorded`).
    pub(crate) unrecorded_first: bool,
}

/// What to do with a delivery.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Decision {
    /// No record yet, on a redelivery, or of a task whose submitter died between its two
    /// writes: create this one (`pending`, from the headers), then decide again.
    Create(Box<TaskRecord>),
    /// The task already succeeded (a lost ack): Ack.
    AckDuplicate,
    /// The task was cancelled before it started: Ack without running it.
    AckCancelled,
    /// An operator cancelled the running task and no worker answered the signal: write
    /// this `cancelled` record (CAS on the revision read), then Ack without running.
    Cancel(Box<TaskRecord>),
    /// The task is dead; the dead letter or the Term may be missing: publish the dead
    /// letter (idempotent by message id) with this error, then Term.
    FinishDead(ErrorInfo),
    /// Another message of the same task holds the running attempt (a copy published after
    /// the duplicate window): Term this one without running it.
    RetireStray,
    /// Attempts are used up: write this `dead` record (CAS on the revision read), publish
    /// the dead letter, Term.
    Dead(Box<TaskRecord>),
    /// Start an attempt: write this `running` record (CAS on the revision read); the new
    /// revision is the fencing token. `lost` is true when the previous attempt stopped
    /// heartbeating (it counts as a failed attempt). With no record read (the first
    /// delivery of an unrecorded task), the write is a create-if-absent and may be
    /// deferred (`attempt::start`).
    Start { rec: Box<TaskRecord>, lost: bool },
}

/// Decides what a delivery of `meta` does, given the stored record.
pub(crate) fn decide(found: Option<&TaskRecord>, meta: &TaskMeta, d: Delivery<'_>) -> Decision {
    let mut rec = match found {
        Some(found) => found.clone(),
        // Its submit stored no record and this is the message's first delivery: no attempt
        // can have started, so the attempt starts from the headers.
        None if d.unrecorded_first => meta.record(),
        None => {
            return Decision::Create(Box::new(
                meta.record().transition_at(TaskState::Pending, d.now_ms),
            ))
        }
    };
    let mut lost = false;
    match rec.state {
        TaskState::Succeeded => return Decision::AckDuplicate,
        TaskState::Cancelled => return Decision::AckCancelled,
        TaskState::Dead => {
            return Decision::FinishDead(rec.last_error.clone().unwrap_or(ErrorInfo {
                detail: None,
                class: "dead".into(),
                message: String::new(),
            }))
        }
        TaskState::Running if rec.cancel_requested_at_ms.is_some() => {
            let mut cancelled = rec.transition_at(TaskState::Cancelled, d.now_ms);
            cancelled.last_error = Some(ErrorInfo {
                detail: None,
                class: "cancelled".into(),
                message: "cancelled by an operator while running".into(),
            });
            return Decision::Cancel(Box::new(cancelled));
        }
        // The message "run now" replaced: its copy carries the task on.
        TaskState::Scheduled | TaskState::Pending | TaskState::Retrying
            if rec.superseded_seq == Some(d.seq) =>
        {
            return Decision::RetireStray
        }
        // A `running` record names the message its attempt was claimed from: any other
        // message of the task is a stray copy. (A `pending` record's `ready_seq`, set at
        // submit, is not used this way: a pending task's other copies may be the ones its
        // trigger or flow stands behind, and retiring them lost tasks.)
        TaskState::Running if rec.ready_seq.is_some() && rec.ready_seq != Some(d.seq) => {
            return Decision::RetireStray
        }
        TaskState::Running => {
            lost = true;
            rec.last_error = Some(ErrorInfo {
                detail: None,
                class: "heartbeat_timeout".into(),
                message: format!(
                    "attempt {} on worker {} stopped heartbeating",
                    rec.attempt,
                    rec.worker.as_deref().unwrap_or("?")
                ),
            });
        }
        TaskState::Scheduled | TaskState::Pending | TaskState::Retrying => {}
    }
    // The attempts in force: the message's, or the worker's option for the task's name.
    rec.max_attempts = meta.max_attempts;
    if rec.attempt >= meta.max_attempts {
        let error = rec.last_error.clone().unwrap_or(ErrorInfo {
            detail: None,
            class: "attempts_exhausted".into(),
            message: format!("{} attempts made", rec.attempt),
        });
        let mut dead = rec.transition_at(TaskState::Dead, d.now_ms);
        dead.last_error = Some(error);
        return Decision::Dead(Box::new(dead));
    }
    rec.attempt += 1;
    rec.started_at_ms = Some(d.now_ms);
    rec.worker = Some(d.worker.to_string());
    rec.ready_seq = Some(d.seq);
    Decision::Start {
        rec: Box::new(rec.transition_at(TaskState::Running, d.now_ms)),
        lost,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::SubmitRequest;
    use crate::task::Limits;

    fn meta(max_attempts: i64) -> TaskMeta {
        let req = SubmitRequest {
            name: "t".into(),
            max_attempts: Some(max_attempts),
            ..Default::default()
        };
        TaskMeta::from_request("q", req, &Limits::default())
            .unwrap()
            .0
    }

    const D: Delivery<'static> = Delivery {
        seq: 7,
        worker: "w1",
        now_ms: 1000,
        unrecorded_first: false,
    };

    fn with(state: TaskState, attempt: u32, ready_seq: Option<u64>) -> TaskRecord {
        let mut rec = meta(3).record();
        rec.state = state;
        rec.attempt = attempt;
        rec.ready_seq = ready_seq;
        rec.worker = Some("w0".into());
        rec
    }

    #[test]
    fn a_missing_record_is_created_pending() {
        let m = meta(3);
        match decide(None, &m, D) {
            Decision::Create(rec) => {
                assert_eq!(
                    (rec.state, rec.attempt, &rec.id),
                    (TaskState::Pending, 0, &m.id)
                );
                assert_eq!(rec.updated_at_ms, 1000);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_first_delivery_of_an_unrecorded_task_starts_attempt_one_from_its_headers() {
        let m = meta(3);
        let first = Delivery {
            unrecorded_first: true,
            ..D
        };
        match decide(None, &m, first) {
            Decision::Start { rec, lost } => {
                assert!(!lost);
                assert_eq!((rec.state, rec.attempt), (TaskState::Running, 1));
                assert_eq!(
                    (rec.ready_seq, rec.worker.as_deref()),
                    (Some(7), Some("w1"))
                );
            }
            other => panic!("{other:?}"),
        }
        // A record found (a cancel made it, or another delivery's claim) decides as usual.
        let mut cancelled = m.record();
        cancelled.state = TaskState::Cancelled;
        assert_eq!(decide(Some(&cancelled), &m, first), Decision::AckCancelled);
    }

    #[test]
    fn pending_scheduled_and_retrying_start_the_next_attempt() {
        for state in [
            TaskState::Pending,
            TaskState::Scheduled,
            TaskState::Retrying,
        ] {
            let mut found = with(state, 1, None);
            found.next_retry_at_ms = Some(999);
            match decide(Some(&found), &meta(3), D) {
                Decision::Start { rec, lost } => {
                    assert!(!lost);
                    assert_eq!(rec.state, TaskState::Running);
                    assert_eq!(rec.attempt, 2);
                    assert_eq!(rec.worker.as_deref(), Some("w1"));
                    assert_eq!(rec.ready_seq, Some(7));
                    assert_eq!(rec.started_at_ms, Some(1000));
                    assert_eq!(rec.next_retry_at_ms, None, "cleared when running");
                }
                other => panic!("{state}: {other:?}"),
            }
        }
    }

    #[test]
    fn finished_tasks_are_not_run_again() {
        assert_eq!(
            decide(Some(&with(TaskState::Succeeded, 1, Some(7))), &meta(3), D),
            Decision::AckDuplicate
        );
        let mut dead = with(TaskState::Dead, 3, Some(7));
        dead.last_error = Some(ErrorInfo {
            detail: None,
            class: "io".into(),
            message: "x".into(),
        });
        assert_eq!(
            decide(Some(&dead), &meta(3), D),
            Decision::FinishDead(dead.last_error.clone().unwrap())
        );
        dead.last_error = None;
        assert!(matches!(
            decide(Some(&dead), &meta(3), D),
            Decision::FinishDead(ErrorInfo { class, .. }) if class == "dead"
        ));
    }

    #[test]
    fn a_running_task_cancelled_without_its_worker_ends_cancelled_unrun() {
        let mut running = with(TaskState::Running, 1, Some(7));
        running.cancel_requested_at_ms = Some(900);
        match decide(Some(&running), &meta(3), D) {
            Decision::Cancel(rec) => {
                assert_eq!((rec.state, rec.attempt), (TaskState::Cancelled, 1));
                assert_eq!(rec.finished_at_ms, Some(1000));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_message_run_now_replaced_is_retired() {
        for state in [TaskState::Retrying, TaskState::Pending] {
            let mut found = with(state, 1, Some(9));
            found.superseded_seq = Some(7);
            assert_eq!(decide(Some(&found), &meta(3), D), Decision::RetireStray);
            found.superseded_seq = Some(5);
            assert!(matches!(
                decide(Some(&found), &meta(3), D),
                Decision::Start { .. }
            ));
        }
    }

    #[test]
    fn a_stray_copy_of_a_running_task_is_retired() {
        let running = with(TaskState::Running, 1, Some(3));
        assert_eq!(decide(Some(&running), &meta(3), D), Decision::RetireStray);
    }

    #[test]
    fn any_message_of_a_pending_task_starts_it() {
        // Whether or not the record names a message (`ready_seq`, set at submit).
        for named in [Some(3), Some(7), None] {
            let pending = with(TaskState::Pending, 0, named);
            assert!(matches!(
                decide(Some(&pending), &meta(3), D),
                Decision::Start { .. }
            ));
        }
    }

    #[test]
    fn a_running_record_of_this_message_means_a_lost_heartbeat() {
        let running = with(TaskState::Running, 1, Some(7));
        match decide(Some(&running), &meta(3), D) {
            Decision::Start { rec, lost } => {
                assert!(lost);
                assert_eq!(rec.attempt, 2);
                assert_eq!(rec.last_error.unwrap().class, "heartbeat_timeout");
            }
            other => panic!("{other:?}"),
        }
        // A record without `ready_seq` (written by an older worker) counts the same way.
        assert!(matches!(
            decide(Some(&with(TaskState::Running, 1, None)), &meta(3), D),
            Decision::Start { lost: true, .. }
        ));
    }

    #[test]
    fn used_up_attempts_go_dead_with_the_last_error() {
        let mut retrying = with(TaskState::Retrying, 3, Some(7));
        retrying.last_error = Some(ErrorInfo {
            detail: None,
            class: "io".into(),
            message: "reset".into(),
        });
        match decide(Some(&retrying), &meta(3), D) {
            Decision::Dead(rec) => {
                assert_eq!(rec.state, TaskState::Dead);
                assert_eq!(rec.last_error.unwrap().class, "io");
                assert_eq!(rec.finished_at_ms, Some(1000));
            }
            other => panic!("{other:?}"),
        }
        // The last attempt lost its heartbeat: dead with that as the reason.
        match decide(Some(&with(TaskState::Running, 3, Some(7))), &meta(3), D) {
            Decision::Dead(rec) => assert_eq!(rec.last_error.unwrap().class, "heartbeat_timeout"),
            other => panic!("{other:?}"),
        }
        match decide(Some(&with(TaskState::Pending, 3, None)), &meta(3), D) {
            Decision::Dead(rec) => assert_eq!(rec.last_error.unwrap().class, "attempts_exhausted"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unknown_fields_are_carried_into_the_decision() {
        let mut found = with(TaskState::Pending, 0, None);
        found
            .extra
            .insert("owner".into(), serde_json::json!("billing"));
        match decide(Some(&found), &meta(3), D) {
            Decision::Start { rec, .. } => assert_eq!(rec.extra["owner"], "billing"),
            other => panic!("{other:?}"),
        }
    }
}
