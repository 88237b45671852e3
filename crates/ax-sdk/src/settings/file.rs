//! The settings file (`runtime.yaml`): tunable parameters of tasks kept apart from code,
//! in the words of the Python decorator, applied with `ax apply -f` or loaded by the
//! Python runtime at start (PROTOCOL.md §8, "The settings file").
//!
//! ```yaml
//! tasks:
//!   create_invoice:           # the task name
//!     queue: billing          # default "default"
//!     retries: 3              # attempts after the first (or max_attempts: 4)
//!     timeout: 60s            # hard timeout: a duration ("500ms", "2m") or seconds
//!     heartbeat_timeout: 5m   # soft timeout
//!     retry_backoff: 10s      # first retry delay, doubling ...
//!     retry_backoff_max: 10m  # ... up to this
//!     retry_jitter: 0.2
//!     retry_on: [InvoiceApiError]
//!     no_retry_on: [ConfigError]
//!     concurrency: 4          # per worker
//!     alert_group: billing
//! ```
//!
//! This module reads the file's data (YAML or JSON, already parsed) into [`TaskSettings`];
//! the command line and the Python package both use it, so the file means the same
//! everywhere. Errors name the field: `tasks.create_invoice.timeout`.

use super::{key, TaskSettings};
use crate::error::WireError;
use crate::protocol::BackoffRequest;
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Duration;

/// The queue of a task the file does not give one.
pub const DEFAULT_QUEUE: &str = "default";

/// One task's entry in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskEntry {
    /// Queue (default `default`).
    #[serde(default)]
    pub queue: Option<String>,
    /// Attempts after the first.
    #[serde(default)]
    pub retries: Option<u32>,
    /// Attempts in all (instead of `retries`).
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// Hard timeout.
    #[serde(default)]
    pub timeout: Option<Value>,
    /// Soft timeout.
    #[serde(default)]
    pub heartbeat_timeout: Option<Value>,
    /// First retry delay.
    #[serde(default)]
    pub retry_backoff: Option<Value>,
    /// Longest retry delay.
    #[serde(default)]
    pub retry_backoff_max: Option<Value>,
    /// Fraction by which a delay is randomly shortened.
    #[serde(default)]
    pub retry_jitter: Option<f64>,
    /// Error classes retried.
    #[serde(default, alias = "retry_on_exception")]
    pub retry_on: Option<Vec<String>>,
    /// Error classes never retried.
    #[serde(default, alias = "no_retry_on_exception")]
    pub no_retry_on: Option<Vec<String>>,
    /// Per-worker concurrency of the name.
    #[serde(default)]
    pub concurrency: Option<u32>,
    /// Alert label.
    #[serde(default)]
    pub alert_group: Option<String>,
}

/// One task's settings from the file.
#[derive(Debug, Clone, PartialEq)]
pub struct FileTask {
    /// Queue.
    pub queue: String,
    /// Task name.
    pub name: String,
    /// Its settings, checked.
    pub settings: TaskSettings,
}

/// A duration as the file writes it: a number of seconds or a string such as `"90s"`,
/// `"1m 30s"`, `"250ms"`; in whole ms, at least 1.
fn millis(field: &str, v: &Value) -> Result<u64, WireError> {
    let d = match v {
        Value::Number(n) => match n.as_f64() {
            Some(s) if s.is_finite() && s > 0.0 && s <= 1e9 => Duration::from_secs_f64(s),
            _ => {
                return Err(WireError::field(
                    field,
                    format!("{n} is not a positive number of seconds"),
                ))
            }
        },
        Value::String(s) => humantime::parse_duration(s.trim()).map_err(|e| {
            WireError::field(
                field,
                format!("{s:?}: {e} (write e.g. \"30s\", \"5m\", \"250ms\")"),
            )
        })?,
        other => {
            return Err(WireError::field(
                field,
                format!("{other} is not a duration"),
            ))
        }
    };
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms == 0 {
        return Err(WireError::field(field, "must be at least 1 ms"));
    }
    Ok(ms)
}

impl TaskEntry {
    /// The settings this entry sets, for task `name`; errors name `<at>.<field>`.
    pub fn settings(&self, at: &str) -> Result<TaskSettings, WireError> {
        let field = |f: &str| format!("{at}.{f}");
        let ms = |f: &str, v: &Option<Value>| v.as_ref().map(|v| millis(&field(f), v)).transpose();
        let max_attempts = match (self.retries, self.max_attempts) {
            (Some(_), Some(_)) => {
                return Err(WireError::field(
                    &field("retries"),
                    "give retries or max_attempts, not both",
                ))
            }
            (Some(r), None) => Some(r.saturating_add(1)),
            (None, m) => m,
        };
        let backoff_ms = ms("retry_backoff", &self.retry_backoff)?;
        let backoff_max_ms = ms("retry_backoff_max", &self.retry_backoff_max)?;
        let backoff = (backoff_ms.is_some()
            || backoff_max_ms.is_some()
            || self.retry_jitter.is_some())
        .then(|| BackoffRequest {
            base_ms: backoff_ms.map(|v| v.min(i64::MAX as u64) as i64),
            max_ms: backoff_max_ms.map(|v| v.min(i64::MAX as u64) as i64),
            jitter: self.retry_jitter,
        });
        let settings = TaskSettings {
            max_attempts,
            timeout_ms: ms("timeout", &self.timeout)?,
            heartbeat_timeout_ms: ms("heartbeat_timeout", &self.heartbeat_timeout)?,
            backoff,
            retry_on: self.retry_on.clone(),
            no_retry_on: self.no_retry_on.clone(),
            concurrency: self.concurrency,
            alert_group: self.alert_group.clone(),
        };
        // The checks' field names, in the file's words.
        settings.validate().map_err(|mut e| {
            let name = match e.field.as_deref() {
                Some("max_attempts") if self.retries.is_some() => "retries",
                Some("timeout_ms") => "timeout",
                Some("heartbeat_timeout_ms") => "heartbeat_timeout",
                Some("backoff.base_ms") => "retry_backoff",
                Some("backoff.max_ms") => "retry_backoff_max",
                Some("backoff.jitter") => "retry_jitter",
                Some(other) => other,
                None => "",
            }
            .to_string();
            e.field = Some(field(&name));
            e
        })?;
        Ok(settings)
    }
}

/// Reads the `tasks:` section of a settings file (the whole file, parsed from YAML or
/// JSON): each task's queue, name and settings, checked; `None` if the file has no such
/// section.
pub fn read_tasks(file: &Value) -> Result<Option<Vec<FileTask>>, WireError> {
    let Some(tasks) = file.get("tasks") else {
        return Ok(None);
    };
    let entries: BTreeMap<String, Value> = serde_json::from_value(tasks.clone()).map_err(|e| {
        WireError::field(
            "tasks",
            format!("must map task names to their settings: {e}"),
        )
    })?;
    let mut out = Vec::with_capacity(entries.len());
    for (name, entry) in entries {
        let at = format!("tasks.{name}");
        let entry: TaskEntry = match entry {
            Value::Null => TaskEntry::default(),
            v => serde_json::from_value(v).map_err(|e| WireError::field(&at, e.to_string()))?,
        };
        let queue = entry
            .queue
            .clone()
            .unwrap_or_else(|| DEFAULT_QUEUE.to_string());
        key(&queue, &name).map_err(|e| {
            let f = e.field.as_deref().unwrap_or("name");
            let where_ = if f == "queue" {
                format!("{at}.queue")
            } else {
                at.clone()
            };
            WireError::field(&where_, e.message)
        })?;
        let settings = entry.settings(&at)?;
        out.push(FileTask {
            queue,
            name,
            settings,
        });
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_file_reads_in_the_decorators_words() {
        let file = json!({"tasks": {
            "create_invoice": {
                "queue": "billing", "retries": 3, "timeout": "60s", "heartbeat_timeout": 300,
                "retry_backoff": "10s", "retry_on_exception": ["InvoiceApiError"],
                "no_retry_on": ["ConfigError"], "concurrency": 4, "alert_group": "billing"
            },
            "send_notification": {"timeout": 5.5}
        }});
        let tasks = read_tasks(&file).unwrap().unwrap();
        assert_eq!(tasks.len(), 2);
        let inv = &tasks[0];
        assert_eq!(
            (inv.queue.as_str(), inv.name.as_str()),
            ("billing", "create_invoice")
        );
        let s = &inv.settings;
        assert_eq!(s.max_attempts, Some(4));
        assert_eq!(s.timeout_ms, Some(60_000));
        assert_eq!(s.heartbeat_timeout_ms, Some(300_000));
        assert_eq!(s.backoff.as_ref().unwrap().base_ms, Some(10_000));
        assert_eq!(
            s.backoff.as_ref().unwrap().max_ms,
            None,
            "the default applies"
        );
        assert_eq!(
            s.retry_on.as_deref(),
            Some(&["InvoiceApiError".to_string()][..])
        );
        assert_eq!(s.concurrency, Some(4));
        assert_eq!(s.alert_group.as_deref(), Some("billing"));
        assert_eq!(tasks[1].queue, DEFAULT_QUEUE);
        assert_eq!(tasks[1].settings.timeout_ms, Some(5_500));
        assert_eq!(read_tasks(&json!({"triggers": []})).unwrap(), None);
    }

    #[test]
    fn bad_values_name_their_place_in_the_file() {
        let cases = [
            (json!({"t": {"timeout": "soon"}}), "tasks.t.timeout"),
            (json!({"t": {"timeout": -1}}), "tasks.t.timeout"),
            (json!({"t": {"timeout": 1e300}}), "tasks.t.timeout"),
            (json!({"t": {"timeout": "0s"}}), "tasks.t.timeout"),
            (json!({"t": {"timeout": "25h"}}), "tasks.t.timeout"),
            (json!({"t": {"retries": 5000}}), "tasks.t.retries"),
            (
                json!({"t": {"retries": 1, "max_attempts": 2}}),
                "tasks.t.retries",
            ),
            (json!({"t": {"retry_jitter": 2.0}}), "tasks.t.retry_jitter"),
            (
                json!({"t": {"retry_backoff": "1m", "retry_backoff_max": "1s"}}),
                "tasks.t.retry_backoff_max",
            ),
            (json!({"t": {"concurrency": 0}}), "tasks.t.concurrency"),
            (json!({"t": {"retrys": 3}}), "tasks.t"),
            (json!({"t": {"queue": "a b"}}), "tasks.t.queue"),
            (json!({"a.b": {}}), "tasks.a.b"),
            (json!(["t"]), "tasks"),
        ];
        for (tasks, field) in cases {
            let e = read_tasks(&json!({ "tasks": tasks })).unwrap_err();
            assert_eq!(e.field.as_deref(), Some(field), "{tasks}: {e:?}");
        }
    }
}
