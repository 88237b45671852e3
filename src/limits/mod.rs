//! Limits (issue 10, S2-3, S4-8): token-bucket rate limits and concurrency caps shared by
//! every worker process — per queue, per task name, per `limit_key` — kept in KV and
//! applied by each worker before it claims a delivery.
//!
//! - [`model`]: a limit's definition and its checks.
//! - [`gcra`]: the token bucket as one number (GCRA), a pure function.
//! - `gate`: the worker side (live definitions, tokens, slots).
//! - `api`: `ax.limit.<op>` requests served by `ax server`.

pub(crate) mod api;
pub(crate) mod gate;
pub mod gcra;
pub mod model;

pub use model::LimitDef;
