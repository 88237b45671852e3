//! The request APIs a server answers, one entry per operation: `ax.<api>.<op>` over NATS
//! and `POST /api/<api>/<op>` on the console (PROTOCOL.md §5–§8).
//!
//! The server routes by this table (an operation not in it is answered
//! [`unknown_operation`] when [`Request::decode`] reads it, before the handler acts), subscribes the index's operations only
//! where it keeps an index, and lets the console's read-only role call exactly the
//! operations marked [`Operation::read_only`]. A test reads PROTOCOL.md's tables and checks
//! them against this one, and calls every entry over NATS and through the console.

use crate::error::{ErrorCode, WireError};
use crate::names;

/// One of the request APIs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `ax.task.<op>`: operating tasks and queues.
    Task,
    /// `ax.flow.<op>`: flow definitions and runs.
    Flow,
    /// `ax.limit.<op>`: rate limits and concurrency caps.
    Limit,
    /// `ax.trigger.<op>`: triggers.
    Trigger,
}

impl Api {
    /// Every API.
    pub const ALL: [Api; 4] = [Api::Task, Api::Flow, Api::Limit, Api::Trigger];

    /// The API's name in subjects and console paths: `task`, `flow`, `limit`, `trigger`.
    pub fn name(self) -> &'static str {
        match self {
            Api::Task => "task",
            Api::Flow => "flow",
            Api::Limit => "limit",
            Api::Trigger => "trigger",
        }
    }

    /// The API by its name.
    pub fn from_name(name: &str) -> Option<Api> {
        Api::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The subject prefix of its requests (`ax.task.`, …).
    pub fn prefix(self) -> &'static str {
        match self {
            Api::Task => names::TASK_API_PREFIX,
            Api::Flow => names::FLOW_API_PREFIX,
            Api::Limit => names::LIMIT_API_PREFIX,
            Api::Trigger => names::TRIGGER_API_PREFIX,
        }
    }

    /// The subject of operation `op`: `ax.<api>.<op>`.
    pub fn subject(self, op: &str) -> String {
        format!("{}{op}", self.prefix())
    }
}

/// One operation of an API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operation {
    /// Its API.
    pub api: Api,
    /// Its name, the last token of the subject.
    pub name: &'static str,
    /// It changes nothing: the console's read-only role may call it.
    pub read_only: bool,
    /// Only servers that keep the task index answer it (`--task-index`).
    pub needs_index: bool,
}

const fn op(api: Api, name: &'static str, read_only: bool, needs_index: bool) -> Operation {
    Operation {
        api,
        name,
        read_only,
        needs_index,
    }
}

const R: bool = true;
const W: bool = false;
const INDEX: bool = true;
const ANY: bool = false;

/// Every operation of every API.
pub const OPERATIONS: &[Operation] = &[
    op(Api::Task, "get", R, ANY),
    op(Api::Task, "events", R, ANY),
    op(Api::Task, "payload", R, ANY),
    op(Api::Task, "cancel", W, ANY),
    op(Api::Task, "retry", W, ANY),
    op(Api::Task, "run_now", W, ANY),
    op(Api::Task, "pause", W, ANY),
    op(Api::Task, "resume", W, ANY),
    op(Api::Task, "list", R, INDEX),
    op(Api::Task, "queues", R, INDEX),
    op(Api::Task, "series", R, INDEX),
    op(Api::Task, "replay", W, INDEX),
    op(Api::Task, "cancel_many", W, INDEX),
    op(Api::Task, "purge", W, INDEX),
    op(Api::Task, "options_put", W, ANY),
    op(Api::Task, "options_get", R, ANY),
    op(Api::Task, "options_list", R, ANY),
    op(Api::Task, "options_delete", W, ANY),
    op(Api::Flow, "put", W, ANY),
    op(Api::Flow, "def", R, ANY),
    op(Api::Flow, "defs", R, ANY),
    op(Api::Flow, "delete", W, ANY),
    op(Api::Flow, "run", W, ANY),
    op(Api::Flow, "get", R, ANY),
    op(Api::Flow, "list", R, ANY),
    op(Api::Flow, "leader", R, ANY),
    op(Api::Flow, "cancel", W, ANY),
    op(Api::Flow, "rerun", W, ANY),
    op(Api::Flow, "approve", W, ANY),
    op(Api::Flow, "approve_task", W, ANY),
    op(Api::Flow, "approvals", R, ANY),
    op(Api::Limit, "put", W, ANY),
    op(Api::Limit, "get", R, ANY),
    op(Api::Limit, "list", R, ANY),
    op(Api::Limit, "delete", W, ANY),
    op(Api::Limit, "status", R, ANY),
    op(Api::Limit, "windows", R, ANY),
    op(Api::Limit, "fair_put", W, ANY),
    op(Api::Limit, "fair_get", R, ANY),
    op(Api::Trigger, "put", W, ANY),
    op(Api::Trigger, "apply", W, ANY),
    op(Api::Trigger, "get", R, ANY),
    op(Api::Trigger, "list", R, ANY),
    op(Api::Trigger, "names", R, ANY),
    op(Api::Trigger, "leader", R, ANY),
    op(Api::Trigger, "pause", W, ANY),
    op(Api::Trigger, "resume", W, ANY),
    op(Api::Trigger, "delete", W, ANY),
    op(Api::Trigger, "run", W, ANY),
];

/// Operation `name` of `api`, if there is one.
pub fn operation(api: Api, name: &str) -> Option<&'static Operation> {
    OPERATIONS.iter().find(|o| o.api == api && o.name == name)
}

/// The operations of `api`.
pub fn operations(api: Api) -> impl Iterator<Item = &'static Operation> {
    OPERATIONS.iter().filter(move |o| o.api == api)
}

/// The answer to an operation that is not in [`OPERATIONS`] (`bad_request`).
pub fn unknown_operation(api: Api, op: &str) -> WireError {
    WireError::new(
        ErrorCode::BadRequest,
        format!("unknown {} operation {op:?}", api.name()),
    )
}

/// A typed request of one API: an enum whose variant is the operation and whose content
/// is the request's JSON body, in serde's adjacently tagged form (`{"op": …, "body": …}`,
/// `rename_all = "snake_case"`). The server decodes every request through it and the
/// [`Client`](crate::Client) encodes its typed calls with it, so both sides share one type
/// per request body.
///
/// Each enum ends with a hidden unit variant marked `#[serde(other)]`: the tag alone
/// decodes to it for an operation the enum lacks, which tells an unknown operation from a
/// body that does not decode by type, not by an error's text.
pub trait Request: serde::Serialize + serde::de::DeserializeOwned {
    /// The API whose subjects carry it.
    const API: Api;

    /// True for the catch-all variant (an operation this enum does not have).
    fn is_unknown(&self) -> bool;

    /// Decodes a request to `ax.<api>.<op>` with `body` (an empty body reads as `{}`):
    /// [`unknown_operation`] for an operation the registry or this enum lacks,
    /// `bad_request` for a body that does not decode.
    fn decode(op: &str, body: &[u8]) -> Result<Self, WireError> {
        let unknown = || unknown_operation(Self::API, op);
        operation(Self::API, op).ok_or_else(unknown)?;
        let tag: Result<Self, _> = serde_json::from_value(serde_json::json!({ "op": op }));
        if tag.is_ok_and(|r| r.is_unknown()) {
            return Err(unknown());
        }
        let bad = |e: serde_json::Error| WireError::new(ErrorCode::BadRequest, e.to_string());
        let body: serde_json::Value = match body.iter().all(u8::is_ascii_whitespace) {
            true => serde_json::json!({}),
            false => serde_json::from_slice(body).map_err(bad)?,
        };
        serde_json::from_value(serde_json::json!({ "op": op, "body": body })).map_err(bad)
    }

    /// The operation and the JSON body this request is sent with.
    fn encode(&self) -> (String, serde_json::Value) {
        let mut v = serde_json::to_value(self).expect("a request serializes");
        let op = v["op"].as_str().unwrap_or_default().to_string();
        (op, v["body"].take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn each_operation_is_listed_once_with_a_subject_token_name() {
        let mut seen = HashSet::new();
        for o in OPERATIONS {
            assert!(seen.insert((o.api, o.name)), "{o:?} twice");
            assert!(names::valid_token(o.name, 32), "{o:?}");
            assert_eq!(operation(o.api, o.name), Some(o));
        }
        assert_eq!(operation(Api::Task, "frobnicate"), None);
        // Only the task API has operations that need the index.
        assert!(OPERATIONS
            .iter()
            .all(|o| !o.needs_index || o.api == Api::Task));
        for api in Api::ALL {
            assert_eq!(Api::from_name(api.name()), Some(api));
            assert!(operations(api).count() > 0);
        }
    }

    /// True if `R` has no variant for operation `op` (its tag alone decodes to the
    /// catch-all).
    fn lacks<R: Request>(op: &str) -> bool {
        serde_json::from_value::<R>(serde_json::json!({ "op": op })).is_ok_and(|r| r.is_unknown())
    }

    #[test]
    fn each_registered_operation_has_a_typed_request_and_no_other_decodes() {
        use crate::flow::FlowRequest;
        use crate::limits::LimitRequest;
        use crate::ops::TaskRequest;
        use crate::trigger::TriggerRequest;
        for o in OPERATIONS {
            let lacking = match o.api {
                Api::Task => lacks::<TaskRequest>(o.name),
                Api::Flow => lacks::<FlowRequest>(o.name),
                Api::Limit => lacks::<LimitRequest>(o.name),
                Api::Trigger => lacks::<TriggerRequest>(o.name),
            };
            assert!(!lacking, "{o:?} has no request variant");
        }
        assert!(lacks::<TaskRequest>("frobnicate"));
        // Unknown operations are refused as such; a bad body is a bad request of a known
        // operation, with the decoder's words.
        let unknown = TaskRequest::decode("frobnicate", b"{}").unwrap_err();
        assert_eq!(unknown, unknown_operation(Api::Task, "frobnicate"));
        let bad = LimitRequest::decode("get", br#"{"queue": "q"}"#).unwrap_err();
        assert_eq!(bad.code, ErrorCode::BadRequest);
        assert_ne!(bad, unknown_operation(Api::Limit, "get"));
        let bad = FlowRequest::decode("run", b"not json").unwrap_err();
        assert_eq!(bad.code, ErrorCode::BadRequest);
        // An empty body reads as `{}`; a request encodes back to its operation and body.
        assert_eq!(
            TriggerRequest::decode("leader", b"").unwrap(),
            TriggerRequest::Leader {}
        );
        let get = LimitRequest::decode("get", br#"{"queue": "q", "name": "n"}"#).unwrap();
        assert_eq!(
            get.encode(),
            (
                "get".to_string(),
                serde_json::json!({"queue": "q", "name": "n"})
            )
        );
    }
}
