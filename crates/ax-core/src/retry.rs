//! Waiting for what a process needs (NATS, the topology, a queue) with backoff and one
//! clear log line, so servers, workers and producers can start in any order.

use rand::Rng;
use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Shortest and longest pause between tries.
const FIRST: Duration = Duration::from_millis(100);
const MOST: Duration = Duration::from_secs(5);
/// While still waiting, the log line is repeated this often.
const REMIND: Duration = Duration::from_secs(60);

/// The pause before try `n` (0-based): 100 ms doubling to 5 s, shortened by up to 20 %.
pub fn pause(n: u32) -> Duration {
    let nominal = FIRST.saturating_mul(1 << n.min(10)).min(MOST);
    nominal.mul_f64(1.0 - rand::rng().random_range(0.0..0.2))
}

/// Calls `f` until it returns `Ok`, pausing with backoff in between. The first failure
/// logs one line naming `what` is awaited and why; a success after waiting logs that it
/// arrived. Returns `None` if `shutdown` is cancelled first.
pub async fn until_ok<T, E, F, Fut>(what: &str, shutdown: &CancellationToken, mut f: F) -> Option<T>
where
    E: Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let started = Instant::now();
    let mut reminded = started;
    let mut n = 0u32;
    loop {
        let attempt = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = f() => r,
        };
        match attempt {
            Ok(v) => {
                if n > 0 {
                    info!(waited = ?started.elapsed(), "{what}: ready");
                }
                return Some(v);
            }
            Err(e) if n == 0 => {
                warn!(cause = %e, "waiting for {what}; retrying with backoff");
            }
            Err(e) if reminded.elapsed() >= REMIND => {
                reminded = Instant::now();
                warn!(cause = %e, waited = ?started.elapsed(), "still waiting for {what}");
            }
            Err(e) => debug!(cause = %e, "still waiting for {what}"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(pause(n)) => {}
        }
        n = n.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_grow_to_a_bound() {
        assert!(pause(0) <= FIRST && pause(0) >= FIRST.mul_f64(0.8));
        assert!(pause(3) <= Duration::from_millis(800));
        assert!(pause(30) <= MOST && pause(30) >= MOST.mul_f64(0.8));
    }

    #[tokio::test(start_paused = true)]
    async fn retries_until_ok_or_shutdown() {
        let token = CancellationToken::new();
        let mut calls = 0;
        let got = until_ok("a thing", &token, || {
            calls += 1;
            let c = calls;
            async move {
                if c < 4 {
                    Err("not yet")
                } else {
                    Ok(c)
                }
            }
        })
        .await;
        assert_eq!(got, Some(4));
        token.cancel();
        let never: Option<()> = until_ok("never", &token, || async { Err::<(), _>("no") }).await;
        assert_eq!(never, None);
    }
}
