//! Rate limits whose excess is dropped (`"excess": "drop"`): a submit over the rate is
//! refused (`rate_limited`, with `retry_after_ms`) and stores nothing, single or in a batch
//! request; workers run the accepted ones without taking the token again; a restarted
//! server knows the limit before it admits.

use crate::procs::{wait_ready, AxProc};
use crate::support::{eventually, Env};
use ax_core::protocol::ErrorCode;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, ClientError, TaskSpec, TaskState};
use ax_testkit::LocalNats;
use serde_json::json;
use std::time::{Duration, Instant};

/// One token per 5 s, three at once, for tasks named `call` of `q`; the excess refused.
fn dropping() -> serde_json::Value {
    json!({"name": "api", "queue": "q", "task": "call", "rate": 0.2, "burst": 3, "excess": "drop"})
}

/// The `rate_limited` refusal's wait, or a panic naming what came instead.
fn limited(r: Result<ax_sdk::SubmitAccepted, ClientError>) -> u64 {
    match r {
        Err(ClientError::Refused(w)) if w.code == ErrorCode::RateLimited => {
            w.retry_after_ms.expect("a rate_limited refusal says when")
        }
        other => panic!("not a rate_limited refusal: {other:?}"),
    }
}

/// Submits `call` until one is refused (the server has read the limit and its burst is
/// spent): that refusal.
async fn until_refused(ax: &Client) -> ClientError {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Err(e) = ax.submit("q", TaskSpec::new("call")).await {
            return e;
        }
        assert!(Instant::now() < deadline, "no submit refused in 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropping_limit_refuses_the_excess_and_workers_take_no_token_again() {
    let env = Env::start(Env::server()).await;
    env.ax.limits("put", &dropping()).await.unwrap();
    limited(Err(until_refused(&env.ax).await));
    // The burst is spent: every submit of `call` in the next seconds is refused, single
    // or in a batch request, and says how long until the next token (≤ one interval).
    for _ in 0..10 {
        let wait = limited(env.ax.submit("q", TaskSpec::new("call")).await);
        assert!((1..=5_000).contains(&wait), "retry after {wait} ms");
    }
    let specs = vec![TaskSpec::new("call"); 5];
    for answer in env.ax.submit_many("q", specs).await {
        limited(answer.map_err(ClientError::Refused));
    }
    // Another task name is not under the limit.
    let other = env.ax.submit("q", TaskSpec::new("other")).await.unwrap();
    let stored = env.stream_len("AX_READY_NORMAL").await;

    // Workers run what was accepted without taking the limit's token again: the bucket
    // is as the submits left it.
    let js = async_nats::jetstream::new(env.client.clone());
    let state = js.get_key_value("AX_LIMIT_STATE").await.unwrap();
    let before = state
        .get("q.api.all")
        .await
        .unwrap()
        .expect("the submits' bucket");
    let worker = Worker::builder("q")
        .handler(|_: Task| async { Ok(()) })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    env.wait_state(&other.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    eventually(
        Duration::from_secs(10),
        "every accepted task ran",
        || async { (env.stream_len("AX_READY_NORMAL").await == 0).then_some(()) },
    )
    .await;
    stop.cancel();
    handle.await.unwrap();
    let after = state.get("q.api.all").await.unwrap();
    assert_eq!(
        Some(before),
        after,
        "a worker took a token ({stored} tasks ran)"
    );
}

/// A server started after the limit was put reads it before it admits a submit: the bucket
/// (in `AX_LIMIT_STATE`) and the definition outlive the server that used them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_still_drops_the_excess() {
    let nats = LocalNats::start().unwrap();
    let url = nats.url();
    let args = ["server", "--queue", "q"];
    let mut first = AxProc::spawn(&url, &args);
    let client = async_nats::connect(&url).await.unwrap();
    wait_ready(&client).await;
    let ax = Client::new(client.clone());
    let slow = json!({"name": "api", "queue": "q", "task": "call", "rate": 0.001, "burst": 2,
                      "excess": "drop"});
    ax.limits("put", &slow).await.unwrap();
    limited(Err(until_refused(&ax).await));
    first.kill9();
    let _next = AxProc::spawn(&url, &args);
    wait_ready(&client).await;
    for _ in 0..10 {
        let wait = limited(ax.submit("q", TaskSpec::new("call")).await);
        assert!(
            wait > 900_000,
            "retry after {wait} ms (one token per 1,000 s)"
        );
    }
}

/// `ax limits set --excess drop` stores a dropping limit and the table says so; a dropping
/// limit without a rate, or adaptive, is refused naming `excess`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_and_the_api_set_and_check_a_dropping_limit() {
    let env = Env::start(Env::server()).await;
    let args = [
        "limits", "set", "quota", "--queue", "q", "--rate", "10", "--excess", "drop",
    ];
    let out = crate::limits::ax_cli(&env, &args).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = crate::limits::ax_cli(&env, &["limits", "list", "--queue", "q"]).await;
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("10.0 (excess dropped)"), "{table}");
    let stored = env
        .ax
        .limits("get", &json!({"queue": "q", "name": "quota"}))
        .await
        .unwrap();
    assert_eq!(stored["excess"], "drop");
    for bad in [
        json!({"name": "x", "queue": "q", "concurrency": 2, "excess": "drop"}),
        json!({"name": "x", "queue": "q", "rate": 10.0, "excess": "drop", "adaptive": {"min": 1.0}}),
    ] {
        match env.ax.limits("put", &bad).await {
            Err(ClientError::Refused(w)) => assert_eq!(w.field.as_deref(), Some("excess"), "{w:?}"),
            other => panic!("{bad}: {other:?}"),
        }
    }
}
