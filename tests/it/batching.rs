//! Batching (docs/PROTOCOL.md §2, "Batching"): the items of one batch key become tasks
//! whose payloads are their lists, at most `size` long, in the order stored, due when full
//! or `timeout` after their first item; racing items lose none and hold none twice; a batch
//! survives a killed server and one aborted between a timed-out batch's two writes.

use crate::procs::{wait_ready, AxProc};
use crate::support::{eventually, Env};
use ax_core::protocol::ErrorCode;
use ax_core::time::now_ms;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, ClientError, TaskSpec, TaskState};
use ax_testkit::LocalNats;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Attempt starts: (task id, the list's `n`s, start ms).
type Runs = Arc<Mutex<Vec<(String, Vec<u64>, u64)>>>;

fn recording_worker(runs: Runs) -> Worker {
    Worker::builder("q")
        .concurrency(16)
        .handler(move |task: Task| {
            let runs = runs.clone();
            async move {
                let list = task.json::<Vec<Value>>()?;
                let ns = list.iter().map(|v| v["n"].as_u64().unwrap()).collect();
                runs.lock().unwrap().push((task.id, ns, now_ms()));
                Ok(())
            }
        })
        .build()
        .unwrap()
}

fn item(key: &str, size: usize, timeout_ms: u64, n: u64) -> TaskSpec {
    TaskSpec::new("invoice").json(&json!({ "n": n })).batch(
        key,
        size,
        Duration::from_millis(timeout_ms),
    )
}

fn by_id(runs: &Runs) -> HashMap<String, Vec<(Vec<u64>, u64)>> {
    let mut out: HashMap<String, Vec<(Vec<u64>, u64)>> = HashMap::new();
    for (id, ns, at) in runs.lock().unwrap().iter() {
        out.entry(id.clone()).or_default().push((ns.clone(), *at));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_run_as_full_lists_in_order_and_the_rest_after_the_timeout() {
    let env = Env::start(Env::server()).await;
    let runs: Runs = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(runs.clone()));
    let mut answered = Vec::new(); // (id, n, sent)
    for n in 0..25 {
        let sent = now_ms();
        let a = env
            .ax
            .submit("q", item("orders", 10, 1500, n))
            .await
            .unwrap();
        assert_eq!(a.state, TaskState::Scheduled);
        answered.push((a.id, n, sent));
    }
    let mut ids: Vec<String> = answered.iter().map(|a| a.0.clone()).collect();
    ids.dedup();
    assert_eq!(ids.len(), 3, "25 items of size 10: three batches {ids:?}");
    // The last batch waits for its timeout, found by its id meanwhile.
    let (rec, _) = env
        .ax
        .task(&ids[2])
        .await
        .unwrap()
        .expect("a waiting batch");
    assert_eq!(rec.state, TaskState::Scheduled);
    for id in &ids {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
    }
    let ran = by_id(&runs);
    let want: [Vec<u64>; 3] = [(0..10).collect(), (10..20).collect(), (20..25).collect()];
    for (id, want) in ids.iter().zip(want) {
        assert_eq!(ran[id].len(), 1, "batch {id} ran once: {ran:?}");
        assert_eq!(ran[id][0].0, want, "batch {id}: its items in order");
    }
    let first_of_last = answered[20].2;
    let started = ran[&ids[2]][0].1;
    assert!(
        started >= first_of_last + 1500,
        "the partial batch started {} ms after its first item",
        started as i64 - first_of_last as i64
    );
    assert!(
        ran[&ids[0]][0].1 < first_of_last + 1500,
        "a full batch does not wait for its timeout"
    );
    eventually(Duration::from_secs(5), "AX_DELAYED emptied", || async {
        (env.stream_len("AX_DELAYED").await == 0).then_some(())
    })
    .await;
    stop.cancel();
    handle.await.unwrap();
}

/// Producers racing on two keys and the dispatcher's timeouts: every answered item is in
/// exactly one list, the list of the id it was answered, and each batch runs once. An
/// append that did not expect the batch's sequence loses items; a close that did not
/// expect it runs a list without the items answered after it was read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_items_lose_none_and_hold_none_twice() {
    let env = Env::start(Env::server()).await;
    let runs: Runs = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(runs.clone()));
    let answered: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let mut producers = Vec::new();
    for p in 0..8u64 {
        let (ax, answered) = (env.ax.clone(), answered.clone());
        producers.push(tokio::spawn(async move {
            for i in 0..40u64 {
                let n = i * 8 + p;
                let key = format!("k{}", p % 2);
                let a = ax.submit("q", item(&key, 16, 40, n)).await.unwrap();
                answered.lock().unwrap().push((a.id, n));
                tokio::time::sleep(Duration::from_millis(3 * ((i + p) % 5))).await;
            }
        }));
    }
    for p in producers {
        p.await.unwrap();
    }
    let answered = answered.lock().unwrap().clone();
    let mut want: HashMap<String, Vec<u64>> = HashMap::new();
    for (id, n) in &answered {
        want.entry(id.clone()).or_default().push(*n);
    }
    for id in want.keys() {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(15))
            .await;
    }
    let ran = by_id(&runs);
    let mut wrong = Vec::new();
    for (id, items) in &want {
        let Some(starts) = ran.get(id) else {
            wrong.push(format!("{id}: never ran"));
            continue;
        };
        if starts.len() != 1 {
            wrong.push(format!("{id}: ran {} times", starts.len()));
        }
        let (mut got, mut items) = (starts[0].0.clone(), items.clone());
        assert!(got.len() <= 16, "{id}: {} items", got.len());
        got.sort_unstable();
        items.sort_unstable();
        if got != items {
            wrong.push(format!("{id}: ran {got:?}, answered {items:?}"));
        }
    }
    assert_eq!(
        ran.len(),
        want.len(),
        "no batch ran that no item was answered"
    );
    assert!(wrong.is_empty(), "{wrong:?}");
    println!(
        "racing batches: {} items, {} batches, {} runs",
        answered.len(),
        want.len(),
        runs.lock().unwrap().len()
    );
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_is_refused_with_a_due_time_a_debounce_bytes_or_another_name() {
    let env = Env::start(Env::server()).await;
    let field = |r: Result<_, ClientError>| match r {
        Err(ClientError::Refused(e)) => (e.code, e.field),
        other => panic!("accepted: {other:?}"),
    };
    let cases = [
        (item("k", 5, 100, 1).delay(Duration::from_secs(1)), "batch"),
        (
            item("k", 5, 100, 1).debounce("k", Duration::from_secs(1)),
            "batch",
        ),
        (
            TaskSpec::new("invoice")
                .bytes(&[1, 2])
                .batch("k", 5, Duration::from_secs(1)),
            "batch",
        ),
        (item("a b", 5, 100, 1), "batch.key"),
        (item("k", 0, 100, 1), "batch.size"),
        (item("k", 10_001, 100, 1), "batch.size"),
        (item("k", 5, 0, 1), "batch.timeout_ms"),
    ];
    for (s, want) in cases {
        let (code, f) = field(env.ax.submit("q", s).await);
        assert_eq!((code, f.as_deref()), (ErrorCode::InvalidField, Some(want)));
    }
    let batch = env.ax.submit_many("q", [item("k", 5, 100, 1)]).await;
    let err = batch[0].as_ref().expect_err("a batch request's task");
    assert_eq!(err.field.as_deref(), Some("batch"));
    assert_eq!(env.stream_len("AX_DELAYED").await, 0, "nothing stored");
    // One key batches one task name.
    let first = env.ax.submit("q", item("k", 5, 60_000, 1)).await.unwrap();
    let other =
        TaskSpec::new("receipt")
            .json(&json!({"n": 2}))
            .batch("k", 5, Duration::from_secs(60));
    let (code, f) = field(env.ax.submit("q", other).await);
    assert_eq!(
        (code, f.as_deref()),
        (ErrorCode::InvalidField, Some("batch.key"))
    );
    let (rec, _) = env.ax.task(&first.id).await.unwrap().unwrap();
    assert_eq!(rec.name, "invoice");
}

/// A server killed with a batch open, then one aborted between a timed-out batch's closed
/// copy and the delete of the batch (`AX_TEST_ABORT_AFTER_CLOSE`): the next server
/// dispatches the copy once with every item answered. The batch's timeout (15 s) leaves
/// the aborting server time to answer before it closes the batch: with 6 s, a loaded CI
/// machine had it close the batch and abort before it answered its first submit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_survives_a_killed_server_and_one_aborted_mid_close() {
    let nats = LocalNats::start().unwrap();
    let url = nats.url();
    let args = ["server", "--queue", "q"];
    let mut server = AxProc::spawn(&url, &args);
    let client = async_nats::connect(&url).await.unwrap();
    wait_ready(&client).await;
    let ax = Client::new(client.clone());
    let mut ids = Vec::new();
    for n in 1..=3 {
        ids.push(
            ax.submit("q", item("b-1", 100, 15_000, n))
                .await
                .unwrap()
                .id,
        );
    }
    server.kill9();
    let mut aborting = AxProc::spawn_env(&url, &args, &[("AX_TEST_ABORT_AFTER_CLOSE", "1")]);
    wait_ready(&client).await;
    for n in 4..=5 {
        ids.push(
            ax.submit("q", item("b-1", 100, 15_000, n))
                .await
                .unwrap()
                .id,
        );
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "one batch across the kill: {ids:?}");
    let aborted = aborting.exited_within(Duration::from_secs(40)).await;
    assert!(
        aborted.is_some_and(|s| !s.success()),
        "the hook never fired"
    );
    let runs: Runs = Arc::default();
    let stop = CancellationToken::new();
    let worker = tokio::spawn(recording_worker(runs.clone()).run(client.clone(), stop.clone()));
    let _next = AxProc::spawn(&url, &args);
    let js = async_nats::jetstream::new(client.clone());
    eventually(Duration::from_secs(20), "the batch ran", || async {
        (!runs.lock().unwrap().is_empty()).then_some(())
    })
    .await;
    eventually(Duration::from_secs(10), "AX_DELAYED emptied", || async {
        let mut s = js.get_stream("AX_DELAYED").await.ok()?;
        (s.info().await.ok()?.state.messages == 0).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 1, "ran once: {runs:?}");
    assert_eq!(runs[0].0, ids[0]);
    assert_eq!(runs[0].1, vec![1, 2, 3, 4, 5]);
    stop.cancel();
    worker.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_adds_items_to_a_batch_key() {
    let env = Env::start(Env::server()).await;
    let runs: Runs = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(runs.clone()));
    let mut ids = Vec::new();
    for n in ["1", "2"] {
        let json = format!("{{\"n\": {n}}}");
        let out = crate::limits::ax_cli(
            &env,
            &[
                "submit",
                "--queue",
                "q",
                "--name",
                "invoice",
                "--json",
                &json,
                "--batch-key",
                "cli",
                "--batch-size",
                "2",
                "--batch-timeout",
                "1m",
            ],
        )
        .await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        ids.push(v["id"].as_str().unwrap().to_string());
    }
    assert_eq!(ids[0], ids[1], "one batch");
    env.wait_state(&ids[0], TaskState::Succeeded, Duration::from_secs(10))
        .await;
    assert_eq!(
        by_id(&runs)[&ids[0]][0].0,
        vec![1, 2],
        "full at two: ran at once"
    );
    let alone = crate::limits::ax_cli(&env, &["submit", "--name", "x", "--batch-key", "k"]).await;
    assert!(
        !alone.status.success(),
        "--batch-key needs a size and a timeout"
    );
    stop.cancel();
    handle.await.unwrap();
}

/// `ax.limit.windows` and `ax limits status` show what waits: a batch filling (its items)
/// and a debounce window, by key and task id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_batches_and_windows_are_listed() {
    let env = Env::start(Env::server().queues(["q", "other"])).await;
    let batch = env
        .ax
        .submit("q", item("orders", 10, 60_000, 1))
        .await
        .unwrap();
    env.ax
        .submit("q", item("orders", 10, 60_000, 2))
        .await
        .unwrap();
    let deb = TaskSpec::new("sync")
        .json(&json!({"n": 1}))
        .debounce("user:1", Duration::from_secs(60));
    let window = env.ax.submit("other", deb).await.unwrap();
    let all = env.ax.limits("windows", &json!({})).await.unwrap();
    let listed = all["windows"].as_array().unwrap();
    assert_eq!(listed.len(), 2, "{all}");
    let b = listed.iter().find(|w| w["kind"] == "batch").unwrap();
    assert_eq!(
        (&b["queue"], &b["key"], &b["id"], &b["items"], &b["closed"]),
        (
            &json!("q"),
            &json!("orders"),
            &json!(batch.id),
            &json!(2),
            &json!(false)
        )
    );
    let d = listed.iter().find(|w| w["kind"] == "debounce").unwrap();
    assert_eq!(
        (&d["queue"], &d["id"]),
        (&json!("other"), &json!(window.id))
    );
    assert!(d["due_ms"].as_u64().unwrap() > now_ms() + 50_000);
    let only_q = env
        .ax
        .limits("windows", &json!({"queue": "q"}))
        .await
        .unwrap();
    assert_eq!(only_q["windows"].as_array().unwrap().len(), 1);
    let bad = env.ax.limits("windows", &json!({"queue": "a b"})).await;
    assert!(matches!(bad, Err(ClientError::Refused(e)) if e.field.as_deref() == Some("queue")));
    let out = crate::limits::ax_cli(&env, &["limits", "status"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("orders") && text.contains(&batch.id) && text.contains("user:1"),
        "{text}"
    );
}
