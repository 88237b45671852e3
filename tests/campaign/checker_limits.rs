//! Limit rules, counted from the workers' journals (every handler start and
//! end, which no record can hide):
//!
//! - **rate**: per key, never more starts in any window of `w` seconds than `burst + rate ×
//!   (w + RATE_SLACK_S)`. The bound of docs/PROTOCOL.md §7 is on token times; a handler
//!   starts after its token by the worker's claim time (a record read and maybe a write),
//!   hence the slack of `rate × RATE_SLACK_S` starts. A worker `SIGSTOP`ped after taking a
//!   token starts late by the whole pause: its starts within [`RESUME_GRACE_MS`] after its
//!   `SIGCONT` are left out;
//! - **cap** (per key) and **singleton**: never more handlers running at once than the
//!   concurrency. A handler holds from its start line to its end line (a killed worker's:
//!   to its kill). A `SIGSTOP`ped worker's handler cannot run while stopped, and is stopped
//!   when it resumes if its slot expired meanwhile (docs/PROTOCOL.md §7): it is not
//!   counted from its stop until [`CAP_RESUME_SLACK_MS`] after its `SIGCONT`.

//! - **debounce**: a key's window never closes early. Consecutive submits of one key
//!   (one lane's, in order) answered different ids only if the second was answered after
//!   the first window was due: `min(sent + period, first sent + max_wait)`; and a window's
//!   id never comes back after another's.

use crate::checker::Invocation;
use crate::cluster::Timeline;
use std::collections::{BTreeMap, HashMap};

/// Handler starts may trail their token by the claim: `rate × RATE_SLACK_S` more starts
/// are allowed in any window.
pub const RATE_SLACK_S: f64 = 0.05;
/// A worker's starts this soon after its `SIGCONT` may use tokens taken before its stop.
pub const RESUME_GRACE_MS: u64 = 500;
/// While a nats-server (an R3 node) is down and this long after it is back, claims and
/// token writes stall and complete in bunches, and a pause can reach a worker late (its
/// reads wait for the stream's new leader): rate and pause are not checked on starts in
/// that time. A known limit (docs/RELIABILITY.md), not a promise kept.
pub const BROKER_GRACE_MS: u64 = 5000;

/// True if `at` falls while a broker was down or within [`BROKER_GRACE_MS`] after.
pub fn broker_disturbed(timeline: &Timeline, at: u64) -> bool {
    timeline
        .nats
        .iter()
        .any(|(down, up)| (*down..=up + BROKER_GRACE_MS).contains(&at))
}

/// True if `run` started while its worker was `SIGSTOP`ped or within `grace_ms` after its
/// `SIGCONT`: a start timed before the recorded `SIGCONT` is the resume itself.
pub fn started_on_resume(timeline: &Timeline, run: &Invocation, grace_ms: u64) -> bool {
    timeline.stops.iter().any(|(w, stop, cont)| {
        *w == run.worker && (*stop..=cont + grace_ms).contains(&run.start_ms)
    })
}

/// A resumed worker stops a handler whose slot's TTL ran out while it was stopped at its
/// first timer tick, without waiting for the broker (docs/PROTOCOL.md §7); until then the
/// handler is not counted.
pub const CAP_RESUME_SLACK_MS: u64 = 250;

/// Handler starts of the tasks of `limit`, by key, oldest first, without those of a worker
/// just resumed (see [`RESUME_GRACE_MS`]); and how many were left out.
pub fn starts_by_key(
    limit: &str,
    keyed: &HashMap<String, (&'static str, String)>,
    journal: &HashMap<String, Vec<Invocation>>,
    timeline: &Timeline,
) -> (BTreeMap<String, Vec<u64>>, usize) {
    let mut out: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut left_out = 0;
    for (id, (l, key)) in keyed {
        if *l != limit {
            continue;
        }
        for run in journal.get(id).into_iter().flatten() {
            // From the stop: a start timed before the recorded `SIGCONT` is the resume
            // (see `checker_ops::check_pauses`).
            let resumed = started_on_resume(timeline, run, RESUME_GRACE_MS);
            if resumed || broker_disturbed(timeline, run.start_ms) {
                left_out += 1;
                continue;
            }
            out.entry(key.clone()).or_default().push(run.start_ms);
        }
    }
    for starts in out.values_mut() {
        starts.sort();
    }
    (out, left_out)
}

/// Rule "rate": one violation per key over, naming the worst window; and the tightest
/// margin seen (starts beyond `burst + rate × w`, may be negative).
pub fn check_rate(
    rate: f64,
    burst: u32,
    starts: &BTreeMap<String, Vec<u64>>,
) -> (Vec<String>, f64) {
    let mut v = Vec::new();
    let mut tightest = f64::MIN;
    for (key, t) in starts {
        let mut worst: Option<(f64, usize, u64, u64)> = None;
        for j in 0..t.len() {
            for i in 0..=j {
                let n = j - i + 1;
                let w = (t[j] - t[i]) as f64 / 1000.0;
                let over = n as f64 - (f64::from(burst) + rate * w);
                tightest = tightest.max(over);
                if over > rate * RATE_SLACK_S + 1e-9 && worst.is_none_or(|(o, ..)| over > o) {
                    worst = Some((over, n, t[i], t[j]));
                }
            }
        }
        if let Some((_, n, from, to)) = worst {
            v.push(format!(
                "rate limit, key {key}: {n} starts in {} ms ({from}..{to}); at most {burst} + {rate}/s × (w + {RATE_SLACK_S} s) = {:.2}",
                to - from,
                f64::from(burst) + rate * ((to - from) as f64 / 1000.0 + RATE_SLACK_S)
            ));
        }
    }
    (v, tightest)
}

/// When each handler of `limit`'s tasks held a slot, by key: (from, to, task id), stop
/// windows taken out (see [`CAP_RESUME_SLACK_MS`]).
pub fn holds_by_key(
    limit: &str,
    keyed: &HashMap<String, (&'static str, String)>,
    journal: &HashMap<String, Vec<Invocation>>,
    timeline: &Timeline,
) -> BTreeMap<String, Vec<(u64, u64, String)>> {
    let mut out: BTreeMap<String, Vec<(u64, u64, String)>> = BTreeMap::new();
    for (id, (l, key)) in keyed {
        if *l != limit {
            continue;
        }
        for run in journal.get(id).into_iter().flatten() {
            let killed = timeline
                .kills
                .iter()
                .filter(|(w, at)| *w == run.worker && *at >= run.start_ms)
                .map(|(_, at)| *at)
                .min();
            let end = run.end_ms.or(killed).unwrap_or(u64::MAX);
            let mut pieces = vec![(run.start_ms, end)];
            for (w, stop, cont) in &timeline.stops {
                if *w != run.worker {
                    continue;
                }
                let gap = (*stop, cont + CAP_RESUME_SLACK_MS);
                pieces = pieces
                    .into_iter()
                    .flat_map(|(a, b)| {
                        if b <= gap.0 || a >= gap.1 {
                            vec![(a, b)]
                        } else {
                            [(a, gap.0), (gap.1, b)]
                                .into_iter()
                                .filter(|(x, y)| x < y)
                                .collect()
                        }
                    })
                    .collect();
            }
            let entry = out.entry(key.clone()).or_default();
            entry.extend(pieces.into_iter().map(|(a, b)| (a, b, id.clone())));
        }
    }
    out
}

/// Rule "cap": one violation per key where more than `cap` handlers ran at once; and the
/// most seen at once.
pub fn check_cap(
    limit: &str,
    cap: usize,
    holds: &BTreeMap<String, Vec<(u64, u64, String)>>,
) -> (Vec<String>, usize) {
    let mut v = Vec::new();
    let mut most = 0;
    for (key, spans) in holds {
        // Ends before starts at the same ms: a slot is released after its holder's end line.
        let mut events: Vec<(u64, i32, &str)> = spans
            .iter()
            .flat_map(|(a, b, id)| [(*a, 1, id.as_str()), (*b, -1, id.as_str())])
            .collect();
        events.sort();
        let mut holding: Vec<&str> = Vec::new();
        let mut reported = false;
        for (at, delta, id) in events {
            if delta < 0 {
                if let Some(i) = holding.iter().position(|h| *h == id) {
                    holding.remove(i);
                }
                continue;
            }
            holding.push(id);
            most = most.max(holding.len());
            if holding.len() > cap && !reported {
                reported = true;
                v.push(format!(
                    "{limit}, key {key}: {} handlers running at {at} (cap {cap}): {holding:?}",
                    holding.len()
                ));
            }
        }
    }
    (v, most)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(worker: &str, start: u64, end: Option<u64>) -> Invocation {
        Invocation {
            attempt: 1,
            worker: worker.into(),
            start_ms: start,
            end_ms: end,
            ..Default::default()
        }
    }

    #[test]
    fn starts_beyond_burst_plus_rate_times_the_window_are_caught() {
        // Rate 5/s, burst 2: 2 at once, then one every 200 ms is fine.
        let fine = BTreeMap::from([("k".to_string(), vec![0, 0, 200, 400, 600, 800, 1000])]);
        assert!(check_rate(5.0, 2, &fine).0.is_empty());
        // Within the slack: a start 10 ms early.
        let early = BTreeMap::from([("k".to_string(), vec![0, 0, 190, 400])]);
        assert!(check_rate(5.0, 2, &early).0.is_empty());
        // Three at once, or one every 100 ms.
        let burst = BTreeMap::from([("k".to_string(), vec![0, 0, 0])]);
        assert_eq!(check_rate(5.0, 2, &burst).0.len(), 1);
        let fast = BTreeMap::from([("k".to_string(), (0..10).map(|i| i * 100).collect())]);
        assert_eq!(check_rate(5.0, 2, &fast).0.len(), 1);
    }

    #[test]
    fn a_resumed_workers_first_starts_are_left_out() {
        let keyed = HashMap::from([("x.a".to_string(), ("rated", "k".to_string()))]);
        let journal = HashMap::from([(
            "x.a".to_string(),
            vec![run("x0", 5_100, None), run("x1", 5_100, None)],
        )]);
        let timeline = Timeline {
            stops: vec![("x0".into(), 2_000, 5_000)],
            ..Default::default()
        };
        let (starts, left_out) = starts_by_key("rated", &keyed, &journal, &timeline);
        assert_eq!((starts["k"].len(), left_out), (1, 1));
    }

    #[test]
    fn more_holders_than_the_cap_are_caught() {
        let keyed = HashMap::from([
            ("x.a".to_string(), ("capped", "k".to_string())),
            ("x.b".to_string(), ("capped", "k".to_string())),
            ("x.c".to_string(), ("capped", "k".to_string())),
        ]);
        let mut journal = HashMap::from([
            ("x.a".to_string(), vec![run("x0", 0, Some(1000))]),
            ("x.b".to_string(), vec![run("x1", 500, Some(1500))]),
            // Starts as x.a ends (a released slot): fine.
            ("x.c".to_string(), vec![run("x1", 1000, Some(1200))]),
        ]);
        let t = Timeline::default();
        assert!(
            check_cap("capped", 2, &holds_by_key("capped", &keyed, &journal, &t))
                .0
                .is_empty()
        );
        // Three at once.
        journal.insert("x.c".to_string(), vec![run("x1", 900, Some(1200))]);
        assert_eq!(
            check_cap("capped", 2, &holds_by_key("capped", &keyed, &journal, &t))
                .0
                .len(),
            1
        );
        // Unless x.a's worker was stopped then (its handler cannot run) …
        let stopped = Timeline {
            stops: vec![("x0".into(), 800, 2000)],
            ..Default::default()
        };
        assert!(check_cap(
            "capped",
            2,
            &holds_by_key("capped", &keyed, &journal, &stopped)
        )
        .0
        .is_empty());
        // … or killed before.
        journal.insert("x.a".to_string(), vec![run("x0", 0, None)]);
        let killed = Timeline {
            kills: vec![("x0".into(), 850)],
            ..Default::default()
        };
        assert!(check_cap(
            "capped",
            2,
            &holds_by_key("capped", &keyed, &journal, &killed)
        )
        .0
        .is_empty());
        // A killed worker's handler that never ended holds until the kill, not for ever.
        assert_eq!(
            check_cap("capped", 2, &holds_by_key("capped", &keyed, &journal, &t))
                .0
                .len(),
            1
        );
    }
}

/// The quiet period and longest wait of the campaign's debounced submits.
pub const DEBOUNCE_PERIOD_MS: u64 = 250;
pub const DEBOUNCE_MAX_WAIT_MS: u64 = 600;
/// A dispatch may run this much before its due time (the monotonic timer's rounding).
const DEBOUNCE_SLACK_MS: u64 = 5;

/// One accepted debounced submit, as its producer saw it.
#[derive(Debug, Clone)]
pub struct Debounced {
    pub key: String,
    pub id: String,
    /// Sent (its first attempt, when retried).
    pub sent_ms: u64,
    pub answered_ms: u64,
}

/// The debounce rule over `submits` (each key's in the order they were made).
pub fn check_debounce(submits: &[Debounced]) -> Vec<String> {
    let mut by_key: BTreeMap<&str, Vec<&Debounced>> = BTreeMap::new();
    for d in submits {
        by_key.entry(d.key.as_str()).or_default().push(d);
    }
    let mut out = Vec::new();
    for (key, list) in by_key {
        let mut first_sent: HashMap<&str, u64> = HashMap::new();
        let mut closed: Vec<&str> = Vec::new();
        for pair in list.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            let first = *first_sent.entry(a.id.as_str()).or_insert(a.sent_ms);
            if a.id == b.id {
                continue;
            }
            let due = (a.sent_ms + DEBOUNCE_PERIOD_MS).min(first + DEBOUNCE_MAX_WAIT_MS);
            if b.answered_ms + DEBOUNCE_SLACK_MS < due {
                out.push(format!(
                    "debounce key {key}: window {} closed early: a submit sent at {} was answered \
                     {} with a new window {} ({} ms before the first could be due)",
                    a.id,
                    a.sent_ms,
                    b.answered_ms,
                    b.id,
                    due - b.answered_ms
                ));
            }
            closed.push(a.id.as_str());
            if closed.contains(&b.id.as_str()) {
                out.push(format!(
                    "debounce key {key}: window {} answered again after it ended",
                    b.id
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod debounce_tests {
    use super::*;

    fn d(key: &str, id: &str, sent_ms: u64, answered_ms: u64) -> Debounced {
        Debounced {
            key: key.into(),
            id: id.into(),
            sent_ms,
            answered_ms,
        }
    }

    #[test]
    fn a_window_may_end_only_when_due() {
        let ok = [
            d("k", "a", 0, 5),
            d("k", "a", 100, 105),
            d("k", "b", 400, 405),
            d("j", "c", 0, 1),
        ];
        assert!(check_debounce(&ok).is_empty());
        // b answered 200 ms after a's last submit: a (period 250) was not due.
        let early = [d("k", "a", 0, 5), d("k", "b", 195, 200)];
        assert_eq!(check_debounce(&early).len(), 1);
        // Never quiet: a window may end at max_wait (600 ms after its first submit).
        let long: Vec<Debounced> = (0..8)
            .map(|i| d("k", if i < 7 { "a" } else { "b" }, i * 100, i * 100 + 3))
            .collect();
        assert_eq!(check_debounce(&long), Vec::<String>::new());
        let reopened = [
            d("k", "a", 0, 1),
            d("k", "b", 300, 301),
            d("k", "a", 900, 901),
        ];
        assert_eq!(check_debounce(&reopened).len(), 1);
    }
}
