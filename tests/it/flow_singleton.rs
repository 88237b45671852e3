//! Singleton keys of flow runs (`FlowStart::singleton`): while a run holding a key has not
//! ended, a start with it is refused naming that run (`cancel_new`) or cancels it — its
//! running step's handler told — and starts (`cancel_in_progress`); racing starts leave one
//! holder; a run that ended frees its key.

use crate::singleton::{worker, Runs};
use crate::support::{eventually, Env};
use ax_core::protocol::ErrorCode;
use ax_sdk::flow::{FlowStart, RunState};
use ax_sdk::{ClientError, Collision};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A flow of two steps on `q`: `a`, then `b`.
async fn put_flow(env: &Env) {
    let flow = json!({"name": "sync", "steps": [
        {"name": "a", "task": {"name": "t", "queue": "q"}},
        {"name": "b", "task": {"name": "t", "queue": "q"}, "needs": ["a"]}]});
    env.ax.flow("put", &flow).await.unwrap();
}

fn start(key: &str, on: Collision) -> FlowStart {
    FlowStart::new("sync", json!(null)).singleton(key, on)
}

/// The run a `cancel_new` refusal names.
fn holder(e: ClientError) -> String {
    match e {
        ClientError::Refused(w) if w.code == ErrorCode::Running => {
            w.run_id.expect("a running refusal names the holder run")
        }
        other => panic!("not a running refusal: {other}"),
    }
}

async fn wait_ended(env: &Env, run: &str) -> RunState {
    tokio::time::timeout(Duration::from_secs(30), env.ax.wait_flow(run))
        .await
        .expect("the run ends")
        .unwrap()
        .state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_new_refuses_while_the_run_holds_the_key_and_starts_once_it_ended() {
    let env = Env::start(Env::server()).await;
    put_flow(&env).await;
    let first = env
        .ax
        .start_flow(start("k", Collision::CancelNew))
        .await
        .unwrap();
    for _ in 0..3 {
        let refused = env.ax.start_flow(start("k", Collision::CancelNew)).await;
        assert_eq!(holder(refused.unwrap_err()), first, "names the running run");
    }
    // Another key, and a start without a key, are not refused.
    let other = env
        .ax
        .start_flow(start("other", Collision::CancelNew))
        .await
        .unwrap();
    let plain = env.ax.run_flow("sync", json!(null)).await.unwrap();
    // A bad key is the caller's error, by field.
    let bad = env
        .ax
        .start_flow(start("no spaces", Collision::CancelNew))
        .await;
    match bad.unwrap_err() {
        ClientError::Refused(w) => assert_eq!(w.field.as_deref(), Some("singleton.key")),
        other => panic!("{other}"),
    }

    let runs = Arc::new(Mutex::new(Runs::default()));
    let (stop, handle) = env.spawn_worker(worker(runs.clone(), Duration::from_millis(1)));
    for run in [&first, &other, &plain] {
        assert_eq!(wait_ended(&env, run).await, RunState::Succeeded, "{run}");
    }
    // Its run ended: the key is free again.
    let next = env
        .ax
        .start_flow(start("k", Collision::CancelNew))
        .await
        .unwrap();
    assert_ne!(next, first);
    assert_eq!(wait_ended(&env, &next).await, RunState::Succeeded);
    stop.cancel();
    handle.await.unwrap();
    assert_eq!(
        runs.lock().unwrap().started.len(),
        8,
        "two steps of k twice, other and plain: no refused start ran a step"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_in_progress_cancels_the_running_run_and_stops_its_handler() {
    let env = Env::start(Env::server()).await;
    put_flow(&env).await;
    let runs = Arc::new(Mutex::new(Runs::default()));
    let (stop, handle) = env.spawn_worker(worker(runs.clone(), Duration::from_secs(30)));
    let on = Collision::CancelInProgress;
    let first = env.ax.start_flow(start("k", on)).await.unwrap();
    let first_a = format!("q.fl.{first}.a.0.0");
    eventually(
        Duration::from_secs(15),
        "the first run's step a to start",
        || async {
            runs.lock()
                .unwrap()
                .started
                .contains_key(&first_a)
                .then_some(())
        },
    )
    .await;
    let second = env.ax.start_flow(start("k", on)).await.unwrap();
    assert_ne!(second, first);
    // The step's task is cancelled by the time the start is answered.
    let rec = env.record(&first_a).await;
    assert_eq!(rec.state, ax_sdk::TaskState::Cancelled, "{rec:?}");
    assert_eq!(wait_ended(&env, &first).await, RunState::Cancelled);
    let second_a = format!("q.fl.{second}.a.0.0");
    eventually(
        Duration::from_secs(15),
        "the second run's step a to start",
        || async {
            runs.lock()
                .unwrap()
                .started
                .contains_key(&second_a)
                .then_some(())
        },
    )
    .await;
    // (Its handler stopped too, so the worker stops at once.)
    env.ax.cancel_task(&second_a).await.unwrap();
    stop.cancel();
    handle.await.unwrap();
    let runs = runs.lock().unwrap();
    assert_eq!(runs.started.get(&first_a), Some(&1));
    assert_eq!(
        runs.finished.get(&first_a),
        None,
        "the cancelled run's handler was stopped"
    );
    assert!(
        !runs.started.contains_key(&format!("q.fl.{first}.b.0.0")),
        "the cancelled run's next step never started"
    );
}

/// Twenty starts of one key at once: one run starts, every other start names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_starts_leave_one_holder() {
    let env = Env::start(Env::server()).await;
    put_flow(&env).await;
    for round in 0..3 {
        let key = format!("race{round}");
        let starts = (0..20).map(|_| env.ax.start_flow(start(&key, Collision::CancelNew)));
        let results = futures::future::join_all(starts).await;
        let started: Vec<&String> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(started.len(), 1, "round {round}: {results:?}");
        let winner = started[0].clone();
        for r in results.into_iter().filter(|r| r.is_err()) {
            assert_eq!(holder(r.unwrap_err()), winner, "round {round}");
        }
    }
    let listed = env.ax.flow("list", &json!({"flow": "sync"})).await.unwrap();
    assert_eq!(
        listed.as_array().map(Vec::len),
        Some(3),
        "no refused start stored a run: {listed}"
    );
}

/// The CLI: `ax flow run --singleton` (default `cancel_new`) refuses a second start naming
/// the running run; `--on-collision cancel_in_progress` cancels it and starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_starts_a_run_with_a_singleton_key() {
    let env = Env::start(Env::server()).await;
    put_flow(&env).await;
    let run = |extra: &'static [&'static str]| {
        let env = &env;
        async move {
            let mut args = vec!["flow", "run", "sync", "--singleton", "k"];
            args.extend_from_slice(extra);
            let out = crate::limits::ax_cli(env, &args).await;
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).trim().to_string(),
                String::from_utf8_lossy(&out.stderr).to_string(),
            )
        }
    };
    let (ok, first, err) = run(&[]).await;
    assert!(ok, "{err}");
    let (ok, _, err) = run(&[]).await;
    assert!(!ok && err.contains(&first), "{err}");
    let (ok, second, err) = run(&["--on-collision", "cancel_in_progress"]).await;
    assert!(ok && second != first, "{err}");
    assert_eq!(wait_ended(&env, &first).await, RunState::Cancelled);
    let (ok, _, err) = run(&["--on-collision", "queue"]).await;
    assert!(!ok && err.contains("cancel_new"), "{err}");
}
