//! The write budget: how many messages the broker stores per task, counted exactly from
//! every stream's last sequence (KV buckets are streams; acking a work-queue message
//! stores nothing), per stream, across many tasks. Not timed: a count, so it cannot be
//! noisy, and any write added to the task path turns it red.
//!
//! The figures asserted are today's path (docs/PERFORMANCE.md, "Stored writes per
//! task"): two on the fast path (the budget), three with a key or a retry, four for a
//! delayed task.

use crate::support::Env;
use ax_sdk::worker::{Task, TaskError, Worker};
use ax_sdk::{TaskSpec, TaskState};
use futures::StreamExt;
use std::collections::BTreeMap;
use std::time::Duration;

/// Written by the servers on their own schedule (leader leases), not by tasks.
const BACKGROUND: &[&str] = &["KV_AX_LEASES"];

/// Every stream's last sequence.
async fn sequences(env: &Env) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut names = env.js.stream_names();
    while let Some(name) = names.next().await {
        let name = name.unwrap();
        let mut stream = env.js.get_stream(&name).await.unwrap();
        out.insert(name, stream.info().await.unwrap().state.last_sequence);
    }
    out
}

/// Messages stored per task by each stream while `specs` ran on `worker`, `n` per task
/// exactly (a fraction fails the test). Every task is submitted before the worker starts:
/// a worker that claims a task before the server has written its record creates the
/// record itself (one write less), and that race would make the count vary.
async fn writes_per_task(env: &Env, specs: Vec<TaskSpec>, worker: Worker) -> BTreeMap<String, u64> {
    writes_per_task_by(env, &env.ax, specs, worker).await
}

/// [`writes_per_task`] with the tasks submitted by `client`.
async fn writes_per_task_by(
    env: &Env,
    client: &ax_sdk::Client,
    specs: Vec<TaskSpec>,
    worker: Worker,
) -> BTreeMap<String, u64> {
    let tasks = specs.len() as u64;
    let before = sequences(env).await;
    let mut ids = Vec::new();
    for spec in specs {
        ids.push(client.submit("q", spec).await.unwrap().id);
    }
    let (stop, handle) = env.spawn_worker(worker);
    for id in ids {
        env.wait_state(&id, TaskState::Succeeded, Duration::from_secs(20))
            .await;
    }
    stop.cancel();
    handle.await.unwrap();
    let after = sequences(env).await;
    let mut per_task = BTreeMap::new();
    for (name, last) in after {
        let grew = last - before.get(&name).copied().unwrap_or(0);
        if grew == 0 || BACKGROUND.contains(&name.as_str()) {
            continue;
        }
        assert_eq!(grew % tasks, 0, "{name}: {grew} messages for {tasks} tasks");
        per_task.insert(name, grew / tasks);
    }
    per_task
}

fn worker() -> Worker {
    Worker::builder("q")
        .concurrency(32)
        .handler(|task: Task| async move {
            // `{"fail_first": true}` fails its first attempt (retried at once).
            let fail_first = task.json::<serde_json::Value>()?["fail_first"] == true;
            if fail_first && task.attempt == 1 {
                return Err(TaskError::new("flaky", "first attempt"));
            }
            Ok(())
        })
        .build()
        .unwrap()
}

fn expect(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

const N: u64 = 60;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_writes_per_task_on_each_path() {
    let env = Env::start(Env::server()).await;
    let plain = || TaskSpec::new("t").json(&serde_json::json!({}));
    let n = |f: &dyn Fn(u64) -> TaskSpec| (0..N).map(f).collect::<Vec<_>>();

    // The fast path: an immediate task, no key, its first attempt succeeds within a
    // second. The ready message, then the record the claim creates as `succeeded` (the
    // submit stores none, the attempt writes no `running`): two writes. Before the
    // unrecorded submit this was 1 + 3.
    let fast = writes_per_task(&env, n(&|_| plain()), worker()).await;
    assert_eq!(fast, expect(&[("AX_READY_NORMAL", 1), ("KV_AX_TASKS", 1)]));

    // The same by a direct submit (the producer publishes the message itself): the same
    // two writes, immediate or delayed.
    let direct = ax_sdk::Client::new(env.client.clone()).direct_submits(true);
    let fast_direct = writes_per_task_by(&env, &direct, n(&|_| plain()), worker()).await;
    assert_eq!(
        fast_direct, fast,
        "a direct submit stores what a requested one does"
    );
    let later = n(&|_| plain().delay(Duration::from_millis(300)));
    let delayed_direct = writes_per_task_by(&env, &direct, later, worker()).await;
    assert_eq!(
        delayed_direct,
        expect(&[
            ("AX_DELAYED", 1),
            ("AX_READY_NORMAL", 1),
            ("KV_AX_TASKS", 2)
        ])
    );

    // With an idempotency key: the ready message, then the key naming it, then the
    // record the claim creates as `succeeded` (no record at submit: the key, not the
    // record, is what a duplicate submit reads; no `running` before a first attempt that
    // ends within a second, as without a key). Five before 2026-12-03 (the key, the
    // message, and `pending`, `running`, `succeeded`), four until the cancel of an
    // unwritten attempt signalled its worker (`running` before the handler).
    let keyed = || n(&|i| plain().idempotency_key(format!("budget-{i}")));
    let with_key = writes_per_task(&env, keyed(), worker()).await;
    assert_eq!(
        with_key,
        expect(&[
            ("AX_READY_NORMAL", 1),
            ("KV_AX_IDEMPOTENCY", 1),
            ("KV_AX_TASKS", 1)
        ])
    );

    // One retry: the first attempt creates `retrying`; the retry (a delayed Nak of the
    // same message, no new publish) starts without `running` too and writes `succeeded`.
    let flaky = n(&|_| {
        TaskSpec::new("t")
            .json(&serde_json::json!({"fail_first": true}))
            .backoff(Duration::from_millis(1), Duration::from_millis(1), 0.0)
    });
    let with_retry = writes_per_task(&env, flaky, worker()).await;
    assert_eq!(
        with_retry,
        expect(&[("AX_READY_NORMAL", 1), ("KV_AX_TASKS", 2)])
    );

    // A delayed task: its message in `AX_DELAYED` and no record while it waits, the ready
    // message the dispatcher publishes when it is due, and two records: the claim writes
    // `running` before the attempt starts (the dispatcher may have published a copy:
    // docs/PROTOCOL.md §3), then `succeeded`. Five before delayed tasks went unrecorded.
    let delayed = n(&|_| plain().delay(Duration::from_millis(300)));
    let with_delay = writes_per_task(&env, delayed, worker()).await;
    assert_eq!(
        with_delay,
        expect(&[
            ("AX_DELAYED", 1),
            ("AX_READY_NORMAL", 1),
            ("KV_AX_TASKS", 2)
        ])
    );

    // A delayed task with a key keeps the record made at submit (`scheduled`, then
    // `running`, `succeeded`) after its key.
    let keys = (0..N).map(|i| {
        plain()
            .idempotency_key(format!("later-{i}"))
            .delay(Duration::from_millis(300))
    });
    let delayed_keyed = writes_per_task(&env, keys.collect(), worker()).await;
    assert_eq!(
        delayed_keyed,
        expect(&[
            ("AX_DELAYED", 1),
            ("AX_READY_NORMAL", 1),
            ("KV_AX_IDEMPOTENCY", 1),
            ("KV_AX_TASKS", 3)
        ])
    );
}

/// How many of the messages of `stream` since `from` were stored by an atomic batch (group
/// commit), out of how many.
async fn batched(env: &Env, stream: &str, from: u64) -> (usize, usize) {
    let stream = env.js.get_stream(stream).await.unwrap();
    let last = stream.get_info().await.unwrap().state.last_sequence;
    let mut batched = 0;
    for seq in from + 1..=last {
        let msg = stream.get_raw_message(seq).await.unwrap();
        batched += usize::from(msg.headers.get("Nats-Batch-Id").is_some());
    }
    (batched, (last - from) as usize)
}

/// A worker writes the outcomes of tasks that end at the same moment as one atomic batch
/// (one stored write, one fsync, for many); with group commit off, each on its own. The
/// number of records is the same either way (the budget above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_that_end_together_are_stored_in_groups() {
    let env = Env::start(Env::server()).await;
    for group in [true, false] {
        let from = env
            .js
            .get_stream("KV_AX_TASKS")
            .await
            .unwrap()
            .get_info()
            .await
            .unwrap()
            .state
            .last_sequence;
        let mut ids = Vec::new();
        for _ in 0..N {
            ids.push(env.ax.submit("q", TaskSpec::new("t")).await.unwrap().id);
        }
        let worker = Worker::builder("q")
            .concurrency(32)
            .group_commit(group)
            .handler(|_task: Task| async { Ok(()) })
            .build()
            .unwrap();
        let (stop, handle) = env.spawn_worker(worker);
        for id in &ids {
            env.wait_state(id, TaskState::Succeeded, Duration::from_secs(20))
                .await;
        }
        stop.cancel();
        handle.await.unwrap();
        let (batched, records) = batched(&env, "KV_AX_TASKS", from).await;
        assert_eq!(records, N as usize, "one record a task");
        match group {
            true => assert!(batched > 0, "no record was stored in a group"),
            false => assert_eq!(batched, 0, "group commit is off"),
        }
    }
}

/// Delayed and immediate submits of one moment are stored as atomic batches, each in its
/// own stream (one stored write, one fsync, for many). Delayed ones once went into the
/// ready stream's groups: a batch is stored by one stream, so a group that mixed the two
/// was refused and every message in it fell back to a publish of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_submits_of_one_moment_are_stored_in_groups() {
    let env = Env::start(Env::server().group_commit(true)).await;
    let spec = |i: u64| match i % 2 {
        0 => TaskSpec::new("t").delay(Duration::from_secs(3600)),
        _ => TaskSpec::new("t"),
    };
    let submits = (0..2 * N).map(|i| env.ax.submit("q", spec(i)));
    for answer in futures::future::join_all(submits).await {
        answer.unwrap();
    }
    for stream in ["AX_DELAYED", "AX_READY_NORMAL"] {
        let (batched, stored) = batched(&env, stream, 0).await;
        eprintln!("{stream}: {batched} of {stored} stored by a batch");
        assert_eq!(stored, N as usize, "{stream}: each task stored once");
        assert!(
            batched * 2 > stored,
            "{stream}: {batched} of {stored} tasks submitted together stored by an atomic batch"
        );
    }
}
