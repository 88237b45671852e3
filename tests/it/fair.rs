//! Fair shares between tenants (`TaskSpec::fair_key`, `ax.limit.fair_put`): tasks with a
//! fair key wait in `AX_FAIR` and are released to their ready subject in weighted fair
//! order, so a small tenant is not stuck behind a big one's backlog; a release survives a
//! server aborted between its publish and its purge.

use crate::procs::{wait_ready, AxProc};
use crate::support::{eventually, Env};
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, TaskSpec, TaskState};
use ax_testkit::LocalNats;
use serde_json::json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Attempt starts in order: (task id, tenant).
type Starts = Arc<Mutex<Vec<(String, String)>>>;

fn recording_worker(queue: &str, starts: Starts, concurrency: usize, pause: Duration) -> Worker {
    Worker::builder(queue)
        .concurrency(concurrency)
        .handler(move |task: Task| {
            let starts = starts.clone();
            async move {
                starts
                    .lock()
                    .unwrap()
                    .push((task.id.clone(), task.name.clone()));
                tokio::time::sleep(pause).await;
                Ok(())
            }
        })
        .build()
        .unwrap()
}

async fn submit_tenant(ax: &Client, queue: &str, tenant: &str, n: usize) -> Vec<String> {
    let specs: Vec<TaskSpec> = (0..n)
        .map(|_| TaskSpec::new(tenant).fair_key(tenant))
        .collect();
    let mut ids = Vec::new();
    for chunk in specs.chunks(500) {
        for a in ax.submit_many(queue, chunk.to_vec()).await {
            ids.push(a.unwrap().id);
        }
    }
    ids
}

/// Backlogs of 3,000 (`big`, weight 1), 10 (`small`, weight 1) and 1,500 (`mid`, weight
/// 2), all stored before a worker starts: the small tenant's tasks start among the first
/// few dozen, and while big and mid both have tasks held they start 1 : 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_tenant_passes_a_big_backlog_and_weights_share_the_rest() {
    let env = Env::start(Env::server().queues(["q"])).await;
    let def = env
        .ax
        .limits(
            "fair_put",
            &json!({"queue": "q", "weights": {"mid": 2}, "depth": 16}),
        )
        .await
        .unwrap();
    assert_eq!(def["weights"]["mid"], 2);
    let big = submit_tenant(&env.ax, "q", "big", 3000).await;
    let small = submit_tenant(&env.ax, "q", "small", 10).await;
    let mid = submit_tenant(&env.ax, "q", "mid", 1500).await;
    // Held, not ready: a held task is found by its id, `pending` with no record.
    let (rec, revision) = env.ax.task(&small[0]).await.unwrap().unwrap();
    assert_eq!((rec.state, revision), (TaskState::Pending, 0));
    // The queue's consumer exists (made at the server's start): `depth` tasks are released
    // to the ready subject, the rest held.
    eventually(Duration::from_secs(10), "16 ready, 4,494 held", || async {
        let ready = env.stream_len("AX_READY_NORMAL").await;
        let held = env.stream_len("AX_FAIR").await;
        (ready == 16 && held == 4494).then_some(())
    })
    .await;
    // The dispatcher reports its tenants.
    eventually(
        Duration::from_secs(10),
        "a report of three tenants",
        || async {
            let got = env
                .ax
                .limits("fair_get", &json!({"queue": "q"}))
                .await
                .ok()?;
            (got["status"]["tenants"].as_array()?.len() == 3).then_some(())
        },
    )
    .await;

    let starts: Starts = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(
        "q",
        starts.clone(),
        8,
        Duration::from_millis(1),
    ));
    for id in big.iter().chain(&mid).chain(&small) {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(120))
            .await;
    }
    stop.cancel();
    handle.await.unwrap();
    let starts = starts.lock().unwrap().clone();
    // Every task ran once.
    let mut attempts: HashMap<&str, usize> = HashMap::new();
    for (id, _) in &starts {
        *attempts.entry(id.as_str()).or_default() += 1;
    }
    assert_eq!(attempts.len(), 4510);
    assert!(attempts.values().all(|n| *n == 1), "a task ran twice");
    let last_small = starts.iter().rposition(|(_, t)| t == "small").unwrap();
    println!("the last small task started {}th of 4,510", last_small + 1);
    assert!(
        last_small < 100,
        "the small tenant waited behind the backlog: started {last_small}th"
    );
    // While mid had tasks held: mid's first 1,200 starts against big's in the same span.
    let span_end = starts
        .iter()
        .enumerate()
        .filter(|(_, (_, t))| t == "mid")
        .nth(1199)
        .unwrap()
        .0;
    // From mid's first start: the 16 released before mid submitted anything were big's.
    let span_start = starts.iter().position(|(_, t)| t == "mid").unwrap();
    let count = |tenant: &str| {
        starts[span_start..span_end]
            .iter()
            .filter(|(_, t)| t == tenant)
            .count()
    };
    let ratio = count("mid") as f64 / count("big") as f64;
    println!(
        "starts {span_start}..{span_end}: mid {} big {} (ratio {ratio:.3})",
        count("mid"),
        count("big")
    );
    assert!(
        (1.9..=2.1).contains(&ratio),
        "weights 2 : 1 within 5 %: {ratio:.3}"
    );
    assert_eq!(env.stream_len("AX_FAIR").await, 0, "released tasks purged");
}

/// Weights changed while a backlog is held apply to the next releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_change_live() {
    let env = Env::start(Env::server().queues(["q"])).await;
    env.ax
        .limits("fair_put", &json!({"queue": "q", "depth": 8}))
        .await
        .unwrap();
    // Enough of both that neither runs out before the last start counted (5 ms tasks,
    // four at a time: about 700 starts a second).
    submit_tenant(&env.ax, "q", "a", 2000).await;
    submit_tenant(&env.ax, "q", "b", 2000).await;
    let starts: Starts = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(
        "q",
        starts.clone(),
        4,
        Duration::from_millis(5),
    ));
    eventually(Duration::from_secs(30), "300 started", || async {
        (starts.lock().unwrap().len() >= 300).then_some(())
    })
    .await;
    env.ax
        .limits(
            "fair_put",
            &json!({"queue": "q", "depth": 8, "weights": {"b": 4}}),
        )
        .await
        .unwrap();
    // Read within a second; then 600 more starts.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let from = starts.lock().unwrap().len();
    eventually(Duration::from_secs(30), "600 more started", || async {
        (starts.lock().unwrap().len() >= from + 600).then_some(())
    })
    .await;
    stop.cancel();
    handle.await.unwrap();
    let starts = starts.lock().unwrap().clone();
    let early = &starts[..300];
    let late = &starts[from..from + 600];
    let share =
        |s: &[(String, String)]| s.iter().filter(|(_, t)| t == "b").count() as f64 / s.len() as f64;
    println!(
        "b's share: {:.3} at weight 1, {:.3} at weight 4",
        share(early),
        share(late)
    );
    assert!((0.45..=0.55).contains(&share(early)), "1 : 1 at first");
    assert!(
        (0.76..=0.84).contains(&share(late)),
        "4 : 1 after the change"
    );
}

/// A server aborted between a release's ready publish and its purge
/// (`AX_TEST_ABORT_AFTER_RELEASE`): the next one releases the unpurged tasks again, and
/// every task runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_survives_a_server_aborted_before_its_purge() {
    let nats = LocalNats::start().unwrap();
    let url = nats.url();
    let args = ["server", "--queue", "q"];
    let mut aborting = AxProc::spawn_env(&url, &args, &[("AX_TEST_ABORT_AFTER_RELEASE", "1")]);
    let client = async_nats::connect(&url).await.unwrap();
    wait_ready(&client).await;
    let ax = Client::new(client.clone());
    let ids = submit_tenant(&ax, "q", "t", 200).await;
    let starts: Starts = Arc::default();
    let stop = CancellationToken::new();
    let worker = tokio::spawn(
        recording_worker("q", starts.clone(), 4, Duration::from_millis(1))
            .run(client.clone(), stop.clone()),
    );
    let aborted = aborting.exited_within(Duration::from_secs(20)).await;
    assert!(
        aborted.is_some_and(|s| !s.success()),
        "the hook never fired"
    );
    let js = async_nats::jetstream::new(client.clone());
    let held = crate::support::stream_len(&js, "AX_FAIR").await;
    assert_eq!(held, 200, "the aborted release purged nothing");
    let _next = AxProc::spawn(&url, &args);
    eventually(Duration::from_secs(30), "every task ran", || async {
        let started: std::collections::HashSet<String> = starts
            .lock()
            .unwrap()
            .iter()
            .map(|(id, _)| id.clone())
            .collect();
        ids.iter().all(|id| started.contains(id)).then_some(())
    })
    .await;
    eventually(Duration::from_secs(10), "AX_FAIR emptied", || async {
        let mut s = js.get_stream("AX_FAIR").await.ok()?;
        (s.info().await.ok()?.state.messages == 0).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    worker.await.unwrap().unwrap();
    let starts = starts.lock().unwrap().clone();
    assert_eq!(starts.len(), 200, "each task ran once");
}

/// The CLI: `ax submit --fair-key` holds a task for its tenant, `ax limits fair` changes
/// the weights and shows the tenants (`--output json` for the figures), a bad weight is
/// refused naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_submits_with_a_fair_key_and_sets_weights() {
    let env = Env::start(Env::server().queues(["q"])).await;
    let cli = |args: Vec<&'static str>| {
        let env = &env;
        async move {
            let out = crate::limits::ax_cli(env, &args).await;
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            (
                out.status.success(),
                text,
                String::from_utf8_lossy(&out.stderr).to_string(),
            )
        }
    };
    let (ok, _, err) = cli(vec![
        "limits", "fair", "q", "--weight", "acme=3", "--depth", "1",
    ])
    .await;
    assert!(ok, "{err}");
    let submit = |fair_key: &'static str| {
        cli(vec![
            "submit",
            "--queue",
            "q",
            "--name",
            "r",
            "--fair-key",
            fair_key,
        ])
    };
    for _ in 0..3 {
        let (ok, _, err) = submit("acme").await;
        assert!(ok, "{err}");
    }
    // Depth 1 and no worker: one ready, two held for acme at weight 3.
    eventually(
        Duration::from_secs(10),
        "acme: 2 held, weight 3",
        || async {
            let (_, out, _) = cli(vec!["--output", "json", "limits", "fair", "q"]).await;
            let v: serde_json::Value = serde_json::from_str(&out).ok()?;
            let t = &v["status"]["tenants"][0];
            (t["key"] == "acme" && t["held"] == 2 && t["weight"] == 3).then_some(())
        },
    )
    .await;
    let (ok, table, _) = cli(vec!["limits", "fair", "q"]).await;
    assert!(
        ok && table.contains("acme") && table.contains("acme=3"),
        "{table}"
    );
    let (ok, _, err) = cli(vec!["limits", "fair", "q", "--weight", "acme=0"]).await;
    assert!(!ok && err.contains("weights"), "{err}");
    let (ok, _, err) = submit("a b").await;
    assert!(!ok && err.contains("fair_key"), "{err}");
}

/// With no memory for held messages (`max_held_bytes(0)`), the dispatcher keeps only
/// their sequences and reads each back when it releases it: every task still runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_tasks_beyond_the_memory_budget_are_read_back_when_released() {
    let env = Env::start(Env::server().queues(["q"]).max_held_bytes(0)).await;
    let mut ids = submit_tenant(&env.ax, "q", "a", 300).await;
    ids.extend(submit_tenant(&env.ax, "q", "b", 300).await);
    let starts: Starts = Arc::default();
    let worker = recording_worker("q", starts.clone(), 8, Duration::from_millis(1));
    let (stop, handle) = env.spawn_worker(worker);
    for id in &ids {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(60))
            .await;
    }
    stop.cancel();
    handle.await.unwrap();
    let starts = starts.lock().unwrap().clone();
    assert_eq!(starts.len(), 600, "each task ran once");
    assert_eq!(env.stream_len("AX_FAIR").await, 0);
}

/// A release refused by a full ready subject (capacity 5, depth 64, no worker yet) is put
/// back; its body, moved into the refused publish, is read again from `AX_FAIR` at a later
/// round: once a worker drains the subject, every task runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_refused_by_a_full_ready_subject_is_put_back_and_read_again() {
    let env = Env::start(Env::server().queues(["q"]).capacity([5, 5, 5])).await;
    let ids = submit_tenant(&env.ax, "q", "a", 100).await;
    // The rounds keep asking for 59 more releases than the subject holds.
    eventually(Duration::from_secs(20), "5 released, 95 held", || async {
        let ready = env.stream_len("AX_READY_NORMAL").await;
        let held = env.stream_len("AX_FAIR").await;
        (ready == 5 && held == 95).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        env.stream_len("AX_READY_NORMAL").await,
        5,
        "the subject stayed full"
    );
    assert_eq!(
        env.stream_len("AX_FAIR").await,
        95,
        "refused releases were not purged"
    );
    let starts: Starts = Arc::default();
    let worker = recording_worker("q", starts.clone(), 2, Duration::from_millis(2));
    let (stop, handle) = env.spawn_worker(worker);
    for id in &ids {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(30))
            .await;
    }
    stop.cancel();
    handle.await.unwrap();
    let starts = starts.lock().unwrap().clone();
    assert_eq!(starts.len(), 100, "each task ran once");
    assert_eq!(env.stream_len("AX_FAIR").await, 0);
}
