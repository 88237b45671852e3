//! A worker serving several task names : a handler and options per name;
//! options apply where the submit left them unset; an unserved name is handed back, not
//! failed; a name's own concurrency limit holds.

use crate::support::Env;
use ax_sdk::worker::{Task, TaskError, TaskOptions, Worker};
use ax_sdk::{TaskSpec, TaskState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

async fn finished(env: &Env, id: &str) -> ax_sdk::TaskRecord {
    tokio::time::timeout(Duration::from_secs(20), env.ax.wait(id))
        .await
        .unwrap_or_else(|_| panic!("task {id} did not finish"))
        .unwrap()
        .record
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_name_runs_its_handler_with_its_options() {
    let env = Env::start(Env::server()).await;
    let fast =
        || TaskOptions::new().backoff(Duration::from_millis(10), Duration::from_millis(10), 0.0);
    let worker = Worker::builder("q")
        .task("double", |t: Task| async move {
            let n: i64 = t.json()?;
            Ok(serde_json::json!(n * 2))
        })
        .task_with("flaky", fast().max_attempts(2), |_t: Task| async {
            Err::<(), _>(TaskError::new("io", "always"))
        })
        .task_with(
            "slow",
            fast().timeout(Duration::from_millis(200)).max_attempts(1),
            |_t: Task| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok(())
            },
        )
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let submit = |spec: TaskSpec| {
        let ax = env.ax.clone();
        async move { ax.submit("q", spec).await.unwrap().id }
    };
    let double = submit(TaskSpec::new("double").json(&21)).await;
    let flaky = submit(TaskSpec::new("flaky")).await;
    // The producer's own values win over the worker's options.
    let flaky3 = submit(TaskSpec::new("flaky").max_attempts(3).backoff(
        Duration::from_millis(10),
        Duration::from_millis(10),
        0.0,
    ))
    .await;
    let slow = submit(TaskSpec::new("slow")).await;

    let done = env.ax.wait(&double).await.unwrap();
    assert_eq!(done.output.unwrap().json::<i64>().unwrap(), 42);
    let rec = finished(&env, &flaky).await;
    assert_eq!(
        (rec.state, rec.attempt, rec.max_attempts),
        (TaskState::Dead, 2, 2),
        "the worker's max_attempts (the submit gave none)"
    );
    let rec = finished(&env, &flaky3).await;
    assert_eq!(
        (rec.state, rec.attempt, rec.max_attempts),
        (TaskState::Dead, 3, 3),
        "the producer's max_attempts"
    );
    let rec = finished(&env, &slow).await;
    assert_eq!((rec.state, rec.attempt), (TaskState::Dead, 1));
    assert_eq!(
        rec.last_error.unwrap().class,
        "timeout",
        "the worker's 200 ms timeout, not the default 30 s"
    );
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unserved_name_is_handed_back_until_a_worker_serves_it() {
    let env = Env::start(Env::server()).await;
    let only_a = Worker::builder("q")
        .task("a", |_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    let (stop_a, handle_a) = env.spawn_worker(only_a);
    let a = env.ax.submit("q", TaskSpec::new("a")).await.unwrap().id;
    let b = env.ax.submit("q", TaskSpec::new("b")).await.unwrap().id;
    assert_eq!(finished(&env, &a).await.state, TaskState::Succeeded);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (rec, _) = env.ax.task(&b).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.attempt),
        (TaskState::Pending, 0),
        "handed back untouched: not failed, no attempt counted"
    );
    // A rolling deploy: the old worker leaves, a new one serving `b` arrives. (With both
    // running, which idle worker gets the redelivery is random: their long polls jitter.)
    stop_a.cancel();
    handle_a.await.unwrap();
    let serves_b = Worker::builder("q")
        .task("b", |_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    let (stop_b, handle_b) = env.spawn_worker(serves_b);
    let rec = finished(&env, &b).await;
    assert_eq!((rec.state, rec.attempt), (TaskState::Succeeded, 1));
    stop_b.cancel();
    handle_b.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_never_runs_more_than_its_own_concurrency() {
    let env = Env::start(Env::server()).await;
    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let worker = Worker::builder("q")
        .concurrency(8)
        .task_with("limited", TaskOptions::new().concurrency(2), {
            let (now, most) = (now.clone(), most.clone());
            move |_t: Task| {
                let (now, most) = (now.clone(), most.clone());
                async move {
                    let running = now.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(running, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    now.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..10 {
        ids.push(
            env.ax
                .submit("q", TaskSpec::new("limited"))
                .await
                .unwrap()
                .id,
        );
    }
    let (stop, handle) = env.spawn_worker(worker);
    for id in &ids {
        assert_eq!(finished(&env, id).await.state, TaskState::Succeeded);
    }
    assert_eq!(
        most.load(Ordering::SeqCst),
        2,
        "at most 2 at once, and 2 reached"
    );
    stop.cancel();
    handle.await.unwrap();
}
