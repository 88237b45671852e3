//! # ax-server — the ax server: admission, delayed dispatch, triggers, flows, operations
//!
//! Services submit tasks by request/reply on `ax.submit.<queue>`; the server admits them
//! (validation, idempotency key, priority, bounded capacity), holds delayed ones, and puts
//! them on JetStream subjects partitioned by priority; workers (`ax-sdk`) pull, run and
//! ack. JetStream is the only source of truth: every process here holds caches it can
//! rebuild. What producers and workers need lives in `ax-sdk`, below this crate.
//!
//! ## Module map
//! | module | concept |
//! |---|---|
//! | [`streams`] | the declarative topology in `streams/` and `apply` |
//! | [`submit`] | admission |
//! | `intake` / `singleton` | the entry of a single submit; singleton keys claimed at submit |
//! | [`schedule`] | delayed tasks: timer index and dispatch |
//! | `fair` | fair shares between tenants: held tasks released in weighted fair order |
//! | [`server`] | `ax server`: admission, dispatch and the services below |
//! | [`trigger`] | cron / interval / once / event triggers, their engine and API |
//! | [`flow`] | the flow engine (one leader), its API and re-runs |
//! | `event_wait` | the event matcher (one leader): ends the flows' waits for events |
//! | [`limits`] | the limits API |
//! | [`ops`] | the task index, operations, alerts |
//! | [`console`] | the web console |
#![warn(missing_docs, unreachable_pub, rustdoc::broken_intra_doc_links)]

mod approval;
pub mod console;
mod context;
mod event_wait;
mod fair;
pub mod flow;
mod intake;
mod lease;
pub mod limits;
pub mod ops;
pub mod schedule;
pub mod server;
mod singleton;
pub mod streams;
pub mod submit;
pub mod trigger;

pub use server::{Server, ServerBuilder, ServerError};
