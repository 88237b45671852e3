//! Declarative JetStream topology: the JSON files in `streams/`, applied idempotently.
//!
//! The files are the same JSON the `nats` CLI accepts (`nats stream add --config F`); they
//! are compiled into the binary so `ax streams apply` needs no checkout. [`Topology`] holds
//! the few settings an operator overrides (capacities, ack wait, replicas); [`apply`] creates
//! what is missing, updates what differs, and refuses changes JetStream cannot make in place
//! (retention, storage, a consumer's filter) with [`StreamsError::Incompatible`].
//!
//! `ax streams apply` is the one way to change an existing object. A server calls
//! [`ensure`] instead: it creates what is missing and never changes what exists, so a
//! server restarted with default flags cannot undo an operator's `--ack-wait 5m`; an object
//! that differs from the server's flags is reported ([`Outcome::Kept`]) and logged.

use async_nats::jetstream::{self, consumer, stream};
use ax_core::names::{self, Priority};
use serde_json::Value;
use std::time::Duration;

/// The stream definitions, by file name.
pub const STREAM_FILES: [(&str, &str); 21] = [
    (
        "AX_READY_HIGH.json",
        include_str!("../../../streams/AX_READY_HIGH.json"),
    ),
    (
        "AX_READY_NORMAL.json",
        include_str!("../../../streams/AX_READY_NORMAL.json"),
    ),
    (
        "AX_READY_LOW.json",
        include_str!("../../../streams/AX_READY_LOW.json"),
    ),
    (
        "AX_DELAYED.json",
        include_str!("../../../streams/AX_DELAYED.json"),
    ),
    (
        "AX_FAIR.json",
        include_str!("../../../streams/AX_FAIR.json"),
    ),
    (
        "AX_DEAD.json",
        include_str!("../../../streams/AX_DEAD.json"),
    ),
    (
        "KV_AX_TASKS.json",
        include_str!("../../../streams/KV_AX_TASKS.json"),
    ),
    (
        "KV_AX_RESULTS.json",
        include_str!("../../../streams/KV_AX_RESULTS.json"),
    ),
    (
        "KV_AX_IDEMPOTENCY.json",
        include_str!("../../../streams/KV_AX_IDEMPOTENCY.json"),
    ),
    (
        "KV_AX_TRIGGERS.json",
        include_str!("../../../streams/KV_AX_TRIGGERS.json"),
    ),
    (
        "KV_AX_TRIGGER_STATE.json",
        include_str!("../../../streams/KV_AX_TRIGGER_STATE.json"),
    ),
    (
        "KV_AX_LEASES.json",
        include_str!("../../../streams/KV_AX_LEASES.json"),
    ),
    (
        "KV_AX_FLOWS.json",
        include_str!("../../../streams/KV_AX_FLOWS.json"),
    ),
    (
        "KV_AX_FLOW_RUNS.json",
        include_str!("../../../streams/KV_AX_FLOW_RUNS.json"),
    ),
    (
        "KV_AX_LIMITS.json",
        include_str!("../../../streams/KV_AX_LIMITS.json"),
    ),
    (
        "KV_AX_LIMIT_STATE.json",
        include_str!("../../../streams/KV_AX_LIMIT_STATE.json"),
    ),
    (
        "KV_AX_LIMIT_SLOTS.json",
        include_str!("../../../streams/KV_AX_LIMIT_SLOTS.json"),
    ),
    (
        "KV_AX_ALERTS.json",
        include_str!("../../../streams/KV_AX_ALERTS.json"),
    ),
    (
        "KV_AX_WAITS.json",
        include_str!("../../../streams/KV_AX_WAITS.json"),
    ),
    (
        "AX_EVENTS.json",
        include_str!("../../../streams/AX_EVENTS.json"),
    ),
    (
        "AX_TASK_EVENTS.json",
        include_str!("../../../streams/AX_TASK_EVENTS.json"),
    ),
];

/// Streams made only when asked for (`Topology::task_events`).
fn is_optional(file: &str) -> bool {
    file.trim_end_matches(".json") == names::EVENTS_STREAM
}

/// The ready-consumer template (`{queue}` and `{priority}` are substituted).
pub const READY_CONSUMER_TEMPLATE: &str = include_str!("../../../streams/consumers/ready.json");

/// Operator settings applied over the files. Defaults match the files.
#[derive(Debug, Clone)]
pub struct Topology {
    /// Capacity of each queue's ready subject per priority (high, normal, low):
    /// default 1000 / 5000 / 10000 tasks. A full one answers `busy`.
    pub capacity: [i64; 3],
    /// Most delayed tasks held at once, all queues (default 1,000,000).
    pub max_delayed: i64,
    /// How long a delivered task may go without an ack or heartbeat before it is
    /// redelivered (default 30 s).
    pub ack_wait: Duration,
    /// Most unacknowledged tasks per queue and priority across all workers (default 10,000).
    pub max_ack_pending: i64,
    /// Stream replicas (default 1; use 3 on a cluster).
    pub replicas: usize,
    /// Keep every task-state change for 30 days in `AX_TASK_EVENTS` (default false: the
    /// broker copying each record write cost about a tenth of end-to-end throughput,
    /// docs/PERFORMANCE.md). Without it a task's history is its record's last 16
    /// revisions.
    pub task_events: bool,
}

impl Default for Topology {
    fn default() -> Self {
        Topology {
            capacity: [1000, 5000, 10000],
            max_delayed: 1_000_000,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 10_000,
            replicas: 1,
            task_events: false,
        }
    }
}

/// Errors applying the topology.
#[derive(Debug, thiserror::Error)]
pub enum StreamsError {
    /// A definition file is not valid.
    #[error("definition {file}: {source}")]
    Definition {
        /// File name.
        file: String,
        /// Decode error.
        source: serde_json::Error,
    },
    /// A queue name is invalid.
    #[error("invalid queue name {0:?}: use 1..=64 of A-Z a-z 0-9 _ -")]
    InvalidQueue(String),
    /// The existing object differs in a field JetStream cannot change in place.
    #[error("{object}: field {field} is {existing} on the server but {desired} in the definition; migrate it by hand (see docs/ARCHITECTURE.md)")]
    Incompatible {
        /// Stream or consumer.
        object: String,
        /// Field name.
        field: String,
        /// Value on the server.
        existing: String,
        /// Value wanted.
        desired: String,
    },
    /// The broker refused or failed.
    #[error("{object}: {source}")]
    Broker {
        /// Stream or consumer.
        object: String,
        /// Underlying error.
        source: async_nats::Error,
    },
}

impl StreamsError {
    /// What kind of failure this is.
    pub fn kind(&self) -> ax_core::error::ErrorKind {
        use ax_core::error::ErrorKind;
        match self {
            StreamsError::Definition { .. } | StreamsError::InvalidQueue(_) => ErrorKind::Invalid,
            StreamsError::Incompatible { .. } => ErrorKind::Conflict,
            StreamsError::Broker { source, .. } => ErrorKind::of(source.as_ref()),
        }
    }
}

/// What [`apply`] or [`ensure`] did to one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It did not exist.
    Created,
    /// It existed with other settings and was changed ([`apply`]).
    Updated,
    /// It already matched.
    Unchanged,
    /// It exists with other settings and was left as it is ([`ensure`]).
    Kept,
}

/// A field whose value on the server differs from the definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// Field name, as in the JSON definition.
    pub field: String,
    /// Value on the server (JSON).
    pub existing: String,
    /// Value wanted (JSON).
    pub desired: String,
}

/// One line of the apply report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// `stream AX_DELAYED` or `consumer AX_READY_HIGH/ax_default_high`.
    pub object: String,
    /// What happened.
    pub outcome: Outcome,
    /// Fields that differed (changed by `Updated`, left by `Kept`).
    pub differences: Vec<Difference>,
}

/// Whether existing objects that differ are changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Apply,
    Ensure,
}

const STREAM_FIXED: [&str; 3] = ["retention", "storage", "name"];
const CONSUMER_FIXED: [&str; 4] = [
    "durable_name",
    "filter_subject",
    "ack_policy",
    "deliver_policy",
];

/// The stream configs with `topology` applied.
pub fn stream_configs(topology: &Topology) -> Result<Vec<stream::Config>, StreamsError> {
    STREAM_FILES
        .iter()
        .filter(|(file, _)| topology.task_events || !is_optional(file))
        .map(|(file, text)| {
            let mut config: stream::Config =
                serde_json::from_str(text).map_err(|source| StreamsError::Definition {
                    file: file.to_string(),
                    source,
                })?;
            config.num_replicas = topology.replicas;
            for p in Priority::ALL {
                if config.name == p.ready_stream() {
                    config.max_messages_per_subject = topology.capacity[p.index()];
                }
            }
            if config.name == names::DELAYED_STREAM {
                config.max_messages = topology.max_delayed;
            }
            // KV_AX_LIMIT_SLOTS keeps its own max_age (an hour): each slot expires after
            // its queue's ack wait by a per-message TTL (`limits::expiry`).
            Ok(config)
        })
        .collect()
}

/// The ready consumer config of one queue and priority.
pub fn consumer_config(
    topology: &Topology,
    queue: &str,
    priority: Priority,
) -> Result<consumer::pull::Config, StreamsError> {
    if !names::valid_queue(queue) {
        return Err(StreamsError::InvalidQueue(queue.to_string()));
    }
    let text = READY_CONSUMER_TEMPLATE
        .replace("{queue}", queue)
        .replace("{priority}", priority.as_str());
    let mut config: consumer::pull::Config =
        serde_json::from_str(&text).map_err(|source| StreamsError::Definition {
            file: "consumers/ready.json".into(),
            source,
        })?;
    config.ack_wait = topology.ack_wait;
    config.max_ack_pending = topology.max_ack_pending;
    Ok(config)
}

/// Fields of `desired` whose values differ on the server (`existing`), ignoring fields the
/// definition does not set.
fn differences(desired: &Value, existing: &Value) -> Vec<Difference> {
    let (Some(desired), Some(existing)) = (desired.as_object(), existing.as_object()) else {
        return Vec::new();
    };
    desired
        .iter()
        .filter(|(k, v)| existing.get(*k).unwrap_or(&Value::Null) != *v)
        .map(|(k, v)| {
            let had = existing.get(k).cloned().unwrap_or(Value::Null);
            Difference {
                field: k.clone(),
                existing: had.to_string(),
                desired: v.to_string(),
            }
        })
        .collect()
}

fn check_fixed(object: &str, fixed: &[&str], diffs: &[Difference]) -> Result<(), StreamsError> {
    match diffs.iter().find(|d| fixed.contains(&d.field.as_str())) {
        Some(d) => Err(StreamsError::Incompatible {
            object: object.to_string(),
            field: d.field.clone(),
            existing: d.existing.clone(),
            desired: d.desired.clone(),
        }),
        None => Ok(()),
    }
}

/// Stream settings this version of ax needs to run: [`ensure`] turns them on in an existing
/// stream (leaving its other settings as they are), so an upgraded server works without
/// `ax streams apply`. `allow_atomic`: atomic batch publish (ADR-50), which nothing else
/// notices.
const STREAM_REQUIRED: [&str; 1] = ["allow_atomic"];

/// Turns on the [`STREAM_REQUIRED`] settings among `diffs` in `existing`; answers them.
async fn turn_on_required(
    js: &jetstream::Context,
    object: &str,
    desired: &stream::Config,
    mut existing: stream::Config,
    diffs: &[Difference],
) -> Result<Vec<Difference>, StreamsError> {
    let required: Vec<Difference> = diffs
        .iter()
        .filter(|d| STREAM_REQUIRED.contains(&d.field.as_str()) && d.desired == "true")
        .cloned()
        .collect();
    if required.is_empty() {
        return Ok(required);
    }
    existing.allow_atomic_publish = desired.allow_atomic_publish;
    js.update_stream(&existing)
        .await
        .map_err(|e| broker(object, e))?;
    Ok(required)
}

/// What to do with an existing object whose fields differ.
fn settle(mode: Mode, diffs: &[Difference]) -> Outcome {
    match (diffs.is_empty(), mode) {
        (true, _) => Outcome::Unchanged,
        (false, Mode::Apply) => Outcome::Updated,
        (false, Mode::Ensure) => Outcome::Kept,
    }
}

pub(crate) fn is_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(js)
        if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
}

fn broker(object: &str, e: impl Into<async_nats::Error>) -> StreamsError {
    StreamsError::Broker {
        object: object.to_string(),
        source: e.into(),
    }
}

/// Creates or updates every stream, and the ready consumers of `queues` (`ax streams
/// apply`).
pub async fn apply(
    js: &jetstream::Context,
    topology: &Topology,
    queues: &[String],
) -> Result<Vec<Applied>, StreamsError> {
    reconcile(js, topology, queues, Mode::Apply).await
}

/// Creates every missing stream and ready consumer of `queues`; leaves existing ones as
/// they are, reporting fields that differ as [`Outcome::Kept`] (what a server does at
/// start).
pub async fn ensure(
    js: &jetstream::Context,
    topology: &Topology,
    queues: &[String],
) -> Result<Vec<Applied>, StreamsError> {
    reconcile(js, topology, queues, Mode::Ensure).await
}

async fn reconcile(
    js: &jetstream::Context,
    topology: &Topology,
    queues: &[String],
    mode: Mode,
) -> Result<Vec<Applied>, StreamsError> {
    let mut report = Vec::new();
    for config in stream_configs(topology)? {
        let object = format!("stream {}", config.name);
        let desired = serde_json::to_value(&config).expect("config serializes");
        let (outcome, differences) = match js.get_stream(&config.name).await {
            Ok(mut existing) => {
                let info = existing.info().await.map_err(|e| broker(&object, e))?;
                let had = serde_json::to_value(&info.config).expect("config serializes");
                let mut diffs = differences(&desired, &had);
                if mode == Mode::Ensure {
                    let required =
                        turn_on_required(js, &object, &config, info.config.clone(), &diffs).await?;
                    if !required.is_empty() {
                        diffs.retain(|d| !required.contains(d));
                        report.push(Applied {
                            object: object.clone(),
                            outcome: Outcome::Updated,
                            differences: required,
                        });
                        if diffs.is_empty() {
                            continue;
                        }
                    }
                }
                let outcome = settle(mode, &diffs);
                if outcome == Outcome::Updated {
                    check_fixed(&object, &STREAM_FIXED, &diffs)?;
                    js.update_stream(&config)
                        .await
                        .map_err(|e| broker(&object, e))?;
                }
                (outcome, diffs)
            }
            Err(e) if is_not_found(&e) => {
                js.create_stream(config.clone())
                    .await
                    .map_err(|e| broker(&object, e))?;
                (Outcome::Created, Vec::new())
            }
            Err(e) => return Err(broker(&object, e)),
        };
        report.push(Applied {
            object,
            outcome,
            differences,
        });
    }
    for queue in queues {
        for p in Priority::ALL {
            report.push(reconcile_consumer(js, topology, queue, p, mode).await?);
        }
    }
    Ok(report)
}

/// What is missing for a server or worker of `queues` to run: streams, buckets and ready
/// consumers, by name; empty when everything is there.
pub async fn missing(
    js: &jetstream::Context,
    queues: &[String],
) -> Result<Vec<String>, StreamsError> {
    let mut out = Vec::new();
    for (file, _) in STREAM_FILES.iter().filter(|(f, _)| !is_optional(f)) {
        let name = file.trim_end_matches(".json");
        match js.get_stream(name).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => out.push(format!("stream {name}")),
            Err(e) => return Err(broker(&format!("stream {name}"), e)),
        }
    }
    for queue in queues {
        for p in Priority::ALL {
            let stream = p.ready_stream();
            let name = names::consumer_name(queue, p);
            let object = format!("consumer {stream}/{name}");
            let Ok(stream) = js.get_stream(&stream).await else {
                continue; // reported above
            };
            match stream.consumer_info(&name).await {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        jetstream::context::ConsumerInfoErrorKind::NotFound
                            | jetstream::context::ConsumerInfoErrorKind::StreamNotFound
                    ) =>
                {
                    out.push(object)
                }
                Err(e) => return Err(broker(&object, e)),
            }
        }
    }
    Ok(out)
}

async fn reconcile_consumer(
    js: &jetstream::Context,
    topology: &Topology,
    queue: &str,
    priority: Priority,
    mode: Mode,
) -> Result<Applied, StreamsError> {
    let config = consumer_config(topology, queue, priority)?;
    let stream_name = priority.ready_stream();
    let name = config.durable_name.clone().unwrap_or_default();
    let object = format!("consumer {stream_name}/{name}");
    let stream = js
        .get_stream(&stream_name)
        .await
        .map_err(|e| broker(&object, e))?;
    let desired = serde_json::to_value(&config).expect("config serializes");
    let (outcome, differences) = match stream.consumer_info(&name).await {
        Ok(info) => {
            let had = serde_json::to_value(&info.config).expect("config serializes");
            let diffs = differences(&desired, &had);
            let outcome = settle(mode, &diffs);
            if outcome == Outcome::Updated {
                check_fixed(&object, &CONSUMER_FIXED, &diffs)?;
                stream
                    .update_consumer(config)
                    .await
                    .map_err(|e| broker(&object, e))?;
            }
            (outcome, diffs)
        }
        Err(e) if e.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound => {
            stream
                .create_consumer(config)
                .await
                .map_err(|e| broker(&object, e))?;
            (Outcome::Created, Vec::new())
        }
        Err(e) => return Err(broker(&object, e)),
    };
    Ok(Applied {
        object,
        outcome,
        differences,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn definitions_parse_and_take_overrides() {
        let topology = Topology {
            capacity: [1, 2, 3],
            replicas: 3,
            task_events: true,
            ..Topology::default()
        };
        let configs = stream_configs(&topology).unwrap();
        assert_eq!(configs.len(), STREAM_FILES.len());
        let without = stream_configs(&Topology::default()).unwrap();
        assert!(without.iter().all(|c| c.name != "AX_TASK_EVENTS"));
        assert_eq!(without.len(), STREAM_FILES.len() - 1);
        let high = configs.iter().find(|c| c.name == "AX_READY_HIGH").unwrap();
        assert_eq!(high.max_messages_per_subject, 1);
        assert!(high.discard_new_per_subject);
        assert!(configs.iter().all(|c| c.num_replicas == 3));
        let c = consumer_config(&topology, "emails", Priority::Low).unwrap();
        assert_eq!(c.durable_name.as_deref(), Some("ax_emails_low"));
        assert_eq!(c.filter_subject, "ax.ready.emails.low");
        assert!(matches!(
            consumer_config(&topology, "a.b", Priority::Low),
            Err(StreamsError::InvalidQueue(_))
        ));
    }

    #[test]
    fn file_defaults_match_topology_defaults() {
        let from_files: Vec<stream::Config> = STREAM_FILES
            .iter()
            .map(|(_, t)| serde_json::from_str(t).unwrap())
            .collect();
        let all = Topology {
            task_events: true,
            ..Topology::default()
        };
        assert_eq!(from_files, stream_configs(&all).unwrap());
    }
}
