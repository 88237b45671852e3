//! Per-task settings kept apart from code and changed live (PROTOCOL.md §8, "Task
//! settings"): the JSON of one task name's options, as a worker declares them in code, as
//! an operator stores them in KV (`ax tasks options set`, `ax apply -f runtime.yaml`), and
//! as the Python decorator passes them to the Rust worker.
//!
//! Stored settings live in `AX_LIMITS` under `<queue>.=task.<name>` beside the queue's
//! limits and pause flag, so the watch every worker already keeps on its queue's key space
//! brings them: a change applies to the next attempt that starts, within a second.
//!
//! Precedence, per field: what the producer set on the submit (the task's own value) >
//! the stored settings > the worker's declared options (`@ax.task(...)`,
//! [`TaskOptions`](crate::worker::TaskOptions)) > the server's defaults.

mod client;
pub mod file;

use crate::backoff::Backoff;
use crate::error::WireError;
use crate::names;
use crate::protocol::BackoffRequest;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The longest hard or soft timeout a setting may hold (24 h, the submit's limit).
pub const MAX_TIMEOUT_MS: u64 = 24 * 3600 * 1000;
/// Most attempts a setting may allow (the submit's limit).
pub const MAX_ATTEMPTS: u32 = 1000;
/// Most concurrent attempts of one name per worker a setting may allow.
pub const MAX_CONCURRENCY: u32 = 100_000;

/// One task name's options; every field is optional (unset: the next source decides).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSettings {
    /// Attempts in all (1..=1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Hard timeout of one attempt in ms (1..=86400000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Soft timeout in ms: an attempt that has not called `heartbeat()` for this long is
    /// failed with class `heartbeat_timeout` (retried like any failure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_timeout_ms: Option<u64>,
    /// Retry backoff, as on a submit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<BackoffRequest>,
    /// Error classes retried (others are not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_on: Option<Vec<String>>,
    /// Error classes never retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_retry_on: Option<Vec<String>>,
    /// Most attempts of this name running at once in one worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    /// A label the server puts on this name's alerts (`group`), for routing them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alert_group: Option<String>,
}

impl TaskSettings {
    /// True if no field is set.
    pub fn is_empty(&self) -> bool {
        *self == TaskSettings::default()
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), WireError> {
        let bad = |field: &str, msg: String| Err(WireError::field(field, msg));
        if let Some(n) = self.max_attempts {
            if !(1..=MAX_ATTEMPTS).contains(&n) {
                return bad("max_attempts", format!("{n} is outside 1..={MAX_ATTEMPTS}"));
            }
        }
        for (field, v) in [
            ("timeout_ms", self.timeout_ms),
            ("heartbeat_timeout_ms", self.heartbeat_timeout_ms),
        ] {
            if let Some(ms) = v {
                if !(1..=MAX_TIMEOUT_MS).contains(&ms) {
                    return bad(field, format!("{ms} ms is outside 1..={MAX_TIMEOUT_MS} ms"));
                }
            }
        }
        if let Some(b) = &self.backoff {
            Backoff::from_request(b.clone())?;
        }
        for (field, list) in [
            ("retry_on", &self.retry_on),
            ("no_retry_on", &self.no_retry_on),
        ] {
            for class in list.iter().flatten() {
                if class.is_empty() || class.len() > 128 || class.chars().any(char::is_control) {
                    return bad(field, format!("{class:?} is not an error class (1..=128 characters, no control characters)"));
                }
            }
            if list.as_ref().is_some_and(|l| l.len() > 256) {
                return bad(field, "more than 256 classes".into());
            }
        }
        if let Some(n) = self.concurrency {
            if !(1..=MAX_CONCURRENCY).contains(&n) {
                return bad(
                    "concurrency",
                    format!("{n} is outside 1..={MAX_CONCURRENCY}"),
                );
            }
        }
        if let Some(g) = &self.alert_group {
            if !names::valid_token(g, 64) {
                return bad("alert_group", "must be 1..=64 of A-Z a-z 0-9 _ -".into());
            }
        }
        Ok(())
    }

    /// These settings over `base`: each field set here wins, the rest come from `base`.
    pub fn over(&self, base: &TaskSettings) -> TaskSettings {
        TaskSettings {
            max_attempts: self.max_attempts.or(base.max_attempts),
            timeout_ms: self.timeout_ms.or(base.timeout_ms),
            heartbeat_timeout_ms: self.heartbeat_timeout_ms.or(base.heartbeat_timeout_ms),
            backoff: self.backoff.clone().or_else(|| base.backoff.clone()),
            retry_on: self.retry_on.clone().or_else(|| base.retry_on.clone()),
            no_retry_on: self
                .no_retry_on
                .clone()
                .or_else(|| base.no_retry_on.clone()),
            concurrency: self.concurrency.or(base.concurrency),
            alert_group: self
                .alert_group
                .clone()
                .or_else(|| base.alert_group.clone()),
        }
    }

    /// The hard timeout, if set.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout_ms.map(Duration::from_millis)
    }

    /// The soft timeout, if set.
    pub fn heartbeat_timeout(&self) -> Option<Duration> {
        self.heartbeat_timeout_ms.map(Duration::from_millis)
    }
}

/// The `AX_LIMITS` key of the stored settings of task `name` on `queue`, both checked
/// (`invalid_field` naming `queue` or `name`).
pub fn key(queue: &str, name: &str) -> Result<String, WireError> {
    if !names::valid_queue(queue) {
        return Err(WireError::field("queue", "not a queue name"));
    }
    if !names::valid_token(name, 64) {
        return Err(WireError::field(
            "name",
            "not a task name (1..=64 of A-Z a-z 0-9 _ -)",
        ));
    }
    Ok(format!("{queue}.{KEY_MARK}{name}"))
}

/// What follows `<queue>.` in a settings key (`=` is never part of a limit name).
pub const KEY_MARK: &str = "=task.";

/// The task name of a settings key of `queue`, if `key` is one.
pub fn name_of_key<'a>(queue: &str, key: &'a str) -> Option<&'a str> {
    key.strip_prefix(queue)?
        .strip_prefix('.')?
        .strip_prefix(KEY_MARK)
}

/// Stored settings of one task name: the body of `ax.task.options_put`, the answer of
/// `options_get` and `options_list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredSettings {
    /// Queue.
    pub queue: String,
    /// Task name.
    pub name: String,
    /// The settings.
    pub settings: TaskSettings,
}

/// Names one task name's settings: `{"queue", "name"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettingsName {
    /// Queue.
    pub queue: String,
    /// Task name.
    pub name: String,
}

/// Picks the settings of one queue (`{"queue"}`) or of all (`{}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettingsFilter {
    /// Only this queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn validate_names_the_bad_field() {
        let cases: Vec<(TaskSettings, &str)> = vec![
            (
                TaskSettings {
                    max_attempts: Some(0),
                    ..Default::default()
                },
                "max_attempts",
            ),
            (
                TaskSettings {
                    max_attempts: Some(1001),
                    ..Default::default()
                },
                "max_attempts",
            ),
            (
                TaskSettings {
                    timeout_ms: Some(0),
                    ..Default::default()
                },
                "timeout_ms",
            ),
            (
                TaskSettings {
                    heartbeat_timeout_ms: Some(u64::MAX),
                    ..Default::default()
                },
                "heartbeat_timeout_ms",
            ),
            (
                TaskSettings {
                    backoff: Some(BackoffRequest {
                        base_ms: Some(-1),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                "backoff.base_ms",
            ),
            (
                TaskSettings {
                    backoff: Some(BackoffRequest {
                        jitter: Some(f64::NAN),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                "backoff.jitter",
            ),
            (
                TaskSettings {
                    retry_on: Some(vec![String::new()]),
                    ..Default::default()
                },
                "retry_on",
            ),
            (
                TaskSettings {
                    no_retry_on: Some(vec!["a\nb".into()]),
                    ..Default::default()
                },
                "no_retry_on",
            ),
            (
                TaskSettings {
                    concurrency: Some(0),
                    ..Default::default()
                },
                "concurrency",
            ),
            (
                TaskSettings {
                    alert_group: Some("a b".into()),
                    ..Default::default()
                },
                "alert_group",
            ),
        ];
        for (s, field) in cases {
            let e = s.validate().unwrap_err();
            assert_eq!(
                (e.code, e.field.as_deref()),
                (ErrorCode::InvalidField, Some(field)),
                "{s:?}"
            );
        }
        let good = TaskSettings {
            max_attempts: Some(3),
            timeout_ms: Some(60_000),
            heartbeat_timeout_ms: Some(5_000),
            retry_on: Some(vec!["InvoiceApiError".into()]),
            concurrency: Some(4),
            alert_group: Some("billing".into()),
            ..Default::default()
        };
        good.validate().unwrap();
        // Unknown fields are refused, so a typo is not silently ignored.
        assert!(serde_json::from_str::<TaskSettings>(r#"{"retries": 3}"#).is_err());
    }

    #[test]
    fn over_takes_each_field_from_the_first_that_sets_it() {
        let stored = TaskSettings {
            max_attempts: Some(9),
            retry_on: Some(vec![]),
            ..Default::default()
        };
        let declared = TaskSettings {
            max_attempts: Some(3),
            timeout_ms: Some(10),
            retry_on: Some(vec!["io".into()]),
            ..Default::default()
        };
        let merged = stored.over(&declared);
        assert_eq!(merged.max_attempts, Some(9));
        assert_eq!(merged.timeout_ms, Some(10));
        assert_eq!(merged.retry_on, Some(vec![]), "an empty list is a value");
        assert_eq!(merged.concurrency, None);
    }

    #[test]
    fn keys_round_trip_and_are_checked() {
        let k = key("billing", "create_invoice").unwrap();
        assert_eq!(k, "billing.=task.create_invoice");
        assert_eq!(name_of_key("billing", &k), Some("create_invoice"));
        assert_eq!(name_of_key("bill", &k), None);
        assert_eq!(name_of_key("billing", "billing.=paused"), None);
        assert_eq!(
            key("billing", "a.b").unwrap_err().field.as_deref(),
            Some("name")
        );
        assert_eq!(key("a b", "n").unwrap_err().field.as_deref(), Some("queue"));
    }
}
