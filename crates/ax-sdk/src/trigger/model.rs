//! Trigger definitions: when (kind + params), what (task templates), and policies.
//!
//! A definition is JSON (or YAML) stored in the `AX_TRIGGERS` bucket under its name.
//! [`TriggerDef::check_fields`] checks every field but the schedule's expression; the
//! server parses that too (cron and time zones live there) before it stores one.

use crate::names;
use crate::protocol::{ErrorCode, SubmitRequest, WireError};
use serde::{Deserialize, Serialize};

/// When a trigger fires.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Kind {
    /// A cron expression: 5 fields (minute precision) or 6 with seconds first, evaluated
    /// in `tz` (an IANA zone, default `UTC`).
    Cron {
        /// The expression, e.g. `0 8 * * Mon-Fri` or `*/10 * * * * *`.
        expr: String,
        /// IANA time zone, e.g. `Europe/Berlin`.
        #[serde(default = "utc")]
        tz: String,
    },
    /// Every `every_ms` (at least 1000).
    Interval {
        /// Period in milliseconds.
        every_ms: u64,
        /// `fixed_rate` (default): times are `start + k × every`, never re-aligned to when a
        /// fire happened (no drift). `fixed_delay`: the next fire is `every` after the
        /// previous fire's tasks finished.
        #[serde(default)]
        mode: IntervalMode,
        /// First fire time, RFC 3339 (default: one period after creation).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_at: Option<String>,
    },
    /// Once, at an RFC 3339 time.
    Once {
        /// The time.
        at: String,
    },
    /// Every message on a NATS subject starts a fire; the message body becomes the
    /// payload of templates that have none.
    Event {
        /// The subject (wildcards allowed; not under `ax.` or `$`).
        subject: String,
    },
}

fn utc() -> String {
    "UTC".to_string()
}

/// Interval semantics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IntervalMode {
    /// Scheduled times are fixed; no drift.
    #[default]
    FixedRate,
    /// Next fire = previous completion + period.
    FixedDelay,
}

/// What to do with fire times missed while ax or NATS was down.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MisfirePolicy {
    /// Fire once for all missed times, scheduled at the latest one (default).
    #[default]
    FireOnce,
    /// Drop missed times; fire only times within the grace window.
    Skip,
    /// Fire every missed time, at most `max_catch_up` of them (the latest ones).
    FireAll,
}

/// When the previous fire's tasks are still running at the next fire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverlapPolicy {
    /// Do not fire; count it as skipped.
    Skip,
    /// Remember one fire and start it as soon as the running one ends, then return to the
    /// normal cadence (default).
    #[default]
    BufferOne,
    /// Fire anyway.
    Allow,
    /// The new fire wins: cancel the previous fire's unfinished tasks (a running
    /// handler is signalled to stop, as an operator's cancel does), then fire. Several
    /// times missed at once fire as the latest of them.
    CancelInProgress,
}

fn default_grace_ms() -> u64 {
    60_000
}

fn default_max_catch_up() -> u32 {
    10
}

fn yes() -> bool {
    true
}

/// A flow run started at each fire (flows started by cron, interval, once, event or
/// manual runs; overlap policies count the run as the fire's work until it ends).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowStart {
    /// The flow's name (its definition is read from `AX_FLOWS` at each fire).
    pub flow: String,
    /// The run's input; absent: an event's message body (JSON if it parses), else `null`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<serde_json::Value>,
}

/// A trigger definition. Decode it with [`TriggerDef::decode`], which refuses unknown
/// fields (serde cannot, with the flattened kind).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TriggerDef {
    /// Name, 1..=64 of `A-Z a-z 0-9 _ -`.
    pub name: String,
    /// When it fires.
    #[serde(flatten)]
    pub kind: Kind,
    /// Paused triggers keep their definition and state but do not fire.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Missed-fire policy.
    #[serde(default)]
    pub misfire: MisfirePolicy,
    /// A fire time more than this late counts as missed (default 60 s).
    #[serde(default = "default_grace_ms")]
    pub grace_ms: u64,
    /// Most missed fires `fire_all` makes up (default 10).
    #[serde(default = "default_max_catch_up")]
    pub max_catch_up: u32,
    /// Overlap policy.
    #[serde(default)]
    pub overlap: OverlapPolicy,
    /// Tasks submitted at each fire: submit requests whose `queue` is required and which
    /// take no `delay_ms`, `run_at` or `idempotency_key` (ax sets the key).
    #[serde(default)]
    pub tasks: Vec<SubmitRequest>,
    /// Flow runs started at each fire (with `tasks`, 1..=16 in all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub flows: Vec<FlowStart>,
}

/// Longest name, in bytes.
const MAX_NAME: usize = 64;

const COMMON_FIELDS: [&str; 9] = [
    "name",
    "kind",
    "enabled",
    "misfire",
    "grace_ms",
    "max_catch_up",
    "overlap",
    "tasks",
    "flows",
];

/// The fields each kind adds to [`COMMON_FIELDS`].
const KIND_FIELDS: [(&str, &[&str]); 4] = [
    ("cron", &["expr", "tz"]),
    ("interval", &["every_ms", "mode", "start_at"]),
    ("once", &["at"]),
    ("event", &["subject"]),
];

impl TriggerDef {
    /// Every field a definition may have, of any kind (the decoder refuses the others).
    pub fn fields() -> impl Iterator<Item = &'static str> {
        COMMON_FIELDS
            .into_iter()
            .chain(KIND_FIELDS.into_iter().flat_map(|(_, f)| f.iter().copied()))
    }

    /// Decodes a definition from JSON, refusing unknown fields by name.
    pub fn decode(value: serde_json::Value) -> Result<TriggerDef, WireError> {
        let bad = |m: String| WireError::new(ErrorCode::BadRequest, m);
        let Some(object) = value.as_object() else {
            return Err(bad("a trigger definition is a JSON object".into()));
        };
        let kind_fields: &[&str] = match object.get("kind").and_then(|k| k.as_str()) {
            Some(kind) => match KIND_FIELDS.iter().find(|(k, _)| *k == kind) {
                Some((_, fields)) => fields,
                None => {
                    return Err(bad(format!(
                        "unknown kind {kind:?} (expected cron, interval, once or event)"
                    )))
                }
            },
            None => return Err(bad("missing field `kind`".into())),
        };
        if let Some(unknown) = object
            .keys()
            .find(|k| !COMMON_FIELDS.contains(&k.as_str()) && !kind_fields.contains(&k.as_str()))
        {
            return Err(bad(format!("unknown field `{unknown}`")));
        }
        serde_json::from_value(value).map_err(|e| bad(e.to_string()))
    }

    /// Checks every field but the recurrence (the cron expression, zone, interval), which
    /// the server parses.
    pub fn check_fields(&self) -> Result<(), WireError> {
        if !names::valid_token(&self.name, MAX_NAME) {
            return Err(WireError::field(
                "name",
                "must be 1..=64 of A-Z a-z 0-9 _ -",
            ));
        }
        let work = self.tasks.len() + self.flows.len();
        if work == 0 || work > 16 {
            return Err(WireError::field(
                "tasks",
                "give 1..=16 task templates and flows in all",
            ));
        }
        for (i, start) in self.flows.iter().enumerate() {
            if !names::valid_token(&start.flow, MAX_NAME) {
                return Err(WireError::field(
                    &format!("flows[{i}].flow"),
                    "must be 1..=64 of A-Z a-z 0-9 _ -",
                ));
            }
        }
        for (i, task) in self.tasks.iter().enumerate() {
            let field = |f: &str| format!("tasks[{i}].{f}");
            match &task.queue {
                Some(q) if names::valid_queue(q) => {}
                _ => {
                    return Err(WireError::field(
                        &field("queue"),
                        "a valid queue is required",
                    ))
                }
            }
            if task.delay_ms.is_some() || task.run_at.is_some() {
                return Err(WireError::field(
                    &field("delay_ms"),
                    "the trigger decides when",
                ));
            }
            if task.idempotency_key.is_some() {
                return Err(WireError::field(
                    &field("idempotency_key"),
                    "ax keys each fire by trigger and scheduled time",
                ));
            }
        }
        if self.max_catch_up == 0 || self.max_catch_up > 1000 {
            return Err(WireError::field("max_catch_up", "must be 1..=1000"));
        }
        Ok(())
    }

    /// Checks each task template as a submit of it would be checked, so a trigger that
    /// could never fire is refused when it is stored, naming the field
    /// (`tasks[<i>].<field>`).
    pub fn check_templates(&self, limits: &crate::task::Limits) -> Result<(), WireError> {
        for (i, task) in self.tasks.iter().enumerate() {
            let queue = task.queue.clone().unwrap_or_default();
            crate::task::TaskMeta::from_request(&queue, task.clone(), limits).map_err(
                |mut e| {
                    e.field = Some(format!("tasks[{i}].{}", e.field.as_deref().unwrap_or("")));
                    e
                },
            )?;
        }
        Ok(())
    }

    /// The task templates' queues.
    pub fn queues(&self) -> impl Iterator<Item = &str> {
        self.tasks.iter().filter_map(|t| t.queue.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_kind_takes_its_own_fields_and_refuses_the_others_by_name() {
        let task = json!([{"name": "t", "queue": "q"}]);
        let ok = [
            json!({"name": "a", "kind": "cron", "expr": "0 * * * * *", "tz": "UTC", "tasks": task}),
            json!({"name": "a", "kind": "interval", "every_ms": 1000, "tasks": task}),
            json!({"name": "a", "kind": "once", "at": "2030-01-01T00:00:00Z", "tasks": task}),
            json!({"name": "a", "kind": "event", "subject": "orders.created", "tasks": task}),
        ];
        for def in ok {
            TriggerDef::decode(def.clone()).unwrap_or_else(|e| panic!("{def}: {e:?}"));
        }
        let cross = json!({"name": "a", "kind": "once", "at": "2030-01-01T00:00:00Z",
            "every_ms": 1000, "tasks": task});
        let e = TriggerDef::decode(cross).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(e.message.contains("every_ms"), "{e:?}");
        for def in [
            json!({"name": "a", "kind": "weekly"}),
            json!({"name": "a"}),
            json!([1]),
        ] {
            assert_eq!(
                TriggerDef::decode(def).unwrap_err().code,
                ErrorCode::BadRequest
            );
        }
        let fields: Vec<&str> = TriggerDef::fields().collect();
        let unique: std::collections::BTreeSet<&str> = fields.iter().copied().collect();
        assert_eq!(fields.len(), unique.len(), "{fields:?}");
        assert!(["flows", "expr", "subject", "at"]
            .iter()
            .all(|f| unique.contains(f)));
    }
}
