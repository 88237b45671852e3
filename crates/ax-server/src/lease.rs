//! A lease in `AX_LEASES`: one KV key, taken and renewed by compare-and-set. The trigger
//! engine's leader holds `triggers`, the flow engine's `flows`; the owners of delayed-task
//! partitions hold `delayed.<partition>` (`schedule::partitions`). Both engines run their
//! terms through [`run_as_leader`].
//!
//! No wall clocks of two hosts are ever compared. The holder renews every third of the TTL
//! and acts as leader only while its last successful renewal, by its own monotonic clock,
//! is younger than the TTL. A standby watches the key's *revision*: it takes over only after
//! seeing the same revision for a whole TTL by its own monotonic clock, so a live holder
//! (whose renewals change the revision) is never displaced, whatever the standby's wall
//! clock says.
//!
//! The revision written by the last successful take or renewal is the holder's fencing
//! token ([`Lease::token`]): it is stored with every trigger-state write, and an engine that
//! reads a state written under a newer token steps down (see `engine`).

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::time::Instant;

/// The key of the trigger engine's lease in `AX_LEASES`.
pub(crate) const TRIGGERS_KEY: &str = "triggers";

/// The lease's value: who holds it and for how long a renewal counts. No absolute times.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct LeaseValue {
    /// Holder id; empty when released.
    pub(crate) holder: String,
    /// The TTL the holder renews against, ms.
    #[serde(default)]
    pub(crate) ttl_ms: u64,
}

pub(crate) struct Lease {
    kv: kv::Store,
    /// The client `kv` talks through, watched for reconnects under a renewal.
    client: async_nats::Client,
    key: String,
    holder: String,
    ttl: Duration,
    /// Revision of our last take or renewal, while held.
    revision: Option<u64>,
    /// When our last successful take or renewal was sent.
    renewed_at: Instant,
    /// The revision a standby last saw, and since when.
    seen: Option<(u64, Instant)>,
}

impl Lease {
    pub(crate) fn new(
        client: async_nats::Client,
        kv: kv::Store,
        key: impl Into<String>,
        holder: String,
        ttl: Duration,
    ) -> Lease {
        Lease {
            kv,
            client,
            key: key.into(),
            holder,
            ttl,
            revision: None,
            renewed_at: Instant::now(),
            seen: None,
        }
    }

    /// The TTL the lease is renewed against.
    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The fencing token while held.
    pub(crate) fn token(&self) -> Option<u64> {
        self.revision
    }

    /// True while held and the last renewal is younger than the TTL.
    pub(crate) fn valid(&self) -> bool {
        self.revision.is_some() && self.renewed_at.elapsed() < self.ttl
    }

    fn value(&self, holder: &str) -> LeaseValue {
        LeaseValue {
            holder: holder.to_string(),
            ttl_ms: self.ttl.as_millis() as u64,
        }
    }

    fn body(&self, holder: &str) -> bytes::Bytes {
        serde_json::to_vec(&self.value(holder))
            .expect("serializes")
            .into()
    }

    /// Renews the lease if held, else tries to take it; true while held.
    pub(crate) async fn hold(&mut self) -> bool {
        self.hold_if(true).await
    }

    /// Like [`Lease::hold`], but when not held only takes the lease if `take`; otherwise
    /// it just watches the holder's revision, so that an expired lease can be taken as soon
    /// as `take` is true.
    pub(crate) async fn hold_if(&mut self, take: bool) -> bool {
        let sent = Instant::now();
        if let Some(rev) = self.revision {
            // A renewal the broker leaves unanswered is given up when the lease runs out,
            // so a leader never acts past its TTL while it waits (a standby takes over
            // then). An expired lease is still renewed if nobody took it.
            let left = self.ttl.saturating_sub(self.renewed_at.elapsed());
            let bound = if left.is_zero() { self.ttl } else { left };
            return match tokio::time::timeout(bound, self.renew(rev)).await {
                Ok(Ok(new)) => {
                    self.revision = Some(new);
                    self.renewed_at = sent;
                    true
                }
                Ok(Err(Renewal::Lost)) => {
                    self.revision = None; // someone else holds it now
                    false
                }
                // The broker failed or did not answer in time: still ours until the TTL
                // runs out, unless renewed.
                Ok(Err(Renewal::Failed)) | Err(_) => self.valid(),
            };
        }
        let read = ax_core::follow::across_reconnects(&self.client, || self.kv.entry(&self.key));
        let current = match read.await {
            Ok(current) => current,
            Err(_) => return false,
        };
        let take = match current {
            None if take => self
                .kv
                .create(&self.key, self.body(&self.holder))
                .await
                .ok(),
            None => None,
            Some(e) => {
                let value: Option<LeaseValue> = if e.operation == kv::Operation::Put {
                    serde_json::from_slice(&e.value).ok()
                } else {
                    None
                };
                let free = match &value {
                    None => true,
                    // Released, or ours from before a restart with the same id.
                    Some(v) => v.holder.is_empty() || v.holder == self.holder,
                };
                let expired = match self.seen {
                    Some((rev, since)) if rev == e.revision => since.elapsed() >= self.ttl,
                    _ => {
                        self.seen = Some((e.revision, sent));
                        false
                    }
                };
                if take && (free || expired) {
                    self.kv
                        .update(&self.key, self.body(&self.holder), e.revision)
                        .await
                        .ok()
                } else {
                    None
                }
            }
        };
        match take {
            Some(rev) => {
                self.revision = Some(rev);
                self.renewed_at = sent;
                self.seen = None;
                true
            }
            None => false,
        }
    }

    /// Renews the lease held at revision `rev`: its new revision. Sent again if the client
    /// connects anew while it waits (`typed_kv::put_again`): a renewal the broker had when
    /// it stopped is never answered, and the leader would step down for it though the
    /// restarted broker is back within the TTL. The value is the same at every renewal, so
    /// a renewal whose earlier sending was stored is told apart from another holder's
    /// write (whose holder differs).
    async fn renew(&self, rev: u64) -> Result<u64, Renewal> {
        let value = self.value(&self.holder);
        let renewal =
            ax_core::typed_kv::put_again(&self.client, &self.kv, &self.key, &value, Some(rev));
        match renewal.await {
            Ok(new) => Ok(new),
            Err(ax_core::typed_kv::KvError::Stale(_)) => Err(Renewal::Lost),
            Err(_) => Err(Renewal::Failed),
        }
    }

    /// Gives the lease up so a standby takes over at once.
    pub(crate) async fn release(&mut self) {
        if let Some(rev) = self.revision.take() {
            let _ = self.kv.update(&self.key, self.body(""), rev).await;
        }
    }
}

/// Why a renewal did not renew.
enum Renewal {
    /// Another holder wrote the key: the lease is lost.
    Lost,
    /// The broker failed the request: the lease is ours until its TTL runs out.
    Failed,
}

/// How one term of leadership ended.
pub(crate) enum Stop {
    /// The process is shutting down: the lease is released.
    Shutdown,
    /// The leader found it is no longer one (the lease lost or a newer leader's write
    /// seen): it stands by again.
    StepDown(&'static str),
}

/// The work of an engine while it leads.
pub(crate) trait Leader {
    /// What ends a term with an error (the lease is released, the engine stands by).
    type Error: std::fmt::Display;
    /// Leads until shut down or no longer the leader; `lease` is held at the start and is
    /// to be renewed (`hold`) every third of its TTL.
    fn lead(
        &self,
        lease: &mut Lease,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> impl std::future::Future<Output = Result<Stop, Self::Error>> + Send;
}

/// The leader loop of an engine (`engine` names it in the logs): takes `lease` when it is
/// free, leads while it holds it, and stands by (polling every third of the TTL) in
/// between, until `shutdown`. A term that ends in an error releases the lease, so a
/// standby takes over without waiting out the TTL; a term that steps down does not (it
/// lost the lease already). `stood_down` runs after every term.
pub(crate) async fn run_as_leader<L: Leader + Sync>(
    engine: &'static str,
    leader: &L,
    mut lease: Lease,
    shutdown: &tokio_util::sync::CancellationToken,
    mut stood_down: impl FnMut() + Send,
) {
    let poll = lease.ttl / 3;
    let id = lease.holder.clone();
    loop {
        if lease.hold().await {
            let token = lease.token().unwrap_or_default();
            tracing::info!(%id, token, "{engine}: leader");
            match leader.lead(&mut lease, shutdown).await {
                Ok(Stop::Shutdown) => {
                    lease.release().await;
                    return;
                }
                Ok(Stop::StepDown(why)) => {
                    tracing::warn!(%id, why, "{engine}: stepping down")
                }
                Err(e) => {
                    tracing::warn!(cause = %e, "{engine}: leadership ended with an error");
                    lease.release().await;
                }
            }
            stood_down();
            tracing::info!(%id, "{engine}: standing by");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(poll) => {}
        }
    }
}

/// The holder of lease `key` (`triggers`, `flows`) as the `leader` API operations answer
/// it: `{"leader": <server id or null>}` (null when nobody holds it).
pub(crate) async fn leader(
    js: &async_nats::jetstream::Context,
    key: &str,
) -> Result<serde_json::Value, ax_core::protocol::WireError> {
    let unavailable =
        |e: String| ax_core::protocol::WireError::new(ax_core::protocol::ErrorCode::Unavailable, e);
    let leases = js
        .get_key_value(ax_core::names::LEASES_BUCKET)
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    let lease = leases
        .get(key)
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    let holder = lease
        .and_then(|v| serde_json::from_slice::<LeaseValue>(&v).ok())
        .map(|v| v.holder)
        .filter(|h| !h.is_empty());
    Ok(serde_json::json!({ "leader": holder }))
}
