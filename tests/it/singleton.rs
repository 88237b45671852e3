//! Singleton keys (`TaskSpec::singleton`): at most one task of a key waits or runs; a
//! colliding submit is refused naming the holder (`cancel_new`) or cancels it
//! (`cancel_in_progress`, its handler stopped); racing submits leave one holder; a server
//! aborted between a key's claim and its task's store blocks the key for its grace only.

use crate::procs::{wait_ready, AxProc};
use crate::support::{eventually, Env};
use ax_core::protocol::ErrorCode;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{Client, ClientError, Collision, TaskSpec, TaskState};
use ax_testkit::LocalNats;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Handler starts and ends per task id.
#[derive(Default)]
pub(crate) struct Runs {
    pub(crate) started: HashMap<String, u32>,
    pub(crate) finished: HashMap<String, u32>,
}

/// A worker on `q` whose handler takes `work` (long enough to be cancelled while running).
pub(crate) fn worker(runs: Arc<Mutex<Runs>>, work: Duration) -> Worker {
    Worker::builder("q")
        .concurrency(8)
        .handler(move |task: Task| {
            let runs = runs.clone();
            async move {
                *runs
                    .lock()
                    .unwrap()
                    .started
                    .entry(task.id.clone())
                    .or_default() += 1;
                tokio::time::sleep(work).await;
                *runs.lock().unwrap().finished.entry(task.id).or_default() += 1;
                Ok(())
            }
        })
        .build()
        .unwrap()
}

fn spec(key: &str, on: Collision) -> TaskSpec {
    TaskSpec::new("t").singleton(key, on)
}

/// The holder a `cancel_new` refusal names.
fn holder(e: ClientError) -> String {
    match e {
        ClientError::Refused(w) if w.code == ErrorCode::Running => {
            w.task_id.expect("a running refusal names the holder")
        }
        other => panic!("not a running refusal: {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_new_refuses_while_the_key_is_held_and_accepts_once_its_task_ended() {
    let env = Env::start(Env::server()).await;
    let ax = &env.ax;
    let first = ax
        .submit("q", spec("k", Collision::CancelNew))
        .await
        .unwrap();
    for _ in 0..3 {
        let refused = ax.submit("q", spec("k", Collision::CancelNew)).await;
        assert_eq!(
            holder(refused.unwrap_err()),
            first.id,
            "names the waiting holder"
        );
    }
    // Another key, and a retry of a keyed submit (its idempotency key), are not refused.
    ax.submit("q", spec("other", Collision::CancelNew))
        .await
        .unwrap();
    let keyed = || spec("keyed", Collision::CancelNew).idempotency_key("order-1");
    let a = ax.submit("q", keyed()).await.unwrap();
    let b = ax.submit("q", keyed()).await.unwrap();
    assert!(b.duplicate && b.id == a.id, "{a:?} {b:?}");
    // A delayed holder holds too.
    let later = spec("later", Collision::CancelNew).delay(Duration::from_secs(3600));
    let held = ax.submit("q", later.clone()).await.unwrap();
    assert_eq!(holder(ax.submit("q", later).await.unwrap_err()), held.id);

    let runs = Arc::new(Mutex::new(Runs::default()));
    let (stop, handle) = env.spawn_worker(worker(runs.clone(), Duration::from_millis(1)));
    env.wait_state(&first.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    // Its task ended: the key is free again.
    let next = ax
        .submit("q", spec("k", Collision::CancelNew))
        .await
        .unwrap();
    assert_ne!(next.id, first.id);
    env.wait_state(&next.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    stop.cancel();
    handle.await.unwrap();
    let runs = runs.lock().unwrap();
    assert_eq!(runs.started.get(&first.id), Some(&1));
    assert_eq!(runs.started.get(&next.id), Some(&1));
    assert_eq!(
        runs.started.len(),
        4,
        "k twice, other, keyed: nothing refused ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_in_progress_stops_the_running_holder_and_runs_the_new_task() {
    let env = Env::start(Env::server()).await;
    let runs = Arc::new(Mutex::new(Runs::default()));
    let (stop, handle) = env.spawn_worker(worker(runs.clone(), Duration::from_secs(30)));
    let on = Collision::CancelInProgress;
    let first = env.ax.submit("q", spec("sync", on)).await.unwrap();
    eventually(
        Duration::from_secs(10),
        "the first handler to start",
        || async {
            runs.lock()
                .unwrap()
                .started
                .contains_key(&first.id)
                .then_some(())
        },
    )
    .await;
    let second = env.ax.submit("q", spec("sync", on)).await.unwrap();
    // Answered once the holder is cancelled: its record says so already.
    let rec = env.record(&first.id).await;
    assert_eq!(rec.state, TaskState::Cancelled, "{rec:?}");
    assert_eq!(rec.last_error.map(|e| e.class), Some("cancelled".into()));
    eventually(
        Duration::from_secs(10),
        "the second handler to start",
        || async {
            runs.lock()
                .unwrap()
                .started
                .contains_key(&second.id)
                .then_some(())
        },
    )
    .await;
    // And the second, running, by a third.
    let third = env.ax.submit("q", spec("sync", on)).await.unwrap();
    assert_eq!(env.record(&second.id).await.state, TaskState::Cancelled);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop.cancel();
    handle.await.unwrap();
    let runs = runs.lock().unwrap();
    for id in [&first.id, &second.id] {
        assert_eq!(runs.started.get(id), Some(&1), "started once: {id}");
        assert_eq!(runs.finished.get(id), None, "handler stopped: {id}");
    }
    assert_eq!(runs.started.get(&third.id), Some(&1));
}

/// Twenty submits of one key at once: one is accepted, every other is refused naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_submits_leave_one_holder() {
    let env = Env::start(Env::server()).await;
    for round in 0..3 {
        let key = format!("race{round}");
        let submits = (0..20).map(|_| env.ax.submit("q", spec(&key, Collision::CancelNew)));
        let results = futures::future::join_all(submits).await;
        let accepted: Vec<String> = results
            .iter()
            .filter_map(|r| r.as_ref().ok().map(|a| a.id.clone()))
            .collect();
        assert_eq!(accepted.len(), 1, "round {round}: {results:?}");
        for r in results.into_iter().filter(|r| r.is_err()) {
            assert_eq!(holder(r.unwrap_err()), accepted[0]);
        }
    }
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, 3);
}

/// A server aborted by the fault `hook` during a first submit of key `k`, and the server
/// started after it: the submit's answer (it never comes: the client gives up after its
/// request timeout), when the abort was seen, and the pieces to go on with.
struct Aborted {
    _nats: LocalNats,
    _next: AxProc,
    client: async_nats::Client,
    ax: Client,
    lost: tokio::task::JoinHandle<Result<ax_sdk::SubmitAccepted, ClientError>>,
    at: Instant,
}

async fn abort_first_submit(hook: &str) -> Aborted {
    abort_submit(hook, spec("k", Collision::CancelNew)).await
}

async fn abort_submit(hook: &str, first: TaskSpec) -> Aborted {
    let nats = LocalNats::start().unwrap();
    let url = nats.url();
    let args = ["server", "--queue", "q"];
    let mut aborting = AxProc::spawn_env(&url, &args, &[(hook, "1")]);
    let client = async_nats::connect(&url).await.unwrap();
    wait_ready(&client).await;
    let ax = Client::new(client.clone());
    let lost = tokio::spawn({
        let ax = ax.clone();
        async move { ax.submit("q", first).await }
    });
    let aborted = aborting.exited_within(Duration::from_secs(10)).await;
    assert!(
        aborted.is_some_and(|s| !s.success()),
        "the hook never fired"
    );
    let at = Instant::now();
    let next = AxProc::spawn(&url, &args);
    wait_ready(&client).await;
    Aborted {
        _nats: nats,
        _next: next,
        client,
        ax,
        lost,
        at,
    }
}

async fn ready_messages(client: &async_nats::Client) -> u64 {
    let js = async_nats::jetstream::new(client.clone());
    let mut ready = js.get_stream("AX_READY_NORMAL").await.unwrap();
    ready.info().await.unwrap().state.messages
}

/// A server aborted after claiming a key and before storing its task: the key names a
/// task that does not exist. A submit within the grace is refused (the first might still
/// be storing it); after the grace it takes the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_claimed_by_an_aborted_submit_frees_itself_after_its_grace() {
    // Bound whole: the nats-server and the next server live as long as it.
    let aborted = abort_first_submit("AX_TEST_ABORT_AFTER_CLAIM").await;
    let (client, ax, at) = (&aborted.client, &aborted.ax, aborted.at);
    let refused = ax.submit("q", spec("k", Collision::CancelNew)).await;
    let named = holder(refused.unwrap_err());
    assert!(named.starts_with("q."), "{named}");
    let accepted = eventually(Duration::from_secs(30), "the key freed", || async {
        ax.submit("q", spec("k", Collision::CancelNew)).await.ok()
    })
    .await;
    assert!(
        at.elapsed() >= ax_core::singleton::GRACE - Duration::from_secs(1),
        "freed after {:?}",
        at.elapsed()
    );
    assert_ne!(accepted.id, named);
    assert!(
        aborted.lost.await.unwrap().is_err(),
        "the aborted server answered"
    );
    assert_eq!(ready_messages(client).await, 1, "one task stored");
}

/// A retry of a submit whose first attempt claimed the key and died before storing its
/// task (the same idempotency key) takes the key at once instead of being refused for the
/// grace naming its own lost attempt; another submit is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_takes_over_the_key_its_own_lost_attempt_claimed() {
    let keyed = || spec("k", Collision::CancelNew).idempotency_key("order-7");
    let aborted = abort_submit("AX_TEST_ABORT_AFTER_CLAIM", keyed()).await;
    let (client, ax, at) = (&aborted.client, &aborted.ax, aborted.at);
    let other = spec("k", Collision::CancelNew).idempotency_key("order-8");
    let lost = holder(ax.submit("q", other.clone()).await.unwrap_err());
    let retried = ax.submit("q", keyed()).await.unwrap();
    assert!(
        at.elapsed() < ax_core::singleton::GRACE / 2,
        "taken at once, not after the grace: {:?}",
        at.elapsed()
    );
    assert_ne!(retried.id, lost, "a new task, not the lost attempt's id");
    assert!(!retried.duplicate);
    // The retry holds the key now: another submit is refused naming it, and a second
    // retry answers it as a duplicate.
    assert_eq!(holder(ax.submit("q", other).await.unwrap_err()), retried.id);
    let again = ax.submit("q", keyed()).await.unwrap();
    assert!(again.duplicate && again.id == retried.id, "{again:?}");
    assert!(
        aborted.lost.await.unwrap().is_err(),
        "the aborted server answered"
    );
    assert_eq!(ready_messages(client).await, 1, "one task stored");
}

/// The CLI: `ax submit --singleton` (default `cancel_new`) refuses a second submit naming
/// the holder; `--on-collision cancel_in_progress` takes the key over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_submits_with_a_singleton_key() {
    let env = Env::start(Env::server()).await;
    let submit = |extra: &'static [&'static str]| {
        let env = &env;
        async move {
            let mut args = vec!["submit", "--queue", "q", "--name", "t", "--singleton", "k"];
            args.extend_from_slice(extra);
            let out = crate::limits::ax_cli(env, &args).await;
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).to_string(),
                String::from_utf8_lossy(&out.stderr).to_string(),
            )
        }
    };
    let (ok, out, err) = submit(&[]).await;
    assert!(ok, "{err}");
    let first: serde_json::Value = serde_json::from_str(&out).unwrap();
    let first = first["id"].as_str().unwrap().to_string();
    let (ok, _, err) = submit(&[]).await;
    assert!(!ok && err.contains(&first), "{err}");
    let (ok, _, err) = submit(&["--on-collision", "cancel_in_progress"]).await;
    assert!(ok, "{err}");
    assert_eq!(env.record(&first).await.state, TaskState::Cancelled);
    let (ok, _, err) = submit(&["--on-collision", "queue"]).await;
    assert!(!ok && err.contains("cancel_new"), "{err}");
}

/// A server aborted between a singleton task's message and its record: the key names a
/// task with no record, but its message is stored and will run. After the grace the key
/// is still held: the holder is found by its message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_stored_without_its_record_still_holds_after_the_grace() {
    // Bound whole: the nats-server and the next server live as long as it.
    let aborted = abort_first_submit("AX_TEST_ABORT_AFTER_PUBLISH").await;
    let (client, ax, at) = (&aborted.client, &aborted.ax, aborted.at);
    assert_eq!(ready_messages(client).await, 1, "its message is stored");
    let past_grace = ax_core::singleton::GRACE + Duration::from_secs(1);
    tokio::time::sleep(past_grace.saturating_sub(at.elapsed())).await;
    let named = holder(
        ax.submit("q", spec("k", Collision::CancelNew))
            .await
            .unwrap_err(),
    );
    assert!(
        aborted.lost.await.unwrap().is_err(),
        "the aborted server answered"
    );
    let found = ax.task(&named).await.unwrap();
    assert_eq!(found.map(|(r, _)| r.state), Some(TaskState::Pending));
}
