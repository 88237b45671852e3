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
//!
//! **Timeouts wait for the matcher.** A wait's timeout (its delayed message, `schedule::
//! wake`) ends it only once its registration is gone. The matcher ends a wait that met
//! nothing by its `on_timeout` (then removes its delayed message and its registration)
//! when it has looked at every event stored up to the wait's timeout: it has read one
//! stored after it, or it asked the stream for its last sequence after the timeout and
//! has read up to it. So an event stored in time ends its wait however long the matcher
//! was down or behind; the timeout comes late instead. (Ended by the timeout's dispatch
//! once let go, as first built, 10,000 timeouts due within 2 s came 3 s late at p99: the
//! dispatch's retries back off together.)

mod index;

use crate::context::Context;
use crate::lease::{run_as_leader, Leader, Lease, Stop};
use async_nats::jetstream::{consumer, kv};
use ax_core::event::{OnTimeout, WaitRegistration};
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
/// Least time between two asks of `AX_EVENTS`'s last sequence (a wait is due and no event
/// stored after its timeout has been read).
const PROBE_EVERY: Duration = Duration::from_millis(50);
/// The same while the feed has not read up to the last answer yet.
const PROBE_AGAIN: Duration = Duration::from_secs(1);

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

/// What the matcher does to a wait.
enum Work {
    /// End it with the event it met.
    Hit(Hit),
    /// End it by its timeout's policy (if its registration says it), then let its
    /// registration go: it met nothing by its timeout.
    TimedOut(String, Option<OnTimeout>),
}

/// The stream's last message as asked after a wait's timeout: `(asked_at_ms, last_seq,
/// last_stored_ms)`.
type Probe = (u64, u64, u64);

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
    /// Work waiting for room among the ends in flight.
    queued: VecDeque<Work>,
    ending: JoinSet<(String, Result<Ended, String>)>,
    /// Waits to end again (`(when, task)`), after a failed try or with no record yet.
    again: BTreeSet<(Instant, String)>,
    checking: JoinSet<()>,
    /// Every event stored before this time (ms) has been read.
    seen_ms: u64,
    /// The `AX_EVENTS` sequence of the last event read.
    read_seq: u64,
    /// When the event feed starts (its events stored from then on are read).
    feed_from_ms: u64,
    /// An ask of the stream's last sequence in flight, and when the last one was sent.
    probing: JoinSet<Result<Probe, String>>,
    probed_at: Option<Instant>,
    /// An answer to it not read up to yet: `(asked_at_ms, last_seq)`.
    caught_up_at: Option<(u64, u64)>,
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
            seen_ms: 0,
            read_seq: 0,
            feed_from_ms: now_ms().saturating_sub(WINDOW.as_millis() as u64),
            probing: JoinSet::new(),
            probed_at: None,
            caught_up_at: None,
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
            let probe = self.probe_at();
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
                Some(probed) = self.probing.join_next(), if !self.probing.is_empty() => {
                    self.on_probe(probed);
                }
                _ = tokio::time::sleep_until(probe.unwrap_or_else(Instant::now)), if probe.is_some() => {
                    self.probe();
                }
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
        let from = self.feed_from_ms;
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
                    self.queued.push_back(Work::Hit(hit));
                }
                self.time_out();
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
        self.queued.extend(hits.into_iter().map(Work::Hit));
        // Read up to here: every event stored before this one (and before an ask answered
        // with this sequence) has been looked at.
        self.read_seq = info.stream_sequence;
        self.seen_ms = self.seen_ms.max(at_ms);
        if let Some((asked_at, last)) = self.caught_up_at {
            if self.read_seq >= last {
                self.seen_ms = self.seen_ms.max(asked_at);
                self.caught_up_at = None;
            }
        }
        self.time_out();
    }

    /// Lets go of the waits that met nothing by their timeout.
    fn time_out(&mut self) {
        for task in self.index.timed_out(self.seen_ms) {
            let policy = self.index.on_timeout(&task);
            self.queued.push_back(Work::TimedOut(task, policy));
        }
    }

    /// When to ask the stream for its last sequence: a wait is due, no event stored
    /// after its timeout has been read, and no ask is in flight.
    fn probe_at(&self) -> Option<Instant> {
        let due = self.index.next_due()?;
        if !self.probing.is_empty() || self.seen_ms > due {
            return None;
        }
        let now = Instant::now();
        let after_due = now + Duration::from_millis((due + 1).saturating_sub(now_ms()));
        // Answered already, with a sequence the feed has not read up to: the feed is
        // behind, and reading on moves time on; asked again now and then (the last
        // message may be gone before the feed reads it).
        let every = match self.caught_up_at {
            Some(_) => PROBE_AGAIN,
            None => PROBE_EVERY,
        };
        Some(match self.probed_at {
            Some(at) => after_due.max(at + every),
            None => after_due,
        })
    }

    /// Asks `AX_EVENTS` for its last sequence (answered by its leader): once the feed has
    /// read up to it, every event stored before the ask has been looked at.
    fn probe(&mut self) {
        self.probed_at = Some(Instant::now());
        let js = self.ctx.js.clone();
        self.probing.spawn(async move {
            let asked_at = now_ms();
            let stream = js
                .get_stream(EVENT_STREAM)
                .await
                .map_err(|e| e.to_string())?;
            let state = &stream.cached_info().state;
            let last_ms = (state.last_timestamp.unix_timestamp_nanos() / 1_000_000).max(0) as u64;
            Ok((asked_at, state.last_sequence, last_ms))
        });
    }

    fn on_probe(&mut self, probed: Result<Result<Probe, String>, tokio::task::JoinError>) {
        let (asked_at, last, last_ms) = match probed {
            Ok(Ok(probe)) => probe,
            Ok(Err(cause)) => {
                debug!(%cause, "the event stream's last sequence not read; asked again");
                return;
            }
            Err(_) => return,
        };
        // Read up to it already, or its last event is older than the feed's start.
        if self.read_seq >= last || last_ms < self.feed_from_ms {
            self.seen_ms = self.seen_ms.max(asked_at);
            self.caught_up_at = None;
            self.time_out();
        } else {
            self.caught_up_at = Some((asked_at, last));
        }
    }

    /// Starts the queued work while there is room among the ends in flight.
    fn start_ends(&mut self) {
        while self.ending.len() < IN_FLIGHT {
            let Some(work) = self.queued.pop_front() else {
                return;
            };
            let (ctx, results) = (self.ctx.clone(), self.results.clone());
            self.ending.spawn(async move {
                match work {
                    Work::Hit(hit) => {
                        let task = hit.task.clone();
                        (task, end(&ctx, &results, &hit).await)
                    }
                    Work::TimedOut(task, policy) => {
                        let gone = let_go(&ctx, &task, policy).await;
                        (task, gone)
                    }
                }
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
                self.queued.push_back(Work::Hit(hit));
            } else if self.index.is_timed_out(&task) {
                let policy = self.index.on_timeout(&task);
                self.queued.push_back(Work::TimedOut(task, policy));
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

/// Ends wait `task`, which met no event by its timeout, by its timeout's `policy` (as its
/// timeout's dispatch would: `schedule::wake`), deletes its delayed message, and removes
/// its registration. With no policy (an older registration) or no record yet, only the
/// registration goes: the timeout's dispatch, refused while it is registered, ends it.
async fn let_go(ctx: &Context, task: &str, policy: Option<OnTimeout>) -> Result<Ended, String> {
    if let Some(policy) = policy {
        let kind = ax_core::task::Wait::Event(policy);
        let ended = crate::schedule::wake::end_record(&ctx.tasks, task, kind)
            .await
            .map_err(|e| e.to_string())?;
        if let Some(seq) = ended.and_then(|rec| rec.delayed_seq) {
            delete_timeout(ctx, task, seq).await;
        }
    }
    debug!(task_id = %task, "wait met no event by its timeout; ended, its registration let go");
    ctx.waits
        .remove(task)
        .await
        .map_err(|e| format!("removing the registration: {e}"))?;
    Ok(Ended::Done)
}

/// Deletes the delayed message (the timeout) of wait `task`, ended: its dispatch would find
/// the wait ended. Sent again on a new connection, like the registration's removal: an
/// answer the broker never gave would hold the matcher for the request timeout (a second
/// delete of one message is refused as not found, which changes nothing).
async fn delete_timeout(ctx: &Context, task: &str, seq: u64) {
    let client = ctx.js.client();
    let delete = || ax_core::admit::delete_delayed(&ctx.js, seq);
    if let Err(cause) = ax_core::follow::across_reconnects(&client, delete).await {
        debug!(task_id = %task, seq, %cause, "an ended wait's timeout message not deleted; its dispatch finds the wait ended");
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
    if let Some(seq) = rec.delayed_seq {
        delete_timeout(ctx, &hit.task, seq).await;
    }
    ctx.waits
        .remove(&hit.task)
        .await
        .map_err(|e| format!("removing the registration: {e}"))?;
    Ok(Ended::Done)
}
