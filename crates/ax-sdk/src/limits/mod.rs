//! Limits: token-bucket rate limits and concurrency caps shared by
//! every worker process — per queue, per task name, per `limit_key` — kept in KV and
//! applied by each worker before it claims a delivery.
//!
//! - [`model`]: a limit's definition and its checks.
//! - [`gcra`]: the token bucket as one number (GCRA), a pure function.
//! - [`adaptive`]: rates that follow reported pressure (AIMD), pure functions.
//! - `decide`: what one read of a rate bucket decides for a delivery, a pure function.
//! - `gate`: the worker side (live definitions, tokens, slots).
//! - the `ax.limit.<op>` API is served by `ax server` (the `ax-server` crate).

pub mod adaptive;
mod client;
mod decide;
mod expiry;
pub(crate) mod gate;
pub mod gcra;
pub mod model;
mod request;

pub use ax_core::wire::fair;
pub use client::{LimitStatus, SlotHeld};
pub use model::{Excess, LimitDef};
pub use request::{LimitFilter, LimitName, LimitRequest};

/// The `AX_LIMITS` key that pauses a queue while it exists: `<queue>.=paused` (`=` is
/// never part of a limit name, so it cannot clash with one). Workers follow it with the
/// limit definitions and stop taking the queue's tasks; submits are still accepted.
pub fn pause_key(queue: &str) -> String {
    format!("{queue}.=paused")
}
