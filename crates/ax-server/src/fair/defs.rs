//! The fair-share definitions of the queues with held tasks (`AX_LIMITS` keys
//! `<queue>.=fair`), read again every second.

use async_nats::jetstream::kv;
use ax_core::names;
use ax_sdk::limits::fair::{fair_key, FairDef};
use std::collections::HashMap;
use tracing::{debug, warn};

/// A definition with its weights keyed by the hex of the tenant's key (how lanes name
/// tenants).
#[derive(Debug)]
pub(crate) struct Def {
    pub(crate) def: FairDef,
    by_hex: HashMap<String, u32>,
}

impl Def {
    /// The weight of the tenant whose key's hex is `hex`.
    pub(crate) fn weight_of_hex(&self, hex: &str) -> u32 {
        self.by_hex
            .get(hex)
            .copied()
            .unwrap_or(self.def.default_weight)
    }
}

impl From<FairDef> for Def {
    fn from(def: FairDef) -> Def {
        let by_hex = def
            .weights
            .iter()
            .map(|(k, w)| (names::hex_token(k), *w))
            .collect();
        Def { def, by_hex }
    }
}

/// The definitions read so far, by queue.
#[derive(Debug, Default)]
pub(crate) struct Defs {
    defs: HashMap<String, std::sync::Arc<Def>>,
}

impl Defs {
    /// The definition of `queue`: the one read last, else the defaults.
    pub(crate) fn get(&self, queue: &str) -> std::sync::Arc<Def> {
        match self.defs.get(queue) {
            Some(def) => def.clone(),
            None => std::sync::Arc::new(Def::from(FairDef::default_for(queue))),
        }
    }

    /// True if `queue`'s definition was read.
    pub(crate) fn known(&self, queue: &str) -> bool {
        self.defs.contains_key(queue)
    }

    /// Reads the definitions of `queues` again; one not read keeps the last.
    pub(crate) async fn refresh(&mut self, limits: &kv::Store, queues: Vec<String>) {
        for queue in queues {
            let def = match limits.get(fair_key(&queue)).await {
                Ok(Some(v)) => match serde_json::from_slice::<FairDef>(&v) {
                    Ok(def) if def.validate().is_ok() => def,
                    _ => {
                        warn!(%queue, "stored fair-share definition not valid: defaults apply; put it again");
                        FairDef::default_for(&queue)
                    }
                },
                Ok(None) => FairDef::default_for(&queue),
                Err(e) => {
                    debug!(%queue, cause = %e, "fair-share definition not read; the last one stands");
                    continue;
                }
            };
            self.defs.insert(queue, std::sync::Arc::new(Def::from(def)));
        }
    }
}
