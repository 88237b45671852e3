//! A worker's configuration, as its builder leaves it.

use super::{options, status};
use std::time::Duration;

/// What a worker is built with ([`WorkerBuilder`](super::WorkerBuilder) sets it; `fetch` runs it).
pub(crate) struct Config {
    pub(crate) queue: String,
    pub(crate) concurrency: usize,
    pub(crate) routes: options::Routes,
    pub(crate) id: String,
    pub(crate) shutdown_grace: Duration,
    pub(crate) idle_poll: Duration,
    pub(crate) max_batch: usize,
    pub(crate) weights: [u32; 3],
    /// Priority aging threshold ([`super::aging`]); none by default.
    pub(crate) aging: Option<Duration>,
    pub(crate) lean_first_attempt: bool,
    pub(crate) group_commit: crate::atomic::GroupCommit,
    pub(crate) flags: status::Flags,
    /// Faults a test armed (a slower claim, services that panic); none by default.
    pub(crate) faults: crate::faults::Faults,
}
