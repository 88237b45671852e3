//! Fairness rules, from the fairness load's episodes (`fairness.rs`), the journal's first
//! start of each task and the nemesis's timeline:
//!
//! - **fair shares within their bound**: a `small` task waits behind at most
//!   `FAIR_DEPTH + FQ_SLOTS + BIG_WEIGHT × (⌈(ahead + 1) / SMALL_WEIGHT⌉ + 1) + LAG_STARTS`
//!   first starts of `big`'s tasks between its answer and its own first start, `ahead`
//!   being the `small` tasks sent before it was answered and not started before it was
//!   sent. Deficit round robin releases per round `SMALL_WEIGHT` of `small`'s and
//!   `BIG_WEIGHT` of `big`'s; before it, at most `depth` were released and not delivered,
//!   and `slots` delivered and not started; `LAG_STARTS` covers `big`'s starts while the
//!   dispatcher had not indexed the task yet. Released in arrival order instead, a `small`
//!   task waits behind the whole backlog (`FAIR_BACKLOG`, several times the bound);
//! - **aging never starves**: a `low` task waits at most `2 × AGING_MS + AGING_SLACK_MS`
//!   from its answer to its first start behind a `normal` backlog that outlasts it.
//!
//! Both judge only a task whose wait is clear of broker and server faults (from
//! `BEFORE_MS` before its send; after a broker restart, `AFTER_RESTART_MS`, or
//! `AFTER_NODE_RESTART_MS` in an R3 cluster, whose streams elect leaders again): a leader
//! taking over starts its rounds afresh, and a broker coming back delivers late. The
//! queue's worker is never faulted.

use crate::checker::Invocation;
use crate::cluster::Timeline;
use crate::fairness::{Episode, Waiter, AGING_MS, BIG_WEIGHT, FAIR_DEPTH, FQ_SLOTS, SMALL_WEIGHT};
use std::collections::HashMap;

/// `big`'s starts a `small` task may see while the dispatcher has not indexed it yet.
pub const LAG_STARTS: u64 = 10;
/// A low task's wait beyond twice the aging threshold: the worker's look at the oldest
/// waiting task (every 100 ms), its fetch and claim, on a loaded machine.
pub const AGING_SLACK_MS: u64 = 1_500;
const BEFORE_MS: u64 = 2_000;
const AFTER_RESTART_MS: u64 = 3_000;
const AFTER_NODE_RESTART_MS: u64 = 10_000;

/// A task's first handler start (`None`: never started).
fn first_start(journal: &HashMap<String, Vec<Invocation>>, id: &str) -> Option<u64> {
    journal.get(id)?.iter().map(|i| i.start_ms).min()
}

/// No broker or server fault touches `[from − BEFORE_MS, to]`.
fn quiet(timeline: &Timeline, cluster: bool, from: u64, to: u64) -> bool {
    let from = from.saturating_sub(BEFORE_MS);
    let after = if cluster {
        AFTER_NODE_RESTART_MS
    } else {
        AFTER_RESTART_MS
    };
    let broker = timeline
        .nats
        .iter()
        .any(|(killed, restarted)| *killed <= to && restarted + after >= from);
    let server = timeline
        .servers
        .iter()
        .any(|(_, at)| (from..=to).contains(at));
    !broker && !server
}

/// What one rule judged: tasks judged of those seen, and the tightest figure.
#[derive(Debug, Default, PartialEq)]
pub struct Judged {
    pub seen: usize,
    pub judged: usize,
    /// Fair: most `big` starts passing a `small` task, and its bound; aging: the longest
    /// wait (ms), and the bound.
    pub most: u64,
    pub bound: u64,
}

pub fn check_fair(
    episodes: &[Episode],
    journal: &HashMap<String, Vec<Invocation>>,
    timeline: &Timeline,
    cluster: bool,
) -> (Vec<String>, Judged) {
    let fair: Vec<&Episode> = episodes.iter().filter(|e| e.fair).collect();
    let big_starts: Vec<u64> = fair
        .iter()
        .flat_map(|e| &e.backlog)
        .filter_map(|id| first_start(journal, id))
        .collect();
    let smalls: Vec<(&Waiter, Option<u64>)> = fair
        .iter()
        .flat_map(|e| &e.waiters)
        .map(|w| (w, first_start(journal, &w.id)))
        .collect();
    let mut out = Vec::new();
    let mut judged = Judged {
        seen: smalls.len(),
        ..Judged::default()
    };
    for (t, start) in &smalls {
        let Some(start) = *start else { continue };
        if !quiet(timeline, cluster, t.first_sent_ms, start) {
            continue;
        }
        judged.judged += 1;
        let passing = big_starts
            .iter()
            .filter(|s| **s > t.answered_ms && **s < start)
            .count() as u64;
        let ahead = smalls
            .iter()
            .filter(|(s, s_start)| {
                s.id != t.id
                    && s.first_sent_ms < t.answered_ms
                    && s_start.is_none_or(|at| at > t.first_sent_ms)
            })
            .count() as u64;
        let bound = FAIR_DEPTH
            + FQ_SLOTS
            + BIG_WEIGHT * ((ahead + 1).div_ceil(SMALL_WEIGHT) + 1)
            + LAG_STARTS;
        if passing > judged.most || judged.bound == 0 {
            judged.most = judged.most.max(passing);
            judged.bound = bound;
        }
        if passing > bound {
            out.push(format!(
                "fair shares: small task {} (answered at {}, {ahead} of its tenant ahead) \
                 started at {start} after {passing} first starts of big's tasks (bound {bound})",
                t.id, t.answered_ms
            ));
        }
    }
    (out, judged)
}

pub fn check_aging(
    episodes: &[Episode],
    journal: &HashMap<String, Vec<Invocation>>,
    timeline: &Timeline,
    cluster: bool,
) -> (Vec<String>, Judged) {
    let bound = 2 * AGING_MS + AGING_SLACK_MS;
    let lows: Vec<&Waiter> = episodes
        .iter()
        .filter(|e| !e.fair)
        .flat_map(|e| &e.waiters)
        .collect();
    let mut out = Vec::new();
    let mut judged = Judged {
        seen: lows.len(),
        bound,
        ..Judged::default()
    };
    for low in lows {
        let Some(start) = first_start(journal, &low.id) else {
            continue;
        };
        if !quiet(timeline, cluster, low.first_sent_ms, start) {
            continue;
        }
        judged.judged += 1;
        let waited = start.saturating_sub(low.answered_ms);
        judged.most = judged.most.max(waited);
        if waited > bound {
            out.push(format!(
                "aging: low task {} (first sent at {}, answered at {}) started {waited} ms later (bound {bound} ms)",
                low.id, low.first_sent_ms, low.answered_ms
            ));
        }
    }
    (out, judged)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn started(journal: &mut HashMap<String, Vec<Invocation>>, id: &str, at: u64) {
        journal.entry(id.to_string()).or_default().push(Invocation {
            attempt: 1,
            token: 1,
            outcome: Some("ok".into()),
            worker: "f".into(),
            name: "fback".into(),
            start_ms: at,
            end_ms: Some(at + 30),
            items: None,
        });
    }

    fn waiter(id: &str, sent: u64) -> Waiter {
        Waiter {
            id: id.into(),
            first_sent_ms: sent,
            answered_ms: sent + 5,
        }
    }

    /// A backlog of 60 `big` tasks starting every 15 ms from 10,000, and 4 `small` ones
    /// answered at 10,105: they start after `passing` more of `big`'s.
    fn fair_episode(passing: u64) -> (Vec<Episode>, HashMap<String, Vec<Invocation>>) {
        let mut journal = HashMap::new();
        let backlog: Vec<String> = (0..60).map(|i| format!("fq.b{i}")).collect();
        for (i, id) in backlog.iter().enumerate() {
            started(&mut journal, id, 10_000 + 15 * i as u64);
        }
        let waiters: Vec<Waiter> = (0..4)
            .map(|i| waiter(&format!("fq.s{i}"), 10_100))
            .collect();
        // Big's 8th start is at 10,105 (the answer): the later ones pass.
        for (i, w) in waiters.iter().enumerate() {
            started(&mut journal, &w.id, 10_106 + 15 * passing + i as u64);
        }
        let episode = Episode {
            fair: true,
            backlog,
            waiters,
        };
        (vec![episode], journal)
    }

    #[test]
    fn a_small_tenant_behind_the_whole_backlog_is_caught_and_one_within_the_bound_is_not() {
        let quiet = Timeline::default();
        // Deficit round robin: a few of big's pass.
        let (episodes, journal) = fair_episode(3);
        let (v, judged) = check_fair(&episodes, &journal, &quiet, false);
        assert!(v.is_empty(), "{v:?}");
        assert_eq!((judged.seen, judged.judged, judged.most), (4, 4, 3));
        // Arrival order: the rest of the backlog (52 starts) passes each.
        let (episodes, journal) = fair_episode(52);
        let (v, judged) = check_fair(&episodes, &journal, &quiet, false);
        assert_eq!(v.len(), 4, "{v:?}");
        assert_eq!((judged.most, judged.bound), (52, 17));
        // The same wait during a broker restart is not judged.
        let faulted = Timeline {
            nats: vec![(9_500, 9_800)],
            ..Timeline::default()
        };
        let (v, judged) = check_fair(&episodes, &journal, &faulted, false);
        assert!(v.is_empty(), "{v:?}");
        assert_eq!(judged.judged, 0);
        // An ax server killed 1.5 s before: not judged either (a new leader's rounds).
        let killed = Timeline {
            servers: vec![(0, 8_700)],
            ..Timeline::default()
        };
        assert_eq!(check_fair(&episodes, &journal, &killed, false).1.judged, 0);
    }

    #[test]
    fn a_low_task_waiting_past_twice_the_threshold_and_the_slack_is_caught() {
        let mut journal = HashMap::new();
        let episodes = vec![Episode {
            fair: false,
            backlog: vec![],
            waiters: vec![waiter("fq.l0", 10_000), waiter("fq.l1", 10_000)],
        }];
        started(&mut journal, "fq.l0", 10_005 + 2 * AGING_MS + 100);
        started(
            &mut journal,
            "fq.l1",
            10_005 + 2 * AGING_MS + AGING_SLACK_MS + 1,
        );
        let (v, judged) = check_aging(&episodes, &journal, &Timeline::default(), false);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("fq.l1"), "{v:?}");
        assert_eq!(
            (judged.judged, judged.most),
            (2, 2 * AGING_MS + AGING_SLACK_MS + 1)
        );
        // A broker restarted 6 s before the send: judged on one node, not in an R3
        // cluster (its streams may still be electing).
        let restarted = Timeline {
            nats: vec![(3_500, 4_000)],
            ..Timeline::default()
        };
        assert_eq!(
            check_aging(&episodes, &journal, &restarted, false).1.judged,
            2
        );
        assert_eq!(
            check_aging(&episodes, &journal, &restarted, true).1.judged,
            0
        );
    }
}
