//! Whether this worker may have missed an operator's cancel signal around a claim.
//!
//! Cancel signals are core NATS messages (`ax.cancel.<queue>`): one sent while the worker's
//! connection is away (a broker restarted, a stalled process dropped as stale) is lost. An
//! attempt that would start unwritten trusts that any cancel made after its claim read the
//! record reached it; across a reconnect it cannot, so such an attempt writes `running`
//! first (as a late start does) and meets a `cancelled` record instead of running. That
//! covers a reconnect between the claim's read and the start, and one noticed shortly
//! before the read ([`SIGNAL_GAP`]: a cancel whose signal was lost writes its record after
//! waiting for a holder's answer, so it may land after a read made just after the
//! reconnect).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long before a claim's read a reconnect still makes its start write `running`
/// first: an operator's cancel waits up to 500 ms for the holder's answer before it writes
/// the record (`ax-server`'s `ops::holder::HOLDER_WAIT`), with room for that write.
pub(crate) const SIGNAL_GAP: Duration = Duration::from_millis(1500);

/// The connections of this worker's client, and when a new one was last noticed. Read on
/// every unwritten start: atomics, no lock.
pub(crate) struct Reconnected {
    stats: Arc<async_nats::Statistics>,
    /// Connections counted here so far.
    seen: AtomicU64,
    /// When the latest of them was first seen here: ms after `base`, plus 1 (0: none
    /// since the start).
    noticed: AtomicU64,
    base: Instant,
}

impl Reconnected {
    pub(crate) fn new(stats: Arc<async_nats::Statistics>) -> Reconnected {
        let now = stats.connects.load(Ordering::SeqCst);
        Reconnected {
            stats,
            seen: AtomicU64::new(now),
            noticed: AtomicU64::new(0),
            base: Instant::now(),
        }
    }

    /// The connections made so far: taken before a claim reads the record.
    pub(crate) fn count(&self) -> u64 {
        self.stats.connects.load(Ordering::SeqCst)
    }

    /// True if a cancel signal meant for a claim that read the record at `read`, with
    /// `count` connections made then, may have been lost: the client connected again
    /// since, or a new connection was noticed less than [`SIGNAL_GAP`] before `read`. A
    /// connection is noticed here, at the first start that asks after it (never sooner
    /// than it was made, so the answer errs on the side of the write).
    pub(crate) fn around(&self, read: Instant, count: u64) -> bool {
        let now = self.count();
        let seen = self.seen.load(Ordering::SeqCst);
        if now != seen
            && self
                .seen
                .compare_exchange(seen, now, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            let at = self.base.elapsed().as_millis() as u64 + 1;
            self.noticed.store(at, Ordering::SeqCst);
        }
        let noticed = match self.noticed.load(Ordering::SeqCst) {
            0 => None,
            ms => Some(self.base + Duration::from_millis(ms - 1)),
        };
        now != count || noticed.is_some_and(|at| at + SIGNAL_GAP >= read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_across_or_just_after_a_reconnect_is_not_trusted() {
        let stats = Arc::new(async_nats::Statistics::default());
        stats.connects.store(1, Ordering::SeqCst);
        let r = Reconnected::new(stats.clone());
        let read = Instant::now();
        let count = r.count();
        assert!(
            !r.around(read, count),
            "no reconnect: the signal would have come"
        );
        // Reconnected between the read and the start.
        stats.connects.store(2, Ordering::SeqCst);
        assert!(r.around(read, count));
        // A later claim reading just after that reconnect was noticed.
        let read = Instant::now();
        assert!(r.around(read, r.count()));
        // Long after it: trusted again.
        let later = Instant::now() + SIGNAL_GAP + Duration::from_millis(1);
        assert!(!r.around(later, r.count()));
    }
}
