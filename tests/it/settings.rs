//! Task settings stored apart from code (`ax.task.options_*`, `ax tasks options`,
//! `ax apply -f runtime.yaml`), applied live by a running worker, and the soft timeout.
//! Attempts are counted by the handlers themselves, per task id.

use crate::limits::ax_cli;
use crate::support::Env;
use crate::support::{eventually, within};
use ax_core::error::ErrorCode;
use ax_sdk::settings::TaskSettings;
use ax_sdk::worker::{Task, TaskError, TaskOptions, Worker};
use ax_sdk::{ClientError, TaskSpec, TaskState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

type Attempts = Arc<Mutex<HashMap<String, u32>>>;

/// Submits a `flaky` task (it always fails) and returns how many attempts it got before
/// it died.
async fn attempts_until_dead(env: &Env, attempts: &Attempts, spec: TaskSpec) -> u32 {
    let id = env.ax.submit("q", spec).await.unwrap().id;
    env.wait_state(&id, TaskState::Dead, Duration::from_secs(10))
        .await;
    attempts.lock().unwrap()[&id]
}

fn settings(max_attempts: u32) -> TaskSettings {
    TaskSettings {
        max_attempts: Some(max_attempts),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_settings_reach_the_next_attempt_of_a_running_worker() {
    let env = Env::start(Env::server()).await;
    let attempts: Attempts = Arc::default();
    let declared = TaskOptions::new().max_attempts(1).backoff(
        Duration::from_millis(5),
        Duration::from_millis(5),
        0.0,
    );
    let worker = Worker::builder("q")
        .task_with("flaky", declared, {
            let attempts = attempts.clone();
            move |task: Task| {
                *attempts.lock().unwrap().entry(task.id).or_default() += 1;
                async { Err::<(), _>(TaskError::new("io", "always")) }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let flaky = || TaskSpec::new("flaky");

    // The declared option applies while nothing is stored.
    assert_eq!(attempts_until_dead(&env, &attempts, flaky()).await, 1);

    // Stored settings win over the declared ones, from a next attempt on, without a
    // restart: tasks are submitted until one gets the stored value.
    let stored = env
        .ax
        .put_task_settings("q", "flaky", &settings(3))
        .await
        .unwrap();
    assert_eq!(stored.settings, settings(3));
    let mut seen = Vec::new();
    let started = Instant::now();
    loop {
        let n = attempts_until_dead(&env, &attempts, flaky()).await;
        seen.push(n);
        if n == 3 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never applied: {seen:?}"
        );
    }
    // Once applied, every task gets it.
    assert_eq!(attempts_until_dead(&env, &attempts, flaky()).await, 3);
    // The submit's own value wins over the stored one.
    let own = flaky().max_attempts(2);
    assert_eq!(attempts_until_dead(&env, &attempts, own).await, 2);

    // A change is followed too, and a delete goes back to the declared option.
    env.ax
        .put_task_settings("q", "flaky", &settings(2))
        .await
        .unwrap();
    eventually(
        Duration::from_secs(10),
        "the change to be applied",
        || async { (attempts_until_dead(&env, &attempts, flaky()).await == 2).then_some(()) },
    )
    .await;
    assert!(env.ax.delete_task_settings("q", "flaky").await.unwrap());
    assert!(!env.ax.delete_task_settings("q", "flaky").await.unwrap());
    eventually(
        Duration::from_secs(10),
        "the delete to be applied",
        || async { (attempts_until_dead(&env, &attempts, flaky()).await == 1).then_some(()) },
    )
    .await;
    stop.cancel();
    handle.await.unwrap();
}

/// Handlers of `slow` running now and the most seen at once.
#[derive(Default)]
struct Overlap {
    now: AtomicUsize,
    max: AtomicUsize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_concurrency_resizes_the_names_slots_while_the_worker_runs() {
    let env = Env::start(Env::server()).await;
    // Stored before the worker starts: its first attempts already follow it.
    env.ax
        .put_task_settings(
            "q",
            "slow",
            &TaskSettings {
                concurrency: Some(1),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let overlap: Arc<Overlap> = Arc::default();
    let worker = Worker::builder("q")
        .concurrency(8)
        .task("slow", {
            let o = overlap.clone();
            move |_task: Task| {
                let o = o.clone();
                async move {
                    let now = o.now.fetch_add(1, Ordering::SeqCst) + 1;
                    o.max.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    o.now.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let run_batch = |n: usize| {
        let env = &env;
        async move {
            let mut ids = Vec::new();
            for _ in 0..n {
                ids.push(env.ax.submit("q", TaskSpec::new("slow")).await.unwrap().id);
            }
            for id in ids {
                env.wait_state(&id, TaskState::Succeeded, Duration::from_secs(20))
                    .await;
            }
        }
    };
    run_batch(4).await;
    assert_eq!(overlap.max.load(Ordering::SeqCst), 1, "the stored cap of 1");

    env.ax
        .put_task_settings(
            "q",
            "slow",
            &TaskSettings {
                concurrency: Some(3),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    within(Duration::from_secs(30), "the cap of 3 to be used", async {
        while overlap.max.load(Ordering::SeqCst) < 3 {
            run_batch(6).await;
        }
    })
    .await;
    assert_eq!(
        overlap.max.load(Ordering::SeqCst),
        3,
        "never above the new cap"
    );
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_soft_timeout_stops_a_handler_that_stops_heartbeating() {
    let env = Env::start(Env::server()).await;
    let options = TaskOptions::new()
        .max_attempts(1)
        .timeout(Duration::from_secs(30))
        .heartbeat_timeout(Duration::from_millis(300));
    let worker = Worker::builder("q")
        .task_with("long", options, |task: Task| async move {
            let stall: bool = task.json()?;
            // 1.2 s of work, a beat every 100 ms: four times the soft timeout.
            for _ in 0..12 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                task.heartbeat();
            }
            if stall {
                tokio::time::sleep(Duration::from_secs(20)).await;
            }
            Ok(())
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    let submit = |stall: bool| {
        let env = &env;
        async move {
            let spec = TaskSpec::new("long").json(&stall);
            env.ax.submit("q", spec).await.unwrap().id
        }
    };
    let beating = submit(false).await;
    let started = Instant::now();
    let stalling = submit(true).await;
    env.wait_state(&beating, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    let dead = env
        .wait_state(&stalling, TaskState::Dead, Duration::from_secs(10))
        .await;
    let took = started.elapsed();
    let error = dead.last_error.expect("an error");
    assert_eq!(error.class, "heartbeat_timeout");
    assert!(error.message.contains("12 heartbeats"), "{}", error.message);
    assert!(
        took < Duration::from_secs(5),
        "stopped by the soft timeout: {took:?}"
    );
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_settings_api_checks_what_it_stores() {
    let env = Env::start(Env::server()).await;
    let refused = |r: Result<_, ClientError>| match r {
        Err(ClientError::Refused(e)) => (e.code, e.field),
        other => panic!("not refused: {other:?}"),
    };
    let bad = TaskSettings {
        timeout_ms: Some(0),
        ..Default::default()
    };
    assert_eq!(
        refused(env.ax.put_task_settings("q", "t", &bad).await),
        (ErrorCode::InvalidField, Some("timeout_ms".into()))
    );
    assert_eq!(
        refused(env.ax.put_task_settings("q", "a.b", &settings(2)).await),
        (ErrorCode::InvalidField, Some("name".into()))
    );
    let unknown = env.ax.put_task_settings("nope", "t", &settings(2)).await;
    assert_eq!(refused(unknown).0, ErrorCode::UnknownQueue);
    // A body with an unknown field is refused, not stored without it.
    let typo = serde_json::json!({"queue": "q", "name": "t", "settings": {"retries": 2}});
    let answer = env
        .client
        .request("ax.task.options_put", typo.to_string().into())
        .await
        .unwrap();
    let answer: serde_json::Value = serde_json::from_slice(&answer.payload).unwrap();
    assert_eq!(answer["error"]["code"], "bad_request", "{answer}");
    assert_eq!(env.ax.task_settings("q", "t").await.unwrap(), None);

    env.ax
        .put_task_settings("q", "t", &settings(2))
        .await
        .unwrap();
    assert_eq!(
        env.ax.task_settings("q", "t").await.unwrap(),
        Some(settings(2))
    );
    let listed = env.ax.list_task_settings(Some("q")).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].name.as_str(), &listed[0].settings),
        ("t", &settings(2))
    );
    // Limits and the pause flag share the bucket; they are not settings.
    env.ax.pause_queue("q", None).await.unwrap();
    assert_eq!(env.ax.list_task_settings(None).await.unwrap().len(), 1);
    assert!(env.ax.list_limits(Some("q")).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ax_apply_stores_a_settings_file_and_refuses_a_bad_one_whole() {
    let env = Env::start(Env::server().queues(["q", "other"])).await;
    env.ax
        .put_task_settings("other", "kept", &settings(4))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("runtime.yaml");
    let write = |text: &str| std::fs::write(&file, text).unwrap();
    let path = file.to_str().unwrap().to_string();
    let args = ["apply", "-f", path.as_str()];
    let apply = || ax_cli(&env, &args);
    write(
        "tasks:\n  create_invoice:\n    queue: q\n    retries: 3\n    timeout: 60s\n    retry_on: [InvoiceApiError]\n    alert_group: billing\n  gone:\n    queue: q\n    timeout: 5\n",
    );
    let out = apply().await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("created    task create_invoice on q"),
        "{stdout}"
    );
    let stored = env
        .ax
        .task_settings("q", "create_invoice")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.max_attempts, Some(4));
    assert_eq!(stored.timeout_ms, Some(60_000));
    assert_eq!(stored.alert_group.as_deref(), Some("billing"));

    // Applied again: unchanged; a name taken out of the file is deleted in its queue, and
    // other queues are left alone.
    assert!(
        String::from_utf8_lossy(&apply().await.stdout).contains("unchanged  task create_invoice")
    );
    write("tasks:\n  create_invoice:\n    queue: q\n    retries: 3\n    timeout: 60s\n    retry_on: [InvoiceApiError]\n    alert_group: billing\n");
    let stdout = String::from_utf8_lossy(&apply().await.stdout).to_string();
    assert!(stdout.contains("deleted    task gone on q"), "{stdout}");
    assert_eq!(
        env.ax.task_settings("other", "kept").await.unwrap(),
        Some(settings(4))
    );

    // A bad entry refuses the whole file, naming the field; nothing changes.
    write("tasks:\n  create_invoice:\n    queue: q\n    retries: 9\n  broken:\n    queue: q\n    timeout: soon\n");
    let out = apply().await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("tasks.broken.timeout"), "{stderr}");
    assert!(!stderr.contains("backtrace"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    let kept = env
        .ax
        .task_settings("q", "create_invoice")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kept.max_attempts, Some(4));

    // `ax tasks options set` merges into what is stored; `get -o json` shows it.
    let out = ax_cli(
        &env,
        &[
            "tasks",
            "options",
            "set",
            "create_invoice",
            "--queue",
            "q",
            "--concurrency",
            "2",
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let out = ax_cli(
        &env,
        &[
            "-o",
            "json",
            "tasks",
            "options",
            "get",
            "create_invoice",
            "--queue",
            "q",
        ],
    )
    .await;
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got[0]["settings"]["concurrency"], 2);
    assert_eq!(
        got[0]["settings"]["max_attempts"], 4,
        "merged, not replaced"
    );
}

/// `limits:` and `fair:` in the settings file: `ax apply` stores each limit (a dropping
/// one too) and a queue's fair shares, reports unchanged ones, deletes a limit of a named
/// queue the file no longer lists, and refuses a bad limit before storing anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ax_apply_stores_limits_and_fair_shares() {
    let env = Env::start(Env::server().queues(["q", "other"])).await;
    let kept = serde_json::json!({"name": "kept", "queue": "other", "concurrency": 2});
    env.ax.limits("put", &kept).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("runtime.yaml");
    let path = file.to_str().unwrap().to_string();
    let apply = |text: &str| {
        std::fs::write(&file, text).unwrap();
        let args = ["apply", "-f", path.as_str()];
        let env = &env;
        async move {
            let out = ax_cli(env, &args).await;
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            (
                out.status.success(),
                text,
                String::from_utf8_lossy(&out.stderr).to_string(),
            )
        }
    };
    let both = "limits:\n  - {name: quota, queue: q, rate: 10, burst: 20, excess: drop}\n  - {name: cap, queue: q, concurrency: 3}\nfair:\n  q: {weights: {acme: 2}, depth: 64}\n";
    let (ok, out, err) = apply(both).await;
    assert!(ok, "{err}");
    assert!(out.contains("created    limit quota on q"), "{out}");
    assert!(out.contains("applied    fair shares on q"), "{out}");
    let quota = env
        .ax
        .limits("get", &serde_json::json!({"queue": "q", "name": "quota"}))
        .await
        .unwrap();
    assert_eq!(
        (quota["excess"].as_str(), quota["burst"].as_u64()),
        (Some("drop"), Some(20))
    );
    let fair = env
        .ax
        .limits("fair_get", &serde_json::json!({"queue": "q"}))
        .await
        .unwrap();
    assert_eq!(
        (
            fair["fair"]["weights"]["acme"].as_u64(),
            fair["fair"]["depth"].as_u64()
        ),
        (Some(2), Some(64))
    );

    let (ok, out, _) = apply(both).await;
    assert!(ok && out.contains("unchanged  limit quota on q"), "{out}");
    // `cap` left out: deleted from q; `kept` (another queue) stays.
    let (ok, out, err) =
        apply("limits:\n  - {name: quota, queue: q, rate: 10, burst: 20, excess: drop}\n").await;
    assert!(
        ok && out.contains("deleted    limit cap on q"),
        "{out}{err}"
    );
    let names = |v: serde_json::Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|d| d["name"].as_str().unwrap().to_string())
            .collect()
    };
    let q = env
        .ax
        .limits("list", &serde_json::json!({"queue": "q"}))
        .await
        .unwrap();
    assert_eq!(names(q), ["quota"]);
    let other = env
        .ax
        .limits("list", &serde_json::json!({"queue": "other"}))
        .await
        .unwrap();
    assert_eq!(names(other), ["kept"]);
    // A limit that does not decode: refused naming it, nothing changed.
    let (ok, _, err) =
        apply("limits:\n  - {name: quota, queue: q, rate: 1, excess: sometimes}\n").await;
    assert!(!ok && err.contains("limits[0]"), "{err}");
    let quota = env
        .ax
        .limits("get", &serde_json::json!({"queue": "q", "name": "quota"}))
        .await
        .unwrap();
    assert_eq!(quota["rate"].as_f64(), Some(10.0));
}
