//! Delayed tasks shared among servers.
//!
//! `AX_DELAYED` is split into [`DELAYED_PARTITIONS`] partitions by a hash of the task id
//! (the last token of the subject, `names::delayed_partition`). Each partition is owned
//! through a lease in `AX_LEASES` (key `delayed.<p>`, the same lease as the trigger
//! engine's, renewed every fifth of the TTL; a standby takes it over after seeing it
//! unchanged for a whole TTL). The owner runs one [`Scheduler`] for the partition: it indexes and
//! dispatches only that partition's tasks.
//!
//! **Fair share.** Each server announces itself by writing `members.<id>` every fifth of
//! the TTL; a member not heard from for a TTL is gone. With `n` members a server wants
//! `ceil(P / n)` partitions: it takes free or expired ones while it has fewer, and releases
//! its highest-numbered ones while it has more, so a joining server gets its share within
//! a few ticks and a killed one's partitions are taken over about one TTL after its last
//! renewal. A partition may briefly be dispatched by its old and its new owner at once
//! (the old one learns of the loss one renewal later): that is harmless, as it always was
//! with several servers, because a dispatch is a publish with `Nats-Msg-Id` = task id
//! followed by a delete by sequence.

use super::{ScheduleError, Scheduler};
use crate::lease::Lease;
use async_nats::jetstream::kv;
use ax_core::metrics as m;
use ax_core::names::{delayed_filters, DELAYED_PARTITIONS, LEASES_BUCKET};
use futures::StreamExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// The delayed-task partitions a server takes part in.
pub(crate) struct Partitions {
    /// The settings every partition's scheduler starts from (budgets are for the whole
    /// server; each partition gets its share).
    pub(crate) scheduler: Scheduler,
    /// This server's id (lease holder and member name).
    pub(crate) id: String,
    /// Lease TTL.
    pub(crate) ttl: Duration,
}

type Running = BTreeMap<u32, (CancellationToken, JoinHandle<Result<(), ScheduleError>>)>;

fn member_key(id: &str) -> String {
    let clean: String = id
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '-' | '_' => c,
            _ => '_',
        })
        .collect();
    format!("members.{clean}")
}

impl Partitions {
    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), ScheduleError> {
        let js = self.scheduler.js.clone();
        let kv = ax_core::retry::until_ok(
            "the AX_LEASES bucket, to share delayed tasks",
            &shutdown,
            || js.get_key_value(LEASES_BUCKET),
        )
        .await;
        let Some(kv) = kv else { return Ok(()) };
        let heard: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let members = tokio::spawn(follow_members(kv.clone(), heard.clone()));
        let me = member_key(&self.id);
        let p_all = DELAYED_PARTITIONS;
        let mut leases: Vec<Lease> = (0..p_all)
            .map(|p| {
                Lease::new(
                    js.client(),
                    kv.clone(),
                    format!("delayed.{p}"),
                    self.id.clone(),
                    self.ttl,
                )
            })
            .collect();
        // Servers start looking at different partitions, so they rarely race for one.
        let first = ax_core::names::delayed_partition(&self.id);
        let order: Vec<u32> = (0..p_all).map(|i| (first + i) % p_all).collect();
        let mut running: Running = BTreeMap::new();
        // Renew and look every fifth of the TTL: a lease left unrenewed is seen unchanged for
        // a TTL within TTL + 1/5 TTL of its last renewal.
        let mut tick = tokio::time::interval(self.ttl / 5);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let outcome = loop {
            tokio::select! {
                _ = shutdown.cancelled() => break Ok(()),
                _ = tick.tick() => {}
            }
            // A scheduler that ended on its own is started again while the lease is ours
            // (below): a partition is never left without dispatch while this server runs.
            restart_ended(&mut running).await;
            if let Err(e) = kv.put(&me, self.id.clone().into()).await {
                warn!(cause = %e, "cannot announce this server to the delayed-task partitions");
            }
            let live = {
                let mut heard = heard.lock().expect("not poisoned");
                heard.insert(me.clone(), Instant::now());
                heard.retain(|_, at| at.elapsed() < self.ttl);
                heard.len()
            };
            let fair = p_all.div_ceil(live as u32) as usize;
            for p in order.iter().copied() {
                let lease = &mut leases[p as usize];
                let owned = running.contains_key(&p);
                if owned {
                    if !lease.hold().await {
                        info!(
                            partition = p,
                            "delayed-task partition lost (taken by another server, or not renewed within its TTL)"
                        );
                        stop(&mut running, p).await;
                    }
                } else {
                    let want = running.len() < fair;
                    if lease.hold_if(want).await {
                        info!(
                            partition = p,
                            owned = running.len() + 1,
                            fair,
                            "delayed-task partition taken"
                        );
                        running.insert(p, self.start(p, &shutdown));
                    }
                }
            }
            while running.len() > fair {
                let p = *running.keys().next_back().expect("not empty");
                info!(
                    partition = p,
                    fair, "delayed-task partition handed over (fair share)"
                );
                stop(&mut running, p).await;
                leases[p as usize].release().await;
            }
            metrics::gauge!(m::DELAYED_PARTITIONS_OWNED).set(running.len() as f64);
        };
        let owned: Vec<u32> = running.keys().copied().collect();
        for p in owned {
            stop(&mut running, p).await;
            leases[p as usize].release().await;
        }
        let _ = kv.delete(&me).await;
        members.abort();
        metrics::gauge!(m::DELAYED_PARTITIONS_OWNED).set(0.0);
        outcome
    }

    /// Starts the scheduler of partition `p`.
    fn start(
        &self,
        p: u32,
        shutdown: &CancellationToken,
    ) -> (CancellationToken, JoinHandle<Result<(), ScheduleError>>) {
        let parts = DELAYED_PARTITIONS as usize;
        let mut s = self.scheduler.clone();
        s.filters = delayed_filters(p);
        s.slot = p as usize;
        s.max_held_bytes = (s.max_held_bytes / parts).max(1 << 20);
        s.max_inflight = (s.max_inflight / parts).max(256);
        let token = shutdown.child_token();
        (token.clone(), tokio::spawn(s.run(token)))
    }
}

/// Stops partition `p`'s scheduler and waits for it.
async fn stop(running: &mut Running, p: u32) {
    if let Some((token, handle)) = running.remove(&p) {
        token.cancel();
        match handle.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(partition = p, cause = %e, "delayed-task scheduler stopped with an error")
            }
            Err(e) => warn!(partition = p, cause = %e, "delayed-task scheduler panicked"),
        }
    }
}

/// Forgets the schedulers that ended on their own (they only end when cancelled
/// otherwise), logging why; their leases are still held, so the next look starts them
/// again.
async fn restart_ended(running: &mut Running) {
    let done: Vec<u32> = running
        .iter()
        .filter(|(_, (_, h))| h.is_finished())
        .map(|(p, _)| *p)
        .collect();
    for p in done {
        let (_, handle) = running.remove(&p).expect("listed");
        match handle.await {
            Ok(Ok(())) => warn!(
                partition = p,
                "delayed-task scheduler ended; starting it again"
            ),
            Ok(Err(e)) => {
                warn!(partition = p, cause = %e, "delayed-task scheduler failed; starting it again")
            }
            Err(join) => {
                error!(partition = p, cause = %join, "delayed-task scheduler panicked; starting it again")
            }
        }
    }
}

/// Keeps `heard` up to date: when each member last wrote its key (by this clock).
async fn follow_members(kv: kv::Store, heard: Arc<Mutex<HashMap<String, Instant>>>) {
    loop {
        match kv.watch("members.>").await {
            Ok(mut watch) => {
                while let Some(entry) = watch.next().await {
                    let Ok(entry) = entry else { break };
                    let mut heard = heard.lock().expect("not poisoned");
                    match entry.operation {
                        kv::Operation::Put => {
                            heard.insert(entry.key, Instant::now());
                        }
                        _ => {
                            heard.remove(&entry.key);
                        }
                    }
                }
            }
            Err(e) => warn!(cause = %e, "cannot watch the server members; retrying"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
