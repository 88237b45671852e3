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
//! | module | concept |
//! |---|---|
//! | [`client`] | submit tasks, read their records and outputs, wait, call the APIs |
//! | [`worker`] | pull, claim, run and settle tasks (fencing, heartbeats, retries) |
//! | [`flow`], [`ops`], [`trigger`], [`limits`], [`settings`] | each area's models and its calls on a [`Client`]; `limits` also holds the gate every worker applies |
//! | [`api`] | the request APIs: one entry per operation (`ax.<api>.<op>`) |
//! | [`output`] | what a handler returns |
//!
//! The stores, the wire layer (subjects, headers, the JSON of requests and records) and
//! the JetStream idioms under them are the `ax-core` crate, which the server shares; the
//! protocol's types a service meets are re-exported here.
#![warn(missing_docs, unreachable_pub, rustdoc::broken_intra_doc_links)]

pub mod api;
pub mod client;
mod direct;
pub mod flow;
pub mod limits;
pub mod ops;
pub mod output;
pub mod settings;
pub mod trigger;
pub mod worker;

// The shared machinery, under the paths this crate's modules name it by.
pub(crate) use ax_core::{
    admit, atomic, backoff, error, faults, follow, idempotency, key_wait, kv_read, metrics, names,
    protocol, retry, state, supervisor, task, time, typed_kv, wire,
};

pub use client::{Client, ClientError, TaskSpec};
pub use error::ErrorKind;
pub use names::Priority;
pub use output::{Output, TaskOutput};
pub use state::{TaskRecord, TaskState};
pub use worker::{Task, TaskError, Worker, WorkerBuilder};

// The protocol's types this crate's calls take or return (defined in ax-core).
pub use ax_core::atomic::GroupCommit;
pub use ax_core::state::ListFilter;
pub use ax_core::wire::error::WireError;
pub use ax_core::wire::protocol::{BackoffRequest, SubmitAccepted, SubmitRequest};
pub use ax_core::wire::record::ErrorInfo;
pub use ax_core::wire::singleton::Collision;
pub use ax_core::wire::task::Limits;

#[cfg(test)]
mod surface {
    /// The SDK's public items (`pub fn`, `struct`, `enum`, `const`, `type`, `trait`,
    /// `static`; each file up to its `#[cfg(test)]`), as docs/ARCHITECTURE.md counts them.
    fn public_items(dir: &std::path::Path) -> usize {
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                n += public_items(&path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                n += text
                    .lines()
                    .take_while(|l| !l.contains("#[cfg(test)]"))
                    .filter(|l| {
                        let l = l.trim_start().strip_prefix("pub ").unwrap_or("");
                        let l = l.strip_prefix("async ").unwrap_or(l);
                        [
                            "fn ", "struct ", "enum ", "const ", "type ", "trait ", "static ",
                        ]
                        .iter()
                        .any(|k| l.starts_with(k))
                    })
                    .count();
            }
        }
        n
    }

    /// What a service uses stays small: the stores and machinery live in ax-core. A new
    /// public item past the budget is a decision (raise it here and in ARCHITECTURE.md).
    #[test]
    fn the_public_surface_stays_within_its_budget() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let n = public_items(&src);
        assert!(n <= 326, "ax-sdk has {n} public items; the budget is 326");
        assert!(
            n >= 250,
            "{n}: the count no longer sees the items (the budget means nothing)"
        );
    }
}

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
