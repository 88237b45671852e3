//! Flows from a [`Client`](crate::Client): DAGs of tasks — their definitions and checks
//! ([`def`]), builders, the run records in KV ([`model`], [`store`]) and the flow calls.
//! The engine that drives runs lives in the `ax-server` crate.

mod build;
pub mod child;
mod client;
pub mod def;
pub mod model;
mod request;
mod rerun;
pub mod store;

pub use ax_core::event::{ApprovalCompletion, Decision, OnTimeout};
pub use child::{ChildFlowDef, CHILD_FLOW_TASK};
pub use def::{
    ApprovalDef, FailurePolicy, FlowDef, Plan, SleepDef, StepDef, TriggerRule, WaitForEventDef,
    APPROVAL_TASK, SLEEP_TASK, WAIT_FOR_EVENT_TASK,
};
pub use model::{FlowRun, ParentRef, RunState, StepRun, StepState};
pub use request::{FlowName, FlowRequest, FlowRerun, FlowStart, RunFilter, RunRef};
pub use rerun::RerunMode;
