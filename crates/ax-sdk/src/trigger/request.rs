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
    /// The stored triggers' names, sorted, a page at a time.
    Names(TriggerNames),
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
    /// Only check the definitions; store nothing, answer `{"checked": n}` (default false).
    /// A file too large for one request is checked part by part first, then applied.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub check: bool,
    /// The position of `triggers[0]` in the whole file, for the field paths of errors
    /// (`triggers[<offset + i>].…`; default 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offset: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The body of `names`: `{"after"?}`, a page of the stored triggers' names.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggerNames {
    /// Only names after this one (in byte order); default from the first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
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
