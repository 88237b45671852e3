//! `ax_task_timeout_rate`: timed-out attempts / ended attempts over a sliding window.
//!
//! Counts live in one-second buckets, so recording is O(1) whatever the task rate.

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    second: u64,
    ended: u64,
    timed_out: u64,
}

/// A sliding window of attempt outcomes (timed out or not), by the second.
#[derive(Debug)]
pub(crate) struct TimeoutRate {
    start: Instant,
    buckets: Mutex<Vec<Bucket>>,
}

impl TimeoutRate {
    pub(crate) fn new(window: Duration) -> TimeoutRate {
        let n = window.as_secs().max(1) as usize;
        TimeoutRate {
            start: Instant::now(),
            buckets: Mutex::new(vec![Bucket::default(); n]),
        }
    }

    /// Records an ended attempt and returns the rate over the window.
    pub(crate) fn record(&self, timed_out: bool) -> f64 {
        let second = self.start.elapsed().as_secs() + 1;
        let mut buckets = self.buckets.lock().expect("not poisoned");
        let n = buckets.len() as u64;
        let slot = &mut buckets[(second % n) as usize];
        if slot.second != second {
            *slot = Bucket {
                second,
                ..Bucket::default()
            };
        }
        slot.ended += 1;
        slot.timed_out += u64::from(timed_out);
        let (ended, timeouts) = buckets
            .iter()
            .filter(|b| b.second + n > second)
            .fold((0, 0), |(e, t), b| (e + b.ended, t + b.timed_out));
        timeouts as f64 / ended as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn rate_over_window() {
        let rate = TimeoutRate::new(Duration::from_secs(60));
        assert_eq!(rate.record(true), 1.0);
        assert_eq!(rate.record(false), 0.5);
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(rate.record(false), 1.0 / 3.0);
        tokio::time::advance(Duration::from_secs(31)).await;
        // The first second (with the timeout) has left the window.
        assert_eq!(rate.record(false), 0.0);
        assert_eq!(rate.record(true), 1.0 / 3.0);
        tokio::time::advance(Duration::from_secs(120)).await;
        assert_eq!(rate.record(false), 0.0);
    }
}
