//! Errors on the wire: the codes every request API answers with, and [`WireError`].
//!
//! A leaf module: validation anywhere in the crate returns a [`WireError`] naming the code
//! and, for `invalid_field`, the field, without depending on the request types.

use serde::{Deserialize, Serialize};

/// Machine-readable error codes of the submit API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The body is not valid JSON of the request's shape (wrong type, unknown field, ...).
    BadRequest,
    /// A field has a value outside its range or format; `field` names it.
    InvalidField,
    /// The payload is larger than the server's limit.
    PayloadTooLarge,
    /// No such queue is declared.
    UnknownQueue,
    /// The priority's bounded capacity is full: retry later. Nothing was stored.
    Busy,
    /// ax could not reach JetStream; nothing is known to be stored: retry later.
    Unavailable,
    /// No such trigger.
    NotFound,
    /// A manual run was refused: the trigger's previous run is still running; or a submit
    /// was refused: its singleton key's task has not ended (`task_id` names it); or a flow
    /// run's start was: its singleton key's run has not ended (`run_id` names it).
    Running,
    /// The task's state does not allow the operation (retrying a task that is not dead,
    /// cancelling a finished one, ...).
    Conflict,
    /// A submit over a rate limit whose excess is dropped: refused, nothing stored;
    /// `retry_after_ms` says when a token is due.
    RateLimited,
}

impl ErrorCode {
    /// The snake_case wire name (also the `code` label of metrics).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::InvalidField => "invalid_field",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::UnknownQueue => "unknown_queue",
            ErrorCode::Busy => "busy",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Running => "running",
            ErrorCode::Conflict => "conflict",
            ErrorCode::RateLimited => "rate_limited",
        }
    }

    /// True if the same request may succeed when sent again later.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::Busy | ErrorCode::Unavailable | ErrorCode::RateLimited
        )
    }
}

/// A typed error reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct WireError {
    /// What went wrong.
    pub code: ErrorCode,
    /// Human-readable detail.
    pub message: String,
    /// The request field at fault, for `invalid_field`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The task that caused a `running` refusal of a submit (the one holding its
    /// singleton key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// The flow run that caused a `running` refusal of a run's start (the one holding its
    /// singleton key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// For `rate_limited`: how long until the limit's next token, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

impl WireError {
    /// An error without a field.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        WireError {
            code,
            message: message.into(),
            field: None,
            task_id: None,
            run_id: None,
            retry_after_ms: None,
        }
    }

    /// An `unavailable` error (retryable): the broker failed or could not be reached;
    /// the message is the cause's text.
    pub fn unavailable(cause: impl std::fmt::Display) -> Self {
        WireError::new(ErrorCode::Unavailable, cause.to_string())
    }

    /// An `invalid_field` error.
    pub fn field(field: &str, message: impl Into<String>) -> Self {
        WireError {
            code: ErrorCode::InvalidField,
            message: message.into(),
            field: Some(field.to_string()),
            task_id: None,
            run_id: None,
            retry_after_ms: None,
        }
    }
}

/// The text of a caught panic (its `&str` or `String` payload).
pub fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panicked".into())
}

/// Checks a string that travels in a message header (idempotency key, names, error
/// classes, trigger fields): 1..=`max` bytes, no control characters (a line break would
/// end the header block), no leading or trailing whitespace (header values are trimmed on
/// the wire, so the value read back would differ).
pub fn check_header_text(field: &str, value: &str, max: usize) -> Result<(), WireError> {
    if value.is_empty() || value.len() > max {
        return Err(WireError::field(field, format!("must be 1..={max} bytes")));
    }
    if value.chars().any(char::is_control) {
        return Err(WireError::field(
            field,
            "must not contain control characters (line breaks, tabs, ...)",
        ));
    }
    if value.trim() != value {
        return Err(WireError::field(
            field,
            "must not start or end with whitespace",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_text() {
        assert!(check_header_text("k", "user-7:2026-11-29 ok", 256).is_ok());
        assert!(check_header_text("k", "ünïcødé ✓", 256).is_ok());
        for bad in [
            "",
            "a\r\nb",
            "a\n",
            "tab\there",
            "nul\0",
            " lead",
            "trail ",
            "x".repeat(257).as_str(),
        ] {
            let e = check_header_text("k", bad, 256).unwrap_err();
            assert_eq!(
                (e.code, e.field.as_deref()),
                (ErrorCode::InvalidField, Some("k")),
                "{bad:?}"
            );
        }
    }
}

/// What kind of failure a library error is, so a caller can decide what to do next
/// without reading messages (modelled on async-nats's `Error<Kind>`). Every public error
/// type of this crate has a `kind()`.
///
/// NATS reports a denied publish or subscribe to the connection, not to the request that
/// caused it, so a permission problem on a request surfaces as [`ErrorKind::TimedOut`];
/// only connect-time refusals are [`ErrorKind::Permission`].
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// No answer in time: the broker or server is slow, gone, or silently refused.
    TimedOut,
    /// Credentials or permissions refused.
    Permission,
    /// Another writer changed the thing first (a compare-and-set lost), or it exists.
    Conflict,
    /// The stream, consumer, key, task or trigger does not exist.
    NotFound,
    /// Nobody could serve it now (no ax server listening, busy, JetStream unavailable):
    /// retrying later may succeed.
    Unavailable,
    /// The input or a stored value is not valid.
    Invalid,
    /// Anything else.
    Other,
}

impl ErrorKind {
    /// The kind of an error from the broker, found by walking its source chain.
    pub fn of(err: &(dyn std::error::Error + 'static)) -> ErrorKind {
        use async_nats::jetstream;
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
        while let Some(e) = cur {
            if let Some(js) = e.downcast_ref::<jetstream::Error>() {
                match js.error_code() {
                    jetstream::ErrorCode::STREAM_NOT_FOUND
                    | jetstream::ErrorCode::CONSUMER_NOT_FOUND
                    | jetstream::ErrorCode::NO_MESSAGE_FOUND => return ErrorKind::NotFound,
                    jetstream::ErrorCode::STREAM_WRONG_LAST_SEQUENCE
                    | jetstream::ErrorCode::STREAM_WRONG_LAST_SEQUENCE_CONSTANT => {
                        return ErrorKind::Conflict
                    }
                    _ => {}
                }
            }
            if let Some(r) = e.downcast_ref::<async_nats::RequestError>() {
                match r.kind() {
                    async_nats::RequestErrorKind::TimedOut => return ErrorKind::TimedOut,
                    async_nats::RequestErrorKind::NoResponders => return ErrorKind::Unavailable,
                    _ => {}
                }
            }
            if let Some(c) = e.downcast_ref::<async_nats::ConnectError>() {
                match c.kind() {
                    async_nats::ConnectErrorKind::AuthorizationViolation
                    | async_nats::ConnectErrorKind::Authentication => return ErrorKind::Permission,
                    async_nats::ConnectErrorKind::TimedOut => return ErrorKind::TimedOut,
                    _ => return ErrorKind::Unavailable,
                }
            }
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                if io.kind() == std::io::ErrorKind::TimedOut {
                    return ErrorKind::TimedOut;
                }
            }
            if let Some(kind) = typed_kind(e) {
                return kind;
            }
            cur = e.source();
        }
        ErrorKind::Other
    }
}

/// The kind of one error of async-nats by its type and kind (never by its text); `None`
/// if this level says nothing and its source should be asked.
fn typed_kind(e: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
    use async_nats::jetstream::{context, kv};
    if let Some(p) = e.downcast_ref::<context::PublishError>() {
        return match p.kind() {
            context::PublishErrorKind::TimedOut => Some(ErrorKind::TimedOut),
            context::PublishErrorKind::StreamNotFound => Some(ErrorKind::NotFound),
            context::PublishErrorKind::WrongLastSequence
            | context::PublishErrorKind::WrongLastMessageId => Some(ErrorKind::Conflict),
            context::PublishErrorKind::MaxPayloadExceeded => Some(ErrorKind::Invalid),
            context::PublishErrorKind::MaxAckPending | context::PublishErrorKind::BrokenPipe => {
                Some(ErrorKind::Unavailable)
            }
            _ => None,
        };
    }
    if let Some(p) = e.downcast_ref::<async_nats::PublishError>() {
        return match p.kind() {
            async_nats::client::PublishErrorKind::MaxPayloadExceeded
            | async_nats::client::PublishErrorKind::InvalidSubject => Some(ErrorKind::Invalid),
            async_nats::client::PublishErrorKind::Send => Some(ErrorKind::Unavailable),
        };
    }
    if let Some(r) = e.downcast_ref::<context::RequestError>() {
        return match r.kind() {
            context::RequestErrorKind::TimedOut => Some(ErrorKind::TimedOut),
            context::RequestErrorKind::NoResponders => Some(ErrorKind::Unavailable),
            _ => None,
        };
    }
    if let Some(c) = e.downcast_ref::<kv::CreateError>() {
        if c.kind() == kv::CreateErrorKind::AlreadyExists {
            return Some(ErrorKind::Conflict);
        }
    }
    if let Some(u) = e.downcast_ref::<kv::UpdateError>() {
        return match u.kind() {
            kv::UpdateErrorKind::WrongLastRevision => Some(ErrorKind::Conflict),
            kv::UpdateErrorKind::TimedOut => Some(ErrorKind::TimedOut),
            _ => None,
        };
    }
    if let Some(g) = e.downcast_ref::<kv::EntryError>() {
        if g.kind() == kv::EntryErrorKind::TimedOut {
            return Some(ErrorKind::TimedOut);
        }
    }
    if let Some(w) = e.downcast_ref::<kv::WatchError>() {
        if w.kind() == kv::WatchErrorKind::TimedOut {
            return Some(ErrorKind::TimedOut);
        }
    }
    None
}

/// True if `err` (or a source of it) is a replicated stream's refusal of a conditional
/// write whose subject has another write in flight (JetStream 10164, "wrong last
/// sequence" with no sequence). Nothing of it was stored, and it is not yet a lost race:
/// the write in flight passed its own check and will most likely land, but may still
/// fail, and it may even be this writer's own earlier sending (a group commit's batch
/// whose answer was lost, sent again alone).
pub fn is_write_in_flight(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if e.downcast_ref::<async_nats::jetstream::Error>()
            .is_some_and(|js| {
                js.error_code()
                    == async_nats::jetstream::ErrorCode::STREAM_WRONG_LAST_SEQUENCE_CONSTANT
            })
        {
            return true;
        }
        cur = e.source();
    }
    false
}

/// True if `err` (or a source of it) is a publish refused for exceeding the server's
/// `max_payload`.
pub(crate) fn is_max_payload(err: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::context;
    let mut cur = Some(err);
    while let Some(e) = cur {
        if e.downcast_ref::<context::PublishError>()
            .is_some_and(|p| p.kind() == context::PublishErrorKind::MaxPayloadExceeded)
            || e.downcast_ref::<async_nats::PublishError>()
                .is_some_and(|p| {
                    p.kind() == async_nats::client::PublishErrorKind::MaxPayloadExceeded
                })
        {
            return true;
        }
        cur = e.source();
    }
    false
}

impl WireError {
    /// The kind of a refusal.
    pub fn kind(&self) -> ErrorKind {
        match self.code {
            ErrorCode::BadRequest | ErrorCode::InvalidField | ErrorCode::PayloadTooLarge => {
                ErrorKind::Invalid
            }
            ErrorCode::UnknownQueue | ErrorCode::NotFound => ErrorKind::NotFound,
            ErrorCode::Busy | ErrorCode::Unavailable | ErrorCode::RateLimited => {
                ErrorKind::Unavailable
            }
            ErrorCode::Running | ErrorCode::Conflict => ErrorKind::Conflict,
        }
    }
}
