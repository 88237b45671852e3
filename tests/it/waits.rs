//! Waiting for tasks and flow runs at a web service's scale: `Client::wait` and
//! `Client::wait_flow` hold no consumer, so thousands of waits at once work and none
//! leaves anything on the server (issue 38: a KV watch per wait left an ordered consumer
//! for ~30 s, and a thousand waits hit the consumer limit).

use crate::support::{counting_worker, Env};
use ax_core::names::TASKS_BUCKET;
use ax_sdk::{TaskSpec, TaskState};
use std::time::Duration;

/// Consumers on the task bucket's stream.
async fn task_consumers(env: &Env) -> usize {
    let mut stream = env
        .js
        .get_stream(format!("KV_{TASKS_BUCKET}"))
        .await
        .expect("stream");
    stream.info().await.expect("info").state.consumer_count
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_waits_at_once_all_return_and_leave_no_consumer() {
    let env = Env::start(Env::server()).await;
    let specs = (0..2_000).map(|i| TaskSpec::new("t").json(&i));
    let ids: Vec<String> = env
        .ax
        .submit_many("q", specs)
        .await
        .into_iter()
        .map(|a| a.expect("accepted").id)
        .collect();
    // The server's own feeds follow the bucket; the waits must add nothing to them.
    let servers = task_consumers(&env).await;
    // Five waits per task, every one started before any worker runs.
    let waits: Vec<_> = ids
        .iter()
        .cycle()
        .take(10_000)
        .map(|id| {
            let (ax, id) = (env.ax.clone(), id.clone());
            tokio::spawn(async move { ax.wait(&id).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        waits.iter().all(|w| !w.is_finished()),
        "a wait returned before its task ran"
    );
    assert_eq!(
        task_consumers(&env).await,
        servers,
        "waits hold no consumer"
    );
    let (worker, runs) = counting_worker(64);
    let (stop, handle) = env.spawn_worker(worker);
    let started = std::time::Instant::now();
    for w in waits {
        let done = tokio::time::timeout(Duration::from_secs(120), w)
            .await
            .expect("every wait returns")
            .unwrap()
            .expect("wait succeeds");
        assert_eq!(done.record.state, TaskState::Succeeded);
    }
    println!(
        "10,000 waits on 2,000 tasks returned {:?} after the worker started",
        started.elapsed()
    );
    assert_eq!(runs.lock().unwrap().len(), 2_000);
    stop.cancel();
    handle.await.unwrap();

    // One after another on finished tasks: each returns at once and leaves nothing.
    for id in ids.iter().take(1_100) {
        let done = tokio::time::timeout(Duration::from_secs(5), env.ax.wait(id))
            .await
            .expect("a finished task's wait returns at once")
            .unwrap();
        assert_eq!(done.record.state, TaskState::Succeeded);
    }
    assert_eq!(
        task_consumers(&env).await,
        servers,
        "no wait left a consumer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_wait_holds_no_consumer() {
    let env = Env::start(Env::server()).await;
    let flow = serde_json::json!({"name": "one", "steps": [
        {"name": "a", "task": {"name": "t", "queue": "q"}}]});
    env.ax.flow("put", &flow).await.unwrap();
    let run = env
        .ax
        .flow("run", &serde_json::json!({"flow": "one", "input": 1}))
        .await
        .unwrap()["run"]
        .as_str()
        .unwrap()
        .to_string();
    let mut runs_stream = env.js.get_stream("KV_AX_FLOW_RUNS").await.unwrap();
    let servers = runs_stream.info().await.unwrap().state.consumer_count;
    let waits: Vec<_> = (0..200)
        .map(|_| {
            let (ax, run) = (env.ax.clone(), run.clone());
            tokio::spawn(async move { ax.wait_flow(&run).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        runs_stream.info().await.unwrap().state.consumer_count,
        servers,
        "flow waits hold no consumer"
    );
    let (worker, _) = counting_worker(4);
    let (stop, handle) = env.spawn_worker(worker);
    for w in waits {
        let ended = tokio::time::timeout(Duration::from_secs(30), w)
            .await
            .expect("the flow wait returns")
            .unwrap()
            .unwrap();
        assert_eq!(ended.state, ax_sdk::flow::RunState::Succeeded);
    }
    stop.cancel();
    handle.await.unwrap();
}

/// A `succeeded` record of task `id` of queue `q`, as a worker would write it: forged.
fn succeeded_record(id: &str) -> bytes::Bytes {
    let rec = serde_json::json!({"id": id, "queue": "q", "name": "t", "priority": "normal",
        "state": "succeeded", "attempt": 1, "max_attempts": 5,
        "created_at_ms": 0, "updated_at_ms": 0});
    serde_json::to_vec(&rec).unwrap().into()
}

/// `Client::wait` of task `id`, in a task of its own.
fn wait_in_background(
    env: &Env,
    id: &str,
) -> tokio::task::JoinHandle<Result<ax_sdk::client::Finished, ax_sdk::ClientError>> {
    let (ax, id) = (env.ax.clone(), id.to_string());
    tokio::spawn(async move { ax.wait(&id).await })
}

/// A core subscriber also sees publishes the stream refuses: a `succeeded` record whose
/// compare-and-set lost reaches the wait's subscription, and the wait must not take it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_ends_only_on_a_stored_final_record() {
    use futures::StreamExt;
    let env = Env::start(Env::server()).await;
    let id = env
        .ax
        .submit("q", TaskSpec::new("t").json(&1))
        .await
        .unwrap()
        .id;
    let waiting = wait_in_background(&env, &id);
    let subject = env.store().await.subject(&id);
    let mut seen = env.client.subscribe(subject.clone()).await.unwrap();
    env.client.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Expected-Last-Subject-Sequence", "999999");
    let refused = env
        .js
        .publish_with_headers(subject, headers, succeeded_record(&id))
        .await
        .unwrap()
        .await;
    assert!(refused.is_err(), "the stream refuses the forged write");
    let msg = tokio::time::timeout(Duration::from_secs(5), seen.next())
        .await
        .expect("core subscribers see the refused publish")
        .unwrap();
    let seen_record: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
    assert_eq!(
        seen_record["state"], "succeeded",
        "the forged record itself"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !waiting.is_finished(),
        "the wait took a record the stream never stored"
    );
    let (worker, _) = counting_worker(2);
    let (stop, handle) = env.spawn_worker(worker);
    let done = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("the real end wakes the wait")
        .unwrap()
        .unwrap();
    assert_eq!(done.record.state, TaskState::Succeeded);
    assert!(done.revision > 0);
    stop.cancel();
    handle.await.unwrap();
}

/// A write the server routes before the wait's subscription exists but stores after the
/// wait's first read reaches neither: the first message of an atomic batch is routed to
/// core subscribers when it arrives and stored only when the batch's commit does (the
/// worker's group commit of task records). The wait reads again soon after its first
/// read; before it did, it found the end only at its 10 s idle read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_write_routed_before_the_wait_and_stored_after_its_read_is_found() {
    let env = Env::start(Env::server()).await;
    let mut ids = Vec::new();
    for i in 0..2 {
        let accepted = env.ax.submit("q", TaskSpec::new("t").json(&i)).await;
        ids.push(accepted.unwrap().id);
    }
    let store = env.store().await;
    let batch = format!("wait-race-{}", ids[0]);
    let mut first = async_nats::HeaderMap::new();
    first.insert("Nats-Batch-Id", batch.as_str());
    first.insert("Nats-Batch-Sequence", "1");
    env.client
        .publish_with_headers(store.subject(&ids[0]), first, succeeded_record(&ids[0]))
        .await
        .unwrap();
    env.client.flush().await.unwrap();
    let waiting = wait_in_background(&env, &ids[0]);
    // Its subscription and first read are done well within this.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "the wait took a write the stream had not stored"
    );
    let mut commit = async_nats::HeaderMap::new();
    commit.insert("Nats-Batch-Id", batch.as_str());
    commit.insert("Nats-Batch-Sequence", "2");
    commit.insert("Nats-Batch-Commit", "1");
    let ack = env
        .client
        .request_with_headers(store.subject(&ids[1]), commit, succeeded_record(&ids[1]))
        .await
        .unwrap();
    let ack: serde_json::Value = serde_json::from_slice(&ack.payload).unwrap();
    assert!(ack.get("error").is_none(), "the batch is stored: {ack}");
    let stored = std::time::Instant::now();
    let done = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the wait finds the stored end by reading again, not at its 10 s idle read")
        .unwrap()
        .unwrap();
    assert_eq!(done.record.state, TaskState::Succeeded);
    println!(
        "the wait returned {:?} after the batch was stored",
        stored.elapsed()
    );
}
