//! Purges of released tasks from `AX_FAIR`, off the release rounds' path: a round asks
//! for its tenants' purges and goes on; one task of the term purges what was asked, each
//! tenant's filter once for the highest sequence asked since its last purge, at most every
//! [`PASS_PAUSE`]. Awaited in the round, the purges held up the next round and so the
//! releases (a depth of 64 released at 0.34 × the queue without fair keys, against 0.55 ×
//! without purges: docs/PERFORMANCE.md, "Fair shares"). A purge that fails is asked again
//! at the next pass;
//! one lost with its leader leaves tasks the next leader re-publishes (de-duplicated, or
//! retired at their claim, as a release whose purge was never sent: `super`).

use async_nats::jetstream::stream;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;
use tracing::debug;

/// The pause after each pass over the purges asked: a tenant's filter is purged at most
/// this often. A purge by filter costs the broker a walk over the tenant's subjects (one
/// per held task), so purged every round it slowed the releases as much as awaiting it.
const PASS_PAUSE: Duration = Duration::from_millis(250);

/// The purges asked for and not done yet, by tenant filter.
#[derive(Debug, Default)]
pub(crate) struct Purges {
    /// Filter → purge every message of it below this sequence.
    wanted: Mutex<HashMap<String, u64>>,
    asked: Notify,
}

impl Purges {
    /// Asks for every message of `filter` below `below` to be purged.
    pub(crate) fn ask(&self, filter: String, below: u64) {
        let mut wanted = self.wanted.lock().expect("not poisoned");
        let at = wanted.entry(filter).or_insert(0);
        *at = (*at).max(below);
        drop(wanted);
        self.asked.notify_one();
    }

    /// Purges what is asked, until the term ends (the task is aborted with it).
    pub(crate) async fn run(&self, stream: stream::Stream) {
        loop {
            self.asked.notified().await;
            let batch: Vec<(String, u64)> =
                self.wanted.lock().expect("not poisoned").drain().collect();
            for (filter, below) in batch {
                if let Err(e) = stream.purge().filter(&filter).sequence(below).await {
                    debug!(%filter, cause = %e, "released tasks not purged from AX_FAIR yet; asked again");
                    self.ask(filter, below);
                }
            }
            tokio::time::sleep(PASS_PAUSE).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_for_one_filter_keep_the_highest_sequence() {
        let purges = Purges::default();
        purges.ask("ax.fair.q.normal.aa.>".into(), 10);
        purges.ask("ax.fair.q.normal.aa.>".into(), 7);
        purges.ask("ax.fair.q.normal.bb.>".into(), 3);
        let wanted = purges.wanted.lock().unwrap().clone();
        assert_eq!(wanted["ax.fair.q.normal.aa.>"], 10);
        assert_eq!(wanted["ax.fair.q.normal.bb.>"], 3);
    }
}
