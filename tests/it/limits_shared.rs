//! A limit shared by several queues (`queues`): one rate bucket and one set of slots for
//! the tasks of all of them — one partner API called from two queues. Starts and running
//! handlers are counted from the `ax worker` processes' journals.

use crate::limits::{all_done, max_in_window, max_overlap, runs, spawn_worker};
use crate::support::Env;
use ax_sdk::client::ClientError;
use ax_sdk::TaskSpec;
use serde_json::{json, Value};
use std::time::Duration;

async fn submit(env: &Env, queue: &str, name: &str, n: usize, sleep_ms: u64) -> Vec<String> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let spec = TaskSpec::new(name).json(&json!({ "sleep_ms": sleep_ms }));
        ids.push(env.ax.submit(queue, spec).await.unwrap().id);
    }
    ids
}

async fn get_named(env: &Env, queue: &str, name: &str) -> Value {
    let which = json!({"queue": queue, "name": name});
    env.ax.limits("get", &which).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_shared_by_two_queues_holds_for_their_tasks_together() {
    let env = Env::start(Env::server().queues(["q", "a", "b"])).await;
    for def in [
        json!({"name": "partner", "queues": ["a", "b"], "task": "t", "rate": 10.0, "burst": 2}),
        json!({"name": "pool", "queues": ["a", "b"], "task": "capped", "concurrency": 2}),
    ] {
        let stored = env.ax.limits("put", &def).await.unwrap();
        assert_eq!(stored["queue"], "a", "the first queue named: {stored}");
    }
    // Workers started after the definitions load them before they claim.
    let dir = tempfile::tempdir().unwrap();
    let journals: Vec<_> = ["a", "b"]
        .map(|q| dir.path().join(format!("{q}.jsonl")))
        .into();
    let _workers: Vec<_> = ["a", "b"]
        .iter()
        .zip(&journals)
        .map(|(q, j)| spawn_worker(&env.nats.url(), q, j, 8, crate::procs::free_port(), &[]))
        .collect();
    let mut limited = submit(&env, "a", "t", 30, 5).await;
    limited.extend(submit(&env, "b", "t", 30, 5).await);
    let mut capped = submit(&env, "a", "capped", 8, 200).await;
    capped.extend(submit(&env, "b", "capped", 8, 200).await);
    all_done(&env, &limited, Duration::from_secs(60)).await;
    all_done(&env, &capped, Duration::from_secs(60)).await;
    let runs = runs(&journals);
    let starts: Vec<u64> = limited
        .iter()
        .filter_map(|id| runs.get(id).map(|r| r.0))
        .collect();
    assert_eq!(starts.len(), 60);
    let most = max_in_window(starts.clone(), 1000);
    assert!(
        most <= 12,
        "{most} starts of both queues in one second (one bucket: rate 10 + burst 2)"
    );
    let span = starts.iter().max().unwrap() - starts.iter().min().unwrap();
    assert!(
        span >= 5_000,
        "60 at 10/s after a burst of 2 take ≥ 5.8 s, not {span} ms"
    );
    let both = max_overlap(capped.iter().filter_map(|id| runs.get(id).copied()));
    assert_eq!(
        both, 2,
        "at most 2 running across both queues, and the cap is reached"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_limit_is_stored_on_each_queue_and_changed_or_deleted_as_one() {
    let env = Env::start(Env::server().queues(["q", "a", "b", "c"])).await;
    let get = |queue: &'static str| {
        let ax = env.ax.clone();
        async move {
            ax.limits("get", &json!({"queue": queue, "name": "partner"}))
                .await
        }
    };
    let put = |def: Value| {
        let ax = env.ax.clone();
        async move { ax.limits("put", &def).await }
    };
    put(json!({"name": "partner", "queues": ["a", "b", "c"], "rate": 5.0}))
        .await
        .unwrap();
    for q in ["a", "b", "c"] {
        let copy = get(q).await.unwrap();
        assert_eq!(
            (copy["queue"].as_str(), &copy["queues"]),
            (Some(q), &json!(["a", "b", "c"]))
        );
    }
    // Narrowed to two queues: the third queue's copy goes.
    put(json!({"name": "partner", "queue": "b", "queues": ["a", "b"], "rate": 7.0}))
        .await
        .unwrap();
    assert_eq!(get("a").await.unwrap()["rate"], 7.0);
    assert!(
        matches!(get("c").await, Err(ClientError::Refused(e)) if e.code.as_str() == "not_found")
    );
    // A queue's own limit of that name is not taken over.
    put(json!({"name": "own", "queue": "c", "rate": 1.0}))
        .await
        .unwrap();
    let clash = put(json!({"name": "own", "queues": ["a", "c"], "rate": 1.0})).await;
    assert!(
        matches!(&clash, Err(ClientError::Refused(e)) if e.code.as_str() == "conflict"),
        "{clash:?}"
    );
    assert!(
        matches!(get("a").await, Ok(v) if v["name"] == "partner"),
        "nothing else stored"
    );
    let bad = put(json!({"name": "x", "queue": "a", "queues": ["b", "c"], "rate": 1.0})).await;
    assert!(
        matches!(&bad, Err(ClientError::Refused(e)) if e.field.as_deref() == Some("queues")),
        "{bad:?}"
    );
    // The CLI: `--shared-with`, and the table says so.
    let set = crate::limits::ax_cli(
        &env,
        &[
            "limits",
            "set",
            "cli",
            "--queue",
            "a",
            "--shared-with",
            "c",
            "--rate",
            "2",
        ],
    )
    .await;
    assert!(set.status.success(), "{set:?}");
    assert_eq!(
        get_named(&env, "c", "cli").await["queues"],
        json!(["a", "c"])
    );
    let table = crate::limits::ax_cli(&env, &["limits", "list", "--queue", "c"]).await;
    assert!(
        String::from_utf8_lossy(&table.stdout).contains("c (shared: a,c)"),
        "{table:?}"
    );
    // Deleted from one queue: gone from every queue it spans.
    let deleted = env
        .ax
        .limits("delete", &json!({"queue": "b", "name": "partner"}))
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], true);
    for q in ["a", "b"] {
        assert!(
            get(q).await.is_err(),
            "queue {q} keeps the deleted shared limit"
        );
    }
}
