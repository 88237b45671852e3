//! Debounced submits (docs/PROTOCOL.md §2, "Debounce"): a burst of one key runs once,
//! after the key is quiet, with the last (or first) payload; windows survive a server
//! stopped or aborted between its two writes; racing submits lose no payload.

use crate::procs::{wait_ready, AxProc};
use crate::support::{eventually, Env};
use ax_core::protocol::ErrorCode;
use ax_core::time::now_ms;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, ClientError, TaskSpec, TaskState};
use ax_testkit::LocalNats;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Attempt starts: (task id, payload `n`, start ms).
type Runs = Arc<Mutex<Vec<(String, u64, u64)>>>;

fn recording_worker(runs: Runs) -> Worker {
    Worker::builder("q")
        .concurrency(16)
        .handler(move |task: Task| {
            let runs = runs.clone();
            async move {
                let n = task.json::<serde_json::Value>()?["n"].as_u64().unwrap_or(0);
                runs.lock().unwrap().push((task.id, n, now_ms()));
                Ok(())
            }
        })
        .build()
        .unwrap()
}

fn spec(key: &str, period_ms: u64, n: u64) -> TaskSpec {
    TaskSpec::new("sync")
        .json(&serde_json::json!({ "n": n }))
        .debounce(key, Duration::from_millis(period_ms))
}

/// Starts of each task id.
fn starts(runs: &Runs) -> HashMap<String, Vec<(u64, u64)>> {
    let mut by_id: HashMap<String, Vec<(u64, u64)>> = HashMap::new();
    for (id, n, at) in runs.lock().unwrap().iter() {
        by_id.entry(id.clone()).or_default().push((*n, *at));
    }
    by_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_one_key_runs_once_after_it_is_quiet_with_the_last_payload() {
    let env = Env::start(Env::server()).await;
    let runs: Runs = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(runs.clone()));
    let mut ids = Vec::new();
    let mut last_sent = 0;
    for n in 1..=12 {
        last_sent = now_ms();
        ids.push(env.ax.submit("q", spec("user:7", 400, n)).await.unwrap());
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let other = env.ax.submit("q", spec("user:8", 400, 100)).await.unwrap();
    let id = ids[0].id.clone();
    assert!(ids
        .iter()
        .all(|a| a.id == id && a.state == TaskState::Scheduled));
    assert_ne!(other.id, id, "another key is another window");
    assert!(
        runs.lock().unwrap().is_empty(),
        "nothing ran while the key was busy"
    );
    // While it waits, the task is found: scheduled, due after the last submit.
    let (rec, _) = env
        .ax
        .task(&id)
        .await
        .unwrap()
        .expect("a waiting debounced task");
    assert_eq!(rec.state, TaskState::Scheduled);
    assert!(rec.run_at_ms.unwrap() >= last_sent + 400);
    env.wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    env.wait_state(&other.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    let by_id = starts(&runs);
    assert_eq!(by_id[&id].len(), 1, "the burst ran once: {by_id:?}");
    let (n, at) = by_id[&id][0];
    assert_eq!(n, 12, "with the last submit's payload");
    assert!(
        at >= last_sent + 400,
        "started {at}, quiet from {last_sent}"
    );
    assert_eq!(by_id[&other.id], [(100, by_id[&other.id][0].1)]);
    // Quiet: the next submit opens a new window, under a new id.
    let again = env.ax.submit("q", spec("user:7", 100, 13)).await.unwrap();
    assert_ne!(again.id, id);
    env.wait_state(&again.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    assert_eq!(starts(&runs)[&again.id].len(), 1);
    eventually(Duration::from_secs(5), "AX_DELAYED emptied", || async {
        (env.stream_len("AX_DELAYED").await == 0).then_some(())
    })
    .await;
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_never_quiet_runs_by_max_wait_with_the_first_payload_of_each_window() {
    let env = Env::start(Env::server()).await;
    let runs: Runs = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(runs.clone()));
    // A submit every 50 ms for 2 s, quiet period 300 ms: only max_wait (600 ms) ends a
    // window while the burst lasts.
    let mut answered: Vec<(String, u64, u64)> = Vec::new(); // id, n, sent
    for n in 0..40 {
        let sent = now_ms();
        let spec = spec("hot", 300, n)
            .debounce_max_wait(Duration::from_millis(600))
            .debounce_keep_first();
        answered.push((env.ax.submit("q", spec).await.unwrap().id, n, sent));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut windows: Vec<String> = answered.iter().map(|a| a.0.clone()).collect();
    windows.dedup();
    assert!(
        (3..=6).contains(&windows.len()),
        "a 2 s burst with max_wait 600 ms is 3-6 windows: {}",
        windows.len()
    );
    for id in &windows {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
    }
    let by_id = starts(&runs);
    for id in &windows {
        let mine: Vec<&(String, u64, u64)> = answered.iter().filter(|a| &a.0 == id).collect();
        let (first_n, first_sent) = (mine[0].1, mine[0].2);
        assert_eq!(by_id[id].len(), 1, "window {id} ran once");
        let (n, at) = by_id[id][0];
        assert_eq!(n, first_n, "window {id} ran with its first payload");
        assert!(
            at <= first_sent + 600 + 1_500,
            "window {id} started {} ms after its first submit",
            at - first_sent
        );
    }
    stop.cancel();
    handle.await.unwrap();
}

/// Submits of a few keys racing each other and the dispatcher's closes (a period shorter
/// than the pace of submits): each window runs once, and with the last payload a submit
/// was answered for it — a close that did not expect the window's sequence would run a
/// window whose later submit was answered but never ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_submits_lose_no_payload_and_run_each_window_once() {
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
                let a = ax.submit("q", spec(&key, 30, n)).await.unwrap();
                answered.lock().unwrap().push((a.id, n));
                tokio::time::sleep(Duration::from_millis(7 * (1 + (i + p) % 5))).await;
            }
        }));
    }
    for p in producers {
        p.await.unwrap();
    }
    let answered = answered.lock().unwrap().clone();
    let mut last: HashMap<String, u64> = HashMap::new();
    for (id, n) in &answered {
        let e = last.entry(id.clone()).or_default();
        *e = (*e).max(*n);
    }
    for id in last.keys() {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(15))
            .await;
    }
    let by_id = starts(&runs);
    let mut short = Vec::new();
    for id in last.keys() {
        let ran = &by_id[id];
        assert_eq!(ran.len(), 1, "window {id} ran {} times", ran.len());
        // Submits of one window serialize on the broker, and each producer's follow one
        // another: the payload that ran is the last stored, so no later submit of its
        // producer was answered with this window's id.
        let ran_n = ran[0].0;
        let of_producer = answered
            .iter()
            .filter(|a| &a.0 == id && a.1 % 8 == ran_n % 8)
            .map(|a| a.1)
            .max();
        if of_producer != Some(ran_n) {
            short.push(format!(
                "{id}: ran {ran_n}, its producer's last: {of_producer:?}"
            ));
        }
    }
    assert!(short.is_empty(), "{short:?}");
    assert!(last.len() >= 4, "the race made {} windows", last.len());
    println!(
        "racing debounce: {} submits, {} windows, {} runs",
        answered.len(),
        last.len(),
        runs.lock().unwrap().len()
    );
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debounce_is_refused_with_a_due_time_a_key_or_in_a_batch() {
    let env = Env::start(Env::server()).await;
    let field = |r: Result<_, ClientError>| match r {
        Err(ClientError::Refused(e)) => (e.code, e.field),
        other => panic!("accepted: {other:?}"),
    };
    let delayed = spec("k", 100, 1).delay(Duration::from_secs(1));
    let keyed = spec("k", 100, 1).idempotency_key("x");
    let bad_key = spec("a b", 100, 1);
    let bad_period = spec("k", 0, 1);
    for (s, want) in [
        (delayed, "debounce"),
        (keyed, "debounce"),
        (bad_key, "debounce.key"),
        (bad_period, "debounce.period_ms"),
    ] {
        let (code, f) = field(env.ax.submit("q", s).await);
        assert_eq!((code, f.as_deref()), (ErrorCode::InvalidField, Some(want)));
    }
    let batch = env.ax.submit_many("q", [spec("k", 100, 1)]).await;
    let err = batch[0]
        .as_ref()
        .expect_err("a batch's task is not debounced");
    assert_eq!(err.field.as_deref(), Some("debounce"));
    assert_eq!(env.stream_len("AX_DELAYED").await, 0, "nothing stored");
}

/// A server killed mid-window, then one aborted between a window's fired copy and the
/// delete of the window (`AX_TEST_ABORT_AFTER_CLOSE`): the next server dispatches the copy
/// once, drops the stale window, and the burst runs once with its last payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_survives_a_killed_server_and_one_aborted_mid_close() {
    let nats = LocalNats::start().unwrap();
    let url = nats.url();
    let args = ["server", "--queue", "q"];
    let mut server = AxProc::spawn(&url, &args);
    let client = async_nats::connect(&url).await.unwrap();
    wait_ready(&client).await;
    let ax = Client::new(client.clone());
    let mut ids = Vec::new();
    for n in 1..=3 {
        ids.push(ax.submit("q", spec("order-1", 1500, n)).await.unwrap().id);
    }
    server.kill9();
    let mut aborting = AxProc::spawn_env(&url, &args, &[("AX_TEST_ABORT_AFTER_CLOSE", "1")]);
    wait_ready(&client).await;
    for n in 4..=5 {
        ids.push(ax.submit("q", spec("order-1", 1500, n)).await.unwrap().id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "one window across the kill: {ids:?}");
    let aborted = aborting.exited_within(Duration::from_secs(20)).await;
    assert!(
        aborted.is_some_and(|s| !s.success()),
        "the hook never fired"
    );
    let runs: Runs = Arc::default();
    let stop = CancellationToken::new();
    let worker = tokio::spawn(recording_worker(runs.clone()).run(client.clone(), stop.clone()));
    let _next = AxProc::spawn(&url, &args);
    let js = async_nats::jetstream::new(client.clone());
    eventually(Duration::from_secs(20), "the burst ran", || async {
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
    assert_eq!((runs[0].0.as_str(), runs[0].1), (ids[0].as_str(), 5));
    stop.cancel();
    worker.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_debounces_under_a_key_and_refuses_a_period_alone() {
    let env = Env::start(Env::server()).await;
    let submit = |n: &str| {
        let json = format!("{{\"n\": {n}}}");
        let env = &env;
        async move {
            let out = crate::limits::ax_cli(
                env,
                &[
                    "submit",
                    "--queue",
                    "q",
                    "--name",
                    "sync",
                    "--json",
                    &json,
                    "--debounce-key",
                    "cli:1",
                    "--debounce",
                    "5s",
                ],
            )
            .await;
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            v["id"].as_str().unwrap().to_string()
        }
    };
    let (a, b) = (submit("1").await, submit("2").await);
    assert_eq!(a, b, "one window");
    let (rec, _) = env.ax.task(&a).await.unwrap().expect("waiting");
    assert_eq!(rec.state, TaskState::Scheduled);
    let alone = crate::limits::ax_cli(&env, &["submit", "--name", "x", "--debounce", "5s"]).await;
    assert!(!alone.status.success(), "--debounce needs --debounce-key");
}

/// A closed window whose message's delete was lost leaves that message, open, under the
/// key's subject, older than the window's fired copy. Dispatching the copy purges the
/// subject up to it: the key's next submit opens a new window and runs, rather than join
/// the old message's window, which already ran (its payload would be lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_whose_delete_was_lost_is_not_joined_after_it_ran() {
    let faults = ax_core::faults::Faults::armed();
    faults.lose_window_deletes();
    let env = Env::start(Env::server().faults(faults)).await;
    let runs: Runs = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(runs.clone()));
    let first = env.ax.submit("q", spec("k", 200, 1)).await.unwrap();
    env.wait_state(&first.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    for n in 2..=3 {
        let next = env.ax.submit("q", spec("k", 200, n)).await.unwrap();
        assert_ne!(next.id, first.id, "submit {n} joined the window that ran");
        env.wait_state(&next.id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
    }
    stop.cancel();
    handle.await.unwrap();
    let mut ran: Vec<u64> = runs.lock().unwrap().iter().map(|(_, n, _)| *n).collect();
    ran.sort();
    assert_eq!(
        ran,
        vec![1, 2, 3],
        "every window ran once, with its payload"
    );
}

/// Two fired copies of one key's windows wait in `AX_DELAYED` at once (a ready subject
/// refused the older for now, e.g. during a node restart), and the newer is dispatched
/// first. Its dispatch must not remove the older copy with the stale messages below it
/// (found by the R3 campaign seed 4955772603497125947: a window of key `d5-1`, parked,
/// was purged by the next window's dispatch and never ran). Stood in for here by the
/// older copy due 1.5 s after the newer one, both written while no server runs, and a
/// horizon short enough that the older one's body is read back when it is due (as a
/// parked task's is).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatching_a_newer_window_keeps_an_older_fired_one_that_waits() {
    let mut env = Env::start(Env::server()).await;
    env.stop_server().await;
    let stored = |n: u64, due: u64| {
        let req = ax_core::protocol::SubmitRequest {
            name: "sync".into(),
            payload: Some(serde_json::json!({ "n": n })),
            ..Default::default()
        };
        let limits = ax_core::task::Limits::default();
        let (mut meta, body) = ax_core::task::TaskMeta::from_request("q", req, &limits).unwrap();
        meta.id = format!("q.=d.6b.window{n}");
        meta.run_at_ms = Some(due);
        meta.unrecorded = true;
        let mut headers = meta.to_headers();
        headers.insert(ax_core::debounce::FIRED, "1");
        let subject = ax_core::debounce::window_subject_of(&meta.id).unwrap();
        (subject, headers, body)
    };
    let now = now_ms();
    for (n, due) in [(1, now + 1_500), (2, now)] {
        let (subject, headers, body) = stored(n, due);
        env.js
            .publish_with_headers(subject, headers, body)
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let horizon = Duration::from_millis(300);
    env.start_server(Env::server().dispatch_horizon(horizon))
        .await;
    let runs: Runs = Arc::default();
    let (stop, handle) = env.spawn_worker(recording_worker(runs.clone()));
    for n in 1..=2 {
        let id = format!("q.=d.6b.window{n}");
        env.wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
    }
    stop.cancel();
    handle.await.unwrap();
    let mut ran: Vec<u64> = runs.lock().unwrap().iter().map(|(_, n, _)| *n).collect();
    ran.sort();
    assert_eq!(ran, vec![1, 2], "both windows ran, once each");
}
