//! Idempotency keys of immediate tasks: the message is stored first, the key second, and
//! no record until the claim. A message under another id that a submit left behind when
//! it lost the key never runs; a message whose submit died before its key gets the key
//! from its claim, so a later submit with the key finds it.

use crate::support::{counting_worker, eventually, Env, Runs};
use ax_core::task::header;
use ax_sdk::TaskSpec;
use std::time::Duration;

/// Stores a copy of the last ready message of queue `q` under id `id`, with headers
/// changed by `edit`: a message as a submit would have stored it.
async fn copy_ready(env: &Env, id: &str, edit: impl FnOnce(&mut async_nats::HeaderMap)) {
    let ready = env.js.get_stream("AX_READY_NORMAL").await.unwrap();
    let last = ready
        .direct_get_last_for_subject("ax.ready.q.normal")
        .await
        .unwrap();
    let mut headers = last.headers.clone();
    headers.insert(header::ID, id);
    headers.insert("Nats-Msg-Id", id);
    edit(&mut headers);
    env.js
        .publish_with_headers("ax.ready.q.normal", headers, last.payload.clone())
        .await
        .unwrap()
        .await
        .unwrap();
}

fn total(runs: &Runs) -> u32 {
    runs.lock().unwrap().values().sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_left_by_a_submit_that_lost_its_key_never_runs() {
    let env = Env::start(Env::server()).await;
    let first = env
        .ax
        .submit("q", TaskSpec::new("t").idempotency_key("order-1"))
        .await
        .unwrap();
    assert!(
        env.ax.record(&first.id).await.unwrap().is_none(),
        "a keyed immediate task has no record before its claim"
    );
    // A second submit of the key that lost the race for it, and whose delete of its own
    // message was lost: its message, under its own id, carrying the same key.
    let stray = ax_core::names::new_task_id("q");
    copy_ready(&env, &stray, |_| {}).await;
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, 2);

    let (worker, runs) = counting_worker(16);
    let (stop, handle) = env.spawn_worker(worker);
    eventually(Duration::from_secs(10), "both messages handled", || async {
        (env.stream_len("AX_READY_NORMAL").await == 0).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.cancel();
    handle.await.unwrap();
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.get(&first.id), Some(&1), "{runs:?}");
    assert_eq!(runs.get(&stray), None, "the copy ran: {runs:?}");
    assert!(
        env.ax.record(&stray).await.unwrap().is_none(),
        "the copy was retired without a record"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_stored_before_its_key_gets_the_key_from_its_claim() {
    let env = Env::start(Env::server()).await;
    // A submit that stored its message and died before its key: made by hand from a
    // plain task's message, carrying a key nobody wrote.
    let plain = env.ax.submit("q", TaskSpec::new("t")).await.unwrap();
    let orphan = ax_core::names::new_task_id("q");
    copy_ready(&env, &orphan, |h| {
        h.insert(header::IDEMPOTENCY_KEY, "order-2");
    })
    .await;
    let (worker, runs) = counting_worker(16);
    let (stop, handle) = env.spawn_worker(worker);
    eventually(Duration::from_secs(10), "both tasks run", || async {
        (total(&runs) >= 2).then_some(())
    })
    .await;
    // The producer retries with the key: the task that ran is the one it gets.
    let again = env
        .ax
        .submit("q", TaskSpec::new("t").idempotency_key("order-2"))
        .await
        .unwrap();
    assert_eq!(
        (again.id.as_str(), again.duplicate),
        (orphan.as_str(), true)
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    handle.await.unwrap();
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 2, "a second task ran for the key: {runs:?}");
    assert_eq!((runs[&plain.id], runs[&orphan]), (1, 1), "{runs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_submits_of_one_key_run_one_task() {
    let env = Env::start(Env::server()).await;
    let (worker, runs) = counting_worker(16);
    let (stop, handle) = env.spawn_worker(worker);
    for round in 0..5 {
        let key = format!("race-{round}");
        let answers = futures::future::join_all((0..16).map(|_| {
            env.ax
                .submit("q", TaskSpec::new("t").idempotency_key(key.clone()))
        }))
        .await;
        let ids: std::collections::HashSet<String> =
            answers.into_iter().map(|a| a.unwrap().id).collect();
        assert_eq!(ids.len(), 1, "one task for key {key}: {ids:?}");
    }
    eventually(Duration::from_secs(10), "the five tasks run", || async {
        (total(&runs) >= 5 && env.stream_len("AX_READY_NORMAL").await == 0).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    handle.await.unwrap();
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 5, "{runs:?}");
    assert!(runs.values().all(|&n| n == 1), "{runs:?}");
}
