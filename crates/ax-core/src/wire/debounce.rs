//! Debounced submits (docs/PROTOCOL.md §2, "Debounce"): a burst of submits with one
//! debounce key in one queue becomes one task, run once the key has been quiet for
//! `period` (and at most `max_wait` after the burst's first submit), with the last (or the
//! first) submit's payload.
//!
//! The window of a key is the delayed subject of its *base id* `<queue>.=d.<key in hex>`:
//! `ax.delayed.<queue>.normal.<partition of the base id>.<base id>`. Its last message is
//! the window: a delayed task whose id is `<base id>.<nuid>` (one id per window, answered
//! to every submit of it), with `Ax-Debounce-Until-Ms` (the latest due time). A submit
//! replaces it with a publish expecting its sequence (`Nats-Expected-Last-Subject-Sequence`),
//! so concurrent submits serialize on the broker; the dispatcher closes the window the same
//! way, by storing a copy marked `Ax-Debounce-Fired` that expects the window's sequence,
//! then dispatches that copy as any due task. A submit that finds the last message fired
//! (or none) opens a new window under a new id.

use crate::error::WireError;
use crate::names;
use crate::protocol::{DebounceRequest, ErrorCode, SubmitRequest};
use crate::task::{Limits, TaskMeta};
use bytes::Bytes;
use std::time::Duration;

/// Header of a window's message: the latest due time, ms since the epoch (its first
/// submit's time plus `max_wait`).
pub const UNTIL_MS: &str = "Ax-Debounce-Until-Ms";
/// Header of a window's message: the debounce key.
pub const KEY: &str = "Ax-Debounce-Key";
/// Header (`1`) of a closed window's copy: due now, and a submit opens a new window.
pub const FIRED: &str = "Ax-Debounce-Fired";
/// Header of a window's (or batch's) message: the id of the write that stored it, new for
/// each write, so a write sent again after a reconnect tells its own stored message from
/// another writer's (`ax_core::admit::publish_expecting`).
pub const WRITE: &str = "Ax-Write";

/// The id token after the queue that marks a debounced task's id.
const MARK: &str = "=d";
/// Longest debounce key (its hex form is part of task ids of at most 255 bytes).
pub const MAX_KEY: usize = 64;
/// Longest quiet period and wait: 7 days.
pub const MAX_PERIOD: Duration = Duration::from_secs(7 * 24 * 3600);
/// `max_wait` when a submit gives none: this many periods.
pub const DEFAULT_MAX_WAIT_PERIODS: u32 = 10;

/// Which payload a window's task runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// The last submit's (default).
    Last,
    /// The first submit's.
    First,
}

/// A validated debounce: key, quiet period, longest wait, which payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Debounce {
    /// The key (1..=64 of `A-Z a-z 0-9 _ - . : @`).
    pub key: String,
    /// Quiet time after the last submit before the task runs.
    pub period: Duration,
    /// Longest time from a window's first submit to its run.
    pub max_wait: Duration,
    /// Which submit's payload and options the task runs with.
    pub keep: Keep,
}

impl Debounce {
    /// Checks a request's `debounce` object.
    pub fn from_request(req: &DebounceRequest) -> Result<Debounce, WireError> {
        if req.key.len() > MAX_KEY || !crate::task::valid_limit_key(&req.key) {
            return Err(WireError::field(
                "debounce.key",
                "must be 1..=64 of A-Z a-z 0-9 _ - . : @",
            ));
        }
        let ms = |field: &str, v: i64| {
            if v < 1 || v as u128 > MAX_PERIOD.as_millis() {
                Err(WireError::field(
                    field,
                    "must be 1 ms to 7 days (604800000 ms)",
                ))
            } else {
                Ok(Duration::from_millis(v as u64))
            }
        };
        let period = ms("debounce.period_ms", req.period_ms)?;
        let max_wait = match req.max_wait_ms {
            Some(v) => ms("debounce.max_wait_ms", v)?,
            None => (period * DEFAULT_MAX_WAIT_PERIODS).min(MAX_PERIOD),
        };
        if max_wait < period {
            return Err(WireError::field(
                "debounce.max_wait_ms",
                "must be at least period_ms",
            ));
        }
        let keep = match req.keep.as_deref() {
            None | Some("last") => Keep::Last,
            Some("first") => Keep::First,
            Some(_) => return Err(WireError::field("debounce.keep", "must be last or first")),
        };
        Ok(Debounce {
            key: req.key.clone(),
            period,
            max_wait,
            keep,
        })
    }

    /// The base id of this key's windows in `queue`: `<queue>.=d.<key's bytes in hex>`.
    pub fn base_id(&self, queue: &str) -> String {
        crate::batching::window_base_id(queue, MARK, &self.key)
    }

    /// The subject of this key's window in `queue`.
    pub fn subject(&self, queue: &str) -> String {
        crate::batching::window_subject(queue, &self.base_id(queue))
    }

    /// A new window's task id.
    pub fn window_id(&self, queue: &str) -> String {
        format!("{}.{}", self.base_id(queue), nuid::next())
    }

    /// The due time of a submit at `now_ms` into a window that must run by `until_ms`.
    pub fn due(&self, now_ms: u64, until_ms: u64) -> u64 {
        (now_ms + self.period.as_millis() as u64).min(until_ms)
    }

    /// The latest due time of a window opened at `now_ms`.
    pub fn until(&self, now_ms: u64) -> u64 {
        now_ms + self.max_wait.as_millis() as u64
    }
}

/// The window subject of a debounced task id (`<queue>.=d.<hex>.<nuid>`) or a batch's
/// (`<queue>.=b.<hex>.<nuid>`, [`crate::batching`]), or `None` if `id` is neither.
pub fn window_subject_of(id: &str) -> Option<String> {
    let queue = names::queue_of_task_id(id)?;
    let rest = &id[queue.len() + 1..];
    let (base_rest, _nuid) = rest.rsplit_once('.')?;
    let marked = base_rest
        .strip_prefix(MARK)
        .or_else(|| base_rest.strip_prefix(crate::batching::MARK))?;
    let hex = marked.strip_prefix('.')?;
    if hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let base = format!("{queue}.{base_rest}");
    Some(crate::batching::window_subject(queue, &base))
}

/// True if delayed message headers are an open window (closed by the dispatcher when due).
pub fn is_open(headers: &async_nats::HeaderMap) -> bool {
    headers.get(UNTIL_MS).is_some() && headers.get(FIRED).is_none()
}

/// The window a single submit joins, or the singleton key it claims, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Window {
    /// A debounce window (this module).
    Debounce(Debounce),
    /// A batch ([`crate::batching`]).
    Batch(crate::batching::Batching),
    /// A singleton key ([`crate::singleton`]): not a window, but like one decided at
    /// submit, and not combined with one.
    Singleton(crate::singleton::Singleton),
}

/// [`crate::task::decode_submit`] of a request that may carry a `debounce`, a `batch` or a
/// `singleton` (a single submit): the task (with no due time for a window: the window sets
/// it) and the checked window it joins or key it claims, if any.
pub fn decode_submit(
    queue: &str,
    body: &[u8],
    limits: &Limits,
) -> Result<(TaskMeta, Bytes, Option<Window>), WireError> {
    let mut req: SubmitRequest = serde_json::from_slice(body)
        .map_err(|e| WireError::new(ErrorCode::BadRequest, e.to_string()))?;
    let window = match (req.debounce.take(), req.batch.take(), req.singleton.take()) {
        (None, None, None) => {
            let (meta, payload) = TaskMeta::from_request(queue, req, limits)?;
            return Ok((meta, payload, None));
        }
        (None, None, Some(s)) => {
            let singleton = crate::singleton::Singleton::from_request(&s)?;
            let (meta, payload) = TaskMeta::from_request(queue, req, limits)?;
            return Ok((meta, payload, Some(Window::Singleton(singleton))));
        }
        (Some(_), Some(_), _) => {
            return Err(WireError::field(
                "batch",
                "give debounce or batch, not both",
            ))
        }
        (_, _, Some(_)) => {
            return Err(WireError::field(
                "singleton",
                "a singleton key is not combined with a debounce or a batch key",
            ))
        }
        (Some(d), None, None) => ("debounce", Window::Debounce(Debounce::from_request(&d)?)),
        (None, Some(b), None) => {
            let b = crate::batching::Batching::from_request(&b)?;
            if req.payload_base64.is_some() {
                return Err(WireError::field(
                    "batch",
                    "a batch's task runs with the JSON list of its items: give a JSON payload",
                ));
            }
            ("batch", Window::Batch(b))
        }
    };
    let (field, window) = window;
    if req.delay_ms.is_some_and(|ms| ms != 0) || req.run_at.is_some() {
        return Err(WireError::field(
            field,
            "the window sets when the task runs: give no delay_ms or run_at",
        ));
    }
    if req.idempotency_key.is_some() && matches!(window, Window::Debounce(_)) {
        return Err(WireError::field(
            field,
            "a window's task is found by the id every submit answers: give no idempotency_key",
        ));
    }
    let (meta, payload) = TaskMeta::from_request(queue, req, limits)?;
    Ok((meta, payload, Some(window)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: &str, period_ms: i64) -> DebounceRequest {
        DebounceRequest {
            key: key.into(),
            period_ms,
            max_wait_ms: None,
            keep: None,
        }
    }

    #[test]
    fn a_debounce_is_checked_and_defaulted() {
        let d = Debounce::from_request(&req("user:42", 500)).unwrap();
        assert_eq!(d.max_wait, Duration::from_millis(5000));
        assert_eq!(d.keep, Keep::Last);
        for bad in [
            req("", 1),
            req("a b", 1),
            req(&"k".repeat(65), 1),
            req("k", 0),
        ] {
            assert!(Debounce::from_request(&bad).is_err(), "{bad:?}");
        }
        let mut r = req("k", 1000);
        r.max_wait_ms = Some(999);
        assert!(Debounce::from_request(&r).is_err());
        r.max_wait_ms = Some(i64::MAX);
        assert!(Debounce::from_request(&r).is_err());
        r.max_wait_ms = None;
        r.keep = Some("middle".into());
        assert!(Debounce::from_request(&r).is_err());
    }

    #[test]
    fn a_window_id_names_its_window_subject() {
        let d = Debounce::from_request(&req("a:b", 10)).unwrap();
        let id = d.window_id("q");
        assert!(id.starts_with("q.=d.613a62."), "{id}");
        assert_eq!(names::queue_of_task_id(&id), Some("q"));
        assert_eq!(window_subject_of(&id), Some(d.subject("q")));
        assert_eq!(window_subject_of("q.abc"), None);
        let b = crate::batching::Batching {
            key: "a:b".into(),
            size: 2,
            timeout: Duration::from_millis(10),
        };
        assert_eq!(window_subject_of(&b.batch_id("q")), Some(b.subject("q")));
        assert_eq!(window_subject_of("q.=d.zz.abc"), None);
        assert_eq!(d.due(1000, 1005), 1005);
        assert_eq!(d.due(1000, 5000), 1010);
    }
}
