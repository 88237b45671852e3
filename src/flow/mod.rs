//! Flows: DAGs of tasks whose outputs feed the next steps (issue 9, S0-4, S4-2).
//!
//! So far: [`def`], the definition and its checks (unknown steps, cycles named, fan-out,
//! trigger rules, task templates checked as their submits would be). Not built yet: the
//! engine that starts runs, keeps step states in KV and advances them on task completions,
//! re-runs and cancels, and the `ax flow` commands.

pub mod def;

pub use def::{FailurePolicy, FlowDef, Plan, StepDef, TriggerRule};
