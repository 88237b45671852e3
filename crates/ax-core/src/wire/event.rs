//! Events that flows wait for (docs/PROTOCOL.md §6, "Events"): what a pending wait
//! stores in `AX_WAITS`, and how an event's payload is matched against it. Pure data.
//!
//! An event is any JSON published on `ax.events.<name>`. A wait matches an event of its
//! name when every field path of its `match` (dotted, `order.id`) is present in the
//! event's payload with an equal JSON value (`1` and `1.0` differ, as their text does),
//! and the event was stored at or after the wait's `since_ms`.
//!
//! An approval (docs/PROTOCOL.md §6, "Approvals") is a wait of the same bucket with no
//! event: its registration names the step and holds its token's secret, and a
//! completion that presents the token ends it.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// A flow's pending wait for an event: the value of its key (the wait task's id) in
/// `AX_WAITS`, written before the wait task is accepted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WaitRegistration {
    /// The wait task's id (also the key).
    pub task: String,
    /// The event name (`ax.events.<event>`).
    pub event: String,
    /// Field path → the value it must have, resolved when the step started.
    #[serde(default, rename = "match")]
    pub matches: BTreeMap<String, Value>,
    /// Events stored at or after this time count (the step's start less its lookback).
    pub since_ms: u64,
    /// When the wait times out (its wait task's due time).
    pub until_ms: u64,
    /// An approval's step and token (then `event` is empty and `match` too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalWait>,
    /// What a wait for an event does at its timeout (its wait task's `Ax-Wait`): the
    /// matcher ends it so once it has read every event stored up to the timeout. Absent
    /// (a registration stored before 2026-12-07): the timeout's dispatch ends it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<OnTimeout>,
}

/// What an approval's registration holds beside its times.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalWait {
    /// The flow, run and step it belongs to.
    pub flow: String,
    /// The run's id.
    pub run: String,
    /// The step's name.
    pub step: String,
    /// What the approver is asked (the step's `message`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The token's secret: drawn by the submit that stores the registration, kept only
    /// in `AX_WAITS` (never in the wait task's message, which workers' streams hold).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

/// A completion of an approval (`ax.flow.approve`, docs/PROTOCOL.md §6, "Approvals"):
/// by its `token` (whoever holds it), or by its wait `task` id (a caller of the
/// management API, the console's buttons); exactly one of the two.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalCompletion {
    /// The token the approval's start announced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// The approval's wait task id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    /// Approve or reject.
    pub decision: Decision,
    /// An approval's payload (in the step's output; default `null`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Value>,
    /// A rejection's reason (the step's error message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// What a completion decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// The step succeeds, output `{"decision": "approved", "payload"}`.
    Approve,
    /// The step fails, class `approval_rejected` (its `on_failure` applies).
    Reject,
}

/// An approval's token: `<wait task id>~<secret>` (URL-safe: task ids are `A-Z a-z 0-9
/// _ - .`, secrets hex).
pub fn approval_token(task: &str, secret: &str) -> String {
    format!("{task}~{secret}")
}

/// A token taken apart: `(wait task id, secret)`, or `None` if it is not one.
pub fn parse_approval_token(token: &str) -> Option<(&str, &str)> {
    let (task, secret) = token.rsplit_once('~')?;
    let ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 512
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    };
    (ok(task) && ok(secret)).then_some((task, secret))
}

impl WaitRegistration {
    /// The field paths it matches on, in order: its events are indexed by these.
    pub fn fields(&self) -> Vec<String> {
        self.matches.keys().cloned().collect()
    }

    /// The values it wants, in [`WaitRegistration::fields`] order, as one key.
    pub fn key(&self) -> String {
        let values: Vec<&Value> = self.matches.values().collect();
        serde_json::to_string(&values).expect("JSON values serialize")
    }
}

/// The value at dotted `path` in `payload` (`a.b` is `payload["a"]["b"]`).
pub fn field<'a>(payload: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(payload, |v, part| v.get(part))
}

/// The key of `payload`'s values at `fields` (as [`WaitRegistration::key`] makes it), or
/// `None` when one is missing.
pub fn key_of(payload: &Value, fields: &[String]) -> Option<String> {
    let values = fields
        .iter()
        .map(|f| field(payload, f))
        .collect::<Option<Vec<&Value>>>()?;
    Some(serde_json::to_string(&values).expect("JSON values serialize"))
}

/// What a wait for an event does when it times out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// The step fails (its `on_failure` applies): the wait task ends `dead`, class
    /// `wait_timed_out`.
    #[default]
    Fail,
    /// The step succeeds with output `null`.
    Continue,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_token_names_its_wait_and_its_secret() {
        let token = approval_token("q.fl.R1.ok.0.0", "0a1b");
        assert_eq!(token, "q.fl.R1.ok.0.0~0a1b");
        assert_eq!(
            parse_approval_token(&token),
            Some(("q.fl.R1.ok.0.0", "0a1b"))
        );
        for bad in ["", "~", "q~", "~s", "q.fl/x~s", "q~s/../x", "q s~s"] {
            assert_eq!(parse_approval_token(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_wait_and_an_event_meet_on_the_same_key_and_not_otherwise() {
        let reg: WaitRegistration = serde_json::from_value(json!({
            "task": "q.fl.r.w.0.0", "event": "order.paid", "since_ms": 1, "until_ms": 9,
            "match": {"order_id": 42, "customer.tier": "gold"}}))
        .unwrap();
        let fields = reg.fields();
        assert_eq!(fields, ["customer.tier", "order_id"]);
        let paid = json!({"order_id": 42, "customer": {"tier": "gold", "x": 1}, "amount": 5});
        assert_eq!(key_of(&paid, &fields), Some(reg.key()));
        let other = json!({"order_id": 43, "customer": {"tier": "gold"}});
        assert_ne!(key_of(&other, &fields), Some(reg.key()));
        let float = json!({"order_id": 42.0, "customer": {"tier": "gold"}});
        assert_ne!(key_of(&float, &fields), Some(reg.key()), "42.0 is not 42");
        assert_eq!(key_of(&json!({"order_id": 42}), &fields), None);
        assert_eq!(key_of(&json!([1, 2]), &fields), None);
    }
}
