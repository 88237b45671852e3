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
//! Priorities, many submits in one call, a worker's concurrency and a task's fencing token:
//!
//! ```no_run
//! use ax_sdk::{Client, Priority, Task, TaskError, TaskSpec, Worker};
//! # async fn send(_to: &str, _token: u64) -> Result<(), std::io::Error> { Ok(()) }
//! # async fn demo(nats: async_nats::Client, specs: Vec<TaskSpec>,
//! #     shutdown_token: tokio_util::sync::CancellationToken) -> Result<(), Box<dyn std::error::Error>> {
//! // producer
//! let ax = Client::new(nats.clone());
//! let accepted = ax
//!     .submit("emails", TaskSpec::new("send_welcome").json(&"a@example.com").priority(Priority::High))
//!     .await?;
//! let answers = ax.submit_many("emails", specs).await; // one answer per task, in order
//!
//! // worker
//! Worker::builder("emails")
//!     .concurrency(32)
//!     .handler(|task: Task| async move {
//!         let to: String = task.json()?; // decode errors are non-retryable
//!         let token = task.fencing_token().await?; // writes `running` first if not yet done
//!         send(&to, token).await.map_err(|e| TaskError::new("smtp", e.to_string()))?;
//!         Ok(())
//!     })
//!     .build()?
//!     .run(nats, shutdown_token) // returns after a graceful drain
//!     .await?;
//! # let _ = (accepted, answers); Ok(()) }
//! ```
//!
//! ## Module map
//! Layers point down only (`.ci/layers` fails on an import cycle inside a crate, and on
//! anything in `wire` naming a module outside it).
//!
//! | layer | module | concept |
//! |---|---|---|
//! | API | [`client`] | submit tasks, read their records and outputs, wait, call the APIs |
//! | | [`worker`] | pull, claim, run and settle tasks (fencing, heartbeats, retries) |
//! | | [`flow`], [`ops`], [`trigger`], [`limits`], [`settings`] | each area's models and its calls on a [`Client`]; `limits` also holds the gate every worker applies |
//! | | [`api`] | the request APIs: one entry per operation (`ax.<api>.<op>`) |
//! | stores | [`state`] | task records in the `AX_TASKS` KV bucket ([`unclaimed`]: a task with no record yet) |
//! | | [`output`] | outputs: what a handler returns, and the `AX_RESULTS` bucket |
//! | | [`idempotency`] | idempotency keys in `AX_IDEMPOTENCY` |
//! | | [`typed_kv`], [`kv_read`], [`key_wait`], [`atomic`] | JSON in KV by create or compare-and-set; reads from the stream leader; waiting for a key; atomic batch publish (ADR-50) |
//! | | [`metrics`] | Prometheus metric names (the process installs the exporter) |
//! | wire | [`wire`] | what the protocol carries: [`names`], [`time`], [`error`] codes and [`ErrorKind`], the submit [`protocol`], a [`task`]'s message and headers, its [`record`](wire::record) and [`output`](wire::output), [`backoff`]; serde and pure functions, no I/O |
#![warn(missing_docs, unreachable_pub, rustdoc::broken_intra_doc_links)]

pub mod api;
pub mod atomic;
pub mod client;
/// Faults injected by tests, as a value held by a server or worker (not a stable API).
#[doc(hidden)]
pub mod faults;
pub mod flow;
/// Following a stream or bucket across broker restarts (shared with the server crate;
/// not a stable API).
#[doc(hidden)]
pub mod follow;
pub mod idempotency;
pub mod key_wait;
pub mod kv_read;
pub mod limits;
pub mod metrics;
pub mod ops;
pub mod output;
/// Retrying a broker call with backoff (shared with the server crate; not a stable API).
#[doc(hidden)]
pub mod retry;
pub mod settings;
pub mod state;
/// Named long-running services restarted with backoff (shared with the server crate; not a
/// stable API).
#[doc(hidden)]
pub mod supervisor;
pub mod trigger;
pub mod typed_kv;
pub mod unclaimed;
pub mod wire;
pub mod worker;

pub use wire::{backoff, error, names, protocol, task, time};

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
    fn code(text: &str, fence: &str, nth: usize) -> String {
        let mut lines = text
            .lines()
            .map(|l| l.trim_start().trim_start_matches("//!").trim_start());
        for _ in 0..=nth {
            lines.by_ref().find(|l| *l == fence);
        }
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

    /// The README's Rust examples are this crate's doc examples (which the doc tests
    /// compile), laid out shorter: the same code once comments and whitespace are dropped.
    #[test]
    fn the_readme_examples_are_the_crate_examples() {
        for nth in 0..2 {
            let readme = code(include_str!("../../../README.md"), "```rust", nth);
            let crate_doc = code(include_str!("lib.rs"), "```no_run", nth);
            assert!(readme.contains("Worker::builder"), "{readme}");
            assert_eq!(readme, crate_doc, "example {nth}");
        }
    }
}
