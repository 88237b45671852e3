//! Operations on tasks and queues from a [`Client`](crate::Client): find tasks, cancel,
//! retry, replay, run now, pause and resume (PROTOCOL.md §8). The server side lives in the
//! `ax-server` crate.

mod client;
mod query;
mod request;

pub use client::{OpOutcome, ReplayOutcome};
pub use query::{ListReply, ListRequest, PageCursor, TaskQuery, TaskRow};
pub use request::{QueuePause, SeriesFilter, TaskBulk, TaskPurge, TaskRef, TaskRequest, TaskRetry};
