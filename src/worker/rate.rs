//! `ax_task_timeout_rate`: timed-out attempts / ended attempts over a sliding window.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// A sliding window of attempt outcomes (timed out or not).
#[derive(Debug)]
pub(crate) struct TimeoutRate {
    window: Duration,
    events: Mutex<VecDeque<(Instant, bool)>>,
}

impl TimeoutRate {
    pub(crate) fn new(window: Duration) -> TimeoutRate {
        TimeoutRate {
            window,
            events: Mutex::new(VecDeque::new()),
        }
    }

    /// Records an ended attempt and returns the rate over the window.
    pub(crate) fn record(&self, timed_out: bool) -> f64 {
        let now = Instant::now();
        let mut events = self.events.lock().expect("not poisoned");
        events.push_back((now, timed_out));
        while let Some((at, _)) = events.front() {
            if now.duration_since(*at) > self.window {
                events.pop_front();
            } else {
                break;
            }
        }
        let timeouts = events.iter().filter(|(_, t)| *t).count();
        timeouts as f64 / events.len() as f64
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
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(rate.record(false), 0.0);
    }
}
