//! The held tasks of every queue and priority, by tenant, and the weighted fair order they
//! are released in: deficit round robin (Shreedhar and Varghese) over the tenants that have
//! tasks held, each visit adding the tenant's weight to its deficit and releasing that many
//! of its tasks, oldest first. Work-conserving (a tenant with nothing held is not visited,
//! so its share goes to the others at once) and starvation-free (every tenant with tasks
//! is visited once per round). Pure: no broker in here, so the order is unit-tested.

use ax_core::names::Priority;
use bytes::Bytes;
use std::collections::{BTreeMap, HashMap, VecDeque};

/// One held task: its `AX_FAIR` sequence and, unless the memory budget was spent, its
/// message (read back by sequence when it is released otherwise).
#[derive(Debug, Clone)]
pub(crate) struct Held {
    pub(crate) seq: u64,
    pub(crate) body: Option<(async_nats::HeaderMap, Bytes)>,
}

impl Held {
    fn bytes(&self) -> usize {
        // Headers counted at a fixed 512 bytes: a task's dozen headers come near that, and
        // adding them up per message would cost more than the budget saves.
        self.body.as_ref().map_or(0, |(_, p)| p.len() + 512)
    }
}

#[derive(Debug, Default)]
struct Tenant {
    held: VecDeque<Held>,
    deficit: u64,
    /// Its weight was added to the deficit for the visit now under way.
    visiting: bool,
    released: u64,
}

/// The tenants of one queue and priority.
#[derive(Debug, Default)]
pub(crate) struct Lane {
    tenants: HashMap<String, Tenant>,
    /// Tenants with tasks held, in visiting order; the front is being visited.
    active: VecDeque<String>,
}

impl Lane {
    fn add(&mut self, key_hex: &str, held: Held) {
        let tenant = self.tenants.entry(key_hex.to_string()).or_default();
        if tenant.held.is_empty() {
            self.active.push_back(key_hex.to_string());
        }
        tenant.held.push_back(held);
    }

    /// Tasks held.
    pub(crate) fn held(&self) -> usize {
        self.active
            .iter()
            .map(|k| self.tenants.get(k).map_or(0, |t| t.held.len()))
            .sum()
    }

    /// Up to `room` tasks in weighted fair order, by tenant (each tenant's oldest first).
    /// `weight` gives a tenant's weight from its key's hex (at least 1).
    pub(crate) fn take(
        &mut self,
        mut room: usize,
        weight: impl Fn(&str) -> u32,
    ) -> BTreeMap<String, Vec<Held>> {
        let mut out: BTreeMap<String, Vec<Held>> = BTreeMap::new();
        while room > 0 {
            let Some(key) = self.active.front().cloned() else {
                break;
            };
            let tenant = self.tenants.get_mut(&key).expect("active tenants are held");
            if !tenant.visiting {
                tenant.deficit += u64::from(weight(&key).max(1));
                tenant.visiting = true;
            }
            let n = (tenant.deficit as usize).min(tenant.held.len()).min(room);
            let taken = out.entry(key.clone()).or_default();
            taken.extend(tenant.held.drain(..n));
            tenant.deficit -= n as u64;
            tenant.released += n as u64;
            room -= n;
            if tenant.held.is_empty() {
                // An idle tenant keeps no credit (DRR): its share goes to the others.
                tenant.deficit = 0;
                tenant.visiting = false;
                self.active.pop_front();
            } else if tenant.deficit == 0 {
                tenant.visiting = false;
                self.active.rotate_left(1);
            }
        }
        out
    }

    /// Puts back tasks `take` gave that were not released, in their order, ahead of the
    /// tenant's others (and the tenant first in line if it had left it).
    pub(crate) fn put_back(&mut self, key_hex: &str, tasks: Vec<Held>) {
        if tasks.is_empty() {
            return;
        }
        let tenant = self.tenants.entry(key_hex.to_string()).or_default();
        tenant.released = tenant.released.saturating_sub(tasks.len() as u64);
        if tenant.held.is_empty() {
            self.active.push_front(key_hex.to_string());
        }
        for t in tasks.into_iter().rev() {
            tenant.held.push_front(t);
        }
    }

    /// Forgets the tenants with nothing held and starts every release count again.
    pub(crate) fn forget_idle(&mut self) {
        self.tenants.retain(|_, t| !t.held.is_empty());
        for t in self.tenants.values_mut() {
            t.released = 0;
        }
    }

    /// No tenant known.
    pub(crate) fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }

    /// Each tenant's key hex, tasks held and tasks released since the counts started.
    pub(crate) fn report(&self) -> Vec<(String, usize, u64)> {
        let mut out: Vec<_> = self
            .tenants
            .iter()
            .map(|(k, t)| (k.clone(), t.held.len(), t.released))
            .collect();
        out.sort();
        out
    }
}

/// Every lane this dispatcher holds tasks of, and the bytes of messages held in memory.
#[derive(Debug)]
pub(crate) struct Lanes {
    pub(crate) lanes: BTreeMap<(String, Priority), Lane>,
    held_bytes: usize,
    max_held_bytes: usize,
}

impl Lanes {
    pub(crate) fn new(max_held_bytes: usize) -> Lanes {
        Lanes {
            lanes: BTreeMap::new(),
            held_bytes: 0,
            max_held_bytes,
        }
    }

    /// Adds a held task; its message is kept only while the budget allows.
    pub(crate) fn add(&mut self, queue: &str, priority: Priority, key_hex: &str, mut held: Held) {
        let bytes = held.bytes();
        if self.held_bytes + bytes > self.max_held_bytes {
            held.body = None;
        } else {
            self.held_bytes += bytes;
        }
        self.lanes
            .entry((queue.to_string(), priority))
            .or_default()
            .add(key_hex, held);
    }

    /// Counts the messages of tasks leaving the index out of the budget.
    pub(crate) fn forget(&mut self, tasks: &[Held]) {
        let bytes: usize = tasks.iter().map(Held::bytes).sum();
        self.held_bytes = self.held_bytes.saturating_sub(bytes);
    }

    /// Counts put-back tasks' messages in the budget again.
    pub(crate) fn remember(&mut self, tasks: &[Held]) {
        self.held_bytes += tasks.iter().map(Held::bytes).sum::<usize>();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(seq: u64) -> Held {
        Held { seq, body: None }
    }

    fn lane(tenants: &[(&str, u64)]) -> Lane {
        let mut lane = Lane::default();
        let mut seq = 0;
        for (key, n) in tenants {
            for _ in 0..*n {
                seq += 1;
                lane.add(key, held(seq));
            }
        }
        lane
    }

    fn counts(out: &BTreeMap<String, Vec<Held>>) -> Vec<(String, usize)> {
        out.iter().map(|(k, v)| (k.clone(), v.len())).collect()
    }

    #[test]
    fn shares_follow_weights_and_idle_tenants_give_theirs_away() {
        // Backlogs 100,000 / 10 / 10,000 at weights 1 / 1 / 2, released 300 at a time.
        let mut lane = lane(&[("a", 100_000), ("b", 10), ("c", 10_000)]);
        let w = |k: &str| if k == "c" { 2 } else { 1 };
        let first = lane.take(300, w);
        // The small tenant's 10 go in the first release.
        assert_eq!(first["b"].len(), 10);
        let mut total: BTreeMap<String, usize> = BTreeMap::new();
        for _ in 0..20 {
            for (k, v) in lane.take(300, w) {
                *total.entry(k).or_default() += v.len();
            }
        }
        // a : c = 1 : 2 while both have tasks held.
        assert_eq!(total["a"] * 2, total["c"]);
        // Once c is done, a gets everything.
        while !lane.tenants["c"].held.is_empty() {
            lane.take(300, w);
        }
        assert_eq!(counts(&lane.take(300, w)), vec![("a".to_string(), 300)]);
    }

    #[test]
    fn each_tenant_releases_oldest_first_and_put_back_keeps_the_order() {
        let mut lane = lane(&[("a", 5), ("b", 5)]);
        let out = lane.take(4, |_| 1);
        let a: Vec<u64> = out["a"].iter().map(|h| h.seq).collect();
        assert_eq!(a, vec![1, 2]);
        lane.put_back("a", out["a"].clone());
        let again = lane.take(1, |_| 1);
        assert_eq!(again["a"][0].seq, 1);
        assert_eq!(lane.held(), 7);
    }

    #[test]
    fn a_room_smaller_than_a_weight_continues_the_visit() {
        let mut lane = lane(&[("a", 10), ("b", 10)]);
        let w = |k: &str| if k == "a" { 4 } else { 1 };
        let mut order = Vec::new();
        for _ in 0..10 {
            for (k, v) in lane.take(1, w) {
                order.extend(std::iter::repeat_n(k, v.len()));
            }
        }
        assert_eq!(order.concat(), "aaaabaaaab");
    }
}
