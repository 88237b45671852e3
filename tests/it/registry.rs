//! The API registry (`ax_sdk::api::OPERATIONS`) against what serves it and what documents
//! it: every operation is answered over NATS and through the console (with the role the
//! registry gives it), and PROTOCOL.md's operation tables, its read-only list and its
//! list of index operations say exactly what the registry says.

use crate::console_guard::{console, send};
use crate::procs::free_port;
use crate::support::{within, Env};
use ax_core::error::WireError;
use ax_sdk::api::{operation, unknown_operation, Api, OPERATIONS};
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::Duration;

const ADMIN: &str = "registry-admin";
const VIEWER: &str = "registry-viewer";

fn protocol() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/PROTOCOL.md")).unwrap()
}

/// The names in backticks in `text`.
fn ticked(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The operations in the first table after `start` (a heading) in `doc`: the names in
/// the first column of each row.
fn table_ops(doc: &str, start: &str) -> BTreeSet<String> {
    let at = doc
        .find(start)
        .unwrap_or_else(|| panic!("PROTOCOL.md has {start:?}"));
    doc[at..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2) // the header and its rule
        .flat_map(|row| ticked(row.split('|').nth(1).unwrap_or_default()))
        .collect()
}

fn registered(api: Api) -> BTreeSet<String> {
    ax_sdk::api::operations(api)
        .map(|o| o.name.to_string())
        .collect()
}

#[test]
fn protocol_md_lists_exactly_the_registered_operations() {
    let doc = protocol();
    for (api, heading) in [
        (Api::Trigger, "## 5. Triggers"),
        (Api::Flow, "## 6. Flows"),
        (Api::Limit, "## 7. Limits"),
    ] {
        let section = &doc[doc.find(heading).unwrap()..];
        assert_eq!(
            table_ops(section, "### API"),
            registered(api),
            "{heading}: the API table against the registry"
        );
    }
    assert_eq!(
        table_ops(&doc, "## 8. Operating tasks"),
        registered(Api::Task),
        "§8: the operations table against the registry"
    );
    // The console's read-only role and the index's operations, as the doc lists them.
    let read_only = doc
        .split("(only\n")
        .nth(1)
        .and_then(|rest| rest.split("are read-only)").next())
        .expect("PROTOCOL.md lists the read-only operations");
    let listed: BTreeSet<String> = ticked(read_only).into_iter().collect();
    let marked: BTreeSet<String> = OPERATIONS
        .iter()
        .filter(|o| o.read_only)
        .map(|o| o.name.to_string())
        .collect();
    assert_eq!(listed, marked, "the read-only operations");
    let line = doc
        .lines()
        .find(|l| l.contains("are answered only by servers started with `--task-index`"))
        .expect("PROTOCOL.md lists the index's operations");
    let listed: BTreeSet<String> = ticked(line.split(" are answered").next().unwrap())
        .into_iter()
        .collect();
    let marked: BTreeSet<String> = OPERATIONS
        .iter()
        .filter(|o| o.needs_index)
        .map(|o| o.name.to_string())
        .collect();
    assert_eq!(listed, marked, "the index's operations");
}

/// The error in a `{"ok"}` / `{"error"}` reply, if any.
fn error_of(reply: &Value) -> Option<WireError> {
    reply
        .get("error")
        .map(|e| serde_json::from_value(e.clone()).expect("a typed error"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_registered_operation_is_served_over_nats_and_by_the_console_with_its_role() {
    within(Duration::from_secs(90), "registry", async {
        let port = free_port();
        let env = Env::start(
            Env::server()
                .task_index(true)
                .console(console(port).token(ADMIN).readonly_token(VIEWER)),
        )
        .await;
        // An empty body: most operations refuse it, none may call it an unknown operation.
        for o in OPERATIONS {
            let subject = o.api.subject(o.name);
            let reply = tokio::time::timeout(
                Duration::from_secs(10),
                env.client.request(subject.clone(), "{}".into()),
            )
            .await
            .unwrap_or_else(|_| panic!("{subject}: no answer in 10 s"))
            .unwrap_or_else(|e| panic!("{subject}: {e}"));
            let reply: Value = serde_json::from_slice(&reply.payload).unwrap();
            assert_ne!(
                error_of(&reply),
                Some(unknown_operation(o.api, o.name)),
                "{subject} is registered but its handler does not know it"
            );
        }
        // An operation the registry lacks is refused as unknown before any handler.
        let reply = env
            .client
            .request(Api::Flow.subject("frobnicate"), "{}".into())
            .await
            .unwrap();
        let reply: Value = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(
            error_of(&reply),
            Some(unknown_operation(Api::Flow, "frobnicate"))
        );
        // The console: the admin may call each; the viewer exactly the read-only ones.
        let host = format!("127.0.0.1:{port}");
        for o in OPERATIONS {
            let path = format!("/api/{}/{}", o.api.name(), o.name);
            for (token, allowed) in [(ADMIN, true), (VIEWER, o.read_only)] {
                let auth = format!("Bearer {token}");
                let a = send(
                    port,
                    "POST",
                    &path,
                    &[
                        ("host", &host),
                        ("content-type", "application/json"),
                        ("authorization", &auth),
                    ],
                    "{}",
                )
                .await;
                if !allowed {
                    assert_eq!(a.status, 403, "{path} as {token}: {}", a.body);
                    continue;
                }
                assert_eq!(a.status, 200, "{path} as {token}: {}", a.body);
                let reply: Value = serde_json::from_str(&a.body).unwrap();
                assert_ne!(
                    error_of(&reply),
                    Some(unknown_operation(o.api, o.name)),
                    "{path} as {token}"
                );
            }
        }
        assert!(operation(Api::Task, "frobnicate").is_none());
    })
    .await;
}

/// A management handler that panics (a bug) takes neither the server nor the console down:
/// over NATS and from the console the request is answered `unavailable`, counted in
/// `ax_request_panics_total{api}`, and the next request is served. A real `ax server`
/// process, its hook set by `AX_TEST_PANIC_REQUEST` (requests whose body holds the marker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_management_handler_answers_unavailable_and_the_server_serves_on() {
    within(Duration::from_secs(60), "request panic", async {
        let nats = ax_testkit::LocalNats::start().unwrap();
        let (console_port, metrics_port) = (free_port(), free_port());
        let console_addr = format!("127.0.0.1:{console_port}");
        let _server = crate::procs::AxProc::spawn_full(
            &nats.url(),
            &[
                "server",
                "--queue",
                "q",
                "--console-addr",
                &console_addr,
                "--console-token",
                ADMIN,
            ],
            &format!("127.0.0.1:{metrics_port}"),
            &[("AX_TEST_PANIC_REQUEST", "boom-marker")],
        );
        let client = async_nats::connect(nats.url()).await.unwrap();
        crate::procs::wait_ready(&client).await;
        let ask = |op: &'static str, body: &'static str| {
            let client = client.clone();
            async move {
                let reply = client
                    .request(Api::Task.subject(op), body.into())
                    .await
                    .unwrap();
                serde_json::from_slice::<Value>(&reply.payload).unwrap()
            }
        };
        let unavailable = |reply: &Value| {
            error_of(reply).map(|e| e.code) == Some(ax_core::protocol::ErrorCode::Unavailable)
        };
        let reply = ask("get", r#"{"id": "boom-marker"}"#).await;
        assert!(unavailable(&reply), "{reply}");
        let reply = ask("queues", "{}").await;
        assert!(reply["ok"]["queues"].is_array(), "{reply}");

        let auth = format!("Bearer {ADMIN}");
        let headers = [
            ("host", console_addr.as_str()),
            ("content-type", "application/json"),
            ("authorization", &auth),
        ];
        crate::support::eventually(Duration::from_secs(10), "the console to listen", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", console_port))
                .await
                .ok()
        })
        .await;
        let body = r#"{"id": "boom-marker"}"#;
        let a = send(console_port, "POST", "/api/task/get", &headers, body).await;
        let reply: Value = serde_json::from_str(&a.body).unwrap();
        assert!(unavailable(&reply), "{} {}", a.status, a.body);
        let a = send(
            console_port,
            "POST",
            "/api/task/get",
            &headers,
            r#"{"id": "x"}"#,
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.body);

        let metrics = crate::procs::scrape(metrics_port).await;
        let panics = metrics
            .lines()
            .find(|l| l.starts_with("ax_request_panics_total{") && l.contains("api=\"task\""))
            .unwrap_or_else(|| panic!("no request panics counted:\n{metrics}"));
        assert!(panics.ends_with(" 2"), "{panics}");
    })
    .await;
}
