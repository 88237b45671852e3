//! The tasks this worker holds now, by id: one attempt of a task at a time per worker.
//!
//! JetStream redelivers a message one ack wait after the broker last heard of it. When the
//! holder is this very worker — its heartbeats went unanswered through a cluster election,
//! or a handler blocked its thread past the ack wait — the redelivery must not start a
//! second run beside the attempt still in progress. It waits for that attempt to end and
//! then decides from the record like any delivery (a recorded result: acked as a
//! duplicate). Meanwhile the redelivery itself is the broker's word that the task is ours
//! again, so the first attempt's result write keeps trying (see [`Held`]).
//! Across worker processes the fencing token keeps results apart (docs/PROTOCOL.md §3).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// When the broker last confirmed that a task held here is ours: a delivery of it, or a
/// heartbeat it acknowledged. JetStream redelivers one ack wait after that.
pub(crate) struct Held(Mutex<Instant>);

impl Held {
    pub(crate) fn now() -> Held {
        Held(Mutex::new(Instant::now()))
    }
    pub(crate) fn confirmed(&self) {
        *self.0.lock().expect("not poisoned") = Instant::now();
    }
    pub(crate) fn since(&self) -> Duration {
        self.0.lock().expect("not poisoned").elapsed()
    }
}

/// One task held by this worker, shared by every delivery of it here.
pub(crate) struct Slot {
    pub(crate) held: Held,
    /// Held by the delivery whose claim or attempt runs; later deliveries wait for it.
    pub(crate) turn: tokio::sync::Mutex<()>,
    /// Cancelled when an operator cancels the task while its attempt runs here
    /// (`ax.cancel.<queue>`): the attempt stops and ends `cancelled`.
    pub(crate) cancel: tokio_util::sync::CancellationToken,
    /// Set (before `cancel`) by an operator's cancel signal; read by an attempt as its
    /// handler starts, after it set `started` (see [`Slot::start`]).
    stop: AtomicBool,
    /// The attempt whose handler was started here (0: none).
    started: AtomicU32,
}

impl Slot {
    /// Marks the handler of `attempt` as started; false if a cancel signal came first (the
    /// handler must not start). The signal sets `stop` and then reads `started`, the
    /// attempt sets `started` and then reads `stop` (both sequentially consistent), so a
    /// signal that answers "not started" is always seen here: a cancelled task's handler
    /// either started before the signal's answer, which says so, or never starts.
    pub(crate) fn start(&self, attempt: u32) -> bool {
        self.started.store(attempt, SeqCst);
        !self.stop.load(SeqCst)
    }

    /// The attempt whose handler was last started here (0: none).
    pub(crate) fn started(&self) -> u32 {
        self.started.load(SeqCst)
    }
}

/// The registry: task id → its slot and how many deliveries use it.
#[derive(Default)]
pub(crate) struct InFlight(Mutex<HashMap<String, (Arc<Slot>, usize)>>);

impl InFlight {
    /// Registers a delivery of task `id`; the slot is dropped with the last delivery.
    /// A delivery confirms the task is ours (a fresh ack wait starts at the broker).
    pub(crate) fn enter(self: &Arc<Self>, id: &str) -> Entry {
        let mut map = self.0.lock().expect("not poisoned");
        let (slot, users) = map.entry(id.to_string()).or_insert_with(|| {
            let slot = Slot {
                held: Held::now(),
                turn: tokio::sync::Mutex::new(()),
                cancel: Default::default(),
                stop: AtomicBool::new(false),
                started: AtomicU32::new(0),
            };
            (Arc::new(slot), 0)
        });
        *users += 1;
        slot.held.confirmed();
        Entry {
            registry: self.clone(),
            id: id.to_string(),
            slot: slot.clone(),
        }
    }

    /// Signals the attempt of task `id` held here to stop. `None` if the task is not held
    /// here; else the attempt whose handler had started here (0: none, and none will).
    pub(crate) fn cancel(&self, id: &str) -> Option<u32> {
        let map = self.0.lock().expect("not poisoned");
        let (slot, _) = map.get(id)?;
        slot.stop.store(true, SeqCst);
        slot.cancel.cancel();
        Some(slot.started.load(SeqCst))
    }

    /// Tasks held now (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().expect("not poisoned").len()
    }
}

/// A delivery's registration; leaves the registry on drop.
pub(crate) struct Entry {
    registry: Arc<InFlight>,
    id: String,
    pub(crate) slot: Arc<Slot>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        let mut map = self.registry.0.lock().expect("not poisoned");
        if let Some((_, users)) = map.get_mut(&self.id) {
            *users -= 1;
            if *users == 0 {
                map.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_delivery_waits_for_the_first_and_shares_its_hold() {
        let reg = Arc::new(InFlight::default());
        let first = reg.enter("q.a");
        let turn = first.slot.turn.lock().await;
        std::thread::sleep(Duration::from_millis(20));
        let second = reg.enter("q.a");
        assert!(Arc::ptr_eq(&first.slot, &second.slot));
        assert!(
            first.slot.held.since() < Duration::from_millis(20),
            "the second delivery renews the first one's hold"
        );
        assert!(second.slot.turn.try_lock().is_err(), "the second waits");
        drop(turn);
        assert!(second.slot.turn.try_lock().is_ok());
        let other = reg.enter("q.b");
        assert!(!Arc::ptr_eq(&first.slot, &other.slot));
        drop((first, other));
        assert_eq!(reg.len(), 1);
        drop(second);
        assert_eq!(reg.len(), 0, "the slot leaves with its last delivery");
    }

    #[test]
    fn a_cancel_signal_says_whether_the_handler_started_and_stops_a_later_start() {
        let reg = Arc::new(InFlight::default());
        assert_eq!(reg.cancel("q.a"), None, "not held here");
        let before = reg.enter("q.a");
        assert_eq!(reg.cancel("q.a"), Some(0), "held, not started");
        assert!(!before.slot.start(1), "a start after the signal is refused");
        drop(before);
        let running = reg.enter("q.b");
        assert!(running.slot.start(2));
        assert_eq!(
            reg.cancel("q.b"),
            Some(2),
            "the signal names the started attempt"
        );
        assert!(running.slot.cancel.is_cancelled());
    }
}
