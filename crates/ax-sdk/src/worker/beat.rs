//! The soft timeout: an attempt of a name with a `heartbeat_timeout` must call
//! [`Task::heartbeat`](super::Task::heartbeat) at least that often, or it is judged stuck,
//! stopped and failed with class `heartbeat_timeout` (retried like any failure). The
//! broker-side heartbeat (`+WPI`) is separate and automatic: it keeps the delivery while
//! the worker lives; this one tells whether the handler still makes progress.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// When the handler last said it was alive.
#[derive(Debug)]
pub(crate) struct Beats {
    started: Instant,
    /// ms after `started` of the last beat.
    last_ms: AtomicU64,
    /// Beats so far.
    count: AtomicU64,
}

impl Default for Beats {
    fn default() -> Self {
        Beats {
            started: Instant::now(),
            last_ms: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl Beats {
    /// Records a beat now.
    pub(crate) fn beat(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Beats so far.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn last(&self) -> Instant {
        self.started + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    /// Resolves once no beat came for `timeout` (since the start or the last beat);
    /// never without a timeout.
    pub(crate) async fn stalled(&self, timeout: Option<Duration>) {
        let Some(timeout) = timeout else {
            return std::future::pending().await;
        };
        loop {
            let deadline = self.last() + timeout;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline.into()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn beats_push_the_deadline_and_silence_ends_it() {
        let beats = std::sync::Arc::new(Beats::default());
        let timeout = Some(Duration::from_millis(60));
        let keeper = {
            let beats = beats.clone();
            tokio::spawn(async move {
                for _ in 0..6 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    beats.beat();
                }
            })
        };
        let started = Instant::now();
        beats.stalled(timeout).await;
        let took = started.elapsed();
        keeper.await.unwrap();
        // Six beats 20 ms apart, then 60 ms of silence: at least 120 + 60 ms.
        assert!(took >= Duration::from_millis(175), "{took:?}");
        assert_eq!(beats.count(), 6);
        // Without a timeout it never resolves.
        let never = tokio::time::timeout(Duration::from_millis(30), beats.stalled(None)).await;
        assert!(never.is_err());
    }
}
