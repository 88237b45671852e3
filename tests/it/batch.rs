//! Batch submit: one request, many tasks, one answer per task in order.

use crate::support::{counting_worker, eventually, Env};
use ax_core::protocol::{ErrorCode, SubmitReply};
use ax_sdk::{Priority, TaskSpec, TaskState};
use std::collections::HashSet;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_task_of_a_batch_is_answered_on_its_own_in_order() {
    let env = Env::start(Env::server()).await;
    // A key already used by a single submit.
    let earlier = env
        .ax
        .submit("q", TaskSpec::new("t").idempotency_key("k-earlier"))
        .await
        .unwrap();
    // 2,500 tasks: more than one batch request (at most 1,000 each).
    let mut specs: Vec<TaskSpec> = (0..2500)
        .map(|i| TaskSpec::new("t").json(&serde_json::json!({ "i": i })))
        .collect();
    specs[7] = TaskSpec::new("bad name!");
    specs[10] = TaskSpec::new("t").idempotency_key("k-twice");
    specs[11] = TaskSpec::new("t").idempotency_key("k-twice");
    specs[1200] = TaskSpec::new("t").idempotency_key("k-earlier");
    specs[2000] = TaskSpec::new("t").delay(Duration::from_secs(3600));
    specs[2499] = TaskSpec::new("t").max_attempts(0);
    let answers = env.ax.submit_many("q", specs).await;
    assert_eq!(answers.len(), 2500);
    let refusal = |i: usize| answers[i].as_ref().expect_err("refused").clone();
    assert_eq!(refusal(7).code, ErrorCode::InvalidField);
    assert_eq!(refusal(7).field.as_deref(), Some("name"));
    assert_eq!(refusal(2499).code, ErrorCode::InvalidField);
    let ok = |i: usize| answers[i].as_ref().expect("accepted").clone();
    assert!(!ok(10).duplicate);
    assert!(ok(11).duplicate, "the second use of a key in one batch");
    assert_eq!(ok(11).id, ok(10).id);
    assert!(ok(1200).duplicate);
    assert_eq!(ok(1200).id, earlier.id);
    assert_eq!(ok(2000).state, TaskState::Scheduled);
    assert_eq!(ok(0).state, TaskState::Pending);
    // Every other task is new, with its own id and record.
    let new: Vec<String> = answers
        .iter()
        .flatten()
        .filter(|a| !a.duplicate)
        .map(|a| a.id.clone())
        .collect();
    assert_eq!(new.len(), 2500 - 2 - 2);
    assert_eq!(new.iter().collect::<HashSet<_>>().len(), new.len());
    for id in [&new[0], &new[1500], &ok(2000).id] {
        env.record(id).await;
    }
    // In order: the payload of answer i is task i's.
    let rec = env.store().await;
    let (r5, _) = rec.find(&ok(5).id).await.unwrap().unwrap();
    assert_eq!(r5.state, TaskState::Pending);
    // Each ready task runs exactly once: 2,500 less the 2 refused, the 2 duplicates and
    // the delayed one, plus the earlier single submit.
    let (worker, runs) = counting_worker(64);
    let (stop, handle) = env.spawn_worker(worker);
    let want = 2500 - 2 - 2 - 1 + 1;
    eventually(Duration::from_secs(60), "every ready task ran", || async {
        (runs.lock().unwrap().len() >= want).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    handle.await.unwrap();
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), want);
    assert!(runs.values().all(|&n| n == 1), "a task ran twice");
    assert!(!runs.contains_key(&ok(2000).id), "the delayed task waits");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_priority_refuses_only_the_tasks_beyond_it() {
    let env = Env::start(Env::server().capacity([3, 5, 5])).await;
    let specs = (0..8).map(|_| TaskSpec::new("t").priority(Priority::High));
    let answers = env.ax.submit_many("q", specs).await;
    let accepted = answers.iter().filter(|a| a.is_ok()).count();
    let busy = answers
        .iter()
        .filter(|a| matches!(a, Err(e) if e.code == ErrorCode::Busy))
        .count();
    assert_eq!((accepted, busy), (3, 5));
    assert_eq!(env.stream_len("AX_READY_HIGH").await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_level_problems_refuse_the_whole_batch() {
    let env = Env::start(Env::server()).await;
    let request = |subject: &str, body: String| {
        let client = env.client.clone();
        let subject = subject.to_string();
        async move {
            let msg = client.request(subject, body.into()).await.unwrap();
            serde_json::from_slice::<serde_json::Value>(&msg.payload).unwrap()
        }
    };
    // Too many tasks: one error object, nothing stored.
    let many = format!("[{}]", vec![r#"{"name":"t"}"#; 1001].join(","));
    let reply = request("ax.submit.q", many).await;
    assert_eq!(reply["error"]["code"], "bad_request", "{reply}");
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, 0);
    // An undeclared queue.
    let reply = request("ax.submit.nope", r#"[{"name":"t"}]"#.into()).await;
    assert_eq!(reply["error"]["code"], "unknown_queue", "{reply}");
    // Not an array of objects: each element is answered.
    let reply = request("ax.submit.q", r#"[1, {"name":"t"}, {"nam":"t"}]"#.into()).await;
    let replies: Vec<SubmitReply> = serde_json::from_value(reply.clone()).unwrap();
    assert!(
        matches!(&replies[0], SubmitReply::Error { error } if error.code == ErrorCode::BadRequest)
    );
    assert!(matches!(&replies[1], SubmitReply::Accepted(_)), "{reply}");
    assert!(
        matches!(&replies[2], SubmitReply::Error { error } if error.code == ErrorCode::BadRequest)
    );
    // A broken array.
    let reply = request("ax.submit.q", r#"[{"name":"t"}"#.into()).await;
    assert_eq!(reply["error"]["code"], "bad_request", "{reply}");
    // An empty batch is an empty answer.
    let reply = request("ax.submit.q", "[]".into()).await;
    assert_eq!(reply, serde_json::json!([]));
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_submits_a_file_and_reports_each_line() {
    let env = Env::start(Env::server()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tasks.jsonl");
    let mut text = String::new();
    for i in 0..1500 {
        text.push_str(&format!("{{\"name\":\"t\",\"payload\":{{\"i\":{i}}}}}\n"));
    }
    text.push_str("not json\n\n");
    text.push_str("{\"name\":\"t\",\"priority\":\"urgent\"}\n");
    std::fs::write(&path, text).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ax"))
        .args(["submit", "--queue", "q", "--file"])
        .arg(&path)
        .env("NATS_URL", env.nats.url())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "refusals exit 1: {stderr}");
    assert!(
        stderr.contains("1502 tasks")
            && stderr.contains("1500 accepted")
            && stderr.contains("2 refused"),
        "{stderr}"
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1502, "one answer per non-empty line, in order");
    assert_eq!(lines[1500]["error"]["code"], "bad_request");
    assert_eq!(lines[1501]["error"]["field"], "priority");
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, 1500);
    let id = lines[0]["id"].as_str().unwrap();
    assert_eq!(env.record(id).await.state, TaskState::Pending);
}
