//! Wire types of the submit API (request/reply on `ax.submit.<queue>`).
//!
//! `docs/PROTOCOL.md` describes the same JSON; the tests in this module pin the field names.

pub use crate::wire::error::{ErrorCode, WireError};
use crate::wire::record::TaskState;
use serde::{Deserialize, Serialize};

/// Most tasks in one batch submit request.
pub const MAX_BATCH: usize = 1000;

/// The JSON body of a submit request. Unknown fields are refused, so a typo in an option
/// name is an error rather than a silently ignored setting.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// Task name, the handler's routing key (`[A-Za-z0-9_.:-]`, 1..=128).
    pub name: String,
    /// Queue; optional because the subject names it. If given it must match the subject.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// A JSON payload (mutually exclusive with `payload_base64`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<serde_json::Value>,
    /// A binary payload, standard base64 with padding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_base64: Option<String>,
    /// `high`, `normal` (default) or `low`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<String>,
    /// Run after this many milliseconds (mutually exclusive with `run_at`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<i64>,
    /// Run at this RFC 3339 time, e.g. `2026-12-01T08:00:00Z`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_at: Option<String>,
    /// Business idempotency key: a second submit with the same key (per queue) inside the
    /// window returns the first task's id and creates nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// The key per-key limits count this task under (e.g. a customer id): 1..=128 of
    /// `A-Z a-z 0-9 _ - . : @` (docs/PROTOCOL.md §7).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_key: Option<String>,
    /// The tenant this task's fair share is counted under (1..=64 of
    /// `A-Z a-z 0-9 _ - . : @`): tasks with a fair key are released to their ready subject
    /// in weighted fair order between tenants (docs/PROTOCOL.md §7, "Fair shares").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fair_key: Option<String>,
    /// W3C trace context of the caller (`00-<trace id>-<parent id>-<flags>`), carried in
    /// the task message and record into every attempt's logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The business id the task works for (an order number, a batch id: 1..=256 printable
    /// characters), carried in the task message and record into every attempt's logs, and
    /// by a flow run into each of its step tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub business_id: Option<String>,
    /// Attempts in all, including the first (default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<i64>,
    /// Retry backoff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<BackoffRequest>,
    /// Hard timeout of one attempt in milliseconds (default 30000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<i64>,
    /// Retry only these error classes (empty: retry every class not in `no_retry_on`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_on: Option<Vec<String>>,
    /// Never retry these error classes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_retry_on: Option<Vec<String>>,
    /// Debounce: submits with one key become one task, run once the key has been quiet
    /// (docs/PROTOCOL.md §2, "Debounce"). Not with a due time, an idempotency key or in a
    /// batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debounce: Option<DebounceRequest>,
    /// Batching: submits with one batch key become one task whose payload is the list of
    /// their payloads, once `size` arrived or `timeout_ms` passed (docs/PROTOCOL.md §2,
    /// "Batching"). Not with a due time, an idempotency key, a debounce or in a batch
    /// submit request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchRequest>,
    /// Singleton key: at most one task of the key waits or runs at a time; a colliding
    /// submit does what `on_collision` says (docs/PROTOCOL.md §2, "Singleton keys"). Not
    /// with a debounce, a batch key or in a batch submit request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub singleton: Option<SingletonRequest>,
}

/// The `singleton` object of a submit request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SingletonRequest {
    /// The key: 1..=64 of `A-Z a-z 0-9 _ - . : @`.
    pub key: String,
    /// `cancel_new` (refuse the new task) or `cancel_in_progress` (cancel the one that
    /// holds the key).
    pub on_collision: String,
}

/// The `batch` object of a submit request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    /// The batch key: 1..=64 of `A-Z a-z 0-9 _ - . : @`.
    pub key: String,
    /// Items per task at most: the task is due as soon as this many arrived (1..=10000).
    pub size: i64,
    /// Longest wait from a batch's first item to its run, ms (1 ms to 7 days).
    pub timeout_ms: i64,
}

/// The `debounce` object of a submit request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DebounceRequest {
    /// The key: 1..=64 of `A-Z a-z 0-9 _ - . : @`.
    pub key: String,
    /// Quiet time after the last submit before the task runs, ms (1 ms to 7 days).
    pub period_ms: i64,
    /// Longest time from a window's first submit to its run, ms (default 10 periods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait_ms: Option<i64>,
    /// `last` (default) or `first`: whose payload and options the task runs with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<String>,
}

/// Backoff options of a submit request; each field falls back to its default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackoffRequest {
    /// First retry delay in ms (default 1000); doubles each attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_ms: Option<i64>,
    /// Upper bound in ms (default 600000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ms: Option<i64>,
    /// Fraction in 0..=1 by which a delay is randomly shortened (default 0.2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jitter: Option<f64>,
}

/// A successful submit reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitAccepted {
    /// The task id (new, or the first task's id for a duplicate idempotency key).
    pub id: String,
    /// True when the idempotency key was seen before and nothing was created.
    pub duplicate: bool,
    /// `pending` (in the ready queue) or `scheduled` (held until due); for a duplicate, the
    /// state the first task had when it was looked up.
    pub state: TaskState,
}

/// The reply body: either accepted or `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SubmitReply {
    /// `{"error": {"code": ..., "message": ..., "field": ...}}`
    Error {
        /// The error.
        error: WireError,
    },
    /// `{"id": ..., "duplicate": ..., "state": ...}`
    Accepted(SubmitAccepted),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_json_shapes() {
        let ok = SubmitReply::Accepted(SubmitAccepted {
            id: "abc".into(),
            duplicate: false,
            state: TaskState::Pending,
        });
        let text = serde_json::to_string(&ok).unwrap();
        assert_eq!(text, r#"{"id":"abc","duplicate":false,"state":"pending"}"#);
        assert_eq!(serde_json::from_str::<SubmitReply>(&text).unwrap(), ok);

        let err = SubmitReply::Error {
            error: WireError::field("delay_ms", "negative"),
        };
        let text = serde_json::to_string(&err).unwrap();
        assert_eq!(
            text,
            r#"{"error":{"code":"invalid_field","message":"negative","field":"delay_ms"}}"#
        );
        assert_eq!(serde_json::from_str::<SubmitReply>(&text).unwrap(), err);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err =
            serde_json::from_str::<SubmitRequest>(r#"{"name":"a","max_attempt":3}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field"));
    }
}
