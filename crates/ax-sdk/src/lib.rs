//! # ax-sdk — producers and workers for ax, the task scheduler native to NATS JetStream
//!
//! What a service links to submit tasks ([`Client`]) or run them ([`Worker`]); no server,
//! console or command-line code is compiled in. The wire protocol (subjects, headers, JSON)
//! is docs/PROTOCOL.md; this crate is its Rust implementation, and the Python package binds
//! to it.
//!
//! ```no_run
//! use ax_sdk::{Client, Task, TaskSpec, Worker};
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let nats = async_nats::connect("nats://127.0.0.1:4222").await?;
//! // a producer
//! let task = TaskSpec::new("send").json(&serde_json::json!({"to": "a@example.com"}));
//! let accepted = Client::new(nats.clone()).submit("emails", task).await?;
//! // a worker
//! let worker = Worker::builder("emails")
//!     .task("send", |task: Task| async move {
//!         let body: serde_json::Value = task.json()?;
//!         Ok(body)
//!     })
//!     .build()?;
//! worker.run(nats, tokio_util::sync::CancellationToken::new()).await?;
//! # let _ = accepted; Ok(()) }
//! ```
//!
//! ## Module map
//! | module | concept |
//! |---|---|
//! | [`client`] | submit tasks, read their records and outputs, call the APIs |
//! | [`api`] | the request APIs: one entry per operation (`ax.<api>.<op>`) |
//! | [`worker`] | pull, claim, run and settle tasks (fencing, heartbeats, retries) |
//! | [`flow`] | flow definitions, builders and run records |
//! | [`ops`] | the operations calls: find, cancel, retry, replay, run now, pause |
//! | [`trigger`] | trigger definitions and the trigger calls |
//! | [`limits`] | rate limits and concurrency caps, and the gate every worker applies |
//! | [`settings`] | per-task options stored apart from code, applied live by every worker |
//! | [`error`] | error codes on the wire, [`ErrorKind`] (a leaf) |
//! | [`time`] | ms since the epoch, strict RFC 3339 (a leaf) |
//! | [`protocol`] | submit request / reply JSON |
//! | [`names`] | subjects, stream, bucket and consumer names, priorities |
//! | [`task`] | a validated task and its message headers |
//! | [`backoff`] | exponential backoff with jitter |
//! | [`state`] | task state records in the `AX_TASKS` KV bucket |
//! | [`atomic`] | atomic batch publish (ADR-50): many messages, one write, all or none |
//! | [`typed_kv`] | JSON values in KV written by create or compare-and-set, one error type |
//! | [`kv_read`] | KV reads from a bucket's stream leader (see every acknowledged write) |
//! | [`key_wait`] | waiting for a key's final value: a core subscription and leader reads, no consumer |
//! | [`output`] | task outputs: inline in the record or in the `AX_RESULTS` bucket |
//! | [`metrics`] | Prometheus metric names (the process installs the exporter) |
#![warn(missing_docs, unreachable_pub, rustdoc::broken_intra_doc_links)]

pub mod api;
pub mod atomic;
pub mod backoff;
pub mod client;
pub mod error;
pub mod flow;
/// Following a stream or bucket across broker restarts (shared with the server crate;
/// not a stable API).
#[doc(hidden)]
pub mod follow;
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub mod hooks;
pub mod idempotency;
pub mod key_wait;
pub mod kv_read;
pub mod limits;
pub mod metrics;
pub mod names;
pub mod ops;
pub mod output;
pub mod protocol;
/// Retrying a broker call with backoff (shared with the server crate; not a stable API).
#[doc(hidden)]
pub mod retry;
pub mod settings;
pub mod state;
/// Named long-running services restarted with backoff (shared with the server crate; not a
/// stable API).
#[doc(hidden)]
pub mod supervisor;
pub mod task;
pub mod time;
pub mod trigger;
pub mod typed_kv;
pub mod unclaimed;
pub mod worker;

pub use client::{Client, ClientError, TaskSpec};
pub use error::ErrorKind;
pub use names::Priority;
pub use output::{Output, TaskOutput};
pub use state::{TaskRecord, TaskState};
pub use worker::{Task, TaskError, Worker, WorkerBuilder};

#[cfg(test)]
mod readme {
    /// The code of the first ```` ```rust ```` / ```` ```no_run ```` block of `text`, with
    /// `//! ` prefixes, hidden (`#`) lines, comments and whitespace dropped.
    fn code(text: &str, fence: &str) -> String {
        let mut lines = text
            .lines()
            .map(|l| l.trim_start().trim_start_matches("//!").trim_start())
            .skip_while(|l| *l != fence)
            .skip(1);
        let mut out = String::new();
        for line in lines.by_ref().take_while(|l| !l.starts_with("```")) {
            if line.starts_with('#') {
                continue;
            }
            let code = line.split("//").next().unwrap_or_default();
            out.extend(code.chars().filter(|c| !c.is_whitespace()));
        }
        out
    }

    /// The README's Rust example is this crate's doc example (which the doc tests
    /// compile), laid out shorter: the same code once comments and whitespace are dropped.
    #[test]
    fn the_readme_example_is_the_crate_example() {
        let readme = code(include_str!("../../../README.md"), "```rust");
        let crate_doc = code(include_str!("lib.rs"), "```no_run");
        assert!(readme.contains("Worker::builder"), "{readme}");
        assert_eq!(readme, crate_doc);
    }
}
