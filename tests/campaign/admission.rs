//! The admission load: on queue `x`, tasks with a singleton key (`skeyed`, keys `s0`–`s2`,
//! each submit `cancel_new` or `cancel_in_progress`) and tasks under a rate limit that drops
//! its excess (`dropped`), in bursts larger than either lets through, under the nemesis.
//! Each submit's first send, answer and outcome are noted for `checker_admission`.

use crate::Log;
use ax_core::protocol::{ErrorCode, WireError};
use ax_core::time::now_ms;
use ax_sdk::{Client, ClientError, Collision, TaskSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The dropping rate limit: tokens per second and burst, for every task `dropped` of `x`.
pub const DROP_RATE: f64 = 4.0;
pub const DROP_BURST: u32 = 3;

/// The limit, as `ax.limit.put` takes it.
pub fn drop_def() -> serde_json::Value {
    json!({"name": "dropped", "queue": "x", "task": "dropped", "rate": DROP_RATE,
           "burst": DROP_BURST, "excess": "drop"})
}

/// One submit as the producer saw it: from its first send to its answer.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub first_sent_ms: u64,
    pub answered_ms: u64,
    /// The accepted task's id, or the refusal.
    pub outcome: Result<String, WireError>,
}

/// A singleton submit.
#[derive(Debug, Clone)]
pub struct SingletonNote {
    pub key: String,
    pub cancel_in_progress: bool,
    pub seen: Admitted,
}

/// What the admission load saw.
#[derive(Debug, Default)]
pub struct AdmissionLog {
    pub singletons: Vec<SingletonNote>,
    pub drops: Vec<Admitted>,
    /// Submits never answered within their minute (not checked).
    pub unanswered: usize,
}

/// Submits `spec` until it is answered: accepted or refused for good (`rate_limited` and
/// `running` are answers here, not retried). Refusals join the log's refused submits, so
/// the core rule checks they stored nothing.
async fn admit(ax: &Client, spec: TaskSpec, key: &str, log: &Mutex<Log>) -> Option<Admitted> {
    let first_sent_ms = now_ms();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut clean = true;
    while Instant::now() < deadline {
        let outcome = match ax.submit("x", spec.clone()).await {
            Ok(a) => Ok(a.id),
            Err(ClientError::Refused(e))
                if matches!(e.code, ErrorCode::Unavailable | ErrorCode::Busy) =>
            {
                clean = false;
                log.lock().unwrap().unanswered_retries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(ClientError::Refused(e)) => Err(e),
            Err(_) => {
                clean = false;
                log.lock().unwrap().unanswered_retries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let answered_ms = now_ms();
        let mut log = log.lock().unwrap();
        match &outcome {
            Ok(id) => {
                log.accepted.insert(id.clone());
            }
            Err(e) => log
                .refused
                .push(("x".into(), key.into(), e.code.as_str().into(), clean)),
        }
        return Some(Admitted {
            first_sent_ms,
            answered_ms,
            outcome,
        });
    }
    None
}

/// Bursts every 0.3–0.7 s until `until`: 1–3 singleton submits of one key, or 2–7 submits
/// over the dropping limit.
pub async fn load(
    ax: Client,
    log: Arc<Mutex<Log>>,
    seen: Arc<Mutex<AdmissionLog>>,
    seed: u64,
    until: Instant,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xad_0155);
    let mut k = 0u64;
    while Instant::now() < until {
        let singleton = rng.random_range(0..100) < 60;
        let key = format!("s{}", rng.random_range(0..3));
        let n = if singleton {
            rng.random_range(1..=3)
        } else {
            rng.random_range(2..=7)
        };
        let cancel_in_progress: Vec<bool> = (0..n).map(|_| rng.random_range(0..100) < 30).collect();
        let sleep_ms = rng.random_range(200..800);
        let submits = cancel_in_progress.into_iter().map(|cip| {
            k += 1;
            let idem = format!("a-{seed}-{k}");
            let spec = if singleton {
                let on = if cip {
                    Collision::CancelInProgress
                } else {
                    Collision::CancelNew
                };
                TaskSpec::new("skeyed")
                    .json(&json!({"sleep_ms": sleep_ms}))
                    .singleton(key.clone(), on)
            } else {
                TaskSpec::new("dropped").json(&json!({"sleep_ms": 10}))
            };
            let spec = spec
                .max_attempts(8)
                .backoff(Duration::from_millis(100), Duration::from_secs(1), 0.2)
                .idempotency_key(idem.clone());
            let (ax, log, seen, key) = (ax.clone(), log.clone(), seen.clone(), key.clone());
            async move {
                let admitted = admit(&ax, spec, &idem, &log).await;
                let mut seen = seen.lock().unwrap();
                match admitted {
                    None => seen.unanswered += 1,
                    Some(a) if singleton => seen.singletons.push(SingletonNote {
                        key,
                        cancel_in_progress: cip,
                        seen: a,
                    }),
                    Some(a) => seen.drops.push(a),
                }
            }
        });
        futures::future::join_all(submits).await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..700))).await;
    }
}
