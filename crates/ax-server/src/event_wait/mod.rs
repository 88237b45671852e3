//! The event matcher inside `ax server` (docs/PROTOCOL.md §6, "Events"): one leader
//! (lease `events` in `AX_LEASES`) ends the flows' waits for events.
//!
//! It follows two feeds: the pending waits in `AX_WAITS` (a KV watch with history, so a
//! new leader finds every wait) and the events of `AX_EVENTS` (an ordered consumer from
//! an hour back: the longest lookback a wait may ask for). Both go through one
//! [`index::Index`], so each (wait, event) pair is looked at once, by whichever comes
//! second, and a wait meets the first matching event in stream order.
//!
//! A wait that met its event is ended by compare-and-set on its task's record
//! (`succeeded`, the event's payload as output, large ones in `AX_RESULTS` first), then
//! its registration and its delayed message (its timeout) are removed. A record already
//! ended (a timeout, the run's cancel, another leader) stays as it is: the wait ends
//! once. A wait whose record is not stored yet (its submit is being retried) is tried
//! again; one past its timeout with its record ended or never stored is removed.

mod index;

use crate::context::Context;
use crate::lease::{run_as_leader, Leader, Lease, Stop};
use async_nats::jetstream::{consumer, kv};
use ax_core::event::WaitRegistration;
use ax_core::metrics as m;
use ax_core::names::{EVENT_PREFIX, EVENT_STREAM, LEASES_BUCKET};
use ax_core::results::ResultStore;
use ax_core::time::now_ms;
use ax_core::wire::output::{StoredOutput, TaskOutput};
use futures::StreamExt;
use index::{Hit, Index, Seen};
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// The key of the matcher's lease in `AX_LEASES`.
pub(crate) const EVENTS_KEY: &str = "events";
/// How long events are held for new waits' lookback (the longest a wait may ask for).
const WINDOW: Duration = Duration::from_secs(3600);
/// Most bytes of events held for the lookback; beyond it the oldest are let go early
/// (counted in `ax_events_dropped_early_total`).
const MAX_HELD_BYTES: usize = 64 << 20;
/// Most waits being ended at once.
const IN_FLIGHT: usize = 256;
/// How long after its timeout a wait's registration is checked for removal.
const OVERDUE_GRACE_MS: u64 = 60_000;

/// Errors that end a term as leader.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EventWaitError {
    /// The broker failed.
    #[error("event matcher: {op}: {source}")]
    Broker {
        /// Operation.
        op: &'static str,
        /// Underlying error.
        source: async_nats::Error,
    },
}

fn broker(op: &'static str) -> impl FnOnce(async_nats::Error) -> EventWaitError {
    move |source| EventWaitError::Broker { op, source }
}

pub(crate) struct EventWaits {
    pub(crate) ctx: Arc<Context>,
    pub(crate) lease_ttl: Duration,
    pub(crate) id: String,
}

/// How ending a wait went.
enum Ended {
    /// Its record is final (by this end or another): the registration is removed.
    Done,
    /// It has no record yet: try again later.
    NoRecord,
}

impl EventWaits {
    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), EventWaitError> {
        let js = self.ctx.js.clone();
        let waits = self.ctx.waits.clone();
        let opened = ax_core::retry::until_ok(
            "the event buckets (AX_WAITS, AX_EVENTS, AX_RESULTS; `ax streams apply`)",
            &shutdown,
            || async {
                waits.store().await?;
                js.get_stream(EVENT_STREAM).await?;
                let results = ResultStore::open(&js).await?;
                let kv = js.get_key_value(LEASES_BUCKET).await?;
                Ok::<_, async_nats::Error>((results, kv))
            },
        )
        .await;
        let Some((results, kv)) = opened else {
            return Ok(());
        };
        let lease = Lease::new(js.client(), kv, EVENTS_KEY, self.id.clone(), self.lease_ttl);
        let leading = Leading {
            matcher: &self,
            results: &results,
        };
        run_as_leader("event matcher", &leading, lease, &shutdown, || {
            metrics::gauge!(m::EVENT_WAITS_PENDING).set(0.0)
        })
        .await;
        Ok(())
    }
}

struct Leading<'a> {
    matcher: &'a EventWaits,
    results: &'a ResultStore,
}

impl Leader for Leading<'_> {
    type Error = EventWaitError;

    async fn lead(
        &self,
        lease: &mut Lease,
        shutdown: &CancellationToken,
    ) -> Result<Stop, EventWaitError> {
        Term::new(self.matcher.ctx.clone(), self.results.clone())
            .lead(lease, self.matcher.lease_ttl, shutdown)
            .await
    }
}

/// One term as leader: the index and the ends in flight.
struct Term {
    ctx: Arc<Context>,
    results: ResultStore,
    index: Index,
    /// Hits waiting for room among the ends in flight.
    queued: VecDeque<Hit>,
    ending: JoinSet<(String, Result<Ended, String>)>,
    /// Waits to end again (`(when, task)`), after a failed try or with no record yet.
    again: BTreeSet<(Instant, String)>,
    checking: JoinSet<()>,
}

impl Term {
    fn new(ctx: Arc<Context>, results: ResultStore) -> Term {
        Term {
            ctx,
            results,
            index: Index::new(WINDOW.as_millis() as u64, MAX_HELD_BYTES),
            queued: VecDeque::new(),
            ending: JoinSet::new(),
            again: BTreeSet::new(),
            checking: JoinSet::new(),
        }
    }

    async fn lead(
        mut self,
        lease: &mut Lease,
        ttl: Duration,
        shutdown: &CancellationToken,
    ) -> Result<Stop, EventWaitError> {
        let store = self
            .ctx
            .waits
            .store()
            .await
            .map_err(broker("open AX_WAITS"))?;
        let mut waits = store
            .watch_with_history(">")
            .await
            .map_err(|e| broker("follow AX_WAITS")(e.into()))?;
        let mut events = self.follow_events().await?;
        let mut renew = tokio::time::interval(ttl / 3);
        let mut sweep = tokio::time::interval(Duration::from_secs(5));
        loop {
            self.start_ends();
            let next = self.again.first().map(|(at, _)| *at);
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(Stop::Shutdown),
                _ = renew.tick() => {
                    if !lease.hold().await {
                        return Ok(Stop::StepDown("lease lost"));
                    }
                }
                _ = sweep.tick() => self.sweep(),
                entry = waits.next() => {
                    let Some(entry) = entry else { return Ok(Stop::StepDown("wait watch ended")) };
                    let entry = entry.map_err(|e| broker("follow AX_WAITS")(e.into()))?;
                    self.on_wait(entry);
                }
                msg = events.next() => {
                    let Some(msg) = msg else { return Ok(Stop::StepDown("event feed ended")) };
                    let msg = msg.map_err(|e| broker("follow AX_EVENTS")(e.into()))?;
                    self.on_event(&msg);
                }
                Some(ended) = self.ending.join_next(), if !self.ending.is_empty() => {
                    self.on_ended(ended);
                }
                Some(_) = self.checking.join_next(), if !self.checking.is_empty() => {}
                _ = tokio::time::sleep_until(next.unwrap_or_else(Instant::now)), if next.is_some() => {
                    self.retry_due();
                }
            }
            let (pending, _) = self.index.sizes();
            metrics::gauge!(m::EVENT_WAITS_PENDING).set(pending as f64);
            if !lease.valid() {
                return Ok(Stop::StepDown("lease not renewed within its TTL"));
            }
        }
    }

    /// The events of the last [`WINDOW`], then every new one.
    async fn follow_events(&self) -> Result<consumer::pull::Ordered, EventWaitError> {
        let from = now_ms().saturating_sub(WINDOW.as_millis() as u64);
        let start_time =
            time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(from) * 1_000_000)
                .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
        let config = consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::ByStartTime { start_time },
            filter_subject: format!("{EVENT_PREFIX}>"),
            ..Default::default()
        };
        ax_core::follow::ordered(&self.ctx.js, EVENT_STREAM, config)
            .await
            .map_err(broker("follow AX_EVENTS"))
    }

    fn on_wait(&mut self, entry: kv::Entry) {
        if entry.operation != kv::Operation::Put {
            self.index.unregister(&entry.key);
            return;
        }
        match serde_json::from_slice::<WaitRegistration>(&entry.value) {
            Ok(reg) if reg.task == entry.key => {
                if let Some(hit) = self.index.register(reg) {
                    self.queued.push_back(hit);
                }
            }
            Ok(_) | Err(_) => {
                warn!(key = %entry.key, "a wait in AX_WAITS does not decode or names another task; ignored")
            }
        }
    }

    fn on_event(&mut self, msg: &async_nats::jetstream::Message) {
        let Ok(info) = msg.info() else { return };
        let Some(name) = msg.subject.as_str().strip_prefix(EVENT_PREFIX) else {
            return;
        };
        let at_ms = (info.published.unix_timestamp_nanos() / 1_000_000).max(0) as u64;
        let seen = Seen {
            seq: info.stream_sequence,
            at_ms,
            name: name.to_string(),
            raw: msg.payload.clone(),
            payload: serde_json::from_slice(&msg.payload).unwrap_or_default(),
        };
        let before = self.index.dropped_early;
        let hits = self.index.event(seen, now_ms());
        if self.index.dropped_early > before {
            metrics::counter!(m::EVENTS_DROPPED_EARLY).increment(self.index.dropped_early - before);
        }
        self.queued.extend(hits);
    }

    /// Starts ends for queued hits while there is room.
    fn start_ends(&mut self) {
        while self.ending.len() < IN_FLIGHT {
            let Some(hit) = self.queued.pop_front() else {
                return;
            };
            let (ctx, results) = (self.ctx.clone(), self.results.clone());
            self.ending.spawn(async move {
                let task = hit.task.clone();
                (task, end(&ctx, &results, &hit).await)
            });
        }
    }

    fn on_ended(&mut self, ended: Result<(String, Result<Ended, String>), tokio::task::JoinError>) {
        let Ok((task, ended)) = ended else { return };
        let pause = match ended {
            Ok(Ended::Done) => {
                // Its registration's removal reaches the index through the watch; until
                // then it meets nothing (it has its hit).
                return;
            }
            Ok(Ended::NoRecord) => Duration::from_secs(1),
            Err(cause) => {
                debug!(task_id = %task, %cause, "wait not ended yet; tried again");
                Duration::from_millis(500)
            }
        };
        self.again.insert((Instant::now() + pause, task));
    }

    fn retry_due(&mut self) {
        let now = Instant::now();
        while let Some((at, task)) = self.again.first().cloned() {
            if at > now {
                return;
            }
            self.again.pop_first();
            if let Some(hit) = self.index.hit_of(&task) {
                self.queued.push_back(hit);
            }
        }
    }

    /// Removes the registrations of waits past their timeout whose record has ended (or
    /// was never stored): their wait task's timeout ended them.
    fn sweep(&mut self) {
        self.index.expire(now_ms());
        if !self.checking.is_empty() {
            return;
        }
        let overdue = self
            .index
            .overdue(now_ms().saturating_sub(OVERDUE_GRACE_MS));
        if overdue.is_empty() {
            return;
        }
        let ctx = self.ctx.clone();
        self.checking.spawn(async move {
            for task in overdue {
                match ctx.tasks.get(&task).await {
                    Ok(Some((rec, _))) if !rec.state.is_terminal() => {}
                    Ok(_) => {
                        if let Err(e) = ctx.waits.remove(&task).await {
                            debug!(task_id = %task, cause = %e, "an overdue wait's registration not removed yet");
                        }
                    }
                    Err(e) => debug!(task_id = %task, cause = %e, "an overdue wait's record not read"),
                }
            }
        });
    }
}

/// Ends wait `hit.task` with its event's payload (if it has not ended), then removes its
/// registration and its timeout's delayed message.
async fn end(ctx: &Context, results: &ResultStore, hit: &Hit) -> Result<Ended, String> {
    let out = TaskOutput {
        bytes: hit.event.raw.clone(),
        is_json: serde_json::from_slice::<serde::de::IgnoredAny>(&hit.event.raw).is_ok(),
    };
    let stored = StoredOutput::of(&out, &format!("{}.1", hit.task));
    if let Some(key) = &stored.key {
        results
            .put(key, out.bytes.clone())
            .await
            .map_err(|e| format!("storing the event's payload: {e}"))?;
    }
    let rec = ctx
        .tasks
        .succeed_unstarted(&hit.task, Some(stored))
        .await
        .map_err(|e| e.to_string())?;
    let Some(rec) = rec else {
        return Ok(Ended::NoRecord);
    };
    if rec.state == ax_core::state::TaskState::Succeeded {
        metrics::counter!(m::EVENT_WAITS_MET).increment(1);
        debug!(task_id = %hit.task, event_seq = hit.event.seq, "wait met its event");
    }
    // The timeout's message is useless now (its dispatch would find the wait ended). Sent
    // again on a new connection, like the registration's removal: an answer the broker
    // never gave would hold the matcher for the request timeout (a second delete of one
    // message is refused as not found, which changes nothing).
    if let Some(seq) = rec.delayed_seq {
        let client = ctx.js.client();
        let delete = || ax_core::admit::delete_delayed(&ctx.js, seq);
        if let Err(cause) = ax_core::follow::across_reconnects(&client, delete).await {
            debug!(task_id = %hit.task, seq, %cause, "a met wait's timeout message not deleted; its dispatch finds the wait ended");
        }
    }
    ctx.waits
        .remove(&hit.task)
        .await
        .map_err(|e| format!("removing the registration: {e}"))?;
    Ok(Ended::Done)
}
