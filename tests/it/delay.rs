//! Delayed tasks: held durably, moved to ready once, survive a server restart.

use crate::support::{eventually, Env};
use ax_core::time::now_ms;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{TaskSpec, TaskState};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn recording_worker(seen: Arc<Mutex<Vec<(String, u64)>>>) -> Worker {
    Worker::builder("q")
        .concurrency(8)
        .handler(move |task: Task| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push((task.id, now_ms()));
                Ok(())
            }
        })
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_task_runs_once_after_its_due_time() {
    let env = Env::start(Env::server()).await;
    let seen: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(seen.clone()));
    let accepted = env
        .ax
        .submit(
            "q",
            TaskSpec::new("later").delay(Duration::from_millis(1500)),
        )
        .await
        .unwrap();
    assert_eq!(accepted.state, TaskState::Scheduled);
    let rec = env.record(&accepted.id).await;
    let due = rec.run_at_ms.expect("a due time");
    assert_eq!(rec.state, TaskState::Scheduled);
    assert_eq!(env.stream_len("AX_DELAYED").await, 1);
    let done = env
        .wait_state(&accepted.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    assert_eq!(done.attempt, 1);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "ran exactly once");
    assert!(
        seen[0].1 >= due,
        "ran at {} before its due time {due}",
        seen[0].1
    );
    // Every write is kept: none while it waits (its message is the task), then the
    // claim's `running` (written before the attempt starts: PROTOCOL.md §3) and the end.
    let states: Vec<TaskState> = env
        .ax
        .history(&accepted.id)
        .await
        .unwrap()
        .into_iter()
        .map(|(r, _)| r.state)
        .collect();
    assert_eq!(states, [TaskState::Running, TaskState::Succeeded]);
    eventually(
        Duration::from_secs(5),
        "delayed message deleted",
        || async { (env.stream_len("AX_DELAYED").await == 0).then_some(()) },
    )
    .await;
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_at_in_the_future_is_held() {
    let env = Env::start(Env::server()).await;
    let at = std::time::SystemTime::now() + Duration::from_secs(2);
    let text = humantime::format_rfc3339_millis(at).to_string();
    let accepted = env
        .ax
        .submit("q", TaskSpec::new("at").run_at(text))
        .await
        .unwrap();
    assert_eq!(accepted.state, TaskState::Scheduled);
    let seen: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(seen.clone()));
    let rec = env
        .wait_state(&accepted.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    assert!(seen.lock().unwrap()[0].1 >= rec.run_at_ms.unwrap());
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_tasks_survive_a_server_restart() {
    let mut env = Env::start(Env::server()).await;
    let mut ids = Vec::new();
    for i in 0..50 {
        let spec = TaskSpec::new("later").delay(Duration::from_millis(800 + i * 10));
        ids.push(env.ax.submit("q", spec).await.unwrap().id);
    }
    env.stop_server().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // All are due now and no server ran at their due time: nothing moved.
    assert_eq!(env.stream_len("AX_DELAYED").await, 50);
    env.start_server(Env::server()).await;
    let seen: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(seen.clone()));
    for id in &ids {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(15))
            .await;
    }
    let mut ran: Vec<String> = seen.lock().unwrap().iter().map(|s| s.0.clone()).collect();
    ran.sort();
    ran.dedup();
    assert_eq!(ran.len(), 50);
    assert_eq!(seen.lock().unwrap().len(), 50, "no task ran twice");
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_ready_queue_keeps_a_due_task_held() {
    let env = Env::start(Env::server().capacity([5, 1, 5])).await;
    let first = env.ax.submit("q", TaskSpec::new("fill")).await.unwrap();
    let delayed = env
        .ax
        .submit(
            "q",
            TaskSpec::new("later").delay(Duration::from_millis(200)),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Due, but its ready subject is full: it stays in AX_DELAYED, still scheduled.
    assert_eq!(env.record(&delayed.id).await.state, TaskState::Scheduled);
    assert_eq!(env.stream_len("AX_DELAYED").await, 1);
    let seen: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(seen.clone()));
    for id in [&first.id, &delayed.id] {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
    }
    assert_eq!(seen.lock().unwrap().len(), 2);
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_beyond_the_horizon_are_read_back_when_near() {
    // Horizon 500 ms: a task due in 2 s is indexed without its message at first.
    let env = Env::start(Env::server().dispatch_horizon(Duration::from_millis(500))).await;
    let seen: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(seen.clone()));
    let mut ids = Vec::new();
    for i in 0..20 {
        let spec = TaskSpec::new("far").delay(Duration::from_millis(2000 + i * 50));
        ids.push(env.ax.submit("q", spec).await.unwrap().id);
    }
    for id in &ids {
        let rec = env
            .wait_state(id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        let ran_at = seen.lock().unwrap().iter().find(|s| &s.0 == id).unwrap().1;
        assert!(ran_at >= rec.run_at_ms.unwrap());
    }
    assert_eq!(seen.lock().unwrap().len(), 20);
    stop.cancel();
    handle.await.unwrap();
}

/// Defect 7.1.1: a burst of delayed tasks at one due time beyond the horizon, and a second
/// burst submitted while the first is being read back, all reach ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_beyond_the_horizon_all_reach_ready() {
    let env = Env::start(
        Env::server()
            .capacity([1000, 20_000, 1000])
            .dispatch_horizon(Duration::from_secs(1)),
    )
    .await;
    // Count every task published to a ready subject (what a worker would see).
    let mut ready = env.client.subscribe("ax.ready.q.*").await.unwrap();
    let arrived: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
    let counter = tokio::spawn({
        let arrived = arrived.clone();
        async move {
            use futures::StreamExt;
            while let Some(msg) = ready.next().await {
                if let Some(id) = msg
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(ax_core::task::header::ID))
                {
                    arrived.lock().unwrap().insert(id.to_string());
                }
            }
        }
    });
    let rfc = |at: std::time::SystemTime| humantime::format_rfc3339_millis(at).to_string();
    let submit_burst = |n: usize, at: String| {
        let ax = env.ax.clone();
        async move {
            use futures::StreamExt;
            futures::stream::iter(0..n)
                .map(|_| {
                    let (ax, at) = (ax.clone(), at.clone());
                    async move {
                        ax.submit("q", TaskSpec::new("burst").run_at(at))
                            .await
                            .unwrap()
                            .id
                    }
                })
                .buffer_unordered(128)
                .collect::<Vec<String>>()
                .await
        }
    };
    let start = std::time::SystemTime::now();
    let first_due = start + Duration::from_secs(6);
    let mut ids = submit_burst(3000, rfc(first_due)).await;
    // The first burst crosses into the horizon at due - 1 s and is being read back: submit
    // the second burst then, due a little later.
    let loading = first_due - Duration::from_millis(800);
    if let Ok(wait) = loading.duration_since(std::time::SystemTime::now()) {
        tokio::time::sleep(wait).await;
    }
    let second_due = std::time::SystemTime::now() + Duration::from_secs(3);
    ids.extend(submit_burst(2000, rfc(second_due)).await);
    let total = ids.len();
    let last_due = now_ms().max(
        second_due
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
    );
    eventually(
        Duration::from_secs(30),
        "every delayed task to reach its ready subject",
        || async {
            let n = arrived.lock().unwrap().len();
            (n == total).then_some(())
        },
    )
    .await;
    println!(
        "delayed bursts: {total} tasks reached ready {} ms after the last due time",
        now_ms().saturating_sub(last_due)
    );
    for id in &ids {
        assert!(
            arrived.lock().unwrap().contains(id),
            "{id} never reached ready"
        );
    }
    counter.abort();
}

/// A delayed task stores no record while it waits, so a second ready copy of it — what a
/// dispatcher killed between its publish and its delete publishes again on restart, after
/// the duplicate window — must not start beside the first: the claim of an unrecorded
/// delayed task writes `running` (naming its message) before the handler runs, and the
/// other copy is retired. Both copies wait before any worker starts, so both are first
/// deliveries with no record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ready_copy_of_an_unrecorded_delayed_task_does_not_run_it_again() {
    let env = Env::start(Env::server()).await;
    let accepted = env
        .ax
        .submit(
            "q",
            TaskSpec::new("later").delay(Duration::from_millis(200)),
        )
        .await
        .unwrap();
    // Waiting, it is found by its delayed message alone.
    let waiting = env.record(&accepted.id).await;
    assert_eq!(waiting.state, TaskState::Scheduled);
    assert!(waiting.delayed_seq.is_some(), "{waiting:?}");
    assert!(
        env.ax.record(&accepted.id).await.unwrap().is_none(),
        "no record is stored while the task waits"
    );
    let ready = env.js.get_stream("AX_READY_NORMAL").await.unwrap();
    let first = eventually(
        Duration::from_secs(10),
        "the due task's ready message",
        || {
            let ready = ready.clone();
            async move {
                ready
                    .direct_get_last_for_subject("ax.ready.q.normal")
                    .await
                    .ok()
            }
        },
    )
    .await;
    let mut headers = first.headers.clone();
    headers.insert("Nats-Msg-Id", format!("{}.again", accepted.id).as_str());
    env.js
        .publish_with_headers("ax.ready.q.normal", headers, first.payload.clone())
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, 2);

    // Two workers of one slot each (a worker never runs two attempts of a task at once,
    // and a wider one may fetch both copies), each handler long enough for both copies
    // to be claimed while the first runs.
    let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let slow = |runs: Arc<std::sync::atomic::AtomicU32>| {
        Worker::builder("q")
            .concurrency(1)
            .handler(move |_task: Task| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    Ok(())
                }
            })
            .build()
            .unwrap()
    };
    let workers = [
        env.spawn_worker(slow(runs.clone())),
        env.spawn_worker(slow(runs.clone())),
    ];
    env.wait_state(&accepted.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    eventually(Duration::from_secs(10), "both copies handled", || async {
        (env.stream_len("AX_READY_NORMAL").await == 0).then_some(())
    })
    .await;
    for (stop, handle) in workers {
        stop.cancel();
        handle.await.unwrap();
    }
    let runs = runs.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(runs, 1, "the handler ran {runs} times for one task");
}

/// Moves task `id`'s delayed message to `subject` (an older layout), with a fresh
/// message id so the duplicate window does not drop the copy.
async fn move_delayed(env: &Env, id: &str, subject: &str) {
    let stream = env.js.get_stream("AX_DELAYED").await.unwrap();
    let now = ax_core::names::delayed_subject("q", ax_core::names::Priority::Normal, id);
    let msg = stream.direct_get_last_for_subject(&now).await.unwrap();
    let mut headers = msg.headers.clone();
    headers.insert("Nats-Msg-Id", format!("{id}.moved").as_str());
    env.js
        .publish_with_headers(subject.to_string(), headers, msg.payload.clone())
        .await
        .unwrap()
        .await
        .unwrap();
    stream.delete_message(msg.sequence).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_messages_of_older_subject_layouts_run_beside_new_ones() {
    let mut env = Env::start(Env::server()).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let spec = TaskSpec::new("later").delay(Duration::from_secs(3));
        ids.push(env.ax.submit("q", spec).await.unwrap().id);
    }
    env.stop_server().await;
    // As stored before subjects named their task, and before partitions existed.
    let p = ax_core::names::delayed_partition(&ids[0]);
    move_delayed(&env, &ids[0], &format!("ax.delayed.q.normal.{p}")).await;
    move_delayed(&env, &ids[1], "ax.delayed.q.normal").await;
    assert_eq!(env.stream_len("AX_DELAYED").await, 3);
    // Each partition replays every layout, then follows the live subjects alone.
    env.start_server(Env::server()).await;
    let seen: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(seen.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = TaskSpec::new("later").delay(Duration::from_millis(1500));
    ids.push(env.ax.submit("q", later).await.unwrap().id);
    for id in &ids {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(15))
            .await;
    }
    let mut ran: Vec<String> = seen.lock().unwrap().iter().map(|s| s.0.clone()).collect();
    assert_eq!(ran.len(), 4, "each ran once: {ran:?}");
    ran.sort();
    ran.dedup();
    assert_eq!(ran.len(), 4);
    stop.cancel();
    handle.await.unwrap();
}

/// A delayed task is stored create-if-absent on its own subject, not de-duplicated by a
/// message id: the delayed stream's duplicate window keeps no id for it (a million waiting
/// tasks kept a million ids there: docs/PERFORMANCE.md, W4), and a re-publish of its
/// message (a publish whose answer was lost, sent again) stores nothing and answers the
/// sequence it is stored under. By request to a server and by a direct submit alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_task_is_stored_once_and_keeps_no_id_in_the_duplicate_window() {
    let env = Env::start(Env::server()).await;
    let direct = ax_sdk::Client::new(env.client.clone()).direct_submits(true);
    let delayed = env.js.get_stream("AX_DELAYED").await.unwrap();
    for (how, client) in [("by request", &env.ax), ("direct", &direct)] {
        let spec = TaskSpec::new("t").json(&1).delay(Duration::from_secs(3600));
        let accepted = client.submit("q", spec).await.unwrap();
        let subject = ax_core::names::delayed_subject("q", ax_sdk::Priority::Normal, &accepted.id);
        let stored = delayed
            .get_last_raw_message_by_subject(&subject)
            .await
            .unwrap();
        assert!(
            stored.headers.get("Nats-Msg-Id").is_none(),
            "{how}: stored without a message id"
        );
        // The window holds no id for it: another message under its id is stored.
        let mut probe = async_nats::HeaderMap::new();
        probe.insert("Nats-Msg-Id", accepted.id.as_str());
        let ack = env
            .js
            .publish_with_headers("ax.delayed.probe.normal.0.x", probe, "".into())
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(
            !ack.duplicate,
            "{how}: the duplicate window held the task's id"
        );
        delayed.delete_message(ack.sequence).await.unwrap();
        // Published again as a producer whose answer was lost would: stored once.
        let before = env.stream_len("AX_DELAYED").await;
        let meta = ax_core::task::TaskMeta::from_headers(&stored.headers).unwrap();
        let seq = ax_core::admit::publish_task(&env.js, subject, &meta, stored.payload)
            .await
            .unwrap_or_else(|e| panic!("{how}: a re-publish of a stored task failed: {e}"));
        assert_eq!(seq, stored.sequence, "{how}: answers where it is stored");
        assert_eq!(env.stream_len("AX_DELAYED").await, before, "{how}");
    }
}
