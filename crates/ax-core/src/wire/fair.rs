//! Fair shares between tenants of a queue: the definition the fair dispatcher follows
//! (`AX_LIMITS` key `<queue>.=fair`, docs/PROTOCOL.md §7 "Fair shares") and what it
//! reports of each tenant. Re-exported by ax-sdk as `limits::fair`.

use crate::wire::protocol::WireError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most tenants a definition may weigh by name.
pub const MAX_WEIGHTS: usize = 10_000;
/// The largest weight.
pub const MAX_WEIGHT: u32 = 1_000;
/// The default of [`FairDef::depth`]: a tenant that becomes busy waits behind about this
/// many tasks, and a smaller depth than the workers' slots can leave them idle between
/// release rounds (docs/PERFORMANCE.md, "Fair shares").
pub const DEFAULT_DEPTH: u32 = 64;

/// The `AX_LIMITS` key of a queue's fair-share definition: `<queue>.=fair`.
pub fn fair_key(queue: &str) -> String {
    format!("{queue}.=fair")
}

/// How a queue's tasks with a fair key are shared between tenants. Without a definition
/// every tenant weighs 1 and the depth is [`DEFAULT_DEPTH`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FairDef {
    /// The queue.
    pub queue: String,
    /// Weights of named tenants (1..=1000): a tenant with a backlog is released this many
    /// tasks for each one a tenant of weight 1 is.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: BTreeMap<String, u32>,
    /// The weight of every other tenant (default 1).
    #[serde(default = "one")]
    pub default_weight: u32,
    /// Most tasks of the queue and priority waiting on the ready subject undelivered; the
    /// rest wait in `AX_FAIR` for their turn (default 256). Smaller: a newly busy tenant
    /// waits behind fewer tasks; larger: idle workers are refilled less often.
    #[serde(default = "default_depth")]
    pub depth: u32,
}

fn one() -> u32 {
    1
}

fn default_depth() -> u32 {
    DEFAULT_DEPTH
}

impl FairDef {
    /// The definition a queue without one is dispatched by.
    pub fn default_for(queue: &str) -> FairDef {
        FairDef {
            queue: queue.to_string(),
            weights: BTreeMap::new(),
            default_weight: 1,
            depth: DEFAULT_DEPTH,
        }
    }

    /// The weight of `tenant`.
    pub fn weight(&self, tenant: &str) -> u32 {
        self.weights
            .get(tenant)
            .copied()
            .unwrap_or(self.default_weight)
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), WireError> {
        if !crate::wire::names::valid_queue(&self.queue) {
            return Err(WireError::field("queue", "not a queue name"));
        }
        let weight_ok = |w: u32| (1..=MAX_WEIGHT).contains(&w);
        if !weight_ok(self.default_weight) {
            return Err(WireError::field("default_weight", "must be 1..=1000"));
        }
        if self.weights.len() > MAX_WEIGHTS {
            return Err(WireError::field("weights", "at most 10000 tenants"));
        }
        for (tenant, w) in &self.weights {
            if !crate::wire::task::valid_fair_key(tenant) {
                return Err(WireError::field(
                    "weights",
                    format!("{tenant:?} is not a fair key (1..=64 of A-Z a-z 0-9 _ - . : @)"),
                ));
            }
            if !weight_ok(*w) {
                return Err(WireError::field(
                    "weights",
                    format!("{tenant:?}: a weight must be 1..=1000"),
                ));
            }
        }
        if !(1..=100_000).contains(&self.depth) {
            return Err(WireError::field("depth", "must be 1..=100000"));
        }
        Ok(())
    }
}

/// Names the queue of `ax.limit.fair_get` (`{"queue"}`), or none: every queue's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FairQueue {
    /// The queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

/// The `AX_LIMIT_STATE` key of the fair dispatcher's report of every queue (a map of
/// queue to [`FairStatus`]).
pub const ALL_REPORTS_KEY: &str = "=fair";

/// What the fair dispatcher reports of one tenant (`ax.limit.fair_get`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantStatus {
    /// The fair key.
    pub key: String,
    /// Its priority lane (`high`, `normal`, `low`).
    pub priority: String,
    /// Tasks held in `AX_FAIR`, waiting for their turn.
    pub held: u64,
    /// Tasks released to the ready subject since the previous report (about a second).
    pub released: u64,
    /// Its weight now.
    pub weight: u32,
}

/// The fair dispatcher's report of a queue, written every second while it has tenants
/// (`AX_LIMIT_STATE` key `<queue>.=fair`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FairStatus {
    /// The server that leads the dispatcher.
    pub leader: String,
    /// When it wrote this, ms since the epoch.
    pub at_ms: u64,
    /// Its tenants with tasks held or released, by priority then key.
    pub tenants: Vec<TenantStatus>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_checks() {
        let def: FairDef = serde_json::from_str(r#"{"queue":"q"}"#).unwrap();
        assert_eq!(def, FairDef::default_for("q"));
        assert_eq!(def.weight("anyone"), 1);
        let mut def: FairDef =
            serde_json::from_str(r#"{"queue":"q","weights":{"big":3},"default_weight":2}"#)
                .unwrap();
        assert_eq!((def.weight("big"), def.weight("other")), (3, 2));
        def.validate().unwrap();
        def.weights.insert("bad key".into(), 1);
        assert_eq!(
            def.validate().unwrap_err().field.as_deref(),
            Some("weights")
        );
        def.weights.clear();
        def.weights.insert("t".into(), 0);
        assert_eq!(
            def.validate().unwrap_err().field.as_deref(),
            Some("weights")
        );
        def.weights.clear();
        def.depth = 0;
        assert_eq!(def.validate().unwrap_err().field.as_deref(), Some("depth"));
        let unknown = serde_json::from_str::<FairDef>(r#"{"queue":"q","weight":{}}"#);
        assert!(unknown.is_err());
    }
}
