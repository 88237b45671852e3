//! Direct submits (`Client::direct_submits`, docs/PROTOCOL.md §2 "Direct submits"): the
//! client publishes the task's message itself. It must store what a server stores, be
//! refused as a server refuses, and need no ax server on an immediate task's path.

use crate::submit::refused;
use crate::support::{counting_worker, eventually, Env};
use ax_core::protocol::ErrorCode;
use ax_core::task::header;
use ax_sdk::{Client, Priority, TaskSpec, TaskState};
use std::time::Duration;

fn direct(env: &Env) -> Client {
    Client::new(env.client.clone()).direct_submits(true)
}

/// With the ax server stopped, a direct submit is accepted, findable (`task`) while it
/// waits, and run once by a worker; a delayed one waits for a server's dispatcher and then
/// runs once. Attempts are counted, not records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_submit_needs_no_ax_server_and_runs_once() {
    let mut env = Env::start(Env::server()).await;
    env.stop_server().await;
    let ax = direct(&env);
    let now = ax.submit("q", TaskSpec::new("t").json(&1)).await.unwrap();
    assert_eq!(now.state, TaskState::Pending);
    assert!(!now.duplicate);
    let later = ax
        .submit("q", TaskSpec::new("t").delay(Duration::from_millis(500)))
        .await
        .unwrap();
    assert_eq!(later.state, TaskState::Scheduled);
    // Findable at once, with no server: from its message.
    let (rec, _) = ax
        .task(&now.id)
        .await
        .unwrap()
        .expect("found while pending");
    assert_eq!(rec.state, TaskState::Pending);
    let (rec, _) = ax
        .task(&later.id)
        .await
        .unwrap()
        .expect("found while scheduled");
    assert_eq!(rec.state, TaskState::Scheduled);
    let (worker, runs) = counting_worker(4);
    let (stop, handle) = env.spawn_worker(worker);
    env.wait_state(&now.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    // The delayed task is the server's to dispatch.
    env.start_server(Env::server()).await;
    env.wait_state(&later.id, TaskState::Succeeded, Duration::from_secs(15))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.get(&now.id), Some(&1), "{runs:?}");
    assert_eq!(runs.get(&later.id), Some(&1), "{runs:?}");
    stop.cancel();
    handle.await.unwrap();
}

/// The message a direct submit stores is the one a server stores for the same task: the
/// same stream and subject, every header but the task's id and creation time equal, the
/// same payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_submit_stores_the_message_a_server_stores() {
    let env = Env::start(Env::server()).await;
    let spec = || {
        TaskSpec::new("mail")
            .json(&serde_json::json!({"to": "a@example.com"}))
            .priority(Priority::High)
            .max_attempts(7)
            .timeout(Duration::from_secs(9))
            .backoff(Duration::from_secs(2), Duration::from_secs(60), 0.5)
            .retry_on(["smtp"])
            .limit_key("tenant-1")
            .business_id("order-1")
            .traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    };
    let by_server = env.ax.submit("q", spec()).await.unwrap();
    let by_client = direct(&env).submit("q", spec()).await.unwrap();
    let stream = env.js.get_stream("AX_READY_HIGH").await.unwrap();
    let (a, b) = (
        stream.get_raw_message(1).await.unwrap(),
        stream.get_raw_message(2).await.unwrap(),
    );
    assert_eq!(a.subject, b.subject);
    assert_eq!(a.payload, b.payload);
    let (ha, hb) = (a.headers, b.headers);
    assert_eq!(ha.get(header::ID).unwrap().as_str(), by_server.id);
    assert_eq!(hb.get(header::ID).unwrap().as_str(), by_client.id);
    assert_eq!(
        hb.get("Nats-Msg-Id").map(|v| v.as_str()),
        Some(by_client.id.as_str()),
        "de-duplicated by its id"
    );
    let names = |h: &async_nats::HeaderMap| {
        let mut n: Vec<String> = h.iter().map(|(k, _)| k.to_string()).collect();
        n.sort();
        n
    };
    assert_eq!(names(&ha), names(&hb));
    for (name, _) in ha.iter() {
        let name = name.to_string();
        if ["Nats-Msg-Id", header::ID, header::CREATED_AT_MS].contains(&name.as_str()) {
            continue;
        }
        assert_eq!(
            ha.get_all(name.as_str())
                .map(|v| v.as_str())
                .collect::<Vec<_>>(),
            hb.get_all(name.as_str())
                .map(|v| v.as_str())
                .collect::<Vec<_>>(),
            "header {name}"
        );
    }
    assert_eq!(hb.get(header::UNRECORDED).map(|v| v.as_str()), Some("1"));
}

/// Refused as a server refuses, with the same codes, and nothing stored: an undeclared
/// queue, a bad name, a payload over the bound, a full priority.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_submits_are_refused_as_a_servers_are() {
    let env = Env::start(Env::server().capacity([2, 3, 3])).await;
    let ax = direct(&env);
    let err = refused(ax.submit("nowhere", TaskSpec::new("t")).await);
    assert_eq!(err.code, ErrorCode::UnknownQueue, "{err:?}");
    let err = refused(ax.submit("q", TaskSpec::new("bad name")).await);
    assert_eq!(err.code, ErrorCode::InvalidField, "{err:?}");
    let big = vec![b'x'; 300 * 1024];
    let err = refused(ax.submit("q", TaskSpec::new("t").bytes(&big)).await);
    assert_eq!(err.code, ErrorCode::PayloadTooLarge, "{err:?}");
    let err = refused(ax.submit("q", TaskSpec::new("t").max_attempts(0)).await);
    assert_eq!(err.code, ErrorCode::InvalidField, "{err:?}");
    // Numbers no JSON request could carry reach the client's validation as they are.
    let s = Duration::from_secs(1);
    for jitter in [f64::NAN, f64::INFINITY, -0.5, 1.5] {
        let err = refused(
            ax.submit("q", TaskSpec::new("t").backoff(s, s, jitter))
                .await,
        );
        assert_eq!(
            err.code,
            ErrorCode::InvalidField,
            "jitter {jitter}: {err:?}"
        );
    }
    let err = refused(
        ax.submit("q", TaskSpec::new("t").delay(Duration::MAX))
            .await,
    );
    assert_eq!(err.code, ErrorCode::InvalidField, "{err:?}");
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, 0);
    assert_eq!(env.stream_len("AX_DELAYED").await, 0);
    let high = || TaskSpec::new("t").priority(Priority::High);
    ax.submit("q", high()).await.unwrap();
    ax.submit("q", high()).await.unwrap();
    let err = refused(ax.submit("q", high()).await);
    assert_eq!(err.code, ErrorCode::Busy, "{err:?}");
    assert_eq!(env.stream_len("AX_READY_HIGH").await, 2);
}

/// Many at once: one answer per task in order, grouped into atomic batches, each run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_direct_submits_are_answered_in_order_and_each_runs_once() {
    let env = Env::start(Env::server()).await;
    let ax = direct(&env);
    let specs: Vec<TaskSpec> = (0..500).map(|i| TaskSpec::new("t").json(&i)).collect();
    let answers = ax.submit_many("q", specs).await;
    assert_eq!(answers.len(), 500);
    let ids: Vec<String> = answers.into_iter().map(|a| a.unwrap().id).collect();
    // Published as a server publishes them: the submits of one moment as atomic batches
    // (the group commit starts grouped and measures single publishes later).
    let stream = env.js.get_stream("AX_READY_NORMAL").await.unwrap();
    let mut batched = 0;
    for seq in 1..=500 {
        let msg = stream.get_raw_message(seq).await.unwrap();
        batched += usize::from(msg.headers.get("Nats-Batch-Id").is_some());
    }
    assert!(batched > 0, "no direct submit went in an atomic batch");
    let (worker, runs) = counting_worker(64);
    let (stop, handle) = env.spawn_worker(worker);
    eventually(Duration::from_secs(20), "every task ran", || async {
        (runs.lock().unwrap().len() == 500).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let runs = runs.lock().unwrap().clone();
    assert!(ids.iter().all(|id| runs.get(id) == Some(&1)), "{runs:?}");
    stop.cancel();
    handle.await.unwrap();
}
