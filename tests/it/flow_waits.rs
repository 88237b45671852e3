//! Flows that wait: a sleep step holds its children until its time, held by the broker
//! (a delayed wait task no worker runs), shown as sleeping, ended once whatever servers
//! die meanwhile, and ended early by "run now".

use crate::flows::{finish, flow_worker, step, waiting, Calls, TwoServers, SERVER_ARGS};
use crate::procs::AxProc;
use crate::support::Env;
use ax_sdk::flow::{FlowDef, RunState, StepDef, StepState};
use ax_sdk::{SubmitRequest, TaskState};
use serde_json::{json, Value};
use std::time::Duration;

/// Times a task's record moved to `succeeded`.
async fn successes(ax: &ax_sdk::Client, id: &str) -> usize {
    let history = ax.history(id).await.unwrap();
    let states: Vec<TaskState> = history.iter().map(|(r, _)| r.state).collect();
    states
        .windows(2)
        .filter(|w| w[0] != TaskState::Succeeded && w[1] == TaskState::Succeeded)
        .count()
        + usize::from(states.first() == Some(&TaskState::Succeeded))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleep_step_holds_its_child_until_its_time_and_shows_it() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let def = FlowDef::new("nap")
        .step(step("a", "seed"))
        .step(StepDef::sleep_for("z", "q", Duration::from_millis(1500)).needs(["a"]))
        .step(step("b", "echo").needs(["z"]));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("nap", json!({"x": 7})).await.unwrap();
    let z = waiting(&env.ax, &run, "z", "sleep").await;
    let started = z["started_at_ms"].as_u64().unwrap();
    let until = z["waiting"]["until_ms"].as_u64().unwrap();
    assert_eq!(until, started + 1500, "{z}");
    assert_eq!(z["state"], "running");
    assert_eq!(z["task"], "ax.sleep");
    // Its timer is a scheduled task of queue q, due when the sleep ends.
    let timer = env.record(z["task_id"].as_str().unwrap()).await;
    assert_eq!(
        (timer.state, timer.run_at_ms),
        (TaskState::Scheduled, Some(until))
    );
    let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
    assert_eq!(
        view["steps"][2]["state"], "waiting",
        "b waits for the sleep"
    );
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
    let b_id = view["steps"][2]["task_id"].as_str().unwrap().to_string();
    let b = env.ax.wait(&b_id).await.unwrap();
    assert!(
        b.record.started_at_ms.unwrap() >= until,
        "b started {} ms before the sleep's end",
        until - b.record.started_at_ms.unwrap()
    );
    let output: Value = b.output.unwrap().json().unwrap();
    assert_eq!(output, json!({"z": null}), "a sleep's output is null");
    assert!(
        view["steps"][1].get("waiting").is_none(),
        "no longer sleeping"
    );
    let ran: Vec<String> = calls.lock().unwrap().keys().cloned().collect();
    assert_eq!(ran.len(), 2, "no worker ran the sleep: {ran:?}");
    assert!(ran.iter().all(|id| !id.contains(".z.")), "{ran:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleep_outlives_every_server_and_ends_once() {
    let TwoServers {
        env,
        url,
        mut servers,
        calls,
        worker: _worker,
    } = TwoServers::start().await;
    let def = FlowDef::new("long_nap")
        .step(StepDef::sleep_for("z", "q", Duration::from_millis(2500)))
        .step(step("b", "seed").needs(["z"]));
    env.ax.put_flow(&def).await.unwrap();
    let runs: Vec<String> =
        futures::future::join_all((0..5).map(|i| env.ax.run_flow("long_nap", json!({ "x": i }))))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
    let mut wakes = Vec::new();
    for run in &runs {
        let z = waiting(&env.ax, run, "z", "sleep").await;
        wakes.push(z["waiting"]["until_ms"].as_u64().unwrap());
    }
    // No ax server is left while the sleeps are due: nothing holds them but the broker.
    for s in &mut servers {
        s.kill9();
    }
    let last = *wakes.iter().max().unwrap();
    let now = ax_core::time::now_ms();
    tokio::time::sleep(Duration::from_millis(last.saturating_sub(now) + 500)).await;
    servers = vec![
        AxProc::spawn(&url, &SERVER_ARGS),
        AxProc::spawn(&url, &SERVER_ARGS),
    ];
    for (run, wake) in runs.iter().zip(&wakes) {
        let ended = finish(&env.ax, run).await;
        assert_eq!(
            ended.state,
            RunState::Succeeded,
            "{run}: {:?}",
            ended.reason
        );
        let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
        let z_id = view["steps"][0]["task_id"].as_str().unwrap();
        assert_eq!(
            successes(&env.ax, z_id).await,
            1,
            "{run}: the sleep ended once"
        );
        let b = env
            .record(view["steps"][1]["task_id"].as_str().unwrap())
            .await;
        assert!(
            b.started_at_ms.unwrap() >= *wake,
            "{run}: b ran before its sleep's end"
        );
    }
    let calls = calls.lock().unwrap();
    assert_eq!(
        calls.len(),
        5,
        "one b a run, no sleep ran on a worker: {calls:?}"
    );
    assert!(
        calls.values().all(|n| *n == 1),
        "a task ran twice: {calls:?}"
    );
    drop(servers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_now_ends_a_sleep_early_and_a_cancel_ends_it_cancelled() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let def = FlowDef::new("hour_nap")
        .step(StepDef::sleep_for("z", "q", Duration::from_secs(3600)))
        .step(step("b", "seed").needs(["z"]));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("hour_nap", json!({"x": 1})).await.unwrap();
    let z = waiting(&env.ax, &run, "z", "sleep").await;
    let z_id = z["task_id"].as_str().unwrap().to_string();
    env.ax.run_now(&z_id).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert_eq!(env.record(&z_id).await.state, TaskState::Succeeded);
    // A cancelled run's sleep ends cancelled, and its timer never ends it later.
    let run = env.ax.run_flow("hour_nap", json!({"x": 2})).await.unwrap();
    let z = waiting(&env.ax, &run, "z", "sleep").await;
    let z_id = z["task_id"].as_str().unwrap().to_string();
    env.ax.flow("cancel", &json!({ "run": run })).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Cancelled);
    let (_, steps) = env.ax.flow_run(&run).await.unwrap().unwrap();
    assert_eq!(steps[0].state, StepState::Cancelled);
    assert_eq!(env.record(&z_id).await.state, TaskState::Cancelled);
    assert_eq!(calls.lock().unwrap().len(), 1, "only the first run's b ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sleeps_are_refused_by_field() {
    let env = Env::start(Env::server()).await;
    let flow = |sleep: Value| {
        json!({"name": "bad", "steps": [
            {"name": "a", "task": {"name": "seed", "queue": "q"}},
            {"name": "z", "needs": ["a"], "sleep": sleep}]})
    };
    for (sleep, field) in [
        (json!({}), "steps[1].sleep"),
        (
            json!({"for_ms": 5, "until": "2030-01-01T00:00:00Z"}),
            "steps[1].sleep",
        ),
        (json!({"for_ms": 0}), "steps[1].sleep.for_ms"),
        (
            json!({"for_ms": 40u64 * 24 * 3600 * 1000}),
            "steps[1].sleep.for_ms",
        ),
        (json!({"until": "tomorrow"}), "steps[1].sleep.until"),
    ] {
        let e = env.ax.flow("put", &flow(sleep.clone())).await.unwrap_err();
        let ax_sdk::ClientError::Refused(e) = e else {
            panic!("{sleep}: {e}")
        };
        assert_eq!(e.field.as_deref(), Some(field), "{sleep}: {}", e.message);
    }
    // A sleep with a task of its own, or fanning out, or with no queue to hold it.
    let with_task = json!({"name": "bad", "steps": [
        {"name": "z", "sleep": {"for_ms": 5}, "task": {"name": "x", "queue": "q"}}]});
    let only_sleep = json!({"name": "bad", "steps": [{"name": "z", "sleep": {"for_ms": 5}}]});
    for (def, field) in [
        (with_task, "steps[0].task"),
        (only_sleep, "steps[0].sleep.queue"),
    ] {
        let e = env.ax.flow("put", &def).await.unwrap_err();
        let ax_sdk::ClientError::Refused(e) = e else {
            panic!("{def}: {e}")
        };
        assert_eq!(e.field.as_deref(), Some(field), "{def}: {}", e.message);
    }
    // The same with a queue named is fine, and `def` gives back its wait task.
    let named = json!({"name": "ok", "steps": [
        {"name": "z", "sleep": {"until": "2000-01-01T00:00:00Z", "queue": "q"}}]});
    env.ax.flow("put", &named).await.unwrap();
    let back = env.ax.flow("def", &json!({"name": "ok"})).await.unwrap();
    let task: SubmitRequest = serde_json::from_value(back["steps"][0]["task"].clone()).unwrap();
    assert_eq!(
        (task.name.as_str(), task.queue.as_deref()),
        ("ax.sleep", Some("q"))
    );
    // A sleep until a past time ends at once.
    let run = env.ax.run_flow("ok", Value::Null).await.unwrap();
    assert_eq!(finish(&env.ax, &run).await.state, RunState::Succeeded);
}

/// A wait task's message can be due before its record is written (the submit stores the
/// message first), or its submit can die in between: the dispatcher then creates the
/// record the message stands for and ends the wait, instead of dropping the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_wait_whose_record_is_not_written_yet_still_ends() {
    let env = Env::start(Env::server()).await;
    let req = SubmitRequest {
        name: ax_sdk::flow::SLEEP_TASK.into(),
        queue: Some("q".into()),
        ..SubmitRequest::default()
    };
    let (mut meta, payload) =
        ax_core::task::TaskMeta::from_request("q", req, &ax_core::task::Limits::default()).unwrap();
    meta.run_at_ms = Some(ax_core::time::now_ms());
    meta.wait = Some(ax_core::task::Wait::Sleep);
    let subject = ax_core::admit::subject(&meta);
    ax_core::admit::publish_task(&env.js, subject, &meta, payload)
        .await
        .unwrap();
    let id = meta.id.clone();
    let ended = crate::support::eventually(Duration::from_secs(20), "the wait's end", || async {
        let (rec, _) = env.ax.task(&id).await.ok()??;
        rec.state.is_terminal().then_some(rec)
    })
    .await;
    assert_eq!(ended.state, TaskState::Succeeded, "{ended:?}");
}
