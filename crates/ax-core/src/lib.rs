//! # ax-core — the machinery ax-sdk and ax-server share (not a stable API)
//!
//! What a service links is `ax-sdk` (`Client`, `Worker` and the models of flows,
//! triggers and limits); this crate is what both it and the server are built on, kept
//! apart so that the SDK's public surface is what a service uses and nothing more (as
//! River keeps `rivershared`). Its items change with ax's releases without notice.
//!
//! Layers point down only (`.ci/layers` fails on an import cycle inside a crate, and on
//! anything in `wire` naming a module outside it).
//!
//! | layer | module | what it holds |
//! |---|---|---|
//! | stores | [`admit`] | admission written once: what is stored as its message alone, its subject and publish, the declared queues |
//! | | [`state`] | task records in the `AX_TASKS` KV bucket ([`unclaimed`]: a task with no record yet) |
//! | | [`results`] | outputs too large for their record, in `AX_RESULTS` |
//! | | [`idempotency`] | idempotency keys in `AX_IDEMPOTENCY` |
//! | | [`waits`] | the flows' pending waits for events, in `AX_WAITS` |
//! | | [`typed_kv`], [`kv_read`], [`key_wait`], [`atomic`] | JSON in KV by create or compare-and-set; reads from the stream leader; waiting for a key; atomic batch publish (ADR-50) and group commit |
//! | process | [`supervisor`], [`follow`], [`retry`], [`faults`] | named services restarted with backoff; following a stream across broker restarts; retrying a broker call; faults a test arms on a value |
//! | | [`metrics`] | Prometheus metric names (the process installs the exporter) |
//! | wire | [`wire`] | what the protocol carries: [`names`], [`time`], [`error`] codes, the submit [`protocol`], a [`task`]'s message and headers, its record and output, [`backoff`]; serde and pure functions, no I/O |
#![warn(missing_docs, unreachable_pub, rustdoc::broken_intra_doc_links)]

pub mod admit;
pub mod atomic;
pub mod faults;
pub mod follow;
pub mod idempotency;
pub mod key_wait;
pub mod kv_read;
pub mod metrics;
pub mod results;
pub mod retry;
pub mod state;
pub mod supervisor;
pub mod typed_kv;
pub mod unclaimed;
pub mod waits;
pub mod wire;

pub use wire::{backoff, batching, debounce, error, event, names, protocol, singleton, task, time};
