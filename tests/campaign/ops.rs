//! Operations under the nemesis, on queue `x` through the public `Client`
//! API: cancels of running, just-submitted and scheduled tasks, retries of dead tasks, "run
//! now" of scheduled and of retrying tasks, and pause / resume of the queue.

use crate::{submit_until_answered, Log};
use ax_core::time::now_ms;
use ax_sdk::{Client, ClientError, TaskSpec, TaskState};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An acknowledged cancel.
#[derive(Debug, Clone)]
pub struct CancelNote {
    pub id: String,
    pub ack_ms: u64,
    /// The task's state in the answer.
    pub state: TaskState,
}

/// An acknowledged retry of a dead task.
#[derive(Debug, Clone)]
pub struct RetryNote {
    pub id: String,
    /// The attempt the task died at.
    pub dead_attempt: u32,
}

/// An acknowledged "run now".
#[derive(Debug, Clone)]
pub struct RunNowNote {
    pub id: String,
    pub ack_ms: u64,
    /// When it would have run without it (its due time, or its next retry).
    pub due_ms: u64,
    /// The attempt it was at.
    pub attempt: u32,
}

#[derive(Debug, Default)]
pub struct OpsLog {
    pub cancels: Vec<CancelNote>,
    pub retries: Vec<RetryNote>,
    pub run_nows: Vec<RunNowNote>,
    /// (pause acknowledged at, resume sent at), queue `x`.
    pub pauses: Vec<(u64, u64)>,
    /// Operations without an answer, or refused (`conflict`: the task moved on first).
    pub unanswered: usize,
    pub refused: usize,
}

/// Waits (up to 40 s) for task `id` to reach `state`; its record then.
async fn reach(ax: &Client, id: &str, state: TaskState) -> Option<ax_sdk::TaskRecord> {
    let deadline = Instant::now() + Duration::from_secs(40);
    while Instant::now() < deadline {
        if let Ok(Some((rec, _))) = ax.record(id).await {
            if rec.state == state {
                return Some(rec);
            }
            if rec.state.is_terminal() {
                return None;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

async fn submit(ax: &Client, log: &Arc<Mutex<Log>>, spec: TaskSpec) -> Option<String> {
    match submit_until_answered(ax, "x", spec, log).await {
        (Some(Ok(a)), _) => {
            log.lock().unwrap().accepted.insert(a.id.clone());
            Some(a.id)
        }
        _ => None,
    }
}

/// One operation on a task of its own.
async fn one(
    ax: Client,
    log: Arc<Mutex<Log>>,
    ops: Arc<Mutex<OpsLog>>,
    key: String,
    mut rng: StdRng,
) {
    let fast = |s: TaskSpec| {
        s.max_attempts(6)
            .backoff(Duration::from_millis(100), Duration::from_secs(1), 0.2)
    };
    let kind = rng.random_range(0..100);
    let spec = match kind {
        // Cancelled while it runs (1.5 s).
        0..=24 => fast(TaskSpec::new("slow").json(&json!({"sleep_ms": 1500}))),
        // Cancelled at once: pending, running or done by then.
        25..=39 => fast(TaskSpec::new("quick").json(&json!({"sleep_ms": 100}))),
        // Cancelled, or run now, while scheduled 20–30 s ahead.
        40..=69 => fast(TaskSpec::new("early").json(&json!({"sleep_ms": 20})))
            .delay(Duration::from_millis(rng.random_range(20_000..30_000))),
        // Dead at attempt 1 (a class it may not retry), then retried: succeeds at 2.
        70..=84 => TaskSpec::new("once")
            .json(&json!({"sleep_ms": 20, "fail_attempts": 1}))
            .max_attempts(5)
            .no_retry_on(["flaky"]),
        // Fails attempt 1, waits 30 s to retry: run now.
        _ => TaskSpec::new("later-retry")
            .json(&json!({"sleep_ms": 20, "fail_attempts": 1}))
            .max_attempts(5)
            .backoff(Duration::from_secs(30), Duration::from_secs(60), 0.2),
    };
    let Some(id) = submit(&ax, &log, spec.idempotency_key(key)).await else {
        return;
    };
    let cancel = match kind {
        0..=24 => Some(rng.random_range(300..900)),
        25..=39 => Some(rng.random_range(0..30)),
        40..=54 => Some(rng.random_range(100..500)),
        _ => None,
    };
    if let Some(ms) = cancel {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        let answer = ax.cancel_task(&id).await;
        let ack_ms = now_ms();
        let mut ops = ops.lock().unwrap();
        match answer {
            Ok(out) => ops.cancels.push(CancelNote {
                id,
                ack_ms,
                state: out.state,
            }),
            Err(ClientError::Refused(_)) => ops.refused += 1,
            Err(_) => ops.unanswered += 1,
        }
        return;
    }
    if (55..=69).contains(&kind) {
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..800))).await;
        let Ok(Some((rec, _))) = ax.record(&id).await else {
            return;
        };
        let answer = ax.run_now(&id).await;
        let ack_ms = now_ms();
        let mut ops = ops.lock().unwrap();
        match answer {
            Ok(_) => ops.run_nows.push(RunNowNote {
                id,
                ack_ms,
                due_ms: rec.run_at_ms.unwrap_or(0),
                attempt: rec.attempt,
            }),
            Err(ClientError::Refused(_)) => ops.refused += 1,
            Err(_) => ops.unanswered += 1,
        }
        return;
    }
    if (70..=84).contains(&kind) {
        let Some(dead) = reach(&ax, &id, TaskState::Dead).await else {
            return;
        };
        let answer = ax.retry_task(&id, false).await;
        let mut ops = ops.lock().unwrap();
        match answer {
            Ok(_) => ops.retries.push(RetryNote {
                id,
                dead_attempt: dead.attempt,
            }),
            Err(ClientError::Refused(_)) => ops.refused += 1,
            Err(_) => ops.unanswered += 1,
        }
        return;
    }
    let Some(waiting) = reach(&ax, &id, TaskState::Retrying).await else {
        return;
    };
    let answer = ax.run_now(&id).await;
    let ack_ms = now_ms();
    let mut ops = ops.lock().unwrap();
    match answer {
        Ok(_) => ops.run_nows.push(RunNowNote {
            id,
            ack_ms,
            due_ms: waiting.next_retry_at_ms.unwrap_or(0),
            attempt: waiting.attempt,
        }),
        Err(ClientError::Refused(_)) => ops.refused += 1,
        Err(_) => ops.unanswered += 1,
    }
}

/// An operation every 0.3–0.8 s until `until`, each on a task of its own; and queue `x`
/// paused for 1–2 s every 6–10 s.
pub async fn load(
    ax: Client,
    log: Arc<Mutex<Log>>,
    ops: Arc<Mutex<OpsLog>>,
    seed: u64,
    until: Instant,
) {
    let pauses = {
        let (ax, ops) = (ax.clone(), ops.clone());
        let mut rng = StdRng::seed_from_u64(seed ^ 0xba05e);
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(rng.random_range(6000..10_000))).await;
                if Instant::now() >= until {
                    break;
                }
                if ax.pause_queue("x", Some("campaign")).await.is_err() {
                    ops.lock().unwrap().unanswered += 1;
                    continue;
                }
                let paused = now_ms();
                tokio::time::sleep(Duration::from_millis(rng.random_range(1000..2000))).await;
                // Resumed whatever happens (the next load needs the queue).
                let resumed = now_ms();
                crate::support::eventually(
                    Duration::from_secs(60),
                    "queue x to resume",
                    || async { ax.resume_queue("x").await.ok() },
                )
                .await;
                ops.lock().unwrap().pauses.push((paused, resumed));
            }
        }
    };
    let each = async move {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x0b5);
        let mut each = Vec::new();
        let mut k = 0u64;
        while Instant::now() < until {
            k += 1;
            let one_rng = StdRng::seed_from_u64(rng.random());
            let key = format!("o-{seed}-{k}");
            each.push(tokio::spawn(one(
                ax.clone(),
                log.clone(),
                ops.clone(),
                key,
                one_rng,
            )));
            tokio::time::sleep(Duration::from_millis(rng.random_range(300..800))).await;
        }
        for e in each {
            let _ = e.await;
        }
    };
    tokio::join!(pauses, each);
}
