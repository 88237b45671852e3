//! A cancel whose task moves on while it is being cancelled: the attempt it read fails
//! and hands the task back for a retry before the cancel's signal. The operations API's
//! cancel follows the task and ends it; a `cancel_in_progress` trigger's fire makes sure
//! the previous fire's task is ended (or its cancel recorded) before it fires.

use crate::support::{eventually, within, Env};
use crate::triggers::fired;
use ax_sdk::worker::{Task, TaskError, Worker};
use ax_sdk::{TaskSpec, TaskState};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A server whose cancels signal a running attempt 800 ms after they read its record.
async fn slow_signals() -> Env {
    let faults = ax_core::faults::Faults::armed();
    faults.cancel_signal_delay(Duration::from_millis(800));
    Env::start(
        Env::server()
            .ack_wait(Duration::from_secs(30))
            .faults(faults),
    )
    .await
}

/// The ids of the tasks whose handler started, in order.
type Starts = Arc<Mutex<Vec<String>>>;

/// Runs a worker on `env` whose handler writes `running` (so a cancel takes the running
/// task's path), notes its start, waits `wait(task)` and fails (to be retried).
fn failing_worker(
    env: &Env,
    wait: fn(&Task) -> Duration,
) -> (Starts, (CancellationToken, JoinHandle<()>)) {
    let starts: Starts = Default::default();
    let s = starts.clone();
    let worker = Worker::builder("q")
        .handler(move |task: Task| {
            let s = s.clone();
            async move {
                task.fencing_token().await?;
                s.lock().unwrap().push(task.id.clone());
                tokio::time::sleep(wait(&task)).await;
                Err::<(), _>(TaskError::new("flaky", "fails while cancelled"))
            }
        })
        .build()
        .unwrap();
    (starts, env.spawn_worker(worker))
}

/// The CI campaign at b0edb02 (single node, seed 7997574421656072346): a
/// `cancel_in_progress` trigger's previous run went on for a second after the next fire,
/// its cancel having come out while the task moved on. Here the cancel reads a running
/// attempt, which fails (a retry, 5 s later) before the cancel signals it: nobody answers,
/// and the cancel's record write meets the `retrying` record. That was a conflict ("try
/// again"), which the trigger engine took for "ended", and the retry ran; now the cancel
/// follows the task and ends it `cancelled`. Red before: the cancel answered a conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_follows_an_attempt_that_failed_while_it_signalled() {
    within(
        Duration::from_secs(60),
        "handed back under a cancel",
        async {
            let env = slow_signals().await;
            let (starts, _w) = failing_worker(&env, |_| Duration::from_millis(300));
            let spec = TaskSpec::new("t").max_attempts(3).backoff(
                Duration::from_secs(5),
                Duration::from_secs(5),
                0.0,
            );
            let id = env.ax.submit("q", spec).await.unwrap().id;
            eventually(Duration::from_secs(5), "the handler to start", || async {
                (starts.lock().unwrap().len() == 1).then_some(())
            })
            .await;
            let out = env.ax.cancel_task(&id).await;
            let out = out.expect("the cancel ends the task, not a conflict");
            assert_eq!(out.state, TaskState::Cancelled, "{out:?}");
            // Past the retry's due time: it is not run.
            tokio::time::sleep(Duration::from_secs(5)).await;
            assert_eq!(starts.lock().unwrap().len(), 1, "the handler ran once");
            let rec = env.record(&id).await;
            assert_eq!((rec.state, rec.attempt), (TaskState::Cancelled, 1));
        },
    )
    .await
}

/// A `cancel_in_progress` fire whose cancel of the previous run met that run's attempt
/// failing (a retry due 5 s later) still ends it before it fires: the retry never runs.
/// Red with neither the API's cancel following the task nor the engine reading the record
/// again after its cancel (the conflict was taken for "ended"); green with either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_in_progress_fire_ends_a_run_that_failed_while_it_was_cancelled() {
    within(
        Duration::from_secs(60),
        "overlap over a failing run",
        async {
            let env = slow_signals().await;
            // A first attempt fails 300 ms after the next fire's time (`<queue>.tr.
            // <trigger>.<scheduled ms>.<i>`): after that fire's cancel read it running,
            // before its signal (800 ms later).
            let (starts, _w) = failing_worker(&env, |task| {
                let scheduled: u64 = task.id.split('.').nth(3).unwrap().parse().unwrap();
                let fail_at = scheduled + 3_300;
                Duration::from_millis(fail_at.saturating_sub(ax_core::time::now_ms()))
            });
            let def = json!({
                "name": "slow", "kind": "interval", "every_ms": 3000,
                "overlap": "cancel_in_progress",
                "tasks": [{"name": "t", "queue": "q", "max_attempts": 3,
                           "backoff": {"base_ms": 5000, "max_ms": 5000, "jitter": 0.0}}],
            });
            env.ax.trigger("put", &def).await.unwrap();
            let recs = eventually(Duration::from_secs(15), "the second fire", || async {
                let recs = fired(&env, "slow").await;
                (recs.len() >= 2).then_some(recs)
            })
            .await;
            env.ax
                .trigger("pause", &json!({"name": "slow"}))
                .await
                .unwrap();
            let first = recs[0].id.clone();
            // Past the first run's retry time (5 s after its failure).
            tokio::time::sleep(Duration::from_secs(7)).await;
            let runs = starts
                .lock()
                .unwrap()
                .iter()
                .filter(|id| **id == first)
                .count();
            assert_eq!(runs, 1, "the first fire's task ran once");
            let rec = env.record(&first).await;
            assert_eq!(
                (rec.state, rec.attempt),
                (TaskState::Cancelled, 1),
                "{rec:?}"
            );
        },
    )
    .await
}
