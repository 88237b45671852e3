//! Fair shares between tenants (docs/PROTOCOL.md §7, "Fair shares").
//!
//! A task with a fair key is stored in `AX_FAIR` under
//! `ax.fair.<queue>.<priority>.<hex key>.<task id>` instead of its ready subject. One ax
//! server at a time (the holder of the lease `fair` in `AX_LEASES`) follows `AX_FAIR` with
//! an ordered consumer, keeps the held tasks of each queue and priority by tenant
//! ([`lanes`]), and releases them to the ready subject in weighted fair order (deficit
//! round robin) while fewer than the queue's `depth` tasks wait there undelivered (the
//! worker consumer's `num_pending`). Workers see ordinary ready messages; a tenant with a
//! backlog of 100,000 holds at most its share of `depth` of them.
//!
//! A release publishes the task's message to its ready subject (`Nats-Msg-Id` = task id),
//! then asks for what the tenant had released to be purged from `AX_FAIR` (one purge per
//! tenant, `filter` = the tenant's subjects, `seq` = one past its last released; done by
//! a task of its own, [`purge`], so the next round does not wait for it). Killed
//! between the two, the next leader re-publishes the unpurged ones: within the ready
//! stream's two-minute duplicate window that stores nothing; later, the copy's claim
//! finds the task's record naming another message and retires it (docs/PROTOCOL.md §3).
//! The index is a cache of the stream: a new leader rebuilds it from the start. Indexing
//! ([`feed`]) and releasing ([`release`]) run side by side, so a burst of submits is
//! indexed while releases go on. A leader that lost its lease may finish a round before
//! it stops (at most a third of the lease's TTL): what it releases twice is a duplicate,
//! dropped as above.

use crate::context::Context;
use crate::lease::{run_as_leader, Leader, Lease, Stop};
use async_nats::jetstream::{self, kv};
use ax_core::names::{self, FAIR_STREAM};
use ax_core::protocol::WireError;
use ax_sdk::limits::fair::{fair_key, FairStatus};
use error::{err, FairError};
use lanes::Lanes;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

mod defs;
mod error;
mod feed;
pub(crate) mod lanes;
mod purge;
mod release;

/// The key of the fair dispatcher's lease in `AX_LEASES`.
pub(crate) const FAIR_LEASE: &str = "fair";

/// The fair dispatcher of one server: stands by until it holds the lease `fair`.
pub(crate) struct FairDispatcher {
    pub(crate) ctx: Arc<Context>,
    pub(crate) id: String,
    pub(crate) lease_ttl: Duration,
    /// Most bytes of held messages kept in memory; the rest are read back when released.
    pub(crate) max_held_bytes: usize,
}

struct Leading<'a> {
    fair: &'a FairDispatcher,
    limits: kv::Store,
    state: kv::Store,
}

impl Leader for Leading<'_> {
    type Error = FairError;

    async fn lead(
        &self,
        lease: &mut Lease,
        shutdown: &CancellationToken,
    ) -> Result<Stop, FairError> {
        self.fair.lead(self, lease, shutdown).await
    }
}

impl FairDispatcher {
    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), FairError> {
        let js = self.ctx.js.clone();
        let opened = ax_core::retry::until_ok(
            "AX_LEASES, AX_LIMITS and AX_LIMIT_STATE, to dispatch fair shares",
            &shutdown,
            || async {
                let leases = js.get_key_value(names::LEASES_BUCKET).await?;
                let limits = js.get_key_value(names::LIMITS_BUCKET).await?;
                let state = js.get_key_value(names::LIMIT_STATE_BUCKET).await?;
                Ok::<_, async_nats::Error>((leases, limits, state))
            },
        )
        .await;
        let Some((leases, limits, state)) = opened else {
            return Ok(());
        };
        let lease = Lease::new(
            js.client(),
            leases,
            FAIR_LEASE,
            self.id.clone(),
            self.lease_ttl,
        );
        let leading = Leading {
            fair: &self,
            limits,
            state,
        };
        run_as_leader("fair dispatcher", &leading, lease, &shutdown, || {}).await;
        Ok(())
    }

    /// One term: the feed and the rounds run as tasks of their own while this renews the
    /// lease; the first of them to end (or a lost lease) ends the term.
    async fn lead(
        &self,
        with: &Leading<'_>,
        lease: &mut Lease,
        shutdown: &CancellationToken,
    ) -> Result<Stop, FairError> {
        let js = &self.ctx.js;
        let stream = js
            .get_stream(FAIR_STREAM)
            .await
            .map_err(|e| err("get stream AX_FAIR")(e.into()))?;
        let lanes = Arc::new(Mutex::new(Lanes::new(self.max_held_bytes)));
        let caught_up = Arc::new(AtomicBool::new(false));
        let added = Arc::new(Notify::new());
        let mut tasks: JoinSet<Result<(), FairError>> = JoinSet::new();
        tasks.spawn(
            feed::Feed {
                client: js.client(),
                stream: stream.clone(),
                lanes: lanes.clone(),
                caught_up: caught_up.clone(),
                added: added.clone(),
            }
            .run(),
        );
        let purges = Arc::new(purge::Purges::default());
        {
            let (purges, stream) = (purges.clone(), stream.clone());
            tasks.spawn(async move {
                purges.run(stream).await;
                Ok(())
            });
        }
        tasks.spawn(
            release::Rounds {
                js: js.clone(),
                groups: self.ctx.ready.clone(),
                faults: self.ctx.faults.clone(),
                id: self.id.clone(),
                stream,
                purges,
                lanes,
                caught_up,
                added,
                limits: with.limits.clone(),
                state: with.state.clone(),
                reported: Mutex::new(true),
            }
            .run(),
        );
        let mut renew = tokio::time::interval(lease.ttl() / 3);
        let stop = loop {
            tokio::select! {
                _ = shutdown.cancelled() => break Ok(Stop::Shutdown),
                _ = renew.tick() => {
                    if !lease.hold().await {
                        break Ok(Stop::StepDown("the lease `fair` was lost"));
                    }
                }
                Some(done) = tasks.join_next() => break match done {
                    Ok(Err(e)) => Err(e),
                    Ok(Ok(())) => Err(err("lead")("a task of the term ended".into())),
                    Err(e) => Err(err("lead")(e.into())),
                },
            }
        };
        tasks.shutdown().await;
        metrics::gauge!(ax_core::metrics::FAIR_HELD).set(0.0);
        stop
    }
}

/// The fair dispatcher's last report of every queue with tenants (`{}` if none).
pub(crate) async fn reports(js: &jetstream::Context) -> Result<serde_json::Value, WireError> {
    let state = js
        .get_key_value(names::LIMIT_STATE_BUCKET)
        .await
        .map_err(WireError::unavailable)?;
    let value = state
        .get(ax_sdk::limits::fair::ALL_REPORTS_KEY)
        .await
        .map_err(WireError::unavailable)?;
    Ok(value
        .and_then(|v| serde_json::from_slice(&v).ok())
        .unwrap_or_else(|| serde_json::json!({})))
}

/// What the fair dispatcher last reported of `queue` (`None` if it never did).
pub(crate) async fn status(
    js: &jetstream::Context,
    queue: &str,
) -> Result<Option<FairStatus>, WireError> {
    let state = js
        .get_key_value(names::LIMIT_STATE_BUCKET)
        .await
        .map_err(WireError::unavailable)?;
    let value = state
        .get(fair_key(queue))
        .await
        .map_err(WireError::unavailable)?;
    Ok(value.and_then(|v| serde_json::from_slice(&v).ok()))
}
