//! Submission: run and ack, bad input, idempotency, backpressure.

use crate::support::Env;
use ax::protocol::ErrorCode;
use ax::worker::{Task, Worker};
use ax::{ClientError, Priority, TaskSpec, TaskState};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn refused(result: Result<ax::protocol::SubmitAccepted, ClientError>) -> ax::protocol::WireError {
    match result {
        Err(ClientError::Refused(e)) => e,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submitted_tasks_run_once_and_are_acked() {
    let env = Env::start(Env::server()).await;
    let mut ids = Vec::new();
    for i in 0..20 {
        let spec = TaskSpec::new("square").json(&serde_json::json!({ "n": i }));
        let accepted = env.ax.submit("q", spec).await.unwrap();
        assert_eq!(accepted.state, TaskState::Pending);
        assert!(!accepted.duplicate);
        ids.push(accepted.id);
    }
    let seen: Arc<Mutex<Vec<(String, u64, u32)>>> = Arc::default();
    let worker = Worker::builder("q")
        .concurrency(4)
        .handler({
            let seen = seen.clone();
            move |task: Task| {
                let seen = seen.clone();
                async move {
                    let v: serde_json::Value = task.json()?;
                    seen.lock()
                        .unwrap()
                        .push((task.id, v["n"].as_u64().unwrap(), task.attempt));
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    for id in &ids {
        let rec = env
            .wait_state(id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        assert_eq!(rec.attempt, 1);
        assert!(rec.finished_at_ms.is_some());
    }
    stop.cancel();
    handle.await.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 20, "each task ran exactly once");
    let mut ns: Vec<u64> = seen.iter().map(|s| s.1).collect();
    ns.sort();
    assert_eq!(ns, (0..20).collect::<Vec<u64>>(), "payloads arrive intact");
    // Work-queue retention: acked tasks leave the ready streams.
    for p in Priority::ALL {
        assert_eq!(env.stream_len(&p.ready_stream()).await, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_typed_errors_and_stores_nothing() {
    let env = Env::start(Env::server().limits(ax::task::Limits {
        max_payload_bytes: 1024,
        ..Default::default()
    }))
    .await;
    let cases: Vec<(&str, Vec<u8>, ErrorCode, Option<&str>)> = vec![
        ("q", b"{not json".to_vec(), ErrorCode::BadRequest, None),
        ("q", b"\xff\xfe".to_vec(), ErrorCode::BadRequest, None),
        (
            "q",
            br#"{"name":"a","max_attempt":3}"#.to_vec(),
            ErrorCode::BadRequest,
            None,
        ),
        (
            "q",
            br#"{"name":"a","delay_ms":"soon"}"#.to_vec(),
            ErrorCode::BadRequest,
            None,
        ),
        (
            "q",
            br#"{"name":"a","delay_ms":1e400}"#.to_vec(),
            ErrorCode::BadRequest,
            None,
        ),
        (
            "q",
            br#"{"name":"a","delay_ms":-5}"#.to_vec(),
            ErrorCode::InvalidField,
            Some("delay_ms"),
        ),
        (
            "q",
            br#"{"name":"a","delay_ms":99999999999999}"#.to_vec(),
            ErrorCode::InvalidField,
            Some("delay_ms"),
        ),
        (
            "q",
            br#"{"name":"a","priority":"urgent"}"#.to_vec(),
            ErrorCode::InvalidField,
            Some("priority"),
        ),
        (
            "q",
            br#"{"name":""}"#.to_vec(),
            ErrorCode::InvalidField,
            Some("name"),
        ),
        (
            "q",
            format!(r#"{{"name":"a","payload":"{}"}}"#, "x".repeat(2000)).into_bytes(),
            ErrorCode::PayloadTooLarge,
            None,
        ),
        (
            "nope",
            br#"{"name":"a"}"#.to_vec(),
            ErrorCode::UnknownQueue,
            None,
        ),
    ];
    for (queue, body, code, field) in cases {
        let err = refused(env.ax.submit_raw(queue, body.clone()).await);
        assert_eq!(err.code, code, "body {:?}", String::from_utf8_lossy(&body));
        assert_eq!(err.field.as_deref(), field);
    }
    let tasks = ax::names::TASKS_BUCKET;
    assert_eq!(
        env.stream_len(&format!("KV_{tasks}")).await,
        0,
        "no record stored"
    );
    for p in Priority::ALL {
        assert_eq!(
            env.stream_len(&p.ready_stream()).await,
            0,
            "no message stored"
        );
    }
    // The server keeps serving good requests.
    let ok = env.ax.submit("q", TaskSpec::new("fine")).await.unwrap();
    assert_eq!(env.record(&ok.id).await.state, TaskState::Pending);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_key_returns_the_first_task() {
    let env = Env::start(Env::server().queues(["q", "r"])).await;
    let spec = || TaskSpec::new("invoice").idempotency_key("user-7:2026-11-29");
    let first = env.ax.submit("q", spec()).await.unwrap();
    let second = env
        .ax
        .submit("q", spec().priority(Priority::High))
        .await
        .unwrap();
    assert_eq!(second.id, first.id);
    assert!(second.duplicate && !first.duplicate);
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, 1);
    assert_eq!(
        env.stream_len("AX_READY_HIGH").await,
        0,
        "the duplicate created nothing"
    );
    // Keys are per queue.
    let other = env.ax.submit("r", spec()).await.unwrap();
    assert_ne!(other.id, first.id);
    // Still a duplicate after the task ran.
    let worker = Worker::builder("q")
        .handler(|_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    env.wait_state(&first.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    let third = env.ax.submit("q", spec()).await.unwrap();
    assert_eq!(
        (third.id.as_str(), third.duplicate, third.state),
        (first.id.as_str(), true, TaskState::Succeeded)
    );
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_priority_answers_busy_and_drops_nothing() {
    let env = Env::start(Env::server().capacity([2, 3, 3])).await;
    let high = || TaskSpec::new("t").priority(Priority::High);
    let a = env.ax.submit("q", high()).await.unwrap();
    let b = env.ax.submit("q", high()).await.unwrap();
    let err = refused(env.ax.submit("q", high()).await);
    assert_eq!(err.code, ErrorCode::Busy);
    assert!(err.code.is_retryable());
    assert_eq!(env.stream_len("AX_READY_HIGH").await, 2);
    // Other priorities have their own capacity.
    env.ax
        .submit("q", TaskSpec::new("t").priority(Priority::Low))
        .await
        .unwrap();
    // Once a worker drains the bucket, submits are accepted again.
    let worker = Worker::builder("q")
        .handler(|_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    for id in [&a.id, &b.id] {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
    }
    let c = env.ax.submit("q", high()).await.unwrap();
    env.wait_state(&c.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    stop.cancel();
    handle.await.unwrap();
}
