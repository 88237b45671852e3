//! The delayed-task timer index: a pure data structure (no broker, no clock), so its
//! bounds are unit-tested.
//!
//! - `pending`: every task not yet handed to a dispatch, ordered by (due, stream sequence):
//!   about 32 bytes a task, whatever its payload.
//! - `held`: message bodies (headers + payload) of some pending tasks, read ahead of their
//!   due time so dispatching them needs no read. Bounded by `max_bytes`: beyond it a task is
//!   read back when it is dispatched. Also holds a `Loading` mark for each read in flight.
//! - `parked`: tasks whose ready publish was refused (`busy`, or the broker failed), grouped
//!   by ready subject. Only one of a group is retried at a time, with backoff; when it goes
//!   through, the whole group is released. So a full ready queue costs one publish per
//!   backoff step, not one per waiting task, and never holds up other subjects.

use async_nats::HeaderMap;
use bytes::Bytes;
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;
use tokio::time::Instant;

/// A held delayed message: headers and payload.
pub(crate) type Body = (HeaderMap, Bytes);

/// Memory a held body is counted for: payload, headers and bookkeeping.
pub(crate) fn body_size(body: &Body) -> usize {
    let headers: usize = body
        .0
        .iter()
        .map(|(k, vs)| {
            AsRef::<str>::as_ref(k).len() + vs.iter().map(|v| v.as_str().len() + 32).sum::<usize>()
        })
        .sum();
    body.1.len() + headers + 128
}

enum Held {
    Loading,
    Body(Body, usize),
}

/// One task to dispatch: due time (ms), stream sequence, and its body if held.
pub(crate) struct Due {
    pub(crate) due: u64,
    pub(crate) seq: u64,
    pub(crate) body: Option<Body>,
    /// The parked group it was released from as a probe, if any.
    pub(crate) probe_of: Option<String>,
}

struct Parked {
    tasks: Vec<(u64, u64)>,
    retry_at: Instant,
    backoff: Duration,
    probing: bool,
}

/// First and longest pause before retrying a parked group.
const PARK_FIRST: Duration = Duration::from_millis(20);
const PARK_MOST: Duration = Duration::from_secs(2);

pub(crate) struct Index {
    pending: BTreeSet<(u64, u64)>,
    held: HashMap<u64, Held>,
    held_bytes: usize,
    max_bytes: usize,
    /// Every pending entry below this has been considered for a read-ahead.
    cursor: (u64, u64),
    parked: HashMap<String, Parked>,
    parked_tasks: usize,
}

impl Index {
    pub(crate) fn new(max_bytes: usize) -> Index {
        Index {
            pending: BTreeSet::new(),
            held: HashMap::new(),
            held_bytes: 0,
            max_bytes,
            cursor: (0, 0),
            parked: HashMap::new(),
            parked_tasks: 0,
        }
    }

    /// Tasks known and not yet handed out (pending + parked).
    pub(crate) fn len(&self) -> usize {
        self.pending.len() + self.parked_tasks
    }

    /// Tasks parked after a refused publish.
    pub(crate) fn parked(&self) -> usize {
        self.parked_tasks
    }

    /// Bytes of bodies held.
    #[cfg(test)]
    fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    fn hold(&mut self, seq: u64, body: Body) -> bool {
        let size = body_size(&body);
        if self.held_bytes + size > self.max_bytes {
            return false;
        }
        self.held_bytes += size;
        if let Some(Held::Body(_, old)) = self.held.insert(seq, Held::Body(body, size)) {
            self.held_bytes -= old;
        }
        true
    }

    fn take_body(&mut self, seq: u64) -> Option<Body> {
        match self.held.remove(&seq) {
            Some(Held::Body(body, size)) => {
                self.held_bytes -= size;
                Some(body)
            }
            _ => None,
        }
    }

    /// A task read from the stream; its body is kept if it is due within `horizon_ms` of
    /// `now_ms` and the budget allows.
    pub(crate) fn add(
        &mut self,
        due: u64,
        seq: u64,
        body: Option<Body>,
        now_ms: u64,
        horizon_ms: u64,
    ) {
        if let Some(body) = body {
            if due <= now_ms + horizon_ms {
                self.hold(seq, body);
            }
        }
        self.pending.insert((due, seq));
    }

    /// Up to `limit` tasks due by `until_ms`, earliest first, with their bodies if held.
    pub(crate) fn take_due(&mut self, until_ms: u64, limit: usize) -> Vec<Due> {
        let mut out = Vec::new();
        while out.len() < limit {
            match self.pending.first() {
                Some(&(due, seq)) if due <= until_ms => {
                    self.pending.pop_first();
                    out.push(Due {
                        due,
                        seq,
                        body: self.take_body(seq),
                        probe_of: None,
                    });
                }
                _ => break,
            }
        }
        out
    }

    /// Up to `limit` sequences to read ahead: pending, due by `until_ms`, not held, while the
    /// budget has room. Each is marked as loading.
    pub(crate) fn take_loads(&mut self, until_ms: u64, limit: usize) -> Vec<u64> {
        let mut out = Vec::new();
        if self.held_bytes >= self.max_bytes / 10 * 9 {
            return out;
        }
        let start = self.cursor;
        let mut last = None;
        for &(due, seq) in self.pending.range(start..) {
            if due > until_ms || out.len() >= limit {
                break;
            }
            last = Some((due, seq));
            if !self.held.contains_key(&seq) {
                out.push(seq);
            }
        }
        for &seq in &out {
            self.held.insert(seq, Held::Loading);
        }
        if let Some((due, seq)) = last {
            self.cursor = (due, seq + 1);
        }
        out
    }

    /// A read-ahead finished: keep the body if the task still waits and the budget allows.
    pub(crate) fn loaded(&mut self, seq: u64, body: Option<Body>) {
        if !matches!(self.held.get(&seq), Some(Held::Loading)) {
            return; // dispatched meanwhile: it read the message itself
        }
        self.held.remove(&seq);
        if let Some(body) = body {
            self.hold(seq, body);
        }
    }

    /// The due time (ms) of the next read-ahead, if any is waiting.
    pub(crate) fn next_load_due(&self) -> Option<u64> {
        if self.held_bytes >= self.max_bytes / 10 * 9 {
            return None;
        }
        self.pending
            .range(self.cursor..)
            .find(|(_, seq)| !self.held.contains_key(seq))
            .map(|&(due, _)| due)
    }

    /// The due time (ms) of the earliest pending task.
    pub(crate) fn next_due(&self) -> Option<u64> {
        self.pending.first().map(|&(due, _)| due)
    }

    /// A dispatch was refused (full subject or broker failure): park it under `group`.
    /// Parks a refused dispatch under `group`. `probe_of` is the group the dispatch probed,
    /// if it was a probe: that group's probe has failed, whichever group the task lands in
    /// (a probe of the read group can be refused by its ready subject, and the other way
    /// round), so that group backs off further and is probed again.
    pub(crate) fn park(
        &mut self,
        group: String,
        due: u64,
        seq: u64,
        body: Option<Body>,
        now: Instant,
        probe_of: Option<&str>,
    ) {
        if let Some(body) = body {
            self.hold(seq, body);
        }
        if let Some(of) = probe_of.filter(|of| *of != group) {
            if let Some(p) = self.parked.get_mut(of) {
                p.probing = false;
                p.backoff = (p.backoff * 2).min(PARK_MOST);
                p.retry_at = now + p.backoff;
            }
        }
        self.parked_tasks += 1;
        let p = self.parked.entry(group.clone()).or_insert(Parked {
            tasks: Vec::new(),
            retry_at: now + PARK_FIRST,
            backoff: PARK_FIRST,
            probing: false,
        });
        p.tasks.push((due, seq));
        if probe_of == Some(group.as_str()) {
            // This group's own probe failed: back off further.
            p.probing = false;
            p.backoff = (p.backoff * 2).min(PARK_MOST);
            p.retry_at = now + p.backoff;
        }
    }

    /// A dispatch from `group` went through: release the rest of the group at once.
    pub(crate) fn unpark(&mut self, group: &str) {
        if let Some(p) = self.parked.remove(group) {
            self.parked_tasks -= p.tasks.len();
            self.pending.extend(p.tasks);
        }
    }

    /// One probe per parked group whose retry time has come.
    pub(crate) fn probes(&mut self, now: Instant) -> Vec<Due> {
        let mut out = Vec::new();
        let ready: Vec<String> = self
            .parked
            .iter()
            .filter(|(_, p)| !p.probing && p.retry_at <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for group in ready {
            let p = self.parked.get_mut(&group).expect("listed");
            let Some((due, seq)) = p.tasks.pop() else {
                self.parked.remove(&group);
                continue;
            };
            p.probing = true;
            self.parked_tasks -= 1;
            if p.tasks.is_empty() {
                // Nothing left behind it: the group ends with this probe.
                self.parked.remove(&group);
            }
            let body = self.take_body(seq);
            out.push(Due {
                due,
                seq,
                body,
                probe_of: Some(group),
            });
        }
        out
    }

    /// When the next parked group may be retried.
    pub(crate) fn next_probe(&self) -> Option<Instant> {
        self.parked
            .values()
            .filter(|p| !p.probing)
            .map(|p| p.retry_at)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(n: usize) -> Body {
        (HeaderMap::new(), Bytes::from(vec![b'x'; n]))
    }

    #[test]
    fn bodies_stay_within_the_budget() {
        let mut ix = Index::new(10_000);
        for seq in 1..=100 {
            ix.add(1000, seq, Some(body(1000)), 0, 5000);
        }
        assert!(ix.held_bytes() <= 10_000, "{}", ix.held_bytes());
        assert_eq!(ix.len(), 100);
        let due = ix.take_due(1000, 1000);
        assert_eq!(due.len(), 100);
        assert!(due.iter().filter(|d| d.body.is_some()).count() <= 10);
        assert_eq!(ix.held_bytes(), 0);
    }

    #[test]
    fn far_tasks_are_read_ahead_within_the_budget() {
        let mut ix = Index::new(10_000);
        for seq in 1..=50 {
            ix.add(100_000 + seq, seq, Some(body(1000)), 0, 5000);
        }
        assert_eq!(ix.held_bytes(), 0, "beyond the horizon: only (due, seq)");
        assert_eq!(ix.next_load_due(), Some(100_001));
        let loads = ix.take_loads(100_020, 1000);
        assert_eq!(loads.len(), 20);
        for seq in loads {
            ix.loaded(seq, Some(body(1000)));
        }
        assert!(ix.held_bytes() <= 10_000);
        // The budget is full: no more read-ahead until dispatches free it.
        assert!(ix.take_loads(200_000, 1000).is_empty());
        assert_eq!(ix.next_load_due(), None);
        ix.take_due(100_010, 1000);
        assert!(!ix.take_loads(200_000, 1000).is_empty());
    }

    #[test]
    fn a_read_ahead_that_lost_the_race_is_dropped() {
        let mut ix = Index::new(10_000);
        ix.add(5, 1, None, 0, 0);
        assert_eq!(ix.take_loads(10, 10), vec![1]);
        let d = ix.take_due(10, 10);
        assert!(d[0].body.is_none());
        ix.loaded(1, Some(body(100)));
        assert_eq!(ix.held_bytes(), 0);
    }

    #[test]
    fn a_full_subject_is_probed_by_one_task_with_backoff() {
        let mut ix = Index::new(10_000);
        let t0 = Instant::now();
        for seq in 1..=1000 {
            ix.park("ax.ready.q.normal".into(), 5, seq, None, t0, None);
        }
        assert_eq!(ix.parked(), 1000);
        assert_eq!(ix.len(), 1000);
        assert!(ix.probes(t0).is_empty(), "waits for its backoff");
        let probes = ix.probes(t0 + PARK_FIRST);
        assert_eq!(probes.len(), 1);
        assert!(ix.probes(t0 + PARK_MOST).is_empty(), "one probe at a time");
        // The probe is refused again: the pause doubles.
        ix.park(
            "ax.ready.q.normal".into(),
            5,
            probes[0].seq,
            None,
            t0 + PARK_FIRST,
            Some("ax.ready.q.normal"),
        );
        assert_eq!(ix.next_probe(), Some(t0 + PARK_FIRST + PARK_FIRST * 2));
        let probe = ix.probes(t0 + PARK_FIRST * 3).pop().unwrap();
        assert_eq!(probe.probe_of.as_deref(), Some("ax.ready.q.normal"));
        // It went through: the rest is released at once.
        ix.unpark("ax.ready.q.normal");
        assert_eq!(ix.parked(), 0);
        assert_eq!(ix.take_due(5, 10_000).len(), 999);
    }

    #[test]
    fn a_probe_refused_under_another_group_leaves_its_group_probed_again() {
        // Tasks whose read failed wait under "(read)"; its probe is read but then refused
        // by the (full, or electing) ready stream, so it parks under the ready subject.
        // The "(read)" group must be probed again, not wait for a probe that never returns.
        let mut ix = Index::new(10_000);
        let t0 = Instant::now();
        for seq in 1..=10 {
            ix.park("(read)".into(), 5, seq, None, t0, None);
        }
        let probe = ix.probes(t0 + PARK_FIRST).pop().unwrap();
        assert_eq!(probe.probe_of.as_deref(), Some("(read)"));
        let t1 = t0 + PARK_FIRST;
        ix.park(
            "ax.ready.q.normal".into(),
            5,
            probe.seq,
            None,
            t1,
            Some("(read)"),
        );
        assert_eq!(ix.parked(), 10);
        let later = t1 + PARK_MOST;
        let groups: Vec<String> = ix
            .probes(later)
            .into_iter()
            .filter_map(|d| d.probe_of)
            .collect();
        assert!(groups.contains(&"(read)".to_string()), "{groups:?}");
        assert!(
            groups.contains(&"ax.ready.q.normal".to_string()),
            "{groups:?}"
        );
        // And a task parked into a group whose own probe is out does not start a second one.
        let mut ix = Index::new(10_000);
        ix.park("g".into(), 5, 1, None, t0, None);
        ix.park("g".into(), 5, 2, None, t0, None);
        assert_eq!(ix.probes(t0 + PARK_FIRST).len(), 1);
        ix.park("g".into(), 5, 3, None, t0 + PARK_FIRST, None);
        assert!(
            ix.probes(t0 + PARK_MOST * 2).is_empty(),
            "one probe at a time"
        );
    }
}
