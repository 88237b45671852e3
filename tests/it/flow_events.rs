//! Flows that wait for an event: the step ends with the first matching event's payload
//! (published after it started, or within its lookback before), times out by its policy,
//! and ends once whatever ax servers die while events come.

use crate::flows::{finish, flow_worker, step, waiting, Calls, TwoServers, SERVER_ARGS};
use crate::procs::AxProc;
use crate::support::Env;
use ax_sdk::flow::{FlowDef, OnTimeout, RunState, StepDef, StepState, WaitForEventDef};
use ax_sdk::TaskState;
use serde_json::{json, Value};
use std::time::Duration;

/// A wait for `order.paid` whose `order_id` is the run input's `order`.
fn paid(timeout: Duration, on_timeout: OnTimeout, lookback_ms: Option<u64>) -> WaitForEventDef {
    let matches = json!({"order_id": "$input.order"});
    WaitForEventDef {
        event: "order.paid".into(),
        matches: matches.as_object().cloned().unwrap(),
        timeout_ms: Some(timeout.as_millis() as u64),
        on_timeout,
        lookback_ms,
        queue: None,
    }
}

/// Times a task's record moved to a final state.
pub(crate) async fn endings(ax: &ax_sdk::Client, id: &str) -> usize {
    let history = ax.history(id).await.unwrap();
    let states: Vec<TaskState> = history.iter().map(|(r, _)| r.state).collect();
    states
        .windows(2)
        .filter(|w| !w[0].is_terminal() && w[1].is_terminal())
        .count()
        + usize::from(states.first().is_some_and(|s| s.is_terminal()))
}

/// The output `b` (an `echo`) got: its parents' outputs.
async fn echoed(ax: &ax_sdk::Client, run: &str, b: usize) -> Value {
    let view = ax.flow("get", &json!({ "run": run })).await.unwrap();
    let id = view["steps"][b]["task_id"].as_str().unwrap().to_string();
    ax.wait(&id).await.unwrap().output.unwrap().json().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_ends_with_the_first_matching_event_and_shows_it() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let def = FlowDef::new("pay")
        .step(step("a", "seed"))
        .step(
            StepDef::wait_for_event(
                "w",
                "q",
                paid(Duration::from_secs(60), OnTimeout::Fail, None),
            )
            .needs(["a"]),
        )
        .step(step("b", "echo").needs(["w"]));
    env.ax.put_flow(&def).await.unwrap();
    let run = env
        .ax
        .run_flow("pay", json!({"x": 1, "order": 42}))
        .await
        .unwrap();
    let w = waiting(&env.ax, &run, "w", "event").await;
    let started = w["started_at_ms"].as_u64().unwrap();
    assert_eq!(w["waiting"]["event"], "order.paid");
    assert_eq!(
        w["waiting"]["until_ms"].as_u64(),
        Some(started + 60_000),
        "{w}"
    );
    assert_eq!(w["task"], "ax.wait_for_event");
    let w_id = w["task_id"].as_str().unwrap().to_string();
    // Its timeout is a scheduled task; what it matches is in AX_WAITS under its id.
    assert_eq!(env.record(&w_id).await.state, TaskState::Scheduled);
    let waits = env.js.get_key_value("AX_WAITS").await.unwrap();
    let reg: Value = serde_json::from_slice(&waits.get(&w_id).await.unwrap().unwrap()).unwrap();
    assert_eq!(
        reg["match"],
        json!({"order_id": 42}),
        "resolved from the input"
    );
    // Another order's event, an event of another name, then two of this order.
    env.ax
        .publish_event("order.paid", &json!({"order_id": 41}), None)
        .await
        .unwrap();
    env.ax
        .publish_event("order.refunded", &json!({"order_id": 42}), None)
        .await
        .unwrap();
    for amount in [5, 6] {
        env.ax
            .publish_event(
                "order.paid",
                &json!({"order_id": 42, "amount": amount}),
                None,
            )
            .await
            .unwrap();
    }
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert_eq!(
        echoed(&env.ax, &run, 2).await,
        json!({"w": {"order_id": 42, "amount": 5}}),
        "b got the first matching event as w's output"
    );
    assert_eq!(endings(&env.ax, &w_id).await, 1, "the wait ended once");
    let ran: Vec<String> = calls.lock().unwrap().keys().cloned().collect();
    assert!(
        ran.iter().all(|id| !id.contains(".w.")),
        "no worker ran the wait: {ran:?}"
    );
    crate::support::eventually(
        Duration::from_secs(10),
        "the registration's removal",
        || async { waits.get(&w_id).await.unwrap().is_none().then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_before_the_wait_counts_within_its_lookback_and_a_timeout_can_continue() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    // The webhook came before the run got to its wait: within the default 5 minutes.
    env.ax
        .publish_event("order.paid", &json!({"order_id": 7, "early": true}), None)
        .await
        .unwrap();
    let def = FlowDef::new("early")
        .step(StepDef::wait_for_event(
            "w",
            "q",
            paid(Duration::from_secs(60), OnTimeout::Fail, None),
        ))
        .step(step("b", "echo").needs(["w"]));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("early", json!({"order": 7})).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert_eq!(
        echoed(&env.ax, &run, 1).await,
        json!({"w": {"order_id": 7, "early": true}})
    );
    // One older than a 1 ms lookback does not count: the wait times out and, with
    // `continue`, its step succeeds with output null.
    env.ax
        .publish_event("order.paid", &json!({"order_id": 8}), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let def = FlowDef::new("late")
        .step(StepDef::wait_for_event(
            "w",
            "q",
            paid(Duration::from_millis(1500), OnTimeout::Continue, Some(1)),
        ))
        .step(step("b", "echo").needs(["w"]));
    env.ax.put_flow(&def).await.unwrap();
    let run = env.ax.run_flow("late", json!({"order": 8})).await.unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert_eq!(echoed(&env.ax, &run, 1).await, json!({"w": null}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_times_out_fails_its_step_by_default() {
    let env = Env::start(Env::server()).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let def = FlowDef::new("unpaid")
        .step(StepDef::wait_for_event(
            "w",
            "q",
            paid(Duration::from_millis(1000), OnTimeout::Fail, None),
        ))
        .step(step("b", "echo").needs(["w"]));
    env.ax.put_flow(&def).await.unwrap();
    let run = env
        .ax
        .run_flow("unpaid", json!({"order": 9}))
        .await
        .unwrap();
    let ended = finish(&env.ax, &run).await;
    assert_eq!(ended.state, RunState::Failed, "{:?}", ended.reason);
    let (_, steps) = env.ax.flow_run(&run).await.unwrap().unwrap();
    assert_eq!(steps[0].state, StepState::Failed);
    let error = steps[0].error.as_ref().expect("its error");
    assert_eq!(error.class, "wait_timed_out", "{}", error.message);
    // An event after the timeout changes nothing.
    env.ax
        .publish_event("order.paid", &json!({"order_id": 9}), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
    let w_id = view["steps"][0]["task_id"].as_str().unwrap().to_string();
    assert_eq!(env.record(&w_id).await.state, TaskState::Dead);
    assert_eq!(endings(&env.ax, &w_id).await, 1);
    assert!(calls.lock().unwrap().is_empty(), "b never ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_published_while_no_server_runs_end_every_wait_once() {
    let TwoServers {
        env,
        url,
        mut servers,
        calls,
        worker: _worker,
    } = TwoServers::start().await;
    let def = FlowDef::new("pay_all")
        .step(StepDef::wait_for_event(
            "w",
            "q",
            paid(Duration::from_secs(120), OnTimeout::Fail, None),
        ))
        .step(step("b", "echo").needs(["w"]));
    env.ax.put_flow(&def).await.unwrap();
    let runs: Vec<String> = futures::future::join_all(
        (0..6).map(|i| env.ax.run_flow("pay_all", json!({ "order": i }))),
    )
    .await
    .into_iter()
    .map(Result::unwrap)
    .collect();
    for run in &runs {
        waiting(&env.ax, run, "w", "event").await;
    }
    // Half the events while the servers run; then every server dies, the rest come
    // (stored by the broker alone), and new servers start.
    for i in 0..3 {
        env.ax
            .publish_event(
                "order.paid",
                &json!({"order_id": i}),
                Some(&format!("e{i}")),
            )
            .await
            .unwrap();
    }
    for s in &mut servers {
        s.kill9();
    }
    for i in 3..6 {
        env.ax
            .publish_event(
                "order.paid",
                &json!({"order_id": i}),
                Some(&format!("e{i}")),
            )
            .await
            .unwrap();
        // The same event published again (a producer's retry) is one event.
        env.ax
            .publish_event(
                "order.paid",
                &json!({"order_id": i}),
                Some(&format!("e{i}")),
            )
            .await
            .unwrap();
    }
    servers = vec![
        AxProc::spawn(&url, &SERVER_ARGS),
        AxProc::spawn(&url, &SERVER_ARGS),
    ];
    for (i, run) in runs.iter().enumerate() {
        let ended = finish(&env.ax, run).await;
        assert_eq!(
            ended.state,
            RunState::Succeeded,
            "{run}: {:?}",
            ended.reason
        );
        assert_eq!(echoed(&env.ax, run, 1).await, json!({"w": {"order_id": i}}));
        let view = env.ax.flow("get", &json!({ "run": run })).await.unwrap();
        let w_id = view["steps"][0]["task_id"].as_str().unwrap();
        assert_eq!(
            endings(&env.ax, w_id).await,
            1,
            "{run}: the wait ended once"
        );
    }
    let calls = calls.lock().unwrap();
    assert_eq!(calls.len(), 6, "one b a run: {calls:?}");
    assert!(
        calls.values().all(|n| *n == 1),
        "a task ran twice: {calls:?}"
    );
    drop(servers);
}

/// An event stored before its wait's timeout ends the wait, however late the matcher gets
/// to it: the timeout waits for the matcher to let the wait go. Here the first server's
/// matcher never starts (its scheduler runs the timeouts), and a server that has one
/// comes 2 s after the timeout. Red before the timeout waited: that wait timed out (the R3
/// fault campaign met it with the matcher's leader stalled on the broker, the event stored
/// 8.4 s before the timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stored_in_time_ends_its_wait_however_late_the_matcher_comes() {
    let faults = ax_core::faults::Faults::armed();
    faults.fail_service_starts("event-matcher", 1000);
    let env = Env::start(Env::server().faults(faults)).await;
    let calls = Calls::default();
    let (_stop, _w) = env.spawn_worker(flow_worker(calls.clone()));
    let timeout = Duration::from_millis(1500);
    let def = FlowDef::new("pay_late")
        .step(StepDef::wait_for_event(
            "w",
            "q",
            paid(timeout, OnTimeout::Fail, None),
        ))
        .step(step("b", "echo").needs(["w"]));
    env.ax.put_flow(&def).await.unwrap();
    let paid_run = env
        .ax
        .run_flow("pay_late", json!({"order": 1}))
        .await
        .unwrap();
    let unpaid_run = env
        .ax
        .run_flow("pay_late", json!({"order": 2}))
        .await
        .unwrap();
    waiting(&env.ax, &paid_run, "w", "event").await;
    waiting(&env.ax, &unpaid_run, "w", "event").await;
    env.ax
        .publish_event("order.paid", &json!({"order_id": 1}), None)
        .await
        .unwrap();
    tokio::time::sleep(timeout + Duration::from_secs(2)).await;
    let view = env
        .ax
        .flow("get", &json!({ "run": paid_run }))
        .await
        .unwrap();
    let w_id = view["steps"][0]["task_id"].as_str().unwrap().to_string();
    assert!(
        !env.record(&w_id).await.state.is_terminal(),
        "timed out with its event stored and no matcher to read it"
    );
    let _matcher = AxProc::spawn(&env.nats.url(), &SERVER_ARGS);
    let ended = finish(&env.ax, &paid_run).await;
    assert_eq!(ended.state, RunState::Succeeded, "{:?}", ended.reason);
    assert_eq!(
        echoed(&env.ax, &paid_run, 1).await,
        json!({"w": {"order_id": 1}})
    );
    assert_eq!(endings(&env.ax, &w_id).await, 1);
    // The wait no event met times out by its policy once the matcher let it go.
    let ended = finish(&env.ax, &unpaid_run).await;
    assert_eq!(ended.state, RunState::Failed, "{:?}", ended.reason);
    let (_, steps) = env.ax.flow_run(&unpaid_run).await.unwrap().unwrap();
    let error = steps[0].error.as_ref().expect("its error");
    assert_eq!(error.class, "wait_timed_out", "{}", error.message);
    assert_eq!(
        calls.lock().unwrap().len(),
        1,
        "b ran for the paid run only"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_waits_and_bad_events_are_refused_by_field() {
    let env = Env::start(Env::server()).await;
    let flow = |wait: Value| {
        json!({"name": "bad", "steps": [
            {"name": "a", "task": {"name": "seed", "queue": "q"}},
            {"name": "w", "needs": ["a"], "wait_for_event": wait}]})
    };
    for (wait, field) in [
        (
            json!({"event": "bad name"}),
            "steps[1].wait_for_event.event",
        ),
        (json!({"event": ""}), "steps[1].wait_for_event.event"),
        (json!({"event": "a..b"}), "steps[1].wait_for_event.event"),
        (
            json!({"event": "paid", "match": {"a..b": 1}}),
            "steps[1].wait_for_event.match",
        ),
        (
            json!({"event": "paid", "timeout_ms": 0}),
            "steps[1].wait_for_event.timeout_ms",
        ),
        (
            json!({"event": "paid", "lookback_ms": 3_600_001u64}),
            "steps[1].wait_for_event.lookback_ms",
        ),
    ] {
        let e = env.ax.flow("put", &flow(wait.clone())).await.unwrap_err();
        let ax_sdk::ClientError::Refused(e) = e else {
            panic!("{wait}: {e}")
        };
        assert_eq!(e.field.as_deref(), Some(field), "{wait}: {}", e.message);
    }
    let both = json!({"name": "bad", "steps": [{"name": "w", "sleep": {"for_ms": 5, "queue": "q"},
        "wait_for_event": {"event": "paid", "queue": "q"}}]});
    let e = env.ax.flow("put", &both).await.unwrap_err();
    assert_eq!(e.kind(), ax_sdk::ErrorKind::Invalid, "{e}");
    // A match naming what the step's input lacks fails the step when it starts.
    let def = json!({"name": "nomatch", "steps": [{"name": "w", "wait_for_event":
        {"event": "paid", "queue": "q", "match": {"id": "$input.missing"}}}]});
    env.ax.flow("put", &def).await.unwrap();
    let run = env.ax.run_flow("nomatch", json!({})).await.unwrap();
    assert_eq!(finish(&env.ax, &run).await.state, RunState::Failed);
    let (_, steps) = env.ax.flow_run(&run).await.unwrap().unwrap();
    assert_eq!(steps[0].error.as_ref().unwrap().class, "bad_match");
    // Publishing: a bad name and a payload over 512 KiB are refused before the broker.
    let e = env
        .ax
        .publish_event("no spaces", &json!({}), None)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ax_sdk::ErrorKind::Invalid, "{e}");
    let huge = json!({"blob": "x".repeat(600 * 1024)});
    let e = env.ax.publish_event("paid", &huge, None).await.unwrap_err();
    let ax_sdk::ClientError::Refused(e) = e else {
        panic!("{e}")
    };
    assert_eq!(e.code, ax_core::protocol::ErrorCode::PayloadTooLarge);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_runs_wait_leaves_the_waits_at_once() {
    let env = Env::start(Env::server()).await;
    let def = FlowDef::new("abandoned").step(StepDef::wait_for_event(
        "w",
        "q",
        paid(Duration::from_secs(3600), OnTimeout::Fail, None),
    ));
    env.ax.put_flow(&def).await.unwrap();
    let run = env
        .ax
        .run_flow("abandoned", json!({"order": 1}))
        .await
        .unwrap();
    let w = waiting(&env.ax, &run, "w", "event").await;
    let w_id = w["task_id"].as_str().unwrap().to_string();
    let waits = env.js.get_key_value("AX_WAITS").await.unwrap();
    assert!(waits.get(&w_id).await.unwrap().is_some(), "registered");
    env.ax.flow("cancel", &json!({ "run": run })).await.unwrap();
    assert_eq!(finish(&env.ax, &run).await.state, RunState::Cancelled);
    assert_eq!(env.record(&w_id).await.state, TaskState::Cancelled);
    // Not kept until an hour (and a minute) from now: removed with the cancel.
    crate::support::eventually(
        Duration::from_secs(10),
        "the registration's removal",
        || async { waits.get(&w_id).await.unwrap().is_none().then_some(()) },
    )
    .await;
    // An event for it now ends nothing.
    env.ax
        .publish_event("order.paid", &json!({"order_id": 1}), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(env.record(&w_id).await.state, TaskState::Cancelled);
}
