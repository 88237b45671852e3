//! Triggers from a [`Client`](crate::Client): their definitions ([`model`]) and typed
//! calls of `ax.trigger.<op>` (PROTOCOL.md §5). The engine that fires them, and the
//! parsing of cron expressions and time zones, live in the `ax-server` crate.

mod client;
pub mod model;
mod request;

pub use client::{Applied, ApplyStage, ManualRun, PutOutcome, TriggerInfo, TriggerSummary};
pub use model::{Kind, MisfirePolicy, OverlapPolicy, TriggerDef};
pub use request::{TriggerApply, TriggerNames, TriggerRef, TriggerRequest};
