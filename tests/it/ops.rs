//! Task operations against a real nats-server: find, cancel, retry, replay,
//! run now, pause and resume, through the SDK and the CLI. Handler runs are counted per
//! task id by the handlers themselves.

use crate::support::{eventually, within, Env};
use ax_sdk::ops::{ListRequest, TaskQuery};
use ax_sdk::worker::{Task, TaskError, Worker};
use ax_sdk::{ErrorKind, TaskSpec, TaskState};
use futures::StreamExt;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

type Runs = Arc<Mutex<HashMap<String, u32>>>;

fn runs_of(runs: &Runs, id: &str) -> u32 {
    runs.lock().unwrap().get(id).copied().unwrap_or(0)
}

/// A worker on `q`: payload `{"fail": true}` fails with the permanent class
/// `card_declined` until `fixed` is set; `{"block": true}` sleeps a minute; `{"flaky":
/// true}` fails (retryably) its first attempt.
fn worker(fixed: Arc<AtomicBool>) -> (Worker, Runs, Arc<Mutex<u32>>) {
    let runs: Runs = Arc::default();
    let finished_blocks = Arc::new(Mutex::new(0));
    let w = Worker::builder("q")
        .concurrency(8)
        .handler({
            let (runs, finished_blocks) = (runs.clone(), finished_blocks.clone());
            move |task: Task| {
                let (runs, fixed, finished_blocks) =
                    (runs.clone(), fixed.clone(), finished_blocks.clone());
                async move {
                    *runs.lock().unwrap().entry(task.id.clone()).or_default() += 1;
                    let p: Value = serde_json::from_slice(&task.payload).unwrap_or_default();
                    if p["fail"] == true && !fixed.load(Ordering::SeqCst) {
                        return Err(TaskError::permanent(
                            "card_declined",
                            "the card was declined",
                        ));
                    }
                    if p["flaky"] == true && task.attempt == 1 {
                        return Err(TaskError::new("io", "first attempt fails"));
                    }
                    if p["block"] == true {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                        *finished_blocks.lock().unwrap() += 1;
                    }
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    (w, runs, finished_blocks)
}

fn query(state: Option<TaskState>, class: Option<&str>) -> ListRequest {
    ListRequest {
        query: TaskQuery {
            state,
            error_class: class.map(str::to_string),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Runs the `ax` command (without blocking the runtime the in-process server runs on).
async fn cli(env: &Env, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_ax"))
        .args(args)
        .env("NATS_URL", env.nats.url())
        .output()
        .await
        .unwrap()
}

async fn submit(env: &Env, spec: TaskSpec) -> String {
    env.ax.submit("q", spec).await.unwrap().id
}

#[tokio::test]
async fn a_dead_task_is_found_by_its_error_class_among_many_retried_and_succeeds() {
    within(Duration::from_secs(90), "find and retry", async {
        let env = Env::start(Env::server().task_index(true)).await;
        let fixed = Arc::new(AtomicBool::new(false));
        let (w, runs, _) = worker(fixed.clone());
        let _w = env.spawn_worker(w);
        let mut ok = Vec::new();
        for i in 0..200 {
            ok.push(submit(&env, TaskSpec::new("charge").json(&json!({"i": i}))).await);
        }
        let mut dead = Vec::new();
        for _ in 0..3 {
            let spec = TaskSpec::new("charge")
                .json(&json!({"fail": true}))
                .max_attempts(2);
            dead.push(submit(&env, spec).await);
        }
        let found = eventually(Duration::from_secs(20), "3 dead tasks in the index", || {
            let ax = env.ax.clone();
            async move {
                let r = ax
                    .find_tasks(&query(Some(TaskState::Dead), Some("card_declined")))
                    .await
                    .ok()?;
                (r.total == Some(3)).then_some(r)
            }
        })
        .await;
        let mut ids: Vec<&str> = found.tasks.iter().map(|t| t.id.as_str()).collect();
        ids.sort();
        let mut want: Vec<&str> = dead.iter().map(String::as_str).collect();
        want.sort();
        assert_eq!(ids, want);
        assert!(found
            .tasks
            .iter()
            .all(|t| t.error_class.as_deref() == Some("card_declined")));
        let other = env
            .ax
            .find_tasks(&query(None, Some("timeout")))
            .await
            .unwrap();
        assert_eq!((other.total, other.tasks.len()), (Some(0), 0));
        eventually(
            Duration::from_secs(20),
            "200 succeeded in the index",
            || {
                let ax = env.ax.clone();
                async move {
                    let r = ax
                        .find_tasks(&query(Some(TaskState::Succeeded), None))
                        .await
                        .ok()?;
                    (r.total == Some(200)).then_some(())
                }
            },
        )
        .await;

        // The CLI finds them too, as a table and as JSON.
        let table = cli(
            &env,
            &[
                "tasks",
                "list",
                "--state",
                "dead",
                "--error-class",
                "card_declined",
            ],
        )
        .await;
        assert!(table.status.success(), "{table:?}");
        let text = String::from_utf8_lossy(&table.stdout);
        assert!(text.starts_with("ID"), "{text}");
        assert_eq!(text.lines().count(), 4, "{text}");
        let listed = cli(&env, &["tasks", "list", "--state", "dead", "-o", "json"]).await;
        let listed: Value = serde_json::from_slice(&listed.stdout).unwrap();
        assert_eq!(listed["total"], 3);

        // Retry without a reset: one more attempt (still failing: dead again, with a new
        // dead letter of its own).
        let d0 = &dead[0];
        let letters = env.stream_len("AX_DEAD").await;
        let out = env.ax.retry_task(d0, false).await.unwrap();
        assert_eq!(out.state, TaskState::Pending);
        let again = eventually(
            Duration::from_secs(10),
            "the retried task dead again",
            || {
                let ax = env.ax.clone();
                async move {
                    let (rec, _) = ax.task(d0).await.ok()??;
                    (rec.state == TaskState::Dead && rec.attempt == 2).then_some(rec)
                }
            },
        )
        .await;
        assert_eq!(again.max_attempts, 2);
        assert_eq!(runs_of(&runs, d0), 2);
        eventually(Duration::from_secs(5), "a second dead letter", || {
            let env = &env;
            async move { (env.stream_len("AX_DEAD").await == letters + 1).then_some(()) }
        })
        .await;

        // Fixed: retry with a reset runs it from attempt 1, and it succeeds.
        fixed.store(true, Ordering::SeqCst);
        env.ax.retry_task(d0, true).await.unwrap();
        let done = env
            .wait_state(d0, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        assert_eq!(done.attempt, 1, "attempts were reset");
        assert_eq!(done.op.as_ref().map(|o| o.op.as_str()), Some("retry"));
        assert_eq!(runs_of(&runs, d0), 3);
        let refused = env.ax.retry_task(d0, false).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Conflict, "{refused}");

        // Replay the other two by filter: a dry run names them, the replay runs them.
        let q = TaskQuery {
            error_class: Some("card_declined".into()),
            ..Default::default()
        };
        let dry = env.ax.replay_dead(&q, None, false, true).await.unwrap();
        assert_eq!(dry.would_retry, 2);
        assert_eq!(runs_of(&runs, &dead[1]), 1, "a dry run retries nothing");
        let replayed = env.ax.replay_dead(&q, None, false, false).await.unwrap();
        assert_eq!((replayed.retried, replayed.failed.len()), (2, 0));
        for id in &dead[1..] {
            env.wait_state(id, TaskState::Succeeded, Duration::from_secs(10))
                .await;
            assert_eq!(runs_of(&runs, id), 2);
        }
        assert!(ok.iter().all(|id| runs_of(&runs, id) == 1));
    })
    .await
}

#[tokio::test]
async fn cancel_stops_a_task_before_and_during_its_attempt() {
    within(Duration::from_secs(60), "cancel", async {
        let env = Env::start(Env::server()).await;

        // This server keeps no task index: finding tasks is refused, saying what to do.
        let refused = env.ax.find_tasks(&query(None, None)).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Unavailable);
        assert!(refused.to_string().contains("--task-index"), "{refused}");

        // Scheduled: cancelled, its delayed message removed; a second cancel is refused.
        let later = submit(&env, TaskSpec::new("t").delay(Duration::from_secs(3600))).await;
        assert_eq!(env.stream_len("AX_DELAYED").await, 1);
        let out = env.ax.cancel_task(&later).await.unwrap();
        assert_eq!(out.state, TaskState::Cancelled);
        assert_eq!(env.stream_len("AX_DELAYED").await, 0);
        let refused = env.ax.cancel_task(&later).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Conflict);

        // Running on a worker that is gone (its record says running; nobody answers the
        // signal): the cancel is recorded and the next delivery ends it unrun.
        let orphan = submit(&env, TaskSpec::new("t")).await;
        let store = env.store().await;
        let (rec, rev) = store.find(&orphan).await.unwrap().unwrap();
        let mut running = rec.transition(TaskState::Running);
        running.attempt = 1;
        running.worker = Some("gone".into());
        store.cas(&running, rev).await.unwrap();
        let out = env.ax.cancel_task(&orphan).await.unwrap();
        assert!(
            out.cancel_requested && out.state == TaskState::Running,
            "{out:?}"
        );

        // Pending with no record yet (an immediate submit without a key: the claim would
        // create it): found by its message, cancelled by creating its record; the worker
        // then acks it unrun. A made-up id of the queue is not found.
        let unclaimed = submit(&env, TaskSpec::new("t")).await;
        assert!(
            store.get(&unclaimed).await.unwrap().is_none(),
            "no record yet"
        );
        let found = env.record(&unclaimed).await;
        assert_eq!(
            (found.state, found.ready_seq.is_some()),
            (TaskState::Pending, true)
        );
        assert_eq!(env.stream_len("AX_READY_NORMAL").await, 2);
        let out = env.ax.cancel_task(&unclaimed).await.unwrap();
        assert_eq!(out.state, TaskState::Cancelled);
        // Its message goes with it: no worker fetches it to find it cancelled.
        assert_eq!(env.stream_len("AX_READY_NORMAL").await, 1);
        let made_up = env.ax.cancel_task("q.nosuchtask").await.unwrap_err();
        assert_eq!(made_up.kind(), ErrorKind::NotFound);

        let (w, runs, finished) = worker(Arc::new(AtomicBool::new(false)));
        let _w = env.spawn_worker(w);
        let rec = env
            .wait_state(&orphan, TaskState::Cancelled, Duration::from_secs(10))
            .await;
        assert_eq!(rec.attempt, 1);
        assert_eq!(runs_of(&runs, &orphan), 0, "cancelled unrun");
        eventually(
            Duration::from_secs(10),
            "the unclaimed task's message acked",
            || {
                let env = &env;
                async move { (env.stream_len("AX_READY_NORMAL").await == 0).then_some(()) }
            },
        )
        .await;
        assert_eq!(
            runs_of(&runs, &unclaimed),
            0,
            "cancelled before its claim: unrun"
        );
        assert_eq!(env.record(&unclaimed).await.state, TaskState::Cancelled);

        // Running here: the handler is stopped, the attempt ends cancelled, nothing reruns.
        let block = submit(&env, TaskSpec::new("t").json(&json!({"block": true}))).await;
        env.wait_state(&block, TaskState::Running, Duration::from_secs(10))
            .await;
        eventually(Duration::from_secs(5), "the handler to start", || async {
            (runs_of(&runs, &block) == 1).then_some(())
        })
        .await;
        let out = env.ax.cancel_task(&block).await.unwrap();
        assert_eq!(out.state, TaskState::Cancelled, "{out:?}");
        assert!(out.worker.is_some());
        let rec = env.record(&block).await;
        assert_eq!(rec.state, TaskState::Cancelled);
        assert_eq!(rec.last_error.unwrap().class, "cancelled");
        tokio::time::sleep(Duration::from_millis(2500)).await; // 2.5 ack waits
        assert_eq!(runs_of(&runs, &block), 1, "no redelivery ran it again");
        assert_eq!(
            *finished.lock().unwrap(),
            0,
            "the handler did not run to its end"
        );
        assert_eq!(env.record(&block).await.state, TaskState::Cancelled);
    })
    .await
}

#[tokio::test]
async fn run_now_starts_scheduled_and_retrying_tasks_at_once() {
    within(Duration::from_secs(60), "run now", async {
        let env = Env::start(Env::server()).await;
        let (w, runs, _) = worker(Arc::new(AtomicBool::new(false)));
        let _w = env.spawn_worker(w);

        let later = submit(&env, TaskSpec::new("t").delay(Duration::from_secs(3600))).await;
        let out = env.ax.run_now(&later).await.unwrap();
        assert_eq!(out.state, TaskState::Pending);
        env.wait_state(&later, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        assert_eq!(runs_of(&runs, &later), 1);
        eventually(
            Duration::from_secs(5),
            "the delayed message removed",
            || {
                let env = &env;
                async move { (env.stream_len("AX_DELAYED").await == 0).then_some(()) }
            },
        )
        .await;

        // Retrying with an hour's backoff: run now starts the next attempt at once.
        // Submitted in a batch with another task, its message was stored by a group
        // commit and carries the batch's headers, which the run-now copy must not.
        let spec = TaskSpec::new("t").json(&json!({"flaky": true})).backoff(
            Duration::from_secs(3600),
            Duration::from_secs(3600),
            0.0,
        );
        let both = env.ax.submit_many("q", [spec, TaskSpec::new("t")]).await;
        let flaky = both[0].as_ref().unwrap().id.clone();
        let rec = env
            .wait_state(&flaky, TaskState::Retrying, Duration::from_secs(10))
            .await;
        assert!(rec.next_retry_at_ms.unwrap() > ax_core::time::now_ms() + 3_000_000);
        let stored = env
            .js
            .get_stream("AX_READY_NORMAL")
            .await
            .unwrap()
            .get_raw_message(rec.ready_seq.unwrap())
            .await
            .unwrap();
        assert!(
            stored.headers.get("Nats-Batch-Id").is_some(),
            "the two submits were one group: {:?}",
            stored.headers
        );
        env.ax.run_now(&flaky).await.unwrap();
        let done = env
            .wait_state(&flaky, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        assert_eq!(done.attempt, 2);
        assert_eq!(done.op.as_ref().map(|o| o.op.as_str()), Some("run_now"));
        assert_eq!(runs_of(&runs, &flaky), 2);
        let refused = env.ax.run_now(&flaky).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Conflict);
    })
    .await
}

#[tokio::test]
async fn a_paused_queue_takes_nothing_until_resumed() {
    within(Duration::from_secs(60), "pause", async {
        let env = Env::start(Env::server().task_index(true)).await;
        let (w, runs, _) = worker(Arc::new(AtomicBool::new(false)));
        let mut status = w.status();
        let _w = env.spawn_worker(w);
        let first = submit(&env, TaskSpec::new("t")).await;
        env.wait_state(&first, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        assert!(status.ready() && !status.paused());

        let paused = cli(&env, &["queue", "pause", "q", "--reason", "deploy"]).await;
        assert!(paused.status.success(), "{paused:?}");
        // The pause reaches the running worker through a KV watch (and a 250 ms poll):
        // wait until the worker says it saw it.
        status.wait_paused(true).await;
        let mut held = Vec::new();
        for _ in 0..20 {
            held.push(submit(&env, TaskSpec::new("t")).await);
        }
        // A worker started during the pause takes nothing either (it ran 3–9 tasks before
        // it read the pause flag: found by the fault campaign). It is ready and paused from
        // its first read; then nothing may run for 3 s (an absence needs a window).
        let (late, late_runs, _) = worker(Arc::new(AtomicBool::new(false)));
        let mut late_status = late.status();
        let _late = env.spawn_worker(late);
        late_status.wait_ready().await;
        assert!(
            late_status.paused(),
            "a worker ready during the pause saw no pause"
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            held.iter().all(|id| runs_of(&runs, id) == 0),
            "a paused queue ran a task"
        );
        assert!(
            held.iter().all(|id| runs_of(&late_runs, id) == 0),
            "a worker started during the pause ran a task"
        );
        let queues = env.ax.queues().await.unwrap();
        let q = &queues["queues"][0];
        assert_eq!(
            (q["queue"].as_str(), q["paused"].as_bool()),
            (Some("q"), Some(true))
        );
        assert_eq!(q["pause"]["reason"], "deploy");
        assert_eq!(q["ready"]["normal"], 20);
        let table = cli(&env, &["queue", "list"]).await;
        let text = String::from_utf8_lossy(&table.stdout);
        assert!(
            text.lines()
                .nth(1)
                .is_some_and(|l| l.starts_with("q ") && l.contains("paused")),
            "{text}"
        );

        env.ax.resume_queue("q").await.unwrap();
        status.wait_paused(false).await;
        late_status.wait_paused(false).await;
        for id in &held {
            env.wait_state(id, TaskState::Succeeded, Duration::from_secs(15))
                .await;
            assert_eq!(runs_of(&runs, id) + runs_of(&late_runs, id), 1);
        }
        let completions = cli(&env, &["completions", "bash"]).await;
        assert!(String::from_utf8_lossy(&completions.stdout).contains("complete -F"));
    })
    .await
}

/// A webhook receiver: answers 200 to every POST and keeps the bodies.
async fn webhook() -> (String, Arc<Mutex<Vec<Value>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let bodies: Arc<Mutex<Vec<Value>>> = Arc::default();
    let kept = bodies.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let n = sock.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len: usize = text[..end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse().unwrap())
                            })
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + len {
                            let body =
                                serde_json::from_slice(&buf[end + 4..end + 4 + len]).unwrap();
                            kept.lock().unwrap().push(body);
                            let _ = sock
                                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                                .await;
                            return;
                        }
                    }
                }
            });
        }
    });
    (url, bodies)
}

#[tokio::test]
async fn alerts_fire_once_per_failure_burst_across_servers() {
    within(Duration::from_secs(60), "alerts", async {
        let (url, hooked) = webhook().await;
        let alerts = ax_server::ops::AlertConfig {
            window: Duration::from_secs(3),
            webhook: Some(url),
            console_url: Some("http://console.test".into()),
        };
        let env = Env::start(Env::server().alerts(alerts.clone())).await;
        // A second server on the same broker sees every failure too.
        let second = CancellationToken::new();
        let client = async_nats::connect(env.nats.url()).await.unwrap();
        tokio::spawn(
            Env::server()
                .alerts(alerts)
                .build()
                .run(client, second.clone()),
        );
        let _stop = second.clone().drop_guard();
        let mut events = env.client.subscribe("ax.events.alert.q").await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;

        let (w, _, _) = worker(Arc::new(AtomicBool::new(false)));
        let _w = env.spawn_worker(w);
        let fail = || {
            TaskSpec::new("charge")
                .json(&json!({"fail": true}))
                .max_attempts(1)
        };
        let mut burst = Vec::new();
        for _ in 0..5 {
            burst.push(submit(&env, fail()).await);
        }
        for id in &burst {
            env.wait_state(id, TaskState::Dead, Duration::from_secs(10))
                .await;
        }
        let first = tokio::time::timeout(Duration::from_secs(5), events.next())
            .await
            .unwrap()
            .unwrap();
        let first: Value = serde_json::from_slice(&first.payload).unwrap();
        assert_eq!(first["kind"], "task_dead");
        assert_eq!(
            (first["queue"].as_str(), first["name"].as_str()),
            (Some("q"), Some("charge"))
        );
        assert_eq!(first["error_class"], "card_declined");
        assert_eq!(first["suppressed_since_last"], 0);
        assert!(burst.iter().any(|id| first["task"] == id.as_str()));
        // The console's route for one task.
        let id = first["task"].as_str().unwrap();
        assert_eq!(first["link"], format!("http://console.test/#/task/{id}"));
        let quiet = tokio::time::timeout(Duration::from_millis(1500), events.next()).await;
        assert!(
            quiet.is_err(),
            "a repeat within the window alerted: {quiet:?}"
        );

        assert!(first.get("group").is_none(), "no alert group stored yet");

        // After the window, the next failure alerts again and counts the 4 folded ones;
        // the name's stored alert group is on it.
        let group = ax_sdk::settings::TaskSettings {
            alert_group: Some("billing".into()),
            ..Default::default()
        };
        env.ax
            .put_task_settings("q", "charge", &group)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let late = submit(&env, fail()).await;
        let next = tokio::time::timeout(Duration::from_secs(10), events.next())
            .await
            .unwrap()
            .unwrap();
        let next: Value = serde_json::from_slice(&next.payload).unwrap();
        assert_eq!(next["task"], late.as_str());
        assert_eq!(next["suppressed_since_last"], 4);
        assert_eq!(next["group"], "billing");
        eventually(
            Duration::from_secs(10),
            "both alerts at the webhook",
            || async { (hooked.lock().unwrap().len() == 2).then_some(()) },
        )
        .await;
        let hooked = hooked.lock().unwrap().clone();
        assert_eq!(hooked, vec![first, next]);
        assert!(
            tokio::time::timeout(Duration::from_millis(500), events.next())
                .await
                .is_err()
        );
    })
    .await
}

#[tokio::test]
async fn a_tasks_events_outlive_its_sixteen_stored_revisions() {
    within(Duration::from_secs(60), "events", async {
        let env = Env::start(Env::server().task_events(true)).await;
        // The broker starts copying a moment after the stream is made (changes overwritten
        // in the record's 16 revisions before then are not copied: docs/PROTOCOL.md §8).
        eventually(Duration::from_secs(10), "the event copy to run", || {
            let js = env.js.clone();
            async move {
                let mut s = js.get_stream("AX_TASK_EVENTS").await.ok()?;
                let info = s.info().await.ok()?;
                info.sources.first()?.active.map(|_| ())
            }
        })
        .await;
        // Fails 19 times, then succeeds: 20 stored writes (each attempt writes its end
        // only: `retrying` ×19, `succeeded`), more than the record's 16 revisions; 41 events
        // (the submit, then each attempt's start and end).
        let w = Worker::builder("q")
            .handler(|task: Task| async move {
                if task.attempt <= 19 {
                    return Err(TaskError::new(
                        "io",
                        format!("attempt {} fails", task.attempt),
                    ));
                }
                Ok(())
            })
            .build()
            .unwrap();
        let _w = env.spawn_worker(w);
        let spec = TaskSpec::new("t").max_attempts(30).backoff(
            Duration::from_millis(1),
            Duration::from_millis(5),
            0.0,
        );
        let id = submit(&env, spec).await;
        env.wait_state(&id, TaskState::Succeeded, Duration::from_secs(30))
            .await;
        assert_eq!(
            env.ax.history(&id).await.unwrap().len(),
            16,
            "the record keeps 16"
        );
        let events = eventually(Duration::from_secs(5), "41 events", || {
            let ax = env.ax.clone();
            let id = id.clone();
            async move {
                let (e, complete) = ax.task_events(&id).await.ok()?;
                (complete && e.len() == 41).then_some(e)
            }
        })
        .await;
        let names: Vec<&str> = events
            .iter()
            .map(|e| e["event"].as_str().unwrap())
            .collect();
        assert_eq!(names[0], "submitted");
        assert_eq!(names.iter().filter(|n| **n == "started").count(), 20);
        assert_eq!(
            names.iter().filter(|n| **n == "failed_will_retry").count(),
            19
        );
        assert_eq!(names[40], "succeeded");
        assert_eq!(events[2]["reason"], "io: attempt 1 fails");
        assert!(events[1]["actor"].as_str().unwrap().starts_with("worker "));
        let table = cli(&env, &["task", "events", &id]).await;
        assert_eq!(String::from_utf8_lossy(&table.stdout).lines().count(), 42);

        // Without the stream (the default), the record's last 16 changes, said so.
        let plain = Env::start(Env::server()).await;
        let _pw = plain.spawn_worker(
            Worker::builder("q")
                .handler(|_t: Task| async { Ok(()) })
                .build()
                .unwrap(),
        );
        let one = plain.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
        plain
            .wait_state(&one, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        let (events, complete) = plain.ax.task_events(&one).await.unwrap();
        assert!(!complete);
        let names: Vec<&str> = events
            .iter()
            .map(|e| e["event"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["submitted", "started", "succeeded"]);
    })
    .await
}

#[tokio::test]
async fn the_request_apis_are_a_nats_service() {
    within(Duration::from_secs(30), "micro", async {
        let env = Env::start(Env::server().task_index(true)).await;
        let ask = |subject: &'static str| {
            let client = env.client.clone();
            async move {
                let reply = client.request(subject, "".into()).await.unwrap();
                serde_json::from_slice::<Value>(&reply.payload).unwrap()
            }
        };
        let ping = ask("$SRV.PING.ax").await;
        assert_eq!(ping["name"], "ax");
        assert_eq!(ping["version"], env!("CARGO_PKG_VERSION"));
        let info = ask("$SRV.INFO.ax").await;
        let endpoints: HashMap<String, String> = info["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_string(),
                    e["subject"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        for (name, subject) in [
            ("submit", "ax.submit.*"),
            ("flow", "ax.flow.*"),
            ("limit", "ax.limit.*"),
            ("trigger", "ax.trigger.*"),
            ("task-cancel", "ax.task.cancel"),
            ("task-list", "ax.task.list"),
        ] {
            assert_eq!(
                endpoints.get(name).map(String::as_str),
                Some(subject),
                "{info}"
            );
        }
        for _ in 0..3 {
            submit(&env, TaskSpec::new("t")).await;
        }
        env.ax.find_tasks(&query(None, None)).await.unwrap();
        let stats = ask("$SRV.STATS.ax").await;
        let count = |name: &str| {
            stats["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == name)
                .map(|e| e["num_requests"].as_u64().unwrap())
        };
        assert!(count("submit") >= Some(4), "{stats}"); // 3 + the start probe
        assert_eq!(count("task-list"), Some(1), "{stats}");
        let leader = eventually(Duration::from_secs(10), "a trigger leader", || async {
            let l = env.ax.trigger("leader", &json!({})).await.ok()?;
            l["leader"].as_str().map(str::to_string)
        })
        .await;
        assert!(!leader.is_empty());
    })
    .await
}

/// Log output captured on this thread (the test's runtime runs every task on it).
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn every_attempt_logs_in_a_span_with_the_task_and_its_trace() {
    let logs = Captured::default();
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .with_env_filter("ax=info,handler=info")
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    within(Duration::from_secs(30), "spans", async {
        let env = Env::start(Env::server()).await;
        let w = Worker::builder("q")
            .handler(|task: Task| async move {
                tracing::info!(target: "handler", "charging the card");
                if task.attempt == 1 {
                    return Err(TaskError::new("io", "reset"));
                }
                ax_sdk::Output::json(&json!({"ok": true}))
            })
            .build()
            .unwrap();
        let _w = env.spawn_worker(w);
        let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
        let tp = format!("00-{trace}-00f067aa0ba902b7-01");
        let spec = TaskSpec::new("charge")
            .json(&json!({"order": 7}))
            .idempotency_key("order-7")
            .traceparent(tp.clone())
            .backoff(Duration::from_millis(10), Duration::from_millis(10), 0.0);
        let id = submit(&env, spec).await;
        let rec = env
            .wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        assert_eq!(rec.traceparent.as_deref(), Some(tp.as_str()));
        let bad = env
            .ax
            .submit("q", TaskSpec::new("t").traceparent("00-xyz"))
            .await
            .unwrap_err();
        assert_eq!(bad.kind(), ErrorKind::Invalid, "{bad}");
        assert!(bad.to_string().contains("traceparent"), "{bad}");
    })
    .await;
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let handler_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("charging the card"))
        .collect();
    assert_eq!(handler_lines.len(), 2, "{text}");
    for (n, line) in handler_lines.iter().enumerate() {
        for want in [
            "task_id=q.".to_string(),
            "name=charge".into(),
            "queue=q".into(),
            format!("attempt={}", n + 1),
            "idempotency_key=order-7".into(),
            "trace_id=4bf92f3577b34da6a3ce929d0e0e4736".into(),
        ] {
            assert!(line.contains(&want), "{want} not in {line}");
        }
    }
    let finished: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("attempt finished"))
        .collect();
    assert_eq!(finished.len(), 2, "{text}");
    assert!(
        finished[0].contains("outcome=\"failed\"") || finished[0].contains("outcome=failed"),
        "{}",
        finished[0]
    );
    assert!(
        finished[0].contains("class=\"io\"") || finished[0].contains("class=io"),
        "{}",
        finished[0]
    );
    assert!(
        finished[1].contains("succeeded")
            && finished[1].contains("input_bytes=11")
            && finished[1].contains("output_bytes=11"),
        "{}",
        finished[1]
    );
    assert!(finished.iter().all(|l| l.contains("duration_ms=")));
}

#[tokio::test]
async fn a_retry_delivered_before_its_record_moves_waits_for_it_and_runs() {
    let faults = ax_core::faults::Faults::armed();
    within(Duration::from_secs(30), "retry race", async {
        let env = Env::start(Env::server().faults(faults.clone())).await;
        let fixed = Arc::new(AtomicBool::new(false));
        let (w, runs, _) = worker(fixed.clone());
        let _w = env.spawn_worker(w);
        let id = submit(
            &env,
            TaskSpec::new("t")
                .json(&json!({"fail": true}))
                .max_attempts(1),
        )
        .await;
        env.wait_state(&id, TaskState::Dead, Duration::from_secs(10))
            .await;
        fixed.store(true, Ordering::SeqCst);
        // The retry's message reaches the idle worker long before its record says
        // `pending`: the worker must wait for that write, not dead-letter the task again.
        faults.retry_gap(Duration::from_millis(800));
        let retried = env.ax.retry_task(&id, false).await;
        faults.retry_gap(Duration::ZERO);
        assert_eq!(retried.unwrap().state, TaskState::Pending);
        let rec = env
            .wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        assert_eq!(rec.attempt, 2);
        assert_eq!(runs_of(&runs, &id), 2);
    })
    .await
}

#[tokio::test]
async fn unfinished_tasks_matching_a_filter_are_cancelled_in_bulk() {
    within(Duration::from_secs(30), "bulk cancel", async {
        let env = Env::start(Env::server().task_index(true)).await;
        let mut later = Vec::new();
        for _ in 0..10 {
            later.push(
                submit(
                    &env,
                    TaskSpec::new("later").delay(Duration::from_secs(3600)),
                )
                .await,
            );
        }
        let other = submit(
            &env,
            TaskSpec::new("other").delay(Duration::from_secs(3600)),
        )
        .await;
        let q = TaskQuery {
            name: Some("later".into()),
            ..Default::default()
        };
        let dry = eventually(Duration::from_secs(10), "the index to hold the 10", || {
            let (ax, q) = (env.ax.clone(), q.clone());
            async move {
                let d = ax.cancel_matching(&q, None, true).await.ok()?;
                (d["would_cancel"] == 10).then_some(d)
            }
        })
        .await;
        assert_eq!(dry["ids"].as_array().unwrap().len(), 10);
        assert_eq!(
            env.record(&later[0]).await.state,
            TaskState::Scheduled,
            "a dry run cancels nothing"
        );
        let done = env.ax.cancel_matching(&q, None, false).await.unwrap();
        assert_eq!(
            (
                done["cancelled"].as_u64(),
                done["failed"].as_array().map(Vec::len)
            ),
            (Some(10), Some(0))
        );
        for id in &later {
            assert_eq!(env.record(id).await.state, TaskState::Cancelled);
        }
        assert_eq!(
            env.record(&other).await.state,
            TaskState::Scheduled,
            "outside the filter"
        );
        let queues = env.ax.queues().await.unwrap();
        assert!(queues["last_minute"]["succeeded"].is_u64(), "{queues}");
    })
    .await
}

#[tokio::test]
async fn limit_status_shows_tokens_left_and_who_holds_the_slots() {
    within(Duration::from_secs(30), "limit status", async {
        let env = Env::start(Env::server()).await;
        env.ax
            .limits(
                "put",
                &json!({"name": "one", "queue": "q", "rate": 5.0, "burst": 5, "concurrency": 1}),
            )
            .await
            .unwrap();
        let (w, runs, _) = worker(Arc::new(AtomicBool::new(false)));
        let _w = env.spawn_worker(w);
        let block = submit(&env, TaskSpec::new("t").json(&json!({"block": true}))).await;
        eventually(Duration::from_secs(10), "the handler to start", || async {
            (runs_of(&runs, &block) == 1).then_some(())
        })
        .await;
        let status = env
            .ax
            .limits("status", &json!({"queue": "q"}))
            .await
            .unwrap();
        let one = &status[0];
        assert_eq!(one["limit"]["name"], "one");
        let tokens = one["tokens"].as_f64().unwrap();
        assert!(
            (3.0..5.0).contains(&tokens),
            "one token taken of 5: {tokens}"
        );
        let held = one["slots_held"].as_array().unwrap();
        assert_eq!(held.len(), 1, "{status}");
        assert!(held[0]["slot"].as_str().unwrap().starts_with("q.one."));
        env.ax.cancel_task(&block).await.unwrap();
    })
    .await
}

#[tokio::test]
async fn a_console_open_to_other_hosts_without_a_token_is_refused_at_once() {
    // No NATS at that address: the refusal must not wait for one. An empty token (from
    // the flag or the environment) is no token; a read-only token alone would make
    // everyone admin.
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 4] = [
        (&["--console-addr", "0.0.0.0:0"], &[], "--console-token"),
        (
            &["--console-addr", "0.0.0.0:0", "--console-token", ""],
            &[],
            "--console-token",
        ),
        (
            &["--console-addr", "0.0.0.0:0"],
            &[("AX_CONSOLE_TOKEN", "")],
            "--console-token",
        ),
        (
            &[
                "--console-addr",
                "127.0.0.1:0",
                "--console-readonly-token",
                "viewer-token",
            ],
            &[],
            "needs --console-token",
        ),
    ];
    for (args, env, said) in cases {
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::process::Command::new(env!("CARGO_BIN_EXE_ax"))
                .args(["--url", "nats://127.0.0.1:1", "server"])
                .args(args)
                .args(["--metrics-addr", "off"])
                .envs(env.iter().copied())
                .env("RUST_BACKTRACE", "0")
                .output(),
        )
        .await
        .expect("refused without waiting for NATS")
        .unwrap();
        assert!(!out.status.success(), "{args:?} {env:?} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(said), "{args:?} {env:?}: {err}");
    }
}

/// Finds tasks matching `query` once the index shows exactly `n` of them.
async fn find_n(env: &Env, query: TaskQuery, n: usize) -> ax_sdk::ops::ListReply {
    let what = format!("{n} tasks matching {query:?}");
    let req = ListRequest {
        query,
        ..Default::default()
    };
    eventually(Duration::from_secs(15), &what, || {
        let (ax, req) = (env.ax.clone(), req.clone());
        async move {
            let r = ax.find_tasks(&req).await.ok()?;
            (r.total == Some(n)).then_some(r)
        }
    })
    .await
}

#[tokio::test]
async fn records_with_json_escapes_are_found_in_their_final_state() {
    within(Duration::from_secs(60), "escapes", async {
        let env = Env::start(Env::server().task_index(true)).await;
        // A record as another client's JSON writer may store it: any character may be
        // escaped (here the name and trigger, `\u0061` for `a`).
        let kv = env.js.get_key_value("AX_TASKS").await.unwrap();
        let id = "q.escaped0000000000001";
        let record = |state: &str, name: &str, trigger: &str| {
            format!(
                r#"{{"id":"{id}","queue":"q","name":"{name}","priority":"normal","state":"{state}","attempt":1,"max_attempts":3,"created_at_ms":1,"updated_at_ms":{},"trigger":"{trigger}"}}"#,
                ax_core::time::now_ms()
            )
        };
        kv.put(id, record("running", "charge", "nightly").into())
            .await
            .unwrap();
        let by_name = |state| TaskQuery {
            name: Some("charge".into()),
            state: Some(state),
            ..Default::default()
        };
        find_n(&env, by_name(TaskState::Running), 1).await;
        kv.put(
            id,
            record("succeeded", r"ch\u0061rge", r"n\u0069ghtly").into(),
        )
        .await
        .unwrap();
        let done = find_n(&env, by_name(TaskState::Succeeded), 1).await;
        assert_eq!(done.tasks[0].id, id);
        assert_eq!(done.tasks[0].trigger.as_deref(), Some("nightly"));
        find_n(&env, by_name(TaskState::Running), 0).await;

        // A worker's error message with a quote and a line break (escaped in the record).
        let w = Worker::builder("q")
            .handler(|_task: Task| async move {
                Err::<(), _>(TaskError::permanent(
                    "bad_input",
                    "field \"amount\" is missing\nsecond line",
                ))
            })
            .build()
            .unwrap();
        let _w = env.spawn_worker(w);
        let dead = submit(&env, TaskSpec::new("parse").max_attempts(1)).await;
        env.wait_state(&dead, TaskState::Dead, Duration::from_secs(10))
            .await;
        let q = TaskQuery {
            name: Some("parse".into()),
            state: Some(TaskState::Dead),
            ..Default::default()
        };
        let found = find_n(&env, q, 1).await;
        assert_eq!(found.tasks[0].id, dead);
        assert_eq!(found.tasks[0].error_class.as_deref(), Some("bad_input"));
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_an_operator_sees_and_purges() {
    within(Duration::from_secs(60), "payload, search, series, purge", async {
        let env = Env::start(Env::server().queues(["q", "idle"]).task_index(true)).await;
        // A declared queue without tasks is listed (the overview shows it).
        let q = env.ax.queues().await.unwrap();
        let idle = q["queues"].as_array().unwrap().iter().find(|x| x["queue"] == "idle");
        assert_eq!(idle.map(|x| x["tasks"]["pending"].clone()), Some(json!(0)), "{q}");
        let w = Worker::builder("q")
            .handler(|task: Task| async move {
                if task.name == "charge" {
                    return Err(TaskError::permanent("card_declined", "Card Declined by bank")
                        .with_detail("trace:\n  at charge (billing.rs:42)"));
                }
                Ok(())
            })
            .build()
            .unwrap();
        let _w = env.spawn_worker(w);
        let mut ok = Vec::new();
        for i in 0..10 {
            ok.push(submit(&env, TaskSpec::new("send").json(&i)).await);
        }
        let dead = submit(&env, TaskSpec::new("charge").json(&json!({"card": "4242"})).max_attempts(1)).await;
        env.wait_state(&dead, TaskState::Dead, Duration::from_secs(10)).await;
        let later = submit(
            &env,
            TaskSpec::new("send").json(&json!({"later": true})).delay(Duration::from_secs(3600)),
        )
        .await;

        // The payload and options come from the message; the error's detail is stored.
        let p = env.ax.task_op("payload", &json!({"id": dead})).await.unwrap();
        assert_eq!((p["source"].as_str(), &p["payload"]["json"]), (Some("dead letter"), &json!({"card": "4242"})));
        assert_eq!(p["options"]["max_attempts"], 1);
        let p = env.ax.task_op("payload", &json!({"id": later})).await.unwrap();
        assert_eq!((p["source"].as_str(), &p["payload"]["json"]), (Some("delayed"), &json!({"later": true})));
        let rec = env.record(&dead).await;
        assert_eq!(rec.last_error.unwrap().detail.as_deref(), Some("trace:\n  at charge (billing.rs:42)"));

        // Search by error text (any case, class or message) and by id.
        for text in ["declined by", "CARD_DECL"] {
            let r = find_n(&env, TaskQuery { error_text: Some(text.into()), ..Default::default() }, 1).await;
            assert_eq!(r.tasks[0].id, dead, "{text}");
        }
        let r = find_n(&env, TaskQuery { id: Some(ok[3].clone()), ..Default::default() }, 1).await;
        assert_eq!(r.tasks[0].id, ok[3]);
        find_n(&env, TaskQuery { error_text: Some("nope".into()), ..Default::default() }, 0).await;

        // The series of this minute counts what ended in it.
        let s = env.ax.task_op("series", &json!({"queue": "q"})).await.unwrap();
        let points = s["queues"]["q"].as_array().unwrap();
        assert_eq!(points.len(), 60);
        let sum = |f: &str| points.iter().map(|p| p[f].as_u64().unwrap()).sum::<u64>();
        assert_eq!((sum("succeeded"), sum("dead")), (10, 1));
        assert!(points.iter().any(|p| p["run_p50_ms"].is_number()));

        // Purge: only finished tasks, only older than asked.
        let none = env.ax.task_op("purge", &json!({"older_than_ms": 3_600_000, "dry_run": true})).await.unwrap();
        assert_eq!(none["would_purge"], 0);
        let refused = env.ax.task_op("purge", &json!({"state": "scheduled", "older_than_ms": 0})).await;
        assert!(matches!(&refused, Err(ax_sdk::ClientError::Refused(e)) if e.field.as_deref() == Some("state")), "{refused:?}");
        let done = env
            .ax
            .task_op("purge", &json!({"queue": "q", "state": "succeeded", "older_than_ms": 0, "by": "test"}))
            .await
            .unwrap();
        assert_eq!(done["purged"], 10, "{done}");
        for id in &ok {
            assert!(env.store().await.get(id).await.unwrap().is_none(), "{id} kept");
        }
        find_n(&env, TaskQuery { state: Some(TaskState::Succeeded), ..Default::default() }, 0).await;
        assert_eq!(env.record(&later).await.state, TaskState::Scheduled);
        assert_eq!(env.record(&dead).await.state, TaskState::Dead);
    })
    .await
}

#[tokio::test]
async fn finished_tasks_are_purged_with_their_outputs_unless_a_key_still_names_them() {
    within(Duration::from_secs(60), "purge", async {
        let env = Env::start(Env::server().queues(["q", "idle"]).task_index(true)).await;
        let w = Worker::builder("q")
            .handler(|task: Task| async move {
                match task.name.as_str() {
                    // Larger than an inline output: kept in AX_RESULTS.
                    "big" => Ok(ax_sdk::Output::bytes(vec![7u8; 4096])),
                    _ => Ok(ax_sdk::Output::none()),
                }
            })
            .build()
            .unwrap();
        let _w = env.spawn_worker(w);
        let mut done = Vec::new();
        for i in 0..10 {
            let name = if i == 0 { "big" } else { "send" };
            done.push(submit(&env, TaskSpec::new(name)).await);
        }
        let keyed = submit(&env, TaskSpec::new("send").idempotency_key("order-7")).await;
        // No worker serves `idle`: it stays pending.
        let pending = env
            .ax
            .submit("idle", TaskSpec::new("send"))
            .await
            .unwrap()
            .id;
        for id in done.iter().chain([&keyed]) {
            env.wait_state(id, TaskState::Succeeded, Duration::from_secs(10))
                .await;
        }
        let output_key = env.record(&done[0]).await.output.unwrap().key.unwrap();
        let results = env.js.get_key_value("AX_RESULTS").await.unwrap();
        assert!(results.get(&output_key).await.unwrap().is_some());
        let succeeded = TaskQuery {
            state: Some(TaskState::Succeeded),
            ..Default::default()
        };
        find_n(&env, succeeded.clone(), 11).await;

        // Refused: a state that is not finished; a request without `older_than_ms`.
        for state in [TaskState::Pending, TaskState::Running] {
            let q = TaskQuery {
                state: Some(state),
                ..Default::default()
            };
            let refused = env
                .ax
                .purge_tasks(&q, Duration::ZERO, None, false)
                .await
                .unwrap_err();
            assert!(
                matches!(&refused, ax_sdk::ClientError::Refused(e) if e.field.as_deref() == Some("state")),
                "{refused:?}"
            );
        }
        let no_age = env.ax.task_op("purge", &json!({"dry_run": true})).await;
        assert!(no_age.is_err(), "{no_age:?}");

        // Nothing is older than an hour; a dry run purges nothing.
        let all = TaskQuery::default();
        let hour = Duration::from_secs(3600);
        let none = env.ax.purge_tasks(&all, hour, None, false).await.unwrap();
        assert_eq!((&none["matched"], &none["purged"]), (&json!(0), &json!(0)));
        let dry = env
            .ax
            .purge_tasks(&all, Duration::ZERO, None, true)
            .await
            .unwrap();
        assert_eq!(dry["would_purge"], 11, "{dry}");
        assert!(env.store().await.get(&done[1]).await.unwrap().is_some());

        let purged = env
            .ax
            .purge_tasks(&all, Duration::ZERO, None, false)
            .await
            .unwrap();
        assert_eq!(purged["purged"], 10, "{purged}");
        let failed = purged["failed"].as_array().unwrap();
        assert_eq!(failed.len(), 1, "{purged}");
        assert_eq!(failed[0]["id"], keyed.as_str());
        assert_eq!(failed[0]["error"]["code"], "conflict");
        let store = env.store().await;
        for id in &done {
            assert!(store.get(id).await.unwrap().is_none(), "{id} kept");
        }
        assert!(
            results.get(&output_key).await.unwrap().is_none(),
            "the output is gone with its task"
        );
        // The index forgets them at once, here and (through the purge markers) elsewhere.
        let left = env
            .ax
            .find_tasks(&ListRequest {
                query: succeeded,
                ..Default::default()
            })
            .await
            .unwrap();
        let left: Vec<&str> = left.tasks.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(left, [keyed.as_str()]);
        let again = TaskQuery {
            id: Some(done[1].clone()),
            ..Default::default()
        };
        find_n(&env, again, 0).await;
        assert_eq!(env.record(&pending).await.state, TaskState::Pending);
        assert_eq!(env.record(&keyed).await.state, TaskState::Succeeded);
        // The key still answers with its task.
        let dup = env
            .ax
            .submit("q", TaskSpec::new("send").idempotency_key("order-7"))
            .await
            .unwrap();
        assert_eq!((dup.id.as_str(), dup.duplicate), (keyed.as_str(), true));
    })
    .await
}

/// Issue 44: a record the protocol accepts with its queue written with JSON escapes (a
/// worker's encoder may escape any character: `"\u0071"` is `q`) is found by its queue,
/// state and id like any other.
#[tokio::test]
async fn a_record_whose_queue_is_escaped_is_in_the_index() {
    within(Duration::from_secs(60), "escaped queue", async {
        let env = Env::start(Env::server().task_index(true)).await;
        let id = "q.EscapedQueue0000000001";
        let record = r#"{"id":"q.EscapedQueue0000000001","queue":"\u0071","name":"w\u006frk","priority":"normal","state":"dead","attempt":1,"max_attempts":1,"created_at_ms":1000,"updated_at_ms":2000,"finished_at_ms":2000,"last_error":{"class":"b\u006fom","message":"m"}}"#;
        let store = env.store().await;
        let kv = env.js.get_key_value("AX_TASKS").await.unwrap();
        kv.create(id, record.into()).await.unwrap();
        // The protocol's own reader takes it.
        let (rec, _) = store.get(id).await.unwrap().unwrap();
        assert_eq!((rec.queue.as_str(), rec.name.as_str()), ("q", "work"));
        let by = |q: TaskQuery| {
            let ax = env.ax.clone();
            async move {
                let r = ax
                    .find_tasks(&ListRequest {
                        query: q,
                        ..Default::default()
                    })
                    .await
                    .ok()?;
                (r.total == Some(1)).then_some(r)
            }
        };
        let found = eventually(Duration::from_secs(20), "the record by its queue", || {
            by(TaskQuery {
                queue: Some("q".into()),
                state: Some(TaskState::Dead),
                ..Default::default()
            })
        })
        .await;
        assert_eq!(found.tasks[0].id, id);
        assert_eq!(found.tasks[0].name, "work");
        let queues = env
            .ax
            .call(&ax_sdk::ops::TaskRequest::Queues {})
            .await
            .unwrap();
        let q = queues["queues"]
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["queue"] == "q")
            .cloned()
            .unwrap();
        assert_eq!(q["tasks"]["dead"], 1, "{q}");
    })
    .await
}
