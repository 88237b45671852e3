//! The fairness load: on queue `fq` (one worker of its own, `FQ_SLOTS` at once, priority
//! aging after `AGING_MS`; the nemesis never touches it), episodes one after the other:
//!
//! - **fair**: a backlog of `FAIR_BACKLOG` tasks of tenant `big` (weight 1), then, once
//!   all of them are accepted, `FAIR_WAITERS` tasks of tenant `small` (weight 2), all at
//!   `normal` under the queue's fair shares (depth `FAIR_DEPTH`);
//! - **aging**: a backlog of `AGING_BACKLOG` `normal` tasks, then `AGING_WAITERS` `low`
//!   ones.
//!
//! Each waiter's first send and answer are noted for `checker_fairness`; every accepted
//! task joins the accepted set, so the core rules (ran once, ended) cover them too.

use crate::{submit_until_answered, Log};
use ax_core::time::now_ms;
use ax_sdk::{Client, Priority, TaskSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The queue, its worker's slots and its aging threshold.
pub const FQ: &str = "fq";
pub const FQ_SLOTS: u64 = 2;
pub const AGING_MS: u64 = 400;
/// The fair shares of `fq`: tasks released to the ready subject at most, and the weights.
pub const FAIR_DEPTH: u64 = 2;
pub const BIG: &str = "big";
pub const SMALL: &str = "small";
pub const BIG_WEIGHT: u64 = 1;
pub const SMALL_WEIGHT: u64 = 2;
/// Tasks per episode: the backlog, then the waiters.
const FAIR_BACKLOG: usize = 60;
const FAIR_WAITERS: usize = 4;
const AGING_BACKLOG: usize = 130;
const AGING_WAITERS: usize = 3;
/// Handler times (ms): the backlogs outlast the checked bounds several times over.
const FAIR_SLEEP_MS: u64 = 30;
const AGING_SLEEP_MS: u64 = 60;

/// The fair shares of `fq`, as `ax.limits.fair_put` takes them.
pub fn fair_def() -> serde_json::Value {
    json!({"queue": FQ, "depth": FAIR_DEPTH, "weights": {BIG: BIG_WEIGHT, SMALL: SMALL_WEIGHT}})
}

/// One waiter: a `small` task (fair) or a `low` one (aging).
#[derive(Debug, Clone)]
pub struct Waiter {
    pub id: String,
    pub first_sent_ms: u64,
    pub answered_ms: u64,
}

/// One episode: what it was and the ids it made.
#[derive(Debug, Clone)]
pub struct Episode {
    pub fair: bool,
    pub backlog: Vec<String>,
    pub waiters: Vec<Waiter>,
}

/// What the fairness load saw.
#[derive(Debug, Default)]
pub struct FairnessLog {
    pub episodes: Vec<Episode>,
    /// Submits never answered within their minute (not checked).
    pub unanswered: usize,
}

/// Submits one task of `fq`; its id if accepted (the answer noted in the core log).
async fn submit(ax: &Client, log: &Mutex<Log>, spec: TaskSpec) -> Option<Waiter> {
    let first_sent_ms = now_ms();
    let (answer, _) = submit_until_answered(ax, FQ, spec, log).await;
    let id = answer?.ok()?.id;
    log.lock().unwrap().accepted.insert(id.clone());
    Some(Waiter {
        id,
        first_sent_ms,
        answered_ms: now_ms(),
    })
}

/// Episodes until `until`, fair and aging in turn, each followed by a pause long enough
/// for its backlog to drain.
pub async fn load(
    ax: Client,
    log: Arc<Mutex<Log>>,
    seen: Arc<Mutex<FairnessLog>>,
    seed: u64,
    until: Instant,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xfa_17);
    let mut k = 0u64;
    let mut fair = rng.random_bool(0.5);
    while Instant::now() < until {
        let (backlog_n, waiters_n, sleep_ms) = if fair {
            (FAIR_BACKLOG, FAIR_WAITERS, FAIR_SLEEP_MS)
        } else {
            (AGING_BACKLOG, AGING_WAITERS, AGING_SLEEP_MS)
        };
        let mut spec = |waiter: bool| {
            k += 1;
            let spec = TaskSpec::new(if waiter { "fwait" } else { "fback" })
                .json(&json!({"sleep_ms": sleep_ms}))
                .idempotency_key(format!("f-{seed}-{k}"));
            match (fair, waiter) {
                (true, false) => spec.fair_key(BIG),
                (true, true) => spec.fair_key(SMALL),
                (false, false) => spec,
                (false, true) => spec.priority(Priority::Low),
            }
        };
        let backlog: Vec<TaskSpec> = (0..backlog_n).map(|_| spec(false)).collect();
        let waiters: Vec<TaskSpec> = (0..waiters_n).map(|_| spec(true)).collect();
        let backlog: Vec<Option<Waiter>> =
            futures::StreamExt::collect(futures::StreamExt::buffer_unordered(
                futures::stream::iter(backlog.into_iter().map(|s| submit(&ax, &log, s))),
                16,
            ))
            .await;
        // The waiters only once the whole backlog is accepted: stored before them.
        let waiters: Vec<Option<Waiter>> =
            futures::future::join_all(waiters.into_iter().map(|s| submit(&ax, &log, s))).await;
        let unanswered = backlog
            .iter()
            .chain(&waiters)
            .filter(|w| w.is_none())
            .count();
        let backlog_drain = (backlog_n as u64 * sleep_ms) / FQ_SLOTS;
        {
            let mut seen = seen.lock().unwrap();
            seen.unanswered += unanswered;
            seen.episodes.push(Episode {
                fair,
                backlog: backlog.into_iter().flatten().map(|w| w.id).collect(),
                waiters: waiters.into_iter().flatten().collect(),
            });
        }
        tokio::time::sleep(Duration::from_millis(
            backlog_drain + rng.random_range(300..1200),
        ))
        .await;
        fair = !fair;
    }
}
