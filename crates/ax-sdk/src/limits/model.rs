//! Limit definitions (`AX_LIMITS`, key `<queue>.<name>`), checked before they are stored.

use crate::error::WireError;
use crate::names;
use serde::{Deserialize, Serialize};

/// Most tasks per second a rate may allow.
pub const MAX_RATE: f64 = 100_000.0;
/// Fewest tasks per second a rate may allow: one per 10⁶ s (11.6 days). Slower rates
/// would need intervals and waits the arithmetic and the broker's delays do not hold.
pub const MIN_RATE: f64 = 0.000_001;
/// Largest burst (with the slowest rate the bucket's TAT then stays within `u64` µs).
pub const MAX_BURST: u32 = 1_000_000;
/// Most queues one shared limit spans.
pub const MAX_SHARED_QUEUES: usize = 16;
/// The first token of a shared limit's bucket keys (`=` is never part of a queue name).
pub const SHARED_PREFIX: &str = "=shared";
/// Largest concurrency cap (each slot is a KV key; taking one tries free slots in turn).
pub const MAX_CONCURRENCY: u32 = 1_000;

/// A limit on the tasks of one queue: all of them, those of one task name, or — with
/// `per_key` — each `limit_key` value separately (tasks without a key are not limited by
/// a per-key limit). A rate counts attempt *starts* (retries included) per second, with
/// `burst` starts allowed at once; a concurrency cap counts attempts *running* at once
/// (each holds a slot from its start to its end; a slot whose holder stops heartbeating is
/// freed after the queue's ack wait).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitDef {
    /// Name, unique in its queue: 1..=64 of `A-Z a-z 0-9 _ -`.
    pub name: String,
    /// The queue it limits. In a put of a shared limit it may be left out (the first of
    /// `queues`).
    #[serde(default)]
    pub queue: String,
    /// A limit **shared** by several queues (2..=16, `queue` among them): the tasks of all
    /// of them draw from one rate bucket and one set of slots — one partner API called
    /// from three queues, say. The server stores a copy under each queue (each queue's
    /// workers follow their own); its name is unique among shared limits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queues: Vec<String>,
    /// Only tasks of this name (default: every task of the queue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    /// One limit per `limit_key` value instead of one for all matching tasks.
    #[serde(default)]
    pub per_key: bool,
    /// Only tasks with this `limit_key` (one hot customer, say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Starts per second: 0.000001 (one per 11.6 days) to 100,000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// Starts allowed at once above the rate (default: the rate rounded up, at least 1;
    /// at most 1,000,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Attempts running at once (1 = a singleton; at most 1,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    /// The rate follows reported pressure between `min` and `rate` (only with a rate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<Adaptive>,
    /// What happens to tasks over the rate: [`Excess::Throttle`] (default: they wait for
    /// their turn) or [`Excess::Drop`] (refused at submit).
    #[serde(default, skip_serializing_if = "is_throttle")]
    pub excess: Excess,
}

/// What a rate limit does with the tasks over it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Excess {
    /// Queue them: a worker takes the token before it starts a task, and a task over the
    /// rate waits for one (the default).
    #[default]
    Throttle,
    /// Refuse them: an ax server takes the token when the task is submitted, and a submit
    /// over the rate is refused (`rate_limited`, nothing stored); workers do not take the
    /// token again. Only with a rate, not adaptive; the limit's concurrency (if any) is
    /// still applied by workers.
    Drop,
}

fn is_throttle(excess: &Excess) -> bool {
    *excess == Excess::Throttle
}

/// How an adaptive rate follows pressure (see [`super::adaptive`]): lowered by the factor
/// `decrease` when a handler fails with one of the error classes `on` (once per overload:
/// not again for attempts started before the lowering), raised by `increase` starts per
/// second each second while calm;
/// never below `min` nor above the limit's `rate`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Adaptive {
    /// The lowest rate (starts per second), at most the limit's `rate`.
    pub min: f64,
    /// Starts per second added back per calm second (default: a twentieth of `rate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub increase: Option<f64>,
    /// The factor a report of pressure multiplies the rate by, 0.05–0.95 (default 0.7).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decrease: Option<f64>,
    /// Error classes that report pressure (default: `["pressure"]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on: Vec<String>,
}

/// The error class a handler fails with to report pressure to an adaptive limit, unless
/// the limit names its own (`adaptive.on`).
pub const PRESSURE_CLASS: &str = "pressure";

impl Adaptive {
    /// Starts per second added back per calm second, for a limit of `rate`.
    pub fn increase(&self, rate: f64) -> f64 {
        self.increase.unwrap_or(rate / 20.0)
    }

    /// The factor applied on pressure.
    pub fn decrease(&self) -> f64 {
        self.decrease.unwrap_or(0.7)
    }

    /// True if a failure of `class` reports pressure.
    pub fn reports(&self, class: &str) -> bool {
        if self.on.is_empty() {
            class == PRESSURE_CLASS
        } else {
            self.on.iter().any(|c| c == class)
        }
    }

    fn validate(&self, rate: f64) -> Result<(), WireError> {
        if check_rate(self.min).is_err() || self.min > rate {
            return Err(WireError::field(
                "adaptive.min",
                "must be a rate from 0.000001 up to the limit's rate",
            ));
        }
        if let Some(i) = self.increase {
            if !(MIN_RATE..=MAX_RATE).contains(&i) {
                return Err(WireError::field(
                    "adaptive.increase",
                    "must be starts per second from 0.000001 to 100000",
                ));
            }
        }
        if let Some(d) = self.decrease {
            if !(0.05..=0.95).contains(&d) {
                return Err(WireError::field(
                    "adaptive.decrease",
                    "must be a factor from 0.05 to 0.95",
                ));
            }
        }
        if self.on.len() > 16 || self.on.iter().any(|c| !crate::task::valid_class(c)) {
            return Err(WireError::field(
                "adaptive.on",
                "at most 16 error classes (1..=128 of A-Z a-z 0-9 _ . : -)",
            ));
        }
        Ok(())
    }
}

impl LimitDef {
    /// Its key in `AX_LIMITS`.
    pub fn key(&self) -> String {
        format!("{}.{}", self.queue, self.name)
    }

    /// The burst in force.
    pub fn burst(&self) -> u32 {
        self.burst
            .unwrap_or_else(|| self.rate.map_or(1, |r| r.ceil().max(1.0) as u32))
    }

    /// True if a worker takes this limit's rate tokens: a rate whose excess is throttled
    /// (a dropping one's token was taken at submit).
    pub(crate) fn throttles(&self) -> bool {
        self.rate.is_some() && self.excess == Excess::Throttle
    }

    /// True if the limit applies to a task of `name` with `limit_key`.
    pub fn applies(&self, name: &str, limit_key: Option<&str>) -> bool {
        self.task.as_deref().is_none_or(|t| t == name)
            && (!self.per_key || limit_key.is_some())
            && self.key.as_deref().is_none_or(|k| Some(k) == limit_key)
    }

    /// Checks every field; the error names it.
    pub fn validate(&self) -> Result<(), WireError> {
        if !names::valid_token(&self.name, 64) {
            return Err(WireError::field(
                "name",
                "must be 1..=64 of A-Z a-z 0-9 _ -",
            ));
        }
        if !names::valid_queue(&self.queue) {
            return Err(WireError::field("queue", "a valid queue is required"));
        }
        if !self.queues.is_empty() {
            let mut seen = std::collections::BTreeSet::new();
            let valid = (2..=MAX_SHARED_QUEUES).contains(&self.queues.len())
                && self
                    .queues
                    .iter()
                    .all(|q| names::valid_queue(q) && seen.insert(q.as_str()))
                && seen.contains(self.queue.as_str());
            if !valid {
                return Err(WireError::field(
                    "queues",
                    "2..=16 distinct valid queues, the limit's queue among them",
                ));
            }
        }
        if let Some(task) = &self.task {
            if !crate::task::valid_class(task) || task.len() > 128 {
                return Err(WireError::field(
                    "task",
                    "a task name: 1..=128 of A-Z a-z 0-9 _ . : -",
                ));
            }
        }
        if let Some(key) = &self.key {
            if self.per_key || !crate::task::valid_limit_key(key) {
                return Err(WireError::field(
                    "key",
                    "a limit key (1..=128 of A-Z a-z 0-9 _ - . : @), not with per_key",
                ));
            }
        }
        if let Some(r) = self.rate {
            check_rate(r).map_err(|e| WireError::field("rate", e))?;
        }
        if let Some(b) = self.burst {
            if self.rate.is_none() || !(1..=MAX_BURST).contains(&b) {
                return Err(WireError::field(
                    "burst",
                    "must be 1..=1000000, and only with a rate",
                ));
            }
        }
        match (&self.adaptive, self.rate) {
            (Some(_), None) => {
                return Err(WireError::field("adaptive", "only with a rate"));
            }
            (Some(a), Some(rate)) => a.validate(rate)?,
            _ => {}
        }
        if self.excess == Excess::Drop && (self.rate.is_none() || self.adaptive.is_some()) {
            return Err(WireError::field(
                "excess",
                "drop needs a rate that is not adaptive (a submit over it is refused)",
            ));
        }
        match self.concurrency {
            Some(c) if c == 0 || c > MAX_CONCURRENCY => {
                return Err(WireError::field("concurrency", "must be 1..=1000"))
            }
            _ => {}
        }
        if self.rate.is_none() && self.concurrency.is_none() {
            return Err(WireError::field(
                "rate",
                "give a rate, a concurrency, or both",
            ));
        }
        Ok(())
    }
}

/// Checks a rate (starts per second): a finite number from [`MIN_RATE`] to [`MAX_RATE`].
/// The error says the range (the CLI shows it under the option's name).
pub fn check_rate(rate: f64) -> Result<f64, String> {
    if (MIN_RATE..=MAX_RATE).contains(&rate) {
        Ok(rate)
    } else {
        Err(
            "must be a number of starts per second from 0.000001 (one per 11.6 days) to 100000"
                .to_string(),
        )
    }
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

/// What every bucket key of a limit starts with: `<queue>.<limit>`, or for a limit shared
/// by several queues `=shared.<limit>` (one bucket for all of them).
pub fn bucket_prefix(def: &LimitDef) -> String {
    match def.queues.is_empty() {
        true => format!("{}.{}", def.queue, def.name),
        false => format!("{SHARED_PREFIX}.{}", def.name),
    }
}

/// The KV key of a limit's bucket for a task: `<prefix>.all` or
/// `<prefix>.k<hex of the limit key>` ([`bucket_prefix`]).
pub fn bucket_key(def: &LimitDef, limit_key: Option<&str>) -> String {
    match (def.per_key, limit_key) {
        (true, Some(k)) => format!("{}.k{}", bucket_prefix(def), hex(k)),
        _ => format!("{}.all", bucket_prefix(def)),
    }
    // (A `key` limit has one bucket: `.all`, as only tasks of that key reach it.)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn def(v: serde_json::Value) -> LimitDef {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn limits_are_checked_by_field_and_match_tasks() {
        let ok = def(json!({"name": "c", "queue": "q", "per_key": true, "rate": 2.5}));
        assert!(ok.validate().is_ok());
        assert_eq!(ok.burst(), 3);
        assert!(ok.applies("any", Some("k")) && !ok.applies("any", None));
        let named = def(json!({"name": "s", "queue": "q", "task": "send", "concurrency": 1}));
        assert!(named.applies("send", None) && !named.applies("other", None));
        let one = def(json!({"name": "h", "queue": "q", "key": "hot", "rate": 20.0}));
        assert!(one.applies("x", Some("hot")) && !one.applies("x", Some("cold")));
        let field = |v| def(v).validate().unwrap_err().field.unwrap();
        assert_eq!(field(json!({"name": "x", "queue": "q"})), "rate");
        assert_eq!(
            field(json!({"name": "x", "queue": "q", "rate": 0.0})),
            "rate"
        );
        assert_eq!(
            field(json!({"name": "x", "queue": "q", "concurrency": 0})),
            "concurrency"
        );
        assert_eq!(
            field(json!({"name": "x", "queue": "q", "concurrency": 2, "burst": 3})),
            "burst"
        );
        assert_eq!(
            field(json!({"name": "x y", "queue": "q", "rate": 1.0})),
            "name"
        );
        let adaptive = |a: serde_json::Value| {
            def(json!({"name": "x", "queue": "q", "rate": 100.0, "adaptive": a}))
                .validate()
                .map_err(|e| e.field.unwrap())
        };
        assert_eq!(adaptive(json!({"min": 1.0})), Ok(()));
        assert_eq!(adaptive(json!({"min": 101.0})), Err("adaptive.min".into()));
        assert_eq!(adaptive(json!({"min": 0.0})), Err("adaptive.min".into()));
        assert_eq!(
            adaptive(json!({"min": 1.0, "decrease": 1.0})),
            Err("adaptive.decrease".into())
        );
        assert_eq!(
            adaptive(json!({"min": 1.0, "increase": -1.0})),
            Err("adaptive.increase".into())
        );
        assert_eq!(
            adaptive(json!({"min": 1.0, "on": ["a b"]})),
            Err("adaptive.on".into())
        );
        assert_eq!(
            field(json!({"name": "x", "queue": "q", "concurrency": 1, "adaptive": {"min": 1.0}})),
            "adaptive"
        );
    }

    #[test]
    fn a_shared_limit_names_its_queues_and_has_one_bucket_for_all() {
        let shared = |queue: &str, queues: serde_json::Value| {
            def(json!({"name": "partner", "queue": queue, "queues": queues, "rate": 5.0}))
        };
        let a = shared("a", json!(["a", "b", "c"]));
        assert_eq!(a.validate(), Ok(()));
        let c = shared("c", json!(["a", "b", "c"]));
        assert_eq!(bucket_key(&a, None), "=shared.partner.all");
        assert_eq!(bucket_key(&a, None), bucket_key(&c, None), "one bucket");
        let own = def(json!({"name": "partner", "queue": "a", "rate": 5.0}));
        assert_eq!(bucket_key(&own, None), "a.partner.all");
        for bad in [
            shared("a", json!(["a"])),
            shared("a", json!(["b", "c"])),
            shared("a", json!(["a", "a"])),
            shared("a", json!(["a", "b c"])),
            shared(
                "a",
                json!((0..17)
                    .map(|i| format!("q{i}"))
                    .chain(["a".into()])
                    .collect::<Vec<_>>()),
            ),
        ] {
            assert_eq!(
                bad.validate().unwrap_err().field.as_deref(),
                Some("queues"),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn rates_and_bursts_outside_what_the_arithmetic_holds_are_refused() {
        let check = |rate: f64, burst: Option<u32>| {
            LimitDef {
                name: "x".into(),
                queue: "q".into(),
                queues: Vec::new(),
                task: None,
                per_key: false,
                key: None,
                rate: Some(rate),
                burst,
                concurrency: None,
                adaptive: None,
                excess: Excess::Throttle,
            }
            .validate()
            .map_err(|e| e.field.unwrap())
        };
        // 1e-20 and 1e-11 were accepted and broke the limit.
        for bad in [
            1e-20,
            1e-11,
            9.9e-7,
            0.0,
            -5.0,
            -0.0,
            100_000.5,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ] {
            assert_eq!(check(bad, None), Err("rate".into()), "{bad}");
        }
        for good in [MIN_RATE, 1.5e-6, 0.5, 1.0, 1000.0, MAX_RATE] {
            assert_eq!(check(good, None), Ok(()), "{good}");
        }
        assert_eq!(check(1.0, Some(MAX_BURST)), Ok(()));
        assert_eq!(check(1.0, Some(MAX_BURST + 1)), Err("burst".into()));
        assert_eq!(check(1.0, Some(u32::MAX)), Err("burst".into()));
        let message = check_rate(1e-20).unwrap_err();
        assert!(
            message.contains("0.000001") && message.contains("100000"),
            "{message}"
        );
    }
}
