//! The trigger API's requests (`ax.trigger.<op>`, PROTOCOL.md §5) as one typed enum.

use crate::api::{Api, Request};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A request to the trigger API: the variant is the operation, its content the body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "body", rename_all = "snake_case")]
pub enum TriggerRequest {
    /// Store a trigger. Its body stays JSON here: the server checks it field by field
    /// ([`TriggerDef::decode`](super::TriggerDef::decode)) to name the field at fault.
    Put(Value),
    /// Store a set of triggers at once, deleting the others unless `prune` is false.
    Apply(TriggerApply),
    /// One trigger with its state and next fires.
    Get(TriggerRef),
    /// Every trigger, with its next fire and counts.
    List {},
    /// Which server's trigger engine fires now.
    Leader {},
    /// Stop firing a trigger.
    Pause(TriggerRef),
    /// Fire a paused trigger again (the times it was paused for are skipped).
    Resume(TriggerRef),
    /// Delete a trigger (the tasks it made stay).
    Delete(TriggerRef),
    /// Fire a trigger now (`force`: even while its last fire's tasks run).
    Run(TriggerRef),
    /// An operation this enum does not have (never sent).
    #[doc(hidden)]
    #[serde(other)]
    Unknown,
}

/// Names one trigger: `{"name", "force"?}` (`force` matters to `run` only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggerRef {
    /// The trigger's name.
    pub name: String,
    /// `run`: fire even while the previous fire's tasks are unfinished.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

impl TriggerRef {
    /// The trigger `name`, without `force`.
    pub fn new(name: impl Into<String>) -> TriggerRef {
        TriggerRef {
            name: name.into(),
            force: false,
        }
    }
}

/// The body of `apply`: `{"triggers": [definition, …], "prune"?}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggerApply {
    /// The definitions, each checked like a `put`'s.
    pub triggers: Vec<Value>,
    /// Delete the stored triggers not in `triggers` (default true).
    #[serde(default = "yes")]
    pub prune: bool,
}

fn yes() -> bool {
    true
}

impl Request for TriggerRequest {
    const API: Api = Api::Trigger;
    fn is_unknown(&self) -> bool {
        matches!(self, TriggerRequest::Unknown)
    }
}
