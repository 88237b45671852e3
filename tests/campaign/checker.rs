//! The campaign's checker: pure functions over what the run observed (the journal the
//! handlers wrote, every revision of every task record, trigger states, the producer's
//! log). Each returns the violations it finds, as sentences.

use ax_sdk::{TaskRecord, TaskState};
use std::collections::{BTreeMap, HashMap, HashSet};

/// One handler invocation, from the journal.
#[derive(Debug, Clone, Default)]
pub struct Invocation {
    pub attempt: u32,
    pub token: u64,
    /// `ok`, `err:<class>`, `stopped`, or `None` if it never ended (its worker was killed).
    pub outcome: Option<String>,
    /// The worker that ran it (its `--id`).
    pub worker: String,
    /// Task name.
    pub name: String,
    /// When the handler started and ended, ms since the epoch.
    pub start_ms: u64,
    pub end_ms: Option<u64>,
    /// The `item` of each element of a batch's list (`None`: not a batch).
    pub items: Option<Vec<String>>,
}

/// Parses the journal: invocations by task id, in file order. Torn lines are skipped.
pub fn parse_journal(text: &str) -> HashMap<String, Vec<Invocation>> {
    let mut out: HashMap<String, Vec<Invocation>> = HashMap::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(id), Some(token)) = (v["id"].as_str(), v["token"].as_u64()) else {
            continue;
        };
        let runs = out.entry(id.to_string()).or_default();
        match v["event"].as_str() {
            Some("start") => runs.push(Invocation {
                attempt: v["attempt"].as_u64().unwrap_or(0) as u32,
                token,
                outcome: None,
                worker: v["worker"].as_str().unwrap_or_default().to_string(),
                name: v["name"].as_str().unwrap_or_default().to_string(),
                start_ms: v["at_ms"].as_u64().unwrap_or(0),
                end_ms: None,
                items: v["items"].as_array().map(|items| {
                    items
                        .iter()
                        .map(|i| i.as_str().unwrap_or("?").to_string())
                        .collect()
                }),
            }),
            Some("end") => {
                // Matched by token, attempt and worker: invocations that never asked for a
                // token all journal token 0, a paused one may end after a later one
                // started, and a first attempt lost within its first second runs again as
                // the same attempt on another worker (docs/RELIABILITY.md).
                let attempt = v["attempt"].as_u64().map(|a| a as u32);
                let worker = v["worker"].as_str();
                if let Some(run) = runs.iter_mut().rev().find(|r| {
                    r.token == token
                        && attempt.is_none_or(|a| a == r.attempt)
                        && worker.is_none_or(|w| w == r.worker)
                }) {
                    run.outcome = v["outcome"].as_str().map(str::to_string);
                    run.end_ms = v["at_ms"].as_u64();
                }
            }
            _ => {}
        }
    }
    out
}

/// Every stored revision of every record, oldest first, by task id.
pub type Histories = BTreeMap<String, Vec<(u64, TaskRecord)>>;

/// When each record revision was stored (the broker's timestamp, ms since the epoch), by
/// revision.
pub type StoredAt = HashMap<u64, u64>;

/// The wait tasks of task name `name` (a flow's waits, which the server ends, never a
/// worker), each with its one final record, and how many there are. What breaks "ends
/// once, never on a worker" is pushed to `v` — a worker started it, it never ended, it
/// ended more than once (`what` names it: "a sleep") — and such a task is left out.
pub fn wait_ends<'a>(
    histories: &'a Histories,
    journal: &HashMap<String, Vec<Invocation>>,
    name: &str,
    what: &str,
    v: &mut Vec<String>,
) -> (Vec<(&'a String, &'a TaskRecord)>, usize) {
    let mut out = Vec::new();
    let mut judged = 0;
    for (id, history) in histories {
        let Some((_, last)) = history.last() else {
            continue;
        };
        if last.name != name {
            continue;
        }
        judged += 1;
        if journal.get(id).is_some_and(|starts| !starts.is_empty()) {
            v.push(format!("{id}: a worker ran {what}"));
        }
        let ends: Vec<&TaskRecord> = history
            .iter()
            .map(|(_, r)| r)
            .filter(|r| r.state.is_terminal())
            .collect();
        match ends.as_slice() {
            [] => v.push(format!("{id}: {what} never ended (last {})", last.state)),
            [end] => out.push((id, *end)),
            more => v.push(format!("{id}: {what} ended {} times", more.len())),
        }
    }
    (out, judged)
}

/// A record history in one line, for a violation's message: `rev:state/attempt[op by
/// worker]` per revision.
fn brief(history: &[(u64, TaskRecord)]) -> String {
    history
        .iter()
        .map(|(rev, r)| {
            let op =
                r.op.as_ref()
                    .map_or(String::new(), |o| format!(" {}", o.op));
            let worker = r.worker.as_deref().unwrap_or("-");
            format!("{rev}:{}/{}{op} {worker}", r.state, r.attempt)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A `cancelled` record written again by the same cancel to count an attempt that a
/// worker holding the task's message had started (docs/PROTOCOL.md §8, "cancel": the
/// second signal after the write): the one outcome, counted right, not a second.
fn recount(before: &TaskRecord, after: &TaskRecord) -> bool {
    before.state == TaskState::Cancelled
        && after.state == TaskState::Cancelled
        && after.op.is_some()
        && after.op == before.op
        && after.attempt > before.attempt
}

/// Every accepted task reached a final state; none has two recorded outcomes (unless an
/// operator's retry reopened a dead one in between); a success is backed by a successful
/// invocation under the token it was recorded with.
pub fn check_tasks(
    accepted: &HashSet<String>,
    histories: &Histories,
    journal: &HashMap<String, Vec<Invocation>>,
) -> Vec<String> {
    let mut v = Vec::new();
    for id in accepted {
        match histories.get(id).and_then(|h| h.last()) {
            None => v.push(format!("{id}: accepted but no record")),
            Some((_, rec)) if !rec.state.is_terminal() => {
                v.push(format!("{id}: accepted but still {}", rec.state))
            }
            _ => {}
        }
    }
    for (id, history) in histories {
        // Lives: an operator's retry (`pending` with `op` retry right after `dead`) starts a
        // new one; each has at most one outcome, and nothing follows it.
        let mut start = 0;
        for i in 1..=history.len() {
            let reopened = history.get(i).is_some_and(|(_, r)| {
                history[i - 1].1.state == TaskState::Dead
                    && r.state == TaskState::Pending
                    && r.op.as_ref().is_some_and(|op| op.op == "retry")
            });
            if i < history.len() && !reopened {
                continue;
            }
            let life = &history[start..i];
            let terminal: Vec<usize> = life
                .iter()
                .enumerate()
                .filter(|(j, (_, r))| {
                    r.state.is_terminal() && !(*j > 0 && recount(&life[j - 1].1, r))
                })
                .map(|(i, _)| i)
                .collect();
            if terminal.len() > 1 {
                v.push(format!(
                    "{id}: {} recorded outcomes ({})",
                    terminal.len(),
                    brief(history)
                ));
            }
            let after_outcome = terminal.first().map_or(&life[..0], |&i| &life[i..]);
            if after_outcome.windows(2).any(|w| !recount(&w[0].1, &w[1].1)) {
                v.push(format!(
                    "{id}: a transition after its outcome ({})",
                    brief(history)
                ));
            }
            start = i;
        }
        let Some((_, last)) = history.last() else {
            continue;
        };
        // A flow's waits (a sleep, a wait for an event, an approval, a child flow) are
        // ended by the server, never by a worker: their own rules
        // (`checker_flows::check_sleeps`, `check_waits`, `check_approvals`,
        // `check_children`) judge them.
        let wait = [
            ax_sdk::flow::SLEEP_TASK,
            ax_sdk::flow::WAIT_FOR_EVENT_TASK,
            ax_sdk::flow::APPROVAL_TASK,
            ax_sdk::flow::CHILD_FLOW_TASK,
        ];
        if last.state == TaskState::Succeeded && !wait.contains(&last.name.as_str()) {
            // The token of the attempt that succeeded: the revision of its `running` write;
            // or, for a first attempt that started without one (docs/PROTOCOL.md §3), the
            // record's creation revision (its `running` write, if it lasted over a second,
            // came later).
            let running = history
                .iter()
                .rposition(|(_, r)| r.state == TaskState::Running);
            let created = history
                .first()
                .filter(|(_, r)| r.attempt == 0)
                .map(|(rev, _)| *rev);
            let mut tokens = Vec::new();
            match running {
                Some(i) => {
                    tokens.push(history[i].0);
                    if i == 1 && history[i].1.attempt == 1 {
                        tokens.extend(created);
                    }
                }
                None => tokens.extend(created),
            }
            let token = tokens.first().copied();
            // An invocation that did not ask for its token journals 0: it backs the
            // success if it is of the same attempt.
            let backed = journal.get(id).is_some_and(|runs| {
                runs.iter().any(|r| {
                    r.outcome.as_deref() == Some("ok")
                        && (tokens.contains(&r.token)
                            || (r.token == 0 && r.attempt == last.attempt))
                })
            });
            if !backed {
                let states: Vec<String> = history
                    .iter()
                    .map(|(rev, r)| format!("{rev}:{}#{}", r.state, r.attempt))
                    .collect();
                let runs: Vec<String> = journal.get(id).map_or(Vec::new(), |runs| {
                    runs.iter()
                        .map(|r| format!("#{}@{}={:?}", r.attempt, r.token, r.outcome))
                        .collect()
                });
                v.push(format!(
                    "{id}: succeeded without a successful invocation under token {token:?} (history {states:?}, invocations {runs:?})"
                ));
            }
        }
    }
    v
}

/// Per task, fencing tokens only grow with the attempt number, and no attempt ran twice.
/// Only invocations that asked for their token are checked (a first attempt that did not
/// and was lost is not counted as an attempt, so its redelivery is attempt 1 again).
pub fn check_tokens(journal: &HashMap<String, Vec<Invocation>>) -> Vec<String> {
    let mut v = Vec::new();
    for (id, runs) in journal {
        let mut by_attempt: BTreeMap<u32, u64> = BTreeMap::new();
        // Invocations that never asked for a token (journalled as 0) have none to check.
        for r in runs.iter().filter(|r| r.token != 0) {
            if let Some(old) = by_attempt.insert(r.attempt, r.token) {
                v.push(format!(
                    "{id}: attempt {} ran twice (tokens {old} and {})",
                    r.attempt, r.token
                ));
            }
        }
        let tokens: Vec<u64> = by_attempt.values().copied().collect();
        if tokens.windows(2).any(|w| w[1] <= w[0]) {
            v.push(format!(
                "{id}: fencing tokens do not grow with attempts: {by_attempt:?}"
            ));
        }
    }
    v
}

/// How long a first attempt (or a retry) may run before its `running` write
/// (`FIRST_WRITE_AFTER` in the worker).
pub const FIRST_WRITE_MS: u64 = 1_000;

/// Every handler start is of an attempt its task's record counts: the record exists and
/// its attempt is at least the journal's. A start the records do not count (a task run
/// again after it ended, a fire made twice) is what deterministic ids would hide. Left
/// out: a start without a token whose worker was killed or stopped within
/// [`FIRST_WRITE_MS`] of it — an attempt lost before its `running` write is not counted
/// (docs/RELIABILITY.md, "An attempt lost within its first second is not counted"), and
/// a cancel made meanwhile records none.
pub fn check_counted(
    journal: &HashMap<String, Vec<Invocation>>,
    histories: &Histories,
    timeline: &crate::cluster::Timeline,
) -> Vec<String> {
    let lost_unwritten = |r: &Invocation| {
        let soon = |at: u64| at >= r.start_ms && at < r.start_ms + FIRST_WRITE_MS;
        r.token == 0
            && (timeline
                .kills
                .iter()
                .any(|(w, at)| *w == r.worker && soon(*at))
                || timeline
                    .stops
                    .iter()
                    .any(|(w, at, _)| *w == r.worker && soon(*at)))
    };
    let mut v = Vec::new();
    for (id, runs) in journal {
        let Some(most) = runs
            .iter()
            .filter(|r| !lost_unwritten(r))
            .map(|r| r.attempt)
            .max()
        else {
            continue;
        };
        match histories.get(id).and_then(|h| h.last()) {
            None => v.push(format!(
                "{id}: ran ({} starts) without a record",
                runs.len()
            )),
            Some((_, rec)) if rec.attempt < most => v.push(format!(
                "{id} ({}): a handler started attempt {most}, the record counts {} ({})",
                runs[0].name, rec.attempt, rec.state
            )),
            _ => {}
        }
    }
    v.sort();
    v
}

/// What the campaign knows about one trigger.
pub struct TriggerRun<'a> {
    pub name: &'a str,
    /// `allow`, `skip`, `buffer_one` or `fixed_delay`.
    pub policy: &'a str,
    pub state: &'a serde_json::Value,
    /// When it was paused (the end of the window), ms.
    pub paused_ms: u64,
}

/// Every scheduled time in the window was fired exactly once (or, for `skip` and
/// `buffer_one`, accounted as skipped); no time fired twice.
pub fn check_trigger(t: &TriggerRun<'_>, records: &[&TaskRecord]) -> Vec<String> {
    let mut v = Vec::new();
    let mut times: Vec<u64> = records
        .iter()
        .filter(|r| r.trigger.as_deref() == Some(t.name))
        .filter(|r| r.trigger_source.as_deref() == Some("schedule"))
        .filter_map(|r| r.scheduled_at_ms)
        .collect();
    times.sort();
    let fired = times.len();
    times.dedup();
    if times.len() != fired {
        v.push(format!("{}: a scheduled time fired twice", t.name));
    }
    if t.policy == "fixed_delay" {
        // A run takes about 1.5 s and the next waits 1 s after it: at least one fire per
        // 10 s of window, faults included, or the trigger stalled.
        let window_s = t
            .paused_ms
            .saturating_sub(t.state["created_at_ms"].as_u64().unwrap_or(t.paused_ms))
            / 1000;
        let need = (window_s / 10).max(3) as usize;
        if fired < need {
            v.push(format!(
                "{}: fixed-delay fired {fired} times in {window_s} s (at least {need} expected)",
                t.name
            ));
        }
        return v;
    }
    let state = t.state;
    let scheduled_fires =
        state["fires"].as_u64().unwrap_or(0) - state["manual"].as_u64().unwrap_or(0);
    if scheduled_fires != fired as u64 {
        // Each fire's first task as its record ends (attempts, when created and by whom),
        // so the next occurrence says which fire the state missed.
        let mut made: Vec<String> = records
            .iter()
            .filter(|r| r.trigger.as_deref() == Some(t.name))
            .filter(|r| r.trigger_source.as_deref() == Some("schedule") && r.id.ends_with(".0"))
            .map(|r| {
                format!(
                    "{}:{}/{} created {} by {}",
                    r.scheduled_at_ms.unwrap_or_default(),
                    r.state,
                    r.attempt,
                    r.created_at_ms,
                    r.worker.as_deref().unwrap_or("-")
                )
            })
            .collect();
        made.sort();
        v.push(format!(
            "{}: state counts {scheduled_fires} scheduled fires, {fired} were made (state: last \
             scheduled {}, skipped {}, last fire {}; fires made: {})",
            t.name,
            t.state["last_scheduled_ms"],
            t.state["skipped"],
            t.state["last_fire"],
            made.join(", ")
        ));
    }
    let (Some(created), Some(last)) = (
        state["created_at_ms"].as_u64(),
        state["last_scheduled_ms"].as_u64(),
    ) else {
        v.push(format!("{}: never handled a scheduled time", t.name));
        return v;
    };
    // Fixed rate, every 1 s from one period after creation.
    let grid = (last.saturating_sub(created + 1000)) / 1000 + 1;
    let skipped = state["skipped"].as_u64().unwrap_or(0);
    // A fire buffer_one holds back when the window closed is neither fired nor skipped.
    let buffered = u64::from(state["buffered_ms"].is_u64());
    if scheduled_fires + skipped + buffered != grid {
        v.push(format!(
            "{}: {scheduled_fires} fired + {skipped} skipped + {buffered} buffered != {grid} scheduled times",
            t.name
        ));
    }
    if last + 10_000 < t.paused_ms {
        v.push(format!(
            "{}: the last scheduled time handled was {} ms before the end",
            t.name,
            t.paused_ms - last
        ));
    }
    if t.policy == "allow" {
        if skipped != 0 {
            v.push(format!("{}: overlap allow skipped {skipped} times", t.name));
        }
        if times.windows(2).any(|w| w[1] - w[0] != 1000) {
            v.push(format!("{}: a gap between fires", t.name));
        }
    }
    v
}

/// How long after the next fire's task is made a cancelled run's handler may still be
/// journaled running: the cancel signals it before the fire (the handler stops at once),
/// and the end line is written after.
pub const CANCEL_SLACK_MS: u64 = 500;

/// Overlap `cancel_in_progress`: each run's handler has ended by the time the next fire's
/// task is made (plus [`CANCEL_SLACK_MS`]) — the fire cancelled it first. Not checked where
/// the cancel may rightly have failed and the fire gone anyway (the new fire wins by
/// design): its worker stopped or killed, a broker fault
/// ([`crate::checker_limits::broker_disturbed`]) or an ax server killed (the leader) in
/// the 3 s before the next fire.
pub fn check_cancel_in_progress(
    name: &str,
    records: &[&TaskRecord],
    journal: &HashMap<String, Vec<Invocation>>,
    timeline: &crate::cluster::Timeline,
) -> Vec<String> {
    let mut runs: Vec<&&TaskRecord> = records
        .iter()
        .filter(|r| r.trigger.as_deref() == Some(name))
        .filter(|r| r.trigger_source.as_deref() == Some("schedule"))
        .collect();
    runs.sort_by_key(|r| (r.scheduled_at_ms, r.created_at_ms));
    let mut v = Vec::new();
    for pair in runs.windows(2) {
        let (prev, next) = (pair[0], pair[1]);
        let by = next.created_at_ms + CANCEL_SLACK_MS;
        let from = next.created_at_ms.saturating_sub(3_000);
        let faulted = (from..=by).any(|at| crate::checker_limits::broker_disturbed(timeline, at))
            || timeline
                .servers
                .iter()
                .any(|(_, at)| (from..=by).contains(at));
        if faulted {
            continue;
        }
        for run in journal.get(&prev.id).into_iter().flatten() {
            let interrupted =
                timeline.stops.iter().any(|(w, stop, cont)| {
                    *w == run.worker && *stop <= by && *cont >= run.start_ms
                }) || timeline
                    .kills
                    .iter()
                    .any(|(w, at)| *w == run.worker && *at >= run.start_ms);
            if !interrupted && run.end_ms.is_none_or(|end| end > by) {
                v.push(format!(
                    "{name}: run {} still ran {} ms after the next fire {} (cancel in progress; \
                     the run started {} on {}, ended {:?}, its record ends {:?}; the next fire \
                     was made {} ms after its time)",
                    prev.id,
                    run.end_ms
                        .map_or(u64::MAX, |e| e.saturating_sub(next.created_at_ms)),
                    next.id,
                    run.start_ms,
                    run.worker,
                    run.end_ms,
                    prev.state,
                    next.created_at_ms
                        .saturating_sub(next.scheduled_at_ms.unwrap_or(next.created_at_ms)),
                ));
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_lines_match_their_attempt() {
        // A paused attempt 1 ends after attempt 2, both without a token (0).
        let text = [
            r#"{"event":"start","id":"q.a","attempt":1,"token":0}"#,
            r#"{"event":"start","id":"q.a","attempt":2,"token":0}"#,
            r#"{"event":"end","id":"q.a","attempt":2,"token":0,"outcome":"ok"}"#,
            r#"{"event":"end","id":"q.a","attempt":1,"token":0,"outcome":"err:flaky"}"#,
        ]
        .join("\n");
        let j = parse_journal(&text);
        let outcomes: Vec<_> = j["q.a"].iter().map(|r| r.outcome.clone()).collect();
        assert_eq!(outcomes, [Some("err:flaky".into()), Some("ok".into())]);
    }

    #[test]
    fn end_lines_match_their_worker() {
        // Attempt 1 lost in its first second on w1 (stopped) runs again on w2; w1's ends
        // after w2's.
        let text = [
            r#"{"event":"start","id":"q.a","attempt":1,"token":0,"worker":"w1","at_ms":1}"#,
            r#"{"event":"start","id":"q.a","attempt":1,"token":0,"worker":"w2","at_ms":2}"#,
            r#"{"event":"end","id":"q.a","attempt":1,"token":0,"worker":"w2","outcome":"ok","at_ms":3}"#,
            r#"{"event":"end","id":"q.a","attempt":1,"token":0,"worker":"w1","outcome":"ok","at_ms":9}"#,
        ]
        .join("\n");
        let j = parse_journal(&text);
        let ends: Vec<_> = j["q.a"]
            .iter()
            .map(|r| (r.worker.as_str(), r.end_ms))
            .collect();
        assert_eq!(ends, [("w1", Some(9)), ("w2", Some(3))]);
    }

    #[test]
    fn only_an_operators_retry_reopens_a_dead_task() {
        let rec = |state: &str, attempt: u32, op: Option<&str>| -> TaskRecord {
            let mut v = serde_json::json!({"id": "q.a", "queue": "q", "name": "t",
                "priority": "normal", "state": state, "attempt": attempt, "max_attempts": 5,
                "created_at_ms": 0, "updated_at_ms": 0});
            if let Some(op) = op {
                v["op"] = serde_json::json!({"op": op, "by": "api", "at_ms": 0});
            }
            serde_json::from_value(v).unwrap()
        };
        let life = |reopen: Option<&str>| {
            vec![
                (1, rec("pending", 0, None)),
                (2, rec("running", 1, None)),
                (3, rec("dead", 1, None)),
                (4, rec("pending", 1, reopen)),
                (5, rec("running", 2, None)),
                (6, rec("succeeded", 2, None)),
            ]
        };
        let ok = Invocation {
            attempt: 2,
            outcome: Some("ok".into()),
            ..Default::default()
        };
        let journal = HashMap::from([("q.a".to_string(), vec![ok])]);
        let accepted = HashSet::from(["q.a".to_string()]);
        let retried = Histories::from([("q.a".to_string(), life(Some("retry")))]);
        assert!(check_tasks(&accepted, &retried, &journal).is_empty());
        // Reopened by anything else: two outcomes, and a transition after the first.
        let reopened = Histories::from([("q.a".to_string(), life(Some("run_now")))]);
        assert_eq!(check_tasks(&accepted, &reopened, &journal).len(), 2);
        let unmarked = Histories::from([("q.a".to_string(), life(None))]);
        assert_eq!(check_tasks(&accepted, &unmarked, &journal).len(), 2);
    }

    /// An operator's cancel that learns, signalling again after its write, of an attempt a
    /// worker had started writes `cancelled` again with that attempt: one outcome. A second
    /// `cancelled` by anything else, or one that counts no more, is two.
    #[test]
    fn a_cancel_that_counts_a_started_attempt_is_one_outcome() {
        let rec = |attempt: u32, op_at: Option<u64>| -> TaskRecord {
            let mut v = serde_json::json!({"id": "q.a", "queue": "q", "name": "t",
                "priority": "normal", "state": "cancelled", "attempt": attempt,
                "max_attempts": 5, "created_at_ms": 0, "updated_at_ms": 0});
            if let Some(at) = op_at {
                v["op"] = serde_json::json!({"op": "cancel", "by": "api", "at_ms": at});
            }
            serde_json::from_value(v).unwrap()
        };
        let journal = HashMap::new();
        let accepted = HashSet::from(["q.a".to_string()]);
        let judge = |second: TaskRecord| {
            let h = Histories::from([("q.a".to_string(), vec![(1, rec(0, Some(7))), (2, second)])]);
            check_tasks(&accepted, &h, &journal).len()
        };
        assert_eq!(
            judge(rec(1, Some(7))),
            0,
            "the same cancel, counting attempt 1"
        );
        assert_eq!(
            judge(rec(0, Some(7))),
            2,
            "the same cancel, counting no more"
        );
        assert_eq!(judge(rec(1, Some(9))), 2, "another cancel");
        assert_eq!(judge(rec(1, None)), 2, "no operator");
    }

    #[test]
    fn a_start_its_record_does_not_count_is_caught() {
        let run = |attempt| Invocation {
            attempt,
            ..Default::default()
        };
        let rec: TaskRecord = serde_json::from_value(serde_json::json!({"id": "q.a",
            "queue": "q", "name": "t", "priority": "normal", "state": "cancelled",
            "attempt": 1, "max_attempts": 5, "created_at_ms": 0, "updated_at_ms": 0}))
        .unwrap();
        let histories = Histories::from([("q.a".to_string(), vec![(1, rec)])]);
        let none = crate::cluster::Timeline::default();
        let mut journal = HashMap::from([("q.a".to_string(), vec![run(1)])]);
        assert!(check_counted(&journal, &histories, &none).is_empty());
        journal.insert("q.a".to_string(), vec![run(1), run(2)]);
        journal.insert("q.b".to_string(), vec![run(1)]);
        assert_eq!(check_counted(&journal, &histories, &none).len(), 2);
        // Attempt 2 started unwritten on w, which was stopped 500 ms in: not counted,
        // not a violation; stopped 1.5 s in (after its `running` write) it is one.
        let lost = Invocation {
            attempt: 2,
            worker: "w".into(),
            start_ms: 10_000,
            ..Default::default()
        };
        journal = HashMap::from([("q.a".to_string(), vec![run(1), lost])]);
        let mut stopped = crate::cluster::Timeline::default();
        stopped.stops.push(("w".into(), 10_500, 13_000));
        assert!(check_counted(&journal, &histories, &stopped).is_empty());
        stopped.stops[0].1 = 11_500;
        assert_eq!(check_counted(&journal, &histories, &stopped).len(), 1);
    }

    #[test]
    fn tokens_must_grow_and_attempts_run_once() {
        let mut j = HashMap::new();
        j.insert(
            "q.a".to_string(),
            vec![
                Invocation {
                    attempt: 1,
                    token: 5,
                    ..Default::default()
                },
                Invocation {
                    attempt: 2,
                    token: 4,
                    ..Default::default()
                },
            ],
        );
        j.insert(
            "q.b".to_string(),
            vec![
                Invocation {
                    attempt: 1,
                    token: 5,
                    ..Default::default()
                },
                Invocation {
                    attempt: 1,
                    token: 6,
                    ..Default::default()
                },
            ],
        );
        // Invocations that never asked for a token (0) are not checked.
        let unfenced = Invocation {
            attempt: 1,
            token: 0,
            ..Default::default()
        };
        j.insert("q.c".to_string(), vec![unfenced.clone(), unfenced]);
        let v = check_tokens(&j);
        assert_eq!(v.len(), 2, "{v:?}");
    }
}
