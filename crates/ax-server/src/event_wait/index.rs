//! The matcher's memory: the pending waits indexed by event name, match fields and
//! wanted values, and the recent events (the lookback) in stream order. Pure: the
//! service feeds it the two feeds' entries and acts on the hits it answers.
//!
//! Each (wait, event) pair is looked at once, by whichever of the two arrives second: a
//! new event is looked up in the waits' index (one hash lookup per set of match fields
//! in use for its name); a new wait walks the recent events of its name, oldest first,
//! so it takes the first event that matches.
//!
//! An event counts for a wait if it was stored from the wait's `since_ms` to its
//! `until_ms` (its timeout). A wait that met none by the time the service has read an
//! event (or learnt of none) stored after its timeout has timed out
//! ([`Index::timed_out`]): it meets nothing more, and the service ends it by its
//! `on_timeout`.

use ax_core::event::{key_of, WaitRegistration};
use bytes::Bytes;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

/// An event as the matcher holds it.
#[derive(Debug)]
pub(crate) struct Seen {
    /// Its `AX_EVENTS` sequence.
    pub(crate) seq: u64,
    /// When the broker stored it, ms since the epoch.
    pub(crate) at_ms: u64,
    /// Its name (the subject after `ax.events.`).
    pub(crate) name: String,
    /// Its payload as stored (the wait's output).
    pub(crate) raw: Bytes,
    /// Its payload decoded (`Null` if it is not JSON: it matches only an empty match).
    pub(crate) payload: Value,
}

impl Seen {
    fn bytes(&self) -> usize {
        self.raw.len() * 2 + self.name.len() + 64
    }
}

/// A wait that met its event: the service ends it with the event's payload.
#[derive(Debug, Clone)]
pub(crate) struct Hit {
    pub(crate) task: String,
    pub(crate) event: Arc<Seen>,
}

struct Entry {
    reg: WaitRegistration,
    fields: Arc<[String]>,
    key: String,
    /// The event it met (being ended with it): it meets no other.
    hit: Option<Arc<Seen>>,
    /// No event met it up to its timeout: it meets none.
    timed_out: bool,
}

type ByKey = HashMap<String, BTreeSet<String>>;

/// The pending waits and the recent events.
pub(crate) struct Index {
    waits: HashMap<String, Entry>,
    /// Event name → match fields → wanted values → wait task ids (waits without a hit).
    shapes: HashMap<String, HashMap<Arc<[String]>, ByKey>>,
    /// Recent events, oldest first, and the same by name.
    recent: VecDeque<Arc<Seen>>,
    by_name: HashMap<String, VecDeque<Arc<Seen>>>,
    bytes: usize,
    window_ms: u64,
    max_bytes: usize,
    /// Events let go before their window ended, for want of memory.
    pub(crate) dropped_early: u64,
    /// How many of `waits` are approvals (held only for the sweep: they meet no event).
    approvals: usize,
    /// The waits for events that met nothing yet, by timeout: `(until_ms, task)`.
    due: BTreeSet<(u64, String)>,
}

impl Index {
    /// Keeps events for `window_ms` after they were stored, `max_bytes` of them at most.
    pub(crate) fn new(window_ms: u64, max_bytes: usize) -> Index {
        Index {
            waits: HashMap::new(),
            shapes: HashMap::new(),
            recent: VecDeque::new(),
            by_name: HashMap::new(),
            bytes: 0,
            window_ms,
            max_bytes,
            dropped_early: 0,
            approvals: 0,
            due: BTreeSet::new(),
        }
    }

    /// How many waits for events are pending (approvals left out), and how many events
    /// are held.
    pub(crate) fn sizes(&self) -> (usize, usize) {
        (self.waits.len() - self.approvals, self.recent.len())
    }

    /// A wait stored (or stored again): its hit among the recent events, if any.
    pub(crate) fn register(&mut self, reg: WaitRegistration) -> Option<Hit> {
        if let Some(old) = self.waits.get(&reg.task) {
            if old.reg == reg {
                return None; // the same value written again (a retried submit)
            }
            self.unregister(&reg.task.clone());
        }
        let fields: Arc<[String]> = reg.fields().into();
        let key = reg.key();
        let task = reg.task.clone();
        if reg.approval.is_some() {
            // An approval meets no event: it is held for the sweep only.
            self.approvals += 1;
            let entry = Entry {
                reg,
                fields,
                key,
                hit: None,
                timed_out: false,
            };
            self.waits.insert(task, entry);
            return None;
        }
        let hit = self.by_name.get(&reg.event).and_then(|events| {
            events
                .iter()
                .find(|e| {
                    (reg.since_ms..=reg.until_ms).contains(&e.at_ms)
                        && key_of(&e.payload, &fields).as_ref() == Some(&key)
                })
                .cloned()
        });
        if hit.is_none() {
            self.shapes
                .entry(reg.event.clone())
                .or_default()
                .entry(fields.clone())
                .or_default()
                .entry(key.clone())
                .or_default()
                .insert(task.clone());
            self.due.insert((reg.until_ms, task.clone()));
        }
        let entry = Entry {
            reg,
            fields,
            key,
            hit: hit.clone(),
            timed_out: false,
        };
        self.waits.insert(task.clone(), entry);
        hit.map(|event| Hit { task, event })
    }

    /// A wait removed (it ended).
    pub(crate) fn unregister(&mut self, task: &str) {
        let Some(entry) = self.waits.remove(task) else {
            return;
        };
        if entry.reg.approval.is_some() {
            self.approvals -= 1;
            return;
        }
        self.due.remove(&(entry.reg.until_ms, task.to_string()));
        self.unshape(&entry, task);
    }

    /// Takes wait `task` (its `entry`) out of the lookup of new events.
    fn unshape(&mut self, entry: &Entry, task: &str) {
        let Some(shapes) = self.shapes.get_mut(&entry.reg.event) else {
            return;
        };
        if let Some(by_key) = shapes.get_mut(&entry.fields) {
            if let Some(ids) = by_key.get_mut(&entry.key) {
                ids.remove(task);
                if ids.is_empty() {
                    by_key.remove(&entry.key);
                }
            }
            if by_key.is_empty() {
                shapes.remove(&entry.fields);
            }
        }
        if shapes.is_empty() {
            self.shapes.remove(&entry.reg.event);
        }
    }

    /// The waits for events that met nothing by their timeout, now that every event
    /// stored before `seen_ms` has been looked at: each meets nothing from now on, and is
    /// answered once (the service ends it by its `on_timeout` and removes its registration).
    pub(crate) fn timed_out(&mut self, seen_ms: u64) -> Vec<String> {
        let mut out = Vec::new();
        while let Some((until, _)) = self.due.first() {
            if *until >= seen_ms {
                break;
            }
            let (_, task) = self.due.pop_first().expect("looked at");
            let Some(entry) = self.waits.remove(&task) else {
                continue;
            };
            self.unshape(&entry, &task);
            let entry = Entry {
                timed_out: true,
                ..entry
            };
            self.waits.insert(task.clone(), entry);
            out.push(task);
        }
        out
    }

    /// The earliest timeout of a wait for an event that met nothing yet.
    pub(crate) fn next_due(&self) -> Option<u64> {
        self.due.first().map(|(until, _)| *until)
    }

    /// What wait `task` does at its timeout, if its registration says.
    pub(crate) fn on_timeout(&self, task: &str) -> Option<ax_core::event::OnTimeout> {
        self.waits.get(task).and_then(|e| e.reg.on_timeout)
    }

    /// Whether wait `task` timed out here ([`Index::timed_out`]) and is still registered.
    pub(crate) fn is_timed_out(&self, task: &str) -> bool {
        self.waits.get(task).is_some_and(|e| e.timed_out)
    }

    /// An event stored at `now_ms`-ish: the waits it meets (each meets one event).
    pub(crate) fn event(&mut self, seen: Seen, now_ms: u64) -> Vec<Hit> {
        let seen = Arc::new(seen);
        let mut hits = Vec::new();
        if let Some(shapes) = self.shapes.get_mut(&seen.name) {
            for (fields, by_key) in shapes.iter_mut() {
                let Some(key) = key_of(&seen.payload, fields) else {
                    continue;
                };
                let Some(ids) = by_key.get_mut(&key) else {
                    continue;
                };
                let met: Vec<String> = ids
                    .iter()
                    .filter(|id| {
                        self.waits.get(*id).is_some_and(|e| {
                            (e.reg.since_ms..=e.reg.until_ms).contains(&seen.at_ms)
                        })
                    })
                    .cloned()
                    .collect();
                for id in met {
                    ids.remove(&id);
                    if let Some(entry) = self.waits.get_mut(&id) {
                        entry.hit = Some(seen.clone());
                        self.due.remove(&(entry.reg.until_ms, id.clone()));
                    }
                    hits.push(Hit {
                        task: id,
                        event: seen.clone(),
                    });
                }
                if ids.is_empty() {
                    by_key.remove(&key);
                }
            }
            shapes.retain(|_, by_key| !by_key.is_empty());
        }
        self.hold(seen, now_ms);
        hits
    }

    /// The hit of wait `task` (to end it again after a failed try).
    pub(crate) fn hit_of(&self, task: &str) -> Option<Hit> {
        let event = self.waits.get(task)?.hit.clone()?;
        Some(Hit {
            task: task.to_string(),
            event,
        })
    }

    /// Waits whose timeout passed before `now_ms`: the service checks their records and
    /// removes the ended ones.
    pub(crate) fn overdue(&self, now_ms: u64) -> Vec<String> {
        self.waits
            .values()
            .filter(|e| e.reg.until_ms < now_ms)
            .map(|e| e.reg.task.clone())
            .collect()
    }

    /// Keeps `seen` for the lookback; lets go of events past the window or the budget.
    fn hold(&mut self, seen: Arc<Seen>, now_ms: u64) {
        self.bytes += seen.bytes();
        self.by_name
            .entry(seen.name.clone())
            .or_default()
            .push_back(seen.clone());
        self.recent.push_back(seen);
        self.expire(now_ms);
    }

    /// Lets go of events stored more than the window before `now_ms`, and of the oldest
    /// while over the memory budget.
    pub(crate) fn expire(&mut self, now_ms: u64) {
        let oldest = now_ms.saturating_sub(self.window_ms);
        while let Some(first) = self.recent.front() {
            let over = self.bytes > self.max_bytes;
            if first.at_ms >= oldest && !over {
                break;
            }
            if over && first.at_ms >= oldest {
                self.dropped_early += 1;
            }
            let first = self.recent.pop_front().expect("looked at");
            self.bytes -= first.bytes();
            if let Some(events) = self.by_name.get_mut(&first.name) {
                events.pop_front();
                if events.is_empty() {
                    self.by_name.remove(&first.name);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn reg(task: &str, order: u64, since_ms: u64) -> WaitRegistration {
        serde_json::from_value(json!({"task": task, "event": "paid", "since_ms": since_ms,
            "until_ms": 1_000_000, "match": {"order_id": order}}))
        .unwrap()
    }

    fn seen(seq: u64, at_ms: u64, order: u64) -> Seen {
        let payload = json!({"order_id": order, "seq": seq});
        Seen {
            seq,
            at_ms,
            name: "paid".into(),
            raw: serde_json::to_vec(&payload).unwrap().into(),
            payload,
        }
    }

    #[test]
    fn a_wait_meets_the_first_matching_event_whichever_came_first() {
        let mut ix = Index::new(60_000, 1 << 20);
        // An event before the wait (the lookback): the first matching one counts.
        assert!(ix.event(seen(1, 100, 7), 100).is_empty());
        assert!(ix.event(seen(2, 110, 8), 110).is_empty());
        assert!(ix.event(seen(3, 120, 7), 120).is_empty());
        let hit = ix.register(reg("w1", 7, 50)).expect("met in the lookback");
        assert_eq!((hit.task.as_str(), hit.event.seq), ("w1", 1));
        // Too old for its lookback: not met; the next matching event meets it.
        assert!(ix.register(reg("w2", 8, 115)).is_none());
        assert!(
            ix.event(seen(4, 130, 7), 130).is_empty(),
            "w1 met one already"
        );
        let hits = ix.event(seen(5, 140, 8), 140);
        assert_eq!(hits.len(), 1);
        assert_eq!((hits[0].task.as_str(), hits[0].event.seq), ("w2", 5));
        assert!(
            ix.event(seen(6, 150, 8), 150).is_empty(),
            "w2 met one already"
        );
        // Two waits on one key both meet one event.
        assert!(ix.register(reg("w3", 9, 0)).is_none());
        assert!(ix.register(reg("w4", 9, 0)).is_none());
        assert_eq!(ix.event(seen(7, 160, 9), 160).len(), 2);
        // A wait removed meets nothing.
        assert!(ix.register(reg("w5", 10, 0)).is_none());
        ix.unregister("w5");
        assert!(ix.event(seen(8, 170, 10), 170).is_empty());
        assert_eq!(ix.hit_of("w2").map(|h| h.event.seq), Some(5));
    }

    /// An event counts up to the wait's timeout; a wait that met none by then is answered
    /// once as timed out, when an event (or an ask) stored after it has been read, and
    /// meets nothing after.
    #[test]
    fn a_wait_times_out_once_every_event_up_to_its_timeout_was_looked_at() {
        let mut ix = Index::new(60_000, 1 << 20);
        let until = |task: &str, order: u64, until_ms: u64| {
            let mut r = reg(task, order, 0);
            r.until_ms = until_ms;
            r
        };
        assert!(ix.register(until("w1", 7, 1_000)).is_none());
        assert!(ix.register(until("w2", 8, 2_000)).is_none());
        assert_eq!(ix.next_due(), Some(1_000));
        // Stored at its timeout: counts.
        let hits = ix.event(seen(1, 1_000, 7), 1_000);
        assert_eq!(hits.len(), 1);
        assert_eq!(
            ix.next_due(),
            Some(2_000),
            "a wait that met its event is not due"
        );
        // Up to its timeout, nothing is timed out; past it, once.
        assert!(ix.timed_out(2_000).is_empty());
        // An event stored after w2's timeout does not meet it...
        assert!(ix.event(seen(2, 2_001, 8), 2_001).is_empty());
        // ...and once it has been read, w2 is timed out, once.
        assert_eq!(ix.timed_out(2_001), ["w2".to_string()]);
        assert!(ix.timed_out(5_000).is_empty());
        assert!(ix.is_timed_out("w2") && ix.hit_of("w2").is_none());
        assert!(ix.event(seen(3, 2_002, 8), 2_002).is_empty());
        assert_eq!(ix.next_due(), None);
        // A wait read late meets an event of its lookback only up to its timeout.
        assert!(
            ix.register(until("w3", 8, 1_500)).is_none(),
            "8's events came after"
        );
        assert_eq!(ix.timed_out(2_002), ["w3".to_string()]);
        assert!(ix.register(until("w4", 8, 2_001)).is_some(), "met by seq 2");
        ix.unregister("w2");
        assert!(!ix.is_timed_out("w2"));
    }

    #[test]
    fn an_approval_is_held_for_the_sweep_but_meets_no_event_and_is_not_counted() {
        let mut ix = Index::new(60_000, 1 << 20);
        let approval: WaitRegistration = serde_json::from_value(json!({"task": "a1",
            "event": "", "since_ms": 0, "until_ms": 100, "match": {},
            "approval": {"flow": "f", "run": "r", "step": "ok"}}))
        .unwrap();
        assert!(ix.register(approval).is_none());
        assert!(ix.register(reg("w", 7, 0)).is_none());
        let anything = Seen {
            seq: 1,
            at_ms: 10,
            name: String::new(),
            raw: "{}".into(),
            payload: json!({}),
        };
        assert!(
            ix.event(anything, 10).is_empty(),
            "no event meets an approval"
        );
        assert_eq!(ix.sizes().0, 1, "the gauge counts waits for events only");
        assert_eq!(ix.overdue(200), ["a1".to_string()], "swept once overdue");
        ix.unregister("a1");
        ix.unregister("w");
        assert_eq!(ix.sizes().0, 0);
    }

    #[test]
    fn events_past_the_window_or_the_budget_are_let_go() {
        let mut ix = Index::new(1_000, 1 << 20);
        ix.event(seen(1, 0, 7), 0);
        ix.event(seen(2, 2_000, 8), 2_000);
        assert!(ix.register(reg("w", 7, 0)).is_none(), "out of the window");
        assert_eq!(ix.sizes(), (1, 1));
        let mut small = Index::new(1_000_000, 400);
        for k in 0..10 {
            small.event(seen(k, k, 7), k);
        }
        assert!(small.sizes().1 < 10);
        assert!(small.dropped_early > 0);
        assert!(small.register(reg("w", 7, 0)).is_some(), "a later one met");
    }
}
