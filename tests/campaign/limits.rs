//! The limited load: on queue `x`, a per-key rate (task `rated`, a limit shared with
//! queue `q`: every other task of its bursts goes there, drawing from the same buckets), a per-key
//! concurrency cap (task `capped`) and a singleton (task `single`), set through the public
//! `Client` API and fed bursts larger than they let through, under the nemesis.

use crate::{submit_until_answered, Log};
use ax_sdk::{Client, TaskSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The per-key rate: starts per second and burst.
pub const RATE: f64 = 5.0;
pub const BURST: u32 = 2;
/// The per-key cap.
pub const CAP: usize = 2;

/// The limits, as `ax.limit.put` takes them.
pub fn defs() -> Vec<serde_json::Value> {
    vec![
        json!({"name": "rated", "queue": "x", "queues": ["x", "q"], "task": "rated",
               "per_key": true, "rate": RATE, "burst": BURST}),
        json!({"name": "capped", "queue": "x", "task": "capped", "per_key": true,
               "concurrency": CAP}),
        json!({"name": "single", "queue": "x", "task": "single", "concurrency": 1}),
    ]
}

/// Which limited task has which key: task id → (limit, key; the singleton's key is `*`).
#[derive(Debug, Default)]
pub struct LimitLog {
    pub keyed: HashMap<String, (&'static str, String)>,
}

/// Bursts of limited tasks every 0.3–0.7 s until `until`.
pub async fn load(
    ax: Client,
    log: Arc<Mutex<Log>>,
    limits: Arc<Mutex<LimitLog>>,
    seed: u64,
    until: Instant,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x11_0175);
    let mut k = 0u64;
    while Instant::now() < until {
        let (limit, key, n, sleep_ms) = match rng.random_range(0..100) {
            0..=44 => (
                "rated",
                format!("r{}", rng.random_range(0..3)),
                rng.random_range(3..=8),
                20,
            ),
            45..=79 => (
                "capped",
                format!("c{}", rng.random_range(0..3)),
                rng.random_range(3..=6),
                rng.random_range(300..600),
            ),
            _ => ("single", "*".to_string(), rng.random_range(2..=4), 100),
        };
        // The shared rate's bursts are split between the two queues, task by task: one
        // bucket per queue would let both queues' bursts through at once.
        let submits = (0..n).map(|i| {
            let queue = if limit == "rated" && i % 2 == 1 {
                "q"
            } else {
                "x"
            };
            k += 1;
            let mut spec = TaskSpec::new(limit)
                .json(&json!({"sleep_ms": sleep_ms}))
                .max_attempts(8)
                .backoff(Duration::from_millis(100), Duration::from_secs(1), 0.2)
                .idempotency_key(format!("l-{seed}-{k}"));
            if limit != "single" {
                spec = spec.limit_key(key.clone());
            }
            let (ax, log, limits, key) = (ax.clone(), log.clone(), limits.clone(), key.clone());
            async move {
                if let (Some(Ok(a)), _) = submit_until_answered(&ax, queue, spec, &log).await {
                    log.lock().unwrap().accepted.insert(a.id.clone());
                    limits.lock().unwrap().keyed.insert(a.id, (limit, key));
                }
            }
        });
        futures::future::join_all(submits).await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..700))).await;
    }
}
