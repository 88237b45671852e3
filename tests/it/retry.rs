//! Retries with backoff, dead letters, hard timeouts.

use crate::support::Env;
use ax_core::task::header;
use ax_sdk::worker::{Task, TaskError, Worker};
use ax_sdk::{TaskSpec, TaskState};
use futures::StreamExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The dead letter of a task, read from AX_DEAD.
async fn dead_letter(env: &Env, id: &str) -> async_nats::HeaderMap {
    let stream = env.js.get_stream("AX_DEAD").await.unwrap();
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default())
        .await
        .unwrap();
    let mut msgs = consumer.messages().await.unwrap();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(5), msgs.next())
            .await
            .expect("a dead letter")
            .unwrap()
            .unwrap();
        let headers = msg.headers.clone().unwrap();
        if headers.get(header::ID).map(|v| v.as_str()) == Some(id) {
            return headers;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_errors_back_off_exponentially() {
    let env = Env::start(Env::server()).await;
    let starts: Arc<Mutex<Vec<(u32, Instant)>>> = Arc::default();
    let worker = Worker::builder("q")
        .handler({
            let starts = starts.clone();
            move |task: Task| {
                let starts = starts.clone();
                async move {
                    starts.lock().unwrap().push((task.attempt, Instant::now()));
                    if task.attempt < 4 {
                        Err(TaskError::new("io", format!("flaky {}", task.attempt)))
                    } else {
                        Ok(())
                    }
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let spec =
        TaskSpec::new("flaky").backoff(Duration::from_millis(300), Duration::from_secs(5), 0.1);
    let id = env.ax.submit("q", spec).await.unwrap().id;
    let rec = env
        .wait_state(&id, TaskState::Succeeded, Duration::from_secs(15))
        .await;
    assert_eq!(rec.attempt, 4);
    assert_eq!(rec.last_error.as_ref().unwrap().message, "flaky 3");
    let starts = starts.lock().unwrap().clone();
    assert_eq!(starts.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 2, 3, 4]);
    // Delays are base × 2^(n-1) = 300, 600, 1,200 ms, shortened by at most 10 % jitter;
    // each gap is that delay plus the redelivery and claim (allowed: 800 ms on a loaded
    // machine). Three gaps tell doubling from a constant (300, 300, 300) or a linear
    // (300, 600, 900) backoff, and the upper bounds a steeper one.
    for (n, nominal) in [300u64, 600, 1200].into_iter().enumerate() {
        let gap = starts[n + 1].1 - starts[n].1;
        let low = Duration::from_millis(nominal * 9 / 10);
        let high = Duration::from_millis(nominal + 800);
        assert!(
            gap >= low && gap <= high,
            "retry {} came after {gap:?}, not within {low:?}..{high:?}",
            n + 1
        );
    }
    // The record went through retrying between attempts.
    let states: Vec<(TaskState, u32)> = env
        .ax
        .history(&id)
        .await
        .unwrap()
        .into_iter()
        .map(|(r, _)| (r.state, r.attempt))
        .collect();
    assert!(
        (1..=3).all(|a| states.contains(&(TaskState::Retrying, a))),
        "{states:?}"
    );
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_retryable_and_exhausted_tasks_are_dead_lettered() {
    let env = Env::start(Env::server()).await;
    let worker = Worker::builder("q")
        .handler(|task: Task| async move {
            match task.name.as_str() {
                // Only failures: name the (absent) output type.
                "permanent" => Err::<(), _>(TaskError::permanent("validation", "bad order")),
                "listed" => Err(TaskError::new("http.404", "gone")),
                _ => Err(TaskError::new(
                    "io",
                    format!("still failing at {}", task.attempt),
                )),
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let fast = |name: &str| {
        TaskSpec::new(name).backoff(Duration::from_millis(20), Duration::from_millis(50), 0.0)
    };
    let permanent = env.ax.submit("q", fast("permanent")).await.unwrap().id;
    let listed = env
        .ax
        .submit("q", fast("listed").no_retry_on(["http.404"]))
        .await
        .unwrap()
        .id;
    let exhausted = env
        .ax
        .submit("q", fast("exhausted").max_attempts(3))
        .await
        .unwrap()
        .id;

    let rec = env
        .wait_state(&permanent, TaskState::Dead, Duration::from_secs(10))
        .await;
    assert_eq!(
        (rec.attempt, rec.last_error.unwrap().class.as_str()),
        (1, "validation")
    );
    let rec = env
        .wait_state(&listed, TaskState::Dead, Duration::from_secs(10))
        .await;
    assert_eq!(rec.attempt, 1);
    let rec = env
        .wait_state(&exhausted, TaskState::Dead, Duration::from_secs(10))
        .await;
    assert_eq!(rec.attempt, 3);
    assert_eq!(rec.last_error.unwrap().message, "still failing at 3");

    let h = dead_letter(&env, &exhausted).await;
    assert_eq!(h.get(header::ERROR_CLASS).unwrap().as_str(), "io");
    assert_eq!(h.get(header::ATTEMPTS).unwrap().as_str(), "3");
    let h = dead_letter(&env, &permanent).await;
    assert_eq!(h.get(header::ERROR_MESSAGE).unwrap().as_str(), "bad order");
    // Dead tasks are terminated: nothing is left to deliver.
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, 0);
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_timeout_aborts_the_handler() {
    let env = Env::start(Env::server()).await;
    let finished = Arc::new(AtomicBool::new(false));
    let worker = Worker::builder("q")
        .handler({
            let finished = finished.clone();
            move |_task: Task| {
                let finished = finished.clone();
                async move {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    finished.store(true, Ordering::SeqCst);
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let spec = TaskSpec::new("slow")
        .timeout(Duration::from_millis(200))
        .max_attempts(2)
        .backoff(Duration::from_millis(50), Duration::from_millis(50), 0.0);
    let started = Instant::now();
    let id = env.ax.submit("q", spec).await.unwrap().id;
    let rec = env
        .wait_state(&id, TaskState::Dead, Duration::from_secs(10))
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "attempts were cut short"
    );
    assert_eq!(rec.attempt, 2);
    assert_eq!(rec.last_error.unwrap().class, "timeout");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !finished.load(Ordering::SeqCst),
        "the aborted handler never resumed"
    );
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_ready_message_is_dead_lettered_not_retried() {
    let env = Env::start(Env::server()).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(header::ID, "not-a-task");
    env.js
        .publish_with_headers("ax.ready.q.normal", headers, "garbage".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let worker = Worker::builder("q")
        .handler({
            let ran = ran.clone();
            move |_t: Task| {
                let ran = ran.clone();
                async move {
                    ran.store(true, Ordering::SeqCst);
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let h = dead_letter(&env, "not-a-task").await;
    assert_eq!(h.get(header::ERROR_CLASS).unwrap().as_str(), "bad_message");
    crate::support::eventually(
        Duration::from_secs(5),
        "the message to leave the queue",
        || async { (env.stream_len("AX_READY_NORMAL").await == 0).then_some(()) },
    )
    .await;
    assert!(!ran.load(Ordering::SeqCst), "the handler never saw it");
    stop.cancel();
    handle.await.unwrap();
}
