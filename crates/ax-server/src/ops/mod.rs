//! Operating ax: finding tasks and acting on them.
//!
//! - `index`: every task's searchable fields, kept from the task-state feed.
//! - `feed`: follows `KV_AX_TASKS` and `AX_DEAD` into the index.
//! - `actions`: cancel, retry, replay, run now, pause and resume.
//! - `stop`: a cancel repeated until the task is stopped (the server's own cancels).
//! - `settings`: task settings stored apart from code (`options_put`, …).
//! - `alerts`: one alert per burst of terminal failures, on NATS and a webhook.
//! - `api`: `ax.task.<op>` requests served by `ax server` (docs/PROTOCOL.md §8).

pub(crate) mod actions;
pub mod alerts;
pub(crate) mod api;
pub(crate) mod feed;
pub(crate) mod holder;
pub(crate) mod index;
mod inspect;
mod purge;
pub(crate) mod series;
mod settings;
pub(crate) mod stop;
mod webhook;

pub use alerts::AlertConfig;
pub use ax_sdk::ops::*;
