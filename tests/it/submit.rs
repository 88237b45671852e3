//! Submission: run and ack, bad input, idempotency, backpressure.

use crate::support::Env;
use ax_core::protocol::ErrorCode;
use ax_sdk::worker::{Task, Worker};
use ax_sdk::{ClientError, Priority, TaskSpec, TaskState};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub(crate) fn refused(
    result: Result<ax_core::protocol::SubmitAccepted, ClientError>,
) -> ax_core::protocol::WireError {
    match result {
        Err(ClientError::Refused(e)) => e,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submitted_tasks_run_once_and_are_acked() {
    let env = Env::start(Env::server()).await;
    let mut ids = Vec::new();
    for i in 0..20 {
        let spec = TaskSpec::new("square").json(&serde_json::json!({ "n": i }));
        let accepted = env.ax.submit("q", spec).await.unwrap();
        assert_eq!(accepted.state, TaskState::Pending);
        assert!(!accepted.duplicate);
        ids.push(accepted.id);
    }
    let seen: Arc<Mutex<Vec<(String, u64, u32)>>> = Arc::default();
    let worker = Worker::builder("q")
        .concurrency(4)
        .handler({
            let seen = seen.clone();
            move |task: Task| {
                let seen = seen.clone();
                async move {
                    let v: serde_json::Value = task.json()?;
                    seen.lock()
                        .unwrap()
                        .push((task.id, v["n"].as_u64().unwrap(), task.attempt));
                    Ok(())
                }
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    for id in &ids {
        let rec = env
            .wait_state(id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
        assert_eq!(rec.attempt, 1);
        assert!(rec.finished_at_ms.is_some());
    }
    stop.cancel();
    handle.await.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 20, "each task ran exactly once");
    let mut ns: Vec<u64> = seen.iter().map(|s| s.1).collect();
    ns.sort();
    assert_eq!(ns, (0..20).collect::<Vec<u64>>(), "payloads arrive intact");
    // Work-queue retention: acked tasks leave the ready streams.
    for p in Priority::ALL {
        assert_eq!(env.stream_len(&p.ready_stream()).await, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_typed_errors_and_stores_nothing() {
    let env = Env::start(Env::server().limits(ax_core::task::Limits {
        max_payload_bytes: 1024,
        ..Default::default()
    }))
    .await;
    let cases: Vec<(&str, Vec<u8>, ErrorCode, Option<&str>)> = vec![
        ("q", b"{not json".to_vec(), ErrorCode::BadRequest, None),
        ("q", b"\xff\xfe".to_vec(), ErrorCode::BadRequest, None),
        (
            "q",
            br#"{"name":"a","max_attempt":3}"#.to_vec(),
            ErrorCode::BadRequest,
            None,
        ),
        (
            "q",
            br#"{"name":"a","delay_ms":"soon"}"#.to_vec(),
            ErrorCode::BadRequest,
            None,
        ),
        (
            "q",
            br#"{"name":"a","delay_ms":1e400}"#.to_vec(),
            ErrorCode::BadRequest,
            None,
        ),
        (
            "q",
            br#"{"name":"a","delay_ms":-5}"#.to_vec(),
            ErrorCode::InvalidField,
            Some("delay_ms"),
        ),
        (
            "q",
            br#"{"name":"a","delay_ms":99999999999999}"#.to_vec(),
            ErrorCode::InvalidField,
            Some("delay_ms"),
        ),
        (
            "q",
            br#"{"name":"a","priority":"urgent"}"#.to_vec(),
            ErrorCode::InvalidField,
            Some("priority"),
        ),
        (
            "q",
            br#"{"name":""}"#.to_vec(),
            ErrorCode::InvalidField,
            Some("name"),
        ),
        (
            "q",
            format!(r#"{{"name":"a","payload":"{}"}}"#, "x".repeat(2000)).into_bytes(),
            ErrorCode::PayloadTooLarge,
            None,
        ),
        (
            "nope",
            br#"{"name":"a"}"#.to_vec(),
            ErrorCode::UnknownQueue,
            None,
        ),
    ];
    for (queue, body, code, field) in cases {
        let err = refused(env.ax.submit_raw(queue, body.clone()).await);
        assert_eq!(err.code, code, "body {:?}", String::from_utf8_lossy(&body));
        assert_eq!(err.field.as_deref(), field);
    }
    let tasks = ax_core::names::TASKS_BUCKET;
    assert_eq!(
        env.stream_len(&format!("KV_{tasks}")).await,
        0,
        "no record stored"
    );
    for p in Priority::ALL {
        assert_eq!(
            env.stream_len(&p.ready_stream()).await,
            0,
            "no message stored"
        );
    }
    // The server keeps serving good requests.
    let ok = env.ax.submit("q", TaskSpec::new("fine")).await.unwrap();
    assert_eq!(env.record(&ok.id).await.state, TaskState::Pending);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_key_returns_the_first_task() {
    let env = Env::start(Env::server().queues(["q", "r"])).await;
    let spec = || TaskSpec::new("invoice").idempotency_key("user-7:2026-11-29");
    let first = env.ax.submit("q", spec()).await.unwrap();
    let second = env
        .ax
        .submit("q", spec().priority(Priority::High))
        .await
        .unwrap();
    assert_eq!(second.id, first.id);
    assert!(second.duplicate && !first.duplicate);
    assert_eq!(env.stream_len("AX_READY_NORMAL").await, 1);
    assert_eq!(
        env.stream_len("AX_READY_HIGH").await,
        0,
        "the duplicate created nothing"
    );
    // Keys are per queue.
    let other = env.ax.submit("r", spec()).await.unwrap();
    assert_ne!(other.id, first.id);
    // Still a duplicate after the task ran.
    let worker = Worker::builder("q")
        .handler(|_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    env.wait_state(&first.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    let third = env.ax.submit("q", spec()).await.unwrap();
    assert_eq!(
        (third.id.as_str(), third.duplicate, third.state),
        (first.id.as_str(), true, TaskState::Succeeded)
    );
    stop.cancel();
    handle.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_priority_answers_busy_and_drops_nothing() {
    let env = Env::start(Env::server().capacity([2, 3, 3])).await;
    let high = || TaskSpec::new("t").priority(Priority::High);
    let a = env.ax.submit("q", high()).await.unwrap();
    let b = env.ax.submit("q", high()).await.unwrap();
    let err = refused(env.ax.submit("q", high()).await);
    assert_eq!(err.code, ErrorCode::Busy);
    assert!(err.code.is_retryable());
    assert_eq!(env.stream_len("AX_READY_HIGH").await, 2);
    // Other priorities have their own capacity.
    env.ax
        .submit("q", TaskSpec::new("t").priority(Priority::Low))
        .await
        .unwrap();
    // Once a worker drains the bucket, submits are accepted again.
    let worker = Worker::builder("q")
        .handler(|_t: Task| async { Ok(()) })
        .build()
        .unwrap();
    let (stop, handle) = env.spawn_worker(worker);
    for id in [&a.id, &b.id] {
        env.wait_state(id, TaskState::Succeeded, Duration::from_secs(10))
            .await;
    }
    let c = env.ax.submit("q", high()).await.unwrap();
    env.wait_state(&c.id, TaskState::Succeeded, Duration::from_secs(10))
        .await;
    stop.cancel();
    handle.await.unwrap();
}

/// Defect 7.1.2: a line break (or any control character) in a string that becomes a
/// header is an `invalid_field` answer, every time, and stores nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_in_header_fields_are_refused() {
    let env = Env::start(Env::server()).await;
    let bodies = [
        (
            r#"{"name":"a","idempotency_key":"k\r\nX-Evil: 1"}"#,
            "idempotency_key",
        ),
        (r#"{"name":"a","idempotency_key":"k\n"}"#, "idempotency_key"),
        (
            r#"{"name":"a","idempotency_key":"tab\there"}"#,
            "idempotency_key",
        ),
        (
            r#"{"name":"a","idempotency_key":" padded "}"#,
            "idempotency_key",
        ),
        (r#"{"name":"a\r\n"}"#, "name"),
    ];
    for (body, field) in bodies {
        // Twice: the retry the protocol recommends gets the same answer.
        for _ in 0..2 {
            let err = refused(env.ax.submit_raw("q", body.as_bytes().to_vec()).await);
            assert_eq!(
                (err.code, err.field.as_deref()),
                (ErrorCode::InvalidField, Some(field)),
                "{body}"
            );
        }
    }
    for stream in ["KV_AX_IDEMPOTENCY", "KV_AX_TASKS", "AX_READY_NORMAL"] {
        assert_eq!(env.stream_len(stream).await, 0, "{stream} stored something");
    }
    // The server still serves.
    env.ax
        .submit("q", TaskSpec::new("fine").idempotency_key("ok key"))
        .await
        .unwrap();
}

/// Defect 7.1.3: RFC 3339 times with any offset, `Z` and fractions are read exactly; a
/// space for `T` or a missing offset are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_at_with_offsets_is_exact_and_loose_forms_are_refused() {
    let env = Env::start(Env::server()).await;
    let due_ms = (ax_core::time::now_ms() / 1000 + 3600) * 1000; // a whole second, 1 h ahead
    let utc = chrono_like(due_ms, 0, "");
    let cases = [
        (utc.clone(), due_ms),
        (chrono_like(due_ms, 60, ""), due_ms),
        (chrono_like(due_ms, -330, ""), due_ms),
        (chrono_like(due_ms, 60, ".25"), due_ms + 250),
        (chrono_like(due_ms, 120, ".250000"), due_ms + 250),
    ];
    for (text, want) in cases {
        let accepted = env
            .ax
            .submit("q", TaskSpec::new("at").run_at(text.clone()))
            .await
            .unwrap_or_else(|e| panic!("{text}: {e}"));
        let rec = env.record(&accepted.id).await;
        assert_eq!(rec.run_at_ms, Some(want), "{text}");
    }
    let loose = [
        utc.replace('T', " "),
        utc.trim_end_matches('Z').to_string(),
        "2026-11-29T20:03:54+0100".to_string(),
        "tomorrow".to_string(),
    ];
    for text in loose {
        let err = refused(
            env.ax
                .submit("q", TaskSpec::new("at").run_at(text.clone()))
                .await,
        );
        assert_eq!(
            (err.code, err.field.as_deref()),
            (ErrorCode::InvalidField, Some("run_at")),
            "{text}"
        );
    }
}

/// `ms` (UTC) written in RFC 3339 at a UTC offset of `offset_min` minutes, with `frac`
/// appended to the seconds.
pub fn chrono_like(ms: u64, offset_min: i64, frac: &str) -> String {
    let local = ms as i64 / 1000 + offset_min * 60;
    let days = local.div_euclid(86_400);
    let secs = local.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let zone = if offset_min == 0 && frac.is_empty() {
        "Z".to_string()
    } else {
        let sign = if offset_min < 0 { '-' } else { '+' };
        format!(
            "{sign}{:02}:{:02}",
            offset_min.abs() / 60,
            offset_min.abs() % 60
        )
    };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}{frac}{zone}",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}
