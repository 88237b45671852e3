//! Pulling: which priority to fetch from, in what batches, and how to wait when idle.
//!
//! **Pick policy.** Each queue has one consumer per priority. Every fetch round fills the
//! worker's free slots: it starts with the priority chosen by smooth weighted round-robin
//! (weights high 6 / normal 3 / low 1 by default), then fills what is left from the others
//! in high → normal → low order. While all three have work, 6 rounds in 10 start at high,
//! 3 at normal and 1 at low, so low priority is slowed under load but never starved; when
//! high is empty its share goes to the rest, so no slot idles while anything is queued.
//!
//! **Batches, no idle waiting**. Fetches use `no_wait` pulls of up to the free slot
//! count, so a busy worker never blocks on an empty priority. Only when all three are empty
//! does it long-poll all three at once (one message each, expiring after `idle_poll`): the
//! first task to arrive starts at once. A task with nothing behind it on its consumer
//! (the delivery's pending count 0), taken while slots are free, leaves the worker idle:
//! that priority's pull is sent again at once. Otherwise the worker returns to batch
//! fetching.

use super::attempt::{self, Shared};
use super::config::Config;
use super::error::WorkerError;
use super::rate::TimeoutRate;
use crate::names::Priority;
use crate::output::ResultStore;
use crate::state::TaskStore;
use crate::supervisor::Supervisor;
use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::{FutureExt, StreamExt};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

/// Longest wait for a pull request's answer beyond its own expiry.
const FETCH_TIMEOUT: Duration = Duration::from_secs(1);

/// Default pick weights of high, normal and low.
pub const DEFAULT_WEIGHTS: [u32; 3] = [6, 3, 1];

/// Smooth weighted round-robin over the three priorities.
#[derive(Debug, Clone)]
pub struct Picker {
    weights: [i64; 3],
    current: [i64; 3],
}

impl Picker {
    /// A picker with the given weights (a zero weight is raised to 1: nothing starves).
    pub fn new(weights: [u32; 3]) -> Picker {
        Picker {
            weights: weights.map(|w| i64::from(w.max(1))),
            current: [0; 3],
        }
    }

    /// The fetch order for the next round: the picked priority, then the others by rank.
    pub fn order(&mut self) -> [Priority; 3] {
        self.order_aged([0; 3])
    }

    /// [`Picker::order`] with priorities raised by aging (`levels` of high, normal, low;
    /// [`super::aging`]): a raised priority is picked with the weight of the one it is
    /// served as, and ranks beside it (after it on a tie).
    pub(crate) fn order_aged(&mut self, levels: [u8; 3]) -> [Priority; 3] {
        let served: [usize; 3] = [0, 1, 2].map(|i| i - usize::from(levels[i]).min(i));
        let weights = served.map(|s| self.weights[s]);
        let total: i64 = weights.iter().sum();
        for (c, w) in self.current.iter_mut().zip(weights) {
            *c += w;
        }
        let first = (0..3)
            .max_by_key(|&i| (self.current[i], -(served[i] as i64), -(i as i64)))
            .unwrap();
        self.current[first] -= total;
        let mut rest: Vec<usize> = (0..3).filter(|&i| i != first).collect();
        rest.sort_by_key(|&i| (served[i], i));
        [first, rest[0], rest[1]].map(|i| Priority::ALL[i])
    }
}

pub(super) async fn run(
    mut worker: Config,
    js: jetstream::Context,
    (tasks, results): (TaskStore, ResultStore),
    consumers: Vec<PullConsumer>,
    ack_wait: Duration,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    let slots = Arc::new(Semaphore::new(worker.concurrency));
    let heartbeat = (ack_wait / 3).max(Duration::from_millis(100));
    // The worker's long-running parts (limit watchers, cancel signals), supervised.
    let mut services =
        Supervisor::new(worker.id.clone(), shutdown.clone()).faults(worker.faults.clone());
    let gate = crate::limits::gate::Gate::start(
        js.clone(),
        &worker.queue,
        (
            worker.id.clone(),
            std::mem::take(&mut worker.flags),
            worker.routes.live.clone(),
        ),
        (heartbeat, ack_wait),
        (worker.concurrency / 2).max(1),
        shutdown.clone(),
        &mut services,
    );
    let stats = js.client().statistics();
    let shared = Arc::new(Shared {
        gate,
        keys: crate::idempotency::Keys::new(js.clone()),
        js,
        tasks,
        results,
        queue: worker.queue.clone(),
        worker_id: worker.id.clone(),
        routes: std::mem::take(&mut worker.routes),
        slots: slots.clone(),
        concurrency: worker.concurrency,
        running: Default::default(),
        heartbeat,
        ack_wait,
        labels: Default::default(),
        shutdown: shutdown.clone(),
        hard_stop: CancellationToken::new(),
        rate: TimeoutRate::new(Duration::from_secs(60)),
        tracker: TaskTracker::new(),
        lean_first_attempt: worker.lean_first_attempt,
        inflight: Default::default(),
        streaks: Default::default(),
        faults: worker.faults.clone(),
        reconnected: super::signals::Reconnected::new(stats),
    });
    // Nothing is fetched before the cancel-signal subscription is in place: an attempt
    // that starts unwritten must hear an operator's cancel, or the cancel (answered by no
    // holder) writes `cancelled` while the handler runs anyway (docs/PROTOCOL.md §8).
    let (subscribed_tx, mut subscribed) = watch::channel(false);
    {
        let (shared, subscribed_tx) = (shared.clone(), Arc::new(subscribed_tx));
        services.spawn("cancel-signals", move |token| {
            cancel_signals(shared.clone(), subscribed_tx.clone(), token).map(Ok::<(), Infallible>)
        });
    }
    let consumers = Arc::new(consumers);
    let levels = Arc::new(super::aging::Levels::default());
    if let Some(after) = worker.aging {
        let (js, queue) = (shared.js.clone(), worker.queue.clone());
        let (consumers, levels) = (consumers.clone(), levels.clone());
        services.spawn("aging", move |token| {
            let (js, queue, consumers, levels) =
                (js.clone(), queue.clone(), consumers.clone(), levels.clone());
            super::aging::follow(js, queue, consumers, after, levels, token)
                .map(Ok::<(), Infallible>)
        });
    }
    let woken = Arc::new(Notify::new());
    // True while the worker waits with every priority empty: only then are its long polls
    // sent again as they expire (a busy worker's would take tasks past its slots).
    let idle = Arc::new(AtomicBool::new(false));
    let mut picker = Picker::new(worker.weights);
    // Long polls by priority. A reconnect loses their pull requests on the server side:
    // then they are aborted and sent again rather than waited out.
    let mut polls = Polls::default();
    let mut reconnects = crate::follow::Reconnects::new(&shared.js.client());
    metrics::gauge!(crate::metrics::WORKER_BUSY_RATE, "queue" => worker.queue.clone()).set(0.0);
    metrics::gauge!(crate::metrics::TASK_TIMEOUT_RATE, "queue" => worker.queue.clone()).set(0.0);
    tokio::select! {
        _ = subscribed.wait_for(|ready| *ready) => {}
        _ = shutdown.cancelled() => {}
    }
    info!(queue = %worker.queue, concurrency = worker.concurrency, "worker started");

    loop {
        let Some(permits) = free_slots(&shared, &slots, worker.max_batch, &shutdown).await else {
            break;
        };
        if fetch_round(
            &shared,
            &consumers,
            picker.order_aged(levels.get()),
            permits,
        )
        .await
            > 0
        {
            continue;
        }
        // Every priority is empty: long-poll all three, wake on the first arrival.
        if reconnects.take() {
            polls.abort();
        }
        idle.store(true, Ordering::SeqCst);
        long_poll(
            &mut polls,
            &consumers,
            &woken,
            &shared,
            worker.idle_poll,
            &idle,
        );
        tokio::select! {
            _ = shutdown.cancelled() => {
                idle.store(false, Ordering::SeqCst);
                break;
            }
            _ = woken.notified() => {}
            _ = tokio::time::sleep(worker.idle_poll) => {}
        }
        idle.store(false, Ordering::SeqCst);
    }

    info!(queue = %worker.queue, "worker stopping: draining in-flight tasks");
    for poll in polls.tasks.into_iter().flatten() {
        let _ = poll.await;
    }
    shared.tracker.close();
    if tokio::time::timeout(worker.shutdown_grace, shared.tracker.wait())
        .await
        .is_err()
    {
        warn!(queue = %worker.queue, "shutdown grace over: aborting and handing back running tasks");
        shared.hard_stop.cancel();
        shared.tracker.wait().await;
    }
    services.stop().await;
    info!(queue = %worker.queue, "worker stopped");
    Ok(())
}

/// Waits until the worker may fetch — the queue's limits and pause flag read (a worker
/// started during a pause must not take the paused queue's tasks), the queue not paused
/// (running attempts go on), a handler slot free — and takes every free slot, at most
/// `max_batch`. `None` on shutdown.
async fn free_slots(
    shared: &Shared,
    slots: &Arc<Semaphore>,
    max_batch: usize,
    shutdown: &CancellationToken,
) -> Option<Vec<OwnedSemaphorePermit>> {
    tokio::select! {
        _ = shutdown.cancelled() => return None,
        _ = shared.gate.wait_ready() => {}
    }
    if shared.gate.paused() {
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = shared.gate.wait_unpaused() => {}
        }
    }
    let first = tokio::select! {
        _ = shutdown.cancelled() => return None,
        p = slots.clone().acquire_owned() => p.expect("never closed"),
    };
    let mut permits = vec![first];
    while permits.len() < max_batch {
        match slots.clone().try_acquire_owned() {
            Ok(p) => permits.push(p),
            Err(_) => break,
        }
    }
    Some(permits)
}

/// One fetch round: `no_wait` pulls in `order` until the permits are used, each delivery
/// started with one. Answers how many were fetched (0: every priority is empty).
async fn fetch_round(
    shared: &Arc<Shared>,
    consumers: &[PullConsumer],
    order: [Priority; 3],
    mut permits: Vec<OwnedSemaphorePermit>,
) -> usize {
    shared.faults.fetch_round_starting().await;
    let mut fetched = 0usize;
    for p in order {
        if permits.is_empty() {
            break;
        }
        // A pull request lost with a restarting server is never answered: bound the wait
        // on the client side.
        let fetch = async {
            let mut batch = consumers[p.index()]
                .fetch()
                .max_messages(permits.len())
                .messages()
                .await?;
            while let Some(msg) = batch.next().await {
                match msg {
                    Ok(msg) => {
                        fetched += 1;
                        let permit = permits.pop();
                        attempt::spawn(shared, msg, permit);
                    }
                    Err(e) => warn!(cause = %e, priority = %p, "fetch error"),
                }
            }
            Ok::<(), async_nats::Error>(())
        };
        match tokio::time::timeout(FETCH_TIMEOUT, fetch).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(cause = %e, priority = %p, "fetch failed"),
            Err(_) => warn!(priority = %p, "fetch unanswered; retrying"),
        }
    }
    fetched
}

/// Long polls by priority: the task of each, and whether one is in flight.
#[derive(Default)]
struct Polls {
    /// Each priority's poll task (aborted on a reconnect, awaited at shutdown).
    tasks: [Option<JoinHandle<()>>; 3],
    /// Set when a priority's poll is sent, cleared by the poll as it ends, before it wakes
    /// the worker: once woken, the worker sees it clear and sends the next. (Whether the
    /// task had finished is not that: a poll that woke the worker and was then descheduled
    /// before it returned was seen running, none was sent, and tasks arriving waited the
    /// worker's whole idle wait.)
    in_flight: Arc<[AtomicBool; 3]>,
}

impl Polls {
    /// Aborts every poll (their pull requests were lost with the connection).
    fn abort(&mut self) {
        for (p, task) in self.tasks.iter_mut().enumerate() {
            if let Some(task) = task.take() {
                task.abort();
            }
            self.in_flight[p].store(false, Ordering::SeqCst);
        }
    }
}

/// What one long poll brought.
enum Polled {
    /// It expired (or was refused, or went unanswered).
    Nothing,
    /// A task, started; `behind`: the messages its consumer still had to deliver;
    /// `slotted`: whether it took a free handler slot at once.
    Task { behind: u64, slotted: bool },
}

/// Sends a long poll (one message, expiring after about `idle_poll`) on each priority that
/// has none in flight; a message that arrives starts. A poll that expires without one, or
/// that brought a task with nothing behind it while a slot is free, is sent again at once
/// while the worker is still `idle`, so every priority keeps a pull waiting on the server
/// while the worker is idle. One that ends otherwise (tasks behind it, no slot free, or
/// the worker busy) wakes the worker after it marks itself ended, so the worker's next
/// idle round sends it again (before, a task arriving in between waited up to
/// `idle_poll`: the events bench's next steps, p99 224-481 ms at 1,000/s, max about
/// 500 ms).
fn long_poll(
    polls: &mut Polls,
    consumers: &Arc<Vec<PullConsumer>>,
    woken: &Arc<Notify>,
    shared: &Arc<Shared>,
    idle_poll: Duration,
    idle: &Arc<AtomicBool>,
) {
    for p in Priority::ALL {
        if polls.in_flight[p.index()].swap(true, Ordering::SeqCst) {
            continue;
        }
        let (consumers, woken, shared) = (consumers.clone(), woken.clone(), shared.clone());
        let (idle, in_flight) = (idle.clone(), polls.in_flight.clone());
        polls.tasks[p.index()] = Some(tokio::spawn(async move {
            loop {
                // Randomly 80–120 % of `idle_poll`: JetStream hands a message to the oldest
                // waiting pull, so idle workers polling in a fixed phase would always give
                // a redelivered message to the same one (a task handed back by a worker
                // that does not serve its name would keep going back to it).
                let expires =
                    idle_poll.mul_f64(rand::Rng::random_range(&mut rand::rng(), 0.8..1.2));
                let sent = std::time::Instant::now();
                let poll = async {
                    let batch = consumers[p.index()]
                        .batch()
                        .max_messages(1)
                        .expires(expires)
                        .messages()
                        .await;
                    let Ok(mut batch) = batch else {
                        return Polled::Nothing;
                    };
                    let mut got = Polled::Nothing;
                    while let Some(msg) = batch.next().await {
                        if let Ok(msg) = msg {
                            let behind = msg.info().map_or(u64::MAX, |i| i.pending);
                            // Its slot now, if one is free: the worker this poll may wake
                            // takes every free slot for its fetch round, and the task
                            // would wait for that round to end.
                            let slot = shared.slots.clone().try_acquire_owned().ok();
                            let slotted = slot.is_some();
                            attempt::spawn(&shared, msg, slot);
                            got = Polled::Task { behind, slotted };
                        }
                    }
                    got
                };
                let got = tokio::time::timeout(expires + FETCH_TIMEOUT, poll)
                    .await
                    .unwrap_or(Polled::Nothing);
                let idle_now = idle.load(Ordering::SeqCst);
                match got {
                    Polled::Nothing if idle_now && sent.elapsed() >= expires / 2 => {
                        continue; // expired while the worker waits: keep a pull there
                    }
                    // Nothing behind it, a slot free beside its own, the queue not
                    // paused: the worker has nothing to fetch, so the pull goes back at
                    // once. Waking the worker instead left the priority without a pull
                    // for its fetch round (three requests in turn), and tasks arriving
                    // meanwhile waited for it.
                    Polled::Task {
                        behind: 0,
                        slotted: true,
                    } if idle_now
                        && shared.slots.available_permits() > 0
                        && !shared.gate.paused() =>
                    {
                        continue;
                    }
                    _ => {}
                }
                let got = matches!(got, Polled::Task { .. });
                in_flight[p.index()].store(false, Ordering::SeqCst);
                // A message, or a worker no longer idle (busy, or shutting down): wake it.
                // A poll refused at once (a broker away) does not: the worker's idle wait
                // paces the next.
                if got || sent.elapsed() >= expires / 2 {
                    woken.notify_one();
                }
                shared.faults.poll_ending().await;
                break;
            }
        }));
    }
}

/// Answers operators' cancel signals (`ax.cancel.<queue>`, body = task id): the attempt
/// of that task running here stops and ends `cancelled`. A worker not holding the task
/// stays silent, so the one that holds it answers, with the attempt whose handler it had
/// started (`started`, 0 if none: then none starts).
///
/// `subscribed` turns true once the server has the subscription (a flush after it), the
/// moment from which the worker may fetch.
async fn cancel_signals(
    shared: Arc<Shared>,
    subscribed: Arc<watch::Sender<bool>>,
    shutdown: CancellationToken,
) {
    let client = shared.js.client();
    let subject = crate::names::cancel_subject(&shared.queue);
    shared.faults.cancel_subscribing().await;
    let mut subscription =
        match crate::retry::until_ok("the cancel-signal subscription", &shutdown, || async {
            client
                .subscribe(subject.clone())
                .await
                .map_err(async_nats::Error::from)
        })
        .await
        {
            Some(s) => s,
            None => return,
        };
    if crate::retry::until_ok(
        "the cancel-signal subscription's flush",
        &shutdown,
        || async { client.flush().await.map_err(async_nats::Error::from) },
    )
    .await
    .is_none()
    {
        return;
    }
    subscribed.send_replace(true);
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => return,
            msg = subscription.next() => match msg { Some(m) => m, None => return },
        };
        let id = String::from_utf8_lossy(&msg.payload).to_string();
        if let Some(started) = shared.inflight.cancel(&id) {
            info!(task_id = %id, started, "cancel signal: stopping the attempt");
            if let Some(reply) = msg.reply {
                let body = serde_json::json!({ "worker": shared.worker_id, "started": started })
                    .to_string();
                let _ = client.publish(reply, body.into()).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_first_picks() {
        let mut picker = Picker::new(DEFAULT_WEIGHTS);
        let mut counts = [0; 3];
        for _ in 0..1000 {
            let order = picker.order();
            counts[order[0].index()] += 1;
            // The rest follow by rank.
            let rest: Vec<_> = order[1..].to_vec();
            let mut sorted = rest.clone();
            sorted.sort();
            assert_eq!(rest, sorted);
        }
        assert_eq!(counts, [600, 300, 100]);
    }

    #[test]
    fn zero_weight_never_starves() {
        let mut picker = Picker::new([1, 0, 0]);
        let firsts: Vec<_> = (0..3).map(|_| picker.order()[0]).collect();
        assert!(firsts.contains(&Priority::Low));
    }

    #[test]
    fn an_aged_priority_is_picked_as_the_one_it_is_served_as() {
        let mut picker = Picker::new([100, 10, 1]);
        let firsts = |picker: &mut Picker, levels: [u8; 3]| {
            let mut n = [0usize; 3];
            for _ in 0..201 {
                n[picker.order_aged(levels)[0].index()] += 1;
            }
            n
        };
        assert_eq!(firsts(&mut picker, [0, 0, 0])[2], 2, "1 in 111 rounds");
        // Low waited past the threshold twice: served as high, with high's weight.
        let n = firsts(&mut picker, [0, 0, 2]);
        assert!(
            (95..=105).contains(&n[2]) && (95..=105).contains(&n[0]),
            "{n:?}"
        );
        // Ranked beside the priority it is served as: normal raised to high comes right
        // after high, before low, whichever is picked first.
        for _ in 0..20 {
            let order = picker.order_aged([0, 1, 0]);
            if order[0] == Priority::Low {
                assert_eq!(order[1..], [Priority::High, Priority::Normal]);
            } else {
                assert_eq!(order[2], Priority::Low, "{order:?}");
            }
        }
    }
}
