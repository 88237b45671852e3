//! Per-minute series of the last hour, per queue, for the console's charts
//! (`ax.task.series`): tasks that reached `succeeded`, `retrying` and `dead`, and their
//! queue wait and run time. Kept by the task index from the records it reads: a record
//! that moves into one of those states counts in the minute of its `updated_at_ms`. After
//! a server start the series is rebuilt from each record's last value, so retries that
//! were followed by another state before the start are not seen.

use ax_core::state::TaskState;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};

const MINUTE: u64 = 60_000;
/// Minutes kept and answered.
const MINUTES: u64 = 60;
/// Histogram buckets: bucket `i` holds durations `ms` with `ms + 1` in
/// `[2^(i/2), 2^((i+1)/2))` (a resolution of √2), the last one everything longer (about
/// 50 days). A percentile is its bucket's upper bound: never below the true value.
const BUCKETS: usize = 64;

#[derive(Clone)]
struct Minute {
    succeeded: u32,
    retried: u32,
    dead: u32,
    wait: [u32; BUCKETS],
    run: [u32; BUCKETS],
}

impl Default for Minute {
    fn default() -> Self {
        Minute {
            succeeded: 0,
            retried: 0,
            dead: 0,
            wait: [0; BUCKETS],
            run: [0; BUCKETS],
        }
    }
}

fn bucket(ms: u64) -> usize {
    // floor(2·log2(ms + 1)): twice the bit length, plus one in the upper half of the
    // octave (v ≥ √2·2^bits, that is v² ≥ 2^(2·bits + 1)).
    let v = u128::from(ms) + 1;
    let bits = 127 - v.leading_zeros() as usize;
    let half = usize::from(v * v >= 1u128 << (2 * bits + 1));
    (2 * bits + half).min(BUCKETS - 1)
}

/// The upper bound of bucket `i`, in ms.
fn bound(i: usize) -> f64 {
    2f64.powf((i + 1) as f64 / 2.0) - 1.0
}

fn percentile(h: &[u32; BUCKETS], p: f64) -> Option<f64> {
    let n: u64 = h.iter().map(|&c| u64::from(c)).sum();
    if n == 0 {
        return None;
    }
    let rank = ((n as f64) * p).ceil().max(1.0) as u64;
    let mut seen = 0u64;
    for (i, &c) in h.iter().enumerate() {
        seen += u64::from(c);
        if seen >= rank {
            return Some(bound(i).round());
        }
    }
    None
}

/// What a record says about one transition.
pub(crate) struct Moved<'a> {
    pub(crate) queue: &'a str,
    pub(crate) state: TaskState,
    pub(crate) attempt: u32,
    pub(crate) created_at_ms: u64,
    pub(crate) updated_at_ms: u64,
    pub(crate) run_at_ms: Option<u64>,
    pub(crate) started_at_ms: Option<u64>,
    pub(crate) finished_at_ms: Option<u64>,
}

#[derive(Default)]
pub(crate) struct Series {
    queues: HashMap<Box<str>, BTreeMap<u64, Minute>>,
}

impl Series {
    /// Counts a record that moved into `m.state` (the caller checks it moved).
    pub(crate) fn record(&mut self, m: &Moved<'_>, now_ms: u64) {
        let counted = matches!(
            m.state,
            TaskState::Succeeded | TaskState::Retrying | TaskState::Dead
        );
        let oldest = (now_ms / MINUTE).saturating_sub(MINUTES - 1) * MINUTE;
        if !counted || m.updated_at_ms < oldest || m.updated_at_ms > now_ms + MINUTE {
            return;
        }
        let minutes = match self.queues.get_mut(m.queue) {
            Some(q) => q,
            None => self.queues.entry(m.queue.into()).or_default(),
        };
        while minutes.first_key_value().is_some_and(|(t, _)| *t < oldest) {
            minutes.pop_first();
        }
        let slot = minutes
            .entry(m.updated_at_ms / MINUTE * MINUTE)
            .or_default();
        match m.state {
            TaskState::Succeeded => slot.succeeded += 1,
            TaskState::Retrying => slot.retried += 1,
            _ => slot.dead += 1,
        }
        if let Some(started) = m.started_at_ms {
            let ended = m.finished_at_ms.unwrap_or(m.updated_at_ms);
            slot.run[bucket(ended.saturating_sub(started))] += 1;
            if m.attempt == 1 {
                let ready = m.run_at_ms.unwrap_or(m.created_at_ms);
                slot.wait[bucket(started.saturating_sub(ready))] += 1;
            }
        }
    }

    /// `{"now_ms", "minute_ms", "queues": {queue: [60 points, oldest first]}}`.
    pub(crate) fn answer(&self, queue: Option<&str>, now_ms: u64) -> Value {
        let last = now_ms / MINUTE * MINUTE;
        let first = last.saturating_sub((MINUTES - 1) * MINUTE);
        let empty = BTreeMap::new();
        let mut out = serde_json::Map::new();
        for (name, minutes) in &self.queues {
            if queue.is_some_and(|q| q != name.as_ref()) {
                continue;
            }
            out.insert(name.to_string(), points(minutes, first));
        }
        if let Some(q) = queue {
            out.entry(q.to_string())
                .or_insert_with(|| points(&empty, first));
        }
        json!({"now_ms": now_ms, "minute_ms": MINUTE, "queues": out})
    }
}

fn points(minutes: &BTreeMap<u64, Minute>, first: u64) -> Value {
    let zero = Minute::default();
    let list: Vec<Value> = (0..MINUTES)
        .map(|i| {
            let t = first + i * MINUTE;
            let m = minutes.get(&t).unwrap_or(&zero);
            json!({
                "t": t, "succeeded": m.succeeded, "retried": m.retried, "dead": m.dead,
                "wait_p50_ms": percentile(&m.wait, 0.5), "wait_p95_ms": percentile(&m.wait, 0.95),
                "run_p50_ms": percentile(&m.run, 0.5), "run_p95_ms": percentile(&m.run, 0.95),
            })
        })
        .collect();
    Value::Array(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moved(state: TaskState, updated: u64, started: Option<u64>) -> Moved<'static> {
        Moved {
            queue: "q",
            state,
            attempt: 1,
            created_at_ms: updated.saturating_sub(1_000),
            updated_at_ms: updated,
            run_at_ms: None,
            started_at_ms: started,
            finished_at_ms: Some(updated),
        }
    }

    #[test]
    fn buckets_cover_durations_within_a_factor_of_root_two() {
        for ms in [0u64, 1, 2, 3, 10, 99, 100, 1_000, 65_000, 3_600_000] {
            let b = bound(bucket(ms));
            assert!(
                b >= ms as f64 && b <= (ms as f64 + 1.0) * 1.42 + 1.0,
                "{ms} → {b}"
            );
        }
    }

    #[test]
    fn every_duration_is_at_most_its_buckets_bound_and_within_root_two_of_it() {
        // Up to the last bucket (about 50 days), which holds everything longer.
        let mut ms = 0u64;
        while (bound(BUCKETS - 2) as u64) >= ms {
            let b = bound(bucket(ms));
            assert!(b >= ms as f64, "{ms} ms reported as {b}");
            assert!(
                b <= (ms as f64 + 1.0) * 2f64.sqrt(),
                "{ms} ms reported as {b}"
            );
            ms = if ms < 100_000 { ms + 1 } else { ms + ms / 1000 };
        }
    }

    #[test]
    fn a_minute_counts_its_transitions_and_times() {
        let now = 10 * 3_600_000 + 30_000;
        let mut s = Series::default();
        let minute = now / MINUTE * MINUTE;
        for i in 0..10 {
            s.record(
                &moved(TaskState::Succeeded, minute + i, Some(minute + i - 100)),
                now,
            );
        }
        s.record(&moved(TaskState::Retrying, minute - MINUTE, None), now);
        s.record(&moved(TaskState::Dead, now - 2 * 3_600_000, None), now); // too old
        s.record(&moved(TaskState::Running, minute, None), now); // not counted
        let v = s.answer(None, now);
        let q = v["queues"]["q"].as_array().unwrap();
        assert_eq!(q.len(), 60);
        let last = &q[59];
        assert_eq!(last["t"], minute);
        assert_eq!(
            (last["succeeded"].as_u64(), last["dead"].as_u64()),
            (Some(10), Some(0))
        );
        let p50 = last["run_p50_ms"].as_f64().unwrap();
        assert!((100.0..=142.0).contains(&p50), "{p50}");
        let wait = last["wait_p50_ms"].as_f64().unwrap();
        assert!((900.0..=1_300.0).contains(&wait), "{wait}");
        assert_eq!(q[58]["retried"], 1);
        assert!(q[58]["run_p50_ms"].is_null());
        assert_eq!(
            q.iter().map(|p| p["dead"].as_u64().unwrap()).sum::<u64>(),
            0
        );
        // An hour later it has rolled off.
        let later = now + 3_600_000;
        s.record(&moved(TaskState::Dead, later, None), later);
        let v = s.answer(Some("q"), later);
        let total: u64 = v["queues"]["q"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["succeeded"].as_u64().unwrap())
            .sum();
        assert_eq!(total, 0);
    }
}
