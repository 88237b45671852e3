//! # ax — a task scheduler native to NATS JetStream
//!
//! Services submit tasks by request/reply on `ax.submit.<queue>`; ax admits them
//! (validation, idempotency key, priority, bounded capacity), holds delayed ones, and puts
//! them on JetStream subjects partitioned by priority; workers pull, run and ack. JetStream is
//! the only source of truth: every process here holds caches it can rebuild.
//!
//! ## Module map
//! | module | concept |
//! |---|---|
//! | [`error`] | error codes on the wire, header-text validation (a leaf) |
//! | [`time`] | ms since the epoch, strict RFC 3339 (a leaf) |
//! | [`protocol`] | submit request / reply JSON |
//! | [`names`] | subjects, stream, bucket and consumer names, priorities |
//! | [`task`] | a validated task and its message headers |
//! | [`backoff`] | exponential backoff with jitter |
//! | [`state`] | task state records in the `AX_TASKS` KV bucket |
//! | [`kv_read`] | KV reads from a bucket's stream leader (see every acknowledged write) |
//! | [`output`] | task outputs: inline in the record or in the `AX_RESULTS` bucket |
//! | [`streams`] | the declarative topology in `streams/` and `apply` |
//! | [`submit`] | level-1 admission (server side) |
//! | [`schedule`] | delayed tasks: timer index and dispatch |
//! | [`server`] | `ax server`: admission + dispatch |
//! | [`worker`] | the Rust worker SDK |
//! | [`trigger`] | cron / interval / once / event triggers, their engine and API |
//! | [`client`] | the producer SDK |
//! | [`flow`] | flows: DAGs of tasks, their engine (one leader), API, re-runs |
//! | [`limits`] | rate limits and concurrency caps shared by all workers |
//! | [`metrics`] | Prometheus metric names and exporter |
#![warn(missing_docs, unreachable_pub, rustdoc::broken_intra_doc_links)]

pub mod backoff;
pub mod client;
pub mod console;
pub mod error;
pub mod flow;
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub mod hooks;
pub mod kv_read;
mod lease;
pub mod limits;
pub mod metrics;
pub mod names;
pub mod ops;
pub mod output;
pub mod protocol;
mod retry;
pub mod schedule;
pub mod server;
pub mod state;
pub mod streams;
pub mod submit;
mod supervisor;
pub mod task;
pub mod time;
pub mod trigger;
pub mod worker;

pub use client::{Client, ClientError, TaskSpec};
pub use error::ErrorKind;
pub use names::Priority;
pub use output::{Output, TaskOutput};
pub use server::{Server, ServerBuilder, ServerError};
pub use state::{TaskRecord, TaskState};
pub use worker::{Task, TaskError, Worker, WorkerBuilder};
