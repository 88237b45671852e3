//! The limits API's requests (`ax.limit.<op>`, PROTOCOL.md §7) as one typed enum.

use super::model::LimitDef;
use crate::api::{Api, Request};
use serde::{Deserialize, Serialize};

/// A request to the limits API: the variant is the operation, its content the body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "body", rename_all = "snake_case")]
pub enum LimitRequest {
    /// Store a limit (checked first).
    Put(LimitDef),
    /// One limit.
    Get(LimitName),
    /// Delete one limit.
    Delete(LimitName),
    /// The limits of a queue, or of every queue.
    List(LimitFilter),
    /// Like `List`, with what each holds now.
    Status(LimitFilter),
    /// The debounce windows and batches waiting now, of a queue or of every queue.
    Windows(LimitFilter),
    /// Store a queue's fair-share definition (checked first).
    FairPut(ax_core::wire::fair::FairDef),
    /// A queue's fair-share definition and what the fair dispatcher last reported of it.
    FairGet(ax_core::wire::fair::FairQueue),
    /// An operation this enum does not have (never sent).
    #[doc(hidden)]
    #[serde(other)]
    Unknown,
}

/// Names one limit: `{"queue", "name"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitName {
    /// Its queue.
    pub queue: String,
    /// Its name.
    pub name: String,
}

/// Picks the limits of one queue (`{"queue"}`), or of every queue (`{}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitFilter {
    /// Only this queue's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

impl Request for LimitRequest {
    const API: Api = Api::Limit;
    fn is_unknown(&self) -> bool {
        matches!(self, LimitRequest::Unknown)
    }
}
