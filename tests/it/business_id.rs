//! The business id a producer attaches (`business_id`): in the task's message, record and
//! handler, and in every step task of a flow run started with one; refused when it could
//! not travel in a header, with nothing stored.

use crate::support::Env;
use ax_sdk::flow::{FlowStart, RunState};
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{ClientError, ErrorKind, Output, TaskSpec, TaskState};
use serde_json::json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A worker of `q` recording the business id each task's handler saw.
fn seeing_worker(seen: Arc<Mutex<HashMap<String, Option<String>>>>) -> Worker {
    Worker::builder("q")
        .concurrency(8)
        .handler(move |task: Task| {
            let seen = seen.clone();
            async move {
                seen.lock()
                    .unwrap()
                    .insert(task.id.clone(), task.business_id.clone());
                Ok(Output::none())
            }
        })
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_business_id_reaches_the_record_the_handler_and_every_step_of_a_flow() {
    let env = Env::start(Env::server()).await;
    let seen: Arc<Mutex<HashMap<String, Option<String>>>> = Arc::default();
    let (stop, handle) = env.spawn_worker(seeing_worker(seen.clone()));

    let one = TaskSpec::new("t").json(&1).business_id("order-42");
    let id = env.ax.submit("q", one).await.unwrap().id;
    let done = tokio::time::timeout(Duration::from_secs(15), env.ax.wait(&id))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.record.state, TaskState::Succeeded);
    assert_eq!(done.record.business_id.as_deref(), Some("order-42"));
    assert_eq!(seen.lock().unwrap()[&id].as_deref(), Some("order-42"));

    let flow = json!({"name": "order", "steps": [
        {"name": "a", "task": {"name": "t", "queue": "q"}},
        {"name": "b", "task": {"name": "t", "queue": "q"}, "needs": ["a"]}]});
    env.ax.flow("put", &flow).await.unwrap();
    let start = FlowStart {
        flow: "order".into(),
        input: json!(null),
        business_id: Some("order-43".into()),
        ..FlowStart::default()
    };
    let run = env.ax.start_flow(start).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(30), env.ax.wait_flow(&run))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ended.state, RunState::Succeeded);
    assert_eq!(ended.business_id.as_deref(), Some("order-43"));
    for step in ["a", "b"] {
        let task = ax_sdk::flow::model::step_task_id("q", &run, step, 0, 0);
        assert_eq!(
            env.record(&task).await.business_id.as_deref(),
            Some("order-43"),
            "step {step}'s task"
        );
        assert_eq!(seen.lock().unwrap()[&task].as_deref(), Some("order-43"));
    }
    // A whole re-run is a new run working for the same thing.
    let again = env
        .ax
        .flow("rerun", &json!({"run": run, "mode": "whole"}))
        .await
        .unwrap()["run"]
        .as_str()
        .unwrap()
        .to_string();
    let ended = tokio::time::timeout(Duration::from_secs(30), env.ax.wait_flow(&again))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ended.business_id.as_deref(), Some("order-43"));
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_business_id_that_cannot_travel_in_a_header_is_refused_and_nothing_stored() {
    let env = Env::start(Env::server()).await;
    let flow =
        json!({"name": "one", "steps": [{"name": "a", "task": {"name": "t", "queue": "q"}}]});
    env.ax.flow("put", &flow).await.unwrap();
    let before = env.stream_len("AX_READY_NORMAL").await;
    for bad in ["", "line\nbreak", " padded", &"x".repeat(257)] {
        let refused = env
            .ax
            .submit("q", TaskSpec::new("t").business_id(bad))
            .await
            .unwrap_err();
        let ClientError::Refused(e) = &refused else {
            panic!("{bad:?}: {refused}")
        };
        assert_eq!(e.kind(), ErrorKind::Invalid, "{bad:?}");
        assert_eq!(e.field.as_deref(), Some("business_id"), "{bad:?}");
        let start = FlowStart {
            flow: "one".into(),
            input: json!(null),
            business_id: Some(bad.to_string()),
            ..FlowStart::default()
        };
        let refused = env.ax.start_flow(start).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Invalid, "{bad:?}");
    }
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, before);
    let runs = env.ax.flow("list", &json!({})).await.unwrap();
    assert_eq!(runs.as_array().map(Vec::len), Some(0), "no run stored");
}
