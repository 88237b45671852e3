//! Worker SDK: priority pick policy, heartbeats, redelivery, graceful shutdown.

use crate::support::Env;
use ax_core::names::{consumer_name, Priority};
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{TaskSpec, TaskState};
use futures::StreamExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn high_priority_first_and_low_not_starved() {
    let env = Env::start(Env::server()).await;
    for p in [Priority::Low, Priority::Normal, Priority::High] {
        for _ in 0..10 {
            env.ax
                .submit("q", TaskSpec::new(p.as_str()).priority(p))
                .await
                .unwrap();
        }
    }
    let order: Arc<Mutex<Vec<String>>> = Arc::default();
    let worker = Worker::builder("q")
        .concurrency(1)
        .max_batch(1)
        .handler({
            let order = order.clone();
            move |task: Task| {
                let order = order.clone();
                async move {
                    order.lock().unwrap().push(task.name);
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    crate::support::eventually(Duration::from_secs(15), "30 tasks", || async {
        (order.lock().unwrap().len() == 30).then_some(())
    })
    .await;
    stop.cancel();
    handle.await.unwrap();
    let order = order.lock().unwrap().clone();
    let first10 = &order[..10];
    let count = |name: &str| first10.iter().filter(|n| *n == name).count();
    // Weighted round-robin 6/3/1 while all three priorities have work.
    assert_eq!(
        (count("high"), count("normal"), count("low")),
        (6, 3, 1),
        "{order:?}"
    );
    assert_eq!(order[0], "high");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_a_long_task_from_redelivery() {
    // Ack wait is 1 s; the task runs 3 s.
    let env = Env::start(Env::server()).await;
    let runs: Arc<Mutex<u32>> = Arc::default();
    let worker = Worker::builder("q")
        .handler({
            let runs = runs.clone();
            move |_task: Task| {
                let runs = runs.clone();
                async move {
                    *runs.lock().unwrap() += 1;
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let id = env.ax.submit("q", TaskSpec::new("long")).await.unwrap().id;
    let rec = env
        .wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    assert_eq!(rec.attempt, 1);
    assert_eq!(*runs.lock().unwrap(), 1);
    // Delivered once: without heartbeats the broker redelivers after the ack wait (to this
    // same worker, which waits for the running attempt and acks it as a duplicate, so the
    // counts above would not see it); the consumer's delivery sequence does.
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = env
        .js
        .get_consumer_from_stream(&consumer_name("q", Priority::Normal), "AX_READY_NORMAL")
        .await
        .unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!(
        info.delivered.consumer_sequence, 1,
        "the task was delivered again: its heartbeats did not hold it"
    );
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_heartbeat_redelivers_and_counts_the_attempt() {
    let env = Env::start(Env::server()).await;
    let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
    // A worker that claims the task and then dies: it fetches, writes `running`, and never
    // acks or heartbeats again.
    let consumer: async_nats::jetstream::consumer::PullConsumer = env
        .js
        .get_consumer_from_stream(&consumer_name("q", Priority::Normal), "AX_READY_NORMAL")
        .await
        .unwrap();
    let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
    let _held = batch.next().await.unwrap().unwrap();
    let store = env.store().await;
    let (rec, rev) = store.find(&id).await.unwrap().unwrap();
    let mut running = rec.transition(TaskState::Running);
    running.attempt = 1;
    running.worker = Some("doomed".into());
    let dead_token = store.cas(&running, rev).await.unwrap();

    let tokens: Arc<Mutex<Vec<(u32, u64)>>> = Arc::default();
    let worker = Worker::builder("q")
        .handler({
            let tokens = tokens.clone();
            move |task: Task| {
                let tokens = tokens.clone();
                async move {
                    let token = task.fencing_token().await?;
                    tokens.lock().unwrap().push((task.attempt, token));
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let rec = env
        .wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    assert_eq!(rec.attempt, 2, "the lost attempt counts");
    assert_eq!(rec.last_error.unwrap().class, "heartbeat_timeout");
    let tokens = tokens.lock().unwrap().clone();
    assert_eq!(tokens.len(), 1);
    assert!(
        tokens[0].1 > dead_token,
        "fencing tokens increase across attempts"
    );
    // The dead worker's late result is refused.
    let mut late = running.transition(TaskState::Succeeded);
    late.worker = Some("doomed".into());
    let lost = store.cas(&late, dead_token).await.unwrap_err();
    assert!(matches!(lost, ax_core::state::StateError::Stale { .. }));
    assert_eq!(lost.kind(), ax_sdk::ErrorKind::Conflict);
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_starves_its_heartbeat_past_the_ack_wait_runs_once() {
    // The handler blocks its thread (CPU-bound work, a blocking call) for 2.5 ack waits: no
    // heartbeat goes out, and JetStream redelivers the task — to this same worker, where
    // the first attempt is still running. The redelivery waits for it instead of running
    // the task a second time; the first attempt records its result.
    let env = Env::start(Env::server()).await;
    let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let worker = Worker::builder("q")
        .handler({
            let calls = calls.clone();
            move |_task: Task| {
                let calls = calls.clone();
                async move {
                    if calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                        std::thread::sleep(Duration::from_millis(2500));
                    }
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let rec = env
        .wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    // Give a second run, if one were started, the time to happen.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the task ran twice"
    );
    assert_eq!(rec.attempt, 1);
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_running_tasks_finish() {
    let env = Env::start(Env::server()).await;
    let worker = Worker::builder("q")
        .handler(|_t: Task| async {
            tokio::time::sleep(Duration::from_millis(800)).await;
            Ok(())
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
    env.wait_state(&id, TaskState::Running, Duration::from_secs(5))
        .await;
    stop.cancel();
    handle.await.unwrap();
    // The worker returned only after the task finished and was acked.
    assert_eq!(env.record(&id).await.state, TaskState::Succeeded);
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_grace_hands_back_unfinished_tasks() {
    let env = Env::start(Env::server()).await;
    let slow = Worker::builder("q")
        .shutdown_grace(Duration::from_millis(100))
        .handler(|_t: Task| async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            Ok(())
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(slow);
    let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
    env.wait_state(&id, TaskState::Running, Duration::from_secs(5))
        .await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), handle)
        .await
        .expect("worker stops after grace")
        .unwrap();
    let rec = env.record(&id).await;
    assert_eq!(rec.state, TaskState::Retrying);
    assert_eq!(rec.last_error.unwrap().class, "shutdown");
    // Another worker picks it up at once (handed back with a plain nak).
    let quick = Worker::builder("q")
        .handler(|_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(quick);
    let rec = env
        .wait_state(&id, TaskState::Succeeded, Duration::from_secs(3))
        .await;
    assert_eq!(rec.attempt, 2);
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stray_duplicate_message_does_not_run_the_task_twice() {
    let env = Env::start(Env::server()).await;
    let runs: Arc<Mutex<u32>> = Arc::default();
    let worker = Worker::builder("q")
        .handler({
            let runs = runs.clone();
            move |_task: Task| {
                let runs = runs.clone();
                async move {
                    *runs.lock().unwrap() += 1;
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
    env.wait_state(&id, TaskState::Running, Duration::from_secs(5))
        .await;
    // A second copy of the task message, as a dispatcher restarted after the duplicate
    // window would publish it.
    let stream = env.js.get_stream("AX_READY_NORMAL").await.unwrap();
    let original = stream.get_raw_message(1).await.unwrap();
    let mut headers = original.headers.clone();
    headers.insert("Nats-Msg-Id", "another-id");
    env.js
        .publish_with_headers(
            original.subject.to_string(),
            headers,
            original.payload.clone(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    env.wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        *runs.lock().unwrap(),
        1,
        "the duplicate was retired, not run"
    );
    assert_eq!(env.record(&id).await.attempt, 1);
    stop.cancel();
    handle.await.unwrap();
}

/// Defect 7.1.8: a worker started before any ax server waits for its queue instead of
/// exiting, then runs what is submitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_before_the_server_waits_for_its_queue() {
    let mut env = Env::nats_only().await;
    let (worker, runs) = crate::support::counting_worker(4);
    let stop = tokio_util::sync::CancellationToken::new();
    let handle = tokio::spawn(worker.run(env.client.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !handle.is_finished(),
        "the worker gave up before the server came"
    );
    env.start_server(Env::server()).await;
    let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
    env.wait_state(&id, TaskState::Succeeded, Duration::from_secs(15))
        .await;
    assert_eq!(runs.lock().unwrap().get(&id), Some(&1));
    stop.cancel();
    handle.await.unwrap().unwrap();
}

/// Defect 7.1.9 (panic): a handler that panics ends its attempt at once as a failure of
/// class `panic`, not as a lost heartbeat after the ack wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_fails_its_attempt_with_class_panic() {
    let env = Env::start(Env::server().ack_wait(Duration::from_secs(20))).await;
    let worker = Worker::builder("q")
        .handler(|task: Task| async move {
            if task.attempt == 1 {
                panic!("handler bug");
            }
            Ok(())
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let spec = TaskSpec::new("t").backoff(Duration::from_millis(100), Duration::from_secs(1), 0.0);
    let id = env.ax.submit("q", spec).await.unwrap().id;
    // Well within the 20 s ack wait.
    let rec = env
        .wait_state(&id, TaskState::Succeeded, Duration::from_secs(8))
        .await;
    assert_eq!(rec.attempt, 2);
    let history = env.ax.history(&id).await.unwrap();
    let failed = history
        .iter()
        .find(|(r, _)| r.state == TaskState::Retrying)
        .expect("a retrying transition");
    assert_eq!(failed.0.last_error.as_ref().unwrap().class, "panic");
    stop.cancel();
    handle.await.unwrap();
}

/// Defect 7.1.9 (unknown fields): fields another writer added to a record survive the Rust
/// worker's writes (docs/PROTOCOL.md §3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_record_fields_survive_the_worker() {
    let env = Env::start(Env::server()).await;
    let id = env
        .ax
        .submit(
            "q",
            // A key keeps the record made at submit (a task without one has none until
            // its claim).
            TaskSpec::new("t")
                .delay(Duration::from_millis(1500))
                .idempotency_key("unknown-fields"),
        )
        .await
        .unwrap()
        .id;
    let kv = env.js.get_key_value("AX_TASKS").await.unwrap();
    let entry = kv.entry(&id).await.unwrap().unwrap();
    let mut value: serde_json::Value = serde_json::from_slice(&entry.value).unwrap();
    value["custom"] = serde_json::json!({"owner": "billing"});
    kv.update(
        &id,
        serde_json::to_vec(&value).unwrap().into(),
        entry.revision,
    )
    .await
    .unwrap();
    let (worker, _runs) = crate::support::counting_worker(2);
    let (stop, handle) = env.spawn_worker(worker);
    env.wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    let done: serde_json::Value =
        serde_json::from_slice(&kv.get(&id).await.unwrap().unwrap()).unwrap();
    assert_eq!(
        done["custom"],
        serde_json::json!({"owner": "billing"}),
        "{done}"
    );
    stop.cancel();
    handle.await.unwrap();
}

/// An idle worker keeps a pull request waiting on the server for each priority, so a task
/// that arrives starts at once: sampled every 25 ms for 3 s (six expiries of its 500 ms
/// long polls), no priority's consumer is without one for 4 samples in a row (a poll's
/// expiry and the next poll's arrival may fall between two samples, not a tenth of a
/// second). Before, a worker sent new polls only after its own idle wait, and a priority
/// whose poll had expired first had none for up to 500 ms (seen red: runs of 15 to 17
/// samples).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_always_has_a_pull_waiting_on_every_priority() {
    let env = Env::start(Env::server()).await;
    let worker = Worker::builder("q")
        .handler(|_task: Task| async { ax_sdk::Output::json(&1) })
        .build()
        .unwrap();
    let (_stop, _w) = env.spawn_worker(worker);
    let js = async_nats::jetstream::new(env.client.clone());
    let mut consumers = Vec::new();
    for p in Priority::ALL {
        let stream = js.get_stream(p.ready_stream()).await.unwrap();
        let c: async_nats::jetstream::consumer::PullConsumer =
            stream.get_consumer(&consumer_name("q", p)).await.unwrap();
        consumers.push((p, c, 0u32, 0u32)); // priority, consumer, empty run, longest run
    }
    // Idle and polling first.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut all = true;
        for (_, c, _, _) in consumers.iter_mut() {
            all &= c.info().await.unwrap().num_waiting > 0;
        }
        if all {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the worker never polled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..120 {
        for (_, c, run, longest) in consumers.iter_mut() {
            let waiting = c.info().await.unwrap().num_waiting;
            *run = if waiting == 0 { *run + 1 } else { 0 };
            *longest = (*longest).max(*run);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let runs: Vec<(Priority, u32)> = consumers.iter().map(|(p, _, _, l)| (*p, *l)).collect();
    assert!(
        runs.iter().all(|(_, l)| *l < 4),
        "samples in a row with no pull waiting, by priority: {runs:?}"
    );
}

/// A long poll that delivered a task and woke the worker, then ended late (its thread
/// descheduled between the two on a busy machine: `Faults::poll_end_delay`), still leaves
/// a pull waiting on its priority once the worker is idle again, so the next task is
/// taken at once. Before, the worker looked at whether the poll's task had finished, saw
/// it running and sent none, then waited its whole idle wait (500 ms): the events bench,
/// as deployed, had a next-step p99 of 422-481 ms in two runs of five from such gaps.
/// One slot: a poll whose task leaves no slot free ends (with a slot free beside it, it
/// would be sent again without ending: the test below).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_poll_that_ends_late_still_leaves_a_pull_waiting() {
    let env = Env::start(Env::server()).await;
    let faults = ax_core::faults::Faults::armed();
    faults.poll_end_delay(Duration::from_millis(100));
    let started: Arc<Mutex<Vec<String>>> = Arc::default();
    let worker = Worker::builder("q")
        .concurrency(1)
        .faults(faults)
        .handler({
            let started = started.clone();
            move |task: Task| {
                started.lock().unwrap().push(task.id.clone());
                async { ax_sdk::Output::json(&1) }
            }
        })
        .build()
        .unwrap();
    let (_stop, _w) = env.spawn_worker(worker);
    let js = async_nats::jetstream::new(env.client.clone());
    let stream = js
        .get_stream(Priority::Normal.ready_stream())
        .await
        .unwrap();
    let mut normal: async_nats::jetstream::consumer::PullConsumer = stream
        .get_consumer(&consumer_name("q", Priority::Normal))
        .await
        .unwrap();
    let mut waiting_after = Vec::new();
    for round in 0..5 {
        tokio::time::sleep(Duration::from_millis(700)).await; // idle, polling
        let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
        env.wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        // Past the late end (100 ms), well within the idle wait (500 ms).
        tokio::time::sleep(Duration::from_millis(150)).await;
        let mut waiting = 0;
        for _ in 0..4 {
            waiting = waiting.max(normal.info().await.unwrap().num_waiting);
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
        waiting_after.push((round, waiting));
    }
    assert!(
        waiting_after.iter().all(|(_, w)| *w > 0),
        "pulls waiting on normal after each task, by round: {waiting_after:?}"
    );
    assert_eq!(started.lock().unwrap().len(), 5);
}

/// A worker of queue `q` whose fetch rounds take 3 s (`Faults::fetch_round_delay`, a
/// broker answering no-wait pulls late) and whose idle wait is 20 s, noting when each
/// task starts; and the queue's normal consumer.
struct SlowRounds {
    env: Env,
    started: Arc<Mutex<Vec<(String, std::time::Instant)>>>,
    normal: async_nats::jetstream::consumer::PullConsumer,
    _worker: (
        tokio_util::sync::CancellationToken,
        tokio::task::JoinHandle<()>,
    ),
}

impl SlowRounds {
    async fn start(slots: usize) -> SlowRounds {
        let env = Env::start(Env::server()).await;
        let faults = ax_core::faults::Faults::armed();
        faults.fetch_round_delay(Duration::from_secs(3));
        let started: Arc<Mutex<Vec<(String, std::time::Instant)>>> = Arc::default();
        let worker = Worker::builder("q")
            .concurrency(slots)
            .idle_poll(Duration::from_secs(20))
            .faults(faults)
            .handler({
                let started = started.clone();
                move |task: Task| {
                    let now = std::time::Instant::now();
                    started.lock().unwrap().push((task.id.clone(), now));
                    async { ax_sdk::Output::json(&1) }
                }
            })
            .build()
            .unwrap();
        let worker = env.spawn_worker(worker);
        let js = async_nats::jetstream::new(env.client.clone());
        let stream = js
            .get_stream(Priority::Normal.ready_stream())
            .await
            .unwrap();
        let normal = stream
            .get_consumer(&consumer_name("q", Priority::Normal))
            .await
            .unwrap();
        SlowRounds {
            env,
            started,
            normal,
            _worker: worker,
        }
    }

    /// Returns once the worker is idle and polling (past a slow fetch round).
    async fn polling(&self) {
        crate::support::eventually(Duration::from_secs(15), "the worker polling", || {
            let mut normal = self.normal.clone();
            async move { (normal.info().await.unwrap().num_waiting > 0).then_some(()) }
        })
        .await;
    }

    /// Submits a task and answers how long after its submit it started.
    async fn submit_to_start(&self) -> Duration {
        let submitted = std::time::Instant::now();
        let id = self
            .env
            .ax
            .submit("q", TaskSpec::new("t"))
            .await
            .unwrap()
            .id;
        self.env
            .wait_state(&id, TaskState::Succeeded, Duration::from_secs(15))
            .await;
        let started = self.started.lock().unwrap();
        let at = started.iter().find(|(t, _)| *t == id).unwrap().1;
        at.duration_since(submitted)
    }
}

/// An idle worker that takes a task with nothing behind it, a slot still free, sends that
/// priority's pull again at once instead of returning to its fetch rounds, so the next
/// task does not wait for them. With fetch rounds of 3 s ([`SlowRounds`]), three times a
/// task is submitted once the one before it ran, and each must start within 1.5 s of its
/// submit. Before, the poll that took a task woke the worker, whose fetch round held the
/// next task for the round's 3 s (seen red: 3.0 s each; the events bench as deployed: a
/// next step waited for the worker's round of three no-wait pulls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_that_takes_a_task_with_none_behind_it_keeps_polling() {
    let w = SlowRounds::start(64).await;
    w.polling().await;
    let mut waits = Vec::new();
    for _ in 0..3 {
        waits.push(w.submit_to_start().await);
    }
    assert!(
        waits.iter().all(|w| *w < Duration::from_millis(1500)),
        "submit to start of each task: {waits:?}"
    );
}

/// A task a long poll takes holds its handler slot before the poll wakes the worker: the
/// worker's fetch round takes every free slot, and a task without one waited for the
/// round to end. One slot (so the poll wakes the worker), fetch rounds of 3 s
/// ([`SlowRounds`]): three times, once the worker polls again, a task is submitted, and
/// each must start within 1.5 s of its submit (seen red: 3.0 s each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_a_long_poll_takes_does_not_wait_for_the_fetch_round_it_wakes() {
    let w = SlowRounds::start(1).await;
    let mut waits = Vec::new();
    for _ in 0..3 {
        w.polling().await;
        waits.push(w.submit_to_start().await);
    }
    assert!(
        waits.iter().all(|w| *w < Duration::from_millis(1500)),
        "submit to start of each task: {waits:?}"
    );
}
