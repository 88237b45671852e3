//! How the end of an attempt settles its task: the record to write (under the attempt's
//! fencing token) and what to tell the broker once that write has succeeded. Pure, beside
//! [`decide`](super::claim::decide) for the claim; `attempt` carries it out.

use crate::output::StoredOutput;
use crate::state::{ErrorInfo, TaskRecord, TaskState};
use crate::task::TaskMeta;
use std::time::Duration;

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum End {
    /// The handler returned; its output as the record names it, if any.
    Succeeded(Option<StoredOutput>),
    /// The handler failed: returned an error, panicked, ran out of time, or returned an
    /// output too large to store. `permanent`: never retried.
    Failed { error: ErrorInfo, permanent: bool },
    /// An operator cancelled the task while it ran.
    Cancelled,
    /// The attempt's concurrency slot expired under it (the worker stalled past the ack
    /// wait): the handler was stopped so the cap holds.
    SlotLost,
    /// The worker shut down and its grace ended before the handler did.
    Shutdown,
}

/// What the broker is told once the record is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    /// Acknowledge: the task is finished.
    Ack,
    /// Deliver again after this delay (`None`: at once).
    Nak(Option<Duration>),
    /// Publish a dead letter, then terminate the message.
    DeadLetter,
}

/// The record an attempt's end writes and what follows it. `now_ms` is the time of the
/// write; `retry_delay` the task's backoff for this attempt (used only for a retry).
pub(crate) fn settle(
    meta: &TaskMeta,
    rec: TaskRecord,
    end: End,
    now_ms: u64,
    retry_delay: Duration,
) -> (TaskRecord, After) {
    let handed_back = |rec: TaskRecord, class: &str, message: &str| {
        let mut back = rec.transition_at(TaskState::Retrying, now_ms);
        back.last_error = Some(ErrorInfo {
            detail: None,
            class: class.into(),
            message: message.into(),
        });
        back.next_retry_at_ms = Some(now_ms);
        (back, After::Nak(None))
    };
    match end {
        End::Succeeded(output) => {
            let mut done = rec.transition_at(TaskState::Succeeded, now_ms);
            done.output = output;
            (done, After::Ack)
        }
        End::Failed { error, permanent } => {
            let retry =
                !permanent && meta.retryable(&error.class) && rec.attempt < meta.max_attempts;
            if !retry {
                let mut dead = rec.transition_at(TaskState::Dead, now_ms);
                dead.last_error = Some(error);
                return (dead, After::DeadLetter);
            }
            let mut next = rec.transition_at(TaskState::Retrying, now_ms);
            next.last_error = Some(error);
            next.next_retry_at_ms = Some(now_ms + retry_delay.as_millis() as u64);
            (next, After::Nak(Some(retry_delay)))
        }
        End::Cancelled => {
            let mut cancelled = rec.transition_at(TaskState::Cancelled, now_ms);
            cancelled.last_error = Some(ErrorInfo {
                detail: None,
                class: "cancelled".into(),
                message: "cancelled by an operator while running".into(),
            });
            (cancelled, After::Ack)
        }
        End::SlotLost => handed_back(
            rec,
            "slot_lost",
            "the attempt's concurrency slot expired (the worker stalled past the ack wait): \
             attempt stopped",
        ),
        End::Shutdown => handed_back(rec, "shutdown", "worker shut down during the attempt"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::SubmitRequest;
    use crate::task::Limits;

    fn meta(max_attempts: u32, no_retry_on: &[&str]) -> TaskMeta {
        let req: SubmitRequest = serde_json::from_value(serde_json::json!({
            "name": "t", "max_attempts": max_attempts, "no_retry_on": no_retry_on,
        }))
        .unwrap();
        TaskMeta::from_request("q", req, &Limits::default())
            .unwrap()
            .0
    }

    fn running(meta: &TaskMeta, attempt: u32) -> TaskRecord {
        let mut rec = meta.record().transition_at(TaskState::Running, 1_000);
        rec.attempt = attempt;
        rec
    }

    fn failed(class: &str, permanent: bool) -> End {
        End::Failed {
            error: ErrorInfo {
                class: class.into(),
                message: "m".into(),
                detail: None,
            },
            permanent,
        }
    }

    const DELAY: Duration = Duration::from_millis(1_500);

    #[test]
    fn a_success_writes_succeeded_with_its_output_and_acks() {
        let m = meta(3, &[]);
        let (rec, after) = settle(&m, running(&m, 1), End::Succeeded(None), 2_000, DELAY);
        assert_eq!((rec.state, after), (TaskState::Succeeded, After::Ack));
        assert_eq!((rec.updated_at_ms, rec.output), (2_000, None));
    }

    #[test]
    fn a_retryable_failure_before_the_last_attempt_retries_after_its_backoff() {
        let m = meta(3, &[]);
        let (rec, after) = settle(&m, running(&m, 2), failed("io", false), 2_000, DELAY);
        assert_eq!(rec.state, TaskState::Retrying);
        assert_eq!(after, After::Nak(Some(DELAY)));
        assert_eq!(rec.next_retry_at_ms, Some(3_500));
        assert_eq!(rec.last_error.unwrap().class, "io");
    }

    #[test]
    fn the_last_attempt_a_permanent_error_or_a_class_not_retried_is_dead() {
        let m = meta(3, &["validation"]);
        for (attempt, end) in [
            (3, failed("io", false)),
            (1, failed("io", true)),
            (1, failed("validation", false)),
        ] {
            let (rec, after) = settle(&m, running(&m, attempt), end.clone(), 2_000, DELAY);
            assert_eq!(
                (rec.state, after),
                (TaskState::Dead, After::DeadLetter),
                "{end:?}"
            );
            assert_eq!(rec.next_retry_at_ms, None);
        }
    }

    #[test]
    fn cancelled_acks_and_a_lost_slot_or_a_shutdown_hands_the_task_back_at_once() {
        let m = meta(3, &[]);
        let (rec, after) = settle(&m, running(&m, 1), End::Cancelled, 2_000, DELAY);
        assert_eq!((rec.state, after), (TaskState::Cancelled, After::Ack));
        for (end, class) in [(End::SlotLost, "slot_lost"), (End::Shutdown, "shutdown")] {
            let (rec, after) = settle(&m, running(&m, 1), end, 2_000, DELAY);
            assert_eq!((rec.state, after), (TaskState::Retrying, After::Nak(None)));
            assert_eq!(rec.next_retry_at_ms, Some(2_000));
            assert_eq!(rec.last_error.unwrap().class, class);
        }
    }
}
