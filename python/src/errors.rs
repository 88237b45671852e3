//! Rust errors raised as the typed exceptions of `ax_scheduler.errors`, chosen by the
//! error's kind ([`ax_sdk::ErrorKind`]), never by its text.

use ax_sdk::ErrorKind;
use pyo3::prelude::*;
use std::time::Duration;

/// The `ax_scheduler.errors` class of a kind.
fn class(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Invalid => "InvalidInput",
        ErrorKind::NotFound => "NotFound",
        ErrorKind::Conflict => "Conflict",
        ErrorKind::Unavailable => "Unavailable",
        ErrorKind::TimedOut => "TimedOut",
        ErrorKind::Permission => "PermissionDenied",
        _ => "AxError",
    }
}

/// A Python exception of `kind`'s class with the wire `code` and `field` when known.
pub(crate) fn raise(
    kind: ErrorKind,
    message: String,
    code: Option<&str>,
    field: Option<&str>,
) -> PyErr {
    raise_naming(kind, message, code, field, (None, None, None))
}

/// [`raise`] with the task a refusal names (`task_id`), the seconds until a
/// `rate_limited` submit may pass (`retry_after`) and the flow run a refusal names
/// (`run_id`).
fn raise_naming(
    kind: ErrorKind,
    message: String,
    code: Option<&str>,
    field: Option<&str>,
    (task_id, retry_after, run_id): (Option<&str>, Option<f64>, Option<&str>),
) -> PyErr {
    Python::attach(|py| {
        let made = py
            .import("ax_scheduler.errors")
            .and_then(|m| m.getattr(class(kind)))
            .and_then(|c| c.call1((message.clone(), code, field, task_id, retry_after, run_id)));
        match made {
            Ok(value) => PyErr::from_value(value),
            Err(e) => e,
        }
    })
}

/// A client error as its typed exception.
pub(crate) fn client(e: ax_sdk::ClientError) -> PyErr {
    match &e {
        ax_sdk::ClientError::Refused(w) => wire(w),
        _ => raise(e.kind(), e.to_string(), None, None),
    }
}

/// A refusal on the wire as its typed exception, with its code and field.
pub(crate) fn wire(w: &ax_core::error::WireError) -> PyErr {
    raise_naming(
        w.kind(),
        w.message.clone(),
        Some(w.code.as_str()),
        w.field.as_deref(),
        (
            w.task_id.as_deref(),
            w.retry_after_ms.map(|ms| ms as f64 / 1000.0),
            w.run_id.as_deref(),
        ),
    )
}

/// Input the caller gave that does not decode.
pub(crate) fn invalid(message: impl ToString) -> PyErr {
    raise(
        ErrorKind::Invalid,
        message.to_string(),
        Some("bad_request"),
        None,
    )
}

/// Seconds from Python: finite and not negative.
pub(crate) fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        invalid(format!(
            "{what} must be a finite number of seconds ≥ 0, not {value}"
        ))
    })
}
