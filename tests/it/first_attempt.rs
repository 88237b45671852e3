//! A first attempt on its message's first delivery runs without writing `running` first;
//! it writes it when the handler asks for its fencing token or after a second; a stale
//! one cannot record its result. Each test runs both kinds: an unrecorded task (an
//! immediate submit: the claim creates the record, every worker does this) and a recorded
//! one (its `pending` record made with its message, as a trigger fire's or a flow step's
//! is: the lean first attempt, opt-in).

use crate::support::Env;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{TaskSpec, TaskState};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, Semaphore};

/// Records (attempt, token) of every invocation; token 0 if it did not ask for one.
type Seen = Arc<Mutex<Vec<(u32, u64)>>>;

fn worker_with(seen: Seen, hold: Duration, fenced: bool) -> Worker {
    Worker::builder("q")
        .lean_first_attempt(true)
        .handler(move |task: Task| {
            let seen = seen.clone();
            async move {
                let token = match fenced {
                    true => task.fencing_token().await?,
                    false => 0,
                };
                seen.lock().unwrap().push((task.attempt, token));
                tokio::time::sleep(hold).await;
                Ok(())
            }
        })
        .build()
        .unwrap()
}

async fn states(env: &Env, id: &str) -> Vec<(TaskState, u64)> {
    env.ax
        .history(id)
        .await
        .unwrap()
        .into_iter()
        .map(|(r, rev)| (r.state, rev))
        .collect()
}

/// The states of a history, in order.
fn kinds(history: &[(TaskState, u64)]) -> Vec<TaskState> {
    history.iter().map(|(s, _)| *s).collect()
}

/// Submits an unrecorded task (`recorded` false) or a recorded one, and the states its
/// record starts with: none, or `pending`. A recorded one gets the `pending` record a
/// trigger fire writes beside its message (naming it by `ready_seq`), made here from the
/// stored message before any worker runs.
async fn submit(env: &Env, recorded: bool) -> (String, Vec<TaskState>) {
    let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
    if !recorded {
        return (id, vec![]);
    }
    let (meta, seq) = ax_core::unclaimed::find_ready(&env.js, &id)
        .await
        .unwrap()
        .expect("the message is stored");
    let tasks = ax_core::state::TaskStore::open(&env.js).await.unwrap();
    tasks
        .create(&ax_core::unclaimed::pending_record(&meta, seq))
        .await
        .unwrap();
    (id, vec![TaskState::Pending])
}

fn then(mut first: Vec<TaskState>, more: &[TaskState]) -> Vec<TaskState> {
    first.extend_from_slice(more);
    first
}

/// Waits for the task to succeed, stops the worker, returns the task's history.
async fn finish(
    env: &Env,
    id: &str,
    stop: tokio_util::sync::CancellationToken,
    handle: tokio::task::JoinHandle<()>,
) -> Vec<(TaskState, u64)> {
    env.wait_state(id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    stop.cancel();
    handle.await.unwrap();
    states(env, id).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quick_first_attempt_writes_its_outcome_only() {
    let env = Env::start(Env::server().ack_wait(Duration::from_secs(30))).await;
    for recorded in [false, true] {
        let (id, first) = submit(&env, recorded).await;
        let seen: Seen = Arc::default();
        let (stop, handle) = env.spawn_worker(worker_with(seen.clone(), Duration::ZERO, false));
        let rec = env
            .wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        stop.cancel();
        handle.await.unwrap();
        let history = states(&env, &id).await;
        assert_eq!(kinds(&history), then(first, &[TaskState::Succeeded]));
        assert_eq!(*seen.lock().unwrap(), [(1, 0)]);
        assert_eq!(rec.attempt, 1);
        assert!(rec.worker.is_some() && rec.started_at_ms.is_some());
    }
}

/// Asking for the fencing token writes `running` first: the token is that revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_for_the_token_writes_running_first() {
    let env = Env::start(Env::server().ack_wait(Duration::from_secs(30))).await;
    for recorded in [false, true] {
        let (id, first) = submit(&env, recorded).await;
        let running_at = first.len();
        let seen: Seen = Arc::default();
        let (stop, handle) = env.spawn_worker(worker_with(seen.clone(), Duration::ZERO, true));
        let history = finish(&env, &id, stop, handle).await;
        assert_eq!(
            kinds(&history),
            then(first, &[TaskState::Running, TaskState::Succeeded])
        );
        assert_eq!(*seen.lock().unwrap(), [(1, history[running_at].1)]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_attempt_longer_than_a_second_is_visible_as_running() {
    let env = Env::start(Env::server().ack_wait(Duration::from_secs(30))).await;
    for recorded in [false, true] {
        let (id, first) = submit(&env, recorded).await;
        let seen: Seen = Arc::default();
        let (stop, handle) = env.spawn_worker(worker_with(
            seen.clone(),
            Duration::from_millis(2500),
            false,
        ));
        let running = env
            .wait_state(&id, TaskState::Running, Duration::from_secs(5))
            .await;
        assert_eq!(running.attempt, 1);
        let started = running.started_at_ms.unwrap();
        assert!(
            running.updated_at_ms >= started + 900 && running.updated_at_ms <= started + 2000,
            "running written about a second after the start ({} ms)",
            running.updated_at_ms - started
        );
        let history = finish(&env, &id, stop, handle).await;
        assert_eq!(
            kinds(&history),
            then(first, &[TaskState::Running, TaskState::Succeeded])
        );
        assert_eq!(*seen.lock().unwrap(), [(1, 0)]);
    }
}

/// Another attempt takes the task over while a first attempt runs unwritten: the first
/// one's `running` write and its result are refused, and it does not ack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_first_attempt_cannot_record_its_result() {
    for recorded in [false, true] {
        stale_first_attempt(recorded).await;
    }
}

async fn stale_first_attempt(recorded: bool) {
    let env = Env::start(Env::server().ack_wait(Duration::from_secs(30))).await;
    let (id, _) = submit(&env, recorded).await;
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let release = Arc::new(Semaphore::new(0));
    let worker = Worker::builder("q")
        .lean_first_attempt(true)
        .handler({
            let release = release.clone();
            move |task: Task| {
                let (started_tx, release) = (started_tx.clone(), release.clone());
                async move {
                    started_tx.send(Ok(task.attempt.into())).unwrap();
                    let _ = release.acquire().await;
                    // Overtaken: no token is handed out.
                    started_tx.send(task.fencing_token().await).unwrap();
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    assert_eq!(started.recv().await.unwrap(), Ok(1));
    // The takeover: an attempt elsewhere claims the record (as a redelivery would); an
    // unrecorded task is found by its message, at revision 0 (a create).
    let store = env.store().await;
    let (rec, rev) = store.find(&id).await.unwrap().unwrap();
    assert_eq!(rec.state, TaskState::Pending);
    assert_eq!(rev == 0, !recorded, "recorded at submit only with a key");
    let mut other = rec.transition(TaskState::Running);
    other.attempt = 1;
    other.worker = Some("other".into());
    let other_token = store.cas(&other, rev).await.unwrap();
    // Past the first attempt's running write (1 s), then let it finish.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    release.add_permits(1);
    let refused = started.recv().await.unwrap().unwrap_err();
    assert_eq!(refused.class, "overtaken");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let (now, now_rev) = store.get(&id).await.unwrap().unwrap();
    assert_eq!(now_rev, other_token, "nothing written over the takeover");
    assert_eq!(now.worker.as_deref(), Some("other"));
    assert_eq!(now.state, TaskState::Running);
    // Not acked: the message is still held by the consumer.
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = env
        .js
        .get_consumer_from_stream(
            &ax_core::names::consumer_name("q", ax_sdk::Priority::Normal),
            "AX_READY_NORMAL",
        )
        .await
        .unwrap();
    assert_eq!(consumer.info().await.unwrap().num_ack_pending, 1);
    stop.cancel();
    handle.await.unwrap();
}
