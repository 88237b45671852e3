//! A write or publish the broker stored but never answered (it died first) is sent again
//! when the client connects anew, and taken as done once: `typed_kv::put_again` (a lease
//! renewal, a trigger's state) and a task's publish (`admit::publish_headers`, as
//! `publish_task`). The broker's answers are lost by `AnswerDropper`, a proxy that drops
//! what the server sends, then cuts the connection so the client connects again.

use async_nats::jetstream::{self, kv, stream};
use ax_core::typed_kv::{get, put, put_again, KvError};
use ax_testkit::env::eventually;
use ax_testkit::proxy::AnswerDropper;
use ax_testkit::LocalNats;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::time::timeout;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Thing {
    n: u32,
}

/// Less than the JetStream request timeout (5 s): an answer within it came of the write
/// sent again, not of the first one timing out.
const AFTER_RECONNECT: Duration = Duration::from_secs(4);

/// A client connected to `nats` through a proxy that can drop the server's answers.
async fn through(nats: &LocalNats) -> (AnswerDropper, async_nats::Client) {
    let upstream = nats.url().trim_start_matches("nats://").to_string();
    let proxy = AnswerDropper::start(&upstream).await.unwrap();
    let client = async_nats::ConnectOptions::new()
        .reconnect_delay_callback(|_| Duration::from_millis(50))
        .connect(proxy.url())
        .await
        .unwrap();
    (proxy, client)
}

/// Drops the broker's answers, starts `write`, and waits until `stored` finds what the
/// broker stored of it.
async fn mute_until_stored<T, S, Fut>(
    proxy: &AnswerDropper,
    write: impl std::future::Future<Output = T> + Send + 'static,
    stored: impl FnMut() -> Fut,
) -> (tokio::task::JoinHandle<T>, S)
where
    T: Send + 'static,
    Fut: std::future::Future<Output = Option<S>>,
{
    proxy.mute();
    let write = tokio::spawn(write);
    let found = eventually(Duration::from_secs(5), "the write stored", stored).await;
    (write, found)
}

/// Cuts the connection and takes `write`'s answer, which must come of its sending again
/// (within [`AFTER_RECONNECT`]), not of its first sending timing out.
async fn answer_after_cut<T>(proxy: &AnswerDropper, write: tokio::task::JoinHandle<T>) -> T {
    proxy.cut();
    timeout(AFTER_RECONNECT, write)
        .await
        .expect("answered once sent again, not at the request timeout")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compare_and_set_stored_but_unanswered_is_taken_as_written_once_sent_again() {
    let nats = LocalNats::start().unwrap();
    let direct = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let store = direct
        .create_key_value(kv::Config {
            bucket: "AGAIN".into(),
            history: 5,
            ..Default::default()
        })
        .await
        .unwrap();
    let r1 = put(&store, "k", &Thing { n: 1 }, None).await.unwrap();
    let (proxy, client) = through(&nats).await;
    let via = jetstream::new(client.clone())
        .get_key_value("AGAIN")
        .await
        .unwrap();

    // Stored, its answer dropped; then the connection is cut.
    let (write, stored) = mute_until_stored(
        &proxy,
        {
            let (client, via) = (client.clone(), via.clone());
            async move { put_again(&client, &via, "k", &Thing { n: 2 }, Some(r1)).await }
        },
        || async {
            let e = store.entry("k").await.unwrap()?;
            (e.revision > r1).then_some(e.revision)
        },
    )
    .await;
    let answered = answer_after_cut(&proxy, write).await;
    assert_eq!(
        answered.unwrap(),
        stored,
        "taken as written, at the revision its first sending was stored at"
    );
    assert_eq!(
        get(&store, "k").await.unwrap(),
        Some((Thing { n: 2 }, stored))
    );

    // Stored, then changed by another writer before the answer: a lost race still.
    let (write, mine) = mute_until_stored(
        &proxy,
        {
            let (client, via) = (client.clone(), via.clone());
            async move { put_again(&client, &via, "k", &Thing { n: 3 }, Some(stored)).await }
        },
        || async {
            let e = store.entry("k").await.unwrap()?;
            (e.revision > stored).then_some(e.revision)
        },
    )
    .await;
    put(&store, "k", &Thing { n: 4 }, Some(mine)).await.unwrap();
    let answered = answer_after_cut(&proxy, write).await;
    assert!(
        matches!(answered, Err(KvError::Stale(_))),
        "another writer's value is not ours: {answered:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_publish_stored_but_unanswered_is_sent_again_and_stored_once() {
    let nats = LocalNats::start().unwrap();
    let direct = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let tasks = direct
        .create_stream(stream::Config {
            name: "AGAIN".into(),
            subjects: vec!["again.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let (proxy, client) = through(&nats).await;
    let via = jetstream::new(client);

    proxy.mute();
    let publish = tokio::spawn(async move {
        ax_core::admit::publish_headers(
            &via,
            "again.q".into(),
            async_nats::HeaderMap::new(),
            "task-1",
            "payload".into(),
        )
        .await
    });
    let messages = || async { tasks.clone().info().await.unwrap().state.messages };
    eventually(Duration::from_secs(5), "the publish stored", || async {
        (messages().await == 1).then_some(())
    })
    .await;
    proxy.cut();
    let ack = timeout(AFTER_RECONNECT, publish)
        .await
        .expect("acknowledged once sent again, not at the ack timeout")
        .unwrap()
        .unwrap();
    assert_eq!(ack.sequence, 1, "the message stored the first time");
    assert!(ack.duplicate, "the second sending was a duplicate");
    assert_eq!(messages().await, 1, "stored once");
}

/// A worker's writes of a record (`TaskStore::cas`: its `running` write, its outcome), on
/// their own and group-committed: one the broker stored but never answered is taken as
/// written at the revision stored, not refused as overtaken by another attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_write_stored_but_unanswered_is_taken_as_written_once_sent_again() {
    use ax_core::atomic::GroupCommit;
    use ax_sdk::{TaskSpec, TaskState};
    let env = crate::support::Env::start(crate::support::Env::server()).await;
    let direct = env.store().await;
    for mode in [GroupCommit::Never, GroupCommit::Always] {
        let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
        let (rec, rev) = direct.find(&id).await.unwrap().unwrap();
        let (proxy, client) = through(&env.nats).await;
        let store = ax_core::state::TaskStore::open(&jetstream::new(client))
            .await
            .unwrap()
            .grouped(mode);
        let mut running = rec.transition(TaskState::Running);
        running.attempt = 1;
        running.worker = Some("w".into());
        proxy.mute();
        let write = tokio::spawn(async move { store.cas(&running, rev).await });
        let stored = eventually(Duration::from_secs(5), "the write stored", || async {
            let (r, at) = direct.get_latest(&id).await.unwrap()?;
            (r.state == TaskState::Running).then_some(at)
        })
        .await;
        proxy.cut();
        let answered = timeout(AFTER_RECONNECT, write)
            .await
            .unwrap_or_else(|_| panic!("{mode:?}: answered once sent again"))
            .unwrap();
        assert_eq!(
            answered.unwrap(),
            stored,
            "{mode:?}: taken as written, at the revision stored"
        );
    }
}

/// The broker's side of a publish sent again: the ready stream (a work queue) forgets the
/// id of a message its consumer removed once the broker restarts (its duplicate table is
/// rebuilt from the messages it still holds; nats-server #3272), so a task's publish sent
/// again after its first copy ran stores a second copy. The worker claims that copy
/// without running it (its record is finished; a running record names the first
/// message): the task runs once. These are the copies the fault campaign prints beside
/// its fire messages (docs/RELIABILITY.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_message_stored_again_after_a_broker_restart_is_not_run_again() {
    use ax_sdk::{TaskSpec, TaskState};
    let mut env = crate::support::Env::start(crate::support::Env::server()).await;
    let id = env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id;
    let ready = env.js.get_stream("AX_READY_NORMAL").await.unwrap();
    let first = ready
        .direct_get_last_for_subject("ax.ready.q.normal")
        .await
        .unwrap();
    let (worker, runs) = ax_testkit::env::counting_worker(4);
    let (stop, handle) = env.spawn_worker(worker);
    env.wait_state(&id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    eventually(
        Duration::from_secs(5),
        "the first copy acknowledged",
        || async { (env.stream_len("AX_READY_NORMAL").await == 0).then_some(()) },
    )
    .await;

    env.nats.restart().unwrap();
    let ack = eventually(
        Duration::from_secs(10),
        "the publish sent again",
        || async {
            ax_core::admit::publish_headers(
                &env.js,
                "ax.ready.q.normal".into(),
                first.headers.clone(),
                &id,
                first.payload.clone(),
            )
            .await
            .ok()
        },
    )
    .await;
    // Stored under a new sequence: the broker forgot the first copy's id. (An earlier try
    // of the loop above may have stored it and failed before its answer, on a loaded
    // machine just after the restart: then this one answers `duplicate` with the copy's
    // sequence. A broker that remembered the id would answer the first copy's.)
    assert!(
        ack.sequence > first.sequence,
        "the restarted broker stored the copy: {ack:?} (if it now answers the first copy's \
         sequence, nats-server remembers removed ids across restarts and the campaign's count \
         of stored fire messages can be exact again)"
    );
    eventually(Duration::from_secs(10), "the copy claimed", || async {
        (env.stream_len("AX_READY_NORMAL").await == 0).then_some(())
    })
    .await;
    stop.cancel();
    handle.await.unwrap();
    assert_eq!(runs.lock().unwrap().get(&id), Some(&1), "the task ran once");
    let rec = env.record(&id).await;
    assert_eq!((rec.state, rec.attempt), (TaskState::Succeeded, 1));
}

/// A flow run's writes (`FlowStore::put_run`, `put_step`: the engine's every transition)
/// are sent again the same way: one the broker stored but never answered is taken as
/// written at the revision stored, not waited out for the request timeout (red with a
/// single send: no answer within 4 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_run_write_stored_but_unanswered_is_taken_as_written_once_sent_again() {
    use ax_core::names::{FLOWS_BUCKET, FLOW_RUNS_BUCKET};
    use ax_sdk::flow::store::FlowStore;
    use ax_sdk::flow::{FlowDef, StepDef, StepRun, StepState};
    use ax_sdk::TaskSpec;
    let nats = LocalNats::start().unwrap();
    let direct = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    for bucket in [FLOWS_BUCKET, FLOW_RUNS_BUCKET] {
        direct
            .create_key_value(kv::Config {
                bucket: bucket.into(),
                history: 5,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let mine = FlowStore::open(&direct).await.unwrap();
    let def = FlowDef::new("f").step(StepDef::new("a", "q", TaskSpec::new("t")));
    let mut run: ax_sdk::flow::FlowRun = serde_json::from_value(serde_json::json!({
        "id": "r1", "flow": "f", "def": def, "state": "running",
        "created_at_ms": 1, "updated_at_ms": 1,
    }))
    .unwrap();
    let r1 = mine.put_run(&run, None).await.unwrap();
    let s1 = mine
        .put_step("r1", "a", &StepRun::default(), None)
        .await
        .unwrap();
    let (proxy, client) = through(&nats).await;
    let via = FlowStore::open(&jetstream::new(client)).await.unwrap();
    let latest = |key: &'static str| {
        let direct = direct.clone();
        async move {
            let kv = direct.get_key_value(FLOW_RUNS_BUCKET).await.unwrap();
            kv.entry(key).await.unwrap().map_or(0, |e| e.revision)
        }
    };

    // The run's compare-and-set.
    run.updated_at_ms = 2;
    proxy.mute();
    let write = tokio::spawn({
        let (via, run) = (via.clone(), run.clone());
        async move { via.put_run(&run, Some(r1)).await }
    });
    let stored = eventually(Duration::from_secs(5), "the run's write stored", || async {
        let at = latest("r1").await;
        (at > r1).then_some(at)
    })
    .await;
    proxy.cut();
    let answered = timeout(AFTER_RECONNECT, write)
        .await
        .expect("the run's write answered once sent again, not at the request timeout")
        .unwrap();
    assert_eq!(
        answered.unwrap(),
        stored,
        "taken as written, at its revision"
    );

    // A step's.
    let running = StepRun {
        state: StepState::Running,
        started_at_ms: Some(2),
        ..Default::default()
    };
    proxy.mute();
    let write = tokio::spawn({
        let via = via.clone();
        async move { via.put_step("r1", "a", &running, Some(s1)).await }
    });
    let stored = eventually(
        Duration::from_secs(5),
        "the step's write stored",
        || async {
            let at = latest("r1.a").await;
            (at > s1).then_some(at)
        },
    )
    .await;
    proxy.cut();
    let answered = timeout(AFTER_RECONNECT, write)
        .await
        .expect("the step's write answered once sent again, not at the request timeout")
        .unwrap();
    assert_eq!(
        answered.unwrap(),
        stored,
        "taken as written, at its revision"
    );
}

/// Ending a task that has not started (`TaskStore::end_unstarted`: a wait met by its
/// event, a timeout, a cancel) reads its record first: a read the broker had when it
/// stopped is asked again when the client connects anew, as the write is sent again, not
/// waited out for the client's request timeout (10 s, longer than many a wait). Found by
/// the single-node campaign's seed 12517236175659910130: a wait for an event whose event
/// was stored 10 s before its timeout timed out across two broker restarts. Red with the
/// read sent once: no answer within 4 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unstarted_task_s_end_whose_read_the_broker_had_is_asked_again() {
    use ax_sdk::{TaskRecord, TaskState};
    let env = crate::support::Env::start(crate::support::Env::server()).await;
    let direct = env.store().await;
    let id = "q.wait.resend";
    let rec: TaskRecord = serde_json::from_value(serde_json::json!({"id": id, "queue": "q",
        "name": "ax.wait_for_event", "priority": "normal", "state": "scheduled", "attempt": 0,
        "max_attempts": 1, "created_at_ms": 1, "updated_at_ms": 1}))
    .unwrap();
    direct.create(&rec).await.unwrap();
    let (proxy, client) = through(&env.nats).await;
    let store = ax_core::state::TaskStore::open(&jetstream::new(client))
        .await
        .unwrap();

    // The read reaches the broker, its answer is dropped; then the connection is cut.
    proxy.mute();
    let end = tokio::spawn(async move { store.succeed_unstarted(id, None).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.cut();
    let ended = timeout(AFTER_RECONNECT, end)
        .await
        .expect("answered once the read was asked again, not at the request timeout")
        .unwrap()
        .unwrap();
    assert_eq!(ended.map(|r| r.state), Some(TaskState::Succeeded));
    let (stored, _) = direct.get(id).await.unwrap().unwrap();
    assert_eq!(stored.state, TaskState::Succeeded, "ended once, stored");
}

/// A debounce window's or a batch's append (`admit::publish_expecting`: stored only if the
/// subject's last message is the one expected) that the broker stored but never answered
/// is sent again and answered with the sequence it was stored under; if another writer
/// appended after it meanwhile, whether it was stored is unknown (`unavailable`): not
/// refused as moved on, which made its caller append its items again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_append_stored_but_unanswered_is_taken_as_stored_once_sent_again() {
    use ax_core::admit::{publish_expecting, Expected};
    use ax_core::protocol::ErrorCode;
    let nats = LocalNats::start().unwrap();
    let direct = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let windows = direct
        .create_stream(stream::Config {
            name: ax_core::names::DELAYED_STREAM.into(),
            subjects: vec!["win.>".into()],
            allow_direct: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let open = direct.publish("win.k", "[1]".into()).await.unwrap();
    let opened = open.await.unwrap().sequence;
    let (proxy, client) = through(&nats).await;
    let via = jetstream::new(client);
    let last = || async {
        let msg = windows
            .get_last_raw_message_by_subject("win.k")
            .await
            .unwrap();
        (msg.sequence, msg.payload)
    };
    let append = |expect: u64, list: &'static str| {
        let via = via.clone();
        async move {
            let headers = async_nats::HeaderMap::new();
            publish_expecting(&via, "win.k".into(), headers, expect, list.into()).await
        }
    };
    let after = |seq: u64| move || async move { Some(last().await.0).filter(|s| *s > seq) };

    // Stored, its answer dropped; then the connection is cut.
    let (write, stored) = mute_until_stored(&proxy, append(opened, "[1,2]"), after(opened)).await;
    let answered = answer_after_cut(&proxy, write).await;
    assert_eq!(
        answered.unwrap(),
        Expected::Stored(stored),
        "taken as stored, where it was"
    );
    assert_eq!(last().await, (stored, "[1,2]".into()), "appended once");

    // Stored, then another writer appends after it before the answer: unknown, not
    // moved on (its caller would append its items again).
    let (write, mine) = mute_until_stored(&proxy, append(stored, "[1,2,3]"), after(stored)).await;
    let other = direct
        .publish_with_headers("win.k", expecting(mine), "[1,2,3,4]".into())
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence;
    let answered = answer_after_cut(&proxy, write).await;
    assert!(
        matches!(&answered, Err(e) if e.code == ErrorCode::Unavailable),
        "unknown whether stored: {answered:?}"
    );
    assert_eq!(
        last().await,
        (other, "[1,2,3,4]".into()),
        "nothing appended again"
    );
    assert_eq!(windows.clone().info().await.unwrap().state.messages, 4);

    // A write sent once that expected a sequence no longer last moved on, as before.
    let answered = timeout(AFTER_RECONNECT, append(stored, "[1,2,5]")).await;
    assert_eq!(answered.unwrap().unwrap(), Expected::MovedOn);
}

fn expecting(seq: u64) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(ax_core::admit::EXPECTED_LAST, seq.to_string().as_str());
    headers
}

/// A wait's registration read (`Waits::get`: an approval's completion, the matcher) and
/// its removal once the wait ended (`Waits::remove`) are asked again when the client
/// connects anew, as a task's end is: an answer the broker never gave held them for the
/// client's request timeout. Red with either sent once: no answer within 4 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_registration_s_read_and_removal_the_broker_had_are_asked_again() {
    use ax_core::event::WaitRegistration;
    use ax_core::waits::Waits;
    // The bucket alone: a server's matcher would remove a registration without its task.
    let nats = LocalNats::start().unwrap();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.create_key_value(kv::Config {
        bucket: ax_core::names::WAITS_BUCKET.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let direct = Waits::new(js);
    let id = "q.wait.resend";
    let reg: WaitRegistration = serde_json::from_value(serde_json::json!({
        "task": id, "event": "paid", "since_ms": 1, "until_ms": 2}))
    .unwrap();
    direct.put(&reg).await.unwrap();
    let (proxy, client) = through(&nats).await;
    let waits = Waits::new(jetstream::new(client));
    waits.store().await.unwrap();

    // The read reaches the broker, its answer is dropped; then the connection is cut.
    proxy.mute();
    let read = {
        let waits = waits.clone();
        tokio::spawn(async move { waits.get(id).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let found = answer_after_cut(&proxy, read).await.unwrap();
    assert_eq!(found, Some(reg));

    let remove = {
        let waits = waits.clone();
        async move { waits.remove(id).await }
    };
    let (remove, ()) = mute_until_stored(&proxy, remove, || async {
        direct.get(id).await.unwrap().is_none().then_some(())
    })
    .await;
    answer_after_cut(&proxy, remove).await.unwrap();
    assert_eq!(direct.get(id).await.unwrap(), None);
}
