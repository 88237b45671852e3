//! Priority aging: a priority whose oldest waiting task has waited longer than the
//! worker's aging threshold is picked as the priority above it (`low` as `normal`), and
//! after twice the threshold as the one above that (`low` as `high`).
//!
//! Every `threshold / 4` (at least 100 ms, at most 1 s) the worker looks at the first
//! message of its `normal` and `low` consumers that no worker has been handed yet (the
//! consumer's delivered sequence + 1 on the queue's ready subject, one direct get) and
//! takes its age from the time the broker stored it. Tasks are not moved or copied: a
//! task is delivered once, from where it was stored, only sooner ([`super::fetch::Picker`]
//! gives the aged priority the weight and the place of the one it is served as).

use crate::names::{self, Priority};
use async_nats::jetstream::{self, consumer::PullConsumer};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// A look at the oldest waiting task slower than this is logged (aging lags behind it).
const SLOW_LOOK: Duration = Duration::from_secs(1);
/// A look is given up after this (the levels stay as they were; the next tick looks
/// again): a request lost in a broker's restart would otherwise hold every level stale
/// for the client's request timeout (10 s was seen in the fault campaign).
const LOOK_TIMEOUT: Duration = Duration::from_millis(1500);

/// How many levels each priority is raised now (high, normal, low), shared with the fetch
/// loop.
#[derive(Debug, Default)]
pub(crate) struct Levels([AtomicU8; 3]);

impl Levels {
    /// The levels now.
    pub(crate) fn get(&self) -> [u8; 3] {
        [0, 1, 2].map(|i| self.0[i].load(Ordering::Relaxed))
    }

    fn set(&self, p: Priority, level: u8) {
        self.0[p.index()].store(level, Ordering::Relaxed);
    }
}

/// The levels a waiting task of priority `p` is raised after waiting `age`: one per
/// `threshold` waited, never above `high`.
pub(crate) fn level(p: Priority, age: Duration, threshold: Duration) -> u8 {
    let steps = age.as_millis() / threshold.as_millis().max(1);
    steps.min(p.index() as u128) as u8
}

/// Follows the age of the oldest undelivered task of `normal` and `low` until `shutdown`.
pub(crate) async fn follow(
    js: jetstream::Context,
    queue: String,
    consumers: Arc<Vec<PullConsumer>>,
    threshold: Duration,
    levels: Arc<Levels>,
    shutdown: CancellationToken,
) {
    let tick = (threshold / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
    loop {
        for p in [Priority::Normal, Priority::Low] {
            let asked = std::time::Instant::now();
            let look = tokio::time::timeout(
                LOOK_TIMEOUT,
                oldest_waiting(&js, &queue, &consumers[p.index()], p),
            )
            .await
            .unwrap_or_else(|_| Err("no answer within the look's timeout".into()));
            let took = asked.elapsed();
            if took > SLOW_LOOK {
                // The levels were stale meanwhile: say so (a broker slow to answer).
                warn!(queue = %queue, priority = %p, took_ms = took.as_millis() as u64,
                    "aging: a look at the oldest waiting task was slow; aging lagged behind");
            }
            match look {
                Ok(age) => levels.set(p, age.map_or(0, |a| level(p, a, threshold))),
                // Left as it was: the next look decides.
                Err(e) => {
                    debug!(queue = %queue, priority = %p, cause = %e, "aging: cannot read the oldest waiting task")
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(tick) => {}
        }
    }
}

/// How long the first task of priority `p` that no worker has been handed has been
/// stored; `None` if every stored one has been handed out.
async fn oldest_waiting(
    js: &jetstream::Context,
    queue: &str,
    consumer: &PullConsumer,
    p: Priority,
) -> Result<Option<Duration>, async_nats::Error> {
    let mut consumer = consumer.clone();
    let info = consumer.info().await?;
    if info.num_pending == 0 {
        return Ok(None);
    }
    let from = info.delivered.stream_sequence + 1;
    let stream = js.get_stream_no_info(p.ready_stream()).await?;
    let msg = match stream
        .direct_get_next_for_subject(names::ready_subject(queue, p), Some(from))
        .await
    {
        Ok(msg) => msg,
        Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let stored_ms = (msg.time.unix_timestamp_nanos() / 1_000_000).max(0) as u64;
    Ok(Some(Duration::from_millis(
        crate::time::now_ms().saturating_sub(stored_ms),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_rises_one_level_per_threshold_waited_up_to_high() {
        let t = Duration::from_secs(10);
        let s = Duration::from_secs;
        assert_eq!(level(Priority::Low, s(9), t), 0);
        assert_eq!(level(Priority::Low, s(10), t), 1);
        assert_eq!(level(Priority::Low, s(25), t), 2);
        assert_eq!(level(Priority::Low, s(1000), t), 2);
        assert_eq!(level(Priority::Normal, s(1000), t), 1);
        assert_eq!(level(Priority::High, s(1000), t), 0);
    }
}
