//! The fair dispatcher's release rounds: for each queue and priority with tasks held,
//! as many tasks as its ready subject has room for (`depth` less the consumer's
//! `num_pending`), in weighted fair order, published to the ready subject and purged from
//! `AX_FAIR` per tenant; every second the definitions are read again and the report
//! written.

use super::defs::{Def, Defs};
use super::lanes::{Held, Lanes};
use async_nats::jetstream::{self, kv, stream};
use ax_core::metrics as m;
use ax_core::names::{self, Priority};
use ax_core::time::now_ms;
use ax_sdk::limits::fair::{fair_key, FairStatus, TenantStatus, ALL_REPORTS_KEY};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{debug, warn};

/// How long the rounds wait when nothing could be released (ready subjects full, or no
/// consumer) before they look again.
const IDLE_ROUND: Duration = Duration::from_millis(5);

/// How often definitions are read again and the report written.
const REFRESH: Duration = Duration::from_secs(1);

/// What the rounds work with.
pub(crate) struct Rounds {
    pub(crate) js: jetstream::Context,
    pub(crate) groups: Option<ax_core::admit::Groups>,
    pub(crate) faults: ax_core::faults::Faults,
    pub(crate) id: String,
    pub(crate) stream: stream::Stream,
    /// Where a round asks for its tenants' purges ([`super::purge`]).
    pub(crate) purges: Arc<super::purge::Purges>,
    pub(crate) lanes: Arc<Mutex<Lanes>>,
    pub(crate) caught_up: Arc<AtomicBool>,
    pub(crate) added: Arc<Notify>,
    pub(crate) limits: kv::Store,
    pub(crate) state: kv::Store,
    /// The last report of every queue had a queue in it.
    pub(crate) reported: Mutex<bool>,
}

impl Rounds {
    pub(crate) async fn run(self) -> Result<(), super::error::FairError> {
        let mut defs = Defs::default();
        let mut refreshed: Option<Instant> = None;
        loop {
            if !self.caught_up.load(Ordering::Acquire) {
                self.added.notified().await;
                continue;
            }
            if refreshed.is_none_or(|at| at.elapsed() >= REFRESH) {
                let queues = self.queues(|_| true);
                defs.refresh(&self.limits, queues).await;
                self.report(&defs).await;
                refreshed = Some(Instant::now());
            }
            let busy: Vec<(String, Priority)> = {
                let lanes = self.lanes.lock().expect("not poisoned");
                let busy = lanes.lanes.iter().filter(|(_, l)| l.held() > 0);
                busy.map(|(k, _)| k.clone()).collect()
            };
            if busy.is_empty() {
                tokio::select! {
                    _ = self.added.notified() => {}
                    _ = tokio::time::sleep(REFRESH) => {}
                }
                continue;
            }
            let unknown: Vec<String> = busy
                .iter()
                .filter(|(q, _)| !defs.known(q))
                .map(|(q, _)| q.clone())
                .collect();
            defs.refresh(&self.limits, unknown).await;
            let this = &self;
            let rounds = busy.into_iter().map(|(queue, priority)| {
                let def = defs.get(&queue);
                async move { this.lane(queue, priority, def).await }
            });
            let released: usize = futures::future::join_all(rounds).await.into_iter().sum();
            if released == 0 {
                tokio::time::sleep(IDLE_ROUND).await;
            }
        }
    }

    /// The queues with a lane that `pick` keeps.
    fn queues(&self, pick: impl Fn(&crate::fair::lanes::Lane) -> bool) -> Vec<String> {
        let lanes = self.lanes.lock().expect("not poisoned");
        let mut out: Vec<String> = lanes
            .lanes
            .iter()
            .filter(|(_, l)| pick(l))
            .map(|((q, _), _)| q.clone())
            .collect();
        out.dedup();
        out
    }

    /// One round of one lane; answers how many tasks it released.
    async fn lane(&self, queue: String, priority: Priority, def: Arc<Def>) -> usize {
        let Some(waiting) = undelivered(&self.js, &queue, priority).await else {
            return 0; // no worker consumer yet (or no answer): hold
        };
        let room = u64::from(def.def.depth).saturating_sub(waiting) as usize;
        if room == 0 {
            return 0;
        }
        let picks = {
            let mut lanes = self.lanes.lock().expect("not poisoned");
            let Some(lane) = lanes.lanes.get_mut(&(queue.clone(), priority)) else {
                return 0;
            };
            let picks = lane.take(room, |hex| def.weight_of_hex(hex));
            for tasks in picks.values() {
                lanes.forget(tasks);
            }
            picks
        };
        let subject = names::ready_subject(&queue, priority);
        let tenants = picks.into_iter().map(|(hex, tasks)| {
            let (subject, queue) = (subject.clone(), queue.clone());
            let mut tasks = tasks;
            async move {
                let done = self.release(priority, &subject, &mut tasks).await;
                if let Some(last) = done.checked_sub(1).map(|i| tasks[i].seq) {
                    self.faults.pass(ax_core::faults::Abort::AfterRelease);
                    let filter = names::fair_tenant_filter(&queue, priority, &hex);
                    self.purges.ask(filter, last + 1);
                }
                let rest = tasks.into_iter().skip(done).collect::<Vec<_>>();
                (hex, done, rest)
            }
        });
        let outcomes = futures::future::join_all(tenants).await;
        let mut released = 0;
        let mut lanes = self.lanes.lock().expect("not poisoned");
        for (hex, done, rest) in outcomes {
            released += done;
            lanes.remember(&rest);
            if let Some(lane) = lanes.lanes.get_mut(&(queue.clone(), priority)) {
                lane.put_back(&hex, rest);
            }
        }
        drop(lanes);
        metrics::counter!(m::FAIR_RELEASED, "queue" => queue).increment(released as u64);
        released
    }

    /// Publishes a tenant's tasks to their ready subject; answers how many from the first
    /// were released (a refused one, and those after it, are put back). Each body held
    /// is moved into its publish, not copied: one put back is read again from `AX_FAIR`
    /// at its next release, as one never held in memory is.
    async fn release(&self, priority: Priority, subject: &str, tasks: &mut [Held]) -> usize {
        let sends = tasks.iter_mut().map(|held| async move {
            let (headers, payload) = match held.body.take() {
                Some(body) => body,
                None => match self.stream.direct_get(held.seq).await {
                    Ok(msg) => (msg.headers, msg.payload),
                    // Purged by an earlier leader's release: nothing to do.
                    Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => return true,
                    Err(_) => return false,
                },
            };
            let Some(id) = headers
                .get(ax_core::task::header::ID)
                .map(|v| v.as_str().to_string())
            else {
                warn!(seq = held.seq, "AX_FAIR message without Ax-Task-Id; dropped from the index");
                return true;
            };
            let sent = match &self.groups {
                Some(groups) => groups
                    .release(priority, subject.to_string(), headers, &id, payload)
                    .await
                    .map(|_| ()),
                None => {
                    let subject = subject.to_string();
                    ax_core::admit::publish_headers(&self.js, subject, headers, &id, payload)
                        .await
                        .map(|_| ())
                }
            };
            if let Err(e) = &sent {
                debug!(task_id = %id, cause = %e.message, "fair release refused; held for the next round");
            }
            sent.is_ok()
        });
        let results = futures::future::join_all(sends).await;
        results.iter().take_while(|ok| **ok).count()
    }

    /// Writes each queue's report to `AX_LIMIT_STATE` and the gauges; forgets tenants
    /// with nothing held (their release counts start again).
    async fn report(&self, defs: &Defs) {
        let mut by_queue: BTreeMap<String, Vec<TenantStatus>> = BTreeMap::new();
        {
            let mut lanes = self.lanes.lock().expect("not poisoned");
            for ((queue, priority), lane) in lanes.lanes.iter_mut() {
                let def = defs.get(queue);
                let tenants = by_queue.entry(queue.clone()).or_default();
                for (hex, held, released) in lane.report() {
                    let key = names::unhex_token(&hex).unwrap_or_else(|| hex.clone());
                    tenants.push(TenantStatus {
                        weight: def.def.weight(&key),
                        key,
                        priority: priority.to_string(),
                        held: held as u64,
                        released,
                    });
                }
                lane.forget_idle();
            }
            lanes.lanes.retain(|_, lane| !lane.is_empty());
        }
        let mut all = BTreeMap::new();
        for (queue, tenants) in by_queue {
            let held: u64 = tenants.iter().map(|t| t.held).sum();
            metrics::gauge!(m::FAIR_HELD, "queue" => queue.clone()).set(held as f64);
            let status = FairStatus {
                leader: self.id.clone(),
                at_ms: now_ms(),
                tenants,
            };
            let value = serde_json::to_vec(&status).expect("serializes");
            if let Err(e) = self.state.put(fair_key(&queue), value.into()).await {
                debug!(%queue, cause = %e, "fair report not written");
            }
            all.insert(queue, status);
        }
        // Every queue's report in one key (the console's table), written while there is
        // something to report and once more when there is nothing left.
        if all.is_empty() && !*self.reported.lock().expect("not poisoned") {
            return;
        }
        *self.reported.lock().expect("not poisoned") = !all.is_empty();
        let value = serde_json::to_vec(&all).expect("serializes");
        if let Err(e) = self.state.put(ALL_REPORTS_KEY, value.into()).await {
            debug!(cause = %e, "fair report of every queue not written");
        }
    }
}

/// Tasks of `queue` and `priority` on the ready subject not delivered to a worker yet
/// (the worker consumer's `num_pending`); `None` without a consumer or an answer.
async fn undelivered(js: &jetstream::Context, queue: &str, priority: Priority) -> Option<u64> {
    let stream = js.get_stream_no_info(priority.ready_stream()).await.ok()?;
    match stream
        .consumer_info(names::consumer_name(queue, priority))
        .await
    {
        Ok(info) => Some(info.num_pending),
        Err(e) => {
            debug!(%queue, %priority, cause = %e, "no ready consumer to release fair tasks to");
            None
        }
    }
}
