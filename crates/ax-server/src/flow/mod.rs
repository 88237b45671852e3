//! Flows: DAGs of tasks whose outputs feed the next steps.
//!
//! - [`def`]: the definition and its checks (unknown steps, cycles named, fan-out, trigger
//!   rules, task templates checked as their submits would be).
//! - [`model`]: what a run stores (`AX_FLOW_RUNS`: the run, one record per step) and the
//!   deterministic ids of step tasks.
//! - [`advance`]: the state machine, a pure function of the steps and their tasks' ends.
//! - `engine` / `actor` / `shared`: the leader inside `ax server` that drives running runs.
//! - `api`: `ax.flow.<op>` requests (put, run, get, list, cancel, rerun, …); `singleton`:
//!   a start holding a singleton key (above `api` and the task operations).
//! - [`store`]: the two KV buckets.

mod actor;
pub mod advance;
pub(crate) mod api;
mod child_runs;
pub(crate) mod engine;
mod input;
mod shared;
mod singleton;
pub(crate) mod start;
pub(crate) mod waits;

pub use ax_sdk::flow::*;
