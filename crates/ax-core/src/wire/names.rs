//! Names on the wire: priorities, queue names, subjects, stream, bucket and consumer names.
//!
//! Every subject ax uses is built here, so `docs/PROTOCOL.md` has one place to match.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Stream holding ready tasks of one priority (`AX_READY_HIGH`, ...).
pub const READY_STREAM_PREFIX: &str = "AX_READY_";
/// Stream holding delayed tasks until they are due.
pub const DELAYED_STREAM: &str = "AX_DELAYED";
/// Stream holding tasks with a fair key until the fair dispatcher releases them to their
/// ready subject (docs/PROTOCOL.md §7, "Fair shares").
pub const FAIR_STREAM: &str = "AX_FAIR";
/// Stream holding dead-lettered tasks.
pub const DEAD_STREAM: &str = "AX_DEAD";
/// KV bucket with one record per task (its state).
pub const TASKS_BUCKET: &str = "AX_TASKS";
/// KV bucket of task outputs too large for the task record (key `<task id>.<attempt>`).
pub const RESULTS_BUCKET: &str = "AX_RESULTS";
/// KV bucket mapping idempotency keys to task ids.
pub const IDEMPOTENCY_BUCKET: &str = "AX_IDEMPOTENCY";
/// KV bucket of trigger definitions.
pub const TRIGGERS_BUCKET: &str = "AX_TRIGGERS";
/// KV bucket of trigger runtime state.
pub const TRIGGER_STATE_BUCKET: &str = "AX_TRIGGER_STATE";
/// KV bucket of leases (the trigger engine's leader).
pub const LEASES_BUCKET: &str = "AX_LEASES";
/// KV bucket of flow definitions (key = flow name).
pub const FLOWS_BUCKET: &str = "AX_FLOWS";
/// KV bucket of flow runs: key `<run>` is the run, `<run>.<step>` one step's state.
pub const FLOW_RUNS_BUCKET: &str = "AX_FLOW_RUNS";
/// Subject prefix of the flow API: `ax.flow.<op>`.
pub const FLOW_API_PREFIX: &str = "ax.flow.";
/// KV bucket of limit definitions (key `<queue>.<name>`).
pub const LIMITS_BUCKET: &str = "AX_LIMITS";
/// KV bucket of rate-limit state: one GCRA arrival time per bucket.
pub const LIMIT_STATE_BUCKET: &str = "AX_LIMIT_STATE";
/// KV bucket of concurrency slots (one key per held slot; `max_age` = the ack wait).
pub const LIMIT_SLOTS_BUCKET: &str = "AX_LIMIT_SLOTS";
/// Subject prefix of slot releases: `ax.slots.freed.<cap bucket key>` (core NATS, no
/// stream), published by a worker that deleted a concurrency slot so a worker holding a
/// delivery for that cap tries at once.
pub const SLOTS_FREED_PREFIX: &str = "ax.slots.freed";

/// The subject announcing a freed slot of the cap bucket `bucket`
/// (`<queue>.<limit>.all` or `<queue>.<limit>.k<hex>`), or, given a queue, the prefix of
/// every release of that queue's caps.
pub fn slot_freed_subject(bucket: &str) -> String {
    format!("{SLOTS_FREED_PREFIX}.{bucket}")
}

/// Subject prefix of the limits API: `ax.limit.<op>`.
pub const LIMIT_API_PREFIX: &str = "ax.limit.";
/// Subject prefix of the trigger management API: `ax.trigger.<op>`.
pub const TRIGGER_API_PREFIX: &str = "ax.trigger.";
/// KV bucket of alert windows (one key per queue, task name and error class).
pub const ALERTS_BUCKET: &str = "AX_ALERTS";
/// Stream keeping every task-state change (sourced from `KV_AX_TASKS`) for the retention
/// period: the task-event history.
pub const EVENTS_STREAM: &str = "AX_TASK_EVENTS";
/// Stream of events that flows wait for (docs/PROTOCOL.md §6, "Events"): subjects
/// `ax.events.<name>`, published by anyone; kept a week for the waits' lookback.
pub const EVENT_STREAM: &str = "AX_EVENTS";
/// Subject prefix of events: `ax.events.<name>` (`<name>`: 1..=8 dot-separated tokens).
pub const EVENT_PREFIX: &str = "ax.events.";
/// KV bucket of the flows' pending event waits: key = the wait task's id, value an
/// [`crate::event::WaitRegistration`].
pub const WAITS_BUCKET: &str = "AX_WAITS";

/// The subject of event `name`: `ax.events.<name>`.
pub fn event_subject(name: &str) -> String {
    format!("{EVENT_PREFIX}{name}")
}

/// Checks an event name: 1..=8 dot-separated tokens of `A-Z a-z 0-9 _ -`, 200 bytes at
/// most (`order.paid`).
pub fn valid_event_name(name: &str) -> bool {
    name.len() <= 200 && name.split('.').count() <= 8 && name.split('.').all(|t| valid_token(t, 64))
}

/// Subject prefix of the task operations API: `ax.task.<op>` (docs/PROTOCOL.md §8: get,
/// list, events, payload, cancel, retry, replay, cancel_many, run_now, pause, resume,
/// queues, series, purge).
pub const TASK_API_PREFIX: &str = "ax.task.";

/// The subject on which a cancel reaches the workers of `queue`: `ax.cancel.<queue>`.
pub fn cancel_subject(queue: &str) -> String {
    format!("ax.cancel.{queue}")
}

/// The NATS service (micro) name the servers register their request APIs under.
pub const SERVICE_NAME: &str = "ax";
/// Queue group of the servers that keep a task index (they answer its operations).
pub const INDEX_QUEUE_GROUP: &str = "ax-index";
/// Queue group the ax servers' request handlers join.
pub const SERVER_QUEUE_GROUP: &str = "ax";

/// Task priority. Each priority of a queue is its own bounded JetStream subject.
#[derive(
    Debug, Default, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Fetched first.
    High,
    /// The default.
    #[default]
    Normal,
    /// Fetched last, but never starved (see the worker's pick policy).
    Low,
}

impl Priority {
    /// All priorities, highest first.
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Low];

    /// The lowercase wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }

    /// Index into [`Priority::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The ready stream of this priority.
    pub fn ready_stream(self) -> String {
        format!("{READY_STREAM_PREFIX}{}", self.as_str().to_uppercase())
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown priority name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown priority {0:?} (expected high, normal or low)")]
pub struct UnknownPriority(pub String);

impl FromStr for Priority {
    type Err = UnknownPriority;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "high" => Ok(Priority::High),
            "normal" => Ok(Priority::Normal),
            "low" => Ok(Priority::Low),
            other => Err(UnknownPriority(other.to_string())),
        }
    }
}

/// Checks a queue name: 1 to 64 characters of `A-Z a-z 0-9 _ -`.
///
/// Queue names become subject tokens and consumer names, so no dots or wildcards.
pub fn valid_queue(name: &str) -> bool {
    valid_token(name, 64)
}

/// Checks a name usable as one subject token: 1..=max of `A-Z a-z 0-9 _ -`.
pub fn valid_token(name: &str, max: usize) -> bool {
    !name.is_empty()
        && name.len() <= max
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A fresh task id of `queue`: `<queue>.<nuid>`.
///
/// Every task id starts with its queue as the first dot-separated token. The id is also
/// the task's key in `AX_TASKS` (subject `$KV.AX_TASKS.<queue>.<rest>`), so NATS
/// permissions can scope a worker's record reads and writes to its own queues.
pub fn new_task_id(queue: &str) -> String {
    format!("{queue}.{}", nuid::next())
}

/// The queue a task id belongs to, if `id` is a well-formed task id: `<queue>.<rest>` where
/// `rest` is 1..=255 of `A-Z a-z 0-9 _ - . = /`, not starting or ending with a dot.
pub fn queue_of_task_id(id: &str) -> Option<&str> {
    let (queue, rest) = id.split_once('.')?;
    let rest_ok = !rest.is_empty()
        && rest.len() <= 255
        && !rest.starts_with('.')
        && !rest.ends_with('.')
        && !rest.contains("..")
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.=/".contains(&b));
    (valid_queue(queue) && rest_ok).then_some(queue)
}

/// Subject a producer sends a submit request to.
pub fn submit_subject(queue: &str) -> String {
    format!("ax.submit.{queue}")
}

/// Subject of ready tasks of one queue and priority.
pub fn ready_subject(queue: &str, priority: Priority) -> String {
    format!("ax.ready.{queue}.{priority}")
}

/// The lowercase hex of a key's bytes: how a free-form key becomes one subject token.
pub fn hex_token(key: &str) -> String {
    key.bytes().map(|b| format!("{b:02x}")).collect()
}

/// Subject of a task held for its fair share:
/// `ax.fair.<queue>.<priority>.<hex of the fair key>.<task id>`. The tenant's token lets
/// the dispatcher purge what it released per tenant; the id, that a waiting task is found
/// by one direct get (`crate::unclaimed`).
pub fn fair_subject(queue: &str, priority: Priority, fair_key: &str, task_id: &str) -> String {
    format!(
        "ax.fair.{queue}.{priority}.{}.{task_id}",
        hex_token(fair_key)
    )
}

/// The filter of every held task of one tenant (`key_hex`: [`hex_token`] of its key).
pub fn fair_tenant_filter(queue: &str, priority: Priority, key_hex: &str) -> String {
    format!("ax.fair.{queue}.{priority}.{key_hex}.>")
}

/// The parts of a fair subject ([`fair_subject`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FairSubject<'a> {
    /// The queue.
    pub queue: &'a str,
    /// The priority.
    pub priority: Priority,
    /// The hex of the fair key.
    pub key_hex: &'a str,
    /// The task id.
    pub task_id: &'a str,
}

/// Reads a fair subject; `None` for anything else.
pub fn parse_fair_subject(subject: &str) -> Option<FairSubject<'_>> {
    let rest = subject.strip_prefix("ax.fair.")?;
    let mut parts = rest.splitn(4, '.');
    let queue = parts.next()?;
    let priority = parts.next()?.parse().ok()?;
    let key_hex = parts.next()?;
    let task_id = parts.next()?;
    let hex_ok = !key_hex.is_empty()
        && key_hex.len().is_multiple_of(2)
        && key_hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    (valid_queue(queue) && hex_ok && queue_of_task_id(task_id) == Some(queue)).then_some(
        FairSubject {
            queue,
            priority,
            key_hex,
            task_id,
        },
    )
}

/// The key a [`hex_token`] stands for, if it is one.
pub fn unhex_token(hex: &str) -> Option<String> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

/// Delayed tasks are split into this many partitions by a hash of their id; each is owned
/// (indexed and dispatched) by one ax server at a time.
pub const DELAYED_PARTITIONS: u32 = 16;

/// The delayed-task partition of a task id: FNV-1a (32 bit) of its bytes, modulo
/// [`DELAYED_PARTITIONS`].
pub fn delayed_partition(task_id: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in task_id.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h % DELAYED_PARTITIONS
}

/// Subject of a delayed task: `ax.delayed.<queue>.<priority>.<partition>.<task id>`. A
/// subject of its own, so a task without a record is found by one direct get (the last
/// message of its subject) while it waits: [`crate::unclaimed::find_delayed`].
pub fn delayed_subject(queue: &str, priority: Priority, task_id: &str) -> String {
    format!(
        "ax.delayed.{queue}.{priority}.{}.{task_id}",
        delayed_partition(task_id)
    )
}

/// The subject filter of the delayed tasks of one partition stored now (a subject per
/// task). The first of [`delayed_filters`].
pub fn delayed_filter(partition: u32) -> String {
    format!("ax.delayed.*.*.{partition}.>")
}

/// Every subject filter of one delayed-task partition. Messages stored before delayed
/// subjects named their task (`ax.delayed.<queue>.<priority>.<partition>`) stay in their
/// partition, and partition 0 also owns those stored before partitions existed
/// (`ax.delayed.<queue>.<priority>`).
pub fn delayed_filters(partition: u32) -> Vec<String> {
    let mut filters = vec![
        delayed_filter(partition),
        format!("ax.delayed.*.*.{partition}"),
    ];
    if partition == 0 {
        filters.push("ax.delayed.*.*".to_string());
    }
    filters
}

/// Subject of dead-lettered tasks of one queue.
pub fn dead_subject(queue: &str) -> String {
    format!("ax.dead.{queue}")
}

/// Subject of a task's dead letter: `ax.dead.<task id>` (the queue is its first token, so
/// `ax.dead.<queue>.>` holds a queue's dead letters, and a task's latest one is a direct
/// get by subject).
pub fn task_dead_subject(task_id: &str) -> String {
    format!("ax.dead.{task_id}")
}

/// Key of an idempotency key in `AX_IDEMPOTENCY`: `<queue>.<the key's bytes in lowercase
/// hex>` (any key becomes a valid KV key). Submits write it; a purge reads it.
pub fn idempotency_kv_key(queue: &str, key: &str) -> String {
    format!("{queue}.{}", hex_token(key))
}

/// Durable consumer name of one queue and priority.
pub fn consumer_name(queue: &str, priority: Priority) -> String {
    format!("ax_{queue}_{priority}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fair_subjects_read_back_and_refuse_what_is_not_one() {
        let subject = fair_subject("q", Priority::High, "acme:eu", "q.7Xq");
        assert_eq!(subject, "ax.fair.q.high.61636d653a6575.q.7Xq");
        let parts = parse_fair_subject(&subject).unwrap();
        assert_eq!(
            (parts.queue, parts.priority, parts.key_hex, parts.task_id),
            ("q", Priority::High, "61636d653a6575", "q.7Xq")
        );
        assert_eq!(unhex_token(parts.key_hex).as_deref(), Some("acme:eu"));
        assert_eq!(
            fair_tenant_filter("q", Priority::High, parts.key_hex),
            "ax.fair.q.high.61636d653a6575.>"
        );
        for bad in [
            "ax.fair.q.high.61.other.7Xq", // the id is not of the queue
            "ax.fair.q.urgent.61.q.7Xq",
            "ax.fair.q.high.6.q.7Xq", // odd hex
            "ax.fair.q.high.zz.q.7Xq",
            "ax.ready.q.high",
        ] {
            assert_eq!(parse_fair_subject(bad), None, "{bad}");
        }
        assert_eq!(unhex_token("6"), None);
    }

    #[test]
    fn priorities_round_trip() {
        for p in Priority::ALL {
            assert_eq!(p.as_str().parse::<Priority>().unwrap(), p);
        }
        assert_eq!(
            "urgent".parse::<Priority>(),
            Err(UnknownPriority("urgent".into()))
        );
        assert_eq!(Priority::High.ready_stream(), "AX_READY_HIGH");
    }

    #[test]
    fn delayed_partitions_are_stable_and_spread() {
        // Pinned: other implementations must compute the same partition.
        assert_eq!(delayed_partition(""), 0x811c_9dc5 % DELAYED_PARTITIONS);
        assert_eq!(delayed_partition("a"), 0xe40c_292c % DELAYED_PARTITIONS);
        // Ids of the nuid shape from a seeded generator: the same every run. (16,000 ids
        // of one process's nuid sequence spread less evenly, 664–1,655 a partition where
        // 1,000 is even: FNV-1a's low bits follow only the low bits of the characters.)
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(19);
        const B62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
        let mut counts = [0u32; DELAYED_PARTITIONS as usize];
        for _ in 0..16_000 {
            let nuid: String = (0..22)
                .map(|_| B62[rng.random_range(0..B62.len())] as char)
                .collect();
            counts[delayed_partition(&format!("q.{nuid}")) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
        let p = delayed_partition("q.x");
        assert_eq!(
            delayed_subject("q", Priority::Low, "q.x"),
            format!("ax.delayed.q.low.{p}.q.x")
        );
        assert_eq!(
            delayed_filters(0),
            ["ax.delayed.*.*.0.>", "ax.delayed.*.*.0", "ax.delayed.*.*"]
        );
        assert_eq!(
            delayed_filters(5),
            ["ax.delayed.*.*.5.>", "ax.delayed.*.*.5"]
        );
        assert_eq!(delayed_filter(5), "ax.delayed.*.*.5.>");
    }

    #[test]
    fn task_ids_carry_their_queue() {
        let id = new_task_id("emails");
        assert_eq!(queue_of_task_id(&id), Some("emails"));
        assert_eq!(queue_of_task_id("q.tr.nightly.1764400000000.0"), Some("q"));
        for bad in [
            "nodot", "a..b", "q.", "q.x.", "q.a b", "q.a*", "a.b.c..d", ".x",
        ] {
            assert_eq!(queue_of_task_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn queue_names() {
        assert!(valid_queue("emails-eu_1"));
        assert!(!valid_queue(""));
        assert!(!valid_queue("a.b"));
        assert!(!valid_queue("a*"));
        assert!(!valid_queue(&"x".repeat(65)));
    }
}
