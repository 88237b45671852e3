//! A validated task: what travels in the headers of a ready (or delayed) message.
//!
//! [`Limits`] bound every option; [`TaskMeta::from_request`] turns a wire
//! [`SubmitRequest`] into a validated task or a typed [`WireError`] naming the field.

use crate::wire::backoff::Backoff;
use crate::wire::error::check_header_text;
use crate::wire::names::{self, Priority};
use crate::wire::protocol::{ErrorCode, SubmitRequest, WireError};
use crate::wire::record::{TaskRecord, TaskState};
use crate::wire::time::{now_ms, parse_rfc3339_ms};
use async_nats::HeaderMap;
use base64::Engine;
use bytes::Bytes;
use std::time::Duration;

/// Header names of task messages (see docs/PROTOCOL.md).
pub mod header {
    /// Task id.
    pub const ID: &str = "Ax-Task-Id";
    /// Task name.
    pub const NAME: &str = "Ax-Task-Name";
    /// Queue.
    pub const QUEUE: &str = "Ax-Queue";
    /// Priority.
    pub const PRIORITY: &str = "Ax-Priority";
    /// Attempts allowed in all.
    pub const MAX_ATTEMPTS: &str = "Ax-Max-Attempts";
    /// Hard timeout of one attempt, ms.
    pub const TIMEOUT_MS: &str = "Ax-Timeout-Ms";
    /// Backoff as `base_ms,max_ms,jitter`.
    pub const BACKOFF: &str = "Ax-Backoff";
    /// Comma-separated error classes to retry (empty: all not refused).
    pub const RETRY_ON: &str = "Ax-Retry-On";
    /// Comma-separated error classes never retried.
    pub const NO_RETRY_ON: &str = "Ax-No-Retry-On";
    /// `application/json` or `application/octet-stream`.
    pub const CONTENT_TYPE: &str = "Ax-Content-Type";
    /// Creation time, ms since the Unix epoch.
    pub const CREATED_AT_MS: &str = "Ax-Created-At-Ms";
    /// Due time of a delayed task, ms since the Unix epoch.
    pub const RUN_AT_MS: &str = "Ax-Run-At-Ms";
    /// The idempotency key, if any.
    pub const IDEMPOTENCY_KEY: &str = "Ax-Idempotency-Key";
    /// On a dead letter: the error class.
    pub const ERROR_CLASS: &str = "Ax-Error-Class";
    /// On a dead letter: the error message.
    pub const ERROR_MESSAGE: &str = "Ax-Error-Message";
    /// On a dead letter: the number of attempts made.
    pub const ATTEMPTS: &str = "Ax-Attempts";
    /// The trigger that created the task.
    pub const TRIGGER: &str = "Ax-Trigger";
    /// Why the trigger fired: `schedule` or `manual`.
    pub const TRIGGER_SOURCE: &str = "Ax-Trigger-Source";
    /// The scheduled time the fire stands for, ms since the Unix epoch.
    pub const SCHEDULED_AT_MS: &str = "Ax-Scheduled-At-Ms";
    /// Options the producer left unset, so the server's defaults stand in the headers:
    /// comma-separated `max_attempts`, `timeout`, `backoff`, `retry_on`, `no_retry_on`.
    /// A worker's per-name options replace exactly these (docs/PROTOCOL.md §3).
    pub const DEFAULTED: &str = "Ax-Defaulted";
    /// The key per-key limits count the task under.
    pub const LIMIT_KEY: &str = "Ax-Limit-Key";
    /// On a retry's message: the revision of the `dead` record it retries (the record is
    /// moved to `pending` right after the publish; a delivery that finds it still at that
    /// revision waits for that write instead of dead-lettering the task again).
    pub const RETRY_OF: &str = "Ax-Retry-Of";
    /// W3C trace context of the submit (the standard header name).
    pub const TRACEPARENT: &str = "traceparent";
    /// The business id the task works for (an order number, a batch id).
    pub const BUSINESS_ID: &str = "Ax-Business-Id";
    /// `1` on a message whose submit stored no record: the worker that claims it creates
    /// the record (docs/PROTOCOL.md §3, "Unrecorded tasks"). Set only on immediate tasks
    /// without an idempotency key, which are published exactly once.
    pub const UNRECORDED: &str = "Ax-Unrecorded";
    /// The tenant whose fair share the task is dispatched in (docs/PROTOCOL.md §7, "Fair
    /// shares"): its message waits in `AX_FAIR` until the fair dispatcher releases it.
    pub const FAIR_KEY: &str = "Ax-Fair-Key";
    /// On a flow's wait task (docs/PROTOCOL.md §6, "Waits"): what it waits for (`sleep`,
    /// `event`, `event-or-null`, `approval`, `approval-or-null`, `flow`, `flow-or-null`).
    /// No worker runs such a task: the server that dispatches it when due records it
    /// `succeeded` instead of publishing it to its ready subject.
    pub const WAIT: &str = "Ax-Wait";
}

/// What a flow's wait task waits for (header `Ax-Wait`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Wait {
    /// Its due time: a durable sleep, ended by the dispatch of its delayed message.
    Sleep,
    /// An event (`AX_WAITS` holds what it matches); its due time is its timeout, which
    /// ends it as the policy says.
    Event(crate::wire::event::OnTimeout),
    /// An approval (`AX_WAITS` holds its token's secret); its due time is its timeout,
    /// which ends it as the policy says.
    Approval(crate::wire::event::OnTimeout),
    /// A child flow run (started by the flow engine once the task is stored; its end
    /// ends the task); its due time is its timeout, which ends it as the policy says.
    Flow(crate::wire::event::OnTimeout),
}

impl Wait {
    /// The header value: `sleep`, `event` (fails on timeout), `event-or-null`,
    /// `approval` (fails on timeout), `approval-or-null`, `flow` (fails on timeout) or
    /// `flow-or-null`.
    pub fn as_str(self) -> &'static str {
        use crate::wire::event::OnTimeout;
        match self {
            Wait::Sleep => "sleep",
            Wait::Event(OnTimeout::Fail) => "event",
            Wait::Event(OnTimeout::Continue) => "event-or-null",
            Wait::Approval(OnTimeout::Fail) => "approval",
            Wait::Approval(OnTimeout::Continue) => "approval-or-null",
            Wait::Flow(OnTimeout::Fail) => "flow",
            Wait::Flow(OnTimeout::Continue) => "flow-or-null",
        }
    }

    /// The wait a header value names (`None` for none this version knows).
    pub fn parse(value: &str) -> Option<Wait> {
        use crate::wire::event::OnTimeout;
        match value {
            "sleep" => Some(Wait::Sleep),
            "event" => Some(Wait::Event(OnTimeout::Fail)),
            "event-or-null" => Some(Wait::Event(OnTimeout::Continue)),
            "approval" => Some(Wait::Approval(OnTimeout::Fail)),
            "approval-or-null" => Some(Wait::Approval(OnTimeout::Continue)),
            "flow" => Some(Wait::Flow(OnTimeout::Fail)),
            "flow-or-null" => Some(Wait::Flow(OnTimeout::Continue)),
            _ => None,
        }
    }
}

/// Where a trigger-made task came from: which trigger, why, for which scheduled time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lineage {
    /// Trigger name.
    pub trigger: String,
    /// `schedule` or `manual`.
    pub source: String,
    /// The scheduled time of the fire.
    pub scheduled_at_ms: u64,
}

/// Checks a business id (`business_id` of a submit or a flow run): 1..=256 bytes, no
/// control characters, no whitespace at either end (it travels in a header).
pub fn check_business_id(id: &str) -> Result<(), WireError> {
    check_header_text("business_id", id, 256)
}

/// A W3C `traceparent`: `<version>-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`,
/// lowercase, ids not all zero, version not `ff`.
pub fn valid_traceparent(t: &str) -> bool {
    let parts: Vec<&str> = t.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    parts.len() == 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex(parts[3], 2)
}

/// A fair key (a tenant): 1..=64 of `A-Z a-z 0-9 _ - . : @` (its hex is a subject token).
pub fn valid_fair_key(key: &str) -> bool {
    key.len() <= 64 && valid_limit_key(key)
}

/// A limit key: 1..=128 of `A-Z a-z 0-9 _ - . : @` (safe in a header; hashed into KV keys).
pub fn valid_limit_key(key: &str) -> bool {
    (1..=128).contains(&key.len())
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.:@".contains(&b))
}

/// Bounds on submitted options; the server's are configurable, these are the defaults.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest payload in bytes (default 256 KiB).
    pub max_payload_bytes: usize,
    /// Longest delay / furthest `run_at` (default 30 days).
    pub max_delay: Duration,
    /// Most attempts a task may ask for (default 1000).
    pub max_attempts: u32,
    /// Longest per-attempt timeout (default 24 h).
    pub max_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_payload_bytes: 256 * 1024,
            max_delay: Duration::from_secs(30 * 24 * 3600),
            max_attempts: 1000,
            max_timeout: Duration::from_secs(24 * 3600),
        }
    }
}

/// Default attempts in all.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Default hard timeout of one attempt.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Payload encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentType {
    /// The payload is JSON text.
    Json,
    /// The payload is opaque bytes.
    Bytes,
}

impl ContentType {
    fn as_str(self) -> &'static str {
        match self {
            ContentType::Json => "application/json",
            ContentType::Bytes => "application/octet-stream",
        }
    }
}

/// Everything about a task except its payload.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskMeta {
    /// Unique id.
    pub id: String,
    /// Queue.
    pub queue: String,
    /// Task name (handler routing key).
    pub name: String,
    /// Priority.
    pub priority: Priority,
    /// Attempts in all.
    pub max_attempts: u32,
    /// Hard timeout of one attempt.
    pub timeout: Duration,
    /// Retry backoff.
    pub backoff: Backoff,
    /// Error classes to retry (empty: every class not in `no_retry_on`).
    pub retry_on: Vec<String>,
    /// Error classes never retried.
    pub no_retry_on: Vec<String>,
    /// Payload encoding.
    pub content_type: ContentType,
    /// Creation time, ms since the epoch.
    pub created_at_ms: u64,
    /// Due time of a delayed task, ms since the epoch.
    pub run_at_ms: Option<u64>,
    /// Business idempotency key.
    pub idempotency_key: Option<String>,
    /// The key per-key limits count the task under.
    pub limit_key: Option<String>,
    /// The tenant whose fair share the task is dispatched in (header `Ax-Fair-Key`).
    pub fair_key: Option<String>,
    /// W3C trace context of the submit.
    pub traceparent: Option<String>,
    /// The business id the task works for.
    pub business_id: Option<String>,
    /// On an operator's retry: the revision of the `dead` record it retries.
    pub retry_of: Option<u64>,
    /// Set for tasks a trigger created.
    pub lineage: Option<Lineage>,
    /// Options the producer left unset (header `Ax-Defaulted`).
    pub defaulted: Defaulted,
    /// The submit stored no record: the claim creates it (header `Ax-Unrecorded`).
    pub unrecorded: bool,
    /// A flow's wait task: what it waits for (header `Ax-Wait`; no worker runs it).
    pub wait: Option<Wait>,
}

/// Which options of a task took the server's defaults because the producer left them
/// unset; a worker's per-name options replace exactly these.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Defaulted {
    /// `max_attempts` was not given.
    pub max_attempts: bool,
    /// `timeout_ms` was not given.
    pub timeout: bool,
    /// `backoff` was not given.
    pub backoff: bool,
    /// `retry_on` was not given.
    pub retry_on: bool,
    /// `no_retry_on` was not given.
    pub no_retry_on: bool,
}

impl Defaulted {
    const NAMES: [&'static str; 5] = [
        "max_attempts",
        "timeout",
        "backoff",
        "retry_on",
        "no_retry_on",
    ];

    fn flags(&self) -> [bool; 5] {
        [
            self.max_attempts,
            self.timeout,
            self.backoff,
            self.retry_on,
            self.no_retry_on,
        ]
    }

    /// The header value, or `None` if every option was given.
    pub fn to_header(&self) -> Option<String> {
        let names: Vec<&str> = Self::NAMES
            .iter()
            .zip(self.flags())
            .filter(|(_, on)| *on)
            .map(|(n, _)| *n)
            .collect();
        (!names.is_empty()).then(|| names.join(","))
    }

    /// Reads the header value; unknown names are ignored (a newer producer's).
    pub fn from_header(value: &str) -> Defaulted {
        let has = |name: &str| value.split(',').any(|v| v.trim() == name);
        Defaulted {
            max_attempts: has("max_attempts"),
            timeout: has("timeout"),
            backoff: has("backoff"),
            retry_on: has("retry_on"),
            no_retry_on: has("no_retry_on"),
        }
    }
}

/// A header of a task message is missing or malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("task header {header}: {problem}")]
pub struct HeaderError {
    /// The header name.
    pub header: &'static str,
    /// What is wrong with it.
    pub problem: &'static str,
}

/// Whether `class` is a usable error class (not empty).
pub fn valid_class(class: &str) -> bool {
    !class.is_empty()
        && class.len() <= 64
        && class
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
}

fn classes(field: &str, list: Option<Vec<String>>) -> Result<Vec<String>, WireError> {
    let list = list.unwrap_or_default();
    if list.len() > 32 {
        return Err(WireError::field(field, "at most 32 error classes"));
    }
    if let Some(bad) = list.iter().find(|c| !valid_class(c)) {
        return Err(WireError::field(
            field,
            format!("error class {bad:?} must be 1..=64 of A-Z a-z 0-9 _ . : -"),
        ));
    }
    Ok(list)
}

fn ms_in(field: &str, value: i64, min: u64, max: Duration) -> Result<Duration, WireError> {
    if value < 0 {
        return Err(WireError::field(field, format!("{value} is negative")));
    }
    let d = Duration::from_millis(value as u64);
    if (value as u64) < min || d > max {
        return Err(WireError::field(
            field,
            format!("{value} ms is outside {min}..={} ms", max.as_millis()),
        ));
    }
    Ok(d)
}

/// Decodes and validates a submit request body for `queue`: the whole wire decoder of the
/// submit API. Never panics; every refusal is a typed [`WireError`].
pub fn decode_submit(
    queue: &str,
    body: &[u8],
    limits: &Limits,
) -> Result<(TaskMeta, Bytes), WireError> {
    let req: SubmitRequest = serde_json::from_slice(body)
        .map_err(|e| WireError::new(ErrorCode::BadRequest, e.to_string()))?;
    TaskMeta::from_request(queue, req, limits)
}

impl TaskMeta {
    /// The first record of a newly accepted task (`scheduled` if it has a due time).
    pub fn record(&self) -> TaskRecord {
        TaskRecord {
            id: self.id.clone(),
            queue: self.queue.clone(),
            name: self.name.clone(),
            priority: self.priority,
            state: if self.run_at_ms.is_some() {
                TaskState::Scheduled
            } else {
                TaskState::Pending
            },
            attempt: 0,
            max_attempts: self.max_attempts,
            created_at_ms: self.created_at_ms,
            updated_at_ms: self.created_at_ms,
            run_at_ms: self.run_at_ms,
            started_at_ms: None,
            finished_at_ms: None,
            next_retry_at_ms: None,
            last_error: None,
            worker: None,
            ready_seq: None,
            idempotency_key: self.idempotency_key.clone(),
            trigger: self.lineage.as_ref().map(|l| l.trigger.clone()),
            trigger_source: self.lineage.as_ref().map(|l| l.source.clone()),
            scheduled_at_ms: self.lineage.as_ref().map(|l| l.scheduled_at_ms),
            output: None,
            delayed_seq: None,
            superseded_seq: None,
            cancel_requested_at_ms: None,
            op: None,
            traceparent: self.traceparent.clone(),
            business_id: self.business_id.clone(),
            waiting: None,
            extra: Default::default(),
        }
    }

    /// Validates a request for `queue` into a task with a fresh id, and its payload.
    pub fn from_request(
        queue: &str,
        req: SubmitRequest,
        limits: &Limits,
    ) -> Result<(TaskMeta, Bytes), WireError> {
        if req.debounce.is_some() {
            return Err(WireError::field(
                "debounce",
                "only a single submit may be debounced (not a batch's task)",
            ));
        }
        if req.batch.is_some() {
            return Err(WireError::field(
                "batch",
                "only a single submit may join a batch key (not a batch request's task)",
            ));
        }
        if req.singleton.is_some() {
            return Err(WireError::field(
                "singleton",
                "only a single submit request to an ax server may claim a singleton key \
                 (not a batch request's task, a direct publish, a trigger's or a flow's task)",
            ));
        }
        if let Some(q) = &req.queue {
            if q != queue {
                return Err(WireError::field("queue", "does not match the subject"));
            }
        }
        if !valid_class(&req.name) || req.name.len() > 128 {
            return Err(WireError::field(
                "name",
                "must be 1..=128 of A-Z a-z 0-9 _ . : -",
            ));
        }
        let (payload, content_type) = match (req.payload, req.payload_base64) {
            (Some(_), Some(_)) => {
                return Err(WireError::field(
                    "payload",
                    "give payload or payload_base64, not both",
                ))
            }
            (Some(v), None) => (
                Bytes::from(serde_json::to_vec(&v).expect("a Value serializes")),
                ContentType::Json,
            ),
            (None, Some(b64)) => {
                let raw = base64::engine::general_purpose::STANDARD
                    .decode(b64.as_bytes())
                    .map_err(|e| WireError::field("payload_base64", e.to_string()))?;
                (Bytes::from(raw), ContentType::Bytes)
            }
            (None, None) => (Bytes::from_static(b"null"), ContentType::Json),
        };
        if payload.len() > limits.max_payload_bytes {
            return Err(WireError::new(
                ErrorCode::PayloadTooLarge,
                format!(
                    "payload is {} bytes, limit {}",
                    payload.len(),
                    limits.max_payload_bytes
                ),
            ));
        }
        let priority = match req.priority.as_deref() {
            None => Priority::Normal,
            Some(p) => p
                .parse()
                .map_err(|e: names::UnknownPriority| WireError::field("priority", e.to_string()))?,
        };
        let now = now_ms();
        let run_at_ms = match (req.delay_ms, req.run_at) {
            (Some(_), Some(_)) => {
                return Err(WireError::field(
                    "delay_ms",
                    "give delay_ms or run_at, not both",
                ))
            }
            (Some(0), None) | (None, None) => None,
            (Some(ms), None) => {
                let d = ms_in("delay_ms", ms, 0, limits.max_delay)?;
                Some(now + d.as_millis() as u64)
            }
            (None, Some(text)) => {
                let at_ms = parse_rfc3339_ms(&text)
                    .map_err(|e| WireError::field("run_at", e.to_string()))?;
                if at_ms > now + limits.max_delay.as_millis() as u64 {
                    return Err(WireError::field("run_at", "is further away than max delay"));
                }
                // A time in the past runs now.
                (at_ms > now).then_some(at_ms)
            }
        };
        let max_attempts = match req.max_attempts {
            None => DEFAULT_MAX_ATTEMPTS,
            Some(n) if n >= 1 && n <= i64::from(limits.max_attempts) => n as u32,
            Some(n) => {
                return Err(WireError::field(
                    "max_attempts",
                    format!("{n} is outside 1..={}", limits.max_attempts),
                ))
            }
        };
        let timeout = match req.timeout_ms {
            None => DEFAULT_TIMEOUT,
            Some(ms) => ms_in("timeout_ms", ms, 1, limits.max_timeout)?,
        };
        let defaulted = Defaulted {
            max_attempts: req.max_attempts.is_none(),
            timeout: req.timeout_ms.is_none(),
            backoff: req.backoff.is_none(),
            retry_on: req.retry_on.is_none(),
            no_retry_on: req.no_retry_on.is_none(),
        };
        let backoff = Backoff::from_request(req.backoff.unwrap_or_default())?;
        if let Some(key) = &req.idempotency_key {
            check_header_text("idempotency_key", key, 256)?;
        }
        if let Some(key) = &req.limit_key {
            if !valid_limit_key(key) {
                return Err(WireError::field(
                    "limit_key",
                    "must be 1..=128 of A-Z a-z 0-9 _ - . : @",
                ));
            }
        }
        if let Some(key) = &req.fair_key {
            if !valid_fair_key(key) {
                return Err(WireError::field(
                    "fair_key",
                    "must be 1..=64 of A-Z a-z 0-9 _ - . : @",
                ));
            }
        }
        if let Some(t) = &req.traceparent {
            if !valid_traceparent(t) {
                return Err(WireError::field(
                    "traceparent",
                    "must be a W3C traceparent: 00-<32 hex>-<16 hex>-<2 hex>",
                ));
            }
        }
        if let Some(id) = &req.business_id {
            check_business_id(id)?;
        }
        let meta = TaskMeta {
            id: names::new_task_id(queue),
            queue: queue.to_string(),
            name: req.name,
            priority,
            max_attempts,
            timeout,
            backoff,
            retry_on: classes("retry_on", req.retry_on)?,
            no_retry_on: classes("no_retry_on", req.no_retry_on)?,
            content_type,
            created_at_ms: now,
            run_at_ms,
            idempotency_key: req.idempotency_key,
            limit_key: req.limit_key,
            fair_key: req.fair_key,
            traceparent: req.traceparent,
            business_id: req.business_id,
            retry_of: None,
            lineage: None,
            defaulted,
            unrecorded: false,
            wait: None,
        };
        Ok((meta, payload))
    }

    /// Checks a delivered message's payload as a submit would have: at most the default
    /// [`Limits::max_payload_bytes`], and JSON text unless the message says it is bytes.
    /// A worker dead-letters a message that fails this (a producer publishing directly
    /// skipped the client's checks), never runs it.
    pub fn check_payload(&self, payload: &[u8]) -> Result<(), WireError> {
        let limit = Limits::default().max_payload_bytes;
        if payload.len() > limit {
            return Err(WireError::new(
                ErrorCode::PayloadTooLarge,
                format!("payload is {} bytes, limit {limit}", payload.len()),
            ));
        }
        if self.content_type == ContentType::Json {
            serde_json::from_slice::<serde::de::IgnoredAny>(payload)
                .map_err(|e| WireError::field("payload", format!("not JSON: {e}")))?;
        }
        Ok(())
    }

    /// Whether an error of `class` may be retried under this task's lists.
    pub fn retryable(&self, class: &str) -> bool {
        if self.no_retry_on.iter().any(|c| c == class) {
            return false;
        }
        self.retry_on.is_empty() || self.retry_on.iter().any(|c| c == class)
    }

    /// The task message headers.
    pub fn to_headers(&self) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::ID, self.id.as_str());
        h.insert(header::NAME, self.name.as_str());
        h.insert(header::QUEUE, self.queue.as_str());
        h.insert(header::PRIORITY, self.priority.as_str());
        h.insert(header::MAX_ATTEMPTS, self.max_attempts.to_string().as_str());
        h.insert(
            header::TIMEOUT_MS,
            self.timeout.as_millis().to_string().as_str(),
        );
        h.insert(header::BACKOFF, self.backoff.to_header().as_str());
        if !self.retry_on.is_empty() {
            h.insert(header::RETRY_ON, self.retry_on.join(",").as_str());
        }
        if !self.no_retry_on.is_empty() {
            h.insert(header::NO_RETRY_ON, self.no_retry_on.join(",").as_str());
        }
        h.insert(header::CONTENT_TYPE, self.content_type.as_str());
        h.insert(
            header::CREATED_AT_MS,
            self.created_at_ms.to_string().as_str(),
        );
        if let Some(at) = self.run_at_ms {
            h.insert(header::RUN_AT_MS, at.to_string().as_str());
        }
        if let Some(key) = &self.idempotency_key {
            h.insert(header::IDEMPOTENCY_KEY, key.as_str());
        }
        if let Some(key) = &self.limit_key {
            h.insert(header::LIMIT_KEY, key.as_str());
        }
        if let Some(key) = &self.fair_key {
            h.insert(header::FAIR_KEY, key.as_str());
        }
        if let Some(t) = &self.traceparent {
            h.insert(header::TRACEPARENT, t.as_str());
        }
        if let Some(id) = &self.business_id {
            h.insert(header::BUSINESS_ID, id.as_str());
        }
        if let Some(r) = self.retry_of {
            h.insert(header::RETRY_OF, r.to_string().as_str());
        }
        if let Some(defaulted) = self.defaulted.to_header() {
            h.insert(header::DEFAULTED, defaulted.as_str());
        }
        if self.unrecorded {
            h.insert(header::UNRECORDED, "1");
        }
        if let Some(wait) = self.wait {
            h.insert(header::WAIT, wait.as_str());
        }
        if let Some(l) = &self.lineage {
            h.insert(header::TRIGGER, l.trigger.as_str());
            h.insert(header::TRIGGER_SOURCE, l.source.as_str());
            h.insert(
                header::SCHEDULED_AT_MS,
                l.scheduled_at_ms.to_string().as_str(),
            );
        }
        h
    }

    /// Where a stored task message goes when it is due, read from its headers without
    /// decoding the rest: its ready subject (its fair subject in `AX_FAIR` if it has a fair
    /// key) and its id. The queue, the priority and the id
    /// (which must belong to the queue) are checked; a worker checks the rest.
    pub fn ready_route(h: &HeaderMap) -> Result<(String, &str), HeaderError> {
        let get = |name: &'static str| {
            h.get(name).map(|v| v.as_str()).ok_or(HeaderError {
                header: name,
                problem: "missing",
            })
        };
        let queue = get(header::QUEUE)?;
        let id = get(header::ID)?;
        if !names::valid_queue(queue) || names::queue_of_task_id(id) != Some(queue) {
            return Err(HeaderError {
                header: header::ID,
                problem: "not a task id of the message's queue (<queue>.<key>)",
            });
        }
        let priority: Priority = get(header::PRIORITY)?.parse().map_err(|_| HeaderError {
            header: header::PRIORITY,
            problem: "unknown priority",
        })?;
        let subject = match h
            .get(header::FAIR_KEY)
            .map(|v| v.as_str())
            .filter(|k| valid_fair_key(k))
        {
            Some(key) => names::fair_subject(queue, priority, key, id),
            None => names::ready_subject(queue, priority),
        };
        Ok((subject, id))
    }

    /// Reads a task from message headers.
    pub fn from_headers(h: &HeaderMap) -> Result<TaskMeta, HeaderError> {
        fn get<'a>(h: &'a HeaderMap, name: &'static str) -> Result<&'a str, HeaderError> {
            h.get(name).map(|v| v.as_str()).ok_or(HeaderError {
                header: name,
                problem: "missing",
            })
        }
        fn num<T: std::str::FromStr>(h: &HeaderMap, name: &'static str) -> Result<T, HeaderError> {
            get(h, name)?.parse().map_err(|_| HeaderError {
                header: name,
                problem: "not a number",
            })
        }
        fn list(h: &HeaderMap, name: &'static str) -> Vec<String> {
            h.get(name)
                .map(|v| v.as_str().split(',').map(str::to_string).collect())
                .unwrap_or_default()
        }
        let priority = get(h, header::PRIORITY)?.parse().map_err(|_| HeaderError {
            header: header::PRIORITY,
            problem: "unknown priority",
        })?;
        let backoff = Backoff::from_header(get(h, header::BACKOFF)?).ok_or(HeaderError {
            header: header::BACKOFF,
            problem: "expected base_ms,max_ms,jitter",
        })?;
        let content_type = match h.get(header::CONTENT_TYPE).map(|v| v.as_str()) {
            Some("application/octet-stream") => ContentType::Bytes,
            _ => ContentType::Json,
        };
        let run_at_ms = match h.get(header::RUN_AT_MS) {
            Some(_) => Some(num(h, header::RUN_AT_MS)?),
            None => None,
        };
        let queue = get(h, header::QUEUE)?;
        if !names::valid_queue(queue) {
            return Err(HeaderError {
                header: header::QUEUE,
                problem: "not a valid queue name",
            });
        }
        let id = get(h, header::ID)?;
        if names::queue_of_task_id(id) != Some(queue) {
            return Err(HeaderError {
                header: header::ID,
                problem: "not a task id of the message's queue (<queue>.<key>)",
            });
        }
        Ok(TaskMeta {
            id: id.to_string(),
            queue: queue.to_string(),
            name: get(h, header::NAME)?.to_string(),
            priority,
            max_attempts: num(h, header::MAX_ATTEMPTS)?,
            timeout: Duration::from_millis(num(h, header::TIMEOUT_MS)?),
            backoff,
            retry_on: list(h, header::RETRY_ON),
            no_retry_on: list(h, header::NO_RETRY_ON),
            content_type,
            created_at_ms: num(h, header::CREATED_AT_MS)?,
            run_at_ms,
            idempotency_key: h
                .get(header::IDEMPOTENCY_KEY)
                .map(|v| v.as_str().to_string()),
            limit_key: h
                .get(header::LIMIT_KEY)
                .map(|v| v.as_str().to_string())
                .filter(|k| valid_limit_key(k)),
            fair_key: h
                .get(header::FAIR_KEY)
                .map(|v| v.as_str().to_string())
                .filter(|k| valid_fair_key(k)),
            traceparent: h
                .get(header::TRACEPARENT)
                .map(|v| v.as_str().to_string())
                .filter(|t| valid_traceparent(t)),
            business_id: h.get(header::BUSINESS_ID).map(|v| v.as_str().to_string()),
            retry_of: h
                .get(header::RETRY_OF)
                .and_then(|v| v.as_str().parse().ok()),
            lineage: match h.get(header::TRIGGER) {
                Some(trigger) => Some(Lineage {
                    trigger: trigger.as_str().to_string(),
                    source: get(h, header::TRIGGER_SOURCE)?.to_string(),
                    scheduled_at_ms: num(h, header::SCHEDULED_AT_MS)?,
                }),
                None => None,
            },
            defaulted: h
                .get(header::DEFAULTED)
                .map_or_else(Defaulted::default, |v| Defaulted::from_header(v.as_str())),
            unrecorded: h.get(header::UNRECORDED).is_some_and(|v| v.as_str() == "1"),
            wait: h.get(header::WAIT).and_then(|v| Wait::parse(v.as_str())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::protocol::BackoffRequest;

    fn req(name: &str) -> SubmitRequest {
        SubmitRequest {
            name: name.into(),
            ..Default::default()
        }
    }

    #[test]
    fn headers_round_trip() {
        let mut r = req("send_email");
        r.priority = Some("high".into());
        r.delay_ms = Some(5_000);
        r.idempotency_key = Some("user-1:2026-11-29".into());
        r.retry_on = Some(vec!["io".into(), "http.503".into()]);
        r.backoff = Some(BackoffRequest {
            base_ms: Some(10),
            max_ms: Some(1000),
            jitter: Some(0.1),
        });
        let (meta, payload) = TaskMeta::from_request("emails", r, &Limits::default()).unwrap();
        assert_eq!(&payload[..], b"null");
        assert!(meta.run_at_ms.unwrap() >= meta.created_at_ms + 5_000);
        assert_eq!(TaskMeta::from_headers(&meta.to_headers()).unwrap(), meta);
        assert!(meta.retryable("io"));
        assert!(!meta.retryable("validation"));
    }

    #[test]
    fn bad_fields_name_the_field() {
        let limits = Limits::default();
        let cases: Vec<(SubmitRequest, &str)> = vec![
            (req("bad name"), "name"),
            (
                SubmitRequest {
                    delay_ms: Some(-1),
                    ..req("a")
                },
                "delay_ms",
            ),
            (
                SubmitRequest {
                    delay_ms: Some(i64::MAX),
                    ..req("a")
                },
                "delay_ms",
            ),
            (
                SubmitRequest {
                    priority: Some("urgent".into()),
                    ..req("a")
                },
                "priority",
            ),
            (
                SubmitRequest {
                    run_at: Some("tomorrow".into()),
                    ..req("a")
                },
                "run_at",
            ),
            (
                SubmitRequest {
                    max_attempts: Some(0),
                    ..req("a")
                },
                "max_attempts",
            ),
            (
                SubmitRequest {
                    timeout_ms: Some(0),
                    ..req("a")
                },
                "timeout_ms",
            ),
            (
                SubmitRequest {
                    payload_base64: Some("***".into()),
                    ..req("a")
                },
                "payload_base64",
            ),
            (
                SubmitRequest {
                    no_retry_on: Some(vec!["a,b".into()]),
                    ..req("a")
                },
                "no_retry_on",
            ),
            (
                SubmitRequest {
                    queue: Some("other".into()),
                    ..req("a")
                },
                "queue",
            ),
        ];
        for (r, field) in cases {
            let err = TaskMeta::from_request("q", r.clone(), &limits).unwrap_err();
            assert_eq!(err.code, ErrorCode::InvalidField, "{r:?}");
            assert_eq!(err.field.as_deref(), Some(field), "{r:?}");
        }
    }

    #[test]
    fn oversize_payload_is_refused() {
        let limits = Limits {
            max_payload_bytes: 8,
            ..Limits::default()
        };
        let r = SubmitRequest {
            payload: Some(serde_json::json!("0123456789")),
            ..req("a")
        };
        let err = TaskMeta::from_request("q", r, &limits).unwrap_err();
        assert_eq!(err.code, ErrorCode::PayloadTooLarge);
    }

    #[test]
    fn a_delivered_payload_is_checked_as_a_submit_would_have() {
        let (json, payload) = TaskMeta::from_request("q", req("a"), &Limits::default()).unwrap();
        assert!(json.check_payload(&payload).is_ok());
        let err = json.check_payload(b"{not json").unwrap_err();
        assert_eq!(
            (err.code, err.field.as_deref()),
            (ErrorCode::InvalidField, Some("payload"))
        );
        let big = vec![b' '; Limits::default().max_payload_bytes + 1];
        assert_eq!(
            json.check_payload(&big).unwrap_err().code,
            ErrorCode::PayloadTooLarge
        );
        let bytes = SubmitRequest {
            payload_base64: Some("AP8=".into()),
            ..req("a")
        };
        let (bytes, payload) = TaskMeta::from_request("q", bytes, &Limits::default()).unwrap();
        assert!(bytes.check_payload(&payload).is_ok(), "bytes are not JSON");
        assert!(
            bytes.check_payload(&big).is_err(),
            "but have the same bound"
        );
    }

    #[test]
    fn past_run_at_runs_now() {
        let r = SubmitRequest {
            run_at: Some("2001-01-01T00:00:00Z".into()),
            ..req("a")
        };
        let (meta, _) = TaskMeta::from_request("q", r, &Limits::default()).unwrap();
        assert_eq!(meta.run_at_ms, None);
    }
}
