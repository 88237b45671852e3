//! Batch items with idempotency keys (docs/PROTOCOL.md §2, "Batching"): a retried item is
//! held once, whether its batch is still open (its key is in the batch's message), closed
//! full by an item (its keys written between the batch's two writes) or closed at its
//! timeout by the dispatcher (its keys written before the close), and answers its
//! batch's id as a duplicate.

use crate::support::Env;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{TaskSpec, TaskState};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Attempt starts: (task id, the list's `n`s).
type Runs = Arc<Mutex<Vec<(String, Vec<u64>)>>>;

fn recording_worker(runs: Runs) -> Worker {
    Worker::builder("q")
        .concurrency(8)
        .handler(move |task: Task| {
            let runs = runs.clone();
            async move {
                let list = task.json::<Vec<Value>>()?;
                let ns = list.iter().map(|v| v["n"].as_u64().unwrap()).collect();
                runs.lock().unwrap().push((task.id, ns));
                Ok(())
            }
        })
        .build()
        .unwrap()
}

/// Item `n` of batch key `key` with idempotency key `i<n>`.
fn item(key: &str, size: usize, timeout_ms: u64, n: u64) -> TaskSpec {
    TaskSpec::new("invoice")
        .json(&json!({ "n": n }))
        .batch(key, size, Duration::from_millis(timeout_ms))
        .idempotency_key(format!("i{n}"))
}

/// Submits item `n` and answers (id, duplicate).
async fn send(env: &Env, key: &str, size: usize, timeout_ms: u64, n: u64) -> (String, bool) {
    let a = env
        .ax
        .submit("q", item(key, size, timeout_ms, n))
        .await
        .unwrap();
    (a.id, a.duplicate)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_item_is_held_once_whether_its_batch_is_open_or_closed() {
    let env = Env::start(Env::server()).await;
    // Batch A (size 4): items 1-3, item 2 sent again while A is open.
    let (a, dup) = send(&env, "full", 4, 60_000, 1).await;
    assert!(!dup);
    assert_eq!(send(&env, "full", 4, 60_000, 2).await, (a.clone(), false));
    assert_eq!(send(&env, "full", 4, 60_000, 3).await, (a.clone(), false));
    assert_eq!(
        send(&env, "full", 4, 60_000, 2).await,
        (a.clone(), true),
        "a retry while its batch is open answers it, a duplicate"
    );
    // Item 4 fills A; items 1 and 4 sent again after it closed; item 5 opens B.
    assert_eq!(send(&env, "full", 4, 60_000, 4).await, (a.clone(), false));
    assert_eq!(send(&env, "full", 4, 60_000, 1).await, (a.clone(), true));
    assert_eq!(send(&env, "full", 4, 60_000, 4).await, (a.clone(), true));
    let (b, dup) = send(&env, "full", 4, 1_000, 5).await;
    assert!(b != a && !dup, "the next item opens the next batch");
    // Two sends of item 6 at once: one batch holds it, the other answer is a duplicate.
    let (x, y) = tokio::join!(
        send(&env, "full", 4, 1_000, 6),
        send(&env, "full", 4, 1_000, 6)
    );
    assert_eq!((&x.0, &y.0), (&b, &b));
    assert!(x.1 != y.1, "one of the two is the duplicate: {x:?} {y:?}");
    // C (another key) times out: the dispatcher closes it, and its keys are found after.
    let (c, _) = send(&env, "timed", 10, 500, 7).await;
    assert_eq!(send(&env, "timed", 10, 500, 8).await, (c.clone(), false));
    let runs: Runs = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(runs.clone()));
    for id in [&a, &b, &c] {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(15))
            .await;
    }
    let again = env.ax.submit("q", item("timed", 10, 500, 7)).await.unwrap();
    assert_eq!((&again.id, again.duplicate), (&c, true));
    assert_eq!(again.state, TaskState::Succeeded, "the batch's state");
    assert_eq!(send(&env, "timed", 10, 500, 8).await, (c.clone(), true));
    assert_eq!(send(&env, "full", 4, 1_000, 5).await, (b.clone(), true));
    tokio::time::sleep(Duration::from_millis(1500)).await; // a batch opened by a retry would run
    let runs = runs.lock().unwrap().clone();
    let mut lists: HashMap<String, Vec<Vec<u64>>> = HashMap::new();
    for (id, ns) in runs {
        lists.entry(id).or_default().push(ns);
    }
    let want = HashMap::from([
        (a, vec![vec![1, 2, 3, 4]]),
        (b, vec![vec![5, 6]]),
        (c, vec![vec![7, 8]]),
    ]);
    assert_eq!(lists, want, "each item in one list, each batch run once");
    stop.cancel();
    handle.await.unwrap();
}

/// A server aborted between a full batch's items stored (open) and the write of their
/// keys (`AX_TEST_ABORT_BEFORE_BATCH_KEYS`): the item that filled it goes unanswered; its
/// retry on the next server finds its key in the open batch, the dispatcher writes the
/// keys as it closes the batch at its timeout, and a retry after that finds them there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_aborted_before_a_full_batchs_keys_loses_no_item_and_holds_none_twice() {
    use crate::procs::{wait_ready, AxProc};
    let nats = ax_testkit::LocalNats::start().unwrap();
    let url = nats.url();
    let args = ["server", "--queue", "q"];
    let env = [("AX_TEST_ABORT_BEFORE_BATCH_KEYS", "1")];
    let mut aborting = AxProc::spawn_env(&url, &args, &env);
    let client = async_nats::connect(&url).await.unwrap();
    wait_ready(&client).await;
    let ax = ax_sdk::Client::new(client.clone());
    let mut ids = Vec::new();
    for n in 1..=3 {
        ids.push(ax.submit("q", item("k", 4, 3_000, n)).await.unwrap().id);
    }
    let filled = ax.submit("q", item("k", 4, 3_000, 4)).await;
    assert!(
        filled.is_err(),
        "the item that filled it was answered: {filled:?}"
    );
    let aborted = aborting.exited_within(Duration::from_secs(10)).await;
    assert!(
        aborted.is_some_and(|s| !s.success()),
        "the hook never fired"
    );
    let _next = AxProc::spawn(&url, &args);
    wait_ready(&client).await;
    let again = ax.submit("q", item("k", 4, 3_000, 4)).await.unwrap();
    assert_eq!(
        (&again.id, again.duplicate),
        (&ids[0], true),
        "held in the open batch"
    );
    let runs: Runs = Arc::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let worker = tokio::spawn(recording_worker(runs.clone()).run(client.clone(), stop.clone()));
    crate::support::eventually(Duration::from_secs(20), "the batch ran", || async {
        (!runs.lock().unwrap().is_empty()).then_some(())
    })
    .await;
    for n in [1, 4] {
        let again = ax.submit("q", item("k", 4, 3_000, n)).await.unwrap();
        assert_eq!(
            (&again.id, again.duplicate),
            (&ids[0], true),
            "item {n} after the close"
        );
    }
    tokio::time::sleep(Duration::from_millis(4_000)).await; // a batch opened by a retry would run
    let runs = runs.lock().unwrap().clone();
    assert_eq!(
        runs,
        vec![(ids[0].clone(), vec![1, 2, 3, 4])],
        "one batch, run once"
    );
    stop.cancel();
    worker.await.unwrap().unwrap();
}

/// Items and their retries sent all at once, 30 times on keys of their own (size 4): the
/// retries meet their first sends in one round of the key's writer, or in the next, or
/// after the batch closed; each item is in one list once, and every answer of an item
/// (first send or retry) names that list's batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_retries_of_keyed_items_hold_each_once() {
    let env = Env::start(Env::server()).await;
    let runs: Runs = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(runs.clone()));
    let mut answers: HashMap<u64, Vec<String>> = HashMap::new();
    for round in 0..30u64 {
        let key = format!("race-{round}");
        let ns = [1, 2, 3, 4, 4, 1, 5, 5].map(|n| round * 10 + n);
        let sends = ns.map(|n| {
            let (ax, key) = (env.ax.clone(), key.clone());
            async move { (n, ax.submit("q", item(&key, 4, 300, n)).await.unwrap().id) }
        });
        for (n, id) in futures::future::join_all(sends).await {
            answers.entry(n).or_default().push(id);
        }
    }
    let ids: std::collections::HashSet<&String> = answers.values().flatten().collect();
    for id in &ids {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(20))
            .await;
    }
    let runs = runs.lock().unwrap().clone();
    let mut held: HashMap<u64, Vec<&String>> = HashMap::new();
    for (id, ns) in &runs {
        for n in ns {
            held.entry(*n).or_default().push(id);
        }
    }
    assert_eq!(runs.len(), ids.len(), "each batch ran once: {runs:?}");
    for (n, ids) in &answers {
        let lists = &held[n];
        assert_eq!(lists.len(), 1, "item {n} held once: {lists:?}");
        assert!(
            ids.iter().all(|id| id == lists[0]),
            "item {n}: answers {ids:?}, in {lists:?}"
        );
    }
    stop.cancel();
    handle.await.unwrap();
}
