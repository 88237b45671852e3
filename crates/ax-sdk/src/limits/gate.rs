//! The worker's gate: before a delivery is claimed (so no attempt is counted), the task
//! takes a token of every rate limit that applies, most specific first (per key, task
//! name, queue), then a slot of every concurrency cap. Over a limit, the delivery is held
//! for a reserved token or a freed slot, within a horizon and while the worker holds fewer
//! than its budget; else it is handed back with a delay (Nak). Either way the task is not
//! failed, and tasks of other keys flow past it (docs/ARCHITECTURE.md "Limits").
//!
//! Shared state lives in KV, so every worker process and server counts against the same
//! limits: a bucket's TAT in `AX_LIMIT_STATE` (compare-and-set), a slot as a key of
//! `AX_LIMIT_SLOTS` (create-if-absent with a per-message TTL of the queue's ack wait —
//! the bucket's `max_age` where TTLs are refused — and the holder rewrites its key every
//! heartbeat, so a dead holder's slot expires by itself).

use super::adaptive::BucketState;
use super::decide::{batch_size, token_step, BucketRead, Hold, TokenStep, BATCH_LIFETIME};
use super::expiry;
use super::gcra;
use super::model::{bucket_key, LimitDef};
use crate::metrics as m;
use crate::names::{
    slot_freed_subject, LIMITS_BUCKET, LIMIT_SLOTS_BUCKET, LIMIT_STATE_BUCKET, SLOTS_FREED_PREFIX,
};
use crate::supervisor::Supervisor;
use crate::task::TaskMeta;
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use rand::Rng;
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Most compare-and-set tries for one token before the delivery is handed back.
const CAS_TRIES: usize = 8;

/// How long before its token is due a held delivery is claimed (the *lead*): the claim
/// happens in it and the handler starts at the token's due time, so handler starts follow
/// the tokens' spacing, not the claim's varying round trip. It follows the worker's claim
/// times: twice their moving average, from `MIN_LEAD` to `MAX_LEAD` (a replicated
/// bucket's claims take longer than a single node's).
const MIN_LEAD: Duration = Duration::from_millis(10);
const MAX_LEAD: Duration = Duration::from_millis(250);

/// A delivery whose token came due longer ago than this before it could be claimed gives
/// the token up (see [`Gate::admit`]).
const MAX_LATE: Duration = Duration::from_millis(10);

/// The longest a delivery is held for a reserved token (a token due later is not booked:
/// the delivery is handed back until about then).
const MAX_RATE_HOLD: Duration = Duration::from_secs(1);

/// The longest a delivery is held waiting for a freed slot before it is handed back.
const MAX_SLOT_HOLD: Duration = Duration::from_secs(10);

/// How long a delivery of a paused queue is handed back for (the worker stops fetching
/// while paused; only deliveries already on their way meet this).
const PAUSED_DELAY: Duration = Duration::from_secs(2);

/// Tokens this worker holds for one bucket.
struct LocalBucket {
    tokens: u32,
    taken_at: std::time::Instant,
    /// When the batch's tokens are due (µs since the epoch).
    due_us: u64,
}

impl Default for LocalBucket {
    fn default() -> Self {
        LocalBucket {
            tokens: 0,
            taken_at: std::time::Instant::now(),
            due_us: 0,
        }
    }
}

/// Why a delivery waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    RateLimit,
    Concurrency,
    Unavailable,
    Paused,
}

impl Reason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::RateLimit => "rate_limit",
            Reason::Concurrency => "concurrency",
            Reason::Unavailable => "limits_unavailable",
            Reason::Paused => "paused",
        }
    }
}

/// What the gate decided.
pub(crate) enum Admit {
    /// Start: hold these slots until the attempt ends; with rate tokens, start the handler
    /// at `start_at` (the tokens' due time, at least the lead from now).
    Go {
        slots: Vec<Slot>,
        start_at: Option<tokio::time::Instant>,
    },
    /// Hand the delivery back for `delay`.
    Wait {
        delay: Duration,
        reason: Reason,
        limit: String,
    },
}

struct Buckets {
    defs: kv::Store,
    state: kv::Store,
    slots: kv::Store,
    js: jetstream::Context,
}

/// A worker's view of its queue's limits, kept current by a KV watch.
pub(crate) struct Gate {
    queue: String,
    holder: String,
    defs: RwLock<HashMap<String, LimitDef>>,
    buckets: RwLock<Option<Arc<Buckets>>>,
    renew_every: Duration,
    /// How long a slot lives unless rewritten: the queue's ack wait (a per-message TTL);
    /// `None` once the bucket has refused TTLs (its `max_age` then applies).
    slot_ttl: std::sync::Mutex<Option<Duration>>,
    /// True once the definitions stored when the worker started have been read: until
    /// then nothing is admitted (a fresh worker must not start a singleton's second task).
    ready: tokio::sync::watch::Sender<bool>,
    /// True while the queue is paused (key `<queue>.=paused` in `AX_LIMITS`).
    paused: tokio::sync::watch::Sender<bool>,
    /// Per bucket: this worker's batch of tokens, and the lock that makes its takes of
    /// one bucket go one at a time.
    local: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<LocalBucket>>>>,
    /// Deliveries this worker may hold at once for a reserved token or a freed slot (the
    /// rest of its concurrency stays free for tasks of other keys).
    holds: Arc<Semaphore>,
    /// How long a delivery is held for a reserved token / for a freed slot.
    rate_hold: Duration,
    slot_hold: Duration,
    /// Per cap bucket with waiting deliveries: woken by a release (`ax.slots.freed.…`).
    freed: std::sync::Mutex<HashMap<String, Arc<Notify>>>,
    shutdown: CancellationToken,
    /// Moving average of this worker's claim times under a rate (µs).
    claim_us: AtomicU64,
    /// The revision of the pause key last applied.
    pause_rev: AtomicU64,
    /// The stored task settings of the queue (`<queue>.=task.<name>`), for the worker.
    live: Arc<crate::worker::options::Live>,
}

impl Gate {
    /// A gate for `queue` that follows the limit definitions from now on (waiting for the
    /// buckets, with one log line, if they do not exist yet), for worker `holder`, showing
    /// what it knows in `flags` (the worker's status) and passing the stored task settings
    /// of the queue to `live`.
    ///
    /// `max_held`: how many deliveries may wait in the gate at once (for a reserved token
    /// or a freed slot); `slot_ttl` is the queue's ack wait, which also bounds how long one
    /// is held (a quarter of it for a token, at most 1 s; half for a slot, at most 10 s).
    pub(crate) fn start(
        js: jetstream::Context,
        queue: &str,
        (holder, flags, live): (
            String,
            crate::worker::status::Flags,
            Arc<crate::worker::options::Live>,
        ),
        (renew_every, slot_ttl): (Duration, Duration),
        max_held: usize,
        shutdown: CancellationToken,
        services: &mut Supervisor,
    ) -> Arc<Gate> {
        let gate = Arc::new(Gate {
            queue: queue.to_string(),
            holder,
            defs: RwLock::new(HashMap::new()),
            buckets: RwLock::new(None),
            renew_every,
            slot_ttl: std::sync::Mutex::new(Some(slot_ttl)),
            ready: flags.ready,
            paused: flags.paused,
            local: Default::default(),
            holds: Arc::new(Semaphore::new(max_held.max(1))),
            rate_hold: (slot_ttl / 4).min(MAX_RATE_HOLD),
            slot_hold: (slot_ttl / 2).min(MAX_SLOT_HOLD),
            freed: Default::default(),
            shutdown: shutdown.clone(),
            claim_us: AtomicU64::new(MIN_LEAD.as_micros() as u64 / 2),
            pause_rev: AtomicU64::new(0),
            live,
        });
        // Supervised: each runs until its token is cancelled; one that stops is restarted.
        let g = gate.clone();
        services.spawn("pause-poll", move |token| {
            g.clone().poll_pause(token).map(Ok::<(), Infallible>)
        });
        let (g, client) = (gate.clone(), js.client());
        services.spawn("slot-wakeups", move |token| {
            g.clone()
                .listen_freed(client.clone(), token)
                .map(Ok::<(), Infallible>)
        });
        let g = gate.clone();
        services.spawn("limit-watch", move |token| {
            g.clone()
                .follow(js.clone(), token)
                .map(Ok::<(), Infallible>)
        });
        gate
    }

    /// Follows slot releases of this queue's caps (`ax.slots.freed.<queue>.>`) and of the
    /// caps shared by several queues (`ax.slots.freed.=shared.>`), core NATS, and wakes
    /// one delivery waiting for a slot of that cap, if any.
    async fn listen_freed(
        self: Arc<Gate>,
        client: async_nats::Client,
        shutdown: CancellationToken,
    ) {
        let prefix = format!("{}.", SLOTS_FREED_PREFIX);
        let mut subs = Vec::new();
        for scope in [self.queue.as_str(), super::model::SHARED_PREFIX] {
            let filter = format!("{}.>", slot_freed_subject(scope));
            let Some(sub) = crate::retry::until_ok("slot releases", &shutdown, || async {
                client
                    .subscribe(filter.clone())
                    .await
                    .map_err(async_nats::Error::from)
            })
            .await
            else {
                return;
            };
            subs.push(sub);
        }
        let mut sub = futures::stream::select_all(subs);
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => return,
                msg = sub.next() => msg,
            };
            let Some(msg) = msg else { return };
            let Some(bucket) = msg.subject.as_str().strip_prefix(&prefix) else {
                continue;
            };
            let notify = self
                .freed
                .lock()
                .expect("not poisoned")
                .get(bucket)
                .cloned();
            if let Some(n) = notify {
                n.notify_one();
            }
        }
    }

    /// The wake-up of deliveries waiting for a slot of the cap bucket `base`.
    fn freed_notify(&self, base: &str) -> Arc<Notify> {
        let mut all = self.freed.lock().expect("not poisoned");
        if all.len() > 10_000 {
            all.retain(|_, n| Arc::strong_count(n) > 1);
        }
        all.entry(base.to_string()).or_default().clone()
    }

    async fn follow(self: Arc<Gate>, js: jetstream::Context, shutdown: CancellationToken) {
        loop {
            let opened = crate::retry::until_ok(
                "the limit buckets (AX_LIMITS, AX_LIMIT_STATE, AX_LIMIT_SLOTS)",
                &shutdown,
                || async {
                    let defs = js.get_key_value(LIMITS_BUCKET).await?;
                    let state = js.get_key_value(LIMIT_STATE_BUCKET).await?;
                    let slots = js.get_key_value(LIMIT_SLOTS_BUCKET).await?;
                    let filter = format!("{}.>", self.queue);
                    let watch = defs.watch_with_history(&filter).await?;
                    // Nothing stored for this queue: the watch will deliver nothing to
                    // wait for, so the gate is ready at once.
                    let mut stored = defs
                        .stream
                        .info_with_subjects(format!("$KV.{LIMITS_BUCKET}.{filter}"))
                        .await?;
                    let none = stored.next().await.is_none();
                    let js = js.clone();
                    Ok::<_, async_nats::Error>((
                        watch,
                        Buckets {
                            defs,
                            state,
                            slots,
                            js,
                        },
                        none,
                    ))
                },
            )
            .await;
            let Some((mut watch, buckets, none)) = opened else {
                return;
            };
            *self.buckets.write().expect("not poisoned") = Some(Arc::new(buckets));
            if none {
                self.ready.send_replace(true);
            }
            // After a reconnect (a broker restart) the watch may stall until its consumer
            // misses heartbeats, seconds in which a pause or a changed limit goes unseen:
            // follow again at once instead.
            let mut reconnects = crate::follow::Reconnects::new(&js.client());
            loop {
                let entry = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    entry = watch.next() => entry,
                    _ = reconnects.changed() => {
                        info!(queue = %self.queue, "limit definitions: reconnected; following again");
                        break;
                    }
                };
                let Some(Ok(entry)) = entry else {
                    warn!(queue = %self.queue, "limit definitions: watch ended; following again");
                    break;
                };
                let caught_up = entry.delta == 0;
                if let Some(name) = crate::settings::name_of_key(&self.queue, &entry.key) {
                    self.task_settings(name, &entry);
                    if caught_up {
                        self.ready.send_replace(true);
                    }
                    continue;
                }
                if entry.key == super::pause_key(&self.queue) {
                    self.set_paused(entry.operation == kv::Operation::Put, entry.revision);
                    if caught_up {
                        self.ready.send_replace(true);
                    }
                    continue;
                }
                let mut defs = self.defs.write().expect("not poisoned");
                let def = (entry.operation == kv::Operation::Put)
                    .then(|| serde_json::from_slice::<LimitDef>(&entry.value).ok())
                    .flatten()
                    .filter(|d| d.queue == self.queue)
                    .filter(|d| match d.validate() {
                        Ok(()) => true,
                        // Written by hand, or stored before its checks were tightened
                        // (a rate below 0.000001/s): the API would refuse it now.
                        Err(e) => {
                            warn!(queue = %self.queue, key = %entry.key, cause = %e,
                                "stored limit not valid: not applied; put it again");
                            false
                        }
                    });
                match def {
                    Some(def) => {
                        info!(queue = %self.queue, limit = %def.name, rate = ?def.rate,
                            concurrency = ?def.concurrency, per_key = def.per_key, "limit in force");
                        defs.insert(entry.key.clone(), def);
                    }
                    None => {
                        if defs.remove(&entry.key).is_some() {
                            info!(queue = %self.queue, key = %entry.key, "limit removed");
                        }
                    }
                }
                drop(defs);
                metrics::gauge!(m::LIMITS_APPLIED, "queue" => self.queue.clone())
                    .set(entry.revision as f64);
                if caught_up {
                    self.ready.send_replace(true);
                }
            }
        }
    }

    /// Applies a change of task `name`'s stored settings (a value that does not decode or
    /// validate, written by hand, is not applied: logged, and the name's settings removed).
    fn task_settings(&self, name: &str, entry: &kv::Entry) {
        let settings = (entry.operation == kv::Operation::Put)
            .then(|| {
                serde_json::from_slice::<crate::settings::TaskSettings>(&entry.value)
                    .map_err(|e| e.to_string())
                    .and_then(|s| s.validate().map(|()| s).map_err(|e| e.to_string()))
                    .inspect_err(|e| {
                        warn!(queue = %self.queue, key = %entry.key, cause = %e,
                            "stored task settings not valid: not applied; set them again")
                    })
                    .ok()
            })
            .flatten();
        self.live.set(&self.queue, name, settings);
    }

    /// The limits that apply to a task, most specific first.
    fn applicable(&self, meta: &TaskMeta) -> Vec<LimitDef> {
        let defs = self.defs.read().expect("not poisoned");
        let mut found: Vec<LimitDef> = defs
            .values()
            .filter(|d| d.applies(&meta.name, meta.limit_key.as_deref()))
            .cloned()
            .collect();
        found.sort_by_key(|d| {
            std::cmp::Reverse((
                u8::from(d.per_key),
                u8::from(d.task.is_some()),
                d.name.clone(),
            ))
        });
        found
    }

    /// Applies the pause flag read at `revision` of its key, unless a later revision of
    /// it was applied already (the watch and the poll both report it).
    fn set_paused(&self, paused: bool, revision: u64) {
        if self.pause_rev.fetch_max(revision, Ordering::SeqCst) > revision {
            return;
        }
        if *self.paused.borrow() != paused {
            info!(queue = %self.queue, paused, "queue {}", if paused { "paused" } else { "resumed" });
        }
        self.paused.send_replace(paused);
    }

    /// Reads the pause flag every 250 ms besides the watch, from the stream's leader: a
    /// watch whose stream changed leader (a replicated bucket losing a node) may stall for
    /// seconds before its consumer is made again, and a pause must reach the workers in
    /// well under a second.
    async fn poll_pause(self: Arc<Gate>, shutdown: CancellationToken) {
        let key = super::pause_key(&self.queue);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let Some(buckets) = self.buckets.read().expect("not poisoned").clone() else {
                continue;
            };
            // From the stream's leader, not a direct get: a replica just back from a restart
            // answers direct gets from its stale copy.
            let read = tokio::time::timeout(
                Duration::from_secs(1),
                crate::kv_read::latest(&buckets.defs, &key),
            )
            .await;
            if let Ok(Ok(Some(entry))) = read {
                let deleted = entry.operation != kv::Operation::Put;
                self.set_paused(!deleted, entry.revision);
            }
            // No entry: never paused (nothing to apply); a failed read: the watch decides.
        }
    }

    /// True while the queue is paused.
    pub(crate) fn paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// True if a handler due to start at `at` would start too late now (the claim took
    /// longer than the lead): it would bunch with the starts due after it.
    pub(crate) fn too_late(at: tokio::time::Instant) -> bool {
        tokio::time::Instant::now() > at + MAX_LATE
    }

    /// For a claimed delivery whose token came due too long ago ([`Gate::too_late`]):
    /// takes its rate tokens again, reserving (the first ones are given up), and answers
    /// when the handler may start; or, if no token is due within the hold horizon, how
    /// long to wait before asking again (the delivery is claimed: it waits, never starts
    /// without a token).
    pub(crate) async fn retime(&self, meta: &TaskMeta) -> Result<tokio::time::Instant, Duration> {
        let Some(buckets) = self.buckets.read().expect("not poisoned").clone() else {
            return Err(Duration::from_secs(1));
        };
        let mut due: Option<u64> = None;
        for def in self.applicable(meta).iter().filter(|d| d.throttles()) {
            // Not counted against the hold budget: this delivery is claimed already.
            let mut hold = Arc::new(Semaphore::new(1)).try_acquire_owned().ok();
            let key = meta.limit_key.as_deref();
            let at = self.take_token(&buckets.state, def, key, &mut hold).await?;
            due = due.max(Some(at));
        }
        // No rate applies any more (the limit was deleted): start now.
        Ok(due.map_or_else(tokio::time::Instant::now, instant_of))
    }

    /// The lead: how long before a token is due its delivery is claimed.
    fn lead(&self) -> Duration {
        Duration::from_micros(self.claim_us.load(Ordering::Relaxed).saturating_mul(2))
            .clamp(MIN_LEAD, MAX_LEAD)
    }

    /// A claim under a rate took `took`: the lead follows (a moving average, weight 1/5).
    pub(crate) fn observe_claim(&self, took: Duration) {
        let took = took.as_micros().min(u128::from(u32::MAX)) as u64;
        let avg = self.claim_us.load(Ordering::Relaxed);
        self.claim_us.store((avg * 4 + took) / 5, Ordering::Relaxed);
    }

    /// Returns once the stored definitions and pause flag of the queue have been read.
    pub(crate) async fn wait_ready(&self) {
        let mut ready = self.ready.subscribe();
        let _ = ready.wait_for(|r| *r).await;
    }

    /// Returns once the queue is not paused (at once if it is not).
    pub(crate) async fn wait_unpaused(&self) {
        let mut paused = self.paused.subscribe();
        let _ = paused.wait_for(|p| !*p).await;
    }

    /// Decides whether a delivery of `meta` (its `delivered`-th) may start now.
    pub(crate) async fn admit(&self, meta: &TaskMeta, delivered: i64) -> Admit {
        if let Err(back) = self.ready_and_running().await {
            return back;
        }
        let limits = self.applicable(meta);
        if limits.is_empty() {
            return Admit::Go {
                slots: Vec::new(),
                start_at: None,
            };
        }
        let Some(buckets) = self.buckets.read().expect("not poisoned").clone() else {
            return unavailable(String::new());
        };
        let key = meta.limit_key.as_deref();
        // A delivery held for a reserved token or a freed slot keeps this permit.
        let mut hold: Option<OwnedSemaphorePermit> = None;
        let start_at = match self.tokens(&buckets, &limits, key, &mut hold, meta).await {
            Ok(start_at) => start_at,
            Err(back) => return back,
        };
        let caps: Vec<&LimitDef> = limits.iter().filter(|d| d.concurrency.is_some()).collect();
        if self.paused() {
            return hand_back_paused(); // paused while the tokens were taken
        }
        if caps.is_empty() {
            return Admit::Go {
                slots: Vec::new(),
                start_at,
            };
        }
        match self.slots(&buckets, &caps, key, hold, delivered).await {
            Ok(slots) => Admit::Go { slots, start_at },
            Err(back) => back,
        }
    }

    /// Waits (at most 2 s) for the gate to have read its limits; the delivery goes back
    /// if it has not, or if the queue is paused.
    async fn ready_and_running(&self) -> Result<(), Admit> {
        if self.paused() {
            return Err(hand_back_paused());
        }
        if !*self.ready.borrow() {
            let mut ready = self.ready.subscribe();
            let waited = tokio::time::timeout(Duration::from_secs(2), ready.wait_for(|r| *r)).await;
            if !matches!(waited, Ok(Ok(_))) {
                return Err(unavailable(String::new()));
            }
            // The pause flag is known only now.
            if self.paused() {
                return Err(hand_back_paused());
            }
        }
        Ok(())
    }

    /// Takes a token of every rate limit in `limits`; with one reserved, holds the
    /// delivery until just before it is due (its slots are taken then, and the claim runs
    /// in the lead) and answers that instant.
    async fn tokens(
        &self,
        buckets: &Buckets,
        limits: &[LimitDef],
        key: Option<&str>,
        hold: &mut Option<OwnedSemaphorePermit>,
        meta: &TaskMeta,
    ) -> Result<Option<tokio::time::Instant>, Admit> {
        let mut due_us: Option<u64> = None;
        for def in limits.iter().filter(|d| d.throttles()) {
            match self.take_token(&buckets.state, def, key, hold).await {
                Ok(due) => due_us = due_us.max(Some(due)),
                Err(delay) => return Err(wait(delay, Reason::RateLimit, def.name.clone())),
            }
        }
        let Some(at) = due_us.map(instant_of) else {
            return Ok(None);
        };
        tokio::select! {
            _ = tokio::time::sleep_until(at.checked_sub(self.lead()).unwrap_or(at)) => {}
            _ = self.shutdown.cancelled() => return Err(shutting_down()),
        }
        // Paused while held: hand it back (the token is given up).
        if self.paused() {
            return Err(hand_back_paused());
        }
        // Woken far too late (the process stalled): starting now would bunch this start
        // with the ones due after it. Give the token up and come back for another at once.
        if tokio::time::Instant::now() > at + MAX_LATE {
            debug!(task_id = %meta.id, "rate token missed (the worker ran late); handed back");
            return Err(wait(Duration::ZERO, Reason::RateLimit, String::new()));
        }
        Ok(Some(at))
    }

    /// Takes a slot of every cap in `caps`, all or none. When one is full the delivery
    /// waits in the worker for a release of that cap (if it holds, or can take, a hold
    /// permit; at most the slot hold), then tries every cap again; else it goes back.
    async fn slots(
        &self,
        buckets: &Buckets,
        caps: &[&LimitDef],
        key: Option<&str>,
        mut hold: Option<OwnedSemaphorePermit>,
        delivered: i64,
    ) -> Result<Vec<Slot>, Admit> {
        let deadline = tokio::time::Instant::now() + self.slot_hold;
        'all: loop {
            let mut held = Vec::new();
            for def in caps {
                match self.take_slot(buckets, def, key).await {
                    Ok(Some(slot)) => held.push(slot),
                    Ok(None) => {
                        drop(held); // never keep a slot while waiting
                        if hold.is_none() {
                            hold = self.holds.clone().try_acquire_owned().ok();
                        }
                        if hold.is_some() && tokio::time::Instant::now() < deadline {
                            let notify = self.freed_notify(&bucket_key(def, key));
                            tokio::select! {
                                _ = notify.notified() => {
                                    // Paused while held: hand it back.
                                    if self.paused() {
                                        return Err(hand_back_paused());
                                    }
                                    continue 'all;
                                }
                                _ = tokio::time::sleep_until(deadline) => {}
                                _ = self.shutdown.cancelled() => return Err(shutting_down()),
                            }
                        }
                        let reason = Reason::Concurrency;
                        return Err(wait(slot_delay(delivered), reason, def.name.clone()));
                    }
                    Err(()) => return Err(unavailable(def.name.clone())),
                }
            }
            if self.paused() {
                return Err(hand_back_paused()); // paused while the slots were taken
            }
            return Ok(held);
        }
    }

    /// Takes one token of `def`'s bucket and answers when it is due (µs since the epoch,
    /// at least the lead from now): at once if one is free; if the next is due within the
    /// hold horizon and this worker may hold one more delivery, that token is **reserved**
    /// (the delivery is held and starts when it is due); else it says how long to hand the
    /// delivery back for: until the next token is due, plus a random spread of up to as
    /// long again (at most the horizon), so a backlog does not come back at one instant.
    ///
    /// Within this worker the takes of one bucket go one at a time, and each
    /// read-and-write fetches a small batch (up to 2 ms of the rate, at most 64, never more
    /// than the burst allows) kept for 2 ms: so a busy bucket costs one compare-and-set per
    /// batch, not a storm of conflicting ones.
    async fn take_token(
        &self,
        state: &kv::Store,
        def: &LimitDef,
        limit_key: Option<&str>,
        hold: &mut Option<OwnedSemaphorePermit>,
    ) -> Result<u64, Duration> {
        let burst = def.burst();
        let key = bucket_key(def, limit_key);
        let local = {
            let mut all = self.local.lock().expect("not poisoned");
            if all.len() > 10_000 {
                all.retain(|_, b| Arc::strong_count(b) > 1);
            }
            all.entry(key.clone()).or_default().clone()
        };
        let mut local = local.lock().await;
        if local.tokens > 0 && local.taken_at.elapsed() < BATCH_LIFETIME {
            local.tokens -= 1;
            return Ok(local.due_us);
        }
        let horizon = self.rate_hold.as_micros() as u64;
        let mut interval = gcra::interval_us(def.rate.unwrap_or(1.0));
        for _ in 0..CAS_TRIES {
            let entry = match state.entry(&key).await {
                Ok(e) => e,
                Err(e) => {
                    warn!(limit = %def.name, cause = %e, "limit state unreadable; the task waits");
                    return Err(Duration::from_secs(1));
                }
            };
            let (bucket, rev) = read_bucket(entry.as_ref());
            let tat = bucket.tat;
            // Tokens are taken for a moment a lead ahead: the claim runs meanwhile.
            let now = crate::time::now_us() + self.lead().as_micros() as u64;
            // The rate in force (an adaptive limit's follows pressure).
            let rate = bucket.rate(def, now);
            if def.adaptive.is_some() && !def.per_key {
                metrics::gauge!(m::LIMIT_RATE, "queue" => def.queue.clone(), "limit" => def.name.clone())
                    .set(rate);
            }
            interval = gcra::interval_us(rate);
            let read = BucketRead {
                tat,
                now_us: now,
                interval_us: interval,
                burst,
                want: batch_size(rate),
                horizon_us: horizon,
            };
            let mut step = token_step(
                &read,
                if hold.is_some() {
                    Hold::Held
                } else {
                    Hold::MayTake
                },
            );
            let (got, next, due) = loop {
                match step {
                    TokenStep::Take {
                        got,
                        next_tat,
                        due_us,
                    } => break (got, next_tat, due_us),
                    TokenStep::TakeHold => {
                        *hold = self.holds.clone().try_acquire_owned().ok();
                        step =
                            token_step(&read, if hold.is_some() { Hold::Held } else { Hold::No });
                    }
                    TokenStep::Back {
                        after_us,
                        spread_up_to_us,
                    } => {
                        if !def.per_key {
                            metrics::gauge!(m::LIMIT_TOKENS, "queue" => def.queue.clone(), "limit" => def.name.clone())
                                .set(0.0);
                        }
                        let spread = rand::rng().random_range(0..=spread_up_to_us);
                        return Err(gcra::wait_delay(after_us, spread));
                    }
                }
            };
            let body = Bytes::from(bucket.encode(next));
            let stored = match rev {
                Some(rev) => state.update(&key, body, rev).await.is_ok(),
                None => state.create(&key, body).await.is_ok(),
            };
            if stored {
                if !def.per_key {
                    metrics::gauge!(m::LIMIT_TOKENS, "queue" => def.queue.clone(), "limit" => def.name.clone())
                        .set(gcra::tokens(next, now, interval, burst));
                }
                local.tokens = got - 1;
                local.taken_at = std::time::Instant::now();
                local.due_us = due;
                return Ok(due);
            }
        }
        Err(gcra::wait_delay(interval, 0))
    }

    /// A handler of `meta` failed with `class`: every adaptive limit that applies and
    /// listens to that class lowers its rate (one compare-and-set of its bucket), unless
    /// it was lowered after this attempt started (`started_ms`). Best effort: a report
    /// that cannot be written is dropped with a debug line.
    pub(crate) async fn pressure(&self, meta: &TaskMeta, class: &str, started_ms: u64) {
        let limits = self.applicable(meta);
        let adaptive = limits
            .iter()
            .filter(|d| d.adaptive.as_ref().is_some_and(|a| a.reports(class)));
        let Some(buckets) = self.buckets.read().expect("not poisoned").clone() else {
            return;
        };
        for def in adaptive {
            let key = bucket_key(def, meta.limit_key.as_deref());
            let mut lowered = false;
            for _ in 0..CAS_TRIES {
                let Ok(entry) = buckets.state.entry(&key).await else {
                    break;
                };
                let (bucket, rev) = read_bucket(entry.as_ref());
                let now = crate::time::now_us();
                let Some(next) = bucket.pressured(def, now, started_ms.saturating_mul(1000)) else {
                    break;
                };
                let body = Bytes::from(next.encode(bucket.tat.unwrap_or(now)));
                let stored = match rev {
                    Some(rev) => buckets.state.update(&key, body, rev).await.is_ok(),
                    None => buckets.state.create(&key, body).await.is_ok(),
                };
                if stored {
                    lowered = true;
                    let rate = next.rate(def, now);
                    info!(queue = %def.queue, limit = %def.name, bucket = %key, rate, class,
                        "pressure reported: rate lowered");
                    if !def.per_key {
                        metrics::gauge!(m::LIMIT_RATE, "queue" => def.queue.clone(), "limit" => def.name.clone())
                            .set(rate);
                    }
                    break;
                }
            }
            metrics::counter!(m::LIMIT_PRESSURE, "queue" => def.queue.clone(), "limit" => def.name.clone(),
                "lowered" => if lowered { "true" } else { "false" })
            .increment(1);
            debug!(queue = %def.queue, limit = %def.name, class, lowered, "pressure reported");
        }
    }

    /// Takes a free slot of `def`'s cap, trying them from a random one; `None` if all are
    /// held.
    async fn take_slot(
        &self,
        buckets: &Buckets,
        def: &LimitDef,
        limit_key: Option<&str>,
    ) -> Result<Option<Slot>, ()> {
        let cap = def.concurrency.unwrap_or(1);
        let base = bucket_key(def, limit_key);
        let start = rand::rng().random_range(0..cap);
        let value = Bytes::from(self.holder.clone());
        for j in 0..cap {
            let key = format!("{base}.{}", (start + j) % cap);
            let ttl = *self.slot_ttl.lock().expect("not poisoned");
            let sent = tokio::time::Instant::now();
            let mut made =
                expiry::create(&buckets.js, &buckets.slots, &key, value.clone(), ttl).await;
            if matches!(made, Err(expiry::WriteError::TtlDisabled)) {
                warn!(
                    "AX_LIMIT_SLOTS allows no per-message TTL: slots expire by the bucket's \
                     max_age, one for every queue; run `ax streams apply` to expire each after \
                     its own queue's ack wait"
                );
                *self.slot_ttl.lock().expect("not poisoned") = None;
                made = expiry::create(&buckets.js, &buckets.slots, &key, value.clone(), None).await;
            }
            match made {
                Ok(rev) => {
                    return Ok(Some(Slot::hold(
                        buckets.js.clone(),
                        buckets.slots.clone(),
                        (key, rev, sent),
                        value,
                        (self.renew_every, ttl),
                        (def.queue.clone(), def.name.clone()),
                    )))
                }
                Err(expiry::WriteError::Taken) => continue,
                Err(e) => {
                    warn!(limit = %def.name, cause = %e, "limit slots unreadable; the task waits");
                    return Err(());
                }
            }
        }
        Ok(None)
    }
}

/// A rate bucket's stored state and the revision to write it back against (`None`: the
/// key was never written; a deleted key reads as a fresh bucket).
fn read_bucket(entry: Option<&kv::Entry>) -> (BucketState, Option<u64>) {
    match entry {
        Some(e) if e.operation == kv::Operation::Put => {
            (BucketState::parse(&e.value), Some(e.revision))
        }
        Some(e) => (BucketState::default(), Some(e.revision)),
        None => (BucketState::default(), None),
    }
}

/// The instant of a moment in µs since the epoch (now, if it has passed).
fn instant_of(at_us: u64) -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_micros(at_us.saturating_sub(crate::time::now_us()))
}

/// Hand the delivery back for `delay`, over `limit` for `reason`.
fn wait(delay: Duration, reason: Reason, limit: String) -> Admit {
    Admit::Wait {
        delay,
        reason,
        limit,
    }
}

/// The limits (or `limit`'s buckets) cannot be read now: back in a second.
fn unavailable(limit: String) -> Admit {
    wait(Duration::from_secs(1), Reason::Unavailable, limit)
}

/// The queue is paused: hand the delivery back (the worker stops fetching meanwhile).
fn hand_back_paused() -> Admit {
    Admit::Wait {
        delay: PAUSED_DELAY,
        reason: Reason::Paused,
        limit: String::new(),
    }
}

/// A held delivery meets the worker's shutdown: hand it back at once.
fn shutting_down() -> Admit {
    Admit::Wait {
        delay: Duration::ZERO,
        reason: Reason::Unavailable,
        limit: String::new(),
    }
}

/// How long a delivery waits for a concurrency slot: 250 ms more per delivery so far, at
/// most 2 s, shortened by up to 20 %.
fn slot_delay(delivered: i64) -> Duration {
    let base = Duration::from_millis(250).saturating_mul(delivered.clamp(1, 8) as u32);
    base.mul_f64(1.0 - rand::rng().random_range(0.0..0.2))
}

/// A held concurrency slot: rewritten every heartbeat (compare-and-set, so a slot that
/// expired and was taken by another is not taken back), deleted when dropped. A rewrite
/// that finds the slot changed (it expired — the worker stalled past the ack wait — and
/// may be held by another attempt now) marks it **lost**: the attempt holding it must stop,
/// or the cap would be exceeded.
///
/// It is marked lost without a word from the broker too, when its TTL has run out since the
/// last write the broker confirmed was sent (the broker counts the TTL from its receipt,
/// which is later): a worker resumed after a stall (`SIGSTOP`, a frozen VM) stops the
/// attempt at its first timer tick instead of after a round trip that a loaded or failing
/// broker may take seconds to answer, and a worker cut off from the broker stops it before
/// the slot can be taken, instead of running on beside the next holder.
pub(crate) struct Slot {
    slots: kv::Store,
    key: String,
    rev: Arc<AtomicU64>,
    renew: tokio::task::JoinHandle<()>,
    labels: (String, String),
    lost: CancellationToken,
    client: async_nats::Client,
}

impl Slot {
    /// Holds the slot written at revision `rev` by a write sent at `sent`.
    fn hold(
        js: jetstream::Context,
        slots: kv::Store,
        (key, rev, sent): (String, u64, tokio::time::Instant),
        value: Bytes,
        (every, ttl): (Duration, Option<Duration>),
        labels: (String, String),
    ) -> Slot {
        let rev = Arc::new(AtomicU64::new(rev));
        let lost = CancellationToken::new();
        let client = js.client();
        let (labels_q, labels_l) = labels.clone();
        let renew = tokio::spawn({
            let (key, rev, lost) = (key.clone(), rev.clone(), lost.clone());
            async move {
                let why = renew(&js, (&key, &rev, sent), value, (every, ttl)).await;
                warn!(slot = %key, "concurrency slot lost ({why}, and may be held by another attempt): stopping the attempt");
                metrics::counter!(m::LIMIT_SLOTS_LOST, "queue" => labels_q, "limit" => labels_l)
                    .increment(1);
                lost.cancel();
            }
        });
        metrics::gauge!(m::LIMIT_SLOTS_HELD, "queue" => labels.0.clone(), "limit" => labels.1.clone())
            .increment(1.0);
        Slot {
            slots,
            key,
            rev,
            renew,
            labels,
            lost,
            client,
        }
    }

    /// Cancelled when the slot is found lost.
    pub(crate) fn lost(&self) -> &CancellationToken {
        &self.lost
    }
}

/// Rewrites the slot every `every` until it is lost; answers why it was. With a `ttl`, the
/// slot counts as lost once `ttl` has passed since the last confirmed write was sent (its
/// expiry at the broker is later: the broker counts from its receipt, in whole seconds).
async fn renew(
    js: &jetstream::Context,
    (key, rev, mut confirmed): (&str, &AtomicU64, tokio::time::Instant),
    value: Bytes,
    (every, ttl): (Duration, Option<Duration>),
) -> &'static str {
    // `None`: the bucket's max age applies (an hour); only the broker can say.
    let expires = |confirmed: tokio::time::Instant| ttl.map(|ttl| confirmed + ttl);
    let until = |at: Option<tokio::time::Instant>| async move {
        match at {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    };
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = until(expires(confirmed)) => return EXPIRED_HERE,
        }
        // A stalled process wakes here with both timers past: the elapsed TTL decides.
        if expires(confirmed).is_some_and(|at| tokio::time::Instant::now() >= at) {
            return EXPIRED_HERE;
        }
        let sent = tokio::time::Instant::now();
        let expected = rev.load(Ordering::SeqCst);
        let written = tokio::select! {
            written = expiry::write(js, key, value.clone(), expected, ttl) => written,
            () = until(expires(confirmed)) => return EXPIRED_HERE,
        };
        match written {
            Ok(new) => {
                rev.store(new, Ordering::SeqCst);
                confirmed = sent;
            }
            Err(expiry::WriteError::Taken) => return "it expired",
            // Unreachable: try again until the TTL runs out here.
            Err(e) => {
                debug!(slot = %key, cause = %e, "concurrency slot not renewed; trying again")
            }
        }
    }
}

/// Why a slot is lost when its TTL ran out without a confirmed rewrite.
const EXPIRED_HERE: &str =
    "no rewrite confirmed within its TTL: the worker stalled or the broker was out of reach";

impl Drop for Slot {
    fn drop(&mut self) {
        self.renew.abort();
        metrics::gauge!(m::LIMIT_SLOTS_HELD, "queue" => self.labels.0.clone(), "limit" => self.labels.1.clone())
            .decrement(1.0);
        let (slots, key, rev, client) = (
            self.slots.clone(),
            self.key.clone(),
            self.rev.load(Ordering::SeqCst),
            self.client.clone(),
        );
        tokio::spawn(async move {
            // Only if it is still ours; a failure leaves it to expire. Then say so, for a
            // delivery waiting for a slot of this cap (on any worker).
            if slots.delete_expect_revision(&key, Some(rev)).await.is_ok() {
                if let Some((base, _)) = key.rsplit_once('.') {
                    let _ = client.publish(slot_freed_subject(base), Bytes::new()).await;
                }
            }
        });
    }
}
