//! The server's long-running parts are supervised: made to fail at start or to panic
//! mid-run (faults armed on a value the test hands the server), each comes back and does its work — cron keeps firing, a flow run
//! that was mid-way finishes, the task index lists new tasks — and a fire job that panics
//! does not stop its trigger, and a flow run whose turn panics still finishes.

use crate::flows::{finish, flow_worker, slow_chain, Calls};
use crate::support::{eventually, Env};
use crate::triggers::{fired, interval};
use ax_sdk::flow::RunState;
use ax_sdk::worker::{Task, Worker};
use serde_json::json;
use std::time::Duration;

fn quick_worker(
    env: &Env,
) -> (
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let worker = Worker::builder("q")
        .concurrency(8)
        .handler(|_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    env.spawn_worker(worker)
}

/// Waits until `trigger` has made `n` more fires than `from`.
async fn fires_beyond(env: &Env, trigger: &str, from: usize, n: usize, what: &str) -> usize {
    eventually(Duration::from_secs(20), what, || async {
        let now = fired(env, trigger).await.len();
        (now >= from + n).then_some(now)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_engine_that_panics_comes_back_and_keeps_firing() {
    let faults = ax_core::faults::Faults::armed();
    let env = Env::start(Env::server().faults(faults.clone())).await;
    let (stop, handle) = quick_worker(&env);
    let mut def = interval("beat", 1000);
    def["overlap"] = json!("allow");
    env.ax.trigger("put", &def).await.unwrap();
    let before = fires_beyond(&env, "beat", 0, 2, "two fires").await;
    faults.panic_service("trigger-engine");
    // The engine panics within 50 ms, is started again within a backoff of 100 ms, takes
    // its lease back (same holder) and fires on.
    fires_beyond(
        &env,
        "beat",
        before,
        4,
        "four fires after the engine panicked",
    )
    .await;
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_engine_that_fails_at_start_is_started_again_and_fires() {
    // Its first three starts fail at once (as when its buckets cannot be opened: it used
    // to stay stopped, cron silent until the process exited).
    let faults = ax_core::faults::Faults::armed();
    faults.fail_service_starts("trigger-engine", 3);
    let env = Env::start(Env::server().faults(faults)).await;
    let (stop, handle) = quick_worker(&env);
    let mut def = interval("late", 1000);
    def["overlap"] = json!("allow");
    env.ax.trigger("put", &def).await.unwrap();
    fires_beyond(&env, "late", 0, 2, "two fires once the engine could start").await;
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fire_job_that_panics_does_not_stop_its_trigger() {
    let faults = ax_core::faults::Faults::armed();
    let env = Env::start(Env::server().faults(faults.clone())).await;
    let (stop, handle) = quick_worker(&env);
    faults.panic_next_fire("jolt");
    let mut def = interval("jolt", 1000);
    def["overlap"] = json!("allow");
    env.ax.trigger("put", &def).await.unwrap();
    // Its first fire job panics before firing (after claiming the state as this term's);
    // the trigger fires at its next times, and the time it did not fire is fired late.
    fires_beyond(&env, "jolt", 0, 3, "three fires after a fire job panicked").await;
    env.ax
        .trigger("pause", &json!({"name": "jolt"}))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let state = env
        .ax
        .trigger("get", &json!({"name": "jolt"}))
        .await
        .unwrap()["state"]
        .clone();
    let fires = state["fires"].as_u64().unwrap();
    assert!(fires >= 3, "{state}");
    // Every scheduled time handled (every second from one after creation) is counted fired
    // or skipped, and each counted fire was made: the claim writes the state as read, not
    // the plan's, which counts the time the panicked job never fired as handled.
    let made = fired(&env, "jolt").await.len() as u64;
    let created = state["created_at_ms"].as_u64().unwrap();
    let last = state["last_scheduled_ms"].as_u64().unwrap();
    let handled = (last - created - 1000) / 1000 + 1;
    let skipped = state["skipped"].as_u64().unwrap();
    assert_eq!(
        fires + skipped,
        handled,
        "every time handled is counted: {state}"
    );
    assert_eq!(fires, made, "each counted fire was made: {state}");
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_engine_that_panics_comes_back_and_its_run_finishes() {
    let faults = ax_core::faults::Faults::armed();
    let env = Env::start(Env::server().faults(faults.clone())).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let def = slow_chain("mid");
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("mid", json!({"x": 7})).await.unwrap();
    // Step a runs: panic the engine while the run waits on it.
    eventually(Duration::from_secs(10), "step a running", || async {
        let view = env.ax.flow("get", &json!({ "run": run })).await.ok()?;
        (view["steps"][0]["state"] == "running").then_some(())
    })
    .await;
    faults.panic_service("flow-engine");
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    let once = calls.lock().unwrap().values().all(|&n| n == 1);
    assert!(once, "each step ran once: {:?}", calls.lock().unwrap());
}

/// A flow run's turn that panics (a bug in the actor) is caught by the engine, which reads
/// the run again: the run still finishes, each step once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_run_whose_turn_panics_still_finishes() {
    let faults = ax_core::faults::Faults::armed();
    let env = Env::start(Env::server().faults(faults.clone())).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    env.ax.put_flow(&slow_chain("turn")).await.unwrap();
    let run = env.ax.run_flow("turn", json!({"x": 1})).await.unwrap();
    // Its next turn (when step a ends, to start b) panics.
    faults.panic_next_turn(&run);
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert!(
        !faults.turn_panics(&run),
        "no turn panicked: the test proved nothing"
    );
    let once = calls.lock().unwrap().values().all(|&n| n == 1);
    assert!(once, "each step ran once: {:?}", calls.lock().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_index_that_panics_comes_back_and_lists_new_tasks() {
    let faults = ax_core::faults::Faults::armed();
    let env = Env::start(Env::server().faults(faults.clone()).task_index(true)).await;
    // Found through the index (`ax.task.list`), not by reading the bucket.
    let listed = |id: String| {
        let ax = env.ax.clone();
        async move {
            let all = ax
                .find_tasks(&serde_json::from_value(json!({"limit": 1000})).unwrap())
                .await
                .ok()?;
            all.tasks.iter().any(|r| r.id == id).then_some(())
        }
    };
    // Immediate tasks, recorded by their claim: listed from their records (the feed of
    // `AX_TASKS`, the service that panics), not from a delayed message.
    let (worker, _runs) = crate::support::counting_worker(2);
    let (_stop, _handle) = env.spawn_worker(worker);
    let task = || ax_sdk::TaskSpec::new("t");
    let first = env.ax.submit("q", task()).await.unwrap().id;
    eventually(Duration::from_secs(10), "the first task listed", || {
        listed(first.clone())
    })
    .await;
    faults.panic_service("task-index");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = env.ax.submit("q", task()).await.unwrap().id;
    eventually(
        Duration::from_secs(15),
        "a task submitted after the panic listed",
        || listed(second.clone()),
    )
    .await;
}
