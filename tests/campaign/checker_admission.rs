//! Admission rules, from what the producer saw (each submit's first send and answer) and
//! the tasks' final records:
//!
//! - **singleton refusals**: a `cancel_new` refusal names a task of its key that had not
//!   ended when the refused submit was first sent (its terminal record was stored later,
//!   or it never finished); or one never stored, and then every refusal naming it falls
//!   within its grace. Ended is when the broker stored the terminal record, not the
//!   record's `finished_at_ms` (the worker's clock before its write, which a loaded broker
//!   may store tens of ms later): a server can only see an end that is stored;
//! - **singleton exclusion**: of one key, a task accepted after another was answered
//!   accepted finds that one ended or its cancel requested by the time it is answered —
//!   two tasks of a key never wait or run at once, whatever servers were killed (submits
//!   in flight together are not compared: their order is the broker's); and no attempt of
//!   the earlier one starts after (the journal), but for a start that a worker `SIGSTOP`ped
//!   between the attempt's start and its handler's first line made as it resumed (within
//!   [`CAP_RESUME_SLACK_MS`] of its `SIGCONT`): no process can be stopped from running its
//!   next line, so such an attempt's outcome must be refused instead (its fencing token is
//!   stale): no record of it — its worker and attempt — ever ends the task;
//! - **dropped rate**: in any span `[t1, t2]`, the accepted submits sent and answered
//!   within it (their tokens were taken in it) are at most `burst + rate × (t2 − t1)`; a
//!   `rate_limited` refusal's `retry_after_ms` is at most one token's interval.

use crate::admission::{Admitted, SingletonNote};
use crate::checker::{Histories, Invocation, StoredAt};
use crate::checker_limits::{started_on_resume, CAP_RESUME_SLACK_MS};
use crate::cluster::Timeline;
use ax_core::protocol::ErrorCode;
use std::collections::{BTreeMap, HashMap};

/// A key naming a task that was never stored (its server died between the claim and the
/// store) holds for `ax_core::singleton::GRACE` (10 s) from the claim: every refusal naming
/// it falls within that span, plus a second for the claim's own time.
const UNSTORED_SPAN_MS: u64 = 11_000;

/// When a task ended for good: the first of its final terminal records was stored (its
/// `finished_at_ms` where that time is not known). `None`: its final record is not
/// terminal.
fn ended_ms(histories: &Histories, stored: &StoredAt, id: &str) -> Option<u64> {
    let history = histories.get(id)?;
    let (_, last) = history.last()?;
    let finished = last.finished_at_ms.filter(|_| last.state.is_terminal())?;
    let first_terminal = history
        .iter()
        .rev()
        .take_while(|(_, r)| r.state.is_terminal())
        .last()
        .map(|(rev, _)| *rev)?;
    Some(stored.get(&first_terminal).copied().unwrap_or(finished))
}

/// When a task stopped holding its key by its final record: ended, or its cancel requested
/// (a running attempt whose worker is stopped ends when it wakes). `None`: never.
fn released_ms(histories: &Histories, stored: &StoredAt, id: &str) -> Option<u64> {
    let (_, rec) = histories.get(id)?.last()?;
    match (ended_ms(histories, stored, id), rec.cancel_requested_at_ms) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

pub fn check_singletons(
    notes: &[SingletonNote],
    histories: &Histories,
    stored: &StoredAt,
    journal: &HashMap<String, Vec<Invocation>>,
    timeline: &Timeline,
) -> Vec<String> {
    let mut out = Vec::new();
    let mut unstored: BTreeMap<&str, Vec<&Admitted>> = BTreeMap::new();
    let key_of: HashMap<&str, &str> = notes
        .iter()
        .filter_map(|n| {
            n.seen
                .outcome
                .as_ref()
                .ok()
                .map(|id| (id.as_str(), n.key.as_str()))
        })
        .collect();
    for n in notes {
        let Err(e) = &n.seen.outcome else { continue };
        if e.code != ErrorCode::Running {
            continue;
        }
        let Some(holder) = e.task_id.as_deref() else {
            out.push(format!(
                "singleton {}: a running refusal names no task",
                n.key
            ));
            continue;
        };
        if key_of.get(holder).is_some_and(|k| *k != n.key) {
            out.push(format!(
                "singleton {}: refused naming {holder}, a task of key {}",
                n.key, key_of[holder]
            ));
        }
        if !histories.contains_key(holder) {
            // Never stored (its server died after claiming the key): it holds for the
            // grace only, checked below over all the refusals naming it.
            unstored.entry(holder).or_default().push(&n.seen);
            continue;
        }
        // Ended, not merely asked to stop: a holder whose cancel was requested (its worker
        // frozen) still holds until its attempt ends or a new submit takes the key.
        if let Some(at) = ended_ms(histories, stored, holder) {
            if at < n.seen.first_sent_ms {
                out.push(format!(
                    "singleton {}: refused (sent at {}) naming {holder}, which had ended at {at}",
                    n.key, n.seen.first_sent_ms
                ));
            }
        }
    }
    for (holder, refusals) in unstored {
        let last_sent = refusals.iter().map(|r| r.first_sent_ms).max().unwrap_or(0);
        let first_answered = refusals.iter().map(|r| r.answered_ms).min().unwrap_or(0);
        let span = last_sent.saturating_sub(first_answered);
        if span > UNSTORED_SPAN_MS {
            out.push(format!(
                "singleton: {} refusals name {holder}, which was never stored, over {span} ms (more than its grace)",
                refusals.len()
            ));
        }
    }
    // Exclusion, per key.
    let mut accepted: BTreeMap<&str, Vec<(&Admitted, &str)>> = BTreeMap::new();
    for n in notes {
        if let Ok(id) = &n.seen.outcome {
            accepted.entry(&n.key).or_default().push((&n.seen, id));
        }
    }
    for (key, tasks) in accepted {
        for (b, b_id) in &tasks {
            for (a, a_id) in &tasks {
                if a_id == b_id || a.answered_ms >= b.first_sent_ms {
                    continue;
                }
                // Released before b was answered: no attempt of it starts after, but a
                // stopped worker's as it resumed, whose outcome no record holds.
                for run in journal.get(*a_id).into_iter().flatten() {
                    if run.start_ms > b.answered_ms
                        && started_on_resume(timeline, run, CAP_RESUME_SLACK_MS)
                    {
                        if let Some(state) = recorded_by(histories, a_id, run) {
                            out.push(format!(
                                "singleton {key}: {a_id}'s attempt {} started late on worker {} as it resumed, and its outcome was recorded ({state:?})",
                                run.attempt, run.worker
                            ));
                        }
                    } else if run.start_ms > b.answered_ms {
                        out.push(format!(
                            "singleton {key}: {a_id} started (attempt {}, worker {}) {} ms after {b_id} took its key",
                            run.attempt,
                            run.worker,
                            run.start_ms - b.answered_ms
                        ));
                    }
                }
                match released_ms(histories, stored, a_id) {
                    Some(at) if at <= b.answered_ms => {}
                    at => out.push(format!(
                        "singleton {key}: {b_id} accepted at {} while {a_id} (accepted at {}) still held the key (released: {at:?})",
                        b.answered_ms, a.answered_ms
                    )),
                }
            }
        }
    }
    out
}

/// The terminal state a record of `run` (its worker, its attempt) gave task `id`, if any.
fn recorded_by(histories: &Histories, id: &str, run: &Invocation) -> Option<ax_sdk::TaskState> {
    histories.get(id)?.iter().find_map(|(_, r)| {
        (r.state.is_terminal()
            && r.worker.as_deref() == Some(run.worker.as_str())
            && r.attempt == run.attempt)
            .then_some(r.state)
    })
}

/// The dropping limit's rule; also the largest count over its bound's `burst` part (how
/// tight the spans came), printed.
pub fn check_drops(drops: &[Admitted], rate: f64, burst: u32) -> (Vec<String>, f64) {
    let mut out = Vec::new();
    let interval_ms = 1000.0 / rate;
    for d in drops {
        if let Err(e) = &d.outcome {
            if e.code == ErrorCode::RateLimited {
                match e.retry_after_ms {
                    Some(ms) if (ms as f64) <= interval_ms + 1.0 => {}
                    other => out.push(format!(
                        "dropped: a refusal's retry_after_ms {other:?} is over one interval ({interval_ms} ms)"
                    )),
                }
            }
        }
    }
    let mut spans: Vec<(u64, u64)> = drops
        .iter()
        .filter(|d| d.outcome.is_ok())
        .map(|d| (d.first_sent_ms, d.answered_ms))
        .collect();
    spans.sort();
    let mut tightest = f64::MIN;
    for (i, &(t1, _)) in spans.iter().enumerate() {
        let mut ends: Vec<u64> = spans[i..].iter().map(|&(_, a)| a).collect();
        ends.sort();
        for (k, &t2) in ends.iter().enumerate() {
            let count = (k + 1) as f64;
            let bound = f64::from(burst) + rate * (t2 - t1) as f64 / 1000.0;
            tightest = tightest.max(count - bound + f64::from(burst));
            if count > bound + 1e-6 {
                out.push(format!(
                    "dropped: {} submits accepted within [{t1}, {t2}] ({} ms), over burst + rate × w = {bound:.2}",
                    k + 1,
                    t2 - t1
                ));
                break;
            }
        }
    }
    (out, tightest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ax_core::protocol::WireError;
    use serde_json::json;

    fn history(id: &str, state: &str, finished: Option<u64>) -> Vec<(u64, ax_sdk::TaskRecord)> {
        let rec = serde_json::from_value(json!({"id": id, "queue": "x", "name": "skeyed",
            "priority": "normal", "state": state, "attempt": 1, "max_attempts": 5,
            "created_at_ms": 0, "updated_at_ms": 0, "finished_at_ms": finished}))
        .unwrap();
        vec![(1, rec)]
    }

    fn note(key: &str, sent: u64, answered: u64, outcome: Result<&str, &str>) -> SingletonNote {
        SingletonNote {
            key: key.into(),
            cancel_in_progress: false,
            seen: Admitted {
                first_sent_ms: sent,
                answered_ms: answered,
                outcome: outcome.map(str::to_string).map_err(|holder| {
                    let mut e = WireError::new(ErrorCode::Running, "held");
                    e.task_id = Some(holder.to_string());
                    e
                }),
            },
        }
    }

    #[test]
    fn two_live_tasks_of_a_key_and_a_refusal_for_an_ended_holder_are_caught() {
        let calm = Timeline::default();
        let histories = Histories::from([
            ("x.a".to_string(), history("x.a", "succeeded", Some(2000))),
            ("x.b".to_string(), history("x.b", "succeeded", Some(4000))),
        ]);
        let none = StoredAt::new();
        let mut journal = HashMap::new();
        // a held the key until 2000; b accepted after; a refusal at 1500 named a.
        let fine = [
            note("s0", 0, 10, Ok("x.a")),
            note("s0", 1500, 1510, Err("x.a")),
            note("s0", 1990, 2100, Ok("x.b")),
        ];
        assert!(check_singletons(&fine, &histories, &none, &journal, &calm).is_empty());
        // An attempt of a starting after b took the key.
        let late_start = Invocation {
            attempt: 2,
            start_ms: 2500,
            worker: "x0".into(),
            ..Default::default()
        };
        journal.insert("x.a".to_string(), vec![late_start]);
        assert_eq!(
            check_singletons(&fine, &histories, &none, &journal, &calm).len(),
            1
        );
        journal.clear();
        // b accepted while a still held the key.
        let both = [
            note("s0", 0, 10, Ok("x.a")),
            note("s0", 1000, 1010, Ok("x.b")),
        ];
        assert_eq!(
            check_singletons(&both, &histories, &none, &journal, &calm).len(),
            1
        );
        // A refusal sent after a had ended, naming it.
        let late = [
            note("s0", 0, 10, Ok("x.a")),
            note("s0", 2500, 2510, Err("x.a")),
        ];
        assert_eq!(
            check_singletons(&late, &histories, &none, &journal, &calm).len(),
            1
        );
        // A holder asked to stop (its worker frozen) still holds: a refusal naming it is
        // fine, and a task accepted after its cancel was requested too.
        let mut frozen = history("x.f", "running", None);
        frozen[0].1.cancel_requested_at_ms = Some(1000);
        let histories = Histories::from([("x.f".to_string(), frozen)]);
        let asked = [
            note("s2", 0, 10, Ok("x.f")),
            note("s2", 1500, 1510, Err("x.f")),
            note("s2", 1600, 1700, Ok("x.g")),
        ];
        assert!(check_singletons(&asked, &histories, &none, &journal, &calm).is_empty());
        // Refusals naming a task never stored: within the grace, then past it.
        let grace = [
            note("s1", 100, 110, Err("x.gone")),
            note("s1", 9000, 9010, Err("x.gone")),
        ];
        assert!(check_singletons(&grace, &histories, &none, &journal, &calm).is_empty());
        let past = [
            note("s1", 100, 110, Err("x.gone")),
            note("s1", 12000, 12010, Err("x.gone")),
        ];
        assert_eq!(
            check_singletons(&past, &histories, &none, &journal, &calm).len(),
            1
        );
    }

    /// An attempt of an ended holder starting after the next task took the key: caught,
    /// unless its worker was stopped and it started as the worker resumed — and then only
    /// if a record of that attempt ended the task (its outcome should have been refused).
    #[test]
    fn a_resumed_worker_s_late_start_counts_only_if_its_outcome_was_recorded() {
        let mut a = history("x.a", "running", None);
        a.extend(history("x.a", "succeeded", Some(2000)));
        a[1].0 = 2;
        a[1].1.attempt = 2;
        a[1].1.worker = Some("x1".into());
        let histories = Histories::from([("x.a".to_string(), a)]);
        let none = StoredAt::new();
        let fine = [
            note("s0", 0, 10, Ok("x.a")),
            note("s0", 2100, 2200, Ok("x.b")),
        ];
        // Attempt 1 on x0, stopped from 900 to 3000, starts its handler at 3004.
        let zombie = Invocation {
            attempt: 1,
            start_ms: 3004,
            worker: "x0".into(),
            ..Default::default()
        };
        let journal = HashMap::from([("x.a".to_string(), vec![zombie])]);
        let calm = Timeline::default();
        assert_eq!(
            check_singletons(&fine, &histories, &none, &journal, &calm).len(),
            1,
            "no stop: a late start"
        );
        let stopped = Timeline {
            stops: vec![("x0".into(), 900, 3000)],
            ..Default::default()
        };
        assert!(
            check_singletons(&fine, &histories, &none, &journal, &stopped).is_empty(),
            "started as it resumed, its outcome refused"
        );
        let elsewhere = Timeline {
            stops: vec![("x1".into(), 900, 3000)],
            ..Default::default()
        };
        assert_eq!(
            check_singletons(&fine, &histories, &none, &journal, &elsewhere).len(),
            1,
            "another worker's stop excuses nothing"
        );
        let long_after = Timeline {
            stops: vec![("x0".into(), 900, 2500)],
            ..Default::default()
        };
        assert_eq!(
            check_singletons(&fine, &histories, &none, &journal, &long_after).len(),
            1,
            "started 504 ms after its resume: not the stop's doing"
        );
        // The zombie's outcome recorded: caught even so.
        let mut recorded = histories.clone();
        let last = &mut recorded.get_mut("x.a").unwrap()[1].1;
        last.attempt = 1;
        last.worker = Some("x0".into());
        assert_eq!(
            check_singletons(&fine, &recorded, &none, &journal, &stopped).len(),
            1,
            "a late attempt's outcome recorded"
        );
    }

    /// A holder ends when its terminal record is stored, not at its `finished_at_ms`: a
    /// refusal sent between the two is fine, one sent after the store is caught.
    #[test]
    fn a_holder_ends_when_its_terminal_record_is_stored() {
        let calm = Timeline::default();
        let mut a = history("x.a", "running", None);
        a.extend(history("x.a", "succeeded", Some(2000)));
        a[1].0 = 2;
        let histories = Histories::from([("x.a".to_string(), a)]);
        let stored = StoredAt::from([(1, 100), (2, 2600)]);
        let journal = HashMap::new();
        let between = [
            note("s0", 0, 10, Ok("x.a")),
            note("s0", 2500, 2510, Err("x.a")),
        ];
        assert!(check_singletons(&between, &histories, &stored, &journal, &calm).is_empty());
        let none = StoredAt::new();
        assert_eq!(
            check_singletons(&between, &histories, &none, &journal, &calm).len(),
            1
        );
        let after = [
            note("s0", 0, 10, Ok("x.a")),
            note("s0", 2700, 2710, Err("x.a")),
        ];
        assert_eq!(
            check_singletons(&after, &histories, &stored, &journal, &calm).len(),
            1
        );
        // Accepted before the store: a still held the key.
        let early = [
            note("s0", 0, 10, Ok("x.a")),
            note("s0", 2100, 2200, Ok("x.b")),
        ];
        assert_eq!(
            check_singletons(&early, &histories, &stored, &journal, &calm).len(),
            1
        );
    }

    fn drop_note(sent: u64, answered: u64, accepted: bool) -> Admitted {
        Admitted {
            first_sent_ms: sent,
            answered_ms: answered,
            outcome: if accepted {
                Ok(format!("x.{sent}"))
            } else {
                let mut e = WireError::new(ErrorCode::RateLimited, "over");
                e.retry_after_ms = Some(250);
                Err(e)
            },
        }
    }

    #[test]
    fn accepted_drops_over_the_bound_are_caught() {
        // Rate 4/s, burst 3: 3 at once, then one per 250 ms.
        let fine: Vec<Admitted> = [0, 1, 2, 250, 500, 750]
            .iter()
            .map(|&t| drop_note(t, t + 5, true))
            .chain([drop_note(3, 8, false)])
            .collect();
        let (v, _) = check_drops(&fine, 4.0, 3);
        assert!(v.is_empty(), "{v:?}");
        // A fourth inside the first 100 ms.
        let over: Vec<Admitted> = [0, 1, 2, 50]
            .iter()
            .map(|&t| drop_note(t, t + 5, true))
            .collect();
        assert!(!check_drops(&over, 4.0, 3).0.is_empty());
        // A refusal that says to wait longer than one interval.
        let mut slow = drop_note(0, 5, false);
        if let Err(e) = &mut slow.outcome {
            e.retry_after_ms = Some(900);
        }
        assert_eq!(check_drops(&[slow], 4.0, 3).0.len(), 1);
    }
}
