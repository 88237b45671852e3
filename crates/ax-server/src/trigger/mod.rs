//! Triggers: one place for every "run this at that time".
//!
//! | module | concept |
//! |---|---|
//! | [`model`] | definitions: kind, policies, task templates |
//! | [`recur`] | `next_after` for cron (with time zones), intervals, once |
//! | [`plan`] | what fires now: misfire, overlap, drift, clock steps — a pure function |
//! | [`store`] | definitions and state in KV |
//! | `feed` | the trigger buckets followed: pulled in batches, not pushed |
//! | `engine` | the leader that fires (inside `ax server`) |
//! | `lease` | the leader lease: monotonic-clock expiry, revision as fencing token |
//! | `fire` | one fire: task ids, submitting, unfinished tasks |
//! | `api` | the NATS request API on `ax.trigger.<op>` |
//! | `events` | event triggers: a subject whose messages start fires |
//!
//! Exactly-once fires across servers: a scheduled fire's task ids are derived from the
//! trigger, the scheduled time and the template index (`<queue>.tr.<name>.<ms>.<i>`), so
//! whichever server fires a scheduled time, and however often after a crash, one task
//! exists per template and time. A leader lease (KV compare-and-set, the revision is the
//! fencing token, checked against every trigger state it writes) keeps the servers from
//! doing the same work twice.

pub(crate) mod api;
mod apply;
pub mod clock;
pub(crate) mod engine;
pub(crate) mod events;
mod feed;
pub(crate) mod fire;
pub use ax_sdk::trigger::model;
pub mod plan;
pub mod recur;
pub mod store;

pub use model::{Kind, MisfirePolicy, OverlapPolicy, TriggerDef};
pub use plan::{Source, TriggerState};
pub use recur::Validate;
