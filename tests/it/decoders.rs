//! Property tests of every decoder on the wire: random and malformed input gets a typed
//! error, never a panic; what decodes round-trips. Each test prints its execution count.

use crate::support::Env;
use ax_core::backoff::Backoff;
use ax_core::protocol::ErrorCode;
use ax_core::task::{decode_submit, Limits, TaskMeta};
use ax_sdk::ClientError;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Map, Value};

const CASES: u32 = 4000;

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        Just(json!(1e300)),
        Just(json!(-1)),
        Just(json!(0)),
        ".{0,40}".prop_map(Value::String),
        Just(json!("2026-12-01T08:00:00Z")),
        Just(json!("high")),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(".{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn submit_object() -> impl Strategy<Value = Value> {
    let field = prop::sample::select(crate::fields::SUBMIT_FIELDS.to_vec());
    prop::collection::vec((field, json_value()), 0..8).prop_map(|pairs| {
        let mut m = Map::new();
        m.insert("name".into(), json!("task"));
        for (k, v) in pairs {
            m.insert(k.to_string(), v);
        }
        Value::Object(m)
    })
}

fn run<S: Strategy>(name: &str, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&strategy, test)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    println!("fuzz {name}: {CASES} executions, 0 crashes or untyped errors");
}

#[test]
fn submit_decoder_takes_any_bytes() {
    let limits = Limits {
        max_payload_bytes: 512,
        ..Limits::default()
    };
    run(
        "submit bytes",
        prop::collection::vec(any::<u8>(), 0..300),
        |bytes| {
            if let Err(e) = decode_submit("q", &bytes, &limits) {
                prop_assert!(matches!(
                    e.code,
                    ErrorCode::BadRequest | ErrorCode::InvalidField | ErrorCode::PayloadTooLarge
                ));
            }
            Ok(())
        },
    );
}

#[test]
fn submit_decoder_takes_any_json_shape() {
    let limits = Limits {
        max_payload_bytes: 512,
        ..Limits::default()
    };
    run("submit json", submit_object(), |value| {
        let body = serde_json::to_vec(&value).unwrap();
        match decode_submit("q", &body, &limits) {
            Ok((meta, payload)) => {
                prop_assert!(payload.len() <= 512);
                prop_assert!(meta.max_attempts >= 1);
                prop_assert_eq!(TaskMeta::from_headers(&meta.to_headers()).unwrap(), meta);
            }
            Err(e) => {
                prop_assert!(e.code != ErrorCode::Busy && e.code != ErrorCode::Unavailable);
                if e.code == ErrorCode::InvalidField {
                    prop_assert!(e.field.is_some());
                }
            }
        }
        Ok(())
    });
}

#[test]
fn task_header_decoder_takes_any_values() {
    let names = [
        "Ax-Task-Id",
        "Ax-Task-Name",
        "Ax-Queue",
        "Ax-Priority",
        "Ax-Max-Attempts",
        "Ax-Timeout-Ms",
        "Ax-Backoff",
        "Ax-Created-At-Ms",
        "Ax-Run-At-Ms",
        "Ax-Retry-On",
    ];
    let strategy =
        prop::collection::vec((prop::sample::select(names.to_vec()), "[ -~]{0,30}"), 0..12);
    run("task headers", strategy, |pairs| {
        let mut headers = async_nats::HeaderMap::new();
        for (k, v) in pairs {
            headers.insert(k, v.as_str());
        }
        if let Ok(meta) = TaskMeta::from_headers(&headers) {
            prop_assert_eq!(TaskMeta::from_headers(&meta.to_headers()).unwrap(), meta);
        }
        Ok(())
    });
}

#[test]
fn backoff_header_decoder_takes_any_string() {
    run("backoff header", ".{0,40}", |text| {
        if let Some(b) = Backoff::from_header(&text) {
            prop_assert_eq!(Backoff::from_header(&b.to_header()), Some(b));
            let _ = b.delay(u32::MAX);
        }
        Ok(())
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_refuses_garbage_and_keeps_serving() {
    let env = Env::start(Env::server()).await;
    let mut runner = TestRunner::new(Config {
        cases: 300,
        ..Config::default()
    });
    let bodies = prop::collection::vec(any::<u8>(), 0..200);
    let mut sent = 0;
    for _ in 0..300 {
        let body = bodies.new_tree(&mut runner).unwrap().current();
        match env.ax.submit_raw("q", body).await {
            Err(ClientError::Refused(e)) => assert_eq!(e.code, ErrorCode::BadRequest),
            other => panic!("garbage accepted or unanswered: {other:?}"),
        }
        sent += 1;
    }
    assert_eq!(env.stream_len("KV_AX_TASKS").await, 0, "nothing stored");
    let ok = env
        .ax
        .submit("q", ax_sdk::TaskSpec::new("fine"))
        .await
        .unwrap();
    assert!(!ok.duplicate);
    println!("fuzz live server: {sent} garbage submits refused, server still serving");
}
